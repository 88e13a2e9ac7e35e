//! The host-to-host protocol between vrdmads (the mediated path): fixed 64-byte frame
//! headers, little-endian, each optionally followed by `data_len` bytes. Headers are
//! validated on every receive ([`FrameHeader::decode`]); a peer daemon is as untrusted as a
//! container, so nothing it sends can make us panic, allocate without bound or misframe.
//!
//! Requests (WRITE, SEND, READ_REQ, ATOMIC_REQ) travel on the *requester's* connections;
//! responses (ACK, READ_RESP, ATOMIC_RESP) come back on the same connection. Each QP pair
//! numbers its requests with a PSN; the responder executes them in PSN order, exactly once.
//! Acknowledgements are cumulative, as in RC: any response for PSN p also acknowledges every
//! earlier SEND and WRITE of the pair (an ACK for p, p itself), so the responder may defer
//! them and let the pair's reverse requests carry them ([`F_ACKS`]).

use crate::repr_enum::repr_enum;
use crate::ring::SqEntry;
use crate::verbs::{send_flags, WrOpcode};

/// Frame magic ("VRDW").
pub const MAGIC: u32 = 0x5744_5256;
/// Protocol version; peers of different versions refuse each other at HELLO.
pub const VERSION: u16 = 8;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 64;
/// Largest payload of a control frame (HELLO, CONNECT_*).
pub const MAX_CONTROL_DATA: u32 = 4096;
/// Largest RDMA message (the vNIC's advertised `max_msg_sz`).
pub const MAX_MESSAGE: u32 = 1 << 31;

repr_enum! {
    /// Frame kinds.
    pub enum Kind: u16 {
        /// First frame on a connection: `arg1` = sender's boot id, data = its host name.
        Hello = 1,
        /// Liveness probe (answered with `HeartbeatAck`).
        Heartbeat = 2,
        /// Answer to a heartbeat.
        HeartbeatAck = 3,
        /// Connection broker: `src_qpn` asks to be connected to `dst_qpn`; `arg1` = request id;
        /// data = [`ConnectReq`].
        ConnectReq = 4,
        /// Broker answer: `arg1` = request id, `status` = 0 or an errno; data = message.
        ConnectRep = 5,
        /// The sender's QP `src_qpn`, connected to our `dst_qpn`, is gone.
        PeerGone = 6,
        /// First frame on a *lane*: a connection that carries the requests of one QP pair only
        /// (the sender's `src_qpn` to our `dst_qpn`), written by the QP's own client library;
        /// `arg1` = sender's boot id, data = its host name and listening address, as in HELLO;
        /// `arg2` and `remote_addr` = the lane's secret, the key of its ACK tokens' MACs
        /// ([`lane_ack_mac`]). Answered with HELLO.
        Lane = 7,
        /// RDMA WRITE (`flags`: [`F_IMM`], [`F_SOLICITED`]; [`F_MORE`], [`F_CONT`] for a
        /// segment): data goes to `remote_addr`/`rkey`.
        Write = 10,
        /// SEND (`flags`: [`F_IMM`], [`F_SOLICITED`]; [`F_MORE`], [`F_CONT`] for a segment).
        Send = 11,
        /// RDMA READ of `arg1` bytes at `remote_addr`/`rkey`.
        ReadReq = 12,
        /// Atomic at `remote_addr`/`rkey` (`flags`: [`F_CMP_SWAP`] or fetch-add), `arg1` =
        /// compare or add, `arg2` = swap.
        AtomicReq = 13,
        /// A UD datagram to `dst_qpn` from `src_qpn` (`flags`: [`F_IMM`], [`F_SOLICITED`];
        /// `arg1` = Q_Key); data = source GID, destination GID, payload
        /// ([`crate::ud::split_frame`]). Unacknowledged, like UD.
        UdSend = 14,
        /// Acknowledges request `psn` (`status` = 0 or a [`Nak`] code).
        Ack = 20,
        /// Data of READ `psn` (`status` as in ACK; data only when 0), or a part of it
        /// ([`F_MORE`]: `arg2` = its offset in the READ).
        ReadResp = 21,
        /// Result of atomic `psn`: `arg1` = the original value.
        AtomicResp = 22,
    }
    /// Decodes a header's kind field.
    fn from_u16(u16);
}

impl Kind {
    /// Whether frames of this kind are requests of a QP pair (executed at the responder).
    pub fn is_request(self) -> bool {
        matches!(self, Kind::Write | Kind::Send | Kind::ReadReq | Kind::AtomicReq)
    }

    /// Whether frames of this kind answer a request.
    pub fn is_response(self) -> bool {
        matches!(self, Kind::Ack | Kind::ReadResp | Kind::AtomicResp)
    }

    fn max_data(self) -> u32 {
        match self {
            Kind::Write | Kind::Send | Kind::ReadResp => MAX_MESSAGE,
            Kind::Hello | Kind::Lane | Kind::ConnectReq | Kind::ConnectRep => MAX_CONTROL_DATA,
            Kind::UdSend => crate::ud::UD_FRAME_MAX as u32,
            _ => 0,
        }
    }
}

/// Flag: the request carries immediate data.
pub const F_IMM: u32 = 1;
/// Flag: the request asks for a solicited event.
pub const F_SOLICITED: u32 = 2;
/// Flag: the atomic is compare-and-swap (else fetch-and-add).
pub const F_CMP_SWAP: u32 = 4;
/// Flag of a request: it also acknowledges, for its destination QP's own requests, every
/// SEND and WRITE up to the PSN in `status` (the responder's deferred ACK, carried by the
/// reverse traffic of the QP pair). On a lane, where the client writes the frame, only a
/// SEND or WRITE carries it, as an [`crate::ring::AckToken`] of its daemon's: `arg1` = its
/// counter, `arg2` = its MAC ([`lane_ack_mac`]).
pub const F_ACKS: u32 = 8;
/// Flag: more of the message follows, in frames of the same kind and PSN. A READ's data
/// goes in READ_RESPs of at most [`SEGMENT`] bytes, each with its offset in the READ in
/// `arg2`; a WRITE or SEND of more than [`SEGMENT`] bytes that the engine sends on a
/// connection shared by QPs goes in segments of [`SEGMENT`] bytes, all but the last with this
/// flag, all but the first with [`F_CONT`] (a WRITE segment's `remote_addr` is where its own
/// bytes go). So the connection, which carries other QPs' requests and answers too, carries
/// those between the segments rather than after a message of up to [`MAX_MESSAGE`] bytes.
pub const F_MORE: u32 = 16;
/// Flag of a WRITE or SEND segment: it continues the message its QP's earlier segments of
/// the same PSN began (see [`F_MORE`]); `arg2` = its offset in the message.
pub const F_CONT: u32 = 32;
/// Flag of a WRITE or SEND segment (with [`F_CONT`]): the requester sends its message again
/// from this segment on, where the responder's "not ready" NAK said it stopped (that NAK's
/// `arg2`, the bytes it had stored; 0: from the start). A message whose receiving memory
/// answers slowly then still gets through, a segment at a time, rather than start over at
/// every stall.
pub const F_RESUME: u32 = 64;
/// Most data bytes of one READ_RESP, WRITE or SEND segment (see [`F_MORE`]).
pub const SEGMENT: u32 = 256 << 10;

/// The MAC of an ACK token: SipHash-2-4 keyed with the secret of the lane the acknowledged
/// requests came on (sent by the requester's daemon in that lane's LANE frame, `arg2` and
/// `remote_addr`; clients never see it), over the requester's QP, the responder's, the PSN
/// acknowledged and the token's counter.
pub fn lane_ack_mac(key: [u64; 2], requester_qpn: u32, responder_qpn: u32, psn: u32, counter: u64) -> u64 {
    use std::hash::Hasher;
    let mut h = siphasher::sip::SipHasher24::new_with_keys(key[0], key[1]);
    h.write(&requester_qpn.to_le_bytes());
    h.write(&responder_qpn.to_le_bytes());
    h.write(&psn.to_le_bytes());
    h.write(&counter.to_le_bytes());
    h.finish()
}

repr_enum! {
    /// Negative-acknowledgement codes (the `status` of responses).
    pub enum Nak: u32 {
        /// Receiver not ready (no receive posted): retry after the responder's RNR timer.
        Rnr = 1,
        /// The responder QP is not in RTR/RTS yet, or its memory did not answer now: retry
        /// until the requester's timeout (a segmented message from `arg2`, see [`F_RESUME`]).
        NotReady = 2,
        /// Bad rkey, bounds or access: REM_ACCESS_ERR.
        RemoteAccess = 3,
        /// The receive buffer is too small: REM_INV_REQ_ERR.
        InvalidRequest = 4,
        /// The responder failed on its side (bad receive buffer): REM_OP_ERR.
        RemoteOperation = 5,
        /// The responder QP does not exist (any more): RETRY_EXC_ERR, like a NIC.
        Gone = 6,
    }
    /// Decodes a status word (0 is not a NAK).
    pub fn from_u32(u32);
}

/// Decoding failures.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// Wrong magic: not a vrdma peer, or misframed.
    #[error("bad frame magic {magic:#x}")]
    BadMagic {
        /// The first four bytes, as read.
        magic: u32,
    },
    /// Another protocol version.
    #[error("peer speaks protocol version {version}, we speak {VERSION}")]
    BadVersion {
        /// The version the peer speaks.
        version: u16,
    },
    /// Unknown frame kind.
    #[error("unknown frame kind {kind}")]
    UnknownKind {
        /// The raw kind received.
        kind: u16,
    },
    /// Payload larger than the kind allows.
    #[error("frame kind {kind:?} with {len} data bytes (at most {max})")]
    TooLong {
        /// The frame's kind.
        kind: Kind,
        /// Data bytes it declares.
        len: u32,
        /// The most that kind may carry.
        max: u32,
    },
    /// A READ request larger than a message may be.
    #[error("read of {len} bytes (at most {MAX_MESSAGE})")]
    ReadTooLong {
        /// Bytes the READ asks for.
        len: u64,
    },
    /// A control payload that does not parse.
    #[error("malformed {what} payload")]
    BadPayload {
        /// The payload's type.
        what: &'static str,
    },
}

/// A frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame is.
    pub kind: Kind,
    /// Kind-specific flags.
    pub flags: u32,
    /// QP (on the receiving host) the frame is for.
    pub dst_qpn: u32,
    /// QP (on the sending host) it comes from.
    pub src_qpn: u32,
    /// Request sequence number (requests) or the one answered (responses).
    pub psn: u32,
    /// Remote key.
    pub rkey: u32,
    /// Immediate data.
    pub imm: u32,
    /// Response status: 0 or a [`Nak`]; errno for CONNECT_REP.
    pub status: u32,
    /// Bytes that follow the header.
    pub data_len: u32,
    /// Remote address.
    pub remote_addr: u64,
    /// Kind-specific.
    pub arg1: u64,
    /// Kind-specific.
    pub arg2: u64,
}

impl FrameHeader {
    /// A header of `kind` with every other field zero.
    pub fn new(kind: Kind) -> Self {
        FrameHeader {
            kind,
            flags: 0,
            dst_qpn: 0,
            src_qpn: 0,
            psn: 0,
            rkey: 0,
            imm: 0,
            status: 0,
            data_len: 0,
            remote_addr: 0,
            arg1: 0,
            arg2: 0,
        }
    }

    /// The request frame of a send WR (`len`: its data bytes, or the READ's length), with
    /// PSN `psn`, from QP `src_qpn` to the peer's `dst_qpn`. One definition for the engine
    /// and for a client sending on its lane, so both put the same frame on the wire.
    pub fn request(opcode: WrOpcode, wr: &SqEntry, psn: u32, src_qpn: u32, dst_qpn: u32, len: u32) -> FrameHeader {
        let kind = match opcode {
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => Kind::Write,
            WrOpcode::Send | WrOpcode::SendWithImm => Kind::Send,
            WrOpcode::RdmaRead => Kind::ReadReq,
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => Kind::AtomicReq,
        };
        let mut h = FrameHeader::new(kind);
        h.dst_qpn = dst_qpn;
        h.src_qpn = src_qpn;
        h.psn = psn;
        h.rkey = wr.rkey;
        h.remote_addr = wr.remote_addr;
        if matches!(opcode, WrOpcode::RdmaWriteWithImm | WrOpcode::SendWithImm) {
            h.flags |= F_IMM;
            h.imm = wr.imm_data;
        }
        if wr.send_flags & send_flags::SOLICITED != 0 {
            h.flags |= F_SOLICITED;
        }
        match kind {
            Kind::ReadReq => h.arg1 = u64::from(len),
            Kind::AtomicReq => {
                if opcode == WrOpcode::AtomicCmpAndSwp {
                    h.flags |= F_CMP_SWAP;
                }
                h.arg1 = wr.compare_add;
                h.arg2 = wr.swap;
            }
            _ => h.data_len = len,
        }
        h
    }

    /// Makes this request (a SEND or WRITE on a lane) carry ACK token `t` ([`F_ACKS`]).
    pub fn carry(&mut self, t: &crate::ring::AckToken) {
        self.flags |= F_ACKS;
        self.status = t.psn;
        self.arg1 = t.counter;
        self.arg2 = t.mac;
    }

    /// Encodes into 64 bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        for (i, v) in [self.flags, self.dst_qpn, self.src_qpn, self.psn, self.rkey, self.imm, self.status, self.data_len].iter().enumerate()
        {
            b[8 + 4 * i..12 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        b[40..48].copy_from_slice(&self.remote_addr.to_le_bytes());
        b[48..56].copy_from_slice(&self.arg1.to_le_bytes());
        b[56..64].copy_from_slice(&self.arg2.to_le_bytes());
        b
    }

    /// Decodes and validates 64 received bytes.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<FrameHeader, WireError> {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| u64::from(u32_at(o)) | (u64::from(u32_at(o + 4)) << 32);
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(WireError::BadMagic { magic });
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(WireError::BadVersion { version });
        }
        let k = u16::from_le_bytes([b[6], b[7]]);
        let kind = Kind::from_u16(k).ok_or(WireError::UnknownKind { kind: k })?;
        let h = FrameHeader {
            kind,
            flags: u32_at(8),
            dst_qpn: u32_at(12),
            src_qpn: u32_at(16),
            psn: u32_at(20),
            rkey: u32_at(24),
            imm: u32_at(28),
            status: u32_at(32),
            data_len: u32_at(36),
            remote_addr: u64_at(40),
            arg1: u64_at(48),
            arg2: u64_at(56),
        };
        if h.data_len > kind.max_data() {
            return Err(WireError::TooLong { kind, len: h.data_len, max: kind.max_data() });
        }
        if kind == Kind::ReadReq && h.arg1 > u64::from(MAX_MESSAGE) {
            return Err(WireError::ReadTooLong { len: h.arg1 });
        }
        Ok(h)
    }
}

/// Payload of CONNECT_REQ: who asks (GID and tenant of its vNIC) and whom it wants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectReq {
    /// Requesting vNIC's GID.
    pub src_gid: [u8; 16],
    /// Destination GID.
    pub dst_gid: [u8; 16],
    /// Requesting vNIC's tenant.
    pub src_tenant: String,
}

/// Longest tenant name on the wire.
pub const MAX_TENANT: usize = 256;

impl ConnectReq {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(32 + self.src_tenant.len());
        v.extend_from_slice(&self.src_gid);
        v.extend_from_slice(&self.dst_gid);
        v.extend_from_slice(&self.src_tenant.as_bytes()[..self.src_tenant.len().min(MAX_TENANT)]);
        v
    }

    /// Decodes a received payload.
    pub fn decode(b: &[u8]) -> Result<ConnectReq, WireError> {
        let bad = WireError::BadPayload { what: "CONNECT_REQ" };
        if b.len() < 32 || b.len() > 32 + MAX_TENANT {
            return Err(bad);
        }
        let mut src_gid = [0u8; 16];
        let mut dst_gid = [0u8; 16];
        src_gid.copy_from_slice(&b[..16]);
        dst_gid.copy_from_slice(&b[16..32]);
        let src_tenant = std::str::from_utf8(&b[32..]).map_err(|_| bad)?.to_string();
        if src_tenant.is_empty() {
            return Err(WireError::BadPayload { what: "CONNECT_REQ" });
        }
        Ok(ConnectReq { src_gid, dst_gid, src_tenant })
    }
}

/// Decodes a UTF-8 text payload (HELLO's host name, CONNECT_REP's message), lossily.
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(&b[..b.len().min(MAX_CONTROL_DATA as usize)]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let mut h = FrameHeader::new(Kind::Write);
        h.flags = F_IMM | F_SOLICITED;
        h.dst_qpn = 1;
        h.src_qpn = 2;
        h.psn = 3;
        h.rkey = 4;
        h.imm = 5;
        h.status = 0;
        h.data_len = 4096;
        h.remote_addr = u64::MAX - 1;
        h.arg1 = 7;
        h.arg2 = 8;
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn kinds_and_naks_decode_from_their_values_only() {
        for &k in Kind::VARIANTS {
            assert_eq!(Kind::from_u16(k as u16), Some(k));
        }
        assert_eq!(Kind::from_u16(0), None);
        assert_eq!(Kind::from_u16(8), None);
        for &n in Nak::VARIANTS {
            assert_eq!(Nak::from_u32(n as u32), Some(n));
        }
        assert_eq!(Nak::from_u32(0), None, "0 is not a NAK");
        assert_eq!(Nak::from_u32(7), None);
    }

    #[test]
    fn bad_headers_are_errors() {
        let h = FrameHeader::new(Kind::Heartbeat);
        let mut b = h.encode();
        b[0] ^= 1;
        assert!(matches!(FrameHeader::decode(&b), Err(WireError::BadMagic { .. })));
        let mut b = h.encode();
        b[4] = 9;
        assert!(matches!(FrameHeader::decode(&b), Err(WireError::BadVersion { .. })));
        let mut b = h.encode();
        b[6] = 99;
        assert!(matches!(FrameHeader::decode(&b), Err(WireError::UnknownKind { .. })));
        let mut b = h.encode();
        b[36] = 1; // a heartbeat carries no data
        assert!(matches!(FrameHeader::decode(&b), Err(WireError::TooLong { .. })));
        let mut r = FrameHeader::new(Kind::ReadReq);
        r.arg1 = u64::from(MAX_MESSAGE) + 1;
        assert!(matches!(FrameHeader::decode(&r.encode()), Err(WireError::ReadTooLong { .. })));
    }

    #[test]
    fn connect_req_round_trip_and_garbage() {
        let c = ConnectReq { src_gid: [1; 16], dst_gid: [2; 16], src_tenant: "blue".into() };
        assert_eq!(ConnectReq::decode(&c.encode()).unwrap(), c);
        assert!(ConnectReq::decode(&[0; 31]).is_err());
        assert!(ConnectReq::decode(&[0; 32]).is_err(), "empty tenant");
        let mut b = c.encode();
        b.push(0xff);
        assert!(ConnectReq::decode(&b).is_err(), "not UTF-8");
        assert!(ConnectReq::decode(&vec![b'a'; 32 + MAX_TENANT + 1]).is_err());
    }

    /// The MAC of an ACK token depends on the key and on every field it covers.
    #[test]
    fn lane_ack_mac_covers_key_and_fields() {
        let k = [1u64, 2];
        let m = lane_ack_mac(k, 10, 20, 30, 40);
        assert_eq!(m, lane_ack_mac(k, 10, 20, 30, 40));
        for other in [
            lane_ack_mac([1, 3], 10, 20, 30, 40),
            lane_ack_mac([0, 2], 10, 20, 30, 40),
            lane_ack_mac(k, 11, 20, 30, 40),
            lane_ack_mac(k, 10, 21, 30, 40),
            lane_ack_mac(k, 10, 20, 31, 40),
            lane_ack_mac(k, 10, 20, 30, 41),
            lane_ack_mac(k, 20, 10, 30, 40),
        ] {
            assert_ne!(m, other);
        }
    }
}
