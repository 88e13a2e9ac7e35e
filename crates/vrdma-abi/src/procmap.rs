//! The mappings of an address space around a range, from an open `/proc/PID/maps`.
//!
//! Both the library (its own mappings, at registration) and vrdmad (a client's, before each
//! copy) need only the few mappings over one range, but the text of `/proc/PID/maps` lists
//! all of them: an MPI process has hundreds, and reading them took 175-200 µs a time, most of
//! a fresh buffer's registration (docs/measurements.md, "Mappings by query"). Linux 6.11's
//! `PROCMAP_QUERY` ioctl answers for one address; older kernels get the text, filtered to
//! the same answer.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;

/// One mapping, as a line of `/proc/PID/maps` describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vma {
    /// First address.
    pub start: u64,
    /// Address past the last byte.
    pub end: u64,
    /// Readable (`r`).
    pub read: bool,
    /// Writable (`w`).
    pub write: bool,
    /// Executable (`x`).
    pub exec: bool,
    /// Shared (`s`) rather than private (`p`).
    pub shared: bool,
    /// Offset in the mapped file (bytes).
    pub offset: u64,
    /// The file's path (`/memfd:NAME (deleted)` for a memfd), `[heap]`, `[stack]`,
    /// `[anon:NAME]`…, or empty for anonymous memory without a name.
    pub name: String,
}

impl Vma {
    /// The permissions as `/proc/PID/maps` writes them (`rw-p`).
    pub fn perms(&self) -> String {
        let f = |on: bool, c: char| if on { c } else { '-' };
        [f(self.read, 'r'), f(self.write, 'w'), f(self.exec, 'x'), if self.shared { 's' } else { 'p' }].iter().collect()
    }
}

/// `struct procmap_query` of `<linux/fs.h>`.
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong =
    (3 << 30) | ((std::mem::size_of::<ProcmapQuery>() as libc::c_ulong) << 16) | ((b'f' as libc::c_ulong) << 8) | 17;
const VMA_READABLE: u64 = 0x01;
const VMA_WRITABLE: u64 = 0x02;
const VMA_EXECUTABLE: u64 = 0x04;
const VMA_SHARED: u64 = 0x08;
const COVERING_OR_NEXT_VMA: u64 = 0x10;
/// Longest name the kernel returns (PATH_MAX).
const NAME_MAX: usize = 4096;

/// What one query found.
enum Found {
    Vma(Vma),
    /// No mapping there (or after, when asked for the next one).
    Nothing,
    /// The kernel has no `PROCMAP_QUERY`.
    Unsupported,
}

fn query(maps: &File, addr: u64, or_next: bool, name: &mut [u8]) -> std::io::Result<Found> {
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_flags: if or_next { COVERING_OR_NEXT_VMA } else { 0 },
        query_addr: addr,
        vma_name_size: name.len() as u32,
        vma_name_addr: name.as_mut_ptr() as u64,
        ..Default::default()
    };
    // SAFETY: PROCMAP_QUERY reads and writes `q` (its size given in `q.size`) and writes at
    // most `vma_name_size` bytes at `vma_name_addr`, which is `name`, alive and exclusively
    // borrowed for the call; no build ID is asked for (size 0).
    let r = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY as _, &mut q as *mut ProcmapQuery) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOENT) => Ok(Found::Nothing),
            Some(libc::ENOTTY | libc::EINVAL | libc::EOPNOTSUPP) => Ok(Found::Unsupported),
            _ => Err(e),
        };
    }
    // The name's size counts its NUL; 0: no name.
    let n = (q.vma_name_size as usize).min(name.len());
    let text = &name[..n.saturating_sub(1)];
    Ok(Found::Vma(Vma {
        start: q.vma_start,
        end: q.vma_end,
        read: q.vma_flags & VMA_READABLE != 0,
        write: q.vma_flags & VMA_WRITABLE != 0,
        exec: q.vma_flags & VMA_EXECUTABLE != 0,
        shared: q.vma_flags & VMA_SHARED != 0,
        offset: q.vma_offset,
        name: String::from_utf8_lossy(text).into_owned(),
    }))
}

/// The mappings of the address space of `maps` (an open `/proc/PID/maps`, which stays bound
/// to the address space it was opened on) that overlap `[lo, hi)`, in address order, preceded
/// by the mapping that ends right where the first of them starts, if there is one (callers
/// look at a mapping's neighbour below: a thread stack's guard).
pub fn mappings_around(maps: &File, lo: u64, hi: u64) -> std::io::Result<Vec<Vma>> {
    match by_query(maps, lo, hi)? {
        Some(v) => Ok(v),
        None => by_text(maps, lo, hi),
    }
}

/// [`mappings_around`] by `PROCMAP_QUERY`; None if the kernel has none.
fn by_query(maps: &File, lo: u64, hi: u64) -> std::io::Result<Option<Vec<Vma>>> {
    let mut name = vec![0u8; NAME_MAX];
    let mut out = Vec::new();
    let mut at = lo;
    while at < hi {
        match query(maps, at, true, &mut name)? {
            Found::Unsupported => return Ok(None),
            Found::Nothing => break,
            Found::Vma(v) if v.start >= hi => break,
            // (The kernel never answers with a mapping ending at or below the address; an
            // answer that did would loop forever.)
            Found::Vma(v) if v.end <= at => {
                return Err(std::io::Error::other(format!("PROCMAP_QUERY at {at:#x} answered {:#x}-{:#x}", v.start, v.end)))
            }
            Found::Vma(v) => {
                at = v.end;
                out.push(v);
            }
        }
    }
    if let Some(below) = out.first().map(|v| v.start).filter(|s| *s > 0) {
        match query(maps, below - 1, false, &mut name)? {
            Found::Vma(v) if v.end == below => out.insert(0, v),
            Found::Unsupported => return Ok(None),
            _ => {}
        }
    }
    Ok(Some(out))
}

/// [`mappings_around`] from the text.
fn by_text(maps: &File, lo: u64, hi: u64) -> std::io::Result<Vec<Vma>> {
    // Read into room reserved up front: /proc files report size 0, so a plain read_to_string
    // starts with small reads, each restarting the kernel's walk.
    let mut text = String::with_capacity(64 * 1024);
    let mut f = maps;
    f.seek(SeekFrom::Start(0))?;
    f.read_to_string(&mut text)?;
    Ok(around(text.lines().filter_map(parse_line).collect(), lo, hi))
}

/// Of `all` (in address order), those overlapping `[lo, hi)` and the one right below them.
fn around(all: Vec<Vma>, lo: u64, hi: u64) -> Vec<Vma> {
    let Some(first) = all.iter().position(|v| v.end > lo && v.start < hi) else { return Vec::new() };
    let from = if first > 0 && all[first - 1].end == all[first].start { first - 1 } else { first };
    all.into_iter().skip(from).take_while(|v| v.start < hi).collect()
}

/// One line of `/proc/PID/maps`: `start-end perms offset dev inode name`.
fn parse_line(line: &str) -> Option<Vma> {
    let mut it = line.split_ascii_whitespace();
    let (range, perms, off) = (it.next()?, it.next()?.as_bytes(), it.next()?);
    let (_dev, _inode) = (it.next()?, it.next()?);
    let name = it.collect::<Vec<_>>().join(" ");
    let (a, b) = range.split_once('-')?;
    Some(Vma {
        start: u64::from_str_radix(a, 16).ok()?,
        end: u64::from_str_radix(b, 16).ok()?,
        read: perms.first() == Some(&b'r'),
        write: perms.get(1) == Some(&b'w'),
        exec: perms.get(2) == Some(&b'x'),
        shared: perms.get(3) == Some(&b's'),
        offset: u64::from_str_radix(off, 16).ok()?,
        name,
    })
}

/// Whether `vmas` cover `[addr, addr+len)` without a gap, readable (and, with `write`,
/// writable): what the process itself could read or write there.
pub fn covers(vmas: &[Vma], addr: u64, len: u64, write: bool) -> bool {
    let Some(end) = addr.checked_add(len) else { return false };
    let mut at = addr;
    for m in vmas {
        if at >= end {
            break;
        }
        if m.end <= at {
            continue;
        }
        if m.start > at || !m.read || (write && !m.write) {
            return false;
        }
        at = m.end;
    }
    at >= end
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Linux 6.11 or later.
    fn kernel_has_the_query() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut it = release.split(|c: char| !c.is_ascii_digit()).map(|n| n.parse::<u32>().unwrap_or(0));
        (it.next().unwrap_or(0), it.next().unwrap_or(0)) >= (6, 11)
    }

    fn self_maps() -> File {
        File::open("/proc/self/maps").unwrap()
    }

    /// An anonymous mapping of `pages` pages with `prot`, at a kernel-chosen address.
    fn map(pages: usize, prot: i32) -> u64 {
        // SAFETY: a new anonymous mapping, touching nothing that exists.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), pages * 4096, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        assert_ne!(p, libc::MAP_FAILED);
        p as u64
    }

    /// Queries and text agree on every kind of range: within one mapping, across several with
    /// different permissions (which the kernel keeps apart), over a hole, and around a
    /// memfd's mapping with its name.
    #[test]
    fn the_query_and_the_text_agree() {
        let a = map(8, libc::PROT_READ | libc::PROT_WRITE);
        // SAFETY: pages of our own new mapping.
        unsafe {
            assert_eq!(libc::mprotect((a + 2 * 4096) as *mut _, 4096, libc::PROT_READ), 0);
            assert_eq!(libc::mprotect((a + 4 * 4096) as *mut _, 4096, libc::PROT_NONE), 0);
            assert_eq!(libc::munmap((a + 6 * 4096) as *mut _, 4096), 0);
        }
        let name = std::ffi::CString::new("procmap-test").unwrap();
        // SAFETY: memfd_create with a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: our new memfd, sized, then mapped at a kernel-chosen address.
        let m = unsafe {
            assert_eq!(libc::ftruncate(fd, 3 * 4096), 0);
            libc::mmap(std::ptr::null_mut(), 2 * 4096, libc::PROT_READ, libc::MAP_SHARED, fd, 4096) as u64
        };
        let f = self_maps();
        let heap = Box::new([0u8; 64]);
        let heap_at = heap.as_ptr() as u64;
        for (lo, hi) in
            [(a, a + 4096), (a, a + 8 * 4096), (a + 4096, a + 5 * 4096), (a + 5 * 4096, a + 8 * 4096), (m, m + 1), (heap_at, heap_at + 64)]
        {
            // (Other tests of this process map and unmap meanwhile, and a mapping the kernel
            // puts next to ours may merge with it between the two reads: a difference that
            // goes away when asked again is theirs; a wrong answer stays.)
            let mut tries = 0;
            let t = loop {
                let q = by_query(&f, lo, hi).unwrap();
                let t = by_text(&f, lo, hi).unwrap();
                tries += 1;
                match q {
                    Some(q) if q != t && tries < 20 => continue,
                    Some(q) => assert_eq!(q, t, "{lo:#x}-{hi:#x}"),
                    None => assert!(!kernel_has_the_query(), "PROCMAP_QUERY refused"),
                }
                break t;
            };
            assert!(t.iter().any(|v| v.end > lo && v.start < hi), "{lo:#x}-{hi:#x}: {t:?}");
        }
        let around_a = mappings_around(&f, a, a + 8 * 4096).unwrap();
        let perms: Vec<_> = around_a.iter().filter(|v| v.start >= a).map(|v| (v.start - a, v.perms())).collect();
        assert!(
            perms.starts_with(&[(0, "rw-p".into()), (2 * 4096, "r--p".into()), (3 * 4096, "rw-p".into()), (4 * 4096, "---p".into())]),
            "{perms:?}"
        );
        let memfd = mappings_around(&f, m, m + 4096).unwrap();
        let mv = memfd.iter().find(|v| v.start == m).unwrap();
        assert_eq!((mv.name.as_str(), mv.offset, mv.perms()), ("/memfd:procmap-test (deleted)", 4096, "r--s".into()));
        assert!(covers(&around_a, a, 2 * 4096, true) && !covers(&around_a, a, 3 * 4096, true) && covers(&around_a, a, 4 * 4096, false));
        assert!(!covers(&around_a, a, 5 * 4096, false), "PROT_NONE is not readable");
        assert!(!covers(&around_a, a + 5 * 4096, 2 * 4096, false), "a hole is not covered");
        // SAFETY: our own mappings and descriptor.
        unsafe {
            libc::munmap(a as *mut _, 8 * 4096);
            libc::munmap(m as *mut _, 2 * 4096);
            libc::close(fd);
        }
    }

    /// The neighbour below comes only when it touches the first mapping in range.
    #[test]
    fn the_neighbour_below_only_when_adjacent() {
        let v =
            |s: u64, e: u64| Vma { start: s, end: e, read: true, write: false, exec: false, shared: false, offset: 0, name: String::new() };
        let all = vec![v(0x1000, 0x2000), v(0x2000, 0x3000), v(0x5000, 0x6000), v(0x6000, 0x8000)];
        assert_eq!(around(all.clone(), 0x2800, 0x2900), vec![v(0x1000, 0x2000), v(0x2000, 0x3000)]);
        assert_eq!(around(all.clone(), 0x4000, 0x5001), vec![v(0x5000, 0x6000)]);
        assert_eq!(around(all.clone(), 0x7000, 0x9000), vec![v(0x5000, 0x6000), v(0x6000, 0x8000)]);
        assert!(around(all, 0x3000, 0x5000).is_empty());
    }

    #[test]
    fn needs_every_byte_mapped_with_the_access() {
        let maps = "\
1000-3000 rw-p 00000000 00:00 0
3000-4000 r--p 00000000 08:01 42 /lib/x
4000-5000 ---p 00000000 00:00 0
6000-8000 rw-s 00000000 00:01 7 /memfd:a (deleted)
";
        let all: Vec<Vma> = maps.lines().filter_map(parse_line).collect();
        assert_eq!(all[3].name, "/memfd:a (deleted)");
        assert!(covers(&all, 0x1000, 0x2000, true));
        assert!(covers(&all, 0x2000, 0x2000, false));
        assert!(!covers(&all, 0x2000, 0x2000, true), "read-only part");
        assert!(!covers(&all, 0x3800, 0x1000, false), "no access");
        assert!(!covers(&all, 0x5800, 0x1000, false), "hole");
        assert!(covers(&all, 0x6000, 0x2000, true));
        assert!(!covers(&all, 0x7000, 0x2000, false), "past the end");
        assert!(!covers(&all, u64::MAX - 1, 4, false), "overflow");
        assert!(covers(&all, 0x2fff, 2, false));
        assert!(!covers(&all, 0x2fff, 2, true), "crosses into a read-only mapping");
        assert!(!covers(&all, 0x3fff, 2, false), "crosses into an inaccessible one");
        assert!(!covers(&all, 0x5fff, 2, false), "starts in a gap");
        assert!(!covers(&all, 0x800, 0x900, false), "before the first mapping");
    }
}
