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
    /// The head dim is 0 or above 256.
    #[error("unsupported head dim {0} (1..=256 is supported)")]
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
    /// A size does not fit the kernels' 32-bit counters (sequence lengths, heads, batch).
    #[error("size too large: {0}")]
    TooLarge(String),
    /// Tensors live on different devices or contexts.
    #[error("device mismatch: {0}")]
    DeviceMismatch(String),
    /// Reading or writing a tensor file failed.
    #[error("I/O: {0}")]
    Io(String),
}
