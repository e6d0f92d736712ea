//! A small hand-written SVG line-plot writer: side-by-side panels with axes, ticks, a linear or
//! logarithmic scale per axis, one coloured polyline per series and a shared legend.
//!
//! No plotting crate: the figure needs a few dozen lines of SVG and must build everywhere.

use std::fmt::Write as _;

/// One curve: a name for the legend and `(x, y)` points in drawing order. Points that cannot
/// be drawn (non-finite, or `≤ 0` on a logarithmic axis) break the line into pieces.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// `(x, y)` data points.
    pub points: Vec<(f64, f64)>,
}

/// Scale of one axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// Linear, ticks at 1-2-5 multiples of a power of ten.
    Linear,
    /// Base-10 logarithmic, ticks at powers of ten (positive values only).
    Log,
}

/// One plot panel.
#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    /// Title above the plot area.
    pub title: String,
    /// Label under the x axis.
    pub x_label: String,
    /// Label left of the y axis.
    pub y_label: String,
    /// Scale of the x axis.
    pub x_scale: Scale,
    /// Scale of the y axis.
    pub y_scale: Scale,
    /// Curves; series `i` gets colour `i` in every panel, so panels share one legend.
    pub series: Vec<Series>,
}

/// Ten distinguishable colours (matplotlib's "tab10").
const COLOURS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// Colour of series `i` (cycled).
pub fn colour(i: usize) -> &'static str {
    COLOURS[i % COLOURS.len()]
}

const PANEL_W: f64 = 460.0;
const PANEL_H: f64 = 360.0;
const MARGIN_L: f64 = 70.0;
const MARGIN_R: f64 = 20.0;
const MARGIN_T: f64 = 36.0;
const MARGIN_B: f64 = 52.0;
const LEGEND_W: f64 = 150.0;

/// Data-to-pixel mapping of one axis.
#[derive(Clone, Copy, Debug)]
struct Axis {
    scale: Scale,
    lo: f64,
    hi: f64,
}

impl Axis {
    /// The range covering every drawable value (padded when degenerate); `None` if nothing is
    /// drawable.
    fn fit(scale: Scale, values: impl Iterator<Item = f64>) -> Option<Axis> {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.filter(|&v| drawable(scale, v)) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if lo > hi {
            return None;
        }
        match scale {
            Scale::Linear => {
                if hi - lo < 1e-12 * hi.abs().max(1.0) {
                    lo -= 0.5;
                    hi += 0.5;
                }
                let step = nice_step((hi - lo) / 5.0);
                lo = (lo / step).floor() * step;
                hi = (hi / step).ceil() * step;
            }
            Scale::Log => {
                lo = 10f64.powf(lo.log10().floor());
                hi = 10f64.powf(hi.log10().ceil());
                if hi <= lo {
                    hi = lo * 10.0;
                }
            }
        }
        Some(Axis { scale, lo, hi })
    }

    /// Position in `[0, 1]` of a drawable value.
    fn frac(&self, v: f64) -> f64 {
        match self.scale {
            Scale::Linear => (v - self.lo) / (self.hi - self.lo),
            Scale::Log => (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10()),
        }
    }

    /// Tick positions with their labels.
    fn ticks(&self) -> Vec<(f64, String)> {
        match self.scale {
            Scale::Linear => {
                let step = nice_step((self.hi - self.lo) / 5.0);
                let first = (self.lo / step).ceil() as i64;
                let last = (self.hi / step + 1e-9).floor() as i64;
                (first..=last)
                    .map(|k| {
                        let v = k as f64 * step;
                        (v, format_tick(v, step))
                    })
                    .collect()
            }
            Scale::Log => {
                let (a, b) = (
                    self.lo.log10().round() as i32,
                    self.hi.log10().round() as i32,
                );
                // At most ~8 labelled decades: skip every other one on wide ranges.
                let stride = ((b - a) / 8 + 1).max(1) as usize;
                (a..=b)
                    .step_by(stride)
                    .map(|e| (10f64.powi(e), format!("1e{e}")))
                    .collect()
            }
        }
    }
}

fn drawable(scale: Scale, v: f64) -> bool {
    v.is_finite() && (scale == Scale::Linear || v > 0.0)
}

/// The 1-2-5 multiple of a power of ten closest above `raw` (> 0).
fn nice_step(raw: f64) -> f64 {
    let raw = if raw.is_finite() && raw > 0.0 {
        raw
    } else {
        1.0
    };
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// A tick label with as many decimals as the step needs.
fn format_tick(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10()).ceil() as usize
    };
    // Snap rounding residue (e.g. -1e-17) to zero so it prints "0", not "-0".
    let v = if v.abs() < 1e-9 * step { 0.0 } else { v };
    format!("{v:.decimals$}")
}

/// Escapes the five XML special characters.
fn xml(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

/// Renders `panels` side by side with a legend of `legend` names (colour `i` for name `i`) on
/// the right. Returns a standalone SVG document.
pub fn figure(panels: &[Panel], legend: &[String]) -> String {
    let width = panels.len().max(1) as f64 * PANEL_W + LEGEND_W;
    let height = PANEL_H;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r#"<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>"#
    );
    for (p, panel) in panels.iter().enumerate() {
        draw_panel(&mut out, panel, p as f64 * PANEL_W);
    }
    let lx = panels.len() as f64 * PANEL_W + 8.0;
    for (i, name) in legend.iter().enumerate() {
        let y = MARGIN_T + 10.0 + 20.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{lx}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="2.5"/><text x="{}" y="{}">{}</text>"#,
            lx + 24.0,
            colour(i),
            lx + 30.0,
            y + 4.0,
            xml(name)
        );
    }
    out.push_str("</svg>\n");
    out
}

fn draw_panel(out: &mut String, panel: &Panel, x0: f64) {
    let (left, top) = (x0 + MARGIN_L, MARGIN_T);
    let (w, h) = (PANEL_W - MARGIN_L - MARGIN_R, PANEL_H - MARGIN_T - MARGIN_B);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14" font-weight="bold">{}</text>"#,
        left + w / 2.0,
        xml(&panel.title)
    );
    let _ = writeln!(
        out,
        r##"<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#333"/>"##
    );
    let all = || panel.series.iter().flat_map(|s| s.points.iter());
    let xa = Axis::fit(panel.x_scale, all().map(|p| p.0));
    let ya = Axis::fit(panel.y_scale, all().map(|p| p.1));
    let (Some(xa), Some(ya)) = (xa, ya) else {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">no data</text>"#,
            left + w / 2.0,
            top + h / 2.0
        );
        return;
    };
    let px = |v: f64| left + xa.frac(v) * w;
    let py = |v: f64| top + (1.0 - ya.frac(v)) * h;
    for (v, label) in xa.ticks() {
        let x = px(v);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{}" stroke="#ddd"/><line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#333"/><text x="{x:.1}" y="{}" text-anchor="middle">{label}</text>"##,
            top + h,
            top + h,
            top + h + 5.0,
            top + h + 18.0
        );
    }
    for (v, label) in ya.ticks() {
        let y = py(v);
        let _ = writeln!(
            out,
            r##"<line x1="{left}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><line x1="{}" y1="{y:.1}" x2="{left}" y2="{y:.1}" stroke="#333"/><text x="{}" y="{:.1}" text-anchor="end">{label}</text>"##,
            left + w,
            left - 5.0,
            left - 8.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        left + w / 2.0,
        top + h + 40.0,
        xml(&panel.x_label)
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle" transform="rotate(-90 {} {})">{}</text>"#,
        x0 + 16.0,
        top + h / 2.0,
        x0 + 16.0,
        top + h / 2.0,
        xml(&panel.y_label)
    );
    for (i, s) in panel.series.iter().enumerate() {
        // Undrawable points split the curve into separate polylines.
        let mut pieces: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
        for &(x, y) in &s.points {
            if drawable(xa.scale, x) && drawable(ya.scale, y) {
                if let Some(last) = pieces.last_mut() {
                    last.push((px(x), py(y)));
                }
            } else if pieces.last().is_some_and(|p| !p.is_empty()) {
                pieces.push(Vec::new());
            }
        }
        for piece in pieces.iter().filter(|p| !p.is_empty()) {
            let pts: Vec<String> = piece
                .iter()
                .map(|(x, y)| format!("{x:.1},{y:.1}"))
                .collect();
            let _ = writeln!(
                out,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.6" stroke-opacity="0.9" points="{}"/>"#,
                colour(i),
                pts.join(" ")
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_cover_the_range() {
        let a = Axis::fit(Scale::Linear, [0.13, 0.97].into_iter()).unwrap();
        let t = a.ticks();
        assert!(t.first().unwrap().0 <= 0.13 && t.last().unwrap().0 >= 0.97);
        let l = Axis::fit(Scale::Log, [3e-4, 2.0].into_iter()).unwrap();
        assert_eq!((l.lo, l.hi), (1e-4, 10.0));
        assert_eq!(l.ticks().len(), 6);
    }

    #[test]
    fn figure_is_well_formed() {
        let s = Series {
            name: "a<b".into(),
            points: vec![(1.0, 0.5), (2.0, f64::NAN), (3.0, 0.7), (4.0, 0.8)],
        };
        let panel = Panel {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            x_scale: Scale::Linear,
            y_scale: Scale::Log,
            series: vec![s],
        };
        let svg = figure(&[panel.clone(), panel], &["a<b".into()]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a&lt;b"));
        // The NaN splits each panel's curve in two polylines.
        assert_eq!(svg.matches("<polyline").count(), 4);
    }
}
