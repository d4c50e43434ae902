//! Tile shapes of the forward kernel per compiled head dim. The kernels take them as const
//! generics and the host reads the same values to size the grid and the shared memory.

/// Head dims that have a compiled kernel. Any other `d ≤ 256` runs on the next larger one.
pub const COMPILED_HEAD_DIMS: [usize; 5] = [32, 64, 96, 128, 256];

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

/// The PTX targets, each with its own tile table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `sm_80` PTX: Ampere and Ada (and anything newer than Hopper, through the driver JIT).
    Sm80,
    /// `sm_90a` PTX: Hopper (compute capability 9.0 exactly).
    Sm90a,
}

impl Arch {
    /// The arch this crate is being compiled for: set by `cargo xtask build-ptx` through
    /// `--cfg flash_arch="…"`; `Sm80` elsewhere.
    pub const fn current() -> Arch {
        if cfg!(flash_arch = "sm90a") {
            Arch::Sm90a
        } else {
            Arch::Sm80
        }
    }
}

/// The tile shape used for a compiled head dim on `arch`; `None` when `head_dim` is not
/// compiled.
pub const fn fwd_tile(arch: Arch, head_dim: usize) -> Option<FwdTile> {
    // (warps, m_tiles, block_n, q_in_regs). Hopper's register allocation fits 64-key tiles at
    // d = 128 without spills (measured faster: docs/perf-notes.md); sm_80..sm_89 spill there.
    let (warps, m_tiles, block_n, q_in_regs) = match (arch, head_dim) {
        (_, 32) => (4, 2, 64, true),
        (_, 64) => (4, 2, 64, true),
        (_, 96) => (4, 2, 32, false),
        (Arch::Sm80, 128) => (4, 2, 32, false),
        (Arch::Sm90a, 128) => (4, 2, 64, false),
        (_, 256) => (4, 1, 16, false),
        _ => return None,
    };
    Some(FwdTile {
        head_dim,
        block_m: warps * MMA_M * m_tiles,
        block_n,
        warps,
        m_tiles,
        q_in_regs,
    })
}

/// The compiled head dim a caller's `head_dim` runs on (the smallest compiled one ≥ it), or
/// `None` for 0 and for anything above 256.
pub const fn compiled_head_dim(head_dim: usize) -> Option<usize> {
    let mut i = 0;
    while i < COMPILED_HEAD_DIMS.len() {
        if head_dim > 0 && head_dim <= COMPILED_HEAD_DIMS[i] {
            return Some(COMPILED_HEAD_DIMS[i]);
        }
        i += 1;
    }
    None
}

/// The tile of `head_dim` for the arch being compiled: shorthand for the kernels' const generic
/// arguments; panics at compile time for a head dim that has no tile.
pub const fn tile(head_dim: usize) -> FwdTile {
    match fwd_tile(Arch::current(), head_dim) {
        Some(t) => t,
        None => panic!("no tile for this head dim"),
    }
}

/// Name of the forward entry point for a dtype (`bf16` or f16) and a compiled head dim.
pub const fn fwd_kernel_name(bf16: bool, head_dim: usize) -> Option<&'static str> {
    Some(match (bf16, head_dim) {
        (false, 32) => "flash_fwd_f16_d32",
        (false, 64) => "flash_fwd_f16_d64",
        (false, 96) => "flash_fwd_f16_d96",
        (false, 128) => "flash_fwd_f16_d128",
        (false, 256) => "flash_fwd_f16_d256",
        (true, 32) => "flash_fwd_bf16_d32",
        (true, 64) => "flash_fwd_bf16_d64",
        (true, 96) => "flash_fwd_bf16_d96",
        (true, 128) => "flash_fwd_bf16_d128",
        (true, 256) => "flash_fwd_bf16_d256",
        _ => return None,
    })
}

/// Name of the strided ⇄ packed layout kernel.
pub const PAD_KERNEL_NAME: &str = "pad_copy_b16";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tile_is_consistent() {
        for (arch, d) in [Arch::Sm80, Arch::Sm90a]
            .into_iter()
            .flat_map(|a| COMPILED_HEAD_DIMS.map(|d| (a, d)))
        {
            let t = fwd_tile(arch, d).unwrap();
            assert_eq!(t.block_m, t.warps * MMA_M * t.m_tiles);
            assert_eq!(t.block_n % 16, 0);
            assert_eq!(d % 16, 0);
            // fits the smallest opt-in shared memory of the targets (sm_86/sm_89: 99 KiB)
            assert!(t.smem_bytes() <= 99 * 1024, "d={d}: {}", t.smem_bytes());
        }
    }

    #[test]
    fn head_dims_round_up() {
        assert_eq!(compiled_head_dim(0), None);
        assert_eq!(compiled_head_dim(1), Some(32));
        assert_eq!(compiled_head_dim(64), Some(64));
        assert_eq!(compiled_head_dim(65), Some(96));
        assert_eq!(compiled_head_dim(200), Some(256));
        assert_eq!(compiled_head_dim(257), None);
    }
}
