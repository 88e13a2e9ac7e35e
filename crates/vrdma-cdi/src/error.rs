//! Errors of writing a CDI spec.

use std::path::PathBuf;

/// Failures of [`crate::write_spec`].
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("creating CDI spec directory {path}: {source}")]
    Dir { path: PathBuf, source: std::io::Error },
    #[error("writing CDI spec {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("removing CDI spec {path}: {source}")]
    Remove { path: PathBuf, source: std::io::Error },
    #[error("encoding the CDI spec: {0}")]
    Encode(#[from] serde_json::Error),
}
