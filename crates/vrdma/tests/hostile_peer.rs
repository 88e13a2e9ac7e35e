//! A hostile peer on the direct path: it speaks the control protocol itself
//! (`Context::raw_control`), skipping every check of the library, and maps whatever vrdmad
//! hands it however it likes. It must get exactly what the owner's MR grants a remote party:
//! no byte of another MR or of unregistered memory, no write to what it may only read, and
//! nothing once the MR is deregistered. Wrong keys are refused, counted and throttled.

mod common;
use common::*;

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use vrdma::*;
use vrdma_abi::control::{MrChunk, Reply, Request};

/// Patterns: a distinct byte per page of the owner's memory (never zero).
fn pattern(page_index: usize) -> u8 {
    0x40 + page_index as u8
}

/// What vrdmad hands a peer for `key`: the chunks and their descriptors.
fn peer_map(peer: &End, key: u32) -> Result<(Vec<MrChunk>, Vec<OwnedFd>), Error> {
    match peer.ctx.raw_control(&Request::MapPeerMr { qpn: peer.qp.qp_num(), key }, &[])? {
        (Reply::PeerMr { chunks, .. }, fds) => Ok((chunks, fds)),
        (r, _) => panic!("unexpected reply {r:?}"),
    }
}

fn fd_size(fd: &OwnedFd) -> usize {
    // SAFETY: an all-zero stat is a valid out-parameter; fstat on an fd we hold.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
    st.st_size as usize
}

/// Maps all of `fd` shared with `prot`.
fn map_fd(fd: &OwnedFd, prot: i32) -> std::io::Result<&'static mut [u8]> {
    let len = fd_size(fd);
    // SAFETY: a fresh shared mapping of a descriptor we hold; leaked for the test's life.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the mapping is `len` bytes and stays mapped (never unmapped).
    Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut u8, len) })
}

/// `pages` pages of private anonymous memory, page `i` filled with `pattern(i)`.
fn owner_memory(pages: usize) -> &'static mut [u8] {
    let page = vrdma_abi::shm::page_size();
    // SAFETY: a fresh private anonymous mapping, leaked for the test's life.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), pages * page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: as above.
    let mem = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, pages * page) };
    for (i, pg) in mem.chunks_mut(page).enumerate() {
        pg.fill(pattern(i));
    }
    mem
}

fn bad_keys(h: &Host, vnic: &str) -> u64 {
    h.daemon.status().into_iter().find(|s| s.record.name == vnic).expect("vNIC").counters.bad_keys
}

/// Two connected ends: the owner (vNIC "own") and the hostile peer (vNIC "evil").
fn setup(tag: &str) -> (Host, End, End) {
    let h = Host::new(Mode::Direct, tag);
    let (own, evil) = h.pair(&h.vnic("own", "t"), &h.vnic("evil", "t"), ALL);
    (h, own, evil)
}

/// A REMOTE_READ-only MR: the peer's descriptors cannot be mapped writable, written, or
/// opened again read-write; the owner's bytes stay as they were.
#[test]
fn read_only_mr_cannot_be_written() {
    let (_h, own, evil) = setup("ro");
    let mem = owner_memory(2);
    // SAFETY: `mem` is leaked, so it outlives the MR.
    let mr = unsafe { own.pd.reg_mr(mem.as_mut_ptr(), mem.len(), access::REMOTE_READ) }.unwrap();
    let (_, fds) = peer_map(&evil, mr.rkey()).expect("a REMOTE_READ MR is mapped (read-only)");
    for fd in &fds {
        match map_fd(fd, libc::PROT_READ | libc::PROT_WRITE) {
            Ok(m) => m.fill(0xee),
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EACCES), "writable mapping refused"),
        }
        // SAFETY: pwrite from our buffer on a descriptor we hold.
        let w = unsafe { libc::pwrite(fd.as_raw_fd(), [0xeeu8; 16].as_ptr().cast(), 16, 0) };
        assert_eq!(w, -1, "write(2) to a read-only MR's descriptor refused");
        let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        assert!(reopen_rw_without_capabilities(&path), "reopening a read-only MR's descriptor read-write refused");
        let ro = map_fd(fd, libc::PROT_READ).expect("readable");
        assert!(ro.iter().all(|b| *b == pattern(0) || *b == pattern(1)), "the peer reads the MR");
    }
    assert!(mem.chunks(vrdma_abi::shm::page_size()).enumerate().all(|(i, p)| p.iter().all(|b| *b == pattern(i))), "0 bytes written");
    drop(mr);
}

/// Runs `child` in a forked child without capabilities (CAP_DAC_OVERRIDE would pass any
/// permission check); whether it returned true. `child` may only make system calls (nothing
/// that allocates: another thread may hold the allocator's lock at the fork).
fn in_a_child_without_capabilities(child: impl FnOnce() -> bool) -> bool {
    // SAFETY: the child only makes system calls (the caller's promise) and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        let header = Header { version: 0x2008_0522, pid: 0 };
        let data = [0u32; 6];
        // SAFETY: capset(2) with a valid header and two (zeroed) data structs: no capabilities.
        unsafe { libc::syscall(libc::SYS_capset, &header as *const Header, data.as_ptr()) };
        let ok = child();
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    assert!(pid > 0, "fork");
    let mut status = 0;
    // SAFETY: waits for our child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
}

/// Whether a child without capabilities fails to open `path` read-write.
fn reopen_rw_without_capabilities(path: &std::ffi::CStr) -> bool {
    in_a_child_without_capabilities(|| {
        // SAFETY: open(2) of a NUL-terminated path.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR) };
        fd < 0
    })
}

/// An MR without remote rights (nor local write, which SENDs need): the peer gets nothing,
/// and the attempt is counted.
#[test]
fn local_only_mr_is_not_mapped() {
    let (h, own, evil) = setup("local");
    let mem = owner_memory(1);
    // SAFETY: `mem` is leaked, so it outlives the MR.
    let mr = unsafe { own.pd.reg_mr(mem.as_mut_ptr(), mem.len(), 0) }.unwrap();
    match peer_map(&evil, mr.rkey()) {
        Err(Error::Refused { errno, .. }) => assert_eq!(errno, libc::EACCES),
        Ok((_, fds)) => {
            let read: usize = fds.iter().map(|fd| map_fd(fd, libc::PROT_READ).unwrap().iter().filter(|b| **b == pattern(0)).count()).sum();
            panic!("a local-only MR was handed to the peer ({read} bytes of it readable)");
        }
        Err(e) => panic!("{e}"),
    }
    assert_eq!(bad_keys(&h, "evil"), 1);
}

/// A receive buffer registered LOCAL_WRITE only (and one that may also be read remotely):
/// a peer's SEND reaches it through its owner's staging ring, so vrdmad maps nothing of the
/// first for the peer (EACCES, counted as a bad key) and only read-only descriptors of the
/// second. Before the staging ring, vrdmad handed the peer the read-write memfds of both
/// (the sender's library wrote the posted receive buffer itself).
#[test]
fn local_write_receive_buffer_is_not_mapped() {
    let (h, own, evil) = setup("recvbuf");
    let page = vrdma_abi::shm::page_size();
    let mem = owner_memory(4);
    let base = mem.as_mut_ptr();
    // SAFETY: `mem` is leaked, so it outlives the MRs.
    let mr = unsafe { own.pd.reg_mr(base, 2 * page, access::LOCAL_WRITE) }.unwrap();
    // SAFETY: as above.
    let readable = unsafe { own.pd.reg_mr(base.add(2 * page), 2 * page, access::LOCAL_WRITE | access::REMOTE_READ) }.unwrap();
    // Posted as receive buffers (which moves them onto shared memory, where a peer could
    // be handed their pages).
    own.qp.post_recv(&RecvWr { wr_id: 1, sg_list: &[Sge { addr: mr.addr(), length: page as u32, lkey: mr.lkey() }] }).unwrap();
    own.qp.post_recv(&RecvWr { wr_id: 2, sg_list: &[Sge { addr: readable.addr(), length: page as u32, lkey: readable.lkey() }] }).unwrap();
    match peer_map(&evil, mr.rkey()) {
        Err(Error::Refused { errno, .. }) => assert_eq!(errno, libc::EACCES),
        Ok((chunks, fds)) => {
            let read: usize = fds.iter().map(|fd| map_fd(fd, libc::PROT_READ).unwrap().iter().filter(|b| **b != 0).count()).sum();
            panic!("a LOCAL_WRITE-only MR was handed to the peer: {} chunks, {read} bytes of the owner's readable", chunks.len());
        }
        Err(e) => panic!("{e}"),
    }
    assert_eq!(bad_keys(&h, "evil"), 1, "the refused key is counted");
    let (_, fds) = peer_map(&evil, readable.rkey()).expect("a REMOTE_READ MR is mapped (read-only)");
    for fd in &fds {
        match map_fd(fd, libc::PROT_READ | libc::PROT_WRITE) {
            Ok(m) => m.fill(0xee),
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EACCES), "writable mapping refused"),
        }
    }
    // The library's own SENDs still arrive, every byte, in both.
    evil.buf.write(0, &[0x5a; 100]);
    for (n, mem_page) in [(1u64, 0usize), (2, 2)] {
        evil.qp.post_send(&SendWr::new(n, WrOpcode::Send, &[evil.buf.sge(0, 100)], send_flags::SIGNALED)).unwrap();
        assert_eq!(wait_one(&evil.cq).status, WcStatus::Success);
        let r = wait_one(&own.cq);
        assert_eq!((r.wr_id, r.status, r.byte_len), (n, WcStatus::Success, 100));
        let pg = &mem[mem_page * page..(mem_page + 1) * page];
        assert!(pg[..100].iter().all(|b| *b == 0x5a) && pg[100..].iter().all(|b| *b == pattern(mem_page)), "SEND {n} arrived");
    }
    assert!(mem[3 * page..].iter().all(|b| *b == pattern(3)), "0 bytes written by the peer");
    assert!(mem[page..2 * page].iter().all(|b| *b == pattern(1)), "0 bytes written by the peer");
    drop((mr, readable));
}

/// Whatever the peer maps of an MR holds no byte of a neighbouring MR or of memory that is
/// no longer registered, even where a former MR covered them all.
#[test]
fn nothing_beyond_the_mr() {
    let (_h, own, evil) = setup("beyond");
    let page = vrdma_abi::shm::page_size();
    let mem = owner_memory(4);
    let base = mem.as_mut_ptr();
    // A former MR over all four pages, deregistered: its memory is unregistered again.
    // SAFETY: `mem` is leaked, so it outlives the MRs.
    drop(unsafe { own.pd.reg_mr(base, 4 * page, ALL) }.unwrap());
    // Page 1 for the peer; page 3 a neighbouring MR.
    // SAFETY: as above.
    let mr = unsafe { own.pd.reg_mr(base.add(page), page, ALL) }.unwrap();
    // SAFETY: as above.
    let _neighbour = unsafe { own.pd.reg_mr(base.add(3 * page), page, access::LOCAL_WRITE) }.unwrap();
    let (chunks, fds) = peer_map(&evil, mr.rkey()).unwrap();
    assert_eq!(chunks.iter().map(|c| c.len).sum::<u64>(), page as u64);
    let mut foreign = 0usize;
    for fd in &fds {
        let m = map_fd(fd, libc::PROT_READ).unwrap();
        foreign += m.iter().filter(|b| [pattern(0), pattern(2), pattern(3)].contains(b)).count();
    }
    assert_eq!(foreign, 0, "bytes of other pages readable by the peer");
    drop(mr);
}

/// An MR inside a live MR of wider range (local access only, which a NIC shows no peer): the
/// inner MR's peer gets no descriptor of the outer MR's other pages, and still reads and
/// writes the inner MR's bytes, and only those.
#[test]
fn an_mr_inside_another_exposes_nothing_of_the_outer_one() {
    let (_h, own, evil) = setup("inside");
    let page = vrdma_abi::shm::page_size();
    let mem = owner_memory(4);
    let base = mem.as_mut_ptr();
    // SAFETY: `mem` is leaked, so it outlives the MRs.
    let _outer = unsafe { own.pd.reg_mr(base, 4 * page, access::LOCAL_WRITE) }.unwrap();
    // SAFETY: as above.
    let inner = unsafe { own.pd.reg_mr(base.add(page), page, ALL) }.unwrap();
    let (_, fds) = peer_map(&evil, inner.rkey()).unwrap();
    let mut foreign = 0usize;
    for fd in &fds {
        let m = map_fd(fd, libc::PROT_READ | libc::PROT_WRITE).unwrap();
        foreign += m.iter().filter(|b| [pattern(0), pattern(2), pattern(3)].contains(b)).count();
        m.fill(0x99);
    }
    assert_eq!(foreign, 0, "bytes of the outer MR readable by the inner MR's peer");
    for i in [0, 2, 3] {
        assert!(mem[i * page..(i + 1) * page].iter().all(|b| *b == pattern(i)), "page {i} written by the peer");
    }
    // Through the library the peer reaches the inner MR as a NIC would let it.
    let buf = MrBuf::new(&evil.pd, page, ALL).unwrap();
    let sg = [buf.sge(0, page as u32)];
    let mut w = SendWr::new(7, WrOpcode::RdmaRead, &sg, send_flags::SIGNALED);
    w.remote_addr = inner.addr();
    w.rkey = inner.rkey();
    evil.qp.post_send(&w).unwrap();
    assert_eq!(wait_one(&evil.cq).status, WcStatus::Success);
    let mut got = vec![0u8; page];
    buf.read(0, &mut got);
    assert!(got.iter().all(|b| *b == pattern(1)), "the inner MR's bytes");
    w.remote_addr = inner.addr() - 8;
    w.wr_id = 8;
    let sg8 = [buf.sge(0, 16)];
    w.sg_list = &sg8;
    evil.qp.post_send(&w).unwrap();
    assert_ne!(wait_one(&evil.cq).status, WcStatus::Success, "a READ starting before the inner MR is refused");
}

/// After deregistration the peer's mapping (kept, notices ignored) neither shows the owner's
/// later writes nor reaches the owner's memory with its own; the owner's bytes are intact.
#[test]
fn mapping_is_dead_after_dereg() {
    let (_h, own, evil) = setup("dereg");
    let page = vrdma_abi::shm::page_size();
    let mem = owner_memory(2);
    // SAFETY: `mem` is leaked, so it outlives the MR.
    let mr = unsafe { own.pd.reg_mr(mem.as_mut_ptr(), mem.len(), ALL) }.unwrap();
    let (_, fds) = peer_map(&evil, mr.rkey()).unwrap();
    let maps: Vec<&mut [u8]> = fds.iter().map(|fd| map_fd(fd, libc::PROT_READ | libc::PROT_WRITE).unwrap()).collect();
    assert!(maps.iter().any(|m| m.contains(&pattern(0))), "mapped before dereg");
    drop(mr);
    for (i, pg) in mem.chunks(page).enumerate() {
        assert!(pg.iter().all(|b| *b == pattern(i)), "the owner's bytes survive deregistration");
    }
    mem.fill(0x77);
    for m in maps {
        assert_eq!(m.iter().filter(|b| **b == 0x77 || [pattern(0), pattern(1)].contains(b)).count(), 0, "the peer still reads the memory");
        m.fill(0x99);
    }
    assert!(mem.iter().all(|b| *b == 0x77), "the peer's writes reached the owner's memory");
}

/// How the hostile peer loses its right to an MR that stays registered.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Revocation {
    /// The owner destroys the QP the peer is connected to.
    OwnerQpDestroyed,
    /// The peer destroys its own QP (but keeps its mapping).
    PeerQpDestroyed,
    /// The peer closes its context (its session ends; the process lives on, mapping kept).
    PeerSessionEnded,
    /// The rule that let the two tenants connect is withdrawn.
    TenantDenied,
}

/// The peer keeps its mapping and ignores every notice after losing its right to an MR that
/// stays registered: once the owner re-homed the MR, the peer neither reads the owner's
/// writes nor reaches its memory, while a peer still entitled keeps RDMA-writing and reading
/// the MR.
fn mapping_dies_when_the_right_ends(how: Revocation, tag: &str) {
    let h = Host::new(Mode::Direct, tag);
    h.daemon.set_rule("town", "tevil", true).unwrap();
    let (own, evil) = h.pair(&h.vnic("own", "town"), &h.vnic("evil", "tevil"), ALL);
    // A second QP of the owner, connected to an entitled peer.
    let friend = end(&h.vnic("friend", "town"), ALL, false);
    let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let own_qp2 = own.pd.create_qp(&QpInitAttr::rc(&own.cq, &own.cq, caps)).unwrap();
    to_init(&own_qp2);
    own_qp2.modify(&rtr_attr(friend.ctx.gids()[0], friend.qp.qp_num()), RTR_MASK).unwrap();
    let rts = QpAttr { qp_state: QpState::Rts as u32, timeout: 10, retry_cnt: 2, rnr_retry: 7, max_rd_atomic: 1, ..Default::default() };
    own_qp2.modify(&rts, RTS_MASK).unwrap();
    connect_with(&friend, own.ctx.gids()[0], own_qp2.qp_num(), 7).unwrap();

    let mem = owner_memory(2);
    // SAFETY: `mem` is leaked, so it outlives the MR.
    let mr = unsafe { own.pd.reg_mr(mem.as_mut_ptr(), mem.len(), ALL) }.unwrap();
    let (mem_addr, rkey) = (mem.as_ptr() as u64, mr.rkey());
    let rdma = |opcode: WrOpcode, id: u64| {
        let sg = [friend.buf.sge(0, 8)];
        let mut w = SendWr::new(id, opcode, &sg, send_flags::SIGNALED);
        w.remote_addr = mem_addr + 8;
        w.rkey = rkey;
        friend.qp.post_send(&w).unwrap();
        assert_eq!(wait_one(&friend.cq).status, WcStatus::Success, "the entitled peer's RDMA");
    };
    friend.buf.write(0, &1u64.to_ne_bytes());
    rdma(WrOpcode::RdmaWrite, 1);
    let (_, fds) = peer_map(&evil, mr.rkey()).unwrap();
    let mut maps: Vec<&mut [u8]> = fds.iter().map(|fd| map_fd(fd, libc::PROT_READ | libc::PROT_WRITE).unwrap()).collect();
    assert_eq!(maps[0][8], 1, "the hostile peer's mapping works while it is entitled");

    let own_qp = own.qp;
    let End { ctx: evil_ctx, pd: evil_pd, cq: evil_cq, qp: evil_qp, buf: evil_buf } = evil;
    let stop = AtomicBool::new(false);
    /// Stops the writer however the test ends (a failed assertion must not leave it running).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let last = std::thread::scope(|sc| {
        let _stop = StopOnDrop(&stop);
        // The entitled peer RDMA-writes all along: none of its completed writes may be lost
        // by the move (its values' low byte is never 0, which the wait below looks for).
        let writer = sc.spawn(|| {
            let (mut i, mut last) = (1u64, 1u64);
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                last = (i << 8) | 1;
                friend.buf.write(0, &last.to_ne_bytes());
                rdma(WrOpcode::RdmaWrite, i);
            }
            last
        });
        match how {
            Revocation::OwnerQpDestroyed => drop(own_qp),
            Revocation::PeerQpDestroyed => drop(evil_qp),
            Revocation::PeerSessionEnded => drop((evil_buf, evil_qp, evil_cq, evil_pd, evil_ctx)),
            Revocation::TenantDenied => {
                h.daemon.set_rule("town", "tevil", false).unwrap();
            }
        }
        // The owner's library re-homes the MR on its own thread: wait until what the former
        // peer writes no longer reaches the owner's memory. (Waiting for the old pages to read
        // zero would not do: an entitled WRITE that was descheduled past the move's grace
        // period may land in them after the punch, and is lost: docs/security.md.)
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let probe = vrdma_abi::shm::page_size() + 100;
        for marker in (1..=255u8).cycle() {
            // SAFETY: bytes of live mappings, accessed volatile as another party changes them.
            unsafe { std::ptr::write_volatile(&mut maps[0][probe], marker) };
            std::thread::sleep(std::time::Duration::from_millis(1));
            // SAFETY: as above.
            if unsafe { std::ptr::read_volatile(&mem[probe]) } != marker {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the MR is still shared with the former peer after 10 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap()
    });
    assert!(last > 1, "the entitled peer wrote during the move");
    assert_eq!(u64::from_ne_bytes(mem[8..16].try_into().unwrap()), last, "the entitled peer's last WRITE is in the owner's memory");
    mem[16..].fill(0x77);
    for m in maps {
        assert_eq!(m.iter().filter(|b| **b == 0x77).count(), 0, "the former peer still reads the memory");
        m.fill(0x99);
    }
    assert!(mem[16..].iter().all(|b| *b == 0x77), "the former peer's writes reached the owner's memory");
    // The entitled peer remaps (MR epoch) and goes on.
    friend.buf.write(0, &0x1234u64.to_ne_bytes());
    rdma(WrOpcode::RdmaWrite, 2);
    assert_eq!(u64::from_ne_bytes(mem[8..16].try_into().unwrap()), 0x1234, "the entitled peer's WRITE after the move");
    friend.buf.write(0, &0u64.to_ne_bytes());
    rdma(WrOpcode::RdmaRead, 3);
    let mut got = [0u8; 8];
    friend.buf.read(0, &mut got);
    assert_eq!(u64::from_ne_bytes(got), 0x1234, "the entitled peer's READ after the move");
    drop(mr);
}

#[test]
fn mapping_is_dead_after_owner_qp_destroy() {
    mapping_dies_when_the_right_ends(Revocation::OwnerQpDestroyed, "ownqp");
}

#[test]
fn mapping_is_dead_after_peer_qp_destroy() {
    mapping_dies_when_the_right_ends(Revocation::PeerQpDestroyed, "peerqp");
}

#[test]
fn mapping_is_dead_after_peer_session_end() {
    mapping_dies_when_the_right_ends(Revocation::PeerSessionEnded, "session");
}

#[test]
fn mapping_is_dead_after_tenant_deny() {
    mapping_dies_when_the_right_ends(Revocation::TenantDenied, "deny");
}

/// The owner unmaps an MR's memory while it stays registered (a registration cache's freed
/// buffer, a heap trimmed at exit); when the peer's right ends, the pages that peer still
/// maps lose the owner's former bytes: it reads zeros. (Before, the re-home gave up on
/// memory no longer mapped and left the bytes there.)
#[test]
fn unmapped_memory_is_emptied_when_the_right_ends() {
    let (_h, own, evil) = setup("orphan");
    let mem = owner_memory(3);
    // SAFETY: `mem` is leaked; it is unmapped below while the MR lives, which the library
    // must cope with (as a NIC copes with an ODP MR whose memory goes).
    let mr = unsafe { own.pd.reg_mr(mem.as_mut_ptr(), mem.len(), ALL) }.unwrap();
    let (_, fds) = peer_map(&evil, mr.rkey()).unwrap();
    let maps: Vec<&mut [u8]> = fds.iter().map(|fd| map_fd(fd, libc::PROT_READ).unwrap()).collect();
    let page = vrdma_abi::shm::page_size();
    assert_eq!(maps[0][page], pattern(1), "the peer maps the owner's bytes while entitled");
    // SAFETY: the owner's own mapping, which nothing else in this test touches from here on.
    assert_eq!(unsafe { libc::munmap(mem.as_mut_ptr() as *mut libc::c_void, mem.len()) }, 0);
    drop(evil.qp);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while maps.iter().any(|m| m.iter().any(|b| *b != 0)) {
        assert!(std::time::Instant::now() < deadline, "the former peer still reads the owner's former bytes after 10 s");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    drop(mr);
    drop(own);
}

/// The owner unmaps part of an MR's memory while it stays registered (a heap trimmed at
/// exit under a registration cache's MR); when the peer's right ends, the peer's mapping
/// neither reads what the owner writes into the rest nor reaches it, and the unmapped part
/// reads zeros. (Before, the re-home refused an MR partly unmapped and left it shared.)
#[test]
fn partly_unmapped_memory_is_taken_back_when_the_right_ends() {
    let (_h, own, evil) = setup("partorphan");
    let mem = owner_memory(3);
    // SAFETY: `mem` is leaked; its first page is unmapped below while the MR lives.
    let mr = unsafe { own.pd.reg_mr(mem.as_mut_ptr(), mem.len(), ALL) }.unwrap();
    let (_, fds) = peer_map(&evil, mr.rkey()).unwrap();
    let mut maps: Vec<&mut [u8]> = fds.iter().map(|fd| map_fd(fd, libc::PROT_READ | libc::PROT_WRITE).unwrap()).collect();
    let page = vrdma_abi::shm::page_size();
    assert_eq!((maps[0][0], maps[0][page]), (pattern(0), pattern(1)), "the peer maps the owner's bytes while entitled");
    // SAFETY: the owner's own first page, which nothing in this test touches from here on.
    assert_eq!(unsafe { libc::munmap(mem.as_mut_ptr() as *mut libc::c_void, page) }, 0);
    let rest = &mut mem[page..];
    drop(evil.qp);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let probe = page + 100;
    for marker in (1..=255u8).cycle() {
        // SAFETY: a byte of the owner's still-mapped memory, read volatile by the peer's side.
        unsafe { std::ptr::write_volatile(&mut rest[100], marker) };
        std::thread::sleep(std::time::Duration::from_millis(1));
        // SAFETY: a byte of a live mapping another party changes.
        if unsafe { std::ptr::read_volatile(&maps[0][probe]) } != marker {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the rest of the MR is still shared with the former peer after 10 s");
    }
    // (The memfd's pages are emptied right after the move.)
    while maps[0][..page].iter().any(|b| *b != 0) {
        assert!(std::time::Instant::now() < deadline, "the unmapped page still holds the owner's former bytes after 10 s");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    rest.fill(0x77);
    for m in maps.iter_mut() {
        assert_eq!(m.iter().filter(|b| **b == 0x77).count(), 0, "the former peer still reads the owner's memory");
        m.fill(0x99);
    }
    assert!(rest.iter().all(|b| *b == 0x77), "the former peer's writes reached the owner's memory");
    drop(mr);
    drop(own);
}

/// 100000 guessed rkeys: all refused, all counted on the guesser's vNIC, throttled (EAGAIN),
/// and the owner's other connection keeps working meanwhile.
#[test]
fn guessed_rkeys_are_refused_counted_and_throttled() {
    const GUESSES: u64 = 100_000;
    let h = Host::new(Mode::Direct, "guess");
    let (own, evil) = h.pair(&h.vnic("own", "t"), &h.vnic("evil", "t"), ALL);
    let (own2, friend) = h.pair(&h.vnic("own2", "t"), &h.vnic("friend", "t"), ALL);
    let real = [own.buf.mr().rkey(), own.buf.mr().lkey()];
    let (mut refused, mut throttled) = (0u64, 0u64);
    let mut key = 0x1234_5677u32;
    for i in 0..GUESSES {
        key = key.wrapping_mul(2_654_435_761).wrapping_add(1) | 1;
        if real.contains(&key) {
            key ^= 2;
        }
        match peer_map(&evil, key) {
            Err(Error::Refused { errno: libc::EACCES, .. }) => refused += 1,
            Err(Error::Refused { errno: libc::EAGAIN, .. }) => throttled += 1,
            other => panic!("guess {i} ({key:#x}): {:?}", other.map(|(c, _)| c)),
        }
        if i % 20_000 == 0 {
            // The owner's other connection is unaffected: an RDMA WRITE to it completes.
            friend.buf.write(0, &i.to_ne_bytes());
            let sg = [friend.buf.sge(0, 8)];
            let mut w = SendWr::new(i, WrOpcode::RdmaWrite, &sg, send_flags::SIGNALED);
            w.remote_addr = own2.buf.addr();
            w.rkey = own2.buf.mr().rkey();
            friend.qp.post_send(&w).unwrap();
            assert_eq!(wait_one(&friend.cq).status, WcStatus::Success);
            let mut got = [0u8; 8];
            own2.buf.read(0, &mut got);
            assert_eq!(u64::from_ne_bytes(got), i);
        }
    }
    assert_eq!(refused + throttled, GUESSES);
    assert!(throttled > 0, "guessing is throttled ({refused} refused, none throttled)");
    assert_eq!(bad_keys(&h, "evil"), GUESSES, "every bad key is counted");
    assert_eq!(bad_keys(&h, "friend"), 0);
    drop((own, evil));
}

/// Keeps `/proc/sys/vm/nr_hugepages` at a value with at least one free huge page while it
/// lives (raised if need be, put back on drop), one test of any process at a time.
struct HugePagePool {
    restore: Option<String>,
    _lock: std::fs::File,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

fn meminfo(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines().find_map(|l| l.strip_prefix(field)?.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

impl HugePagePool {
    fn with_a_free_page() -> Result<HugePagePool, String> {
        let lock = std::fs::File::create("/tmp/vrdma-test-hugepages.lock").map_err(|e| e.to_string())?;
        // SAFETY: flock(2) on a descriptor we hold.
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
        let Ok(before) = std::fs::read_to_string(NR_HUGEPAGES) else {
            return Err(format!("this kernel has no hugetlb support ({NR_HUGEPAGES} is missing)"));
        };
        let free = |_: ()| meminfo("HugePages_Free:").saturating_sub(meminfo("HugePages_Rsvd:"));
        if free(()) > 0 {
            return Ok(HugePagePool { restore: None, _lock: lock });
        }
        let n: u64 = before.trim().parse().unwrap_or(0);
        if std::fs::write(NR_HUGEPAGES, format!("{}", n + 1)).is_err() {
            return Err(format!("no free huge page and {NR_HUGEPAGES} is not writable (not root)"));
        }
        let pool = HugePagePool { restore: Some(before), _lock: lock };
        if free(()) == 0 {
            return Err("the kernel could not add a huge page".into());
        }
        Ok(pool)
    }
}

impl Drop for HugePagePool {
    fn drop(&mut self) {
        if let Some(n) = &self.restore {
            let _ = std::fs::write(NR_HUGEPAGES, n);
        }
    }
}

/// An RDMA WRITE of 8 bytes from `from` into `rkey` at `addr`; its completion status.
fn write8(from: &End, addr: u64, rkey: u32, id: u64) -> WcStatus {
    from.buf.write(0, &id.to_ne_bytes());
    let sg = [from.buf.sge(0, 8)];
    let mut w = SendWr::new(id, WrOpcode::RdmaWrite, &sg, send_flags::SIGNALED);
    w.remote_addr = addr;
    w.rkey = rkey;
    from.qp.post_send(&w).unwrap();
    wait_one(&from.cq).status
}

/// A hostile owner registers an MR whose pages are a *hugetlbfs* memfd, sealed like any
/// other. A mapping of such a file faults with SIGBUS where a page is missing and the
/// huge-page pool is empty, so once the peer's side (vrdmad's engine, or the peer's own
/// library on the direct path) has mapped it, the owner punches the page out and takes the
/// last free huge page: the next access by the peer's side would kill it (vrdmad, with every
/// vNIC of the host; or another tenant's process). Only shmem memfds are taken.
fn an_mr_on_a_huge_page_memfd_hurts_no_peer(mode: Mode) {
    const HUGE: usize = 2 << 20;
    let test = format!("an_mr_on_a_huge_page_memfd_hurts_no_peer::{mode:?}");
    let pool = match HugePagePool::with_a_free_page() {
        Ok(p) => p,
        Err(why) => return vrdma_test_support::skip(&test, why),
    };
    let h = Host::new(mode, "hugefd");
    let (own, peer) = h.pair(&h.vnic("own", "t"), &h.vnic("peer", "t"), ALL);
    // SAFETY: memfd_create with a constant name.
    let raw = unsafe { libc::memfd_create(c"evil-huge".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB) };
    assert!(raw >= 0, "memfd_create(MFD_HUGETLB): {}", std::io::Error::last_os_error());
    // SAFETY: a descriptor memfd_create just returned, owned by nobody else.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    // SAFETY: plain fcntl/ftruncate on our own descriptor.
    unsafe {
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), HUGE as libc::off_t), 0);
        assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, vrdma_abi::shm::REQUIRED_SEALS), 0);
    }
    // The owner maps it at the MR's addresses, as its library would.
    // SAFETY: a fresh shared mapping of our own memfd, leaked for the test's life.
    let at = unsafe { libc::mmap(std::ptr::null_mut(), HUGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    assert_ne!(at, libc::MAP_FAILED, "mapping the huge page memfd: {}", std::io::Error::last_os_error());
    let addr = at as u64;
    let req = Request::RegMr {
        pd: own.pd.handle(),
        addr,
        length: HUGE as u64,
        access: ALL,
        chunks: vec![MrChunk { mr_offset: 0, len: HUGE as u64, fd_offset: 0 }],
    };
    match own.ctx.raw_control(&req, &[fd.as_raw_fd()]) {
        Err(e) => assert_eq!(e.errno(), libc::EINVAL, "refused as a bad chunk: {e}"),
        Ok((Reply::Mr { rkey, .. }, _)) => {
            // The peer's side maps the MR at its first access.
            let _ = write8(&peer, addr, rkey, 1);
            // SAFETY: fallocate(2) on our own memfd: the page and its reservation go.
            let punched =
                unsafe { libc::fallocate(fd.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, HUGE as libc::off_t) };
            assert_eq!(punched, 0, "punching the huge page out: {}", std::io::Error::last_os_error());
            // Every free huge page taken by the owner.
            let free = meminfo("HugePages_Free:") as usize;
            if free > 0 {
                let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_POPULATE;
                // SAFETY: a fresh private mapping, leaked for the test's life.
                let hog = unsafe { libc::mmap(std::ptr::null_mut(), free * HUGE, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
                assert_ne!(hog, libc::MAP_FAILED, "taking the free huge pages: {}", std::io::Error::last_os_error());
            }
            assert_eq!(meminfo("HugePages_Free:"), 0, "the pool is empty");
            // Here the peer's side faulted (SIGBUS), and this process with it.
            let _ = write8(&peer, addr, rkey, 2);
        }
        Ok((other, _)) => panic!("unexpected reply {other:?}"),
    }
    // vrdmad and the peer are unharmed: an ordinary MR of the owner still takes a WRITE.
    assert_eq!(write8(&peer, own.buf.addr(), own.buf.mr().rkey(), 3), WcStatus::Success);
    let mut got = [0u8; 8];
    own.buf.read(0, &mut got);
    assert_eq!(u64::from_ne_bytes(got), 3);
    drop((own, peer, h, pool));
}

#[test]
fn an_mr_on_a_huge_page_memfd_hurts_no_peer_direct() {
    an_mr_on_a_huge_page_memfd_hurts_no_peer(Mode::Direct);
}

#[test]
fn an_mr_on_a_huge_page_memfd_hurts_no_peer_mediated() {
    an_mr_on_a_huge_page_memfd_hurts_no_peer(Mode::Mediated);
}

/// A hostile owner takes a write lease on its MR's memfd (it owns the file; a write lease
/// needs the file open for writing nowhere, so it keeps a read-only descriptor only) and
/// registers it for REMOTE_READ, for which vrdmad opens the file again read-only: an open of
/// a leased file waits for the holder to give the lease up, up to
/// `/proc/sys/fs/lease-break-time` (45 s by default), and the owner never does. Meanwhile
/// another tenant's registration must go on, and the hostile one be answered at once.
#[test]
fn a_leased_memfd_stalls_no_registration() {
    let h = Host::new(Mode::Direct, "lease");
    let own = end(&h.vnic("own", "t"), ALL, false);
    let other = end(&h.vnic("other", "u"), ALL, false);
    let page = vrdma_abi::shm::page_size();
    let rw = vrdma_abi::shm::create_memfd("leased", page, true).unwrap();
    let ro: OwnedFd = std::fs::File::open(format!("/proc/self/fd/{}", rw.as_raw_fd())).unwrap().into();
    drop(rw);
    // The holder is told to give the lease up with SIGIO (whose default kills): ignored.
    // SAFETY: setting a signal's disposition to SIG_IGN runs no code of ours.
    unsafe { libc::signal(libc::SIGIO, libc::SIG_IGN) };
    // SAFETY: fcntl(2) on our own descriptor.
    let leased = unsafe { libc::fcntl(ro.as_raw_fd(), libc::F_SETLEASE, libc::F_WRLCK) };
    assert_eq!(leased, 0, "a write lease on our own memfd: {}", std::io::Error::last_os_error());
    let req = Request::RegMr {
        pd: own.pd.handle(),
        addr: own.buf.addr(),
        length: page as u64,
        access: access::REMOTE_READ,
        chunks: vec![MrChunk { mr_offset: 0, len: page as u64, fd_offset: 0 }],
    };
    let t0 = std::time::Instant::now();
    let stalled = std::thread::scope(|s| {
        let hostile = s.spawn(|| own.ctx.raw_control(&req, &[ro.as_raw_fd()]).map(|_| ()));
        std::thread::sleep(std::time::Duration::from_millis(100));
        // Another tenant's registration, while the hostile one is under way.
        let t = std::time::Instant::now();
        let buf = MrBuf::new(&other.pd, page, ALL).expect("another tenant registers");
        let took = t.elapsed();
        drop(buf);
        match hostile.join().unwrap() {
            Err(Error::Refused { errno: libc::EBUSY, .. }) => {}
            other => panic!("the leased memfd's registration: {other:?}"),
        }
        took
    });
    assert!(stalled < std::time::Duration::from_secs(1), "another tenant's registration took {stalled:?}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(5), "the hostile registration was answered after {:?}", t0.elapsed());
}

/// A TCP socket on loopback whose close waits `secs` seconds (`SO_LINGER`): its peer never
/// reads, so data and the FIN stay queued and the last `close` waits for them to be
/// acknowledged. The listener must outlive every close that should wait (dropping it resets
/// the connection, which ends the wait).
fn lingering_socket(secs: i32) -> (OwnedFd, std::net::TcpListener) {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut s = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    s.set_nonblocking(true).unwrap();
    let chunk = [0x5au8; 65536];
    loop {
        match s.write(&chunk) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("filling the socket: {e}"),
        }
    }
    let linger = libc::linger { l_onoff: 1, l_linger: secs };
    // SAFETY: setsockopt(2) with a linger struct of its exact size, on our own socket.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_LINGER: {}", std::io::Error::last_os_error());
    (s.into(), listener)
}

/// A hostile client sends vrdmad a descriptor it never asked for: a TCP socket whose last
/// `close` waits (`SO_LINGER`, unsent data, a peer that never reads), with a request that
/// takes none (or as an MR's chunk). vrdmad refuses the request and closes the descriptor;
/// that close must not happen under the registry lock, or every vNIC of the host waits for
/// the linger time (here 30 s; a client may choose days). Another tenant's registration
/// goes on meanwhile.
#[test]
fn a_lingering_socket_stalls_no_registration() {
    use vrdma_abi::channel::Channel;
    let h = Host::new(Mode::Direct, "linger");
    let evil_sock = h.vnic("evil", "t");
    let own = end(&evil_sock, ALL, false);
    let other = end(&h.vnic("other", "u"), ALL, false);
    let page = vrdma_abi::shm::page_size();
    let chunk_req = Request::RegMr {
        pd: own.pd.handle(),
        addr: own.buf.addr(),
        length: page as u64,
        access: access::REMOTE_READ,
        chunks: vec![MrChunk { mr_offset: 0, len: page as u64, fd_offset: 0 }],
    };
    for (i, req) in [Request::AllocPd, chunk_req].iter().enumerate() {
        let mut tries = 0;
        let (ch, listener) = loop {
            let (sock, listener) = lingering_socket(30);
            let ch = Channel::connect(&evil_sock).expect("a raw session");
            ch.send(&req.encode(1), &[sock.as_raw_fd()]).expect("sent");
            // The hostile client keeps no reference, so that vrdmad's close is the last one;
            // unless vrdmad closed its own first (then this close waits: try again).
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                drop(sock);
                let _ = tx.send(());
            });
            if rx.recv_timeout(std::time::Duration::from_millis(300)).is_ok() {
                break (ch, listener);
            }
            drop(listener);
            tries += 1;
            assert!(tries < 5, "case {i}: vrdmad always closed the socket before the client");
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        let t = std::time::Instant::now();
        let buf = MrBuf::new(&other.pd, page, ALL).expect("another tenant registers");
        let took = t.elapsed();
        drop(buf);
        // (Dropping the listener resets the connection: a stalled close ends.)
        drop(listener);
        let (m, _) = ch.recv().expect("a reply");
        match Reply::decode(&m).expect("a reply").1 {
            Reply::Error { .. } => {}
            other => panic!("case {i}: a request with a socket for a descriptor: {other:?}"),
        }
        assert!(took < std::time::Duration::from_secs(1), "case {i}: another tenant's registration took {took:?}");
    }
}

/// `len` bytes of a file mapped shared: memory the library cannot move onto a memfd, which
/// it registers as a copied MR (vrdmad reaches it through `/proc/PID/mem`).
fn file_backed_memory(len: usize, tag: &str) -> &'static mut [u8] {
    let path = std::env::temp_dir().join(format!("vrdma-test-{tag}-{}", std::process::id()));
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    f.set_len(len as u64).unwrap();
    // SAFETY: a fresh shared mapping of our own file, leaked for the test's life.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: as above.
    unsafe { std::slice::from_raw_parts_mut(p as *mut u8, len) }
}

/// A hostile client announces a move of its copied MR (`BeginRehome`) and never finishes it:
/// copies through its memory into that range wait for the move (up to 5 s). The mediated
/// engine's threads are shared by every vNIC of the host (one doorbell thread sends every
/// request; a reader per connection executes every peer's requests), so a WRITE posted from
/// that MR (`from_moving`: the doorbell reads it), or a WRITE into it by the hostile
/// tenant's own peer (the responder's reader writes it), must not hold up another tenant's
/// WRITEs.
fn a_move_never_finished_stalls_no_other_tenant(from_moving: bool) {
    let h = Host::new(Mode::Mediated, if from_moving { "gate-from" } else { "gate-into" });
    let (evil, evil_peer) = h.pair(&h.vnic("evil", "t"), &h.vnic("evil-peer", "t"), ALL);
    let (va, vb) = h.pair(&h.vnic("va", "u"), &h.vnic("vb", "u"), ALL);
    let len = 1 << 16;
    let mem = file_backed_memory(len, if from_moving { "gate-from" } else { "gate-into" });
    // SAFETY: `mem` is leaked, so it outlives the MR.
    let mr = unsafe { evil.pd.reg_mr(mem.as_mut_ptr(), len, ALL) }.unwrap();
    let copied = h.daemon.status().into_iter().find(|s| s.record.name == "evil").unwrap().counters.copied_mrs;
    assert_eq!(copied, 1, "file-backed memory is a copied MR");
    match evil.ctx.raw_control(&Request::BeginRehome { key: mr.rkey() }, &[]) {
        Ok((Reply::Ok, _)) => {}
        other => panic!("BeginRehome: {other:?}"),
    }
    let (from, sg, addr, rkey) = if from_moving {
        (&evil, Sge { addr: mem.as_ptr() as u64, length: 4096, lkey: mr.lkey() }, evil_peer.buf.addr(), evil_peer.buf.mr().rkey())
    } else {
        (&evil_peer, evil_peer.buf.sge(0, 4096), mem.as_ptr() as u64, mr.rkey())
    };
    let sgl = [sg];
    let mut w = SendWr::new(1, WrOpcode::RdmaWrite, &sgl, send_flags::SIGNALED);
    w.remote_addr = addr;
    w.rkey = rkey;
    from.qp.post_send(&w).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    let t = std::time::Instant::now();
    // (From both ends: QPs share the engine's connections by QP number.)
    for i in 0..3 {
        assert_eq!(write8(&va, vb.buf.addr(), vb.buf.mr().rkey(), 10 + i), WcStatus::Success, "WRITE {i} a to b");
        assert_eq!(write8(&vb, va.buf.addr(), va.buf.mr().rkey(), 20 + i), WcStatus::Success, "WRITE {i} b to a");
    }
    let took = t.elapsed();
    let _ = wait_one(&from.cq);
    assert!(took < std::time::Duration::from_secs(1), "another tenant's six 8-byte WRITEs took {took:?}");
    drop(mr);
    if !from_moving {
        // A move that ends loses no WRITE: one posted during it lands once it is over.
        let (own, peer) = h.pair(&h.vnic("own", "w"), &h.vnic("peer", "w"), ALL);
        let mem = file_backed_memory(len, "gate-honest");
        // SAFETY: `mem` is leaked, so it outlives the MR.
        let mr = unsafe { own.pd.reg_mr(mem.as_mut_ptr(), len, ALL) }.unwrap();
        assert!(matches!(own.ctx.raw_control(&Request::BeginRehome { key: mr.rkey() }, &[]), Ok((Reply::Ok, _))));
        peer.buf.write(0, b"AFTERMOV");
        let sgl = [peer.buf.sge(0, 8)];
        let mut w = SendWr::new(2, WrOpcode::RdmaWrite, &sgl, send_flags::SIGNALED);
        w.remote_addr = mem.as_ptr() as u64 + 64;
        w.rkey = mr.rkey();
        peer.qp.post_send(&w).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(&mem[64..72], &[0u8; 8], "nothing written during the move");
        assert!(matches!(own.ctx.raw_control(&Request::RehomeMr { key: mr.rkey(), chunks: vec![] }, &[]), Ok((Reply::Ok, _))));
        assert_eq!(wait_one(&peer.cq).status, WcStatus::Success);
        assert_eq!(&mem[64..72], b"AFTERMOV");
        drop(mr);
    }
}

#[test]
fn a_move_never_finished_stalls_no_other_tenant_sending_from_it() {
    a_move_never_finished_stalls_no_other_tenant(true);
}

#[test]
fn a_move_never_finished_stalls_no_other_tenant_writing_into_it() {
    a_move_never_finished_stalls_no_other_tenant(false);
}

/// A hostile client takes the wakeup eventfd of one of its CQs (vrdmad hands a CQ's eventfd
/// to its owner and to every requester connected to it), clears `O_NONBLOCK` on it (a file
/// status flag, shared by every descriptor of the eventfd: vrdmad's too) and fills its
/// counter. A write to a full blocking eventfd waits until someone reads it, and vrdmad wakes
/// a CQ (here: its QP's peer is destroyed) under its registry lock: another tenant's verbs
/// must go on, and the request that made the wakeup must be answered.
#[test]
fn a_full_blocking_eventfd_stalls_no_other_tenant() {
    let h = Host::new(Mode::Direct, "evfd");
    let (evil, evil2) = h.pair(&h.vnic("evil", "t"), &h.vnic("evil2", "t"), ALL);
    let other = end(&h.vnic("other", "u"), ALL, false);
    let connect = Request::ConnectQp { qpn: evil2.qp.qp_num(), dgid: evil.ctx.gids()[0], dest_qpn: evil.qp.qp_num() };
    let fds = match evil2.ctx.raw_control(&connect, &[]) {
        Ok((Reply::Connected(_), fds)) => fds,
        other => panic!("connecting again: {other:?}"),
    };
    // (QP region, receive CQ region, receive CQ eventfd.)
    let evfd = fds[2].as_raw_fd();
    // SAFETY: fcntl(2) and write(2) on a descriptor we hold, from a live u64.
    unsafe {
        let flags = libc::fcntl(evfd, libc::F_GETFL);
        assert_eq!(libc::fcntl(evfd, libc::F_SETFL, flags & !libc::O_NONBLOCK), 0);
        let full: u64 = u64::MAX - 1;
        assert_eq!(libc::write(evfd, (&full as *const u64).cast(), 8), 8);
    }
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let destroy = s.spawn(|| evil2.ctx.raw_control(&Request::DestroyQp { qpn: evil2.qp.qp_num() }, &[]).map(|_| ()));
        std::thread::sleep(std::time::Duration::from_millis(200));
        let t = std::time::Instant::now();
        s.spawn(move || {
            let pd = other.ctx.alloc_pd();
            let _ = done_tx.send((pd.is_ok(), t.elapsed()));
        });
        let other_done = done_rx.recv_timeout(std::time::Duration::from_secs(3));
        let destroyed_in_time = destroy.is_finished();
        // Rescue whatever waits: reading the eventfd empties its counter.
        let mut v = 0u64;
        // SAFETY: read(2) into a live u64 from a descriptor we hold.
        unsafe { libc::read(evfd, (&mut v as *mut u64).cast(), 8) };
        let other_done = other_done.or_else(|_| done_rx.recv());
        let _ = destroy.join();
        let (ok, took) = other_done.expect("another tenant's PD");
        assert!(ok, "another tenant's PD allocated");
        assert!(took < std::time::Duration::from_secs(1), "another tenant's ibv_alloc_pd took {took:?}");
        assert!(destroyed_in_time, "the hostile client's own DestroyQp was answered within 3 s");
    });
}

/// Sends `req` with the descriptors `fds` on `own`'s session, from a thread of its own
/// (without an answer the call waits for ever): whether vrdmad refused it with EINVAL, and
/// whether the session answers the next request (a PD), both within 5 s.
fn refused_einval_and_session_goes_on(own: End, req: Request, fds: Vec<std::os::fd::RawFd>) -> (Result<(), String>, bool) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // (All of `own`: the QP's drop would wait for the session too.)
        let own = own;
        let refused = match own.ctx.raw_control(&req, &fds) {
            Err(Error::Refused { errno: libc::EINVAL, .. }) => Ok(()),
            other => Err(format!("{other:?}")),
        };
        let _ = tx.send((refused, own.ctx.alloc_pd().is_ok()));
    });
    rx.recv_timeout(std::time::Duration::from_secs(5)).expect("an answer within 5 s")
}

/// A hostile client registers an MR of one page on chunks whose lengths add up to more than
/// 2^64 bytes (sparse memfds may be 2^62 bytes long): the sum of their lengths must not wrap
/// around to the page's length (a debug build's vrdmad panicked in the session's thread,
/// leaving the session open and the client waiting for ever; a release build accepted chunks
/// that tile nothing). Refused as a malformed request; the session goes on.
#[test]
fn chunk_lengths_that_wrap_around_are_refused() {
    let h = Host::new(Mode::Direct, "wrap");
    let own = end(&h.vnic("own", "t"), ALL, false);
    let huge: u64 = 1 << 62;
    let fd = vrdma_abi::shm::create_memfd("huge-sparse", huge as usize, true).unwrap();
    let page = vrdma_abi::shm::page_size() as u64;
    let mut chunks: Vec<MrChunk> = (0..4).map(|i| MrChunk { mr_offset: i * huge, len: huge, fd_offset: 0 }).collect();
    chunks.push(MrChunk { mr_offset: 0, len: page, fd_offset: 0 });
    let fds = vec![fd.as_raw_fd(); chunks.len()];
    let req = Request::RegMr { pd: own.pd.handle(), addr: own.buf.addr(), length: page, access: ALL, chunks };
    let (refused, goes_on) = refused_einval_and_session_goes_on(own, req, fds);
    drop(fd);
    refused.expect("chunks of 2^64 bytes and more for one page refused (EINVAL)");
    assert!(goes_on, "the session goes on");
}

/// An MR in the last page of the address space (`addr + length` fits in 64 bits, its page
/// span's end, 2^64, does not), on a memfd: refused, the session goes on (a debug build's
/// vrdmad panicked rounding the span up).
#[test]
fn an_mr_in_the_last_page_of_the_address_space_is_refused() {
    let h = Host::new(Mode::Direct, "lastpage");
    let own = end(&h.vnic("own", "t"), ALL, false);
    let page = vrdma_abi::shm::page_size() as u64;
    let fd = vrdma_abi::shm::create_memfd("last-page", page as usize, true).unwrap();
    let req = Request::RegMr {
        pd: own.pd.handle(),
        addr: u64::MAX - page + 1,
        length: 16,
        access: ALL,
        chunks: vec![MrChunk { mr_offset: 0, len: page, fd_offset: 0 }],
    };
    let (refused, goes_on) = refused_einval_and_session_goes_on(own, req, vec![fd.as_raw_fd()]);
    drop(fd);
    refused.expect("an MR whose page span ends at 2^64 refused (EINVAL)");
    assert!(goes_on, "the session goes on");
}

/// A peer with the MR owner's uid (every container of `vrdma run` is root inside, host uid
/// 1000000 outside, or root without a user namespace) but no capabilities holds a
/// read-only descriptor of a REMOTE_READ MR: making the memfd writable again (`fchmod`,
/// which needs only ownership, not a writable descriptor) and reopening it read-write
/// through `/proc/self/fd` must fail, or the peer writes memory it may only read.
#[test]
fn a_read_only_descriptor_cannot_be_made_writable_by_the_owners_uid() {
    let (_h, own, evil) = setup("chmod");
    let mem = owner_memory(1);
    // SAFETY: `mem` is leaked, so it outlives the MR.
    let mr = unsafe { own.pd.reg_mr(mem.as_mut_ptr(), mem.len(), access::REMOTE_READ) }.unwrap();
    let (_, fds) = peer_map(&evil, mr.rkey()).expect("a REMOTE_READ MR is mapped (read-only)");
    for fd in &fds {
        let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        let refused = in_a_child_without_capabilities(|| {
            // SAFETY: fchmod(2) and open(2) on a descriptor and a NUL-terminated path; pwrite(2)
            // from a live buffer.
            unsafe {
                libc::fchmod(fd.as_raw_fd(), 0o600);
                let rw = libc::open(path.as_ptr(), libc::O_RDWR);
                !(rw >= 0 && libc::pwrite(rw, [0xeeu8; 8].as_ptr().cast(), 8, 0) == 8)
            }
        });
        assert!(refused, "the peer made the descriptor writable and wrote the MR");
    }
    assert!(mem.iter().all(|b| *b == pattern(0)), "the owner's bytes are as they were");
    drop(mr);
}

/// A hostile tenant on the mediated engine loops two things: WRITEs from MRs the engine has
/// not mapped yet (the doorbell thread, holding the QoS scheduler's lock during its round,
/// maps each), and QPs created, connected and destroyed (the registry, under
/// its lock, takes the scheduler's lock to attach and detach each). Another tenant's verbs
/// must go on. Before the engine kept its own map of the MRs it may reach, vrdmad
/// deadlocked within seconds (a `client-N` thread held the registry in `Engine::attach`
/// waiting for the scheduler, the doorbell held the scheduler in `Broker::mr` waiting for the
/// registry); it also happened by chance in
/// `verbs srq_limit_event_fires_once_below_the_armed_limit::mediated_lanes`.
#[test]
fn registry_and_scheduler_locks_never_deadlock() {
    let h = std::sync::Arc::new(Host::new(Mode::Mediated, "abba"));
    let (ea, eb) = (h.vnic("ea", "t"), h.vnic("eb", "t"));
    let victim = end(&h.vnic("victim", "u"), ALL, false);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    {
        let (h, ea, eb, stop) = (h.clone(), ea.clone(), eb.clone(), stop.clone());
        std::thread::spawn(move || {
            let (a, b) = h.pair(&ea, &eb, ALL);
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let buf = MrBuf::new(&a.pd, 4096, ALL).unwrap();
                let sg = [buf.sge(0, 64)];
                let mut w = SendWr::new(i, WrOpcode::RdmaWrite, &sg, send_flags::SIGNALED);
                w.remote_addr = b.buf.addr();
                w.rkey = b.buf.mr().rkey();
                a.qp.post_send(&w).unwrap();
                let _ = wait_one(&a.cq);
                i += 1;
            }
        });
    }
    {
        let (h, ea, eb, stop) = (h.clone(), ea.clone(), eb.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                drop(h.pair(&ea, &eb, ALL));
            }
        });
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let victim = victim;
        let t0 = std::time::Instant::now();
        while t0.elapsed() < std::time::Duration::from_secs(10) {
            let t = std::time::Instant::now();
            let _ = victim.ctx.alloc_pd();
            let _ = tx.send(t.elapsed());
        }
    });
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_secs(10) {
        match rx.recv_timeout(std::time::Duration::from_secs(5)) {
            Ok(_) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(e) => {
                // (Dropping the host would wait for the deadlocked registry too.)
                std::mem::forget(h);
                panic!("another tenant's ibv_alloc_pd got no answer within 5 s ({e:?}): vrdmad is deadlocked");
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
}
