//! The CPU backend against the float64 reference (property tests under the accuracy rule),
//! plus hand-checked edge cases and the typed errors of invalid inputs.

use flash_attn::cpu::{attention_cpu, attention_cpu_into, attention_naive, attention_reference};
use flash_attn::shape::AttnShape;
use flash_attn::{AttnParams, DType, Element, FlashError};
use flash_attn_tests::cpu::cpu_forward_case;
use flash_attn_tests::{cases, random_qkv, to_f64, Magnitude};
use half::{bf16, f16};
use ndarray::{s, Array3, Array4};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Sequence lengths: 1, primes, tile-sized and just past a tile of 64.
const SEQ_LENS: &[usize] = &[1, 7, 13, 31, 61, 64, 67, 127, 129];
/// `(Hq, Hkv)` pairs: MHA, MQA and GQA.
const HEADS: &[(usize, usize)] = &[(1, 1), (2, 1), (4, 2), (3, 3), (6, 2)];
/// Head dims, including ones no GPU kernel is compiled for.
const HEAD_DIMS: &[usize] = &[1, 8, 32, 40, 64, 96, 100, 128];
/// Softmax scales: the default `1/√d`, a custom one and a negative one.
const SCALES: &[Option<f32>] = &[None, Some(0.3), Some(-0.5)];

/// 64 cases, or `PROPTEST_CASES` for a longer soak (e.g. in release builds).
fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok());
    ProptestConfig::with_cases(cases.unwrap_or(64))
}

proptest! {
    #![proptest_config(config())]

    /// The tiled CPU backend meets the accuracy rule on random problems.
    #[test]
    fn cpu_matches_reference(case in cases(SEQ_LENS, HEADS, HEAD_DIMS, SCALES)) {
        let result = match case.dtype {
            DType::F16 => cpu_forward_case::<f16>(&case),
            DType::BF16 => cpu_forward_case::<bf16>(&case),
            DType::F32 => cpu_forward_case::<f32>(&case),
            DType::I32 => unreachable!("the cases draw float dtypes only"),
        };
        result.map_err(TestCaseError::fail)?;
    }
}

/// Params with causal masking and an explicit scale.
fn params(causal: bool, scale: Option<f32>) -> AttnParams<'static> {
    AttnParams {
        causal,
        softmax_scale: scale,
        ..AttnParams::default()
    }
}

/// Causal with more queries than keys: the first `Nq − Nk` rows see nothing, and every
/// implementation gives them O = 0 exactly and LSE = −∞.
fn fully_masked_rows_in<T: Element>() {
    let shape = AttnShape {
        batch: 2,
        seqlen_q: 70,
        seqlen_k: 5,
        heads_q: 4,
        heads_kv: 2,
        head_dim: 8,
    };
    let (q, k, v) = random_qkv::<T>(
        &mut StdRng::seed_from_u64(7),
        &shape,
        Magnitude::Normal,
        1.0,
    );
    let p = params(true, None);
    let (o, lse) = attention_cpu(q.view(), k.view(), v.view(), &p).unwrap();
    let (o_naive, lse_naive) = attention_naive(q.view(), k.view(), v.view(), &p).unwrap();
    let (q64, k64, v64) = (to_f64(q.view()), to_f64(k.view()), to_f64(v.view()));
    let (o_ref, lse_ref) = attention_reference(q64.view(), k64.view(), v64.view(), &p).unwrap();
    let hidden = shape.seqlen_q - shape.seqlen_k; // rows 0..65 see no key
    let outputs = [to_f64(o.view()), to_f64(o_naive.view()), o_ref];
    for o in &outputs {
        assert!(o.slice(s![.., ..hidden, .., ..]).iter().all(|&x| x == 0.0));
        assert!(o
            .slice(s![.., hidden.., .., ..])
            .iter()
            .all(|x| x.is_finite()));
    }
    for lse in [to_f64(lse.view()), to_f64(lse_naive.view()), lse_ref] {
        assert!(lse
            .slice(s![.., .., ..hidden])
            .iter()
            .all(|&x| x == f64::NEG_INFINITY));
        assert!(lse
            .slice(s![.., .., hidden..])
            .iter()
            .all(|x| x.is_finite()));
    }
}

#[test]
fn fully_masked_rows_give_zero_and_neg_inf() {
    fully_masked_rows_in::<f32>();
    fully_masked_rows_in::<f16>();
    fully_masked_rows_in::<bf16>();
}

/// A `[1, n, 1, d]` array from rows of values.
fn rows(values: &[&[f32]]) -> Array4<f32> {
    let d = values[0].len();
    Array4::from_shape_fn((1, values.len(), 1, d), |(_, i, _, j)| values[i][j])
}

/// Runs the CPU backend and both references on small f32 inputs.
fn all_three(
    q: &Array4<f32>,
    k: &Array4<f32>,
    v: &Array4<f32>,
    p: &AttnParams,
) -> [(Array4<f64>, Array3<f64>); 3] {
    let (o, lse) = attention_cpu(q.view(), k.view(), v.view(), p).unwrap();
    let (o_n, lse_n) = attention_naive(q.view(), k.view(), v.view(), p).unwrap();
    let (q64, k64, v64) = (to_f64(q.view()), to_f64(k.view()), to_f64(v.view()));
    let reference = attention_reference(q64.view(), k64.view(), v64.view(), p).unwrap();
    [
        (to_f64(o.view()), to_f64(lse.view())),
        (to_f64(o_n.view()), to_f64(lse_n.view())),
        reference,
    ]
}

#[test]
fn single_key_returns_its_value_and_score() {
    // score = 0.5 · (1·2 + 1·2 + 1·2 + 1·2) = 4 for both queries; softmax over one key is 1
    let q = rows(&[&[1.0; 4], &[1.0; 4]]);
    let k = rows(&[&[2.0; 4]]);
    let v = rows(&[&[1.0, -2.0, 3.5, 0.25]]);
    for causal in [false, true] {
        for (o, lse) in all_three(&q, &k, &v, &params(causal, Some(0.5))) {
            // causal with Nq = 2 > Nk = 1: query 0 sees no key, query 1 sees key 0
            let seen: &[usize] = if causal { &[1] } else { &[0, 1] };
            for &i in seen {
                assert_eq!(o.slice(s![0, i, 0, ..]).to_vec(), [1.0, -2.0, 3.5, 0.25]);
                assert!(
                    (lse[[0, 0, i]] - 4.0).abs() < 1e-6,
                    "lse {}",
                    lse[[0, 0, i]]
                );
            }
            if causal {
                assert_eq!(lse[[0, 0, 0]], f64::NEG_INFINITY);
                assert!(o.slice(s![0, 0, 0, ..]).iter().all(|&x| x == 0.0));
            }
        }
    }
}

#[test]
fn equal_scores_average_the_values() {
    // two keys with the same score 1: O is the mean of the two value rows, LSE = 1 + ln 2
    let q = rows(&[&[1.0, 0.0]]);
    let k = rows(&[&[1.0, 5.0], &[1.0, -3.0]]);
    let v = rows(&[&[2.0, 0.0], &[4.0, 1.0]]);
    for (o, lse) in all_three(&q, &k, &v, &params(false, Some(1.0))) {
        assert_eq!(o.slice(s![0, 0, 0, ..]).to_vec(), [3.0, 0.5]);
        assert!((lse[[0, 0, 0]] - (1.0 + 2f64.ln())).abs() < 1e-6);
    }
}

#[test]
fn any_strides_give_identical_results() {
    // views with a reversed sequence axis and every other element of d, against standard layout
    let shape = AttnShape {
        batch: 2,
        seqlen_q: 80,
        seqlen_k: 70,
        heads_q: 4,
        heads_kv: 2,
        head_dim: 24,
    };
    let (q, k, v) = random_qkv::<bf16>(
        &mut StdRng::seed_from_u64(3),
        &shape,
        Magnitude::Normal,
        1.0,
    );
    let spec = s![.., ..;-1, .., ..;2];
    let pad = |a: &Array4<bf16>| {
        let (b, n, h, d) = a.dim();
        let mut big = Array4::from_elem((b, n, h, 2 * d), bf16::NAN);
        big.slice_mut(spec).assign(a);
        big
    };
    let (qb, kb, vb) = (pad(&q), pad(&k), pad(&v));
    let p = params(true, None);
    let expected = attention_cpu(q.view(), k.view(), v.view(), &p).unwrap();
    let got = attention_cpu(qb.slice(spec), kb.slice(spec), vb.slice(spec), &p).unwrap();
    assert_eq!(got.0, expected.0);
    assert_eq!(got.1, expected.1);
}

/// Every implementation returns an error matching `expected` for these input shapes.
fn assert_rejected(
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    p: AttnParams,
    expected: fn(&FlashError) -> bool,
) {
    let (q, k, v) = (
        Array4::<f32>::zeros(q),
        Array4::<f32>::zeros(k),
        Array4::<f32>::zeros(v),
    );
    let cpu = attention_cpu(q.view(), k.view(), v.view(), &p).map(drop);
    let naive = attention_naive(q.view(), k.view(), v.view(), &p).map(drop);
    let (q64, k64, v64) = (to_f64(q.view()), to_f64(k.view()), to_f64(v.view()));
    let reference = attention_reference(q64.view(), k64.view(), v64.view(), &p).map(drop);
    for (name, result) in [("cpu", cpu), ("naive", naive), ("reference", reference)] {
        match result {
            Err(e) if expected(&e) => {}
            other => panic!("{name}: unexpected {other:?}"),
        }
    }
}

const QKV: [usize; 4] = [2, 5, 4, 8];
const KV: [usize; 4] = [2, 7, 2, 8];
const OK: AttnParams<'static> = AttnParams::DEFAULT;

fn is_shape(e: &FlashError) -> bool {
    matches!(e, FlashError::Shape(_))
}

#[test]
fn batch_mismatch_is_a_shape_error() {
    assert_rejected([3, 5, 4, 8], KV, KV, OK, is_shape);
}

#[test]
fn head_dim_mismatch_is_a_shape_error() {
    assert_rejected([2, 5, 4, 16], KV, KV, OK, is_shape);
}

#[test]
fn k_and_v_shapes_differ_is_a_shape_error() {
    assert_rejected(QKV, KV, [2, 8, 2, 8], OK, is_shape);
    assert_rejected(QKV, KV, [2, 7, 1, 8], OK, is_shape);
}

#[test]
fn zero_heads_are_shape_errors() {
    assert_rejected(
        QKV,
        [2, 7, 0, 8],
        [2, 7, 0, 8],
        OK,
        |e| matches!(e, FlashError::Shape(m) if m.contains("heads_kv is 0")),
    );
    assert_rejected(
        [2, 5, 0, 8],
        [2, 7, 0, 8],
        [2, 7, 0, 8],
        OK,
        |e| matches!(e, FlashError::Shape(m) if m.contains("heads_q is 0")),
    );
}

#[test]
fn heads_not_a_multiple_is_a_gqa_error() {
    assert_rejected(QKV, [2, 7, 3, 8], [2, 7, 3, 8], OK, |e| {
        matches!(
            e,
            FlashError::GqaRatio {
                heads_q: 4,
                heads_kv: 3
            }
        )
    });
}

#[test]
fn empty_batch_or_sequence_is_a_shape_error() {
    assert_rejected([0, 5, 4, 8], [0, 7, 2, 8], [0, 7, 2, 8], OK, is_shape);
    assert_rejected([2, 0, 4, 8], KV, KV, OK, is_shape);
    assert_rejected(QKV, [2, 0, 2, 8], [2, 0, 2, 8], OK, is_shape);
}

#[test]
fn zero_head_dim_is_a_shape_error_without_the_gpu_range() {
    assert_rejected([2, 5, 4, 0], [2, 7, 2, 0], [2, 7, 2, 0], OK, |e| {
        let m = e.to_string();
        matches!(e, FlashError::Shape(_)) && m.contains("head dim is 0") && !m.contains("256")
    });
}

#[test]
fn non_finite_scale_is_a_param_error() {
    for scale in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert_rejected(QKV, KV, KV, params(false, Some(scale)), |e| {
            matches!(e, FlashError::Param(_))
        });
    }
}

/// Runs [`attention_cpu_into`] on zero inputs of shapes [`QKV`] and [`KV`] into outputs of
/// the given shapes.
fn run_into(o: [usize; 4], lse: [usize; 3]) -> flash_attn::Result<()> {
    let (q, k) = (Array4::<f32>::zeros(QKV), Array4::<f32>::zeros(KV));
    let (mut o, mut lse) = (Array4::<f32>::zeros(o), Array3::<f32>::zeros(lse));
    attention_cpu_into(
        q.view(),
        k.view(),
        k.view(),
        &OK,
        o.view_mut(),
        lse.view_mut(),
    )
}

#[test]
fn wrong_output_shapes_are_shape_errors() {
    assert!(matches!(
        run_into([2, 5, 2, 8], [2, 4, 5]),
        Err(FlashError::Shape(_))
    ));
    assert!(matches!(
        run_into(QKV, [2, 5, 4]),
        Err(FlashError::Shape(_))
    ));
    assert!(run_into(QKV, [2, 4, 5]).is_ok());
}
