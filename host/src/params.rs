//! Options of an attention call.

use crate::error::{FlashError, Result};

/// Options of [`crate::flash_attn`] and the CPU backend.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnParams {
    /// Causal masking, aligned to the bottom-right corner when `seqlen_q != seqlen_k`: query
    /// `i` sees keys `j ≤ i + seqlen_k − seqlen_q` (FlashAttention 2's convention).
    pub causal: bool,
    /// Scale applied to `Q·Kᵀ` before the softmax; `None` means `1/√head_dim`.
    pub softmax_scale: Option<f32>,
}

impl AttnParams {
    /// The scale to use for a head dim, checked to be finite.
    pub fn scale(&self, head_dim: usize) -> Result<f32> {
        let s = self.softmax_scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
        if s.is_finite() {
            Ok(s)
        } else {
            Err(FlashError::Param(format!(
                "softmax_scale must be finite, got {s}"
            )))
        }
    }
}
