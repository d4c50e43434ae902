//! Options of an attention call, and the softmax-scale constants every backend uses.

use crate::error::{FlashError, Result};

/// Options of [`crate::flash_attn`] and the CPU backend.
///
/// # Non-finite inputs
///
/// NaN in, NaN out, on every backend: a query row whose scores over its visible keys include a
/// NaN (from NaN in its Q row or in a visible K row, or ±∞·0 in the dot product), whose largest
/// visible score is +∞ (∞ − ∞ in the softmax), or whose visible scores are all −∞, gets NaN in
/// its O row and its LSE. Scaled scores beyond the f32 range overflow to ±∞ and follow the same
/// rule, like a naive f32 softmax. A non-finite value in a visible V row reaches the O row by
/// IEEE arithmetic (NaN, or ±∞). Keys hidden by the mask are never read for the row, and a row
/// with no visible key at all (possible with causal masking and `seqlen_q > seqlen_k`, or a window) gets
/// O = 0 and LSE = −∞: only such a row does.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnParams<'a> {
    /// Causal masking, aligned to the bottom-right corner when `seqlen_q != seqlen_k`: query
    /// `i` sees keys `j ≤ i + seqlen_k − seqlen_q` (FlashAttention 2's convention). Combined
    /// with [`AttnParams::window`], it sets the window's right side to 0.
    pub causal: bool,
    /// Scale applied to `Q·Kᵀ` before the softmax; `None` means `1/√head_dim`.
    pub softmax_scale: Option<f32>,
    /// Sliding window `(left, right)`, bottom-right aligned: query `i` sees keys `j` with
    /// `i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right` (FlashAttention's `window_size`; a side
    /// of `usize::MAX`, or any value ≥ the sequence length, is unbounded). Key tiles outside
    /// every row's window are skipped. `None`: no window.
    pub window: Option<(usize, usize)>,
    /// Logit softcap `cap > 0`: the logits are `cap·tanh(scale·s / cap)` (Gemma 2), with the
    /// tanh's derivative in the backward.
    pub softcap: Option<f32>,
    /// ALiBi slopes, `[Hq]` (one per query head) or `[B, Hq]` row-major, f32: the bias
    /// `−slope·|i + Nk − Nq − j|` is added to the logits (after the softcap), FlashAttention's
    /// convention. The GPU path copies them to the device on every call.
    pub alibi_slopes: Option<&'a [f32]>,
    /// Key padding of a padded batch: entry `b` attends to its first `seqlens_k[b]` keys
    /// (`[B]`, each in `0 ..= Nk`; the rest of K and V is never read), with causal masking and
    /// windows bottom-right aligned at that length, as if the entry had only those keys; its
    /// dK and dV rows past the length are 0. An entry of length 0 gives O = 0 and LSE = −∞.
    /// The GPU path copies them to the device on every call. Not for [`crate::Varlen`] calls
    /// (their `cu_seqlens_k` give every sequence's keys).
    pub seqlens_k: Option<&'a [i32]>,
    /// Block-sparse attention: one bit per block of 128 queries × 128 keys (see
    /// [`crate::BlockMask`]); blocks whose bit is 0 are neither loaded nor computed, in the
    /// forward and the backward. Combines with causal masking and GQA; not with a window,
    /// softcap, ALiBi or key padding, nor with a varlen batch or the decode path (typed
    /// errors).
    /// The GPU path copies the bits to the device on every call.
    pub block_mask: Option<&'a crate::sparse::BlockMask>,
    /// A tree of draft tokens (speculative decoding, see [`crate::TreeMask`]): the queries are
    /// the drafts, the last `Nq` keys the same drafts, and every key before them (the cached
    /// prefix) is visible; draft `i` sees draft `t` when the tree says so (and, with causal
    /// masking, `t ≤ i`). In the forward and the decode path (contiguous or paged caches;
    /// every sequence must hold the drafts among its keys), GPU and CPU; the CPU backward
    /// takes it too, the GPU backward does not (a typed error). Not with a window, softcap,
    /// ALiBi, block mask, key padding or varlen batch.
    pub tree_mask: Option<crate::tree::TreeMaskRef<'a>>,
    /// Attention dropout (the FlashAttention paper's Algorithms 2 and 4): each probability of
    /// the softmax is dropped with probability `p` and the kept ones are scaled by
    /// `1/(1 − p)`; the LSE is that of the softmax before dropout. The mask is drawn from
    /// Philox 4×32-10 keyed by the seed and offset and counted by (sequence, query head, query,
    /// key) (see [`flash_attn_kernels::rng`]): every backend and path draws the same mask,
    /// whatever the tile sizes, split counts or GPU. The forward keeps no mask: its RNG state
    /// is `(seed, offset)`, which these options already hold, so the backward, given the same
    /// options, regenerates it. `None`, or `p = 0`, runs without dropout at no cost.
    pub dropout: Option<Dropout>,
}

/// Attention dropout's probability and random stream; see [`AttnParams::dropout`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DropoutSeed {
    /// Philox seed.
    pub seed: u64,
    /// Philox offset: calls with one seed and different offsets draw different masks (for
    /// example, one offset per layer and step).
    pub offset: u64,
}

/// Attention dropout; see [`AttnParams::dropout`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Dropout {
    /// Probability of dropping each attention probability, in `[0, 1)` (anything else,
    /// NaN included, is a [`FlashError::Param`]).
    pub p: f32,
    /// The random stream: the forward's RNG state, which the backward needs.
    pub rng: DropoutSeed,
    /// The generator's index of this call's first sequence (0 unless the call is one part
    /// of a larger batch whose mask it must reproduce, e.g. a batch split across devices).
    pub first_sequence: u32,
}

impl Dropout {
    /// Dropout with probability `p`, seed `seed` and offset `offset`.
    pub fn new(p: f32, seed: u64, offset: u64) -> Self {
        Self {
            p,
            rng: DropoutSeed { seed, offset },
            first_sequence: 0,
        }
    }

    /// The kernels' arguments for a launch whose first sequence is `batch` of the call.
    pub(crate) fn args(&self, batch: usize) -> flash_attn_kernels::params::DropoutArgs {
        flash_attn_kernels::params::DropoutArgs::new(
            self.p,
            self.rng.seed,
            self.rng.offset,
            self.first_sequence.wrapping_add(batch as u32),
        )
    }
}

impl AttnParams<'static> {
    /// No options (what `Default` gives), usable in `const` items: `AttnParams { causal:
    /// true, ..AttnParams::DEFAULT }`.
    pub const DEFAULT: AttnParams<'static> = AttnParams {
        causal: false,
        softmax_scale: None,
        window: None,
        softcap: None,
        alibi_slopes: None,
        seqlens_k: None,
        block_mask: None,
        tree_mask: None,
        dropout: None,
    };
}

impl AttnParams<'_> {
    /// The dropout to apply: `None` without dropout or with `p = 0`. Errors
    /// ([`FlashError::Param`]) when `p` is not in `[0, 1)`.
    pub fn active_dropout(&self) -> Result<Option<Dropout>> {
        match self.dropout {
            None => Ok(None),
            Some(d) if !(0.0..1.0).contains(&d.p) => Err(FlashError::Param(format!(
                "dropout probability must be in [0, 1), got {}",
                d.p
            ))),
            Some(d) if d.p == 0.0 => Ok(None),
            Some(d) => Ok(Some(d)),
        }
    }

    /// Errors ([`FlashError::Param`]) when dropout is on: the decode path (an inference path)
    /// does not take it.
    pub fn check_no_dropout(&self) -> Result<()> {
        match self.active_dropout()? {
            Some(_) => Err(FlashError::Param(
                "dropout is a training option: the decode path (attn_with_kvcache) does not take it"
                    .into(),
            )),
            None => Ok(()),
        }
    }

    /// The scale to use for a head dim: `softmax_scale`, or `1/√head_dim` by default. Errors
    /// ([`FlashError::Param`]) when it is not finite or when `scale·log2 e` overflows f32
    /// (`|scale|` ≳ 2.4e38), so that every backend accepts the same scales.
    pub fn scale(&self, head_dim: usize) -> Result<f32> {
        Ok(self.softmax_scales(head_dim)?.0)
    }

    /// `scale·log2 e`, the constant by which the tiled backends (GPU kernels and CPU) multiply
    /// `Q·Kᵀ` so that the softmax runs on `exp2`; checked like [`AttnParams::scale`].
    pub fn scale_log2(&self, head_dim: usize) -> Result<f32> {
        Ok(self.softmax_scales(head_dim)?.1)
    }

    /// The one place the scale and `scale·log2 e` are computed (the product in f64, rounded
    /// once to f32).
    fn softmax_scales(&self, head_dim: usize) -> Result<(f32, f32)> {
        let scale = self
            .softmax_scale
            .unwrap_or_else(|| 1.0 / (head_dim as f32).sqrt());
        if !scale.is_finite() {
            return Err(FlashError::Param(format!(
                "softmax_scale must be finite, got {scale}"
            )));
        }
        let scale_log2 = (f64::from(scale) * std::f64::consts::LOG2_E) as f32;
        if !scale_log2.is_finite() {
            return Err(FlashError::Param(format!(
                "softmax_scale {scale} is too large: scale·log2(e) overflows f32"
            )));
        }
        Ok((scale, scale_log2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_const_default_is_default() {
        assert_eq!(AttnParams::DEFAULT, AttnParams::default());
    }

    #[test]
    fn default_scale_is_inverse_sqrt_head_dim() {
        let p = AttnParams::default();
        assert_eq!(p.scale(64).unwrap(), 0.125);
        assert_eq!(
            p.scale_log2(64).unwrap(),
            (0.125 * std::f64::consts::LOG2_E) as f32
        );
    }

    #[test]
    fn huge_or_non_finite_scales_are_param_errors() {
        for s in [
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            2.4e38,
            -3e38,
            f32::MAX,
        ] {
            let p = AttnParams {
                softmax_scale: Some(s),
                ..AttnParams::default()
            };
            assert!(matches!(p.scale(8), Err(FlashError::Param(_))), "{s}");
            assert!(matches!(p.scale_log2(8), Err(FlashError::Param(_))), "{s}");
        }
        let p = AttnParams {
            softmax_scale: Some(2.3e38),
            ..AttnParams::default()
        };
        assert!(p.scale_log2(8).unwrap().is_finite());
    }
}
