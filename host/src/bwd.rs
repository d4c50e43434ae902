//! The backward pass on the GPU (FlashAttention 2's backward). Launches: the pre-pass
//! D = rowsum(dO ∘ O), the main kernel (dK, dV, and dQ into an f32 accumulator), then either
//! the conversion of dQ to the input type ([`BwdMode::Fast`]) or the deterministic dQ kernel
//! ([`BwdMode::Deterministic`]).

use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{FlashError, Result};
use crate::fwd::layout::{operand, packed_input, packed_output, padded_head_dim, scatter_output};
use crate::fwd::validate::{check_dtype, dims, input_shape};
use crate::launch::launch;
use crate::params::AttnParams;
use crate::tensor::DeviceTensor;
use flash_attn_kernels::config::BWD_AUX_THREADS;
use flash_attn_kernels::params::{
    BwdParams, MaskArgs, RowStatsRef, SeqDims, Strides, TensorRef, FLAG_CAUSAL,
};
use flash_attn_kernels::registry::{
    self, KernelDType, MaskKind, BWD_CONVERT_KERNELS, BWD_DQ_KERNELS, BWD_PREP_KERNELS,
};
use std::sync::Arc;

/// How the GPU backward sums dQ. dK and dV are deterministic in both modes (each is summed by
/// one block, over the query heads of its group in order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BwdMode {
    /// dQ through f32 atomic adds (FlashAttention 2's design): the fastest; the order of the
    /// adds, and so dQ's last bits, can change from run to run.
    #[default]
    Fast,
    /// Bit-identical dQ, dK and dV run to run, whatever the number of blocks in flight: dQ is
    /// computed by a second kernel that walks each query tile's key tiles in a fixed order.
    Deterministic,
}

/// Largest grid y/z extent: KV heads and batch are mapped there.
const MAX_GRID_YZ: usize = 65_535;

/// Gradients of attention on the GPU: returns dQ `[B, Nq, Hq, d]`, dK and dV
/// `[B, Nk, Hkv, d]` (input dtype) for the loss whose gradient with respect to O is `d_o`,
/// given the forward's O and LSE (as [`crate::flash_attn`] returns them). GQA: dK and dV of
/// a shared KV head are the sum over its query heads. Head dims up to 128 on the GPU for now.
/// `mode` chooses between speed and bit-identical results ([`BwdMode`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_backward<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    o: &DeviceTensor<T>,
    d_o: &DeviceTensor<T>,
    lse: &DeviceTensor<f32>,
    params: &AttnParams,
    mode: BwdMode,
) -> Result<(DeviceTensor<T>, DeviceTensor<T>, DeviceTensor<T>)> {
    let shape = input_shape(q, k, v)?;
    let mut dq = DeviceTensor::uninit(dev, &shape.q_dims())?;
    let mut dk = DeviceTensor::uninit(dev, &shape.kv_dims())?;
    let mut dv = DeviceTensor::uninit(dev, &shape.kv_dims())?;
    flash_attn_backward_into(
        dev, q, k, v, o, d_o, lse, params, mode, &mut dq, &mut dk, &mut dv,
    )?;
    Ok((dq, dk, dv))
}

/// [`flash_attn_backward`] writing into caller-provided dQ, dK and dV.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_backward_into<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    o: &DeviceTensor<T>,
    d_o: &DeviceTensor<T>,
    lse: &DeviceTensor<f32>,
    params: &AttnParams,
    mode: BwdMode,
    dq: &mut DeviceTensor<T>,
    dk: &mut DeviceTensor<T>,
    dv: &mut DeviceTensor<T>,
) -> Result<()> {
    check_dtype::<T>()?;
    let shape = input_shape(q, k, v)?;
    shape.check_backward_inputs(
        &dims(o.shape(), "O")?,
        &dims(d_o.shape(), "dO")?,
        &dims(lse.shape(), "LSE")?,
    )?;
    shape.check_gradients(
        &dims(dq.shape(), "dQ")?,
        &dims(dk.shape(), "dK")?,
        &dims(dv.shape(), "dV")?,
    )?;
    let d = shape.head_dim;
    let kernel = registry::bwd_kernel(d, MaskKind::Causal).ok_or(FlashError::HeadDim(d))?;
    let dtype = match T::DTYPE {
        DType::BF16 => KernelDType::Bf16,
        _ => KernelDType::F16,
    };
    let tile = kernel.tile(dev.arch());
    let (scale, scale_log2) = (params.scale(d)?, params.scale_log2(d)?);
    let inputs: [(&str, &DeviceTensor<T>); 5] =
        [("Q", q), ("K", k), ("V", v), ("O", o), ("dO", d_o)];
    let outputs: [(&str, &DeviceTensor<T>); 3] = [("dQ", dq), ("dK", dk), ("dV", dv)];
    for (name, t) in inputs.iter().chain(outputs.iter()) {
        if !Arc::ptr_eq(t.context(), dev.context()) {
            return Err(FlashError::DeviceMismatch(format!(
                "{name} belongs to another device or context"
            )));
        }
        if t.strides()[3] != 1 {
            return Err(FlashError::Layout(format!(
                "{name}: the head dim must be contiguous (stride 1)"
            )));
        }
    }
    if !Arc::ptr_eq(lse.context(), dev.context()) {
        return Err(FlashError::DeviceMismatch(
            "LSE belongs to another device or context".into(),
        ));
    }
    if shape.heads_q > MAX_GRID_YZ || shape.batch > MAX_GRID_YZ {
        return Err(FlashError::TooLarge(format!(
            "at most {MAX_GRID_YZ} heads and {MAX_GRID_YZ} batch entries per call"
        )));
    }
    for (out_name, out) in outputs {
        if let Some((in_name, _)) = inputs.iter().find(|(_, t)| t.same_buffer(out)) {
            return Err(FlashError::Layout(format!(
                "{out_name} must not share memory with {in_name}"
            )));
        }
    }
    if dq.same_buffer(dk) || dq.same_buffer(dv) || dk.same_buffer(dv) {
        return Err(FlashError::Layout(
            "dQ, dK and dV must be distinct buffers".into(),
        ));
    }

    if lse.strides()[2] != 1 {
        return Err(FlashError::Layout(
            "LSE: the sequence dim must be contiguous (stride 1)".into(),
        ));
    }

    // Tensors that break the alignment rule go through padded, contiguous temporaries.
    let padded_d = padded_head_dim(d);
    let packed: Vec<_> = [q, k, v, o, d_o]
        .into_iter()
        .map(|t| packed_input(dev, t, padded_d))
        .collect::<Result<_>>()?;
    let dq_packed = packed_output(dev, dq, padded_d)?;
    let dk_packed = packed_output(dev, dk, padded_d)?;
    let dv_packed = packed_output(dev, dv, padded_d)?;
    let (b, nq, hq) = (shape.batch, shape.seqlen_q, shape.heads_q);
    let delta = DeviceTensor::<f32>::uninit(dev, &[b, hq, nq])?;
    let dq_accum = DeviceTensor::<f32>::zeros(dev, &[b, nq, hq, padded_d])?;
    let accum_strides = dq_accum.strides();
    let p = BwdParams {
        q: operand(dev, q, &packed[0]),
        k: operand(dev, k, &packed[1]),
        v: operand(dev, v, &packed[2]),
        o: operand(dev, o, &packed[3]),
        d_o: operand(dev, d_o, &packed[4]),
        dq: operand(dev, dq, &dq_packed),
        dk: operand(dev, dk, &dk_packed),
        dv: operand(dev, dv, &dv_packed),
        dq_accum: TensorRef {
            ptr: dq_accum.device_address(dev),
            strides: Strides {
                batch: accum_strides[0] as u64,
                row: accum_strides[1] as u64,
                head: accum_strides[2] as u64,
            },
        },
        lse: RowStatsRef {
            ptr: lse.device_address(dev),
            batch_stride: lse.strides()[0] as u64,
            head_stride: lse.strides()[1] as u64,
        },
        delta: RowStatsRef {
            ptr: delta.device_address(dev),
            batch_stride: (hq * nq) as u64,
            head_stride: nq as u64,
        },
        dims: SeqDims {
            batch: b as u32,
            heads_q: hq as u32,
            heads_kv: shape.heads_kv as u32,
            seqlen_q: nq as u32,
            seqlen_k: shape.seqlen_k as u32,
            head_dim: padded_d as u32,
        },
        scale_log2,
        scale,
        mask: MaskArgs {
            flags: if params.causal { FLAG_CAUSAL } else { 0 },
        },
    };
    let aux_blocks = |n: usize| n.div_ceil(BWD_AUX_THREADS).clamp(1, 65_535 * 16) as u32;
    let threads = BWD_AUX_THREADS as u32;
    // SAFETY: every pointer and stride in `p` comes from live tensors whose shapes were checked
    // above; the launches use the registry's grid, block and shared memory.
    unsafe {
        launch(
            dev,
            BWD_PREP_KERNELS[dtype as usize],
            (aux_blocks(b * hq * nq), 1, 1),
            threads,
            0,
            p,
        )?;
        let grid = (
            shape.seqlen_k.div_ceil(tile.block_n) as u32,
            shape.heads_kv as u32,
            b as u32,
        );
        launch(
            dev,
            kernel.name(dtype),
            grid,
            tile.threads() as u32,
            tile.smem_bytes(),
            p,
        )?;
        match mode {
            BwdMode::Fast => {
                let pairs = b * nq * hq * padded_d / 2;
                let convert = BWD_CONVERT_KERNELS[dtype as usize];
                launch(dev, convert, (aux_blocks(pairs), 1, 1), threads, 0, p)?;
            }
            BwdMode::Deterministic => {
                let dq_kernel = registry::kernel_for(BWD_DQ_KERNELS, d, MaskKind::Causal)
                    .ok_or(FlashError::HeadDim(d))?;
                let dq_tile = dq_kernel.tile(dev.arch());
                let grid = (nq.div_ceil(dq_tile.block_n) as u32, hq as u32, b as u32);
                let smem = dq_tile.smem_bytes();
                let threads = dq_tile.threads() as u32;
                launch(dev, dq_kernel.name(dtype), grid, threads, smem, p)?;
            }
        }
    }
    for (out, packed) in [(&*dq, &dq_packed), (&*dk, &dk_packed), (&*dv, &dv_packed)] {
        if let Some(packed) = packed {
            scatter_output(dev, out, packed, d, padded_d)?;
        }
    }
    // The temporaries are freed in stream order, after the launches that use them.
    Ok(())
}
