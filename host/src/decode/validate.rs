//! Checks of a decode call, all made before anything is launched: shapes, element types,
//! contexts, strides and aliasing on the host, then the cache lengths and block table, read
//! back from the device, against the cache.

use std::borrow::Cow;
use std::sync::Arc;

use crate::device::Device;
use crate::error::{FlashError, Result};
use crate::fwd::validate::dims;
use crate::shape::{check_decode_lengths, check_decode_shapes, DecodeShape};
use crate::tensor::DeviceTensor;
use crate::Element;

use super::{KvCache, NewKv};

/// Largest grid y/z extent (KV heads and batch are mapped there).
const MAX_GRID_YZ: usize = 65_535;

/// A checked decode call: its sizes, and the most keys any sequence attends to (cached +
/// appended).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CacheCall {
    pub shape: DecodeShape,
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
    min_keys: usize,
) -> Result<CacheCall> {
    let table_dims = match cache.block_table {
        Some(t) => Some(dims::<2>(t.shape(), "block_table")?),
        None => None,
    };
    let new_dims = match new_kv {
        Some(new) => Some((
            dims::<4>(new.k.shape(), "k_new")?,
            dims::<4>(new.v.shape(), "v_new")?,
        )),
        None => None,
    };
    let shape = check_decode_shapes(
        dims::<4>(q.shape(), "Q")?,
        dims::<4>(cache.k.shape(), "K cache")?,
        dims::<4>(cache.v.shape(), "V cache")?,
        dims::<1>(cache.seqlens.shape(), "cache_seqlens")?[0],
        table_dims,
        new_dims,
    )?;
    let DecodeShape {
        batch,
        seqlen_q,
        heads_q,
        heads_kv,
        head_dim,
        capacity,
        ..
    } = shape;
    if head_dim > 256 {
        return Err(FlashError::HeadDim(head_dim));
    }
    if heads_kv > MAX_GRID_YZ || batch > MAX_GRID_YZ {
        return Err(FlashError::TooLarge(format!(
            "at most {MAX_GRID_YZ} KV heads and {MAX_GRID_YZ} batch entries per call"
        )));
    }
    if cache.block_table.is_some_and(|t| t.strides()[1] != 1) {
        return Err(FlashError::Layout(
            "block_table: the page dim must be contiguous (stride 1)".into(),
        ));
    }
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
    let max_pages = table_dims.map_or(0, |[_, m]| m);
    let mut table_checked = false;
    let (lens, table) = match cache.host {
        Some(host) => {
            let table = match (host.block_table, table_dims) {
                (Some(t), Some(_)) if t.entries().len() == batch * max_pages => {
                    table_checked = t.known_within(shape.entries);
                    Cow::Borrowed(t.entries())
                }
                (None, None) => Cow::Borrowed(&[][..]),
                (t, _) => {
                    return Err(FlashError::Shape(format!(
                        "the host block table has {:?} entries, the device one {} ({batch} × {max_pages})",
                        t.map(|t| t.entries().len()),
                        batch * max_pages
                    )))
                }
            };
            if host.seqlens.len() != batch {
                return Err(FlashError::Shape(format!(
                    "the host cache_seqlens has {} entries, expected {batch}",
                    host.seqlens.len()
                )));
            }
            (Cow::Borrowed(host.seqlens), table)
        }
        None => (
            Cow::Owned(cache.seqlens.to_host(dev)?),
            match cache.block_table {
                Some(t) => Cow::Owned(t.to_host(dev)?),
                None => Cow::Borrowed(&[][..]),
            },
        ),
    };
    let mut max_keys = 0;
    check_decode_lengths(&shape, &lens, min_keys, &table, table_checked, |_, keys| {
        max_keys = max_keys.max(keys);
        Ok(())
    })?;
    Ok(CacheCall { shape, max_keys })
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
