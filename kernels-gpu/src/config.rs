//! Tile shapes. The kernels take them as const generics and the host reads the same values to
//! size the grid and the shared memory; which tile each kernel uses is declared in
//! [`crate::registry`].

/// Threads in a warp.
pub const WARP_SIZE: usize = 32;

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
}

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
        }
    }

    /// Elements per shared-memory row: the head dim rounded up to a power of two, so the
    /// XOR swizzle (see [`crate::swizzle`]) stays inside the row.
    pub const fn smem_pitch(&self) -> usize {
        self.head_dim.next_power_of_two()
    }

    /// Threads per block.
    pub const fn threads(&self) -> usize {
        self.warps * WARP_SIZE
    }

    /// Dynamic shared memory in bytes: the Q tile and two (K, V) tile pairs (double buffer).
    pub const fn smem_bytes(&self) -> usize {
        2 * self.smem_pitch() * (self.block_m + 4 * self.block_n)
    }
}

/// Tile shape of one backward instantiation: a block owns `block_n` keys (16 per warp) and
/// walks the query tiles of `block_m` rows that see them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdTile {
    /// Compiled head dim.
    pub head_dim: usize,
    /// Keys per block (`16 · warps`).
    pub block_n: usize,
    /// Queries per step of the block's loop.
    pub block_m: usize,
    /// Warps per block.
    pub warps: usize,
}

impl BwdTile {
    /// The tile for `head_dim` from the registry's `(warps, block_m)`.
    pub const fn new(head_dim: usize, shape: (usize, usize)) -> Self {
        let (warps, block_m) = shape;
        Self {
            head_dim,
            block_n: warps * MMA_M,
            block_m,
            warps,
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

    /// The 8-column dQ tiles a warp computes at a time: all of them up to d = 64, four above
    /// (the dK and dV accumulators already hold `d` registers per thread; wider slices spill
    /// at d = 128 on sm_90a).
    pub const fn dq_tiles(&self) -> usize {
        let tiles = self.head_dim / 8;
        if tiles > 8 {
            4
        } else {
            tiles
        }
    }

    /// Dynamic shared memory in bytes: K and V `[block_n][pitch]`, Q and dO
    /// `[block_m][pitch]`, dSᵀ `[block_n][block_m]` (16-bit), then LSE and D (`block_m` f32
    /// each).
    pub const fn smem_bytes(&self) -> usize {
        2 * (2 * self.block_n * self.smem_pitch()
            + 2 * self.block_m * self.smem_pitch()
            + self.block_n * self.block_m)
            + 2 * 4 * self.block_m
    }
}

/// Threads per block of the backward's pre-pass and dQ conversion kernels.
pub const BWD_AUX_THREADS: usize = 256;

/// Name of the strided ⇄ packed layout kernel.
pub const PAD_KERNEL_NAME: &str = "pad_copy_b16";

/// Threads per block of the layout kernel.
pub const PAD_THREADS: usize = 256;
