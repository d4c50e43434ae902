//! The forward kernel's memory traffic: its shared-memory layout, the K/V tile loads, the Q
//! fragments and the epilogue that writes O and LSE.

use super::super::elem::Elem;
use super::super::frag::{AccTile, FragPos, RowVec, ThreadPos};
use super::super::gemm::AFragments;
use super::super::ptx;
use super::super::quad_store::quad_transpose;
use super::super::softmax::OnlineSoftmax;
use super::super::tile::{LaneOffsets, SmemTile};
use crate::block::BlockInfo;
use crate::config::MMA_M;
use crate::mask::AttnMask;
use crate::params::FwdParams;

/// The dynamic shared memory of one block: Q `[BM][PITCH]`, then two (K, V) buffers of
/// `[BN][PITCH]` each.
#[derive(Clone, Copy)]
pub struct FwdSmem<const BM: usize, const BN: usize, const PITCH: usize> {
    /// The Q tile.
    pub q: SmemTile<BM, PITCH>,
    kv_base: u32,
}

/// One K/V buffer.
#[derive(Clone, Copy)]
pub struct KvTiles<const BN: usize, const PITCH: usize> {
    /// Keys, `[BN][PITCH]`.
    pub k: SmemTile<BN, PITCH>,
    /// Values, `[BN][PITCH]`.
    pub v: SmemTile<BN, PITCH>,
}

impl<const BM: usize, const BN: usize, const PITCH: usize> FwdSmem<BM, BN, PITCH> {
    /// The layout starting at shared address `base`.
    #[inline(always)]
    pub fn at(base: u32) -> Self {
        Self {
            q: SmemTile::at(base),
            kv_base: base + SmemTile::<BM, PITCH>::BYTES,
        }
    }

    /// Loads the Q tile and key tile `n` into buffer 0 (`cp.async`), waits for them, negates
    /// Q when the softmax scale is negative (softmax(s·c) with c < 0 is softmax(s'·|c|) for
    /// s' = (−Q)·Kᵀ, so every step sees a positive scale), and publishes both to the block.
    ///
    /// # Safety
    /// Every thread of the block calls it; `p` and `block` describe live tensors.
    #[inline(always)]
    pub unsafe fn load_q_and_first_kv<const D: usize, const WARPS: usize>(
        &self,
        p: &FwdParams,
        block: &BlockInfo,
        kv: &KvSource,
        n: u32,
        tid: u32,
    ) {
        let q = (p.q.ptr as *const u16).add(block.query_offset(&p.q, block.row0) as usize);
        let (rows_left, d) = (block.rows_left(), p.dims.head_dim);
        self.q
            .load_async::<D, WARPS>(q, p.q.strides.row, rows_left, d, tid);
        kv.load::<D, WARPS, BN, PITCH>(self.kv(0), n, tid);
        ptx::cp_async_commit_group();
        ptx::cp_async_wait_group::<0>();
        if p.scale_log2 < 0.0 {
            self.q.negate_own::<D, WARPS>(tid);
        }
        ptx::bar_sync();
    }

    /// K/V buffer `buf` (0 or 1).
    #[inline(always)]
    pub fn kv(&self, buf: u32) -> KvTiles<BN, PITCH> {
        let bytes = SmemTile::<BN, PITCH>::BYTES;
        KvTiles {
            k: SmemTile::at(self.kv_base + 2 * buf * bytes),
            v: SmemTile::at(self.kv_base + (2 * buf + 1) * bytes),
        }
    }
}

/// Where a block's keys and values live in global memory.
#[derive(Clone, Copy)]
pub struct KvSource {
    k: *const u16,
    v: *const u16,
    k_row: u64,
    v_row: u64,
    seqlen_k: u32,
    head_dim: u32,
}

impl KvSource {
    /// The K and V rows of `block`'s KV head.
    #[inline(always)]
    pub unsafe fn new(p: &FwdParams, block: &BlockInfo) -> Self {
        Self {
            k: (p.k.ptr as *const u16).add(block.key_offset(&p.k, 0) as usize),
            v: (p.v.ptr as *const u16).add(block.key_offset(&p.v, 0) as usize),
            k_row: p.k.strides.row,
            v_row: p.v.strides.row,
            seqlen_k: block.seqlen_k,
            head_dim: p.dims.head_dim,
        }
    }

    /// Starts the `cp.async` copies of key tile `n` into `dst` (keys past the sequence are
    /// zero-filled); the caller commits the group.
    #[inline(always)]
    pub unsafe fn load<const D: usize, const WARPS: usize, const BN: usize, const PITCH: usize>(
        &self,
        dst: KvTiles<BN, PITCH>,
        n: u32,
        tid: u32,
    ) {
        let key0 = n * BN as u32;
        let valid = self.seqlen_k - key0;
        let k = self.k.add(key0 as usize * self.k_row as usize);
        let v = self.v.add(key0 as usize * self.v_row as usize);
        dst.k
            .load_async::<D, WARPS>(k, self.k_row, valid, self.head_dim, tid);
        dst.v
            .load_async::<D, WARPS>(v, self.v_row, valid, self.head_dim, tid);
    }
}

/// The warp's Q fragments: kept in registers for the whole key loop when `IN_REGS`, else
/// re-read from shared memory at every step (saves registers for large head dims).
pub struct QFragments<const MT: usize, const K_STEPS: usize, const IN_REGS: bool>(
    [[[u32; 4]; K_STEPS]; MT],
);

impl<const MT: usize, const K_STEPS: usize, const IN_REGS: bool> QFragments<MT, K_STEPS, IN_REGS> {
    /// Loads the fragments of the warp's rows (from `m0`) when they stay in registers.
    ///
    /// # Safety
    /// The whole warp calls it after the Q tile is published.
    #[inline(always)]
    pub unsafe fn load<const BM: usize, const PITCH: usize>(
        q: SmemTile<BM, PITCH>,
        lanes: &LaneOffsets,
        m0: usize,
    ) -> Self {
        let mut f = [[[0u32; 4]; K_STEPS]; MT];
        if IN_REGS {
            for (mt, frags) in f.iter_mut().enumerate() {
                for (ks, frag) in frags.iter_mut().enumerate() {
                    *frag = q.load_a(lanes, m0, mt, ks);
                }
            }
        }
        Self(f)
    }

    /// The A fragments of every m-tile for reduction step `ks`.
    ///
    /// # Safety
    /// As [`QFragments::load`].
    #[inline(always)]
    pub unsafe fn a<const BM: usize, const PITCH: usize>(
        &self,
        q: SmemTile<BM, PITCH>,
        lanes: &LaneOffsets,
        m0: usize,
        ks: usize,
    ) -> [[u32; 4]; MT] {
        core::array::from_fn(|mt| {
            if IN_REGS {
                self.0[mt][ks]
            } else {
                q.load_a(lanes, m0, mt, ks)
            }
        })
    }
}

/// The warp's Q operand for one step: its fragments, from registers or from the Q tile.
pub struct QOperand<
    'a,
    const MT: usize,
    const K_STEPS: usize,
    const IN_REGS: bool,
    const BM: usize,
    const PITCH: usize,
> {
    /// The fragments kept in registers (unused unless `IN_REGS`).
    pub frags: &'a QFragments<MT, K_STEPS, IN_REGS>,
    /// The Q tile.
    pub tile: SmemTile<BM, PITCH>,
    /// First row of the warp's m-tiles in the tile.
    pub m0: usize,
}

impl<
        const MT: usize,
        const K_STEPS: usize,
        const IN_REGS: bool,
        const BM: usize,
        const PITCH: usize,
    > AFragments<MT> for QOperand<'_, MT, K_STEPS, IN_REGS, BM, PITCH>
{
    #[inline(always)]
    unsafe fn a(&self, lanes: &LaneOffsets, ks: usize) -> [[u32; 4]; MT] {
        self.frags.a(self.tile, lanes, self.m0, ks)
    }
}

/// Finishes the softmax and writes O (normalised and multiplied by `o_scale`, dropout's
/// `1/(1 − p)` or 1; 16-bit, 4 bytes per store) and LSE for the warp's rows starting at
/// sequence row `first_row`; rows past the sequence are skipped. Rows the mask lets see no
/// key get O = 0, LSE = −∞ (see [`OnlineSoftmax::finish`]). The lane is read here (kept out
/// of registers until here).
///
/// # Safety
/// The whole warp calls it; `p` describes live tensors.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn store_output<E: Elem, M: AttnMask, const MT: usize, const D_TILES: usize>(
    p: &FwdParams,
    block: &BlockInfo,
    mask: &M,
    first_row: u32,
    o: &AccTile<MT, D_TILES>,
    softmax: &OnlineSoftmax<MT>,
    o_scale: f32,
) {
    let pos = FragPos::of(ThreadPos::current().lane);
    let (rows, inv_l) = store_lse(p, block, mask, first_row, softmax, o_scale, pos);
    inv_l.for_each(|mt, r, inv| {
        let row = rows.0[mt][r];
        if row >= block.seqlen_q {
            return;
        }
        let dst = (p.o.ptr as *mut u16).add(block.query_offset(&p.o, row) as usize);
        for dt in 0..D_TILES {
            let col = pos.col(dt, 0);
            if col < p.dims.head_dim {
                let [x0, x1] = o.pair(mt, r, dt);
                *(dst.add(col as usize) as *mut u32) = E::pack(x0 * inv, x1 * inv);
            }
        }
    });
}

/// [`store_output`] for one m-tile with 16-byte stores and no shared memory: the four lanes
/// of a quad swap their packed pairs (two butterfly rounds of two shuffles per four 8-column
/// tiles, [`quad_transpose`]) so that each lane holds one tile's 8 columns of a row, then each
/// lane stores them at once (`st.global.v4`): a warp's store covers 64 contiguous bytes of
/// each of 8 rows, where [`store_output`] writes 16 (a quarter of the store instructions, and
/// whole 32-byte sectors). The same bytes as [`store_output`]; a chunk the head dim cuts is
/// stored 4 bytes at a time up to it (O's row starts are 16-byte aligned:
/// [`crate::params::TensorRef`]). `lane`: the caller's copy (a persistent kernel passes an
/// opaque one, so the addresses derived from it are not hoisted out of its tile loop). No
/// sync point (the shuffles are the warp's own).
///
/// # Safety
/// The whole warp calls it; `p` describes live tensors.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn store_output_by_quads<E: Elem, M: AttnMask, const D_TILES: usize>(
    p: &FwdParams,
    block: &BlockInfo,
    mask: &M,
    first_row: u32,
    o: &AccTile<1, D_TILES>,
    softmax: &OnlineSoftmax<1>,
    o_scale: f32,
    lane: u32,
) {
    const { assert!(D_TILES % 4 == 0) };
    let pos = FragPos::of(lane);
    let (rows, inv_l) = store_lse(p, block, mask, first_row, softmax, o_scale, pos);
    let quad_lane = lane % 4;
    for r in 0..2 {
        let (row, inv) = (rows.0[0][r], inv_l.0[0][r]);
        for k in 0..D_TILES / 4 {
            let words = quad_transpose(
                core::array::from_fn(|j| {
                    let [x0, x1] = o.pair(0, r, 4 * k + j);
                    E::pack(x0 * inv, x1 * inv)
                }),
                quad_lane,
            );
            store_o_chunk(p, block, row, (4 * k as u32 + quad_lane) * 8, words);
        }
    }
}

/// Stores the 16-byte chunk `words` (8 columns from `col`) of O's sequence row `row`: nothing
/// for a row past the sequence or a chunk past the head dim, and a chunk the head dim cuts 4
/// bytes at a time up to it (O's row starts are 16-byte aligned: [`crate::params::TensorRef`]).
///
/// # Safety
/// `p` describes live tensors.
#[inline(always)]
unsafe fn store_o_chunk(p: &FwdParams, block: &BlockInfo, row: u32, col: u32, words: [u32; 4]) {
    let head_dim = p.dims.head_dim;
    if row >= block.seqlen_q || col >= head_dim {
        return;
    }
    let dst = (p.o.ptr as *mut u16).add((block.query_offset(&p.o, row) + col as u64) as usize);
    if col + 8 <= head_dim {
        ptx::st_global_v4(dst as u64, words);
    } else {
        for (w, &word) in words.iter().enumerate() {
            if col + 2 * (w as u32) < head_dim {
                *(dst.add(2 * w) as *mut u32) = word;
            }
        }
    }
}

/// Finishes the softmax of the thread's rows (`first_row + ` their fragment rows), writes
/// their LSE (the quad's first lane, rows inside the sequence) and returns the rows and
/// the factors O's rows are multiplied by (`o_scale / l`, 0 for rows that see no key).
#[inline(always)]
unsafe fn store_lse<M: AttnMask, const MT: usize>(
    p: &FwdParams,
    block: &BlockInfo,
    mask: &M,
    first_row: u32,
    softmax: &OnlineSoftmax<MT>,
    o_scale: f32,
    pos: FragPos,
) -> (RowVec<u32, MT>, RowVec<f32, MT>) {
    let rows = RowVec::<u32, MT>::from_fn(|mt, r| first_row + pos.row(mt, r));
    let fin = softmax.finish(rows.map(|row| mask.row_sees_keys(row)));
    fin.lse.for_each(|mt, r, lse| {
        let row = rows.0[mt][r];
        if row < block.seqlen_q && pos.leads_quad() {
            let at = block.row_stat_offset(&p.lse, row);
            *(p.lse.ptr as *mut f32).add(at as usize) = lse;
        }
    });
    (rows, fin.inv_l.map(|inv| inv * o_scale))
}

/// Bytes of one warp's O stage for [`store_output_staged`] at `d` columns: 16 rows.
pub const fn output_stage_bytes(d: usize) -> usize {
    MMA_M * d * 2
}

/// [`store_output`] for one m-tile through the warp's O stage, `[16][8·D_TILES]` 16-bit
/// values at shared address `stage` ([`output_stage_bytes`], 16-byte aligned), each row's
/// 16-byte chunks XOR-swizzled by the row's low three bits (the eight rows of an
/// `stmatrix` matrix fall on distinct banks): the warp's fragments go in by `stmatrix`, four
/// 8 × 8 matrices per instruction, and out by 16-byte loads and global stores, a row's
/// chunks from consecutive lanes. The same bytes as [`store_output`]: a chunk the head dim
/// cuts is stored 4 bytes at a time up to it (O's row starts are 16-byte aligned: see
/// [`crate::params::TensorRef`]). Sync points: `bar.warp.sync` before the stage is written
/// (the warp's previous reads of it are done) and before it is read.
///
/// # Safety
/// The whole warp calls it; `p` describes live tensors; no other warp uses the stage.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn store_output_staged<E: Elem, M: AttnMask, const D_TILES: usize>(
    p: &FwdParams,
    block: &BlockInfo,
    mask: &M,
    first_row: u32,
    o: &AccTile<1, D_TILES>,
    softmax: &OnlineSoftmax<1>,
    o_scale: f32,
    lane: u32,
    stage: u32,
) {
    const { assert!(D_TILES % 2 == 0) };
    let pos = FragPos::of(lane);
    let (_, inv_l) = store_lse(p, block, mask, first_row, softmax, o_scale, pos);
    let inv = inv_l.0[0];
    let row_bytes = D_TILES as u32 * 16;
    let chunk_at = |row: u32, chunk: u32| stage + row * row_bytes + ((chunk ^ (row & 7)) * 16);
    ptx::bar_warp_sync();
    // Lane l addresses row l % 8 of matrix l / 8: (row half, n-tile) = (m % 2, dt + m / 2).
    let (m, row_in) = (lane / 8, lane % 8);
    let row = 8 * (m % 2) + row_in;
    for dt in (0..D_TILES).step_by(2) {
        let frag = |r: usize, nt: usize| {
            let [x0, x1] = o.pair(0, r, nt);
            E::pack(x0 * inv[r], x1 * inv[r])
        };
        let regs = [frag(0, dt), frag(1, dt), frag(0, dt + 1), frag(1, dt + 1)];
        ptx::stmatrix_x4(chunk_at(row, dt as u32 + m / 2), regs);
    }
    ptx::bar_warp_sync();
    for k in 0..MMA_M * D_TILES / 32 {
        let c = lane + 32 * k as u32;
        let (row, chunk) = (c / D_TILES as u32, c % D_TILES as u32);
        let words = ptx::ld_shared_v4(chunk_at(row, chunk));
        store_o_chunk(p, block, first_row + row, chunk * 8, words);
    }
}
