//! Errors of writing a CDI spec.

use std::path::PathBuf;

/// Failures of [`crate::write_spec`].
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// The spec directory could not be created.
    #[error("creating CDI spec directory {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The spec (or its temporary file) could not be written or renamed into place.
    #[error("writing CDI spec {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A spec with no device left could not be removed.
    #[error("removing CDI spec {path}: {source}")]
    Remove {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The spec could not be encoded as JSON.
    #[error("encoding the CDI spec: {0}")]
    Encode(#[from] serde_json::Error),
}
