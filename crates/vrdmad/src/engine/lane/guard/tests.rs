//! The guard confines lane sockets as it says (where the kernel lets it be set up).

use super::*;

fn guard(test: &str) -> Option<LaneGuard> {
    match LaneGuard::start() {
        Ok(g) => Some(g),
        // Only where the kernel or our privileges lack what it needs.
        Err(e) if e.unsupported() => {
            vrdma_test_support::skip(test, format_args!("no lane guard here: {e}"));
            None
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn a_guarded_socket_connects_once_and_never_listens() {
    let Some(g) = guard("a_guarded_socket_connects_once_and_never_listens") else { return };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let s = g.connect(addr, Duration::from_secs(2)).unwrap();
    let (mut a, peer) = l.accept().unwrap();
    assert_eq!(peer, s.local_addr().unwrap());
    (&s).write_all(b"lane").unwrap();
    let mut b = [0u8; 4];
    a.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"lane");
    // What a container holding it could try: disconnect, then connect anywhere.
    disconnect(s.as_raw_fd());
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let e = raw_connect(s.as_raw_fd(), &other.local_addr().unwrap()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    // Nor can it take a port of the host's (a service's, before it starts).
    let free = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let e = raw_bind(s.as_raw_fd(), &free).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    // (The same on an ordinary socket goes through: the refusals above are the guard's.)
    let plain = TcpStream::connect(addr).unwrap();
    let _ = l.accept().unwrap();
    disconnect(plain.as_raw_fd());
    raw_connect(plain.as_raw_fd(), &other.local_addr().unwrap()).unwrap();
    let _ = other.accept().unwrap();
    TcpListener::bind(free).unwrap();
    // Guarded sockets made later are confined just the same, and one socket's arming
    // does not leak to another.
    let s2 = g.connect(addr, Duration::from_secs(2)).unwrap();
    let _ = l.accept().unwrap();
    disconnect(s2.as_raw_fd());
    let e = raw_connect(s2.as_raw_fd(), &addr).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    // Nor by TCP Fast Open (sendto with MSG_FASTOPEN connects too).
    let (ss, len) = sockaddr(&other.local_addr().unwrap());
    // SAFETY: one byte from a live buffer to a valid address of `len` bytes.
    let r = unsafe {
        libc::sendto(s2.as_raw_fd(), b"x".as_ptr().cast(), 1, libc::MSG_FASTOPEN, (&ss as *const libc::sockaddr_storage).cast(), len)
    };
    assert!(r < 0, "a Fast Open send from a guarded socket went out");
    other.set_nonblocking(true).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(other.accept().is_err(), "a guarded socket reached another listener");
    // Listening: accepted by the socket layer, but no handshake completes.
    // SAFETY: listen on a socket we hold.
    assert_eq!(unsafe { libc::listen(s2.as_raw_fd(), 1) }, 0);
    let r = TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], s2.local_addr().unwrap().port())), Duration::from_millis(300));
    assert!(r.is_err(), "a connection to the guarded listener was accepted");
    // The confinement outlives the guard (a daemon that exits, its helper and cgroup gone).
    let s3 = g.connect(addr, Duration::from_secs(2)).unwrap();
    let _ = l.accept().unwrap();
    drop(g);
    disconnect(s3.as_raw_fd());
    let e = raw_connect(s3.as_raw_fd(), &other.local_addr().unwrap()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
}

#[test]
fn the_helper_removes_its_cgroup_when_the_daemon_is_gone() {
    let Some(g) = guard("the_helper_removes_its_cgroup_when_the_daemon_is_gone") else { return };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let s = g.connect(l.local_addr().unwrap(), Duration::from_secs(2)).unwrap();
    let _ = l.accept().unwrap();
    assert!(g.cgroup.exists());
    // The daemon's end of the pair closing, as when it is killed (Drop does not run).
    g.helper.lock().shutdown(std::net::Shutdown::Both).unwrap();
    let gone = (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        !g.cgroup.exists()
    });
    assert!(gone, "{} is still there", g.cgroup.display());
    // Its lane stays confined.
    disconnect(s.as_raw_fd());
    let e = raw_connect(s.as_raw_fd(), &l.local_addr().unwrap()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
}

#[test]
fn ipv6_lanes_are_confined_too() {
    let Some(g) = guard("ipv6_lanes_are_confined_too") else { return };
    let Ok(l) = TcpListener::bind("[::1]:0") else {
        vrdma_test_support::skip("ipv6_lanes_are_confined_too", "no IPv6 loopback here");
        return;
    };
    let addr = l.local_addr().unwrap();
    let s = g.connect(addr, Duration::from_secs(2)).unwrap();
    let _ = l.accept().unwrap();
    disconnect(s.as_raw_fd());
    let other = TcpListener::bind("[::1]:0").unwrap();
    let e = raw_connect(s.as_raw_fd(), &other.local_addr().unwrap()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    // (An IPv4 address in IPv6 form goes through the IPv6 hook.)
    let v4 = TcpListener::bind("127.0.0.1:0").unwrap();
    let mapped = SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped().into(), v4.local_addr().unwrap().port());
    let e = raw_connect(s.as_raw_fd(), &mapped).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
}

#[test]
fn a_refused_connect_leaves_nothing_armed() {
    let Some(g) = guard("a_refused_connect_leaves_nothing_armed") else { return };
    // A port with no listener: refused (asynchronously: the hook has taken the cookie by
    // then; the daemon's disarm finds nothing).
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    assert!(g.connect(addr, Duration::from_secs(2)).is_err());
    // Many lanes: the armed map never fills (each is emptied after its connect).
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    for _ in 0..(ARMED_MAX + 10) {
        let s = g.connect(l.local_addr().unwrap(), Duration::from_secs(2)).unwrap();
        drop(l.accept().unwrap());
        drop(s);
    }
}
