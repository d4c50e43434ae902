//! Backward attention: FlashAttention 2's backward (the FlashAttention paper's Algorithm 4 with
//! the dot(dO, O) pre-pass), key tiles outside, query tiles inside.
//!
//! One block owns `BN = 16·WARPS` keys of one (KV head, batch) and walks, for every query head
//! of its group (GQA), the query tiles of `BM = 16·WARPS` rows that see those keys:
//!
//! ```text
//! load Kⱼ, Vⱼ                                   global → shared, once
//! dKⱼ = dVⱼ = 0                                 registers (each warp: its 16 keys × D)
//! for each query head h of the group, each query tile i that sees tile j:
//!     load Qᵢ, dOᵢ; LSEᵢ·log2 e and Dᵢ          shared (rows past the sequence or with
//!                                               LSE = −∞ get an infinite LSE: P = 0)
//!     Sᵀ = Kⱼ·Qᵢᵀ                               mma.sync, f32; per warp 16 keys × BM queries
//!     Pᵀ = 2^(c·Sᵀ − LSE·log2 e)                masked scores are 0 before the exponential
//!     dVⱼ += Pᵀ·dOᵢ                             Pᵀ straight from registers
//!     dPᵀ = Vⱼ·dOᵢᵀ;  dSᵀ = Pᵀ ∘ (dPᵀ − Dᵢ)
//!     dKⱼ += dSᵀ·Qᵢ                             dSᵀ straight from registers
//!     dSᵀ → shared; bar.sync
//!     dQᵢ += scale·dS·Kⱼ                        each warp 16 query rows; f32 atomic adds
//!     bar.sync
//! write scale·dKⱼ and dVⱼ
//! ```
//!
//! Shared memory (see [`crate::config::BwdTile::smem_bytes`]): K, V `[BN][PITCH]`, Q, dO
//! `[BM][PITCH]`, dSᵀ `[BN][BM]` (all swizzled, 16-bit), LSE and D `[BM]` f32. Registers per
//! thread: dK and dV `D/2` f32 each, Sᵀ/Pᵀ and dPᵀ/dSᵀ `BM/2` f32 each, a dQ slice of
//! `DQ_TILES·4` f32.
//! Sync points: two `bar.sync` per query tile (after its loads, after dSᵀ is in shared memory)
//! and one before the next tile's loads overwrite shared memory.

mod dq;
mod passes;

pub use dq::flash_bwd_dq;
pub use passes::{bwd_convert_dq, bwd_prep};

use super::elem::Elem;
use super::frag::{AccTile, FragPos, ThreadPos};
use super::gemm::{mma_ab, mma_abt, mma_pb, SmemCols, SmemRows};
use super::ptx;
use super::tile::{LaneOffsets, SmemTile};
use crate::block::BlockInfo;
use crate::config::MMA_M;
use crate::mask::AttnMask;
use crate::params::BwdParams;

/// `log2(e)`: converts the natural-log LSE into the base-2 domain of the exponent.
pub(super) const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// The backward kernel body for any mask type `M`; see the module docs. Const parameters: `D`
/// compiled head dim, `PITCH` shared row length of the Q/K/V/dO tiles, `BN` keys per block,
/// `BM` queries per step, `WARPS`, and the derived counts `K_STEPS = D/16`, `D_TILES = D/8`,
/// `Q_TILES = BM/8`, `KEY_STEPS = BN/16`, and `DQ_TILES`, the 8-column tiles of dQ computed
/// at a time (fewer than `D_TILES` keeps registers for d > 64; passed by the registry,
/// checked here).
///
/// # Safety
/// Launched with grid `(ceil(seqlen_k / BN), heads_kv, batch)`, `32·WARPS` threads and
/// `BwdTile::smem_bytes()` bytes of dynamic shared memory, after the pre-pass wrote D and with
/// `dq_accum` zeroed, on parameters the host validated.
#[inline(always)]
pub unsafe fn flash_bwd<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const PITCH: usize,
    const BN: usize,
    const BM: usize,
    const WARPS: usize,
    const K_STEPS: usize,
    const D_TILES: usize,
    const Q_TILES: usize,
    const KEY_STEPS: usize,
    const DQ_TILES: usize,
>(
    p: &BwdParams,
) {
    const {
        assert!(K_STEPS * 16 == D && D_TILES * 8 == D && Q_TILES * 8 == BM && KEY_STEPS * 16 == BN);
        assert!(D_TILES % DQ_TILES == 0 && DQ_TILES % 2 == 0);
        assert!(BN == WARPS * MMA_M && BM == WARPS * MMA_M && PITCH >= D);
    };
    let me = ThreadPos::current();
    let (n, kv_head, batch) = ptx::ctaid();
    let dims = &p.dims;
    let (key0, group) = (n * BN as u32, dims.heads_q / dims.heads_kv);
    let warp_k0 = me.warp as usize * MMA_M; // the warp's keys (and, for dQ, its query rows)
    let smem = BwdSmem::<BN, BM, PITCH>::at(ptx::dyn_smem_base());
    let block_of = |head| BlockInfo {
        batch,
        head,
        kv_head,
        row0: 0,
        seqlen_q: dims.seqlen_q,
        seqlen_k: dims.seqlen_k,
    };
    let kv_block = block_of(kv_head * group);
    let k_src = (p.k.ptr as *const u16).add(kv_block.key_offset(&p.k, key0) as usize);
    let v_src = (p.v.ptr as *const u16).add(kv_block.key_offset(&p.v, key0) as usize);
    let keys_left = dims.seqlen_k - key0;
    smem.k
        .load_async::<D, WARPS>(k_src, p.k.strides.row, keys_left, dims.head_dim, me.tid);
    smem.v
        .load_async::<D, WARPS>(v_src, p.v.strides.row, keys_left, dims.head_dim, me.tid);
    ptx::cp_async_commit_group();
    let lanes = LaneOffsets::new::<PITCH>(me.lane);
    let ds_lanes = LaneOffsets::new::<BM>(me.lane);
    let pos = FragPos::of(me.lane);
    let mut dk = AccTile::<1, D_TILES>::zero(); // dKⱼ: 16 keys × D per warp
    let mut dv = AccTile::<1, D_TILES>::zero(); // dVⱼ
    for head in kv_head * group..(kv_head + 1) * group {
        let block = block_of(head);
        let mask = M::new(&p.mask, &block);
        for i in 0..dims.seqlen_q.div_ceil(BM as u32) {
            let row0 = i * BM as u32;
            if !mask.visits_key_tile(row0, BM as u32, n, BN as u32) {
                continue;
            }
            smem.load_query_tile::<E, D, WARPS>(p, &block, row0, me.tid);
            ptx::bar_sync(); // Qᵢ, dOᵢ, LSE, D (and Kⱼ, Vⱼ) visible to every warp
            let step_lanes = lanes.step_local();
            let pos_s = FragPos::of(ptx::opaque_u32(me.lane));
            let warp_keys = |tile| SmemRows { tile, m0: warp_k0 };
            // Sᵀ = Kⱼ·Qᵢᵀ, then Pᵀ (masked before the exponential).
            let mut pt = AccTile::<1, Q_TILES>::zero();
            mma_abt::<E, 1, Q_TILES, K_STEPS, BM, PITCH>(
                &mut pt,
                &warp_keys(smem.k),
                smem.q,
                &step_lanes,
            );
            let masked = mask.tile_needs_mask(row0, BM as u32, n, BN as u32);
            pt.for_each_mut(|_, r, nt, c, x| {
                let (key, col) = (key0 + (warp_k0 as u32) + pos_s.row(0, r), pos_s.col(nt, c));
                let keep = !masked || mask.visible(row0 + col, key);
                let lse2 = smem.lse2(col);
                *x = if keep {
                    ptx::ex2_approx_ftz(ptx::fma_rn_f32(*x, p.scale_log2, -lse2))
                } else {
                    0.0
                };
            });
            mma_pb::<E, 1, Q_TILES, D_TILES, BM, PITCH>(&mut dv, &pt, smem.d_o, &step_lanes);
            // dPᵀ = Vⱼ·dOᵢᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − D).
            let mut ds = AccTile::<1, Q_TILES>::zero();
            mma_abt::<E, 1, Q_TILES, K_STEPS, BM, PITCH>(
                &mut ds,
                &warp_keys(smem.v),
                smem.d_o,
                &step_lanes,
            );
            ds.for_each_mut(|mt, r, nt, c, x| {
                *x = pt.get(mt, r, nt, c) * (*x - smem.delta(pos_s.col(nt, c)));
            });
            mma_pb::<E, 1, Q_TILES, D_TILES, BM, PITCH>(&mut dk, &ds, smem.q, &step_lanes);
            for r in 0..2 {
                for nt in 0..Q_TILES {
                    let [x0, x1] = ds.pair(0, r, nt);
                    let row = warp_k0 as u32 + pos.row(0, r);
                    smem.ds.store_pair(row, pos.col(nt, 0), E::pack(x0, x1));
                }
            }
            ptx::bar_sync(); // dSᵀ complete
                             // dQᵢ (the warp's 16 query rows) += scale·dS·Kⱼ, `DQ_TILES` columns at a time.
            let ds_rows = SmemCols {
                tile: smem.ds,
                m0: warp_k0,
                lanes: ds_lanes.step_local(),
            };
            let dq_row0 = row0 + warp_k0 as u32;
            let dq_base = p.dq_accum.ptr as *mut f32;
            for chunk in 0..D_TILES / DQ_TILES {
                let mut dq = AccTile::<1, DQ_TILES>::zero();
                let np0 = chunk * DQ_TILES / 2;
                mma_ab::<E, 1, DQ_TILES, KEY_STEPS, BN, PITCH>(
                    &mut dq,
                    &ds_rows,
                    smem.k,
                    &step_lanes,
                    np0,
                );
                dq.for_each_mut(|_, r, dt, c, x| {
                    let (row, col) = (dq_row0 + pos.row(0, r), pos.col(chunk * DQ_TILES + dt, c));
                    if row < dims.seqlen_q && col < dims.head_dim {
                        let at = block.query_offset(&p.dq_accum, row) + col as u64;
                        ptx::red_global_add_f32(dq_base.add(at as usize), *x * p.scale);
                    }
                });
            }
            ptx::bar_sync(); // every warp is done with Qᵢ, dOᵢ, dSᵀ before the next loads
        }
    }
    ptx::cp_async_wait_group::<0>(); // Kⱼ, Vⱼ landed even if no query tile saw them
    for r in 0..2 {
        let key = key0 + warp_k0 as u32 + pos.row(0, r);
        if key >= dims.seqlen_k {
            continue;
        }
        let dk_dst = (p.dk.ptr as *mut u16).add(kv_block.key_offset(&p.dk, key) as usize);
        let dv_dst = (p.dv.ptr as *mut u16).add(kv_block.key_offset(&p.dv, key) as usize);
        for dt in 0..D_TILES {
            let col = pos.col(dt, 0);
            if col < dims.head_dim {
                let [k0, k1] = dk.pair(0, r, dt);
                let [v0, v1] = dv.pair(0, r, dt);
                *(dk_dst.add(col as usize) as *mut u32) = E::pack(k0 * p.scale, k1 * p.scale);
                *(dv_dst.add(col as usize) as *mut u32) = E::pack(v0, v1);
            }
        }
    }
}

/// The backward block's shared memory; see the module docs.
#[derive(Clone, Copy)]
struct BwdSmem<const BN: usize, const BM: usize, const PITCH: usize> {
    k: SmemTile<BN, PITCH>,
    v: SmemTile<BN, PITCH>,
    q: SmemTile<BM, PITCH>,
    d_o: SmemTile<BM, PITCH>,
    /// dSᵀ `[BN][BM]`.
    ds: SmemTile<BN, BM>,
    /// LSE·log2 e, then D: `BM` f32 each.
    stats: u32,
}

impl<const BN: usize, const BM: usize, const PITCH: usize> BwdSmem<BN, BM, PITCH> {
    #[inline(always)]
    fn at(base: u32) -> Self {
        let kv = SmemTile::<BN, PITCH>::BYTES;
        let q = SmemTile::<BM, PITCH>::BYTES;
        Self {
            k: SmemTile::at(base),
            v: SmemTile::at(base + kv),
            q: SmemTile::at(base + 2 * kv),
            d_o: SmemTile::at(base + 2 * kv + q),
            ds: SmemTile::at(base + 2 * kv + 2 * q),
            stats: base + 2 * kv + 2 * q + SmemTile::<BN, BM>::BYTES,
        }
    }

    /// LSE·log2 e of query `col` of the current tile (+∞ for rows past the sequence and rows
    /// that saw no key, so that their P is 0).
    #[inline(always)]
    unsafe fn lse2(&self, col: u32) -> f32 {
        ptx::ld_shared_f32(self.stats + 4 * col)
    }

    /// D of query `col` of the current tile.
    #[inline(always)]
    unsafe fn delta(&self, col: u32) -> f32 {
        ptx::ld_shared_f32(self.stats + 4 * (BM as u32 + col))
    }

    /// Starts the loads of Qᵢ and dOᵢ (rows `row0..`) and writes LSE·log2 e and D of those
    /// rows; returns after the copies completed (the caller publishes them with a barrier).
    #[inline(always)]
    unsafe fn load_query_tile<E: Elem, const D: usize, const WARPS: usize>(
        &self,
        p: &BwdParams,
        block: &BlockInfo,
        row0: u32,
        tid: u32,
    ) {
        let dims = &p.dims;
        let rows_left = dims.seqlen_q - row0;
        let q = (p.q.ptr as *const u16).add(block.query_offset(&p.q, row0) as usize);
        let d_o = (p.d_o.ptr as *const u16).add(block.query_offset(&p.d_o, row0) as usize);
        self.q
            .load_async::<D, WARPS>(q, p.q.strides.row, rows_left, dims.head_dim, tid);
        self.d_o
            .load_async::<D, WARPS>(d_o, p.d_o.strides.row, rows_left, dims.head_dim, tid);
        ptx::cp_async_commit_group();
        if (tid as usize) < BM {
            let row = row0 + tid;
            let (mut lse2, mut delta) = (f32::INFINITY, 0.0);
            if row < dims.seqlen_q {
                let lse =
                    *(p.lse.ptr as *const f32).add(block.row_stat_offset(&p.lse, row) as usize);
                if lse != f32::NEG_INFINITY {
                    lse2 = lse * LOG2_E;
                }
                delta =
                    *(p.delta.ptr as *const f32).add(block.row_stat_offset(&p.delta, row) as usize);
            }
            ptx::st_shared_f32(self.stats + 4 * tid, lse2);
            ptx::st_shared_f32(self.stats + 4 * (BM as u32 + tid), delta);
        }
        ptx::cp_async_wait_group::<0>();
    }
}
