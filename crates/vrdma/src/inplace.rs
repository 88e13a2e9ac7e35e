//! Moving MRs registered in place onto memfds (see [`crate::mr`]): when the owner posts a
//! receive naming one, or when vrdmad asks because peers use one again and again. vrdmad's
//! ask is served at once by the re-homing thread: the owner's threads that store into the
//! MR meanwhile wait for the move ([`crate::move_guard`]), so an owner that only watches its
//! buffer (a latency test's responder) gets it mapped without calling the library. Memory
//! that may hold a thread's stack moves only inside the owner's own verb calls instead: a
//! thread whose own stack page is read-only could not take the signal that makes it wait.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use vrdma_abi::control::Request;
use vrdma_abi::shm;
use vrdma_abi::verbs::access;

use crate::device::Context;
use crate::error::Error;
use crate::mr::{anonymous, read_maps, share_range, LocalMr, Sharing, Vma};

/// In-place MRs (of any context) that may still move onto memfds: while there are none,
/// `post_recv` checks nothing ([`share_receive_buffers`]).
pub(crate) static IN_PLACE_MRS: AtomicUsize = AtomicUsize::new(0);

/// Moves the in-place MRs that `sges` name onto memfds (the owner's `post_recv`: SENDs into a
/// receive buffer should cost its peers no request to vrdmad).
#[inline]
pub(crate) fn share_receive_buffers(ctx: &Context, sges: &[crate::Sge]) {
    if IN_PLACE_MRS.load(Ordering::Relaxed) != 0 {
        share_receive_buffers_slow(ctx, sges);
        at_safe_point(ctx);
    }
}

/// In-place MRs (of any context) vrdmad asked to be shared: while there are none, verb calls
/// check nothing ([`at_safe_point`]).
static SHARE_WANTED: AtomicUsize = AtomicUsize::new(0);

/// The in-place MR `local` moves at this process's next verb call that is a safe point.
pub(crate) fn want_shared(local: &LocalMr) {
    if !local.share_wanted.swap(true, Ordering::AcqRel) {
        SHARE_WANTED.fetch_add(1, Ordering::Relaxed);
    }
}

pub(crate) fn unwant(local: &LocalMr) {
    if local.share_wanted.swap(false, Ordering::AcqRel) {
        SHARE_WANTED.fetch_sub(1, Ordering::Relaxed);
    }
}

/// vrdmad asks for the in-place MR `key` to be shared: moved now (on the calling re-homing
/// thread) unless its range may hold a thread's stack, which waits for [`at_safe_point`].
pub(crate) fn share_when_safe(ctx: &Context, key: u32, local: &LocalMr) {
    let b = local.bounds;
    let page = shm::page_size();
    let (start, end) = (b.addr as usize & !(page - 1), ((b.addr + b.length) as usize).div_ceil(page) * page);
    match read_maps(start, end) {
        // Without write protection a move behind the application's back could lose its
        // stores: then only at a safe point.
        Ok(maps) if crate::move_guard::enabled() && !may_hold_a_stack(&maps, start, end) => {
            if let Err(e) = share_in_place(ctx, key, local) {
                eprintln!("vrdma: MR {key:#x} stays in place (peers reach it through vrdmad): {e}");
            }
        }
        _ => want_shared(local),
    }
}

/// Whether `[start, end)` overlaps the main thread's stack or a mapping laid out like a thread's
/// stack (anonymous, right above an inaccessible guard mapping, as glibc makes them).
pub(crate) fn may_hold_a_stack(maps: &[Vma], start: usize, end: usize) -> bool {
    let guard = |v: &Vma| !v.read && !v.write && !v.exec;
    maps.iter().enumerate().filter(|(_, v)| v.end > start as u64 && v.start < end as u64).any(|(i, v)| {
        v.name == "[stack]" || (anonymous(v) && i > 0 && maps[i - 1].end == v.start && guard(&maps[i - 1]) && anonymous(&maps[i - 1]))
    })
}

/// Moves the in-place MRs of `ctx` that vrdmad asked to be shared. Called from this
/// process's verb calls (registration, deregistration, `post_recv`): the calling thread is
/// in the library, not running on stack pages that a move makes read-only for its duration.
#[inline]
pub(crate) fn at_safe_point(ctx: &Context) {
    if SHARE_WANTED.load(Ordering::Relaxed) != 0 {
        share_wanted_slow(ctx);
    }
}

#[inline(never)]
fn share_wanted_slow(ctx: &Context) {
    let wanted: Vec<(u32, Arc<LocalMr>)> =
        ctx.inner.mrs.read().iter().filter(|(_, l)| l.share_wanted.load(Ordering::Acquire)).map(|(k, l)| (*k, l.clone())).collect();
    for (key, local) in wanted {
        if let Err(e) = share_in_place(ctx, key, &local) {
            eprintln!("vrdma: MR {key:#x} stays in place (peers reach it through vrdmad): {e}");
        }
    }
}

#[inline(never)]
fn share_receive_buffers_slow(ctx: &Context, sges: &[crate::Sge]) {
    for s in sges {
        let local = ctx.inner.mrs.read().get(&s.lkey).cloned();
        if let Some(local) = local.filter(|l| l.in_place.load(Ordering::Acquire)) {
            // (Memory that cannot move, file-backed for instance, stays copied: no news.)
            if let Err(e) = share_in_place(ctx, s.lkey, &local) {
                eprintln!("vrdma: MR {:#x} stays in place (peers reach it through vrdmad): {e}", s.lkey);
            }
        }
    }
}

/// Moves the in-place MR `key` onto memfds and gives them to vrdmad (`BeginRehome`, then
/// `RehomeMr`, as [`crate::rehome`] does): vrdmad refuses copy requests for it from
/// `BeginRehome` on and answers it EBUSY while some are under way, so no copied write lands
/// in pages already copied. Whatever happens, the MR is not tried again. Whether it moved
/// (not: its memory cannot, file-backed for instance).
fn share_in_place(ctx: &Context, key: u32, local: &LocalMr) -> Result<bool, Error> {
    let mut pieces = local.pieces.lock();
    unwant(local);
    if !local.in_place.swap(false, Ordering::AcqRel) {
        return Ok(true); // moved by another thread meanwhile
    }
    IN_PLACE_MRS.fetch_sub(1, Ordering::Relaxed);
    let ctl = &ctx.inner.ctl;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match ctl.call("share MR", &Request::BeginRehome { key }, &[]) {
            Ok(_) => break,
            Err(Error::Refused { errno: libc::EBUSY, .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            Err(e) => {
                let _ = ctl.call("share MR", &Request::RehomeMr { key, chunks: Vec::new() }, &[]);
                return Err(e);
            }
        }
    }
    // (No grace period, unlike re-homing a shared MR: nobody maps an in-place MR, and every
    // write vrdmad makes into it, for a direct-path peer or the mediated engine, holds a pass
    // of its process's move gate, so `BeginRehome` succeeded only once none was under way,
    // and later ones are refused until `RehomeMr`.)
    let b = local.bounds;
    let page = shm::page_size();
    let (start, end) = (b.addr as usize & !(page - 1), (b.addr + b.length) as usize);
    let writable = b.access & (access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0;
    let (chunks, new_pieces) = match share_range(start, end.div_ceil(page) * page, writable, usize::MAX) {
        Ok(Sharing::Chunks(c, p)) => (c, p),
        other => {
            let _ = ctl.call("share MR", &Request::RehomeMr { key, chunks: Vec::new() }, &[]);
            return other.map(|_| false);
        }
    };
    let raw: Vec<RawFd> = chunks.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
    let req = Request::RehomeMr { key, chunks: chunks.iter().map(|(c, _)| *c).collect() };
    match ctl.call("share MR", &req, &raw) {
        Ok(_) => {
            *pieces = new_pieces;
            drop(pieces);
            crate::rehome::watch(ctx);
            Ok(true)
        }
        Err(e) => {
            // (The pages stay shared with no MR: moved off again.)
            crate::unshare::release(&new_pieces, false);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This thread's stack and another thread's are taken for stacks; heap and mmap memory not.
    #[test]
    fn stacks_are_told_from_heap_and_mappings() {
        let page = shm::page_size();
        let around = move |addr: usize| (addr & !(page - 1), (addr & !(page - 1)) + page);
        let on_stack = 0u64;
        let (a, b) = around(&on_stack as *const u64 as usize);
        assert!(may_hold_a_stack(&read_maps(a, b).unwrap(), a, b), "this thread's stack");
        let other = std::thread::spawn(move || {
            let x = 0u64;
            let (a, b) = around(&x as *const u64 as usize);
            may_hold_a_stack(&read_maps(a, b).unwrap(), a, b)
        });
        assert!(other.join().unwrap(), "another thread's stack");
        let heap = vec![0u8; 1 << 20];
        let (a, _) = around(heap.as_ptr() as usize + page);
        assert!(!may_hold_a_stack(&read_maps(a, a + 4 * page).unwrap(), a, a + 4 * page), "heap memory");
    }
}
