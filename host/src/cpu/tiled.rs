//! The CPU backend: FlashAttention-2's tiled forward pass.
//!
//! For every (batch, query head), query tiles of [`BLOCK_M`] rows are visited in order; for
//! each, the key tiles of [`BLOCK_N`] keys that the mask's [`AttnMask::key_tiles`] names are
//! folded in with the online softmax (f32 accumulation, exponents in base 2 with
//! `scale_log2 = scale·log2 e`, or the mask's modified scores times `log2 e`, a softcap's
//! `tanh` taken in f64: [`CpuScores`]), masking element by element only in tiles where
//! [`AttnMask::tile_needs_mask`] says so. The mask is the kernels' own type for the options
//! ([`crate::AttnParams::mask_kind`]). The `Nq × Nk` score matrix is never materialised: one
//! `BLOCK_M × BLOCK_N` tile at a time. The (batch, head) pairs are spread over threads. With attention dropout ([`AttnParams::dropout`]), each
//! (batch, head) draws its mask from the kernels' generator ([`crate::cpu::dropout`]), one
//! tile at a time, as [`QueryTile`] applies it.

use flash_attn_kernels::mask::AttnMask;
use ndarray::{
    s, Array3, Array4, ArrayView2, ArrayView4, ArrayViewMut1, ArrayViewMut2, ArrayViewMut3,
    ArrayViewMut4, Axis, Dim,
};

use crate::cpu::alloc;
use crate::cpu::dropout::{CallDropout, HeadDropout};
use crate::cpu::online_softmax::QueryTile;
use crate::cpu::sequences::{forward_spans, key_padding, rows};
use crate::cpu::validate::{check_inputs, check_outputs};
use crate::dtype::Element;
use crate::error::Result;
use crate::mask::{cpu_mask, with_cpu_mask, CpuScores};
use crate::params::AttnParams;

/// Query rows per tile.
pub const BLOCK_M: usize = 64;

/// Keys per tile.
pub const BLOCK_N: usize = 64;

/// Attention on the CPU: Q `[B, Nq, Hq, d]`, K and V `[B, Nk, Hkv, d]` (any strides, `Hkv`
/// dividing `Hq`), any head dim ≥ 1. Returns O `[B, Nq, Hq, d]` and the natural-log LSE
/// `[B, Hq, Nq]`; a row that sees no key gets O = 0 and LSE = −∞, and NaN or ±∞ inputs give
/// NaN as [`AttnParams`] describes. With dropout ([`AttnParams::dropout`]), O is
/// `(P ∘ Z)·V/(1 − p)` and the LSE that of `P`, the softmax before dropout. Invalid shapes, a
/// non-finite scale or an invalid dropout probability are reported as errors, see
/// [`crate::shape::check_shapes`] and [`AttnParams::active_dropout`], and so are outputs or
/// temporaries that cannot be allocated ([`crate::FlashError::TooLarge`],
/// [`crate::FlashError::Alloc`]): never a panic.
pub fn attention_cpu<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    params: &AttnParams,
) -> Result<(Array4<T>, Array3<f32>)> {
    let shape = check_inputs(&q, &k, &v)?;
    params.scale_log2(shape.head_dim)?;
    params.check_masks(shape.batch, shape.heads_q)?;
    params.active_dropout()?;
    let mut o = alloc::array(Dim(shape.q_dims()), T::default(), "output O")?;
    let mut lse = alloc::array(Dim(shape.lse_dims()), 0.0, "output LSE")?;
    attention_cpu_into(q, k, v, params, o.view_mut(), lse.view_mut())?;
    Ok((o, lse))
}

/// [`attention_cpu`] writing into caller-provided outputs O `[B, Nq, Hq, d]` and LSE
/// `[B, Hq, Nq]` (any strides); their shapes are checked ([`crate::FlashError::Shape`]).
pub fn attention_cpu_into<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    params: &AttnParams,
    o: ArrayViewMut4<T>,
    lse: ArrayViewMut3<f32>,
) -> Result<()> {
    let shape = check_inputs(&q, &k, &v)?;
    check_outputs(&shape, &o, &lse)?;
    let scale_log2 = params.scale_log2(shape.head_dim)?;
    params.check_masks(shape.batch, shape.heads_q)?;
    let dropout = CallDropout::new(params, shape.heads_q)?;
    if let Some(spans) = key_padding(&q, &k, params)? {
        let fill = (T::default(), f32::NEG_INFINITY);
        let (o_all, lse_all) = forward_spans(shape.q_dims(), &spans, params, fill, |sp, p| {
            attention_cpu(
                rows(&q, sp, true),
                rows(&k, sp, false),
                rows(&v, sp, false),
                p,
            )
        })?;
        let (mut o, mut lse) = (o, lse);
        o.assign(&o_all);
        lse.assign(&lse_all);
        return Ok(());
    }
    let heads = alloc::numel::<HeadJob<T>>(&[shape.batch, shape.heads_q], "CPU head jobs")?;
    let mut jobs = alloc::with_capacity(heads, "CPU head jobs")?;
    for (b, (o_b, lse_b)) in o
        .into_outer_iter_mut()
        .zip(lse.into_outer_iter_mut())
        .enumerate()
    {
        let heads = o_b
            .into_axis_iter_mut(Axis(1))
            .zip(lse_b.into_outer_iter_mut());
        for (h, (o, lse)) in heads.enumerate() {
            let kv = shape.kv_head(h);
            jobs.push(HeadJob {
                q: q.slice(s![b, .., h, ..]),
                k: k.slice(s![b, .., kv, ..]),
                v: v.slice(s![b, .., kv, ..]),
                o,
                lse,
                slope: params.slope(b, h, shape.heads_q),
                at: (b, h),
                dropout: dropout.map(|d| d.head(b, h)),
            });
        }
    }
    let new_tile = || QueryTile::new(BLOCK_M, BLOCK_N, shape.head_dim);
    with_cpu_mask!(params, M => {
        // Each (batch, head) its own mask (a block mask may differ between them).
        let jobs = jobs
            .into_iter()
            .map(|job| Ok((cpu_mask::<M>(params, &shape, job.at)?, job)))
            .collect::<Result<Vec<_>>>()?;
        run_parallel(jobs, new_tile, |(mask, job), tile| {
            let scores = CpuScores {
                mask: &mask,
                slope: job.slope,
                scale_log2,
                softcap: params.softcap,
            };
            job.run(tile, &scores)
        })
    })
}

/// One (batch, query head): its Q rows, the K and V rows of its key/value head (`[N, d]`
/// each) and its outputs.
struct HeadJob<'a, T> {
    /// Query rows `[Nq, d]`.
    q: ArrayView2<'a, T>,
    /// Keys `[Nk, d]`.
    k: ArrayView2<'a, T>,
    /// Values `[Nk, d]`.
    v: ArrayView2<'a, T>,
    /// Output rows `[Nq, d]`.
    o: ArrayViewMut2<'a, T>,
    /// Log-sum-exp per query row `[Nq]`.
    lse: ArrayViewMut1<'a, f32>,
    /// `(batch entry, query head)`.
    at: (usize, usize),
    /// The head's ALiBi slope (0 without ALiBi).
    slope: f32,
    /// The head's dropout, if any.
    dropout: Option<HeadDropout>,
}

impl<T: Element> HeadJob<'_, T> {
    /// The tiled forward pass of one head: query tiles outside, key tiles inside.
    fn run<M: AttnMask>(mut self, tile: &mut QueryTile, scores: &CpuScores<M>) {
        let (seqlen_q, seqlen_k) = (self.q.nrows(), self.k.nrows());
        let (bm, bn) = (BLOCK_M as u32, BLOCK_N as u32);
        let mask = scores.mask;
        for row0 in (0..seqlen_q).step_by(BLOCK_M) {
            let rows = row0..(row0 + BLOCK_M).min(seqlen_q);
            tile.start(self.q, rows, self.dropout);
            // Last tile first, as the GPU visits them.
            for n_block in mask.key_tiles(row0 as u32, bm, bn) {
                let key0 = n_block as usize * BLOCK_N;
                let keys = key0..(key0 + BLOCK_N).min(seqlen_k);
                let needs_mask = mask.tile_needs_mask(row0 as u32, bm, n_block, bn);
                tile.visit_keys(self.k, self.v, keys, scores, needs_mask);
            }
            tile.finish(self.o.view_mut(), self.lse.view_mut());
        }
    }
}

/// Runs `work` on every job, spread round-robin over the available cores; each thread owns
/// one working state from `new_state` (a [`QueryTile`] for the forward pass), allocated
/// (fallibly) before any work starts. Which thread runs a job never changes its result.
pub(crate) fn run_parallel<J: Send, S: Send>(
    jobs: Vec<J>,
    new_state: impl Fn() -> Result<S>,
    work: impl Fn(J, &mut S) + Sync,
) -> Result<()> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len());
    if threads <= 1 {
        let mut state = new_state()?;
        jobs.into_iter().for_each(|job| work(job, &mut state));
        return Ok(());
    }
    let mut buckets = Vec::with_capacity(threads);
    for _ in 0..threads {
        let bucket: Vec<J> = alloc::with_capacity(jobs.len().div_ceil(threads), "CPU jobs")?;
        buckets.push((bucket, new_state()?));
    }
    for (i, job) in jobs.into_iter().enumerate() {
        buckets[i % threads].0.push(job);
    }
    std::thread::scope(|scope| {
        for (bucket, mut state) in buckets {
            let work = &work;
            scope.spawn(move || {
                bucket.into_iter().for_each(|job| work(job, &mut state));
            });
        }
    });
    Ok(())
}
