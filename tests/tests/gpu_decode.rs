//! The decode path on the GPU (`attn_with_kvcache`, split-KV, paged caches, appends, GQA
//! packing, `merge_attention_states`, and `flash_attn`'s own use of it) against the float64
//! reference, with the accuracy rule of `flash_attn_tests::check_accuracy`. Outputs are
//! poisoned with NaN before every launch, and so is every cache row no sequence owns: a read
//! outside a sequence's keys shows up as NaN.
//!
//! Without a CUDA device every test prints a loud SKIPPED line and passes, unless
//! `FLASH_ATTN_REQUIRE_GPU=1`.

use flash_attn::cpu::{attention_naive, attention_reference, gather_sequence};
use flash_attn::{
    attn_with_kvcache, attn_with_kvcache_into, flash_attn, merge_attention_states, AttnParams,
    DecodeOptions, Device, DeviceTensor, Element, FlashError, HostBlockTable, HostCacheMeta,
    KvCache, NewKv,
};
use flash_attn_tests::gpu::{device as gpu_device, download3, download4, gpu_cases};
use flash_attn_tests::{
    check_accuracy, mask_recipes, random_array, standard_normal, to_f64, MaskRecipe,
};
use half::{bf16, f16};
use ndarray::{s, Array2, Array3, Array4, ArrayView4, Axis};
use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

fn device() -> Option<&'static Device> {
    gpu_device("gpu_decode")
}

/// One random decode problem.
#[derive(Clone, Debug)]
struct Case {
    seed: u64,
    batch: usize,
    seqlen_q: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    /// Keys cached per sequence before the call.
    lens: Vec<usize>,
    /// New keys appended by the call (0: none).
    appended: usize,
    /// Keys per page, or `None` for a contiguous cache.
    page_size: Option<usize>,
    causal: bool,
    scale: Option<f32>,
    splits: Option<usize>,
    /// Validate from a host copy of the lengths and block table (else read back).
    host_meta: bool,
    /// Window, softcap, ALiBi.
    masks: MaskRecipe,
}

/// A cache in host memory: the tensors as uploaded, the block table, and where each
/// sequence's key `j` lives (`(entry, row)`).
struct HostCache<T> {
    k: Array4<T>,
    v: Array4<T>,
    table: Option<Array2<i32>>,
    page_size: usize,
}

impl<T: Element> HostCache<T> {
    /// A cache holding `keys[b]` (`[len_b + room, Hkv, d]`-sized capacity), every other row
    /// NaN. Paged: pages shuffled, plus two spare pages.
    fn build(rng: &mut impl Rng, c: &Case, capacity: usize) -> Self {
        let (hkv, d) = (c.heads_kv, c.head_dim);
        match c.page_size {
            None => Self {
                k: Array4::from_elem((c.batch, capacity, hkv, d), T::nan()),
                v: Array4::from_elem((c.batch, capacity, hkv, d), T::nan()),
                table: None,
                page_size: 0,
            },
            Some(ps) => {
                let max_pages = capacity.div_ceil(ps).max(1);
                let pages = c.batch * max_pages + 2;
                let mut ids: Vec<i32> = (0..pages as i32).collect();
                ids.shuffle(rng);
                let table =
                    Array2::from_shape_fn((c.batch, max_pages), |(b, p)| ids[b * max_pages + p]);
                Self {
                    k: Array4::from_elem((pages, ps, hkv, d), T::nan()),
                    v: Array4::from_elem((pages, ps, hkv, d), T::nan()),
                    table: Some(table),
                    page_size: ps,
                }
            }
        }
    }

    /// `(entry, row)` of key `j` of sequence `b`.
    fn slot(&self, b: usize, j: usize) -> (usize, usize) {
        match &self.table {
            None => (b, j),
            Some(t) => (t[[b, j / self.page_size]] as usize, j % self.page_size),
        }
    }

    /// Writes `k`, `v` (`[n, Hkv, d]`) as keys `from ..` of sequence `b`.
    fn put(&mut self, b: usize, from: usize, k: ArrayView4<T>, v: ArrayView4<T>) {
        for j in 0..k.dim().1 {
            let (e, r) = self.slot(b, from + j);
            self.k
                .slice_mut(s![e, r, .., ..])
                .assign(&k.slice(s![0, j, .., ..]));
            self.v
                .slice_mut(s![e, r, .., ..])
                .assign(&v.slice(s![0, j, .., ..]));
        }
    }
}

/// The host copy of a block table: checked once against the pool (`HostBlockTable::checked`,
/// the per-call check skipped) for even seeds, else checked by the call.
fn host_table(entries: &[i32], pool_pages: usize, seed: u64) -> HostBlockTable<'_> {
    if seed.is_multiple_of(2) {
        HostBlockTable::checked(entries, pool_pages).expect("the test's table is valid")
    } else {
        entries.into()
    }
}

/// Runs one case and checks O, LSE and the updated cache.
fn run_case<T: Element>(dev: &Device, c: &Case) -> Result<(), String> {
    let err = |e: FlashError| format!("{c:?}: {e}");
    let params = c.masks.params(c.causal, c.scale, c.batch, c.heads_q);
    let mut rng = rand::rngs::StdRng::seed_from_u64(c.seed);
    let (b, nq, hq, hkv, d) = (c.batch, c.seqlen_q, c.heads_q, c.heads_kv, c.head_dim);
    let room = rng.gen_range(0..40usize);
    let capacity = c.lens.iter().max().copied().unwrap_or(0) + c.appended + room;
    let capacity = capacity.max(1);
    let mut host = HostCache::<T>::build(&mut rng, c, capacity);
    let mut seqs = Vec::new();
    for (bi, &len) in c.lens.iter().enumerate() {
        let k = random_array::<T>(&mut rng, [1, len, hkv, d], 1.0);
        let v = random_array::<T>(&mut rng, [1, len, hkv, d], 1.0);
        host.put(bi, 0, k.view(), v.view());
        seqs.push((k, v));
    }
    let q = random_array::<T>(&mut rng, [b, nq, hq, d], 1.0);
    let new = (c.appended > 0).then(|| {
        (
            random_array::<T>(&mut rng, [b, c.appended, hkv, d], 1.0),
            random_array::<T>(&mut rng, [b, c.appended, hkv, d], 1.0),
        )
    });

    let up4 = |a: &Array4<T>| DeviceTensor::from_ndarray(dev, a.view()).map_err(err);
    let qd = up4(&q)?;
    let mut kc = up4(&host.k)?;
    let mut vc = up4(&host.v)?;
    let lens: Vec<i32> = c.lens.iter().map(|&l| l as i32).collect();
    let table_host: Option<Vec<i32>> = host.table.as_ref().map(|t| t.iter().copied().collect());
    let pool_pages = host.k.dim().0;
    let lens_d = DeviceTensor::from_host(dev, &[b], &lens).map_err(err)?;
    let table_d = match &host.table {
        Some(t) => Some(DeviceTensor::from_ndarray(dev, t.view()).map_err(err)?),
        None => None,
    };
    let new_d = match &new {
        Some((k, v)) => Some((up4(k)?, up4(v)?)),
        None => None,
    };
    let mut o = DeviceTensor::<T>::zeros(dev, &[b, nq, hq, d]).map_err(err)?;
    let mut lse = DeviceTensor::<f32>::zeros(dev, &[b, hq, nq]).map_err(err)?;
    o.fill_nan(dev).map_err(err)?;
    lse.fill_nan(dev).map_err(err)?;
    attn_with_kvcache_into(
        dev,
        &qd,
        KvCache {
            k: &mut kc,
            v: &mut vc,
            seqlens: &lens_d,
            block_table: table_d.as_ref(),
            host: c.host_meta.then_some(HostCacheMeta {
                seqlens: &lens,
                block_table: table_host
                    .as_deref()
                    .map(|t| host_table(t, pool_pages, c.seed)),
            }),
        },
        new_d.as_ref().map(|(k, v)| NewKv { k, v }),
        &params,
        &DecodeOptions {
            num_splits: c.splits,
        },
        &mut o,
        &mut lse,
    )
    .map_err(err)?;
    let (o, lse) = (download4(dev, &o), download3(dev, &lse));

    // The expected cache: the new keys after each sequence's cached ones.
    if let Some((kn, vn)) = &new {
        for bi in 0..b {
            host.put(
                bi,
                c.lens[bi],
                kn.slice(s![bi..bi + 1, .., .., ..]),
                vn.slice(s![bi..bi + 1, .., .., ..]),
            );
        }
    }
    let (kc, vc) = (download4(dev, &kc), download4(dev, &vc));
    let same = |a: &Array4<T>, e: &Array4<T>| {
        a.iter().zip(e.iter()).all(|(x, y)| {
            x.to_f32().to_bits() == y.to_f32().to_bits()
                || (x.to_f32().is_nan() && y.to_f32().is_nan())
        })
    };
    if !same(&kc, &host.k) || !same(&vc, &host.v) {
        return Err(format!(
            "{c:?}: the cache after the call is not the expected one"
        ));
    }

    // The references, sequence by sequence.
    let mut ref_o = Array4::<f64>::zeros((b, nq, hq, d));
    let mut ref_lse = Array3::<f64>::from_elem((b, hq, nq), f64::NEG_INFINITY);
    let mut naive_o = Array4::<T>::from_elem((b, nq, hq, d), T::from_f32(0.0));
    let mut naive_lse = Array3::<f32>::from_elem((b, hq, nq), f32::NEG_INFINITY);
    for bi in 0..b {
        let len = c.lens[bi] + c.appended;
        if len == 0 {
            continue;
        }
        let table = host.table.as_ref().map(|t| t.view());
        let (gk, gv) = gather_sequence(host.k.view(), host.v.view(), table, bi, len);
        let qb = q.slice(s![bi..bi + 1, .., .., ..]).to_owned();
        let entry = params.for_entry(bi, hq);
        let r = attention_reference(
            to_f64(qb.view()).view(),
            to_f64(gk.view()).view(),
            to_f64(gv.view()).view(),
            &entry,
        )
        .map_err(err)?;
        let n = attention_naive(qb.view(), gk.view(), gv.view(), &entry).map_err(err)?;
        ref_o
            .index_axis_mut(Axis(0), bi)
            .assign(&r.0.index_axis(Axis(0), 0));
        ref_lse
            .index_axis_mut(Axis(0), bi)
            .assign(&r.1.index_axis(Axis(0), 0));
        naive_o
            .index_axis_mut(Axis(0), bi)
            .assign(&n.0.index_axis(Axis(0), 0));
        naive_lse
            .index_axis_mut(Axis(0), bi)
            .assign(&n.1.index_axis(Axis(0), 0));
    }
    check_accuracy(
        (o.view(), lse.view()),
        (naive_o.view(), naive_lse.view()),
        (ref_o.view(), ref_lse.view()),
    )
    .map_err(|e| format!("{c:?}: {e}"))
}

/// Cache lengths: mostly short, some long, rarely up to 128K keys (with few heads, so the
/// float64 reference stays affordable).
fn case_strategy() -> impl Strategy<Value = Case> {
    let heads = prop::sample::select(vec![
        (1usize, 1usize),
        (4, 4),
        (8, 1),
        (8, 2),
        (12, 4),
        (32, 1),
        (32, 8),
        (16, 16),
    ]);
    let dims = prop::sample::select(vec![8usize, 32, 64, 72, 96, 128, 160, 256]);
    let pages = prop::sample::select(vec![
        None,
        Some(16usize),
        Some(32),
        Some(48),
        Some(64),
        Some(256),
    ]);
    let splits = prop::sample::select(vec![
        None,
        None,
        Some(1usize),
        Some(2),
        Some(3),
        Some(7),
        Some(16),
        Some(64),
    ]);
    let scales = prop::sample::select(vec![None, Some(0.3f32), Some(-0.25), Some(0.0)]);
    (
        any::<u64>(),
        1usize..=3,
        1usize..=16,
        heads,
        dims,
        pages,
        any::<bool>(),
        scales,
        splits,
        0u32..100,
        0usize..=3,
        (any::<bool>(), mask_recipes()),
    )
        .prop_map(
            |(
                seed,
                batch,
                nq,
                (hq, hkv),
                d,
                page_size,
                causal,
                scale,
                splits,
                size_class,
                append,
                (host_meta, masks),
            )| {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
                let (max_len, hq, hkv) = match size_class {
                    0..=79 => (2048usize, hq, hkv),
                    80..=96 => (16 * 1024, hq.min(8), hkv.min(2)),
                    _ => (128 * 1024, hq.min(4).max(hkv.min(1)), hkv.min(1)),
                };
                let (hq, hkv) = if hq % hkv == 0 { (hq, hkv) } else { (hkv, hkv) };
                let (batch, nq) = if max_len > 2048 {
                    (1, nq.min(4))
                } else {
                    (batch, nq)
                };
                let lens = (0..batch)
                    .map(|_| match rng.gen_range(0..10) {
                        0 => 0,
                        1 => rng.gen_range(1..=16),
                        _ => rng.gen_range(1..=max_len),
                    })
                    .collect();
                let appended = if append == 0 {
                    0
                } else {
                    rng.gen_range(1..=nq)
                };
                Case {
                    seed,
                    batch,
                    seqlen_q: nq,
                    heads_q: hq,
                    heads_kv: hkv,
                    head_dim: d,
                    lens,
                    appended,
                    page_size,
                    causal,
                    scale,
                    splits,
                    host_meta,
                    masks,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpu_cases(), ..ProptestConfig::default() })]

    #[test]
    fn decode_f16_matches_reference(c in case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(run_case::<f16>(dev, &c), Ok(()));
        }
    }

    #[test]
    fn decode_bf16_matches_reference(c in case_strategy()) {
        if let Some(dev) = device() {
            prop_assert_eq!(run_case::<bf16>(dev, &c), Ok(()));
        }
    }
}

/// Every head dim, both dtypes, splits 1..=64, paged and not: one fixed case each.
#[test]
fn every_decode_kernel_and_split_count() {
    let Some(dev) = device() else { return };
    for d in [32, 64, 96, 128, 256] {
        for splits in [1, 2, 5, 64] {
            for page_size in [None, Some(16)] {
                let c = Case {
                    seed: (d * 131 + splits) as u64,
                    batch: 2,
                    seqlen_q: 3,
                    heads_q: 8,
                    heads_kv: 2,
                    head_dim: d,
                    lens: vec![1500, 77],
                    appended: 2,
                    page_size,
                    causal: true,
                    scale: None,
                    splits: Some(splits),
                    host_meta: page_size.is_some(),
                    masks: if page_size.is_some() {
                        MaskRecipe {
                            window: Some((300, 0)),
                            softcap: Some(20.0),
                            alibi: flash_attn_tests::Alibi::PerBatchHead,
                            seed: splits as u64,
                            sparse: None,
                        }
                    } else {
                        MaskRecipe::NONE
                    },
                };
                run_case::<f16>(dev, &c).unwrap();
                run_case::<bf16>(dev, &c).unwrap();
            }
        }
    }
}

/// `flash_attn` with few queries over many keys takes the split-KV path; it must agree with
/// the reference like any forward call (GQA, causal, odd head dim).
#[test]
fn forward_with_few_queries_uses_split_kv_correctly() {
    let Some(dev) = device() else { return };
    for (nq, nk, hq, hkv, d, causal) in [
        (1usize, 8192usize, 8usize, 1usize, 128usize, false),
        (4, 5000, 4, 2, 100, true),
        (16, 3000, 2, 2, 64, true),
        (40, 6000, 8, 2, 128, true),
        (64, 4000, 4, 4, 256, false),
        (33, 2500, 6, 3, 80, true),
    ] {
        let params = AttnParams {
            causal,
            softmax_scale: None,
            ..AttnParams::default()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(nk as u64);
        let q = random_array::<bf16>(&mut rng, [1, nq, hq, d], 1.0);
        let k = random_array::<bf16>(&mut rng, [1, nk, hkv, d], 1.0);
        let v = random_array::<bf16>(&mut rng, [1, nk, hkv, d], 1.0);
        let up = |a: &Array4<bf16>| DeviceTensor::from_ndarray(dev, a.view()).unwrap();
        let (o, lse) = flash_attn(dev, &up(&q), &up(&k), &up(&v), &params).unwrap();
        let r = attention_reference(
            to_f64(q.view()).view(),
            to_f64(k.view()).view(),
            to_f64(v.view()).view(),
            &params,
        )
        .unwrap();
        let n = attention_naive(q.view(), k.view(), v.view(), &params).unwrap();
        check_accuracy(
            (download4(dev, &o).view(), download3(dev, &lse).view()),
            (n.0.view(), n.1.view()),
            (r.0.view(), r.1.view()),
        )
        .unwrap();
    }
}

/// Merging the states of two key halves gives the state of all keys (within the rule), a
/// state with LSE = −∞ contributes nothing (even with a NaN O), and merging is associative
/// within rounding.
#[test]
fn merge_attention_states_is_exact_and_associative() {
    let Some(dev) = device() else { return };
    let params = AttnParams::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (b, nq, h, d) = (2, 5, 4, 72);
    let q = random_array::<f16>(&mut rng, [b, nq, h, d], 1.0);
    let parts: Vec<(Array4<f16>, Array4<f16>)> = [300usize, 200, 500]
        .iter()
        .map(|&n| {
            (
                random_array::<f16>(&mut rng, [b, n, h, d], 1.0),
                random_array::<f16>(&mut rng, [b, n, h, d], 1.0),
            )
        })
        .collect();
    let up = |a: &Array4<f16>| DeviceTensor::from_ndarray(dev, a.view()).unwrap();
    let qd = up(&q);
    let states: Vec<_> = parts
        .iter()
        .map(|(k, v)| flash_attn(dev, &qd, &up(k), &up(v), &params).unwrap())
        .collect();
    fn pair(
        s: &(DeviceTensor<f16>, DeviceTensor<f32>),
    ) -> (&DeviceTensor<f16>, &DeviceTensor<f32>) {
        (&s.0, &s.1)
    }
    let ab = merge_attention_states(dev, pair(&states[0]), pair(&states[1])).unwrap();
    let left = merge_attention_states(dev, pair(&ab), pair(&states[2])).unwrap();
    let bc = merge_attention_states(dev, pair(&states[1]), pair(&states[2])).unwrap();
    let right = merge_attention_states(dev, pair(&states[0]), pair(&bc)).unwrap();

    let cat = |i: usize| {
        ndarray::concatenate(
            Axis(1),
            &parts
                .iter()
                .map(|p| if i == 0 { p.0.view() } else { p.1.view() })
                .collect::<Vec<_>>(),
        )
        .unwrap()
    };
    let (k, v) = (cat(0), cat(1));
    let r = attention_reference(
        to_f64(q.view()).view(),
        to_f64(k.view()).view(),
        to_f64(v.view()).view(),
        &params,
    )
    .unwrap();
    let n = attention_naive(q.view(), k.view(), v.view(), &params).unwrap();
    for merged in [&left, &right] {
        check_accuracy(
            (
                download4(dev, &merged.0).view(),
                download3(dev, &merged.1).view(),
            ),
            (n.0.view(), n.1.view()),
            (r.0.view(), r.1.view()),
        )
        .unwrap();
    }
    let (lo, ro) = (download4(dev, &left.0), download4(dev, &right.0));
    let worst = lo
        .iter()
        .zip(ro.iter())
        .map(|(a, b)| (a.to_f32() - b.to_f32()).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 2e-3,
        "merge is not associative within rounding: {worst}"
    );

    // A state without keys (LSE = −∞, O = NaN) leaves the other unchanged.
    let mut empty_o = DeviceTensor::<f16>::zeros(dev, &[b, nq, h, d]).unwrap();
    empty_o.fill_nan(dev).unwrap();
    let neg_inf = vec![f32::NEG_INFINITY; b * h * nq];
    let empty_lse = DeviceTensor::from_host(dev, &[b, h, nq], &neg_inf).unwrap();
    let m = merge_attention_states(dev, pair(&states[0]), (&empty_o, &empty_lse)).unwrap();
    assert_eq!(download4(dev, &m.0), download4(dev, &states[0].0));
    assert_eq!(download3(dev, &m.1), download3(dev, &states[0].1));
    let both = merge_attention_states(dev, (&empty_o, &empty_lse), (&empty_o, &empty_lse)).unwrap();
    assert!(download4(dev, &both.0).iter().all(|x| x.to_f32() == 0.0));
    assert!(download3(dev, &both.1)
        .iter()
        .all(|x| *x == f32::NEG_INFINITY));
}

/// Invalid calls are typed errors, before any launch (the cache is left as it was).
#[test]
fn invalid_decode_calls_are_typed_errors() {
    let Some(dev) = device() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let d = 64;
    let mut data = |n: usize| -> Vec<f16> {
        (0..n)
            .map(|_| f16::from_f32(standard_normal(&mut rng)))
            .collect()
    };
    let q = DeviceTensor::from_host(dev, &[2, 1, 4, d], &data(2 * 4 * d)).unwrap();
    let mut kc = DeviceTensor::from_host(dev, &[2, 64, 2, d], &data(2 * 64 * 2 * d)).unwrap();
    let mut vc = DeviceTensor::from_host(dev, &[2, 64, 2, d], &data(2 * 64 * 2 * d)).unwrap();
    let before = kc.to_host(dev).unwrap();
    let kn = DeviceTensor::from_host(dev, &[2, 4, 2, d], &data(2 * 4 * 2 * d)).unwrap();
    let vn = DeviceTensor::from_host(dev, &[2, 4, 2, d], &data(2 * 4 * 2 * d)).unwrap();
    let p = AttnParams::default();
    let opts = DecodeOptions::default();
    let lens = |l: &[i32]| DeviceTensor::from_host(dev, &[l.len()], l).unwrap();
    let mut call = |seqlens: &DeviceTensor<i32>,
                    table: Option<&DeviceTensor<i32>>,
                    new: bool,
                    o: &DecodeOptions| {
        attn_with_kvcache(
            dev,
            &q,
            KvCache {
                k: &mut kc,
                v: &mut vc,
                seqlens,
                block_table: table,
                host: None,
            },
            new.then_some(NewKv { k: &kn, v: &vn }),
            &p,
            o,
        )
        .map(|_| ())
    };
    // Lengths beyond the cache, negative, or with the appended keys past it.
    assert!(matches!(
        call(&lens(&[65, 1]), None, false, &opts),
        Err(FlashError::Shape(_))
    ));
    assert!(matches!(
        call(&lens(&[-1, 1]), None, false, &opts),
        Err(FlashError::Shape(_))
    ));
    assert!(matches!(
        call(&lens(&[61, 1]), None, true, &opts),
        Err(FlashError::Shape(_))
    ));
    assert!(matches!(
        call(&lens(&[1, 1, 1]), None, false, &opts),
        Err(FlashError::Shape(_))
    ));
    // Splits out of range.
    for n in [0, 129] {
        let o = DecodeOptions {
            num_splits: Some(n),
        };
        assert!(matches!(
            call(&lens(&[3, 3]), None, false, &o),
            Err(FlashError::Param(_))
        ));
    }
    // Paged: the cache viewed as 8 pages of 16 keys; a page index out of range, or a
    // table that does not cover the length.
    let mut kp = DeviceTensor::from_host(dev, &[8, 16, 2, d], &data(8 * 16 * 2 * d)).unwrap();
    let mut vp = DeviceTensor::from_host(dev, &[8, 16, 2, d], &data(8 * 16 * 2 * d)).unwrap();
    let mut paged = |seqlens: &DeviceTensor<i32>, table: &[i32]| {
        let t = DeviceTensor::from_host(dev, &[2, table.len() / 2], table).unwrap();
        attn_with_kvcache(
            dev,
            &q,
            KvCache {
                k: &mut kp,
                v: &mut vp,
                seqlens,
                block_table: Some(&t),
                host: None,
            },
            None,
            &p,
            &opts,
        )
        .map(|_| ())
    };
    assert!(paged(&lens(&[20, 5]), &[0, 1, 2, 3]).is_ok());
    assert!(matches!(
        paged(&lens(&[20, 5]), &[0, 8, 2, 3]),
        Err(FlashError::Shape(_))
    ));
    assert!(matches!(
        paged(&lens(&[20, 5]), &[0, -1, 2, 3]),
        Err(FlashError::Shape(_))
    ));
    assert!(matches!(
        paged(&lens(&[33, 5]), &[0, 1, 2, 3]),
        Err(FlashError::Shape(_))
    ));
    // An unused slot may hold anything.
    assert!(paged(&lens(&[5, 5]), &[0, 99, 2, -7]).is_ok());
    // Page sizes that are not multiples of 16.
    let mut k12 = DeviceTensor::from_host(dev, &[8, 12, 2, d], &data(8 * 12 * 2 * d)).unwrap();
    let mut v12 = DeviceTensor::from_host(dev, &[8, 12, 2, d], &data(8 * 12 * 2 * d)).unwrap();
    let t = DeviceTensor::from_host(dev, &[2, 2], &[0, 1, 2, 3]).unwrap();
    let r = attn_with_kvcache(
        dev,
        &q,
        KvCache {
            k: &mut k12,
            v: &mut v12,
            seqlens: &lens(&[5, 5]),
            block_table: Some(&t),
            host: None,
        },
        None,
        &p,
        &opts,
    );
    assert!(matches!(r, Err(FlashError::Shape(_))));
    assert_eq!(
        kc.to_host(dev).unwrap(),
        before,
        "a failed call changed the cache"
    );
}

/// A host copy of the lengths and block table that differs from the device tensors gives
/// wrong results but never a read or write outside the cache (the kernels clamp lengths to
/// the capacity and page indices into the pool; run under compute-sanitizer memcheck), and
/// the host copy's own values are validated like the device's.
#[test]
fn host_cache_meta_that_lies_stays_inside_the_cache() {
    let Some(dev) = device() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (b, hkv, d, page, pages) = (2usize, 2usize, 64usize, 16usize, 6usize);
    let q = random_array::<f16>(&mut rng, [b, 2, 4, d], 1.0);
    let pool = random_array::<f16>(&mut rng, [pages, page, hkv, d], 1.0);
    let new = random_array::<f16>(&mut rng, [b, 2, hkv, d], 1.0);
    let up = |a: &Array4<f16>| DeviceTensor::from_ndarray(dev, a.view()).unwrap();
    let (qd, newd) = (up(&q), up(&new));
    let (mut k, mut v) = (up(&pool), up(&pool));
    // The device says: lengths far past the cache and negative; pages out of the pool.
    let lens_d = DeviceTensor::from_host(dev, &[b], &[1 << 30, -5]).unwrap();
    let table_d = DeviceTensor::from_host(dev, &[b, 3], &[99, -1, 7, 2, 1_000_000, -9]).unwrap();
    // The host copy says something valid.
    let host = HostCacheMeta {
        seqlens: &[20, 3],
        block_table: Some((&[0, 1, 2, 3, 4, 5][..]).into()),
    };
    for splits in [1, 4] {
        let (o, lse) = attn_with_kvcache(
            dev,
            &qd,
            KvCache {
                k: &mut k,
                v: &mut v,
                seqlens: &lens_d,
                block_table: Some(&table_d),
                host: Some(host),
            },
            Some(NewKv { k: &newd, v: &newd }),
            &AttnParams::default(),
            &DecodeOptions {
                num_splits: Some(splits),
            },
        )
        .unwrap();
        dev.synchronize().unwrap();
        assert_eq!(download4(dev, &o).dim(), (b, 2, 4, d));
        assert_eq!(download3(dev, &lse).dim(), (b, 4, 2));
    }
    // An invalid host copy is a typed error like an invalid device tensor.
    let bad_entries = [0, 6, 2, 3, 4, 5];
    let bad = HostCacheMeta {
        seqlens: &[20, 3],
        block_table: Some((&bad_entries[..]).into()),
    };
    let mut call = |host: HostCacheMeta| {
        attn_with_kvcache(
            dev,
            &qd,
            KvCache {
                k: &mut k,
                v: &mut v,
                seqlens: &lens_d,
                block_table: Some(&table_d),
                host: Some(host),
            },
            None,
            &AttnParams::default(),
            &DecodeOptions::default(),
        )
        .map(|_| ())
    };
    let r = call(bad);
    assert!(matches!(r, Err(FlashError::Shape(_))), "{:?}", r.err());
    // A table checked against a larger pool than the cache's is checked again by the call.
    let checked_larger = HostBlockTable::checked(&bad_entries, pages + 1).unwrap();
    let r = call(HostCacheMeta {
        seqlens: &[20, 3],
        block_table: Some(checked_larger),
    });
    assert!(matches!(r, Err(FlashError::Shape(_))), "{:?}", r.err());
    // One checked against this pool is trusted (no per-call check), and gives the results
    // of the same table checked by the call.
    let good = [5, 4, 3, 2, 1, 0];
    let checked = HostBlockTable::checked(&good, pages).unwrap();
    call(HostCacheMeta {
        seqlens: &[20, 3],
        block_table: Some(checked),
    })
    .unwrap();
    // Checking rejects an entry outside the pool, naming it.
    let e = HostBlockTable::checked(&bad_entries, pages).unwrap_err();
    assert!(e.to_string().contains("entry 1 = 6"), "{e}");
    assert!(HostBlockTable::checked(&[0, -1], pages).is_err());
}
