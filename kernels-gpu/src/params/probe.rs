//! Parameters of the `wgmma` layout probe (a self-test of the warpgroup products).

/// Parameters of `wgmma_probe_*`: one warpgroup computes `S = A·Bᵀ` (`m64n176k16`, both
/// operands in shared memory), its first 128 and 64 columns again by `m64n128k16` and
/// `m64n64k16` (both in shared memory), `O = P·V` twice with P in registers and V MN-major: by `m64n128k16` and by
/// `m64n64k16` per 64-column block, and `G = V₀ᵀ·V₁` (V's two 64-column blocks) by
/// `m64n64k16` with both operands MN-major (the backward's `dQ = dS·K`); it writes every
/// accumulator element where the fragment layout says it belongs.
///
/// Inputs (16-bit, row-major, contiguous): A `[64][64]`, B `[176][64]`, P `[64][128]`, V
/// `[128][128]`. Outputs (f32, row-major): S₁₇₆ `[64][176]`, S `[64][128]`, S₆₄ `[64][64]`,
/// O and O₆₄ `[64][128]`, G `[64][64]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeParams {
    /// Device address of A.
    pub a: u64,
    /// Device address of B.
    pub b: u64,
    /// Device address of P.
    pub p: u64,
    /// Device address of V.
    pub v: u64,
    /// Device address of S (written).
    pub s: u64,
    /// Device address of O by `m64n128k16` (written).
    pub o: u64,
    /// Device address of S₆₄, S's first 64 columns by `m64n64k16` (written).
    pub s64: u64,
    /// Device address of O₆₄, O by `m64n64k16` per column block (written).
    pub o64: u64,
    /// Device address of G = V₀ᵀ·V₁ by `m64n64k16`, both operands transposed (written).
    pub g: u64,
    /// Device address of S₁₇₆, all of B's 176 rows by `m64n176k16` (written).
    pub s176: u64,
}

const _: () = assert!(core::mem::size_of::<ProbeParams>() == 80);
