//! Element types.

use crate::error::{FlashError, Result};
use flash_attn_kernels::registry::KernelDType;
use half::{bf16, f16};

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// f32.
    F32,
    /// i32 (sequence lengths and block tables of the decode path).
    I32,
}

impl DType {
    /// Size in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
        }
    }

    /// The GPU kernels' element type for this one: f16 and bf16; [`FlashError::DType`] for
    /// the others.
    pub(crate) fn kernel(self) -> Result<KernelDType> {
        match self {
            DType::F16 => Ok(KernelDType::F16),
            DType::BF16 => Ok(KernelDType::Bf16),
            DType::F32 | DType::I32 => Err(FlashError::DType(
                "the GPU kernels take f16 or bf16 (use the CPU backend for f32)".into(),
            )),
        }
    }
}

/// A scalar type that tensors of this crate hold: `f16`, `bf16`, `f32`, or `i32` (the decode
/// path's lengths and block tables).
pub trait Element:
    Copy
    + Default
    + Send
    + Sync
    + std::fmt::Debug
    + cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
    + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Converts to f32 exactly.
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (nearest even).
    fn from_f32(x: f32) -> Self;
    /// A quiet NaN, used to poison outputs in tests.
    fn nan() -> Self;
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn nan() -> Self {
        f16::NAN
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn nan() -> Self {
        bf16::NAN
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn nan() -> Self {
        f32::NAN
    }
}

impl Element for i32 {
    const DTYPE: DType = DType::I32;
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(x: f32) -> Self {
        x as i32
    }
    /// There is no NaN integer: `i32::MIN` (an invalid length or page index) stands in.
    fn nan() -> Self {
        i32::MIN
    }
}
