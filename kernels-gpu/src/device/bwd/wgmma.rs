//! Backward attention on Hopper (sm_90a): the loop of [`super::flash_bwd`] (key tiles
//! outside, query tiles inside, dK and dV on chip, dQ through a shared stage and the bulk
//! engine's f32 adds) with its five products on `wgmma`, and the same masks, dropout and
//! deterministic mode.
//!
//! Block: 256 threads, two warpgroups. The block owns `BN = 128` keys of one (KV head,
//! batch), 64 per warpgroup: warp `w` holds keys `16w .. 16w + 16` in the `mma.m16n8k16`
//! accumulator layout that `wgmma` shares (so the register-tile layer, masks and dropout are
//! those of the `mma.sync` kernel). Query tiles have `BM` rows (128 at d = 64, 64 at
//! d = 128: dK and dV take `D/2` f32 registers each per thread; 64 at d = 64 with dropout,
//! whose generator needs the registers).
//!
//! ```text
//! load Kⱼ, Vⱼ; dKⱼ = dVⱼ = 0                   cp.async; registers
//! start loading query tile 0: Q, dO, LSE, D   cp.async into buffer 0
//! for each query tile i (every query head of the group) that sees tile j:
//!     wait; fence.proxy.async; bar.sync       (A) tile i visible; tile i−1 finished, its
//!                                             dQ staged (deterministic mode: thread 0
//!                                             first waits for that tile's turn)
//!     issue Sᵀ = Kⱼ·Qᵢᵀ, dPᵀ = Vⱼ·dOᵢᵀ          m64nBMk16, both operands K-major in shared
//!                                             (BM = 128: dPᵀ only after Pᵀ, with dV)
//!     start the bulk add of tile i−1's dQ      a stage row per flushing thread (see
//!                                             `flush_row`), stage → accumulator, while
//!                                             they run
//!     start loading tile i+1                  into the other buffer, while they run
//!                                             (block-sparse: tile i+1 from the walk's
//!                                             look-ahead slot, which the last warp filled
//!                                             in the step before; it then walks to the
//!                                             tile after i+1 into the other slot)
//!     wait for Sᵀ; Pᵀ = 2^(c·Sᵀ − LSE·log2 e)  hidden scores zeroed in edge tiles; dropout
//!                                             marks dropped ones by their sign
//!     issue dVⱼ += (Pᵀ ∘ Z)·dOᵢ                m64nDk16 (m64n64k16 per 64 columns below
//!                                             d = 128), Pᵀ from registers, dO MN-major
//!     wait for dPᵀ; dSᵀ = Pᵀ ∘ (dPᵀ − Dᵢ)
//!     issue dKⱼ += dSᵀ·Qᵢ                      as dV, Q MN-major
//!     dSᵀ → shared; fence.proxy.async; wait until the bulk add read the stage; bar.sync
//!                                             (B) dSᵀ of both warpgroups complete, the
//!                                             stage free (deterministic mode: thread 0
//!                                             passes tile i−1's turn)
//!     issue dQᵢ = dS·Kⱼ                        m64n64k16 per warpgroup, both operands
//!                                             MN-major (dSᵀ read transposed): its 64 query
//!                                             rows at d = 64, its 64 columns at d = 128
//!                                             (BM = d = 64: the whole tile; warpgroup 0 adds)
//!     find the tile after i                   while dQᵢ runs
//!     wait for all; scale·dQᵢ → the stage     st.shared.v2; fence.proxy.async
//! bar.sync; bulk add of the last tile's dQ
//! write scale·dKⱼ and dVⱼ [·1/(1 − p)]        16-byte stores after a transpose in each
//!                                             quad, while the add runs; wait until it
//!                                             read the stage
//! ```
//!
//! Shared memory (dynamic, 1024-byte aligned; the layout and size of
//! [`crate::config::BwdTile::smem_bytes`] with the head dim as pitch): K, V `[BN][D]`, two
//! buffers of Q and of dO `[BM][D]`, dSᵀ `[BN][BM]`, all in the layout of [`crate::gmma`], then
//! two buffers of LSE and D `[BM]` f32, then the dQ stage `[BM][D + 8]` f32 ([`DqStage`], its
//! record of the staged tile and the walk's two look-ahead slots in the first row's padding), then the block's record of its (KV
//! head, batch) and key tile ([`BlockRecord`], written by thread 0 before a first barrier).
//! Registers per thread: dK and dV `D/2` f32 each, Sᵀ/Pᵀ and dPᵀ/dSᵀ `BM/2` f32 each, dQ 32
//! f32. Sync points: one `bar.sync` at the start (the record), two per query tile, (A) and
//! (B), one after the loop (two in deterministic mode); each warpgroup waits for its own
//! products only. Writes the async proxy reads (the `cp.async` tiles, dSᵀ, the dQ stage) are
//! fenced by their writers (`fence.proxy.async`) before the barrier that publishes them.

use super::dq_stage::{DqStage, StageRecord};
use super::stats::QueryStats;
use super::{block_for, d_score, next_query_tile, order, store_dkv};
use crate::block::BlockInfo;
use crate::device::dropout::{draw_marks, mark_drawn, mark_dropped, rng_for};
use crate::device::elem::Elem;
use crate::device::frag::{AccTile, FragPos, NonNegative, PackedTile, RegFragments, ThreadPos};
use crate::device::ptx;
use crate::device::tile::GmmaTile;
use crate::gmma::BLOCK_COLS;
use crate::mask::AttnMask;
use crate::params::BwdParams;

/// Keys per block (two warpgroups of 64).
pub const BN: usize = 128;
/// Warps per block.
pub const WARPS: usize = 8;
/// Keys per warpgroup.
const WG_KEYS: usize = 64;

/// The backward kernel body on `wgmma`; see the module docs. Const parameters: `D` compiled
/// head dim (64 or 128), `BM` query rows per step (`BM · D = 64 · 128`: each warpgroup's dQ
/// is one 64 × 64 block; or `BM = D = 64`: both compute it, warpgroup 0 adds), `D_TILES = D/8`,
/// `Q_TILES = BM/8`, `DROPOUT`.
///
/// # Safety
/// sm_90a only. Launched with grid `(blocks, heads_kv, batch)`, 256 threads and
/// `BwdTile::smem_bytes()` bytes of dynamic shared memory, after the pre-pass wrote D and
/// with the dQ accumulator (and in deterministic mode the turn counters) zeroed, on
/// parameters the host validated; one block per key tile.
#[inline(always)]
pub unsafe fn flash_bwd_wgmma<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const BM: usize,
    const D_TILES: usize,
    const Q_TILES: usize,
    const DROPOUT: bool,
>(
    p: &BwdParams,
) {
    const {
        assert!(D % BLOCK_COLS == 0 && D_TILES * 8 == D && Q_TILES * 8 == BM);
        assert!((BM == 64 || BM == 128) && (BM * D == 64 * 128 || BM * D == 64 * 64));
    };
    let smem = Smem::<D, BM>::at(ptx::dyn_smem_base());
    if smem.base % 1024 != 0 {
        core::arch::nvptx::trap(); // the 128-byte swizzle's atoms are 1024-byte aligned
    }
    let (mut n, kv_head, batch) = order::block_coords(p);
    if M::WALK_READS_MEMORY {
        n = order::sparse_key_tile(p, (n, kv_head, batch));
    }
    let record = smem.record();
    if ptx::tid_x() == 0 {
        record.write(kv_head, batch, n);
    }
    ptx::bar_sync(); // the block's record visible
    key_tile::<E, M, D, BM, D_TILES, Q_TILES, DROPOUT>(p, smem, record);
}

/// The block's (KV head, batch) and key tile, kept in shared memory ([`Smem::record`]) and
/// loaded where used. In deterministic mode they come from arithmetic on the block index
/// ([`order::block_coords`]) instead of special registers ptxas can read again at will, and
/// keeping them live across the loop made ptxas spill.
#[derive(Clone, Copy)]
struct BlockRecord {
    at: u32,
}

impl BlockRecord {
    /// Byte offsets of the record's words.
    const KV_HEAD: u32 = 0;
    const BATCH: u32 = 4;
    const KEY_TILE: u32 = 8;

    /// Writes the record (one thread, before a barrier).
    #[inline(always)]
    unsafe fn write(self, kv_head: u32, batch: u32, key_tile: u32) {
        ptx::st_shared_u32(self.at + Self::KV_HEAD, kv_head);
        ptx::st_shared_u32(self.at + Self::BATCH, batch);
        ptx::st_shared_u32(self.at + Self::KEY_TILE, key_tile);
    }

    /// The KV head.
    #[inline(always)]
    fn kv_head(self) -> u32 {
        // SAFETY: the record's address in the block's shared memory, written before the
        // kernel's first barrier.
        unsafe { ptx::ld_volatile_shared_u32(self.at + Self::KV_HEAD) }
    }

    /// The batch entry.
    #[inline(always)]
    fn batch(self) -> u32 {
        // SAFETY: as `kv_head`.
        unsafe { ptx::ld_volatile_shared_u32(self.at + Self::BATCH) }
    }

    /// The key tile.
    #[inline(always)]
    fn key_tile(self) -> u32 {
        // SAFETY: as `kv_head`.
        unsafe { ptx::ld_volatile_shared_u32(self.at + Self::KEY_TILE) }
    }

    /// The block information of query head `head` (of this KV head's group).
    #[inline(always)]
    fn block(self, p: &BwdParams, head: u32) -> BlockInfo {
        block_for(p, self.batch(), self.kv_head(), head)
    }

    /// The block information of the KV head (its first query head).
    #[inline(always)]
    fn kv_block(self, p: &BwdParams) -> BlockInfo {
        let group = p.dims.heads_q / p.dims.heads_kv;
        self.block(p, self.kv_head() * group)
    }
}

/// The block's key tile (`record.key_tile()`): the loop of the module docs.
#[inline(always)]
unsafe fn key_tile<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const BM: usize,
    const D_TILES: usize,
    const Q_TILES: usize,
    const DROPOUT: bool,
>(
    p: &BwdParams,
    smem: Smem<D, BM>,
    record: BlockRecord,
) {
    let me = ThreadPos::current();
    let dims = &p.dims;
    let key0 = record.key_tile() * BN as u32;
    let kv_block = record.kv_block(p);
    let k_src = (p.k.ptr as *const u16).add(kv_block.key_offset(&p.k, key0) as usize);
    let v_src = (p.v.ptr as *const u16).add(kv_block.key_offset(&p.v, key0) as usize);
    let keys_left = dims.seqlen_k - key0;
    smem.k()
        .load_async::<WARPS>(k_src, p.k.strides.row, keys_left, dims.head_dim, me.tid);
    smem.v()
        .load_async::<WARPS>(v_src, p.v.strides.row, keys_left, dims.head_dim, me.tid);
    let mut cur = next_query_tile::<M, BM, BN, false>(
        p,
        record.batch(),
        record.kv_head(),
        None,
        record.key_tile(),
    );
    if let Some((head, i)) = cur {
        smem.load_query_tile(p, &record.block(p, head), i, 0, me.tid);
    }
    ptx::cp_async_commit_group();
    let warp = ptx::shfl_sync_idx_u32(me.warp, 0); // warp-uniform for ptxas
    let wg = warp / 4;
    let pos = FragPos::of(me.lane);
    let warp_k0 = 16 * warp; // the warp's first key in the block
    let mut dk = AccTile::<1, D_TILES>::zero();
    let mut dv = AccTile::<1, D_TILES>::zero();
    let mut buf = 0;
    let stage = smem.dq_stage();
    if me.tid == 0 {
        stage.set_staged_tile(None, 0); // published by barrier (A)
    }
    // Where the walk reads memory (block-sparse), one warp walks it a step ahead of the others
    // and leaves each tile in a look-ahead slot (two, by step parity): the step on tile i reads
    // the tile after it from slot `parity` after (A), and the walker then writes the tile after
    // that one into the other slot, read by the next step after its (A). A slot is written
    // only after the barrier that ends the previous step's reads of it.
    let walker = M::WALK_READS_MEMORY && warp == WARPS as u32 - 1;
    let mut parity = 0u32;
    if walker {
        let after = cur.and_then(|t| {
            next_query_tile::<M, BM, BN, false>(
                p,
                record.batch(),
                record.kv_head(),
                Some(t),
                record.key_tile(),
            )
        });
        stage.walk_slot(0).write(after, me.lane);
    }
    while let Some((head, i)) = cur {
        let row0 = i * BM as u32;
        ptx::cp_async_wait_group::<0>();
        smem.stats().finish(buf, row0, dims.seqlen_q, me.tid);
        ptx::fence_proxy_async_shared_cta(); // this thread's copies, for `wgmma`
        if me.tid == 0 && order::ordered(p) {
            stage.wait_for_staged_turn(p, record.batch(), record.key_tile()); // before its flush
        }
        ptx::bar_sync(); // (A) tile i (and Kⱼ, Vⱼ) visible to every warp; tile i−1 staged
        let tiles = smem.opaque(); // descriptors recomputed per step (64 registers if hoisted)
        let (q, d_o, stats) = (tiles.q(buf), tiles.d_o(buf), tiles.stats());
        // Sᵀ and dPᵀ on the tensor cores; Pᵀ is computed while dPᵀ runs, except in 128-row
        // query tiles, where dPᵀ's 64 accumulators live across that made ptxas spill: there
        // dPᵀ is issued with dV.
        let mut pt = AccTile::<1, Q_TILES>::zero();
        let mut dpt = AccTile::<1, Q_TILES>::zero();
        let overlap_dp = BM == 64;
        ptx::wgmma_fence();
        issue_scores::<E, D, BM, Q_TILES>(&mut pt, tiles.k(), q, wg);
        if overlap_dp {
            issue_scores::<E, D, BM, Q_TILES>(&mut dpt, tiles.v(), d_o, wg);
        }
        // While they run: tile i−1's dQ adds (`flush_row`'s threads, a warp's issued one lane
        // at a time), then the next query tile's walk and copies (into the other buffer, last read
        // by the previous step's products, which every warp waited for before (A)).
        stage.flush(p, record.batch(), record.kv_head(), flush_row::<BM>(me.tid));
        let ahead = if M::WALK_READS_MEMORY {
            let ahead = stage.walk_slot(parity).read();
            if let (true, Some(t)) = (walker, ahead) {
                let after = next_query_tile::<M, BM, BN, false>(
                    p,
                    record.batch(),
                    record.kv_head(),
                    Some(t),
                    record.key_tile(),
                );
                stage.walk_slot(parity ^ 1).write(after, me.lane);
            }
            ahead
        } else {
            next_query_tile::<M, BM, BN, false>(
                p,
                record.batch(),
                record.kv_head(),
                Some((head, i)),
                record.key_tile(),
            )
        };
        if let Some((h, i)) = ahead {
            smem.load_query_tile(p, &record.block(p, h), i, buf ^ 1, me.tid);
            ptx::cp_async_commit_group();
        }
        let mask = M::new(&p.mask, &record.block(p, head));
        if me.tid == 0 && order::ordered(p) {
            order::open_turn::<M, BM, BN>(p, &mask, (record.batch(), head, i), record.key_tile());
            // The turn tile i passes on once flushed, kept until the stage records it.
            let next = order::next_in_turn::<M, BM, BN>(&mask, i, record.key_tile());
            ptx::st_shared_u32(stage.record(StageRecord::PendingNext), next);
        }
        // With dropout at d <= 64 the generator's first calls (all four at 64 query rows, four
        // of eight at 128, whose registers are fuller) run while the products do: the issue
        // slots are idle there (at d = 128 the block-sparse and tree kernels spilled, and the
        // plain one gained 1-3 %; docs/perf-notes.md).
        let draw_ahead = DROPOUT && D <= 64;
        let ahead_calls = if BM == 64 { Q_TILES / 2 } else { Q_TILES / 4 };
        let drawn_early = if draw_ahead {
            let rng = rng_for(&p.dropout, record.batch(), head, dims.heads_q);
            let key_base = record.key_tile() * BN as u32 + warp_k0;
            draw_marks::<Q_TILES>(&rng, key_base, row0, pos, (0, ahead_calls))
        } else {
            [0; Q_TILES]
        };
        if overlap_dp {
            ptx::wgmma_wait_group::<1>();
        } else {
            ptx::wgmma_wait_group::<0>();
        }
        ptx::wgmma_fence_operands(pt.tiles_mut::<Q_TILES>(0, 0));
        let key_base = record.key_tile() * BN as u32 + warp_k0;
        // Masks that modify scores (a window with ALiBi): Sᵀ becomes the logits, whose
        // derivative is one value for the whole tile. The softcap's derivative differs per
        // score; keeping it spills (64–848 B), so capped calls take `mma.sync`
        // (`registry::bwd_wgmma_kernel`) and this kernel traps on them.
        let modifies = M::MODIFIES_SCORES && mask.modifies_scores();
        if modifies {
            if mask.capped() {
                core::arch::nvptx::trap();
            }
            let slope = M::slope(&p.mask, record.batch(), head);
            pt.for_each_mut(|_, r, nt, c, x| {
                let (row, key) = (row0 + pos.col(nt, c), key_base + pos.row(0, r));
                *x = mask.score_as::<false>(row, key, *x, slope);
            });
        }
        stats.probabilities(&mut pt, buf, pos, p.scale_log2);
        if mask.tile_needs_mask(row0, BM as u32, record.key_tile(), BN as u32) {
            pt.for_each_mut(|_, r, nt, c, x| {
                if !mask.visible(row0 + pos.col(nt, c), key_base + pos.row(0, r)) {
                    *x = 0.0;
                }
            });
        }
        let mut pt = PackedTile::pack::<E>(&pt);
        if DROPOUT {
            let rng = rng_for(&p.dropout, record.batch(), head, dims.heads_q);
            if draw_ahead {
                let late = (ahead_calls, Q_TILES / 2);
                let drawn_late = draw_marks::<Q_TILES>(&rng, key_base, row0, pos, late);
                mark_drawn(&mut pt, &drawn_early, pos, (0, ahead_calls));
                mark_drawn(&mut pt, &drawn_late, pos, late);
            } else {
                mark_dropped(&rng, &mut pt, key_base, row0, pos);
            }
        }
        let pt = pt;
        ptx::wgmma_fence(); // Pᵀ's registers, written above
        if !overlap_dp {
            issue_scores::<E, D, BM, Q_TILES>(&mut dpt, smem.v(), d_o, wg);
        }
        if DROPOUT {
            issue_rs::<E, _, D, BM, D_TILES>(&mut dv, &NonNegative(&pt), d_o);
        } else {
            issue_rs::<E, _, D, BM, D_TILES>(&mut dv, &pt, d_o);
        }
        ptx::wgmma_wait_group::<1>(); // dPᵀ (dV may still run)
        ptx::wgmma_fence_operands(dpt.tiles_mut::<Q_TILES>(0, 0));
        dpt.for_each_mut(|mt, r, nt, c, x| {
            let prob = pt.get::<E>(mt, r, nt, c);
            let delta = stats.delta(buf, pos.col(nt, c));
            *x = d_score::<DROPOUT>(prob, *x, delta, p.dropout.scale);
            if modifies {
                *x *= mask.uncapped_grad();
            }
        });
        let ds = PackedTile::pack::<E>(&dpt);
        ptx::wgmma_fence();
        issue_rs::<E, _, D, BM, D_TILES>(&mut dk, &ds, q);
        for r in 0..2 {
            for nt in 0..Q_TILES {
                let key = warp_k0 + pos.row(0, r);
                smem.ds().store_pair(key, pos.col(nt, 0), ds.pair(0, r, nt));
            }
        }
        ptx::fence_proxy_async_shared_cta(); // dSᵀ, for `wgmma`
        DqStage::<BM, D>::wait_flushed(p); // the stage's last flush has read it
        ptx::bar_sync(); // (B) dSᵀ complete; the dQ stage free
        if me.tid == 0 && order::ordered(p) {
            stage.pass_staged_turn(p, record.batch()); // the tile flushed at (A)
        }
        // dQᵢ = dS·Kⱼ: warpgroup `wg` takes query rows 64·wg .. (BM = 128) or columns
        // 64·wg .. (D = 128) of the tile. A 64 × 64 tile (BM = D = 64) both
        // compute and warpgroup 0 adds: split over keys it would take two adds
        // per element, in no fixed order, and a product under a branch
        // serialises every `wgmma` of the kernel (ptxas C7514).
        let (row_block, col_block) = if BM == 2 * WG_KEYS {
            (wg, 0)
        } else if D == 2 * BLOCK_COLS {
            (0, wg)
        } else {
            (0, 0)
        };
        let dq_here = BM * D == 2 * 64 * 64 || wg == 0;
        let mut dq = AccTile::<1, { BLOCK_COLS / 8 }>::zero();
        ptx::wgmma_fence();
        for ks in 0..BN / 16 {
            let a = smem.ds().mn_major(ks, row_block as usize);
            let b = smem.k().mn_major(ks, col_block as usize);
            E::wgmma_n64_ss_tt(dq.tiles_mut::<8>(0, 0), a, b, ks > 0);
        }
        ptx::wgmma_commit_group();
        // The next query tile: where the walk reads memory (block-sparse), the one found
        // above, kept in two registers; else looked up again while dQ's product runs (the
        // general mask's kernels have no registers to spare).
        let next = if M::WALK_READS_MEMORY {
            ahead
        } else {
            next_query_tile::<M, BM, BN, false>(
                p,
                record.batch(),
                record.kv_head(),
                Some((head, i)),
                record.key_tile(),
            )
        };
        ptx::wgmma_wait_group::<0>();
        ptx::wgmma_fence_operands(dq.tiles_mut::<8>(0, 0));
        ptx::wgmma_fence_operands(dk.tiles_mut::<D_TILES>(0, 0));
        ptx::wgmma_fence_operands(dv.tiles_mut::<D_TILES>(0, 0));
        // scale·dQᵢ into the stage; the next step's (A) publishes it and starts its adds.
        for r in 0..(dq_here as usize) * 2 {
            let row = 64 * row_block + 16 * (warp % 4) + pos.row(0, r);
            for nt in 0..BLOCK_COLS / 8 {
                let col = 64 * col_block + pos.col(nt, 0);
                let [x0, x1] = dq.pair(0, r, nt);
                ptx::st_shared_v2_f32(stage.addr(row, col), x0 * p.scale, x1 * p.scale);
            }
        }
        ptx::fence_proxy_async_shared_cta(); // the stage, for the bulk engine
        if me.tid == 0 {
            let next = ptx::ld_shared_u32(stage.record(StageRecord::PendingNext));
            stage.set_staged_tile(Some((head, i)), next);
        }
        cur = next;
        buf ^= 1;
        parity ^= 1;
    }
    ptx::cp_async_wait_group::<0>(); // Kⱼ, Vⱼ landed even if no query tile saw them
    if me.tid == 0 && order::ordered(p) {
        stage.wait_for_staged_turn(p, record.batch(), record.key_tile());
    }
    ptx::bar_sync(); // every warp's part of the last tile's dQ is staged
    stage.flush(p, record.batch(), record.kv_head(), flush_row::<BM>(me.tid));
    // dK and dV leave while the bulk engine adds the last tile's dQ.
    let kv_block = record.kv_block(p); // read again: kept live across the loop, it spilled
    let key_base = record.key_tile() * BN as u32 + warp_k0;
    store_dkv::<E, D_TILES, DROPOUT>(p, &kv_block, key_base, 0, pos, &dk, &dv);
    stage.finish(p, record.batch(), me.tid);
}

/// The dQ stage row thread `tid` flushes ([`DqStage::flush`]; `u32::MAX`: none). The adds
/// of one warp's threads are issued one lane at a time. With 128-row query tiles, row `tid`
/// by the first four warps (the other four go on meanwhile); with 64, `BM / WARPS` rows per
/// warp. Measured on the H200, clock-locked, against `BM / WARPS` rows per warp everywhere:
/// the first `BM` threads took 0.967× the cycles at d = 64 (128-row tiles) and 1.04× at
/// d = 128 (64-row tiles; docs/perf-notes.md).
#[inline(always)]
fn flush_row<const BM: usize>(tid: u32) -> u32 {
    if BM >= 128 {
        if tid < BM as u32 {
            tid
        } else {
            u32::MAX
        }
    } else {
        let (warp, lane, per_warp) = (tid / 32, tid % 32, (BM / WARPS) as u32);
        if lane < per_warp {
            warp * per_warp + lane
        } else {
            u32::MAX
        }
    }
}

/// Issues and commits a warpgroup's `Sᵀ = K·Qᵀ` (or `dPᵀ = V·dOᵀ`): its 64 rows of `keys`
/// (from `64·wg`) times the `BM` rows of `queries`, one `m64nBMk16` per 16 columns of the
/// head dim, both operands K-major.
#[inline(always)]
unsafe fn issue_scores<E: Elem, const D: usize, const BM: usize, const QT: usize>(
    acc: &mut AccTile<1, QT>,
    keys: GmmaTile<BN, D>,
    queries: GmmaTile<BM, D>,
    wg: u32,
) {
    let row0 = WG_KEYS * wg as usize;
    for ks in 0..D / 16 {
        let (a, b) = (keys.k_major(row0, ks), queries.k_major(0, ks));
        if BM == 128 {
            E::wgmma_n128_ss(acc.tiles_mut::<16>(0, 0), a, b, ks > 0);
        } else {
            E::wgmma_n64_ss(acc.tiles_mut::<8>(0, 0), a, b, ks > 0);
        }
    }
    ptx::wgmma_commit_group();
}

/// Issues and commits `acc += A·B` for a warpgroup: A (64 keys × the `BM` queries) from
/// registers, B the `[BM][D]` tile read MN-major; one `m64n128k16` per 16 queries at
/// d = 128, else one `m64n64k16` per 16 queries and 64 columns.
#[inline(always)]
unsafe fn issue_rs<
    E: Elem,
    A: RegFragments<1>,
    const D: usize,
    const BM: usize,
    const DT: usize,
>(
    acc: &mut AccTile<1, DT>,
    a: &A,
    b: GmmaTile<BM, D>,
) {
    for kk in 0..BM / 16 {
        let frag = a.a_fragment::<E>(0, kk);
        if D == 2 * BLOCK_COLS {
            E::wgmma_n128_rs(acc.tiles_mut::<16>(0, 0), frag, b.mn_major(kk, 0));
        } else {
            for cb in 0..D / BLOCK_COLS {
                let part = acc.tiles_mut::<{ BLOCK_COLS / 8 }>(0, cb * BLOCK_COLS / 8);
                E::wgmma_n64_rs(part, frag, b.mn_major(kk, cb));
            }
        }
    }
    ptx::wgmma_commit_group();
}

/// The block's shared memory; see the module docs.
#[derive(Clone, Copy)]
struct Smem<const D: usize, const BM: usize> {
    base: u32,
}

impl<const D: usize, const BM: usize> Smem<D, BM> {
    const KV: u32 = GmmaTile::<BN, D>::BYTES;
    const QTILE: u32 = GmmaTile::<BM, D>::BYTES;

    #[inline(always)]
    fn at(base: u32) -> Self {
        Self { base }
    }

    /// The same layout, its base opaque to the optimiser (see [`ptx::opaque_u32`]).
    #[inline(always)]
    fn opaque(self) -> Self {
        // SAFETY: an empty asm on a register.
        Self {
            base: unsafe { ptx::opaque_u32(self.base) },
        }
    }

    /// K.
    #[inline(always)]
    fn k(self) -> GmmaTile<BN, D> {
        GmmaTile::at(self.base)
    }

    /// V.
    #[inline(always)]
    fn v(self) -> GmmaTile<BN, D> {
        GmmaTile::at(self.base + Self::KV)
    }

    /// Q of buffer `buf`.
    #[inline(always)]
    fn q(self, buf: u32) -> GmmaTile<BM, D> {
        GmmaTile::at(self.base + 2 * Self::KV + buf * Self::QTILE)
    }

    /// dO of buffer `buf`.
    #[inline(always)]
    fn d_o(self, buf: u32) -> GmmaTile<BM, D> {
        GmmaTile::at(self.base + 2 * Self::KV + (2 + buf) * Self::QTILE)
    }

    /// dSᵀ `[BN][BM]`.
    #[inline(always)]
    fn ds(self) -> GmmaTile<BN, BM> {
        GmmaTile::at(self.base + 2 * Self::KV + 4 * Self::QTILE)
    }

    /// LSE and D of both buffers.
    #[inline(always)]
    fn stats(self) -> QueryStats<BM> {
        let ds = GmmaTile::<BN, BM>::BYTES;
        QueryStats::at(self.base + 2 * Self::KV + 4 * Self::QTILE + ds)
    }

    /// The dQ stage `[BM][D + 8]` f32, after LSE and D.
    #[inline(always)]
    fn dq_stage(self) -> DqStage<BM, D> {
        let ds = GmmaTile::<BN, BM>::BYTES;
        DqStage::at(self.base + 2 * Self::KV + 4 * Self::QTILE + ds + 16 * BM as u32)
    }

    /// The block's record of its (KV head, batch) and key tile, after the dQ stage.
    #[inline(always)]
    fn record(self) -> BlockRecord {
        BlockRecord {
            at: self.dq_stage().addr(0, 0) + DqStage::<BM, D>::BYTES,
        }
    }

    /// Issues the copies of query tile `i` into buffer `buf`: Q and dO (rows past the
    /// sequence zero-filled), LSE and D; the caller commits them.
    #[inline(always)]
    unsafe fn load_query_tile(
        self,
        p: &BwdParams,
        block: &crate::block::BlockInfo,
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
            .load_async::<WARPS>(q, p.q.strides.row, rows_left, dims.head_dim, tid);
        self.d_o(buf)
            .load_async::<WARPS>(d_o, p.d_o.strides.row, rows_left, dims.head_dim, tid);
        self.stats().load(p, block, row0, buf, tid);
    }
}
