//! Parameters of the backward family (the pre-pass, the main kernel and the dQ conversion).

use super::{MaskArgs, RowStatsRef, SeqDims, TensorRef};

/// Parameters of the backward kernels (`flash_bwd_*`), one struct for the three launches.
///
/// Q, O, dO and dQ are `[batch, seqlen_q, heads_q, head_dim]`; K, V, dK and dV are
/// `[batch, seqlen_k, heads_kv, head_dim]`, all 16-bit. LSE and D (= rowsum(dO ∘ O)) are f32
/// `[batch, heads_q, seqlen_q]`. `dq_accum` is an f32 `[batch, seqlen_q, heads_q, head_dim]`
/// accumulator (strides in f32 elements) that must be zero before the main kernel.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BwdParams {
    /// Queries.
    pub q: TensorRef,
    /// Keys.
    pub k: TensorRef,
    /// Values.
    pub v: TensorRef,
    /// The forward's output.
    pub o: TensorRef,
    /// Gradient of the loss with respect to O.
    pub d_o: TensorRef,
    /// dQ (written by the conversion kernel).
    pub dq: TensorRef,
    /// dK (written by the main kernel).
    pub dk: TensorRef,
    /// dV (written by the main kernel).
    pub dv: TensorRef,
    /// f32 dQ accumulator (atomic adds of the main kernel).
    pub dq_accum: TensorRef,
    /// The forward's log-sum-exp (natural log).
    pub lse: RowStatsRef,
    /// D = rowsum(dO ∘ O) (written by the pre-pass).
    pub delta: RowStatsRef,
    /// Sizes.
    pub dims: SeqDims,
    /// `softmax_scale · log2(e)`.
    pub scale_log2: f32,
    /// `softmax_scale` (dS = P ∘ (dP − D) is scaled by it into dQ and dK).
    pub scale: f32,
    /// Mask arguments.
    pub mask: MaskArgs,
}

const _: () = assert!(core::mem::size_of::<BwdParams>() == 9 * 32 + 2 * 24 + 24 + 16);
const _: () = assert!(core::mem::offset_of!(BwdParams, lse) == 288);
const _: () = assert!(core::mem::offset_of!(BwdParams, dims) == 336);
