//! UD: datagrams to QPs of this host (staged in the destination's staging ring, with a GRH
//! before the payload)
//! and of other hosts (handed to vrdmad on the QP's datagram socket).

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use vrdma_abi::ring::{self, STAGED_MAX_SGE};
use vrdma_abi::shm::MemRegion;
use vrdma_abi::verbs::{send_flags, QpState, WcStatus, WrOpcode};
use vrdma_core::access::Need;
use vrdma_core::qp_state::QpType;
use vrdma_core::sg::Span;

use super::direct::inline_spans;
use super::staged;
use super::{Qp, QpInner, QpMut, SendWr};
use crate::error::{invalid, Error};
use crate::peer::{Peer, UdRoute};

/// Bytes of the Global Routing Header at the start of every UD receive (IB semantics: the
/// receive buffer must have room for it; the payload follows).
pub const GRH_LEN: usize = vrdma_abi::ud::GRH_LEN;
/// Largest UD message (the path MTU, 4096).
pub(crate) const UD_MTU: u64 = vrdma_abi::ud::UD_MTU as u64;

/// Hands a UD datagram for another host to vrdmad on the QP's datagram socket. A full socket
/// or a failure drops the datagram, as UD may.
/// `msg` is a buffer kept from one datagram to the next.
fn send_remote_ud(socket: &OwnedFd, msg: &mut Vec<u8>, wr: &SendWr<'_>, dest: &UdDest, qkey: u32, spans: &[Span], total: u64) {
    use vrdma_abi::ud::{UdDatagram, UD_DATAGRAM_HEADER, UD_F_IMM, UD_F_SOLICITED};
    let mut flags = 0;
    if wr.opcode == WrOpcode::SendWithImm {
        flags |= UD_F_IMM;
    }
    if wr.send_flags & send_flags::SOLICITED != 0 {
        flags |= UD_F_SOLICITED;
    }
    let d = UdDatagram { dest_qpn: dest.qpn, qkey, imm: if flags & UD_F_IMM != 0 { wr.imm_data } else { 0 }, flags, dgid: dest.dgid };
    msg.resize(UD_DATAGRAM_HEADER + total as usize, 0);
    msg[..UD_DATAGRAM_HEADER].copy_from_slice(&d.encode_header());
    let mut at = UD_DATAGRAM_HEADER;
    for sp in spans {
        if sp.mem.read_into(sp.offset, &mut msg[at..at + sp.len]).is_err() {
            return;
        }
        at += sp.len;
    }
    // A full socket is a send queue the "NIC" (vrdmad's engine) has not drained yet: wait for
    // room, as a post waits for a hardware queue, but never for long (a stuck daemon must not
    // hang the application: after that the datagram is dropped).
    let deadline = Instant::now() + UD_SEND_WAIT;
    loop {
        // SAFETY: sends `msg`, a live buffer of `msg.len()` bytes, on a socket we hold.
        let n = unsafe { libc::send(socket.as_raw_fd(), msg.as_ptr().cast(), msg.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EAGAIN) {
            return;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        let mut pfd = libc::pollfd { fd: socket.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
        // SAFETY: polls one live pollfd.
        unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as i32) };
    }
}

/// How long a UD send to another host waits for room on its datagram socket.
const UD_SEND_WAIT: Duration = Duration::from_secs(1);

/// Destination of a UD send (what an address handle and the WR's `ud` fields name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdDest {
    /// Destination GID.
    pub dgid: [u8; 16],
    /// Destination QP number.
    pub qpn: u32,
    /// Q_Key (if its high bit is set, the sending QP's own Q_Key is used).
    pub qkey: u32,
}

impl QpInner {
    /// Delivers a UD datagram of `total` bytes (`spans`) to `dest`, or drops it.
    fn deliver_ud(&self, m: &mut QpMut, wr: &SendWr<'_>, dest: &UdDest, spans: &[Span], total: u64) {
        let key = (dest.dgid, dest.qpn);
        if let std::collections::hash_map::Entry::Vacant(slot) = m.ud_peers.entry(key) {
            match Peer::resolve_ud(&self.ctx, self.qpn, dest.dgid, dest.qpn) {
                Ok(p) => {
                    slot.insert(p);
                }
                Err(_) => return, // no such destination: the datagram is lost
            }
        }
        let qkey = if dest.qkey & 0x8000_0000 != 0 { m.attr.qkey } else { dest.qkey };
        if let Some(UdRoute::Remote(socket)) = m.ud_peers.get(&key) {
            return send_remote_ud(socket, &mut m.ud_msg, wr, dest, qkey, spans, total);
        }
        let my_gid = self.ctx.gids().first().copied().unwrap_or_default();
        let mut rsges = std::mem::take(&mut m.rsges);
        let Some(UdRoute::Direct(peer)) = m.ud_peers.get_mut(&key) else { unreachable!("resolved above, not remote") };
        'deliver: {
            if !matches!(peer.state(), Some(QpState::Rtr | QpState::Rts | QpState::Sqd)) || peer.qkey() != qkey {
                break 'deliver;
            }
            let Some(_lock) = peer.ud_lock() else { break 'deliver };
            // Into the destination's staging ring (`staged.rs`), which it drains when it
            // polls; no room there (a receiver that does not poll): lost, as UD may be.
            if !peer.staging().has_room(STAGED_MAX_SGE, GRH_LEN + total as usize) {
                break 'deliver;
            }
            let Some((recv_wr_id, srq)) = peer.take_recv(&mut rsges) else { break 'deliver };
            rsges.retain(|s| s.length > 0);
            let imm = (wr.opcode == WrOpcode::SendWithImm).then_some(wr.imm_data);
            let solicited = wr.send_flags & send_flags::SOLICITED != 0;
            let mut ce = vrdma_abi::ud::recv_completion(recv_wr_id, total as usize, imm, solicited, srq, self.qpn);
            let room: u64 = rsges.iter().map(|s| u64::from(s.length)).sum();
            if room < GRH_LEN as u64 + total {
                ce.status = WcStatus::LocLenErr as u8;
            } else {
                let mut grh = vrdma_abi::ud::grh(&my_gid, &dest.dgid, total as usize);
                // SAFETY: `grh` lives for this block and is only read.
                let gmem = unsafe { MemRegion::from_raw(grh.as_mut_ptr(), GRH_LEN) };
                let grh = Span { mem: gmem, offset: 0, len: GRH_LEN };
                if staged::stage_datagram(peer.staging(), &rsges, grh, spans, total as usize) {
                    ce.flags |= ring::COMP_STAGED;
                } else {
                    ce.status = WcStatus::LocProtErr as u8;
                }
            }
            if ce.status != 0 {
                ce.byte_len = 0;
            }
            peer.complete(&ce);
        }
        m.rsges = rsges;
    }
}

impl Qp {
    /// `ibv_post_send` of one WR on a UD QP, to `dest`. Datagram semantics: the send completes
    /// successfully once executed, whether or not the destination took it (no receive posted,
    /// wrong Q_Key, destination gone: dropped). The receiver gets a [`GRH_LEN`]-byte GRH
    /// (sender's GID at byte 8, its own at byte 24) before the payload, and a completion
    /// with `wc_flags::GRH` and the sender's QPN.
    pub fn post_send_ud(&self, wr: &SendWr<'_>, dest: &UdDest) -> Result<(), Error> {
        let q = &self.inner;
        let op = "post_send";
        let Some(mut m) = q.lock_for_send(wr, op, QpType::Ud, "not a UD QP")? else {
            return Ok(());
        };
        if !matches!(wr.opcode, WrOpcode::Send | WrOpcode::SendWithImm) {
            return Err(invalid(op, format!("{:?} on a UD QP (UD only sends)", wr.opcode)));
        }
        let inline = wr.send_flags & send_flags::INLINE != 0;
        let mut spans = std::mem::take(&mut m.spans);
        let total = if inline {
            // SAFETY: inline data pointers are valid during post_send (verbs contract), and UD
            // sends execute within it.
            Ok(unsafe { inline_spans(wr.sg_list, &mut spans) })
        } else {
            q.local_spans(wr.sg_list, Need::LocalRead, &mut spans)
        };
        let status = match total {
            Err(st) => st,
            Ok(t) if t > UD_MTU => WcStatus::LocLenErr,
            Ok(t) => {
                q.deliver_ud(&mut m, wr, dest, &spans, t);
                q.meter.sent(wr.opcode as u32, t);
                WcStatus::Success
            }
        };
        m.spans = spans;
        if status != WcStatus::Success {
            q.fail(&mut m, wr.wr_id, wr.opcode, status);
        } else if q.sq_sig_all || wr.send_flags & send_flags::SIGNALED != 0 {
            let len = total.unwrap_or(0) as u32;
            q.send_cq.push_local_for(wr.wr_id, WcStatus::Success, wr.opcode.wc_opcode(), q.qpn, len);
        }
        Ok(())
    }
}
