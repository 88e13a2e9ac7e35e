//! The node's vNIC slots: how many (fixed, or read from a file an operator or a ConfigMap
//! changes) and their device IDs, which are also the names of the vNICs bound to them.

use std::path::PathBuf;

/// The longest device ID the kubelet accepts (the API's limit; vrdmad's names allow 64).
const MAX_ID: usize = 63;

/// Where the number of slots comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotSource {
    /// A fixed number (`--slots N`).
    Fixed(u32),
    /// The number in a file (`--slots-file`), re-read on every health tick; `fallback` while
    /// the file is missing or unreadable.
    File {
        /// The file holding the number (surrounding whitespace ignored).
        path: PathBuf,
        /// The number of slots while the file says none.
        fallback: u32,
    },
}

impl SlotSource {
    /// The number of slots now.
    pub fn current(&self) -> u32 {
        match self {
            SlotSource::Fixed(n) => *n,
            SlotSource::File { path, fallback } => {
                std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(*fallback)
            }
        }
    }
}

/// Names the slots of one node. The names are stable (the same node and index always give
/// the same ID) and unique in the cluster (vNIC names are cluster-wide in etcd).
#[derive(Clone, Debug)]
pub struct SlotNames {
    prefix: String,
}

impl SlotNames {
    /// Slot names of node `node`: `k8s-<node>-<index>`, the node name cut to fit (with a hash
    /// of the whole name so two long names sharing a beginning stay apart).
    pub fn new(node: &str) -> SlotNames {
        let clean: String =
            node.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c.to_ascii_lowercase() } else { '-' }).collect();
        // Room for "k8s-", "-" and a five-digit index.
        let room = MAX_ID - 4 - 6;
        let node_part = if clean.len() <= room { clean } else { format!("{}-{:08x}", &clean[..room - 9], fnv1a(node.as_bytes())) };
        SlotNames { prefix: format!("k8s-{node_part}") }
    }

    /// Device ID (and vNIC name) of slot `index`.
    pub fn id(&self, index: u32) -> String {
        format!("{}-{index}", self.prefix)
    }

    /// The index of device ID `id`, when it names one of this node's slots.
    pub fn index(&self, id: &str) -> Option<u32> {
        let rest = id.strip_prefix(&self.prefix)?.strip_prefix('-')?;
        if rest.starts_with('0') && rest.len() > 1 {
            return None;
        }
        rest.parse().ok()
    }
}

fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(*b)).wrapping_mul(0x0100_0193))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_round_trip() {
        let n = SlotNames::new("Node-1.example");
        assert_eq!(n.id(3), "k8s-node-1-example-3");
        assert_eq!(SlotNames::new("Node-1.example").id(3), n.id(3));
        assert_eq!(n.index("k8s-node-1-example-3"), Some(3));
        assert_eq!(n.index("k8s-node-1-example-03"), None);
        assert_eq!(n.index("k8s-other-3"), None);
    }

    #[test]
    fn long_node_names_fit_and_stay_apart() {
        let a = SlotNames::new(&format!("{}a", "n".repeat(200)));
        let b = SlotNames::new(&format!("{}b", "n".repeat(200)));
        assert!(a.id(99999).len() <= MAX_ID);
        assert_ne!(a.id(0), b.id(0));
    }

    #[test]
    fn a_slot_file_is_reread_and_has_a_fallback() {
        let path = std::env::temp_dir().join(format!("vrdma-slots-{}", std::process::id()));
        let src = SlotSource::File { path: path.clone(), fallback: 2 };
        assert_eq!(src.current(), 2);
        std::fs::write(&path, "5\n").unwrap();
        assert_eq!(src.current(), 5);
        std::fs::remove_file(&path).unwrap();
    }
}
