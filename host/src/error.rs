//! Typed errors. Every invalid input is reported before any launch; driver failures carry the
//! driver's own error.

use thiserror::Error;

/// Result alias of this crate.
pub type Result<T, E = FlashError> = std::result::Result<T, E>;

/// Everything that can go wrong in this crate.
#[derive(Debug, Error)]
pub enum FlashError {
    /// The CUDA driver library could not be loaded, or reports no device.
    #[error("no CUDA device available: {0}")]
    NoDevice(String),
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// The device's compute capability has no kernels (sm_80 or newer is needed).
    #[error("unsupported GPU: compute capability {major}.{minor} (sm_80 or newer is required)")]
    UnsupportedDevice {
        /// Major compute capability.
        major: i32,
        /// Minor compute capability.
        minor: i32,
    },
    /// A tensor's shape does not fit the operation.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A tensor's element type does not fit the operation.
    #[error("dtype mismatch: {0}")]
    DType(String),
    /// A tensor's layout (strides, contiguity, offset) is not accepted.
    #[error("layout not supported: {0}")]
    Layout(String),
    /// The GPU kernels do not cover the head dim (they take 1..=256; the CPU backend takes any
    /// head dim ≥ 1, and a head dim of 0 is a [`FlashError::Shape`] error on every path).
    #[error(
        "unsupported head dim {0} on the GPU (1..=256 is supported; the CPU backend takes any)"
    )]
    HeadDim(usize),
    /// `heads_q` is not a multiple of `heads_kv`.
    #[error("GQA: {heads_q} query heads is not a multiple of {heads_kv} key/value heads")]
    GqaRatio {
        /// Query heads.
        heads_q: usize,
        /// Key/value heads.
        heads_kv: usize,
    },
    /// A parameter value is invalid (softmax scale not finite, ...).
    #[error("invalid parameter: {0}")]
    Param(String),
    /// A size does not fit the kernels' 32-bit counters (sequence lengths, heads, batch), or
    /// the byte size of an output or temporary overflows `usize`/`isize`.
    #[error("size too large: {0}")]
    TooLarge(String),
    /// Host memory for an output or a temporary of the CPU backend could not be allocated.
    #[error("host allocation failed: {0}")]
    Alloc(String),
    /// Tensors live on different devices or contexts.
    #[error("device mismatch: {0}")]
    DeviceMismatch(String),
    /// Reading or writing a tensor file failed.
    #[error("I/O: {0}")]
    Io(String),
    /// The library itself is inconsistent (a kernel the registry names is not embedded): a
    /// build problem, not the caller's.
    #[error("internal error: {0}")]
    Internal(String),
}
