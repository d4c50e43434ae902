//! The forward pass on the GPU: the public entry points (calls with at most 16 queries per
//! sequence and keys enough to split run on the decode kernels, see [`crate::decode`]). The
//! work is split by job:
//! [`validate`] checks the call, [`dispatch`] picks the kernel, [`layout`] handles tensors
//! that break the kernel's alignment rule, and [`crate::launch`] launches.

mod dispatch;
pub(crate) mod layout;
pub(crate) mod validate;

use flash_attn_kernels::params::{FwdParams, RowStatsRef};

use crate::device::Device;
use crate::dtype::Element;
use crate::error::Result;
use crate::launch::launch;
use crate::mask::DeviceMask;
use crate::params::AttnParams;
use crate::tensor::DeviceTensor;
use dispatch::fwd_kernel;
use layout::{operand, packed_input, packed_output, padded_head_dim, scatter_output};
use validate::{check_dtype, check_output_shapes, check_placement, input_shape};

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
    let d = shape.head_dim;
    let kernel = fwd_kernel(dev.arch(), T::DTYPE, d, params.mask_kind())?;
    let scale_log2 = params.kernel_scale_log2(d)?;
    params.check_masks(shape.batch, shape.heads_q)?;
    check_placement(dev, &shape, [q, k, v], o, lse)?;
    // Few queries over many keys: the split-KV decode kernels fill the GPU where one block
    // per query tile would leave it idle.
    if crate::decode::forward_via_decode(dev, q, k, v, &shape, params, o, lse)? {
        return Ok(());
    }

    let mask = DeviceMask::new(dev, params, (shape.batch, shape.heads_q, d))?;
    // Tensors that break the alignment rule go through padded, contiguous temporaries.
    let padded_d = padded_head_dim(d);
    let q_packed = packed_input(dev, q, padded_d)?;
    let k_packed = packed_input(dev, k, padded_d)?;
    let v_packed = packed_input(dev, v, padded_d)?;
    let o_packed = packed_output(dev, o, padded_d)?;
    let p = FwdParams {
        q: operand(dev, q, &q_packed),
        k: operand(dev, k, &k_packed),
        v: operand(dev, v, &v_packed),
        o: operand(dev, o, &o_packed),
        lse: RowStatsRef {
            ptr: lse.device_address(dev),
            batch_stride: lse.strides()[0] as u64,
            head_stride: lse.strides()[1] as u64,
        },
        dims: shape.seq_dims(padded_d),
        mask: mask.args,
        scale_log2,
        reserved: 0,
    };
    let tile = kernel.tile;
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
            kernel.name,
            grid,
            tile.threads() as u32,
            tile.smem_bytes(),
            p,
        )?
    };
    if let Some(packed) = &o_packed {
        scatter_output(dev, o, packed, d, padded_d)?;
    }
    Ok(())
}
