//! QP state machine (IB spec 10.3, as enforced by the kernel's `ib_modify_qp_is_ok`).

use vrdma_abi::verbs::qp_attr::*;
use vrdma_abi::verbs::QpState;

/// Transport type of a QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpType {
    /// Reliable connected.
    Rc,
    /// Unreliable datagram.
    Ud,
}

/// Why a modify was refused; the verb returns EINVAL for all of them, like hardware.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModifyError {
    /// The state machine has no edge from `from` to `to`.
    #[error("transition {from:?} -> {to:?} is not allowed")]
    BadTransition {
        /// The QP's current state.
        from: QpState,
        /// The state asked for.
        to: QpState,
    },
    /// The attribute mask lacks attributes the transition requires.
    #[error("transition {from:?} -> {to:?} is missing required attributes {missing:#x}")]
    MissingAttributes {
        /// The QP's current state.
        from: QpState,
        /// The state asked for.
        to: QpState,
        /// The required `IBV_QP_*` mask bits that were not given.
        missing: u32,
    },
    /// The attribute mask has attributes the transition does not take.
    #[error("transition {from:?} -> {to:?} does not accept attributes {extra:#x}")]
    ExtraAttributes {
        /// The QP's current state.
        from: QpState,
        /// The state asked for.
        to: QpState,
        /// The `IBV_QP_*` mask bits given that the transition does not allow.
        extra: u32,
    },
    /// The caller's `cur_qp_state` (with `IBV_QP_CUR_STATE`) is not the QP's state.
    #[error("IBV_QP_CUR_STATE {given:?} does not match the current state {actual:?}")]
    CurStateMismatch {
        /// The state the caller believes the QP is in.
        given: QpState,
        /// The QP's actual state.
        actual: QpState,
    },
}

impl ModifyError {
    /// The errno the verb returns.
    pub fn errno(&self) -> i32 {
        22 // EINVAL
    }
}

/// (required, optional) attribute masks of a transition, `None` if it is not allowed.
pub fn transition_masks(qp_type: QpType, from: QpState, to: QpState) -> Option<(u32, u32)> {
    use QpState::*;
    let rc = qp_type == QpType::Rc;
    Some(match (from, to) {
        (_, Reset) | (_, Err) => (0, 0),
        (Reset, Init) => {
            if rc {
                (PKEY_INDEX | PORT | ACCESS_FLAGS, 0)
            } else {
                (PKEY_INDEX | PORT | QKEY, 0)
            }
        }
        (Init, Init) => {
            if rc {
                (0, PKEY_INDEX | PORT | ACCESS_FLAGS)
            } else {
                (0, PKEY_INDEX | PORT | QKEY)
            }
        }
        (Init, Rtr) => {
            if rc {
                (AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER, ALT_PATH | ACCESS_FLAGS | PKEY_INDEX)
            } else {
                (0, PKEY_INDEX | QKEY)
            }
        }
        (Rtr, Rts) => {
            if rc {
                (
                    SQ_PSN | TIMEOUT | RETRY_CNT | RNR_RETRY | MAX_QP_RD_ATOMIC,
                    CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE,
                )
            } else {
                (SQ_PSN, CUR_STATE | QKEY)
            }
        }
        (Rts, Rts) => {
            if rc {
                (0, CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE | MIN_RNR_TIMER)
            } else {
                (0, CUR_STATE | QKEY)
            }
        }
        (Rts, Sqd) => (0, EN_SQD_ASYNC_NOTIFY),
        (Sqd, Rts) => {
            if rc {
                (0, CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE)
            } else {
                (0, CUR_STATE | QKEY)
            }
        }
        (Sqd, Sqd) => {
            if rc {
                (
                    0,
                    PKEY_INDEX
                        | ACCESS_FLAGS
                        | ALT_PATH
                        | MIN_RNR_TIMER
                        | PATH_MIG_STATE
                        | TIMEOUT
                        | RETRY_CNT
                        | RNR_RETRY
                        | MAX_QP_RD_ATOMIC
                        | MAX_DEST_RD_ATOMIC
                        | AV,
                )
            } else {
                (0, PKEY_INDEX | QKEY)
            }
        }
        (Sqe, Rts) => {
            if rc {
                return None; // SQE exists only for unreliable transports
            }
            (0, CUR_STATE | QKEY)
        }
        _ => return None,
    })
}

/// Validates `ibv_modify_qp(attr_mask)` on a QP in `cur`; returns the new state.
/// `attr_state` is `attr.qp_state` (used when `STATE` is in the mask) and `attr_cur_state`
/// is `attr.cur_qp_state` (checked when `CUR_STATE` is in the mask).
pub fn check_modify(
    qp_type: QpType,
    cur: QpState,
    attr_mask: u32,
    attr_state: QpState,
    attr_cur_state: QpState,
) -> Result<QpState, ModifyError> {
    let to = if attr_mask & STATE != 0 { attr_state } else { cur };
    if attr_mask & CUR_STATE != 0 && attr_cur_state != cur {
        return Err(ModifyError::CurStateMismatch { given: attr_cur_state, actual: cur });
    }
    let (req, opt) = transition_masks(qp_type, cur, to).ok_or(ModifyError::BadTransition { from: cur, to })?;
    let given = attr_mask & !STATE;
    let missing = req & !given;
    if missing != 0 {
        return Err(ModifyError::MissingAttributes { from: cur, to, missing });
    }
    // CUR_STATE is tolerated everywhere it was checked above (libibverbs users pass it freely).
    let extra = given & !(req | opt | CUR_STATE);
    if extra != 0 {
        return Err(ModifyError::ExtraAttributes { from: cur, to, extra });
    }
    Ok(to)
}

/// Whether send WRs may be posted in `s` (they are flushed in ERR).
pub fn can_post_send(s: QpState) -> bool {
    matches!(s, QpState::Rts | QpState::Sqd | QpState::Sqe | QpState::Err)
}

/// Whether receive WRs may be posted in `s`.
pub fn can_post_recv(s: QpState) -> bool {
    !matches!(s, QpState::Reset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use QpState::*;

    const ALL: [QpState; 7] = [Reset, Init, Rtr, Rts, Sqd, Sqe, Err];

    #[test]
    fn rc_happy_path() {
        let s = check_modify(QpType::Rc, Reset, STATE | PKEY_INDEX | PORT | ACCESS_FLAGS, Init, Reset).unwrap();
        assert_eq!(s, Init);
        let s = check_modify(QpType::Rc, s, STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER, Rtr, Reset)
            .unwrap();
        assert_eq!(s, Rtr);
        let s = check_modify(QpType::Rc, s, STATE | SQ_PSN | TIMEOUT | RETRY_CNT | RNR_RETRY | MAX_QP_RD_ATOMIC, Rts, Reset).unwrap();
        assert_eq!(s, Rts);
    }

    #[test]
    fn every_missing_required_bit_is_refused() {
        for qt in [QpType::Rc, QpType::Ud] {
            for from in ALL {
                for to in ALL {
                    let Some((req, opt)) = transition_masks(qt, from, to) else {
                        assert!(matches!(check_modify(qt, from, STATE, to, from), Result::Err(ModifyError::BadTransition { .. })));
                        continue;
                    };
                    assert_eq!(check_modify(qt, from, STATE | req | opt, to, from), Ok(to));
                    for bit in 0..21 {
                        let b = 1u32 << bit;
                        if req & b != 0 {
                            assert!(matches!(
                                check_modify(qt, from, STATE | (req & !b), to, from),
                                Result::Err(ModifyError::MissingAttributes { .. })
                            ));
                        } else if (req | opt | CUR_STATE | STATE) & b == 0 {
                            assert!(
                                matches!(
                                    check_modify(qt, from, STATE | req | b, to, from),
                                    Result::Err(ModifyError::ExtraAttributes { .. })
                                ),
                                "{qt:?} {from:?}->{to:?} bit {bit}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn skipping_states_is_refused() {
        assert!(check_modify(QpType::Rc, Reset, STATE, Rts, Reset).is_err());
        assert!(check_modify(QpType::Rc, Init, STATE | SQ_PSN, Rts, Reset).is_err());
        assert!(check_modify(QpType::Rc, Err, STATE, Rts, Reset).is_err());
        assert_eq!(check_modify(QpType::Rc, Rts, STATE, Err, Reset), Ok(Err));
        assert_eq!(check_modify(QpType::Rc, Err, STATE, Reset, Reset), Ok(Reset));
    }

    #[test]
    fn cur_state_must_match() {
        assert!(matches!(check_modify(QpType::Rc, Rts, STATE | CUR_STATE, Err, Rtr), Result::Err(ModifyError::CurStateMismatch { .. })));
    }
}
