//! The GEMM plan: the dense products of [`crate::Device::gemm`] and of the optimizers
//! (`Device::product_consumed`: the Kronecker step's products, the cached squares) described
//! once — operand format, transposes, whether `C` is read — and run by one dispatcher over its
//! candidates ([`Candidate`]): grng's own kernels (the **engine**: `cuda::gemm`'s SIMT GEMM for
//! `f32`, the tensor-core engine for `bf16` and the f32-accurate split3 products), the
//! **vendor** (cuBLAS `cublasGemmEx`, [`super::gemm_vendor`]) and, for the f32-accurate
//! products, **bf16x3** (split3 planes concatenated along `K`, one bf16 product:
//! [`gemm3_bf16x3`]).
//!
//! The vendor library is the floor: on a CUDA device where it loads, the first product of a
//! (plan, shape class, device) runs every candidate, checks each against the engine within
//! the bound of [`Trial::bound`], times them ([`TRIAL_RUNS`] runs each, CUDA events, the
//! median; each run pays the operand splits the candidate pays outside a trial) and keeps the
//! fastest that agrees for every later product of that key ([`choices`] lists the decisions
//! with their times, for the bench's kernel column). A candidate that disagrees is not
//! chosen, and that is said once on stderr. Where the vendor
//! is absent — always on [`Device::Emulated`] — the engine runs, each such product is counted
//! ([`vendor_absent`]) and the first is said on stderr: never a silent slow path.
//!
//! `GRNG_GEMM=vendor|engine|auto` ([`Policy`]) forces a side (`auto`, the default, chooses
//! by measurement); `vendor` where the vendor cannot run is a typed error, not a fallback.
//! A choice is kept in the process, and with `GRNG_GEMM_CACHE=FILE` also on disk: a trial's
//! decision is appended to `FILE`, and a later process on the same device, driver and build
//! takes it from there without a trial (so processes sharing the file choose alike).
//! Without the file two processes may pick differently where candidates time alike: their
//! results then differ by the rounding of [`Trial::bound`]; set `GRNG_GEMM` or
//! `GRNG_GEMM_CACHE` for results reproducible across processes.
//!
//! The products in the plan: `Device::gemm` ([`gemm()`]), the Kronecker factors' SYRK with its
//! EMA ([`syrk_ema`]), the optimizers' checked products ([`product3_checked`]), the
//! preconditioning (`precondition_checked`: [`gemm3`] then a checked product), the
//! damped-inverse update ([`damped_inverse_update`]) and Newton's products with their fused
//! epilogues (`newton_product`, [`Product::Newton`]).

mod cache;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once, OnceLock, PoisonError};
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use half::bf16;

use super::engine::Role;
use super::gemm::{self as engine, Epilogue3, Split3, SplitCache};
use super::gemm_vendor::{self as vendor, VendorElement};
use super::newton;
use super::syrk;
use crate::device::{Device, Element, Matrix};
use crate::error::{check_shape, Error, Result, OVERFLOW};
use crate::mat::Trans;
use crate::shape::MatMul;

/// Runs of each candidate a trial times (after one untimed run that also gives the outputs
/// compared): the median of three is robust to one interrupted run at a small cost on the
/// first product of a shape class.
pub const TRIAL_RUNS: usize = 3;

/// Which side runs the products ([`Policy::from_env`] reads `GRNG_GEMM`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The faster of the two, measured on first use of a key (the default).
    Auto,
    /// cuBLAS always; an error where it cannot run.
    Vendor,
    /// grng's own kernels always.
    Engine,
}

impl Policy {
    /// The policy a `GRNG_GEMM` value names (`None`, unset: [`Policy::Auto`]).
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] naming the variable for any other value (as a bad
    /// `GRNG_DEVICE`).
    pub fn parse(value: Option<&str>) -> Result<Self> {
        match value {
            None | Some("auto") => Ok(Self::Auto),
            Some("vendor") => Ok(Self::Vendor),
            Some("engine") => Ok(Self::Engine),
            Some(other) => Err(Error::DeviceUnavailable(format!(
                "GRNG_GEMM={other:?}: expected vendor, engine or auto"
            ))),
        }
    }

    /// `GRNG_GEMM` as read at the first product of the process.
    ///
    /// # Errors
    /// As [`Policy::parse`], on every product while the value is wrong.
    pub fn from_env() -> Result<Self> {
        static POLICY: OnceLock<std::result::Result<Policy, String>> = OnceLock::new();
        POLICY
            .get_or_init(|| {
                Self::parse(std::env::var("GRNG_GEMM").ok().as_deref()).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::DeviceUnavailable)
    }
}

/// A product's operands and accuracy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// `f32` operands, `f32` arithmetic (`Device::gemm` on `f32`): engine `gemm_{nn,..}`,
    /// vendor SGEMM.
    F32,
    /// `bf16` operands, `f32` accumulation: engine `gemm_tc`, vendor `GemmEx` bf16 → f32.
    Bf16,
    /// `f32` operands at `f32` accuracy with the result checked as it is stored (the
    /// optimizers' products): engine split3 `gemm3_tc` with its flagging epilogue, vendor
    /// SGEMM and a check launch.
    F32Checked,
    /// `f32` operands at `f32` accuracy, unchecked (the preconditioning's first product, the
    /// damped-inverse update): engine split3 `gemm3_tc`, vendor SGEMM.
    F32Accurate,
}

/// What is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Product {
    /// `C ← α·op(A)·op(B) + β·C`.
    Gemm,
    /// The Kronecker factor's `Λ ← ε·Λ + (1−ε)/m·AᵀA`, exactly symmetric: the engine's
    /// lower-triangle SYRK with its mirror, or cuBLAS (`Ssyrk` for `f32`, `GemmEx` for `bf16`)
    /// and `newton_mirror_lower`.
    SyrkEma,
    /// `C ← α·op(A)·op(B)` of a product symmetric in exact arithmetic (the optimizers' Grams
    /// and `E·Γ̃⁻¹·Eᵀ`-like products), exactly symmetric: the engine's lower-triangle tiles
    /// mirrored ([`Epilogue3::mirror`]), or the vendor's or bf16x3's full product with its
    /// lower triangle mirrored.
    Symmetric,
    /// A Newton product `A·B` (`cuda::newton`) with its fused epilogue, or cuBLAS and the
    /// same epilogue as a kernel (`newton_epilogue`); `mirror`: a symmetric product, of
    /// which the engine computes the lower-triangle tiles only.
    Newton {
        /// [`super::newton::Epilogue::mirror`].
        mirror: bool,
    },
}

/// One product's description: the key of a choice with its [`ShapeClass`] and device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmPlan {
    /// What is computed.
    pub product: Product,
    /// Operands and accuracy.
    pub format: Format,
    /// Whether `A` is transposed (`op(A) = Aᵀ`).
    pub ta: Trans,
    /// Whether `B` is transposed.
    pub tb: Trans,
    /// Whether `C` is read (`β ≠ 0`).
    pub reads_c: bool,
}

/// The sizes a choice holds for: `⌈log₂⌉` of `m`, `n` and `k`, so one trial serves every
/// product within a factor of two of its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShapeClass {
    /// `⌈log₂ m⌉`.
    pub m: u32,
    /// `⌈log₂ n⌉`.
    pub n: u32,
    /// `⌈log₂ k⌉`.
    pub k: u32,
}

impl ShapeClass {
    /// The class of an `m x n x k` product.
    pub fn of(m: usize, n: usize, k: usize) -> Self {
        let c = |x: usize| x.max(1).next_power_of_two().trailing_zeros();
        Self {
            m: c(m),
            n: c(n),
            k: c(k),
        }
    }
}

/// The candidates. Every plan has the first two; the f32-accurate formats
/// ([`Format::F32Accurate`], [`Format::F32Checked`]) also [`Candidate::Bf16x3`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Candidate {
    /// grng's kernels.
    Engine,
    /// cuBLAS at the plan's precision (SGEMM, never TF32, for `f32` operands).
    Vendor,
    /// f32 accuracy at the bf16 tensor cores' rate (issue 36 item 3): both operands' split3
    /// planes concatenated along `K`, six plane products small first, and ONE bf16 product of
    /// the plan over them (`K' = 6K`): [`gemm3_bf16x3`].
    Bf16x3,
}

impl Candidate {
    /// Every candidate, in the order a tie prefers (the engine first); [`Trial`]'s arrays
    /// are indexed so.
    pub const ALL: [Self; 3] = [Self::Engine, Self::Vendor, Self::Bf16x3];

    /// How many products an output element's `f32` sum adds for inner dimension `k`
    /// ([`Trial::bound`]): the split3 engine sums its six plane products in one accumulator
    /// too, but its bound is `k`'s (`cuda::gemm::gemm3`: the small products' roundings stay
    /// ~2⁻⁸ below the result's); `Bf16x3`'s vendor may split its `6k`-deep sum in any order.
    pub fn sum_depth(self, k: usize) -> usize {
        match self {
            Self::Engine | Self::Vendor => k,
            Self::Bf16x3 => 6 * k,
        }
    }
}

/// What a trial measured, each array indexed as [`Candidate::ALL`]: each candidate's median
/// time over [`TRIAL_RUNS`] runs and the Frobenius norm of its output's difference from the
/// engine's, against its bound.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Trial {
    /// Median seconds; `None` for a candidate the plan does not have, or that failed.
    pub secs: [Option<f64>; 3],
    /// `‖C_candidate − C_engine‖_F` (0 for the engine; NaN where it did not run).
    pub difference: [f64; 3],
    /// The most each difference may be ([`Trial::bound`]).
    pub bound: [f64; 3],
}

impl Trial {
    /// How far two `f32`-accumulated products of the same operands, whose sums are `depth`
    /// products deep together ([`Candidate::sum_depth`] of both), may differ:
    /// `(depth + 16)·2⁻²⁴·(|α|·‖A‖_F·‖B‖_F + |β|·‖C‖_F)`. Each candidate is within
    /// `(d + 8)·2⁻²⁴·|α|·‖|op(A)||op(B)|‖_F` of the exact product for its depth `d`, plus a
    /// rounding of `β·C` (SGEMM's `γ_k`; the split3 engine's bound, `cuda::gemm::gemm3`; bf16
    /// operands multiply exactly), and `‖|A||B|‖_F ≤ ‖A‖_F·‖B‖_F`. Loose, but a product with
    /// a wrong layout or transpose misses it by orders of magnitude.
    pub fn bound(depth: usize, alpha: f32, beta: f32, norms: [f64; 3]) -> f64 {
        let [a, b, c] = norms;
        (depth as f64 + 16.0)
            * 2f64.powi(-24)
            * (f64::from(alpha).abs() * a * b + f64::from(beta).abs() * c)
    }

    /// The candidate's median seconds, `None` where it did not run or failed.
    pub fn secs(&self, c: Candidate) -> Option<f64> {
        self.secs[c as usize]
    }

    /// Whether the candidate's output agreed with the engine's within its bound (never for a
    /// NaN difference).
    pub fn agrees(&self, c: Candidate) -> bool {
        self.difference[c as usize] <= self.bound[c as usize]
    }

    /// The decision: the fastest candidate that ran and agrees with the engine, the earlier
    /// of [`Candidate::ALL`] on a tie (the engine first).
    pub fn decide(&self) -> Candidate {
        let timed = Candidate::ALL
            .into_iter()
            .filter(|&c| self.agrees(c))
            .filter_map(|c| Some((c, self.secs(c)?)));
        let mut best = (Candidate::Engine, f64::INFINITY);
        for (c, secs) in timed {
            if secs < best.1 {
                best = (c, secs);
            }
        }
        best.0
    }
}

/// One decision of the process: its key, the candidate and, where one ran, the trial.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// The product.
    pub plan: GemmPlan,
    /// Its sizes.
    pub class: ShapeClass,
    /// The device's ordinal.
    pub ordinal: usize,
    /// What runs.
    pub candidate: Candidate,
    /// The measurement behind it (`None` when a policy forced the side or the on-disk cache
    /// gave it).
    pub trial: Option<Trial>,
    /// Whether the decision came from the on-disk cache (`GRNG_GEMM_CACHE`, a trial of an
    /// earlier process).
    pub cached: bool,
}

type Key = (GemmPlan, ShapeClass, usize);

fn decisions() -> std::sync::MutexGuard<'static, HashMap<Key, Choice>> {
    static CHOICES: OnceLock<Mutex<HashMap<Key, Choice>>> = OnceLock::new();
    CHOICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// The decisions made so far in this process (trials and forced sides), in no order.
pub fn choices() -> Vec<Choice> {
    decisions().values().copied().collect()
}

static VENDOR_ABSENT: AtomicU64 = AtomicU64::new(0);

/// Products of the plan that ran on the engine because the vendor library could not run
/// (every product on [`Device::Emulated`]; on a GPU while libcublas does not load) since the
/// process started. `GRNG_GEMM=engine` products are not counted: nothing was missing.
pub fn vendor_absent() -> u64 {
    VENDOR_ABSENT.load(Ordering::Relaxed)
}

fn note_absent(why: &str) {
    VENDOR_ABSENT.fetch_add(1, Ordering::Relaxed);
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        eprintln!(
            "grng: GEMMs run on grng's own kernels, no vendor library (counted in \
             grng::cuda::gemm_plan::vendor_absent): {why}"
        );
    });
}

/// One candidate writing the product into the output it is given.
type Run<'a> = dyn FnMut(&mut Matrix) -> Result<()> + 'a;

/// A plan's candidates with their runs, the engine first.
type Runs<'r, 'a> = [(Candidate, &'r mut Run<'a>)];

/// The dispatcher: picks the candidate for `plan` on `dev` (a trial on first use under
/// [`Policy::Auto`]) and runs it into `c`. `runs` are the plan's candidates, the engine
/// first. `dims` is `(m, n, k)`; `operand_norms` gives `[‖A‖_F, ‖B‖_F]` for a trial's bound:
/// they and `‖C‖_F` are downloaded only when a trial runs, never on the products after it.
fn dispatch(
    dev: &Device,
    plan: GemmPlan,
    (m, n, k): (usize, usize, usize),
    (alpha, beta): (f32, f32),
    operand_norms: &dyn Fn(&Matrix) -> Result<[f64; 2]>,
    runs: &mut Runs<'_, '_>,
    c: &mut Matrix,
) -> Result<()> {
    let policy = Policy::from_env()?;
    // α = 0 or an empty product is C ← β·C, which the engine does without reading A and B.
    if policy == Policy::Engine || alpha == 0.0 || m == 0 || n == 0 || k == 0 {
        return run_engine(runs, c);
    }
    let cuda = match dev {
        Device::Cuda(d) if vendor::available() => d,
        _ => {
            let why = match dev {
                Device::Cuda(_) => "libcublas does not load",
                _ => "the emulator runs grng's kernels only",
            };
            if policy == Policy::Vendor {
                return Err(Error::DeviceUnavailable(format!(
                    "GRNG_GEMM=vendor, but {why}"
                )));
            }
            note_absent(why);
            return run_engine(runs, c);
        }
    };
    let class = ShapeClass::of(m, n, k);
    let key = (plan, class, cuda.ordinal());
    let record = |candidate, trial, cached| {
        let choice = Choice {
            plan,
            class,
            ordinal: key.2,
            candidate,
            trial,
            cached,
        };
        decisions().insert(key, choice);
    };
    let known = decisions().get(&key).map(|choice| choice.candidate);
    // The on-disk cache (GRNG_GEMM_CACHE), asked only while a key is undecided: its identity
    // queries the driver and hashes the PTX, which no later product should pay.
    let disk = match (policy, known) {
        (Policy::Auto, None) => cache::path().and_then(|p| Some((p, cache::identity(cuda).ok()?))),
        _ => None,
    };
    let from_disk = match (policy, known, &disk) {
        (Policy::Auto, None, Some((path, id))) => cache::lookup(path, id, plan, class),
        _ => None,
    };
    let candidate = match (policy, known, from_disk) {
        (_, Some(candidate), _) => candidate,
        (Policy::Vendor, None, _) => {
            record(Candidate::Vendor, None, false);
            Candidate::Vendor
        }
        (_, None, Some(candidate)) => {
            record(candidate, None, true);
            candidate
        }
        _ => {
            let [na, nb] = operand_norms(c)?;
            let nc = if beta != 0.0 { frobenius(c)? } else { 0.0 };
            let norms = [na, nb, nc];
            let bound = |c: Candidate| Trial::bound(k + c.sum_depth(k), alpha, beta, norms);
            match trial(dev, c, &bound, runs) {
                Ok(trial) => {
                    warn_if_disagree(plan, (m, n, k), &trial);
                    let candidate = trial.decide();
                    record(candidate, Some(trial), false);
                    if let Some((path, id)) = &disk {
                        cache::store(path, id, plan, class, candidate);
                    }
                    candidate
                }
                // The engine's product failed (an overflow its check flags: it depends on the
                // operands): its own error, and its output in `c`, exactly as without a plan;
                // nothing is decided and the next product tries again.
                Err(_) => return run_engine(runs, c),
            }
        }
    };
    match runs.iter_mut().find(|(c, _)| *c == candidate) {
        Some((_, run)) => run(c),
        None => run_engine(runs, c),
    }
}

/// Runs the engine: `runs`' first candidate in every plan of this file.
fn run_engine(runs: &mut Runs<'_, '_>, c: &mut Matrix) -> Result<()> {
    match runs.first_mut() {
        Some((Candidate::Engine, run)) => run(c),
        _ => Err(Error::DeviceUnavailable(
            "cuda::gemm_plan: a plan's first candidate is the engine".into(),
        )),
    }
}

/// Says (once per process) that a trial's candidate disagreed with the engine beyond its
/// bound.
fn warn_if_disagree(plan: GemmPlan, (m, n, k): (usize, usize, usize), trial: &Trial) {
    let Some(c) = Candidate::ALL
        .into_iter()
        .find(|&c| trial.secs(c).is_some() && !trial.agrees(c))
    else {
        return;
    };
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        let i = c as usize;
        eprintln!(
            "grng: {c:?} and grng's kernels disagree on {plan:?} ({m}x{n}x{k}): \
             ‖ΔC‖_F = {:e} > {:e}; it is not chosen",
            trial.difference[i], trial.bound[i]
        );
    });
}

/// Says (once per process) that a candidate failed in a trial.
fn warn_failed(c: Candidate, e: &Error) {
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        eprintln!("grng: the GEMM plan's {c:?} candidate failed in a trial: {e}; not chosen");
    });
}

/// Runs every candidate of `runs` into copies of `c` (one untimed run each, whose outputs
/// are compared with the engine's; then [`TRIAL_RUNS`] timed runs each), leaving `c` as it
/// was; `bound` gives what a candidate's difference may be ([`Trial::bound`]). `Err`: the
/// engine failed; a later candidate that fails is said once and not timed (`secs` `None`),
/// so the trial still decides and no later product of its key pays a trial again. Each run
/// pays what the candidate pays outside a trial, the split of its operands included
/// ([`split_for_run`]).
fn trial(
    dev: &Device,
    c: &Matrix,
    bound: &dyn Fn(Candidate) -> f64,
    runs: &mut Runs<'_, '_>,
) -> Result<Trial> {
    let _mark = TrialMark::set();
    // CUDA events on a GPU; the host's clock on the emulator, whose launches are synchronous
    // (no product trials there, but the plan's unit tests run one).
    let once = |run: &mut Run<'_>, out: &mut Matrix| -> Result<f64> {
        match dev {
            Device::Cuda(d) => {
                let stream = d.stream();
                let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                run(out)?;
                let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                end.synchronize()?;
                Ok(f64::from(start.elapsed_ms(&end)?) / 1e3)
            }
            _ => {
                let t = Instant::now();
                run(out)?;
                Ok(t.elapsed().as_secs_f64())
            }
        }
    };
    let time = |run: &mut Run<'_>, out: &mut Matrix| -> Result<f64> {
        let mut secs = Vec::with_capacity(TRIAL_RUNS);
        for _ in 0..TRIAL_RUNS {
            secs.push(once(run, out)?);
        }
        secs.sort_by(f64::total_cmp);
        Ok(secs[TRIAL_RUNS / 2])
    };
    let mut out = Trial {
        secs: [None; 3],
        difference: [f64::NAN; 3],
        bound: Candidate::ALL.map(bound),
    };
    let mut engine_out: Option<Vec<f32>> = None;
    for (candidate, run) in runs.iter_mut() {
        // The outputs compared are the untimed runs' (with β ≠ 0 a timed run reads its own
        // output back as `C`).
        let mut mine = c.try_clone()?;
        let measured = run(&mut mine)
            .and_then(|()| mine.to_vec())
            .and_then(|v| Ok((v, time(run, &mut mine)?)));
        let (v, secs) = match (measured, &engine_out) {
            (Ok(m), _) => m,
            (Err(e), None) => return Err(e),
            (Err(e), Some(_)) => {
                warn_failed(*candidate, &e);
                continue;
            }
        };
        let i = *candidate as usize;
        out.secs[i] = Some(secs);
        out.difference[i] = match &engine_out {
            None => 0.0,
            Some(e) => e
                .iter()
                .zip(&v)
                .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
                .sum::<f64>()
                .sqrt(),
        };
        engine_out.get_or_insert(v);
    }
    Ok(out)
}

/// `‖x‖_F` in `f64` (one download: a trial's bound only).
fn frobenius<T: Element>(x: &Matrix<T>) -> Result<f64> {
    Ok(x.to_vec()?
        .iter()
        .map(|&v| f64::from(v.to_f32()).powi(2))
        .sum::<f64>()
        .sqrt())
}

/// The engine's launcher of a format's products.
type EngineGemm<T> = fn(&Device, MatMul<&Matrix<T>>, f32, &mut Matrix) -> Result<()>;

/// The engine's SYRK-EMA launcher of an operand type.
type EngineSyrk<T> = fn(&Device, &Matrix<T>, f32, &mut Matrix) -> Result<()>;

/// The operand types of [`gemm()`] and [`syrk_ema`]: each with its plan format and engine
/// launchers.
pub trait PlanElement: VendorElement {
    /// The plan's format of products of this type.
    const FORMAT: Format;
    /// The engine's GEMM launcher.
    const ENGINE: EngineGemm<Self>;
    /// The engine's SYRK-EMA launcher.
    const ENGINE_SYRK: EngineSyrk<Self>;
}

impl PlanElement for f32 {
    const FORMAT: Format = Format::F32;
    const ENGINE: EngineGemm<Self> = engine::gemm;
    const ENGINE_SYRK: EngineSyrk<Self> = syrk::syrk_ema_f32;
}

impl PlanElement for bf16 {
    const FORMAT: Format = Format::Bf16;
    const ENGINE: EngineGemm<Self> = engine::gemm_tc;
    const ENGINE_SYRK: EngineSyrk<Self> = syrk::syrk_ema_tc;
}

/// [`crate::Device::gemm`] on a kernel device: `C ← α·op(A)·op(B) + β·C` (the product `p`)
/// with `f32` or `bf16` operands (plan [`Format::F32`] or [`Format::Bf16`]), same BLAS
/// semantics as [`engine::gemm`]. The op validated the arguments.
///
/// # Errors
/// As [`engine::gemm`] and [`vendor::gemm`]; [`Error::DeviceUnavailable`] for
/// `GRNG_GEMM=vendor` where cuBLAS cannot run, a bad `GRNG_GEMM`. `c`
/// is unchanged on error.
pub fn gemm<T: PlanElement>(
    dev: &Device,
    p: MatMul<&Matrix<T>>,
    beta: f32,
    c: &mut Matrix,
) -> Result<()> {
    let mut ours = |out: &mut Matrix| T::ENGINE(dev, p, beta, out);
    let mut cublas = |out: &mut Matrix| vendor::gemm(dev, p, beta, out);
    let plan = ("cuda::gemm_plan::gemm", Product::Gemm, T::FORMAT);
    let runs: &mut Runs<'_, '_> = &mut [
        (Candidate::Engine, &mut ours),
        (Candidate::Vendor, &mut cublas),
    ];
    dispatch_product(dev, plan, p, beta, runs, c)
}

/// `α·op(A)·op(B)` as a new matrix at `f32` accuracy with the result checked (plan
/// [`Format::F32Checked`]): the engine's [`engine::product3_checked`] (split3 planes, flagging
/// epilogue), or cuBLAS SGEMM or [`gemm3_bf16x3`] followed by one finiteness check launch —
/// into the ledger of an enclosing `Device::deferred` scope either way. With `epi.planes` (an
/// empty cache for the result), the engine's epilogue writes the result's split planes into
/// it (in a trial, a scratch cache instead); after the vendor's or bf16x3's product it stays
/// empty. With `epi.mirror` (plan [`Product::Symmetric`]) the engine computes the
/// lower-triangle tiles and mirrors them, and the vendor and bf16x3 mirror their product's
/// lower triangle (`newton_mirror_lower`, a launch): exactly symmetric whichever runs.
///
/// # Errors
/// As [`engine::product3_checked`]: [`Error::NonFinite`] (`op`, `"result (overflow)"`) for a
/// non-finite product; plus allocation errors and the plan's errors of [`gemm()`].
pub fn product3_checked(
    dev: &Device,
    op: &'static str,
    p: MatMul<&Split3<'_>>,
    epi: Epilogue3<'_>,
) -> Result<Matrix> {
    let matrices = p.map(Split3::matrix);
    let (m, n) = matrices.shape();
    if epi.mirror {
        check_shape(op, "op(a)·op(b) (symmetric)", (m, n), (m, m))?;
    }
    let mut c = dev.scratch(m, n)?;
    let [mut ours, mut cublas, mut bf16x3] = checked_runs(dev, op, p, epi);
    let product = match epi.mirror {
        true => Product::Symmetric,
        false => Product::Gemm,
    };
    let runs: &mut Runs<'_, '_> = &mut [
        (Candidate::Engine, &mut *ours),
        (Candidate::Vendor, &mut *cublas),
        (Candidate::Bf16x3, &mut *bf16x3),
    ];
    dispatch_product(
        dev,
        (op, product, Format::F32Checked),
        matrices,
        0.0,
        runs,
        &mut c,
    )?;
    Ok(c)
}

/// [`product3_checked`]'s candidates, in [`Candidate::ALL`]'s order. The split ones read
/// `p`'s operands through [`split_for_run`], so a trial times the splits each pays.
fn checked_runs<'r>(
    dev: &'r Device,
    op: &'static str,
    p: MatMul<&'r Split3<'r>>,
    epi: Epilogue3<'r>,
) -> [Box<Run<'r>>; 3] {
    let (planes, cat) = split_made(p);
    // The vendor's and bf16x3's full products, mirrored where the engine mirrors, then checked.
    let finish = move |out: &mut Matrix| {
        if epi.mirror {
            super::cholesky::mirror_lower(dev, out)?;
        }
        super::elementwise::check_finite(dev, op, &[(OVERFLOW, out)])
    };
    [
        Box::new(move |out: &mut Matrix| {
            let scratch = SplitCache::default();
            let epi = Epilogue3 {
                planes: result_cache(epi.planes, &scratch),
                ..epi
            };
            split_for_run(p, planes, |p| {
                engine::product3_checked(dev, op, p, out, epi)
            })
        }),
        Box::new(move |out: &mut Matrix| {
            vendor::gemm(dev, p.map(Split3::matrix), 0.0, out)?;
            finish(out)
        }),
        Box::new(move |out: &mut Matrix| {
            split_for_run(p, cat, |p| gemm3_bf16x3(dev, p, 0.0, &mut *out))?;
            finish(out)
        }),
    ]
}

/// Which of `p`'s operands have their engine planes, and which their bf16x3 concatenation
/// for `p`'s roles and transposes, before the product: [`split_for_run`]'s `made` of each
/// candidate.
fn split_made(p: MatMul<&Split3<'_>>) -> ([bool; 2], [bool; 2]) {
    let planes = [p.a.has_planes(), p.b.has_planes()];
    let cat = [
        p.a.has_concatenated(Role::A, p.ta),
        p.b.has_concatenated(Role::B, p.tb),
    ];
    (planes, cat)
}

/// Where an engine run writes its result's split planes: into `out`, or, in a [`trial`], into
/// `scratch` (a fresh cache, dropped after the run), so that each of a trial's runs pays the
/// epilogue's writes as the product does outside it, and only the product that stays (whose
/// output is the caller's) fills `out`.
fn result_cache<'o>(
    out: Option<&'o SplitCache>,
    scratch: &'o SplitCache,
) -> Option<&'o SplitCache> {
    match out {
        Some(_) if IN_TRIAL.get() => Some(scratch),
        out => out,
    }
}

thread_local! {
    /// Whether this thread runs a [`trial`]'s candidates ([`split_for_run`]).
    static IN_TRIAL: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as in a [`trial`] until dropped (and back to what it was: a candidate's
/// bf16 product may hold a trial of its own).
struct TrialMark(bool);

impl TrialMark {
    fn set() -> Self {
        Self(IN_TRIAL.replace(true))
    }
}

impl Drop for TrialMark {
    fn drop(&mut self) {
        IN_TRIAL.set(self.0);
    }
}

/// Runs `run` on a product's split operands as a candidate reads them: `p`'s own, or, in a
/// [`trial`], fresh ones for those whose split `made` says did not exist when the product was
/// called. So each of a trial's runs pays the splits the candidate pays outside it (a
/// `Split3` keeps what its first product made, and the untimed run would otherwise leave the
/// timed ones nothing to split), while an operand split before the call (read by several
/// products, split by the first) costs no run anything.
fn split_for_run<'a, R>(
    p: MatMul<&Split3<'a>>,
    made: [bool; 2],
    run: impl FnOnce(MatMul<&Split3<'a>>) -> R,
) -> R {
    if !IN_TRIAL.get() {
        return run(p);
    }
    let fresh = |s: &Split3<'a>, made: bool| (!made).then(|| Split3::new(s.matrix()));
    let a = fresh(p.a, made[0]);
    let a = a.as_ref().unwrap_or(p.a);
    // One matrix for both operands (a square) is split once outside a trial too.
    if std::ptr::eq(p.a, p.b) {
        return run(p.with(a, a));
    }
    let b = fresh(p.b, made[1]);
    run(p.with(a, b.as_ref().unwrap_or(p.b)))
}

/// `C ← α·op(A)·op(B) + β·C` at `f32` accuracy for `f32` operands (plan
/// [`Format::F32Accurate`]): the engine's split3 [`engine::gemm3`], cuBLAS SGEMM or
/// [`gemm3_bf16x3`].
///
/// # Errors
/// As [`engine::gemm3`] and [`vendor::gemm`]; the plan's errors of [`gemm()`]. `c` is unchanged
/// on error.
pub fn gemm3(dev: &Device, p: MatMul<&Matrix>, beta: f32, c: &mut Matrix) -> Result<()> {
    let (sa, sb) = (Split3::new(p.a), Split3::new(p.b));
    gemm3_split(dev, p.with(&sa, &sb), beta, c, None)
}

/// [`gemm3`] of operands split once ([`Split3`]: their planes and concatenations made by the
/// first candidate that reads them, or kept from an earlier call). With `result` (an empty
/// cache for `c`), the engine's epilogue writes `c`'s split planes into it, as in
/// [`product3_checked`].
///
/// # Errors
/// As [`gemm3`].
pub fn gemm3_split(
    dev: &Device,
    p: MatMul<&Split3<'_>>,
    beta: f32,
    c: &mut Matrix,
    result: Option<&SplitCache>,
) -> Result<()> {
    let (planes, cat) = split_made(p);
    let matrices = p.map(Split3::matrix);
    let mut ours = |out: &mut Matrix| {
        let scratch = SplitCache::default();
        let result = result_cache(result, &scratch);
        split_for_run(p, planes, |p| {
            engine::gemm3_split(dev, p, beta, out, result)
        })
    };
    let mut cublas = |out: &mut Matrix| vendor::gemm(dev, matrices, beta, out);
    let mut bf16x3 =
        |out: &mut Matrix| split_for_run(p, cat, |p| gemm3_bf16x3(dev, p, beta, &mut *out));
    let plan = ("cuda::gemm_plan::gemm3", Product::Gemm, Format::F32Accurate);
    let runs: &mut Runs<'_, '_> = &mut [
        (Candidate::Engine, &mut ours),
        (Candidate::Vendor, &mut cublas),
        (Candidate::Bf16x3, &mut bf16x3),
    ];
    dispatch_product(dev, plan, matrices, beta, runs, c)
}

/// `C ← α·op(A)·op(B) + β·C` at `f32` accuracy as ONE bf16 product (candidate
/// [`Candidate::Bf16x3`], issue 36 item 3): `A` and `B` as split3 planes concatenated along `K`
/// (`gemm_split3_cat`, 12 bytes per element, kept in the [`Split3`]), whose six blocks pair
/// the plane products of the split3 engine in its order (mid·mid, hi·lo, lo·hi, hi·mid,
/// mid·hi, hi·hi: small first), summed by the plan's bf16 product ([`gemm()`] on bf16
/// operands: cuBLAS `GemmEx` or `gemm_tc`, whichever its own trial keeps) with `K' = 6K`.
/// Where that product runs `gemm_tc` and `K` is a multiple of its 32-deep K slice, the result
/// is the split3 engine's ([`engine::gemm3`]) bit for bit: the same slices in the same order.
/// Error: within `(6K + 8)·2⁻²⁴·|α|·|op(A)||op(B)|` of the exact product plus a rounding of
/// `β·C` in any summation order; `≈ (K + 8)·2⁻²⁴` in order, as the engine's. `α = 0` and empty
/// products run the engine's [`engine::gemm3`] (which reads neither operand then).
///
/// # Errors
/// As [`gemm()`], plus allocation errors. `c` is unchanged on error.
pub fn gemm3_bf16x3(dev: &Device, p: MatMul<&Split3<'_>>, beta: f32, c: &mut Matrix) -> Result<()> {
    const OP: &str = "cuda::gemm_plan::gemm3_bf16x3";
    let (m, n, k) = p.dims(OP, c.shape())?;
    if p.alpha == 0.0 || m == 0 || n == 0 || k == 0 {
        return engine::gemm3(dev, p.map(Split3::matrix), beta, c);
    }
    let a = p.a.concatenated(dev, Role::A, p.ta)?;
    let b = p.b.concatenated(dev, Role::B, p.tb)?;
    gemm::<bf16>(dev, p.with(a, b), beta, c)
}

/// `P = Γ̃⁻¹ (G Λ̃⁻¹)` with `Γ̃⁻¹` `d_out x d_out`, `G` `d_out x d_in`, `Λ̃⁻¹` `d_in x d_in`
/// (`crate::Device::precondition` on a kernel device), the inverses as split operands (their
/// planes kept by the caller where it keeps them): [`gemm3_split`] into a `d_out x d_in`
/// scratch matrix, then [`product3_checked`], which checks `P`'s finiteness as it stores it
/// (into the ledger of an enclosing `Device::deferred` scope, or a status read here); the new
/// matrix replaces `p` only when clean. Each product is the plan's. Where the engine runs the
/// first product, its epilogue writes the scratch's split planes and the second reads them
/// (one split less); with `out` (empty, for `P`) the second's epilogue writes `P`'s.
///
/// # Errors
/// [`Error::Shape`] (`p`, and the products' own checks), device, allocation and launch
/// errors, [`Error::NonFinite`] naming `op` and `"result (overflow)"` for a non-finite `P`.
/// `p` is unchanged on error.
pub(crate) fn precondition_checked(
    dev: &Device,
    op: &'static str,
    gamma_inv: &Split3<'_>,
    g: &Split3<'_>,
    lambda_inv: &Split3<'_>,
    p: &mut Matrix,
    out: Option<&SplitCache>,
) -> Result<()> {
    let (d_out, d_in) = g.matrix().shape();
    check_shape(op, "p", p.shape(), (d_out, d_in))?;
    let mut t = dev.scratch::<f32>(d_out, d_in)?;
    let t_planes = SplitCache::default();
    let g_lambda = MatMul::new(Trans::No, Trans::No, 1.0, g, lambda_inv);
    gemm3_split(dev, g_lambda, 0.0, &mut t, Some(&t_planes))?;
    let t = Split3::kept(&t, &t_planes);
    let epi = Epilogue3 {
        planes: out,
        mirror: false,
    };
    *p = product3_checked(dev, op, g_lambda.with(gamma_inv, &t), epi)?;
    Ok(())
}

/// Lazy-Fisher damped-inverse update `X ← X − dλ·X·X` for a square `X` (plan
/// [`Format::F32Accurate`], `β = 1`): the engine's [`engine::damped_inverse_update`] (split3
/// planes of the old `X`, so in place), or cuBLAS SGEMM reading a copy of the old `X` (cuBLAS
/// may not read what it writes). `dλ = 0` leaves `X` as it is.
///
/// # Errors
/// As [`engine::damped_inverse_update`] and [`vendor::gemm`]; the plan's errors of [`gemm()`].
/// `inv` is unchanged on error.
pub fn damped_inverse_update(dev: &Device, inv: &mut Matrix, dlambda: f32) -> Result<()> {
    const OP: &str = "cuda::gemm_plan::damped_inverse_update";
    let n = inv.rows();
    check_shape(OP, "inv", inv.shape(), (n, n))?;
    let plan = GemmPlan {
        product: Product::Gemm,
        format: Format::F32Accurate,
        ta: Trans::No,
        tb: Trans::No,
        reads_c: true,
    };
    let mut ours = |out: &mut Matrix| engine::damped_inverse_update(dev, out, dlambda);
    // cuBLAS may not read what it writes: both vendor-side candidates read a copy of the old
    // X (n² floats: a fraction of a product's time; bf16x3 reads only its concatenated
    // operands, but building them from `out` while writing it is the same aliasing).
    let xx = MatMul::new(Trans::No, Trans::No, -dlambda, (), ());
    let mut cublas = |out: &mut Matrix| {
        let x = out.try_clone()?;
        vendor::gemm(dev, xx.with(&x, &x), 1.0, out)
    };
    let mut bf16x3 = |out: &mut Matrix| {
        let x = out.try_clone()?;
        let x = Split3::new(&x);
        gemm3_bf16x3(dev, xx.with(&x, &x), 1.0, out)
    };
    let norms = |x: &Matrix| {
        let nx = frobenius(x)?;
        Ok([nx, nx])
    };
    let runs: &mut Runs<'_, '_> = &mut [
        (Candidate::Engine, &mut ours),
        (Candidate::Vendor, &mut cublas),
        (Candidate::Bf16x3, &mut bf16x3),
    ];
    dispatch(dev, plan, (n, n, n), (-dlambda, 1.0), &norms, runs, inv)
}

/// [`dispatch`] of `C ← p + β·C`, a `product` ([`Product::Gemm`] or
/// [`Product::Symmetric`]) of `format` whose operands are `p`'s matrices, after their shapes'
/// check ([`MatMul::dims`], naming `op`); `runs` are the plan's candidates, the engine first.
fn dispatch_product<T: Element>(
    dev: &Device,
    (op, product, format): (&'static str, Product, Format),
    p: MatMul<&Matrix<T>>,
    beta: f32,
    runs: &mut Runs<'_, '_>,
    c: &mut Matrix,
) -> Result<()> {
    let dims = p.dims(op, c.shape())?;
    let plan = GemmPlan {
        product,
        format,
        ta: p.ta,
        tb: p.tb,
        reads_c: beta != 0.0,
    };
    let norms = |_: &Matrix| Ok([frobenius(p.a)?, frobenius(p.b)?]);
    dispatch(dev, plan, dims, (p.alpha, beta), &norms, runs, c)
}

/// [`crate::Device::syrk_ema`] on a kernel device: `Λ ← ε·Λ + (1−ε)/m·AᵀA` (`A` `m x n`,
/// `m ≥ 1`, `f32` or `bf16`; `factor` `n x n`), exactly symmetric, reading only the lower
/// triangle of the old `Λ` (plan [`Product::SyrkEma`]): the engine's `syrk_ema_f32` /
/// `syrk_ema_tc`, or cuBLAS ([`vendor::syrk_ema`]) and the mirror of its lower triangle.
/// The op validated the arguments.
///
/// # Errors
/// As the launchers; the plan's errors of [`gemm()`]. `factor` is unchanged on error.
pub fn syrk_ema<T: PlanElement>(
    dev: &Device,
    a: &Matrix<T>,
    eps: f32,
    factor: &mut Matrix,
) -> Result<()> {
    let (m, n) = a.shape();
    let plan = GemmPlan {
        product: Product::SyrkEma,
        format: T::FORMAT,
        ta: Trans::Yes,
        tb: Trans::No,
        reads_c: eps != 0.0,
    };
    let alpha = (1.0 - eps) / m.max(1) as f32;
    let mut ours = |out: &mut Matrix| T::ENGINE_SYRK(dev, a, eps, out);
    let mut cublas = |out: &mut Matrix| {
        vendor::syrk_ema(dev, a, eps, out)?;
        super::cholesky::mirror_lower(dev, out)
    };
    dispatch(
        dev,
        plan,
        (n, n, m),
        (alpha, eps),
        &|_| {
            let na = frobenius(a)?;
            Ok([na, na])
        },
        &mut [
            (Candidate::Engine, &mut ours),
            (Candidate::Vendor, &mut cublas),
        ],
        factor,
    )
}

/// A Newton product `A·B` with its fused epilogue (plan [`Product::Newton`], [`Format::Bf16`]
/// on bf16 copies, [`Format::F32Accurate`] on f32 operands): the engine's
/// [`newton::engine_product`] (`newton_gemm_tc`, split3 `newton_gemm3_tc`), or cuBLAS (bf16 →
/// f32, or SGEMM: never TF32) into the scratch's f32 product, then [`newton::epilogue`] over
/// it — the same outputs and residual partials; on f32 operands also [`newton_bf16x3`]. The
/// trial compares the f32 output `epi.out`, which the epilogue must have.
///
/// # Errors
/// [`Error::Value`] without `epi.out`; as the launchers and [`vendor::gemm`]; the plan's
/// errors of [`gemm()`].
pub(crate) fn newton_product(
    dev: &Device,
    ops: newton::Operands<'_>,
    mut epi: newton::Epilogue<'_>,
    scratch: &mut newton::Scratch,
) -> Result<newton::Ran> {
    use newton::{Epilogue, Operands, Ran};
    const OP: &str = "cuda::gemm_plan::newton_product";
    let Some(out) = epi.out.take() else {
        return Err(Error::Value {
            op: OP,
            arg: "out",
            value: 0.0,
            expected: "an f32 output (the plan compares candidates on it)",
        });
    };
    let n = ops.n();
    let format = match ops {
        Operands::Bf16(..) => Format::Bf16,
        Operands::F32(..) => Format::F32Accurate,
    };
    let plan = GemmPlan {
        product: Product::Newton { mirror: epi.mirror },
        format,
        ta: Trans::No,
        tb: Trans::No,
        reads_c: false,
    };
    let (alpha, diag, adds) = (epi.alpha, epi.diag, [epi.add1, epi.add2]);
    // Both candidates write the epilogue's other outputs (bf16 copy, planes, partials), one at
    // a time. `ran` ends as the last run's candidate: the chosen one's, trial or not.
    let state = RefCell::new((epi, scratch));
    let ran = Cell::new(Ran::Other);
    let mut ours = |c: &mut Matrix| {
        let (epi, scratch) = &mut *state.borrow_mut();
        let epi = Epilogue {
            out: Some(c),
            ..epi.reborrow()
        };
        ran.set(Ran::Engine);
        newton::engine_product(dev, ops, epi, scratch)
    };
    let mut cublas = |c: &mut Matrix| {
        ran.set(Ran::Other);
        let (epi, scratch) = &mut *state.borrow_mut();
        let (product, unused) = scratch.for_epilogue(dev, n)?;
        let no = Trans::No;
        match ops {
            Operands::Bf16(a, b) => vendor::gemm(dev, MatMul::new(no, no, 1.0, a, b), 0.0, product),
            Operands::F32(a, b) => {
                vendor::gemm(dev, MatMul::new(no, no, 1.0, a.m, b.m), 0.0, product)
            }
        }?;
        let epi = Epilogue {
            out: Some(c),
            ..epi.reborrow()
        };
        newton::epilogue(dev, product, epi, unused)
    };
    // The additions enter the bound as part of the product (‖A‖_F·‖B‖_F + ‖d·I + add1 +
    // add2‖_F/|α|): each candidate rounds α·C + d·I + add1 + add2 at most three times, within
    // 3·2⁻²⁴ of the terms' magnitudes, well inside Trial::bound's (2k + 16)·2⁻²⁴ per unit.
    let norms = |_: &Matrix| {
        let (na, nb) = match ops {
            Operands::Bf16(a, b) => (frobenius(a)?, frobenius(b)?),
            Operands::F32(a, b) => (frobenius(a.m)?, frobenius(b.m)?),
        };
        let mut added = f64::from(diag).abs() * (n as f64).sqrt();
        for add in adds.into_iter().flatten() {
            added += frobenius(add)?;
        }
        Ok([1.0, na * nb + added / f64::from(alpha).abs()])
    };
    // bf16x3 is an f32-accurate candidate: the bf16 products have none.
    let mut bf16x3 = match ops {
        Operands::F32(a, b) => Some(|c: &mut Matrix| {
            ran.set(Ran::Other);
            let (epi, scratch) = &mut *state.borrow_mut();
            let epi = Epilogue {
                out: Some(c),
                ..epi.reborrow()
            };
            newton_bf16x3(dev, (a.m, b.m), epi, scratch)
        }),
        Operands::Bf16(..) => None,
    };
    let mut runs: Vec<(Candidate, &mut Run<'_>)> = vec![
        (Candidate::Engine, &mut ours),
        (Candidate::Vendor, &mut cublas),
    ];
    if let Some(run) = bf16x3.as_mut() {
        runs.push((Candidate::Bf16x3, run));
    }
    dispatch(dev, plan, (n, n, n), (alpha, 0.0), &norms, &mut runs, out)?;
    Ok(ran.get())
}

/// Candidate bf16x3 of an f32 Newton product: `A·B` by [`gemm3_bf16x3`] (the split3 planes
/// concatenated along `K`, one bf16 product of the plan) into the scratch's f32 product, then
/// [`newton::epilogue`] over it — `newton_product`'s outputs and residual partials. A square
/// (`a` and `b` the same matrix) is split once. Where the bf16 product runs `gemm_tc` and `n`
/// is a multiple of its 32-deep K slice, the product is the split3 engine's bit for bit, and
/// so are the outputs (`newton_epilogue` is the fused epilogue's algebra).
///
/// # Errors
/// As [`gemm3_bf16x3`] and [`newton::epilogue`]; [`Error::Shape`] for operands that are not
/// square and of one size.
pub fn newton_bf16x3(
    dev: &Device,
    (a, b): (&Matrix, &Matrix),
    epi: newton::Epilogue<'_>,
    scratch: &mut newton::Scratch,
) -> Result<()> {
    const OP: &str = "cuda::gemm_plan::newton_bf16x3";
    let n = a.rows();
    check_shape(OP, "a", a.shape(), (n, n))?;
    check_shape(OP, "b", b.shape(), (n, n))?;
    let (product, unused) = scratch.for_epilogue(dev, n)?;
    let sa = Split3::new(a);
    let sb = (!std::ptr::eq(a, b)).then(|| Split3::new(b));
    let p = MatMul::new(Trans::No, Trans::No, 1.0, &sa, sb.as_ref().unwrap_or(&sa));
    gemm3_bf16x3(dev, p, 0.0, product)?;
    newton::epilogue(dev, product, epi, unused)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_parses_the_three_names_and_refuses_others() {
        assert_eq!(Policy::parse(None).unwrap(), Policy::Auto);
        assert_eq!(Policy::parse(Some("auto")).unwrap(), Policy::Auto);
        assert_eq!(Policy::parse(Some("vendor")).unwrap(), Policy::Vendor);
        assert_eq!(Policy::parse(Some("engine")).unwrap(), Policy::Engine);
        let e = Policy::parse(Some("cublas")).unwrap_err();
        assert!(
            matches!(e, Error::DeviceUnavailable(ref s) if s.contains("GRNG_GEMM")),
            "{e}"
        );
    }

    #[test]
    fn the_faster_agreeing_candidate_wins_and_disagreement_keeps_the_engine() {
        let t = |e, v, d| Trial {
            secs: [Some(e), Some(v), None],
            difference: [0.0, d, f64::NAN],
            bound: [1e-3; 3],
        };
        assert_eq!(t(2.0, 1.0, 1e-4).decide(), Candidate::Vendor);
        assert_eq!(t(1.0, 2.0, 1e-4).decide(), Candidate::Engine);
        assert_eq!(t(1.0, 1.0, 0.0).decide(), Candidate::Engine, "a tie");
        assert_eq!(t(2.0, 1.0, 1e-2).decide(), Candidate::Engine, "disagree");
        assert_eq!(t(2.0, 1.0, f64::NAN).decide(), Candidate::Engine, "NaN");
        // Three candidates: the fastest that agrees; a failed one (no time) never wins.
        let three = |secs: [Option<f64>; 3], d: [f64; 3]| Trial {
            secs,
            difference: d,
            bound: [1e-3; 3],
        };
        let all = [Some(3.0), Some(2.0), Some(1.0)];
        assert_eq!(three(all, [0.0; 3]).decide(), Candidate::Bf16x3);
        assert_eq!(
            three(all, [0.0, 0.0, 1.0]).decide(),
            Candidate::Vendor,
            "bf16x3 disagrees"
        );
        assert_eq!(
            three([Some(3.0), None, Some(2.0)], [0.0, f64::NAN, 0.0]).decide(),
            Candidate::Bf16x3,
            "the vendor failed"
        );
        assert_eq!(
            three([Some(1.0), Some(1.0), Some(1.0)], [0.0; 3]).decide(),
            Candidate::Engine,
            "a three-way tie"
        );
    }

    /// `len` values `((i·mul mod m) − ⌊m/2⌋)/div`: a few distinct values around zero, not
    /// aligned with the tiles, reproducible without a seed (the plan's tests count launches or
    /// compare candidates, whatever the values).
    fn pattern(len: usize, mul: usize, m: usize, div: f32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * mul % m) as f32 - (m / 2) as f32) / div)
            .collect()
    }

    /// A trial's runs each pay the operand splits their candidate pays outside a trial. On
    /// the emulator (the host's clock; cuBLAS fails there and is not timed), the engine's
    /// 1 + [`TRIAL_RUNS`] runs of [`product3_checked`] split both operands each
    /// (`gemm_split3`) and bf16x3's concatenate both each (`gemm_split3_cat`); an operand
    /// split before the product (read by an earlier one) costs no run its split; and the
    /// caller's operands are left as they were, for the chosen run to split once. Mutation
    /// check: with `split_for_run` passing `p` through, the untimed run's planes serve the
    /// timed ones (2 splits counted where 8 are expected).
    #[cfg(feature = "test-hooks")]
    #[test]
    fn a_trial_times_the_splits_each_run_pays() {
        use crate::hooks::{record_launches_here, take_launches_here};
        let dev = Device::Emulated;
        let upload = |r: usize, c: usize| dev.upload(r, c, &pattern(r * c, 7, 13, 7.0)).unwrap();
        let (a, b, b0) = (upload(33, 40), upload(40, 20), upload(40, 20));
        let no = Trans::No;
        let runs = 1 + TRIAL_RUNS;
        for split_before in [false, true] {
            let (sa, sb) = (Split3::new(&a), Split3::new(&b));
            if split_before {
                // An earlier product that read `a` (its planes), and its concatenation.
                let sb0 = Split3::new(&b0);
                product3_checked(
                    &dev,
                    "test",
                    MatMul::new(no, no, 1.0, &sa, &sb0),
                    Epilogue3::default(),
                )
                .unwrap();
                sa.concatenated(&dev, Role::A, no).unwrap();
            }
            let c = dev.zeros(33, 20).unwrap();
            let [mut e, mut v, mut x] = checked_runs(
                &dev,
                "test",
                MatMul::new(no, no, 1.0, &sa, &sb),
                Epilogue3::default(),
            );
            record_launches_here(true);
            let t = trial(
                &dev,
                &c,
                &|_| 1.0,
                &mut [
                    (Candidate::Engine, &mut *e),
                    (Candidate::Vendor, &mut *v),
                    (Candidate::Bf16x3, &mut *x),
                ],
            );
            let launches = take_launches_here();
            record_launches_here(false);
            let t = t.unwrap();
            let count = |k: &str| launches.iter().filter(|&&l| l == k).count();
            let per_run = if split_before { 1 } else { 2 };
            assert_eq!(count("gemm3_tc"), runs, "{launches:?}");
            assert_eq!(count("gemm_split3"), per_run * runs, "{launches:?}");
            assert_eq!(count("gemm_tc"), runs, "{launches:?}");
            assert_eq!(count("gemm_split3_cat"), per_run * runs, "{launches:?}");
            assert!(t.secs(Candidate::Engine).is_some() && t.secs(Candidate::Bf16x3).is_some());
            assert_eq!(t.secs(Candidate::Vendor), None);
            assert!(!sb.has_planes() && !sb.has_concatenated(Role::B, no));
            assert_eq!(sa.has_planes(), split_before);
        }
    }

    /// A trial's engine runs write their results' planes into scratch caches (so each pays
    /// the epilogue's writes) and leave the caller's cache empty: only the product that
    /// stays, whose output is the caller's, fills it, with the planes of that output.
    /// Mutation check: without the scratch in a trial, the second engine run finds the
    /// caller's cache filled and fails, and so does the trial.
    #[test]
    fn a_trial_leaves_the_result_planes_to_the_product_that_stays() {
        let dev = Device::Emulated;
        let upload = |r: usize, c: usize| dev.upload(r, c, &pattern(r * c, 5, 11, 3.0)).unwrap();
        let (a, b) = (upload(9, 17), upload(17, 6));
        let (sa, sb) = (Split3::new(&a), Split3::new(&b));
        let no = Trans::No;
        let out = SplitCache::default();
        let mut c = dev.zeros(9, 6).unwrap();
        let [mut e, mut v, mut x] = checked_runs(
            &dev,
            "test",
            MatMul::new(no, no, 1.0, &sa, &sb),
            Epilogue3 {
                planes: Some(&out),
                mirror: false,
            },
        );
        let runs: &mut Runs<'_, '_> = &mut [
            (Candidate::Engine, &mut *e),
            (Candidate::Vendor, &mut *v),
            (Candidate::Bf16x3, &mut *x),
        ];
        let t = trial(&dev, &c, &|_| 1.0, runs).unwrap();
        assert!(t.secs(Candidate::Engine).is_some());
        assert!(!out.has_planes());
        run_engine(runs, &mut c).unwrap();
        let planes = out.planes().unwrap().to_vec().unwrap();
        let split = crate::cuda::engine::split3(&dev, &c)
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(
            planes.iter().map(|p| p.to_bits()).collect::<Vec<_>>(),
            split.iter().map(|p| p.to_bits()).collect::<Vec<_>>()
        );
    }

    /// A symmetric product's candidates all give an exactly symmetric result: the engine's
    /// mirrored tiles, and bf16x3's full product with its lower triangle mirrored (the
    /// vendor's run does the same after SGEMM; the emulator has no cuBLAS). Both agree with
    /// the f64 product of the lower triangle within split3's bound. `A·B` with `B ≠ Aᵀ` (the
    /// mirror's mechanics: a Gram's two triangles would agree anyway), three 128-wide tiles.
    /// Mutation check: without the mirror after bf16x3's product it fails.
    #[test]
    fn every_symmetric_candidate_mirrors() {
        let dev = Device::Emulated;
        let (n, k) = (300, 37);
        let (v, w) = (pattern(n * k, 7, 19, 5.0), pattern(n * k, 5, 23, 7.0));
        let (a, b) = (dev.upload(n, k, &v).unwrap(), dev.upload(n, k, &w).unwrap());
        let (sa, sb) = (Split3::new(&a), Split3::new(&b));
        let mirror = Epilogue3 {
            planes: None,
            mirror: true,
        };
        let p = MatMul::new(Trans::No, Trans::Yes, 1.0, &sa, &sb);
        let [mut e, _, mut x] = checked_runs(&dev, "test", p, mirror);
        for (name, run) in [("engine", &mut e), ("bf16x3", &mut x)] {
            let mut c = dev.zeros(n, n).unwrap();
            run(&mut c).unwrap();
            let c = c.to_vec().unwrap();
            for i in 0..n {
                for j in 0..=i {
                    assert_eq!(
                        c[i * n + j].to_bits(),
                        c[j * n + i].to_bits(),
                        "{name} ({i}, {j})"
                    );
                    let (mut want, mut abs) = (0.0f64, 0.0f64);
                    for q in 0..k {
                        let t = f64::from(v[i * k + q]) * f64::from(w[j * k + q]);
                        (want, abs) = (want + t, abs + t.abs());
                    }
                    let tol = (6 * k + 8) as f64 * abs / f64::from(1u32 << 24);
                    let got = f64::from(c[i * n + j]);
                    assert!(
                        (got - want).abs() <= tol,
                        "{name} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn shape_classes_round_up_to_powers_of_two() {
        let c = ShapeClass::of(1000, 1024, 1025);
        assert_eq!((c.m, c.n, c.k), (10, 10, 11));
        assert_eq!(ShapeClass::of(0, 1, 2), ShapeClass { m: 0, n: 0, k: 1 });
    }

    #[test]
    fn the_bound_scales_with_k_and_the_operands() {
        let b = Trial::bound(2000, 2.0, 0.5, [3.0, 4.0, 10.0]);
        let want = 2.0 * 1008.0 * 2f64.powi(-24) * (2.0 * 12.0 + 0.5 * 10.0);
        assert!((b - want).abs() <= 1e-12 * want, "{b} vs {want}");
    }
}
