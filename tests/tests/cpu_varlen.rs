//! Sequences of different lengths on the CPU backend: packed varlen batches
//! (`attention_varlen_cpu`, `attention_varlen_backward_cpu`) and key padding
//! (`AttnParams::seqlens_k`). Each sequence's outputs must be exactly those of a call on that
//! sequence alone (copied out by the test), rows of sequences without keys O = 0 and
//! LSE = −∞, gradients of keys nobody sees 0; invalid lengths are typed errors.

use flash_attn::cpu::{
    attention_backward_cpu, attention_cpu, attention_varlen_backward_cpu, attention_varlen_cpu,
};
use flash_attn::{AttnParams, FlashError};
use flash_attn_tests::{mask_recipes, prefix_sums, random_array};
use half::bf16;
use ndarray::{s, Array3, Array4, Axis};
use proptest::prelude::*;
use rand::SeedableRng;

/// Random packed tensors `[total, H, d]`.
fn packed(rng: &mut impl rand::Rng, total: usize, heads: usize, d: usize) -> Array3<bf16> {
    random_array::<bf16>(rng, [1, total, heads, d], 1.0).index_axis_move(Axis(0), 0)
}

/// Rows `r` of a packed tensor as a batch of one.
fn alone(t: &Array3<bf16>, r: std::ops::Range<usize>) -> Array4<bf16> {
    t.slice(s![r, .., ..]).to_owned().insert_axis(Axis(0))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn varlen_is_each_sequence_alone(
        lens in prop::collection::vec((0usize..40, 0usize..40), 1..5),
        causal in any::<bool>(),
        masks in mask_recipes(),
        seed in any::<u64>(),
    ) {
        let (hq, hkv, d) = (4, 2, 24);
        let (cu_q, cu_k) = prefix_sums(&lens);
        let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
        prop_assume!(tq > 0 && tk > 0);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (q, k, v) = (packed(&mut rng, tq, hq, d), packed(&mut rng, tk, hkv, d), packed(&mut rng, tk, hkv, d));
        let d_o = packed(&mut rng, tq, hq, d);
        let base = AttnParams { causal, ..AttnParams::default() };
        let params = masks.apply(base, lens.len(), hq);
        let cu = (cu_q.as_slice(), cu_k.as_slice());
        let (o, lse) = attention_varlen_cpu(q.view(), k.view(), v.view(), cu, &params).unwrap();
        let (dq, dk, dv) = attention_varlen_backward_cpu(
            q.view(), k.view(), v.view(), o.view(), d_o.view(), lse.view(), cu, &params,
        ).unwrap();
        for b in 0..lens.len() {
            let (rq, rk) = (cu_q[b] as usize..cu_q[b + 1] as usize, cu_k[b] as usize..cu_k[b + 1] as usize);
            if rq.is_empty() {
                // Keys nobody queries get zero gradients.
                prop_assert!(dk.slice(s![rk.clone(), .., ..]).iter().all(|x| x.to_f32() == 0.0));
                continue;
            }
            if rk.is_empty() {
                prop_assert!(o.slice(s![rq.clone(), .., ..]).iter().all(|x| x.to_f32() == 0.0));
                prop_assert!(lse.slice(s![.., rq.clone()]).iter().all(|&x| x == f32::NEG_INFINITY));
                prop_assert!(dq.slice(s![rq.clone(), .., ..]).iter().all(|x| x.to_f32() == 0.0));
                continue;
            }
            let p = params.for_entry(b, hq);
            let (qa, ka, va) = (alone(&q, rq.clone()), alone(&k, rk.clone()), alone(&v, rk.clone()));
            let (o1, lse1) = attention_cpu(qa.view(), ka.view(), va.view(), &p).unwrap();
            prop_assert_eq!(o1.index_axis(Axis(0), 0), o.slice(s![rq.clone(), .., ..]));
            prop_assert_eq!(lse1.index_axis(Axis(0), 0), lse.slice(s![.., rq.clone()]));
            let (dq1, dk1, dv1) = attention_backward_cpu(
                qa.view(), ka.view(), va.view(), o1.view(), alone(&d_o, rq.clone()).view(), lse1.view(), &p,
            ).unwrap();
            prop_assert_eq!(dq1.index_axis(Axis(0), 0), dq.slice(s![rq, .., ..]));
            prop_assert_eq!(dk1.index_axis(Axis(0), 0), dk.slice(s![rk.clone(), .., ..]));
            prop_assert_eq!(dv1.index_axis(Axis(0), 0), dv.slice(s![rk, .., ..]));
        }
    }

    #[test]
    fn key_padding_is_each_entry_alone(
        lens in prop::collection::vec(0usize..30, 1..4),
        nq in 1usize..30,
        causal in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (b, hq, hkv, d) = (lens.len(), 2, 1, 16);
        let nk = 30;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let q = random_array::<bf16>(&mut rng, [b, nq, hq, d], 1.0);
        let k = random_array::<bf16>(&mut rng, [b, nk, hkv, d], 1.0);
        let v = random_array::<bf16>(&mut rng, [b, nk, hkv, d], 1.0);
        let d_o = random_array::<bf16>(&mut rng, [b, nq, hq, d], 1.0);
        let seqlens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let params = AttnParams { causal, seqlens_k: Some(&seqlens), ..AttnParams::default() };
        let (o, lse) = attention_cpu(q.view(), k.view(), v.view(), &params).unwrap();
        let (dq, dk, dv) = attention_backward_cpu(
            q.view(), k.view(), v.view(), o.view(), d_o.view(), lse.view(), &params,
        ).unwrap();
        for (e, &len) in lens.iter().enumerate() {
            prop_assert!(dk.slice(s![e, len.., .., ..]).iter().all(|x| x.to_f32() == 0.0));
            prop_assert!(dv.slice(s![e, len.., .., ..]).iter().all(|x| x.to_f32() == 0.0));
            if len == 0 {
                prop_assert!(lse.slice(s![e, .., ..]).iter().all(|&x| x == f32::NEG_INFINITY));
                prop_assert!(dq.slice(s![e, .., .., ..]).iter().all(|x| x.to_f32() == 0.0));
                continue;
            }
            let one = AttnParams { causal, ..AttnParams::default() };
            let cut = |t: &Array4<bf16>, r: std::ops::Range<usize>| t.slice(s![e..e + 1, r, .., ..]).to_owned();
            let (qa, ka, va) = (cut(&q, 0..nq), cut(&k, 0..len), cut(&v, 0..len));
            let (o1, lse1) = attention_cpu(qa.view(), ka.view(), va.view(), &one).unwrap();
            prop_assert_eq!(o1.index_axis(Axis(0), 0), o.index_axis(Axis(0), e));
            prop_assert_eq!(lse1.index_axis(Axis(0), 0), lse.index_axis(Axis(0), e));
            let (dq1, dk1, _) = attention_backward_cpu(
                qa.view(), ka.view(), va.view(), o1.view(), cut(&d_o, 0..nq).view(), lse1.view(), &one,
            ).unwrap();
            prop_assert_eq!(dq1.index_axis(Axis(0), 0), dq.index_axis(Axis(0), e));
            prop_assert_eq!(dk1.index_axis(Axis(0), 0), dk.slice(s![e, ..len, .., ..]));
        }
    }
}

#[test]
fn invalid_lengths_are_typed_errors() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let q = packed(&mut rng, 10, 2, 8);
    let k = packed(&mut rng, 12, 1, 8);
    let params = AttnParams::default();
    let run = |cu_q: &[i32], cu_k: &[i32]| {
        attention_varlen_cpu(q.view(), k.view(), k.view(), (cu_q, cu_k), &params)
    };
    assert!(run(&[0, 4, 10], &[0, 12, 12]).is_ok());
    for (cu_q, cu_k) in [
        (&[0, 4, 9][..], &[0, 5, 12][..]),
        (&[1, 4, 10][..], &[0, 5, 12][..]),
        (&[0, 6, 4, 10][..], &[0, 5, 6, 12][..]),
        (&[0, 10][..], &[0, 5, 12][..]),
        (&[0][..], &[0][..]),
    ] {
        assert!(
            matches!(run(cu_q, cu_k), Err(FlashError::Shape(_))),
            "{cu_q:?} {cu_k:?}"
        );
    }
    let lens = [3];
    let with_lens = AttnParams {
        seqlens_k: Some(&lens),
        ..AttnParams::default()
    };
    let r = attention_varlen_cpu(
        q.view(),
        k.view(),
        k.view(),
        (&[0, 10], &[0, 12]),
        &with_lens,
    );
    assert!(matches!(r, Err(FlashError::Param(_))));
    let q4 = random_array::<bf16>(&mut rng, [2, 5, 2, 8], 1.0);
    let k4 = random_array::<bf16>(&mut rng, [2, 6, 1, 8], 1.0);
    for bad in [&[3][..], &[3, 7], &[-1, 2]] {
        let p = AttnParams {
            seqlens_k: Some(bad),
            ..AttnParams::default()
        };
        let r = attention_cpu(q4.view(), k4.view(), k4.view(), &p);
        assert!(matches!(r, Err(FlashError::Shape(_))), "{bad:?}");
    }
}
