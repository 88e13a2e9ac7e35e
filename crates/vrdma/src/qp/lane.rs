//! Lanes: a mediated QP whose vrdmad gave it a connection of its own to the peer's daemon
//! sends small WRs on it itself, from `post_send`, when the engine would accept them.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::ring::Sge;
use vrdma_abi::verbs::{send_flags, WrOpcode};
use vrdma_core::access::{check, Need};

use super::{QpInner, SendWr};
use crate::mr::LocalMr;

impl QpInner {
    /// Whether a mediated QP's client may send `wr` on its lane itself, and the length its
    /// frame names: the checks the engine makes when it takes a WR (local keys, bounds and
    /// access, lengths), so that a WR the engine would fail is left to the engine.
    pub(super) fn lane_len(&self, last_mr: &mut Option<(u32, Arc<LocalMr>)>, wr: &SendWr<'_>) -> Option<u32> {
        let fetches = matches!(wr.opcode, WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd);
        let need = if fetches { Need::LocalWrite } else { Need::LocalRead };
        let inline = wr.send_flags & send_flags::INLINE != 0;
        if inline && fetches {
            // (Its gather list went into the inline copy: the engine makes of it what it does.)
            return None;
        }
        let mut total = 0u64;
        for s in wr.sg_list.iter().filter(|s| s.length > 0) {
            total += u64::from(s.length);
            if !inline && !self.local_access_ok(last_mr, s, need) {
                return None;
            }
        }
        match wr.opcode {
            WrOpcode::RdmaRead => u32::try_from(total).ok().filter(|&t| t <= vrdma_abi::wire::MAX_MESSAGE),
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => (total == 8 && wr.sg_list.len() == 1).then_some(8),
            _ => (total <= crate::mediated::LANE_DATA_MAX).then_some(total as u32),
        }
    }

    /// `s` lies in one of the QP's PD's MRs with `need`'s access (as the engine checks it).
    fn local_access_ok(&self, last_mr: &mut Option<(u32, Arc<LocalMr>)>, s: &Sge, need: Need) -> bool {
        let pd = self.pd.handle;
        if let Some((k, mr)) = last_mr.as_ref() {
            if *k == s.lkey && mr.valid.load(Ordering::Acquire) {
                return mr.pd == pd && check(&mr.bounds, s.addr, u64::from(s.length), need).is_ok();
            }
        }
        let mrs = self.ctx.inner.mrs.read();
        match mrs.get(&s.lkey) {
            Some(mr) => {
                *last_mr = Some((s.lkey, mr.clone()));
                mr.pd == pd && check(&mr.bounds, s.addr, u64::from(s.length), need).is_ok()
            }
            None => false,
        }
    }
}
