//! Backward attention: FlashAttention 2's backward (the FlashAttention paper's Algorithm 4 with
//! the dot(dO, O) pre-pass), key tiles outside, query tiles inside.
//!
//! A block of `WARPS` warps owns `BN = 16·KEY_WARPS` keys of one (KV head, batch) at a time
//! and walks, for every query head of its group (GQA), the query tiles of `BM` rows that see
//! those keys. Key warp `w % KEY_WARPS` holds 16 keys; with `D_SPLIT > 1`, `D_SPLIT` warps
//! share those keys and each accumulates `D / D_SPLIT` columns of dK and dV.
//!
//! ```text
//! load Kⱼ, Vⱼ                                   global → shared, once per key tile
//! dKⱼ = dVⱼ = 0                                 registers
//! start loading query tile 0: Q, dO, LSE, D     cp.async into buffer 0
//! for each query tile i (every query head of the group) that sees tile j:
//!     wait for tile i; bar.sync                 (A) tile i visible; tile i−1 finished
//!     [staged dQ: start the bulk add of i−1]    one row per thread, shared → accumulator
//!     start loading tile i+1                    cp.async into the other buffer
//!     Sᵀ = Kⱼ·Qᵢᵀ                               mma.sync, f32; per warp 16 keys × BM queries
//!     Pᵀ = 2^(c·Sᵀ − LSE·log2 e)                hidden scores zeroed, only in tiles that
//!                                               cross the mask's edge
//!     [dropout: dropped Pᵀ negated]             Z from Philox (`device::dropout`)
//!     dVⱼ += (Pᵀ ∘ Z)·dOᵢ                       Pᵀ straight from registers
//!     dPᵀ = Vⱼ·dOᵢᵀ;  dSᵀ = Pᵀ ∘ (dPᵀ − Dᵢ)      with dropout: Pᵀ ∘ (Z·dPᵀ/(1 − p) − Dᵢ)
//!     dKⱼ += dSᵀ·Qᵢ                             dSᵀ straight from registers
//!     dSᵀ → shared; [staged: wait]; bar.sync    (B) dSᵀ complete, the dQ stage free
//!     dQᵢ += scale·dS·Kⱼ                        16 query rows × a column slice per warp:
//!                                               f32 atomic adds into the block's accumulator,
//!                                               or (staged dQ, sm_90) into the stage
//! [staged: bar.sync, bulk add of the last tile]
//! write scale·dKⱼ and dVⱼ [·1/(1 − p)]         16-byte stores after a transpose in each
//!                                               quad, beside the staged add
//! [staged: wait until the add read the stage]
//! ```
//!
//! One block per key tile, all adding into one f32 dQ accumulator. In deterministic mode the
//! blocks add to each query tile in turn, highest key tile first (`order`). Thread 0 looks up
//! the turns after (A), where the fewest registers are live: it opens tile i's turn if the
//! block is the first to add to it and, without the stage, waits for the turn there (its
//! warp starts the step late; the wait before (B) that the `wgmma` kernel uses made ptxas
//! spill here) and passes it after a barrier that follows the adds (a third barrier per
//! step); with the stage it waits before (A), whose flush is the add, and passes the turn
//! after (B), once the flush completed. Each dQ element of a block comes from one thread.
//!
//! Shared memory (see [`crate::config::BwdTile::smem_bytes`]): K, V `[BN][PITCH]`, two
//! buffers of Q, dO `[BM][PITCH]`, dSᵀ `[BN][BM]` (all swizzled, 16-bit), two buffers of LSE
//! and D `[BM]` f32, and with `STAGED_DQ` the dQ stage `[BM][D + 8]` f32 (its first row's
//! padding records which query tile it holds, and in deterministic mode the turns to pass).
//! Registers per thread: dK and dV `D/(2·D_SPLIT)` f32 each, Sᵀ/Pᵀ and dPᵀ/dSᵀ `BM/2` f32
//! each, a dQ slice of `DQ_TILES·4` f32. Sync points: two `bar.sync` per query tile, (A) and
//! (B) above (three in deterministic mode without the stage), and with `STAGED_DQ` one more at
//! the end (two in deterministic mode). The stage's writers fence it for the bulk engine (`fence.proxy.async`) before the barrier that precedes its bulk add.

mod dq_stage;
mod order;
mod passes;
mod stats;
#[cfg(flash_arch = "sm90a")]
pub mod wgmma;

use dq_stage::{DqStage, StageRecord};
pub use passes::{bwd_convert_dq, bwd_prep};
use stats::QueryStats;

use super::dropout::{mark_dropped, rng_for};
use super::elem::Elem;
use super::frag::{AccTile, FragPos, NonNegative, PackedTile, ThreadPos};
use super::gemm::{mma_ab, mma_abt, mma_pb, SmemCols, SmemRows};
use super::ptx;
use super::quad_store::{store_row_chunk, store_rows_by_quads};
use super::tile::{LaneOffsets, SmemTile};
use crate::block::BlockInfo;
use crate::config::MMA_M;
use crate::mask::AttnMask;
use crate::params::BwdParams;

/// The backward kernel body for any mask type `M`; see the module docs. Const parameters: `D`
/// compiled head dim, `PITCH` shared row length of the Q/K/V/dO tiles, `BN` keys per block,
/// `BM` queries per step, `WARPS`, `D_SPLIT` warps per 16 keys, and the derived counts
/// `K_STEPS = D/16`, `DKV_TILES = D/(8·D_SPLIT)` (a warp's dK/dV columns in 8-column tiles),
/// `Q_TILES = BM/8`, `KEY_STEPS = BN/16`, `DQ_COL_TILES` (a warp's dQ columns in 8-column
/// tiles) and `DQ_TILES`, the 8-column tiles of dQ computed at a time (fewer than
/// `DQ_COL_TILES` keeps registers for large head dims), and `DP_TILES`, the 8-query column
/// tiles of dPᵀ/dSᵀ computed at a time, and `STAGED_DQ` (dQ through the shared stage and the
/// bulk engine; sm_90 only), and `DROPOUT` (attention dropout from `p.dropout`, see
/// [`crate::rng`]). All are passed by the registry from
/// one [`crate::config::BwdTile`] and checked here.
///
/// # Safety
/// Launched with grid `(key tiles, heads_kv, batch)`, `32·WARPS` threads and
/// `BwdTile::smem_bytes()` bytes of dynamic shared memory, after the pre-pass wrote D and with
/// the dQ accumulator (and in deterministic mode the turn counters) zeroed, on parameters
/// the host validated.
#[inline(always)]
pub unsafe fn flash_bwd<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const PITCH: usize,
    const BN: usize,
    const BM: usize,
    const WARPS: usize,
    const D_SPLIT: usize,
    const K_STEPS: usize,
    const DKV_TILES: usize,
    const Q_TILES: usize,
    const KEY_STEPS: usize,
    const DQ_COL_TILES: usize,
    const DQ_TILES: usize,
    const DP_TILES: usize,
    const STAGED_DQ: bool,
    const DROPOUT: bool,
>(
    p: &BwdParams,
) {
    const {
        assert!(K_STEPS * 16 == D && DKV_TILES * 8 * D_SPLIT == D && DKV_TILES % 2 == 0);
        assert!(Q_TILES * 8 == BM && KEY_STEPS * 16 == BN && BN * D_SPLIT == WARPS * MMA_M);
        assert!(BM % MMA_M == 0 && WARPS % (BM / MMA_M) == 0 && PITCH >= D);
        assert!(DQ_COL_TILES * 8 * (WARPS / (BM / MMA_M)) == D);
        assert!(DQ_COL_TILES % DQ_TILES == 0 && DQ_TILES % 2 == 0);
        assert!(Q_TILES % DP_TILES == 0 && DP_TILES % 2 == 0);
    };
    let (_, kv_head, batch) = ptx::ctaid();
    let mut n = order::block_key_tile::<BN>(p);
    if M::WALK_READS_MEMORY {
        n = order::sparse_key_tile(p, (n, kv_head, batch));
    }
    key_tile::<
        E,
        M,
        D,
        PITCH,
        BN,
        BM,
        WARPS,
        D_SPLIT,
        K_STEPS,
        DKV_TILES,
        Q_TILES,
        KEY_STEPS,
        DQ_COL_TILES,
        DQ_TILES,
        DP_TILES,
        STAGED_DQ,
        DROPOUT,
    >(p, n, kv_head, batch);
}

/// One key tile `n` of the block: the loop of the module docs.
#[inline(always)]
unsafe fn key_tile<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const PITCH: usize,
    const BN: usize,
    const BM: usize,
    const WARPS: usize,
    const D_SPLIT: usize,
    const K_STEPS: usize,
    const DKV_TILES: usize,
    const Q_TILES: usize,
    const KEY_STEPS: usize,
    const DQ_COL_TILES: usize,
    const DQ_TILES: usize,
    const DP_TILES: usize,
    const STAGED_DQ: bool,
    const DROPOUT: bool,
>(
    p: &BwdParams,
    n: u32,
    kv_head: u32,
    batch: u32,
) {
    let me = ThreadPos::current();
    let dims = &p.dims;
    let key0 = n * BN as u32;
    let roles = |warp: u32| WarpRoles::of(warp as usize, (BN, BM, WARPS), DKV_TILES, DQ_COL_TILES);
    let smem = BwdSmem::<BN, BM, PITCH>::at(ptx::dyn_smem_base());
    let kv_block = block_for(p, batch, kv_head, kv_head * (dims.heads_q / dims.heads_kv));
    let k_src = (p.k.ptr as *const u16).add(kv_block.key_offset(&p.k, key0) as usize);
    let v_src = (p.v.ptr as *const u16).add(kv_block.key_offset(&p.v, key0) as usize);
    let keys_left = dims.seqlen_k - key0;
    smem.k
        .load_async::<D, WARPS>(k_src, p.k.strides.row, keys_left, dims.head_dim, me.tid);
    smem.v
        .load_async::<D, WARPS>(v_src, p.v.strides.row, keys_left, dims.head_dim, me.tid);
    let mut cur = next_query_tile::<M, BM, BN, DROPOUT>(p, batch, kv_head, None, n);
    if let Some((head, i)) = cur {
        smem.load_query_tile::<D, WARPS>(p, &block_for(p, batch, kv_head, head), i, 0, me.tid);
    }
    ptx::cp_async_commit_group();
    let lanes = LaneOffsets::new::<PITCH>(me.lane);
    let ds_lanes = LaneOffsets::new::<BM>(me.lane);
    let pos = FragPos::of(me.lane);
    let mut dk = AccTile::<1, DKV_TILES>::zero(); // the warp's 16 keys × its dK columns
    let mut dv = AccTile::<1, DKV_TILES>::zero();
    let mut buf = 0;
    if STAGED_DQ && me.tid == 0 {
        smem.dq_stage::<D>().set_staged_tile(None, 0); // published by barrier (A)
    }
    while let Some((head, i)) = cur {
        let block = block_for(p, batch, kv_head, head);
        let row0 = i * BM as u32;
        ptx::cp_async_wait_group::<0>();
        smem.stats.finish(buf, row0, dims.seqlen_q, me.tid);
        if STAGED_DQ && me.tid == 0 && order::ordered(p) {
            smem.dq_stage::<D>().wait_for_staged_turn(p, batch, n); // before its flush
        }
        ptx::bar_sync(); // (A) tile i (and Kⱼ, Vⱼ) visible to every warp; tile i−1 done
        if STAGED_DQ {
            smem.dq_stage::<D>().flush(p, batch, kv_head, me.tid);
        }
        // `next` is looked up again at the end rather than kept live through the step.
        if let Some((h, i)) =
            next_query_tile::<M, BM, BN, DROPOUT>(p, batch, kv_head, Some((head, i)), n)
        {
            let next_block = block_for(p, batch, kv_head, h);
            smem.load_query_tile::<D, WARPS>(p, &next_block, i, buf ^ 1, me.tid);
            ptx::cp_async_commit_group();
        }
        let (q, d_o) = (smem.q(buf), smem.d_o(buf));
        let mask = M::new(&p.mask, &block);
        if me.tid == 0 && order::ordered(p) {
            order::open_turn::<M, BM, BN>(p, &mask, (batch, head, i), n);
            if STAGED_DQ {
                // The turn tile i passes on once flushed, kept until the stage records it.
                let next = order::next_in_turn::<M, BM, BN>(&mask, i, n);
                ptx::st_shared_u32(smem.dq_stage::<D>().record(StageRecord::PendingNext), next);
            } else {
                order::wait_for_turn::<BM>(p, batch, head, i, n);
            }
        }
        let next_turn = match !STAGED_DQ && me.tid == 0 && order::ordered(p) {
            true => order::next_in_turn::<M, BM, BN>(&mask, i, n),
            false => 0,
        };
        let step_lanes = lanes.step_local();
        // The thread's fragment position and its warp's roles, from the thread index made
        // opaque per step: what derives from them (dSᵀ store addresses, dQ rows, column
        // slices) is recomputed each step rather than hoisted out of the loop into registers.
        let tid_s = ptx::opaque_u32(me.tid);
        let pos_s = FragPos::of(tid_s % 32);
        let WarpRoles {
            warp_k0,
            dkv_pair0,
            dq_r0,
            dq_pair0,
        } = roles(tid_s / 32);
        let warp_keys = |tile| SmemRows { tile, m0: warp_k0 };
        // Sᵀ = Kⱼ·Qᵢᵀ, then Pᵀ (masked before the exponential).
        let mut pt = AccTile::<1, Q_TILES>::zero();
        mma_abt::<E, 1, Q_TILES, K_STEPS, BM, PITCH>(&mut pt, &warp_keys(smem.k), q, &step_lanes);
        // Masks that modify scores: Sᵀ becomes the logits, and `grad` keeps d logit / d s
        // for dS (the compiler drops it for the others; a window alone modifies nothing).
        let modifies = M::MODIFIES_SCORES && mask.modifies_scores();
        let mut grad = AccTile::<1, Q_TILES>::zero();
        if modifies {
            // One branch per step on the cap, none per score.
            let slope = M::slope(&p.mask, batch, head);
            let at = (row0, key0 + warp_k0 as u32, pos_s);
            if mask.capped() {
                logits_and_grads::<M, true, Q_TILES>(&mut pt, &mut grad, &mask, slope, at);
            } else {
                logits_and_grads::<M, false, Q_TILES>(&mut pt, &mut grad, &mask, slope, at);
            }
        }
        // Pᵀ; scores the mask hides are zeroed afterwards, only in tiles that cross its edge.
        smem.stats.probabilities(&mut pt, buf, pos_s, p.scale_log2);
        if mask.tile_needs_mask(row0, BM as u32, n, BN as u32) {
            let key_base = key0 + warp_k0 as u32;
            pt.for_each_mut(|_, r, nt, c, x| {
                if !mask.visible(row0 + pos_s.col(nt, c), key_base + pos_s.row(0, r)) {
                    *x = 0.0;
                }
            });
        }
        // Pᵀ in 16 bits from here on: it is the `mma` operand, and keeping it packed frees
        // registers for dPᵀ (dS = P ∘ (dP − D) uses the rounded P). Dropout marks it packed.
        let mut pt = PackedTile::pack::<E>(&pt);
        if DROPOUT {
            let rng = rng_for(&p.dropout, batch, head, dims.heads_q);
            mark_dropped(&rng, &mut pt, key0 + warp_k0 as u32, row0, pos_s);
        }
        let pt = pt;
        let (d_o_cols, dkv_lanes) = d_o.kn_slice(&step_lanes, dkv_pair0, DKV_TILES / 2);
        if DROPOUT {
            let kept = NonNegative(&pt); // P ∘ Z: the dropped (negated) probabilities read as 0
            mma_pb::<E, 1, Q_TILES, DKV_TILES, BM, PITCH>(&mut dv, &kept, d_o_cols, &dkv_lanes, 0);
        } else {
            mma_pb::<E, 1, Q_TILES, DKV_TILES, BM, PITCH>(&mut dv, &pt, d_o_cols, &dkv_lanes, 0);
        }
        // dPᵀ = Vⱼ·dOᵢᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − D), dKⱼ += dSᵀ·Qᵢ and dSᵀ → shared, `DP_TILES`
        // query columns of 8 at a time (fewer live registers for large head dims).
        let (q_cols, _) = q.kn_slice(&step_lanes, dkv_pair0, DKV_TILES / 2);
        for part in 0..Q_TILES / DP_TILES {
            let c0 = part * DP_TILES * 8;
            let mut ds = AccTile::<1, DP_TILES>::zero();
            mma_abt::<E, 1, DP_TILES, K_STEPS, BM, PITCH>(
                &mut ds,
                &warp_keys(smem.v),
                d_o.rows_from(c0),
                &step_lanes,
            );
            ds.for_each_mut(|mt, r, nt, c, x| {
                let prob = pt.get::<E>(mt, r, part * DP_TILES + nt, c);
                let delta = smem.stats.delta(buf, (c0 as u32) + pos_s.col(nt, c));
                *x = d_score::<DROPOUT>(prob, *x, delta, p.dropout.scale);
                if modifies {
                    *x *= grad.get(mt, r, part * DP_TILES + nt, c);
                }
            });
            let ds = PackedTile::pack::<E>(&ds);
            let q_part = q_cols.rows_from(c0);
            mma_pb::<E, 1, DP_TILES, DKV_TILES, BM, PITCH>(&mut dk, &ds, q_part, &dkv_lanes, 0);
            if dkv_pair0 == 0 {
                for r in 0..2 {
                    for nt in 0..DP_TILES {
                        let (row, col) = (warp_k0 as u32 + pos_s.row(0, r), pos_s.col(nt, 0));
                        smem.ds.store_pair(row, c0 as u32 + col, ds.pair(0, r, nt));
                    }
                }
            }
        }
        if STAGED_DQ {
            DqStage::<BM, D>::wait_flushed(p); // the stage's last flush has read it
        }
        ptx::bar_sync(); // (B) dSᵀ complete; the dQ stage free
        if STAGED_DQ && me.tid == 0 && order::ordered(p) {
            smem.dq_stage::<D>().pass_staged_turn(p, batch); // the tile flushed at (A)
        }
        // dQᵢ (the warp's 16 rows, its column slice) += scale·dS·Kⱼ, `DQ_TILES` at a time.
        let ds_rows = SmemCols {
            tile: smem.ds,
            m0: dq_r0,
            lanes: ds_lanes.step_local(),
        };
        let (k_cols, dq_lanes) = smem.k.kn_slice(&step_lanes, dq_pair0, DQ_COL_TILES / 2);
        // The accumulator is padded to whole query tiles and the compiled head dim (see
        // `BwdParams::dq_accum`): the adds need no bounds checks.
        for chunk in 0..DQ_COL_TILES / DQ_TILES {
            let mut dq = AccTile::<1, DQ_TILES>::zero();
            let np0 = chunk * DQ_TILES / 2;
            mma_ab::<E, 1, DQ_TILES, KEY_STEPS, BN, PITCH>(
                &mut dq, &ds_rows, k_cols, &dq_lanes, np0,
            );
            for r in 0..2 {
                let row = dq_r0 as u32 + pos_s.row(0, r);
                let row_at = block.query_offset(&p.dq_accum, row0 + row);
                let row_at = (p.dq_accum.ptr as *mut f32).add(row_at as usize);
                for dt in 0..DQ_TILES {
                    let col = 16 * dq_pair0 as u32 + pos_s.col(chunk * DQ_TILES + dt, 0);
                    let [x0, x1] = dq.pair(0, r, dt);
                    let (x0, x1) = (x0 * p.scale, x1 * p.scale);
                    if STAGED_DQ {
                        ptx::st_shared_v2_f32(smem.dq_stage::<D>().addr(row, col), x0, x1);
                    } else {
                        ptx::red_global_add_f32x2(row_at.add(col as usize), x0, x1);
                    }
                }
            }
        }
        if STAGED_DQ {
            ptx::fence_proxy_async_shared_cta(); // the stage, for the bulk engine
            if me.tid == 0 {
                let next =
                    ptx::ld_shared_u32(smem.dq_stage::<D>().record(StageRecord::PendingNext));
                smem.dq_stage::<D>().set_staged_tile(Some((head, i)), next);
            }
        } else if order::ordered(p) {
            ptx::bar_sync(); // every warp's adds to tile i are done
            if me.tid == 0 {
                order::pass_turn_to::<BM>(p, (batch, head, i), next_turn);
            }
        }
        cur = next_query_tile::<M, BM, BN, DROPOUT>(p, batch, kv_head, Some((head, i)), n);
        buf ^= 1;
    }
    ptx::cp_async_wait_group::<0>(); // Kⱼ, Vⱼ landed even if no query tile saw them
    if STAGED_DQ {
        if me.tid == 0 && order::ordered(p) {
            smem.dq_stage::<D>().wait_for_staged_turn(p, batch, n);
        }
        ptx::bar_sync(); // every warp's part of the last tile's dQ is staged
        smem.dq_stage::<D>().flush(p, batch, kv_head, me.tid);
    }
    // dK and dV leave while the bulk engine adds the last tile's dQ.
    let WarpRoles {
        warp_k0, dkv_pair0, ..
    } = roles(me.warp);
    let key_base = key0 + warp_k0 as u32;
    let col0 = 16 * dkv_pair0 as u32;
    store_dkv::<E, DKV_TILES, DROPOUT>(p, &kv_block, key_base, col0, pos, &dk, &dv);
    if STAGED_DQ {
        smem.dq_stage::<D>().finish(p, batch, me.tid);
    }
}

/// Writes a warp's `scale·dK` and dV (`·1/(1 − p)` with dropout) of its 16 keys from
/// `key_base` and its columns from `col0` (16-byte stores after a transpose within each quad,
/// [`store_rows_by_quads`]), skipping keys past the sequence and columns past the head dim.
///
/// # Safety
/// The whole warp calls it; `kv_block` and `p` describe the launch's validated dK and dV.
#[inline(always)]
unsafe fn store_dkv<E: Elem, const DT: usize, const DROPOUT: bool>(
    p: &BwdParams,
    kv_block: &BlockInfo,
    key_base: u32,
    col0: u32,
    pos: FragPos,
    dk: &AccTile<1, DT>,
    dv: &AccTile<1, DT>,
) {
    let dims = &p.dims;
    let dv_scale = if DROPOUT { p.dropout.scale } else { 1.0 };
    let (head_dim, quad_lane) = (dims.head_dim, pos.quad_lane());
    for (t, tile, scale) in [(&p.dk, dk, p.scale), (&p.dv, dv, dv_scale)] {
        store_rows_by_quads::<E, DT>(tile, [scale; 2], quad_lane, |r, col, words, cols| {
            let key = key_base + pos.row(0, r);
            if key < dims.seqlen_k {
                let offset = kv_block.key_offset(t, key);
                store_row_chunk(t.ptr as *mut u16, offset, col0 + col, words, cols, head_dim);
            }
        });
    }
}

/// dS of one score from its probability `prob`, dP and D: `P·(dP − D)`; with dropout the
/// kept probabilities (P ≥ 0) give `P·(dP/(1 − p) − D)` (`keep_scale` = 1/(1 − p)) and the
/// dropped ones (stored as −P, see [`mark_dropped`]) `−P·D`.
#[inline(always)]
fn d_score<const DROPOUT: bool>(prob: f32, dp: f32, delta: f32, keep_scale: f32) -> f32 {
    match DROPOUT {
        true if prob >= 0.0 => prob * (dp * keep_scale - delta),
        true => prob * delta,
        false => prob * (dp - delta),
    }
}

/// What one warp of the block owns: its 16 keys (from `warp_k0`) and slice of dK/dV columns
/// (column pairs from `dkv_pair0`), and its 16 dQ rows (from `dq_r0`) and dQ column slice
/// (column pairs from `dq_pair0`); see the module docs.
#[derive(Clone, Copy)]
struct WarpRoles {
    warp_k0: usize,
    dkv_pair0: usize,
    dq_r0: usize,
    dq_pair0: usize,
}

impl WarpRoles {
    /// The roles of warp `warp` in a block of `(BN, BM, WARPS)`, with `dkv_tiles` and
    /// `dq_col_tiles` 8-column tiles of dK/dV and of dQ per warp.
    #[inline(always)]
    fn of(
        warp: usize,
        block: (usize, usize, usize),
        dkv_tiles: usize,
        dq_col_tiles: usize,
    ) -> Self {
        let (bn, bm, warps) = block;
        let (key_warps, row_groups) = (bn / MMA_M, bm / MMA_M);
        Self {
            warp_k0: (warp % key_warps) * MMA_M,
            dkv_pair0: (warp / key_warps) * dkv_tiles / 2,
            dq_r0: (warp % row_groups) * MMA_M,
            dq_pair0: if warps == row_groups {
                0
            } else {
                (warp / row_groups) * dq_col_tiles / 2
            },
        }
    }
}

/// The rows of query head `head` (of KV head `kv_head`'s group) in batch entry `batch`.
#[inline(always)]
fn block_for(p: &BwdParams, batch: u32, kv_head: u32, head: u32) -> BlockInfo {
    let dims = &p.dims;
    BlockInfo {
        batch,
        head,
        kv_head,
        row0: 0,
        seqlen_q: dims.seqlen_q,
        seqlen_k: dims.seqlen_k,
    }
}

/// Turns a warp's raw scores Sᵀ (16 keys from `key_base` × the query tile from `row0`) into
/// the mask's logits and `grad` into their derivatives ([`AttnMask::score_and_grad_as`] with
/// `CAP`).
#[inline(always)]
fn logits_and_grads<M: AttnMask, const CAP: bool, const Q_TILES: usize>(
    pt: &mut AccTile<1, Q_TILES>,
    grad: &mut AccTile<1, Q_TILES>,
    mask: &M,
    slope: f32,
    (row0, key_base, pos): (u32, u32, FragPos),
) {
    pt.for_each_mut(|_, r, nt, c, x| {
        let (row, key) = (row0 + pos.col(nt, c), key_base + pos.row(0, r));
        let (logit, g) = mask.score_and_grad_as::<CAP>(row, key, *x, slope);
        *x = logit;
        grad.set(0, r, nt, c, g);
    });
}

/// The query tile after `after` (`None`: the first) among those of the KV head's query heads
/// that see key tile `n`, as `(query head, tile index)`; heads in order, tiles in order.
/// `LEAN` as in [`AttnMask::query_tile_at_or_after`] (the `mma.sync` kernels pass their
/// `DROPOUT`: their general mask's jump spilled with dropout). Where the mask's walk reads
/// memory, the result comes through lane 0 ([`ptx::warp_uniform_tile`]).
///
/// # Safety
/// Every lane of the warp calls it, with the same arguments.
#[inline(always)]
unsafe fn next_query_tile<M: AttnMask, const BM: usize, const BN: usize, const LEAN: bool>(
    p: &BwdParams,
    batch: u32,
    kv_head: u32,
    after: Option<(u32, u32)>,
    n: u32,
) -> Option<(u32, u32)> {
    let found = walk_query_tiles::<M, BM, BN, LEAN>(p, batch, kv_head, after, n);
    if !M::WALK_READS_MEMORY {
        return found;
    }
    let i = ptx::warp_uniform_tile(found.map(|(_, i)| i))?;
    let head = ptx::shfl_sync_idx_u32(found.map_or(0, |(head, _)| head), 0);
    Some((head, i))
}

/// [`next_query_tile`]'s walk.
#[inline(always)]
fn walk_query_tiles<M: AttnMask, const BM: usize, const BN: usize, const LEAN: bool>(
    p: &BwdParams,
    batch: u32,
    kv_head: u32,
    after: Option<(u32, u32)>,
    n: u32,
) -> Option<(u32, u32)> {
    let dims = &p.dims;
    let group = dims.heads_q / dims.heads_kv;
    let (mut head, mut i) = match after {
        Some((head, i)) => (head, i + 1),
        None => (kv_head * group, 0),
    };
    while head < (kv_head + 1) * group {
        // SAFETY: the launch's host-validated mask arguments.
        let mask = unsafe { M::new(&p.mask, &block_for(p, batch, kv_head, head)) };
        if let Some(i) = mask.query_tile_at_or_after::<LEAN>(i, BM as u32, n, BN as u32) {
            return Some((head, i));
        }
        head += 1;
        i = 0;
    }
    None
}

/// The backward block's shared memory; see the module docs.
#[derive(Clone, Copy)]
struct BwdSmem<const BN: usize, const BM: usize, const PITCH: usize> {
    k: SmemTile<BN, PITCH>,
    v: SmemTile<BN, PITCH>,
    /// Two buffers of Q, then two of dO.
    q_do: u32,
    /// dSᵀ `[BN][BM]`.
    ds: SmemTile<BN, BM>,
    /// Two buffers of `BM` f32 LSE·log2 e then `BM` f32 D.
    stats: QueryStats<BM>,
    /// The dQ stage `[BM][D + 8]` f32 (tiles with `staged_dq` only).
    dq_stage: u32,
}

impl<const BN: usize, const BM: usize, const PITCH: usize> BwdSmem<BN, BM, PITCH> {
    const QTILE: u32 = SmemTile::<BM, PITCH>::BYTES;

    #[inline(always)]
    fn at(base: u32) -> Self {
        let kv = SmemTile::<BN, PITCH>::BYTES;
        let q_do = base + 2 * kv;
        let ds = q_do + 4 * Self::QTILE;
        Self {
            k: SmemTile::at(base),
            v: SmemTile::at(base + kv),
            q_do,
            ds: SmemTile::at(ds),
            stats: QueryStats::at(ds + SmemTile::<BN, BM>::BYTES),
            dq_stage: ds + SmemTile::<BN, BM>::BYTES + QueryStats::<BM>::BYTES,
        }
    }

    /// Q of buffer `buf`.
    #[inline(always)]
    fn q(&self, buf: u32) -> SmemTile<BM, PITCH> {
        SmemTile::at(self.q_do + buf * Self::QTILE)
    }

    /// dO of buffer `buf`.
    #[inline(always)]
    fn d_o(&self, buf: u32) -> SmemTile<BM, PITCH> {
        SmemTile::at(self.q_do + (2 + buf) * Self::QTILE)
    }

    /// The dQ stage (tiles with `staged_dq` only).
    #[inline(always)]
    fn dq_stage<const D: usize>(&self) -> DqStage<BM, D> {
        DqStage::at(self.dq_stage)
    }

    /// Issues the copies of query tile `i` into buffer `buf`: Q and dO (rows past the
    /// sequence zero-filled) and the raw LSE and D of those rows (zero-filled past the
    /// sequence); the caller commits them. [`QueryStats::finish`] completes the LSE slots.
    #[inline(always)]
    unsafe fn load_query_tile<const D: usize, const WARPS: usize>(
        &self,
        p: &BwdParams,
        block: &BlockInfo,
        i: u32,
        buf: u32,
        tid: u32,
    ) {
        let dims = &p.dims;
        let row0 = i * BM as u32;
        let rows_left = dims.seqlen_q - row0;
        let q = (p.q.ptr as *const u16).add(block.query_offset(&p.q, row0) as usize);
        let d_o = (p.d_o.ptr as *const u16).add(block.query_offset(&p.d_o, row0) as usize);
        self.q(buf)
            .load_async::<D, WARPS>(q, p.q.strides.row, rows_left, dims.head_dim, tid);
        self.d_o(buf)
            .load_async::<D, WARPS>(d_o, p.d_o.strides.row, rows_left, dims.head_dim, tid);
        self.stats.load(p, block, row0, buf, tid);
    }
}
