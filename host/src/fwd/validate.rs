//! Checks of a GPU forward call, all made before anything is allocated or launched: element
//! type, shapes, contexts, strides, grid limits and aliasing.

use std::sync::Arc;

use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{FlashError, Result};
use crate::shape::{check_shapes, AttnShape};
use crate::tensor::DeviceTensor;
use flash_attn_kernels::params::RowStatsRef;

/// Largest grid y/z extent: heads and batch are mapped there.
const MAX_GRID_YZ: usize = 65_535;

/// The GPU kernels take f16 and bf16 only.
pub(crate) fn check_dtype<T: Element>() -> Result<()> {
    match T::DTYPE {
        DType::F16 | DType::BF16 => Ok(()),
        DType::F32 => Err(FlashError::DType(
            "the GPU kernels take f16 or bf16 (use the CPU backend for f32)".into(),
        )),
        DType::I32 => Err(FlashError::DType(
            "attention takes f16 or bf16 tensors (f32 on the CPU backend), not i32".into(),
        )),
    }
}

/// Shapes of Q, K and V, checked (rank, sizes, GQA, the GPU's head dim range, 32-bit limits).
pub(crate) fn input_shape<T: Element>(
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
) -> Result<AttnShape> {
    let shape = check_shapes(
        &dims(q.shape(), "Q")?,
        &dims(k.shape(), "K")?,
        &dims(v.shape(), "V")?,
    )?;
    if shape.head_dim > 256 {
        return Err(FlashError::HeadDim(shape.head_dim));
    }
    Ok(shape)
}

/// Checks the shapes of O `[B, Nq, Hq, d]` and LSE `[B, Hq, Nq]` against the inputs'.
pub(crate) fn check_output_shapes<T: Element>(
    shape: &AttnShape,
    o: &DeviceTensor<T>,
    lse: &DeviceTensor<f32>,
) -> Result<()> {
    shape.check_outputs(&dims(o.shape(), "O")?, &dims(lse.shape(), "LSE")?)
}

/// Checks where the tensors live and how they are laid out (padded `[B, N, H, d]` or packed
/// varlen `[total, H, d]`): every tensor on `dev`'s context, the head dim (and LSE's
/// sequence dim) contiguous, heads and batch within the grid, and O
/// not sharing a buffer with an input.
pub(crate) fn check_placement<T: Element>(
    dev: &Device,
    shape: &AttnShape,
    [q, k, v]: [&DeviceTensor<T>; 3],
    o: &DeviceTensor<T>,
    lse: &DeviceTensor<f32>,
) -> Result<()> {
    for (name, ctx) in [
        ("Q", q.context()),
        ("K", k.context()),
        ("V", v.context()),
        ("O", o.context()),
    ]
    .into_iter()
    .chain([("LSE", lse.context())])
    {
        if !Arc::ptr_eq(ctx, dev.context()) {
            return Err(FlashError::DeviceMismatch(format!(
                "{name} belongs to another device or context"
            )));
        }
    }
    for (name, strides) in [
        ("Q", q.strides()),
        ("K", k.strides()),
        ("V", v.strides()),
        ("O", o.strides()),
    ] {
        if strides.last() != Some(&1) {
            return Err(FlashError::Layout(format!(
                "{name}: the head dim must be contiguous (stride 1)"
            )));
        }
    }
    if lse.strides().last() != Some(&1) {
        return Err(FlashError::Layout(
            "LSE: the sequence dim must be contiguous (stride 1)".into(),
        ));
    }
    if shape.heads_q > MAX_GRID_YZ || shape.batch > MAX_GRID_YZ {
        return Err(FlashError::TooLarge(format!(
            "at most {MAX_GRID_YZ} heads and {MAX_GRID_YZ} batch entries per call"
        )));
    }
    // The kernel reads K/V while writing O.
    if [q, k, v].iter().any(|t| t.same_buffer(o)) {
        return Err(FlashError::Layout(
            "O must not share memory with Q, K or V".into(),
        ));
    }
    Ok(())
}

/// A tensor's shape as a fixed rank, or a [`FlashError::Shape`] naming it.
pub(crate) fn dims<const R: usize>(shape: &[usize], name: &str) -> Result<[usize; R]> {
    shape
        .try_into()
        .map_err(|_| FlashError::Shape(format!("{name} must have rank {R}, got shape {shape:?}")))
}

/// The kernels' view of an LSE tensor: `[B, Hq, Nq]`, or `[Hq, total_q]` for a packed varlen
/// batch (batch stride 0: rows are absolute).
pub(crate) fn lse_ref(dev: &Device, lse: &DeviceTensor<f32>) -> RowStatsRef {
    let s = lse.strides();
    let (batch_stride, head_stride) = match s.len() {
        2 => (0, s[0]),
        _ => (s[0], s[1]),
    };
    RowStatsRef {
        ptr: lse.device_address(dev),
        batch_stride: batch_stride as u64,
        head_stride: head_stride as u64,
    }
}

/// The sizes of a packed varlen call: Q `[total_q, Hq, d]`, K and V `[total_k, Hkv, d]`
/// checked as one batch entry (the GPU's head dim range included), then the prefix sums
/// against the totals. The shape's batch is the number of sequences and its lengths the
/// longest ones (the grid covers those).
pub(crate) fn varlen_shape<'a, T: Element>(
    dev: &Device,
    [q, k, v]: [&DeviceTensor<T>; 3],
    varlen: &crate::seqs::Varlen<'a>,
    params: &crate::params::AttnParams,
) -> Result<(AttnShape, crate::seqs::VarlenLens<'a>)> {
    let one = |t: &DeviceTensor<T>, name| -> Result<[usize; 4]> {
        let [n, h, d] = dims::<3>(t.shape(), name)?;
        Ok([1, n, h, d])
    };
    let packed = check_shapes(&one(q, "Q")?, &one(k, "K")?, &one(v, "V")?)?;
    if packed.head_dim > 256 {
        return Err(FlashError::HeadDim(packed.head_dim));
    }
    params.check_varlen_options()?;
    let lens = varlen.lens(dev, packed.seqlen_q, packed.seqlen_k)?;
    let shape = AttnShape {
        batch: lens.batch(),
        seqlen_q: lens.max_q,
        seqlen_k: lens.max_k,
        ..packed
    };
    Ok((shape, lens))
}
