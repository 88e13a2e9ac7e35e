//! Whether a range of a process's address space is mapped with the protection an access
//! needs, from its `/proc/PID/maps`: what the process itself could read or write there.
//! (`/proc/PID/mem` alone would also write read-only private pages, as a debugger does.)

/// One line of `/proc/PID/maps`: `[start, end)` and whether it is readable and writable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mapping {
    start: u64,
    end: u64,
    read: bool,
    write: bool,
}

fn parse_line(line: &str) -> Option<Mapping> {
    let mut f = line.split_ascii_whitespace();
    let (start, end) = f.next()?.split_once('-')?;
    let perms = f.next()?.as_bytes();
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        read: perms.first() == Some(&b'r'),
        write: perms.get(1) == Some(&b'w'),
    })
}

/// Whether `maps` (the text of `/proc/PID/maps`) covers `[addr, addr+len)` without a gap
/// with readable (and, if `write`, writable) mappings.
pub(super) fn covers(maps: &str, addr: u64, len: u64, write: bool) -> bool {
    let Some(end) = addr.checked_add(len) else { return false };
    let mut at = addr;
    // (The kernel lists mappings in address order.)
    for m in maps.lines().filter_map(parse_line) {
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

    const MAPS: &str = "\
1000-3000 rw-p 00000000 00:00 0
3000-4000 r--p 00000000 08:01 42 /lib/x
4000-5000 ---p 00000000 00:00 0
6000-8000 rw-s 00000000 00:01 7 /memfd:a (deleted)
";

    #[test]
    fn needs_every_byte_mapped_with_the_access() {
        assert!(covers(MAPS, 0x1000, 0x2000, true));
        assert!(covers(MAPS, 0x2fff, 2, false));
        assert!(!covers(MAPS, 0x2fff, 2, true), "crosses into a read-only mapping");
        assert!(!covers(MAPS, 0x3fff, 2, false), "crosses into an inaccessible one");
        assert!(!covers(MAPS, 0x5fff, 2, false), "starts in a gap");
        assert!(!covers(MAPS, 0x7fff, 2, false), "ends past the last mapping");
        assert!(covers(MAPS, 0x6000, 0x2000, true));
        assert!(!covers(MAPS, 0x800, 0x900, false), "before the first mapping");
        assert!(!covers(MAPS, u64::MAX, 2, false), "wraps");
    }
}
