//! Attention dropout on register tiles: the keep bits of [`DropoutRng`] applied to a warp's
//! probabilities, in the forward (rows are queries) and in the backward (rows are keys).
//!
//! One Philox call gives the values of 8 elements, a thread's share of a 16 × 16 block of the
//! forward's `mma` accumulator: rows `{g, g + 8}` × keys `{2t, 2t + 1, 2t + 8, 2t + 9}` (lane
//! `4g + t`), the numbering of [`crate::rng`]. The backward's tile is the transpose, so a
//! thread there needs half the values of two calls; the two lanes `g` and `g ^ 1` need the
//! same two calls, so each makes one and they swap halves with two shuffles: one call per 8
//! elements on both sides. Values are tested two at a time against the threshold with one
//! `setp.ge.f16x2` ([`ptx::keep_halves_ge`]).

use super::frag::{AccTile, FragPos, RowVec};
use super::ptx;
use crate::params::DropoutArgs;
use crate::rng::DropoutRng;

/// The generator of sequence `batch` of the launch and query head `head`.
#[inline(always)]
pub fn rng_for(args: &DropoutArgs, batch: u32, head: u32, heads_q: u32) -> DropoutRng {
    DropoutRng::new(args, args.batch0.wrapping_add(batch), head, heads_q)
}

/// Forward: zeroes the dropped probabilities of a warp's P tile, whose thread rows are
/// `rows` (queries; `rows.0[mt][0]` is `16·k + g`) and whose keys start at `key0`, a
/// multiple of 16. Each word of a call holds the values of two adjacent keys of one row, the
/// pair of P one `setp.ge.f16x2` tests (see [`DropoutRng::draw`]).
#[inline(always)]
pub fn drop_probabilities<const MT: usize, const NT: usize>(
    rng: &DropoutRng,
    p: &mut AccTile<MT, NT>,
    rows: &RowVec<u32, MT>,
    key0: u32,
    pos: FragPos,
) {
    let threshold = rng.threshold_pair();
    for mt in 0..MT {
        for np in 0..NT / 2 {
            let words = rng.draw(rows.0[mt][0], key0 + pos.col(2 * np, 0));
            for r in 0..2 {
                for u in 0..2 {
                    let nt = 2 * np + u;
                    let pair = (p.get(mt, r, nt, 0), p.get(mt, r, nt, 1));
                    // SAFETY: arithmetic only.
                    let (lo, hi) =
                        unsafe { ptx::keep_halves_ge::<false>(words[2 * r + u], threshold, pair) };
                    p.set(mt, r, nt, 0, lo);
                    p.set(mt, r, nt, 1, hi);
                }
            }
        }
    }
}

/// Backward: marks the dropped probabilities of a warp's Pᵀ tile (16 keys from `key0` × the
/// queries from `row0`, both multiples of 16) by negating them (their sign bit: dS still
/// needs the value, dV must not see it; see [`crate::device::bwd`]).
///
/// # Safety
/// The whole warp calls it (two shuffles).
#[inline(always)]
pub unsafe fn mark_dropped<const NT: usize>(
    rng: &DropoutRng,
    pt: &mut AccTile<1, NT>,
    key0: u32,
    row0: u32,
    pos: FragPos,
) {
    // Lane 4g + t holds keys {g, g + 8}: those of the call at keys (g & !1) + {0, 1, 8, 9},
    // the half g & 1 of its words; and queries 16·np + {2t, 2t + 1, 2t + 8, 2t + 9}: those of
    // the calls at rows 16·np + 2t + e (e = 0, 1), word pair by query half. It makes the call
    // of e = g & 1, keeps its words' halves g & 1 and gives the others to lane g ^ 1, whose
    // call's halves g & 1 it takes: each lane then holds, per call, the halves of words
    // (0, 1) in one register and (2, 3) in another, one `setp.ge.f16x2` each.
    let (key_pair, odd) = (key0 + (pos.row(0, 0) & !1), pos.row(0, 0) & 1);
    // `prmt` selectors: the low halves of two words, or their high halves.
    let (own_halves, given_halves) = if odd == 0 {
        (0x5410, 0x7632)
    } else {
        (0x7632, 0x5410)
    };
    let threshold = rng.threshold_pair();
    for np in 0..NT / 2 {
        let w = rng.draw(row0 + pos.col(2 * np, odd as usize), key_pair);
        let own = [
            ptx::prmt(w[0], w[1], own_halves),
            ptx::prmt(w[2], w[3], own_halves),
        ];
        let given = [
            ptx::prmt(w[0], w[1], given_halves),
            ptx::prmt(w[2], w[3], given_halves),
        ];
        let taken = given.map(|x| ptx::shfl_sync_bfly::<4>(f32::from_bits(x)).to_bits());
        // Element (key half k, query half s, e): call e's word 2s + k.
        for e in 0..2 {
            let calls = if (e as u32) == odd { own } else { taken };
            for s in 0..2 {
                let nt = 2 * np + s;
                let pair = (pt.get(0, 0, nt, e), pt.get(0, 1, nt, e));
                let (k0, k1) = ptx::keep_halves_ge::<true>(calls[s], threshold, pair);
                pt.set(0, 0, nt, e, k0);
                pt.set(0, 1, nt, e, k1);
            }
        }
    }
}

/// Backward: the values [`mark_dropped`] tests, drawn (and exchanged between the lane pairs)
/// before the scores exist, for the calls `np` in `first..end` (of `NT / 2`): `[0][nt]` the
/// lane's own word of n-tile `nt`, `[1][nt]` the one its partner lane gave. Other entries stay
/// zero. [`mark_drawn`] applies them.
///
/// # Safety
/// The whole warp calls it (two shuffles per call).
#[inline(always)]
pub unsafe fn draw_marks<const NT: usize>(
    rng: &DropoutRng,
    key0: u32,
    row0: u32,
    pos: FragPos,
    (first, end): (usize, usize),
) -> [[u32; NT]; 2] {
    let (key_pair, odd) = (key0 + (pos.row(0, 0) & !1), pos.row(0, 0) & 1);
    let (own_halves, given_halves) = if odd == 0 {
        (0x5410, 0x7632)
    } else {
        (0x7632, 0x5410)
    };
    let mut drawn = [[0u32; NT]; 2];
    for np in first..end {
        let w = rng.draw(row0 + pos.col(2 * np, odd as usize), key_pair);
        for s in 0..2 {
            drawn[0][2 * np + s] = ptx::prmt(w[2 * s], w[2 * s + 1], own_halves);
            let given = ptx::prmt(w[2 * s], w[2 * s + 1], given_halves);
            drawn[1][2 * np + s] = ptx::shfl_sync_bfly::<4>(f32::from_bits(given)).to_bits();
        }
    }
    drawn
}

/// Backward: [`mark_dropped`] with the values of n-tiles `first..end` drawn before
/// ([`draw_marks`]).
///
/// # Safety
/// Arithmetic only.
#[inline(always)]
pub unsafe fn mark_drawn<const NT: usize>(
    rng: &DropoutRng,
    pt: &mut AccTile<1, NT>,
    drawn: &[[u32; NT]; 2],
    pos: FragPos,
    (first, end): (usize, usize),
) {
    let odd = pos.row(0, 0) & 1;
    let threshold = rng.threshold_pair();
    for nt in first..end {
        for e in 0..2 {
            let word = if (e as u32) == odd {
                drawn[0][nt]
            } else {
                drawn[1][nt]
            };
            let pair = (pt.get(0, 0, nt, e), pt.get(0, 1, nt, e));
            let (k0, k1) = ptx::keep_halves_ge::<true>(word, threshold, pair);
            pt.set(0, 0, nt, e, k0);
            pt.set(0, 1, nt, e, k1);
        }
    }
}
