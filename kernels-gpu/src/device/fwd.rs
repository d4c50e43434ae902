//! Forward attention: FlashAttention 2, Algorithm 1 with the query-outer loop order.
//!
//! One block computes `O[row0 .. row0 + BM]` for one (head, batch):
//!
//! ```text
//! load Q tile                                  global → shared (cp.async) [→ registers]
//! m = −∞, l = 0, O = 0                         registers
//! for each visible K/V tile j, last to first:  (masked tiles come first)
//!     prefetch tile j−1 into the other buffer  cp.async, overlaps this step
//!     S = Q·Kⱼᵀ                                mma.sync m16n8k16, f32 accumulators
//!     mask S (diagonal and tail tiles only)
//!     m' = max(m, c·rowmax S)                  online softmax in base 2, c = scale·log2(e) > 0
//!                                              (a negative scale is folded into Q)
//!     P = 2^(c·S − m')                         one FFMA + ex2 per score
//!     l = 2^(m − m')·l + rowsum P;  O = 2^(m − m')·O   (O skipped when no row max moved)
//!     O += P·Vⱼ                                P converted to 16 bits in registers: it is
//!                                              already the A fragment of the next mma
//! O /= l;  LSE = (m + log2 l)·ln 2             one write of O and LSE per row
//! ```
//!
//! Tile shape: `BM = 16·MT·WARPS` query rows per block; each warp owns `MT` tiles of 16 rows
//! (every K/V fragment loaded from shared memory feeds `MT` mmas); `BN` keys per K/V tile;
//! `D` is the compiled head dim. Shared memory (dynamic, see
//! [`crate::config::FwdTile::smem_bytes`]): Q `[BM][PITCH]`, then two buffers of K `[BN][PITCH]`
//! and V `[BN][PITCH]`, all swizzled. Registers per thread: O `MT × D/8 × 4` f32, S
//! `MT × BN/8 × 4` f32, Q fragments `MT × D/16 × 4` u32 (only when `Q_IN_REGS`; else re-read
//! with `ldmatrix` at every step), m and l for `2·MT` rows.
//! Sync points: one `bar.sync` per K/V tile (after its `cp.async` group completes; it also
//! frees the buffer the prefetch then overwrites).

use super::elem::Elem;
use super::ptx;
use super::tile::{quad_max, quad_sum, FragPos, LaneOffsets, SmemTile};
use crate::mask::AttnMask;
use crate::params::FwdParams;

/// `ln 2`: converts the base-2 LSE kept by the kernel to the natural log of the API.
const LN_2: f32 = core::f32::consts::LN_2;

/// The online-softmax state of the `2·MT` rows a thread holds (rows `g` and `g + 8` of each of
/// its warp's m-tiles), and the thread's slice of their output accumulator.
struct RowState<const MT: usize, const D_TILES: usize> {
    /// Running maximum of the scaled scores, base 2 (quad-uniform).
    m: [[f32; 2]; MT],
    /// Running sum of `2^(s − m)` over this thread's columns only (summed over the quad at the
    /// end).
    l: [[f32; 2]; MT],
    /// Output accumulator: per m-tile, `D/8` tiles of 16 × 8.
    o: [[[f32; 4]; D_TILES]; MT],
}

/// The shared-memory tiles one step reads.
#[derive(Clone, Copy)]
struct StepTiles<const BM: usize, const BN: usize, const PITCH: usize> {
    q: SmemTile<BM, PITCH>,
    k: SmemTile<BN, PITCH>,
    v: SmemTile<BN, PITCH>,
}

/// The forward kernel body for any mask policy `M` (tile range + score predicate); see the
/// module docs. Const parameters: `D` compiled head dim,
/// `PITCH` shared row length, `BM`/`BN` tile rows/keys, `WARPS`, `MT` m-tiles per warp,
/// `Q_IN_REGS`, and the derived counts `K_STEPS = D/16`, `D_TILES = D/8`, `N_TILES = BN/8`
/// (stable Rust cannot compute array lengths from const parameters, so the entry macro passes
/// them and this checks them).
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
>(
    p: &FwdParams,
    mask: M,
) {
    const {
        assert!(K_STEPS * 16 == D && D_TILES * 8 == D && N_TILES * 8 == BN);
        assert!(BM == WARPS * 16 * MT && BN % 16 == 0 && D % 16 == 0 && PITCH >= D);
    };
    let tid = ptx::tid_x();
    let warp = tid / 32;
    let lane = tid % 32;
    let pos = FragPos::of(lane);
    let (bx, head, batch) = ptx::ctaid();
    // Blocks whose rows see more keys start first, so the last wave of the grid holds the
    // short ones.
    let m_block = if mask.later_rows_see_more() {
        ptx::nctaid_x() - 1 - bx
    } else {
        bx
    };
    let row0 = m_block * BM as u32;
    let kv_head = head / (p.heads_q / p.heads_kv);
    // First row (within the block) of this warp's m-tiles.
    let warp_m0 = warp as usize * 16 * MT;
    let mut rows = [[0u32; 2]; MT];
    for (mt, r) in rows.iter_mut().enumerate() {
        let base = row0 + (warp_m0 + 16 * mt) as u32;
        *r = [base + pos.row(0), base + pos.row(2)];
    }

    let q = (p.q as *const u16).add(p.q_strides.offset(batch, row0, head) as usize);
    let k = (p.k as *const u16).add(p.k_strides.offset(batch, 0, kv_head) as usize);
    let v = (p.v as *const u16).add(p.v_strides.offset(batch, 0, kv_head) as usize);

    let mut st = RowState::<MT, D_TILES> {
        m: [[f32::NEG_INFINITY; 2]; MT],
        l: [[0.0; 2]; MT],
        o: [[[0.0; 4]; D_TILES]; MT],
    };

    let (n_start, n_end) = mask.key_tiles(row0, BM as u32, BN as u32);
    if n_start < n_end {
        let base = ptx::dyn_smem_base();
        let q_tile = SmemTile::<BM, PITCH>::at(base);
        let kv_base = base + SmemTile::<BM, PITCH>::BYTES;
        let kv_bytes = SmemTile::<BN, PITCH>::BYTES;
        let tiles = |buf: u32| StepTiles {
            q: q_tile,
            k: SmemTile::<BN, PITCH>::at(kv_base + 2 * buf * kv_bytes),
            v: SmemTile::<BN, PITCH>::at(kv_base + (2 * buf + 1) * kv_bytes),
        };
        let load_kv = |n: u32, buf: u32| {
            let key0 = n * BN as u32;
            let valid = p.seqlen_k - key0;
            let t = tiles(buf);
            let k_src = k.add(key0 as usize * p.k_strides.row as usize);
            let v_src = v.add(key0 as usize * p.v_strides.row as usize);
            t.k.load_async::<D, WARPS>(k_src, p.k_strides.row, valid, p.head_dim, tid);
            t.v.load_async::<D, WARPS>(v_src, p.v_strides.row, valid, p.head_dim, tid);
        };

        q_tile.load_async::<D, WARPS>(q, p.q_strides.row, p.seqlen_q - row0, p.head_dim, tid);
        load_kv(n_end - 1, 0);
        ptx::cp_async_commit_group();

        // softmax(s·c) with c < 0 is softmax(s'·|c|) for s' = (−Q)·Kᵀ: negate this thread's
        // part of the Q tile once, so every step sees a positive scale.
        let negate_q = p.scale_log2 < 0.0;
        let scale_log2 = p.scale_log2.abs();
        let lanes = LaneOffsets::new::<PITCH>(lane);
        let mut q_frag = [[[0u32; 4]; K_STEPS]; MT];
        // Q and the first K/V tile have landed; publish them.
        ptx::cp_async_wait_group::<0>();
        if negate_q {
            q_tile.negate_own::<D, WARPS>(tid);
        }
        ptx::bar_sync();
        if Q_IN_REGS {
            for (mt, frags) in q_frag.iter_mut().enumerate() {
                for (ks, frag) in frags.iter_mut().enumerate() {
                    *frag = q_tile.load_a(&lanes, warp_m0 + 16 * mt, ks);
                }
            }
        }
        let mut buf = 0;
        let mut n = n_end - 1;
        loop {
            if n > n_start {
                load_kv(n - 1, buf ^ 1);
                ptx::cp_async_commit_group();
            }
            let step = Step {
                tiles: tiles(buf),
                mask: &mask,
                scale_log2,
                warp_m0,
                lane,
                lanes,
                rows,
                n,
            };
            if mask.tile_needs_mask(row0, BM as u32, n, BN as u32) {
                step.attend::<E, true, Q_IN_REGS, K_STEPS, D_TILES, N_TILES>(&mut st, &q_frag);
            } else {
                step.attend::<E, false, Q_IN_REGS, K_STEPS, D_TILES, N_TILES>(&mut st, &q_frag);
            }
            if n == n_start {
                break;
            }
            n -= 1;
            buf ^= 1;
            // The prefetched tile has landed, and every warp is done with the buffer the next
            // prefetch overwrites.
            ptx::cp_async_wait_group::<0>();
            ptx::bar_sync();
        }
    }
    store_output::<E, MT, D_TILES>(p, &mut st, batch, head, rows, pos);
}

/// One step of the key loop: the tiles to read and where this thread's rows and keys are.
struct Step<'a, M: AttnMask, const BM: usize, const BN: usize, const PITCH: usize, const MT: usize>
{
    tiles: StepTiles<BM, BN, PITCH>,
    /// The score policy (which keys each row sees).
    mask: &'a M,
    /// `|softmax_scale|·log2(e)` (a negative scale is folded into Q).
    scale_log2: f32,
    /// First row of this warp's m-tiles within the block.
    warp_m0: usize,
    lane: u32,
    /// This lane's `ldmatrix` offsets.
    lanes: LaneOffsets,
    /// Global query rows of the thread's accumulator rows, per m-tile.
    rows: [[u32; 2]; MT],
    /// Key tile index.
    n: u32,
}

impl<M: AttnMask, const BM: usize, const BN: usize, const PITCH: usize, const MT: usize>
    Step<'_, M, BM, BN, PITCH, MT>
{
    /// `S = Q·Kᵀ`, optional masking, the online-softmax update, and `O += P·V` for key tile
    /// `n`. `MASKED` selects the element-wise mask for diagonal and tail tiles; interior tiles
    /// skip it.
    #[inline(always)]
    unsafe fn attend<
        E: Elem,
        const MASKED: bool,
        const Q_IN_REGS: bool,
        const K_STEPS: usize,
        const D_TILES: usize,
        const N_TILES: usize,
    >(
        &self,
        st: &mut RowState<MT, D_TILES>,
        q_frag: &[[[u32; 4]; K_STEPS]; MT],
    ) {
        let lane = ptx::opaque_u32(self.lane);
        let lanes = self.lanes.step_local();
        let pos = FragPos::of(lane);
        let t = self.tiles;

        // S = Q·Kᵀ: MT × 16 × BN per warp.
        let mut s = [[[0.0f32; 4]; N_TILES]; MT];
        for ks in 0..K_STEPS {
            let mut a = [[0u32; 4]; MT];
            for (mt, a) in a.iter_mut().enumerate() {
                *a = if Q_IN_REGS {
                    q_frag[mt][ks]
                } else {
                    t.q.load_a(&lanes, self.warp_m0 + 16 * mt, ks)
                };
            }
            for np in 0..N_TILES / 2 {
                let b = t.k.load_b_pair_nk(&lanes, np * 16, ks);
                for mt in 0..MT {
                    E::mma(&mut s[mt][2 * np], a[mt], b[0]);
                    E::mma(&mut s[mt][2 * np + 1], a[mt], b[1]);
                }
            }
        }

        // Mask, take the row maxima of the raw scores, then scale them into base 2. The scale
        // is positive here (a negative one was folded into Q), so max and scaling commute and
        // the exponent below is one fused multiply-add per score.
        let scale = self.scale_log2;
        let key0 = self.n * BN as u32;
        let mut rescale = [[1.0f32; 2]; MT];
        let mut max_moved = false;
        for mt in 0..MT {
            let mut raw_max = [f32::NEG_INFINITY; 2];
            for (nt, tile) in s[mt].iter_mut().enumerate() {
                for (e, x) in tile.iter_mut().enumerate() {
                    if MASKED
                        && !self
                            .mask
                            .visible(self.rows[mt][e >> 1], key0 + nt as u32 * 8 + pos.col(e))
                    {
                        *x = f32::NEG_INFINITY;
                    }
                    raw_max[e >> 1] = raw_max[e >> 1].max(*x);
                }
            }
            let mut shift = [0.0f32; 2];
            for r in 0..2 {
                let tile_max = quad_max(raw_max[r]);
                // −∞ stays −∞ (also for a zero scale, where −∞·0 would be NaN).
                let tile_max = if tile_max == f32::NEG_INFINITY {
                    tile_max
                } else {
                    tile_max * scale
                };
                let m_new = st.m[mt][r].max(tile_max);
                // A row that has seen only masked keys keeps m = −∞; subtracting 0 instead
                // keeps 2^(−∞ − shift) = 0 rather than NaN.
                shift[r] = if m_new == f32::NEG_INFINITY {
                    0.0
                } else {
                    m_new
                };
                max_moved |= m_new != st.m[mt][r];
                rescale[mt][r] = ptx::ex2_approx_ftz(st.m[mt][r] - shift[r]);
                st.m[mt][r] = m_new;
            }

            // P = 2^(S·scale − m) and the row sums.
            let mut row_sum = [0.0f32; 2];
            for tile in s[mt].iter_mut() {
                for (e, x) in tile.iter_mut().enumerate() {
                    let p = ptx::ex2_approx_ftz(ptx::fma_rn_f32(*x, scale, -shift[e >> 1]));
                    // Masked scores are −∞; with a zero scale −∞·0 is NaN, so zero them here.
                    *x = if MASKED && *x == f32::NEG_INFINITY {
                        0.0
                    } else {
                        p
                    };
                    row_sum[e >> 1] += *x;
                }
            }
            for r in 0..2 {
                st.l[mt][r] = st.l[mt][r] * rescale[mt][r] + row_sum[r];
            }
        }
        // Rescale O only when some row's maximum moved (the factor is exactly 1 otherwise);
        // late in a long key loop most steps skip it. The vote keeps the branch warp-uniform.
        if ptx::vote_any_sync(max_moved) {
            for (o, rescale) in st.o.iter_mut().zip(&rescale) {
                for tile in o.iter_mut() {
                    for (e, x) in tile.iter_mut().enumerate() {
                        *x *= rescale[e >> 1];
                    }
                }
            }
        }

        // O += P·V. Two adjacent 16×8 accumulator tiles of S are exactly one 16×16 A fragment.
        for kk in 0..N_TILES / 2 {
            let mut a = [[0u32; 4]; MT];
            for (mt, a) in a.iter_mut().enumerate() {
                let (s0, s1) = (&s[mt][2 * kk], &s[mt][2 * kk + 1]);
                *a = [
                    E::pack(s0[0], s0[1]),
                    E::pack(s0[2], s0[3]),
                    E::pack(s1[0], s1[1]),
                    E::pack(s1[2], s1[3]),
                ];
            }
            for dp in 0..D_TILES / 2 {
                let b = t.v.load_b_pair_kn(&lanes, kk * 16, dp);
                for mt in 0..MT {
                    E::mma(&mut st.o[mt][2 * dp], a[mt], b[0]);
                    E::mma(&mut st.o[mt][2 * dp + 1], a[mt], b[1]);
                }
            }
        }
    }
}

/// Normalises O by the row sums and writes O (16-bit, 4 bytes per store) and LSE (natural log).
/// A row that saw no key has l = 0: it gets O = 0 and LSE = −∞.
#[inline(always)]
unsafe fn store_output<E: Elem, const MT: usize, const D_TILES: usize>(
    p: &FwdParams,
    st: &mut RowState<MT, D_TILES>,
    batch: u32,
    head: u32,
    rows: [[u32; 2]; MT],
    pos: FragPos,
) {
    for mt in 0..MT {
        for r in 0..2 {
            let l = quad_sum(st.l[mt][r]);
            let (inv, lse) = if l > 0.0 {
                (1.0 / l, (st.m[mt][r] + ptx::lg2_approx_ftz(l)) * LN_2)
            } else {
                (0.0, f32::NEG_INFINITY)
            };
            let row = rows[mt][r];
            if row >= p.seqlen_q {
                continue;
            }
            let o = (p.o as *mut u16).add(p.o_strides.offset(batch, row, head) as usize);
            for (dt, tile) in st.o[mt].iter().enumerate() {
                let col = dt as u32 * 8 + pos.col(2 * r);
                if col < p.head_dim {
                    let packed = E::pack(tile[2 * r] * inv, tile[2 * r + 1] * inv);
                    *(o.add(col as usize) as *mut u32) = packed;
                }
            }
            if pos.t == 0 {
                let at = batch as u64 * p.lse_batch_stride
                    + head as u64 * p.lse_head_stride
                    + row as u64;
                *(p.lse as *mut f32).add(at as usize) = lse;
            }
        }
    }
}
