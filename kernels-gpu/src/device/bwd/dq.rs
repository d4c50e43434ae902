//! The deterministic backward's dQ: query tiles outside, key tiles inside (the forward's loop
//! order), so each dQ row is summed by one thread in a fixed order, with no atomics.
//!
//! One block owns `BM = 16·WARPS` query rows of one (query head, batch); each warp 16 rows:
//!
//! ```text
//! load Qᵢ, dOᵢ; LSE·log2 e and D of the warp's rows     shared / registers
//! for each key tile j the mask visits:
//!     load Kⱼ, Vⱼ                                        shared
//!     S = Qᵢ·Kⱼᵀ;  P = 2^(c·S − LSE·log2 e)              masked scores 0 before the exponential
//!     dP = dOᵢ·Vⱼᵀ;  dS = P ∘ (dP − D)
//!     dQᵢ += dS·Kⱼ                                        dS straight from registers
//! write scale·dQᵢ
//! ```
//!
//! Shared memory: Q, dO `[BM][PITCH]`, K, V `[BN][PITCH]`. Registers per thread: dQ `D/2`
//! f32, S/P and dP/dS `BN/2` f32 each. Sync points: one `bar.sync` after each K/V load and one
//! before the next overwrites it.

use super::super::elem::Elem;
use super::super::frag::{AccTile, FragPos, RowVec, ThreadPos};
use super::super::gemm::{mma_abt, mma_pb, SmemRows};
use super::super::ptx;
use super::super::tile::{LaneOffsets, SmemTile};
use super::LOG2_E;
use crate::block::BlockInfo;
use crate::config::MMA_M;
use crate::mask::AttnMask;
use crate::params::BwdParams;

/// The deterministic dQ kernel body; const parameters as [`super::flash_bwd`], with `BN`
/// keys per step, `BM = 16·WARPS` query rows per block and `N_TILES = BN/8`.
///
/// # Safety
/// Launched with grid `(ceil(seqlen_q / BM), heads_q, batch)`, `32·WARPS` threads and
/// `BwdTile::smem_bytes()` bytes of dynamic shared memory, after the pre-pass wrote D.
#[inline(always)]
pub unsafe fn flash_bwd_dq<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const PITCH: usize,
    const BN: usize,
    const BM: usize,
    const WARPS: usize,
    const K_STEPS: usize,
    const D_TILES: usize,
    const N_TILES: usize,
>(
    p: &BwdParams,
) {
    const {
        assert!(K_STEPS * 16 == D && D_TILES * 8 == D && N_TILES * 8 == BN);
        assert!(BM == WARPS * MMA_M && PITCH >= D);
    };
    let me = ThreadPos::current();
    let dims = &p.dims;
    let longest_first = M::later_rows_see_more(&p.mask);
    let block = BlockInfo::new(
        dims,
        ptx::ctaid(),
        ptx::nctaid_x(),
        BM as u32,
        longest_first,
    );
    let mask = M::new(&p.mask, &block);
    let warp_m0 = me.warp as usize * MMA_M;
    let pos = FragPos::of(me.lane);
    let rows = RowVec::<u32, 1>::from_fn(|_, r| block.row0 + warp_m0 as u32 + pos.row(0, r));
    let stat = |t: &crate::params::RowStatsRef, row: u32| {
        *(t.ptr as *const f32).add(block.row_stat_offset(t, row) as usize)
    };
    // +∞ for rows past the sequence and rows that saw no key: their P is 0.
    let lse2 = rows.map(|row| match row < dims.seqlen_q {
        true if stat(&p.lse, row) != f32::NEG_INFINITY => stat(&p.lse, row) * LOG2_E,
        _ => f32::INFINITY,
    });
    let delta = rows.map(|row| {
        if row < dims.seqlen_q {
            stat(&p.delta, row)
        } else {
            0.0
        }
    });
    let mut dq = AccTile::<1, D_TILES>::zero(); // dQ: 16 rows × D per warp
    let (row0, bm, bn) = (block.row0, BM as u32, BN as u32);
    if let Some(mut n) = mask.first_key_tile(row0, bm, bn) {
        let base = ptx::dyn_smem_base();
        let q_tile = SmemTile::<BM, PITCH>::at(base);
        let do_tile = SmemTile::<BM, PITCH>::at(base + SmemTile::<BM, PITCH>::BYTES);
        let k_tile = SmemTile::<BN, PITCH>::at(base + 2 * SmemTile::<BM, PITCH>::BYTES);
        let v_tile = SmemTile::<BN, PITCH>::at(
            base + 2 * SmemTile::<BM, PITCH>::BYTES + SmemTile::<BN, PITCH>::BYTES,
        );
        let rows_left = dims.seqlen_q - row0;
        let q = (p.q.ptr as *const u16).add(block.query_offset(&p.q, row0) as usize);
        let d_o = (p.d_o.ptr as *const u16).add(block.query_offset(&p.d_o, row0) as usize);
        q_tile.load_async::<D, WARPS>(q, p.q.strides.row, rows_left, dims.head_dim, me.tid);
        do_tile.load_async::<D, WARPS>(d_o, p.d_o.strides.row, rows_left, dims.head_dim, me.tid);
        let lanes = LaneOffsets::new::<PITCH>(me.lane);
        loop {
            let key0 = n * bn;
            let keys_left = dims.seqlen_k - key0;
            let k = (p.k.ptr as *const u16).add(block.key_offset(&p.k, key0) as usize);
            let v = (p.v.ptr as *const u16).add(block.key_offset(&p.v, key0) as usize);
            k_tile.load_async::<D, WARPS>(k, p.k.strides.row, keys_left, dims.head_dim, me.tid);
            v_tile.load_async::<D, WARPS>(v, p.v.strides.row, keys_left, dims.head_dim, me.tid);
            ptx::cp_async_commit_group();
            ptx::cp_async_wait_group::<0>();
            ptx::bar_sync(); // Kⱼ, Vⱼ (and Qᵢ, dOᵢ) visible to every warp
            let step_lanes = lanes.step_local();
            let pos_s = FragPos::of(ptx::opaque_u32(me.lane));
            let warp_rows = |tile| SmemRows { tile, m0: warp_m0 };
            let mut s = AccTile::<1, N_TILES>::zero(); // S = Qᵢ·Kⱼᵀ, then P
            mma_abt::<E, 1, N_TILES, K_STEPS, BN, PITCH>(
                &mut s,
                &warp_rows(q_tile),
                k_tile,
                &step_lanes,
            );
            let masked = mask.tile_needs_mask(row0, bm, n, bn);
            s.for_each_mut(|mt, r, nt, c, x| {
                let keep = !masked || mask.visible(rows.0[mt][r], key0 + pos_s.col(nt, c));
                *x = if keep {
                    ptx::ex2_approx_ftz(ptx::fma_rn_f32(*x, p.scale_log2, -lse2.0[mt][r]))
                } else {
                    0.0
                };
            });
            let mut ds = AccTile::<1, N_TILES>::zero(); // dP = dOᵢ·Vⱼᵀ, then dS
            mma_abt::<E, 1, N_TILES, K_STEPS, BN, PITCH>(
                &mut ds,
                &warp_rows(do_tile),
                v_tile,
                &step_lanes,
            );
            ds.for_each_mut(|mt, r, nt, c, x| *x = s.get(mt, r, nt, c) * (*x - delta.0[mt][r]));
            mma_pb::<E, 1, N_TILES, D_TILES, BN, PITCH>(&mut dq, &ds, k_tile, &step_lanes);
            let Some(next) = mask.next_key_tile(row0, bm, bn, n) else {
                break;
            };
            n = next;
            ptx::bar_sync(); // every warp is done with Kⱼ, Vⱼ before the next loads
        }
    }
    rows.for_each(|mt, r, row| {
        if row >= dims.seqlen_q {
            return;
        }
        let dst = (p.dq.ptr as *mut u16).add(block.query_offset(&p.dq, row) as usize);
        for dt in 0..D_TILES {
            let col = pos.col(dt, 0);
            if col < dims.head_dim {
                let [x0, x1] = dq.pair(mt, r, dt);
                *(dst.add(col as usize) as *mut u32) = E::pack(x0 * p.scale, x1 * p.scale);
            }
        }
    });
}
