//! The backward pass on the GPU (FlashAttention 2's backward). Launches: the pre-pass
//! D = rowsum(dO ∘ O), the main kernel (dK, dV, and dQ into f32 accumulators), then the
//! conversion of dQ to the input type. [`BwdMode`] picks how the main kernel's blocks share
//! the dQ accumulators.

use crate::bwd_order::KeyTileOrders;
use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{FlashError, Result};
use crate::fwd::check_varlen_outputs;
use crate::fwd::layout::{operand, packed_input, packed_output, padded_head_dim, scatter_output};
use crate::fwd::validate::{check_dtype, dims, input_shape, lse_ref, varlen_shape};
use crate::launch::{launch, Order};
use crate::mask::DeviceMask;
use crate::params::AttnParams;
use crate::seqs::{gpu_runs, SeqRun, Varlen};
use crate::shape::AttnShape;
use crate::tensor::DeviceTensor;
use flash_attn_kernels::config::{
    bwd_aux_grid, bwd_prep_grid, bwd_prep_smem, BWD_AUX_THREADS, BWD_PREP_THREADS,
};
use flash_attn_kernels::params::{BwdParams, Strides, TensorRef};
use flash_attn_kernels::registry::{self, BWD_CONVERT_KERNELS, BWD_PREP_KERNELS};
use std::sync::Arc;

/// How the GPU backward sums dQ. dK and dV are deterministic in both modes (each is summed by
/// one block, over the query heads of its group in order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BwdMode {
    /// dQ through f32 atomic adds (FlashAttention 2's design): the fastest; the order of the
    /// adds, and so dQ's last bits, can change from run to run.
    #[default]
    Fast,
    /// Bit-identical dQ, dK and dV run to run, whatever the number of blocks in flight: the
    /// blocks add into the one f32 dQ accumulator of fast mode in turn, tile by tile, highest
    /// key tile first, through one u32 turn counter per (batch, query head, query tile)
    /// (FlashAttention 3's scheme). The blocks of each (batch, KV head) launch from the
    /// highest key tile down, so a block only waits for blocks started before it, and
    /// several (batch, KV head) pairs are interleaved in the launch order, so a block seldom
    /// waits at all.
    Deterministic,
}

/// The backward kernel row for a call: Hopper's `wgmma` kernel where the registry has one for
/// the head dim, mask and dropout (unless [`crate::BackwardPath::Mma`]), else `mma.sync`'s.
fn backward_kernel(
    dev: &Device,
    head_dim: usize,
    params: &AttnParams,
    dropout: bool,
) -> Result<&'static registry::BwdKernel> {
    let (mask, capped) = (params.mask_kind(), params.softcap.is_some());
    let wgmma = registry::bwd_wgmma_kernel(head_dim, mask, dropout, capped)
        .filter(|_| dev.wgmma_backward());
    wgmma
        .or_else(|| registry::bwd_kernel(head_dim, mask, dropout))
        .ok_or(FlashError::HeadDim(head_dim))
}

/// The entry point the backward's main kernel would run for a call of this head dim,
/// element type and parameters on `dev` (for benchmarks and tests; the mask kind and dropout
/// come from `params`).
pub fn backward_kernel_name(
    dev: &Device,
    dtype: DType,
    head_dim: usize,
    params: &AttnParams,
) -> Result<&'static str> {
    let dropout = params.active_dropout()?.is_some();
    let kernel = backward_kernel(dev, head_dim, params, dropout)?;
    Ok(kernel.name(dtype.kernel()?))
}

/// Largest grid y/z extent: KV heads and batch are mapped there.
const MAX_GRID_YZ: usize = 65_535;

/// Gradients of attention on the GPU: returns dQ `[B, Nq, Hq, d]`, dK and dV
/// `[B, Nk, Hkv, d]` (input dtype) for the loss whose gradient with respect to O is `d_o`,
/// given the forward's O and LSE (as [`crate::flash_attn`] returns them). GQA: dK and dV of
/// a shared KV head are the sum over its query heads. Head dims up to 256, as the forward.
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
    let runs = gpu_runs(&shape, params, None)?;
    run_backward(
        dev,
        &shape,
        [q, k, v, o, d_o],
        lse,
        params,
        mode,
        &runs,
        [dq, dk, dv],
    )
}

/// Gradients of [`crate::flash_attn_varlen`]: Q, O, dO and the returned dQ are
/// `[total_q, Hq, d]`, K, V, dK and dV `[total_k, Hkv, d]`, LSE `[Hq, total_q]`; sequences
/// as [`Varlen`] describes. Otherwise as [`flash_attn_backward`].
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_backward<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    o: &DeviceTensor<T>,
    d_o: &DeviceTensor<T>,
    lse: &DeviceTensor<f32>,
    varlen: &Varlen,
    params: &AttnParams,
    mode: BwdMode,
) -> Result<(DeviceTensor<T>, DeviceTensor<T>, DeviceTensor<T>)> {
    check_dtype::<T>()?;
    let mut dq = DeviceTensor::uninit(dev, q.shape())?;
    let mut dk = DeviceTensor::uninit(dev, k.shape())?;
    let mut dv = DeviceTensor::uninit(dev, k.shape())?;
    flash_attn_varlen_backward_into(
        dev, q, k, v, o, d_o, lse, varlen, params, mode, &mut dq, &mut dk, &mut dv,
    )?;
    Ok((dq, dk, dv))
}

/// [`flash_attn_varlen_backward`] writing into caller-provided dQ, dK and dV.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_backward_into<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    o: &DeviceTensor<T>,
    d_o: &DeviceTensor<T>,
    lse: &DeviceTensor<f32>,
    varlen: &Varlen,
    params: &AttnParams,
    mode: BwdMode,
    dq: &mut DeviceTensor<T>,
    dk: &mut DeviceTensor<T>,
    dv: &mut DeviceTensor<T>,
) -> Result<()> {
    check_dtype::<T>()?;
    let (shape, lens) = varlen_shape(dev, [q, k, v], varlen, params)?;
    check_varlen_outputs(&shape, q.shape(), o.shape(), lse.shape())?;
    for (name, t, like) in [
        ("dO", d_o.shape(), q.shape()),
        ("gradient dQ", dq.shape(), q.shape()),
        ("gradient dK", dk.shape(), k.shape()),
        ("gradient dV", dv.shape(), k.shape()),
    ] {
        if t != like {
            return Err(FlashError::Shape(format!(
                "{name} is {t:?}, expected {like:?}"
            )));
        }
    }
    let runs = gpu_runs(&shape, params, Some(&lens))?;
    run_backward(
        dev,
        &shape,
        [q, k, v, o, d_o],
        lse,
        params,
        mode,
        &runs,
        [dq, dk, dv],
    )
}

/// The backward of a checked call of `shape` (padded, or a varlen batch's longest lengths)
/// over its runs of sequences: the remaining checks, then per run the pre-pass, the main
/// kernel and the dQ conversion (a run without keys gets dQ = 0, one without queries
/// dK = dV = 0).
#[allow(clippy::too_many_arguments)]
fn run_backward<T: Element>(
    dev: &Device,
    shape: &AttnShape,
    [q, k, v, o, d_o]: [&DeviceTensor<T>; 5],
    lse: &DeviceTensor<f32>,
    params: &AttnParams,
    mode: BwdMode,
    runs: &[SeqRun],
    [dq, dk, dv]: [&mut DeviceTensor<T>; 3],
) -> Result<()> {
    let d = shape.head_dim;
    let dropout = params.active_dropout()?;
    let kernel = backward_kernel(dev, d, params, dropout.is_some())?;
    let dtype = T::DTYPE.kernel()?;
    let tile = kernel.tile(dev.arch());
    let (scale_log2, scale) = (params.kernel_scale_log2(d)?, params.kernel_grad_scale(d)?);
    params.check_masks(shape.batch, shape.heads_q)?;
    let inputs: [(&str, &DeviceTensor<T>); 5] =
        [("Q", q), ("K", k), ("V", v), ("O", o), ("dO", d_o)];
    let outputs: [(&str, &DeviceTensor<T>); 3] = [("dQ", dq), ("dK", dk), ("dV", dv)];
    for (name, t) in inputs.iter().chain(outputs.iter()) {
        if !Arc::ptr_eq(t.context(), dev.context()) {
            return Err(FlashError::DeviceMismatch(format!(
                "{name} belongs to another device or context"
            )));
        }
        if t.strides().last() != Some(&1) {
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

    if lse.strides().last() != Some(&1) {
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
    let hq = shape.heads_q;
    let fast = mode == BwdMode::Fast;
    let orders = KeyTileOrders::of(dev, params, shape, (fast, tile.block_n, padded_d), runs)?;
    let mask = DeviceMask::with_orders(dev, params, shape, &orders.orders)?;
    // D has LSE's layout: [B, Hq, Nq], or [Hq, total_q] for a varlen batch.
    let delta = DeviceTensor::<f32>::uninit(dev, lse.shape())?;
    let base = BwdParams {
        q: operand(dev, q, &packed[0]),
        k: operand(dev, k, &packed[1]),
        v: operand(dev, v, &packed[2]),
        o: operand(dev, o, &packed[3]),
        d_o: operand(dev, d_o, &packed[4]),
        dq: operand(dev, dq, &dq_packed),
        dk: operand(dev, dk, &dk_packed),
        dv: operand(dev, dv, &dv_packed),
        dq_accum: TensorRef::default(),
        lse: lse_ref(dev, lse),
        delta: lse_ref(dev, &delta),
        dims: shape.seq_dims(padded_d),
        scale_log2,
        scale,
        mask: mask.args,
        dq_order: 0,
        order_heads: 0,
        key_tile_order: 0,
        dropout: Default::default(),
    };
    let threads = BWD_AUX_THREADS as u32;
    // Accumulators of earlier runs, freed in stream order after the launches that use them.
    let mut accums = Vec::with_capacity(runs.len());
    for (i, run) in runs.iter().enumerate() {
        let (len_q, len_k) = (run.len_q, run.len_k);
        let key_tiles = len_k.div_ceil(tile.block_n);
        // Whole query tiles and the compiled head dim: the main kernel's adds are unchecked.
        let (accum_rows, accum_d) = (len_q.div_ceil(tile.block_m) * tile.block_m, tile.head_dim);
        let dq_accum = match len_q {
            0 => None, // no query rows: the main kernel only writes dK = dV = 0
            _ => Some(DeviceTensor::<f32>::zeros(
                dev,
                &[run.count, accum_rows, hq, accum_d],
            )?),
        };
        // Deterministic mode's turn counters, one per (sequence, query head, query tile).
        let query_tiles = accum_rows / tile.block_m;
        let turns = match (mode, len_q) {
            (BwdMode::Deterministic, 1..) => Some(DeviceTensor::<i32>::zeros(
                dev,
                &[run.count, hq, query_tiles],
            )?),
            _ => None,
        };
        let order_heads = match turns {
            Some(_) => {
                let name = kernel.name(dtype);
                let resident =
                    dev.resident_blocks(name, tile.threads() as u32, tile.smem_bytes())?;
                let steps = query_tiles * (hq / shape.heads_kv);
                interleaved_pairs(resident, steps, run.count * shape.heads_kv)
            }
            None => 0,
        };
        let run_mask = run.mask(base.mask);
        let p = BwdParams {
            q: run.tensor(base.q, true),
            k: run.tensor(base.k, false),
            v: run.tensor(base.v, false),
            o: run.tensor(base.o, true),
            d_o: run.tensor(base.d_o, true),
            dq: run.tensor(base.dq, true),
            dk: run.tensor(base.dk, false),
            dv: run.tensor(base.dv, false),
            dq_accum: dq_accum.as_ref().map_or(TensorRef::default(), |a| {
                let st = a.strides();
                TensorRef {
                    ptr: a.device_address(dev),
                    strides: Strides {
                        batch: st[0] as u64,
                        row: st[1] as u64,
                        head: st[2] as u64,
                    },
                }
            }),
            lse: run.stats(base.lse),
            delta: run.stats(base.delta),
            dims: run.dims(shape, padded_d),
            mask: run_mask,
            dq_order: turns.as_ref().map_or(0, |t| t.device_address(dev)),
            order_heads,
            dropout: run.dropout(dropout),
            key_tile_order: orders.words_after_bits(i, run_mask.mask_bits, mask.orders_at),
            ..base
        };
        let aux_grid = bwd_aux_grid(run.count * len_q, hq, padded_d);
        // SAFETY: every pointer and stride in `p` comes from live tensors whose shapes were
        // checked above, the run's rows from validated lengths within them; the launches use
        // the registry's grid, block and shared memory.
        unsafe {
            if len_q > 0 && len_k > 0 {
                launch(
                    dev,
                    Order::Stream,
                    BWD_PREP_KERNELS[dtype as usize],
                    bwd_prep_grid(run.count * len_q, hq),
                    BWD_PREP_THREADS as u32,
                    bwd_prep_smem(padded_d),
                    p,
                )?;
            }
            if len_k > 0 {
                // One block per key tile (in deterministic mode from the last tile down, pairs
                // interleaved: `order_heads`); overlapped with the pre-pass where one ran.
                let grid = (key_tiles as u32, shape.heads_kv as u32, run.count as u32);
                let order = if len_q > 0 {
                    Order::Overlapped
                } else {
                    Order::Stream
                };
                launch(
                    dev,
                    order,
                    kernel.name(dtype),
                    grid,
                    tile.threads() as u32,
                    tile.smem_bytes(),
                    p,
                )?;
            }
            if len_q > 0 {
                // dQ (0 for rows of a run without keys: the accumulators stay zero).
                let convert = BWD_CONVERT_KERNELS[dtype as usize];
                launch(dev, Order::Stream, convert, aux_grid, threads, 0, p)?;
            }
        }
        accums.push((dq_accum, turns));
    }
    for (out, packed) in [(&*dq, &dq_packed), (&*dk, &dk_packed), (&*dv, &dv_packed)] {
        if let Some(packed) = packed {
            scatter_output(dev, out, packed, d, padded_d)?;
        }
    }
    // The temporaries are freed in stream order, after the launches that use them.
    Ok(())
}

/// Deterministic mode's launch order: how many (batch, KV head) pairs to interleave so that
/// the blocks of one pair, `steps` query-tile steps each, start at least about a step and a
/// half apart once `resident` blocks run at once (a block starts every `1/resident` of a
/// block's time), spread evenly over the groups of `pairs`. One pair (the plain order) when
/// a block walks more steps than there are resident blocks.
fn interleaved_pairs(resident: usize, steps: usize, pairs: usize) -> u32 {
    let wanted = (3 * resident)
        .div_ceil(2 * steps.max(1))
        .clamp(1, pairs.max(1));
    let groups = pairs.max(1).div_ceil(wanted);
    u32::try_from(pairs.max(1).div_ceil(groups)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::interleaved_pairs;

    #[test]
    fn interleaving_spaces_a_pairs_blocks_by_a_step_and_a_half() {
        // 132 SMs, one block each: 8 steps per block want 25 pairs; 512 pairs in 21 groups.
        assert_eq!(interleaved_pairs(132, 8, 512), 25);
        assert_eq!(interleaved_pairs(132, 32, 512), 7);
        // Long walks keep the plain order, and there are never more pairs than given.
        assert_eq!(interleaved_pairs(132, 256, 16), 1);
        assert_eq!(interleaved_pairs(132, 8, 3), 3);
        // Groups come out even: 30 wanted of 40 pairs gives two groups of 20.
        assert_eq!(interleaved_pairs(20, 1, 40), 20);
        assert_eq!(interleaved_pairs(1, 0, 0), 1);
    }
}
