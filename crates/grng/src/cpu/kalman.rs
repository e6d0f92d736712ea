//! Diagonal R-Kalman step (docs/math.md §3 steps 1 and 3–7) on the host.
//!
//! The parameter count `n` is large (10⁵–10⁷) and the observation size `d_o` small, so the
//! step is two streaming passes over the row-major `d_o x n` Jacobian `H` plus `d_o x d_o`
//! algebra in `f64`:
//!
//! 1. `P = H diag(σ⁻) Hᵀ` — a rayon reduction over column chunks, summed in `f64`; never
//!    anything `n x n`.
//! 2. `R ← βR + (1−β)(vvᵀ + P)`, `R̃`, `S = P + R̃ + δI = LLᵀ`, `w = S⁻¹v`, all `f64`.
//! 3. One fused pass: with `z_i = L⁻¹h_i` (`h_i` the column `i` of `H`),
//!    `μ_i ← μ_i + σ⁻_i h_iᵀw` and `σ_i ← σ⁻_i (1 − σ⁻_i ‖z_i‖²)`, floored.
//!
//! Both passes read `H` in chunks of `CHUNK` (256) columns: every row segment of a chunk is
//! contiguous, so the column loop vectorizes and a chunk (`d_o · CHUNK` elements) stays in L1.
//! `H` is `f32` or `bf16` (any [`Element`]); a `bf16` entry is widened where it is used (exact),
//! never through a widened copy of the matrix, and every product and sum is `f32`/`f64` as
//! for an `f32` `H`.

use rayon::prelude::*;

use crate::cpu::elementwise::dot_chunk;
use crate::element::Element;
use crate::error::{check_len, Error, Result};
use crate::mat::MatRef;
use crate::params::kalman::{KalmanInfo, KalmanOptions, RForm};
use crate::shape::{check_h_shape, check_kalman_lens, kalman_lens};

/// Columns of `H` per work item (a row segment of 1 KiB).
const CHUNK: usize = 256;

/// The buffers of one step: the prior state (read) and the posterior (written).
///
/// `n` is the parameter count (columns of `H`), `d_o` the observation size (rows of `H`).
#[derive(Debug)]
pub struct KalmanIo<'a> {
    /// Mean `μ`, length `n`.
    pub mu: &'a [f32],
    /// Diagonal covariance `σ`, length `n`, every entry finite and `> 0`.
    pub sigma: &'a [f32],
    /// Observation-noise estimate `R`, row-major `d_o x d_o`, symmetric PSD (its symmetric
    /// part `(R + Rᵀ)/2` is what is used).
    pub r: &'a [f32],
    /// Posterior mean, length `n`.
    pub mu_out: &'a mut [f32],
    /// Posterior diagonal covariance, length `n`.
    pub sigma_out: &'a mut [f32],
    /// Updated `R`, `d_o x d_o` (exactly symmetric).
    pub r_out: &'a mut [f32],
}

/// One R-Kalman step: reads `io.mu`, `io.sigma`, `io.r`, the `d_o x n` Jacobian `h`
/// (row-major, `∂ŷ/∂μ`) and the innovation `v = y − ŷ` (length `d_o`); writes the posterior
/// into `io.mu_out`, `io.sigma_out`, `io.r_out`.
///
/// With `q` = `opts.process_noise` and `σ⁻ = σ + q`:
/// `P = H diag(σ⁻) Hᵀ`, `R ← βR + (1−β)(vvᵀ + P)`, `R̃ = R(I + ρR)⁻¹` ([`RForm::Exact`], a
/// Cholesky solve with the SPD `I + ρR`) or `R(I − ρR)` ([`RForm::Neumann`]),
/// `S = P + R̃ + δI` with `δ` = `opts.jitter · mean(diag S)` (or `opts.jitter` when that
/// diagonal is all zero), multiplied by 10 up to `opts.max_jitter_escalations` times while
/// the Cholesky factorization fails; then `μ ← μ + σ⁻ ⊙ Hᵀ S⁻¹ v` and
/// `σ_i ← max(σ⁻_i (1 − σ⁻_i h_iᵀS⁻¹h_i), min(floor, σ⁻_i))`. The floor term never exceeds
/// `σ⁻_i`, so with `q = 0` no `σ_i` grows, and every `σ_i` stays `> 0`.
///
/// The inputs are never modified. On error the outputs hold unspecified values, so a caller
/// that wants its state unchanged on failure (as [`crate::Device::kalman_step`] does) passes
/// spare buffers and swaps them in on success.
///
/// # Errors
/// - [`Error::Shape`]: `d_o = 0` or `n = 0`, or a buffer length disagrees with `h`;
/// - [`Error::Value`]: bad options, `σ_i ≤ 0`, or finite inputs so large that `P` overflows;
/// - [`Error::NonFinite`]: NaN/Inf in `μ`, `σ`, `R`, `H`, `v`, or in the posterior;
/// - [`Error::NotSpd`]: `I + ρR` (exact form) or `S` after every jitter escalation is not SPD.
pub fn kalman_step<T: Element>(
    io: KalmanIo<'_>,
    h: MatRef<'_, T>,
    innovation: &[f32],
    opts: &KalmanOptions,
) -> Result<KalmanInfo> {
    const OP: &str = "cpu::kalman_step";
    opts.validate(OP)?;
    let (d_o, n) = check_h_shape(OP, h.shape())?;
    check_kalman_lens(OP, (d_o, n), kalman_lens!(io, innovation))?;
    check_len(OP, "r_out", io.r_out.len(), d_o * d_o)?;
    crate::error::check_finite(OP, "mu", io.mu)?;
    crate::error::check_finite(OP, "sigma", io.sigma)?;
    crate::error::check_finite(OP, "r", io.r)?;
    crate::error::check_finite(OP, "innovation", innovation)?;
    if let Some(i) = io.sigma.iter().position(|&s| s <= 0.0) {
        return Err(Error::Value {
            op: OP,
            arg: "sigma",
            value: io.sigma[i] as f64,
            expected: "every entry > 0",
        });
    }
    let q = opts.process_noise;

    // Pass 1. H's finiteness is checked here, not by a pass of its own: with every σ⁻_i > 0
    // a NaN/Inf in row j of H makes P_jj non-finite.
    let p = weighted_gram(h, io.sigma, q);
    if p.iter().any(|x| !x.is_finite()) {
        return Err(nonfinite_h(OP, h));
    }

    let v: Vec<f64> = innovation.iter().map(|&x| x as f64).collect();
    let beta = opts.beta as f64;
    let mut r_new = vec![0.0f64; d_o * d_o];
    for j in 0..d_o {
        for k in 0..d_o {
            let r_sym = 0.5 * (io.r[j * d_o + k] as f64 + io.r[k * d_o + j] as f64);
            r_new[j * d_o + k] = beta * r_sym + (1.0 - beta) * (v[j] * v[k] + p[j * d_o + k]);
        }
    }
    let r_tilde = regularized_r(&r_new, d_o, opts.rho as f64, opts.r_form, OP)?;
    let mut s: Vec<f64> = p.iter().zip(&r_tilde).map(|(a, b)| a + b).collect();
    symmetrize(&mut s, d_o);

    let mean_diag = (0..d_o).map(|j| s[j * d_o + j]).sum::<f64>() / d_o as f64;
    let scale = if mean_diag > 0.0 { mean_diag } else { 1.0 };
    let mut delta = opts.jitter as f64 * scale;
    let mut escalations = 0;
    let l = loop {
        let mut sj = s.clone();
        (0..d_o).for_each(|j| sj[j * d_o + j] += delta);
        match cholesky_f64(&sj, d_o) {
            Ok(l) => break l,
            Err((index, pivot)) => {
                if escalations == opts.max_jitter_escalations {
                    return Err(Error::NotSpd {
                        op: OP,
                        index,
                        pivot,
                    });
                }
                escalations += 1;
                delta *= 10.0;
            }
        }
    };
    let l_inv = lower_inverse(&l, d_o);
    // w = S⁻¹ v = L⁻ᵀ (L⁻¹ v).
    let y: Vec<f64> = (0..d_o)
        .map(|i| (0..=i).map(|j| l_inv[i * d_o + j] * v[j]).sum())
        .collect();
    let w: Vec<f64> = (0..d_o)
        .map(|j| (j..d_o).map(|i| l_inv[i * d_o + j] * y[i]).sum())
        .collect();
    let nis: f64 = y.iter().map(|x| x * x).sum();

    // Pass 2 (fused μ and σ update).
    let l_inv32: Vec<f32> = l_inv.iter().map(|&x| x as f32).collect();
    let w32: Vec<f32> = w.iter().map(|&x| x as f32).collect();
    let KalmanIo {
        mu,
        sigma,
        mu_out,
        sigma_out,
        r_out,
        ..
    } = io;
    let prior = Prior {
        mu,
        sigma,
        q,
        floor: opts.sigma_floor,
    };
    let floored = posterior_pass(prior, h, &l_inv32, &w32, mu_out, sigma_out);
    crate::error::check_finite(OP, "posterior mu", mu_out)?;
    crate::error::check_finite(OP, "posterior sigma", sigma_out)?;
    for (o, &x) in r_out.iter_mut().zip(&r_new) {
        *o = x as f32;
    }
    crate::error::check_finite(OP, "posterior r", r_out)?;
    Ok(KalmanInfo {
        jitter: delta as f32,
        jitter_escalations: escalations,
        sigma_floored: floored,
        nis: nis as f32,
    })
}

/// `P = H diag(σ + q) Hᵀ` (`d_o x d_o`, row-major, symmetric) by a reduction over column
/// chunks: per chunk the rows `g_j = √σ⁻ ⊙ H[j, chunk]` are formed once in `f32`, and
/// `P = G Gᵀ` is summed in `f64` (products of two `f32` are exact there). As the Gram matrix
/// of one rounded `G` summed in `f64`, `P` is PSD to ~1e-16 relative even when rank-deficient
/// (`n < d_o`); forming `σ⁻ ⊙ h_j` and dotting with `h_k` in `f32` would leave negative
/// eigenvalues of ~1e-7·‖P‖, enough to make `I + ρR` indefinite for large `H`.
fn weighted_gram<T: Element>(h: MatRef<'_, T>, sigma: &[f32], q: f32) -> Vec<f64> {
    let (d_o, n) = h.shape();
    let chunks = n.div_ceil(CHUNK);
    let mut p = (0..chunks)
        .into_par_iter()
        .with_min_len(8)
        .fold(
            || (vec![0.0f64; d_o * d_o], vec![0.0f32; d_o * CHUNK]),
            |(mut acc, mut g), c| {
                let c0 = c * CHUNK;
                let c1 = (c0 + CHUNK).min(n);
                let w = c1 - c0;
                let mut root = [0.0f32; CHUNK];
                for (r, &s) in root.iter_mut().zip(&sigma[c0..c1]) {
                    *r = (s + q).sqrt();
                }
                for j in 0..d_o {
                    let hj = &h.row(j)[c0..c1];
                    for ((gi, &hv), &r) in g[j * CHUNK..j * CHUNK + w].iter_mut().zip(hj).zip(&root)
                    {
                        *gi = r * hv.to_f32();
                    }
                }
                for j in 0..d_o {
                    let gj = &g[j * CHUNK..j * CHUNK + w];
                    for k in j..d_o {
                        acc[j * d_o + k] += dot_chunk(gj, &g[k * CHUNK..k * CHUNK + w]);
                    }
                }
                (acc, g)
            },
        )
        .map(|(acc, _)| acc)
        .reduce(
            || vec![0.0f64; d_o * d_o],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                a
            },
        );
    for j in 0..d_o {
        for k in 0..j {
            p[j * d_o + k] = p[k * d_o + j];
        }
    }
    p
}

/// The prior of the update pass: `μ`, `σ`, the process noise and the `σ` floor.
#[derive(Clone, Copy)]
struct Prior<'a> {
    mu: &'a [f32],
    sigma: &'a [f32],
    q: f32,
    floor: f32,
}

/// The fused update pass; returns how many `σ_i` were set by the floor. `l_inv` is `L⁻¹`
/// (lower, row-major `d_o x d_o`) and `w = S⁻¹v`.
fn posterior_pass<T: Element>(
    prior: Prior<'_>,
    h: MatRef<'_, T>,
    l_inv: &[f32],
    w: &[f32],
    mu_out: &mut [f32],
    sigma_out: &mut [f32],
) -> usize {
    let d_o = h.rows();
    let Prior {
        mu,
        sigma,
        q,
        floor,
    } = prior;
    mu_out
        .par_chunks_mut(CHUNK)
        .zip(sigma_out.par_chunks_mut(CHUNK))
        .enumerate()
        .with_min_len(8)
        .map(|(c, (mu_c, sig_c))| {
            let c0 = c * CHUNK;
            let wd = mu_c.len();
            let mut t = [0.0f32; CHUNK];
            let mut zz = [0.0f32; CHUNK];
            let mut z = [0.0f32; CHUNK];
            let (t, zz, z) = (&mut t[..wd], &mut zz[..wd], &mut z[..wd]);
            for r in 0..d_o {
                let hr = &h.row(r)[c0..c0 + wd];
                let wr = w[r];
                t.iter_mut()
                    .zip(hr)
                    .for_each(|(ti, &hv)| *ti += wr * hv.to_f32());
                // z_r = Σ_{j ≤ r} L⁻¹[r][j] H[j, chunk]
                z.fill(0.0);
                for j in 0..=r {
                    let lrj = l_inv[r * d_o + j];
                    let hj = &h.row(j)[c0..c0 + wd];
                    z.iter_mut()
                        .zip(hj)
                        .for_each(|(zi, &hv)| *zi += lrj * hv.to_f32());
                }
                zz.iter_mut()
                    .zip(z.iter())
                    .for_each(|(a, &zi)| *a += zi * zi);
            }
            let mut floored = 0;
            for i in 0..wd {
                let sp = sigma[c0 + i] + q;
                mu_c[i] = mu[c0 + i] + sp * t[i];
                let post = sp * (1.0 - sp * zz[i]);
                let lo = floor.min(sp);
                // `!(post > lo)` also catches a NaN.
                sig_c[i] = if post > lo {
                    post
                } else {
                    floored += 1;
                    lo
                };
            }
            floored
        })
        .sum()
}

/// `R̃` from the updated `R` (both `d_o x d_o`, `f64`).
fn regularized_r(
    r: &[f64],
    d_o: usize,
    rho: f64,
    form: RForm,
    op: &'static str,
) -> Result<Vec<f64>> {
    if rho == 0.0 {
        return Ok(r.to_vec());
    }
    let mut out = match form {
        RForm::Neumann => {
            // R − ρR²
            let mut out = r.to_vec();
            for i in 0..d_o {
                for j in 0..d_o {
                    let rr: f64 = (0..d_o).map(|k| r[i * d_o + k] * r[k * d_o + j]).sum();
                    out[i * d_o + j] -= rho * rr;
                }
            }
            out
        }
        RForm::Exact => {
            // M = I + ρR is SPD for a PSD R; R and M commute, so R M⁻¹ = M⁻¹ R: solve M X = R.
            let mut m: Vec<f64> = r.iter().map(|x| rho * x).collect();
            (0..d_o).for_each(|j| m[j * d_o + j] += 1.0);
            let l = cholesky_f64(&m, d_o).map_err(|(index, pivot)| Error::NotSpd {
                op,
                index,
                pivot,
            })?;
            let l_inv = lower_inverse(&l, d_o);
            // M⁻¹ = L⁻ᵀ L⁻¹, then M⁻¹ R.
            let mut m_inv = vec![0.0f64; d_o * d_o];
            for i in 0..d_o {
                for j in 0..d_o {
                    m_inv[i * d_o + j] = (i.max(j)..d_o)
                        .map(|k| l_inv[k * d_o + i] * l_inv[k * d_o + j])
                        .sum();
                }
            }
            let mut out = vec![0.0f64; d_o * d_o];
            for i in 0..d_o {
                for j in 0..d_o {
                    out[i * d_o + j] = (0..d_o).map(|k| m_inv[i * d_o + k] * r[k * d_o + j]).sum();
                }
            }
            out
        }
    };
    symmetrize(&mut out, d_o);
    Ok(out)
}

/// `A ← (A + Aᵀ)/2` for a square row-major `f64` matrix.
fn symmetrize(a: &mut [f64], n: usize) {
    for i in 0..n {
        for j in 0..i {
            let m = 0.5 * (a[i * n + j] + a[j * n + i]);
            a[i * n + j] = m;
            a[j * n + i] = m;
        }
    }
}

/// Lower Cholesky factor of a small SPD `f64` matrix; `Err((index, pivot))` at the first
/// pivot that is not finite and positive.
fn cholesky_f64(a: &[f64], n: usize) -> std::result::Result<Vec<f64>, (usize, f64)> {
    let mut l = vec![0.0f64; n * n];
    for j in 0..n {
        let d = a[j * n + j] - (0..j).map(|k| l[j * n + k] * l[j * n + k]).sum::<f64>();
        if !(d > 0.0 && d.is_finite()) {
            return Err((j, d));
        }
        let djj = d.sqrt();
        l[j * n + j] = djj;
        for i in j + 1..n {
            let s = a[i * n + j] - (0..j).map(|k| l[i * n + k] * l[j * n + k]).sum::<f64>();
            l[i * n + j] = s / djj;
        }
    }
    Ok(l)
}

/// Inverse of a lower-triangular `f64` matrix with a positive diagonal (forward substitution
/// against the identity), lower-triangular itself.
fn lower_inverse(l: &[f64], n: usize) -> Vec<f64> {
    let mut inv = vec![0.0f64; n * n];
    for c in 0..n {
        for i in c..n {
            let rhs = if i == c { 1.0 } else { 0.0 };
            let s: f64 = (c..i).map(|k| l[i * n + k] * inv[k * n + c]).sum();
            inv[i * n + c] = (rhs - s) / l[i * n + i];
        }
    }
    inv
}

/// The error for a `P` that came out non-finite: the first NaN/Inf of `H`, or (all finite)
/// entries so large that `P` overflows.
fn nonfinite_h<T: Element>(op: &'static str, h: MatRef<'_, T>) -> Error {
    for j in 0..h.rows() {
        if let Some(i) = h.row(j).iter().position(|x| !x.to_f32().is_finite()) {
            return Error::NonFinite {
                op,
                arg: "h",
                index: j * h.cols() + i,
                value: h.at(j, i).to_f32(),
            };
        }
    }
    let max = (0..h.rows())
        .flat_map(|j| h.row(j).iter())
        .fold(0.0f32, |m, x| m.max(x.to_f32().abs()));
    Error::Value {
        op,
        arg: "h",
        value: max as f64,
        expected: "entries small enough that H diag(σ) Hᵀ is finite in f64",
    }
}
