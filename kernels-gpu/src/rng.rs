//! Attention dropout's random numbers: Philox 4×32-10 (Salmon et al., "Parallel random
//! numbers: as easy as 1, 2, 3", SC 2011; the generator FlashAttention and PyTorch use),
//! counted by (batch, head, query, key) so that the mask of an element depends on nothing
//! else: not on tile sizes, launch order, split counts, the GPU or the path. The GPU kernels,
//! the CPU backend and the CPU reference all draw through [`DropoutRng::draw`] and test the
//! values with [`DropoutRng::keep_group`] (this module compiles for the host too), so they
//! draw the very same mask.
//!
//! # Which element gets which bits
//!
//! One Philox call gives 128 bits, those of 16 elements: query rows `{r, r + 8}` × keys
//! `c + {0, 1, 8, 9, 16, 17, 24, 25}` with `r = 16·⌊i/16⌋ + i mod 8` and
//! `c = 32·⌊j/32⌋ + 2·⌊(j mod 8)/2⌋`, exactly what one thread holds of a 16 × 32 block of
//! scores in the `mma` m16n8 (and `wgmma` m64nN) accumulator layout. The call's counter is
//! `(4·⌊j/32⌋ + ⌊(j mod 8)/2⌋, 8·⌊i/16⌋ + i mod 8, batch·Hq + head, offset mod 2³²)` and its
//! key `(seed mod 2³², ⌊seed/2³²⌋ ⊕ ⌊offset/2³²⌋)`. Element (row `r + 8s`, key
//! `c + 16h + 8u + e`) owns byte `2u + e` of word `2h + s`. `batch` is the sequence's index
//! in the call (varlen: in `cu_seqlens`), `head` the query head, `i` and `j` the query and key
//! within the sequence.
//!
//! Each element draws 15 bits: the low 7 of its byte are its own, and the top bits of the 8
//! bytes of its word pair (words `2h`, `2h + 1`: a *group* of 8 elements) make 8 bits the
//! group shares (byte `b`'s top bits are bits `2b + 1` and `2b` of that number, word `2h`'s
//! the higher). An element is dropped when its own bits ·
//! 2⁸ + the shared bits is below [`DropoutArgs::threshold`] (`round(p·2¹⁵)`), so each
//! element is kept with probability `1 − p` within 2⁻¹⁶. The shared bits decide only for an
//! element whose own 7 bits equal the threshold's top 7 (probability 2⁻⁷), so two elements of
//! a group depend on each other only when both do (2⁻¹⁴): the covariance of their keep
//! indicators is at most 2⁻¹⁶ (a correlation of about 10⁻⁴ at p = 0.1), elements of different
//! groups are independent. Eight bits per element rather than sixteen halve the Philox calls
//! (the forward's largest cost with dropout), and the test is byte-parallel: a group's
//! shared bits pick the threshold its own 7-bit values are compared with, one add per word
//! (see [`DropoutRng::keep_group`]).

use crate::params::DropoutArgs;

/// The bits of a Philox word that are its elements' own: the low 7 of each byte.
pub const OWN_BITS: u32 = 0x7f7f_7f7f;

/// The bits of a Philox word that its group shares: the top bit of each byte.
pub const SHARED_BITS: u32 = 0x8080_8080;

/// The scale of [`DropoutArgs::threshold`]: `2¹⁵`, the number of values of an element's 15
/// bits.
pub const THRESHOLD_SCALE: f64 = 32768.0;

/// Philox 4×32's multipliers.
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
/// Philox 4×32's key increments (Weyl sequence).
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// One in every byte.
const BYTES: u32 = 0x0101_0101;

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

/// The 8 shared bits of a group (words `first`, `second`) in one word, at bits `4k + 3` for
/// bit `k` of the group's number: bit `2b + 1` is byte `b`'s top bit in `first`, bit `2b` in
/// `second`. Compared with [`spread_threshold`]'s value, they compare as that number.
#[inline(always)]
fn shared_bits(first: u32, second: u32) -> u32 {
    (first & SHARED_BITS) | (second & SHARED_BITS) >> 4
}

/// An 8-bit number with bit `k` moved to bit `4k + 3` (the layout of [`shared_bits`]).
#[inline(always)]
const fn spread_threshold(low: u32) -> u32 {
    let mut spread = 0;
    let mut k = 0;
    while k < 8 {
        spread |= ((low >> k) & 1) << (4 * k + 3);
        k += 1;
    }
    spread
}

/// The dropout generator of one (batch, head): its Philox key and counter words and the
/// threshold in the forms the byte-parallel test uses; see the module docs for the numbering.
#[derive(Clone, Copy, Debug)]
pub struct DropoutRng {
    key: [u32; 2],
    /// `batch·Hq + head`.
    stream: u32,
    /// `offset mod 2³²`.
    offset_lo: u32,
    /// `0x80 − ⌊threshold/2⁸⌋` in every byte: added to a word's own bits, it sets a byte's top
    /// bit when its value is at least the threshold's top 7 bits.
    add: u32,
    /// The threshold's low 8 bits laid out as [`shared_bits`].
    low_threshold: u32,
}

impl DropoutRng {
    /// The generator of sequence `batch` (the index in the call) and query head `head`, of a
    /// call with `heads_q` query heads.
    #[inline(always)]
    pub fn new(args: &DropoutArgs, batch: u32, head: u32, heads_q: u32) -> Self {
        let (seed, offset, threshold) = (args.seed, args.offset, args.threshold);
        Self {
            key: [seed as u32, (seed >> 32) as u32 ^ (offset >> 32) as u32],
            stream: batch.wrapping_mul(heads_q).wrapping_add(head),
            offset_lo: offset as u32,
            add: 0x8080_8080u32.wrapping_sub((threshold >> 8).wrapping_mul(BYTES)),
            low_threshold: spread_threshold(threshold & 0xff),
        }
    }

    /// The Philox words of the call of rows `{r, r + 8}` × keys
    /// `c + {0, 1, 8, 9, 16, 17, 24, 25}`, where `r` is a query with `r mod 16 < 8` and `c` an
    /// even key with `c mod 32 < 8` (see the module docs). Word `2h + s` holds row `r + 8s`,
    /// byte `2u + e` key `c + 16h + 8u + e`; [`Self::keep_group`] tests words `2h`, `2h + 1`.
    #[inline(always)]
    pub fn draw(&self, r: u32, c: u32) -> [u32; 4] {
        let counter = [
            4 * (c / 32) + (c % 8) / 2,
            8 * (r / 16) + r % 8,
            self.stream,
            self.offset_lo,
        ];
        philox4x32_10(counter, self.key)
    }

    /// The keep test of a group, words `first` (`2h`) and `second` (`2h + 1`) of a call of
    /// [`Self::draw`]: the same words with each byte's top bit set where its element is kept,
    /// the other bits meaningless. The group's shared bits below the threshold's low 8 mean its
    /// elements whose own bits equal the threshold's top 7 are dropped too, so the own bits
    /// are compared with that plus one (one add per word, no carry between bytes: a byte's
    /// own bits are below 2⁷ and the added byte at most 2⁷).
    #[inline(always)]
    pub fn keep_group(&self, first: u32, second: u32) -> [u32; 2] {
        // A multiply of the test rather than a select of two sums: one register less across
        // the kernels' loops (ptxas spilled the `mma.sync` d = 128 forward with dropout).
        let tie_dropped = (shared_bits(first, second) < self.low_threshold) as u32;
        let add = self.add.wrapping_sub(tie_dropped.wrapping_mul(BYTES));
        [
            (first & OWN_BITS).wrapping_add(add),
            (second & OWN_BITS).wrapping_add(add),
        ]
    }

    /// The keep test of the half of a call's words `w` ([`Self::draw`]) that holds key `key`:
    /// words 0 and 1 for keys `c + {0, 1, 8, 9}`, 2 and 3 for `c + {16, 17, 24, 25}` (bit 4 of
    /// the key), tested by [`Self::keep_group`]. For a tile of 16 keys, which holds one half.
    #[inline(always)]
    pub fn keep_half(&self, w: [u32; 4], key: u32) -> [u32; 2] {
        let (first, second) = if key & 16 == 0 {
            (w[0], w[1])
        } else {
            (w[2], w[3])
        };
        self.keep_group(first, second)
    }

    /// The keep words of the call at `(r, c)`: [`Self::draw`] tested by [`Self::keep_group`].
    #[inline(always)]
    pub fn keep_words(&self, r: u32, c: u32) -> [u32; 4] {
        let w = self.draw(r, c);
        let [a, b] = self.keep_group(w[0], w[1]);
        let [x, y] = self.keep_group(w[2], w[3]);
        [a, b, x, y]
    }

    /// The keep bits of the 16 elements of the call at `(r, c)`: bit `4·(2h + s) + 2u + e` is
    /// set when the element (row `r + 8s`, key `c + 16h + 8u + e`) is kept.
    #[inline(always)]
    pub fn keep_bits(&self, r: u32, c: u32) -> u32 {
        let words = self.keep_words(r, c);
        let mut bits = 0;
        let mut w = 0;
        while w < 4 {
            let mut b = 0;
            while b < 4 {
                bits |= (words[w] >> (8 * b + 7) & 1) << (4 * w + b);
                b += 1;
            }
            w += 1;
        }
        bits
    }

    /// Whether element (query `i`, key `j`) is kept: one Philox call (for scalar code: the
    /// CPU backend, the reference and tests).
    #[inline(always)]
    pub fn keep(&self, i: u32, j: u32) -> bool {
        let (r, s) = (i - (i % 16) + i % 8, (i % 16) / 8);
        let c = j - (j % 32) + (j % 8) / 2 * 2;
        let (h, u, e) = ((j % 32) / 16, (j % 16) / 8, j % 2);
        self.keep_bits(r, c) >> (4 * (2 * h + s) + 2 * u + e) & 1 != 0
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

    fn args(p: f32, seed: u64, offset: u64) -> DropoutArgs {
        DropoutArgs::new(p, seed, offset, 0)
    }

    /// A 16-key tile's half of a call is the half its keys lie in: keys `c + {0, …, 15}` take
    /// the words of keys `c + {0, 1, 8, 9}`, keys `c + {16, …, 31}` those of `c + {16, 17, 24,
    /// 25}`, as [`DropoutRng::keep_words`] tests them.
    #[test]
    fn keep_half_takes_the_half_of_the_tile_keys() {
        let rng = DropoutRng::new(&args(0.3, 7, 11), 1, 2, 4);
        for (r, c) in [(0, 0), (9, 32), (35, 66), (1000, 4002)] {
            let (w, keep) = (rng.draw(r, c), rng.keep_words(r, c));
            let tile = c & !31;
            for key in tile..tile + 32 {
                let half = if key < tile + 16 { 0 } else { 2 };
                assert_eq!(
                    rng.keep_half(w, key),
                    [keep[half], keep[half + 1]],
                    "key {key}"
                );
            }
        }
    }

    /// The byte-parallel test is the scalar definition: element `b` of word `w` of a group is
    /// kept when `own·2⁸ + shared ≥ threshold`, for every threshold's top and low bits at
    /// their edges and words that put each element's own bits at, below and above them.
    #[test]
    fn keep_group_is_the_fifteen_bit_comparison() {
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u32
        };
        let scalar = |t: u32, words: [u32; 2], w: usize, b: u32| {
            let own = words[w] >> (8 * b) & 0x7f;
            let shared = (0..8).fold(0, |n, k| {
                let word = words[1 - (k % 2) as usize];
                n | (word >> (8 * (k / 2) + 7) & 1) << k
            });
            own * 256 + shared >= t
        };
        let mut thresholds =
            std::vec![0, 1, 255, 256, 257, 3277, 16384, 32511, 32512, 32767, 32768];
        thresholds.extend((0..200).map(|_| next() % 32769));
        for t in thresholds {
            let rng = DropoutRng::new(
                &DropoutArgs {
                    threshold: t,
                    ..args(0.5, 1, 2)
                },
                0,
                0,
                1,
            );
            for round in 0..300 {
                let mut words = [next(), next()];
                if round % 2 == 0 {
                    // Own bits at the threshold's top 7 (ties the shared bits decide), or next to it.
                    for (i, word) in words.iter_mut().enumerate() {
                        for b in 0..4 {
                            let own = ((t >> 8) as i32 + (next() % 3) as i32 - 1 + i as i32 % 2)
                                .clamp(0, 127) as u32;
                            *word = *word & !(0x7f << (8 * b)) | own << (8 * b);
                        }
                    }
                }
                let kept = rng.keep_group(words[0], words[1]);
                for (w, kept) in kept.iter().enumerate() {
                    for b in 0..4 {
                        let bit = kept >> (8 * b + 7) & 1 != 0;
                        assert_eq!(
                            bit,
                            scalar(t, words, w, b),
                            "t {t} words {words:x?} {w} {b}"
                        );
                    }
                }
            }
        }
    }

    /// Every element of a 64 × 64 block is drawn from exactly one (call, bit), and `keep`
    /// agrees with `keep_bits`.
    #[test]
    fn every_element_has_its_own_bits() {
        let rng = DropoutRng::new(&args(0.5, 7, 3), 1, 2, 4);
        let mut seen = std::collections::HashSet::new();
        for r in (0..64u32).filter(|r| r % 16 < 8) {
            for c in (0..64u32).filter(|c| c % 32 < 8 && c % 2 == 0) {
                let bits = rng.keep_bits(r, c);
                for (s, h, u, e) in (0..16).map(|x| (x & 1, x >> 1 & 1, x >> 2 & 1, x >> 3)) {
                    let (i, j) = (r + 8 * s, c + 16 * h + 8 * u + e);
                    assert!(seen.insert((i, j)));
                    let bit = bits >> (4 * (2 * h + s) + 2 * u + e) & 1 != 0;
                    assert_eq!(bit, rng.keep(i, j), "({i}, {j})");
                }
            }
        }
        assert_eq!(seen.len(), 64 * 64);
    }

    /// The kept fraction over 10⁷ draws is within 4σ of `1 − p`.
    #[test]
    fn the_kept_fraction_is_one_minus_p() {
        for (p, seed) in [(0.1f32, 1u64), (0.5, 2), (0.9, 3), (0.013, 4), (0.0001, 5)] {
            let rng = DropoutRng::new(&args(p, seed, 11), 0, 0, 1);
            let (rows, cols) = (1248u32, 8000u32); // ≈ 10⁷ elements
            let mut kept = 0u64;
            for r in (0..rows).filter(|r| r % 16 < 8) {
                for c in (0..cols).filter(|c| c % 32 < 8 && c % 2 == 0) {
                    kept += rng.keep_bits(r, c).count_ones() as u64;
                }
            }
            let n = (rows * cols) as f64;
            let (q, frac) = (1.0 - p as f64, kept as f64 / n);
            let sigma = (p as f64 * q / n).sqrt();
            assert!((frac - q).abs() <= 4.0 * sigma, "p={p}: {frac} vs {q}");
        }
    }

    /// Elements of one group whose own bits both tie are the only dependent ones: over 10⁷
    /// pairs of elements in one group, the fraction of both kept is within 4σ of `(1 − p)²`.
    #[test]
    fn elements_of_a_group_are_nearly_independent() {
        let p = 0.3f32;
        let rng = DropoutRng::new(&args(p, 21, 5), 0, 0, 1);
        let (mut both, mut pairs) = (0u64, 0u64);
        for r in (0..2048u32).filter(|r| r % 16 < 8) {
            for c in (0..4096u32).filter(|c| c % 32 < 8 && c % 2 == 0) {
                let bits = rng.keep_bits(r, c);
                // Group h: bits 8h..8h + 8; the 28 pairs of each.
                for h in 0..2 {
                    let g = bits >> (8 * h) & 0xff;
                    for a in 0..8 {
                        for b in a + 1..8 {
                            both += u64::from(g >> a & g >> b & 1);
                            pairs += 1;
                        }
                    }
                }
            }
        }
        let q = (1.0 - f64::from(p)).powi(2);
        let (frac, n) = (both as f64 / pairs as f64, pairs as f64);
        // Pairs that share an element are dependent: σ of the mean of 28 pairs per group
        // bounded by that of 8 independent ones' pairs, generously.
        let sigma = (q * (1.0 - q) / (n / 28.0 * 8.0)).sqrt();
        assert!((frac - q).abs() <= 4.0 * sigma, "{frac} vs {q}");
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
