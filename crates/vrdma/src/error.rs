//! Errors of the verbs library. Each carries the errno the matching libibverbs verb returns.

use vrdma_abi::channel::ChannelError;
use vrdma_abi::control::DecodeError;

/// Verbs failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The vNIC's control socket could not be reached (no vNIC there, or no vrdmad): ENODEV.
    #[error("connecting to vrdmad: {0}")]
    Connect(#[source] ChannelError),
    /// The control channel to vrdmad broke after it was open (vrdmad stopped): EIO.
    #[error("control channel to vrdmad failed: {0}")]
    Channel(#[source] ChannelError),
    /// vrdmad's reply does not decode (a vrdmad of another build): EIO.
    #[error("vrdmad sent an undecodable reply: {0}")]
    Protocol(#[source] DecodeError),
    /// vrdmad refused the request; its errno is the verb's.
    #[error("vrdmad refused {op}: {message} (errno {errno})")]
    Refused {
        /// The verb.
        op: &'static str,
        /// The errno vrdmad returned.
        errno: i32,
        /// vrdmad's explanation.
        message: String,
    },
    /// vrdmad answered with a reply of another kind than the request expects: EIO.
    #[error("vrdmad answered {op} with an unexpected reply")]
    UnexpectedReply {
        /// The verb.
        op: &'static str,
    },
    /// The caller passed a bad argument, checked before asking vrdmad: EINVAL.
    #[error("{op}: invalid argument: {reason}")]
    Invalid {
        /// The verb.
        op: &'static str,
        /// What is wrong with the argument.
        reason: String,
    },
    /// A post found its send or receive queue full: ENOMEM, as libibverbs.
    #[error("{op}: queue full")]
    QueueFull {
        /// The verb.
        op: &'static str,
    },
    /// Mapping a region vrdmad passed failed: ENOMEM.
    #[error("mapping shared memory for {op}: {source}")]
    Shm {
        /// The verb.
        op: &'static str,
        /// The mapping failure.
        source: vrdma_abi::shm::ShmError,
    },
    /// A system call failed; its errno is the verb's.
    #[error("{op}: {source}")]
    Os {
        /// The verb.
        op: &'static str,
        /// The system call's error.
        source: std::io::Error,
    },
    /// `modify_qp` asked for a transition the QP state machine refuses: EINVAL.
    #[error("modify_qp: {0}")]
    Modify(#[from] vrdma_core::qp_state::ModifyError),
    /// A verb or option vrdma does not implement: EOPNOTSUPP.
    #[error("{op}: not supported by vrdma")]
    Unsupported {
        /// The verb.
        op: &'static str,
    },
}

impl Error {
    /// The errno a libibverbs verb would return for this failure.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Connect(_) => libc::ENODEV,
            Error::Channel(_) | Error::Protocol(_) | Error::UnexpectedReply { .. } => libc::EIO,
            Error::Refused { errno, .. } => *errno,
            Error::Invalid { .. } | Error::Modify(_) => libc::EINVAL,
            Error::QueueFull { .. } => libc::ENOMEM,
            Error::Shm { .. } => libc::ENOMEM,
            Error::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::Unsupported { .. } => libc::EOPNOTSUPP,
        }
    }
}

pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Error {
    Error::Invalid { op, reason: reason.into() }
}
