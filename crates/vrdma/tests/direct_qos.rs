//! Caps on the direct path (issue 29, point 3), against an in-process vrdmad: the library
//! holds a capped vNIC's QP to its cap and follows a change within a second; a library that
//! ignores its cap (the `test-ignore-cap` build, `Qp::ignore_caps_for_test`) is caught
//! within 2 s, moved onto the engine with nothing lost, repeated or reordered, and held to
//! the cap there. Every message is a SEND of a pattern its sequence number fixes, checked
//! byte for byte where it lands.

mod common;
use common::*;
use vrdma::*;

use std::time::{Duration, Instant};

/// Bytes per message.
const MSG: usize = 16 << 10;
/// Messages in flight (send slots on one side, receive slots on the other).
const SLOTS: usize = 128;
/// The cap under test: low enough that the engine of a debug build keeps up with it.
const CAP: u64 = 20_000_000;

/// The cases measure rates: one at a time (the cheat floods memory at full speed, and the
/// machine may have 2 CPUs).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Side {
    _ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    buf: MrBuf,
}

fn side(sock: &std::path::Path) -> Side {
    let ctx = Context::open(sock).expect("open");
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(4 * SLOTS as u32, None).expect("cq");
    let caps = QpCaps { max_send_wr: SLOTS as u32, max_recv_wr: SLOTS as u32, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq, caps)).expect("qp");
    let buf = MrBuf::new(&pd, SLOTS * MSG, ALL).expect("mr");
    Side { _ctx: ctx, _pd: pd, cq, qp, buf }
}

/// The bytes of message `seq`: its number, then a byte it fixes.
fn pattern(seq: u64) -> Vec<u8> {
    let mut v = vec![(seq.wrapping_mul(31).wrapping_add(7)) as u8; MSG];
    v[..8].copy_from_slice(&seq.to_le_bytes());
    v
}

/// A stream of SENDs from `a` to `b`, one thread driving both ends.
struct Flow {
    a: Side,
    b: Side,
    posted: u64,
    sent: u64,
    received: u64,
    /// Whether `run` posts more.
    posting: bool,
}

impl Flow {
    fn new(host: &Host, sa: &std::path::Path, sb: &std::path::Path) -> Flow {
        let (a, b) = (side(sa), side(sb));
        a.qp.connect_rc(b._ctx.gids()[0], b.qp.qp_num(), ALL).unwrap();
        b.qp.connect_rc(a._ctx.gids()[0], a.qp.qp_num(), ALL).unwrap();
        assert!(!a.qp.is_mediated() && !b.qp.is_mediated(), "direct path on {:?}", host.mode);
        for slot in 0..SLOTS {
            b.qp.post_recv(&RecvWr { wr_id: slot as u64, sg_list: &[b.buf.sge(slot * MSG, MSG as u32)] }).unwrap();
        }
        Flow { a, b, posted: 0, sent: 0, received: 0, posting: true }
    }

    /// Runs the stream for `d` (or until `stop` says so); the payload bytes whose sends
    /// completed meanwhile.
    fn run(&mut self, d: Duration, mut stop: impl FnMut(&Flow) -> bool) -> u64 {
        let (start, sent_before) = (Instant::now(), self.sent);
        let mut wc = [Wc::EMPTY; SLOTS];
        let mut got = vec![0u8; MSG];
        while start.elapsed() < d && !stop(self) {
            while self.posting && self.posted - self.sent < SLOTS as u64 {
                let slot = (self.posted % SLOTS as u64) as usize;
                self.a.buf.write(slot * MSG, &pattern(self.posted));
                let sg = [self.a.buf.sge(slot * MSG, MSG as u32)];
                self.a.qp.post_send(&SendWr::new(self.posted, WrOpcode::Send, &sg, send_flags::SIGNALED)).unwrap();
                self.posted += 1;
            }
            let n = self.a.cq.poll(&mut wc);
            for c in &wc[..n] {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                assert_eq!(c.wr_id, self.sent, "send completions in order, each once");
                self.sent += 1;
            }
            let n = self.b.cq.poll(&mut wc);
            for c in &wc[..n] {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                assert_eq!(c.byte_len as usize, MSG);
                let slot = c.wr_id as usize;
                assert_eq!(slot, (self.received % SLOTS as u64) as usize, "receives in order");
                self.b.buf.read(slot * MSG, &mut got);
                assert!(got == pattern(self.received), "message {} arrived intact", self.received);
                self.received += 1;
                self.b.qp.post_recv(&RecvWr { wr_id: slot as u64, sg_list: &[self.b.buf.sge(slot * MSG, MSG as u32)] }).unwrap();
            }
            std::thread::yield_now();
        }
        (self.sent - sent_before) * MSG as u64
    }

    /// Stops posting and waits for every message to land: none lost, none twice.
    fn drain(&mut self) {
        self.posting = false;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.sent < self.posted || self.received < self.posted {
            assert!(Instant::now() < deadline, "drained {} sent, {} received of {}", self.sent, self.received, self.posted);
            self.run(Duration::from_millis(10), |_| false);
        }
        assert_eq!((self.sent, self.received), (self.posted, self.posted));
    }
}

/// Bytes/s of `bytes` over `d`.
fn rate(bytes: u64, d: Duration) -> u64 {
    (bytes as f64 / d.as_secs_f64()) as u64
}

fn assert_near(what: &str, got: u64, want: u64) {
    eprintln!("{what}: {got} bytes/s (cap {want})");
    let (lo, hi) = (want * 9 / 10, want * 11 / 10);
    assert!((lo..=hi).contains(&got), "{what}: {got} bytes/s, want {want} ± 10%");
}

#[test]
fn a_capped_vnic_is_held_to_its_cap_and_follows_a_change() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let host = Host::new(Mode::Direct, "qos-cap");
    let (sa, sb) = (host.vnic("qa", "t"), host.vnic("qb", "t"));
    host.daemon.apply_vnic_qos("qa", Qos { max_bw: CAP, ..Qos::default() }).unwrap();
    let mut f = Flow::new(&host, &sa, &sb);
    assert!(f.a.qp.is_capped() && !f.b.qp.is_capped());
    f.run(Duration::from_millis(300), |_| false);
    let d = Duration::from_millis(1500);
    assert_near("capped", rate(f.run(d, |_| false), d), CAP);
    // Doubled while running: within a second it runs at the new cap.
    host.daemon.apply_vnic_qos("qa", Qos { max_bw: 2 * CAP, ..Qos::default() }).unwrap();
    f.run(Duration::from_millis(200), |_| false);
    let d = Duration::from_millis(800);
    assert_near("within 1 s of the change", rate(f.run(d, |_| false), d), 2 * CAP);
    // And back down, with a message-rate cap instead (half the messages of the byte cap).
    let wrs = CAP / MSG as u64 / 2;
    host.daemon.apply_vnic_qos("qa", Qos { max_msg_rate: wrs, ..Qos::default() }).unwrap();
    f.run(Duration::from_millis(200), |_| false);
    let d = Duration::from_secs(1);
    assert_near("message-rate cap", rate(f.run(d, |_| false), d), wrs * MSG as u64);
    f.drain();
    assert!(!f.a.qp.is_mediated(), "an obedient library stays on the direct path");
    assert!(!host.daemon.is_demoted("qa"));
    let st = host.daemon.status();
    assert_eq!(st.iter().find(|s| s.record.name == "qa").unwrap().counters.demotions, 0);
}

#[test]
fn a_library_ignoring_its_cap_is_moved_to_the_engine_and_held_there() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let host = Host::new(Mode::Direct, "qos-cheat");
    let (sa, sb) = (host.vnic("qa", "t"), host.vnic("qb", "t"));
    host.daemon.apply_vnic_qos("qa", Qos { max_bw: CAP, ..Qos::default() }).unwrap();
    let mut f = Flow::new(&host, &sa, &sb);
    f.a.qp.ignore_caps_for_test();
    let start = Instant::now();
    let cheated = f.run(Duration::from_secs(2), |f| f.a.qp.is_mediated());
    let caught_after = start.elapsed();
    assert!(f.a.qp.is_mediated(), "still direct after {caught_after:?} ({} bytes/s)", rate(cheated, caught_after));
    assert!(caught_after < Duration::from_secs(2), "{caught_after:?}");
    assert!(rate(cheated, caught_after) > CAP * 11 / 10, "it did go over its cap");
    assert!(host.daemon.is_demoted("qa"));
    let st = host.daemon.status();
    assert_eq!(st.iter().find(|s| s.record.name == "qa").unwrap().counters.demotions, 1);
    // On the engine: held to the cap whatever its library does.
    f.run(Duration::from_millis(300), |_| false);
    let d = Duration::from_millis(2000);
    assert_near("held by the engine", rate(f.run(d, |_| false), d), CAP);
    f.drain();
    eprintln!("caught after {caught_after:?}, {} messages checked", f.received);
}
