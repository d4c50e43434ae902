//! The results files: `docs/bench/*.json`, each an array of row objects as written by
//! `flash-attn-bench` and `xtask/scripts/bench_torch.py`.
//!
//! The files are a public record, so reading is lenient: extra keys are ignored, a `null` or
//! missing torch value reads as not measured, and `driver_version` is accepted for `driver`.
//! Only the keys below are read; the files themselves are stored exactly as the tools wrote them.

use serde_json::Value;
use std::path::{Path, PathBuf};

/// One benchmark row, the keys the report uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Row {
    /// `op`: `fwd` when absent; `_det` appended for rows of the deterministic backward
    /// (`mode` = `deterministic`).
    pub op: String,
    /// `dtype`: element type, `f16`, `bf16`, ...
    pub dtype: String,
    /// `d`: head dimension.
    pub d: u64,
    /// `h`: number of heads, when recorded.
    pub h: Option<u64>,
    /// `n`: sequence length.
    pub n: u64,
    /// `causal`: whether the causal mask was applied.
    pub causal: bool,
    /// `ours_tflops`.
    pub ours: Option<f64>,
    /// `torch_flash_tflops`: PyTorch SDPA, flash backend.
    pub flash: Option<f64>,
    /// `torch_cudnn_tflops`: PyTorch SDPA, cuDNN backend.
    pub cudnn: Option<f64>,
    /// `torch_efficient_tflops`: PyTorch SDPA, memory-efficient backend.
    pub efficient: Option<f64>,
    /// `device`: the GPU's name.
    pub device: String,
    /// `date`: YYYY-MM-DD of the run.
    pub date: String,
    /// `torch_version`, empty when PyTorch was not measured.
    pub torch_version: String,
    /// `driver` (or `driver_version`): the NVIDIA driver.
    pub driver: String,
    /// `ptx_arch`: the target of our PTX.
    pub ptx_arch: String,
    /// The forward's path (`wgmma` or `mma`; empty in files from before it was recorded).
    pub path: String,
    /// TFLOP/s of our `mma.sync` forward on the same shape, where the row timed it too (the
    /// `wgmma` rows on Hopper).
    pub mma: Option<f64>,
    /// The least and greatest of the per-round ours/cuDNN ratios of a row timed in paired
    /// rounds (`ratio_vs_cudnn_rounds`: min, median, max; see `bench_torch.py --pair`).
    pub cudnn_rounds: Option<(f64, f64)>,
}

impl Row {
    /// Reads one row object.
    pub fn from_json(v: &Value) -> Result<Row, String> {
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
        let op = if op.is_empty() { "fwd".to_string() } else { op };
        let driver = text("driver");
        Ok(Row {
            // Rows of the deterministic backward are their own op (`bwd_det`, `fwd_bwd_det`).
            op: if text("mode") == "deterministic" {
                format!("{op}_det")
            } else {
                op
            },
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
            path: text("path"),
            mma: match (num("ours_tflops"), num("ours_ms"), num("mma_ms")) {
                (Some(t), Some(ms), Some(mma_ms)) if mma_ms > 0.0 => Some(t * ms / mma_ms),
                _ => None,
            },
            cudnn_rounds: match obj.get("ratio_vs_cudnn_rounds").and_then(Value::as_array) {
                Some(r) if r.len() == 3 => r[0].as_f64().zip(r[2].as_f64()),
                _ => None,
            },
        })
    }
}

/// Reads every row of `values`; the error names the first bad row.
pub(super) fn rows_from_values(values: &[Value]) -> Result<Vec<Row>, String> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| Row::from_json(v).map_err(|e| format!("row {i}: {e}")))
        .collect()
}

/// Reads the text of one results file.
pub(super) fn parse_rows(text: &str) -> Result<Vec<Row>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let values = v.as_array().ok_or("expected a JSON array of row objects")?;
    rows_from_values(values)
}

/// The first non-empty value of a text key among `rows`.
pub(super) fn first_nonempty<'a>(
    rows: &'a [Row],
    key: impl Fn(&'a Row) -> &'a String,
) -> Option<&'a str> {
    rows.iter()
        .map(key)
        .find(|s| !s.is_empty())
        .map(String::as_str)
}

/// Sort key for element types: f16 first, then bf16, then the rest by name.
pub(super) fn dtype_rank(dtype: &str) -> (u8, String) {
    let rank = match dtype {
        "f16" => 0,
        "bf16" => 1,
        "f32" => 2,
        _ => 3,
    };
    (rank, dtype.to_string())
}

/// The rows of one results file.
pub(super) struct RunFile {
    /// The file name without `.json`.
    pub stem: String,
    /// Its rows, in file order.
    pub rows: Vec<Row>,
}

impl RunFile {
    /// The device of the run, `unknown device` if no row names one.
    pub fn device(&self) -> &str {
        first_nonempty(&self.rows, |r| &r.device).unwrap_or("unknown device")
    }

    /// The date of the run, empty if no row has one.
    pub fn date(&self) -> &str {
        first_nonempty(&self.rows, |r| &r.date).unwrap_or("")
    }

    /// The file name of its forward plot, next to the JSON file.
    pub fn svg_name(&self) -> String {
        format!("fwd-{}.svg", self.stem)
    }
}

/// Every `*.json` in `dir`, newest first (the file name breaks ties).
pub(super) fn load_runs(dir: &Path) -> Result<Vec<RunFile>, String> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
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
    runs.sort_by(|a, b| (b.date(), &b.stem).cmp(&(a.date(), &a.stem)));
    Ok(runs)
}

/// Rows and files for the tests of the report and the plot.
#[cfg(test)]
pub(super) mod sample {
    use super::{Row, RunFile};

    /// A forward row on an H100, with PyTorch's three backends when `torch`.
    pub fn row(dtype: &str, d: u64, n: u64, causal: bool, torch: bool) -> Row {
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

    /// A results file holding `rows`.
    pub fn run_of(rows: Vec<Row>) -> RunFile {
        RunFile {
            stem: "2026-11-22-nvidia-h100".into(),
            rows,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn op_is_read_and_defaults_to_fwd() {
        let text = r#"[{"dtype":"f16","d":64,"n":512,"causal":true,"ours_tflops":1.0},
            {"op":"bwd","dtype":"bf16","d":128,"n":1024,"causal":false,"ours_tflops":2.0},
            {"op":"fwd_bwd","dtype":"f16","d":64,"n":512,"causal":false,"ours_tflops":3.0}]"#;
        let ops: Vec<String> = parse_rows(text)
            .unwrap()
            .into_iter()
            .map(|r| r.op)
            .collect();
        assert_eq!(ops, ["fwd", "bwd", "fwd_bwd"]);
    }
}
