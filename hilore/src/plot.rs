//! Small self-contained SVG charts (lines and scatter, axes with ticks, legend). No fonts
//! or system libraries: the SVG names a generic sans-serif family and the viewer renders
//! it.

use std::fmt::Write as _;
use std::path::Path;

/// One named series.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// Points in data coordinates.
    pub points: Vec<(f64, f64)>,
    /// Connect the points with a line (else markers only).
    pub line: bool,
    /// Draw markers.
    pub markers: bool,
}

impl Series {
    pub fn scatter(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series {
            name: name.into(),
            points,
            line: false,
            markers: true,
        }
    }

    pub fn line(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series {
            name: name.into(),
            points,
            line: true,
            markers: true,
        }
    }

    pub fn plain_line(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series {
            name: name.into(),
            points,
            line: true,
            markers: false,
        }
    }
}

/// Axis scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    Linear,
    Log,
}

/// A chart.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Vertical reference lines (x, label).
    pub vlines: Vec<(f64, String)>,
    /// Draw y = x.
    pub diagonal: bool,
    pub x_scale: Scale,
    pub y_scale: Scale,
}

impl Chart {
    pub fn new(title: &str, x_label: &str, y_label: &str) -> Self {
        Chart {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            series: Vec::new(),
            vlines: Vec::new(),
            diagonal: false,
            x_scale: Scale::Linear,
            y_scale: Scale::Linear,
        }
    }
}

const COLORS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(1e-300);
    let raw = span / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| span / s <= n as f64)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut v = Vec::new();
    while t <= hi + step * 1e-9 {
        v.push(t);
        t += step;
    }
    v
}

fn fmt_tick(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e5).contains(&a) {
        format!("{v:.1e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.2}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    } else {
        format!("{v:.4}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

impl Chart {
    /// Renders the chart as SVG text.
    pub fn to_svg(&self) -> String {
        let (w, h) = (900.0, 560.0);
        let (ml, mr, mt, mb) = (90.0, 230.0, 50.0, 70.0);
        let pw = w - ml - mr;
        let ph = h - mt - mb;
        let tx = |v: f64, s: Scale| {
            if s == Scale::Log {
                v.max(1e-300).log10()
            } else {
                v
            }
        };
        let pts: Vec<(f64, f64)> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().copied())
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .filter(|p| {
                (self.x_scale == Scale::Linear || p.0 > 0.0)
                    && (self.y_scale == Scale::Linear || p.1 > 0.0)
            })
            .map(|(x, y)| (tx(x, self.x_scale), tx(y, self.y_scale)))
            .collect();
        let (mut x0, mut x1, mut y0, mut y1) = pts.iter().fold(
            (
                f64::INFINITY,
                f64::NEG_INFINITY,
                f64::INFINITY,
                f64::NEG_INFINITY,
            ),
            |(a, b, c, d), p| (a.min(p.0), b.max(p.0), c.min(p.1), d.max(p.1)),
        );
        for (x, _) in &self.vlines {
            let x = tx(*x, self.x_scale);
            x0 = x0.min(x);
            x1 = x1.max(x);
        }
        if !x0.is_finite() {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if self.diagonal {
            let lo = x0.min(y0);
            let hi = x1.max(y1);
            (x0, y0, x1, y1) = (lo, lo, hi, hi);
        }
        let pad = |a: f64, b: f64| {
            let d = if b > a {
                (b - a) * 0.06
            } else {
                a.abs().max(1.0) * 0.1
            };
            (a - d, b + d)
        };
        let (x0, x1) = pad(x0, x1);
        let (y0, y1) = pad(y0, y1);
        let sx = |v: f64| ml + (v - x0) / (x1 - x0) * pw;
        let sy = |v: f64| mt + ph - (v - y0) / (y1 - y0) * ph;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="DejaVu Sans, Arial, sans-serif" font-size="13">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="28" font-size="17" text-anchor="middle">{}</text>"#,
            ml + pw / 2.0,
            esc(&self.title)
        );
        let _ = writeln!(
            s,
            r#"<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        let ticks = |lo: f64, hi: f64, scale: Scale| -> Vec<(f64, String)> {
            if scale == Scale::Log {
                let mut v = Vec::new();
                let mut e = lo.floor();
                while e <= hi.ceil() {
                    if e >= lo && e <= hi {
                        v.push((e, format!("1e{e:.0}")));
                    }
                    e += 1.0;
                }
                if v.len() < 2 {
                    return nice_ticks(lo, hi, 5)
                        .into_iter()
                        .map(|t| (t, fmt_tick(10f64.powf(t))))
                        .collect();
                }
                v
            } else {
                nice_ticks(lo, hi, 6)
                    .into_iter()
                    .map(|t| (t, fmt_tick(t)))
                    .collect()
            }
        };
        for (t, label) in ticks(x0, x1, self.x_scale) {
            let x = sx(t);
            let _ = writeln!(
                s,
                r##"<line x1="{x}" y1="{}" x2="{x}" y2="{}" stroke="#ddd"/><text x="{x}" y="{}" text-anchor="middle">{label}</text>"##,
                mt,
                mt + ph,
                mt + ph + 18.0
            );
        }
        for (t, label) in ticks(y0, y1, self.y_scale) {
            let y = sy(t);
            let _ = writeln!(
                s,
                r##"<line x1="{ml}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{label}</text>"##,
                ml + pw,
                ml - 6.0,
                y + 4.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            ml + pw / 2.0,
            h - 22.0,
            esc(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text x="22" y="{}" text-anchor="middle" transform="rotate(-90 22 {})">{}</text>"#,
            mt + ph / 2.0,
            mt + ph / 2.0,
            esc(&self.y_label)
        );
        if self.diagonal {
            let lo = x0.max(y0);
            let hi = x1.min(y1);
            let _ = writeln!(
                s,
                r##"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#999" stroke-dasharray="6 4"/>"##,
                sx(lo),
                sy(lo),
                sx(hi),
                sy(hi)
            );
        }
        for (x, label) in &self.vlines {
            let xx = sx(tx(*x, self.x_scale));
            let _ = writeln!(
                s,
                r##"<line x1="{xx}" y1="{mt}" x2="{xx}" y2="{}" stroke="#555" stroke-dasharray="3 3"/><text x="{}" y="{}" font-size="11" fill="#555">{}</text>"##,
                mt + ph,
                xx + 4.0,
                mt + 14.0,
                esc(label)
            );
        }
        for (i, ser) in self.series.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            let p: Vec<(f64, f64)> = ser
                .points
                .iter()
                .filter(|p| p.0.is_finite() && p.1.is_finite())
                .filter(|p| {
                    (self.x_scale == Scale::Linear || p.0 > 0.0)
                        && (self.y_scale == Scale::Linear || p.1 > 0.0)
                })
                .map(|&(x, y)| (sx(tx(x, self.x_scale)), sy(tx(y, self.y_scale))))
                .collect();
            if ser.line && p.len() > 1 {
                let d: Vec<String> = p.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
                let _ = writeln!(
                    s,
                    r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
                    d.join(" ")
                );
            }
            if ser.markers {
                for (x, y) in &p {
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{x:.1}" cy="{y:.1}" r="4" fill="{c}" fill-opacity="0.8"/>"#
                    );
                }
            }
            let ly = mt + 10.0 + 20.0 * i as f64;
            let lx = ml + pw + 15.0;
            let _ = writeln!(
                s,
                r#"<rect x="{lx}" y="{}" width="14" height="10" fill="{c}"/><text x="{}" y="{}">{}</text>"#,
                ly - 4.0,
                lx + 20.0,
                ly + 6.0,
                esc(&ser.name)
            );
        }
        s.push_str("</svg>\n");
        s
    }

    /// Writes the chart to `path` (SVG).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        hilore_models::atomic::write_bytes_atomic(path, self.to_svg().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_series_and_escapes() {
        let mut c = Chart::new("a < b", "x", "y");
        c.series
            .push(Series::line("s&t", vec![(0.0, 1.0), (1.0, 2.0)]));
        c.vlines.push((0.5, "budget".into()));
        let svg = c.to_svg();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("a &lt; b") && svg.contains("s&amp;t"));
        assert!(svg.contains("<polyline"));
        assert_eq!(
            nice_ticks(0.0, 10.0, 5),
            vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        );
    }
}
