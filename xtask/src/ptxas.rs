//! The offline resource check: compiles each committed PTX with `ptxas -v` for every
//! architecture it targets, prints registers / shared memory / stack / spills per kernel, and
//! fails on any spill or stack use (local memory) unless the kernel is allowed below.

use crate::build_ptx::{committed_path, TARGETS};
use crate::toolchain;
use flash_attn_kernels::config::{fwd_kernel_name, fwd_tile, Arch, COMPILED_HEAD_DIMS};
use std::process::Command;

/// Kernels allowed to use local memory (none yet).
const LOCAL_MEMORY_ALLOWED: &[&str] = &[];

/// Resource usage of one kernel on one architecture.
#[derive(Debug, Default, Clone)]
struct Usage {
    kernel: String,
    arch: String,
    registers: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
    /// Static shared memory (ptxas `N bytes smem`).
    smem: u32,
}

/// Dynamic shared memory a kernel is launched with: the tile table of its target, read from
/// the kernel crate (as the host does), with kernels named by `config::fwd_kernel_name`.
fn dynamic_smem(kernel: &str, target: &str) -> usize {
    let arch = if target == "flash_attn_sm90a" {
        Arch::Sm90a
    } else {
        Arch::Sm80
    };
    COMPILED_HEAD_DIMS
        .into_iter()
        .find(|&d| {
            [false, true]
                .into_iter()
                .any(|bf16| fwd_kernel_name(bf16, d) == Some(kernel))
        })
        .and_then(|d| fwd_tile(arch, d))
        .map_or(0, |t| t.smem_bytes())
}

/// Checks the committed PTX files.
pub fn report_committed() -> Result<(), String> {
    let ptxas = toolchain::ptxas()?;
    let mut all = Vec::new();
    for t in &TARGETS {
        let path = committed_path(t);
        for arch in t.ptxas_archs {
            let out = Command::new(&ptxas)
                .arg(format!("-arch={arch}"))
                .arg("-v")
                .arg(&path)
                .arg("-o")
                .arg("/dev/null")
                .output()
                .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
            let text = String::from_utf8_lossy(&out.stderr).into_owned();
            if !out.status.success() {
                return Err(format!(
                    "ptxas -arch={arch} {} failed:\n{text}",
                    path.display()
                ));
            }
            all.extend(parse(&text, arch).into_iter().map(|u| (t.name, u)));
        }
    }
    println!(
        "{:<24} {:<7} {:>5} {:>6} {:>7} {:>6} {:>9}",
        "kernel", "arch", "regs", "stack", "spills", "smem", "dyn smem"
    );
    let mut bad = Vec::new();
    for (target, u) in &all {
        println!(
            "{:<24} {:<7} {:>5} {:>6} {:>7} {:>6} {:>9}",
            u.kernel,
            u.arch,
            u.registers,
            u.stack,
            u.spill_stores + u.spill_loads,
            u.smem,
            dynamic_smem(&u.kernel, target)
        );
        let local = u.stack + u.spill_stores + u.spill_loads > 0;
        if local && !LOCAL_MEMORY_ALLOWED.contains(&u.kernel.as_str()) {
            bad.push(format!("{} on {}", u.kernel, u.arch));
        }
    }
    if bad.is_empty() {
        println!(
            "ptxas check: {} kernel/arch pairs, no spills, no stack",
            all.len()
        );
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
