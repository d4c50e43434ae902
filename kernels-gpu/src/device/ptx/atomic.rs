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

/// `addr[0] += a; addr[1] += b` in f32, atomically per element, without a return value: one
/// vector reduction on sm_90 and later (`red.global.add.v2.f32`, PTX 8.1), two scalar ones
/// before.
///
/// # Safety
/// `addr` is an 8-byte aligned global address of two live f32.
#[inline(always)]
pub unsafe fn red_global_add_f32x2(addr: *mut f32, a: f32, b: f32) {
    if crate::arch::Arch::current().has_vector_red() {
        asm!(
            "red.global.add.v2.f32 [{addr}], {{{a}, {b}}};",
            addr = in(reg64) addr,
            a = in(reg32) a,
            b = in(reg32) b,
            options(nostack)
        );
    } else {
        red_global_add_f32(addr, a);
        red_global_add_f32(addr.add(1), b);
    }
}

/// `*addr` read with acquire semantics at GPU scope (`ld.acquire.gpu.global.u32`): what the
/// writer of the value did before its release is visible to this thread's later accesses.
///
/// # Safety
/// `addr` is a 4-byte aligned global address of live memory.
#[inline(always)]
pub unsafe fn ld_acquire_gpu_u32(addr: *const u32) -> u32 {
    let v: u32;
    asm!("ld.acquire.gpu.global.u32 {v}, [{addr}];", v = out(reg32) v, addr = in(reg64) addr, options(nostack));
    v
}

/// `*addr = v` with release semantics at GPU scope (`st.release.gpu.global.u32`): this
/// thread's earlier accesses, and those ordered before them (by a barrier, for example), are
/// visible to a thread that reads `v` with acquire semantics.
///
/// # Safety
/// `addr` is a 4-byte aligned global address of live memory.
#[inline(always)]
pub unsafe fn st_release_gpu_u32(addr: *mut u32, v: u32) {
    asm!("st.release.gpu.global.u32 [{addr}], {v};", addr = in(reg64) addr, v = in(reg32) v, options(nostack));
}

/// `old = *addr; *addr = if old >= bound { 0 } else { old + 1 }`, atomically; returns `old`
/// (`atom.global.inc.u32`). A counter taken `bound + 1` times from zero this way is zero again.
///
/// # Safety
/// `addr` is a 4-byte aligned global address of a live u32.
#[inline(always)]
pub unsafe fn atom_global_inc_u32(addr: *mut u32, bound: u32) -> u32 {
    let old: u32;
    asm!("atom.global.inc.u32 {old}, [{addr}], {bound};", old = out(reg32) old, addr = in(reg64) addr, bound = in(reg32) bound, options(nostack));
    old
}
