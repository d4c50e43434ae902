//! Attention dropout's random numbers: Philox 4×32-10 (Salmon et al., "Parallel random
//! numbers: as easy as 1, 2, 3", SC 2011; the generator FlashAttention and PyTorch use),
//! counted by (batch, head, query, key) so that the mask of an element depends on nothing
//! else: not on tile sizes, launch order, split counts, the GPU or the path. The GPU kernels,
//! the CPU backend and the CPU reference all draw through [`DropoutRng::draw`] (this module
//! compiles for the host too), so they draw the very same bits.
//!
//! # Which element gets which bits
//!
//! Each element gets the low 14 bits of a 16-bit half of a Philox word and is kept when they
//! are `≥` [`DropoutArgs::threshold`] (`round(p·2¹⁴)`), so the kept fraction is `1 − p`
//! within 2⁻¹⁵. Fourteen bits rather than the half's sixteen: read as an f16, a value below
//! 2¹⁴ is finite and non-negative, so the Hopper kernels compare both halves of a word with
//! one `setp.ge.f16x2` (the integers' order; see [`DropoutRng::draw`]). One Philox call gives
//! 128 bits, those of 8 elements: query rows `{r, r + 8}` × keys `{c, c + 1, c + 8,
//! c + 9}` with `r = 16·⌊i/16⌋ + i mod 8` and `c = 16·⌊j/16⌋ + 2·⌊(j mod 8)/2⌋`, exactly what
//! one thread holds of a 16 × 16 block of scores in the `mma.sync` m16n8 accumulator layout.
//! The call's counter is `(4·⌊j/16⌋ + ⌊(j mod 8)/2⌋, 8·⌊i/16⌋ + i mod 8, batch·Hq + head,
//! offset mod 2³²)` and its key `(seed mod 2³², ⌊seed/2³²⌋ ⊕ ⌊offset/2³²⌋)`; in the output,
//! word `2·s + u` holds rows `r + 8s`, keys `c + 8u`, and its low half key `c`, its high half
//! key `c + 1` (see [`DropoutRng::keep_bits`]). `batch` is the sequence's index in the call
//! (varlen: in `cu_seqlens`), `head` the query head, `i` and `j` the query and key within the
//! sequence.

use crate::params::DropoutArgs;

/// The bits of a Philox word that [`DropoutRng::draw`] keeps: the low 14 of each half.
pub const RANDOM_HALVES: u32 = 0x3fff_3fff;

/// The scale of [`DropoutArgs::threshold`]: `2¹⁴`, one more than the largest value of a half of
/// [`DropoutRng::draw`].
pub const THRESHOLD_SCALE: f64 = 16384.0;

/// Philox 4×32's multipliers.
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
/// Philox 4×32's key increments (Weyl sequence).
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox 4×32-10: the 128-bit block of `counter` under `key`.
#[inline(always)]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    let mut round = 0;
    while round < 10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 as u64 * c[0] as u64;
        let p1 = M1 as u64 * c[2] as u64;
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
        round += 1;
    }
    c
}

/// The dropout generator of one (batch, head): its Philox key and counter words; see the
/// module docs for the numbering.
#[derive(Clone, Copy, Debug)]
pub struct DropoutRng {
    key: [u32; 2],
    /// `batch·Hq + head`.
    stream: u32,
    /// `offset mod 2³²`.
    offset_lo: u32,
    threshold: u32,
}

impl DropoutRng {
    /// The generator of sequence `batch` (the index in the call) and query head `head`, of a
    /// call with `heads_q` query heads.
    #[inline(always)]
    pub fn new(args: &DropoutArgs, batch: u32, head: u32, heads_q: u32) -> Self {
        let (seed, offset) = (args.seed, args.offset);
        Self {
            key: [seed as u32, (seed >> 32) as u32 ^ (offset >> 32) as u32],
            stream: batch.wrapping_mul(heads_q).wrapping_add(head),
            offset_lo: offset as u32,
            threshold: args.threshold,
        }
    }

    /// The random values of the 8 elements of one Philox call: rows `{r, r + 8}` × keys
    /// `{c, c + 1, c + 8, c + 9}`, where `r` is a query with `r mod 16 < 8` and `c` an even key
    /// with `c mod 16 < 8` (see the module docs). Word `2·s + u` holds keys `c + 8u` (low
    /// half) and `c + 8u + 1` (high half) of row `r + 8s`, each half's value below 2¹⁴
    /// ([`RANDOM_HALVES`] of the Philox word). An element is kept when its value is `≥` the
    /// threshold ([`DropoutArgs::threshold`]); read as f16 halves, the values compare in the integers' order.
    #[inline(always)]
    pub fn draw(&self, r: u32, c: u32) -> [u32; 4] {
        let counter = [
            4 * (c / 16) + (c % 8) / 2,
            8 * (r / 16) + r % 8,
            self.stream,
            self.offset_lo,
        ];
        philox4x32_10(counter, self.key).map(|word| word & RANDOM_HALVES)
    }

    /// The threshold of [`Self::draw`]'s values (`round(p·2¹⁴)`) in both 16-bit halves, to
    /// compare with a word of [`Self::draw`].
    #[inline(always)]
    pub fn threshold_pair(&self) -> u32 {
        self.threshold | self.threshold << 16
    }

    /// The keep bits of the 8 elements of one Philox call ([`Self::draw`]): bit `4·s + 2·u + e`
    /// is set when the element (row `r + 8s`, key `c + 8u + e`) is kept.
    #[inline(always)]
    pub fn keep_bits(&self, r: u32, c: u32) -> u32 {
        let words = self.draw(r, c);
        let mut bits = 0;
        let mut w = 0;
        while w < 4 {
            let word = words[w];
            let keep_lo = (word & 0xffff) >= self.threshold;
            let keep_hi = (word >> 16) >= self.threshold;
            bits |= ((keep_lo as u32) | ((keep_hi as u32) << 1)) << (2 * w);
            w += 1;
        }
        bits
    }

    /// Whether element (query `i`, key `j`) is kept: one Philox call (for scalar code: the
    /// CPU backend, the reference and tests).
    #[inline(always)]
    pub fn keep(&self, i: u32, j: u32) -> bool {
        let (r, s) = (i - (i % 16) + i % 8, (i % 16) / 8);
        let (c, u, e) = (j - (j % 16) + (j % 8) / 2 * 2, (j % 16) / 8, j % 2);
        self.keep_bits(r, c) >> (4 * s + 2 * u + e) & 1 != 0
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    /// Random123's known-answer vectors for Philox 4×32-10.
    #[test]
    fn philox_matches_the_published_vectors() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    /// The f16 value of the bits `h` (finite, non-negative: below 0x7c00).
    fn f16_value(h: u32) -> f64 {
        let (exp, frac) = ((h >> 10) as i32, f64::from(h & 0x3ff));
        if exp == 0 {
            frac * 2f64.powi(-24)
        } else {
            (1.0 + frac / 1024.0) * 2f64.powi(exp - 15)
        }
    }

    /// Read as f16 (subnormals kept), the values of `draw` and every threshold up to 2¹⁴ are
    /// strictly increasing in their integer value, so the kernels' `setp.ge.f16x2` is the
    /// integer comparison `keep_bits` makes.
    #[test]
    fn draw_values_compare_as_f16_in_integer_order() {
        assert_eq!(RANDOM_HALVES & 0xffff, THRESHOLD_SCALE as u32 - 1);
        assert_eq!(args(0.999_99, 1, 2).threshold, THRESHOLD_SCALE as u32);
        for h in 1..=THRESHOLD_SCALE as u32 {
            assert!(f16_value(h) > f16_value(h - 1), "{h:#x}");
        }
        let rng = DropoutRng::new(&args(0.5, 3, 4), 0, 0, 1);
        for c in (0..64).step_by(2).filter(|c| c % 16 < 8) {
            assert!(rng.draw(0, c).iter().all(|w| w & !RANDOM_HALVES == 0));
        }
    }

    fn args(p: f32, seed: u64, offset: u64) -> DropoutArgs {
        DropoutArgs::new(p, seed, offset, 0)
    }

    /// Every element of a 64 × 64 block is drawn from exactly one (call, bit), and `keep`
    /// agrees with `keep_bits`.
    #[test]
    fn every_element_has_its_own_bits() {
        let rng = DropoutRng::new(&args(0.5, 7, 3), 1, 2, 4);
        let mut seen = std::collections::HashSet::new();
        for r in (0..64u32).filter(|r| r % 16 < 8) {
            for c in (0..64u32).filter(|c| c % 16 < 8 && c % 2 == 0) {
                let bits = rng.keep_bits(r, c);
                for s in 0..2 {
                    for u in 0..2 {
                        for e in 0..2 {
                            let (i, j) = (r + 8 * s, c + 8 * u + e);
                            assert!(seen.insert((i, j)));
                            let bit = bits >> (4 * s + 2 * u + e) & 1 != 0;
                            assert_eq!(bit, rng.keep(i, j), "({i}, {j})");
                        }
                    }
                }
            }
        }
        assert_eq!(seen.len(), 64 * 64);
    }

    /// The kept fraction over 10⁷ draws is within 4σ of `1 − p`.
    #[test]
    fn the_kept_fraction_is_one_minus_p() {
        for (p, seed) in [(0.1f32, 1u64), (0.5, 2), (0.9, 3), (0.013, 4)] {
            let rng = DropoutRng::new(&args(p, seed, 11), 0, 0, 1);
            let (rows, cols) = (1250u32, 8000u32); // 10⁷ elements
            let mut kept = 0u64;
            for r in (0..rows.next_multiple_of(16)).filter(|r| r % 16 < 8) {
                for c in (0..cols).filter(|c| c % 16 < 8 && c % 2 == 0) {
                    kept += rng.keep_bits(r, c).count_ones() as u64;
                }
            }
            let n = (rows.next_multiple_of(16) * cols) as f64;
            let (q, frac) = (1.0 - p as f64, kept as f64 / n);
            let sigma = (p as f64 * q / n).sqrt();
            assert!((frac - q).abs() <= 4.0 * sigma, "p={p}: {frac} vs {q}");
        }
    }

    /// Another offset, seed, batch or head gives another mask; the same ones the same mask.
    #[test]
    fn masks_depend_on_seed_offset_batch_and_head() {
        let mask = |seed, offset, batch, head| {
            let rng = DropoutRng::new(&args(0.5, seed, offset), batch, head, 8);
            (0..32)
                .flat_map(|i| (0..32).map(move |j| (i, j)))
                .map(|(i, j)| rng.keep(i, j))
                .collect::<std::vec::Vec<_>>()
        };
        let base = mask(5, 9, 1, 3);
        assert_eq!(base, mask(5, 9, 1, 3));
        for other in [
            mask(6, 9, 1, 3),
            mask(5, 10, 1, 3),
            mask(5, 9 + (1 << 32), 1, 3),
            mask(5, 9, 2, 3),
            mask(5, 9, 1, 4),
        ] {
            assert_ne!(base, other);
        }
    }
}
