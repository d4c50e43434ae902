//! Per-sequence lengths of a batch, in one place for every backend: packed variable-length
//! batches ([`Varlen`], FlashAttention's `cu_seqlens` layout) and key padding of a padded
//! batch ([`AttnParams::seqlens_k`]). Validation of the lengths, the sequences' row spans
//! ([`SeqSpan`]: what the CPU backend and the references run sequence by sequence), and the
//! GPU launches they take (`SeqRun`: one per run of consecutive sequences of equal lengths).

use std::borrow::Cow;
use std::ops::Range;

use flash_attn_kernels::params::{DropoutArgs, MaskArgs, RowStatsRef, SeqDims, Strides, TensorRef};

use crate::device::Device;
use crate::error::{FlashError, Result};
use crate::params::AttnParams;
use crate::shape::MAX_DIM;
use crate::tensor::DeviceTensor;

/// A packed batch of variable-length sequences on the GPU (FlashAttention's varlen API): Q is
/// `[total_q, Hq, d]` and K, V are `[total_k, Hkv, d]`; sequence `b` is Q rows
/// `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]` and K/V rows `cu_seqlens_k[b] ..
/// cu_seqlens_k[b + 1]`. The prefix sums are i32 `[B + 1]` on the device: they start at 0,
/// never decrease and end at the total; sequences of length 0 are allowed. Masks apply per
/// sequence (causal and windows bottom-right aligned within each). LSE is `[Hq, total_q]`.
#[derive(Clone, Copy)]
pub struct Varlen<'a> {
    /// Query prefix sums `[B + 1]`, i32.
    pub cu_seqlens_q: &'a DeviceTensor<i32>,
    /// Key prefix sums `[B + 1]`, i32.
    pub cu_seqlens_k: &'a DeviceTensor<i32>,
    /// The same prefix sums in host memory, when the caller has them: the call validates
    /// them instead of copying the device tensors back (no synchronisation). The launches
    /// follow the validated host values (the kernels take the lengths from the host), so the
    /// tensors are never read or written outside their validated rows; the caller vouches
    /// that the copy equals the device tensors (where it does not, results follow the copy).
    pub host: Option<HostVarlen<'a>>,
}

/// A host copy of a [`Varlen`] batch's prefix sums (see [`Varlen::host`]).
#[derive(Clone, Copy, Debug)]
pub struct HostVarlen<'a> {
    /// `cu_seqlens_q`, `[B + 1]`.
    pub cu_seqlens_q: &'a [i32],
    /// `cu_seqlens_k`, `[B + 1]`.
    pub cu_seqlens_k: &'a [i32],
}

/// Validated prefix sums of a varlen batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VarlenLens<'a> {
    /// Query prefix sums `[B + 1]`.
    pub cu_q: Cow<'a, [i32]>,
    /// Key prefix sums `[B + 1]`.
    pub cu_k: Cow<'a, [i32]>,
    /// The longest query sequence.
    pub max_q: usize,
    /// The longest key sequence.
    pub max_k: usize,
}

impl<'a> VarlenLens<'a> {
    /// Checks prefix sums for packed tensors of `total_q` query rows and `total_k` key rows:
    /// both `[B + 1]` with `B ≥ 1`, starting at 0, never decreasing, ending at the totals.
    /// Errors: [`FlashError::Shape`]; [`FlashError::TooLarge`] for totals past `i32`.
    pub fn check(
        cu_q: Cow<'a, [i32]>,
        cu_k: Cow<'a, [i32]>,
        total_q: usize,
        total_k: usize,
    ) -> Result<Self> {
        if cu_q.len() != cu_k.len() || cu_q.len() < 2 {
            return Err(FlashError::Shape(format!(
                "cu_seqlens_q has {} entries and cu_seqlens_k {}: both must be [batch + 1] with batch ≥ 1",
                cu_q.len(),
                cu_k.len()
            )));
        }
        let max_q = check_prefix_sums("cu_seqlens_q", &cu_q, total_q)?;
        let max_k = check_prefix_sums("cu_seqlens_k", &cu_k, total_k)?;
        Ok(Self {
            cu_q,
            cu_k,
            max_q,
            max_k,
        })
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.cu_q.len() - 1
    }

    /// Every sequence's rows: entry 0 of the packed tensors (viewed as `[1, total, H, d]`).
    pub fn spans(&self) -> Vec<SeqSpan> {
        let range = |cu: &[i32], b: usize| cu[b] as usize..cu[b + 1] as usize;
        (0..self.batch())
            .map(|b| SeqSpan {
                seq: b,
                entry: 0,
                q: range(&self.cu_q, b),
                k: range(&self.cu_k, b),
            })
            .collect()
    }
}

/// Checks one prefix-sum array against its tensor's `total` rows; returns the longest
/// sequence.
fn check_prefix_sums(name: &str, cu: &[i32], total: usize) -> Result<usize> {
    if total > MAX_DIM {
        return Err(FlashError::TooLarge(format!(
            "{name}: {total} packed rows exceed {MAX_DIM}"
        )));
    }
    if cu[0] != 0 {
        return Err(FlashError::Shape(format!(
            "{name}[0] = {}, expected 0",
            cu[0]
        )));
    }
    let mut longest = 0;
    for (b, pair) in cu.windows(2).enumerate() {
        if pair[1] < pair[0] {
            return Err(FlashError::Shape(format!(
                "{name} decreases at entry {}: {} < {}",
                b + 1,
                pair[1],
                pair[0]
            )));
        }
        longest = longest.max((pair[1] - pair[0]) as usize);
    }
    let last = *cu.last().expect("at least two entries");
    if last as usize != total {
        return Err(FlashError::Shape(format!(
            "{name} ends at {last}, but the packed tensor has {total} rows"
        )));
    }
    Ok(longest)
}

/// One sequence of a call as the CPU backend runs it: batch entry `entry` of the (padded or
/// `[1, total, H, d]`-viewed packed) tensors, its query rows `q` and the key rows `k` it
/// attends to. Sequence `seq` picks its per-sequence options ([`AttnParams::for_entry`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    /// Sequence index (batch entry of a padded batch, or position in the varlen batch).
    pub seq: usize,
    /// Batch entry of the tensors that holds it.
    pub entry: usize,
    /// Query rows.
    pub q: Range<usize>,
    /// Key and value rows.
    pub k: Range<usize>,
}

impl AttnParams<'_> {
    /// Checks that these options suit a varlen batch (every backend): no key lengths (its
    /// `cu_seqlens_k` give every sequence's keys), no block or tree mask. Errors:
    /// [`FlashError::Param`].
    pub fn check_varlen_options(&self) -> Result<()> {
        if self.seqlens_k.is_some() {
            return Err(FlashError::Param(
                "seqlens_k (key padding of a padded batch) cannot be combined with a varlen batch: cu_seqlens_k gives every sequence's keys".into(),
            ));
        }
        if self.block_mask.is_some() || self.tree_mask.is_some() {
            return Err(FlashError::Param(
                "a block mask or a tree mask cannot be combined with a varlen batch".into(),
            ));
        }
        Ok(())
    }

    /// Checks the key lengths of a padded batch of `batch` entries of `seqlen_k` keys: one
    /// per entry, each in `0 ..= seqlen_k`. Errors: [`FlashError::Shape`].
    pub fn check_key_lengths(&self, batch: usize, seqlen_k: usize) -> Result<()> {
        let Some(lens) = self.seqlens_k else {
            return Ok(());
        };
        if lens.len() != batch {
            return Err(FlashError::Shape(format!(
                "seqlens_k has {} values, expected {batch} (one per batch entry)",
                lens.len()
            )));
        }
        if let Some((b, &len)) = lens
            .iter()
            .enumerate()
            .find(|&(_, &l)| l < 0 || l as usize > seqlen_k)
        {
            return Err(FlashError::Shape(format!(
                "seqlens_k[{b}] = {len} is not in 0..={seqlen_k} (the keys of the batch)"
            )));
        }
        Ok(())
    }

    /// The sequences of a padded batch with these options' key lengths, or `None` without
    /// key padding (every entry sees all its keys).
    pub(crate) fn key_padding_spans(
        &self,
        batch: usize,
        seqlen_q: usize,
        seqlen_k: usize,
    ) -> Result<Option<Vec<SeqSpan>>> {
        self.check_key_lengths(batch, seqlen_k)?;
        Ok(self.seqlens_k.map(|lens| {
            lens.iter()
                .enumerate()
                .map(|(b, &len)| SeqSpan {
                    seq: b,
                    entry: b,
                    q: 0..seqlen_q,
                    k: 0..len as usize,
                })
                .collect()
        }))
    }
}

/// One launch of the batched GPU kernels: sequences `first .. first + count` of a call, all
/// of `len_q` queries and `len_k` keys, at a constant distance from each other in every
/// tensor (consecutive entries of a padded batch, or consecutive packed sequences of equal
/// lengths). The kernels take per-call lengths, so a call whose sequences differ runs one
/// launch per run of equal lengths (see docs/design.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SeqRun {
    /// First sequence (its index selects per-sequence ALiBi slopes).
    pub first: usize,
    /// Sequences in the run (the launch's batch).
    pub count: usize,
    /// Batch entry of the first sequence (padded tensors; 0 when packed).
    pub entry: usize,
    /// First query row of the first sequence (packed tensors; 0 when padded).
    pub q_start: usize,
    /// First key row of the first sequence (packed tensors; when padded, 0, or the first key
    /// past an entry's length for a run of those keys alone).
    pub k_start: usize,
    /// Queries per sequence.
    pub len_q: usize,
    /// Keys per sequence.
    pub len_k: usize,
    /// Whether the tensors are packed (`[total, H, d]`): sequences `len` rows apart, not one
    /// batch entry apart.
    pub packed: bool,
}

impl SeqRun {
    /// The runs of `spans` (in order), packed or padded.
    pub(crate) fn group(spans: &[SeqSpan], packed: bool) -> Vec<SeqRun> {
        let mut runs: Vec<SeqRun> = Vec::new();
        for s in spans {
            let (len_q, len_k) = (s.q.len(), s.k.len());
            if let Some(r) = runs.last_mut() {
                let next = r.first + r.count == s.seq;
                let same = r.len_q == len_q && r.len_k == len_k;
                let spaced = if packed {
                    s.q.start == r.q_start + r.count * len_q
                        && s.k.start == r.k_start + r.count * len_k
                } else {
                    s.entry == r.entry + r.count && s.q.start == 0 && s.k.start == 0
                };
                if next && same && spaced {
                    r.count += 1;
                    continue;
                }
            }
            runs.push(SeqRun {
                first: s.seq,
                count: 1,
                entry: s.entry,
                q_start: s.q.start,
                k_start: s.k.start,
                len_q,
                len_k,
                packed,
            });
        }
        runs
    }

    /// The run of a padded batch whose entries all see every key: the whole call.
    pub(crate) fn whole(shape: &crate::shape::AttnShape) -> SeqRun {
        SeqRun {
            first: 0,
            count: shape.batch,
            entry: 0,
            q_start: 0,
            k_start: 0,
            len_q: shape.seqlen_q,
            len_k: shape.seqlen_k,
            packed: false,
        }
    }

    /// A query-side (`query = true`: Q, O, dO, dQ) or key-side (K, V, dK, dV) tensor of 16-bit
    /// elements, as the run's launch sees it.
    pub(crate) fn tensor(&self, t: TensorRef, query: bool) -> TensorRef {
        let (start, len) = match query {
            true => (self.q_start, self.len_q),
            false => (self.k_start, self.len_k),
        };
        let s = t.strides;
        let offset = self.entry as u64 * s.batch + start as u64 * s.row;
        TensorRef {
            ptr: t.ptr + 2 * offset,
            strides: Strides {
                batch: if self.packed {
                    len as u64 * s.row
                } else {
                    s.batch
                },
                ..s
            },
        }
    }

    /// An f32 per-row statistic (LSE, D) as the run's launch sees it.
    pub(crate) fn stats(&self, t: RowStatsRef) -> RowStatsRef {
        let offset = self.entry as u64 * t.batch_stride + self.q_start as u64;
        RowStatsRef {
            ptr: t.ptr + 4 * offset,
            batch_stride: if self.packed {
                self.len_q as u64
            } else {
                t.batch_stride
            },
            head_stride: t.head_stride,
        }
    }

    /// The mask arguments of the run: per-sequence ALiBi slopes and block-mask rows from its
    /// first sequence.
    pub(crate) fn mask(&self, args: MaskArgs) -> MaskArgs {
        let from = |ptr: u64, stride: u32| match ptr {
            0 => 0,
            ptr => ptr + 4 * self.first as u64 * u64::from(stride),
        };
        MaskArgs {
            alibi_slopes: from(args.alibi_slopes, args.alibi_batch_stride),
            mask_bits: from(args.mask_bits, args.bits_batch_stride),
            ..args
        }
    }

    /// Dropout's arguments for the run's launch (its first sequence is `first` of the call);
    /// the defaults, which no kernel without dropout reads, when `dropout` is `None`.
    pub(crate) fn dropout(&self, dropout: Option<crate::params::Dropout>) -> DropoutArgs {
        dropout.map_or(DropoutArgs::default(), |d| d.args(self.first))
    }

    /// The launch's sizes for a call of `shape` (heads and head dim) with the kernels' head
    /// dim `padded_d`.
    pub(crate) fn dims(&self, shape: &crate::shape::AttnShape, padded_d: usize) -> SeqDims {
        SeqDims {
            batch: self.count as u32,
            seqlen_q: self.len_q as u32,
            seqlen_k: self.len_k as u32,
            ..shape.seq_dims(padded_d)
        }
    }
}

/// The launches of a GPU call: per run of sequences of a varlen batch's validated lengths or
/// of a padded batch's key lengths (plus, for the latter, the keys past each entry's length),
/// or the whole call.
pub(crate) fn gpu_runs(
    shape: &crate::shape::AttnShape,
    params: &AttnParams,
    varlen: Option<&VarlenLens>,
) -> Result<Vec<SeqRun>> {
    Ok(match varlen {
        Some(lens) => SeqRun::group(&lens.spans(), true),
        None => match params.key_padding_spans(shape.batch, shape.seqlen_q, shape.seqlen_k)? {
            Some(spans) => {
                // The keys past each entry's length, as runs without queries: the backward
                // writes their dK = dV = 0 (the forward launches nothing for them).
                let tails = spans
                    .iter()
                    .filter(|s| s.k.end < shape.seqlen_k)
                    .map(|s| SeqRun {
                        first: s.seq,
                        count: 1,
                        entry: s.entry,
                        q_start: 0,
                        k_start: s.k.end,
                        len_q: 0,
                        len_k: shape.seqlen_k - s.k.end,
                        packed: false,
                    });
                let mut runs = SeqRun::group(&spans, false);
                runs.extend(tails);
                runs
            }
            None => vec![SeqRun::whole(shape)],
        },
    })
}

impl<'a> Varlen<'a> {
    /// The validated prefix sums for packed tensors of `total_q` and `total_k` rows: the host
    /// copy, or the device tensors read back (one small blocking copy each). Checks the
    /// tensors' shapes (`[B + 1]`, on `dev`'s context) first.
    pub(crate) fn lens(
        &self,
        dev: &Device,
        total_q: usize,
        total_k: usize,
    ) -> Result<VarlenLens<'a>> {
        for (name, t) in [
            ("cu_seqlens_q", self.cu_seqlens_q),
            ("cu_seqlens_k", self.cu_seqlens_k),
        ] {
            if t.shape().len() != 1 {
                return Err(FlashError::Shape(format!(
                    "{name} must have rank 1 ([batch + 1]), got shape {:?}",
                    t.shape()
                )));
            }
            if !std::sync::Arc::ptr_eq(t.context(), dev.context()) {
                return Err(FlashError::DeviceMismatch(format!(
                    "{name} belongs to another device or context"
                )));
            }
            if t.strides()[0] != 1 {
                return Err(FlashError::Layout(format!("{name} must be contiguous")));
            }
        }
        let (cu_q, cu_k) = match self.host {
            Some(h) => {
                for (name, host, t) in [
                    ("cu_seqlens_q", h.cu_seqlens_q, self.cu_seqlens_q),
                    ("cu_seqlens_k", h.cu_seqlens_k, self.cu_seqlens_k),
                ] {
                    if host.len() != t.shape()[0] {
                        return Err(FlashError::Shape(format!(
                            "the host {name} has {} entries, the device tensor {}",
                            host.len(),
                            t.shape()[0]
                        )));
                    }
                }
                (Cow::Borrowed(h.cu_seqlens_q), Cow::Borrowed(h.cu_seqlens_k))
            }
            None => (
                Cow::Owned(self.cu_seqlens_q.to_host(dev)?),
                Cow::Owned(self.cu_seqlens_k.to_host(dev)?),
            ),
        };
        VarlenLens::check(cu_q, cu_k, total_q, total_k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(q: &[i32], k: &[i32], tq: usize, tk: usize) -> Result<VarlenLens<'static>> {
        VarlenLens::check(Cow::Owned(q.to_vec()), Cow::Owned(k.to_vec()), tq, tk)
    }

    #[test]
    fn prefix_sums_are_checked() {
        let ok = lens(&[0, 3, 3, 10], &[0, 5, 6, 6], 10, 6).unwrap();
        assert_eq!((ok.batch(), ok.max_q, ok.max_k), (3, 7, 5));
        assert_eq!(ok.spans()[1].q, 3..3);
        assert_eq!(ok.spans()[2].k, 6..6);
        for (q, k, tq, tk) in [
            (&[0, 3][..], &[0, 3, 4][..], 3, 4),    // lengths differ
            (&[0][..], &[0][..], 0, 0),             // no sequence
            (&[1, 3][..], &[0, 3][..], 3, 3),       // does not start at 0
            (&[0, 3, 2][..], &[0, 1, 2][..], 2, 2), // decreases
            (&[0, 3][..], &[0, 3][..], 4, 3),       // does not end at the total
        ] {
            assert!(
                matches!(lens(q, k, tq, tk), Err(FlashError::Shape(_))),
                "{q:?} {k:?}"
            );
        }
        assert!(matches!(
            lens(&[0, 3], &[0, 3], MAX_DIM + 1, 3),
            Err(FlashError::TooLarge(_))
        ));
    }

    #[test]
    fn key_lengths_are_checked() {
        let lens = [3, 0, 5];
        let p = AttnParams {
            seqlens_k: Some(&lens),
            ..AttnParams::default()
        };
        assert!(p.check_key_lengths(3, 5).is_ok());
        assert!(matches!(
            p.check_key_lengths(2, 5),
            Err(FlashError::Shape(_))
        ));
        assert!(matches!(
            p.check_key_lengths(3, 4),
            Err(FlashError::Shape(_))
        ));
        let spans = p.key_padding_spans(3, 7, 5).unwrap().unwrap();
        assert_eq!(
            spans[2],
            SeqSpan {
                seq: 2,
                entry: 2,
                q: 0..7,
                k: 0..5
            }
        );
        let neg = [-1];
        let p = AttnParams {
            seqlens_k: Some(&neg),
            ..AttnParams::default()
        };
        assert!(matches!(
            p.check_key_lengths(1, 5),
            Err(FlashError::Shape(_))
        ));
    }
}
