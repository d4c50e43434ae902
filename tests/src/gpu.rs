//! GPU test helpers: the shared device (or a loud SKIPPED line), uploads in several layouts and
//! downloads, and one forward or backward case against the float64 reference.

use crate::{
    check_accuracy, check_gradient_accuracy, max_abs_diff, random_array, random_qkv, to_f64,
    Magnitude, GPU_GRADIENT_FACTOR,
};
use flash_attn::cpu::{
    attention_backward_naive, attention_backward_reference, attention_backward_reference_given,
    attention_naive, attention_reference,
};
use flash_attn::shape::AttnShape;
use flash_attn::{
    flash_attn, flash_attn_backward_into, flash_attn_into, AttnParams, BwdMode, Device,
    DeviceTensor, Element, FlashError,
};
use ndarray::{Array3, Array4, ArrayView4, Ix3, Ix4};
use rand::rngs::StdRng;
use rand::SeedableRng;
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

/// Query and KV heads (GQA) of the persistent-block properties, whose calls have many more
/// query tiles (of 128 rows, or 192 for the kernels of three consumer warpgroups) than an
/// H100 has SMs.
pub const PERSISTENT_HEADS: [(usize, usize); 4] = [(16, 16), (16, 4), (24, 1), (12, 3)];
/// Head dims of the persistent-block properties (the persistent kernels': 33..=64, 65..=128).
pub const PERSISTENT_DIMS: [usize; 4] = [48, 64, 100, 128];
/// Query lengths of the persistent-block properties (2 to 5 query tiles of 128 rows, the
/// last of one row; 1 to 4 of 192).
pub const PERSISTENT_LENS_Q: [usize; 3] = [129, 385, 577];
/// Key lengths of the persistent-block properties: up to 4 key tiles of 128 (7 of 64), few
/// enough to keep the float64 reference affordable; queries longer than keys give causal
/// tiles that see none.
pub const PERSISTENT_LENS_K: [usize; 4] = [1, 65, 200, 385];

/// Random cases per GPU property test: `FLASH_ATTN_GPU_CASES`, 64 when unset.
pub fn gpu_cases() -> u32 {
    std::env::var("FLASH_ATTN_GPU_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

/// Fresh Q, K, V of `shape` from `seed` (sized for `params`' softmax scale), and the
/// generator for whatever the case draws next.
fn seeded_qkv<T: Element>(
    seed: u64,
    shape: &AttnShape,
    params: &AttnParams,
    magnitude: Magnitude,
) -> Result<(StdRng, [Array4<T>; 3]), FlashError> {
    let scale = params.scale(shape.head_dim)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let (q, k, v) = random_qkv::<T>(&mut rng, shape, magnitude, scale);
    Ok((rng, [q, k, v]))
}

/// One forward case: fresh inputs of `shape` (seeded), uploaded in `layout`, NaN-poisoned
/// outputs, `flash_attn_into` with `params`, and the accuracy rule of [`check_accuracy`]
/// against the float64 reference and the naive implementation in `T`. With
/// `FLASH_ATTN_TEST_VERBOSE` set, prints both errors.
pub fn forward_case<T: Element>(
    dev: &Device,
    seed: u64,
    shape: AttnShape,
    params: &AttnParams,
    magnitude: Magnitude,
    layout: Layout,
) -> Result<(), String> {
    let err = |e: FlashError| format!("{shape:?} {params:?}: {e}");
    let (_, [q, k, v]) = seeded_qkv::<T>(seed, &shape, params, magnitude).map_err(err)?;
    let up = |a: &Array4<T>| upload(dev, a.view(), layout);
    let (qd, kd, vd) = (up(&q), up(&k), up(&v));
    let mut o = DeviceTensor::<T>::zeros(dev, &shape.q_dims()).map_err(err)?;
    let mut lse = DeviceTensor::<f32>::zeros(dev, &shape.lse_dims()).map_err(err)?;
    o.fill_nan(dev).map_err(err)?;
    lse.fill_nan(dev).map_err(err)?;
    flash_attn_into(dev, &qd, &kd, &vd, params, &mut o, &mut lse).map_err(err)?;
    let (o, lse) = (download4(dev, &o), download3(dev, &lse));
    let f64s = |a: &Array4<T>| to_f64(a.view());
    let reference = attention_reference(f64s(&q).view(), f64s(&k).view(), f64s(&v).view(), params)
        .map_err(err)?;
    let naive = attention_naive(q.view(), k.view(), v.view(), params).map_err(err)?;
    if std::env::var_os("FLASH_ATTN_TEST_VERBOSE").is_some() {
        use std::io::Write;
        let e = |a: ndarray::ArrayView4<f64>| max_abs_diff(a, reference.0.view());
        let _ = writeln!(
            std::io::stderr(),
            "{shape:?} {params:?} {magnitude:?} {layout:?}: max|O-ref| ours {:.3e}, naive {:.3e}",
            e(to_f64(o.view()).view()),
            e(to_f64(naive.0.view()).view())
        );
    }
    check_accuracy(
        (o.view(), lse.view()),
        (naive.0.view(), naive.1.view()),
        (reference.0.view(), reference.1.view()),
    )
    .map_err(|e| format!("{shape:?} {params:?} {magnitude:?} {layout:?}: {e}"))
}

/// One backward case: fresh inputs and dO of `shape` (seeded), uploaded in `layout`, the GPU
/// forward, NaN-poisoned gradients, the GPU backward in `mode`, and the gradient rule of
/// [`check_gradient_accuracy`] against the float64 reference gradients.
pub fn backward_case<T: Element>(
    dev: &Device,
    seed: u64,
    shape: AttnShape,
    params: &AttnParams,
    magnitude: Magnitude,
    layout: Layout,
    mode: BwdMode,
) -> Result<(), String> {
    let err = |e: FlashError| format!("{shape:?} {params:?}: {e}");
    let (mut rng, [q, k, v]) = seeded_qkv::<T>(seed, &shape, params, magnitude).map_err(err)?;
    let d_o = random_array::<T>(&mut rng, shape.q_dims(), 1.0);
    let up = |a: &Array4<T>| upload(dev, a.view(), layout);
    let (qd, kd, vd, dod) = (up(&q), up(&k), up(&v), up(&d_o));
    let (o, lse) = flash_attn(dev, &qd, &kd, &vd, params).map_err(err)?;
    let mut dq = DeviceTensor::<T>::zeros(dev, &shape.q_dims()).map_err(err)?;
    let mut dk = DeviceTensor::<T>::zeros(dev, &shape.kv_dims()).map_err(err)?;
    let mut dv = DeviceTensor::<T>::zeros(dev, &shape.kv_dims()).map_err(err)?;
    for t in [&mut dq, &mut dk, &mut dv] {
        t.fill_nan(dev).map_err(err)?;
    }
    flash_attn_backward_into(
        dev, &qd, &kd, &vd, &o, &dod, &lse, params, mode, &mut dq, &mut dk, &mut dv,
    )
    .map_err(err)?;
    let ours = [
        download4(dev, &dq),
        download4(dev, &dk),
        download4(dev, &dv),
    ];
    let (o, lse) = (download4(dev, &o), download3(dev, &lse));
    let f64s = |a: &Array4<T>| to_f64(a.view());
    let (q64, k64, v64, do64) = (f64s(&q), f64s(&k), f64s(&v), f64s(&d_o));
    let reference =
        attention_backward_reference(q64.view(), k64.view(), v64.view(), do64.view(), params)
            .map_err(err)?;
    let given = attention_backward_reference_given(
        q64.view(),
        k64.view(),
        v64.view(),
        f64s(&o).view(),
        do64.view(),
        lse.mapv(f64::from).view(),
        params,
    )
    .map_err(err)?;
    let naive =
        attention_backward_naive(q.view(), k.view(), v.view(), d_o.view(), params).map_err(err)?;
    check_gradient_accuracy(
        GPU_GRADIENT_FACTOR,
        [ours[0].view(), ours[1].view(), ours[2].view()],
        [naive.0.view(), naive.1.view(), naive.2.view()],
        [given.0.view(), given.1.view(), given.2.view()],
        [reference.0.view(), reference.1.view(), reference.2.view()],
    )
    .map_err(|e| format!("{shape:?} {params:?} {magnitude:?} {layout:?} {mode:?}: {e}"))
}
