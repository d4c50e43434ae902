//! The online softmax (FlashAttention 2, Algorithm 1, lines 8–10 and 12): a running maximum
//! `m` and running sum `l` per query row, updated one key tile at a time, in base 2.
//!
//! Scores arrive raw (`Q·Kᵀ`, masked ones −∞); the positive scale `c = |scale|·log2(e)` is
//! applied here (a negative scale was folded into Q by the kernel). Per tile:
//! `m' = max(m, c·rowmax S)`, `P = 2^(c·S − m')` (one FFMA + `ex2` per score),
//! `l' = 2^(m − m')·l + rowsum P`, and O must be multiplied by `2^(m − m')`.
//! At the end `O /= l` and `LSE = (m + log2 l)·ln 2`.
//!
//! NaN in, NaN out: a NaN score makes its row's `l` NaN, and so O and LSE. A row that saw
//! visible keys whose scores were all −∞ ends with `l = 0`; it gets NaN, not the `O = 0`,
//! `LSE = −∞` of a row that sees no key at all.

use super::frag::{quad_max, AccTile, RowVec};
use super::ptx;

/// `ln 2`: converts the base-2 LSE kept by the kernel to the natural log of the API.
const LN_2: f32 = core::f32::consts::LN_2;

/// The softmax state of the `2·MT` rows a thread holds.
pub struct OnlineSoftmax<const MT: usize> {
    /// Running maximum of the scaled scores, base 2 (quad-uniform).
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
    /// its O rows, or `None` when no row's maximum moved (the factor is exactly 1; the answer
    /// is warp-uniform, so the caller's branch is too).
    ///
    /// # Safety
    /// The whole warp calls it.
    #[inline(always)]
    pub unsafe fn update<const MASKED: bool, const NT: usize>(
        &mut self,
        s: &mut AccTile<MT, NT>,
        scale: f32,
        visible: impl Fn(usize, usize, usize, usize) -> bool,
    ) -> Option<RowVec<f32, MT>> {
        let mut rescale = RowVec::<f32, MT>::splat(1.0);
        let mut any_moved = false;
        // One m-tile at a time, as its rows are independent: shorter live ranges.
        for mt in 0..MT {
            // Row maxima of the raw scores, then into base 2: the scale is positive, so max
            // and scaling commute.
            let mut raw_max = [f32::NEG_INFINITY; 2];
            s.for_each_in_mtile(mt, |r, nt, c, x| {
                if MASKED && !visible(mt, r, nt, c) {
                    *x = f32::NEG_INFINITY;
                }
                raw_max[r] = raw_max[r].max(*x);
            });
            let mut shift = [0.0f32; 2];
            for r in 0..2 {
                let tile_max = quad_max(raw_max[r]);
                // −∞ stays −∞ (also for a zero scale, where −∞·0 would be NaN).
                let tile_max = if tile_max == f32::NEG_INFINITY {
                    tile_max
                } else {
                    tile_max * scale
                };
                let m_old = self.m.0[mt][r];
                let m_new = m_old.max(tile_max);
                any_moved |= m_new != m_old;
                // A row that has seen only masked keys keeps m = −∞; subtracting 0 instead
                // keeps 2^(−∞ − shift) = 0 rather than NaN.
                shift[r] = if m_new == f32::NEG_INFINITY {
                    0.0
                } else {
                    m_new
                };
                rescale.0[mt][r] = ptx::ex2_approx_ftz(m_old - shift[r]);
                self.m.0[mt][r] = m_new;
            }
            let mut row_sum = [0.0f32; 2];
            s.for_each_in_mtile(mt, |r, _, _, x| {
                let p = ptx::ex2_approx_ftz(ptx::fma_rn_f32(*x, scale, -shift[r]));
                // Masked scores are −∞; with a zero scale −∞·0 is NaN, so zero them here.
                *x = if MASKED && *x == f32::NEG_INFINITY {
                    0.0
                } else {
                    p
                };
                row_sum[r] += *x;
            });
            for r in 0..2 {
                self.l.0[mt][r] = self.l.0[mt][r] * rescale.0[mt][r] + row_sum[r];
            }
        }
        if ptx::vote_any_sync(any_moved) {
            Some(rescale)
        } else {
            None
        }
    }

    /// The state to merge with other warps' (FlashDecoding's split merge): the running
    /// maxima `m` (base 2, scaled) and the row sums `l` summed over the quad, per row.
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
