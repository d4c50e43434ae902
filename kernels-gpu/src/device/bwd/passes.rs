//! The backward's two small kernels: the pre-pass D = rowsum(dO ∘ O) and the conversion of
//! the f32 dQ accumulator to the output type. One thread per row (pre-pass) or per pair of
//! elements (conversion), grid-stride; no shared memory, no barriers.

use super::super::elem::Elem;
use super::super::ptx;
use crate::params::BwdParams;

/// The global thread index and the grid's thread count.
#[inline(always)]
unsafe fn grid_stride() -> (u64, u64) {
    let (bx, _, _) = ptx::ctaid();
    let step = ptx::nctaid_x() as u64 * ptx::ntid_x() as u64;
    (bx as u64 * ptx::ntid_x() as u64 + ptx::tid_x() as u64, step)
}

/// `delta[b, h, i] = Σ_c dO[b, i, h, c] · O[b, i, h, c]` in f32.
///
/// # Safety
/// `p` describes live O, dO and delta tensors.
#[inline(always)]
pub unsafe fn bwd_prep<E: Elem>(p: &BwdParams) {
    let d = &p.dims;
    let total = d.batch as u64 * d.heads_q as u64 * d.seqlen_q as u64;
    let (mut idx, step) = grid_stride();
    while idx < total {
        let row = (idx % d.seqlen_q as u64) as u32;
        let head = ((idx / d.seqlen_q as u64) % d.heads_q as u64) as u32;
        let batch = (idx / (d.seqlen_q as u64 * d.heads_q as u64)) as u32;
        let o = (p.o.ptr as *const u16).add(p.o.strides.offset(batch, row, head) as usize);
        let d_o = (p.d_o.ptr as *const u16).add(p.d_o.strides.offset(batch, row, head) as usize);
        let mut sum = 0.0f32;
        for c in 0..d.head_dim as usize {
            sum = ptx::fma_rn_f32(E::to_f32(*o.add(c)), E::to_f32(*d_o.add(c)), sum);
        }
        let at = p.delta.offset(batch, head, row);
        *(p.delta.ptr as *mut f32).add(at as usize) = sum;
        idx += step;
    }
}

/// `dq[b, i, h, c] = Σ_s dq_accum_s[b, i, h, c]` rounded to `E`, two elements per thread;
/// the `dq_splits` accumulators are summed in order (deterministic).
///
/// # Safety
/// `p` describes live dQ and dQ-accumulator tensors; the head dim is even.
#[inline(always)]
pub unsafe fn bwd_convert_dq<E: Elem>(p: &BwdParams) {
    let d = &p.dims;
    let pairs = d.head_dim as u64 / 2;
    let total = d.batch as u64 * d.seqlen_q as u64 * d.heads_q as u64 * pairs;
    let (mut idx, step) = grid_stride();
    while idx < total {
        let col = 2 * (idx % pairs) as u32;
        let rest = idx / pairs;
        let head = (rest % d.heads_q as u64) as u32;
        let rest = rest / d.heads_q as u64;
        let row = (rest % d.seqlen_q as u64) as u32;
        let batch = (rest / d.seqlen_q as u64) as u32;
        let mut src = (p.dq_accum.ptr as *const f32)
            .add((p.dq_accum.strides.offset(batch, row, head) + col as u64) as usize);
        let (mut x0, mut x1) = (*src, *src.add(1));
        for _ in 1..p.dq_splits {
            src = src.add(p.dq_split_stride as usize);
            x0 += *src;
            x1 += *src.add(1);
        }
        let dst = (p.dq.ptr as *mut u16)
            .add((p.dq.strides.offset(batch, row, head) + col as u64) as usize);
        *(dst as *mut u32) = E::pack(x0, x1);
        idx += step;
    }
}
