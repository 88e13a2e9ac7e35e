//! The RC connect sequence (RESET → INIT → RTR → RTS with the attributes RDMA
//! applications usually choose), so that programs need not spell it out.

use vrdma_abi::verbs::{qp_attr, QpState};

use super::{Qp, QpAttr};
use crate::error::Error;

/// RESET → INIT (and INIT → INIT) of an RC QP.
pub(super) const INIT_MASK: u32 = qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS;
/// INIT → RTR of an RC QP: its required attributes.
pub(super) const RTR_MASK: u32 = qp_attr::STATE
    | qp_attr::AV
    | qp_attr::PATH_MTU
    | qp_attr::DEST_QPN
    | qp_attr::RQ_PSN
    | qp_attr::MAX_DEST_RD_ATOMIC
    | qp_attr::MIN_RNR_TIMER;
/// RTR → RTS of an RC QP: its required attributes.
pub(super) const RTS_MASK: u32 =
    qp_attr::STATE | qp_attr::SQ_PSN | qp_attr::TIMEOUT | qp_attr::RETRY_CNT | qp_attr::RNR_RETRY | qp_attr::MAX_QP_RD_ATOMIC;

impl Qp {
    /// Takes an RC QP from RESET to INIT on port 1 (P_Key index 0), allowing the peer
    /// `remote_access` (`access::*`): the first step of [`Qp::connect_rc`], for programs
    /// that post receives before they connect.
    pub fn init_rc(&self, remote_access: u32) -> Result<(), Error> {
        let init = QpAttr { qp_state: QpState::Init as u32, port_num: 1, qp_access_flags: remote_access, ..Default::default() };
        self.modify(&init, INIT_MASK)
    }

    /// Takes an RC QP from RESET through INIT and RTR to RTS, connected to `dest_qp_num` at
    /// `dgid` (GID index 0 of port 1), with the attributes RDMA applications usually choose:
    /// the boilerplate of every RC program, in one call. Each step is an ordinary `modify`.
    /// A QP already in INIT (see [`Qp::init_rc`]) goes INIT → INIT with the same attributes
    /// first, as the state machine allows; its posted receives stay.
    pub fn connect_rc(&self, dgid: [u8; 16], dest_qp_num: u32, remote_access: u32) -> Result<(), Error> {
        self.init_rc(remote_access)?;
        let rtr = QpAttr {
            qp_state: QpState::Rtr as u32,
            path_mtu: 5,
            dest_qp_num,
            is_global: true,
            dgid,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 1,
            ..Default::default()
        };
        self.modify(&rtr, RTR_MASK)?;
        let rts =
            QpAttr { qp_state: QpState::Rts as u32, timeout: 14, retry_cnt: 7, rnr_retry: 7, max_rd_atomic: 16, ..Default::default() };
        self.modify(&rts, RTS_MASK)
    }
}
