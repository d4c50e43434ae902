//! FlashAttention kernels written in Rust.
//!
//! This crate compiles two ways:
//! - for the host (any target): only the plain-Rust parts that both sides must agree on — the
//!   kernel registry ([`registry`]: every kernel, its tiles per target) and the targets
//!   ([`arch`]), the `#[repr(C)]` launch parameters ([`params`]), tile shapes ([`config`]),
//!   the block information ([`block`]), the shared-memory swizzle ([`swizzle`]) and the masks
//!   ([`mask`], with their scalar [`math`]) and dropout's generator ([`rng`]). The host crate links these, so there is exactly one definition of each.
//! - for `nvptx64-nvidia-cuda` (through `cargo xtask build-ptx`): additionally the kernels, with
//!   every inline-PTX instruction wrapped once in the private `ptx` module.
#![no_std]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, asm_experimental_arch, stdarch_nvptx)
)]

pub mod arch;
pub mod block;
pub mod config;
pub mod gmma;
pub mod mask;
pub mod math;
pub mod params;
pub mod registry;
pub mod rng;
pub mod swizzle;

#[cfg(target_arch = "nvptx64")]
mod device;

/// On the GPU a panic (for example a failed bounds check) traps: the launch fails with
/// `CUDA_ERROR_LAUNCH_FAILED`, which the host reports as an error.
#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: `trap` aborts the kernel; nothing runs after it.
    unsafe { core::arch::nvptx::trap() }
}
