//! `cp.async`: asynchronous global → shared copies (sm_80+), tracked in commit groups.

use core::arch::asm;

/// Copies 16 bytes from global `src` to shared `dst`, zero-filling all bytes past `src_bytes`
/// (so `src_bytes = 0` writes 16 zero bytes and reads nothing). Bypasses L1 (`.cg`).
///
/// # Safety
/// `dst` is a 16-byte aligned shared address inside the block's allocation; `src` is a
/// 16-byte aligned global address whose first `src_bytes` (≤ 16) bytes are readable.
#[inline(always)]
pub unsafe fn cp_async_cg_16(dst: u32, src: *const u8, src_bytes: u32) {
    asm!(
        "cp.async.cg.shared.global [{dst}], [{src}], 16, {n};",
        dst = in(reg32) dst,
        src = in(reg64) src,
        n = in(reg32) src_bytes,
        options(nostack)
    );
}

/// Copies 4 bytes from global `src` to shared `dst`, zero-filling them when `src_bytes` is 0
/// (then nothing is read). Through L1 (`.ca`, the only cache mode for copies below 16 bytes).
///
/// # Safety
/// `dst` is a 4-byte aligned shared address inside the block's allocation; when `src_bytes`
/// is 4, `src` is a readable 4-byte aligned global address.
#[inline(always)]
pub unsafe fn cp_async_ca_4(dst: u32, src: *const u8, src_bytes: u32) {
    asm!(
        "cp.async.ca.shared.global [{dst}], [{src}], 4, {n};",
        dst = in(reg32) dst,
        src = in(reg64) src,
        n = in(reg32) src_bytes,
        options(nostack)
    );
}

/// Closes the current group of `cp.async` copies issued by this thread.
///
/// # Safety
/// Always safe to execute; `unsafe` only because it orders memory behind the compiler's back.
#[inline(always)]
pub unsafe fn cp_async_commit_group() {
    asm!("cp.async.commit_group;", options(nostack));
}

/// Waits until at most `N` of this thread's committed groups are still in flight. Other
/// threads' copies need a barrier after this before they are visible.
///
/// # Safety
/// As [`cp_async_commit_group`].
#[inline(always)]
pub unsafe fn cp_async_wait_group<const N: u32>() {
    asm!("cp.async.wait_group {n};", n = const N, options(nostack));
}
