//! The state of one query tile during FlashAttention-2's key loop: the query rows in f32,
//! and per row the running maximum (base-2 domain), the running sum of exponentials and the
//! unnormalised output accumulator.

use std::ops::Range;

use flash_attn_kernels::mask::AttnMask;
use ndarray::{s, ArrayView2, ArrayViewMut1, ArrayViewMut2};

use crate::dtype::Element;

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
    /// Scores of the current tile, `rows × block_n`, times `scale·log2 e`.
    scores: Vec<f32>,
    /// Running row maxima of the scores (base 2), −∞ while a row has seen no key.
    max: Vec<f32>,
    /// Running row sums of `2^(score − max)`.
    sum: Vec<f32>,
    /// Unnormalised outputs, `rows × d`.
    acc: Vec<f32>,
}

impl QueryTile {
    /// Buffers for tiles of `block_m` query rows and `block_n` keys of head dim `d`.
    pub(crate) fn new(block_m: usize, block_n: usize, d: usize) -> Self {
        QueryTile {
            d,
            block_n,
            row0: 0,
            rows: 0,
            q: Vec::with_capacity(block_m * d),
            k: Vec::with_capacity(block_n * d),
            v: Vec::with_capacity(block_n * d),
            scores: vec![0.0; block_m * block_n],
            max: Vec::with_capacity(block_m),
            sum: Vec::with_capacity(block_m),
            acc: Vec::with_capacity(block_m * d),
        }
    }

    /// Starts the query rows `rows` of `q` (`[Nq, d]`): loads them and clears the state.
    pub(crate) fn start<T: Element>(&mut self, q: ArrayView2<T>, rows: Range<usize>) {
        self.row0 = rows.start;
        self.rows = rows.len();
        load_rows(q, rows, &mut self.q);
        self.max.clear();
        self.max.resize(self.rows, f32::NEG_INFINITY);
        self.sum.clear();
        self.sum.resize(self.rows, 0.0);
        self.acc.clear();
        self.acc.resize(self.rows * self.d, 0.0);
    }

    /// Folds the keys `keys` of `k` and `v` (`[Nk, d]`) into the tile's state. With
    /// `needs_mask`, scores of keys that `mask` hides from a row become −∞ first.
    pub(crate) fn visit_keys<T: Element, M: AttnMask>(
        &mut self,
        k: ArrayView2<T>,
        v: ArrayView2<T>,
        keys: Range<usize>,
        scale_log2: f32,
        mask: Option<&M>,
    ) {
        let key0 = keys.start;
        let n = keys.len();
        load_rows(k, keys.clone(), &mut self.k);
        load_rows(v, keys, &mut self.v);
        for r in 0..self.rows {
            let s = &mut self.scores[r * self.block_n..r * self.block_n + n];
            let q_row = &self.q[r * self.d..(r + 1) * self.d];
            for (c, (s, k_row)) in s.iter_mut().zip(self.k.chunks_exact(self.d)).enumerate() {
                let visible = mask.is_none_or(|m| m.visible(idx(self.row0 + r), idx(key0 + c)));
                *s = if visible {
                    dot(q_row, k_row) * scale_log2
                } else {
                    f32::NEG_INFINITY
                };
            }
            let tile_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let new_max = self.max[r].max(tile_max);
            if new_max == f32::NEG_INFINITY {
                continue; // nothing visible to this row yet
            }
            let correction = (self.max[r] - new_max).exp2();
            self.max[r] = new_max;
            let acc = &mut self.acc[r * self.d..(r + 1) * self.d];
            acc.iter_mut().for_each(|a| *a *= correction);
            let mut sum = self.sum[r] * correction;
            for (&s, v_row) in s.iter().zip(self.v.chunks_exact(self.d)) {
                let p = (s - new_max).exp2();
                sum += p;
                acc.iter_mut().zip(v_row).for_each(|(a, &x)| *a += p * x);
            }
            self.sum[r] = sum;
        }
    }

    /// Writes the normalised outputs of the tile's rows to `o` (`[Nq, d]`) and their natural
    /// log-sum-exp to `lse` (`[Nq]`); a row that saw no key gets zeros and −∞.
    pub(crate) fn finish<T: Element>(&self, mut o: ArrayViewMut2<T>, mut lse: ArrayViewMut1<f32>) {
        for r in 0..self.rows {
            let i = self.row0 + r;
            let (sum, max) = (self.sum[r], self.max[r]);
            let acc = &self.acc[r * self.d..(r + 1) * self.d];
            let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            for (dst, &a) in o.row_mut(i).iter_mut().zip(acc) {
                *dst = T::from_f32(a * inv);
            }
            lse[i] = if sum > 0.0 {
                ((f64::from(max) + f64::from(sum).log2()) * std::f64::consts::LN_2) as f32
            } else {
                f32::NEG_INFINITY
            };
        }
    }
}

/// Copies rows `rows` of a `[N, d]` view into `dst` as contiguous f32.
fn load_rows<T: Element>(src: ArrayView2<T>, rows: Range<usize>, dst: &mut Vec<f32>) {
    dst.clear();
    for row in src.slice(s![rows, ..]).outer_iter() {
        dst.extend(row.iter().map(|x| x.to_f32()));
    }
}

/// Dot product with f32 accumulation, in index order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0, |s, (&x, &y)| s + x * y)
}

/// A row or key index as the mask's `u32`; [`crate::shape::check_shapes`] bounds the sizes.
fn idx(i: usize) -> u32 {
    i as u32
}
