//! Register reallocation between warpgroups (`setmaxnreg`, sm_90a): a producer warpgroup that
//! only starts copies gives registers back, so the consumer warpgroups may use more than the
//! block's even share. The kernel's PTX must carry `.maxntid` (the register budget per thread
//! at launch is then `65536 / threads`, rounded down to a multiple of 8).

use core::arch::asm;

/// Lowers this warpgroup's register limit to `N` per thread (`setmaxnreg.dec.sync.aligned`).
///
/// # Safety
/// sm_90a only; the whole warpgroup executes it; `N` is a multiple of 8 in 24..=256 and at
/// most the current limit.
#[inline(always)]
pub unsafe fn setmaxnreg_dec<const N: u32>() {
    asm!("setmaxnreg.dec.sync.aligned.u32 {n};", n = const N, options(nostack));
}

/// Raises this warpgroup's register limit to `N` per thread (`setmaxnreg.inc.sync.aligned`),
/// waiting until the block has that many free.
///
/// # Safety
/// As [`setmaxnreg_dec`], with `N` at least the current limit, and the other warpgroups'
/// decreases leaving enough registers.
#[inline(always)]
pub unsafe fn setmaxnreg_inc<const N: u32>() {
    asm!("setmaxnreg.inc.sync.aligned.u32 {n};", n = const N, options(nostack));
}
