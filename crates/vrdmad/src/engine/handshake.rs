//! The first frame of every connection: HELLO (host name, listening address, boot id), or
//! LANE for a lane.

use std::net::SocketAddr;
use std::time::Duration;

use vrdma_abi::wire::{self, FrameHeader, Kind};

use super::connection::{Conn, PeerRx};
use super::link::LinkError;
use super::Engine;

pub(crate) fn hello_frame(e: &Engine) -> (FrameHeader, Vec<u8>) {
    let data = format!("{}\n{}", e.cfg.host, e.local_addr()).into_bytes();
    let mut h = FrameHeader::new(Kind::Hello);
    h.arg1 = e.boot_id;
    h.data_len = data.len() as u32;
    (h, data)
}

/// Reads a HELLO: the peer's host name, listening address and boot id.
pub(crate) fn read_hello(c: &Conn) -> Result<(String, SocketAddr, u64), LinkError> {
    let (h, host, addr, boot) = read_first(c)?;
    if h.kind != Kind::Hello {
        return Err(LinkError::Hello { addr: c.peer, reason: "first frame is not HELLO" });
    }
    Ok((host, addr, boot))
}

/// Reads the first frame of a connection, HELLO or LANE: its header, and the peer's host
/// name, listening address and boot id.
pub(crate) fn read_first(c: &Conn) -> Result<(FrameHeader, String, SocketAddr, u64), LinkError> {
    // Nothing heard from this peer yet: a HELLO that does not come within the timeout fails.
    let (h, _) = c.read_header(&PeerRx::new(), Duration::ZERO)?;
    let bad = |reason: &'static str| LinkError::Hello { addr: c.peer, reason };
    if !matches!(h.kind, Kind::Hello | Kind::Lane) {
        return Err(bad("first frame is neither HELLO nor LANE"));
    }
    let mut data = vec![0u8; h.data_len as usize];
    c.read_exact(&mut data).map_err(|source| LinkError::Recv { addr: c.peer, source })?;
    let text = wire::text(&data);
    let (host, addr) = text.split_once('\n').ok_or_else(|| bad("malformed HELLO"))?;
    let addr: SocketAddr = addr.parse().map_err(|_| bad("malformed address in HELLO"))?;
    Ok((h, host.to_string(), addr, h.arg1))
}
