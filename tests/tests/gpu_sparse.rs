//! Block-sparse attention on the GPU against the float64 reference, forward and all three
//! gradients, with the accuracy rules of `flash_attn_tests` (outputs and gradients poisoned
//! with NaN before every launch). Every case draws a block mask (per entry and head, per entry,
//! per head or shared) at a density from none to all blocks, so rows of all-zero blocks, rows
//! that see no key, and rows cut by causal masking inside visible blocks all occur; lengths
//! span several 128-row blocks, with GQA, both dtypes and both backward modes.
//!
//! Without a CUDA device every test prints a loud SKIPPED line and passes, unless
//! `FLASH_ATTN_REQUIRE_GPU=1`.

use flash_attn::shape::AttnShape;
use flash_attn::{AttnParams, BlockMask, BwdMode, Device};
use flash_attn_tests::gpu::{
    backward_case, device as gpu_device, forward_case, gpu_cases, Layout, PERSISTENT_DIMS,
    PERSISTENT_HEADS, PERSISTENT_LENS_K, PERSISTENT_LENS_Q,
};
use flash_attn_tests::{Magnitude, MaskRecipe};
use half::{bf16, f16};
use proptest::prelude::*;

fn device() -> Option<&'static Device> {
    gpu_device("gpu_sparse")
}

/// One random block-sparse problem: seed, sizes, params (with the block mask), magnitude and
/// layout.
type SparseCase = (u64, AttnShape, AttnParams<'static>, Magnitude, Layout);

/// Sizes of one problem: `(batch, seqlen_q, seqlen_k, (heads_q, heads_kv), head_dim)`.
type Sizes = (usize, usize, usize, (usize, usize), usize);

fn case_strategy() -> impl Strategy<Value = SparseCase> {
    let lens = prop::sample::select(&[1usize, 63, 128, 129, 200, 256, 300, 385, 513][..]);
    let heads = prop::sample::select(&[(1usize, 1usize), (2, 1), (4, 2), (3, 3), (8, 1)][..]);
    let dims = prop::sample::select(&[32usize, 40, 64, 80, 96, 128, 200, 256][..]);
    cases_over((1..3usize, lens.clone(), lens, heads, dims).boxed())
}

/// Cases with many more query tiles than an H100 has SMs (up to 3 × 24 × 5 of 128 rows) at the
/// head dims of the persistent block-sparse `wgmma` kernels (33..=64 and 65..=128), so each of
/// their blocks takes several query tiles from the counter, with the ring of K/V stages and
/// the walk over the mask's bits running on from one tile to the next.
fn persistent_case_strategy() -> impl Strategy<Value = SparseCase> {
    let sizes = (
        1..=3usize,
        prop::sample::select(&PERSISTENT_LENS_Q[..]),
        prop::sample::select(&PERSISTENT_LENS_K[..]),
        prop::sample::select(&PERSISTENT_HEADS[..]),
        prop::sample::select(&PERSISTENT_DIMS[..]),
    );
    cases_over(sizes.boxed())
}

/// Random block-sparse problems of sizes `sizes` (with the causal flag, scale, density,
/// magnitude and layout drawn beside them).
fn cases_over(sizes: BoxedStrategy<Sizes>) -> impl Strategy<Value = SparseCase> {
    let scales = prop::sample::select(&[None, Some(0.3f32), Some(-0.25)][..]);
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
        sizes,
        (any::<bool>(), scales, 0u8..=16, mags, layouts),
    )
        .prop_map(
            |(seed, (batch, seqlen_q, seqlen_k, (heads_q, heads_kv), head_dim), o)| {
                let (causal, softmax_scale, sixteenths, magnitude, layout) = o;
                let shape = AttnShape {
                    batch,
                    seqlen_q,
                    seqlen_k,
                    heads_q,
                    heads_kv,
                    head_dim,
                };
                let recipe = MaskRecipe {
                    seed,
                    sparse: Some(sixteenths),
                    ..MaskRecipe::NONE
                };
                let params = recipe.params_for(causal, softmax_scale, &shape);
                (seed, shape, params, magnitude, layout)
            },
        )
}

fn mode(deterministic: bool) -> BwdMode {
    if deterministic {
        BwdMode::Deterministic
    } else {
        BwdMode::Fast
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpu_cases(), ..ProptestConfig::default() })]

    #[test]
    fn sparse_forward_f16((seed, shape, params, mag, layout) in case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(forward_case::<f16>(dev, seed, shape, &params, mag, layout), Ok(()));
        }
    }

    #[test]
    fn sparse_forward_bf16((seed, shape, params, mag, layout) in case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(forward_case::<bf16>(dev, seed, shape, &params, mag, layout), Ok(()));
        }
    }

    #[test]
    fn sparse_forward_with_persistent_blocks((seed, shape, params, mag, layout) in persistent_case_strategy(), half in any::<bool>()) {
        if let Some(dev) = device() {
            let r = if half {
                forward_case::<f16>(dev, seed, shape, &params, mag, layout)
            } else {
                forward_case::<bf16>(dev, seed, shape, &params, mag, layout)
            };
            prop_assert_eq!(r, Ok(()));
        }
    }

    #[test]
    fn sparse_backward_f16((seed, shape, params, mag, layout) in case_strategy(), det in any::<bool>()) {
        if let Some(dev) = device() {
            let r = backward_case::<f16>(dev, seed, shape, &params, mag, layout, mode(det));
            prop_assert_eq!(r, Ok(()));
        }
    }

    #[test]
    fn sparse_backward_bf16((seed, shape, params, mag, layout) in case_strategy(), det in any::<bool>()) {
        if let Some(dev) = device() {
            let r = backward_case::<bf16>(dev, seed, shape, &params, mag, layout, mode(det));
            prop_assert_eq!(r, Ok(()));
        }
    }
}

/// A long key sequence at low density: the backward's walk jumps over many empty blocks per
/// key tile (gradients of keys in fully empty columns must come out 0), causal and not.
#[test]
fn long_sparse_backward() {
    let Some(dev) = device() else { return };
    for (causal, sixteenths) in [(false, 1u8), (true, 2), (false, 0)] {
        let shape = AttnShape {
            batch: 1,
            seqlen_q: 3000,
            seqlen_k: 3100,
            heads_q: 4,
            heads_kv: 2,
            head_dim: 64,
        };
        let recipe = MaskRecipe {
            seed: 7 + u64::from(sixteenths),
            sparse: Some(sixteenths),
            ..MaskRecipe::NONE
        };
        let params = recipe.params_for(causal, None, &shape);
        backward_case::<bf16>(
            dev,
            11,
            shape,
            &params,
            Magnitude::Normal,
            Layout::Contiguous,
            BwdMode::Fast,
        )
        .unwrap();
    }
}

/// One mask through many calls, as a model uses it layer after layer: the first call of each
/// launch shape puts the mask's words and that call's tile orders on the device, later ones
/// read them there (`crate::resident` in the host crate). Forward and backward calls over
/// six lengths of the same block counts, causal and not, give more sets of orders than one
/// mask keeps (8), so copies are reused, added and dropped between the calls; the clone
/// starts without copies. Every call is checked against the reference.
#[test]
fn one_mask_across_calls() {
    let Some(dev) = device() else { return };
    let mut seed = 0x9e37_79b9u64;
    let mask = BlockMask::from_fn([1, 4, 4, 10], |_, h, i, j| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (seed >> 60) < 5 || (h + i + j) % 7 == 0
    })
    .unwrap();
    let clone = mask.clone();
    // Lengths within 4 query blocks and 10 key blocks; the third round's differ from the
    // first two's, which are the same.
    let calls = [(385, 1153), (470, 1200), (420, 1160)];
    for round in 0..3u64 {
        let (more_q, more_k) = if round == 2 { (40, 80) } else { (0, 0) };
        for (i, &(seqlen_q, seqlen_k)) in calls.iter().enumerate() {
            for causal in [false, true] {
                let shape = AttnShape {
                    batch: 1,
                    seqlen_q: seqlen_q + more_q,
                    seqlen_k: seqlen_k + more_k,
                    heads_q: 4,
                    heads_kv: 2,
                    head_dim: 128,
                };
                let params = AttnParams {
                    causal,
                    block_mask: Some(if round == 2 { &clone } else { &mask }),
                    ..AttnParams::default()
                };
                let seed = round * 10 + i as u64;
                let (mag, layout) = (Magnitude::Normal, Layout::Contiguous);
                let r = forward_case::<bf16>(dev, seed, shape, &params, mag, layout);
                assert_eq!(
                    r,
                    Ok(()),
                    "forward, round {round}, call {i}, causal {causal}"
                );
                let r = backward_case::<f16>(dev, seed, shape, &params, mag, layout, mode(i == 1));
                assert_eq!(
                    r,
                    Ok(()),
                    "backward, round {round}, call {i}, causal {causal}"
                );
            }
        }
    }
}
