//! A self-test of Hopper's warpgroup products: runs the `wgmma` layout probe kernel (see
//! `flash_attn_kernels::params::ProbeParams`) so a test can compare each product shape the
//! Hopper forward uses with a CPU product.

use flash_attn_kernels::arch::Arch;
use flash_attn_kernels::config::{PROBE_SMEM_BYTES, PROBE_THREADS};
use flash_attn_kernels::params::ProbeParams;
use flash_attn_kernels::registry::WGMMA_PROBE_KERNELS;

use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{FlashError, Result};
use crate::launch::{launch, Order};
use crate::tensor::DeviceTensor;

/// Rows of A, P, S and O.
const M: usize = 64;
/// Columns of A.
const K: usize = 64;
/// Columns of V and O.
const DV: usize = 128;
/// Rows of V, columns of P and S.
const N: usize = 128;
/// Rows of B, columns of the 176-key product's S.
const N_WIDE: usize = 176;

/// What the `wgmma` layout probe computed (f32, row-major).
#[derive(Clone, Debug)]
pub struct WgmmaProbe {
    /// `S = A·Bᵀ` over all of B's rows, `[64][176]`, by `wgmma.m64n176k16` with both
    /// operands in shared memory.
    pub s_n176: Vec<f32>,
    /// S's first 128 columns, `[64][128]`, by `wgmma.m64n128k16` with both operands in
    /// shared memory.
    pub s: Vec<f32>,
    /// S's first 64 columns, `[64][64]`, by `wgmma.m64n64k16` with both operands in shared
    /// memory.
    pub s_n64: Vec<f32>,
    /// `O = P·V`, `[64][128]`, by `wgmma.m64n128k16` with P in registers and V transposed.
    pub o: Vec<f32>,
    /// `O = P·V` again, `[64][128]`, by `wgmma.m64n64k16` per 64-column block of V.
    pub o_n64: Vec<f32>,
    /// `G = V₀ᵀ·V₁`, `[64][64]` (V's first 64 columns transposed times its last 64), by
    /// `wgmma.m64n64k16` with both operands transposed in shared memory (the backward's dQ).
    pub g_tt: Vec<f32>,
}

/// Runs the `wgmma` layout probe on `dev` (compute capability 9.0 only): see [`WgmmaProbe`],
/// where A is `[64][64]`, B `[176][64]`, P `[64][128]` and V `[128][128]`
/// (row-major, f16 or bf16). Each accumulator element is written where the kernels' fragment
/// layout places it, so a layout error shows as wrong elements. Errors:
/// [`FlashError::UnsupportedDevice`] elsewhere than on sm_90a, [`FlashError::Shape`] for other
/// sizes, [`FlashError::DType`] for f32.
pub fn wgmma_layout_probe<T: Element>(
    dev: &Device,
    a: &[T],
    b: &[T],
    p: &[T],
    v: &[T],
) -> Result<WgmmaProbe> {
    if dev.arch() != Arch::Sm90a {
        let (major, minor) = dev.compute_capability();
        return Err(FlashError::UnsupportedDevice { major, minor });
    }
    let name = match T::DTYPE {
        DType::F16 => WGMMA_PROBE_KERNELS[0],
        DType::BF16 => WGMMA_PROBE_KERNELS[1],
        _ => return Err(FlashError::DType("the probe takes f16 or bf16".into())),
    };
    for (what, got, want) in [
        ("A", a.len(), M * K),
        ("B", b.len(), N_WIDE * K),
        ("P", p.len(), M * N),
        ("V", v.len(), N * DV),
    ] {
        if got != want {
            return Err(FlashError::Shape(format!(
                "probe operand {what}: {got} elements, expected {want}"
            )));
        }
    }
    let up = |x: &[T]| DeviceTensor::from_host(dev, &[x.len()], x);
    let (a, b, p, v) = (up(a)?, up(b)?, up(p)?, up(v)?);
    let s176 = DeviceTensor::<f32>::zeros(dev, &[M * N_WIDE])?;
    let s = DeviceTensor::<f32>::zeros(dev, &[M * N])?;
    let o = DeviceTensor::<f32>::zeros(dev, &[M * DV])?;
    let o64 = DeviceTensor::<f32>::zeros(dev, &[M * DV])?;
    let s64 = DeviceTensor::<f32>::zeros(dev, &[M * K])?;
    let g = DeviceTensor::<f32>::zeros(dev, &[M * DV / 2])?;
    let params = ProbeParams {
        a: a.device_address(dev),
        b: b.device_address(dev),
        p: p.device_address(dev),
        v: v.device_address(dev),
        s: s.device_address(dev),
        o: o.device_address(dev),
        s64: s64.device_address(dev),
        o64: o64.device_address(dev),
        g: g.device_address(dev),
        s176: s176.device_address(dev),
    };
    // SAFETY: every buffer is live and of the size the kernel reads or writes; one block of
    // the probe's threads and shared memory.
    unsafe {
        launch(
            dev,
            Order::Stream,
            name,
            (1, 1, 1),
            PROBE_THREADS as u32,
            PROBE_SMEM_BYTES,
            params,
        )?
    };
    Ok(WgmmaProbe {
        s_n176: s176.to_host(dev)?,
        s: s.to_host(dev)?,
        s_n64: s64.to_host(dev)?,
        o: o.to_host(dev)?,
        o_n64: o64.to_host(dev)?,
        g_tt: g.to_host(dev)?,
    })
}
