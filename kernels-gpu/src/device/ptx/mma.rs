//! `mma.sync.m16n8k16` with f32 accumulators: `d = a · b + d` for a 16×16 A (row-major, four
//! registers of two 16-bit values), a 16×8 B (column-major, two registers) and a 16×8 f32
//! accumulator (four registers). With `g = lane / 4`, `t = lane % 4`: A holds rows `g`/`g+8`,
//! columns `2t`,`2t+1` (and `+8`); B holds rows `2t`,`2t+1` (and `+8`) of column `g`; the
//! accumulator holds rows `g`/`g+8`, columns `2t`,`2t+1`.

use core::arch::asm;

macro_rules! mma_m16n8k16 {
    ($(#[$doc:meta])* $name:ident, $ty:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// All 32 lanes of the warp execute it together (`.sync.aligned`).
        #[inline(always)]
        pub unsafe fn $name(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
            asm!(
                concat!(
                    "mma.sync.aligned.m16n8k16.row.col.f32.", $ty, ".", $ty, ".f32 ",
                    "{{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, ",
                    "{{{d0}, {d1}, {d2}, {d3}}};"
                ),
                d0 = inout(reg32) d[0],
                d1 = inout(reg32) d[1],
                d2 = inout(reg32) d[2],
                d3 = inout(reg32) d[3],
                a0 = in(reg32) a[0],
                a1 = in(reg32) a[1],
                a2 = in(reg32) a[2],
                a3 = in(reg32) a[3],
                b0 = in(reg32) b[0],
                b1 = in(reg32) b[1],
                options(pure, nomem, nostack)
            );
        }
    };
}

mma_m16n8k16!(
    /// f16 inputs, f32 accumulation.
    mma_m16n8k16_f16,
    "f16"
);
mma_m16n8k16!(
    /// bf16 inputs, f32 accumulation.
    mma_m16n8k16_bf16,
    "bf16"
);
