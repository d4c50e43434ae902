//! Launch parameters, passed by value to the kernels. `#[repr(C)]` and defined only here: the
//! host fills these structs and the kernels read them, so both sides compile these files.
//!
//! Each family has its own struct in its own module (`fwd.rs`, `bwd.rs`, `decode.rs`, `pad.rs`), assembled from the
//! shared sub-structs below: a tensor's address and strides ([`TensorRef`]), the problem's
//! dimensions ([`SeqDims`]), the per-row statistics output ([`RowStatsRef`]) and the mask's
//! arguments ([`MaskArgs`]). Later families (backward, decode) reuse them.

mod bwd;
mod decode;
mod fwd;
mod pad;
mod probe;

pub use bwd::BwdParams;
pub use decode::{AppendParams, CombineParams, DecodeParams, KvLayout};
pub use fwd::{q_box_rows, FwdParams, WgmmaFwdParams, SCHEDULE_PINGPONG, TENSOR_MAP_BYTES};
pub use pad::{PadParams, PAD_SCATTER};
pub use probe::ProbeParams;

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

/// A `[batch, seq, head, dim]` tensor of 16-bit elements: device address and strides. Every
/// row start must be 16-byte aligned (the host checks, or passes a padded copy).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TensorRef {
    /// Device address of element `(0, 0, 0, 0)`.
    pub ptr: u64,
    /// Element strides.
    pub strides: Strides,
}

/// An f32 `[batch, head, seq]` tensor of per-row statistics (the LSE), rows contiguous.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowStatsRef {
    /// Device address.
    pub ptr: u64,
    /// Elements between consecutive batch entries.
    pub batch_stride: u64,
    /// Elements between consecutive heads.
    pub head_stride: u64,
}

impl RowStatsRef {
    /// Element offset of `(batch, head, row)`.
    #[inline(always)]
    pub fn offset(&self, batch: u32, head: u32, row: u32) -> u64 {
        batch as u64 * self.batch_stride + head as u64 * self.head_stride + row as u64
    }
}

/// The problem's dimensions: the same for every sequence of the batch (per-sequence lengths,
/// when they come, are read by the block information, see [`crate::block`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqDims {
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
    /// The caller's head dim, rounded up to a multiple of 8 (≤ the kernel's compiled head dim;
    /// the rest of the tile is zero-filled).
    pub head_dim: u32,
}

/// Arguments of the mask types ([`crate::mask`]); each mask reads what it needs.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaskArgs {
    /// Device address of the f32 ALiBi slopes (`[heads_q]`, or `[batch, heads_q]` with
    /// `alibi_batch_stride = heads_q`), or 0 for none.
    pub alibi_slopes: u64,
    /// Elements between two batch entries' slopes (0: one slope per head for every entry).
    pub alibi_batch_stride: u32,
    /// Keys a query sees before its diagonal ([`crate::mask::UNBOUNDED`]: all).
    pub window_left: u32,
    /// Keys a query sees after its diagonal (0: causal; [`crate::mask::UNBOUNDED`]: all).
    pub window_right: u32,
    /// Logit softcap `cap` (`cap·tanh(x / cap)`), or 0 for none ([`crate::mask::ScoredMask`]).
    pub softcap: f32,
    /// The softmax scale, applied by [`crate::mask::ScoredMask`] before the cap.
    pub scale: f32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Device address of the u32 words of a bit mask: a block-sparse mask's block rows
    /// ([`crate::mask::SparseMask`]) or a tree mask's rows ([`crate::mask::TreeMask`]), or
    /// 0 for none.
    pub mask_bits: u64,
    /// Words between two batch entries' rows (0: one mask for every entry).
    pub bits_batch_stride: u32,
    /// Words between two heads' rows (0: one mask for every head). A block-sparse head's rows
    /// are `⌈seqlen_q / 128⌉` rows of [`crate::mask::sparse_row_words`] words each.
    pub bits_head_stride: u32,
    /// Words between two batch entries' columns of [`MaskArgs::mask_cols`].
    pub cols_batch_stride: u32,
    /// Words between two heads' columns of [`MaskArgs::mask_cols`].
    pub cols_head_stride: u32,
    /// Device address of a block-sparse mask's bits by key block (each head: `⌈seqlen_k /
    /// 128⌉` columns of [`crate::mask::sparse_row_words`]`(seqlen_q)` words), for the
    /// backward's walk over the query tiles of a key tile; 0 for none.
    pub mask_cols: u64,
}

/// Bit set in [`MaskArgs::flags`] for causal masking (aligned to the bottom-right corner):
/// what [`crate::mask::CausalMask`] reads (the window's right side is then 0 as well).
pub const FLAG_CAUSAL: u32 = 1;

/// Bit set in [`MaskArgs::flags`] when a softcap or ALiBi modifies the scores: without it
/// [`crate::mask::ScoredMask`] leaves them alone (a window only), and the softmax takes the
/// scale as the plain kernels do.
pub const FLAG_MODIFIES_SCORES: u32 = 2;

impl MaskArgs {
    /// Whether causal masking is on ([`FLAG_CAUSAL`]).
    #[inline(always)]
    pub fn causal(&self) -> bool {
        self.flags & FLAG_CAUSAL != 0
    }

    /// Whether a softcap or ALiBi modifies the scores ([`FLAG_MODIFIES_SCORES`]).
    #[inline(always)]
    pub fn modifies_scores(&self) -> bool {
        self.flags & FLAG_MODIFIES_SCORES != 0
    }
}

impl Default for MaskArgs {
    /// No mask: every key of the sequence visible, no score modifier.
    fn default() -> Self {
        Self {
            alibi_slopes: 0,
            alibi_batch_stride: 0,
            window_left: crate::mask::UNBOUNDED,
            window_right: crate::mask::UNBOUNDED,
            softcap: 0.0,
            scale: 1.0,
            flags: 0,
            mask_bits: 0,
            bits_batch_stride: 0,
            bits_head_stride: 0,
            cols_batch_stride: 0,
            cols_head_stride: 0,
            mask_cols: 0,
        }
    }
}

/// Attention dropout's arguments ([`crate::rng`]), in the forward and backward parameters;
/// `threshold = 0` with `scale = 1` keeps everything (the kernels without dropout ignore them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DropoutArgs {
    /// Philox seed.
    pub seed: u64,
    /// Philox offset (a second key, so that calls with one seed draw different masks).
    pub offset: u64,
    /// An element is dropped when its 15 random bits are below this: `round(p·2¹⁵)` (see
    /// [`crate::rng`]).
    pub threshold: u32,
    /// `1 / (1 − p)`: what kept probabilities are multiplied by.
    pub scale: f32,
    /// Index in the call of the launch's first sequence (a varlen or key-padded call runs one
    /// launch per run of sequences; the generator counts sequences of the whole call).
    pub batch0: u32,
    /// Keeps the size a multiple of 8 bytes.
    pub reserved: u32,
}

impl DropoutArgs {
    /// The arguments for probability `p ∈ [0, 1)` (checked by the host), `seed` and `offset`,
    /// for a launch whose first sequence is `batch0`.
    pub fn new(p: f32, seed: u64, offset: u64, batch0: u32) -> Self {
        Self {
            seed,
            offset,
            threshold: (p as f64 * crate::rng::THRESHOLD_SCALE + 0.5) as u32,
            scale: (1.0 / (1.0 - p as f64)) as f32,
            batch0,
            reserved: 0,
        }
    }
}

const _: () = assert!(core::mem::size_of::<DropoutArgs>() == 32);
const _: () = assert!(core::mem::size_of::<Strides>() == 24);
const _: () = assert!(core::mem::size_of::<TensorRef>() == 32);
const _: () = assert!(core::mem::size_of::<RowStatsRef>() == 24);
const _: () = assert!(core::mem::size_of::<SeqDims>() == 24);
const _: () = assert!(core::mem::size_of::<MaskArgs>() == 64);
