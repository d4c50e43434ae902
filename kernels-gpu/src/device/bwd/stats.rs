//! The per-query statistics of a backward step in shared memory: LSE·log2 e and D of the
//! query tile's `BM` rows, in two buffers (the tile being computed and the one loading).

use crate::block::BlockInfo;
use crate::device::frag::{AccTile, FragPos};
use crate::device::ptx;
use crate::params::BwdParams;

/// `log2(e)`: converts the natural-log LSE into the base-2 domain of the exponent.
pub(super) const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// Two buffers, each `BM` f32 LSE·log2 e then `BM` f32 D.
#[derive(Clone, Copy)]
pub(super) struct QueryStats<const BM: usize> {
    base: u32,
}

impl<const BM: usize> QueryStats<BM> {
    /// Bytes of one buffer.
    const BUF: u32 = 2 * 4 * BM as u32;
    /// Bytes of both buffers.
    pub const BYTES: u32 = 2 * Self::BUF;

    /// The buffers at shared address `base` (4-byte aligned).
    #[inline(always)]
    pub fn at(base: u32) -> Self {
        Self { base }
    }

    /// Shared address of query `col`'s LSE slot in buffer `buf` (its D slot is `4·BM` on).
    #[inline(always)]
    fn addr(&self, buf: u32, col: u32) -> u32 {
        self.base + buf * Self::BUF + 4 * col
    }

    /// LSE·log2 e of query `col` of buffer `buf` (+∞ for rows past the sequence and rows
    /// that saw no key, so that their P is 0).
    #[inline(always)]
    pub unsafe fn lse2(&self, buf: u32, col: u32) -> f32 {
        ptx::ld_shared_f32(self.addr(buf, col))
    }

    /// D of query `col` of buffer `buf`.
    #[inline(always)]
    pub unsafe fn delta(&self, buf: u32, col: u32) -> f32 {
        ptx::ld_shared_f32(self.addr(buf, col) + 4 * BM as u32)
    }

    /// Thread `tid < BM` issues the copies of the raw LSE and D of row `row0 + tid` into
    /// buffer `buf` (zero-filled past the sequence); the caller commits them.
    /// [`Self::finish`] completes the LSE slots.
    #[inline(always)]
    pub unsafe fn load(&self, p: &BwdParams, block: &BlockInfo, row0: u32, buf: u32, tid: u32) {
        if (tid as usize) < BM {
            let row = row0 + tid;
            let (bytes, lse, delta) = if row < p.dims.seqlen_q {
                let lse =
                    (p.lse.ptr as *const f32).add(block.row_stat_offset(&p.lse, row) as usize);
                let delta =
                    (p.delta.ptr as *const f32).add(block.row_stat_offset(&p.delta, row) as usize);
                (4, lse, delta)
            } else {
                (0, p.lse.ptr as *const f32, p.delta.ptr as *const f32)
            };
            let at = self.addr(buf, tid);
            ptx::cp_async_ca_4(at, lse as *const u8, bytes);
            ptx::cp_async_ca_4(at + 4 * BM as u32, delta as *const u8, bytes);
        }
    }

    /// Turns the raw LSE this thread copied into buffer `buf` (tile rows from `row0`) into
    /// LSE·log2 e, or +∞ where the row is past the sequence or saw no key (LSE = −∞). Call
    /// after this thread's copies completed and before the barrier that publishes them.
    #[inline(always)]
    pub unsafe fn finish(&self, buf: u32, row0: u32, seqlen_q: u32, tid: u32) {
        if (tid as usize) < BM {
            let at = self.addr(buf, tid);
            let lse = ptx::ld_shared_f32(at);
            let valid = row0 + tid < seqlen_q && lse != f32::NEG_INFINITY;
            ptx::st_shared_f32(at, if valid { lse * LOG2_E } else { f32::INFINITY });
        }
    }

    /// `Pᵀ = 2^(c·Sᵀ − LSE·log2 e)` in place for a warp's keys and the query tile in buffer
    /// `buf`, with no mask (the caller zeroes hidden scores; rows past the sequence need
    /// nothing: their LSE slot is +∞).
    #[inline(always)]
    pub unsafe fn probabilities<const Q_TILES: usize>(
        &self,
        pt: &mut AccTile<1, Q_TILES>,
        buf: u32,
        pos: FragPos,
        scale_log2: f32,
    ) {
        pt.for_each_mut(|_, _, nt, c, x| {
            let lse2 = self.lse2(buf, pos.col(nt, c));
            *x = ptx::ex2_approx_ftz(ptx::fma_rn_f32(*x, scale_log2, -lse2));
        });
    }
}
