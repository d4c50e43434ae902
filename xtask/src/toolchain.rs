//! Finding (and on Debian/Ubuntu, installing) the kernel toolchain: a rustc with the nvptx
//! backend and the `core` sources for `-Zbuild-std`, plus LLVM's `llvm-link`, `opt` and `llc`
//! for the link step, and NVIDIA's `ptxas` for the offline resource check.

use crate::cmd;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Debian packages that provide the toolchain (bookworm's security suite carries them).
const APT_PACKAGES: [&str; 4] = ["rustc-web", "cargo-web", "rust-web-src", "llvm-22"];
/// The ptxas used for the offline check: from NVIDIA's PyPI wheel, pinned.
pub const PTXAS_WHEEL: &str = "nvidia-cuda-nvcc==13.0.88";

/// A complete kernel toolchain.
#[derive(Debug, Clone)]
pub struct Toolchain {
    /// Human-readable origin ("Debian rustc-web" or "rustup nightly").
    pub origin: String,
    /// `cargo` to run.
    pub cargo: PathBuf,
    /// `rustc` to build with (passed as `RUSTC`).
    pub rustc: PathBuf,
    /// `rustup` toolchain name to pin for the nested cargo, if any.
    pub rustup_toolchain: Option<String>,
    /// LLVM tools.
    pub llvm_link: PathBuf,
    /// See `llvm_link`.
    pub opt: PathBuf,
    /// See `llvm_link`.
    pub llc: PathBuf,
}

/// The Debian toolchain, if complete.
fn debian() -> Result<Toolchain, Vec<String>> {
    let mut missing = Vec::new();
    let need = |p: &str, what: &str, missing: &mut Vec<String>| {
        if !Path::new(p).exists() {
            missing.push(format!("{p} ({what})"));
        }
    };
    need("/usr/bin/rustc", "rustc-web", &mut missing);
    need("/usr/bin/cargo", "cargo-web", &mut missing);
    need(
        "/usr/lib/rustlib/src/rust/library/core",
        "rust-web-src",
        &mut missing,
    );
    for t in ["llvm-link-22", "opt-22", "llc-22"] {
        need(&format!("/usr/bin/{t}"), "llvm-22", &mut missing);
    }
    if !missing.is_empty() {
        return Err(missing);
    }
    Ok(Toolchain {
        origin: "Debian rustc-web + llvm-22".into(),
        cargo: "/usr/bin/cargo".into(),
        rustc: "/usr/bin/rustc".into(),
        rustup_toolchain: None,
        llvm_link: "/usr/bin/llvm-link-22".into(),
        opt: "/usr/bin/opt-22".into(),
        llc: "/usr/bin/llc-22".into(),
    })
}

/// A rustup nightly with `rust-src`, plus LLVM tools on PATH (`llvm-link`, `opt`, `llc`,
/// optionally suffixed with a version).
fn rustup_nightly() -> Result<Toolchain, Vec<String>> {
    let mut missing = Vec::new();
    let sysroot =
        cmd::output(Command::new("rustup").args(["run", "nightly", "rustc", "--print", "sysroot"]))
            .map(|s| PathBuf::from(s.trim()));
    let sysroot = match sysroot {
        Ok(s) => s,
        Err(_) => {
            return Err(vec![
            "a rustup nightly toolchain (`rustup toolchain install nightly --component rust-src`)"
                .into(),
        ])
        }
    };
    if !sysroot.join("lib/rustlib/src/rust/library/core").exists() {
        missing.push(
            "rust-src for nightly (`rustup component add rust-src --toolchain nightly`)".into(),
        );
    }
    let find = |base: &str| -> Option<PathBuf> {
        let host_bin = sysroot
            .join("lib/rustlib/x86_64-unknown-linux-gnu/bin")
            .join(base);
        if host_bin.is_file() {
            return Some(host_bin);
        }
        std::iter::once(base.to_string())
            .chain((17..=23).rev().map(|v| format!("{base}-{v}")))
            .find_map(|n| cmd::which(&n))
    };
    let tools: Vec<Option<PathBuf>> = ["llvm-link", "opt", "llc"]
        .iter()
        .map(|t| find(t))
        .collect();
    for (t, p) in ["llvm-link", "opt", "llc"].iter().zip(&tools) {
        if p.is_none() {
            missing.push(format!(
                "{t} (LLVM ≥ 17 tools, e.g. `apt-get install llvm-22`)"
            ));
        }
    }
    if !missing.is_empty() {
        return Err(missing);
    }
    let mut tools = tools.into_iter().map(Option::unwrap);
    Ok(Toolchain {
        origin: "rustup nightly".into(),
        cargo: cmd::which("cargo").unwrap_or_else(|| "cargo".into()),
        rustc: sysroot.join("bin/rustc"),
        rustup_toolchain: Some("nightly".into()),
        llvm_link: tools.next().unwrap(),
        opt: tools.next().unwrap(),
        llc: tools.next().unwrap(),
    })
}

/// Finds a toolchain; on a Debian/Ubuntu machine where we are root and none is complete,
/// installs the Debian one (saying what). Otherwise explains what is missing and how to get it.
pub fn ensure() -> Result<Toolchain, String> {
    let debian_missing = match debian() {
        Ok(t) => return Ok(t),
        Err(m) => m,
    };
    let rustup_missing = match rustup_nightly() {
        Ok(t) => return Ok(t),
        Err(m) => m,
    };
    let is_root = cmd::output(Command::new("id").arg("-u"))
        .map(|s| s.trim() == "0")
        .unwrap_or(false);
    if cmd::which("apt-get").is_some() && is_root {
        eprintln!(
            "kernel toolchain missing ({}); installing Debian packages: {}",
            debian_missing.join(", "),
            APT_PACKAGES.join(" ")
        );
        cmd::run(Command::new("apt-get").args(["update", "-q"]))?;
        cmd::run(
            Command::new("apt-get")
                .args(["install", "-y", "-q", "--no-install-recommends"])
                .args(APT_PACKAGES)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
        return debian()
            .map_err(|m| format!("still missing after apt-get install: {}", m.join(", ")));
    }
    Err(format!(
        "no kernel toolchain found.\n  Debian/Ubuntu: `sudo apt-get install {}` (missing: {})\n  rustup: missing {}",
        APT_PACKAGES.join(" "),
        debian_missing.join(", "),
        rustup_missing.join(", ")
    ))
}

/// Path of a cached `ptxas` (under `.cache/` in the repository), downloading NVIDIA's wheel with
/// pip and extracting it on first use.
pub fn ptxas() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("PTXAS") {
        return Ok(PathBuf::from(p));
    }
    let cache = cmd::repo_root().join(".cache/ptxas-13.0.88");
    let exe = cache.join("nvidia/cu13/bin/ptxas");
    if exe.is_file() {
        return Ok(exe);
    }
    eprintln!("ptxas not cached; downloading the {PTXAS_WHEEL} wheel with pip (about 37 MB)");
    let wheels = cache.join("wheel");
    let python = cmd::which("python3").ok_or("python3 is needed to fetch ptxas (pip wheel)")?;
    cmd::run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
            ])
            .args([
                "--platform",
                "manylinux_2_17_x86_64",
                "--platform",
                "manylinux2014_x86_64",
            ])
            .arg(PTXAS_WHEEL)
            .arg("-d")
            .arg(&wheels),
    )?;
    let script = "import sys, zipfile, glob, os\n\
        w = glob.glob(os.path.join(sys.argv[1], '*.whl'))[0]\n\
        zipfile.ZipFile(w).extract('nvidia/cu13/bin/ptxas', sys.argv[2])\n\
        os.chmod(os.path.join(sys.argv[2], 'nvidia/cu13/bin/ptxas'), 0o755)\n";
    cmd::run(
        Command::new(&python)
            .args(["-c", script])
            .arg(&wheels)
            .arg(&cache),
    )?;
    Ok(exe)
}

/// What made the generated kernel files: the versions of rustc, LLVM (the link step's `llc`)
/// and ptxas, as one line.
pub fn identity(tc: &Toolchain, ptxas: &Path) -> Result<String, String> {
    let first = |out: String| out.lines().next().unwrap_or("").trim().to_string();
    let rustc = first(cmd::output(Command::new(&tc.rustc).arg("--version"))?);
    let llvm = cmd::output(Command::new(&tc.llc).arg("--version"))?
        .lines()
        .find_map(|l| {
            l.split_once("LLVM version ")
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let ptxas_version = cmd::output(Command::new(ptxas).arg("--version"))?
        .lines()
        .find_map(|l| l.split_once(", release ").map(|(_, v)| v.trim().to_owned()))
        .unwrap_or_else(|| "unknown".into());
    Ok(format!("{rustc}; LLVM {llvm}; ptxas {ptxas_version}"))
}
