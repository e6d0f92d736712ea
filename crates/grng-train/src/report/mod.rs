//! The main job's outputs: the summary table, the SVG figure (validation accuracy and
//! gradient norm vs iteration, the paper's Figures 1–2) and a CSV of the curves.

pub mod svg;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::train::{MethodResult, SweepPoint};
use grng::error::{Error, Result};

use svg::{Panel, Scale, Series};

/// A plain-text table: a header row, a rule, then the rows; columns padded to their widest
/// cell (counted in characters), the first column left-aligned and the others right-aligned.
pub fn text_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let cols = header.len();
    let width = |s: &str| s.chars().count();
    let mut w: Vec<usize> = header.iter().map(|h| width(h)).collect();
    for row in rows {
        for (j, cell) in row.iter().enumerate().take(cols) {
            w[j] = w[j].max(width(cell));
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| -> String {
        let mut s = String::new();
        for (j, cell) in cells.enumerate().take(cols) {
            let pad = " ".repeat(w[j].saturating_sub(width(cell)));
            if j == 0 {
                let _ = write!(s, "{cell}{pad}");
            } else {
                let _ = write!(s, "  {pad}{cell}");
            }
        }
        s.trim_end().to_string()
    };
    let mut out = line(&mut header.iter().copied());
    out.push('\n');
    out.push_str(&"-".repeat(w.iter().sum::<usize>() + 2 * cols.saturating_sub(1)));
    out.push('\n');
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
        out.push('\n');
    }
    out
}

/// A duration in seconds with a readable unit (`812 µs`, `3.4 ms`, `1.25 s`); `—` if NaN.
pub fn fmt_seconds(s: f64) -> String {
    if !s.is_finite() {
        "—".into()
    } else if s < 1e-3 {
        format!("{:.0} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// The summary table of a run: optimizer, test accuracy, final training loss, steps and
/// training time to reach `target_acc` on the validation split (`—` if never), median step
/// time, final full-batch gradient norm, and the hyperparameters.
pub fn summary_table(results: &[MethodResult], target_acc: f32) -> String {
    let to_target = format!("steps to {:.0}%", 100.0 * target_acc);
    let time_target = format!("time to {:.0}%", 100.0 * target_acc);
    let header = [
        "optimizer",
        "test acc",
        "train loss",
        to_target.as_str(),
        time_target.as_str(),
        "median step",
        "grad norm",
        "steps",
        "hyperparameters",
    ];
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            let last = r.last();
            let failed = r.failure.is_some();
            vec![
                r.config.method.label().to_string(),
                if failed {
                    "failed".into()
                } else {
                    format!("{:.2}%", 100.0 * r.test_acc)
                },
                last.map_or("—".into(), |p| format!("{:.4}", p.train_loss)),
                r.steps_to_target.map_or("—".into(), |s| s.to_string()),
                r.time_to_target.map_or("—".into(), fmt_seconds),
                fmt_seconds(r.median_step_time),
                last.map_or("—".into(), |p| format!("{:.2e}", p.grad_norm)),
                r.steps.to_string(),
                r.config.describe(),
            ]
        })
        .collect();
    let mut out = text_table(&header, &rows);
    for r in results {
        if let Some(f) = &r.failure {
            let _ = writeln!(out, "{} stopped early: {f}", r.config.method.label());
        }
    }
    out
}

/// The two-panel figure: validation accuracy vs iteration and full-batch gradient norm vs
/// iteration (log y), both with a log x axis — the Kalman methods take one sample per step, so
/// their runs are ~30x longer in iterations than the batch methods'.
pub fn figure(results: &[MethodResult]) -> String {
    let series = |f: &dyn Fn(&crate::train::CurvePoint) -> f64| -> Vec<Series> {
        results
            .iter()
            .map(|r| Series {
                name: r.config.method.label().into(),
                // Step 0 has no place on a log axis: iterations are 1-based there.
                points: r
                    .curve
                    .iter()
                    .map(|p| (p.step.max(1) as f64, f(p)))
                    .collect(),
            })
            .collect()
    };
    let panels = [
        Panel {
            title: "Validation accuracy".into(),
            x_label: "iteration (log scale)".into(),
            y_label: "validation accuracy".into(),
            x_scale: Scale::Log,
            y_scale: Scale::Linear,
            series: series(&|p| p.val_acc as f64),
        },
        Panel {
            title: "Gradient norm (full training set)".into(),
            x_label: "iteration (log scale)".into(),
            y_label: "‖∇L‖ (log scale)".into(),
            x_scale: Scale::Log,
            y_scale: Scale::Log,
            series: series(&|p| p.grad_norm as f64),
        },
    ];
    let legend: Vec<String> = results
        .iter()
        .map(|r| r.config.method.label().to_string())
        .collect();
    svg::figure(&panels, &legend)
}

/// The curves as CSV: `optimizer,step,epoch,val_acc,train_loss,grad_norm,train_time_s`.
pub fn curves_csv(results: &[MethodResult]) -> String {
    let mut out = String::from("optimizer,step,epoch,val_acc,train_loss,grad_norm,train_time_s\n");
    for r in results {
        for p in &r.curve {
            let _ = writeln!(
                out,
                "{},{},{:.6},{:.6},{:.6e},{:.6e},{:.6}",
                r.config.method.key(),
                p.step,
                p.epoch,
                p.val_acc,
                p.train_loss,
                p.grad_norm,
                p.train_time
            );
        }
    }
    out
}

/// Creates the output folder `dir` (and its parents) and checks that a file can be written
/// in it, so a run that cannot save its results fails before any training, naming the path.
///
/// # Errors
/// [`grng::Error::Io`] naming the folder or the probe file.
pub fn prepare_output_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let probe = dir.join(format!(".grng-write-probe.{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| Error::io(&probe, e))?;
    std::fs::remove_file(&probe).map_err(|e| Error::io(&probe, e))
}

/// Writes `curves.svg` and `curves.csv` into `dir` (created if missing); returns their paths.
///
/// # Errors
/// [`grng::Error::Io`] naming the folder or the file that cannot be written.
pub fn write_outputs(dir: &Path, results: &[MethodResult]) -> Result<(PathBuf, PathBuf)> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let svg_path = dir.join("curves.svg");
    let csv_path = dir.join("curves.csv");
    std::fs::write(&svg_path, figure(results)).map_err(|e| Error::io(&svg_path, e))?;
    std::fs::write(&csv_path, curves_csv(results)).map_err(|e| Error::io(&csv_path, e))?;
    Ok((svg_path, csv_path))
}

/// The sweep's table for one method: one row per grid point (knob values, final validation
/// accuracy, final training loss, steps to target), the chosen one marked `*`.
pub fn sweep_table(points: &[SweepPoint], chosen: Option<usize>) -> String {
    let Some(first) = points.first() else {
        return String::new();
    };
    let knobs: Vec<&str> = first.values.iter().map(|(k, _)| k.name()).collect();
    let mut header: Vec<&str> = vec!["method"];
    header.extend(&knobs);
    header.extend(["val acc", "train loss", "steps to target", ""]);
    let rows: Vec<Vec<String>> = points
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut row = vec![p.result.config.method.label().to_string()];
            row.extend(p.values.iter().map(|(_, v)| format!("{v}")));
            row.push(if p.result.failure.is_some() {
                "failed".into()
            } else {
                format!("{:.2}%", 100.0 * p.val_acc())
            });
            row.push(format!("{:.4}", p.train_loss()));
            row.push(
                p.result
                    .steps_to_target
                    .map_or("—".into(), |s| s.to_string()),
            );
            row.push(if Some(i) == chosen {
                "*".into()
            } else {
                String::new()
            });
            row
        })
        .collect();
    let mut out = text_table(&header, &rows);
    for p in points {
        if let Some(f) = &p.result.failure {
            let values: Vec<String> = p
                .values
                .iter()
                .map(|(k, v)| format!("{}={v}", k.name()))
                .collect();
            let _ = writeln!(out, "  failed at {}: {f}", values.join(" "));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() {
        let t = text_table(
            &["a", "bb"],
            &[vec!["xyz".into(), "1".into()], vec!["q".into(), "—".into()]],
        );
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "a    bb");
        assert_eq!(lines[1], "-------");
        assert_eq!(lines[2], "xyz   1");
        assert_eq!(lines[3], "q     —");
    }

    #[test]
    fn seconds_pick_a_unit() {
        assert_eq!(fmt_seconds(2.5e-4), "250 µs");
        assert_eq!(fmt_seconds(0.0123), "12.3 ms");
        assert_eq!(fmt_seconds(3.0), "3.00 s");
        assert_eq!(fmt_seconds(f64::NAN), "—");
    }
}
