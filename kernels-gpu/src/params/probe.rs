//! Parameters of the `wgmma` layout probe (a self-test of the warpgroup products).

/// Parameters of `wgmma_probe_*`: one warpgroup computes `S = A·Bᵀ` (`m64n128k16`, both
/// operands in shared memory), its first 64 columns again by `m64n64k16` (both in shared
/// memory), and `O = P·V` (`m64n64k16`, P in registers, V MN-major), and writes every
/// accumulator element where the fragment layout says it belongs.
///
/// Inputs (16-bit, row-major, contiguous): A `[64][64]`, B `[128][64]`, P `[64][128]`, V
/// `[128][64]`. Outputs (f32, row-major): S `[64][128]`, S₆₄ `[64][64]`, O `[64][64]`.
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
    /// Device address of O (written).
    pub o: u64,
    /// Device address of S₆₄, S's first 64 columns by `m64n64k16` (written).
    pub s64: u64,
}

const _: () = assert!(core::mem::size_of::<ProbeParams>() == 56);
