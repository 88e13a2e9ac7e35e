//! A session's staging buffer for staged direct copies (`CopyStaging`, docs/architecture.md
//! "Direct copies"): a READ of a peer's copied MR into the requester's own memory registered
//! in place goes into this buffer, which the requester maps read-only and copies from
//! itself, instead of vrdmad writing the requester's memory through `/proc/PID/mem` (a page
//! at a time through a kernel page; writes cannot go by PID, docs/security.md).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use vrdma_abi::control::{Reply, MAX_DIRECT_COPY};
use vrdma_abi::shm::{self, SharedMapping};

use super::{Registry, ReplyFds, RequestError};

/// Bytes of a session's staging buffer, charged to its vNIC's queue memory (its pages exist
/// only once written).
pub(super) const STAGING_BYTES: u64 = MAX_DIRECT_COPY as u64;

/// The buffer: the sealed memfd the client maps, and vrdmad's writable mapping of it.
pub(super) struct Staging {
    fd: Arc<OwnedFd>,
    pub(super) mapping: Arc<SharedMapping>,
}

impl Registry {
    /// `CopyStaging`: the session's staging buffer, made (and charged) at the first ask.
    pub(super) fn copy_staging(&mut self, session: u64) -> Result<(Reply, ReplyFds), RequestError> {
        if let Some(s) = &self.session(session)?.staging {
            return Ok((Reply::Ok, vec![s.fd.clone()]));
        }
        let vnic = self.session(session)?.vnic.clone();
        let v = self.vnics.get_mut(&vnic).ok_or(RequestError::VnicDeleted)?;
        v.charge_ring(STAGING_BYTES)?;
        let made = shm::create_memfd("vrdma-copy-staging", STAGING_BYTES as usize, true)
            .and_then(|fd| SharedMapping::map_sealed(fd.as_fd(), STAGING_BYTES as usize, true).map(|m| (fd, m)));
        let (fd, mapping) = match made {
            Ok(m) => m,
            Err(e) => {
                v.uncharge_ring(STAGING_BYTES);
                return Err(RequestError::QueueMemory(e));
            }
        };
        let staging = Staging { fd: Arc::new(fd), mapping: Arc::new(mapping) };
        let fd = staging.fd.clone();
        self.session(session)?.staging = Some(staging);
        Ok((Reply::Ok, vec![fd]))
    }

    /// `session`'s staging buffer, if it asked for one.
    pub(super) fn staging_of(&self, session: u64) -> Option<Arc<SharedMapping>> {
        self.sessions.get(&session)?.staging.as_ref().map(|s| s.mapping.clone())
    }
}
