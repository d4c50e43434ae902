//! Hopper's tensor memory accelerator (TMA, sm_90): tiled copies of a tensor's box from global
//! to shared memory, described by a `CUtensorMap` that the host encodes and leaves in global
//! memory (see `docs/toolchain.md` for why not a kernel parameter), completing on an
//! `mbarrier` ([`super::mbarrier_arrive_expect_tx`]).

use core::arch::asm;

/// Starts the copy of the box at coordinates `c` (innermost first) of the 4-D tensor that
/// `map` describes into shared memory at `dst`, laid out (and swizzled) as the map says;
/// elements outside the tensor arrive as zeros. Completes `bytes` of `bar`'s transactions
/// (`cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes`).
///
/// # Safety
/// sm_90 only. `map` is the global address of a valid, 64-byte aligned `CUtensorMap` of rank 4
/// that stays valid during the kernel; `dst` is aligned as the map's swizzle needs (1024 bytes
/// for the 128-byte swizzle) and holds the box; `bar` expects the bytes.
#[inline(always)]
pub unsafe fn cp_async_bulk_tensor_4d(dst: u32, map: u64, c: [u32; 4], bar: u32) {
    asm!(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{m}, {{{c0}, {c1}, {c2}, {c3}}}], [{b}];",
        d = in(reg32) dst,
        m = in(reg64) map,
        c0 = in(reg32) c[0],
        c1 = in(reg32) c[1],
        c2 = in(reg32) c[2],
        c3 = in(reg32) c[3],
        b = in(reg32) bar,
        options(nostack)
    );
}

/// Brings the tensor map at global address `map` into the descriptor cache ahead of its first
/// use (`prefetch.tensormap`).
///
/// # Safety
/// sm_90 only; `map` is the global address of a tensor map.
#[inline(always)]
pub unsafe fn prefetch_tensormap(map: u64) {
    asm!("prefetch.tensormap [{m}];", m = in(reg64) map, options(nostack));
}
