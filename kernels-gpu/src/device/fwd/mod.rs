//! Forward attention: FlashAttention 2, Algorithm 1 with the query-outer loop order.
//!
//! One block computes `O[row0 .. row0 + BM]` for one (head, batch):
//!
//! ```text
//! load Q tile                                  global → shared (cp.async) [→ registers]
//! m = −∞, l = 0, O = 0                         registers (OnlineSoftmax, AccTile)
//! for each key tile j the mask visits,         last first: masked tiles come first
//!     prefetch the next tile                   cp.async into the other buffer
//!     S = Q·Kⱼᵀ                                mma.sync m16n8k16, f32 accumulators
//!     mask S (only tiles the mask flags), modify scores (masks that do)
//!     P, m, l ← online softmax of S            O rescaled only when some row max moved
//!     [dropout: P ← P ∘ Z]                     Z from Philox (`device::dropout`); l keeps
//!                                              the sum before dropout
//!     O += P·Vⱼ                                P converted to 16 bits in registers: it is
//!                                              already the A fragment of the next mma
//! O /= l [·1/(1 − p)];  LSE = (m + log2 l)·ln 2   one write of O and LSE per row
//! ```
//!
//! Tile shape: `BM = 16·MT·WARPS` query rows per block; each warp owns `MT` m-tiles of 16 rows
//! (every K/V fragment loaded from shared memory feeds `MT` mmas); `BN` keys per K/V tile; `D`
//! is the compiled head dim. Shared memory (dynamic, see
//! [`crate::config::FwdTile::smem_bytes`]): Q `[BM][PITCH]`, then two buffers of K `[BN][PITCH]`
//! and V `[BN][PITCH]`, all swizzled. Registers per thread: O `MT × D/8 × 4` f32, S
//! `MT × BN/8 × 4` f32, Q fragments `MT × D/16 × 4` u32 (only when `Q_IN_REGS`; else re-read
//! with `ldmatrix` at every step), m, l for `2·MT` rows.
//! Sync points: one `bar.sync` per K/V tile (after its `cp.async` group completes; it also
//! frees the buffer the prefetch then overwrites).

pub(crate) mod io;
#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // sm_90a code
pub(crate) mod wgmma;

use super::dropout::{drop_packed_probabilities, drop_probabilities, rng_for};
use super::elem::Elem;
use super::frag::{AccTile, FragPos, PackedTile, RowVec, ThreadPos};
use super::gemm::{mma_abt, mma_pb};
use super::ptx;
use super::softmax::{OnlineSoftmax, Tuning};
use super::tile::LaneOffsets;
use crate::block::BlockInfo;
use crate::config::MMA_M;
use crate::mask::AttnMask;
use crate::params::FwdParams;
use crate::rng::DropoutRng;
use core::marker::PhantomData;
use io::{store_output, FwdSmem, KvSource, KvTiles, QFragments, QOperand};

/// The forward kernel body for any mask type `M`; see the module docs. Const parameters: `D`
/// compiled head dim, `PITCH` shared row length, `BM`/`BN` tile rows/keys, `WARPS`, `MT`
/// m-tiles per warp, `Q_IN_REGS`, and the derived counts `K_STEPS = D/16`, `D_TILES = D/8`,
/// `N_TILES = BN/8`, and `DROPOUT` (attention dropout from `p.dropout`; see
/// [`crate::rng`]) (stable Rust cannot compute array lengths from const parameters, so the
/// registry passes them and this checks them).
///
/// # Safety
/// Launched with grid `(ceil(seqlen_q / BM), heads_q, batch)`, `32·WARPS` threads and
/// `FwdTile::smem_bytes()` bytes of dynamic shared memory, on parameters the host validated.
#[inline(always)]
pub unsafe fn flash_fwd<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const PITCH: usize,
    const BM: usize,
    const BN: usize,
    const WARPS: usize,
    const MT: usize,
    const Q_IN_REGS: bool,
    const K_STEPS: usize,
    const D_TILES: usize,
    const N_TILES: usize,
    const DROPOUT: bool,
>(
    p: &FwdParams,
) {
    const {
        assert!(K_STEPS * 16 == D && D_TILES * 8 == D && N_TILES * 8 == BN);
        assert!(BM == WARPS * MMA_M * MT && BN % 16 == 0 && D % 16 == 0 && PITCH >= D);
    };
    let me = ThreadPos::current();
    let longest_first = M::later_rows_see_more(&p.mask);
    let block = BlockInfo::new(
        &p.dims,
        ptx::ctaid(),
        ptx::nctaid_x(),
        BM as u32,
        longest_first,
    );
    let mask = M::new(&p.mask, &block);
    let warp_m0 = me.warp as usize * MMA_M * MT; // first row of this warp's m-tiles
    let mut o = AccTile::<MT, D_TILES>::zero();
    let mut softmax = OnlineSoftmax::<MT>::new();

    let (row0, bm, bn) = (block.row0, BM as u32, BN as u32);
    if let Some(mut n) = mask.first_key_tile(row0, bm, bn) {
        let smem = FwdSmem::<BM, BN, PITCH>::at(ptx::dyn_smem_base());
        let kv = KvSource::new(p, &block);
        smem.load_q_and_first_kv::<D, WARPS>(p, &block, &kv, n, me.tid); // ends in bar.sync
        let scale = p.scale_log2.abs(); // a negative scale was folded into Q
        let lanes = LaneOffsets::new::<PITCH>(me.lane);
        let pos = FragPos::of(me.lane);
        let rows = RowVec::<u32, MT>::from_fn(|mt, r| row0 + pos.row(mt, r) + warp_m0 as u32);
        let q_frags = QFragments::<MT, K_STEPS, Q_IN_REGS>::load(smem.q, &lanes, warp_m0);
        let mut buf = 0;
        loop {
            let next = mask.next_key_tile(row0, bm, bn, n);
            if let Some(next) = next {
                kv.load::<D, WARPS, BN, PITCH>(smem.kv(buf ^ 1), next, me.tid);
                ptx::cp_async_commit_group();
            }
            let step = Step::<E, M, BM, BN, PITCH, MT, K_STEPS, N_TILES, Q_IN_REGS, DROPOUT> {
                q: QOperand {
                    frags: &q_frags,
                    tile: smem.q,
                    m0: warp_m0,
                },
                kv: smem.kv(buf),
                mask: &mask,
                scale,
                lane: me.lane,
                lanes,
                rows,
                key0: n * BN as u32,
                rng: rng_for(&p.dropout, block.batch, block.head, p.dims.heads_q),
                elem: PhantomData,
            };
            if mask.tile_needs_mask(row0, bm, n, bn) {
                step.attend::<true, D_TILES>(&mut softmax, &mut o);
            } else {
                step.attend::<false, D_TILES>(&mut softmax, &mut o);
            }
            let Some(next) = next else { break };
            (n, buf) = (next, buf ^ 1);
            ptx::cp_async_wait_group::<0>();
            ptx::bar_sync(); // tile `next` landed; every warp is done with the buffer it frees
        }
    }
    let o_scale = if DROPOUT { p.dropout.scale } else { 1.0 };
    let first_row = row0 + warp_m0 as u32;
    store_output::<E, M, MT, D_TILES>(p, &block, &mask, first_row, &o, &softmax, o_scale);
}

/// One step of the key loop: what this thread reads and where its rows and keys are.
struct Step<
    'a,
    E,
    M,
    const BM: usize,
    const BN: usize,
    const PITCH: usize,
    const MT: usize,
    const K_STEPS: usize,
    const N_TILES: usize,
    const Q_IN_REGS: bool,
    const DROPOUT: bool,
> {
    /// The warp's Q fragments (registers or the Q tile).
    q: QOperand<'a, MT, K_STEPS, Q_IN_REGS, BM, PITCH>,
    /// This step's K and V tiles.
    kv: KvTiles<BN, PITCH>,
    mask: &'a M,
    /// `|softmax_scale|·log2(e)` (a negative scale is folded into Q).
    scale: f32,
    lane: u32,
    /// This lane's `ldmatrix` offsets.
    lanes: LaneOffsets,
    /// Sequence rows of the thread's accumulator rows.
    rows: RowVec<u32, MT>,
    /// First key of the tile.
    key0: u32,
    /// The (batch, head)'s dropout generator (unused without `DROPOUT`).
    rng: DropoutRng,
    elem: PhantomData<(E, [(); N_TILES])>,
}

impl<
        E: Elem,
        M: AttnMask,
        const BM: usize,
        const BN: usize,
        const PITCH: usize,
        const MT: usize,
        const K_STEPS: usize,
        const N_TILES: usize,
        const Q_IN_REGS: bool,
        const DROPOUT: bool,
    > Step<'_, E, M, BM, BN, PITCH, MT, K_STEPS, N_TILES, Q_IN_REGS, DROPOUT>
{
    /// One step of Algorithm 1 for this key tile. `MASKED`: the tile holds keys some row may
    /// not see, so the mask's predicate runs (inside the softmax's max pass).
    #[inline(always)]
    unsafe fn attend<const MASKED: bool, const D_TILES: usize>(
        &self,
        softmax: &mut OnlineSoftmax<MT>,
        o: &mut AccTile<MT, D_TILES>,
    ) {
        let lanes = self.lanes.step_local();
        let mut s = AccTile::<MT, N_TILES>::zero(); // S = Q·Kᵀ: 16·MT × BN per warp
        mma_abt::<E, MT, N_TILES, K_STEPS, BN, PITCH>(&mut s, &self.q, self.kv.k, &lanes);
        let tile = KeyTile {
            mask: self.mask,
            rows: &self.rows,
            key0: self.key0,
            lane: self.lane,
            scale: self.scale,
            rng: &self.rng,
            by_interval: false,
        };
        tile.scores_to_probabilities::<MASKED, DROPOUT, N_TILES>(&mut s, softmax, o, Tuning::PLAIN);
        mma_pb::<E, MT, N_TILES, D_TILES, BN, PITCH>(o, &s, self.kv.v, &lanes, 0);
        // O += P·V
    }
}

/// What a warp knows about the key tile in front of it, between its two products.
pub(crate) struct KeyTile<'a, M, const MT: usize> {
    /// The block's mask.
    pub mask: &'a M,
    /// Sequence rows of the thread's accumulator rows.
    pub rows: &'a RowVec<u32, MT>,
    /// First key of the tile.
    pub key0: u32,
    /// Lane index in the warp.
    pub lane: u32,
    /// `|softmax_scale|·log2(e)` (a negative scale is folded into Q).
    pub scale: f32,
    /// The (batch, head)'s dropout generator (unused without `DROPOUT`).
    pub rng: &'a DropoutRng,
    /// Masked tiles test scores against each row's key interval ([`AttnMask::row_keys`],
    /// masks with [`AttnMask::ROW_INTERVAL`]) rather than with [`AttnMask::visible`]: the
    /// `wgmma` kernels without dropout. The `mma.sync` kernels and those with dropout keep
    /// `visible` (with the per-row bounds live, several of them spilled).
    pub by_interval: bool,
}

impl<M: AttnMask, const MT: usize> KeyTile<'_, M, MT> {
    /// Turns the raw scores `s = Q·Kᵀ` into P in place: the mask's score modifier (masks that
    /// have one), the online softmax (with the mask's predicate when `MASKED`), then
    /// `o.rescale(factor)` when a row's reference point moved (O's rows multiplied by the
    /// factor now, or the factor kept until O is out of the tensor cores: see [`Rescale`]),
    /// and dropout.
    /// Shared by every forward kernel body; `tuning` schedules the softmax (see
    /// [`crate::device::softmax`]).
    ///
    /// # Safety
    /// The whole warp calls it.
    #[inline(always)]
    pub unsafe fn scores_to_probabilities<
        const MASKED: bool,
        const DROPOUT: bool,
        const NT: usize,
    >(
        &self,
        s: &mut AccTile<MT, NT>,
        softmax: &mut OnlineSoftmax<MT>,
        o: &mut impl Rescale<MT>,
        tuning: Tuning,
    ) {
        self.probabilities_by::<false, MASKED, DROPOUT, NT>(s, softmax, o, tuning, |_| false);
    }

    /// As [`Self::scores_to_probabilities`] with the lazy maximum, taken at the rows' current
    /// reference points ([`OnlineSoftmax::update_at_reference`]): `true` when no row's
    /// maximum moves (P in `s`, O needs no rescaling); `false` (warp-uniform) when one would,
    /// with `s` spent and the softmax state untouched: the caller computes S again and calls
    /// [`Self::scores_to_probabilities`]. `any` votes over the threads that take the same
    /// path (see [`OnlineSoftmax::update_at_reference`]).
    ///
    /// # Safety
    /// Every thread `any` votes over calls it.
    #[inline(always)]
    pub unsafe fn scores_to_probabilities_at_reference<
        const MASKED: bool,
        const DROPOUT: bool,
        const NT: usize,
    >(
        &self,
        s: &mut AccTile<MT, NT>,
        softmax: &mut OnlineSoftmax<MT>,
        tuning: Tuning,
        any: impl FnOnce(bool) -> bool,
    ) -> bool {
        let mut unused: Option<RowVec<f32, MT>> = None; // no rescale at the reference points
        self.probabilities_by::<true, MASKED, DROPOUT, NT>(s, softmax, &mut unused, tuning, any)
    }

    /// The body of both: `AT_REFERENCE` picks the softmax's update (and uses `any`); returns
    /// whether P is in `s` (always without `AT_REFERENCE`).
    #[inline(always)]
    unsafe fn probabilities_by<
        const AT_REFERENCE: bool,
        const MASKED: bool,
        const DROPOUT: bool,
        const NT: usize,
    >(
        &self,
        s: &mut AccTile<MT, NT>,
        softmax: &mut OnlineSoftmax<MT>,
        o: &mut impl Rescale<MT>,
        tuning: Tuning,
        any: impl FnOnce(bool) -> bool,
    ) -> bool {
        let pos = FragPos::of(ptx::opaque_u32(self.lane));
        if M::MODIFIES_SCORES && self.mask.modifies_scores() {
            // One branch per tile on the cap, none per score.
            let (mask, slope) = (self.mask, self.mask.block_slope());
            if mask.capped() {
                s.map_scores(self.rows, pos, self.key0, |r, k, x| {
                    mask.score_as::<true>(r, k, x, slope)
                });
            } else {
                s.map_scores(self.rows, pos, self.key0, |r, k, x| {
                    mask.score_as::<false>(r, k, x, slope)
                });
            }
        }
        let by_interval = M::ROW_INTERVAL && self.by_interval;
        let bounds = if by_interval {
            self.row_bounds(pos)
        } else {
            RowVec::splat((0, 0))
        };
        let visible = |mt: usize, r: usize, nt: usize, c: usize| {
            if by_interval {
                let ((lo, hi), col) = (bounds.0[mt][r], (pos.col(nt, c) - pos.col(0, 0)) as i32);
                (!M::ROW_LOWER_BOUND || col >= lo) && col < hi
            } else {
                self.mask
                    .visible(self.rows.0[mt][r], self.key0 + pos.col(nt, c))
            }
        };
        let done = if AT_REFERENCE {
            softmax.update_at_reference::<MASKED, NT>(s, self.scale, visible, tuning, any)
        } else {
            if let Some(factor) = softmax.update::<MASKED, NT>(s, self.scale, visible, tuning) {
                o.rescale(&factor);
            }
            true
        };
        if DROPOUT && done {
            self.drop_out(s);
        }
        done
    }

    /// Dropout on the tile's probabilities (`s` holds P): see [`drop_probabilities`].
    #[inline(always)]
    pub fn drop_out<const NT: usize>(&self, s: &mut AccTile<MT, NT>) {
        // SAFETY: `opaque_u32` is arithmetic only.
        let pos = FragPos::of(unsafe { ptx::opaque_u32(self.lane) });
        drop_probabilities(self.rng, s, self.rows, self.key0, pos);
    }

    /// Dropout on the tile's probabilities packed to 16 bits: see
    /// [`drop_packed_probabilities`].
    #[inline(always)]
    pub fn drop_out_packed<const NT: usize>(&self, p: &mut PackedTile<MT, NT>) {
        // SAFETY: `opaque_u32` is arithmetic only.
        let pos = FragPos::of(unsafe { ptx::opaque_u32(self.lane) });
        drop_packed_probabilities(self.rng, p, self.rows, self.key0, pos);
    }
}

impl<M: AttnMask, const MT: usize> KeyTile<'_, M, MT> {
    /// For masks with [`AttnMask::ROW_INTERVAL`]: each row's visible keys `[lo, hi)` relative
    /// to the thread's first column of the tile (`key0 + pos.col(0, 0)`), so a score's test is
    /// its column offset (a constant per register) against two per-row values. Keys and
    /// lengths lie below 2³¹ (the host rejects larger sequences), so the differences fit i32.
    #[inline(always)]
    fn row_bounds(&self, pos: FragPos) -> RowVec<(i32, i32), MT> {
        let base = self.key0 + pos.col(0, 0);
        RowVec::from_fn(|mt, r| {
            let (lo, hi) = self.mask.row_keys(self.rows.0[mt][r]);
            (lo.wrapping_sub(base) as i32, hi.wrapping_sub(base) as i32)
        })
    }
}

/// What the online softmax's O rescale does: multiply the rows now (an [`AccTile`] O) or
/// keep the factor for later (`Option<RowVec>`, while O is in flight on the tensor cores).
pub(crate) trait Rescale<const MT: usize> {
    /// Applies or records `O ·= 2^(m − m')` with per-row `factor`.
    fn rescale(&mut self, factor: &RowVec<f32, MT>);
}

impl<const MT: usize, const DT: usize> Rescale<MT> for AccTile<MT, DT> {
    #[inline(always)]
    fn rescale(&mut self, factor: &RowVec<f32, MT>) {
        self.scale_rows(factor); // O ·= 2^(m − m')
    }
}

impl<const MT: usize> Rescale<MT> for Option<RowVec<f32, MT>> {
    #[inline(always)]
    fn rescale(&mut self, factor: &RowVec<f32, MT>) {
        *self = Some(*factor);
    }
}
