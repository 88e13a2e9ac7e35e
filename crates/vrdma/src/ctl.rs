//! The client side of the control channel: one request, one reply, in order.

use std::os::fd::{OwnedFd, RawFd};
use std::path::Path;

use parking_lot::Mutex;
use vrdma_abi::channel::Channel;
use vrdma_abi::control::{Reply, Request};

use crate::error::Error;

pub(crate) struct Control {
    ch: Mutex<(Channel, u32)>,
}

impl Control {
    pub(crate) fn connect(path: &Path) -> Result<Control, Error> {
        Ok(Control { ch: Mutex::new((Channel::connect(path).map_err(Error::Connect)?, 0)) })
    }

    /// The socket's descriptor (for watching it hang up; never read or written outside
    /// `call`).
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.ch.lock().0.as_raw_fd()
    }

    /// Sends `req` (with `fds`) and returns the reply and its fds; an error reply becomes
    /// [`Error::Refused`].
    pub(crate) fn call(&self, op: &'static str, req: &Request, fds: &[RawFd]) -> Result<(Reply, Vec<OwnedFd>), Error> {
        let mut g = self.ch.lock();
        g.1 = g.1.wrapping_add(1);
        let seq = g.1;
        g.0.send(&req.encode(seq), fds).map_err(Error::Channel)?;
        let (msg, rfds) = g.0.recv().map_err(Error::Channel)?;
        let (rseq, reply) = Reply::decode(&msg).map_err(Error::Protocol)?;
        if rseq != seq {
            return Err(Error::UnexpectedReply { op });
        }
        match reply {
            Reply::Error { errno, message } => Err(Error::Refused { op, errno, message }),
            r => Ok((r, rfds)),
        }
    }
}
