//! The state of one query tile during FlashAttention-2's key loop: the query rows in f32,
//! and per row the running maximum (base-2 domain), the running sum of exponentials and the
//! unnormalised output accumulator.
//!
//! With attention dropout (the FlashAttention paper's Algorithm 2), each key tile's mask `Z`
//! is drawn ([`HeadDropout::fill`]) and applied to the exponentials after they are added to
//! the row sum (the LSE is that of the softmax before dropout) and before `P·V`; the output is
//! multiplied by `1/(1 − p)` when it is normalised.

use std::ops::Range;

use flash_attn_kernels::mask::AttnMask;

use crate::mask::CpuScores;
use ndarray::{s, ArrayView2, ArrayViewMut1, ArrayViewMut2};

use crate::cpu::alloc::{filled, numel, with_capacity};
use crate::cpu::dropout::HeadDropout;
use crate::dtype::Element;
use crate::error::Result;

/// Working buffers of one query tile against one key tile at a time. Sized for at most
/// `block_m` query rows and `block_n` keys; reused across tiles and heads.
pub(crate) struct QueryTile {
    /// Head dim.
    d: usize,
    /// Keys per key tile (row pitch of `scores`).
    block_n: usize,
    /// First query row of the tile.
    row0: usize,
    /// Query rows in the tile (≤ `block_m`).
    rows: usize,
    /// Query rows, `rows × d`, in f32.
    q: Vec<f32>,
    /// The current key tile, `keys × d`.
    k: Vec<f32>,
    /// The current value tile, `keys × d`.
    v: Vec<f32>,
    /// Base-2 logits of the current tile, `rows × block_n`, in f64 ([`CpuScores::logit2`]):
    /// each exponent `logit − max` is rounded to f32 once, as the kernels' FFMA
    /// `s·scale_log2 − max` rounds it, not the logit first at its own magnitude (an f32 logit
    /// near 100 is off by up to 4e-6, about the whole error of the f32 naive attention there,
    /// and dropout's `1/(1 − p)` triples what reaches O). The running maxima stay f32.
    scores: Vec<f64>,
    /// Per row: whether it has seen at least one key the mask shows it.
    seen: Vec<bool>,
    /// Running row maxima of the visible scores (base 2), NaN-propagating; −∞ while a row's
    /// visible scores are all −∞ (or it has seen none).
    max: Vec<f32>,
    /// Running row sums of `2^(score − max)`, one addition per key tile.
    sum: Vec<f32>,
    /// Unnormalised outputs, `rows × d`, one addition per key tile.
    acc: Vec<f32>,
    /// One row's `P·V` over the current key tile, `d`, added to `acc` once per tile.
    pv: Vec<f32>,
    /// The dropout of the tile's (sequence, head), if any.
    dropout: Option<HeadDropout>,
    /// `Z` of the current tile with dropout, `rows × block_n`: 1 kept, 0 dropped.
    keep: Vec<u8>,
}

impl QueryTile {
    /// Buffers for tiles of `block_m` query rows and `block_n` keys of head dim `d`; an error
    /// (not an abort) when they cannot be allocated.
    pub(crate) fn new(block_m: usize, block_n: usize, d: usize) -> Result<Self> {
        let rows_d = numel::<f32>(&[block_m, d], "CPU query tile")?;
        let keys_d = numel::<f32>(&[block_n, d], "CPU key tile")?;
        Ok(QueryTile {
            d,
            block_n,
            row0: 0,
            rows: 0,
            q: with_capacity(rows_d, "CPU query tile")?,
            k: with_capacity(keys_d, "CPU key tile")?,
            v: with_capacity(keys_d, "CPU value tile")?,
            scores: filled(block_m * block_n, 0.0, "CPU score tile")?,
            seen: with_capacity(block_m, "CPU row state")?,
            max: with_capacity(block_m, "CPU row state")?,
            sum: with_capacity(block_m, "CPU row state")?,
            acc: with_capacity(rows_d, "CPU output tile")?,
            pv: filled(d, 0.0, "CPU output tile")?,
            dropout: None,
            keep: filled(block_m * block_n, 0, "CPU dropout tile")?,
        })
    }

    /// Starts the query rows `rows` of `q` (`[Nq, d]`), with the dropout of their (sequence,
    /// head) if any: loads them and clears the state.
    pub(crate) fn start<T: Element>(
        &mut self,
        q: ArrayView2<T>,
        rows: Range<usize>,
        dropout: Option<HeadDropout>,
    ) {
        self.dropout = dropout;
        self.row0 = rows.start;
        self.rows = rows.len();
        load_rows(q, rows, &mut self.q);
        self.seen.clear();
        self.seen.resize(self.rows, false);
        self.max.clear();
        self.max.resize(self.rows, f32::NEG_INFINITY);
        self.sum.clear();
        self.sum.resize(self.rows, 0.0);
        self.acc.clear();
        self.acc.resize(self.rows * self.d, 0.0);
    }

    /// Folds the keys `keys` of `k` and `v` (`[Nk, d]`) into the tile's state, scores turned
    /// into logits by `scores`. With `needs_mask`, keys the mask hides from a row are skipped
    /// for that row (neither their K nor their V is read for it). The tile's probabilities and
    /// `P·V` are summed tile-locally and added to the running sums once, as the GPU's
    /// tensor-core accumulation does: adding one key at a time to a sum over 10⁶ keys loses
    /// most of each term's bits in f32. With dropout, `P·V` takes `P ∘ Z` (a product: a NaN
    /// probability stays NaN), the sum takes `P`.
    pub(crate) fn visit_keys<T: Element, M: AttnMask>(
        &mut self,
        k: ArrayView2<T>,
        v: ArrayView2<T>,
        keys: Range<usize>,
        scores: &CpuScores<M>,
        needs_mask: bool,
    ) {
        let key0 = keys.start;
        let n = keys.len();
        load_rows(k, keys.clone(), &mut self.k);
        load_rows(v, keys.clone(), &mut self.v);
        if let Some(dropout) = &self.dropout {
            let rows = self.row0..self.row0 + self.rows;
            dropout.fill(rows, keys, &mut self.keep, self.block_n);
        }
        let d = self.d;
        for r in 0..self.rows {
            let row = self.row0 + r;
            let visible = |c: usize| !needs_mask || scores.mask.visible(idx(row), idx(key0 + c));
            let s = &mut self.scores[r * self.block_n..r * self.block_n + n];
            let q_row = &self.q[r * d..(r + 1) * d];
            let mut any_visible = false;
            for (c, (s, k_row)) in s.iter_mut().zip(self.k.chunks_exact(d)).enumerate() {
                *s = if visible(c) {
                    any_visible = true;
                    scores.logit2(row, key0 + c, dot(q_row, k_row))
                } else {
                    f64::NEG_INFINITY
                };
            }
            if !any_visible {
                continue;
            }
            self.seen[r] = true;
            let tile_max = s
                .iter()
                .fold(f32::NEG_INFINITY, |m, &x| max_nan(m, x as f32));
            let new_max = max_nan(self.max[r], tile_max);
            // While every visible score is −∞, subtract 0 instead of −∞ (−∞ − −∞ is NaN): the
            // probabilities stay 0, and 0·V still carries a NaN of V, as in the reference.
            let shift = if new_max == f32::NEG_INFINITY {
                0.0
            } else {
                new_max
            };
            let correction = (self.max[r] - shift).exp2();
            self.max[r] = new_max;
            self.pv.fill(0.0);
            let mut tile_sum = 0.0;
            let keep = &self.keep[r * self.block_n..r * self.block_n + n];
            for (c, (&s, v_row)) in s.iter().zip(self.v.chunks_exact(d)).enumerate() {
                if !visible(c) {
                    continue;
                }
                let mut p = ((s - f64::from(shift)) as f32).exp2();
                tile_sum += p;
                if self.dropout.is_some() {
                    p *= f32::from(keep[c]);
                }
                self.pv
                    .iter_mut()
                    .zip(v_row)
                    .for_each(|(a, &x)| *a += p * x);
            }
            let acc = &mut self.acc[r * d..(r + 1) * d];
            acc.iter_mut()
                .zip(&self.pv)
                .for_each(|(a, &pv)| *a = *a * correction + pv);
            self.sum[r] = self.sum[r] * correction + tile_sum;
        }
    }

    /// Writes the normalised outputs of the tile's rows to `o` (`[Nq, d]`) and their natural
    /// log-sum-exp to `lse` (`[Nq]`), outputs times `1/(1 − p)` with dropout (the LSE is that
    /// of the softmax before dropout). A row that saw no key gets zeros and −∞; a row whose
    /// visible scores were all −∞ gets NaN; NaN and +∞ scores reach O and LSE as NaN through
    /// the arithmetic (see [`crate::AttnParams`]).
    pub(crate) fn finish<T: Element>(&self, mut o: ArrayViewMut2<T>, mut lse: ArrayViewMut1<f32>) {
        for r in 0..self.rows {
            let i = self.row0 + r;
            let (sum, max) = (self.sum[r], self.max[r]);
            let acc = &self.acc[r * self.d..(r + 1) * self.d];
            let (inv, row_lse) = if !self.seen[r] {
                (0.0, f32::NEG_INFINITY)
            } else if max == f32::NEG_INFINITY {
                (f32::NAN, f32::NAN)
            } else {
                let lse = (f64::from(max) + f64::from(sum).log2()) * std::f64::consts::LN_2;
                let inv = match &self.dropout {
                    None => 1.0 / sum,
                    Some(dropout) => dropout.scale / sum,
                };
                (inv, lse as f32)
            };
            for (dst, &a) in o.row_mut(i).iter_mut().zip(acc) {
                *dst = T::from_f32(a * inv);
            }
            lse[i] = row_lse;
        }
    }
}

/// `max` that propagates NaN (`f32::max` returns the other operand, which would hide a NaN
/// score behind the row's other scores).
fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// Copies rows `rows` of a `[N, d]` view into `dst` as contiguous f32.
pub(crate) fn load_rows<T: Element>(src: ArrayView2<T>, rows: Range<usize>, dst: &mut Vec<f32>) {
    dst.clear();
    for row in src.slice(s![rows, ..]).outer_iter() {
        dst.extend(row.iter().map(|x| x.to_f32()));
    }
}

/// Dot product of f32 rows, accumulated in f64 and rounded to f32 once. The products of f32
/// values are exact in f64 (as those of f16/bf16 values are in the tensor cores' f32), so a
/// score is off by half an ulp, not by a rounding per product and per sum: with large queries
/// and keys an f32 fold misses a score by up to a few ulp (3e-6 at 52 in a failing test
/// case), which alone can exceed twice the f32 naive attention's error in O and, through the
/// recomputed P, in the backward's gradients. Four partial sums (elements `i` with the same
/// `i mod 4`) added in a fixed order: the result does not depend on the machine, and the loop
/// vectorises (it is no slower than the sequential f32 fold was).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a4, b4) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail = a4
        .remainder()
        .iter()
        .zip(b4.remainder())
        .fold(0.0, |s, (&x, &y)| s + f64::from(x) * f64::from(y));
    let mut part = [0.0f64; 4];
    for (x, y) in a4.zip(b4) {
        for i in 0..4 {
            part[i] += f64::from(x[i]) * f64::from(y[i]);
        }
    }
    ((part[0] + part[1]) + (part[2] + part[3]) + tail) as f32
}

/// A row or key index as the mask's `u32`; [`crate::shape::check_shapes`] bounds the sizes.
pub(crate) fn idx(i: usize) -> u32 {
    i as u32
}
