//! Block information: which (batch, query head, KV head) and which query rows one thread block
//! works on, the lengths of its sequences, and where its rows start in each tensor.
//!
//! Every kernel family starts from a [`BlockInfo`] and reads tensors only through its offset
//! methods, so per-sequence offsets (varlen `cu_seqlens`, KV-cache lengths, page tables) change
//! this file and the params, not the kernels' main loops.

use crate::params::{RowStatsRef, SeqDims, TensorRef};

/// What one thread block of a query-tiled kernel works on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Batch entry.
    pub batch: u32,
    /// Query head.
    pub head: u32,
    /// The KV head this query head reads (grouped-query attention).
    pub kv_head: u32,
    /// First query row of the block.
    pub row0: u32,
    /// Query length of this block's sequence.
    pub seqlen_q: u32,
    /// Key length of this block's sequence.
    pub seqlen_k: u32,
}

impl BlockInfo {
    /// The block at grid position `(m_block, head, batch)` of a grid with `m_blocks` query
    /// tiles of `block_m` rows. With `longest_first`, grid x runs over the query tiles in
    /// reverse, so the tiles that see the most keys start first and the last wave of the grid
    /// holds the short ones.
    #[inline(always)]
    pub fn new(
        dims: &SeqDims,
        (m_block, head, batch): (u32, u32, u32),
        m_blocks: u32,
        block_m: u32,
        longest_first: bool,
    ) -> Self {
        let m_block = if longest_first {
            m_blocks - 1 - m_block
        } else {
            m_block
        };
        Self {
            batch,
            head,
            kv_head: head / (dims.heads_q / dims.heads_kv),
            row0: m_block * block_m,
            seqlen_q: dims.seqlen_q,
            seqlen_k: dims.seqlen_k,
        }
    }

    /// Query rows of the block that exist (may exceed the tile; the kernel clamps).
    #[inline(always)]
    pub fn rows_left(&self) -> u32 {
        self.seqlen_q - self.row0
    }

    /// Element offset of query-side row `row` (absolute, within the sequence) of this block's
    /// head in `t` (Q, O and their gradients).
    #[inline(always)]
    pub fn query_offset(&self, t: &TensorRef, row: u32) -> u64 {
        t.strides.offset(self.batch, row, self.head)
    }

    /// Element offset of key `key` of this block's KV head in `t` (K, V).
    #[inline(always)]
    pub fn key_offset(&self, t: &TensorRef, key: u32) -> u64 {
        t.strides.offset(self.batch, key, self.kv_head)
    }

    /// Element offset of query row `row`'s statistic in `t` (LSE).
    #[inline(always)]
    pub fn row_stat_offset(&self, t: &RowStatsRef, row: u32) -> u64 {
        t.offset(self.batch, self.head, row)
    }
}

/// The backward's deterministic launch order: the `(key tile, KV head, batch)` of the block
/// at `linear` (`x + tiles · (y + heads · z)`) in a grid of `tiles × heads × batches`. The
/// (batch, KV head) pairs form groups of `per_group` (the last may hold fewer); a group's
/// blocks are its pairs' rank 0, then their rank 1, and so on, rank `r` being key tile
/// `tiles − 1 − r`. So rank `r − 1` of a pair always has a lower linear index than rank `r`.
pub fn interleaved_key_block(
    linear: u32,
    (tiles, heads, batches): (u32, u32, u32),
    per_group: u32,
) -> (u32, u32, u32) {
    let pairs = heads * batches;
    let per_group = per_group.clamp(1, pairs);
    let (group, at) = (linear / (per_group * tiles), linear % (per_group * tiles));
    let in_group = per_group.min(pairs - group * per_group);
    let pair = group * per_group + at % in_group;
    (tiles - 1 - at / in_group, pair % heads, pair / heads)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::params::Strides;

    #[test]
    fn gqa_and_longest_first() {
        let dims = SeqDims {
            batch: 2,
            heads_q: 8,
            heads_kv: 2,
            seqlen_q: 300,
            seqlen_k: 50,
            head_dim: 64,
        };
        let b = BlockInfo::new(&dims, (0, 5, 1), 3, 128, true);
        assert_eq!((b.batch, b.head, b.kv_head, b.row0), (1, 5, 1, 256));
        assert_eq!(b.rows_left(), 44);
        let b = BlockInfo::new(&dims, (0, 3, 0), 3, 128, false);
        assert_eq!((b.kv_head, b.row0), (0, 0));
        let t = TensorRef {
            ptr: 0,
            strides: Strides {
                batch: 1000,
                row: 10,
                head: 1,
            },
        };
        let b = BlockInfo::new(&dims, (1, 7, 1), 3, 128, false);
        assert_eq!(b.query_offset(&t, 130), 1000 + 1300 + 7);
        assert_eq!(b.key_offset(&t, 4), 1000 + 40 + 1);
    }

    #[test]
    fn interleaved_key_blocks_cover_the_grid_each_after_its_turn() {
        for (tiles, heads, batches) in [(1, 1, 1), (8, 32, 16), (5, 3, 7), (33, 2, 1)] {
            let count = tiles * heads * batches;
            for per_group in [0, 1, 2, 4, 7, 25, heads * batches, 1000] {
                let mut seen = std::collections::HashMap::new();
                for linear in 0..count {
                    let (n, h, b) =
                        interleaved_key_block(linear, (tiles, heads, batches), per_group);
                    assert!(n < tiles && h < heads && b < batches);
                    assert!(
                        seen.insert((n, h, b), linear).is_none(),
                        "{n} {h} {b} twice"
                    );
                }
                // The tile before in turn (one higher) starts first.
                for (&(n, h, b), &linear) in &seen {
                    if n + 1 < tiles {
                        assert!(seen[&(n + 1, h, b)] < linear);
                    }
                }
            }
        }
    }
}
