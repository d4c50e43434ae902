//! `cargo xtask bundle`: everything a GPU machine without Rust needs, in `bundle/`
//! and `bundle.txz` (git-ignored; what travels must stay under 64 MiB): the release test
//! binaries, the benchmark and CLI binaries, the PyTorch comparison script and `run.sh`.

use crate::cmd;
use std::path::Path;
use std::process::Command;

/// Test targets that read the source tree (the inline-asm tidy check, the README/example
/// check): they run here and in CI, not on a GPU machine that has only the bundle.
const SOURCE_TESTS: [&str; 2] = ["tidy", "readme"];

/// Whether a test target needs the GPU machine: the `gpu_*` suites and the host crate's own
/// tests (its loader and device tests). The CPU suites run here and in CI; every test binary
/// embeds the kernels (about 22 MiB of compressed streams that do not compress further), so
/// carrying them all would not fit the bundle.
fn needs_gpu(target: &str) -> bool {
    target.starts_with("gpu_") || target == "flash_attn"
}

/// Size limit of the bundle (what the GPU machines accept).
const MAX_BYTES: u64 = 64 << 20;

/// Builds the bundle.
pub fn run() -> Result<(), String> {
    let root = cmd::repo_root();
    let out = root.join("bundle");
    if out.exists() {
        std::fs::remove_dir_all(&out).map_err(|e| e.to_string())?;
    }
    for sub in ["tests", "bin", "scripts"] {
        std::fs::create_dir_all(out.join(sub)).map_err(|e| e.to_string())?;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // Stripped release binaries keep the bundle small.
    let strip = [
        ("CARGO_PROFILE_RELEASE_STRIP", "symbols"),
        ("CARGO_PROFILE_RELEASE_DEBUG", "false"),
    ];
    cmd::run(Command::new(&cargo).current_dir(&root).envs(strip).args([
        "build",
        "--release",
        "-p",
        "flash-attn-cli",
        "--bins",
    ]))?;
    let json = cmd::output(
        Command::new(&cargo)
            .current_dir(&root)
            .envs(strip)
            .args(["test", "--release", "--no-run", "--message-format=json"])
            .args([
                "-p",
                "flash-attn-tests",
                "-p",
                "flash-attn",
                "-p",
                "flash-attn-cli",
                "-p",
                "flash-attn-kernels",
            ]),
    )?;
    for line in json.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] != "compiler-artifact" || v["profile"]["test"] != true {
            continue;
        }
        let target = v["target"]["name"].as_str().unwrap_or("test");
        if SOURCE_TESTS.contains(&target) || !needs_gpu(target) {
            continue;
        }
        if let Some(exe) = v["executable"].as_str() {
            let name = format!(
                "{target}-{}",
                v["target"]["kind"][0].as_str().unwrap_or("lib")
            );
            copy(Path::new(exe), &out.join("tests").join(name))?;
        }
    }
    for bin in ["flash-attn-bench", "flash-attn-cli"] {
        copy(
            &root.join("target/release").join(bin),
            &out.join("bin").join(bin),
        )?;
    }
    // The training example (forward + backward on the GPU, falling loss).
    cmd::run(Command::new(&cargo).current_dir(&root).envs(strip).args([
        "build",
        "--release",
        "-p",
        "flash-attn",
        "--example",
        "train",
    ]))?;
    copy(
        &root.join("target/release/examples/train"),
        &out.join("bin/train"),
    )?;
    for script in [
        "bench_torch.py",
        "bench_masks_torch.py",
        "bench_dropout_torch.py",
        "io_ncu.py",
        "cli_vs_torch.py",
        "mem_peak.sh",
    ] {
        copy(
            &root.join("xtask/scripts").join(script),
            &out.join("scripts").join(script),
        )?;
    }
    copy(&root.join("xtask/scripts/run.sh"), &out.join("run.sh"))?;
    let size = dir_size(&out)?;
    eprintln!("bundle/: {:.1} MiB", size as f64 / (1 << 20) as f64);
    // Every binary embeds the same kernels (zlib streams, about 22 MiB, that gzip cannot
    // shrink): xz with a 64 MiB dictionary (`-9`) stores them about once for all binaries.
    let archive = root.join("bundle.txz");
    cmd::run(Command::new("tar").current_dir(&root).args([
        "-I",
        "xz -9 -T1",
        "-cf",
        "bundle.txz",
        "bundle",
    ]))?;
    let packed = std::fs::metadata(&archive)
        .map_err(|e| e.to_string())?
        .len();
    eprintln!("bundle.txz: {:.1} MiB", packed as f64 / (1 << 20) as f64);
    if packed > MAX_BYTES {
        return Err(format!(
            "bundle.txz is {packed} bytes, over the 64 MiB limit"
        ));
    }
    if size <= MAX_BYTES {
        println!("bundle ready: carry `bundle` (or `bundle.txz`) and run `bash bundle/run.sh test` / `bash bundle/run.sh bench`");
    } else {
        println!("bundle ready: carry `bundle.txz`, unpack it there (`tar xJf bundle.txz`) and run `bash bundle/run.sh test` / `bash bundle/run.sh bench`");
    }
    Ok(())
}

fn copy(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| format!("copy {} -> {}: {e}", from.display(), to.display()))
}

fn dir_size(dir: &Path) -> Result<u64, String> {
    let mut total = 0;
    for e in std::fs::read_dir(dir).map_err(|e| e.to_string())? {
        let e = e.map_err(|e| e.to_string())?;
        let m = e.metadata().map_err(|e| e.to_string())?;
        total += if m.is_dir() {
            dir_size(&e.path())?
        } else {
            m.len()
        };
    }
    Ok(total)
}
