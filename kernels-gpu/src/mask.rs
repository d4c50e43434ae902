//! Which keys a query row may see, which key tiles a query tile must visit, and how a score
//! is modified before the softmax.
//!
//! A mask is a compile-time type (one per [`crate::registry::MaskKind`]) built in each block
//! from the params' [`MaskArgs`] and the block's [`BlockInfo`]. The kernels ask it:
//! - the *key tiles* a query tile visits, as an iterator (last tile first; gaps allowed, for
//!   block-sparse and tree masks); tiles it skips are neither loaded nor computed;
//! - whether a visited tile needs the element-wise predicate ([`AttnMask::visible`]), or is
//!   entirely visible;
//! - the *score modifier* ([`AttnMask::score`], for ALiBi and softcap), which does nothing
//!   unless the mask says [`AttnMask::MODIFIES_SCORES`], and its derivative for the backward.
//!
//! The CPU backend uses the same types, so both sides agree on every edge.

use crate::block::BlockInfo;
use crate::params::MaskArgs;

/// A mask policy; see the module docs.
pub trait AttnMask: Sized {
    /// Whether [`AttnMask::score`] may change scores (else kernels skip it and apply the
    /// softmax scale themselves).
    const MODIFIES_SCORES: bool = false;

    /// Whether the tile walks ([`AttnMask::next_key_tile`], [`AttnMask::query_tile_at_or_after`])
    /// read memory (the block-sparse mask's bits). Their results are the same in every lane,
    /// but ptxas cannot know it: the GPU kernels then pass them through lane 0 (a shuffle), so
    /// that the loops they drive, and the `wgmma` descriptors derived from them, stay on the
    /// uniform datapath.
    const WALK_READS_MEMORY: bool = false;

    /// Whether [`AttnMask::score`] changes this block's scores: [`AttnMask::MODIFIES_SCORES`]
    /// and, for masks whose modifiers are optional, one of them on (block-uniform; when false
    /// the kernels skip the modifier and apply the softmax scale themselves).
    #[inline(always)]
    fn modifies_scores(&self) -> bool {
        Self::MODIFIES_SCORES
    }

    /// The mask of one block.
    ///
    /// # Safety
    /// `args` are the host-validated arguments of the launch.
    unsafe fn new(args: &MaskArgs, block: &BlockInfo) -> Self;

    /// The ALiBi slope of query head `head` of batch entry `batch` (0 without ALiBi): the
    /// `slope` argument of [`AttnMask::score`].
    ///
    /// # Safety
    /// `args.alibi_slopes`, when set, holds the entry (the host validated its length).
    #[inline(always)]
    unsafe fn slope(_args: &MaskArgs, _batch: u32, _head: u32) -> f32 {
        0.0
    }

    /// [`AttnMask::slope`] of the block's own head (kept by the mask; 0 without ALiBi).
    #[inline(always)]
    fn block_slope(&self) -> f32 {
        0.0
    }

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

    /// Whether the key tiles a query tile visits are one run, from
    /// [`AttnMask::lowest_key_tile`] up to [`AttnMask::first_key_tile`] (the causal mask and
    /// windows): a kernel may then walk them upwards.
    const CONTIGUOUS_WALK: bool = false;

    /// The lowest key tile of the walk that starts at [`AttnMask::first_key_tile`], for masks
    /// with [`AttnMask::CONTIGUOUS_WALK`] (others never call it). Only meaningful when
    /// `first_key_tile` is `Some`.
    #[inline(always)]
    fn lowest_key_tile(&self, _row0: u32, _block_n: u32) -> u32 {
        0
    }

    /// Whether query rows `[row0, row0 + block_m)` visit key tile `n` (the backward walks the
    /// query tiles of one key tile).
    fn visits_key_tile(&self, row0: u32, block_m: u32, n: u32, block_n: u32) -> bool;

    /// The first query tile `≥ i` (of `block_m` rows) that visits key tile `n` (of `block_n`
    /// keys): the backward's walk over the query tiles of one key tile. The default is
    /// [`AttnMask::scan_query_tiles`]; masks that can jump over the tiles they skip override
    /// it. With `LEAN` (a caller with no registers to spare: the `mma.sync` backward with
    /// dropout), masks whose jump costs registers (windows) scan instead.
    #[inline(always)]
    fn query_tile_at_or_after<const LEAN: bool>(
        &self,
        i: u32,
        block_m: u32,
        n: u32,
        block_n: u32,
    ) -> Option<u32> {
        self.scan_query_tiles(i, block_m, n, block_n)
    }

    /// [`AttnMask::query_tile_at_or_after`] by testing each tile from `i` with
    /// [`AttnMask::visits_key_tile`].
    #[inline(always)]
    fn scan_query_tiles(&self, i: u32, block_m: u32, n: u32, block_n: u32) -> Option<u32> {
        let tiles = self.seqlen_q().div_ceil(block_m);
        (i..tiles).find(|&t| self.visits_key_tile(t * block_m, block_m, n, block_n))
    }

    /// The query sequence length of the mask's block.
    fn seqlen_q(&self) -> u32;

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

    /// Whether every row sees one interval of keys, [`AttnMask::row_keys`] (the causal mask,
    /// windows and the general mask): a masked tile then tests each score against two bounds
    /// per row instead of calling [`AttnMask::visible`].
    const ROW_INTERVAL: bool = false;

    /// Whether the interval of [`AttnMask::row_keys`] may start after key 0 (windows; the
    /// causal mask's always starts at 0).
    const ROW_LOWER_BOUND: bool = true;

    /// The keys `row` sees, `[lo, hi)` (none when `lo ≥ hi`): exactly the keys
    /// [`AttnMask::visible`] accepts, for masks with [`AttnMask::ROW_INTERVAL`] (others never
    /// call it).
    #[inline(always)]
    fn row_keys(&self, _row: u32) -> (u32, u32) {
        (0, 0)
    }

    /// Whether query `row` sees at least one key. Rows that see none get O = 0 and LSE = −∞;
    /// rows that see keys whose scores are all −∞ get NaN (they are not masked rows).
    fn row_sees_keys(&self, row: u32) -> bool;

    /// The logit of (`row`, `key`) from its raw score `s = q·k`, for masks that
    /// [`AttnMask::MODIFIES_SCORES`] (the softmax then runs with the scale `log2 e`); `slope`
    /// from [`AttnMask::slope`] for the row's head.
    #[inline(always)]
    fn score(&self, _row: u32, _key: u32, s: f32, _slope: f32) -> f32 {
        s
    }

    /// [`AttnMask::score`] and its derivative with respect to `s` (the backward multiplies dS
    /// by it).
    #[inline(always)]
    fn score_and_grad(&self, row: u32, key: u32, s: f32, slope: f32) -> (f32, f32) {
        self.score_and_grad_as::<true>(row, key, s, slope)
    }

    /// Whether the block's score modifier takes its optional branch (the softcap's `tanh`):
    /// block-uniform, so kernels branch on it once per tile and call
    /// [`AttnMask::score_as`] with it, leaving no branch in the per-score code.
    #[inline(always)]
    fn capped(&self) -> bool {
        false
    }

    /// [`AttnMask::score`] with the optional branch decided by the caller (`CAP` =
    /// [`AttnMask::capped`]).
    #[inline(always)]
    fn score_as<const CAP: bool>(&self, row: u32, key: u32, s: f32, slope: f32) -> f32 {
        self.score(row, key, s, slope)
    }

    /// d logit / d s of an uncapped block ([`AttnMask::capped`] false): one value for every
    /// score (the softmax scale where the mask applies it, else 1), so a kernel that takes no
    /// capped blocks multiplies dS by it instead of keeping a derivative per score.
    #[inline(always)]
    fn uncapped_grad(&self) -> f32 {
        1.0
    }

    /// [`AttnMask::score_and_grad`] with the optional branch decided by the caller.
    #[inline(always)]
    fn score_and_grad_as<const CAP: bool>(
        &self,
        row: u32,
        key: u32,
        s: f32,
        slope: f32,
    ) -> (f32, f32) {
        (self.score(row, key, s, slope), 1.0)
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
    pub fn key_end(&self, row: u32) -> u32 {
        if self.causal {
            (self.causal_limit(row) + 1).clamp(0, self.seqlen_k as i64) as u32
        } else {
            self.seqlen_k
        }
    }

    /// [`AttnMask::query_tile_at_or_after`] jumping straight to the first query tile that
    /// reaches key tile `n` (rows before `key0 − shift` see none of its keys under causal
    /// masking; from there on the visited tiles have no gap). The block-sparse walk uses it;
    /// the plain backward keeps the trait's plain scan, which costs it fewer registers.
    #[inline(always)]
    pub fn first_query_tile_from(&self, i: u32, block_m: u32, n: u32, block_n: u32) -> Option<u32> {
        let lowest_row = if self.causal {
            let key0 = n as i64 * block_n as i64;
            (key0 - self.seqlen_k as i64 + self.seqlen_q as i64).max(0)
        } else {
            0
        };
        let from = i.max((lowest_row / block_m as i64).min(u32::MAX as i64) as u32);
        let tiles = self.seqlen_q.div_ceil(block_m);
        (from..tiles).find(|&t| self.visits_key_tile(t * block_m, block_m, n, block_n))
    }
}

impl AttnMask for CausalMask {
    #[inline(always)]
    fn seqlen_q(&self) -> u32 {
        self.seqlen_q
    }

    #[inline(always)]
    unsafe fn new(args: &MaskArgs, block: &BlockInfo) -> Self {
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

    const CONTIGUOUS_WALK: bool = true;

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

    const ROW_INTERVAL: bool = true;
    const ROW_LOWER_BOUND: bool = false;

    #[inline(always)]
    fn row_keys(&self, row: u32) -> (u32, u32) {
        (0, self.key_end(row))
    }

    #[inline(always)]
    fn row_sees_keys(&self, row: u32) -> bool {
        self.key_end(row) > 0
    }
}

/// The largest window bound: a window side of this size (or more) is unbounded.
pub const UNBOUNDED: u32 = u32::MAX;

/// Sequence tails plus a window aligned to the bottom-right corner: with
/// `shift = seqlen_k − seqlen_q`, query `i` sees keys `j` with
/// `i + shift − left ≤ j ≤ i + shift + right` and `j < seqlen_k` (FlashAttention 2's
/// convention). Causal masking is the window `(UNBOUNDED, 0)`, no mask `(UNBOUNDED,
/// UNBOUNDED)`. Rows whose window holds no key (for example `i < seqlen_q − seqlen_k` when
/// causal) see no key at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowMask {
    /// Query sequence length.
    pub seqlen_q: u32,
    /// Key sequence length.
    pub seqlen_k: u32,
    /// Keys visible before the diagonal ([`UNBOUNDED`]: all).
    pub left: u32,
    /// Keys visible after the diagonal ([`UNBOUNDED`]: all).
    pub right: u32,
}

impl WindowMask {
    /// The mask of `args` for sequences of `seqlen_q` queries and `seqlen_k` keys.
    #[inline(always)]
    pub fn of(args: &MaskArgs, seqlen_q: u32, seqlen_k: u32) -> Self {
        Self {
            seqlen_q,
            seqlen_k,
            left: args.window_left,
            right: args.window_right,
        }
    }

    /// `seqlen_k − seqlen_q`: the diagonal of row `i` is key `i + shift`.
    #[inline(always)]
    fn shift(&self) -> i64 {
        self.seqlen_k as i64 - self.seqlen_q as i64
    }

    /// The first key `row` may see, before clipping to the sequence (may be negative).
    #[inline(always)]
    fn lo(&self, row: u32) -> i64 {
        row as i64 + self.shift() - self.left as i64
    }

    /// The last key `row` may see, before clipping to the sequence (inclusive).
    #[inline(always)]
    fn hi(&self, row: u32) -> i64 {
        row as i64 + self.shift() + self.right as i64
    }

    /// The keys rows `[row0, row0 + block_m)` see, as an inclusive range clipped to the
    /// sequence; empty when `first > last`. Rows past `seqlen_q` do not count. The rows'
    /// windows slide by one key per row, so their union has no gap.
    #[inline(always)]
    fn keys_of_rows(&self, row0: u32, block_m: u32) -> (i64, i64) {
        let last_row = (row0 + block_m).min(self.seqlen_q).max(row0 + 1) - 1;
        (
            self.lo(row0).max(0),
            self.hi(last_row).min(self.seqlen_k as i64 - 1),
        )
    }
}

impl AttnMask for WindowMask {
    #[inline(always)]
    fn seqlen_q(&self) -> u32 {
        self.seqlen_q
    }

    #[inline(always)]
    unsafe fn new(args: &MaskArgs, block: &BlockInfo) -> Self {
        Self::of(args, block.seqlen_q, block.seqlen_k)
    }

    #[inline(always)]
    fn later_rows_see_more(args: &MaskArgs) -> bool {
        args.window_left == UNBOUNDED && args.window_right != UNBOUNDED
    }

    #[inline(always)]
    fn first_key_tile(&self, row0: u32, block_m: u32, block_n: u32) -> Option<u32> {
        let (first, last) = self.keys_of_rows(row0, block_m);
        (first <= last).then(|| (last / block_n as i64) as u32)
    }

    #[inline(always)]
    fn next_key_tile(&self, row0: u32, _block_m: u32, block_n: u32, n: u32) -> Option<u32> {
        let lowest = self.lowest_key_tile(row0, block_n);
        (n > lowest).then(|| n - 1)
    }

    const CONTIGUOUS_WALK: bool = true;

    #[inline(always)]
    fn lowest_key_tile(&self, row0: u32, block_n: u32) -> u32 {
        (self.lo(row0).max(0) / block_n as i64) as u32
    }

    #[inline(always)]
    fn visits_key_tile(&self, row0: u32, block_m: u32, n: u32, block_n: u32) -> bool {
        let (first, last) = self.keys_of_rows(row0, block_m);
        let (k0, k1) = (
            n as i64 * block_n as i64,
            (n as i64 + 1) * block_n as i64 - 1,
        );
        first <= last && k0 <= last && k1 >= first
    }

    /// The rows whose windows reach keys `k0 ..= k1` of tile `n` (clipped to the sequence)
    /// are `k0 − shift − right ..= k1 − shift + left` (the windows slide by one key per row),
    /// so the walk jumps to the first tile of them instead of testing every tile before it
    /// (with a 4K window at 64K keys, ~1,400 tests per key tile); `LEAN` scans.
    #[inline(always)]
    fn query_tile_at_or_after<const LEAN: bool>(
        &self,
        i: u32,
        block_m: u32,
        n: u32,
        block_n: u32,
    ) -> Option<u32> {
        if LEAN {
            return self.scan_query_tiles(i, block_m, n, block_n);
        }
        let k0 = n as i64 * block_n as i64;
        let k1 = (k0 + block_n as i64).min(self.seqlen_k as i64) - 1;
        let first_row = (k0 - self.shift() - self.right as i64).max(0);
        let last_row = (k1 - self.shift() + self.left as i64).min(self.seqlen_q as i64 - 1);
        let from = (i as i64).max(first_row / block_m as i64);
        (first_row <= last_row && from * block_m as i64 <= last_row).then_some(from as u32)
    }

    #[inline(always)]
    fn tile_needs_mask(&self, row0: u32, block_m: u32, n_block: u32, block_n: u32) -> bool {
        let k0 = n_block as i64 * block_n as i64;
        let k1 = k0 + block_n as i64 - 1; // inclusive
                                          // The first row sees the fewest keys on the right, the tile's last row (valid or
                                          // not: rows past the sequence are never stored) the fewest on the left.
        k1 >= self.seqlen_k as i64 || k1 > self.hi(row0) || k0 < self.lo(row0 + block_m - 1)
    }

    #[inline(always)]
    fn visible(&self, row: u32, key: u32) -> bool {
        let key_i = key as i64;
        key < self.seqlen_k && key_i >= self.lo(row) && key_i <= self.hi(row)
    }

    const ROW_INTERVAL: bool = true;

    #[inline(always)]
    fn row_keys(&self, row: u32) -> (u32, u32) {
        let clip = |k: i64| k.clamp(0, self.seqlen_k as i64) as u32;
        (clip(self.lo(row)), clip(self.hi(row) + 1))
    }

    #[inline(always)]
    fn row_sees_keys(&self, row: u32) -> bool {
        self.lo(row).max(0) <= self.hi(row).min(self.seqlen_k as i64 - 1)
    }
}

/// The general mask ([`crate::registry::MaskKind::Masked`]): a [`WindowMask`] plus score
/// modifiers. The logit of (row `i`, key `j`) is
/// `softcap(scale·s) − slope·|i + shift − j|` with `softcap(x) = cap·tanh(x / cap)` when a
/// cap is set (Gemma 2) and the ALiBi slope of the block's (batch, head) (MPT, BLOOM;
/// FlashAttention's convention, bottom-right aligned). The kernels then run the softmax with
/// the scale `log2 e` (the softmax scale is applied here, before the cap).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoredMask {
    /// Which keys each row sees.
    pub window: WindowMask,
    /// The softmax scale (applied before the cap).
    pub scale: f32,
    /// The cap; 0 for none.
    pub softcap: f32,
    /// `1 / softcap` (0 without a cap).
    pub inv_softcap: f32,
    /// `seqlen_k − seqlen_q` in f32: the diagonal of row `i` is key `i + shift`.
    pub shift: f32,
    /// The ALiBi slope of the block's head (0: none).
    pub slope: f32,
    /// Whether a softcap or ALiBi is on ([`MaskArgs::modifies_scores`]); without them the
    /// scores are left alone (a window only).
    pub modifies: bool,
}

impl ScoredMask {
    /// The mask of `args` for sequences of `seqlen_q` queries and `seqlen_k` keys.
    #[inline(always)]
    pub fn of(args: &MaskArgs, seqlen_q: u32, seqlen_k: u32) -> Self {
        Self {
            window: WindowMask::of(args, seqlen_q, seqlen_k),
            scale: args.scale,
            softcap: args.softcap,
            inv_softcap: if args.softcap > 0.0 {
                1.0 / args.softcap
            } else {
                0.0
            },
            shift: (seqlen_k as i64 - seqlen_q as i64) as f32,
            slope: 0.0,
            modifies: args.modifies_scores(),
        }
    }

    /// `cap·tanh(x / cap)` and its derivative `1 − tanh²` when `CAP` (the caller checked
    /// [`AttnMask::capped`]), else `(x, 1)`.
    #[inline(always)]
    fn cap<const CAP: bool>(&self, x: f32) -> (f32, f32) {
        if CAP {
            let t = crate::math::tanh(x * self.inv_softcap);
            (self.softcap * t, 1.0 - t * t)
        } else {
            (x, 1.0)
        }
    }

    /// `|row + shift − key|` in f32 (exact while the positions stay below 2²⁴).
    #[inline(always)]
    fn distance(&self, row: u32, key: u32) -> f32 {
        (row as f32 + self.shift - key as f32).abs()
    }
}

impl AttnMask for ScoredMask {
    #[inline(always)]
    fn seqlen_q(&self) -> u32 {
        self.window.seqlen_q
    }

    const MODIFIES_SCORES: bool = true;

    #[inline(always)]
    fn modifies_scores(&self) -> bool {
        self.modifies
    }

    #[inline(always)]
    unsafe fn new(args: &MaskArgs, block: &BlockInfo) -> Self {
        Self {
            slope: Self::slope(args, block.batch, block.head),
            ..Self::of(args, block.seqlen_q, block.seqlen_k)
        }
    }

    #[inline(always)]
    fn block_slope(&self) -> f32 {
        self.slope
    }

    #[inline(always)]
    unsafe fn slope(args: &MaskArgs, batch: u32, head: u32) -> f32 {
        if args.alibi_slopes == 0 {
            0.0
        } else {
            let at = batch as usize * args.alibi_batch_stride as usize + head as usize;
            *(args.alibi_slopes as *const f32).add(at)
        }
    }

    #[inline(always)]
    fn later_rows_see_more(args: &MaskArgs) -> bool {
        WindowMask::later_rows_see_more(args)
    }

    #[inline(always)]
    fn first_key_tile(&self, row0: u32, block_m: u32, block_n: u32) -> Option<u32> {
        self.window.first_key_tile(row0, block_m, block_n)
    }

    #[inline(always)]
    fn next_key_tile(&self, row0: u32, block_m: u32, block_n: u32, n: u32) -> Option<u32> {
        self.window.next_key_tile(row0, block_m, block_n, n)
    }

    const CONTIGUOUS_WALK: bool = true;

    #[inline(always)]
    fn lowest_key_tile(&self, row0: u32, block_n: u32) -> u32 {
        self.window.lowest_key_tile(row0, block_n)
    }

    #[inline(always)]
    fn visits_key_tile(&self, row0: u32, block_m: u32, n: u32, block_n: u32) -> bool {
        self.window.visits_key_tile(row0, block_m, n, block_n)
    }

    #[inline(always)]
    fn query_tile_at_or_after<const LEAN: bool>(
        &self,
        i: u32,
        block_m: u32,
        n: u32,
        block_n: u32,
    ) -> Option<u32> {
        self.window
            .query_tile_at_or_after::<LEAN>(i, block_m, n, block_n)
    }

    #[inline(always)]
    fn tile_needs_mask(&self, row0: u32, block_m: u32, n_block: u32, block_n: u32) -> bool {
        self.window.tile_needs_mask(row0, block_m, n_block, block_n)
    }

    #[inline(always)]
    fn visible(&self, row: u32, key: u32) -> bool {
        self.window.visible(row, key)
    }

    const ROW_INTERVAL: bool = true;

    #[inline(always)]
    fn row_keys(&self, row: u32) -> (u32, u32) {
        self.window.row_keys(row)
    }

    #[inline(always)]
    fn row_sees_keys(&self, row: u32) -> bool {
        self.window.row_sees_keys(row)
    }

    #[inline(always)]
    fn score(&self, row: u32, key: u32, s: f32, slope: f32) -> f32 {
        if self.capped() {
            self.score_as::<true>(row, key, s, slope)
        } else {
            self.score_as::<false>(row, key, s, slope)
        }
    }

    #[inline(always)]
    fn score_and_grad(&self, row: u32, key: u32, s: f32, slope: f32) -> (f32, f32) {
        if self.capped() {
            self.score_and_grad_as::<true>(row, key, s, slope)
        } else {
            self.score_and_grad_as::<false>(row, key, s, slope)
        }
    }

    #[inline(always)]
    fn capped(&self) -> bool {
        self.softcap > 0.0
    }

    #[inline(always)]
    fn uncapped_grad(&self) -> f32 {
        self.scale
    }

    #[inline(always)]
    fn score_as<const CAP: bool>(&self, row: u32, key: u32, s: f32, slope: f32) -> f32 {
        let (x, _) = self.cap::<CAP>(self.scale * s);
        x - slope * self.distance(row, key)
    }

    #[inline(always)]
    fn score_and_grad_as<const CAP: bool>(
        &self,
        row: u32,
        key: u32,
        s: f32,
        slope: f32,
    ) -> (f32, f32) {
        let (x, dx) = self.cap::<CAP>(self.scale * s);
        (x - slope * self.distance(row, key), self.scale * dx)
    }
}

/// Side of the blocks of a block-sparse mask ([`SparseMask`]): 128 queries × 128 keys, a
/// multiple of every kernel tile (GPU and CPU tiles are powers of two up to 128), so that a
/// tile lies in one block and is visited or skipped whole.
pub const SPARSE_BLOCK: u32 = 128;

/// Block-sparse attention (the FlashAttention paper's section 3.3): the tails and causal
/// masking of a [`CausalMask`], and one bit per block of [`SPARSE_BLOCK`] queries ×
/// [`SPARSE_BLOCK`] keys of the block's (batch, head). Key tiles in blocks whose bit is 0 are
/// neither loaded nor computed; a row whose visible blocks hold no key it may see gets
/// O = 0, LSE = −∞.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseMask {
    /// Tails and causal masking.
    pub base: CausalMask,
    /// Address of the (batch, head)'s first u32 word (row-major block rows of
    /// [`sparse_row_words`] words each).
    pub bits: u64,
    /// Address of the (batch, head)'s first word of the same bits by key block (block columns
    /// of [`sparse_row_words`]`(seqlen_q)` words each: bit `qb % 32` of word `qb / 32` of
    /// column `kb` is block (`qb`, `kb`)), which the backward's walk over the query tiles of a
    /// key tile reads.
    pub cols: u64,
}

/// Words per block row of a block-sparse mask over `seqlen_k` keys: one bit per key block of
/// [`SPARSE_BLOCK`] keys (recomputed from the key count rather than kept in a register).
#[inline(always)]
pub const fn sparse_row_words(seqlen_k: u32) -> u32 {
    seqlen_k.div_ceil(SPARSE_BLOCK).div_ceil(32)
}

impl SparseMask {
    /// The word of block row `qb` holding key block `kb`.
    #[inline(always)]
    fn word(&self, qb: u32, kb: u32) -> u32 {
        let row_words = sparse_row_words(self.base.seqlen_k);
        let at = qb as usize * row_words as usize + (kb / 32) as usize;
        // SAFETY: `new`'s caller vouches for the words of every block row and key block.
        unsafe { *(self.bits as *const u32).add(at) }
    }

    /// Whether block (`qb`, `kb`) is visible.
    #[inline(always)]
    pub fn block_visible(&self, qb: u32, kb: u32) -> bool {
        self.word(qb, kb) >> (kb % 32) & 1 != 0
    }

    /// The highest visible key block `≤ kb` of block row `qb`.
    #[inline(always)]
    fn visible_block_at_or_below(&self, qb: u32, kb: u32) -> Option<u32> {
        let mut w = kb / 32;
        let mut bits = self.word(qb, kb) & (u32::MAX >> (31 - kb % 32));
        loop {
            if bits != 0 {
                return Some(w * 32 + 31 - bits.leading_zeros());
            }
            if w == 0 {
                return None;
            }
            w -= 1;
            bits = self.word(qb, w * 32);
        }
    }

    /// The lowest visible query block `≥ qb` of key block `kb` (from the column words).
    #[inline(always)]
    fn visible_block_at_or_after(&self, qb: u32, kb: u32) -> Option<u32> {
        let col_words = sparse_row_words(self.base.seqlen_q);
        let word = |w: u32| {
            let at = kb as usize * col_words as usize + w as usize;
            // SAFETY: `new`'s caller vouches for the column words of every key block.
            unsafe { *(self.cols as *const u32).add(at) }
        };
        let mut w = qb / 32;
        if w >= col_words {
            return None;
        }
        let mut bits = word(w) & (u32::MAX << (qb % 32));
        loop {
            if bits != 0 {
                return Some(w * 32 + bits.trailing_zeros());
            }
            w += 1;
            if w == col_words {
                return None;
            }
            bits = word(w);
        }
    }

    /// The highest tile `≤ n` (of `block_n` keys) in a visible block of rows from `row0`.
    #[inline(always)]
    fn visible_tile_at_or_below(&self, row0: u32, n: u32, block_n: u32) -> Option<u32> {
        let per = SPARSE_BLOCK / block_n;
        let kb = n / per;
        let found = self.visible_block_at_or_below(row0 / SPARSE_BLOCK, kb)?;
        Some(if found == kb {
            n
        } else {
            found * per + per - 1
        })
    }
}

impl AttnMask for SparseMask {
    const WALK_READS_MEMORY: bool = true;

    #[inline(always)]
    fn seqlen_q(&self) -> u32 {
        self.base.seqlen_q
    }

    #[inline(always)]
    unsafe fn new(args: &MaskArgs, block: &BlockInfo) -> Self {
        let first = block.batch as u64 * args.bits_batch_stride as u64
            + block.head as u64 * args.bits_head_stride as u64;
        let first_col = block.batch as u64 * args.cols_batch_stride as u64
            + block.head as u64 * args.cols_head_stride as u64;
        Self {
            base: CausalMask::new(args, block),
            bits: args.mask_bits + 4 * first,
            cols: args.mask_cols + 4 * first_col,
        }
    }

    #[inline(always)]
    fn later_rows_see_more(args: &MaskArgs) -> bool {
        CausalMask::later_rows_see_more(args)
    }

    #[inline(always)]
    fn query_tile_at_or_after<const LEAN: bool>(
        &self,
        i: u32,
        block_m: u32,
        n: u32,
        block_n: u32,
    ) -> Option<u32> {
        // Query tiles lie in one block row each (block_m divides SPARSE_BLOCK): jump to the
        // next visible block of the key tile's column, then let the base mask (causal, tails)
        // pick the first tile it visits from there.
        let (per, kb) = (SPARSE_BLOCK / block_m, n * block_n / SPARSE_BLOCK);
        let mut i = i;
        loop {
            let qb = self.visible_block_at_or_after(i / per, kb)?;
            i = i.max(qb * per);
            let t = self.base.first_query_tile_from(i, block_m, n, block_n)?;
            if t / per == qb {
                return Some(t);
            }
            i = t; // in a later block row: look for the next visible block from there
        }
    }

    #[inline(always)]
    fn first_key_tile(&self, row0: u32, block_m: u32, block_n: u32) -> Option<u32> {
        let last = self.base.first_key_tile(row0, block_m, block_n)?;
        self.visible_tile_at_or_below(row0, last, block_n)
    }

    #[inline(always)]
    fn next_key_tile(&self, row0: u32, block_m: u32, block_n: u32, n: u32) -> Option<u32> {
        let below = self.base.next_key_tile(row0, block_m, block_n, n)?;
        self.visible_tile_at_or_below(row0, below, block_n)
    }

    #[inline(always)]
    fn visits_key_tile(&self, row0: u32, block_m: u32, n: u32, block_n: u32) -> bool {
        self.base.visits_key_tile(row0, block_m, n, block_n)
            && self.block_visible(row0 / SPARSE_BLOCK, n * block_n / SPARSE_BLOCK)
    }

    #[inline(always)]
    fn tile_needs_mask(&self, row0: u32, block_m: u32, n_block: u32, block_n: u32) -> bool {
        // A visited tile lies in one visible block: only the tails and the diagonal cut it.
        self.base.tile_needs_mask(row0, block_m, n_block, block_n)
    }

    #[inline(always)]
    fn visible(&self, row: u32, key: u32) -> bool {
        self.base.visible(row, key) && self.block_visible(row / SPARSE_BLOCK, key / SPARSE_BLOCK)
    }

    #[inline(always)]
    fn row_sees_keys(&self, row: u32) -> bool {
        // The lowest visible block must start before the row's last visible key.
        let end = self.base.key_end(row);
        end > 0
            && self
                .visible_block_at_or_below(row / SPARSE_BLOCK, (end - 1) / SPARSE_BLOCK)
                .is_some()
    }
}

/// A tree mask (speculative decoding): the queries are `seqlen_q` draft tokens, the last
/// `seqlen_q` keys are the same drafts, and the keys before them (the cached prefix,
/// `seqlen_k − seqlen_q` of them) stay fully visible. Query `i` sees draft key `t` when bit
/// `t` of its row is set (row `i`: [`tree_row_words`] u32 words, bit `t % 32` of word
/// `t / 32`); with causal masking also `t ≤ i`. Only key tiles that reach the drafts run the
/// element test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeMask {
    /// Tails and causal masking (bottom-right aligned: draft `i` is key `prefix + i`).
    pub base: CausalMask,
    /// Address of the batch entry's first u32 word.
    pub bits: u64,
}

/// Words per row of a tree mask over `drafts` draft tokens.
#[inline(always)]
pub const fn tree_row_words(drafts: u32) -> u32 {
    drafts.div_ceil(32)
}

impl TreeMask {
    /// Keys before the drafts (the cached prefix; the host checks `seqlen_k ≥ seqlen_q`).
    #[inline(always)]
    fn prefix(&self) -> u32 {
        self.base.seqlen_k.saturating_sub(self.base.seqlen_q)
    }

    /// Whether draft `row` sees draft `t`.
    #[inline(always)]
    fn sees_draft(&self, row: u32, t: u32) -> bool {
        let words = tree_row_words(self.base.seqlen_q);
        let at = row as usize * words as usize + (t / 32) as usize;
        // SAFETY: `new`'s caller vouches for `seqlen_q` rows of words; `row < seqlen_q`.
        unsafe { *(self.bits as *const u32).add(at) >> (t % 32) & 1 != 0 }
    }
}

impl AttnMask for TreeMask {
    #[inline(always)]
    fn seqlen_q(&self) -> u32 {
        self.base.seqlen_q
    }

    #[inline(always)]
    unsafe fn new(args: &MaskArgs, block: &BlockInfo) -> Self {
        let first = block.batch as u64 * args.bits_batch_stride as u64;
        Self {
            base: CausalMask::new(args, block),
            bits: args.mask_bits + 4 * first,
        }
    }

    #[inline(always)]
    fn later_rows_see_more(args: &MaskArgs) -> bool {
        CausalMask::later_rows_see_more(args)
    }

    #[inline(always)]
    fn first_key_tile(&self, row0: u32, block_m: u32, block_n: u32) -> Option<u32> {
        self.base.first_key_tile(row0, block_m, block_n)
    }

    #[inline(always)]
    fn next_key_tile(&self, row0: u32, block_m: u32, block_n: u32, n: u32) -> Option<u32> {
        self.base.next_key_tile(row0, block_m, block_n, n)
    }

    #[inline(always)]
    fn visits_key_tile(&self, row0: u32, block_m: u32, n: u32, block_n: u32) -> bool {
        self.base.visits_key_tile(row0, block_m, n, block_n)
    }

    #[inline(always)]
    fn tile_needs_mask(&self, row0: u32, block_m: u32, n_block: u32, block_n: u32) -> bool {
        let reaches_drafts = (n_block as u64 + 1) * block_n as u64 > self.prefix() as u64;
        reaches_drafts || self.base.tile_needs_mask(row0, block_m, n_block, block_n)
    }

    #[inline(always)]
    fn visible(&self, row: u32, key: u32) -> bool {
        let prefix = self.prefix();
        self.base.visible(row, key)
            && (key < prefix || (row < self.base.seqlen_q && self.sees_draft(row, key - prefix)))
    }

    #[inline(always)]
    fn row_sees_keys(&self, row: u32) -> bool {
        if !self.base.row_sees_keys(row) {
            return false;
        }
        let end = self.base.key_end(row);
        let prefix = self.prefix();
        // Rows past the drafts (the rest of a query tile) have no bits to read.
        prefix > 0
            || (row < self.base.seqlen_q
                && (0..end.saturating_sub(prefix)).any(|t| self.sees_draft(row, t)))
    }
}

/// The mask types by [`crate::registry::MaskKind`] name (the registry's entry points name them
/// this way).
pub mod kind {
    pub use super::CausalMask as Causal;
    pub use super::ScoredMask as Masked;
    pub use super::SparseMask as Sparse;
    pub use super::TreeMask as Tree;
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    /// Uncapped blocks: the one derivative [`AttnMask::uncapped_grad`] is every score's
    /// (what the `wgmma` backward multiplies dS by, keeping no derivative per score).
    #[test]
    fn uncapped_grad_is_every_scores_derivative() {
        for (scale, slope) in [(0.125f32, 0.0f32), (-0.7, 0.25), (0.0, 1.5), (3.0, -0.5)] {
            let mask = ScoredMask {
                window: WindowMask {
                    seqlen_q: 37,
                    seqlen_k: 90,
                    left: 20,
                    right: 3,
                },
                slope,
                modifies: true,
                ..ScoredMask::of(
                    &MaskArgs {
                        scale,
                        ..Default::default()
                    },
                    37,
                    90,
                )
            };
            assert!(!mask.capped());
            for (row, key, s) in [(0u32, 0u32, 1.5f32), (5, 60, -3.0), (36, 89, 40.0)] {
                let (logit, grad) = mask.score_and_grad(row, key, s, slope);
                assert_eq!(grad, mask.uncapped_grad());
                assert_eq!(logit, mask.score(row, key, s, slope));
            }
        }
        let causal = CausalMask {
            seqlen_q: 4,
            seqlen_k: 4,
            causal: true,
        };
        assert_eq!(
            causal.score_and_grad(1, 1, 2.0, 0.0).1,
            causal.uncapped_grad()
        );
    }

    /// [`AttnMask::row_keys`] is [`AttnMask::visible`] as an interval for every row (past the
    /// sequence too: kernels compute those rows) and key (past the keys too), starting at 0
    /// where the mask says it has no lower bound.
    fn row_keys_match_predicate<M: AttnMask>(m: &M, nq: u32, nk: u32) {
        assert!(M::ROW_INTERVAL);
        for row in 0..nq + 70 {
            let (lo, hi) = m.row_keys(row);
            assert!(M::ROW_LOWER_BOUND || lo == 0);
            for key in 0..nk + 70 {
                assert_eq!(
                    m.visible(row, key),
                    lo <= key && key < hi,
                    "row {row} key {key}"
                );
            }
        }
    }

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
            let windows = [
                (UNBOUNDED, UNBOUNDED),
                (UNBOUNDED, 0),
                (0, 0),
                (5, 0),
                (17, 3),
                (0, 40),
                (70, UNBOUNDED),
                (3, 2),
            ];
            for (left, right) in windows {
                let m = WindowMask {
                    seqlen_q: nq,
                    seqlen_k: nk,
                    left,
                    right,
                };
                row_keys_match_predicate(&m, nq, nk);
                let causal = CausalMask {
                    seqlen_q: nq,
                    seqlen_k: nk,
                    causal: right == 0,
                };
                row_keys_match_predicate(&causal, nq, nk);
                for (bm, bn) in [(16u32, 16u32), (64, 32), (128, 64)] {
                    for row0 in (0..nq).step_by(bm as usize) {
                        let mut visited = [false; 256];
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
                                "nq={nq} nk={nk} window=({left}, {right}) row0={row0} n={n}"
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
                    query_walk_matches_scan(&m, nk, bm, bn);
                    let causal = CausalMask {
                        seqlen_q: nq,
                        seqlen_k: nk,
                        causal: right == 0,
                    };
                    query_walk_matches_scan(&causal, nk, bm, bn);
                    walk_is_one_run(&m, bm, bn);
                    walk_is_one_run(&causal, bm, bn);
                    for n in 0..nk.div_ceil(bn) {
                        for i in 0..=nq.div_ceil(bm) {
                            assert_eq!(
                                causal.first_query_tile_from(i, bm, n, bn),
                                causal.query_tile_at_or_after::<false>(i, bm, n, bn)
                            );
                        }
                    }
                }
            }
        }
    }

    /// For masks with [`AttnMask::CONTIGUOUS_WALK`] the key walk is exactly the run from
    /// [`AttnMask::lowest_key_tile`] up to [`AttnMask::first_key_tile`] (the `wgmma` forward
    /// walks it upwards).
    fn walk_is_one_run<M: AttnMask>(m: &M, bm: u32, bn: u32) {
        assert!(M::CONTIGUOUS_WALK);
        for row0 in (0..m.seqlen_q()).step_by(bm as usize) {
            let walk: std::vec::Vec<u32> = m.key_tiles(row0, bm, bn).collect();
            let run: std::vec::Vec<u32> = match m.first_key_tile(row0, bm, bn) {
                Some(last) => (m.lowest_key_tile(row0, bn)..=last).rev().collect(),
                None => std::vec::Vec::new(),
            };
            assert_eq!(walk, run, "row0={row0}");
        }
    }

    /// The backward's walk ([`AttnMask::query_tile_at_or_after`]) finds, from every start,
    /// the first query tile that [`AttnMask::visits_key_tile`] says visits each key tile.
    fn query_walk_matches_scan<M: AttnMask>(m: &M, nk: u32, bm: u32, bn: u32) {
        let tiles = m.seqlen_q().div_ceil(bm);
        for n in 0..nk.div_ceil(bn) {
            for i in 0..=tiles {
                let scan = (i..tiles).find(|&t| m.visits_key_tile(t * bm, bm, n, bn));
                assert_eq!(
                    m.query_tile_at_or_after::<false>(i, bm, n, bn),
                    scan,
                    "n={n} i={i}"
                );
                assert_eq!(
                    m.query_tile_at_or_after::<true>(i, bm, n, bn),
                    scan,
                    "n={n} i={i}"
                );
            }
        }
        // The deterministic backward passes dQ's turn along `key_tiles`: it must hold exactly
        // the key tiles whose walk visits the query tile.
        for i in 0..tiles {
            let chain: std::vec::Vec<u32> = m.key_tiles(i * bm, bm, bn).collect();
            for n in 0..nk.div_ceil(bn) {
                let visits = m.query_tile_at_or_after::<false>(i, bm, n, bn) == Some(i);
                assert_eq!(chain.contains(&n), visits, "n={n} i={i}");
            }
        }
    }

    /// Brute force for the tree mask: random ancestor sets, prefixes and causal on or off; the
    /// tiles a query tile visits hold every key it sees, and tiles it sees only partly run
    /// the element test.
    #[test]
    fn tree_tiles_match_predicate() {
        let mut seed = 0x1234_5678_u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for &(drafts, prefix) in &[(1u32, 0u32), (5, 0), (7, 30), (40, 100), (64, 64), (100, 3)] {
            for causal in [false, true] {
                let words = tree_row_words(drafts);
                let bits: std::vec::Vec<u32> =
                    (0..drafts * words).map(|_| next() & next()).collect();
                let m = TreeMask {
                    base: CausalMask {
                        seqlen_q: drafts,
                        seqlen_k: prefix + drafts,
                        causal,
                    },
                    bits: bits.as_ptr() as u64,
                };
                let nk = prefix + drafts;
                for (bm, bn) in [(16u32, 16u32), (64, 32), (128, 64)] {
                    query_walk_matches_scan(&m, nk, bm, bn);
                    for row0 in (0..drafts).step_by(bm as usize) {
                        let visited: std::vec::Vec<u32> = m.key_tiles(row0, bm, bn).collect();
                        let rows = row0..(row0 + bm).min(drafts);
                        for n in 0..nk.div_ceil(bn) {
                            let keys = n * bn..((n + 1) * bn).min(nk);
                            let any = rows.clone().any(|r| keys.clone().any(|k| m.visible(r, k)));
                            let all = rows
                                .clone()
                                .all(|r| (n * bn..(n + 1) * bn).all(|k| m.visible(r, k)));
                            if any {
                                assert!(visited.contains(&n), "{drafts} {prefix} {causal} {n}");
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

    /// Brute force for the block-sparse mask: random bit patterns (empty rows included), the
    /// tile iterator visits exactly the tiles holding a visible key, in decreasing order, and
    /// a visited tile needs the element test only where the tails or the diagonal cut it.
    #[test]
    fn sparse_tiles_match_predicate() {
        let mut seed = 0x9e37_79b9_u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for &(nq, nk) in &[
            (1u32, 1u32),
            (100, 300),
            (300, 100),
            (256, 4200),
            (129, 129),
        ] {
            for causal in [false, true] {
                for density in [0u32, 3, 8, 16] {
                    let (qb, kb) = (nq.div_ceil(SPARSE_BLOCK), nk.div_ceil(SPARSE_BLOCK));
                    let row_words = sparse_row_words(nk);
                    assert_eq!(row_words, kb.div_ceil(32));
                    let words: std::vec::Vec<u32> = (0..qb * row_words)
                        .map(|_| {
                            (0..32).fold(0, |w, b| w | (((next() % 16) < density) as u32) << b)
                        })
                        .collect();
                    // The same bits by key block, as the host lays them out.
                    let col_words = sparse_row_words(nq);
                    let mut cols = std::vec![0u32; (kb * col_words) as usize];
                    for (i, j) in (0..qb).flat_map(|i| (0..kb).map(move |j| (i, j))) {
                        if words[(i * row_words + j / 32) as usize] >> (j % 32) & 1 != 0 {
                            cols[(j * col_words + i / 32) as usize] |= 1 << (i % 32);
                        }
                    }
                    let m = SparseMask {
                        base: CausalMask {
                            seqlen_q: nq,
                            seqlen_k: nk,
                            causal,
                        },
                        bits: words.as_ptr() as u64,
                        cols: cols.as_ptr() as u64,
                    };
                    for (bm, bn) in [(64u32, 64u32), (128, 32), (32, 128), (128, 16)] {
                        query_walk_matches_scan(&m, nk, bm, bn);
                        for row0 in (0..nq).step_by(bm as usize) {
                            let mut last = u32::MAX;
                            let mut visited = std::vec![false; nk.div_ceil(bn) as usize];
                            for n in m.key_tiles(row0, bm, bn) {
                                assert!(n < last);
                                last = n;
                                visited[n as usize] = true;
                            }
                            let rows = row0..(row0 + bm).min(nq);
                            for n in 0..nk.div_ceil(bn) {
                                let keys = n * bn..((n + 1) * bn).min(nk);
                                let any =
                                    rows.clone().any(|r| keys.clone().any(|k| m.visible(r, k)));
                                let all = rows
                                    .clone()
                                    .all(|r| (n * bn..(n + 1) * bn).all(|k| m.visible(r, k)));
                                let what = (nq, nk, causal, density, bm, bn, row0, n);
                                assert_eq!(visited[n as usize], any, "{what:?}");
                                assert_eq!(m.visits_key_tile(row0, bm, n, bn), any, "{what:?}");
                                if any {
                                    assert!(all || m.tile_needs_mask(row0, bm, n, bn), "{what:?}");
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
}
