//! The first frame of every connection: HELLO (host name, listening address, boot id), or
//! LANE for a lane.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::Duration;

use vrdma_abi::wire::{self, FrameHeader, Kind};

use super::connection::seal::FrameKeys;
use super::connection::{Conn, PeerRx};
use super::link::LinkError;
use super::peer_tls::PeerCert;
use super::Engine;

/// What the TLS handshake established about a peer (nothing, without TLS).
pub(crate) enum Verified<'a> {
    /// No TLS.
    Nothing,
    /// Inbound: the certificate it presented (chained to the CA).
    Cert(&'a PeerCert),
    /// Outbound: the host its certificate was verified to name.
    Host(&'a str),
}

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
    let (host, addr) = parse_first(&data).map_err(bad)?;
    Ok((h, host, addr, h.arg1))
}

/// The host name and listening address a first frame's data (`HOST\nADDR`) claims; the name
/// must be one a host record could have.
pub(crate) fn parse_first(data: &[u8]) -> Result<(String, SocketAddr), &'static str> {
    let text = wire::text(data);
    let (host, addr) = text.split_once('\n').ok_or("malformed HELLO")?;
    if !crate::store::valid_record_name(host) {
        return Err("malformed host name in HELLO");
    }
    let addr: SocketAddr = addr.parse().map_err(|_| "malformed address in HELLO")?;
    Ok((host.to_string(), addr))
}

/// The fuzzer's entry point (`fuzz/fuzz_targets/first_frame.rs`): `data` as a peer's first
/// frame (a 64-byte header, then its data), decoded as an accepting daemon decodes it, and
/// the identity it claims judged against a fixed cluster view of two hosts. Panics if a
/// claimed identity is accepted that the view does not have at the claimed address.
pub fn fuzz_first_frame(data: &[u8]) {
    use crate::registry::ClusterView;
    use crate::store::HostRecord;
    let Some((head, rest)) = data.split_first_chunk::<{ wire::HEADER_LEN }>() else { return };
    let Ok(h) = FrameHeader::decode(head) else { return };
    if !matches!(h.kind, Kind::Hello | Kind::Lane) {
        return;
    }
    let Ok((host, addr)) = parse_first(&rest[..rest.len().min(h.data_len as usize)]) else { return };
    assert!(crate::store::valid_record_name(&host), "{host:?}");
    let mut view = ClusterView { local_host: "h1".into(), ..Default::default() };
    for (name, last) in [("h1", 11), ("h2", 12)] {
        let a = std::net::Ipv4Addr::new(198, 19, 0, last);
        view.hosts.insert(name.into(), HostRecord { name: name.into(), transport_addr: SocketAddr::from((a, 4791)), underlay_ip: a });
    }
    if view.check_peer_host(&host, addr).is_ok() {
        assert_eq!(view.hosts.get(&host).map(|h| h.transport_addr), Some(addr), "{host} accepted at {addr}");
    }
}

/// The address itself: an IPv4-mapped IPv6 address as the IPv4 one.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Whether the peer on `c` may be who its first frame says: host `host`, listening at
/// `claimed`. The address must be the connection's own (a daemon reaches its peers from the
/// address it listens on, so one cannot claim another's: their answers, PEER_GONE notices,
/// lanes and failures are all keyed by that address), and the cluster view must have that
/// host there. A refusal is counted ([`Engine::refused_peers`]) and logged with both addresses.
pub(crate) fn check_peer(e: &Engine, c: &Conn, host: &str, claimed: SocketAddr, verified: Verified<'_>) -> Result<(), LinkError> {
    let tls = e.cfg.tls.is_some();
    let why = if canonical(claimed.ip()) != canonical(c.peer.ip()) {
        Some("it claims another address than its own".to_string())
    } else {
        match verified {
            Verified::Nothing if tls => Some("no certificate".to_string()),
            Verified::Cert(cert) if !cert.names(host) => Some("its certificate is for another host".to_string()),
            Verified::Host(name) if name != host => Some(format!("its certificate is for host {name}")),
            _ => None,
        }
    };
    let why = why.or_else(|| e.broker().and_then(|b| b.check_peer_host(host, claimed).err()));
    let Some(why) = why else { return Ok(()) };
    let n = e.refused_peers.fetch_add(1, Ordering::Relaxed) + 1;
    // (Every refusal up to 64, then at powers of two: a flood does not flood the log.)
    if n <= 64 || n.is_power_of_two() {
        let host: String = host.chars().take(64).collect();
        log::warn!("engine: refused peer at {} claiming host {host:?} at {claimed}: {why} ({n} refused so far)", c.peer);
    }
    Err(LinkError::Impostor { addr: c.peer, claimed })
}

/// The server's TLS handshake on an accepted connection from `from`, when TLS is on: the
/// peer's certificate, and the keys that seal what follows. A failed handshake is counted
/// and logged as a refused peer.
pub(crate) fn tls_accept(e: &Engine, s: &std::net::TcpStream, from: SocketAddr) -> Result<Option<(PeerCert, FrameKeys)>, ()> {
    let Some(tls) = &e.cfg.tls else { return Ok(None) };
    tls.accept(s).map(Some).map_err(|err| {
        let n = e.refused_peers.fetch_add(1, Ordering::Relaxed) + 1;
        if n <= 64 || n.is_power_of_two() {
            log::warn!("engine: refused peer at {from}: {err} ({n} refused so far)");
        }
    })
}

/// The client's TLS handshake on a connection to the daemon at `addr`, when TLS is on: the
/// host whose certificate it presented (the one the cluster view has at `addr`), and the
/// keys that seal what follows.
pub(crate) fn tls_connect(e: &Engine, s: &std::net::TcpStream, addr: SocketAddr) -> Result<Option<(String, FrameKeys)>, LinkError> {
    let Some(tls) = &e.cfg.tls else { return Ok(None) };
    let host = e.broker().and_then(|b| b.host_at(addr)).ok_or(LinkError::Hello { addr, reason: "no host of the cluster listens there" })?;
    let keys = tls.connect(s, &host).map_err(|source| LinkError::Tls { addr, source })?;
    Ok(Some((host, keys)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::engine;
    use std::net::TcpStream;

    /// A connection whose HELLO claims another address than the one it comes from is
    /// refused and counted; one that claims its own is taken.
    #[test]
    fn a_hello_claiming_another_address_is_refused_and_counted() {
        let t = engine();
        let s = TcpStream::connect(t.e.local_addr()).unwrap();
        let c = Conn::new(s.try_clone().unwrap(), s.peer_addr().unwrap());
        // (The engine's own address is 127.0.0.1: the peer below is "at" 127.0.0.1 too.)
        let own: SocketAddr = "127.0.0.1:4791".parse().unwrap();
        check_peer(&t.e, &c, "h2", own, Verified::Nothing).unwrap();
        let other: SocketAddr = "198.19.0.12:4791".parse().unwrap();
        let err = check_peer(&t.e, &c, "h2", other, Verified::Nothing).unwrap_err();
        assert!(matches!(err, LinkError::Impostor { claimed, .. } if claimed == other), "{err}");
        assert_eq!(t.e.refused_peers(), 1);
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:1".parse().unwrap();
        check_peer(&t.e, &c, "h2", mapped, Verified::Nothing).unwrap();
    }

    #[test]
    fn first_frames_claim_a_valid_name_and_an_address() {
        assert_eq!(parse_first(b"h2\n198.19.0.12:4791").unwrap(), ("h2".to_string(), "198.19.0.12:4791".parse().unwrap()));
        for bad in [&b"h2"[..], b"../x\n198.19.0.12:4791", b"\n1.2.3.4:1", b"h2\nnowhere", b"h\x002\n1.2.3.4:5"] {
            assert!(parse_first(bad).is_err(), "{bad:?}");
        }
        let frame = |body: &[u8]| {
            let mut h = FrameHeader::new(Kind::Hello);
            h.data_len = body.len() as u32;
            [&h.encode()[..], body].concat()
        };
        fuzz_first_frame(&frame(b"h2\n198.19.0.12:4791"));
        fuzz_first_frame(&frame(b"h2\n198.19.0.11:4791"));
        fuzz_first_frame(&frame(b"\xff\xfe"));
        fuzz_first_frame(b"short");
    }
}
