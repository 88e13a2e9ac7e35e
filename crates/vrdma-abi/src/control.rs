//! Control protocol between the client library and vrdmad, over the vNIC's
//! `control.sock` (`SOCK_SEQPACKET`: one datagram per message, file descriptors alongside
//! with `SCM_RIGHTS`).
//!
//! A message is a [`Header`] (`repr(C)`, little-endian, validated by [`Header::parse`]) and a
//! payload decoded by a bounds-checked [`Reader`]. vrdmad trusts no byte of it: every decoder
//! returns [`DecodeError`] on bad input, never panics (see `fuzz/`).

/// Magic number at the start of every message ("VRDM").
pub const MAGIC: u32 = 0x4d44_5256;
/// Protocol version this build speaks.
/// Bumped whenever a message or a shared-memory layout changes: a client and a daemon of
/// different layouts must refuse each other at Hello, not misread each other's rings.
pub const VERSION: u16 = 8;
/// Largest message, header included: a [`MAX_COPY_DATA`] copy with room to spare (a
/// `SOCK_SEQPACKET` datagram this size fits the default socket buffers).
pub const MAX_MESSAGE: usize = MAX_COPY_DATA + 8 * 1024;
/// Largest number of file descriptors carried by one message.
pub const MAX_FDS: usize = 64;
/// Largest string in a message.
pub const MAX_STRING: usize = 1024;
/// Largest number of chunks of one MR.
pub const MAX_MR_CHUNKS: usize = 64;
/// Most bytes one [`Request::PeerMrWrite`] or [`Reply::Bytes`] carries (well inside
/// [`MAX_MESSAGE`] with its header). Each is a round trip to vrdmad (32 KiB ones held the
/// copying fallback's 1 MiB writes to 210-280 MB/s on a 2-CPU VM); 64 KiB keeps a
/// datagram's linear part in the kernel to an order-2 allocation (the rest goes in page
/// fragments), which a fragmented host can still satisfy.
pub const MAX_COPY_DATA: usize = 64 * 1024;

/// Decoding failures.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("message of {len} bytes is shorter than its {need}-byte header")]
    ShortHeader { len: usize, need: usize },
    #[error("bad magic {magic:#x}")]
    BadMagic { magic: u32 },
    #[error("unsupported protocol version {version}")]
    BadVersion { version: u16 },
    #[error("payload length {declared} does not match the {actual} bytes received")]
    LengthMismatch { declared: usize, actual: usize },
    #[error("message of {len} bytes exceeds the maximum {max}")]
    TooLong { len: usize, max: usize },
    #[error("unknown operation {op}")]
    UnknownOp { op: u16 },
    #[error("truncated payload: needed {need} bytes at offset {offset}, had {have}")]
    Truncated { offset: usize, need: usize, have: usize },
    #[error("{what} count {count} exceeds the maximum {max}")]
    TooMany { what: &'static str, count: usize, max: usize },
    #[error("string is not UTF-8")]
    BadString,
    #[error("{extra} trailing bytes after the payload")]
    Trailing { extra: usize },
    #[error("field {field} has invalid value {value}")]
    BadValue { field: &'static str, value: u64 },
}

/// Fixed message header.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// [`MAGIC`].
    pub magic: u32,
    /// [`VERSION`].
    pub version: u16,
    /// Operation code of the payload.
    pub op: u16,
    /// Request sequence number, echoed in the reply.
    pub seq: u32,
    /// Payload bytes following the header.
    pub len: u32,
}

/// Size of [`Header`] on the wire.
pub const HEADER_LEN: usize = std::mem::size_of::<Header>();

impl Header {
    /// Parses and validates the header of a received datagram of `buf.len()` bytes.
    pub fn parse(buf: &[u8]) -> Result<Header, DecodeError> {
        if buf.len() < HEADER_LEN {
            return Err(DecodeError::ShortHeader { len: buf.len(), need: HEADER_LEN });
        }
        if buf.len() > MAX_MESSAGE {
            return Err(DecodeError::TooLong { len: buf.len(), max: MAX_MESSAGE });
        }
        let mut r = Reader::new(&buf[..HEADER_LEN]);
        let h = Header { magic: r.u32()?, version: r.u16()?, op: r.u16()?, seq: r.u32()?, len: r.u32()? };
        h.is_valid(buf.len() - HEADER_LEN)?;
        Ok(h)
    }

    /// Checks magic, version and that the declared length matches what arrived.
    pub fn is_valid(&self, payload_len: usize) -> Result<(), DecodeError> {
        if self.magic != MAGIC {
            return Err(DecodeError::BadMagic { magic: self.magic });
        }
        if self.version != VERSION {
            return Err(DecodeError::BadVersion { version: self.version });
        }
        if self.len as usize != payload_len {
            return Err(DecodeError::LengthMismatch { declared: self.len as usize, actual: payload_len });
        }
        Ok(())
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.magic.to_le_bytes());
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.op.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }
}

/// Bounds-checked little-endian reader.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Reads `buf` from its start.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let have = self.buf.len() - self.pos;
        if n > have {
            return Err(DecodeError::Truncated { offset: self.pos, need: n, have });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    /// One byte.
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    /// A little-endian u16.
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }
    /// A little-endian u32.
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    /// A little-endian i32.
    pub fn i32(&mut self) -> Result<i32, DecodeError> {
        Ok(self.u32()? as i32)
    }
    /// A little-endian u64.
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    /// A 16-byte GID.
    pub fn gid(&mut self) -> Result<[u8; 16], DecodeError> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.take(16)?);
        Ok(a)
    }
    /// A length-prefixed UTF-8 string of at most [`MAX_STRING`] bytes.
    pub fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        if n > MAX_STRING {
            return Err(DecodeError::TooMany { what: "string byte", count: n, max: MAX_STRING });
        }
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| DecodeError::BadString)
    }
    /// A count prefix bounded by `max`.
    pub fn count(&mut self, what: &'static str, max: usize) -> Result<usize, DecodeError> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(DecodeError::TooMany { what, count: n, max });
        }
        Ok(n)
    }
    /// Fails unless every byte was consumed.
    /// A boolean byte (0 or 1).
    pub fn flag(&mut self, field: &'static str) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::BadValue { field, value: u64::from(v) }),
        }
    }
    /// A length-prefixed byte string of at most [`MAX_COPY_DATA`] bytes.
    pub fn bytes(&mut self) -> Result<Vec<u8>, DecodeError> {
        let n = self.u32()? as usize;
        if n > MAX_COPY_DATA {
            return Err(DecodeError::BadValue { field: "data length", value: n as u64 });
        }
        Ok(self.take(n)?.to_vec())
    }
    pub fn finish(&self) -> Result<(), DecodeError> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            extra => Err(DecodeError::Trailing { extra }),
        }
    }
}

/// Little-endian writer.
#[derive(Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i32(&mut self, v: i32) -> &mut Self {
        self.u32(v as u32)
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn gid(&mut self, g: &[u8; 16]) -> &mut Self {
        self.buf.extend_from_slice(g);
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.buf.extend_from_slice(b);
        self
    }
    fn string(&mut self, s: &str) -> &mut Self {
        let b = &s.as_bytes()[..s.len().min(MAX_STRING)];
        self.u16(b.len() as u16);
        self.buf.extend_from_slice(b);
        self
    }
    fn count(&mut self, n: usize) -> &mut Self {
        self.u16(n as u16)
    }
}

/// One piece of a memory region: `len` bytes at `mr_offset` within the MR's page-aligned
/// span are the bytes of the accompanying memfd at `fd_offset`. Each chunk carries one fd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrChunk {
    /// Offset within the page-aligned span of the MR.
    pub mr_offset: u64,
    /// Length in bytes (page multiple).
    pub len: u64,
    /// Offset within the memfd (page multiple).
    pub fd_offset: u64,
}

/// Capabilities requested for a QP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// Scatter/gather elements per send WR.
    pub max_send_sge: u32,
    /// Scatter/gather elements per receive WR.
    pub max_recv_sge: u32,
    /// Inline data bytes.
    pub max_inline_data: u32,
}

/// Per-vNIC resource limits (also stored with each vNIC record, as JSON, with the `serde`
/// feature).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Limits {
    /// Protection domains.
    pub max_pd: u32,
    /// Completion queues.
    pub max_cq: u32,
    /// Queue pairs.
    pub max_qp: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Bytes of registered memory.
    pub max_mr_bytes: u64,
    /// Shared receive queues.
    pub max_srq: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_pd: 1024, max_cq: 4096, max_qp: 4096, max_mr: 16384, max_mr_bytes: 64 << 30, max_srq: 1024 }
    }
}

/// Counts of the resources a vNIC holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Usage {
    /// Live client connections.
    pub clients: u32,
    /// Protection domains.
    pub pds: u32,
    /// Completion queues.
    pub cqs: u32,
    /// Queue pairs.
    pub qps: u32,
    /// Memory regions.
    pub mrs: u32,
    /// Registered bytes.
    pub mr_bytes: u64,
    /// Shared receive queues.
    pub srqs: u32,
}

/// Client → daemon requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// First message of a connection.
    Hello { version: u32 },
    /// `ibv_alloc_pd`.
    AllocPd,
    /// `ibv_dealloc_pd`.
    DeallocPd { pd: u32 },
    /// `ibv_reg_mr`; one fd per chunk follows. No chunks at all registers memory that cannot
    /// be shared (file-backed, hugetlb…): vrdmad then copies every remote access through the
    /// registering process's memory (the copying fallback, DESIGN §3).
    RegMr { pd: u32, addr: u64, length: u64, access: u32, chunks: Vec<MrChunk> },
    /// `ibv_dereg_mr`.
    DeregMr { key: u32 },
    /// `ibv_create_cq`.
    CreateCq { cqe: u32 },
    /// `ibv_destroy_cq`.
    DestroyCq { cq: u32 },
    /// `ibv_create_srq`.
    CreateSrq { pd: u32, max_wr: u32, max_sge: u32 },
    /// `ibv_destroy_srq`.
    DestroySrq { srq: u32 },
    /// `ibv_create_qp` (`srq` 0 = none).
    CreateQp { pd: u32, send_cq: u32, recv_cq: u32, srq: u32, qp_type: u8, caps: QpCaps },
    /// Tells the daemon the QP's new state (it tracks connections).
    SetQpState { qpn: u32, state: u8 },
    /// `modify_qp(RTR)`: connect to `dest_qpn` at `dgid`.
    ConnectQp { qpn: u32, dgid: [u8; 16], dest_qpn: u32 },
    /// `ibv_destroy_qp`.
    DestroyQp { qpn: u32 },
    /// Map the connected peer's MR with key `key` (for RDMA ops or to fill a receive).
    MapPeerMr { qpn: u32, key: u32 },
    /// Resource counts of this vNIC.
    QueryUsage,
    /// `ibv_create_ah`: whether `dgid` is a vNIC this one may reach (tenant rules).
    CheckGid { dgid: [u8; 16] },
    /// A UD send from `qpn` to `dest_qpn` at `dgid`: the destination UD QP's rings (replied as
    /// [`Reply::Connected`], fds as for [`Request::ConnectQp`]); connects nothing.
    ResolveUd { qpn: u32, dgid: [u8; 16], dest_qpn: u32 },
    /// Map the MR with key `key` of UD QP `dest_qpn`, resolved before by `qpn` (to fill a
    /// receive).
    MapUdPeerMr { qpn: u32, dest_qpn: u32, key: u32 },
    /// Writes `data` at `addr` of the peer's copied MR `key` (see [`Reply::PeerMr`]); the
    /// peer is `qpn`'s connected QP (`dest_qpn` 0) or UD destination `dest_qpn`. `need_remote`:
    /// the access needs REMOTE_WRITE (an RDMA WRITE), else LOCAL_WRITE (a receive buffer).
    PeerMrWrite { qpn: u32, dest_qpn: u32, key: u32, addr: u64, need_remote: bool, data: Vec<u8> },
    /// Reads `len` (≤ [`MAX_COPY_DATA`]) bytes at `addr` of the peer's copied MR `key`
    /// (REMOTE_READ); replied as [`Reply::Bytes`].
    PeerMrRead { qpn: u32, dest_qpn: u32, key: u32, addr: u64, len: u32 },
    /// An RDMA atomic on the 8 bytes at `addr` of the peer's copied MR `key`; replied as
    /// [`Reply::Atomic`].
    PeerMrAtomic { qpn: u32, dest_qpn: u32, key: u32, addr: u64, cmp_swap: bool, compare_add: u64, swap: u64 },
}

/// vNIC description returned by [`Reply::Hello`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VnicInfo {
    /// vNIC name.
    pub name: String,
    /// Tenant.
    pub tenant: String,
    /// GID table (vGIDs).
    pub gids: Vec<[u8; 16]>,
    /// Limits.
    pub limits: Limits,
    /// Node GUID.
    pub node_guid: u64,
}

/// Description of a connected peer's shared state; fds follow in order: QP region, recv CQ
/// region, recv CQ eventfd, and the SRQ region if `srq_ring` is some.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// Peer's QP number.
    pub qpn: u32,
    /// Peer's receive ring (entries, max_sge), if it has no SRQ.
    pub rq_ring: Option<(u32, u32)>,
    /// Peer's inbound completion ring entries.
    pub comp_entries: u32,
    /// Peer's SRQ ring (entries, max_sge), if any.
    pub srq_ring: Option<(u32, u32)>,
}

/// Daemon → client replies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The request failed with `errno`.
    Error { errno: i32, message: String },
    /// Done, nothing to return.
    Ok,
    /// Hello answered.
    Hello(VnicInfo),
    /// A new handle (PD, CQ, SRQ…).
    Handle { handle: u32 },
    /// A registered MR.
    Mr { lkey: u32, rkey: u32 },
    /// A CQ; fds: region memfd, eventfd.
    Cq { cq: u32 },
    /// An SRQ; fd: region memfd.
    Srq { srq: u32, entries: u32, max_sge: u32 },
    /// A QP; fd: region memfd.
    Qp { qpn: u32, rq_entries: u32, max_recv_sge: u32, comp_entries: u32 },
    /// Connected; fds as described in [`PeerInfo`].
    Connected(PeerInfo),
    /// Connected through vrdmad's engine (the peer is on another host, or policy mediates):
    /// the QP posts its send WRs into a [`crate::ring::SqRing`] of `sq_entries` slots
    /// (`max_sge`, `max_inline`) and polls send completions from a ring of `comp_entries`,
    /// both in one channel region ([`crate::ring::MediatedLayout`]); fds: that region and
    /// the engine's doorbell eventfd, and, when the engine gives the QP a *lane*, the lane's
    /// TCP socket: the client may write its requests there itself while it holds the
    /// channel's send side ([`crate::ring::MED_SEND_SIDE`]).
    ConnectedMediated { sq_entries: u32, max_sge: u32, max_inline: u32, comp_entries: u32 },
    /// A UD destination on another host, reached through vrdmad: the UD QP sends its
    /// datagrams there as [`crate::ud::UdDatagram`] messages on the `SOCK_SEQPACKET` socket
    /// in fds (the same socket for every remote destination of the QP).
    UdRemote,
    /// A peer MR; one fd per chunk. No chunks: the MR is copied (registered without chunks),
    /// reach it with [`Request::PeerMrWrite`], [`Request::PeerMrRead`] and
    /// [`Request::PeerMrAtomic`].
    PeerMr { addr: u64, length: u64, access: u32, chunks: Vec<MrChunk> },
    /// Bytes read from a copied MR.
    Bytes { data: Vec<u8> },
    /// An atomic's original value.
    Atomic { old: u64 },
    /// Usage of this vNIC.
    Usage(Usage),
}

mod op {
    pub const HELLO: u16 = 1;
    pub const ALLOC_PD: u16 = 2;
    pub const DEALLOC_PD: u16 = 3;
    pub const REG_MR: u16 = 4;
    pub const DEREG_MR: u16 = 5;
    pub const CREATE_CQ: u16 = 6;
    pub const DESTROY_CQ: u16 = 7;
    pub const CREATE_SRQ: u16 = 8;
    pub const DESTROY_SRQ: u16 = 9;
    pub const CREATE_QP: u16 = 10;
    pub const SET_QP_STATE: u16 = 11;
    pub const CONNECT_QP: u16 = 12;
    pub const DESTROY_QP: u16 = 13;
    pub const MAP_PEER_MR: u16 = 14;
    pub const QUERY_USAGE: u16 = 15;
    pub const CHECK_GID: u16 = 16;
    pub const RESOLVE_UD: u16 = 17;
    pub const MAP_UD_PEER_MR: u16 = 18;
    pub const PEER_MR_WRITE: u16 = 19;
    pub const PEER_MR_READ: u16 = 20;
    pub const PEER_MR_ATOMIC: u16 = 21;

    pub const R_ERROR: u16 = 0x8000;
    pub const R_OK: u16 = 0x8001;
    pub const R_HELLO: u16 = 0x8002;
    pub const R_HANDLE: u16 = 0x8003;
    pub const R_MR: u16 = 0x8004;
    pub const R_CQ: u16 = 0x8005;
    pub const R_SRQ: u16 = 0x8006;
    pub const R_QP: u16 = 0x8007;
    pub const R_CONNECTED: u16 = 0x8008;
    pub const R_PEER_MR: u16 = 0x8009;
    pub const R_USAGE: u16 = 0x800a;
    pub const R_CONNECTED_MEDIATED: u16 = 0x800b;
    pub const R_BYTES: u16 = 0x800c;
    pub const R_ATOMIC: u16 = 0x800d;
    pub const R_UD_REMOTE: u16 = 0x800e;
}

fn frame(op: u16, seq: u32, w: Writer) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + w.buf.len());
    Header { magic: MAGIC, version: VERSION, op, seq, len: w.buf.len() as u32 }.write(&mut out);
    out.extend_from_slice(&w.buf);
    out
}

fn write_chunks(w: &mut Writer, chunks: &[MrChunk]) {
    w.count(chunks.len());
    for c in chunks {
        w.u64(c.mr_offset).u64(c.len).u64(c.fd_offset);
    }
}

fn read_chunks(r: &mut Reader<'_>) -> Result<Vec<MrChunk>, DecodeError> {
    let n = r.count("MR chunk", MAX_MR_CHUNKS)?;
    (0..n).map(|_| Ok(MrChunk { mr_offset: r.u64()?, len: r.u64()?, fd_offset: r.u64()? })).collect()
}

fn write_ring(w: &mut Writer, ring: Option<(u32, u32)>) {
    match ring {
        Some((e, s)) => w.u8(1).u32(e).u32(s),
        None => w.u8(0).u32(0).u32(0),
    };
}

fn read_ring(r: &mut Reader<'_>) -> Result<Option<(u32, u32)>, DecodeError> {
    let present = r.u8()?;
    let (e, s) = (r.u32()?, r.u32()?);
    match present {
        0 => Ok(None),
        1 => Ok(Some((e, s))),
        v => Err(DecodeError::BadValue { field: "ring present", value: u64::from(v) }),
    }
}

impl Request {
    /// Encodes with sequence number `seq`.
    pub fn encode(&self, seq: u32) -> Vec<u8> {
        let mut w = Writer::default();
        let op = match self {
            Request::Hello { version } => {
                w.u32(*version);
                op::HELLO
            }
            Request::AllocPd => op::ALLOC_PD,
            Request::DeallocPd { pd } => {
                w.u32(*pd);
                op::DEALLOC_PD
            }
            Request::RegMr { pd, addr, length, access, chunks } => {
                w.u32(*pd).u64(*addr).u64(*length).u32(*access);
                write_chunks(&mut w, chunks);
                op::REG_MR
            }
            Request::DeregMr { key } => {
                w.u32(*key);
                op::DEREG_MR
            }
            Request::CreateCq { cqe } => {
                w.u32(*cqe);
                op::CREATE_CQ
            }
            Request::DestroyCq { cq } => {
                w.u32(*cq);
                op::DESTROY_CQ
            }
            Request::CreateSrq { pd, max_wr, max_sge } => {
                w.u32(*pd).u32(*max_wr).u32(*max_sge);
                op::CREATE_SRQ
            }
            Request::DestroySrq { srq } => {
                w.u32(*srq);
                op::DESTROY_SRQ
            }
            Request::CreateQp { pd, send_cq, recv_cq, srq, qp_type, caps } => {
                w.u32(*pd).u32(*send_cq).u32(*recv_cq).u32(*srq).u8(*qp_type);
                w.u32(caps.max_send_wr).u32(caps.max_recv_wr).u32(caps.max_send_sge).u32(caps.max_recv_sge).u32(caps.max_inline_data);
                op::CREATE_QP
            }
            Request::SetQpState { qpn, state } => {
                w.u32(*qpn).u8(*state);
                op::SET_QP_STATE
            }
            Request::ConnectQp { qpn, dgid, dest_qpn } => {
                w.u32(*qpn).gid(dgid).u32(*dest_qpn);
                op::CONNECT_QP
            }
            Request::DestroyQp { qpn } => {
                w.u32(*qpn);
                op::DESTROY_QP
            }
            Request::MapPeerMr { qpn, key } => {
                w.u32(*qpn).u32(*key);
                op::MAP_PEER_MR
            }
            Request::QueryUsage => op::QUERY_USAGE,
            Request::CheckGid { dgid } => {
                w.gid(dgid);
                op::CHECK_GID
            }
            Request::ResolveUd { qpn, dgid, dest_qpn } => {
                w.u32(*qpn).gid(dgid).u32(*dest_qpn);
                op::RESOLVE_UD
            }
            Request::MapUdPeerMr { qpn, dest_qpn, key } => {
                w.u32(*qpn).u32(*dest_qpn).u32(*key);
                op::MAP_UD_PEER_MR
            }
            Request::PeerMrWrite { qpn, dest_qpn, key, addr, need_remote, data } => {
                w.u32(*qpn).u32(*dest_qpn).u32(*key).u64(*addr).u8(u8::from(*need_remote)).bytes(data);
                op::PEER_MR_WRITE
            }
            Request::PeerMrRead { qpn, dest_qpn, key, addr, len } => {
                w.u32(*qpn).u32(*dest_qpn).u32(*key).u64(*addr).u32(*len);
                op::PEER_MR_READ
            }
            Request::PeerMrAtomic { qpn, dest_qpn, key, addr, cmp_swap, compare_add, swap } => {
                w.u32(*qpn).u32(*dest_qpn).u32(*key).u64(*addr).u8(u8::from(*cmp_swap)).u64(*compare_add).u64(*swap);
                op::PEER_MR_ATOMIC
            }
        };
        frame(op, seq, w)
    }

    /// Decodes a received datagram; returns the header's sequence number too.
    pub fn decode(buf: &[u8]) -> Result<(u32, Request), DecodeError> {
        let h = Header::parse(buf)?;
        let mut r = Reader::new(&buf[HEADER_LEN..]);
        let req = match h.op {
            op::HELLO => Request::Hello { version: r.u32()? },
            op::ALLOC_PD => Request::AllocPd,
            op::DEALLOC_PD => Request::DeallocPd { pd: r.u32()? },
            op::REG_MR => Request::RegMr { pd: r.u32()?, addr: r.u64()?, length: r.u64()?, access: r.u32()?, chunks: read_chunks(&mut r)? },
            op::DEREG_MR => Request::DeregMr { key: r.u32()? },
            op::CREATE_CQ => Request::CreateCq { cqe: r.u32()? },
            op::DESTROY_CQ => Request::DestroyCq { cq: r.u32()? },
            op::CREATE_SRQ => Request::CreateSrq { pd: r.u32()?, max_wr: r.u32()?, max_sge: r.u32()? },
            op::DESTROY_SRQ => Request::DestroySrq { srq: r.u32()? },
            op::CREATE_QP => Request::CreateQp {
                pd: r.u32()?,
                send_cq: r.u32()?,
                recv_cq: r.u32()?,
                srq: r.u32()?,
                qp_type: r.u8()?,
                caps: QpCaps {
                    max_send_wr: r.u32()?,
                    max_recv_wr: r.u32()?,
                    max_send_sge: r.u32()?,
                    max_recv_sge: r.u32()?,
                    max_inline_data: r.u32()?,
                },
            },
            op::SET_QP_STATE => Request::SetQpState { qpn: r.u32()?, state: r.u8()? },
            op::CONNECT_QP => Request::ConnectQp { qpn: r.u32()?, dgid: r.gid()?, dest_qpn: r.u32()? },
            op::DESTROY_QP => Request::DestroyQp { qpn: r.u32()? },
            op::MAP_PEER_MR => Request::MapPeerMr { qpn: r.u32()?, key: r.u32()? },
            op::QUERY_USAGE => Request::QueryUsage,
            op::CHECK_GID => Request::CheckGid { dgid: r.gid()? },
            op::RESOLVE_UD => Request::ResolveUd { qpn: r.u32()?, dgid: r.gid()?, dest_qpn: r.u32()? },
            op::MAP_UD_PEER_MR => Request::MapUdPeerMr { qpn: r.u32()?, dest_qpn: r.u32()?, key: r.u32()? },
            op::PEER_MR_WRITE => Request::PeerMrWrite {
                qpn: r.u32()?,
                dest_qpn: r.u32()?,
                key: r.u32()?,
                addr: r.u64()?,
                need_remote: r.flag("need_remote")?,
                data: r.bytes()?,
            },
            op::PEER_MR_READ => {
                let (qpn, dest_qpn, key, addr, len) = (r.u32()?, r.u32()?, r.u32()?, r.u64()?, r.u32()?);
                if len as usize > MAX_COPY_DATA {
                    return Err(DecodeError::BadValue { field: "read length", value: u64::from(len) });
                }
                Request::PeerMrRead { qpn, dest_qpn, key, addr, len }
            }
            op::PEER_MR_ATOMIC => Request::PeerMrAtomic {
                qpn: r.u32()?,
                dest_qpn: r.u32()?,
                key: r.u32()?,
                addr: r.u64()?,
                cmp_swap: r.flag("cmp_swap")?,
                compare_add: r.u64()?,
                swap: r.u64()?,
            },
            other => return Err(DecodeError::UnknownOp { op: other }),
        };
        r.finish()?;
        Ok((h.seq, req))
    }
}

impl Reply {
    /// Encodes with sequence number `seq`.
    pub fn encode(&self, seq: u32) -> Vec<u8> {
        let mut w = Writer::default();
        let op = match self {
            Reply::Error { errno, message } => {
                w.i32(*errno).string(message);
                op::R_ERROR
            }
            Reply::Ok => op::R_OK,
            Reply::Hello(v) => {
                w.string(&v.name).string(&v.tenant).count(v.gids.len());
                for g in &v.gids {
                    w.gid(g);
                }
                let l = &v.limits;
                w.u32(l.max_pd).u32(l.max_cq).u32(l.max_qp).u32(l.max_mr).u64(l.max_mr_bytes).u32(l.max_srq).u64(v.node_guid);
                op::R_HELLO
            }
            Reply::Handle { handle } => {
                w.u32(*handle);
                op::R_HANDLE
            }
            Reply::Mr { lkey, rkey } => {
                w.u32(*lkey).u32(*rkey);
                op::R_MR
            }
            Reply::Cq { cq } => {
                w.u32(*cq);
                op::R_CQ
            }
            Reply::Srq { srq, entries, max_sge } => {
                w.u32(*srq).u32(*entries).u32(*max_sge);
                op::R_SRQ
            }
            Reply::Qp { qpn, rq_entries, max_recv_sge, comp_entries } => {
                w.u32(*qpn).u32(*rq_entries).u32(*max_recv_sge).u32(*comp_entries);
                op::R_QP
            }
            Reply::Connected(p) => {
                w.u32(p.qpn);
                write_ring(&mut w, p.rq_ring);
                w.u32(p.comp_entries);
                write_ring(&mut w, p.srq_ring);
                op::R_CONNECTED
            }
            Reply::ConnectedMediated { sq_entries, max_sge, max_inline, comp_entries } => {
                w.u32(*sq_entries).u32(*max_sge).u32(*max_inline).u32(*comp_entries);
                op::R_CONNECTED_MEDIATED
            }
            Reply::UdRemote => op::R_UD_REMOTE,
            Reply::PeerMr { addr, length, access, chunks } => {
                w.u64(*addr).u64(*length).u32(*access);
                write_chunks(&mut w, chunks);
                op::R_PEER_MR
            }
            Reply::Bytes { data } => {
                w.bytes(data);
                op::R_BYTES
            }
            Reply::Atomic { old } => {
                w.u64(*old);
                op::R_ATOMIC
            }
            Reply::Usage(u) => {
                w.u32(u.clients).u32(u.pds).u32(u.cqs).u32(u.qps).u32(u.mrs).u64(u.mr_bytes).u32(u.srqs);
                op::R_USAGE
            }
        };
        frame(op, seq, w)
    }

    /// Decodes a received datagram.
    pub fn decode(buf: &[u8]) -> Result<(u32, Reply), DecodeError> {
        let h = Header::parse(buf)?;
        let mut r = Reader::new(&buf[HEADER_LEN..]);
        let rep = match h.op {
            op::R_ERROR => Reply::Error { errno: r.i32()?, message: r.string()? },
            op::R_OK => Reply::Ok,
            op::R_HELLO => {
                let name = r.string()?;
                let tenant = r.string()?;
                let n = r.count("GID", 128)?;
                let gids = (0..n).map(|_| r.gid()).collect::<Result<_, _>>()?;
                let limits = Limits {
                    max_pd: r.u32()?,
                    max_cq: r.u32()?,
                    max_qp: r.u32()?,
                    max_mr: r.u32()?,
                    max_mr_bytes: r.u64()?,
                    max_srq: r.u32()?,
                };
                Reply::Hello(VnicInfo { name, tenant, gids, limits, node_guid: r.u64()? })
            }
            op::R_HANDLE => Reply::Handle { handle: r.u32()? },
            op::R_MR => Reply::Mr { lkey: r.u32()?, rkey: r.u32()? },
            op::R_CQ => Reply::Cq { cq: r.u32()? },
            op::R_SRQ => Reply::Srq { srq: r.u32()?, entries: r.u32()?, max_sge: r.u32()? },
            op::R_QP => Reply::Qp { qpn: r.u32()?, rq_entries: r.u32()?, max_recv_sge: r.u32()?, comp_entries: r.u32()? },
            op::R_CONNECTED => Reply::Connected(PeerInfo {
                qpn: r.u32()?,
                rq_ring: read_ring(&mut r)?,
                comp_entries: r.u32()?,
                srq_ring: read_ring(&mut r)?,
            }),
            op::R_CONNECTED_MEDIATED => {
                Reply::ConnectedMediated { sq_entries: r.u32()?, max_sge: r.u32()?, max_inline: r.u32()?, comp_entries: r.u32()? }
            }
            op::R_UD_REMOTE => Reply::UdRemote,
            op::R_PEER_MR => Reply::PeerMr { addr: r.u64()?, length: r.u64()?, access: r.u32()?, chunks: read_chunks(&mut r)? },
            op::R_BYTES => Reply::Bytes { data: r.bytes()? },
            op::R_ATOMIC => Reply::Atomic { old: r.u64()? },
            op::R_USAGE => Reply::Usage(Usage {
                clients: r.u32()?,
                pds: r.u32()?,
                cqs: r.u32()?,
                qps: r.u32()?,
                mrs: r.u32()?,
                mr_bytes: r.u64()?,
                srqs: r.u32()?,
            }),
            other => return Err(DecodeError::UnknownOp { op: other }),
        };
        r.finish()?;
        Ok((h.seq, rep))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_requests() -> Vec<Request> {
        vec![
            Request::Hello { version: 1 },
            Request::AllocPd,
            Request::DeallocPd { pd: 3 },
            Request::RegMr {
                pd: 1,
                addr: 0x1000,
                length: 4096,
                access: 7,
                chunks: vec![MrChunk { mr_offset: 0, len: 4096, fd_offset: 0 }],
            },
            Request::DeregMr { key: 9 },
            Request::CreateCq { cqe: 100 },
            Request::DestroyCq { cq: 1 },
            Request::CreateSrq { pd: 1, max_wr: 10, max_sge: 2 },
            Request::DestroySrq { srq: 2 },
            Request::CreateQp {
                pd: 1,
                send_cq: 2,
                recv_cq: 3,
                srq: 0,
                qp_type: 2,
                caps: QpCaps { max_send_wr: 1, max_recv_wr: 2, max_send_sge: 3, max_recv_sge: 4, max_inline_data: 5 },
            },
            Request::SetQpState { qpn: 5, state: 6 },
            Request::ConnectQp { qpn: 5, dgid: [7; 16], dest_qpn: 8 },
            Request::DestroyQp { qpn: 5 },
            Request::MapPeerMr { qpn: 5, key: 0xabcd },
            Request::QueryUsage,
            Request::CheckGid { dgid: [3; 16] },
            Request::ResolveUd { qpn: 5, dgid: [7; 16], dest_qpn: 9 },
            Request::MapUdPeerMr { qpn: 5, dest_qpn: 9, key: 0xabcd },
            Request::PeerMrWrite { qpn: 5, dest_qpn: 0, key: 0xabcd, addr: 0x1000, need_remote: true, data: vec![1, 2, 3] },
            Request::PeerMrRead { qpn: 5, dest_qpn: 9, key: 0xabcd, addr: 0x1000, len: 4096 },
            Request::PeerMrAtomic { qpn: 5, dest_qpn: 0, key: 1, addr: 8, cmp_swap: true, compare_add: 3, swap: 4 },
        ]
    }

    #[test]
    fn requests_round_trip() {
        for (i, r) in all_requests().into_iter().enumerate() {
            let bytes = r.encode(i as u32);
            assert_eq!(Request::decode(&bytes).unwrap(), (i as u32, r));
        }
    }

    #[test]
    fn replies_round_trip() {
        let replies = vec![
            Reply::Error { errno: 22, message: "bad".into() },
            Reply::Ok,
            Reply::Hello(VnicInfo { name: "a".into(), tenant: "t".into(), gids: vec![[1; 16]], limits: Limits::default(), node_guid: 5 }),
            Reply::Handle { handle: 4 },
            Reply::Mr { lkey: 1, rkey: 2 },
            Reply::Cq { cq: 3 },
            Reply::Srq { srq: 1, entries: 2, max_sge: 3 },
            Reply::Qp { qpn: 1, rq_entries: 2, max_recv_sge: 3, comp_entries: 4 },
            Reply::Connected(PeerInfo { qpn: 9, rq_ring: Some((4, 1)), comp_entries: 4, srq_ring: None }),
            Reply::PeerMr { addr: 1, length: 2, access: 3, chunks: vec![] },
            Reply::Bytes { data: vec![9; 100] },
            Reply::Atomic { old: 77 },
            Reply::ConnectedMediated { sq_entries: 1, max_sge: 2, max_inline: 3, comp_entries: 4 },
            Reply::UdRemote,
            Reply::Usage(Usage { clients: 1, pds: 2, cqs: 3, qps: 4, mrs: 5, mr_bytes: 6, srqs: 7 }),
        ];
        for r in replies {
            assert_eq!(Reply::decode(&r.encode(7)).unwrap(), (7, r));
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        for r in all_requests() {
            let bytes = r.encode(1);
            for cut in 0..bytes.len() {
                assert!(Request::decode(&bytes[..cut]).is_err(), "{r:?} cut at {cut}");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(Request::decode(&longer).is_err());
        }
    }

    #[test]
    fn header_is_checked() {
        let mut b = Request::AllocPd.encode(1);
        b[0] ^= 1;
        assert!(matches!(Request::decode(&b), Err(DecodeError::BadMagic { .. })));
        let mut b = Request::AllocPd.encode(1);
        b[4] = 9;
        assert!(matches!(Request::decode(&b), Err(DecodeError::BadVersion { .. })));
        let mut b = Request::AllocPd.encode(1);
        b[6] = 0x77;
        assert!(matches!(Request::decode(&b), Err(DecodeError::UnknownOp { .. })));
        let mut huge = Request::AllocPd.encode(1);
        huge.resize(MAX_MESSAGE + 1, 0);
        assert!(matches!(Request::decode(&huge), Err(DecodeError::TooLong { .. })));
        let w = {
            let mut w = Writer::default();
            w.u32(1).u64(0).u64(0).u32(0).u16(65535);
            w
        };
        assert!(matches!(Request::decode(&frame(op::REG_MR, 1, w)), Err(DecodeError::TooMany { .. })));
    }
}
