//! Request frames built from WRs: whole, or (a large WRITE or SEND on a connection QPs
//! share) in segments, a pump's budget at a time; their data copied into the batch or sent
//! later straight from registered memory.

use vrdma_abi::ring;
use vrdma_abi::verbs::send_flags;
use vrdma_abi::wire::{self, FrameHeader, Kind};
use vrdma_core::access::Need;

use super::requester::{InFlight, Out, Outbox};
use super::{sge_pieces, MedQp, BATCH_DATA_MAX};
use crate::engine::mr::NotNow;
use crate::engine::Engine;

impl MedQp {
    /// Queues the request frame of `f` whole in the batch, whatever its size (the rest of a
    /// frame a lane's owner began: see `finish_unsent`); `Err(NotNow)` (nothing queued) if
    /// its data is in a copied MR whose owner's memory did not give it now.
    pub(crate) fn send_wr_copied(&self, e: &Engine, out: &mut Outbox, f: &InFlight, token: Option<ring::AckToken>) -> Result<(), NotNow> {
        self.queue_part(e, out, f, self.with_acks(self.header(f), token), 0, false)
    }

    /// Queues the frames of `f` from its data byte `from` on, with ACK `token` on a lane:
    /// small ones copied into the batch, large ones sent later straight from registered
    /// memory. A WRITE or SEND of more than [`wire::SEGMENT`] bytes on a
    /// connection shared by QPs goes in segments (`wire::F_MORE`), queued until `allowed`
    /// bytes are (at least one): the doorbell thread serves other QPs between them, whose
    /// frames then take that connection between them too. Before, one WRITE of up to 2 GiB
    /// held it for as long as it took to send. So does one from a copied MR on a lane (its
    /// bytes are read on its owner's agent, a segment at a time, into the batch).
    /// Returns the bytes charged (data, or a READ's length), where the rest begins, if any
    /// is left, and whether it stopped there because a copied MR's owner's memory did not
    /// give the next frame's data now (`mr::NotNow`).
    pub(super) fn queue_frames(
        &self,
        e: &Engine,
        out: &mut Outbox,
        f: &InFlight,
        from: u32,
        token: Option<ring::AckToken>,
        allowed: usize,
    ) -> (u32, Option<u32>, bool) {
        let whole = self.header(f);
        let len = whole.data_len;
        let inline = f.wr.send_flags & send_flags::INLINE != 0;
        let segmented = !inline && len > wire::SEGMENT && (!self.lane || self.data_is_copied(e, f));
        if !segmented {
            let mut h = self.with_acks(whole, token);
            if f.resuming() && h.kind == Kind::ReadReq {
                // (Its response from where the parts its memory stored end.)
                h.flags |= wire::F_RESUME;
                h.arg2 = u64::from(f.resume_at);
            }
            return match self.queue_part(e, out, f, h, 0, true) {
                Ok(()) => (f.len, None, false),
                Err(NotNow) => (0, Some(0), true),
            };
        }
        let mut at = from;
        loop {
            let n = (len - at).min(wire::SEGMENT);
            let mut h = whole;
            h.data_len = n;
            if at == 0 {
                h = self.with_acks(h, token);
            } else {
                h.flags |= wire::F_CONT;
                h.arg2 = u64::from(at);
                if at == from && f.resuming() {
                    h.flags |= wire::F_RESUME;
                }
            }
            if at + n < len {
                h.flags |= wire::F_MORE;
            }
            if h.kind == Kind::Write {
                h.remote_addr = h.remote_addr.wrapping_add(u64::from(at));
            }
            if self.queue_part(e, out, f, h, at, true).is_err() {
                return (at - from, Some(at), true);
            }
            at += n;
            if at >= len || (at - from) as usize >= allowed {
                return (at - from, (at < len).then_some(at), false);
            }
        }
    }

    /// Whether any of `f`'s data is in a copied MR.
    fn data_is_copied(&self, e: &Engine, f: &InFlight) -> bool {
        f.wr.sges
            .iter()
            .filter(|s| s.length > 0)
            .any(|s| self.local_span(e, s.lkey, s.addr, u64::from(s.length), Need::LocalRead).is_ok_and(|(mr, _)| mr.is_copied()))
    }

    /// `h` carrying the ACK this QP owes (not on a lane: there its responder takes them only
    /// as tokens; still owed until the frame is queued, see [`MedQp::queue_part`]) or, on a
    /// lane, `token`.
    fn with_acks(&self, mut h: FrameHeader, token: Option<ring::AckToken>) -> FrameHeader {
        if let Some(psn) = (!self.lane).then(|| self.owed_ack()).flatten() {
            h.flags |= wire::F_ACKS;
            h.status = psn;
        }
        if let Some(t) = &token {
            h.carry(t);
        }
        h
    }

    /// Queues frame `h` with its `h.data_len` data bytes from byte `at` of `f`'s data;
    /// `Err(NotNow)`, nothing queued, if a copied MR's owner's memory did not give them now.
    /// The ACK `h` carries, if any, is no longer owed once it is queued: not before, or the
    /// connection's reader, seeing none owed while a frame whose data did not come held it,
    /// would send none, and the peer would wait for it until that data came.
    fn queue_part(&self, e: &Engine, out: &mut Outbox, f: &InFlight, h: FrameHeader, at: u32, by_reference: bool) -> Result<(), NotNow> {
        let len = h.data_len as usize;
        let inline = f.wr.send_flags & send_flags::INLINE != 0;
        // No allocation per WR: the non-empty elements are walked in place.
        let sges = f.wr.sges.iter().filter(|s| s.length > 0);
        let single = sges.clone().nth(1).is_none();
        if let (true, false, true, Some(s)) = (by_reference && len > BATCH_DATA_MAX, inline, single, sges.clone().next()) {
            if let Ok((mr, off)) = self.local_span(e, s.lkey, s.addr, u64::from(s.length), Need::LocalRead) {
                if !mr.is_copied() {
                    out.push_big(Out::Region(h, mr, off + at as usize, len));
                    self.settle_carried_ack(&h);
                    return Ok(());
                }
            }
        }
        let batch = &mut out.cur;
        let start = batch.len();
        batch.extend_from_slice(&h.encode());
        if len == 0 || inline {
            batch.extend_from_slice(if len == 0 { &[] } else { &f.wr.inline });
            self.settle_carried_ack(&h);
            return Ok(());
        }
        let who = self.as_requester(f.psn);
        for (addr, lkey, n) in sge_pieces(&f.wr.sges, u64::from(at), len as u64) {
            let at = batch.len();
            batch.resize(at + n as usize, 0);
            // Deregistered since admission: zeros go out (the application broke the verbs
            // contract by deregistering an MR in use).
            if let Ok((mr, off)) = self.local_span(e, lkey, addr, n, Need::LocalRead) {
                if mr.read_for(who, off, &mut batch[at..]).is_err() {
                    batch.truncate(start);
                    return Err(NotNow);
                }
            }
        }
        self.settle_carried_ack(&h);
        Ok(())
    }

    /// Frame `h` is queued: the ACK it carries (not on a lane), if any, is no longer owed.
    fn settle_carried_ack(&self, h: &FrameHeader) {
        if !self.lane && h.flags & wire::F_ACKS != 0 {
            self.settle_owed_ack(h.status);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use vrdma_abi::ring::{Sge, SqEntry};
    use vrdma_abi::verbs::{access, WrOpcode};
    use vrdma_abi::wire::{self, FrameHeader, Kind, HEADER_LEN};

    use crate::engine::testing::{connection, engine, mediated_qp_of, small_buffers};

    const LEN: usize = 24 << 20;
    const KEY: u32 = 0x700;
    const ADDR: u64 = 0x10_0000;

    /// A WRITE far larger than a segment, on a connection its QP shares with another vNIC's
    /// QP (as every QP without a lane shares its host's connection to the peer), goes in
    /// segments: the other QP's SEND goes between them, after at most a few, not after the
    /// whole WRITE. Its segments are contiguous, flagged, each at its own remote address,
    /// and carry the MR's bytes. Before, the 24 MiB went as one frame first (at the slow
    /// peer's pace here: seconds; 2 GiB on a 10 Gbit/s link held every other tenant's
    /// traffic to that host for almost two seconds).
    #[test]
    fn a_large_write_lets_another_qps_requests_through() {
        let t = engine();
        let mr = t.broker.register_mr(KEY, ADDR, LEN, access::LOCAL_WRITE);
        let data: Vec<u8> = (0..LEN).map(|i| (i % 239) as u8).collect();
        mr.write(ADDR, &data);
        let (mut peer, c) = connection();
        // Socket buffers of a few hundred KiB (loopback's grow to megabytes, which a SEND
        // queued behind would wait for whatever the engine does).
        small_buffers(std::os::fd::AsRawFd::as_raw_fd(&peer), libc::SO_RCVBUF);
        small_buffers(c.fd().as_raw_fd(), libc::SO_SNDBUF);
        let (big, _s1) = mediated_qp_of(&t, 0x11, 0x21, &c, "bulk");
        let (small, _s2) = mediated_qp_of(&t, 0x12, 0x22, &c, "victim");

        // The peer daemon's reader: slow (a far link) until the other QP's SEND is in.
        let fast = Arc::new(AtomicBool::new(false));
        let f = fast.clone();
        let reader = std::thread::spawn(move || {
            peer.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let (mut frames, mut written) = (Vec::new(), Vec::new());
            let (mut big_done, mut small_after) = (false, None);
            while !(big_done && small_after.is_some()) {
                let mut b = [0u8; HEADER_LEN];
                peer.read_exact(&mut b).unwrap();
                let h = FrameHeader::decode(&b).unwrap();
                let mut d = vec![0u8; h.data_len as usize];
                for chunk in d.chunks_mut(64 << 10) {
                    peer.read_exact(chunk).unwrap();
                    if !f.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(4));
                    }
                }
                if h.dst_qpn == 0x22 {
                    small_after = Some(written.len());
                    f.store(true, Ordering::Relaxed);
                } else {
                    big_done = h.flags & wire::F_MORE == 0;
                    written.extend_from_slice(&d);
                    frames.push(h);
                }
            }
            (frames, written, small_after.unwrap())
        });

        let write = SqEntry {
            wr_id: 1,
            opcode: WrOpcode::RdmaWrite as u32,
            rkey: 9,
            remote_addr: 0x4000_0000,
            sges: vec![Sge { addr: ADDR, length: LEN as u32, lkey: KEY }],
            ..SqEntry::default()
        };
        assert!(big.sq.push(&write, &mut 0).unwrap());
        big.wants_pump.store(true, Ordering::Release);
        t.e.kick();
        let started = Instant::now();
        while big.wire_bytes.load(Ordering::Relaxed) == 0 {
            assert!(started.elapsed() < Duration::from_secs(5), "the WRITE never began");
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(50));
        assert!(small.sq.push(&SqEntry { wr_id: 2, opcode: WrOpcode::Send as u32, ..SqEntry::default() }, &mut 0).unwrap());
        small.wants_pump.store(true, Ordering::Release);
        t.e.kick();
        let (frames, written, before_small) = reader.join().unwrap();

        assert!(before_small <= 2 << 20, "the other QP's SEND waited behind {before_small} bytes of the WRITE");
        assert!(written == data, "the segments carry the MR's bytes, in order");
        let mut at = 0u64;
        for (i, h) in frames.iter().enumerate() {
            assert_eq!((h.kind, h.psn, h.remote_addr), (Kind::Write, 0, 0x4000_0000 + at), "segment {i}");
            assert!(h.data_len <= wire::SEGMENT);
            assert_eq!(h.flags & wire::F_CONT != 0, i > 0, "segment {i}");
            assert_eq!(h.flags & wire::F_MORE != 0, i + 1 < frames.len(), "segment {i}");
            at += u64::from(h.data_len);
        }
        assert_eq!(at, LEN as u64);
    }

    /// A WRITE whose data is in a copied MR whose owner's memory does not answer (it holds
    /// its memory-map lock: here the test's stall) holds back no other tenant's frames: the
    /// doorbell thread, which serves every QP of the host, leaves it for a later pump and
    /// sends the other QP's SEND; once the memory answers, the WRITE goes, with its bytes
    /// (read on the owner's agent). Before, the doorbell thread waited in that memory, and
    /// every QP of the host with it.
    #[test]
    fn a_write_from_a_stalled_copied_mr_lets_other_qps_frames_through() {
        const COPIED: u32 = 0x701;
        let t = engine();
        let mut mr = t.broker.register_copied_mr(COPIED, 8192, access::LOCAL_WRITE);
        let data: Vec<u8> = (0..3000).map(|i| (i % 251) as u8).collect();
        mr.set(100, &data);
        let (mut peer, c) = connection();
        peer.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let (owner, _s1) = mediated_qp_of(&t, 0x11, 0x21, &c, "owner");
        let (other, _s2) = mediated_qp_of(&t, 0x12, 0x22, &c, "other");

        let stall = mr.mem.stall.write();
        // (It owes the peer an ACK, which its next frame carries: the WRITE's, once it goes.)
        owner.owe_ack(5);
        let write = SqEntry {
            wr_id: 1,
            opcode: WrOpcode::RdmaWrite as u32,
            rkey: 9,
            remote_addr: 0x4000_0000,
            sges: vec![Sge { addr: mr.addr + 100, length: data.len() as u32, lkey: COPIED }],
            ..SqEntry::default()
        };
        assert!(owner.sq.push(&write, &mut 0).unwrap());
        owner.wants_pump.store(true, Ordering::Release);
        t.e.kick();
        std::thread::sleep(Duration::from_millis(20));
        assert!(other.sq.push(&SqEntry { wr_id: 2, opcode: WrOpcode::Send as u32, ..SqEntry::default() }, &mut 0).unwrap());
        other.wants_pump.store(true, Ordering::Release);
        t.e.kick();
        let mut b = [0u8; HEADER_LEN];
        peer.read_exact(&mut b).expect("the other QP's SEND went while the owner's memory stalled");
        let first = FrameHeader::decode(&b).unwrap();
        assert_eq!((first.dst_qpn, first.kind), (0x22, Kind::Send));
        assert!(owner.owes_ack(), "the ACK the WRITE that did not go was to carry is owed still");
        drop(stall);

        peer.read_exact(&mut b).expect("the WRITE goes once the memory answers");
        let h = FrameHeader::decode(&b).unwrap();
        assert_eq!((h.dst_qpn, h.kind, h.data_len), (0x21, Kind::Write, data.len() as u32));
        assert_eq!((h.flags & wire::F_ACKS != 0, h.status), (true, 5), "it carries the ACK");
        let mut got = vec![0u8; data.len()];
        peer.read_exact(&mut got).unwrap();
        assert!(got == data, "the MR's bytes");
    }

    /// The pieces of a byte range of a scatter list: skipping empty elements, cut at both
    /// ends, nothing past the list.
    #[test]
    fn a_range_of_a_scatter_list_is_cut_into_its_elements_pieces() {
        use super::sge_pieces;
        let sg = |addr, length| Sge { addr, length, lkey: addr as u32 };
        let sges = [sg(100, 10), sg(500, 0), sg(200, 20), sg(300, 5)];
        let pieces = |from, len| sge_pieces(&sges, from, len).collect::<Vec<_>>();
        assert_eq!(pieces(0, 35), [(100, 100, 10), (200, 200, 20), (300, 300, 5)]);
        assert_eq!(pieces(4, 10), [(104, 100, 6), (200, 200, 4)]);
        assert_eq!(pieces(10, 20), [(200, 200, 20)]);
        assert_eq!(pieces(29, 100), [(219, 200, 1), (300, 300, 5)]);
        assert_eq!(pieces(35, 5), []);
        assert_eq!(pieces(3, 0), []);
    }
}
