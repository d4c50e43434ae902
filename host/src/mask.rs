//! The masks of a call, in one place for every backend: validation of
//! [`AttnParams`]' mask options, the kernel kind they need, the kernels' [`MaskArgs`], and
//! the mask values the CPU backend and the references evaluate (the same
//! [`flash_attn_kernels::mask`] types the kernels run).

use flash_attn_kernels::block::BlockInfo;
use flash_attn_kernels::mask::{AttnMask, UNBOUNDED};
use flash_attn_kernels::params::{MaskArgs, FLAG_CAUSAL, FLAG_MODIFIES_SCORES};
use flash_attn_kernels::registry::MaskKind;

use crate::device::Device;
use crate::error::{FlashError, Result};
use crate::params::AttnParams;
use crate::shape::AttnShape;
use crate::tensor::DeviceTensor;

/// The kernels' mask arguments for a GPU call, with the ALiBi slopes copied to the device
/// (kept alive here until the launches that read them are queued).
pub(crate) struct DeviceMask {
    /// The arguments to launch with.
    pub args: MaskArgs,
    /// The slopes on the device, when ALiBi is on.
    _slopes: Option<DeviceTensor<f32>>,
    /// The block-sparse mask's words on the device, when there is one.
    _blocks: Option<DeviceTensor<i32>>,
}

impl DeviceMask {
    /// Checks `params`' masks for a call of `shape` (a varlen batch's longest lengths; the
    /// block mask is checked against them) and prepares their arguments on `dev`.
    pub(crate) fn new(dev: &Device, params: &AttnParams, shape: &AttnShape) -> Result<Self> {
        params.check_masks(shape.batch, shape.heads_q)?;
        params.check_bit_masks(shape)?;
        let slopes = match params.alibi_slopes {
            Some(s) => Some(DeviceTensor::from_host(dev, &[s.len()], s)?),
            None => None,
        };
        let blocks = match params.mask_words() {
            Some(w) => {
                let words: Vec<i32> = w.iter().map(|&w| w as i32).collect();
                Some(DeviceTensor::from_host(dev, &[words.len()], &words)?)
            }
            None => None,
        };
        let slopes_at = slopes.as_ref().map_or(0, |t| t.device_address(dev));
        let blocks_at = blocks.as_ref().map_or(0, |t| t.device_address(dev));
        Ok(Self {
            args: params.mask_args(shape.head_dim, shape.heads_q, slopes_at, blocks_at)?,
            _slopes: slopes,
            _blocks: blocks,
        })
    }
}

impl<'a> AttnParams<'a> {
    /// These options for batch entry `batch` alone (a call of batch 1): per-(batch, head)
    /// ALiBi slopes are cut to the entry's `[Hq]`, key lengths and a tree mask to the
    /// entry's; a block mask is dropped (block masks take no per-entry calls: the callers
    /// that split a call reject them); the rest is unchanged.
    pub fn for_entry(&self, batch: usize, heads_q: usize) -> AttnParams<'a> {
        let alibi_slopes = self.alibi_slopes.map(|s| {
            if s.len() == heads_q {
                s
            } else {
                &s[batch * heads_q..(batch + 1) * heads_q]
            }
        });
        AttnParams {
            alibi_slopes,
            seqlens_k: self.seqlens_k.map(|l| &l[batch..batch + 1]),
            block_mask: None,
            tree_mask: self.tree_mask.map(|t| t.entry(batch)),
            ..*self
        }
    }

    /// Checks the mask options for a call of `batch` entries and `heads_q` query heads: a
    /// softcap must be finite and > 0; ALiBi slopes must be finite, one per query head
    /// (`[Hq]`) or per batch entry and query head (`[B, Hq]`, row-major). Errors:
    /// [`FlashError::Param`], [`FlashError::Shape`].
    pub fn check_masks(&self, batch: usize, heads_q: usize) -> Result<()> {
        if let Some(cap) = self.softcap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(FlashError::Param(format!(
                    "softcap must be finite and > 0, got {cap}"
                )));
            }
        }
        // The bit masks have kernels of their own, which carry causal masking only.
        let others = [
            ("a window", self.window.is_some()),
            ("a softcap", self.softcap.is_some()),
            ("ALiBi", self.alibi_slopes.is_some()),
            ("key padding (seqlens_k)", self.seqlens_k.is_some()),
            ("a block mask", self.block_mask.is_some()),
        ];
        for (mask, on) in [
            ("a block mask", self.block_mask.is_some()),
            ("a tree mask", self.tree_mask.is_some()),
        ] {
            let clash = others.iter().find(|(what, set)| *set && *what != mask);
            if let (true, Some((what, _))) = (on, clash) {
                return Err(FlashError::Param(format!(
                    "{mask} cannot be combined with {what}"
                )));
            }
        }
        if let Some(slopes) = self.alibi_slopes {
            let (b, h) = (batch, heads_q);
            if slopes.len() != h && slopes.len() != b * h {
                return Err(FlashError::Shape(format!(
                    "alibi_slopes has {} values, expected {h} ([heads_q]) or {} ([batch, heads_q])",
                    slopes.len(),
                    b * h
                )));
            }
            if let Some(x) = slopes.iter().find(|x| !x.is_finite()) {
                return Err(FlashError::Param(format!(
                    "alibi_slopes must be finite, got {x}"
                )));
            }
        }
        Ok(())
    }

    /// Checks the block mask and the tree mask, if any, against a call of `shape`.
    pub fn check_bit_masks(&self, shape: &AttnShape) -> Result<()> {
        if let Some(m) = self.block_mask {
            m.check(shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k)?;
        }
        if let Some(t) = self.tree_mask {
            t.check(shape.batch, shape.seqlen_q, shape.seqlen_k)?;
        }
        Ok(())
    }

    /// The keys every sequence of a decode call with queries `q_shape` (`[B, Nq, ..]`) must
    /// attend to: a tree mask's drafts (`Nq`), else 0.
    pub(crate) fn min_decode_keys(&self, q_shape: &[usize]) -> usize {
        match self.tree_mask {
            Some(_) => q_shape.get(1).copied().unwrap_or(0),
            None => 0,
        }
    }

    /// The words of the bit mask the kernels read: the block mask's or the tree's.
    pub(crate) fn mask_words(&self) -> Option<&[u32]> {
        match (self.block_mask, self.tree_mask) {
            (Some(m), _) => Some(m.words()),
            (None, Some(t)) => Some(t.words()),
            (None, None) => None,
        }
    }

    /// The kernel kind the options need: [`MaskKind::Sparse`] with a block mask,
    /// [`MaskKind::Tree`] with a tree mask, [`MaskKind::Masked`] with a window, a softcap or
    /// ALiBi, else [`MaskKind::Causal`] (the plain kernels, causal or not).
    pub fn mask_kind(&self) -> MaskKind {
        if self.block_mask.is_some() {
            MaskKind::Sparse
        } else if self.tree_mask.is_some() {
            MaskKind::Tree
        } else if self.window.is_some() || self.softcap.is_some() || self.alibi_slopes.is_some() {
            MaskKind::Masked
        } else {
            MaskKind::Causal
        }
    }

    /// The window as the kernels take it, `(left, right)` keys around the diagonal
    /// ([`UNBOUNDED`]: all), with causal masking folded in (`right ≤ 0`).
    pub fn window_bounds(&self) -> (u32, u32) {
        let bound = |x: usize| u32::try_from(x).unwrap_or(UNBOUNDED);
        let (left, right) = self
            .window
            .map_or((UNBOUNDED, UNBOUNDED), |(l, r)| (bound(l), bound(r)));
        (left, if self.causal { 0 } else { right })
    }

    /// The ALiBi slope of query head `head` of batch entry `batch` (0 without ALiBi).
    pub(crate) fn slope(&self, batch: usize, head: usize, heads_q: usize) -> f32 {
        match self.alibi_slopes {
            Some(s) if s.len() == heads_q => s[head],
            Some(s) => s[batch * heads_q + head],
            None => 0.0,
        }
    }

    /// The kernels' mask arguments, with the ALiBi slopes at address `slopes` and the block
    /// mask's words at address `blocks` (0 when none) for a call with `heads_q` query heads
    /// and head dim `head_dim`.
    pub(crate) fn mask_args(
        &self,
        head_dim: usize,
        heads_q: usize,
        slopes: u64,
        blocks: u64,
    ) -> Result<MaskArgs> {
        let (window_left, window_right) = self.window_bounds();
        let per_batch = self.alibi_slopes.is_some_and(|s| s.len() != heads_q);
        Ok(MaskArgs {
            alibi_slopes: slopes,
            alibi_batch_stride: if per_batch { heads_q as u32 } else { 0 },
            window_left,
            window_right,
            softcap: self.softcap.unwrap_or(0.0),
            scale: self.scale(head_dim)?,
            flags: if self.causal { FLAG_CAUSAL } else { 0 }
                | if self.modifies_scores() {
                    FLAG_MODIFIES_SCORES
                } else {
                    0
                },
            mask_bits: blocks,
            bits_batch_stride: match (self.block_mask, self.tree_mask) {
                (Some(m), _) => m.batch_stride() as u32,
                (None, Some(t)) => t.batch_stride() as u32,
                (None, None) => 0,
            },
            bits_head_stride: self.block_mask.map_or(0, |m| m.head_stride() as u32),
            cols_batch_stride: self.block_mask.map_or(0, |m| m.col_batch_stride() as u32),
            cols_head_stride: self.block_mask.map_or(0, |m| m.col_head_stride() as u32),
            mask_cols: match self.block_mask {
                Some(m) if blocks != 0 => blocks + 4 * m.cols_offset() as u64,
                _ => 0,
            },
        })
    }

    /// Whether a softcap or ALiBi modifies the scores (then the mask applies the softmax
    /// scale; a window alone leaves the scores alone).
    pub(crate) fn modifies_scores(&self) -> bool {
        self.softcap.is_some() || self.alibi_slopes.is_some()
    }

    /// The base-2 scale of the kernels' softmax (GPU and CPU): `scale·log2 e`, or `log2 e`
    /// when a softcap or ALiBi modifies the scores (they carry the scale already).
    pub(crate) fn kernel_scale_log2(&self, head_dim: usize) -> Result<f32> {
        let scale_log2 = self.scale_log2(head_dim)?;
        Ok(if self.modifies_scores() {
            std::f32::consts::LOG2_E
        } else {
            scale_log2
        })
    }

    /// The factor of dS into dQ and dK in the backward (GPU and CPU): the softmax scale, or 1
    /// when a softcap or ALiBi modifies the scores (the derivative of the scores carries the
    /// scale).
    pub(crate) fn kernel_grad_scale(&self, head_dim: usize) -> Result<f32> {
        let scale = self.scale(head_dim)?;
        Ok(if self.modifies_scores() { 1.0 } else { scale })
    }
}

/// The mask of batch entry `batch`, query head `head` of a call of `shape` as the CPU backend
/// runs it: built by [`AttnMask::new`] from the same [`MaskArgs`] the kernels get (without a
/// slopes address: the CPU passes each head's slope to [`AttnMask::score`] itself; with the
/// block mask's words in host memory).
pub(crate) fn cpu_mask<M: AttnMask>(
    params: &AttnParams,
    shape: &AttnShape,
    (batch, head): (usize, usize),
) -> Result<M> {
    params.check_bit_masks(shape)?;
    let words = params.mask_words().map_or(0, |w| w.as_ptr() as u64);
    let args = params.mask_args(shape.head_dim, shape.heads_q, 0, words)?;
    let block = BlockInfo {
        batch: batch as u32,
        head: head as u32,
        kv_head: 0,
        row0: 0,
        seqlen_q: shape.seqlen_q as u32,
        seqlen_k: shape.seqlen_k as u32,
    };
    // SAFETY: `args` hold no slopes address; the block mask's words, when any, are
    // `params.block_mask`'s, checked against `shape` above, and outlive the mask's uses (the
    // caller holds `params`).
    Ok(unsafe { M::new(&args, &block) })
}

/// Runs `$body` with `$M` the CPU mask type of `$params` ([`AttnParams::mask_kind`]).
macro_rules! with_cpu_mask {
    ($params:expr, $M:ident => $body:expr) => {
        match $params.mask_kind() {
            flash_attn_kernels::registry::MaskKind::Causal => {
                type $M = flash_attn_kernels::mask::CausalMask;
                $body
            }
            flash_attn_kernels::registry::MaskKind::Masked => {
                type $M = flash_attn_kernels::mask::ScoredMask;
                $body
            }
            flash_attn_kernels::registry::MaskKind::Sparse => {
                type $M = flash_attn_kernels::mask::SparseMask;
                $body
            }
            flash_attn_kernels::registry::MaskKind::Tree => {
                type $M = flash_attn_kernels::mask::TreeMask;
                $body
            }
        }
    };
}
pub(crate) use with_cpu_mask;

/// How the CPU backend turns a raw score `s = q·k` into the base-2 logit of its softmax, as
/// the kernels do: the mask's [`AttnMask::score`] times `log2 e` for masks that modify scores,
/// else `s·scale·log2 e`.
#[derive(Clone, Copy)]
pub(crate) struct CpuScores<'m, M> {
    /// The mask of the sequence.
    pub mask: &'m M,
    /// The head's ALiBi slope.
    pub slope: f32,
    /// `scale·log2 e`.
    pub scale_log2: f32,
}

impl<M: AttnMask> CpuScores<'_, M> {
    /// The base-2 logit of raw score `s` at (`row`, `key`).
    pub fn logit2(&self, row: usize, key: usize, s: f32) -> f32 {
        if self.mask.modifies_scores() {
            self.mask.score(row as u32, key as u32, s, self.slope) * std::f32::consts::LOG2_E
        } else {
            s * self.scale_log2
        }
    }

    /// The base-2 logit of `s` in f64 (the backward subtracts the LSE from it there) and the
    /// derivative of the score modifier (1 for masks that do not modify scores: the softmax
    /// scale is applied to dQ and dK at the end, see [`AttnParams::kernel_grad_scale`]).
    pub fn logit2_and_grad(&self, row: usize, key: usize, s: f32) -> (f64, f32) {
        if self.mask.modifies_scores() {
            let (x, g) = self
                .mask
                .score_and_grad(row as u32, key as u32, s, self.slope);
            (f64::from(x) * std::f64::consts::LOG2_E, g)
        } else {
            (f64::from(s) * f64::from(self.scale_log2), 1.0)
        }
    }
}
