//! Lanes peers open to our QPs: their requests executed, answered on the peer daemon's own
//! connections, with the ACK duties tokens bring.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::deadline;
use super::token_timer::TokenTimer;
use super::tokens::AckDuty;
use super::LaneIn;
use crate::engine::accept::Inbound;
use crate::engine::affinity::{incoming_cpu, CpuFollower};
use crate::engine::connection::Conn;
use crate::engine::handshake::hello_frame;
use crate::engine::link::LinkError;
use crate::engine::qp::MedQp;
use crate::engine::reader::ReaderError;
use crate::engine::trace::{self, Stage};
use crate::engine::{responder, Engine};

/// Serves a lane a peer opened to our QP `dst_qpn` for its QP `src_qpn`: requests of that
/// pair only (anything else ends the lane), executed as on a peer's connection. They are
/// answered on one of the peer daemon's connections to us (the lane's far end is shared
/// with a client; see `open_lane`). The lane's licence is withdrawn by a newer lane for the
/// same QP or by a (re)connection, which starts a new PSN sequence: what an old lane still
/// carries is then dropped, never executed.
pub(crate) fn serve_lane(engine: Weak<Engine>, c: Arc<Conn>, peer: SocketAddr, src_qpn: u32, dst_qpn: u32, key: [u64; 2]) {
    let Some(e) = engine.upgrade() else { return };
    if !e.cfg.lanes {
        // (Lanes are on where both daemons have them: the peer's QP goes without.)
        log::warn!("engine: lane from {peer} for QP {src_qpn} to our QP {dst_qpn}: refused, lanes are off here");
        c.shutdown();
        return;
    }
    // A lane for a QP that is paired with someone else is refused (it must not replace the
    // licence of that pair's lane); one for a QP not connected yet is taken (its requests
    // are answered "not ready" until it is).
    if e.qps.read().get(&dst_qpn).is_some_and(|q| q.remote != peer || q.remote_qpn != src_qpn) {
        e.refuse_claim(peer, format_args!("lane for its QP {src_qpn} to our QP {dst_qpn}, which is paired otherwise"));
        c.shutdown();
        return;
    }
    // Its frames come from a client: each must arrive whole in time (see `deadline`).
    let clock = match deadline::watch(&c) {
        Ok(clock) => clock,
        Err(why) => {
            log::warn!("engine: lane from {peer} for QP {src_qpn} to our QP {dst_qpn}: refused, {why}");
            c.shutdown();
            return;
        }
    };
    // (Its requests come one way only: see `RxBuf`.)
    c.peek_reads();
    let licence = Arc::new(AtomicBool::new(true));
    // (Keyed by the pair: a lane of another QP of that peer's, which the responder answers
    // "gone", never takes this one's licence.)
    if let Some(old) = e.lanes_in.lock().insert((peer, dst_qpn, src_qpn), LaneIn { licence: licence.clone(), conn: c.clone() }) {
        old.licence.store(false, Ordering::Release);
    }
    let (h, data) = hello_frame(&e);
    let err = if c.send(&h, &data).is_err() { Some(ReaderError::Hello) } else { None };
    log::info!("engine: lane from {peer}: its QP {src_qpn} to our QP {dst_qpn}");
    let (live, timeout) = (e.peer_rx(peer), e.cfg.peer_timeout);
    let mut follower = CpuFollower::new(e.cfg.follow_cpu);
    drop(e);
    // The QP whose ACKs are to be seen to before the reader blocks: its deferred ACK (sent,
    // or waiting for its owner to carry it as a token), or a PSN tokens acknowledged that
    // our own ACK must confirm (see `MedQp::ack_duty`).
    let mut duty: Option<Arc<MedQp>> = None;
    // Wakes the reader for a token's deadline, made when first needed (without one, tokens
    // are settled at once).
    let mut timer: Option<TokenTimer> = None;
    // Where answers go: a live connection of the peer daemon's to us.
    let mut out: Option<Inbound> = None;
    let err = err.unwrap_or_else(|| loop {
        let mut until = None;
        if let Some(q) = duty.clone().filter(|_| !c.readable_now()) {
            let Some(o) = answers_to(&engine, peer, dst_qpn, &mut out) else { break ReaderError::NoAnswerPath };
            if timer.is_none() {
                timer = TokenTimer::new();
            }
            let mut can_wait = timer.is_some();
            let sent = loop {
                let r = match q.ack_duty(Instant::now(), can_wait) {
                    // (The timer is armed only to wait, and then keeps ticking until the
                    // duties end: arming and stopping it per message would cost more than
                    // the tokens save.)
                    AckDuty::Wait(t) if timer.as_mut().is_some_and(TokenTimer::tick) => {
                        until = Some(t);
                        break Ok(());
                    }
                    AckDuty::Wait(_) => {
                        can_wait = false;
                        continue;
                    }
                    AckDuty::SendOwed => responder::send_owed_ack(&o.conn, &q),
                    AckDuty::Confirm(psn) => responder::send_ack(&o.conn, &q, psn),
                    AckDuty::Idle => {
                        duty = None;
                        break Ok(());
                    }
                };
                trace::record(Stage::AcksSent, 0, 0);
                if r.is_err() {
                    break r;
                }
            };
            if let Err(err) = sent {
                break ReaderError::from(err);
            }
        }
        if until.is_none() {
            if let Some(t) = timer.as_mut() {
                t.stop();
            }
        }
        let h = match c.read_header_until(&live, timeout, until) {
            Ok(Some((h, read))) => {
                if read {
                    follower.woken_from(|| incoming_cpu(c.fd()));
                }
                h
            }
            // A token's deadline: see to the ACKs again.
            Ok(None) => continue,
            Err(e) => break ReaderError::from(e),
        };
        trace::record(Stage::RequestRead, h.dst_qpn, h.psn);
        if !h.kind.is_request() || h.dst_qpn != dst_qpn || h.src_qpn != src_qpn {
            break ReaderError::OffLane { kind: h.kind, src_qpn: h.src_qpn, dst_qpn: h.dst_qpn, lane_src: src_qpn, lane_dst: dst_qpn };
        }
        let Some(o) = answers_to(&engine, peer, dst_qpn, &mut out) else { break ReaderError::NoAnswerPath };
        let Some(e) = engine.upgrade() else { break ReaderError::Stopped };
        clock.arm(deadline::allowance(u64::from(h.data_len)));
        let handled = responder::handle_request(&e, &c, &o.conn, &h, Some(&licence), Some(key), Some(&o.answers));
        clock.disarm();
        match handled {
            Ok(Some(q)) => duty = Some(q),
            Ok(None) => {}
            Err(err) => break ReaderError::from(err),
        }
        trace::record(Stage::RequestDone, h.dst_qpn, h.psn);
        if !licence.load(Ordering::Acquire) {
            break ReaderError::Replaced;
        }
    });
    // A frame that does not decode (a library of another protocol version, a hostile
    // client) or does not belong on the lane is worth saying: its QP then fails.
    if matches!(err, ReaderError::Link(LinkError::Protocol { .. }) | ReaderError::OffLane { .. }) {
        log::warn!("engine: lane from {peer} to our QP {dst_qpn} ends: {err}");
    } else {
        log::debug!("engine: lane from {peer} to our QP {dst_qpn} ends: {err}");
    }
    c.shutdown();
    if let Some(e) = engine.upgrade() {
        let mut lanes = e.lanes_in.lock();
        if lanes.get(&(peer, dst_qpn, src_qpn)).is_some_and(|l| Arc::ptr_eq(&l.licence, &licence)) {
            lanes.remove(&(peer, dst_qpn, src_qpn));
        }
    }
}

/// The connection a lane's answers take: one the peer daemon opened to us (chosen by our
/// QPN, so one QP's answers keep one connection and their order), kept while it lives;
/// with it, the answerer of READs on it (READs on the lane are answered there too, as the
/// scheduler grants).
fn answers_to(engine: &Weak<Engine>, peer: SocketAddr, qpn: u32, out: &mut Option<Inbound>) -> Option<Inbound> {
    if let Some(o) = out.as_ref().filter(|o| o.conn.is_alive()) {
        return Some(o.clone());
    }
    // The peer's connections are up before it opens a lane, but the accepting thread may
    // not have listed its own yet: a moment's grace.
    for _ in 0..100 {
        let e = engine.upgrade()?;
        let found = e.inbound.lock().get(&peer).and_then(|v| {
            let live: Vec<_> = v.iter().filter(|c| c.conn.is_alive()).collect();
            (!live.is_empty()).then(|| live[qpn as usize % live.len()].clone())
        });
        if found.is_some() {
            out.clone_from(&found);
            return found;
        }
        drop(e);
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}
