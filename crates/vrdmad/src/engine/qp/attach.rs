//! Mediated QPs attached to the engine and detached from it.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::fd::new_eventfd;

use super::{MedQp, MedQpSetup};
use crate::engine::doorbell::Token;
use crate::engine::lane::Lane;
use crate::engine::{Engine, EngineError};

/// Why a mediated QP (or a UD QP's sending side) could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// Mapping or creating its shared memory.
    #[error(transparent)]
    Shm(#[from] vrdma_abi::shm::ShmError),
    /// A descriptor (eventfd, socket) or the engine's epoll set.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl Engine {
    /// Starts executing QP `setup.qpn`'s sends; returns the channel memfd and the doorbell
    /// eventfd for the client, and with a lane (from [`Engine::open_lane`] for this QP) the
    /// client's end of it.
    #[allow(clippy::type_complexity)]
    pub fn attach(
        self: &Arc<Self>,
        setup: MedQpSetup,
        mut lane: Option<Lane>,
    ) -> Result<(Arc<OwnedFd>, Arc<OwnedFd>, Option<Arc<OwnedFd>>, vrdma_abi::ring::MediatedLayout), EngineError> {
        let qpn = setup.qpn;
        let attach_err = |source: AttachError| EngineError::Attach { qpn, source };
        // Make sure the link exists now, so a dead peer fails modify_qp rather than the first WR.
        let link = self.link(setup.remote)?;
        // (A lane to another peer, or to an earlier incarnation of this one, is dropped: closed.)
        let lane = lane.as_mut().filter(|l| l.addr == setup.remote && l.peer_boot == link.peer_boot);
        let (conn, client_lane, lane_key) = match lane.and_then(|l| Some((l.conn.take()?, l.client.take()?, l.key))) {
            Some((c, fd, key)) => (c, Some(Arc::new(fd)), Some(key)),
            None => (link.conn_for(qpn), None, None),
        };
        let lane = client_lane.is_some();
        // On failure below, the lane (if any) must close, or its watcher would wait for good.
        let closing = lane.then(|| conn.clone());
        let attach_err = |source: AttachError| {
            if let Some(c) = &closing {
                c.shutdown();
            }
            attach_err(source)
        };
        let doorbell = Arc::new(new_eventfd().map_err(|e| attach_err(e.into()))?);
        let (q, chan_fd, layout) = MedQp::new(setup, doorbell.clone(), conn, lane_key, link.peer_boot).map_err(|e| attach_err(e.into()))?;
        // A sealed lane's client seals what it writes on it: it gets the key and the
        // sequence word (`connection::seal`); without them it gets no lane (the engine
        // writes the lane alone).
        let client_lane = client_lane.filter(|_| share_lane_seal(&q, &chan_fd, layout.size()));
        // Edge-triggered: every ring (an eventfd write) is one event, and the doorbell thread
        // never reads the counter, a system call less per doorbell on the latency path (the
        // counter cannot fill: 2^64 - 2 rings).
        self.epoll_add_events(doorbell.as_raw_fd(), Token::qp(qpn), (libc::EPOLLIN | libc::EPOLLET) as u32)
            .map_err(|e| attach_err(e.into()))?;
        // (Under the scheduler's lock, as `set_qos` decides holds: no policy change is missed.)
        let qos = self.qos.lock();
        Engine::qos_hold(&qos, &q);
        let lane = q.lane;
        let replaced = self.qps.write().insert(qpn, q);
        drop(qos);
        if lane {
            // The watcher sleeps while the engine has no lane QP.
            if let Some(w) = self.contention_watcher.get() {
                w.unpark();
            }
        }
        if let Some(old) = replaced {
            self.epoll_del(old.doorbell.as_raw_fd());
            old.reads.end_all(&old.wire_bytes);
            old.close_lane();
        }
        Ok((chan_fd, doorbell, client_lane, layout))
    }

    /// Stops executing QP `qpn` (destroyed, reset or its client gone).
    pub fn detach(&self, qpn: u32) {
        let removed = self.qps.write().remove(&qpn);
        // (Not under the QP table's lock: the doorbell thread takes the scheduler's first.)
        self.qos.lock().forget(qpn);
        if let Some(q) = removed {
            self.epoll_del(q.doorbell.as_raw_fd());
            {
                let _gate = q.recv_gate.lock();
                q.detached.store(true, Ordering::Release);
            }
            q.reads.end_all(&q.wire_bytes);
            // The client's end stops carrying anything to the peer.
            q.close_lane();
            let tokens = q.tokens_applied.load(Ordering::Relaxed);
            if tokens > 0 {
                log::info!("engine: QP {qpn}: {tokens} ACK tokens acknowledged its requests");
            }
            // A deferred ACK still owed is sent by the connection's reader before it next waits.
        }
    }
}

/// Hands a sealed lane's sealing to its client, if `q` has a sealed lane: the key and the
/// sequence word in its channel page, which the engine's own sealing then uses too (the
/// send side decides who seals next). Whether the client may write the lane.
fn share_lane_seal(q: &MedQp, chan_fd: &OwnedFd, size: usize) -> bool {
    let Some(key) = q.conn.seal_key() else { return true };
    // (The sealer's own mapping of the page: it lives as long as the connection.)
    let Ok(map) = vrdma_abi::shm::SharedMapping::map_sealed(std::os::fd::AsFd::as_fd(chan_fd), size, true) else { return false };
    for (i, word) in key.chunks_exact(8).enumerate() {
        let w = u64::from_le_bytes(word.try_into().unwrap_or_default());
        if q.chan_ctl.store_u64(vrdma_abi::ring::MED_LANE_SEAL + 8 * (i + 1), w).is_err() {
            return false;
        }
    }
    q.conn.share_seal_sequence(map, vrdma_abi::ring::MED_LANE_SEQ);
    q.chan_ctl.store_u64(vrdma_abi::ring::MED_LANE_SEAL, 1).is_ok()
}
