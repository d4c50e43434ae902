//! Device-only code: compiled for `nvptx64-nvidia-cuda` alone.

mod elem;
mod entry;
mod fwd;
mod pad;
mod ptx;
mod tile;
