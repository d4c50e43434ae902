//! Tree masks on the CPU backend against the float64 reference: the forward (accuracy rule)
//! and the backward (gradient rule) of `flash_attn_tests::cpu`, on random trees from parent
//! arrays after random prefixes, shared or per-entry trees, causal or not, GQA, every dtype.

use flash_attn::shape::AttnShape;
use flash_attn::{AttnParams, DType};
use flash_attn_tests::cpu::{cpu_backward_case, cpu_forward_case};
use flash_attn_tests::{random_tree, Case, Magnitude};
use half::{bf16, f16};
use proptest::prelude::*;
use rand::SeedableRng;

/// A case of `drafts` queries over `prefix + drafts` keys with a random tree (leaked, like the
/// shared recipes' slopes).
fn tree_case(
    (batch, drafts, prefix): (usize, usize, usize),
    (heads_q, heads_kv): (usize, usize),
    (causal, shared, dtype): (bool, bool, DType),
    seed: u64,
) -> Case {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x7ee);
    let tree = Box::leak(Box::new(random_tree(
        &mut rng,
        if shared { 1 } else { batch },
        drafts,
    )));
    Case {
        shape: AttnShape {
            batch,
            seqlen_q: drafts,
            seqlen_k: prefix + drafts,
            heads_q,
            heads_kv,
            head_dim: 24,
        },
        dtype,
        params: AttnParams {
            causal,
            tree_mask: Some(tree.as_ref()),
            ..AttnParams::default()
        },
        magnitude: Magnitude::Normal,
        head_major: seed.is_multiple_of(2),
        seed,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn cpu_tree_matches_reference(
        sizes in (1usize..3, prop::sample::select(&[1usize, 3, 16, 33, 70][..]), prop::sample::select(&[0usize, 1, 20, 100][..])),
        heads in prop::sample::select(&[(1usize, 1usize), (4, 2)][..]),
        flags in (any::<bool>(), any::<bool>(), prop::sample::select(&[DType::F16, DType::BF16, DType::F32][..])),
        seed in any::<u64>(),
    ) {
        let case = tree_case(sizes, heads, flags, seed);
        let result = match case.dtype {
            DType::F16 => cpu_forward_case::<f16>(&case).and(cpu_backward_case::<f16>(&case)),
            DType::BF16 => cpu_forward_case::<bf16>(&case).and(cpu_backward_case::<bf16>(&case)),
            _ => cpu_forward_case::<f32>(&case).and(cpu_backward_case::<f32>(&case)),
        };
        prop_assert_eq!(result, Ok(()));
    }
}
