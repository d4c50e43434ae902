//! Thread indices and barriers.

use core::arch::asm;

/// `%tid.x`.
///
/// # Safety
/// Always safe to execute.
#[inline(always)]
pub unsafe fn tid_x() -> u32 {
    let v: u32;
    asm!("mov.u32 {v}, %tid.x;", v = out(reg32) v, options(pure, nomem, nostack));
    v
}

/// `%ctaid.x`, `%ctaid.y`, `%ctaid.z`.
///
/// # Safety
/// Always safe to execute.
#[inline(always)]
pub unsafe fn ctaid() -> (u32, u32, u32) {
    let (x, y, z): (u32, u32, u32);
    asm!(
        "mov.u32 {x}, %ctaid.x;", "mov.u32 {y}, %ctaid.y;", "mov.u32 {z}, %ctaid.z;",
        x = out(reg32) x, y = out(reg32) y, z = out(reg32) z,
        options(pure, nomem, nostack)
    );
    (x, y, z)
}

/// `%nctaid.x`.
///
/// # Safety
/// Always safe to execute.
#[inline(always)]
pub unsafe fn nctaid_x() -> u32 {
    let v: u32;
    asm!("mov.u32 {v}, %nctaid.x;", v = out(reg32) v, options(pure, nomem, nostack));
    v
}

/// `%nctaid.x`, `%nctaid.y`, `%nctaid.z`.
///
/// # Safety
/// Always safe to execute.
#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // sm_90a code (the `wgmma` backward)
#[inline(always)]
pub unsafe fn nctaid() -> (u32, u32, u32) {
    let (x, y, z): (u32, u32, u32);
    asm!(
        "mov.u32 {x}, %nctaid.x;", "mov.u32 {y}, %nctaid.y;", "mov.u32 {z}, %nctaid.z;",
        x = out(reg32) x, y = out(reg32) y, z = out(reg32) z,
        options(pure, nomem, nostack)
    );
    (x, y, z)
}

/// `bar.sync 0`: block-wide barrier; orders shared-memory accesses of the block. Emitted
/// through LLVM's `llvm.nvvm.barrier0`, which LLVM knows to be convergent: an inline-asm
/// barrier may be duplicated into both arms of a branch (jump threading), after which the
/// warps of a block wait at different `bar.sync` instructions (compute-sanitizer's synccheck
/// reports that, and `bar.sync` is `.aligned`: every thread must execute the same one).
///
/// # Safety
/// Every thread of the block reaches it (no divergent barriers).
#[inline(always)]
pub unsafe fn bar_sync() {
    core::arch::nvptx::_syncthreads();
}

/// `bar.warp.sync 0xffffffff`: warp-wide barrier; orders the shared-memory accesses of the
/// warp's lanes (one lane's `cp.async` data, once waited for, becomes visible to the others).
///
/// # Safety
/// All 32 lanes reach it.
#[inline(always)]
pub unsafe fn bar_warp_sync() {
    asm!("bar.warp.sync 0xffffffff;", options(nostack));
}

/// `%ntid.x`.
///
/// # Safety
/// Always safe to execute.
#[inline(always)]
pub unsafe fn ntid_x() -> u32 {
    let v: u32;
    asm!("mov.u32 {v}, %ntid.x;", v = out(reg32) v, options(pure, nomem, nostack));
    v
}

/// Returns `x` through a `mov` the compiler may not hoist, merge or see through.
///
/// Inline-asm address operands take no immediate offset, so every `ldmatrix` address is a
/// register. Left alone, LLVM hoists the loop-invariant part of each of them out of the key
/// loop, keeping one live register per address (dozens). Passing the lane index through this
/// at the top of each step makes the addresses step-local again, at one add per `ldmatrix`.
///
/// # Safety
/// Always safe to execute.
#[inline(always)]
pub unsafe fn opaque_u32(x: u32) -> u32 {
    let y: u32;
    asm!("mov.b32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(nomem, nostack));
    y
}

/// A copy of `x` (a plain-data value of whole 32-bit words, such as a kernel parameter
/// struct) made word by word through [`opaque_u32`]: what is computed from the copy cannot be
/// hoisted to where `x` was first read (a persistent kernel's tile loop recomputes it per tile
/// instead of holding it in registers through every key loop).
///
/// # Safety
/// `T` is plain data (any bit pattern of its size is one `x` had), its size a multiple of 4.
#[inline(always)]
pub unsafe fn opaque_copy<T: Copy>(x: &T) -> T {
    const { assert!(core::mem::size_of::<T>() % 4 == 0) };
    let mut out = core::mem::MaybeUninit::<T>::uninit();
    let (src, dst) = (x as *const T as *const u32, out.as_mut_ptr() as *mut u32);
    for i in 0..core::mem::size_of::<T>() / 4 {
        *dst.add(i) = opaque_u32(*src.add(i));
    }
    out.assume_init()
}

/// `vote.sync.any.pred`: whether `pred` holds in any lane of the warp (warp-uniform result).
///
/// # Safety
/// All 32 lanes execute it together.
#[inline(always)]
pub unsafe fn vote_any_sync(pred: bool) -> bool {
    let r: u32;
    asm!(
        "{{ .reg .pred p, q; setp.ne.u32 p, {x}, 0; vote.sync.any.pred q, p, 0xffffffff; selp.u32 {r}, 1, 0, q; }}",
        x = in(reg32) pred as u32,
        r = out(reg32) r,
        options(nostack)
    );
    r != 0
}

/// `bar.sync id, threads`: a barrier for the `threads` threads (a multiple of 32) that name
/// barrier `id` (1..=15; 0 is [`bar_sync`]'s), e.g. one warpgroup's 128.
///
/// # Safety
/// Exactly `threads` threads, in whole warps, reach it with the same `id`, at the same
/// instruction (call it where the warps' control flow does not diverge).
#[inline(always)]
pub unsafe fn bar_sync_named(id: u32, threads: u32) {
    asm!("bar.sync {i}, {n};", i = in(reg32) id, n = in(reg32) threads, options(nostack));
}

/// `bar.red.or.pred`: [`bar_sync_named`] that also returns, in every thread, whether `pred`
/// was true in any of the `threads` threads (a vote over several warps, e.g. a warpgroup's,
/// before a warpgroup-wide instruction only some warps' data ask for).
///
/// # Safety
/// As [`bar_sync_named`].
#[inline(always)]
pub unsafe fn bar_red_or_named(id: u32, threads: u32, pred: bool) -> bool {
    let r: u32;
    asm!(
        "{{ .reg .pred p, q; setp.ne.u32 p, {x}, 0; bar.red.or.pred q, {i}, {n}, p; selp.u32 {r}, 1, 0, q; }}",
        r = out(reg32) r,
        x = in(reg32) pred as u32,
        i = in(reg32) id,
        n = in(reg32) threads,
        options(nostack)
    );
    r != 0
}

/// `bar.arrive id, threads`: counts the calling warps as arrived at named barrier `id`
/// without waiting; the barrier completes when `threads` threads arrived or synced there (the
/// other side of a producer/consumer handshake whose waiters use [`bar_sync_named`]).
///
/// # Safety
/// As [`bar_sync_named`].
#[inline(always)]
pub unsafe fn bar_arrive_named(id: u32, threads: u32) {
    asm!("bar.arrive {i}, {n};", i = in(reg32) id, n = in(reg32) threads, options(nostack));
}
