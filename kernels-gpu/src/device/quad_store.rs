//! Global stores of a warp's accumulator rows 16 bytes at a time: the four lanes of a quad
//! swap their packed pairs so that each lane holds one 8-column tile of a row, then store it
//! with one `st.global.v4`. A warp's store then covers 64 contiguous bytes of each of 8 rows
//! (whole 32-byte sectors) where a store of each lane's own pair covers 16, with a quarter of
//! the store instructions. The backward's dK/dV epilogue stores this way; the forward's O
//! epilogue (`fwd::io::store_output_by_quads`) shares the transpose.
//! No sync point (the shuffles are the warp's own).

use super::elem::Elem;
use super::frag::AccTile;
use super::ptx;

/// Stores the thread's two rows of one m-tile of `tile` (`DT` 8-column tiles) as `E`, row
/// `r` multiplied by `scales[r]`: for each group of four tiles the quad's lanes swap their
/// pairs ([`quad_transpose`]) and `store(r, col, words, 8)` gets this lane's 8 columns from
/// `col` (its tile `4k + quad_lane`); tiles past the last group (`DT % 4` of them) go a
/// lane's pair at a time, `store(r, col, [pair, ..], 2)`. Columns are counted from the
/// tile's first; `store` places them ([`store_row_chunk`]) and skips rows that do not exist,
/// while every lane takes part in the shuffles. `quad_lane`: `lane % 4`, the caller's copy
/// (a persistent kernel passes an opaque one, so the addresses derived from it are not
/// hoisted out of its tile loop).
///
/// # Safety
/// The whole warp calls it.
#[inline(always)]
pub unsafe fn store_rows_by_quads<E: Elem, const DT: usize>(
    tile: &AccTile<1, DT>,
    scales: [f32; 2],
    quad_lane: u32,
    mut store: impl FnMut(usize, u32, [u32; 4], u32),
) {
    for r in 0..2 {
        let scale = scales[r];
        let pack = |nt: usize| {
            let [x0, x1] = tile.pair(0, r, nt);
            E::pack(x0 * scale, x1 * scale)
        };
        for k in 0..DT / 4 {
            let words = quad_transpose(core::array::from_fn(|j| pack(4 * k + j)), quad_lane);
            store(r, (4 * k as u32 + quad_lane) * 8, words, 8);
        }
        for nt in DT / 4 * 4..DT {
            store(r, 8 * nt as u32 + 2 * quad_lane, [pack(nt), 0, 0, 0], 2);
        }
    }
}

/// Stores `cols` columns (8, or 2 in `words[0]`) from `col` of the row whose first element
/// is `row_offset` elements past `base`: nothing from `head_dim` on; 8 columns in one 16-byte
/// store where the head dim does not cut them, else 4 bytes at a time up to it.
///
/// # Safety
/// The row start is 16-byte aligned (the kernels' tensor rule, [`crate::params::TensorRef`]),
/// `col` a multiple of `cols`, and the row's elements up to `head_dim` are writable.
#[inline(always)]
pub unsafe fn store_row_chunk(
    base: *mut u16,
    row_offset: u64,
    col: u32,
    words: [u32; 4],
    cols: u32,
    head_dim: u32,
) {
    if col >= head_dim {
        return;
    }
    let dst = base.add((row_offset + col as u64) as usize);
    if cols == 8 && col + 8 <= head_dim {
        ptx::st_global_v4(dst as u64, words);
    } else {
        for (w, &word) in words.iter().take(cols as usize / 2).enumerate() {
            if col + 2 * (w as u32) < head_dim {
                *(dst.add(2 * w) as *mut u32) = word;
            }
        }
    }
}

/// The 4 × 4 transpose of a quad's words: lane `t` (`quad_lane`) passes its words `v[j]` (the
/// pair it holds of 8-column tile `j`) and gets `[v₀[t], v₁[t], v₂[t], v₃[t]]`, tile `t`'s
/// pairs from lanes 0 to 3 in column order. Round one exchanges half the tiles with lane
/// `t ^ 2`, round two a tile with lane `t ^ 1`; every lane of the warp takes part.
#[inline(always)]
pub unsafe fn quad_transpose(v: [u32; 4], quad_lane: u32) -> [u32; 4] {
    let (hi, lo) = (quad_lane & 2 != 0, quad_lane & 1 != 0);
    let pick = |c: bool, a: u32, b: u32| if c { a } else { b };
    let swap = |x: u32, m| match m {
        1 => ptx::shfl_sync_bfly::<1>(f32::from_bits(x)).to_bits(),
        _ => ptx::shfl_sync_bfly::<2>(f32::from_bits(x)).to_bits(),
    };
    // Round one: keep tiles 2h, 2h + 1 (h = hi), from this lane and from lane t ^ 2.
    let (own_a, own_b) = (pick(hi, v[2], v[0]), pick(hi, v[3], v[1]));
    let (oth_a, oth_b) = (swap(pick(hi, v[0], v[2]), 2), swap(pick(hi, v[1], v[3]), 2));
    // Round two: keep tile 2h + lo, from lanes t and t ^ 2, and take it from t ^ 1 and t ^ 3.
    let (keep_own, keep_oth) = (pick(lo, own_b, own_a), pick(lo, oth_b, oth_a));
    let from_1 = swap(pick(lo, own_a, own_b), 1);
    let from_3 = swap(pick(lo, oth_a, oth_b), 1);
    // Lane L's word is at L: this lane's, then t ^ 1's within each pair of lanes.
    let near = if lo {
        [from_1, keep_own]
    } else {
        [keep_own, from_1]
    };
    let far = if lo {
        [from_3, keep_oth]
    } else {
        [keep_oth, from_3]
    };
    if hi {
        [far[0], far[1], near[0], near[1]]
    } else {
        [near[0], near[1], far[0], far[1]]
    }
}
