//! The receives this process posted, as it posted them, in its own memory. The receive ring
//! lives in the QP's (or SRQ's) shared region, which a peer on the direct path maps and can
//! rewrite; a staged SEND's scatter list is what the requester copied from that ring. The
//! responder checks it against this copy before it scatters a byte, so a peer can land its
//! payload only in a receive buffer posted and not yet used, as a NIC would, never in
//! another of the responder's own MRs.

use std::collections::VecDeque;

use vrdma_abi::ring::{RecvRing, Sge};
use vrdma_abi::shm::ShmError;

use crate::spin::SpinLock;

/// Posts receive `wr_id` of `sges` to `ring` and records it in `copy`, the copy first: a peer
/// may take the receive from the ring as soon as it is there. The ring's answer (false:
/// full), the copy undone unless the receive was posted.
pub(crate) fn post(copy: &SpinLock<PostedRecvs>, ring: &RecvRing, wr_id: u64, sges: &[Sge], flags: u32) -> Result<bool, ShmError> {
    copy.lock().push(wr_id, sges);
    let pushed = ring.push_flagged(wr_id, sges, flags);
    if !matches!(pushed, Ok(true)) {
        copy.lock().unpush();
    }
    pushed
}

/// A posted receive not yet completed.
#[derive(Debug)]
struct Posted {
    wr_id: u64,
    /// Its non-empty elements (as the requester stages them).
    sges: Vec<Sge>,
    /// The claim of the staged message being scattered into it.
    claimed: Option<u64>,
}

/// A staged message's claim on a posted receive, made at its first part. Receives posted
/// with the same elements are interchangeable, so a claim may move to another of them (the
/// requester took another from the ring than the oldest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim(u64);

/// What a completion named, against the receive its message claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Named {
    /// The receive, now used up.
    Posted,
    /// Another receive: the claimed one (used up) is reported, under this name.
    Other(u64),
    /// Nothing posted (the claimed receive is gone too).
    Nothing,
}

/// One receive queue's posted receives (a QP's own, or an SRQ's).
#[derive(Debug, Default)]
pub(crate) struct PostedRecvs {
    entries: VecDeque<Posted>,
    next_claim: u64,
    /// Most entries kept: the queue's depth (posting checks it first); a peer that completes
    /// receives under names never posted leaves entries behind, and the oldest go.
    cap: usize,
    /// Element lists of completed receives, reused (posting allocates nothing).
    spare: Vec<Vec<Sge>>,
    /// Staged messages and completions that named no receive posted (a hostile or broken
    /// peer; what the application sees is each one's LOC_PROT_ERR completion).
    refused: u64,
}

impl PostedRecvs {
    /// For a queue of `cap` receives.
    pub(crate) fn new(cap: usize) -> PostedRecvs {
        PostedRecvs { cap: cap.max(1), ..PostedRecvs::default() }
    }

    /// Receive `wr_id` of `sges` was posted.
    pub(crate) fn push(&mut self, wr_id: u64, sges: &[Sge]) {
        if self.entries.len() >= self.cap {
            if let Some(old) = self.entries.pop_front() {
                self.recycle(old.sges);
            }
        }
        let mut v = self.spare.pop().unwrap_or_default();
        v.clear();
        v.extend(sges.iter().filter(|s| s.length > 0).copied());
        self.entries.push_back(Posted { wr_id, sges: v, claimed: None });
    }

    /// The last receive pushed was not posted after all (the ring refused it).
    pub(crate) fn unpush(&mut self) {
        if let Some(p) = self.entries.pop_back() {
            self.recycle(p.sges);
        }
    }

    fn recycle(&mut self, v: Vec<Sge>) {
        if self.spare.len() < 64 {
            self.spare.push(v);
        }
    }

    /// A staged message's first part names `sges`: the oldest unclaimed receive posted with
    /// exactly those elements, claimed for the message; none, and it is refused.
    pub(crate) fn claim(&mut self, sges: &[Sge]) -> Option<Claim> {
        let named = || sges.iter().filter(|s| s.length > 0);
        let Some(p) = self.entries.iter_mut().find(|p| p.claimed.is_none() && p.sges.iter().eq(named())) else {
            self.refused += 1;
            return None;
        };
        self.next_claim += 1;
        p.claimed = Some(self.next_claim);
        Some(Claim(self.next_claim))
    }

    /// The oldest unclaimed receive with the elements of entry `like` (and posted as `wr_id`,
    /// if given).
    fn unclaimed_like(&self, like: usize, wr_id: Option<u64>) -> Option<usize> {
        let sges = &self.entries[like].sges;
        self.entries.iter().position(|p| p.claimed.is_none() && wr_id.is_none_or(|id| p.wr_id == id) && p.sges == *sges)
    }

    /// The completion of a staged message that claimed `claim` names receive `wr_id`: the
    /// claimed receive is used up, and the completion must name it, or another unclaimed
    /// receive with the same elements (taken in its place).
    pub(crate) fn complete_claimed(&mut self, claim: Claim, wr_id: u64) -> Named {
        let Some(i) = self.entries.iter().position(|p| p.claimed == Some(claim.0)) else {
            self.refused += 1;
            return Named::Nothing;
        };
        if self.entries[i].wr_id == wr_id {
            self.remove(i);
            return Named::Posted;
        }
        if let Some(j) = self.unclaimed_like(i, Some(wr_id)) {
            self.entries[i].claimed = None;
            self.remove(j);
            return Named::Posted;
        }
        let name = self.entries[i].wr_id;
        self.remove(i);
        self.refused += 1;
        Named::Other(name)
    }

    /// A receive completed without a staged message (written by the peer in place, by
    /// vrdmad, or failed): the oldest unclaimed receive `wr_id` is used up; if a staged
    /// message claimed it meanwhile (one posted with the same elements, which the requester
    /// took instead), that claim moves to another receive like it. Whether there was one.
    pub(crate) fn complete(&mut self, wr_id: u64) -> bool {
        if let Some(i) = self.entries.iter().position(|p| p.claimed.is_none() && p.wr_id == wr_id) {
            self.remove(i);
            return true;
        }
        let mut claimed = self.entries.iter().enumerate().filter(|(_, p)| p.wr_id == wr_id && p.claimed.is_some()).map(|(i, _)| i);
        let moved = claimed.find_map(|i| self.unclaimed_like(i, None).map(|j| (i, j)));
        match moved {
            Some((i, j)) => {
                self.entries[j].claimed = self.entries[i].claimed.take();
                self.remove(i);
                true
            }
            None => {
                self.refused += 1;
                false
            }
        }
    }

    /// Drops entry `i`, keeping its element list for reuse.
    fn remove(&mut self, i: usize) {
        if let Some(p) = self.entries.remove(i) {
            self.recycle(p.sges);
        }
    }

    /// Every receive is gone (flushed): their names, oldest first.
    pub(crate) fn take_all(&mut self) -> Vec<u64> {
        let ids = self.entries.iter().map(|p| p.wr_id).collect();
        self.clear();
        ids
    }

    /// Every receive is gone (the queue reset).
    pub(crate) fn clear(&mut self) {
        while let Some(p) = self.entries.pop_front() {
            self.recycle(p.sges);
        }
    }

    /// The oldest receive not claimed, used up in place of one a completion named but was
    /// never posted (the completion reports an error under a name the application knows).
    pub(crate) fn take_oldest(&mut self) -> Option<u64> {
        let i = self.entries.iter().position(|p| p.claimed.is_none())?;
        let id = self.entries[i].wr_id;
        self.remove(i);
        Some(id)
    }

    /// Receives posted and not completed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sge(addr: u64, length: u32, lkey: u32) -> Sge {
        Sge { addr, length, lkey }
    }

    #[test]
    fn a_claim_must_name_a_posted_receive_exactly() {
        let mut p = PostedRecvs::new(4);
        p.push(1, &[sge(0x1000, 64, 7), sge(0, 0, 0)]);
        // Another buffer, a longer length, another key: refused.
        assert!(p.claim(&[sge(0x2000, 64, 7)]).is_none());
        assert!(p.claim(&[sge(0x1000, 65, 7)]).is_none());
        assert!(p.claim(&[sge(0x1000, 64, 8)]).is_none());
        assert_eq!(p.refused, 3);
        // Empty elements are not staged: the rest must match.
        let c = p.claim(&[sge(0x1000, 64, 7)]).expect("posted");
        // Claimed once: a second message cannot use it too.
        assert!(p.claim(&[sge(0x1000, 64, 7)]).is_none());
        assert_eq!(p.complete_claimed(c, 1), Named::Posted);
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn a_completion_must_name_the_receive_its_message_used() {
        let mut p = PostedRecvs::new(4);
        p.push(1, &[sge(0x1000, 64, 7)]);
        p.push(2, &[sge(0x2000, 64, 7)]);
        let c = p.claim(&[sge(0x2000, 64, 7)]).unwrap();
        // The payload went to receive 2; a completion naming 1 is refused and 2 is used up.
        assert_eq!(p.complete_claimed(c, 1), Named::Other(2));
        assert_eq!(p.len(), 1);
        assert!(p.complete(1));
        assert!(!p.complete(1), "completed twice");
    }

    #[test]
    fn receives_of_one_buffer_are_interchangeable() {
        let mut p = PostedRecvs::new(4);
        p.push(1, &[sge(0x1000, 64, 7)]);
        p.push(2, &[sge(0x1000, 64, 7)]);
        let c = p.claim(&[sge(0x1000, 64, 7)]).unwrap();
        // The requester took receive 2 from the ring: it is the one used up.
        assert_eq!(p.complete_claimed(c, 2), Named::Posted);
        assert!(p.complete(1));
        assert_eq!(p.len(), 0);
    }

    /// Receive 1 was written in place and receive 2 staged, both of one buffer: the staged
    /// message claimed 1 (the oldest like it) before 1's completion was polled. The claim
    /// moves to 2 and both complete.
    #[test]
    fn a_claim_moves_off_a_receive_completed_in_place() {
        let mut p = PostedRecvs::new(4);
        p.push(1, &[sge(0x1000, 64, 7)]);
        p.push(2, &[sge(0x1000, 64, 7)]);
        let c = p.claim(&[sge(0x1000, 64, 7)]).unwrap();
        assert!(p.complete(1));
        assert_eq!(p.complete_claimed(c, 2), Named::Posted);
        assert_eq!(p.len(), 0);
        assert_eq!(p.refused, 0);
    }

    #[test]
    fn completions_never_posted_cannot_grow_it_past_its_depth() {
        let mut p = PostedRecvs::new(2);
        for i in 0..10 {
            p.push(i, &[sge(0x1000, 64, 7)]);
            assert!(!p.complete(1000 + i));
        }
        assert_eq!(p.len(), 2);
        assert_eq!(p.refused, 10);
    }
}
