//! Whether the CUDA driver library can be loaded, whatever way cudarc links it.
//!
//! cudarc's own probe (`driver::sys::is_culib_present`) exists only with its `dynamic-loading`
//! link mode; an application that also depends on candle gets `dynamic-linking` instead (Cargo
//! merges the features, and `fallback-dynamic-loading` then links). Opening the library by
//! name answers in both modes: with dynamic linking it is already mapped and opens at once.

/// Names the NVIDIA driver's library goes by (Linux, then Windows).
const LIBCUDA_NAMES: [&str; 3] = ["libcuda.so.1", "libcuda.so", "nvcuda.dll"];

/// True when the CUDA driver library can be loaded in this process.
pub(crate) fn libcuda_present() -> bool {
    LIBCUDA_NAMES.iter().any(|name| {
        // SAFETY: loading the NVIDIA driver runs only its own initialisers; the handle is
        // dropped at once (the library stays mapped while cudarc uses it).
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}
