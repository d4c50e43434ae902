//! Shared-memory operands of Hopper's warpgroup products (`wgmma`): the tile layout the
//! kernels store and the 64-bit matrix descriptors that describe it (PTX ISA, "Matrix
//! Descriptor Format").
//!
//! Layout: a tile of `ROWS × D` 16-bit elements is stored as `D / 64` column blocks, each
//! `[ROWS][64]` with 128-byte rows swizzled as in [`crate::swizzle`] (16-byte chunk `c` of
//! row `r` at chunk `c ^ (r % 8)`): the hardware's 128-byte swizzle, whose 8-row × 128-byte
//! atoms (1024 bytes) must start 1024-byte aligned. Such a block serves as
//! - a K-major operand (rows are M or N, the 64 columns are K): A = Q, B = K in `S = Q·Kᵀ`;
//!   consecutive 8-row groups are 1024 bytes apart (the stride byte offset), and the k-step
//!   `ks` of 16 columns starts `32·ks` bytes into the block;
//! - an MN-major operand (rows are K, the 64 columns are N): B = V in `O = P·V`; groups of 8 K
//!   rows are 1024 bytes apart (the stride byte offset), 64-column blocks `ROWS·128` bytes
//!   apart (the leading byte offset), and the k-step of 16 rows starts `16·128·ks` bytes in.

/// Bytes of one swizzled row (64 16-bit elements).
pub const ROW_BYTES: u32 = 128;

/// Bytes between consecutive 8-row groups of a block (one swizzle atom).
pub const ATOM_BYTES: u32 = 8 * ROW_BYTES;

/// Elements per column block.
pub const BLOCK_COLS: usize = 64;

/// Descriptor swizzle-mode field (bits 62–63) of the 128-byte swizzle.
const SWIZZLE_128B: u64 = 1 << 62;

/// The descriptor of a swizzled operand starting at shared address `start` (16-byte
/// aligned, inside a 1024-byte aligned atom layout), with leading and stride byte offsets
/// `lbo` and `sbo` (multiples of 16). Fields: start, LBO and SBO in 16-byte units at bits
/// 0, 16 and 32 (14 bits each); base offset 0; swizzle mode at 62.
#[inline(always)]
pub const fn descriptor(start: u32, lbo: u32, sbo: u32) -> u64 {
    field(start) | field(lbo) << 16 | field(sbo) << 32 | SWIZZLE_128B
}

/// A byte count in a descriptor's 14-bit, 16-byte-unit field.
const fn field(bytes: u32) -> u64 {
    ((bytes >> 4) & 0x3fff) as u64
}

/// The descriptor `desc` moved `bytes` (a multiple of 16) further into shared memory: its
/// start field plus `bytes / 16`, a 32-bit add on the low word. The same as the descriptor
/// built from the moved address while that address stays below 256 KiB (the field's 14 bits
/// of 16-byte units), which every shared-memory address does. The tiles' descriptors are
/// built this way from their base's so that a product's k-steps cost an add each rather
/// than the whole field's arithmetic per `wgmma`.
#[inline(always)]
pub const fn moved(desc: u64, bytes: u32) -> u64 {
    let low = (desc as u32).wrapping_add(bytes >> 4);
    (desc & !0xffff_ffff) | low as u64
}

/// Descriptor of a K-major operand: k-step `ks` (16 columns) of the tile at `base` with
/// `rows` rows, from row `row0` (a multiple of 8).
#[inline(always)]
pub const fn k_major(base: u32, rows: u32, row0: u32, ks: u32) -> u64 {
    let block = ks / 4;
    let offset = block * rows * ROW_BYTES + row0 * ROW_BYTES + (ks % 4) * 32;
    // The leading byte offset is not used by swizzled K-major layouts (1 by convention).
    moved(descriptor(base, 16, ATOM_BYTES), offset)
}

/// Descriptor of an MN-major operand: k-step `ks` (rows `16·ks ..`) and column block `cb`
/// of the tile at `base` with `rows` rows.
#[inline(always)]
pub const fn mn_major(base: u32, rows: u32, ks: u32, cb: u32) -> u64 {
    let offset = cb * rows * ROW_BYTES + ks * 16 * ROW_BYTES;
    moved(descriptor(base, rows * ROW_BYTES, ATOM_BYTES), offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_sit_where_the_ptx_isa_puts_them() {
        let d = descriptor(0x1_2340, 0x400, 0x800);
        assert_eq!(d & 0x3fff, 0x1234);
        assert_eq!((d >> 16) & 0x3fff, 0x40);
        assert_eq!((d >> 32) & 0x3fff, 0x80);
        assert_eq!((d >> 49) & 0x7, 0);
        assert_eq!(d >> 62, 1);
    }

    #[test]
    fn k_steps_walk_the_column_blocks() {
        let start = |d: u64| ((d & 0x3fff) << 4) as u32;
        assert_eq!(start(k_major(0, 128, 0, 0)), 0);
        assert_eq!(start(k_major(0, 128, 0, 3)), 96);
        assert_eq!(start(k_major(0, 128, 0, 4)), 128 * 128);
        assert_eq!(
            start(k_major(1024, 128, 64, 5)),
            1024 + 128 * 128 + 64 * 128 + 32
        );
        assert_eq!(start(mn_major(0, 64, 2, 1)), 64 * 128 + 2 * 16 * 128);
        assert_eq!((mn_major(0, 64, 0, 0) >> 16) & 0x3fff, 64 * 128 / 16);
    }

    #[test]
    fn moved_descriptors_equal_those_built_at_the_moved_address() {
        // Every 1024-byte aligned base of a 228 KiB shared memory, offsets up to its end.
        for base in (0..228 * 1024).step_by(1024) {
            for offset in (0..228 * 1024 - base).step_by(16 * 37) {
                for (lbo, sbo) in [(16, ATOM_BYTES), (64 * ROW_BYTES, ATOM_BYTES)] {
                    assert_eq!(
                        moved(descriptor(base, lbo, sbo), offset),
                        descriptor(base + offset, lbo, sbo),
                        "base {base}, offset {offset}"
                    );
                }
            }
        }
    }
}
