//! What vrdma's tests share.
//!
//! An end-to-end test needs root, network namespaces or a program from a Debian package.
//! Where that is missing on a developer's machine, the test says so and returns; under CI
//! (`CI=true`) or with `VRDMA_E2E=1` a missing prerequisite fails the test instead, so a
//! suite can never pass by running nothing. [`skip`] is the one place that decides.

use std::io::Write;
use std::path::Path;

/// True where a missing prerequisite must fail the test: `CI=true` or `VRDMA_E2E=1`.
pub fn prerequisites_required() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") || std::env::var("VRDMA_E2E").is_ok_and(|v| v == "1")
}

/// A test (named `test`) cannot run here, because of `why`. Under CI this panics; elsewhere
/// it prints one line, appends it to the file `VRDMA_SKIP_LOG` names (so `scripts/test.sh`
/// can list every skip at the end), and returns so the test can.
#[track_caller]
pub fn skip(test: &str, why: impl std::fmt::Display) {
    let line = format!("SKIPPED {test}: {why}");
    if prerequisites_required() {
        panic!("{line} (a missing prerequisite fails the test under CI=true or VRDMA_E2E=1)");
    }
    eprintln!("{line}");
    if let Some(log) = std::env::var_os("VRDMA_SKIP_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// True when the process runs as root (network namespaces, veth, cgroups need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

/// True when running as root; otherwise [`skip`]s `test` and returns false.
#[track_caller]
pub fn require_root(test: &str) -> bool {
    if is_root() {
        return true;
    }
    skip(test, "needs root (network namespaces, veth, cgroups)");
    false
}

/// True when every one of `paths` exists; otherwise [`skip`]s `test`, naming the first
/// missing one and `install` (what provides it), and returns false.
#[track_caller]
pub fn require_files(test: &str, paths: &[&str], install: &str) -> bool {
    match paths.iter().find(|p| !Path::new(p).exists()) {
        None => true,
        Some(p) => {
            skip(test, format_args!("{p} is missing (install {install})"));
            false
        }
    }
}

/// [`require_files`] for programs in /usr/bin.
#[track_caller]
pub fn require_programs(test: &str, programs: &[&str], install: &str) -> bool {
    let paths: Vec<String> = programs.iter().map(|p| format!("/usr/bin/{p}")).collect();
    let refs: Vec<&str> = paths.iter().map(String::as_str).collect();
    require_files(test, &refs, install)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn present_files_are_no_reason_to_skip() {
        assert!(require_files("t", &["/", "/proc/self"], "nothing"));
    }

    #[test]
    fn a_missing_file_skips_or_fails_as_the_environment_says() {
        let missing = "/nonexistent/vrdma-test-support-probe";
        let run = std::panic::catch_unwind(|| require_files("t", &[missing], "nothing"));
        if prerequisites_required() {
            assert!(run.is_err(), "under CI a missing prerequisite must fail the test");
        } else {
            assert_eq!(run.ok(), Some(false));
        }
    }
}
