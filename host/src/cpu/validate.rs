//! Shape checks of the CPU entry points: [`crate::shape`] applied to ndarray views.

use ndarray::{ArrayView3, ArrayView4, ArrayViewMut3, ArrayViewMut4};

use crate::error::Result;
use crate::shape::{check_shapes, AttnShape};

/// Validates the shapes of Q, K and V.
pub(crate) fn check_inputs<T>(
    q: &ArrayView4<T>,
    k: &ArrayView4<T>,
    v: &ArrayView4<T>,
) -> Result<AttnShape> {
    check_shapes(&dims(q.dim()), &dims(k.dim()), &dims(v.dim()))
}

/// Validates the shapes of the outputs O and LSE against the inputs' sizes.
pub(crate) fn check_outputs<T>(
    shape: &AttnShape,
    o: &ArrayViewMut4<T>,
    lse: &ArrayViewMut3<f32>,
) -> Result<()> {
    let (b, h, n) = lse.dim();
    shape.check_outputs(&dims(o.dim()), &[b, h, n])
}

/// An ndarray 4-D pattern as an array.
fn dims((a, b, c, d): (usize, usize, usize, usize)) -> [usize; 4] {
    [a, b, c, d]
}

/// Validates the backward pass's extra inputs O, dO (like Q) and LSE (`[B, Hq, Nq]`).
pub(crate) fn check_backward_inputs<T>(
    shape: &AttnShape,
    o: &ArrayView4<T>,
    d_o: &ArrayView4<T>,
    lse: &ArrayView3<f32>,
) -> Result<()> {
    let (b, h, n) = lse.dim();
    shape.check_backward_inputs(&dims(o.dim()), &dims(d_o.dim()), &[b, h, n])
}

/// Validates the shapes of caller-provided gradients dQ (like Q), dK and dV (like K and V).
pub(crate) fn check_gradients<T>(
    shape: &AttnShape,
    dq: &ArrayViewMut4<T>,
    dk: &ArrayViewMut4<T>,
    dv: &ArrayViewMut4<T>,
) -> Result<()> {
    shape.check_gradients(&dims(dq.dim()), &dims(dk.dim()), &dims(dv.dim()))
}
