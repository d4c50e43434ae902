//! The PTX built by `cargo xtask build-ptx` from the `flash-attn-kernels` crate, embedded so
//! that applications need no kernel toolchain. `cargo xtask build-ptx --check` (run by CI)
//! proves these files are what the committed kernel sources build to.

use flash_attn_kernels::config::Arch;

/// PTX for sm_80 and newer (Ampere, Ada; Hopper through the driver's JIT).
pub const SM80: &str = include_str!("../ptx/flash_attn_sm80.ptx");
/// PTX for sm_90a (Hopper only; may use wgmma/TMA).
pub const SM90A: &str = include_str!("../ptx/flash_attn_sm90a.ptx");

/// The PTX target to load on a device of compute capability `major.minor`, and its text;
/// `None` below 8.0. sm_90a code runs only on exactly 9.0.
pub fn for_compute_capability(major: i32, minor: i32) -> Option<(Arch, &'static str)> {
    match (major, minor) {
        (9, 0) => Some((Arch::Sm90a, SM90A)),
        (m, _) if m >= 8 => Some((Arch::Sm80, SM80)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flash_attn_kernels::config::{fwd_kernel_name, COMPILED_HEAD_DIMS, PAD_KERNEL_NAME};

    /// Every kernel the host launches is an entry point of both embedded PTX files.
    #[test]
    fn every_kernel_name_is_in_the_ptx() {
        for ptx in [SM80, SM90A] {
            let mut names = vec![PAD_KERNEL_NAME];
            for d in COMPILED_HEAD_DIMS {
                names.push(fwd_kernel_name(false, d).unwrap());
                names.push(fwd_kernel_name(true, d).unwrap());
            }
            for n in names {
                assert!(
                    ptx.contains(&format!(".entry {n}(")),
                    "{n} missing: run `cargo xtask build-ptx`"
                );
            }
        }
    }

    #[test]
    fn arch_selection() {
        assert_eq!(for_compute_capability(7, 5), None);
        assert_eq!(for_compute_capability(8, 0).unwrap().0, Arch::Sm80);
        assert_eq!(for_compute_capability(8, 9).unwrap().0, Arch::Sm80);
        assert_eq!(for_compute_capability(9, 0).unwrap().0, Arch::Sm90a);
        assert_eq!(for_compute_capability(10, 0).unwrap().0, Arch::Sm80);
    }
}
