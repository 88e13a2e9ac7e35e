//! Why a connection's reader ends: logged, and the peer's QPs (or the lane's QP) fail with it.

use vrdma_abi::wire::Kind;

use super::link::LinkError;

/// Why a reader of a peer daemon's connection (ours, theirs, or a lane) stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReaderError {
    /// Reading a frame failed (the connection broke, or the peer sent a bad one).
    #[error(transparent)]
    Link(#[from] LinkError),
    /// Reading a frame's data, or answering, failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A frame that has no business on this kind of connection.
    #[error("unexpected {kind:?} on a {role} connection")]
    Unexpected { kind: Kind, role: &'static str },
    /// A lane carried a frame other than a request of its own QP pair.
    #[error("{kind:?} from QP {src_qpn} to QP {dst_qpn} on the lane of QP {lane_src} to QP {lane_dst}")]
    OffLane { kind: Kind, src_qpn: u32, dst_qpn: u32, lane_src: u32, lane_dst: u32 },
    /// Our HELLO on a lane could not be sent.
    #[error("sending HELLO failed")]
    Hello,
    /// A lane's answers have no connection of the peer daemon's to take.
    #[error("no connection from the peer daemon")]
    NoAnswerPath,
    /// The engine is gone.
    #[error("engine stopped")]
    Stopped,
    /// A newer lane or a (re)connection took the lane's licence.
    #[error("replaced by a newer lane or connection")]
    Replaced,
}

/// Why our end of a lane ended (see `lane::watch`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum LaneEnd {
    /// Shut down (by us), or hung up.
    #[error("closed")]
    Closed,
    /// The peer daemon closed it.
    #[error("closed by the peer")]
    ClosedByPeer,
    /// The peer daemon sent something (it never should).
    #[error("the peer sent data on a lane")]
    DataFromPeer,
    /// Waiting on the socket failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
