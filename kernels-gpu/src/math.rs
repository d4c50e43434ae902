//! Scalar math of the masks, compiled for both sides, each with its own exponential (the
//! GPU's `ex2.approx`, the host's `std`). The CPU backend's softcap does not use it: it takes
//! `tanh` in f64 (`CpuScores::capped` in the host crate), since this formula is off by a few
//! ulp of 1, which the cap multiplies.

/// `tanh(x) = 1 − 2 / (e^{2x} + 1)`: exact limits ±1 for large `|x|` (the exponential
/// saturates to ∞ or 0), absolute error a few ulp of 1. The GPU takes the reciprocal from
/// `rcp.approx` (1 ulp), not from an IEEE division (a dozen instructions per score).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    1.0 - 2.0 * recip(exp2(x * (2.0 * core::f32::consts::LOG2_E)) + 1.0)
}

#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn recip(x: f32) -> f32 {
    // SAFETY: a pure arithmetic instruction.
    unsafe { crate::device::ptx_rcp(x) }
}

#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
fn recip(x: f32) -> f32 {
    1.0 / x
}

#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn exp2(x: f32) -> f32 {
    // SAFETY: a pure arithmetic instruction.
    unsafe { crate::device::ptx_ex2(x) }
}

#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
fn exp2(x: f32) -> f32 {
    extern crate std;
    x.exp2()
}

#[cfg(test)]
mod tests {
    extern crate std;

    #[test]
    fn tanh_matches_std() {
        for i in -4000..=4000 {
            let x = i as f32 * 0.01;
            assert!((super::tanh(x) - x.tanh()).abs() < 4e-7, "{x}");
        }
        assert_eq!(super::tanh(1e6), 1.0);
        assert_eq!(super::tanh(-1e6), -1.0);
    }
}
