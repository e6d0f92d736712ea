//! GPU benchmark: grng's device ops beside the vendor library (cuBLAS) or the bandwidth
//! ceiling (a device-to-device copy), on the same GPU, sizes and run.
//!
//! `cargo bench --bench gpu -- [SECTION] [--quick]`; sections: `launch`, `copy`, `adamw`,
//! `gemm-f32`, `gemm-bf16`, `syrk`, `newton`, `kalman`, `step`. Every timing is the median of samples taken after warm-up, each sample a batch
//! of calls closed by a device synchronization. A grng row names the kernels the op launched
//! (`grng::cuda::launch::take_launches`) and prints no number when it launched none (a host
//! fallback). Without a GPU it says so and exits 0. Results: `docs/gpu-benchmarks.md`.
//!
//! cuBLAS and cuSOLVER are loaded dynamically through cudarc's `cublas` and `cusolver`
//! features, enabled for the benches only (dev-dependency features): the library never needs
//! them.

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasMath_t, cublasOperation_t, cublasSetMathMode,
    cublasStatus_t, cudaDataType_t,
};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use grng::cuda::launch::{record_launches, take_launches};
use grng::cuda::newton::{product_tc, Epilogue, Unused};
use grng::cuda::CudaDevice;
use grng::ops::elementwise::AdamWCoeffs;
use grng::ops::kalman::{KalmanOptions, KalmanState};
use grng::ops::newton::{NewtonOptions, Precision};
use grng::optim::kron::{KronConfig, KronOptimizer};
use grng::optim::KronStats;
use grng::{Device, Trans};
use half::bf16;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct Opts {
    filter: Option<String>,
    quick: bool,
}

impl Opts {
    fn parse() -> Self {
        let mut o = Self {
            filter: None,
            quick: false,
        };
        // `cargo bench` appends `--bench`; other flags are ignored for the same reason.
        for a in std::env::args().skip(1) {
            match a.as_str() {
                "--quick" => o.quick = true,
                s if s.starts_with('-') => {}
                s => o.filter = Some(s.to_owned()),
            }
        }
        o
    }

    fn runs(&self, section: &str) -> bool {
        self.filter.as_deref().map_or(true, |f| section.contains(f))
    }

    fn samples(&self) -> usize {
        if self.quick {
            5
        } else {
            15
        }
    }
}

/// Median seconds per call of `f`: warm-up, then samples of `reps` calls each, the batch size
/// chosen so a sample lasts about 2 ms; the device is synchronized around every sample.
fn median_secs(cuda: &CudaDevice, samples: usize, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    for _ in 0..3 {
        f()?;
    }
    cuda.synchronize()?;
    let t = Instant::now();
    f()?;
    cuda.synchronize()?;
    let once = t.elapsed().as_secs_f64();
    let reps = (2e-3 / once.max(1e-9)).ceil().clamp(1.0, 1000.0) as usize;
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        cuda.synchronize()?;
        let t = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        cuda.synchronize()?;
        times.push(t.elapsed().as_secs_f64() / reps as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The kernels one call of `f` launches (deduplicated, in order), or `None` when it launched
/// none: then the op ran on the host and must not be reported as a GPU timing.
fn kernels_of(cuda: &CudaDevice, mut f: impl FnMut() -> Res<()>) -> Res<Option<String>> {
    record_launches(true);
    let r = f().and_then(|()| Ok(cuda.synchronize()?));
    let mut names = take_launches();
    record_launches(false);
    r?;
    let mut seen = Vec::new();
    names.retain(|n| {
        let new = !seen.contains(n);
        seen.push(*n);
        new
    });
    Ok((!names.is_empty()).then(|| names.join("+")))
}

/// One grng timing, or the reason there is none; `work` is the op's FLOPs or bytes.
fn grng_row(cuda: &CudaDevice, samples: usize, mut f: impl FnMut() -> Res<()>) -> Res<Timed> {
    match kernels_of(cuda, &mut f)? {
        Some(kernels) => Ok(Timed {
            label: kernels,
            secs: Some(median_secs(cuda, samples, f)?),
        }),
        None => Ok(Timed {
            label: "no kernel launched (host fallback): not timed".into(),
            secs: None,
        }),
    }
}

struct Timed {
    label: String,
    secs: Option<f64>,
}

/// Prints `section | case | grng kernel | rate | peer | rate | ratio`; `work` is in the unit's
/// base (FLOP or byte), `scale` turns a per-second rate into the printed unit.
fn print_row(section: &str, case: &str, ours: &Timed, peer: &Timed, work: f64, unit: &str) {
    let scale = 1e-12;
    let rate = |t: &Timed| {
        t.secs
            .map_or("-".into(), |s| format!("{:.3} {unit}", work / s * scale))
    };
    println!(
        "| {section} | {case} | {} | {} | {} | {} | {} |",
        ours.label,
        rate(ours),
        peer.label,
        rate(peer),
        ratio(ours, peer)
    );
}

/// grng's time over the peer's, or `-` when either has none.
fn ratio(ours: &Timed, peer: &Timed) -> String {
    match (ours.secs, peer.secs) {
        (Some(a), Some(b)) => format!("{:.2}", a / b),
        _ => "-".into(),
    }
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

/// A device-to-device copy of `n` f32 (read + write: `8n` bytes), the bandwidth ceiling.
fn copy_row(cuda: &CudaDevice, samples: usize, n: usize) -> Res<Timed> {
    let s = cuda.stream();
    let src: CudaSlice<f32> = s.alloc_zeros(n)?;
    let mut dst: CudaSlice<f32> = s.alloc_zeros(n)?;
    let secs = median_secs(cuda, samples, || Ok(s.memcpy_dtod(&src, &mut dst)?))?;
    Ok(Timed {
        label: "cuMemcpyDtoD".into(),
        secs: Some(secs),
    })
}

fn launch_section(dev: &Device, cuda: &CudaDevice, o: &Opts) -> Res<()> {
    // A one-element op: the per-call cost without CUDA graphs (launch, checks, read-backs).
    let mut x = dev.upload(1, 1, &[1.0f32])?;
    let ours = grng_row(cuda, o.samples(), || Ok(dev.scale(1.0, &mut x)?))?;
    let peer = copy_row(cuda, o.samples(), 1)?;
    let us = |t: &Timed| t.secs.map_or("-".into(), |s| format!("{:.1} us", s * 1e6));
    println!(
        "| launch | scale of 1 element | {} | {} | {} (4 bytes) | {} | - |",
        ours.label,
        us(&ours),
        peer.label,
        us(&peer)
    );
    Ok(())
}

fn copy_section(cuda: &CudaDevice, o: &Opts) -> Res<()> {
    for n in sizes(o, &[10_000_000, 100_000_000]) {
        let peer = copy_row(cuda, o.samples(), n)?;
        let none = Timed {
            label: "-".into(),
            secs: None,
        };
        print_row(
            "copy",
            &format!("n = {n}"),
            &peer,
            &none,
            8.0 * n as f64,
            "TB/s",
        );
    }
    Ok(())
}

fn adamw_section(dev: &Device, cuda: &CudaDevice, o: &Opts) -> Res<()> {
    let c = AdamWCoeffs {
        lr: 1e-6,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        step: 1,
    };
    for n in sizes(o, &[10_000_000, 100_000_000]) {
        let mut p = dev.upload(1, n, &values(n, 1))?;
        let g = dev.upload(1, n, &values(n, 2))?;
        let mut m = dev.zeros(1, n)?;
        let mut v = dev.zeros(1, n)?;
        let ours = grng_row(cuda, o.samples(), || {
            Ok(dev.adamw_update(&mut p, &g, &mut m, &mut v, &c)?)
        })?;
        // Reads θ, g, m, v and writes θ, m, v: 7 f32 per element. The copy moves 8 bytes per
        // element, so it is timed on 7n/2 elements to move the same bytes.
        let peer = copy_row(cuda, o.samples(), 7 * n / 2)?;
        print_row(
            "adamw",
            &format!("n = {n}"),
            &ours,
            &peer,
            28.0 * n as f64,
            "TB/s",
        );
    }
    Ok(())
}

fn gemm_f32_section(dev: &Device, cuda: &CudaDevice, o: &Opts) -> Res<()> {
    let blas = cublas(cuda, "gemm-f32")?;
    for n in sizes(o, &[1024, 2048, 4096, 8192]) {
        let (ha, hb) = (values(n * n, 3), values(n * n, 4));
        let a = dev.upload(n, n, &ha)?;
        let b = dev.upload(n, n, &hb)?;
        let mut c = dev.zeros(n, n)?;
        let ours = grng_row(cuda, o.samples(), || {
            Ok(dev.gemm(Trans::No, Trans::No, 1.0, &a, &b, 0.0, &mut c)?)
        })?;
        let flop = 2.0 * (n as f64).powi(3);
        let case = format!("m = n = k = {n}");
        let Some(blas) = &blas else {
            print_row("gemm-f32", &case, &ours, &none_peer(), flop, "TFLOP/s");
            continue;
        };
        let s = cuda.stream();
        let da: CudaSlice<f32> = s.clone_htod(&ha)?;
        let db: CudaSlice<f32> = s.clone_htod(&hb)?;
        let mut dc: CudaSlice<f32> = s.alloc_zeros(n * n)?;
        let ni = i32::try_from(n)?;
        // Row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ: swap the operands.
        let cfg = GemmConfig {
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
        };
        for (name, mode) in [
            ("cublasSgemm", cublasMath_t::CUBLAS_DEFAULT_MATH),
            ("cublasSgemm TF32", cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH),
        ] {
            // SAFETY: a valid handle; the mode only selects the algorithm family.
            let st = unsafe { cublasSetMathMode(*blas.handle(), mode) };
            if st != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(format!("cublasSetMathMode: {st:?}").into());
            }
            // SAFETY: the three buffers hold n² f32 each, the leading dimensions are n.
            let secs = median_secs(cuda, o.samples(), || {
                Ok(unsafe { blas.gemm(cfg, &db, &da, &mut dc) }?)
            })?;
            let peer = Timed {
                label: name.into(),
                secs: Some(secs),
            };
            print_row("gemm-f32", &case, &ours, &peer, flop, "TFLOP/s");
        }
    }
    Ok(())
}

/// A cuBLAS handle on grng's stream, or `None` (said in a row) when libcublas cannot be loaded.
fn cublas(cuda: &CudaDevice, section: &str) -> Res<Option<CudaBlas>> {
    // SAFETY: only probes whether libcublas can be loaded (calls would panic otherwise).
    if unsafe { cudarc::cublas::sys::is_culib_present() } {
        Ok(Some(CudaBlas::new(cuda.stream().clone())?))
    } else {
        println!("| {section} | - | - | - | cuBLAS not found (LD_LIBRARY_PATH) | - | - |");
        Ok(None)
    }
}

/// Column-major `C = op(A)·op(B)` (`m x n`, inner `k`) by `cublasGemmEx`: bf16 `A`, `B`,
/// f32 `C`, f32 compute (`CUBLAS_COMPUTE_32F`, tensor cores on bf16).
#[allow(clippy::too_many_arguments)]
fn gemm_ex_bf16(
    cuda: &CudaDevice,
    blas: &CudaBlas,
    (ta, tb): (cublasOperation_t, cublasOperation_t),
    (m, n, k): (usize, usize, usize),
    a: &CudaSlice<bf16>,
    lda: usize,
    b: &CudaSlice<bf16>,
    ldb: usize,
    c: &mut CudaSlice<f32>,
) -> Res<()> {
    let s = cuda.stream();
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (pa, _ra) = a.device_ptr(s);
    let (pb, _rb) = b.device_ptr(s);
    let (pc, _rc) = c.device_ptr_mut(s);
    // SAFETY: a valid handle; the caller's buffers hold the op(A) m x k, op(B) k x n and
    // C m x n column-major matrices with the given leading dimensions (C's is m); alpha and
    // beta are f32 as CUBLAS_COMPUTE_32F requires.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            ta,
            tb,
            i32::try_from(m)?,
            i32::try_from(n)?,
            i32::try_from(k)?,
            (&alpha as *const f32).cast(),
            pa as *const std::ffi::c_void,
            cudaDataType_t::CUDA_R_16BF,
            i32::try_from(lda)?,
            pb as *const std::ffi::c_void,
            cudaDataType_t::CUDA_R_16BF,
            i32::try_from(ldb)?,
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

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn gemm_bf16_section(dev: &Device, cuda: &CudaDevice, o: &Opts) -> Res<()> {
    // grng's bf16 product is square (the Newton iteration's `newton_gemm_tc`, f32 out).
    let blas = cublas(cuda, "gemm-bf16")?;
    let mut unused = Unused::new(dev)?;
    for n in sizes(o, &[1024, 2048, 4096, 8192]) {
        let (ha, hb) = (to_bf16(&values(n * n, 5)), to_bf16(&values(n * n, 6)));
        let a = dev.upload(n, n, &ha)?;
        let b = dev.upload(n, n, &hb)?;
        let mut c = dev.zeros(n, n)?;
        let ours = grng_row(cuda, o.samples(), || {
            let epi = Epilogue {
                out: Some(&mut c),
                ..Epilogue::new()
            };
            Ok(product_tc(dev, &a, &b, epi, &mut unused)?)
        })?;
        let flop = 2.0 * (n as f64).powi(3);
        let case = format!("m = n = k = {n}, f32 out");
        let Some(blas) = &blas else {
            print_row("gemm-bf16", &case, &ours, &none_peer(), flop, "TFLOP/s");
            continue;
        };
        let s = cuda.stream();
        let da: CudaSlice<bf16> = s.clone_htod(&ha)?;
        let db: CudaSlice<bf16> = s.clone_htod(&hb)?;
        let mut dc: CudaSlice<f32> = s.alloc_zeros(n * n)?;
        let nn = cublasOperation_t::CUBLAS_OP_N;
        // Row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ: swap the operands.
        let secs = median_secs(cuda, o.samples(), || {
            gemm_ex_bf16(cuda, blas, (nn, nn), (n, n, n), &db, n, &da, n, &mut dc)
        })?;
        let peer = Timed {
            label: "cublasGemmEx bf16 → f32".into(),
            secs: Some(secs),
        };
        print_row("gemm-bf16", &case, &ours, &peer, flop, "TFLOP/s");
    }
    Ok(())
}

fn syrk_section(dev: &Device, cuda: &CudaDevice, o: &Opts) -> Res<()> {
    // grng computes the lower triangle only; the peer is the full AᵀA GEMM, and both rates
    // count the full product's 2·m·n² FLOPs (so the ratio is the time ratio).
    let blas = cublas(cuda, "syrk")?;
    let m = 4096;
    for n in sizes(o, &[1024, 2048, 4096, 8192]) {
        let ha = to_bf16(&values(m * n, 7));
        let a = dev.upload(m, n, &ha)?;
        let mut factor = dev.zeros(n, n)?;
        // ε = 0 replaces the factor (Device::kron_factor_update: finiteness checks included).
        let ours = grng_row(cuda, o.samples(), || {
            Ok(dev.kron_factor_update(&a, 0.0, &mut factor)?)
        })?;
        let flop = 2.0 * m as f64 * (n as f64).powi(2);
        let case = format!("bf16 A m = {m}, n = {n}");
        let Some(blas) = &blas else {
            print_row("syrk", &case, &ours, &none_peer(), flop, "TFLOP/s");
            continue;
        };
        let s = cuda.stream();
        let da: CudaSlice<bf16> = s.clone_htod(&ha)?;
        let mut dc: CudaSlice<f32> = s.alloc_zeros(n * n)?;
        // Row-major A (m x n) is column-major X = Aᵀ (n x m, ld n): AᵀA = X·Xᵀ.
        let ops = (
            cublasOperation_t::CUBLAS_OP_N,
            cublasOperation_t::CUBLAS_OP_T,
        );
        let secs = median_secs(cuda, o.samples(), || {
            gemm_ex_bf16(cuda, blas, ops, (n, n, m), &da, n, &da, n, &mut dc)
        })?;
        let peer = Timed {
            label: "cublasGemmEx bf16 → f32, full AᵀA".into(),
            secs: Some(secs),
        };
        print_row("syrk", &case, &ours, &peer, flop, "TFLOP/s");
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
        // SAFETY: only probes whether libcusolver can be loaded (calls would panic otherwise).
        if !unsafe { cudarc::cusolver::sys::is_culib_present() } {
            println!("| newton | - | - | - | cuSOLVER not found (LD_LIBRARY_PATH) | - | - |");
            return Ok(None);
        }
        Ok(Some(Self {
            handle: cudarc::cusolver::safe::DnHandle::new(cuda.stream().clone())?,
        }))
    }

    /// Copies `a` into `w` and overwrites `w` with the lower triangle (column-major; the
    /// upper one row-major) of `a⁻¹`; `work` is resized as cuSOLVER asks.
    fn inverse(
        &self,
        cuda: &CudaDevice,
        n: usize,
        a: &CudaSlice<f32>,
        w: &mut CudaSlice<f32>,
        work: &mut CudaSlice<f32>,
        info: &mut CudaSlice<i32>,
    ) -> Res<()> {
        use cudarc::cusolver::sys::{self as cs, cublasFillMode_t, cusolverStatus_t};
        let s = cuda.stream();
        s.memcpy_dtod(a, w)?;
        let ni = i32::try_from(n)?;
        let lower = cublasFillMode_t::CUBLAS_FILL_MODE_LOWER;
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
                    cs::cusolverDnSpotrf_bufferSize(h, lower, ni, pw as *mut f32, ni, &mut l1)
                },
                "cusolverDnSpotrf_bufferSize",
            )?;
            // SAFETY: as above.
            check(
                unsafe {
                    cs::cusolverDnSpotri_bufferSize(h, lower, ni, pw as *mut f32, ni, &mut l2)
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
        // SAFETY: w is n x n (ld n), work holds lwork f32 (at least what cuSOLVER asked for),
        // info one int; all on the handle's stream.
        check(
            unsafe {
                cs::cusolverDnSpotrf(
                    h,
                    lower,
                    ni,
                    pw as *mut f32,
                    ni,
                    pk as *mut f32,
                    lwork,
                    pi as *mut i32,
                )
            },
            "cusolverDnSpotrf",
        )?;
        // SAFETY: as above, on potrf's factor.
        check(
            unsafe {
                cs::cusolverDnSpotri(
                    h,
                    lower,
                    ni,
                    pw as *mut f32,
                    ni,
                    pk as *mut f32,
                    lwork,
                    pi as *mut i32,
                )
            },
            "cusolverDnSpotri",
        )?;
        Ok(())
    }
}

fn newton_section(dev: &Device, cuda: &CudaDevice, o: &Opts) -> Res<()> {
    let solver = Solver::new(cuda)?;
    let ms = |t: &Timed| t.secs.map_or("-".into(), |s| format!("{:.3} ms", s * 1e3));
    for n in sizes(o, &[512, 1024, 2048, 4096]) {
        for kappa in [33.0, 1000.0] {
            let ha = spd(n, kappa, 8);
            let a = dev.upload(n, n, &ha)?;
            // The cuSOLVER peer and its residual, once per matrix.
            let peer = match &solver {
                None => (none_peer(), "-".to_owned()),
                Some(solver) => {
                    let s = cuda.stream();
                    let da: CudaSlice<f32> = s.clone_htod(&ha)?;
                    let mut w: CudaSlice<f32> = s.alloc_zeros(n * n)?;
                    let mut work: CudaSlice<f32> = s.alloc_zeros(1)?;
                    let mut info: CudaSlice<i32> = s.alloc_zeros(1)?;
                    let secs = median_secs(cuda, o.samples(), || {
                        solver.inverse(cuda, n, &da, &mut w, &mut work, &mut info)
                    })?;
                    let code = s.clone_dtoh(&info)?[0];
                    let mut x = s.clone_dtoh(&w)?;
                    // Row-major upper triangle holds a⁻¹: mirror it into the lower one.
                    for i in 0..n {
                        for j in 0..i {
                            x[i * n + j] = x[j * n + i];
                        }
                    }
                    let res = if code == 0 {
                        format!("{:.1e}", residual(dev, &a, &dev.upload(n, n, &x)?)?)
                    } else {
                        format!("devInfo {code}")
                    };
                    let t = Timed {
                        label: "cusolverDnSpotrf+Spotri (+ copy of A)".into(),
                        secs: Some(secs),
                    };
                    (t, res)
                }
            };
            for (name, precision) in [("f32", Precision::F32), ("bf16", Precision::Bf16)] {
                // The smallest eigenvalue is known (1): given as λ_low, as a damping would be.
                let opts = NewtonOptions {
                    precision,
                    lambda_low: 1.0,
                    ..NewtonOptions::default()
                };
                let mut last = None;
                // An error (e.g. `Error::Diverged` at a bf16 floor above `tol`) is a result
                // of the row, not the end of the bench.
                let ours = grng_row(cuda, o.samples(), || {
                    last = Some(dev.newton_inverse(&a, None, &opts)?);
                    Ok(())
                })
                .unwrap_or_else(|e| Timed {
                    label: format!("error: {e}"),
                    secs: None,
                });
                let res = match &last {
                    Some((x, info)) => format!(
                        "{:.1e} ({} it, own {:.1e})",
                        residual(dev, &a, x)?,
                        info.iterations,
                        info.residual
                    ),
                    None => "-".into(),
                };
                println!(
                    "| newton | {name}, n = {n}, κ = {kappa} | {} | {} res {res} | {} | {} res {} | {} |",
                    ours.label,
                    ms(&ours),
                    peer.0.label,
                    ms(&peer.0),
                    peer.1,
                    ratio(&ours, &peer.0)
                );
            }
        }
    }
    Ok(())
}

fn kalman_section(dev: &Device, cuda: &CudaDevice, o: &Opts) -> Res<()> {
    let opts = KalmanOptions::default();
    for n in sizes(o, &[1_000_000, 10_000_000, 50_000_000]) {
        for d_o in [10, 64] {
            let mut state = KalmanState::new(dev, &values(n, 9), 0.1, d_o)?;
            let h = dev.upload(d_o, n, &values(d_o * n, 10))?;
            let v = dev.upload(d_o, 1, &values(d_o, 11))?;
            // Each call is a further step of the same filter (σ shrinks, R follows its EMA).
            let ours = grng_row(cuda, o.samples(), || {
                dev.kalman_step(&mut state, &h, &v, &opts)?;
                Ok(())
            })
            .unwrap_or_else(|e| Timed {
                label: format!("error: {e}"),
                secs: None,
            });
            // The bytes the step must move: H twice (the Gram pass, then the update once the
            // d_o x d_o solve has S), σ twice, μ once, μ and σ written: 4n(2 d_o + 5) bytes.
            // The copy moves 8 bytes per element: timed on half that many elements.
            let bytes = 4 * n * (2 * d_o + 5);
            let peer = copy_row(cuda, o.samples(), bytes / 8)?;
            print_row(
                "kalman",
                &format!("n = {n}, d_o = {d_o}"),
                &ours,
                &peer,
                bytes as f64,
                "TB/s",
            );
        }
    }
    Ok(())
}

fn step_section(dev: &Device, cuda: &CudaDevice, o: &Opts) -> Res<()> {
    // (name, batch m, [(d_out, d_in)] of the weights, bias column included).
    let models = [
        (
            "MLP 784-1024-1024-10",
            256usize,
            vec![(1024, 785), (1024, 1025), (10, 1025)],
        ),
        ("3 x 4096x4096", 1024, vec![(4096, 4096); 3]),
    ];
    let ms = |t: &Timed| t.secs.map_or("-".into(), |s| format!("{:.3} ms", s * 1e3));
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
        let grads: Vec<&grng::Matrix> = mats.iter().map(|(_, _, g, _)| g).collect();
        for (variant, base) in [
            ("RING", KronConfig::ring()),
            ("RENG", KronConfig::reng()),
            ("NGD", KronConfig::ngd()),
        ] {
            for skip in [1, 8] {
                let cfg = KronConfig { skip, ..base };
                let mut opt = KronOptimizer::new(dev, shapes, cfg)?;
                let mut params: Vec<grng::Matrix> = mats
                    .iter()
                    .map(|(_, _, _, w)| w.try_clone())
                    .collect::<Result<_, _>>()?;
                // One call is S steps (one refresh, S − 1 reuses): the time is per call / S,
                // the amortized cost of a step.
                let row = grng_row(cuda, o.samples(), || {
                    for _ in 0..skip {
                        let st = opt.needs_stats().then_some(&stats[..]);
                        opt.step(&mut params, &grads, st)?;
                    }
                    Ok(())
                });
                let ours = match row {
                    Ok(t) => Timed {
                        secs: t.secs.map(|s| s / skip as f64),
                        ..t
                    },
                    Err(e) => Timed {
                        label: format!("error: {e}"),
                        secs: None,
                    },
                };
                println!(
                    "| step | {variant}, S = {skip}, {model}, m = {m} | {} | {} per step | - | - | - |",
                    ours.label,
                    ms(&ours)
                );
            }
        }
    }
    Ok(())
}

fn none_peer() -> Timed {
    Timed {
        label: "-".into(),
        secs: None,
    }
}

/// The sizes of a section: all, or the first and the one before last with `--quick`.
fn sizes(o: &Opts, all: &[usize]) -> Vec<usize> {
    if o.quick && all.len() > 1 {
        vec![all[0], all[all.len() - 2]]
    } else {
        all.to_vec()
    }
}

fn main() -> Res<()> {
    let o = Opts::parse();
    let cuda = match CudaDevice::new(0) {
        Ok(c) => c,
        Err(e) => {
            println!("gpu bench: no GPU ({e}); nothing measured");
            return Ok(());
        }
    };
    let dev = Device::Cuda(cuda.clone());
    println!("| section | case | grng kernel | grng | peer | peer | ratio (time, grng / peer) |");
    println!("|---|---|---|---|---|---|---|");
    if o.runs("launch") {
        launch_section(&dev, &cuda, &o)?;
    }
    if o.runs("copy") {
        copy_section(&cuda, &o)?;
    }
    if o.runs("adamw") {
        adamw_section(&dev, &cuda, &o)?;
    }
    if o.runs("gemm-f32") {
        gemm_f32_section(&dev, &cuda, &o)?;
    }
    if o.runs("gemm-bf16") {
        gemm_bf16_section(&dev, &cuda, &o)?;
    }
    if o.runs("syrk") {
        syrk_section(&dev, &cuda, &o)?;
    }
    if o.runs("newton") {
        newton_section(&dev, &cuda, &o)?;
    }
    if o.runs("kalman") {
        kalman_section(&dev, &cuda, &o)?;
    }
    if o.runs("step") {
        step_section(&dev, &cuda, &o)?;
    }
    Ok(())
}
