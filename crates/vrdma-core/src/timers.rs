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

/// The longest a requester's wait between resends of one request grows to while the responder
/// answers it RNR again and again (unless the responder's timer is longer still).
pub const RNR_BACKOFF_CAP: Duration = Duration::from_millis(1);

/// How long a requester waits before resending a request the responder has answered RNR
/// `tries` times in a row (1: the first answer): the responder's timer at first, doubling with
/// every repeat up to [`RNR_BACKOFF_CAP`] (or the timer itself, when that is longer). The
/// timer is the least a requester must wait, not the most; backing off keeps a peer that
/// never posts receives (an RNR storm, 10 µs timers on many QPs) from costing both hosts a
/// resend and a NAK per QP every few microseconds, while a responder that is only briefly
/// short of receives is retried nearly as soon as its timer allows.
pub fn rnr_wait(code: u8, tries: u32) -> Duration {
    let timer = rnr_timer(code);
    let doubled = timer.saturating_mul(1u32 << tries.saturating_sub(1).min(16));
    doubled.min(timer.max(RNR_BACKOFF_CAP))
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

    #[test]
    fn rnr_waits_double_up_to_the_cap_or_the_timer() {
        let us = |v| Duration::from_micros(v);
        let waits: Vec<_> = (1..=9).map(|t| rnr_wait(1, t)).collect();
        assert_eq!(waits, [us(10), us(20), us(40), us(80), us(160), us(320), us(640), us(1000), us(1000)]);
        // Tries counted from 0 or absurdly high still give a wait within the bounds.
        assert_eq!(rnr_wait(1, 0), us(10));
        assert_eq!(rnr_wait(1, u32::MAX), RNR_BACKOFF_CAP);
        // A timer above the cap is kept as it is: never waiting less than the responder asked.
        assert_eq!(rnr_wait(12, 1), us(640));
        assert_eq!(rnr_wait(12, 3), us(1000));
        assert_eq!(rnr_wait(14, 1), us(1280));
        assert_eq!(rnr_wait(14, 5), us(1280));
        assert_eq!(rnr_wait(0, 30), rnr_timer(0));
    }
}
