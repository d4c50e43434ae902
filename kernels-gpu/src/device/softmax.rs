//! The online softmax (FlashAttention 2, Algorithm 1, lines 8–10 and 12): a running maximum
//! `m` and running sum `l` per query row, updated one key tile at a time, in base 2.
//!
//! Scores arrive raw (`Q·Kᵀ`, masked ones −∞); the positive scale `c = |scale|·log2(e)` is
//! applied here (a negative scale was folded into Q by the kernel). Per tile:
//! `m' = max(m, c·rowmax S)`, `P = 2^(c·S − m')` (one FFMA + `ex2` per score),
//! `l' = 2^(m − m')·l + rowsum P`, and O must be multiplied by `2^(m − m')`.
//! At the end `O /= l` and `LSE = (m + log2 l)·ln 2`.
//!
//! A caller may let the maximum move lazily: only when the tile's exceeds the running one
//! by more than [`LAZY_MAX_LOG2`] (FlashAttention 4's lazy rescaling). In between, `m` is a
//! stale reference point: P's values reach at most `2^LAZY_MAX_LOG2`, which neither the
//! 16-bit P nor the f32 sums mind; O and `l` share the point, so `O/l` and the LSE are the
//! same sums in exact arithmetic; and O is rescaled only in the rare tiles where some row's
//! maximum jumps (on random inputs almost only the first).
//!
//! With the lazy maximum a caller may also take a tile at the reference points as they
//! stand ([`OnlineSoftmax::update_at_reference`]): the exponentials start without waiting
//! for the tile's row maxima, which the same pass takes and which only decide afterwards
//! whether a point would have moved; in that rare case the caller computes S again and runs
//! [`OnlineSoftmax::update`].
//!
//! A caller may also ask for the row maxima and sums of a tile as two interleaved chains
//! per row (even and odd n-tiles), merged at the end: half the dependent latency of one
//! chain, for the `wgmma` consumer warps, which have no other warp of theirs to hide it
//! behind; two more registers per row, which the `mma.sync` kernels at 255 do not have.
//!
//! NaN in, NaN out: a NaN score makes its row's `l` NaN, and so O and LSE. A row that saw
//! visible keys whose scores were all −∞ ends with `l = 0`; it gets NaN, not the `O = 0`,
//! `LSE = −∞` of a row that sees no key at all.

use super::frag::{quad_max, AccTile, RowVec};
use super::ptx;

/// `ln 2`: converts the base-2 LSE kept by the kernel to the natural log of the API.
const LN_2: f32 = core::f32::consts::LN_2;

/// How far (base 2) a tile's row maximum may exceed the running one before the running one
/// moves and O is rescaled: P stays below `2^8 = 256`.
pub const LAZY_MAX_LOG2: f32 = 8.0;

/// How a kernel wants its softmax scheduled (constants once inlined).
#[derive(Clone, Copy)]
pub struct Tuning {
    /// The running maximum moves only past [`LAZY_MAX_LOG2`] (see the module docs).
    pub lazy_max: bool,
    /// Two interleaved chains per row for the maxima and sums (see the module docs).
    pub two_chains: bool,
}

impl Tuning {
    /// The maximum moved at every tile it grows, one chain per row: the `mma.sync` kernels,
    /// which have warps to spare and no registers (their block-sparse kernels with dropout
    /// at d = 128 spill on sm_80 with the lazy maximum).
    pub const PLAIN: Self = Self {
        lazy_max: false,
        two_chains: false,
    };
}

/// The softmax state of the `2·MT` rows a thread holds.
pub struct OnlineSoftmax<const MT: usize> {
    /// Reference point of the scaled scores, base 2 (quad-uniform): the running maximum as
    /// of the last tile that moved it (see [`LAZY_MAX_LOG2`]).
    m: RowVec<f32, MT>,
    /// Running sum of `2^(c·s − m)` over this thread's columns only (summed over the quad at
    /// the end).
    l: RowVec<f32, MT>,
}

/// What [`OnlineSoftmax::finish`] gives per row: the factor for O and the natural-log LSE.
pub struct Finished<const MT: usize> {
    /// `1/l` (0 for a row that sees no key, NaN for a row whose scores were all −∞).
    pub inv_l: RowVec<f32, MT>,
    /// `ln Σ exp(scale·s)` (−∞ for a row that sees no key).
    pub lse: RowVec<f32, MT>,
}

impl<const MT: usize> OnlineSoftmax<MT> {
    /// No key seen yet: `m = −∞`, `l = 0`.
    #[inline(always)]
    pub fn new() -> Self {
        Self {
            m: RowVec::splat(f32::NEG_INFINITY),
            l: RowVec::splat(0.0),
        }
    }

    /// Folds one tile of raw scores into the state and turns `s` into P in place; `scale` is
    /// `c > 0`. With `MASKED`, the scores for which `visible(mt, r, nt, c)` (m-tile, row half,
    /// n-tile, column half) is false are set to −∞ first, in the same pass that takes the row
    /// maxima (one pass keeps the predicates' live ranges short). Returns the factor by which the caller must rescale
    /// its O rows, or `None` when no row's reference point moved (the factor is exactly 1;
    /// the answer is warp-uniform, so the caller's branch is too).
    ///
    /// # Safety
    /// The whole warp calls it.
    #[inline(always)]
    pub unsafe fn update<const MASKED: bool, const NT: usize>(
        &mut self,
        s: &mut AccTile<MT, NT>,
        scale: f32,
        visible: impl Fn(usize, usize, usize, usize) -> bool,
        tuning: Tuning,
    ) -> Option<RowVec<f32, MT>> {
        let chains = if tuning.two_chains { 2 } else { 1 };
        let mut rescale = RowVec::<f32, MT>::splat(1.0);
        let mut any_moved = false;
        // One m-tile at a time, as its rows are independent: shorter live ranges.
        for mt in 0..MT {
            // Row maxima of the raw scores (one or two chains per row, merged after the
            // pass), then into base 2: the scale is positive, so max and scaling commute.
            let mut raw_max = [[f32::NEG_INFINITY; 2]; 2];
            s.for_each_in_mtile(mt, |r, nt, c, x| {
                if MASKED && !visible(mt, r, nt, c) {
                    *x = f32::NEG_INFINITY;
                }
                raw_max[r][nt % chains] = raw_max[r][nt % chains].max(*x);
            });
            let mut shift = [0.0f32; 2];
            for r in 0..2 {
                let raw = if chains == 2 {
                    raw_max[r][0].max(raw_max[r][1])
                } else {
                    raw_max[r][0]
                };
                let tile_max = quad_max(raw);
                // −∞ stays −∞ (also for a zero scale, where −∞·0 would be NaN).
                let tile_max = if tile_max == f32::NEG_INFINITY {
                    tile_max
                } else {
                    tile_max * scale
                };
                let m_old = self.m.0[mt][r];
                // Lazy, the reference point moves only past the threshold (always from −∞
                // to a finite maximum); a NaN maximum never moves it (`max` ignores NaN).
                let (m_new, moves) = if tuning.lazy_max {
                    let moves = tile_max > m_old + LAZY_MAX_LOG2;
                    (if moves { tile_max } else { m_old }, moves)
                } else {
                    let m_new = m_old.max(tile_max);
                    (m_new, m_new != m_old)
                };
                any_moved |= moves;
                // A row that has seen only masked keys keeps m = −∞; subtracting 0 instead
                // keeps 2^(−∞ − shift) = 0 rather than NaN.
                shift[r] = if m_new == f32::NEG_INFINITY {
                    0.0
                } else {
                    m_new
                };
                rescale.0[mt][r] = if moves || !tuning.lazy_max {
                    ptx::ex2_approx_ftz(m_old - shift[r])
                } else {
                    1.0
                };
                self.m.0[mt][r] = m_new;
            }
            let mut row_sum = [[0.0f32; 2]; 2];
            s.for_each_in_mtile(mt, |r, nt, _, x| {
                let p = ptx::ex2_approx_ftz(ptx::fma_rn_f32(*x, scale, -shift[r]));
                // Masked scores are −∞; with a zero scale −∞·0 is NaN, so zero them here.
                *x = if MASKED && *x == f32::NEG_INFINITY {
                    0.0
                } else {
                    p
                };
                row_sum[r][nt % chains] += *x;
            });
            for r in 0..2 {
                let sum = if chains == 2 {
                    row_sum[r][0] + row_sum[r][1]
                } else {
                    row_sum[r][0] // x + 0 is not x for x = −0: no add to fold
                };
                self.l.0[mt][r] = self.l.0[mt][r] * rescale.0[mt][r] + sum;
            }
        }
        if ptx::vote_any_sync(any_moved) {
            Some(rescale)
        } else {
            None
        }
    }

    /// The lazy maximum's common case without its latency: P from the reference points `m`
    /// as they stand, the tile's row maxima taken in the same pass, off the path to the
    /// exponentials (no wait for the maxima's shuffles). Returns `true` when no row's
    /// maximum would move ([`LAZY_MAX_LOG2`]): then `s` holds P, `l` is updated and O needs
    /// no rescaling, exactly as [`Self::update`] with `lazy_max` would have done. Returns
    /// `false` otherwise, with `s` spent and the state untouched: the caller computes S again
    /// and calls [`Self::update`]. The answer is `any(moves)`: `any` votes over the threads
    /// that must take the same path (a warpgroup, whose `wgmma` computes S). A row with no
    /// reference point yet (`m = −∞`) that sees a key moves, so a query tile's first key tile
    /// always returns `false`: callers take [`Self::update`] there directly.
    ///
    /// # Safety
    /// Every thread `any` votes over calls it.
    #[inline(always)]
    pub unsafe fn update_at_reference<const MASKED: bool, const NT: usize>(
        &mut self,
        s: &mut AccTile<MT, NT>,
        scale: f32,
        visible: impl Fn(usize, usize, usize, usize) -> bool,
        tuning: Tuning,
        any: impl FnOnce(bool) -> bool,
    ) -> bool {
        let chains = if tuning.two_chains { 2 } else { 1 };
        let mut moves = false;
        let mut sums = RowVec::<f32, MT>::splat(0.0);
        for mt in 0..MT {
            // 2^(c·s − m) with a finite m; with m = −∞ the row moves if it sees a key, and 0
            // keeps 2^(−∞) = 0 for one that does not.
            let shift: [f32; 2] = core::array::from_fn(|r| {
                let m = self.m.0[mt][r];
                if m == f32::NEG_INFINITY {
                    0.0
                } else {
                    m
                }
            });
            let mut raw_max = [[f32::NEG_INFINITY; 2]; 2];
            let mut row_sum = [[0.0f32; 2]; 2];
            s.for_each_in_mtile(mt, |r, nt, c, x| {
                if MASKED && !visible(mt, r, nt, c) {
                    *x = f32::NEG_INFINITY;
                }
                raw_max[r][nt % chains] = raw_max[r][nt % chains].max(*x);
                let p = ptx::ex2_approx_ftz(ptx::fma_rn_f32(*x, scale, -shift[r]));
                // Masked scores are −∞; with a zero scale −∞·0 is NaN, so zero them here.
                *x = if MASKED && *x == f32::NEG_INFINITY {
                    0.0
                } else {
                    p
                };
                row_sum[r][nt % chains] += *x;
            });
            for r in 0..2 {
                let (raw, sum) = if chains == 2 {
                    (
                        raw_max[r][0].max(raw_max[r][1]),
                        row_sum[r][0] + row_sum[r][1],
                    )
                } else {
                    (raw_max[r][0], row_sum[r][0])
                };
                let tile_max = quad_max(raw);
                // −∞ never moves the point (also for a zero scale, where −∞·0 is NaN).
                moves |= tile_max != f32::NEG_INFINITY
                    && tile_max * scale > self.m.0[mt][r] + LAZY_MAX_LOG2;
                sums.0[mt][r] = sum;
            }
        }
        if any(moves) {
            return false;
        }
        for mt in 0..MT {
            for r in 0..2 {
                self.l.0[mt][r] += sums.0[mt][r];
            }
        }
        true
    }

    /// The state to merge with other warps' (FlashDecoding's split merge): the running
    /// reference points `m` (base 2, scaled; lazily moved, so at most the running maximum) and
    /// the row sums `l` relative to them, summed over the quad, per row.
    ///
    /// # Safety
    /// The whole warp calls it.
    #[inline(always)]
    pub unsafe fn partial(&self) -> (RowVec<f32, MT>, RowVec<f32, MT>) {
        (self.m, self.l.quad_sum())
    }

    /// The final `1/l` and LSE of every row (see [`Finished`] and the module docs);
    /// `sees_keys` says which rows the mask lets see at least one key.
    ///
    /// # Safety
    /// The whole warp calls it.
    #[inline(always)]
    pub unsafe fn finish(&self, sees_keys: RowVec<bool, MT>) -> Finished<MT> {
        let l = self.l.quad_sum();
        let row = |mt: usize, r: usize| -> (f32, f32) {
            let (l, m) = (l.0[mt][r], self.m.0[mt][r]);
            if l != 0.0 {
                (1.0 / l, (m + ptx::lg2_approx_ftz(l)) * LN_2) // NaN l: NaN both
            } else if sees_keys.0[mt][r] {
                (f32::NAN, f32::NAN) // visible keys, every score −∞
            } else {
                (0.0, f32::NEG_INFINITY) // no visible key
            }
        };
        let inv_l = RowVec::from_fn(|mt, r| row(mt, r).0);
        let lse = RowVec::from_fn(|mt, r| row(mt, r).1);
        Finished { inv_l, lse }
    }
}
