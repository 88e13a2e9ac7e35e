//! Memory registration's lifecycle as applications and their registration caches (UCX's,
//! Open MPI's) use it, compared with a NIC's: registering a range again, the application
//! unmapping a registered range and reusing its addresses, and `fork` after registration.
//! Each case on every data path (`each_path!`). (Registration of large memory with holes and
//! odd tails keeping every byte is verbs.rs's `large_registration_keeps_every_byte…`.)
//!
//! Ranges up to 64 KiB move onto shared memory at registration; larger ones are registered in
//! place and reached through vrdmad until a receive is posted on them (crates/vrdma/src/mr.rs):
//! the cases below cover both.

mod common;
use common::*;
use vrdma::*;

/// Private anonymous memory of our own (not the library's `MrBuf`): what malloc hands out.
struct Anon {
    ptr: *mut u8,
    len: usize,
}

impl Anon {
    /// `len` bytes at any address, or (with `at`) exactly there, replacing what was mapped.
    fn map(len: usize, at: Option<*mut u8>) -> Anon {
        let (hint, fixed) = match at {
            Some(p) => (p as *mut libc::c_void, libc::MAP_FIXED),
            None => (std::ptr::null_mut(), 0),
        };
        // SAFETY: a new anonymous mapping; with `at`, it replaces only memory the caller
        // owns and gave up.
        let p =
            unsafe { libc::mmap(hint, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed, -1, 0) };
        assert_ne!(p, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        Anon { ptr: p as *mut u8, len }
    }

    // The memory is not the struct's: peers write it too, so `&self` hands out the view.
    #[allow(clippy::mut_from_ref)]
    fn bytes(&self) -> &mut [u8] {
        // SAFETY: the mapping is ours, readable and writable, for `len` bytes; the tests touch
        // it from one thread (peers' writes land between the test's own accesses).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Unmaps it now (what `free` of a large block does).
    fn unmap(self) {
        // SAFETY: our own mapping; `self` is consumed, so nothing refers to it afterwards.
        assert_eq!(unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) }, 0);
        std::mem::forget(self);
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// Whether the page at `addr` is mapped from one of the library's shared memfds (moved at or
/// after registration), rather than still the application's private memory.
fn on_shared_memory(addr: u64) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().any(|l| {
        let Some((range, rest)) = l.split_once(' ') else { return false };
        let Some((a, b)) = range.split_once('-') else { return false };
        let (a, b) = (u64::from_str_radix(a, 16).unwrap(), u64::from_str_radix(b, 16).unwrap());
        a <= addr && addr < b && rest.contains("/memfd:vrdma-mr-")
    })
}

/// The size above which registration leaves memory in place (`VRDMA_MR_MOVE_MAX`, which
/// every test here sets before its first registration: the library reads it once).
const MOVED_AT_REGISTRATION_MAX: usize = 64 << 10;

/// Sets `VRDMA_MR_MOVE_MAX` to [`MOVED_AT_REGISTRATION_MAX`] (every test calls it first, so
/// whichever registers first in this process finds it set).
fn in_place_above_64k() {
    std::env::set_var("VRDMA_MR_MOVE_MAX", MOVED_AT_REGISTRATION_MAX.to_string());
    // In-place MRs move behind the application's back only with moves write-protected.
    std::env::set_var("VRDMA_MOVE_GUARD", "1");
}

fn pattern(seed: u8, i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 11) as u8 ^ seed
}

/// `a` RDMA-writes `data` (staged in its own buffer) to `remote_addr` under `rkey`; returns
/// the completion's status.
fn write_to(a: &End, wr_id: u64, data: &[u8], remote_addr: u64, rkey: u32) -> WcStatus {
    a.buf.write(0, data);
    let sg = [a.buf.sge(0, data.len() as u32)];
    let mut w = SendWr::new(wr_id, WrOpcode::RdmaWrite, &sg, send_flags::SIGNALED);
    w.remote_addr = remote_addr;
    w.rkey = rkey;
    a.qp.post_send(&w).unwrap();
    wait_one(&a.cq).status
}

/// `a` RDMA-reads `n` bytes at `remote_addr` under `rkey`; the completion's status and the
/// bytes read.
fn read_from(a: &End, wr_id: u64, n: usize, remote_addr: u64, rkey: u32) -> (WcStatus, Vec<u8>) {
    a.buf.write(4096, &vec![0xa5; n]);
    let sg = [a.buf.sge(4096, n as u32)];
    let mut r = SendWr::new(wr_id, WrOpcode::RdmaRead, &sg, send_flags::SIGNALED);
    r.remote_addr = remote_addr;
    r.rkey = rkey;
    a.qp.post_send(&r).unwrap();
    let st = wait_one(&a.cq).status;
    let mut got = vec![0; n];
    a.buf.read(4096, &mut got);
    (st, got)
}

each_path!(registering_a_range_again_keeps_its_bytes_and_every_key_works);
/// What a registration cache does: register, deregister, register the same range again, and
/// register a range that is registered already (two MRs, two keys, one memory).
fn registering_a_range_again_keeps_its_bytes_and_every_key_works(mode: Mode) {
    in_place_above_64k();
    let h = Host::new(mode, "rereg");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    // Odd length: the MR ends mid-page, and the page's tail beyond it is the application's too.
    let len = (1 << 20) + 4096 + 77;
    let mem = Anon::map(len + 4096, None);
    for (i, x) in mem.bytes().iter_mut().enumerate() {
        *x = pattern(1, i);
    }
    let timed = |what: &str| {
        let t = std::time::Instant::now();
        // SAFETY: `mem` outlives every MR of this test (dropped before it).
        let mr = unsafe { b.pd.reg_mr(mem.ptr, len, ALL) }.unwrap();
        eprintln!("{mode:?}: {what} registration of {len} B: {:?}", t.elapsed());
        mr
    };
    let first = timed("first");
    drop(first);
    assert!(mem.bytes().iter().enumerate().all(|(i, x)| *x == pattern(1, i)), "deregistration changed the memory");
    let again = timed("repeated");
    let twice = timed("overlapping (range registered already)");
    assert_ne!(again.rkey(), twice.rkey(), "two registrations, two keys");
    assert!(mem.bytes().iter().enumerate().all(|(i, x)| *x == pattern(1, i)), "registration changed the memory");
    // A write through one key shows in the application's memory and through the other key.
    let at = mem.addr() + len as u64 - 8;
    assert_eq!(write_to(&a, 1, b"TAILTAIL", at, again.rkey()), WcStatus::Success);
    assert_eq!(&mem.bytes()[len - 8..len], b"TAILTAIL");
    assert_eq!(read_from(&a, 2, 8, at, twice.rkey()), (WcStatus::Success, b"TAILTAIL".to_vec()));
    // The application's own later write shows through both.
    mem.bytes()[100] = 0x5a;
    assert_eq!(read_from(&a, 3, 1, mem.addr() + 100, again.rkey()).1, [0x5a]);
    // One deregistered, the other key still works and the dead one fails.
    let dead = again.rkey();
    drop(again);
    assert_eq!(write_to(&a, 4, b"STILL", mem.addr() + 4096, twice.rkey()), WcStatus::Success);
    assert_eq!(&mem.bytes()[4096..4101], b"STILL");
    assert_eq!(write_to(&a, 5, b"DEAD", mem.addr(), dead), WcStatus::RemAccessErr);
    // The byte just past the MR is the application's, untouched by all of this.
    assert_eq!(mem.bytes()[len], pattern(1, len));
    drop(twice);
    assert_eq!(&mem.bytes()[4096..4101], b"STILL", "deregistration keeps what peers wrote");
}

each_path!(unmapping_registered_memory_never_reaches_memory_mapped_there_later);
/// The application unmaps a range while it is registered (free() of a large block before
/// ibv_dereg_mr, or a registration cache that has not yet seen the free), or maps new memory
/// over it. A NIC's MR pins the old pages: remote access under the old key keeps succeeding
/// on those orphaned pages (with ODP it would fail instead), never on the new memory;
/// deregistering it later succeeds; registering the new memory gets its content, not the
/// old pages'. vrdma must do the same: for the old key, success on the orphaned pages or an
/// error completion are both acceptable; reaching the new memory is not.
fn unmapping_registered_memory_never_reaches_memory_mapped_there_later(mode: Mode) {
    in_place_above_64k();
    let h = Host::new(mode, "munmap");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let len = 64 << 10;

    // munmap while registered, then remote access under the key while nothing is mapped
    // there (in this one process, the addresses may be reused by anything at once, so the
    // reuse is the second part's, done atomically).
    let gone = Anon::map(len, None);
    gone.bytes().fill(0x33);
    let gone_at = gone.addr();
    // SAFETY: the MR outlives the mapping on purpose (the case under test); nothing local
    // touches the range through it after the unmap, only peers through its key.
    let mr = unsafe { b.pd.reg_mr(gone.ptr, len, ALL) }.unwrap();
    let gone_key = mr.rkey();
    gone.unmap();
    let st_write = write_to(&a, 1, b"ORPHAN", gone_at + 64, gone_key);
    let (st_read, got) = read_from(&a, 2, 6, gone_at + 64, gone_key);
    eprintln!("{mode:?}: after munmap, the old key's write completes {st_write:?}, its read {st_read:?} {got:?}");
    assert!(
        matches!(st_write, WcStatus::Success | WcStatus::RemAccessErr | WcStatus::RemOpErr),
        "old key's write after munmap: {st_write:?}"
    );
    if st_write == WcStatus::Success && st_read == WcStatus::Success {
        assert_eq!(got, b"ORPHAN", "the orphaned pages keep what was written to them, as pinned pages do");
    }
    // Deregistering it afterwards succeeds quietly.
    drop(mr);

    // New memory mapped over a registered range (MAP_FIXED: what malloc's reuse of freed
    // addresses amounts to): zeroes, and nothing the old key does reaches it.
    let old = Anon::map(len, None);
    for (i, x) in old.bytes().iter_mut().enumerate() {
        *x = pattern(2, i);
    }
    // SAFETY: as above: the MR outlives the mapping it was made on.
    let mr = unsafe { b.pd.reg_mr(old.ptr, len, ALL) }.unwrap();
    let old_key = mr.rkey();
    let at = old.ptr;
    std::mem::forget(old); // `new` below replaces it and unmaps the range
    let new = Anon::map(len, Some(at));
    assert!(new.bytes().iter().all(|x| *x == 0), "new anonymous memory reads as zero");
    let st_after = write_to(&a, 3, b"STALE!", at as u64 + 128, old_key);
    assert!(new.bytes().iter().all(|x| *x == 0), "a write under the old key ({st_after:?}) reached memory mapped later");
    // Bytes of the new memory's own, which a read under the old key must not see.
    new.bytes()[256..262].fill(0x11);
    let (st_read, got) = read_from(&a, 4, 6, at as u64 + 256, old_key);
    eprintln!("{mode:?}: after new memory replaced it, the old key's write completes {st_after:?}, its read {st_read:?} {got:?}");
    if st_read == WcStatus::Success {
        assert_ne!(got, [0x11; 6], "a read under the old key saw the new memory");
    }
    // Deregistering the old MR leaves the new memory alone.
    drop(mr);
    assert_eq!(&new.bytes()[256..262], &[0x11; 6]);
    assert!(new.bytes()[..256].iter().all(|x| *x == 0));
    // Registering the new memory (what a cache does after its invalidation) gets the new
    // content, and peers reach it.
    new.bytes()[1000] = 0x77;
    // SAFETY: `new` outlives the MR.
    let mr2 = unsafe { b.pd.reg_mr(new.ptr, len, ALL) }.unwrap();
    assert_eq!(new.bytes()[1000], 0x77, "registration of the new memory kept its content");
    assert!(new.bytes()[..256].iter().all(|x| *x == 0), "the new memory took the old pages' content at registration");
    assert_eq!(read_from(&a, 6, 1, at as u64 + 1000, mr2.rkey()), (WcStatus::Success, vec![0x77]));
    assert_eq!(read_from(&a, 7, 6, at as u64 + 256, mr2.rkey()), (WcStatus::Success, vec![0x11; 6]));
    assert_eq!(write_to(&a, 8, b"NEWKEY", at as u64 + 2048, mr2.rkey()), WcStatus::Success);
    assert_eq!(&new.bytes()[2048..2054], b"NEWKEY");
    drop(mr2);
}

/// Whether, after the application unmaps memory registered in place (above 64 KiB) and maps
/// new memory at the same addresses without deregistering, a peer's write under the old key
/// reaches the new memory. An in-place MR follows its addresses, as an ODP MR does (vrdmad
/// copies through whatever the process maps there); a NIC's pinned MR, and an MR vrdma moved
/// onto a memfd (the case above), keep the orphaned pages instead. Checked, so that a change
/// shows here (docs/security.md, "What remains").
const IN_PLACE_OLD_KEY_REACHES_MEMORY_MAPPED_LATER: bool = true;

each_path!(unmapping_memory_registered_in_place_follows_the_addresses);
/// The unmapping case for an in-place MR: memory mapped at its addresses later (MAP_FIXED,
/// what malloc's reuse amounts to) is reached by the old key as
/// `IN_PLACE_OLD_KEY_REACHES_MEMORY_MAPPED_LATER` says; deregistering leaves the new memory
/// alone.
fn unmapping_memory_registered_in_place_follows_the_addresses(mode: Mode) {
    in_place_above_64k();
    let h = Host::new(mode, "munmap-inplace");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let len = 1 << 20;
    let old = Anon::map(len, None);
    old.bytes().fill(0x33);
    // SAFETY: the MR outlives the mapping on purpose (the case under test); nothing local
    // touches the range through it.
    let mr = unsafe { b.pd.reg_mr(old.ptr, len, ALL) }.unwrap();
    assert!(!on_shared_memory(old.addr()));
    let at = old.ptr;
    std::mem::forget(old); // `new` below replaces it
    let new = Anon::map(len, Some(at));
    let st = write_to(&a, 1, b"STALE!", at as u64 + 128, mr.rkey());
    let reached = &new.bytes()[128..134] == b"STALE!";
    eprintln!("{mode:?}: in place, new memory at the old addresses: the old key's write completes {st:?}, reached it: {reached}");
    assert_eq!(reached, IN_PLACE_OLD_KEY_REACHES_MEMORY_MAPPED_LATER, "semantics of an in-place MR after munmap changed");
    new.bytes()[4096] = 0x11;
    drop(mr);
    assert_eq!(new.bytes()[4096], 0x11, "deregistration left the new memory alone");
}

/// Whether a child's writes to registered memory after `fork` show in the parent. On a NIC
/// (without `ibv_fork_init`, Linux 5.9 and later copies pinned pages into the child at fork)
/// they do not: the child gets a private copy. vrdma maps registered pages it moved onto
/// shared memory `MAP_SHARED` from a memfd (crates/vrdma/src/mr.rs), so for those they do: a
/// difference from a NIC. The test checks these constants, so that a change of the behaviour
/// shows here.
const FORK_CHILD_WRITES_REACH_PARENT: bool = true;
/// The same for memory registered in place (larger than 64 KiB, no receive posted on it):
/// it stays private anonymous memory, copied-on-write at fork, as on a NIC.
const FORK_CHILD_WRITES_REACH_PARENT_IN_PLACE: bool = false;

each_path!(fork_after_registration_keeps_the_parents_mr_working);
/// `fork` after registration, without `ibv_fork_init` (as MPI launchers and applications
/// calling system() do): the parent's MR keeps working both ways, and the child sees the
/// registered memory's content as of the fork; for memory moved at registration and memory
/// registered in place.
fn fork_after_registration_keeps_the_parents_mr_working(mode: Mode) {
    in_place_above_64k();
    fork_case(mode, 64 << 10, FORK_CHILD_WRITES_REACH_PARENT);
    fork_case(mode, 1 << 20, FORK_CHILD_WRITES_REACH_PARENT_IN_PLACE);
}

fn fork_case(mode: Mode, len: usize, child_writes_reach_parent: bool) {
    let h = Host::new(mode, "fork");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let mem = Anon::map(len, None);
    mem.bytes().fill(0x11);
    // SAFETY: `mem` outlives the MR.
    let mr = unsafe { b.pd.reg_mr(mem.ptr, len, ALL) }.unwrap();
    assert_eq!(write_to(&a, 1, b"BEFORE", mem.addr(), mr.rkey()), WcStatus::Success);
    // SAFETY: the child only reads and writes plain memory and leaves with _exit (no
    // allocation, no locks: the parent has other threads).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // The child: it must see the content as of the fork, then writes its own copy.
        let p = mem.ptr;
        // SAFETY: the child's copy of the mapping, valid for len bytes.
        let ok = unsafe { std::slice::from_raw_parts(p, 6) == b"BEFORE" && *p.add(len - 1) == 0x11 };
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(p.add(8192), 0x22, 4096) };
        // SAFETY: ends the child at once, running nothing of the parent's.
        unsafe { libc::_exit(if ok { 0 } else { 3 }) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child did not see the memory as of the fork: {status:#x}");
    let child_write_seen = mem.bytes()[8192..12288].iter().all(|x| *x == 0x22);
    eprintln!("{mode:?}: after fork, the child's writes to registered memory reach the parent: {child_write_seen}");
    assert_eq!(child_write_seen, child_writes_reach_parent, "fork semantics of registered memory ({len} B) changed");
    // The parent's MR works both ways after the fork.
    assert_eq!(write_to(&a, 2, b"AFTER!", mem.addr() + 100, mr.rkey()), WcStatus::Success);
    assert_eq!(&mem.bytes()[100..106], b"AFTER!");
    mem.bytes()[50_000] = 0x99;
    assert_eq!(read_from(&a, 3, 1, mem.addr() + 50_000, mr.rkey()), (WcStatus::Success, vec![0x99]));
    assert_eq!(&mem.bytes()[..6], b"BEFORE");
    drop(mr);
}

each_path!(large_registration_moves_nothing_and_peers_reach_every_byte);
/// A range above 64 KiB is registered in place (the application's pages stay where they
/// are), and peers still read and write every byte of it with the MR's rights: across page
/// boundaries, at its odd tail, in accesses larger than one copy request (64 KiB).
fn large_registration_moves_nothing_and_peers_reach_every_byte(mode: Mode) {
    in_place_above_64k();
    let h = Host::new(mode, "inplace");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let len = (4 << 20) + 4096 + 77;
    let mem = Anon::map(len + 4096, None);
    for (i, x) in mem.bytes().iter_mut().enumerate() {
        *x = pattern(3, i);
    }
    let t = std::time::Instant::now();
    // SAFETY: `mem` outlives the MR.
    let mr = unsafe { b.pd.reg_mr(mem.ptr, len, ALL) }.unwrap();
    eprintln!("{mode:?}: registration of {len} B in place: {:?}", t.elapsed());
    assert!(len > MOVED_AT_REGISTRATION_MAX && !on_shared_memory(mem.addr()), "registration moved the memory");
    assert!(mem.bytes().iter().enumerate().all(|(i, x)| *x == pattern(3, i)), "registration changed the memory");
    // A read larger than one copy request (64 KiB), across many pages.
    let n = BUF - 4096;
    let (st, got) = read_from(&a, 1, n, mem.addr() + 12_345, mr.rkey());
    assert_eq!(st, WcStatus::Success);
    assert!(got.iter().enumerate().all(|(i, x)| *x == pattern(3, 12_345 + i)), "a read of {n} B saw other bytes");
    // Writes at the first byte, across a page boundary and at the very end.
    for (i, at) in [0, 4096 * 300 - 3, len - 8].into_iter().enumerate() {
        assert_eq!(write_to(&a, 10 + i as u64, b"INPLACE!", mem.addr() + at as u64, mr.rkey()), WcStatus::Success);
        assert_eq!(&mem.bytes()[at..at + 8], b"INPLACE!", "write at {at}");
    }
    // An atomic, and the application's own write seen by the peer.
    mem.bytes()[8192..8200].copy_from_slice(&41u64.to_ne_bytes());
    a.buf.write(200, &[0u8; 8]);
    let sg = [a.buf.sge(200, 8)];
    let mut w = SendWr::new(20, WrOpcode::AtomicFetchAndAdd, &sg, send_flags::SIGNALED);
    w.remote_addr = mem.addr() + 8192;
    w.rkey = mr.rkey();
    w.compare_add = 1;
    a.qp.post_send(&w).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    assert_eq!(u64::from_ne_bytes(mem.bytes()[8192..8200].try_into().unwrap()), 42);
    // Beyond its end: refused, and the application's byte after it untouched.
    assert_eq!(write_to(&a, 30, b"PAST", mem.addr() + len as u64 - 2, mr.rkey()), WcStatus::RemAccessErr);
    assert_eq!(mem.bytes()[len], pattern(3, len));
    assert!(!on_shared_memory(mem.addr()), "RDMA moved the memory (no receive was posted on it)");
    let t = std::time::Instant::now();
    drop(mr);
    eprintln!("{mode:?}: deregistration in place: {:?}", t.elapsed());
    assert_eq!(&mem.bytes()[len - 8..len], b"INPLACE!");
}

each_path!(in_place_mr_grants_only_its_rights_and_nothing_after_deregistration);
/// Issue 26's rights on memory registered in place: a REMOTE_READ MR is read, never written;
/// an MR without remote rights is neither; after deregistration the old key reaches nothing.
fn in_place_mr_grants_only_its_rights_and_nothing_after_deregistration(mode: Mode) {
    in_place_above_64k();
    let h = Host::new(mode, "inplace-rights");
    let (va, vb) = (h.vnic("a", "t"), h.vnic("b", "t"));
    let len = 256 << 10;
    let mem = Anon::map(len, None);
    mem.bytes().fill(0x44);
    // Each refused access moves the requester's QP to ERR, as on a NIC: a new pair each.
    let refused = |wr_id: u64, flags: u32, write: bool, deregister_first: bool| {
        let (a, b) = h.pair(&va, &vb, ALL);
        // SAFETY: `mem` outlives the MR.
        let mr = unsafe { b.pd.reg_mr(mem.ptr, len, flags) }.unwrap();
        assert!(!on_shared_memory(mem.addr()), "registered in place");
        let key = mr.rkey();
        if deregister_first {
            drop(mr);
        }
        let st = if write { write_to(&a, wr_id, b"NOPE", mem.addr() + 100, key) } else { read_from(&a, wr_id, 8, mem.addr(), key).0 };
        assert_eq!(st, WcStatus::RemAccessErr, "access {wr_id} (flags {flags:#x}, write {write}, deregistered {deregister_first})");
    };
    {
        let (a, b) = h.pair(&va, &vb, ALL);
        // SAFETY: `mem` outlives the MR.
        let ro = unsafe { b.pd.reg_mr(mem.ptr, len, access::REMOTE_READ) }.unwrap();
        assert_eq!(read_from(&a, 1, 8, mem.addr() + 100, ro.rkey()), (WcStatus::Success, vec![0x44; 8]));
    }
    refused(2, access::REMOTE_READ, true, false);
    refused(3, access::LOCAL_WRITE, false, false);
    refused(4, access::LOCAL_WRITE, true, false);
    refused(5, ALL, false, true);
    refused(6, ALL, true, true);
    assert!(mem.bytes().iter().all(|x| *x == 0x44), "a refused access changed the memory");
}

each_path!(in_place_mr_reused_by_peers_moves_by_itself);
/// Peers reading an MR registered in place through vrdmad make vrdmad ask the owner to share
/// it once they have copied twice its length (a buffer used once stays in place); the owner's
/// library moves it at once, without the owner calling it, and peers map it from then on.
/// Every byte stays as it was. (The mediated engine copies through the owner's memory
/// without asking: there the MR stays in place.)
fn in_place_mr_reused_by_peers_moves_by_itself(mode: Mode) {
    in_place_above_64k();
    let h = Host::new(mode, "inplace-ask");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let len = 256 << 10;
    let mem = Anon::map(len, None);
    for (i, x) in mem.bytes().iter_mut().enumerate() {
        *x = pattern(4, i);
    }
    // SAFETY: `mem` outlives the MR.
    let mr = unsafe { b.pd.reg_mr(mem.ptr, len, ALL) }.unwrap();
    assert!(!on_shared_memory(mem.addr()));
    read_twice_then_wait(&a, mem.addr(), len, mr.rkey(), 4, |moved| {
        assert_eq!(moved, !mode.mediated(), "moved by itself after its second use (direct path only)");
    });
    assert!(mem.bytes().iter().enumerate().all(|(i, x)| *x == pattern(4, i)), "the move changed the memory");
    assert_eq!(write_to(&a, 2, b"MAPPED!!", mem.addr() + 100, mr.rkey()), WcStatus::Success);
    assert_eq!(&mem.bytes()[100..108], b"MAPPED!!");
    drop(mr);
    assert_eq!(&mem.bytes()[100..108], b"MAPPED!!", "deregistration kept the bytes");
}

/// Reads `len` bytes at `addr` (pattern `seed`) through `a` once, checks they stay in place
/// for a while, reads them again, and hands `then` whether they moved onto shared memory
/// within 300 ms without the owner calling its library.
fn read_twice_then_wait(a: &End, addr: u64, len: usize, rkey: u32, seed: u8, then: impl FnOnce(bool)) {
    let step = 32 << 10;
    let read_all = |first_id: u64| {
        for (i, off) in (0..len).step_by(step).enumerate() {
            let (st, got) = read_from(a, first_id + i as u64, step, addr + off as u64, rkey);
            assert_eq!(st, WcStatus::Success);
            assert!(got.iter().enumerate().all(|(j, x)| *x == pattern(seed, off + j)), "read at {off}");
        }
    };
    let moved_within = |ms: u64| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(ms);
        while !on_shared_memory(addr) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        on_shared_memory(addr)
    };
    read_all(100);
    assert!(!moved_within(100), "a buffer used once moved");
    read_all(200);
    then(moved_within(300));
}

#[test]
/// The same on a thread's stack: it must not move while the thread may be running on it (a
/// store to its own read-only stack page would kill it), so it moves at the owner's next
/// verb call.
fn in_place_mr_on_a_stack_moves_at_the_owners_next_verb_call() {
    in_place_above_64k();
    let h = Host::new(Mode::Direct, "inplace-stack");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    const LEN: usize = 256 << 10;
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .stack_size(4 << 20)
            .spawn_scoped(s, || {
                let mut buf = [0u8; LEN + 4096];
                let page = 4096;
                let at = (buf.as_ptr() as usize).next_multiple_of(page) - buf.as_ptr() as usize;
                for (i, x) in buf[at..at + LEN].iter_mut().enumerate() {
                    *x = pattern(6, i);
                }
                let ptr = buf[at..].as_mut_ptr();
                // SAFETY: `buf` outlives the MR (dropped at the end of this closure).
                let mr = unsafe { b.pd.reg_mr(ptr, LEN, ALL) }.unwrap();
                read_twice_then_wait(&a, ptr as u64, LEN, mr.rkey(), 6, |moved| assert!(!moved, "a stack moved by itself"));
                drop(MrBuf::new(&b.pd, 4096, ALL).unwrap()); // a verb call: the safe point
                assert!(on_shared_memory(ptr as u64), "moved at the owner's verb call");
                assert!(buf[at..at + LEN].iter().enumerate().all(|(i, x)| *x == pattern(6, i)), "the move changed the memory");
                drop(mr);
            })
            .unwrap();
    });
}

each_path!(peer_writes_racing_a_move_onto_shared_memory_are_all_kept);
/// A receive posted on memory registered in place moves it onto shared memory (mr.rs) while
/// a peer keeps RDMA-writing it from another thread: every write lands, before, during or
/// after the move, and the SEND into the posted buffer too.
fn peer_writes_racing_a_move_onto_shared_memory_are_all_kept(mode: Mode) {
    in_place_above_64k();
    let h = Host::new(mode, "inplace-race");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let len = 2 << 20;
    let mem = Anon::map(len, None);
    mem.bytes().fill(0x01);
    // SAFETY: `mem` outlives the MR.
    let mr = unsafe { b.pd.reg_mr(mem.ptr, len, ALL) }.unwrap();
    assert!(!on_shared_memory(mem.addr()));
    let writes = 300usize;
    let stride = 4096 + 8; // one write per page, each at another offset in it
    let (addr, rkey) = (mem.addr(), mr.rkey());
    let recv_at = len - 4096;
    std::thread::scope(|sc| {
        let writer = sc.spawn(|| {
            for i in 0..writes {
                let v = (i as u64 + 1).to_le_bytes();
                assert_eq!(write_to(&a, i as u64, &v, addr + (i * stride) as u64, rkey), WcStatus::Success, "write {i}");
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(3));
        let sg = [Sge { addr: addr + recv_at as u64, length: 64, lkey: mr.lkey() }];
        b.qp.post_recv(&RecvWr { wr_id: 77, sg_list: &sg }).unwrap();
        writer.join().unwrap();
    });
    assert!(on_shared_memory(mem.addr()), "post_recv moved the MR onto shared memory");
    for i in 0..writes {
        let at = i * stride;
        assert_eq!(&mem.bytes()[at..at + 8], &(i as u64 + 1).to_le_bytes(), "write {i} was lost");
    }
    // A SEND into the posted buffer.
    a.buf.write(0, b"RECEIVED");
    let sg = [a.buf.sge(0, 8)];
    a.qp.post_send(&SendWr::new(1000, WrOpcode::Send, &sg, send_flags::SIGNALED)).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    let wc = wait_one(&b.cq);
    assert_eq!((wc.status, wc.wr_id), (WcStatus::Success, 77));
    assert_eq!(&mem.bytes()[recv_at..recv_at + 8], b"RECEIVED");
    // Untouched bytes kept.
    assert_eq!(mem.bytes()[4000], 0x01);
    assert_eq!(mem.bytes()[len - 1], 0x01);
    drop(mr);
    assert_eq!(&mem.bytes()[recv_at..recv_at + 8], b"RECEIVED", "deregistration kept the bytes");
}

/// Figures, not a check (`cargo test --release -p vrdma --test registration -- --ignored
/// --nocapture fresh_buffer`): per size, registering a freshly written buffer, one RDMA READ
/// and one RDMA WRITE of all of it by the peer, and deregistering it (what a rendezvous on a
/// registration cache miss costs), against a SEND of the same bytes into a posted buffer (an
/// eager copy), on the direct path. Each the median of 9.
#[test]
#[ignore]
fn fresh_buffer_rdma_figures() {
    if std::env::var_os("VRDMA_MR_MOVE_MAX").is_none() {
        in_place_above_64k();
    }
    let h = Host::new(Mode::Direct, "fresh");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let max = 4 << 20;
    let local = MrBuf::new(&a.pd, max, ALL).unwrap();
    let recv = MrBuf::new(&b.pd, max, ALL).unwrap();
    let median = |mut v: Vec<f64>| {
        v.sort_by(|x, y| x.partial_cmp(y).unwrap());
        v[v.len() / 2]
    };
    let one = |op: WrOpcode, n: usize, at: u64, rkey: u32| {
        let sg = [local.sge(0, n as u32)];
        let mut w = SendWr::new(1, op, &sg, send_flags::SIGNALED);
        w.remote_addr = at;
        w.rkey = rkey;
        a.qp.post_send(&w).unwrap();
        assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    };
    let mut n = 8 << 10;
    while n <= max {
        let (mut reg, mut read, mut write, mut dereg, mut send) = (vec![], vec![], vec![], vec![], vec![]);
        for round in 0..9u8 {
            let mem = Anon::map(n, None);
            mem.bytes().fill(round | 1);
            let t = std::time::Instant::now();
            // SAFETY: `mem` outlives the MR.
            let mr = unsafe { b.pd.reg_mr(mem.ptr, n, ALL) }.unwrap();
            reg.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            one(WrOpcode::RdmaRead, n, mem.addr(), mr.rkey());
            read.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            one(WrOpcode::RdmaWrite, n, mem.addr(), mr.rkey());
            write.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            drop(mr);
            dereg.push(t.elapsed().as_secs_f64());
            b.qp.post_recv(&RecvWr { wr_id: 5, sg_list: &[recv.sge(0, n as u32)] }).unwrap();
            let t = std::time::Instant::now();
            one(WrOpcode::Send, n, 0, 0);
            send.push(t.elapsed().as_secs_f64());
            assert_eq!(wait_one(&b.cq).status, WcStatus::Success);
        }
        let (reg, read, write, dereg, send) = (median(reg), median(read), median(write), median(dereg), median(send));
        let gbps = |s: f64| n as f64 / s / 1e9;
        eprintln!(
            "fresh {n:>8} B: reg {:>8.1} us, READ {:>8.1} us ({:.2} GB/s), WRITE {:>8.1} us ({:.2} GB/s), dereg {:>7.1} us; reg+READ+dereg {:.2} GB/s; SEND (eager copy) {:>7.1} us ({:.2} GB/s)",
            reg * 1e6,
            read * 1e6,
            gbps(read),
            write * 1e6,
            gbps(write),
            dereg * 1e6,
            gbps(reg + read + dereg),
            send * 1e6,
            gbps(send)
        );
        n *= 4;
    }
}
