//! GPU test helpers: the shared device (or a loud SKIPPED line), uploads in several layouts and
//! downloads.

use flash_attn::{Device, DeviceTensor, Element};
use ndarray::{Array3, Array4, ArrayView4, Ix3, Ix4};
use std::sync::OnceLock;

/// The shared device, or `None` (after a loud message) when there is none.
pub fn device(suite: &str) -> Option<&'static Device> {
    static DEV: OnceLock<Option<Device>> = OnceLock::new();
    DEV.get_or_init(|| match timed(|| Device::new(0)) {
        (Ok(d), load_time) => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "GPU tests on {} (compute capability {:?}, PTX {}, Device::new took {load_time:.2?})",
                d.name().unwrap_or_default(),
                d.compute_capability(),
                d.ptx_arch()
            );
            Some(d)
        }
        (Err(e), _) => {
            if std::env::var("FLASH_ATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("FLASH_ATTN_REQUIRE_GPU=1 but no usable GPU: {e}");
            }
            None
        }
    })
    .as_ref()
    .or_else(|| {
        static REPORTED: OnceLock<()> = OnceLock::new();
        REPORTED.get_or_init(|| {
            // Written to the real stderr: the test harness captures `eprintln!` of passing tests.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "\n***** SKIPPED: the GPU tests of {suite} did not run: no CUDA device/driver on this machine *****\n"
            );
        });
        None
    })
}

/// `f()` and how long it took.
pub fn timed<R>(f: impl FnOnce() -> R) -> (R, std::time::Duration) {
    let t0 = std::time::Instant::now();
    let r = f();
    (r, t0.elapsed())
}

/// How an input tensor is laid out in device memory.
#[derive(Clone, Copy, Debug)]
pub enum Layout {
    /// `[B, N, H, d]` row-major.
    Contiguous,
    /// `[B, H, N, d]` in memory, viewed as `[B, N, H, d]`.
    HeadMajor,
    /// Rows padded by `extra` elements after `d` (as in a packed QKV buffer), plus a leading
    /// offset of `extra` elements.
    Padded { extra: usize },
}

/// Uploads `a` (`[B, N, H, d]`) with the given layout.
pub fn upload<T: Element>(dev: &Device, a: ArrayView4<T>, layout: Layout) -> DeviceTensor<T> {
    let [b, n, h, d] = [a.dim().0, a.dim().1, a.dim().2, a.dim().3];
    let (mem_shape, strides, offset, data): ([usize; 4], [usize; 4], usize, Vec<T>) = match layout {
        Layout::Contiguous => (
            [b, n, h, d],
            [n * h * d, h * d, d, 1],
            0,
            a.iter().copied().collect(),
        ),
        Layout::HeadMajor => {
            let data = a.permuted_axes([0, 2, 1, 3]).iter().copied().collect();
            ([b, h, n, d], [h * n * d, d, n * d, 1], 0, data)
        }
        Layout::Padded { extra } => {
            let row = d + extra;
            let mut data = vec![T::nan(); extra + b * n * h * row];
            for ((ib, i, ih, id), &x) in a.indexed_iter() {
                data[extra + ((ib * n + i) * h + ih) * row + id] = x;
            }
            (
                [data.len(), 1, 1, 1],
                [n * h * row, h * row, row, 1],
                extra,
                data,
            )
        }
    };
    let t = DeviceTensor::from_host(dev, &[mem_shape.iter().product()], &data).expect("upload");
    t.with_layout(&[b, n, h, d], &strides, offset)
        .expect("layout")
}

pub fn download4<T: Element>(dev: &Device, t: &DeviceTensor<T>) -> Array4<T> {
    t.to_ndarray(dev)
        .expect("download")
        .into_dimensionality::<Ix4>()
        .expect("rank 4")
}

pub fn download3(dev: &Device, t: &DeviceTensor<f32>) -> Array3<f32> {
    t.to_ndarray(dev)
        .expect("download")
        .into_dimensionality::<Ix3>()
        .expect("rank 3")
}

/// Random cases per GPU property test: `FLASH_ATTN_GPU_CASES`, 64 when unset.
pub fn gpu_cases() -> u32 {
    std::env::var("FLASH_ATTN_GPU_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}
