//! Plain shared-memory loads and stores, and the 16-byte global store that writes what a
//! warp staged there.

use core::arch::asm;

/// Loads 16 bytes from shared address `addr`.
///
/// # Safety
/// `addr` is 16-byte aligned and inside the block's shared memory.
#[inline(always)]
pub unsafe fn ld_shared_v4(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    asm!(
        "ld.shared.v4.u32 {{{a}, {b}, {c}, {d}}}, [{addr}];",
        a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
        addr = in(reg32) addr,
        options(nostack)
    );
    [a, b, c, d]
}

/// Stores 16 bytes to shared address `addr`.
///
/// # Safety
/// As [`ld_shared_v4`].
#[inline(always)]
pub unsafe fn st_shared_v4(addr: u32, v: [u32; 4]) {
    asm!(
        "st.shared.v4.u32 [{addr}], {{{a}, {b}, {c}, {d}}};",
        addr = in(reg32) addr,
        a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
        options(nostack)
    );
}

/// Stores 4 bytes to shared address `addr`.
///
/// # Safety
/// `addr` is 4-byte aligned and inside the block's shared memory.
#[inline(always)]
pub unsafe fn st_shared_u32(addr: u32, v: u32) {
    asm!("st.shared.u32 [{addr}], {v};", addr = in(reg32) addr, v = in(reg32) v, options(nostack));
}

/// Stores an f32 to shared address `addr`.
///
/// # Safety
/// As [`st_shared_u32`].
#[inline(always)]
pub unsafe fn st_shared_f32(addr: u32, v: f32) {
    asm!("st.shared.f32 [{addr}], {v};", addr = in(reg32) addr, v = in(reg32) v, options(nostack));
}

/// Loads an f32 from shared address `addr`.
///
/// # Safety
/// As [`st_shared_u32`].
#[inline(always)]
pub unsafe fn ld_shared_f32(addr: u32) -> f32 {
    let v: f32;
    asm!("ld.shared.f32 {v}, [{addr}];", v = out(reg32) v, addr = in(reg32) addr, options(nostack, readonly));
    v
}

/// `st.shared.v2.f32`: two f32 at an 8-byte aligned shared address.
///
/// # Safety
/// `addr` is an 8-byte aligned shared-memory address inside the block's allocation.
#[inline(always)]
pub unsafe fn st_shared_v2_f32(addr: u32, a: f32, b: f32) {
    asm!("st.shared.v2.f32 [{addr}], {{{a}, {b}}};", addr = in(reg32) addr, a = in(reg32) a, b = in(reg32) b, options(nostack));
}

/// `ld.volatile.shared.u32`: loads 4 bytes from shared address `addr` where it is used, never
/// merged with another load of it, so the value lives in a register only briefly (for values
/// that would otherwise stay live across a whole loop).
///
/// # Safety
/// As [`st_shared_u32`].
#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // sm_90a code (the `wgmma` backward)
#[inline(always)]
pub unsafe fn ld_volatile_shared_u32(addr: u32) -> u32 {
    let v: u32;
    asm!("ld.volatile.shared.u32 {v}, [{addr}];", v = out(reg32) v, addr = in(reg32) addr, options(nostack));
    v
}

/// Loads 4 bytes from shared address `addr`.
///
/// # Safety
/// As [`st_shared_u32`].
#[inline(always)]
pub unsafe fn ld_shared_u32(addr: u32) -> u32 {
    let v: u32;
    asm!("ld.shared.u32 {v}, [{addr}];", v = out(reg32) v, addr = in(reg32) addr, options(nostack, readonly));
    v
}

/// Stores 16 bytes to global address `addr`.
///
/// # Safety
/// `addr` is a 16-byte aligned address of 16 writable bytes of global memory.
#[inline(always)]
pub unsafe fn st_global_v4(addr: u64, v: [u32; 4]) {
    asm!(
        "st.global.v4.u32 [{addr}], {{{a}, {b}, {c}, {d}}};",
        addr = in(reg64) addr,
        a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
        options(nostack)
    );
}
