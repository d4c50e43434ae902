//! Parameters of the decode family: the split-KV attention kernel over a KV cache, the
//! combine kernel that merges its splits, the merge of two attention states, and the copy of
//! new keys and values into the cache.

use super::{MaskArgs, RowStatsRef, SeqDims, TensorRef};

/// Where a sequence's keys live: a contiguous cache `[batch, capacity, heads_kv, d]`, or pages
/// `[num_pages, page_size, heads_kv, d]` listed per sequence by a block table.
///
/// With `block_table == 0` the cache is contiguous: key `j` of batch entry `b` is row `j` of
/// entry `b` (the [`TensorRef`]'s batch stride). Otherwise key `j` is row `j % page_size` of
/// page `block_table[b · table_stride + j / page_size]` (the batch stride is then the page
/// stride).
///
/// The host validates the lengths and pages, from the device tensors or from a host copy the
/// caller vouches for. So that a copy that differs from the device never makes a kernel read
/// or write outside the cache, the kernels also clamp: a sequence's keys to `capacity`, and
/// page indices into `0 .. entries`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvLayout {
    /// Device address of the i32 block table `[batch, max_pages]`, or 0 (contiguous cache).
    pub block_table: u64,
    /// Elements between two batch rows of the block table.
    pub table_stride: u32,
    /// Keys per page (a multiple of 16); unused for a contiguous cache.
    pub page_size: u32,
    /// Device address of the i32 per-sequence cache lengths `[batch]`, or 0 (every sequence
    /// has [`SeqDims::seqlen_k`] keys).
    pub seqlens: u64,
    /// Keys appended by this call after each sequence's cached ones: sequence `b` attends to
    /// `seqlens[b] + appended` keys.
    pub appended: u32,
    /// Keys the cache holds per sequence (`max_pages · page_size` when paged).
    pub capacity: u32,
    /// Pages in the pool (paged) or batch entries of the cache (contiguous).
    pub entries: u32,
    /// Keeps the size a multiple of 8 bytes.
    pub reserved: u32,
}

impl KvLayout {
    /// Keys that batch entry `batch` attends to (at most `capacity`).
    ///
    /// # Safety
    /// `seqlens`, when set, points to at least `batch + 1` readable i32.
    #[inline(always)]
    pub unsafe fn seqlen_k(&self, dims: &SeqDims, batch: u32) -> u32 {
        if self.seqlens == 0 {
            dims.seqlen_k
        } else {
            self.cached(batch)
                .saturating_add(self.appended)
                .min(self.capacity)
        }
    }

    /// Keys cached for batch entry `batch` before this call (a negative length reads as 0).
    ///
    /// # Safety
    /// `seqlens` points to at least `batch + 1` readable i32.
    #[inline(always)]
    pub unsafe fn cached(&self, batch: u32) -> u32 {
        (*(self.seqlens as *const i32).add(batch as usize)).max(0) as u32
    }

    /// Where key `key` of batch entry `batch` lives: `(entry, row)` such that its element
    /// offset in a cache tensor is `strides.offset(entry, row, head)` (the batch entry and
    /// the key for a contiguous cache; the page and the row in it when paged). For a `key`
    /// that is a multiple of 16, the next 15 keys follow at the row stride (pages hold
    /// multiples of 16 keys).
    ///
    /// # Safety
    /// `key < capacity`; the block table, when set, has `capacity / page_size` readable
    /// entries per batch row (page indices outside the pool are clamped into it).
    #[inline(always)]
    pub unsafe fn key_slot(&self, batch: u32, key: u32) -> (u32, u32) {
        if self.block_table == 0 {
            (batch, key)
        } else {
            (
                self.clamp_page(self.table_entry(batch, key)),
                key % self.page_size,
            )
        }
    }

    /// The block-table entry of the page holding key `key` of batch entry `batch`, as stored
    /// (unchecked: pass it through [`KvLayout::clamp_page`] before use). Kept apart from the
    /// clamp so that a kernel can load entries early and wait for them only where used.
    ///
    /// # Safety
    /// The block table is set; `key < capacity`, and it has `capacity / page_size` readable
    /// entries per batch row.
    #[inline(always)]
    pub unsafe fn table_entry(&self, batch: u32, key: u32) -> i32 {
        let slot = batch as usize * self.table_stride as usize + (key / self.page_size) as usize;
        *(self.block_table as *const i32).add(slot)
    }

    /// A block-table entry clamped into the pool's pages `0 .. entries`.
    #[inline(always)]
    pub fn clamp_page(&self, entry: i32) -> u32 {
        entry.max(0).min(self.entries as i32 - 1) as u32
    }
}

/// Parameters of the split-KV decode kernels (`flash_decode_*`).
///
/// Q and O are `[batch, seqlen_q, heads_q, head_dim]`, LSE `[batch, heads_q, seqlen_q]` f32;
/// K and V are described by [`KvLayout`]. With one split the kernel writes O and LSE; with
/// more, split `s` writes its normalised partial O to `o_part` (f32 `[splits, batch, heads_q,
/// seqlen_q, head_dim]`, contiguous) and its LSE to `lse_part` (f32 `[splits, batch, heads_q,
/// seqlen_q]`), and the combine kernel merges them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeParams {
    /// New queries.
    pub q: TensorRef,
    /// Key cache.
    pub k: TensorRef,
    /// Value cache.
    pub v: TensorRef,
    /// Output (one split).
    pub o: TensorRef,
    /// Log-sum-exp per query row (one split).
    pub lse: RowStatsRef,
    /// Sizes (`seqlen_k`: keys of every sequence when [`KvLayout::seqlens`] is 0).
    pub dims: SeqDims,
    /// Mask arguments (windows bottom-right aligned at each sequence's own length).
    pub mask: MaskArgs,
    /// The cache's layout and lengths.
    pub kv: KvLayout,
    /// f32 partial outputs (more than one split).
    pub o_part: u64,
    /// f32 partial LSE (more than one split).
    pub lse_part: u64,
    /// `softmax_scale · log2(e)` (`log2 e` for masks that apply the scale themselves).
    pub scale_log2: f32,
    /// Number of key splits.
    pub num_splits: u32,
    /// Keys per split (a multiple of 16).
    pub split_keys: u32,
    /// Query-row tiles per (batch, KV head): grid x is `num_splits · row_tiles`.
    pub row_tiles: u32,
}

impl DecodeParams {
    /// Element offset of row `(split, batch, head, token)` in the partial outputs (multiply by
    /// the head dim for `o_part`).
    #[inline(always)]
    pub fn part_row(&self, split: u32, batch: u32, head: u32, token: u32) -> u64 {
        let d = &self.dims;
        ((split as u64 * d.batch as u64 + batch as u64) * d.heads_q as u64 + head as u64)
            * d.seqlen_q as u64
            + token as u64
    }
}

/// Parameters of the combine kernel (`flash_decode_combine_*`: the decode kernel's splits,
/// read from [`DecodeParams::o_part`]) and of the merge kernel (`merge_states_*`: two
/// attention states given as tensors). One warp per output row.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CombineParams {
    /// Output O `[batch, seqlen_q, heads_q, head_dim]`.
    pub o: TensorRef,
    /// Output LSE `[batch, heads_q, seqlen_q]`.
    pub lse: RowStatsRef,
    /// The two states' O (merge only), O's shape.
    pub state_o: [TensorRef; 2],
    /// The two states' LSE (merge only).
    pub state_lse: [RowStatsRef; 2],
    /// Sizes (`seqlen_k` unused).
    pub dims: SeqDims,
    /// Number of splits (combine only).
    pub num_splits: u32,
    /// Keeps the next field 8-byte aligned without implicit padding.
    pub reserved: u32,
    /// f32 partial outputs, laid out as [`DecodeParams::o_part`] (combine only).
    pub o_part: u64,
    /// f32 partial LSE, laid out as [`DecodeParams::lse_part`] (combine only).
    pub lse_part: u64,
}

/// Parameters of the cache append kernel (`kv_append_b16`): writes `k_new[b, i]`, `v_new[b, i]`
/// to key `seqlens[b] + i` of sequence `b` in the caches (through the block table when paged).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AppendParams {
    /// New keys `[batch, appended, heads_kv, head_dim]`.
    pub k_new: TensorRef,
    /// New values, as `k_new`.
    pub v_new: TensorRef,
    /// Key cache (written).
    pub k: TensorRef,
    /// Value cache (written).
    pub v: TensorRef,
    /// The caches' layout; `seqlens` holds the lengths before this call, `appended` the new
    /// keys per sequence.
    pub kv: KvLayout,
    /// Batch entries.
    pub batch: u32,
    /// KV heads.
    pub heads_kv: u32,
    /// Elements per row to copy (the caller's head dim, any value).
    pub head_dim: u32,
    /// Keeps the size a multiple of 8 bytes.
    pub reserved: u32,
}

const _: () = assert!(core::mem::size_of::<KvLayout>() == 40);
const _: () = assert!(core::mem::size_of::<DecodeParams>() == 4 * 32 + 24 + 24 + 64 + 40 + 16 + 16);
const _: () = assert!(core::mem::size_of::<CombineParams>() == 32 + 24 + 64 + 48 + 24 + 8 + 16);
const _: () = assert!(core::mem::size_of::<AppendParams>() == 4 * 32 + 40 + 16);
