//! The CPU backend's backward pass: FlashAttention-2's tiled backward (Algorithm 4 of the
//! FlashAttention paper, with FA2's `D = rowsum(dO ∘ O)` pre-pass).
//!
//! One job per (batch, key/value head), run in parallel like the forward pass. A job first
//! computes `D` and `LSE·log2 e` for every query row of the query heads sharing its key/value
//! head; then key tiles of [`BLOCK_N`] keys are the outer loop and, for each query head of the
//! group, the query tiles of [`BLOCK_M`] rows that visit the key tile are the inner one:
//! `P = 2^(scale_log2·Q·Kᵀ − LSE·log2 e)` is recomputed from the forward's LSE,
//! `dV += Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)`, `dK += dSᵀ·Q` and `dQ += dS·K`, all in f32
//! (the dot products of the scores and of dP accumulated in f64 and rounded once, see
//! [`dots`]). The gradients' terms are computed for [`GROUP`] query rows at a time and then
//! added, in the same order as row by row and key by key, up to four per pass over an
//! accumulator row ([`Terms`]): the sums are bit for bit those of one term at a time.
//! dK and dV of a key tile are complete (summed over the group's query heads, so GQA needs no
//! atomics and the result does not depend on the thread count) when its inner loop ends; dQ
//! lives in an f64 buffer of the job until every key tile has been visited. `scale` is applied
//! once to dK and dQ at the end.
//!
//! The tiles visited and masked are the forward's: a query tile visits the key tiles that
//! [`AttnMask::key_tiles`] names (inverted once per call into a [`KeySchedule`]), and only
//! tiles where [`AttnMask::tile_needs_mask`] says so test [`AttnMask::visible`] element by
//! element; a masked score is skipped before the exponential, never computed as `0·∞`.
//!
//! With attention dropout (Algorithm 4), each (query tile, key tile) draws the forward's mask
//! `Z` again from the kernels' generator ([`crate::cpu::dropout`]; the forward keeps none), and
//! [`KeyTile::visit_queries`] takes `dV += (P ∘ Z)ᵀ·dO/(1 − p)` and
//! `dS = P ∘ (dP ∘ Z/(1 − p) − D)`, D being computed from the forward's (dropped) O as before.

use std::ops::Range;

use flash_attn_kernels::mask::AttnMask;
use ndarray::{s, ArrayView1, ArrayView2, ArrayView3, ArrayView4, ArrayViewMut2};
use ndarray::{ArrayViewMut4, Axis, Dim};

use crate::cpu::alloc;
use crate::cpu::backward_reference::Gradients;
use crate::cpu::dropout::{CallDropout, HeadDropout};
#[cfg(target_arch = "x86_64")]
use crate::cpu::online_softmax::with_avx2;
use crate::cpu::online_softmax::{dot, dots, idx, load_rows};
use crate::cpu::sequences::{backward_spans, key_padding, rows, stat_rows};
use crate::cpu::tiled::{run_parallel, BLOCK_M, BLOCK_N};
use crate::cpu::validate::{check_backward_inputs, check_gradients, check_inputs};
use crate::dtype::Element;
use crate::error::Result;
use crate::mask::{cpu_mask, with_cpu_mask, CpuScores};
use crate::params::AttnParams;
use crate::shape::AttnShape;

/// The attention backward pass on the CPU. Takes the forward's inputs Q `[B, Nq, Hq, d]`, K
/// and V `[B, Nk, Hkv, d]`, its outputs O `[B, Nq, Hq, d]` and natural-log LSE `[B, Hq, Nq]`
/// (as [`crate::cpu::attention_cpu`] returns them) and the gradient dO of the loss with
/// respect to O (Q's shape), all with any strides, and the forward's `params`. Returns dQ
/// (Q's shape), dK and dV (K's shape) in `T`; dK and dV of a key/value head shared by several
/// query heads are sums over them.
///
/// With dropout ([`AttnParams::dropout`], the forward's: same probability, seed, offset and
/// first sequence), the forward's mask is drawn again and the gradients are those of
/// `O = (P ∘ Z)·V/(1 − p)`.
///
/// A row whose LSE is −∞ (it saw no key) contributes nothing and gets a zero dQ row; NaN in
/// the inputs gives NaN. The result is deterministic: independent of the number of threads.
/// Shapes are checked before any work ([`crate::FlashError::Shape`] when O, dO or LSE do not
/// fit Q, K and V; the errors of [`crate::shape::check_shapes`], [`AttnParams::scale`] and
/// [`AttnParams::active_dropout`] otherwise), and buffers that cannot be allocated are
/// errors, never a panic.
pub fn attention_backward_cpu<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    o: ArrayView4<T>,
    d_o: ArrayView4<T>,
    lse: ArrayView3<f32>,
    params: &AttnParams,
) -> Result<Gradients<T>> {
    let shape = check_inputs(&q, &k, &v)?;
    check_backward_inputs(&shape, &o, &d_o, &lse)?;
    params.scale_log2(shape.head_dim)?;
    params.check_masks(shape.batch, shape.heads_q)?;
    params.active_dropout()?;
    let mut dq = alloc::array(Dim(shape.q_dims()), T::default(), "gradient dQ")?;
    let mut dk = alloc::array(Dim(shape.kv_dims()), T::default(), "gradient dK")?;
    let mut dv = alloc::array(Dim(shape.kv_dims()), T::default(), "gradient dV")?;
    attention_backward_cpu_into(
        q,
        k,
        v,
        o,
        d_o,
        lse,
        params,
        dq.view_mut(),
        dk.view_mut(),
        dv.view_mut(),
    )?;
    Ok((dq, dk, dv))
}

/// [`attention_backward_cpu`] writing into caller-provided gradients dQ `[B, Nq, Hq, d]`, dK
/// and dV `[B, Nk, Hkv, d]` (any strides; every element is overwritten); their shapes are
/// checked ([`crate::FlashError::Shape`]).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_cpu_into<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    o: ArrayView4<T>,
    d_o: ArrayView4<T>,
    lse: ArrayView3<f32>,
    params: &AttnParams,
    dq: ArrayViewMut4<T>,
    dk: ArrayViewMut4<T>,
    dv: ArrayViewMut4<T>,
) -> Result<()> {
    let shape = check_inputs(&q, &k, &v)?;
    check_backward_inputs(&shape, &o, &d_o, &lse)?;
    check_gradients(&shape, &dq, &dk, &dv)?;
    let scale = params.kernel_grad_scale(shape.head_dim)?;
    let scale_log2 = params.scale_log2(shape.head_dim)?;
    params.check_masks(shape.batch, shape.heads_q)?;
    let dropout = CallDropout::new(params, shape.heads_q)?;
    if let Some(spans) = key_padding(&q, &k, params)? {
        let dims = (shape.q_dims(), shape.kv_dims());
        let (dq_all, dk_all, dv_all) =
            backward_spans(dims, &spans, params, T::default(), |sp, p| {
                let (q_, k_, v_) = (rows(&q, sp, true), rows(&k, sp, false), rows(&v, sp, false));
                let (o_, do_) = (rows(&o, sp, true), rows(&d_o, sp, true));
                attention_backward_cpu(q_, k_, v_, o_, do_, stat_rows(&lse, sp), p)
            })?;
        let (mut dq, mut dk, mut dv) = (dq, dk, dv);
        dq.assign(&dq_all);
        dk.assign(&dk_all);
        dv.assign(&dv_all);
        return Ok(());
    }
    let group = shape.group_size();
    let n_jobs = alloc::numel::<KvHeadJob<T>>(&[shape.batch, shape.heads_kv], "CPU jobs")?;
    let mut jobs = alloc::with_capacity(n_jobs, "CPU jobs")?;
    let batches = dq
        .into_outer_iter_mut()
        .zip(dk.into_outer_iter_mut())
        .zip(dv.into_outer_iter_mut());
    for (b, ((dq_b, dk_b), dv_b)) in batches.enumerate() {
        let mut dq_heads = dq_b.into_axis_iter_mut(Axis(1));
        let kv_heads = dk_b
            .into_axis_iter_mut(Axis(1))
            .zip(dv_b.into_axis_iter_mut(Axis(1)));
        for (kv, (dk, dv)) in kv_heads.enumerate() {
            let mut heads = alloc::with_capacity(group, "CPU jobs")?;
            for h in kv * group..(kv + 1) * group {
                heads.push(QueryHead {
                    q: q.slice(s![b, .., h, ..]),
                    o: o.slice(s![b, .., h, ..]),
                    d_o: d_o.slice(s![b, .., h, ..]),
                    lse: lse.slice(s![b, h, ..]),
                    dq: dq_heads.next().expect("Hq = Hkv·group query heads"),
                    slope: params.slope(b, h, shape.heads_q),
                    index: b * shape.heads_q + h,
                    dropout: dropout.map(|d| d.head(b, h)),
                });
            }
            jobs.push(KvHeadJob {
                k: k.slice(s![b, .., kv, ..]),
                v: v.slice(s![b, .., kv, ..]),
                dk,
                dv,
                heads,
            });
        }
    }
    let new_state = || KeyTile::new(&shape);
    with_cpu_mask!(params, M => {
        // Each (batch, query head) its own mask and schedule (a block mask may differ between
        // them).
        let heads = alloc::numel::<M>(&[shape.batch, shape.heads_q], "CPU masks")?;
        let (mut masks, mut schedules) =
            (alloc::with_capacity(heads, "CPU masks")?, alloc::with_capacity(heads, "CPU masks")?);
        for b in 0..shape.batch {
            for h in 0..shape.heads_q {
                let mask: M = cpu_mask(params, &shape, (b, h))?;
                schedules.push(KeySchedule::new(&mask, &shape)?);
                masks.push(mask);
            }
        }
        let step = Step {
            masks: &masks,
            schedules: &schedules,
            scale,
            scale_log2,
            softcap: params.softcap,
        };
        run_parallel(jobs, new_state, |job, tile| job.run(tile, &step))
    })
}

/// Which query tiles visit each key tile: the forward's [`AttnMask::key_tiles`] per query
/// tile, inverted (compressed rows: `query_tiles[starts[n]..starts[n + 1]]` for key tile `n`,
/// in increasing order). Its size is the number of (query tile, key tile) pairs visited.
struct KeySchedule {
    /// Offsets into `query_tiles`, one per key tile plus one.
    starts: Vec<usize>,
    /// Query tile indices, grouped by key tile.
    query_tiles: Vec<u32>,
}

impl KeySchedule {
    /// The schedule of `mask` for tiles of [`BLOCK_M`] × [`BLOCK_N`].
    fn new<M: AttnMask>(mask: &M, shape: &AttnShape) -> Result<Self> {
        let (bm, bn) = (BLOCK_M as u32, BLOCK_N as u32);
        let m_tiles = shape.seqlen_q.div_ceil(BLOCK_M);
        let n_tiles = shape.seqlen_k.div_ceil(BLOCK_N);
        let visits = |m: usize| mask.key_tiles(idx(m * BLOCK_M), bm, bn);
        let mut starts = alloc::filled(n_tiles + 1, 0usize, "CPU key schedule")?;
        for m in 0..m_tiles {
            visits(m).for_each(|n| starts[n as usize + 1] += 1);
        }
        for n in 0..n_tiles {
            starts[n + 1] += starts[n];
        }
        let mut query_tiles = alloc::filled(starts[n_tiles], 0u32, "CPU key schedule")?;
        let mut next = alloc::filled(n_tiles, 0usize, "CPU key schedule")?;
        next.copy_from_slice(&starts[..n_tiles]);
        for m in 0..m_tiles {
            for n in visits(m) {
                query_tiles[next[n as usize]] = m as u32;
                next[n as usize] += 1;
            }
        }
        Ok(KeySchedule {
            starts,
            query_tiles,
        })
    }

    /// The query tiles that visit key tile `n`, in increasing order.
    fn query_tiles(&self, n: usize) -> &[u32] {
        &self.query_tiles[self.starts[n]..self.starts[n + 1]]
    }
}

/// What every job shares: the masks, the schedules and the scale.
struct Step<'a, M> {
    /// The forward's mask per (batch, query head), indexed by [`QueryHead::index`].
    masks: &'a [M],
    /// Query tiles per key tile, per (batch, query head).
    schedules: &'a [KeySchedule],
    /// Applied to dK and dQ at the end: the softmax scale, or 1 for masks whose scores carry
    /// it (see [`AttnParams::kernel_grad_scale`]).
    scale: f32,
    /// `scale·log2 e`, applied to the scores as in the forward pass.
    scale_log2: f32,
    /// The logit softcap, if any (see [`CpuScores`]).
    softcap: Option<f32>,
}

/// One query head of a job: its inputs `[Nq, d]` (LSE `[Nq]`) and its dQ rows.
struct QueryHead<'a, T> {
    /// Query rows `[Nq, d]`.
    q: ArrayView2<'a, T>,
    /// The forward's output rows `[Nq, d]`.
    o: ArrayView2<'a, T>,
    /// Gradient of the output `[Nq, d]`.
    d_o: ArrayView2<'a, T>,
    /// The forward's natural-log LSE `[Nq]`.
    lse: ArrayView1<'a, f32>,
    /// Gradient of the query rows `[Nq, d]`.
    dq: ArrayViewMut2<'a, T>,
    /// The head's ALiBi slope (0 without ALiBi).
    slope: f32,
    /// `batch · Hq + head`: the head's mask and schedule in [`Step`].
    index: usize,
    /// The head's dropout, if any.
    dropout: Option<HeadDropout>,
}

/// One (batch, key/value head): its keys and values `[Nk, d]`, their gradients, and the query
/// heads that read them.
struct KvHeadJob<'a, T> {
    /// Keys `[Nk, d]`.
    k: ArrayView2<'a, T>,
    /// Values `[Nk, d]`.
    v: ArrayView2<'a, T>,
    /// Gradient of the keys `[Nk, d]`.
    dk: ArrayViewMut2<'a, T>,
    /// Gradient of the values `[Nk, d]`.
    dv: ArrayViewMut2<'a, T>,
    /// The query heads sharing this key/value head (`Hq / Hkv` of them).
    heads: Vec<QueryHead<'a, T>>,
}

impl<T: Element> KvHeadJob<'_, T> {
    /// The tiled backward pass of one key/value head: key tiles outside, query tiles inside.
    fn run<M: AttnMask>(mut self, tile: &mut KeyTile, step: &Step<M>) {
        let (seqlen_q, seqlen_k) = (tile.seqlen_q, self.k.nrows());
        tile.pre_pass(&self.heads);
        let key_tiles = seqlen_k.div_ceil(BLOCK_N);
        for n_block in 0..key_tiles {
            let key0 = n_block * BLOCK_N;
            let keys = key0..(key0 + BLOCK_N).min(seqlen_k);
            tile.start(self.k, self.v, keys.clone());
            for (head, h) in self.heads.iter().zip(0..) {
                let mask = &step.masks[head.index];
                for &m_block in step.schedules[head.index].query_tiles(n_block) {
                    let row0 = m_block as usize * BLOCK_M;
                    let rows = row0..(row0 + BLOCK_M).min(seqlen_q);
                    let needs_mask = mask.tile_needs_mask(
                        idx(row0),
                        BLOCK_M as u32,
                        idx(n_block),
                        BLOCK_N as u32,
                    );
                    let scores = CpuScores {
                        mask,
                        slope: head.slope,
                        scale_log2: step.scale_log2,
                        softcap: step.softcap,
                    };
                    tile.visit_queries(head, h, rows, &scores, needs_mask);
                }
            }
            tile.finish_keys(
                self.dk.slice_mut(s![keys.clone(), ..]),
                self.dv.slice_mut(s![keys, ..]),
                step.scale,
            );
        }
        for (head, h) in self.heads.iter_mut().zip(0..) {
            tile.finish_queries(h, head.dq.view_mut(), step.scale);
        }
    }
}

/// The working buffers of one thread: one key tile's K, V and gradient accumulators, one
/// query tile's rows, and per query row of the job (all heads of the group) D, LSE·log2 e
/// and the dQ accumulator. The gradients accumulate in f64: each term (an f32 times an
/// f32) is exact there, so the sums over keys and queries add no rounding of their own
/// (in f32 they did, and an f32 case's dV once came out 2.08× the naive backward's error).
struct KeyTile {
    /// Head dim.
    d: usize,
    /// Query rows per head.
    seqlen_q: usize,
    /// Keys in the current key tile (≤ [`BLOCK_N`]).
    keys: usize,
    /// First key of the current key tile.
    key0: usize,
    /// The current key tile, `keys × d`, in f64 (exact, converted once per tile).
    k: Vec<f64>,
    /// The current value tile, `keys × d`, in f64 likewise.
    v: Vec<f64>,
    /// dK of the key tile (without `scale`), `keys × d`.
    dk: Vec<f64>,
    /// dV of the key tile, `keys × d`.
    dv: Vec<f64>,
    /// The current query rows, `rows × d`, in f64 likewise.
    q: Vec<f64>,
    /// The current rows of dO, `rows × d`, in f64 likewise.
    d_o: Vec<f64>,
    /// `D = rowsum(dO ∘ O)` per query row of every head, `group × Nq`.
    delta: Vec<f32>,
    /// `LSE·log2 e` per query row of every head, `group × Nq`, in f64 (see
    /// [`KeyTile::visit_queries`]).
    lse_log2: Vec<f64>,
    /// dQ (without `scale`) of every head, `group × Nq × d`.
    dq: Vec<f64>,
    /// One query row's raw scores `q·k` against the key tile ([`dots`]), `BLOCK_N`, in f64
    /// (see [`CpuScores`]).
    raw_s: Vec<f64>,
    /// One query row's `dO·v` against the key tile, `BLOCK_N`.
    raw_dp: Vec<f32>,
    /// With dropout, `Z` of the current (query tile, key tile), `rows × BLOCK_N`: 1 kept, 0
    /// dropped.
    keep: Vec<u8>,
    /// A group of [`GROUP`] query rows' terms against the key tile, `GROUP × BLOCK_N` each:
    /// what goes into dV (`P`, times `Z/(1 − p)` with dropout), what goes into dK and dQ
    /// (`dS` times the score modifier's derivative), and whether the pair adds at all (the
    /// row saw keys in the forward pass and the mask shows it the key).
    group_p: Vec<f32>,
    group_ds: Vec<f32>,
    group_adds: Vec<bool>,
}

impl KeyTile {
    /// Buffers for a job of `shape`; an error (not an abort) when they cannot be allocated.
    fn new(shape: &AttnShape) -> Result<Self> {
        let (d, nq, group) = (shape.head_dim, shape.seqlen_q, shape.group_size());
        let keys_d = alloc::numel::<f64>(&[BLOCK_N, d], "CPU key tile")?;
        let rows_d = alloc::numel::<f64>(&[BLOCK_M, d], "CPU query tile")?;
        let rows = alloc::numel::<f32>(&[group, nq], "CPU row state")?;
        let dq = alloc::numel::<f64>(&[group, nq, d], "CPU dQ accumulator")?;
        Ok(KeyTile {
            d,
            seqlen_q: nq,
            keys: 0,
            key0: 0,
            k: alloc::with_capacity(keys_d, "CPU key tile")?,
            v: alloc::with_capacity(keys_d, "CPU value tile")?,
            dk: alloc::filled(keys_d, 0.0, "CPU dK tile")?,
            dv: alloc::filled(keys_d, 0.0, "CPU dV tile")?,
            q: alloc::with_capacity(rows_d, "CPU query tile")?,
            d_o: alloc::with_capacity(rows_d, "CPU dO tile")?,
            delta: alloc::filled(rows, 0.0, "CPU row state")?,
            lse_log2: alloc::filled(rows, 0.0, "CPU row state")?,
            dq: alloc::filled(dq, 0.0, "CPU dQ accumulator")?,
            raw_s: alloc::filled(BLOCK_N, 0.0, "CPU score tile")?,
            raw_dp: alloc::filled(BLOCK_N, 0.0, "CPU score tile")?,
            keep: alloc::filled(BLOCK_M * BLOCK_N, 0, "CPU dropout tile")?,
            group_p: alloc::filled(GROUP * BLOCK_N, 0.0, "CPU score tile")?,
            group_ds: alloc::filled(GROUP * BLOCK_N, 0.0, "CPU score tile")?,
            group_adds: alloc::filled(GROUP * BLOCK_N, false, "CPU score tile")?,
        })
    }

    /// FA2's pre-pass for the job's query heads: `D = rowsum(dO ∘ O)` and `LSE·log2 e` per
    /// row; clears the dQ accumulator. `D` is the [`dot`] that gives `dP = dO·v`, in the same
    /// order, so that where O equals a row of V (a row that sees one key, without dropout)
    /// `dP − D` is exactly 0, as the true `dS` is, rather than the difference of two
    /// roundings.
    fn pre_pass<T: Element>(&mut self, heads: &[QueryHead<T>]) {
        let (nq, d) = (self.seqlen_q, self.d);
        for (h, head) in heads.iter().enumerate() {
            for rows in (0..nq).step_by(BLOCK_M).map(|r| r..(r + BLOCK_M).min(nq)) {
                load_rows(head.o, rows.clone(), &mut self.q);
                load_rows(head.d_o, rows.clone(), &mut self.d_o);
                let pairs = self.d_o.chunks_exact(d).zip(self.q.chunks_exact(d));
                for (i, (d_o, o)) in rows.zip(pairs) {
                    self.delta[h * nq + i] = dot(d_o, o);
                    self.lse_log2[h * nq + i] = f64::from(head.lse[i]) * std::f64::consts::LOG2_E;
                }
            }
        }
        self.dq.fill(0.0);
    }

    /// Starts the key tile `keys` of `k` and `v` (`[Nk, d]`): loads it and clears its
    /// gradient accumulators.
    fn start<T: Element>(&mut self, k: ArrayView2<T>, v: ArrayView2<T>, keys: Range<usize>) {
        self.key0 = keys.start;
        self.keys = keys.len();
        load_rows(k, keys.clone(), &mut self.k);
        load_rows(v, keys, &mut self.v);
        let n = self.keys * self.d;
        self.dk[..n].fill(0.0);
        self.dv[..n].fill(0.0);
    }

    /// Folds the query rows `rows` of head `h` (the job's `h`-th query head) into the key
    /// tile's dK and dV and into the rows' dQ, scores turned into logits by `scores` (dS
    /// times the derivative of the mask's score modifier). With `needs_mask`, the keys the
    /// mask hides from a row are skipped for that row (before the exponential: a hidden score
    /// is never computed). With the head's dropout, `P ∘ Z/(1 − p)` goes into dV and
    /// `dP ∘ Z/(1 − p)` into dS (products: a NaN stays NaN).
    ///
    /// The exponent `scale_log2·s − LSE·log2 e` is formed in f64, as the forward forms
    /// `logit − max`: both terms are about as large as the largest score (±100 in base 2 is
    /// common), where an f32 rounding is worth 4e-6; the difference is small and its `exp2`
    /// runs in f32.
    fn visit_queries<T: Element, M: AttnMask>(
        &mut self,
        head: &QueryHead<T>,
        h: usize,
        rows: Range<usize>,
        scores: &CpuScores<M>,
        needs_mask: bool,
    ) {
        #[cfg(target_arch = "x86_64")]
        if with_avx2() {
            // SAFETY: the CPU has AVX2.
            return unsafe { self.visit_queries_avx2(head, h, rows, scores, needs_mask) };
        }
        // SAFETY: without AVX2 code.
        unsafe { self.visit_queries_any::<T, M, false>(head, h, rows, scores, needs_mask) }
    }

    /// [`Self::visit_queries`] compiled for AVX2 (see [`with_avx2`]).
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn visit_queries_avx2<T: Element, M: AttnMask>(
        &mut self,
        head: &QueryHead<T>,
        h: usize,
        rows: Range<usize>,
        scores: &CpuScores<M>,
        needs_mask: bool,
    ) {
        // SAFETY: the caller's CPU has AVX2.
        unsafe { self.visit_queries_any::<T, M, true>(head, h, rows, scores, needs_mask) }
    }

    /// [`Self::visit_queries`] for any CPU (`AVX`: see [`dots`]).
    ///
    /// # Safety
    /// With `AVX`, the CPU has AVX2.
    #[inline(always)]
    unsafe fn visit_queries_any<T: Element, M: AttnMask, const AVX: bool>(
        &mut self,
        head: &QueryHead<T>,
        h: usize,
        rows: Range<usize>,
        scores: &CpuScores<M>,
        needs_mask: bool,
    ) {
        let (d, n, key0) = (self.d, self.keys, self.key0);
        load_rows(head.q, rows.clone(), &mut self.q);
        load_rows(head.d_o, rows.clone(), &mut self.d_o);
        if let Some(dropout) = &head.dropout {
            dropout.fill(rows.clone(), key0..key0 + n, &mut self.keep, BLOCK_N);
        }
        // Rows in groups of `GROUP`: each group's terms first, then every accumulator takes
        // them in the order the row-by-row, key-by-key loop would add them (dK and dV by
        // row, dQ by key), up to four terms per pass over it (see `Terms`).
        let first = rows.start;
        for g0 in rows.clone().step_by(GROUP) {
            let group = g0..(g0 + GROUP).min(rows.end);
            for (g, row) in group.clone().enumerate() {
                let r = row - first;
                let at = h * self.seqlen_q + row;
                let (lse_log2, delta) = (self.lse_log2[at], self.delta[at]);
                let terms = g * BLOCK_N..g * BLOCK_N + n;
                let adds = &mut self.group_adds[terms.clone()];
                // LSE = −∞: the row saw no key in the forward pass; P = 0, it adds nothing.
                if lse_log2 == f64::NEG_INFINITY {
                    adds.fill(false);
                    continue;
                }
                let (q_row, do_row) = (&self.q[r * d..(r + 1) * d], &self.d_o[r * d..(r + 1) * d]);
                let (raw_s, raw_dp) = (&mut self.raw_s[..n], &mut self.raw_dp[..n]);
                // SAFETY: with `AVX`, the CPU has AVX2 (this function's contract).
                unsafe {
                    dots::<AVX, f64>(q_row, &self.k, raw_s);
                    dots::<AVX, f32>(do_row, &self.v, raw_dp);
                }
                let keep = &self.keep[r * BLOCK_N..r * BLOCK_N + n];
                let (ps, dss) = (&mut self.group_p[terms.clone()], &mut self.group_ds[terms]);
                for c in 0..n {
                    adds[c] = !needs_mask || scores.mask.visible(idx(row), idx(key0 + c));
                    if !adds[c] {
                        continue;
                    }
                    let (logit2, grad) = scores.logit2_and_grad(row, key0 + c, raw_s[c]);
                    let p = ((logit2 - lse_log2) as f32).exp2();
                    // Dropout: Z/(1 − p) on the probability that reached O and on its gradient.
                    let (p_out, dp) = match &head.dropout {
                        None => (p, raw_dp[c]),
                        Some(dropout) => {
                            let z = f32::from(keep[c]) * dropout.scale;
                            (p * z, raw_dp[c] * z)
                        }
                    };
                    ps[c] = p_out;
                    dss[c] = p * (dp - delta) * grad;
                }
            }
            // dK and dV of each key: the group's rows in order.
            let parts = self.dk.chunks_exact_mut(d).zip(self.dv.chunks_exact_mut(d));
            for (c, (dk_row, dv_row)) in parts.take(n).enumerate() {
                let (mut to_dk, mut to_dv) = (Terms::of(dk_row), Terms::of(dv_row));
                for (g, row) in group.clone().enumerate() {
                    let t = g * BLOCK_N + c;
                    if self.group_adds[t] {
                        let r = row - first;
                        to_dv.add(self.group_p[t], &self.d_o[r * d..(r + 1) * d]);
                        to_dk.add(self.group_ds[t], &self.q[r * d..(r + 1) * d]);
                    }
                }
                to_dv.finish();
                to_dk.finish();
            }
            // dQ of each row: the keys in order.
            for (g, row) in group.clone().enumerate() {
                let at = h * self.seqlen_q + row;
                let mut to_dq = Terms::of(&mut self.dq[at * d..(at + 1) * d]);
                for (c, k_row) in self.k.chunks_exact(d).take(n).enumerate() {
                    let t = g * BLOCK_N + c;
                    if self.group_adds[t] {
                        to_dq.add(self.group_ds[t], k_row);
                    }
                }
                to_dq.finish();
            }
        }
    }

    /// Writes the key tile's gradients to `dk` and `dv` (its `[keys, d]` rows): dK times
    /// `scale`, dV as accumulated.
    fn finish_keys<T: Element>(&self, dk: ArrayViewMut2<T>, dv: ArrayViewMut2<T>, scale: f32) {
        store_rows(dk, &self.dk, self.d, scale);
        store_rows(dv, &self.dv, self.d, 1.0);
    }

    /// Writes dQ of head `h` (times `scale`) to `dq` (`[Nq, d]`).
    fn finish_queries<T: Element>(&self, h: usize, dq: ArrayViewMut2<T>, scale: f32) {
        let n = self.seqlen_q * self.d;
        store_rows(dq, &self.dq[h * n..(h + 1) * n], self.d, scale);
    }
}

/// Query rows whose terms [`KeyTile::visit_queries`] computes before adding them.
const GROUP: usize = 4;

/// The terms `a·x` of one accumulator row `y`, added in the order they come: every fourth
/// term adds the four pending ones in one pass over `y` (each element
/// `((y + a₀x₀) + a₁x₁) + …`, bit for bit the sums of one term at a time), and
/// [`Terms::finish`] adds what is left one by one. One pass instead of four saves three loads
/// and stores of `y` per element.
struct Terms<'y, 'x> {
    y: &'y mut [f64],
    a: [f64; 4],
    x: [&'x [f64]; 4],
    len: usize,
}

impl<'y, 'x> Terms<'y, 'x> {
    /// No term yet of `y`.
    #[inline(always)]
    fn of(y: &'y mut [f64]) -> Self {
        Terms {
            y,
            a: [0.0; 4],
            x: [&[]; 4],
            len: 0,
        }
    }

    /// Takes the term `a·x` (f32 values held in f64: the product is exact).
    #[inline(always)]
    fn add(&mut self, a: f32, x: &'x [f64]) {
        self.a[self.len] = f64::from(a);
        self.x[self.len] = x;
        self.len += 1;
        if self.len == 4 {
            let [a0, a1, a2, a3] = self.a;
            let n = self.y.len();
            let [x0, x1, x2, x3] = self.x.map(|x| &x[..n]);
            for (j, y) in self.y.iter_mut().enumerate() {
                *y = *y + a0 * x0[j] + a1 * x1[j] + a2 * x2[j] + a3 * x3[j];
            }
            self.len = 0;
        }
    }

    /// Adds the pending terms, in order.
    #[inline(always)]
    fn finish(self) {
        for (&a, x) in self.a.iter().zip(self.x).take(self.len) {
            self.y.iter_mut().zip(x).for_each(|(y, &x)| *y += a * x);
        }
    }
}

/// Writes `factor·src` (contiguous rows of `d`) to the rows of `dst`, rounded to `T`.
fn store_rows<T: Element>(mut dst: ArrayViewMut2<T>, src: &[f64], d: usize, factor: f32) {
    let factor = f64::from(factor);
    for (mut row, src) in dst.outer_iter_mut().zip(src.chunks_exact(d)) {
        row.iter_mut()
            .zip(src)
            .for_each(|(x, &y)| *x = T::from_f32((factor * y) as f32));
    }
}

#[cfg(test)]
mod tests {
    use super::Terms;
    use crate::cpu::online_softmax::tests::values;

    /// `Terms` adds each term in the order given, bit for bit as one `y += a·x` at a time,
    /// with whole groups of four and a remainder, on values whose sums round differently in
    /// any other order (each of the five other groupings of a group's sum, and swapping two
    /// terms, made this test fail).
    #[test]
    fn terms_add_in_order_bit_for_bit() {
        let d = 256;
        for count in [0usize, 1, 3, 4, 5, 8, 11] {
            // The values are exact in f32.
            let coefs: Vec<f32> = values(count, 7 + count as u32)
                .into_iter()
                .map(|a| a as f32)
                .collect();
            let xs: Vec<Vec<f64>> = (0..count).map(|t| values(d, 100 + t as u32)).collect();
            let mut want = values(d, 99);
            let mut got = want.clone();
            for (&a, x) in coefs.iter().zip(&xs) {
                want.iter_mut()
                    .zip(x)
                    .for_each(|(y, &x)| *y += f64::from(a) * x);
            }
            let mut terms = Terms::of(&mut got);
            for (&a, x) in coefs.iter().zip(&xs) {
                terms.add(a, x);
            }
            terms.finish();
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{count} terms");
        }
    }
}
