//! The one place kernels are launched: parameter structs go by value through [`ByValue`].
//!
//! Every kernel of a target whose kernels start by waiting for the grids before them on the
//! stream ([`flash_attn_kernels::arch::Arch::waits_for_previous_grids`]: sm_90a) may be
//! launched with programmatic stream serialization (`cuLaunchKernelEx`, [`Order::Overlapped`]):
//! the driver then launches it as soon as every block of the previous kernel has exited,
//! without waiting for that kernel's completion to be processed, and its blocks wait in
//! `griddepcontrol.wait` until it is. Nothing a kernel reads or writes is touched before that
//! wait, so memory keeps stream order exactly as with ordinary launches, including memory the
//! stream-ordered pool hands from one kernel to the next.
//!
//! Only the backward's main kernel is launched this way, after its pre-pass (1–7 µs less per
//! backward call on the H200; docs/perf-notes.md, 2026-12-01). `FLASH_ATTN_PDL=0` launches it
//! the ordinary way ([`crate::Device::new`]).

use crate::device::Device;
use crate::error::Result;
use cudarc::driver::sys;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

/// A `#[repr(C)]` parameter struct from `flash-attn-kernels`, passed to a kernel by value.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct ByValue<P: Copy>(pub P);

// SAFETY: only instantiated with the plain-data `#[repr(C)]` parameter structs of
// `flash_attn_kernels::params`, whose layout the kernels share.
unsafe impl<P: Copy> DeviceRepr for ByValue<P> {}

/// How a launch is ordered after the work before it on the stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Order {
    /// Ordinary stream order: the kernel starts once the previous work has completed.
    Stream,
    /// The kernel follows another kernel of the same call: launched with programmatic stream
    /// serialization where the device's kernels allow and `FLASH_ATTN_PDL` does not forbid it
    /// ([`Device::overlapped_launches`]), in ordinary stream order otherwise (module docs).
    Overlapped,
}

/// Launches kernel `name` on `grid` blocks of `threads` threads with `smem_bytes` of dynamic
/// shared memory and one by-value parameter struct, ordered after the stream's previous work
/// as `order` says.
///
/// # Safety
/// `params` must describe memory the kernel may read and write for the whole launch, and the
/// grid, block and shared memory must be those the kernel was written for. With
/// [`Order::Overlapped`], the kernel must wait for the previous grid before touching memory
/// ([`flash_attn_kernels::arch::Arch::waits_for_previous_grids`]).
pub(crate) unsafe fn launch<P: Copy>(
    dev: &Device,
    order: Order,
    name: &'static str,
    grid: (u32, u32, u32),
    threads: u32,
    smem_bytes: usize,
    params: P,
) -> Result<()> {
    let f = dev.function(name, smem_bytes)?;
    let arg = ByValue(params);
    if order == Order::Overlapped && dev.overlapped_launches() {
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem_bytes as u32,
            hStream: dev.stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut args = [&arg as *const ByValue<P> as *mut core::ffi::c_void];
        dev.context().bind_to_thread()?;
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            args.as_mut_ptr(),
            core::ptr::null_mut(),
        )
        .result()?;
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem_bytes as u32,
    };
    dev.stream().launch_builder(&f).arg(&arg).launch(cfg)?;
    Ok(())
}
