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
const _: () = assert!(core::mem::size_of::<WgmmaFwdParams>() == 280 + 40);
const _: () = assert!(core::mem::offset_of!(WgmmaFwdParams, tile_counter) == 288);

/// Bytes of one `CUtensorMap` (a TMA descriptor); they are 64-byte aligned.
pub const TENSOR_MAP_BYTES: usize = 128;

/// Rows of the box of Q's tensor map in [`WgmmaFwdParams::tensor_maps`] for a kernel of
/// `block_m` query rows: one consumer warpgroup's 64 in persistent blocks of two consumer
/// warpgroups, which load each warpgroup's part of the next query tile as soon as that
/// warpgroup is done with the current one; else the block's `block_m`.
pub const fn q_box_rows(block_m: usize, persistent: bool) -> usize {
    if persistent && block_m == 128 {
        64
    } else {
        block_m
    }
}

/// Parameters of Hopper's warp-specialised forward kernels (`flash_fwd_wgmma_*`): the
/// forward's, plus the TMA descriptors of Q, K and V, which the host encodes for the same
/// pointers, strides and sizes and leaves in global memory (a descriptor passed by value would
/// be copied to local memory, which TMA cannot read).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WgmmaFwdParams {
    /// The forward's parameters.
    pub fwd: FwdParams,
    /// Device address of three consecutive [`TENSOR_MAP_BYTES`]-byte tensor maps (Q, K, V),
    /// each of rank 4 over `(head_dim, seq, head, batch)` with 64-column boxes and the
    /// 128-byte swizzle: Q's box has [`q_box_rows`] rows, K's and V's the kernel's `block_n`.
    pub tensor_maps: u64,
    /// Persistent kernels ([`crate::config::FwdTile::persistent`]): device address of a u32,
    /// zero at launch, from which the blocks take their query tiles after their first
    /// (block `x` starts with tile `x`; then `nctaid.x + atomicInc(counter, tiles − 1)`, one
    /// increment per tile taken, so that the launch leaves the counter at zero again). Tile `t`
    /// is the one the one-block-per-tile grid runs as block `(t mod tiles_x, t / tiles_x mod
    /// heads_q, t / (tiles_x·heads_q))`. Unused by the other kernels.
    pub tile_counter: u64,
    /// Persistent kernels with a mask that reads memory (block-sparse): device address of
    /// `tiles` u32 query tile indices, a permutation, in the order the blocks take them (block
    /// `x` takes entry `x` first, then entry `nctaid.x + atomicInc(counter, tiles − 1)`), or 0 for
    /// the tiles in their own order. The host's is longest first. Unused by the other kernels.
    pub tile_order: u64,
    /// [`SCHEDULE_PINGPONG`] or 0 (the consumer warpgroups issue their products as they
    /// come).
    pub schedule: u32,
    /// Persistent kernels: query tiles per (head, sequence), the one-block-per-tile grid's x.
    pub tiles_x: u32,
    /// Persistent kernels: query tiles in all, `tiles_x · heads_q · sequences`.
    pub tiles: u32,
    /// Keeps the size a multiple of 8 without implicit padding.
    pub reserved: u32,
}

/// [`WgmmaFwdParams::schedule`]: the two consumer warpgroups take turns issuing their
/// products (named barriers), so one's softmax runs while the other's products do.
pub const SCHEDULE_PINGPONG: u32 = 1;
