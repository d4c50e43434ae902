//! `ldmatrix` and `stmatrix`: warp-wide loads (and stores, sm_90) of 8×8 16-bit matrices
//! between shared memory and the fragment layout `mma.sync` uses. Lane `l` supplies the row
//! address of row `l % 8` of matrix `l / 8`; register `i` of every lane holds its part of
//! matrix `i`.

use core::arch::asm;

macro_rules! ldmatrix_x4 {
    ($(#[$doc:meta])* $name:ident, $suffix:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// All 32 lanes execute it together, each with a 16-byte aligned shared address of a
        /// row that the block wrote and synchronised before.
        #[inline(always)]
        pub unsafe fn $name(addr: u32) -> [u32; 4] {
            let (a, b, c, d): (u32, u32, u32, u32);
            asm!(
                concat!("ldmatrix.sync.aligned.m8n8.x4", $suffix, ".shared.b16 {{{a}, {b}, {c}, {d}}}, [{addr}];"),
                a = out(reg32) a,
                b = out(reg32) b,
                c = out(reg32) c,
                d = out(reg32) d,
                addr = in(reg32) addr,
                options(nostack)
            );
            [a, b, c, d]
        }
    };
}

ldmatrix_x4!(
    /// Four 8×8 matrices, not transposed: lane `l` gets row `l / 4`, columns `2·(l % 4)` and
    /// `+1` of each matrix.
    ldmatrix_x4,
    ""
);
ldmatrix_x4!(
    /// Four 8×8 matrices, transposed: lane `l` gets rows `2·(l % 4)` and `+1` of column
    /// `l / 4`.
    ldmatrix_x4_trans,
    ".trans"
);

/// Stores four 8×8 matrices (sm_90): lane `l` gives row `l / 4`, columns `2·(l % 4)` and
/// `+1` of matrix `i` in register `i` (the accumulator layout of `mma.m16n8k16` and
/// `wgmma`, packed to 16 bits), and the address of row `l % 8` of matrix `l / 8`.
///
/// # Safety
/// All 32 lanes execute it together, each with a 16-byte aligned shared address of 16
/// writable bytes.
#[inline(always)]
pub unsafe fn stmatrix_x4(addr: u32, v: [u32; 4]) {
    asm!(
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [{addr}], {{{a}, {b}, {c}, {d}}};",
        addr = in(reg32) addr,
        a = in(reg32) v[0],
        b = in(reg32) v[1],
        c = in(reg32) v[2],
        d = in(reg32) v[3],
        options(nostack)
    );
}
