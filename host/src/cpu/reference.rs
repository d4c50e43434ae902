//! Naive attention with materialised scores: the float64 oracle of the tests, and the same
//! algorithm in an element type `T`, whose error is the yardstick of the accuracy rule.
//!
//! Both are one generic routine parametrised by a [`Precision`]: where values are loaded, and
//! where scores, probabilities and outputs are rounded. The causal rule is restated here
//! ([`visible_keys`]) instead of taken from the kernels' mask policy, so that the oracle checks
//! that policy rather than repeating it.

use ndarray::{s, Array3, Array4, ArrayView4, ArrayViewMut1, LinalgScalar};

use crate::cpu::validate::check_inputs;
use crate::dtype::Element;
use crate::error::Result;
use crate::params::AttnParams;
use crate::shape::AttnShape;

/// Naive float64 attention: `S = scale·Q·Kᵀ` materialised per (batch, head), masked, softmax
/// per row, `O = P·V`. Returns O `[B, Nq, Hq, d]` and the natural-log LSE `[B, Hq, Nq]`; a row
/// that sees no key gets O = 0 and LSE = −∞. The oracle of the tests.
pub fn attention_reference(
    q: ArrayView4<f64>,
    k: ArrayView4<f64>,
    v: ArrayView4<f64>,
    params: &AttnParams,
) -> Result<(Array4<f64>, Array3<f64>)> {
    let exact = Precision {
        load: |x: f64| x,
        scores: |x| x,
        probs: |x| x,
        store: |x| x,
    };
    naive(q, k, v, params, |s| s as f64, &exact)
}

/// Naive attention in the element type `T`: `S = Q·Kᵀ` accumulated in f32 and rounded to `T`,
/// then scaled; softmax in f32; `P` rounded to `T`; `O = P·V` accumulated in f32 and rounded to
/// `T`; LSE in f32. Its error against [`attention_reference`] bounds what the accuracy rule
/// allows the other backends.
pub fn attention_naive<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    params: &AttnParams,
) -> Result<(Array4<T>, Array3<f32>)> {
    let in_t = Precision {
        load: T::to_f32,
        scores: round_to::<T>,
        probs: round_to::<T>,
        store: T::from_f32,
    };
    naive(q, k, v, params, |s| s, &in_t)
}

/// Arithmetic of the naive routine's accumulator (f32 or f64).
trait Real: LinalgScalar + PartialOrd {
    /// Zero.
    const ZERO: Self;
    /// Negative infinity.
    const NEG_INF: Self;
    /// `eˣ`.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f32::NEG_INFINITY;
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f64::NEG_INFINITY;
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
}

/// Where the naive routine converts: inputs `T` to the accumulator `A`, the rounding of the
/// raw scores and of the probabilities, and the output conversion to `O`.
struct Precision<T, A, O> {
    /// Input element to accumulator.
    load: fn(T) -> A,
    /// Rounding of `Q·Kᵀ` before scaling.
    scores: fn(A) -> A,
    /// Rounding of the normalised probabilities before `P·V`.
    probs: fn(A) -> A,
    /// Accumulator to output element.
    store: fn(A) -> O,
}

/// Rounds an f32 to `T` and back.
fn round_to<T: Element>(x: f32) -> f32 {
    T::from_f32(x).to_f32()
}

/// The naive routine shared by [`attention_reference`] and [`attention_naive`].
fn naive<T: Copy, A: Real, O: Copy + Default>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    params: &AttnParams,
    scale_to_acc: fn(f32) -> A,
    prec: &Precision<T, A, O>,
) -> Result<(Array4<O>, Array3<A>)> {
    let shape = check_inputs(&q, &k, &v)?;
    let scale = scale_to_acc(params.scale(shape.head_dim)?);
    let mut out = Array4::from_elem(shape.q_dims(), O::default());
    let mut lse = Array3::from_elem(shape.lse_dims(), A::NEG_INF);
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            let kv = shape.kv_head(h);
            let qh = q.slice(s![b, .., h, ..]).mapv(prec.load);
            let kh = k.slice(s![b, .., kv, ..]).mapv(prec.load);
            let vh = v.slice(s![b, .., kv, ..]).mapv(prec.load);
            let mut scores = qh.dot(&kh.t());
            scores.mapv_inplace(|x| (prec.scores)(x) * scale);
            for (i, row) in scores.outer_iter_mut().enumerate() {
                let seen = visible_keys(&shape, params.causal, i);
                lse[[b, h, i]] = softmax_in_place(row, seen, prec.probs);
            }
            let o = scores.dot(&vh);
            out.slice_mut(s![b, .., h, ..]).assign(&o.mapv(prec.store));
        }
    }
    Ok((out, lse))
}

/// How many keys query row `i` sees (always a prefix `0..n`): all of them without causal
/// masking, else those with `j ≤ i + Nk − Nq` (bottom-right alignment).
fn visible_keys(shape: &AttnShape, causal: bool, i: usize) -> usize {
    if !causal {
        return shape.seqlen_k;
    }
    let end = i as i128 + shape.seqlen_k as i128 - shape.seqlen_q as i128 + 1;
    end.clamp(0, shape.seqlen_k as i128) as usize
}

/// Replaces a row of scores, of which the first `seen` are visible, by its softmax
/// probabilities (rounded by `round`) and returns its log-sum-exp. A row with nothing visible
/// becomes all zeros with LSE −∞.
fn softmax_in_place<A: Real>(mut row: ArrayViewMut1<A>, seen: usize, round: fn(A) -> A) -> A {
    row.slice_mut(s![seen..]).fill(A::ZERO);
    let mut visible = row.slice_mut(s![..seen]);
    let max = visible
        .iter()
        .fold(A::NEG_INF, |m, &x| if x > m { x } else { m });
    if max == A::NEG_INF {
        visible.fill(A::ZERO);
        return A::NEG_INF;
    }
    visible.mapv_inplace(|x| (x - max).exp());
    let sum = visible.iter().fold(A::ZERO, |s, &p| s + p);
    visible.mapv_inplace(|p| round(p / sum));
    max + sum.ln()
}
