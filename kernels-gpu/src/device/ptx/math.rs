//! Arithmetic the compiler would not pick on its own: fast `ex2`, packed 16-bit conversion and
//! comparison, byte permutes and the quad shuffles of the row reductions.

use core::arch::asm;

/// `2^x` with the hardware approximation (flushes denormals; `ex2(-inf) = 0`).
///
/// # Safety
/// Always safe to execute; `unsafe` as every wrapper of this module.
#[inline(always)]
pub unsafe fn ex2_approx_ftz(x: f32) -> f32 {
    let y: f32;
    asm!("ex2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(pure, nomem, nostack));
    y
}

/// `1/x` with the hardware approximation (1 ulp; flushes denormals; `1/∞ = 0`).
///
/// # Safety
/// As [`ex2_approx_ftz`].
#[inline(always)]
pub unsafe fn rcp_approx_ftz(x: f32) -> f32 {
    let y: f32;
    asm!("rcp.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(pure, nomem, nostack));
    y
}

/// `log2(x)` with the hardware approximation.
///
/// # Safety
/// As [`ex2_approx_ftz`].
#[inline(always)]
pub unsafe fn lg2_approx_ftz(x: f32) -> f32 {
    let y: f32;
    asm!("lg2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(pure, nomem, nostack));
    y
}

/// Packs two f32 into f16x2, round to nearest even: `lo` in bits 0..16, `hi` in 16..32.
///
/// # Safety
/// As [`ex2_approx_ftz`].
#[inline(always)]
pub unsafe fn cvt_rn_f16x2_f32(lo: f32, hi: f32) -> u32 {
    let d: u32;
    asm!("cvt.rn.f16x2.f32 {d}, {hi}, {lo};", d = out(reg32) d, hi = in(reg32) hi, lo = in(reg32) lo, options(pure, nomem, nostack));
    d
}

/// Packs two f32 into bf16x2, round to nearest even: `lo` in bits 0..16, `hi` in 16..32.
///
/// # Safety
/// As [`ex2_approx_ftz`].
#[inline(always)]
pub unsafe fn cvt_rn_bf16x2_f32(lo: f32, hi: f32) -> u32 {
    let d: u32;
    asm!("cvt.rn.bf16x2.f32 {d}, {hi}, {lo};", d = out(reg32) d, hi = in(reg32) hi, lo = in(reg32) lo, options(pure, nomem, nostack));
    d
}

/// The bytes of `(a, b)` picked by `selector` (`prmt.b32`: nibble `i` of the selector names
/// byte `i` of the result, 0–3 from `a`, 4–7 from `b`).
///
/// # Safety
/// As [`ex2_approx_ftz`].
#[inline(always)]
pub unsafe fn prmt(a: u32, b: u32, selector: u32) -> u32 {
    let d: u32;
    asm!("prmt.b32 {d}, {a}, {b}, {s};", d = out(reg32) d, a = in(reg32) a, b = in(reg32) b, s = in(reg32) selector, options(pure, nomem, nostack));
    d
}

/// All ones where the top bit of byte `byte` (0–3) of `word` is set, else zero: `prmt.b32`
/// replicating the byte's sign over the word (dropout's keep words, [`crate::rng`]).
///
/// # Safety
/// As [`ex2_approx_ftz`].
#[inline(always)]
pub unsafe fn byte_sign_mask(word: u32, byte: u32) -> u32 {
    prmt(word, 0, (8 + byte) * 0x1111)
}

/// A mask of 16-bit halves for a packed pair: the low half all ones where the top bit of byte
/// `lo` of `(a, b)` is set (bytes 0–3 of `a`, 4–7 of `b`), the high half likewise by byte
/// `hi`, else zero (`prmt.b32` replicating the bytes' signs).
///
/// # Safety
/// As [`ex2_approx_ftz`].
#[inline(always)]
pub unsafe fn byte_sign_halves(a: u32, b: u32, lo: u32, hi: u32) -> u32 {
    prmt(a, b, (8 + lo) * 0x11 | (8 + hi) * 0x1100)
}

/// Butterfly shuffle over the whole warp: returns `x` of lane `lane ^ MASK`.
///
/// # Safety
/// All 32 lanes execute it together.
#[inline(always)]
pub unsafe fn shfl_sync_bfly<const MASK: u32>(x: f32) -> f32 {
    let y: f32;
    asm!(
        "shfl.sync.bfly.b32 {y}, {x}, {m}, 0x1f, 0xffffffff;",
        y = out(reg32) y,
        x = in(reg32) x,
        m = const MASK,
        options(nostack)
    );
    y
}

/// `shfl.sync.idx.b32`: lane `src_lane`'s `x` (all 32 lanes take part).
///
/// # Safety
/// All 32 lanes execute it together.
#[inline(always)]
pub unsafe fn shfl_sync_idx(x: f32, src_lane: u32) -> f32 {
    let y: f32;
    asm!(
        "shfl.sync.idx.b32 {y}, {x}, {l}, 0x1f, 0xffffffff;",
        y = out(reg32) y,
        x = in(reg32) x,
        l = in(reg32) src_lane,
        options(nostack)
    );
    y
}

/// `a · b + c` with one rounding (`fma.rn.f32`).
///
/// # Safety
/// As [`ex2_approx_ftz`].
#[inline(always)]
pub unsafe fn fma_rn_f32(a: f32, b: f32, c: f32) -> f32 {
    let d: f32;
    asm!("fma.rn.f32 {d}, {a}, {b}, {c};", d = out(reg32) d, a = in(reg32) a, b = in(reg32) b, c = in(reg32) c, options(pure, nomem, nostack));
    d
}

/// Converts the f16 in the low 16 bits of `h` to f32 (exact).
///
/// # Safety
/// As [`ex2_approx_ftz`].
#[inline(always)]
pub unsafe fn cvt_f32_f16(h: u16) -> f32 {
    let y: f32;
    asm!("cvt.f32.f16 {y}, {h};", y = out(reg32) y, h = in(reg16) h, options(pure, nomem, nostack));
    y
}

/// `shfl.sync.idx.b32` of a `u32`: lane `src_lane`'s `x`. Besides moving data, this tells
/// ptxas the result is the same in every lane: a branch on the warp index read through it
/// (`x = tid / 32`, `src_lane = 0`) is known warp-uniform, which `wgmma` after it needs.
///
/// # Safety
/// All 32 lanes execute it together.
#[inline(always)]
pub unsafe fn shfl_sync_idx_u32(x: u32, src_lane: u32) -> u32 {
    let y: u32;
    asm!(
        "shfl.sync.idx.b32 {y}, {x}, {l}, 0x1f, 0xffffffff;",
        y = out(reg32) y,
        x = in(reg32) x,
        l = in(reg32) src_lane,
        options(nostack)
    );
    y
}

/// A tile index (below `u32::MAX`) or none, as lane 0 holds it, through
/// [`shfl_sync_idx_u32`]: the same value, which ptxas then knows is warp-uniform (for a
/// mask's walk that reads memory: [`crate::mask::AttnMask::WALK_READS_MEMORY`]), so that the
/// loop it drives and what is derived from it stay on the uniform datapath.
///
/// # Safety
/// All 32 lanes execute it together and hold the same `tile`.
#[inline(always)]
pub unsafe fn warp_uniform_tile(tile: Option<u32>) -> Option<u32> {
    let x = shfl_sync_idx_u32(tile.unwrap_or(u32::MAX), 0);
    (x != u32::MAX).then_some(x)
}
