//! RDMA READ and WRITE of memory registered in place (above 64 KiB here), as a rendezvous on
//! a freshly registered buffer makes them: on the direct path vrdmad copies between the
//! peer's memory and the requester's MR itself (`PeerMrCopy`), whether the requester's MR is
//! on shared memory or registered in place too, in pieces of up to 4 MiB. Every byte is
//! checked, and the bytes beside each range must not change. Each case on every data path.

mod common;
use common::*;
use vrdma::*;

/// Private anonymous memory of our own: what malloc hands out for a large block.
struct Anon {
    ptr: *mut u8,
    len: usize,
}

impl Anon {
    fn map(len: usize) -> Anon {
        // SAFETY: a new private anonymous mapping.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        Anon { ptr: p as *mut u8, len }
    }

    // The memory is not the struct's: peers write it too, so `&self` hands out the view.
    #[allow(clippy::mut_from_ref)]
    fn bytes(&self) -> &mut [u8] {
        // SAFETY: the mapping is ours, readable and writable, for `len` bytes; one thread
        // touches it between the peers' accesses.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// Registration leaves ranges above 64 KiB in place (set before the first registration of
/// this process: the library reads it once).
fn in_place_above_64k() {
    std::env::set_var("VRDMA_MR_MOVE_MAX", (64 << 10).to_string());
    // Direct copies are opt-in; this file tests them.
    std::env::set_var("VRDMA_DIRECT_COPY", "1");
}

fn pattern(seed: u8, i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 11) as u8 ^ seed
}

/// Sizes: just above the in-place threshold, odd, one direct copy's worth, and more than
/// one (4 MiB + a page + a tail).
const SIZES: [usize; 4] = [(64 << 10) + 1, (256 << 10) + 13, 1 << 20, (4 << 20) + 4096 + 77];
/// Room before and after each range, checked untouched.
const EDGE: usize = 4096 + 7;

fn post(a: &End, op: WrOpcode, sg: &[Sge], remote_addr: u64, rkey: u32) -> WcStatus {
    let mut w = SendWr::new(1, op, sg, send_flags::SIGNALED);
    w.remote_addr = remote_addr;
    w.rkey = rkey;
    a.qp.post_send(&w).unwrap();
    wait_one(&a.cq).status
}

/// Checks `mem[EDGE..EDGE+n]` holds `want(i)` and the edges `edge(i)`.
fn check_bytes(what: &str, mem: &[u8], n: usize, want: impl Fn(usize) -> u8, edge: impl Fn(usize) -> u8) {
    for (i, x) in mem.iter().enumerate() {
        let exp = if (EDGE..EDGE + n).contains(&i) { want(i - EDGE) } else { edge(i) };
        assert_eq!(*x, exp, "{what}: byte {i} (range {EDGE}..{})", EDGE + n);
    }
}

each_path!(read_and_write_of_in_place_mrs_keep_every_byte);
/// The peer's buffer registered in place; the requester's local buffer registered in place
/// too (vrdmad copies between two processes' memory) and on shared memory (vrdmad copies
/// into its mapping of it), READ then WRITE of each size.
fn read_and_write_of_in_place_mrs_keep_every_byte(mode: Mode) {
    in_place_above_64k();
    let h = Host::new(mode, "dcopy");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    for n in SIZES {
        let total = n + 2 * EDGE;
        let remote = Anon::map(total);
        remote.bytes().iter_mut().enumerate().for_each(|(i, x)| *x = pattern(1, i));
        // SAFETY: `remote` outlives the MR.
        let rmr = unsafe { b.pd.reg_mr(remote.ptr, total, ALL) }.unwrap();
        let raddr = remote.addr() + EDGE as u64;

        // Into (and from) a local buffer registered in place.
        let local = Anon::map(total);
        local.bytes().iter_mut().enumerate().for_each(|(i, x)| *x = pattern(2, i));
        // SAFETY: `local` outlives the MR.
        let lmr = unsafe { a.pd.reg_mr(local.ptr, total, ALL) }.unwrap();
        let sg = [Sge { addr: local.addr() + EDGE as u64, length: n as u32, lkey: lmr.lkey() }];
        assert_eq!(post(&a, WrOpcode::RdmaRead, &sg, raddr, rmr.rkey()), WcStatus::Success, "{mode:?} READ of {n} into in-place");
        check_bytes("READ into in-place", local.bytes(), n, |i| pattern(1, EDGE + i), |i| pattern(2, i));
        local.bytes()[EDGE..EDGE + n].iter_mut().enumerate().for_each(|(i, x)| *x = pattern(3, i));
        assert_eq!(post(&a, WrOpcode::RdmaWrite, &sg, raddr, rmr.rkey()), WcStatus::Success, "{mode:?} WRITE of {n} from in-place");
        check_bytes("WRITE from in-place", remote.bytes(), n, |i| pattern(3, i), |i| pattern(1, i));
        drop(lmr);

        // Into (and from) a local buffer on shared memory (the library's MrBuf).
        let shared = MrBuf::new(&a.pd, total, ALL).unwrap();
        shared.write(0, &(0..total).map(|i| pattern(4, i)).collect::<Vec<_>>());
        let sg = [shared.sge(EDGE, n as u32)];
        assert_eq!(post(&a, WrOpcode::RdmaRead, &sg, raddr, rmr.rkey()), WcStatus::Success, "{mode:?} READ of {n} into shared");
        let mut got = vec![0u8; total];
        shared.read(0, &mut got);
        check_bytes("READ into shared", &got, n, |i| pattern(3, i), |i| pattern(4, i));
        shared.write(EDGE, &(0..n).map(|i| pattern(5, i)).collect::<Vec<_>>());
        assert_eq!(post(&a, WrOpcode::RdmaWrite, &sg, raddr, rmr.rkey()), WcStatus::Success, "{mode:?} WRITE of {n} from shared");
        check_bytes("WRITE from shared", remote.bytes(), n, |i| pattern(5, i), |i| pattern(1, i));
        drop(rmr);
    }
}

each_path!(a_read_scatters_into_several_mrs_and_refusals_hold);
/// A READ scattered over an in-place MR and a shared one fills both in order; beyond the
/// peer's MR, without its rights, or into a local MR without LOCAL_WRITE, nothing moves.
fn a_read_scatters_into_several_mrs_and_refusals_hold(mode: Mode) {
    in_place_above_64k();
    let h = Host::new(mode, "dcopy-sg");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let n = (1 << 20) + 333;
    let remote = Anon::map(n);
    remote.bytes().iter_mut().enumerate().for_each(|(i, x)| *x = pattern(6, i));
    // SAFETY: `remote` outlives the MRs.
    let rmr = unsafe { b.pd.reg_mr(remote.ptr, n, ALL) }.unwrap();
    // SAFETY: as above.
    let read_only = unsafe { b.pd.reg_mr(remote.ptr, n, access::REMOTE_READ) }.unwrap();
    let first = (300 << 10) + 5;
    let local = Anon::map(first);
    // SAFETY: `local` outlives the MR.
    let lmr = unsafe { a.pd.reg_mr(local.ptr, first, ALL) }.unwrap();
    let shared = MrBuf::new(&a.pd, n - first, ALL).unwrap();
    let sg = [Sge { addr: local.addr(), length: first as u32, lkey: lmr.lkey() }, shared.sge(0, (n - first) as u32)];
    assert_eq!(post(&a, WrOpcode::RdmaRead, &sg, remote.addr(), rmr.rkey()), WcStatus::Success);
    assert!(local.bytes().iter().enumerate().all(|(i, x)| *x == pattern(6, i)), "{mode:?}: the first element");
    let mut rest = vec![0u8; n - first];
    shared.read(0, &mut rest);
    assert!(rest.iter().enumerate().all(|(i, x)| *x == pattern(6, first + i)), "{mode:?}: the second element");

    // Refusals: past the peer's MR, a WRITE to a read-only MR, a READ into a local MR
    // without LOCAL_WRITE.
    let sg = [Sge { addr: local.addr(), length: first as u32, lkey: lmr.lkey() }];
    assert_eq!(post(&a, WrOpcode::RdmaRead, &sg, remote.addr() + (n - first) as u64 + 1, rmr.rkey()), WcStatus::RemAccessErr);
    // (An error completion moves the QP to ERR: each refusal on a new pair.)
    let (a, b) = h.pair(&h.vnic("c", "t"), &h.vnic("d", "t"), ALL);
    // SAFETY: `remote` outlives the MR.
    let read_only_b = unsafe { b.pd.reg_mr(remote.ptr, n, access::REMOTE_READ) }.unwrap();
    // SAFETY: `local` outlives the MRs.
    let lmr = unsafe { a.pd.reg_mr(local.ptr, first, ALL) }.unwrap();
    local.bytes().fill(0x5a);
    let sg = [Sge { addr: local.addr(), length: first as u32, lkey: lmr.lkey() }];
    assert_eq!(post(&a, WrOpcode::RdmaWrite, &sg, remote.addr(), read_only_b.rkey()), WcStatus::RemAccessErr);
    assert!(remote.bytes().iter().enumerate().all(|(i, x)| *x == pattern(6, i)), "{mode:?}: a refused WRITE wrote");
    let (a, b) = h.pair(&h.vnic("e", "t"), &h.vnic("f", "t"), ALL);
    // SAFETY: `remote` outlives the MR.
    let rmr_b = unsafe { b.pd.reg_mr(remote.ptr, n, ALL) }.unwrap();
    // SAFETY: `local` outlives the MR.
    let no_write = unsafe { a.pd.reg_mr(local.ptr, first, 0) }.unwrap();
    let sg = [Sge { addr: local.addr(), length: first as u32, lkey: no_write.lkey() }];
    assert_ne!(post(&a, WrOpcode::RdmaRead, &sg, remote.addr(), rmr_b.rkey()), WcStatus::Success);
    assert!(local.bytes().iter().all(|x| *x == 0x5a), "{mode:?}: a refused READ wrote");
    drop((read_only, read_only_b));
}

/// Figures, not a check (`cargo test --release -p vrdma --test direct_copy -- --ignored
/// --nocapture direct_copy_figures`): a rendezvous where both buffers are fresh (what
/// Graph-500's Alltoallv does: malloc, register, READ, deregister, free on each side), so
/// both are registered in place and vrdmad copies between two processes' memory; against a
/// SEND of the same bytes into a posted buffer. Direct path, medians of 9.
#[test]
#[ignore]
fn direct_copy_figures() {
    in_place_above_64k();
    let h = Host::new(Mode::Direct, "dcopy-fig");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let max = 4 << 20;
    let send_src = MrBuf::new(&a.pd, max, ALL).unwrap();
    let recv = MrBuf::new(&b.pd, max, ALL).unwrap();
    let median = |mut v: Vec<f64>| {
        v.sort_by(|x, y| x.partial_cmp(y).unwrap());
        v[v.len() / 2]
    };
    let mut n = 128 << 10;
    while n <= max {
        let (mut read, mut write, mut whole, mut send) = (vec![], vec![], vec![], vec![]);
        for round in 0..9u8 {
            let (theirs, mine) = (Anon::map(n), Anon::map(n));
            theirs.bytes().fill(round | 1);
            mine.bytes().fill(0);
            let t0 = std::time::Instant::now();
            // SAFETY: both buffers outlive their MRs.
            let (rmr, lmr) = unsafe { (b.pd.reg_mr(theirs.ptr, n, ALL).unwrap(), a.pd.reg_mr(mine.ptr, n, ALL).unwrap()) };
            let sg = [Sge { addr: mine.addr(), length: n as u32, lkey: lmr.lkey() }];
            let t = std::time::Instant::now();
            assert_eq!(post(&a, WrOpcode::RdmaRead, &sg, theirs.addr(), rmr.rkey()), WcStatus::Success);
            read.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            assert_eq!(post(&a, WrOpcode::RdmaWrite, &sg, theirs.addr(), rmr.rkey()), WcStatus::Success);
            write.push(t.elapsed().as_secs_f64());
            drop((rmr, lmr));
            whole.push(t0.elapsed().as_secs_f64() - write.last().unwrap());
            assert!(mine.bytes().iter().all(|x| *x == round | 1));
            b.qp.post_recv(&RecvWr { wr_id: 5, sg_list: &[recv.sge(0, n as u32)] }).unwrap();
            let t = std::time::Instant::now();
            assert_eq!(post(&a, WrOpcode::Send, &[send_src.sge(0, n as u32)], 0, 0), WcStatus::Success);
            send.push(t.elapsed().as_secs_f64());
            assert_eq!(wait_one(&b.cq).status, WcStatus::Success);
        }
        let (read, write, whole, send) = (median(read), median(write), median(whole), median(send));
        let gbps = |s: f64| n as f64 / s / 1e9;
        eprintln!(
            "both fresh {n:>8} B: READ {:>7.1} us ({:.2} GB/s), WRITE {:>7.1} us ({:.2} GB/s); 2 reg + READ + 2 dereg {:.2} GB/s; SEND (eager copy) {:>7.1} us ({:.2} GB/s)",
            read * 1e6,
            gbps(read),
            write * 1e6,
            gbps(write),
            gbps(whole),
            send * 1e6,
            gbps(send)
        );
        n *= 4;
    }
}
