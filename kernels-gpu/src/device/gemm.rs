//! Warp-level matrix products on the tile layers: `mma.sync.m16n8k16` over register tiles
//! ([`AccTile`]) with B operands read from shared tiles ([`SmemTile`]) by `ldmatrix`. Every K
//! or V fragment read from shared memory feeds the warp's `MT` m-tiles.

use super::elem::Elem;
use super::frag::{AccTile, RegFragments};
use super::tile::{LaneOffsets, SmemTile};

/// Where the A operand of [`mma_abt`] comes from (registers or shared memory).
pub trait AFragments<const MT: usize> {
    /// The A fragments of every m-tile for reduction step `ks` (16 wide).
    ///
    /// # Safety
    /// The whole warp calls it; shared data is written and synchronised.
    unsafe fn a(&self, lanes: &LaneOffsets, ks: usize) -> [[u32; 4]; MT];
}

/// `acc += A·Bᵀ` over `K_STEPS` reduction steps of 16, where `a` gives the A fragments of
/// every m-tile and `b` is stored `[n][k]` (K, for `S = Q·Kᵀ`).
///
/// # Safety
/// The whole warp calls it; `b` is written and synchronised.
#[inline(always)]
pub unsafe fn mma_abt<
    E: Elem,
    const MT: usize,
    const NT: usize,
    const K_STEPS: usize,
    const ROWS: usize,
    const PITCH: usize,
>(
    acc: &mut AccTile<MT, NT>,
    a: &impl AFragments<MT>,
    b: SmemTile<ROWS, PITCH>,
    lanes: &LaneOffsets,
) {
    for ks in 0..K_STEPS {
        let a = a.a(lanes, ks);
        for np in 0..NT / 2 {
            let b = b.load_b_pair_nk(lanes, np, ks);
            for (mt, a) in a.iter().enumerate() {
                acc.mma_pair::<E>(mt, np, *a, b);
            }
        }
    }
}

/// `acc += P·B[:, 16·np0 ..]` where P is a `16·MT × 8·NT` register tile (an [`AccTile`]
/// converted to `E`, or a [`super::frag::PackedTile`]: the accumulator layout of two adjacent
/// n-tiles is one A fragment, so P never leaves registers) and `b` is
/// stored `[k][n]` (V, for `O += P·V`); `acc` covers `DT` 8-column tiles of B's columns from
/// column pair `np0`.
///
/// # Safety
/// As [`mma_abt`].
#[inline(always)]
pub unsafe fn mma_pb<
    E: Elem,
    const MT: usize,
    const NT: usize,
    const DT: usize,
    const ROWS: usize,
    const PITCH: usize,
>(
    acc: &mut AccTile<MT, DT>,
    p: &impl RegFragments<MT>,
    b: SmemTile<ROWS, PITCH>,
    lanes: &LaneOffsets,
    np0: usize,
) {
    for ks in 0..NT / 2 {
        let a: [[u32; 4]; MT] = core::array::from_fn(|mt| p.a_fragment::<E>(mt, ks));
        for dp in 0..DT / 2 {
            let b = b.load_b_pair_kn(lanes, ks, np0 + dp);
            for (mt, a) in a.iter().enumerate() {
                acc.mma_pair::<E>(mt, dp, *a, b);
            }
        }
    }
}

/// An A operand read from a shared tile stored `[m][k]`: the warp's rows from `m0`.
pub struct SmemRows<const ROWS: usize, const PITCH: usize> {
    /// The tile.
    pub tile: SmemTile<ROWS, PITCH>,
    /// First row of the warp's m-tiles.
    pub m0: usize,
}

impl<const MT: usize, const ROWS: usize, const PITCH: usize> AFragments<MT>
    for SmemRows<ROWS, PITCH>
{
    #[inline(always)]
    unsafe fn a(&self, lanes: &LaneOffsets, ks: usize) -> [[u32; 4]; MT] {
        core::array::from_fn(|mt| self.tile.load_a(lanes, self.m0, mt, ks))
    }
}

/// An A operand read from a shared tile stored transposed, `[k][m]`: the warp's columns
/// from `m0` (see [`SmemTile::load_a_trans`]). Its pitch may differ from the B tile's, so it
/// carries its own lane offsets.
pub struct SmemCols<const ROWS: usize, const PITCH: usize> {
    /// The tile.
    pub tile: SmemTile<ROWS, PITCH>,
    /// First column (A row) of the warp's m-tiles.
    pub m0: usize,
    /// This lane's `ldmatrix` offsets for tiles of `PITCH`.
    pub lanes: LaneOffsets,
}

impl<const MT: usize, const ROWS: usize, const PITCH: usize> AFragments<MT>
    for SmemCols<ROWS, PITCH>
{
    #[inline(always)]
    unsafe fn a(&self, _: &LaneOffsets, ks: usize) -> [[u32; 4]; MT] {
        core::array::from_fn(|mt| self.tile.load_a_trans(&self.lanes, self.m0, mt, ks))
    }
}

/// `acc += A·B[:, 16·np0 ..]` over `K_STEPS` reduction steps of 16, where `a` gives the A
/// fragments and `b` is stored `[k][n]` (K, for `dQ = dS·K`); `acc` covers `DT` 8-column
/// tiles of B's columns starting at column pair `np0` (a slice of a wider product keeps
/// fewer accumulators live).
///
/// # Safety
/// As [`mma_abt`].
#[inline(always)]
pub unsafe fn mma_ab<
    E: Elem,
    const MT: usize,
    const DT: usize,
    const K_STEPS: usize,
    const ROWS: usize,
    const PITCH: usize,
>(
    acc: &mut AccTile<MT, DT>,
    a: &impl AFragments<MT>,
    b: SmemTile<ROWS, PITCH>,
    lanes: &LaneOffsets,
    np0: usize,
) {
    for ks in 0..K_STEPS {
        let a = a.a(lanes, ks);
        for dp in 0..DT / 2 {
            let b = b.load_b_pair_kn(lanes, ks, np0 + dp);
            for (mt, a) in a.iter().enumerate() {
                acc.mma_pair::<E>(mt, dp, *a, b);
            }
        }
    }
}
