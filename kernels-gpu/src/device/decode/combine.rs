//! Merging attention states: the decode kernel's splits (`decode_combine`) and two states
//! given as tensors (`merge_states`). Both compute, per query row, from partial results
//! `(Oₛ, LSEₛ)` (each Oₛ normalised over its own keys):
//!
//! `LSE = log Σₛ exp(LSEₛ)`, `O = Σₛ exp(LSEₛ − LSE) · Oₛ`
//!
//! with the maximum subtracted first. States with LSE = −∞ (no key) weigh nothing; a row whose
//! states all have LSE = −∞ gets O = 0 and LSE = −∞; a NaN LSE makes the row NaN.
//!
//! One warp per output row and 64-column chunk, no shared memory: lane `l` holds the LSE of
//! states `l`, `l + 32`, ... (at most [`crate::config::MAX_DECODE_SPLITS`]) and columns
//! `64·chunk + 2·l`, `+1`; the states' O are read sixteen at a time.
//!
//! The loop is latency-bound (few rows, up to 128 states each), so every load is
//! unconditional: indices past the last state or column are clamped to valid ones and their
//! values dropped by selection. A load under a branch would have its use sunk into the
//! branch, and the warp would then wait for each state in turn.

use super::super::elem::Elem;
use super::super::frag::ThreadPos;
use super::super::ptx;
use crate::params::CombineParams;

/// `log2(e)`.
const LOG2_E: f32 = core::f32::consts::LOG2_E;
/// `ln 2`.
const LN_2: f32 = core::f32::consts::LN_2;
/// States per lane (`MAX_DECODE_SPLITS / 32`).
const STATES_PER_LANE: usize = 4;
/// Columns per warp: two per lane.
const CHUNK_COLS: u32 = 64;
/// States whose O loads are issued together (a divisor of 32).
const UNROLL: usize = 16;

/// Where the states of row `(batch, head, token)` come from.
trait States {
    /// Number of states.
    fn count(&self) -> u32;
    /// LSE (natural log) of state `s`.
    unsafe fn lse(&self, s: u32, row: Row) -> f32;
    /// Columns `col`, `col + 1` of state `s`'s O.
    unsafe fn o_pair(&self, s: u32, row: Row, col: u32) -> [f32; 2];
}

/// An output row.
#[derive(Clone, Copy)]
struct Row {
    batch: u32,
    head: u32,
    token: u32,
}

/// The decode kernel's f32 partials.
struct Splits<'a>(&'a CombineParams);

impl Splits<'_> {
    #[inline(always)]
    fn row(&self, s: u32, r: Row) -> u64 {
        let d = &self.0.dims;
        ((s as u64 * d.batch as u64 + r.batch as u64) * d.heads_q as u64 + r.head as u64)
            * d.seqlen_q as u64
            + r.token as u64
    }
}

impl States for Splits<'_> {
    #[inline(always)]
    fn count(&self) -> u32 {
        self.0.num_splits
    }
    #[inline(always)]
    unsafe fn lse(&self, s: u32, r: Row) -> f32 {
        *(self.0.lse_part as *const f32).add(self.row(s, r) as usize)
    }
    #[inline(always)]
    unsafe fn o_pair(&self, s: u32, r: Row, col: u32) -> [f32; 2] {
        let at = self.row(s, r) * self.0.dims.head_dim as u64 + col as u64;
        let src = (self.0.o_part as *const f32).add(at as usize);
        [*src, *src.add(1)]
    }
}

/// Two states in 16-bit O tensors and f32 LSE tensors.
struct TwoStates<'a, E>(&'a CombineParams, core::marker::PhantomData<E>);

impl<E: Elem> States for TwoStates<'_, E> {
    #[inline(always)]
    fn count(&self) -> u32 {
        2
    }
    #[inline(always)]
    unsafe fn lse(&self, s: u32, r: Row) -> f32 {
        let t = pick(&self.0.state_lse, s);
        *(t.ptr as *const f32).add(t.offset(r.batch, r.head, r.token) as usize)
    }
    #[inline(always)]
    unsafe fn o_pair(&self, s: u32, r: Row, col: u32) -> [f32; 2] {
        let t = pick(&self.0.state_o, s);
        let at = t.strides.offset(r.batch, r.token, r.head) + col as u64;
        let src = (t.ptr as *const u16).add(at as usize);
        [E::to_f32(*src), E::to_f32(*src.add(1))]
    }
}

/// Element `s` (0 or 1) of a parameter pair, by selection: indexing a kernel parameter with a
/// run-time value would copy it to local memory.
#[inline(always)]
fn pick<T>(pair: &[T; 2], s: u32) -> &T {
    if s == 0 {
        &pair[0]
    } else {
        &pair[1]
    }
}

/// The larger of `a` and `b`, NaN if either is.
#[inline(always)]
fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// The combine kernel body: merges the `num_splits` partials of every row into O and LSE.
///
/// # Safety
/// Launched with one warp per row of `[batch, heads_q, seqlen_q]` (any grid covering them) on
/// parameters the host validated.
#[inline(always)]
pub unsafe fn decode_combine<E: Elem>(p: &CombineParams) {
    merge_rows::<E, _>(p, &Splits(p));
}

/// The merge kernel body: merges two states given as tensors into O and LSE.
///
/// # Safety
/// As [`decode_combine`].
#[inline(always)]
pub unsafe fn merge_states<E: Elem>(p: &CombineParams) {
    merge_rows::<E, _>(p, &TwoStates::<E>(p, core::marker::PhantomData));
}

#[inline(always)]
unsafe fn merge_rows<E: Elem, S: States>(p: &CombineParams, states: &S) {
    let me = ThreadPos::current();
    let (bx, _, _) = ptx::ctaid();
    let d = &p.dims;
    let rows = d.batch as u64 * d.heads_q as u64 * d.seqlen_q as u64;
    // One warp per (row, 64-column chunk): more warps in flight when rows are few.
    let chunks = d.head_dim.div_ceil(CHUNK_COLS) as u64;
    let warp = bx as u64 * (ptx::ntid_x() / 32) as u64 + me.warp as u64;
    let (index, chunk) = (warp / chunks, (warp % chunks) as u32);
    if index >= rows {
        return; // the whole warp
    }
    let row = Row {
        token: (index % d.seqlen_q as u64) as u32,
        head: ((index / d.seqlen_q as u64) % d.heads_q as u64) as u32,
        batch: (index / (d.seqlen_q as u64 * d.heads_q as u64)) as u32,
    };
    let n = states.count();
    let mut lse = [f32::NEG_INFINITY; STATES_PER_LANE];
    for (i, x) in lse.iter_mut().enumerate() {
        let s = me.lane + 32 * i as u32;
        let loaded = states.lse(s.min(n - 1), row); // unconditional: see the module docs
        *x = if s < n { loaded } else { f32::NEG_INFINITY };
    }
    let mut max = lse.iter().fold(f32::NEG_INFINITY, |m, &x| max_nan(m, x));
    max = max_nan(max, ptx::shfl_sync_bfly::<16>(max));
    max = max_nan(max, ptx::shfl_sync_bfly::<8>(max));
    max = max_nan(max, ptx::shfl_sync_bfly::<4>(max));
    max = max_nan(max, ptx::shfl_sync_bfly::<2>(max));
    max = max_nan(max, ptx::shfl_sync_bfly::<1>(max));
    // Weights relative to the maximum (0 for −∞ states; all 0 when every state is −∞).
    let finite = max != f32::NEG_INFINITY;
    let weight = lse.map(|x| {
        if finite {
            ptx::ex2_approx_ftz((x - max) * LOG2_E)
        } else {
            0.0
        }
    });
    let mut sum = weight.iter().sum::<f32>();
    sum += ptx::shfl_sync_bfly::<16>(sum);
    sum += ptx::shfl_sync_bfly::<8>(sum);
    sum += ptx::shfl_sync_bfly::<4>(sum);
    sum += ptx::shfl_sync_bfly::<2>(sum);
    sum += ptx::shfl_sync_bfly::<1>(sum);
    let (inv, lse_out) = if sum != 0.0 {
        (1.0 / sum, max + ptx::lg2_approx_ftz(sum) * LN_2) // NaN: NaN both
    } else {
        (0.0, f32::NEG_INFINITY)
    };

    // This lane's two columns (lanes past the head dim read the last two and store nothing);
    // `UNROLL` states at a time, their loads issued together.
    let col = CHUNK_COLS * chunk + 2 * me.lane;
    let read_col = col.min(d.head_dim - 2);
    let mut acc = [0.0f32; 2];
    // Every lane runs the loop (it shuffles).
    if sum != 0.0 {
        let mut s0 = 0;
        while s0 < n {
            // States s0 .. s0 + UNROLL have their weights in the same register of the lanes.
            let held = match s0 / 32 {
                0 => weight[0],
                1 => weight[1],
                2 => weight[2],
                _ => weight[3],
            };
            let mut w = [0.0f32; UNROLL];
            let mut x = [[0.0f32; 2]; UNROLL];
            for u in 0..UNROLL {
                let s = s0 + u as u32;
                w[u] = ptx::shfl_sync_idx(held, s % 32) * inv;
                x[u] = states.o_pair(s.min(n - 1), row, read_col);
            }
            for u in 0..UNROLL {
                // A state without keys (or past the last) weighs 0 and its O, which may be
                // anything, is dropped.
                let keep = s0 + (u as u32) < n && w[u] != 0.0;
                acc[0] += if keep { w[u] * x[u][0] } else { 0.0 };
                acc[1] += if keep { w[u] * x[u][1] } else { 0.0 };
            }
            s0 += UNROLL as u32;
        }
    }
    if lse_out.is_nan() {
        acc = [f32::NAN; 2];
    }
    if col < d.head_dim {
        let at = p.o.strides.offset(row.batch, row.token, row.head) + col as u64;
        *((p.o.ptr as *mut u16).add(at as usize) as *mut u32) = E::pack(acc[0], acc[1]);
    }
    if chunk == 0 && me.lane == 0 {
        let at = p.lse.offset(row.batch, row.head, row.token);
        *(p.lse.ptr as *mut f32).add(at as usize) = lse_out;
    }
}
