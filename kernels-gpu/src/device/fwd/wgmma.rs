//! Forward attention on Hopper (sm_90a), warp-specialised: a producer warpgroup whose one
//! thread loads every tile with TMA, and two or three consumer warpgroups that run both
//! products on `wgmma`, with the same masks, softmax, dropout and epilogue as
//! [`super::flash_fwd`].
//!
//! Block: 128 + BM·2 threads (`BM` = 128 or 192 query rows). Warpgroup 0 is the producer: it
//! gives its registers back (`setmaxnreg.dec` to [`PRODUCER_REGS`]) and its thread 0 issues
//! the copies. The other `BM / 64` warpgroups are the consumers (`setmaxnreg.inc` to
//! [`CONSUMER_REGS_OF_TWO`] or [`CONSUMER_REGS_OF_THREE`]), 64 query rows each; consumer
//! warp `w` owns rows `16w .. 16w + 16`, in the `mma.m16n8k16` accumulator layout that
//! `wgmma` shares, so every register-tile layer (softmax, masks, dropout, the O store) is the
//! one of the `mma.sync` kernels.
//!
//! Two consumer warpgroups (`BM = 128`) overlap each one's softmax with its own P·V, as
//! drawn below. Three (`BM = 192`, at d = 64, where two leave the tensor cores idle) have
//! 160 registers each, too few to hold S, P and O at once: each runs its products and its
//! softmax in turn (issue P·Vᵢ, then S = Q·Kᵢ₊₁ᵀ, wait for both, softmax, rescale O), and
//! the other two warpgroups' products cover its softmax ([`Pipeline::consume_in_turn`]);
//! each masks by its own rows and skips the leading key tiles none of them sees (a causal
//! 192-row block's first warpgroups end one or two 128-key tiles before its last). After its
//! first key tile, each of the three takes the softmax at its rows' reference points first
//! (`Pipeline::AT_REFERENCE`), and only where one of its rows' maxima moves past the lazy
//! threshold (a vote at its named barrier) multiplies S again and takes the full softmax.
//!
//! ```text
//! producer (one thread)                     consumers (each warpgroup, its 64 rows)
//! Q → shared (TMA), on q_full               wait q_full
//! for each key tile j the mask visits       S = Q·K₀ᵀ; (2 stages: arrive k_empty[0]);
//!                                           P₀ ← softmax
//! (s = j % STAGES):                         for tile i + 1 = 1, 2, …:
//!   wait k_empty[s]; K_j → stage s            wait k_full; issue S = Q·Kᵢ₊₁ᵀ   (m64nBNk16)
//!   wait v_empty[s]; V_j → stage s            wait v_full; issue O += Pᵢ·Vᵢ   (m64n128k16
//!                                               at d = 128, else m64n64k16 × D/64; P from
//!                                               registers, V MN-major)
//!                                             wait for S; (2 stages: arrive k_empty of i + 1)
//!                                             Pᵢ₊₁ ← softmax                 (while P·V runs)
//!                                             wait for O; arrive v_empty of tile i (3 stages:
//!                                             the stage's one barrier); O ·= rescale
//!                                           O += P_last·V_last; O /= l; LSE
//! ```
//!
//! Persistent kernels (`PERSISTENT`, the registry's rows marked so): the host launches about
//! one block per SM; block `x` runs query tile `x`, then takes `nctaid.x + atomicInc(counter,
//! tiles − 1)` (left at zero by the launch) until past the last, in the one-tile-per-block
//! grid's order (query tiles of a head in a row, longest first under a causal mask; heads and
//! sequences after), so the tiles in flight stay as close together as the hardware's block
//! order kept them; a block-sparse launch's blocks take those entries of the host's tile order
//! instead, its tiles by the key blocks they visit, most first, so the launch ends on its
//! shortest ones ([`WgmmaFwdParams::tile_order`]). The producer's warp 0
//! (lane 0 issuing) writes each tile's index into a shared slot before `q_full`, waits on
//! `q_empty` (every consumer warp arrives once its warpgroup is done reading Q: after its
//! last S = Q·Kᵀ of the tile, or with three consumer warpgroups after the softmax that may
//! compute that S again; before the last P·V and O store) before the next tile's Q, and
//! runs the K/V ring on across tiles: the next tile's Q and first K/V load while the
//! consumers write the current tile's O. Past the last tile it writes the index alone, and the
//! consumers stop. With two consumer warpgroups ([`q_by_warpgroup`]) Q is loaded and freed
//! per warpgroup (its 64 rows, a box of its own, on its own `q_full` and `q_empty`), and the
//! turns run on from one query tile to the next ([`Turns`]): a warpgroup done with a tile
//! starts the next one (its rows of Q loaded since its last S = Q·Kᵀ) while the other runs its
//! last P·V and stores its O, so the tensor cores do not wait for both epilogues.
//!
//! The key walk ([`Walk`]): blocks of two consumer warpgroups at d ≤ 128 without dropout walk
//! the key tiles of a causal mask or a window upwards, so the tile a causal mask cuts at the
//! diagonal comes last and its masked softmax runs beside the previous tile's P·V, while the
//! query tile's first softmax, which no product covers, is an unmasked one (clock-locked on an
//! H100: 0.967× the cycles at 2K causal keys, 0.982× at 4K; docs/perf-notes.md). The other
//! kernels take the mask's own walk, from the last tile down.
//!
//! The plain kind's kernel at d = 128 takes 176-key tiles (FlashAttention 3's shape without a
//! causal mask at that head dim): S is 88 registers per consumer thread, and the per-tile
//! steps (barriers, row maxima, the rescale test) are spread over more keys. The host runs it
//! only where that pays (at most 1/64 of the keys padding the last tile, causal calls from 8K
//! keys); elsewhere plain calls take the general kind's 128-key kernel.
//!
//! In a ring of two stages (d = 256, and the 176-key tiles at d = 128, whose tiles leave room
//! for no more) K and V are freed separately, each as soon as its product completes, so every
//! tile is still requested one loop step ahead: the K of tile i + 1 and the V of tile i, read
//! in step i, were requested when step i − 2 freed their halves of the stage. With three stages one barrier frees the
//! stage (`v_empty` is `k_empty`) at the end of the step that reads its V.
//!
//! Shared memory (dynamic, 1024-byte aligned, [`crate::config::FwdTile::smem_bytes`]): Q
//! `[BM][D]`, a ring of `STAGES` (K `[BN][D]`, V `[BN][D]`) stages in the layout of
//! [`crate::gmma`] (which is TMA's 128-byte swizzle of 64-column boxes), where it fits
//! (d = 64; the general kind with dropout at d = 128, whose 64-key tiles leave room) each
//! consumer warp's O stage `[16][D]` ([`store_output_staged`]: O leaves by
//! `stmatrix` and 16-byte stores), then the barriers. Elsewhere O leaves by 16-byte stores
//! from registers, after each quad's lanes swap their pairs ([`store_output_by_quads`]).
//! Registers per consumer thread: S `BN/2` f32, P `BN/4` packed, O `D/2` f32, m and l of 2
//! rows. Sync points: one `bar.sync` after the barriers are initialised; from then on only
//! `mbarrier`s: `*_full` complete when the copies' bytes land (one arrival, the producer's
//! `expect_tx`), `k_empty[s]` / `v_empty[s]` when every consumer warp has finished reading
//! that tile of stage `s` (one arrival per warp, by lane 0, after the `wgmma.wait_group` of
//! the product that read it). A negative softmax scale negates
//! each warpgroup's Q rows in place, then `fence.proxy.async` and a named barrier of that
//! warpgroup.

use super::io::{output_stage_bytes, store_output_by_quads, store_output_staged};
use super::KeyTile;
use crate::block::BlockInfo;
use crate::config::MMA_M;
use crate::device::dropout::rng_for;
use crate::device::elem::Elem;
use crate::device::frag::{AccTile, FragPos, PackedTile, RegFragments, RowVec, ThreadPos};
use crate::device::ptx;
use crate::device::softmax::{OnlineSoftmax, Tuning};
use crate::device::tile::GmmaTile;
use crate::gmma::BLOCK_COLS;
use crate::mask::AttnMask;
use crate::params::{q_box_rows, FwdParams, WgmmaFwdParams, SCHEDULE_PINGPONG, TENSOR_MAP_BYTES};
use crate::rng::DropoutRng;
use core::marker::PhantomData;

/// Producer warps per block (one warpgroup, of which one thread works).
pub const PRODUCER_WARPS: usize = 4;
/// Register limit of the producer warpgroup after `setmaxnreg.dec`.
pub const PRODUCER_REGS: u32 = 24;
/// Register limit of a persistent block's producer warpgroup with three consumer warpgroups
/// (its tile loop holds more than 24): launched at 128 per thread (`.maxnreg`), the producer
/// frees `128·(128 − 32)`, exactly what the consumers' `setmaxnreg.inc` to 160 takes. With two
/// (launched at 168) the producer must go down to 24: the consumers' raise to 240 waits for
/// `128·(168 − 24)` free registers, and would wait forever for more than are freed.
pub const PRODUCER_REGS_PERSISTENT_OF_THREE: u32 = 32;
/// Register limit of two consumer warpgroups after `setmaxnreg.inc`: with the producer's,
/// `128·(24 + 2·240) = 64 512` of the SM's 65 536.
pub const CONSUMER_REGS_OF_TWO: u32 = 240;
/// Register limit of three consumer warpgroups: `128·(24 + 3·160) = 64 512`.
pub const CONSUMER_REGS_OF_THREE: u32 = 160;
/// Rows of one warpgroup's products.
const WG_ROWS: usize = 64;
/// Threads of one warpgroup.
const WG_THREADS: u32 = 128;

/// Whether each consumer warpgroup's rows of Q are loaded and freed on their own (`q_full`
/// and `q_empty` per warpgroup) and the warpgroups' turns run on across query tiles
/// ([`Turns::chained`]): persistent blocks of two consumer warpgroups. A warpgroup then
/// starts its next query tile (its part of Q loaded once it had read the last of its part of
/// this one) while the other one still runs its last P·V and stores its O.
/// The host's Q boxes then have a warpgroup's rows ([`q_box_rows`]).
const fn q_by_warpgroup(bm: usize, persistent: bool) -> bool {
    q_box_rows(bm, persistent) < bm
}

/// Bytes of the barriers after the tiles: `q_full`, then `k_full`, `v_full`, `k_empty` and
/// (two stages) `v_empty` of each stage (8 bytes each; reserved for up to 3 stages), then
/// the persistent blocks' `q_empty`, two tile slots, and where [`q_by_warpgroup`] the second
/// warpgroup's `q_full` and `q_empty` ([`Barriers`]).
pub const BARRIER_BYTES: usize = crate::config::TMA_BARRIER_BYTES;

/// The forward kernel body on TMA and `wgmma`; see the module docs. Const parameters: `D`
/// compiled head dim (a multiple of 64), `BM` query rows per block (128 or 192: two or three
/// consumer warpgroups), `BN` keys per tile (64, 128 or 176: the `m64n64k16`,
/// `m64n128k16` or `m64n176k16` product of S), `D_TILES = D/8`, `N_TILES = BN/8`, `STAGES`
/// (2 or 3), `DROPOUT`.
///
/// # Safety
/// sm_90a only. Launched with grid `(ceil(seqlen_q / BM), heads_q, batch)`, `128 + 2·BM`
/// threads, `FwdTile::smem_bytes()` bytes of dynamic shared memory and `.maxntid` of that
/// block size in its PTX, on
/// parameters the host validated, whose tensor maps describe `args.fwd`'s Q, K and V.
#[inline(always)]
pub unsafe fn flash_fwd_wgmma<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const BM: usize,
    const BN: usize,
    const D_TILES: usize,
    const N_TILES: usize,
    const STAGES: usize,
    const DROPOUT: bool,
    const PERSISTENT: bool,
>(
    args: &WgmmaFwdParams,
) {
    const {
        assert!(D % BLOCK_COLS == 0 && D_TILES * 8 == D && N_TILES * 8 == BN);
        assert!(BN == 64 || BN == 128 || BN == 176);
        assert!(BM == 128 || BM == 192);
        assert!(STAGES >= 2 && STAGES <= 3); // step i reads K of tile i + 1 and V of tile i
        assert!(BARRIER_BYTES >= 8 * (1 + 4 * 3) + 32);
        assert!(!q_by_warpgroup(BM, PERSISTENT) || q_box_rows(BM, PERSISTENT) == WG_ROWS);
    };
    let p = &args.fwd;
    let layout = SmemLayout::<D, BM, BN, STAGES> {
        base: ptx::dyn_smem_base(),
    };
    if layout.base % 1024 != 0 {
        core::arch::nvptx::trap(); // TMA's 128-byte swizzle needs 1024-byte aligned boxes
    }
    let me = ThreadPos::current();
    let warp = ptx::shfl_sync_idx_u32(me.warp, 0); // warp-uniform for ptxas (see its docs)
    let longest_first = M::later_rows_see_more(&p.mask);
    let pingpong = args.schedule == SCHEDULE_PINGPONG;
    let walk = Walk::of::<M, D, BM, DROPOUT>();
    if PERSISTENT {
        if me.tid == 0 {
            layout
                .bars()
                .init(BM as u32 / MMA_M as u32, true, q_by_warpgroup(BM, true));
        }
        ptx::bar_sync(); // the barriers are initialised (the only block-wide barrier)
        if warp < PRODUCER_WARPS as u32 {
            if BM == 128 {
                ptx::setmaxnreg_dec::<PRODUCER_REGS>();
            } else {
                ptx::setmaxnreg_dec::<PRODUCER_REGS_PERSISTENT_OF_THREE>();
            }
            if warp == 0 {
                produce_tiles::<M, D, BM, BN, STAGES>(args, layout, walk, longest_first, me.lane);
            }
            return;
        }
        grow_consumer_registers::<BM>();
        let me = consumer_thread(me, warp);
        consume_tiles::<E, M, D, BM, BN, D_TILES, N_TILES, STAGES, DROPOUT>(
            args,
            layout,
            me,
            pingpong,
            longest_first,
        );
        return;
    }
    let block = BlockInfo::new(
        &p.dims,
        ptx::ctaid(),
        ptx::nctaid_x(),
        BM as u32,
        longest_first,
    );
    let mask = M::new(&p.mask, &block);
    if me.tid == 0 {
        layout.bars().init(BM as u32 / MMA_M as u32, false, false);
    }
    ptx::bar_sync(); // the barriers are initialised (the only block-wide barrier)
    let first = walk.first::<M, BM, BN>(&mask, block.row0);
    if warp < PRODUCER_WARPS as u32 {
        ptx::setmaxnreg_dec::<PRODUCER_REGS>();
        if let (0, Some(first)) = (me.tid, first) {
            produce(
                args.tensor_maps,
                &block,
                &mask,
                layout,
                walk,
                first,
                0,
                true,
                QLoad {
                    by_warpgroup: false,
                    tile: 0,
                },
            );
        }
        return;
    }
    grow_consumer_registers::<BM>();
    let me = consumer_thread(me, warp);
    consume::<E, M, D, BM, BN, D_TILES, N_TILES, STAGES, DROPOUT, false>(
        p, &block, &mask, layout, first, me, pingpong, 0, 0,
    );
}

/// `setmaxnreg.inc` of the consumer warpgroups: [`CONSUMER_REGS_OF_TWO`] or
/// [`CONSUMER_REGS_OF_THREE`].
#[inline(always)]
unsafe fn grow_consumer_registers<const BM: usize>() {
    if BM == 128 {
        ptx::setmaxnreg_inc::<CONSUMER_REGS_OF_TWO>();
    } else {
        ptx::setmaxnreg_inc::<CONSUMER_REGS_OF_THREE>();
    }
}

/// A consumer's thread, warp and lane, counted from the first consumer thread.
#[inline(always)]
fn consumer_thread(me: ThreadPos, warp: u32) -> ThreadPos {
    ThreadPos {
        tid: me.tid - (PRODUCER_WARPS * 32) as u32,
        warp: warp - PRODUCER_WARPS as u32,
        lane: me.lane,
    }
}

/// The block of query tile `tile` of a persistent launch: the one-block-per-tile grid's
/// block `(tile mod tiles_x, ⌊tile / tiles_x⌋ mod heads_q, ⌊tile / (tiles_x·heads_q)⌋)`.
#[inline(always)]
fn tile_block<const BM: usize>(
    p: &FwdParams,
    tile: u32,
    tiles_x: u32,
    longest_first: bool,
) -> BlockInfo {
    let tiles_x = tiles_x.max(1); // no division-by-zero branch
    let (x, rest) = (tile % tiles_x, tile / tiles_x);
    let heads = p.dims.heads_q.max(1);
    let at = (x, rest % heads, rest / heads);
    BlockInfo::new(&p.dims, at, tiles_x, BM as u32, longest_first)
}

/// The producer of a persistent block (its first warp, lane 0 issuing: the loop's scalars stay
/// warp-uniform, in uniform registers, which the producer's 24 per thread do not hold): its
/// first query tile is the block's index, the next ones come from the launch's counter
/// (entries of the launch's tile order, where it has one: [`ordered_tile`]). For
/// each, once the consumers have freed Q (`q_empty`; where [`q_by_warpgroup`], the first
/// warpgroup's part, the second's before its part loads): the tile's index into its slot,
/// then Q and its key tiles (the ring running on across tiles), or bare arrivals on `q_full`
/// for a tile that sees no key; past the last tile, the index alone (the consumers then
/// stop).
#[inline(always)]
unsafe fn produce_tiles<
    M: AttnMask,
    const D: usize,
    const BM: usize,
    const BN: usize,
    const STAGES: usize,
>(
    args: &WgmmaFwdParams,
    layout: SmemLayout<D, BM, BN, STAGES>,
    walk: Walk,
    longest_first: bool,
    lane: u32,
) {
    let (p, bars, leader) = (&args.fwd, layout.bars(), lane == 0);
    let by_warpgroup = q_by_warpgroup(BM, true);
    let (mut taken, mut t, mut ring) = (ptx::ctaid().0, 0u32, 0u32);
    loop {
        let tile = ordered_tile::<M>(args, taken);
        if t > 0 {
            ptx::mbarrier_wait(bars.q_empty(0), (t - 1) & 1);
        }
        if leader {
            ptx::st_shared_u32(bars.tile_slot(t), tile);
        }
        if tile >= args.tiles {
            announce_without_q(bars, by_warpgroup, t, leader);
            return;
        }
        let block = tile_block::<BM>(p, tile, args.tiles_x, longest_first);
        let mask = M::new(&p.mask, &block);
        match walk.first::<M, BM, BN>(&mask, block.row0) {
            Some(first) => {
                ring = produce(
                    args.tensor_maps,
                    &block,
                    &mask,
                    layout,
                    walk,
                    first,
                    ring,
                    leader,
                    QLoad {
                        by_warpgroup,
                        tile: t,
                    },
                )
            }
            None => announce_without_q(bars, by_warpgroup, t, leader),
        }
        // `tiles` increments in all (one per tile taken), the last of which wraps the
        // counter back to zero for the next launch.
        let counted = if leader {
            ptx::atom_global_inc_u32(args.tile_counter as *mut u32, args.tiles - 1)
        } else {
            0
        };
        taken = ptx::nctaid_x() + ptx::shfl_sync_idx_u32(counted, 0);
        t += 1;
    }
}

/// A persistent producer's arrivals on `q_full` for its `t`-th query tile without loading Q
/// (a tile that sees no key, or past the last tile): where [`q_by_warpgroup`], the second
/// warpgroup's once that warpgroup freed its part of tile `t − 1` (so that no barrier runs a
/// phase ahead of its waiters).
#[inline(always)]
unsafe fn announce_without_q<const STAGES: usize>(
    bars: Barriers<STAGES>,
    by_warpgroup: bool,
    t: u32,
    leader: bool,
) {
    ptx::mbarrier_arrive_if(bars.q_full(0), leader);
    if by_warpgroup {
        if t > 0 {
            ptx::mbarrier_wait(bars.q_empty(1), (t - 1) & 1);
        }
        ptx::mbarrier_arrive_if(bars.q_full(1), leader);
    }
}

/// How a producer loads a query tile's Q: at once, or where [`q_by_warpgroup`] (`by_warpgroup`)
/// each consumer warpgroup's rows on their own `q_full`, the second's once that warpgroup has
/// freed its part of the block's previous query tile (`tile` counts the block's tiles).
#[derive(Clone, Copy)]
struct QLoad {
    by_warpgroup: bool,
    tile: u32,
}

/// Brings the launch's tensor maps into the TMA unit's descriptor cache.
#[inline(always)]
unsafe fn prefetch_maps(maps: [u64; 3]) {
    for map in maps {
        ptx::prefetch_tensormap(map);
    }
}

/// Entry `k` of a persistent launch's tile order ([`WgmmaFwdParams::tile_order`]) for masks
/// that read memory (block-sparse), where the launch has one; else, and past the last entry,
/// `k` itself. Warp-uniform (through lane 0).
#[inline(always)]
unsafe fn ordered_tile<M: AttnMask>(args: &WgmmaFwdParams, k: u32) -> u32 {
    if M::WALK_READS_MEMORY && args.tile_order != 0 && k < args.tiles {
        // SAFETY: the host's order holds `tiles` entries.
        let tile = *(args.tile_order as *const u32).add(k as usize);
        ptx::shfl_sync_idx_u32(tile, 0)
    } else {
        k
    }
}

/// The consumers of a persistent block: for each query tile the producer announces (its
/// index in the slot once `q_full` completes), the key loop (which frees Q, `q_empty`, once
/// done reading it), then O and LSE.
#[inline(always)]
unsafe fn consume_tiles<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const BM: usize,
    const BN: usize,
    const D_TILES: usize,
    const N_TILES: usize,
    const STAGES: usize,
    const DROPOUT: bool,
>(
    args: &WgmmaFwdParams,
    layout: SmemLayout<D, BM, BN, STAGES>,
    me: ThreadPos,
    pingpong: bool,
    longest_first: bool,
) {
    let (p, bars) = (&args.fwd, layout.bars());
    let walk = Walk::of::<M, D, BM, DROPOUT>();
    let by_warpgroup = q_by_warpgroup(BM, true);
    let part = if by_warpgroup { me.warp / 4 } else { 0 };
    if by_warpgroup {
        Turns::of::<BM>(pingpong, me.warp / 4, true).start_chain();
    }
    let (mut t, mut ring) = (0u32, 0u32);
    loop {
        ptx::mbarrier_wait(bars.q_full(part), t & 1);
        let mut tile = ptx::ld_shared_u32(bars.tile_slot(t));
        if M::WALK_READS_MEMORY {
            // The tile, the ring's count and (below) the first key tile through lane 0, as the
            // walk's next tiles (see `consume_overlapped`): the first key tile comes from a
            // load of the mask's bits, and with a branch on it ptxas built every `wgmma`
            // descriptor and barrier address of the key loop in ordinary registers (90
            // `R2UR` in the kernel at d = 128 against 34; 1.16x the cycles). A constant
            // test: the other masks' code is unchanged.
            tile = ptx::shfl_sync_idx_u32(tile, 0);
            ring = ptx::shfl_sync_idx_u32(ring, 0);
        }
        if tile >= args.tiles {
            return;
        }
        // The sizes and mask arguments through opaque copies: hoisted out of the tile loop,
        // what depends only on them would stay live in registers through every key loop.
        let p = &FwdParams {
            dims: ptx::opaque_copy(&p.dims),
            mask: ptx::opaque_copy(&p.mask),
            ..*p
        };
        let tiles_x = ptx::opaque_u32(args.tiles_x);
        let block = tile_block::<BM>(p, tile, tiles_x, longest_first);
        let mask = M::new(&p.mask, &block);
        let mut first = walk.first::<M, BM, BN>(&mask, block.row0);
        if M::WALK_READS_MEMORY {
            first = ptx::warp_uniform_tile(first);
        }
        let me = ThreadPos {
            lane: ptx::opaque_u32(me.lane),
            ..me
        };
        ring += consume::<E, M, D, BM, BN, D_TILES, N_TILES, STAGES, DROPOUT, true>(
            p,
            &block,
            &mask,
            layout,
            first,
            me,
            pingpong,
            t & 1,
            ring,
        );
        t += 1;
    }
}

/// Where the tiles and barriers live in dynamic shared memory (see the module docs).
#[derive(Clone, Copy)]
struct SmemLayout<const D: usize, const BM: usize, const BN: usize, const STAGES: usize> {
    base: u32,
}

impl<const D: usize, const BM: usize, const BN: usize, const STAGES: usize>
    SmemLayout<D, BM, BN, STAGES>
{
    /// The Q tile.
    #[inline(always)]
    fn q(self) -> GmmaTile<BM, D> {
        GmmaTile::at(self.base)
    }

    /// The K and V tiles of ring stage `s`.
    #[inline(always)]
    fn stage(self, s: u32) -> (GmmaTile<BN, D>, GmmaTile<BN, D>) {
        let bytes = GmmaTile::<BN, D>::BYTES;
        let at = self.base + GmmaTile::<BM, D>::BYTES + s * 2 * bytes;
        (GmmaTile::at(at), GmmaTile::at(at + bytes))
    }

    /// Whether O is staged through shared memory (the registry's tile says; persistence does
    /// not change the layout).
    const STAGED_OUTPUT: bool = crate::registry::wgmma_tile(D, BM, BN, false).staged_output;

    /// Consumer warp `warp`'s O stage (16 rows, see [`store_output_staged`]), after the ring.
    #[inline(always)]
    fn output_stage(self, warp: u32) -> u32 {
        self.ring_end() + warp * output_stage_bytes(D) as u32
    }

    /// The end of the ring.
    #[inline(always)]
    fn ring_end(self) -> u32 {
        self.base + GmmaTile::<BM, D>::BYTES + STAGES as u32 * 2 * GmmaTile::<BN, D>::BYTES
    }

    /// The barriers, after the ring and (when staged) the O stage.
    #[inline(always)]
    fn bars(self) -> Barriers<STAGES> {
        let output = if Self::STAGED_OUTPUT {
            (BM / MMA_M * output_stage_bytes(D)) as u32
        } else {
            0
        };
        Barriers {
            base: self.ring_end() + output,
        }
    }
}

/// The block's `mbarrier`s: `q_full`, then per stage `k_full`, `v_full`, `k_empty` and
/// `v_empty`.
#[derive(Clone, Copy)]
struct Barriers<const STAGES: usize> {
    base: u32,
}

impl<const STAGES: usize> Barriers<STAGES> {
    /// Completes when Q has landed: all of it (`part` 0), or where [`q_by_warpgroup`],
    /// consumer warpgroup `part`'s rows.
    #[inline(always)]
    fn q_full(self, part: u32) -> u32 {
        self.base + part * (8 * (1 + 4 * 3) + 16)
    }

    /// Completes when stage `s`'s K tile has landed.
    #[inline(always)]
    fn k_full(self, s: u32) -> u32 {
        self.base + 8 + 8 * s
    }

    /// Completes when stage `s`'s V tile has landed.
    #[inline(always)]
    fn v_full(self, s: u32) -> u32 {
        self.base + 8 + 8 * (STAGES as u32 + s)
    }

    /// Whether K and V of a stage are freed separately (see the module docs): in a ring of
    /// two stages. With three, one barrier frees both, when the tile's V has been read
    /// (a second barrier's address live across the softmax made ptxas spill the tree mask's
    /// kernel with dropout at d = 128).
    const SPLIT: bool = STAGES == 2;

    /// Completes when every consumer warp has finished reading stage `s`'s K tile.
    #[inline(always)]
    fn k_empty(self, s: u32) -> u32 {
        self.base + 8 + 8 * (2 * STAGES as u32 + s)
    }

    /// Completes when every consumer warp has finished reading stage `s`'s V tile (and its
    /// K, unless [`Self::SPLIT`]: then it is [`Self::k_empty`]).
    #[inline(always)]
    fn v_empty(self, s: u32) -> u32 {
        if Self::SPLIT {
            self.base + 8 + 8 * (3 * STAGES as u32 + s)
        } else {
            self.k_empty(s)
        }
    }

    /// Persistent blocks: completes when every consumer warp has finished reading Q (and the
    /// tile slot), after a query tile's key loop; where [`q_by_warpgroup`], every warp of
    /// consumer warpgroup `part`, its rows of Q. After the barriers of a ring of 3, then
    /// after the second `q_full`.
    #[inline(always)]
    fn q_empty(self, part: u32) -> u32 {
        self.base + 8 * (1 + 4 * 3) + part * 24
    }

    /// Persistent blocks: the index (u32) of the block's `t`-th query tile, written by the
    /// producer before it arrives on `q_full`; two slots, alternate tiles (with Q by
    /// warpgroup one warpgroup may read tile `t + 1`'s before the other is done with `t`).
    #[inline(always)]
    fn tile_slot(self, t: u32) -> u32 {
        self.q_empty(0) + 8 + 4 * (t & 1)
    }

    /// Initialises every barrier (one thread) for `warps` consumer warps (and `q_empty` in
    /// a persistent block; per warpgroup where [`q_by_warpgroup`]).
    #[inline(always)]
    unsafe fn init(self, warps: u32, persistent: bool, by_warpgroup: bool) {
        ptx::mbarrier_init(self.q_full(0), 1);
        if by_warpgroup {
            ptx::mbarrier_init(self.q_full(1), 1);
            ptx::mbarrier_init(self.q_empty(0), warps / 2);
            ptx::mbarrier_init(self.q_empty(1), warps / 2);
        } else if persistent {
            ptx::mbarrier_init(self.q_empty(0), warps);
        }
        for s in 0..STAGES as u32 {
            ptx::mbarrier_init(self.k_full(s), 1);
            ptx::mbarrier_init(self.v_full(s), 1);
            ptx::mbarrier_init(self.k_empty(s), warps);
            if Self::SPLIT {
                ptx::mbarrier_init(self.v_empty(s), warps);
            }
        }
        ptx::fence_mbarrier_init();
    }
}

/// The consumer warpgroups' turns at issuing products ([`SCHEDULE_PINGPONG`]), round robin:
/// warpgroup `w` of `count` waits at its named barrier ([`Turns::barrier`]; 256 threads: its own
/// wait, the previous warpgroup's arrival) and, once its products are issued, arrives at the
/// next one's. All run the same key tiles, so the arrivals and waits pair up exactly: the
/// last warpgroup arrives once before the loop (warpgroup 0 goes first) and skips its
/// arrival in its last turn.
///
/// Chained (`chained`, where [`q_by_warpgroup`]): the turns run on across a persistent
/// block's query tiles, as one sequence. The last warpgroup arrives once before the block's
/// first tile ([`Turns::start_chain`]) and in every turn, its last one of a query tile too,
/// so warpgroup 0 can issue its next tile's products while the last warpgroup finishes this
/// one. Both warpgroups walk the same key tiles, so the arrivals still pair up; the block's
/// very last arrival is left unawaited when it exits.
#[derive(Clone, Copy)]
struct Turns {
    on: bool,
    wg: u32,
    count: u32,
    chained: bool,
}

impl Turns {
    /// The turns of warpgroup `wg` of a block of `BM` rows.
    #[inline(always)]
    fn of<const BM: usize>(on: bool, wg: u32, chained: bool) -> Self {
        Self {
            on,
            wg,
            count: (BM / WG_ROWS) as u32,
            chained,
        }
    }

    /// Once per persistent block, before its first query tile, where `chained`: the last
    /// warpgroup lets warpgroup 0 go first.
    #[inline(always)]
    unsafe fn start_chain(self) {
        if self.on && self.chained && self.wg == self.count - 1 {
            ptx::bar_arrive_named(self.barrier(0), 2 * WG_THREADS);
        }
    }

    /// Named barrier of warpgroup `wg`'s turn: after `bar.sync`'s 0 and the warpgroups' own
    /// (`1 ..= count`).
    #[inline(always)]
    fn barrier(self, wg: u32) -> u32 {
        1 + self.count + wg
    }

    /// Before the first turn of a query tile: the last warpgroup lets warpgroup 0 go first
    /// (unless `chained`: see [`Turns::start_chain`]).
    #[inline(always)]
    unsafe fn start(self) {
        if self.on && !self.chained && self.wg == self.count - 1 {
            ptx::bar_arrive_named(self.barrier(0), 2 * WG_THREADS);
        }
    }

    /// Waits for this warpgroup's turn.
    #[inline(always)]
    unsafe fn wait(self) {
        if self.on {
            ptx::bar_sync_named(self.barrier(self.wg), 2 * WG_THREADS);
        }
    }

    /// Gives the turn to the next warpgroup (unless this is the last warpgroup's last turn of
    /// a query tile, which warpgroup 0 does not wait for, and the turns are not `chained`).
    #[inline(always)]
    unsafe fn pass(self, last: bool) {
        let wraps = self.wg == self.count - 1;
        if self.on && !(last && wraps && !self.chained) {
            // Two: the other one, as `1 − wg` (the same PTX as before a third warpgroup existed:
            // the 240-register kernels' allocation moves with any change).
            let next = match (self.count, wraps) {
                (2, _) => 1 - self.wg,
                (_, true) => 0,
                (_, false) => self.wg + 1,
            };
            ptx::bar_arrive_named(self.barrier(next), 2 * WG_THREADS);
        }
    }
}

/// The order in which a block walks its query tile's key tiles; the producer and the
/// consumers walk the same way. Upwards ([`Walk::of`]) or the mask's own walk, from its last
/// tile down.
#[derive(Clone, Copy)]
struct Walk {
    up: bool,
}

impl Walk {
    /// The walk of a kernel: upwards for blocks of two consumer warpgroups over masks whose
    /// tiles are one run (causal, windows) at d ≤ 128 without dropout. The tile a causal mask
    /// cuts then comes last, its masked softmax beside the previous tile's P·V, and the query
    /// tile's first softmax, which no product covers, is an unmasked one. The others walk
    /// down: three consumer warpgroups skip the block's leading tiles their own rows do not
    /// see, which that order puts first; at d = 256 and with dropout, the upward walk made
    /// the calls without a mask 0.6–0.9 % slower for at most 0.5 % on causal ones
    /// (docs/perf-notes.md).
    const fn of<M: AttnMask, const D: usize, const BM: usize, const DROPOUT: bool>() -> Self {
        Self {
            up: M::CONTIGUOUS_WALK && BM == 2 * WG_ROWS && D <= 128 && !DROPOUT,
        }
    }

    /// The first key tile a block of `BM` rows from `row0` visits (`None`: no row sees a
    /// key).
    #[inline(always)]
    fn first<M: AttnMask, const BM: usize, const BN: usize>(
        self,
        mask: &M,
        row0: u32,
    ) -> Option<u32> {
        let last = mask.first_key_tile(row0, BM as u32, BN as u32)?;
        Some(if self.up {
            mask.lowest_key_tile(row0, BN as u32)
        } else {
            last
        })
    }

    /// The key tile visited after tile `n`, or `None` after the last.
    #[inline(always)]
    fn next<M: AttnMask, const BM: usize, const BN: usize>(
        self,
        mask: &M,
        row0: u32,
        n: u32,
    ) -> Option<u32> {
        if self.up {
            let last = mask.first_key_tile(row0, BM as u32, BN as u32)?;
            (n < last).then_some(n + 1)
        } else {
            mask.next_key_tile(row0, BM as u32, BN as u32, n)
        }
    }
}

/// Ring stage and phase parity of the `j`-th key tile of the loop.
#[inline(always)]
fn ring<const STAGES: usize>(j: u32) -> (u32, u32) {
    (j % STAGES as u32, (j / STAGES as u32) & 1)
}

/// The producer: Q (as `q_load` says), then each key tile the mask visits into the next free
/// stage, the first being the ring's `ring0`-th tile; returns the ring's count after the
/// last. Run by one thread, or by a warp whose `leader` lane alone arrives and issues the
/// copies.
#[inline(always)]
unsafe fn produce<
    M: AttnMask,
    const D: usize,
    const BM: usize,
    const BN: usize,
    const STAGES: usize,
>(
    maps: u64,
    block: &BlockInfo,
    mask: &M,
    layout: SmemLayout<D, BM, BN, STAGES>,
    walk: Walk,
    first: u32,
    ring0: u32,
    leader: bool,
    q_load: QLoad,
) -> u32 {
    let (map_q, map_k, map_v) = (
        maps,
        maps + TENSOR_MAP_BYTES as u64,
        maps + 2 * TENSOR_MAP_BYTES as u64,
    );
    let bars = layout.bars();
    let (q, row0, head, batch) = (layout.q(), block.row0, block.head, block.batch);
    if q_load.by_warpgroup {
        let (bytes, t) = (GmmaTile::<BM, D>::BYTES / 2, q_load.tile);
        if leader {
            prefetch_maps([map_q, map_k, map_v]);
            ptx::mbarrier_arrive_expect_tx(bars.q_full(0), bytes);
            q.load_tma_rows::<WG_ROWS>(map_q, row0, head, batch, bars.q_full(0), 0, WG_ROWS);
        }
        if t > 0 {
            ptx::mbarrier_wait(bars.q_empty(1), (t - 1) & 1);
        }
        if leader {
            ptx::mbarrier_arrive_expect_tx(bars.q_full(1), bytes);
            let bar = bars.q_full(1);
            q.load_tma_rows::<WG_ROWS>(map_q, row0, head, batch, bar, WG_ROWS, WG_ROWS);
        }
    } else if leader {
        prefetch_maps([map_q, map_k, map_v]);
        ptx::mbarrier_arrive_expect_tx(bars.q_full(0), GmmaTile::<BM, D>::BYTES);
        q.load_tma(map_q, row0, head, batch, bars.q_full(0));
    }
    let (mut n, mut j) = (first, ring0);
    loop {
        let (s, phase) = ring::<STAGES>(j);
        let (k, v) = layout.stage(s);
        let (key0, bytes) = (n * BN as u32, GmmaTile::<BN, D>::BYTES);
        ptx::mbarrier_wait(bars.k_empty(s), phase ^ 1); // fresh barriers: every stage free
        if leader {
            ptx::mbarrier_arrive_expect_tx(bars.k_full(s), bytes);
            k.load_tma(map_k, key0, block.kv_head, block.batch, bars.k_full(s));
        }
        ptx::mbarrier_wait(bars.v_empty(s), phase ^ 1);
        if leader {
            ptx::mbarrier_arrive_expect_tx(bars.v_full(s), bytes);
            v.load_tma(map_v, key0, block.kv_head, block.batch, bars.v_full(s));
        }
        j += 1;
        match walk.next::<M, BM, BN>(mask, block.row0, n) {
            // Opaque: with the ring's count returned, LLVM unrolled this loop by two where the
            // mask's walk has a computable length (the tree mask's), and the 24-register
            // producer spilled.
            Some(next) => n = ptx::opaque_u32(next),
            None => break,
        }
    }
    j
}

/// A consumer warpgroup's part: the key loop over its 64 rows
/// ([`Pipeline::consume_overlapped`] with two consumer warpgroups,
/// [`Pipeline::consume_in_turn`] with three), then O and LSE; returns the key tiles it read. `me` counts threads and warps from the first consumer; Q is the `q_full`
/// phase of parity `q_phase`, the first key tile the ring's `ring0`-th. In a persistent block
/// each warp frees Q (`q_empty`) as soon as its warpgroup is done reading it (in the loops:
/// after the last S = Q·Kᵀ, or the softmax that may compute it again; here for a tile
/// without keys), so the next tile's Q loads during the last P·V and the O and LSE stores.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn consume<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const BM: usize,
    const BN: usize,
    const D_TILES: usize,
    const N_TILES: usize,
    const STAGES: usize,
    const DROPOUT: bool,
    const PERSISTENT: bool,
>(
    p: &FwdParams,
    block: &BlockInfo,
    mask: &M,
    layout: SmemLayout<D, BM, BN, STAGES>,
    first: Option<u32>,
    me: ThreadPos,
    pingpong: bool,
    q_phase: u32,
    ring0: u32,
) -> u32 {
    let warp_m0 = me.warp as usize * MMA_M; // first row of this warp
    let wg = me.warp / 4;
    let wg_m0 = wg as usize * WG_ROWS; // first row of this warpgroup
    let by_warpgroup = q_by_warpgroup(BM, PERSISTENT);
    let q_part = if by_warpgroup { wg } else { 0 }; // its `q_full` and `q_empty`
    let mut o = AccTile::<1, D_TILES>::zero();
    let mut softmax = OnlineSoftmax::<1>::new();
    let row0 = block.row0;
    let mut tiles = 0;
    if let Some(first) = first {
        let pos = FragPos::of(me.lane);
        let rows = RowVec::<u32, 1>::from_fn(|_, r| row0 + pos.row(0, r) + warp_m0 as u32);
        let pipe = Pipeline::<E, M, D, BM, BN, STAGES, DROPOUT> {
            layout,
            lane: me.lane,
            wg_m0,
            mask,
            rows,
            row0,
            rng: rng_for(&p.dropout, block.batch, block.head, p.dims.heads_q),
            scale: p.scale_log2.abs(),
            ring0,
            frees_q: PERSISTENT,
            q_part,
            walk: Walk::of::<M, D, BM, DROPOUT>(),
            elem: PhantomData,
        };
        ptx::mbarrier_wait(layout.bars().q_full(q_part), q_phase);
        if p.scale_log2 < 0.0 {
            // softmax(s·c), c < 0, is softmax((−Q)·Kᵀ·|c|): each warpgroup negates its rows.
            let t = me.tid % WG_THREADS;
            layout
                .q()
                .negate_rows::<WG_ROWS, { WG_THREADS as usize }>(wg_m0, t);
            ptx::fence_proxy_async_shared_cta();
            ptx::bar_sync_named(1 + wg, WG_THREADS);
        }
        let turns = Turns::of::<BM>(pingpong, wg, by_warpgroup);
        tiles = if BM == 2 * WG_ROWS {
            pipe.consume_overlapped::<D_TILES, N_TILES>(first, turns, &mut o, &mut softmax)
        } else {
            pipe.consume_in_turn::<D_TILES, N_TILES>(first, turns, &mut o, &mut softmax)
        };
        if PERSISTENT {
            // The loops leave the last tile's stage held (a one-tile block ends there); the
            // ring runs on into the next query tile.
            pipe.release_v(tiles - 1);
        }
    }
    if PERSISTENT && first.is_none() {
        // No product read Q (the loops free it once done reading it).
        ptx::mbarrier_arrive_if(layout.bars().q_empty(q_part), me.lane == 0);
    }
    let o_scale = if DROPOUT { p.dropout.scale } else { 1.0 };
    let first_row = row0 + warp_m0 as u32;
    if SmemLayout::<D, BM, BN, STAGES>::STAGED_OUTPUT {
        let stage = layout.output_stage(me.warp);
        store_output_staged::<E, M, D_TILES>(
            p, block, mask, first_row, &o, &softmax, o_scale, me.lane, stage,
        );
    } else {
        store_output_by_quads::<E, M, D_TILES>(
            p, block, mask, first_row, &o, &softmax, o_scale, me.lane,
        );
    }
    tiles
}

/// What a consumer thread needs to run the key loop: the shared-memory layout, its rows, the
/// mask and the dropout generator. Methods, not closures: a closure that LLVM leaves out of
/// line moves the register tiles it takes by reference to local memory.
struct Pipeline<
    'a,
    E,
    M,
    const D: usize,
    const BM: usize,
    const BN: usize,
    const STAGES: usize,
    const DROPOUT: bool,
> {
    layout: SmemLayout<D, BM, BN, STAGES>,
    lane: u32,
    /// First row of the thread's warpgroup in the block.
    wg_m0: usize,
    mask: &'a M,
    rows: RowVec<u32, 1>,
    row0: u32,
    rng: DropoutRng,
    /// `|softmax_scale|·log2(e)`.
    scale: f32,
    /// The ring's count at the query tile's first key tile (0 but in persistent blocks).
    ring0: u32,
    /// Whether the warps free Q (`q_empty`) once done reading it, before the last P·V
    /// (persistent blocks, in which the producer then loads the next query tile's Q while
    /// the warps finish this one).
    frees_q: bool,
    /// The `q_empty` this warp arrives on: its warpgroup's where [`q_by_warpgroup`], else 0.
    q_part: u32,
    /// The order of the key tiles, the producer's.
    walk: Walk,
    elem: PhantomData<E>,
}

impl<
        E: Elem,
        M: AttnMask,
        const D: usize,
        const BM: usize,
        const BN: usize,
        const STAGES: usize,
        const DROPOUT: bool,
    > Pipeline<'_, E, M, D, BM, BN, STAGES, DROPOUT>
{
    /// The rows whose visibility decides which key tiles this warpgroup masks and skips
    /// (first row in the sequence, count): its own 64 with three consumer warpgroups (in a
    /// 192-row block under a causal mask, a 64-row warpgroup cuts one 128-key tile where the
    /// block cuts two or three); the block's with two (aligned 128-row blocks of 128-key
    /// tiles gain nothing, and the 240-register kernels keep their allocation).
    #[inline(always)]
    fn own_rows(&self) -> (u32, u32) {
        if BM > 2 * WG_ROWS {
            (self.row0 + self.wg_m0 as u32, WG_ROWS as u32)
        } else {
            (self.row0, BM as u32)
        }
    }

    /// Waits until the K tile of loop tile `i` has landed.
    #[inline(always)]
    unsafe fn wait_k(&self, i: u32) {
        let (s, phase) = ring::<STAGES>(self.ring0 + i);
        ptx::mbarrier_wait(self.layout.bars().k_full(s), phase);
    }

    /// Waits until the V tile of loop tile `i` has landed.
    #[inline(always)]
    unsafe fn wait_v(&self, i: u32) {
        let (s, phase) = ring::<STAGES>(self.ring0 + i);
        ptx::mbarrier_wait(self.layout.bars().v_full(s), phase);
    }

    /// Tells the producer this warp is done with the K tile of loop tile `i` (after the
    /// warpgroup's product that read it completed, which every lane waited for): lane 0
    /// arrives, by a predicated instruction (a branch on the lane index among the `wgmma`s
    /// would make ptxas serialize them).
    #[inline(always)]
    unsafe fn release_k(&self, i: u32) {
        let bar = self.layout.bars().k_empty(ring::<STAGES>(self.ring0 + i).0);
        ptx::mbarrier_arrive_if(bar, self.lane == 0);
    }

    /// Frees Q for the next query tile's load (in persistent blocks; `frees_q` is a constant
    /// there) where `last`: once the warpgroup's last S = Q·Kᵀ completed (Q's one reader,
    /// but for [`Self::recompute_s`]: the loop of three calls it after the softmax).
    /// Predicated, like [`Self::release_k`], so no branch sits among the `wgmma`s.
    #[inline(always)]
    unsafe fn release_q(&self, last: bool) {
        if self.frees_q {
            let bar = self.layout.bars().q_empty(self.q_part);
            ptx::mbarrier_arrive_if(bar, last && self.lane == 0);
        }
    }

    /// As [`Self::release_k`], for the V tile of loop tile `i` (and its K, in a ring of three).
    #[inline(always)]
    unsafe fn release_v(&self, i: u32) {
        let bar = self.layout.bars().v_empty(ring::<STAGES>(self.ring0 + i).0);
        ptx::mbarrier_arrive_if(bar, self.lane == 0);
    }

    /// Issues and commits `S = Q·Kᵀ` of loop tile `i` for the warpgroup's 64 rows (one
    /// `m64nBNk16` product per 16 columns of the head dim). Above d = 128, Q's descriptors
    /// are recomputed at each call: kept in registers through the key loop (LLVM hoists
    /// them), the 16 of d = 256 take 32 registers the consumer does not have (ptxas then
    /// drops `setmaxnreg` and serialises every `wgmma`).
    #[inline(always)]
    unsafe fn issue_s<const NT: usize>(&self, s: &mut AccTile<1, NT>, i: u32) {
        let q = if D > 128 {
            self.layout.q().opaque()
        } else {
            self.layout.q()
        };
        let k = self.layout.stage(ring::<STAGES>(self.ring0 + i).0).0;
        for ks in 0..D / 16 {
            let (a, b) = (q.k_major(self.wg_m0, ks), k.k_major(0, ks));
            match BN {
                176 => E::wgmma_n176_ss(s.tiles_mut::<22>(0, 0), a, b, ks > 0),
                128 => E::wgmma_n128_ss(s.tiles_mut::<16>(0, 0), a, b, ks > 0),
                _ => E::wgmma_n64_ss(s.tiles_mut::<8>(0, 0), a, b, ks > 0),
            }
        }
        ptx::wgmma_commit_group();
    }

    /// Issues and commits `O += P·V` of loop tile `i`, P from registers: at d = 128 one
    /// `m64n128k16` per 16 keys (V's two 64-column blocks, the descriptor's leading byte
    /// offset apart), else one `m64n64k16` per 16 keys and 64 columns of O (at d = 256 the
    /// wider product made the general mask's kernel with dropout spill).
    #[inline(always)]
    unsafe fn issue_pv<const NT: usize, const DT: usize>(
        &self,
        o: &mut AccTile<1, DT>,
        p: &PackedTile<1, NT>,
        i: u32,
    ) {
        let v = self.layout.stage(ring::<STAGES>(self.ring0 + i).0).1;
        for kk in 0..BN / 16 {
            let a = p.a_fragment::<E>(0, kk);
            if D == 2 * BLOCK_COLS {
                E::wgmma_n128_rs(o.tiles_mut::<16>(0, 0), a, v.mn_major(kk, 0));
            } else {
                for cb in 0..D / BLOCK_COLS {
                    let acc = o.tiles_mut::<{ BLOCK_COLS / 8 }>(0, cb * BLOCK_COLS / 8);
                    E::wgmma_n64_rs(acc, a, v.mn_major(kk, cb));
                }
            }
        }
        ptx::wgmma_commit_group();
    }

    /// The register-tile step of key tile `n` (see [`KeyTile`]).
    #[inline(always)]
    fn key_tile(&self, n: u32) -> KeyTile<'_, M, 1> {
        KeyTile {
            mask: self.mask,
            rows: &self.rows,
            key0: n * BN as u32,
            lane: self.lane,
            scale: self.scale,
            rng: &self.rng,
            by_interval: !DROPOUT,
        }
    }

    /// The consumers' softmax schedule: O rescaled rarely; a consumer warp has no other warp
    /// of its own to hide the reductions' latency behind (see `device::softmax`).
    const TUNING: Tuning = Tuning {
        lazy_max: true,
        two_chains: true,
    };

    /// P (in place) from S of key tile `n`; returns the factor O's rows must be multiplied by,
    /// if a row maximum moved. Dropout comes when P is packed ([`Self::pack_p`]).
    #[inline(always)]
    unsafe fn softmax<const NT: usize>(
        &self,
        s: &mut AccTile<1, NT>,
        softmax: &mut OnlineSoftmax<1>,
        n: u32,
    ) -> Option<RowVec<f32, 1>> {
        let (tile, tuning) = (self.key_tile(n), Self::TUNING);
        let mut factor = None;
        if self
            .mask
            .tile_needs_mask(self.row0, BM as u32, n, BN as u32)
        {
            tile.scores_to_probabilities::<true, false, NT>(s, softmax, &mut factor, tuning);
        } else {
            tile.scores_to_probabilities::<false, false, NT>(s, softmax, &mut factor, tuning);
        }
        factor
    }

    /// P of key tile `n` packed to 16 bits for its product, and with dropout, its dropped
    /// probabilities zeroed there: once, after the masked and unmasked branches met (LLVM does
    /// not merge the branches' copies itself: they hold inline asm), and a pair at a time.
    #[inline(always)]
    unsafe fn pack_p<const NT: usize>(&self, s: &AccTile<1, NT>, n: u32) -> PackedTile<1, NT> {
        let mut p = PackedTile::<1, NT>::pack::<E>(s);
        if DROPOUT {
            self.key_tile(n).drop_out_packed(&mut p);
        }
        p
    }

    /// Whether the softmax of a key tile after the warpgroup's first is first tried at the
    /// rows' reference points ([`KeyTile::scores_to_probabilities_at_reference`]: the
    /// exponentials need not wait for the tile's row maxima; the warpgroup then votes at its
    /// named barrier whether a row maximum moved, and if so computes S again, its K still in
    /// the ring of three stages), in the loop of three consumer warpgroups
    /// ([`Self::probabilities`]; d = 64: 0–5 % faster, docs/perf-notes.md), with masks
    /// tested by row interval and without dropout. In the loop of two (d = 128) it was within
    /// noise; there, with dropout or the block-sparse mask ptxas spilled 8–240 B, with the
    /// tree mask it serialised the `wgmma`s.
    const AT_REFERENCE: bool = STAGES == 3 && M::ROW_INTERVAL && !DROPOUT;

    /// Whether any thread of this warpgroup has `moves` (its named barrier, `bar.red.or`).
    #[inline(always)]
    unsafe fn warpgroup_any(&self, moves: bool) -> bool {
        let wg = (self.wg_m0 / WG_ROWS) as u32;
        ptx::bar_red_or_named(1 + wg, WG_THREADS, moves)
    }

    /// Computes S of loop tile `i` again (its K is still in the ring), for the rare tile
    /// whose softmax at the reference points found a row maximum moving; waits for every
    /// product in flight.
    #[inline(always)]
    unsafe fn recompute_s<const NT: usize>(&self, s: &mut AccTile<1, NT>, i: u32) {
        ptx::wgmma_fence();
        self.issue_s(s, i);
        ptx::wgmma_wait_group::<0>();
        ptx::wgmma_fence_operands(s.tiles_mut::<NT>(0, 0));
    }

    /// As [`Self::softmax`] for a warpgroup whose O is not in flight, key tile `n`, loop tile
    /// `i`, tried first at the reference points where `later` (not the warpgroup's first
    /// tile; see [`Self::AT_REFERENCE`]): O is rescaled at once and P packed inside each
    /// branch (masked tile or not), so the branches meet on P and O. Meeting on S and the
    /// factor, ptxas copied 30-odd scores between registers in the unmasked branch of the
    /// plain kind's kernel.
    #[inline(always)]
    unsafe fn probabilities<const NT: usize, const DT: usize>(
        &self,
        s: &mut AccTile<1, NT>,
        softmax: &mut OnlineSoftmax<1>,
        o: &mut AccTile<1, DT>,
        n: u32,
        i: u32,
        later: bool,
    ) -> PackedTile<1, NT> {
        let (own_row0, own_rows) = self.own_rows();
        let at_reference = Self::AT_REFERENCE && later;
        if self.mask.tile_needs_mask(own_row0, own_rows, n, BN as u32) {
            self.probabilities_as::<true, NT, DT>(s, softmax, o, n, i, at_reference)
        } else {
            self.probabilities_as::<false, NT, DT>(s, softmax, o, n, i, at_reference)
        }
    }

    /// [`Self::probabilities`] of a tile that is `MASKED` or not.
    #[inline(always)]
    unsafe fn probabilities_as<const MASKED: bool, const NT: usize, const DT: usize>(
        &self,
        s: &mut AccTile<1, NT>,
        softmax: &mut OnlineSoftmax<1>,
        o: &mut AccTile<1, DT>,
        n: u32,
        i: u32,
        at_reference: bool,
    ) -> PackedTile<1, NT> {
        let (tile, tuning) = (self.key_tile(n), Self::TUNING);
        if at_reference {
            let any = |moves| self.warpgroup_any(moves);
            if tile
                .scores_to_probabilities_at_reference::<MASKED, false, NT>(s, softmax, tuning, any)
            {
                return self.pack_p(s, n);
            }
            self.recompute_s(s, i);
        }
        tile.scores_to_probabilities::<MASKED, false, NT>(s, softmax, o, tuning);
        self.pack_p(s, n)
    }

    /// The key loop of two consumer warpgroups (see the module docs' drawing): the softmax of
    /// tile i + 1 runs while the warpgroup's own P·V of tile i does, and, taking turns, while the
    /// other warpgroup's products do.
    #[inline(always)]
    unsafe fn consume_overlapped<const D_TILES: usize, const N_TILES: usize>(
        &self,
        mut first: u32,
        turns: Turns,
        o: &mut AccTile<1, D_TILES>,
        softmax: &mut OnlineSoftmax<1>,
    ) -> u32 {
        if M::WALK_READS_MEMORY && !DROPOUT {
            // Every tile of the walk through lane 0, the first too (see `next` below); not
            // with dropout, where the one more register made ptxas spill at d = 128.
            first = ptx::shfl_sync_idx_u32(first, 0);
        }
        let early_k = Barriers::<STAGES>::SPLIT; // else K is freed with its tile's V
        let (mask, row0) = (self.mask, self.row0);
        let mut s = AccTile::<1, N_TILES>::zero();
        self.wait_k(0);
        ptx::wgmma_fence();
        self.issue_s(&mut s, 0);
        ptx::wgmma_wait_group::<0>();
        ptx::wgmma_fence_operands(s.tiles_mut::<N_TILES>(0, 0));
        if early_k {
            self.release_k(0);
        }
        self.softmax(&mut s, softmax, first); // O is still zero: nothing to rescale
        let mut p_cur = self.pack_p(&s, first);
        let mut next = self.walk.next::<M, BM, BN>(mask, row0, first);
        if M::WALK_READS_MEMORY {
            // Through lane 0, so that the loop's tiles (and the stages and descriptors derived
            // from them) are known warp-uniform; a constant test, the other masks' code is
            // unchanged.
            next = ptx::warp_uniform_tile(next);
        }
        self.release_q(next.is_none()); // a one-tile query tile: after its softmax
        if next.is_some() {
            turns.start();
        }
        // Tile `i` has its P in `p_cur`; tile `i + 1` is `next`.
        let mut i = 0u32;
        while let Some(n) = next {
            let mut after = self.walk.next::<M, BM, BN>(mask, row0, n);
            if M::WALK_READS_MEMORY {
                after = ptx::warp_uniform_tile(after);
            }
            // S of tile i + 1 and O += P·V of tile i, both on the tensor cores; the softmax of
            // tile i + 1 runs while the second product does (and, taking turns, while the
            // other warpgroup's products do).
            self.wait_k(i + 1);
            self.wait_v(i);
            turns.wait();
            ptx::wgmma_fence();
            self.issue_s(&mut s, i + 1);
            self.issue_pv(o, &p_cur, i);
            turns.pass(after.is_none());
            ptx::wgmma_wait_group::<1>();
            ptx::wgmma_fence_operands(s.tiles_mut::<N_TILES>(0, 0));
            self.release_q(after.is_none());
            if early_k {
                self.release_k(i + 1);
            }
            let factor = self.softmax(&mut s, softmax, n);
            ptx::wgmma_wait_group::<0>();
            ptx::wgmma_fence_operands(o.tiles_mut::<D_TILES>(0, 0));
            self.release_v(i);
            if let Some(factor) = factor {
                o.scale_rows(&factor); // O ·= 2^(m − m'), now that P·V of tile i is in
            }
            p_cur = self.pack_p(&s, n);
            i += 1;
            next = after;
        }
        self.wait_v(i);
        ptx::wgmma_fence();
        self.issue_pv(o, &p_cur, i);
        ptx::wgmma_wait_group::<0>();
        ptx::wgmma_fence_operands(o.tiles_mut::<D_TILES>(0, 0));
        i + 1
    }

    /// The key loop of three consumer warpgroups: a warpgroup's products and its softmax run in
    /// turn, so only S and O are live through the softmax (P exists from the softmax's end until
    /// its P·V completes). Per tile `i`, in the warpgroup's turn: issue S = Q·Kᵢᵀ (P·Vᵢ₋₁,
    /// issued at the end of the previous step, runs ahead of it); wait for both; free the
    /// stage of tile i − 1 (and, in a ring of two, K of tile i); Pᵢ ← softmax; O ·= rescale;
    /// issue O += Pᵢ·Vᵢ. Each warpgroup masks by its own 64 rows and passes its turn without a
    /// product at the block's leading tiles none of them sees ([`Pipeline::own_rows`]).
    #[inline(always)]
    unsafe fn consume_in_turn<const D_TILES: usize, const N_TILES: usize>(
        &self,
        first: u32,
        turns: Turns,
        o: &mut AccTile<1, D_TILES>,
        softmax: &mut OnlineSoftmax<1>,
    ) -> u32 {
        let early_k = Barriers::<STAGES>::SPLIT; // else K is freed with its tile's V
        let (mask, row0, bn) = (self.mask, self.row0, BN as u32);
        let mut s = AccTile::<1, N_TILES>::zero();
        turns.start();
        let (mut n, mut i) = (first, 0u32);
        // The block's leading key tiles that none of this warpgroup's rows see (under a causal
        // mask, the last one or two for the first 64 or 128 rows; every tile for rows past the
        // sequence): no product, only the turn, and the stages freed as the loop below frees
        // them (V one tile later), each after its loads landed (an arrival before then would
        // count towards the stage's previous use).
        let (own_row0, own_rows) = self.own_rows();
        while own_row0 >= mask.seqlen_q() || !mask.visits_key_tile(own_row0, own_rows, n, bn) {
            let after = self.walk.next::<M, BM, BN>(mask, row0, n);
            self.wait_k(i);
            self.wait_v(i);
            turns.wait();
            turns.pass(after.is_none());
            self.release_q(after.is_none()); // this warpgroup reads no Q in this query tile
            if i > 0 {
                self.release_v(i - 1);
            }
            if early_k {
                self.release_k(i);
            }
            match after {
                Some(next) => n = next,
                None => return i + 1, // the last stage stays held, as after the loop below
            }
            i += 1;
        }
        let skipped = i;
        loop {
            let after = self.walk.next::<M, BM, BN>(mask, row0, n);
            self.wait_k(i);
            turns.wait();
            ptx::wgmma_fence();
            self.issue_s(&mut s, i);
            turns.pass(after.is_none());
            ptx::wgmma_wait_group::<0>();
            ptx::wgmma_fence_operands(s.tiles_mut::<N_TILES>(0, 0));
            ptx::wgmma_fence_operands(o.tiles_mut::<D_TILES>(0, 0));
            if i > 0 {
                self.release_v(i - 1);
            }
            if early_k {
                self.release_k(i);
            }
            // P·V of tile i − 1 is in; the warpgroup's first tile sets the reference points.
            let p_cur = self.probabilities(&mut s, softmax, o, n, i, i > skipped);
            // Q is free only now: a softmax at the reference points may compute S again.
            self.release_q(after.is_none());
            self.wait_v(i);
            ptx::wgmma_fence();
            self.issue_pv(o, &p_cur, i);
            match after {
                Some(next) => n = next,
                None => break,
            }
            i += 1;
        }
        ptx::wgmma_wait_group::<0>();
        ptx::wgmma_fence_operands(o.tiles_mut::<D_TILES>(0, 0));
        i + 1
    }
}
