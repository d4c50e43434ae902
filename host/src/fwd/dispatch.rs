//! Which compiled kernel runs a call: the one decision between the validated inputs and the
//! launch.

use flash_attn_kernels::arch::Arch;
use flash_attn_kernels::config::FwdTile;
use flash_attn_kernels::registry::{self, KernelDType, MaskKind};

use crate::dtype::DType;
use crate::error::{FlashError, Result};

/// A forward kernel chosen for a call: its entry point and its tile on this device's target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FwdKernel {
    /// Entry point name (see `flash_attn_kernels::registry`).
    pub name: &'static str,
    /// Tile shape: block size, launch threads and shared memory.
    pub tile: FwdTile,
}

/// The forward kernel for a target, element type, head dim, mask and dropout: the registry's
/// kernel of that mask kind and dropout (see `registry::fwd_kernel`) with the smallest
/// compiled head dim ≥ `head_dim` (the kernel pads the rest with zeros). Errors:
/// [`FlashError::DType`] for f32, [`FlashError::HeadDim`] when no kernel covers `head_dim`.
pub(crate) fn fwd_kernel(
    arch: Arch,
    dtype: DType,
    head_dim: usize,
    mask: MaskKind,
    dropout: bool,
) -> Result<FwdKernel> {
    let dtype = match dtype {
        DType::F16 => KernelDType::F16,
        DType::BF16 => KernelDType::Bf16,
        DType::F32 | DType::I32 => {
            return Err(FlashError::DType(
                "the GPU kernels take f16 or bf16 (use the CPU backend for f32)".into(),
            ))
        }
    };
    match registry::fwd_kernel(head_dim, mask, dropout) {
        Some(k) => Ok(FwdKernel {
            name: k.name(dtype),
            tile: k.tile(arch),
        }),
        None => Err(FlashError::HeadDim(head_dim)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_head_dims_run_on_the_next_compiled_kernel() {
        let k = fwd_kernel(Arch::Sm80, DType::BF16, 80, MaskKind::Causal, false).unwrap();
        assert_eq!(k.name, "flash_fwd_bf16_d96");
        assert_eq!(k.tile.head_dim, 96);
        let k = fwd_kernel(Arch::Sm90a, DType::F16, 1, MaskKind::Causal, false).unwrap();
        assert_eq!(k.name, "flash_fwd_f16_d32");
        let k = fwd_kernel(Arch::Sm90a, DType::BF16, 128, MaskKind::Masked, false).unwrap();
        assert_eq!(k.name, "flash_fwd_masked_bf16_d128");
        let k = fwd_kernel(Arch::Sm90a, DType::BF16, 100, MaskKind::Causal, true).unwrap();
        assert_eq!(k.name, "flash_fwd_masked_dropout_bf16_d128");
    }

    #[test]
    fn f32_and_uncovered_head_dims_are_rejected() {
        assert!(matches!(
            fwd_kernel(Arch::Sm80, DType::F32, 64, MaskKind::Causal, false),
            Err(FlashError::DType(_))
        ));
        for d in [0, 257] {
            assert!(matches!(
                fwd_kernel(Arch::Sm80, DType::F16, d, MaskKind::Masked, true),
                Err(FlashError::HeadDim(x)) if x == d
            ));
        }
    }
}
