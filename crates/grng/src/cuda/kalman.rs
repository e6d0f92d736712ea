//! Launcher of `kernels/kalman.cu`: one diagonal R-Kalman step (docs/math.md §3 steps 3–7) on
//! [`Device::Emulated`] or [`Device::Cuda`], with the semantics of
//! [`crate::cpu::kalman::kalman_step`] (same arithmetic, jitter escalation, floor and errors).
//!
//! Four kernels are queued back to back — weighted Gram partials over column chunks, their
//! deterministic reduction, the single-block `d_o x d_o` solve (R EMA, R̃, Cholesky of `S`
//! with in-kernel jitter escalation, `L⁻¹`, `w = S⁻¹v`) and one fused streaming pass writing
//! the posterior `μ`, `σ` — and the host reads one status buffer at the end: the only
//! synchronization of the step. Every input is checked for NaN/Inf inside the pass that
//! reads it anyway (σ and `H` by the Gram pass, μ by the update pass, R and v by the solve),
//! and the update runs only when everything was clean and the solve succeeded; the posterior
//! goes to the caller's output buffers only, so a caller that swaps them in on success (as
//! [`Device::kalman_step`] does) keeps its state unchanged on any error, without a copy.
//!
//! `H` is read as `f32` or `bf16` ([`JacobianElement`]), widened per element in registers.
//! The step allocates nothing on the device: its scratch (partials, `P`, `L⁻¹` and `w`, the
//! solve's workspace for `d_o > 64`, the status) is a [`KalmanScratch`] the caller keeps, and
//! every status slot is initialized by the kernel that owns it (no reset upload).

use half::bf16;

use super::launch::{kernel, launch, to_i32, KernelArgs, LaunchConfig};
use crate::device::{Device, Element, Matrix};
use crate::error::{check_shape, Error, Result};
use crate::params::kalman::{KalmanInfo, KalmanOptions, RForm};
use crate::shape::{check_kalman_lens, kalman_lens};

kernel!(pub(crate) GRAM_PARTIAL_F32 = KALMAN::kalman_gram_partial_f32;);
kernel!(pub(crate) GRAM_PARTIAL_BF16 = KALMAN::kalman_gram_partial_bf16;);
kernel!(pub(crate) GRAM_REDUCE = KALMAN::kalman_gram_reduce;);
kernel!(pub(crate) SOLVE = KALMAN::kalman_solve;);
kernel!(pub(crate) UPDATE_D8_F32 = KALMAN::kalman_update_d8_f32;);
kernel!(pub(crate) UPDATE_D16_F32 = KALMAN::kalman_update_d16_f32;);
kernel!(pub(crate) UPDATE_D32_F32 = KALMAN::kalman_update_d32_f32;);
kernel!(pub(crate) UPDATE_D64_F32 = KALMAN::kalman_update_d64_f32;);
kernel!(pub(crate) UPDATE_WIDE_F32 = KALMAN::kalman_update_wide_f32;);
kernel!(pub(crate) UPDATE_D8_BF16 = KALMAN::kalman_update_d8_bf16;);
kernel!(pub(crate) UPDATE_D16_BF16 = KALMAN::kalman_update_d16_bf16;);
kernel!(pub(crate) UPDATE_D32_BF16 = KALMAN::kalman_update_d32_bf16;);
kernel!(pub(crate) UPDATE_D64_BF16 = KALMAN::kalman_update_d64_bf16;);
kernel!(pub(crate) UPDATE_WIDE_BF16 = KALMAN::kalman_update_wide_bf16;);

/// Largest observation size `d_o` of the GPU step.
pub const MAX_D_O: usize = 256;
/// Largest `d_o` of the fast path: the solve in shared memory (`KAL_SMEM_DO`, 96 KiB) and
/// `h_i` in registers in the update pass.
pub const FAST_D_O: usize = 64;
/// Threads per block of every Kalman kernel (`KAL_THREADS`).
const THREADS: u32 = 256;
/// Columns per block step of `kalman_update_wide` (`KAL_WIDE_TW`).
const WIDE_TW: usize = 32;
/// Bound on the Gram pass's f64 partials (blocks x upper-triangle entries): at most 1024
/// blocks, fewer for large `d_o` (8 MiB of partials; at `d_o = 256` still 31 x 9 blocks,
/// each with `d_o²/2` FMAs per column). With the chunk width it depends on `n` and `d_o`
/// only, so the summation order is device-independent.
const GRAM_PARTIALS: usize = 1 << 20;
/// Grid cap of the update pass (grid-stride above).
const UPDATE_BLOCKS: usize = 4096;
/// Per-block flags of the Gram pass (`KAL_NFLAGS`).
const NFLAGS: usize = 3;
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
const S_H: usize = 14;
const ISLOTS: usize = 16;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// The element types the Kalman kernels read the Jacobian `H` in: `f32`, and `bf16` for half
/// the bytes of the two streaming passes over `H`. Either way every product and sum is `f32`
/// (and `f64` across chunks): widening a `bf16` is exact, so a `bf16` `H` is used exactly as
/// given. Sealed.
pub trait JacobianElement: Element + sealed::Sealed {
    /// Whether the kernels read `bf16` (launcher dispatch).
    #[doc(hidden)]
    const BF16: bool;
}
impl JacobianElement for f32 {
    const BF16: bool = false;
}
impl JacobianElement for bf16 {
    const BF16: bool = true;
}

/// Launch geometry of the Gram pass for `(d_o, n)`: the chunk width, the blocks along `n`,
/// the groups of 256 tiles (4x4 blocks of `P`'s upper triangle) and where the per-block flags
/// start in the partials buffer. Depends on `d_o` and `n` only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Gram {
    r4: usize,
    tc: usize,
    blocks: usize,
    groups: usize,
    npairs: usize,
    flag_off: usize,
}

impl Gram {
    fn new(d_o: usize, n: usize) -> Self {
        let r4 = 4 * d_o.div_ceil(4);
        let nt = r4 / 4;
        // Wide chunks for small d_o (fewer barriers per byte), at least 64 columns (a 256-byte
        // row segment per load).
        let tc = (2048 / r4 / 32 * 32).clamp(64, 512);
        let npairs = d_o * (d_o + 1) / 2;
        let blocks = n.div_ceil(tc).min((GRAM_PARTIALS / npairs).clamp(1, 1024));
        Self {
            r4,
            tc,
            blocks,
            groups: (nt * (nt + 1) / 2).div_ceil(THREADS as usize),
            npairs,
            // f64 partials from the first 8-byte aligned float (one spare float).
            flag_off: 2 * npairs * blocks + 1,
        }
    }
}

/// The device scratch of the step for one `(d_o, n)`, allocated once and reused by every
/// step (no device allocation per step). Its contents are never read before a kernel of the
/// same step wrote them.
#[derive(Debug)]
pub struct KalmanScratch {
    d_o: usize,
    n: usize,
    gram: Gram,
    /// Gram partials (f64) then the per-block flags (ints).
    partial: Matrix,
    /// `P`, f64 `d_o x d_o`.
    p: Matrix,
    /// `L⁻¹` (f32 `d_o x d_o`) then `w` (`d_o`).
    gain: Matrix,
    /// The solve's f64 workspace for `d_o > FAST_D_O` (one unused float otherwise).
    work: Matrix,
    /// The status word: f64 values, then the int slots at `ISTAT`.
    status: Matrix,
}

impl KalmanScratch {
    /// Scratch for `d_o x n` Jacobians on `dev`, NaN-filled (an entry a kernel forgot to
    /// write poisons the result instead of passing silently).
    ///
    /// # Errors
    /// [`Error::Shape`] unless `1 ≤ d_o ≤ MAX_D_O` and `n ≥ 1`; device errors.
    pub fn new(dev: &Device, d_o: usize, n: usize) -> Result<Self> {
        check_dims("KalmanScratch::new", d_o, n)?;
        let gram = Gram::new(d_o, n);
        let nan = |len: usize| dev.upload(len, 1, &vec![f32::NAN; len]);
        let work = if d_o > FAST_D_O {
            2 * (3 * d_o * d_o + 2 * d_o) + 1
        } else {
            1
        };
        Ok(Self {
            d_o,
            n,
            gram,
            partial: nan(gram.flag_off + NFLAGS * gram.blocks)?,
            p: nan(2 * d_o * d_o + 1)?,
            gain: nan(d_o * d_o + d_o)?,
            work: nan(work)?,
            status: nan(ISTAT + ISLOTS)?,
        })
    }

    /// The `(d_o, n)` it serves.
    pub fn dims(&self) -> (usize, usize) {
        (self.d_o, self.n)
    }

    /// Whether it serves `(d_o, n)` on `dev`.
    pub fn fits(&self, dev: &Device, d_o: usize, n: usize) -> bool {
        self.dims() == (d_o, n) && dev.check_on("KalmanScratch::fits", &self.status).is_ok()
    }
}

/// `Err(Error::Shape)` unless `1 ≤ d_o ≤ MAX_D_O` and `n ≥ 1`.
fn check_dims(op: &'static str, d_o: usize, n: usize) -> Result<()> {
    if d_o == 0 || n == 0 || d_o > MAX_D_O {
        return Err(Error::Shape {
            op,
            arg: "h",
            expected: format!("d_o x n with 1 <= d_o <= {MAX_D_O} and n >= 1"),
            got: format!("{d_o}x{n}"),
        });
    }
    Ok(())
}

/// The buffers of one step, all on the launch's device: the prior (read), the posterior
/// (written; every element, whatever they held) and the scratch. Shapes: `mu`, `sigma`,
/// `mu_out`, `sigma_out` are `n x 1`, `r` and `r_out` `d_o x d_o` (row-major).
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
    /// Scratch for this `(d_o, n)` ([`KalmanScratch::new`]).
    pub scratch: &'a mut KalmanScratch,
}

/// One R-Kalman step on `dev` for the `d_o x n` Jacobian `h` (row-major, `f32` or `bf16`) and
/// the innovation `v = y − ŷ` (`d_o x 1`): reads `io.mu`, `io.sigma`, `io.r`, writes the
/// posterior into `io.mu_out`, `io.sigma_out`, `io.r_out`. Arithmetic, options and errors are
/// those of [`crate::cpu::kalman::kalman_step`]; the inputs are never modified, and on error
/// the outputs hold unspecified values. `opts` are not validated here
/// ([`crate::Device::kalman_step`] does).
///
/// # Errors
/// As the CPU step ([`Error::Shape`], [`Error::Value`], [`Error::NonFinite`],
/// [`Error::NotSpd`]), plus [`Error::Shape`] for `d_o > MAX_D_O` or a scratch of other
/// dimensions, [`Error::Value`] for `d_o · n ≥ 2³¹`, [`Error::DeviceMismatch`] and device
/// errors.
pub fn kalman_step<T: JacobianElement>(
    dev: &Device,
    io: KalmanBuffers<'_>,
    h: &Matrix<T>,
    innovation: &Matrix,
    opts: &KalmanOptions,
) -> Result<KalmanInfo> {
    const OP: &str = "cuda::kalman_step";
    // Memory safety only (the options, shapes and finiteness are the op's,
    // `Device::kalman_step`): every buffer against the d_o, n the kernels index by, d_o within
    // the kernels' limits, d_o·n within their ints, the scratch sized for (d_o, n).
    let (d_o, n) = h.shape();
    check_dims(OP, d_o, n)?;
    check_kalman_lens(OP, (d_o, n), kalman_lens!(io, innovation))?;
    check_shape(OP, "r_out", io.r_out.shape(), (d_o, d_o))?;
    check_shape(OP, "scratch", io.scratch.dims(), (d_o, n))?;
    to_i32(OP, "h", d_o * n)?; // every index of h fits the kernels' int
    let d = d_o as i32;
    let KalmanScratch {
        gram,
        partial,
        p,
        gain,
        work,
        status,
        ..
    } = io.scratch;
    let g = *gram;

    // Pass 1: Gram partials and the per-block flags of σ and H.
    let mut args = KernelArgs::new(dev);
    args.input(OP, h)?
        .input(OP, io.sigma)?
        .scalar(opts.process_noise)
        .scalar(d)
        .scalar(n as i32)
        .scalar(g.tc as i32)
        .scalar(g.flag_off as i32)
        .output(OP, partial)?;
    let cfg = LaunchConfig {
        grid: (g.blocks as u32, g.groups as u32, 1),
        block: (THREADS, 1, 1),
        shared_mem: ((g.tc + g.r4 * (g.tc + 1)) * 4) as u32,
    };
    let gram_kernel = if T::BF16 {
        &GRAM_PARTIAL_BF16
    } else {
        &GRAM_PARTIAL_F32
    };
    // SAFETY: kalman_gram_partial_{f32,bf16}(const T* h, const float* sigma, float q, int d_o,
    // int n, int tc, int flag_off, float* partial), T the element type of h (f32 or bf16 by
    // T::BF16): h holds d_o*n and sigma n elements (checked above); loads are guarded by
    // j < d_o, i < n; block (b, y) writes f64 partials of its group's tiles at pair*blocks + b
    // < npairs*blocks inside flag_off = 2*npairs*blocks + 1 floats (one spare for the 8-byte
    // alignment), and blocks of group 0 write NFLAGS ints at flag_off + NFLAGS*b inside the
    // flag_off + NFLAGS*blocks floats of the scratch (sized by Gram::new for this (d_o, n),
    // checked above); shared memory is tc + r4*(tc + 1) floats as sized here.
    unsafe { launch(gram_kernel, cfg, args)? };

    // Pass 2: P (f64 d_o x d_o) and the flags into the status.
    let mut args = KernelArgs::new(dev);
    args.input(OP, &*partial)?
        .scalar(g.blocks as i32)
        .scalar(g.flag_off as i32)
        .scalar(d)
        .output(OP, p)?
        .output(OP, status)?;
    let cfg = LaunchConfig::linear(
        (g.npairs + 1).div_ceil(THREADS as usize / 32) as u32,
        THREADS,
    );
    // SAFETY: kalman_gram_reduce(const float* partial, int nblocks, int flag_off, int d_o,
    // float* p, float* status): warp w < npairs reads partials pair*blocks .. +blocks and
    // writes two f64 entries of p (2*d_o² + 1 floats); warp npairs reads the NFLAGS*blocks
    // flag ints (all written by pass 1) and writes 3 int slots of status (ISTAT + 16 floats);
    // warps past npairs return.
    unsafe { launch(&GRAM_REDUCE, cfg, args)? };

    // Pass 3: the single-block solve.
    let mut args = KernelArgs::new(dev);
    args.input(OP, &*p)?
        .input(OP, io.r)?
        .input(OP, innovation)?
        .scalar(d)
        .scalar(opts.beta)
        .scalar(opts.rho)
        .scalar(i32::from(opts.r_form == RForm::Exact))
        .scalar(opts.jitter)
        .scalar(opts.max_jitter_escalations as i32)
        .output(OP, io.r_out)?
        .output(OP, gain)?
        .output(OP, work)?
        .output(OP, status)?;
    let solve_words = 3 * d_o * d_o + 2 * d_o;
    let cfg = LaunchConfig {
        grid: (1, 1, 1),
        block: (THREADS, 1, 1),
        shared_mem: if d_o <= FAST_D_O {
            (solve_words * 8) as u32
        } else {
            0
        },
    };
    // SAFETY: kalman_solve(const float* p, const float* r, const float* innov, int d_o, float
    // beta, float rho, int exact, float jitter, int max_esc, float* r_out, float* gain, float*
    // work, float* status): p holds d_o² f64 (pass 2), r and r_out d_o², innov d_o, gain
    // d_o² + d_o floats (checked above); the workspace of 3 d_o² + 2 d_o doubles is the shared
    // memory sized here for d_o ≤ KAL_SMEM_DO = FAST_D_O (≤ 96 KiB), else `work`, whose
    // 2*(3 d_o² + 2 d_o) + 1 floats (KalmanScratch::new) hold it from the first 8-byte aligned
    // float; max_esc ≤ 30 (validated) bounds the escalation loop.
    unsafe { launch(&SOLVE, cfg, args)? };

    // Pass 4: the fused update, in the smallest register bucket D ≥ d_o, or the wide kernel.
    let (update, wide) = match (d_o, T::BF16) {
        (1..=8, false) => (&UPDATE_D8_F32, false),
        (9..=16, false) => (&UPDATE_D16_F32, false),
        (17..=32, false) => (&UPDATE_D32_F32, false),
        (33..=FAST_D_O, false) => (&UPDATE_D64_F32, false),
        (_, false) => (&UPDATE_WIDE_F32, true),
        (1..=8, true) => (&UPDATE_D8_BF16, false),
        (9..=16, true) => (&UPDATE_D16_BF16, false),
        (17..=32, true) => (&UPDATE_D32_BF16, false),
        (33..=FAST_D_O, true) => (&UPDATE_D64_BF16, false),
        (_, true) => (&UPDATE_WIDE_BF16, true),
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, h)?
        .input(OP, io.mu)?
        .input(OP, io.sigma)?
        .input(OP, &*gain)?
        .scalar(opts.process_noise)
        .scalar(opts.sigma_floor)
        .scalar(d)
        .scalar(n as i32)
        .output(OP, io.mu_out)?
        .output(OP, io.sigma_out)?
        .output(OP, status)?;
    let cfg = if wide {
        LaunchConfig {
            grid: (n.div_ceil(WIDE_TW).min(UPDATE_BLOCKS) as u32, 1, 1),
            block: (THREADS, 1, 1),
            shared_mem: ((d_o * WIDE_TW + 2 * THREADS as usize) * 4) as u32,
        }
    } else {
        LaunchConfig::linear(
            n.div_ceil(THREADS as usize).min(UPDATE_BLOCKS) as u32,
            THREADS,
        )
    };
    // SAFETY: kalman_update_{dD,wide}_{f32,bf16}(const T* h, const float* mu, const float*
    // sigma, const float* gain, float q, float floor, int d_o, int n, float* mu_out, float*
    // sigma_out, float* status), T the element type of h (by T::BF16): D ≥ d_o by the match
    // above (the wide kernel has no register bound); h holds d_o*n, mu, sigma, mu_out,
    // sigma_out n, gain d_o² + d_o floats (checked above); column i < n only; the wide kernel's
    // dynamic shared memory is d_o*WIDE_TW + 2*THREADS floats as sized here, the others use
    // static shared memory only.
    unsafe { launch(update, cfg, args)? };

    // The one read-back of the step.
    let s = status.to_vec()?;
    let int = |k: usize| s[ISTAT + k].to_bits() as i32;
    let dbl = |k: usize| {
        // The kernels use the buffer's first 8-byte aligned address (device buffers are
        // 256-byte aligned; emulator host buffers only 4).
        let off = status
            .host()
            .map_or(0, |v| usize::from(!(v.as_ptr() as usize).is_multiple_of(8)));
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
    if int(S_H) != NONE {
        let index = int(S_H) as usize;
        return Err(Error::NonFinite {
            op: OP,
            arg: "h",
            index,
            value: h.to_vec()?[index].to_f32(),
        });
    }
    if int(S_P) != 0 {
        return Err(h_overflow(OP, h)?);
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

/// The error for a `P` that came out non-finite from a finite `H` (rare path: `h` is read
/// back): its largest magnitude, as the CPU reports it.
fn h_overflow<T: Element>(op: &'static str, h: &Matrix<T>) -> Result<Error> {
    let max = h
        .to_vec()?
        .iter()
        .fold(0.0f32, |m, x| m.max(x.to_f32().abs()));
    Ok(Error::Value {
        op,
        arg: "h",
        value: max as f64,
        expected: "entries small enough that H diag(σ) Hᵀ is finite in f64",
    })
}
