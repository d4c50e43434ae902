//! The file handling behind `flash-attn-cli`: bounded readers for `.safetensors` and `.npy`
//! inputs ([`input`]), output paths checked before the forward pass and written through
//! temporary files ([`output`]), and the typed errors of both ([`CliError`]).
//!
//! The `flash-attn` library itself has no file formats; everything about files lives here.

pub mod error;
pub mod input;
pub mod output;
pub mod sample;

pub use error::CliError;
