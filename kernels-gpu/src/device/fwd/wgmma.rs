//! Forward attention on Hopper's warpgroup products (sm_90a): the same algorithm, masks,
//! softmax, dropout and epilogue as [`super::flash_fwd`], with both products on `wgmma`.
//!
//! Block: `BM = 128` query rows, 8 warps = 2 warpgroups of 64 rows each; warp `w` owns rows
//! `16w .. 16w + 16`, in the `mma.m16n8k16` accumulator layout that `wgmma` shares, so every
//! register-tile layer (softmax, masks, dropout, the O store) is the one of the `mma.sync`
//! kernels.
//!
//! ```text
//! load Q, tiles 0 and 1                          global → shared (cp.async, all threads)
//! S = Q·K₀ᵀ; P₀ ← online softmax of S           wgmma m64n128k16 (Q, K from shared memory)
//! for tile i + 1 = 1, 2, … the mask visits:
//!     load tile i + 2 into its stage             cp.async, all threads
//!     issue S = Q·Kᵢ₊₁ᵀ, then O += Pᵢ·Vᵢ          wgmma; P from registers, V (MN-major) from
//!                                                shared memory, one m64n64k16 per 64 columns
//!     wait for S; Pᵢ₊₁ ← online softmax of S     registers, as the mma.sync kernels, while
//!     [· dropout]                                O += Pᵢ·Vᵢ runs on the tensor cores
//!     wait for O; O ·= the softmax's rescale
//!     wait for tile i + 2; fence.proxy.async; bar.sync
//! O += P_last·V_last; O /= l; LSE                one write per row
//! ```
//!
//! Shared memory (dynamic, 1024-byte aligned, [`crate::config::FwdTile::smem_bytes`]): Q
//! `[BM][D]`, then a ring of `STAGES = 3` (K `[BN][D]`, V `[BN][D]`) stages, each tile in the
//! layout of [`crate::gmma`]; tile `i` lives in stage `i % 3`, so tile `i + 2` loads while K of
//! tile `i + 1` and V of tile `i` are read. Registers per thread: S `BN/2` f32, P `BN/4`
//! packed, O `D/2` f32, m and l of 2 rows. Sync points: the `cp.async` copies are made
//! visible to the tensor cores' (async) proxy by `fence.proxy.async` in each copying thread,
//! then one `bar.sync` per key tile, which also frees the stage the next load overwrites
//! (every warpgroup has waited for its products by then).

use super::io::{store_output, KvSource};
use super::KeyTile;
use crate::block::BlockInfo;
use crate::config::MMA_M;
use crate::device::dropout::rng_for;
use crate::device::elem::Elem;
use crate::device::frag::{AccTile, FragPos, PackedTile, RegFragments, RowVec, ThreadPos};
use crate::device::ptx;
use crate::device::softmax::OnlineSoftmax;
use crate::device::tile::GmmaTile;
use crate::gmma::BLOCK_COLS;
use crate::mask::AttnMask;
use crate::params::FwdParams;
use crate::rng::DropoutRng;
use core::marker::PhantomData;

/// Query rows per block.
pub const BM: usize = 128;
/// Warps per block (two warpgroups).
pub const WARPS: usize = 8;
/// Rows of one warpgroup's products.
const WG_ROWS: usize = 64;

/// The forward kernel body on `wgmma`; see the module docs. Const parameters: `D` compiled
/// head dim (a multiple of 64), `BN` keys per tile (128: the `m64n128k16` product),
/// `D_TILES = D/8`, `N_TILES = BN/8`, `STAGES` (3), `DROPOUT`.
///
/// # Safety
/// sm_90a only. Launched with grid `(ceil(seqlen_q / 128), heads_q, batch)`, 256 threads and
/// `FwdTile::smem_bytes()` bytes of dynamic shared memory, on parameters the host validated.
#[inline(always)]
pub unsafe fn flash_fwd_wgmma<
    E: Elem,
    M: AttnMask,
    const D: usize,
    const BN: usize,
    const D_TILES: usize,
    const N_TILES: usize,
    const STAGES: usize,
    const DROPOUT: bool,
>(
    p: &FwdParams,
) {
    const {
        assert!(D % BLOCK_COLS == 0 && D_TILES * 8 == D && N_TILES * 8 == BN && BN == 128);
        assert!(STAGES == 3); // tile i + 2 loads while tiles i (V) and i + 1 (K) are read
    };
    let base = ptx::dyn_smem_base();
    if base % 1024 != 0 {
        core::arch::nvptx::trap(); // the 128-byte swizzle atoms must be aligned
    }
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
    let warp_m0 = me.warp as usize * MMA_M; // first row of this warp
    let wg_m0 = (me.warp as usize / 4) * WG_ROWS; // first row of this warpgroup
    let mut o = AccTile::<1, D_TILES>::zero();
    let mut softmax = OnlineSoftmax::<1>::new();

    let (row0, bm, bn) = (block.row0, BM as u32, BN as u32);
    if let Some(first) = mask.first_key_tile(row0, bm, bn) {
        let pos = FragPos::of(me.lane);
        let rows = RowVec::<u32, 1>::from_fn(|_, r| row0 + pos.row(0, r) + warp_m0 as u32);
        let pipe = Pipeline::<E, M, D, BN, STAGES, DROPOUT> {
            q: GmmaTile::at(base),
            kv_base: base + GmmaTile::<BM, D>::BYTES,
            kv: KvSource::new(p, &block),
            tid: me.tid,
            lane: me.lane,
            wg_m0,
            mask: &mask,
            rows,
            row0,
            rng: rng_for(&p.dropout, block.batch, block.head, p.dims.heads_q),
            scale: p.scale_log2.abs(),
            elem: PhantomData,
        };
        let q_src = (p.q.ptr as *const u16).add(block.query_offset(&p.q, row0) as usize);
        let q_rows = block.rows_left();
        pipe.q
            .load_async::<WARPS>(q_src, p.q.strides.row, q_rows, p.dims.head_dim, me.tid);
        pipe.load(0, first);
        let mut next = mask.next_key_tile(row0, bm, bn, first);
        if let Some(second) = next {
            pipe.load(1, second);
            ptx::cp_async_wait_group::<1>(); // Q and the first tile
        } else {
            ptx::cp_async_wait_group::<0>();
        }
        if p.scale_log2 < 0.0 {
            pipe.q.negate_own::<WARPS>(me.tid); // softmax(s·c), c < 0, is softmax((−Q)·Kᵀ·|c|)
        }
        ptx::fence_proxy_async_shared_cta();
        ptx::bar_sync();

        let mut s = AccTile::<1, N_TILES>::zero();
        ptx::wgmma_fence();
        pipe.issue_s(&mut s, 0);
        ptx::wgmma_wait_group::<0>();
        ptx::wgmma_fence_operands(s.tiles_mut::<N_TILES>(0, 0));
        pipe.softmax(&mut s, &mut softmax, first); // O is still zero: nothing to rescale
        let mut p_cur = PackedTile::<1, N_TILES>::pack::<E>(&s);
        if next.is_some() {
            ptx::cp_async_wait_group::<0>();
            ptx::fence_proxy_async_shared_cta();
            ptx::bar_sync(); // the second tile landed
        }
        // Tile `i` (stage i) has its P in `p_cur`; tile `i + 1` is in shared memory.
        let mut i = 0u32;
        while let Some(n) = next {
            let after = mask.next_key_tile(row0, bm, bn, n);
            if let Some(after) = after {
                pipe.load(i + 2, after); // its stage's last reader finished before the last barrier
            }
            // S of tile i + 1 and O += P·V of tile i, both on the tensor cores; the softmax of
            // tile i + 1 runs while the second product does.
            ptx::wgmma_fence();
            pipe.issue_s(&mut s, i + 1);
            pipe.issue_pv(&mut o, &p_cur, i);
            ptx::wgmma_wait_group::<1>();
            ptx::wgmma_fence_operands(s.tiles_mut::<N_TILES>(0, 0));
            let factor = pipe.softmax(&mut s, &mut softmax, n);
            ptx::wgmma_wait_group::<0>();
            ptx::wgmma_fence_operands(o.tiles_mut::<D_TILES>(0, 0));
            if let Some(factor) = factor {
                o.scale_rows(&factor); // O ·= 2^(m − m'), now that P·V of tile i is in
            }
            p_cur = PackedTile::<1, N_TILES>::pack::<E>(&s);
            if after.is_some() {
                ptx::cp_async_wait_group::<0>();
                ptx::fence_proxy_async_shared_cta();
                ptx::bar_sync(); // tile i + 2 landed; every warpgroup is done with tile i
            }
            i += 1;
            next = after;
        }
        ptx::wgmma_fence();
        pipe.issue_pv(&mut o, &p_cur, i);
        ptx::wgmma_wait_group::<0>();
        ptx::wgmma_fence_operands(o.tiles_mut::<D_TILES>(0, 0));
    }
    let o_scale = if DROPOUT { p.dropout.scale } else { 1.0 };
    let first_row = row0 + warp_m0 as u32;
    store_output::<E, M, 1, D_TILES>(p, &block, &mask, first_row, &o, &softmax, o_scale);
}

/// What a thread of the block needs to run the key loop: its tiles, its rows, the mask and the
/// dropout generator. Methods, not closures: a closure that LLVM leaves out of line moves the
/// register tiles it takes by reference to local memory.
struct Pipeline<'a, E, M, const D: usize, const BN: usize, const STAGES: usize, const DROPOUT: bool>
{
    q: GmmaTile<BM, D>,
    /// Shared address of stage 0's K tile.
    kv_base: u32,
    kv: KvSource,
    tid: u32,
    lane: u32,
    /// First row of the thread's warpgroup in the block.
    wg_m0: usize,
    mask: &'a M,
    rows: RowVec<u32, 1>,
    row0: u32,
    rng: DropoutRng,
    /// `|softmax_scale|·log2(e)`.
    scale: f32,
    elem: PhantomData<E>,
}

impl<
        E: Elem,
        M: AttnMask,
        const D: usize,
        const BN: usize,
        const STAGES: usize,
        const DROPOUT: bool,
    > Pipeline<'_, E, M, D, BN, STAGES, DROPOUT>
{
    /// The K and V tiles of the stage of tile `i` (the `i`-th tile of the loop).
    #[inline(always)]
    fn stage(&self, i: u32) -> (GmmaTile<BN, D>, GmmaTile<BN, D>) {
        let bytes = GmmaTile::<BN, D>::BYTES;
        let at = self.kv_base + (i % STAGES as u32) * 2 * bytes;
        (GmmaTile::at(at), GmmaTile::at(at + bytes))
    }

    /// Starts the copies of key tile `n` into the stage of tile `i`, as one group.
    #[inline(always)]
    unsafe fn load(&self, i: u32, n: u32) {
        let (k, v) = self.stage(i);
        self.kv.load_gmma::<D, WARPS, BN>(k, v, n, self.tid);
        ptx::cp_async_commit_group();
    }

    /// Issues and commits `S = Q·Kᵀ` of the stage of tile `i` for the warpgroup's 64 rows.
    #[inline(always)]
    unsafe fn issue_s<const NT: usize>(&self, s: &mut AccTile<1, NT>, i: u32) {
        let k = self.stage(i).0;
        for ks in 0..D / 16 {
            let (a, b) = (self.q.k_major(self.wg_m0, ks), k.k_major(0, ks));
            E::wgmma_n128_ss(s.tiles_mut::<16>(0, 0), a, b, ks > 0);
        }
        ptx::wgmma_commit_group();
    }

    /// Issues and commits `O += P·V` of the stage of tile `i`, P from registers, 64 columns of
    /// O per product.
    #[inline(always)]
    unsafe fn issue_pv<const NT: usize, const DT: usize>(
        &self,
        o: &mut AccTile<1, DT>,
        p: &PackedTile<1, NT>,
        i: u32,
    ) {
        let v = self.stage(i).1;
        for kk in 0..BN / 16 {
            let a = p.a_fragment::<E>(0, kk);
            for cb in 0..D / BLOCK_COLS {
                let acc = o.tiles_mut::<{ BLOCK_COLS / 8 }>(0, cb * BLOCK_COLS / 8);
                E::wgmma_n64_rs(acc, a, v.mn_major(kk, cb));
            }
        }
        ptx::wgmma_commit_group();
    }

    /// P (in place) from S of key tile `n`; returns the factor O's rows must be multiplied by,
    /// if a row maximum moved.
    #[inline(always)]
    unsafe fn softmax<const NT: usize>(
        &self,
        s: &mut AccTile<1, NT>,
        softmax: &mut OnlineSoftmax<1>,
        n: u32,
    ) -> Option<RowVec<f32, 1>> {
        let tile = KeyTile {
            mask: self.mask,
            rows: &self.rows,
            key0: n * BN as u32,
            lane: self.lane,
            scale: self.scale,
            rng: &self.rng,
        };
        let mut factor = None;
        if self
            .mask
            .tile_needs_mask(self.row0, BM as u32, n, BN as u32)
        {
            tile.scores_to_probabilities::<true, DROPOUT, NT>(s, softmax, &mut factor);
        } else {
            tile.scores_to_probabilities::<false, DROPOUT, NT>(s, softmax, &mut factor);
        }
        factor
    }
}
