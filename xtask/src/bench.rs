//! `cargo xtask bench` and `cargo xtask bench-report`.
//!
//! `bench` runs the forward benchmark on this machine (it needs a GPU), adds PyTorch SDPA's
//! numbers measured on the same shapes when PyTorch is importable, stores the merged rows as
//! `docs/bench/<date>-<device-slug>.json` and then runs the report.
//!
//! `bench-report` reads every `docs/bench/*.json` (an array of row objects, as written by
//! `flash-attn-bench` and `xtask/scripts/bench_torch.py`; extra keys are ignored, `null` torch
//! values read "n/a") and regenerates, for each file, `docs/bench/fwd-<stem>.svg` and the
//! generated section of `docs/benchmarks.md` between [`BEGIN`] and [`END`].

use crate::cmd;
use serde_json::Value;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Start of the generated part of `docs/benchmarks.md`.
const BEGIN: &str = "<!-- bench:begin -->";
/// End of the generated part of `docs/benchmarks.md`.
const END: &str = "<!-- bench:end -->";

// ---------------------------------------------------------------------------------------------
// cargo xtask bench
// ---------------------------------------------------------------------------------------------

/// Builds and runs the benchmark here, adds PyTorch's numbers, stores the rows, runs the report.
pub fn run(args: &[String]) -> Result<(), String> {
    let root = cmd::repo_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    cmd::run(Command::new(&cargo).current_dir(&root).args([
        "build",
        "--release",
        "-p",
        "flash-attn",
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
    report()
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

// ---------------------------------------------------------------------------------------------
// Rows
// ---------------------------------------------------------------------------------------------

/// One benchmark row, the keys the report uses.
#[derive(Debug, Clone, Default, PartialEq)]
struct Row {
    op: String,
    dtype: String,
    d: u64,
    h: Option<u64>,
    n: u64,
    causal: bool,
    ours: Option<f64>,
    flash: Option<f64>,
    cudnn: Option<f64>,
    efficient: Option<f64>,
    device: String,
    date: String,
    torch_version: String,
    driver: String,
    ptx_arch: String,
}

impl Row {
    fn from_json(v: &Value) -> Result<Row, String> {
        let obj = v.as_object().ok_or("not a JSON object")?;
        let text = |k: &str| {
            obj.get(k)
                .and_then(Value::as_str)
                .unwrap_or("")
                .trim()
                .to_string()
        };
        let int = |k: &str| {
            obj.get(k)
                .and_then(Value::as_u64)
                .ok_or_else(|| format!("missing or non-integer `{k}`"))
        };
        let num = |k: &str| obj.get(k).and_then(Value::as_f64).filter(|x| x.is_finite());
        let dtype = text("dtype");
        if dtype.is_empty() {
            return Err("missing `dtype`".into());
        }
        let op = text("op");
        let driver = text("driver");
        Ok(Row {
            op: if op.is_empty() { "fwd".into() } else { op },
            dtype,
            d: int("d")?,
            h: int("h").ok(),
            n: int("n")?,
            causal: obj
                .get("causal")
                .and_then(Value::as_bool)
                .ok_or("missing or non-boolean `causal`")?,
            ours: num("ours_tflops"),
            flash: num("torch_flash_tflops"),
            cudnn: num("torch_cudnn_tflops"),
            efficient: num("torch_efficient_tflops"),
            device: text("device"),
            date: text("date"),
            torch_version: text("torch_version"),
            driver: if driver.is_empty() {
                text("driver_version")
            } else {
                driver
            },
            ptx_arch: text("ptx_arch"),
        })
    }
}

fn rows_from_values(values: &[Value]) -> Result<Vec<Row>, String> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| Row::from_json(v).map_err(|e| format!("row {i}: {e}")))
        .collect()
}

fn parse_rows(text: &str) -> Result<Vec<Row>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let values = v.as_array().ok_or("expected a JSON array of row objects")?;
    rows_from_values(values)
}

fn first_nonempty<'a>(rows: &'a [Row], key: impl Fn(&'a Row) -> &'a String) -> Option<&'a str> {
    rows.iter()
        .map(key)
        .find(|s| !s.is_empty())
        .map(String::as_str)
}

/// Sort key for element types: f16 first, then bf16, then the rest by name.
fn dtype_rank(dtype: &str) -> (u8, String) {
    let rank = match dtype {
        "f16" => 0,
        "bf16" => 1,
        "f32" => 2,
        _ => 3,
    };
    (rank, dtype.to_string())
}

/// The rows of one results file.
struct RunFile {
    stem: String,
    rows: Vec<Row>,
}

impl RunFile {
    fn device(&self) -> &str {
        first_nonempty(&self.rows, |r| &r.device).unwrap_or("unknown device")
    }
    fn date(&self) -> &str {
        first_nonempty(&self.rows, |r| &r.date).unwrap_or("")
    }
    fn svg_name(&self) -> String {
        format!("fwd-{}.svg", self.stem)
    }
}

/// One line on the plot and one column of the table.
struct Series {
    label: &'static str,
    short: &'static str,
    color: &'static str,
    width: f64,
    value: fn(&Row) -> Option<f64>,
}

/// Ours first (legend order); drawn last, on top.
const SERIES: [Series; 4] = [
    Series {
        label: "ours (Rust)",
        short: "ours",
        color: "#d62728",
        width: 3.0,
        value: |r| r.ours,
    },
    Series {
        label: "PyTorch flash",
        short: "flash",
        color: "#1f77b4",
        width: 2.0,
        value: |r| r.flash,
    },
    Series {
        label: "PyTorch cuDNN",
        short: "cudnn",
        color: "#2ca02c",
        width: 2.0,
        value: |r| r.cudnn,
    },
    Series {
        label: "PyTorch efficient",
        short: "efficient",
        color: "#9467bd",
        width: 2.0,
        value: |r| r.efficient,
    },
];

// ---------------------------------------------------------------------------------------------
// cargo xtask bench-report
// ---------------------------------------------------------------------------------------------

/// Regenerates the SVG plots and the generated section of `docs/benchmarks.md`.
pub fn report() -> Result<(), String> {
    let root = cmd::repo_root();
    let dir = root.join("docs/bench");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let mut runs = Vec::new();
    for p in &paths {
        let text =
            std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()))?;
        let rows = parse_rows(&text).map_err(|e| format!("{}: {e}", p.display()))?;
        let stem = p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        runs.push(RunFile { stem, rows });
    }
    // Newest first; the file name breaks ties.
    runs.sort_by(|a, b| (b.date(), &b.stem).cmp(&(a.date(), &a.stem)));

    let mut svgs = BTreeSet::new();
    for run in &runs {
        if let Some(svg) = render_svg(run) {
            let path = dir.join(run.svg_name());
            write_if_changed(&path, &svg)?;
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
    let doc = replace_section(&doc, &render_section(&runs))
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

/// `doc` with the text between the markers replaced by `body` (markers appended if absent).
fn replace_section(doc: &str, body: &str) -> Result<String, String> {
    let mut body = body.to_string();
    if !body.ends_with('\n') {
        body.push('\n');
    }
    match (doc.find(BEGIN), doc.find(END)) {
        (Some(s), Some(e)) if e > s => Ok(format!(
            "{}{BEGIN}\n{body}{END}{}",
            &doc[..s],
            &doc[e + END.len()..]
        )),
        (None, None) => Ok(format!("{}\n\n{BEGIN}\n{body}{END}\n", doc.trim_end())),
        _ => Err(format!("`{BEGIN}` / `{END}` missing or out of order")),
    }
}

fn fmt_opt(x: Option<f64>, decimals: usize) -> String {
    x.map_or_else(|| "n/a".into(), |v| format!("{v:.decimals$}"))
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// "min–max (geometric mean g×)" of the ratios that exist.
fn ratio_summary(ratios: impl Iterator<Item = Option<f64>>) -> String {
    let rs: Vec<f64> = ratios.flatten().filter(|r| *r > 0.0).collect();
    if rs.is_empty() {
        return "n/a".into();
    }
    let min = rs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = rs.iter().copied().fold(0.0, f64::max);
    let geo = (rs.iter().map(|r| r.ln()).sum::<f64>() / rs.len() as f64).exp();
    format!("{min:.2}–{max:.2}× (geometric mean {geo:.2}×)")
}

/// The markdown table of `rows`, sorted by dtype, d, causal, N.
fn render_table(rows: &[Row]) -> String {
    let mut sorted: Vec<&Row> = rows.iter().collect();
    sorted.sort_by(|a, b| {
        (dtype_rank(&a.dtype), a.d, a.causal, a.n).cmp(&(dtype_rank(&b.dtype), b.d, b.causal, b.n))
    });
    let mut s = String::new();
    s.push_str("| dtype | d | N | causal | ours TFLOP/s | flash | cuDNN | efficient | ours/flash | ours/cuDNN |\n");
    s.push_str("|:--|--:|--:|:--|--:|--:|--:|--:|--:|--:|\n");
    for r in sorted {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.dtype,
            r.d,
            r.n,
            if r.causal { "yes" } else { "no" },
            fmt_opt(r.ours, 1),
            fmt_opt(r.flash, 1),
            fmt_opt(r.cudnn, 1),
            fmt_opt(r.efficient, 1),
            fmt_opt(ratio(r.ours, r.flash), 2),
            fmt_opt(ratio(r.ours, r.cudnn), 2),
        );
    }
    s
}

/// The generated section of docs/benchmarks.md (between the markers).
fn render_section(runs: &[RunFile]) -> String {
    let mut s = String::new();
    s.push_str(
        "<!-- Generated by `cargo xtask bench-report` from docs/bench/*.json: edits here are overwritten. -->\n",
    );
    if runs.is_empty() {
        s.push_str("\n_No results in docs/bench/ yet._\n\n");
        return s;
    }
    for run in runs {
        let rows = &run.rows;
        let or_na = |v: Option<&str>| v.unwrap_or("n/a").to_string();
        let date = run.date();
        let _ = write!(
            s,
            "\n### {} — {}",
            run.device(),
            if date.is_empty() { "undated" } else { date }
        );
        // Several files of one device and day: name the file in the heading.
        if runs
            .iter()
            .filter(|o| o.device() == run.device() && o.date() == date)
            .count()
            > 1
        {
            let _ = write!(s, " — `{}`", run.stem);
        }
        s.push_str("\n\n");
        let _ = writeln!(s, "- Device: {}", run.device());
        if let Some(driver) = first_nonempty(rows, |r| &r.driver) {
            let _ = writeln!(s, "- Driver: {driver}");
        }
        let _ = writeln!(s, "- Date: {}", if date.is_empty() { "n/a" } else { date });
        let _ = writeln!(
            s,
            "- PyTorch: {}",
            or_na(first_nonempty(rows, |r| &r.torch_version))
        );
        if let Some(arch) = first_nonempty(rows, |r| &r.ptx_arch) {
            let _ = writeln!(s, "- Our PTX: `{arch}`");
        }
        let _ = writeln!(s, "- Rows: [`bench/{0}.json`](bench/{0}.json)", run.stem);
        let _ = writeln!(
            s,
            "- Ours / PyTorch flash: {}",
            ratio_summary(rows.iter().map(|r| ratio(r.ours, r.flash)))
        );
        let _ = writeln!(
            s,
            "- Ours / PyTorch cuDNN: {}",
            ratio_summary(rows.iter().map(|r| ratio(r.ours, r.cudnn)))
        );
        if rows.iter().any(|r| r.op == "fwd") {
            let _ = writeln!(
                s,
                "\n![Forward TFLOP/s vs sequence length, {}, {}](bench/{})",
                run.device(),
                date,
                run.svg_name()
            );
        }
        let ops: BTreeSet<&str> = rows.iter().map(|r| r.op.as_str()).collect();
        for op in ops {
            let of_op: Vec<Row> = rows.iter().filter(|r| r.op == op).cloned().collect();
            let _ = writeln!(
                s,
                "\n<details><summary>Table: <code>{op}</code>, TFLOP/s ({} rows)</summary>\n",
                of_op.len()
            );
            s.push_str(&render_table(&of_op));
            s.push_str("\n</details>\n");
        }
    }
    s.push('\n');
    s
}

// ---------------------------------------------------------------------------------------------
// SVG plot
// ---------------------------------------------------------------------------------------------

const PLOT_W: f64 = 300.0;
const PLOT_H: f64 = 180.0;
const PAD_L: f64 = 58.0;
const PAD_R: f64 = 16.0;
const PAD_T: f64 = 30.0;
const PAD_B: f64 = 44.0;
const CELL_W: f64 = PAD_L + PLOT_W + PAD_R;
const CELL_H: f64 = PAD_T + PLOT_H + PAD_B;
const HEAD: f64 = 116.0;
const MARGIN: f64 = 12.0;
/// Space between the frame and the first / last sequence length.
const X_INSET: f64 = 12.0;

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A round upper bound for the y axis and its tick step (at most about 8 ticks).
fn nice_axis(max: f64) -> (f64, f64) {
    if max <= 0.0 || !max.is_finite() {
        return (1.0, 0.25);
    }
    let raw = max / 7.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

/// 512 → "512", 16384 → "16K".
fn n_label(n: u64) -> String {
    if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}K", n / 1024)
    } else {
        n.to_string()
    }
}

/// The forward TFLOP/s plot of one results file: one panel per (dtype, d, causal), rows of
/// panels by dtype; `None` when the file has no forward rows.
fn render_svg(run: &RunFile) -> Option<String> {
    let rows: Vec<&Row> = run.rows.iter().filter(|r| r.op == "fwd").collect();
    if rows.is_empty() {
        return None;
    }
    // Panel rows by (dtype, d), columns by masking: about 770 px wide, so GitHub shows it unscaled.
    let mut panel_rows: Vec<(&str, u64)> = rows.iter().map(|r| (r.dtype.as_str(), r.d)).collect();
    panel_rows.sort_by_key(|&(t, d)| (dtype_rank(t), d));
    panel_rows.dedup();
    let cols: Vec<bool> = rows
        .iter()
        .map(|r| r.causal)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let n_min = rows.iter().map(|r| r.n).min().unwrap_or(1).max(1);
    let n_max = rows.iter().map(|r| r.n).max().unwrap_or(1).max(1);
    let (l_min, l_max) = ((n_min as f64).log2(), (n_max as f64).log2());
    let top = rows
        .iter()
        .flat_map(|r| SERIES.iter().filter_map(|s| (s.value)(r)))
        .fold(0.0, f64::max);
    let (y_max, y_step) = nice_axis(top);
    let shown: Vec<&Series> = SERIES
        .iter()
        .filter(|s| rows.iter().any(|r| (s.value)(r).is_some()))
        .collect();

    let width = 2.0 * MARGIN + cols.len() as f64 * CELL_W;
    let height = HEAD + panel_rows.len() as f64 * CELL_H + MARGIN;
    let device = xml_escape(run.device());
    let date = xml_escape(run.date());
    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">
<title>Forward attention TFLOP/s vs sequence length, {device}, {date}</title>
<rect width="100%" height="100%" fill="#ffffff"/>"##
    );
    // The title shrinks to fit a long device name (about 0.62 em per bold character).
    let title = format!("Forward attention — {device} — {date}");
    let title_px = (0.92 * width / (0.62 * title.chars().count() as f64)).clamp(11.0, 18.0);
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="28" text-anchor="middle" font-size="{title_px:.1}" font-weight="bold" fill="#222">{title}</text>"##,
        width / 2.0
    );
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="49" text-anchor="middle" font-size="13" fill="#444">TFLOP/s vs sequence length N · B·N = 16K tokens · H·d = 2048</text>"##,
        width / 2.0
    );
    let mut sub = String::new();
    match first_nonempty(&run.rows, |r| &r.torch_version) {
        Some(v) => {
            let _ = write!(sub, "PyTorch {} SDPA backends", xml_escape(v));
        }
        None => sub.push_str("PyTorch not measured"),
    }
    if let Some(a) = first_nonempty(&run.rows, |r| &r.ptx_arch) {
        let _ = write!(sub, " · our PTX {}", xml_escape(a));
    }
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="67" text-anchor="middle" font-size="12" fill="#666">{sub}</text>"##,
        width / 2.0
    );

    // Legend, centred: a line sample and a label per series.
    let item_w = |ser: &Series| 34.0 + ser.label.chars().count() as f64 * 7.2 + 26.0;
    let total: f64 = shown.iter().map(|ser| item_w(ser)).sum::<f64>() - 26.0;
    let mut x = (width - total) / 2.0;
    for ser in &shown {
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" y1="94" x2="{:.1}" y2="94" stroke="{}" stroke-width="{}"/><circle cx="{:.1}" cy="94" r="3.5" fill="{}"/><text x="{:.1}" y="98.5" font-size="13" fill="#222">{}</text>"##,
            x,
            x + 28.0,
            ser.color,
            ser.width,
            x + 14.0,
            ser.color,
            x + 34.0,
            xml_escape(ser.label)
        );
        x += item_w(ser);
    }

    for (ri, &(dtype, d)) in panel_rows.iter().enumerate() {
        for (ci, &causal) in cols.iter().enumerate() {
            let panel: Vec<&Row> = rows
                .iter()
                .copied()
                .filter(|r| r.dtype == dtype && r.d == d && r.causal == causal)
                .collect();
            if panel.is_empty() {
                continue;
            }
            let ox = MARGIN + ci as f64 * CELL_W;
            let oy = HEAD + ri as f64 * CELL_H;
            let (x0, y0) = (ox + PAD_L, oy + PAD_T);
            let (x1, y1) = (x0 + PLOT_W, y0 + PLOT_H);
            let px = |n: u64| {
                let l = (n.max(1) as f64).log2();
                if l_max > l_min {
                    x0 + X_INSET + (l - l_min) / (l_max - l_min) * (PLOT_W - 2.0 * X_INSET)
                } else {
                    x0 + PLOT_W / 2.0
                }
            };
            let py = |v: f64| y1 - (v / y_max).clamp(0.0, 1.0) * PLOT_H;

            let heads = panel.iter().filter_map(|r| r.h).collect::<BTreeSet<_>>();
            let h = match (heads.len(), heads.first()) {
                (1, Some(h)) => format!(" · H={h}"),
                _ => String::new(),
            };
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="14" font-weight="bold" fill="#222">{} · d={d}{h} · {}</text>"##,
                x0 + PLOT_W / 2.0,
                y0 - 10.0,
                xml_escape(dtype),
                if causal { "causal" } else { "non-causal" }
            );
            let _ = writeln!(
                s,
                r##"<rect x="{x0:.1}" y="{y0:.1}" width="{PLOT_W}" height="{PLOT_H}" fill="#fbfbfb" stroke="#888" stroke-width="1"/>"##
            );
            // Horizontal grid and y tick labels.
            let mut v = 0.0;
            while v <= y_max + y_step * 1e-6 {
                let y = py(v);
                if v > 0.0 && v < y_max - y_step * 1e-6 {
                    let _ = writeln!(
                        s,
                        r##"<line x1="{x0:.1}" y1="{y:.1}" x2="{x1:.1}" y2="{y:.1}" stroke="#e2e2e2" stroke-width="1"/>"##
                    );
                }
                let _ = writeln!(
                    s,
                    r##"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="12" fill="#444">{}</text>"##,
                    x0 - 6.0,
                    y + 4.0,
                    v.round()
                );
                v += y_step;
            }
            // Vertical grid at powers of two and x tick labels.
            let first = l_min.ceil() as u32;
            let last = l_max.floor() as u32;
            let every = ((last.saturating_sub(first) + 1) as usize)
                .div_ceil(8)
                .max(1);
            for (i, p) in (first..=last).enumerate() {
                let n = 1u64 << p;
                let x = px(n);
                let _ = writeln!(
                    s,
                    r##"<line x1="{x:.1}" y1="{y0:.1}" x2="{x:.1}" y2="{y1:.1}" stroke="#ececec" stroke-width="1"/>"##
                );
                if i % every == 0 {
                    let _ = writeln!(
                        s,
                        r##"<text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="12" fill="#444">{}</text>"##,
                        y1 + 16.0,
                        n_label(n)
                    );
                }
            }
            if ri + 1 == panel_rows.len() {
                let _ = writeln!(
                    s,
                    r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="12" fill="#555">sequence length N (log scale)</text>"##,
                    x0 + PLOT_W / 2.0,
                    y1 + 34.0
                );
            }
            if ci == 0 {
                let (lx, ly) = (ox + 14.0, y0 + PLOT_H / 2.0);
                let _ = writeln!(
                    s,
                    r##"<text x="{lx:.1}" y="{ly:.1}" transform="rotate(-90 {lx:.1} {ly:.1})" text-anchor="middle" font-size="12" fill="#555">TFLOP/s</text>"##
                );
            }
            // Series, ours last so it lies on top.
            for ser in SERIES.iter().rev() {
                let mut pts: Vec<(f64, f64)> = panel
                    .iter()
                    .filter_map(|r| (ser.value)(r).map(|v| (px(r.n), py(v))))
                    .collect();
                if pts.is_empty() {
                    continue;
                }
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                let points: Vec<String> =
                    pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
                let _ = writeln!(
                    s,
                    r#"<polyline class="series-{}" fill="none" stroke="{}" stroke-width="{}" stroke-linejoin="round" points="{}"/>"#,
                    ser.short,
                    ser.color,
                    ser.width,
                    points.join(" ")
                );
                for (x, y) in pts {
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{x:.1}" cy="{y:.1}" r="{}" fill="{}"/>"#,
                        if ser.width > 2.0 { 3.5 } else { 2.8 },
                        ser.color
                    );
                }
            }
        }
    }
    s.push_str("</svg>\n");
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(dtype: &str, d: u64, n: u64, causal: bool, torch: bool) -> Row {
        let t = |x: f64| torch.then_some(x);
        Row {
            op: "fwd".into(),
            dtype: dtype.into(),
            d,
            h: Some(2048 / d),
            n,
            causal,
            ours: Some(200.0 + n as f64 / 1024.0),
            flash: t(250.0),
            cudnn: t(400.0),
            efficient: t(125.0),
            device: "NVIDIA H100 80GB HBM3".into(),
            date: "2026-11-22".into(),
            torch_version: if torch {
                "2.11.0".into()
            } else {
                String::new()
            },
            ..Row::default()
        }
    }

    fn run_of(rows: Vec<Row>) -> RunFile {
        RunFile {
            stem: "2026-11-22-nvidia-h100".into(),
            rows,
        }
    }

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

    #[test]
    fn rows_parse_with_nulls_and_extra_keys() {
        let text = r#"[{"op":"fwd","dtype":"f16","d":64,"b":32,"h":32,"n":512,"causal":false,
            "ours_ms":0.36,"ours_tflops":189.18,"torch_flash_tflops":null,
            "torch_cudnn_tflops":347.99,"device":"NVIDIA H100","date":"2026-11-22",
            "torch_flash_error":"no kernel","something_else":[1,2]}]"#;
        let rows = parse_rows(text).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].ours, Some(189.18));
        assert_eq!(rows[0].flash, None);
        assert_eq!(rows[0].efficient, None);
        assert_eq!(rows[0].cudnn, Some(347.99));
        assert!(parse_rows(r#"[{"dtype":"f16","d":64}]"#)
            .unwrap_err()
            .contains("row 0"));
        assert!(parse_rows("{}").is_err());
    }

    #[test]
    fn table_from_a_tiny_row_set() {
        let rows = vec![
            row("bf16", 64, 1024, false, true),
            row("f16", 128, 2048, true, false),
            row("f16", 64, 512, false, true),
        ];
        let t = render_table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5);
        assert_eq!(
            lines[0],
            "| dtype | d | N | causal | ours TFLOP/s | flash | cuDNN | efficient | ours/flash | ours/cuDNN |"
        );
        // Sorted: f16 before bf16, then d, causal, N.
        assert_eq!(
            lines[2],
            "| f16 | 64 | 512 | no | 200.5 | 250.0 | 400.0 | 125.0 | 0.80 | 0.50 |"
        );
        assert_eq!(
            lines[3],
            "| f16 | 128 | 2048 | yes | 202.0 | n/a | n/a | n/a | n/a | n/a |"
        );
        assert!(lines[4].starts_with("| bf16 | 64 | 1024 | no |"));
    }

    #[test]
    fn section_mentions_device_date_and_plot() {
        let run = run_of(vec![row("f16", 64, 512, false, true)]);
        let s = render_section(&[run]);
        assert!(s.contains("### NVIDIA H100 80GB HBM3 — 2026-11-22"));
        assert!(s.contains("- PyTorch: 2.11.0"));
        assert!(s.contains("](bench/fwd-2026-11-22-nvidia-h100.svg)"));
        assert!(!s.contains("Driver"));
        assert!(!s.contains(BEGIN) && !s.contains(END));

        // Two files of one device and day: the headings name the files.
        let mut other = run_of(vec![row("f16", 64, 512, false, false)]);
        other.stem = "2026-11-22-nvidia-h100-b".into();
        let s = render_section(&[other, run_of(vec![row("f16", 64, 512, false, true)])]);
        let a = s.find("— 2026-11-22 — `2026-11-22-nvidia-h100-b`").unwrap();
        let b = s.find("— 2026-11-22 — `2026-11-22-nvidia-h100`\n").unwrap();
        assert!(a < b);
        assert!(s.contains("| f16 | 64 | 512 | no | 200.5 | n/a | n/a | n/a | n/a | n/a |"));
        assert!(s.contains("- PyTorch: n/a"));
    }

    #[test]
    fn svg_has_one_polyline_per_series_and_panel() {
        let mut rows = Vec::new();
        for n in [512, 1024, 2048] {
            rows.push(row("f16", 64, n, false, true));
        }
        let svg = render_svg(&run_of(rows)).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 4);
        for ser in &SERIES {
            assert_eq!(
                svg.matches(&format!("class=\"series-{}\"", ser.short))
                    .count(),
                1
            );
        }
        assert!(svg.contains("NVIDIA H100 80GB HBM3"));
        assert!(svg.contains("2026-11-22"));
        assert!(svg.trim_end().ends_with("</svg>"));

        // Torch not measured: only our line, in each of two panels.
        let mut rows = Vec::new();
        for n in [512, 1024] {
            rows.push(row("f16", 64, n, false, false));
            rows.push(row("bf16", 64, n, true, false));
        }
        let svg = render_svg(&run_of(rows)).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("class=\"series-ours\"").count(), 2);
        assert!(svg.contains("PyTorch not measured"));
    }

    #[test]
    fn no_forward_rows_no_plot() {
        let mut r = row("f16", 64, 512, false, true);
        r.op = "bwd".into();
        assert!(render_svg(&run_of(vec![r])).is_none());
    }

    #[test]
    fn marker_replacement_is_idempotent() {
        let doc = format!("# B\n\nhand\n\n{BEGIN}\nold\n{END}\n\ntail\n");
        let once = replace_section(&doc, "new\n").unwrap();
        assert_eq!(
            once,
            format!("# B\n\nhand\n\n{BEGIN}\nnew\n{END}\n\ntail\n")
        );
        assert_eq!(replace_section(&once, "new\n").unwrap(), once);

        let bare = "# B\n\nhand\n";
        let once = replace_section(bare, "gen").unwrap();
        assert_eq!(once, format!("# B\n\nhand\n\n{BEGIN}\ngen\n{END}\n"));
        assert_eq!(replace_section(&once, "gen").unwrap(), once);

        assert!(replace_section(&format!("{END}\n{BEGIN}\n"), "x").is_err());
        assert!(replace_section(&format!("{BEGIN}\n"), "x").is_err());
    }

    #[test]
    fn axis_and_labels() {
        assert_eq!(nice_axis(671.3), (700.0, 100.0));
        assert_eq!(nice_axis(0.0), (1.0, 0.25));
        assert_eq!(n_label(512), "512");
        assert_eq!(n_label(16384), "16K");
        assert_eq!(xml_escape("a<b&\"c\">"), "a&lt;b&amp;&quot;c&quot;&gt;");
    }
}
