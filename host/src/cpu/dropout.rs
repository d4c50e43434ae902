//! Attention dropout on the CPU: which probabilities are kept, drawn from the kernels' own
//! generator ([`flash_attn_kernels::rng::DropoutRng`], Philox 4×32-10 counted by (sequence,
//! query head, query, key)), so that the CPU backend, the references and the GPU kernels drop
//! the very same elements.
//!
//! The mask `Z` of a call is fixed by its [`Dropout`]: element (query `i`, key `j`) of
//! sequence `b` of the call (its batch entry, or its index in a varlen batch) and query head
//! `h` is kept when `DropoutRng::new(args, first_sequence + b, h, Hq).keep(i, j)`. A call that
//! the CPU splits into one call per sequence ([`crate::cpu::sequences`]) passes each part a
//! [`Dropout::first_sequence`] advanced by the sequence's index, so the parts draw the whole
//! call's mask.
//!
//! - [`dropout_mask`]: the whole mask as an array (for tests, at small sizes).
//! - [`CallDropout`] / [`HeadDropout`] (crate-internal): the generator of a call and of one
//!   (sequence, query head), and [`HeadDropout::fill`], the one routine that evaluates `Z` for
//!   a block of (query, key) pairs, 16 elements per Philox call. The tiled backend fills one
//!   tile at a time; the references fill each head's whole `Nq × Nk` matrix.

use std::ops::Range;

use flash_attn_kernels::params::DropoutArgs;
use flash_attn_kernels::rng::DropoutRng;
use ndarray::{Array4, Axis, Dim};

use crate::cpu::alloc;
use crate::error::Result;
use crate::params::{AttnParams, Dropout};

/// The dropout mask of a padded call of `batch` sequences and `heads_q` query heads:
/// `[batch, heads_q, seqlen_q, seqlen_k]`, 1 where a probability is kept and 0 where it is
/// dropped (sequence `b` of the array is sequence `dropout.first_sequence + b` of the
/// generator). Whatever masking the call applies on top is not reflected here.
///
/// Costs O(B·H·Nq·Nk) time and memory: meant for tests at small sizes. Errors:
/// [`crate::FlashError::Param`] for `p` outside `[0, 1)` (NaN included), and
/// [`crate::FlashError::TooLarge`] / [`crate::FlashError::Alloc`] for a mask that cannot be
/// allocated. With `p = 0` every element is kept.
pub fn dropout_mask(
    batch: usize,
    heads_q: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    dropout: &Dropout,
) -> Result<Array4<u8>> {
    let params = AttnParams {
        dropout: Some(*dropout),
        ..AttnParams::default()
    };
    params.active_dropout()?;
    let call = CallDropout::of(dropout, heads_q);
    let dims = Dim([batch, heads_q, seqlen_q, seqlen_k]);
    let mut mask = alloc::array(dims, 0u8, "dropout mask")?;
    for (b, mut per_batch) in mask.axis_iter_mut(Axis(0)).enumerate() {
        for (h, mut head) in per_batch.axis_iter_mut(Axis(0)).enumerate() {
            let keep = head.as_slice_mut().expect("a fresh standard-layout array");
            call.head(b, h)
                .fill(0..seqlen_q, 0..seqlen_k, keep, seqlen_k);
        }
    }
    Ok(mask)
}

/// The dropout of one call as the CPU applies it: the kernels' arguments (with the call's
/// first sequence) and the call's query heads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallDropout {
    /// The kernels' arguments; `batch0` is the generator's index of the call's sequence 0.
    args: DropoutArgs,
    /// Query heads of the call (the generator counts `batch·Hq + head`).
    heads_q: u32,
    /// `1/(1 − p)` in f64.
    scale: f64,
}

impl CallDropout {
    /// The dropout of `params` for a call of `heads_q` query heads: `None` without dropout
    /// or with `p = 0`; [`crate::FlashError::Param`] for an invalid `p`
    /// ([`AttnParams::active_dropout`]).
    pub(crate) fn new(params: &AttnParams, heads_q: usize) -> Result<Option<Self>> {
        Ok(params.active_dropout()?.map(|d| Self::of(&d, heads_q)))
    }

    /// The dropout `d` (already checked) for a call of `heads_q` query heads.
    fn of(d: &Dropout, heads_q: usize) -> Self {
        Self {
            args: d.args(0),
            heads_q: heads_q as u32,
            scale: 1.0 / (1.0 - f64::from(d.p)),
        }
    }

    /// `1/(1 − p)` in f64, as the float64 reference applies it.
    pub(crate) fn scale64(&self) -> f64 {
        self.scale
    }

    /// The dropout of sequence `b` of the call (its batch entry) and query head `h`.
    pub(crate) fn head(&self, b: usize, h: usize) -> HeadDropout {
        let batch = self.args.batch0.wrapping_add(b as u32);
        HeadDropout {
            rng: DropoutRng::new(&self.args, batch, h as u32, self.heads_q),
            scale: self.args.scale,
        }
    }
}

/// The dropout of one (sequence, query head): its generator and the factor `1/(1 − p)` that
/// kept probabilities are multiplied by.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadDropout {
    /// The generator of this (sequence, query head).
    rng: DropoutRng,
    /// `1/(1 − p)` rounded to f32, as the kernels apply it.
    pub(crate) scale: f32,
}

impl HeadDropout {
    /// Writes `Z` of the queries `rows` × keys `keys` into `keep`: 1 for a kept element and
    /// 0 for a dropped one, element (`i`, `j`) at `(i − rows.start)·pitch + j − keys.start`.
    /// One Philox call per 16 elements (the 16 × 32 blocks of the generator are visited
    /// whole, the parts outside the ranges discarded).
    pub(crate) fn fill(
        &self,
        rows: Range<usize>,
        keys: Range<usize>,
        keep: &mut [u8],
        pitch: usize,
    ) {
        if rows.is_empty() || keys.is_empty() {
            return;
        }
        // The generator's calls: rows r with r mod 16 < 8, even keys c with c mod 32 < 8.
        let first_row = rows.start / 16 * 16;
        let first_key = keys.start / 32 * 32;
        for r in (first_row..rows.end).filter(|r| r % 16 < 8) {
            for c in (first_key..keys.end).step_by(2).filter(|c| c % 32 < 8) {
                let bits = self.rng.keep_bits(r as u32, c as u32);
                for s in 0..2 {
                    let i = r + 8 * s;
                    if !rows.contains(&i) {
                        continue;
                    }
                    let at = (i - rows.start) * pitch;
                    for (h, u, e) in (0..8).map(|x| (x >> 2, x >> 1 & 1, x & 1)) {
                        let j = c + 16 * h + 8 * u + e;
                        if keys.contains(&j) {
                            let bit = 4 * (2 * h + s) + 2 * u + e;
                            keep[at + j - keys.start] = ((bits >> bit) & 1) as u8;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `fill` of any block, aligned to the generator's 16 × 16 blocks or not, is
    /// [`DropoutRng::keep`] element by element, and leaves the pitch's slack alone.
    #[test]
    fn fill_is_keep_on_any_block() {
        let d = Dropout {
            first_sequence: 2,
            ..Dropout::new(0.5, 3, 4)
        };
        let call = CallDropout::of(&d, 3);
        let rng = DropoutRng::new(&d.args(1), 3, 2, 3);
        for (rows, keys) in [
            (0..1, 0..1),
            (5..29, 3..41),
            (16..32, 8..9),
            (61..130, 0..64),
            (3..40, 17..120),
        ] {
            let pitch = keys.len() + 3;
            let mut keep = vec![7u8; rows.len() * pitch];
            call.head(1, 2)
                .fill(rows.clone(), keys.clone(), &mut keep, pitch);
            for (r, i) in rows.clone().enumerate() {
                for (c, j) in keys.clone().enumerate() {
                    let want = rng.keep(i as u32, j as u32) as u8;
                    assert_eq!(keep[r * pitch + c], want, "({i}, {j})");
                }
                assert!(keep[r * pitch + keys.len()..(r + 1) * pitch]
                    .iter()
                    .all(|&x| x == 7));
            }
        }
    }
}
