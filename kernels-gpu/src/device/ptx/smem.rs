//! The block's dynamic shared memory: one module-level `.extern .shared` array, sized at launch,
//! 1024-byte aligned (the alignment of the `wgmma` operands' swizzle atoms).

use core::arch::{asm, global_asm};

global_asm!(".extern .shared .align 1024 .b8 flash_dyn_smem[];");

/// 32-bit shared-state-space address of the start of the dynamic shared memory.
///
/// # Safety
/// Only meaningful in a kernel launched with enough dynamic shared memory for its use.
#[inline(always)]
pub unsafe fn dyn_smem_base() -> u32 {
    let a: u32;
    asm!("mov.u32 {a}, flash_dyn_smem;", a = out(reg32) a, options(pure, nomem, nostack));
    a
}
