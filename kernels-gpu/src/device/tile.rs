//! Shared-memory tiles and the register fragments loaded from them. Kernels never do lane
//! arithmetic themselves: this module knows which rows and chunks each lane addresses.

use super::ptx;
use crate::config::MMA_M;
use crate::swizzle::{chunk_offset, split_offset};

/// Rows (and 16-bit columns) of one `ldmatrix.x4` / `mma` A fragment.
const FRAG: usize = MMA_M;

/// `ROWS × PITCH` 16-bit elements in shared memory, row-major, swizzled by
/// [`crate::swizzle::chunk_offset`].
#[derive(Clone, Copy)]
pub struct SmemTile<const ROWS: usize, const PITCH: usize> {
    base: u32,
}

impl<const ROWS: usize, const PITCH: usize> SmemTile<ROWS, PITCH> {
    /// Bytes the tile occupies.
    pub const BYTES: u32 = (ROWS * PITCH * 2) as u32;

    /// The tile starting at shared address `base` (128-byte aligned).
    #[inline(always)]
    pub fn at(base: u32) -> Self {
        Self { base }
    }

    /// Shared address of logical 16-byte chunk `chunk` of row `row`.
    #[inline(always)]
    fn chunk_addr(self, row: usize, chunk: usize) -> u32 {
        self.base + chunk_offset(PITCH, row, chunk) as u32
    }

    /// Issues `cp.async` copies of rows `[0, ROWS)` × columns `[0, COLS)` of a global tile whose
    /// row `r` starts at `src + r · row_stride` (elements). Rows `≥ rows_valid` and columns
    /// `≥ cols_valid` are zero-filled without being read. All `32·WARPS` threads of the block call
    /// it; thread `tid` copies chunks `tid`, `tid + 32·WARPS`, ...
    ///
    /// # Safety
    /// Every row start `src + r · row_stride` for `r < rows_valid` is 16-byte aligned and its
    /// first `cols_valid` elements (a multiple of 8) are readable.
    #[inline(always)]
    pub unsafe fn load_async<const COLS: usize, const WARPS: usize>(
        self,
        src: *const u16,
        row_stride: u64,
        rows_valid: u32,
        cols_valid: u32,
        tid: u32,
    ) {
        // Recomputed per call, not hoisted out of the key loop (see `ptx::opaque_u32`).
        let tid = ptx::opaque_u32(tid) as usize;
        let (threads, chunks_per_row) = (WARPS * 32, COLS / 8);
        let rows_per_pass = threads / chunks_per_row;
        let regular = threads % chunks_per_row == 0 && ROWS % rows_per_pass == 0;
        if regular
            && rows_valid as usize >= ROWS
            && ((tid % chunks_per_row) * 8) < cols_valid as usize
        {
            // Whole tile, and this thread's column is inside the head dim: each thread copies
            // one column chunk of every `rows_per_pass`-th row. Consecutive copies differ by a
            // constant in both addresses (the swizzle repeats every 8 rows), so each costs
            // one 64-bit add.
            let (row, chunk) = (tid / chunks_per_row, tid % chunks_per_row);
            let mut from = src.add(row * row_stride as usize + chunk * 8);
            let pass = rows_per_pass * row_stride as usize;
            for i in 0..ROWS / rows_per_pass {
                let r = row + i * rows_per_pass;
                let dst = if rows_per_pass % 8 == 0 {
                    self.chunk_addr(row, chunk) + (i * rows_per_pass * PITCH * 2) as u32
                } else {
                    self.chunk_addr(r, chunk)
                };
                ptx::cp_async_cg_16(dst, from as *const u8, 16);
                from = from.add(pass);
            }
            return;
        }
        self.for_own_chunks::<COLS, WARPS>(tid as u32, |row, chunk| {
            let col = (chunk * 8) as u32;
            let valid = (row as u32) < rows_valid && col < cols_valid;
            let from = if valid {
                src.add(row * row_stride as usize + col as usize)
            } else {
                src
            };
            let bytes = if valid { 16 } else { 0 };
            ptx::cp_async_cg_16(self.chunk_addr(row, chunk), from as *const u8, bytes);
        });
    }

    /// Issues `cp.async` copies of rows `[0, ROWS)` × columns `[0, COLS)` where row `r`
    /// starts at `row_src(r)`; rows for which it gives `None` and columns `≥ cols_valid` are
    /// zero-filled without being read (for tiles whose rows are not evenly strided, as the
    /// decode kernel's packed query rows). Chunks are assigned to threads as
    /// [`SmemTile::negate_own`] expects.
    ///
    /// # Safety
    /// Every row start given is 16-byte aligned with its first `cols_valid` elements (a
    /// multiple of 8) readable; all `32·WARPS` threads of the block call it.
    #[inline(always)]
    pub unsafe fn load_rows_async<const COLS: usize, const WARPS: usize>(
        self,
        row_src: impl Fn(usize) -> Option<*const u16>,
        cols_valid: u32,
        tid: u32,
    ) {
        self.for_own_chunks::<COLS, WARPS>(tid, |row, chunk| {
            let col = (chunk * 8) as u32;
            let (from, bytes) = match row_src(row) {
                Some(src) if col < cols_valid => (src.add(col as usize), 16),
                _ => (core::ptr::null(), 0),
            };
            ptx::cp_async_cg_16(self.chunk_addr(row, chunk), from as *const u8, bytes);
        });
    }

    /// Flips the sign of every element of the chunks this thread copied with
    /// [`SmemTile::load_async`] (exact for f16 and bf16). Call after the copies completed
    /// (`cp_async_wait_group`) and before the barrier that publishes the tile.
    ///
    /// # Safety
    /// As [`SmemTile::load_async`], with the same `COLS`, `WARPS` and `tid`.
    #[inline(always)]
    pub unsafe fn negate_own<const COLS: usize, const WARPS: usize>(self, tid: u32) {
        self.for_own_chunks::<COLS, WARPS>(tid, |row, chunk| {
            let a = self.chunk_addr(row, chunk);
            ptx::st_shared_v4(a, ptx::ld_shared_v4(a).map(|x| x ^ 0x8000_8000));
        });
    }

    /// Calls `f(row, chunk)` for the 16-byte chunks of `ROWS × COLS` that thread `tid` of
    /// `32·WARPS` owns: chunks `tid`, `tid + 32·WARPS`, ... in row-major order.
    #[inline(always)]
    fn for_own_chunks<const COLS: usize, const WARPS: usize>(
        self,
        tid: u32,
        mut f: impl FnMut(usize, usize),
    ) {
        let threads = WARPS * 32;
        let chunks_per_row = COLS / 8;
        let total = ROWS * chunks_per_row;
        for i in 0..total.div_ceil(threads) {
            let idx = tid as usize + i * threads;
            if total % threads == 0 || idx < total {
                f(idx / chunks_per_row, idx % chunks_per_row);
            }
        }
    }

    /// The `mma` A fragment of m-tile `mt` of the rows starting at `m0` (a multiple of 16):
    /// rows `[m0 + 16·mt, +16)`, columns `[16·ks, +16)`.
    ///
    /// # Safety
    /// The whole warp calls it; the tile is written and synchronised.
    #[inline(always)]
    pub unsafe fn load_a(self, lanes: &LaneOffsets, m0: usize, mt: usize, ks: usize) -> [u32; 4] {
        let row0 = m0 + FRAG * mt;
        ptx::ldmatrix_x4(self.base + lanes.a[ks % 4] + lanes.const_part::<PITCH>(row0, ks))
    }

    /// The `mma` A fragment of m-tile `mt` (16 rows of A from `m0 + 16·mt`) and reduction step
    /// `ks` for a tile stored transposed, as `[k][m]` (rows are A's columns, as dSᵀ is for
    /// `dQ = dS·K`): the transposing `ldmatrix` of rows `[16·ks, +16)`, columns
    /// `[m0 + 16·mt, +16)`.
    ///
    /// # Safety
    /// As [`SmemTile::load_a`].
    #[inline(always)]
    pub unsafe fn load_a_trans(
        self,
        lanes: &LaneOffsets,
        m0: usize,
        mt: usize,
        ks: usize,
    ) -> [u32; 4] {
        let (k0, mp) = (FRAG * ks, m0 / FRAG + mt);
        ptx::ldmatrix_x4_trans(
            self.base + lanes.b_at::<PITCH>(mp) + lanes.const_part::<PITCH>(k0, mp),
        )
    }

    /// The same tile from row `row0` on (a multiple of 8, so the swizzle pattern is
    /// unchanged): a view for products over a slice of the rows.
    #[inline(always)]
    pub fn rows_from(self, row0: usize) -> Self {
        Self {
            base: self.base + (row0 * PITCH * 2) as u32,
        }
    }

    /// The tile and lane offsets with which [`SmemTile::load_b_pair_kn`] reads column pair
    /// `pair0 + np` at `np`, for a warp's column slice of `slice_pairs` pairs starting at the
    /// run-time `pair0` (a multiple of `slice_pairs`). Slices of whole swizzle groups (4
    /// pairs) only move the tile's base; narrower ones rotate the lane offsets
    /// ([`LaneOffsets::shifted_cols`], four more registers).
    #[inline(always)]
    pub fn kn_slice(
        self,
        lanes: &LaneOffsets,
        pair0: usize,
        slice_pairs: usize,
    ) -> (Self, LaneOffsets) {
        if slice_pairs % 4 == 0 || pair0 == 0 {
            let base = self.base + chunk_offset(PITCH, 0, 2 * pair0) as u32;
            (Self { base }, *lanes)
        } else {
            (self, lanes.shifted_cols::<PITCH>(pair0))
        }
    }

    /// Stores two adjacent 16-bit elements (`bits`, low half first) at row `row`, columns
    /// `col` and `col + 1` (`col` even).
    ///
    /// # Safety
    /// Inside the tile; the caller orders it against readers with a barrier.
    #[inline(always)]
    pub unsafe fn store_pair(self, row: u32, col: u32, bits: u32) {
        let (row, col) = (row as usize, col as usize);
        ptx::st_shared_u32(self.chunk_addr(row, col / 8) + (2 * (col % 8)) as u32, bits);
    }

    /// `mma` B fragments of two adjacent 8-column tiles for a tile stored as `[n][k]` (rows are
    /// the B columns, as K is for `S = Q·Kᵀ`): B columns `[16·np, +16)`, k `[16·ks, +16)`.
    ///
    /// # Safety
    /// As [`SmemTile::load_a`].
    #[inline(always)]
    pub unsafe fn load_b_pair_nk(self, lanes: &LaneOffsets, np: usize, ks: usize) -> [[u32; 2]; 2] {
        let n0 = FRAG * np;
        let r = ptx::ldmatrix_x4(self.base + lanes.b[ks % 4] + lanes.const_part::<PITCH>(n0, ks));
        [[r[0], r[1]], [r[2], r[3]]]
    }

    /// `mma` B fragments of two adjacent 8-column tiles for a tile stored as `[k][n]` (rows are
    /// the reduction dim, as V is for `O = P·V`): k rows `[16·ks, +16)`, B columns
    /// `[16·np, +16)`. Uses the transposing `ldmatrix`.
    ///
    /// # Safety
    /// As [`SmemTile::load_a`].
    #[inline(always)]
    pub unsafe fn load_b_pair_kn(self, lanes: &LaneOffsets, ks: usize, np: usize) -> [[u32; 2]; 2] {
        let k0 = FRAG * ks;
        let r =
            ptx::ldmatrix_x4_trans(self.base + lanes.a[np % 4] + lanes.const_part::<PITCH>(k0, np));
        [[r[0], r[1]], [r[2], r[3]]]
    }
}

/// The per-lane, swizzled part of every `ldmatrix` row address (see
/// [`crate::swizzle::split_offset`]): four offsets for each of the two lane patterns. Pattern
/// `a` (lane `l` reads row `8·(l/8 % 2) + l % 8`, chunk parity `l/16`) serves the A operand and
/// the transposed B operand; pattern `b` (row `8·(l/16) + l % 8`, parity `l/8 % 2`) the B
/// operand stored `[n][k]`. Computed once per kernel; [`LaneOffsets::step_local`] at the top of
/// each step keeps the compiler from hoisting one register per address out of the key loop.
#[derive(Clone, Copy)]
pub struct LaneOffsets {
    a: [u32; 4],
    b: [u32; 4],
    /// Pattern `b`'s row and chunk parity (for [`LaneOffsets::b_at`]).
    b_row: u32,
    b_parity: u32,
    /// Pattern `a`'s row and chunk parity (for [`LaneOffsets::shifted_cols`]).
    a_row: u32,
    a_parity: u32,
}

impl LaneOffsets {
    /// The offsets of `lane` for tiles with `PITCH` elements per row.
    #[inline(always)]
    pub fn new<const PITCH: usize>(lane: u32) -> Self {
        let lane = lane as usize;
        let mat = lane / 8;
        let part = |row: usize, parity: usize| -> [u32; 4] {
            core::array::from_fn(|j| split_offset(PITCH, row, parity, 0, j).0 as u32)
        };
        Self {
            a: part((mat & 1) * 8 + lane % 8, mat >> 1),
            b: part((mat >> 1) * 8 + lane % 8, mat & 1),
            b_row: ((mat >> 1) * 8 + lane % 8) as u32,
            b_parity: (mat & 1) as u32,
            a_row: ((mat & 1) * 8 + lane % 8) as u32,
            a_parity: (mat >> 1) as u32,
        }
    }

    /// The same offsets, opaque to the optimiser (see [`ptx::opaque_u32`]), the row and
    /// parity too: offsets derived from them are recomputed per step, not kept in registers.
    #[inline(always)]
    pub unsafe fn step_local(self) -> Self {
        Self {
            a: self.a.map(|x| ptx::opaque_u32(x)),
            b: self.b.map(|x| ptx::opaque_u32(x)),
            b_row: ptx::opaque_u32(self.b_row),
            b_parity: ptx::opaque_u32(self.b_parity),
            a_row: ptx::opaque_u32(self.a_row),
            a_parity: ptx::opaque_u32(self.a_parity),
        }
    }

    /// Offsets for reading B operands stored `[k][n]` ([`SmemTile::load_b_pair_kn`]) from
    /// column pair `c2_0` on, a run-time value (a warp's column slice): pattern `a` for column
    /// pairs `c2_0 .. c2_0 + 4`, each with its whole swizzle rows (`c2 / 4`) folded in, so the
    /// loads of column pair `c2_0 + np` keep `np` a compile-time value. Only for those loads:
    /// A operands ([`SmemTile::load_a`]) need the unshifted offsets.
    #[inline(always)]
    pub fn shifted_cols<const PITCH: usize>(self, c2_0: usize) -> Self {
        let (row, parity) = (self.a_row as usize, self.a_parity as usize);
        Self {
            a: core::array::from_fn(|j| {
                let (lane, whole) = split_offset(PITCH, row, parity, 0, c2_0 + j);
                (lane + whole) as u32
            }),
            ..self
        }
    }

    /// Pattern `b`'s offset for chunk pair `c2` when `c2` is only known at run time: computed
    /// from the lane's row and parity (indexing `b` with a run-time value would put the array
    /// in local memory).
    #[inline(always)]
    fn b_at<const PITCH: usize>(&self, c2: usize) -> u32 {
        let (row, parity) = (self.b_row as usize, self.b_parity as usize);
        split_offset(PITCH, row, parity, 0, c2).0 as u32
    }

    #[inline(always)]
    fn const_part<const PITCH: usize>(&self, row0: usize, c2: usize) -> u32 {
        split_offset(PITCH, 0, 0, row0, c2).1 as u32
    }
}

#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))]
/// A `ROWS × D` tile in the layout of Hopper's warpgroup products (see [`crate::gmma`]):
/// `D / 64` column blocks, each a [`SmemTile`] of `[ROWS][64]` (whose swizzle is the
/// hardware's 128-byte one). The base must be 1024-byte aligned.
#[derive(Clone, Copy)]
pub struct GmmaTile<const ROWS: usize, const D: usize> {
    base: u32,
}

#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))]
impl<const ROWS: usize, const D: usize> GmmaTile<ROWS, D> {
    /// Bytes the tile occupies.
    pub const BYTES: u32 = (ROWS * D * 2) as u32;
    /// Column blocks.
    const BLOCKS: usize = D / crate::gmma::BLOCK_COLS;

    /// The tile starting at shared address `base`.
    #[inline(always)]
    pub fn at(base: u32) -> Self {
        Self { base }
    }

    /// The same tile, its address opaque to the optimiser (see [`ptx::opaque_u32`]): the
    /// descriptors made from it are recomputed where they are used rather than kept in
    /// registers across a loop.
    #[inline(always)]
    pub fn opaque(self) -> Self {
        // SAFETY: an empty asm on a register.
        Self {
            base: unsafe { ptx::opaque_u32(self.base) },
        }
    }

    /// Column block `cb` (columns `64·cb ..`).
    #[inline(always)]
    fn block(self, cb: usize) -> SmemTile<ROWS, { crate::gmma::BLOCK_COLS }> {
        SmemTile::at(self.base + (cb * ROWS * crate::gmma::ROW_BYTES as usize) as u32)
    }

    /// [`SmemTile::load_async`] of the whole tile, block by block.
    ///
    /// # Safety
    /// As [`SmemTile::load_async`].
    #[inline(always)]
    pub unsafe fn load_async<const WARPS: usize>(
        self,
        src: *const u16,
        row_stride: u64,
        rows_valid: u32,
        cols_valid: u32,
        tid: u32,
    ) {
        const { assert!(D % crate::gmma::BLOCK_COLS == 0) };
        for cb in 0..Self::BLOCKS {
            let col0 = cb * crate::gmma::BLOCK_COLS;
            self.block(cb)
                .load_async::<{ crate::gmma::BLOCK_COLS }, WARPS>(
                    src.wrapping_add(col0),
                    row_stride,
                    rows_valid,
                    cols_valid.saturating_sub(col0 as u32),
                    tid,
                );
        }
    }

    /// Starts the TMA copies of rows `row ..` of `(head, batch)` of the tensor `map` describes
    /// (one 64-column box of `ROWS` rows per column block) into this tile, completing on `bar`,
    /// which must expect [`Self::BYTES`]. Rows and columns outside the tensor arrive as zeros.
    ///
    /// # Safety
    /// sm_90 only; `map` describes a 16-bit tensor with `(64, ROWS, 1, 1)` boxes and the
    /// 128-byte swizzle (see [`crate::params::WgmmaFwdParams`]); the tile is 1024-byte
    /// aligned and no one reads it until `bar` completes.
    #[inline(always)]
    pub unsafe fn load_tma(self, map: u64, row: u32, head: u32, batch: u32, bar: u32) {
        self.load_tma_rows::<ROWS>(map, row, head, batch, bar, 0, ROWS);
    }

    /// As [`Self::load_tma`], for the tile's rows `part0 .. part0 + rows` only (rows
    /// `row + part0 ..` of the tensor), in boxes of `BOX` rows: one copy per box and column
    /// block. `bar` must expect `rows·D·2` bytes.
    ///
    /// # Safety
    /// As [`Self::load_tma`], with `(64, BOX, 1, 1)` boxes; `part0` and `rows` are multiples
    /// of `BOX` (and of 8, the swizzle's period, so each box stays 1024-byte aligned) within
    /// the tile.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn load_tma_rows<const BOX: usize>(
        self,
        map: u64,
        row: u32,
        head: u32,
        batch: u32,
        bar: u32,
        part0: usize,
        rows: usize,
    ) {
        const { assert!(BOX % 8 == 0 && ROWS % BOX == 0) };
        for cb in 0..Self::BLOCKS {
            let col = (cb * crate::gmma::BLOCK_COLS) as u32;
            for r in (part0..part0 + rows).step_by(BOX) {
                let dst = self.base + ((cb * ROWS + r) * crate::gmma::ROW_BYTES as usize) as u32;
                ptx::cp_async_bulk_tensor_4d(dst, map, [col, row + r as u32, head, batch], bar);
            }
        }
    }

    /// Flips the sign of rows `row0 .. row0 + ROWS_PART` of every column block (exact for f16
    /// and bf16), shared by `THREADS` threads of which this is `t`. Whole rows keep their
    /// place under the swizzle, so no address is unswizzled.
    ///
    /// # Safety
    /// The rows are in shared memory and no one else touches them meanwhile.
    #[inline(always)]
    pub unsafe fn negate_rows<const ROWS_PART: usize, const THREADS: usize>(
        self,
        row0: usize,
        t: u32,
    ) {
        let row_bytes = crate::gmma::ROW_BYTES as usize;
        const { assert!((ROWS_PART * crate::gmma::ROW_BYTES as usize / 16) % THREADS == 0) };
        for cb in 0..Self::BLOCKS {
            let start = self.base as usize + cb * ROWS * row_bytes + row0 * row_bytes;
            for i in 0..ROWS_PART * row_bytes / 16 / THREADS {
                let a = (start + 16 * (i * THREADS + t as usize)) as u32;
                ptx::st_shared_v4(a, ptx::ld_shared_v4(a).map(|x| x ^ 0x8000_8000));
            }
        }
    }

    /// Stores two adjacent 16-bit elements (`bits`, low half first) at row `row`, columns
    /// `col` and `col + 1` (`col` even), in the block that holds them.
    ///
    /// # Safety
    /// Inside the tile; the caller orders it against readers (for `wgmma`: a proxy fence,
    /// then a barrier).
    #[inline(always)]
    pub unsafe fn store_pair(self, row: u32, col: u32, bits: u32) {
        let cols = crate::gmma::BLOCK_COLS as u32;
        self.block((col / cols) as usize)
            .store_pair(row, col % cols, bits);
    }

    /// The K-major descriptor of rows `row0 ..` (a multiple of 8) at k-step `ks` (16 columns).
    #[inline(always)]
    pub fn k_major(self, row0: usize, ks: usize) -> u64 {
        crate::gmma::k_major(self.base, ROWS as u32, row0 as u32, ks as u32)
    }

    /// The MN-major descriptor of rows `16·ks ..` (the reduction) and column block `cb`.
    #[inline(always)]
    pub fn mn_major(self, ks: usize, cb: usize) -> u64 {
        crate::gmma::mn_major(self.base, ROWS as u32, ks as u32, cb as u32)
    }
}
