//! Checks of a decode call, all made before anything is launched: shapes, element types,
//! contexts, strides and aliasing on the host, then the cache lengths and block table, read
//! back from the device, against the cache.

use std::sync::Arc;

use crate::device::Device;
use crate::error::{FlashError, Result};
use crate::fwd::validate::dims;
use crate::tensor::DeviceTensor;
use crate::Element;

use super::{KvCache, NewKv};

/// Largest grid y/z extent (KV heads and batch are mapped there).
const MAX_GRID_YZ: usize = 65_535;

/// The sizes of a checked decode call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CacheCall {
    pub batch: usize,
    pub seqlen_q: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// Keys per page (0: contiguous cache).
    pub page_size: usize,
    /// New keys appended per sequence.
    pub appended: usize,
    /// The most keys any sequence attends to (cached + appended).
    pub max_keys: usize,
}

/// Checks a decode call and returns its sizes; see [`super::attn_with_kvcache`].
pub(super) fn check_cache<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    cache: &KvCache<'_, T>,
    new_kv: Option<NewKv<'_, T>>,
    o: &DeviceTensor<T>,
    lse: &DeviceTensor<f32>,
) -> Result<CacheCall> {
    let [batch, seqlen_q, heads_q, head_dim] = dims::<4>(q.shape(), "Q")?;
    let k_dims = dims::<4>(cache.k.shape(), "K cache")?;
    let v_dims = dims::<4>(cache.v.shape(), "V cache")?;
    if k_dims != v_dims {
        return Err(FlashError::Shape(format!(
            "K cache {k_dims:?} and V cache {v_dims:?} must have the same shape"
        )));
    }
    let [entries, rows, heads_kv, head_dim_k] = k_dims;
    if head_dim_k != head_dim {
        return Err(FlashError::Shape(format!(
            "Q has head dim {head_dim}, the cache has head dim {head_dim_k}"
        )));
    }
    for (name, n) in [
        ("batch", batch),
        ("new queries", seqlen_q),
        ("query heads", heads_q),
        ("KV heads", heads_kv),
        ("head dim", head_dim),
    ] {
        if n == 0 {
            return Err(FlashError::Shape(format!("{name} is 0: it must be ≥ 1")));
        }
    }
    if head_dim > 256 {
        return Err(FlashError::HeadDim(head_dim));
    }
    if heads_q % heads_kv != 0 {
        return Err(FlashError::GqaRatio { heads_q, heads_kv });
    }
    if heads_kv > MAX_GRID_YZ || batch > MAX_GRID_YZ {
        return Err(FlashError::TooLarge(format!(
            "at most {MAX_GRID_YZ} KV heads and {MAX_GRID_YZ} batch entries per call"
        )));
    }
    let seqlens_dims = dims::<1>(cache.seqlens.shape(), "cache_seqlens")?;
    if seqlens_dims != [batch] {
        return Err(FlashError::Shape(format!(
            "cache_seqlens is {seqlens_dims:?}, expected [{batch}] (one length per sequence)"
        )));
    }
    // Capacity per sequence, and the pages when paged.
    let (page_size, capacity, pages) = match cache.block_table {
        None => {
            if entries != batch {
                return Err(FlashError::Shape(format!(
                    "the KV cache has batch {entries}, Q has batch {batch} (a paged cache needs a block table)"
                )));
            }
            (0, rows, None)
        }
        Some(table) => {
            let [tb, max_pages] = dims::<2>(table.shape(), "block_table")?;
            if tb != batch || max_pages == 0 {
                return Err(FlashError::Shape(format!(
                    "block_table is [{tb}, {max_pages}], expected [{batch}, max_pages ≥ 1]"
                )));
            }
            if rows == 0 || rows % 16 != 0 {
                return Err(FlashError::Shape(format!(
                    "page size {rows} must be a positive multiple of 16"
                )));
            }
            if table.strides()[1] != 1 {
                return Err(FlashError::Layout(
                    "block_table: the page dim must be contiguous (stride 1)".into(),
                ));
            }
            let capacity = max_pages.checked_mul(rows).ok_or_else(|| {
                FlashError::TooLarge("block_table pages × page size overflows".into())
            })?;
            (rows, capacity, Some((table, max_pages, entries)))
        }
    };
    let appended = match new_kv {
        None => 0,
        Some(new) => {
            let kn = dims::<4>(new.k.shape(), "k_new")?;
            let vn = dims::<4>(new.v.shape(), "v_new")?;
            if kn != vn || kn[0] != batch || kn[2] != heads_kv || kn[3] != head_dim || kn[1] == 0 {
                return Err(FlashError::Shape(format!(
                    "k_new {kn:?} and v_new {vn:?} must both be [{batch}, N_new ≥ 1, {heads_kv}, {head_dim}]"
                )));
            }
            kn[1]
        }
    };
    if capacity > i32::MAX as usize || seqlen_q > i32::MAX as usize {
        return Err(FlashError::TooLarge(format!(
            "cache capacity {capacity} or {seqlen_q} new queries exceed the kernels' 32-bit counters"
        )));
    }
    o_and_lse_shapes([batch, seqlen_q, heads_q, head_dim], o, lse)?;

    // (name, context, strides of a [.., d] tensor whose head dim must be contiguous)
    type Placement<'t> = (
        &'t str,
        &'t Arc<cudarc::driver::CudaContext>,
        Option<&'t [usize]>,
    );
    let mut tensors: Vec<Placement> = vec![
        ("Q", q.context(), Some(q.strides())),
        ("K cache", cache.k.context(), Some(cache.k.strides())),
        ("V cache", cache.v.context(), Some(cache.v.strides())),
        ("O", o.context(), Some(o.strides())),
        ("LSE", lse.context(), None),
        ("cache_seqlens", cache.seqlens.context(), None),
    ];
    if let Some(t) = cache.block_table {
        tensors.push(("block_table", t.context(), None));
    }
    if let Some(new) = new_kv {
        tensors.push(("k_new", new.k.context(), Some(new.k.strides())));
        tensors.push(("v_new", new.v.context(), Some(new.v.strides())));
    }
    for (name, ctx, strides) in tensors {
        if !Arc::ptr_eq(ctx, dev.context()) {
            return Err(FlashError::DeviceMismatch(format!(
                "{name} belongs to another device or context"
            )));
        }
        if strides.is_some_and(|s| s[3] != 1) {
            return Err(FlashError::Layout(format!(
                "{name}: the head dim must be contiguous (stride 1)"
            )));
        }
    }
    if [q, &*cache.k, &*cache.v].iter().any(|t| t.same_buffer(o)) || lse.same_buffer(cache.seqlens)
    {
        return Err(FlashError::Layout(
            "O and LSE must not share memory with Q, the cache or its lengths".into(),
        ));
    }
    if let Some(new) = new_kv {
        if [new.k, new.v]
            .iter()
            .any(|t| t.same_buffer(cache.k) || t.same_buffer(cache.v))
        {
            return Err(FlashError::Layout(
                "k_new and v_new must not share memory with the cache they are written into".into(),
            ));
        }
    }

    // The lengths and pages, read back: every key the call writes or reads must exist.
    let lens = cache.seqlens.to_host(dev)?;
    let table = match pages {
        Some((t, max_pages, _)) => Some((t.to_host(dev)?, max_pages)),
        None => None,
    };
    let mut max_keys = 0;
    for (b, &len) in lens.iter().enumerate() {
        let keys = usize::try_from(len)
            .ok()
            .and_then(|l| l.checked_add(appended))
            .filter(|&k| k <= capacity)
            .ok_or_else(|| {
                FlashError::Shape(format!(
                    "cache_seqlens[{b}] = {len}: with {appended} new keys it must lie in 0..={} (the cache holds {capacity} keys per sequence)",
                    capacity.saturating_sub(appended)
                ))
            })?;
        if let (Some((table, max_pages)), Some((_, _, num_pages))) = (&table, pages) {
            for slot in 0..keys.div_ceil(page_size) {
                let page = table[b * max_pages + slot];
                if page < 0 || page as usize >= num_pages {
                    return Err(FlashError::Shape(format!(
                        "block_table[{b}, {slot}] = {page} is not a page of the cache (0..{num_pages})"
                    )));
                }
            }
        }
        max_keys = max_keys.max(keys);
    }
    Ok(CacheCall {
        batch,
        seqlen_q,
        heads_q,
        heads_kv,
        head_dim,
        page_size,
        appended,
        max_keys,
    })
}

/// O must be Q's shape and LSE `[B, Hq, Nq]` with the sequence dim contiguous.
fn o_and_lse_shapes<T: Element>(
    q: [usize; 4],
    o: &DeviceTensor<T>,
    lse: &DeviceTensor<f32>,
) -> Result<()> {
    let [b, n, h, _] = q;
    if o.shape() != q {
        return Err(FlashError::Shape(format!(
            "O is {:?}, expected {q:?} (Q's shape)",
            o.shape()
        )));
    }
    if lse.shape() != [b, h, n] {
        return Err(FlashError::Shape(format!(
            "LSE is {:?}, expected {:?} ([B, Hq, Nq])",
            lse.shape(),
            [b, h, n]
        )));
    }
    if lse.strides()[2] != 1 {
        return Err(FlashError::Layout(
            "LSE: the sequence dim must be contiguous (stride 1)".into(),
        ));
    }
    Ok(())
}

/// Checks two attention states for a merge and returns O's shape `[B, N, H, d]`.
pub(super) fn check_merge<T: Element>(
    dev: &Device,
    states: [(&DeviceTensor<T>, &DeviceTensor<f32>); 2],
) -> Result<[usize; 4]> {
    let shape = dims::<4>(states[0].0.shape(), "O₁")?;
    if shape.contains(&0) {
        return Err(FlashError::Shape(format!(
            "O₁ is {shape:?}: every dim must be ≥ 1"
        )));
    }
    if shape[3] > 256 {
        return Err(FlashError::HeadDim(shape[3]));
    }
    if shape[0] * shape[1] * shape[2] > i32::MAX as usize {
        return Err(FlashError::TooLarge(format!("{shape:?}: too many rows")));
    }
    for (i, (o, lse)) in states.iter().enumerate() {
        o_and_lse_shapes(shape, o, lse).map_err(|e| match e {
            FlashError::Shape(m) => FlashError::Shape(format!("state {}: {m}", i + 1)),
            e => e,
        })?;
        if !Arc::ptr_eq(o.context(), dev.context()) || !Arc::ptr_eq(lse.context(), dev.context()) {
            return Err(FlashError::DeviceMismatch(format!(
                "state {} belongs to another device or context",
                i + 1
            )));
        }
        if o.strides()[3] != 1 {
            return Err(FlashError::Layout(format!(
                "state {}: the head dim of O must be contiguous (stride 1)",
                i + 1
            )));
        }
    }
    Ok(shape)
}
