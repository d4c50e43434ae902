//! Launch parameters, passed by value to the kernels. `#[repr(C)]` and defined only here: the
//! host fills these structs and the kernels read them, so both sides compile this one file.

/// Bit set in [`FwdParams::flags`] for causal masking (aligned to the bottom-right corner).
pub const FLAG_CAUSAL: u32 = 1;

/// Element strides of one 4-D tensor laid out as `[batch, seq, head, dim]` (dim contiguous).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Strides {
    /// Elements between consecutive batch entries.
    pub batch: u64,
    /// Elements between consecutive sequence positions.
    pub row: u64,
    /// Elements between consecutive heads.
    pub head: u64,
}

impl Strides {
    /// Element offset of `(batch, row, head, 0)`, in 64-bit arithmetic so tensors past 2³¹
    /// elements index correctly.
    #[inline(always)]
    pub fn offset(&self, batch: u32, row: u32, head: u32) -> u64 {
        batch as u64 * self.batch + row as u64 * self.row + head as u64 * self.head
    }
}

/// Parameters of the forward kernels (`flash_fwd_*`).
///
/// Q is `[batch, seqlen_q, heads_q, head_dim]`, K and V are `[batch, seqlen_k, heads_kv,
/// head_dim]`, O has Q's shape and LSE is `[batch, heads_q, seqlen_q]` f32 (natural log).
/// Pointers are device addresses; every row start must be 16-byte aligned (the host checks).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FwdParams {
    /// Device address of Q.
    pub q: u64,
    /// Device address of K.
    pub k: u64,
    /// Device address of V.
    pub v: u64,
    /// Device address of O (written).
    pub o: u64,
    /// Device address of the f32 LSE (written).
    pub lse: u64,
    /// Strides of Q.
    pub q_strides: Strides,
    /// Strides of K.
    pub k_strides: Strides,
    /// Strides of V.
    pub v_strides: Strides,
    /// Strides of O.
    pub o_strides: Strides,
    /// Elements between consecutive batch entries of LSE.
    pub lse_batch_stride: u64,
    /// Elements between consecutive heads of LSE (rows are contiguous).
    pub lse_head_stride: u64,
    /// Batch size.
    pub batch: u32,
    /// Number of query heads.
    pub heads_q: u32,
    /// Number of key/value heads (divides `heads_q`).
    pub heads_kv: u32,
    /// Query sequence length.
    pub seqlen_q: u32,
    /// Key/value sequence length.
    pub seqlen_k: u32,
    /// The caller's head dim (≤ the kernel's compiled head dim; the rest is zero-padded).
    pub head_dim: u32,
    /// `softmax_scale · log2(e)`: scores are scaled once into the base-2 domain.
    pub scale_log2: f32,
    /// `FLAG_*` bits.
    pub flags: u32,
}

impl FwdParams {
    /// Whether causal masking is on.
    #[inline(always)]
    pub fn causal(&self) -> bool {
        self.flags & FLAG_CAUSAL != 0
    }
}

const _: () = assert!(core::mem::size_of::<Strides>() == 24);
const _: () = assert!(core::mem::size_of::<FwdParams>() == 40 + 4 * 24 + 16 + 32);
const _: () = assert!(core::mem::offset_of!(FwdParams, q_strides) == 40);
const _: () = assert!(core::mem::offset_of!(FwdParams, lse_batch_stride) == 136);
const _: () = assert!(core::mem::offset_of!(FwdParams, batch) == 152);
const _: () = assert!(core::mem::offset_of!(FwdParams, flags) == 180);

/// Parameters of the layout kernel (`pad_copy_b16`) that gathers a strided, possibly unaligned
/// `[batch, seq, head, dim]` tensor of 16-bit elements into a contiguous one whose dim is padded
/// with zeros to `dst_dim`, or scatters it back (`flags & PAD_SCATTER`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PadParams {
    /// Device address of the strided tensor.
    pub strided: u64,
    /// Device address of the contiguous, padded tensor.
    pub packed: u64,
    /// Strides of the strided tensor.
    pub strides: Strides,
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

const _: () = assert!(core::mem::size_of::<PadParams>() == 16 + 24 + 24);
