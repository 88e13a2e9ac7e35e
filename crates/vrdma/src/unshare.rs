//! Taking pages off their memfds when no MR uses them any more, so that a peer that mapped
//! them (and kept its mapping, ignoring every notice) neither sees this process's later
//! writes nor reaches its memory with its own.
//!
//! Each run of pages that lost its last MR is copied into fresh private anonymous memory,
//! which `mremap` then moves over the same addresses in one step (the addresses never show
//! other bytes); the memfd's pages are then punched out, so the former peer's mapping reads
//! zeros, and its writes allocate pages of the memfd that nobody else maps.
//!
//! Trade-off: a write by another thread of this process to those pages between the copy and
//! the `mremap` is lost (as at registration, which copies the other way); so is a peer's
//! write in flight at deregistration, which no longer has the right to land. Memory that is
//! unmapped right after deregistration (an [`crate::MrBuf`]) is only punched out.

use std::os::fd::AsRawFd;

use vrdma_abi::shm;

use crate::mr::{intact_parts, read_maps, SharedPiece, SEGMENTS};

/// Counts one user less for each of `pieces` and takes the pages no MR uses any more off
/// their memfds (`discard`: the memory is about to be unmapped, its content need not be kept).
pub(crate) fn release(pieces: &[SharedPiece], discard: bool) {
    if pieces.is_empty() {
        return;
    }
    let page = shm::page_size();
    let mut segs = SEGMENTS.lock();
    // (segment start, run start, run end) of pages whose last user this was
    let mut freed: Vec<(usize, usize, usize)> = Vec::new();
    for p in pieces {
        let Some(seg) = segs.get_mut(&p.seg_start) else { continue };
        for i in (p.a - p.seg_start) / page..(p.b - p.seg_start) / page {
            let Some(n) = seg.users.get_mut(i) else { continue };
            *n = n.saturating_sub(1);
            if *n == 0 {
                let a = p.seg_start + i * page;
                match freed.last_mut() {
                    Some(r) if r.0 == p.seg_start && r.2 == a => r.2 = a + page,
                    _ => freed.push((p.seg_start, a, a + page)),
                }
            }
        }
    }
    if freed.is_empty() {
        return;
    }
    let maps = if discard {
        Vec::new()
    } else {
        let lo = freed.iter().map(|r| r.1).min().unwrap_or(0);
        let hi = freed.iter().map(|r| r.2).max().unwrap_or(0);
        read_maps(lo, hi).unwrap_or_default()
    };
    // The pages may hold this thread's own live stack frames (an MR on the stack): then copy
    // and remap on the mover thread while this one sleeps, so its stack does not change
    // between the copy and the remap (as registration does).
    let moves = || {
        for &(seg_start, a, b) in &freed {
            let Some(seg) = segs.get(&seg_start) else { continue };
            // Only what is still mapped from the memfd moves (pages the application unmapped
            // or replaced meanwhile are not ours to touch); then the memfd lets go of all of it.
            let parts = if discard { Vec::new() } else { intact_parts(&maps, seg_start, seg, a, b) };
            let mut kept = false;
            for (x, y) in parts {
                if let Err(e) = move_to_private(seg.fd.as_raw_fd(), x - seg_start, x, y - x) {
                    eprintln!("vrdma: deregistered memory at {x:#x} ({} bytes) stays shared: {e}", y - x);
                    kept = true;
                }
            }
            if !kept {
                punch(seg.fd.as_raw_fd(), a - seg_start, b - a);
            }
        }
    };
    if discard {
        moves(); // nothing is copied: punching needs no other thread
    } else if crate::mover::run_off_stack(
        maps.is_empty() || freed.iter().any(|&(_, a, b)| crate::inplace::may_hold_a_stack(&maps, a, b)),
        moves,
    )
    .is_none()
    {
        eprintln!("vrdma: the thread moving deregistered memory panicked");
    }
    segs.retain(|_, seg| seg.users.iter().any(|n| *n > 0));
}

/// Replaces the mapping of `len` bytes at `addr` (the memfd `fd` at `fd_offset`) by private
/// anonymous memory holding the same bytes.
pub(crate) fn move_to_private(fd: i32, fd_offset: usize, addr: usize, len: usize) -> std::io::Result<()> {
    let os = std::io::Error::last_os_error;
    // Allocated up front (one call rather than a fault per page) when the memfd holds data
    // throughout, as it does for memory the application wrote.
    // SAFETY: lseek(2) on our memfd.
    let full = unsafe { libc::lseek(fd, fd_offset as libc::off_t, libc::SEEK_HOLE) } >= (fd_offset + len) as libc::off_t;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if full { libc::MAP_POPULATE } else { 0 };
    // SAFETY: a fresh private anonymous mapping aliasing nothing.
    let tmp = unsafe { crate::vm::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
    if tmp == libc::MAP_FAILED {
        return Err(os());
    }
    // Read-only from the copy to the remap: another thread's store waits instead of landing
    // in the memfd's pages after they were copied (crate::move_guard).
    let moved = crate::move_guard::while_protected(addr, len, || {
        copy_data(fd, fd_offset, addr, tmp as usize, len);
        // SAFETY: moves our fresh mapping over `[addr, addr+len)`, which holds the same
        // bytes; the old mapping there is unmapped by the move, atomically for other threads.
        let p = unsafe { crate::vm::mremap_fixed(tmp, len, addr as *mut libc::c_void) };
        if p == libc::MAP_FAILED {
            Err(os())
        } else {
            Ok(())
        }
    });
    if let Err(e) = moved {
        // SAFETY: unmapping our own fresh mapping, still where it was.
        unsafe { crate::vm::munmap(tmp, len) };
        return Err(e);
    }
    Ok(())
}

/// Copies the data of the memfd `fd` from `fd_offset` (mapped at `addr`) to `tmp`, `len`
/// bytes: its holes read as zero, like the fresh pages at `tmp`.
fn copy_data(fd: i32, fd_offset: usize, addr: usize, tmp: usize, len: usize) {
    let end = (fd_offset + len) as libc::off_t;
    let mut at = fd_offset as libc::off_t;
    while at < end {
        // SAFETY: lseek(2) on our memfd.
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 || data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) }.clamp(data, end);
        let (from, n) = (data as usize - fd_offset, (hole - data) as usize);
        // SAFETY: `[addr+from, +n)` is mapped from the memfd (checked by the caller) and
        // `[tmp+from, +n)` lies in the fresh mapping of `len` bytes at `tmp`.
        unsafe { std::ptr::copy_nonoverlapping((addr + from) as *const u8, (tmp as *mut u8).add(from), n) };
        at = hole;
    }
}

/// Frees `len` bytes of the memfd at `offset`: whoever still maps them reads zeros.
pub(crate) fn punch(fd: i32, offset: usize, len: usize) {
    // SAFETY: fallocate(2) on our memfd; punching keeps its size (its seals forbid changing it).
    let rc =
        unsafe { libc::fallocate(fd, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset as libc::off_t, len as libc::off_t) };
    if rc != 0 {
        eprintln!("vrdma: punching deregistered memory out of its memfd: {}", std::io::Error::last_os_error());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After the move, the bytes are the same at the same address, and writes to the memfd
    /// no longer show there (nor the other way).
    #[test]
    fn moved_pages_keep_their_bytes_and_leave_the_memfd() {
        let page = shm::page_size();
        let len = 4 * page;
        let fd = shm::create_memfd("vrdma-unshare-test", len, true).unwrap();
        // SAFETY: a fresh shared mapping of our memfd.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) }
            as *mut u8;
        assert_ne!(p as *mut libc::c_void, libc::MAP_FAILED);
        // Pages 0 and 2 written, 1 and 3 holes.
        // SAFETY: within our mapping.
        unsafe {
            std::ptr::write_bytes(p, 0xa5, page);
            std::ptr::write_bytes(p.add(2 * page), 0x5a, page);
        }
        move_to_private(fd.as_raw_fd(), 0, p as usize, len).unwrap();
        punch(fd.as_raw_fd(), 0, len);
        // SAFETY: the same addresses, now private memory.
        let mine = unsafe { std::slice::from_raw_parts(p, len) };
        assert!(mine[..page].iter().all(|b| *b == 0xa5));
        assert!(mine[page..2 * page].iter().all(|b| *b == 0));
        assert!(mine[2 * page..3 * page].iter().all(|b| *b == 0x5a));
        let mut other = vec![0u8; len];
        // SAFETY: reading our memfd into our buffer.
        assert_eq!(unsafe { libc::pread(fd.as_raw_fd(), other.as_mut_ptr().cast(), len, 0) }, len as isize);
        assert!(other.iter().all(|b| *b == 0), "punched pages read as zero");
        // SAFETY: writing our memfd from our buffer.
        assert_eq!(unsafe { libc::pwrite(fd.as_raw_fd(), [7u8; 8].as_ptr().cast(), 8, 0) }, 8);
        assert_eq!(mine[0], 0xa5, "the memfd's later writes do not reach the moved pages");
        // SAFETY: our mapping.
        unsafe { libc::munmap(p.cast(), len) };
    }

    /// Releasing the last MR of a segment the application partly unmapped moves the pages
    /// still mapped (their bytes kept) and leaves the unmapped hole alone.
    #[test]
    fn release_moves_what_is_still_mapped() {
        let page = shm::page_size();
        let len = 3 * page;
        // SAFETY: a fresh private anonymous mapping.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        } as *mut u8;
        assert_ne!(p as *mut libc::c_void, libc::MAP_FAILED);
        // SAFETY: within our mapping.
        unsafe { std::ptr::write_bytes(p, 0x3c, len) };
        let start = p as usize;
        let mut seg = crate::mr::share_gap(start, start + len).unwrap();
        seg.users.iter_mut().for_each(|n| *n = 1);
        let fd = seg.fd.clone();
        SEGMENTS.lock().insert(start, seg);
        // SAFETY: unmapping the middle page of our own mapping.
        unsafe { libc::munmap((start + page) as *mut libc::c_void, page) };
        release(&[SharedPiece { seg_start: start, a: start, b: start + len }], false);
        assert!(!SEGMENTS.lock().contains_key(&start), "the segment is forgotten");
        for pg in [0, 2] {
            // SAFETY: pages 0 and 2 are still mapped (now private memory).
            let bytes = unsafe { std::slice::from_raw_parts(p.add(pg * page), page) };
            assert!(bytes.iter().all(|b| *b == 0x3c), "page {pg} keeps its bytes");
        }
        let mut other = vec![1u8; len];
        // SAFETY: reading the memfd into our buffer.
        assert_eq!(unsafe { libc::pread(fd.as_raw_fd(), other.as_mut_ptr().cast(), len, 0) }, len as isize);
        assert!(other.iter().all(|b| *b == 0), "the memfd let go of every page");
        // SAFETY: our remaining mapping.
        unsafe {
            libc::munmap(p.cast(), page);
            libc::munmap(p.add(2 * page).cast(), page);
        }
    }
}
