//! Operation codes of the [`super::Header`]: requests from 1, replies from `0x8000`.

use crate::repr_enum::repr_enum;

repr_enum! {
    /// The operation of a [`super::Request`] (one per variant).
    pub(super) enum RequestOp: u16 {
        Hello = 1,
        AllocPd = 2,
        DeallocPd = 3,
        RegMr = 4,
        DeregMr = 5,
        CreateCq = 6,
        DestroyCq = 7,
        CreateSrq = 8,
        DestroySrq = 9,
        CreateQp = 10,
        SetQpState = 11,
        ConnectQp = 12,
        DestroyQp = 13,
        MapPeerMr = 14,
        QueryUsage = 15,
        CheckGid = 16,
        ResolveUd = 17,
        MapUdPeerMr = 18,
        PeerMrWrite = 19,
        PeerMrRead = 20,
        PeerMrAtomic = 21,
        TakeRehomes = 22,
        RehomeMr = 23,
        BeginRehome = 24,
        MoveToEngine = 25,
        PeerMrCopy = 26,
        CopyStaging = 27,
    }
    /// Decodes a request header's `op` (a reply's is unknown here).
    pub(super) fn from_u16(u16);
}

repr_enum! {
    /// The operation of a [`super::Reply`] (one per variant).
    pub(super) enum ReplyOp: u16 {
        Error = 0x8000,
        Ok = 0x8001,
        Hello = 0x8002,
        Handle = 0x8003,
        Mr = 0x8004,
        Cq = 0x8005,
        Srq = 0x8006,
        Qp = 0x8007,
        Connected = 0x8008,
        PeerMr = 0x8009,
        Usage = 0x800a,
        ConnectedMediated = 0x800b,
        Bytes = 0x800c,
        Atomic = 0x800d,
        UdRemote = 0x800e,
        Keys = 0x800f,
    }
    /// Decodes a reply header's `op` (a request's is unknown here).
    pub(super) fn from_u16(u16);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Request and reply operations never share a code, and each decodes only as its own kind.
    #[test]
    fn request_and_reply_ops_are_disjoint() {
        for &op in RequestOp::VARIANTS {
            assert_eq!(RequestOp::from_u16(op as u16), Some(op));
            assert_eq!(ReplyOp::from_u16(op as u16), None);
        }
        for &op in ReplyOp::VARIANTS {
            assert_eq!(ReplyOp::from_u16(op as u16), Some(op));
            assert_eq!(RequestOp::from_u16(op as u16), None);
        }
    }
}
