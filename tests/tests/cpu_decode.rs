//! The CPU decode path (`attn_with_kvcache_cpu`) against the float64 reference: random
//! batches of sequences of random lengths (0 included) in contiguous and paged caches, with
//! and without new keys appended, under the accuracy rule of `flash_attn_tests`.
//!
//! Every sequence's keys are drawn first as one logical array; the cache is built from its
//! first `seqlens[b]` keys (rows past them, unused table slots and unused pages hold NaN or
//! invalid page indices, which must never be read) and `k_new`/`v_new` from the rest. After the
//! call, the keys `gather_sequence` reads back from the cache must be the logical ones, and
//! each sequence's O and LSE must meet the accuracy rule against `attention_reference` on
//! them.

use flash_attn::cpu::{
    attention_naive, attention_reference, attn_with_kvcache_cpu, gather_sequence, CpuKvCache,
};
use flash_attn::{AttnParams, DType, Element};
use flash_attn_tests::{check_accuracy, mask_recipes, random_array, to_f64, Magnitude};
use half::{bf16, f16};
use ndarray::{s, Array2, Array4};
use proptest::prelude::*;
use proptest::sample::select;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// `(Hq, Hkv)` pairs: MHA, MQA and GQA.
const HEADS: &[(usize, usize)] = &[(1, 1), (2, 1), (4, 2), (3, 3), (6, 2), (8, 1)];
/// Head dims.
const HEAD_DIMS: &[usize] = &[8, 16, 40, 64];
/// Page sizes of a paged cache; `None` is a contiguous cache.
const PAGE_SIZES: &[Option<usize>] = &[None, Some(16), Some(32), Some(48), Some(256)];

/// One random decode call.
#[derive(Clone, Debug)]
struct Case {
    dtype: DType,
    /// Keys cached per sequence before the call (the batch is its length).
    seqlens: Vec<usize>,
    /// New queries per sequence.
    seqlen_q: usize,
    heads: (usize, usize),
    head_dim: usize,
    /// New keys appended per sequence, if any.
    appended: Option<usize>,
    /// Keys per page, or `None` for a contiguous cache.
    page_size: Option<usize>,
    /// Rows (contiguous) or table slots (paged) beyond the longest sequence's.
    slack: usize,
    params: AttnParams<'static>,
    magnitude: Magnitude,
    seed: u64,
}

/// A cache length: often 0 or short, sometimes spanning several pages.
fn length() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), 1..=40usize, 0..=300usize]
}

fn cases() -> impl Strategy<Value = Case> {
    let sizes = (
        prop::collection::vec(length(), 1..=3),
        1..=16usize,
        select(HEADS),
        select(HEAD_DIMS),
        prop_oneof![Just(None), (1..=4usize).prop_map(Some)],
        select(PAGE_SIZES),
    );
    let options = (
        select(&[DType::F16, DType::BF16, DType::F32][..]),
        0..=2usize,
        any::<bool>(),
        select(&[None, Some(0.3f32), Some(-0.5)][..]),
        select(&[Magnitude::Normal, Magnitude::Large][..]),
        any::<u64>(),
        mask_recipes(),
    );
    (sizes, options).prop_map(|(sizes, options)| {
        let (seqlens, seqlen_q, heads, head_dim, appended, page_size) = sizes;
        let (dtype, slack, causal, softmax_scale, magnitude, seed, masks) = options;
        let batch = seqlens.len();
        Case {
            dtype,
            seqlens,
            seqlen_q,
            heads,
            head_dim,
            appended,
            page_size,
            slack,
            params: masks.params(causal, softmax_scale, batch, heads.0),
            magnitude,
            seed,
        }
    })
}

/// The cache of a case and where each sequence's keys live in it.
struct Cache<T> {
    k: Array4<T>,
    v: Array4<T>,
    table: Option<Array2<i32>>,
}

impl<T: Element> Cache<T> {
    /// An empty cache (all NaN) for `case`, with its block table when paged: the pages of all
    /// sequences in a random order among spare ones, unused table slots holding `-1`.
    fn new(case: &Case, rng: &mut impl Rng) -> Self {
        let (batch, (_, heads_kv), d) = (case.seqlens.len(), case.heads, case.head_dim);
        let total = |b: usize| case.seqlens[b] + case.appended.unwrap_or(0);
        let longest = (0..batch).map(total).max().unwrap_or(0);
        match case.page_size {
            None => {
                let dims = [batch, longest + case.slack, heads_kv, d];
                Cache {
                    k: Array4::from_elem(dims, T::nan()),
                    v: Array4::from_elem(dims, T::nan()),
                    table: None,
                }
            }
            Some(page_size) => {
                let max_pages = longest.div_ceil(page_size) + case.slack;
                let max_pages = max_pages.max(1);
                let used: Vec<usize> = (0..batch).map(|b| total(b).div_ceil(page_size)).collect();
                let num_pages = used.iter().sum::<usize>() + case.slack + 1;
                let mut order: Vec<usize> = (0..num_pages).collect();
                order.shuffle(rng);
                let mut next = order.into_iter();
                let mut table = Array2::from_elem((batch, max_pages), -1);
                for (b, &n) in used.iter().enumerate() {
                    for slot in 0..n {
                        table[[b, slot]] = next.next().expect("enough pages") as i32;
                    }
                }
                let dims = [num_pages, page_size, heads_kv, d];
                Cache {
                    k: Array4::from_elem(dims, T::nan()),
                    v: Array4::from_elem(dims, T::nan()),
                    table: Some(table),
                }
            }
        }
    }

    /// Writes key `j` of sequence `b`.
    fn put(&mut self, b: usize, j: usize, k: &Array4<T>, v: &Array4<T>) {
        let (entry, row) = match &self.table {
            None => (b, j),
            Some(t) => {
                let page_size = self.k.dim().1;
                (t[[b, j / page_size]] as usize, j % page_size)
            }
        };
        let src = s![0, j, .., ..];
        self.k
            .slice_mut(s![entry, row, .., ..])
            .assign(&k.slice(src));
        self.v
            .slice_mut(s![entry, row, .., ..])
            .assign(&v.slice(src));
    }
}

/// Runs one case in its element type and applies the accuracy rule per sequence.
fn check_case<T: Element>(case: &Case) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let batch = case.seqlens.len();
    let (heads_q, heads_kv) = case.heads;
    let (nq, d) = (case.seqlen_q, case.head_dim);
    let scale = case.params.scale(d).map_err(|e| e.to_string())?;
    let sigma = case.magnitude.std_dev(d, scale);
    let appended = case.appended.unwrap_or(0);

    // The logical keys and values of every sequence, then the cache and the new tokens.
    let logical: Vec<(Array4<T>, Array4<T>)> = case
        .seqlens
        .iter()
        .map(|&n| {
            let dims = [1, n + appended, heads_kv, d];
            (
                random_array(&mut rng, dims, sigma),
                random_array(&mut rng, dims, 1.0),
            )
        })
        .collect();
    let q = random_array::<T>(&mut rng, [batch, nq, heads_q, d], sigma);
    let mut cache = Cache::<T>::new(case, &mut rng);
    let new_dims = [batch, appended, heads_kv, d];
    let (mut k_new, mut v_new) = (
        Array4::from_elem(new_dims, T::nan()),
        Array4::from_elem(new_dims, T::nan()),
    );
    for (b, (k, v)) in logical.iter().enumerate() {
        let cached = case.seqlens[b];
        for j in 0..cached {
            cache.put(b, j, k, v);
        }
        k_new
            .slice_mut(s![b, .., .., ..])
            .assign(&k.slice(s![0, cached.., .., ..]));
        v_new
            .slice_mut(s![b, .., .., ..])
            .assign(&v.slice(s![0, cached.., .., ..]));
    }
    let seqlens: Vec<i32> = case.seqlens.iter().map(|&n| n as i32).collect();

    let (o, lse) = attn_with_kvcache_cpu(
        q.view(),
        CpuKvCache {
            k: cache.k.view_mut(),
            v: cache.v.view_mut(),
            seqlens: &seqlens,
            block_table: cache.table.as_ref().map(|t| t.view()),
        },
        case.appended.map(|_| (k_new.view(), v_new.view())),
        &case.params,
    )
    .map_err(|e| e.to_string())?;

    let fail = |e: flash_attn::FlashError| e.to_string();
    for (b, (k_logical, v_logical)) in logical.iter().enumerate() {
        let len = case.seqlens[b] + appended;
        let table = cache.table.as_ref().map(|t| t.view());
        let (k, v) = gather_sequence(cache.k.view(), cache.v.view(), table, b, len);
        // Bit-identical (NaN never occurs in the logical keys).
        if !same(&k, k_logical) || !same(&v, v_logical) {
            return Err(format!(
                "sequence {b}: the cache after the call does not hold its keys and values"
            ));
        }
        let ours = (
            o.slice(s![b..b + 1, .., .., ..]),
            lse.slice(s![b..b + 1, .., ..]),
        );
        if len == 0 {
            let zero = ours.0.iter().all(|x| x.to_f32() == 0.0);
            let neg_inf = ours.1.iter().all(|&x| x == f32::NEG_INFINITY);
            if !(zero && neg_inf) {
                return Err(format!("sequence {b} has no key: O must be 0 and LSE −∞"));
            }
            continue;
        }
        let q_b = q.slice(s![b..b + 1, .., .., ..]);
        let p = &case.params.for_entry(b, case.heads.0);
        let naive = attention_naive(q_b, k.view(), v.view(), p).map_err(fail)?;
        let (q64, k64, v64) = (to_f64(q_b), to_f64(k.view()), to_f64(v.view()));
        let reference = attention_reference(q64.view(), k64.view(), v64.view(), p).map_err(fail)?;
        check_accuracy(
            ours,
            (naive.0.view(), naive.1.view()),
            (reference.0.view(), reference.1.view()),
        )
        .map_err(|e| format!("sequence {b} ({len} keys): {e}"))?;
    }
    Ok(())
}

/// Whether two arrays hold the same elements, bit for bit.
fn same<T: Element>(a: &Array4<T>, b: &Array4<T>) -> bool {
    a.shape() == b.shape()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_f32().to_bits() == y.to_f32().to_bits())
}

/// 32 cases, or `FLASH_ATTN_CPU_CASES` for a longer soak.
fn config() -> ProptestConfig {
    let cases = std::env::var("FLASH_ATTN_CPU_CASES")
        .ok()
        .and_then(|n| n.parse().ok());
    ProptestConfig::with_cases(cases.unwrap_or(32))
}

proptest! {
    #![proptest_config(config())]

    /// The CPU decode path meets the accuracy rule on every sequence of random calls, and
    /// leaves exactly the logical keys in the cache.
    #[test]
    fn decode_matches_reference(case in cases()) {
        let result = match case.dtype {
            DType::F16 => check_case::<f16>(&case),
            DType::BF16 => check_case::<bf16>(&case),
            DType::F32 => check_case::<f32>(&case),
            DType::I32 => unreachable!("the strategy draws float types only"),
        };
        result.map_err(TestCaseError::fail)?;
    }
}
