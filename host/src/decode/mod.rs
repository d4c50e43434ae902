//! Decoding on the GPU: attention of a few new query tokens over a KV cache (contiguous or
//! paged), with split-KV (FlashDecoding) and GQA packing, and the merge of attention states.
//! [`validate`] checks the call (reading the cache lengths and block table back),
//! [`splits`] picks the number of key splits, and this file launches.

mod splits;
mod validate;

use flash_attn_kernels::config::{APPEND_THREADS, COMBINE_THREADS, MAX_DECODE_SPLITS};
use flash_attn_kernels::params::{
    AppendParams, CombineParams, DecodeParams, KvLayout, MaskArgs, RowStatsRef, SeqDims, TensorRef,
};
use flash_attn_kernels::registry::{self, MaskKind};

use crate::device::Device;
use crate::dtype::Element;
use crate::error::{FlashError, Result};
use crate::fwd::layout::{operand, packed_input, packed_output, padded_head_dim, scatter_output};
use crate::fwd::validate::check_dtype;
use crate::launch::{launch, Order};
use crate::mask::DeviceMask;
use crate::params::AttnParams;
use crate::shape::DecodeShape;
use crate::tensor::DeviceTensor;

pub use splits::decode_splits;
use splits::filling_splits;
use validate::{check_cache, check_merge, CacheCall};

/// A KV cache on the device, as FlashAttention's `flash_attn_with_kvcache` takes it.
///
/// - Contiguous: `k` and `v` are `[B, capacity, Hkv, d]`; sequence `b`'s keys are rows
///   `0 .. seqlens[b]` of entry `b`.
/// - Paged (`block_table` given): `k` and `v` are `[num_pages, page_size, Hkv, d]` with
///   `page_size` a multiple of 16, and `block_table` is `[B, max_pages]` i32: key `j` of
///   sequence `b` is row `j % page_size` of page `block_table[b, j / page_size]` (the vLLM
///   layout).
///
/// `seqlens` (`[B]` i32) holds the keys cached per sequence before the call. The cache may
/// hold anything past them; those rows are never read.
pub struct KvCache<'a, T> {
    /// Key cache (new keys are written into it).
    pub k: &'a mut DeviceTensor<T>,
    /// Value cache (new values are written into it).
    pub v: &'a mut DeviceTensor<T>,
    /// Cached keys per sequence, `[B]` i32.
    pub seqlens: &'a DeviceTensor<i32>,
    /// Pages per sequence, `[B, max_pages]` i32, for a paged cache.
    pub block_table: Option<&'a DeviceTensor<i32>>,
    /// The same lengths and block table in host memory, when the caller has them: the call
    /// then validates them instead of copying the device tensors back (no synchronisation).
    pub host: Option<HostCacheMeta<'a>>,
}

/// A host copy of a cache's lengths and block table (see [`KvCache::host`]). The caller
/// vouches that it equals the device tensors; where it does not, the results are wrong, but
/// the kernels still never read or write outside the cache: they clamp each sequence's keys
/// to the cache's capacity and page indices into the pool.
#[derive(Clone, Copy, Debug)]
pub struct HostCacheMeta<'a> {
    /// `seqlens`, `[B]`.
    pub seqlens: &'a [i32],
    /// The block table (paged caches).
    pub block_table: Option<HostBlockTable<'a>>,
}

/// A host copy of a block table, row-major `[B, max_pages]`, for [`HostCacheMeta`].
///
/// From [`HostBlockTable::new`] (or `From<&[i32]>`), each call checks the entries its
/// sequences' keys reach: with pages of 16 keys and long sequences that is 10⁵–10⁶ entries
/// per call (on the H100 machine's CPU, 35–85 µs for 131K entries, 85–200 µs for 524K). A
/// decode step runs one call per layer on the same table: [`HostBlockTable::checked`] checks
/// every entry once, and calls on a pool of at least that many pages then skip the per-entry
/// check. The borrow keeps the entries unchanged while the value lives.
#[derive(Clone, Copy, Debug)]
pub struct HostBlockTable<'a> {
    entries: &'a [i32],
    /// Every entry lies in `0..pages` (checked by [`Self::checked`]).
    checked_pages: Option<usize>,
}

impl<'a> HostBlockTable<'a> {
    /// The table `entries`, checked by each call that uses it.
    pub fn new(entries: &'a [i32]) -> Self {
        Self {
            entries,
            checked_pages: None,
        }
    }

    /// The table `entries`, every one checked now to name a page of a pool of `pages` pages
    /// (typed error naming the first that does not). Calls on a cache of at least `pages`
    /// pages do not check the entries again; calls on a smaller pool do.
    pub fn checked(entries: &'a [i32], pages: usize) -> Result<Self> {
        if let Some((slot, page)) = crate::shape::first_bad_page(entries, pages) {
            return Err(FlashError::Shape(format!(
                "block table entry {slot} = {page} is not a page of a pool of {pages}"
            )));
        }
        Ok(Self {
            entries,
            checked_pages: Some(pages),
        })
    }

    /// The entries, row-major `[B, max_pages]`.
    pub fn entries(&self) -> &'a [i32] {
        self.entries
    }

    /// Whether every entry is known to name a page of a pool of `pages` pages.
    pub(crate) fn known_within(&self, pages: usize) -> bool {
        self.checked_pages.is_some_and(|p| p <= pages)
    }
}

impl<'a> From<&'a [i32]> for HostBlockTable<'a> {
    fn from(entries: &'a [i32]) -> Self {
        Self::new(entries)
    }
}

/// Keys and values of the new tokens, `[B, N_new, Hkv, d]` each, appended to the cache by
/// [`attn_with_kvcache`] before attending.
#[derive(Clone, Copy)]
pub struct NewKv<'a, T> {
    /// New keys.
    pub k: &'a DeviceTensor<T>,
    /// New values.
    pub v: &'a DeviceTensor<T>,
}

/// Options of the decode path beyond [`AttnParams`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Number of key splits (1 to 128); `None` picks it from the batch, the heads, the
    /// lengths, the SM count and the memory's bandwidth ([`decode_splits`]).
    pub num_splits: Option<usize>,
}

/// Attention of new queries over a KV cache on the GPU (FlashDecoding): returns O
/// `[B, Nq, Hq, d]` and LSE `[B, Hq, Nq]` (f32, natural log).
///
/// `q` is `[B, Nq, Hq, d]` (typically 1 to 16 new tokens per sequence). With `new_kv`, its
/// keys and values are first written into the cache at positions `seqlens[b] ..
/// seqlens[b] + N_new` of each sequence (the caller then advances `seqlens`), and sequence `b`
/// attends to `seqlens[b] + N_new` keys; else to `seqlens[b]`. Causal masking is aligned to
/// the bottom-right of each sequence: new token `i` sees keys `j ≤ i + len_b − Nq`. A sequence
/// with no visible key gets O = 0 and LSE = −∞. GQA/MQA: the query heads of one KV head share
/// one block, so each byte of the cache is read once per group.
///
/// Every length is checked against the cache, and every page index the lengths reach
/// against the pool, before anything is launched: from [`KvCache::host`] when given, else
/// by reading `seqlens` and `block_table` back to the host (one small blocking copy each).
pub fn attn_with_kvcache<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    cache: KvCache<'_, T>,
    new_kv: Option<NewKv<'_, T>>,
    params: &AttnParams,
    options: &DecodeOptions,
) -> Result<(DeviceTensor<T>, DeviceTensor<f32>)> {
    let s = q.shape();
    if s.len() != 4 {
        return Err(FlashError::Shape(format!(
            "Q must have rank 4 [B, Nq, Hq, d], got shape {s:?}"
        )));
    }
    let mut o = DeviceTensor::uninit(dev, s)?;
    let mut lse = DeviceTensor::uninit(dev, &[s[0], s[2], s[1]])?;
    attn_with_kvcache_into(dev, q, cache, new_kv, params, options, &mut o, &mut lse)?;
    Ok((o, lse))
}

/// [`attn_with_kvcache`] writing into caller-provided O and LSE.
#[allow(clippy::too_many_arguments)]
pub fn attn_with_kvcache_into<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    cache: KvCache<'_, T>,
    new_kv: Option<NewKv<'_, T>>,
    params: &AttnParams,
    options: &DecodeOptions,
    o: &mut DeviceTensor<T>,
    lse: &mut DeviceTensor<f32>,
) -> Result<()> {
    check_dtype::<T>()?;
    params.check_no_dropout()?;
    let CacheCall {
        shape: call,
        max_keys,
    } = check_cache(
        dev,
        q,
        &cache,
        new_kv,
        o,
        lse,
        params.min_decode_keys(q.shape()),
    )?;
    let scale_log2 = params.kernel_scale_log2(call.head_dim)?;
    let kernel = decode_kernel::<T>(call.head_dim, params.mask_kind())?;
    let splits = pick_splits(dev, &call, max_keys, kernel, options)?;
    let mask_shape = crate::shape::AttnShape {
        batch: call.batch,
        seqlen_q: call.seqlen_q,
        seqlen_k: call.capacity,
        heads_q: call.heads_q,
        heads_kv: call.heads_kv,
        head_dim: call.head_dim,
    };
    let mask = DeviceMask::new(dev, params, &mask_shape)?;
    let padded_d = padded_head_dim(call.head_dim);

    let layout = |seqlens: u64, appended: usize| KvLayout {
        block_table: cache.block_table.map_or(0, |t| t.device_address(dev)),
        table_stride: cache.block_table.map_or(0, |t| t.strides()[0] as u32),
        page_size: call.page_size as u32,
        seqlens,
        appended: appended as u32,
        capacity: call.capacity as u32,
        entries: call.entries as u32,
        reserved: 0,
    };
    let seqlens = cache.seqlens.device_address(dev);
    if let Some(new) = new_kv {
        let p = AppendParams {
            k_new: raw_operand(dev, new.k),
            v_new: raw_operand(dev, new.v),
            k: raw_operand(dev, cache.k),
            v: raw_operand(dev, cache.v),
            kv: layout(seqlens, call.appended),
            batch: call.batch as u32,
            heads_kv: call.heads_kv as u32,
            head_dim: call.head_dim as u32,
            reserved: 0,
        };
        let total = call.batch * call.appended * call.heads_kv * call.head_dim;
        let blocks = total.div_ceil(APPEND_THREADS).clamp(1, 65_535 * 16) as u32;
        // SAFETY: the new tensors and the caches match `p` (checked); every target key lies
        // inside the cache, through pages the block table names (checked on the host).
        unsafe {
            launch(
                dev,
                Order::Stream,
                registry::APPEND_KERNEL,
                (blocks, 1, 1),
                APPEND_THREADS as u32,
                0,
                p,
            )?
        };
    }
    let k_packed = packed_input(dev, cache.k, padded_d)?;
    let v_packed = packed_input(dev, cache.v, padded_d)?;
    let args = LaunchArgs {
        q,
        k: operand(dev, cache.k, &k_packed),
        v: operand(dev, cache.v, &v_packed),
        kv: layout(seqlens, call.appended),
        dims: SeqDims {
            batch: call.batch as u32,
            heads_q: call.heads_q as u32,
            heads_kv: call.heads_kv as u32,
            seqlen_q: call.seqlen_q as u32,
            seqlen_k: 0,
            head_dim: padded_d as u32,
        },
        head_dim: call.head_dim,
        scale_log2,
        mask: mask.args,
        splits,
    };
    run_decode(dev, kernel, &args, o, lse)
}

/// Forward attention through the decode kernels, for [`crate::flash_attn`] when there are
/// few queries and many keys: contiguous K/V, every sequence `seqlen_k` long. Returns
/// `false` (nothing launched) when the split-KV path would not split, or when `params`
/// carry key lengths or a block mask (which only the forward kernels take).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_via_decode<T: Element>(
    dev: &Device,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    shape: &crate::shape::AttnShape,
    params: &AttnParams,
    o: &mut DeviceTensor<T>,
    lse: &mut DeviceTensor<f32>,
) -> Result<bool> {
    // Key padding and block masks have no decode route (the padded launches take them).
    let options_fit = params.seqlens_k.is_none() && params.block_mask.is_none();
    if shape.seqlen_q > FORWARD_DECODE_MAX_Q || !options_fit {
        return Ok(false);
    }
    let kernel = decode_kernel::<T>(shape.head_dim, params.mask_kind())?;
    let sizes = [shape.batch, shape.heads_q, shape.heads_kv, shape.seqlen_q];
    let (resident, blocks) = kernel.occupancy(dev, sizes)?;
    if filling_splits(resident, blocks, shape.seqlen_k) <= 1 {
        return Ok(false); // the forward kernels' own blocks fill the GPU well enough
    }
    let splits = splits_on(dev, (resident, blocks), shape.seqlen_k);
    let mask = DeviceMask::new(dev, params, shape)?;
    let padded_d = padded_head_dim(shape.head_dim);
    let k_packed = packed_input(dev, k, padded_d)?;
    let v_packed = packed_input(dev, v, padded_d)?;
    let args = LaunchArgs {
        q,
        k: operand(dev, k, &k_packed),
        v: operand(dev, v, &v_packed),
        kv: KvLayout {
            capacity: shape.seqlen_k as u32,
            entries: shape.batch as u32,
            ..KvLayout::default()
        },
        dims: shape.seq_dims(padded_d),
        head_dim: shape.head_dim,
        scale_log2: params.kernel_scale_log2(shape.head_dim)?,
        mask: mask.args,
        splits: Splits::new(splits, shape.seqlen_k),
    };
    run_decode(dev, kernel, &args, o, lse)?;
    Ok(true)
}

/// Queries per sequence up to which [`crate::flash_attn`] considers the split-KV path (it
/// takes it only when the forward kernels' blocks would fill less than half the GPU, see
/// [`filling_splits`]): 64 covers a typical tree of draft tokens.
pub(crate) const FORWARD_DECODE_MAX_Q: usize = 64;

/// Merges two attention states over disjoint key sets into the state over their union:
/// `LSE = log(exp LSE₁ + exp LSE₂)`, `O = exp(LSE₁ − LSE)·O₁ + exp(LSE₂ − LSE)·O₂` (for prefix
/// sharing, or results computed on different devices). O's are `[B, N, H, d]` (f16/bf16),
/// LSE's `[B, H, N]` f32 natural log, as [`crate::flash_attn`] returns them. A state with
/// LSE = −∞ (no key) contributes nothing, whatever its O; both −∞ give O = 0, LSE = −∞.
pub fn merge_attention_states<T: Element>(
    dev: &Device,
    (o1, lse1): (&DeviceTensor<T>, &DeviceTensor<f32>),
    (o2, lse2): (&DeviceTensor<T>, &DeviceTensor<f32>),
) -> Result<(DeviceTensor<T>, DeviceTensor<f32>)> {
    check_dtype::<T>()?;
    let dims = check_merge(dev, [(o1, lse1), (o2, lse2)])?;
    let [b, n, h, d] = dims;
    let padded_d = padded_head_dim(d);
    let o = DeviceTensor::<T>::uninit(dev, &dims)?;
    let lse = DeviceTensor::<f32>::uninit(dev, &[b, h, n])?;
    let p1 = packed_input(dev, o1, padded_d)?;
    let p2 = packed_input(dev, o2, padded_d)?;
    let o_packed = packed_output(dev, &o, padded_d)?;
    let p = CombineParams {
        o: operand(dev, &o, &o_packed),
        lse: stats(dev, &lse),
        state_o: [operand(dev, o1, &p1), operand(dev, o2, &p2)],
        state_lse: [stats(dev, lse1), stats(dev, lse2)],
        dims: SeqDims {
            batch: b as u32,
            heads_q: h as u32,
            heads_kv: h as u32,
            seqlen_q: n as u32,
            seqlen_k: 0,
            head_dim: padded_d as u32,
        },
        num_splits: 2,
        ..CombineParams::default()
    };
    let name = registry::MERGE_KERNELS[T::DTYPE.kernel()? as usize];
    launch_combine(dev, name, b * h * n, padded_d, p)?;
    if let Some(packed) = &o_packed {
        scatter_output(dev, &o, packed, d, padded_d)?;
    }
    Ok((o, lse))
}

/// How the keys are split: the count and the keys per split (a multiple of 16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Splits {
    count: usize,
    keys: usize,
}

impl Splits {
    /// `wanted` splits of `max_keys` keys, in whole steps of 16 keys, without empty trailing
    /// splits.
    fn new(wanted: usize, max_keys: usize) -> Self {
        let steps = max_keys.div_ceil(16).max(1);
        let per = steps.div_ceil(wanted.max(1));
        Self {
            count: steps.div_ceil(per),
            keys: 16 * per,
        }
    }
}

/// The splits of a validated call: forced by `options` or chosen by [`decode_splits`].
fn pick_splits(
    dev: &Device,
    call: &DecodeShape,
    max_keys: usize,
    kernel: DecodeKernel,
    options: &DecodeOptions,
) -> Result<Splits> {
    let wanted = match options.num_splits {
        Some(n) if (1..=MAX_DECODE_SPLITS).contains(&n) => n,
        Some(n) => {
            return Err(FlashError::Param(format!(
                "num_splits must be 1..={MAX_DECODE_SPLITS}, got {n}"
            )))
        }
        None => kernel.auto_splits(
            dev,
            [call.batch, call.heads_q, call.heads_kv, call.seqlen_q],
            max_keys,
        )?,
    };
    Ok(Splits::new(wanted, max_keys))
}

/// The decode kernel for `T`, a head dim and a mask kind.
fn decode_kernel<T: Element>(head_dim: usize, mask: MaskKind) -> Result<DecodeKernel> {
    if mask == MaskKind::Sparse {
        return Err(FlashError::Param(
            "block-sparse masks are not supported on the decode path".into(),
        ));
    }
    let row = registry::decode_kernel(head_dim, mask).ok_or(FlashError::HeadDim(head_dim))?;
    Ok(DecodeKernel {
        name: row.name(T::DTYPE.kernel()?),
        row: *row,
    })
}

/// [`decode_splits`] on `dev` for the `(resident, blocks)` of [`DecodeKernel::occupancy`].
fn splits_on(dev: &Device, (resident, blocks): (usize, usize), max_keys: usize) -> usize {
    decode_splits(resident, blocks, max_keys, dev.memory_gbps_per_sm())
}

/// A chosen decode kernel.
#[derive(Clone, Copy)]
struct DecodeKernel {
    name: &'static str,
    row: registry::DecodeKernel,
}

impl DecodeKernel {
    /// The kernel's tile on `dev`'s target.
    fn tile(&self, dev: &Device) -> flash_attn_kernels::config::DecodeTile {
        self.row.tile(dev.arch())
    }

    /// [`decode_splits`] for `[batch, heads_q, heads_kv, seqlen_q]` over at most `max_keys`
    /// keys ([`Self::occupancy`]).
    fn auto_splits(&self, dev: &Device, sizes: [usize; 4], max_keys: usize) -> Result<usize> {
        Ok(splits_on(dev, self.occupancy(dev, sizes)?, max_keys))
    }

    /// The blocks `dev` holds at once (the driver's occupancy) and the unsplit call's blocks
    /// (batch, KV head, row tile) for `[batch, heads_q, heads_kv, seqlen_q]`.
    fn occupancy(&self, dev: &Device, [b, hq, hkv, nq]: [usize; 4]) -> Result<(usize, usize)> {
        let tile = self.tile(dev);
        let blocks = b * hkv * (hq / hkv * nq).div_ceil(tile.block_m());
        let resident = dev.resident_blocks(self.name, tile.threads() as u32, tile.smem_bytes())?;
        Ok((resident, blocks))
    }
}

/// The number of key splits [`attn_with_kvcache`] picks by itself for `T`, a head dim and
/// `[batch, heads_q, heads_kv, new queries]` over at most `max_keys` keys (for benchmarks and
/// logs).
pub fn auto_decode_splits<T: Element>(
    dev: &Device,
    head_dim: usize,
    sizes: [usize; 4],
    max_keys: usize,
) -> Result<usize> {
    decode_kernel::<T>(head_dim, MaskKind::Causal)?.auto_splits(dev, sizes, max_keys)
}

/// Everything [`run_decode`] needs besides O and LSE.
struct LaunchArgs<'a, T> {
    q: &'a DeviceTensor<T>,
    k: TensorRef,
    v: TensorRef,
    kv: KvLayout,
    dims: SeqDims,
    head_dim: usize,
    scale_log2: f32,
    mask: MaskArgs,
    splits: Splits,
}

/// Launches the decode kernel (and the combine when the keys are split), handling unaligned
/// Q and O through padded copies.
fn run_decode<T: Element>(
    dev: &Device,
    kernel: DecodeKernel,
    a: &LaunchArgs<'_, T>,
    o: &mut DeviceTensor<T>,
    lse: &mut DeviceTensor<f32>,
) -> Result<()> {
    let tile = kernel.tile(dev);
    let padded_d = a.dims.head_dim as usize;
    let q_packed = packed_input(dev, a.q, padded_d)?;
    let o_packed = packed_output(dev, o, padded_d)?;
    let (b, hq, nq) = (
        a.dims.batch as usize,
        a.dims.heads_q as usize,
        a.dims.seqlen_q as usize,
    );
    let rows = hq / a.dims.heads_kv as usize * nq;
    let row_tiles = rows.div_ceil(tile.block_m());
    let splits = a.splits.count;
    let part_rows = splits
        .checked_mul(b * hq * nq)
        .filter(|&n| n.checked_mul(padded_d).is_some_and(|e| e < (1 << 40)))
        .ok_or_else(|| FlashError::TooLarge("decode partial outputs overflow".into()))?;
    let (o_part, lse_part) = if splits > 1 {
        (
            Some(DeviceTensor::<f32>::uninit(dev, &[part_rows, padded_d])?),
            Some(DeviceTensor::<f32>::uninit(dev, &[part_rows])?),
        )
    } else {
        (None, None)
    };
    let grid_x = splits
        .checked_mul(row_tiles)
        .filter(|&x| x <= i32::MAX as usize)
        .ok_or_else(|| FlashError::TooLarge("decode grid overflows".into()))?;
    let p = DecodeParams {
        q: operand(dev, a.q, &q_packed),
        k: a.k,
        v: a.v,
        o: operand(dev, o, &o_packed),
        lse: stats(dev, lse),
        dims: a.dims,
        scale_log2: a.scale_log2,
        mask: a.mask,
        kv: a.kv,
        o_part: o_part.as_ref().map_or(0, |t| t.device_address(dev)),
        lse_part: lse_part.as_ref().map_or(0, |t| t.device_address(dev)),
        num_splits: splits as u32,
        split_keys: a.splits.keys as u32,
        row_tiles: row_tiles as u32,
    };
    // SAFETY: every address and stride in `p` comes from live, validated tensors; the
    // partials cover `splits × B × Hq × Nq` rows; grid, block and shared memory are the tile's.
    unsafe {
        launch(
            dev,
            Order::Stream,
            kernel.name,
            (grid_x as u32, a.dims.heads_kv, a.dims.batch),
            tile.threads() as u32,
            tile.smem_bytes(),
            p,
        )?
    };
    if splits > 1 {
        let c = CombineParams {
            o: p.o,
            lse: p.lse,
            dims: a.dims,
            num_splits: splits as u32,
            o_part: p.o_part,
            lse_part: p.lse_part,
            ..CombineParams::default()
        };
        let name = registry::DECODE_COMBINE_KERNELS[T::DTYPE.kernel()? as usize];
        launch_combine(dev, name, b * hq * nq, padded_d, c)?;
    }
    if let Some(packed) = &o_packed {
        scatter_output(dev, o, packed, a.head_dim, padded_d)?;
    }
    Ok(())
}

/// Launches a combine or merge kernel over `rows` output rows of `head_dim` (padded)
/// columns: one warp per row and 64-column chunk.
fn launch_combine(
    dev: &Device,
    name: &'static str,
    rows: usize,
    head_dim: usize,
    p: CombineParams,
) -> Result<()> {
    let warps = rows * head_dim.div_ceil(64);
    let blocks = warps.div_ceil(COMBINE_THREADS / 32);
    if blocks > i32::MAX as usize {
        return Err(FlashError::TooLarge(format!("{rows} rows to merge")));
    }
    // SAFETY: `p` describes live outputs and states of `rows` rows.
    unsafe {
        launch(
            dev,
            Order::Stream,
            name,
            (blocks as u32, 1, 1),
            COMBINE_THREADS as u32,
            0,
            p,
        )
    }
}

/// The kernel's view of an f32 `[B, H, N]` statistics tensor.
fn stats(dev: &Device, t: &DeviceTensor<f32>) -> RowStatsRef {
    RowStatsRef {
        ptr: t.device_address(dev),
        batch_stride: t.strides()[0] as u64,
        head_stride: t.strides()[1] as u64,
    }
}

/// A tensor's address and strides as they are (no padded copy: the append kernel takes any
/// layout).
fn raw_operand<T: Element>(dev: &Device, t: &DeviceTensor<T>) -> TensorRef {
    operand(dev, t, &None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checked_block_table_names_pages_of_its_pool_only() {
        let t = HostBlockTable::checked(&[3, 0, 2, 1], 4).unwrap();
        assert_eq!(t.entries(), &[3, 0, 2, 1]);
        assert!(t.known_within(4) && t.known_within(9) && !t.known_within(3));
        let e = HostBlockTable::checked(&[3, 0, 4, 1], 4).unwrap_err();
        assert!(e.to_string().contains("entry 2 = 4"), "{e}");
        assert!(HostBlockTable::checked(&[0, -2], 4).is_err());
        assert!(HostBlockTable::checked(&[], 0).is_ok());
        let unchecked = HostBlockTable::from(&[7, 8][..]);
        assert!(!unchecked.known_within(usize::MAX));
    }
}
