//! Attention dropout on register tiles: the keep bits of [`DropoutRng`] applied to a warp's
//! probabilities, in the forward (rows are queries) and in the backward (rows are keys).
//!
//! One Philox call gives the bits of 8 elements, a thread's share of a 16 × 16 block of the
//! forward's `mma` accumulator: rows `{g, g + 8}` × keys `{2t, 2t + 1, 2t + 8, 2t + 9}` (lane
//! `4g + t`), the numbering of [`crate::rng`]. The backward's tile is the transpose, so a
//! thread there needs half the bits of two calls; the two lanes `g` and `g ^ 1` need the same
//! two calls, so each makes one and they swap the 8 bits with one shuffle: one call per 8
//! elements on both sides.

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
/// multiple of 16.
#[inline(always)]
pub fn drop_probabilities<const MT: usize, const NT: usize>(
    rng: &DropoutRng,
    p: &mut AccTile<MT, NT>,
    rows: &RowVec<u32, MT>,
    key0: u32,
    pos: FragPos,
) {
    for mt in 0..MT {
        for np in 0..NT / 2 {
            let bits = rng.keep_bits(rows.0[mt][0], key0 + pos.col(2 * np, 0));
            for r in 0..2 {
                for u in 0..2 {
                    for e in 0..2 {
                        if bits >> (4 * r + 2 * u + e) & 1 == 0 {
                            p.set(mt, r, 2 * np + u, e, 0.0);
                        }
                    }
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
/// The whole warp calls it (one shuffle).
#[inline(always)]
pub unsafe fn mark_dropped<const NT: usize>(
    rng: &DropoutRng,
    pt: &mut AccTile<1, NT>,
    key0: u32,
    row0: u32,
    pos: FragPos,
) {
    // Lane 4g + t holds keys {g, g + 8}: those of the call at keys (g & !1) + {0, 1, 8, 9},
    // bit (g & 1); and queries 16·np + {2t, 2t + 1, 2t + 8, 2t + 9}: those of the calls at
    // rows 16·np + 2t + e (e = 0, 1), row half by query half. It makes the call of
    // e = g & 1 and takes the other from lane g ^ 1.
    let (key_pair, odd) = (key0 + (pos.row(0, 0) & !1), pos.row(0, 0) & 1);
    for np in 0..NT / 2 {
        let mine = rng.keep_bits(row0 + pos.col(2 * np, odd as usize), key_pair);
        let other = ptx::shfl_sync_bfly::<4>(f32::from_bits(mine)).to_bits();
        let calls = if odd == 0 {
            [mine, other]
        } else {
            [other, mine]
        };
        for k in 0..2 {
            for s in 0..2 {
                for e in 0..2 {
                    if calls[e] >> (4 * s + 2 * k + odd as usize) & 1 == 0 {
                        let x = pt.get(0, k, 2 * np + s, e);
                        pt.set(0, k, 2 * np + s, e, -x);
                    }
                }
            }
        }
    }
}
