//! The GPU targets the kernels are compiled for: declared once here and read by the kernel
//! build (`cargo xtask build-ptx`), the ptxas report, the host's loader and the tests.

/// A compilation target of the kernel crate. Each has its own tile table (see
/// [`crate::registry`]) and its own embedded PTX and SASS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// `sm_80` PTX: Ampere and Ada (and anything newer than Hopper, through the driver JIT).
    Sm80,
    /// `sm_90a` PTX: Hopper (compute capability 9.0 exactly).
    Sm90a,
}

/// Everything the build and the loader need to know about one [`Arch`].
#[derive(Clone, Copy, Debug)]
pub struct ArchInfo {
    /// The target.
    pub arch: Arch,
    /// Short name: the `--cfg flash_arch` value and the folder of its generated files.
    pub name: &'static str,
    /// `-C target-cpu` of the kernel build (the PTX `.target`).
    pub cpu: &'static str,
    /// `-C target-feature` of the kernel build (empty for none).
    pub features: &'static str,
    /// The SASS architecture compiled offline and embedded next to the PTX.
    pub sass: &'static str,
    /// Further architectures the ptxas resource check compiles this PTX for (never embedded).
    pub ptxas_check: &'static [&'static str],
}

/// Every target, in [`Arch`] order (index with [`Arch::index`]).
pub const ARCHS: [ArchInfo; ARCH_COUNT] = [
    ArchInfo {
        arch: Arch::Sm80,
        name: "sm80",
        cpu: "sm_80",
        features: "",
        sass: "sm_80",
        ptxas_check: &["sm_86", "sm_89", "sm_90"],
    },
    ArchInfo {
        arch: Arch::Sm90a,
        name: "sm90a",
        cpu: "sm_90a",
        features: "+ptx81",
        sass: "sm_90a",
        ptxas_check: &[],
    },
];

/// Number of targets.
pub const ARCH_COUNT: usize = 2;

impl Arch {
    /// Position in [`ARCHS`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The description of this target.
    pub const fn info(self) -> &'static ArchInfo {
        &ARCHS[self.index()]
    }

    /// The arch this crate is being compiled for: set by `cargo xtask build-ptx` through
    /// `--cfg flash_arch="…"`; `Sm80` elsewhere.
    pub const fn current() -> Arch {
        if cfg!(flash_arch = "sm90a") {
            Arch::Sm90a
        } else {
            Arch::Sm80
        }
    }

    /// Opt-in dynamic shared memory per block on every device this target's kernels run on:
    /// 99 KiB for sm_80 code (sm_86 and sm_89 have no more), 227 KiB on Hopper.
    pub const fn max_dyn_smem(self) -> usize {
        match self {
            Arch::Sm80 => 99 * 1024,
            Arch::Sm90a => 227 * 1024,
        }
    }

    /// Whether every kernel of this target starts by waiting for the grids before it on the
    /// stream (`griddepcontrol.wait` in the kernels' `device::await_previous_grids`, sm_90): the
    /// host may then launch them with programmatic stream serialization, so that a kernel's
    /// launch and its blocks' start overlap the previous kernel's last blocks.
    pub const fn waits_for_previous_grids(self) -> bool {
        matches!(self, Arch::Sm90a)
    }

    /// Whether the target has vector f32 reductions (`red.global.add.v2.f32`: sm_90, PTX 8.1).
    pub const fn has_vector_red(self) -> bool {
        matches!(self, Arch::Sm90a)
    }

    /// The target whose kernels run on a device of compute capability `major.minor`; `None`
    /// below 8.0. `sm_90a` code runs only on exactly 9.0.
    pub const fn for_compute_capability(major: i32, minor: i32) -> Option<Arch> {
        match (major, minor) {
            (9, 0) => Some(Arch::Sm90a),
            (m, _) if m >= 8 => Some(Arch::Sm80),
            _ => None,
        }
    }

    /// Whether this target's embedded SASS loads on compute capability `major.minor` as it is
    /// (same major version, minor at least the SASS's); elsewhere the driver JIT-compiles the
    /// PTX.
    pub const fn sass_runs_on(self, major: i32, minor: i32) -> bool {
        match self {
            Arch::Sm80 => major == 8,
            Arch::Sm90a => major == 9 && minor == 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_in_arch_order() {
        for (i, a) in ARCHS.iter().enumerate() {
            assert_eq!(a.arch.index(), i);
            assert_eq!(a.cpu.replace('_', ""), a.name);
            assert!(a.sass_runs_on_own_target());
        }
    }

    impl ArchInfo {
        fn sass_runs_on_own_target(&self) -> bool {
            let digits = &self.sass[3..5];
            let (major, minor) = (digits[..1].parse().unwrap(), digits[1..].parse().unwrap());
            self.arch.sass_runs_on(major, minor)
                && Arch::for_compute_capability(major, minor).is_some()
        }
    }

    #[test]
    fn selection() {
        assert_eq!(Arch::for_compute_capability(7, 5), None);
        assert_eq!(Arch::for_compute_capability(8, 0), Some(Arch::Sm80));
        assert_eq!(Arch::for_compute_capability(8, 9), Some(Arch::Sm80));
        assert_eq!(Arch::for_compute_capability(9, 0), Some(Arch::Sm90a));
        assert_eq!(Arch::for_compute_capability(10, 0), Some(Arch::Sm80));
        assert!(!Arch::Sm80.sass_runs_on(10, 0));
        assert!(!Arch::Sm80.sass_runs_on(9, 0));
    }
}
