//! `cargo xtask`: build automation for flash-attn.
//!
//! Sub-commands:
//! - `build-ptx [--check]`: set up the kernel toolchain if missing, build every kernel of the
//!   registry for every target, write one PTX and one SASS cubin per kernel plus the index into
//!   `host/kernels/`, run the ptxas resource check. `--check` fails if any generated file
//!   differs from the committed one (and says so when the toolchain differs).
//! - `ptxas-report`: the ptxas check alone, on the committed PTX.
//! - `bundle`: release test and bench binaries plus scripts in `bundle/`, for a GPU machine
//!   without Rust (`bash bundle/run.sh test|bench`).
//! - `bench`: run the benchmark here (needs a GPU) next to PyTorch SDPA.
//! - `bench-report`: regenerate docs/benchmarks.md tables and the SVG plot from docs/bench/.
//!
//! The same binary is also the nvptx linker: `build-ptx` passes it to rustc as `-C linker=`
//! with `XTASK_PTX_LINKER=1` set (see [`ptx_link`]).

mod bench;
mod build_ptx;
mod bundle;
mod cmd;
mod ptx_link;
mod ptxas;
mod toolchain;

use std::process::ExitCode;

fn main() -> ExitCode {
    if std::env::var_os(ptx_link::LINKER_ENV).is_some() {
        return report(ptx_link::run(std::env::args().skip(1).collect()));
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = &args[args.len().min(1)..];
    let result = match args.first().map(String::as_str) {
        Some("build-ptx") => match build_ptx::Trial::parse(rest) {
            Ok(Some(trial)) => build_ptx::trial(&trial),
            Ok(None) => build_ptx::run(rest.iter().any(|a| a == "--check")),
            Err(e) => Err(e),
        },
        Some("ptxas-report") => ptxas::report_committed(),
        Some("bundle") => bundle::run(),
        Some("bench") => bench::run(rest),
        Some("bench-report") => bench::report(),
        _ => {
            eprintln!(
                "usage: cargo xtask <build-ptx [--check | --arch NAME [--only SUBSTR,...]] | ptxas-report | bundle | bench [ARGS] | bench-report>"
            );
            return ExitCode::from(2);
        }
    };
    report(result)
}

fn report(result: Result<(), String>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e}");
            ExitCode::FAILURE
        }
    }
}
