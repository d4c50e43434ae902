//! The forward pass on the GPU: the public entry points (calls with at most 16 queries per
//! sequence and keys enough to split run on the decode kernels, see [`crate::decode`]). The
//! work is split by job:
//! [`validate`] checks the call, [`dispatch`] picks the kernel, [`layout`] handles tensors
//! that break the kernel's alignment rule, [`tile_order`] orders the query tiles of a
//! persistent block-sparse launch, and [`crate::launch`] launches.

mod dispatch;
mod dropout_mask;
pub(crate) mod layout;
mod tile_order;
mod tma;
pub(crate) mod validate;

use flash_attn_kernels::params::{q_box_rows, FwdParams, WgmmaFwdParams};

use crate::device::Device;
use crate::dtype::Element;
use crate::error::{FlashError, Result};
use crate::launch::{launch, Order};
use crate::mask::StagedMask;
use crate::params::AttnParams;
use crate::scratch::LaunchBytes;
use crate::seqs::{gpu_runs, SeqRun, Varlen};
use crate::shape::AttnShape;
use crate::tensor::DeviceTensor;
use dispatch::{fwd_kernel, wgmma_pays, FwdKernel, Keys};
pub use dropout_mask::flash_attn_dropout_mask;
use layout::{operand, packed_input, packed_output, padded_head_dim, scatter_output};
use tile_order::LaunchOrders;
use tma::{encode_maps, LAUNCH_BYTES, TENSOR_MAP_ALIGN};
use validate::{
    check_dtype, check_output_shapes, check_placement, dims, input_shape, lse_ref, varlen_shape,
};

/// Forward attention on the GPU: returns O `[B, Nq, Hq, d]` (input dtype) and LSE
/// `[B, Hq, Nq]` (f32, natural log). Q, K, V are f16 or bf16, `[B, N, H, d]` with the last dim
/// contiguous; see [`AttnParams`] for the options and for non-finite inputs. Allocates the
/// outputs; use [`flash_attn_into`] to write into existing ones.
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
    check_dtype::<T>()?;
    let shape = input_shape(q, k, v)?;
    check_output_shapes(&shape, o, lse)?;
    let runs = gpu_runs(&shape, params, None)?;
    let call = ForwardCall::checked(dev, &shape, [q, k, v], o, lse, params)?;
    // Few queries over many keys: the split-KV decode kernels fill the GPU where one block
    // per query tile would leave it idle (not with dropout: those kernels take none).
    if call.dropout.is_none()
        && crate::decode::forward_via_decode(dev, q, k, v, &shape, params, o, lse)?
    {
        return Ok(());
    }
    call.launch(dev, [q, k, v], o, lse, params, &runs)
}

/// The entry point of the forward kernel that a call of `dtype` with head dim `head_dim`,
/// `seqlen_k` keys and `params` launches on `dev` when it runs the forward kernels (calls
/// with few queries over many keys may take the decode kernels instead), e.g.
/// `flash_fwd_wgmma_masked_bf16_d128` on Hopper: for benchmarks and diagnostics. Errors as
/// the call's kernel choice (dtype, head dim, dropout probability).
pub fn forward_kernel_name(
    dev: &Device,
    dtype: crate::DType,
    head_dim: usize,
    seqlen_k: usize,
    params: &AttnParams,
) -> Result<&'static str> {
    let dropout = params.active_dropout()?.is_some();
    let (kernel, _) = call_kernels(dev, dtype, head_dim, seqlen_k, params, dropout)?;
    Ok(kernel.name)
}

/// The forward kernels of a call on `dev` (element type `dtype`, head dim `head_dim`,
/// `seqlen_k` keys, the mask of `params`, with or without dropout): the one it runs (on
/// Hopper the `wgmma` kernel where that pays) and the `mma.sync` kernel of the same call.
fn call_kernels(
    dev: &Device,
    dtype: crate::DType,
    head_dim: usize,
    seqlen_k: usize,
    params: &AttnParams,
    dropout: bool,
) -> Result<(FwdKernel, FwdKernel)> {
    let causal_or_window = params.causal || params.window.is_some();
    let mask = params.mask_kind();
    let long = wgmma_pays(head_dim, seqlen_k, causal_or_window, mask, dropout);
    let keys = Keys {
        seqlen_k,
        causal_or_window,
        always_wide: dev.wgmma_wide_tiles(),
    };
    let pick = |wgmma| fwd_kernel(dev.arch(), wgmma, dtype, head_dim, mask, dropout, keys);
    Ok((pick(dev.wgmma_forward(long))?, pick(false)?))
}

/// Forward attention over a packed batch of variable-length sequences ([`Varlen`]): Q
/// `[total_q, Hq, d]`, K and V `[total_k, Hkv, d]`; returns O `[total_q, Hq, d]` and LSE
/// `[Hq, total_q]` (f32, natural log). Every option of [`AttnParams`] applies per sequence
/// except `seqlens_k`, `block_mask` and `tree_mask` (errors here); per-(batch, head) ALiBi
/// slopes are `[B, Hq]`. Query tiles past a sequence's end are not computed. Allocates the
/// outputs; see [`flash_attn_varlen_into`].
pub fn flash_attn_varlen<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    varlen: &Varlen,
    params: &AttnParams,
) -> Result<(DeviceTensor<T>, DeviceTensor<f32>)> {
    check_dtype::<T>()?;
    let [total_q, heads_q, d] = dims::<3>(q.shape(), "Q")?;
    let mut o = DeviceTensor::uninit(dev, &[total_q, heads_q, d])?;
    let mut lse = DeviceTensor::uninit(dev, &[heads_q, total_q])?;
    flash_attn_varlen_into(dev, q, k, v, varlen, params, &mut o, &mut lse)?;
    Ok((o, lse))
}

/// [`flash_attn_varlen`] writing into caller-provided O `[total_q, Hq, d]` and LSE
/// `[Hq, total_q]` (the alignment rule of [`flash_attn_into`] applies).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_into<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    varlen: &Varlen,
    params: &AttnParams,
    o: &mut DeviceTensor<T>,
    lse: &mut DeviceTensor<f32>,
) -> Result<()> {
    check_dtype::<T>()?;
    let (shape, lens) = varlen_shape(dev, [q, k, v], varlen, params)?;
    check_varlen_outputs(&shape, q.shape(), o.shape(), lse.shape())?;
    let call = ForwardCall::checked(dev, &shape, [q, k, v], o, lse, params)?;
    call.launch(
        dev,
        [q, k, v],
        o,
        lse,
        params,
        &gpu_runs(&shape, params, Some(&lens))?,
    )
}

/// Checks O (Q's shape) and LSE (`[Hq, total_q]`) of a varlen call.
pub(crate) fn check_varlen_outputs(
    shape: &AttnShape,
    q: &[usize],
    o: &[usize],
    lse: &[usize],
) -> Result<()> {
    if o != q {
        return Err(FlashError::Shape(format!(
            "output O is {o:?}, expected {q:?} (the shape of Q)"
        )));
    }
    let want = [shape.heads_q, q[0]];
    if lse != want {
        return Err(FlashError::Shape(format!(
            "output LSE is {lse:?}, expected {want:?} ([heads_q, total_q])"
        )));
    }
    Ok(())
}

/// A checked forward call: its kernel and softmax constant, ready to launch.
struct ForwardCall {
    shape: AttnShape,
    kernel: FwdKernel,
    /// The `mma.sync` kernel of the same call, for layouts TMA descriptors cannot describe
    /// (`kernel` itself when that is no Hopper kernel).
    fallback: FwdKernel,
    scale_log2: f32,
    /// Attention dropout, if any (checked).
    dropout: Option<crate::params::Dropout>,
}

impl ForwardCall {
    /// Checks what every forward call shares (kernel for the head dim and mask, scale,
    /// masks, placement) for `shape` (padded, or a varlen batch's longest lengths).
    fn checked<T: Element>(
        dev: &Device,
        shape: &AttnShape,
        qkv: [&DeviceTensor<T>; 3],
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        params: &AttnParams,
    ) -> Result<Self> {
        let d = shape.head_dim;
        let dropout = params.active_dropout()?;
        let (kernel, fallback) =
            call_kernels(dev, T::DTYPE, d, shape.seqlen_k, params, dropout.is_some())?;
        let scale_log2 = params.kernel_scale_log2(d)?;
        params.check_masks(shape.batch, shape.heads_q)?;
        params.check_bit_masks(shape)?;
        check_placement(dev, shape, qkv, o, lse)?;
        Ok(Self {
            shape: *shape,
            kernel,
            fallback,
            scale_log2,
            dropout,
        })
    }

    /// Launches the forward kernel once per run of sequences (tensors that break the
    /// alignment rule go through padded, contiguous temporaries first). Runs without queries
    /// launch nothing; runs without keys write O = 0 and LSE = −∞.
    fn launch<T: Element>(
        &self,
        dev: &Device,
        [q, k, v]: [&DeviceTensor<T>; 3],
        o: &mut DeviceTensor<T>,
        lse: &mut DeviceTensor<f32>,
        params: &AttnParams,
        runs: &[SeqRun],
    ) -> Result<()> {
        let (shape, d) = (&self.shape, self.shape.head_dim);
        let padded_d = padded_head_dim(d);
        let orders = LaunchOrders::of(dev, params, shape, (self.kernel.tile, padded_d), runs)?;
        // The call's launch data (`crate::scratch`; one copy, none where the device's scratch
        // holds the same data already): the mask's (ALiBi slopes, a tree mask's words), then
        // the TMA maps; a block mask's words and tile orders are on the device already
        // (`BlockMask::on_device`), and persistent launches take their tiles from the
        // scratch's counter, one launch after the other. The device addresses exist only
        // after the upload: the launches' parameters take them below.
        let mut data = LaunchBytes::default();
        let staged_mask = StagedMask::stage(dev, params, shape, &orders.orders, &mut data)?;
        let q_packed = packed_input(dev, q, padded_d)?;
        let k_packed = packed_input(dev, k, padded_d)?;
        let v_packed = packed_input(dev, v, padded_d)?;
        let o_packed = packed_output(dev, o, padded_d)?;
        let base = FwdParams {
            q: operand(dev, q, &q_packed),
            k: operand(dev, k, &k_packed),
            v: operand(dev, v, &v_packed),
            o: operand(dev, o, &o_packed),
            lse: lse_ref(dev, lse),
            dims: shape.seq_dims(padded_d),
            mask: params.mask_args(d, shape.heads_q, 0, 0)?, // addresses after the copy
            scale_log2: self.scale_log2,
            reserved: 0,
            dropout: Default::default(),
        };
        let launches: Vec<(&SeqRun, FwdParams)> = runs
            .iter()
            .filter(|r| r.len_q > 0)
            .map(|run| {
                let p = FwdParams {
                    q: run.tensor(base.q, true),
                    k: run.tensor(base.k, false),
                    v: run.tensor(base.v, false),
                    o: run.tensor(base.o, true),
                    lse: run.stats(base.lse),
                    dims: run.dims(shape, padded_d),
                    dropout: run.dropout(self.dropout),
                    ..base
                };
                (run, p)
            })
            .collect();
        let (mut kernel, mut maps) = (self.kernel, None);
        if kernel.tile.producer_warps > 0 {
            let params: Vec<FwdParams> = launches.iter().map(|(_, p)| *p).collect();
            let tile = kernel.tile;
            let q_rows = q_box_rows(tile.block_m, tile.persistent);
            maps = encode_maps(&params, q_rows, tile.block_n);
            if maps.is_none() {
                kernel = self.fallback; // a layout the TMA descriptors cannot describe
            }
        }
        let tile = kernel.tile;
        let maps_at = maps.as_ref().map(|maps| data.push(maps, TENSOR_MAP_ALIGN));
        // Locked until the launches are queued.
        let scratch = dev.launch_scratch().upload(dev, &data)?;
        let (mask_args, tile_orders_at) = staged_mask.args(params, shape, &scratch)?;
        for (i, (run, p)) in launches.into_iter().enumerate() {
            let p = FwdParams {
                mask: run.mask(mask_args),
                ..p
            };
            let tiles_x = run.len_q.div_ceil(tile.block_m) as u32;
            let mut grid = (tiles_x, shape.heads_q as u32, run.count as u32);
            let tiles = grid.0 as usize * shape.heads_q * run.count;
            let tiles = u32::try_from(tiles)
                .map_err(|_| FlashError::TooLarge(format!("{tiles} query tiles in one launch")))?;
            let tile_counter = match maps_at {
                Some(_) if tile.persistent => {
                    grid = (dev.persistent_blocks(tiles as usize) as u32, 1, 1);
                    scratch.tile_counter()
                }
                _ => 0,
            };
            // Persistent block-sparse launches take their tiles longest first (`tile_order`).
            let tile_order = match orders.starts.get(i) {
                Some(&start) if tile_counter != 0 => tile_orders_at + 4 * start as u64,
                _ => 0,
            };
            let (name, threads, smem) = (kernel.name, tile.threads() as u32, tile.smem_bytes());
            // SAFETY: every pointer and stride in `p` was derived from live tensors whose
            // shapes were checked, the run's rows from validated lengths within them; the
            // tensor maps describe the same tensors; grid, block and shared memory are the
            // tile's.
            unsafe {
                match maps_at {
                    Some(maps_at) => {
                        let p = WgmmaFwdParams {
                            fwd: p,
                            tensor_maps: scratch.address(maps_at + i * LAUNCH_BYTES),
                            tile_counter,
                            tile_order,
                            schedule: dev.wgmma_schedule(),
                            tiles_x,
                            tiles,
                            reserved: 0,
                        };
                        launch(dev, Order::Stream, name, grid, threads, smem, p)?
                    }
                    None => launch(dev, Order::Stream, name, grid, threads, smem, p)?,
                }
            };
        }
        drop(scratch);
        if let Some(packed) = &o_packed {
            scatter_output(dev, o, packed, d, padded_d)?;
        }
        Ok(())
    }
}
