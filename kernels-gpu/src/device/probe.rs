//! The `wgmma` layout probe: one warpgroup runs each warpgroup product shape the Hopper
//! forward and backward use, through the same wrappers, descriptors and tile layout, and writes every
//! accumulator element at the (row, column) the register-tile layer assigns it. The host
//! compares with a CPU product (`tests/tests/gpu_wgmma.rs`), so a wrong descriptor field,
//! swizzle or fragment mapping shows up as a wrong element.
//!
//! Block: 128 threads (one warpgroup); shared memory A `[64][64]`, B `[176][64]`, V `[128][128]`
//! in the layout of [`crate::gmma`] (62 KiB, see [`crate::config::PROBE_SMEM_BYTES`]). Sync points: the
//! `cp.async` wait, `fence.proxy.async`, one `bar.sync`, then each product's wait.

use super::elem::Elem;
use super::frag::{AccTile, FragPos, ThreadPos};
use super::ptx;
use super::tile::GmmaTile;
use crate::params::ProbeParams;

/// Rows of A, P, S and O.
const M: usize = 64;
/// Columns of A (the reduction of S).
const K: usize = 64;
/// Columns of V and O.
const DV: usize = 128;
/// Rows of V and of the `m64n128k16` product's B (the columns of S, the reduction of O).
const N: usize = 128;
/// Rows of B (the columns of the `m64n176k16` product's S).
const N_WIDE: usize = 176;

/// The probe body; see the module docs.
///
/// # Safety
/// sm_90a only; launched with one block of 128 threads and [`crate::config::PROBE_SMEM_BYTES`] of dynamic
/// shared memory on live buffers of the documented sizes.
#[inline(always)]
pub unsafe fn wgmma_probe<E: Elem>(p: &ProbeParams) {
    let base = ptx::dyn_smem_base();
    let me = ThreadPos::current();
    let a = GmmaTile::<M, K>::at(base);
    let b = GmmaTile::<N_WIDE, K>::at(base + GmmaTile::<M, K>::BYTES);
    let v = GmmaTile::<N, DV>::at(base + GmmaTile::<M, K>::BYTES + GmmaTile::<N_WIDE, K>::BYTES);
    let rows = |t: u64| t as *const u16;
    a.load_async::<4>(rows(p.a), K as u64, M as u32, K as u32, me.tid);
    b.load_async::<4>(rows(p.b), K as u64, N_WIDE as u32, K as u32, me.tid);
    v.load_async::<4>(rows(p.v), DV as u64, N as u32, DV as u32, me.tid);
    ptx::cp_async_commit_group();
    ptx::cp_async_wait_group::<0>();
    ptx::fence_proxy_async_shared_cta();
    ptx::bar_sync();

    // Each product's accumulators go to global memory before the next product starts (all
    // four live at once made ptxas serialize the products for want of registers).
    let pos = FragPos::of(me.lane);
    let row = |r: usize| me.warp as usize * 16 + pos.row(0, r) as usize;
    // S over all of B's rows by the 176-key product (the plain d = 128 kernel's S), then its
    // first 128 columns (B's first 128 rows: the same addresses, one column block).
    let mut s176 = AccTile::<1, { N_WIDE / 8 }>::zero();
    ptx::wgmma_fence();
    for ks in 0..K / 16 {
        E::wgmma_n176_ss(
            s176.tiles_mut::<22>(0, 0),
            a.k_major(0, ks),
            b.k_major(0, ks),
            ks > 0,
        );
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group::<0>();
    ptx::wgmma_fence_operands(s176.tiles_mut::<22>(0, 0));
    store(&mut s176, p.s176, N_WIDE, me);

    let mut s = AccTile::<1, { N / 8 }>::zero();
    ptx::wgmma_fence();
    for ks in 0..K / 16 {
        E::wgmma_n128_ss(
            s.tiles_mut::<16>(0, 0),
            a.k_major(0, ks),
            b.k_major(0, ks),
            ks > 0,
        );
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group::<0>();
    ptx::wgmma_fence_operands(s.tiles_mut::<16>(0, 0));
    store(&mut s, p.s, N, me);

    // S's first 64 columns again, by the 64-key product (B's first 64 rows).
    let mut s64 = AccTile::<1, { K / 8 }>::zero();
    ptx::wgmma_fence();
    for ks in 0..K / 16 {
        E::wgmma_n64_ss(
            s64.tiles_mut::<8>(0, 0),
            a.k_major(0, ks),
            b.k_major(0, ks),
            ks > 0,
        );
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group::<0>();
    ptx::wgmma_fence_operands(s64.tiles_mut::<8>(0, 0));
    store(&mut s64, p.s64, K, me);

    // P's A fragments from global memory: the warp's rows 16w + g (+8), columns 16kk + 2t
    // (+1, +8, +9), as `mma.m16n8k16`'s A.
    let pair = |r: usize, col: usize| *((p.p as *const u16).add(row(r) * N + col) as *const u32);
    let frag = |kk: usize| {
        let c = 16 * kk + pos.col(0, 0) as usize;
        [pair(0, c), pair(1, c), pair(0, c + 8), pair(1, c + 8)]
    };
    // O = P·V by one m64n128k16 per 16 keys (the d = 128 kernels), then again by one
    // m64n64k16 per 16 keys and 64-column block (the other head dims).
    let mut o = AccTile::<1, { DV / 8 }>::zero();
    ptx::wgmma_fence();
    for kk in 0..N / 16 {
        E::wgmma_n128_rs(o.tiles_mut::<16>(0, 0), frag(kk), v.mn_major(kk, 0));
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group::<0>();
    ptx::wgmma_fence_operands(o.tiles_mut::<16>(0, 0));
    store(&mut o, p.o, DV, me);
    let mut o64 = AccTile::<1, { DV / 8 }>::zero();
    ptx::wgmma_fence();
    for kk in 0..N / 16 {
        for cb in 0..DV / 64 {
            E::wgmma_n64_rs(o64.tiles_mut::<8>(0, 8 * cb), frag(kk), v.mn_major(kk, cb));
        }
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group::<0>();
    ptx::wgmma_fence_operands(o64.tiles_mut::<16>(0, 0));
    store(&mut o64, p.o64, DV, me);

    // G = V₀ᵀ·V₁ with both operands MN-major, as the backward's dQ = dS·K reads dSᵀ and K:
    // A[m][k] = V[k][m] (column block 0), B[k][n] = V[k][64 + n] (column block 1).
    let mut g = AccTile::<1, { DV / 16 }>::zero();
    ptx::wgmma_fence();
    for ks in 0..N / 16 {
        E::wgmma_n64_ss_tt(
            g.tiles_mut::<8>(0, 0),
            v.mn_major(ks, 0),
            v.mn_major(ks, 1),
            ks > 0,
        );
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group::<0>();
    ptx::wgmma_fence_operands(g.tiles_mut::<8>(0, 0));
    store(&mut g, p.g, DV / 2, me);
}

/// Writes a warp's accumulators of a `[64][cols]` f32 product at `out`, each element at the
/// (row, column) the fragment layout assigns it.
///
/// # Safety
/// `out` holds `64 · cols` writable f32.
#[inline(always)]
unsafe fn store<const NT: usize>(acc: &mut AccTile<1, NT>, out: u64, cols: usize, me: ThreadPos) {
    let (out, pos) = (out as *mut f32, FragPos::of(me.lane));
    let row = |r: usize| me.warp as usize * 16 + pos.row(0, r) as usize;
    acc.for_each_mut(|_, r, nt, c, x| *out.add(row(r) * cols + pos.col(nt, c) as usize) = *x);
}
