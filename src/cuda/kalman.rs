//! Launcher of `kernels/kalman.cu`: one diagonal R-Kalman step (SPEC §3 steps 3–7) on
//! [`Device::Emulated`] or [`Device::Cuda`], with the semantics of
//! [`crate::cpu::kalman::kalman_step`] (same arithmetic, jitter escalation, floor and errors).
//!
//! Four kernels are queued back to back — weighted Gram partials over column chunks, their
//! deterministic reduction, the single-block `d_o x d_o` solve (R EMA, R̃, Cholesky of `S`
//! with in-kernel jitter escalation, `L⁻¹`, `w = S⁻¹v`) and one fused streaming pass writing
//! the posterior `μ`, `σ` — and the host reads one status buffer at the end: the only
//! synchronization of the step. Inputs are validated inside the passes that read them
//! anyway (σ by the Gram pass, μ by the update pass, R and v by the solve), and the update
//! runs only when the solve succeeded; the posterior goes to the caller's output buffers
//! only, so a caller that swaps them in on success (as [`Device::kalman_step`] does) keeps
//! its state unchanged on any error.
//!
//! The solve runs in one block with `3 d_o² + 2 d_o` doubles of shared memory, hence the
//! limit [`MAX_D_O`] = 64 (96 KiB); larger observations are an [`Error::Shape`].

use super::elementwise::to_i32;
use super::launch::{kernel, launch, KernelArgs, LaunchConfig};
use crate::device::{Device, Matrix};
use crate::error::{check_len, check_shape, Error, Result};
use crate::params::kalman::{KalmanInfo, KalmanOptions, RForm};

kernel!(pub(crate) GRAM_PARTIAL = KALMAN::kalman_gram_partial;);
kernel!(pub(crate) GRAM_REDUCE = KALMAN::kalman_gram_reduce;);
kernel!(pub(crate) SOLVE = KALMAN::kalman_solve;);
kernel!(pub(crate) UPDATE_D8 = KALMAN::kalman_update_d8;);
kernel!(pub(crate) UPDATE_D16 = KALMAN::kalman_update_d16;);
kernel!(pub(crate) UPDATE_D32 = KALMAN::kalman_update_d32;);
kernel!(pub(crate) UPDATE_D64 = KALMAN::kalman_update_d64;);

/// Largest observation size `d_o` of the GPU step (the single-block solve's shared memory).
pub const MAX_D_O: usize = 64;
/// Threads per block of every Kalman kernel (`KAL_THREADS`).
const THREADS: u32 = 256;
/// Grid cap of the Gram pass: at most this many partials per entry. With the chunk width it
/// depends on `n` and `d_o` only, so the summation order is device-independent.
const GRAM_BLOCKS: usize = 1024;
/// Grid cap of the update pass (grid-stride above).
const UPDATE_BLOCKS: usize = 4096;
/// "No bad index" (`KAL_NONE`).
const NONE: i32 = i32::MAX;
/// Float offset of the int slots in the status buffer (`KAL_ISTAT`); the f64 values live at
/// the buffer's 8-byte aligned start, before it.
const ISTAT: usize = 10;
/// Int slots (`KAL_S_*`).
const S_MU: usize = 0;
const S_SIGMA: usize = 1;
const S_R: usize = 2;
const S_INNOV: usize = 3;
const S_SIGMA_POS: usize = 4;
const S_P: usize = 5;
const S_M_SPD: usize = 6;
const S_S_SPD: usize = 7;
const S_ESC: usize = 8;
const S_FLOORED: usize = 9;
const S_POST_MU: usize = 10;
const S_POST_SIGMA: usize = 11;
const S_POST_R: usize = 12;
const ISLOTS: usize = 16;

/// The buffers of one step, all on the launch's device: the prior (read) and the posterior
/// (written; every element, whatever they held). Shapes: `mu`, `sigma`, `mu_out`,
/// `sigma_out` are `n x 1`, `r` and `r_out` `d_o x d_o` (row-major).
#[derive(Debug)]
pub struct KalmanBuffers<'a> {
    /// Mean `μ`.
    pub mu: &'a Matrix,
    /// Diagonal covariance `σ`, every entry finite and `> 0`.
    pub sigma: &'a Matrix,
    /// Observation-noise estimate `R` (its symmetric part is used).
    pub r: &'a Matrix,
    /// Posterior mean.
    pub mu_out: &'a mut Matrix,
    /// Posterior diagonal covariance.
    pub sigma_out: &'a mut Matrix,
    /// Updated `R` (exactly symmetric).
    pub r_out: &'a mut Matrix,
}

/// One R-Kalman step on `dev` for the `d_o x n` Jacobian `h` (row-major) and the innovation
/// `v = y − ŷ` (`d_o x 1`): reads `io.mu`, `io.sigma`, `io.r`, writes the posterior into
/// `io.mu_out`, `io.sigma_out`, `io.r_out`. Arithmetic, options and errors are those of
/// [`crate::cpu::kalman::kalman_step`]; the inputs are never modified, and on error the
/// outputs hold unspecified values. `opts` are not validated here
/// ([`crate::Device::kalman_step`] does).
///
/// # Errors
/// As the CPU step ([`Error::Shape`], [`Error::Value`], [`Error::NonFinite`],
/// [`Error::NotSpd`]), plus [`Error::Shape`] for `d_o > MAX_D_O`, [`Error::Value`] for
/// `d_o · n ≥ 2³¹`, [`Error::DeviceMismatch`] and device errors.
pub fn kalman_step(
    dev: &Device,
    io: KalmanBuffers<'_>,
    h: &Matrix,
    innovation: &Matrix,
    opts: &KalmanOptions,
) -> Result<KalmanInfo> {
    const OP: &str = "cuda::kalman_step";
    // Memory safety only (the options, shapes and finiteness are the op's,
    // `Device::kalman_step`): every buffer against the d_o, n the kernels index by, d_o within
    // their fixed-size solve, d_o·n within their ints.
    let (d_o, n) = h.shape();
    if d_o == 0 || n == 0 || d_o > MAX_D_O {
        return Err(Error::Shape {
            op: OP,
            arg: "h",
            expected: format!("d_o x n with 1 <= d_o <= {MAX_D_O} and n >= 1"),
            got: format!("{d_o}x{n}"),
        });
    }
    check_len(OP, "mu", io.mu.len(), n)?;
    check_len(OP, "sigma", io.sigma.len(), n)?;
    check_len(OP, "r", io.r.len(), d_o * d_o)?;
    check_len(OP, "innovation", innovation.len(), d_o)?;
    check_len(OP, "mu_out", io.mu_out.len(), n)?;
    check_len(OP, "sigma_out", io.sigma_out.len(), n)?;
    check_shape(OP, "r_out", io.r_out.shape(), (d_o, d_o))?;
    to_i32(OP, "h", d_o * n)?; // every index of h fits the kernels' int
    let (d, npairs) = (d_o as i32, d_o * (d_o + 1) / 2);

    // Status: NaN f64 slots (poison: each is written before it is read back), then the ints.
    let mut init = vec![f32::NAN; ISTAT + ISLOTS];
    let islots: [i32; ISLOTS] = [
        NONE, NONE, NONE, NONE, NONE, 0, -1, -1, 0, 0, NONE, NONE, NONE, 0, 0, 0,
    ];
    for (s, v) in init[ISTAT..].iter_mut().zip(islots) {
        *s = f32::from_bits(v as u32);
    }
    let mut status = dev.upload(init.len(), 1, &init)?;

    // Pass 1: Gram partials. Chunk width: wide for small d_o (fewer barriers per byte), at
    // least 64 columns (a 256-byte row segment per load).
    let r4 = 4 * d_o.div_ceil(4);
    let tc = (2048 / r4 / 32 * 32).clamp(64, 512);
    let blocks = n.div_ceil(tc).min(GRAM_BLOCKS);
    // NaN scratch: an entry a kernel forgot to write poisons the result.
    let nan = |len: usize| dev.upload(len, 1, &vec![f32::NAN; len]);
    let mut partial = nan(2 * npairs * blocks + 1)?;
    let mut args = KernelArgs::new(dev);
    args.input(OP, h)?
        .input(OP, io.sigma)?
        .scalar(opts.process_noise)
        .scalar(d)
        .scalar(n as i32)
        .scalar(tc as i32)
        .output(OP, &mut partial)?
        .output(OP, &mut status)?;
    let cfg = LaunchConfig {
        grid: (blocks as u32, 1, 1),
        block: (THREADS, 1, 1),
        shared_mem: ((tc + r4 * (tc + 1)) * 4) as u32,
    };
    // SAFETY: kalman_gram_partial(const float* h, const float* sigma, float q, int d_o, int n,
    // int tc, float* partial, float* status): h holds d_o*n and sigma n floats (checked
    // above); loads are guarded by j < d_o, i < n; block b writes f64 partials at
    // pair*blocks + b < npairs*blocks inside 2*npairs*blocks + 1 floats (one spare for the
    // 8-byte alignment); shared memory is tc + r4*(tc + 1) floats as sized here; status holds
    // ISTAT + 16 floats.
    unsafe { launch(&GRAM_PARTIAL, cfg, args)? };

    // Pass 2: P (f64 d_o x d_o).
    let mut p = nan(2 * d_o * d_o + 1)?;
    let mut args = KernelArgs::new(dev);
    args.input(OP, &partial)?
        .scalar(blocks as i32)
        .scalar(d)
        .output(OP, &mut p)?;
    let cfg = LaunchConfig {
        grid: (npairs.div_ceil(THREADS as usize / 32) as u32, 1, 1),
        block: (THREADS, 1, 1),
        shared_mem: 0,
    };
    // SAFETY: kalman_gram_reduce(const float* partial, int nblocks, int d_o, float* p): warp w
    // < npairs reads partials pair*blocks .. +blocks (written by pass 1) and writes two f64
    // entries of p (2*d_o² + 1 floats); warps past npairs return.
    unsafe { launch(&GRAM_REDUCE, cfg, args)? };

    // Pass 3: the single-block solve.
    let mut gain = nan(d_o * d_o + d_o)?;
    let mut args = KernelArgs::new(dev);
    args.input(OP, &p)?
        .input(OP, io.r)?
        .input(OP, innovation)?
        .scalar(d)
        .scalar(opts.beta)
        .scalar(opts.rho)
        .scalar(i32::from(opts.r_form == RForm::Exact))
        .scalar(opts.jitter)
        .scalar(opts.max_jitter_escalations as i32)
        .output(OP, io.r_out)?
        .output(OP, &mut gain)?
        .output(OP, &mut status)?;
    let cfg = LaunchConfig {
        grid: (1, 1, 1),
        block: (THREADS, 1, 1),
        shared_mem: ((3 * d_o * d_o + 2 * d_o) * 8) as u32,
    };
    // SAFETY: kalman_solve(const float* p, const float* r, const float* innov, int d_o, float
    // beta, float rho, int exact, float jitter, int max_esc, float* r_out, float* gain, float*
    // status): p holds d_o² f64 (pass 2), r and r_out d_o², innov d_o, gain d_o² + d_o floats
    // (checked above); shared memory is 3 d_o² + 2 d_o doubles as sized here (≤ 96 KiB for
    // d_o ≤ 64); max_esc ≤ 30 (validated) bounds the escalation loop.
    unsafe { launch(&SOLVE, cfg, args)? };

    // Pass 4: the fused update, in the smallest register bucket D ≥ d_o.
    let update = match d_o {
        1..=8 => &UPDATE_D8,
        9..=16 => &UPDATE_D16,
        17..=32 => &UPDATE_D32,
        _ => &UPDATE_D64,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, h)?
        .input(OP, io.mu)?
        .input(OP, io.sigma)?
        .input(OP, &gain)?
        .scalar(opts.process_noise)
        .scalar(opts.sigma_floor)
        .scalar(d)
        .scalar(n as i32)
        .output(OP, io.mu_out)?
        .output(OP, io.sigma_out)?
        .output(OP, &mut status)?;
    let cfg = LaunchConfig {
        grid: (n.div_ceil(THREADS as usize).min(UPDATE_BLOCKS) as u32, 1, 1),
        block: (THREADS, 1, 1),
        shared_mem: 0,
    };
    // SAFETY: kalman_update_dD(const float* h, const float* mu, const float* sigma, const
    // float* gain, float q, float floor, int d_o, int n, float* mu_out, float* sigma_out,
    // float* status): D ≥ d_o by the match above; h holds d_o*n, mu, sigma, mu_out, sigma_out
    // n, gain d_o² + d_o floats (checked above); column i < n only; static shared memory only.
    unsafe { launch(update, cfg, args)? };

    // The one read-back of the step.
    let s = status.to_vec()?;
    let int = |k: usize| s[ISTAT + k].to_bits() as i32;
    let dbl = |k: usize| {
        // The kernels use the buffer's first 8-byte aligned address (device buffers are
        // 256-byte aligned; emulator host buffers only 4).
        let off = status
            .host()
            .map_or(0, |v| usize::from(v.as_ptr() as usize % 8 != 0));
        let (lo, hi) = (s[off + 2 * k].to_bits(), s[off + 2 * k + 1].to_bits());
        f64::from_bits(u64::from(lo) | (u64::from(hi) << 32))
    };
    let nonfinite = |arg: &'static str, m: &Matrix, index: i32| -> Result<Error> {
        Ok(Error::NonFinite {
            op: OP,
            arg,
            index: index as usize,
            value: m.to_vec()?[index as usize],
        })
    };
    // The CPU's order of checks.
    for (slot, arg, m) in [
        (S_MU, "mu", io.mu),
        (S_SIGMA, "sigma", io.sigma),
        (S_R, "r", io.r),
        (S_INNOV, "innovation", innovation),
    ] {
        if int(slot) != NONE {
            return Err(nonfinite(arg, m, int(slot))?);
        }
    }
    if int(S_SIGMA_POS) != NONE {
        return Err(Error::Value {
            op: OP,
            arg: "sigma",
            value: io.sigma.to_vec()?[int(S_SIGMA_POS) as usize] as f64,
            expected: "every entry > 0",
        });
    }
    if int(S_P) != 0 {
        return Err(nonfinite_h(OP, h)?);
    }
    for (slot, pivot) in [(S_M_SPD, 2), (S_S_SPD, 3)] {
        if int(slot) >= 0 {
            return Err(Error::NotSpd {
                op: OP,
                index: int(slot) as usize,
                pivot: dbl(pivot),
            });
        }
    }
    for (slot, arg, m) in [
        (S_POST_MU, "posterior mu", &*io.mu_out),
        (S_POST_SIGMA, "posterior sigma", &*io.sigma_out),
        (S_POST_R, "posterior r", &*io.r_out),
    ] {
        if int(slot) != NONE {
            return Err(nonfinite(arg, m, int(slot))?);
        }
    }
    Ok(KalmanInfo {
        jitter: dbl(0) as f32,
        jitter_escalations: int(S_ESC) as usize,
        sigma_floored: int(S_FLOORED) as usize,
        nis: dbl(1) as f32,
    })
}

/// The error for a `P` that came out non-finite (rare path: `h` is read back): its first
/// NaN/Inf, or (all finite) the largest magnitude, as the CPU reports it.
fn nonfinite_h(op: &'static str, h: &Matrix) -> Result<Error> {
    let v = h.to_vec()?;
    Ok(match v.iter().position(|x| !x.is_finite()) {
        Some(index) => Error::NonFinite {
            op,
            arg: "h",
            index,
            value: v[index],
        },
        None => Error::Value {
            op,
            arg: "h",
            value: v.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64,
            expected: "entries small enough that H diag(σ) Hᵀ is finite in f64",
        },
    })
}
