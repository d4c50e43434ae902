//! The CPU backend and the reference implementations the tests measure it against.
//!
//! - [`attention_cpu`] / [`attention_cpu_into`]: FlashAttention-2's tiled forward pass (query
//!   tiles outside, key tiles inside, online softmax in the base-2 domain, f32 accumulation).
//!   It asks [`flash_attn_kernels::mask::CausalMask`] which key tiles to visit and which
//!   elements to mask, exactly like the GPU kernels, so both backends agree on every edge.
//! - [`attention_reference`]: naive float64 attention with materialised scores; the test oracle.
//! - [`attention_naive`]: the same naive algorithm in an element type `T` (scores and
//!   probabilities rounded to `T`), the yardstick of the accuracy rule.
//! - [`attention_backward_cpu`] / [`attention_backward_cpu_into`]: FlashAttention-2's tiled
//!   backward pass (key tiles outside, query tiles inside, P recomputed from the forward's LSE,
//!   f32 accumulation, one deterministic job per (batch, key/value head)), visiting and masking
//!   the same tiles as the forward pass.
//! - [`attention_backward_reference`] and [`attention_backward_naive`]: the naive backward in
//!   float64 (the oracle of the gradient tests) and in `T` (the yardstick);
//!   [`attention_backward_reference_given`]: the float64 backward from given (rounded) forward
//!   outputs, which measures what their rounding costs.
//! - [`attn_with_kvcache_cpu`] and [`merge_attention_states_cpu`]: the decode path of
//!   [`crate::attn_with_kvcache`] and [`crate::merge_attention_states`] on the CPU (new keys
//!   appended to a contiguous or paged [`CpuKvCache`], then [`attention_cpu`] per sequence), and
//!   [`gather_sequence`], the keys and values one sequence of such a cache attends to.
//!
//! - [`attention_varlen_cpu`] / [`attention_varlen_backward_cpu`]: packed variable-length
//!   batches (FlashAttention's varlen layout), and [`sequences`], which runs any of the
//!   padded-batch routines above once per sequence (varlen, and key padding with
//!   [`crate::AttnParams::seqlens_k`], which every routine here honours).
//! - [`dropout_mask`]: attention dropout's mask `Z` of a call (for tests at small sizes),
//!   drawn from the GPU kernels' own generator, as every routine here that takes dropout
//!   draws it.
//!
//! All of them (the decode path's cache aside) take Q `[B, Nq, Hq, d]`, K and V
//! `[B, Nk, Hkv, d]` with any strides, and return O `[B, Nq, Hq, d]` and the natural-log LSE
//! `[B, Hq, Nq]`. A query row that sees no key gets O = 0 and LSE = −∞; NaN or ±∞ in the
//! inputs give NaN, never a row that looks masked (the rule is on [`crate::AttnParams`]).
//! Every routine but the decode path honours attention dropout
//! ([`crate::AttnParams::dropout`]: `O = (P ∘ Z)·V/(1 − p)`, the LSE that of `P`, and the
//! matching gradients), with the mask of [`dropout_mask`]; the decode path rejects it.
//! Outputs and temporaries are allocated fallibly: a shape whose buffers cannot exist is a
//! [`crate::FlashError`], not a panic or an abort.

mod alloc;
mod backward_reference;
mod backward_tiled;
mod decode;
mod dropout;
mod online_softmax;
mod reference;
pub mod sequences;
mod tiled;
mod validate;

pub use backward_reference::{
    attention_backward_naive, attention_backward_reference, attention_backward_reference_given,
    Gradients,
};
pub use backward_tiled::{attention_backward_cpu, attention_backward_cpu_into};
pub use decode::{attn_with_kvcache_cpu, gather_sequence, merge_attention_states_cpu, CpuKvCache};
pub use dropout::dropout_mask;
pub use reference::{attention_naive, attention_reference};
pub use sequences::{attention_varlen_backward_cpu, attention_varlen_cpu};
pub use tiled::{attention_cpu, attention_cpu_into, BLOCK_M, BLOCK_N};

#[cfg(test)]
mod backward_tests;
#[cfg(test)]
mod tests;
