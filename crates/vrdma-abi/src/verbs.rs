//! Verbs constants, numerically identical to rdma-core's `<infiniband/verbs.h>` so the
//! drop-in library passes them through unchanged.

/// Work completion status (`enum ibv_wc_status`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum WcStatus {
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

impl WcStatus {
    /// Decodes a status byte read from shared memory.
    pub fn from_u8(v: u8) -> Option<Self> {
        use WcStatus::*;
        Some(match v {
            0 => Success,
            1 => LocLenErr,
            2 => LocQpOpErr,
            4 => LocProtErr,
            5 => WrFlushErr,
            7 => BadRespErr,
            8 => LocAccessErr,
            9 => RemInvReqErr,
            10 => RemAccessErr,
            11 => RemOpErr,
            12 => RetryExcErr,
            13 => RnrRetryExcErr,
            19 => FatalErr,
            21 => GeneralErr,
            _ => return None,
        })
    }
}

/// Work completion opcode (`enum ibv_wc_opcode`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum WcOpcode {
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
    /// Decodes an opcode byte read from shared memory.
    pub fn from_u8(v: u8) -> Option<Self> {
        use WcOpcode::*;
        Some(match v {
            0 => Send,
            1 => RdmaWrite,
            2 => RdmaRead,
            3 => CompSwap,
            4 => FetchAdd,
            128 => Recv,
            129 => RecvRdmaWithImm,
            _ => return None,
        })
    }
}

/// Send work request opcode (`enum ibv_wr_opcode`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WrOpcode {
    RdmaWrite = 0,
    RdmaWriteWithImm = 1,
    Send = 2,
    SendWithImm = 3,
    RdmaRead = 4,
    AtomicCmpAndSwp = 5,
    AtomicFetchAndAdd = 6,
}

impl WrOpcode {
    /// Decodes `ibv_wr_opcode`.
    pub fn from_u32(v: u32) -> Option<Self> {
        use WrOpcode::*;
        Some(match v {
            0 => RdmaWrite,
            1 => RdmaWriteWithImm,
            2 => Send,
            3 => SendWithImm,
            4 => RdmaRead,
            5 => AtomicCmpAndSwp,
            6 => AtomicFetchAndAdd,
            _ => return None,
        })
    }

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

/// QP states (`enum ibv_qp_state`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum QpState {
    Reset = 0,
    Init = 1,
    Rtr = 2,
    Rts = 3,
    Sqd = 4,
    Sqe = 5,
    Err = 6,
}

impl QpState {
    /// Decodes `ibv_qp_state`.
    pub fn from_u32(v: u32) -> Option<Self> {
        use QpState::*;
        Some(match v {
            0 => Reset,
            1 => Init,
            2 => Rtr,
            3 => Rts,
            4 => Sqd,
            5 => Sqe,
            6 => Err,
            _ => return None,
        })
    }
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
