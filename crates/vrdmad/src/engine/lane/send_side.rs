//! A lane QP's send side, which its client and the engine hand back and forth
//! (`ring::MED_SEND_SIDE`), and the WRs the client claimed and sent (or began) itself.

use std::sync::atomic::Ordering;
use std::time::Instant;

use vrdma_abi::ring::{self, SqEntry};
use vrdma_abi::verbs::{send_flags, QpState};

use crate::engine::qp::{Fs, MedQp, Outbox, ReqState};
use crate::engine::Engine;

impl MedQp {
    /// Closes the QP's lane (destroyed, reset, its peer failed): the client's end of it stops
    /// carrying anything, and its reader ends.
    pub(crate) fn close_lane(&self) {
        if self.lane {
            self.conn.shutdown();
        }
    }

    /// Asks the client to leave the send side to the engine (it sends nothing itself, and
    /// rings when it gives the side back).
    pub(crate) fn want_send_side(&self) {
        if self.lane {
            // (After the flag that says why, if any: see `release_send_side_if_clean`.)
            std::sync::atomic::fence(Ordering::SeqCst);
            self.chan_ctl.store_u64(ring::MED_ENGINE_WANTS, 1).ok();
        }
    }

    /// Holds the lane's send side for the engine from now on (`held`: its vNIC got a QoS
    /// policy), or gives it back when clean (the policy is gone). Live: what the client sent
    /// itself is adopted as usual, a frame it left unfinished the engine finishes, and every
    /// later WR waits in the send ring for the scheduler (it completes later, never fails).
    /// Whether this changed anything (the QP is then to be pumped).
    pub(crate) fn hold_lane(&self, held: bool) -> bool {
        if !self.lane || self.lane_held.swap(held, Ordering::AcqRel) == held {
            return false;
        }
        // (Claims are legitimate until the engine has the side and has pumped.)
        self.claims_frozen.store(false, Ordering::Release);
        if held {
            // (Flag first: a release in progress looks at it after clearing the wish, and
            // asks again.)
            std::sync::atomic::fence(Ordering::SeqCst);
            self.want_send_side();
        }
        self.wants_pump.store(true, Ordering::Release);
        true
    }

    /// The client holds the send side, and the engine has asked for it (so the client rings
    /// the doorbell when it lets go).
    pub(crate) fn client_holds_side_and_knows(&self) -> bool {
        self.chan_ctl.load_u64(ring::MED_SEND_SIDE).unwrap_or(0) == ring::SEND_SIDE_CLIENT
            && self.chan_ctl.load_u64(ring::MED_ENGINE_WANTS).unwrap_or(0) != 0
    }

    /// Takes the send side of a lane QP for the engine: false while the client is writing a
    /// request (it rings the doorbell when done, having seen `MED_ENGINE_WANTS`). Never
    /// waits: a client that holds it forever stalls only its own QP.
    pub(crate) fn acquire_send_side(&self) -> bool {
        let Ok(side) = self.chan_ctl.atomic_u64(ring::MED_SEND_SIDE) else { return false };
        self.want_send_side();
        std::sync::atomic::fence(Ordering::SeqCst);
        match side.compare_exchange(ring::SEND_SIDE_FREE, ring::SEND_SIDE_ENGINE, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) | Err(ring::SEND_SIDE_ENGINE) => true,
            Err(ring::SEND_SIDE_CLIENT) => false,
            Err(_) => {
                // Garbage from the client: the engine takes the side.
                side.store(ring::SEND_SIDE_ENGINE, Ordering::SeqCst);
                true
            }
        }
    }

    /// Gives a lane QP's send side back to the client once the engine has nothing of its own
    /// to send: no retry wait, no error, no backlog, every posted WR claimed.
    ///
    /// Whoever wants the side back meanwhile must not be overwritten: a wish made under the
    /// QP's lock (a retry wait, a WR the engine must fail) is held off by holding the lock
    /// throughout; one made without it (a failed link, a gone peer, an error request) sets
    /// its flag before it asks, and the flags are read again after the wish is cleared.
    pub(crate) fn release_send_side_if_clean(&self, e: &Engine) {
        if self.lane_held.load(Ordering::Acquire) {
            // Revoked while its vNIC has a QoS policy: every WR goes through the scheduler.
            return;
        }
        let Some(st) = self.req.try_lock() else { return };
        let clean = !st.stop
            && !st.errored
            && st.wait_until.is_none()
            && st.data_wait.is_none()
            && st.resend_from.is_none()
            && st.probe.is_none()
            && st.unfinished.is_none()
            && !self.frames_owed.load(Ordering::Acquire)
            && !self.stalled(&st)
            && self.conn.backlog() == 0
            && self.chan_ctl.load_u64(ring::MED_UNSENT).unwrap_or(1) == 0
            && !self.unclaimed();
        if !clean || !self.free_of_lockless_wishes() {
            return;
        }
        self.chan_ctl.store_u64(ring::MED_ENGINE_WANTS, 0).ok();
        std::sync::atomic::fence(Ordering::SeqCst);
        if !self.free_of_lockless_wishes() {
            self.want_send_side();
            return;
        }
        if let Ok(side) = self.chan_ctl.atomic_u64(ring::MED_SEND_SIDE) {
            side.store(ring::SEND_SIDE_FREE, Ordering::SeqCst);
        }
        drop(st);
        std::sync::atomic::fence(Ordering::SeqCst);
        // A WR posted while the engine held the side was left to the engine by its poster.
        if self.unclaimed() && self.acquire_send_side() {
            self.wants_pump.store(true, Ordering::Release);
            e.kick();
        }
    }

    /// No reason to keep a lane QP's send side that is set without the QP's lock: the lane
    /// is held for the scheduler, the peer is gone, the link is down, an error is requested,
    /// or the owner's QP left RTS.
    pub(crate) fn free_of_lockless_wishes(&self) -> bool {
        !self.lane_held.load(Ordering::Acquire)
            && !self.peer_gone.load(Ordering::Acquire)
            && !self.is_link_down()
            && self.recv.qp_map.region().load_u64(ring::QP_ERROR_REQUEST).unwrap_or(1) == 0
            && self.owner_state() == Some(QpState::Rts)
    }

    /// Send-ring position up to which WRs are claimed (sent, or being sent, by the client or
    /// the engine), never behind what the engine took.
    pub(crate) fn claimed(&self) -> u64 {
        let head = self.sq.head_pos();
        let c = self.chan_ctl.load_u64(ring::MED_CLAIMED).unwrap_or(0);
        if c.wrapping_sub(head) as i64 > 0 {
            c.min(self.sq.tail_pos().max(head))
        } else {
            head
        }
    }

    /// A lane QP has posted WRs nobody claimed.
    pub(crate) fn unclaimed(&self) -> bool {
        self.sq.tail_pos().wrapping_sub(self.claimed()) as i64 > 0
    }

    /// Takes the WRs the client sent itself from the send ring as in flight (in order: their
    /// PSNs are their ring positions, as the engine numbers what it pops).
    pub(crate) fn adopt(&self, e: &Engine, st: &mut ReqState) {
        if !self.lane {
            return;
        }
        let claimed = self.claimed();
        // (Held too: a pump that began before the lane was given back may freeze claims
        // after the release.)
        if self.claims_frozen.load(Ordering::Acquire)
            && self.lane_held.load(Ordering::Acquire)
            && claimed.wrapping_sub(self.sq.head_pos()) as i64 > 0
        {
            if !self.conn.is_alive() {
                return;
            }
            // Its client claimed WRs while the engine held the lane for the scheduler (it
            // wrote them past its caps or shares): the lane ends, and with it the QP (ERR),
            // as when a client breaks its lane's frames. Nothing of it is adopted.
            log::warn!(
                "engine: QP {} (vNIC {}): its client sent on its lane while the engine held it for QoS: lane closed",
                self.qpn,
                self.vnic
            );
            self.conn.shutdown();
            return;
        }
        let now = Instant::now();
        let mut wr = SqEntry::default();
        while claimed.wrapping_sub(self.sq.head_pos()) as i64 > 0 {
            if !self.sq.pop_into(&mut wr).unwrap_or(false) {
                break;
            }
            let mut f = st.number_popped(&mut wr, now);
            if let Err(status) = self.admit(e, &mut f) {
                // The client checks what it sends itself; one that lies fails its own WR.
                f.state = Fs::Done(status);
                st.stop = true;
                self.want_send_side();
            }
            st.inflight.push_back(f);
        }
    }

    /// A WR the client claimed but did not finish sending (its lane had no room): the engine
    /// writes the rest of its frame, before anything else goes on the lane.
    pub(crate) fn take_unsent(&self, st: &mut ReqState) {
        if !self.lane || self.chan_ctl.load_u64(ring::MED_UNSENT).unwrap_or(0) == 0 {
            return;
        }
        let Ok(w) = self.chan_ctl.atomic_u64(ring::MED_UNSENT) else { return };
        let v = w.swap(0, Ordering::AcqRel);
        let sent = self.chan_ctl.load_u64(ring::MED_UNSENT_BYTES).unwrap_or(0);
        // (Whatever the client says: the peer's daemon checks a token, and one it made up
        // only breaks its own lane.)
        let word = |i: usize| self.chan_ctl.load_u64(ring::MED_UNSENT_ACK + 8 * i).unwrap_or(0);
        let token = (word(0) != 0).then(|| ring::AckToken { counter: word(0), psn: word(1) as u32, mac: word(2) });
        if v != 0 && st.unfinished.is_none() {
            st.unfinished = Some((v.wrapping_sub(1) as u32, sent, token));
        }
    }

    /// Writes the rest of the frame the client began (see [`MedQp::take_unsent`]); its
    /// bytes are the ones the client would have written (one header builder, the same WR).
    /// False if it waits for its data (a copied MR's owner's memory did not give it now:
    /// nothing else goes on the lane before it, and the QP is pumped again on a timer).
    pub(crate) fn finish_unsent(&self, e: &Engine, st: &mut ReqState, out: &mut Outbox) -> bool {
        let Some((psn, sent, token)) = st.unfinished.take() else { return true };
        let Some(f) = st.inflight.iter().find(|f| f.psn == psn && f.state == Fs::Sent) else {
            // (Flushed meanwhile.) What follows a cut frame would be misread: the lane ends.
            if sent > 0 {
                self.conn.shutdown();
            }
            return true;
        };
        // (The frame's own data: a READ or atomic request carries none, whatever its length.)
        if u64::from(self.header(f).data_len) > ring::LANE_DATA_MAX && f.wr.send_flags & send_flags::INLINE == 0 {
            // Never sent from a client (too large): a lying client breaks its own lane.
            self.conn.shutdown();
            return true;
        }
        let start = out.cur.len();
        // (The header the client began: with the token it carried, if any; the whole frame
        // in the batch, since the client's bytes are cut out of it below.)
        if self.send_wr_copied(e, out, f, token).is_err() {
            st.unfinished = Some((psn, sent, token));
            self.wait_for_data(e, st);
            return false;
        }
        if self.conn.is_sealed() {
            if start > 0 || !out.items.is_empty() {
                // (Never: nothing is put before this. Were it, the rest would overtake it.)
                self.conn.shutdown();
                return true;
            }
            // The client sealed the frame (records numbered from the word it left) and
            // wrote `sent` bytes of them: the same plaintext sealed again is the same
            // records, whose rest goes now, first on the lane (nothing was put before it).
            let plain: Vec<u8> = out.cur.drain(start..).collect();
            let seq = self.chan_ctl.load_u64(ring::MED_UNSENT_SEQ).unwrap_or(u64::MAX);
            let skip = usize::try_from(sent).unwrap_or(usize::MAX);
            if self.conn.send_resealed(&plain, seq, skip).is_err() {
                self.conn.shutdown();
            }
            return true;
        }
        let frame = out.cur.len() - start;
        let skip = usize::try_from(sent).map_or(frame, |s| s.min(frame));
        out.cur.drain(start..start + skip);
        true
    }
}

#[cfg(test)]
mod tests {
    use vrdma_abi::ring::{self, SqEntry};

    use crate::engine::testing::{connection, engine, mediated_lane_qp};

    /// A lane QP with `n` WRs its client posted and claimed as sent on its lane.
    fn claimed_by_client(q: &crate::engine::qp::MedQp, n: u64) {
        let mut head = 0;
        for i in 0..n {
            assert!(q.sq.push(&SqEntry { wr_id: i, ..SqEntry::default() }, &mut head).unwrap());
        }
        q.chan_ctl.store_u64(ring::MED_CLAIMED, q.sq.tail_pos()).unwrap();
    }

    /// A frame larger than a batch (a lane's client sends WRs of up to 64 KiB itself) that
    /// the client could write only in part is finished by the engine: on the lane, exactly
    /// the frame's bytes after those the client wrote, its data from the MR.
    #[test]
    fn the_engine_finishes_a_large_frame_its_client_began() {
        use std::io::Read;
        use vrdma_abi::ring::Sge;
        use vrdma_abi::verbs::{access, WrOpcode};
        use vrdma_abi::wire::FrameHeader;

        let t = engine();
        let (mut peer, conn) = connection();
        let (q, _side) = mediated_lane_qp(&t, 7, 70, &conn);
        let (addr, len) = (0x10000u64, 16usize << 10);
        let mr = t.broker.register_mr(5, addr, len, access::LOCAL_WRITE);
        let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        mr.write(addr, &data);
        let wr = SqEntry {
            wr_id: 1,
            opcode: WrOpcode::RdmaWrite as u32,
            rkey: 9,
            remote_addr: 0x2000,
            sges: vec![Sge { addr, length: len as u32, lkey: 5 }],
            ..SqEntry::default()
        };
        let mut head = 0;
        assert!(q.sq.push(&wr, &mut head).unwrap());
        // The client claimed it and wrote its first 1000 bytes, then found no room.
        let sent = 1000;
        q.chan_ctl.store_u64(ring::MED_CLAIMED, 1).unwrap();
        q.chan_ctl.store_u64(ring::MED_UNSENT_BYTES, sent as u64).unwrap();
        q.chan_ctl.store_u64(ring::MED_UNSENT, 1).unwrap();
        q.chan_ctl.store_u64(ring::MED_ENGINE_WANTS, 1).unwrap();
        q.pump(&t.e, &mut crate::engine::qos::Budget::new(64, 1 << 20));

        let mut frame = FrameHeader::request(WrOpcode::RdmaWrite, &wr, 0, 7, 70, len as u32).encode().to_vec();
        frame.extend_from_slice(&data);
        let mut rest = vec![0u8; frame.len() - sent];
        peer.read_exact(&mut rest).unwrap();
        assert!(rest == frame[sent..], "the rest of the client's frame, byte for byte");
        assert!(conn.is_alive(), "the lane goes on");
        assert!(crate::engine::testing::nothing_sent(&peer), "nothing else");
    }

    /// Claims made before the engine pumped the held QP are the client's own WRs of before
    /// the hold: adopted.
    #[test]
    fn claims_before_the_engine_took_a_held_lane_are_adopted() {
        let t = engine();
        let (_peer, conn) = connection();
        let (q, _side) = mediated_lane_qp(&t, 7, 70, &conn);
        assert!(q.hold_lane(true));
        claimed_by_client(&q, 2);
        q.adopt(&t.e, &mut q.req.lock());
        assert_eq!(q.sq.head_pos(), 2, "adopted");
        assert!(conn.is_alive());
    }

    /// Once the engine has pumped a held lane QP, a claim is a client writing on a lane it
    /// does not hold: nothing of it is adopted, and the lane ends.
    #[test]
    fn a_claim_on_a_lane_the_engine_holds_ends_the_lane() {
        let t = engine();
        let (_peer, conn) = connection();
        let (q, _side) = mediated_lane_qp(&t, 7, 70, &conn);
        assert!(q.hold_lane(true));
        // (What `pump_locked` leaves when held.)
        q.claims_frozen.store(true, std::sync::atomic::Ordering::Release);
        claimed_by_client(&q, 2);
        q.adopt(&t.e, &mut q.req.lock());
        assert_eq!(q.sq.head_pos(), 0, "nothing adopted");
        assert!(!conn.is_alive(), "the lane was shut down");
    }

    /// Given back, the lane's claims are the client's right again, whatever a pump that
    /// raced the release left behind.
    #[test]
    fn a_lane_given_back_adopts_claims_again() {
        let t = engine();
        let (_peer, conn) = connection();
        let (q, _side) = mediated_lane_qp(&t, 7, 70, &conn);
        assert!(q.hold_lane(true));
        assert!(q.hold_lane(false));
        assert!(!q.hold_lane(false), "no change, nothing to pump");
        q.claims_frozen.store(true, std::sync::atomic::Ordering::Release);
        claimed_by_client(&q, 1);
        q.adopt(&t.e, &mut q.req.lock());
        assert_eq!(q.sq.head_pos(), 1);
        assert!(conn.is_alive());
    }

    /// A lane's socket is shared with its client, which can make its last `close` wait:
    /// `SO_LINGER`, and a frame kept unsent behind it with a pacing rate of a byte a second
    /// (`SO_MAX_PACING_RATE`: no help from the peer daemon, which reads all it gets). It
    /// closes its own descriptor, so the last is ours, dropped with the QP by whoever holds
    /// it last: here the doorbell thread, which keeps the QPs it pumped until it next wakes.
    /// Before, that drop held the doorbell thread (every vNIC's sends, and the heartbeats
    /// whose silence fails every QP of the host at its peers) for the linger time (30 s
    /// here; a client may choose days); the socket is now disconnected before it closes.
    #[test]
    fn a_lingering_lane_never_holds_up_the_doorbell_thread() {
        use std::io::{Read, Write};
        use std::os::fd::AsRawFd;
        use std::sync::atomic::Ordering;
        use std::time::{Duration, Instant};

        use vrdma_abi::verbs::WrOpcode;
        use vrdma_abi::wire::{FrameHeader, Kind, HEADER_LEN};

        use crate::engine::connection::set_socket_option;
        use crate::engine::testing::mediated_qp;

        let t = engine();
        let (mut lane_peer, lane) = connection();
        // (The peer daemon's end reads all the lane carries, until it is reset.)
        lane_peer.set_read_timeout(None).unwrap();
        std::thread::spawn(move || {
            let mut b = [0u8; 4096];
            while matches!(lane_peer.read(&mut b), Ok(1..)) {}
        });
        let (q, _side) = mediated_lane_qp(&t, 7, 70, &lane);
        {
            // The client, with its descriptor of the lane.
            let client = lane.try_clone_stream().unwrap();
            client.set_nodelay(true).unwrap();
            // (The kernel paces a socket from its tenth segment on.)
            for _ in 0..12 {
                (&client).write_all(&[0u8; 64]).unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
            let rate: libc::c_uint = 1;
            set_socket_option(client.as_raw_fd(), libc::SOL_SOCKET, libc::SO_MAX_PACING_RATE, &rate).unwrap();
            (&client).write_all(&[0u8; 1000]).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            // Its turn comes 1000 s after the last segment's, and the FIN's after it.
            (&client).write_all(&[0u8; 64]).unwrap();
            let linger = libc::linger { l_onoff: 1, l_linger: 30 };
            set_socket_option(client.as_raw_fd(), libc::SOL_SOCKET, libc::SO_LINGER, &linger).unwrap();
        }

        // Rung: the doorbell thread pumps the QP, and keeps it until it next wakes.
        q.wants_pump.store(true, Ordering::Release);
        t.e.kick();
        std::thread::sleep(Duration::from_millis(100));
        // Destroyed: the doorbell thread holds the last reference.
        let started = Instant::now();
        t.e.detach(7);
        drop((q, lane));
        assert!(started.elapsed() < Duration::from_secs(2), "destroying the QP waited {:?}", started.elapsed());

        // Another tenant's QP rings: its frame goes at once.
        let (mut peer2, c2) = connection();
        let (q2, _side2) = mediated_qp(&t, 8, 80, &c2);
        let wr = SqEntry { wr_id: 1, opcode: WrOpcode::Send as u32, ..SqEntry::default() };
        let mut head = 0;
        assert!(q2.sq.push(&wr, &mut head).unwrap());
        q2.wants_pump.store(true, Ordering::Release);
        let started = Instant::now();
        t.e.kick();
        peer2.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut frame = [0u8; HEADER_LEN];
        let got = peer2.read_exact(&mut frame);
        assert!(got.is_ok(), "another QP's SEND waited {:?} for the doorbell thread", started.elapsed());
        let h = FrameHeader::decode(&frame).unwrap();
        assert_eq!((h.kind, h.dst_qpn, h.src_qpn), (Kind::Send, 80, 8));
    }
}
