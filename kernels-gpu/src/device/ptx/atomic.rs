//! Atomic reductions to global memory.

use core::arch::asm;

/// `*addr += v` in f32, atomically, without a return value (`red.global.add.f32`).
///
/// # Safety
/// `addr` is a 4-byte aligned global address of live memory.
#[inline(always)]
pub unsafe fn red_global_add_f32(addr: *mut f32, v: f32) {
    asm!("red.global.add.f32 [{addr}], {v};", addr = in(reg64) addr, v = in(reg32) v, options(nostack));
}
