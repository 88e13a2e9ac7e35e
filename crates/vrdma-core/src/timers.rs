//! IB timer encodings.

use std::time::Duration;

/// RNR NAK timer of `min_rnr_timer` (IB spec table 45), in microseconds.
pub fn rnr_timer(code: u8) -> Duration {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120, 7_680, 10_240, 15_360,
        20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(u64::from(US[(code & 31) as usize]))
}

/// Local ACK timeout of `timeout` (4.096 µs × 2^timeout; 0 means infinite → None).
pub fn ack_timeout(code: u8) -> Option<Duration> {
    if code == 0 {
        return None;
    }
    Some(Duration::from_nanos(4096u64 << code.min(31)))
}

/// How long a requester retries an unanswered request before RETRY_EXC_ERR: the local ACK
/// timeout × (`retry_cnt` + 1) (None: forever, timeout 0).
pub fn retry_limit(timeout: u8, retry_cnt: u8) -> Option<Duration> {
    ack_timeout(timeout).map(|t| t * (u32::from(retry_cnt) + 1))
}

/// `rnr_retry` of 7 means retry forever.
pub const RNR_RETRY_INFINITE: u8 = 7;

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn encodings() {
        assert_eq!(rnr_timer(0), Duration::from_micros(655_360));
        assert_eq!(rnr_timer(1), Duration::from_micros(10));
        assert_eq!(rnr_timer(12), Duration::from_micros(640));
        assert_eq!(rnr_timer(31), Duration::from_micros(491_520));
        assert_eq!(ack_timeout(0), None);
        assert_eq!(ack_timeout(14), Some(Duration::from_nanos(4096 << 14)));
        assert_eq!(retry_limit(0, 7), None);
        assert_eq!(retry_limit(10, 2), Some(Duration::from_nanos(3 * (4096 << 10))));
    }
}
