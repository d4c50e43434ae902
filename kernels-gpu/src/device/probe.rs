//! The `wgmma` layout probe: one warpgroup runs each warpgroup product shape the Hopper
//! forward uses, through the same wrappers, descriptors and tile layout, and writes every
//! accumulator element at the (row, column) the register-tile layer assigns it. The host
//! compares with a CPU product (`tests/tests/gpu_wgmma.rs`), so a wrong descriptor field,
//! swizzle or fragment mapping shows up as a wrong element.
//!
//! Block: 128 threads (one warpgroup); shared memory A `[64][64]`, B `[128][64]`, V `[128][64]`
//! in the layout of [`crate::gmma`] (40 KiB, see [`crate::config::PROBE_SMEM_BYTES`]). Sync points: the
//! `cp.async` wait, `fence.proxy.async`, one `bar.sync`, then each product's wait.

use super::elem::Elem;
use super::frag::{AccTile, FragPos, ThreadPos};
use super::ptx;
use super::tile::GmmaTile;
use crate::params::ProbeParams;

/// Rows of A, P, S and O.
const M: usize = 64;
/// Columns of A and V (the reduction of S, the columns of O).
const K: usize = 64;
/// Rows of B and V (the columns of S, the reduction of O).
const N: usize = 128;

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
    let b = GmmaTile::<N, K>::at(base + GmmaTile::<M, K>::BYTES);
    let v = GmmaTile::<N, K>::at(base + GmmaTile::<M, K>::BYTES + GmmaTile::<N, K>::BYTES);
    let rows = |t: u64| t as *const u16;
    a.load_async::<4>(rows(p.a), K as u64, M as u32, K as u32, me.tid);
    b.load_async::<4>(rows(p.b), K as u64, N as u32, K as u32, me.tid);
    v.load_async::<4>(rows(p.v), K as u64, N as u32, K as u32, me.tid);
    ptx::cp_async_commit_group();
    ptx::cp_async_wait_group::<0>();
    ptx::fence_proxy_async_shared_cta();
    ptx::bar_sync();

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

    // P's A fragments from global memory: the warp's rows 16w + g (+8), columns 16kk + 2t
    // (+1, +8, +9), as `mma.m16n8k16`'s A.
    let pos = FragPos::of(me.lane);
    let row = |r: usize| me.warp as usize * 16 + pos.row(0, r) as usize;
    let pair = |r: usize, col: usize| *((p.p as *const u16).add(row(r) * N + col) as *const u32);
    let mut o = AccTile::<1, { K / 8 }>::zero();
    ptx::wgmma_fence();
    for kk in 0..N / 16 {
        let c = 16 * kk + pos.col(0, 0) as usize;
        let frag = [pair(0, c), pair(1, c), pair(0, c + 8), pair(1, c + 8)];
        E::wgmma_n64_rs(o.tiles_mut::<8>(0, 0), frag, v.mn_major(kk, 0));
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group::<0>();
    ptx::wgmma_fence_operands(o.tiles_mut::<8>(0, 0));

    let (s_out, s64_out, o_out) = (p.s as *mut f32, p.s64 as *mut f32, p.o as *mut f32);
    s.for_each_mut(|_, r, nt, c, x| *s_out.add(row(r) * N + pos.col(nt, c) as usize) = *x);
    s64.for_each_mut(|_, r, nt, c, x| *s64_out.add(row(r) * K + pos.col(nt, c) as usize) = *x);
    o.for_each_mut(|_, r, nt, c, x| *o_out.add(row(r) * K + pos.col(nt, c) as usize) = *x);
}
