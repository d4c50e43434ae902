//! Parameters of the layout kernel.

use super::TensorRef;

/// Parameters of the layout kernel (`pad_copy_b16`) that gathers a strided, possibly unaligned
/// `[batch, seq, head, dim]` tensor of 16-bit elements into a contiguous one whose dim is padded
/// with zeros to `packed_dim`, or scatters it back (`flags & PAD_SCATTER`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PadParams {
    /// The strided tensor (any alignment).
    pub strided: TensorRef,
    /// Device address of the contiguous, padded tensor.
    pub packed: u64,
    /// Batch size.
    pub batch: u32,
    /// Sequence length.
    pub seqlen: u32,
    /// Number of heads.
    pub heads: u32,
    /// Valid elements per row in the strided tensor.
    pub dim: u32,
    /// Elements per row in the packed tensor (≥ `dim`; the extra ones are zero).
    pub packed_dim: u32,
    /// `PAD_*` bits.
    pub flags: u32,
}

/// Bit set in [`PadParams::flags`]: copy packed → strided (drops the padding) instead of
/// strided → packed.
pub const PAD_SCATTER: u32 = 1;

const _: () = assert!(core::mem::size_of::<PadParams>() == 32 + 8 + 24);
