//! The dropout mask the GPU forward draws, read back through the forward itself: for tests
//! at small sizes.

use half::f16;

use crate::device::Device;
use crate::error::{FlashError, Result};
use crate::params::{AttnParams, Dropout};
use crate::tensor::DeviceTensor;

/// Keys per forward call (the smallest compiled head dim).
const KEYS_PER_CALL: usize = 32;

/// The dropout mask of a call with `batch` sequences, `heads_q` query heads, `seqlen_q`
/// queries and `seqlen_k` keys, as the GPU forward kernel draws it: `[batch, heads_q,
/// seqlen_q, seqlen_k]` row-major, 1 where the probability is kept. It runs the dropout forward
/// kernel itself, `⌈seqlen_k / 32⌉` times, with Q = K = 0 (every probability `1/seqlen_k`) and
/// V the identity on 32 keys at a time, so that O is the mask scaled: O(B·H·Nq·Nk) time and
/// memory, for tests at small sizes. `cpu::dropout_mask` gives the same mask on the host.
/// Errors as [`crate::flash_attn`] for these sizes, and [`FlashError::Param`] for an invalid
/// or zero `p`.
pub fn flash_attn_dropout_mask(
    dev: &Device,
    [batch, heads_q, seqlen_q, seqlen_k]: [usize; 4],
    dropout: &Dropout,
) -> Result<Vec<u8>> {
    let params = AttnParams {
        dropout: Some(*dropout),
        ..AttnParams::default()
    };
    if params.active_dropout()?.is_none() {
        return Err(FlashError::Param(
            "the dropout mask needs a dropout probability above 0".into(),
        ));
    }
    let d = KEYS_PER_CALL;
    let mut mask = vec![0u8; batch * heads_q * seqlen_q * seqlen_k];
    if mask.is_empty() {
        return Ok(mask);
    }
    let zeros = DeviceTensor::<f16>::zeros(dev, &[batch, seqlen_q, heads_q, d])?;
    let keys = DeviceTensor::<f16>::zeros(dev, &[batch, seqlen_k, heads_q, d])?;
    for key0 in (0..seqlen_k).step_by(d) {
        // V[b, j, h, c] = 1 where j = key0 + c: O[b, i, h, c] ≠ 0 exactly when (i, key0 + c)
        // is kept.
        let mut v = vec![f16::ZERO; batch * seqlen_k * heads_q * d];
        for b in 0..batch {
            for c in 0..d.min(seqlen_k - key0) {
                for h in 0..heads_q {
                    v[((b * seqlen_k + key0 + c) * heads_q + h) * d + c] = f16::ONE;
                }
            }
        }
        let v = DeviceTensor::from_host(dev, &[batch, seqlen_k, heads_q, d], &v)?;
        let (o, _) = crate::flash_attn(dev, &zeros, &keys, &v, &params)?;
        let o = o.to_host(dev)?;
        for b in 0..batch {
            for i in 0..seqlen_q {
                for h in 0..heads_q {
                    for c in 0..d.min(seqlen_k - key0) {
                        let kept = o[((b * seqlen_q + i) * heads_q + h) * d + c] != f16::ZERO;
                        let at = ((b * heads_q + h) * seqlen_q + i) * seqlen_k + key0 + c;
                        mask[at] = kept as u8;
                    }
                }
            }
        }
    }
    Ok(mask)
}
