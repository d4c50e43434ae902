//! The order in which the blocks of a persistent block-sparse forward launch take their query
//! tiles: each (sequence, head)'s tiles longest first, by the key blocks each visits, so that
//! the launch's last tiles are its shortest and the blocks finish close together (the tail of
//! a launch whose tiles visit 2 to 16 key blocks is otherwise up to a long tile's time, with
//! the other SMs idle). The heads stay in order, so that the tiles in flight share one
//! head's keys and values in L2 as they do in grid order.

use std::cmp::Reverse;
use std::sync::Arc;

use flash_attn_kernels::block::BlockInfo;
use flash_attn_kernels::config::FwdTile;
use flash_attn_kernels::mask::{AttnMask, SparseMask};
use flash_attn_kernels::params::SeqDims;

use crate::device::Device;
use crate::error::Result;
use crate::params::AttnParams;
use crate::seqs::SeqRun;
use crate::shape::AttnShape;
use crate::sparse::{BlockMask, OrderKey, BLOCK};

/// The tile orders of a call's launches, kept on the device after the mask's words
/// ([`BlockMask::on_device`]; computed once per mask and launch shape,
/// [`BlockMask::tile_order`]).
#[derive(Default)]
pub(crate) struct LaunchOrders {
    /// Every launch's order with its key, laid one after the other on the device.
    pub orders: Vec<(OrderKey, Arc<[u32]>)>,
    /// Where, in words after the first order's start, each launch's order starts (launches
    /// of the runs with queries, in order); empty when the call's launches take none.
    pub starts: Vec<usize>,
}

impl LaunchOrders {
    /// The orders of a call of `shape` whose runs with queries launch `tile`'s kernel: for
    /// persistent `wgmma` kernels with a block mask (unless [`Device::sparse_tile_order`] is
    /// off), none otherwise.
    pub(crate) fn of(
        dev: &Device,
        params: &AttnParams,
        shape: &AttnShape,
        (tile, padded_d): (FwdTile, usize),
        runs: &[SeqRun],
    ) -> Result<Self> {
        let Some(mask) = params.block_mask else {
            return Ok(Self::default());
        };
        if !(tile.persistent && tile.producer_warps > 0 && dev.sparse_tile_order()) {
            return Ok(Self::default());
        }
        let args = params.mask_args(shape.head_dim, shape.heads_q, 0, 0)?;
        let (causal, longest_first) = (args.causal(), SparseMask::later_rows_see_more(&args));
        let (mut orders, mut at) = (Self::default(), 0);
        for run in runs.iter().filter(|r| r.len_q > 0) {
            let dims = run.dims(shape, padded_d);
            let tiles_x = run.len_q.div_ceil(tile.block_m) as u32;
            let block_m = tile.block_m as u32;
            let key = [
                dims.batch,
                dims.heads_q,
                dims.seqlen_q,
                dims.seqlen_k,
                run.first as u32,
                tiles_x,
                block_m,
                u32::from(causal) | u32::from(longest_first) << 1,
            ];
            let order = mask.tile_order(key, || {
                let launch = (tiles_x, block_m, longest_first);
                sparse_tile_order(mask, &dims, run.first, causal, launch)
            });
            orders.starts.push(at);
            at += order.len();
            orders.orders.push((key, order));
        }
        Ok(orders)
    }
}

/// The tiles `0 .. tiles_x · heads_q · batch` of a persistent launch over `dims` (tile `t` is
/// the one-block-per-tile grid's block `(t mod tiles_x, t / tiles_x mod heads_q,
/// t / (tiles_x · heads_q))`, mapped to its query rows as the kernels map it, by
/// [`BlockInfo::new`] with `block_m` and `longest_first`), each (sequence, head)'s `tiles_x`
/// in turn, those sorted by the visible key blocks of their rows' block rows, most first,
/// ties in tile order. `first` is the launch's first sequence, its batch entry in `mask`;
/// with `causal` a row sees the keys up to its (bottom-right aligned) diagonal.
pub(crate) fn sparse_tile_order(
    mask: &BlockMask,
    dims: &SeqDims,
    first: usize,
    causal: bool,
    (tiles_x, block_m, longest_first): (u32, u32, bool),
) -> Vec<u32> {
    let tiles = tiles_x as usize * dims.heads_q as usize * dims.batch as usize;
    let key_blocks = (dims.seqlen_k as usize).div_ceil(BLOCK);
    let visits: Vec<usize> = (0..tiles)
        .map(|t| {
            let (x, rest) = (t as u32 % tiles_x, t as u32 / tiles_x);
            let at = (x, rest % dims.heads_q, rest / dims.heads_q);
            let block = BlockInfo::new(dims, at, tiles_x, block_m, longest_first);
            let last_row = (block.row0 + block_m).min(dims.seqlen_q) as usize - 1;
            let keys = if causal {
                // Keys up to the last row's diagonal: `last_row + Nk − Nq`, if any.
                (last_row + dims.seqlen_k as usize + 1).saturating_sub(dims.seqlen_q as usize)
            } else {
                dims.seqlen_k as usize
            };
            let rows = block.row0 as usize / BLOCK..=last_row / BLOCK;
            let entry = first + block.batch as usize;
            mask.visible_blocks(
                entry,
                block.head as usize,
                rows,
                keys.div_ceil(BLOCK).min(key_blocks),
            )
        })
        .collect();
    let mut order: Vec<u32> = (0..tiles as u32).collect();
    for head in order.chunks_mut(tiles_x as usize) {
        head.sort_by_key(|&t| Reverse(visits[t as usize])); // stable: ties keep tile order
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(batch: u32, heads_q: u32, seqlen_q: u32, seqlen_k: u32) -> SeqDims {
        SeqDims {
            batch,
            heads_q,
            heads_kv: 1,
            seqlen_q,
            seqlen_k,
            head_dim: 128,
        }
    }

    /// The visits of tile `t` counted block by block, as the definition says.
    fn visits(
        mask: &BlockMask,
        d: &SeqDims,
        causal: bool,
        t: u32,
        tiles_x: u32,
        longest_first: bool,
    ) -> usize {
        let (x, rest) = (t % tiles_x, t / tiles_x);
        let block = BlockInfo::new(
            d,
            (x, rest % d.heads_q, rest / d.heads_q),
            tiles_x,
            128,
            longest_first,
        );
        let last_row = (block.row0 + 128).min(d.seqlen_q) - 1;
        let i = block.row0 as usize / BLOCK;
        (0..(d.seqlen_k as usize).div_ceil(BLOCK))
            .filter(|&j| {
                let key0 = j * BLOCK;
                mask.get(block.batch as usize, block.head as usize, i, j)
                    && (!causal
                        || key0 + d.seqlen_q as usize <= last_row as usize + d.seqlen_k as usize)
            })
            .count()
    }

    #[test]
    fn tiles_come_longest_first_each_once() {
        for (causal, longest_first, nq, nk) in [
            (false, false, 2048, 2048),
            (true, true, 2048, 2048),
            (true, true, 1000, 3000),
            (true, true, 3000, 1000),
            (false, false, 640, 1900),
        ] {
            let d = dims(2, 3, nq, nk);
            let (qb, kb) = ((nq as usize).div_ceil(BLOCK), (nk as usize).div_ceil(BLOCK));
            let mask = BlockMask::from_fn([2, 3, qb, kb], |b, h, i, j| {
                let x = ((b * 3 + h) * 64 + i) * 64 + j;
                (x as u32).wrapping_mul(0x9e37_79b9) >> 29 < 3 // 3/8 of the blocks, unevenly
            })
            .unwrap();
            let tiles_x = nq.div_ceil(128);
            let order = sparse_tile_order(&mask, &d, 0, causal, (tiles_x, 128, longest_first));
            let mut seen = order.clone();
            seen.sort_unstable();
            assert_eq!(seen, (0..tiles_x * 6).collect::<Vec<_>>(), "a permutation");
            let mut differ = false;
            for (head, tiles) in order.chunks(tiles_x as usize).enumerate() {
                let own = head as u32 * tiles_x..(head as u32 + 1) * tiles_x;
                assert!(
                    tiles.iter().all(|t| own.contains(t)),
                    "heads in order: {tiles:?}"
                );
                let v: Vec<usize> = tiles
                    .iter()
                    .map(|&t| visits(&mask, &d, causal, t, tiles_x, longest_first))
                    .collect();
                differ |= crate::sparse::assert_longest_first(&v, tiles);
            }
            assert!(differ, "the mask's rows differ");
        }
    }

    /// A launch of the call's later sequences reads their entries of the mask, each
    /// sequence's tiles in turn.
    #[test]
    fn a_later_run_reads_its_own_entries() {
        let d = dims(1, 1, 512, 512);
        // Entry 0 sees everything, entry 1 only its first block row's first block.
        let mask =
            BlockMask::from_fn([2, 1, 4, 4], |b, _, i, j| b == 0 || (i == 3 && j < 3)).unwrap();
        assert_eq!(
            sparse_tile_order(&mask, &d, 0, false, (4, 128, false)),
            [0, 1, 2, 3]
        );
        assert_eq!(
            sparse_tile_order(&mask, &d, 1, false, (4, 128, false)),
            [3, 0, 1, 2]
        );
        let d = dims(2, 1, 512, 512);
        let mask = BlockMask::from_fn([3, 1, 4, 4], |b, _, i, j| j <= i + b % 2).unwrap();
        assert_eq!(
            sparse_tile_order(&mask, &d, 1, false, (4, 128, false)),
            [2, 3, 1, 0, 7, 6, 5, 4]
        );
    }
}
