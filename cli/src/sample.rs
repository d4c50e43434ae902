//! Deterministic pseudo-random inputs for the benchmark and the CLI tests (xorshift64), so
//! runs and machines see the same values.

/// `n` values uniform in `[lo, hi)` from `seed`.
pub fn uniform(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + ((s >> 40) as f32 / (1u64 << 24) as f32) * (hi - lo)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_range_and_repeatable() {
        let a = uniform(10_000, 7, -2.0, 2.0);
        assert!(a.iter().all(|x| (-2.0..2.0).contains(x)));
        assert_eq!(a, uniform(10_000, 7, -2.0, 2.0));
        assert_ne!(a, uniform(10_000, 8, -2.0, 2.0));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.05, "{mean}");
    }
}
