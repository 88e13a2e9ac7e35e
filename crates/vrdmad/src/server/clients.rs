//! The vNIC sockets' side of the daemon: one accept loop per vNIC socket, one thread per
//! client session (blocked in `recvmsg` while idle), and the requests that need more than
//! the registry (connecting through the engine, checking copied memory).

use super::*;

/// How long a reply to a client may wait for room in its socket before its session ends.
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a refused client may take to send its first request (to be answered with why).
const REFUSAL_WAIT: Duration = Duration::from_millis(200);

/// Answers the first request of a client that gets no session with `why`'s errno, then
/// closes its connection.
fn refuse_client(conn: UnixStream, why: &RequestError) {
    let _ = conn.set_read_timeout(Some(REFUSAL_WAIT));
    let ch = Channel::from(OwnedFd::from(conn));
    let seq = match ch.recv() {
        Ok((msg, _)) => Request::decode(&msg).map(|(seq, _)| seq).unwrap_or(0),
        Err(_) => return,
    };
    let _ = ch.send(&Reply::Error { errno: why.errno(), message: why.to_string() }.encode(seq), &[]);
}

impl Daemon {
    pub(super) fn serve_vnic(self: &Arc<Self>, rec: VnicRecord) -> Result<(), ServerError> {
        let dir = self.vnic_dir(&rec.name);
        std::fs::create_dir_all(&dir).map_err(|source| ServerError::Dir { path: dir.display().to_string(), source })?;
        let sock = dir.join("control.sock");
        let listener = channel::listen(&sock).map_err(|source| ServerError::Listen { path: sock.display().to_string(), source })?;
        // Containers run as any user; the directory is theirs alone by mount isolation.
        let _ = std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o666));
        let name = rec.name.clone();
        self.registry.lock().add_vnic(rec);
        let d = self.clone();
        let spawned = std::thread::Builder::new().name(format!("vnic-{name}")).spawn({
            let name = name.clone();
            move || d.accept_loop(&name, listener)
        });
        if let Err(e) = spawned {
            let _ = self.registry.lock().remove_vnic(&name);
            return Err(Self::vnic_err(&name, format!("no thread for its socket: {e}")));
        }
        Ok(())
    }

    pub(super) fn accept_loop(self: Arc<Self>, vnic: &str, listener: UnixListener) {
        loop {
            let (conn, handle, mem) = match listener.accept() {
                Ok((s, _)) => {
                    let handle = s.try_clone().ok();
                    // The client's memory, for MRs that take the copying fallback: bound now
                    // to the process that connected (by pidfd, with its credentials).
                    let mem = Some(crate::procmem::ProcMem::of_peer(std::os::fd::AsFd::as_fd(&s)).map(Arc::new).map_err(|e| e.to_string()));
                    (s, handle, mem)
                }
                Err(e) => {
                    log::warn!("vNIC {vnic}: accept failed: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    continue;
                }
            };
            // Registered under the conns lock, so `unserve_vnic` (which removes the vNIC, then
            // shuts down the sockets it finds there) cannot miss a session opened meanwhile.
            let opened = {
                let mut conns = self.conns.lock();
                let opened = self.registry.lock().open_session(vnic, mem);
                if let (Ok(session), Some(h)) = (&opened, handle) {
                    conns.insert(*session, (vnic.to_string(), h));
                }
                opened
            };
            let session = match opened {
                Ok(session) => session,
                Err(RequestError::VnicDeleted) => {
                    log::info!("vNIC {vnic} is gone; its accept loop ends");
                    return;
                }
                Err(e) => {
                    log::warn!("vNIC {vnic}: client refused: {e}");
                    refuse_client(conn, &e);
                    continue;
                }
            };
            // A client that stops reading its replies ends its session, not a thread forever.
            let _ = conn.set_write_timeout(Some(REPLY_TIMEOUT));
            let d = self.clone();
            let name = vnic.to_string();
            let spawned = std::thread::Builder::new()
                .name(format!("client-{session}"))
                .spawn(move || d.serve_client(&name, session, Channel::from(OwnedFd::from(conn))));
            if let Err(e) = spawned {
                log::warn!("vNIC {vnic}: no thread for client session {session}: {e}");
                self.conns.lock().remove(&session);
                self.registry.lock().close_session(session);
            }
        }
    }

    pub(super) fn serve_client(&self, vnic: &str, session: u64, ch: Channel) {
        log::debug!("vNIC {vnic}: client session {session} opened (fd {})", ch.as_raw_fd());
        let Some(pending) = self.registry.lock().pending_gauge(vnic) else { return self.end_session(vnic, session) };
        loop {
            let (msg, fds) = match ch.recv() {
                Ok(m) => m,
                Err(ChannelError::Closed) => break,
                Err(e) => {
                    // Oversized or truncated input: counted, and the connection is closed,
                    // because we can no longer tell where messages begin.
                    self.registry.lock().count_bad_input(session);
                    log::warn!("vNIC {vnic} session {session}: {e}; closing");
                    break;
                }
            };
            let (seq, reply, out_fds) = match Request::decode(&msg) {
                Err(e) => {
                    pending.charge_and_wait();
                    self.registry.lock().count_bad_input(session);
                    log::warn!("vNIC {vnic} session {session}: bad message: {e}");
                    (0, Reply::Error { errno: libc::EINVAL, message: e.to_string() }, vec![])
                }
                Ok((seq, req)) => {
                    let copy = is_copy(&req);
                    let result = match pending.begin() {
                        Ok(_in_progress) if copy => {
                            pending.wait_for_copy_share();
                            let r = self.handle(session, req, fds);
                            pending.charge_copy();
                            r
                        }
                        Ok(_in_progress) => self.handle(session, req, fds),
                        Err(limit) => Err(RequestError::PendingLimit { limit }),
                    };
                    match result {
                        Ok((r, f)) => (seq, r, f),
                        Err(e) => {
                            if e.is_bad_input() {
                                self.registry.lock().count_bad_input(session);
                                log::warn!("vNIC {vnic} session {session}: refused: {e}");
                            } else if e.is_limit() {
                                self.registry.lock().count_limit_refusal(session);
                                log::debug!("vNIC {vnic} session {session}: refused: {e}");
                            }
                            (seq, Reply::Error { errno: e.errno(), message: e.to_string() }, vec![])
                        }
                    }
                }
            };
            self.send_notices();
            let raw: Vec<_> = out_fds.iter().map(|f| f.as_raw_fd()).collect();
            if ch.send(&reply.encode(seq), &raw).is_err() {
                break;
            }
        }
        self.end_session(vnic, session);
    }

    pub(super) fn end_session(&self, vnic: &str, session: u64) {
        self.conns.lock().remove(&session);
        self.registry.lock().close_session(session);
        self.send_notices();
        log::debug!("vNIC {vnic}: client session {session} closed, resources reclaimed");
    }

    /// Handles one request of `session`: under the registry lock, but for what waits on
    /// another daemon or touches a client's memory.
    pub(super) fn handle(&self, session: u64, req: Request, fds: Vec<OwnedFd>) -> Result<(Reply, Vec<Arc<OwnedFd>>), RequestError> {
        // Refused here, where the descriptors are closed without a lock (on error they are
        // dropped as this returns).
        check_fds(&req, &fds)?;
        match req {
            // (Each plan is made under the registry lock, which its step through the engine
            // does not hold.)
            Request::ConnectQp { qpn, dgid, dest_qpn } => {
                let plan = self.registry.lock().prepare_connect(session, qpn, dgid, dest_qpn)?;
                plan.answer_or(|step| self.connect_qp(session, qpn, dest_qpn, step))
            }
            Request::MoveToEngine { qpn } => {
                let (plan, dest_qpn) = self.registry.lock().prepare_move_to_engine(session, qpn)?;
                plan.answer_or(|step| self.move_to_engine(session, qpn, dest_qpn, step))
            }
            Request::ResolveUd { qpn, dgid, dest_qpn } => {
                let plan = self.registry.lock().prepare_resolve_ud(session, qpn, dgid, dest_qpn)?;
                plan.answer_or(|step| self.resolve_ud(session, qpn, dgid, step))
            }
            // Copies through a client's memory run without the registry lock.
            req @ (Request::PeerMrWrite { .. } | Request::PeerMrRead { .. } | Request::PeerMrAtomic { .. }) => {
                let target = self.registry.lock().copy_target(session, &req);
                target.and_then(|mem| crate::registry::copy_access(&mem, &req)).map(|r| (r, vec![]))
            }
            req @ Request::PeerMrCopy { .. } => {
                let copy = self.registry.lock().direct_copy(session, &req)?;
                copy.run()?;
                Ok((Reply::Ok, vec![]))
            }
            Request::RegMr { pd, addr, length, access, chunks } => {
                if chunks.is_empty() {
                    self.check_copied_mr(session, addr, length, access)?;
                }
                self.registry.lock().handle_request(session, Request::RegMr { pd, addr, length, access, chunks }, fds)
            }
            // A QP's queue memory (up to about 40 MB) is made without the registry lock.
            req @ Request::CreateQp { .. } => {
                if !fds.is_empty() {
                    return Err(RequestError::FdCount { expected: 0, got: fds.len() });
                }
                let plan = self.registry.lock().prepare_create_qp(session, req)?;
                let region = plan.make_region();
                self.registry.lock().finish_qp(plan, region)
            }
            req => self.registry.lock().handle_request(session, req, fds),
        }
    }

    /// A copied MR's range must be mapped in its process readable (and writable, if the MR
    /// grants any write): checked here, without the registry lock (reading another
    /// process's mappings waits on its memory map's lock).
    pub(super) fn check_copied_mr(&self, session: u64, addr: u64, length: u64, access: u32) -> Result<(), RequestError> {
        use vrdma_abi::verbs::access as a;
        let Some(Ok(mem)) = self.registry.lock().session_memory(session) else {
            // (The registry says why: no memory, or none could be bound.)
            return Ok(());
        };
        if length == 0 || addr.checked_add(length).is_none() {
            // (The registry refuses these as malformed.)
            return Ok(());
        }
        let write = access & (a::LOCAL_WRITE | a::REMOTE_WRITE | a::REMOTE_ATOMIC) != 0;
        mem.check_range(addr, length, write).map_err(RequestError::MrUnreadable)
    }

    /// `ConnectQp` through the engine (a direct connection is the registry's answer): asks
    /// the peer daemon without the registry lock (that daemon may be asking us at the same
    /// time).
    pub(super) fn connect_qp(&self, session: u64, qpn: u32, dest_qpn: u32, step: RemoteConnect) -> Result<(Reply, ReplyFds), RequestError> {
        let RemoteConnect { addr, req } = step;
        if let Err(e) = self.engine.connect_remote(addr, qpn, dest_qpn, &req) {
            self.registry.lock().count_refused(session);
            log::warn!("QP {qpn}: connection to QP {dest_qpn} at {addr} failed: {e}");
            return Err(e.into());
        }
        // The QP's lane, if any, is opened before the registry lock is taken (a
        // connection and a HELLO with the peer daemon).
        // A lane is a socket the client holds: one of the vNIC's `max_lanes`; beyond
        // them the QP goes without (its WRs take the engine's connections).
        // A vNIC with a QoS policy gets no lane: the client would write its small WRs past
        // the scheduler that holds it to its caps and share (docs/architecture.md, "QoS").
        let vnic = self.conns.lock().get(&session).map(|(v, _)| v.clone());
        if vnic.is_some_and(|v| !self.engine.qos_allows_lane(&v)) {
            log::debug!("QP {qpn}: its vNIC has a QoS policy: connected without a lane");
            return self.registry.lock().finish_remote_connect(session, qpn, addr, dest_qpn, None);
        }
        if !self.registry.lock().reserve_lane(session, qpn) {
            log::info!("QP {qpn}: its vNIC holds all the lanes it may: connected without one");
            return self.registry.lock().finish_remote_connect(session, qpn, addr, dest_qpn, None);
        }
        let lane = self.engine.open_lane(addr, qpn, dest_qpn).map_err(|e| {
            log::warn!("QP {qpn}: lane to QP {dest_qpn} at {addr}: {e}");
            RequestError::from(e)
        });
        let mut reg = self.registry.lock();
        if !matches!(lane, Ok(Some(_))) {
            reg.release_lane(session, qpn);
        }
        reg.finish_remote_connect(session, qpn, addr, dest_qpn, lane?)
    }

    /// `MoveToEngine`: the QP of a demoted vNIC connects to its peer QP through this
    /// daemon's engine, without a lane (the client would send on it unpaced). The engine
    /// answers only QPs it holds, so the peer QP is attached first, as a responder (its own
    /// library keeps sending directly; should its vNIC be demoted too, its move finds its
    /// answer ready).
    fn move_to_engine(&self, session: u64, qpn: u32, dest_qpn: u32, step: RemoteConnect) -> Result<(Reply, ReplyFds), RequestError> {
        let RemoteConnect { addr, req } = step;
        if let Some(answer) = self.registry.lock().take_parked_move(qpn) {
            self.registry.lock().finish_move_to_engine(session, qpn, false);
            return Ok(answer);
        }
        let failed = |e: crate::engine::EngineError| {
            log::warn!("QP {qpn}: move onto the engine (peer QP {dest_qpn}) failed: {e}");
            RequestError::from(e)
        };
        self.engine.connect_remote(addr, qpn, dest_qpn, &req).map_err(failed)?;
        let peer = self.registry.lock().peer_to_attach(dest_qpn, qpn);
        if let Some((peer_session, peer_req)) = peer {
            self.engine.connect_remote(addr, dest_qpn, qpn, &peer_req).map_err(failed)?;
            let mut reg = self.registry.lock();
            let answer = reg.finish_remote_connect(peer_session, dest_qpn, addr, qpn, None)?;
            reg.park_for_move(peer_session, dest_qpn, answer);
        }
        let mut reg = self.registry.lock();
        let answer = reg.finish_remote_connect(session, qpn, addr, dest_qpn, None)?;
        reg.finish_move_to_engine(session, qpn, true);
        Ok(answer)
    }

    /// `ResolveUd` of a destination on another host: its engine route is made without the
    /// registry lock (the engine may connect to that host's daemon).
    pub(super) fn resolve_ud(&self, session: u64, qpn: u32, dgid: [u8; 16], step: RemoteUd) -> Result<(Reply, ReplyFds), RequestError> {
        let RemoteUd { addr, src_gid, vnic } = step;
        let created = self.engine.add_ud_route(qpn, src_gid, dgid, addr, &vnic).map_err(|e| {
            log::warn!("UD QP {qpn}: no route to {addr}: {e}");
            RequestError::from(e)
        })?;
        self.registry.lock().finish_remote_ud(session, qpn, created).inspect_err(|_| self.engine.detach_ud(qpn))
    }

    /// Sends the PEER_GONE notices the registry queued.
    pub(super) fn send_notices(&self) {
        let notices = self.registry.lock().take_notices();
        for (addr, remote_qpn, local_qpn) in notices {
            self.engine.send_peer_gone(addr, remote_qpn, local_qpn);
        }
    }
}

/// A copy for a copied MR (the copying fallback's data path), paced by the vNIC's copy share.
fn is_copy(req: &Request) -> bool {
    matches!(req, Request::PeerMrRead { .. } | Request::PeerMrWrite { .. } | Request::PeerMrCopy { .. } | Request::PeerMrAtomic { .. })
}

/// The descriptors a request came with must be as many as it takes, and each a shmem memfd
/// (the only kind any request takes: an MR's chunks). Checked before any lock is taken, so
/// that what the registry refuses under its lock is only ever a memfd: the last `close` of
/// another kind of file can wait as long as the client likes (a TCP socket with `SO_LINGER`
/// and data its peer never acknowledges waits up to the linger time), and under the registry
/// lock that wait stalled every vNIC of the host.
fn check_fds(req: &Request, fds: &[OwnedFd]) -> Result<(), RequestError> {
    let expected = crate::registry::expected_fds(req);
    if fds.len() != expected {
        return Err(RequestError::FdCount { expected, got: fds.len() });
    }
    for fd in fds {
        vrdma_abi::shm::check_sealed(std::os::fd::AsFd::as_fd(fd), 0).map_err(RequestError::ChunkUnsealed)?;
    }
    Ok(())
}
