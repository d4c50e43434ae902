//! `cargo xtask build-ptx [--check]`: builds every kernel of the registry for every target of
//! `flash_attn_kernels::arch::ARCHS` and writes, under `host/kernels/<arch>/`, one PTX file and
//! one SASS cubin (compiled offline by the pinned `ptxas`) per kernel, each as a zlib stream
//! (`.ptx.z`, `.cubin.z`: about a fifth of the size; the host inflates a kernel when it first
//! loads it), plus the host's index `host/kernels/index.rs`. Every generated text (the PTX
//! inside its stream, the index) starts with the toolchain that made it. `--check` rebuilds
//! into `target/` and compares every file byte for byte (the compression is deterministic).

use crate::{cmd, ptx_link, ptxas, toolchain};
use flash_attn_kernels::arch::{ArchInfo, ARCHS};
use flash_attn_kernels::registry::ALL_KERNELS;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// LLVM's default full-unroll threshold leaves some fragment loops rolled, which moves the
/// register tiles to local memory; the kernels' loops all have small constant trip counts.
const UNROLL_THRESHOLD: &str = "-unroll-threshold=2000";

/// Where the generated kernel files live.
pub fn kernels_root() -> PathBuf {
    cmd::repo_root().join("host/kernels")
}

/// Committed PTX of `kernel` for `arch` (a zlib stream).
pub fn ptx_path(arch: &ArchInfo, kernel: &str) -> PathBuf {
    kernels_root()
        .join(arch.name)
        .join(format!("{kernel}.ptx.z"))
}

/// Committed SASS of `kernel` for `arch` (a zlib stream).
pub fn cubin_path(arch: &ArchInfo, kernel: &str) -> PathBuf {
    kernels_root()
        .join(arch.name)
        .join(format!("{kernel}.cubin.z"))
}

/// zlib level of the committed files: fixed, so that a rebuild compares byte for byte.
const ZLIB_LEVEL: u8 = 9;

/// `bytes` as a zlib stream (what the host's `kernels.rs` inflates).
pub fn compress(bytes: &[u8]) -> Vec<u8> {
    miniz_oxide::deflate::compress_to_vec_zlib(bytes, ZLIB_LEVEL)
}

/// The bytes of a committed zlib stream.
pub fn inflate(stream: &[u8], what: &Path) -> Result<Vec<u8>, String> {
    miniz_oxide::inflate::decompress_to_vec_zlib(stream)
        .map_err(|e| format!("{}: not a zlib stream ({e:?})", what.display()))
}

/// Builds every target; writes the generated files (or, with `check`, compares them with the
/// committed ones); reports the ptxas resource use and fails on spills or stack.
pub fn run(check: bool) -> Result<(), String> {
    let tc = toolchain::ensure()?;
    let ptxas = toolchain::ptxas()?;
    let identity = toolchain::identity(&tc, &ptxas)?;
    eprintln!("kernel toolchain: {} ({identity})", tc.origin);
    let root = cmd::repo_root();
    // Generated files by path: (text or bytes) as rebuilt now.
    let mut files: BTreeMap<PathBuf, Vec<u8>> = BTreeMap::new();
    let mut usages = Vec::new();
    for arch in &ARCHS {
        let built = build_target(&tc, arch, &root)?;
        let scratch = root.join("target/ptx").join(arch.name).join("cubin");
        std::fs::create_dir_all(&scratch).map_err(|e| e.to_string())?;
        for k in ALL_KERNELS.iter().filter(|k| k.built_for(arch.arch)) {
            let body = built
                .get(k.name)
                .ok_or_else(|| format!("{}: kernel {} was not built", arch.name, k.name))?;
            let ptx = format!("{}{body}", header("//", &identity));
            check_no_paths(&ptx, k.name)?;
            let tmp_ptx = scratch.join(format!("{}.ptx", k.name));
            std::fs::write(&tmp_ptx, &ptx).map_err(|e| e.to_string())?;
            let tmp_cubin = scratch.join(format!("{}.cubin", k.name));
            let smem = k.dyn_smem[arch.arch.index()];
            usages.push(ptxas::compile(
                &ptxas,
                &tmp_ptx,
                arch.sass,
                Some(&tmp_cubin),
                k,
                smem,
            )?);
            for check_arch in arch.ptxas_check {
                usages.push(ptxas::compile(&ptxas, &tmp_ptx, check_arch, None, k, smem)?);
            }
            let cubin = std::fs::read(&tmp_cubin).map_err(|e| e.to_string())?;
            files.insert(ptx_path(arch, k.name), compress(ptx.as_bytes()));
            files.insert(cubin_path(arch, k.name), compress(&cubin));
        }
    }
    files.insert(
        kernels_root().join("index.rs"),
        index(&identity).into_bytes(),
    );
    ptxas::print_report(&usages)?;
    if check {
        compare(&files, &identity)
    } else {
        write(&files)
    }
}

/// `build-ptx --arch NAME [--only SUBSTR,...]`: a trial build of one target that writes
/// nothing under `host/kernels/` and runs ptxas only on the kernels whose names contain one
/// of the substrings (all without `--only`), for a quick resource check while developing.
pub struct Trial {
    arch: &'static ArchInfo,
    only: Vec<String>,
}

impl Trial {
    /// The trial the arguments ask for, or `None` for a full build.
    pub fn parse(args: &[String]) -> Result<Option<Trial>, String> {
        let value = |flag: &str| {
            let i = args.iter().position(|a| a == flag)?;
            Some(args.get(i + 1).cloned().unwrap_or_default())
        };
        let Some(name) = value("--arch") else {
            return Ok(None);
        };
        let arch = ARCHS
            .iter()
            .find(|a| a.name == name)
            .ok_or_else(|| format!("--arch {name}: no such target"))?;
        let only = value("--only")
            .map(|s| s.split(',').map(str::to_owned).collect())
            .unwrap_or_default();
        Ok(Some(Trial { arch, only }))
    }
}

/// Runs a [`Trial`]: builds its target and prints the ptxas report of the selected kernels.
pub fn trial(t: &Trial) -> Result<(), String> {
    let tc = toolchain::ensure()?;
    let ptxas = toolchain::ptxas()?;
    let root = cmd::repo_root();
    let built = build_target(&tc, t.arch, &root)?;
    let scratch = root.join("target/ptx").join(t.arch.name).join("trial");
    std::fs::create_dir_all(&scratch).map_err(|e| e.to_string())?;
    let (mut usages, mut failures) = (Vec::new(), Vec::new());
    let selected = ALL_KERNELS.iter().filter(|k| {
        k.built_for(t.arch.arch)
            && (t.only.is_empty() || t.only.iter().any(|s| k.name.contains(s.as_str())))
    });
    // Every selected kernel is compiled, and every failure reported, not only the first.
    for k in selected {
        let path = scratch.join(format!("{}.ptx", k.name));
        std::fs::write(&path, &built[k.name]).map_err(|e| e.to_string())?;
        let smem = k.dyn_smem[t.arch.arch.index()];
        match ptxas::compile(&ptxas, &path, t.arch.sass, None, k, smem) {
            Ok(usage) => usages.push(usage),
            Err(e) => failures.push(e),
        }
    }
    ptxas::print_report(&usages)?;
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} kernels failed:\n{}",
            failures.len(),
            failures.join("\n")
        ))
    }
}

/// The first lines of every generated text file: what made it.
fn header(comment: &str, identity: &str) -> String {
    format!(
        "{comment} @generated by `cargo xtask build-ptx` from kernels-gpu/: do not edit.\n\
         {comment} toolchain: {identity}\n"
    )
}

/// The host's table of embedded kernels: `(arch, kernel, PTX, SASS)` for every pair.
fn index(identity: &str) -> String {
    let mut s = header("//", identity);
    s.push_str(
        "\n/// Every embedded kernel: (target name, kernel name, PTX, SASS cubin), the last two as\n\
         /// zlib streams.\n\
         pub(crate) static EMBEDDED: &[(&str, &str, &[u8], &[u8])] = &[\n",
    );
    for arch in &ARCHS {
        for k in ALL_KERNELS.iter().filter(|k| k.built_for(arch.arch)) {
            s.push_str(&format!(
                "    (\n        \"{a}\",\n        \"{k}\",\n        include_bytes!(\"{a}/{k}.ptx.z\"),\n        include_bytes!(\"{a}/{k}.cubin.z\"),\n    ),\n",
                a = arch.name,
                k = k.name
            ));
        }
    }
    s.push_str("];\n");
    s
}

/// Writes the generated files and removes kernel files the registry no longer has.
fn write(files: &BTreeMap<PathBuf, Vec<u8>>) -> Result<(), String> {
    for (path, bytes) in files {
        std::fs::create_dir_all(path.parent().unwrap()).map_err(|e| e.to_string())?;
        std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    for stale in existing_files()?
        .into_iter()
        .filter(|p| !files.contains_key(p))
    {
        eprintln!("removing {} (no longer in the registry)", stale.display());
        std::fs::remove_file(&stale).map_err(|e| e.to_string())?;
    }
    let total: usize = files.values().map(Vec::len).sum();
    eprintln!(
        "wrote {} files under {} ({:.1} MiB)",
        files.len(),
        kernels_root().display(),
        total as f64 / (1 << 20) as f64
    );
    Ok(())
}

/// Every file now under `host/kernels/`.
fn existing_files() -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    let root = kernels_root();
    if !root.exists() {
        return Ok(out);
    }
    let mut dirs = vec![root];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))? {
            let p = e.map_err(|e| e.to_string())?.path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// `--check`: every generated file equals the committed one, and nothing else is there. When
/// files differ and they were made by another toolchain, says so rather than "stale".
fn compare(files: &BTreeMap<PathBuf, Vec<u8>>, identity: &str) -> Result<(), String> {
    let mut differ = Vec::new();
    for (path, bytes) in files {
        if std::fs::read(path).ok().as_deref() != Some(bytes.as_slice()) {
            differ.push(path.clone());
        }
    }
    let extra: Vec<PathBuf> = existing_files()?
        .into_iter()
        .filter(|p| !files.contains_key(p))
        .collect();
    if differ.is_empty() && extra.is_empty() {
        eprintln!(
            "{} generated files identical to the committed ones",
            files.len()
        );
        return Ok(());
    }
    let recorded = std::fs::read_to_string(kernels_root().join("index.rs"))
        .ok()
        .and_then(|text| recorded_identity(&text));
    Err(check_failure(
        recorded.as_deref(),
        identity,
        &differ,
        files.len(),
        &extra,
    ))
}

/// The `--check` failure message: a toolchain difference when the recorded toolchain is not
/// the installed one, else stale files; plus files the registry does not make.
fn check_failure(
    recorded: Option<&str>,
    identity: &str,
    differ: &[PathBuf],
    total: usize,
    extra: &[PathBuf],
) -> String {
    let show = |v: &[PathBuf]| -> String {
        let names: Vec<String> = v.iter().take(6).map(|p| p.display().to_string()).collect();
        let more = v.len().saturating_sub(6);
        if more > 0 {
            format!("{} and {more} more", names.join(", "))
        } else {
            names.join(", ")
        }
    };
    let mut msg = match recorded {
        Some(r) if r != identity => format!(
            "the installed kernel toolchain differs from the one that made the committed \
             kernels:\n  committed: {r}\n  installed: {identity}\nso the rebuilt files differ \
             ({} of {total}); this says nothing about the kernel sources. Install the recorded \
             versions, or rebuild with `cargo xtask build-ptx` and commit the regenerated \
             files.",
            differ.len()
        ),
        _ => format!(
            "committed kernel files are stale (same toolchain: {identity}): {} differ: {}. \
             Run `cargo xtask build-ptx` and commit.",
            differ.len(),
            show(differ)
        ),
    };
    if !extra.is_empty() {
        msg.push_str(&format!(
            "\nfiles under host/kernels/ that the registry does not make: {}",
            show(extra)
        ));
    }
    msg
}

/// The toolchain line of a generated file's header.
fn recorded_identity(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix("// toolchain: "))
        .map(str::to_owned)
}

/// Runs the nested kernel build for one target and returns the PTX text of each kernel.
fn build_target(
    tc: &toolchain::Toolchain,
    t: &ArchInfo,
    root: &Path,
) -> Result<BTreeMap<String, String>, String> {
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
        format!("--cfg=flash_arch=\"{}\"", t.name),
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
    let dir = ptx_link::kernels_dir(&out);
    let mut kernels = BTreeMap::new();
    for name in std::fs::read_to_string(&out)
        .map_err(|e| format!("{}: {e}", out.display()))?
        .lines()
    {
        let path = dir.join(format!("{name}.ptx"));
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        kernels.insert(name.to_string(), text);
    }
    let expected = ALL_KERNELS.iter().filter(|k| k.built_for(t.arch)).count();
    if kernels.len() != expected {
        return Err(format!(
            "{}: built {} kernels, the registry has {expected} for it",
            t.name,
            kernels.len(),
        ));
    }
    Ok(kernels)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_records_the_toolchain_and_check_names_a_difference() {
        let made_by = "rustc 1.96.0; LLVM 22.1.8; ptxas 13.0, V13.0.88";
        let text = format!("{}\n.version 7.0\n", header("//", made_by));
        assert_eq!(recorded_identity(&text).as_deref(), Some(made_by));
        let differ = [PathBuf::from("host/kernels/sm80/k.ptx.z")];
        let other = "rustc 1.97.0; LLVM 22.1.9; ptxas 13.0, V13.0.88";
        let msg = check_failure(Some(made_by), other, &differ, 45, &[]);
        assert!(msg.contains("toolchain differs"), "{msg}");
        assert!(msg.contains(made_by) && msg.contains(other), "{msg}");
        let msg = check_failure(Some(made_by), made_by, &differ, 45, &[]);
        assert!(msg.contains("stale") && msg.contains("k.ptx"), "{msg}");
        let extra = [PathBuf::from("host/kernels/sm80/old.ptx.z")];
        let msg = check_failure(Some(made_by), made_by, &[], 45, &extra);
        assert!(msg.contains("old.ptx"), "{msg}");
    }

    #[test]
    fn index_embeds_every_kernel_of_every_target() {
        let index = index("x");
        for arch in &ARCHS {
            for k in ALL_KERNELS.iter().filter(|k| k.built_for(arch.arch)) {
                assert!(index.contains(&format!(
                    "include_bytes!(\"{}/{}.ptx.z\")",
                    arch.name, k.name
                )));
                assert!(index.contains(&format!(
                    "include_bytes!(\"{}/{}.cubin.z\")",
                    arch.name, k.name
                )));
            }
        }
    }

    #[test]
    fn compression_round_trips_and_is_deterministic() {
        let text = ".version 8.1\n.target sm_80\n".repeat(1000);
        let z = compress(text.as_bytes());
        assert!(z.len() * 10 < text.len());
        assert_eq!(z, compress(text.as_bytes()));
        assert_eq!(inflate(&z, Path::new("x")).unwrap(), text.as_bytes());
        assert!(inflate(b"not zlib", Path::new("x")).is_err());
    }
}
