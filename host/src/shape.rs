//! Shapes of an attention call, checked once for every backend.
//!
//! Q is `[batch, seqlen_q, heads_q, head_dim]`, K and V are `[batch, seqlen_k, heads_kv,
//! head_dim]`, O has Q's shape and LSE is `[batch, heads_q, seqlen_q]`. [`check_shapes`] turns
//! the three input shapes into an [`AttnShape`] or a typed error; backend-specific limits (the
//! GPU's head dim ≤ 256, layouts) are checked by the backends themselves, and so are the byte
//! sizes of outputs (the CPU backend allocates fallibly, see [`crate::cpu`]).

use crate::error::{FlashError, Result};
use flash_attn_kernels::params::SeqDims;

/// The sizes of one attention call, validated by [`check_shapes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnShape {
    /// Batch size `B`.
    pub batch: usize,
    /// Query sequence length `Nq`.
    pub seqlen_q: usize,
    /// Key / value sequence length `Nk`.
    pub seqlen_k: usize,
    /// Query heads `Hq`.
    pub heads_q: usize,
    /// Key / value heads `Hkv`; divides `Hq` (grouped-query attention).
    pub heads_kv: usize,
    /// Head dim `d` of Q, K and V.
    pub head_dim: usize,
}

/// The largest sequence length, head count or batch size: the kernels count in `i32`.
pub const MAX_DIM: usize = i32::MAX as usize;

impl AttnShape {
    /// The sizes as the kernels' launch parameters take them, with `padded_d`, the head dim
    /// the kernels index by (the call's, rounded up to a multiple of 8).
    pub(crate) fn seq_dims(&self, padded_d: usize) -> SeqDims {
        SeqDims {
            batch: self.batch as u32,
            heads_q: self.heads_q as u32,
            heads_kv: self.heads_kv as u32,
            seqlen_q: self.seqlen_q as u32,
            seqlen_k: self.seqlen_k as u32,
            head_dim: padded_d as u32,
        }
    }

    /// Query heads that share one key/value head (`Hq / Hkv`).
    pub fn group_size(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// The key/value head that query head `h` reads.
    pub fn kv_head(&self, h: usize) -> usize {
        h / self.group_size()
    }

    /// The shape of Q and of the output O: `[B, Nq, Hq, d]`.
    pub fn q_dims(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim]
    }

    /// The shape of K and of V: `[B, Nk, Hkv, d]`.
    pub fn kv_dims(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim]
    }

    /// The shape of the log-sum-exp output: `[B, Hq, Nq]`.
    pub fn lse_dims(&self) -> [usize; 3] {
        [self.batch, self.heads_q, self.seqlen_q]
    }

    /// Checks the shapes of caller-provided outputs O and LSE.
    pub fn check_outputs(&self, o: &[usize; 4], lse: &[usize; 3]) -> Result<()> {
        if *o != self.q_dims() {
            return Err(FlashError::Shape(format!(
                "output O is {o:?}, expected {:?} (the shape of Q)",
                self.q_dims()
            )));
        }
        if *lse != self.lse_dims() {
            return Err(FlashError::Shape(format!(
                "output LSE is {lse:?}, expected {:?} ([batch, heads_q, seqlen_q])",
                self.lse_dims()
            )));
        }
        Ok(())
    }

    /// Checks the extra inputs of the backward pass: the forward's output O and the incoming
    /// gradient dO have Q's shape, the forward's LSE is `[B, Hq, Nq]`.
    pub fn check_backward_inputs(
        &self,
        o: &[usize; 4],
        d_o: &[usize; 4],
        lse: &[usize; 3],
    ) -> Result<()> {
        expect_dims("O", o, &self.q_dims(), "the shape of Q")?;
        expect_dims("dO", d_o, &self.q_dims(), "the shape of Q")?;
        expect_dims("LSE", lse, &self.lse_dims(), "[batch, heads_q, seqlen_q]")
    }

    /// Checks the shapes of caller-provided gradients: dQ like Q, dK and dV like K and V.
    pub fn check_gradients(&self, dq: &[usize; 4], dk: &[usize; 4], dv: &[usize; 4]) -> Result<()> {
        expect_dims("gradient dQ", dq, &self.q_dims(), "the shape of Q")?;
        expect_dims("gradient dK", dk, &self.kv_dims(), "the shape of K")?;
        expect_dims("gradient dV", dv, &self.kv_dims(), "the shape of V")
    }
}

/// A [`FlashError::Shape`] naming `what` unless `got` is `want` (described as `like`).
fn expect_dims(what: &str, got: &[usize], want: &[usize], like: &str) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(FlashError::Shape(format!(
        "{what} is {got:?}, expected {want:?} ({like})"
    )))
}

/// Validates the shapes of Q, K and V and returns the sizes of the call.
///
/// Errors: [`FlashError::Shape`] when K and V differ, when the batch or head dim of Q and K
/// differ, or when the head dim, the batch, a sequence length or a head count is 0;
/// [`FlashError::GqaRatio`] when `Hq % Hkv != 0`; [`FlashError::TooLarge`] for a size above
/// [`MAX_DIM`].
pub fn check_shapes(q: &[usize; 4], k: &[usize; 4], v: &[usize; 4]) -> Result<AttnShape> {
    let [batch, seqlen_q, heads_q, head_dim] = *q;
    let [batch_k, seqlen_k, heads_kv, head_dim_k] = *k;
    if k != v {
        return Err(FlashError::Shape(format!(
            "K {k:?} and V {v:?} must have the same shape"
        )));
    }
    if batch_k != batch {
        return Err(FlashError::Shape(format!(
            "Q has batch {batch}, K and V have batch {batch_k}"
        )));
    }
    if head_dim_k != head_dim {
        return Err(FlashError::Shape(format!(
            "Q has head dim {head_dim}, K and V have head dim {head_dim_k}"
        )));
    }
    if head_dim == 0 {
        return Err(FlashError::Shape(format!(
            "head dim is 0 (Q {q:?}): it must be ≥ 1"
        )));
    }
    let empty = [
        ("batch", batch),
        ("seqlen_q", seqlen_q),
        ("seqlen_k", seqlen_k),
        ("heads_q", heads_q),
        ("heads_kv", heads_kv),
    ];
    if let Some((name, _)) = empty.into_iter().find(|&(_, n)| n == 0) {
        return Err(FlashError::Shape(format!(
            "{name} is 0 (Q {q:?}, K {k:?}): batch, sequence lengths and heads must be ≥ 1"
        )));
    }
    if heads_q % heads_kv != 0 {
        return Err(FlashError::GqaRatio { heads_q, heads_kv });
    }
    let sizes = [
        ("batch", batch),
        ("seqlen_q", seqlen_q),
        ("seqlen_k", seqlen_k),
        ("heads_q", heads_q),
    ];
    if let Some((name, n)) = sizes.into_iter().find(|&(_, n)| n > MAX_DIM) {
        return Err(FlashError::TooLarge(format!(
            "{name} = {n} exceeds {MAX_DIM}"
        )));
    }
    Ok(AttnShape {
        batch,
        seqlen_q,
        seqlen_k,
        heads_q,
        heads_kv,
        head_dim,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_page_outside_the_pool_is_found() {
        assert_eq!(first_bad_page(&[], 4), None);
        assert_eq!(first_bad_page(&[0, 3, 1, 2], 4), None);
        assert_eq!(first_bad_page(&[0, 3, 4, -1], 4), Some((2, 4)));
        assert_eq!(first_bad_page(&[0, 3, -1, 4], 4), Some((2, -1)));
        assert_eq!(first_bad_page(&[i32::MIN], 4), Some((0, i32::MIN)));
        assert_eq!(first_bad_page(&[i32::MAX - 1], i32::MAX as usize), None);
        assert_eq!(first_bad_page(&[i32::MAX, -1], usize::MAX), Some((1, -1)));
        assert_eq!(first_bad_page(&[i32::MIN], 1 << 40), Some((0, i32::MIN)));
        // Long rows, as the vectorised pass sees them.
        let mut row: Vec<i32> = (0..10_000).map(|i| i % 4096).collect();
        assert_eq!(first_bad_page(&row, 4096), None);
        row[9_999] = 4096;
        assert_eq!(first_bad_page(&row, 4096), Some((9_999, 4096)));
        row[5_000] = -7;
        assert_eq!(first_bad_page(&row, 4096), Some((5_000, -7)));
    }

    #[test]
    fn accepts_gqa_and_reports_sizes() {
        let s = check_shapes(&[2, 7, 6, 40], &[2, 13, 2, 40], &[2, 13, 2, 40]).unwrap();
        assert_eq!(s.group_size(), 3);
        assert_eq!(
            (0..6).map(|h| s.kv_head(h)).collect::<Vec<_>>(),
            [0, 0, 0, 1, 1, 1]
        );
        assert_eq!(s.q_dims(), [2, 7, 6, 40]);
        assert_eq!(s.kv_dims(), [2, 13, 2, 40]);
        assert_eq!(s.lse_dims(), [2, 6, 7]);
        assert!(s.check_outputs(&[2, 7, 6, 40], &[2, 6, 7]).is_ok());
        assert!(matches!(
            s.check_outputs(&[2, 7, 6, 40], &[2, 7, 6]),
            Err(FlashError::Shape(_))
        ));
    }

    #[test]
    fn rejects_each_invalid_shape_with_its_variant() {
        let kv = [1, 4, 1, 8];
        let shape = |q: [usize; 4], k: [usize; 4], v: [usize; 4]| check_shapes(&q, &k, &v);
        assert!(matches!(
            shape([1, 4, 1, 8], kv, [1, 5, 1, 8]),
            Err(FlashError::Shape(_))
        ));
        assert!(matches!(
            shape([2, 4, 1, 8], kv, kv),
            Err(FlashError::Shape(_))
        ));
        assert!(matches!(
            shape([1, 4, 1, 9], kv, kv),
            Err(FlashError::Shape(_))
        ));
        assert!(matches!(
            shape([1, 4, 1, 0], [1, 4, 1, 0], [1, 4, 1, 0]),
            Err(FlashError::Shape(m)) if m.contains("head dim is 0")
        ));
        assert!(matches!(
            shape([1, 4, 3, 8], [1, 4, 2, 8], [1, 4, 2, 8]),
            Err(FlashError::GqaRatio { .. })
        ));
        assert!(matches!(
            shape([1, 4, 1, 8], [1, 4, 0, 8], [1, 4, 0, 8]),
            Err(FlashError::Shape(m)) if m.contains("heads_kv is 0")
        ));
        assert!(matches!(
            shape([1, 4, 0, 8], [1, 4, 0, 8], [1, 4, 0, 8]),
            Err(FlashError::Shape(m)) if m.contains("heads_q is 0")
        ));
        assert!(matches!(
            shape([0, 4, 1, 8], [0, 4, 1, 8], [0, 4, 1, 8]),
            Err(FlashError::Shape(_))
        ));
        assert!(matches!(
            shape([1, 0, 1, 8], kv, kv),
            Err(FlashError::Shape(_))
        ));
        assert!(matches!(
            shape([1, 4, 1, 8], [1, 0, 1, 8], [1, 0, 1, 8]),
            Err(FlashError::Shape(_))
        ));
        let huge = MAX_DIM + 1;
        assert!(matches!(
            shape([1, huge, 1, 8], kv, kv),
            Err(FlashError::TooLarge(_))
        ));
    }
}

/// The sizes of a decode call over a KV cache (GPU and CPU alike); see
/// [`check_decode_shapes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DecodeShape {
    pub batch: usize,
    pub seqlen_q: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// Keys per page (0: contiguous cache).
    pub page_size: usize,
    /// Pages in the pool (paged), or batch entries of the cache (contiguous).
    pub entries: usize,
    /// Keys the cache holds per sequence.
    pub capacity: usize,
    /// New keys appended per sequence.
    pub appended: usize,
}

/// Checks the shapes of a decode call: Q `[B, Nq, Hq, d]`, the K and V caches (`[B, capacity,
/// Hkv, d]`, or `[pages, page_size, Hkv, d]` with a block table `[B, max_pages]`), `seqlens_len`
/// lengths and the new keys and values `[B, N_new, Hkv, d]`.
pub(crate) fn check_decode_shapes(
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    seqlens_len: usize,
    table: Option<[usize; 2]>,
    new_kv: Option<([usize; 4], [usize; 4])>,
) -> Result<DecodeShape> {
    let [batch, seqlen_q, heads_q, head_dim] = q;
    if k != v {
        return Err(FlashError::Shape(format!(
            "K cache {k:?} and V cache {v:?} must have the same shape"
        )));
    }
    let [entries, rows, heads_kv, head_dim_k] = k;
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
    if heads_q % heads_kv != 0 {
        return Err(FlashError::GqaRatio { heads_q, heads_kv });
    }
    if seqlens_len != batch {
        return Err(FlashError::Shape(format!(
            "cache_seqlens is [{seqlens_len}], expected [{batch}] (one length per sequence)"
        )));
    }
    let (page_size, capacity) = match table {
        None => {
            if entries != batch {
                return Err(FlashError::Shape(format!(
                    "the KV cache has batch {entries}, Q has batch {batch} (a paged cache needs a block table)"
                )));
            }
            (0, rows)
        }
        Some([tb, max_pages]) => {
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
            let capacity = max_pages.checked_mul(rows).ok_or_else(|| {
                FlashError::TooLarge("block_table pages × page size overflows".into())
            })?;
            (rows, capacity)
        }
    };
    let appended = match new_kv {
        None => 0,
        Some((kn, vn)) => {
            if kn != vn || kn[0] != batch || kn[2] != heads_kv || kn[3] != head_dim || kn[1] == 0 {
                return Err(FlashError::Shape(format!(
                    "k_new {kn:?} and v_new {vn:?} must both be [{batch}, N_new ≥ 1, {heads_kv}, {head_dim}]"
                )));
            }
            kn[1]
        }
    };
    Ok(DecodeShape {
        batch,
        seqlen_q,
        heads_q,
        heads_kv,
        head_dim,
        page_size,
        entries,
        capacity,
        appended,
    })
}

/// Checks the cache lengths of a decode call against its shape, and (paged) every page the
/// lengths reach against the pool (`table`: the block table, row-major `[batch, max_pages]`;
/// empty for a contiguous cache); calls `each(b, keys)` with the keys sequence `b` attends to
/// (cached + appended), which must be at least `min_keys` (a tree mask's drafts).
/// `table_checked`: every entry of `table` is already known to name a page of the pool
/// ([`crate::HostBlockTable::checked`]), so the pages are not checked again.
pub(crate) fn check_decode_lengths(
    shape: &DecodeShape,
    lens: &[i32],
    min_keys: usize,
    table: &[i32],
    table_checked: bool,
    mut each: impl FnMut(usize, usize) -> Result<()>,
) -> Result<()> {
    let (appended, capacity) = (shape.appended, shape.capacity);
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
        // The table holds `capacity / page_size` pages per sequence (checked).
        let max_pages = shape.capacity.checked_div(shape.page_size);
        if let Some(max_pages) = max_pages.filter(|_| !table_checked) {
            let row = &table[b * max_pages..][..keys.div_ceil(shape.page_size)];
            if let Some((slot, p)) = first_bad_page(row, shape.entries) {
                return Err(FlashError::Shape(format!(
                    "block_table[{b}, {slot}] = {p} is not a page of the cache (0..{})",
                    shape.entries
                )));
            }
        }
        if keys < min_keys {
            return Err(FlashError::Shape(format!(
                "sequence {b} attends to {keys} keys, fewer than the {min_keys} drafts of its tree mask"
            )));
        }
        each(b, keys)?;
    }
    Ok(())
}

/// The first entry of `pages` outside `0..entries`, as `(index, page)`. One branch-free pass
/// first (negative pages read as large unsigned ones), which the compiler vectorises even for
/// baseline x86-64: the block table of a large batch has ~10⁵–10⁶ entries, checked on every
/// call (524K entries: 34 µs on this pass, 130 µs with an unsigned maximum, which SSE2 lacks).
pub(crate) fn first_bad_page(pages: &[i32], entries: usize) -> Option<(usize, i32)> {
    // At most 2³¹: every negative page stays at or above it.
    let limit = entries.min(1 << 31) as u32;
    if pages
        .iter()
        .fold(0u32, |bad, &p| bad | (p as u32 >= limit) as u32)
        == 0
    {
        return None;
    }
    pages
        .iter()
        .position(|&p| p < 0 || p as usize >= entries)
        .map(|i| (i, pages[i]))
}
