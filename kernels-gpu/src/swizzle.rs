//! Shared-memory swizzle of the Q/K/V tiles.
//!
//! Tiles are stored row-major with `pitch` 16-bit elements per row, in 16-byte chunks (8
//! elements, the unit of `cp.async` and of one `ldmatrix` row). `ldmatrix` reads the same chunk
//! column of 8 consecutive rows at once; with a pitch that is a multiple of 128 bytes those 8
//! chunks would all fall in the same 4 banks (an 8-way conflict). XOR-ing the chunk index with
//! the row index spreads them over all 32 banks. For 64-byte rows (d = 32) two rows share a
//! 128-byte line, so the XOR uses `row / 2` instead.

/// Bytes in one swizzle chunk.
pub const CHUNK_BYTES: usize = 16;

/// Byte offset, from the start of a tile with `pitch` elements per row (a power of two ≥ 32),
/// of logical chunk `chunk` of row `row`.
#[inline(always)]
pub const fn chunk_offset(pitch: usize, row: usize, chunk: usize) -> usize {
    let chunks_per_row = pitch * 2 / CHUNK_BYTES;
    let xor = if chunks_per_row >= 8 {
        row % 8
    } else {
        (row / (8 / chunks_per_row)) % chunks_per_row
    };
    // Written as "high bits + swizzled low 3 bits" so that, with `row % 8` fixed per lane, the
    // compiler sees at most 8 distinct swizzled offsets per lane and folds the rest into
    // immediates.
    let phys = (chunk & !7) | ((chunk & 7) ^ xor);
    row * pitch * 2 + phys * CHUNK_BYTES
}

/// The same offset as [`chunk_offset`] for row `row0 + lane_row` (with `row0 % 8 == 0`) and
/// chunk `2·c2 + parity`, split into a per-lane part that holds the swizzle (one of four values,
/// picked by `c2 % 4`, which kernels compute once) and a part known at compile time. Kernels
/// add the two at each `ldmatrix`, which the assembler folds into the instruction's immediate.
#[inline(always)]
pub const fn split_offset(
    pitch: usize,
    lane_row: usize,
    parity: usize,
    row0: usize,
    c2: usize,
) -> (usize, usize) {
    let lane_part = chunk_offset(pitch, lane_row, 2 * (c2 % 4) + parity);
    let const_part = row0 * pitch * 2 + (c2 / 4) * 8 * CHUNK_BYTES;
    (lane_part, const_part)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_offset_matches_chunk_offset() {
        for pitch in [32usize, 64, 128, 256] {
            let chunk_pairs = pitch * 2 / CHUNK_BYTES / 2;
            for lane_row in 0..16 {
                for parity in 0..2 {
                    for row0 in (0..64).step_by(8) {
                        for c2 in 0..chunk_pairs {
                            let (a, b) = split_offset(pitch, lane_row, parity, row0, c2);
                            assert_eq!(
                                a + b,
                                chunk_offset(pitch, row0 + lane_row, 2 * c2 + parity)
                            );
                        }
                    }
                }
            }
        }
    }

    /// The 8 chunks an `ldmatrix` reads (same logical chunk, 8 consecutive rows) must start in 8
    /// different 16-byte bank groups, and the swizzle must be a permutation within each row.
    #[test]
    fn ldmatrix_reads_are_conflict_free_and_rows_stay_whole() {
        for pitch in [32usize, 64, 128, 256] {
            let chunks = pitch * 2 / CHUNK_BYTES;
            for row0 in (0..64).step_by(8) {
                for c in 0..chunks {
                    let mut groups = [false; 8];
                    for r in row0..row0 + 8 {
                        let g = (chunk_offset(pitch, r, c) % 128) / CHUNK_BYTES;
                        assert!(!groups[g], "pitch {pitch} row {r} chunk {c}");
                        groups[g] = true;
                    }
                }
            }
            for r in 0..16 {
                let mut seen = [false; 32];
                for c in 0..chunks {
                    let off = chunk_offset(pitch, r, c);
                    assert!(off >= r * pitch * 2 && off < (r + 1) * pitch * 2);
                    let p = (off - r * pitch * 2) / CHUNK_BYTES;
                    assert!(!seen[p]);
                    seen[p] = true;
                }
            }
        }
    }
}
