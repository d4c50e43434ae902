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
use crate::resident::DeviceWords;
use crate::scratch::{LaunchBytes, ScratchUpload};
use crate::shape::AttnShape;
use crate::sparse::CallOrders;

/// Where a call's mask data sits: the ALiBi slopes and a tree mask's words in its launch data
/// ([`LaunchBytes`]), a block mask's words, with the call's tile orders right after them,
/// on the device already ([`BlockMask::on_device`]). The device addresses, and so the
/// kernels' arguments, come once the launch data is uploaded ([`StagedMask::args`]).
pub(crate) struct StagedMask {
    slopes: Option<usize>,
    bits: Option<Bits>,
}

/// Where the bit mask's words are.
enum Bits {
    /// A tree mask's, in the launch data at this offset.
    Staged(usize),
    /// A block mask's, on the device, with the call's orders after them.
    Resident(DeviceWords),
}

impl StagedMask {
    /// Checks `params`' masks for a call of `shape` (a varlen batch's longest lengths; the
    /// block mask is checked against them), appends the slopes and a tree mask's words to
    /// `data`, and finds a block mask's words, with `orders` after them, on the device
    /// (uploaded there by the first call that needs them).
    pub(crate) fn stage(
        dev: &Device,
        params: &AttnParams,
        shape: &AttnShape,
        orders: &CallOrders,
        data: &mut LaunchBytes,
    ) -> Result<Self> {
        params.check_masks(shape.batch, shape.heads_q)?;
        params.check_bit_masks(shape)?;
        let slopes = params
            .alibi_slopes
            .map(|s| data.push_words(s.iter().map(|x| x.to_bits())));
        let bits = match (params.block_mask, params.tree_mask) {
            (Some(mask), _) => Some(Bits::Resident(mask.on_device(dev, orders)?)),
            (None, Some(tree)) => Some(Bits::Staged(data.push_words(tree.words().iter().copied()))),
            (None, None) => None,
        };
        Ok(Self { slopes, bits })
    }

    /// The kernels' mask arguments once the launch data is at `upload`, and the device
    /// address of the orders (0 when none).
    pub(crate) fn args(
        &self,
        params: &AttnParams,
        shape: &AttnShape,
        upload: &ScratchUpload,
    ) -> Result<(MaskArgs, u64)> {
        let slopes = self.slopes.map_or(0, |o| upload.address(o));
        let (bits, orders) = match &self.bits {
            None => (0, 0),
            Some(Bits::Staged(offset)) => (upload.address(*offset), 0),
            Some(Bits::Resident(words)) => (words.address, words.orders_address),
        };
        let args = params.mask_args(shape.head_dim, shape.heads_q, slopes, bits)?;
        Ok((args, orders))
    }
}

/// The kernels' mask arguments for a GPU call whose only launch data is its mask's (the
/// backward, the decode path), uploaded to the device's launch scratch, which stays locked
/// while this lives: keep it until the launches that read it are queued.
pub(crate) struct DeviceMask<'a> {
    /// The arguments to launch with.
    pub args: MaskArgs,
    /// Device address of the orders ([`DeviceMask::with_orders`]; 0 when none).
    pub orders_at: u64,
    _staged: StagedMask,
    _upload: ScratchUpload<'a>,
}

impl<'a> DeviceMask<'a> {
    /// Checks `params`' masks for a call of `shape` (see [`StagedMask::stage`]) and uploads
    /// their data.
    pub(crate) fn new(dev: &'a Device, params: &AttnParams, shape: &AttnShape) -> Result<Self> {
        Self::with_orders(dev, params, shape, &[])
    }

    /// [`DeviceMask::new`] with `orders` after a block mask's words (the backward's key tile
    /// orders), at [`DeviceMask::orders_at`].
    pub(crate) fn with_orders(
        dev: &'a Device,
        params: &AttnParams,
        shape: &AttnShape,
        orders: &CallOrders,
    ) -> Result<Self> {
        let mut data = LaunchBytes::default();
        let staged = StagedMask::stage(dev, params, shape, orders, &mut data)?;
        let upload = dev.launch_scratch().upload(dev, &data)?;
        let (args, orders_at) = staged.args(params, shape, &upload)?;
        Ok(Self {
            args,
            orders_at,
            _staged: staged,
            _upload: upload,
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
/// else `s·scale·log2 e`; except that a softcap's `tanh` is taken in f64 on the host
/// ([`CpuScores::capped`]), not by the kernels' `flash_attn_kernels::math::tanh`. The raw
/// scores and the logits are f64, so that the forward and the backward subtract their running
/// maximum or LSE before anything is rounded (at ±100, an f32 score or logit is already off by
/// up to 4e-6, more than the whole error of the f32 naive attention; the backward's P, and
/// through its `dP − D` its dQ and dK, inherit that relative error). Masks that modify scores
/// take the f32 score their kernel code takes.
#[derive(Clone, Copy)]
pub(crate) struct CpuScores<'m, M> {
    /// The mask of the sequence.
    pub mask: &'m M,
    /// The head's ALiBi slope.
    pub slope: f32,
    /// `scale·log2 e`.
    pub scale_log2: f32,
    /// The logit softcap ([`AttnParams::softcap`]); `Some` exactly when the mask is
    /// [`AttnMask::capped`].
    pub softcap: Option<f32>,
}

impl<M: AttnMask> CpuScores<'_, M> {
    /// The base-2 logit of raw score `s` at (`row`, `key`), in f64: `s·scale_log2`, the
    /// mask's f32 score (of `s` rounded to f32) times `log2 e`, or the capped logit of
    /// [`CpuScores::capped`] times `log2 e`.
    pub fn logit2(&self, row: usize, key: usize, s: f64) -> f64 {
        self.logit2_and_grad(row, key, s).0
    }

    /// [`CpuScores::logit2`] and the derivative of the score modifier (1 for masks that do
    /// not modify scores: the softmax scale is applied to dQ and dK at the end, see
    /// [`AttnParams::kernel_grad_scale`]).
    pub fn logit2_and_grad(&self, row: usize, key: usize, s: f64) -> (f64, f32) {
        match self.softcap {
            Some(cap) => {
                let (logit, grad) = self.capped(row, key, s as f32, cap);
                (logit * std::f64::consts::LOG2_E, grad)
            }
            None if self.mask.modifies_scores() => {
                let (x, g) = self
                    .mask
                    .score_and_grad(row as u32, key as u32, s as f32, self.slope);
                (f64::from(x) * std::f64::consts::LOG2_E, g)
            }
            None => (s * f64::from(self.scale_log2), 1.0),
        }
    }

    /// The logit `cap·tanh(x / cap) − slope·|i + Nk − Nq − j|` of raw score `s` under a softcap
    /// (the mask is a capped [`flash_attn_kernels::mask::ScoredMask`]), in f64, and its
    /// derivative `scale·(1 − tanh²)`. The scaled score `x = scale·s` and the ALiBi term are
    /// the mask's own f32 values (its score without the cap: `x − slope·distance`, taken with
    /// slope 0 and with `s = 0`); the `tanh` and the sum are f64.
    ///
    /// Not the kernels' `tanh(y) = 1 − 2/(e^{2y} + 1)`: its error is a few ulp of 1 whatever
    /// `y`, so for `|y| ≪ 1` (the scores of a large cap) it loses the bits that `1 − ⋯` cancels,
    /// and the cap multiplies what is left into an absolute logit error of about
    /// `cap·2⁻²³`: 6e-6 at cap 50 on logits of ±3, where the f32 naive attention errs by 4e-7
    /// (and the f32 logit rounded once by 1e-7). That is below the f16/bf16 resolution the GPU
    /// computes in, but in f32 it gave O errors of 20 to 70 times the naive one (1e-5 and more
    /// with the `1/(1 − p)` of dropout).
    fn capped(&self, row: usize, key: usize, s: f32, cap: f32) -> (f64, f32) {
        debug_assert!(self.mask.capped(), "a softcap without a capped mask");
        let (row, key) = (row as u32, key as u32);
        let (x, scale) = self.mask.score_and_grad_as::<false>(row, key, s, 0.0);
        let alibi = self.mask.score_as::<false>(row, key, 0.0, self.slope);
        let t = (f64::from(x) / f64::from(cap)).tanh();
        let logit = f64::from(cap) * t + f64::from(alibi);
        (logit, scale * (1.0 - t * t) as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flash_attn_kernels::mask::ScoredMask;

    /// With a softcap, the CPU's logits are `cap·tanh(scale·s / cap) − slope·|i + Nk − Nq − j|`
    /// (times `log2 e`) within the f32 roundings of `scale·s` and of the ALiBi term (half an
    /// ulp each, times at most `log2 e`): for small `scale·s / cap` too, where the kernels'
    /// `tanh` errs by a few ulp of 1 (at cap 50, 6e-6 on logits of ±3, 30 times this bound).
    /// The backward's derivative is `scale·(1 − tanh²)` to a few ulp.
    #[test]
    fn softcapped_logits_are_accurate_for_small_scores() {
        let shape = AttnShape {
            batch: 1,
            seqlen_q: 5,
            seqlen_k: 9,
            heads_q: 1,
            heads_kv: 1,
            head_dim: 3,
        };
        let slopes = [0.25f32];
        for (cap, scale, alibi) in [
            (50.0f32, -0.5f32, false),
            (50.0, 0.3, true),
            (2.0, 0.3, false),
        ] {
            let params = AttnParams {
                softmax_scale: Some(scale),
                softcap: Some(cap),
                alibi_slopes: alibi.then_some(&slopes[..]),
                ..AttnParams::default()
            };
            let mask: ScoredMask = cpu_mask(&params, &shape, (0, 0)).unwrap();
            let slope = params.slope(0, 0, 1);
            let scores = CpuScores {
                mask: &mask,
                slope,
                scale_log2: params.scale_log2(3).unwrap(),
                softcap: params.softcap,
            };
            let (cap, scale) = (f64::from(cap), f64::from(scale));
            for step in -400i32..=400 {
                let s = step as f32 * 0.01;
                let (row, key) = (step.unsigned_abs() as usize % 5, 7);
                let x = scale * f64::from(s);
                let t = (x / cap).tanh();
                let ramp = f64::from(slope) * (row as f64 + 4.0 - key as f64).abs();
                let exact = (cap * t - ramp) * std::f64::consts::LOG2_E;
                let ulp = f64::from(f32::EPSILON);
                let tol = ulp * (x.abs() + ramp) + 1e-12 * exact.abs();
                let (got, grad) = scores.logit2_and_grad(row, key, f64::from(s));
                assert!(
                    (got - exact).abs() <= tol,
                    "cap {cap}, s {s}: {got} vs {exact}"
                );
                let want = scale * (1.0 - t * t);
                assert!((f64::from(grad) - want).abs() <= 4.0 * ulp * scale.abs());
            }
        }
    }
}
