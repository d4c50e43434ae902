//! Parameters of the forward family.

use super::{DropoutArgs, MaskArgs, RowStatsRef, SeqDims, TensorRef};

/// Parameters of the forward kernels (`flash_fwd_*`).
///
/// Q is `[batch, seqlen_q, heads_q, head_dim]`, K and V are `[batch, seqlen_k, heads_kv,
/// head_dim]`, O has Q's shape and LSE is `[batch, heads_q, seqlen_q]` f32 (natural log).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FwdParams {
    /// Queries.
    pub q: TensorRef,
    /// Keys.
    pub k: TensorRef,
    /// Values.
    pub v: TensorRef,
    /// Output (written).
    pub o: TensorRef,
    /// Log-sum-exp per query row (written).
    pub lse: RowStatsRef,
    /// Sizes.
    pub dims: SeqDims,
    /// `softmax_scale · log2(e)`: scores are scaled once into the base-2 domain (`log2 e`
    /// for masks that apply the softmax scale themselves, see [`crate::mask::ScoredMask`]).
    pub scale_log2: f32,
    /// Keeps `mask` 8-byte aligned without implicit padding.
    pub reserved: u32,
    /// Mask arguments.
    pub mask: MaskArgs,
    /// Dropout arguments (read by the dropout kernels only).
    pub dropout: DropoutArgs,
}

const _: () = assert!(core::mem::size_of::<FwdParams>() == 4 * 32 + 24 + 24 + 64 + 8 + 32);
const _: () = assert!(core::mem::offset_of!(FwdParams, lse) == 128);
const _: () = assert!(core::mem::offset_of!(FwdParams, dims) == 152);
const _: () = assert!(core::mem::offset_of!(FwdParams, mask) == 184);
