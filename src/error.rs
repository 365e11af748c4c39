//! The one error type of the crate.
//!
//! Every variant says what went wrong and where (which file, which tensor,
//! which argument). The Python layer maps each variant to exactly one
//! exception class in `python/colibri/_errors.py`; that mapping lives in
//! `src/python/mod.rs` and nowhere else.

use std::path::{Path, PathBuf};

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in colibri, grouped by who has to act on it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `.colibri` file is malformed, truncated or of an unknown version.
    #[error("{path}: {msg}")]
    Format {
        /// The file being read.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },

    /// The Hugging Face checkpoint names an architecture or a feature that is
    /// not implemented.
    #[error("{0}")]
    Unsupported(String),

    /// The Hugging Face checkpoint is inconsistent: a tensor is missing, has
    /// the wrong shape or dtype, a config field is absent or out of range.
    #[error("{path}: {msg}")]
    Checkpoint {
        /// The checkpoint folder or file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },

    /// The caller passed something unusable (token id out of range, empty
    /// prompt, bad option value).
    #[error("{0}")]
    InvalidInput(String),

    /// The sequence does not fit in the context window.
    #[error("{0}")]
    ContextOverflow(String),

    /// The output of a conversion already exists and overwriting was not asked for.
    #[error("{}: already exists; pass force=True (CLI: --force) to overwrite it", .0.display())]
    OutputExists(PathBuf),

    /// A file or folder the caller named does not exist.
    #[error("{}: no such file or directory", .0.display())]
    NotFound(PathBuf),

    /// Any other operating-system error, with the path it happened on.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file the operation was on.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// Reading a routed expert from the model file failed while streaming
    /// (an I/O error, a short read because the file was truncated, or the
    /// file gone). The call that needed the expert fails; the engine stays
    /// usable, and a later call works again once the file is back.
    #[error("{}: cannot read expert {expert} of layer {layer}: {source}", path.display())]
    ExpertRead {
        /// The model file.
        path: PathBuf,
        /// Layer of the expert.
        layer: usize,
        /// Expert index within the layer.
        expert: usize,
        /// The OS error (`UnexpectedEof` for a short read).
        #[source]
        source: std::io::Error,
    },

    /// The caller interrupted a long operation (Ctrl-C).
    #[error("interrupted")]
    Interrupted,

    /// A scheduler's queue is full: try again later.
    #[error("{0}")]
    Busy(String),

    /// An invariant of the engine itself did not hold: a bug in colibri, not
    /// a problem with the caller's input or files. The message says which.
    #[error("internal error (please report): {0}")]
    Internal(String),
}

impl Clone for Error {
    /// An equal error; an OS error keeps its kind and message (the OS code
    /// itself cannot be cloned).
    fn clone(&self) -> Self {
        let io = |e: &std::io::Error| std::io::Error::new(e.kind(), e.to_string());
        match self {
            Error::Format { path, msg } => Error::Format { path: path.clone(), msg: msg.clone() },
            Error::Unsupported(m) => Error::Unsupported(m.clone()),
            Error::Checkpoint { path, msg } => Error::Checkpoint { path: path.clone(), msg: msg.clone() },
            Error::InvalidInput(m) => Error::InvalidInput(m.clone()),
            Error::ContextOverflow(m) => Error::ContextOverflow(m.clone()),
            Error::OutputExists(p) => Error::OutputExists(p.clone()),
            Error::NotFound(p) => Error::NotFound(p.clone()),
            Error::Io { path, source } => Error::Io { path: path.clone(), source: io(source) },
            Error::ExpertRead { path, layer, expert, source } => {
                Error::ExpertRead { path: path.clone(), layer: *layer, expert: *expert, source: io(source) }
            }
            Error::Interrupted => Error::Interrupted,
            Error::Busy(m) => Error::Busy(m.clone()),
            Error::Internal(m) => Error::Internal(m.clone()),
        }
    }
}

impl Error {
    /// A format error about `path`.
    pub fn format(path: &Path, msg: impl Into<String>) -> Self {
        Error::Format { path: path.to_path_buf(), msg: msg.into() }
    }

    /// A checkpoint error about `path`.
    pub fn checkpoint(path: &Path, msg: impl Into<String>) -> Self {
        Error::Checkpoint { path: path.to_path_buf(), msg: msg.into() }
    }

    /// Wraps an I/O error with the path it happened on; a missing file gets
    /// its own variant so callers can tell it apart.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            Error::NotFound(path.to_path_buf())
        } else {
            Error::Io { path: path.to_path_buf(), source }
        }
    }
}
