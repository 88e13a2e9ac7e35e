//! The *channel* region of a mediated QP (its send ring and send completions, for vrdmad's
//! engine), the words of its control page, and the ACK tokens published there.

use super::{CompRingLayout, SqRingLayout, LINE, PAGE};
use crate::shm::{MemRegion, ShmError};
use std::sync::atomic::Ordering;

/// Layout of a mediated QP's *channel* region (created by vrdmad when the QP connects to a
/// peer it reaches through its engine): a control page, the send ring, and the ring of send
/// completions the engine writes (twice the send ring, so WRs in flight plus unpolled
/// completions always fit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MediatedLayout {
    /// Send ring.
    pub sq: SqRingLayout,
    /// Send completions.
    pub comp: CompRingLayout,
}

/// Largest data of a WR the owner of a lane sends on it itself (see [`MED_SEND_SIDE`]);
/// larger ones are the engine's, which streams them from memory. Large enough for UCX's
/// eager fragments (8 KiB) and mid-size messages, whose doorbell wakeup per WR would cost
/// more than the frame; small enough that `post_send` stays a short copy. The engine
/// finishes a frame its owner could write only in part up to this size.
pub const LANE_DATA_MAX: u64 = 64 << 10;

/// Channel control word: 1 while the engine sleeps and wants a doorbell (eventfd write)
/// after the next post; the engine clears it when it wakes.
pub const MED_DOORBELL_WANTED: usize = 0;
/// Channel control word: 1 when the engine left WRs in the send ring because the
/// completion ring had no room; the owner rings the doorbell after polling.
pub const MED_STALLED: usize = LINE;
/// Channel control word: how many send-ring WRs the engine has retired (completed in order,
/// with or without a completion entry). If vrdmad dies, the owner flushes the WRs from
/// here to its own producer position.
pub const MED_RETIRED: usize = 2 * LINE;
/// Channel control word: 1 + the CPU the owner ran on when it last rang the doorbell (0:
/// unknown), so the engine's doorbell thread can move to where its wakeups come from. A
/// hint only: any value is harmless.
pub const MED_RINGER_CPU: usize = 3 * LINE;
/// Channel control word of a QP with a *lane* (its own connection to the peer's daemon,
/// shared with the owner): who may write requests on it now, [`SEND_SIDE_FREE`],
/// [`SEND_SIDE_CLIENT`] (the owner, sending one WR itself) or [`SEND_SIDE_ENGINE`] (the
/// engine: retries, errors, large WRs, a full socket). Taken by compare-and-swap from FREE.
pub const MED_SEND_SIDE: usize = 4 * LINE;
/// Channel control word: send-ring position up to which WRs are claimed for sending (by
/// the owner or the engine, whoever held the send side). The WR at position `p` has PSN
/// `p as u32`; the engine takes claimed WRs from the ring as in flight without sending them.
pub const MED_CLAIMED: usize = 5 * LINE;
/// Channel control word: 1 while the engine wants the send side (an RNR or not-ready wait,
/// an error, a backlog): the owner then sends nothing itself, and rings the doorbell when it
/// gives the send side back.
pub const MED_ENGINE_WANTS: usize = 6 * LINE;
/// Channel control word: 1 + the send-ring position of a WR the owner claimed but did not
/// finish sending (its lane had no room): the engine writes the rest of its frame (0: none).
/// Set after [`MED_UNSENT_BYTES`]; while set, the owner sends nothing itself.
pub const MED_UNSENT: usize = 7 * LINE;
/// Channel control word: how many bytes of that frame the owner wrote.
pub const MED_UNSENT_BYTES: usize = 8 * LINE;
/// Channel control line of a QP with a lane: the *ACK token* its daemon publishes for the
/// owner to carry on its lane, a seqlock of four words: sequence (odd while being written),
/// PSN, counter, MAC (see [`AckToken`]).
pub const MED_ACK_TOKEN: usize = 9 * LINE;
/// Channel control word: the counter of the last ACK token put on the lane, by the owner
/// or by the engine sending in its place (the owner's is a claim the daemon only uses to
/// decide when to acknowledge itself; it never trusts it for more than [`AckToken`] says).
pub const MED_ACK_TAKEN: usize = 10 * LINE;
/// Channel control line: counter, PSN and MAC of the ACK token in the frame the owner left
/// unfinished ([`MED_UNSENT`]; counter 0: it carries none), so the engine finishes the frame
/// with the header bytes the owner began. Written before [`MED_UNSENT`].
pub const MED_UNSENT_ACK: usize = 11 * LINE;
/// Channel control line of a QP with a *sealed* lane (see [`crate::seal`]): a word, 1 when
/// the lane is sealed, then the 16-byte key of what goes on it, written by the daemon before
/// the owner gets the lane. The owner seals what it writes on the lane with it.
pub const MED_LANE_SEAL: usize = 12 * LINE;
/// Channel control word: the sequence number of the next record on a sealed lane, used and
/// advanced by whoever holds [`MED_SEND_SIDE`] (owner or engine) as it seals.
pub const MED_LANE_SEQ: usize = 13 * LINE;
/// Channel control word: the sequence number of the first record of the frame the owner
/// left unfinished on a sealed lane (the engine seals its plaintext again with it, and
/// writes the bytes the owner did not). Written before [`MED_UNSENT`].
pub const MED_UNSENT_SEQ: usize = 14 * LINE;
/// [`MED_SEND_SIDE`]: nobody is sending.
pub const SEND_SIDE_FREE: u64 = 0;
/// [`MED_SEND_SIDE`]: the owner is writing a request on the lane.
pub const SEND_SIDE_CLIENT: u64 = 1;
/// [`MED_SEND_SIDE`]: the engine sends this QP's requests.
pub const SEND_SIDE_ENGINE: u64 = 2;

/// A deferred ACK that the responder's daemon lets the QP's owner carry on its lane, in the
/// next request it sends there itself (`wire::F_ACKS`): an ACK without a frame, a wakeup
/// and a system call of the daemon's. The MAC (keyed with the secret of the lane the
/// acknowledged requests came on, which only the two daemons hold) is what the receiving
/// daemon checks; the counter, increasing, makes a token good once. The owner can only carry a token or withhold it, and its daemon
/// acknowledges by itself what is not carried soon.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AckToken {
    /// The PSN acknowledged, with every SEND and WRITE before it.
    pub psn: u32,
    /// Per lane, from 1, increasing.
    pub counter: u64,
    /// The daemons' MAC of the token.
    pub mac: u64,
}

impl AckToken {
    /// Publishes the token in a channel's control page (the daemon; one writer per QP).
    pub fn publish(&self, ctl: &MemRegion) -> Result<(), ShmError> {
        let seq = ctl.atomic_u64(MED_ACK_TOKEN)?;
        let s = seq.load(Ordering::Relaxed) | 1;
        seq.store(s, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        ctl.atomic_u64(MED_ACK_TOKEN + 8)?.store(u64::from(self.psn), Ordering::Relaxed);
        ctl.atomic_u64(MED_ACK_TOKEN + 16)?.store(self.counter, Ordering::Relaxed);
        ctl.atomic_u64(MED_ACK_TOKEN + 24)?.store(self.mac, Ordering::Relaxed);
        seq.store(s.wrapping_add(1), Ordering::Release);
        Ok(())
    }

    /// The token published last, if it is newer than `carried_here` and than the last one
    /// carried on the lane ([`MED_ACK_TAKEN`]), claimed as carried now (before the frame
    /// carrying it is written, so the daemon never takes it for one left behind).
    pub fn take_next(ctl: &MemRegion, carried_here: u64) -> Option<AckToken> {
        let carried = carried_here.max(ctl.load_u64(MED_ACK_TAKEN).ok()?);
        let t = AckToken::read(ctl).filter(|t| t.counter > carried)?;
        ctl.store_u64(MED_ACK_TAKEN, t.counter).ok()?;
        Some(t)
    }

    /// The token published last, if one was read whole (none while it is being written).
    pub fn read(ctl: &MemRegion) -> Option<AckToken> {
        let seq = ctl.atomic_u64(MED_ACK_TOKEN).ok()?;
        let s = seq.load(Ordering::Acquire);
        if s & 1 != 0 {
            return None;
        }
        let psn = ctl.atomic_u64(MED_ACK_TOKEN + 8).ok()?.load(Ordering::Relaxed) as u32;
        let counter = ctl.atomic_u64(MED_ACK_TOKEN + 16).ok()?.load(Ordering::Relaxed);
        let mac = ctl.atomic_u64(MED_ACK_TOKEN + 24).ok()?.load(Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Acquire);
        (seq.load(Ordering::Relaxed) == s && counter != 0).then_some(AckToken { psn, counter, mac })
    }
}

impl MediatedLayout {
    /// Layout for a send ring of `sq`.
    pub fn new(sq: SqRingLayout) -> Self {
        MediatedLayout { sq, comp: CompRingLayout::new(2 * sq.capacity) }
    }
    /// Offset of the send ring.
    pub fn sq_offset(&self) -> usize {
        PAGE
    }
    /// Offset of the completion ring.
    pub fn comp_offset(&self) -> usize {
        PAGE + self.sq.size()
    }
    /// Total bytes.
    pub fn size(&self) -> usize {
        self.comp_offset() + self.comp.size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::tests::mapping;

    /// A published token reads back whole; none before the first, none while the sequence
    /// says a write is under way (odd), and the next publication replaces it.
    #[test]
    fn ack_token_seqlock() {
        let m = mapping(PAGE);
        let ctl = m.region().subregion(0, PAGE).unwrap();
        assert_eq!(AckToken::read(&ctl), None, "nothing published");
        let t = AckToken { psn: 7, counter: 1, mac: 0xdead_beef };
        t.publish(&ctl).unwrap();
        assert_eq!(AckToken::read(&ctl), Some(t));
        let seq = ctl.load_u64(MED_ACK_TOKEN).unwrap();
        assert_eq!(seq % 2, 0);
        ctl.store_u64(MED_ACK_TOKEN, seq + 1).unwrap();
        assert_eq!(AckToken::read(&ctl), None, "being written");
        let u = AckToken { psn: 8, counter: 2, mac: 42 };
        u.publish(&ctl).unwrap();
        assert_eq!(AckToken::read(&ctl), Some(u));
        assert_eq!(ctl.load_u64(MED_ACK_TOKEN).unwrap() % 2, 0);
    }
}
