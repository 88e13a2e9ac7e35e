//! Errors of the verbs library. Each carries the errno the matching libibverbs verb returns.

use vrdma_abi::channel::ChannelError;
use vrdma_abi::control::DecodeError;

/// Verbs failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connecting to vrdmad: {0}")]
    Connect(#[source] ChannelError),
    #[error("control channel to vrdmad failed: {0}")]
    Channel(#[source] ChannelError),
    #[error("vrdmad sent an undecodable reply: {0}")]
    Protocol(#[source] DecodeError),
    #[error("vrdmad refused {op}: {message} (errno {errno})")]
    Refused { op: &'static str, errno: i32, message: String },
    #[error("vrdmad answered {op} with an unexpected reply")]
    UnexpectedReply { op: &'static str },
    #[error("{op}: invalid argument: {reason}")]
    Invalid { op: &'static str, reason: String },
    #[error("{op}: queue full")]
    QueueFull { op: &'static str },
    #[error("mapping shared memory for {op}: {source}")]
    Shm { op: &'static str, source: vrdma_abi::shm::ShmError },
    #[error("{op}: {source}")]
    Os { op: &'static str, source: std::io::Error },
    #[error("modify_qp: {0}")]
    Modify(#[from] vrdma_core::qp_state::ModifyError),
    #[error("{op}: not supported by vrdma")]
    Unsupported { op: &'static str },
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
