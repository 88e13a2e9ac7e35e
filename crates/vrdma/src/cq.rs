//! Completion queues and completion channels.
//!
//! A CQ gathers completions from two kinds of source: completions its own process
//! generated (sends it executed, flushes) in a local queue, and the inbound-completion
//! rings of the QPs that use it as receive CQ, which connected peers fill. Polling drains
//! both. Events: the arm word lives in the CQ's shared page so a peer that adds a
//! completion can see whether to wake this process through the CQ's eventfd; a completion
//! channel is an epoll set of its CQs' eventfds.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use vrdma_abi::control::{Reply, Request};
use vrdma_abi::fd::{drain_eventfd, signal_eventfd};
use vrdma_abi::ring::{self, CompEntry};
use vrdma_abi::shm::SharedMapping;
use vrdma_abi::verbs::{WcOpcode, WcStatus};

use crate::device::Context;
use crate::error::{invalid, Error};
use crate::idle::{self, EmptyPolls};
use crate::mediated::MedShared;
use crate::qp::QpInner;
use crate::recv_list::RecvQps;
use crate::spin::SpinLock;

/// A work completion (`ibv_wc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wc {
    /// The WR's identifier.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Opcode.
    pub opcode: WcOpcode,
    /// Bytes transferred (receives, READ, atomics).
    pub byte_len: u32,
    /// Immediate data (network order as posted), valid with `wc_flags::WITH_IMM`.
    pub imm_data: u32,
    /// Local QP number.
    pub qp_num: u32,
    /// Remote QP number (receives).
    pub src_qp: u32,
    /// `wc_flags::*`.
    pub wc_flags: u32,
    /// Vendor error (0).
    pub vendor_err: u32,
}

impl Wc {
    /// A slot to poll into (its contents are overwritten by every completion polled).
    pub const EMPTY: Wc = Wc {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm_data: 0,
        qp_num: 0,
        src_qp: 0,
        wc_flags: 0,
        vendor_err: 0,
    };
}

impl Wc {
    pub(crate) fn new(wr_id: u64, status: WcStatus, opcode: WcOpcode, qp_num: u32) -> Wc {
        Wc { wr_id, status, opcode, byte_len: 0, imm_data: 0, qp_num, src_qp: 0, wc_flags: 0, vendor_err: 0 }
    }
}

pub(crate) struct CqInner {
    pub(crate) ctx: Context,
    pub(crate) handle: u32,
    pub(crate) capacity: usize,
    region: SharedMapping,
    eventfd: OwnedFd,
    channel: Option<CompChannel>,
    local: SpinLock<VecDeque<Wc>>,
    local_len: AtomicUsize,
    /// QPs whose inbound completions arrive here.
    pub(crate) recv_qps: RecvQps,
    /// Channels of mediated QPs sending here: the engine writes their send completions.
    mediated: SpinLock<Vec<Arc<MedShared>>>,
    mediated_count: AtomicUsize,
    /// QPs sending here that have work waiting (RNR, peer not ready).
    pub(crate) waiting_qps: Mutex<Vec<Weak<QpInner>>>,
    pub(crate) waiting: AtomicUsize,
    events_acked: AtomicU32,
    /// The current run of empty polls: past a threshold, polls yield the CPU.
    empty_polls: EmptyPolls,
}

/// A completion queue.
#[derive(Clone)]
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
}

impl Context {
    /// Creates a CQ of at least `cqe` entries, with events delivered to `channel` if given.
    pub fn create_cq(&self, cqe: u32, channel: Option<&CompChannel>) -> Result<Cq, Error> {
        let (r, mut fds) = self.inner.ctl.call("create_cq", &Request::CreateCq { cqe }, &[])?;
        let Reply::Cq { cq } = r else {
            return Err(Error::UnexpectedReply { op: "create_cq" });
        };
        if fds.len() != 2 {
            return Err(Error::UnexpectedReply { op: "create_cq" });
        }
        let eventfd = fds.pop().expect("two fds");
        let region_fd = fds.pop().expect("two fds");
        let region = SharedMapping::map_sealed(region_fd.as_fd(), ring::CQ_REGION_SIZE, true)
            .map_err(|source| Error::Shm { op: "create_cq", source })?;
        let inner = Arc::new(CqInner {
            ctx: self.clone(),
            handle: cq,
            capacity: cqe as usize,
            region,
            eventfd,
            channel: channel.cloned(),
            local: SpinLock::new(VecDeque::with_capacity(cqe as usize)),
            local_len: AtomicUsize::new(0),
            recv_qps: RecvQps::new(),
            mediated: SpinLock::new(Vec::new()),
            mediated_count: AtomicUsize::new(0),
            waiting_qps: Mutex::new(Vec::new()),
            waiting: AtomicUsize::new(0),
            events_acked: AtomicU32::new(0),
            empty_polls: EmptyPolls::new(idle::yield_after()),
        });
        if let Some(ch) = channel {
            ch.add(&inner)?;
            // Tells whoever completes into this CQ that events may be wanted at all.
            if let Ok(w) = inner.region.region().atomic_u64(ring::CQ_HAS_CHANNEL) {
                w.store(1, Ordering::Release);
            }
        }
        Ok(Cq { inner })
    }
}

/// Delivers an event if the CQ behind `arm`/`eventfd` is armed for this completion.
pub(crate) fn maybe_notify(arm_region: &SharedMapping, eventfd: &OwnedFd, solicited_or_error: bool) {
    // A CQ without a completion channel is never armed (its owner sets CQ_HAS_CHANNEL once,
    // before any QP can complete into it): no fence, no arm word, on every completion.
    if arm_region.region().load_u64(ring::CQ_HAS_CHANNEL).is_ok_and(|c| c == 0) {
        return;
    }
    let Ok(arm) = arm_region.region().atomic_u64(ring::CQ_ARM) else {
        return;
    };
    std::sync::atomic::fence(Ordering::SeqCst);
    let a = arm.load(Ordering::SeqCst);
    let fire = a == ring::CQ_ARM_NEXT || (a == ring::CQ_ARM_SOLICITED && solicited_or_error);
    if fire && arm.compare_exchange(a, ring::CQ_ARM_NONE, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
        signal_eventfd(eventfd);
    }
}

impl CqInner {
    /// Adds a completion of this process with only the common fields set (wr_id, status,
    /// opcode, QP number, byte count): they come in registers and are written straight into
    /// the queue, where a `Wc` passed by value is built on the caller's stack and copied.
    /// Out of line: that is the code whose gain was measured (docs/measurements.md);
    /// inlined into its callers, one comparison on a noisy machine was inconclusive.
    #[inline(never)]
    pub(crate) fn push_local_for(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode, qpn: u32, byte_len: u32) {
        let mut w = Wc::new(wr_id, status, opcode, qpn);
        w.byte_len = byte_len;
        self.push(w);
    }

    /// Adds a completion generated by this process.
    pub(crate) fn push_local(&self, wc: Wc) {
        self.push(wc);
    }

    #[inline(always)]
    fn push(&self, wc: Wc) {
        {
            let mut q = self.local.lock();
            q.push_back(wc);
            self.local_len.store(q.len(), Ordering::Release);
        }
        // Without a channel no event can be requested (req_notify fails), so the arm word,
        // and the full fence before reading it, are only for CQs that have one.
        if self.channel.is_some() {
            maybe_notify(&self.region, &self.eventfd, wc.status != WcStatus::Success);
        }
    }

    /// Starts polling a mediated QP's send completions.
    pub(crate) fn add_mediated(&self, c: Arc<MedShared>) {
        let mut v = self.mediated.lock();
        v.push(c);
        self.mediated_count.store(v.len(), Ordering::Release);
    }

    /// Stops polling a mediated QP's send completions.
    pub(crate) fn remove_mediated(&self, c: &Arc<MedShared>) {
        let mut v = self.mediated.lock();
        v.retain(|x| !Arc::ptr_eq(x, c));
        self.mediated_count.store(v.len(), Ordering::Release);
    }

    /// Mediated QPs' send completions into completions `n..max` of `put`; the new count.
    fn poll_mediated<P: FnMut(usize, Wc)>(&self, mut n: usize, max: usize, put: &mut P) -> usize {
        let chans = self.mediated.lock();
        let mut failed = Vec::new();
        for c in chans.iter() {
            let before = n;
            while n < max {
                let Some(e) = c.pop() else { break };
                put(n, comp_to_wc(&e, c.qpn));
                n += 1;
                if e.status != WcStatus::Success as u8 && e.status != WcStatus::WrFlushErr as u8 {
                    failed.push(c.qp.clone());
                }
            }
            if n > before {
                c.after_poll();
            }
            if n == max {
                break;
            }
        }
        drop(chans);
        // The engine's error: the QP is in ERR by the time the caller sees the completion
        // (after the list lock: the QP lock is taken before it elsewhere).
        for q in failed.iter().filter_map(std::sync::Weak::upgrade) {
            q.enter_error_if_live();
        }
        n
    }

    pub(crate) fn region(&self) -> &SharedMapping {
        &self.region
    }

    pub(crate) fn eventfd(&self) -> &OwnedFd {
        &self.eventfd
    }

    /// Runs the waiting work of QPs that send into this CQ.
    #[inline]
    pub(crate) fn progress(&self) {
        if self.waiting.load(Ordering::Acquire) != 0 {
            self.progress_waiting();
        }
    }

    #[cold]
    fn progress_waiting(&self) {
        let qps: Vec<Arc<QpInner>> = self.waiting_qps.lock().iter().filter_map(Weak::upgrade).collect();
        for q in qps {
            q.progress();
        }
    }

    /// Polls up to `max` completions, handing completion `i` (0, 1, …) to `put(i, wc)`;
    /// returns how many. A long run of empty polls gives the CPU away (`idle.rs`).
    #[inline]
    fn poll<P: FnMut(usize, Wc)>(&self, max: usize, put: &mut P) -> usize {
        let n = self.poll_sources(max, put);
        if max != 0 {
            self.empty_polls.record(n);
        }
        n
    }

    /// One pass over every source of completions: the local queue, mediated channels, the
    /// receive QPs' inbound rings.
    #[inline]
    fn poll_sources<P: FnMut(usize, Wc)>(&self, max: usize, put: &mut P) -> usize {
        self.progress();
        let mut n = 0;
        if self.local_len.load(Ordering::Acquire) > 0 {
            let mut q = self.local.lock();
            while n < max {
                let Some(wc) = q.pop_front() else { break };
                put(n, wc);
                n += 1;
            }
            self.local_len.store(q.len(), Ordering::Release);
        }
        if n < max && self.mediated_count.load(Ordering::Acquire) > 0 {
            n = self.poll_mediated(n, max, put);
        }
        if n == max || self.recv_qps.is_empty() || self.recv_qps.surely_idle() {
            return n;
        }
        #[cfg(test)]
        crate::recv_list::tests::between_check_and_lock();
        let qps = self.recv_qps.lock();
        for qp in qps.iter() {
            n = qp.poll_inbound(n, max, put);
            if n == max {
                break;
            }
        }
        n
    }
}

pub(crate) fn comp_to_wc(e: &CompEntry, qpn: u32) -> Wc {
    Wc {
        wr_id: e.wr_id,
        status: WcStatus::from_u8(e.status).unwrap_or(WcStatus::GeneralErr),
        opcode: WcOpcode::from_u8(e.opcode).unwrap_or(WcOpcode::Recv),
        byte_len: e.byte_len,
        imm_data: e.imm,
        qp_num: qpn,
        src_qp: e.src_qp,
        wc_flags: u32::from(e.wc_flags),
        vendor_err: 0,
    }
}

impl Cq {
    /// Polls up to `out.len()` completions; returns how many were written.
    pub fn poll(&self, out: &mut [Wc]) -> usize {
        self.inner.poll(out.len(), &mut |i, wc| out[i] = wc)
    }

    /// Polls up to `max` completions, handing the `i`-th (from 0) to `put(i, wc)`; returns
    /// how many. For callers with their own completion format (the drop-in writes
    /// `ibv_wc`s straight into the application's array: no intermediate buffer).
    #[inline]
    pub fn poll_with<P: FnMut(usize, Wc)>(&self, max: usize, mut put: P) -> usize {
        self.inner.poll(max, &mut put)
    }

    /// Arms the CQ: the next completion (or, with `solicited_only`, the next solicited or
    /// error completion) sends an event to the CQ's channel.
    pub fn req_notify(&self, solicited_only: bool) -> Result<(), Error> {
        if self.inner.channel.is_none() {
            return Err(invalid("req_notify_cq", "CQ has no completion channel"));
        }
        let arm = self.inner.region.region().atomic_u64(ring::CQ_ARM).map_err(|source| Error::Shm { op: "req_notify_cq", source })?;
        arm.store(if solicited_only { ring::CQ_ARM_SOLICITED } else { ring::CQ_ARM_NEXT }, Ordering::SeqCst);
        Ok(())
    }

    /// Acknowledges `n` events (`ibv_ack_cq_events`).
    pub fn ack_events(&self, n: u32) {
        self.inner.events_acked.fetch_add(n, Ordering::Relaxed);
    }

    /// CQ handle (unique within the vNIC).
    pub fn handle(&self) -> u32 {
        self.inner.handle
    }

    /// Number of entries requested.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Same CQ?
    pub fn ptr_eq(&self, other: &Cq) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        if let Some(ch) = &self.channel {
            ch.remove(self.handle, &self.eventfd);
        }
        let _ = self.ctx.inner.ctl.call("destroy_cq", &Request::DestroyCq { cq: self.handle }, &[]);
    }
}

/// A completion channel (`ibv_comp_channel`): an epoll set of its CQs' eventfds.
#[derive(Clone)]
pub struct CompChannel {
    inner: Arc<ChannelInner>,
}

struct ChannelInner {
    epfd: OwnedFd,
    cqs: Mutex<Vec<(u32, Weak<CqInner>)>>,
}

impl Context {
    /// Creates a completion channel.
    pub fn create_comp_channel(&self) -> Result<CompChannel, Error> {
        // SAFETY: plain epoll_create1 call.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(Error::Os { op: "create_comp_channel", source: std::io::Error::last_os_error() });
        }
        // SAFETY: fd is new and ours.
        let epfd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(CompChannel { inner: Arc::new(ChannelInner { epfd, cqs: Mutex::new(Vec::new()) }) })
    }
}

impl CompChannel {
    fn add(&self, cq: &Arc<CqInner>) -> Result<(), Error> {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: u64::from(cq.handle) };
        // SAFETY: registering a live eventfd with our epoll set.
        let rc = unsafe { libc::epoll_ctl(self.inner.epfd.as_raw_fd(), libc::EPOLL_CTL_ADD, cq.eventfd.as_raw_fd(), &mut ev) };
        if rc != 0 {
            return Err(Error::Os { op: "create_cq", source: std::io::Error::last_os_error() });
        }
        self.inner.cqs.lock().push((cq.handle, Arc::downgrade(cq)));
        Ok(())
    }

    fn remove(&self, handle: u32, eventfd: &OwnedFd) {
        // SAFETY: deregistering an fd from our epoll set.
        unsafe { libc::epoll_ctl(self.inner.epfd.as_raw_fd(), libc::EPOLL_CTL_DEL, eventfd.as_raw_fd(), std::ptr::null_mut()) };
        self.inner.cqs.lock().retain(|(h, _)| *h != handle);
    }

    /// The pollable fd (`ibv_comp_channel.fd`).
    pub fn fd(&self) -> i32 {
        self.inner.epfd.as_raw_fd()
    }

    /// Waits for the next CQ event (`ibv_get_cq_event`); `None` waits forever. Returns the
    /// CQ that fired, or `None` on timeout.
    pub fn get_cq_event(&self, timeout: Option<Duration>) -> Result<Option<Cq>, Error> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            // Short slices let waiting sends (RNR retries) of this channel's CQs progress
            // while the application sleeps.
            let slice_ms = match deadline {
                Some(d) => d.saturating_duration_since(std::time::Instant::now()).as_millis().min(10) as i32,
                None => 10,
            };
            let mut ev = libc::epoll_event { events: 0, u64: 0 };
            // SAFETY: waiting on our epoll set with room for one event.
            let n = unsafe { libc::epoll_wait(self.inner.epfd.as_raw_fd(), &mut ev, 1, slice_ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::Os { op: "get_cq_event", source: e });
            }
            let cqs: Vec<(u32, Arc<CqInner>)> = self.inner.cqs.lock().iter().filter_map(|(h, w)| w.upgrade().map(|c| (*h, c))).collect();
            if n == 1 {
                let handle = ev.u64 as u32;
                if let Some((_, cq)) = cqs.into_iter().find(|(h, _)| *h == handle) {
                    drain_eventfd(&cq.eventfd);
                    return Ok(Some(Cq { inner: cq }));
                }
                continue;
            }
            for (_, cq) in &cqs {
                cq.progress();
                // Large SENDs to a sleeper go on: what peers staged lands in its buffers.
                for q in cq.recv_qps.lock().iter() {
                    q.drain_staged_now();
                }
            }
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return Ok(None);
            }
        }
    }
}
