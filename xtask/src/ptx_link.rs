//! The nvptx "linker". rustc's `nvptx64-nvidia-cuda` target links bitcode with an
//! `llvm-bitcode-linker`-style program (linker flavor `llbc`); rustup ships one, Debian does
//! not. This is ours: `llvm-link` (all bitcode inputs, rlib archives included) → `opt -O3` with
//! everything but the exported kernels internalised and dead code removed → then, per exported
//! kernel, `opt` keeping only that kernel → `llc` to one PTX file per kernel, so the host can
//! load (and the driver JIT-compile) each kernel on its own. The PTX files go to the folder
//! [`kernels_dir`] of the output; the output itself lists their names.

use crate::cmd;
use flash_attn_kernels::arch::ARCHS;
use flash_attn_kernels::registry::ALL_KERNELS;
use std::path::PathBuf;
use std::process::Command;

/// Set in the environment of the kernel build: this binary then acts as the linker.
pub const LINKER_ENV: &str = "XTASK_PTX_LINKER";
/// Paths of `llvm-link`, `opt` and `llc`, set by `build-ptx` next to [`LINKER_ENV`].
pub const LLVM_LINK_ENV: &str = "XTASK_LLVM_LINK";
/// See [`LLVM_LINK_ENV`].
pub const OPT_ENV: &str = "XTASK_OPT";
/// See [`LLVM_LINK_ENV`].
pub const LLC_ENV: &str = "XTASK_LLC";
/// Extra `opt`/`llc` arguments (space separated), e.g. the unroll threshold.
pub const LLVM_ARGS_ENV: &str = "XTASK_LLVM_ARGS";

/// The folder that receives one `<kernel>.ptx` per exported kernel, next to the linker output.
pub fn kernels_dir(output: &std::path::Path) -> PathBuf {
    output.with_extension("kernels")
}

/// Links the bitcode inputs rustc passes into one PTX file per kernel.
pub fn run(args: Vec<String>) -> Result<(), String> {
    let mut exports = Vec::new();
    let mut inputs = Vec::new();
    let mut output = None;
    let mut cpu = String::from("sm_80");
    let mut features = String::new();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--export-symbol" => exports.push(it.next().ok_or("--export-symbol needs a value")?),
            "-o" => output = Some(PathBuf::from(it.next().ok_or("-o needs a value")?)),
            "--target-cpu" => cpu = it.next().ok_or("--target-cpu needs a value")?,
            "--target-feature" => features = it.next().ok_or("--target-feature needs a value")?,
            "-L" | "--target" => {
                it.next();
            }
            s if s.starts_with("--target-feature=") => {
                features = s["--target-feature=".len()..].to_string()
            }
            s if s.starts_with("-O") || s == "--debug" => {}
            s if s.starts_with('-') => return Err(format!("ptx linker: unknown argument {s}")),
            _ => inputs.push(a),
        }
    }
    let output = output.ok_or("ptx linker: no -o")?;
    let tool = |env: &str| std::env::var(env).map_err(|_| format!("ptx linker: {env} not set"));
    let extra: Vec<String> = std::env::var(LLVM_ARGS_ENV)
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let linked = output.with_extension("linked.bc");
    let optimized = output.with_extension("opt.bc");

    cmd::run(
        Command::new(tool(LLVM_LINK_ENV)?)
            .arg("--ignore-non-bitcode")
            .args(&inputs)
            .arg("-o")
            .arg(&linked),
    )?;
    cmd::run(
        Command::new(tool(OPT_ENV)?)
            .args(&extra)
            .arg("--passes=default<O3>,internalize,globaldce")
            .arg(format!(
                "--internalize-public-api-list={}",
                exports.join(",")
            ))
            .arg(&linked)
            .arg("-o")
            .arg(&optimized),
    )?;
    let dir = kernels_dir(&output);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (opt, llc) = (tool(OPT_ENV)?, tool(LLC_ENV)?);
    let one_kernel = |name: &String| -> Result<(), String> {
        let bc = dir.join(format!("{name}.bc"));
        cmd::run(
            Command::new(&opt)
                .arg("--passes=internalize,globaldce")
                .arg(format!("--internalize-public-api-list={name}"))
                .arg(&optimized)
                .arg("-o")
                .arg(&bc),
        )?;
        let mut c = Command::new(&llc);
        c.args(&extra)
            .arg("-O3")
            .arg("-mtriple=nvptx64-nvidia-cuda")
            .arg(format!("-mcpu={cpu}"));
        if !features.is_empty() {
            c.arg(format!("-mattr={features}"));
        }
        let ptx = dir.join(format!("{name}.ptx"));
        cmd::run(c.arg(&bc).arg("-o").arg(&ptx))?;
        if let Some(threads) = maxntid(name, &cpu) {
            let text =
                std::fs::read_to_string(&ptx).map_err(|e| format!("{}: {e}", ptx.display()))?;
            let text = with_launch_bounds(&text, name, threads)?;
            std::fs::write(&ptx, text).map_err(|e| format!("{}: {e}", ptx.display()))?;
        }
        std::fs::remove_file(&bc).map_err(|e| e.to_string())
    };
    // Two at a time: llc is single-threaded and the kernels are independent.
    std::thread::scope(|s| {
        let one_kernel = &one_kernel;
        let handles: Vec<_> = exports
            .chunks(exports.len().div_ceil(2).max(1))
            .map(|chunk| s.spawn(move || chunk.iter().try_for_each(one_kernel)))
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| "llc thread panicked".to_string())?)
    })?;
    std::fs::write(&output, exports.join("\n")).map_err(|e| format!("{}: {e}", output.display()))
}

/// The block size kernel `name` must declare with `.maxntid` on the target of `-mcpu=cpu`, if
/// the registry says it needs one ([`KernelInfo::maxntid`]). rustc has no attribute for it.
///
/// [`KernelInfo::maxntid`]: flash_attn_kernels::registry::KernelInfo::maxntid
fn maxntid(name: &str, cpu: &str) -> Option<usize> {
    let arch = ARCHS.iter().find(|a| a.cpu == cpu)?.arch;
    let k = ALL_KERNELS.iter().find(|k| k.name == name && k.maxntid)?;
    Some(k.threads[arch.index()])
}

/// Registers per thread at launch for a block of `threads` (alone on the SM): the 64 K
/// register file divided among them, at most 255, in the allocation unit of 8.
fn launch_registers(threads: usize) -> usize {
    (65536 / threads).min(255) / 8 * 8
}

/// `ptx` with `.maxntid threads, 1, 1` and `.maxnreg` [`launch_registers`] between the
/// parameter list of entry `name` and its body (where PTX puts performance-tuning
/// directives). `setmaxnreg` moves registers from that count at launch: from `.maxntid`
/// alone ptxas derived it for the d <= 128 kernels but not for the d = 256 ones ("unable to
/// determine register count at entry", C7508, whereupon it ignores `setmaxnreg`); stated,
/// it holds for all.
fn with_launch_bounds(ptx: &str, name: &str, threads: usize) -> Result<String, String> {
    let entry = format!(".entry {name}(");
    let start = ptx
        .find(&entry)
        .ok_or_else(|| format!("{name}: no `{entry}` in its PTX"))?;
    let close = ptx[start..]
        .find("\n)")
        .ok_or_else(|| format!("{name}: its parameter list does not end"))?
        + start
        + 2;
    let regs = launch_registers(threads);
    Ok(format!(
        "{}\n.maxntid {threads}, 1, 1\n.maxnreg {regs}{}",
        &ptx[..close],
        &ptx[close..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_bounds_go_between_the_parameters_and_the_body() {
        let ptx = ".visible .entry k(\n\t.param .align 8 .b8 k_param_0[16]\n)\n{\n\tret;\n}\n";
        let out = with_launch_bounds(ptx, "k", 384).unwrap();
        assert_eq!(
            out,
            ".visible .entry k(\n\t.param .align 8 .b8 k_param_0[16]\n)\n.maxntid 384, 1, 1\n.maxnreg 168\n{\n\tret;\n}\n"
        );
        assert!(with_launch_bounds(ptx, "other", 384).is_err());
        assert_eq!((launch_registers(128), launch_registers(512)), (248, 128));
    }

    #[test]
    fn only_the_warp_specialised_kernels_declare_their_block_size() {
        // A producer warpgroup and two consumer warpgroups, or three.
        for k in ALL_KERNELS.iter().filter(|k| k.maxntid) {
            let threads = maxntid(k.name, "sm_90a");
            assert!(
                matches!(threads, Some(384 | 512)),
                "{}: {threads:?}",
                k.name
            );
        }
        assert_eq!(
            maxntid("flash_fwd_wgmma_masked_bf16_d128", "sm_90a"),
            Some(384)
        );
        assert_eq!(maxntid("flash_fwd_wgmma_bf16_d64", "sm_90a"), Some(512));
        let plain = ALL_KERNELS.iter().find(|k| !k.maxntid).unwrap();
        assert_eq!(maxntid(plain.name, "sm_90a"), None);
    }
}
