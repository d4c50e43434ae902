//! Which compiled kernel runs a call: the one decision between the validated inputs and the
//! launch.

use flash_attn_kernels::arch::Arch;
use flash_attn_kernels::config::FwdTile;
use flash_attn_kernels::registry::{self, MaskKind};

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

/// The keys a forward call's query tiles walk, as far as the kernel choice cares: how many
/// (the longest sequence's), and whether a causal mask or a window cuts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Keys {
    /// Keys per sequence (a varlen batch's longest).
    pub seqlen_k: usize,
    /// A causal mask or a window.
    pub causal_or_window: bool,
    /// Take wide key tiles wherever the kind has them (`FLASH_ATTN_WGMMA_WIDE=1`, a test
    /// switch: `Device::wgmma_wide_tiles`).
    pub always_wide: bool,
}

impl Keys {
    /// Whether the call gains on key tiles wider than 128 (the plain kind's `wgmma` kernel at
    /// d = 128 has 176): where the last tile's padding is at most 1/64 of the keys, and under
    /// a causal mask only from 8K keys. Clock-locked kernel cycles on the H100 (Nsight
    /// Compute, 176 against 128 keys, docs/perf-notes.md): without a mask 2K and 4K (3 %
    /// padding) 0.997–1.003×, 8K and 16K 0.977–0.984×; causal 2K 1.014–1.024×, 4K 0.997×,
    /// 8K 0.990×, 16K 0.979–0.980×. Windows have their own kind and never get here.
    fn take_wide_tiles(self, block_n: usize) -> bool {
        let padding = self.seqlen_k.next_multiple_of(block_n) - self.seqlen_k;
        let long_enough = !self.causal_or_window || self.seqlen_k >= 8192;
        self.always_wide || (long_enough && padding * 64 <= self.seqlen_k)
    }
}

/// The forward kernel for a target, element type, head dim, mask, dropout and key walk: the
/// registry's kernel of that mask kind and dropout (see `registry::fwd_kernel`) with the
/// smallest compiled head dim ≥ `head_dim` (the kernel pads the rest with zeros). With
/// `wgmma` (sm_90a only), Hopper's `wgmma` kernel of the mask kind and dropout at its own
/// smallest compiled head dim ≥ `head_dim` replaces it where the registry has one
/// (`registry::fwd_wgmma_kernel`; whether that pays is [`wgmma_pays`]'s question), or the
/// general kind's kernel where that one has key tiles wider than 128 and `keys` do not gain
/// on them ([`Keys::take_wide_tiles`]; with no score modifier both compute the same).
/// Errors: [`FlashError::DType`] for f32, [`FlashError::HeadDim`] when no kernel covers
/// `head_dim`.
pub(crate) fn fwd_kernel(
    arch: Arch,
    wgmma: bool,
    dtype: DType,
    head_dim: usize,
    mask: MaskKind,
    dropout: bool,
    keys: Keys,
) -> Result<FwdKernel> {
    let dtype = dtype.kernel()?;
    let Some(k) = registry::fwd_kernel(head_dim, mask, dropout) else {
        return Err(FlashError::HeadDim(head_dim));
    };
    let hopper = registry::fwd_wgmma_kernel(head_dim, mask, dropout)
        .filter(|_| wgmma && arch == Arch::Sm90a)
        .and_then(|h| match h.tile(arch).block_n {
            n if n > 128 && !keys.take_wide_tiles(n) => {
                registry::fwd_wgmma_kernel(head_dim, MaskKind::Masked, dropout)
            }
            _ => Some(h),
        });
    let k = hopper.unwrap_or(k);
    Ok(FwdKernel {
        name: k.name(dtype),
        tile: k.tile(arch),
    })
}

/// Whether a forward call over `seqlen_k` keys at `head_dim` under `mask` (with or without
/// `dropout`) gains on Hopper's `wgmma` kernels over the `mma.sync` ones: at d > 128 (the
/// d = 256 kernel) from 512 keys, at d = 33–128 from 1,024 keys whatever the mask, causal or
/// not; at d ≤ 32 (run on the d = 64 kernels) from 1,024 keys, and under a causal mask or a
/// window (which halve the keys a query tile visits) 2,048, or 4,096 on a kernel of two
/// consumer warpgroups (the general mask's: windows, ALiBi, softcaps).
///
/// Measured on the H200 on 2026-11-27 (docs/perf-notes.md, "the forward's dispatch at short
/// lengths"), both paths of the same build in one call: with FlashAttention's shapes
/// (B·N = 16K tokens) `wgmma` took 0.33–0.84× the time of `mma.sync` on every row from 512
/// to 4,096 keys at d = 64, 96, 128 and 256, causal or not, f16 and bf16; one sequence of 16
/// heads (the masks bench, bf16) at d = 64 and 128 0.36–1.00× on every mask row from 1,024 keys
/// (but one block-sparse row of 25 µs, 1.08×), while at 512 keys, where such a call takes
/// 11–30 µs, `mma.sync` was faster on 8 of 18 rows (up to 1.5×, block-sparse). At d = 32
/// `wgmma` took 1.02–1.05× at 512 keys, 0.96–1.00× at 1,024 (causal: 1.00), 0.87–0.92× from
/// 2,048. Until then the thresholds were those measured on the H100 on 2026-11-23, before
/// the persistent kernels: 2,048 causal keys at d = 65–128, and 2,048 or 4,096 at d ≤ 64.
pub(crate) fn wgmma_pays(
    head_dim: usize,
    seqlen_k: usize,
    causal_or_window: bool,
    mask: MaskKind,
    dropout: bool,
) -> bool {
    let three_warpgroups = registry::fwd_wgmma_kernel(head_dim, mask, dropout)
        .is_some_and(|k| k.tile(Arch::Sm90a).block_m > 128);
    let min_keys = match (causal_or_window, head_dim) {
        (_, 129..) => 512,
        (_, 33..) | (false, _) => 1024,
        (true, _) if three_warpgroups => 2048,
        (true, _) => 4096,
    };
    seqlen_k >= min_keys
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4K keys without a causal mask: no kernel of wide key tiles (3 % padding at 176).
    const LONG: Keys = keys(4096, false, false);

    const fn keys(seqlen_k: usize, causal_or_window: bool, always_wide: bool) -> Keys {
        Keys {
            seqlen_k,
            causal_or_window,
            always_wide,
        }
    }

    /// [`fwd_kernel`] for a call over [`LONG`] keys.
    fn long(
        arch: Arch,
        wgmma: bool,
        dtype: DType,
        head_dim: usize,
        mask: MaskKind,
        dropout: bool,
    ) -> Result<FwdKernel> {
        fwd_kernel(arch, wgmma, dtype, head_dim, mask, dropout, LONG)
    }

    #[test]
    fn odd_head_dims_run_on_the_next_compiled_kernel() {
        let k = long(Arch::Sm80, false, DType::BF16, 80, MaskKind::Causal, false).unwrap();
        assert_eq!(k.name, "flash_fwd_bf16_d96");
        assert_eq!(k.tile.head_dim, 96);
        let k = long(Arch::Sm90a, false, DType::F16, 1, MaskKind::Causal, false).unwrap();
        assert_eq!(k.name, "flash_fwd_f16_d32");
        let k = long(
            Arch::Sm90a,
            false,
            DType::BF16,
            128,
            MaskKind::Masked,
            false,
        )
        .unwrap();
        assert_eq!(k.name, "flash_fwd_masked_bf16_d128");
        let k = long(Arch::Sm90a, false, DType::BF16, 100, MaskKind::Causal, true).unwrap();
        assert_eq!(k.name, "flash_fwd_masked_dropout_bf16_d128");
    }

    #[test]
    fn hopper_takes_the_wgmma_kernel_of_the_same_head_dim() {
        let k = long(Arch::Sm90a, true, DType::BF16, 100, MaskKind::Causal, false).unwrap();
        assert_eq!(k.name, "flash_fwd_wgmma_masked_bf16_d128");
        assert_eq!((k.tile.block_m, k.tile.threads()), (128, 384));
        let k = long(Arch::Sm90a, true, DType::F16, 64, MaskKind::Sparse, true).unwrap();
        assert_eq!(k.name, "flash_fwd_wgmma_sparse_dropout_f16_d64");
        assert_eq!((k.tile.block_m, k.tile.threads()), (128, 384));
        // Plain calls at d <= 64 run their own kernel, of three consumer warpgroups; masked
        // ones the general kernel, of two.
        let k = long(Arch::Sm90a, true, DType::BF16, 48, MaskKind::Causal, false).unwrap();
        assert_eq!(k.name, "flash_fwd_wgmma_bf16_d64");
        assert_eq!((k.tile.block_m, k.tile.threads()), (192, 512));
        let k = long(Arch::Sm90a, true, DType::BF16, 64, MaskKind::Masked, false).unwrap();
        assert_eq!(k.name, "flash_fwd_wgmma_masked_bf16_d64");
        assert_eq!((k.tile.block_m, k.tile.threads()), (128, 384));
        // With dropout at d <= 64 the plain and general masks run three, on 64-key tiles.
        for (mask, name) in [
            (MaskKind::Causal, "flash_fwd_wgmma_dropout_bf16_d64"),
            (MaskKind::Masked, "flash_fwd_wgmma_masked_dropout_bf16_d64"),
        ] {
            let k = long(Arch::Sm90a, true, DType::BF16, 64, mask, true).unwrap();
            assert_eq!(k.name, name);
            let t = k.tile;
            assert_eq!((t.block_m, t.block_n, t.threads()), (192, 64, 512));
        }
        // The general mask with dropout at d = 128: 64-key tiles (128 spilled).
        let k = long(Arch::Sm90a, true, DType::F16, 128, MaskKind::Masked, true).unwrap();
        assert_eq!(k.name, "flash_fwd_wgmma_masked_dropout_f16_d128");
        assert_eq!(k.tile.block_n, 64);
        // d = 80 pads to 128 on wgmma, d = 200 to 256; sm_80 never takes one.
        let k = long(Arch::Sm90a, true, DType::F16, 80, MaskKind::Causal, false).unwrap();
        assert_eq!(k.name, "flash_fwd_wgmma_masked_f16_d128");
        let k = long(Arch::Sm90a, true, DType::BF16, 200, MaskKind::Tree, false).unwrap();
        assert_eq!(k.name, "flash_fwd_wgmma_tree_bf16_d256");
        assert_eq!((k.tile.block_n, k.tile.kv_stages), (64, 2));
        // With dropout at d = 256 the tree and block-sparse masks have their `wgmma` kernels.
        let k = long(Arch::Sm90a, true, DType::BF16, 256, MaskKind::Tree, true).unwrap();
        assert_eq!(k.name, "flash_fwd_wgmma_tree_dropout_bf16_d256");
        let k = long(Arch::Sm90a, true, DType::BF16, 256, MaskKind::Sparse, true).unwrap();
        assert_eq!(k.name, "flash_fwd_wgmma_sparse_dropout_bf16_d256");
        let k = long(Arch::Sm80, true, DType::F16, 64, MaskKind::Causal, false).unwrap();
        assert_eq!(k.name, "flash_fwd_f16_d64");
    }

    #[test]
    fn plain_calls_take_wide_key_tiles_where_they_pay() {
        let at =
            |arch, mask, keys| fwd_kernel(arch, true, DType::F16, 128, mask, false, keys).unwrap();
        let pick = |n, causal| at(Arch::Sm90a, MaskKind::Causal, keys(n, causal, false));
        let wide = pick(8192, false);
        assert_eq!(wide.name, "flash_fwd_wgmma_f16_d128");
        assert_eq!((wide.tile.block_n, wide.tile.kv_stages), (176, 2));
        // 176 · 30 keys: no padding at all.
        assert_eq!(pick(5280, false).name, "flash_fwd_wgmma_f16_d128");
        // Causal calls from 8K keys, with as little padding.
        assert_eq!(pick(8192, true).name, "flash_fwd_wgmma_f16_d128");
        assert_eq!(pick(16384, true).name, "flash_fwd_wgmma_f16_d128");
        for (n, causal) in [
            (5280, true),
            (4096, true),
            (4096, false),
            (2048, false),
            (9000, false),
        ] {
            let k = pick(n, causal);
            assert_eq!(k.name, "flash_fwd_wgmma_masked_f16_d128", "{n} {causal}");
            assert_eq!(k.tile.block_n, 128);
        }
        // Only the plain kind has wide tiles; sm_80 never takes them.
        let long = keys(8192, false, false);
        assert_eq!(at(Arch::Sm90a, MaskKind::Masked, long).tile.block_n, 128);
        assert_eq!(
            at(Arch::Sm80, MaskKind::Causal, long).name,
            "flash_fwd_f16_d128"
        );
        // The test switch: wide tiles on any keys, causal included.
        let short = keys(100, true, true);
        assert_eq!(at(Arch::Sm90a, MaskKind::Causal, short).tile.block_n, 176);
    }

    #[test]
    fn wgmma_takes_long_calls_only() {
        let pays = |d, n, causal_or_window, mask| wgmma_pays(d, n, causal_or_window, mask, false);
        let (plain, general) = (MaskKind::Causal, MaskKind::Masked);
        for d in [64, 96, 128] {
            for causal in [false, true] {
                for mask in [plain, general, MaskKind::Sparse, MaskKind::Tree] {
                    assert!(!pays(d, 512, causal, mask) && pays(d, 1024, causal, mask));
                    assert!(!wgmma_pays(d, 1023, causal, mask, true));
                    assert!(wgmma_pays(d, 1024, causal, mask, true));
                }
            }
        }
        // At d <= 32 causal plain calls run three consumer warpgroups, windows two.
        assert!(!pays(32, 512, false, plain) && pays(32, 1024, false, plain));
        assert!(!pays(32, 1024, true, plain) && pays(32, 2048, true, plain));
        assert!(!pays(32, 2048, true, general) && pays(32, 4096, true, general));
        assert!(!pays(256, 256, false, plain) && pays(256, 512, false, plain));
        assert!(pays(200, 512, true, plain) && pays(96, 1024, true, general));
    }

    #[test]
    fn f32_and_uncovered_head_dims_are_rejected() {
        assert!(matches!(
            long(Arch::Sm80, false, DType::F32, 64, MaskKind::Causal, false),
            Err(FlashError::DType(_))
        ));
        for d in [0, 257] {
            assert!(matches!(
                long(Arch::Sm80, false, DType::F16, d, MaskKind::Masked, true),
                Err(FlashError::HeadDim(x)) if x == d
            ));
        }
    }
}
