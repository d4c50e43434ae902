//! Shape checks of the CPU entry points: [`crate::shape`] applied to ndarray views.

use ndarray::{ArrayView4, ArrayViewMut3, ArrayViewMut4};

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
