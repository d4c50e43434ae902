//! The backward's two small kernels: the pre-pass D = rowsum(dO ∘ O) and the conversion of
//! the f32 dQ accumulators to the output type. Grid `(x, heads_q)` (see
//! [`crate::config::bwd_aux_grid`]): each (token, head) row is handled by
//! [`crate::config::bwd_aux_lanes`] lanes of one warp, 8 elements (16-byte loads) per lane,
//! grid-stride over the tokens. No shared memory, no barriers; the pre-pass sums its lanes
//! with warp shuffles.

use super::super::elem::Elem;
use super::super::ptx;
use crate::config::bwd_aux_lanes;
use crate::params::BwdParams;

/// 16 bytes, 16-byte aligned: one vector load or store.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct Vec16([u32; 4]);

/// The global thread index along x and the grid's thread count along x (a multiple of 32).
#[inline(always)]
unsafe fn grid_stride() -> (u64, u64) {
    let (bx, _, _) = ptx::ctaid();
    let step = ptx::nctaid_x() as u64 * ptx::ntid_x() as u64;
    (bx as u64 * ptx::ntid_x() as u64 + ptx::tid_x() as u64, step)
}

/// `(batch, row)` of token `t` of a `[batch, seqlen, …]` tensor (32-bit division when it fits).
#[inline(always)]
fn split_token(t: u64, seqlen: u32) -> (u32, u32) {
    if t <= u32::MAX as u64 {
        let t = t as u32;
        (t / seqlen, t % seqlen)
    } else {
        ((t / seqlen as u64) as u32, (t % seqlen as u64) as u32)
    }
}

/// Calls `f(batch, row, head, col0)` for every (token, head) row and 8-column chunk this
/// thread owns, and `done(lane_in_row, valid)` once per iteration in every lane of the warp
/// (warp-uniform trip count: the pre-pass shuffles there).
#[inline(always)]
unsafe fn for_each_chunk(p: &BwdParams, mut f: impl FnMut(u32, u32, u32, u32, u32, bool)) {
    let d = &p.dims;
    let lanes_log2 = bwd_aux_lanes(d.head_dim as usize).trailing_zeros();
    let head = ptx::ctaid().1;
    let total = (d.batch as u64 * d.seqlen_q as u64) << lanes_log2;
    let (mut idx, step) = grid_stride();
    let lane = idx % 32;
    while idx - lane < total {
        let (t, chunk) = (idx >> lanes_log2, (idx & ((1 << lanes_log2) - 1)) as u32);
        let valid = idx < total && chunk * 8 < d.head_dim;
        let (batch, row) = if valid {
            split_token(t, d.seqlen_q)
        } else {
            (0, 0)
        };
        f(batch, row, head, 8 * chunk, chunk, valid);
        idx += step;
    }
}

/// `delta[b, h, i] = Σ_c dO[b, i, h, c] · O[b, i, h, c]` in f32.
///
/// # Safety
/// `p` describes live O, dO and delta tensors whose rows are 16-byte aligned with a head dim
/// that is a multiple of 8; launched with [`crate::config::bwd_aux_grid`].
#[inline(always)]
pub unsafe fn bwd_prep<E: Elem>(p: &BwdParams) {
    let lanes = bwd_aux_lanes(p.dims.head_dim as usize) as u32;
    for_each_chunk(p, |batch, row, head, col0, chunk, valid| {
        let mut sum = 0.0f32;
        if valid {
            let at = |t: &crate::params::TensorRef| {
                (t.ptr as *const u16)
                    .add((t.strides.offset(batch, row, head) + col0 as u64) as usize)
                    as *const Vec16
            };
            let (o, d_o) = (*at(&p.o), *at(&p.d_o));
            for k in 0..4 {
                for half in [0, 16] {
                    let x = E::to_f32((o.0[k] >> half) as u16);
                    let y = E::to_f32((d_o.0[k] >> half) as u16);
                    sum = ptx::fma_rn_f32(x, y, sum);
                }
            }
        }
        // Sum over the row's lanes (a power of two, aligned within the warp).
        if lanes > 1 {
            sum += ptx::shfl_sync_bfly::<1>(sum);
        }
        if lanes > 2 {
            sum += ptx::shfl_sync_bfly::<2>(sum);
        }
        if lanes > 4 {
            sum += ptx::shfl_sync_bfly::<4>(sum);
        }
        if lanes > 8 {
            sum += ptx::shfl_sync_bfly::<8>(sum);
        }
        if lanes > 16 {
            sum += ptx::shfl_sync_bfly::<16>(sum);
        }
        if valid && chunk == 0 {
            let at = p.delta.offset(batch, head, row);
            *(p.delta.ptr as *mut f32).add(at as usize) = sum;
        }
    });
}

/// `dq[b, i, h, c] = Σ_s dq_accum_s[b, i, h, c]` rounded to `E`, 8 elements per lane; the
/// `dq_splits` accumulators are summed in order (deterministic).
///
/// # Safety
/// `p` describes live dQ and dQ-accumulator tensors with 16-byte aligned rows and a head dim
/// that is a multiple of 8; launched with [`crate::config::bwd_aux_grid`].
#[inline(always)]
pub unsafe fn bwd_convert_dq<E: Elem>(p: &BwdParams) {
    for_each_chunk(p, |batch, row, head, col0, _, valid| {
        if !valid {
            return;
        }
        let at = p.dq_accum.strides.offset(batch, row, head) + col0 as u64;
        let mut src = (p.dq_accum.ptr as *const f32).add(at as usize) as *const Vec16;
        let mut x = [0.0f32; 8];
        for s in 0..p.dq_splits {
            if s > 0 {
                src = (src as *const f32).add(p.dq_split_stride as usize) as *const Vec16;
            }
            let (a, b) = (*src, *src.add(1));
            for k in 0..4 {
                x[k] += f32::from_bits(a.0[k]);
                x[4 + k] += f32::from_bits(b.0[k]);
            }
        }
        let packed = Vec16(core::array::from_fn(|k| E::pack(x[2 * k], x[2 * k + 1])));
        let dst = (p.dq.ptr as *mut u16)
            .add((p.dq.strides.offset(batch, row, head) + col0 as u64) as usize);
        *(dst as *mut Vec16) = packed;
    });
}
