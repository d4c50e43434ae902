//! A CUDA device with its context, its stream and the kernels loaded so far.

use crate::error::{FlashError, Result};
use crate::kernels;
use crate::scratch::LaunchScratch;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;
use flash_attn_kernels::arch::Arch;
use flash_attn_kernels::params::SCHEDULE_PINGPONG;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// One GPU, ready to run the kernels: a context and the stream every call of this crate is
/// enqueued on. Kernels are loaded lazily, each on its first launch, as its own module: the
/// embedded SASS where it runs on this device (no compilation), else the PTX through the
/// driver's JIT (cached by the driver for later runs).
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    compute_capability: (i32, i32),
    arch: Arch,
    force_ptx: bool,
    /// Which kernels the forward takes on Hopper ([`ForwardPath`] as a `u8`).
    forward_path: AtomicU8,
    /// Which kernels the backward takes on Hopper ([`BackwardPath`] as a `u8`).
    backward_path: AtomicU8,
    /// The `wgmma` kernels' schedule (`FLASH_ATTN_WGMMA_PINGPONG`, read once).
    wgmma_schedule: u32,
    /// Whether the persistent `wgmma` kernels run persistent blocks
    /// (`FLASH_ATTN_WGMMA_PERSISTENT`, read once).
    wgmma_persistent: bool,
    /// Whether persistent block-sparse forward launches take their query tiles longest first
    /// (`FLASH_ATTN_TILE_ORDER`, read once).
    sparse_tile_order: bool,
    /// Whether forward calls take wide key tiles wherever the kind has them
    /// (`FLASH_ATTN_WGMMA_WIDE=1`, read once).
    wgmma_wide_tiles: bool,
    /// Whether launches allow programmatic stream serialization (read once).
    overlapped_launches: bool,
    max_smem_optin: usize,
    sm_count: usize,
    /// Peak memory bandwidth per SM in GB/s (0 when the driver does not say).
    memory_gbps_per_sm: f64,
    loaded: Mutex<HashMap<&'static str, Loaded>>,
    /// Blocks of each kernel an SM holds at once (see [`Device::resident_blocks`]).
    occupancy: Mutex<HashMap<&'static str, usize>>,
    /// The calls' launch data (TMA descriptors, mask data), one buffer reused, and the
    /// persistent launches' tile counter (see [`crate::scratch`]).
    scratch: LaunchScratch,
}

/// Which kernels the forward runs on Hopper (compute capability 9.0); other GPUs always run
/// the `mma.sync` kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardPath {
    /// The `wgmma` kernels for calls long enough for them to be faster (at d ≤ 128 at least
    /// 1,024 keys, 2,048 or 4,096 with a causal mask or a window; at d > 128 512), where the
    /// registry has one for the head dim and mask; else `mma.sync`. The default.
    Auto = 0,
    /// The `wgmma` kernels wherever the registry has one, whatever the length (tests).
    Wgmma = 1,
    /// Always the `mma.sync` kernels (`FLASH_ATTN_FWD=mma`).
    Mma = 2,
}

/// Which kernels the backward runs on Hopper (compute capability 9.0); other GPUs always run
/// the `mma.sync` kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardPath {
    /// The `wgmma` kernels wherever the registry has one for the head dim, mask and dropout;
    /// else `mma.sync`. The default.
    Auto = 0,
    /// Always the `mma.sync` kernels (`FLASH_ATTN_BWD=mma`).
    Mma = 2,
}

/// A kernel's module (kept alive as long as its function) and function.
struct Loaded {
    _module: Arc<CudaModule>,
    function: CudaFunction,
}

/// Number of CUDA devices; an error (not a panic) when the driver library is missing.
pub fn device_count() -> Result<usize> {
    if !crate::driver_lib::libcuda_present() {
        return Err(FlashError::NoDevice(
            "the CUDA driver library (libcuda.so) could not be loaded".into(),
        ));
    }
    let n = CudaContext::device_count().map_err(|e| FlashError::NoDevice(e.to_string()))?;
    Ok(n.max(0) as usize)
}

impl Device {
    /// Opens device `ordinal` (primary context) and creates a stream; loads no kernel yet.
    /// `FLASH_ATTN_PTX=sm80` forces the sm_80 kernels on newer devices and
    /// `FLASH_ATTN_JIT=1` the PTX (JIT) path instead of the embedded SASS, and
    /// `FLASH_ATTN_FWD=mma` or `=wgmma` one forward path on Hopper (see [`ForwardPath`]),
    /// `FLASH_ATTN_BWD=mma` the backward's `mma.sync` kernels there (see [`BackwardPath`]), and
    /// `FLASH_ATTN_WGMMA_PINGPONG=0` the `wgmma` kernels' schedule without turns, and
    /// `FLASH_ATTN_WGMMA_PERSISTENT=0` one block per query tile on the persistent ones, and
    /// `FLASH_ATTN_TILE_ORDER=0` their block-sparse launches' tiles in grid order rather than
    /// each head's longest first (and the fast-mode block-sparse backward's key tiles), and
    /// `FLASH_ATTN_WGMMA_WIDE=1` the plain kind's kernel of 176-key tiles on every call it covers
    /// (see [`Device::wgmma_wide_tiles`]), and `FLASH_ATTN_PDL=0` the backward's main kernel launched the
    /// ordinary way (see [`Device::overlapped_launches`]), for testing.
    /// Raises the release threshold of the
    /// device's default memory pool (where cudarc's allocations come from) from 0 to unlimited,
    /// unless something set it already or `FLASH_ATTN_POOL_RETAIN=0`: freed memory then stays in
    /// the pool for the next allocation of the process instead of being unmapped at every
    /// synchronisation and mapped again by the next call (about 0.25 ms per backward call on an
    /// H100); see [`Device::release_freed_memory`]. Fails with [`FlashError::NoDevice`] when there
    /// is no driver or no such device, and with [`FlashError::UnsupportedDevice`] below compute
    /// capability 8.0.
    pub fn new(ordinal: usize) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(FlashError::NoDevice(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let mut arch = Arch::for_compute_capability(major, minor)
            .ok_or(FlashError::UnsupportedDevice { major, minor })?;
        // Lets the sm_80 kernels (Ampere/Ada tiles) be tested on a Hopper machine.
        if std::env::var("FLASH_ATTN_PTX").is_ok_and(|v| v == "sm80") {
            arch = Arch::Sm80;
        }
        let force_ptx = std::env::var("FLASH_ATTN_JIT").is_ok_and(|v| v == "1");
        let forward_path = match std::env::var("FLASH_ATTN_FWD").as_deref() {
            Ok("mma") => ForwardPath::Mma,
            Ok("wgmma") => ForwardPath::Wgmma,
            _ => ForwardPath::Auto,
        };
        let backward_path = match std::env::var("FLASH_ATTN_BWD").as_deref() {
            Ok("mma") => BackwardPath::Mma,
            _ => BackwardPath::Auto,
        };
        let wgmma_schedule = match std::env::var("FLASH_ATTN_WGMMA_PINGPONG").as_deref() {
            Ok("0") => 0,
            _ => SCHEDULE_PINGPONG,
        };
        let wgmma_persistent = std::env::var("FLASH_ATTN_WGMMA_PERSISTENT").as_deref() != Ok("0");
        let sparse_tile_order = std::env::var("FLASH_ATTN_TILE_ORDER").as_deref() != Ok("0");
        let wgmma_wide_tiles = std::env::var("FLASH_ATTN_WGMMA_WIDE").as_deref() == Ok("1");
        let overlapped_launches = arch.waits_for_previous_grids()
            && std::env::var("FLASH_ATTN_PDL").as_deref() != Ok("0");
        let max_smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            as usize;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as usize;
        let memory_gbps_per_sm = peak_memory_gbps(&ctx) / sm_count as f64;
        // Every allocation and launch of a `Device` runs on its one stream, in order, so
        // cudarc's cross-stream event tracking has nothing to order; left on, it creates two
        // events per allocation and records one per use of a buffer (about a dozen driver
        // calls per attention call, which dominate small decode calls).
        // SAFETY: buffers of this context are only ever used on `stream` (`DeviceTensor`
        // exposes no other stream).
        unsafe { ctx.disable_event_tracking() };
        if std::env::var("FLASH_ATTN_POOL_RETAIN").as_deref() != Ok("0") {
            // Speed only: a driver that refuses leaves the pool as it was, and the device
            // works as before.
            let _ = crate::pool::retain_freed_memory(&ctx);
        }
        let stream = ctx.new_stream()?;
        let scratch = LaunchScratch::new(&stream)?;
        Ok(Self {
            ctx,
            stream,
            compute_capability: (major, minor),
            arch,
            force_ptx,
            forward_path: AtomicU8::new(forward_path as u8),
            backward_path: AtomicU8::new(backward_path as u8),
            wgmma_schedule,
            wgmma_persistent,
            sparse_tile_order,
            wgmma_wide_tiles,
            overlapped_launches,
            max_smem_optin,
            sm_count,
            memory_gbps_per_sm,
            loaded: Mutex::new(HashMap::new()),
            occupancy: Mutex::new(HashMap::new()),
            scratch,
        })
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Which embedded target the kernels come from (`"sm_80"` or `"sm_90a"`).
    pub fn ptx_arch(&self) -> &'static str {
        self.arch.info().cpu
    }

    /// The target whose kernels run here (selects the tile shapes).
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// Which kernels the forward takes on Hopper (see [`ForwardPath`]; from `FLASH_ATTN_FWD`
    /// at creation, `mma` or `wgmma`, else automatic).
    pub fn forward_path(&self) -> ForwardPath {
        match self.forward_path.load(Ordering::Relaxed) {
            1 => ForwardPath::Wgmma,
            2 => ForwardPath::Mma,
            _ => ForwardPath::Auto,
        }
    }

    /// Chooses the forward's kernels on Hopper for the calls made after this one (for
    /// comparisons and tests). Other GPUs have only the `mma.sync` kernels and ignore it.
    pub fn set_forward_path(&self, path: ForwardPath) {
        self.forward_path.store(path as u8, Ordering::Relaxed);
    }

    /// How the Hopper kernels' two consumer warpgroups issue their products: taking turns
    /// ([`SCHEDULE_PINGPONG`], the default), or as they come with
    /// `FLASH_ATTN_WGMMA_PINGPONG=0` (a diagnostic switch for benchmarks; both are exact).
    pub(crate) fn wgmma_schedule(&self) -> u32 {
        self.wgmma_schedule
    }

    /// Blocks of a persistent `wgmma` kernel for `tiles` query tiles: at most one per SM
    /// (which is all its shared memory allows), at every length; one per tile with
    /// `FLASH_ATTN_WGMMA_PERSISTENT=0` (a diagnostic switch; both are exact). Until
    /// 2026-11-27 calls over more than 4,096 keys took one block per tile (on the H100 of
    /// 2026-11-25 persistent blocks had gained nothing there); clock-locked on today's kernels
    /// persistent blocks take 0.965–0.995× the cycles at 8K and 16K keys, d = 64 and 128,
    /// causal and not, on the H100 and the H200 alike (docs/perf-notes.md).
    pub(crate) fn persistent_blocks(&self, tiles: usize) -> usize {
        if self.wgmma_persistent {
            tiles.min(self.sm_count)
        } else {
            tiles
        }
    }

    /// Whether the persistent block-sparse forward launches take their query tiles in the
    /// order of the key blocks each visits, most first (`crate::fwd`'s `tile_order`), and the
    /// fast-mode block-sparse backward launches their key tiles in the order of the query
    /// blocks each visits, most first (`crate::bwd_order`), rather than in grid order:
    /// `FLASH_ATTN_TILE_ORDER=0` turns both off (a diagnostic switch; both orders are exact).
    pub(crate) fn sparse_tile_order(&self) -> bool {
        self.sparse_tile_order
    }

    /// Whether forward calls take a `wgmma` kernel of key tiles wider than 128 (the plain
    /// kind's at d = 128) wherever the kind has one, causal and short calls included, rather
    /// than only where such tiles pay (at most 1/64 of the keys padding, causal calls from 8K
    /// keys): `FLASH_ATTN_WGMMA_WIDE=1`, a test switch (both are exact).
    pub fn wgmma_wide_tiles(&self) -> bool {
        self.wgmma_wide_tiles
    }

    /// Which kernels the backward takes on Hopper (see [`BackwardPath`]; from
    /// `FLASH_ATTN_BWD` at creation, `mma`, else automatic).
    pub fn backward_path(&self) -> BackwardPath {
        match self.backward_path.load(Ordering::Relaxed) {
            2 => BackwardPath::Mma,
            _ => BackwardPath::Auto,
        }
    }

    /// Chooses the backward's kernels on Hopper for the calls made after this one (for
    /// comparisons and tests). Other GPUs have only the `mma.sync` kernels and ignore it.
    pub fn set_backward_path(&self, path: BackwardPath) {
        self.backward_path.store(path as u8, Ordering::Relaxed);
    }

    /// Whether the backward runs on the `wgmma` kernels where the registry has one.
    pub(crate) fn wgmma_backward(&self) -> bool {
        self.arch == Arch::Sm90a && self.backward_path() == BackwardPath::Auto
    }

    /// Whether a forward call takes Hopper's `wgmma` kernels (where the registry has one for
    /// it), given whether it is long enough for them to pay (`long`, for
    /// [`ForwardPath::Auto`]).
    pub(crate) fn wgmma_forward(&self, long: bool) -> bool {
        self.arch == Arch::Sm90a
            && match self.forward_path() {
                ForwardPath::Auto => long,
                ForwardPath::Wgmma => true,
                ForwardPath::Mma => false,
            }
    }

    /// Whether the backward's main kernel is launched with programmatic stream serialization,
    /// so that its launch overlaps the end of the pre-pass (sm_90a, whose kernels all wait for
    /// the previous grid before touching memory; off with `FLASH_ATTN_PDL=0`; see
    /// `launch.rs`).
    pub fn overlapped_launches(&self) -> bool {
        self.overlapped_launches
    }

    /// Whether kernels load as embedded SASS (`true`) or through the driver's PTX JIT.
    pub fn uses_sass(&self) -> bool {
        let (major, minor) = self.compute_capability;
        !self.force_ptx && self.arch.sass_runs_on(major, minor)
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

    /// Waits for this device's stream, then gives the memory freed into the device's default
    /// pool back to the driver (see [`Device::new`]; for applications that share the GPU with
    /// code that does not allocate from the pool).
    pub fn release_freed_memory(&self) -> Result<()> {
        self.synchronize()?;
        crate::pool::release_freed_memory(&self.ctx)
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

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// Peak memory bandwidth per SM in GB/s, from the driver's memory clock and bus width (0
    /// when the driver reports neither); the decode path's split choice reads it.
    pub fn memory_gbps_per_sm(&self) -> f64 {
        self.memory_gbps_per_sm
    }

    /// Blocks of kernel `name` (launched with `threads` threads and `smem` bytes of dynamic
    /// shared memory, always the same for one kernel) that the whole GPU holds at once: the
    /// driver's occupancy for one SM times the SMs. Asked once per kernel.
    pub(crate) fn resident_blocks(
        &self,
        name: &'static str,
        threads: u32,
        smem: usize,
    ) -> Result<usize> {
        if let Some(&n) = self
            .occupancy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
        {
            return Ok(n);
        }
        let per_sm = self
            .function(name, smem)?
            .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)?;
        let n = self.sm_count * (per_sm.max(1) as usize);
        self.occupancy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name, n);
        Ok(n)
    }

    /// The buffer of the calls' launch data (see [`crate::scratch`]).
    pub(crate) fn launch_scratch(&self) -> &LaunchScratch {
        &self.scratch
    }

    /// Kernel `name`, loaded on first use, with its dynamic shared-memory limit raised to
    /// `smem`.
    pub(crate) fn function(&self, name: &'static str, smem: usize) -> Result<CudaFunction> {
        if smem > self.max_smem_optin {
            return Err(FlashError::UnsupportedDevice {
                major: self.compute_capability.0,
                minor: self.compute_capability.1,
            });
        }
        let mut map = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = map.get(name) {
            return Ok(k.function.clone());
        }
        let code = kernels::code(self.arch, name).ok_or_else(|| {
            FlashError::Internal(format!("kernel {name} is not embedded for {:?}", self.arch))
        })?;
        let module = if self.uses_sass() {
            // A driver too old for the cubin's ELF version refuses it: fall back to the PTX.
            match self.ctx.load_module(Ptx::from_binary(code.sass()?)) {
                Ok(m) => m,
                Err(_) => self.ctx.load_module(Ptx::from_src(code.ptx()?))?,
            }
        } else {
            self.ctx.load_module(Ptx::from_src(code.ptx()?))?
        };
        let function = module.load_function(name)?;
        if smem > 48 * 1024 {
            function.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        map.insert(
            name,
            Loaded {
                _module: module,
                function: function.clone(),
            },
        );
        Ok(function)
    }
}

/// Peak memory bandwidth of `ctx`'s GPU in GB/s: two transfers per memory clock over the bus
/// (3.35 TB/s on the H100 SXM, 4.9 on the H200); 0 where the driver reports no clock or width.
fn peak_memory_gbps(ctx: &CudaContext) -> f64 {
    let attribute = |a| ctx.attribute(a).ok().filter(|&v| v > 0).map(f64::from);
    let clock_khz = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE);
    let bus_bits = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
    match (clock_khz, bus_bits) {
        (Some(khz), Some(bits)) => 2.0 * khz * 1e3 * bits / 8.0 / 1e9,
        _ => 0.0,
    }
}
