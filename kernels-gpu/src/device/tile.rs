//! Shared-memory tiles and the register fragments loaded from them. Kernels never do lane
//! arithmetic themselves: this module knows which rows and chunks each lane addresses.

use super::ptx;
use crate::swizzle::chunk_offset;

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
        let tid = ptx::opaque_u32(tid);
        let threads = WARPS * 32;
        let chunks_per_row = COLS / 8;
        let total = ROWS * chunks_per_row;
        let mut i = 0;
        while i < total.div_ceil(threads) {
            let idx = tid as usize + i * threads;
            if total % threads == 0 || idx < total {
                let row = idx / chunks_per_row;
                let chunk = idx % chunks_per_row;
                let col = (chunk * 8) as u32;
                let valid = (row as u32) < rows_valid && col < cols_valid;
                let from = if valid {
                    src.add(row as u64 as usize * row_stride as usize + col as usize)
                } else {
                    src
                };
                let bytes = if valid { 16 } else { 0 };
                ptx::cp_async_cg_16(self.chunk_addr(row, chunk), from as *const u8, bytes);
            }
            i += 1;
        }
    }

    /// The `mma` A fragment of rows `[m0, m0 + 16)`, columns `[16·ks, 16·ks + 16)`.
    ///
    /// # Safety
    /// The whole warp calls it; the tile is written and synchronised.
    #[inline(always)]
    pub unsafe fn load_a(self, m0: usize, ks: usize, lane: u32) -> [u32; 4] {
        let lane = lane as usize;
        let mat = lane / 8;
        let row = m0 + (mat & 1) * 8 + lane % 8;
        let chunk = 2 * ks + (mat >> 1);
        ptx::ldmatrix_x4(self.chunk_addr(row, chunk))
    }

    /// `mma` B fragments of two adjacent 8-column tiles for a tile stored as `[n][k]` (rows are
    /// the B columns, as K is for `S = Q·Kᵀ`): B columns `[n0, n0 + 16)`, k `[16·ks, +16)`.
    ///
    /// # Safety
    /// As [`SmemTile::load_a`].
    #[inline(always)]
    pub unsafe fn load_b_pair_nk(self, n0: usize, ks: usize, lane: u32) -> [[u32; 2]; 2] {
        let lane = lane as usize;
        let mat = lane / 8;
        let row = n0 + (mat >> 1) * 8 + lane % 8;
        let chunk = 2 * ks + (mat & 1);
        let r = ptx::ldmatrix_x4(self.chunk_addr(row, chunk));
        [[r[0], r[1]], [r[2], r[3]]]
    }

    /// `mma` B fragments of two adjacent 8-column tiles for a tile stored as `[k][n]` (rows are
    /// the reduction dim, as V is for `O = P·V`): k rows `[k0, k0 + 16)`, B columns
    /// `[8·nt, 8·nt + 16)`. Uses the transposing `ldmatrix`.
    ///
    /// # Safety
    /// As [`SmemTile::load_a`].
    #[inline(always)]
    pub unsafe fn load_b_pair_kn(self, k0: usize, nt: usize, lane: u32) -> [[u32; 2]; 2] {
        let lane = lane as usize;
        let mat = lane / 8;
        let row = k0 + (mat & 1) * 8 + lane % 8;
        let chunk = nt + (mat >> 1);
        let r = ptx::ldmatrix_x4_trans(self.chunk_addr(row, chunk));
        [[r[0], r[1]], [r[2], r[3]]]
    }
}

/// Position of a lane inside an `mma` accumulator tile: rows `g` and `g + 8`, columns `2t`
/// and `2t + 1` (see [`ptx::mma_m16n8k16_f16`]).
#[derive(Clone, Copy)]
pub struct FragPos {
    /// `lane / 4`.
    pub g: u32,
    /// `lane % 4`.
    pub t: u32,
}

impl FragPos {
    /// The position of `lane`.
    #[inline(always)]
    pub fn of(lane: u32) -> Self {
        Self {
            g: lane / 4,
            t: lane % 4,
        }
    }

    /// Row (0..16) of accumulator element `e` (0..4).
    #[inline(always)]
    pub fn row(self, e: usize) -> u32 {
        self.g + 8 * (e as u32 >> 1)
    }

    /// Column (0..8) of accumulator element `e` (0..4).
    #[inline(always)]
    pub fn col(self, e: usize) -> u32 {
        2 * self.t + (e as u32 & 1)
    }
}

/// Sums `x` over the 4 lanes of a quad (the lanes holding one accumulator row).
///
/// # Safety
/// The whole warp calls it.
#[inline(always)]
pub unsafe fn quad_sum(x: f32) -> f32 {
    let x = x + ptx::shfl_sync_bfly::<1>(x);
    x + ptx::shfl_sync_bfly::<2>(x)
}

/// Maximum of `x` over the 4 lanes of a quad.
///
/// # Safety
/// The whole warp calls it.
#[inline(always)]
pub unsafe fn quad_max(x: f32) -> f32 {
    let x = x.max(ptx::shfl_sync_bfly::<1>(x));
    x.max(ptx::shfl_sync_bfly::<2>(x))
}
