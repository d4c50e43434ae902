//! The backward's two small kernels: the pre-pass D = rowsum(dO ∘ O) and the conversion of
//! the f32 dQ accumulators to the output type. Grid `(x, heads_q)`, grid-stride over the
//! tokens of head `blockIdx.y`: the pre-pass ([`crate::config::bwd_prep_grid`]) gives each warp
//! 16 tokens, stages their rows in shared memory and sums with `mma` (see [`bwd_prep`]); the
//! conversion ([`crate::config::bwd_aux_grid`]) gives each (token, head) row
//! [`crate::config::bwd_aux_lanes`] lanes of one warp, 8 elements (16-byte loads and stores)
//! per lane, without shared memory. Neither has a block-wide barrier.

use super::super::elem::Elem;
use super::super::ptx;
use crate::config::{bwd_aux_lanes, bwd_prep_pitch, BWD_PREP_TOKENS};
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
/// Each warp takes 16 tokens at a time: their rows of O and dO go to the warp's stage in
/// shared memory ([`crate::config::bwd_prep_smem`]: 16 rows of O, then 16 of dO, each
/// [`crate::config::bwd_prep_pitch`] bytes, zero past the head dim and past the last token)
/// by 16-byte `cp.async` copies, a row's chunks from consecutive lanes, all in flight at
/// once; the `mma` fragments are then read from there. Sync points: `bar.warp.sync` after the
/// copies have landed and before the stage is written again. No block-wide barrier.
///
/// # Safety
/// `p` describes live O, dO and delta tensors whose rows are 16-byte aligned with a head dim
/// that is a multiple of 8 (the backward's packed layout); launched with
/// [`crate::config::bwd_prep_grid`], [`crate::config::BWD_PREP_WARPS`] warps and
/// [`crate::config::bwd_prep_smem`] bytes of dynamic shared memory (any grid: warps stride
/// over the 16-token groups).
#[inline(always)]
pub unsafe fn bwd_prep<E: Elem>(p: &BwdParams) {
    let d = &p.dims;
    let head = ptx::ctaid().1;
    let tokens = d.batch as u64 * d.seqlen_q as u64;
    const TOKENS: u32 = BWD_PREP_TOKENS as u32; // a group: one `mma` tile's rows
    const { assert!(TOKENS == 16) }; // the lanes' roles below: 32 staged rows, 8 per half tile
    let groups = tokens.div_ceil(TOKENS as u64);
    let (idx, step) = grid_stride();
    let (lane, warps) = ((idx % 32) as u32, step / 32);
    let (g, t) = (lane / 4, lane % 4);
    let pitch = bwd_prep_pitch(d.head_dim as usize) as u32;
    let stage = ptx::dyn_smem_base() + (ptx::tid_x() / 32) * 2 * TOKENS * pitch;
    // 16-byte chunks per staged row (the head dim rounded up to 16 columns).
    let chunks = d.head_dim.div_ceil(16) * 2;
    let mut group = idx / 32;
    while group < groups {
        // Lane l holds the address of staged row l: O's rows, then dO's (0: none).
        let (tensor, r) = (if lane < TOKENS { &p.o } else { &p.d_o }, lane % TOKENS);
        let tok = group * TOKENS as u64 + r as u64;
        let row_addr = if tok < tokens {
            let (batch, row) = split_token(tok, d.seqlen_q.max(1));
            tensor.ptr + 2 * tensor.strides.offset(batch, row, head)
        } else {
            0
        };
        // Chunk c of staged row s for item s·chunks + c, lanes over consecutive items.
        let (mut s_row, mut c) = (lane / chunks, lane % chunks);
        let lanes_step = (32 / chunks, 32 % chunks); // chunks ≤ 32
        for _ in 0..chunks {
            let lo = ptx::shfl_sync_idx_u32(row_addr as u32, s_row);
            let hi = ptx::shfl_sync_idx_u32((row_addr >> 32) as u32, s_row);
            let src = (hi as u64) << 32 | lo as u64;
            // Past the last token or the head dim: 16 zero bytes, nothing read.
            let (src, bytes) = if src != 0 && 8 * c < d.head_dim {
                (src + 16 * c as u64, 16)
            } else {
                (p.o.ptr, 0)
            };
            ptx::cp_async_cg_16(stage + s_row * pitch + 16 * c, src as *const u8, bytes);
            c += lanes_step.1;
            s_row += lanes_step.0;
            if c >= chunks {
                c -= chunks;
                s_row += 1;
            }
        }
        ptx::cp_async_commit_group();
        ptx::cp_async_wait_group::<0>();
        ptx::bar_warp_sync();
        // This lane's two tokens: rows g and g + 8 of the group (A rows; B columns of the two
        // 8-token n-tiles).
        let pair = |row: u32, col: u32| ptx::ld_shared_u32(stage + row * pitch + 2 * col);
        let (o, d_o) = ([g, g + 8], [TOKENS + g, TOKENS + 8 + g]);
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
        // Every lane's reads of the stage are done before the next group's copies land there.
        ptx::bar_warp_sync();
        // The diagonal: token g sits at (row g, column g) of n-tile 0, token g + 8 at
        // (row g + 8, column g) of n-tile 1, both in the lane with t = g / 2 (element g % 2 of
        // the row's pair; selected, not indexed, to stay in registers).
        if t == g / 2 {
            let odd = g % 2 == 1;
            let diagonal = [
                if odd { acc0[1] } else { acc0[0] },
                if odd { acc1[3] } else { acc1[2] },
            ];
            let first = group * TOKENS as u64;
            let toks = [first + g as u64, first + 8 + g as u64];
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
