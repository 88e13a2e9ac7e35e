//! The control protocol without the library's checks: for tests that play a hostile peer
//! (one that asks vrdmad for what the library would never ask, and maps the descriptors it
//! gets however it likes). Not part of the verbs API.

use std::os::fd::{OwnedFd, RawFd};

use vrdma_abi::control::{Reply, Request};

use crate::device::Context;
use crate::error::Error;

impl Context {
    /// Sends `req` (with `fds`) on this context's control socket and returns vrdmad's reply
    /// and the descriptors that came with it; an error reply becomes [`Error::Refused`].
    #[doc(hidden)]
    pub fn raw_control(&self, req: &Request, fds: &[RawFd]) -> Result<(Reply, Vec<OwnedFd>), Error> {
        self.inner.ctl.call("raw control request", req, fds)
    }
}
