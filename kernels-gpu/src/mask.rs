//! Which keys a query row may see, and which key tiles a query tile must visit.
//!
//! The kernels ask two questions of a mask: the *tile range* (which key tiles hold any visible
//! key for a query tile; the rest are skipped, not computed-and-masked) and the *score
//! predicate* (for a tile that is only partly visible, which elements to set to −∞). New masks
//! (varlen, sliding window, block-sparse, ...) implement [`AttnMask`]; the kernel loop does not
//! change. The CPU backend uses the same policies, so both sides agree on every edge.

/// A mask policy: a tile range plus an element predicate.
pub trait AttnMask {
    /// Key tiles `[start, end)` of `block_n` keys that query rows `[row0, row0 + block_m)`
    /// must visit. An empty range means every row of the tile sees no key.
    fn key_tiles(&self, row0: u32, block_m: u32, block_n: u32) -> (u32, u32);

    /// Whether key tile `n_block` holds any key that some row of the query tile may not see
    /// (then the kernel applies [`AttnMask::visible`] element by element).
    fn tile_needs_mask(&self, row0: u32, block_m: u32, n_block: u32, block_n: u32) -> bool;

    /// Whether query `row` sees key `key`.
    fn visible(&self, row: u32, key: u32) -> bool;

    /// Whether later query tiles visit more key tiles (then the grid runs them first, so the
    /// last wave holds the short ones).
    fn later_rows_see_more(&self) -> bool;
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
}

impl AttnMask for CausalMask {
    #[inline(always)]
    fn key_tiles(&self, row0: u32, block_m: u32, block_n: u32) -> (u32, u32) {
        let n_tiles = self.seqlen_k.div_ceil(block_n);
        if !self.causal {
            return (0, n_tiles);
        }
        let last_row = (row0 + block_m).min(self.seqlen_q).max(row0 + 1) - 1;
        let limit = self.causal_limit(last_row);
        if limit < 0 {
            return (0, 0);
        }
        (0, n_tiles.min((limit / block_n as i64) as u32 + 1))
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
    fn later_rows_see_more(&self) -> bool {
        self.causal
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force: the tile range and the needs-mask flag agree with the element predicate.
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
                        let (start, end) = m.key_tiles(row0, bm, bn);
                        let rows = row0..(row0 + bm).min(nq);
                        for n in 0..nk.div_ceil(bn) {
                            let keys = n * bn..(n + 1) * bn;
                            let any = rows.clone().any(|r| keys.clone().any(|k| m.visible(r, k)));
                            let all = rows.clone().all(|r| keys.clone().all(|k| m.visible(r, k)));
                            let inside = n >= start && n < end;
                            assert_eq!(
                                any, inside,
                                "nq={nq} nk={nk} causal={causal} row0={row0} n={n}"
                            );
                            if inside {
                                // rows past seqlen_q are never stored, so only valid rows count
                                assert!(all || m.tile_needs_mask(row0, bm, n, bn));
                            }
                        }
                    }
                }
            }
        }
    }
}
