//! Moving an MR onto new memfd pages when vrdmad says a peer that had mapped it lost the
//! right to it while the MR stays registered (its QP or ours was destroyed, its session
//! ended, a tenant rule was withdrawn): that peer may have kept its mapping of the old
//! memfds, so this process's memory must stop being those pages.
//!
//! A thread per context (started at the first MR shared through memfds, if vrdmad sent an
//! eventfd with its `Hello` reply) sleeps on that eventfd, then asks for the keys
//! (`TakeRehomes`) and re-homes each MR: `BeginRehome` moves the MR epoch on, so peers still
//! entitled stop using their mappings and wait for the move (vrdmad answers them EBUSY); after
//! a grace period for their work requests in flight, the bytes are copied onto a new memfd
//! mapped over the same addresses ([`crate::mr::share_gap`], as at registration), vrdmad is
//! given the new memfd (`RehomeMr`: the waiting peers map it), and the old pages are punched
//! out, so the former peer's mapping reads zeros.
//!
//! The same queue carries MRs registered in place that peers started to use
//! ([`crate::inplace::want_shared`]): those are moved by the owner's own next verb call instead.
//!
//! Trade-off: a write racing with the copy is lost (this process's own threads wait instead:
//! [`crate::move_guard`]): by a peer's work request that passed its MR check before `BeginRehome` and outlives the grace
//! period, or through vrdmad's mediated engine. Pages shared with another MR (overlapping
//! registrations) are not moved: that would silently move the other MR too.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Weak};

use vrdma_abi::control::{MrChunk, Reply, Request};
use vrdma_abi::fd::{drain_eventfd, new_eventfd, signal_eventfd};
use vrdma_abi::shm;

use crate::device::{Context, CtxInner};
use crate::error::{invalid, Error};
use crate::mr::{intact_parts, read_maps, run_intact, share_gap, LocalMr, SharedPiece, Vma, SEGMENTS};

/// A context's re-homing: vrdmad's eventfd until the thread starts, then the thread's stop.
#[derive(Default)]
pub(crate) struct RehomeWatch {
    eventfd: Option<OwnedFd>,
    stop: Option<Arc<OwnedFd>>,
}

impl RehomeWatch {
    /// With the eventfd vrdmad sent with `Hello` (none from a daemon that does not re-home).
    pub(crate) fn new(eventfd: Option<OwnedFd>) -> RehomeWatch {
        RehomeWatch { eventfd, stop: None }
    }
}

impl Drop for RehomeWatch {
    fn drop(&mut self) {
        if let Some(stop) = &self.stop {
            signal_eventfd(stop.as_fd());
        }
    }
}

/// Starts `ctx`'s re-homing thread unless it runs already (or vrdmad sent no eventfd).
pub(crate) fn watch(ctx: &Context) {
    let mut w = ctx.inner.rehome.lock();
    if w.stop.is_some() {
        return;
    }
    let Some(eventfd) = w.eventfd.take() else { return };
    let Ok(stop) = new_eventfd() else { return };
    let stop = Arc::new(stop);
    let (me, thread_stop) = (Arc::downgrade(&ctx.inner), stop.clone());
    let spawned = std::thread::Builder::new().name("vrdma-rehome".into()).spawn(move || run(me, eventfd, thread_stop));
    if spawned.is_ok() {
        w.stop = Some(stop);
    }
}

fn run(me: Weak<CtxInner>, eventfd: OwnedFd, stop: Arc<OwnedFd>) {
    loop {
        let mut fds = [
            libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: eventfd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: poll(2) on an array of two pollfds we own.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        if fds[0].revents != 0 || fds[1].revents & !libc::POLLIN != 0 {
            return;
        }
        drain_eventfd(&eventfd);
        let Some(inner) = me.upgrade() else { return };
        rehome_pending(&Context { inner });
    }
}

/// Re-homes every MR vrdmad lists.
fn rehome_pending(ctx: &Context) {
    loop {
        let keys = match ctx.inner.ctl.call("re-home MRs", &Request::TakeRehomes, &[]) {
            Ok((Reply::Keys { keys }, _)) if !keys.is_empty() => keys,
            _ => return,
        };
        for key in keys {
            let local = ctx.inner.mrs.read().get(&key).cloned();
            if let Some(local) = local {
                // An MR registered in place that peers use again and again: moved now, or at
                // this process's next verb call if it may hold a thread's stack.
                if local.in_place.load(std::sync::atomic::Ordering::Acquire) {
                    crate::inplace::share_when_safe(ctx, key, &local);
                    continue;
                }
                if let Err(e) = rehome_mr(ctx, key, &local) {
                    eprintln!("vrdma: MR {key:#x} stays on the pages a former peer may still map: {e}");
                }
            }
        }
    }
}

/// How long a peer's work request already past its MR check may still write the old pages
/// after `BeginRehome`: the move waits that long before copying.
pub(crate) const GRACE: std::time::Duration = std::time::Duration::from_millis(2);

/// Moves MR `key` onto a new memfd and tells vrdmad: `BeginRehome` first (peers stop using
/// their mappings and wait), a grace period for work requests in flight, the move, then
/// `RehomeMr` (or, if the move failed, `RehomeMr` without chunks: it stays).
fn rehome_mr(ctx: &Context, key: u32, local: &LocalMr) -> Result<(), Error> {
    let mut pieces = local.pieces.lock();
    let mut segs = SEGMENTS.lock();
    // Memory the application unmapped while it stayed registered (a freed buffer in a
    // registration cache, a heap trimmed at exit): only the former peer still maps those
    // pages; they go, and there is nothing to move.
    let maps = maps_of(&pieces)?;
    if punch_orphans(&pieces, &segs, &maps) {
        return Ok(());
    }
    if exclusive(&pieces, &segs) && partly_unmapped(&pieces, &segs, &maps) {
        // What is still mapped cannot move onto one new memfd (the holes are not ours to map
        // over): it goes to private memory instead, and the MR's memfd pages are emptied. The
        // former peer then reaches none of it; peers still entitled find those pages empty,
        // as they find memory the application unmapped.
        ctx.inner.ctl.call("re-home MR", &Request::BeginRehome { key }, &[])?;
        std::thread::sleep(GRACE);
        let kept = take_private(&pieces, &segs, &maps_of(&pieces)?);
        let _ = ctx.inner.ctl.call("re-home MR", &Request::RehomeMr { key, chunks: Vec::new() }, &[]);
        return kept;
    }
    movable(&pieces, &segs, &maps)?;
    ctx.inner.ctl.call("re-home MR", &Request::BeginRehome { key }, &[])?;
    std::thread::sleep(GRACE);
    let moved = move_pieces(&mut pieces, &mut segs);
    drop(segs);
    let (fd, old) = match moved {
        Ok(m) => m,
        Err(e) => {
            let _ = ctx.inner.ctl.call("re-home MR", &Request::RehomeMr { key, chunks: Vec::new() }, &[]);
            // (The application may have unmapped the memory during the move.)
            if punch_orphans(&pieces, &SEGMENTS.lock(), &maps_of(&pieces)?) {
                return Ok(());
            }
            return Err(e);
        }
    };
    let len = pieces.last().map_or(0, |p| p.b - p.a);
    let chunk = MrChunk { mr_offset: 0, len: len as u64, fd_offset: 0 };
    let told = ctx.inner.ctl.call("re-home MR", &Request::RehomeMr { key, chunks: vec![chunk] }, &[fd.as_raw_fd()]);
    // The old pages go whatever vrdmad said: our memory is no longer there.
    for (fd, offset, len) in old {
        crate::unshare::punch(fd.as_raw_fd(), offset, len);
    }
    told.map(|_| ())
}

type Segments = std::collections::BTreeMap<usize, crate::mr::Segment>;

/// The mappings over the MR made of `pieces`.
fn maps_of(pieces: &[SharedPiece]) -> Result<Vec<Vma>, Error> {
    let (Some(first), Some(last)) = (pieces.first(), pieces.last()) else {
        return Err(invalid("re-home MR", "not shared"));
    };
    read_maps(first.a, last.b)
}

/// Whether the MR made of `pieces` (over `maps`) can move: no page shared with another MR,
/// its memory still mapped from its memfds, and its first address free to key a new segment.
fn movable(pieces: &[SharedPiece], segs: &Segments, maps: &[Vma]) -> Result<(), Error> {
    let (start, end) = (pieces[0].a, pieces[pieces.len() - 1].b);
    let page = shm::page_size();
    for p in pieces {
        let seg = segs.get(&p.seg_start).ok_or_else(|| invalid("re-home MR", "segment gone"))?;
        if seg.users[(p.a - p.seg_start) / page..(p.b - p.seg_start) / page].iter().any(|n| *n != 1) {
            return Err(invalid("re-home MR", "its pages are shared with another MR"));
        }
        if !run_intact(maps, p.seg_start, seg, p.a, p.b) {
            return Err(invalid("re-home MR", "its memory is no longer mapped from its memfd"));
        }
    }
    // The new segment takes the key `start`: a segment there must be left with no page.
    if let Some(seg) = segs.get(&start) {
        let ours = (end.min(seg.end) - start) / page;
        if seg.users[ours..].iter().any(|n| *n > 0) {
            return Err(invalid("re-home MR", "its first segment holds other MRs' pages"));
        }
    }
    Ok(())
}

/// Whether no page of the MR made of `pieces` is shared with another MR.
fn exclusive(pieces: &[SharedPiece], segs: &Segments) -> bool {
    let page = shm::page_size();
    pieces.iter().all(|p| {
        segs.get(&p.seg_start).is_some_and(|seg| seg.users[(p.a - p.seg_start) / page..(p.b - p.seg_start) / page].iter().all(|n| *n == 1))
    })
}

/// Whether part of the MR made of `pieces` (over `maps`) is no longer mapped from its memfd.
fn partly_unmapped(pieces: &[SharedPiece], segs: &Segments, maps: &[Vma]) -> bool {
    pieces.iter().any(|p| segs.get(&p.seg_start).is_some_and(|seg| !run_intact(maps, p.seg_start, seg, p.a, p.b)))
}

/// Moves what of the MR made of `pieces` (over `maps`) is still mapped from its memfds into
/// private memory at the same addresses, then empties all its memfd pages.
fn take_private(pieces: &[SharedPiece], segs: &Segments, maps: &[Vma]) -> Result<(), Error> {
    let mut result = Ok(());
    for p in pieces {
        let Some(seg) = segs.get(&p.seg_start) else { continue };
        for (x, y) in intact_parts(maps, p.seg_start, seg, p.a, p.b) {
            if let Err(source) = crate::unshare::move_to_private(seg.fd.as_raw_fd(), x - p.seg_start, x, y - x) {
                result = Err(Error::Os { op: "re-home MR", source });
            }
        }
        crate::unshare::punch(seg.fd.as_raw_fd(), p.a - p.seg_start, p.b - p.a);
    }
    result
}

/// Punches out the pages of the MR made of `pieces` (over `maps`) that the application no
/// longer maps from their memfd (no other MR using them); whether none of the MR is mapped
/// any more.
fn punch_orphans(pieces: &[SharedPiece], segs: &Segments, maps: &[Vma]) -> bool {
    let page = shm::page_size();
    let mut all_gone = true;
    for p in pieces {
        let Some(seg) = segs.get(&p.seg_start) else { continue };
        let intact = intact_parts(maps, p.seg_start, seg, p.a, p.b);
        all_gone &= intact.is_empty();
        let orphan = |pg: usize| seg.users[(pg - p.seg_start) / page] == 1 && !intact.iter().any(|&(x, y)| x <= pg && pg < y);
        let mut pg = p.a;
        while pg < p.b {
            let run = pg;
            while pg < p.b && orphan(pg) {
                pg += page;
            }
            if pg > run {
                crate::unshare::punch(seg.fd.as_raw_fd(), run - p.seg_start, pg - run);
            } else {
                pg += page;
            }
        }
    }
    all_gone
}

/// The old pages to punch out once vrdmad has the new memfd.
type OldPages = Vec<(Arc<OwnedFd>, usize, usize)>;

/// Copies the MR made of `pieces` ([`movable`]) onto a new memfd mapped over the same
/// addresses; returns that memfd and the old pages.
fn move_pieces(pieces: &mut Vec<SharedPiece>, segs: &mut Segments) -> Result<(Arc<OwnedFd>, OldPages), Error> {
    let page = shm::page_size();
    let (start, end) = (pieces[0].a, pieces[pieces.len() - 1].b);
    let mut seg = share_gap(start, end)?;
    seg.users.iter_mut().for_each(|n| *n = 1);
    let mut old = Vec::new();
    for p in pieces.iter() {
        let s = segs.get_mut(&p.seg_start).ok_or_else(|| invalid("re-home MR", "segment gone"))?;
        s.users[(p.a - p.seg_start) / page..(p.b - p.seg_start) / page].iter_mut().for_each(|n| *n = 0);
        old.push((s.fd.clone(), p.a - p.seg_start, p.b - p.a));
    }
    segs.retain(|_, s| s.users.iter().any(|n| *n > 0));
    let fd = seg.fd.clone();
    segs.insert(start, seg);
    *pieces = vec![SharedPiece { seg_start: start, a: start, b: end }];
    Ok((fd, old))
}
