//! `cargo xtask bench` and `cargo xtask bench-report`.
//!
//! `bench` runs the benchmark on this machine (it needs a GPU; `--op bwd|fwd_bwd|all` adds
//! backward rows to the forward's), adds PyTorch SDPA's
//! numbers measured on the same shapes when PyTorch is importable, stores the merged rows as
//! `docs/bench/<date>-<device-slug>.json` and then runs the report.
//!
//! `bench-report` reads every `docs/bench/*.json` (an array of row objects, as written by
//! `flash-attn-bench` and `xtask/scripts/bench_torch.py`; extra keys are ignored, `null` torch
//! values read "n/a") and regenerates, for each file, `docs/bench/fwd-<stem>.svg` (forward
//! rows only) and the generated section of `docs/benchmarks.md` between its `bench:begin` / `bench:end` markers.
//!
//! One file per job: [`mod@run`] measures, [`record`] reads the results files, [`mod@report`] writes
//! the markdown, [`plot`] draws the SVG charts (with `plotters`).

mod plot;
mod record;
mod report;
mod run;

use crate::cmd;
use std::collections::BTreeSet;
use std::path::Path;

/// `cargo xtask bench [ARGS]`: measures here (ARGS go to `flash-attn-bench`), then the report.
pub fn run(args: &[String]) -> Result<(), String> {
    run::measure(args)?;
    report()
}

/// `cargo xtask bench-report`: regenerates the SVG plots and the generated section of
/// `docs/benchmarks.md` from `docs/bench/*.json`.
pub fn report() -> Result<(), String> {
    let root = cmd::repo_root();
    let dir = root.join("docs/bench");
    let runs = record::load_runs(&dir)?;

    let mut svgs = BTreeSet::new();
    for run in &runs {
        if let Some(svg) = plot::render_svg(run)? {
            write_if_changed(&dir.join(run.svg_name()), &svg)?;
            svgs.insert(run.svg_name());
        }
    }
    // Plots whose results file is gone.
    for e in std::fs::read_dir(&dir).map_err(|e| e.to_string())? {
        let p = e.map_err(|e| e.to_string())?.path();
        let name = p
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.starts_with("fwd-") && name.ends_with(".svg") && !svgs.contains(&name) {
            eprintln!("removing stale {}", p.display());
            std::fs::remove_file(&p).map_err(|e| format!("remove {}: {e}", p.display()))?;
        }
    }

    let md_path = root.join("docs/benchmarks.md");
    let doc = match std::fs::read_to_string(&md_path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "# Benchmarks\n".to_string(),
        Err(e) => return Err(format!("cannot read {}: {e}", md_path.display())),
    };
    let doc = report::replace_section(&doc, &report::render_section(&runs))
        .map_err(|e| format!("{}: {e}", md_path.display()))?;
    let changed = write_if_changed(&md_path, &doc)?;
    println!(
        "bench-report: {} result file(s), {} plot(s), {} {}",
        runs.len(),
        svgs.len(),
        md_path.display(),
        if changed { "updated" } else { "up to date" }
    );
    Ok(())
}

/// Writes `text` unless the file already holds it; whether it wrote.
fn write_if_changed(path: &Path, text: &str) -> Result<bool, String> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(true)
}
