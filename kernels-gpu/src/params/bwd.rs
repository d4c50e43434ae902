//! Parameters of the backward family (the pre-pass, the main kernel and the dQ conversion).

use super::{DropoutArgs, MaskArgs, RowStatsRef, SeqDims, TensorRef};

/// Parameters of the backward kernels (`flash_bwd_*`), one struct for the three launches.
///
/// Q, O, dO and dQ are `[batch, seqlen_q, heads_q, head_dim]`; K, V, dK and dV are
/// `[batch, seqlen_k, heads_kv, head_dim]`, all 16-bit. LSE and D (= rowsum(dO ∘ O)) are f32
/// `[batch, heads_q, seqlen_q]`. `dq_accum` is the f32 `[batch, seqlen_q_padded, heads_q,
/// kernel_head_dim]` accumulator (strides in f32 elements), with `seqlen_q` rounded up to
/// whole query tiles (`BwdTile::block_m`) and the head dim the kernel's compiled one
/// (`BwdTile::head_dim`): the main kernel adds whole tiles without bounds checks. It must be
/// zero before the main kernel, as must the deterministic mode's turn counters.
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
    /// f32 dQ accumulators (atomic adds of the main kernel).
    pub dq_accum: TensorRef,
    /// The forward's log-sum-exp (natural log).
    pub lse: RowStatsRef,
    /// D = rowsum(dO ∘ O) (written by the pre-pass).
    pub delta: RowStatsRef,
    /// Sizes.
    pub dims: SeqDims,
    /// `softmax_scale · log2(e)`.
    pub scale_log2: f32,
    /// `softmax_scale` (dS = P ∘ (dP − D) is scaled by it into dQ and dK; 1 for masks that
    /// fold the scale into the derivative of their scores, see [`crate::mask::AttnMask`]).
    pub scale: f32,
    /// Mask arguments.
    pub mask: MaskArgs,
    /// Deterministic mode: device address of the u32 turn counters `[batch, heads_q,
    /// ⌈seqlen_q / block_m⌉]` (zeroed; the blocks add to each query tile of dQ in turn, see
    /// the kernel docs); 0 in fast mode (atomic adds in any order).
    pub dq_order: u64,
    /// Deterministic mode, `wgmma` kernels: how many (batch, KV head) pairs the launch order
    /// interleaves (at least 1; see the kernels' `order` module): the blocks of one pair
    /// start this many blocks apart, so each finds the tile before it in turn already under
    /// way. Unused in fast mode and by the `mma.sync` kernels.
    pub order_heads: u32,
    /// Fast mode, block-sparse kernels: where the key tile each block takes is, in u32 words
    /// after `mask.mask_bits` (the host copies the order after the mask's words), `[batch,
    /// heads_kv, ⌈seqlen_k / block_n⌉]`: a permutation of each (batch, KV head)'s key tiles,
    /// those that visit the most query blocks first, so that a launch's last blocks are its
    /// shortest; 0 for grid order. Unused in deterministic mode and by other masks.
    pub key_tile_order: u32,
    /// Dropout arguments (read by the dropout kernels only).
    pub dropout: DropoutArgs,
}

const _: () = assert!(core::mem::size_of::<BwdParams>() == 9 * 32 + 2 * 24 + 24 + 8 + 64 + 16 + 32);
const _: () = assert!(core::mem::offset_of!(BwdParams, lse) == 288);
const _: () = assert!(core::mem::offset_of!(BwdParams, dims) == 336);
