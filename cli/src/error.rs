//! Typed errors of the CLI; `Display` is the message printed after `flash-attn-cli: error: `.

use std::path::PathBuf;

/// Everything that can go wrong between the command line and the output files.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The command line is inconsistent in a way clap does not check.
    #[error("{0}")]
    Usage(String),
    /// An I/O error on `path`.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file ends before what its header declares (or before the header itself).
    #[error("{}: truncated: {what} needs {expected} bytes, the file has {got}", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Which part is cut short.
        what: &'static str,
        /// Bytes needed.
        expected: u64,
        /// Bytes present.
        got: u64,
    },
    /// More bytes follow the data that the header declares.
    #[error("{}: {extra} unexpected bytes after the declared data", path.display())]
    TrailingData {
        /// The file.
        path: PathBuf,
        /// At least this many extra bytes (reading stops at the first).
        extra: u64,
    },
    /// A header length beyond the cap, read before allocating anything.
    #[error("{}: header length {len} exceeds the limit of {max} bytes", path.display())]
    HeaderTooLarge {
        /// The file.
        path: PathBuf,
        /// Declared header length.
        len: u64,
        /// The cap.
        max: u64,
    },
    /// Not a file of the expected format, or a malformed header.
    #[error("{}: {message}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// An element type the CLI does not read or write.
    #[error("{}: unsupported dtype {dtype}; {supported}", path.display())]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The dtype as the file spells it.
        dtype: String,
        /// What is supported instead.
        supported: &'static str,
    },
    /// A tensor name that the safetensors file lacks.
    #[error("{}: no tensor `{name}` (the file holds: {have}; pick names with --q/--k/--v/--do)", path.display())]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The missing name.
        name: String,
        /// The names present, comma-separated.
        have: String,
    },
    /// Q, K, V (and dO for the backward pass) of different dtypes.
    #[error(
        "Q, K, V (and dO) must have one dtype: `{q}` is {q_dtype}, `{other}` is {other_dtype}"
    )]
    MixedDtypes {
        /// Q's name.
        q: String,
        /// Q's dtype.
        q_dtype: String,
        /// The other tensor's name.
        other: String,
        /// Its dtype.
        other_dtype: String,
    },
    /// A tensor that is not `[B, N, H, d]`.
    #[error("tensor `{name}` must have rank 4 [B, N, H, d], got shape {shape:?}")]
    Rank {
        /// The tensor.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// Two paths that would name the same file: an output and an input, or two outputs.
    #[error("{what} {} is the same file as {other} {}; refusing to overwrite", path.display(), other_path.display())]
    Alias {
        /// Which output (`-o`, `--npy-out O`, ...).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Which other path.
        other: &'static str,
        /// That path.
        other_path: PathBuf,
    },
    /// An output that cannot be written (missing directory, a directory in its place, ...).
    #[error("{what} {}: cannot write: {reason}", path.display())]
    Unwritable {
        /// Which output.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The forward pass (or its shape/parameter checks) failed.
    #[error("{0}")]
    Attention(String),
}

/// Shorthand for results of the CLI.
pub type Result<T, E = CliError> = std::result::Result<T, E>;
