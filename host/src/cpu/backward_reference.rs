//! Naive attention backward with materialised matrices: the float64 oracle of the gradient
//! tests, and the same algorithm in an element type `T`, whose error is the yardstick of the
//! accuracy rule for gradients.
//!
//! Per (batch, query head), with `P` the forward's probabilities (recomputed here from Q and K,
//! masked and modified by the restated rules of [`RefMask`]):
//! `D = rowsum(dO ∘ O)`, `dV += Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)` (zero where masked),
//! `dQ = scale·dS·K`, `dK += scale·dSᵀ·Q`; dK and dV of a key/value head sum over the query
//! heads that share it (GQA/MQA).
//!
//! With dropout ([`AttnParams::dropout`]; `Z` the forward's mask, applied by [`RefDropout`]),
//! the forward's `O = (P ∘ Z)·V/(1 − p)`, `dV += (P ∘ Z)ᵀ·dO/(1 − p)` and
//! `dS = P ∘ (dP ∘ Z/(1 − p) − D)`; the rest is unchanged.

use ndarray::linalg::general_mat_mul;
use ndarray::{s, Array4, ArrayView3, ArrayView4, Dim, Zip};

use crate::cpu::alloc;
use crate::cpu::reference::{
    round_to, softmax_in_place, Precision, Real, RefDropout, RefMask, EXACT,
};
use crate::cpu::sequences::{backward_spans, key_padding, rows, stat_rows};
use crate::cpu::validate::check_inputs;
use crate::dtype::Element;
use crate::error::Result;
use crate::params::AttnParams;

/// Gradients dQ `[B, Nq, Hq, d]`, dK and dV `[B, Nk, Hkv, d]`.
pub type Gradients<T> = (Array4<T>, Array4<T>, Array4<T>);

/// Naive float64 attention backward: recomputes the forward (scores, probabilities, O) per
/// (batch, head) and returns dQ, dK, dV of the loss whose gradient with respect to O is `d_o`
/// (`[B, Nq, Hq, d]`, like Q). A query row that sees no key gets a zero dQ row and adds
/// nothing to dK and dV. The oracle of the tests.
pub fn attention_backward_reference(
    q: ArrayView4<f64>,
    k: ArrayView4<f64>,
    v: ArrayView4<f64>,
    d_o: ArrayView4<f64>,
    params: &AttnParams,
) -> Result<Gradients<f64>> {
    check_inputs(&q, &k, &v)?;
    params.active_dropout()?;
    if let Some(spans) = key_padding(&q, &k, params)? {
        let dims = (q.dim().into(), k.dim().into());
        return backward_spans(dims, &spans, params, 0.0, |sp, p| {
            let (q_, k_, v_) = (rows(&q, sp, true), rows(&k, sp, false), rows(&v, sp, false));
            attention_backward_reference(q_, k_, v_, rows(&d_o, sp, true), p)
        });
    }
    naive_backward(q, k, v, d_o, None, params, |s| s as f64, &EXACT)
}

/// [`attention_backward_reference`] from given forward outputs, as the tiled backward takes
/// them: P = `exp(scale·S − LSE)` from the given natural-log LSE `[B, Hq, Nq]` (zero where
/// masked, and for a row whose LSE is −∞; dropout applied to it as the forward did) and
/// `D = rowsum(dO ∘ O)` from the given O (Q's shape). Fed with the exact forward outputs it
/// equals [`attention_backward_reference`]; fed with outputs rounded to an element type it
/// measures what that rounding alone costs an exact backward, which the accuracy rule of the
/// backward allows on top of twice the naive error.
pub fn attention_backward_reference_given(
    q: ArrayView4<f64>,
    k: ArrayView4<f64>,
    v: ArrayView4<f64>,
    o: ArrayView4<f64>,
    d_o: ArrayView4<f64>,
    lse: ArrayView3<f64>,
    params: &AttnParams,
) -> Result<Gradients<f64>> {
    check_inputs(&q, &k, &v)?;
    params.active_dropout()?;
    if let Some(spans) = key_padding(&q, &k, params)? {
        let dims = (q.dim().into(), k.dim().into());
        return backward_spans(dims, &spans, params, 0.0, |sp, p| {
            let (q_, k_, v_) = (rows(&q, sp, true), rows(&k, sp, false), rows(&v, sp, false));
            let (o_, do_) = (rows(&o, sp, true), rows(&d_o, sp, true));
            attention_backward_reference_given(q_, k_, v_, o_, do_, stat_rows(&lse, sp), p)
        });
    }
    naive_backward(q, k, v, d_o, Some((o, lse)), params, |s| s as f64, &EXACT)
}

/// Naive attention backward in the element type `T`, as a framework's unfused backward in
/// `T` computes it: every matrix product accumulates in f32 and its result is rounded to `T`
/// (scores before scaling, O, dP, and the probabilities P and dS after the elementwise
/// steps, dropout's `P ∘ Z/(1 − p)` and `dP ∘ Z/(1 − p)` too); the row sums D, and dQ, dK,
/// dV accumulate in f32 and are rounded to `T` once. Its error against
/// [`attention_backward_reference`] bounds what the accuracy rule allows the other backends.
pub fn attention_backward_naive<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    d_o: ArrayView4<T>,
    params: &AttnParams,
) -> Result<Gradients<T>> {
    check_inputs(&q, &k, &v)?;
    params.active_dropout()?;
    if let Some(spans) = key_padding(&q, &k, params)? {
        let dims = (q.dim().into(), k.dim().into());
        return backward_spans(dims, &spans, params, T::default(), |sp, p| {
            let (q_, k_, v_) = (rows(&q, sp, true), rows(&k, sp, false), rows(&v, sp, false));
            attention_backward_naive(q_, k_, v_, rows(&d_o, sp, true), p)
        });
    }
    let in_t = Precision {
        load: T::to_f32,
        scores: round_to::<T>,
        probs: round_to::<T>,
        store: T::from_f32,
    };
    naive_backward(q, k, v, d_o, None, params, |s| s, &in_t)
}

/// The routine shared by [`attention_backward_reference`], [`attention_backward_naive`] and
/// [`attention_backward_reference_given`] (which passes the forward outputs O and LSE in
/// `given`); `prec.probs` rounds every intermediate matrix after the scores (P, O, dP, dS).
#[allow(clippy::too_many_arguments)]
fn naive_backward<T: Copy, A: Real, G: Copy + Default>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    d_o: ArrayView4<T>,
    given: Option<(ArrayView4<T>, ArrayView3<A>)>,
    params: &AttnParams,
    scale_to_acc: fn(f32) -> A,
    prec: &Precision<T, A, G>,
) -> Result<Gradients<G>> {
    let shape = check_inputs(&q, &k, &v)?;
    let d_o_dims: [usize; 4] = d_o.dim().into();
    let (o_dims, lse_dims) = match &given {
        Some((o, lse)) => (o.dim().into(), lse.dim().into()),
        None => (shape.q_dims(), shape.lse_dims()),
    };
    shape.check_backward_inputs(&o_dims, &d_o_dims, &lse_dims)?;
    let scale = scale_to_acc(params.scale(shape.head_dim)?);
    let (nq, nk, d) = (shape.seqlen_q, shape.seqlen_k, shape.head_dim);
    let mut dq = alloc::array(Dim(shape.q_dims()), G::default(), "gradient dQ")?;
    let mut dk = alloc::array(Dim(shape.kv_dims()), A::ZERO, "reference dK")?;
    let mut dv = alloc::array(Dim(shape.kv_dims()), A::ZERO, "reference dV")?;
    let mut qh = alloc::array(Dim([nq, d]), A::ZERO, "reference Q")?;
    let mut kh = alloc::array(Dim([nk, d]), A::ZERO, "reference K")?;
    let mut vh = alloc::array(Dim([nk, d]), A::ZERO, "reference V")?;
    let mut doh = alloc::array(Dim([nq, d]), A::ZERO, "reference dO")?;
    let mut p = alloc::array(Dim([nq, nk]), A::ZERO, "reference probabilities")?;
    let mut raw = alloc::array(Dim([nq, nk]), A::ZERO, "reference scores")?;
    let mut ds = alloc::array(Dim([nq, nk]), A::ZERO, "reference dS")?;
    let mut oh = alloc::array(Dim([nq, d]), A::ZERO, "reference O")?;
    let mut dqh = alloc::array(Dim([nq, d]), A::ZERO, "reference dQ")?;
    let mut dropout = RefDropout::new(params, &shape)?;
    // P ∘ Z/(1 − p), with dropout.
    let dropped_dims = if dropout.is_some() { [nq, nk] } else { [0, 0] };
    let mut dropped = alloc::array(Dim(dropped_dims), A::ZERO, "reference dropped P")?;
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            let kv = shape.kv_head(h);
            qh.zip_mut_with(&q.slice(s![b, .., h, ..]), |a, &x| *a = (prec.load)(x));
            kh.zip_mut_with(&k.slice(s![b, .., kv, ..]), |a, &x| *a = (prec.load)(x));
            vh.zip_mut_with(&v.slice(s![b, .., kv, ..]), |a, &x| *a = (prec.load)(x));
            doh.zip_mut_with(&d_o.slice(s![b, .., h, ..]), |a, &x| *a = (prec.load)(x));
            // The forward: P (zero beyond each row's visible keys) and O = P·V (P ∘ Z/(1 − p)
            // with dropout). `p` holds the raw scores first (kept in `raw` for the softcap's
            // derivative), then the logits.
            general_mat_mul(A::one(), &qh, &kh.t(), A::ZERO, &mut p);
            let mask = RefMask::new(params, &shape, (b, h), scale_to_acc)?;
            raw.assign(&p);
            mask.logits(&mut p, scale, prec.scores);
            match &given {
                None => {
                    for (i, row) in p.outer_iter_mut().enumerate() {
                        softmax_in_place(row, mask.visible(i), |j| mask.hidden(i, j), prec.probs);
                    }
                }
                Some((_, lse)) => {
                    for (i, mut row) in p.outer_iter_mut().enumerate() {
                        let (seen, lse) = (mask.visible(i), lse[[b, h, i]]);
                        let seen = if lse == A::NEG_INF { 0..0 } else { seen };
                        row.slice_mut(s![seen.clone()])
                            .mapv_inplace(|s| (s - lse).exp());
                        row.slice_mut(s![..seen.start]).fill(A::ZERO);
                        row.slice_mut(s![seen.end..]).fill(A::ZERO);
                        for j in seen.filter(|&j| mask.hidden(i, j)) {
                            row[j] = A::ZERO;
                        }
                    }
                }
            }
            let p_used = match dropout.as_mut() {
                None => &p,
                Some(dropout) => {
                    dropout.draw(b, h);
                    dropped.assign(&p);
                    dropout.apply(&mut dropped, prec.probs);
                    &dropped
                }
            };
            match &given {
                None => {
                    general_mat_mul(A::one(), p_used, &vh, A::ZERO, &mut oh);
                    oh.mapv_inplace(prec.probs);
                }
                Some((o, _)) => {
                    oh.zip_mut_with(&o.slice(s![b, .., h, ..]), |a, &x| *a = (prec.load)(x));
                }
            }
            // dV += Pᵀ·dO; dP = dO·Vᵀ (into ds; dP ∘ Z/(1 − p) with dropout).
            general_mat_mul(
                A::one(),
                &p_used.t(),
                &doh,
                A::one(),
                &mut dv.slice_mut(s![b, .., kv, ..]),
            );
            general_mat_mul(A::one(), &doh, &vh.t(), A::ZERO, &mut ds);
            if let Some(dropout) = &dropout {
                dropout.apply(&mut ds, prec.probs);
            }
            // dS = P ∘ (dP − D), D = rowsum(dO ∘ O), times the softcap's derivative; zero (not
            // 0·x) where the row cannot see.
            for (i, (mut ds_row, p_row)) in ds.outer_iter_mut().zip(p.outer_iter()).enumerate() {
                let delta = Zip::from(doh.row(i))
                    .and(oh.row(i))
                    .fold(A::ZERO, |s, &x, &y| s + x * y);
                let seen = mask.visible(i);
                Zip::from(ds_row.slice_mut(s![seen.clone()]))
                    .and(p_row.slice(s![seen.clone()]))
                    .and(raw.row(i).slice(s![seen.clone()]))
                    .for_each(|ds, &p, &s| {
                        *ds =
                            (prec.probs)((prec.probs)(*ds) - delta) * p * mask.logit_grad(s, scale)
                    });
                ds_row.slice_mut(s![..seen.start]).fill(A::ZERO);
                ds_row.slice_mut(s![seen.end..]).fill(A::ZERO);
                for j in seen.filter(|&j| mask.hidden(i, j)) {
                    ds_row[j] = A::ZERO;
                }
            }
            ds.mapv_inplace(prec.probs);
            // dQ = scale·dS·K; dK += scale·dSᵀ·Q.
            general_mat_mul(scale, &ds, &kh, A::ZERO, &mut dqh);
            Zip::from(dq.slice_mut(s![b, .., h, ..]))
                .and(&dqh)
                .for_each(|x, &y| *x = (prec.store)(y));
            general_mat_mul(
                scale,
                &ds.t(),
                &qh,
                A::one(),
                &mut dk.slice_mut(s![b, .., kv, ..]),
            );
        }
    }
    let store = |acc: Array4<A>, what| -> Result<Array4<G>> {
        let mut out = alloc::array(Dim(shape.kv_dims()), G::default(), what)?;
        Zip::from(&mut out)
            .and(&acc)
            .for_each(|x, &y| *x = (prec.store)(y));
        Ok(out)
    };
    let dk = store(dk, "gradient dK")?;
    let dv = store(dv, "gradient dV")?;
    Ok((dq, dk, dv))
}
