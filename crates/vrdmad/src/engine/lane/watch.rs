//! Watching our end of a lane: it carries nothing back, so anything on it is its end.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::engine::connection::Conn;
use crate::engine::reader::LaneEnd;
use crate::engine::Engine;

/// Waits for the end of our QP `qpn`'s lane (poll(2), which no socket option or file flag
/// the client sets changes; nothing is read). When the peer closes it, or sends anything on
/// it, that QP goes to ERR. Ends when the lane is shut down (the QP destroyed, reset or
/// failed).
pub(crate) fn watch_lane(engine: Weak<Engine>, c: Arc<Conn>, qpn: u32) {
    let fd = c.raw_fd();
    let why = loop {
        let mut p = libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
        // SAFETY: one valid pollfd, live for the call.
        let n = unsafe { libc::poll(&mut p, 1, -1) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break LaneEnd::from(err);
        }
        if p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLRDHUP | libc::POLLNVAL) != 0 || !c.is_alive() {
            break LaneEnd::Closed;
        }
        if p.revents & libc::POLLIN != 0 {
            let mut b = [0u8; 1];
            // SAFETY: reads at most one byte into `b`, without waiting.
            let r = unsafe { libc::recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
            match r {
                0 => break LaneEnd::ClosedByPeer,
                1.. => break LaneEnd::DataFromPeer,
                _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock => {
                    // (Someone else took it: the client. Nothing is ours to read here.)
                    std::thread::sleep(Duration::from_millis(1));
                }
                _ => break LaneEnd::from(std::io::Error::last_os_error()),
            }
        }
    };
    c.shutdown();
    if let Some(e) = engine.upgrade() {
        if !e.stopping.load(Ordering::Acquire) {
            e.lane_failed(qpn, &c, &why);
        }
    }
}
