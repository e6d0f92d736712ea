//! GPU benchmark: grng's device ops beside the vendor library (cuBLAS, cublasLt, cuSOLVER) or
//! the bandwidth ceiling (a device-to-device copy), on the same GPU, sizes and run.
//!
//! `cargo bench --bench gpu -- [SECTION] [--quick] [--deadline=SECS]`; sections: `launch`, `copy`,
//! `adamw`, `gemm-f32`, `gemm-bf16`, `precond` (with its `precond-accuracy` rows), `syrk`,
//! `sym`, `newton`, `kalman`, `step`, `refresh` (SECTION runs every section whose name contains it; one that
//! matches none is an error, exit 2).
//! `--deadline=SECS`: at SECS seconds after the start the bench stops wherever it is, prints
//! what it prints at its end (the GEMM plan's choices so far, the `loaded:` lines) and exits
//! 124, so a run cut short by a time limit (`run-all.sh --step-limit`) still says which side
//! the plan kept; the rows printed before it are complete. Every timing is the median of
//! samples taken after warm-up, each sample a batch of calls closed by a device
//! synchronization ([`median_secs`]). A grng row names the kernels the op launched
//! (`grng::hooks::take_launches`) and prints no number when it launched none (a host
//! fallback). Where two vendor routines do the same product (`cublasGemmEx`, cublasLt) both
//! are timed and the faster is the peer of the ratio; the row names it. Without a GPU the
//! bench says so and exits 0. Results: `docs/gpu-benchmarks.md`.
//!
//! cuBLAS, cublasLt and cuSOLVER are loaded dynamically through cudarc's `cublas`,
//! `cublaslt` and `cusolver` features, the first two enabled for the benches only (dev-dependency
//! features): the library never needs them.

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasMath_t, cublasOperation_t, cublasSetMathMode,
    cublasStatus_t, cudaDataType_t,
};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::cublaslt::{result as lt, sys as lts};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use grng::cuda::anatomy::launch_anatomy;
use grng::cuda::gemm::gemm_tc;
use grng::cuda::syrk::syrk_ema_tc;
use grng::cuda::timing::{take_kernel_times, time_kernels};
use grng::cuda::CudaDevice;
use grng::hooks::{read_backs, record_launches, take_launches};
use grng::ops::elementwise::{AdamWCoeffs, MultiState};
use grng::ops::kalman::{JacobianElement, KalmanOptions, KalmanState};
use grng::ops::newton::{NewtonOptions, Precision};
use grng::optim::kron::{KronConfig, KronGrad, KronOptimizer};
use grng::optim::KronStats;
use grng::{Device, MatMul, Trans};
use half::bf16;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct Opts {
    filter: Option<String>,
    quick: bool,
    /// `--deadline=SECS`: seconds after the start at which the bench stops ([`watchdog`]).
    deadline: Option<f64>,
}

impl Opts {
    fn parse() -> Self {
        let mut o = Self {
            filter: None,
            quick: false,
            deadline: None,
        };
        // `cargo bench` appends `--bench`; other flags are ignored for the same reason.
        for a in std::env::args().skip(1) {
            match a.as_str() {
                "--quick" => o.quick = true,
                s if s.starts_with("--deadline=") => {
                    let v = &s["--deadline=".len()..];
                    match v.parse::<f64>() {
                        Ok(secs) if secs > 0.0 => o.deadline = Some(secs),
                        _ => {
                            eprintln!(
                                "gpu bench: --deadline={v}: not a positive number of seconds"
                            );
                            std::process::exit(2);
                        }
                    }
                }
                s if s.starts_with('-') => {}
                s => o.filter = Some(s.to_owned()),
            }
        }
        o
    }

    fn runs(&self, section: &str) -> bool {
        self.filter.as_deref().is_none_or(|f| section.contains(f))
    }

    fn samples(&self) -> usize {
        if self.quick {
            5
        } else {
            15
        }
    }

    /// The sizes of a section: all, or the first and the one before last with `--quick`.
    fn sizes(&self, all: &[usize]) -> Vec<usize> {
        if self.quick && all.len() > 1 {
            vec![all[0], all[all.len() - 2]]
        } else {
            all.to_vec()
        }
    }
}

/// A section of the bench: its rows for every size.
type Section = fn(&Bench) -> Res<()>;

/// The GPU, grng's device on it and the options: what every timing needs.
struct Bench {
    cuda: CudaDevice,
    dev: Device,
    o: Opts,
}

/// One side of a row: who ran (grng's kernels or the peer routine), its median seconds per
/// call or `None` (not timed, the label says why), and a note printed after the rate.
struct Timed {
    label: String,
    secs: Option<f64>,
    note: String,
}

impl Timed {
    fn none(label: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            secs: None,
            note: String::new(),
        }
    }
}

/// What a row's rate counts: FLOPs (printed as TFLOP/s), bytes moved (TB/s), or a plain time.
#[derive(Clone, Copy)]
enum Work {
    Flop(f64),
    Bytes(f64),
    Millis,
    Micros,
}

impl Work {
    fn rate(self, t: &Timed) -> String {
        let Some(s) = t.secs else {
            return "-".into();
        };
        let r = match self {
            Work::Flop(f) => format!("{:.1} TFLOP/s", f / s * 1e-12),
            Work::Bytes(b) => format!("{:.3} TB/s", b / s * 1e-12),
            Work::Millis => format!("{:.3} ms", s * 1e3),
            Work::Micros => format!("{:.1} us", s * 1e6),
        };
        if t.note.is_empty() {
            r
        } else {
            format!("{r} {}", t.note)
        }
    }
}

impl Bench {
    /// Median seconds per call of `f`: warm-up, then samples of `reps` calls each, the batch
    /// size chosen so a sample lasts about 2 ms; the device is synchronized around every
    /// sample.
    fn median_secs(&self, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
        for _ in 0..3 {
            f()?;
        }
        self.cuda.synchronize()?;
        let t = Instant::now();
        f()?;
        self.cuda.synchronize()?;
        let once = t.elapsed().as_secs_f64();
        let reps = (2e-3 / once.max(1e-9)).ceil().clamp(1.0, 1000.0) as usize;
        let mut times = Vec::with_capacity(self.o.samples());
        for _ in 0..self.o.samples() {
            self.cuda.synchronize()?;
            let t = Instant::now();
            for _ in 0..reps {
                f()?;
            }
            self.cuda.synchronize()?;
            times.push(t.elapsed().as_secs_f64() / reps as f64);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// A peer's timing under `label`.
    fn peer(&self, label: impl Into<String>, f: impl FnMut() -> Res<()>) -> Res<Timed> {
        Ok(Timed {
            label: label.into(),
            secs: Some(self.median_secs(f)?),
            note: String::new(),
        })
    }

    /// grng's timing labelled with the kernels one call launches (deduplicated, in order).
    /// No timing when it launched none (the op ran on the host) or failed (the error is the
    /// row's result, not the end of the bench).
    fn grng(&self, mut f: impl FnMut() -> Res<()>) -> Timed {
        // A first call outside the record: the GEMM plan's trial on a new shape runs both of
        // its candidates, and the row names the one it kept.
        if let Err(e) = f() {
            return Timed::none(format!("error: {e}"));
        }
        record_launches(true);
        let r = f().and_then(|()| Ok(self.cuda.synchronize()?));
        let mut names = take_launches();
        record_launches(false);
        if let Err(e) = r {
            return Timed::none(format!("error: {e}"));
        }
        let mut seen = Vec::new();
        names.retain(|n| {
            let new = !seen.contains(n);
            seen.push(*n);
            new
        });
        if names.is_empty() || names.iter().any(|n| n.starts_with("host:")) {
            return Timed::none("no kernel launched (host fallback): not timed");
        }
        match self.median_secs(f) {
            Ok(secs) => Timed {
                label: names.join("+"),
                secs: Some(secs),
                note: String::new(),
            },
            Err(e) => Timed::none(format!("{}: error: {e}", names.join("+"))),
        }
    }

    /// A device-to-device copy of `n` f32 (read + write: `8n` bytes), the bandwidth ceiling.
    fn copy(&self, n: usize) -> Res<Timed> {
        let s = self.cuda.stream();
        let src: CudaSlice<f32> = s.alloc_zeros(n)?;
        let mut dst: CudaSlice<f32> = s.alloc_zeros(n)?;
        self.peer("cuMemcpyDtoD", || Ok(s.memcpy_dtod(&src, &mut dst)?))
    }
}

/// Prints `| section | case | grng kernel | grng | peer | peer | ratio |`. The peer is the
/// fastest of `peers` (named, with the others' rates beside it); the ratio is grng's time over
/// its time, `-` when either has none.
fn row(section: &str, case: &str, ours: &Timed, peers: &[Timed], work: Work) {
    let best = peers
        .iter()
        .filter(|p| p.secs.is_some())
        .min_by(|a, b| a.secs.unwrap_or(0.0).total_cmp(&b.secs.unwrap_or(0.0)))
        .or(peers.first());
    let (peer_label, peer_rate, ratio) = match best {
        None => ("-".to_owned(), "-".to_owned(), "-".to_owned()),
        Some(b) => {
            let others: Vec<String> = peers
                .iter()
                .filter(|p| !std::ptr::eq(*p, b))
                .map(|p| format!("{} {}", p.label, work.rate(p)))
                .collect();
            let label = if others.is_empty() {
                b.label.clone()
            } else {
                format!("{} (fastest; also {})", b.label, others.join(", "))
            };
            let ratio = match (ours.secs, b.secs) {
                (Some(a), Some(p)) => format!("{:.2}", a / p),
                _ => "-".into(),
            };
            (label, work.rate(b), ratio)
        }
    };
    println!(
        "| {section} | {case} | {} | {} | {peer_label} | {peer_rate} | {ratio} |",
        ours.label,
        work.rate(ours)
    );
}

/// A `SECTION-kernels` row under a timed one: where `f`'s device time goes, by kernel
/// (`grng::cuda::timing`: two events per launch), in a run of its own after the timing (the
/// events would perturb it). `per`: calls of the unit the row times (S for a step cycle);
/// `wall`: the timed row's seconds per unit, beside which the kernels' sum shows what launches,
/// read-backs and host work cost.
fn kernel_row(section: &str, case: &str, wall: Option<f64>, per: f64, f: impl FnOnce() -> Res<()>) {
    time_kernels(true);
    let times = f().and_then(|()| Ok(take_kernel_times()?));
    time_kernels(false);
    let times = match times {
        Ok(t) => t,
        Err(e) => return println!("| {section}-kernels | {case} | error: {e} | - | - | - | - |"),
    };
    let total = times.iter().map(|k| k.secs).sum::<f64>() / per;
    let top: Vec<String> = times
        .iter()
        .take(6)
        .map(|k| {
            format!(
                "{} {:.1}x {:.3} ms",
                k.name,
                k.launches as f64 / per,
                k.secs / per * 1e3
            )
        })
        .collect();
    let share = wall.map_or_else(|| "-".to_owned(), |w| format!("{:.0}%", 100.0 * total / w));
    println!(
        "| {section}-kernels | {case} | {} | {:.3} ms in kernels, {share} of the row's time | - | - | - |",
        top.join(", "),
        total * 1e3
    );
}

/// The row said in place of a peer whose library is not installed.
fn missing(section: &str, lib: &str) {
    println!("| {section} | - | - | - | {lib} not found (LD_LIBRARY_PATH) | - | - |");
}

/// Deterministic values in [-1, 1) (a hash of the index: no RNG state to thread through).
fn values(n: usize, salt: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let x = (i ^ salt.rotate_left(17))
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_right(29);
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn launch_section(b: &Bench) -> Res<()> {
    // A one-element op: the per-call cost without CUDA graphs (launch, checks, read-backs).
    let mut x = b.dev.upload(1, 1, &[1.0f32])?;
    let ours = b.grng(|| Ok(b.dev.scale(1.0, &mut x)?));
    let peer = b.copy(1)?;
    row("launch", "scale of 1 element", &ours, &[peer], Work::Micros);
    // The same cost taken apart (issue 36 item 4): a bare launch queued, waited for, read
    // back, and as a node of a CUDA graph — what a step replayed as a graph would pay per
    // kernel instead of the eager launch-and-check.
    let a = launch_anatomy(&b.dev, 1000)?;
    let us = |s: f64| format!("{:.2} µs", s * 1e6);
    let graph = a.graph.map_or_else(|| "-".to_owned(), us);
    for (case, secs) in [
        ("fill of 1 float, 1000 queued, one sync", us(a.queued)),
        ("fill of 1 float, sync after each", us(a.waited)),
        (
            "fill of 1 float, 4-byte read-back after each",
            us(a.read_back),
        ),
        ("fill of 1 float, 1000 as one CUDA graph, per node", graph),
    ] {
        println!("| launch-anatomy | {case} | elementwise_fill | {secs} | - | - | - |");
    }
    // What a step no longer queues beside its kernels: a memset per output buffer, an upload
    // per batched launch's table.
    for (case, secs) in [
        ("zeroed alloc of 1 float + free, 1000 queued", us(a.zeroed)),
        ("unset alloc of 1 float + free, 1000 queued", us(a.unset)),
        ("upload of 44 bytes, 1000 queued", us(a.upload)),
    ] {
        println!("| launch-anatomy | {case} | - | {secs} | - | - | - |");
    }
    Ok(())
}

fn copy_section(b: &Bench) -> Res<()> {
    for n in b.o.sizes(&[10_000_000, 100_000_000]) {
        let ours = b.copy(n)?;
        row(
            "copy",
            &format!("n = {n}"),
            &ours,
            &[],
            Work::Bytes(8.0 * n as f64),
        );
    }
    Ok(())
}

fn adamw_section(b: &Bench) -> Res<()> {
    let dev = &b.dev;
    let c = AdamWCoeffs {
        lr: 1e-6,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        step: 1,
    };
    for n in b.o.sizes(&[10_000_000, 100_000_000]) {
        let mut p = dev.upload(1, n, &values(n, 1))?;
        let g = dev.upload(1, n, &values(n, 2))?;
        let mut m = dev.zeros(1, n)?;
        let mut v = dev.zeros(1, n)?;
        let ours = b.grng(|| Ok(dev.adamw_update(&mut p, &g, &mut m, &mut v, &c)?));
        // Reads θ, g, m, v and writes θ, m, v: 7 f32 per element. The copy moves 8 bytes per
        // element, so it is timed on 7n/2 elements to move the same bytes.
        let peer = b.copy(7 * n / 2)?;
        let work = Work::Bytes(28.0 * n as f64);
        row("adamw", &format!("n = {n}"), &ours, &[peer], work);
        // The multi-tensor step (what the optimizers run): the same n over one tensor, and
        // over a model's worth of ragged tensors (weights, biases, norms), in one launch.
        for count in [1, 97] {
            let shapes = model_shapes(n, count);
            let mut ps = shapes
                .iter()
                .enumerate()
                .map(|(t, &(r, c))| dev.upload(r, c, &values(r * c, 10 + t as u64)))
                .collect::<Result<Vec<_>, _>>()?;
            let gs = shapes
                .iter()
                .enumerate()
                .map(|(t, &(r, c))| dev.upload(r, c, &values(r * c, 500 + t as u64)))
                .collect::<Result<Vec<_>, _>>()?;
            let gs: Vec<&grng::Matrix> = gs.iter().collect();
            let mut st = MultiState::new(dev, &shapes, 2)?;
            let ours = b.grng(|| {
                let mut refs: Vec<&mut grng::Matrix> = ps.iter_mut().collect();
                Ok(dev.adamw_update_many(&mut refs, &gs, &mut st, &c)?)
            });
            let peer = b.copy(7 * n / 2)?;
            let case = format!("n = {n}, {count} tensors (multi-tensor step)");
            row("adamw", &case, &ours, &[peer], work);
        }
    }
    Ok(())
}

/// `count` tensor shapes holding `n` elements in all, ragged like a model's: pairs of a
/// `d x d`-ish weight and its bias-sized vector, odd lengths (float4 tails) included.
fn model_shapes(n: usize, count: usize) -> Vec<(usize, usize)> {
    if count == 1 {
        return vec![(1, n)];
    }
    let mut shapes = Vec::with_capacity(count);
    let mut left = n;
    for t in 0..count - 1 {
        let len = if t % 2 == 0 {
            (2 * n / count).min(left)
        } else {
            (n / (count * 1000) + 3).min(left)
        };
        shapes.push((1, len));
        left -= len;
    }
    shapes.push((1, left));
    shapes
}

fn gemm_f32_section(b: &Bench) -> Res<()> {
    let blas = cublas(b, "gemm-f32")?;
    for n in b.o.sizes(&[1024, 2048, 4096, 8192]) {
        let (ha, hb) = (values(n * n, 3), values(n * n, 4));
        let a = b.dev.upload(n, n, &ha)?;
        let bm = b.dev.upload(n, n, &hb)?;
        let mut c = b.dev.zeros(n, n)?;
        let ours = b.grng(|| {
            Ok(b.dev
                .gemm(Trans::No, Trans::No, 1.0, &a, &bm, 0.0, &mut c)?)
        });
        let work = Work::Flop(2.0 * (n as f64).powi(3));
        let case = format!("m = n = k = {n}");
        let Some(blas) = &blas else {
            row("gemm-f32", &case, &ours, &[], work);
            continue;
        };
        let s = b.cuda.stream();
        let da: CudaSlice<f32> = s.clone_htod(&ha)?;
        let db: CudaSlice<f32> = s.clone_htod(&hb)?;
        let mut dc: CudaSlice<f32> = s.alloc_zeros(n * n)?;
        // Row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ: swap the operands.
        let cfg = square_sgemm(n)?;
        for (name, mode) in sgemm_modes() {
            set_math_mode(blas, mode)?;
            // SAFETY: the three buffers hold n² f32 each, the leading dimensions are n.
            let peer = b.peer(name, || Ok(unsafe { blas.gemm(cfg, &db, &da, &mut dc) }?))?;
            row("gemm-f32", &case, &ours, &[peer], work);
        }
    }
    Ok(())
}

fn precond_section(b: &Bench) -> Res<()> {
    // P = Γ̃⁻¹ (G Λ̃⁻¹), all n x n: grng's two f32-accurate tensor-core products (split3)
    // beside two SGEMMs, and beside two TF32 GEMMs; 4n³ FLOPs.
    let blas = cublas(b, "precond")?;
    for n in b.o.sizes(&[1024, 2048, 4096, 8192]) {
        let (hg, hl, hx) = (values(n * n, 12), values(n * n, 13), values(n * n, 14));
        let (gi, g, li) = (
            b.dev.upload(n, n, &hg)?,
            b.dev.upload(n, n, &hx)?,
            b.dev.upload(n, n, &hl)?,
        );
        let mut p = b.dev.zeros(n, n)?;
        let ours = b.grng(|| Ok(b.dev.precondition(&gi, &g, &li, &mut p)?));
        let work = Work::Flop(4.0 * (n as f64).powi(3));
        let case = format!("d_out = d_in = {n}");
        let Some(blas) = &blas else {
            row("precond", &case, &ours, &[], work);
            continue;
        };
        let s = b.cuda.stream();
        let (dg, dx, dl) = (s.clone_htod(&hg)?, s.clone_htod(&hx)?, s.clone_htod(&hl)?);
        let mut dt: CudaSlice<f32> = s.alloc_zeros(n * n)?;
        let mut dp: CudaSlice<f32> = s.alloc_zeros(n * n)?;
        let cfg = square_sgemm(n)?;
        for (name, mode) in sgemm_modes() {
            set_math_mode(blas, mode)?;
            // Column-major: Tᵀ = Λ̃⁻ᵀ Gᵀ, Pᵀ = Tᵀ Γ̃⁻ᵀ (row-major T = G Λ̃⁻¹, P = Γ̃⁻¹ T).
            // SAFETY: every buffer holds n² f32, the leading dimensions are n.
            let peer = b.peer(format!("2 x {name}"), || unsafe {
                blas.gemm(cfg, &dl, &dx, &mut dt)?;
                Ok(blas.gemm(cfg, &dt, &dg, &mut dp)?)
            })?;
            row("precond", &case, &ours, &[peer], work);
        }
    }
    precond_accuracy(b)
}

/// Issue 36 item 3's accuracy row: the relative Frobenius error against f64 of one
/// f32-accurate product `G·Λ̃⁻¹` (n = 1024, values in [-1, 1)) by each candidate of the plan —
/// the split3 engine, cuBLAS SGEMM, bf16x3 — and by TF32 for contrast (the issue asks
/// ≤ 1e-6).
fn precond_accuracy(b: &Bench) -> Res<()> {
    use grng::cuda::{gemm::Split3, gemm_plan, gemm_vendor};
    let n = 1024;
    let (hx, hl) = (values(n * n, 14), values(n * n, 13));
    let want = host_gemm64(n, &hx, &hl);
    let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt();
    let (x, l) = (b.dev.upload(n, n, &hx)?, b.dev.upload(n, n, &hl)?);
    let p = MatMul::new(Trans::No, Trans::No, 1.0, &x, &l);
    let (sx, sl) = (Split3::new(&x), Split3::new(&l));
    let mut c = b.dev.zeros(n, n)?;
    let rel = |name: &str, c: &grng::Matrix| -> Res<()> {
        let got = c.to_vec()?;
        let err = got
            .iter()
            .zip(&want)
            .map(|(&g, &w)| (f64::from(g) - w).powi(2))
            .sum::<f64>()
            .sqrt();
        println!(
            "| precond-accuracy | G·Λ̃⁻¹, n = {n}, vs f64 | {name} | {:.2e} relative | - | - | - |",
            err / norm
        );
        Ok(())
    };
    grng::cuda::gemm::gemm3(&b.dev, p, 0.0, &mut c)?;
    rel("engine gemm3_tc (split3)", &c)?;
    gemm_plan::gemm3_bf16x3(&b.dev, p.with(&sx, &sl), 0.0, &mut c)?;
    rel("bf16x3 (plan's bf16 GEMM)", &c)?;
    if !gemm_vendor::available() {
        return Ok(());
    }
    gemm_vendor::gemm(&b.dev, p, 0.0, &mut c)?;
    rel("cublas SGEMM", &c)?;
    if let Some(blas) = cublas(b, "precond-accuracy")? {
        set_math_mode(&blas, cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH)?;
        let s = b.cuda.stream();
        let (dx, dl) = (s.clone_htod(&hx)?, s.clone_htod(&hl)?);
        let mut dc: CudaSlice<f32> = s.alloc_zeros(n * n)?;
        // SAFETY: the three buffers hold n² f32 each, the leading dimensions are n; column-major
        // Cᵀ = Λ̃⁻ᵀ Gᵀ is the row-major C = G Λ̃⁻¹.
        unsafe { blas.gemm(square_sgemm(n)?, &dl, &dx, &mut dc) }?;
        let tf32 = b.dev.upload(n, n, &s.clone_dtoh(&dc)?)?;
        rel("cublas TF32 (not f32-accurate)", &tf32)?;
    }
    Ok(())
}

/// Row-major `n x n` `A·B` in f64 on the host, rows spread over threads.
fn host_gemm64(n: usize, a: &[f32], b: &[f32]) -> Vec<f64> {
    let mut c = vec![0f64; n * n];
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let rows = n.div_ceil(threads);
    std::thread::scope(|scope| {
        for (t, chunk) in c.chunks_mut(rows * n).enumerate() {
            scope.spawn(move || {
                for (r, out) in chunk.chunks_mut(n).enumerate() {
                    let i = t * rows + r;
                    for l in 0..n {
                        let x = f64::from(a[i * n + l]);
                        for (o, &y) in out.iter_mut().zip(&b[l * n..(l + 1) * n]) {
                            *o += x * f64::from(y);
                        }
                    }
                }
            });
        }
    });
    c
}

/// Column-major `n x n` SGEMM `C = A B`, α = 1, β = 0.
fn square_sgemm(n: usize) -> Res<GemmConfig<f32>> {
    let ni = i32::try_from(n)?;
    Ok(GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: ni,
        n: ni,
        k: ni,
        alpha: 1.0f32,
        lda: ni,
        ldb: ni,
        beta: 0.0,
        ldc: ni,
    })
}

/// SGEMM and TF32 differ in precision: each is its own row, not a choice of peer.
fn sgemm_modes() -> [(&'static str, cublasMath_t); 2] {
    [
        ("cublasSgemm", cublasMath_t::CUBLAS_DEFAULT_MATH),
        ("cublasSgemm TF32", cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH),
    ]
}

fn set_math_mode(blas: &CudaBlas, mode: cublasMath_t) -> Res<()> {
    // SAFETY: a valid handle; the mode only selects the algorithm family.
    let st = unsafe { cublasSetMathMode(*blas.handle(), mode) };
    if st != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(format!("cublasSetMathMode: {st:?}").into());
    }
    Ok(())
}

/// Whether the CUDA library of cudarc module `sys` can be called. cudarc loads the libraries
/// on first use and would panic on a missing one (`is_culib_present` probes); a grng-candle `cuda`
/// build links them instead (cudarc's `dynamic-linking`, which has no probes), so a binary
/// that started has them.
macro_rules! culib_present {
    ($($sys:ident)::+) => {{
        #[cfg(not(feature = "cuda-linked"))]
        // SAFETY: only probes whether the library can be loaded (calls would panic otherwise).
        let present = unsafe { $($sys)::+::is_culib_present() };
        #[cfg(feature = "cuda-linked")]
        let present = true;
        present
    }};
}

/// A cuBLAS handle on grng's stream, or `None` (said in a row) when libcublas cannot be loaded.
fn cublas(b: &Bench, section: &str) -> Res<Option<CudaBlas>> {
    if culib_present!(cudarc::cublas::sys) {
        Ok(Some(CudaBlas::new(b.cuda.stream().clone())?))
    } else {
        missing(section, "cuBLAS");
        Ok(None)
    }
}

/// A column-major product `C = op(A)·op(B)` (`m x n`, inner `k`): bf16 `A`, `B` with leading
/// dimensions `lda`, `ldb`, f32 `C` with leading dimension `m`, f32 accumulation.
#[derive(Clone, Copy)]
struct Bf16Gemm {
    ops: (cublasOperation_t, cublasOperation_t),
    mnk: (usize, usize, usize),
    lda: usize,
    ldb: usize,
}

impl Bf16Gemm {
    /// `X·Yᵀ` (`n x n`) of column-major `X`, `Y` (`n x m`, ld n): the row-major `AᵀB` of two
    /// row-major `m x n` operands (`X = B`, `Y = A`, as `(B, A)`; `AᵀA` with `X = Y = A`).
    fn col_major_xyt(m: usize, n: usize) -> Self {
        Self {
            ops: (
                cublasOperation_t::CUBLAS_OP_N,
                cublasOperation_t::CUBLAS_OP_T,
            ),
            mnk: (n, n, m),
            lda: n,
            ldb: n,
        }
    }

    /// Stored rows (column-major: the leading dimension's extent) and columns of operand `A`
    /// (`first`) or `B`.
    fn stored(&self, first: bool) -> (u64, u64) {
        let (m, n, k) = self.mnk;
        let (op, rows, cols) = if first {
            (self.ops.0, m, k)
        } else {
            (self.ops.1, k, n)
        };
        if op == cublasOperation_t::CUBLAS_OP_N {
            (rows as u64, cols as u64)
        } else {
            (cols as u64, rows as u64)
        }
    }

    /// The product by `cublasGemmEx` (`CUBLAS_COMPUTE_32F`: tensor cores on bf16).
    fn gemm_ex(
        &self,
        b: &Bench,
        blas: &CudaBlas,
        x: &CudaSlice<bf16>,
        y: &CudaSlice<bf16>,
        c: &mut CudaSlice<f32>,
    ) -> Res<()> {
        let s = b.cuda.stream();
        let (m, n, k) = self.mnk;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (pa, _ra) = x.device_ptr(s);
        let (pb, _rb) = y.device_ptr(s);
        let (pc, _rc) = c.device_ptr_mut(s);
        // SAFETY: a valid handle; the caller's buffers hold the stored A, B (see `stored`) and
        // C m x n column-major with the given leading dimensions (C's is m); alpha and beta
        // are f32 as CUBLAS_COMPUTE_32F requires.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                self.ops.0,
                self.ops.1,
                i32::try_from(m)?,
                i32::try_from(n)?,
                i32::try_from(k)?,
                (&alpha as *const f32).cast(),
                pa as *const std::ffi::c_void,
                cudaDataType_t::CUDA_R_16BF,
                i32::try_from(self.lda)?,
                pb as *const std::ffi::c_void,
                cudaDataType_t::CUDA_R_16BF,
                i32::try_from(self.ldb)?,
                (&beta as *const f32).cast(),
                pc as *mut std::ffi::c_void,
                cudaDataType_t::CUDA_R_32F,
                i32::try_from(m)?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}

/// A cublasLt handle with its workspace (the size cudarc's own wrapper uses: 32 MiB on
/// Hopper, 4 MiB before).
struct Lt {
    handle: lts::cublasLtHandle_t,
    work: CudaSlice<u8>,
}

impl Lt {
    /// `None` (said in a row) when libcublasLt cannot be loaded.
    fn new(b: &Bench, section: &str) -> Res<Option<Self>> {
        if !culib_present!(lts) {
            missing(section, "cublasLt");
            return Ok(None);
        }
        let major = b.cuda.stream().context().attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )?;
        let bytes = if major >= 9 { 32 << 20 } else { 4 << 20 };
        Ok(Some(Self {
            handle: lt::create_handle()?,
            work: b.cuda.stream().alloc_zeros(bytes)?,
        }))
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once; a failure here has nothing left to undo.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// A [`Bf16Gemm`] planned for cublasLt: its descriptors and the heuristic's first algorithm,
/// chosen once (outside the timing, as a caller would cache it).
struct LtPlan<'a> {
    lt: &'a Lt,
    desc: lts::cublasLtMatmulDesc_t,
    layouts: [lts::cublasLtMatrixLayout_t; 3],
    algo: lts::cublasLtMatmulAlgo_t,
}

impl<'a> LtPlan<'a> {
    fn new(lt: &'a Lt, g: &Bf16Gemm) -> Res<Self> {
        use lts::cublasLtMatmulDescAttributes_t as Attr;
        let desc = lt::create_matmul_desc(
            lts::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lts::cudaDataType_t::CUDA_R_32F,
        )?;
        // The descriptors are owned by `plan` from here on: its Drop frees them on any error.
        let mut plan = Self {
            lt,
            desc,
            layouts: [std::ptr::null_mut(); 3],
            // SAFETY: a plain C struct of integers, overwritten by the heuristic below.
            algo: unsafe { std::mem::zeroed() },
        };
        for (attr, op) in [
            (Attr::CUBLASLT_MATMUL_DESC_TRANSA, g.ops.0),
            (Attr::CUBLASLT_MATMUL_DESC_TRANSB, g.ops.1),
        ] {
            let op = op as i32;
            // SAFETY: a live descriptor; TRANSA/TRANSB take a cublasOperation_t (an int).
            unsafe {
                lt::set_matmul_desc_attribute(
                    desc,
                    attr,
                    (&op as *const i32).cast(),
                    std::mem::size_of::<i32>(),
                )
            }?;
        }
        let (m, n, _) = g.mnk;
        let ((ar, ac), (br, bc)) = (g.stored(true), g.stored(false));
        let bf = lts::cudaDataType_t::CUDA_R_16BF;
        plan.layouts[0] = lt::create_matrix_layout(bf, ar, ac, i64::try_from(g.lda)?)?;
        plan.layouts[1] = lt::create_matrix_layout(bf, br, bc, i64::try_from(g.ldb)?)?;
        plan.layouts[2] = lt::create_matrix_layout(
            lts::cudaDataType_t::CUDA_R_32F,
            m as u64,
            n as u64,
            i64::try_from(m)?,
        )?;
        let pref = lt::create_matmul_pref()?;
        let size = lt.work.len();
        // SAFETY: a live preference; the attribute is a size_t.
        let r = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                lts::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&size as *const usize).cast(),
                std::mem::size_of::<usize>(),
            )
        }
        // SAFETY: live descriptors of this handle, D laid out as C.
        .and_then(|()| unsafe {
            lt::get_matmul_algo_heuristic(
                lt.handle,
                desc,
                plan.layouts[0],
                plan.layouts[1],
                plan.layouts[2],
                plan.layouts[2],
                pref,
            )
        });
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        plan.algo = r?.algo;
        Ok(plan)
    }

    fn run(
        &self,
        b: &Bench,
        x: &CudaSlice<bf16>,
        y: &CudaSlice<bf16>,
        c: &mut CudaSlice<f32>,
    ) -> Res<()> {
        let s = b.cuda.stream();
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (pa, _ra) = x.device_ptr(s);
        let (pb, _rb) = y.device_ptr(s);
        let (pc, _rc) = c.device_ptr_mut(s);
        let (pw, _rw) = self.lt.work.device_ptr(s);
        // SAFETY: the plan's layouts describe the caller's buffers (as for gemm_ex), C is
        // also D (β = 0), the workspace holds the bytes the heuristic was allowed, all on
        // grng's stream.
        unsafe {
            lt::matmul(
                self.lt.handle,
                self.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                pa as *const _,
                self.layouts[0],
                pb as *const _,
                self.layouts[1],
                pc as *const _,
                self.layouts[2],
                pc as *mut _,
                self.layouts[2],
                &self.algo,
                pw as *mut _,
                self.lt.work.len(),
                s.cu_stream() as *mut _,
            )
        }?;
        Ok(())
    }
}

impl Drop for LtPlan<'_> {
    fn drop(&mut self) {
        // SAFETY: created in `new` (null ones skipped), destroyed once; nothing to undo on
        // failure.
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// The vendor peers of one bf16 product on device buffers `x` (its `A`) and `y` (its `B`):
/// `cublasGemmEx` and cublasLt, whichever libraries are present.
fn bf16_peers(
    b: &Bench,
    libs: &(Option<CudaBlas>, Option<Lt>),
    g: Bf16Gemm,
    (x, y): (&CudaSlice<bf16>, &CudaSlice<bf16>),
    what: &str,
) -> Res<Vec<Timed>> {
    let mut c: CudaSlice<f32> = b.cuda.stream().alloc_zeros(g.mnk.0 * g.mnk.1)?;
    let mut peers = Vec::new();
    if let Some(blas) = &libs.0 {
        let label = format!("cublasGemmEx bf16 → f32{what}");
        peers.push(b.peer(label, || g.gemm_ex(b, blas, x, y, &mut c))?);
    }
    if let Some(lt) = &libs.1 {
        let plan = LtPlan::new(lt, &g)?;
        let label = format!("cublasLtMatmul bf16 → f32{what}");
        peers.push(b.peer(label, || plan.run(b, x, y, &mut c))?);
    }
    Ok(peers)
}

fn gemm_bf16_section(b: &Bench) -> Res<()> {
    // C = AᵀB for bf16 A, B of m x n, f32 C of n x n: the batch gradient's shape (EᵀA, inner
    // dimension the batch) and the full product SYRK halves, through Device::gemm (finiteness
    // checks and the overflow-safe commit included) and through the bare launcher.
    let libs = (cublas(b, "gemm-bf16")?, Lt::new(b, "gemm-bf16")?);
    let m = 4096;
    for n in b.o.sizes(&[1024, 2048, 4096, 8192]) {
        let (ha, hb) = (to_bf16(&values(m * n, 5)), to_bf16(&values(m * n, 6)));
        let a = b.dev.upload(m, n, &ha)?;
        let bm = b.dev.upload(m, n, &hb)?;
        let mut c = b.dev.zeros(n, n)?;
        let op = b.grng(|| {
            Ok(b.dev
                .gemm(Trans::Yes, Trans::No, 1.0, &a, &bm, 0.0, &mut c)?)
        });
        let bare = b.grng(|| {
            let p = MatMul::new(Trans::Yes, Trans::No, 1.0, &a, &bm);
            Ok(gemm_tc(&b.dev, p, 0.0, &mut c)?)
        });
        let s = b.cuda.stream();
        let da: CudaSlice<bf16> = s.clone_htod(&ha)?;
        let db: CudaSlice<bf16> = s.clone_htod(&hb)?;
        // Row-major A (m x n) is column-major Aᵀ (n x m, ld n), so row-major C = AᵀB is
        // column-major Cᵀ = BᵀA = op_N(B_cm)·op_T(A_cm).
        let g = Bf16Gemm::col_major_xyt(m, n);
        let peers = bf16_peers(b, &libs, g, (&db, &da), "")?;
        let work = Work::Flop(2.0 * m as f64 * (n as f64).powi(2));
        for (ours, how) in [(&op, "Device::gemm"), (&bare, "cuda::gemm::gemm_tc")] {
            let case = format!("AᵀB, bf16 A, B m = {m} x n = {n}, f32 out ({how})");
            row("gemm-bf16", &case, ours, &peers, work);
        }
    }
    Ok(())
}

fn syrk_section(b: &Bench) -> Res<()> {
    // grng computes the lower triangle only; the peer is the full AᵀA GEMM, and both rates
    // count the full product's 2·m·n² FLOPs (so the ratio is the time ratio).
    let libs = (cublas(b, "syrk")?, Lt::new(b, "syrk")?);
    let m = 4096;
    for n in b.o.sizes(&[1024, 2048, 4096, 8192]) {
        let ha = to_bf16(&values(m * n, 7));
        let a = b.dev.upload(m, n, &ha)?;
        let mut factor = b.dev.zeros(n, n)?;
        // ε = 0 replaces the factor (Device::syrk_ema: finiteness checks and the
        // overflow-safe commit included), and the bare launcher: the kernel alone.
        let op = b.grng(|| Ok(b.dev.syrk_ema(&a, 0.0, &mut factor)?));
        let bare = b.grng(|| Ok(syrk_ema_tc(&b.dev, &a, 0.0, &mut factor)?));
        let da: CudaSlice<bf16> = b.cuda.stream().clone_htod(&ha)?;
        // Row-major A (m x n) is column-major X = Aᵀ (n x m, ld n): AᵀA = X·Xᵀ.
        let g = Bf16Gemm::col_major_xyt(m, n);
        let peers = bf16_peers(b, &libs, g, (&da, &da), ", full AᵀA")?;
        let work = Work::Flop(2.0 * m as f64 * (n as f64).powi(2));
        for (ours, how) in [
            (&op, "Device::syrk_ema"),
            (&bare, "cuda::syrk::syrk_ema_tc"),
        ] {
            let case = format!("bf16 A m = {m}, n = {n} ({how})");
            row("syrk", &case, ours, &peers, work);
        }
    }
    Ok(())
}

fn sym_section(b: &Bench) -> Res<()> {
    // The optimizers' symmetric f32-accurate products (Grams, E·Γ̃⁻¹·Eᵀ): grng's mirrored
    // split3 product (the lower-triangle tiles, `Epilogue3::mirror`; through the plan, and
    // the engine bare) beside cublasSsyrk (the vendor's triangle) and the full SGEMM and
    // TF32 AᵀA. Every rate counts the full product's 2·m·n² FLOPs (the ratio is the time
    // ratio), as the syrk rows.
    use grng::cuda::gemm::{self as engine, Epilogue3, Split3};
    use grng::cuda::{gemm_plan, gemm_vendor};
    let blas = cublas(b, "sym")?;
    let m = 4096;
    let mirror = Epilogue3 {
        planes: None,
        mirror: true,
    };
    for n in b.o.sizes(&[1024, 2048, 4096]) {
        let ha = values(m * n, 17);
        let a = b.dev.upload(m, n, &ha)?;
        let sa = Split3::new(&a);
        let p = MatMul::new(Trans::Yes, Trans::No, 1.0, &sa, &sa);
        let plan = b.grng(|| {
            gemm_plan::product3_checked(&b.dev, "bench", p, mirror)?;
            Ok(())
        });
        let mut c = b.dev.zeros(n, n)?;
        let bare = b.grng(|| {
            Ok(engine::product3_checked(
                &b.dev, "bench", p, &mut c, mirror,
            )?)
        });
        let work = Work::Flop(2.0 * m as f64 * (n as f64).powi(2));
        let mut peers = Vec::new();
        if gemm_vendor::available() {
            peers.push(b.peer("cublasSsyrk (triangle)", || {
                Ok(gemm_vendor::syrk_ema(&b.dev, &a, 0.0, &mut c)?)
            })?);
        }
        if let Some(blas) = &blas {
            let s = b.cuda.stream();
            let da: CudaSlice<f32> = s.clone_htod(&ha)?;
            let mut dc: CudaSlice<f32> = s.alloc_zeros(n * n)?;
            let (ni, mi) = (i32::try_from(n)?, i32::try_from(m)?);
            // Row-major A (m x n) is column-major X = Aᵀ (n x m, ld n): AᵀA = X·Xᵀ.
            let cfg = GemmConfig {
                transa: cublasOperation_t::CUBLAS_OP_N,
                transb: cublasOperation_t::CUBLAS_OP_T,
                m: ni,
                n: ni,
                k: mi,
                alpha: 1.0f32,
                lda: ni,
                ldb: ni,
                beta: 0.0,
                ldc: ni,
            };
            for (name, mode) in sgemm_modes() {
                set_math_mode(blas, mode)?;
                // SAFETY: da holds m·n f32 (X: n x m, ld n), dc n² (ld n).
                let full = format!("{name}, full AᵀA");
                peers.push(b.peer(full, || Ok(unsafe { blas.gemm(cfg, &da, &da, &mut dc) }?))?);
            }
        }
        for (ours, how) in [(&plan, "plan"), (&bare, "engine")] {
            let case = format!("f32-accurate AᵀA, m = {m}, n = {n} (mirrored, {how})");
            row("sym", &case, ours, &peers, work);
        }
    }
    Ok(())
}

/// Row-major `n x n` SPD matrix `Q diag(λ) Qᵀ`, `λ` geometric from 1 to `kappa` (so its
/// condition number is `kappa`), `Q` the product of three Householder reflectors.
fn spd(n: usize, kappa: f64, salt: u64) -> Vec<f32> {
    let mut a = vec![0f64; n * n];
    for i in 0..n {
        a[i * n + i] = kappa.powf(i as f64 / (n - 1).max(1) as f64);
    }
    for r in 0..3 {
        // A ← H A H with H = I − β v vᵀ, β = 2/(vᵀv): A − v qᵀ − q vᵀ for p = β A v,
        // q = p − (β/2)(vᵀp) v.
        let v: Vec<f64> = values(n, salt + r).iter().map(|&x| x as f64).collect();
        let beta = 2.0 / v.iter().map(|x| x * x).sum::<f64>();
        let p: Vec<f64> = (0..n)
            .map(|i| beta * (0..n).map(|j| a[i * n + j] * v[j]).sum::<f64>())
            .collect();
        let k = beta / 2.0 * v.iter().zip(&p).map(|(x, y)| x * y).sum::<f64>();
        let q: Vec<f64> = p.iter().zip(&v).map(|(p, v)| p - k * v).collect();
        for i in 0..n {
            for j in 0..n {
                a[i * n + j] -= v[i] * q[j] + q[i] * v[j];
            }
        }
    }
    a.iter().map(|&x| x as f32).collect()
}

/// `‖I − AX‖_F / √n` (the measure of `NewtonInfo::residual`) with the product `A·X` formed by
/// grng's f32 GEMM, the same for every row.
fn residual(dev: &Device, a: &grng::Matrix, x: &grng::Matrix) -> Res<f64> {
    let n = a.rows();
    let mut ax = dev.zeros(n, n)?;
    dev.gemm(Trans::No, Trans::No, 1.0, a, x, 0.0, &mut ax)?;
    let ax = ax.to_vec()?;
    let mut sum = 0f64;
    for i in 0..n {
        for j in 0..n {
            let e = f64::from(i == j) - ax[i * n + j] as f64;
            sum += e * e;
        }
    }
    Ok((sum / n as f64).sqrt())
}

/// cuSOLVER's Cholesky inverse `potrf` + `potri` of an SPD `n x n` matrix, or the reason
/// there is none (library not found).
struct Solver {
    handle: cudarc::cusolver::safe::DnHandle,
}

impl Solver {
    fn new(cuda: &CudaDevice) -> Res<Option<Self>> {
        if !culib_present!(cudarc::cusolver::sys) {
            missing("newton", "cuSOLVER");
            return Ok(None);
        }
        Ok(Some(Self {
            handle: cudarc::cusolver::safe::DnHandle::new(cuda.stream().clone())?,
        }))
    }

    /// Copies `a` into `w` and overwrites `w`'s `fill` triangle (column-major; `Lower` is
    /// the row-major upper one) with `a⁻¹`'s; `work` is resized as cuSOLVER asks.
    #[allow(clippy::too_many_arguments)]
    fn inverse(
        &self,
        cuda: &CudaDevice,
        n: usize,
        fill: cudarc::cusolver::sys::cublasFillMode_t,
        a: &CudaSlice<f32>,
        w: &mut CudaSlice<f32>,
        work: &mut CudaSlice<f32>,
        info: &mut CudaSlice<i32>,
    ) -> Res<()> {
        use cudarc::cusolver::sys::{self as cs, cusolverStatus_t};
        let s = cuda.stream();
        s.memcpy_dtod(a, w)?;
        let ni = i32::try_from(n)?;
        let check = |st: cusolverStatus_t, what: &str| -> Res<()> {
            if st == cusolverStatus_t::CUSOLVER_STATUS_SUCCESS {
                Ok(())
            } else {
                Err(format!("{what}: {st:?}").into())
            }
        };
        let h = self.handle.cu();
        let (mut l1, mut l2) = (0i32, 0i32);
        {
            let (pw, _rw) = w.device_ptr_mut(s);
            // SAFETY: a valid handle; w holds n x n f32 with leading dimension n.
            check(
                unsafe {
                    cs::cusolverDnSpotrf_bufferSize(h, fill, ni, pw as *mut f32, ni, &mut l1)
                },
                "cusolverDnSpotrf_bufferSize",
            )?;
            // SAFETY: as above.
            check(
                unsafe {
                    cs::cusolverDnSpotri_bufferSize(h, fill, ni, pw as *mut f32, ni, &mut l2)
                },
                "cusolverDnSpotri_bufferSize",
            )?;
        }
        let need = usize::try_from(l1.max(l2).max(1))?;
        if work.len() < need {
            *work = s.alloc_zeros(need)?;
        }
        let lwork = i32::try_from(work.len())?;
        let (pw, _rw) = w.device_ptr_mut(s);
        let (pk, _rk) = work.device_ptr_mut(s);
        let (pi, _ri) = info.device_ptr_mut(s);
        // `potrf`, then `potri` on its factor: the same arguments.
        macro_rules! factor_step {
            ($f:ident) => {
                check(
                    // SAFETY: w is n x n (ld n), work holds lwork f32 (at least what cuSOLVER
                    // asked for), info one int; all on the handle's stream.
                    unsafe {
                        cs::$f(
                            h,
                            fill,
                            ni,
                            pw as *mut f32,
                            ni,
                            pk as *mut f32,
                            lwork,
                            pi as *mut i32,
                        )
                    },
                    stringify!($f),
                )?
            };
        }
        factor_step!(cusolverDnSpotrf);
        factor_step!(cusolverDnSpotri);
        Ok(())
    }
}

fn newton_section(b: &Bench) -> Res<()> {
    let (dev, cuda) = (&b.dev, &b.cuda);
    let solver = Solver::new(cuda)?;
    for n in b.o.sizes(&[512, 1024, 2048, 4096]) {
        for kappa in [33.0, 1000.0] {
            let ha = spd(n, kappa, 8);
            let a = dev.upload(n, n, &ha)?;
            // The cuSOLVER peers and their residuals, once per matrix: both fill modes, since
            // grng's row-major lower triangle is cuSOLVER's upper one (`cuda::cholesky`), and
            // the two run different code; the faster is the ratio's peer.
            let mut peers = Vec::new();
            if let Some(solver) = &solver {
                use cudarc::cusolver::sys::cublasFillMode_t as Fill;
                let s = cuda.stream();
                let da: CudaSlice<f32> = s.clone_htod(&ha)?;
                let mut w: CudaSlice<f32> = s.alloc_zeros(n * n)?;
                let mut work: CudaSlice<f32> = s.alloc_zeros(1)?;
                let mut info: CudaSlice<i32> = s.alloc_zeros(1)?;
                for (fill, label) in [
                    (Fill::CUBLAS_FILL_MODE_LOWER, "lower"),
                    (Fill::CUBLAS_FILL_MODE_UPPER, "upper (grng's)"),
                ] {
                    let mut t = b.peer(
                        format!("cusolverDnSpotrf+Spotri {label} (+ copy of A)"),
                        || solver.inverse(cuda, n, fill, &da, &mut w, &mut work, &mut info),
                    )?;
                    let code = s.clone_dtoh(&info)?[0];
                    let mut x = s.clone_dtoh(&w)?;
                    // Mirror the row-major triangle that holds a⁻¹ onto the other one.
                    let upper_holds = fill == Fill::CUBLAS_FILL_MODE_LOWER;
                    for i in 0..n {
                        for j in 0..i {
                            if upper_holds {
                                x[i * n + j] = x[j * n + i];
                            } else {
                                x[j * n + i] = x[i * n + j];
                            }
                        }
                    }
                    t.note = if code == 0 {
                        format!("res {:.1e}", residual(dev, &a, &dev.upload(n, n, &x)?)?)
                    } else {
                        format!("devInfo {code}")
                    };
                    peers.push(t);
                }
            }
            for (name, precision) in [("f32", Precision::F32), ("bf16", Precision::Bf16)] {
                // The smallest eigenvalue is known (1): given as λ_low, as a damping would be.
                let opts = NewtonOptions {
                    precision,
                    lambda_low: 1.0,
                    ..NewtonOptions::default()
                };
                let mut last = None;
                let mut ours = b.grng(|| {
                    last = Some(dev.newton_inverse(&a, None, &opts)?);
                    Ok(())
                });
                if let Some((x, info)) = &last {
                    ours.note = format!(
                        "res {:.1e} ({} it, own {:.1e})",
                        residual(dev, &a, x)?,
                        info.iterations,
                        info.residual
                    );
                }
                let case = format!("{name}, n = {n}, κ = {kappa}");
                row("newton", &case, &ours, &peers, Work::Millis);
                if ours.secs.is_some() {
                    kernel_row("newton", &case, ours.secs, 1.0, || {
                        dev.newton_inverse(&a, None, &opts)?;
                        Ok(())
                    });
                }
            }
            // grng's own cuSOLVER path (potrf + potri + mirror, with its checks) beside the
            // bare calls: issue 9's target is ≤ 1.2x.
            let mut last = None;
            let mut ours = b.grng(|| {
                last = Some(dev.cholesky_inverse(&a)?);
                Ok(())
            });
            if let Some(x) = &last {
                ours.note = format!("res {:.1e}", residual(dev, &a, x)?);
            }
            row(
                "cholesky",
                &format!("n = {n}, κ = {kappa}"),
                &ours,
                &peers,
                Work::Millis,
            );
        }
    }
    Ok(())
}

fn kalman_section(b: &Bench) -> Res<()> {
    let dev = &b.dev;
    for n in b.o.sizes(&[1_000_000, 10_000_000, 50_000_000]) {
        // d_o = 256 (the wide path: global-memory solve, H staged in shared memory) at the
        // smallest size only: H is 4·256·n bytes.
        for d_o in [10, 64, 256]
            .into_iter()
            .filter(|&d| d <= 64 || n <= 1_000_000)
        {
            let h = values(d_o * n, 10);
            let h32 = dev.upload(d_o, n, &h)?;
            kalman_case(b, n, d_o, &h32, "f32 H")?;
            drop(h32);
            kalman_case(b, n, d_o, &dev.upload(d_o, n, &to_bf16(&h))?, "bf16 H")?;
        }
    }
    Ok(())
}

/// One Kalman row: repeated steps of one filter on the `d_o x n` Jacobian `h`.
fn kalman_case<T: JacobianElement>(
    b: &Bench,
    n: usize,
    d_o: usize,
    h: &grng::Matrix<T>,
    label: &str,
) -> Res<()> {
    let dev = &b.dev;
    let opts = KalmanOptions::default();
    let mut state = KalmanState::new(dev, &values(n, 9), 0.1, d_o)?;
    let v = dev.upload(d_o, 1, &values(d_o, 11))?;
    // Each call is a further step of the same filter (σ shrinks, R follows its EMA); the
    // scratch is allocated by the first (warm-up) step.
    let ours = b.grng(|| {
        dev.kalman_step(&mut state, h, &v, &opts)?;
        Ok(())
    });
    // The bytes the step must move: H twice (the Gram pass, then the update once the d_o x d_o
    // solve has S), σ twice, μ once, μ and σ written: n(2·d_o·e + 20) bytes, e = 4 (f32 H) or
    // 2 (bf16 H). The copy moves 8 bytes per f32 element: timed on bytes / 8 elements.
    let bytes = n * (2 * d_o * std::mem::size_of::<T>() + 20);
    let peer = b.copy(bytes / 8)?;
    let case = format!("n = {n}, d_o = {d_o}, {label}");
    row("kalman", &case, &ours, &[peer], Work::Bytes(bytes as f64));
    Ok(())
}

fn step_section(b: &Bench) -> Res<()> {
    let dev = &b.dev;
    // (name, batch m, [(d_out, d_in)] of the weights, bias column included).
    let models = [
        // The launch-bound regime: the main job's small MLP (issue 10: at most the CPU's time).
        ("MLP 64-64-10", 64usize, vec![(64, 65), (10, 65)]),
        (
            "MLP 784-1024-1024-10",
            256,
            vec![(1024, 785), (1024, 1025), (10, 1025)],
        ),
        ("3 x 4096x4096", 1024, vec![(4096, 4096); 3]),
    ];
    for (model, m, shapes) in &models {
        // Statistics and gradients already on the device, as after a forward/backward pass.
        let mut mats = Vec::new();
        for (l, &(d_out, d_in)) in shapes.iter().enumerate() {
            let salt = 100 + 4 * l as u64;
            let a = dev.upload(*m, d_in, &values(m * d_in, salt))?;
            let e = dev.upload(*m, d_out, &values(m * d_out, salt + 1))?;
            let g = dev.upload(d_out, d_in, &values(d_out * d_in, salt + 2))?;
            let w = dev.upload(d_out, d_in, &values(d_out * d_in, salt + 3))?;
            mats.push((a, e, g, w));
        }
        let stats: Vec<KronStats<'_>> =
            mats.iter().map(|(a, e, _, _)| KronStats { a, e }).collect();
        // RENG's regularized gradient is dense; RING and NGD take the batch factors of
        // `G = (1/m) EᵀA`, as the trainer hands them over (`KronGrad::Factored`).
        let dense: Vec<KronGrad<'_>> = mats.iter().map(|(_, _, g, _)| KronGrad::Dense(g)).collect();
        let factored: Vec<KronGrad<'_>> = mats
            .iter()
            .map(|(a, e, _, _)| KronGrad::Factored { e, a })
            .collect();
        for (variant, base, grads) in [
            ("RING", KronConfig::ring(), &factored),
            ("RENG", KronConfig::reng(), &dense),
            ("NGD", KronConfig::ngd(), &factored),
        ] {
            // `T`: the Levenberg–Marquardt interval (`KronConfig::damping_interval`); with
            // `T = 5` four steps in five skip the model's products.
            for (skip, interval) in [(1, 1), (8, 1), (8, 5)] {
                let cfg = KronConfig {
                    skip,
                    damping_interval: interval,
                    ..base
                };
                let mut opt = KronOptimizer::new(dev, shapes, cfg)?;
                let mut params: Vec<grng::Matrix> = mats
                    .iter()
                    .map(|(_, _, _, w)| w.try_clone())
                    .collect::<Result<_, _>>()?;
                // One call is S steps (one refresh, S − 1 reuses): the time is per call / S,
                // the amortized cost of a step.
                let mut cycle = || -> Res<()> {
                    for _ in 0..skip {
                        let st = opt.needs_stats().then_some(&stats[..]);
                        opt.step_grads(&mut params, grads, st)?;
                    }
                    Ok(())
                };
                // Launches per step: times the `launch` section's cost per launch, the step's
                // launch overhead (eager launches; CUDA graphs are not done, docs/gpu.md).
                // Read-backs per step (each a stream synchronization): a lazy step's checks
                // are read once (`Device::deferred`); a refresh adds Newton's stop scalars.
                record_launches(true);
                let reads0 = read_backs();
                let counted = cycle();
                let reads = (read_backs() - reads0) as f64 / skip as f64;
                let launches = take_launches().len() / skip;
                record_launches(false);
                let mut ours = match counted {
                    Ok(()) => b.grng(&mut cycle),
                    Err(e) => Timed::none(format!("error: {e}")),
                };
                ours.secs = ours.secs.map(|s| s / skip as f64);
                ours.note = format!("per step, {launches} launches, {reads:.1} read-backs");
                let case = format!("{variant}, S = {skip}, T = {interval}, {model}, m = {m}");
                row("step", &case, &ours, &[], Work::Millis);
                if ours.secs.is_some() {
                    kernel_row("step", &case, ours.secs, skip as f64, &mut cycle);
                }
            }
        }
    }
    Ok(())
}

/// Where a small factor is refreshed (`KronConfig::host_refresh_max`): one `n x n` layer at
/// `S = 1` (every step forms both factors, RING's norms or NGD's traces, and both inverses),
/// its step with the factors refreshed on the host beside the same step with them on the
/// device (Newton, power iteration), in the same run. The ratio (host / device) below 1 is
/// where the host route wins: the default `HOST_REFRESH_MAX` (128) is designed, not measured,
/// and this row sets it.
fn refresh_section(b: &Bench) -> Res<()> {
    let dev = &b.dev;
    let m = 64;
    for n in b.o.sizes(&[32, 128, 512]) {
        let a = dev.upload(m, n, &values(m * n, 300))?;
        let e = dev.upload(m, n, &values(m * n, 301))?;
        let w = dev.upload(n, n, &values(n * n, 302))?;
        let stats = [KronStats { a: &a, e: &e }];
        let grads = [KronGrad::Factored { e: &e, a: &a }];
        for (variant, base) in [("RING", KronConfig::ring()), ("NGD", KronConfig::ngd())] {
            let optimizer = |host_refresh_max| -> Res<_> {
                let cfg = KronConfig {
                    skip: 1,
                    host_refresh_max,
                    ..base
                };
                Ok((
                    KronOptimizer::new(dev, &[(n, n)], cfg)?,
                    vec![w.try_clone()?],
                ))
            };
            let (mut opt, mut params) = optimizer(usize::MAX)?;
            let host = b.grng(|| {
                opt.step_grads(&mut params, &grads, Some(&stats))?;
                Ok(())
            });
            let (mut opt, mut params) = optimizer(0)?;
            let device = b.peer("device route (Newton, power iteration)", || {
                opt.step_grads(&mut params, &grads, Some(&stats))?;
                Ok(())
            });
            let device = device.unwrap_or_else(|e| Timed::none(format!("error: {e}")));
            let case = format!("{variant}, S = 1, one {n} x {n} layer, m = {m}, host route");
            row("refresh", &case, &host, &[device], Work::Millis);
        }
    }
    Ok(())
}

/// The sections in the order they run.
const SECTIONS: [(&str, Section); 12] = [
    ("launch", launch_section),
    ("copy", copy_section),
    ("adamw", adamw_section),
    ("gemm-f32", gemm_f32_section),
    ("gemm-bf16", gemm_bf16_section),
    ("precond", precond_section),
    ("syrk", syrk_section),
    ("sym", sym_section),
    ("newton", newton_section),
    ("kalman", kalman_section),
    ("step", step_section),
    // Last: a bench cut short by its deadline loses these rows before the step rows.
    ("refresh", refresh_section),
];

/// `--deadline=SECS`: a thread that, `secs` after the start, prints the bench's closing tables
/// (what the plan decided so far, the libraries mapped) and ends the process with status 124
/// (a timeout's), wherever the sections are. Rows are printed whole (`println!` holds stdout
/// for the line), so every row above the note is complete.
fn watchdog(secs: f64) {
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs_f64(secs));
        println!(
            "\ngpu bench: stopped at --deadline={secs} s: the rest of the section of the last row above, \
             and every section after it, did not run"
        );
        print_plan_choices();
        print_loaded_libraries();
        std::process::exit(124);
    });
}

fn main() -> Res<()> {
    let o = Opts::parse();
    // A filter that selects nothing would spend a GPU lease on the self-checks alone.
    if let Some(f) = &o.filter {
        if !SECTIONS.iter().any(|(name, _)| name.contains(f.as_str())) {
            let names: Vec<&str> = SECTIONS.iter().map(|(n, _)| *n).collect();
            eprintln!(
                "gpu bench: no section matches {f:?}; sections: {}",
                names.join(", ")
            );
            std::process::exit(2);
        }
    }
    if let Some(secs) = o.deadline {
        watchdog(secs);
    }
    let cuda = match CudaDevice::new(0) {
        Ok(c) => c,
        Err(e) => {
            println!("gpu bench: no GPU ({e}); nothing measured");
            return Ok(());
        }
    };
    let b = Bench {
        dev: Device::Cuda(cuda.clone()),
        cuda,
        o,
    };
    // The GEMM path (and its one-time self-check) is decided before anything is timed.
    let sm90 = grng::cuda::check_sm90(&b.dev)?;
    println!(
        "GEMM mainloop: {} (sm_90a fallbacks: {})\n",
        if sm90 {
            "sm_90a wgmma"
        } else {
            "sm_80 mma.sync"
        },
        grng::cuda::sm90::fallbacks()
    );
    println!("| section | case | grng kernel | grng | peer | peer | ratio (time, grng / peer) |");
    println!("|---|---|---|---|---|---|---|");
    for (name, section) in SECTIONS {
        if b.o.runs(name) {
            section(&b)?;
        }
    }
    print_plan_choices();
    print_loaded_libraries();
    Ok(())
}

/// The GEMM plan's decisions of this run (`grng::cuda::gemm_plan`): per product and shape
/// class, the candidate kept and the trial's median times (`-`: not a candidate of that plan,
/// or it failed) with the largest difference from the engine over its bound.
fn print_plan_choices() {
    use grng::cuda::gemm_plan::Candidate;
    println!(
        "\n| GEMM plan | shape class (log2 m, n, k) | kept | engine | cuBLAS | bf16x3 | max ‖ΔC‖ / bound |"
    );
    println!("|---|---|---|---|---|---|---|");
    for c in grng::cuda::gemm_plan::choices() {
        let class = format!("{}, {}, {}", c.class.m, c.class.n, c.class.k);
        let times = match c.trial {
            Some(t) => {
                let ms = |x: Candidate| {
                    t.secs(x)
                        .map_or("-".into(), |s| format!("{:.3} ms", s * 1e3))
                };
                let worst = Candidate::ALL
                    .into_iter()
                    .filter(|&x| t.secs(x).is_some())
                    .map(|x| t.difference[x as usize] / t.bound[x as usize])
                    .fold(0.0, f64::max);
                format!(
                    "{} | {} | {} | {worst:.2e}",
                    ms(Candidate::Engine),
                    ms(Candidate::Vendor),
                    ms(Candidate::Bf16x3)
                )
            }
            None if c.cached => "from GRNG_GEMM_CACHE | - | - | -".into(),
            None => "forced (GRNG_GEMM) | - | - | -".into(),
        };
        println!("| {:?} | {class} | {:?} | {times} |", c.plan, c.candidate);
    }
}

/// One `loaded: PATH` line per NVIDIA library this process mapped (the real files, so the
/// version is in the name): which cuBLAS, cublasLt and cuSOLVER the peers' numbers came from.
fn print_loaded_libraries() {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut seen: Vec<&str> = Vec::new();
    for path in maps.lines().filter_map(|l| l.split_whitespace().nth(5)) {
        let file = path.rsplit('/').next().unwrap_or(path);
        let ours = ["libcuda.", "libnvrtc", "libcublas", "libcusolver"]
            .iter()
            .any(|p| file.starts_with(p));
        if ours && !seen.contains(&path) {
            seen.push(path);
            println!("loaded: {path}");
        }
    }
}
