//! # grng-testkit — what the tests of every grng crate share
//!
//! The replayable seeds (`GRNG_TEST_SEED`), the devices a test runs on, and `f64` references
//! (products, Gram matrices, SPD inverses, random SPD matrices of a chosen spectrum). Each
//! test file imports it as `use grng_testkit as common;`. Depends on `grng`, `proptest` and
//! `rand`; never a dependency of a library.

use std::sync::OnceLock;

pub mod dist;

use grng::cuda::CudaDevice;
use grng::ops::elementwise::AdamWCoeffs;
use grng::optim::kron::{InverseMethod, KronConfig, KronFactorState, KronVariant};
use grng::{Device, Trans};
use proptest::test_runner::{Config, RngSeed};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The run's master seed: `GRNG_TEST_SEED` when set (decimal `u64`), else a fresh random one,
/// so every run draws new inputs and any failure can be replayed exactly.
pub fn master_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| match std::env::var("GRNG_TEST_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("GRNG_TEST_SEED={s:?} is not a decimal u64")),
        Err(_) => rand::random(),
    })
}

/// The seed of one test: the master seed mixed with the test's name, so tests draw independent
/// streams and each replays alone. Prints the master seed; libtest shows it only on failure.
pub fn test_seed(name: &str) -> u64 {
    let master = master_seed();
    eprintln!("replay with GRNG_TEST_SEED={master} ({name})");
    // FNV-1a of the name, then a SplitMix64 finalizer: stable across Rust versions, unlike
    // `DefaultHasher`.
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ master;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The name of the running test: libtest runs each test on a thread named after it.
fn current_test() -> String {
    std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .to_string()
}

/// A proptest config of `cases` cases whose generator is seeded by [`test_seed`] of the
/// running test (checked-in regression files still replay first).
pub fn proptest_config(cases: u32) -> Config {
    Config {
        cases,
        rng_seed: RngSeed::Fixed(test_seed(&current_test())),
        ..Config::default()
    }
}

/// [`test_seed`] of the running test: for helpers that take a seed.
pub fn seed() -> u64 {
    test_seed(&current_test())
}

/// A ChaCha8 generator seeded by [`test_seed`] of the running test, for hand-rolled random tests.
pub fn seeded_rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed())
}

/// Unit roundoff of f32.
pub const U32: f64 = 1.0 / (1u64 << 24) as f64;

/// Usual AdamW coefficients at a step past the first (`step` 3: neither bias correction is
/// 1), the baseline the fused-update tests check and vary.
pub const ADAMW: AdamWCoeffs = AdamWCoeffs {
    lr: 1e-3,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.01,
    step: 3,
};

/// The kernel devices to check: always the emulator, plus CUDA when a GPU is present
/// ([`cuda`]).
pub fn devices() -> Vec<Device> {
    let mut d = vec![Device::Emulated];
    d.extend(cuda());
    d
}

/// The GPU of the CUDA arms, or `None` without one: then it says once per test binary, on
/// stderr past libtest's capture, that the CUDA arms were skipped and why, so a run shows it.
/// With `GRNG_REQUIRE_CUDA=1` (the GPU bundle's run-all.sh sets it) a missing GPU fails the
/// test instead: there a skipped arm would pass for a tested kernel.
///
/// The device's GEMM path is decided before it is returned (`cuda::check_sm90`, as the GPU bench
/// does): the first GEMM launch on a compute capability 9.0 GPU runs the sm_90a self-check,
/// whose launches (sm_80 and sm_90a twins side by side) would otherwise land in the launch
/// record of whichever test launched first and break its kernel counts (seen on an H200).
pub fn cuda() -> Option<Device> {
    let dev = gpu(CudaDevice::new(0).map(Device::Cuda))?;
    grng::cuda::check_sm90(&dev).expect("the sm_80 side of the sm_90a self-check runs");
    Some(dev)
}

/// The GPU that `open` gave (grng's device, or candle's in `tests/candle_grng.rs`), or `None`
/// after the skip note of [`cuda`], whose `GRNG_REQUIRE_CUDA` rule it applies.
pub fn gpu<D, E: std::fmt::Display>(open: Result<D, E>) -> Option<D> {
    static SKIPPED: OnceLock<()> = OnceLock::new();
    match open {
        Ok(d) => Some(d),
        Err(e) => {
            let required = std::env::var("GRNG_REQUIRE_CUDA").is_ok_and(|v| v == "1");
            assert!(!required, "GRNG_REQUIRE_CUDA=1 but no usable GPU: {e}");
            SKIPPED.get_or_init(|| {
                use std::io::Write;
                let exe = std::env::args().next().unwrap_or_default();
                let msg = format!("note: {exe}: CUDA arms skipped (no GPU: {e})\n");
                // `eprintln!` would be captured (and shown only on failure).
                let _ = std::io::stderr().write_all(msg.as_bytes());
            });
            None
        }
    }
}

/// A dimension of the CUDA arms: 4096 (whole 128-wide tiles) one time in four, else ragged in
/// `2049..=4096`.
pub fn large_dim(rng: &mut ChaCha8Rng) -> usize {
    if rng.random_range(0..4) == 0 {
        4096
    } else {
        rng.random_range(2049..=4096)
    }
}

/// `|α|·|op(A)|·|op(B)| + |β|·|C|` (row-major; `op(A)` `m x k`, `op(B)` `k x n`), the scale of
/// each element's rounding error in a GEMM, by the CPU backend's GEMM on absolute values: at
/// the CUDA arms' sizes an f64 triple loop is too slow. Its own rounding (≤ (k + 2)·2⁻²⁴
/// relative: all terms are nonnegative) only tightens the bounds built on it by that much.
#[allow(clippy::too_many_arguments)]
pub fn abs_gemm(
    (ta, tb): (Trans, Trans),
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &[f32],
) -> Vec<f64> {
    let cpu = Device::Cpu;
    let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<f32>>();
    let stored = |t: Trans, r: usize, c: usize| if t == Trans::No { (r, c) } else { (c, r) };
    let ((ar, ac), (br, bc)) = (stored(ta, m, k), stored(tb, k, n));
    let mut s = cpu.upload(m, n, &abs(c)).unwrap();
    cpu.gemm(
        ta,
        tb,
        alpha.abs(),
        &cpu.upload(ar, ac, &abs(a)).unwrap(),
        &cpu.upload(br, bc, &abs(b)).unwrap(),
        beta.abs(),
        &mut s,
    )
    .unwrap();
    s.to_vec().unwrap().into_iter().map(f64::from).collect()
}

/// `A·B` in f64 (row-major, `A` `r x k`, `B` `k x c`), the triple loop the references use.
pub fn matmul64(a: &[f64], b: &[f64], r: usize, k: usize, c: usize) -> Vec<f64> {
    let mut out = vec![0.0; r * c];
    for i in 0..r {
        for l in 0..k {
            let x = a[i * k + l];
            for j in 0..c {
                out[i * c + j] += x * b[l * c + j];
            }
        }
    }
    out
}

/// Asserts that the row-major `n x n` `a` is exactly (bitwise) symmetric.
pub fn assert_symmetric(a: &[f32], n: usize) {
    for i in 0..n {
        for j in 0..i {
            assert_eq!(
                a[i * n + j].to_bits(),
                a[j * n + i].to_bits(),
                "not symmetric at ({i}, {j})"
            );
        }
    }
}

/// `‖I − A X‖_F / √n` in `f64` (row-major `n x n` `A` and `X`): how far `X` is from `A⁻¹`.
pub fn residual64(a: &[f32], x: &[f32], n: usize) -> f64 {
    let mut s = 0.0;
    for i in 0..n {
        for j in 0..n {
            let ax: f64 = (0..n)
                .map(|k| a[i * n + k] as f64 * x[k * n + j] as f64)
                .sum();
            let e = if i == j { 1.0 - ax } else { -ax };
            s += e * e;
        }
    }
    (s / n as f64).sqrt()
}

/// `(1/m) XᵀX` in f64 for a row-major `m x n` host matrix.
pub fn gram64(x: &[f32], m: usize, n: usize) -> Vec<f64> {
    let mut g = vec![0.0; n * n];
    for k in 0..m {
        for i in 0..n {
            for j in 0..n {
                g[i * n + j] += x[k * n + i] as f64 * x[k * n + j] as f64;
            }
        }
    }
    g.iter_mut().for_each(|v| *v /= m as f64);
    g
}

/// `A⁻¹` of a symmetric positive definite row-major `n x n` matrix in `f64` (Cholesky, then
/// `L⁻ᵀ L⁻¹`); only the lower triangle of `a` is read. Panics unless `A` is SPD in f64.
pub fn spd_inverse64(a: &[f64], n: usize) -> Vec<f64> {
    let mut l = vec![0.0f64; n * n];
    for j in 0..n {
        let d = a[j * n + j] - (0..j).map(|k| l[j * n + k].powi(2)).sum::<f64>();
        assert!(d > 0.0, "test matrix not SPD in f64");
        l[j * n + j] = d.sqrt();
        for i in j + 1..n {
            let s = a[i * n + j] - (0..j).map(|k| l[i * n + k] * l[j * n + k]).sum::<f64>();
            l[i * n + j] = s / l[j * n + j];
        }
    }
    let mut li = vec![0.0f64; n * n];
    for c in 0..n {
        for i in c..n {
            let rhs = if i == c { 1.0 } else { 0.0 };
            let s: f64 = (c..i).map(|k| l[i * n + k] * li[k * n + c]).sum();
            li[i * n + c] = (rhs - s) / l[i * n + i];
        }
    }
    let mut inv = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            inv[i * n + j] = (i.max(j)..n).map(|k| li[k * n + i] * li[k * n + j]).sum();
        }
    }
    inv
}

/// `|X₀| + |Δ|·|X₀||X₀|` for the Kronecker factor `s` at the damping target `lambda`
/// (`Δ = λ − λ₀`, the optimizer's f32 difference): the scale of each entry's f32 rounding in
/// the lazy steps' first-order inverse `X₀ − Δ·X₀X₀` (the square's GEMM and the axpy).
pub fn first_order_scale64(s: &KronFactorState, lambda: f32) -> Vec<f64> {
    let n = s.inverse.rows();
    let x0: Vec<f64> = s
        .inverse
        .to_vec()
        .unwrap()
        .iter()
        .map(|v| v.abs() as f64)
        .collect();
    let d = ((lambda - s.damping) as f64).abs();
    let sq = matmul64(&x0, &x0, n, n, n);
    x0.iter().zip(&sq).map(|(x, s)| x + d * s).collect()
}

/// `n` values drawn uniformly from `[lo, hi)`.
pub fn uniform(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// `len` values drawn uniformly from `[-1, 1)`.
pub fn vals(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    uniform(rng, len, -1.0, 1.0)
}

/// Eigenvalues of a symmetric matrix by cyclic Jacobi rotations (f64), largest first.
pub fn eigs64(a: &[f64], n: usize) -> Vec<f64> {
    let mut a = a.to_vec();
    for _ in 0..100 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j].powi(2))
            .sum();
        if off < 1e-30 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
            }
        }
    }
    let mut d: Vec<f64> = (0..n).map(|i| a[i * n + i]).collect();
    d.sort_by(|x, y| y.total_cmp(x));
    d
}

/// `Q = (I − 2 v₁v₁ᵀ/v₁ᵀv₁)⋯(I − 2 v_r v_rᵀ/v_rᵀv_r)` in `f64` (row-major `n x n`): the
/// product of `reflectors` Householder reflectors, each `v` drawn uniformly from `[-1, 1)ⁿ`.
pub fn householder_q64(rng: &mut ChaCha8Rng, n: usize, reflectors: usize) -> Vec<f64> {
    let mut q = vec![0.0f64; n * n];
    (0..n).for_each(|i| q[i * n + i] = 1.0);
    for _ in 0..reflectors {
        let v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let vv: f64 = v.iter().map(|x| x * x).sum::<f64>().max(1e-300);
        // Q ← Q (I − 2 v vᵀ / vᵀv)
        for i in 0..n {
            let qv: f64 = (0..n).map(|p| q[i * n + p] * v[p]).sum();
            for j in 0..n {
                q[i * n + j] -= 2.0 * qv * v[j] / vv;
            }
        }
    }
    q
}

/// `Q D Qᵀ` in `f64` (`Q` a product of three random Householder reflectors), rounded to `f32`:
/// a symmetric matrix with the prescribed spectrum `d` (exact up to that rounding).
pub fn with_spectrum(rng: &mut ChaCha8Rng, d: &[f64]) -> Vec<f32> {
    let n = d.len();
    let q = householder_q64(rng, n, 3);
    let mut a = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..n).map(|p| q[i * n + p] * d[p] * q[j * n + p]).sum();
            a[i * n + j] = s as f32;
            a[j * n + i] = s as f32;
        }
    }
    a
}

/// `Q D Qᵀ` in `f64`, `Q` a product of three random Householder reflectors, eigenvalues
/// log-spaced over `[1/κ, 1]` in random order (both ends present), rounded to `f32`.
/// Returns the matrix and its spectrum `D`.
pub fn spd(rng: &mut ChaCha8Rng, n: usize, kappa: f64) -> (Vec<f32>, Vec<f64>) {
    let mut d: Vec<f64> = (0..n)
        .map(|i| {
            let t = if n == 1 {
                0.0
            } else {
                i as f64 / (n - 1) as f64
            };
            kappa.powf(-t)
        })
        .collect();
    for i in (1..n).rev() {
        d.swap(i, rng.random_range(0..=i));
    }
    (with_spectrum(rng, &d), d)
}

/// Runs test `name` of this test binary again in a child process, with the environment
/// changes `env` (`Some(v)` sets, `None` removes), asserts that it ran and passed, and returns
/// its stderr: for tests of process-wide state (a one-time fallback line, a failed module
/// load) that one process can show only once.
pub fn run_child(name: &str, env: &[(&str, Option<&str>)]) -> String {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--nocapture"]);
    for &(key, value) in env {
        match value {
            Some(v) => cmd.env(key, v),
            None => cmd.env_remove(key),
        };
    }
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed:\n{stdout}\n{stderr}"
    );
    stderr
}

/// The default configuration of `variant` (`KronConfig::ring()`, `reng()` or `ngd()`).
pub fn variant_config(variant: KronVariant) -> KronConfig {
    match variant {
        KronVariant::Ring => KronConfig::ring(),
        KronVariant::Reng => KronConfig::reng(),
        KronVariant::Ngd => KronConfig::ngd(),
    }
}

/// `base` set up for lazy-step tests whose ρ drifts: ρ = 1e-2 free in [1e-8, 1], φ = 0.8 (each
/// observed step moves the damping target), no refresh after the first (S = 1000) and exact
/// (Cholesky) inverses, so a lazy step's first-order inverse is the only approximation.
pub fn drifting_config(base: KronConfig) -> KronConfig {
    KronConfig {
        rho: 1e-2,
        rho_min: 1e-8,
        rho_max: 1.0,
        phi: 0.8,
        skip: 1000,
        inverse: InverseMethod::Cholesky,
        ..base
    }
}

/// Whether a recorded launch is a matrix product: a GEMM kernel of the engine or the SIMT
/// GEMM (`gemm_nn`…, `gemm3_tc`, `newton_gemm_tc`, their `_wg_tc` variants), not one of the
/// helpers that share `kernels/gemm.cu`'s name (`gemm_split3`, `gemm_add_diagonal`,
/// `gemm_trace`), which tests of product counts must not count.
pub fn is_product(kernel: &str) -> bool {
    kernel.contains("gemm") && !matches!(kernel, "gemm_split3" | "gemm_add_diagonal" | "gemm_trace")
}

/// The stored shape of an operand whose `op(X)` is `r x c`.
pub fn stored_shape(t: Trans, (r, c): (usize, usize)) -> (usize, usize) {
    match t {
        Trans::No => (r, c),
        Trans::Yes => (c, r),
    }
}

/// Random `A`, `B`, `C` for `op(A)` `m x k`, `op(B)` `k x n`: the values and the stored shapes.
pub struct GemmCase {
    /// `A` as stored.
    pub a: Vec<f32>,
    /// `B` as stored.
    pub b: Vec<f32>,
    /// `C` before the product.
    pub c0: Vec<f32>,
    /// `A`'s stored shape.
    pub a_shape: (usize, usize),
    /// `B`'s stored shape.
    pub b_shape: (usize, usize),
}

/// A [`GemmCase`] drawn from `seed`.
pub fn gemm_case(seed: u64, (m, n, k): (usize, usize, usize), ta: Trans, tb: Trans) -> GemmCase {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    GemmCase {
        a: vals(&mut rng, m * k),
        b: vals(&mut rng, k * n),
        c0: vals(&mut rng, m * n),
        a_shape: stored_shape(ta, (m, k)),
        b_shape: stored_shape(tb, (k, n)),
    }
}

/// The launches of `jobs` axpys formed together (a Kronecker step's first-order inverses,
/// its weight updates: `Device::axpy_new_split_all`, `axpy_over_all` on a kernel device):
/// `[elementwise_axpy_new, elementwise_multi_axpy_new]` — one launch of the single kernel for
/// one job, one of the batched kernel for several.
pub fn batched_axpy_launches(jobs: usize) -> [usize; 2] {
    match jobs {
        0 => [0, 0],
        1 => [1, 0],
        _ => [0, 1],
    }
}

/// The `[elementwise_axpy_new, elementwise_multi_axpy_new]` launches in `launched`.
pub fn axpy_launches(launched: &[&str]) -> [usize; 2] {
    let count = |k: &str| launched.iter().filter(|&&l| l == k).count();
    [
        count("elementwise_axpy_new"),
        count("elementwise_multi_axpy_new"),
    ]
}

/// `a + b`, element by element.
pub fn add2(a: [usize; 2], b: [usize; 2]) -> [usize; 2] {
    [a[0] + b[0], a[1] + b[1]]
}

/// The split3 planes of `v` as `grng_split3` makes them (round to nearest even each):
/// `hi = bf16(v)`, `mid = bf16(v − hi)`, `lo = bf16(v − hi − mid)`, as bits.
pub fn host_split3(v: f32) -> [u16; 3] {
    let hi = half::bf16::from_f32(v);
    let r = v - hi.to_f32();
    let mid = half::bf16::from_f32(r);
    [hi, mid, half::bf16::from_f32(r - mid.to_f32())].map(half::bf16::to_bits)
}
