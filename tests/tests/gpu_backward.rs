//! The backward kernels on the GPU against the float64 reference gradients, with the
//! gradient accuracy rule of `flash_attn_tests::check_gradient_accuracy`. The forward runs on
//! the GPU too (the backward takes its O and LSE); the gradients are poisoned with NaN before
//! every launch.
//!
//! Without a CUDA device every test prints a loud SKIPPED line and passes, unless
//! `FLASH_ATTN_REQUIRE_GPU=1`.

use flash_attn::shape::AttnShape;
use flash_attn::{
    backward_kernel_name, flash_attn, AttnParams, BackwardPath, BwdMode, DType, Device,
    DeviceTensor, Element, FlashError,
};
use flash_attn_kernels::arch::Arch;
use flash_attn_tests::gpu::{backward_case, device as gpu_device, download4, gpu_cases, Layout};
use flash_attn_tests::{
    attention_mask_recipes, mask_recipes, random_array, random_qkv, Magnitude, MaskRecipe,
};
use half::{bf16, f16};
use proptest::prelude::*;
use rand::SeedableRng;

/// The shared device, or `None` after a loud SKIPPED line.
fn device() -> Option<&'static Device> {
    gpu_device("gpu_backward")
}

/// One case (see [`backward_case`]).
fn run_case<T: Element>(
    dev: &Device,
    seed: u64,
    shape: AttnShape,
    params: AttnParams<'static>,
    magnitude: Magnitude,
    layout: Layout,
    mode: BwdMode,
) -> Result<(), String> {
    backward_case::<T>(dev, seed, shape, &params, magnitude, layout, mode)
}

/// Sizes and options: odd lengths, GQA/MQA, every head dim the GPU backward takes (odd ones
/// run padded), causal, scales, layouts, every mask recipe.
fn case_strategy() -> impl Strategy<Value = (u64, AttnShape, AttnParams<'static>, Magnitude, Layout)>
{
    case_strategy_with(
        &[
            8usize, 16, 24, 32, 40, 64, 72, 80, 96, 100, 128, 136, 200, 256,
        ],
        attention_mask_recipes(),
    )
}

/// The cases Hopper's `wgmma` backward takes by default: head dims up to 128 (run on the
/// d = 64 and d = 128 kernels) with no mask beyond causal, a block-sparse mask, or windows
/// and ALiBi without a softcap.
fn wgmma_case_strategy(
) -> impl Strategy<Value = (u64, AttnShape, AttnParams<'static>, Magnitude, Layout)> {
    let uncapped = mask_recipes().prop_map(|r| MaskRecipe { softcap: None, ..r });
    let sparse =
        (prop::sample::select(&[0u8, 4, 8, 12, 16][..]), any::<u64>()).prop_map(|(s, seed)| {
            MaskRecipe {
                seed,
                sparse: Some(s),
                ..MaskRecipe::NONE
            }
        });
    let masks = prop_oneof![2 => Just(MaskRecipe::NONE), 1 => sparse, 1 => uncapped];
    case_strategy_with(&[8usize, 16, 32, 40, 64, 72, 96, 100, 128], masks)
}

/// [`case_strategy`] over the head dims `dims` and masks `masks`.
fn case_strategy_with(
    dims: &'static [usize],
    masks: impl Strategy<Value = MaskRecipe>,
) -> impl Strategy<Value = (u64, AttnShape, AttnParams<'static>, Magnitude, Layout)> {
    let lens =
        prop::sample::select(&[1usize, 7, 16, 31, 63, 64, 65, 127, 128, 129, 200, 385, 777][..]);
    let heads = prop::sample::select(&[(1usize, 1usize), (2, 1), (4, 2), (3, 3), (8, 1)][..]);
    let dims = prop::sample::select(dims);
    let scales = prop::sample::select(&[None, Some(0.3f32), Some(-0.25), Some(0.0)][..]);
    let layouts = prop::sample::select(
        &[
            Layout::Contiguous,
            Layout::HeadMajor,
            Layout::Padded { extra: 3 },
        ][..],
    );
    let mags = prop::sample::select(&[Magnitude::Normal, Magnitude::Large][..]);
    (
        any::<u64>(),
        1..3usize,
        lens.clone(),
        lens,
        heads,
        dims,
        any::<bool>(),
        scales,
        (mags, layouts, masks),
    )
        .prop_map(
            |(
                seed,
                batch,
                seqlen_q,
                seqlen_k,
                (heads_q, heads_kv),
                head_dim,
                causal,
                softmax_scale,
                (mag, layout, masks),
            )| {
                let shape = AttnShape {
                    batch,
                    seqlen_q,
                    seqlen_k,
                    heads_q,
                    heads_kv,
                    head_dim,
                };
                (
                    seed,
                    shape,
                    masks.params_for(causal, softmax_scale, &shape),
                    mag,
                    layout,
                )
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpu_cases(), ..ProptestConfig::default() })]

    /// On Hopper (default path) every case runs the `wgmma` backward, f16 then bf16.
    #[test]
    fn backward_at_wgmma_kernels_matches_reference((seed, shape, params, mag, layout) in wgmma_case_strategy(), det in any::<bool>()) {
        if let Some(dev) = device() {
            let mode = if det { BwdMode::Deterministic } else { BwdMode::Fast };
            if dev.arch() == Arch::Sm90a && dev.backward_path() == BackwardPath::Auto {
                let name = backward_kernel_name(dev, DType::BF16, shape.head_dim, &params).unwrap();
                prop_assert!(name.contains("wgmma"), "{}", name);
            }
            prop_assert_eq!(run_case::<f16>(dev, seed, shape, params, mag, layout, mode), Ok(()));
            prop_assert_eq!(run_case::<bf16>(dev, seed ^ 1, shape, params, mag, layout, mode), Ok(()));
        }
    }

    #[test]
    fn backward_f16_matches_reference((seed, shape, params, mag, layout) in case_strategy(), det in any::<bool>()) {
        if let Some(dev) = device() {
            let mode = if det { BwdMode::Deterministic } else { BwdMode::Fast };
            prop_assert_eq!(run_case::<f16>(dev, seed, shape, params, mag, layout, mode), Ok(()));
        }
    }

    #[test]
    fn backward_bf16_matches_reference((seed, shape, params, mag, layout) in case_strategy(), det in any::<bool>()) {
        if let Some(dev) = device() {
            let mode = if det { BwdMode::Deterministic } else { BwdMode::Fast };
            prop_assert_eq!(run_case::<bf16>(dev, seed, shape, params, mag, layout, mode), Ok(()));
        }
    }
}

/// Every backward kernel of the registry, causal and not, at sizes spanning several tiles,
/// with GQA; rows that see no key (causal, Nq > Nk) must get zero dQ.
#[test]
fn every_backward_kernel() {
    let Some(dev) = device() else { return };
    for d in flash_attn_kernels::registry::BWD_KERNELS
        .iter()
        .map(|k| k.head_dim)
    {
        for causal in [false, true] {
            let shape = AttnShape {
                batch: 2,
                seqlen_q: 300,
                seqlen_k: 213,
                heads_q: 4,
                heads_kv: 2,
                head_dim: d,
            };
            let params = AttnParams {
                causal,
                softmax_scale: None,
                ..AttnParams::default()
            };
            run_case::<f16>(
                dev,
                d as u64,
                shape,
                params,
                Magnitude::Normal,
                Layout::Contiguous,
                BwdMode::Fast,
            )
            .unwrap();
            run_case::<bf16>(
                dev,
                d as u64 + 1,
                shape,
                params,
                Magnitude::Large,
                Layout::Contiguous,
                BwdMode::Deterministic,
            )
            .unwrap();
        }
    }
}

/// Head dims the GPU backward has no kernel for (above 256, as the forward) are a typed error
/// before any launch.
#[test]
fn head_dims_above_256_are_typed_errors() {
    let Some(dev) = device() else { return };
    let shape = AttnShape {
        batch: 1,
        seqlen_q: 8,
        seqlen_k: 8,
        heads_q: 1,
        heads_kv: 1,
        head_dim: 264,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (q, k, v) = random_qkv::<f16>(&mut rng, &shape, Magnitude::Normal, 0.1);
    let up = |a: &ndarray::Array4<f16>| DeviceTensor::from_ndarray(dev, a.view()).unwrap();
    let lse = DeviceTensor::<f32>::zeros(dev, &[1, 1, 8]).unwrap();
    let r = flash_attn::flash_attn_backward(
        dev,
        &up(&q),
        &up(&k),
        &up(&v),
        &up(&q),
        &up(&q),
        &lse,
        &AttnParams::default(),
        BwdMode::Fast,
    );
    assert!(matches!(r, Err(FlashError::HeadDim(264))), "{:?}", r.err());
}

/// Deterministic mode: 100 runs give bit-identical dQ, dK and dV, with GQA, on a shape whose
/// grid fills the GPU many times over (4 × 4 (batch, KV head) pairs × 16 key tiles), causal
/// (the blocks reach a query tile in turn), not causal (they all start at the first one) and
/// with a sliding window and a softcap (the general mask's kernel; on Hopper `mma.sync` with
/// dQ through the bulk engine).
#[test]
fn deterministic_mode_is_bit_identical_over_100_runs() {
    let Some(dev) = device() else { return };
    let shape = AttnShape {
        batch: 4,
        seqlen_q: 2048,
        seqlen_k: 2048,
        heads_q: 16,
        heads_kv: 4,
        head_dim: 128,
    };
    let causal = AttnParams {
        causal: true,
        ..AttnParams::default()
    };
    let windowed = AttnParams {
        window: Some((300, 0)),
        softcap: Some(30.0),
        ..AttnParams::default()
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let (q, k, v) = random_qkv::<bf16>(&mut rng, &shape, Magnitude::Normal, 0.088);
    let d_o = random_array::<bf16>(&mut rng, shape.q_dims(), 1.0);
    let up = |a: &ndarray::Array4<bf16>| DeviceTensor::from_ndarray(dev, a.view()).unwrap();
    let (qd, kd, vd, dod) = (up(&q), up(&k), up(&v), up(&d_o));
    let bits = |t: &DeviceTensor<bf16>| -> Vec<u16> {
        download4(dev, t).iter().map(|x| x.to_bits()).collect()
    };
    for params in [causal, AttnParams::default(), windowed] {
        let (o, lse) = flash_attn(dev, &qd, &kd, &vd, &params).unwrap();
        let mut first: Option<[Vec<u16>; 3]> = None;
        for run in 0..100 {
            let (dq, dk, dv) = flash_attn::flash_attn_backward(
                dev,
                &qd,
                &kd,
                &vd,
                &o,
                &dod,
                &lse,
                &params,
                BwdMode::Deterministic,
            )
            .unwrap();
            let now = [bits(&dq), bits(&dk), bits(&dv)];
            match &first {
                None => first = Some(now),
                Some(f) => {
                    for (i, name) in ["dQ", "dK", "dV"].into_iter().enumerate() {
                        assert!(f[i] == now[i], "{name} differs in run {run} ({params:?})");
                    }
                }
            }
        }
    }
}

/// On Hopper the backward's default takes the `wgmma` kernels where the registry has one
/// (head dims up to 128 round up to 64 or 128; so this suite's other tests run them), and
/// `FLASH_ATTN_BWD=mma` the `mma.sync` ones; head dims above 128 and other GPUs always take
/// `mma.sync`.
#[test]
fn backward_dispatch_follows_the_path() {
    let Some(dev) = device() else { return };
    let wgmma = dev.arch() == Arch::Sm90a && dev.backward_path() == BackwardPath::Auto;
    eprintln!(
        "gpu_backward: backward path {:?} on {:?}: wgmma kernels {}",
        dev.backward_path(),
        dev.arch(),
        if wgmma { "on" } else { "off" }
    );
    for causal in [false, true] {
        let params = AttnParams {
            causal,
            ..AttnParams::default()
        };
        for d in [8, 32, 64, 96, 128, 200, 256] {
            for dtype in [DType::F16, DType::BF16] {
                let name = backward_kernel_name(dev, dtype, d, &params).unwrap();
                let want = wgmma && d <= 128;
                assert_eq!(name.contains("wgmma"), want, "d = {d} {dtype:?}: {name}");
            }
        }
    }
    // Windows and ALiBi take the general mask's `wgmma` kernels; a softcap takes `mma.sync`.
    let slopes: &'static [f32] = &[0.5, 0.25];
    for (params, want) in [
        (
            AttnParams {
                window: Some((100, 0)),
                ..AttnParams::default()
            },
            wgmma,
        ),
        (
            AttnParams {
                alibi_slopes: Some(slopes),
                causal: true,
                ..AttnParams::default()
            },
            wgmma,
        ),
        (
            AttnParams {
                softcap: Some(30.0),
                alibi_slopes: Some(slopes),
                ..AttnParams::default()
            },
            false,
        ),
    ] {
        for d in [64, 128] {
            let name = backward_kernel_name(dev, DType::BF16, d, &params).unwrap();
            assert_eq!(name.contains("wgmma"), want, "d = {d} {params:?}: {name}");
            assert!(name.contains("masked"), "{name}");
        }
    }
}
