//! When an MR reached through its owner's memory (registered in place) is worth moving onto
//! memfds, which peers and the engine then map: once the accesses through the owner's memory
//! come to twice the MR's length. Moving costs about one copy of the MR there and one back
//! at deregistration: a buffer used once (a rendezvous on a fresh buffer) is cheaper copied,
//! one used again and again cheaper mapped, and waiting for the second use never pays more
//! than twice the better of the two. The registry counts the direct path's copy requests,
//! the engine its own accesses across hosts, each by this rule.

/// What one access costs beyond its bytes (a round trip to vrdmad or a hand-off to the
/// owner's agent, and a system call on the owner's memory, ~20-60 us), in bytes a copy moves
/// in that time: small accesses to a large MR (a latency test's) pay mostly the access, so
/// they bring its move forward.
const ACCESS_WORTH: u64 = 32 * 1024;

/// What an access of `len` bytes counts for.
pub fn counted(len: u64) -> u64 {
    len.max(ACCESS_WORTH)
}

/// Whether an MR of `length` bytes through which `copied` bytes were counted is worth moving.
pub fn worth_sharing(copied: u64, length: u64) -> bool {
    copied >= length.saturating_mul(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_accesses_count_as_the_access_costs() {
        assert_eq!(counted(8), ACCESS_WORTH);
        assert_eq!(counted(1 << 20), 1 << 20);
        // An 8 KiB MR read 8 bytes at a time is worth moving at the first access, a 1 MiB one
        // after 64 accesses of 8 bytes or two of its length.
        assert!(worth_sharing(counted(8), 8192));
        assert!(!worth_sharing(63 * counted(8), 1 << 20));
        assert!(worth_sharing(64 * counted(8), 1 << 20));
        assert!(worth_sharing(2 * counted(1 << 20), 1 << 20));
        assert!(!worth_sharing(u64::MAX - 1, u64::MAX));
    }
}
