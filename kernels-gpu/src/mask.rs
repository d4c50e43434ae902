//! Which keys a query row may see, which key tiles a query tile must visit, and how a score
//! is modified before the softmax.
//!
//! A mask is a compile-time type (one per [`crate::registry::MaskKind`]) built in each block
//! from the params' [`MaskArgs`] and the block's [`BlockInfo`]. The kernels ask it:
//! - the *key tiles* a query tile visits, as an iterator (last tile first; gaps allowed, for
//!   block-sparse and tree masks); tiles it skips are neither loaded nor computed;
//! - whether a visited tile needs the element-wise predicate ([`AttnMask::visible`]), or is
//!   entirely visible;
//! - the *score modifier* ([`AttnMask::modify_score`], for ALiBi and softcap), which does
//!   nothing unless the mask says [`AttnMask::MODIFIES_SCORES`].
//!
//! The CPU backend uses the same types, so both sides agree on every edge.

use crate::block::BlockInfo;
use crate::params::MaskArgs;

/// A mask policy; see the module docs.
pub trait AttnMask: Sized {
    /// Whether [`AttnMask::modify_score`] changes scores (else kernels skip it).
    const MODIFIES_SCORES: bool = false;

    /// The mask of one block.
    fn new(args: &MaskArgs, block: &BlockInfo) -> Self;

    /// Whether later query tiles visit more key tiles (then the grid runs them first, so the
    /// last wave holds the short ones).
    fn later_rows_see_more(args: &MaskArgs) -> bool;

    /// The first key tile (of `block_n` keys) that query rows `[row0, row0 + block_m)` must
    /// visit: the last one holding a key some row sees. `None` when no row sees any key.
    fn first_key_tile(&self, row0: u32, block_m: u32, block_n: u32) -> Option<u32>;

    /// The key tile visited after tile `n` (a lower index; gaps allowed), or `None` when `n` is
    /// the last. A function of `n` rather than iterator state, so a kernel keeps only the
    /// current tile index live across a step.
    fn next_key_tile(&self, row0: u32, block_m: u32, block_n: u32, n: u32) -> Option<u32>;

    /// Whether query rows `[row0, row0 + block_m)` visit key tile `n` (the backward walks the
    /// query tiles of one key tile).
    fn visits_key_tile(&self, row0: u32, block_m: u32, n: u32, block_n: u32) -> bool;

    /// Every key tile the query tile visits, in visiting order (decreasing).
    #[inline(always)]
    fn key_tiles(&self, row0: u32, block_m: u32, block_n: u32) -> KeyTiles<'_, Self> {
        KeyTiles {
            mask: self,
            tile: (row0, block_m, block_n),
            next: self.first_key_tile(row0, block_m, block_n),
        }
    }

    /// Whether key tile `n_block` holds any key that some row of the query tile may not see
    /// (then the kernel applies [`AttnMask::visible`] element by element).
    fn tile_needs_mask(&self, row0: u32, block_m: u32, n_block: u32, block_n: u32) -> bool;

    /// Whether query `row` sees key `key`.
    fn visible(&self, row: u32, key: u32) -> bool;

    /// Whether query `row` sees at least one key. Rows that see none get O = 0 and LSE = −∞;
    /// rows that see keys whose scores are all −∞ get NaN (they are not masked rows).
    fn row_sees_keys(&self, row: u32) -> bool;

    /// The score of (`row`, `key`) as the softmax should see it (before the softmax scale).
    #[inline(always)]
    fn modify_score(&self, _row: u32, _key: u32, score: f32) -> f32 {
        score
    }
}

/// The key tiles of one query tile in visiting order: [`AttnMask::first_key_tile`], then
/// [`AttnMask::next_key_tile`] until `None`.
pub struct KeyTiles<'a, M: ?Sized> {
    mask: &'a M,
    tile: (u32, u32, u32),
    next: Option<u32>,
}

impl<M: AttnMask> Iterator for KeyTiles<'_, M> {
    type Item = u32;

    #[inline(always)]
    fn next(&mut self) -> Option<u32> {
        let n = self.next?;
        let (row0, block_m, block_n) = self.tile;
        self.next = self.mask.next_key_tile(row0, block_m, block_n, n);
        Some(n)
    }
}

/// Sequence tails plus optional causal masking aligned to the bottom-right corner: query `i`
/// sees keys `j ≤ i + seqlen_k − seqlen_q` (FlashAttention 2's convention when the lengths
/// differ). Rows with `i < seqlen_q − seqlen_k` see no key at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CausalMask {
    /// Query sequence length.
    pub seqlen_q: u32,
    /// Key sequence length.
    pub seqlen_k: u32,
    /// Causal masking on or off (off: only the key tail is masked).
    pub causal: bool,
}

impl CausalMask {
    /// The last key (inclusive, may be negative) that `row` sees under the causal rule.
    #[inline(always)]
    fn causal_limit(&self, row: u32) -> i64 {
        row as i64 + self.seqlen_k as i64 - self.seqlen_q as i64
    }

    /// One past the last key `row` sees (0 when none): the key tail and, if causal, the
    /// diagonal. Row `row` sees exactly the keys `0 .. key_end(row)`.
    #[inline(always)]
    fn key_end(&self, row: u32) -> u32 {
        if self.causal {
            (self.causal_limit(row) + 1).clamp(0, self.seqlen_k as i64) as u32
        } else {
            self.seqlen_k
        }
    }
}

impl AttnMask for CausalMask {
    #[inline(always)]
    fn new(args: &MaskArgs, block: &BlockInfo) -> Self {
        Self {
            seqlen_q: block.seqlen_q,
            seqlen_k: block.seqlen_k,
            causal: args.causal(),
        }
    }

    #[inline(always)]
    fn later_rows_see_more(args: &MaskArgs) -> bool {
        args.causal()
    }

    #[inline(always)]
    fn first_key_tile(&self, row0: u32, block_m: u32, block_n: u32) -> Option<u32> {
        let n_tiles = self.seqlen_k.div_ceil(block_n);
        let end = if self.causal {
            let last_row = (row0 + block_m).min(self.seqlen_q).max(row0 + 1) - 1;
            let limit = self.causal_limit(last_row);
            if limit < 0 {
                return None;
            }
            n_tiles.min((limit / block_n as i64) as u32 + 1)
        } else {
            n_tiles
        };
        end.checked_sub(1)
    }

    #[inline(always)]
    fn next_key_tile(&self, _row0: u32, _block_m: u32, _block_n: u32, n: u32) -> Option<u32> {
        n.checked_sub(1)
    }

    #[inline(always)]
    fn visits_key_tile(&self, row0: u32, block_m: u32, n: u32, block_n: u32) -> bool {
        // The visited tiles are 0 ..= first_key_tile.
        self.first_key_tile(row0, block_m, block_n)
            .is_some_and(|last| n <= last)
    }

    #[inline(always)]
    fn tile_needs_mask(&self, row0: u32, _block_m: u32, n_block: u32, block_n: u32) -> bool {
        let key_end = (n_block as u64 + 1) * block_n as u64; // exclusive
        if key_end > self.seqlen_k as u64 {
            return true;
        }
        self.causal && key_end as i64 - 1 > self.causal_limit(row0)
    }

    #[inline(always)]
    fn visible(&self, row: u32, key: u32) -> bool {
        key < self.seqlen_k && (!self.causal || key as i64 <= self.causal_limit(row))
    }

    #[inline(always)]
    fn row_sees_keys(&self, row: u32) -> bool {
        self.key_end(row) > 0
    }
}

/// The mask types by [`crate::registry::MaskKind`] name (the registry's entry points name them
/// this way).
pub mod kind {
    pub use super::CausalMask as Causal;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force: the tile iterator and the needs-mask flag agree with the element predicate,
    /// and the tiles come in decreasing order.
    #[test]
    fn tile_policy_matches_predicate() {
        for &(nq, nk) in &[
            (1u32, 1u32),
            (7, 13),
            (13, 7),
            (64, 64),
            (100, 37),
            (37, 100),
            (129, 255),
        ] {
            for causal in [false, true] {
                let m = CausalMask {
                    seqlen_q: nq,
                    seqlen_k: nk,
                    causal,
                };
                for (bm, bn) in [(16u32, 16u32), (64, 32), (128, 64)] {
                    for row0 in (0..nq).step_by(bm as usize) {
                        let mut visited = [false; 64];
                        let mut last = u32::MAX;
                        for n in m.key_tiles(row0, bm, bn) {
                            assert!(n < last, "tiles must come in decreasing order");
                            last = n;
                            visited[n as usize] = true;
                        }
                        for n in 0..nk.div_ceil(bn) {
                            assert_eq!(m.visits_key_tile(row0, bm, n, bn), visited[n as usize]);
                        }
                        let rows = row0..(row0 + bm).min(nq);
                        for n in 0..nk.div_ceil(bn) {
                            let keys = n * bn..(n + 1) * bn;
                            let any = rows.clone().any(|r| keys.clone().any(|k| m.visible(r, k)));
                            let all = rows.clone().all(|r| keys.clone().all(|k| m.visible(r, k)));
                            let inside = visited[n as usize];
                            assert_eq!(
                                any, inside,
                                "nq={nq} nk={nk} causal={causal} row0={row0} n={n}"
                            );
                            if inside {
                                // rows past seqlen_q are never stored, so only valid rows count
                                assert!(all || m.tile_needs_mask(row0, bm, n, bn));
                            }
                        }
                        for r in rows {
                            assert_eq!(m.row_sees_keys(r), (0..nk).any(|k| m.visible(r, k)));
                        }
                    }
                }
            }
        }
    }
}
