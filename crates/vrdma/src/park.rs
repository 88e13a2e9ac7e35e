//! The application's own pages, kept aside ("parked") while a memfd is mapped over their
//! addresses, so that deregistration takes them back instead of allocating, zeroing and later
//! freeing as many fresh pages (and registration frees none).
//!
//! At registration each step of a move ([`crate::mr::share_gap`]) copies the private pages
//! onto the memfd, then `mremap(MREMAP_DONTUNMAP)` moves those pages into the segment's
//! park (a reserved range of the same size) and the memfd is mapped over the addresses they
//! left. The addresses stay mapped throughout (no `SEGV_MAPERR` window): they are
//! `PROT_NONE` from just before the `mremap` to the memfd's mapping, so another thread's load
//! or store takes the move guard's wait ([`crate::move_guard`]) rather than reading the
//! empty pages `MREMAP_DONTUNMAP` leaves. At deregistration ([`crate::unshare`]) the memfd's
//! bytes are copied into the parked pages, which `mremap` moves back over the addresses.
//!
//! Parked memory is memory held twice while registered, so it is capped per process
//! (`VRDMA_MR_PARK_MAX` bytes, default [`DEFAULT_MAX`]; 0 turns parking off); past the cap a
//! move frees the private pages and its move back allocates fresh ones, as without parking.
//! Parks are not inherited by `fork` children (`MADV_DONTFORK`): a child moves back into
//! fresh pages.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Bytes parked at most per process when `VRDMA_MR_PARK_MAX` is not set.
pub(crate) const DEFAULT_MAX: usize = 128 << 20;

/// Bytes reserved by live parks.
static RESERVED: AtomicUsize = AtomicUsize::new(0);

fn max_bytes() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| std::env::var("VRDMA_MR_PARK_MAX").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(DEFAULT_MAX))
}

/// What a page of a park holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Slot {
    /// Reserved (`PROT_NONE`), nothing parked: ours to unmap.
    Empty,
    /// The application's page, parked: ours to unmap or to move back.
    Parked,
    /// Moved back over the application's address: the park's address is no longer ours
    /// (something else may be mapped there since).
    Taken,
}

/// A segment's park: `len` bytes at `addr`, page `i` parking the page at `segment start + i`.
pub(crate) struct Park {
    addr: usize,
    slots: Vec<Slot>,
    /// The process that reserved it (a `fork` child has no park at these addresses).
    pid: u32,
}

impl Park {
    /// Reserves a park for a segment of `len` bytes (page-aligned), or `None` past the cap or
    /// when the reservation fails.
    pub(crate) fn reserve(len: usize) -> Option<Park> {
        let max = max_bytes();
        if len == 0 || RESERVED.fetch_add(len, Ordering::Relaxed) + len > max {
            RESERVED.fetch_sub(len, Ordering::Relaxed);
            return None;
        }
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        // SAFETY: a fresh inaccessible mapping aliasing nothing.
        let addr = unsafe { crate::vm::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, flags, -1, 0) };
        if addr == libc::MAP_FAILED {
            RESERVED.fetch_sub(len, Ordering::Relaxed);
            return None;
        }
        // SAFETY: advice on our own fresh mapping.
        unsafe { libc::madvise(addr, len, libc::MADV_DONTFORK) };
        Some(Park { addr: addr as usize, slots: vec![Slot::Empty; len / vrdma_abi::shm::page_size()], pid: std::process::id() })
    }

    /// Moves the private pages at `[at, at + len)`, page `first` of the segment on, into the
    /// park, leaving the addresses mapped, empty and `PROT_NONE`; the caller maps the memfd
    /// over them next, then calls [`Park::mark_parked`]. False (nothing changed but the
    /// protection, put back to read-only) if the kernel refuses. Makes system calls only and
    /// touches no heap memory: it runs while those pages, which may be the heap's, move.
    pub(crate) fn park_pages(&self, first: usize, at: usize, len: usize) -> bool {
        let to = self.addr + first * vrdma_abi::shm::page_size();
        // SAFETY: `[at, at+len)` is private anonymous memory being moved (read-only under the
        // move guard); `[to, to+len)` is our reservation. Loads and stores to `at` fault and
        // wait from here until the memfd is mapped there.
        let moved = unsafe {
            libc::mprotect(at as *mut libc::c_void, len, libc::PROT_NONE) == 0
                && crate::vm::mremap_dontunmap(at as *mut libc::c_void, len, to as *mut libc::c_void) == to as *mut libc::c_void
        };
        if !moved {
            // SAFETY: back to the move guard's read-only protection of the step.
            unsafe { libc::mprotect(at as *mut libc::c_void, len, libc::PROT_READ) };
        }
        moved
    }

    /// Moves pages parked by [`Park::park_pages`] back over `[at, at + len)` (the memfd could
    /// not be mapped there); the caller then calls [`Park::mark_gone`]. System calls only, as
    /// `park_pages`.
    pub(crate) fn unpark_pages(&self, first: usize, at: usize, len: usize) -> bool {
        let from = self.addr + first * vrdma_abi::shm::page_size();
        // SAFETY: our parked pages, moved back over the addresses they came from.
        unsafe {
            libc::mprotect(from as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE) == 0
                && crate::vm::mremap_fixed(from as *mut libc::c_void, len, at as *mut libc::c_void) == at as *mut libc::c_void
        }
    }

    /// Records that pages `first..first + n` are parked.
    pub(crate) fn mark_parked(&mut self, first: usize, n: usize) {
        self.slots[first..first + n].iter_mut().for_each(|s| *s = Slot::Parked);
    }

    /// Records that pages `first..first + n` left the park (their addresses are not ours).
    pub(crate) fn mark_gone(&mut self, first: usize, n: usize) {
        let page = vrdma_abi::shm::page_size();
        for s in &mut self.slots[first..first + n] {
            if *s != Slot::Taken {
                *s = Slot::Taken;
                RESERVED.fetch_sub(page, Ordering::Relaxed);
            }
        }
    }

    /// The address of pages `first..first + len / page`, writable, if all of them are
    /// parked; they are the caller's from then on (moved over their old addresses).
    pub(crate) fn take(&mut self, first: usize, len: usize) -> Option<usize> {
        let page = vrdma_abi::shm::page_size();
        let n = len / page;
        if self.pid != std::process::id() || first + n > self.slots.len() || self.slots[first..first + n].iter().any(|s| *s != Slot::Parked) {
            return None;
        }
        let at = self.addr + first * page;
        // SAFETY: our parked pages; they were PROT_NONE since the move.
        if unsafe { libc::mprotect(at as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
            return None;
        }
        self.mark_gone(first, n);
        Some(at)
    }
}

impl Drop for Park {
    fn drop(&mut self) {
        let page = vrdma_abi::shm::page_size();
        let mut i = 0;
        while i < self.slots.len() {
            if self.slots[i] == Slot::Taken {
                i += 1;
                continue;
            }
            let run = i;
            while i < self.slots.len() && self.slots[i] != Slot::Taken {
                i += 1;
            }
            RESERVED.fetch_sub((i - run) * page, Ordering::Relaxed);
            if self.pid == std::process::id() {
                // SAFETY: unmaps what is still ours of the reservation (taken pages excepted).
                unsafe { crate::vm::munmap((self.addr + run * page) as *mut libc::c_void, (i - run) * page) };
            }
        }
    }
}
