//! The 16-bit element types the kernels take. Elements travel as raw `u16` bits; this trait
//! supplies the two operations whose instruction depends on the type.

use super::ptx;

/// A 16-bit floating-point element type with a tensor-core `mma` and a packing conversion.
pub trait Elem {
    /// `d += a · b` on one `m16n8k16` tile (see [`ptx::mma_m16n8k16_f16`]).
    ///
    /// # Safety
    /// The whole warp executes it together.
    unsafe fn mma(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]);

    /// Packs two f32 into this type, `lo` in the low half.
    ///
    /// # Safety
    /// Always safe to execute.
    unsafe fn pack(lo: f32, hi: f32) -> u32;

    /// The f32 value of one element's bits (exact).
    ///
    /// # Safety
    /// Always safe to execute.
    unsafe fn to_f32(bits: u16) -> f32;

    #[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))]
    /// `d (+)= A·B` by `wgmma.m64n128k16`, both operands in shared memory (see
    /// [`ptx::wgmma_m64n128k16_ss_f16`]).
    ///
    /// # Safety
    /// sm_90a only; as the wrapper.
    unsafe fn wgmma_n128_ss(d: &mut [[f32; 4]; 16], a: u64, b: u64, accumulate: bool);

    #[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))]
    /// `d (+)= A·B` by `wgmma.m64n176k16`, both operands in shared memory (see
    /// [`ptx::wgmma_m64n176k16_ss_f16`]).
    ///
    /// # Safety
    /// sm_90a only; as the wrapper.
    unsafe fn wgmma_n176_ss(d: &mut [[f32; 4]; 22], a: u64, b: u64, accumulate: bool);

    #[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))]
    /// `d (+)= A·B` by `wgmma.m64n64k16`, both operands in shared memory (see
    /// [`ptx::wgmma_m64n64k16_ss_f16`]).
    ///
    /// # Safety
    /// sm_90a only; as the wrapper.
    unsafe fn wgmma_n64_ss(d: &mut [[f32; 4]; 8], a: u64, b: u64, accumulate: bool);

    #[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))]
    /// `d (+)= A·B` by `wgmma.m64n64k16`, both operands MN-major in shared memory (see
    /// [`ptx::wgmma_m64n64k16_ss_tt_f16`]).
    ///
    /// # Safety
    /// sm_90a only; as the wrapper.
    unsafe fn wgmma_n64_ss_tt(d: &mut [[f32; 4]; 8], a: u64, b: u64, accumulate: bool);

    #[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))]
    /// `d += A·B` by `wgmma.m64n64k16`, A in registers, B transposed in shared memory (see
    /// [`ptx::wgmma_m64n64k16_rs_f16`]).
    ///
    /// # Safety
    /// sm_90a only; as the wrapper.
    unsafe fn wgmma_n64_rs(d: &mut [[f32; 4]; 8], a: [u32; 4], b: u64);

    #[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))]
    /// `d += A·B` by `wgmma.m64n128k16`, A in registers, B transposed in shared memory (see
    /// [`ptx::wgmma_m64n128k16_rs_f16`]).
    ///
    /// # Safety
    /// sm_90a only; as the wrapper.
    unsafe fn wgmma_n128_rs(d: &mut [[f32; 4]; 16], a: [u32; 4], b: u64);
}

/// IEEE half precision.
pub struct F16;
/// bfloat16.
pub struct Bf16;

impl Elem for F16 {
    #[inline(always)]
    unsafe fn mma(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
        ptx::mma_m16n8k16_f16(d, a, b)
    }
    #[inline(always)]
    unsafe fn pack(lo: f32, hi: f32) -> u32 {
        ptx::cvt_rn_f16x2_f32(lo, hi)
    }
    #[inline(always)]
    unsafe fn to_f32(bits: u16) -> f32 {
        ptx::cvt_f32_f16(bits)
    }
    #[inline(always)]
    unsafe fn wgmma_n128_ss(d: &mut [[f32; 4]; 16], a: u64, b: u64, accumulate: bool) {
        ptx::wgmma_m64n128k16_ss_f16(d, a, b, accumulate)
    }
    #[inline(always)]
    unsafe fn wgmma_n176_ss(d: &mut [[f32; 4]; 22], a: u64, b: u64, accumulate: bool) {
        ptx::wgmma_m64n176k16_ss_f16(d, a, b, accumulate)
    }
    #[inline(always)]
    unsafe fn wgmma_n64_ss(d: &mut [[f32; 4]; 8], a: u64, b: u64, accumulate: bool) {
        ptx::wgmma_m64n64k16_ss_f16(d, a, b, accumulate)
    }
    #[inline(always)]
    unsafe fn wgmma_n64_ss_tt(d: &mut [[f32; 4]; 8], a: u64, b: u64, accumulate: bool) {
        ptx::wgmma_m64n64k16_ss_tt_f16(d, a, b, accumulate)
    }
    #[inline(always)]
    unsafe fn wgmma_n64_rs(d: &mut [[f32; 4]; 8], a: [u32; 4], b: u64) {
        ptx::wgmma_m64n64k16_rs_f16(d, a, b)
    }
    #[inline(always)]
    unsafe fn wgmma_n128_rs(d: &mut [[f32; 4]; 16], a: [u32; 4], b: u64) {
        ptx::wgmma_m64n128k16_rs_f16(d, a, b)
    }
}

impl Elem for Bf16 {
    #[inline(always)]
    unsafe fn mma(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
        ptx::mma_m16n8k16_bf16(d, a, b)
    }
    #[inline(always)]
    unsafe fn pack(lo: f32, hi: f32) -> u32 {
        ptx::cvt_rn_bf16x2_f32(lo, hi)
    }
    #[inline(always)]
    unsafe fn to_f32(bits: u16) -> f32 {
        f32::from_bits((bits as u32) << 16)
    }
    #[inline(always)]
    unsafe fn wgmma_n128_ss(d: &mut [[f32; 4]; 16], a: u64, b: u64, accumulate: bool) {
        ptx::wgmma_m64n128k16_ss_bf16(d, a, b, accumulate)
    }
    #[inline(always)]
    unsafe fn wgmma_n176_ss(d: &mut [[f32; 4]; 22], a: u64, b: u64, accumulate: bool) {
        ptx::wgmma_m64n176k16_ss_bf16(d, a, b, accumulate)
    }
    #[inline(always)]
    unsafe fn wgmma_n64_ss(d: &mut [[f32; 4]; 8], a: u64, b: u64, accumulate: bool) {
        ptx::wgmma_m64n64k16_ss_bf16(d, a, b, accumulate)
    }
    #[inline(always)]
    unsafe fn wgmma_n64_ss_tt(d: &mut [[f32; 4]; 8], a: u64, b: u64, accumulate: bool) {
        ptx::wgmma_m64n64k16_ss_tt_bf16(d, a, b, accumulate)
    }
    #[inline(always)]
    unsafe fn wgmma_n64_rs(d: &mut [[f32; 4]; 8], a: [u32; 4], b: u64) {
        ptx::wgmma_m64n64k16_rs_bf16(d, a, b)
    }
    #[inline(always)]
    unsafe fn wgmma_n128_rs(d: &mut [[f32; 4]; 16], a: [u32; 4], b: u64) {
        ptx::wgmma_m64n128k16_rs_bf16(d, a, b)
    }
}
