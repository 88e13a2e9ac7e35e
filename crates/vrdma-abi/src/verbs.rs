//! Verbs constants, numerically identical to rdma-core's `<infiniband/verbs.h>` so the
//! drop-in library passes them through unchanged.

use crate::repr_enum::repr_enum;

repr_enum! {
    /// Work completion status (`enum ibv_wc_status`).
    #[allow(missing_docs)]
    pub enum WcStatus: u8 {
        Success = 0,
        LocLenErr = 1,
        LocQpOpErr = 2,
        LocProtErr = 4,
        WrFlushErr = 5,
        BadRespErr = 7,
        LocAccessErr = 8,
        RemInvReqErr = 9,
        RemAccessErr = 10,
        RemOpErr = 11,
        RetryExcErr = 12,
        RnrRetryExcErr = 13,
        FatalErr = 19,
        GeneralErr = 21,
    }
    /// Decodes a status byte read from shared memory.
    pub fn from_u8(u8);
}

repr_enum! {
    /// Work completion opcode (`enum ibv_wc_opcode`).
    #[allow(missing_docs)]
    pub enum WcOpcode: u8 {
        Send = 0,
        RdmaWrite = 1,
        RdmaRead = 2,
        CompSwap = 3,
        FetchAdd = 4,
        Recv = 128,
        RecvRdmaWithImm = 129,
    }
    /// Decodes an opcode byte read from shared memory.
    pub fn from_u8(u8);
}

repr_enum! {
    /// Send work request opcode (`enum ibv_wr_opcode`).
    #[allow(missing_docs)]
    pub enum WrOpcode: u32 {
        RdmaWrite = 0,
        RdmaWriteWithImm = 1,
        Send = 2,
        SendWithImm = 3,
        RdmaRead = 4,
        AtomicCmpAndSwp = 5,
        AtomicFetchAndAdd = 6,
    }
    /// Decodes `ibv_wr_opcode`.
    pub fn from_u32(u32);
}

impl WrOpcode {
    /// The completion opcode of a send WR.
    pub fn wc_opcode(self) -> WcOpcode {
        match self {
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
            WrOpcode::Send | WrOpcode::SendWithImm => WcOpcode::Send,
            WrOpcode::RdmaRead => WcOpcode::RdmaRead,
            WrOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
            WrOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
        }
    }

    /// Whether the responder consumes a receive WR.
    pub fn consumes_recv(self) -> bool {
        matches!(self, WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWriteWithImm)
    }
}

/// MR access flags (`enum ibv_access_flags`).
pub mod access {
    /// IBV_ACCESS_LOCAL_WRITE
    pub const LOCAL_WRITE: u32 = 1;
    /// IBV_ACCESS_REMOTE_WRITE
    pub const REMOTE_WRITE: u32 = 2;
    /// IBV_ACCESS_REMOTE_READ
    pub const REMOTE_READ: u32 = 4;
    /// IBV_ACCESS_REMOTE_ATOMIC
    pub const REMOTE_ATOMIC: u32 = 8;
    /// Flags vrdma understands; others are ignored like optional hints.
    pub const KNOWN: u32 = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC;
}

/// Send flags (`enum ibv_send_flags`).
pub mod send_flags {
    /// IBV_SEND_FENCE
    pub const FENCE: u32 = 1;
    /// IBV_SEND_SIGNALED
    pub const SIGNALED: u32 = 2;
    /// IBV_SEND_SOLICITED
    pub const SOLICITED: u32 = 4;
    /// IBV_SEND_INLINE
    pub const INLINE: u32 = 8;
}

/// Work completion flags (`enum ibv_wc_flags`).
pub mod wc_flags {
    /// IBV_WC_GRH
    pub const GRH: u32 = 1;
    /// IBV_WC_WITH_IMM
    pub const WITH_IMM: u32 = 2;
}

repr_enum! {
    /// QP states (`enum ibv_qp_state`).
    #[allow(missing_docs)]
    #[derive(PartialOrd, Ord)]
    pub enum QpState: u8 {
        Reset = 0,
        Init = 1,
        Rtr = 2,
        Rts = 3,
        Sqd = 4,
        Sqe = 5,
        Err = 6,
    }
    /// Decodes `ibv_qp_state`.
    pub fn from_u32(u32);
}

/// QP attribute mask bits (`enum ibv_qp_attr_mask`).
#[allow(missing_docs)]
pub mod qp_attr {
    pub const STATE: u32 = 1;
    pub const CUR_STATE: u32 = 1 << 1;
    pub const EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const QKEY: u32 = 1 << 6;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const ALT_PATH: u32 = 1 << 14;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const PATH_MIG_STATE: u32 = 1 << 18;
    pub const CAP: u32 = 1 << 19;
    pub const DEST_QPN: u32 = 1 << 20;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_decodes_from_its_own_value() {
        for &s in WcStatus::VARIANTS {
            assert_eq!(WcStatus::from_u8(s as u8), Some(s));
        }
        for &o in WcOpcode::VARIANTS {
            assert_eq!(WcOpcode::from_u8(o as u8), Some(o));
        }
        for &o in WrOpcode::VARIANTS {
            assert_eq!(WrOpcode::from_u32(o as u32), Some(o));
        }
        for &s in QpState::VARIANTS {
            assert_eq!(QpState::from_u32(u32::from(s as u8)), Some(s));
        }
    }

    #[test]
    fn values_verbs_h_leaves_out_are_unknown() {
        assert_eq!(WcStatus::from_u8(3), None);
        assert_eq!(WcStatus::from_u8(22), None);
        assert_eq!(WcOpcode::from_u8(5), None);
        assert_eq!(WcOpcode::from_u8(130), None);
        assert_eq!(WrOpcode::from_u32(7), None);
        assert_eq!(QpState::from_u32(7), None);
        // Stored as a byte, passed as a u32: a value whose low byte is a state is not one.
        assert_eq!(QpState::from_u32(0x100 | QpState::Rts as u32), None);
    }

    #[test]
    fn discriminants_are_rdma_cores() {
        assert_eq!(WcStatus::RnrRetryExcErr as u8, 13);
        assert_eq!(WcStatus::GeneralErr as u8, 21);
        assert_eq!(WcOpcode::RecvRdmaWithImm as u8, 129);
        assert_eq!(WrOpcode::AtomicFetchAndAdd as u32, 6);
        assert_eq!(QpState::Err as u8, 6);
    }
}
