//! Shared helpers of the test suites: random inputs, conversions, and the accuracy rule that
//! every backend (CPU now, GPU later) is held to.
//!
//! The accuracy rule ([`check_accuracy`]): against the float64 reference, a backend may err at
//! most twice as much as the naive implementation in the same element type, plus
//! FlashAttention's own absolute term `atol` (twice the error of arithmetic on the reference
//! rounded to the element type, about an ulp of the output) and `1e-5`:
//! `max|ours − ref| ≤ 2·max|naive − ref| + atol + 1e-5`, for O and for LSE separately. NaN always
//! fails, and an infinite LSE (a row that sees no key) must be matched exactly. The backward
//! pass is held to the same rule for dQ, dK and dV ([`check_gradient_accuracy`]).

pub mod cpu;
pub mod gpu;

use flash_attn::shape::AttnShape;
use flash_attn::sparse::BLOCK;
use flash_attn::{AttnParams, BlockMask, DType, Element};
use ndarray::{Array, Array4, ArrayView, ArrayView3, ArrayView4, Dimension};
use proptest::prelude::*;
use proptest::sample::select;
use rand::{Rng, SeedableRng};

/// How large the random queries and keys are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Magnitude {
    /// Standard normal entries.
    Normal,
    /// Entries scaled so that the scores `scale·q·k` have a standard deviation of 50/3: they
    /// spread over about ±50, which stresses the running maximum of the softmax.
    Large,
}

impl Magnitude {
    /// Standard deviation of the Q and K entries for a head dim and a softmax scale.
    pub fn std_dev(self, head_dim: usize, scale: f32) -> f32 {
        match self {
            Magnitude::Normal => 1.0,
            // With a zero scale every score is 0 whatever the inputs: large inputs would only
            // overflow the 16-bit naive yardstick.
            Magnitude::Large if scale == 0.0 => 1.0,
            Magnitude::Large => {
                // std(scale·q·k) = σ²·|scale|·√d for independent N(0, σ²) entries
                let per_unit = scale.abs().max(1e-3) * (head_dim as f32).sqrt();
                (50.0 / 3.0 / per_unit).sqrt()
            }
        }
    }
}

/// A draw from the standard normal distribution (Box–Muller).
pub fn standard_normal(rng: &mut impl Rng) -> f32 {
    let u1 = 1.0 - rng.gen::<f32>(); // (0, 1]: keeps ln finite
    let u2 = rng.gen::<f32>();
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

/// An array of `dims` with independent `N(0, std_dev²)` entries rounded to `T`.
pub fn random_array<T: Element>(rng: &mut impl Rng, dims: [usize; 4], std_dev: f32) -> Array4<T> {
    Array4::from_shape_simple_fn(dims, || T::from_f32(std_dev * standard_normal(rng)))
}

/// Fresh random Q `[B, Nq, Hq, d]`, K and V `[B, Nk, Hkv, d]` for `shape`: Q and K with the
/// standard deviation of `magnitude` (for the softmax `scale` that will be used), V standard
/// normal.
pub fn random_qkv<T: Element>(
    rng: &mut impl Rng,
    shape: &AttnShape,
    magnitude: Magnitude,
    scale: f32,
) -> (Array4<T>, Array4<T>, Array4<T>) {
    let sigma = magnitude.std_dev(shape.head_dim, scale);
    let q = random_array(rng, shape.q_dims(), sigma);
    let k = random_array(rng, shape.kv_dims(), sigma);
    let v = random_array(rng, shape.kv_dims(), 1.0);
    (q, k, v)
}

/// The same values as `a` (`[B, N, H, d]`), stored head-major (`[B, H, N, d]` in memory), so
/// that the view has non-standard strides.
pub fn head_major<T: Clone>(a: ArrayView4<T>) -> Array4<T> {
    let order = [0, 2, 1, 3];
    a.permuted_axes(order)
        .as_standard_layout()
        .into_owned()
        .permuted_axes(order)
}

/// Converts an array of f16, bf16 or f32 to f64 (exactly).
pub fn to_f64<T: Element, D: Dimension>(a: ArrayView<T, D>) -> Array<f64, D> {
    a.mapv(|x| f64::from(x.to_f32()))
}

/// The largest elementwise `|a − b|`: equal values (including equal infinities) differ by 0,
/// and any NaN makes the result NaN.
pub fn max_abs_diff<D: Dimension>(a: ArrayView<f64, D>, b: ArrayView<f64, D>) -> f64 {
    worst_diff(a, b).map_or(0.0, |w| w.diff)
}

/// The element where two arrays differ most.
struct Worst<P> {
    /// `|a − b|`, 0 for equal values, NaN if either is NaN.
    diff: f64,
    /// Its index.
    at: P,
    /// The value in `a`.
    a: f64,
    /// The value in `b`.
    b: f64,
}

/// The element where `a` and `b` differ most (a NaN difference counts as largest); `None` for
/// empty arrays.
fn worst_diff<D: Dimension>(
    a: ArrayView<f64, D>,
    b: ArrayView<f64, D>,
) -> Option<Worst<D::Pattern>> {
    let mut worst: Option<Worst<D::Pattern>> = None;
    for ((at, &a), &b) in a.indexed_iter().zip(b.iter()) {
        let diff = if a == b { 0.0 } else { (a - b).abs() };
        let larger = worst
            .as_ref()
            .is_none_or(|w| !w.diff.is_nan() && (diff.is_nan() || diff > w.diff));
        if larger {
            worst = Some(Worst { diff, at, a, b });
        }
    }
    worst
}

/// The accuracy rule, for one call's outputs `(O, LSE)`: ours and the naive implementation in
/// the same element type, each measured against the float64 reference. O and LSE are checked
/// separately; the error message names the tensor, the worst element and both errors.
pub fn check_accuracy<T: Element, U: Element>(
    ours: (ArrayView4<T>, ArrayView3<f32>),
    naive: (ArrayView4<U>, ArrayView3<f32>),
    reference: (ArrayView4<f64>, ArrayView3<f64>),
) -> Result<(), String> {
    check_tensor("O", ours.0, naive.0, reference.0)?;
    check_tensor("LSE", ours.1, naive.1, reference.1)
}

/// The accuracy rule for one backward call's gradients `(dQ, dK, dV)`, each separately:
/// `max|ours − ref| ≤ 2·max|naive − ref| + max|given − ref| + atol + 1e-5` (`atol` as in the
/// forward's rule), where `naive` is the
/// naive backward in the same element type and `given` the float64 backward computed from the
/// forward outputs (O in the element type, LSE in f32) that ours consumed
/// (`flash_attn::cpu::attention_backward_reference_given`). The middle term is the error that
/// rounding O and LSE alone costs an exact backward: FlashAttention's backward reads O (for
/// `D = rowsum(dO ∘ O)`) and LSE (for P) as the forward stored them, which the naive backward,
/// recomputing its own, does not; with few rows and a small head dim, one rounding of O can
/// exceed twice the naive error.
///
/// `factor` is the multiple of the naive error allowed (2 on the CPU; FlashAttention's own
/// tests allow 2–3 for gradients, see [`GPU_GRADIENT_FACTOR`]).
pub fn check_gradient_accuracy<T: Element, U: Element>(
    factor: f64,
    ours: [ArrayView4<T>; 3],
    naive: [ArrayView4<U>; 3],
    given: [ArrayView4<f64>; 3],
    reference: [ArrayView4<f64>; 3],
) -> Result<(), String> {
    let names = ["dQ", "dK", "dV"];
    for (i, what) in names.into_iter().enumerate() {
        let given_err = max_abs_diff(given[i].view(), reference[i].view());
        if !given_err.is_finite() {
            return Err(format!(
                "{what}: the backward from the rounded forward outputs is off by {given_err}"
            ));
        }
        check_tensor_within(
            what,
            ours[i].view(),
            naive[i].view(),
            reference[i].view(),
            factor,
            given_err,
        )?;
    }
    Ok(())
}

/// [`check_accuracy`] for one tensor.
fn check_tensor<T: Element, U: Element, D: Dimension>(
    what: &str,
    ours: ArrayView<T, D>,
    naive: ArrayView<U, D>,
    reference: ArrayView<f64, D>,
) -> Result<(), String> {
    check_tensor_within(what, ours, naive, reference, 2.0, 0.0)
}

/// FlashAttention's own tests' absolute term (`fwd_atol`, and the same for each gradient):
/// twice the largest error that any arithmetic on the reference rounded to the element type
/// makes, measured as `|((r + 0.3) − 0.3) − r|` with `r` and each result rounded to `T`.
/// It is about an ulp of the output's magnitude: without it an output above 1 whose exact
/// value lies near the midpoint of two f16 or bf16 values fails when ours rounds one way and
/// the naive implementation the other, however small the difference before rounding.
fn arithmetic_error<T: Element, D: Dimension>(reference: ArrayView<f64, D>) -> f64 {
    let round = |x: f32| T::from_f32(x).to_f32();
    let err = reference.iter().fold(0f32, |worst, &x| {
        let r = round(x as f32);
        let err = (round(round(r + 0.3) - 0.3) - r).abs();
        if err.is_finite() {
            worst.max(err)
        } else {
            worst
        }
    });
    2.0 * f64::from(err)
}

/// The factor of the naive error the GPU backward's gradients are allowed: 3, the upper end
/// of FlashAttention's own tests. The tensor-core backward rounds P and dS to the element
/// type before its matrix products, as the naive backward does, so its errors are of the
/// naive's size; measured on the H100 (2026-11-22), f16 dV reached 2.4× the naive error in a
/// 128 × 65 causal case while its error stayed within one f16 ulp of the reference.
pub const GPU_GRADIENT_FACTOR: f64 = 3.0;

/// [`check_tensor`] with `factor` times the naive error plus `extra` as the tolerance.
fn check_tensor_within<T: Element, U: Element, D: Dimension>(
    what: &str,
    ours: ArrayView<T, D>,
    naive: ArrayView<U, D>,
    reference: ArrayView<f64, D>,
    factor: f64,
    extra: f64,
) -> Result<(), String> {
    if ours.shape() != reference.shape() || naive.shape() != reference.shape() {
        return Err(format!(
            "{what}: shapes differ: ours {:?}, naive {:?}, reference {:?}",
            ours.shape(),
            naive.shape(),
            reference.shape()
        ));
    }
    let naive_err = max_abs_diff(to_f64(naive).view(), reference.view());
    if !naive_err.is_finite() {
        return Err(format!(
            "{what}: the naive yardstick itself is off by {naive_err}"
        ));
    }
    let atol = arithmetic_error::<T, D>(reference.view());
    let tolerance = factor * naive_err + extra + atol + 1e-5;
    match worst_diff(to_f64(ours).view(), reference.view()) {
        Some(w) if w.diff.is_nan() || w.diff > tolerance => Err(format!(
            "{what}: error {:e} at {:?} (ours {}, reference {}) exceeds {factor}·{naive_err:e} + \
             {extra:e} + {atol:e} + 1e-5 ({factor} times the naive implementation's error, plus \
             that of the rounded forward outputs, plus twice that of arithmetic on the rounded \
             reference)",
            w.diff, w.at, w.a, w.b
        )),
        _ => Ok(()),
    }
}

/// The masks of a random case beyond causal: a sliding window, a softcap and ALiBi slopes,
/// each present in about a third of the cases (see [`mask_recipes`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaskRecipe {
    /// `(left, right)`; `usize::MAX` is unbounded.
    pub window: Option<(usize, usize)>,
    /// Logit softcap.
    pub softcap: Option<f32>,
    /// ALiBi slopes: none, one per head, or one per (batch entry, head).
    pub alibi: Alibi,
    /// Seed of the slopes and of the block mask.
    pub seed: u64,
    /// A block-sparse mask of about this many sixteenths of visible blocks (alone: not with
    /// a window, softcap or ALiBi; see [`attention_mask_recipes`]).
    pub sparse: Option<u8>,
}

/// Which ALiBi slopes a [`MaskRecipe`] draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alibi {
    /// No ALiBi.
    None,
    /// `[Hq]`.
    PerHead,
    /// `[B, Hq]`.
    PerBatchHead,
}

impl MaskRecipe {
    /// No mask beyond causal.
    pub const NONE: MaskRecipe = MaskRecipe {
        window: None,
        softcap: None,
        alibi: Alibi::None,
        seed: 0,
        sparse: None,
    };

    /// Params with `causal`, `softmax_scale` and this recipe's masks, for a call of `batch`
    /// entries and `heads_q` query heads (see [`MaskRecipe::apply`]); for recipes without a
    /// block mask (whose bits depend on the lengths: [`MaskRecipe::params_for`]).
    pub fn params(
        &self,
        causal: bool,
        softmax_scale: Option<f32>,
        batch: usize,
        heads_q: usize,
    ) -> AttnParams<'static> {
        assert!(
            self.sparse.is_none(),
            "a block mask needs the lengths: params_for"
        );
        let base = AttnParams {
            causal,
            softmax_scale,
            ..AttnParams::default()
        };
        self.apply(base, batch, heads_q)
    }

    /// Params with `causal`, `softmax_scale` and this recipe's masks, for a call of `shape`
    /// (see [`MaskRecipe::apply`]; the block mask, when the recipe has one, is drawn for the
    /// shape's lengths and leaked like the slopes).
    pub fn params_for(
        &self,
        causal: bool,
        softmax_scale: Option<f32>,
        shape: &AttnShape,
    ) -> AttnParams<'static> {
        let base = AttnParams {
            causal,
            softmax_scale,
            ..AttnParams::default()
        };
        let params = self.apply(base, shape.batch, shape.heads_q);
        AttnParams {
            block_mask: self.sparse.map(|sixteenths| {
                let mask: &'static BlockMask =
                    Box::leak(Box::new(self.block_mask(shape, sixteenths)));
                mask
            }),
            ..params
        }
    }

    /// A random block mask for `shape`: per (batch, head), per batch, per head or shared
    /// (from the seed), each block visible with probability `sixteenths / 16`.
    fn block_mask(&self, shape: &AttnShape, sixteenths: u8) -> BlockMask {
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed ^ 0x5eed);
        let b = if rng.gen::<bool>() { shape.batch } else { 1 };
        let h = if rng.gen::<bool>() { shape.heads_q } else { 1 };
        let dims = [
            b,
            h,
            shape.seqlen_q.div_ceil(BLOCK),
            shape.seqlen_k.div_ceil(BLOCK),
        ];
        BlockMask::from_fn(dims, |_, _, _, _| rng.gen_range(0..16) < sixteenths)
            .expect("valid block mask dims")
    }

    /// `params` with this recipe's masks for a call of `batch` entries and `heads_q` query
    /// heads; the slopes (uniform in `[0, 0.5)`, random signs in a tenth) are leaked, a few
    /// bytes per test case.
    pub fn apply<'a>(
        &self,
        params: AttnParams<'a>,
        batch: usize,
        heads_q: usize,
    ) -> AttnParams<'a> {
        let slopes: Option<&'static [f32]> = match self.alibi {
            Alibi::None => None,
            alibi => {
                let n = if alibi == Alibi::PerHead {
                    heads_q
                } else {
                    batch * heads_q
                };
                let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed);
                let v: Vec<f32> = (0..n)
                    .map(|_| {
                        let x = rng.gen::<f32>() * 0.5;
                        if rng.gen::<f32>() < 0.1 {
                            -x
                        } else {
                            x
                        }
                    })
                    .collect();
                Some(Box::leak(v.into_boxed_slice()))
            }
        };
        AttnParams {
            causal: params.causal,
            softmax_scale: params.softmax_scale,
            window: self.window,
            softcap: self.softcap,
            alibi_slopes: slopes,
            seqlens_k: params.seqlens_k,
            block_mask: params.block_mask,
            tree_mask: params.tree_mask,
            dropout: params.dropout,
        }
    }
}

/// [`mask_recipes`], or (a quarter of the cases) a block-sparse mask alone, at densities from
/// none to all blocks: the recipes of the forward and backward tests (the decode path takes no
/// block mask).
pub fn attention_mask_recipes() -> impl Strategy<Value = MaskRecipe> {
    let sparse =
        (select(&[0u8, 4, 8, 12, 16][..]), any::<u64>()).prop_map(|(s, seed)| MaskRecipe {
            seed,
            sparse: Some(s),
            ..MaskRecipe::NONE
        });
    prop_oneof![3 => mask_recipes(), 1 => sparse]
}

/// Random [`MaskRecipe`]s: windows with bounded and unbounded sides (small enough that tiles
/// are skipped at the tests' lengths), caps from 2 to 50, per-head and per-(batch, head)
/// slopes; each feature absent in about two thirds of the cases.
pub fn mask_recipes() -> impl Strategy<Value = MaskRecipe> {
    let side = prop_oneof![4 => 0..80usize, 1 => Just(usize::MAX)];
    let window = prop_oneof![2 => Just(None), 1 => (side.clone(), side).prop_map(Some)];
    let softcap =
        prop_oneof![2 => Just(None), 1 => select(&[2.0f32, 8.0, 30.0, 50.0][..]).prop_map(Some)];
    let alibi = prop_oneof![
        4 => Just(Alibi::None),
        1 => Just(Alibi::PerHead),
        1 => Just(Alibi::PerBatchHead)
    ];
    (window, softcap, alibi, any::<u64>()).prop_map(|(window, softcap, alibi, seed)| MaskRecipe {
        window,
        softcap,
        alibi,
        seed,
        sparse: None,
    })
}

/// One random problem of the CPU property tests.
#[derive(Clone, Debug)]
pub struct Case {
    /// Sizes.
    pub shape: AttnShape,
    /// Element type.
    pub dtype: DType,
    /// Causal masking and scale.
    pub params: AttnParams<'static>,
    /// Size of Q and K.
    pub magnitude: Magnitude,
    /// Inputs stored head-major (non-standard strides).
    pub head_major: bool,
    /// Seed of the input values.
    pub seed: u64,
}

/// Random problems: batch 1 or 2, lengths from `seq_lens`, `(Hq, Hkv)` from `heads`, head dims
/// from `head_dims`, scales from `scales`; every element type, causal or not, both magnitudes,
/// both layouts.
pub fn cases(
    seq_lens: &'static [usize],
    heads: &'static [(usize, usize)],
    head_dims: &'static [usize],
    scales: &'static [Option<f32>],
) -> impl Strategy<Value = Case> {
    let dtypes = select(&[DType::F16, DType::BF16, DType::F32][..]);
    let magnitudes = select(&[Magnitude::Normal, Magnitude::Large][..]);
    let sizes = (
        1..3usize,
        select(seq_lens),
        select(seq_lens),
        select(heads),
        select(head_dims),
    );
    let options = (
        dtypes,
        any::<bool>(),
        select(scales),
        magnitudes,
        any::<bool>(),
        any::<u64>(),
        attention_mask_recipes(),
    );
    (sizes, options).prop_map(
        |((batch, seqlen_q, seqlen_k, (heads_q, heads_kv), head_dim), o)| {
            let (dtype, causal, softmax_scale, magnitude, head_major, seed, masks) = o;
            let shape = AttnShape {
                batch,
                seqlen_q,
                seqlen_k,
                heads_q,
                heads_kv,
                head_dim,
            };
            Case {
                shape,
                dtype,
                params: masks.params_for(causal, softmax_scale, &shape),
                magnitude,
                head_major,
                seed,
            }
        },
    )
}

/// A random tree of `drafts` draft tokens per entry (`batch` entries, or one shared tree when
/// `batch` is 1): each draft continues an earlier draft or (about a fifth of them) the prefix.
pub fn random_tree(rng: &mut impl Rng, batch: usize, drafts: usize) -> flash_attn::TreeMask {
    let parents: Vec<i32> = (0..batch * drafts)
        .map(|at| {
            let i = at % drafts;
            if i == 0 || rng.gen_range(0..5) == 0 {
                -1
            } else {
                rng.gen_range(0..i as i32)
            }
        })
        .collect();
    flash_attn::TreeMask::from_parents(batch, drafts, &parents).expect("valid parents")
}

/// The prefix sums `(cu_seqlens_q, cu_seqlens_k)` of `(queries, keys)` per sequence, from 0.
pub fn prefix_sums(lens: &[(usize, usize)]) -> (Vec<i32>, Vec<i32>) {
    let (mut cu_q, mut cu_k) = (vec![0i32], vec![0i32]);
    for &(a, b) in lens {
        cu_q.push(cu_q.last().unwrap() + a as i32);
        cu_k.push(cu_k.last().unwrap() + b as i32);
    }
    (cu_q, cu_k)
}
