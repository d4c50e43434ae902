//! Register tiles: the `mma.m16n8k16` accumulator layout and the per-row vectors of the online
//! softmax. These types own the fragment ↔ (row, column) mapping, so kernel bodies never do
//! lane arithmetic.
//!
//! A warp's accumulator tile is `MT` m-tiles of 16 rows × `NT` n-tiles of 8 columns. Lane `l`
//! holds, in each 16×8 tile, rows `l/4` and `l/4 + 8` and columns `2·(l%4)` and `2·(l%4) + 1`
//! (element `e` of its four: row half `e / 2`, column `e % 2`). A thread therefore holds `2·MT`
//! rows, and the four lanes of a quad hold the same rows.

use super::elem::Elem;
use super::ptx;
use crate::config::WARP_SIZE;

/// Elements of one 16×8 accumulator tile a lane holds.
const TILE_ELEMS: usize = 4;
/// Rows of an m-tile (the `mma`'s M).
const M_ROWS: u32 = 16;
/// Columns of an n-tile (the `mma`'s N).
const N_COLS: u32 = 8;

/// A thread's place in its block.
#[derive(Clone, Copy)]
pub struct ThreadPos {
    /// Thread index in the block.
    pub tid: u32,
    /// Warp index in the block.
    pub warp: u32,
    /// Lane index in the warp.
    pub lane: u32,
}

impl ThreadPos {
    /// The calling thread's position (one-dimensional blocks).
    ///
    /// # Safety
    /// Inside a kernel.
    #[inline(always)]
    pub unsafe fn current() -> Self {
        let tid = ptx::tid_x();
        Self {
            tid,
            warp: tid / WARP_SIZE as u32,
            lane: tid % WARP_SIZE as u32,
        }
    }
}

/// Position of a lane inside an accumulator tile.
#[derive(Clone, Copy)]
pub struct FragPos {
    /// Row group: `lane / 4`.
    g: u32,
    /// Column pair: `lane % 4`.
    t: u32,
}

impl FragPos {
    /// The position of `lane`.
    #[inline(always)]
    pub fn of(lane: u32) -> Self {
        Self {
            g: lane / 4,
            t: lane % 4,
        }
    }

    /// Row (within its warp's `16·MT` rows) of the thread's row `r` (0..2) of m-tile `mt`.
    #[inline(always)]
    pub fn row(self, mt: usize, r: usize) -> u32 {
        mt as u32 * M_ROWS + self.g + 8 * r as u32
    }

    /// Column (within an `8·NT`-column tile) of element `c` (0..2) of n-tile `nt`.
    #[inline(always)]
    pub fn col(self, nt: usize, c: usize) -> u32 {
        nt as u32 * N_COLS + 2 * self.t + c as u32
    }

    /// The lane's place in its quad, `lane % 4` (its column pair).
    #[inline(always)]
    pub fn quad_lane(self) -> u32 {
        self.t
    }

    /// Whether this lane is the first of its quad (writes the per-row values).
    #[inline(always)]
    pub fn leads_quad(self) -> bool {
        self.t == 0
    }
}

/// One value per row a thread holds: `[m-tile][row half]`.
#[derive(Clone, Copy)]
pub struct RowVec<T: Copy, const MT: usize>(pub [[T; 2]; MT]);

impl<T: Copy, const MT: usize> RowVec<T, MT> {
    /// The value `f(mt, r)` for every row.
    #[inline(always)]
    pub fn from_fn(mut f: impl FnMut(usize, usize) -> T) -> Self {
        Self(core::array::from_fn(|mt| {
            core::array::from_fn(|r| f(mt, r))
        }))
    }

    /// Every row set to `x`.
    #[inline(always)]
    pub fn splat(x: T) -> Self {
        Self([[x; 2]; MT])
    }

    /// Element-wise map.
    #[inline(always)]
    pub fn map<U: Copy>(self, mut f: impl FnMut(T) -> U) -> RowVec<U, MT> {
        RowVec(self.0.map(|r| r.map(&mut f)))
    }

    /// Calls `f(mt, r, value)` for every row.
    #[inline(always)]
    pub fn for_each(self, mut f: impl FnMut(usize, usize, T)) {
        for mt in 0..MT {
            for r in 0..2 {
                f(mt, r, self.0[mt][r]);
            }
        }
    }
}

/// The maximum of `x` over the 4 lanes of a quad (the lanes holding one accumulator row).
///
/// # Safety
/// The whole warp calls it.
#[inline(always)]
pub unsafe fn quad_max(x: f32) -> f32 {
    let x = x.max(ptx::shfl_sync_bfly::<1>(x));
    x.max(ptx::shfl_sync_bfly::<2>(x))
}

impl<const MT: usize> RowVec<f32, MT> {
    /// The sum over the quad (the whole row), per row.
    ///
    /// # Safety
    /// The whole warp calls it.
    #[inline(always)]
    pub unsafe fn quad_sum(self) -> Self {
        self.map(|x| {
            let x = x + ptx::shfl_sync_bfly::<1>(x);
            x + ptx::shfl_sync_bfly::<2>(x)
        })
    }
}

/// A register tile that can be the A operand of an `mma` (its accumulator layout is the A
/// layout): [`AccTile`] (rounded to `E` on the fly) or [`PackedTile`].
pub trait RegFragments<const MT: usize> {
    /// The A fragment (16 × 16, element type `E`) of n-tiles `2·kk`, `2·kk + 1` of m-tile `mt`.
    ///
    /// # Safety
    /// Always safe to execute (conversion instructions).
    unsafe fn a_fragment<E: Elem>(&self, mt: usize, kk: usize) -> [u32; 4];
}

/// A warp's `16·MT × 8·NT` tile rounded to 16-bit pairs, in the accumulator layout: half the
/// registers of an [`AccTile`], for operands kept live across a product (P, dS).
#[derive(Clone, Copy)]
pub struct PackedTile<const MT: usize, const NT: usize>([[[u32; 2]; NT]; MT]);

impl<const MT: usize, const NT: usize> PackedTile<MT, NT> {
    /// `acc` rounded to `E`.
    ///
    /// # Safety
    /// Always safe to execute.
    #[inline(always)]
    pub unsafe fn pack<E: Elem>(acc: &AccTile<MT, NT>) -> Self {
        Self(core::array::from_fn(|mt| {
            core::array::from_fn(|nt| {
                let t = &acc.0[mt][nt];
                [E::pack(t[0], t[1]), E::pack(t[2], t[3])]
            })
        }))
    }

    /// The f32 value at m-tile `mt`, row half `r`, n-tile `nt`, column half `c`.
    ///
    /// # Safety
    /// Always safe to execute.
    #[inline(always)]
    pub unsafe fn get<E: Elem>(&self, mt: usize, r: usize, nt: usize, c: usize) -> f32 {
        E::to_f32((self.0[mt][nt][r] >> (16 * c)) as u16)
    }

    /// The two adjacent elements of row half `r`, n-tile `nt` of m-tile `mt`, packed (low
    /// half first), for a 4-byte store.
    #[inline(always)]
    pub fn pair(&self, mt: usize, r: usize, nt: usize) -> u32 {
        self.0[mt][nt][r]
    }

    /// The pair of [`Self::pair`], to update in place.
    #[inline(always)]
    pub fn pair_mut(&mut self, mt: usize, r: usize, nt: usize) -> &mut u32 {
        &mut self.0[mt][nt][r]
    }
}

impl<const MT: usize, const NT: usize> RegFragments<MT> for PackedTile<MT, NT> {
    #[inline(always)]
    unsafe fn a_fragment<E: Elem>(&self, mt: usize, kk: usize) -> [u32; 4] {
        let (s0, s1) = (&self.0[mt][2 * kk], &self.0[mt][2 * kk + 1]);
        [s0[0], s0[1], s1[0], s1[1]]
    }
}

/// A packed tile read as an `mma` operand with its negative elements replaced by zero, each
/// fragment as it is fetched (no second tile in registers; a bit operation per pair, for f16
/// and bf16 alike: the sign is bit 15 of each half). The backward marks dropped probabilities
/// by their sign (see [`crate::device::dropout`]).
pub struct NonNegative<'a, const MT: usize, const NT: usize>(pub &'a PackedTile<MT, NT>);

impl<const MT: usize, const NT: usize> RegFragments<MT> for NonNegative<'_, MT, NT> {
    #[inline(always)]
    unsafe fn a_fragment<E: Elem>(&self, mt: usize, kk: usize) -> [u32; 4] {
        self.0.a_fragment::<E>(mt, kk).map(|x| {
            let negative = ((x >> 15) & 0x0001_0001) * 0xffff;
            x & !negative
        })
    }
}

impl<const MT: usize, const NT: usize> RegFragments<MT> for AccTile<MT, NT> {
    #[inline(always)]
    unsafe fn a_fragment<E: Elem>(&self, mt: usize, kk: usize) -> [u32; 4] {
        AccTile::a_fragment::<E>(self, mt, kk)
    }
}

/// A warp's `16·MT × 8·NT` f32 accumulator tile (the thread's share of it).
#[derive(Clone, Copy)]
pub struct AccTile<const MT: usize, const NT: usize>([[[f32; TILE_ELEMS]; NT]; MT]);

impl<const MT: usize, const NT: usize> AccTile<MT, NT> {
    /// All zeros.
    #[inline(always)]
    pub fn zero() -> Self {
        Self([[[0.0; TILE_ELEMS]; NT]; MT])
    }

    /// `self[m-tile mt, n-tiles 2·np, 2·np + 1] += a · b`: one 16×16 A fragment times the two
    /// B fragments of an `ldmatrix.x4`.
    ///
    /// # Safety
    /// The whole warp executes it together.
    #[inline(always)]
    pub unsafe fn mma_pair<E: Elem>(
        &mut self,
        mt: usize,
        np: usize,
        a: [u32; 4],
        b: [[u32; 2]; 2],
    ) {
        E::mma(&mut self.0[mt][2 * np], a, b[0]);
        E::mma(&mut self.0[mt][2 * np + 1], a, b[1]);
    }

    /// The element at m-tile `mt`, row half `r`, n-tile `nt`, column half `c`.
    #[inline(always)]
    pub fn get(&self, mt: usize, r: usize, nt: usize, c: usize) -> f32 {
        self.0[mt][nt][2 * r + c]
    }

    /// Sets the element at m-tile `mt`, row half `r`, n-tile `nt`, column half `c`.
    #[inline(always)]
    pub fn set(&mut self, mt: usize, r: usize, nt: usize, c: usize, x: f32) {
        self.0[mt][nt][2 * r + c] = x;
    }

    /// Calls `f(mt, r, nt, c, x)` for every element: m-tile, row half, n-tile, column half.
    #[inline(always)]
    pub fn for_each_mut(&mut self, mut f: impl FnMut(usize, usize, usize, usize, &mut f32)) {
        for (mt, tiles) in self.0.iter_mut().enumerate() {
            for (nt, tile) in tiles.iter_mut().enumerate() {
                for (e, x) in tile.iter_mut().enumerate() {
                    f(mt, e / 2, nt, e % 2, x);
                }
            }
        }
    }

    /// Replaces every score by `f(row, col, score)`, where the thread's row `(mt, r)` is
    /// `rows.0[mt][r]` and its column `(nt, c)` is `col0 + pos.col(nt, c)`.
    #[inline(always)]
    pub fn map_scores(
        &mut self,
        rows: &RowVec<u32, MT>,
        pos: FragPos,
        col0: u32,
        f: impl Fn(u32, u32, f32) -> f32,
    ) {
        self.for_each_mut(|mt, r, nt, c, x| {
            *x = f(rows.0[mt][r], col0 + pos.col(nt, c), *x);
        });
    }

    /// Calls `f(r, nt, c, x)` for every element of m-tile `mt` (row half, n-tile, column
    /// half), so the per-row
    /// work of one m-tile can finish before the next starts (shorter register live ranges).
    #[inline(always)]
    pub fn for_each_in_mtile(
        &mut self,
        mt: usize,
        mut f: impl FnMut(usize, usize, usize, &mut f32),
    ) {
        for (nt, tile) in self.0[mt].iter_mut().enumerate() {
            for (e, x) in tile.iter_mut().enumerate() {
                f(e / 2, nt, e % 2, x);
            }
        }
    }

    /// Multiplies every row by its factor.
    #[inline(always)]
    pub fn scale_rows(&mut self, factor: &RowVec<f32, MT>) {
        self.for_each_mut(|mt, r, _, _, x| *x *= factor.0[mt][r]);
    }

    /// The A fragment (16 × 16, element type `E`) made of n-tiles `2·kk` and `2·kk + 1` of
    /// m-tile `mt`: the accumulator layout of two adjacent tiles is exactly the A layout, so
    /// P goes from the softmax to the next `mma` without leaving registers.
    #[inline(always)]
    pub unsafe fn a_fragment<E: Elem>(&self, mt: usize, kk: usize) -> [u32; 4] {
        let (s0, s1) = (&self.0[mt][2 * kk], &self.0[mt][2 * kk + 1]);
        [
            E::pack(s0[0], s0[1]),
            E::pack(s0[2], s0[3]),
            E::pack(s1[0], s1[1]),
            E::pack(s1[2], s1[3]),
        ]
    }

    #[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))]
    /// The `W` n-tiles of m-tile `mt` from n-tile `first`: the accumulators of one warpgroup
    /// product (see [`ptx::wgmma_m64n128k16_ss_f16`]).
    #[inline(always)]
    pub fn tiles_mut<const W: usize>(
        &mut self,
        mt: usize,
        first: usize,
    ) -> &mut [[f32; TILE_ELEMS]; W] {
        let tiles = &mut self.0[mt][first..first + W];
        tiles.try_into().unwrap()
    }

    /// The two values of row half `r`, n-tile `nt` of m-tile `mt` (adjacent columns), for a
    /// 4-byte store.
    #[inline(always)]
    pub fn pair(&self, mt: usize, r: usize, nt: usize) -> [f32; 2] {
        let t = &self.0[mt][nt];
        [t[2 * r], t[2 * r + 1]]
    }
}
