//! A CUDA device with its context, stream and the loaded kernel module.

use crate::error::{FlashError, Result};
use crate::ptx;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use flash_attn_kernels::config::Arch;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One GPU, ready to run the kernels: a context, the stream every call of this crate is
/// enqueued on, and the embedded PTX for the device's architecture, loaded once.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    compute_capability: (i32, i32),
    arch: Arch,
    max_smem_optin: usize,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

/// Number of CUDA devices; an error (not a panic) when the driver library is missing.
pub fn device_count() -> Result<usize> {
    // SAFETY: only probes whether libcuda can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(FlashError::NoDevice(
            "the CUDA driver library (libcuda.so) could not be loaded".into(),
        ));
    }
    let n = CudaContext::device_count().map_err(|e| FlashError::NoDevice(e.to_string()))?;
    Ok(n.max(0) as usize)
}

impl Device {
    /// Opens device `ordinal` (primary context), creates a stream and loads the kernels for its
    /// architecture (`FLASH_ATTN_PTX=sm80` forces the sm_80 PTX on newer devices, for testing).
    /// Fails with [`FlashError::NoDevice`] when there is no driver or no such device, and with
    /// [`FlashError::UnsupportedDevice`] below compute capability 8.0.
    pub fn new(ordinal: usize) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(FlashError::NoDevice(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let (mut arch, mut src) = ptx::for_compute_capability(major, minor)
            .ok_or(FlashError::UnsupportedDevice { major, minor })?;
        // Lets the sm_80 kernels (Ampere/Ada tiles) be tested on a Hopper machine.
        if std::env::var("FLASH_ATTN_PTX").is_ok_and(|v| v == "sm80") {
            (arch, src) = (Arch::Sm80, ptx::SM80);
        }
        let max_smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            as usize;
        let stream = ctx.new_stream()?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(src))?;
        Ok(Self {
            ctx,
            stream,
            module,
            compute_capability: (major, minor),
            arch,
            max_smem_optin,
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Which embedded PTX was loaded (`"sm_80"` or `"sm_90a"`).
    pub fn ptx_arch(&self) -> &'static str {
        match self.arch {
            Arch::Sm80 => "sm_80",
            Arch::Sm90a => "sm_90a",
        }
    }

    /// The PTX target loaded (selects the kernels' tile shapes).
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The device's name.
    pub fn name(&self) -> Result<String> {
        Ok(self.ctx.name()?)
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// Waits for everything enqueued on this device's stream.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// The stream all work of this crate is enqueued on (for interop and timing).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context (tensors must belong to it).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The largest dynamic shared memory a block may opt in to, in bytes.
    pub fn max_shared_memory_per_block(&self) -> usize {
        self.max_smem_optin
    }

    /// A kernel of the loaded module, with its dynamic shared-memory limit raised to `smem`.
    pub(crate) fn function(&self, name: &'static str, smem: usize) -> Result<CudaFunction> {
        if smem > self.max_smem_optin {
            return Err(FlashError::UnsupportedDevice {
                major: self.compute_capability.0,
                minor: self.compute_capability.1,
            });
        }
        let mut map = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = map.get(name) {
            return Ok(f.clone());
        }
        let f = self.module.load_function(name)?;
        if smem > 48 * 1024 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        map.insert(name, f.clone());
        Ok(f)
    }
}
