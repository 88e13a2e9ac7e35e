//! UD datagrams to another host: what a client library hands vrdmad (one `SOCK_SEQPACKET`
//! message per datagram on the UD QP's datagram socket), and what one vrdmad sends the other
//! (the data of a [`crate::wire::Kind::UdSend`] frame). Both are a fixed header and the
//! payload; both are validated on every receive, since neither sender is trusted.

use crate::ring::{self, CompEntry};
use crate::verbs::{wc_flags, WcOpcode};

/// Largest UD payload (the path MTU).
pub const UD_MTU: usize = 4096;

/// Flag: the datagram carries immediate data.
pub const UD_F_IMM: u32 = 1;
/// Flag: the sender asked for a solicited event.
pub const UD_F_SOLICITED: u32 = 2;
const UD_KNOWN_FLAGS: u32 = UD_F_IMM | UD_F_SOLICITED;

/// Bytes of a [`UdDatagram`] header.
pub const UD_DATAGRAM_HEADER: usize = 32;
/// Largest datagram message (header and payload).
pub const UD_DATAGRAM_MAX: usize = UD_DATAGRAM_HEADER + UD_MTU;

/// Bytes of the GIDs before the payload of a `UdSend` frame (source, then destination).
pub const UD_FRAME_GIDS: usize = 32;
/// Largest `UdSend` frame data.
pub const UD_FRAME_MAX: usize = UD_FRAME_GIDS + UD_MTU;

/// Bytes of the Global Routing Header at the start of every UD receive buffer.
pub const GRH_LEN: usize = 40;

/// The GRH a UD receiver finds before the payload, in IB layout: IPv6-style
/// version/class/flow, payload length, next header, hop limit, source GID, destination GID.
pub fn grh(src_gid: &[u8; 16], dgid: &[u8; 16], payload_len: usize) -> [u8; GRH_LEN] {
    let mut g = [0u8; GRH_LEN];
    g[0..4].copy_from_slice(&(6u32 << 28).to_be_bytes());
    g[4..6].copy_from_slice(&(payload_len as u16).to_be_bytes());
    g[6] = 0x1b;
    g[7] = 64;
    g[8..24].copy_from_slice(src_gid);
    g[24..40].copy_from_slice(dgid);
    g
}

/// The receive completion of a UD datagram of `payload_len` bytes (received after its GRH)
/// from QP `src_qp`: `imm` if it carried immediate data, `solicited` if the sender asked for
/// an event, `from_srq` if the receive came from an SRQ. The same on every delivery path.
pub fn recv_completion(wr_id: u64, payload_len: usize, imm: Option<u32>, solicited: bool, from_srq: bool, src_qp: u32) -> CompEntry {
    let mut flags = if solicited { ring::COMP_SOLICITED } else { 0 };
    if from_srq {
        flags |= ring::COMP_FROM_SRQ;
    }
    CompEntry {
        wr_id,
        byte_len: (GRH_LEN + payload_len) as u32,
        imm: imm.unwrap_or(0),
        opcode: WcOpcode::Recv as u8,
        status: 0,
        wc_flags: (wc_flags::GRH | if imm.is_some() { wc_flags::WITH_IMM } else { 0 }) as u8,
        flags,
        src_qp,
    }
}

/// Decoding failures.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UdError {
    /// Shorter than its header.
    #[error("UD datagram of {len} bytes is shorter than its {UD_DATAGRAM_HEADER}-byte header")]
    Truncated {
        /// Bytes received.
        len: usize,
    },
    /// Payload over the MTU.
    #[error("UD payload of {len} bytes is over the {UD_MTU}-byte MTU")]
    TooLong {
        /// Payload bytes.
        len: usize,
    },
    /// Unknown flag bits.
    #[error("UD datagram flags {flags:#x} has unknown bits")]
    BadFlags {
        /// The flags word received.
        flags: u32,
    },
}

/// A datagram a client sends to a UD QP on another host, through vrdmad.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdDatagram {
    /// Destination QPN.
    pub dest_qpn: u32,
    /// The Q_Key the datagram carries (already resolved against the QP's own when the WR's
    /// has the high bit set).
    pub qkey: u32,
    /// Immediate data (with [`UD_F_IMM`]).
    pub imm: u32,
    /// [`UD_F_IMM`], [`UD_F_SOLICITED`].
    pub flags: u32,
    /// Destination GID.
    pub dgid: [u8; 16],
}

impl UdDatagram {
    /// The message: header, then `payload` (at most [`UD_MTU`] bytes, not checked here).
    pub fn encode_header(&self) -> [u8; UD_DATAGRAM_HEADER] {
        let mut b = [0u8; UD_DATAGRAM_HEADER];
        b[0..4].copy_from_slice(&self.dest_qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.qkey.to_le_bytes());
        b[8..12].copy_from_slice(&self.imm.to_le_bytes());
        b[12..16].copy_from_slice(&self.flags.to_le_bytes());
        b[16..32].copy_from_slice(&self.dgid);
        b
    }

    /// Decodes a received message into its header and payload.
    pub fn decode(msg: &[u8]) -> Result<(UdDatagram, &[u8]), UdError> {
        if msg.len() < UD_DATAGRAM_HEADER {
            return Err(UdError::Truncated { len: msg.len() });
        }
        let payload = &msg[UD_DATAGRAM_HEADER..];
        if payload.len() > UD_MTU {
            return Err(UdError::TooLong { len: payload.len() });
        }
        let u32_at = |at: usize| u32::from_le_bytes([msg[at], msg[at + 1], msg[at + 2], msg[at + 3]]);
        let flags = u32_at(12);
        if flags & !UD_KNOWN_FLAGS != 0 {
            return Err(UdError::BadFlags { flags });
        }
        let mut dgid = [0u8; 16];
        dgid.copy_from_slice(&msg[16..32]);
        Ok((UdDatagram { dest_qpn: u32_at(0), qkey: u32_at(4), imm: u32_at(8), flags, dgid }, payload))
    }
}

/// The data of a `UdSend` frame, split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdFrame<'a> {
    /// The sending vNIC's GID.
    pub src_gid: [u8; 16],
    /// The destination GID.
    pub dst_gid: [u8; 16],
    /// The datagram.
    pub payload: &'a [u8],
}

/// Splits a `UdSend` frame's data into source GID, destination GID and payload.
pub fn split_frame(data: &[u8]) -> Result<UdFrame<'_>, UdError> {
    if data.len() < UD_FRAME_GIDS {
        return Err(UdError::Truncated { len: data.len() });
    }
    let payload = &data[UD_FRAME_GIDS..];
    if payload.len() > UD_MTU {
        return Err(UdError::TooLong { len: payload.len() });
    }
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&data[..16]);
    dst.copy_from_slice(&data[16..32]);
    Ok(UdFrame { src_gid: src, dst_gid: dst, payload })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagram_round_trips_and_bad_ones_are_refused() {
        let d = UdDatagram { dest_qpn: 7, qkey: 0x1111_2222, imm: 9, flags: UD_F_IMM, dgid: [3; 16] };
        let mut msg = d.encode_header().to_vec();
        msg.extend_from_slice(b"hello");
        assert_eq!(UdDatagram::decode(&msg), Ok((d, &b"hello"[..])));
        assert_eq!(UdDatagram::decode(&msg[..31]), Err(UdError::Truncated { len: 31 }));
        let mut big = d.encode_header().to_vec();
        big.resize(UD_DATAGRAM_MAX + 1, 0);
        assert_eq!(UdDatagram::decode(&big), Err(UdError::TooLong { len: UD_MTU + 1 }));
        big.truncate(UD_DATAGRAM_MAX);
        assert!(UdDatagram::decode(&big).is_ok());
        let mut bad = msg.clone();
        bad[12] = 0x80;
        assert_eq!(UdDatagram::decode(&bad), Err(UdError::BadFlags { flags: 0x80 }));
    }

    #[test]
    fn frame_data_splits_into_gids_and_payload() {
        let mut data = vec![1u8; 16];
        data.extend_from_slice(&[2u8; 16]);
        data.extend_from_slice(b"xy");
        assert_eq!(split_frame(&data), Ok(UdFrame { src_gid: [1; 16], dst_gid: [2; 16], payload: &b"xy"[..] }));
        assert_eq!(split_frame(&data[..20]), Err(UdError::Truncated { len: 20 }));
        data.resize(UD_FRAME_MAX + 1, 0);
        assert_eq!(split_frame(&data), Err(UdError::TooLong { len: UD_MTU + 1 }));
    }
}
