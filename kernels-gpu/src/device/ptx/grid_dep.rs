//! Programmatic dependent launch (`griddepcontrol`, sm_90, PTX 7.8): a grid the host launched
//! with programmatic stream serialization may start while the grid before it on the stream
//! finishes, and must wait for it before touching memory. On other targets the wrapper is
//! empty: their kernels are launched the ordinary way
//! ([`crate::arch::Arch::waits_for_previous_grids`]).

#[cfg(flash_arch = "sm90a")]
use core::arch::asm;

/// The first statement of every kernel: `griddepcontrol.wait`, which returns once every grid
/// this one depends on has completed and its writes are visible (at once when the grid was
/// launched the ordinary way). The asm is a compiler barrier for memory: no load or store of
/// the kernel moves above it.
///
/// No kernel issues `griddepcontrol.launch_dependents`: the grid after it is then launched once
/// all of its blocks have exited, not before. Issued at the start of the backward's pre-pass,
/// it let the main kernel's blocks start beside the pre-pass's last blocks, and the main
/// kernel then took 2–6 % longer at 16K keys on the H200 (docs/perf-notes.md, 2026-12-01).
///
/// # Safety
/// Every thread of the grid executes it before any global memory access.
#[inline(always)]
pub unsafe fn await_previous_grids() {
    #[cfg(flash_arch = "sm90a")]
    asm!("griddepcontrol.wait;", options(nostack));
}
