//! The kernel's alignment rule and what happens to tensors that break it: a padded,
//! contiguous temporary on the device, written (inputs) or read back (O) by the layout kernel.

use flash_attn_kernels::config::{PAD_KERNEL_NAME, PAD_THREADS};
use flash_attn_kernels::params::{PadParams, Strides, TensorRef, PAD_SCATTER};

use crate::device::Device;
use crate::dtype::Element;
use crate::error::Result;
use crate::launch::{launch, Order};
use crate::tensor::DeviceTensor;

/// The head dim the kernel sees: `d` rounded up to a multiple of 8 (16 bytes of f16/bf16).
pub(crate) fn padded_head_dim(d: usize) -> usize {
    d.div_ceil(8) * 8
}

/// The kernel's alignment rule: every row start 16-byte aligned and `d % 8 == 0` (the
/// allocation itself is 256-byte aligned).
pub(crate) fn is_aligned<T: Element>(t: &DeviceTensor<T>) -> bool {
    let (shape, strides) = batched(t);
    shape[3] % 8 == 0 && t.offset() % 8 == 0 && strides[..3].iter().all(|x| x % 8 == 0)
}

/// Shape and strides of a `[B, N, H, d]` tensor, or of a packed varlen `[total, H, d]` one
/// seen as `[1, total, H, d]` with batch stride 0 (every sequence indexes it by its absolute
/// rows).
pub(crate) fn batched<T: Element>(t: &DeviceTensor<T>) -> ([usize; 4], [usize; 4]) {
    let (sh, st) = (t.shape(), t.strides());
    match sh.len() {
        3 => ([1, sh[0], sh[1], sh[2]], [0, st[0], st[1], st[2]]),
        _ => ([sh[0], sh[1], sh[2], sh[3]], [st[0], st[1], st[2], st[3]]),
    }
}

/// A contiguous `[.., padded_d]` twin of `t`'s shape (same rank).
fn padded_shape<T: Element>(t: &DeviceTensor<T>, padded_d: usize) -> Vec<usize> {
    let mut shape = t.shape().to_vec();
    *shape.last_mut().expect("rank 3 or 4") = padded_d;
    shape
}

/// A padded contiguous copy of input `t` when it breaks the alignment rule, else `None`.
pub(crate) fn packed_input<T: Element>(
    dev: &Device,
    t: &DeviceTensor<T>,
    padded_d: usize,
) -> Result<Option<DeviceTensor<T>>> {
    if is_aligned(t) {
        return Ok(None);
    }
    let packed = DeviceTensor::<T>::uninit(dev, &padded_shape(t, padded_d))?;
    pad_copy(dev, t, &packed, batched(t).0[3], padded_d, 0)?;
    Ok(Some(packed))
}

/// An uninitialised padded temporary for output `o` when it breaks the alignment rule (the
/// kernel writes it; [`scatter_output`] copies it to `o`), else `None`.
pub(crate) fn packed_output<T: Element>(
    dev: &Device,
    o: &DeviceTensor<T>,
    padded_d: usize,
) -> Result<Option<DeviceTensor<T>>> {
    if is_aligned(o) {
        return Ok(None);
    }
    Ok(Some(DeviceTensor::<T>::uninit(
        dev,
        &padded_shape(o, padded_d),
    )?))
}

/// Copies the kernel's padded output to `o` (its first `d` columns).
pub(crate) fn scatter_output<T: Element>(
    dev: &Device,
    o: &DeviceTensor<T>,
    packed: &DeviceTensor<T>,
    d: usize,
    padded_d: usize,
) -> Result<()> {
    pad_copy(dev, o, packed, d, padded_d, PAD_SCATTER)
}

/// The address and strides the kernel should use for `t` (or its packed copy).
pub(crate) fn operand<T: Element>(
    dev: &Device,
    t: &DeviceTensor<T>,
    packed: &Option<DeviceTensor<T>>,
) -> TensorRef {
    let used = packed.as_ref().unwrap_or(t);
    TensorRef {
        ptr: used.device_address(dev),
        strides: strides(used),
    }
}

/// The batch, row and head strides of a `[B, N, H, d]` tensor (batch stride 0 for a packed
/// varlen one), in elements.
fn strides<T: Element>(t: &DeviceTensor<T>) -> Strides {
    let s = batched(t).1;
    Strides {
        batch: s[0] as u64,
        row: s[1] as u64,
        head: s[2] as u64,
    }
}

/// Runs the layout kernel between a strided tensor and its packed twin (`flags`: 0 gathers
/// strided → packed, [`PAD_SCATTER`] scatters packed → strided).
fn pad_copy<T: Element>(
    dev: &Device,
    strided: &DeviceTensor<T>,
    packed: &DeviceTensor<T>,
    dim: usize,
    packed_dim: usize,
    flags: u32,
) -> Result<()> {
    let sh = batched(strided).0;
    let p = PadParams {
        strided: TensorRef {
            ptr: strided.device_address(dev),
            strides: strides(strided),
        },
        packed: packed.device_address(dev),
        batch: sh[0] as u32,
        seqlen: sh[1] as u32,
        heads: sh[2] as u32,
        dim: dim as u32,
        packed_dim: packed_dim as u32,
        flags,
    };
    let total = sh[0] * sh[1] * sh[2] * packed_dim;
    let blocks = total.div_ceil(PAD_THREADS).clamp(1, 65_535 * 16) as u32;
    // SAFETY: both tensors cover `[batch, seqlen, heads, dim]` as described by `p`.
    unsafe {
        launch(
            dev,
            Order::Stream,
            PAD_KERNEL_NAME,
            (blocks, 1, 1),
            PAD_THREADS as u32,
            0,
            p,
        )
    }
}
