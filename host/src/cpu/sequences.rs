//! Calls whose sequences differ in length, on the CPU: packed variable-length batches
//! ([`attention_varlen_cpu`], [`attention_varlen_backward_cpu`]) and key padding of a padded batch
//! ([`AttnParams::seqlens_k`]). Both run any padded-batch routine (the tiled backend, the
//! references) once per sequence ([`SeqSpan`]) on views of its rows, with the sequence's own
//! options ([`AttnParams::for_entry`]), and stitch the outputs: the masks then align to each
//! sequence's own lengths by construction. With dropout, each sequence's call draws the mask
//! of its index in the whole call: [`seq_params`] advances [`crate::Dropout::first_sequence`]
//! by the sequence's index.

use std::borrow::Cow;

use ndarray::{s, Array2, Array3, Array4, ArrayView2, ArrayView3, ArrayView4, Axis, Dim};

use crate::cpu::alloc;
use crate::dtype::Element;
use crate::error::{FlashError, Result};
use crate::params::AttnParams;
use crate::seqs::{SeqSpan, VarlenLens};
use crate::shape::check_shapes;

/// The rows of `span` in a `[E, N, H, d]` tensor: its queries (`query`) or its keys.
pub fn rows<'a, X>(t: &ArrayView4<'a, X>, span: &SeqSpan, query: bool) -> ArrayView4<'a, X> {
    let (b, r) = (
        span.entry,
        if query {
            span.q.clone()
        } else {
            span.k.clone()
        },
    );
    (*t).slice_move(s![b..b + 1, r, .., ..])
}

/// The query rows of `span` in a `[E, H, N]` per-row statistic (LSE).
pub fn stat_rows<'a, X>(t: &ArrayView3<'a, X>, span: &SeqSpan) -> ArrayView3<'a, X> {
    let b = span.entry;
    (*t).slice_move(s![b..b + 1, .., span.q.clone()])
}

/// A sequence's options: its entry's ALiBi slopes; no key lengths (its keys are cut already);
/// dropout, if any, with [`crate::Dropout::first_sequence`] advanced by the sequence's index
/// (`span.seq`), so that the sequence, run alone as sequence 0 of its own call, draws the mask
/// that the whole call's generator gives it.
pub fn seq_params<'p>(params: &AttnParams<'p>, span: &SeqSpan, heads_q: usize) -> AttnParams<'p> {
    let dropout = params.dropout.map(|d| crate::params::Dropout {
        first_sequence: d.first_sequence.wrapping_add(span.seq as u32),
        ..d
    });
    AttnParams {
        seqlens_k: None,
        dropout,
        ..params.for_entry(span.seq, heads_q)
    }
}

/// Runs `f(span, its options)` for every sequence of `spans` with queries and keys (the
/// padded-batch routine on the sequence's rows, see [`rows`]) and stitches O (`q_dims`
/// `[E, N, Hq, d]`) and LSE `[E, Hq, N]`; rows of sequences without keys, and rows no span
/// covers, are `fill` (O = 0, LSE = −∞).
pub fn forward_spans<A: Clone, L: Clone>(
    q_dims: [usize; 4],
    spans: &[SeqSpan],
    params: &AttnParams,
    fill: (A, L),
    f: impl Fn(&SeqSpan, &AttnParams) -> Result<(Array4<A>, Array3<L>)>,
) -> Result<(Array4<A>, Array3<L>)> {
    let [e, n, hq, _] = q_dims;
    let mut o = alloc::array(Dim(q_dims), fill.0, "output O")?;
    let mut lse = alloc::array(Dim([e, hq, n]), fill.1, "output LSE")?;
    for span in spans.iter().filter(|s| !s.q.is_empty() && !s.k.is_empty()) {
        let (o_s, lse_s) = f(span, &seq_params(params, span, hq))?;
        let (b, r) = (span.entry, span.q.clone());
        o.slice_mut(s![b..b + 1, r.clone(), .., ..]).assign(&o_s);
        lse.slice_mut(s![b..b + 1, .., r]).assign(&lse_s);
    }
    Ok((o, lse))
}

/// The backward of [`forward_spans`]: stitches dQ (`q_dims`), dK and dV (`k_dims`); `zero`
/// where no sequence with both queries and keys reaches (keys past a sequence's length,
/// sequences without queries or without keys).
pub fn backward_spans<A: Clone>(
    (q_dims, k_dims): ([usize; 4], [usize; 4]),
    spans: &[SeqSpan],
    params: &AttnParams,
    zero: A,
    f: impl Fn(&SeqSpan, &AttnParams) -> Result<(Array4<A>, Array4<A>, Array4<A>)>,
) -> Result<(Array4<A>, Array4<A>, Array4<A>)> {
    let hq = q_dims[2];
    let mut dq = alloc::array(Dim(q_dims), zero.clone(), "gradient dQ")?;
    let mut dk = alloc::array(Dim(k_dims), zero.clone(), "gradient dK")?;
    let mut dv = alloc::array(Dim(k_dims), zero, "gradient dV")?;
    for span in spans.iter().filter(|s| !s.q.is_empty() && !s.k.is_empty()) {
        let (dq_s, dk_s, dv_s) = f(span, &seq_params(params, span, hq))?;
        let b = span.entry;
        dq.slice_mut(s![b..b + 1, span.q.clone(), .., ..])
            .assign(&dq_s);
        dk.slice_mut(s![b..b + 1, span.k.clone(), .., ..])
            .assign(&dk_s);
        dv.slice_mut(s![b..b + 1, span.k.clone(), .., ..])
            .assign(&dv_s);
    }
    Ok((dq, dk, dv))
}

/// The sequences of a packed varlen batch on the CPU (FlashAttention's varlen layout, see
/// [`crate::Varlen`]): Q `[total_q, Hq, d]`, K and V `[total_k, Hkv, d]`, host prefix sums
/// `[B + 1]`, checked with the options ([`varlen_spans`]'s errors). Run any padded-batch
/// routine per sequence with [`forward_spans`] / [`backward_spans`] on the tensors viewed as
/// `[1, total, H, d]` ([`packed`]), as [`attention_varlen_cpu`] does.
pub fn varlen_spans<A>(
    [q, k, v]: [&ArrayView3<A>; 3],
    (cu_seqlens_q, cu_seqlens_k): (&[i32], &[i32]),
    params: &AttnParams,
) -> Result<Vec<SeqSpan>> {
    let one = |t: &ArrayView3<A>| [1, t.dim().0, t.dim().1, t.dim().2];
    let shape = check_shapes(&one(q), &one(k), &one(v))?;
    params.check_varlen_options()?;
    params.active_dropout()?;
    let lens = VarlenLens::check(
        Cow::Borrowed(cu_seqlens_q),
        Cow::Borrowed(cu_seqlens_k),
        shape.seqlen_q,
        shape.seqlen_k,
    )?;
    params.check_masks(lens.batch(), shape.heads_q)?;
    Ok(lens.spans())
}

/// A packed `[total, H, d]` tensor as the one batch entry `[1, total, H, d]`.
pub fn packed<'a, X>(t: &ArrayView3<'a, X>) -> ArrayView4<'a, X> {
    (*t).insert_axis(Axis(0))
}

/// Varlen attention with the CPU backend ([`super::attention_cpu`] per sequence): returns O
/// `[total_q, Hq, d]` and LSE `[Hq, total_q]`; rows of a sequence without keys get O = 0 and
/// LSE = −∞. With dropout, sequence `b` of the batch draws the generator's sequence
/// `first_sequence + b` (see [`seq_params`]).
pub fn attention_varlen_cpu<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    cu_seqlens: (&[i32], &[i32]),
    params: &AttnParams,
) -> Result<(Array3<T>, Array2<f32>)> {
    let spans = varlen_spans([&q, &k, &v], cu_seqlens, params)?;
    let (q4, k4, v4) = (packed(&q), packed(&k), packed(&v));
    let (o, lse) = forward_spans(
        q4.dim().into(),
        &spans,
        params,
        (T::default(), f32::NEG_INFINITY),
        |span, p| {
            let (q, k, v) = (
                rows(&q4, span, true),
                rows(&k4, span, false),
                rows(&v4, span, false),
            );
            super::attention_cpu(q, k, v, p)
        },
    )?;
    Ok((
        o.index_axis_move(Axis(0), 0),
        lse.index_axis_move(Axis(0), 0),
    ))
}

/// The gradients of [`attention_varlen_cpu`] ([`super::attention_backward_cpu`] per
/// sequence): O and dO like Q, LSE `[Hq, total_q]`; returns dQ `[total_q, Hq, d]`, dK and dV
/// `[total_k, Hkv, d]` (0 for sequences without queries or without keys).
#[allow(clippy::too_many_arguments)]
pub fn attention_varlen_backward_cpu<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    o: ArrayView3<T>,
    d_o: ArrayView3<T>,
    lse: ArrayView2<f32>,
    cu_seqlens: (&[i32], &[i32]),
    params: &AttnParams,
) -> Result<(Array3<T>, Array3<T>, Array3<T>)> {
    let spans = varlen_spans([&q, &k, &v], cu_seqlens, params)?;
    for (name, t) in [("O", &o), ("dO", &d_o)] {
        if t.dim() != q.dim() {
            return Err(FlashError::Shape(format!(
                "{name} is {:?}, expected {:?} (the shape of Q)",
                t.shape(),
                q.shape()
            )));
        }
    }
    if lse.dim() != (q.dim().1, q.dim().0) {
        return Err(FlashError::Shape(format!(
            "LSE is {:?}, expected [{}, {}] ([heads_q, total_q])",
            lse.shape(),
            q.dim().1,
            q.dim().0
        )));
    }
    let (q4, k4, v4, o4, do4) = (packed(&q), packed(&k), packed(&v), packed(&o), packed(&d_o));
    let lse3 = lse.insert_axis(Axis(0));
    let (dq, dk, dv) = backward_spans(
        (q4.dim().into(), k4.dim().into()),
        &spans,
        params,
        T::default(),
        |span, p| {
            super::attention_backward_cpu(
                rows(&q4, span, true),
                rows(&k4, span, false),
                rows(&v4, span, false),
                rows(&o4, span, true),
                rows(&do4, span, true),
                stat_rows(&lse3, span),
                p,
            )
        },
    )?;
    let drop = |t: Array4<T>| t.index_axis_move(Axis(0), 0);
    Ok((drop(dq), drop(dk), drop(dv)))
}

/// The sequences of a padded batch with key padding in `params` ([`AttnParams::seqlens_k`]),
/// or `None` without.
pub(crate) fn key_padding<A, B>(
    q: &ArrayView4<A>,
    k: &ArrayView4<B>,
    params: &AttnParams,
) -> Result<Option<Vec<SeqSpan>>> {
    params.key_padding_spans(q.dim().0, q.dim().1, k.dim().1)
}
