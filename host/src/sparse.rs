//! Block-sparse masks ([`BlockMask`]): one bit per block of [`SPARSE_BLOCK`] queries ×
//! [`SPARSE_BLOCK`] keys, per batch entry and head or shared, and the helpers that build the
//! common layouts (local + global tokens, strided, butterfly).

use std::ops::Range;
use std::sync::{Arc, Mutex};

use flash_attn_kernels::mask::SPARSE_BLOCK;

use crate::device::Device;
use crate::error::{FlashError, Result};
use crate::resident::{DeviceWords, ResidentWords};

/// Rows and columns of one block of a [`BlockMask`]: 128 queries × 128 keys.
pub const BLOCK: usize = SPARSE_BLOCK as usize;

/// A block-sparse mask: `[B or 1, H or 1, ⌈Nq / 128⌉, ⌈Nk / 128⌉]` bits, bit (b, h, i, j) set
/// when query block `i` (queries `128·i ..`) of batch entry `b`, query head `h` may see key
/// block `j` (a dimension of 1 is shared by every entry or head). Blocks whose bit is 0 are
/// neither loaded nor computed; within visible blocks the other masks (causal, sequence ends)
/// still apply, so a causal block-sparse call sees `visible block ∧ j ≤ i + Nk − Nq`. Stored
/// bit-packed twice: by block row (`⌈key blocks / 32⌉` u32 words each, bit `j % 32` of word
/// `j / 32`; the forward walks a query tile's key blocks), then by block column (`⌈query
/// blocks / 32⌉` words each; the backward walks a key tile's query blocks).
///
/// A GPU call keeps these words, with its launches' tile orders after them, in device memory
/// until the mask is dropped (one copy per stream and launch shape, the newest 8), so later
/// calls with the same mask copy nothing to the device: build a mask once and reuse it
/// across calls (layers, steps). A clone starts without copies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMask {
    dims: [usize; 4],
    row_words: usize,
    col_words: usize,
    /// The block rows of every (entry, head), then from `cols_at` their block columns.
    words: Vec<u32>,
    cols_at: usize,
    /// The tile orders of the persistent forward launches and the backward launches over this
    /// mask so far.
    orders: Beside<OrderCache>,
    /// The words and the orders of recent calls, on the device.
    resident: Beside<ResidentWords>,
}

/// What identifies a launch's tile order over a mask (`crate::fwd`'s `tile_order`): its
/// sequences, heads, lengths, first sequence, query tiles per head, rows per tile, and causal
/// and longest-first flags; for a backward key tile order (`crate::bwd_order`, flag bit 2)
/// the KV heads and keys per tile in place of the tiles and rows.
pub(crate) type OrderKey = [u32; 8];

/// The tile orders of a call's launches over one mask, each with the key that names it among
/// the mask's orders (`crate::fwd::tile_order`, `crate::bwd_order`), laid one after the other
/// after the mask's words on the device.
pub(crate) type CallOrders = [(OrderKey, Arc<[u32]>)];

/// Launches' tile orders over one mask, each computed once (a mask is immutable, and a model
/// calls with the same one layer after layer): the newest [`OrderCache::KEEP`].
#[derive(Default)]
struct OrderCache(Mutex<Vec<(OrderKey, Arc<[u32]>)>>);

impl OrderCache {
    /// Orders kept per mask.
    const KEEP: usize = 8;
}

/// What a mask keeps beside its value (its caches): not part of it, so clones start empty,
/// and equality and `Debug` ignore it.
#[derive(Default)]
struct Beside<T>(T);

impl<T: Default> Clone for Beside<T> {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl<T> PartialEq for Beside<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl<T> Eq for Beside<T> {}

impl<T> std::ops::Deref for Beside<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> std::fmt::Debug for Beside<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("_")
    }
}

impl BlockMask {
    /// The mask of `dims` (`[B or 1, H or 1, query blocks, key blocks]`) with bit
    /// `visible(b, h, i, j)`. Errors: [`FlashError::Shape`] for a zero dimension,
    /// [`FlashError::TooLarge`] for one that overflows.
    pub fn from_fn(
        dims: [usize; 4],
        mut visible: impl FnMut(usize, usize, usize, usize) -> bool,
    ) -> Result<Self> {
        if dims.contains(&0) {
            return Err(FlashError::Shape(format!(
                "block mask {dims:?}: every dimension must be ≥ 1"
            )));
        }
        let [nb, nh, nqb, nkb] = dims;
        let (row_words, col_words) = (nkb.div_ceil(32), nqb.div_ceil(32));
        let too_large = || FlashError::TooLarge(format!("block mask {dims:?}"));
        let slots = nb.checked_mul(nh).ok_or_else(too_large)?;
        let rows_len = slots
            .checked_mul(nqb)
            .and_then(|n| n.checked_mul(row_words))
            .ok_or_else(too_large)?;
        let n = slots
            .checked_mul(nkb)
            .and_then(|n| n.checked_mul(col_words))
            .and_then(|n| n.checked_add(rows_len))
            .filter(|&n| n <= u32::MAX as usize)
            .ok_or_else(too_large)?;
        let mut words = vec![0u32; n];
        for b in 0..nb {
            for h in 0..nh {
                let slot = b * nh + h;
                for i in 0..nqb {
                    let row = (slot * nqb + i) * row_words;
                    for j in 0..nkb {
                        if visible(b, h, i, j) {
                            words[row + j / 32] |= 1 << (j % 32);
                            let col = rows_len + (slot * nkb + j) * col_words;
                            words[col + i / 32] |= 1 << (i % 32);
                        }
                    }
                }
            }
        }
        Ok(Self {
            dims,
            row_words,
            col_words,
            words,
            cols_at: rows_len,
            orders: Beside::default(),
            resident: Beside::default(),
        })
    }

    /// The mask of a dense `[B or 1, H or 1, query blocks, key blocks]` array (row-major),
    /// nonzero where visible (the CLI's `block_mask` tensor).
    pub fn from_dense(dims: [usize; 4], dense: &[i32]) -> Result<Self> {
        let n: usize = dims.iter().product();
        if dense.len() != n {
            return Err(FlashError::Shape(format!(
                "block mask {dims:?} needs {n} values, got {}",
                dense.len()
            )));
        }
        let [_, nh, nqb, nkb] = dims;
        Self::from_fn(dims, |b, h, i, j| {
            dense[((b * nh + h) * nqb + i) * nkb + j] != 0
        })
    }

    /// `[B or 1, H or 1, query blocks, key blocks]`.
    pub fn dims(&self) -> [usize; 4] {
        self.dims
    }

    /// Whether key block `j` is visible from query block `i` of entry `b`, head `h` (indices
    /// of shared dimensions are taken modulo 1).
    pub fn get(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let (b, h) = (b % self.dims[0], h % self.dims[1]);
        let row = ((b * self.dims[1] + h) * self.dims[2] + i) * self.row_words;
        self.words[row + j / 32] >> (j % 32) & 1 != 0
    }

    /// The visible key blocks below `key_blocks` in the union of block rows `rows` of entry
    /// `b`, head `h` (indices of shared dimensions taken modulo 1).
    pub(crate) fn visible_blocks(
        &self,
        b: usize,
        h: usize,
        rows: std::ops::RangeInclusive<usize>,
        key_blocks: usize,
    ) -> usize {
        let (b, h) = (b % self.dims[0], h % self.dims[1]);
        let first_row = (b * self.dims[1] + h) * self.dims[2];
        let lines = rows.map(|i| (first_row + i) * self.row_words);
        self.union_ones(lines, 0..key_blocks)
    }

    /// The visible query blocks in `rows` of the union of block columns `cols` of entry `b`,
    /// head `h` (indices of shared dimensions taken modulo 1).
    pub(crate) fn visible_query_blocks(
        &self,
        b: usize,
        h: usize,
        cols: std::ops::RangeInclusive<usize>,
        rows: std::ops::Range<usize>,
    ) -> usize {
        let (b, h) = (b % self.dims[0], h % self.dims[1]);
        let first_col = self.cols_at + (b * self.dims[1] + h) * self.dims[3] * self.col_words;
        let lines = cols.map(|j| first_col + j * self.col_words);
        self.union_ones(lines, rows)
    }

    /// The set bits with indices in `bits` of the union of the bit lines (rows or columns)
    /// whose words start at `lines`.
    fn union_ones(&self, lines: impl Iterator<Item = usize> + Clone, bits: Range<usize>) -> usize {
        (bits.start / 32..bits.end.div_ceil(32))
            .map(|w| {
                let union = lines.clone().fold(0u32, |u, at| u | self.words[at + w]);
                // Keep bits 32·w + [lo, hi).
                let lo = bits.start.saturating_sub(32 * w).min(32);
                let hi = (bits.end - 32 * w).min(32);
                let kept = ((u64::from(u32::MAX) << lo) & ((1u64 << hi) - 1)) as u32;
                (union & kept).count_ones() as usize
            })
            .sum()
    }

    /// The tile order of the launch `key` describes: kept from an earlier call, else
    /// `compute`d and kept.
    pub(crate) fn tile_order(
        &self,
        key: OrderKey,
        compute: impl FnOnce() -> Vec<u32>,
    ) -> Arc<[u32]> {
        let cache: &OrderCache = &self.orders;
        let mut orders = cache.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, order)) = orders.iter().find(|(k, _)| *k == key) {
            return order.clone();
        }
        let order: Arc<[u32]> = compute().into();
        if orders.len() == OrderCache::KEEP {
            orders.remove(0);
        }
        orders.push((key, order.clone()));
        order
    }

    /// The packed words, then `orders` (tile orders of this mask, one after the other), on
    /// `dev`: uploaded by the first call that asks, kept for the next ([`ResidentWords`]).
    pub(crate) fn on_device(&self, dev: &Device, orders: &CallOrders) -> Result<DeviceWords> {
        self.resident.on_device(dev, orders, self.words.len(), || {
            let mut words = self.words.clone();
            orders.iter().for_each(|(_, o)| words.extend_from_slice(o));
            words
        })
    }

    /// The share of visible blocks.
    pub fn density(&self) -> f64 {
        let rows = &self.words[..self.cols_at];
        let ones: u64 = rows.iter().map(|w| u64::from(w.count_ones())).sum();
        ones as f64 / self.dims.iter().product::<usize>() as f64
    }

    /// The packed words, rows then columns (what the kernels read).
    pub(crate) fn words(&self) -> &[u32] {
        &self.words
    }

    /// Where in [`BlockMask::words`] the block columns start.
    pub(crate) fn cols_offset(&self) -> usize {
        self.cols_at
    }

    /// Words between two batch entries' columns (0 when shared).
    pub(crate) fn col_batch_stride(&self) -> usize {
        if self.dims[0] == 1 {
            0
        } else {
            self.dims[1] * self.dims[3] * self.col_words
        }
    }

    /// Words between two heads' columns (0 when shared).
    pub(crate) fn col_head_stride(&self) -> usize {
        if self.dims[1] == 1 {
            0
        } else {
            self.dims[3] * self.col_words
        }
    }

    /// Words between two batch entries' rows (0 when shared).
    pub(crate) fn batch_stride(&self) -> usize {
        if self.dims[0] == 1 {
            0
        } else {
            self.dims[1] * self.dims[2] * self.row_words
        }
    }

    /// Words between two heads' rows (0 when shared).
    pub(crate) fn head_stride(&self) -> usize {
        if self.dims[1] == 1 {
            0
        } else {
            self.dims[2] * self.row_words
        }
    }

    /// Checks the mask against a call of `batch` entries, `heads_q` query heads and the
    /// lengths `seqlen_q`, `seqlen_k`. Errors: [`FlashError::Shape`].
    pub fn check(
        &self,
        batch: usize,
        heads_q: usize,
        seqlen_q: usize,
        seqlen_k: usize,
    ) -> Result<()> {
        let want = [seqlen_q.div_ceil(BLOCK), seqlen_k.div_ceil(BLOCK)];
        let [b, h, qb, kb] = self.dims;
        if (b != 1 && b != batch) || (h != 1 && h != heads_q) || [qb, kb] != want {
            return Err(FlashError::Shape(format!(
                "block mask is {:?}, expected [{batch} or 1, {heads_q} or 1, {}, {}] (blocks of {BLOCK} queries × {BLOCK} keys)",
                self.dims, want[0], want[1]
            )));
        }
        Ok(())
    }

    /// Local and global attention (Longformer, BigBird's window + global tokens), shared by
    /// every entry and head: query block `i` sees key blocks within `window` blocks of its
    /// diagonal (bottom-right aligned: key block `i + kb − qb`), and the first `global` key
    /// blocks; the first `global` query blocks see every key block.
    pub fn local_global(
        q_blocks: usize,
        k_blocks: usize,
        window: usize,
        global: usize,
    ) -> Result<Self> {
        let shift = k_blocks as i64 - q_blocks as i64;
        Self::from_fn([1, 1, q_blocks, k_blocks], |_, _, i, j| {
            let diag = i as i64 + shift;
            (j as i64 - diag).unsigned_abs() as usize <= window || j < global || i < global
        })
    }

    /// Strided attention (the Sparse Transformer's pattern): query block `i` sees the `local`
    /// key blocks ending at its diagonal and every `stride`-th key block before it (key blocks
    /// `j` with `(diagonal − j) % stride == 0`).
    pub fn strided(q_blocks: usize, k_blocks: usize, local: usize, stride: usize) -> Result<Self> {
        if stride == 0 {
            return Err(FlashError::Param(
                "strided block mask: stride must be ≥ 1".into(),
            ));
        }
        let shift = k_blocks as i64 - q_blocks as i64;
        Self::from_fn([1, 1, q_blocks, k_blocks], |_, _, i, j| {
            let back = i as i64 + shift - j as i64;
            back >= 0 && ((back as usize) < local || back as usize % stride == 0)
        })
    }

    /// Butterfly attention (Pixelated Butterfly): query block `i` sees key block `j` when
    /// `i XOR j` is 0 or a power of two (the diagonal and one partner at every scale; with
    /// fewer key blocks than query blocks, query blocks wrap around the key blocks).
    pub fn butterfly(q_blocks: usize, k_blocks: usize) -> Result<Self> {
        Self::from_fn([1, 1, q_blocks, k_blocks], |_, _, i, j| {
            ((i % k_blocks) ^ j).count_ones() <= 1
        })
    }
}

/// Test helper of the tile orders (`crate::fwd`'s `tile_order`, `crate::bwd_order`): `visits`
/// of an order's `tiles` fall, ties keeping tile order; whether any two differ.
#[cfg(test)]
pub(crate) fn assert_longest_first(visits: &[usize], tiles: &[u32]) -> bool {
    assert!(
        visits.windows(2).all(|w| w[0] >= w[1]),
        "longest first: {visits:?}"
    );
    for (w, t) in visits.windows(2).zip(tiles.windows(2)) {
        assert!(w[0] != w[1] || t[0] < t[1], "ties in tile order");
    }
    visits[0] > visits[visits.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_round_trip_and_broadcast() {
        let m = BlockMask::from_fn([2, 1, 3, 40], |b, _, i, j| (b + i + j) % 3 == 0).unwrap();
        assert_eq!(m.row_words, 2);
        for b in 0..2 {
            for h in 0..5 {
                for i in 0..3 {
                    for j in 0..40 {
                        assert_eq!(m.get(b, h, i, j), (b + i + j) % 3 == 0);
                    }
                }
            }
        }
        assert_eq!((m.batch_stride(), m.head_stride()), (6, 0));
        let dense: Vec<i32> = (0..2 * 3 * 40).map(|x| i32::from(x % 7 == 0)).collect();
        let d = BlockMask::from_dense([2, 1, 3, 40], &dense).unwrap();
        assert!(d.get(0, 0, 0, 0) && !d.get(0, 0, 0, 1) && d.get(0, 0, 0, 7));
        assert!(BlockMask::from_fn([1, 0, 1, 1], |_, _, _, _| true).is_err());
        assert!(m.check(2, 4, 300, 5000).is_ok());
        assert!(m.check(3, 4, 300, 5000).is_err());
        assert!(m.check(2, 4, 257, 5000).is_ok());
        assert!(m.check(2, 4, 256, 5000).is_err());
    }

    /// The block columns hold the same bits as the rows, at their strides.
    #[test]
    fn columns_mirror_rows() {
        for dims in [[2, 3, 5, 40], [1, 2, 70, 3], [3, 1, 33, 33]] {
            let bit = |b: usize, h: usize, i: usize, j: usize| (b * 7 + h * 5 + i * 3 + j) % 4 == 0;
            let m = BlockMask::from_fn(dims, bit).unwrap();
            let col_words = dims[2].div_ceil(32);
            for b in 0..dims[0] {
                for h in 0..dims[1] {
                    for i in 0..dims[2] {
                        for j in 0..dims[3] {
                            let at = m.cols_offset()
                                + b * m.col_batch_stride()
                                + h * m.col_head_stride()
                                + j * col_words
                                + i / 32;
                            assert_eq!(m.words()[at] >> (i % 32) & 1 != 0, bit(b, h, i, j));
                            assert_eq!(m.get(b, h, i, j), bit(b, h, i, j));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn helpers_draw_their_patterns() {
        let lg = BlockMask::local_global(8, 8, 1, 1).unwrap();
        assert!(lg.get(0, 0, 5, 4) && lg.get(0, 0, 5, 6) && !lg.get(0, 0, 5, 3));
        assert!(lg.get(0, 0, 5, 0) && lg.get(0, 0, 0, 7));
        let st = BlockMask::strided(8, 8, 2, 3).unwrap();
        assert!(st.get(0, 0, 7, 7) && st.get(0, 0, 7, 6) && st.get(0, 0, 7, 4));
        assert!(!st.get(0, 0, 7, 5) && st.get(0, 0, 7, 1) && !st.get(0, 0, 3, 4));
        let bf = BlockMask::butterfly(8, 8).unwrap();
        assert!(bf.get(0, 0, 5, 5) && bf.get(0, 0, 5, 4) && bf.get(0, 0, 5, 1));
        assert!(!bf.get(0, 0, 5, 2) && (bf.density() - 32.0 / 64.0).abs() < 1e-12);
    }
}
