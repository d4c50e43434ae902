//! Hopper's warpgroup matrix products (sm_90a, PTX 8.0): `wgmma.mma_async` with f32
//! accumulators and its fence, commit and wait.
//!
//! A warpgroup is 4 consecutive warps starting at a warp index divisible by 4; all 128 threads
//! execute every instruction here together (`.sync.aligned`). For `m64nNk16`, warp `w` of the
//! group holds rows `16w .. 16w + 16` of the 64 × N accumulator in exactly the layout of
//! `mma.m16n8k16` repeated over `N / 8` column tiles (lane `4g + t`: rows `g`, `g + 8`,
//! columns `8j + 2t`, `+1`), so the accumulators are `[[f32; 4]; N / 8]`. An A operand in
//! registers is the `mma.m16n8k16` A fragment of the warp's 16 rows. Operands in shared memory
//! are given by 64-bit matrix descriptors (see [`crate::gmma`]).
//!
//! The product runs asynchronously: after [`wgmma_commit_group`] and [`wgmma_wait_group`] the
//! accumulators are final, and [`wgmma_fence_operands`] keeps the compiler from reading them
//! (or writing them) on the wrong side of those instructions.

use core::arch::asm;

/// Orders this warpgroup's earlier register and shared-memory accesses before the next
/// `wgmma.mma_async` (`wgmma.fence.sync.aligned`): needed before the first product of a batch
/// whose accumulators or A registers were written by other instructions.
///
/// # Safety
/// sm_90a only; the whole warpgroup executes it.
#[inline(always)]
pub unsafe fn wgmma_fence() {
    asm!("wgmma.fence.sync.aligned;", options(nostack));
}

/// Closes the products issued since the last commit into one group
/// (`wgmma.commit_group.sync.aligned`).
///
/// # Safety
/// sm_90a only; the whole warpgroup executes it.
#[inline(always)]
pub unsafe fn wgmma_commit_group() {
    asm!("wgmma.commit_group.sync.aligned;", options(nostack));
}

/// Waits until at most `N` of the warpgroup's product groups are pending
/// (`wgmma.wait_group.sync.aligned N`).
///
/// # Safety
/// sm_90a only; the whole warpgroup executes it.
#[inline(always)]
pub unsafe fn wgmma_wait_group<const N: u32>() {
    asm!("wgmma.wait_group.sync.aligned {n};", n = const N, options(nostack));
}

/// Ties every accumulator register to this point of the instruction stream (an empty asm
/// that reads and writes each): values are neither read before a preceding wait nor
/// written after a following product is issued.
///
/// # Safety
/// Always safe to execute.
#[inline(always)]
pub unsafe fn wgmma_fence_operands<const NT: usize>(d: &mut [[f32; 4]; NT]) {
    for tile in d.iter_mut() {
        for x in tile.iter_mut() {
            asm!(
                "/* wgmma operand {x} */",
                x = inout(reg32) * x,
                options(nomem, nostack)
            );
        }
    }
}

/// The positional operand lists of the accumulators, `{0}` .. `{4·NT − 1}`.
macro_rules! acc_list {
    (8) => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, \
         {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, \
         {30}, {31}"
    };
    (16) => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, \
         {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, \
         {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, \
         {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, \
         {58}, {59}, {60}, {61}, {62}, {63}"
    };
    (22) => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, \
         {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, \
         {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, \
         {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, \
         {57}, {58}, {59}, {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}, {68}, {69}, {70}, \
         {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}, {80}, {81}, {82}, {83}, {84}, \
         {85}, {86}, {87}"
    };
}

/// `wgmma` with both operands in shared memory: `d (+)= A · B` for a 64 × 16 A and a 16 × N
/// B, both K-major (`$tnsp` = `"0, 0"`: A row-major, B stored `[n][k]`, as K for
/// `S = Q·Kᵀ`) or both MN-major (`"1, 1"`: A stored `[k][m]`, B `[k][n]`, as dSᵀ and K for
/// the backward's `dQ = dS·K`).
macro_rules! wgmma_ss {
    ($(#[$doc:meta])* $name:ident, $shape:literal, $n:tt, $ty:literal, $tnsp:literal, [$($t:literal),*]) => {
        $(#[$doc])*
        ///
        /// `accumulate = false` overwrites `d` (`scale-d` = 0) and does not read it, so its old
        /// values need not stay live; pass a compile-time constant.
        ///
        /// # Safety
        /// sm_90a only; the whole warpgroup executes it, after [`wgmma_fence`]; the
        /// descriptors describe live, published shared memory.
        #[inline(always)]
        pub unsafe fn $name(d: &mut [[f32; 4]; $n], a: u64, b: u64, accumulate: bool) {
            if accumulate {
                asm!(
                    concat!(
                        "{{ .reg .pred p; setp.ne.b32 p, {one}, 0; wgmma.mma_async.sync.aligned.",
                        $shape, ".f32.", $ty, ".", $ty, " {{", acc_list!($n),
                        "}}, {a}, {b}, p, 1, 1, ", $tnsp, "; }}"
                    ),
                    $(
                        inout(reg32) d[$t][0], inout(reg32) d[$t][1],
                        inout(reg32) d[$t][2], inout(reg32) d[$t][3],
                    )*
                    a = in(reg64) a,
                    b = in(reg64) b,
                    one = in(reg32) 1u32,
                    options(nostack)
                );
            } else {
                asm!(
                    concat!(
                        "{{ .reg .pred p; setp.ne.b32 p, {zero}, 0; wgmma.mma_async.sync.aligned.",
                        $shape, ".f32.", $ty, ".", $ty, " {{", acc_list!($n),
                        "}}, {a}, {b}, p, 1, 1, ", $tnsp, "; }}"
                    ),
                    $(
                        out(reg32) d[$t][0], out(reg32) d[$t][1],
                        out(reg32) d[$t][2], out(reg32) d[$t][3],
                    )*
                    a = in(reg64) a,
                    b = in(reg64) b,
                    zero = in(reg32) 0u32,
                    options(nostack)
                );
            }
        }
    };
}

/// `wgmma` with A in registers: `d += A · B` for a 64 × 16 A (each warp's `mma.m16n8k16` A
/// fragment of its 16 rows) and a 16 × N B in shared memory stored MN-major (`[k][n]`, as V
/// for `O += P·V`: transposed B).
macro_rules! wgmma_rs {
    ($(#[$doc:meta])* $name:ident, $shape:literal, $n:tt, $ty:literal, [$($t:literal),*]) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// sm_90a only; the whole warpgroup executes it, after [`wgmma_fence`]; the descriptor
        /// describes live, published shared memory.
        #[inline(always)]
        pub unsafe fn $name(d: &mut [[f32; 4]; $n], a: [u32; 4], b: u64) {
            asm!(
                concat!(
                    "{{ .reg .pred p; setp.ne.b32 p, {one}, 0; wgmma.mma_async.sync.aligned.", $shape,
                    ".f32.", $ty, ".", $ty, " {{", acc_list!($n),
                    "}}, {{{a0}, {a1}, {a2}, {a3}}}, {b}, p, 1, 1, 1; }}"
                ),
                $(
                    inout(reg32) d[$t][0], inout(reg32) d[$t][1],
                    inout(reg32) d[$t][2], inout(reg32) d[$t][3],
                )*
                a0 = in(reg32) a[0],
                a1 = in(reg32) a[1],
                a2 = in(reg32) a[2],
                a3 = in(reg32) a[3],
                b = in(reg64) b,
                one = in(reg32) 1u32,
                options(nostack)
            );
        }
    };
}

wgmma_ss!(
    /// `m64n176k16`, f16 inputs.
    wgmma_m64n176k16_ss_f16, "m64n176k16", 22, "f16", "0, 0", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
);
wgmma_ss!(
    /// `m64n176k16`, bf16 inputs.
    wgmma_m64n176k16_ss_bf16, "m64n176k16", 22, "bf16", "0, 0", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
);
wgmma_ss!(
    /// `m64n128k16`, f16 inputs.
    wgmma_m64n128k16_ss_f16, "m64n128k16", 16, "f16", "0, 0", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
);
wgmma_ss!(
    /// `m64n128k16`, bf16 inputs.
    wgmma_m64n128k16_ss_bf16, "m64n128k16", 16, "bf16", "0, 0", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
);
wgmma_ss!(
    /// `m64n64k16`, f16 inputs.
    wgmma_m64n64k16_ss_f16, "m64n64k16", 8, "f16", "0, 0", [0, 1, 2, 3, 4, 5, 6, 7]
);
wgmma_ss!(
    /// `m64n64k16`, bf16 inputs.
    wgmma_m64n64k16_ss_bf16, "m64n64k16", 8, "bf16", "0, 0", [0, 1, 2, 3, 4, 5, 6, 7]
);
wgmma_ss!(
    /// `m64n64k16`, f16 inputs, both operands MN-major (transposed).
    wgmma_m64n64k16_ss_tt_f16, "m64n64k16", 8, "f16", "1, 1", [0, 1, 2, 3, 4, 5, 6, 7]
);
wgmma_ss!(
    /// `m64n64k16`, bf16 inputs, both operands MN-major (transposed).
    wgmma_m64n64k16_ss_tt_bf16, "m64n64k16", 8, "bf16", "1, 1", [0, 1, 2, 3, 4, 5, 6, 7]
);
wgmma_rs!(
    /// `m64n128k16`, f16 inputs, A from registers, B transposed.
    wgmma_m64n128k16_rs_f16, "m64n128k16", 16, "f16", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
);
wgmma_rs!(
    /// `m64n128k16`, bf16 inputs, A from registers, B transposed.
    wgmma_m64n128k16_rs_bf16, "m64n128k16", 16, "bf16", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
);
wgmma_rs!(
    /// `m64n64k16`, f16 inputs, A from registers, B transposed.
    wgmma_m64n64k16_rs_f16, "m64n64k16", 8, "f16", [0, 1, 2, 3, 4, 5, 6, 7]
);
wgmma_rs!(
    /// `m64n64k16`, bf16 inputs, A from registers, B transposed.
    wgmma_m64n64k16_rs_bf16, "m64n64k16", 8, "bf16", [0, 1, 2, 3, 4, 5, 6, 7]
);
