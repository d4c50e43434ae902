//! Hopper's bulk copy engine (sm_90, PTX 8.0): asynchronous reductions from shared to global
//! memory, their completion groups, and the proxy fence that orders ordinary shared-memory
//! writes before the engine reads them.

use core::arch::asm;

/// Makes this thread's earlier ordinary (generic-proxy) shared-memory writes visible to later
/// bulk operations (the async proxy) on this block's shared memory
/// (`fence.proxy.async.shared::cta`). The thread that starts the bulk operation must see the
/// writes after a barrier that follows this fence.
///
/// # Safety
/// sm_90 only.
#[inline(always)]
pub unsafe fn fence_proxy_async_shared_cta() {
    asm!("fence.proxy.async.shared::cta;", options(nostack));
}

/// Starts `global[0 .. bytes/4] += shared[0 .. bytes/4]` in f32, element-wise atomic, by the
/// bulk engine (`cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32`); complete it with
/// [`cp_async_bulk_commit_group`] and [`cp_async_bulk_wait_group`].
///
/// # Safety
/// sm_90 only. `global` and the shared address `shared` are 16-byte aligned, `bytes` is a
/// multiple of 16, both ranges are live until the group completes, and the shared data was
/// published to the async proxy ([`fence_proxy_async_shared_cta`], then a barrier).
#[inline(always)]
pub unsafe fn cp_reduce_async_bulk_add_f32(global: *mut f32, shared: u32, bytes: u32) {
    asm!(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [{g}], [{s}], {n};",
        g = in(reg64) global,
        s = in(reg32) shared,
        n = in(reg32) bytes,
        options(nostack)
    );
}

/// Closes this thread's bulk operations started since the last commit into one group
/// (`cp.async.bulk.commit_group`).
///
/// # Safety
/// sm_90 only.
#[inline(always)]
pub unsafe fn cp_async_bulk_commit_group() {
    asm!("cp.async.bulk.commit_group;", options(nostack));
}

/// Waits until at most `N` of this thread's bulk groups are incomplete, complete meaning the
/// writes performed, not only the sources read (`cp.async.bulk.wait_group N`): successive
/// reductions of one thread into the same memory then apply in order.
///
/// # Safety
/// sm_90 only.
#[inline(always)]
pub unsafe fn cp_async_bulk_wait_group<const N: u32>() {
    asm!("cp.async.bulk.wait_group {n};", n = const N, options(nostack));
}

/// Waits until at most `N` of this thread's bulk groups still read their sources
/// (`cp.async.bulk.wait_group.read N`): the shared memory they read may then be written
/// again, while their writes to global memory may still be under way. They are performed
/// before the grid completes, so a later launch in stream order sees them; successive
/// reductions into the same memory may then apply in any order.
///
/// # Safety
/// sm_90 only.
#[inline(always)]
pub unsafe fn cp_async_bulk_wait_group_read<const N: u32>() {
    asm!("cp.async.bulk.wait_group.read {n};", n = const N, options(nostack));
}

/// Orders this thread's completed bulk writes to global memory (the async proxy) before its
/// later ordinary accesses (`fence.proxy.async.global`): a release that follows then
/// publishes them too.
///
/// # Safety
/// sm_90 only.
#[inline(always)]
pub unsafe fn fence_proxy_async_global() {
    asm!("fence.proxy.async.global;", options(nostack));
}
