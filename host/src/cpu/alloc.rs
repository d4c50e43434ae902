//! Fallible allocation for the CPU backend's outputs and temporaries: sizes are computed with
//! checked arithmetic and memory is reserved with `try_reserve_exact`, so a shape whose
//! buffers cannot exist (a broadcast view of billions of rows, say) is a typed error instead
//! of a "capacity overflow" panic or an allocation-failure abort.

use ndarray::{Array, Dimension};

use crate::error::{FlashError, Result};

/// The number of elements of `dims`, checked so that their bytes fit `isize`
/// ([`FlashError::TooLarge`] otherwise).
pub(crate) fn numel<T>(dims: &[usize], what: &str) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| {
            n.checked_mul(size_of::<T>().max(1))
                .is_some_and(|b| b <= isize::MAX as usize)
        })
        .ok_or_else(|| FlashError::TooLarge(format!("{what} {dims:?}: its size overflows usize")))
}

/// An empty vector with room for exactly `n` elements.
pub(crate) fn with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let n = numel::<T>(&[n], what)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        FlashError::Alloc(format!(
            "{what}: {} bytes could not be allocated",
            n * size_of::<T>()
        ))
    })?;
    Ok(v)
}

/// A vector of `n` copies of `value`.
pub(crate) fn filled<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = with_capacity(n, what)?;
    v.resize(n, value);
    Ok(v)
}

/// An array of shape `dims` filled with `value`.
pub(crate) fn array<T: Clone, D: Dimension>(dims: D, value: T, what: &str) -> Result<Array<T, D>> {
    let n = numel::<T>(dims.slice(), what)?;
    let data = filled(n, value, what)?;
    Array::from_shape_vec(dims, data).map_err(|e| FlashError::TooLarge(format!("{what}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflowing_and_unallocatable_sizes_are_errors() {
        assert!(matches!(
            numel::<f32>(&[usize::MAX, 2], "x"),
            Err(FlashError::TooLarge(_))
        ));
        assert!(matches!(
            numel::<f32>(&[1 << 62], "x"),
            Err(FlashError::TooLarge(_))
        ));
        // 2^50 bytes: beyond any x86-64 / aarch64 user address space.
        assert!(matches!(
            with_capacity::<f32>(1 << 48, "x"),
            Err(FlashError::Alloc(_))
        ));
        let a = array(ndarray::Dim([2, 3]), 1.5f32, "x").unwrap();
        assert_eq!(a.sum(), 9.0);
    }
}
