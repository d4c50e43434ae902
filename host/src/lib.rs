//! FlashAttention for Rust applications.
//!
//! Exact, IO-aware attention whose GPU kernels are written in Rust (crate
//! `flash-attn-kernels`), compiled to PTX by `cargo xtask build-ptx` and embedded here, so an
//! application needs neither the kernel toolchain nor the CUDA toolkit: only the NVIDIA driver
//! at run time. Where no GPU is present, [`cpu`] runs the same algorithm on the CPU.

mod bwd;
mod bwd_order;
pub mod cpu;
mod decode;
pub mod device;
mod driver_lib;
pub mod dtype;
pub mod error;
mod fwd;
pub mod kernels;
mod launch;
mod mask;
pub mod params;
mod pool;
pub mod probe;
mod resident;
mod scratch;
pub mod seqs;
pub mod shape;
pub mod sparse;
pub mod tensor;
pub mod timing;
pub mod tree;

pub use bwd::{
    backward_kernel_name, flash_attn_backward, flash_attn_backward_into,
    flash_attn_varlen_backward, flash_attn_varlen_backward_into, BwdMode,
};
pub use decode::{
    attn_with_kvcache, attn_with_kvcache_into, auto_decode_splits, decode_splits,
    merge_attention_states, DecodeOptions, HostBlockTable, HostCacheMeta, KvCache, NewKv,
};
pub use device::{device_count, BackwardPath, Device, ForwardPath};
pub use dtype::{DType, Element};
pub use error::{FlashError, Result};
pub use fwd::{
    flash_attn, flash_attn_dropout_mask, flash_attn_into, flash_attn_varlen,
    flash_attn_varlen_into, forward_kernel_name,
};
pub use params::{AttnParams, Dropout, DropoutSeed};
pub use seqs::{HostVarlen, Varlen};
pub use sparse::BlockMask;
pub use tensor::DeviceTensor;
pub use tree::{TreeMask, TreeMaskRef};
