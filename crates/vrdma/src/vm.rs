//! The library's own changes to the process's mappings, made as raw system calls.
//!
//! UCX (ucm) and Open MPI (its memory patcher) hook libc's `mmap`, `mremap` and `munmap` to
//! learn when application memory is unmapped, and drop their registration-cache entries for
//! it. A move of registered memory onto a memfd (and back) replaces the mapping under the
//! same addresses with the same bytes: nothing the application sees is unmapped, as on a NIC,
//! where registration leaves the mappings alone. Through libc, each move looked like an
//! `munmap` of the very range being registered: the cache entry died at once, the next
//! transfer registered again, and every rendezvous paid a move and a move back. The kernel
//! entry points here have the same contract as libc's (`MAP_FAILED` and `errno` on failure).

/// `mmap(2)` without libc's wrapper (and whatever hooks it).
///
/// # Safety
/// As `libc::mmap`: a `MAP_FIXED` mapping replaces whatever was at `addr`.
pub(crate) unsafe fn mmap(
    addr: *mut libc::c_void,
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: libc::c_int,
    offset: libc::off_t,
) -> *mut libc::c_void {
    // SAFETY: the caller upholds mmap's contract; the kernel returns the address or -errno,
    // which syscall(3) turns into -1 (MAP_FAILED) and errno.
    unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, offset) as *mut libc::c_void }
}

/// `mremap(2)` with a fixed destination, without libc's wrapper.
///
/// # Safety
/// As `libc::mremap` with `MREMAP_MAYMOVE | MREMAP_FIXED`: the mapping at `to` is replaced.
pub(crate) unsafe fn mremap_fixed(from: *mut libc::c_void, len: usize, to: *mut libc::c_void) -> *mut libc::c_void {
    let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
    // SAFETY: the caller upholds mremap's contract.
    unsafe { libc::syscall(libc::SYS_mremap, from, len, len, flags, to) as *mut libc::c_void }
}

/// `munmap(2)` without libc's wrapper.
///
/// # Safety
/// As `libc::munmap`: nothing may use the range afterwards.
pub(crate) unsafe fn munmap(addr: *mut libc::c_void, len: usize) -> libc::c_int {
    // SAFETY: the caller upholds munmap's contract.
    unsafe { libc::syscall(libc::SYS_munmap, addr, len) as libc::c_int }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_contract_as_libc() {
        let page = vrdma_abi::shm::page_size();
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        // SAFETY: fresh private anonymous mappings, used only here.
        unsafe {
            let a = mmap(std::ptr::null_mut(), 2 * page, rw, anon, -1, 0);
            assert_ne!(a, libc::MAP_FAILED);
            let b = mmap(std::ptr::null_mut(), page, rw, anon, -1, 0);
            assert_ne!(b, libc::MAP_FAILED);
            *(b as *mut u8) = 0x5a;
            assert_eq!(mremap_fixed(b, page, a), a);
            assert_eq!(*(a as *const u8), 0x5a, "the bytes moved with the pages");
            assert_eq!(munmap(a, 2 * page), 0);
            // Failure: errno as libc would set it.
            assert_eq!(mmap(std::ptr::null_mut(), 0, rw, anon, -1, 0), libc::MAP_FAILED);
            assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EINVAL));
            assert_eq!(munmap(a.cast::<u8>().add(1).cast(), page), -1);
        }
    }
}
