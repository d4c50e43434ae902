//! The forward TFLOP/s plot of one results file, drawn with `plotters`' SVG backend.
//!
//! One panel per (dtype, d, causal): rows of panels by (dtype, d), columns by masking, a shared
//! y scale so the panels compare at a glance, and the sequence length on a log2 axis. About
//! 770 px wide, so GitHub shows it unscaled.
//!
//! plotters is built with `default-features = false` and only `svg_backend` + `line_series`.
//! Without `ttf` / `ab_glyph`, plotters uses its "naive" font module: no font-kit, so no
//! fontconfig or freetype at build or run time (`cargo tree -p xtask` shows only plotters,
//! plotters-backend, plotters-svg and num-traits; no `-sys` crate). That costs
//! nothing here: the SVG backend writes text as `<text>` elements and the viewer's font
//! renders them; only plotters' text-size estimates (used to lay out label areas and the
//! legend) are a crude 0.7 em per byte, which is why the label areas below have fixed sizes.

use super::record::{dtype_rank, first_nonempty, Row, RunFile};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::BTreeSet;
use std::error::Error;
use std::ops::Range;

/// Width of one panel, label areas included.
const CELL_W: u32 = 374;
/// Height of one panel, caption and label areas included.
const CELL_H: u32 = 254;
/// Height of the header: title, two lines of context, legend.
const HEAD: u32 = 116;
/// Outer margin.
const MARGIN: u32 = 12;
/// Width of the y tick labels (and the y axis title in the first column).
const Y_LABELS: u32 = 58;
/// Height of the x tick labels (and the x axis title in the last row).
const X_LABELS: u32 = 44;
/// Space above each plot, for its title.
const PAD_T: u32 = 30;
/// Space right of each panel.
const PAD_R: u32 = 16;
/// CSS font families of every text.
const FONT: &str = "DejaVu Sans, Helvetica, Arial, sans-serif";
/// Dark text.
const INK: RGBColor = RGBColor(0x22, 0x22, 0x22);
/// Tick labels and axis titles.
const MUTED: RGBColor = RGBColor(0x44, 0x44, 0x44);

/// One line on the plot.
struct Series {
    /// Legend text.
    label: &'static str,
    /// Line and marker colour.
    color: RGBColor,
    /// Line width in px; ours is wider.
    width: u32,
    /// Marker radius in px.
    radius: u32,
    /// The row's TFLOP/s for this series.
    value: fn(&Row) -> Option<f64>,
}

/// Ours first (legend order); drawn last, on top.
const SERIES: [Series; 4] = [
    Series {
        label: "ours (Rust)",
        color: RGBColor(0xd6, 0x27, 0x28),
        width: 3,
        radius: 4,
        value: |r| r.ours,
    },
    Series {
        label: "PyTorch flash",
        color: RGBColor(0x1f, 0x77, 0xb4),
        width: 2,
        radius: 3,
        value: |r| r.flash,
    },
    Series {
        label: "PyTorch cuDNN",
        color: RGBColor(0x2c, 0xa0, 0x2c),
        width: 2,
        radius: 3,
        value: |r| r.cudnn,
    },
    Series {
        label: "PyTorch efficient",
        color: RGBColor(0x94, 0x67, 0xbd),
        width: 2,
        radius: 3,
        value: |r| r.efficient,
    },
];

/// A font of `px` CSS pixels: plotters' SVG backend writes `font-size` as the size / 1.24.
/// (Sizes here are ones that survive the round trip exactly: 13 would print 13.000000000000002.)
fn font(px: f64, style: FontStyle) -> FontDesc<'static> {
    FontDesc::new(FontFamily::Name(FONT), px * 1.24, style)
}

/// A text style of `px` CSS pixels in `color`, anchored at `pos`.
fn text(px: f64, style: FontStyle, color: &RGBColor, h: HPos) -> TextStyle<'static> {
    font(px, style).color(color).pos(Pos::new(h, VPos::Center))
}

/// A linear f64 axis with fixed ticks: labelled (`bold`) and grid-only (`light`) values.
///
/// Hand-written because plotters' own `(a..b).with_key_points(..)` does not compile with
/// `configure_mesh` for f64: `RangedCoordf64` has `NoDefaultFormatting`, `WithKeyPoints`
/// inherits it and so lacks the `ValueFormatter` the mesh needs (plotters 0.3.7). This type
/// declares `DefaultFormatting`; the labels come from the mesh's label formatters anyway.
struct Ticks {
    range: Range<f64>,
    bold: Vec<f64>,
    light: Vec<f64>,
}

impl Ranged for Ticks {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        RangedCoordf64::from(self.range.clone()).map(value, limit)
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            self.light.clone()
        } else {
            self.bold.clone()
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

/// A round upper bound for the y axis and its tick step (at most about 8 ticks).
///
/// Kept by hand: every panel shares one y scale that must end on a labelled tick, which
/// plotters' own key points (chosen per range, not per bound) do not guarantee.
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

/// The forward TFLOP/s plot of one results file as SVG text; `None` when the file has no
/// forward rows.
pub(super) fn render_svg(run: &RunFile) -> Result<Option<String>, String> {
    let rows: Vec<&Row> = run.rows.iter().filter(|r| r.op == "fwd").collect();
    if rows.is_empty() {
        return Ok(None);
    }
    let mut panel_rows: Vec<(&str, u64)> = rows.iter().map(|r| (r.dtype.as_str(), r.d)).collect();
    panel_rows.sort_by_key(|&(t, d)| (dtype_rank(t), d));
    panel_rows.dedup();
    let cols: Vec<bool> = rows
        .iter()
        .map(|r| r.causal)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let size = (
        2 * MARGIN + cols.len() as u32 * CELL_W,
        HEAD + panel_rows.len() as u32 * CELL_H + MARGIN,
    );
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        draw(&root, run, &rows, &panel_rows, &cols)
            .and_then(|()| root.present().map_err(Into::into))
            .map_err(|e| format!("plot {}: {e}", run.svg_name()))?;
    }
    Ok(Some(svg))
}

/// Draws the header and the panels onto `root`.
fn draw(
    root: &DrawingArea<SVGBackend, Shift>,
    run: &RunFile,
    rows: &[&Row],
    panel_rows: &[(&str, u64)],
    cols: &[bool],
) -> Result<(), Box<dyn Error>> {
    root.fill(&WHITE)?;
    let (width, _) = root.dim_in_pixel();
    let mid = width as i32 / 2;

    // The title shrinks to fit a long device name: the SVG writer cannot measure text, so
    // this assumes about 0.62 em per bold character.
    let title = format!("Forward attention — {} — {}", run.device(), run.date());
    let title_px =
        (0.92 * f64::from(width) / (0.62 * title.chars().count() as f64)).clamp(11.0, 18.0);
    let centred = |px, style, color| text(px, style, color, HPos::Center);
    root.draw_text(&title, &centred(title_px, FontStyle::Bold, &INK), (mid, 22))?;
    root.draw_text(
        "TFLOP/s vs sequence length N · B·N = 16K tokens · H·d = 2048",
        &centred(12.5, FontStyle::Normal, &MUTED),
        (mid, 45),
    )?;
    let mut sub = match first_nonempty(&run.rows, |r| &r.torch_version) {
        Some(v) => format!("PyTorch {v} SDPA backends"),
        None => "PyTorch not measured".to_string(),
    };
    if let Some(a) = first_nonempty(&run.rows, |r| &r.ptx_arch) {
        sub.push_str(&format!(" · our PTX {a}"));
    }
    root.draw_text(
        &sub,
        &centred(12.0, FontStyle::Normal, &RGBColor(0x66, 0x66, 0x66)),
        (mid, 63),
    )?;

    // One legend for all panels, centred, from plotters elements: plotters' own series legend
    // (`configure_series_labels`) belongs to one chart and would repeat in every panel.
    let shown: Vec<&Series> = SERIES
        .iter()
        .filter(|s| rows.iter().any(|r| (s.value)(r).is_some()))
        .collect();
    let label_style = text(12.5, FontStyle::Normal, &INK, HPos::Left);
    let item_w = |ser: &Series| -> Result<i32, Box<dyn Error>> {
        let (w, _) = root.estimate_text_size(ser.label, &label_style)?;
        Ok(34 + w as i32 + 26)
    };
    let mut total = -26;
    for ser in &shown {
        total += item_w(ser)?;
    }
    let (mut x, y) = ((width as i32 - total) / 2, 94);
    for ser in &shown {
        let line = ShapeStyle::from(&ser.color).stroke_width(ser.width);
        root.draw(&PathElement::new(vec![(x, y), (x + 28, y)], line))?;
        root.draw(&Circle::new((x + 14, y), ser.radius, ser.color.filled()))?;
        root.draw_text(ser.label, &label_style, (x + 34, y))?;
        x += item_w(ser)?;
    }

    // Shared axes: y from 0 to a round bound, x = log2 N with a 4 % inset either side.
    let n_min = rows.iter().map(|r| r.n).min().unwrap_or(1).max(1);
    let n_max = rows.iter().map(|r| r.n).max().unwrap_or(1).max(1);
    let (l_min, l_max) = ((n_min as f64).log2(), (n_max as f64).log2());
    let inset = if l_max > l_min {
        0.04 * (l_max - l_min)
    } else {
        1.0
    };
    let powers: Vec<u32> = (l_min.ceil() as u32..=l_max.floor() as u32).collect();
    let every = powers.len().div_ceil(8).max(1);
    let x_ticks: Vec<f64> = powers
        .iter()
        .step_by(every)
        .map(|&p| f64::from(p))
        .collect();
    let x_grid: Vec<f64> = powers.iter().map(|&p| f64::from(p)).collect();
    let top = rows
        .iter()
        .flat_map(|r| SERIES.iter().filter_map(|s| (s.value)(r)))
        .fold(0.0, f64::max);
    let (y_max, y_step) = nice_axis(top);
    let y_ticks: Vec<f64> = (0..)
        .map(|i| f64::from(i) * y_step)
        .take_while(|v| *v <= y_max + y_step * 1e-6)
        .collect();

    let body = root.margin(HEAD, MARGIN, MARGIN, MARGIN);
    let cells = body.split_evenly((panel_rows.len(), cols.len()));
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
            let heads = panel.iter().filter_map(|r| r.h).collect::<BTreeSet<_>>();
            let h = match (heads.len(), heads.first()) {
                (1, Some(h)) => format!(" · H={h}"),
                _ => String::new(),
            };
            let mask = if causal { "causal" } else { "non-causal" };
            let mut chart = ChartBuilder::on(&cells[ri * cols.len() + ci])
                .margin_right(PAD_R)
                .margin_top(PAD_T)
                .x_label_area_size(X_LABELS)
                .y_label_area_size(Y_LABELS)
                .build_cartesian_2d(
                    Ticks {
                        range: (l_min - inset)..(l_max + inset),
                        bold: x_ticks.clone(),
                        light: x_grid.clone(),
                    },
                    Ticks {
                        range: 0.0..y_max,
                        bold: y_ticks.clone(),
                        light: Vec::new(),
                    },
                )?;
            // The panel title is centred on the plot, not on the panel with its label area
            // as `ChartBuilder::caption` would.
            let (xs, ys) = chart.plotting_area().get_pixel_range();
            root.draw_text(
                &format!("{dtype} · d={d}{h} · {mask}"),
                &centred(14.0, FontStyle::Bold, &INK),
                ((xs.start + xs.end) / 2, ys.start - 14),
            )?;
            chart.plotting_area().fill(&RGBColor(0xfb, 0xfb, 0xfb))?;
            let mut mesh = chart.configure_mesh();
            mesh.bold_line_style(RGBColor(0xe2, 0xe2, 0xe2))
                .light_line_style(RGBColor(0xec, 0xec, 0xec))
                .axis_style(RGBColor(0x88, 0x88, 0x88))
                .label_style(font(12.0, FontStyle::Normal).color(&MUTED))
                .axis_desc_style(font(12.0, FontStyle::Normal).color(&RGBColor(0x55, 0x55, 0x55)))
                .x_label_formatter(&|l| n_label(2f64.powf(*l).round() as u64))
                .y_label_formatter(&|v| format!("{}", v.round()));
            if ri + 1 == panel_rows.len() {
                mesh.x_desc("sequence length N (log scale)");
            }
            if ci == 0 {
                mesh.y_desc("TFLOP/s");
            }
            mesh.draw()?;
            // Series, ours last so it lies on top.
            for ser in SERIES.iter().rev() {
                let mut pts: Vec<(f64, f64)> = panel
                    .iter()
                    .filter_map(|r| (ser.value)(r).map(|v| ((r.n.max(1) as f64).log2(), v)))
                    .collect();
                if pts.is_empty() {
                    continue;
                }
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                let style = ser.color.filled().stroke_width(ser.width);
                chart.draw_series(LineSeries::new(pts, style).point_size(ser.radius))?;
            }
            // A frame on all four sides (the mesh draws only the left and bottom axes).
            chart.plotting_area().draw(&Rectangle::new(
                [(l_min - inset, 0.0), (l_max + inset, y_max)],
                RGBColor(0x88, 0x88, 0x88),
            ))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::record::sample::{row, run_of};
    use super::*;

    /// The `stroke` attribute plotters writes for `color`.
    fn stroke(color: &RGBColor) -> String {
        format!("stroke=\"#{:02X}{:02X}{:02X}\"", color.0, color.1, color.2)
    }

    /// Number of `<polyline>` elements drawn in `color`.
    fn lines_of(svg: &str, color: &RGBColor) -> usize {
        let stroke = stroke(color);
        svg.lines()
            .filter(|l| l.contains("<polyline") && l.contains(&stroke))
            .count()
    }

    /// Number of `<text>` elements whose content is `label` (plotters writes the content on a
    /// line of its own).
    fn texts(svg: &str, label: &str) -> usize {
        let lines: Vec<&str> = svg.lines().collect();
        lines
            .windows(3)
            .filter(|w| w[0].starts_with("<text") && w[1] == label && w[2] == "</text>")
            .count()
    }

    #[test]
    fn svg_has_one_line_per_series_and_panel() {
        let mut rows = Vec::new();
        for n in [512, 1024, 2048] {
            rows.push(row("f16", 64, n, false, true));
        }
        let svg = render_svg(&run_of(rows)).unwrap().unwrap();
        for ser in &SERIES {
            // One line in the panel, one sample in the legend.
            assert_eq!(lines_of(&svg, &ser.color), 2, "{}", ser.label);
            assert_eq!(texts(&svg, ser.label), 1, "{}", ser.label);
        }
        assert!(svg.contains("NVIDIA H100 80GB HBM3"));
        assert!(svg.contains("2026-11-22"));
        assert_eq!(texts(&svg, "f16 · d=64 · H=32 · non-causal"), 1);
        assert_eq!(texts(&svg, "TFLOP/s"), 1);
        assert_eq!(texts(&svg, "sequence length N (log scale)"), 1);
        for tick in ["512", "1K", "2K", "0", "100", "400"] {
            assert_eq!(texts(&svg, tick), 1, "{tick}");
        }
        assert!(svg.trim_end().ends_with("</svg>"));

        // Torch not measured: only our line, in each of two panels (and the legend).
        let mut rows = Vec::new();
        for n in [512, 1024] {
            rows.push(row("f16", 64, n, false, false));
            rows.push(row("bf16", 64, n, true, false));
        }
        let svg = render_svg(&run_of(rows)).unwrap().unwrap();
        assert_eq!(lines_of(&svg, &SERIES[0].color), 3);
        for ser in &SERIES[1..] {
            assert_eq!(lines_of(&svg, &ser.color), 0, "{}", ser.label);
        }
        assert!(svg.contains("PyTorch not measured"));
    }

    #[test]
    fn no_forward_rows_no_plot() {
        let mut r = row("f16", 64, 512, false, true);
        r.op = "bwd".into();
        assert!(render_svg(&run_of(vec![r])).unwrap().is_none());
    }

    #[test]
    fn axis_and_labels() {
        assert_eq!(nice_axis(671.3), (700.0, 100.0));
        assert_eq!(nice_axis(0.0), (1.0, 0.25));
        assert_eq!(n_label(512), "512");
        assert_eq!(n_label(16384), "16K");
    }
}
