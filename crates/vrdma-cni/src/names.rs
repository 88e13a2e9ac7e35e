//! Names derived from an attachment's key (container ID, ifname), so that DEL finds what an
//! ADD made even when the ADD died before recording it.

/// 64-bit FNV-1a of `container_id`, a NUL, `ifname`.
fn key_hash(container_id: &str, ifname: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in container_id.bytes().chain([0]).chain(ifname.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The host end of the veth pair: `vc` + 11 hex digits (13 bytes; `vrdma run` uses `vr…`).
pub fn host_veth(container_id: &str, ifname: &str) -> String {
    format!("vc{:011x}", key_hash(container_id, ifname) & 0xfff_ffff_ffff)
}

/// The vNIC the plugin creates for an attachment: `cni-`, the container ID's first 12
/// characters (`.` becomes `_`: vNIC names are `[A-Za-z0-9_-]`), `-`, 8 hex digits of the
/// key's hash (container IDs may share a prefix).
pub fn vnic(container_id: &str, ifname: &str) -> String {
    let short: String = container_id.chars().take(12).map(|c| if c == '.' { '_' } else { c }).collect();
    format!("cni-{short}-{:08x}", key_hash(container_id, ifname) >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_stable_distinct_and_valid() {
        let a = host_veth("c0ffee", "eth0");
        assert_eq!(a, host_veth("c0ffee", "eth0"));
        assert_eq!(a.len(), 13);
        assert!(a.starts_with("vc"));
        assert_ne!(a, host_veth("c0ffee", "net1"));
        assert_ne!(a, host_veth("c0ffe", "eeth0"));
        let v = vnic("0123456789abcdef.x", "eth0");
        assert!(v.starts_with("cni-0123456789ab-"), "{v}");
        assert!(v.len() <= 64 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        assert_ne!(vnic("samecontainerprefix1", "eth0"), vnic("samecontainerprefix2", "eth0"));
        assert_eq!(vnic("a.b", "eth0"), vnic("a.b", "eth0"));
        assert!(vnic("a.b", "eth0").starts_with("cni-a_b-"));
    }
}
