//! The offline SASS compile and resource check: `ptxas -v` on each kernel's PTX for each
//! architecture, the report of registers / shared memory / stack / spills per kernel, and a
//! failure on any spill or stack use (local memory) in the embedded SASS (unless the kernel
//! is allowed below). The further architectures of `ArchInfo::ptxas_check` (sm_86, sm_89,
//! sm_90 for the sm_80 PTX) run the embedded sm_80 SASS; their PTX JIT is only a fallback
//! (a driver that refuses the cubin), so local memory there is reported as a warning.

use crate::build_ptx::{inflate, ptx_path};
use crate::toolchain;
use flash_attn_kernels::arch::ARCHS;
use flash_attn_kernels::registry::{KernelInfo, ALL_KERNELS};
use std::path::Path;
use std::process::Command;

/// Kernels allowed to use local memory, each with its bound in bytes (stack frame + spill
/// stores + spill loads; more fails the check), each a measured trade-off: the block-sparse
/// backward with dropout at d = 128 on `wgmma` (8 B frame, 16 B of spills at 255 registers)
/// since the shared dK/dV epilogue stores by quads beside the last dQ add, which every other
/// backward kernel gains from: the spill costs this kernel 1.4–1.7 % of its cycles at
/// densities ≥ 1/2, and it still takes 1.7 % fewer at 1/16; it was kept rather than given an
/// epilogue of its own (docs/perf-notes.md, 2026-11-30; earlier allowances:
/// docs/toolchain.md).
const LOCAL_MEMORY_ALLOWED: &[(&str, u32)] = &[
    ("flash_bwd_wgmma_sparse_dropout_f16_d128", 24),
    ("flash_bwd_wgmma_sparse_dropout_bf16_d128", 24),
];

/// Whether `u`'s local memory is within its kernel's allowance.
fn local_memory_allowed(u: &Usage) -> bool {
    LOCAL_MEMORY_ALLOWED
        .iter()
        .any(|&(name, max)| name == u.kernel && u.arch == "sm_90a" && u.local_bytes() <= max)
}

/// Resource usage of one kernel on one architecture.
#[derive(Debug, Default, Clone)]
pub struct Usage {
    kernel: String,
    arch: String,
    registers: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
    /// Static shared memory (ptxas `N bytes smem`).
    smem: u32,
    /// Dynamic shared memory the host launches it with (from the registry).
    dyn_smem: usize,
    /// Whether this is the embedded SASS (else a JIT-fallback check).
    embedded: bool,
}

impl Usage {
    /// Bytes of local memory: stack frame + spill stores + spill loads.
    fn local_bytes(&self) -> u32 {
        self.stack + self.spill_stores + self.spill_loads
    }
}

/// Compiles `ptx` (one kernel, `k`, of the target whose tiles apply) for `arch`, writing the
/// cubin to `out` if given, and returns what ptxas reports.
pub fn compile(
    ptxas: &Path,
    ptx: &Path,
    arch: &str,
    out: Option<&Path>,
    k: &KernelInfo,
    dyn_smem: usize,
) -> Result<Usage, String> {
    let dev_null = Path::new("/dev/null");
    let result = Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-O3")
        .arg("-v")
        .arg(ptx)
        .arg("-o")
        .arg(out.unwrap_or(dev_null))
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    let text = String::from_utf8_lossy(&result.stderr).into_owned();
    if !result.status.success() {
        return Err(format!(
            "ptxas -arch={arch} {} failed:\n{text}",
            ptx.display()
        ));
    }
    // ptxas reports `wgmma` products it had to serialize (warning C7515 and kin: a register
    // touched between issue and wait); such a kernel is correct but slow.
    if let Some(line) = text.lines().find(|l| l.contains("Performance Loss")) {
        return Err(format!("{} on {arch}: {}", k.name, line.trim()));
    }
    let mut u = parse(&text, arch)
        .into_iter()
        .find(|u| u.kernel == k.name)
        .ok_or_else(|| {
            format!(
                "ptxas -v said nothing about {} in {}",
                k.name,
                ptx.display()
            )
        })?;
    u.dyn_smem = dyn_smem;
    u.embedded = out.is_some() || ARCHS.iter().any(|a| a.sass == arch);
    Ok(u)
}

/// `cargo xtask ptxas-report`: the check alone, on the committed PTX (inflated into
/// `target/ptx/committed/`).
pub fn report_committed() -> Result<(), String> {
    let ptxas = toolchain::ptxas()?;
    let scratch = crate::cmd::repo_root().join("target/ptx/committed");
    let mut all = Vec::new();
    for arch in &ARCHS {
        std::fs::create_dir_all(scratch.join(arch.name)).map_err(|e| e.to_string())?;
        for k in ALL_KERNELS.iter().filter(|k| k.built_for(arch.arch)) {
            let committed = ptx_path(arch, k.name);
            let stream =
                std::fs::read(&committed).map_err(|e| format!("{}: {e}", committed.display()))?;
            let path = scratch.join(arch.name).join(format!("{}.ptx", k.name));
            std::fs::write(&path, inflate(&stream, &committed)?).map_err(|e| e.to_string())?;
            let smem = k.dyn_smem[arch.arch.index()];
            for a in std::iter::once(&arch.sass).chain(arch.ptxas_check) {
                all.push(compile(&ptxas, &path, a, None, k, smem)?);
            }
        }
    }
    print_report(&all)
}

/// Prints the table; fails if any kernel uses local memory.
pub fn print_report(all: &[Usage]) -> Result<(), String> {
    println!(
        "{:<24} {:<7} {:>5} {:>6} {:>7} {:>6} {:>9}",
        "kernel", "arch", "regs", "stack", "spills", "smem", "dyn smem"
    );
    let mut bad = Vec::new();
    let mut fallback_only = Vec::new();
    let mut allowed = Vec::new();
    for u in all {
        println!(
            "{:<24} {:<7} {:>5} {:>6} {:>7} {:>6} {:>9}",
            u.kernel,
            u.arch,
            u.registers,
            u.stack,
            u.spill_stores + u.spill_loads,
            u.smem,
            u.dyn_smem
        );
        let local = u.local_bytes() > 0;
        if local && local_memory_allowed(u) {
            allowed.push(format!("{} on {}", u.kernel, u.arch));
        } else if local {
            if u.embedded {
                bad.push(format!("{} on {}", u.kernel, u.arch));
            } else {
                fallback_only.push(format!("{} on {}", u.kernel, u.arch));
            }
        }
    }
    println!(
        "registry: {} kernels × {} targets; ptxas: {} kernel/arch pairs",
        ALL_KERNELS.len(),
        ARCHS.len(),
        all.len()
    );
    if !fallback_only.is_empty() {
        println!(
            "warning: local memory on the PTX-JIT fallback only (the embedded SASS is clean): {}",
            fallback_only.join(", ")
        );
    }
    if !allowed.is_empty() {
        println!(
            "local memory within its allowance (LOCAL_MEMORY_ALLOWED): {}",
            allowed.join(", ")
        );
    }
    if bad.is_empty() {
        println!("ptxas check: no spills, no stack in the embedded SASS beyond the allowances");
        Ok(())
    } else {
        Err(format!(
            "local memory (stack or spills) in: {}",
            bad.join(", ")
        ))
    }
}

/// Parses `ptxas -v` output: a "Compiling entry function 'X'" line, then its "N bytes stack
/// frame, N bytes spill stores, N bytes spill loads" and "Used N registers" lines.
fn parse(text: &str, arch: &str) -> Vec<Usage> {
    let mut out: Vec<Usage> = Vec::new();
    let mut current: Option<Usage> = None;
    let num_before = |line: &str, key: &str| -> Option<u32> {
        let i = line.find(key)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    for line in text.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            if let Some(u) = current.take() {
                out.push(u);
            }
            let rest = &line[i + "Compiling entry function '".len()..];
            let name = rest.split('\'').next().unwrap_or("").to_string();
            current = Some(Usage {
                kernel: name,
                arch: arch.to_string(),
                ..Default::default()
            });
        } else if let Some(u) = current.as_mut() {
            if line.contains("bytes stack frame") && u.registers == 0 {
                u.stack = num_before(line, "bytes stack frame").unwrap_or(0);
                u.spill_stores = num_before(line, "bytes spill stores").unwrap_or(0);
                u.spill_loads = num_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used") && line.contains("registers") {
                u.smem = num_before(line, "bytes smem").unwrap_or(0);
                u.registers = line
                    .split("Used")
                    .nth(1)
                    .and_then(|s| s.split_whitespace().next())
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
            }
        }
    }
    out.extend(current);
    out
}
