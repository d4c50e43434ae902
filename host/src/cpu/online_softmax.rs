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
    /// Query rows, `rows × d`, in f64 (exact: converted once per tile, not per score).
    q: Vec<f64>,
    /// The current key tile, `keys × d`, in f64 likewise.
    k: Vec<f64>,
    /// The current value tile, `keys × d`.
    v: Vec<f32>,
    /// Base-2 logits of the current tile, `rows × block_n`, in f64 ([`CpuScores::logit2`]):
    /// each exponent `logit − max` is rounded to f32 once, as the kernels' FFMA
    /// `s·scale_log2 − max` rounds it, not the logit first at its own magnitude (an f32 logit
    /// near 100 is off by up to 4e-6, about the whole error of the f32 naive attention there,
    /// and dropout's `1/(1 − p)` triples what reaches O). The running maxima are these f64
    /// logits themselves, so the largest score's exponent is exactly 0.
    scores: Vec<f64>,
    /// One row's raw scores `q·k` against the current key tile ([`dots`]), `block_n`, in f64
    /// (see `scores`).
    raw: Vec<f64>,
    /// Per row: whether it has seen at least one key the mask shows it.
    seen: Vec<bool>,
    /// Running row maxima of the visible scores (base 2, f64 as `scores`), NaN-propagating;
    /// −∞ while a row's visible scores are all −∞ (or it has seen none). The largest score
    /// then gets exactly `2^0 = 1`: a row that sees one key gets O equal to that key's value
    /// row, bit for bit, and the backward's `dP − D` is exactly 0 there, as the true `dS` is.
    max: Vec<f64>,
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
        let rows_d = numel::<f64>(&[block_m, d], "CPU query tile")?;
        let keys_d = numel::<f64>(&[block_n, d], "CPU key tile")?;
        Ok(QueryTile {
            d,
            block_n,
            row0: 0,
            rows: 0,
            q: with_capacity(rows_d, "CPU query tile")?,
            k: with_capacity(keys_d, "CPU key tile")?,
            v: with_capacity(keys_d, "CPU value tile")?,
            scores: filled(block_m * block_n, 0.0, "CPU score tile")?,
            raw: filled(block_n, 0.0, "CPU score tile")?,
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
        self.max.resize(self.rows, f64::NEG_INFINITY);
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
        #[cfg(target_arch = "x86_64")]
        if with_avx2() {
            // SAFETY: the CPU has AVX2.
            return unsafe { self.visit_keys_avx2(k, v, keys, scores, needs_mask) };
        }
        // SAFETY: without AVX2 code.
        unsafe { self.visit_keys_any::<T, M, false>(k, v, keys, scores, needs_mask) }
    }

    /// [`Self::visit_keys`] compiled for AVX2 (see [`with_avx2`]).
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn visit_keys_avx2<T: Element, M: AttnMask>(
        &mut self,
        k: ArrayView2<T>,
        v: ArrayView2<T>,
        keys: Range<usize>,
        scores: &CpuScores<M>,
        needs_mask: bool,
    ) {
        // SAFETY: the caller's CPU has AVX2.
        unsafe { self.visit_keys_any::<T, M, true>(k, v, keys, scores, needs_mask) }
    }

    /// [`Self::visit_keys`] for any CPU (`AVX`: see [`dots`]).
    ///
    /// # Safety
    /// With `AVX`, the CPU has AVX2.
    #[inline(always)]
    unsafe fn visit_keys_any<T: Element, M: AttnMask, const AVX: bool>(
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
            let raw = &mut self.raw[..n];
            // SAFETY: with `AVX`, the CPU has AVX2 (this function's contract).
            unsafe { dots::<AVX, f64>(q_row, &self.k, raw) };
            let mut any_visible = false;
            for (c, (s, &raw)) in s.iter_mut().zip(raw.iter()).enumerate() {
                *s = if visible(c) {
                    any_visible = true;
                    scores.logit2(row, key0 + c, raw)
                } else {
                    f64::NEG_INFINITY
                };
            }
            if !any_visible {
                continue;
            }
            self.seen[r] = true;
            let tile_max = s.iter().fold(f64::NEG_INFINITY, |m, &x| max_nan(m, x));
            let new_max = max_nan(self.max[r], tile_max);
            // While every visible score is −∞, subtract 0 instead of −∞ (−∞ − −∞ is NaN): the
            // probabilities stay 0, and 0·V still carries a NaN of V, as in the reference.
            let shift = if new_max == f64::NEG_INFINITY {
                0.0
            } else {
                new_max
            };
            let correction = ((self.max[r] - shift) as f32).exp2();
            self.max[r] = new_max;
            self.pv.fill(0.0);
            let mut tile_sum = 0.0;
            let keep = &self.keep[r * self.block_n..r * self.block_n + n];
            for (c, (&s, v_row)) in s.iter().zip(self.v.chunks_exact(d)).enumerate() {
                if !visible(c) {
                    continue;
                }
                let mut p = ((s - shift) as f32).exp2();
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
            } else if max == f64::NEG_INFINITY {
                (f32::NAN, f32::NAN)
            } else {
                let lse = (max + f64::from(sum).log2()) * std::f64::consts::LN_2;
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

/// Whether the CPU has AVX2, for the hot loops of the CPU backend: each is one function
/// compiled twice, for any x86-64 CPU and for AVX2 (wider vectors; no fused multiply-add, so
/// every rounding, and with it every result, is the same in both).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn with_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// `max` that propagates NaN (`f64::max` returns the other operand, which would hide a NaN
/// score behind the row's other scores).
fn max_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// Copies rows `rows` of a `[N, d]` view into `dst` as contiguous `F` (f32, or f64 for the
/// operands of [`dot`]: the conversion is exact, done once per tile instead of once per
/// product).
pub(crate) fn load_rows<T: Element, F: From<f32>>(
    src: ArrayView2<T>,
    rows: Range<usize>,
    dst: &mut Vec<F>,
) {
    dst.clear();
    for row in src.slice(s![rows, ..]).outer_iter() {
        dst.extend(row.iter().map(|x| F::from(x.to_f32())));
    }
}

/// Dot product of f32 values held in f64 (see [`load_rows`]), accumulated in f64 and rounded
/// to f32 once. The products of f32 values are exact in f64 (as those of f16/bf16 values are
/// in the tensor cores' f32), so a score is off by half an ulp, not by a rounding per product
/// and per sum: with large queries and keys an f32 fold misses a score by up to a few ulp
/// (3e-6 at 52 in a failing test case), which alone can exceed twice the f32 naive
/// attention's error in O and, through the recomputed P, in the backward's gradients. Four
/// partial sums (elements `i` with the same `i mod 4`) added in a fixed order: the result does
/// not depend on the machine, and the loop vectorises.
#[inline(always)]
pub(crate) fn dot<F: DotSum>(a: &[f64], b: &[f64]) -> F {
    let (a4, b4) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail = a4
        .remainder()
        .iter()
        .zip(b4.remainder())
        .fold(0.0, |s, (&x, &y)| s + x * y);
    let mut part = [0.0f64; 4];
    for (x, y) in a4.zip(b4) {
        for i in 0..4 {
            part[i] += x[i] * y[i];
        }
    }
    F::round((part[0] + part[1]) + (part[2] + part[3]) + tail)
}

/// What a [`dot`] returns: its f64 sum itself (raw scores, whose rounding to f32 would move a
/// logit near 100 by up to 4e-6, more than the f32 naive attention's whole error), or that
/// sum rounded to f32 once (the backward's `dP` and `D`).
pub(crate) trait DotSum: Copy {
    /// The sum as this type.
    fn round(sum: f64) -> Self;
}

impl DotSum for f32 {
    #[inline(always)]
    fn round(sum: f64) -> Self {
        sum as f32
    }
}

impl DotSum for f64 {
    #[inline(always)]
    fn round(sum: f64) -> Self {
        sum
    }
}

/// `out[c] = dot(a, row c of rows)` for the first `out.len()` rows of `rows` (rows of
/// `a.len()` values), four rows at a time so that each load of `a` serves four products; each
/// result is the one [`dot`] returns (the same sums in the same order). `AVX`: only in code
/// compiled for AVX2 ([`with_avx2`]), where the four products run on 256-bit vectors.
///
/// # Safety
/// With `AVX`, the CPU has AVX2.
#[inline(always)]
pub(crate) unsafe fn dots<const AVX: bool, F: DotSum>(a: &[f64], rows: &[f64], out: &mut [F]) {
    let d = a.len();
    let mut rows = rows.chunks_exact(d);
    let mut quads = out.chunks_exact_mut(4);
    for quad in &mut quads {
        let mut next = || rows.next().expect("a row per result");
        let four = [next(), next(), next(), next()];
        #[cfg(target_arch = "x86_64")]
        if AVX {
            // SAFETY: with `AVX`, the CPU has AVX2 (this function's contract).
            quad.copy_from_slice(&unsafe { dot4_avx2(a, four) });
            continue;
        }
        quad.copy_from_slice(&dot4(a, four));
    }
    for (out, row) in quads.into_remainder().iter_mut().zip(rows) {
        *out = dot(a, row);
    }
}

/// [`dot`] of `a` with four rows at once.
#[inline(always)]
fn dot4<F: DotSum>(a: &[f64], rows: [&[f64]; 4]) -> [F; 4] {
    let n = a.len();
    let rows = rows.map(|r| &r[..n]);
    let whole = n - n % 4;
    let mut part = [[0.0f64; 4]; 4];
    let [r0, r1, r2, r3] = rows.map(|r| r.chunks_exact(4));
    for ((((x, y0), y1), y2), y3) in a.chunks_exact(4).zip(r0).zip(r1).zip(r2).zip(r3) {
        for (part, y) in part.iter_mut().zip([y0, y1, y2, y3]) {
            for i in 0..4 {
                part[i] += x[i] * y[i];
            }
        }
    }
    finish_dot4(a, rows, part, whole)
}

/// [`dot4`] on AVX2: lane `i` of row `j`'s vector is `part[j][i]` of [`dot4`], summed in the
/// same order (a product, then a sum: no fused multiply-add).
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot4_avx2<F: DotSum>(a: &[f64], rows: [&[f64]; 4]) -> [F; 4] {
    use std::arch::x86_64::_mm256_storeu_pd;
    use std::arch::x86_64::{_mm256_add_pd, _mm256_loadu_pd, _mm256_mul_pd, _mm256_setzero_pd};
    let n = a.len();
    let rows = rows.map(|r| &r[..n]);
    let whole = n - n % 4;
    let mut acc = [_mm256_setzero_pd(); 4];
    for at in (0..whole).step_by(4) {
        // SAFETY: `at + 4 <= whole <= n`, the length of `a` and of every row.
        let x = unsafe { _mm256_loadu_pd(a.as_ptr().add(at)) };
        for (acc, row) in acc.iter_mut().zip(rows) {
            // SAFETY: as above.
            let y = unsafe { _mm256_loadu_pd(row.as_ptr().add(at)) };
            *acc = _mm256_add_pd(*acc, _mm256_mul_pd(x, y));
        }
    }
    let mut part = [[0.0f64; 4]; 4];
    for (part, acc) in part.iter_mut().zip(acc) {
        // SAFETY: four f64 of room.
        unsafe { _mm256_storeu_pd(part.as_mut_ptr(), acc) };
    }
    finish_dot4(a, rows, part, whole)
}

/// The end of [`dot4`]: each row's partial sums and its tail past `whole`, as [`dot`] ends.
#[inline(always)]
fn finish_dot4<F: DotSum>(
    a: &[f64],
    rows: [&[f64]; 4],
    part: [[f64; 4]; 4],
    whole: usize,
) -> [F; 4] {
    let mut sums = [0.0f64; 4];
    for ((sum, part), row) in sums.iter_mut().zip(part).zip(rows) {
        let tail = a[whole..]
            .iter()
            .zip(&row[whole..])
            .fold(0.0, |s, (&x, &y)| s + x * y);
        *sum = (part[0] + part[1]) + (part[2] + part[3]) + tail;
    }
    sums.map(F::round)
}

/// A row or key index as the mask's `u32`; [`crate::shape::check_shapes`] bounds the sizes.
pub(crate) fn idx(i: usize) -> u32 {
    i as u32
}

#[cfg(test)]
pub(crate) mod tests {
    use super::{dot, dots};

    /// Values of every magnitude, signs mixed, from a fixed integer sequence (exact in f32).
    pub(crate) fn values(n: usize, seed: u32) -> Vec<f64> {
        let mut x = seed.wrapping_mul(0x9e37_79b9) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let mantissa = (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                f64::from(mantissa * 2f32.powi((x % 40) as i32 - 20))
            })
            .collect()
    }

    /// `a` all ones and rows whose terms cancel: `2^60, 1, −2^60, 1` turned by the row's index
    /// (and the element's chunk), so that the lanes' partial sums are ±2^60 and 1 in different
    /// lanes: a sum in another order than `dot`'s gives 0, 1 or 2 where it gives another.
    fn cancelling(d: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
        let big = 2f64.powi(60);
        let pattern = [big, 1.0, -big, 1.0];
        let rows = (0..n * d)
            .map(|at| {
                let (row, i) = (at / d, at % d);
                pattern[(i + row + i / 4) % 4]
            })
            .collect();
        (vec![1.0; d], rows)
    }

    /// Both forms of `dots` (four rows at a time, and on AVX2 where the CPU has it) return
    /// exactly what `dot` returns for each row: head dims with and without a tail of fewer
    /// than four, row counts with and without a remainder.
    #[test]
    fn dots_equal_dot_bit_for_bit() {
        for d in [1, 3, 4, 7, 8, 40, 64, 65, 128, 259] {
            for (n, crafted) in [
                (1, false),
                (3, false),
                (4, true),
                (5, false),
                (8, true),
                (64, false),
            ] {
                let (a, rows) = if crafted {
                    cancelling(d, n)
                } else {
                    (values(d, d as u32), values(d * n, (d * n) as u32 + 1))
                };
                let want: Vec<u32> = rows
                    .chunks_exact(d)
                    .map(|r| dot::<f32>(&a, r).to_bits())
                    .collect();
                let mut got = vec![0.0f32; n];
                // SAFETY: the portable form.
                unsafe { dots::<false, f32>(&a, &rows, &mut got) };
                let bits: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                assert_eq!(bits, want, "portable, d = {d}, n = {n}");
                #[cfg(target_arch = "x86_64")]
                if super::with_avx2() {
                    got.fill(0.0);
                    // SAFETY: the CPU has AVX2.
                    unsafe { dots_avx2(&a, &rows, &mut got) };
                    let bits: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(bits, want, "AVX2, d = {d}, n = {n}");
                }
            }
        }
    }

    /// `dots::<true>` compiled for AVX2, as the backend's hot loops call it.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn dots_avx2(a: &[f64], rows: &[f64], out: &mut [f32]) {
        // SAFETY: the caller's CPU has AVX2.
        unsafe { dots::<true, f32>(a, rows, out) }
    }
}
