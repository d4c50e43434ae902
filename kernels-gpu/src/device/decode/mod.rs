//! Decoding attention: split-KV (FlashDecoding) over a contiguous or paged KV cache, with the
//! query heads of one KV head packed into one block (GQA packing).
//!
//! One block computes, for one (batch entry, KV head), `BM = 16·MT` packed query rows (row
//! `r` is token `r / group`, query head `kv_head·group + r % group`) against the keys of one
//! split (`[split·split_keys, +split_keys)`, cut at the sequence's length):
//!
//! ```text
//! load Q rows                                 global → shared (cp.async) [→ registers]
//! warp w: m = −∞, l = 0, O = 0                registers; every warp holds all BM rows
//! for steps i = w, w + WARPS, ... of 16 keys  each warp its own ring of STAGES buffers
//!     prefetch step i + (STAGES−1)·WARPS      cp.async; its page read 32 steps before
//!     S = Q·Kᵢᵀ, mask, online softmax, O += P·Vᵢ
//! merge the warps' (m, l, O)                  shared memory (over the drained rings)
//! one split:  O /= l, write O and LSE         16-bit O, f32 LSE
//! more:       write O/l and LSE as partials   f32, merged by `decode_combine`
//! ```
//!
//! Registers per thread: O `MT × D/8 × 4` f32, S `MT × 2 × 4` f32, Q fragments
//! `MT × D/16 × 4` u32 when `Q_IN_REGS`. Shared memory ([`crate::config::DecodeTile`]): the Q
//! tile `[BM][PITCH]`, then per warp `STAGES` buffers of K and V `[16][PITCH]`; at the end the
//! same bytes hold each warp's f32 O `[BM][D]` and row statistics. Sync points: `bar.sync`
//! once after the Q tile lands; `bar.warp.sync` once per step (the warp's copies landed, its
//! oldest buffer is free); two `bar.sync` around the merge writes.

mod append;
mod combine;

pub use append::kv_append;
pub use combine::{decode_combine, merge_states};

use super::elem::Elem;
use super::frag::{AccTile, FragPos, RowVec, ThreadPos};
use super::fwd::io::{QFragments, QOperand};
use super::gemm::{mma_abt, mma_pb};
use super::ptx;
use super::softmax::{OnlineSoftmax, Tuning};
use super::tile::{LaneOffsets, SmemTile};
use crate::block::BlockInfo;
use crate::config::{DECODE_WARP_KEYS, MMA_M};
use crate::mask::AttnMask;
use crate::params::DecodeParams;

/// `ln 2`.
const LN_2: f32 = core::f32::consts::LN_2;

/// Keys per warp step, as a `u32`.
const STEP: u32 = DECODE_WARP_KEYS as u32;

/// The decode kernel body for any mask type `M`; see the module docs. Const parameters: `D`
/// compiled head dim, `PITCH` shared row length, `BM = 16·MT` packed rows per block, `WARPS`,
/// `STAGES` ring depth per warp, `Q_IN_REGS`, and the derived `K_STEPS = D/16`,
/// `D_TILES = D/8`.
///
/// # Safety
/// Launched with grid `(num_splits · row_tiles, heads_kv, batch)`, `32·WARPS` threads and
/// `DecodeTile::smem_bytes()` bytes of dynamic shared memory, on parameters the host
/// validated (every page the block table names for a sequence's keys exists).
#[inline(always)]
pub unsafe fn flash_decode<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const PITCH: usize,
    const BM: usize,
    const MT: usize,
    const WARPS: usize,
    const STAGES: usize,
    const Q_IN_REGS: bool,
    const K_STEPS: usize,
    const D_TILES: usize,
>(
    p: &DecodeParams,
) {
    const {
        assert!(K_STEPS * 16 == D && D_TILES * 8 == D && PITCH >= D);
        assert!(BM == MMA_M * MT && STAGES >= 2 && STAGES <= 4);
    };
    let me = ThreadPos::current();
    let (x, kv_head, batch) = ptx::ctaid();
    let dims = &p.dims;
    let (split, row0) = (x / p.row_tiles, (x % p.row_tiles) * BM as u32);
    let group = dims.heads_q / dims.heads_kv;
    let rows_total = group * dims.seqlen_q;
    let seqlen_k = p.kv.seqlen_k(dims, batch);
    let block = BlockInfo {
        batch,
        head: kv_head * group,
        kv_head,
        row0: 0,
        seqlen_q: dims.seqlen_q,
        seqlen_k,
    };
    let mask = M::new(&p.mask, &block);

    // This split's steps of 16 keys, and this warp's share: steps first + WARPS·j.
    let key_begin = split * p.split_keys;
    let key_end = seqlen_k.min(key_begin.saturating_add(p.split_keys));
    let step_end = if key_end > key_begin {
        key_end.div_ceil(STEP)
    } else {
        0
    };
    let first = key_begin / STEP + me.warp;
    let steps = if first < step_end {
        (step_end - first).div_ceil(WARPS as u32)
    } else {
        0
    };

    let smem = ptx::dyn_smem_base();
    let q_tile = SmemTile::<BM, PITCH>::at(smem);
    let ring = Ring::<PITCH, STAGES>::of_warp(smem + SmemTile::<BM, PITCH>::BYTES, me.warp);
    let q_src = p.q.ptr as *const u16;
    q_tile.load_rows_async::<D, WARPS>(
        |r| {
            let packed = row0 + r as u32;
            (packed < rows_total).then(|| {
                let (token, head) = (packed / group, kv_head * group + packed % group);
                q_src.add(p.q.strides.offset(batch, token, head) as usize)
            })
        },
        dims.head_dim,
        me.tid,
    );
    ptx::cp_async_commit_group();
    let kv = KvStream {
        p,
        batch,
        kv_head,
        seqlen_k,
        first,
        steps,
        lane: me.lane,
    };
    // Lane `l` holds the page of the warp's step `32·i + l` (batch `i` of the block table),
    // and of step `32·(i + 1) + l` in `pages_next`: each batch is loaded 32 steps before its
    // first use, so no step waits on a block-table read.
    let mut pages = kv.pages::<WARPS>(0);
    let mut pages_next = kv.pages::<WARPS>(32);
    for j in 0..STAGES as u32 - 1 {
        kv.load::<D, WARPS, PITCH, STAGES>(ring, j, pages);
        ptx::cp_async_commit_group();
    }
    wait_all_but::<STAGES>(STAGES - 1); // the Q tile (the oldest group) landed
    if p.scale_log2 < 0.0 {
        q_tile.negate_own::<D, WARPS>(me.tid); // see `fwd::io::FwdSmem::load_q_and_first_kv`
    }
    ptx::bar_sync();

    let scale = p.scale_log2.abs();
    let lanes = LaneOffsets::new::<PITCH>(me.lane);
    let pos = FragPos::of(me.lane);
    let q_frags = QFragments::<MT, K_STEPS, Q_IN_REGS>::load(q_tile, &lanes, 0);
    // Token of each accumulator row (rows past the packed rows are never stored).
    let tokens = RowVec::<u32, MT>::from_fn(|mt, r| (row0 + pos.row(mt, r)) / group);
    // ALiBi slope of each accumulator row's head (rows of one block span the group's heads).
    let slopes = RowVec::<f32, MT>::from_fn(|mt, r| {
        let head = kv_head * group + (row0 + pos.row(mt, r)) % group;
        if M::MODIFIES_SCORES {
            M::slope(&p.mask, batch, head)
        } else {
            0.0
        }
    });
    let mut o = AccTile::<MT, D_TILES>::zero();
    let mut softmax = OnlineSoftmax::<MT>::new();
    for j in 0..steps {
        wait_all_but::<STAGES>(STAGES - 2); // step j landed (this lane's copies)
        ptx::bar_warp_sync(); // ... and every lane's; all lanes are done with step j − 1
        let next = j + STAGES as u32 - 1;
        if next % 32 == 0 {
            pages = pages_next;
            pages_next = kv.pages::<WARPS>(next + 32);
        }
        kv.load::<D, WARPS, PITCH, STAGES>(ring, next, pages);
        ptx::cp_async_commit_group();
        let key0 = STEP * (first + j * WARPS as u32);
        let (k, v) = ring.stage(j % STAGES as u32);
        let lanes = lanes.step_local();
        let q = QOperand {
            frags: &q_frags,
            tile: q_tile,
            m0: 0,
        };
        let mut s = AccTile::<MT, 2>::zero();
        mma_abt::<E, MT, 2, K_STEPS, DECODE_WARP_KEYS, PITCH>(&mut s, &q, k, &lanes);
        let pos = FragPos::of(ptx::opaque_u32(me.lane));
        if M::MODIFIES_SCORES && mask.modifies_scores() {
            // One branch per step on the cap, none per score.
            if mask.capped() {
                modify_scores::<M, true, MT>(&mut s, &mask, (&tokens, &slopes), key0, pos);
            } else {
                modify_scores::<M, false, MT>(&mut s, &mask, (&tokens, &slopes), key0, pos);
            }
        }
        let visible = |mt: usize, r: usize, nt: usize, c: usize| {
            mask.visible(tokens.0[mt][r], key0 + pos.col(nt, c))
        };
        let rescale = if mask.tile_needs_mask(0, dims.seqlen_q, key0 / STEP, STEP) {
            softmax.update::<true, 2>(&mut s, scale, visible, Tuning::PLAIN)
        } else {
            softmax.update::<false, 2>(&mut s, scale, visible, Tuning::PLAIN)
        };
        if let Some(rescale) = rescale {
            o.scale_rows(&rescale);
        }
        mma_pb::<E, MT, 2, D_TILES, DECODE_WARP_KEYS, PITCH>(&mut o, &s, v, &lanes, 0);
    }
    ptx::cp_async_wait_group::<0>();
    ptx::bar_sync(); // every warp is done with the rings: the merge area reuses them

    let merge = MergeArea::<BM, D, WARPS>::at(smem + SmemTile::<BM, PITCH>::BYTES);
    merge.put(me.warp, pos, &o, &softmax);
    ptx::bar_sync();
    let out = Output {
        p,
        batch,
        kv_head,
        group,
        split,
    };
    merge.finish::<E>(&out, row0, rows_total, me.tid);
}

/// `cp.async.wait_group` with a run-time count (folded: `STAGES` is a constant).
#[inline(always)]
unsafe fn wait_all_but<const STAGES: usize>(pending: usize) {
    match pending {
        0 => ptx::cp_async_wait_group::<0>(),
        1 => ptx::cp_async_wait_group::<1>(),
        2 => ptx::cp_async_wait_group::<2>(),
        _ => ptx::cp_async_wait_group::<3>(),
    }
}

/// One warp's ring of K/V buffers: `STAGES` × (K `[16][PITCH]`, V `[16][PITCH]`).
#[derive(Clone, Copy)]
struct Ring<const PITCH: usize, const STAGES: usize> {
    base: u32,
}

impl<const PITCH: usize, const STAGES: usize> Ring<PITCH, STAGES> {
    const TILE: u32 = SmemTile::<DECODE_WARP_KEYS, PITCH>::BYTES;

    /// Warp `warp`'s ring, the rings starting at shared address `rings`.
    #[inline(always)]
    fn of_warp(rings: u32, warp: u32) -> Self {
        Self {
            base: rings + warp * STAGES as u32 * 2 * Self::TILE,
        }
    }

    /// The K and V buffers of stage `stage`.
    #[inline(always)]
    fn stage(
        self,
        stage: u32,
    ) -> (
        SmemTile<DECODE_WARP_KEYS, PITCH>,
        SmemTile<DECODE_WARP_KEYS, PITCH>,
    ) {
        let k = self.base + 2 * stage * Self::TILE;
        (SmemTile::at(k), SmemTile::at(k + Self::TILE))
    }
}

/// A warp's stream of key steps from the cache.
struct KvStream<'a> {
    p: &'a DecodeParams,
    batch: u32,
    kv_head: u32,
    seqlen_k: u32,
    /// The warp's first step (in units of 16 keys).
    first: u32,
    /// Steps the warp takes.
    steps: u32,
    lane: u32,
}

impl KvStream<'_> {
    /// The block-table entries of the warp's steps `j0 .. j0 + 32`, entry `j0 + l` in lane `l`
    /// (one coalesced load per 32 steps instead of a dependent load before each step's
    /// copies), unclamped, so that nothing waits for the load until [`KvStream::load`] uses
    /// it; 0 for a contiguous cache or past the warp's steps.
    #[inline(always)]
    unsafe fn pages<const WARPS: usize>(&self, j0: u32) -> u32 {
        let kv = &self.p.kv;
        let j = j0 + self.lane;
        if kv.block_table == 0 || j >= self.steps {
            return 0;
        }
        let key = STEP * (self.first + j * WARPS as u32);
        kv.table_entry(self.batch, key) as u32
    }

    /// Starts the copies of the warp's step `j` into its buffer `j % STAGES` (nothing past the
    /// warp's last step; keys past the sequence are zero-filled, not read). Within a step the
    /// keys are consecutive rows of one page; `pages` is [`KvStream::pages`] of the batch of 32
    /// steps holding `j`.
    #[inline(always)]
    unsafe fn load<const D: usize, const WARPS: usize, const PITCH: usize, const STAGES: usize>(
        &self,
        ring: Ring<PITCH, STAGES>,
        j: u32,
        pages: u32,
    ) {
        if j >= self.steps {
            return;
        }
        let p = self.p;
        let key0 = STEP * (self.first + j * WARPS as u32);
        let valid = self.seqlen_k - key0;
        let (entry, row) = if p.kv.block_table == 0 {
            (self.batch, key0)
        } else {
            let entry = ptx::shfl_sync_idx(f32::from_bits(pages), j % 32).to_bits();
            (p.kv.clamp_page(entry as i32), key0 % p.kv.page_size)
        };
        let (k, v) = ring.stage(j % STAGES as u32);
        let k_src =
            (p.k.ptr as *const u16).add(p.k.strides.offset(entry, row, self.kv_head) as usize);
        let v_src =
            (p.v.ptr as *const u16).add(p.v.strides.offset(entry, row, self.kv_head) as usize);
        k.load_async::<D, 1>(k_src, p.k.strides.row, valid, p.dims.head_dim, self.lane);
        v.load_async::<D, 1>(v_src, p.v.strides.row, valid, p.dims.head_dim, self.lane);
    }
}

/// The merge area: each warp's f32 O `[BM][D]`, then the row maxima `[WARPS][BM]` and sums
/// `[WARPS][BM]`.
struct MergeArea<const BM: usize, const D: usize, const WARPS: usize> {
    base: u32,
}

/// Where the merged rows go.
struct Output<'a> {
    p: &'a DecodeParams,
    batch: u32,
    kv_head: u32,
    group: u32,
    split: u32,
}

/// Four f32, for one 16-byte store.
#[repr(C, align(16))]
struct F32x4([f32; 4]);

/// Two u32, for one 8-byte store.
#[repr(C, align(8))]
struct U32x2([u32; 2]);

impl<const BM: usize, const D: usize, const WARPS: usize> MergeArea<BM, D, WARPS> {
    const O_BYTES: u32 = (BM * D * 4) as u32;

    #[inline(always)]
    fn at(base: u32) -> Self {
        Self { base }
    }

    #[inline(always)]
    fn o_addr(&self, warp: u32, row: u32, col: u32) -> u32 {
        self.base + warp * Self::O_BYTES + (row * D as u32 + col) * 4
    }

    #[inline(always)]
    fn m_addr(&self, warp: u32, row: u32) -> u32 {
        self.base + WARPS as u32 * Self::O_BYTES + (warp * BM as u32 + row) * 4
    }

    #[inline(always)]
    fn l_addr(&self, warp: u32, row: u32) -> u32 {
        self.m_addr(warp, row) + (WARPS * BM * 4) as u32
    }

    /// Writes warp `warp`'s unnormalised O and its row statistics.
    ///
    /// # Safety
    /// The whole warp calls it, after the barrier that frees the rings.
    #[inline(always)]
    unsafe fn put<const MT: usize, const D_TILES: usize>(
        &self,
        warp: u32,
        pos: FragPos,
        o: &AccTile<MT, D_TILES>,
        softmax: &OnlineSoftmax<MT>,
    ) {
        let (m, l) = softmax.partial();
        for mt in 0..MT {
            for r in 0..2 {
                let row = pos.row(mt, r);
                for dt in 0..D_TILES {
                    let [a, b] = o.pair(mt, r, dt);
                    let at = self.o_addr(warp, row, pos.col(dt, 0));
                    ptx::st_shared_f32(at, a);
                    ptx::st_shared_f32(at + 4, b);
                }
                if pos.leads_quad() {
                    ptx::st_shared_f32(self.m_addr(warp, row), m.0[mt][r]);
                    ptx::st_shared_f32(self.l_addr(warp, row), l.0[mt][r]);
                }
            }
        }
    }

    /// Merges the warps' states and writes every packed row `< rows_total` of the block
    /// (from `row0`): four columns per thread and pass. A row no warp saw a key for gets
    /// O = 0 and LSE = −∞; NaN stays NaN.
    ///
    /// # Safety
    /// Every thread calls it after the barrier that follows [`MergeArea::put`].
    #[inline(always)]
    unsafe fn finish<E: Elem>(&self, out: &Output, row0: u32, rows_total: u32, tid: u32) {
        let quads = (D / 4) as u32;
        let head_dim = out.p.dims.head_dim;
        let mut idx = tid;
        while idx < BM as u32 * quads {
            let (row, col) = (idx / quads, 4 * (idx % quads));
            idx += 32 * WARPS as u32;
            if row0 + row >= rows_total || col >= head_dim {
                continue;
            }
            let mut m = f32::NEG_INFINITY;
            for w in 0..WARPS as u32 {
                m = m.max(ptx::ld_shared_f32(self.m_addr(w, row)));
            }
            let (mut acc, mut l) = ([0.0f32; 4], 0.0f32);
            if m != f32::NEG_INFINITY {
                for w in 0..WARPS as u32 {
                    let f = ptx::ex2_approx_ftz(ptx::ld_shared_f32(self.m_addr(w, row)) - m);
                    l += f * ptx::ld_shared_f32(self.l_addr(w, row));
                    let v = ptx::ld_shared_v4(self.o_addr(w, row, col));
                    // Index loops: an iterator over the array put it on the stack.
                    #[allow(clippy::needless_range_loop)]
                    for i in 0..4 {
                        acc[i] += f * f32::from_bits(v[i]);
                    }
                }
            }
            let (inv, lse) = if l != 0.0 {
                (1.0 / l, (m + ptx::lg2_approx_ftz(l)) * LN_2) // NaN l: NaN both
            } else {
                (0.0, f32::NEG_INFINITY)
            };
            let o = [acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv];
            out.write::<E>(row0 + row, col, o, lse);
        }
    }
}

impl Output<'_> {
    /// Writes four columns from `col` of packed row `packed`, and its LSE with the first
    /// column: to O and LSE (one split) or to the split's partials.
    #[inline(always)]
    unsafe fn write<E: Elem>(&self, packed: u32, col: u32, o: [f32; 4], lse: f32) {
        let p = self.p;
        let (token, head) = (
            packed / self.group,
            self.kv_head * self.group + packed % self.group,
        );
        if p.num_splits == 1 {
            let at = p.o.strides.offset(self.batch, token, head) + col as u64;
            let dst = (p.o.ptr as *mut u16).add(at as usize) as *mut U32x2;
            *dst = U32x2([E::pack(o[0], o[1]), E::pack(o[2], o[3])]);
            if col == 0 {
                let at = p.lse.offset(self.batch, head, token);
                *(p.lse.ptr as *mut f32).add(at as usize) = lse;
            }
        } else {
            let row = p.part_row(self.split, self.batch, head, token);
            let at = row * p.dims.head_dim as u64 + col as u64;
            *((p.o_part as *mut f32).add(at as usize) as *mut F32x4) = F32x4(o);
            if col == 0 {
                *(p.lse_part as *mut f32).add(row as usize) = lse;
            }
        }
    }
}

/// Replaces the step's raw scores by the mask's logits ([`AttnMask::score_as`] with `CAP`):
/// row `(mt, r)` is token `tokens` of the head whose ALiBi slope is `slopes`, column `(nt, c)`
/// key `key0 + pos.col(nt, c)`.
#[inline(always)]
fn modify_scores<M: AttnMask, const CAP: bool, const MT: usize>(
    s: &mut AccTile<MT, 2>,
    mask: &M,
    (tokens, slopes): (&RowVec<u32, MT>, &RowVec<f32, MT>),
    key0: u32,
    pos: FragPos,
) {
    s.for_each_mut(|mt, r, nt, c, x| {
        let key = key0 + pos.col(nt, c);
        *x = mask.score_as::<CAP>(tokens.0[mt][r], key, *x, slopes.0[mt][r]);
    });
}
