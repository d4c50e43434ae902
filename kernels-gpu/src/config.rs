//! Tile shapes. The kernels take them as const generics and the host reads the same values to
//! size the grid and the shared memory; which tile each kernel uses is declared in
//! [`crate::registry`].

/// Threads in a warp.
pub const WARP_SIZE: usize = 32;

/// Dynamic shared memory of the `wgmma` layout probe (`wgmma_probe_*`): A `[64][64]`,
/// B `[176][64]` and V `[128][128]` of 16-bit elements.
pub const PROBE_SMEM_BYTES: usize = 2 * (64 * 64 + 176 * 64 + 128 * 128);

/// Threads of the `wgmma` layout probe (one warpgroup).
pub const PROBE_THREADS: usize = 128;

/// Rows of one `mma.m16n8k16` tile (its M).
pub const MMA_M: usize = 16;

/// Tile shape of one forward instantiation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FwdTile {
    /// Compiled head dim (the padded `d`).
    pub head_dim: usize,
    /// Query rows per thread block (BLOCK_M); `warps · 16 · m_tiles`.
    pub block_m: usize,
    /// Keys per K/V tile (BLOCK_N).
    pub block_n: usize,
    /// Warps per block; each owns `16 · m_tiles` query rows.
    pub warps: usize,
    /// 16-row `mma` tiles per warp. Two halve the shared-memory reads of K and V per `mma`
    /// (each B fragment feeds both), at the cost of twice the accumulator registers.
    pub m_tiles: usize,
    /// Keep the Q fragments in registers for the whole key loop (else re-read from shared
    /// memory at every step, which saves registers for large head dims).
    pub q_in_regs: bool,
    /// (K, V) tile pairs in the shared-memory ring: 2 (double buffer) for the `mma.sync`
    /// kernels, 3 for the `wgmma` ones (which read two tiles' K and V at once), 2 where 3
    /// do not fit.
    pub kv_stages: usize,
    /// Warps that only load tiles (Hopper's warp-specialised kernels: one warpgroup), beside
    /// the `warps` that compute; their `mbarrier`s follow the tiles in shared memory.
    pub producer_warps: usize,
    /// Persistent blocks (Hopper's warp-specialised kernels): about one block per SM, each
    /// taking query tiles one after another from a counter, the next tile's loads overlapping
    /// the current one's end; else one block per query tile.
    pub persistent: bool,
    /// O leaves through shared memory (Hopper's warp-specialised kernels where it fits beside
    /// a ring of three): each consumer warp stages its 16 rows with `stmatrix` and stores
    /// them 16 bytes per lane; else 4 bytes per store from registers.
    pub staged_output: bool,
}

/// Bytes of `mbarrier`s after the tiles of a kernel with producer warps: Q's, then K's and
/// V's arrival and free signals of each stage of a ring of up to 3 (8 bytes each), then (the
/// persistent kernels) Q's free signal, two slots for the block's query tiles (alternate
/// tiles), and the arrival and free signals of a second warpgroup's part of Q.
pub const TMA_BARRIER_BYTES: usize = 8 * (1 + 4 * 3) + 32;

impl FwdTile {
    /// The tile for `head_dim` from the registry's `(warps, m_tiles, block_n, q_in_regs)`.
    pub const fn new(head_dim: usize, shape: (usize, usize, usize, bool)) -> Self {
        let (warps, m_tiles, block_n, q_in_regs) = shape;
        Self {
            head_dim,
            block_m: warps * MMA_M * m_tiles,
            block_n,
            warps,
            m_tiles,
            q_in_regs,
            kv_stages: 2,
            producer_warps: 0,
            persistent: false,
            staged_output: false,
        }
    }

    /// This tile with O staged through shared memory (see [`FwdTile::staged_output`]).
    pub const fn with_staged_output(self) -> Self {
        Self {
            staged_output: true,
            ..self
        }
    }

    /// This tile with persistent blocks (see [`FwdTile::persistent`]) if `persistent`.
    pub const fn with_persistent(self, persistent: bool) -> Self {
        Self { persistent, ..self }
    }

    /// This tile with `stages` (K, V) pairs in the shared-memory ring.
    pub const fn with_kv_stages(self, stages: usize) -> Self {
        Self {
            kv_stages: stages,
            ..self
        }
    }

    /// This tile with `warps` producer warps (see [`FwdTile::producer_warps`]).
    pub const fn with_producer_warps(self, warps: usize) -> Self {
        Self {
            producer_warps: warps,
            ..self
        }
    }

    /// Elements per shared-memory row: the head dim rounded up to a power of two, so the
    /// XOR swizzle (see [`crate::swizzle`]) stays inside the row.
    pub const fn smem_pitch(&self) -> usize {
        self.head_dim.next_power_of_two()
    }

    /// Threads per block (producer warps included).
    pub const fn threads(&self) -> usize {
        (self.warps + self.producer_warps) * WARP_SIZE
    }

    /// Dynamic shared memory in bytes: the Q tile and `kv_stages` (K, V) tile pairs, with
    /// [`FwdTile::staged_output`] the O stage (`[block_m][pitch]`), then the barriers of a
    /// kernel with producer warps.
    pub const fn smem_bytes(&self) -> usize {
        let barriers = if self.producer_warps > 0 {
            TMA_BARRIER_BYTES
        } else {
            0
        };
        let output = if self.staged_output { self.block_m } else { 0 };
        2 * self.smem_pitch() * (self.block_m + 2 * self.kv_stages * self.block_n + output)
            + barriers
    }
}

/// Tile shape of one backward instantiation: a block owns `block_n` keys (16 per key warp)
/// and walks the query tiles of `block_m` rows that see them. With `d_split > 1`, that many
/// warps share each 16 keys, each accumulating dK and dV for `head_dim / d_split` columns
/// (they all compute the keys' Sᵀ and dPᵀ: registers for large head dims, at the cost of
/// recomputing two of the five products).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdTile {
    /// Compiled head dim.
    pub head_dim: usize,
    /// Keys per block (`16 · key_warps`).
    pub block_n: usize,
    /// Queries per step of the block's loop.
    pub block_m: usize,
    /// Warps per block (`key_warps · d_split`).
    pub warps: usize,
    /// Warps sharing each 16 keys (each owns a slice of dK's and dV's columns).
    pub d_split: usize,
    /// dQ of each query tile goes through shared memory (`[block_m][head_dim + 8]` f32) and
    /// into the accumulator by the bulk copy engine, one reduction per row (sm_90), instead
    /// of by atomic adds from registers.
    pub staged_dq: bool,
    /// The block keeps its (KV head, batch, key tile) in [`BWD_BLOCK_RECORD_BYTES`] at the end
    /// of its shared memory (the `wgmma` kernels, whose deterministic launch order computes
    /// them).
    pub block_record: bool,
}

/// Bytes of the backward block's record of its (KV head, batch, key tile)
/// ([`BwdTile::block_record`]).
pub const BWD_BLOCK_RECORD_BYTES: usize = 16;

impl BwdTile {
    /// The tile for `head_dim` from the registry's `(key_warps, d_split, block_m, staged_dq)`.
    pub const fn new(head_dim: usize, shape: (usize, usize, usize, bool)) -> Self {
        let (key_warps, d_split, block_m, staged_dq) = shape;
        Self {
            head_dim,
            block_n: key_warps * MMA_M,
            block_m,
            warps: key_warps * d_split,
            d_split,
            staged_dq,
            block_record: false,
        }
    }

    /// The same tile with the block's record ([`BwdTile::block_record`]).
    pub const fn with_block_record(self) -> Self {
        Self {
            block_record: true,
            ..self
        }
    }

    /// Elements per shared-memory row of the Q, dO, K and V tiles.
    pub const fn smem_pitch(&self) -> usize {
        self.head_dim.next_power_of_two()
    }

    /// Threads per block.
    pub const fn threads(&self) -> usize {
        self.warps * WARP_SIZE
    }

    /// Warps sharing one 16-row group of a query tile's dQ (each computes `dq_cols()` of its
    /// columns).
    pub const fn dq_col_groups(&self) -> usize {
        self.warps / (self.block_m / MMA_M)
    }

    /// dQ columns per warp.
    pub const fn dq_cols(&self) -> usize {
        self.head_dim / self.dq_col_groups()
    }

    /// The 8-column dQ tiles a warp computes at a time: two when the dK and dV accumulators
    /// already hold 96 or more registers per thread (`head_dim / d_split`; wider dQ slices
    /// spill there) and the warp's slice is wider than four, else all of its `dq_cols()` up to
    /// 64, else four.
    pub const fn dq_tiles(&self) -> usize {
        let tiles = self.dq_cols() / 8;
        if self.head_dim / self.d_split >= 96 && tiles > 4 {
            2
        } else if tiles > 8 {
            4
        } else {
            tiles
        }
    }

    /// The 8-query tiles of dPᵀ and dSᵀ a warp computes at a time: half the query tile when
    /// the dK and dV accumulators hold 128 or more registers per thread or the query tile has
    /// 128 rows (Sᵀ alone holds 64), else all of it.
    pub const fn dp_tiles(&self) -> usize {
        if self.head_dim / self.d_split >= 128 || self.block_m >= 128 {
            self.block_m / 16
        } else {
            self.block_m / 8
        }
    }

    /// Whether the shape is one the kernel supports: query tiles of whole warps' 16 rows, at
    /// most one 16-row dQ group per warp, dQ and dK/dV column slices of whole 16-column pairs,
    /// dPᵀ computed in whole pairs of 8-query tiles.
    pub const fn is_valid(&self) -> bool {
        let row_groups = self.block_m / MMA_M;
        self.block_m.is_multiple_of(MMA_M)
            && row_groups > 0
            && self.warps.is_multiple_of(row_groups)
            && self.head_dim.is_multiple_of(16 * self.dq_col_groups())
            && (self.dq_cols() / 8).is_multiple_of(self.dq_tiles())
            && self.head_dim.is_multiple_of(16 * self.d_split)
            && self.dp_tiles().is_multiple_of(2)
            && (self.block_m / 8).is_multiple_of(self.dp_tiles())
    }

    /// Dynamic shared memory in bytes: K and V `[block_n][pitch]`, two buffers of Q and dO
    /// `[block_m][pitch]` (the next query tile loads while this one is computed), dSᵀ
    /// `[block_n][block_m]` (16-bit), two buffers of LSE and D (`block_m` f32 each), then
    /// with `staged_dq` the dQ stage `[block_m][dq_stage_pitch]` f32, and with `block_record`
    /// the block's record.
    pub const fn smem_bytes(&self) -> usize {
        let stage = if self.staged_dq {
            self.block_m * self.dq_stage_pitch() * 4
        } else {
            0
        };
        let record = if self.block_record {
            BWD_BLOCK_RECORD_BYTES
        } else {
            0
        };
        2 * (2 * self.block_n * self.smem_pitch()
            + 4 * self.block_m * self.smem_pitch()
            + self.block_n * self.block_m)
            + 2 * 2 * 4 * self.block_m
            + stage
            + record
    }

    /// f32 elements per row of the dQ stage: the head dim plus 8, so that the eight rows one
    /// `st.shared.v2` of a warp touches fall on distinct banks (16-byte aligned rows, as the
    /// bulk engine needs).
    pub const fn dq_stage_pitch(&self) -> usize {
        self.head_dim + 8
    }
}

/// Threads per block of the backward's dQ conversion kernel.
pub const BWD_AUX_THREADS: usize = 256;

/// Warps per block of the backward's pre-pass: each stages its [`BWD_PREP_TOKENS`] tokens'
/// rows of O and dO in shared memory ([`bwd_prep_smem`]); two keep a block's stages within
/// 48 KB at d = 256.
pub const BWD_PREP_WARPS: usize = 2;

/// Threads per block of the backward's pre-pass.
pub const BWD_PREP_THREADS: usize = BWD_PREP_WARPS * 32;

/// Tokens per warp and step of the backward's pre-pass: the rows of one `mma` tile.
pub const BWD_PREP_TOKENS: usize = MMA_M;

/// Bytes per staged row of the pre-pass: the head dim rounded up to 16 columns, 2 bytes each,
/// plus 16 so that the 8 rows one fragment load touches fall on distinct banks.
pub const fn bwd_prep_pitch(head_dim: usize) -> usize {
    head_dim.div_ceil(16) * 16 * 2 + 16
}

/// Dynamic shared memory of the pre-pass: per warp, [`BWD_PREP_TOKENS`] rows of O, then as
/// many of dO.
pub const fn bwd_prep_smem(head_dim: usize) -> usize {
    BWD_PREP_WARPS * 2 * BWD_PREP_TOKENS * bwd_prep_pitch(head_dim)
}

/// Grid of the pre-pass: `x` blocks of [`BWD_PREP_WARPS`] warps, one warp per
/// [`BWD_PREP_TOKENS`] tokens of a head (a grid-stride loop covers the rest past 2²⁰ blocks),
/// `y` the query heads.
pub const fn bwd_prep_grid(tokens: usize, heads: usize) -> (u32, u32, u32) {
    per_head_grid(
        tokens.div_ceil(BWD_PREP_TOKENS).div_ceil(BWD_PREP_WARPS),
        heads,
    )
}

/// `(blocks, heads, 1)` with `blocks` clamped to `1 ..= 2²⁰` (the backward's passes loop over
/// what a smaller grid leaves).
const fn per_head_grid(blocks: usize, heads: usize) -> (u32, u32, u32) {
    let blocks = if blocks < 1 {
        1
    } else if blocks > 1 << 20 {
        1 << 20
    } else {
        blocks
    };
    (blocks as u32, heads as u32, 1)
}

/// Lanes of the backward's dQ conversion per (token, head) row: one per 8
/// elements of the (8-aligned) head dim, rounded up to a power of two; at most 32 for head
/// dims up to 256, so a row never straddles two warps.
pub const fn bwd_aux_lanes(head_dim: usize) -> usize {
    head_dim.div_ceil(8).next_power_of_two()
}

/// Grid of the conversion: `x` blocks of [`BWD_AUX_THREADS`] over the
/// `tokens · bwd_aux_lanes(head_dim)` lanes of one head (a grid-stride loop covers the rest),
/// `y` the query heads.
pub const fn bwd_aux_grid(tokens: usize, heads: usize, head_dim: usize) -> (u32, u32, u32) {
    per_head_grid(
        (tokens * bwd_aux_lanes(head_dim)).div_ceil(BWD_AUX_THREADS),
        heads,
    )
}

/// Name of the strided ⇄ packed layout kernel.
pub const PAD_KERNEL_NAME: &str = "pad_copy_b16";

/// Threads per block of the layout kernel.
pub const PAD_THREADS: usize = 256;

/// Keys per warp step of the decode kernel: one `ldmatrix` row group of K and V, and the
/// granularity of pages (a page holds whole steps, so each step reads one page).
pub const DECODE_WARP_KEYS: usize = 16;

/// Tile shape of one decode instantiation: a block holds `16 · m_tiles` packed query rows
/// (the query heads of one KV head × the new tokens) and its `warps` warps split the keys,
/// each streaming steps of [`DECODE_WARP_KEYS`] keys through its own `stages`-deep ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeTile {
    /// Compiled head dim.
    pub head_dim: usize,
    /// 16-row `mma` tiles per warp (every warp holds all of the block's rows).
    pub m_tiles: usize,
    /// Warps per block.
    pub warps: usize,
    /// Buffers in each warp's K/V ring (`stages − 1` steps are in flight).
    pub stages: usize,
    /// Keep the Q fragments in registers (else re-read from shared memory at every step).
    pub q_in_regs: bool,
}

impl DecodeTile {
    /// The tile for `head_dim` from the registry's `(m_tiles, warps, stages, q_in_regs)`.
    pub const fn new(head_dim: usize, shape: (usize, usize, usize, bool)) -> Self {
        let (m_tiles, warps, stages, q_in_regs) = shape;
        Self {
            head_dim,
            m_tiles,
            warps,
            stages,
            q_in_regs,
        }
    }

    /// Packed query rows per block.
    pub const fn block_m(&self) -> usize {
        MMA_M * self.m_tiles
    }

    /// Elements per shared-memory row.
    pub const fn smem_pitch(&self) -> usize {
        self.head_dim.next_power_of_two()
    }

    /// Threads per block.
    pub const fn threads(&self) -> usize {
        self.warps * WARP_SIZE
    }

    /// Bytes of the K/V rings: per warp, `stages` buffers of K and V `[16][pitch]`.
    pub const fn ring_bytes(&self) -> usize {
        self.warps * self.stages * 2 * DECODE_WARP_KEYS * self.smem_pitch() * 2
    }

    /// Bytes of the end-of-block merge, which reuses the rings: every warp's f32 O
    /// `[block_m][head_dim]`, then its row maxima and sums.
    pub const fn merge_bytes(&self) -> usize {
        self.warps * self.block_m() * (self.head_dim + 2) * 4
    }

    /// Dynamic shared memory in bytes: the Q tile `[block_m][pitch]`, then the rings (or the
    /// merge area, whichever is larger).
    pub const fn smem_bytes(&self) -> usize {
        let ring = self.ring_bytes();
        let merge = self.merge_bytes();
        2 * self.block_m() * self.smem_pitch() + if ring > merge { ring } else { merge }
    }

    /// Whether the kernel supports the shape.
    pub const fn is_valid(&self) -> bool {
        self.m_tiles > 0 && self.warps > 0 && self.stages >= 2 && self.stages <= 4
    }
}

/// Threads per block of the decode combine and merge kernels (one warp per output row).
pub const COMBINE_THREADS: usize = 128;

/// The most key splits the decode path takes (the combine kernel holds 4 per lane).
pub const MAX_DECODE_SPLITS: usize = 128;

/// Threads per block of the cache append kernel.
pub const APPEND_THREADS: usize = 128;
