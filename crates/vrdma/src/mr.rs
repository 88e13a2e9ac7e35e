//! Memory registration on ordinary application memory.
//!
//! A registered range reaches peers in one of two ways (docs/architecture.md, "Memory
//! registration"):
//!
//! - **Shared**: the covering pages are copied into a memfd that is then mapped
//!   `MAP_FIXED | MAP_SHARED` over the very same addresses. vrdmad hands that memfd to a
//!   connected peer whose RDMA operations then read and write the application's memory
//!   directly. Pages already shared by an earlier registration are reused, so overlapping
//!   MRs and registrations of a range registered before share one copy. Only resident pages
//!   are copied (`mincore`). Small ranges (up to [`move_max`], 64 KiB by default) are shared
//!   at registration: the move costs about what the registration round trip does.
//! - **In place**: larger private anonymous ranges not shared yet are registered without
//!   moving a byte (registration costs a round trip to vrdmad whatever the size). vrdmad
//!   performs peers' accesses through this process's memory (its copying path) until the MR
//!   moves onto a memfd: at the owner's `post_recv` naming it ([`crate::inplace`]:
//!   SENDs into it should cost no request to vrdmad), or at the owner's next verb call after
//!   peers copied twice its length through vrdmad (vrdmad asks, see [`crate::inplace`]): a
//!   buffer used once stays in place.
//!
//! Moves happen only inside this process's own verb calls (registration, `post_recv`,
//! deregistration) and vrdmad's re-homing; the pages are read-only while they move, so a
//! store by another thread of this process waits for the move ([`crate::move_guard`]). After `fork()` a
//! shared range is shared with the child instead of copied-on-write; an in-place range is
//! copied-on-write, as a NIC's pinned pages are.
//!
//! Memory that cannot be moved onto a memfd (file-backed mappings, hugetlb pages, memory
//! shared with another process) takes the copying path for good: it is registered without
//! chunks and vrdmad copies each remote access through this process's memory (see vrdmad's
//! `procmem`). Local access is unchanged; remote access costs a request to vrdmad.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use vrdma_abi::control::{MrChunk, Reply, Request};
use vrdma_abi::shm::{self, MemRegion};
use vrdma_abi::verbs::access;
use vrdma_core::access::MrBounds;

use crate::device::{Pd, PdInner};
use crate::error::{invalid, Error};
pub(crate) use crate::inplace::share_receive_buffers;

/// A memfd mapped over application memory at `[start, end)` (its key in [`SEGMENTS`]).
pub(crate) struct Segment {
    pub(crate) end: usize,
    pub(crate) fd: Arc<OwnedFd>,
    id: u64,
    /// Live MRs using each page. A page no MR uses any more is moved off the memfd
    /// ([`crate::unshare`]) and is no longer part of the segment.
    pub(crate) users: Vec<u32>,
}

impl Segment {
    /// The address ranges of the pages some live MR uses, in order.
    fn live_runs(&self, start: usize) -> Vec<(usize, usize)> {
        let page = shm::page_size();
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, _) in self.users.iter().enumerate().filter(|(_, n)| **n > 0) {
            let a = start + i * page;
            match runs.last_mut() {
                Some(r) if r.1 == a => r.1 = a + page,
                _ => runs.push((a, a + page)),
            }
        }
        runs
    }

    /// Counts one more user of the pages of `[a, b)` (page-aligned, within the segment at
    /// `start`).
    fn add_users(&mut self, start: usize, a: usize, b: usize) {
        let page = shm::page_size();
        self.users[(a - start) / page..(b - start) / page].iter_mut().for_each(|n| *n += 1);
    }
}

/// The segments of this process, by start address.
pub(crate) static SEGMENTS: Mutex<BTreeMap<usize, Segment>> = Mutex::new(BTreeMap::new());
static NEXT_SEGMENT: AtomicU64 = AtomicU64::new(1);

/// Pages `[a, b)` of the segment at `seg_start` that one MR uses.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SharedPiece {
    pub(crate) seg_start: usize,
    pub(crate) a: usize,
    pub(crate) b: usize,
}

pub(crate) use vrdma_abi::procmap::Vma;

/// This process's mappings that overlap `[lo, hi)`, and the one right below the first of
/// them if it touches it (`vrdma_abi::procmap`: a query per mapping where the kernel answers
/// them, the whole text of `/proc/self/maps` otherwise).
pub(crate) fn read_maps(lo: usize, hi: usize) -> Result<Vec<Vma>, Error> {
    // Opened anew each time: the file stays bound to the address space it was opened on, and
    // a forked child must not ask about its parent's.
    let os = |source| Error::Os { op: "reg_mr", source };
    let f = std::fs::File::open("/proc/self/maps").map_err(os)?;
    vrdma_abi::procmap::mappings_around(&f, lo as u64, hi as u64).map_err(os)
}

fn segment_name(id: u64) -> String {
    format!("vrdma-mr-{id}")
}

/// Whether mapping `v` maps the segment at `start` (named `want`) as it was made: offset
/// `x - start` at address `x`.
fn maps_segment(v: &Vma, start: usize, want: &str) -> bool {
    v.name == want && v.start >= start as u64 && v.offset == v.start - start as u64
}

/// Whether `[a, b)` of the segment at `start` is still mapped from it (the application may
/// have unmapped and reused the addresses since it was shared).
pub(crate) fn run_intact(maps: &[Vma], start: usize, seg: &Segment, a: usize, b: usize) -> bool {
    let want = format!("/memfd:{} (deleted)", segment_name(seg.id));
    let mut cur = a as u64;
    for v in maps.iter().filter(|v| v.end > a as u64 && v.start < b as u64) {
        if v.start > cur || !maps_segment(v, start, &want) {
            return false;
        }
        cur = v.end;
    }
    cur >= b as u64
}

/// The parts of `[a, b)` of the segment at `start` that are still mapped from it.
pub(crate) fn intact_parts(maps: &[Vma], start: usize, seg: &Segment, a: usize, b: usize) -> Vec<(usize, usize)> {
    let want = format!("/memfd:{} (deleted)", segment_name(seg.id));
    maps.iter()
        .filter(|v| v.end > a as u64 && v.start < b as u64 && maps_segment(v, start, &want))
        .map(|v| ((v.start as usize).max(a), (v.end as usize).min(b)))
        .collect()
}

/// Whether the pages of segment `seg` that live MRs use are still mapped from it.
fn segment_intact(maps: &[Vma], start: usize, seg: &Segment) -> bool {
    seg.live_runs(start).into_iter().all(|(a, b)| run_intact(maps, start, seg, a, b))
}

/// Whether `[start, end)` can take the copying fallback: mapped, readable, and writable if
/// the registration grants writes (as the kernel's pinning answers EFAULT otherwise).
fn copyable(maps: &[Vma], start: usize, end: usize, writable: bool) -> Result<(), Error> {
    if vrdma_abi::procmap::covers(maps, start as u64, (end - start) as u64, writable) {
        Ok(())
    } else {
        Err(Error::Os { op: "reg_mr", source: std::io::Error::from_raw_os_error(libc::EFAULT) })
    }
}

/// Whether `v` is anonymous memory (named with `PR_SET_VMA` or not).
pub(crate) fn anonymous(v: &Vma) -> bool {
    v.name.is_empty() || v.name.starts_with("[anon")
}

/// Whether `[start, end)` is wholly mapped private anonymous read-write memory (what moves
/// onto a memfd).
fn private_anonymous(maps: &[Vma], start: usize, end: usize) -> bool {
    let mut cur = start as u64;
    for v in maps.iter().filter(|v| v.end > start as u64 && v.start < end as u64) {
        let anon = anonymous(v) || v.name == "[heap]" || v.name == "[stack]";
        if v.start > cur || !anon || !v.read || !v.write || v.shared {
            return false;
        }
        cur = v.end;
    }
    cur >= end as u64
}

/// Whether swap is on (non-resident pages may then hold data), read at most once a second.
fn swap_active() -> bool {
    static LAST: Mutex<Option<(std::time::Instant, bool)>> = Mutex::new(None);
    let mut last = LAST.lock();
    match *last {
        Some((at, on)) if at.elapsed() < std::time::Duration::from_secs(1) => on,
        _ => {
            let on = std::fs::read_to_string("/proc/swaps").map(|s| s.lines().count() > 1).unwrap_or(true);
            *last = Some((std::time::Instant::now(), on));
            on
        }
    }
}

/// Bytes copied and remapped per step of [`share_gap`].
const SHARE_STEP_BYTES: usize = 4 << 20;

/// Pages per step at most (4 KiB pages): the residency of a step fits on the stack.
const MAX_STEP_PAGES: usize = SHARE_STEP_BYTES / 4096;

/// Copies the resident pages (`resident[i]`, page `first + i` of the range at `start`) into
/// the memfd at the same offsets.
fn copy_resident_runs(fd: RawFd, start: usize, page: usize, resident: &[u8], first: usize) -> Result<(), Error> {
    let pages = resident.len();
    let mut i = 0;
    while i < pages {
        if resident[i] & 1 == 0 {
            i += 1;
            continue;
        }
        let run_start = i;
        while i < pages && resident[i] & 1 != 0 {
            i += 1;
        }
        let (off, n) = ((first + run_start) * page, (i - run_start) * page);
        // Allocating the run up front saves the write a page fault per page (each page of
        // the write would allocate itself); if it fails the write below still allocates.
        // SAFETY: plain fallocate(2) on our memfd.
        unsafe { libc::fallocate(fd, 0, off as libc::off_t, n as libc::off_t) };
        let mut done = 0;
        while done < n {
            // SAFETY: reading mapped application memory (checked readable) into the memfd.
            let w = unsafe { libc::pwrite(fd, (start + off + done) as *const libc::c_void, n - done, (off + done) as libc::off_t) };
            if w <= 0 {
                return Err(Error::Os { op: "reg_mr", source: std::io::Error::last_os_error() });
            }
            done += w as usize;
        }
    }
    Ok(())
}

/// Moves `[start, end)` (page-aligned, private anonymous) onto a new memfd in place.
///
/// It goes step by step, copying [`SHARE_STEP_BYTES`] and mapping the memfd over them before
/// the next step: the private pages each step frees are the ones the next step's memfd pages
/// are allocated from. On a VM that hands free memory back to its host (virtio-balloon free
/// page reporting), fresh pages cost a fault in the host as well, which made copying whole
/// much slower (docs/measurements.md).
pub(crate) fn share_gap(start: usize, end: usize) -> Result<Segment, Error> {
    let len = end - start;
    let id = NEXT_SEGMENT.fetch_add(1, Ordering::Relaxed);
    let fd = shm::create_memfd(&segment_name(id), len, false).map_err(|source| Error::Shm { op: "reg_mr", source })?;
    let page = shm::page_size();
    let pages = len / page;
    // Untouched anonymous pages read as zero, like the memfd's holes: copy only resident
    // ones, unless swap could hold the content of non-resident pages. Which pages are
    // resident is read once the step is read-only: a store before that may make one so.
    // The answer goes to this thread's stack, never the heap: heap memory may be the very
    // pages being moved, read-only in the window (the kernel's write would fail, ours fault).
    let mut resident = [1u8; MAX_STEP_PAGES];
    let skip_holes = !swap_active();
    // One writer per memfd (shmem writes to one file serialise on its inode lock); large
    // ranges are split into several segments by `share_range` and copied in parallel there.
    let step_pages = (SHARE_STEP_BYTES / page).clamp(1, MAX_STEP_PAGES);
    let mut first = 0;
    while first < pages {
        let n = step_pages.min(pages - first);
        let step_start = start + first * page;
        // Read-only from the copy to the remap: another thread's store waits instead of
        // landing in the old pages (crate::move_guard).
        let step_resident = &mut resident[..n];
        step_resident.fill(1);
        crate::move_guard::while_protected(step_start, n * page, || {
            // SAFETY: the step is page-aligned and mapped (checked by the caller), and
            // `step_resident` has one byte per page of it.
            if skip_holes && unsafe { libc::mincore(step_start as *mut libc::c_void, n * page, step_resident.as_mut_ptr()) } != 0 {
                step_resident.iter_mut().for_each(|r| *r = 1);
            }
            copy_resident_runs(fd.as_raw_fd(), start, page, step_resident, first)?;
            // SAFETY: these pages of [start, end) are private anonymous memory of this
            // process whose content now lives in the memfd at the same offset; replacing the
            // mapping keeps every byte at the same address.
            let p = unsafe {
                crate::vm::mmap(
                    step_start as *mut libc::c_void,
                    n * page,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd.as_raw_fd(),
                    (first * page) as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(Error::Os { op: "reg_mr", source: std::io::Error::last_os_error() });
            }
            Ok(())
        })?;
        first += n;
    }
    shm::seal_memfd(fd.as_fd()).map_err(|source| Error::Shm { op: "reg_mr", source })?;
    Ok(Segment { end, fd: Arc::new(fd), id, users: vec![0; pages] })
}

type ExistingSegment = (usize, Arc<OwnedFd>);

/// How a registered range is reached by peers.
pub(crate) enum Sharing {
    /// Through these chunks (and their memfds), which tile it, made of these pieces of
    /// segments (counted as used until [`crate::unshare::release`]).
    Chunks(Vec<(MrChunk, Arc<OwnedFd>)>, Vec<SharedPiece>),
    /// By vrdmad copying through this process's memory: `movable` if it is private anonymous
    /// memory left in place (it may move onto a memfd later), not if it cannot move at all.
    Copied { movable: bool },
}

/// Largest range (its pages) moved onto a memfd at registration; larger ones not shared yet
/// are registered in place. `VRDMA_MR_MOVE_MAX` (bytes, e.g. 65536; `inf`) sets it: moving
/// 64 KiB costs about 16 us, 1 MiB about 0.5 ms, registering in place a round trip whatever
/// the size (docs/measurements.md). The default is 64 KiB while every peer of the process is
/// on its host: with peers' accesses to in-place memory made by direct copies, Graph-500 over
/// UCX runs at least as fast in place as moved (docs/measurements.md, "In place by default,
/// again"). Once a QP of the process connected to another host ([`note_engine_peer`]) it is
/// unbounded: vrdmad's engine reaches in-place memory through the owner's `/proc/PID/mem` on
/// a thread of the owner's (about 35 us per 256 KiB and two thread hand-offs) for good,
/// moved memory from its mapping, and across hosts a rendezvous buffer UCX's cache reuses
/// ran twice as fast moved (docs/measurements.md, "Across hosts, ranges move at
/// registration").
pub(crate) fn move_max() -> usize {
    static CONFIGURED: OnceLock<Option<usize>> = OnceLock::new();
    let configured = *CONFIGURED.get_or_init(|| match std::env::var("VRDMA_MR_MOVE_MAX") {
        Ok(v) if v == "inf" => Some(usize::MAX),
        Ok(v) => Some(v.parse().unwrap_or(DEFAULT_MOVE_MAX)),
        Err(_) => None,
    });
    match configured {
        Some(max) => max,
        None if ENGINE_PEERS.load(Ordering::Relaxed) => usize::MAX,
        None => DEFAULT_MOVE_MAX,
    }
}

/// Whether a QP of this process has connected through vrdmad's engine (see [`move_max`]).
static ENGINE_PEERS: AtomicBool = AtomicBool::new(false);

/// A QP of this process connected through vrdmad's engine (a peer on another host): ranges
/// registered from now on move onto memfds whatever their size ([`move_max`]).
pub(crate) fn note_engine_peer() {
    ENGINE_PEERS.store(true, Ordering::Relaxed);
}

const DEFAULT_MOVE_MAX: usize = 64 << 10;

/// Makes `[start, end)` shareable; returns the chunks (and their memfds) that tile it, or
/// `Copied` if part of it is not private anonymous memory, or if the pages still to move
/// exceed `move_max` bytes (then nothing moves).
pub(crate) fn share_range(start: usize, end: usize, writable: bool, move_max: usize) -> Result<Sharing, Error> {
    let mut segs = SEGMENTS.lock();
    // Too large to move and no page of it shared yet: in place, without reading our
    // mappings (vrdmad checks them at registration; whether the memory can move is found
    // out if it ever has to, see `share_in_place`).
    if end - start > move_max && !segs.range(..end).any(|(_, seg)| seg.end > start) {
        return Ok(Sharing::Copied { movable: true });
    }
    // The range and the segments it overlaps.
    let (lo, hi) =
        segs.range(..end).filter(|(_, seg)| seg.end > start).fold((start, end), |(lo, hi), (s, seg)| (lo.min(*s), hi.max(seg.end)));
    let maps = read_maps(lo, hi)?;
    // Forget segments whose addresses the application unmapped or remapped.
    let stale: Vec<usize> =
        segs.range(..end).filter(|(s, seg)| seg.end > start && !segment_intact(&maps, **s, seg)).map(|(s, _)| *s).collect();
    for s in stale {
        segs.remove(&s);
    }
    let mut chunks = Vec::new();
    let mut cur = start;
    // The pages of existing segments that live MRs use (the others were moved off them),
    // as (run start, run end, segment start, memfd).
    let overlapping: Vec<(usize, usize, usize, Arc<OwnedFd>)> = segs
        .range(..end)
        .filter(|(_, seg)| seg.end > start)
        .flat_map(|(s, seg)| seg.live_runs(*s).into_iter().map(|(a, b)| (a, b, *s, seg.fd.clone())).collect::<Vec<_>>())
        .filter(|(a, b, _, _)| *b > start && *a < end)
        .collect();
    // A peer is handed whole memfds: reusing a segment some of whose live pages lie outside
    // this range would give this MR's peers those pages too (another MR's, with this MR's
    // rights). Such a range is reached through vrdmad's copies instead, which check its bounds.
    if exposes_other_pages(&segs, &overlapping, start, end) {
        copyable(&maps, start, end, writable)?;
        return Ok(Sharing::Copied { movable: false });
    }
    // (start, end, existing segment (its start, its memfd) or None for a gap to share)
    let mut plan: Vec<(usize, usize, Option<ExistingSegment>)> = Vec::new();
    for (s, e, seg_start, fd) in overlapping {
        if s > cur {
            plan.push((cur, s, None));
        }
        let a = cur.max(s);
        let b = end.min(e);
        plan.push((a, b, Some((seg_start, fd))));
        cur = b;
    }
    if cur < end {
        plan.push((cur, end, None));
    }
    let gaps: Vec<(usize, usize)> = plan.iter().filter(|(_, _, e)| e.is_none()).map(|(a, b, _)| (*a, *b)).collect();
    for &(a, b) in &gaps {
        if !private_anonymous(&maps, a, b) {
            copyable(&maps, start, end, writable)?;
            return Ok(Sharing::Copied { movable: false });
        }
    }
    if gaps.iter().map(|(a, b)| b - a).sum::<usize>() > move_max {
        return Ok(Sharing::Copied { movable: true });
    }
    // The ranges may hold this thread's own live stack frames (stack buffers): then copy and
    // remap on the mover thread while this one sleeps, so its stack does not change between
    // the copy and the remap; other memory moves on this thread.
    let results = if gaps.is_empty() {
        Vec::new()
    } else {
        let on_a_stack = gaps.iter().any(|&(a, b)| crate::inplace::may_hold_a_stack(&maps, a, b));
        crate::mover::run_off_stack(on_a_stack, || gaps.iter().map(|&(a, b)| share_gap(a, b)).collect::<Vec<_>>())
            .ok_or_else(|| invalid("reg_mr", "the thread moving memory panicked"))?
    };
    let mut made: std::collections::HashMap<usize, Segment> = std::collections::HashMap::new();
    for (&(a, _), seg) in gaps.iter().zip(made_results(results)?) {
        made.insert(a, seg);
    }
    let mut pieces = Vec::new();
    for (a, b, existing) in plan {
        let (fd, seg_start) = match existing {
            Some((seg_start, fd)) => (fd, seg_start),
            None => {
                let seg = made.remove(&a).ok_or_else(|| invalid("reg_mr", "segment lost"))?;
                let fd = seg.fd.clone();
                segs.insert(a, seg);
                (fd, a)
            }
        };
        segs.get_mut(&seg_start).ok_or_else(|| invalid("reg_mr", "segment lost"))?.add_users(seg_start, a, b);
        pieces.push(SharedPiece { seg_start, a, b });
        chunks.push((MrChunk { mr_offset: (a - start) as u64, len: (b - a) as u64, fd_offset: (a - seg_start) as u64 }, fd));
    }
    Ok(Sharing::Chunks(chunks, pieces))
}

/// Whether a segment that `[start, end)` would reuse (`overlapping`: its live runs there, by
/// segment start) has live pages outside that range.
fn exposes_other_pages(
    segs: &BTreeMap<usize, Segment>,
    overlapping: &[(usize, usize, usize, Arc<OwnedFd>)],
    start: usize,
    end: usize,
) -> bool {
    let mut seen: Vec<usize> = overlapping.iter().map(|(_, _, seg_start, _)| *seg_start).collect();
    seen.dedup();
    seen.iter().filter_map(|s| segs.get(s).map(|seg| (s, seg))).any(|(s, seg)| seg.live_runs(*s).iter().any(|&(a, b)| a < start || b > end))
}

/// The segments made for the gaps, or the first error.
fn made_results(made: Vec<Result<Segment, Error>>) -> Result<Vec<Segment>, Error> {
    made.into_iter().collect()
}

/// A registered region as the data path sees it.
pub(crate) struct LocalMr {
    pub(crate) bounds: MrBounds,
    pub(crate) mem: MemRegion,
    pub(crate) valid: AtomicBool,
    /// The PD's handle.
    pub(crate) pd: u32,
    /// The segment pages it uses: moved off their memfds at deregistration once no MR uses
    /// them, or onto new ones when a peer loses the right to them ([`crate::rehome`]).
    pub(crate) pieces: Mutex<Vec<SharedPiece>>,
    /// Registered in place, and may still move onto memfds ([`crate::inplace`]).
    pub(crate) in_place: AtomicBool,
    /// In place, and vrdmad asked for it to be shared (peers use it): moved at this
    /// process's next verb call ([`crate::inplace::at_safe_point`]).
    pub(crate) share_wanted: AtomicBool,
}

/// A memory region.
pub struct Mr {
    pd: Arc<PdInner>,
    lkey: u32,
    rkey: u32,
    local: Arc<LocalMr>,
    /// The memory is unmapped right after deregistration: its content need not be kept.
    discard_on_drop: bool,
}

impl Pd {
    /// Registers `len` bytes at `addr` with `access` flags (`access::*`).
    ///
    /// # Safety
    /// `addr..addr+len` must be memory of this process that stays allocated until the MR is
    /// deregistered (dropped), as with `ibv_reg_mr`: remote peers and the library write it.
    pub unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: u32) -> Result<Mr, Error> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.reg_mr_moving(addr, len, access, move_max()) }
    }

    /// [`Pd::reg_mr`], moving at most `move_max` bytes onto memfds (larger: in place).
    ///
    /// # Safety
    /// As [`Pd::reg_mr`].
    unsafe fn reg_mr_moving(&self, addr: *mut u8, len: usize, access: u32, move_max: usize) -> Result<Mr, Error> {
        crate::inplace::at_safe_point(&self.inner.ctx);
        if len == 0 || addr.is_null() {
            return Err(invalid("reg_mr", "empty or null region"));
        }
        if !vrdma_core::access::valid_reg_access(access) {
            return Err(invalid("reg_mr", "REMOTE_WRITE or REMOTE_ATOMIC requires LOCAL_WRITE"));
        }
        let page = shm::page_size();
        let a = addr as usize;
        let end = a.checked_add(len).ok_or_else(|| invalid("reg_mr", "region wraps"))?;
        let (start, span_end) = (a & !(page - 1), end.div_ceil(page) * page);
        let writable = access & (access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0;
        let (chunks, pieces, in_place) = match share_range(start, span_end, writable, move_max)? {
            Sharing::Chunks(c, p) => (c, p, false),
            Sharing::Copied { movable } => (Vec::new(), Vec::new(), movable),
        };
        let registered = self.register(a, len, access, &chunks);
        let (lkey, rkey) = match registered {
            Ok(keys) => keys,
            // vrdmad cannot copy through this process's memory: share the range after all.
            Err(Error::Refused { .. }) if in_place => {
                // SAFETY: the caller's guarantee, passed on.
                return unsafe { self.reg_mr_moving(addr, len, access, usize::MAX) };
            }
            Err(e) => {
                // Not registered: its pages are no longer in use by it.
                crate::unshare::release(&pieces, false);
                return Err(e);
            }
        };
        // SAFETY: the caller guarantees the range stays valid while the MR lives.
        let mem = unsafe { MemRegion::from_raw(addr, len) };
        let local = Arc::new(LocalMr {
            bounds: MrBounds { addr: a as u64, length: len as u64, access },
            mem,
            valid: AtomicBool::new(true),
            pd: self.inner.handle,
            pieces: Mutex::new(pieces),
            in_place: AtomicBool::new(in_place),
            share_wanted: AtomicBool::new(false),
        });
        if in_place {
            crate::inplace::IN_PLACE_MRS.fetch_add(1, Ordering::Relaxed);
        }
        let shared = !local.pieces.lock().is_empty();
        let ctx = &self.inner.ctx.inner;
        ctx.mrs.write().insert(lkey, local.clone());
        // (In place: vrdmad asks through the same queue for it to be shared.)
        if shared || in_place {
            crate::rehome::watch(&self.inner.ctx);
        }
        Ok(Mr { pd: self.inner.clone(), lkey, rkey, local, discard_on_drop: false })
    }

    /// `RegMr` of `[a, a+len)` on `chunks` (none: copied through this process's memory).
    fn register(&self, a: usize, len: usize, access: u32, chunks: &[(MrChunk, Arc<OwnedFd>)]) -> Result<(u32, u32), Error> {
        let raw: Vec<RawFd> = chunks.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
        let req = Request::RegMr {
            pd: self.inner.handle,
            addr: a as u64,
            length: len as u64,
            access,
            chunks: chunks.iter().map(|(c, _)| *c).collect(),
        };
        match self.inner.ctx.inner.ctl.call("reg_mr", &req, &raw)? {
            (Reply::Mr { lkey, rkey }, _) => Ok((lkey, rkey)),
            _ => Err(Error::UnexpectedReply { op: "reg_mr" }),
        }
    }
}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// First byte's address.
    pub fn addr(&self) -> u64 {
        self.local.bounds.addr
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.local.bounds.length as usize
    }
    /// Whether the MR has no bytes (never: registration refuses empty regions).
    pub fn is_empty(&self) -> bool {
        self.local.bounds.length == 0
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.local.valid.store(false, Ordering::Release);
        crate::inplace::unwant(&self.local);
        crate::inplace::at_safe_point(&self.pd.ctx);
        // Taken first: a move of this MR under way on the re-homing thread (it holds the
        // lock from `BeginRehome` to `RehomeMr`) ends before vrdmad forgets the MR.
        let pieces = self.local.pieces.lock();
        if self.local.in_place.swap(false, Ordering::AcqRel) {
            crate::inplace::IN_PLACE_MRS.fetch_sub(1, Ordering::Relaxed);
        }
        let ctx = &self.pd.ctx.inner;
        ctx.mrs.write().remove(&self.lkey);
        let _ = ctx.ctl.call("dereg_mr", &Request::DeregMr { key: self.lkey }, &[]);
        crate::unshare::release(&pieces, self.discard_on_drop);
    }
}

/// A page-aligned buffer owned by the library, registered as an MR: the safe way to get
/// registered memory.
pub struct MrBuf {
    mr: Option<Mr>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; access through &self is by
// shared byte copies only.
unsafe impl Send for MrBuf {}
// SAFETY: as above.
unsafe impl Sync for MrBuf {}

/// What memory an [`MrBuf`] allocates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backing {
    /// Private anonymous memory: registered zero-copy.
    #[default]
    Anonymous,
    /// A shared mapping of an (unlinked) temporary file: the copying fallback.
    SharedFile,
    /// Private anonymous huge pages (`MAP_HUGETLB`, 2 MiB): the copying fallback.
    Hugetlb,
}

impl std::str::FromStr for Backing {
    type Err = String;
    fn from_str(s: &str) -> Result<Backing, String> {
        match s {
            "anon" | "anonymous" => Ok(Backing::Anonymous),
            "file" => Ok(Backing::SharedFile),
            "hugetlb" => Ok(Backing::Hugetlb),
            _ => Err(format!("unknown memory kind {s:?} (anon, file, hugetlb)")),
        }
    }
}

fn map_backing(len: usize, backing: Backing) -> Result<(*mut libc::c_void, usize), Error> {
    let os = || Error::Os { op: "reg_mr", source: std::io::Error::last_os_error() };
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let (map_len, p) = match backing {
        Backing::Anonymous => {
            let map_len = len.div_ceil(shm::page_size()) * shm::page_size();
            // SAFETY: a fresh private anonymous mapping aliasing nothing.
            (map_len, unsafe { libc::mmap(std::ptr::null_mut(), map_len, rw, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) })
        }
        Backing::Hugetlb => {
            let map_len = len.next_multiple_of(2 << 20);
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB;
            // SAFETY: a fresh private anonymous mapping aliasing nothing.
            (map_len, unsafe { libc::mmap(std::ptr::null_mut(), map_len, rw, flags, -1, 0) })
        }
        Backing::SharedFile => {
            let map_len = len.div_ceil(shm::page_size()) * shm::page_size();
            // An unnamed file (O_TMPFILE): nothing to clash with or leave behind.
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_TMPFILE)
                .open(std::env::temp_dir())
                .map_err(|source| Error::Os { op: "reg_mr", source })?;
            f.set_len(map_len as u64).map_err(|source| Error::Os { op: "reg_mr", source })?;
            // SAFETY: a fresh shared mapping of our own unlinked file.
            (map_len, unsafe { libc::mmap(std::ptr::null_mut(), map_len, rw, libc::MAP_SHARED, f.as_raw_fd(), 0) })
        }
    };
    if p == libc::MAP_FAILED {
        return Err(os());
    }
    Ok((p, map_len))
}

impl MrBuf {
    /// Allocates `len` zeroed bytes and registers them.
    pub fn new(pd: &Pd, len: usize, access: u32) -> Result<MrBuf, Error> {
        MrBuf::with_backing(pd, len, access, Backing::Anonymous)
    }

    /// Allocates `len` zeroed bytes of `backing` memory and registers them.
    pub fn with_backing(pd: &Pd, len: usize, access: u32, backing: Backing) -> Result<MrBuf, Error> {
        let (p, map_len) = map_backing(len.max(1), backing)?;
        let ptr = p as *mut u8;
        // Fresh memory has no resident page: sharing it copies nothing, whatever its size,
        // and peers map it from the start.
        // SAFETY: the mapping lives until MrBuf's drop, after the MR is dropped.
        let mr = unsafe { pd.reg_mr_moving(ptr, len.max(1), access, usize::MAX) };
        match mr {
            Ok(mr) => Ok(MrBuf { mr: Some(mr), ptr, len: map_len }),
            Err(e) => {
                // SAFETY: unmapping our own fresh mapping.
                unsafe { libc::munmap(p, map_len) };
                Err(e)
            }
        }
    }
    /// The MR.
    pub fn mr(&self) -> &Mr {
        self.mr.as_ref().expect("present until drop")
    }
    /// Address of the buffer.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    /// Raw pointer (for building scatter lists).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    /// Copies bytes into the buffer at `off`.
    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.mr().len(), "write beyond MrBuf");
        // SAFETY: in bounds of our mapping; peers may write concurrently, as with any MR.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
    /// Copies bytes out of the buffer at `off`.
    pub fn read(&self, off: usize, out: &mut [u8]) {
        assert!(off + out.len() <= self.mr().len(), "read beyond MrBuf");
        // SAFETY: in bounds of our mapping.
        unsafe { std::ptr::copy(self.ptr.add(off), out.as_mut_ptr(), out.len()) };
    }
    /// A volatile read of the byte at `off` (for polling on memory, as ib_write_lat does).
    pub fn read_volatile(&self, off: usize) -> u8 {
        assert!(off < self.mr().len(), "read beyond MrBuf");
        // SAFETY: in bounds of our mapping.
        unsafe { std::ptr::read_volatile(self.ptr.add(off)) }
    }
    /// Sge covering `len` bytes at `off`.
    pub fn sge(&self, off: usize, len: u32) -> crate::Sge {
        crate::Sge { addr: self.ptr as u64 + off as u64, length: len, lkey: self.mr().lkey() }
    }
}

impl Drop for MrBuf {
    fn drop(&mut self) {
        if let Some(mut mr) = self.mr.take() {
            // The buffer is unmapped next: its pages need only leave the memfds, not be kept.
            mr.discard_on_drop = true;
            drop(mr);
        }
        // SAFETY: our own mapping, no longer registered.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}
