//! Keeping the spec file current: written whole to a temporary name and renamed, so a
//! runtime reading the directory at any moment sees the old spec or the new one, never a
//! part; removed when there is no device.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use crate::{CdiError, Spec, SPEC_FILE};

/// The spec's path in `dir`.
pub fn spec_path(dir: &Path) -> PathBuf {
    dir.join(SPEC_FILE)
}

/// Makes `<dir>/vrdma.io-vnic.json` hold `spec`, or removes it for None (see
/// [`write_spec_file`]).
pub fn write_spec(dir: &Path, spec: Option<&Spec>) -> Result<bool, CdiError> {
    write_spec_file(&spec_path(dir), spec)
}

/// Makes file `path` hold `spec`, or removes it for None. Returns whether the file changed
/// (an identical spec is not rewritten, so watching runtimes are not woken for nothing).
pub fn write_spec_file(path: &Path, spec: Option<&Spec>) -> Result<bool, CdiError> {
    let path = path.to_path_buf();
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| SPEC_FILE.into());
    let Some(spec) = spec else {
        return match std::fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(source) => Err(CdiError::Remove { path, source }),
        };
    };
    let mut text = serde_json::to_vec_pretty(spec)?;
    text.push(b'\n');
    if std::fs::read(&path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    std::fs::create_dir_all(&dir).map_err(|source| CdiError::Dir { path: dir.clone(), source })?;
    // A dot name ending in .tmp: runtimes load only *.json and *.yaml.
    let tmp = dir.join(format!(".{file_name}.{}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&text)?;
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        CdiError::Write { path: path.clone(), source }
    })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{spec_for, VnicDevice};

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vrdma-cdi-write-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn writes_replaces_skips_identical_and_removes() {
        let dir = scratch("cycle");
        let one = spec_for(&[VnicDevice { name: "a".into(), dir: "/run/vrdma/vnics/a".into() }], None).unwrap();
        assert!(write_spec(&dir, Some(&one)).unwrap(), "first write creates the directory and the file");
        let back: Spec = serde_json::from_slice(&std::fs::read(spec_path(&dir)).unwrap()).unwrap();
        assert_eq!(back, one);
        assert!(!write_spec(&dir, Some(&one)).unwrap(), "an identical spec is not rewritten");
        let two =
            spec_for(&[VnicDevice { name: "a".into(), dir: "/x/a".into() }, VnicDevice { name: "b".into(), dir: "/x/b".into() }], None)
                .unwrap();
        assert!(write_spec(&dir, Some(&two)).unwrap());
        let back: Spec = serde_json::from_slice(&std::fs::read(spec_path(&dir)).unwrap()).unwrap();
        assert_eq!(back.devices.len(), 2);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [SPEC_FILE], "no temporary file is left behind");
        let mode = std::fs::metadata(spec_path(&dir)).unwrap().permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o644);
        assert!(write_spec(&dir, None).unwrap(), "no device: the file goes");
        assert!(!spec_path(&dir).exists());
        assert!(!write_spec(&dir, None).unwrap(), "removing a missing spec is no change");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_that_cannot_be_made_is_an_error() {
        let dir = scratch("blocked");
        std::fs::write(&dir, b"a file where the directory should be").unwrap();
        let one = spec_for(&[VnicDevice { name: "a".into(), dir: "/x/a".into() }], None).unwrap();
        let e = write_spec(&dir.join("cdi"), Some(&one)).unwrap_err();
        assert!(matches!(e, CdiError::Dir { .. }), "{e}");
        std::fs::remove_file(&dir).unwrap();
    }
}
