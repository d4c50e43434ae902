//! `cargo xtask build-ptx [--check]`.

use crate::{cmd, ptx_link, ptxas, toolchain};
use std::path::{Path, PathBuf};
use std::process::Command;

/// One PTX build: a file name under `host/ptx/`, the `target-cpu`, and target features.
pub struct PtxTarget {
    /// File stem under `host/ptx/`.
    pub name: &'static str,
    /// `-C target-cpu`.
    pub cpu: &'static str,
    /// `-C target-feature` (empty for none).
    pub features: &'static str,
    /// Value of `--cfg flash_arch` (selects the tile table in `flash_attn_kernels::config`).
    pub cfg: &'static str,
    /// Architectures `ptxas` checks this PTX for.
    pub ptxas_archs: &'static [&'static str],
}

/// Every PTX the host embeds. sm_80 PTX runs on Ampere, Ada and Hopper (the driver compiles it
/// for the device); sm_90a is for Hopper-only instructions.
pub const TARGETS: [PtxTarget; 2] = [
    PtxTarget {
        name: "flash_attn_sm80",
        cpu: "sm_80",
        features: "",
        cfg: "sm80",
        ptxas_archs: &["sm_80", "sm_86", "sm_89", "sm_90"],
    },
    PtxTarget {
        name: "flash_attn_sm90a",
        cpu: "sm_90a",
        features: "+ptx80",
        cfg: "sm90a",
        ptxas_archs: &["sm_90a"],
    },
];

/// LLVM's default full-unroll threshold leaves some fragment loops rolled, which moves the
/// register tiles to local memory; the kernels' loops all have small constant trip counts.
const UNROLL_THRESHOLD: &str = "-unroll-threshold=2000";

/// Committed location of a target's PTX.
pub fn committed_path(t: &PtxTarget) -> PathBuf {
    cmd::repo_root()
        .join("host/ptx")
        .join(format!("{}.ptx", t.name))
}

/// Builds every target; writes the PTX (or, with `check`, compares it with the committed
/// files); then runs the ptxas check.
pub fn run(check: bool) -> Result<(), String> {
    let tc = toolchain::ensure()?;
    eprintln!(
        "kernel toolchain: {} (rustc {})",
        tc.origin,
        tc.rustc.display()
    );
    let root = cmd::repo_root();
    let mut stale = Vec::new();
    for t in &TARGETS {
        let ptx = build_target(&tc, t, &root)?;
        check_no_paths(&ptx, t.name)?;
        let dest = committed_path(t);
        if check {
            let committed = std::fs::read_to_string(&dest).unwrap_or_default();
            if committed != ptx {
                stale.push(dest.display().to_string());
            } else {
                eprintln!("{}: identical to the committed PTX", dest.display());
            }
        } else {
            std::fs::create_dir_all(dest.parent().unwrap()).map_err(|e| e.to_string())?;
            std::fs::write(&dest, &ptx).map_err(|e| format!("{}: {e}", dest.display()))?;
            eprintln!("wrote {} ({} bytes)", dest.display(), ptx.len());
        }
    }
    ptxas::report_committed()?;
    if !stale.is_empty() {
        return Err(format!(
            "committed PTX is stale or not reproducible: {} (run `cargo xtask build-ptx` and commit)",
            stale.join(", ")
        ));
    }
    Ok(())
}

/// Runs the nested kernel build for one target and returns the PTX text.
fn build_target(tc: &toolchain::Toolchain, t: &PtxTarget, root: &Path) -> Result<String, String> {
    let target_dir = root.join("target/ptx").join(t.name);
    // A private copy of this binary acts as the linker, so a concurrent rebuild of xtask
    // cannot delete it under the nested build.
    let me = root
        .join("target/ptx")
        .join(format!("ptx-linker-{}", t.name));
    std::fs::create_dir_all(root.join("target/ptx")).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    std::fs::copy(&exe, &me)
        .map_err(|e| format!("copy {} -> {}: {e}", exe.display(), me.display()))?;
    let mut flags = vec![
        format!("-Clinker={}", me.display()),
        format!("-Ctarget-cpu={}", t.cpu),
        format!("--cfg=flash_arch=\"{}\"", t.cfg),
        format!("-Cllvm-args={UNROLL_THRESHOLD}"),
        format!("--remap-path-prefix={}=/flash-attn", root.display()),
    ];
    if !t.features.is_empty() {
        flags.push(format!("-Ctarget-feature={}", t.features));
    }
    let mut c = Command::new(&tc.cargo);
    // The outer (rustup) cargo exports its own compiler, flags and target dir; a nested cargo
    // that inherits them silently builds with the wrong toolchain.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("CARGO") || k.starts_with("RUST") || k == "RUSTUP_TOOLCHAIN" {
            c.env_remove(&k);
        }
    }
    if let Some(tn) = &tc.rustup_toolchain {
        c.env("RUSTUP_TOOLCHAIN", tn);
    }
    c.current_dir(root)
        .env("RUSTC", &tc.rustc)
        // Only this build uses unstable flags (-Zbuild-std, the ptx-kernel ABI).
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_TARGET_DIR", &target_dir)
        .env("CARGO_ENCODED_RUSTFLAGS", flags.join("\u{1f}"))
        .env(ptx_link::LINKER_ENV, "1")
        .env(ptx_link::LLVM_LINK_ENV, &tc.llvm_link)
        .env(ptx_link::OPT_ENV, &tc.opt)
        .env(ptx_link::LLC_ENV, &tc.llc)
        .env(ptx_link::LLVM_ARGS_ENV, UNROLL_THRESHOLD)
        .args(["rustc", "--profile", "ptx", "-Zbuild-std=core"])
        .args([
            "--target",
            "nvptx64-nvidia-cuda",
            "--lib",
            "--crate-type",
            "cdylib",
        ])
        .args(["--manifest-path", "kernels-gpu/Cargo.toml"]);
    cmd::run(&mut c)?;
    let out = target_dir.join("nvptx64-nvidia-cuda/ptx/deps/flash_attn_kernels.ptx");
    std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()))
}

/// The PTX must not depend on where the repository or toolchain lives.
fn check_no_paths(ptx: &str, name: &str) -> Result<(), String> {
    let root = cmd::repo_root().display().to_string();
    for needle in [
        root.as_str(),
        "/home/",
        "/root/",
        "/usr/lib/rustlib",
        ".cargo/registry",
    ] {
        if ptx.contains(needle) {
            return Err(format!(
                "{name}: PTX contains a machine path ({needle}); the build is not reproducible"
            ));
        }
    }
    Ok(())
}
