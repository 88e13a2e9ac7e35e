//! The connected peer of an RC QP, as the requester's library sees it: the peer's receive
//! ring (or SRQ), its inbound-completion ring, its receive CQ's arm word and eventfd, and
//! the peer MRs mapped so far (by key, revalidated when the peer deregisters any MR).

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::control::{PeerInfo, Reply, Request, MAX_COPY_DATA};
use vrdma_abi::ring::{self, CompEntry, CompRing, QpRegionLayout, RecvRing, RecvRingLayout, Sge, StagingRing};
use vrdma_abi::shm::{MemRegion, SharedMapping};
use vrdma_abi::verbs::{access, QpState, WcStatus};
use vrdma_core::access::{check, MrBounds, Need};
use vrdma_core::sg::{self, Atomic, Span};

use crate::device::Context;
use crate::error::Error;
use crate::mediated::MedChannel;
use crate::qp::map_qp_region;

mod copy_path;

pub(crate) use copy_path::CopyStaging;

pub(crate) struct PeerMr {
    /// The peer's memfds mapped here, or `None` for a copied MR (vrdmad copies each access
    /// through the peer's memory: the copying fallback).
    mapping: Option<SharedMapping>,
    span_start: u64,
    bounds: MrBounds,
}

impl PeerMr {
    /// The span of `[addr, addr+len)` of a mapped MR if the MR grants `need` there.
    #[inline]
    fn span_in(&self, mapping: &SharedMapping, addr: u64, len: u64, need: Need) -> Result<Span, WcStatus> {
        check(&self.bounds, addr, len, need)?;
        Ok(Span { mem: *mapping.region(), offset: (addr - self.span_start) as usize, len: len as usize })
    }
}

/// Bytes of a copied peer MR staged in this process for one work request: filled from the
/// peer before a READ, or written to it by [`Peer::flush`] after a WRITE or receive.
struct Staged {
    key: u32,
    addr: u64,
    to_peer: bool,
    need_remote: bool,
    buf: Box<[u8]>,
}

pub(crate) struct Peer {
    region: SharedMapping,
    rq: Option<RecvRing>,
    comp: CompRing,
    /// The peer QP's staging ring: where this library puts the SENDs to it.
    staging: StagingRing,
    srq: Option<(SharedMapping, RecvRing)>,
    cq_region: SharedMapping,
    cq_eventfd: OwnedFd,
    mrs: HashMap<u32, Arc<PeerMr>>,
    last: Option<(u32, Arc<PeerMr>)>,
    epoch: u64,
    comp_head: u64,
    /// For a UD destination: its QPN (MRs are mapped through `MapUdPeerMr`).
    ud_dest: Option<u32>,
    /// Staged spans of copied MRs of the current work request.
    staged: Vec<Staged>,
    /// The peer flagged a receive remote-writable that was not: its SENDs are staged from
    /// then on, whatever its flags say (one refused key, not one per SEND).
    zero_copy_refused: bool,
}

/// How a UD QP reaches one destination.
pub(crate) enum UdRoute {
    /// Same host: the library delivers into the destination's shared state.
    Direct(Box<Peer>),
    /// Another host: datagrams go to vrdmad on the QP's datagram socket.
    Remote(Arc<OwnedFd>),
}

/// How an RC QP reaches its peer.
pub(crate) enum Connection {
    /// Same host: the library executes WRs against the peer's shared state.
    Direct(Peer),
    /// Through vrdmad's engine.
    Mediated(MedChannel),
}

fn bad(op: &'static str) -> Error {
    Error::UnexpectedReply { op }
}

impl Peer {
    /// Asks vrdmad to connect `qpn` to `dest_qpn` at `dgid`: maps the peer's state (direct),
    /// or the channel to vrdmad's engine (mediated), whichever vrdmad chose.
    pub(crate) fn connect(
        ctx: &Context,
        qpn: u32,
        qp: std::sync::Weak<crate::qp::QpInner>,
        dgid: [u8; 16],
        dest_qpn: u32,
    ) -> Result<Connection, Error> {
        let op = "modify_qp(RTR)";
        let (r, fds) = ctx.inner.ctl.call(op, &Request::ConnectQp { qpn, dgid, dest_qpn }, &[])?;
        match r {
            Reply::Connected(info) => Ok(Connection::Direct(Peer::from_reply(info, fds)?)),
            r @ Reply::ConnectedMediated { .. } => Ok(Connection::Mediated(MedChannel::from_reply(qpn, dest_qpn, qp, &r, fds)?)),
            _ => Err(bad(op)),
        }
    }

    /// Asks vrdmad for UD QP `dest_qpn` at `dgid` as a destination of UD QP `qpn`: mapped
    /// (same host), or reached through the QP's datagram socket to vrdmad (another host).
    pub(crate) fn resolve_ud(ctx: &Context, qpn: u32, dgid: [u8; 16], dest_qpn: u32) -> Result<UdRoute, Error> {
        let op = "post_send(UD)";
        let (r, mut fds) = ctx.inner.ctl.call(op, &Request::ResolveUd { qpn, dgid, dest_qpn }, &[])?;
        match r {
            Reply::Connected(info) => {
                let mut p = Peer::from_reply(info, fds)?;
                p.ud_dest = Some(dest_qpn);
                Ok(UdRoute::Direct(Box::new(p)))
            }
            Reply::UdRemote if fds.len() == 1 => Ok(UdRoute::Remote(Arc::new(fds.remove(0)))),
            _ => Err(bad(op)),
        }
    }

    /// The destination's Q_Key (UD).
    pub(crate) fn qkey(&self) -> u32 {
        self.region.region().atomic_u64(ring::QP_QKEY).map(|w| w.load(Ordering::Acquire) as u32).unwrap_or(0)
    }

    /// Takes the destination's UD receive lock (several senders may deliver to one UD QP);
    /// `None` if a sender holds it for long (crashed: the datagram is dropped, as UD may).
    pub(crate) fn ud_lock(&self) -> Option<UdGuard> {
        let w = self.region.region().atomic_u64(ring::QP_UD_LOCK).ok()?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(50);
        let mut spins = 0u32;
        loop {
            if w.compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return Some(UdGuard { region: *self.region.region() });
            }
            spins += 1;
            if spins < 128 {
                std::hint::spin_loop();
            } else {
                if std::time::Instant::now() > deadline {
                    return None;
                }
                std::thread::yield_now();
            }
        }
    }

    fn from_reply(info: PeerInfo, mut fds: Vec<OwnedFd>) -> Result<Peer, Error> {
        let op = "modify_qp(RTR)";
        let want = 3 + usize::from(info.srq_ring.is_some());
        if fds.len() != want {
            return Err(bad(op));
        }
        let shm_err = |source| Error::Shm { op, source };
        let ring_layout = |(e, s): (u32, u32)| -> Result<RecvRingLayout, Error> {
            if e == 0 || !e.is_power_of_two() || e > 1 << 16 || s == 0 || s > 64 {
                return Err(bad(op));
            }
            Ok(RecvRingLayout::new(e as usize, s as usize))
        };
        if info.comp_entries == 0 || !info.comp_entries.is_power_of_two() || info.comp_entries > 1 << 16 {
            return Err(bad(op));
        }
        let srq = match info.srq_ring {
            Some(r) => {
                let l = ring_layout(r)?;
                let fd = fds.pop().expect("counted");
                let m = SharedMapping::map_sealed(fd.as_fd(), ring::srq_region_size(l), true).map_err(shm_err)?;
                let ring = RecvRing::new(m.region().subregion(ring::PAGE, l.size()).map_err(shm_err)?, l).map_err(shm_err)?;
                Some((m, ring))
            }
            None => None,
        };
        let cq_eventfd = fds.pop().expect("counted");
        let cq_fd = fds.pop().expect("counted");
        let qp_fd = fds.pop().expect("counted");
        let rq_layout = info.rq_ring.map(ring_layout).transpose()?;
        let layout = QpRegionLayout::new(rq_layout, info.comp_entries as usize);
        let (region, rq, comp, staging) = map_qp_region(qp_fd.as_fd(), &layout).map_err(shm_err)?;
        let cq_region = SharedMapping::map_sealed(cq_fd.as_fd(), ring::CQ_REGION_SIZE, true).map_err(shm_err)?;
        let epoch = region.region().load_u64(ring::QP_MR_EPOCH).unwrap_or(0);
        Ok(Peer {
            region,
            rq,
            comp,
            staging,
            srq,
            cq_region,
            cq_eventfd,
            mrs: HashMap::new(),
            last: None,
            epoch,
            comp_head: 0,
            ud_dest: None,
            staged: Vec::new(),
            zero_copy_refused: false,
        })
    }

    /// The peer QP's current state, as its owner published it.
    pub(crate) fn state(&self) -> Option<QpState> {
        let v = self.region.region().atomic_u64(ring::QP_OWNER_STATE).ok()?.load(Ordering::Acquire);
        QpState::from_u32(v as u32)
    }

    /// The peer's RNR timer code.
    pub(crate) fn min_rnr_timer(&self) -> u8 {
        self.region.region().load_u64(ring::QP_RESERVED).unwrap_or(12) as u8
    }

    /// Takes the next receive WR of the peer (its RQ or SRQ) into `sges`; returns its
    /// wr_id and whether it came from an SRQ, or `None` (RNR).
    /// Whether the peer has a receive posted now (a hint for retrying a receiver-not-ready
    /// send before its RNR timer: the responder is ready again, so waiting gains nothing).
    pub(crate) fn has_recv(&self) -> bool {
        match (&self.srq, &self.rq) {
            (Some((_, r)), _) => r.has_entries(),
            (None, Some(r)) => r.has_entries(),
            (None, None) => false,
        }
    }

    pub(crate) fn take_recv(&self, sges: &mut Vec<Sge>) -> Option<(u64, bool)> {
        self.take_recv_flagged(sges).map(|(id, srq, _)| (id, srq))
    }

    /// [`Peer::take_recv`], with whether the receive may be written directly (its owner
    /// flagged it `RECV_REMOTE_WRITABLE`, and this peer never lied about that).
    pub(crate) fn take_recv_flagged(&self, sges: &mut Vec<Sge>) -> Option<(u64, bool, bool)> {
        let (ring, srq) = match (&self.srq, &self.rq) {
            (Some((_, r)), _) => (r, true),
            (None, Some(r)) => (r, false),
            (None, None) => return None,
        };
        let (id, flags) = ring.take_into_flagged(sges).ok().flatten()?;
        Some((id, srq, flags & ring::RECV_REMOTE_WRITABLE != 0 && !self.zero_copy_refused))
    }

    /// Stops trusting the peer's `RECV_REMOTE_WRITABLE` flags.
    pub(crate) fn refuse_zero_copy(&mut self) {
        self.zero_copy_refused = true;
    }

    /// Delivers a receive completion to the peer and wakes it if it asked.
    pub(crate) fn complete(&mut self, e: &CompEntry) -> bool {
        let ok = self.comp.push_cached(e, &mut self.comp_head).unwrap_or(false);
        if ok {
            let solicited = e.flags & ring::COMP_SOLICITED != 0 || e.status != 0;
            crate::cq::maybe_notify(&self.cq_region, &self.cq_eventfd, solicited);
        }
        ok
    }

    /// The peer QP's staging ring.
    #[inline]
    pub(crate) fn staging(&self) -> &StagingRing {
        &self.staging
    }

    /// Wakes the peer if it sleeps on its receive CQ's channel (armed for any completion,
    /// or solicited ones): it drains its staging ring when it polls, and a SEND that did not
    /// fit waits for that.
    pub(crate) fn wake(&self) {
        crate::cq::maybe_notify(&self.cq_region, &self.cq_eventfd, true);
    }

    /// Moves the peer QP to ERR (a fatal error it must see, like a responder-side failure).
    pub(crate) fn request_error(&self) {
        if let Ok(w) = self.region.region().atomic_u64(ring::QP_ERROR_REQUEST) {
            w.store(ring::QP_ERR_REMOTE, Ordering::SeqCst);
        }
        crate::cq::maybe_notify(&self.cq_region, &self.cq_eventfd, true);
    }

    /// The peer's MR generation (bumped when it deregisters an MR: mapped MRs are stale).
    #[inline]
    fn mr_epoch(&self) -> u64 {
        self.region.region().atomic_u64(ring::QP_MR_EPOCH).map(|w| w.load(Ordering::Acquire)).unwrap_or(0)
    }

    /// The span `[addr, addr+len)` if `key` is the MR used last, mapped, and no MR was
    /// deregistered since: the data path's usual case, answered without a call, so that the
    /// span stays in registers (`None`: ask [`Peer::span`]). A span returned through a
    /// called function's memory and read back in wider loads than it was written stalled
    /// the store buffer on every WRITE in one build and not in another.
    #[inline(always)]
    pub(crate) fn span_cached(&self, key: u32, addr: u64, len: u64, need: Need) -> Option<Result<Span, WcStatus>> {
        // Zero-length RDMA names no memory (see `span`): not the usual case.
        if len == 0 {
            return None;
        }
        self.cached(self.mr_epoch(), key, addr, len, need)
    }

    /// The span from the one-entry cache, if `epoch` is current and `key` the MR there (mapped).
    #[inline(always)]
    fn cached(&self, epoch: u64, key: u32, addr: u64, len: u64, need: Need) -> Option<Result<Span, WcStatus>> {
        if epoch != self.epoch {
            return None;
        }
        let (k, m) = self.last.as_ref()?;
        let map = m.mapping.as_ref()?;
        (*k == key).then(|| m.span_in(map, addr, len, need))
    }

    /// The span `[addr, addr+len)` of the peer MR with `key` if it grants `need` there.
    /// The MR is mapped on first use, after vrdmad checks it belongs to the peer QP's PD.
    /// A copied MR's span is staged here: call [`Peer::flush`] once the work request wrote it.
    #[inline]
    pub(crate) fn span(&mut self, ctx: &Context, my_qpn: u32, key: u32, addr: u64, len: u64, need: Need) -> Result<Span, WcStatus> {
        if len == 0 && matches!(need, Need::RemoteWrite | Need::RemoteRead) {
            // A zero-length RDMA WRITE or READ names no memory: its R_Key and address are not
            // checked (IB spec C9-88). UCX flushes a QP with one (rkey 0).
            return Ok(Span { mem: MemRegion::empty(), offset: 0, len: 0 });
        }
        let epoch = self.mr_epoch();
        // The usual case (same MR as last time, none deregistered since) inline.
        if let Some(r) = self.cached(epoch, key, addr, len, need) {
            return r;
        }
        self.span_slow(ctx, my_qpn, key, addr, len, need, epoch)
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(never)]
    fn span_slow(&mut self, ctx: &Context, my_qpn: u32, key: u32, addr: u64, len: u64, need: Need, epoch: u64) -> Result<Span, WcStatus> {
        let m = self.peer_mr(ctx, my_qpn, key, epoch)?;
        match &m.mapping {
            Some(map) => m.span_in(map, addr, len, need),
            None => {
                check(&m.bounds, addr, len, need)?;
                self.stage(ctx, my_qpn, key, addr, len as usize, need)
            }
        }
    }

    /// The peer MR with `key` (cached; the cache is dropped when the peer deregistered an MR).
    fn peer_mr(&mut self, ctx: &Context, my_qpn: u32, key: u32, epoch: u64) -> Result<Arc<PeerMr>, WcStatus> {
        if epoch != self.epoch {
            self.mrs.clear();
            self.last = None;
            self.epoch = epoch;
        }
        if let Some((k, m)) = &self.last {
            if *k == key {
                return Ok(m.clone());
            }
        }
        let m = match self.mrs.get(&key) {
            Some(m) => m.clone(),
            None => {
                let m = Arc::new(map_peer_mr(ctx, my_qpn, self.ud_dest, key).map_err(|_| WcStatus::RemAccessErr)?);
                self.mrs.insert(key, m.clone());
                m
            }
        };
        self.last = Some((key, m.clone()));
        Ok(m)
    }

    /// Stages `len` bytes at `addr` of copied MR `key`: read from the peer now for a READ,
    /// else zeroed, to be written to the peer by [`Peer::flush`].
    fn stage(&mut self, ctx: &Context, my_qpn: u32, key: u32, addr: u64, len: usize, need: Need) -> Result<Span, WcStatus> {
        let mut buf = vec![0u8; len].into_boxed_slice();
        let to_peer = need != Need::RemoteRead;
        if !to_peer {
            let dest_qpn = self.ud_dest.unwrap_or(0);
            let mut at = 0;
            while at < len {
                let n = (len - at).min(MAX_COPY_DATA);
                let req = Request::PeerMrRead { qpn: my_qpn, dest_qpn, key, addr: addr + at as u64, len: n as u32 };
                match copy_call(ctx, "RDMA READ (copied MR)", &req) {
                    Ok((Reply::Bytes { data }, _)) if data.len() == n => buf[at..at + n].copy_from_slice(&data),
                    _ => return Err(WcStatus::RemAccessErr),
                }
                at += n;
            }
        }
        // SAFETY: the boxed bytes stay where they are (moving the box moves only its pointer)
        // and live in `self.staged` until the next `flush`, after the caller's last use of the
        // span in this work request.
        let mem = unsafe { MemRegion::from_raw(buf.as_mut_ptr(), len) };
        self.staged.push(Staged { key, addr, to_peer, need_remote: need == Need::RemoteWrite, buf });
        Ok(Span { mem, offset: 0, len })
    }

    /// Ends a work request's use of copied MRs: writes to the peer the staged bytes among the
    /// first `written` bytes of `spans` (the scatter list the request filled, in order) and
    /// forgets all staged spans. Nothing to do (inline) for mapped MRs.
    #[inline]
    pub(crate) fn flush(&mut self, ctx: &Context, my_qpn: u32, spans: &[Span], written: u64) -> Result<(), WcStatus> {
        if self.staged.is_empty() {
            return Ok(());
        }
        self.flush_staged(ctx, my_qpn, spans, written)
    }

    #[inline(never)]
    fn flush_staged(&mut self, ctx: &Context, my_qpn: u32, spans: &[Span], written: u64) -> Result<(), WcStatus> {
        let staged = std::mem::take(&mut self.staged);
        let dest_qpn = self.ud_dest.unwrap_or(0);
        let mut left = written as usize;
        for sp in spans {
            if left == 0 {
                break;
            }
            let n = sp.len.min(left);
            left -= n;
            let Some(st) = staged.iter().find(|st| st.to_peer && st.buf.as_ptr() as usize == sp.mem.addr()) else { continue };
            let mut at = sp.offset;
            let end = sp.offset + n;
            while at < end {
                let step = (end - at).min(MAX_COPY_DATA);
                let req = Request::PeerMrWrite {
                    qpn: my_qpn,
                    dest_qpn,
                    key: st.key,
                    addr: st.addr + at as u64,
                    need_remote: st.need_remote,
                    data: st.buf[at..at + step].to_vec(),
                };
                if !matches!(copy_call(ctx, "RDMA WRITE (copied MR)", &req), Ok((Reply::Ok, _))) {
                    return Err(WcStatus::RemAccessErr);
                }
                at += step;
            }
        }
        Ok(())
    }

    /// An RDMA atomic on the 8 bytes at `addr` of the peer MR `key`; the original value.
    pub(crate) fn atomic(&mut self, ctx: &Context, my_qpn: u32, key: u32, addr: u64, op: Atomic) -> Result<u64, WcStatus> {
        let m = self.peer_mr(ctx, my_qpn, key, self.mr_epoch())?;
        if let Some(map) = &m.mapping {
            let target = m.span_in(map, addr, 8, Need::RemoteAtomic)?;
            return sg::atomic(&target.mem, target.offset, op);
        }
        check(&m.bounds, addr, 8, Need::RemoteAtomic)?;
        let (cmp_swap, compare_add, swap) = match op {
            Atomic::CmpSwap { compare, swap } => (true, compare, swap),
            Atomic::FetchAdd { add } => (false, add, 0),
        };
        let req = Request::PeerMrAtomic { qpn: my_qpn, dest_qpn: self.ud_dest.unwrap_or(0), key, addr, cmp_swap, compare_add, swap };
        match copy_call(ctx, "RDMA atomic (copied MR)", &req) {
            Ok((Reply::Atomic { old }, _)) => Ok(old),
            Err(Error::Refused { errno: libc::EINVAL, .. }) => Err(WcStatus::RemInvReqErr),
            _ => Err(WcStatus::RemAccessErr),
        }
    }
}

/// A copy request through the peer's memory; EBUSY (its owner is moving the MR onto shared
/// memory, and vrdmad waits for copies under way before the move) is asked again, for at
/// most a few seconds, like `map_peer_mr`.
fn copy_call(ctx: &Context, op: &'static str, req: &Request) -> Result<(Reply, Vec<OwnedFd>), Error> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match ctx.inner.ctl.call(op, req, &[]) {
            Err(Error::Refused { errno: libc::EBUSY, .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
            r => return r,
        }
    }
}

fn map_peer_mr(ctx: &Context, my_qpn: u32, ud_dest: Option<u32>, key: u32) -> Result<PeerMr, Error> {
    let op = "map peer MR";
    let req = match ud_dest {
        Some(dest_qpn) => Request::MapUdPeerMr { qpn: my_qpn, dest_qpn, key },
        None => Request::MapPeerMr { qpn: my_qpn, key },
    };
    // EBUSY: the owner is moving the MR to new pages (a peer lost its right to it); it
    // takes a copy of the MR, so wait for it (at most a few seconds).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let (r, fds) = loop {
        match ctx.inner.ctl.call(op, &req, &[]) {
            Err(Error::Refused { errno: libc::EBUSY, .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            r => break r?,
        }
    };
    let Reply::PeerMr { addr, length, access: acc, chunks } = r else {
        return Err(bad(op));
    };
    if fds.len() != chunks.len() {
        return Err(bad(op));
    }
    let page = ring::PAGE as u64;
    let span_start = addr & !(page - 1);
    let span_len = addr.checked_add(length).ok_or(bad(op))?.div_ceil(page) * page - span_start;
    if chunks.is_empty() {
        return Ok(PeerMr { mapping: None, span_start, bounds: MrBounds { addr, length, access: acc } });
    }
    // vrdmad hands read-only descriptors of an MR a peer may only read.
    let writable = acc & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0;
    let mapping = SharedMapping::reserve(span_len as usize).map_err(|source| Error::Shm { op, source })?;
    for (c, fd) in chunks.iter().zip(&fds) {
        mapping
            .place_fd(c.mr_offset as usize, fd.as_fd(), c.fd_offset as usize, c.len as usize, writable)
            .map_err(|source| Error::Shm { op, source })?;
    }
    Ok(PeerMr { mapping: Some(mapping), span_start, bounds: MrBounds { addr, length, access: acc } })
}

/// Holds a UD destination's receive lock (the destination's control page stays mapped while
/// its `Peer` lives, which outlives the guard).
pub(crate) struct UdGuard {
    region: vrdma_abi::shm::MemRegion,
}

impl Drop for UdGuard {
    fn drop(&mut self) {
        if let Ok(w) = self.region.atomic_u64(ring::QP_UD_LOCK) {
            w.store(0, Ordering::Release);
        }
    }
}
