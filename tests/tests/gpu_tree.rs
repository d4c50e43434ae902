//! Tree masks (speculative decoding) on the GPU against the float64 reference, with the
//! accuracy rules: the forward (`flash_attn`, through the forward kernels or, for few drafts
//! over many keys, the decode kernels), the backward (dQ, dK, dV, both modes), and
//! `attn_with_kvcache` over contiguous and paged caches with the drafts appended in the same
//! call. Random trees from parent arrays, random cached
//! prefixes (0 included), shared or per-entry trees, causal or not, GQA; outputs poisoned.
//!
//! Without a CUDA device every test prints a loud SKIPPED line and passes, unless
//! `FLASH_ATTN_REQUIRE_GPU=1`.

use flash_attn::cpu::{attention_naive, attention_reference, gather_sequence};
use flash_attn::shape::AttnShape;
use flash_attn::{
    attn_with_kvcache_into, flash_attn_into, AttnParams, BwdMode, DecodeOptions, Device,
    DeviceTensor, Element, FlashError, KvCache, NewKv,
};
use flash_attn_tests::gpu::{
    backward_case, device as gpu_device, download3, download4, gpu_cases, upload, Layout,
};
use flash_attn_tests::{check_accuracy, random_array, random_tree, to_f64, Magnitude};
use half::{bf16, f16};
use ndarray::{s, Array2, Array3, Array4, Axis};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

fn device() -> Option<&'static Device> {
    gpu_device("gpu_tree")
}

/// One case: `batch` sequences of `prefix[b]` cached keys and `drafts` draft tokens.
#[derive(Clone, Debug)]
struct TreeCase {
    batch: usize,
    drafts: usize,
    prefix: Vec<usize>,
    heads: (usize, usize),
    head_dim: usize,
    causal: bool,
    shared_tree: bool,
    page_size: Option<usize>,
    seed: u64,
}

fn case_strategy() -> impl Strategy<Value = TreeCase> {
    let heads = prop::sample::select(&[(1usize, 1usize), (4, 1), (8, 2), (6, 3)][..]);
    let dims = prop::sample::select(&[32usize, 64, 80, 128, 256][..]);
    let drafts = prop::sample::select(&[1usize, 2, 5, 16, 17, 40, 64, 100][..]);
    let prefix = prop::sample::select(&[0usize, 1, 7, 64, 300, 1000, 5000][..]);
    let pages = prop::sample::select(&[None, Some(16usize), Some(64)][..]);
    (
        1usize..4,
        drafts,
        prop::collection::vec(prefix, 3),
        heads,
        dims,
        (any::<bool>(), any::<bool>(), pages, any::<u64>()),
    )
        .prop_map(
            |(batch, drafts, prefix, heads, head_dim, (causal, shared_tree, page_size, seed))| {
                TreeCase {
                    batch,
                    drafts,
                    prefix: prefix[..batch].to_vec(),
                    heads,
                    head_dim,
                    causal,
                    shared_tree,
                    page_size,
                    seed,
                }
            },
        )
}

/// O and LSE of a call: float64 (the reference) or the element type with f32 LSE (naive).
type Outputs<O, L> = (Array4<O>, Array3<L>);

/// The float64 reference's outputs and the naive ones in `T`.
type References<T> = (Outputs<f64, f64>, Outputs<T, f32>);

/// The references of every sequence: its prefix keys then its drafts, all visible to the
/// float64 and same-dtype references through `params` (the tree of entry `b`).
fn references<T: Element>(
    q: &Array4<T>,
    seqs: &[(Array4<T>, Array4<T>)],
    params: &AttnParams,
    heads_q: usize,
) -> Result<References<T>, FlashError> {
    let (b, nq, hq, d) = q.dim();
    let mut r = (
        Array4::<f64>::zeros((b, nq, hq, d)),
        Array3::<f64>::zeros((b, hq, nq)),
    );
    let mut n = (
        Array4::<T>::default((b, nq, hq, d)),
        Array3::<f32>::zeros((b, hq, nq)),
    );
    for (bi, (k, v)) in seqs.iter().enumerate() {
        let qb = q.slice(s![bi..bi + 1, .., .., ..]).to_owned();
        let entry = params.for_entry(bi, heads_q);
        let (ro, rl) = attention_reference(
            to_f64(qb.view()).view(),
            to_f64(k.view()).view(),
            to_f64(v.view()).view(),
            &entry,
        )?;
        let (no, nl) = attention_naive(qb.view(), k.view(), v.view(), &entry)?;
        r.0.index_axis_mut(Axis(0), bi)
            .assign(&ro.index_axis(Axis(0), 0));
        r.1.index_axis_mut(Axis(0), bi)
            .assign(&rl.index_axis(Axis(0), 0));
        n.0.index_axis_mut(Axis(0), bi)
            .assign(&no.index_axis(Axis(0), 0));
        n.1.index_axis_mut(Axis(0), bi)
            .assign(&nl.index_axis(Axis(0), 0));
    }
    Ok((r, n))
}

/// Our O and LSE (downloaded) under the accuracy rule against `references`.
fn check_outputs<T: Element>(
    dev: &Device,
    o: &DeviceTensor<T>,
    lse: &DeviceTensor<f32>,
    (r, n): References<T>,
) -> Result<(), String> {
    let (o, lse) = (download4(dev, o), download3(dev, lse));
    check_accuracy(
        (o.view(), lse.view()),
        (n.0.view(), n.1.view()),
        (r.0.view(), r.1.view()),
    )
}

impl TreeCase {
    /// The padded batch of the case (every entry with the longest prefix) and a random tree
    /// from `rng`, shared or per entry.
    fn padded(&self, rng: &mut impl Rng) -> (AttnShape, flash_attn::TreeMask) {
        let prefix = self.prefix.iter().copied().max().unwrap_or(0);
        let shape = AttnShape {
            batch: self.batch,
            seqlen_q: self.drafts,
            seqlen_k: prefix + self.drafts,
            heads_q: self.heads.0,
            heads_kv: self.heads.1,
            head_dim: self.head_dim,
        };
        let entries = if self.shared_tree { 1 } else { self.batch };
        (shape, random_tree(rng, entries, self.drafts))
    }
}

/// The forward over a padded batch whose entries all have the longest prefix.
fn run_forward<T: Element>(dev: &Device, c: &TreeCase) -> Result<(), String> {
    let err = |e: FlashError| format!("{c:?}: {e}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(c.seed);
    let (shape, tree) = c.padded(&mut rng);
    let params = AttnParams {
        causal: c.causal,
        tree_mask: Some(tree.as_ref()),
        ..AttnParams::default()
    };
    let q = random_array::<T>(&mut rng, shape.q_dims(), 1.0);
    let k = random_array::<T>(&mut rng, shape.kv_dims(), 1.0);
    let v = random_array::<T>(&mut rng, shape.kv_dims(), 1.0);
    let up = |a: &Array4<T>| upload(dev, a.view(), Layout::Contiguous);
    let mut o = DeviceTensor::<T>::zeros(dev, &shape.q_dims()).map_err(err)?;
    let mut lse = DeviceTensor::<f32>::zeros(dev, &shape.lse_dims()).map_err(err)?;
    o.fill_nan(dev).map_err(err)?;
    lse.fill_nan(dev).map_err(err)?;
    flash_attn_into(dev, &up(&q), &up(&k), &up(&v), &params, &mut o, &mut lse).map_err(err)?;
    let seqs: Vec<_> = (0..c.batch)
        .map(|b| {
            let cut = |a: &Array4<T>| a.slice(s![b..b + 1, .., .., ..]).to_owned();
            (cut(&k), cut(&v))
        })
        .collect();
    let refs = references(&q, &seqs, &params, shape.heads_q).map_err(err)?;
    check_outputs(dev, &o, &lse, refs).map_err(|e| format!("{c:?} forward: {e}"))
}

/// `attn_with_kvcache`: each sequence's prefix cached, the drafts appended by the call.
fn run_decode<T: Element>(dev: &Device, c: &TreeCase) -> Result<(), String> {
    let err = |e: FlashError| format!("{c:?}: {e}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(c.seed ^ 1);
    let (b, t, (hq, hkv), d) = (c.batch, c.drafts, c.heads, c.head_dim);
    let tree = random_tree(&mut rng, if c.shared_tree { 1 } else { b }, t);
    let params = AttnParams {
        causal: c.causal,
        tree_mask: Some(tree.as_ref()),
        ..AttnParams::default()
    };
    let capacity = c.prefix.iter().max().unwrap() + t + rng.gen_range(0..20usize);
    let (k_cache, v_cache, table) = match c.page_size {
        None => (
            random_array::<T>(&mut rng, [b, capacity, hkv, d], 1.0),
            random_array::<T>(&mut rng, [b, capacity, hkv, d], 1.0),
            None,
        ),
        Some(page) => {
            let max_pages = capacity.div_ceil(page);
            let pages = b * max_pages + 3;
            let mut order: Vec<i32> = (0..pages as i32).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.gen_range(0..=i));
            }
            let table = Array2::from_shape_fn((b, max_pages), |(bi, p)| order[bi * max_pages + p]);
            (
                random_array::<T>(&mut rng, [pages, page, hkv, d], 1.0),
                random_array::<T>(&mut rng, [pages, page, hkv, d], 1.0),
                Some(table),
            )
        }
    };
    let q = random_array::<T>(&mut rng, [b, t, hq, d], 1.0);
    let k_new = random_array::<T>(&mut rng, [b, t, hkv, d], 1.0);
    let v_new = random_array::<T>(&mut rng, [b, t, hkv, d], 1.0);
    let lens: Vec<i32> = c.prefix.iter().map(|&p| p as i32).collect();
    let up = |a: &Array4<T>| DeviceTensor::from_ndarray(dev, a.view()).expect("upload");
    let (mut kd, mut vd) = (up(&k_cache), up(&v_cache));
    let lens_d = DeviceTensor::from_host(dev, &[b], &lens).map_err(err)?;
    let table_d = table
        .as_ref()
        .map(|t| DeviceTensor::from_ndarray(dev, t.view()).expect("upload"));
    let mut o = DeviceTensor::<T>::zeros(dev, &[b, t, hq, d]).map_err(err)?;
    let mut lse = DeviceTensor::<f32>::zeros(dev, &[b, hq, t]).map_err(err)?;
    o.fill_nan(dev).map_err(err)?;
    lse.fill_nan(dev).map_err(err)?;
    let cache = KvCache {
        k: &mut kd,
        v: &mut vd,
        seqlens: &lens_d,
        block_table: table_d.as_ref(),
        host: None,
    };
    let (kn, vn) = (up(&k_new), up(&v_new));
    let new_kv = Some(NewKv { k: &kn, v: &vn });
    let opts = DecodeOptions::default();
    attn_with_kvcache_into(
        dev,
        &up(&q),
        cache,
        new_kv,
        &params,
        &opts,
        &mut o,
        &mut lse,
    )
    .map_err(err)?;
    // The caches after the call hold the drafts: gather each sequence from them.
    let k_after: Array4<T> = kd
        .to_ndarray(dev)
        .map_err(err)?
        .into_dimensionality()
        .unwrap();
    let v_after: Array4<T> = vd
        .to_ndarray(dev)
        .map_err(err)?
        .into_dimensionality()
        .unwrap();
    let seqs: Vec<_> = (0..b)
        .map(|bi| {
            let tv = table.as_ref().map(|t| t.view());
            gather_sequence(k_after.view(), v_after.view(), tv, bi, c.prefix[bi] + t)
        })
        .collect();
    let refs = references(&q, &seqs, &params, hq).map_err(err)?;
    check_outputs(dev, &o, &lse, refs).map_err(|e| format!("{c:?} decode: {e}"))
}

/// The backward over a padded batch whose entries all have the longest prefix: dQ, dK, dV
/// against the float64 reference gradients (see `backward_case`), either mode.
fn run_backward<T: Element>(dev: &Device, c: &TreeCase, mode: BwdMode) -> Result<(), String> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(c.seed ^ 2);
    let (shape, tree) = c.padded(&mut rng);
    let params = AttnParams {
        causal: c.causal,
        tree_mask: Some(tree.as_ref()),
        ..AttnParams::default()
    };
    let layout = if c.seed.is_multiple_of(2) {
        Layout::Contiguous
    } else {
        Layout::HeadMajor
    };
    backward_case::<T>(dev, c.seed, shape, &params, Magnitude::Normal, layout, mode)
        .map_err(|e| format!("{c:?} backward: {e}"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpu_cases(), ..ProptestConfig::default() })]

    #[test]
    fn tree_backward_matches_reference(c in case_strategy(), bf in any::<bool>(), det in any::<bool>()) {
        if let Some(dev) = device() {
            let mode = if det { BwdMode::Deterministic } else { BwdMode::Fast };
            let r = if bf { run_backward::<bf16>(dev, &c, mode) } else { run_backward::<f16>(dev, &c, mode) };
            prop_assert_eq!(r, Ok(()));
        }
    }

    #[test]
    fn tree_forward_matches_reference(c in case_strategy(), bf in any::<bool>()) {
        if let Some(dev) = device() {
            let r = if bf { run_forward::<bf16>(dev, &c) } else { run_forward::<f16>(dev, &c) };
            prop_assert_eq!(r, Ok(()));
        }
    }

    #[test]
    fn tree_decode_matches_reference(c in case_strategy(), bf in any::<bool>()) {
        if let Some(dev) = device() {
            let r = if bf { run_decode::<bf16>(dev, &c) } else { run_decode::<f16>(dev, &c) };
            prop_assert_eq!(r, Ok(()));
        }
    }
}

/// Invalid trees are typed errors before any launch.
#[test]
fn invalid_trees_are_typed_errors() {
    let Some(dev) = device() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let tree = random_tree(&mut rng, 1, 5);
    let q = DeviceTensor::<f16>::zeros(dev, &[1, 6, 1, 64]).unwrap();
    let k = DeviceTensor::<f16>::zeros(dev, &[1, 9, 1, 64]).unwrap();
    let p = AttnParams {
        tree_mask: Some(tree.as_ref()),
        ..AttnParams::default()
    };
    assert!(matches!(
        flash_attn::flash_attn(dev, &q, &k, &k, &p),
        Err(FlashError::Shape(_))
    ));
    let q = DeviceTensor::<f16>::zeros(dev, &[1, 5, 1, 64]).unwrap();
    let short = DeviceTensor::<f16>::zeros(dev, &[1, 4, 1, 64]).unwrap();
    assert!(matches!(
        flash_attn::flash_attn(dev, &q, &short, &short, &p),
        Err(FlashError::Shape(_))
    ));
    let with_window = AttnParams {
        window: Some((3, 0)),
        ..p
    };
    assert!(matches!(
        flash_attn::flash_attn(dev, &q, &k, &k, &with_window),
        Err(FlashError::Param(_))
    ));
}
