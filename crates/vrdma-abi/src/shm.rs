//! Raw shared memory, owned by this one module.
//!
//! Everything else in vrdma reaches shared memory (memfd mappings shared with vrdmad and peer
//! processes, and registered application memory) through [`MemRegion`], whose only unsafe
//! parts are its constructors. All accessors are bounds-checked; concurrent writers in other
//! processes are expected, so reads of shared words use atomics and bulk data uses plain
//! byte copies (what a NIC's DMA would do: no tearing guarantees beyond 8-byte words).

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Errors of shared-memory access.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShmError {
    /// An access that does not lie wholly inside the region.
    #[error("access of {len} bytes at offset {offset} is outside a region of {size} bytes")]
    OutOfBounds {
        /// Region offset of the access.
        offset: usize,
        /// Bytes accessed.
        len: usize,
        /// Bytes of the region.
        size: usize,
    },
    /// An atomic access at an offset not aligned to its width.
    #[error("offset {offset} is not aligned to {align} bytes")]
    Misaligned {
        /// Region offset of the access.
        offset: usize,
        /// The alignment it needs.
        align: usize,
    },
    /// `memfd_create` failed.
    #[error("memfd_create({name}) failed: errno {errno}")]
    Create {
        /// The memfd's name (shown in `/proc/PID/fd`).
        name: String,
        /// The errno.
        errno: i32,
    },
    /// `ftruncate` of a new memfd failed.
    #[error("sizing a memfd to {size} bytes failed: errno {errno}")]
    Resize {
        /// The size asked for.
        size: usize,
        /// The errno.
        errno: i32,
    },
    /// Adding the seals to a new memfd failed.
    #[error("sealing a memfd failed: errno {errno}")]
    Seal {
        /// The errno.
        errno: i32,
    },
    /// A received fd is not a memfd sealed against shrinking, or is too small: mapping it
    /// would let its owner cause SIGBUS here.
    #[error("fd is not a sealed memfd of at least {want} bytes (size {size}, seals {seals:#x})")]
    NotSealed {
        /// Bytes the mapping needs.
        want: usize,
        /// The file's size.
        size: usize,
        /// Its seals (`F_GET_SEALS`), negative if it has none to read (not a memfd).
        seals: i32,
    },
    /// A received fd is a sealed memfd, but not of shmem (a hugetlbfs one): its owner could
    /// make an access fault here.
    #[error("fd is not a shmem memfd (file system type {fs_type:#x})")]
    NotShmem {
        /// `f_type` of its file system (0: `fstatfs` failed).
        fs_type: u64,
    },
    /// `mmap` failed.
    #[error("mmap of {len} bytes failed: errno {errno}")]
    Map {
        /// Bytes to map.
        len: usize,
        /// The errno.
        errno: i32,
    },
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Seals that make a memfd safe to map in another process: it can never shrink (no SIGBUS),
/// grow, or have its seals changed.
pub const REQUIRED_SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Creates a memfd of `size` bytes (zero-filled), sealed with [`REQUIRED_SEALS`] when `seal`.
pub fn create_memfd(name: &str, size: usize, seal: bool) -> Result<std::os::fd::OwnedFd, ShmError> {
    use std::os::fd::FromRawFd;
    let cname = std::ffi::CString::new(name).unwrap_or_default();
    // SAFETY: cname is a valid NUL-terminated string; flags are constants.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(ShmError::Create { name: name.to_string(), errno: errno() });
    }
    // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscall on an fd we own.
    if unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
        return Err(ShmError::Resize { size, errno: errno() });
    }
    if seal {
        seal_memfd(owned.as_fd_borrowed())?;
    }
    Ok(owned)
}

trait AsFdBorrowed {
    fn as_fd_borrowed(&self) -> BorrowedFd<'_>;
}
impl AsFdBorrowed for std::os::fd::OwnedFd {
    fn as_fd_borrowed(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.as_fd()
    }
}

/// Applies [`REQUIRED_SEALS`] to a memfd.
pub fn seal_memfd(fd: BorrowedFd<'_>) -> Result<(), ShmError> {
    // SAFETY: fcntl on a borrowed, open fd.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, REQUIRED_SEALS) } != 0 {
        return Err(ShmError::Seal { errno: errno() });
    }
    Ok(())
}

/// Checks that `fd` is a memfd sealed against shrinking of at least `want` bytes, so that a
/// mapping of its first `want` bytes can never fault, whatever its owner does later.
pub fn check_sealed(fd: BorrowedFd<'_>, want: usize) -> Result<usize, ShmError> {
    // SAFETY: fcntl on a borrowed, open fd.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    // SAFETY: an all-zero stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into st, which lives for the call.
    let rc = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
    let size = if rc == 0 { st.st_size.max(0) as usize } else { 0 };
    if rc != 0 || seals < 0 || seals & libc::F_SEAL_SHRINK == 0 || size < want {
        return Err(ShmError::NotSealed { want, size, seals });
    }
    // Only shmem: a missing page of a shmem file is allocated when touched, whereas one of a
    // hugetlbfs file (`MFD_HUGETLB`), which seals as well, faults with SIGBUS while the
    // huge-page pool is empty, and its owner can punch pages out at any time.
    // SAFETY: an all-zero statfs is a valid out-parameter.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes into fs, which lives for the call.
    let rc = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) };
    if rc != 0 || fs.f_type != libc::TMPFS_MAGIC {
        return Err(ShmError::NotShmem { fs_type: if rc == 0 { fs.f_type as u64 } else { 0 } });
    }
    Ok(size)
}

/// A contiguous range of memory shared with other processes, with a bounds-checked API.
///
/// `MemRegion` does not own the memory; [`SharedMapping`] owns a mapping and hands out its
/// region.
#[derive(Clone, Copy, Debug)]
pub struct MemRegion {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a MemRegion is a view of memory that other processes modify concurrently anyway;
// every access goes through atomics or byte copies, so sharing it between threads adds nothing.
unsafe impl Send for MemRegion {}
// SAFETY: as above.
unsafe impl Sync for MemRegion {}

/// Whether the CPU has PREFETCHW (CPUID 0x80000001, ECX bit 8), asked once.
#[cfg(target_arch = "x86_64")]
fn prefetchw_supported() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        // SAFETY: CPUID exists on every x86-64 CPU (a safe function in newer Rust, unsafe in
        // older), and leaf 0x80000001 is asked only where the highest extended leaf reaches it.
        #[allow(unused_unsafe)]
        unsafe {
            std::arch::x86_64::__cpuid(0x8000_0000).eax >= 0x8000_0001 && std::arch::x86_64::__cpuid(0x8000_0001).ecx & (1 << 8) != 0
        }
    })
}

impl MemRegion {
    /// Makes a region of `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be mapped readable (and writable, if any write accessor is used)
    /// for as long as this value or any copy of it is used. Other threads or processes may
    /// modify the memory concurrently; callers accept torn multi-word data in that case,
    /// exactly as with a NIC's DMA.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Self {
        MemRegion { ptr: NonNull::new(ptr).unwrap_or(NonNull::dangling()), len }
    }

    /// A region of no bytes (every non-empty access fails its bounds check).
    #[inline]
    pub fn empty() -> Self {
        MemRegion { ptr: NonNull::dangling(), len: 0 }
    }

    /// Size in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region has no bytes.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte.
    #[inline]
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    #[inline]
    fn check(&self, offset: usize, len: usize) -> Result<(), ShmError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(ShmError::OutOfBounds { offset, len, size: self.len }),
        }
    }

    #[inline]
    fn check_aligned(&self, offset: usize, width: usize) -> Result<(), ShmError> {
        self.check(offset, width)?;
        if !(self.addr() + offset).is_multiple_of(width) {
            return Err(ShmError::Misaligned { offset, align: width });
        }
        Ok(())
    }

    /// A sub-region.
    #[inline]
    pub fn subregion(&self, offset: usize, len: usize) -> Result<MemRegion, ShmError> {
        self.check(offset, len)?;
        // SAFETY: offset+len is within the region, which is valid by our own contract, so
        // the pointer is in bounds and non-null.
        let ptr = unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(offset)) };
        Ok(MemRegion { ptr, len })
    }

    /// Starts bringing the cache line holding `offset` into this CPU's cache, for writing
    /// if `write` (exclusive, where the CPU can: `prefetchw`), without waiting for it. A
    /// reader that is about to touch several lines another CPU wrote prefetches them all
    /// first, so that their cross-core misses overlap instead of following one another.
    /// A hint: out of bounds, or on other architectures, it does nothing.
    #[inline]
    pub fn prefetch(&self, offset: usize, write: bool) {
        if offset >= self.len {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let p = self.ptr.as_ptr().wrapping_add(offset) as *const i8;
            if write && prefetchw_supported() {
                // SAFETY: PREFETCHW is a hint: it neither faults nor changes memory or flags,
                // and the CPU has it (checked); the address is inside the mapping anyway.
                unsafe { std::arch::asm!("prefetchw [{}]", in(reg) p, options(nostack, preserves_flags, readonly)) };
            } else {
                // SAFETY: as above, for the plain prefetch every x86-64 CPU has.
                unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = write;
    }

    /// The atomic 64-bit word at `offset` (must be 8-byte aligned).
    #[inline]
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64, ShmError> {
        self.check_aligned(offset, 8)?;
        // SAFETY: in bounds and aligned; AtomicU64 has the layout of u64 and every bit pattern
        // is valid; concurrent access from other processes is through atomics too.
        Ok(unsafe { &*(self.ptr.as_ptr().add(offset) as *const AtomicU64) })
    }

    /// The atomic 32-bit word at `offset` (must be 4-byte aligned).
    #[inline]
    pub fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32, ShmError> {
        self.check_aligned(offset, 4)?;
        // SAFETY: in bounds and aligned; see atomic_u64.
        Ok(unsafe { &*(self.ptr.as_ptr().add(offset) as *const AtomicU32) })
    }

    /// Relaxed load of a 64-bit word.
    #[inline]
    pub fn load_u64(&self, offset: usize) -> Result<u64, ShmError> {
        Ok(self.atomic_u64(offset)?.load(Ordering::Relaxed))
    }

    /// Relaxed store of a 64-bit word.
    #[inline]
    pub fn store_u64(&self, offset: usize, v: u64) -> Result<(), ShmError> {
        self.atomic_u64(offset)?.store(v, Ordering::Relaxed);
        Ok(())
    }

    /// Copies `dst.len()` bytes out of the region.
    #[inline]
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) -> Result<(), ShmError> {
        self.check(offset, dst.len())?;
        // SAFETY: source range in bounds; dst is a distinct &mut slice.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the region.
    #[inline]
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        self.check(offset, src.len())?;
        // SAFETY: destination range in bounds; src is a shared slice that may alias only if the
        // caller passed a slice of this same region, in which case `copy` semantics are fine.
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_off` to `self` at `dst_off`: the one copy of the
    /// direct data path.
    #[inline]
    pub fn copy_from_region(&self, dst_off: usize, src: &MemRegion, src_off: usize, len: usize) -> Result<(), ShmError> {
        self.check(dst_off, len)?;
        src.check(src_off, len)?;
        if (8..=16).contains(&len) {
            // Small messages (latency tests, inline data): two overlapping 8-byte moves instead
            // of a call into the C library's memmove. Both loads come before both stores, so
            // overlapping ranges behave like `copy`.
            // SAFETY: both ranges are in bounds (checked) and at least 8 bytes long; unaligned
            // reads and writes of plain bytes.
            unsafe {
                let s = src.ptr.as_ptr().add(src_off);
                let d = self.ptr.as_ptr().add(dst_off);
                let head = std::ptr::read_unaligned(s as *const u64);
                let tail = std::ptr::read_unaligned(s.add(len - 8) as *const u64);
                std::ptr::write_unaligned(d as *mut u64, head);
                std::ptr::write_unaligned(d.add(len - 8) as *mut u64, tail);
            }
            return Ok(());
        }
        // SAFETY: both ranges are in bounds of valid regions; `copy` tolerates overlap.
        unsafe { std::ptr::copy(src.ptr.as_ptr().add(src_off), self.ptr.as_ptr().add(dst_off), len) };
        Ok(())
    }

    /// Writes `head` and then `len` bytes of the region at `offset` to `fd` (a socket), all
    /// of it (short writes continue, EINTR retries): one `writev`, so a frame's header and its
    /// payload straight from registered memory leave in one system call.
    pub fn write_to_fd(&self, fd: BorrowedFd<'_>, head: &[u8], offset: usize, len: usize) -> std::io::Result<()> {
        self.check(offset, len).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let (mut h, mut done) = (0usize, 0usize);
        while h < head.len() || done < len {
            let iov = [
                libc::iovec { iov_base: head[h..].as_ptr() as *mut libc::c_void, iov_len: head.len() - h },
                // SAFETY: offset+len is within the region (checked above).
                libc::iovec { iov_base: unsafe { self.ptr.as_ptr().add(offset + done) } as *mut libc::c_void, iov_len: len - done },
            ];
            // SAFETY: both iovecs describe readable memory for their lengths.
            let n = unsafe { libc::writev(fd.as_raw_fd(), iov.as_ptr(), 2) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let mut n = n as usize;
            let hn = n.min(head.len() - h);
            h += hn;
            n -= hn;
            done += n;
        }
        Ok(())
    }

    /// One non-blocking `sendmsg` of `head` and then `len` bytes of the region at `offset` on
    /// socket `fd`: returns how many bytes (of `head`, then of the region) the socket took,
    /// 0 when it is full. For writers that must never wait for a slow peer.
    pub fn try_send_to_socket(&self, fd: BorrowedFd<'_>, head: &[u8], offset: usize, len: usize) -> std::io::Result<usize> {
        self.check(offset, len).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let iov = [
            libc::iovec { iov_base: head.as_ptr() as *mut libc::c_void, iov_len: head.len() },
            // SAFETY: offset+len is within the region (checked above).
            libc::iovec { iov_base: unsafe { self.ptr.as_ptr().add(offset) } as *mut libc::c_void, iov_len: len },
        ];
        // SAFETY: both iovecs describe readable memory for their lengths.
        unsafe { try_sendmsg(fd, &iov) }
    }

    /// Reads exactly `len` bytes from `fd` (a socket) into the region at `offset`: the
    /// receiving end of [`MemRegion::write_to_fd`], straight into registered memory.
    pub fn read_from_fd(&self, fd: BorrowedFd<'_>, offset: usize, len: usize) -> std::io::Result<()> {
        self.check(offset, len).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let mut done = 0usize;
        while done < len {
            // SAFETY: [offset+done, offset+len) is within the region (checked above) and
            // writable by the region's contract for write accessors.
            let n = unsafe { libc::read(fd.as_raw_fd(), self.ptr.as_ptr().add(offset + done) as *mut libc::c_void, len - done) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            done += n as usize;
        }
        Ok(())
    }

    /// Fills `len` bytes with zero.
    pub fn zero(&self, offset: usize, len: usize) -> Result<(), ShmError> {
        self.check(offset, len)?;
        // SAFETY: in bounds.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), 0, len) };
        Ok(())
    }
}

/// One non-blocking `sendmsg` of `iov` on socket `fd` (no SIGPIPE): the bytes the socket
/// took, 0 when it is full; EINTR retries.
///
/// # Safety
/// Every iovec describes memory readable for its length during the call.
pub unsafe fn try_sendmsg(fd: BorrowedFd<'_>, iov: &[libc::iovec]) -> std::io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len();
    loop {
        // SAFETY: `msg` points at the caller's iovecs, readable memory (contract above).
        let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(e),
        }
    }
}

/// An owned `mmap(MAP_SHARED)` of a sealed memfd; unmapped on drop.
#[derive(Debug)]
pub struct SharedMapping {
    region: MemRegion,
    map_len: usize,
}

impl SharedMapping {
    /// Maps the first `len` bytes of a memfd that is sealed against shrinking (checked here,
    /// so that no later `ftruncate` by another process can make an access fault).
    pub fn map_sealed(fd: BorrowedFd<'_>, len: usize, writable: bool) -> Result<Self, ShmError> {
        check_sealed(fd, len)?;
        // SAFETY: the fd is sealed against shrinking and at least len bytes long, so the
        // mapping stays valid for its whole life.
        unsafe { Self::map_fd(fd, 0, len, writable) }
    }

    /// Maps `len` bytes of `fd` at `offset`.
    ///
    /// # Safety
    /// The file must stay at least `offset + len` bytes long while mapped (a shrink would
    /// turn accesses into SIGBUS); use [`SharedMapping::map_sealed`] when it can't be trusted.
    pub unsafe fn map_fd(fd: BorrowedFd<'_>, offset: usize, len: usize, writable: bool) -> Result<Self, ShmError> {
        let map_len = len.max(1);
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: a fresh mapping at an address of the kernel's choosing; aliasing nothing.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), map_len, prot, libc::MAP_SHARED, fd.as_raw_fd(), offset as libc::off_t) };
        if p == libc::MAP_FAILED {
            return Err(ShmError::Map { len: map_len, errno: errno() });
        }
        // SAFETY: the mapping is valid for map_len bytes until drop.
        let region = unsafe { MemRegion::from_raw(p as *mut u8, len) };
        Ok(SharedMapping { region, map_len })
    }

    /// Reserves `len` bytes of address space (no access) to place several fd mappings in one
    /// contiguous range with [`SharedMapping::place_fd`].
    pub fn reserve(len: usize) -> Result<Self, ShmError> {
        let map_len = len.max(1);
        // SAFETY: a fresh anonymous PROT_NONE mapping aliasing nothing.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(ShmError::Map { len: map_len, errno: errno() });
        }
        // SAFETY: valid (if inaccessible) until drop; accessors are only used after place_fd.
        let region = unsafe { MemRegion::from_raw(p as *mut u8, len) };
        Ok(SharedMapping { region, map_len })
    }

    /// Maps `len` bytes of a sealed memfd at `fd_offset` over `[at, at+len)` of this
    /// reservation. `at` and `fd_offset` must be page-aligned.
    pub fn place_fd(&self, at: usize, fd: BorrowedFd<'_>, fd_offset: usize, len: usize, writable: bool) -> Result<(), ShmError> {
        let end = fd_offset.checked_add(len).ok_or(ShmError::OutOfBounds { offset: fd_offset, len, size: 0 })?;
        check_sealed(fd, end)?;
        if at.checked_add(len).is_none_or(|e| e > self.map_len) {
            return Err(ShmError::OutOfBounds { offset: at, len, size: self.map_len });
        }
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: [at, at+len) lies within our own reservation, so MAP_FIXED replaces only
        // memory this mapping owns; the fd is sealed and long enough.
        let p = unsafe {
            libc::mmap(
                self.region.ptr.as_ptr().add(at) as *mut libc::c_void,
                len,
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                fd_offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(ShmError::Map { len, errno: errno() });
        }
        Ok(())
    }

    /// The mapped memory.
    #[inline]
    pub fn region(&self) -> &MemRegion {
        &self.region
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: we own this mapping; no MemRegion derived from it outlives the owner by
        // the contract of `region()` users (they hold the SharedMapping in an Arc).
        unsafe { libc::munmap(self.region.ptr.as_ptr() as *mut libc::c_void, self.map_len) };
    }
}

/// Page size of this machine.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefetch is a hint: anywhere in a region, for reading or writing, and past its end
    /// (where it does nothing), it changes no byte.
    #[test]
    fn prefetch_changes_nothing_in_or_out_of_bounds() {
        let mut buf = vec![7u8; 256];
        // SAFETY: `buf` is live and writable for the whole test.
        let r = unsafe { MemRegion::from_raw(buf.as_mut_ptr(), buf.len()) };
        for off in [0, 63, 64, 255, 256, 4096, usize::MAX] {
            r.prefetch(off, false);
            r.prefetch(off, true);
        }
        assert!(buf.iter().all(|&b| b == 7));
    }
    use std::os::fd::AsFd;

    #[test]
    fn bounds_are_checked() {
        let fd = create_memfd("t", 4096, true).unwrap();
        let m = SharedMapping::map_sealed(fd.as_fd(), 4096, true).unwrap();
        let r = m.region();
        assert!(r.store_u64(4088, 7).is_ok());
        assert_eq!(r.load_u64(4088).unwrap(), 7);
        assert!(matches!(r.load_u64(4096), Err(ShmError::OutOfBounds { .. })));
        assert!(matches!(r.load_u64(3), Err(ShmError::Misaligned { .. })));
        assert!(r.write_from(4090, &[0; 7]).is_err());
        assert!(r.subregion(usize::MAX, 2).is_err());
    }

    #[test]
    fn unsealed_memfd_is_refused() {
        let fd = create_memfd("t", 4096, false).unwrap();
        assert!(matches!(SharedMapping::map_sealed(fd.as_fd(), 4096, true), Err(ShmError::NotSealed { .. })));
        let sealed = create_memfd("t", 4096, true).unwrap();
        assert!(SharedMapping::map_sealed(sealed.as_fd(), 8192, true).is_err());
    }

    #[test]
    fn two_mappings_share_bytes() {
        let fd = create_memfd("t", 8192, true).unwrap();
        let a = SharedMapping::map_sealed(fd.as_fd(), 8192, true).unwrap();
        let b = SharedMapping::map_sealed(fd.as_fd(), 8192, false).unwrap();
        a.region().write_from(100, b"hello").unwrap();
        let mut out = [0u8; 5];
        b.region().read_into(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
    }
}
