//! The kernels built by `cargo xtask build-ptx` from the `flash-attn-kernels` crate, embedded so
//! that applications need no kernel toolchain: for every (target, kernel) of the registry, its
//! PTX and its SASS (compiled offline by the pinned `ptxas`), each as a zlib stream inflated
//! when the kernel is first loaded. `cargo xtask build-ptx --check` (run by CI) proves these
//! files are what the committed kernel sources build to.

use flash_attn_kernels::arch::Arch;

use crate::error::{FlashError, Result};

include!("../kernels/index.rs");

/// The embedded code of one kernel for one target, as zlib streams (see [`KernelCode::ptx`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct KernelCode {
    ptx: &'static [u8],
    sass: &'static [u8],
}

impl KernelCode {
    /// PTX text (the driver JIT-compiles it where the SASS does not run).
    pub(crate) fn ptx(&self) -> Result<String> {
        String::from_utf8(inflate(self.ptx)?)
            .map_err(|_| FlashError::Internal("an embedded PTX is not UTF-8".into()))
    }

    /// SASS cubin for the target's architecture.
    pub(crate) fn sass(&self) -> Result<Vec<u8>> {
        inflate(self.sass)
    }
}

/// The bytes of an embedded zlib stream; a broken one is a build problem.
fn inflate(stream: &[u8]) -> Result<Vec<u8>> {
    miniz_oxide::inflate::decompress_to_vec_zlib(stream)
        .map_err(|e| FlashError::Internal(format!("an embedded kernel does not inflate ({e:?})")))
}

/// The code of `kernel` for `arch`, or `None` if the registry has no such kernel.
pub(crate) fn code(arch: Arch, kernel: &str) -> Option<KernelCode> {
    let target = arch.info().name;
    EMBEDDED
        .iter()
        .find(|(a, k, _, _)| *a == target && *k == kernel)
        .map(|&(_, _, ptx, sass)| KernelCode { ptx, sass })
}

/// Bytes embedded, compressed: (PTX, SASS).
pub fn embedded_bytes() -> (usize, usize) {
    EMBEDDED.iter().fold((0, 0), |(p, s), (_, _, ptx, sass)| {
        (p + ptx.len(), s + sass.len())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flash_attn_kernels::arch::ARCHS;
    use flash_attn_kernels::registry::ALL_KERNELS;

    /// Every kernel of the registry is embedded for every target it is built for (and for no
    /// other), its PTX holds exactly that entry point, and its SASS is an ELF image.
    #[test]
    fn every_registered_kernel_is_embedded() {
        let pairs = ARCHS
            .iter()
            .map(|a| ALL_KERNELS.iter().filter(|k| k.built_for(a.arch)).count())
            .sum::<usize>();
        assert_eq!(EMBEDDED.len(), pairs);
        for arch in &ARCHS {
            for k in ALL_KERNELS {
                if !k.built_for(arch.arch) {
                    assert!(code(arch.arch, k.name).is_none(), "{}", k.name);
                    continue;
                }
                let code = code(arch.arch, k.name)
                    .unwrap_or_else(|| panic!("{} missing: run `cargo xtask build-ptx`", k.name));
                let ptx = code.ptx().unwrap();
                assert!(ptx.contains(&format!(".entry {}(", k.name)));
                assert_eq!(ptx.matches(".entry ").count(), 1);
                assert!(ptx.contains(&format!(".target {}", arch.cpu)));
                assert_eq!(&code.sass().unwrap()[..4], b"\x7fELF", "{}", k.name);
            }
        }
    }

    /// The instruction of a PTX statement line that reads or writes memory other than the
    /// kernel's parameters, shared or local memory, or that leaves the straight-line start of
    /// the kernel (a branch, call or return); `None` for other lines.
    fn touches_memory_or_branches(line: &str) -> Option<&str> {
        let stmt = line.trim();
        // A guarded statement (`@%p1 bra …`): the instruction follows the guard.
        let stmt = match stmt.strip_prefix('@') {
            Some(guarded) => guarded.split_once(char::is_whitespace)?.1.trim_start(),
            None => stmt,
        };
        let op = stmt.split(|c: char| c.is_whitespace() || c == ';').next()?;
        let branches = ["bra", "call", "ret", "exit", "brx"]
            .iter()
            .any(|b| op == *b || op.starts_with(&format!("{b}.")));
        let memory = [
            "ld.",
            "st.",
            "cp.",
            "red.",
            "atom.",
            "prefetch",
            "multimem.",
            "wgmma.",
        ]
        .iter()
        .any(|m| op.starts_with(m))
            && (op.contains(".global")
                || ![".param", ".shared", ".local", ".const"]
                    .iter()
                    .any(|space| op.contains(space)));
        (branches || memory).then_some(op)
    }

    /// On targets whose kernels the host launches overlapped
    /// ([`Arch::waits_for_previous_grids`]), every kernel's `griddepcontrol.wait` comes before
    /// its first access to global (or generic) memory and its first branch, so no block
    /// touches memory before the grid before it has finished; other targets have none.
    #[test]
    fn kernels_wait_for_the_previous_grid_before_touching_memory() {
        for arch in &ARCHS {
            for k in ALL_KERNELS.iter().filter(|k| k.built_for(arch.arch)) {
                let ptx = code(arch.arch, k.name).unwrap().ptx().unwrap();
                if !arch.arch.waits_for_previous_grids() {
                    assert!(!ptx.contains("griddepcontrol"), "{}", k.name);
                    continue;
                }
                let body = &ptx[ptx.find(".entry ").unwrap()..];
                let mut waited = false;
                for line in body.lines() {
                    if line.contains("griddepcontrol.wait") {
                        waited = true;
                        break;
                    }
                    if let Some(op) = touches_memory_or_branches(line) {
                        panic!("{}: `{op}` before griddepcontrol.wait", k.name);
                    }
                }
                assert!(waited, "{}: no griddepcontrol.wait", k.name);
            }
        }
    }

    #[test]
    fn the_memory_and_branch_classifier_reads_ptx_lines() {
        assert_eq!(
            touches_memory_or_branches("\tld.param.u64 %rd1, [p];"),
            None
        );
        assert_eq!(
            touches_memory_or_branches("\tld.shared.u32 %r1, [%r2];"),
            None
        );
        assert_eq!(
            touches_memory_or_branches("\tld.global.nc.u32 %r1, [%rd2];"),
            Some("ld.global.nc.u32")
        );
        assert_eq!(
            touches_memory_or_branches("\tld.u32 %r1, [%rd2];"),
            Some("ld.u32")
        );
        assert_eq!(
            touches_memory_or_branches("\t@%p1 bra $L__BB0_2;"),
            Some("bra")
        );
        assert_eq!(
            touches_memory_or_branches("\tcp.async.cg.shared.global [%r1], [%rd1], 16;"),
            Some("cp.async.cg.shared.global")
        );
        assert_eq!(touches_memory_or_branches("\tmov.u32 %r1, %tid.x;"), None);
        assert_eq!(touches_memory_or_branches("$L__BB0_1:"), None);
    }
}
