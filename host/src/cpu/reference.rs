//! Naive attention with materialised scores: the float64 oracle of the tests, and the same
//! algorithm in an element type `T`, whose error is the yardstick of the accuracy rule.
//!
//! Both are one generic routine parametrised by a [`Precision`]: where values are loaded, and
//! where scores, probabilities and outputs are rounded. The mask rules (window, causal,
//! softcap, ALiBi) are restated here ([`RefMask`]) instead of taken from the kernels' mask
//! types, so that the oracle checks those types rather than repeating them.
//!
//! Attention dropout ([`AttnParams::dropout`]) is applied by [`RefDropout`], the one place
//! of the references (forward and backward) that multiplies by `Z/(1 − p)`: each head's mask
//! is materialised from the kernels' generator ([`crate::cpu::dropout`]) and the
//! probabilities after the softmax (the LSE is that of the softmax before dropout) become
//! `P ∘ Z/(1 − p)` before `O = P·V`.

use ndarray::linalg::{general_mat_mul, general_mat_vec_mul};
use std::ops::Range;

use ndarray::{s, Array2, Array3, Array4, ArrayView4, ArrayViewMut1, Dim, LinalgScalar, Zip};

use crate::cpu::alloc;
use crate::cpu::dropout::CallDropout;
use crate::cpu::sequences::{forward_spans, key_padding, rows};
use crate::cpu::validate::check_inputs;
use crate::dtype::Element;
use crate::error::Result;
use crate::params::AttnParams;
use crate::shape::AttnShape;
use crate::sparse::{BlockMask, BLOCK};
use crate::tree::TreeMaskRef;

/// Naive float64 attention: `S = scale·Q·Kᵀ` materialised per (batch, head), masked, softmax
/// per row, `O = P·V` over the visible keys (with dropout, `O = (P ∘ Z)·V/(1 − p)`, the LSE
/// that of `P` before dropout). Returns O `[B, Nq, Hq, d]` and the natural-log LSE
/// `[B, Hq, Nq]`; a row that sees no key gets O = 0 and LSE = −∞, NaN and ±∞ inputs give NaN
/// as [`AttnParams`] describes. The oracle of the tests.
pub fn attention_reference(
    q: ArrayView4<f64>,
    k: ArrayView4<f64>,
    v: ArrayView4<f64>,
    params: &AttnParams,
) -> Result<(Array4<f64>, Array3<f64>)> {
    check_inputs(&q, &k, &v)?;
    params.active_dropout()?;
    if let Some(spans) = key_padding(&q, &k, params)? {
        return forward_spans(
            q.dim().into(),
            &spans,
            params,
            (0.0, f64::NEG_INFINITY),
            |sp, p| {
                attention_reference(
                    rows(&q, sp, true),
                    rows(&k, sp, false),
                    rows(&v, sp, false),
                    p,
                )
            },
        );
    }
    naive(q, k, v, params, |s| s as f64, &EXACT)
}

/// Naive attention in the element type `T`: `S = Q·Kᵀ` accumulated in f32 and rounded to `T`,
/// then scaled; softmax in f32; `P` rounded to `T` (with dropout, then `P ∘ Z/(1 − p)` rounded
/// to `T`, as a framework's dropout in `T` computes it); `O = P·V` accumulated in f32 and
/// rounded to `T`; LSE in f32. Its error against [`attention_reference`] bounds what the
/// accuracy rule allows the other backends.
pub fn attention_naive<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    params: &AttnParams,
) -> Result<(Array4<T>, Array3<f32>)> {
    check_inputs(&q, &k, &v)?;
    params.active_dropout()?;
    if let Some(spans) = key_padding(&q, &k, params)? {
        let fill = (T::default(), f32::NEG_INFINITY);
        return forward_spans(q.dim().into(), &spans, params, fill, |sp, p| {
            attention_naive(
                rows(&q, sp, true),
                rows(&k, sp, false),
                rows(&v, sp, false),
                p,
            )
        });
    }
    let in_t = Precision {
        load: T::to_f32,
        scores: round_to::<T>,
        probs: round_to::<T>,
        store: T::from_f32,
    };
    naive(q, k, v, params, |s| s, &in_t)
}

/// Arithmetic of the naive routine's accumulator (f32 or f64).
pub(crate) trait Real: LinalgScalar + PartialOrd {
    /// Zero.
    const ZERO: Self;
    /// Negative infinity.
    const NEG_INF: Self;
    /// Not a number.
    const NAN: Self;
    /// Whether the value is NaN.
    fn is_nan(self) -> bool;
    /// `eˣ`.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Hyperbolic tangent.
    fn tanh(self) -> Self;
    /// The nearest value to an f64.
    fn from_f64(x: f64) -> Self;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f32::NEG_INFINITY;
    const NAN: Self = f32::NAN;
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    fn tanh(self) -> Self {
        f32::tanh(self)
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f64::NEG_INFINITY;
    const NAN: Self = f64::NAN;
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
    fn from_f64(x: f64) -> Self {
        x
    }
}

/// Where the naive routine converts: inputs `T` to the accumulator `A`, the rounding of the
/// raw scores and of the probabilities, and the output conversion to `O`.
pub(crate) struct Precision<T, A, O> {
    /// Input element to accumulator.
    pub(crate) load: fn(T) -> A,
    /// Rounding of `Q·Kᵀ` before scaling.
    pub(crate) scores: fn(A) -> A,
    /// Rounding of the normalised probabilities before `P·V`.
    pub(crate) probs: fn(A) -> A,
    /// Accumulator to output element.
    pub(crate) store: fn(A) -> O,
}

/// No rounding anywhere: the float64 reference.
pub(crate) const EXACT: Precision<f64, f64, f64> = Precision {
    load: |x| x,
    scores: |x| x,
    probs: |x| x,
    store: |x| x,
};

/// Rounds an f32 to `T` and back.
pub(crate) fn round_to<T: Element>(x: f32) -> f32 {
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
    let (nq, nk, d) = (shape.seqlen_q, shape.seqlen_k, shape.head_dim);
    let mut out = alloc::array(Dim(shape.q_dims()), O::default(), "output O")?;
    let mut lse = alloc::array(Dim(shape.lse_dims()), A::NEG_INF, "output LSE")?;
    let mut qh = alloc::array(Dim([nq, d]), A::ZERO, "reference Q")?;
    let mut kh = alloc::array(Dim([nk, d]), A::ZERO, "reference K")?;
    let mut vh = alloc::array(Dim([nk, d]), A::ZERO, "reference V")?;
    let mut scores = alloc::array(Dim([nq, nk]), A::ZERO, "reference scores")?;
    let mut o = alloc::array(Dim([d]), A::ZERO, "reference output row")?;
    let mut dropout = RefDropout::new(params, &shape)?;
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            let kv = shape.kv_head(h);
            qh.zip_mut_with(&q.slice(s![b, .., h, ..]), |a, &x| *a = (prec.load)(x));
            kh.zip_mut_with(&k.slice(s![b, .., kv, ..]), |a, &x| *a = (prec.load)(x));
            vh.zip_mut_with(&v.slice(s![b, .., kv, ..]), |a, &x| *a = (prec.load)(x));
            general_mat_mul(A::one(), &qh, &kh.t(), A::ZERO, &mut scores);
            let mask = RefMask::new(params, &shape, (b, h), scale_to_acc)?;
            mask.logits(&mut scores, scale, prec.scores);
            for (i, row) in scores.outer_iter_mut().enumerate() {
                let hidden = |j| mask.hidden(i, j);
                lse[[b, h, i]] = softmax_in_place(row, mask.visible(i), hidden, prec.probs);
            }
            if let Some(dropout) = dropout.as_mut() {
                dropout.draw(b, h);
                dropout.apply(&mut scores, prec.probs);
            }
            for (i, p) in scores.outer_iter().enumerate() {
                // Only the visible keys: a masked key's V must not reach the row (0·NaN).
                let seen = mask.visible(i);
                if mask.has_holes() {
                    o.fill(A::ZERO);
                    for j in seen.filter(|&j| !mask.hidden(i, j)) {
                        o.zip_mut_with(&vh.row(j), |a, &x| *a = *a + p[j] * x);
                    }
                } else {
                    let (p, v_seen) = (p.slice(s![seen.clone()]), vh.slice(s![seen, ..]));
                    general_mat_vec_mul(A::one(), &v_seen.t(), &p, A::ZERO, &mut o);
                }
                let dst = out.slice_mut(s![b, i, h, ..]);
                Zip::from(dst)
                    .and(&o)
                    .for_each(|x, &y| *x = (prec.store)(y));
            }
        }
    }
    Ok((out, lse))
}

/// Attention dropout in the references: the mask `Z` of one (batch, query head) at a time,
/// materialised (`Nq × Nk`) from the kernels' generator, and the one routine that applies it.
pub(crate) struct RefDropout<A> {
    /// The call's dropout.
    call: CallDropout,
    /// `Z` of the current (batch, head): 1 kept, 0 dropped.
    keep: Array2<u8>,
    /// `1/(1 − p)` in the references' precision.
    scale: A,
}

impl<A: Real> RefDropout<A> {
    /// The dropout of `params` for a call of `shape`: `None` without dropout or with `p = 0`
    /// (the references then take exactly their path without dropout);
    /// [`crate::FlashError::Param`] for an invalid `p`.
    pub(crate) fn new(params: &AttnParams, shape: &AttnShape) -> Result<Option<Self>> {
        let Some(call) = CallDropout::new(params, shape.heads_q)? else {
            return Ok(None);
        };
        let dims = Dim([shape.seqlen_q, shape.seqlen_k]);
        Ok(Some(Self {
            call,
            keep: alloc::array(dims, 0u8, "reference dropout mask")?,
            scale: A::from_f64(call.scale64()),
        }))
    }

    /// Draws `Z` of batch entry `b` (the call's sequence `b`) and query head `h`.
    pub(crate) fn draw(&mut self, b: usize, h: usize) {
        let (nq, nk) = self.keep.dim();
        let keep = self
            .keep
            .as_slice_mut()
            .expect("a fresh standard-layout array");
        self.call.head(b, h).fill(0..nq, 0..nk, keep, nk);
    }

    /// `m ∘ Z/(1 − p)` in place, `m` being `Nq × Nk` (the probabilities P, or the backward's
    /// dP): each element, rounded by `round`, times 0 where dropped or `1/(1 − p)` where
    /// kept, rounded by `round` again. A product, not a selection: a NaN stays NaN.
    pub(crate) fn apply(&self, m: &mut Array2<A>, round: fn(A) -> A) {
        Zip::from(m).and(&self.keep).for_each(|x, &z| {
            let factor = if z != 0 { self.scale } else { A::ZERO };
            *x = round(round(*x) * factor);
        });
    }
}

/// The mask of one (batch, head) restated for the references: which keys each row sees and
/// how a scaled score becomes a logit, in the references' precision `A`.
pub(crate) struct RefMask<'p, A> {
    /// `(Nq, Nk)`.
    lens: (usize, usize),
    /// The block mask and this head's `(batch, head)` in it, if any.
    blocks: Option<(&'p BlockMask, (usize, usize))>,
    /// The tree mask and this head's batch entry, if any.
    tree: Option<(TreeMaskRef<'p>, usize)>,
    /// The window `(left, right)` with causal folded in (see [`AttnParams::window_bounds`]).
    window: (u32, u32),
    /// The softcap, if any.
    softcap: Option<A>,
    /// The head's ALiBi slope (0 without).
    slope: A,
    /// Converts an f32 into `A`.
    to_acc: fn(f32) -> A,
}

impl<'p, A: Real> RefMask<'p, A> {
    /// The mask of batch entry `b`, query head `h`.
    pub(crate) fn new(
        params: &AttnParams<'p>,
        shape: &AttnShape,
        (b, h): (usize, usize),
        to_acc: fn(f32) -> A,
    ) -> Result<Self> {
        params.check_masks(shape.batch, shape.heads_q)?;
        params.check_bit_masks(shape)?;
        Ok(Self {
            lens: (shape.seqlen_q, shape.seqlen_k),
            blocks: params.block_mask.map(|m| (m, (b, h))),
            tree: params.tree_mask.map(|t| (t, b)),
            window: params.window_bounds(),
            softcap: params.softcap.map(to_acc),
            slope: to_acc(params.slope(b, h, shape.heads_q)),
            to_acc,
        })
    }

    /// The keys row `i` sees: `[i + Nk − Nq − left, i + Nk − Nq + right]` within `0..Nk`.
    pub(crate) fn visible(&self, i: usize) -> Range<usize> {
        let (nq, nk) = (self.lens.0 as i128, self.lens.1 as i128);
        let diag = i as i128 + nk - nq;
        let first = (diag - self.window.0 as i128).clamp(0, nk);
        let end = (diag + self.window.1 as i128 + 1).clamp(first, nk);
        first as usize..end as usize
    }

    /// Whether a block mask or a tree mask hides key `j` from row `i` (inside its
    /// [`RefMask::visible`] range). The tree's drafts are the last `Nq` keys.
    pub(crate) fn hidden(&self, i: usize, j: usize) -> bool {
        let (nq, nk) = self.lens;
        let block_hidden = self
            .blocks
            .is_some_and(|(m, (b, h))| !m.get(b, h, i / BLOCK, j / BLOCK));
        let tree_hidden = self
            .tree
            .is_some_and(|(t, b)| j + nq >= nk && !t.get(b, i, j + nq - nk));
        block_hidden || tree_hidden
    }

    /// Whether [`RefMask::hidden`] can be true (a block or tree mask is present).
    pub(crate) fn has_holes(&self) -> bool {
        self.blocks.is_some() || self.tree.is_some()
    }

    /// Replaces raw scores `s` (rows × keys, rounded by `round`) by logits:
    /// `softcap(scale·s) − slope·|i + Nk − Nq − j|`, each step rounded by `round`.
    pub(crate) fn logits(&self, scores: &mut Array2<A>, scale: A, round: fn(A) -> A) {
        let shift = self.lens.1 as f64 - self.lens.0 as f64;
        for ((i, j), x) in scores.indexed_iter_mut() {
            let mut y = round(*x) * scale;
            if let Some(cap) = self.softcap {
                y = round(cap * (y / cap).tanh());
            }
            if self.slope != A::ZERO {
                let dist = (self.to_acc)((i as f64 + shift - j as f64).abs() as f32);
                y = round(y - self.slope * dist);
            }
            *x = y;
        }
    }

    /// The derivative of the logit with respect to the scaled score at raw score `s`:
    /// `1 − tanh²(scale·s / cap)` with a softcap, else 1.
    pub(crate) fn logit_grad(&self, s: A, scale: A) -> A {
        match self.softcap {
            Some(cap) => {
                let t = (s * scale / cap).tanh();
                A::one() - t * t
            }
            None => A::one(),
        }
    }
}

/// Replaces a row of scores, of which those in `seen` and not `hidden` are visible, by its
/// softmax probabilities (rounded by `round`) and returns its log-sum-exp. A row with nothing
/// visible becomes all zeros with LSE −∞. A NaN or +∞ visible score, or visible scores that
/// are all −∞, make the row's probabilities and LSE NaN (the rule on [`AttnParams`]).
pub(crate) fn softmax_in_place<A: Real>(
    mut row: ArrayViewMut1<A>,
    seen: Range<usize>,
    hidden: impl Fn(usize) -> bool,
    round: fn(A) -> A,
) -> A {
    row.slice_mut(s![..seen.start]).fill(A::ZERO);
    row.slice_mut(s![seen.end..]).fill(A::ZERO);
    let holes: Vec<usize> = seen.clone().filter(|&j| hidden(j)).collect();
    if holes.len() == seen.len() {
        row.slice_mut(s![seen]).fill(A::ZERO);
        return A::NEG_INF;
    }
    if !holes.is_empty() {
        // Hidden keys take no part: −∞ before the softmax (their scores may be NaN), 0 after.
        for &j in &holes {
            row[j] = A::NEG_INF;
        }
        let lse = softmax_visible(row.view_mut(), seen, round);
        for &j in &holes {
            row[j] = A::ZERO;
        }
        return lse;
    }
    softmax_visible(row, seen, round)
}

/// [`softmax_in_place`] of a non-empty range of visible keys, the rest already zero.
fn softmax_visible<A: Real>(mut row: ArrayViewMut1<A>, seen: Range<usize>, round: fn(A) -> A) -> A {
    let mut visible = row.slice_mut(s![seen]);
    let max = visible.iter().fold(A::NEG_INF, |m, &x| {
        if m.is_nan() || x.is_nan() {
            A::NAN
        } else if x > m {
            x
        } else {
            m
        }
    });
    if max == A::NEG_INF {
        visible.fill(A::NAN);
        return A::NAN;
    }
    // A NaN or +∞ max turns every term into NaN (x − NaN, ∞ − ∞).
    visible.mapv_inplace(|x| (x - max).exp());
    let sum = visible.iter().fold(A::ZERO, |s, &p| s + p);
    visible.mapv_inplace(|p| round(p / sum));
    max + sum.ln()
}
