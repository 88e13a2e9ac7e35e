//! Responses on our connections: completions, READ data scattered, atomics' results, RNR and
//! not-ready retries scheduled.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_abi::verbs::WcStatus;
use vrdma_abi::wire::{FrameHeader, Kind, Nak};
use vrdma_core::access::Need;
use vrdma_core::timers;

use super::completion::mark_acked;
use super::{Fs, InFlight, MedQp};
use crate::engine::connection::Conn;
use crate::engine::Engine;

/// A reader streaming a READ response into a QP (see [`MedQp::defer_while_receiving`]):
/// when it ends, however it ends, a pump the doorbell thread skipped meanwhile is requested.
struct Receiving<'a> {
    e: &'a Engine,
    q: &'a MedQp,
}

impl<'a> Receiving<'a> {
    fn start(e: &'a Engine, q: &'a MedQp) -> Receiving<'a> {
        q.receiving.store(true, Ordering::SeqCst);
        Receiving { e, q }
    }
}

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        self.q.receiving.store(false, Ordering::SeqCst);
        // SeqCst store, then swap (the doorbell thread: store, then load): either it saw
        // `receiving` clear, or we see its deferral here. (`retire_and_kick` may have taken
        // the deferral already, and kicked.)
        if self.q.pump_deferred.swap(false, Ordering::SeqCst) {
            self.q.wants_pump.store(true, Ordering::Release);
            self.e.kick();
        }
    }
}

/// A response on one of our connections: completes (or schedules the retry of) the request,
/// and (acknowledgements being cumulative) every SEND and WRITE before it.
pub(crate) fn handle_response(e: &Arc<Engine>, c: &Conn, h: &FrameHeader) -> std::io::Result<()> {
    let data = u64::from(h.data_len);
    let q = e.qps.read().get(&h.dst_qpn).cloned();
    let Some(q) = q.filter(|q| q.remote == c.peer && q.remote_qpn == h.src_qpn) else {
        return c.discard(data);
    };
    // A READ response is streamed into memory under the QP's lock, as long as it takes on a
    // slow link: marked before the lock is taken, so that a doorbell thread finding the lock
    // held always knows to skip the QP rather than wait (the reader kicks it when done).
    let _receiving = (h.kind == Kind::ReadResp).then(|| Receiving::start(e, &q));
    let mut guard = q.req.lock();
    let st = &mut *guard;
    q.adopt(e, st);
    // Every response but "not ready" and "gone" comes from the responder executing in order
    // at this PSN, so everything before it was executed.
    let in_order = !matches!(Nak::from_u32(h.status), Some(Nak::NotReady | Nak::Gone));
    let earlier_done = in_order && mark_acked(st, h.psn.wrapping_sub(1));
    let Some(i) = st.inflight.iter().position(|f| f.psn == h.psn && f.state == Fs::Sent) else {
        if earlier_done {
            q.retire_and_kick(e, guard);
        }
        return c.discard(data);
    };
    let mut consumed = false;
    let new_state = match Nak::from_u32(h.status) {
        None if h.status != 0 => Some(WcStatus::GeneralErr),
        None => match h.kind {
            Kind::ReadResp => {
                consumed = true;
                let r = scatter_read(e, &q, c, &st.inflight[i], h.data_len);
                // (The data is in: a pump may wait for the lock the little time left.)
                q.receiving.store(false, Ordering::SeqCst);
                Some(r?)
            }
            Kind::AtomicResp => {
                let f = &st.inflight[i];
                let s = f.wr.sges[0];
                Some(match q.local_span(e, s.lkey, s.addr, 8, Need::LocalWrite) {
                    Ok((mr, off)) => match mr.write(off, &h.arg1.to_ne_bytes()) {
                        Ok(()) => WcStatus::Success,
                        Err(_) => WcStatus::LocProtErr,
                    },
                    Err(st) => st,
                })
            }
            _ => Some(WcStatus::Success),
        },
        Some(Nak::Rnr) | Some(Nak::NotReady) => {
            let (rnr_retry, retry_cnt, timeout) = q.retry_attrs();
            let now = Instant::now();
            let f = &mut st.inflight[i];
            let give_up = if h.status == Nak::Rnr as u32 {
                f.rnr_tries += 1;
                q.meter.rnr();
                rnr_retry != timers::RNR_RETRY_INFINITE && f.rnr_tries > u32::from(rnr_retry)
            } else {
                timers::retry_limit(timeout, retry_cnt).is_some_and(|l| now.duration_since(f.first_sent) > l)
            };
            if give_up {
                Some(if h.status == Nak::Rnr as u32 { WcStatus::RnrRetryExcErr } else { WcStatus::RetryExcErr })
            } else {
                let wait =
                    if h.status == Nak::Rnr as u32 { timers::rnr_wait(h.arg1 as u8, f.rnr_tries) } else { Duration::from_micros(200) };
                let at = now + wait;
                st.wait_until = Some(at);
                st.resend_from = Some(h.psn);
                st.probe = None;
                // The responder dropped this request and drops every later one until the
                // resend: none of their data is on the wire any more. Counted there, WRs
                // that wait out RNR timers without end (a peer that posts no receive) would
                // fill the host's bounded wire and hold every other vNIC back.
                for f in st.inflight.iter_mut().filter(|f| f.state == Fs::Sent && f.psn.wrapping_sub(h.psn) as i32 >= 0) {
                    q.wire_bytes.fetch_sub(u64::from(std::mem::take(&mut f.on_wire)), Ordering::Relaxed);
                }
                // The resend is the engine's: the client stops sending meanwhile.
                q.want_send_side();
                e.add_timer(at, q.qpn);
                None
            }
        }
        Some(Nak::RemoteAccess) => Some(WcStatus::RemAccessErr),
        Some(Nak::InvalidRequest) => Some(WcStatus::RemInvReqErr),
        Some(Nak::RemoteOperation) => Some(WcStatus::RemOpErr),
        Some(Nak::Gone) => {
            // The responder no longer has our peer: retries would go unanswered, and the
            // pump fails the WR when they are spent.
            q.peer_gone.store(true, Ordering::Release);
            q.want_send_side();
            q.pump_deferred.store(true, Ordering::SeqCst);
            None
        }
    };
    if !consumed {
        c.discard(data)?;
    }
    if let Some(s) = new_state {
        st.inflight[i].state = Fs::Done(s);
    }
    q.retire_and_kick(e, guard);
    Ok(())
}

/// Reads READ response data into the WR's local scatter list.
fn scatter_read(e: &Engine, q: &MedQp, c: &Conn, f: &InFlight, len: u32) -> std::io::Result<WcStatus> {
    if len != f.len {
        c.discard(u64::from(len))?;
        return Ok(WcStatus::RemOpErr);
    }
    let mut left = u64::from(len);
    let mut status = WcStatus::Success;
    for s in f.wr.sges.iter().filter(|s| s.length > 0) {
        let n = u64::from(s.length).min(left);
        if n == 0 {
            break;
        }
        match q.local_span(e, s.lkey, s.addr, n, Need::LocalWrite) {
            Ok((mr, off)) if status == WcStatus::Success => {
                if !mr.receive(c, off, n as usize)? {
                    status = WcStatus::LocProtErr;
                }
            }
            Ok(_) => c.discard(n)?,
            Err(st) => {
                status = st;
                c.discard(n)?;
            }
        }
        left -= n;
    }
    if left > 0 {
        c.discard(left)?;
    }
    Ok(status)
}
