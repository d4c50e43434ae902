//! `cargo xtask bench` without the report: build `flash-attn-bench`, run it here, add PyTorch
//! SDPA's numbers from `xtask/scripts/bench_torch.py` when PyTorch sees a GPU, and store the
//! merged rows in `docs/bench/`.

use super::record::{first_nonempty, rows_from_values};
use crate::cmd;
use serde_json::Value;
use std::process::Command;

/// Builds and runs the benchmark here, adds PyTorch's numbers, stores the merged rows as
/// `docs/bench/<date>-<device-slug>.json`.
pub(super) fn measure(args: &[String]) -> Result<(), String> {
    let root = cmd::repo_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    cmd::run(Command::new(&cargo).current_dir(&root).args([
        "build",
        "--release",
        "-p",
        "flash-attn-cli",
        "--bin",
        "flash-attn-bench",
    ]))?;

    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir)
        .map_err(|e| format!("cannot create {}: {e}", out_dir.display()))?;
    let ours = out_dir.join("ours.json");
    let merged = out_dir.join("bench.json");
    // A failed run must not leave an older run's rows to be picked up below.
    for stale in [&ours, &merged] {
        let _ = std::fs::remove_file(stale);
    }

    let date = std::env::var("BENCH_DATE")
        .ok()
        .filter(|d| !d.trim().is_empty())
        .unwrap_or_else(today_utc);
    let mut bench = Command::new(root.join("target/release/flash-attn-bench"));
    bench
        .current_dir(&root)
        .env("BENCH_DATE", &date)
        .arg("--out")
        .arg(&ours)
        .args(args);
    eprintln!("+ {}", cmd::show(&bench));
    let status = bench
        .status()
        .map_err(|e| format!("cannot start {}: {e}", cmd::show(&bench)))?;
    match status.code() {
        Some(0) => {}
        Some(2) => {
            return Err(
                "flash-attn-bench SKIPPED: no usable GPU on this machine (exit code 2), \
                 nothing was measured. Run the benchmark where the GPU is: `cargo xtask bundle` \
                 here, then `bash bundle/run.sh bench` on the GPU machine, copy `$OUT/bench.json` \
                 into docs/bench/ and run `cargo xtask bench-report` (see docs/benchmarks.md)"
                    .into(),
            )
        }
        _ => return Err(format!("{} failed with {status}", cmd::show(&bench))),
    }

    match torch_available() {
        Ok(()) => {
            let mut py = Command::new("python3");
            py.current_dir(&root)
                .arg("xtask/scripts/bench_torch.py")
                .arg(&ours)
                .arg(&merged);
            if let Some(reps) = flag(args, "--reps") {
                py.args(["--reps", reps]);
            }
            cmd::run(&mut py)
                .map_err(|e| format!("{e}\n(our own rows are kept in {})", ours.display()))?;
        }
        Err(why) => {
            let bar = "!".repeat(78);
            eprintln!("\n{bar}\n!! PyTorch comparison SKIPPED: {why}\n!! Keeping our rows only: the torch columns will read n/a.\n{bar}\n");
            std::fs::copy(&ours, &merged).map_err(|e| format!("copy rows: {e}"))?;
        }
    }

    let text = std::fs::read_to_string(&merged)
        .map_err(|e| format!("cannot read {}: {e}", merged.display()))?;
    let mut rows: Vec<Value> = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a JSON array of rows: {e}", merged.display()))?;
    if let Some(driver) = nvidia_smi_driver() {
        for r in rows.iter_mut().filter_map(Value::as_object_mut) {
            r.entry("driver").or_insert_with(|| driver.clone().into());
        }
    }
    let parsed = rows_from_values(&rows)?;
    let run_date = first_nonempty(&parsed, |r| &r.date).unwrap_or(&date);
    let device = first_nonempty(&parsed, |r| &r.device).unwrap_or("unknown device");
    let dest = root
        .join("docs/bench")
        .join(format!("{}-{}.json", slug(run_date), slug(device)));
    if dest.exists() {
        eprintln!("note: replacing {}", dest.display());
    }
    let json = serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?;
    std::fs::write(&dest, json + "\n")
        .map_err(|e| format!("cannot write {}: {e}", dest.display()))?;
    println!("rows stored in {}", dest.display());
    Ok(())
}

/// Whether `python3` can import torch and see a CUDA device; the reason if not.
fn torch_available() -> Result<(), String> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)",
        ])
        .output()
        .map_err(|e| format!("cannot start python3: {e}"))?;
    match out.status.code() {
        Some(0) => Ok(()),
        Some(3) => Err("PyTorch is installed but torch.cuda.is_available() is False".into()),
        _ => {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or("").trim();
            Err(format!("`python3 -c \"import torch\"` failed ({last})"))
        }
    }
}

/// The NVIDIA driver version, when `nvidia-smi` is there to say.
fn nvidia_smi_driver() -> Option<String> {
    cmd::which("nvidia-smi")?;
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=driver_version", "--format=csv,noheader"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text.lines().next()?.trim();
    (out.status.success() && !v.is_empty()).then(|| v.to_string())
}

/// The value after `name` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).map(String::as_str)
}

/// Today's date (UTC) as YYYY-MM-DD.
fn today_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    civil_date((secs / 86_400) as i64)
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// Lower-case ASCII letters and digits, every other run of characters one `-`.
fn slug(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.is_empty() && !out.ends_with('-') {
            out.push('-');
        }
    }
    while out.ends_with('-') {
        out.pop();
    }
    if out.is_empty() {
        "unknown".into()
    } else {
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slug_of_device_names() {
        assert_eq!(slug("NVIDIA H100 80GB HBM3"), "nvidia-h100-80gb-hbm3");
        assert_eq!(slug("  NVIDIA A100-SXM4-40GB  "), "nvidia-a100-sxm4-40gb");
        assert_eq!(slug("GeForce RTX 4090 (laptop)"), "geforce-rtx-4090-laptop");
        assert_eq!(slug("2026-11-22"), "2026-11-22");
        assert_eq!(slug("---"), "unknown");
        assert_eq!(slug(""), "unknown");
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(11_016), "2000-02-29");
        assert_eq!(civil_date(19_723), "2024-01-01");
        assert_eq!(civil_date(20_513), "2026-03-01");
    }
}
