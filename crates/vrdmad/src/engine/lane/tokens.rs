//! ACK tokens: the responder's deferred ACK published for the QP's owner to carry on its lane
//! (no frame of ours), settled by the lane's reader; and the requester's side that takes them.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vrdma_abi::ring;
use vrdma_abi::verbs::WrOpcode;
use vrdma_abi::wire::{self, FrameHeader, Kind};

use crate::engine::qp::{MedQp, RespState, OWED};

/// The responder's ACK tokens for the QP's owner to carry on its lane.
#[derive(Default)]
pub(crate) struct TokenState {
    /// Tokens published (the last one's counter).
    published: u64,
    /// The token published last and not yet settled (carried, or replaced by our own ACK),
    /// with when.
    pending: Option<(ring::AckToken, Instant)>,
    /// The last PSN a token acknowledged that no ACK of ours has covered since, and when we
    /// acknowledge it ourselves at the latest (an owner that withholds tokens delays its
    /// peer's completions by at most [`TOKEN_TRUST`]).
    unconfirmed: Option<(u32, Instant)>,
    /// Deferred ACKs to send without a token still (after tokens went uncarried), and how
    /// many the next uncarried one skips.
    skip: u32,
    backoff: u32,
}

/// How long a token waits for the owner's next request before the responder acknowledges by
/// itself (give or take a [`TOKEN_TICK`]): an owner that answers what it just received
/// does so long before; one that does not answer pays it once, and tokens then pause.
pub(crate) const TOKEN_WAIT: Duration = Duration::from_micros(500);

/// The period of a lane reader's token timer (see `lane::token_timer`).
pub(crate) const TOKEN_TICK: Duration = Duration::from_micros(500);

/// Longest a token's PSN goes without an ACK of the responder's own.
pub(crate) const TOKEN_TRUST: Duration = Duration::from_millis(2);

/// Uncarried tokens turn them off for this many deferred ACKs, doubling up to
/// [`TOKEN_BACKOFF_MAX`] while they keep going uncarried (an owner that does not answer:
/// at most one wait in this many of its peer's messages).
const TOKEN_BACKOFF_MIN: u32 = 64;

const TOKEN_BACKOFF_MAX: u32 = 1 << 16;

/// What a lane's reader does about a QP's ACKs before it waits ([`MedQp::ack_duty`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum AckDuty {
    /// Nothing until this instant (or the next request).
    Wait(Instant),
    /// Send the deferred ACK now ([`crate::engine::responder::send_owed_ack`]).
    SendOwed,
    /// Acknowledge this PSN ourselves (tokens did; the owner may have withheld them).
    Confirm(u32),
    /// Nothing left.
    Idle,
}

impl MedQp {
    /// On a lane, the ACK token published for the owner that a request of `opcode` the
    /// engine sends in its place carries (a SEND or WRITE: the owner's large WRs, resends
    /// after an RNR wait), so the owner's answers acknowledge as well whoever sends them;
    /// it counts as carried ([`ring::MED_ACK_TAKEN`]).
    pub(crate) fn token_to_carry(&self, opcode: WrOpcode) -> Option<ring::AckToken> {
        if !self.lane || !matches!(opcode, WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm) {
            return None;
        }
        ring::AckToken::take_next(&self.chan_ctl, 0)
    }

    /// Publishes the deferred ACK of SEND/WRITE `psn` (executed, but for its completion,
    /// written next) as a token for the owner to carry on its lane, in the next request it
    /// sends there itself: the peer daemon reads that request anyway, so the ACK costs no
    /// frame, system call or wakeup of ours and no wakeup of the peer's reader (on 2 CPUs
    /// the wakeup alone is a large part of a one-way message). Only a QP with a lane whose
    /// requests came on a lane; none while uncarried tokens turned them off. Whether the
    /// owner carried it is settled by [`MedQp::ack_duty`].
    ///
    /// The MAC is keyed with the secret of the *requester's* lane, the one the acknowledged
    /// request came on (`requester_key`): its daemon checks a token with its QP's own lane
    /// secret, so a token of an earlier connection of the pair (another lane, another
    /// secret) never counts after a reconnection restarted the PSNs.
    pub(crate) fn publish_ack_token(&self, rs: &mut RespState, psn: u32, requester_key: [u64; 2]) {
        if !self.lane {
            return;
        }
        let t = &mut rs.tokens;
        if t.skip > 0 {
            t.skip -= 1;
            return;
        }
        let counter = t.published + 1;
        let token = ring::AckToken { psn, counter, mac: wire::lane_ack_mac(requester_key, self.remote_qpn, self.qpn, psn, counter) };
        if token.publish(&self.chan_ctl).is_err() {
            return;
        }
        t.published = counter;
        let now = Instant::now();
        t.pending = Some((token, now));
        let due = t.unconfirmed.map_or(now + TOKEN_TRUST, |(_, due)| due);
        t.unconfirmed = Some((psn, due));
    }

    /// Our own ACK covers everything executed: no token waits or stays unconfirmed.
    pub(crate) fn acked_by_us(rs: &mut RespState) {
        rs.tokens.pending = None;
        rs.tokens.unconfirmed = None;
    }

    /// What the reader of the lane this QP's requests come on must do about its ACKs before
    /// it waits for more (at `now`): wait (for the owner to carry the pending token, or for an
    /// unconfirmed PSN's deadline), send the deferred ACK (no token, or one the owner did not
    /// carry in [`TOKEN_WAIT`]: tokens then pause), confirm a PSN tokens acknowledged (an
    /// ACK of our own at most [`TOKEN_TRUST`] later), or nothing. `can_wait` false (the
    /// reader has no timer): a pending token is settled at once.
    pub(crate) fn ack_duty(&self, now: Instant, can_wait: bool) -> AckDuty {
        let mut guard = self.resp.lock();
        let rs = &mut *guard;
        let t = &mut rs.tokens;
        if let Some((token, at)) = t.pending {
            // (The owner's claim: a false one only delays its peer, by TOKEN_TRUST at most.)
            let taken = self.chan_ctl.load_u64(ring::MED_ACK_TAKEN).unwrap_or(0);
            let carried = taken >= token.counter && taken <= t.published;
            let until = at + TOKEN_WAIT;
            if !carried && now < until && can_wait {
                return AckDuty::Wait(t.unconfirmed.map_or(until, |(_, due)| due.min(until)));
            }
            t.pending = None;
            if carried {
                t.backoff = 0;
                let _ = self.ack_owed.compare_exchange(OWED | u64::from(token.psn), 0, Ordering::AcqRel, Ordering::Relaxed);
                // The ACK went: the count towards one of our own starts again, so that a
                // ping-pong's ACKs all ride on its answers.
                rs.unacked = 0;
                rs.unacked_bytes = 0;
            } else {
                t.backoff = (t.backoff * 2).clamp(TOKEN_BACKOFF_MIN, TOKEN_BACKOFF_MAX);
                t.skip = t.backoff;
            }
        }
        if self.ack_owed.load(Ordering::Acquire) != 0 {
            return AckDuty::SendOwed;
        }
        match t.unconfirmed {
            Some((psn, due)) if now >= due || !can_wait => {
                t.unconfirmed = None;
                AckDuty::Confirm(psn)
            }
            Some((_, due)) => AckDuty::Wait(due),
            None => AckDuty::Idle,
        }
    }

    /// Starts fetching the cache lines of shared memory that handling request `h` will
    /// touch and that the owner's CPU wrote last (its send ring for a token's WRs, its
    /// receive ring, the token's seqlock), so that their cross-core misses overlap instead of
    /// following one another on the way to the completion its application waits for. The
    /// completion rings are left alone: their owner spins on them. (Lane QPs only: the
    /// others' owners write neither the claim nor tokens.)
    pub(crate) fn prefetch_for(&self, h: &FrameHeader) {
        if !self.lane {
            return;
        }
        if h.flags & wire::F_ACKS != 0 {
            self.chan_ctl.prefetch(ring::MED_CLAIMED, false);
            self.sq.prefetch_next();
            self.chan_ctl.prefetch(ring::MED_RETIRED, true);
        }
        if h.kind == Kind::Send || h.kind == Kind::Write && h.flags & wire::F_IMM != 0 {
            self.recv.prefetch_recv();
            self.chan_ctl.prefetch(ring::MED_ACK_TOKEN, true);
        }
    }

    /// Whether request `h` (from the peer's QP `h.src_qpn` to this one, on a lane) carries a
    /// genuine ACK token of the peer daemon's for this QP's requests ([`wire::F_ACKS`]): the
    /// MAC keyed with this QP's own lane secret (so only the peer daemon, which got it in
    /// our LANE frame, could make it, and only for this connection of the pair), on a SEND
    /// or WRITE (whose `arg1` and `arg2` carry nothing else), and each counter once. Whatever
    /// else a client writes there is ignored.
    pub(crate) fn take_ack_token(&self, h: &FrameHeader) -> bool {
        let Some(key) = self.lane_key else { return false };
        if !matches!(h.kind, Kind::Send | Kind::Write) || h.arg2 != wire::lane_ack_mac(key, self.qpn, h.src_qpn, h.status, h.arg1) {
            return false;
        }
        // (One reader per lane takes tokens; the maximum keeps this monotonic regardless.)
        let fresh = self.tokens_taken.fetch_max(h.arg1, Ordering::AcqRel) < h.arg1;
        if fresh {
            self.tokens_applied.fetch_add(1, Ordering::Relaxed);
        }
        fresh
    }
}
