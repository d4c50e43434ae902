//! The generated section of `docs/benchmarks.md`: per results file a heading, the run's facts,
//! the ratio summaries (per op), a link to its plot (forward rows) and one markdown table per op
//! (`fwd`, then `bwd`, then `fwd_bwd`, then any other op by name).
//!
//! The tables are a public record: any change to their text is a change to the published
//! numbers' presentation, so `cargo xtask bench-report` must reproduce them byte for byte.

use super::record::{dtype_rank, first_nonempty, Row, RunFile};
use std::fmt::Write as _;

/// Start of the generated part of `docs/benchmarks.md`.
pub(super) const BEGIN: &str = "<!-- bench:begin -->";
/// End of the generated part of `docs/benchmarks.md`.
pub(super) const END: &str = "<!-- bench:end -->";

/// `doc` with the text between the markers replaced by `body` (markers appended if absent).
pub(super) fn replace_section(doc: &str, body: &str) -> Result<String, String> {
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

/// `x` with `decimals` decimals, or `n/a`.
fn fmt_opt(x: Option<f64>, decimals: usize) -> String {
    x.map_or_else(|| "n/a".into(), |v| format!("{v:.decimals$}"))
}

/// `a / b` when both exist and `b` is positive.
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
    // Rows that record the forward's path get its column and the `mma.sync` path's speed.
    let paths = rows.iter().any(|r| !r.path.is_empty());
    let mut s = String::new();
    s.push_str("| dtype | d | N | causal |");
    if paths {
        s.push_str(" path |");
    }
    s.push_str(" ours TFLOP/s | flash | cuDNN | efficient | ours/flash | ours/cuDNN |");
    // Rows timed in paired rounds get the spread of their per-round ratios to cuDNN.
    let rounds = rows.iter().any(|r| r.cudnn_rounds.is_some());
    if paths {
        s.push_str(" mma.sync | ours/mma.sync |");
    }
    if rounds {
        s.push_str(" ours/cuDNN per round |");
    }
    s.push_str("\n|:--|--:|--:|:--|");
    s.push_str(if paths { ":--|" } else { "" });
    s.push_str(&"--:|".repeat(6 + 2 * paths as usize + rounds as usize));
    s.push('\n');
    for r in sorted {
        let causal = if r.causal { "yes" } else { "no" };
        let _ = write!(s, "| {} | {} | {} | {causal} |", r.dtype, r.d, r.n);
        if paths {
            let _ = write!(s, " {} |", if r.path.is_empty() { "mma" } else { &r.path });
        }
        let _ = write!(
            s,
            " {} | {} | {} | {} | {} | {} |",
            fmt_opt(r.ours, 1),
            fmt_opt(r.flash, 1),
            fmt_opt(r.cudnn, 1),
            fmt_opt(r.efficient, 1),
            fmt_opt(ratio(r.ours, r.flash), 2),
            fmt_opt(ratio(r.ours, r.cudnn), 2),
        );
        if paths {
            let _ = write!(
                s,
                " {} | {} |",
                fmt_opt(r.mma, 1),
                fmt_opt(ratio(r.ours, r.mma), 2)
            );
        }
        if rounds {
            match r.cudnn_rounds {
                Some((lo, hi)) => {
                    let _ = write!(s, " {lo:.2}–{hi:.2} |");
                }
                None => s.push_str(" n/a |"),
            }
        }
        s.push('\n');
    }
    s
}

/// Sort key for ops: fwd, bwd, fwd_bwd, then the rest by name.
fn op_rank(op: &str) -> (u8, &str) {
    let rank = match op {
        "fwd" => 0,
        "bwd" => 1,
        "fwd_bwd" => 2,
        _ => 3,
    };
    (rank, op)
}

/// The ops of `rows`, in [`op_rank`] order.
fn ops_of(rows: &[Row]) -> Vec<&str> {
    let mut ops: Vec<&str> = rows.iter().map(|r| r.op.as_str()).collect();
    ops.sort_by_key(|op| op_rank(op));
    ops.dedup();
    ops
}

/// The generated section of docs/benchmarks.md (between the markers).
pub(super) fn render_section(runs: &[RunFile]) -> String {
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
        let ops = ops_of(rows);
        // The forward's summaries carry no label (as before backward rows existed); a file
        // without rows still gets them, reading n/a.
        let mut summaries: Vec<&str> = ops.clone();
        if summaries.is_empty() {
            summaries.push("fwd");
        }
        for op in summaries {
            let label = if op == "fwd" {
                String::new()
            } else {
                format!(" (`{op}`)")
            };
            let of_op = || rows.iter().filter(move |r| r.op == op);
            let _ = writeln!(
                s,
                "- Ours / PyTorch flash{label}: {}",
                ratio_summary(of_op().map(|r| ratio(r.ours, r.flash)))
            );
            let _ = writeln!(
                s,
                "- Ours / PyTorch cuDNN{label}: {}",
                ratio_summary(of_op().map(|r| ratio(r.ours, r.cudnn)))
            );
        }
        if rows.iter().any(|r| r.op == "fwd") {
            let _ = writeln!(
                s,
                "\n![Forward TFLOP/s vs sequence length, {}, {}](bench/{})",
                run.device(),
                date,
                run.svg_name()
            );
        }
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

#[cfg(test)]
mod tests {
    use super::super::record::sample::{row, run_of};
    use super::*;

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
    fn rows_with_a_path_get_the_path_and_mma_columns() {
        let mut r = row("bf16", 128, 4096, false, true);
        r.path = "wgmma".into();
        r.mma = Some(102.0);
        let t = render_table(&[r]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].contains("| causal | path | ours TFLOP/s |"),
            "{}",
            lines[0]
        );
        assert!(
            lines[0].ends_with("| mma.sync | ours/mma.sync |"),
            "{}",
            lines[0]
        );
        assert_eq!(lines[1].matches('|').count(), lines[0].matches('|').count());
        assert!(
            lines[2].starts_with("| bf16 | 128 | 4096 | no | wgmma | 204.0 |"),
            "{}",
            lines[2]
        );
        assert!(lines[2].ends_with("| 102.0 | 2.00 |"), "{}", lines[2]);
    }

    #[test]
    fn rows_timed_in_rounds_get_the_spread_column() {
        let mut r = row("bf16", 128, 4096, false, true);
        r.cudnn_rounds = Some((0.97, 1.04));
        let t = render_table(&[r, row("f16", 64, 512, false, true)]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].ends_with("| ours/cuDNN per round |"),
            "{}",
            lines[0]
        );
        for line in &lines[1..] {
            assert_eq!(
                line.matches('|').count(),
                lines[0].matches('|').count(),
                "{line}"
            );
        }
        assert!(lines[2].ends_with("| n/a |"), "{}", lines[2]);
        assert!(lines[3].ends_with("| 0.97–1.04 |"), "{}", lines[3]);
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

    /// `r` as a row of `op`, with `ours` TFLOP/s.
    fn with_op(mut r: Row, op: &str, ours: f64) -> Row {
        r.op = op.into();
        r.ours = Some(ours);
        r
    }

    #[test]
    fn backward_rows_get_their_own_tables_and_summaries() {
        let fwd = row("f16", 64, 512, false, true);
        let fwd_only = render_section(&[run_of(vec![fwd.clone()])]);
        let rows = vec![
            with_op(row("f16", 64, 512, false, true), "fwd_bwd", 100.0),
            with_op(row("bf16", 128, 1024, true, true), "bwd", 500.0),
            fwd.clone(),
            with_op(row("f16", 64, 512, false, false), "bwd", 125.0),
        ];
        let s = render_section(&[run_of(rows)]);

        // The forward's summaries read only forward rows, as in a forward-only file.
        let line = |s: &str, prefix: &str| {
            s.lines()
                .find(|l| l.starts_with(prefix))
                .map(str::to_string)
        };
        for prefix in ["- Ours / PyTorch flash: ", "- Ours / PyTorch cuDNN: "] {
            assert_eq!(line(&s, prefix), line(&fwd_only, prefix));
        }
        assert_eq!(
            line(&s, "- Ours / PyTorch flash (`bwd`): ").unwrap(),
            "- Ours / PyTorch flash (`bwd`): 2.00–2.00× (geometric mean 2.00×)"
        );
        assert_eq!(
            line(&s, "- Ours / PyTorch cuDNN (`fwd_bwd`): ").unwrap(),
            "- Ours / PyTorch cuDNN (`fwd_bwd`): 0.25–0.25× (geometric mean 0.25×)"
        );
        assert!(!fwd_only.contains("(`bwd`)"));

        // One table per op: fwd, bwd, fwd_bwd; same columns.
        let f = s.find("Table: <code>fwd</code>, TFLOP/s (1 rows)").unwrap();
        let b = s.find("Table: <code>bwd</code>, TFLOP/s (2 rows)").unwrap();
        let fb = s
            .find("Table: <code>fwd_bwd</code>, TFLOP/s (1 rows)")
            .unwrap();
        assert!(f < b && b < fb);
        let bwd_table = &s[b..fb];
        assert!(bwd_table.contains("| dtype | d | N | causal | ours TFLOP/s | flash | cuDNN |"));
        let f16 = bwd_table
            .find("| f16 | 64 | 512 | no | 125.0 | n/a | n/a | n/a | n/a | n/a |")
            .unwrap();
        let bf16 = bwd_table
            .find("| bf16 | 128 | 1024 | yes | 500.0 | 250.0 | 400.0 | 125.0 | 2.00 | 1.25 |")
            .unwrap();
        assert!(f16 < bf16);
        assert!(s[fb..]
            .contains("| f16 | 64 | 512 | no | 100.0 | 250.0 | 400.0 | 125.0 | 0.40 | 0.25 |"));
        // The plot covers the forward rows only.
        assert_eq!(s.matches("![Forward TFLOP/s").count(), 1);
    }

    #[test]
    fn backward_only_file_has_no_plot() {
        let r = with_op(row("f16", 128, 2048, true, true), "bwd", 300.0);
        let s = render_section(&[run_of(vec![r])]);
        assert!(!s.contains("![Forward"));
        assert!(!s.contains("<code>fwd</code>"));
        assert!(!s.contains("- Ours / PyTorch flash: "));
        assert!(s.contains("- Ours / PyTorch flash (`bwd`): 1.20–1.20× (geometric mean 1.20×)"));
        assert!(
            s.contains("| f16 | 128 | 2048 | yes | 300.0 | 250.0 | 400.0 | 125.0 | 1.20 | 0.75 |")
        );
        assert_eq!(
            ops_of(&[
                with_op(row("f16", 64, 512, false, true), "zzz", 1.0),
                with_op(row("f16", 64, 512, false, true), "fwd_bwd", 1.0),
                with_op(row("f16", 64, 512, false, true), "bwd", 1.0),
                row("f16", 64, 512, false, true),
            ]),
            ["fwd", "bwd", "fwd_bwd", "zzz"]
        );
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
}
