//! The deterministic mode's order of dQ adds: every block adds its part of a query tile into
//! the one f32 accumulator in turn, in the order the forward visits the key tiles (highest
//! key tile first, [`AttnMask::key_tiles`]), so each dQ element is summed in the same order on
//! every run, whatever the number of blocks in flight.
//!
//! One `u32` turn counter per (batch, query head, query tile) (`BwdParams::dq_order`,
//! zeroed before the launch) holds `n + 1` while it is key tile `n`'s turn. The first key
//! tile of a query tile ([`AttnMask::first_key_tile`]) opens its own turn when its step
//! starts; before its adds, the block's thread 0 waits (acquire) for its turn; after a
//! barrier that follows all of the block's adds, thread 0 passes the turn (release) to the
//! next key tile ([`AttnMask::next_key_tile`], looked up where the kernel has registers to
//! spare). Waiting needs no mask arithmetic.
//!
//! Launch order ([`block_key_tile`], [`block_coords`]): the blocks of each (batch, KV head)
//! pair take the key tiles from the highest down, so a block only ever waits for blocks with a
//! lower linear index, which the GPU dispatches first (FlashAttention 3 relies on the same
//! order): no deadlock when the grid exceeds what is resident. With causal masks that is also
//! the order in which the blocks reach a query tile. Without a mask, every block of a pair
//! walks the query tiles from the first, so a block that starts together with the one before it
//! in turn waits a whole step for it at every tile: blocks of one pair started side by side
//! form a pipeline that fills one step per block. So the `wgmma` kernels' order interleaves
//! `order_heads` pairs (`BwdParams::order_heads`, chosen by the host from the number of
//! resident blocks and the steps per block): rank 0 of each of them, then rank 1 of each, and
//! so on, which starts a pair's consecutive tiles at least a step apart once the first wave has
//! passed, while the blocks in flight still cover few pairs (their Q, dO and dQ stay in L2).
//! The pair then no longer comes from a special register, and the two live registers more made
//! ptxas spill in some kernels: the `wgmma` kernel keeps it in shared memory and reads it where
//! used. The `mma.sync` kernels keep FlashAttention 2's order.
//!
//! Fast mode has no turns; its blocks take the key tiles in grid order, but with a block mask
//! ([`sparse_key_tile`]) in the host's order of each (batch, KV head)'s key tiles, those that
//! visit the most query blocks first: the GPU dispatches the blocks in index order, so the
//! launch's last blocks are its shortest and the SMs finish close together.

use crate::block::interleaved_key_block;
use crate::device::ptx;
use crate::mask::AttnMask;
use crate::params::BwdParams;

/// Whether the launch is in deterministic mode (the turn counters are given).
#[inline(always)]
pub(super) fn ordered(p: &BwdParams) -> bool {
    p.dq_order != 0
}

/// The key tile of an `mma.sync` backward block (FlashAttention 2's launch order, no pairs
/// interleaved): `blockIdx.x` in fast mode, the tiles from the last one down in
/// deterministic mode.
///
/// # Safety
/// Launched with one block per key tile (`gridDim.x` = `⌈seqlen_k / BN⌉`).
#[inline(always)]
pub(super) unsafe fn block_key_tile<const BN: usize>(p: &BwdParams) -> u32 {
    let x = ptx::ctaid().0;
    match ordered(p) {
        true => p.dims.seqlen_k.div_ceil(BN as u32) - 1 - x,
        false => x,
    }
}

/// The `(key tile, KV head, batch)` of a `wgmma` backward block: the block index in fast
/// mode; in deterministic mode, [`interleaved_key_block`] of the linear block index with
/// `order_heads` pairs per group (see the module docs).
///
/// # Safety
/// Launched with grid `(⌈seqlen_k / BN⌉, heads_kv, batch)`.
#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // sm_90a code (the `wgmma` backward)
#[inline(always)]
pub(super) unsafe fn block_coords(p: &BwdParams) -> (u32, u32, u32) {
    let (x, y, z) = ptx::ctaid();
    if !ordered(p) {
        return (x, y, z);
    }
    let grid = ptx::nctaid();
    interleaved_key_block(x + grid.0 * (y + grid.1 * z), grid, p.order_heads)
}

/// The key tile of the block-sparse kernels' block `(x, kv_head, batch)` of the grid `(key
/// tiles, heads_kv, batch)` whose grid-order key tile is `x` ([`block_key_tile`],
/// [`block_coords`]): in fast mode with an order from the host, entry `x` of its (batch, KV
/// head)'s row of the order `key_tile_order` words after the mask's bits (the key tiles that
/// visit the most query blocks first, so that the launch's last blocks are short ones and the
/// SMs finish together); else `x`. Called only where `M::WALK_READS_MEMORY`, so that the
/// other kernels' code stays as it was.
///
/// # Safety
/// The grid above; a nonzero `key_tile_order` places `batch · heads_kv · key tiles` entries
/// there.
#[inline(always)]
pub(super) unsafe fn sparse_key_tile(p: &BwdParams, (x, kv_head, batch): (u32, u32, u32)) -> u32 {
    if ordered(p) || p.key_tile_order == 0 {
        return x;
    }
    let grid = ptx::nctaid();
    let at = (batch as usize * grid.1 as usize + kv_head as usize) * grid.0 as usize + x as usize;
    let order = (p.mask.mask_bits as *const u32).add(p.key_tile_order as usize);
    *order.add(at)
}

/// The turn counter of query tile `i` (of `BM` rows) of `head` in `batch`.
#[inline(always)]
unsafe fn counter<const BM: usize>(p: &BwdParams, batch: u32, head: u32, i: u32) -> *mut u32 {
    let dims = &p.dims;
    let tiles = dims.seqlen_q.div_ceil(BM as u32) as u64;
    let at = (batch as u64 * dims.heads_q as u64 + head as u64) * tiles + i as u64;
    (p.dq_order as *mut u32).add(at as usize)
}

/// Thread 0, at the start of the block's step on query tile `i` of `head` (of `mask`'s block)
/// with key tile `n`: if `n` is the first key tile to add to it, opens its turn.
///
/// # Safety
/// Deterministic mode, one thread of the block.
#[inline(always)]
pub(super) unsafe fn open_turn<M: AttnMask, const BM: usize, const BN: usize>(
    p: &BwdParams,
    mask: &M,
    (batch, head, i): (u32, u32, u32),
    n: u32,
) {
    if mask.first_key_tile(i * BM as u32, BM as u32, BN as u32) == Some(n) {
        ptx::st_release_gpu_u32(counter::<BM>(p, batch, head, i), n + 1);
    }
}

/// Thread 0, before the block's dQ adds to query tile `i` of `head` from key tile `n`: waits
/// for its turn (opened by [`open_turn`] or passed by the key tile before it).
///
/// # Safety
/// Deterministic mode, one thread of the block; `(head, i)` is a query tile the block's walk
/// visits with key tile `n`.
#[inline(always)]
pub(super) unsafe fn wait_for_turn<const BM: usize>(
    p: &BwdParams,
    batch: u32,
    head: u32,
    i: u32,
    n: u32,
) {
    let at = counter::<BM>(p, batch, head, i);
    while ptx::ld_acquire_gpu_u32(at) != n + 1 {}
}

/// The turn that key tile `n` passes on after adding to query tile `i`: the next key tile
/// plus one, or 0 when `n` is the last.
#[inline(always)]
pub(super) fn next_in_turn<M: AttnMask, const BM: usize, const BN: usize>(
    mask: &M,
    i: u32,
    n: u32,
) -> u32 {
    mask.next_key_tile(i * BM as u32, BM as u32, BN as u32, n)
        .map_or(0, |t| t + 1)
}

/// Thread 0, after a barrier that follows every add of the block to query tile `i` of `head`
/// (bulk adds completed): hands the turn on, to `next` as looked up by [`next_in_turn`] (0:
/// nothing to pass).
///
/// # Safety
/// Deterministic mode, one thread of the block, after [`wait_for_turn`] for the same tile.
#[inline(always)]
pub(super) unsafe fn pass_turn_to<const BM: usize>(
    p: &BwdParams,
    (batch, head, i): (u32, u32, u32),
    next: u32,
) {
    if next != 0 {
        ptx::st_release_gpu_u32(counter::<BM>(p, batch, head, i), next);
    }
}
