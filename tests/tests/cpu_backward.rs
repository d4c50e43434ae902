//! The CPU backward pass against the float64 reference backward (property tests under the
//! accuracy rule of [`check_gradient_accuracy`], every gradient separately), plus fully masked
//! rows in every element type.

use flash_attn::cpu::{attention_backward_cpu, attention_cpu};
use flash_attn::shape::AttnShape;
use flash_attn::{AttnParams, DType, Element};
use flash_attn_tests::cpu::cpu_backward_case;
use flash_attn_tests::{cases, random_array, random_qkv, Magnitude};
use half::{bf16, f16};
use ndarray::s;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Sequence lengths: 1, odd ones, one tile of 64 and just past it.
const SEQ_LENS: &[usize] = &[1, 5, 13, 31, 64, 67];
/// `(Hq, Hkv)` pairs: MHA, MQA and GQA.
const HEADS: &[(usize, usize)] = &[(1, 1), (2, 1), (4, 2), (3, 3), (6, 2)];
/// Head dims, odd ones included.
const HEAD_DIMS: &[usize] = &[1, 3, 8, 17, 32];
/// Softmax scales: the default `1/√d`, a custom one, a negative one and zero.
const SCALES: &[Option<f32>] = &[None, Some(0.3), Some(-0.5), Some(0.0)];

/// 32 cases, or `PROPTEST_CASES` for a longer soak.
fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok());
    ProptestConfig::with_cases(cases.unwrap_or(32))
}

proptest! {
    #![proptest_config(config())]

    /// The tiled CPU backward meets the accuracy rule on random problems.
    #[test]
    fn cpu_backward_matches_reference(case in cases(SEQ_LENS, HEADS, HEAD_DIMS, SCALES)) {
        let result = match case.dtype {
            DType::F16 => cpu_backward_case::<f16>(&case),
            DType::BF16 => cpu_backward_case::<bf16>(&case),
            DType::F32 => cpu_backward_case::<f32>(&case),
            DType::I32 => unreachable!("the cases draw float dtypes only"),
        };
        result.map_err(TestCaseError::fail)?;
    }
}

/// Causal attention with Nq = 9 > Nk = 3 (rows 0..6 see no key) and a tail of the key tile:
/// those rows get exactly zero dQ, and no gradient holds NaN.
fn fully_masked_rows_in<T: Element>() {
    let shape = AttnShape {
        batch: 1,
        seqlen_q: 9,
        seqlen_k: 3,
        heads_q: 2,
        heads_kv: 1,
        head_dim: 5,
    };
    let p = AttnParams {
        causal: true,
        softmax_scale: None,
        ..AttnParams::default()
    };
    let mut rng = StdRng::seed_from_u64(3);
    let (q, k, v) = random_qkv::<T>(&mut rng, &shape, Magnitude::Normal, 0.5);
    let d_o = random_array::<T>(&mut rng, shape.q_dims(), 1.0);
    let (o, lse) = attention_cpu(q.view(), k.view(), v.view(), &p).unwrap();
    let (dq, dk, dv) = attention_backward_cpu(
        q.view(),
        k.view(),
        v.view(),
        o.view(),
        d_o.view(),
        lse.view(),
        &p,
    )
    .unwrap();
    let masked = dq.slice(s![.., ..6, .., ..]);
    assert!(masked.iter().all(|x| x.to_f32() == 0.0), "{:?}", T::DTYPE);
    for g in [&dq, &dk, &dv] {
        assert!(g.iter().all(|x| !x.to_f32().is_nan()), "{:?}", T::DTYPE);
    }
}

#[test]
fn fully_masked_rows_get_zero_gradients() {
    fully_masked_rows_in::<f16>();
    fully_masked_rows_in::<bf16>();
    fully_masked_rows_in::<f32>();
}
