//! Peer daemons' connections to us: accepted, greeted, then served (requests executed and
//! answered on the same connection), or handed to the lane they open.

use crate::engine::Refusal;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use vrdma_abi::wire::{ConnectReq, FrameHeader, Kind};

use super::affinity::CpuFollower;
use super::connection::{tune, Conn};
use super::handshake::{check_peer, hello_frame, read_first, tls_accept, Verified};
use super::link::read_header_following;
use super::priority::{reader_priority, realtime_thread};
use super::reader::ReaderError;
use super::trace::{self, Stage};
use super::{lane, qp, responder, ud, Engine};

/// A peer daemon's connection to us, and the answerer of the READs it carries (its own
/// requests', and those of lanes of that peer's QPs: a lane's answers go on such a
/// connection).
#[derive(Clone)]
pub(crate) struct Inbound {
    pub(crate) conn: Arc<Conn>,
    pub(crate) answers: Arc<responder::ReadAnswers>,
}

/// Accepts peer daemons' connections.
pub(crate) fn accept_loop(engine: Arc<Engine>, listener: TcpListener) {
    let weak = Arc::downgrade(&engine);
    drop(engine);
    let mut failures = 0u64;
    for s in listener.incoming() {
        let Some(e) = weak.upgrade() else { return };
        if e.stopping.load(Ordering::Acquire) {
            return;
        }
        let s = match s {
            Ok(s) => s,
            Err(err) => {
                accept_failed(&mut failures, &err);
                continue;
            }
        };
        let timeout = e.cfg.peer_timeout;
        let w = weak.clone();
        let spawned = std::thread::Builder::new().name("engine-in".into()).spawn(move || {
            tune(&s, timeout);
            let from = s.peer_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
            let Some(e) = w.upgrade() else { return };
            let Ok(verified) = tls_accept(&e, &s, from) else { return };
            let c = Arc::new(Conn::new(s, from));
            let cert = verified.map(|(cert, keys)| {
                // (Every frame from here on is sealed: see `connection::seal`.)
                c.seal_frames(&keys, e.refused_frames.clone());
                cert
            });
            drop(e);
            inbound(w, c, cert)
        });
        if let Err(err) = spawned {
            // The connection (in the closure, dropped) closes; its peer connects again.
            e.thread_failed("engine-in", &err);
        }
    }
}

/// How long the accept loop pauses after a failed accept that a retry at once would repeat
/// (out of descriptors or memory), so that it does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// A failed accept: logged (the first, then at every power of two) and counted; after one
/// that would fail again at once, a pause.
fn accept_failed(failures: &mut u64, err: &std::io::Error) {
    *failures += 1;
    if failures.is_power_of_two() {
        log::warn!("engine: accepting a peer's connection: {err} ({failures} failures so far)");
    }
    if matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) {
        std::thread::sleep(ACCEPT_BACKOFF);
    }
}

/// Serves one inbound connection: HELLO, then requests until it fails.
fn inbound(engine: Weak<Engine>, c0: Arc<Conn>, cert: Option<super::peer_tls::PeerCert>) {
    realtime_thread(reader_priority(engine.upgrade().is_some_and(|e| e.cfg.follow_cpu)));
    // The first frame, from whoever connected, must arrive whole in time (not merely a byte
    // now and then): the connection's thread is not to be held for ever.
    let Ok(clock) = lane::deadline::watch(&c0) else { return };
    clock.arm(lane::deadline::FRAME_BASE);
    let first = read_first(&c0);
    drop(clock);
    let (first, host, peer, peer_boot) = match first {
        Ok(v) => v,
        Err(e) => {
            log::warn!("engine: inbound connection from {}: {e}", c0.peer);
            return;
        }
    };
    let Some(e) = engine.upgrade() else { return };
    if check_peer(&e, &c0, &host, peer, cert.as_ref().map_or(Verified::Nothing, Verified::Cert)).is_err() {
        return c0.shutdown();
    }
    // Re-identify the connection by the peer's listening address, with what the HELLO's read
    // brought with it (the peer need not wait for our answer).
    let c = match c0.reidentified(peer) {
        Ok(c) => Arc::new(c),
        Err(_) => return,
    };
    if first.kind == Kind::Lane {
        drop(e);
        return lane::serve_lane(engine, c, peer, first.src_qpn, first.dst_qpn, [first.arg2, first.remote_addr]);
    }
    let (h, data) = hello_frame(&e);
    if c.send(&h, &data).is_err() {
        return;
    }
    // (Closed however this reader ends: lanes hold it too.)
    let answers = responder::ClosedOnDrop(Arc::new(responder::ReadAnswers::new(c.clone(), engine.clone())));
    e.inbound.lock().entry(peer).or_default().push(Inbound { conn: c.clone(), answers: answers.0.clone() });
    log::debug!("engine: inbound connection from {host} ({peer})");
    let (live, timeout) = (e.peer_rx(peer), e.cfg.peer_timeout);
    let mut follower = CpuFollower::new(e.cfg.follow_cpu);
    drop(e);
    // QPs whose ACK this reader deferred. They are sent before the reader would block: while
    // more requests are already waiting, their ACKs coalesce (up to ACK_EVERY / ACK_BYTES);
    // a request of the QP's own sent meanwhile carries it (F_ACKS).
    let mut owed: Vec<Arc<qp::MedQp>> = Vec::new();
    let mut ud_buf = Vec::new();
    let err = loop {
        if !owed.is_empty() && !c.readable_now() {
            if let Some(err) = owed.drain(..).find_map(|q| responder::send_owed_ack(&c, &q).err()) {
                break ReaderError::from(err);
            }
            trace::record(Stage::AcksSent, 0, 0);
        }
        let h = match read_header_following(&c, &live, timeout, &mut follower) {
            Ok(h) => h,
            Err(e) => break ReaderError::from(e),
        };
        trace::record(Stage::RequestRead, h.dst_qpn, h.psn);
        let Some(e) = engine.upgrade() else { return };
        let r: Result<(), ReaderError> = match h.kind {
            Kind::Heartbeat => c.send(&FrameHeader::new(Kind::HeartbeatAck), &[]).map_err(ReaderError::from),
            k if k.is_request() => match responder::handle_request(&e, &c, &c, &h, None, None, Some(&answers.0)) {
                Ok(Some(q)) => {
                    if !owed.iter().any(|x| Arc::ptr_eq(x, &q)) {
                        owed.push(q);
                    }
                    Ok(())
                }
                Ok(None) => Ok(()),
                Err(e) => Err(e.into()),
            },
            Kind::ConnectReq => {
                let mut data = vec![0u8; h.data_len as usize];
                match c.read_exact(&mut data) {
                    Err(err) => Err(err.into()),
                    Ok(()) => {
                        let result = match ConnectReq::decode(&data) {
                            Err(err) => Err(Refusal::new(libc::EINVAL, err.to_string())),
                            Ok(req) => match e.broker() {
                                Some(b) => b.accept_remote(peer, h.src_qpn, h.dst_qpn, &req),
                                None => Err(Refusal::new(libc::EAGAIN, "daemon starting")),
                            },
                        };
                        if result.is_ok() {
                            // A (re)connection starts a new PSN sequence.
                            e.reset_responder(h.dst_qpn);
                        }
                        let mut rep = FrameHeader::new(Kind::ConnectRep);
                        rep.arg1 = h.arg1;
                        let msg = match &result {
                            Ok(()) => Vec::new(),
                            Err(Refusal { errno, reason }) => {
                                rep.status = *errno as u32;
                                reason.as_bytes()[..reason.len().min(1024)].to_vec()
                            }
                        };
                        rep.data_len = msg.len() as u32;
                        c.send(&rep, &msg).map_err(ReaderError::from)
                    }
                }
            }
            Kind::PeerGone => {
                e.mark_peer_gone(h.dst_qpn, peer, h.src_qpn);
                if let Some(b) = e.broker() {
                    b.peer_gone(h.dst_qpn, peer, h.src_qpn);
                }
                Ok(())
            }
            Kind::UdSend => ud::receive(&e, &c, peer, &h, &mut ud_buf).map_err(ReaderError::from),
            Kind::Hello => c.discard(u64::from(h.data_len)).map_err(ReaderError::from),
            kind => Err(ReaderError::Unexpected { kind, role: "responder" }),
        };
        trace::record(Stage::RequestDone, h.dst_qpn, h.psn);
        if let Err(why) = r {
            break why;
        }
    };
    c.shutdown();
    // (Before the peer is failed: no lane starts another answerer on this connection.)
    drop(answers);
    if let Some(e) = engine.upgrade() {
        if let Some(v) = e.inbound.lock().get_mut(&peer) {
            v.retain(|x| !Arc::ptr_eq(&x.conn, &c));
        }
        if !e.stopping.load(Ordering::Acquire) {
            e.fail_peer(peer, peer_boot, &err);
        }
    }
}
