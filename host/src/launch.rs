//! The one place kernels are launched: parameter structs go by value through [`ByValue`].

use crate::device::Device;
use crate::error::Result;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

/// A `#[repr(C)]` parameter struct from `flash-attn-kernels`, passed to a kernel by value.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct ByValue<P: Copy>(pub P);

// SAFETY: only instantiated with the plain-data `#[repr(C)]` parameter structs of
// `flash_attn_kernels::params`, whose layout the kernels share.
unsafe impl<P: Copy> DeviceRepr for ByValue<P> {}

/// Launches kernel `name` with one by-value parameter struct.
///
/// # Safety
/// `params` must describe memory the kernel may read and write for the whole launch, and the
/// grid, block and shared memory must be those the kernel was written for.
pub(crate) unsafe fn launch<P: Copy>(
    dev: &Device,
    name: &'static str,
    grid: (u32, u32, u32),
    threads: u32,
    smem_bytes: usize,
    params: P,
) -> Result<()> {
    let f = dev.function(name, smem_bytes)?;
    let arg = ByValue(params);
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem_bytes as u32,
    };
    dev.stream().launch_builder(&f).arg(&arg).launch(cfg)?;
    Ok(())
}
