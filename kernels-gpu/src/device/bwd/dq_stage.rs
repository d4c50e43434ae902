//! The backward's dQ stage (sm_90): a query tile's dQ, `[BM][D + 8]` f32 in shared memory,
//! added into the f32 accumulator by the bulk copy engine with one reduction per row, and the
//! stage's record of the tile it holds (in the padding of its first row).
//!
//! Protocol, per query tile (both backward kernels): the warps write their dQ into the stage
//! and fence it for the async proxy ([`ptx::fence_proxy_async_shared_cta`]); thread 0 records
//! the tile ([`DqStage::set_staged_tile`]); after the next barrier, [`DqStage::flush`] starts
//! the adds; the flushing threads wait until the engine has read their rows
//! ([`DqStage::wait_flushed`]) before the barrier after which the stage is written again, and
//! the adds themselves complete before the grid does ([`DqStage::finish`]). In deterministic
//! mode they also wait for the adds, and thread 0 waits for the staged tile's turn before the
//! flush's barrier and passes it once the adds completed.

use super::{block_for, order};
use crate::device::ptx;
use crate::params::BwdParams;

/// The words of the stage's record ([`DqStage::record`]).
#[derive(Clone, Copy)]
pub(super) enum StageRecord {
    /// The query head of the staged tile.
    Head = 0,
    /// The staged query tile (`u32::MAX`: none).
    Tile = 1,
    /// Deterministic mode: the turn to pass once the staged tile is added.
    Next = 2,
    /// Deterministic mode: the turn of the tile being computed, until it is staged.
    PendingNext = 3,
    /// The walk's look-ahead slots (block-sparse kernels, [`DqStage::walk_slot`]): the query
    /// head of slot 0; its tile is the next word, slot 1's head and tile the two after.
    #[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // the sm_90a block-sparse walk
    WalkHead = 4,
}

/// The dQ stage of a block with `BM`-row query tiles at compiled head dim `D`, at shared
/// address `at` (16-byte aligned; [`crate::config::BwdTile::smem_bytes`] counts it).
#[derive(Clone, Copy)]
pub(super) struct DqStage<const BM: usize, const D: usize> {
    at: u32,
}

impl<const BM: usize, const D: usize> DqStage<BM, D> {
    /// Bytes of the stage, record included.
    #[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // the sm_90a block-sparse walk
    pub(super) const BYTES: u32 = (4 * BM * (D + 8)) as u32;

    /// The stage at shared address `at`.
    #[inline(always)]
    pub(super) fn at(at: u32) -> Self {
        Self { at }
    }

    /// Shared address of dQ element (`row`, `col`) (`D + 8` f32 per row: see
    /// [`crate::config::BwdTile::dq_stage_pitch`]).
    #[inline(always)]
    pub(super) fn addr(self, row: u32, col: u32) -> u32 {
        self.at + 4 * (row * (D as u32 + 8) + col)
    }

    /// Shared address of a word of the record (the padding after the `D` dQ columns of the
    /// first row).
    #[inline(always)]
    pub(super) fn record(self, word: StageRecord) -> u32 {
        self.addr(0, D as u32 + word as u32)
    }

    /// The walk's look-ahead slot `parity` (0 or 1): where one warp of a block-sparse kernel
    /// leaves the query tile after the one the next step loads (`u32::MAX` as the tile: none),
    /// so the other warps do not walk the mask's bits themselves (see `wgmma::key_tile`).
    #[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // the sm_90a block-sparse walk
    #[inline(always)]
    pub(super) fn walk_slot(self, parity: u32) -> WalkSlot {
        WalkSlot {
            head: self.record(StageRecord::WalkHead) + 8 * parity,
        }
    }

    /// Records which query tile `(head, i)` the stage holds (`None`: none), kept in shared
    /// memory rather than registers through the loop, and in deterministic mode the turn to
    /// pass once it is added ([`order::next_in_turn`]).
    #[inline(always)]
    pub(super) unsafe fn set_staged_tile(self, tile: Option<(u32, u32)>, next: u32) {
        let (head, i) = tile.unwrap_or((0, u32::MAX));
        ptx::st_shared_u32(self.record(StageRecord::Head), head);
        ptx::st_shared_u32(self.record(StageRecord::Tile), i);
        ptx::st_shared_u32(self.record(StageRecord::Next), next);
    }

    /// The query tile `(head, i)` the stage holds, if any.
    #[inline(always)]
    unsafe fn staged_tile(self) -> Option<(u32, u32)> {
        let head = ptx::ld_shared_u32(self.record(StageRecord::Head));
        let i = ptx::ld_shared_u32(self.record(StageRecord::Tile));
        (i != u32::MAX).then_some((head, i))
    }

    /// Deterministic mode, thread 0, before the barrier that precedes [`Self::flush`]: waits
    /// for the staged tile's turn ([`order::wait_for_turn`]) at key tile `n`.
    #[inline(always)]
    pub(super) unsafe fn wait_for_staged_turn(self, p: &BwdParams, batch: u32, n: u32) {
        if let Some((head, i)) = self.staged_tile() {
            order::wait_for_turn::<BM>(p, batch, head, i, n);
        }
    }

    /// Deterministic mode, thread 0, after a barrier that follows the completion of the
    /// staged tile's flush (and before the stage records the next tile): passes its turn.
    #[inline(always)]
    pub(super) unsafe fn pass_staged_turn(self, p: &BwdParams, batch: u32) {
        if let Some((head, i)) = self.staged_tile() {
            let next = ptx::ld_shared_u32(self.record(StageRecord::Next));
            order::pass_turn_to::<BM>(p, (batch, head, i), next);
        }
    }

    /// Before the barrier after which the stage is written again: waits until the bulk engine
    /// has read the last flush ([`ptx::cp_async_bulk_wait_group_read`]). In deterministic mode
    /// it also waits for the adds themselves and fences them for the generic proxy, so that
    /// thread 0 may pass the flushed tile's turn after that barrier
    /// ([`Self::pass_staged_turn`]). Every thread that flushes calls it.
    #[inline(always)]
    pub(super) unsafe fn wait_flushed(p: &BwdParams) {
        ptx::cp_async_bulk_wait_group_read::<0>();
        if order::ordered(p) {
            ptx::cp_async_bulk_wait_group::<0>();
            ptx::fence_proxy_async_global();
        }
    }

    /// The block's end, after its last [`Self::flush`]: the stage read before the block ends
    /// ([`Self::wait_flushed`]); in deterministic mode, a barrier once every row is added and
    /// thread 0 passes the last tile's turn. Every thread calls it.
    #[inline(always)]
    pub(super) unsafe fn finish(self, p: &BwdParams, batch: u32, tid: u32) {
        Self::wait_flushed(p);
        if order::ordered(p) {
            ptx::bar_sync(); // every row of the last tile added
            if tid == 0 {
                self.pass_staged_turn(p, batch);
            }
        }
    }

    /// Starts adding the staged tile, if any, into the accumulator: a thread given a `row <
    /// BM` reduces that row (`D` f32) with the bulk engine and commits it as one group (every
    /// row of the stage by one thread each). Call after a barrier that follows every warp's
    /// stage writes and proxy fence.
    #[inline(always)]
    pub(super) unsafe fn flush(self, p: &BwdParams, batch: u32, kv_head: u32, row: u32) {
        if (row as usize) < BM {
            if let Some((head, i)) = self.staged_tile() {
                let block = block_for(p, batch, kv_head, head);
                let at = block.query_offset(&p.dq_accum, i * BM as u32 + row);
                let dst = (p.dq_accum.ptr as *mut f32).add(at as usize);
                ptx::cp_reduce_async_bulk_add_f32(dst, self.addr(row, 0), 4 * D as u32);
                ptx::cp_async_bulk_commit_group();
            }
        }
    }
}

/// One of the walk's look-ahead slots ([`DqStage::walk_slot`]): a query tile `(head, i)`, or
/// none, written by one warp before a block-wide barrier and read by every thread after it.
#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // the sm_90a block-sparse walk
#[derive(Clone, Copy)]
pub(super) struct WalkSlot {
    head: u32,
}

#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // the sm_90a block-sparse walk
impl WalkSlot {
    /// Writes `tile` (lane 0 of the calling warp stores).
    #[inline(always)]
    pub(super) unsafe fn write(self, tile: Option<(u32, u32)>, lane: u32) {
        if lane == 0 {
            let (head, i) = tile.unwrap_or((0, u32::MAX));
            ptx::st_shared_u32(self.head, head);
            ptx::st_shared_u32(self.head + 4, i);
        }
    }

    /// Reads the tile, passed through lane 0 so that ptxas knows it warp-uniform (as
    /// [`ptx::warp_uniform_tile`]).
    #[inline(always)]
    pub(super) unsafe fn read(self) -> Option<(u32, u32)> {
        let i = ptx::warp_uniform_tile(Some(ptx::ld_shared_u32(self.head + 4)))?;
        let head = ptx::shfl_sync_idx_u32(ptx::ld_shared_u32(self.head), 0);
        Some((head, i))
    }
}
