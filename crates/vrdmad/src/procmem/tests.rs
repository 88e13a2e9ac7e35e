//! The copying fallback's memory: bound to the process that connected, refused when that
//! process is gone, replaced or changed credentials, and never writing what it could not.

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use super::*;

#[test]
fn reads_writes_and_atomics_on_own_memory() {
    let mut buf = vec![0u64; 4];
    let addr = buf.as_mut_ptr() as u64;
    let m = ProcMem::open(std::process::id() as i32).expect("own /proc/self/mem");
    m.write(addr, &7u64.to_ne_bytes()).unwrap();
    let mut b = [0u8; 8];
    m.read(addr, &mut b).unwrap();
    assert_eq!(u64::from_ne_bytes(b), 7);
    assert_eq!(m.atomic(addr, Atomic::FetchAdd { add: 5 }).unwrap(), 7);
    assert_eq!(m.atomic(addr, Atomic::CmpSwap { compare: 12, swap: 1 }).unwrap(), 12);
    assert_eq!(m.atomic(addr, Atomic::CmpSwap { compare: 12, swap: 2 }).unwrap(), 1);
    assert!(matches!(m.atomic(addr + 4, Atomic::FetchAdd { add: 1 }), Err(ProcMemError::Misaligned { .. })));
    // SAFETY: reading our own vector after the kernel wrote it.
    assert_eq!(unsafe { std::ptr::read_volatile(buf.as_ptr()) }, 1);
    // Unmapped memory is an error, not a crash.
    assert!(m.read(8, &mut b).is_err());
    assert!(m.write(8, &b).is_err());
}

/// `/proc/PID/mem` writes read-only private pages as a debugger would; vrdmad must not:
/// only what the process itself could write is written, only what it could read is read.
#[test]
fn a_read_only_or_inaccessible_page_is_never_written() {
    let page = 4096usize;
    // SAFETY: a fresh anonymous private mapping of three pages, ours alone.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), 3 * page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    assert_ne!(p, libc::MAP_FAILED);
    let base = p as u64;
    // SAFETY: our mapping: page 1 read-only, page 2 inaccessible.
    unsafe {
        assert_eq!(libc::mprotect(p.cast::<u8>().add(page).cast(), page, libc::PROT_READ), 0);
        assert_eq!(libc::mprotect(p.cast::<u8>().add(2 * page).cast(), page, libc::PROT_NONE), 0);
    }
    let m = ProcMem::open(std::process::id() as i32).unwrap();
    m.write(base, b"ok").unwrap();
    let ro = base + page as u64;
    assert!(matches!(m.write(ro, b"no"), Err(ProcMemError::Unmapped { write: true, .. })), "read-only page written");
    assert!(matches!(m.write(ro - 1, b"no"), Err(ProcMemError::Unmapped { .. })), "a write straddling into it");
    assert!(matches!(m.atomic(ro, Atomic::FetchAdd { add: 1 }), Err(ProcMemError::Unmapped { .. })));
    let mut b = [0u8; 2];
    m.read(ro, &mut b).unwrap();
    assert_eq!(b, [0, 0], "the read-only page is unchanged");
    assert!(matches!(m.read(ro + page as u64, &mut b), Err(ProcMemError::Unmapped { write: false, .. })));
    assert!(m.check_range(base, page as u64, true).is_ok());
    assert!(m.check_range(base, 2 * page as u64, false).is_ok());
    assert!(m.check_range(base, 2 * page as u64, true).is_err());
    // SAFETY: unmapping what we mapped above; nothing refers to it any more.
    unsafe { libc::munmap(p, 3 * page) };
}

/// What a [`client`] does once kicked.
#[derive(Clone, Copy)]
enum Change {
    Nothing,
    /// Takes this UID and GID (as a set-user-ID exec would change them).
    Ids(u32),
    /// Runs as this UID and GID from the start (dumpable), then
    /// `prctl(PR_SET_DUMPABLE, 0)`, as a process keeping debuggers out does.
    Undumpable(u32),
}

/// A child process that connects to `path`, then waits for a byte on `go`; given one, it
/// makes `change`, then waits for ever. Only async-signal-safe calls after fork.
fn client(path: &std::path::Path, go: std::os::fd::RawFd, change: Change) -> libc::pid_t {
    let addr = sockaddr_of(path);
    // SAFETY: fork; the child only makes raw system calls on memory prepared before, then
    // exits with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: raw system calls on our own stack data (see above).
        unsafe {
            if let Change::Undumpable(id) = change {
                libc::setresgid(id, id, id);
                libc::setresuid(id, id, id);
                libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0);
            }
            connect_or_exit(&addr);
            let mut b = 0u8;
            libc::read(go, (&mut b as *mut u8).cast(), 1);
            match change {
                Change::Nothing => {}
                Change::Ids(id) => {
                    libc::setresgid(id, id, id);
                    libc::setresuid(id, id, id);
                }
                Change::Undumpable(_) => {
                    libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
                }
            }
            loop {
                libc::pause();
            }
        }
    }
    pid
}

/// The address of Unix socket `path`.
fn sockaddr_of(path: &std::path::Path) -> libc::sockaddr_un {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: plain data, zero is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(path.as_os_str().as_bytes()) {
        *d = *s as libc::c_char;
    }
    addr
}

/// In a forked child: connects a new socket to `addr` (leaked: the child keeps it for life),
/// or exits with status 1.
///
/// # Safety
/// Raw system calls only, as after fork.
unsafe fn connect_or_exit(addr: &libc::sockaddr_un) {
    // SAFETY: socket(2) and connect(2) with an address of our own stack; _exit.
    unsafe {
        let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
        let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        if libc::connect(s, (addr as *const libc::sockaddr_un).cast(), len) != 0 {
            libc::_exit(1);
        }
    }
}

fn pipe() -> (std::os::fd::RawFd, std::os::fd::RawFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) into a two-element array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    (fds[0], fds[1])
}

fn kick(fd: std::os::fd::RawFd) {
    // SAFETY: one byte from our stack into our pipe.
    assert_eq!(unsafe { libc::write(fd, b"g".as_ptr().cast(), 1) }, 1);
}

fn reap(pid: libc::pid_t) {
    // SAFETY: kill and wait for our own child.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
}

fn listener(tag: &str) -> (UnixListener, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!("vrdmad-procmem-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    (UnixListener::bind(&path).unwrap(), path)
}

/// A client that exits before its session binds its memory, its PID taken over by another
/// process meanwhile: the session gets no memory at all, never the newcomer's.
#[test]
fn a_client_whose_pid_was_reused_binds_nothing() {
    if !vrdma_test_support::require_root("procmem::a_client_whose_pid_was_reused_binds_nothing") {
        return;
    }
    let (l, path) = listener("reuse");
    let (go_r, _go_w) = pipe();
    let pid = client(&path, go_r, Change::Nothing);
    let (conn, _): (UnixStream, _) = l.accept().unwrap();
    reap(pid);
    // Hand its PID to a new process (the kernel gives out ns_last_pid + 1 next).
    let mut newcomer = None;
    for _ in 0..20 {
        let _ = std::fs::write("/proc/sys/kernel/ns_last_pid", format!("{}", pid - 1));
        let c = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        if c.id() as i32 == pid {
            newcomer = Some(c);
            break;
        }
        let mut c = c;
        let _ = c.kill();
        let _ = c.wait();
    }
    let mut newcomer = newcomer.expect("the PID reused");
    let bound = ProcMem::of_peer(conn.as_fd());
    let _ = newcomer.kill();
    let _ = newcomer.wait();
    let _ = std::fs::remove_file(&path);
    assert!(bound.is_err(), "bound to process {pid}, which is not the client");
}

/// A client whose credentials change (a set-user-ID exec does that) after connecting is
/// refused: at bind time if before, at the next access if after.
#[test]
fn a_client_that_changes_credentials_is_refused() {
    if !vrdma_test_support::require_root("procmem::a_client_that_changes_credentials_is_refused") {
        return;
    }
    let (l, path) = listener("creds");
    // Changes credentials before vrdmad binds its memory.
    let (go_r, go_w) = pipe();
    let early = client(&path, go_r, Change::Ids(65534));
    let (conn_early, _): (UnixStream, _) = l.accept().unwrap();
    kick(go_w);
    std::thread::sleep(Duration::from_millis(200));
    let bound_early = ProcMem::of_peer(conn_early.as_fd());
    // Changes them after.
    let (go_r2, go_w2) = pipe();
    let late = client(&path, go_r2, Change::Ids(65534));
    let (conn_late, _): (UnixStream, _) = l.accept().unwrap();
    let m = ProcMem::of_peer(conn_late.as_fd()).expect("bound while unchanged");
    let probe = &m as *const ProcMem as u64;
    let mut b = [0u8; 1];
    // (The child is a fork of this process: the same addresses are mapped there.)
    m.read(probe, &mut b).expect("readable while unchanged");
    kick(go_w2);
    std::thread::sleep(Duration::from_millis(200));
    let after = m.read(probe, &mut b);
    reap(early);
    reap(late);
    let _ = std::fs::remove_file(&path);
    assert!(bound_early.is_err(), "bound a client whose credentials changed before");
    assert!(matches!(after, Err(ProcMemError::Changed { .. })), "read after the change: {after:?}");
}

/// A client that makes itself not dumpable (keeping debuggers out) after vrdmad bound its
/// memory is refused at the next access, as `ptrace` would be.
#[test]
fn a_client_that_stops_being_dumpable_is_refused() {
    if !vrdma_test_support::require_root("procmem::a_client_that_stops_being_dumpable_is_refused") {
        return;
    }
    let (l, path) = listener("undumpable");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let (go_r, go_w) = pipe();
    let pid = client(&path, go_r, Change::Undumpable(65534));
    let (conn, _): (UnixStream, _) = l.accept().unwrap();
    let m = ProcMem::of_peer(conn.as_fd()).expect("bound while dumpable");
    let probe = &m as *const ProcMem as u64;
    let mut b = [0u8; 1];
    m.read(probe, &mut b).expect("readable while dumpable");
    kick(go_w);
    std::thread::sleep(Duration::from_millis(200));
    let after = m.read(probe, &mut b);
    reap(pid);
    let _ = std::fs::remove_file(&path);
    assert!(matches!(after, Err(ProcMemError::Changed { .. })), "read after PR_SET_DUMPABLE 0: {after:?}");
}

/// Without `SO_PEERPIDFD` (kernels before 6.5) the client's PID is opened by pidfd at once
/// and must have the socket's credentials: a live client is bound, and its memory read.
#[test]
fn without_so_peerpidfd_a_live_client_is_bound_by_its_pid() {
    let (l, path) = listener("fallback");
    let (go_r, _go_w) = pipe();
    let pid = client(&path, go_r, Change::Nothing);
    let (conn, _): (UnixStream, _) = l.accept().unwrap();
    let (pidfd, uid, gid) = peer::peer_with(conn.as_fd(), false).unwrap();
    let m = ProcMem::bind(pidfd, Some((uid, gid)));
    reap(pid);
    let _ = std::fs::remove_file(&path);
    let m = m.expect("bound");
    assert_eq!(m.pid(), pid);
    let mut b = [0u8; 1];
    assert!(
        matches!(m.read(&m as *const ProcMem as u64, &mut b), Err(ProcMemError::Gone { .. } | ProcMemError::Changed { .. })),
        "gone once reaped"
    );
}

/// A copy request's atomic (on its requester's session thread) does not wait for a move of
/// its range, as the copy requests' reads and writes do not: it would wait holding the
/// process's atomics lock, which the mediated engine's atomics on the same process (on
/// threads every vNIC shares) take too, so a process that began a move and never ended it
/// held up the engine for the move's 5 s time-out per atomic.
#[test]
fn a_copy_atomic_waits_for_no_move_and_holds_up_no_engine_atomic() {
    let buf = [0u64; 16];
    let (moving, other) = (buf.as_ptr() as u64, buf.as_ptr() as u64 + 64);
    let m = std::sync::Arc::new(ProcMem::open(std::process::id() as i32).expect("own /proc/self/mem"));
    assert!(m.begin_move(moving, 8));
    let req =
        vrdma_abi::control::Request::PeerMrAtomic { qpn: 1, dest_qpn: 0, key: 1, addr: moving, cmp_swap: false, compare_add: 1, swap: 0 };
    std::thread::scope(|s| {
        let copy = s.spawn(|| {
            let t = std::time::Instant::now();
            let r = crate::registry::copy_access(&m, &req);
            (r.is_err(), t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(100));
        let t = std::time::Instant::now();
        assert_eq!(m.atomic_now(other, Atomic::FetchAdd { add: 1 }).ok(), Some(0));
        let engine_took = t.elapsed();
        let (refused, copy_took) = copy.join().unwrap();
        assert!(engine_took < Duration::from_secs(1), "the engine's atomic waited {engine_took:?}");
        assert!(refused && copy_took < Duration::from_secs(1), "the copy's atomic is refused at once, not after {copy_took:?}");
    });
    m.end_move(moving, 8);
}

/// Where [`a_read_by_pid_after_an_exec_sees_nothing_of_the_new_program`]'s child and the
/// program it executes both map a page.
const EXEC_PAGE: usize = 0x6f00_0000_0000;
/// Its bytes before the exec, and after (in the new program).
const BEFORE_EXEC: u8 = 0xcd;
const AFTER_EXEC: u8 = 0xab;

/// Maps one page at `EXEC_PAGE` filled with `fill` (MAP_FIXED_NOREPLACE: never over
/// something else). Raw system calls only (also used after fork).
fn map_exec_page(fill: u8) -> bool {
    // SAFETY: a new anonymous private page at a fixed address that replaces nothing; filled
    // through the pointer mmap returned, only when the mapping succeeded there.
    unsafe {
        let p = libc::mmap(
            EXEC_PAGE as *mut libc::c_void,
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        );
        if p as usize != EXEC_PAGE {
            return false;
        }
        libc::memset(p, i32::from(fill), 4096);
        true
    }
}

/// The program a client of the exec test executes: this test binary, running only this
/// (ignored) test, which maps the page with other bytes and waits to be killed.
#[test]
#[ignore = "run by a_read_by_pid_after_an_exec_sees_nothing_of_the_new_program"]
fn exec_target_maps_the_page_and_waits() {
    if std::env::var_os("VRDMA_PROCMEM_EXEC_TARGET").is_none() {
        return;
    }
    assert!(map_exec_page(AFTER_EXEC));
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Reads by PID (`process_vm_readv`) are confirmed against the address space that was
/// bound: a client that executes another program while an access to its memory is under
/// way hands out none of the new program's bytes, even where the new program maps the very
/// addresses that were checked (the access fails instead).
#[test]
fn a_read_by_pid_after_an_exec_sees_nothing_of_the_new_program() {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    if !vrdma_test_support::require_root("procmem::a_read_by_pid_after_an_exec_sees_nothing_of_the_new_program") {
        return;
    }
    let (l, path) = listener("exec");
    let (go_r, go_w) = pipe();
    let exe = CString::new(std::env::current_exe().unwrap().as_os_str().as_bytes()).unwrap();
    let args: Vec<CString> = ["exec-target", "--exact", "procmem::tests::exec_target_maps_the_page_and_waits", "--ignored", "--nocapture"]
        .iter()
        .map(|a| CString::new(*a).unwrap())
        .collect();
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let env = [CString::new("VRDMA_PROCMEM_EXEC_TARGET=1").unwrap()];
    let envp = [env[0].as_ptr(), std::ptr::null()];
    let addr = sockaddr_of(&path);
    // SAFETY: fork; the child makes raw system calls on memory prepared before, then
    // executes the test binary (or exits with _exit).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            if !map_exec_page(BEFORE_EXEC) {
                libc::_exit(2);
            }
            connect_or_exit(&addr);
            let mut b = 0u8;
            libc::read(go_r, (&mut b as *mut u8).cast(), 1);
            libc::execve(exe.as_ptr(), argv.as_ptr(), envp.as_ptr());
            libc::_exit(3);
        }
    }
    let (conn, _): (UnixStream, _) = l.accept().unwrap();
    let m = ProcMem::of_peer(conn.as_fd()).expect("bound");
    let access = m.access(EXEC_PAGE as u64, 4096, false).expect("the page is mapped before the exec");
    let mut b = [0u8; 4096];
    access.read_at(0, &mut b).expect("readable before the exec");
    assert!(b.iter().all(|&x| x == BEFORE_EXEC));
    kick(go_w);
    // Wait for the new program to map the page.
    let maps = format!("/proc/{pid}/maps");
    let start = format!("{EXEC_PAGE:x}-");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&maps).is_ok_and(|s| s.lines().any(|l| l.starts_with(&start))) {
        assert!(std::time::Instant::now() < deadline, "the new program never mapped the page");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    b.fill(0);
    let after = access.read_at(0, &mut b);
    drop(access);
    reap(pid);
    let _ = std::fs::remove_file(&path);
    assert!(!b.contains(&AFTER_EXEC), "read the new program's bytes");
    assert!(after.is_err(), "a read after the exec succeeded");
}
