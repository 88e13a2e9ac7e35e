use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use vrdma_abi::shm;

fn map(len: usize) -> usize {
    // SAFETY: a fresh private anonymous mapping aliasing nothing.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    assert_ne!(p, libc::MAP_FAILED);
    p as usize
}

/// Another thread stores into pages while they move onto a memfd and back, over and over,
/// and checks before each store that its previous store to that word is still there: none
/// is lost (without the protection, stores between a copy and its remap were); a third
/// thread's loads never see a word go back.
#[test]
fn stores_by_another_thread_during_moves_are_kept() {
    let page = shm::page_size();
    let len = 64 * page;
    let buf = map(len);
    let words = len / 8;
    let stop = Arc::new(AtomicBool::new(false));
    let started = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, started) = (stop.clone(), started.clone());
        std::thread::spawn(move || {
            let mut last = vec![0u64; words];
            let (mut i, mut lost) = (1u64, 0u64);
            started.store(true, Ordering::Relaxed);
            while !stop.load(Ordering::Relaxed) {
                let slot = i as usize % words;
                let word = (buf as *mut u64).wrapping_add(slot);
                // SAFETY: `buf` is our live mapping of `words` u64s; the moves keep it mapped.
                if unsafe { std::ptr::read_volatile(word) } != last[slot] {
                    lost += 1;
                }
                // SAFETY: as above.
                unsafe { std::ptr::write_volatile(word, i) };
                last[slot] = i;
                i += 1;
            }
            (lost, i)
        })
    };
    // A reader too, which never stores (so never waits on a read-only step): each word only
    // grows, so a value below one seen before is a load of the wrong pages.
    let reader = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut seen = vec![0u64; words];
            let (mut loads, mut regressed) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let slot = loads as usize % words;
                // SAFETY: as for the writer.
                let v = unsafe { std::ptr::read_volatile((buf as *const u64).wrapping_add(slot)) };
                if v < seen[slot] {
                    regressed += 1;
                }
                seen[slot] = seen[slot].max(v);
                loads += 1;
            }
            regressed
        })
    };
    while !started.load(Ordering::Relaxed) {
        std::thread::yield_now();
    }
    for _ in 0..1000 {
        let seg = crate::mr::share_gap(buf, buf + len).unwrap();
        crate::unshare::move_to_private(seg.fd.as_raw_fd(), 0, buf, len).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let (lost, stores) = writer.join().unwrap();
    let regressed = reader.join().unwrap();
    assert!(stores > 1000, "the writer ran ({stores} stores)");
    assert_eq!(lost, 0, "{lost} stores of {stores} were lost");
    assert_eq!(regressed, 0, "{regressed} loads saw older bytes than before");
}

/// Runs the ignored test `name` of this binary in a child process.
fn run_child(name: &str) -> std::process::ExitStatus {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--ignored", "--nocapture", "--test-threads", "1"])
        .env("VRDMA_MOVE_GUARD_CHILD", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap()
}

/// Moves one page once, so that the handler is installed.
fn one_move() {
    let page = shm::page_size();
    let buf = map(page);
    let seg = crate::mr::share_gap(buf, buf + page).unwrap();
    crate::unshare::move_to_private(seg.fd.as_raw_fd(), 0, buf, page).unwrap();
}

/// A store into a read-only page that no move protects still gets the default action: the
/// process dies of SIGSEGV instead of waiting or going on.
#[test]
fn other_faults_still_kill() {
    let status = run_child("move_guard::tests::child_faults_after_a_move");
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
}

#[test]
#[ignore = "run by other_faults_still_kill in a child process"]
fn child_faults_after_a_move() {
    if std::env::var_os("VRDMA_MOVE_GUARD_CHILD").is_none() {
        return;
    }
    one_move();
    let page = shm::page_size();
    let p = map(page);
    // SAFETY: our own page, made read-only.
    unsafe { libc::mprotect(p as *mut libc::c_void, page, libc::PROT_READ) };
    // SAFETY: a store into our read-only page: the fault under test.
    unsafe { std::ptr::write_volatile(p as *mut u8, 1) };
    std::process::exit(0);
}

static HANDLED: AtomicUsize = AtomicUsize::new(0);

extern "C" fn previous_handler(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel's siginfo; making the faulting page writable lets the store go on.
    unsafe {
        let page = shm::page_size();
        let addr = (*info).si_addr() as usize & !(page - 1);
        libc::mprotect(addr as *mut libc::c_void, page, libc::PROT_READ | libc::PROT_WRITE);
    }
    HANDLED.fetch_add(1, Ordering::SeqCst);
}

/// A handler the application installed before the first move still gets its faults.
#[test]
fn the_previous_handler_is_chained() {
    let status = run_child("move_guard::tests::child_chains_its_handler");
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[test]
#[ignore = "run by the_previous_handler_is_chained in a child process"]
fn child_chains_its_handler() {
    if std::env::var_os("VRDMA_MOVE_GUARD_CHILD").is_none() {
        return;
    }
    // SAFETY: installs a handler that only makes a page writable and counts.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = previous_handler as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGSEGV, &sa, std::ptr::null_mut()), 0);
    }
    one_move();
    let page = shm::page_size();
    let p = map(page);
    // SAFETY: our own page, made read-only; the previous handler makes it writable again.
    unsafe {
        libc::mprotect(p as *mut libc::c_void, page, libc::PROT_READ);
        std::ptr::write_volatile(p as *mut u8, 7);
        assert_eq!(std::ptr::read_volatile(p as *const u8), 7);
    }
    assert_eq!(HANDLED.load(Ordering::SeqCst), 1);
    std::process::exit(0);
}
