//! Every compiled kernel, declared once.
//!
//! The `registry!` invocation at the bottom is the only list of kernels: it expands to the
//! device entry points (on `nvptx64`), to the tables the host dispatches from
//! ([`FWD_KERNELS`], [`ALL_KERNELS`]), and from those the ptxas report, the kernel build's
//! per-kernel files and the tests enumerate kernels. Adding a kernel is one line here.
//!
//! What is a compile-time variant: the family, the element type, the head dim, the mask
//! kind and dropout (each changes the instruction stream or the register tiles). What is a runtime
//! argument: sequence lengths, strides, the softmax scale, the causal flag of
//! [`MaskKind::Causal`] (a warp-uniform branch outside the inner loop: one kernel serves both),
//! and the window, softcap and ALiBi of [`MaskKind::Masked`] (tile bounds, a predicate in edge
//! tiles, and a block-uniform branch that skips the score modifier when neither softcap nor
//! ALiBi is on; see docs/design.md).

use crate::arch::{Arch, ARCH_COUNT};
use crate::config::{
    bwd_prep_smem, BwdTile, DecodeTile, FwdTile, APPEND_THREADS, BWD_AUX_THREADS, BWD_PREP_THREADS,
    COMBINE_THREADS, MMA_M, PAD_THREADS, PROBE_SMEM_BYTES, PROBE_THREADS,
};

/// Element type of a kernel's 16-bit tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelDType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

/// Which mask type a kernel is compiled with (a [`crate::mask::AttnMask`] implementation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MaskKind {
    /// [`crate::mask::CausalMask`]: sequence tails, plus bottom-right causal masking when the
    /// params' window is `(∞, 0)` (the plain kernels).
    Causal,
    /// [`crate::mask::ScoredMask`]: a sliding window plus softcap and ALiBi, which modify
    /// every score (their own kernels, so that the plain ones pay nothing for them).
    Masked,
    /// [`crate::mask::SparseMask`]: block-sparse attention (a bit per 128 × 128 block) with
    /// the tails and causal masking of the plain kernels. Forward and backward only.
    Sparse,
    /// [`crate::mask::TreeMask`]: a tree of draft tokens (speculative decoding) after a fully
    /// visible prefix.
    Tree,
}

/// Kernel family: which algorithm and which parameter struct.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Forward attention, [`crate::params::FwdParams`].
    Fwd,
    /// Backward attention (dK, dV, and dQ through an f32 accumulator),
    /// [`crate::params::BwdParams`].
    Bwd,
    /// The backward's pre-pass (D = rowsum(dO ∘ O)) and dQ conversion,
    /// [`crate::params::BwdParams`].
    BwdPasses,
    /// Split-KV decoding over a KV cache, [`crate::params::DecodeParams`].
    Decode,
    /// The decode path's split combine and the merge of two attention states
    /// ([`crate::params::CombineParams`]), and the cache append
    /// ([`crate::params::AppendParams`]).
    DecodePasses,
    /// Strided ⇄ packed copy, [`crate::params::PadParams`].
    Layout,
    /// The `wgmma` layout probe, [`crate::params::ProbeParams`] (a self-test).
    Probe,
}

/// One kernel per element type for a (head dim, mask kind), with its tile per target: a row
/// of one family's table ([`FwdKernel`], [`BwdKernel`]).
#[derive(Clone, Copy, Debug)]
pub struct KernelRow<T: Copy> {
    /// Compiled head dim; callers' smaller head dims run zero-padded on it.
    pub head_dim: usize,
    /// Mask type.
    pub mask: MaskKind,
    /// Whether the kernel applies attention dropout ([`crate::rng`]).
    pub dropout: bool,
    /// Entry point names, indexed by [`KernelDType`] (`F16`, `Bf16`).
    pub names: [&'static str; 2],
    /// Tile shape per target, in [`crate::arch::ARCHS`] order.
    pub tiles: [T; ARCH_COUNT],
}

impl<T: Copy> KernelRow<T> {
    /// The entry point for `dtype`.
    pub const fn name(&self, dtype: KernelDType) -> &'static str {
        self.names[dtype as usize]
    }

    /// The tile shape on `arch`.
    pub const fn tile(&self, arch: Arch) -> T {
        self.tiles[arch.index()]
    }
}

/// A forward kernel row.
pub type FwdKernel = KernelRow<FwdTile>;

/// A backward kernel row (the main kernel, or the deterministic mode's dQ kernel).
pub type BwdKernel = KernelRow<BwdTile>;

/// A decode kernel row.
pub type DecodeKernel = KernelRow<DecodeTile>;

/// Registry token of the kernels without dropout.
const PLAIN: bool = false;
/// Registry token of the kernels with attention dropout.
const DROPOUT: bool = true;
/// Registry token of the `wgmma` forward kernels with one block per query tile.
const PER_TILE: bool = false;
/// Registry token of the `wgmma` forward kernels with persistent blocks
/// ([`FwdTile::persistent`]).
const PERSISTENT: bool = true;

/// The row of `rows` that runs a caller's `head_dim` under `mask`, with or without `dropout`:
/// the one of that kind at the smallest head dim ≥ `head_dim` that `rows` compile at all
/// (whatever the kind), so a kind missing at that head dim is `None` rather than a larger
/// kernel; `None` for 0 and above the largest.
pub const fn kernel_for<T: Copy>(
    rows: &'static [KernelRow<T>],
    head_dim: usize,
    mask: MaskKind,
    dropout: bool,
) -> Option<&'static KernelRow<T>> {
    let mut padded = usize::MAX;
    let mut i = 0;
    while i < rows.len() {
        if head_dim > 0 && head_dim <= rows[i].head_dim && rows[i].head_dim < padded {
            padded = rows[i].head_dim;
        }
        i += 1;
    }
    let mut i = 0;
    while i < rows.len() {
        let k = &rows[i];
        if k.head_dim == padded && k.mask as u8 == mask as u8 && k.dropout == dropout {
            return Some(k);
        }
        i += 1;
    }
    None
}

/// The forward kernel for a caller's `head_dim` under `mask`, with or without `dropout` (see
/// [`kernel_for`]). The plain kind's forward with dropout runs on the general kind's kernels:
/// the plain mask's spill at the same tiles (ptxas, sm_80 and sm_90a), the general one's
/// (a window of `(∞, ∞)` or causal) do not.
pub const fn fwd_kernel(
    head_dim: usize,
    mask: MaskKind,
    dropout: bool,
) -> Option<&'static FwdKernel> {
    let mask = match (mask, dropout) {
        (MaskKind::Causal, true) => MaskKind::Masked,
        _ => mask,
    };
    kernel_for(FWD_KERNELS, head_dim, mask, dropout)
}

/// Hopper's `wgmma` forward kernel for a caller's `head_dim` under `mask`, with or without
/// `dropout` (see [`kernel_for`]); the plain kind falls back on the general kind's kernel
/// where it has none of its own (no window, no score modifier: the same results). `None`
/// where neither exists.
pub const fn fwd_wgmma_kernel(
    head_dim: usize,
    mask: MaskKind,
    dropout: bool,
) -> Option<&'static FwdKernel> {
    match (kernel_for(FWD_WGMMA_KERNELS, head_dim, mask, dropout), mask) {
        (Some(k), _) => Some(k),
        (None, MaskKind::Causal) => {
            kernel_for(FWD_WGMMA_KERNELS, head_dim, MaskKind::Masked, dropout)
        }
        (None, _) => None,
    }
}

/// The backward kernel for a caller's `head_dim` under `mask`, with or without `dropout` (see
/// [`fwd_kernel`]).
pub const fn bwd_kernel(
    head_dim: usize,
    mask: MaskKind,
    dropout: bool,
) -> Option<&'static BwdKernel> {
    kernel_for(BWD_KERNELS, head_dim, mask, dropout)
}

/// Hopper's `wgmma` backward kernel for a caller's `head_dim` under `mask`, with or without
/// `dropout` and a softcap (`capped`; see [`kernel_for`]); `None` where there is none (the
/// call takes `mma.sync`). No `wgmma` backward takes a softcap: its derivative differs per
/// score, and keeping it spills (the kernels of [`MaskKind::Masked`] trap on one).
pub const fn bwd_wgmma_kernel(
    head_dim: usize,
    mask: MaskKind,
    dropout: bool,
    capped: bool,
) -> Option<&'static BwdKernel> {
    if capped {
        return None;
    }
    kernel_for(BWD_WGMMA_KERNELS, head_dim, mask, dropout)
}

/// The decode kernel for a caller's `head_dim` under `mask` (see [`kernel_for`]; the decode
/// path takes no dropout).
pub const fn decode_kernel(head_dim: usize, mask: MaskKind) -> Option<&'static DecodeKernel> {
    kernel_for(DECODE_KERNELS, head_dim, mask, false)
}

/// Launch resources of any registered kernel (for the ptxas report and the loader's checks).
#[derive(Clone, Copy, Debug)]
pub struct KernelInfo {
    /// Entry point name.
    pub name: &'static str,
    /// Family.
    pub family: Family,
    /// Dynamic shared memory per block, per target.
    pub dyn_smem: [usize; ARCH_COUNT],
    /// Threads per block, per target.
    pub threads: [usize; ARCH_COUNT],
    /// Whether the kernel exists on each target (the `wgmma` kernels are sm_90a only).
    pub built: [bool; ARCH_COUNT],
    /// Whether its PTX must declare `.maxntid threads` (the build adds it): kernels whose
    /// warpgroups rebalance registers with `setmaxnreg` need the launch budget stated.
    pub maxntid: bool,
}

impl KernelInfo {
    /// Whether the kernel is built for `arch`.
    pub const fn built_for(&self, arch: Arch) -> bool {
        self.built[arch.index()]
    }
}

/// The largest head dim any forward kernel takes.
pub const fn max_fwd_head_dim() -> usize {
    let mut max = 0;
    let mut i = 0;
    while i < FWD_KERNELS.len() {
        if FWD_KERNELS[i].head_dim > max {
            max = FWD_KERNELS[i].head_dim;
        }
        i += 1;
    }
    max
}

/// Expands the kernel list into the host tables and (on nvptx64) the entry points.
macro_rules! registry {
    (
        fwd { $( $d:literal $mask:ident $drop:ident [$f16:ident, $bf16:ident] $tiles:expr; )* }
        fwd_wgmma { $( $wd:literal $wmask:ident $wdrop:ident [$wf16:ident, $wbf16:ident] $wblock_m:literal $wblock_n:literal $wsched:ident; )* }
        bwd { $( $bd:literal $bmask:ident $bdrop:ident [$bf16_:ident, $bbf16:ident] $btiles:expr; )* }
        bwd_wgmma { $( $gd:literal $gmask:ident $gdrop:ident [$gf16:ident, $gbf16:ident] $gblock_m:literal; )* }
        bwd_passes { prep [$prep16:ident, $prepb16:ident]; convert [$conv16:ident, $convb16:ident]; }
        decode { $( $dd:literal $dmask:ident [$df16:ident, $dbf16:ident] $dtiles:expr; )* }
        decode_passes {
            combine [$comb16:ident, $combb16:ident];
            merge [$merge16:ident, $mergeb16:ident];
            append $append:ident;
        }
        layout { $( $pad:ident; )* }
        probe { wgmma [$probe16:ident, $probeb16:ident]; }
    ) => {
        /// Every forward kernel.
        pub const FWD_KERNELS: &[FwdKernel] = &[$(
            FwdKernel {
                head_dim: $d,
                mask: MaskKind::$mask,
                dropout: $drop,
                names: [stringify!($f16), stringify!($bf16)],
                tiles: tiles_of($d, $tiles),
            },
        )*];

        /// Every forward kernel on Hopper's warpgroup products (built for sm_90a only; the
        /// tile is the same in both target slots, see [`wgmma_tile`]).
        pub const FWD_WGMMA_KERNELS: &[FwdKernel] = &[$(
            FwdKernel {
                head_dim: $wd,
                mask: MaskKind::$wmask,
                dropout: $wdrop,
                names: [stringify!($wf16), stringify!($wbf16)],
                tiles: [wgmma_tile($wd, $wblock_m, $wblock_n, $wsched); ARCH_COUNT],
            },
        )*];

        /// Every backward kernel.
        pub const BWD_KERNELS: &[BwdKernel] = &[$(
            BwdKernel {
                head_dim: $bd,
                mask: MaskKind::$bmask,
                dropout: $bdrop,
                names: [stringify!($bf16_), stringify!($bbf16)],
                tiles: bwd_tiles_of($bd, $btiles),
            },
        )*];

        /// Every backward kernel on Hopper's warpgroup products (built for sm_90a only; the
        /// tile is the same in both target slots, see [`wgmma_bwd_tile`]).
        pub const BWD_WGMMA_KERNELS: &[BwdKernel] = &[$(
            BwdKernel {
                head_dim: $gd,
                mask: MaskKind::$gmask,
                dropout: $gdrop,
                names: [stringify!($gf16), stringify!($gbf16)],
                tiles: [wgmma_bwd_tile($gd, $gblock_m); ARCH_COUNT],
            },
        )*];

        /// The backward's pre-pass entry points, indexed by [`KernelDType`].
        pub const BWD_PREP_KERNELS: [&str; 2] = [stringify!($prep16), stringify!($prepb16)];

        /// The backward's dQ conversion entry points, indexed by [`KernelDType`].
        pub const BWD_CONVERT_KERNELS: [&str; 2] = [stringify!($conv16), stringify!($convb16)];

        /// Every decode kernel.
        pub const DECODE_KERNELS: &[DecodeKernel] = &[$(
            DecodeKernel {
                head_dim: $dd,
                mask: MaskKind::$dmask,
                dropout: PLAIN,
                names: [stringify!($df16), stringify!($dbf16)],
                tiles: decode_tiles_of($dd, $dtiles),
            },
        )*];

        /// The decode path's split combine entry points, indexed by [`KernelDType`].
        pub const DECODE_COMBINE_KERNELS: [&str; 2] = [stringify!($comb16), stringify!($combb16)];

        /// The attention-state merge entry points, indexed by [`KernelDType`].
        pub const MERGE_KERNELS: [&str; 2] = [stringify!($merge16), stringify!($mergeb16)];

        /// The `wgmma` layout probe's entry points (sm_90a only), indexed by [`KernelDType`].
        pub const WGMMA_PROBE_KERNELS: [&str; 2] = [stringify!($probe16), stringify!($probeb16)];

        /// The KV-cache append entry point (16-bit elements of either type).
        pub const APPEND_KERNEL: &str = stringify!($append);

        /// Every kernel of every family, with its launch resources.
        pub const ALL_KERNELS: &[KernelInfo] = &[
            $(
                fwd_info(stringify!($f16), tiles_of($d, $tiles)),
                fwd_info(stringify!($bf16), tiles_of($d, $tiles)),
            )*
            $(
                wgmma_info(stringify!($wf16), wgmma_tile($wd, $wblock_m, $wblock_n, $wsched)),
                wgmma_info(stringify!($wbf16), wgmma_tile($wd, $wblock_m, $wblock_n, $wsched)),
            )*
            $(
                bwd_info(stringify!($bf16_), bwd_tiles_of($bd, $btiles)),
                bwd_info(stringify!($bbf16), bwd_tiles_of($bd, $btiles)),
            )*
            $(
                wgmma_bwd_info(stringify!($gf16), wgmma_bwd_tile($gd, $gblock_m)),
                wgmma_bwd_info(stringify!($gbf16), wgmma_bwd_tile($gd, $gblock_m)),
            )*
            // The pre-pass: at most the stages of head dim 256 (a
            // launch passes its own head dim's).
            pass_info(stringify!($prep16), Family::BwdPasses, BWD_PREP_THREADS, PREP_SMEM),
            pass_info(stringify!($prepb16), Family::BwdPasses, BWD_PREP_THREADS, PREP_SMEM),
            pass_info(stringify!($conv16), Family::BwdPasses, BWD_AUX_THREADS, 0),
            pass_info(stringify!($convb16), Family::BwdPasses, BWD_AUX_THREADS, 0),
            $(
                decode_info(stringify!($df16), decode_tiles_of($dd, $dtiles)),
                decode_info(stringify!($dbf16), decode_tiles_of($dd, $dtiles)),
            )*
            pass_info(stringify!($comb16), Family::DecodePasses, COMBINE_THREADS, 0),
            pass_info(stringify!($combb16), Family::DecodePasses, COMBINE_THREADS, 0),
            pass_info(stringify!($merge16), Family::DecodePasses, COMBINE_THREADS, 0),
            pass_info(stringify!($mergeb16), Family::DecodePasses, COMBINE_THREADS, 0),
            pass_info(stringify!($append), Family::DecodePasses, APPEND_THREADS, 0),
            $(
                pass_info(stringify!($pad), Family::Layout, PAD_THREADS, 0),
            )*
            probe_info(stringify!($probe16)),
            probe_info(stringify!($probeb16)),
        ];

        /// The entry points: thin wrappers that pick the tile of the target being compiled
        /// and call the generic kernel bodies in `device`.
        #[cfg(target_arch = "nvptx64")]
        mod entries {
            use super::*;
            $(
                fwd_entry!($f16, F16, $mask, $drop, $d, $tiles);
                fwd_entry!($bf16, Bf16, $mask, $drop, $d, $tiles);
            )*
            $(
                fwd_wgmma_entry!($wf16, F16, $wmask, $wdrop, $wd, $wblock_m, $wblock_n, $wsched);
                fwd_wgmma_entry!($wbf16, Bf16, $wmask, $wdrop, $wd, $wblock_m, $wblock_n, $wsched);
            )*
            $(
                bwd_entry!($bf16_, F16, $bmask, $bdrop, $bd, $btiles);
                bwd_entry!($bbf16, Bf16, $bmask, $bdrop, $bd, $btiles);
            )*
            $(
                bwd_wgmma_entry!($gf16, F16, $gmask, $gdrop, $gd, $gblock_m);
                bwd_wgmma_entry!($gbf16, Bf16, $gmask, $gdrop, $gd, $gblock_m);
            )*
            bwd_pass_entry!($prep16, F16, bwd_prep);
            bwd_pass_entry!($prepb16, Bf16, bwd_prep);
            bwd_pass_entry!($conv16, F16, bwd_convert_dq);
            bwd_pass_entry!($convb16, Bf16, bwd_convert_dq);
            $(
                decode_entry!($df16, F16, $dmask, $dd, $dtiles);
                decode_entry!($dbf16, Bf16, $dmask, $dd, $dtiles);
            )*
            decode_pass_entry!($comb16, F16, decode_combine);
            decode_pass_entry!($combb16, Bf16, decode_combine);
            decode_pass_entry!($merge16, F16, merge_states);
            decode_pass_entry!($mergeb16, Bf16, merge_states);
            /// Copies new keys and values into the KV cache; see `device::decode::append`.
            ///
            /// # Safety
            /// Launched by the host crate on validated parameters.
            #[no_mangle]
            pub unsafe extern "ptx-kernel" fn $append(p: crate::params::AppendParams) {
                crate::device::await_previous_grids();
                crate::device::decode::kv_append(&p)
            }
            probe_entry!($probe16, F16);
            probe_entry!($probeb16, Bf16);
            $(
                /// Strided ⇄ packed copy of 16-bit tensors; see `device::pad`.
                ///
                /// # Safety
                /// Launched by the host crate on validated parameters.
                #[no_mangle]
                pub unsafe extern "ptx-kernel" fn $pad(p: crate::params::PadParams) {
                    crate::device::await_previous_grids();
                    crate::device::pad::pad_copy_b16(&p)
                }
            )*
        }
    };
}

/// One forward entry point (see `device::fwd::flash_fwd`).
#[cfg(target_arch = "nvptx64")]
macro_rules! fwd_entry {
    ($name:ident, $elem:ident, $mask:ident, $drop:ident, $d:literal, $tiles:expr) => {
        /// Forward attention for one (dtype, head dim, mask, dropout); see `device::fwd` for the
        /// algorithm and the registry for the tile shape.
        ///
        /// # Safety
        /// Launched by the host crate with the grid, block and shared memory of its tile.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::params::FwdParams) {
            const T: FwdTile = tiles_of($d, $tiles)[Arch::current().index()];
            crate::device::await_previous_grids();
            crate::device::fwd::flash_fwd::<
                crate::device::elem::$elem,
                crate::mask::kind::$mask,
                $d,
                { T.smem_pitch() },
                { T.block_m },
                { T.block_n },
                { T.warps },
                { T.m_tiles },
                { T.q_in_regs },
                { $d / 16 },
                { $d / 8 },
                { T.block_n / 8 },
                $drop,
            >(&p)
        }
    };
}

/// One entry point of the `wgmma` layout probe (see `device::probe`); sm_90a only.
#[cfg(target_arch = "nvptx64")]
macro_rules! probe_entry {
    ($name:ident, $elem:ident) => {
        /// The `wgmma` layout probe for one element type; see `device::probe`.
        ///
        /// # Safety
        /// Launched by the host crate with one block of `PROBE_THREADS` threads and
        /// `PROBE_SMEM_BYTES` of shared memory on buffers of the documented sizes.
        #[cfg(flash_arch = "sm90a")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::params::ProbeParams) {
            crate::device::await_previous_grids();
            crate::device::probe::wgmma_probe::<crate::device::elem::$elem>(&p)
        }
    };
}

/// One forward entry point on `wgmma` (see `device::fwd::wgmma`); sm_90a only.
#[cfg(target_arch = "nvptx64")]
macro_rules! fwd_wgmma_entry {
    ($name:ident, $elem:ident, $mask:ident, $drop:ident, $d:literal, $block_m:literal, $block_n:literal, $sched:ident) => {
        /// Forward attention on Hopper's warpgroup products for one (dtype, head dim, mask,
        /// dropout); see `device::fwd::wgmma`.
        ///
        /// # Safety
        /// Launched by the host crate with the grid, block and shared memory of its tile.
        #[cfg(flash_arch = "sm90a")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::params::WgmmaFwdParams) {
            crate::device::await_previous_grids();
            crate::device::fwd::wgmma::flash_fwd_wgmma::<
                crate::device::elem::$elem,
                crate::mask::kind::$mask,
                $d,
                $block_m,
                $block_n,
                { $d / 8 },
                { $block_n / 8 },
                { wgmma_tile($d, $block_m, $block_n, $sched).kv_stages },
                $drop,
                $sched,
            >(&p)
        }
    };
}

/// One backward entry point (see `device::bwd::flash_bwd`).
#[cfg(target_arch = "nvptx64")]
macro_rules! bwd_entry {
    ($name:ident, $elem:ident, $mask:ident, $drop:ident, $d:literal, $tiles:expr) => {
        /// Backward attention for one (dtype, head dim, mask, dropout); see `device::bwd`.
        ///
        /// # Safety
        /// Launched by the host crate with the grid, block and shared memory of its tile,
        /// after the pre-pass and with the dQ accumulator zeroed.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::params::BwdParams) {
            const T: BwdTile = bwd_tiles_of($d, $tiles)[Arch::current().index()];
            crate::device::await_previous_grids();
            crate::device::bwd::flash_bwd::<
                crate::device::elem::$elem,
                crate::mask::kind::$mask,
                $d,
                { T.smem_pitch() },
                { T.block_n },
                { T.block_m },
                { T.warps },
                { T.d_split },
                { $d / 16 },
                { $d / (8 * T.d_split) },
                { T.block_m / 8 },
                { T.block_n / 16 },
                { T.dq_cols() / 8 },
                { T.dq_tiles() },
                { T.dp_tiles() },
                { T.staged_dq },
                $drop,
            >(&p)
        }
    };
}

/// One backward entry point on `wgmma` (see `device::bwd::wgmma`); sm_90a only.
#[cfg(target_arch = "nvptx64")]
macro_rules! bwd_wgmma_entry {
    ($name:ident, $elem:ident, $mask:ident, $drop:ident, $d:literal, $block_m:literal) => {
        /// Backward attention on Hopper's warpgroup products for one (dtype, head dim, mask,
        /// dropout); see `device::bwd::wgmma`.
        ///
        /// # Safety
        /// Launched by the host crate with the grid, block and shared memory of its tile,
        /// after the pre-pass and with the dQ accumulator zeroed.
        #[cfg(flash_arch = "sm90a")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::params::BwdParams) {
            crate::device::await_previous_grids();
            crate::device::bwd::wgmma::flash_bwd_wgmma::<
                crate::device::elem::$elem,
                crate::mask::kind::$mask,
                $d,
                $block_m,
                { $d / 8 },
                { $block_m / 8 },
                $drop,
            >(&p)
        }
    };
}

/// One entry point of the backward's pre-pass or dQ conversion.
#[cfg(target_arch = "nvptx64")]
macro_rules! bwd_pass_entry {
    ($name:ident, $elem:ident, $body:ident) => {
        /// A pass of the backward (`device::bwd::passes`).
        ///
        /// # Safety
        /// Launched by the host crate on validated parameters.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::params::BwdParams) {
            crate::device::await_previous_grids();
            crate::device::bwd::$body::<crate::device::elem::$elem>(&p)
        }
    };
}

/// One decode entry point (see `device::decode::flash_decode`).
#[cfg(target_arch = "nvptx64")]
macro_rules! decode_entry {
    ($name:ident, $elem:ident, $mask:ident, $d:literal, $tiles:expr) => {
        /// Split-KV decoding for one (dtype, head dim, mask); see `device::decode`.
        ///
        /// # Safety
        /// Launched by the host crate with the grid, block and shared memory of its tile.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::params::DecodeParams) {
            const T: DecodeTile = decode_tiles_of($d, $tiles)[Arch::current().index()];
            crate::device::await_previous_grids();
            crate::device::decode::flash_decode::<
                crate::device::elem::$elem,
                crate::mask::kind::$mask,
                $d,
                { T.smem_pitch() },
                { T.block_m() },
                { T.m_tiles },
                { T.warps },
                { T.stages },
                { T.q_in_regs },
                { $d / 16 },
                { $d / 8 },
            >(&p)
        }
    };
}

/// One entry point of the decode path's combine or merge.
#[cfg(target_arch = "nvptx64")]
macro_rules! decode_pass_entry {
    ($name:ident, $elem:ident, $body:ident) => {
        /// Merges attention states (`device::decode::combine`).
        ///
        /// # Safety
        /// Launched by the host crate on validated parameters.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::params::CombineParams) {
            crate::device::await_previous_grids();
            crate::device::decode::$body::<crate::device::elem::$elem>(&p)
        }
    };
}

/// Dynamic shared memory the pre-pass is registered with: its stages at head dim 256.
const PREP_SMEM: usize = bwd_prep_smem(256);

/// A pass kernel of `family` (the backward's pre-pass and dQ conversion, the decode path's
/// combine, merge and append, the layout kernels): the same `threads` and dynamic shared
/// memory (`dyn_smem` bytes) on every target, no `.maxntid`.
const fn pass_info(
    name: &'static str,
    family: Family,
    threads: usize,
    dyn_smem: usize,
) -> KernelInfo {
    KernelInfo {
        name,
        family,
        dyn_smem: [dyn_smem; ARCH_COUNT],
        threads: [threads; ARCH_COUNT],
        built: [true; ARCH_COUNT],
        maxntid: false,
    }
}

/// `[f(x[0]), f(x[1]), …]` over the targets, in a `const` context (closures and trait
/// methods are not allowed there).
macro_rules! per_arch {
    ($items:expr, $init:expr, |$x:ident| $f:expr) => {{
        let items = $items;
        let mut out = [$init; ARCH_COUNT];
        let mut i = 0;
        while i < ARCH_COUNT {
            let $x = items[i];
            out[i] = $f;
            i += 1;
        }
        out
    }};
}

/// The registry's per-target `(warps, m_tiles, block_n, q_in_regs)` as forward tiles.
const fn tiles_of(
    head_dim: usize,
    shapes: [(usize, usize, usize, bool); ARCH_COUNT],
) -> [FwdTile; ARCH_COUNT] {
    per_arch!(shapes, FwdTile::new(head_dim, shapes[0]), |s| FwdTile::new(
        head_dim, s
    ))
}

/// The registry's per-target `(key_warps, d_split, block_m, staged_dq)` as backward tiles.
const fn bwd_tiles_of(
    head_dim: usize,
    shapes: [(usize, usize, usize, bool); ARCH_COUNT],
) -> [BwdTile; ARCH_COUNT] {
    per_arch!(shapes, BwdTile::new(head_dim, shapes[0]), |s| BwdTile::new(
        head_dim, s
    ))
}

/// The registry's per-target `(m_tiles, warps, stages, q_in_regs)` as decode tiles.
const fn decode_tiles_of(
    head_dim: usize,
    shapes: [(usize, usize, usize, bool); ARCH_COUNT],
) -> [DecodeTile; ARCH_COUNT] {
    per_arch!(shapes, DecodeTile::new(head_dim, shapes[0]), |s| {
        DecodeTile::new(head_dim, s)
    })
}

const fn decode_info(name: &'static str, tiles: [DecodeTile; ARCH_COUNT]) -> KernelInfo {
    KernelInfo {
        name,
        family: Family::Decode,
        dyn_smem: per_arch!(tiles, 0, |t| t.smem_bytes()),
        threads: per_arch!(tiles, 0, |t| t.threads()),
        built: [true; ARCH_COUNT],
        maxntid: false,
    }
}

const fn fwd_info(name: &'static str, tiles: [FwdTile; ARCH_COUNT]) -> KernelInfo {
    KernelInfo {
        name,
        family: Family::Fwd,
        dyn_smem: per_arch!(tiles, 0, |t| t.smem_bytes()),
        threads: per_arch!(tiles, 0, |t| t.threads()),
        built: [true; ARCH_COUNT],
        maxntid: false,
    }
}

const fn probe_info(name: &'static str) -> KernelInfo {
    let mut built = [false; ARCH_COUNT];
    built[Arch::Sm90a.index()] = true;
    KernelInfo {
        name,
        family: Family::Probe,
        dyn_smem: [PROBE_SMEM_BYTES; ARCH_COUNT],
        threads: [PROBE_THREADS; ARCH_COUNT],
        built,
        maxntid: false,
    }
}

const fn wgmma_info(name: &'static str, tile: FwdTile) -> KernelInfo {
    let mut built = [false; ARCH_COUNT];
    built[Arch::Sm90a.index()] = true;
    KernelInfo {
        name,
        family: Family::Fwd,
        dyn_smem: [tile.smem_bytes(); ARCH_COUNT],
        threads: [tile.threads(); ARCH_COUNT],
        built,
        maxntid: tile.producer_warps > 0,
    }
}

/// The tile of a `wgmma` forward kernel: `block_m` query rows (consumer warpgroups of 64), a
/// producer warpgroup, `block_n` keys, a ring of 3 (K, V) stages, or 2 where 3 do not fit
/// Hopper's shared memory (d = 256); O staged through shared memory where that fits beside
/// a ring of 3 (d = 64; at d = 128 it would cost the third stage); persistent blocks if
/// `persistent`.
pub const fn wgmma_tile(
    head_dim: usize,
    block_m: usize,
    block_n: usize,
    persistent: bool,
) -> FwdTile {
    let warps = block_m / MMA_M;
    let tile = FwdTile::new(head_dim, (warps, 1, block_n, false))
        .with_producer_warps(4)
        .with_persistent(persistent);
    let three = tile.with_kv_stages(3);
    let staged = three.with_staged_output();
    if staged.smem_bytes() <= Arch::Sm90a.max_dyn_smem() {
        staged
    } else if three.smem_bytes() <= Arch::Sm90a.max_dyn_smem() {
        three
    } else {
        tile.with_kv_stages(2)
    }
}

/// The tile of a `wgmma` backward kernel: two warpgroups of 64 keys (128 per block) and
/// query tiles of `block_m` rows, in the shared-memory layout of the `mma.sync` backward
/// ([`BwdTile::smem_bytes`], the pitch being the head dim) with its dQ stage, and the block's
/// record; see `device::bwd::wgmma`.
pub const fn wgmma_bwd_tile(head_dim: usize, block_m: usize) -> BwdTile {
    BwdTile::new(head_dim, (8, 1, block_m, true)).with_block_record()
}

const fn wgmma_bwd_info(name: &'static str, tile: BwdTile) -> KernelInfo {
    let mut built = [false; ARCH_COUNT];
    built[Arch::Sm90a.index()] = true;
    KernelInfo {
        name,
        family: Family::Bwd,
        dyn_smem: [tile.smem_bytes(); ARCH_COUNT],
        threads: [tile.threads(); ARCH_COUNT],
        built,
        maxntid: false,
    }
}

const fn bwd_info(name: &'static str, tiles: [BwdTile; ARCH_COUNT]) -> KernelInfo {
    KernelInfo {
        name,
        family: Family::Bwd,
        dyn_smem: per_arch!(tiles, 0, |t| t.smem_bytes()),
        threads: per_arch!(tiles, 0, |t| t.threads()),
        built: [true; ARCH_COUNT],
        maxntid: false,
    }
}

// The kernels. Forward rows: compiled head dim, mask kind, entry names (f16, bf16), and the
// tile `(warps, m_tiles, block_n, q_in_regs)` per target in `ARCHS` order (sm_80, sm_90a).
// Hopper's register allocation fits 64-key tiles at d = 128 without spills (measured faster:
// docs/perf-notes.md); sm_80..sm_89 spill there.
registry! {
    fwd {
        32 Causal PLAIN [flash_fwd_f16_d32, flash_fwd_bf16_d32] [(4, 2, 64, true), (4, 2, 64, true)];
        64 Causal PLAIN [flash_fwd_f16_d64, flash_fwd_bf16_d64] [(4, 2, 64, true), (4, 2, 64, true)];
        96 Causal PLAIN [flash_fwd_f16_d96, flash_fwd_bf16_d96] [(4, 2, 32, false), (4, 2, 32, false)];
        128 Causal PLAIN [flash_fwd_f16_d128, flash_fwd_bf16_d128] [(4, 2, 32, false), (4, 2, 64, false)];
        256 Causal PLAIN [flash_fwd_f16_d256, flash_fwd_bf16_d256] [(4, 1, 16, false), (4, 1, 16, false)];
        // The general mask's kernels: softcap, ALiBi and the window cost registers, so some
        // tiles are smaller than the plain ones' (no spills on either target).
        32 Masked PLAIN [flash_fwd_masked_f16_d32, flash_fwd_masked_bf16_d32] [(4, 2, 64, true), (4, 2, 64, true)];
        64 Masked PLAIN [flash_fwd_masked_f16_d64, flash_fwd_masked_bf16_d64] [(4, 2, 64, false), (4, 2, 64, false)];
        96 Masked PLAIN [flash_fwd_masked_f16_d96, flash_fwd_masked_bf16_d96] [(4, 2, 32, false), (4, 2, 32, false)];
        128 Masked PLAIN [flash_fwd_masked_f16_d128, flash_fwd_masked_bf16_d128] [(4, 2, 32, false), (4, 2, 32, false)];
        256 Masked PLAIN [flash_fwd_masked_f16_d256, flash_fwd_masked_bf16_d256] [(4, 1, 16, false), (4, 1, 16, false)];
        // Block-sparse: the mask keeps its bit rows' address, so the tiles that sit at the
        // register limit in the plain kernels are those of the general mask here.
        32 Sparse PLAIN [flash_fwd_sparse_f16_d32, flash_fwd_sparse_bf16_d32] [(4, 2, 64, true), (4, 2, 64, true)];
        64 Sparse PLAIN [flash_fwd_sparse_f16_d64, flash_fwd_sparse_bf16_d64] [(4, 2, 64, false), (4, 2, 64, false)];
        96 Sparse PLAIN [flash_fwd_sparse_f16_d96, flash_fwd_sparse_bf16_d96] [(4, 2, 32, false), (4, 2, 32, false)];
        128 Sparse PLAIN [flash_fwd_sparse_f16_d128, flash_fwd_sparse_bf16_d128] [(4, 2, 32, false), (4, 2, 16, false)];
        256 Sparse PLAIN [flash_fwd_sparse_f16_d256, flash_fwd_sparse_bf16_d256] [(4, 1, 16, false), (4, 1, 16, false)];
        // Tree masks (few queries: one 64-row query tile covers a typical draft tree).
        32 Tree PLAIN [flash_fwd_tree_f16_d32, flash_fwd_tree_bf16_d32] [(4, 1, 64, true), (4, 1, 64, true)];
        64 Tree PLAIN [flash_fwd_tree_f16_d64, flash_fwd_tree_bf16_d64] [(4, 1, 64, false), (4, 1, 64, false)];
        96 Tree PLAIN [flash_fwd_tree_f16_d96, flash_fwd_tree_bf16_d96] [(4, 1, 32, false), (4, 1, 32, false)];
        128 Tree PLAIN [flash_fwd_tree_f16_d128, flash_fwd_tree_bf16_d128] [(4, 1, 32, false), (4, 1, 32, false)];
        256 Tree PLAIN [flash_fwd_tree_f16_d256, flash_fwd_tree_bf16_d256] [(4, 1, 16, false), (4, 1, 16, false)];
        // Attention dropout: the tiles of the general kind without dropout, smaller where
        // the generator's registers would spill.
        32 Masked DROPOUT [flash_fwd_masked_dropout_f16_d32, flash_fwd_masked_dropout_bf16_d32] [(4, 2, 64, true), (4, 2, 64, true)];
        64 Masked DROPOUT [flash_fwd_masked_dropout_f16_d64, flash_fwd_masked_dropout_bf16_d64] [(4, 2, 64, false), (4, 2, 64, false)];
        96 Masked DROPOUT [flash_fwd_masked_dropout_f16_d96, flash_fwd_masked_dropout_bf16_d96] [(4, 2, 32, false), (4, 2, 32, false)];
        128 Masked DROPOUT [flash_fwd_masked_dropout_f16_d128, flash_fwd_masked_dropout_bf16_d128] [(4, 2, 32, false), (4, 2, 32, false)];
        256 Masked DROPOUT [flash_fwd_masked_dropout_f16_d256, flash_fwd_masked_dropout_bf16_d256] [(4, 1, 16, false), (4, 1, 16, false)];
        32 Sparse DROPOUT [flash_fwd_sparse_dropout_f16_d32, flash_fwd_sparse_dropout_bf16_d32] [(4, 2, 64, true), (4, 2, 64, true)];
        64 Sparse DROPOUT [flash_fwd_sparse_dropout_f16_d64, flash_fwd_sparse_dropout_bf16_d64] [(4, 2, 64, false), (4, 2, 64, false)];
        96 Sparse DROPOUT [flash_fwd_sparse_dropout_f16_d96, flash_fwd_sparse_dropout_bf16_d96] [(4, 2, 32, false), (4, 2, 32, false)];
        128 Sparse DROPOUT [flash_fwd_sparse_dropout_f16_d128, flash_fwd_sparse_dropout_bf16_d128] [(4, 2, 32, false), (4, 2, 16, false)];
        256 Sparse DROPOUT [flash_fwd_sparse_dropout_f16_d256, flash_fwd_sparse_dropout_bf16_d256] [(4, 1, 16, false), (4, 1, 16, false)];
        32 Tree DROPOUT [flash_fwd_tree_dropout_f16_d32, flash_fwd_tree_dropout_bf16_d32] [(4, 1, 64, true), (4, 1, 64, true)];
        64 Tree DROPOUT [flash_fwd_tree_dropout_f16_d64, flash_fwd_tree_dropout_bf16_d64] [(4, 1, 64, false), (4, 1, 64, false)];
        96 Tree DROPOUT [flash_fwd_tree_dropout_f16_d96, flash_fwd_tree_dropout_bf16_d96] [(4, 1, 32, false), (4, 1, 32, false)];
        128 Tree DROPOUT [flash_fwd_tree_dropout_f16_d128, flash_fwd_tree_dropout_bf16_d128] [(4, 1, 32, false), (4, 1, 32, false)];
        256 Tree DROPOUT [flash_fwd_tree_dropout_f16_d256, flash_fwd_tree_dropout_bf16_d256] [(4, 1, 16, false), (4, 1, 16, false)];
    }
    // Hopper's forward on `wgmma` (sm_90a only): compiled head dim, mask kind, names, query
    // rows and keys per tile (128 query rows: two consumer warpgroups of 64, 192: three,
    // plus a producer warpgroup; `wgmma_tile` sizes the ring). Three consumer warpgroups at
    // d = 64 for the plain kind (causal or no mask), and with dropout for the plain and
    // general kinds on 64-key tiles (three scheduler slots' worth of warps hide the
    // generator's latency: 0.91–0.99× the time of two warpgroups on 128-key tiles; with
    // 128-key tiles they spilled 248 B at 160 registers, docs/perf-notes.md). Not the
    // general mask without dropout (at 160 registers it spilled 8–16 B in its masked tiles:
    // window, ALiBi and softcap terms; on 64-key tiles it fit but ran 1.09–1.20× the time),
    // nor at d = 128 with dropout (192 × 64 fits but ran 1.07–1.15× the time), and the
    // block-sparse mask's query tiles must lie in one of its 128-row blocks. Every mask
    // kind, with and without dropout, at d = 64 and 128 (the general mask with dropout at
    // d = 128 on 64-key tiles: with 128 it spilled, 32 B of stack and 100 B of spills at
    // 240 registers). The plain mask without dropout at d = 256 has no kernel of its own,
    // and at d = 128 only one of 176-key tiles: its calls run on the general kernel
    // (`fwd_wgmma_kernel`) where those tiles do not pay (`Keys::take_wide_tiles`; a plain
    // kernel of the general one's tiles ran 5–13 % slower than it on the same calls, H100,
    // docs/perf-notes.md, two consumer warpgroups). At d = 256 (64-key tiles) every mask
    // kind without dropout and the general and tree masks with it (plain calls with dropout
    // run on the general kernel); the block-sparse mask with dropout spills (12 B since the
    // f16-pair keep test), which xtask allows for this kernel alone, measured against
    // `mma.sync`.
    // Which calls take them is the host's dispatch (`wgmma_pays`). `PERSISTENT`: about one
    // block per SM taking query tiles from a counter (`FwdTile::persistent`), for the
    // kernels of plain calls at d = 64 and 128, and at d = 64 those of plain calls with
    // dropout and of the general mask without it (0.93–0.98× the one-block-per-tile
    // kernels' time with dropout, 0.96–0.99× for windows, ALiBi and softcaps at 16K, H200);
    // the block-sparse kernels at d = 64 and 128, with and without dropout (clock-locked,
    // 16K keys, H100: d = 128 0.90× the cycles at density 1/16 to 0.98× at 1, d = 64 0.92×
    // at 1/16 to 1.03× at 1, with dropout 0.97–0.99× at d = 64, 0.93–0.995× at d = 128; a
    // first trial, whose first key tile was not passed through lane 0, ran the d = 128 key
    // loop 1.16× slower, and spilled with dropout). `PER_TILE`: one block per query tile, for
    // the rest. Tried persistent and reverted: the plain kind's d = 128 kernel with dropout
    // (1.11–1.17× the time from 4K keys, H200; again 1.11–1.19× the cycles on the H100 with
    // its first tile uniform, not explained); docs/perf-notes.md, 2026-11-27.
    fwd_wgmma {
        64 Causal PLAIN [flash_fwd_wgmma_f16_d64, flash_fwd_wgmma_bf16_d64] 192 128 PERSISTENT;
        64 Masked PLAIN [flash_fwd_wgmma_masked_f16_d64, flash_fwd_wgmma_masked_bf16_d64] 128 128 PERSISTENT;
        64 Sparse PLAIN [flash_fwd_wgmma_sparse_f16_d64, flash_fwd_wgmma_sparse_bf16_d64] 128 128 PERSISTENT;
        64 Tree PLAIN [flash_fwd_wgmma_tree_f16_d64, flash_fwd_wgmma_tree_bf16_d64] 128 128 PER_TILE;
        64 Causal DROPOUT [flash_fwd_wgmma_dropout_f16_d64, flash_fwd_wgmma_dropout_bf16_d64] 192 64 PERSISTENT;
        64 Masked DROPOUT [flash_fwd_wgmma_masked_dropout_f16_d64, flash_fwd_wgmma_masked_dropout_bf16_d64] 192 64 PER_TILE;
        64 Sparse DROPOUT [flash_fwd_wgmma_sparse_dropout_f16_d64, flash_fwd_wgmma_sparse_dropout_bf16_d64] 128 128 PERSISTENT;
        64 Tree DROPOUT [flash_fwd_wgmma_tree_dropout_f16_d64, flash_fwd_wgmma_tree_dropout_bf16_d64] 128 128 PER_TILE;
        // 176-key tiles (a ring of 2) for the plain calls where they pay; the host sends the
        // others to the general kernel (`Keys::take_wide_tiles`).
        128 Causal PLAIN [flash_fwd_wgmma_f16_d128, flash_fwd_wgmma_bf16_d128] 128 176 PERSISTENT;
        128 Masked PLAIN [flash_fwd_wgmma_masked_f16_d128, flash_fwd_wgmma_masked_bf16_d128] 128 128 PERSISTENT;
        128 Sparse PLAIN [flash_fwd_wgmma_sparse_f16_d128, flash_fwd_wgmma_sparse_bf16_d128] 128 128 PERSISTENT;
        128 Tree PLAIN [flash_fwd_wgmma_tree_f16_d128, flash_fwd_wgmma_tree_bf16_d128] 128 128 PER_TILE;
        128 Causal DROPOUT [flash_fwd_wgmma_dropout_f16_d128, flash_fwd_wgmma_dropout_bf16_d128] 128 128 PER_TILE;
        128 Masked DROPOUT [flash_fwd_wgmma_masked_dropout_f16_d128, flash_fwd_wgmma_masked_dropout_bf16_d128] 128 64 PER_TILE;
        128 Sparse DROPOUT [flash_fwd_wgmma_sparse_dropout_f16_d128, flash_fwd_wgmma_sparse_dropout_bf16_d128] 128 128 PERSISTENT;
        128 Tree DROPOUT [flash_fwd_wgmma_tree_dropout_f16_d128, flash_fwd_wgmma_tree_dropout_bf16_d128] 128 128 PER_TILE;
        256 Masked PLAIN [flash_fwd_wgmma_masked_f16_d256, flash_fwd_wgmma_masked_bf16_d256] 128 64 PER_TILE;
        256 Sparse PLAIN [flash_fwd_wgmma_sparse_f16_d256, flash_fwd_wgmma_sparse_bf16_d256] 128 64 PER_TILE;
        256 Tree PLAIN [flash_fwd_wgmma_tree_f16_d256, flash_fwd_wgmma_tree_bf16_d256] 128 64 PER_TILE;
        256 Masked DROPOUT [flash_fwd_wgmma_masked_dropout_f16_d256, flash_fwd_wgmma_masked_dropout_bf16_d256] 128 64 PER_TILE;
        // The tree mask with dropout fits at d = 256 since the keep test works on f16 pairs;
        // the block-sparse mask with dropout there spills 12 B (8 B frame), within its
        // allowance (xtask's `LOCAL_MEMORY_ALLOWED`; in turn instead of overlapped: 44 B).
        256 Sparse DROPOUT [flash_fwd_wgmma_sparse_dropout_f16_d256, flash_fwd_wgmma_sparse_dropout_bf16_d256] 128 64 PER_TILE;
        256 Tree DROPOUT [flash_fwd_wgmma_tree_dropout_f16_d256, flash_fwd_wgmma_tree_dropout_bf16_d256] 128 64 PER_TILE;
    }
    // Backward rows: the tile `(key_warps, d_split, block_m, staged_dq)` per target; dQ goes
    // through shared memory and the bulk copy engine where the target has one (sm_90a).
    bwd {
        32 Causal PLAIN [flash_bwd_f16_d32, flash_bwd_bf16_d32] [(8, 1, 64, false), (8, 1, 64, true)];
        64 Causal PLAIN [flash_bwd_f16_d64, flash_bwd_bf16_d64] [(8, 1, 64, false), (8, 1, 128, true)];
        96 Causal PLAIN [flash_bwd_f16_d96, flash_bwd_bf16_d96] [(4, 1, 32, false), (4, 1, 32, true)];
        128 Causal PLAIN [flash_bwd_f16_d128, flash_bwd_bf16_d128] [(4, 1, 32, false), (8, 1, 64, false)];
        256 Causal PLAIN [flash_bwd_f16_d256, flash_bwd_bf16_d256] [(2, 2, 32, false), (4, 2, 32, true)];
        // The general mask's kernels keep d logit / d s per score: smaller query tiles.
        32 Masked PLAIN [flash_bwd_masked_f16_d32, flash_bwd_masked_bf16_d32] [(8, 1, 64, false), (8, 1, 64, true)];
        64 Masked PLAIN [flash_bwd_masked_f16_d64, flash_bwd_masked_bf16_d64] [(8, 1, 64, false), (8, 1, 64, true)];
        96 Masked PLAIN [flash_bwd_masked_f16_d96, flash_bwd_masked_bf16_d96] [(4, 1, 32, false), (4, 1, 32, true)];
        128 Masked PLAIN [flash_bwd_masked_f16_d128, flash_bwd_masked_bf16_d128] [(4, 1, 32, false), (8, 1, 32, false)];
        256 Masked PLAIN [flash_bwd_masked_f16_d256, flash_bwd_masked_bf16_d256] [(1, 4, 32, false), (4, 2, 32, true)];
        32 Sparse PLAIN [flash_bwd_sparse_f16_d32, flash_bwd_sparse_bf16_d32] [(8, 1, 64, false), (8, 1, 64, true)];
        64 Sparse PLAIN [flash_bwd_sparse_f16_d64, flash_bwd_sparse_bf16_d64] [(8, 1, 64, false), (8, 1, 64, true)];
        96 Sparse PLAIN [flash_bwd_sparse_f16_d96, flash_bwd_sparse_bf16_d96] [(4, 1, 32, false), (4, 1, 32, true)];
        128 Sparse PLAIN [flash_bwd_sparse_f16_d128, flash_bwd_sparse_bf16_d128] [(4, 1, 32, false), (8, 1, 32, false)];
        256 Sparse PLAIN [flash_bwd_sparse_f16_d256, flash_bwd_sparse_bf16_d256] [(1, 4, 32, false), (4, 2, 32, true)];
        // Tree masks: the block-sparse tiles (both masks keep a bits address).
        32 Tree PLAIN [flash_bwd_tree_f16_d32, flash_bwd_tree_bf16_d32] [(8, 1, 64, false), (8, 1, 64, true)];
        64 Tree PLAIN [flash_bwd_tree_f16_d64, flash_bwd_tree_bf16_d64] [(8, 1, 64, false), (8, 1, 64, true)];
        96 Tree PLAIN [flash_bwd_tree_f16_d96, flash_bwd_tree_bf16_d96] [(4, 1, 32, false), (4, 1, 32, true)];
        128 Tree PLAIN [flash_bwd_tree_f16_d128, flash_bwd_tree_bf16_d128] [(4, 1, 32, false), (8, 1, 32, false)];
        256 Tree PLAIN [flash_bwd_tree_f16_d256, flash_bwd_tree_bf16_d256] [(1, 4, 32, false), (4, 2, 32, true)];
        // Attention dropout: the tiles of the general kind without dropout, smaller where
        // the generator's registers would spill.
        32 Causal DROPOUT [flash_bwd_dropout_f16_d32, flash_bwd_dropout_bf16_d32] [(8, 1, 64, false), (8, 1, 64, true)];
        64 Causal DROPOUT [flash_bwd_dropout_f16_d64, flash_bwd_dropout_bf16_d64] [(8, 1, 32, false), (8, 1, 64, true)];
        96 Causal DROPOUT [flash_bwd_dropout_f16_d96, flash_bwd_dropout_bf16_d96] [(4, 1, 32, false), (4, 1, 32, true)];
        128 Causal DROPOUT [flash_bwd_dropout_f16_d128, flash_bwd_dropout_bf16_d128] [(4, 2, 32, false), (8, 1, 32, false)];
        256 Causal DROPOUT [flash_bwd_dropout_f16_d256, flash_bwd_dropout_bf16_d256] [(1, 4, 32, false), (4, 2, 32, true)];
        32 Masked DROPOUT [flash_bwd_masked_dropout_f16_d32, flash_bwd_masked_dropout_bf16_d32] [(8, 1, 64, false), (8, 1, 64, true)];
        64 Masked DROPOUT [flash_bwd_masked_dropout_f16_d64, flash_bwd_masked_dropout_bf16_d64] [(8, 1, 32, false), (8, 1, 32, true)];
        96 Masked DROPOUT [flash_bwd_masked_dropout_f16_d96, flash_bwd_masked_dropout_bf16_d96] [(4, 1, 32, false), (4, 1, 32, true)];
        128 Masked DROPOUT [flash_bwd_masked_dropout_f16_d128, flash_bwd_masked_dropout_bf16_d128] [(4, 2, 32, false), (8, 1, 32, false)];
        256 Masked DROPOUT [flash_bwd_masked_dropout_f16_d256, flash_bwd_masked_dropout_bf16_d256] [(1, 4, 32, false), (4, 2, 32, true)];
        32 Sparse DROPOUT [flash_bwd_sparse_dropout_f16_d32, flash_bwd_sparse_dropout_bf16_d32] [(8, 1, 64, false), (8, 1, 64, true)];
        64 Sparse DROPOUT [flash_bwd_sparse_dropout_f16_d64, flash_bwd_sparse_dropout_bf16_d64] [(8, 1, 32, false), (8, 1, 64, true)];
        96 Sparse DROPOUT [flash_bwd_sparse_dropout_f16_d96, flash_bwd_sparse_dropout_bf16_d96] [(4, 1, 32, false), (4, 1, 32, true)];
        128 Sparse DROPOUT [flash_bwd_sparse_dropout_f16_d128, flash_bwd_sparse_dropout_bf16_d128] [(4, 1, 32, false), (8, 1, 32, false)];
        256 Sparse DROPOUT [flash_bwd_sparse_dropout_f16_d256, flash_bwd_sparse_dropout_bf16_d256] [(1, 4, 32, false), (4, 2, 32, true)];
        32 Tree DROPOUT [flash_bwd_tree_dropout_f16_d32, flash_bwd_tree_dropout_bf16_d32] [(8, 1, 64, false), (8, 1, 64, true)];
        64 Tree DROPOUT [flash_bwd_tree_dropout_f16_d64, flash_bwd_tree_dropout_bf16_d64] [(8, 1, 64, false), (8, 1, 64, true)];
        96 Tree DROPOUT [flash_bwd_tree_dropout_f16_d96, flash_bwd_tree_dropout_bf16_d96] [(4, 1, 32, false), (4, 1, 32, true)];
        128 Tree DROPOUT [flash_bwd_tree_dropout_f16_d128, flash_bwd_tree_dropout_bf16_d128] [(4, 1, 32, false), (8, 1, 32, false)];
        256 Tree DROPOUT [flash_bwd_tree_dropout_f16_d256, flash_bwd_tree_dropout_bf16_d256] [(1, 4, 32, false), (4, 2, 32, true)];
    }
    // Hopper's backward on `wgmma` (sm_90a only): compiled head dim, mask kind, names, query
    // rows per step (the block holds 128 keys: two warpgroups of 64). Calls without a row
    // here take `mma.sync` (`bwd_wgmma_kernel`; the host's dispatch picks), and so do calls
    // with a softcap (a d logit / d s tile per score spilled 64–848 B; the general mask's
    // kernels here take windows and ALiBi, whose derivative is one value per tile). Missing
    // because ptxas spilled them: dropout with the general mask at d = 128 (88 B frame, 168 B
    // of spills with the f16-pair keep test; 128–152 B frames before it).
    bwd_wgmma {
        64 Causal PLAIN [flash_bwd_wgmma_f16_d64, flash_bwd_wgmma_bf16_d64] 128;
        64 Masked PLAIN [flash_bwd_wgmma_masked_f16_d64, flash_bwd_wgmma_masked_bf16_d64] 128;
        64 Sparse PLAIN [flash_bwd_wgmma_sparse_f16_d64, flash_bwd_wgmma_sparse_bf16_d64] 128;
        64 Tree PLAIN [flash_bwd_wgmma_tree_f16_d64, flash_bwd_wgmma_tree_bf16_d64] 128;
        // With dropout, 128-row query tiles since the keep test works on f16 pairs (with the
        // bit-packing test of before, 128 rows left a 256-byte stack and the kernel ran 64).
        64 Causal DROPOUT [flash_bwd_wgmma_dropout_f16_d64, flash_bwd_wgmma_dropout_bf16_d64] 128;
        64 Masked DROPOUT [flash_bwd_wgmma_masked_dropout_f16_d64, flash_bwd_wgmma_masked_dropout_bf16_d64] 64;
        64 Sparse DROPOUT [flash_bwd_wgmma_sparse_dropout_f16_d64, flash_bwd_wgmma_sparse_dropout_bf16_d64] 64;
        64 Tree DROPOUT [flash_bwd_wgmma_tree_dropout_f16_d64, flash_bwd_wgmma_tree_dropout_bf16_d64] 64;
        128 Sparse DROPOUT [flash_bwd_wgmma_sparse_dropout_f16_d128, flash_bwd_wgmma_sparse_dropout_bf16_d128] 64;
        128 Tree DROPOUT [flash_bwd_wgmma_tree_dropout_f16_d128, flash_bwd_wgmma_tree_dropout_bf16_d128] 64;
        128 Causal PLAIN [flash_bwd_wgmma_f16_d128, flash_bwd_wgmma_bf16_d128] 64;
        128 Causal DROPOUT [flash_bwd_wgmma_dropout_f16_d128, flash_bwd_wgmma_dropout_bf16_d128] 64;
        128 Masked PLAIN [flash_bwd_wgmma_masked_f16_d128, flash_bwd_wgmma_masked_bf16_d128] 64;
        128 Sparse PLAIN [flash_bwd_wgmma_sparse_f16_d128, flash_bwd_wgmma_sparse_bf16_d128] 64;
        128 Tree PLAIN [flash_bwd_wgmma_tree_f16_d128, flash_bwd_wgmma_tree_bf16_d128] 64;
    }
    bwd_passes {
        prep [flash_bwd_prep_f16, flash_bwd_prep_bf16];
        convert [flash_bwd_convert_dq_f16, flash_bwd_convert_dq_bf16];
    }
    // Decode rows: `(m_tiles, warps, stages, q_in_regs)` per target (sm_80 code must fit the
    // 99 KiB of sm_86/sm_89).
    decode {
        32 Causal [flash_decode_f16_d32, flash_decode_bf16_d32] [(2, 4, 4, true), (2, 4, 4, true)];
        64 Causal [flash_decode_f16_d64, flash_decode_bf16_d64] [(2, 4, 4, true), (2, 4, 4, true)];
        96 Causal [flash_decode_f16_d96, flash_decode_bf16_d96] [(2, 4, 2, false), (2, 8, 3, false)];
        128 Causal [flash_decode_f16_d128, flash_decode_bf16_d128] [(2, 4, 2, false), (2, 8, 3, false)];
        256 Causal [flash_decode_f16_d256, flash_decode_bf16_d256] [(1, 2, 2, false), (1, 4, 3, false)];
        // The general mask's kernels hold one ALiBi slope per row: one m-tile at d = 128.
        32 Masked [flash_decode_masked_f16_d32, flash_decode_masked_bf16_d32] [(2, 4, 4, true), (2, 4, 4, true)];
        64 Masked [flash_decode_masked_f16_d64, flash_decode_masked_bf16_d64] [(2, 4, 4, true), (2, 4, 4, true)];
        96 Masked [flash_decode_masked_f16_d96, flash_decode_masked_bf16_d96] [(2, 4, 2, false), (2, 8, 3, false)];
        128 Masked [flash_decode_masked_f16_d128, flash_decode_masked_bf16_d128] [(1, 4, 2, false), (1, 8, 3, false)];
        256 Masked [flash_decode_masked_f16_d256, flash_decode_masked_bf16_d256] [(1, 2, 2, false), (1, 4, 3, false)];
        // Tree masks on the decode path: the plain tiles (one m-tile at d = 128 on sm_80,
        // where the bits address would spill).
        32 Tree [flash_decode_tree_f16_d32, flash_decode_tree_bf16_d32] [(2, 4, 4, true), (2, 4, 4, true)];
        64 Tree [flash_decode_tree_f16_d64, flash_decode_tree_bf16_d64] [(2, 4, 4, true), (2, 4, 4, true)];
        96 Tree [flash_decode_tree_f16_d96, flash_decode_tree_bf16_d96] [(2, 4, 2, false), (2, 8, 3, false)];
        128 Tree [flash_decode_tree_f16_d128, flash_decode_tree_bf16_d128] [(1, 4, 2, false), (2, 8, 3, false)];
        256 Tree [flash_decode_tree_f16_d256, flash_decode_tree_bf16_d256] [(1, 2, 2, false), (1, 4, 3, false)];
    }
    decode_passes {
        combine [flash_decode_combine_f16, flash_decode_combine_bf16];
        merge [merge_states_f16, merge_states_bf16];
        append kv_append_b16;
    }
    layout {
        pad_copy_b16;
    }
    probe {
        wgmma [wgmma_probe_f16, wgmma_probe_bf16];
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::config::PAD_KERNEL_NAME;
    use std::format;

    #[test]
    fn every_tile_is_consistent() {
        for k in FWD_KERNELS {
            for t in k.tiles {
                assert_eq!(t.head_dim, k.head_dim);
                assert_eq!(t.block_m, t.warps * MMA_M * t.m_tiles);
                assert_eq!(t.block_n % 16, 0);
                assert_eq!(k.head_dim % 16, 0);
                // fits the smallest opt-in shared memory of the targets (sm_86/sm_89: 99 KiB)
                assert!(
                    t.smem_bytes() <= Arch::Sm80.max_dyn_smem(),
                    "d={}: {}",
                    k.head_dim,
                    t.smem_bytes()
                );
            }
        }
    }

    /// Opt-in shared memory per block, in `ARCHS` order ([`Arch::max_dyn_smem`]).
    const SMEM_LIMITS: [usize; ARCH_COUNT] =
        [Arch::Sm80.max_dyn_smem(), Arch::Sm90a.max_dyn_smem()];

    /// Every tile of `rows` is valid, has its row's head dim and fits the target's shared
    /// memory; the tile's `(head_dim, is_valid, smem_bytes)` come from `shape`.
    fn check_tiles<T: Copy + core::fmt::Debug>(
        rows: &[KernelRow<T>],
        shape: impl Fn(&T) -> (usize, bool, usize),
    ) {
        for k in rows {
            for (t, limit) in k.tiles.iter().zip(SMEM_LIMITS) {
                let (head_dim, valid, smem) = shape(t);
                assert_eq!(head_dim, k.head_dim);
                assert!(valid, "d={}: {t:?}", k.head_dim);
                assert!(smem <= limit, "d={}: {smem}", k.head_dim);
            }
        }
    }

    #[test]
    fn every_backward_tile_is_valid_and_fits() {
        check_tiles(BWD_KERNELS, |t| (t.head_dim, t.is_valid(), t.smem_bytes()));
    }

    #[test]
    fn every_decode_tile_is_valid_and_fits() {
        check_tiles(DECODE_KERNELS, |t| {
            (t.head_dim, t.is_valid(), t.smem_bytes())
        });
        // Every forward head dim has a decode kernel (the forward may route to it), except
        // the block-sparse kind's (the forward never routes those to the decode path), and
        // the block-sparse kind's, nor the dropout kernels' (the decode path takes no dropout).
        for k in FWD_KERNELS
            .iter()
            .filter(|k| k.mask != MaskKind::Sparse && !k.dropout)
        {
            assert!(decode_kernel(k.head_dim, k.mask).is_some_and(|d| d.head_dim == k.head_dim));
        }
    }

    #[test]
    fn names_follow_the_convention_and_are_unique() {
        for k in FWD_KERNELS {
            let kind = match k.mask {
                MaskKind::Causal => "",
                MaskKind::Masked => "masked_",
                MaskKind::Sparse => "sparse_",
                MaskKind::Tree => "tree_",
            };
            let kind = if k.dropout {
                format!("{kind}dropout_")
            } else {
                kind.into()
            };
            assert_eq!(
                k.name(KernelDType::F16),
                format!("flash_fwd_{kind}f16_d{}", k.head_dim)
            );
            assert_eq!(
                k.name(KernelDType::Bf16),
                format!("flash_fwd_{kind}bf16_d{}", k.head_dim)
            );
        }
        let mut names: std::vec::Vec<_> = ALL_KERNELS.iter().map(|k| k.name).collect();
        assert!(names.contains(&PAD_KERNEL_NAME));
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ALL_KERNELS.len());
        assert_eq!(
            ALL_KERNELS.len(),
            2 * FWD_KERNELS.len()
                + 2 * FWD_WGMMA_KERNELS.len()
                + 2 * BWD_KERNELS.len()
                + 2 * BWD_WGMMA_KERNELS.len()
                + 4
                + 2 * DECODE_KERNELS.len()
                + 5
                + 1
                + 2
        );
    }

    #[test]
    fn every_forward_kernel_has_its_backward_and_dropout_variants() {
        for k in FWD_KERNELS {
            for dropout in [false, true] {
                let fwd = fwd_kernel(k.head_dim, k.mask, dropout).unwrap();
                let general = k.mask == MaskKind::Causal && dropout;
                let kind = if general { MaskKind::Masked } else { k.mask };
                assert_eq!(fwd.mask, kind);
                assert_eq!((fwd.head_dim, fwd.dropout), (k.head_dim, dropout));
                let bwd = bwd_kernel(k.head_dim, k.mask, dropout).unwrap();
                assert_eq!((bwd.head_dim, bwd.dropout), (k.head_dim, dropout));
                assert_eq!(bwd.mask, k.mask);
            }
        }
    }

    /// Every `wgmma` row: 128-row tiles of two consumer warpgroups (192 rows of three for the
    /// plain kind at d = 64, and for the general kind at d = 64 with dropout) and a producer
    /// one (whose PTX declares its block size for `setmaxnreg`), 128 keys in a 3-stage ring
    /// (64 keys in 2 stages at d = 256, 176 in 2 for the plain kind at d = 128 without
    /// dropout, 64 in 3 for the general kind at d = 128 with dropout and for the d = 64
    /// kernels of three warpgroups with dropout) that fits Hopper's
    /// 227 KiB, named
    /// `flash_fwd_wgmma_{kind}{dtype}_d{d}`, with an `mma.sync` row of the same head dim, mask
    /// and dropout to fall back on; built for sm_90a alone.
    #[test]
    fn every_wgmma_row_fits_hopper_and_has_an_mma_twin() {
        for k in FWD_WGMMA_KERNELS {
            let t = k.tile(Arch::Sm90a);
            let plain = k.mask == MaskKind::Causal && !k.dropout;
            let general = matches!(k.mask, MaskKind::Causal | MaskKind::Masked);
            let three = k.head_dim == 64 && (plain || (general && k.dropout));
            let ring = match k.head_dim {
                256 => (64, 2),
                128 if plain => (176, 2),
                128 if k.mask == MaskKind::Masked && k.dropout => (64, 3),
                64 if three && k.dropout => (64, 3),
                _ => (128, 3),
            };
            let rows = if three { 192 } else { 128 };
            assert_eq!(
                (t.block_m, t.block_n, t.threads(), t.kv_stages),
                (rows, ring.0, 128 + 2 * rows, ring.1)
            );
            assert!(ALL_KERNELS
                .iter()
                .any(|i| i.name == k.name(KernelDType::Bf16) && i.maxntid));
            assert!(t.smem_bytes() <= SMEM_LIMITS[Arch::Sm90a.index()], "{t:?}");
            assert_eq!(k.head_dim % crate::gmma::BLOCK_COLS, 0);
            let twin = fwd_kernel(k.head_dim, k.mask, k.dropout).unwrap();
            assert_eq!(twin.head_dim, k.head_dim);
            assert_eq!(
                fwd_wgmma_kernel(k.head_dim, k.mask, k.dropout)
                    .unwrap()
                    .name(KernelDType::F16),
                k.name(KernelDType::F16)
            );
            for dtype in [KernelDType::F16, KernelDType::Bf16] {
                let name = k.name(dtype);
                assert!(name.starts_with("flash_fwd_wgmma_"), "{name}");
                assert_eq!(name.contains("dropout"), k.dropout, "{name}");
                let info = ALL_KERNELS.iter().find(|i| i.name == name).unwrap();
                assert!(info.built_for(Arch::Sm90a) && !info.built_for(Arch::Sm80));
            }
        }
    }

    #[test]
    fn wgmma_kernels_cover_every_mask_at_64_128_and_256_and_plain_runs_on_general_at_256() {
        let kinds = [
            MaskKind::Causal,
            MaskKind::Masked,
            MaskKind::Sparse,
            MaskKind::Tree,
        ];
        for d in [64, 128, 256] {
            for mask in kinds {
                for dropout in [false, true] {
                    // (The general mask with dropout at d = 128 spilled at 128-key tiles and
                    // runs 64-key ones.)
                    let k = fwd_wgmma_kernel(d, mask, dropout);
                    assert!(k.is_some(), "{d} {mask:?} {dropout}");
                    // Plain calls without dropout have their own kernel at d = 64 (three
                    // consumer warpgroups) and 128 (176-key tiles, which the host takes only
                    // where they pay, else the general kernel), the general one at d = 256;
                    // so do those with dropout at d = 256 (a plain kernel there is not built).
                    let own = d <= 128 && !dropout;
                    let general = mask == MaskKind::Causal && !own && (!dropout || d == 256);
                    let kind = if general { MaskKind::Masked } else { mask };
                    if let Some(k) = k {
                        assert_eq!((k.head_dim, k.mask, k.dropout), (d, kind, dropout));
                    }
                }
            }
        }
        // Head dims between the compiled ones round up: d = 65..=96 to 128 (96 on mma.sync),
        // d = 129..=255 to 256.
        let d = |x| fwd_wgmma_kernel(x, MaskKind::Causal, false).map(|k| k.head_dim);
        assert_eq!((d(80), d(200), d(257)), (Some(128), Some(256), None));
    }

    /// Every `wgmma` backward row: 128 keys in two warpgroups, a 64 × 64 dQ block per
    /// warpgroup (or one in all), a valid tile that fits
    /// Hopper's shared memory in whole 1024-byte swizzle atoms, an `mma.sync` row of the same
    /// head dim, mask and dropout to fall back on; built for sm_90a alone.
    #[test]
    fn every_wgmma_backward_row_fits_hopper_and_has_an_mma_twin() {
        for k in BWD_WGMMA_KERNELS {
            let t = k.tile(Arch::Sm90a);
            assert_eq!((t.block_n, t.threads(), t.d_split), (128, 256, 1));
            assert!(t.is_valid() && t.staged_dq, "{t:?}");
            assert_eq!(t.smem_pitch(), k.head_dim);
            assert!(
                t.block_m * k.head_dim == 64 * 128 || (t.block_m, k.head_dim) == (64, 64),
                "one m64n64 dQ block per warpgroup, or one for warpgroup 0: {t:?}"
            );
            assert!(t.smem_bytes() <= SMEM_LIMITS[Arch::Sm90a.index()], "{t:?}");
            let twin = bwd_kernel(k.head_dim, k.mask, k.dropout).unwrap();
            assert_eq!(twin.head_dim, k.head_dim);
            for dtype in [KernelDType::F16, KernelDType::Bf16] {
                let name = k.name(dtype);
                assert!(name.starts_with("flash_bwd_wgmma_"), "{name}");
                let info = ALL_KERNELS.iter().find(|i| i.name == name).unwrap();
                assert!(info.built_for(Arch::Sm90a) && !info.built_for(Arch::Sm80));
                assert_eq!(info.dyn_smem[Arch::Sm90a.index()], t.smem_bytes());
            }
        }
        let d = |x| bwd_wgmma_kernel(x, MaskKind::Causal, false, false).map(|k| k.head_dim);
        assert_eq!(
            (d(64), d(100), d(128), d(256)),
            (Some(64), Some(128), Some(128), None)
        );
        // With dropout: every kind up to d = 128 but the general mask above 64.
        for mask in [MaskKind::Causal, MaskKind::Sparse, MaskKind::Tree] {
            for d in [32, 64, 128] {
                assert!(
                    bwd_wgmma_kernel(d, mask, true, false).is_some(),
                    "{mask:?} {d}"
                );
            }
        }
        assert!(bwd_wgmma_kernel(64, MaskKind::Masked, true, false).is_some());
        assert!(bwd_wgmma_kernel(128, MaskKind::Masked, true, false).is_none());
    }

    #[test]
    fn head_dims_round_up() {
        let d = |x| fwd_kernel(x, MaskKind::Causal, false).map(|k| k.head_dim);
        assert_eq!(d(0), None);
        assert_eq!(d(1), Some(32));
        assert_eq!(d(64), Some(64));
        assert_eq!(d(65), Some(96));
        assert_eq!(d(200), Some(256));
        assert_eq!(d(257), None);
        assert_eq!(max_fwd_head_dim(), 256);
    }
}
