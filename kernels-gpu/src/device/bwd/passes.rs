//! The backward's two small kernels: the pre-pass D = rowsum(dO ∘ O) and the conversion of
//! the f32 dQ accumulators to the output type. Grid `(x, heads_q)` (see
//! [`crate::config::bwd_aux_grid`]), grid-stride over the tokens of head `blockIdx.y`: the
//! pre-pass gives each warp 16 tokens and sums with `mma` (see [`bwd_prep`]); the conversion
//! gives each (token, head) row [`crate::config::bwd_aux_lanes`] lanes of one warp, 8 elements
//! (16-byte loads and stores) per lane. No shared memory, no barriers.

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

/// `delta[b, h, i] = Σ_c dO[b, i, h, c] · O[b, i, h, c]` in f32, computed the way the main
/// kernel computes dP = dO·Vᵀ: by `mma` over 16-column steps in order, from zero (the
/// diagonal of O·dOᵀ for 16 tokens per warp). dS = P ∘ (dP − D) nearly cancels where one key
/// takes nearly all of a row's softmax; when O is exactly that key's V row (one visible key),
/// D and dP are then the same f32 sum and dS is exactly 0, as in the softmax backward.
///
/// # Safety
/// `p` describes live O, dO and delta tensors whose rows are 4-byte aligned with an even
/// head dim; launched with [`crate::config::bwd_aux_grid`] (any grid: warps stride over the
/// 16-token groups).
#[inline(always)]
pub unsafe fn bwd_prep<E: Elem>(p: &BwdParams) {
    let d = &p.dims;
    let head = ptx::ctaid().1;
    let tokens = d.batch as u64 * d.seqlen_q as u64;
    let groups = tokens.div_ceil(16);
    let (idx, step) = grid_stride();
    let (lane, warps) = ((idx % 32) as u32, step / 32);
    let (g, t) = (lane / 4, lane % 4);
    let mut group = idx / 32;
    while group < groups {
        // This lane's two tokens: rows g and g + 8 of the group (A rows; B columns of the two
        // 8-token n-tiles).
        let row_ptr = |tok: u64, tr: &crate::params::TensorRef| -> Option<*const u16> {
            (tok < tokens).then(|| {
                let (batch, row) = split_token(tok, d.seqlen_q.max(1));
                (tr.ptr as *const u16).add(tr.strides.offset(batch, row, head) as usize)
            })
        };
        let toks = [group * 16 + g as u64, group * 16 + 8 + g as u64];
        let o = toks.map(|tok| row_ptr(tok, &p.o));
        let d_o = toks.map(|tok| row_ptr(tok, &p.d_o));
        let pair = |row: Option<*const u16>, col: u32| -> u32 {
            match row {
                Some(r) if col < d.head_dim => *(r.add(col as usize) as *const u32),
                _ => 0,
            }
        };
        let (mut acc0, mut acc1) = ([0.0f32; 4], [0.0f32; 4]);
        let mut k0 = 0;
        while k0 < d.head_dim {
            let (c0, c1) = (k0 + 2 * t, k0 + 8 + 2 * t);
            let a = [
                pair(o[0], c0),
                pair(o[1], c0),
                pair(o[0], c1),
                pair(o[1], c1),
            ];
            E::mma(&mut acc0, a, [pair(d_o[0], c0), pair(d_o[0], c1)]);
            E::mma(&mut acc1, a, [pair(d_o[1], c0), pair(d_o[1], c1)]);
            k0 += 16;
        }
        // The diagonal: token g sits at (row g, column g) of n-tile 0, token g + 8 at
        // (row g + 8, column g) of n-tile 1, both in the lane with t = g / 2 (element g % 2 of
        // the row's pair; selected, not indexed, to stay in registers).
        if t == g / 2 {
            let odd = g % 2 == 1;
            let diagonal = [
                if odd { acc0[1] } else { acc0[0] },
                if odd { acc1[3] } else { acc1[2] },
            ];
            for r in 0..2 {
                let (tok, v) = (toks[r], diagonal[r]);
                if tok < tokens {
                    let (batch, row) = split_token(tok, d.seqlen_q.max(1));
                    let at = p.delta.offset(batch, head, row);
                    *(p.delta.ptr as *mut f32).add(at as usize) = v;
                }
            }
        }
        group += warps;
    }
}

/// `dq[b, i, h, c] = dq_accum[b, i, h, c]` rounded to `E`, 8 elements per lane.
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
        let src = (p.dq_accum.ptr as *const f32).add(at as usize) as *const Vec16;
        let (a, b) = (*src, *src.add(1));
        let x = |k: usize| f32::from_bits(if k < 4 { a.0[k] } else { b.0[k - 4] });
        let packed = Vec16(core::array::from_fn(|k| E::pack(x(2 * k), x(2 * k + 1))));
        let dst = (p.dq.ptr as *mut u16)
            .add((p.dq.strides.offset(batch, row, head) + col0 as u64) as usize);
        *(dst as *mut Vec16) = packed;
    });
}
