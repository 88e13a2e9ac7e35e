//! Peer daemons: links to them, the connection broker across daemons, and their failure.

use crate::engine::Refusal;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::wire::ConnectReq;

use super::connection::PeerRx;
use super::lane::LaneIn;
use super::link::{Link, LinkError};
use super::qp::MedQp;
use super::{Engine, EngineError};

impl Engine {
    /// The liveness record of the peer daemon at `addr`, shared by all its connections' readers.
    pub(crate) fn peer_rx(&self, addr: SocketAddr) -> Arc<PeerRx> {
        self.peer_rx.lock().entry(addr).or_insert_with(|| Arc::new(PeerRx::new())).clone()
    }

    /// The link to the daemon at `addr`, connecting if needed.
    pub(crate) fn link(self: &Arc<Self>, addr: SocketAddr) -> Result<Arc<Link>, LinkError> {
        if let Some(l) = self.existing_link(addr) {
            return Ok(l);
        }
        let _setup = self.link_setup.lock();
        if let Some(l) = self.existing_link(addr) {
            return Ok(l);
        }
        let l = Link::connect(self, addr)?;
        self.links.lock().insert(addr, l.clone());
        Ok(l)
    }

    pub(crate) fn existing_link(&self, addr: SocketAddr) -> Option<Arc<Link>> {
        self.links.lock().get(&addr).filter(|l| l.is_alive()).cloned()
    }

    /// Broker across daemons: asks the daemon at `addr` to accept our QP `src_qpn` as the
    /// peer of its `dst_qpn`. Blocks (the caller holds no registry lock) for at most the
    /// peer timeout.
    pub fn connect_remote(self: &Arc<Self>, addr: SocketAddr, src_qpn: u32, dst_qpn: u32, req: &ConnectReq) -> Result<(), EngineError> {
        let link = self.link(addr)?;
        let id = self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.connect_waiters.lock().insert(id, tx);
        let sent = link.send_connect(id, src_qpn, dst_qpn, req);
        let r = match sent {
            Ok(()) => rx
                .recv_timeout(self.cfg.peer_timeout)
                .unwrap_or_else(|_| Err(Refusal::new(libc::ETIMEDOUT, format!("no answer from {addr}")))),
            Err(e) => Err(Refusal::new(libc::EHOSTUNREACH, e.to_string())),
        };
        self.connect_waiters.lock().remove(&id);
        r.map_err(|Refusal { errno, reason }| EngineError::Refused { addr, errno, message: reason })
    }

    /// Our QP `local_qpn`, connected to `remote_qpn` at `addr`, is gone: tell that daemon.
    pub fn send_peer_gone(self: &Arc<Self>, addr: SocketAddr, remote_qpn: u32, local_qpn: u32) {
        if let Some(l) = self.existing_link(addr) {
            let _ = l.send_peer_gone(remote_qpn, local_qpn);
        }
    }

    /// Our QP `local_qpn`'s peer, QP `remote_qpn` at `from`, is gone (PEER_GONE): later
    /// sends fail like a NIC's retries. A notice naming a QP ours is not connected to (a
    /// stale or forged one) changes nothing.
    pub fn mark_peer_gone(&self, local_qpn: u32, from: SocketAddr, remote_qpn: u32) {
        let q = self.qps.read().get(&local_qpn).cloned();
        if let Some(q) = q.as_ref().filter(|q| q.remote != from || q.remote_qpn != remote_qpn) {
            // (A QP paired with another: not the sender's to end.)
            let paired = (q.remote, q.remote_qpn);
            self.refuse_claim(from, format_args!("PEER_GONE from its QP {remote_qpn} for our QP {local_qpn}, paired with {paired:?}"));
            return;
        }
        if let Some(q) = q {
            q.peer_gone.store(true, Ordering::Release);
            q.want_send_side();
            // WRs already sent wait out their retries from now on.
            self.kick_qp(&q);
        }
    }

    /// A peer (re)connected to our QP `qpn`: its requests start again at PSN 0.
    pub(crate) fn reset_responder(&self, qpn: u32) {
        let q = self.qps.read().get(&qpn).cloned();
        // The old lanes end first. A lane's request holds the QP's responder lock while it
        // reads its data, which a client writes at the pace its frame's deadline allows
        // (minutes for a large one), and this runs on the reader of a peer daemon's
        // connection, which serves every QP of that host: waiting for the lock first would
        // stall them all. Shut down, the lane's read fails and lets go at once; a request
        // it had begun is cut short as at its deadline, and nothing it carries runs after
        // the reset (the licence is checked under the lock).
        let old: Vec<LaneIn> = {
            let mut lanes = self.lanes_in.lock();
            let keys: Vec<_> = lanes.keys().filter(|&&(_, n, _)| n == qpn).copied().collect();
            keys.into_iter().filter_map(|k| lanes.remove(&k)).collect()
        };
        for lane in old {
            lane.licence.store(false, Ordering::Release);
            lane.conn.shutdown();
        }
        if let Some(q) = q {
            let mut rs = q.resp.lock();
            // (A SEND cut off between its segments: its receive completes flushed.)
            super::responder::end_partial(&q, &mut rs, q.remote_qpn, vrdma_abi::verbs::WcStatus::WrFlushErr);
            rs.expected_psn = 0;
            rs.dead = false;
            rs.resets += 1;
            // (READs of before are answered no more: their slots are free at once.)
            q.reads.end_from(None, &q.wire_bytes);
            q.new_responder_stream();
            rs.unacked = 0;
            rs.unacked_bytes = 0;
            q.clear_owed_ack();
            MedQp::acked_by_us(&mut rs);
        }
    }

    /// Every QP whose peer is the daemon at `addr` (that incarnation of it) goes to ERR and
    /// flushes (link failed).
    pub(crate) fn fail_peer(&self, addr: SocketAddr, peer_boot: u64, why: &dyn std::fmt::Display) {
        let removed = {
            let mut links = self.links.lock();
            match links.get(&addr) {
                Some(l) if !l.is_alive() => links.remove(&addr),
                _ => None,
            }
        };
        if let Some(l) = removed {
            l.shutdown();
        }
        let inbound = self.inbound.lock().remove(&addr).unwrap_or_default();
        for c in inbound {
            c.conn.shutdown();
        }
        // (Their serving threads end, and drop their entries.)
        for (_, lane) in self.lanes_in.lock().iter().filter(|((a, _, _), _)| *a == addr) {
            lane.conn.shutdown();
        }
        let victims: Vec<Arc<MedQp>> =
            self.qps.read().values().filter(|q| q.remote == addr && q.peer_boot == peer_boot && !q.is_link_down()).cloned().collect();
        if !victims.is_empty() {
            log::warn!("peer daemon {addr}: {why}; {} QP(s) to ERR", victims.len());
        }
        for q in victims {
            q.link_failed();
            q.close_lane();
            self.kick_qp(&q);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use vrdma_abi::wire::ConnectReq;

    use crate::engine::testing::engine;
    use crate::engine::EngineError;

    fn request() -> ConnectReq {
        ConnectReq { src_gid: [1; 16], dst_gid: [2; 16], src_tenant: "blue".into() }
    }

    /// A connection request goes over a link (HELLO both ways, here to this same engine) to
    /// the peer's broker, and its answer comes back: accepted, or refused with the peer's
    /// errno and message, which the verb then reports.
    #[test]
    fn a_connect_request_reaches_the_peers_broker_and_its_answer_comes_back() {
        let t = engine();
        let peer = t.e.local_addr();
        t.e.connect_remote(peer, 10, 20, &request()).unwrap();
        assert_eq!(t.broker.connects.lock()[0], (10, 20, request()));
        assert_eq!(t.e.links.lock().len(), 1, "one link to the peer");

        *t.broker.refuse_connect.lock() = Some(crate::engine::Refusal::new(libc::EPERM, "tenant rules"));
        let err = t.e.connect_remote(peer, 11, 21, &request()).unwrap_err();
        assert!(matches!(&err, EngineError::Refused { errno, message, .. } if *errno == libc::EPERM && message == "tenant rules"), "{err}");
        assert_eq!(err.errno(), libc::EPERM);
        assert_eq!(t.e.links.lock().len(), 1, "the link is reused");
    }

    /// A peer daemon that cannot be reached fails the request with EHOSTUNREACH.
    #[test]
    fn a_peer_that_cannot_be_reached_fails_with_ehostunreach() {
        let t = engine();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let err = t.e.connect_remote(closed, 1, 2, &request()).unwrap_err();
        assert!(matches!(err, EngineError::Link(_)), "{err}");
        assert_eq!(err.errno(), libc::EHOSTUNREACH);
    }

    /// PEER_GONE reaches the peer's broker, naming its QP and ours.
    #[test]
    fn a_peer_gone_notice_reaches_the_peers_broker() {
        let t = engine();
        let peer = t.e.local_addr();
        t.e.connect_remote(peer, 10, 20, &request()).unwrap();
        t.e.send_peer_gone(peer, 20, 10);
        let deadline = Instant::now() + Duration::from_secs(5);
        while t.broker.gone.lock().is_empty() {
            assert!(Instant::now() < deadline, "no PEER_GONE");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(t.broker.gone.lock()[0], (20, 10));
    }
}
