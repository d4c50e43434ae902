//! The only home of inline PTX. One file per instruction family; each wrapper is an
//! `#[inline(always)] unsafe fn` named after its mnemonic. A tidy test in the host crate fails
//! if `asm!` appears anywhere else.

mod atomic;
mod bulk;
mod cp_async;
mod grid_dep;
mod ldmatrix;
mod math;
#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // sm_90 code
mod mbarrier;
mod mma;
#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // sm_90a code
mod regs;
mod shared;
mod smem;
mod sync;
#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // sm_90 code
mod tma;
#[cfg_attr(not(flash_arch = "sm90a"), allow(dead_code))] // sm_90a code
mod wgmma;

pub use atomic::*;
pub use bulk::*;
pub use cp_async::*;
pub use grid_dep::*;
pub use ldmatrix::*;
pub use math::*;
#[allow(unused_imports)]
pub use mbarrier::*;
pub use mma::*;
#[allow(unused_imports)]
pub use regs::*;
pub use shared::*;
pub use smem::*;
pub use sync::*;
#[allow(unused_imports)]
pub use tma::*;
#[allow(unused_imports)]
pub use wgmma::*;
