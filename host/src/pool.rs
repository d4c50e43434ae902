//! The device's default memory pool, which cudarc's stream-ordered allocations come from: by
//! default it gives freed memory back to the driver at every synchronisation, so each call's
//! temporaries (the backward's f32 dQ accumulator, 128 MiB at 16K tokens × 16 heads × d =
//! 128) are mapped afresh on every call, while the GPU waits (~0.25 ms per backward call on
//! an H100). [`retain_freed_memory`] keeps freed memory in the pool for the next allocation,
//! as PyTorch's caching allocator does; [`release_freed_memory`] gives it back.

use crate::error::Result;
use cudarc::driver::sys::{
    cuDeviceGetDefaultMemPool, cuMemPoolGetAttribute, cuMemPoolSetAttribute, cuMemPoolTrimTo,
    CUmemPool_attribute, CUmemoryPool, CUresult,
};
use cudarc::driver::CudaContext;
use std::ffi::c_void;

/// The context's device's default pool, or `None` where the device has no memory pools
/// (cudarc then allocates synchronously and the pool plays no part).
fn default_pool(ctx: &CudaContext) -> Result<Option<CUmemoryPool>> {
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    ctx.bind_to_thread()?;
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid device handle and an out pointer to a local.
    let r = unsafe { cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
    check(r)?;
    Ok(Some(pool))
}

/// The driver's status as this crate's error.
fn check(r: CUresult) -> Result<()> {
    Ok(r.result()?)
}

/// Raises the default pool's release threshold from the driver's default (0: give every
/// freed byte back at each synchronisation) to unlimited, so that freed memory stays in the
/// pool for later allocations of this process. A threshold someone already set is left
/// alone.
pub(crate) fn retain_freed_memory(ctx: &CudaContext) -> Result<()> {
    let Some(pool) = default_pool(ctx)? else {
        return Ok(());
    };
    let attr = CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    let mut threshold: u64 = 0;
    // SAFETY: the attribute is a u64, as the driver documents.
    let r = unsafe { cuMemPoolGetAttribute(pool, attr, &mut threshold as *mut u64 as *mut c_void) };
    check(r)?;
    if threshold == 0 {
        let mut unlimited = u64::MAX;
        // SAFETY: as above.
        let r =
            unsafe { cuMemPoolSetAttribute(pool, attr, &mut unlimited as *mut u64 as *mut c_void) };
        check(r)?;
    }
    Ok(())
}

/// Gives the memory freed into the default pool back to the driver (after the frees that
/// are still queued on a stream have run: synchronise first).
pub(crate) fn release_freed_memory(ctx: &CudaContext) -> Result<()> {
    let Some(pool) = default_pool(ctx)? else {
        return Ok(());
    };
    // SAFETY: a pool handle from the driver.
    check(unsafe { cuMemPoolTrimTo(pool, 0) })
}
