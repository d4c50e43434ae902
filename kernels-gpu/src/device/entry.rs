//! Kernel entry points: one `extern "ptx-kernel"` per (dtype, compiled head dim), emitted by
//! one macro from the generic bodies. Their names come from [`crate::config::fwd_kernel_name`].

use super::elem::{Bf16, F16};
use super::fwd::flash_fwd;
use crate::config::{tile, FwdTile};
use crate::mask::CausalMask;
use crate::params::{FwdParams, PadParams};

macro_rules! fwd_entries {
    ($($name:ident: $elem:ty, $d:literal;)*) => {$(
        /// Forward attention for one (dtype, head dim); see `device::fwd` for the algorithm
        /// and `config::fwd_tile` for the tile shape.
        ///
        /// # Safety
        /// Launched by the host crate with the grid, block and shared memory of its tile.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: FwdParams) {
            const T: FwdTile = tile($d);
            let mask = CausalMask { seqlen_q: p.seqlen_q, seqlen_k: p.seqlen_k, causal: p.causal() };
            flash_fwd::<
                $elem,
                _,
                $d,
                { T.smem_pitch() },
                { T.block_m },
                { T.block_n },
                { T.warps },
                { T.m_tiles },
                { T.q_in_regs },
                { $d / 16 },
                { $d / 8 },
                { T.block_n / 8 },
            >(&p, mask)
        }
    )*};
}

fwd_entries! {
    flash_fwd_f16_d32: F16, 32;
    flash_fwd_f16_d64: F16, 64;
    flash_fwd_f16_d96: F16, 96;
    flash_fwd_f16_d128: F16, 128;
    flash_fwd_f16_d256: F16, 256;
    flash_fwd_bf16_d32: Bf16, 32;
    flash_fwd_bf16_d64: Bf16, 64;
    flash_fwd_bf16_d96: Bf16, 96;
    flash_fwd_bf16_d128: Bf16, 128;
    flash_fwd_bf16_d256: Bf16, 256;
}

/// Strided ⇄ packed copy of 16-bit tensors; see `device::pad`.
///
/// # Safety
/// Launched by the host crate on validated parameters.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn pad_copy_b16(p: PadParams) {
    super::pad::pad_copy_b16(&p)
}
