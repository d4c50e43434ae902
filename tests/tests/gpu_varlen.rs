//! Sequences of different lengths on the GPU: packed varlen batches (`flash_attn_varlen`,
//! `flash_attn_varlen_backward`) and key padding of a padded batch (`AttnParams::seqlens_k`),
//! forward and backward, against the float64 reference run sequence by sequence, with the
//! accuracy rules of `flash_attn_tests`. Lengths include 0 and 1, masks and GQA come from the
//! shared recipes, a third of the cases add dropout (whose masks count the call's sequences),
//! outputs are poisoned with NaN before every launch.
//!
//! Without a CUDA device every test prints a loud SKIPPED line and passes, unless
//! `FLASH_ATTN_REQUIRE_GPU=1`.

use flash_attn::cpu::sequences::{backward_spans, forward_spans, rows, stat_rows};
use flash_attn::cpu::{
    attention_backward_naive, attention_backward_reference, attention_backward_reference_given,
    attention_naive, attention_reference,
};
use flash_attn::seqs::{SeqSpan, VarlenLens};
use flash_attn::shape::AttnShape;
use flash_attn::{
    flash_attn_backward_into, flash_attn_into, flash_attn_varlen_backward_into,
    flash_attn_varlen_into, AttnParams, BwdMode, Device, DeviceTensor, Dropout, Element,
    FlashError, HostVarlen, Varlen,
};
use flash_attn_tests::gpu::{device as gpu_device, gpu_cases, upload, Layout};
use flash_attn_tests::{
    check_accuracy, check_gradient_accuracy, mask_recipes, prefix_sums, random_array, to_f64,
    Magnitude, MaskRecipe, GPU_GRADIENT_FACTOR,
};
use half::{bf16, f16};
use ndarray::{Array3, Array4, ArrayD, Axis, Ix3, Ix4};
use proptest::prelude::*;
use rand::SeedableRng;
use std::borrow::Cow;

/// The shared device, or `None` after a loud SKIPPED line.
fn device() -> Option<&'static Device> {
    gpu_device("gpu_varlen")
}

/// One random batch of sequences: their lengths, heads, head dim and options.
#[derive(Clone, Debug)]
struct VarCase {
    /// `(queries, keys)` per sequence.
    lens: Vec<(usize, usize)>,
    heads: (usize, usize),
    head_dim: usize,
    causal: bool,
    masks: MaskRecipe,
    magnitude: Magnitude,
    /// Packed varlen (else a padded batch with key padding).
    varlen: bool,
    /// Varlen: give the host copy of the prefix sums (else the call reads them back).
    host_copy: bool,
    deterministic: bool,
    /// Attention dropout `(p, seed, offset)` (the sequences' masks count sequences of the
    /// whole call).
    dropout: Option<(f32, u64, u64)>,
    seed: u64,
}

fn case_strategy() -> impl Strategy<Value = VarCase> {
    let len = prop::sample::select(&[0usize, 1, 5, 16, 33, 64, 65, 127, 130, 200, 300][..]);
    let lens = prop::collection::vec((len.clone(), len), 1..6);
    let heads = prop::sample::select(&[(1usize, 1usize), (2, 1), (4, 2), (3, 3)][..]);
    let dims = prop::sample::select(&[16usize, 32, 40, 64, 96, 128, 256][..]);
    let mags = prop::sample::select(&[Magnitude::Normal, Magnitude::Large][..]);
    let dropout = prop_oneof![
        2 => Just(None),
        1 => (prop::sample::select(&[0.1f32, 0.17, 0.3][..]), any::<u64>(), any::<u64>()).prop_map(Some),
    ];
    (
        lens,
        heads,
        dims,
        any::<bool>(),
        (mask_recipes(), dropout),
        mags,
        (any::<bool>(), any::<bool>(), any::<bool>(), any::<u64>()),
    )
        .prop_map(
            |(
                lens,
                heads,
                head_dim,
                causal,
                (masks, dropout),
                magnitude,
                (varlen, host_copy, det, seed),
            )| {
                VarCase {
                    dropout,
                    lens,
                    heads,
                    head_dim,
                    causal,
                    masks,
                    magnitude,
                    varlen,
                    host_copy,
                    deterministic: det,
                    seed,
                }
            },
        )
}

impl VarCase {
    /// The prefix sums of the lengths.
    fn cu(&self) -> (Vec<i32>, Vec<i32>) {
        prefix_sums(&self.lens)
    }

    /// The shape the tensors are built with: packed as one entry `[1, total, H, d]`, or a
    /// padded batch (`Nq`, `Nk` the longest, at least 1).
    fn tensor_shape(&self) -> AttnShape {
        let (hq, hkv) = self.heads;
        let b = self.lens.len();
        let (nq, nk, batch) = if self.varlen {
            let (cu_q, cu_k) = self.cu();
            let total = |cu: &[i32]| (*cu.last().unwrap() as usize).max(1);
            (total(&cu_q), total(&cu_k), 1)
        } else {
            let max = |f: fn(&(usize, usize)) -> usize| self.lens.iter().map(f).max().unwrap();
            (max(|l| l.0).max(1), max(|l| l.1).max(1), b)
        };
        AttnShape {
            batch,
            seqlen_q: nq,
            seqlen_k: nk,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: self.head_dim,
        }
    }

    /// The sequences' rows in the tensors. A varlen batch whose totals were raised to 1 (every
    /// sequence empty on one side) gets that row in an extra sequence of its own.
    fn spans(&self) -> Vec<SeqSpan> {
        if self.varlen {
            let (cu_q, cu_k) = self.cu_padded();
            VarlenLens::check(
                Cow::Owned(cu_q),
                Cow::Owned(cu_k),
                self.total().0,
                self.total().1,
            )
            .expect("valid prefix sums")
            .spans()
        } else {
            let nq = self.tensor_shape().seqlen_q;
            (0..self.lens.len())
                .map(|b| SeqSpan {
                    seq: b,
                    entry: b,
                    q: 0..nq,
                    k: 0..self.lens[b].1,
                })
                .collect()
        }
    }

    /// Packed totals (at least 1 row each: tensors are never empty).
    fn total(&self) -> (usize, usize) {
        let s = self.tensor_shape();
        (s.seqlen_q, s.seqlen_k)
    }

    /// The prefix sums the call gets: [`VarCase::cu`], plus a last sequence holding the row
    /// that a total of 0 was raised to.
    fn cu_padded(&self) -> (Vec<i32>, Vec<i32>) {
        let (mut cu_q, mut cu_k) = self.cu();
        let (tq, tk) = self.total();
        if *cu_q.last().unwrap() as usize != tq || *cu_k.last().unwrap() as usize != tk {
            cu_q.push(tq as i32);
            cu_k.push(tk as i32);
        }
        (cu_q, cu_k)
    }

    /// The key lengths of a padded batch.
    fn seqlens_k(&self) -> Vec<i32> {
        self.lens.iter().map(|l| l.1 as i32).collect()
    }

    /// The number of sequences the call sees.
    fn sequences(&self) -> usize {
        if self.varlen {
            self.cu_padded().0.len() - 1
        } else {
            self.lens.len()
        }
    }
}

/// Forward and backward of one case on the GPU and the references; the accuracy rules.
fn run_case<T: Element>(dev: &Device, case: &VarCase) -> Result<(), String> {
    let err = |e: FlashError| e.to_string();
    let shape = case.tensor_shape();
    let seqlens_k = case.seqlens_k();
    let base = AttnParams {
        seqlens_k: (!case.varlen).then_some(seqlens_k.as_slice()),
        ..AttnParams::default()
    };
    let params = case.masks.apply(base, case.sequences(), shape.heads_q);
    let params = AttnParams {
        causal: case.causal,
        seqlens_k: base.seqlens_k,
        dropout: case
            .dropout
            .map(|(p, seed, offset)| Dropout::new(p, seed, offset)),
        ..params
    };
    let scale = params.scale(shape.head_dim).map_err(err)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(case.seed);
    let sigma = case.magnitude.std_dev(shape.head_dim, scale);
    let q = random_array::<T>(&mut rng, shape.q_dims(), sigma);
    let k = random_array::<T>(&mut rng, shape.kv_dims(), sigma);
    let v = random_array::<T>(&mut rng, shape.kv_dims(), 1.0);
    let d_o = random_array::<T>(&mut rng, shape.q_dims(), 1.0);

    // The GPU: packed tensors are uploaded as `[total, H, d]`.
    let up = |a: &Array4<T>| -> DeviceTensor<T> {
        if case.varlen {
            DeviceTensor::from_ndarray(dev, a.index_axis(Axis(0), 0)).expect("upload")
        } else {
            upload(dev, a.view(), Layout::Contiguous)
        }
    };
    let (qd, kd, vd, dod) = (up(&q), up(&k), up(&v), up(&d_o));
    let lse_dims: Vec<usize> = if case.varlen {
        vec![shape.heads_q, shape.seqlen_q]
    } else {
        shape.lse_dims().to_vec()
    };
    let mut o = DeviceTensor::<T>::zeros(dev, qd.shape()).map_err(err)?;
    let mut lse = DeviceTensor::<f32>::zeros(dev, &lse_dims).map_err(err)?;
    let mut dq = DeviceTensor::<T>::zeros(dev, qd.shape()).map_err(err)?;
    let mut dk = DeviceTensor::<T>::zeros(dev, kd.shape()).map_err(err)?;
    let mut dv = DeviceTensor::<T>::zeros(dev, kd.shape()).map_err(err)?;
    o.fill_nan(dev).map_err(err)?;
    lse.fill_nan(dev).map_err(err)?;
    for t in [&mut dq, &mut dk, &mut dv] {
        t.fill_nan(dev).map_err(err)?;
    }
    let mode = if case.deterministic {
        BwdMode::Deterministic
    } else {
        BwdMode::Fast
    };
    if case.varlen {
        let (cu_q, cu_k) = case.cu_padded();
        let cu_qd = DeviceTensor::from_host(dev, &[cu_q.len()], &cu_q).map_err(err)?;
        let cu_kd = DeviceTensor::from_host(dev, &[cu_k.len()], &cu_k).map_err(err)?;
        let varlen = Varlen {
            cu_seqlens_q: &cu_qd,
            cu_seqlens_k: &cu_kd,
            host: case.host_copy.then_some(HostVarlen {
                cu_seqlens_q: &cu_q,
                cu_seqlens_k: &cu_k,
            }),
        };
        flash_attn_varlen_into(dev, &qd, &kd, &vd, &varlen, &params, &mut o, &mut lse)
            .map_err(err)?;
        flash_attn_varlen_backward_into(
            dev, &qd, &kd, &vd, &o, &dod, &lse, &varlen, &params, mode, &mut dq, &mut dk, &mut dv,
        )
        .map_err(err)?;
    } else {
        flash_attn_into(dev, &qd, &kd, &vd, &params, &mut o, &mut lse).map_err(err)?;
        flash_attn_backward_into(
            dev, &qd, &kd, &vd, &o, &dod, &lse, &params, mode, &mut dq, &mut dk, &mut dv,
        )
        .map_err(err)?;
    }
    let down = |t: &DeviceTensor<T>| batched4(t.to_ndarray(dev).expect("download"));
    let o_gpu = down(&o);
    let lse_gpu = batched3(lse.to_ndarray(dev).expect("download"));
    let grads = [down(&dq), down(&dk), down(&dv)];

    // The references, sequence by sequence.
    let spans = case.spans();
    let f64s = |a: &Array4<T>| to_f64(a.view());
    let (q64, k64, v64, do64) = (f64s(&q), f64s(&k), f64s(&v), f64s(&d_o));
    let (qv, kv, vv, dov) = (q64.view(), k64.view(), v64.view(), do64.view());
    let q_dims: [usize; 4] = shape.q_dims();
    let sliced = |sp: &SeqSpan| {
        (
            rows(&qv, sp, true),
            rows(&kv, sp, false),
            rows(&vv, sp, false),
        )
    };
    let reference = forward_spans(
        q_dims,
        &spans,
        &params,
        (0.0, f64::NEG_INFINITY),
        |sp, p| {
            let (q, k, v) = sliced(sp);
            attention_reference(q, k, v, p)
        },
    )
    .map_err(err)?;
    let (qt, kt, vt, dot) = (q.view(), k.view(), v.view(), d_o.view());
    let naive = forward_spans(
        q_dims,
        &spans,
        &params,
        (T::default(), f32::NEG_INFINITY),
        |sp, p| {
            attention_naive(
                rows(&qt, sp, true),
                rows(&kt, sp, false),
                rows(&vt, sp, false),
                p,
            )
        },
    )
    .map_err(err)?;
    let what = |e: String| format!("{case:?}: {e}");
    check_accuracy(
        (o_gpu.view(), lse_gpu.view()),
        (naive.0.view(), naive.1.view()),
        (reference.0.view(), reference.1.view()),
    )
    .map_err(|e| what(format!("forward: {e}")))?;

    let dims = (shape.q_dims(), shape.kv_dims());
    let ref_grads = backward_spans(dims, &spans, &params, 0.0, |sp, p| {
        let (q, k, v) = sliced(sp);
        attention_backward_reference(q, k, v, rows(&dov, sp, true), p)
    })
    .map_err(err)?;
    let (o64, lse64) = (f64s(&o_gpu), lse_gpu.mapv(f64::from));
    let (o64v, lse64v) = (o64.view(), lse64.view());
    let given = backward_spans(dims, &spans, &params, 0.0, |sp, p| {
        let (q, k, v) = sliced(sp);
        let (o, d_o) = (rows(&o64v, sp, true), rows(&dov, sp, true));
        attention_backward_reference_given(q, k, v, o, d_o, stat_rows(&lse64v, sp), p)
    })
    .map_err(err)?;
    let naive_grads = backward_spans(dims, &spans, &params, T::default(), |sp, p| {
        let (q, k, v) = (
            rows(&qt, sp, true),
            rows(&kt, sp, false),
            rows(&vt, sp, false),
        );
        attention_backward_naive(q, k, v, rows(&dot, sp, true), p)
    })
    .map_err(err)?;
    check_gradient_accuracy(
        GPU_GRADIENT_FACTOR,
        [grads[0].view(), grads[1].view(), grads[2].view()],
        [
            naive_grads.0.view(),
            naive_grads.1.view(),
            naive_grads.2.view(),
        ],
        [given.0.view(), given.1.view(), given.2.view()],
        [ref_grads.0.view(), ref_grads.1.view(), ref_grads.2.view()],
    )
    .map_err(|e| what(format!("backward ({mode:?}): {e}")))
}

/// A downloaded `[B, N, H, d]` tensor, or a packed `[total, H, d]` one as `[1, total, H, d]`.
fn batched4<T: Clone>(a: ArrayD<T>) -> Array4<T> {
    let a = if a.ndim() == 3 {
        a.insert_axis(Axis(0))
    } else {
        a
    };
    a.into_dimensionality::<Ix4>().expect("rank 4")
}

/// A downloaded LSE `[B, Hq, N]`, or a packed `[Hq, total]` one as `[1, Hq, total]`.
fn batched3(a: ArrayD<f32>) -> Array3<f32> {
    let a = if a.ndim() == 2 {
        a.insert_axis(Axis(0))
    } else {
        a
    };
    a.into_dimensionality::<Ix3>().expect("rank 3")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpu_cases(), ..ProptestConfig::default() })]

    #[test]
    fn sequences_f16_match_reference(case in case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(run_case::<f16>(dev, &case), Ok(()));
        }
    }

    #[test]
    fn sequences_bf16_match_reference(case in case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(run_case::<bf16>(dev, &case), Ok(()));
        }
    }
}

/// A varlen batch of equal lengths runs as one launch and equals the padded batch's results
/// bit for bit (the same kernel over the same rows).
#[test]
fn equal_lengths_match_the_padded_batch() {
    let Some(dev) = device() else { return };
    let shape = AttnShape {
        batch: 3,
        seqlen_q: 100,
        seqlen_k: 150,
        heads_q: 4,
        heads_kv: 2,
        head_dim: 64,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let q = random_array::<bf16>(&mut rng, shape.q_dims(), 1.0);
    let k = random_array::<bf16>(&mut rng, shape.kv_dims(), 1.0);
    let v = random_array::<bf16>(&mut rng, shape.kv_dims(), 1.0);
    let params = AttnParams {
        causal: true,
        ..AttnParams::default()
    };
    let up = |a: &Array4<bf16>| upload(dev, a.view(), Layout::Contiguous);
    let (o, lse) = flash_attn::flash_attn(dev, &up(&q), &up(&k), &up(&v), &params).unwrap();
    let flat = |a: &Array4<bf16>| {
        let (b, n, h, d) = a.dim();
        let a = a.as_standard_layout().into_owned();
        DeviceTensor::from_host(dev, &[b * n, h, d], a.as_slice().unwrap()).unwrap()
    };
    let cu = |n: i32| vec![0, n, 2 * n, 3 * n];
    let (cu_q, cu_k) = (cu(100), cu(150));
    let cu_qd = DeviceTensor::from_host(dev, &[4], &cu_q).unwrap();
    let cu_kd = DeviceTensor::from_host(dev, &[4], &cu_k).unwrap();
    let varlen = Varlen {
        cu_seqlens_q: &cu_qd,
        cu_seqlens_k: &cu_kd,
        host: None,
    };
    let (o2, lse2) =
        flash_attn::flash_attn_varlen(dev, &flat(&q), &flat(&k), &flat(&v), &varlen, &params)
            .unwrap();
    let o = o.to_host(dev).unwrap();
    assert_eq!(o, o2.to_host(dev).unwrap());
    // LSE: [B, H, N] against [H, B·N].
    let lse = lse.to_ndarray(dev).unwrap();
    let lse2 = lse2.to_ndarray(dev).unwrap();
    for b in 0..3 {
        for h in 0..4 {
            for i in 0..100 {
                assert_eq!(lse[[b, h, i]].to_bits(), lse2[[h, b * 100 + i]].to_bits());
            }
        }
    }
}

/// Invalid prefix sums and lengths are typed errors before any launch.
#[test]
fn invalid_lengths_are_typed_errors() {
    let Some(dev) = device() else { return };
    let q = DeviceTensor::<f16>::zeros(dev, &[10, 2, 64]).unwrap();
    let k = DeviceTensor::<f16>::zeros(dev, &[12, 1, 64]).unwrap();
    let params = AttnParams::default();
    for (cu_q, cu_k) in [
        (vec![0, 4, 9], vec![0, 5, 12]),        // does not end at total_q
        (vec![1, 4, 10], vec![0, 5, 12]),       // does not start at 0
        (vec![0, 6, 4, 10], vec![0, 5, 6, 12]), // decreases
        (vec![0, 10], vec![0, 5, 12]),          // lengths differ
    ] {
        let cq = DeviceTensor::from_host(dev, &[cu_q.len()], &cu_q).unwrap();
        let ck = DeviceTensor::from_host(dev, &[cu_k.len()], &cu_k).unwrap();
        let varlen = Varlen {
            cu_seqlens_q: &cq,
            cu_seqlens_k: &ck,
            host: None,
        };
        let r = flash_attn::flash_attn_varlen(dev, &q, &k, &k, &varlen, &params);
        assert!(matches!(r, Err(FlashError::Shape(_))), "{cu_q:?} {cu_k:?}");
    }
    let lens = [13];
    let params = AttnParams {
        seqlens_k: Some(&lens),
        ..AttnParams::default()
    };
    let q4 = DeviceTensor::<f16>::zeros(dev, &[1, 10, 2, 64]).unwrap();
    let k4 = DeviceTensor::<f16>::zeros(dev, &[1, 12, 1, 64]).unwrap();
    let r = flash_attn::flash_attn(dev, &q4, &k4, &k4, &params);
    assert!(matches!(r, Err(FlashError::Shape(_))));
}
