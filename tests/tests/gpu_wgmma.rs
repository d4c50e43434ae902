//! The fragment layout of every `wgmma` shape the Hopper forward and backward use, checked on
//! the GPU: `wgmma_layout_probe` runs `m64n176k16`, `m64n128k16` and `m64n64k16` (both
//! operands in shared memory), the same two shapes with A in registers and B transposed, and `m64n64k16` with
//! both operands transposed, through the kernels' own wrappers, descriptors and tile layout, and every output element must equal the CPU product (exactly up to f32 summation
//! order: the products of 16-bit values are exact in f32).
//!
//! Without a Hopper GPU (compute capability 9.0) the test prints a loud SKIPPED line and
//! passes, unless `FLASH_ATTN_REQUIRE_GPU=1` and no GPU at all is present.

use flash_attn::probe::wgmma_layout_probe;
use flash_attn::{Device, Element};
use flash_attn_tests::gpu::device as gpu_device;
use half::{bf16, f16};
use rand::{Rng, SeedableRng};

fn device() -> Option<&'static Device> {
    gpu_device("gpu_wgmma")
}

/// `n` random values in [-1, 1) as `T`, and their exact f64 values.
fn random<T: Element>(rng: &mut rand::rngs::StdRng, n: usize) -> (Vec<T>, Vec<f64>) {
    let v: Vec<T> = (0..n)
        .map(|_| T::from_f32(rng.gen_range(-1.0f32..1.0)))
        .collect();
    let x = v.iter().map(|t| t.to_f32() as f64).collect();
    (v, x)
}

/// `c[i][j] = Σ_k a[i][k]·b(k, j)` for an `m × kk` A, compared with `got` element by element.
fn check(
    what: &str,
    got: &[f32],
    m: usize,
    n: usize,
    kk: usize,
    a: &[f64],
    b: impl Fn(usize, usize) -> f64,
) {
    for i in 0..m {
        for j in 0..n {
            let want: f64 = (0..kk).map(|k| a[i * kk + k] * b(k, j)).sum();
            let x = got[i * n + j] as f64;
            assert!(
                (x - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "{what}[{i}][{j}] = {x}, expected {want}"
            );
        }
    }
}

fn probe<T: Element>(dev: &Device, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (a, a64) = random::<T>(&mut rng, 64 * 64);
    let (b, b64) = random::<T>(&mut rng, 176 * 64);
    let (p, p64) = random::<T>(&mut rng, 64 * 128);
    let (v, v64) = random::<T>(&mut rng, 128 * 128);
    let out = wgmma_layout_probe(dev, &a, &b, &p, &v).unwrap();
    // S = A·Bᵀ (B stored [n][k]) over 176, 128 and 64 of B's rows; O = P·V (V stored [k][n]).
    check("S176", &out.s_n176, 64, 176, 64, &a64, |k, j| {
        b64[j * 64 + k]
    });
    check("S", &out.s, 64, 128, 64, &a64, |k, j| b64[j * 64 + k]);
    check("S64", &out.s_n64, 64, 64, 64, &a64, |k, j| b64[j * 64 + k]);
    check("O", &out.o, 64, 128, 128, &p64, |k, j| v64[k * 128 + j]);
    check("O64", &out.o_n64, 64, 128, 128, &p64, |k, j| {
        v64[k * 128 + j]
    });
    // G = V₀ᵀ·V₁: A = V's first 64 columns transposed, B = its last 64.
    let v0t: Vec<f64> = (0..64 * 128)
        .map(|x| v64[(x % 128) * 128 + x / 128])
        .collect();
    check("G", &out.g_tt, 64, 64, 128, &v0t, |k, j| {
        v64[k * 128 + 64 + j]
    });
}

#[test]
fn every_wgmma_shape_has_the_fragment_layout_the_kernels_assume() {
    let Some(dev) = device() else { return };
    if dev.compute_capability() != (9, 0) {
        eprintln!(
            "gpu_wgmma: SKIPPED: the wgmma probe needs compute capability 9.0, this GPU is {:?}",
            dev.compute_capability()
        );
        return;
    }
    for seed in 0..4 {
        probe::<f16>(dev, seed);
        probe::<bf16>(dev, 100 + seed);
    }
}
