//! Bad input on the CPU backend: non-finite values, huge scales, shapes whose buffers cannot
//! exist, and the f32 drift of long key sequences. Each case runs through all three
//! implementations (tiled, same-dtype naive, float64 reference).

use ndarray::{Array3, Array4, ArrayView4};

use crate::cpu::{attention_cpu, attention_naive, attention_reference};
use crate::error::FlashError;
use crate::params::AttnParams;
use crate::shape::MAX_DIM;

/// `[1, n, 1, d]` with deterministic values in about ±1.
fn seq(n: usize, d: usize, seed: u32) -> Array4<f32> {
    Array4::from_shape_fn([1, n, 1, d], |(_, i, _, c)| {
        let x = (i as u32 * 31 + c as u32 * 17 + seed * 7) % 23;
        x as f32 / 11.0 - 1.0
    })
}

/// O and LSE of the tiled, naive and reference implementations, all as f64.
fn all_three(
    q: &Array4<f32>,
    k: &Array4<f32>,
    v: &Array4<f32>,
    p: &AttnParams,
) -> [(Array4<f64>, Array3<f64>); 3] {
    let wide = |(o, lse): (Array4<f32>, Array3<f32>)| (o.mapv(f64::from), lse.mapv(f64::from));
    let tiled = attention_cpu(q.view(), k.view(), v.view(), p).unwrap();
    let naive = attention_naive(q.view(), k.view(), v.view(), p).unwrap();
    let f64v = |a: &Array4<f32>| a.mapv(f64::from);
    let reference = attention_reference(f64v(q).view(), f64v(k).view(), f64v(v).view(), p);
    [wide(tiled), wide(naive), reference.unwrap()]
}

const PLAIN: AttnParams<'static> = AttnParams::DEFAULT;

const CAUSAL: AttnParams<'static> = AttnParams {
    causal: true,
    ..AttnParams::DEFAULT
};

/// Whether query row `i` is NaN in every O element and in LSE.
fn row_is_nan(o: &Array4<f64>, lse: &Array3<f64>, i: usize) -> bool {
    o.slice(ndarray::s![0, i, 0, ..]).iter().all(|x| x.is_nan()) && lse[[0, 0, i]].is_nan()
}

/// Whether query row `i` is finite in O and LSE.
fn row_is_finite(o: &Array4<f64>, lse: &Array3<f64>, i: usize) -> bool {
    o.slice(ndarray::s![0, i, 0, ..])
        .iter()
        .all(|x| x.is_finite())
        && lse[[0, 0, i]].is_finite()
}

#[test]
fn nan_in_a_query_row_gives_nan_in_that_row_only() {
    let (mut q, k, v) = (seq(5, 8, 1), seq(7, 8, 2), seq(7, 8, 3));
    q[[0, 2, 0, 3]] = f32::NAN;
    for (name, (o, lse)) in ["tiled", "naive", "reference"]
        .iter()
        .zip(all_three(&q, &k, &v, &PLAIN))
    {
        assert!(row_is_nan(&o, &lse, 2), "{name}: O={o} LSE={lse}");
        for i in [0, 1, 3, 4] {
            assert!(row_is_finite(&o, &lse, i), "{name}: row {i}");
        }
    }
}

#[test]
fn nan_in_a_key_reaches_the_rows_that_see_it_only() {
    let (q, mut k, v) = (seq(6, 8, 1), seq(6, 8, 2), seq(6, 8, 3));
    k[[0, 3, 0, 5]] = f32::NAN;
    for (name, (o, lse)) in ["tiled", "naive", "reference"]
        .iter()
        .zip(all_three(&q, &k, &v, &PLAIN))
    {
        assert!(
            (0..6).all(|i| row_is_nan(&o, &lse, i)),
            "{name}: O={o} LSE={lse}"
        );
    }
    // Causal: rows 0..3 do not see key 3, and its K is never read for them.
    for (name, (o, lse)) in ["tiled", "naive", "reference"]
        .iter()
        .zip(all_three(&q, &k, &v, &CAUSAL))
    {
        for i in 0..6 {
            let ok = if i < 3 {
                row_is_finite(&o, &lse, i)
            } else {
                row_is_nan(&o, &lse, i)
            };
            assert!(ok, "{name}: row {i}: O={o} LSE={lse}");
        }
    }
}

#[test]
fn nan_in_a_value_reaches_that_column_of_the_rows_that_see_it() {
    let (q, k, mut v) = (seq(6, 8, 1), seq(6, 8, 2), seq(6, 8, 3));
    v[[0, 3, 0, 5]] = f32::NAN;
    for (name, (o, lse)) in ["tiled", "naive", "reference"]
        .iter()
        .zip(all_three(&q, &k, &v, &CAUSAL))
    {
        for i in 0..6 {
            assert!(lse[[0, 0, i]].is_finite(), "{name}: LSE row {i}");
            for c in 0..8 {
                let nan = o[[0, i, 0, c]].is_nan();
                assert_eq!(nan, i >= 3 && c == 5, "{name}: O[{i}, {c}] = {o}");
            }
        }
    }
}

#[test]
fn infinities_never_look_like_a_masked_row() {
    // +∞ in Q: some score is +∞ (or ∞·0 = NaN) → ∞ − ∞ in the softmax → NaN.
    let (mut q, k, v) = (seq(3, 8, 1), seq(5, 8, 2), seq(5, 8, 3));
    q[[0, 1, 0, 0]] = f32::INFINITY;
    for (name, (o, lse)) in ["tiled", "naive", "reference"]
        .iter()
        .zip(all_three(&q, &k, &v, &PLAIN))
    {
        assert!(row_is_nan(&o, &lse, 1), "{name}: O={o} LSE={lse}");
        assert!(
            row_is_finite(&o, &lse, 0) && row_is_finite(&o, &lse, 2),
            "{name}"
        );
    }
    // −∞ in Q against keys whose first component is positive: every visible score is −∞.
    let mut k = seq(5, 8, 2);
    k.slice_mut(ndarray::s![.., .., .., 0]).fill(0.5);
    let mut q = seq(3, 8, 1);
    q[[0, 1, 0, 0]] = f32::NEG_INFINITY;
    for (name, (o, lse)) in ["tiled", "naive", "reference"]
        .iter()
        .zip(all_three(&q, &k, &v, &PLAIN))
    {
        assert!(row_is_nan(&o, &lse, 1), "{name}: O={o} LSE={lse}");
        assert!(
            row_is_finite(&o, &lse, 0) && row_is_finite(&o, &lse, 2),
            "{name}"
        );
    }
    // +∞ in K against positive Q: every row that sees the key has a +∞ score and is NaN.
    let (q, mut k) = (seq(3, 8, 1).mapv(|x| x.abs() + 0.1), seq(5, 8, 2));
    k[[0, 4, 0, 2]] = f32::INFINITY;
    for (name, (o, lse)) in ["tiled", "naive", "reference"]
        .iter()
        .zip(all_three(&q, &k, &v, &PLAIN))
    {
        assert!(
            (0..3).all(|i| row_is_nan(&o, &lse, i)),
            "{name}: O={o} LSE={lse}"
        );
    }
}

#[test]
fn a_minus_infinite_score_beside_finite_ones_is_a_zero_probability() {
    // Key 0's score is −∞ for every row (Q > 0, K[0, 0] = −∞): the result is attention over
    // keys 1.. alone.
    let q = seq(3, 8, 1).mapv(|x| x.abs() + 0.1);
    let (mut k, v) = (seq(5, 8, 2), seq(5, 8, 3));
    k[[0, 0, 0, 0]] = f32::NEG_INFINITY;
    let rest = |a: &Array4<f32>| a.slice(ndarray::s![.., 1.., .., ..]).to_owned();
    let expected = all_three(&q, &rest(&k), &rest(&v), &PLAIN);
    let got = all_three(&q, &k, &v, &PLAIN);
    for ((o, lse), (o_e, lse_e)) in got.iter().zip(&expected) {
        assert!(
            o.iter().zip(o_e).all(|(a, b)| (a - b).abs() < 1e-6),
            "{o} vs {o_e}"
        );
        assert!(
            lse.iter().zip(lse_e).all(|(a, b)| (a - b).abs() < 1e-6),
            "{lse} vs {lse_e}"
        );
    }
}

#[test]
fn fully_masked_rows_stay_zero_and_minus_infinity_even_with_nan_inputs() {
    // seqlen_q > seqlen_k with causal masking: rows 0 and 1 see no key; their Q is NaN.
    let (mut q, k, v) = (seq(4, 8, 1), seq(2, 8, 2), seq(2, 8, 3));
    q.slice_mut(ndarray::s![.., 0..2, .., ..]).fill(f32::NAN);
    for (name, (o, lse)) in ["tiled", "naive", "reference"]
        .iter()
        .zip(all_three(&q, &k, &v, &CAUSAL))
    {
        for i in 0..2 {
            assert!(
                o.slice(ndarray::s![0, i, 0, ..]).iter().all(|&x| x == 0.0),
                "{name}"
            );
            assert_eq!(lse[[0, 0, i]], f64::NEG_INFINITY, "{name}");
        }
        assert!(
            row_is_finite(&o, &lse, 2) && row_is_finite(&o, &lse, 3),
            "{name}"
        );
    }
}

#[test]
fn a_scale_whose_base_2_form_overflows_is_a_param_error() {
    let (q, k) = (seq(2, 8, 1), seq(3, 8, 2));
    let p = AttnParams {
        causal: false,
        softmax_scale: Some(3.0e38),
        ..AttnParams::default()
    };
    let is_param = |e: FlashError| matches!(e, FlashError::Param(m) if m.contains("too large"));
    assert!(is_param(
        attention_cpu(q.view(), k.view(), k.view(), &p).unwrap_err()
    ));
    assert!(is_param(
        attention_naive(q.view(), k.view(), k.view(), &p).unwrap_err()
    ));
    let (q, k) = (q.mapv(f64::from), k.mapv(f64::from));
    assert!(is_param(
        attention_reference(q.view(), k.view(), k.view(), &p).unwrap_err()
    ));
}

#[test]
fn outputs_that_cannot_be_allocated_are_errors_not_aborts() {
    // Broadcast views: a single row of Q stands for 2^31 − 1 rows of head dim 2^17, so O would
    // take 2^50 bytes (beyond any 64-bit user address space).
    let d = 1 << 17;
    let row = Array4::<f32>::zeros([1, 1, 1, d]);
    let q = row.broadcast([1, MAX_DIM, 1, d]).unwrap();
    let k = row.view();
    let is_alloc = |e: FlashError| matches!(e, FlashError::Alloc(_) | FlashError::TooLarge(_));
    assert!(is_alloc(attention_cpu(q, k, k, &PLAIN).unwrap_err()));
    assert!(is_alloc(attention_naive(q, k, k, &PLAIN).unwrap_err()));
    let row = Array4::<f64>::zeros([1, 1, 1, d]);
    let q64: ArrayView4<f64> = row.broadcast([1, MAX_DIM, 1, d]).unwrap();
    assert!(is_alloc(
        attention_reference(q64, row.view(), row.view(), &PLAIN).unwrap_err()
    ));
    // A view ndarray accepts (about 2^62 elements) whose output's bytes overflow usize.
    let row = Array4::<f32>::zeros([1, 1, 1, 1]);
    let q = row.broadcast([MAX_DIM, MAX_DIM, 1, 1]).unwrap();
    let k = row.broadcast([MAX_DIM, 1, 1, 1]).unwrap();
    assert!(matches!(
        attention_cpu(q, k, k, &PLAIN),
        Err(FlashError::TooLarge(_))
    ));
}

#[test]
fn a_million_keys_do_not_drift() {
    // Constant V: O must equal it whatever the scores. Summing one key at a time into an f32
    // running sum drifted by about 1 % here; per-tile sums keep it near f32 rounding.
    let (n, d, value) = (1_000_000, 16, 0.3f32);
    let q = seq(1, d, 1);
    let k = Array4::from_shape_fn([1, n, 1, d], |(_, i, _, c)| {
        let x = (i as u64 * 2_654_435_761 + c as u64 * 40_503) % 1000;
        x as f32 / 500.0 - 1.0
    });
    let v = Array4::from_elem([1, n, 1, d], value);
    let (o, lse) = attention_cpu(q.view(), k.view(), v.view(), &PLAIN).unwrap();
    let worst = o
        .iter()
        .map(|&x| ((x - value) / value).abs())
        .fold(0.0, f32::max);
    assert!(worst < 1e-4, "O drifts by {worst:e} relative");
    let (q64, k64, v64) = (q.mapv(f64::from), k.mapv(f64::from), v.mapv(f64::from));
    let (_, lse_ref) = attention_reference(q64.view(), k64.view(), v64.view(), &PLAIN).unwrap();
    let lse_err = (f64::from(lse[[0, 0, 0]]) - lse_ref[[0, 0, 0]]).abs();
    assert!(lse_err < 1e-4, "LSE off by {lse_err:e}");
}
