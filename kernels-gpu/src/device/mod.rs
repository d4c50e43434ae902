//! Device-only code: compiled for `nvptx64-nvidia-cuda` alone.
//!
//! Layers, bottom up: `ptx` (every inline-PTX instruction), `elem` (f16/bf16), `tile`
//! (shared-memory tiles and their `ldmatrix` fragments), `frag` (register tiles and row
//! vectors), `softmax` (the online softmax); the kernel families (`fwd`, `pad`) are assembled
//! from them, with the block information ([`crate::block`]) and masks ([`crate::mask`]) that
//! the host compiles too. The entry points are emitted by [`crate::registry`].

pub(crate) mod bwd;
pub(crate) mod decode;
pub(crate) mod dropout;
pub(crate) mod elem;
pub(crate) mod frag;
pub(crate) mod fwd;
pub(crate) mod gemm;
pub(crate) mod pad;
#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // sm_90a code
pub(crate) mod probe;
mod ptx;
pub(crate) use ptx::await_previous_grids;
pub(crate) mod quad_store;
/// The one `ptx` wrapper shared code outside `device` uses ([`crate::math`]).
pub(crate) use ptx::{ex2_approx_ftz as ptx_ex2, rcp_approx_ftz as ptx_rcp};
pub(crate) mod softmax;
pub(crate) mod tile;
