//! Memory-region bounds and access checks, mapped to completion statuses.

use vrdma_abi::verbs::{access, WcStatus};

/// What a region grants: its virtual range and access flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrBounds {
    /// First byte address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u64,
    /// `ibv_access_flags`.
    pub access: u32,
}

/// The kind of access a work request makes to a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Local gather (send source): any MR.
    LocalRead,
    /// Local scatter (receive buffer, READ/atomic result): LOCAL_WRITE.
    LocalWrite,
    /// Remote RDMA WRITE target: REMOTE_WRITE.
    RemoteWrite,
    /// Remote RDMA READ source: REMOTE_READ.
    RemoteRead,
    /// Remote atomic target: REMOTE_ATOMIC.
    RemoteAtomic,
}

impl Need {
    #[inline]
    fn flag(self) -> u32 {
        match self {
            Need::LocalRead => 0,
            Need::LocalWrite => access::LOCAL_WRITE,
            Need::RemoteWrite => access::REMOTE_WRITE,
            Need::RemoteRead => access::REMOTE_READ,
            Need::RemoteAtomic => access::REMOTE_ATOMIC,
        }
    }

    /// The status a failed check completes with.
    #[inline]
    pub fn failure(self) -> WcStatus {
        match self {
            Need::LocalRead | Need::LocalWrite => WcStatus::LocProtErr,
            _ => WcStatus::RemAccessErr,
        }
    }
}

/// Checks that `[addr, addr+len)` lies in `mr` and that `mr` grants `need`; returns the
/// offset of `addr` within the region.
#[inline]
pub fn check(mr: &MrBounds, addr: u64, len: u64, need: Need) -> Result<u64, WcStatus> {
    if mr.access & need.flag() != need.flag() {
        return Err(need.failure());
    }
    let end = addr.checked_add(len).ok_or(need.failure())?;
    let mr_end = mr.addr.checked_add(mr.length).ok_or(need.failure())?;
    if addr < mr.addr || end > mr_end {
        return Err(need.failure());
    }
    Ok(addr - mr.addr)
}

/// Validates `ibv_reg_mr` access flags: remote write or atomic require local write (IB spec).
pub fn valid_reg_access(flags: u32) -> bool {
    let needs_local = access::REMOTE_WRITE | access::REMOTE_ATOMIC;
    flags & needs_local == 0 || flags & access::LOCAL_WRITE != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const MR: MrBounds = MrBounds { addr: 1000, length: 100, access: access::LOCAL_WRITE | access::REMOTE_READ };

    #[test]
    fn bounds() {
        assert_eq!(check(&MR, 1000, 100, Need::RemoteRead), Ok(0));
        assert_eq!(check(&MR, 1050, 0, Need::LocalRead), Ok(50));
        assert_eq!(check(&MR, 999, 1, Need::RemoteRead), Err(WcStatus::RemAccessErr));
        assert_eq!(check(&MR, 1001, 100, Need::RemoteRead), Err(WcStatus::RemAccessErr));
        assert_eq!(check(&MR, 1001, 100, Need::LocalWrite), Err(WcStatus::LocProtErr));
        assert_eq!(check(&MR, u64::MAX, 2, Need::LocalRead), Err(WcStatus::LocProtErr));
    }

    #[test]
    fn flags() {
        assert_eq!(check(&MR, 1000, 8, Need::RemoteWrite), Err(WcStatus::RemAccessErr));
        assert_eq!(check(&MR, 1000, 8, Need::RemoteAtomic), Err(WcStatus::RemAccessErr));
        assert_eq!(check(&MR, 1000, 8, Need::LocalWrite), Ok(0));
        let ro = MrBounds { access: 0, ..MR };
        assert_eq!(check(&ro, 1000, 8, Need::LocalWrite), Err(WcStatus::LocProtErr));
        assert!(!valid_reg_access(access::REMOTE_WRITE));
        assert!(valid_reg_access(access::REMOTE_WRITE | access::LOCAL_WRITE));
        assert!(valid_reg_access(access::REMOTE_READ));
    }
}
