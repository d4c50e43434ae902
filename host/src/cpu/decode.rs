//! Decoding on the CPU: attention of a few new query tokens over a KV cache (contiguous or
//! paged), with the new keys and values appended first, and the merge of two attention
//! states. The same semantics, checks and error messages as the GPU's
//! [`crate::attn_with_kvcache`] and [`crate::merge_attention_states`], built on
//! [`attention_cpu_into`] one sequence at a time.

use ndarray::{
    s, Array3, Array4, ArrayView2, ArrayView3, ArrayView4, ArrayViewMut3, ArrayViewMut4, Axis, Dim,
};

use crate::cpu::alloc;
use crate::cpu::tiled::attention_cpu_into;
use crate::dtype::Element;
use crate::error::{FlashError, Result};
use crate::params::AttnParams;
use crate::shape::{check_decode_lengths, check_decode_shapes};

/// A KV cache in host memory, laid out as [`crate::KvCache`] describes it for the GPU.
///
/// - Contiguous (`block_table` is `None`): `k` and `v` are `[B, capacity, Hkv, d]`; sequence
///   `b`'s keys are rows `0 .. len_b` of entry `b`.
/// - Paged: `k` and `v` are `[num_pages, page_size, Hkv, d]` with `page_size` a positive
///   multiple of 16, and `block_table` is `[B, max_pages]`: key `j` of sequence `b` is row
///   `j % page_size` of page `block_table[b, j / page_size]`.
///
/// `seqlens[b]` is the number of keys cached for sequence `b` before the call; it is not
/// modified. Rows past the keys a call reads are never read, whatever they hold.
pub struct CpuKvCache<'a, T> {
    /// Key cache (new keys are written into it).
    pub k: ArrayViewMut4<'a, T>,
    /// Value cache (new values are written into it).
    pub v: ArrayViewMut4<'a, T>,
    /// Cached keys per sequence, one length per batch entry.
    pub seqlens: &'a [i32],
    /// Pages per sequence, `[B, max_pages]`, for a paged cache.
    pub block_table: Option<ArrayView2<'a, i32>>,
}

/// Attention of new queries over a KV cache on the CPU, with the semantics of the GPU's
/// [`crate::attn_with_kvcache`]: returns O `[B, Nq, Hq, d]` and the natural-log LSE
/// `[B, Hq, Nq]`.
///
/// `q` is `[B, Nq, Hq, d]` (`Hq` a multiple of `Hkv`). With `new_kv = Some((k_new, v_new))`,
/// both `[B, N_new ≥ 1, Hkv, d]`, the new keys and values are first written into the cache at
/// keys `seqlens[b] .. seqlens[b] + N_new` of each sequence (through the block table when the
/// cache is paged), and sequence `b` attends to `len_b = seqlens[b] + N_new` keys; else to
/// `len_b = seqlens[b]`. Each sequence then gets ordinary attention ([`crate::cpu::attention_cpu`])
/// of its queries over its first `len_b` keys, causal masking aligned bottom-right at `len_b`
/// (query `i` sees key `j` iff `j ≤ i + len_b − Nq`). A row that sees no key (`len_b = 0`, say)
/// gets O = 0 and LSE = −∞.
///
/// Every check is made before the cache is touched: [`FlashError::Shape`] for mismatched or
/// empty dims, a page size that is not a positive multiple of 16, a block table that is not
/// `[B, ≥ 1]`, new keys or values that are not `[B, N_new ≥ 1, Hkv, d]`, a negative length,
/// `len_b` beyond the cache's capacity (`capacity` rows, or `max_pages·page_size` when paged),
/// or a page index that the lengths reach outside `0..num_pages`; [`FlashError::GqaRatio`]
/// when `Hkv` does not divide `Hq`; [`FlashError::Param`] for a non-finite scale or for
/// dropout (a training option: the decode path does not take it, see
/// [`AttnParams::check_no_dropout`]; `p = 0` is no dropout);
/// allocation failures as [`FlashError::TooLarge`] or [`FlashError::Alloc`].
pub fn attn_with_kvcache_cpu<T: Element>(
    q: ArrayView4<T>,
    cache: CpuKvCache<'_, T>,
    new_kv: Option<(ArrayView4<T>, ArrayView4<T>)>,
    params: &AttnParams,
) -> Result<(Array4<T>, Array3<f32>)> {
    params.check_no_dropout()?;
    let CpuKvCache {
        mut k,
        mut v,
        seqlens,
        block_table,
    } = cache;
    let min_keys = params.min_decode_keys(q.shape());
    let call = check_call(
        &q,
        &k.view(),
        &v.view(),
        seqlens,
        block_table,
        new_kv,
        min_keys,
    )?;
    params.scale_log2(call.head_dim)?;
    let (batch, heads_q) = (q.dim().0, q.dim().2);
    params.check_masks(batch, heads_q)?;
    if params.block_mask.is_some() {
        return Err(crate::FlashError::Param(
            "block-sparse masks are not supported on the decode path".into(),
        ));
    }
    if let Some(t) = params.tree_mask {
        t.check(batch, q.dim().1, usize::MAX)?;
    }
    let [batch, seqlen_q, heads_q, head_dim] = q.dim().into();
    let mut o = alloc::array(
        Dim([batch, seqlen_q, heads_q, head_dim]),
        T::default(),
        "output O",
    )?;
    let mut lse = alloc::array(
        Dim([batch, heads_q, seqlen_q]),
        f32::NEG_INFINITY,
        "output LSE",
    )?;
    // A paged sequence's keys are gathered into one buffer, sized for the longest.
    let mut gathered = match block_table {
        Some(_) => {
            let dims = Dim([call.max_keys, call.heads_kv, head_dim]);
            Some((
                alloc::array(dims, T::default(), "gathered keys")?,
                alloc::array(dims, T::default(), "gathered values")?,
            ))
        }
        None => None,
    };

    if let Some((k_new, v_new)) = new_kv {
        for (b, &cached) in call.cached.iter().enumerate() {
            for t in 0..call.appended {
                let (entry, row) = key_slot(block_table, call.page_size, b, cached + t);
                k.slice_mut(s![entry, row, .., ..])
                    .assign(&k_new.slice(s![b, t, .., ..]));
                v.slice_mut(s![entry, row, .., ..])
                    .assign(&v_new.slice(s![b, t, .., ..]));
            }
        }
    }

    let (k, v) = (k.view(), v.view());
    for (b, &cached) in call.cached.iter().enumerate() {
        let len = cached + call.appended;
        if len == 0 {
            continue; // O = 0, LSE = −∞ as allocated
        }
        let (k_b, v_b) = match gathered.as_mut() {
            Some((kg, vg)) => {
                let rows = s![..len, .., ..];
                gather_into(k, v, block_table, b, kg.slice_mut(rows), vg.slice_mut(rows));
                (
                    kg.slice(rows).insert_axis(Axis(0)),
                    vg.slice(rows).insert_axis(Axis(0)),
                )
            }
            None => (
                k.slice(s![b..b + 1, ..len, .., ..]),
                v.slice(s![b..b + 1, ..len, .., ..]),
            ),
        };
        attention_cpu_into(
            q.slice(s![b..b + 1, .., .., ..]),
            k_b,
            v_b,
            &params.for_entry(b, heads_q),
            o.slice_mut(s![b..b + 1, .., .., ..]),
            lse.slice_mut(s![b..b + 1, .., ..]),
        )?;
    }
    Ok((o, lse))
}

/// The keys and values sequence `b` attends to, gathered from a (possibly paged) cache:
/// `[1, len, Hkv, d]` each, key `j` from row `j` of entry `b` (contiguous cache) or from row
/// `j % page_size` of page `block_table[b, j / page_size]` (paged, `page_size` being the
/// cache's second dim). A helper for building references in tests: it allocates infallibly
/// and panics when `b`, `len` or a page index lies outside the cache.
pub fn gather_sequence<T: Element>(
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    block_table: Option<ArrayView2<i32>>,
    b: usize,
    len: usize,
) -> (Array4<T>, Array4<T>) {
    let (_, _, heads_kv, head_dim) = k.dim();
    let mut kg = Array4::default((1, len, heads_kv, head_dim));
    let mut vg = Array4::default((1, len, heads_kv, head_dim));
    gather_into(
        k,
        v,
        block_table,
        b,
        kg.index_axis_mut(Axis(0), 0),
        vg.index_axis_mut(Axis(0), 0),
    );
    (kg, vg)
}

/// Copies the first `kg.len_of(0)` keys and values of sequence `b` into `kg` and `vg`
/// (`[len, Hkv, d]` each).
fn gather_into<T: Element>(
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    block_table: Option<ArrayView2<i32>>,
    b: usize,
    mut kg: ArrayViewMut3<T>,
    mut vg: ArrayViewMut3<T>,
) {
    let page_size = k.dim().1;
    for j in 0..kg.dim().0 {
        let (entry, row) = key_slot(block_table, page_size, b, j);
        kg.slice_mut(s![j, .., ..])
            .assign(&k.slice(s![entry, row, .., ..]));
        vg.slice_mut(s![j, .., ..])
            .assign(&v.slice(s![entry, row, .., ..]));
    }
}

/// Where key `j` of sequence `b` lives: (entry, row) of the cache. Panics on a negative page
/// index (the callers have checked them, or document the panic).
fn key_slot(
    block_table: Option<ArrayView2<i32>>,
    page_size: usize,
    b: usize,
    j: usize,
) -> (usize, usize) {
    match block_table {
        None => (b, j),
        Some(table) => {
            let page = table[[b, j / page_size]];
            let page = usize::try_from(page)
                .unwrap_or_else(|_| panic!("block_table[{b}, {}] = {page}", j / page_size));
            (page, j % page_size)
        }
    }
}

/// The sizes of a checked decode call.
#[derive(Debug)]
struct DecodeCall {
    heads_kv: usize,
    head_dim: usize,
    /// Keys per page (0: contiguous cache).
    page_size: usize,
    /// New keys appended per sequence.
    appended: usize,
    /// Keys cached per sequence before the call.
    cached: Vec<usize>,
    /// The most keys any sequence attends to (cached + appended).
    max_keys: usize,
}

/// Checks a decode call with the shape and length checks the GPU path uses
/// ([`crate::shape::check_decode_shapes`], [`crate::shape::check_decode_lengths`]).
fn check_call<T>(
    q: &ArrayView4<T>,
    k: &ArrayView4<T>,
    v: &ArrayView4<T>,
    seqlens: &[i32],
    block_table: Option<ArrayView2<i32>>,
    new_kv: Option<(ArrayView4<T>, ArrayView4<T>)>,
    min_keys: usize,
) -> Result<DecodeCall> {
    let shape = check_decode_shapes(
        q.dim().into(),
        k.dim().into(),
        v.dim().into(),
        seqlens.len(),
        block_table.map(|t| t.dim().into()),
        new_kv.map(|(kn, vn)| (kn.dim().into(), vn.dim().into())),
    )?;
    // Every key the call writes or reads must exist.
    let mut cached = alloc::with_capacity(shape.batch, "cache lengths")?;
    let mut max_keys = 0;
    // Borrowed as it is when already row-major (the usual case), copied otherwise.
    let table = block_table.as_ref().map(|t| t.as_standard_layout());
    let table = table.as_ref().and_then(|t| t.as_slice()).unwrap_or(&[]);
    check_decode_lengths(&shape, seqlens, min_keys, table, false, |_, keys| {
        cached.push(keys - shape.appended);
        max_keys = max_keys.max(keys);
        Ok(())
    })?;
    Ok(DecodeCall {
        heads_kv: shape.heads_kv,
        head_dim: shape.head_dim,
        page_size: shape.page_size,
        appended: shape.appended,
        cached,
        max_keys,
    })
}

/// Merges two attention states over disjoint key sets into the state over their union, with
/// the semantics of the GPU's [`crate::merge_attention_states`]: O's are `[B, N, H, d]`,
/// LSE's `[B, H, N]` (f32, natural log), as [`crate::cpu::attention_cpu`] returns them.
///
/// Per row, `LSE = log(e^LSE₁ + e^LSE₂)` (computed relative to the larger) and
/// `O = e^(LSE₁ − LSE)·O₁ + e^(LSE₂ − LSE)·O₂`, accumulated in f32 and rounded once to `T`.
/// A state with LSE = −∞ (no key) contributes nothing, whatever its O holds; both −∞ give
/// O = 0 and LSE = −∞. A NaN (or +∞) LSE makes the row's O and LSE NaN.
///
/// Errors: [`FlashError::Shape`] when a dim of O₁ is 0, when O₂ is not O₁'s shape or an LSE
/// not `[B, H, N]`; allocation failures as [`FlashError::TooLarge`] or [`FlashError::Alloc`].
pub fn merge_attention_states_cpu<T: Element>(
    (o1, lse1): (ArrayView4<T>, ArrayView3<f32>),
    (o2, lse2): (ArrayView4<T>, ArrayView3<f32>),
) -> Result<(Array4<T>, Array3<f32>)> {
    let shape: [usize; 4] = o1.dim().into();
    if shape.contains(&0) {
        return Err(FlashError::Shape(format!(
            "O₁ is {shape:?}: every dim must be ≥ 1"
        )));
    }
    let [batch, n, heads, head_dim] = shape;
    let lse_dims = [batch, heads, n];
    let states: [([usize; 4], _); 2] =
        [(o1.dim().into(), lse1.dim()), (o2.dim().into(), lse2.dim())];
    for (i, (o_dims, (lb, lh, ln))) in states.into_iter().enumerate() {
        if o_dims != shape {
            return Err(FlashError::Shape(format!(
                "state {}: O is {o_dims:?}, expected {shape:?} (O₁'s shape)",
                i + 1
            )));
        }
        if [lb, lh, ln] != lse_dims {
            return Err(FlashError::Shape(format!(
                "state {}: LSE is {:?}, expected {lse_dims:?} ([B, H, N])",
                i + 1,
                [lb, lh, ln]
            )));
        }
    }
    let mut o = alloc::array(Dim(shape), T::default(), "output O")?;
    let mut lse = alloc::array(Dim(lse_dims), f32::NEG_INFINITY, "output LSE")?;
    let mut acc = alloc::filled(head_dim, 0.0f32, "merge accumulator")?;
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..n {
                let (l1, l2) = (lse1[[b, h, i]], lse2[[b, h, i]]);
                let max = if l1.is_nan() || l2.is_nan() {
                    f32::NAN
                } else {
                    l1.max(l2)
                };
                if max == f32::NEG_INFINITY {
                    continue; // O = 0, LSE = −∞ as allocated
                }
                // +∞ − +∞ and NaN − x are NaN: such a row ends up NaN.
                let (w1, w2) = ((l1 - max).exp(), (l2 - max).exp());
                let sum = w1 + w2;
                let out = max + sum.ln();
                lse[[b, h, i]] = out;
                let mut dst = o.slice_mut(s![b, i, h, ..]);
                if out.is_nan() {
                    dst.fill(T::from_f32(f32::NAN));
                    continue;
                }
                acc.fill(0.0);
                for (w, state) in [(w1 / sum, &o1), (w2 / sum, &o2)] {
                    if w == 0.0 {
                        continue; // a state without keys: its O is not read
                    }
                    for (a, x) in acc.iter_mut().zip(state.slice(s![b, i, h, ..])) {
                        *a += w * x.to_f32();
                    }
                }
                for (d, &a) in dst.iter_mut().zip(&acc) {
                    *d = T::from_f32(a);
                }
            }
        }
    }
    Ok((o, lse))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::attention_cpu;
    use half::{bf16, f16};
    use ndarray::{Array2, Axis};

    /// Deterministic values in about ±1 of shape `dims`.
    fn values<T: Element>(dims: [usize; 4], seed: u32) -> Array4<T> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
        Array4::from_shape_simple_fn(dims, || {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            T::from_f32(((state >> 8) % 2001) as f32 / 1000.0 - 1.0)
        })
    }

    const PLAIN: AttnParams<'static> = AttnParams::DEFAULT;

    const CAUSAL: AttnParams<'static> = AttnParams {
        causal: true,
        softmax_scale: Some(0.4),
        ..AttnParams::DEFAULT
    };

    /// A paged copy of a contiguous cache `[B, cap, H, d]`: pages of `page_size` rows,
    /// assigned to the sequences in a scrambled order, with unused pages full of NaN.
    fn paginate<T: Element>(
        k: &Array4<T>,
        page_size: usize,
        spare: usize,
    ) -> (Array4<T>, Array2<i32>) {
        let (batch, cap, heads, d) = k.dim();
        let max_pages = cap.div_ceil(page_size);
        let pages = batch * max_pages + spare;
        let mut paged = Array4::from_elem((pages, page_size, heads, d), T::nan());
        // Pages in reverse order: the first `spare` pages are never used.
        let table = Array2::from_shape_fn((batch, max_pages), |(b, slot)| {
            (pages - 1 - (b * max_pages + slot)) as i32
        });
        for b in 0..batch {
            for j in 0..cap {
                let page = table[[b, j / page_size]] as usize;
                paged
                    .slice_mut(s![page, j % page_size, .., ..])
                    .assign(&k.slice(s![b, j, .., ..]));
            }
        }
        (paged, table)
    }

    #[test]
    fn paged_and_contiguous_caches_give_identical_results() {
        for (causal, params) in [(false, PLAIN), (true, CAUSAL)] {
            let (batch, cap, hq, hkv, d, nq) = (3, 70, 4, 2, 24, 5);
            let q = values::<bf16>([batch, nq, hq, d], 1);
            let k = values::<bf16>([batch, cap, hkv, d], 2);
            let v = values::<bf16>([batch, cap, hkv, d], 3);
            let seqlens = [70, 0, 33];
            let (mut kc, mut vc) = (k.clone(), v.clone());
            let contiguous = attn_with_kvcache_cpu(
                q.view(),
                CpuKvCache {
                    k: kc.view_mut(),
                    v: vc.view_mut(),
                    seqlens: &seqlens,
                    block_table: None,
                },
                None,
                &params,
            )
            .unwrap();
            for page_size in [16, 32, 48] {
                // The capacity rounded up to whole pages; the extra rows are NaN.
                let cap_p = cap.div_ceil(page_size) * page_size;
                let pad = |a: &Array4<bf16>| {
                    let mut p = Array4::from_elem((batch, cap_p, hkv, d), bf16::NAN);
                    p.slice_mut(s![.., ..cap, .., ..]).assign(a);
                    p
                };
                let (mut kp, table) = paginate(&pad(&k), page_size, 2);
                let (mut vp, _) = paginate(&pad(&v), page_size, 2);
                let paged = attn_with_kvcache_cpu(
                    q.view(),
                    CpuKvCache {
                        k: kp.view_mut(),
                        v: vp.view_mut(),
                        seqlens: &seqlens,
                        block_table: Some(table.view()),
                    },
                    None,
                    &params,
                )
                .unwrap();
                assert_eq!(paged.0, contiguous.0, "causal {causal}, page {page_size}");
                assert_eq!(paged.1, contiguous.1, "causal {causal}, page {page_size}");
            }
            // Sequence 1 has no key: O = 0, LSE = −∞; the others equal plain attention.
            assert!(contiguous
                .0
                .slice(s![1, .., .., ..])
                .iter()
                .all(|x| x.to_f32() == 0.0));
            assert!(contiguous
                .1
                .slice(s![1, .., ..])
                .iter()
                .all(|&x| x == f32::NEG_INFINITY));
            for b in [0, 2] {
                let len = seqlens[b] as usize;
                let (o, lse) = attention_cpu(
                    q.slice(s![b..b + 1, .., .., ..]),
                    k.slice(s![b..b + 1, ..len, .., ..]),
                    v.slice(s![b..b + 1, ..len, .., ..]),
                    &params,
                )
                .unwrap();
                assert_eq!(
                    o.index_axis(Axis(0), 0),
                    contiguous.0.index_axis(Axis(0), b)
                );
                assert_eq!(
                    lse.index_axis(Axis(0), 0),
                    contiguous.1.index_axis(Axis(0), b)
                );
            }
        }
    }

    #[test]
    fn append_writes_exactly_the_new_rows() {
        let (batch, cap, hq, hkv, d, nq, n_new) = (2, 64, 2, 1, 8, 3, 3);
        let q = values::<f32>([batch, nq, hq, d], 4);
        let k_new = values::<f32>([batch, n_new, hkv, d], 5);
        let v_new = values::<f32>([batch, n_new, hkv, d], 6);
        let seqlens = [10, 61];
        let k0 = values::<f32>([batch, cap, hkv, d], 7);
        let v0 = values::<f32>([batch, cap, hkv, d], 8);

        // Contiguous: rows seqlens[b] .. + 3 of entry b, nothing else.
        let (mut k, mut v) = (k0.clone(), v0.clone());
        let (o, lse) = attn_with_kvcache_cpu(
            q.view(),
            CpuKvCache {
                k: k.view_mut(),
                v: v.view_mut(),
                seqlens: &seqlens,
                block_table: None,
            },
            Some((k_new.view(), v_new.view())),
            &CAUSAL,
        )
        .unwrap();
        for (b, &cached) in seqlens.iter().enumerate() {
            for j in 0..cap {
                let t = j.wrapping_sub(cached as usize);
                let (want_k, want_v) = if t < n_new {
                    (k_new.slice(s![b, t, .., ..]), v_new.slice(s![b, t, .., ..]))
                } else {
                    (k0.slice(s![b, j, .., ..]), v0.slice(s![b, j, .., ..]))
                };
                assert_eq!(k.slice(s![b, j, .., ..]), want_k, "k b {b} j {j}");
                assert_eq!(v.slice(s![b, j, .., ..]), want_v, "v b {b} j {j}");
            }
            // The attention covers the appended keys.
            let len = cached as usize + n_new;
            let (o_ref, lse_ref) = attention_cpu(
                q.slice(s![b..b + 1, .., .., ..]),
                k.slice(s![b..b + 1, ..len, .., ..]),
                v.slice(s![b..b + 1, ..len, .., ..]),
                &CAUSAL,
            )
            .unwrap();
            assert_eq!(o_ref.index_axis(Axis(0), 0), o.index_axis(Axis(0), b));
            assert_eq!(lse_ref.index_axis(Axis(0), 0), lse.index_axis(Axis(0), b));
        }

        // Paged: the new keys of sequence 1 (keys 61..64) straddle pages 3 and 4 of its table.
        let page_size = 16;
        let table = Array2::from_shape_vec((2, 5), vec![5, 0, 2, 9, 9, 1, 3, 4, 6, 7]).unwrap();
        let pages0 = values::<f32>([10, page_size, hkv, d], 9);
        let mut kp = pages0.clone();
        let mut vp = pages0.clone();
        let seqlens = [15, 47];
        attn_with_kvcache_cpu(
            q.view(),
            CpuKvCache {
                k: kp.view_mut(),
                v: vp.view_mut(),
                seqlens: &seqlens,
                block_table: Some(table.view()),
            },
            Some((k_new.view(), v_new.view())),
            &PLAIN,
        )
        .unwrap();
        // Sequence 0: keys 15, 16, 17 → page 5 row 15, page 0 rows 0 and 1.
        // Sequence 1: keys 47, 48, 49 → page 4 row 15, page 6 rows 0 and 1.
        let expected_after = |new: &Array4<f32>| {
            let mut expected = pages0.clone();
            for (b, slots) in [
                (0, [(5, 15), (0, 0), (0, 1)]),
                (1, [(4, 15), (6, 0), (6, 1)]),
            ] {
                for (t, (page, row)) in slots.into_iter().enumerate() {
                    expected
                        .slice_mut(s![page, row, .., ..])
                        .assign(&new.slice(s![b, t, .., ..]));
                }
            }
            expected
        };
        assert_eq!(kp, expected_after(&k_new));
        assert_eq!(vp, expected_after(&v_new));
    }

    #[test]
    fn gather_follows_the_block_table() {
        let k = Array4::from_shape_fn((4, 16, 1, 1), |(p, r, _, _)| (p * 100 + r) as f32);
        let table = Array2::from_shape_vec((1, 3), vec![2, 0, 3]).unwrap();
        let (kg, vg) = gather_sequence(k.view(), k.view(), Some(table.view()), 0, 40);
        let want: Vec<f32> = (0..40)
            .map(|j| ([2, 0, 3][j / 16] * 100 + j % 16) as f32)
            .collect();
        assert_eq!(kg.iter().copied().collect::<Vec<_>>(), want);
        assert_eq!(kg, vg);
        let (kg, _) = gather_sequence(k.view(), k.view(), None, 1, 5);
        assert_eq!(
            kg.iter().copied().collect::<Vec<_>>(),
            [100., 101., 102., 103., 104.]
        );
    }

    /// The inputs of one decode call, in f32, with every part a test may vary.
    struct Call {
        q: Array4<f32>,
        k: Array4<f32>,
        v: Array4<f32>,
        seqlens: Vec<i32>,
        table: Option<Array2<i32>>,
        new: Option<(Array4<f32>, Array4<f32>)>,
        params: AttnParams<'static>,
    }

    impl Call {
        /// A valid paged call: B = 2, Nq = 2, Hq = 4, Hkv = 2, d = 8, 4 pages of 16, 2 per
        /// sequence, one new key.
        fn paged() -> Self {
            Call {
                q: Array4::zeros((2, 2, 4, 8)),
                k: Array4::zeros((4, 16, 2, 8)),
                v: Array4::zeros((4, 16, 2, 8)),
                seqlens: vec![3, 20],
                table: Some(Array2::from_shape_vec((2, 2), vec![0, 1, 2, 3]).unwrap()),
                new: Some((Array4::zeros((2, 1, 2, 8)), Array4::zeros((2, 1, 2, 8)))),
                params: PLAIN,
            }
        }

        /// A valid contiguous call: B = 2, capacity 10, no new keys.
        fn contiguous() -> Self {
            Call {
                seqlens: vec![3, 7],
                k: Array4::zeros((2, 10, 2, 8)),
                v: Array4::zeros((2, 10, 2, 8)),
                table: None,
                new: None,
                ..Self::paged()
            }
        }

        /// Runs the call, checking that a failing call left the cache untouched.
        fn run(mut self) -> Result<()> {
            self.k.fill(1.5);
            self.v.fill(2.5);
            let result = attn_with_kvcache_cpu(
                self.q.view(),
                CpuKvCache {
                    k: self.k.view_mut(),
                    v: self.v.view_mut(),
                    seqlens: &self.seqlens,
                    block_table: self.table.as_ref().map(|t| t.view()),
                },
                self.new.as_ref().map(|(k, v)| (k.view(), v.view())),
                &self.params,
            );
            if result.is_err() {
                assert!(self.k.iter().all(|&x| x == 1.5), "K cache touched");
                assert!(self.v.iter().all(|&x| x == 2.5), "V cache touched");
            }
            result.map(drop)
        }
    }

    /// Asserts a [`FlashError::Shape`] whose message contains `text`.
    fn shape_error(call: Call, text: &str) {
        match call.run() {
            Err(FlashError::Shape(m)) if m.contains(text) => {}
            other => panic!("expected a shape error containing {text:?}, got {other:?}"),
        }
    }

    #[test]
    fn valid_calls_pass() {
        Call::paged().run().unwrap();
        Call::contiguous().run().unwrap();
        // Lengths up to the capacity exactly.
        let mut c = Call::paged();
        c.seqlens = vec![31, 31];
        c.run().unwrap();
        let mut c = Call::contiguous();
        c.seqlens = vec![10, 0];
        c.run().unwrap();
        // Unused table slots may hold anything.
        let mut c = Call::paged();
        c.seqlens = vec![0, 15];
        c.table = Some(Array2::from_shape_vec((2, 2), vec![0, -7, 2, 99]).unwrap());
        c.run().unwrap();
    }

    #[test]
    fn shape_errors() {
        let mut c = Call::contiguous();
        c.v = Array4::zeros((2, 11, 2, 8));
        shape_error(c, "must have the same shape");
        let mut c = Call::contiguous();
        c.q = Array4::zeros((2, 2, 4, 16));
        shape_error(c, "head dim 16, the cache has head dim 8");
        for (dims, name) in [
            ([0, 2, 4, 8], "batch is 0"),
            ([2, 0, 4, 8], "new queries is 0"),
            ([2, 2, 0, 8], "query heads is 0"),
        ] {
            let mut c = Call::contiguous();
            c.q = Array4::zeros(dims);
            shape_error(c, name);
        }
        let mut c = Call::contiguous();
        c.k = Array4::zeros((2, 10, 0, 8));
        c.v = Array4::zeros((2, 10, 0, 8));
        shape_error(c, "KV heads is 0");
        let mut c = Call::contiguous();
        c.q = Array4::zeros((2, 2, 4, 0));
        c.k = Array4::zeros((2, 10, 2, 0));
        c.v = Array4::zeros((2, 10, 2, 0));
        shape_error(c, "head dim is 0");
        let mut c = Call::contiguous();
        c.seqlens = vec![1];
        shape_error(c, "cache_seqlens is [1], expected [2]");
        // A contiguous cache's batch must be Q's (a paged one without its table).
        let mut c = Call::paged();
        c.table = None;
        c.new = None;
        shape_error(c, "needs a block table");
        // Page sizes.
        for rows in [8, 24, 0] {
            let mut c = Call::paged();
            c.k = Array4::zeros((4, rows, 2, 8));
            c.v = Array4::zeros((4, rows, 2, 8));
            c.seqlens = vec![0, 0];
            shape_error(c, "positive multiple of 16");
        }
        // Block table shapes.
        for dims in [(1, 2), (3, 2), (2, 0)] {
            let mut c = Call::paged();
            c.table = Some(Array2::zeros(dims));
            shape_error(c, "expected [2, max_pages ≥ 1]");
        }
        // New keys and values.
        for (kd, vd) in [
            ((2, 1, 2, 8), (2, 2, 2, 8)),
            ((1, 1, 2, 8), (1, 1, 2, 8)),
            ((2, 1, 1, 8), (2, 1, 1, 8)),
            ((2, 1, 2, 4), (2, 1, 2, 4)),
            ((2, 0, 2, 8), (2, 0, 2, 8)),
        ] {
            let mut c = Call::paged();
            c.new = Some((Array4::zeros(kd), Array4::zeros(vd)));
            shape_error(c, "must both be [2, N_new ≥ 1, 2, 8]");
        }
    }

    #[test]
    fn gqa_ratio_is_its_own_error() {
        let mut c = Call::contiguous();
        c.q = Array4::zeros((2, 2, 3, 8));
        assert!(matches!(
            c.run(),
            Err(FlashError::GqaRatio {
                heads_q: 3,
                heads_kv: 2
            })
        ));
    }

    #[test]
    fn lengths_outside_the_cache_are_shape_errors() {
        let mut c = Call::contiguous();
        c.seqlens = vec![3, -1];
        shape_error(c, "cache_seqlens[1] = -1");
        let mut c = Call::contiguous();
        c.seqlens = vec![11, 0];
        shape_error(
            c,
            "cache_seqlens[0] = 11: with 0 new keys it must lie in 0..=10",
        );
        // With one new key the last slot is taken by it.
        let mut c = Call::paged();
        c.seqlens = vec![32, 0];
        shape_error(
            c,
            "cache_seqlens[0] = 32: with 1 new keys it must lie in 0..=31",
        );
        let mut c = Call::paged();
        c.seqlens = vec![0, i32::MAX];
        shape_error(c, "cache_seqlens[1]");
    }

    #[test]
    fn page_indices_the_lengths_reach_must_exist() {
        for (page, slot, len) in [(4, 0, 0), (-1, 1, 16), (17, 1, 20)] {
            let mut c = Call::paged();
            let mut table = Array2::from_shape_vec((2, 2), vec![0, 1, 2, 3]).unwrap();
            table[[1, slot]] = page;
            c.table = Some(table);
            c.seqlens = vec![3, len];
            shape_error(
                c,
                &format!("block_table[1, {slot}] = {page} is not a page of the cache (0..4)"),
            );
        }
    }

    #[test]
    fn a_non_finite_scale_is_a_param_error() {
        let mut c = Call::paged();
        c.params.softmax_scale = Some(f32::NAN);
        assert!(matches!(c.run(), Err(FlashError::Param(_))));
    }

    /// Merging attention over keys `0..split` with attention over `split..n` gives attention
    /// over `0..n`.
    fn merge_of_halves_in<T: Element>(tol: f32) {
        let (nq, n, hq, hkv, d) = (9, 50, 4, 2, 16);
        let q = values::<T>([2, nq, hq, d], 11);
        let k = values::<T>([2, n, hkv, d], 12);
        let v = values::<T>([2, n, hkv, d], 13);
        let whole = attention_cpu(q.view(), k.view(), v.view(), &PLAIN).unwrap();
        for split in [1, 20, 49] {
            let part = |r: std::ops::Range<usize>| {
                let sl = s![.., r, .., ..];
                attention_cpu(q.view(), k.slice(sl), v.slice(sl), &PLAIN).unwrap()
            };
            let (a, b) = (part(0..split), part(split..n));
            let (o, lse) =
                merge_attention_states_cpu((a.0.view(), a.1.view()), (b.0.view(), b.1.view()))
                    .unwrap();
            let o_err = o
                .iter()
                .zip(&whole.0)
                .map(|(x, y)| (x.to_f32() - y.to_f32()).abs())
                .fold(0.0, f32::max);
            let lse_err = lse
                .iter()
                .zip(&whole.1)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(o_err <= tol, "split {split}: O error {o_err}");
            assert!(lse_err <= 1e-5, "split {split}: LSE error {lse_err}");
            // The merge is symmetric.
            let swapped =
                merge_attention_states_cpu((b.0.view(), b.1.view()), (a.0.view(), a.1.view()))
                    .unwrap();
            assert_eq!(swapped.1, lse);
        }
    }

    #[test]
    fn merging_the_halves_gives_the_whole() {
        merge_of_halves_in::<f32>(1e-5);
        merge_of_halves_in::<f16>(2e-3);
        merge_of_halves_in::<bf16>(1.6e-2);
    }

    #[test]
    fn merge_of_empty_and_nan_states() {
        let o1 = Array4::from_shape_vec(
            (1, 4, 1, 2),
            vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        )
        .unwrap();
        // An empty state's O may hold anything: NaN here.
        let o2 = Array4::from_elem((1, 4, 1, 2), f32::NAN);
        let inf = f32::NEG_INFINITY;
        let lse1 = Array3::from_shape_vec((1, 1, 4), vec![0.5, inf, inf, f32::NAN]).unwrap();
        let lse2 = Array3::from_shape_vec((1, 1, 4), vec![inf, 1.0, inf, 0.0]).unwrap();
        let mut o2_row1 = o2.clone();
        o2_row1
            .slice_mut(s![0, 1, 0, ..])
            .assign(&ndarray::arr1(&[-1.0, -2.0]));
        let (o, lse) =
            merge_attention_states_cpu((o1.view(), lse1.view()), (o2_row1.view(), lse2.view()))
                .unwrap();
        // Row 0: state 1 alone; row 1: state 2 alone; row 2: neither; row 3: NaN.
        assert_eq!(lse.slice(s![0, 0, ..3]).to_vec(), [0.5, 1.0, inf]);
        assert_eq!(o.slice(s![0, 0, 0, ..]).to_vec(), [1.0, 2.0]);
        assert_eq!(o.slice(s![0, 1, 0, ..]).to_vec(), [-1.0, -2.0]);
        assert_eq!(o.slice(s![0, 2, 0, ..]).to_vec(), [0.0, 0.0]);
        assert!(lse[[0, 0, 3]].is_nan());
        assert!(o.slice(s![0, 3, 0, ..]).iter().all(|x| x.is_nan()));
        // Equal LSEs average the two rows and add ln 2.
        let lse_eq = Array3::from_elem((1, 1, 4), 2.0f32);
        let o3 = o1.mapv(|x| x + 2.0);
        let (o, lse) =
            merge_attention_states_cpu((o1.view(), lse_eq.view()), (o3.view(), lse_eq.view()))
                .unwrap();
        assert_eq!(o, o1.mapv(|x| x + 1.0));
        assert!(lse.iter().all(|&x| (x - (2.0 + 2f32.ln())).abs() < 1e-6));
    }

    #[test]
    fn merge_shape_errors() {
        let o = Array4::<f32>::zeros((1, 3, 2, 4));
        let lse = Array3::<f32>::zeros((1, 2, 3));
        let merge = |o2: &Array4<f32>, l2: &Array3<f32>| {
            merge_attention_states_cpu((o.view(), lse.view()), (o2.view(), l2.view()))
        };
        assert!(merge(&o, &lse).is_ok());
        let is_shape = |r: Result<(Array4<f32>, Array3<f32>)>, text: &str| matches!(r, Err(FlashError::Shape(m)) if m.contains(text));
        assert!(is_shape(
            merge(&Array4::zeros((1, 3, 2, 5)), &lse),
            "state 2: O is"
        ));
        assert!(is_shape(
            merge(&o, &Array3::zeros((1, 3, 2))),
            "state 2: LSE is"
        ));
        let empty = Array4::<f32>::zeros((1, 0, 2, 4));
        let empty_lse = Array3::<f32>::zeros((1, 2, 0));
        assert!(is_shape(
            merge_attention_states_cpu(
                (empty.view(), empty_lse.view()),
                (empty.view(), empty_lse.view())
            ),
            "every dim must be ≥ 1"
        ));
        assert!(is_shape(
            merge_attention_states_cpu((o.view(), empty_lse.view()), (o.view(), lse.view())),
            "state 1: LSE is"
        ));
    }
}
