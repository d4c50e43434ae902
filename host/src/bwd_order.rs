//! The order in which the blocks of a fast-mode block-sparse backward launch take their key
//! tiles: each (sequence, KV head)'s key tiles, those that visit the most query blocks first
//! (`BwdParams::key_tile_order`). The GPU dispatches a grid's blocks in index order and a new
//! one wherever one ends, so in grid order a launch whose key tiles visit 3 to 16 query blocks
//! (the masks benchmark at density 1/16, 16K keys) ends up to a long block's time after most
//! SMs have run dry: Nsight Compute counted the SMs active 91 % of that kernel's time.
//! Longest first, the last blocks are the short ones.

use std::cmp::Reverse;
use std::sync::Arc;

use flash_attn_kernels::params::SeqDims;

use crate::device::Device;
use crate::error::Result;
use crate::params::AttnParams;
use crate::seqs::SeqRun;
use crate::shape::AttnShape;
use crate::sparse::{BlockMask, OrderKey, BLOCK};

/// The key tile orders of a backward call's launches, kept on the device after the mask's
/// words (`crate::mask::DeviceMask::with_orders`).
#[derive(Default)]
pub(crate) struct KeyTileOrders {
    /// The orders with their keys, laid one after the other on the device.
    pub orders: Vec<(OrderKey, Arc<[u32]>)>,
    /// Where, in words after the first order's start, each run's order starts (`None`: grid
    /// order).
    starts: Vec<Option<usize>>,
}

impl KeyTileOrders {
    /// The orders of a backward call of `shape` whose runs launch `block_n` keys per block:
    /// in fast mode (`fast`) with a block mask (unless [`Device::sparse_tile_order`] is off),
    /// one per run that has queries and keys and whose order is not grid order; none
    /// otherwise.
    pub(crate) fn of(
        dev: &Device,
        params: &AttnParams,
        shape: &AttnShape,
        (fast, block_n, padded_d): (bool, usize, usize),
        runs: &[SeqRun],
    ) -> Result<Self> {
        let Some(mask) = params.block_mask else {
            return Ok(Self::default());
        };
        if !(fast && dev.sparse_tile_order()) {
            return Ok(Self::default());
        }
        let causal = params
            .mask_args(shape.head_dim, shape.heads_q, 0, 0)?
            .causal();
        let (mut orders, mut at) = (Self::default(), 0);
        for run in runs {
            if run.len_q == 0 || run.len_k == 0 {
                orders.starts.push(None);
                continue;
            }
            let dims = run.dims(shape, padded_d);
            let key = order_key(&dims, run.first, causal, block_n as u32);
            let order = key_tile_order(mask, &dims, run.first, causal, block_n as u32);
            // Grid order itself (every key tile visits as many blocks: a dense mask, or one
            // that repeats by column) is launched as such, without the order's loads.
            let tiles = run.len_k.div_ceil(block_n);
            if order
                .iter()
                .enumerate()
                .all(|(i, &n)| n as usize == i % tiles)
            {
                orders.starts.push(None);
                continue;
            }
            orders.starts.push(Some(at));
            at += order.len();
            orders.orders.push((key, order));
        }
        Ok(orders)
    }

    /// Run `i`'s `BwdParams::key_tile_order`: where its order is, in words after the mask's
    /// bits at `bits_at`, given that `words` are at `words_at` (0: grid order; also when the
    /// distance does not fit a u32, which no mask the API accepts reaches).
    pub(crate) fn words_after_bits(&self, i: usize, bits_at: u64, words_at: u64) -> u32 {
        match self.starts.get(i) {
            Some(&Some(start)) if words_at > bits_at => {
                let words = (words_at - bits_at) / 4 + start as u64;
                u32::try_from(words).unwrap_or(0)
            }
            _ => 0,
        }
    }
}

/// Marks an [`crate::sparse::OrderKey`] as a backward key tile order (bit 2 of its flags).
const BACKWARD_KEY_TILES: u32 = 1 << 2;

/// The key tile order of a fast-mode backward launch over `dims` with `block_n` keys per block
/// (grid `(key tiles, heads_kv, batch)`): for each (sequence, KV head) in grid order, its key
/// tiles sorted by the query blocks they visit, most first, ties in tile order. A key tile
/// visits, for each query head of its KV head's group, the visible blocks of the union of its
/// block columns; with `causal` only the block rows whose last query sees the tile's first key
/// (bottom-right aligned). `first` is the launch's first sequence, its batch entry in `mask`.
/// Kept on the mask per launch shape ([`BlockMask::tile_order`]).
pub(crate) fn key_tile_order(
    mask: &BlockMask,
    dims: &SeqDims,
    first: usize,
    causal: bool,
    block_n: u32,
) -> Arc<[u32]> {
    let key = order_key(dims, first, causal, block_n);
    mask.tile_order(key, || order(mask, dims, first, causal, block_n))
}

/// What names [`key_tile_order`]'s order among a mask's orders.
fn order_key(dims: &SeqDims, first: usize, causal: bool, block_n: u32) -> OrderKey {
    [
        dims.batch,
        dims.heads_q,
        dims.seqlen_q,
        dims.seqlen_k,
        first as u32,
        dims.heads_kv,
        block_n,
        u32::from(causal) | BACKWARD_KEY_TILES,
    ]
}

/// [`key_tile_order`]'s order, computed.
fn order(mask: &BlockMask, dims: &SeqDims, first: usize, causal: bool, block_n: u32) -> Vec<u32> {
    let (nq, nk, bn) = (
        dims.seqlen_q as usize,
        dims.seqlen_k as usize,
        block_n as usize,
    );
    let tiles = nk.div_ceil(bn);
    let group = (dims.heads_q / dims.heads_kv) as usize;
    let query_blocks = nq.div_ceil(BLOCK);
    let mut order = Vec::with_capacity(tiles * dims.heads_kv as usize * dims.batch as usize);
    for batch in 0..dims.batch as usize {
        for kv_head in 0..dims.heads_kv as usize {
            let visits = |n: usize| -> usize {
                let (key0, last_key) = (n * bn, ((n + 1) * bn).min(nk) - 1);
                // Causal: rows from `key0 − (Nk − Nq)` see key0.
                let row0 = if causal {
                    (key0 + nq).saturating_sub(nk)
                } else {
                    0
                };
                let rows = match row0 < nq {
                    true => row0 / BLOCK..query_blocks,
                    false => query_blocks..query_blocks, // no row sees the tile
                };
                let cols = key0 / BLOCK..=last_key / BLOCK;
                (kv_head * group..(kv_head + 1) * group)
                    .map(|h| {
                        mask.visible_query_blocks(first + batch, h, cols.clone(), rows.clone())
                    })
                    .sum()
            };
            let mut own: Vec<u32> = (0..tiles as u32).collect();
            let counts: Vec<usize> = (0..tiles).map(visits).collect();
            own.sort_by_key(|&n| Reverse(counts[n as usize])); // stable: ties keep tile order
            order.extend(own);
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(batch: u32, heads_q: u32, heads_kv: u32, seqlen_q: u32, seqlen_k: u32) -> SeqDims {
        SeqDims {
            batch,
            heads_q,
            heads_kv,
            seqlen_q,
            seqlen_k,
            head_dim: 128,
        }
    }

    /// The query blocks key tile `n` of `kv_head` visits, counted bit by bit.
    fn visits(
        m: &BlockMask,
        d: &SeqDims,
        b: usize,
        kv_head: usize,
        n: usize,
        causal: bool,
    ) -> usize {
        let group = (d.heads_q / d.heads_kv) as usize;
        let (nq, nk) = (d.seqlen_q as usize, d.seqlen_k as usize);
        let (key0, last_key) = (n * 128, ((n + 1) * 128).min(nk) - 1);
        let mut count = 0;
        for h in kv_head * group..(kv_head + 1) * group {
            for i in 0..nq.div_ceil(BLOCK) {
                let last_row = ((i + 1) * BLOCK).min(nq) - 1;
                let sees = !causal || key0 + nq <= last_row + nk;
                let any = (key0 / BLOCK..=last_key / BLOCK).any(|j| m.get(b, h, i, j));
                count += usize::from(sees && any);
            }
        }
        count
    }

    #[test]
    fn key_tiles_come_longest_first_each_once() {
        for (causal, nq, nk, batch, heads_q, heads_kv) in [
            (false, 2048, 2048, 2, 4, 2),
            (true, 2048, 2048, 1, 3, 3),
            (true, 1000, 3000, 2, 2, 1),
            (true, 3000, 1000, 1, 4, 1),
            (false, 640, 1900, 2, 2, 2),
            (false, 4200, 4200, 1, 1, 1), // more than 32 query blocks: two column words
        ] {
            let d = dims(batch, heads_q, heads_kv, nq, nk);
            let (qb, kb) = ((nq as usize).div_ceil(BLOCK), (nk as usize).div_ceil(BLOCK));
            let mask =
                BlockMask::from_fn([batch as usize, heads_q as usize, qb, kb], |b, h, i, j| {
                    let x = ((b * 5 + h) * 64 + i) * 64 + j;
                    (x as u32).wrapping_mul(0x9e37_79b9) >> 29 < 3 // 3/8 of the blocks, unevenly
                })
                .unwrap();
            let order = order(&mask, &d, 0, causal, 128);
            let tiles = kb as u32;
            assert_eq!(order.len(), (tiles * heads_kv * batch) as usize);
            let mut differ = false;
            for (pair, own) in order.chunks(tiles as usize).enumerate() {
                let (b, kv_head) = (pair / heads_kv as usize, pair % heads_kv as usize);
                let mut seen = own.to_vec();
                seen.sort_unstable();
                assert_eq!(
                    seen,
                    (0..tiles).collect::<Vec<_>>(),
                    "a permutation of the pair's tiles"
                );
                let v: Vec<usize> = own
                    .iter()
                    .map(|&n| visits(&mask, &d, b, kv_head, n as usize, causal))
                    .collect();
                differ |= crate::sparse::assert_longest_first(&v, own);
            }
            assert!(differ, "the mask's columns differ");
        }
    }

    /// A run's order is found in words after the run's mask bits; runs without one, and
    /// distances past a u32, give grid order.
    #[test]
    fn runs_find_their_order_after_their_bits() {
        let orders = KeyTileOrders {
            orders: Vec::new(),
            starts: vec![Some(0), None, Some(6)],
        };
        let (bits, words) = (0x1000, 0x1000 + 4 * 40);
        assert_eq!(orders.words_after_bits(0, bits, words), 40);
        assert_eq!(orders.words_after_bits(0, bits + 4 * 8, words), 32); // a later run's bits
        assert_eq!(orders.words_after_bits(1, bits, words), 0);
        assert_eq!(orders.words_after_bits(2, bits, words), 46);
        assert_eq!(orders.words_after_bits(3, bits, words), 0);
        assert_eq!(orders.words_after_bits(0, 0, 0), 0);
        assert_eq!(orders.words_after_bits(0, bits, bits + 4 * (1 << 32)), 0);
    }

    /// A launch of later sequences reads their own entries of the mask, and the order is kept
    /// per launch shape.
    #[test]
    fn a_later_run_reads_its_own_entries() {
        // Entry 0 sees everything; entry 1 sees only key block 2 from every row, and block 0
        // from the first row.
        let mask = BlockMask::from_fn([2, 1, 4, 4], |b, _, i, j| {
            b == 0 || j == 2 || (i == 0 && j == 0)
        })
        .unwrap();
        let d = dims(1, 1, 1, 512, 512);
        assert_eq!(&*key_tile_order(&mask, &d, 0, false, 128), [0, 1, 2, 3]);
        assert_eq!(&*key_tile_order(&mask, &d, 1, false, 128), [2, 0, 1, 3]);
        // 64-key tiles: two per block column.
        assert_eq!(
            &*key_tile_order(&mask, &d, 1, false, 64),
            [4, 5, 0, 1, 2, 3, 6, 7]
        );
    }
}
