//! The forward pass on the GPU: validation, layout handling and the launch.

use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{FlashError, Result};
use crate::launch::launch;
use crate::params::AttnParams;
use crate::shape::{check_shapes, AttnShape};
use crate::tensor::DeviceTensor;
use flash_attn_kernels::config::{compiled_head_dim, fwd_kernel_name, fwd_tile, PAD_KERNEL_NAME};
use flash_attn_kernels::params::{FwdParams, PadParams, Strides, FLAG_CAUSAL, PAD_SCATTER};
use std::sync::Arc;

/// Largest grid y/z extent: heads and batch are mapped there.
const MAX_GRID_YZ: usize = 65_535;

/// Forward attention on the GPU: returns O `[B, Nq, Hq, d]` (input dtype) and LSE
/// `[B, Hq, Nq]` (f32, natural log). Q, K, V are f16 or bf16, `[B, N, H, d]` with the last dim
/// contiguous; see [`AttnParams`] for the options. Allocates the outputs; use
/// [`flash_attn_into`] to write into existing ones.
pub fn flash_attn<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    params: &AttnParams,
) -> Result<(DeviceTensor<T>, DeviceTensor<f32>)> {
    let shape = input_shape(q, k, v)?;
    let mut o = DeviceTensor::uninit(dev, &shape.q_dims())?;
    let mut lse = DeviceTensor::uninit(dev, &shape.lse_dims())?;
    flash_attn_into(dev, q, k, v, params, &mut o, &mut lse)?;
    Ok((o, lse))
}

/// [`flash_attn`] writing into caller-provided O and LSE (no allocation when every tensor
/// meets the kernel's alignment rule: row starts on 16 bytes and `d % 8 == 0`; otherwise the
/// unaligned tensors are copied to padded temporaries on the device, one extra pass each).
pub fn flash_attn_into<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    params: &AttnParams,
    o: &mut DeviceTensor<T>,
    lse: &mut DeviceTensor<f32>,
) -> Result<()> {
    let bf16 = match T::DTYPE {
        DType::F16 => false,
        DType::BF16 => true,
        DType::F32 => {
            return Err(FlashError::DType(
                "the GPU kernels take f16 or bf16 (use the CPU backend for f32)".into(),
            ))
        }
    };
    let shape = input_shape(q, k, v)?;
    let o_dims: [usize; 4] = dims(o.shape(), "O")?;
    let lse_dims: [usize; 3] = dims(lse.shape(), "LSE")?;
    shape.check_outputs(&o_dims, &lse_dims)?;
    let d = shape.head_dim;
    let d_kernel = compiled_head_dim(d).ok_or(FlashError::HeadDim(d))?;
    let tile = fwd_tile(dev.arch(), d_kernel).ok_or(FlashError::HeadDim(d))?;
    let kernel = fwd_kernel_name(bf16, d_kernel).ok_or(FlashError::HeadDim(d))?;
    let scale = params.scale(d)?;

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
        if strides[3] != 1 {
            return Err(FlashError::Layout(format!(
                "{name}: the head dim must be contiguous (stride 1)"
            )));
        }
    }
    if lse.strides()[2] != 1 {
        return Err(FlashError::Layout(
            "LSE: the sequence dim must be contiguous (stride 1)".into(),
        ));
    }
    if shape.heads_q > MAX_GRID_YZ || shape.batch > MAX_GRID_YZ {
        return Err(FlashError::TooLarge(format!(
            "at most {MAX_GRID_YZ} heads and {MAX_GRID_YZ} batch entries per call"
        )));
    }
    if o_overlaps_inputs(o, [q, k, v]) {
        return Err(FlashError::Layout(
            "O must not share memory with Q, K or V".into(),
        ));
    }

    // Tensors that break the alignment rule go through padded, contiguous temporaries.
    let padded_d = d.div_ceil(8) * 8;
    let q_packed = packed_copy(dev, q, padded_d)?;
    let k_packed = packed_copy(dev, k, padded_d)?;
    let v_packed = packed_copy(dev, v, padded_d)?;
    let o_packed = if is_aligned(o) {
        None
    } else {
        Some(DeviceTensor::<T>::uninit(
            dev,
            &[o_dims[0], o_dims[1], o_dims[2], padded_d],
        )?)
    };
    let (q_addr, q_strides) = operand(dev, q, &q_packed);
    let (k_addr, k_strides) = operand(dev, k, &k_packed);
    let (v_addr, v_strides) = operand(dev, v, &v_packed);
    let (o_addr, o_strides) = operand(dev, o, &o_packed);

    let p = FwdParams {
        q: q_addr,
        k: k_addr,
        v: v_addr,
        o: o_addr,
        lse: lse.device_address(dev),
        q_strides,
        k_strides,
        v_strides,
        o_strides,
        lse_batch_stride: lse.strides()[0] as u64,
        lse_head_stride: lse.strides()[1] as u64,
        batch: shape.batch as u32,
        heads_q: shape.heads_q as u32,
        heads_kv: shape.heads_kv as u32,
        seqlen_q: shape.seqlen_q as u32,
        seqlen_k: shape.seqlen_k as u32,
        head_dim: padded_d as u32,
        scale_log2: scale * std::f32::consts::LOG2_E,
        flags: if params.causal { FLAG_CAUSAL } else { 0 },
    };
    let grid = (
        shape.seqlen_q.div_ceil(tile.block_m) as u32,
        shape.heads_q as u32,
        shape.batch as u32,
    );
    // SAFETY: every pointer and stride in `p` was derived from live tensors whose shapes were
    // checked above; grid, block and shared memory are the tile's.
    unsafe {
        launch(
            dev,
            kernel,
            grid,
            tile.threads() as u32,
            tile.smem_bytes(),
            p,
        )?
    };
    if let Some(packed) = &o_packed {
        pad_copy(dev, o, packed, d, padded_d, PAD_SCATTER)?;
    }
    Ok(())
}

/// Shapes of Q, K and V, checked (rank, sizes, GQA, head dim range, 32-bit limits).
fn input_shape<T: Element>(
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

fn dims<const R: usize>(shape: &[usize], name: &str) -> Result<[usize; R]> {
    shape
        .try_into()
        .map_err(|_| FlashError::Shape(format!("{name} must have rank {R}, got shape {shape:?}")))
}

/// The kernel's alignment rule: every row start 16-byte aligned and `d % 8 == 0` (the
/// allocation itself is 256-byte aligned).
fn is_aligned<T: Element>(t: &DeviceTensor<T>) -> bool {
    let s = t.strides();
    t.shape()[3] % 8 == 0 && t.offset() % 8 == 0 && s[..3].iter().all(|x| x % 8 == 0)
}

/// Whether O's buffer is one of the inputs' buffers (the kernel reads K/V while writing O).
fn o_overlaps_inputs<T: Element>(o: &DeviceTensor<T>, inputs: [&DeviceTensor<T>; 3]) -> bool {
    inputs.iter().any(|t| t.same_buffer(o))
}

/// A padded contiguous copy of `t` when it breaks the alignment rule, else `None`.
fn packed_copy<T: Element>(
    dev: &Device,
    t: &DeviceTensor<T>,
    padded_d: usize,
) -> Result<Option<DeviceTensor<T>>> {
    if is_aligned(t) {
        return Ok(None);
    }
    let s = t.shape();
    let packed = DeviceTensor::<T>::uninit(dev, &[s[0], s[1], s[2], padded_d])?;
    pad_copy(dev, t, &packed, s[3], padded_d, 0)?;
    Ok(Some(packed))
}

/// The address and strides the kernel should use for `t` (or its packed copy).
fn operand<T: Element>(
    dev: &Device,
    t: &DeviceTensor<T>,
    packed: &Option<DeviceTensor<T>>,
) -> (u64, Strides) {
    let used = packed.as_ref().unwrap_or(t);
    let s = used.strides();
    (
        used.device_address(dev),
        Strides {
            batch: s[0] as u64,
            row: s[1] as u64,
            head: s[2] as u64,
        },
    )
}

/// Runs the layout kernel between a strided tensor and its packed twin.
fn pad_copy<T: Element>(
    dev: &Device,
    strided: &DeviceTensor<T>,
    packed: &DeviceTensor<T>,
    dim: usize,
    packed_dim: usize,
    flags: u32,
) -> Result<()> {
    let s = strided.strides();
    let sh = strided.shape();
    let p = PadParams {
        strided: strided.device_address(dev),
        packed: packed.device_address(dev),
        strides: Strides {
            batch: s[0] as u64,
            row: s[1] as u64,
            head: s[2] as u64,
        },
        batch: sh[0] as u32,
        seqlen: sh[1] as u32,
        heads: sh[2] as u32,
        dim: dim as u32,
        packed_dim: packed_dim as u32,
        flags,
    };
    let total = sh[0] * sh[1] * sh[2] * packed_dim;
    let threads = 256;
    let blocks = total.div_ceil(threads).clamp(1, 65_535 * 16) as u32;
    // SAFETY: both tensors cover `[batch, seqlen, heads, dim]` as described by `p`.
    unsafe { launch(dev, PAD_KERNEL_NAME, (blocks, 1, 1), threads as u32, 0, p) }
}
