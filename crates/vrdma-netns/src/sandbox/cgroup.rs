//! The container's cgroup: its processes get a cgroup of their own with `pids`, `memory`
//! (swap off) and `cpu` limits, removed when the container ends.
//!
//! cgroup v2 where the unified hierarchy has the controllers (`<parent>/vrdma/<name>-<pid>`,
//! `<parent>` being the parent of the caller's own cgroup, or the root; enabling them in
//! `cgroup.subtree_control` on the way); otherwise the v1 hierarchies of a hybrid host (one
//! directory per controller, under the caller's own cgroup there). Either way the limits of
//! whatever holds the caller (a pod, a slice) still bind the container. Parent side only:
//! the directories are made and the setup process is moved in before it forks the
//! container's init, which inherits the cgroup.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{Limits, NetnsError};

const CONTROLLERS: [&str; 3] = ["pids", "memory", "cpu"];

/// CFS period for `--cpus` (100 ms, as Docker and runc use).
const CPU_PERIOD_US: u64 = 100_000;

/// One cgroup directory per hierarchy the limits live in.
#[derive(Debug)]
pub(crate) struct Cgroup {
    dirs: Vec<PathBuf>,
    version: u8,
}

fn err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> NetnsError + 'a {
    move |source| NetnsError::Cgroup { path: path.to_path_buf(), what, source }
}

fn write(dir: &Path, file: &str, value: &str) -> Result<(), NetnsError> {
    let p = dir.join(file);
    std::fs::write(&p, value).map_err(|source| NetnsError::Cgroup { path: p.clone(), what: "writing a limit", source })
}

/// `(mount point, fstype, options)` of every cgroup mount in /proc/self/mounts.
fn cgroup_mounts() -> Vec<(PathBuf, String, String)> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4 && (f[2] == "cgroup2" || f[2] == "cgroup")).then(|| (PathBuf::from(f[1]), f[2].to_string(), f[3].to_string()))
        })
        .collect()
}

/// The caller's cgroup path, without its leading `/`, in the first hierarchy of
/// /proc/self/cgroup (`N:controllers:/path`) whose controller list `ctrls` accepts.
fn own_path(ctrls: impl Fn(&str) -> bool) -> String {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    own.lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, c, path) = (f.next()?, f.next()?, f.next()?);
            ctrls(c).then(|| path.trim().trim_start_matches('/').to_string())
        })
        .next()
        .unwrap_or_default()
}

/// The caller's cgroup path in the v1 hierarchy of `controller`.
fn own_v1_path(controller: &str) -> String {
    own_path(|c| c.split(',').any(|c| c == controller))
}

/// The caller's cgroup path in the unified hierarchy (its line has no controllers); empty at
/// the root.
fn own_v2_path() -> String {
    own_path(str::is_empty)
}

/// Makes `<base>/vrdma/<leaf>` with `needed` controllers enabled on the way (each cgroup
/// enables them for its children in `cgroup.subtree_control`; one already enabling them is
/// left alone, as writing there fails in a cgroup that holds processes).
fn v2_leaf(base: &Path, needed: &[&str], leaf: &str) -> Result<PathBuf, NetnsError> {
    let enable = |dir: &Path| -> Result<(), NetnsError> {
        let on = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
        if needed.iter().all(|c| on.split_whitespace().any(|o| o == *c)) {
            return Ok(());
        }
        let want: String = needed.iter().map(|c| format!("+{c} ")).collect();
        write(dir, "cgroup.subtree_control", want.trim())
    };
    enable(base)?;
    let parent = base.join("vrdma");
    std::fs::create_dir_all(&parent).map_err(err(&parent, "creating"))?;
    sweep_stale(&parent);
    enable(&parent)?;
    let dir = parent.join(leaf);
    std::fs::create_dir(&dir).map_err(err(&dir, "creating"))?;
    Ok(dir)
}

/// Where the hierarchies are mounted when the caller's mount namespace shows none.
const PRIVATE_MOUNTS: &str = "/run/vrdma-cgroup";

/// Mounts, in the caller's own mount namespace, the cgroup hierarchies that hold `needed`
/// controllers but are not mounted there: under `ip netns exec` (a new mount namespace
/// with a fresh /sys) /sys/fs/cgroup is empty, though the process is in cgroups as usual.
/// The hierarchies come from /proc/self/cgroup (`0::/path` for the unified one, `N:a,b:/path`
/// for a v1 hierarchy, mounted with exactly its controller set, which attaches to the
/// existing hierarchy). A mount that fails is skipped: the caller reports what stays missing.
fn mount_missing_hierarchies(needed: &[&str]) {
    let mounts = cgroup_mounts();
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(_)) = (f.next(), f.next(), f.next()) else { continue };
        let (fstype, data, dir) = if ctrls.is_empty() {
            if mounts.iter().any(|(_, fs, _)| fs == "cgroup2") {
                continue;
            }
            ("cgroup2", None, "unified".to_string())
        } else {
            let list: Vec<&str> = ctrls.split(',').filter(|c| !c.starts_with("name=")).collect();
            let wanted = list.iter().any(|c| needed.contains(c));
            let mounted = mounts.iter().any(|(_, fs, opts)| fs == "cgroup" && list.iter().all(|c| opts.split(',').any(|o| o == *c)));
            if !wanted || mounted {
                continue;
            }
            ("cgroup", Some(list.join(",")), list.join(","))
        };
        let target = Path::new(PRIVATE_MOUNTS).join(dir);
        if std::fs::create_dir_all(&target).is_err() {
            continue;
        }
        let already = mounts.iter().any(|(m, ..)| *m == target);
        if !already {
            if let Err(e) = nix::mount::mount(Some(fstype), &target, Some(fstype), nix::mount::MsFlags::empty(), data.as_deref()) {
                log::debug!("mounting cgroup hierarchy {ctrls:?} at {}: {e}", target.display());
            }
        }
    }
}

impl Cgroup {
    /// Makes the container's cgroup `<name>-<pid>` with `limits`; `None` when no limit is
    /// set. Fails when a limit is set and no hierarchy offers its controller.
    pub(crate) fn create(name: &str, pid: i32, limits: &Limits) -> Result<Option<Cgroup>, NetnsError> {
        if limits.pids.is_none() && limits.memory.is_none() && limits.cpu_millis.is_none() {
            return Ok(None);
        }
        let leaf = format!("{name}-{pid}");
        let needed: Vec<&str> = CONTROLLERS
            .iter()
            .zip([limits.pids.is_some(), limits.memory.is_some(), limits.cpu_millis.is_some()])
            .filter_map(|(c, set)| set.then_some(*c))
            .collect();
        mount_missing_hierarchies(&needed);
        let mounts = cgroup_mounts();
        // v2 when its root offers every controller we need.
        if let Some((root, ..)) = mounts.iter().find(|(m, fs, _)| {
            fs == "cgroup2" && {
                let have = std::fs::read_to_string(m.join("cgroup.controllers")).unwrap_or_default();
                needed.iter().all(|c| have.split_whitespace().any(|h| h == *c))
            }
        }) {
            // Beside the caller's own cgroup (which holds the caller, so it cannot have children
            // with controllers): under its parent, whose limits (a pod's, a slice's) then bind
            // the container too. Where that parent does not offer the controllers (or has
            // processes of its own), at the root, said on stderr.
            let own = own_v2_path();
            let beside = Path::new(&own).parent().filter(|p| !p.as_os_str().is_empty()).map(|p| root.join(p));
            let dir = match beside.as_deref().map(|b| v2_leaf(b, &needed, &leaf)) {
                Some(Ok(dir)) => dir,
                tried => {
                    if let Some(Err(e)) = tried {
                        eprintln!("vrdma run: the container's cgroup goes under the root, not beside /{own}: {e}");
                    }
                    v2_leaf(root, &needed, &leaf)?
                }
            };
            let cg = Cgroup { dirs: vec![dir.clone()], version: 2 };
            if let Some(n) = limits.pids {
                write(&dir, "pids.max", &n.to_string())?;
            }
            if let Some(b) = limits.memory {
                write(&dir, "memory.max", &b.to_string())?;
                if dir.join("memory.swap.max").exists() {
                    write(&dir, "memory.swap.max", "0")?;
                }
            }
            if let Some(c) = limits.cpu_millis {
                write(&dir, "cpu.max", &format!("{} {CPU_PERIOD_US}", cpu_quota(c)))?;
            }
            return Ok(Some(cg));
        }
        // v1: one directory per controller.
        let mut cg = Cgroup { dirs: Vec::new(), version: 1 };
        for controller in needed {
            let Some((mount, ..)) = mounts.iter().find(|(_, fs, opts)| fs == "cgroup" && opts.split(',').any(|o| o == controller)) else {
                cg.remove();
                return Err(NetnsError::Cgroup {
                    path: PathBuf::from("/sys/fs/cgroup"),
                    what: "finding a hierarchy with the controller for a limit",
                    source: io::Error::new(io::ErrorKind::NotFound, format!("no cgroup controller {controller:?} is mounted")),
                });
            };
            let parent = mount.join(own_v1_path(controller)).join("vrdma");
            std::fs::create_dir_all(&parent).map_err(err(&parent, "creating"))?;
            sweep_stale(&parent);
            let dir = parent.join(&leaf);
            std::fs::create_dir_all(&dir).map_err(err(&dir, "creating"))?;
            cg.dirs.push(dir.clone());
            let limited = match controller {
                "pids" => limits.pids.map(|n| write(&dir, "pids.max", &n.to_string())),
                "memory" => limits.memory.map(|b| {
                    write(&dir, "memory.limit_in_bytes", &b.to_string())?;
                    if dir.join("memory.memsw.limit_in_bytes").exists() {
                        write(&dir, "memory.memsw.limit_in_bytes", &b.to_string())?;
                    }
                    Ok(())
                }),
                _ => limits.cpu_millis.map(|c| {
                    write(&dir, "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
                    write(&dir, "cpu.cfs_quota_us", &cpu_quota(c).to_string())
                }),
            };
            if let Some(Err(e)) = limited {
                cg.remove();
                return Err(e);
            }
        }
        Ok(Some(cg))
    }

    /// Moves `pid` (and so everything it forks afterwards) into the cgroup.
    pub(crate) fn add(&self, pid: i32) -> Result<(), NetnsError> {
        for dir in &self.dirs {
            write(dir, "cgroup.procs", &pid.to_string())?;
        }
        Ok(())
    }

    /// Removes the directories (after killing what is left, which should be nothing: the
    /// container's PID namespace died with its init). Retries briefly while the last
    /// processes are being reaped.
    pub(crate) fn remove(&self) {
        for dir in self.dirs.iter().rev() {
            if self.version == 2 {
                let _ = std::fs::write(dir.join("cgroup.kill"), "1");
            }
            let deadline = Instant::now() + Duration::from_secs(2);
            loop {
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) if Instant::now() >= deadline => {
                        log::warn!("removing cgroup {}: {e}", dir.display());
                        break;
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        }
    }
}

/// Removes the cgroups of containers whose `vrdma run` was killed before it could (named
/// `<name>-<pid>` after a setup process that no longer exists, and empty: rmdir refuses
/// a cgroup with processes).
fn sweep_stale(parent: &Path) {
    for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.rsplit_once('-')).and_then(|(_, p)| p.parse::<u32>().ok()) else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

/// The quota per `CPU_PERIOD_US` for `millis` thousandths of a CPU (at least 1 ms).
fn cpu_quota(millis: u64) -> u64 {
    (millis.saturating_mul(CPU_PERIOD_US) / 1000).max(1000)
}

/// Parses a byte count with an optional binary suffix: `4096`, `512k`, `256M`, `4G`, `1T`
/// (also `KiB`-style and `b`), as Docker's `--memory` does.
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let num: f64 = num.parse().ok()?;
    let shift = match unit.to_ascii_lowercase().trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return None,
    };
    let bytes = num * (1u64 << shift) as f64;
    (bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_dockers() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("256M"), Some(256 << 20));
        assert_eq!(parse_size("4g"), Some(4 << 30));
        assert_eq!(parse_size("1.5G"), Some(3 << 29));
        assert_eq!(parse_size("512KiB"), Some(512 << 10));
        assert_eq!(parse_size("12x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("0"), None);
    }

    #[test]
    fn cpu_quota_is_per_100ms_period() {
        assert_eq!(cpu_quota(1000), 100_000);
        assert_eq!(cpu_quota(500), 50_000);
        assert_eq!(cpu_quota(1), 1000);
    }

    #[test]
    fn no_limits_no_cgroup() {
        assert!(Cgroup::create("x", 1, &Limits { pids: None, memory: None, cpu_millis: None }).unwrap().is_none());
    }
}
