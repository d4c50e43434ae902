//! The forward kernels on the GPU against the float64 reference, with the accuracy rule of
//! `flash_attn_tests::check_accuracy`. Outputs are poisoned with NaN before every launch.
//!
//! Without a CUDA device every test prints a loud SKIPPED line and passes, unless
//! `FLASH_ATTN_REQUIRE_GPU=1` (set by the GPU bundle), which turns a missing device into a
//! failure.

use flash_attn::cpu::{attention_naive, attention_reference};
use flash_attn::shape::AttnShape;
use flash_attn::{
    flash_attn, flash_attn_into, AttnParams, Device, DeviceTensor, Element, FlashError,
};
use flash_attn_tests::gpu::{
    device as gpu_device, download3, download4, forward_case, gpu_cases, Layout, PERSISTENT_DIMS,
    PERSISTENT_HEADS, PERSISTENT_LENS_K, PERSISTENT_LENS_Q,
};
use flash_attn_tests::{
    attention_mask_recipes, check_accuracy, random_qkv, to_f64, Alibi, Magnitude, MaskRecipe,
};
use half::{bf16, f16};
use ndarray::Array4;
use proptest::prelude::*;
use rand::SeedableRng;

/// The shared device, or `None` after a loud SKIPPED line.
fn device() -> Option<&'static Device> {
    gpu_device("gpu_forward")
}

/// One case of `masks` (see [`forward_case`]).
#[allow(clippy::too_many_arguments)]
fn run_case<T: Element>(
    dev: &Device,
    seed: u64,
    shape: AttnShape,
    causal: bool,
    softmax_scale: Option<f32>,
    masks: MaskRecipe,
    magnitude: Magnitude,
    layout: Layout,
) -> Result<(), String> {
    let params = masks.params_for(causal, softmax_scale, &shape);
    forward_case::<T>(dev, seed, shape, &params, magnitude, layout)
}

fn shape_strategy() -> impl Strategy<Value = AttnShape> {
    shapes_with(
        vec![
            8usize, 16, 24, 32, 40, 64, 72, 80, 96, 100, 128, 160, 200, 256,
        ],
        vec![1usize, 7, 16, 31, 64, 65, 127, 128, 129, 200, 257],
    )
}

/// Random shapes whose head dim is one of `dims` and lengths are from `lens`.
fn shapes_with(dims: Vec<usize>, lens: Vec<usize>) -> impl Strategy<Value = AttnShape> {
    let heads = vec![(1, 1), (2, 1), (4, 2), (3, 3), (6, 2), (8, 1)];
    shapes_from(1..=2, heads, dims, lens.clone(), lens)
}

/// Random shapes: a batch from `batches`, `(Hq, Hkv)` from `heads`, a head dim from `dims`,
/// query and key lengths from `lens_q` and `lens_k`.
fn shapes_from(
    batches: std::ops::RangeInclusive<usize>,
    heads: Vec<(usize, usize)>,
    dims: Vec<usize>,
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
) -> impl Strategy<Value = AttnShape> {
    let (heads, dims) = (prop::sample::select(heads), prop::sample::select(dims));
    let (lens_q, lens_k) = (prop::sample::select(lens_q), prop::sample::select(lens_k));
    (batches, lens_q, lens_k, heads, dims).prop_map(
        |(batch, seqlen_q, seqlen_k, (heads_q, heads_kv), head_dim)| AttnShape {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
        },
    )
}

type ForwardCase = (
    u64,
    AttnShape,
    bool,
    Option<f32>,
    MaskRecipe,
    Magnitude,
    Layout,
);

fn case_strategy() -> impl Strategy<Value = ForwardCase> {
    cases_with(shape_strategy())
}

/// [`case_strategy`] at the head dims of Hopper's `wgmma` forward kernels (33..=64,
/// 65..=128 and 129..=256) and up to 9 key tiles of 128 (17 of 64 at d = 256: the 3-stage
/// ring wraps from the fourth tile, the 2-stage one from the third, and the barriers' phase
/// parity flips back from the seventh and the fifth): with `FLASH_ATTN_FWD=wgmma` every case
/// runs on them (elsewhere on the `mma.sync` kernels).
fn wgmma_case_strategy() -> impl Strategy<Value = ForwardCase> {
    cases_with(shapes_with(
        vec![
            33usize, 40, 57, 64, 72, 96, 97, 104, 120, 128, 136, 160, 200, 248, 256,
        ],
        vec![1usize, 65, 128, 129, 257, 300, 385, 513, 640, 1025],
    ))
}

/// [`case_strategy`] at the head dims of Hopper's `wgmma` kernels with three consumer
/// warpgroups (33..=64: 192 query rows per block), query lengths on both sides of multiples
/// of 192 and up to 9 key tiles of 128, causal or not, without other masks (those run on the
/// 128-row kernels): with `FLASH_ATTN_FWD=wgmma` every case runs on them.
fn three_warpgroup_case_strategy() -> impl Strategy<Value = ForwardCase> {
    let shapes = shapes_with(
        vec![33usize, 48, 57, 64],
        vec![1usize, 64, 191, 192, 193, 320, 385, 577, 1025],
    );
    cases_with(shapes).prop_map(|(seed, shape, causal, scale, _, mag, layout)| {
        (seed, shape, causal, scale, MaskRecipe::NONE, mag, layout)
    })
}

/// [`case_strategy`] at the head dims of Hopper's plain `wgmma` kernel of 176-key tiles
/// (65..=128) and key lengths on both sides of multiples of 176 up to 7 tiles (the ring of
/// two wraps from the third tile, the barriers' parity flips back from the fifth), causal or
/// not, without other masks (those run on the general kernel): with `FLASH_ATTN_FWD=wgmma`
/// and `FLASH_ATTN_WGMMA_WIDE=1` every case runs on it (without the second, only calls
/// whose tiles pay: none of these lengths but the multiples of 176, not causal).
fn wide_key_tile_case_strategy() -> impl Strategy<Value = ForwardCase> {
    let shapes = shapes_from(
        1..=2,
        vec![(1, 1), (2, 1), (4, 2), (3, 3), (6, 2), (8, 1)],
        vec![65usize, 72, 96, 100, 120, 128],
        vec![1usize, 64, 127, 128, 129, 300, 385],
        vec![1usize, 175, 176, 177, 352, 353, 529, 880, 1057, 1232],
    );
    cases_with(shapes).prop_map(|(seed, shape, causal, scale, _, mag, layout)| {
        (seed, shape, causal, scale, MaskRecipe::NONE, mag, layout)
    })
}

/// Cases with many more query tiles than an H100 has SMs (up to 3 × 24 × 5), so the
/// persistent `wgmma` kernels' blocks each take several tiles from the counter, at the head
/// dims of the persistent kernels (33..=64 without other masks: the three-warpgroup kernel;
/// 65..=128, any mask but a tree: the general one or the block-sparse one; 33..=64 with
/// windows, softcaps, ALiBi or block masks: the general or block-sparse one of d = 64) and of
/// the per-tile ones (tree masks), with
/// queries longer than keys (causal tiles that see no key) and GQA. Few keys keep the float64
/// reference affordable; up to 4 key tiles, so that a warpgroup's later tiles can move a row
/// maximum (with three consumer warpgroups, the softmax then computes S again from Q, which
/// the next tile's load must not have overwritten).
fn persistent_case_strategy() -> impl Strategy<Value = ForwardCase> {
    cases_with(shapes_from(
        1..=3,
        PERSISTENT_HEADS.to_vec(),
        PERSISTENT_DIMS.to_vec(),
        PERSISTENT_LENS_Q.to_vec(),
        PERSISTENT_LENS_K.to_vec(),
    ))
}

/// Random cases of the given shapes.
fn cases_with(shapes: impl Strategy<Value = AttnShape>) -> impl Strategy<Value = ForwardCase> {
    (
        any::<u64>(),
        shapes,
        any::<bool>(),
        prop::sample::select(vec![None, Some(0.3f32), Some(-0.25), Some(0.0)]),
        attention_mask_recipes(),
        prop::sample::select(vec![Magnitude::Normal, Magnitude::Large]),
        prop::sample::select(vec![
            Layout::Contiguous,
            Layout::HeadMajor,
            Layout::Padded { extra: 8 },
            Layout::Padded { extra: 3 },
        ]),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpu_cases(), ..ProptestConfig::default() })]

    #[test]
    fn forward_at_wgmma_head_dims_matches_reference((seed, shape, causal, scale, masks, mag, layout) in wgmma_case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(run_case::<f16>(dev, seed, shape, causal, scale, masks, mag, layout), Ok(()));
            prop_assert_eq!(run_case::<bf16>(dev, seed ^ 1, shape, causal, scale, masks, mag, layout), Ok(()));
        }
    }

    #[test]
    fn forward_on_three_consumer_warpgroups_matches_reference((seed, shape, causal, scale, masks, mag, layout) in three_warpgroup_case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(run_case::<f16>(dev, seed, shape, causal, scale, masks, mag, layout), Ok(()));
            prop_assert_eq!(run_case::<bf16>(dev, seed ^ 1, shape, causal, scale, masks, mag, layout), Ok(()));
        }
    }

    #[test]
    fn forward_on_wide_key_tiles_matches_reference((seed, shape, causal, scale, masks, mag, layout) in wide_key_tile_case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(run_case::<f16>(dev, seed, shape, causal, scale, masks, mag, layout), Ok(()));
            prop_assert_eq!(run_case::<bf16>(dev, seed ^ 1, shape, causal, scale, masks, mag, layout), Ok(()));
        }
    }

    #[test]
    fn forward_with_persistent_blocks_matches_reference((seed, shape, causal, scale, masks, mag, layout) in persistent_case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(run_case::<f16>(dev, seed, shape, causal, scale, masks, mag, layout), Ok(()));
            prop_assert_eq!(run_case::<bf16>(dev, seed ^ 1, shape, causal, scale, masks, mag, layout), Ok(()));
        }
    }

    #[test]
    fn forward_f16_matches_reference((seed, shape, causal, scale, masks, mag, layout) in case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(run_case::<f16>(dev, seed, shape, causal, scale, masks, mag, layout), Ok(()));
        }
    }

    #[test]
    fn forward_bf16_matches_reference((seed, shape, causal, scale, masks, mag, layout) in case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(run_case::<bf16>(dev, seed, shape, causal, scale, masks, mag, layout), Ok(()));
        }
    }
}

/// Every forward kernel of the registry (both dtypes), causal and not, at sizes that span
/// several tiles.
#[test]
fn every_kernel_instantiation() {
    let Some(dev) = device() else { return };
    for d in flash_attn_kernels::registry::FWD_KERNELS
        .iter()
        .map(|k| k.head_dim)
    {
        for causal in [false, true] {
            let shape = AttnShape {
                batch: 2,
                seqlen_q: 300,
                seqlen_k: 333,
                heads_q: 4,
                heads_kv: 2,
                head_dim: d,
            };
            run_case::<f16>(
                dev,
                d as u64,
                shape,
                causal,
                None,
                MaskRecipe::NONE,
                Magnitude::Normal,
                Layout::Contiguous,
            )
            .unwrap();
            run_case::<bf16>(
                dev,
                d as u64 + 1,
                shape,
                causal,
                None,
                MaskRecipe::NONE,
                Magnitude::Large,
                Layout::Contiguous,
            )
            .unwrap();
        }
    }
}

/// Every scored forward kernel (softcap and ALiBi, with a window) and the window alone on the
/// plain kernels, both dtypes, at sizes that span several tiles.
#[test]
fn every_masked_kernel_instantiation() {
    let Some(dev) = device() else { return };
    let recipes = [
        MaskRecipe {
            window: Some((100, 20)),
            ..MaskRecipe::NONE
        },
        MaskRecipe {
            window: Some((usize::MAX, 50)),
            softcap: Some(30.0),
            alibi: Alibi::PerBatchHead,
            seed: 5,
            sparse: None,
        },
        MaskRecipe {
            softcap: Some(8.0),
            ..MaskRecipe::NONE
        },
        MaskRecipe {
            sparse: Some(9),
            seed: 11,
            ..MaskRecipe::NONE
        },
    ];
    for d in flash_attn_kernels::registry::FWD_KERNELS
        .iter()
        .map(|k| k.head_dim)
    {
        for (i, masks) in recipes.into_iter().enumerate() {
            let shape = AttnShape {
                batch: 2,
                seqlen_q: 300,
                seqlen_k: 333,
                heads_q: 4,
                heads_kv: 2,
                head_dim: d,
            };
            let causal = i >= 2;
            for (seed, mag) in [
                (d as u64, Magnitude::Normal),
                (d as u64 + 1, Magnitude::Large),
            ] {
                let layout = Layout::Contiguous;
                run_case::<f16>(dev, seed, shape, causal, None, masks, mag, layout).unwrap();
                run_case::<bf16>(dev, seed, shape, causal, None, masks, mag, layout).unwrap();
            }
        }
    }
}

/// Causal with more queries than keys: the first `Nq − Nk` rows see no key and must give
/// O = 0 and LSE = −∞ exactly (never NaN).
#[test]
fn fully_masked_rows_are_zero_with_neg_inf_lse() {
    let Some(dev) = device() else { return };
    let shape = AttnShape {
        batch: 1,
        seqlen_q: 200,
        seqlen_k: 37,
        heads_q: 2,
        heads_kv: 1,
        head_dim: 64,
    };
    run_case::<f16>(
        dev,
        7,
        shape,
        true,
        None,
        MaskRecipe::NONE,
        Magnitude::Normal,
        Layout::Contiguous,
    )
    .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let (q, k, v) = random_qkv::<f16>(&mut rng, &shape, Magnitude::Normal, 0.125);
    let up = |a: &Array4<f16>| DeviceTensor::from_ndarray(dev, a.view()).unwrap();
    let (o, lse) = flash_attn(
        dev,
        &up(&q),
        &up(&k),
        &up(&v),
        &AttnParams {
            causal: true,
            softmax_scale: None,
            ..AttnParams::default()
        },
    )
    .unwrap();
    let (o, lse) = (download4(dev, &o), download3(dev, &lse));
    for i in 0..shape.seqlen_q - shape.seqlen_k {
        for h in 0..shape.heads_q {
            assert_eq!(lse[[0, h, i]], f32::NEG_INFINITY, "row {i}");
            assert!(
                o.slice(ndarray::s![0, i, h, ..])
                    .iter()
                    .all(|x| x.to_f32() == 0.0),
                "row {i}"
            );
        }
    }
    let first_seen = shape.seqlen_q - shape.seqlen_k;
    assert!(lse[[0, 0, first_seen]].is_finite());
}

/// Held by the tests that allocate many GiB or measure the device's free memory: the
/// measurement counts every allocation on the device, so it must not overlap the 2³¹-element
/// test (seen once: 4.4 GB "used" by a 64 MiB call while that test ran beside it).
static DEVICE_MEMORY: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// 64K keys and queries on one head: runs, stays O(N·d) in device memory (an N×N score matrix
/// would need 16 GiB), and sampled rows meet the accuracy rule.
#[test]
fn long_sequence_memory_is_linear() {
    let Some(dev) = device() else { return };
    let _alone = DEVICE_MEMORY.lock().unwrap_or_else(|e| e.into_inner());
    let n = 65_536;
    let shape = AttnShape {
        batch: 1,
        seqlen_q: n,
        seqlen_k: n,
        heads_q: 1,
        heads_kv: 1,
        head_dim: 128,
    };
    let params = AttnParams::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (q, k, v) = random_qkv::<bf16>(&mut rng, &shape, Magnitude::Normal, 1.0 / 128f32.sqrt());
    // Memory freed earlier stays in the device's pool (see `Device::new`): given back
    // before each reading, so that both count live allocations only.
    dev.release_freed_memory().unwrap();
    let (free_before, _) = dev.mem_info().unwrap();
    let up = |a: &Array4<bf16>| DeviceTensor::from_ndarray(dev, a.view()).unwrap();
    let (qd, kd, vd) = (up(&q), up(&k), up(&v));
    let (o, lse) = flash_attn(dev, &qd, &kd, &vd, &params).unwrap();
    dev.release_freed_memory().unwrap();
    let (free_after, _) = dev.mem_info().unwrap();
    let used = free_before.saturating_sub(free_after);
    let tensors = 4 * n * 128 * 2 + n * 4;
    {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "long_sequence_memory_is_linear: N={n} d=128: device memory in use after the call {used} bytes, tensors {tensors} bytes"
        );
    }
    assert!(
        used <= tensors + (64 << 20),
        "used {used} bytes, tensors are {tensors}"
    );

    let (o, lse) = (download4(dev, &o), download3(dev, &lse));
    let rows: Vec<usize> = (0..32).map(|i| (i * 2039 + 17) % n).collect();
    let pick = |a: &Array4<bf16>| a.select(ndarray::Axis(1), &rows);
    let qs = pick(&q);
    let reference = attention_reference(
        to_f64(qs.view()).view(),
        to_f64(k.view()).view(),
        to_f64(v.view()).view(),
        &params,
    )
    .unwrap();
    let naive = attention_naive(qs.view(), k.view(), v.view(), &params).unwrap();
    let ours_o = pick(&o);
    let ours_lse = lse.select(ndarray::Axis(2), &rows);
    check_accuracy(
        (ours_o.view(), ours_lse.view()),
        (naive.0.view(), naive.1.view()),
        (reference.0.view(), reference.1.view()),
    )
    .unwrap();
}

/// Invalid inputs return typed errors before any launch.
#[test]
fn invalid_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let t = |shape: &[usize]| DeviceTensor::<f16>::zeros(dev, shape).unwrap();
    let p = AttnParams::default();
    let q = t(&[1, 16, 4, 64]);
    let kv = t(&[1, 16, 2, 64]);
    assert!(matches!(
        flash_attn(dev, &q, &t(&[1, 16, 3, 64]), &t(&[1, 16, 3, 64]), &p),
        Err(FlashError::GqaRatio { .. })
    ));
    assert!(matches!(
        flash_attn(dev, &q, &kv, &t(&[1, 16, 2, 32]), &p),
        Err(FlashError::Shape(_))
    ));
    assert!(matches!(
        flash_attn(
            dev,
            &t(&[1, 16, 4, 300]),
            &t(&[1, 16, 4, 300]),
            &t(&[1, 16, 4, 300]),
            &p
        ),
        Err(FlashError::HeadDim(300))
    ));
    assert!(matches!(
        flash_attn(
            dev,
            &t(&[0, 16, 4, 64]),
            &t(&[0, 16, 2, 64]),
            &t(&[0, 16, 2, 64]),
            &p
        ),
        Err(FlashError::Shape(_))
    ));
    assert!(matches!(
        flash_attn(dev, &t(&[16, 4, 64]), &kv, &kv, &p),
        Err(FlashError::Shape(_))
    ));
    let strided_last = t(&[1, 16, 2, 128])
        .with_layout(&[1, 16, 2, 64], &[4096, 256, 128, 2], 0)
        .unwrap();
    assert!(matches!(
        flash_attn(dev, &q, &strided_last, &kv, &p),
        Err(FlashError::Layout(_))
    ));
    let f32_t = |shape: &[usize]| DeviceTensor::<f32>::zeros(dev, shape).unwrap();
    assert!(matches!(
        flash_attn(
            dev,
            &f32_t(&[1, 4, 1, 8]),
            &f32_t(&[1, 4, 1, 8]),
            &f32_t(&[1, 4, 1, 8]),
            &p
        ),
        Err(FlashError::DType(_))
    ));
    let bad_scale = AttnParams {
        causal: false,
        softmax_scale: Some(f32::NAN),
        ..AttnParams::default()
    };
    assert!(matches!(
        flash_attn(dev, &q, &kv, &kv, &bad_scale),
        Err(FlashError::Param(_))
    ));
    let mut o_wrong = t(&[1, 16, 4, 32]);
    let mut lse = DeviceTensor::<f32>::zeros(dev, &[1, 4, 16]).unwrap();
    assert!(matches!(
        flash_attn_into(dev, &q, &kv, &kv, &p, &mut o_wrong, &mut lse),
        Err(FlashError::Shape(_))
    ));
    let other = Device::new(0).unwrap();
    let foreign = DeviceTensor::<f16>::zeros(&other, &[1, 16, 2, 64]).unwrap();
    assert!(matches!(
        flash_attn(dev, &q, &foreign, &kv, &p),
        Err(FlashError::DeviceMismatch(_))
    ));
    assert!(matches!(
        flash_attn(
            dev,
            &t(&[1, 16, 70_000, 8]),
            &t(&[1, 16, 70_000, 8]),
            &t(&[1, 16, 70_000, 8]),
            &p
        ),
        Err(FlashError::TooLarge(_))
    ));
}

/// Tensors of 2³¹ elements (4 GiB each in f16): offsets past `i32::MAX` must index correctly.
/// Q, K and V are views of one buffer; the last batch entries, which lie past 2³¹ elements,
/// are checked against the reference. Skipped (loudly) when the device has under 24 GiB free.
#[test]
fn indexing_past_two_to_the_31_elements() {
    let Some(dev) = device() else { return };
    let _alone = DEVICE_MEMORY.lock().unwrap_or_else(|e| e.into_inner());
    dev.release_freed_memory().unwrap(); // what earlier tests freed into the pool
    let (free, _) = dev.mem_info().unwrap();
    if free < 24 << 30 {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "***** SKIPPED: indexing_past_two_to_the_31_elements needs 24 GiB free, {free} bytes are *****");
        return;
    }
    let shape = AttnShape {
        batch: 4096,
        seqlen_q: 256,
        seqlen_k: 256,
        heads_q: 16,
        heads_kv: 16,
        head_dim: 128,
    };
    let n: usize = shape.q_dims().iter().product();
    assert_eq!(n, 1 << 31);
    // Cheap fresh values (xorshift, uniform in [-1, 1)): the reference only needs the tail.
    let mut state = 0x2545_F491_4F6C_DD1Du64 ^ std::process::id() as u64;
    let data: Vec<f16> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            f16::from_f32((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect();
    let qkv = DeviceTensor::from_host(dev, &shape.q_dims(), &data).unwrap();
    let params = AttnParams {
        causal: true,
        softmax_scale: None,
        ..AttnParams::default()
    };
    let (o, lse) = flash_attn(dev, &qkv, &qkv, &qkv, &params).unwrap();
    let (o, lse) = (download4(dev, &o), download3(dev, &lse));
    let full = Array4::from_shape_vec(shape.q_dims(), data).unwrap();
    for b in [shape.batch - 1, shape.batch / 2 + 1] {
        let x = full.slice(ndarray::s![b..b + 1, .., .., ..]);
        let reference = attention_reference(
            to_f64(x).view(),
            to_f64(x).view(),
            to_f64(x).view(),
            &params,
        )
        .unwrap();
        let naive = attention_naive(x, x, x, &params).unwrap();
        let ours_o = o.slice(ndarray::s![b..b + 1, .., .., ..]);
        let ours_lse = lse.slice(ndarray::s![b..b + 1, .., ..]);
        check_accuracy(
            (ours_o, ours_lse),
            (naive.0.view(), naive.1.view()),
            (reference.0.view(), reference.1.view()),
        )
        .unwrap_or_else(|e| panic!("batch {b}: {e}"));
    }
}

/// NaN in, NaN out, on the GPU as on the CPU: a NaN in a Q row makes that row's O and LSE NaN;
/// a NaN in a K row makes every row that sees that key NaN; +∞ in Q makes its row NaN; a row
/// whose visible scores are all −∞ is NaN, not a masked row; rows that see no key stay
/// O = 0, LSE = −∞.
#[test]
fn non_finite_inputs_propagate_and_never_look_masked() {
    let Some(dev) = device() else { return };
    let shape = AttnShape {
        batch: 1,
        seqlen_q: 150,
        seqlen_k: 100,
        heads_q: 2,
        heads_kv: 1,
        head_dim: 64,
    };
    let params = AttnParams {
        causal: true,
        softmax_scale: None,
        ..AttnParams::default()
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (mut q, mut k, v) = random_qkv::<f16>(&mut rng, &shape, Magnitude::Normal, 0.125);
    let first_seen = shape.seqlen_q - shape.seqlen_k; // rows before it see no key
    let nan_q_row = first_seen + 20;
    q[[0, nan_q_row, 0, 5]] = f16::NAN;
    q[[0, first_seen + 30, 1, 0]] = f16::INFINITY;
    // Row first_seen + 40 of head 1 sees keys 0..=40; make all its scores −∞: q = −∞ in one
    // dim and k > 0 there for every key (set below), the other dims zero.
    let inf_row = first_seen + 40;
    for c in 0..shape.head_dim {
        q[[0, inf_row, 1, c]] = f16::ZERO;
    }
    q[[0, inf_row, 1, 7]] = f16::NEG_INFINITY;
    for j in 0..shape.seqlen_k {
        k[[0, j, 0, 7]] = f16::from_f32(0.5 + (j % 3) as f32 * 0.25);
    }
    let nan_key = 60; // seen by rows ≥ first_seen + 60
    k[[0, nan_key, 0, 3]] = f16::NAN;
    let up = |a: &Array4<f16>| DeviceTensor::from_ndarray(dev, a.view()).unwrap();
    let (o, lse) = flash_attn(dev, &up(&q), &up(&k), &up(&v), &params).unwrap();
    let (o, lse) = (download4(dev, &o), download3(dev, &lse));
    let (cpu_o, cpu_lse) = attention_naive(q.view(), k.view(), v.view(), &params).unwrap();
    for h in 0..shape.heads_q {
        for i in 0..shape.seqlen_q {
            let row_nan = o.slice(ndarray::s![0, i, h, ..]).iter().any(|x| x.is_nan());
            let cpu_row_nan = cpu_o
                .slice(ndarray::s![0, i, h, ..])
                .iter()
                .any(|x| x.is_nan());
            let expect_nan = i >= first_seen + nan_key
                || (h == 0 && i == nan_q_row)
                || (h == 1 && (i == first_seen + 30 || i == inf_row));
            assert_eq!(row_nan, expect_nan, "O row {i} head {h}");
            assert_eq!(lse[[0, h, i]].is_nan(), expect_nan, "LSE row {i} head {h}");
            assert_eq!(cpu_row_nan, expect_nan, "CPU O row {i} head {h}");
            assert_eq!(
                cpu_lse[[0, h, i]].is_nan(),
                expect_nan,
                "CPU LSE row {i} head {h}"
            );
            if i < first_seen {
                assert_eq!(lse[[0, h, i]], f32::NEG_INFINITY, "masked row {i}");
                assert!(o
                    .slice(ndarray::s![0, i, h, ..])
                    .iter()
                    .all(|x| x.to_f32() == 0.0));
            }
        }
    }
}

/// Freed device memory stays in the default pool (`Device::new` raises its release
/// threshold, so that each call's temporaries are not mapped afresh) until
/// `release_freed_memory` gives it back. Skipped (loudly) when another setting of the pool
/// was there first (`FLASH_ATTN_POOL_RETAIN=0`).
#[test]
fn freed_memory_stays_in_the_pool_until_released() {
    let Some(dev) = device() else { return };
    if std::env::var("FLASH_ATTN_POOL_RETAIN").as_deref() == Ok("0") {
        eprintln!("***** SKIPPED: freed_memory_stays_in_the_pool_until_released: FLASH_ATTN_POOL_RETAIN=0 *****");
        return;
    }
    let _alone = DEVICE_MEMORY.lock().unwrap_or_else(|e| e.into_inner());
    const GIB: usize = 1 << 30;
    dev.release_freed_memory().unwrap();
    let (free_before, _) = dev.mem_info().unwrap();
    let big = DeviceTensor::<f32>::zeros(dev, &[GIB]).unwrap(); // 4 GiB
    drop(big);
    dev.synchronize().unwrap();
    let (free_kept, _) = dev.mem_info().unwrap();
    dev.release_freed_memory().unwrap();
    let (free_released, _) = dev.mem_info().unwrap();
    assert!(
        free_kept + 3 * GIB <= free_before,
        "freed memory left the pool: {free_before} bytes free before, {free_kept} after"
    );
    assert!(
        free_released >= free_kept + 3 * GIB,
        "release_freed_memory gave nothing back: {free_kept} -> {free_released} bytes free"
    );
}

/// Calls repeated on the same tensors, and a call on other tensors between them, share the
/// device's launch scratch (on Hopper: the TMA descriptors, copied only when a call's differ
/// from the last copy's, and the persistent blocks' tile counter, which every launch must
/// leave at zero for the next; see the host's `scratch` module): every call on the first
/// tensors, 306 of them, gives the first call's bits, into NaN-poisoned outputs, and that
/// call meets the accuracy rule on two of its heads. 160 query tiles of 128 rows, more than
/// an H100's or H200's SMs: blocks take tiles from the counter, so a counter not back at zero
/// would leave tiles unwritten.
#[test]
fn repeated_calls_share_the_launch_scratch() {
    let Some(dev) = device() else { return };
    let shape = AttnShape {
        batch: 1,
        seqlen_q: 1200,
        seqlen_k: 1100,
        heads_q: 16,
        heads_kv: 16,
        head_dim: 128,
    };
    let params = AttnParams::default();
    let scale = params.scale(shape.head_dim).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    let (q, k, v) = random_qkv::<bf16>(&mut rng, &shape, Magnitude::Normal, scale);
    let up = |a: &Array4<bf16>| DeviceTensor::from_ndarray(dev, a.view()).unwrap();
    let (qd, kd, vd) = (up(&q), up(&k), up(&v));
    let mut o = DeviceTensor::<bf16>::zeros(dev, &shape.q_dims()).unwrap();
    let mut lse = DeviceTensor::<f32>::zeros(dev, &shape.lse_dims()).unwrap();
    // One call into poisoned outputs; O comes back only when `full` (else only LSE is
    // poisoned and read: a query tile no block took leaves its rows NaN).
    let mut call = |full: bool| {
        if full {
            o.fill_nan(dev).unwrap();
        }
        lse.fill_nan(dev).unwrap();
        flash_attn_into(dev, &qd, &kd, &vd, &params, &mut o, &mut lse).unwrap();
        (full.then(|| download4(dev, &o)), download3(dev, &lse))
    };
    let (first_o, first_lse) = call(true);
    let first = (first_o.expect("downloaded"), first_lse);
    let other = AttnShape {
        seqlen_q: 300,
        ..shape
    };
    let same_bits = |(o, lse): (Option<Array4<bf16>>, ndarray::Array3<f32>), when: &str| {
        let bits = |a: &Array4<bf16>| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        if let Some(o) = o {
            assert!(
                bits(&o) == bits(&first.0),
                "O differs from the first call's {when}"
            );
        }
        let lse_bits = |a: &ndarray::Array3<f32>| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            lse_bits(&lse) == lse_bits(&first.1),
            "LSE differs from the first call's {when}"
        );
    };
    same_bits(call(true), "on the second call");
    same_bits(call(true), "on the third call");
    let params_other = AttnParams {
        causal: true,
        ..AttnParams::default()
    };
    forward_case::<bf16>(
        dev,
        31,
        other,
        &params_other,
        Magnitude::Normal,
        Layout::Contiguous,
    )
    .unwrap();
    same_bits(call(true), "after a call on other tensors");
    same_bits(call(true), "on the call after that");
    // Calls that repeat the data skip the copy, and each launch takes its tiles from the
    // counter the previous one left at zero: a run of repeated calls, each checked by its LSE
    // (poisoned before the call: a query tile no block took stays NaN), every 100th and the
    // last in full.
    let calls = 301;
    for n in 0..calls {
        let full = n % 100 == 0 || n == calls - 1;
        same_bits(call(full), &format!("on repeated call {n}"));
    }
    for h in [0, shape.heads_q - 1] {
        let head = |a: &Array4<bf16>| a.slice(ndarray::s![.., .., h..h + 1, ..]).to_owned();
        let (qh, kh, vh) = (head(&q), head(&k), head(&v));
        let f64s = |a: &Array4<bf16>| to_f64(a.view());
        let reference = attention_reference(
            f64s(&qh).view(),
            f64s(&kh).view(),
            f64s(&vh).view(),
            &params,
        )
        .unwrap();
        let naive = attention_naive(qh.view(), kh.view(), vh.view(), &params).unwrap();
        let ours_o = first.0.slice(ndarray::s![.., .., h..h + 1, ..]);
        let ours_lse = first.1.slice(ndarray::s![.., h..h + 1, ..]);
        check_accuracy(
            (ours_o, ours_lse),
            (naive.0.view(), naive.1.view()),
            (reference.0.view(), reference.1.view()),
        )
        .unwrap_or_else(|e| panic!("head {h}: {e}"));
    }
}
