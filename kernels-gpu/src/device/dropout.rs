//! Attention dropout on register tiles: the keep words of [`DropoutRng`] applied to a warp's
//! probabilities, in the forward (rows are queries) and in the backward (rows are keys).
//!
//! One Philox call gives the values of 16 elements, a thread's share of a 16 × 32 block of the
//! forward's `mma` accumulator: rows `{g, g + 8}` × keys `2t + {0, 1, 8, 9, 16, 17, 24, 25}`
//! (lane `4g + t`), the numbering of [`crate::rng`]; a tile of 32·k keys takes one call per
//! 16 elements, a tile of 16 keys (`NT = 2`) half of each call. The backward's tile is the
//! transpose, so a thread there needs a quarter of each of two calls; the two lanes `g` and
//! `g ^ 1` need the same two calls, so each makes one and they swap a word of keep bytes with
//! one shuffle: one call per 8 elements. A call's words are tested a group (8 elements) at a
//! time, byte-parallel ([`DropoutRng::keep_group`]). The probabilities are then zeroed
//! (forward) or negated (backward) where dropped, a packed pair of 16-bit values at a time where
//! the kernel packs P before its product (`wgmma` forward, both backwards: one `prmt` turns two
//! keep bytes into a mask of halves, one logic operation applies it), else one f32 at a time
//! (the `mma.sync` forward, whose P stays in f32 until its fragments are packed). Rounding to
//! 16 bits commutes with both, so the two give the same values.

use super::frag::{AccTile, FragPos, PackedTile, RowVec};
use super::ptx;
use crate::params::DropoutArgs;
use crate::rng::DropoutRng;

/// The generator of sequence `batch` of the launch and query head `head`.
#[inline(always)]
pub fn rng_for(args: &DropoutArgs, batch: u32, head: u32, heads_q: u32) -> DropoutRng {
    DropoutRng::new(args, args.batch0.wrapping_add(batch), head, heads_q)
}

/// `x` where byte `byte` of the keep word `keep` says kept, else 0.
#[inline(always)]
fn zero_dropped(keep: u32, byte: u32, x: f32) -> f32 {
    // SAFETY: arithmetic only.
    f32::from_bits(x.to_bits() & unsafe { ptx::byte_sign_mask(keep, byte) })
}

/// Calls `apply(mt, nt0, words)` with the keep words of every group of a warp's P tile (rows
/// `rows`, keys from `key0`): the group's elements are row half `s`, n-tile `nt0 + u`, element
/// `e`, byte `2u + e` of `words[s]`. Each 32 keys from `key0` take a call (`key0` a multiple of
/// 32 when `NT ≥ 4`); with `NT mod 4 = 2` the last 16 keys take the half of a call they hold
/// (`key0` a multiple of 16).
#[inline(always)]
fn for_each_group<const MT: usize, const NT: usize>(
    rng: &DropoutRng,
    rows: &RowVec<u32, MT>,
    key0: u32,
    pos: FragPos,
    mut apply: impl FnMut(usize, usize, [u32; 2]),
) {
    for mt in 0..MT {
        for q in 0..NT / 4 {
            let w = rng.keep_words(rows.0[mt][0], key0 + pos.col(4 * q, 0));
            apply(mt, 4 * q, [w[0], w[1]]);
            apply(mt, 4 * q + 2, [w[2], w[3]]);
        }
        if NT % 4 == 2 {
            let last = key0 + pos.col(NT - 2, 0) - pos.col(0, 0);
            let w = rng.draw(rows.0[mt][0], (last & !31) + pos.col(0, 0));
            apply(mt, NT - 2, rng.keep_half(w, last));
        }
    }
}

/// Forward: zeroes the dropped probabilities of a warp's P tile in f32, whose thread rows are
/// `rows` (queries; `rows.0[mt][0]` is `16·k + g`) and whose keys start at `key0` (see
/// [`for_each_group`]).
#[inline(always)]
pub fn drop_probabilities<const MT: usize, const NT: usize>(
    rng: &DropoutRng,
    p: &mut AccTile<MT, NT>,
    rows: &RowVec<u32, MT>,
    key0: u32,
    pos: FragPos,
) {
    for_each_group::<MT, NT>(rng, rows, key0, pos, |mt, nt0, words| {
        for s in 0..2 {
            for u in 0..2 {
                for e in 0..2 {
                    let (nt, byte) = (nt0 + u, (2 * u + e) as u32);
                    p.set(
                        mt,
                        s,
                        nt,
                        e,
                        zero_dropped(words[s], byte, p.get(mt, s, nt, e)),
                    );
                }
            }
        }
    });
}

/// Forward: [`drop_probabilities`] on P packed to 16 bits, a pair at a time.
#[inline(always)]
pub fn drop_packed_probabilities<const MT: usize, const NT: usize>(
    rng: &DropoutRng,
    p: &mut PackedTile<MT, NT>,
    rows: &RowVec<u32, MT>,
    key0: u32,
    pos: FragPos,
) {
    for_each_group::<MT, NT>(rng, rows, key0, pos, |mt, nt0, words| {
        for s in 0..2 {
            for u in 0..2 {
                let byte = 2 * u as u32;
                // SAFETY: arithmetic only.
                let kept = unsafe { ptx::byte_sign_halves(words[s], 0, byte, byte + 1) };
                *p.pair_mut(mt, s, nt0 + u) &= kept;
            }
        }
    });
}

/// Backward: the keep words of a warp's Pᵀ tile (16 keys from `key0`, a multiple of 16, × the
/// queries from `row0`, a multiple of 16), for the 16-query blocks `np` in `first..end` (of
/// `NT / 2`), drawn (and exchanged between the lane pairs) before the scores need them:
/// `[2·np]` the lane's own call's word, `[2·np + 1]` the one its partner lane gave, each with
/// byte `2s + k` for query half `s` and key half `k`. Other entries stay zero.
/// [`mark_drawn`] applies them.
///
/// # Safety
/// The whole warp calls it (one shuffle per call).
#[inline(always)]
pub unsafe fn draw_marks<const NT: usize>(
    rng: &DropoutRng,
    key0: u32,
    row0: u32,
    pos: FragPos,
    (first, end): (usize, usize),
) -> [u32; NT] {
    // Lane 4g + t holds keys key0 + {g, g + 8}: those of the call at keys
    // (key0 & !31) + (g & !1) + {0, 1, 8, 9, 16, …}, half h = key0 / 16 mod 2, bytes
    // 2k + (g & 1) of words 2h + s; and queries 16·np + {2t, 2t + 1, 2t + 8, 2t + 9}: those of
    // the calls at rows 16·np + 2t + e (e = 0, 1). It makes the call of e = g & 1, keeps its
    // bytes g & 1 and gives the others to lane g ^ 1, whose call's bytes g & 1 it takes.
    let g = pos.row(0, 0);
    let (c, odd) = ((key0 & !31) + (g & !1), g & 1);
    // `prmt` selectors: bytes odd and 2 + odd of both words (own), or the others (given).
    let (own_bytes, given_bytes) = if odd == 0 {
        (0x6420, 0x7531)
    } else {
        (0x7531, 0x6420)
    };
    let mut drawn = [0u32; NT];
    for np in first..end {
        let w = rng.draw(row0 + pos.col(2 * np, odd as usize), c);
        let [k0, k1] = rng.keep_half(w, key0);
        drawn[2 * np] = ptx::prmt(k0, k1, own_bytes);
        let given = ptx::prmt(k0, k1, given_bytes);
        drawn[2 * np + 1] = ptx::shfl_sync_bfly::<4>(f32::from_bits(given)).to_bits();
    }
    drawn
}

/// Backward: marks the dropped probabilities of a warp's Pᵀ tile, packed to 16 bits, by
/// negating them (their sign bit: dS still needs the value, dV must not see it; see
/// [`crate::device::bwd`]), with the keep words of the 16-query blocks `first..end` drawn by
/// [`draw_marks`].
///
/// # Safety
/// Arithmetic only.
#[inline(always)]
pub unsafe fn mark_drawn<const NT: usize>(
    pt: &mut PackedTile<1, NT>,
    drawn: &[u32; NT],
    pos: FragPos,
    (first, end): (usize, usize),
) {
    // A pair holds queries of parity 0 (low half) and 1: the lane's own call's word for its
    // own key parity, its partner's for the other.
    let odd = pos.row(0, 0) & 1 != 0;
    for np in first..end {
        // Static indices and a select: an index by `odd` would put `drawn` in local memory.
        let (own, taken) = (drawn[2 * np], drawn[2 * np + 1]);
        let (even_word, odd_word) = if odd { (taken, own) } else { (own, taken) };
        for s in 0..2 {
            for k in 0..2 {
                let byte = (2 * s + k) as u32;
                let kept = ptx::byte_sign_halves(even_word, odd_word, byte, byte + 4);
                *pt.pair_mut(0, k, 2 * np + s) ^= !kept & 0x8000_8000;
            }
        }
    }
}

/// Backward: [`draw_marks`] and [`mark_drawn`] of the whole tile at once.
///
/// # Safety
/// The whole warp calls it (one shuffle per call).
#[inline(always)]
pub unsafe fn mark_dropped<const NT: usize>(
    rng: &DropoutRng,
    pt: &mut PackedTile<1, NT>,
    key0: u32,
    row0: u32,
    pos: FragPos,
) {
    let drawn = draw_marks::<NT>(rng, key0, row0, pos, (0, NT / 2));
    mark_drawn(pt, &drawn, pos, (0, NT / 2));
}
