//! CPU dense linear algebra against plain `f64` references written here (obvious triple loops,
//! nothing shared with the implementation), through both `grng::cpu` and `Device::Cpu`.
//!
//! Tolerances: a length-k dot product in f32 (any summation order, FMA or not) has error at most
//! γ_k·Σ|x_i||y_i| with γ_k = k·u/(1 − k·u) and u = f32::EPSILON/2 (Higham, Thm 3.5). We allow
//! `(k + 4)·f32::EPSILON` times the matching absolute sum, i.e. a 2x margin over γ_{k+2} that
//! also covers the α·(…) + β·c epilogue and the rounding of the inputs where they are rounded.

use grng_testkit as common;

use grng::cpu;
use grng::ops::norm::{PowerInfo, PowerOptions};
use grng::MatMul;
use grng::{Device, Error, Mat, MatMut, MatRef, Matrix, Trans};
use half::bf16;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const EPS: f64 = f32::EPSILON as f64;

/// A host test matrix with its own leading dimension (`ld ≥ cols`, padding filled with junk).
#[derive(Clone, Debug)]
struct T32 {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    ld: usize,
}

impl T32 {
    fn random(rng: &mut ChaCha8Rng, rows: usize, cols: usize, pad: usize) -> Self {
        let ld = cols + pad;
        let len = if rows == 0 { 0 } else { (rows - 1) * ld + cols };
        let data = (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        Self {
            data,
            rows,
            cols,
            ld,
        }
    }
    fn from_f64(x: &[f64], rows: usize, cols: usize) -> Self {
        Self {
            data: x.iter().map(|&v| v as f32).collect(),
            rows,
            cols,
            ld: cols,
        }
    }
    fn at(&self, i: usize, j: usize) -> f64 {
        self.data[i * self.ld + j] as f64
    }
    fn view(&self) -> MatRef<'_, f32> {
        MatRef::with_ld(&self.data, self.rows, self.cols, self.ld).unwrap()
    }
    fn view_mut(&mut self) -> MatMut<'_, f32> {
        MatMut::with_ld(&mut self.data, self.rows, self.cols, self.ld).unwrap()
    }
    /// Dense f64 copy, row-major `rows x cols`.
    fn dense(&self) -> Vec<f64> {
        let mut v = Vec::with_capacity(self.rows * self.cols);
        for i in 0..self.rows {
            for j in 0..self.cols {
                v.push(self.at(i, j));
            }
        }
        v
    }
    fn contiguous(&self) -> Vec<f32> {
        self.dense().iter().map(|&x| x as f32).collect()
    }
    fn upload(&self) -> Matrix {
        Device::Cpu
            .upload(self.rows, self.cols, &self.contiguous())
            .unwrap()
    }
}

/// op(X)(i, j) for a dense f64 row-major `rows x cols` matrix.
fn op_at(x: &[f64], cols: usize, t: Trans, i: usize, j: usize) -> f64 {
    match t {
        Trans::No => x[i * cols + j],
        Trans::Yes => x[j * cols + i],
    }
}

/// f64 reference matrix product `op(A)·op(B)` (`m x n`) and its absolute counterpart
/// `|op(A)|·|op(B)|` used for the error bound.
#[allow(clippy::too_many_arguments)]
fn ref_mm(
    a: &[f64],
    a_cols: usize,
    ta: Trans,
    b: &[f64],
    b_cols: usize,
    tb: Trans,
    (m, n, k): (usize, usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let x = op_at(a, a_cols, ta, i, p);
                let y = op_at(b, b_cols, tb, p, j);
                c[i * n + j] += x * y;
                abs[i * n + j] += (x * y).abs();
            }
        }
    }
    (c, abs)
}

fn assert_close(got: &[f32], want: &[f64], bound: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (idx, ((&g, &w), &b)) in got.iter().zip(want).zip(bound).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= b + 1e-30,
            "{what}: index {idx}: got {g}, want {w}, error {err:e} > bound {b:e}"
        );
    }
}

fn trans(b: bool) -> Trans {
    if b {
        Trans::Yes
    } else {
        Trans::No
    }
}

/// Sizes 1..=300 with a bias towards small and "ragged" (non-multiple-of-8) ones.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![1usize..=17, 18usize..=300]
}

/// `inv`, the `f32` inverse of the `n x n` `a64` (row-major) by an exact `f64` inverse rounded
/// once: exactly symmetric, and `|A X̂ − I| ≤ u|A||X̂|` (+ the f64 error `κ·2⁻⁵³`) with a 4x
/// margin.
fn check_spd_inverse(a64: &[f64], inv: &Mat) -> Result<(), TestCaseError> {
    let n = inv.rows();
    let iv: Vec<f64> = inv.as_slice().iter().map(|&x| x as f64).collect();
    for i in 0..n {
        for j in 0..i {
            prop_assert_eq!(iv[i * n + j], iv[j * n + i]);
        }
    }
    let ai = common::matmul64(a64, &iv, n, n, n);
    let bound: Vec<f64> = common::matmul64(&abs64(a64), &abs64(&iv), n, n, n)
        .iter()
        .map(|x| 4.0 * EPS * x + 1e-12)
        .collect();
    let eye: Vec<f32> = (0..n * n)
        .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
        .collect();
    assert_close(&eye, &ai, &bound, "A A⁻¹ vs I");
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(40))]

    #[test]
    fn gemm_matches_reference(
        m in dim(), n in dim(), k in dim(), ta: bool, tb: bool,
        pads in (0usize..3, 0usize..3, 0usize..3),
        alpha in -2.0f32..2.0, beta_kind in 0u8..3, seed: u64,
    ) {
        gemm_case((m, n, k), (trans(ta), trans(tb)), pads, alpha, beta_kind, seed)?;
    }

    /// The column-block path of `cpu::gemm` (a transposed `B`, ≥ 2 threads, ≥ 2^21
    /// multiply-adds, ≥ 128 columns: blocks computed as separate single-threaded products),
    /// run in a 3-thread pool so the blocks are uneven among threads, at ragged widths.
    #[test]
    fn gemm_column_blocks_match_reference(
        m in 1usize..=40, n in 128usize..=300, extra_k in 0usize..40, ta: bool,
        pads in (0usize..3, 0usize..3, 0usize..3),
        alpha in -2.0f32..2.0, beta_kind in 0u8..3, seed: u64,
    ) {
        let k = (1usize << 21).div_ceil(m * n) + extra_k;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| gemm_case((m, n, k), (trans(ta), Trans::Yes), pads, alpha, beta_kind, seed))?;
    }

    #[test]
    fn syrk_ema_f32_matches_reference(
        m in dim(), n in dim(), pad in 0usize..3, eps_kind in 0u8..3, seed: u64,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let a = T32::random(&mut rng, m, n, pad);
        let eps = match eps_kind {
            0 => 0.0,
            1 => 0.95,
            _ => rng.random_range(0.0f32..1.0),
        };
        let (factor, want, bound) = syrk_case(&mut rng, &a.dense(), m, n, eps);
        let mut f1 = factor.clone();
        cpu::syrk_ema(a.view(), eps, f1.view_mut()).unwrap();
        check_syrk(&f1.contiguous(), n, &want, &bound);

        let mut df = Device::Cpu.upload(n, n, &factor.data).unwrap();
        Device::Cpu.syrk_ema(&a.upload(), eps, &mut df).unwrap();
        check_syrk(&df.to_vec().unwrap(), n, &want, &bound);
    }

    #[test]
    fn syrk_ema_bf16_matches_reference(
        m in dim(), n in dim(), eps_kind in 0u8..2, seed: u64,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let a: Vec<bf16> = (0..m * n).map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0))).collect();
        // Reference on the bf16-rounded inputs (widening is exact), so the bound is f32's.
        let a64: Vec<f64> = a.iter().map(|v| v.to_f64()).collect();
        let eps = if eps_kind == 0 { 0.0 } else { rng.random_range(0.0f32..1.0) };
        let (factor, want, bound) = syrk_case(&mut rng, &a64, m, n, eps);
        let mut f1 = factor.clone();
        cpu::syrk_ema(MatRef::new(&a, m, n).unwrap(), eps, f1.view_mut()).unwrap();
        check_syrk(&f1.contiguous(), n, &want, &bound);

        let da = Device::Cpu.upload(m, n, &a).unwrap();
        let mut df = Device::Cpu.upload(n, n, &factor.data).unwrap();
        Device::Cpu.syrk_ema(&da, eps, &mut df).unwrap();
        check_syrk(&df.to_vec().unwrap(), n, &want, &bound);
    }

    #[test]
    fn batch_gradient_matches_reference(
        m in dim(), d_out in dim(), d_in in dim(), seed: u64,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let e = T32::random(&mut rng, m, d_out, 1);
        let a = T32::random(&mut rng, m, d_in, 0);
        let (p, abs) = ref_mm(&e.dense(), d_out, Trans::Yes, &a.dense(), d_in, Trans::No, (d_out, d_in, m));
        let want: Vec<f64> = p.iter().map(|x| x / m as f64).collect();
        let bound: Vec<f64> = abs.iter().map(|x| (m + 4) as f64 * EPS * x / m as f64).collect();
        let mut g = T32::random(&mut rng, d_out, d_in, 0);
        cpu::batch_gradient(e.view(), a.view(), g.view_mut()).unwrap();
        assert_close(&g.data, &want, &bound, "cpu::batch_gradient");
        let mut dg = Device::Cpu.zeros(d_out, d_in).unwrap();
        Device::Cpu.batch_gradient(&e.upload(), &a.upload(), &mut dg).unwrap();
        assert_close(&dg.to_vec().unwrap(), &want, &bound, "Device::batch_gradient");
    }

    #[test]
    fn precondition_matches_reference(d_out in dim(), d_in in dim(), seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let gi = T32::random(&mut rng, d_out, d_out, 2);
        let g = T32::random(&mut rng, d_out, d_in, 1);
        let li = T32::random(&mut rng, d_in, d_in, 0);
        let (gl, gl_abs) = ref_mm(&g.dense(), d_in, Trans::No, &li.dense(), d_in, Trans::No, (d_out, d_in, d_in));
        let (want, _) = ref_mm(&gi.dense(), d_out, Trans::No, &gl, d_in, Trans::No, (d_out, d_in, d_out));
        let (abs, _) = ref_mm(
            &gi.dense().iter().map(|x| x.abs()).collect::<Vec<_>>(), d_out, Trans::No,
            &gl_abs, d_in, Trans::No, (d_out, d_in, d_out),
        );
        // Two chained products: the errors of lengths d_in and d_out add up.
        let bound: Vec<f64> = abs.iter().map(|x| (d_in + d_out + 8) as f64 * EPS * x).collect();
        let mut p = T32::random(&mut rng, d_out, d_in, 1);
        cpu::precondition(gi.view(), g.view(), li.view(), p.view_mut()).unwrap();
        assert_close(&p.contiguous(), &want, &bound, "cpu::precondition");
        let mut dp = Device::Cpu.zeros(d_out, d_in).unwrap();
        Device::Cpu.precondition(&gi.upload(), &g.upload(), &li.upload(), &mut dp).unwrap();
        assert_close(&dp.to_vec().unwrap(), &want, &bound, "Device::precondition");
    }

    #[test]
    fn damped_inverse_update_and_add_diagonal(
        n in dim(), pad in 0usize..2, dl in -0.1f32..0.1, lambda in -3.0f32..3.0, seed: u64,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let x = T32::random(&mut rng, n, n, pad);
        let xd = x.dense();
        let (xx, abs) = ref_mm(&xd, n, Trans::No, &xd, n, Trans::No, (n, n, n));
        let want: Vec<f64> = (0..n * n).map(|i| xd[i] - dl as f64 * xx[i]).collect();
        let bound: Vec<f64> = (0..n * n)
            .map(|i| (n + 4) as f64 * EPS * (xd[i].abs() + (dl as f64).abs() * abs[i]))
            .collect();
        let mut x1 = x.clone();
        cpu::damped_inverse_update(x1.view_mut(), dl).unwrap();
        assert_close(&x1.contiguous(), &want, &bound, "cpu::damped_inverse_update");
        let mut dx = x.upload();
        Device::Cpu.damped_inverse_update(&mut dx, dl).unwrap();
        assert_close(&dx.to_vec().unwrap(), &want, &bound, "Device::damped_inverse_update");

        // add_diagonal: one rounding of x_ii + λ.
        let want: Vec<f64> = (0..n * n)
            .map(|i| if i / n == i % n { xd[i] + lambda as f64 } else { xd[i] })
            .collect();
        let bound: Vec<f64> = want.iter().map(|w| EPS * w.abs()).collect();
        let mut x2 = x.clone();
        cpu::add_diagonal(x2.view_mut(), lambda).unwrap();
        assert_close(&x2.contiguous(), &want, &bound, "cpu::add_diagonal");
        let mut dx = x.upload();
        Device::Cpu.add_diagonal(&mut dx, lambda).unwrap();
        assert_close(&dx.to_vec().unwrap(), &want, &bound, "Device::add_diagonal");
        let tr: f64 = (0..n).map(|i| want[i * n + i]).sum();
        let got = Device::Cpu.trace(&dx).unwrap() as f64;
        prop_assert!((got - tr).abs() <= (n + 2) as f64 * EPS * (tr.abs() + n as f64 * 4.0));
    }
}

/// One `cpu::gemm` / `Device::gemm` case against the f64 reference: random operands with
/// padded leading dimensions, `β ∈ {0 (C poisoned with NaN), 1, random}`, the padding of C
/// never written.
fn gemm_case(
    (m, n, k): (usize, usize, usize),
    (ta, tb): (Trans, Trans),
    pads: (usize, usize, usize),
    alpha: f32,
    beta_kind: u8,
    seed: u64,
) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (ar, ac) = if ta == Trans::No { (m, k) } else { (k, m) };
    let (br, bc) = if tb == Trans::No { (k, n) } else { (n, k) };
    let a = T32::random(&mut rng, ar, ac, pads.0);
    let b = T32::random(&mut rng, br, bc, pads.1);
    let mut c = T32::random(&mut rng, m, n, pads.2);
    let beta = match beta_kind {
        0 => 0.0,
        1 => 1.0,
        _ => rng.random_range(-2.0f32..2.0),
    };
    if beta == 0.0 {
        // β = 0 must not read C: poison it.
        c.data.iter_mut().for_each(|x| *x = f32::NAN);
    }
    let c_old = c.dense();
    let (p, abs) = ref_mm(&a.dense(), ac, ta, &b.dense(), bc, tb, (m, n, k));
    let want: Vec<f64> = (0..m * n)
        .map(|i| {
            alpha as f64 * p[i]
                + if beta == 0.0 {
                    0.0
                } else {
                    beta as f64 * c_old[i]
                }
        })
        .collect();
    let bound: Vec<f64> = (0..m * n)
        .map(|i| {
            let cterm = if beta == 0.0 {
                0.0
            } else {
                (beta as f64 * c_old[i]).abs()
            };
            (k + 4) as f64 * EPS * ((alpha as f64).abs() * abs[i] + cterm)
        })
        .collect();

    let mut c1 = c.clone();
    cpu::gemm(
        MatMul::new(ta, tb, alpha, a.view(), b.view()),
        beta,
        c1.view_mut(),
    )
    .unwrap();
    assert_close(&c1.contiguous(), &want, &bound, "cpu::gemm");
    // The padding between rows is never written.
    for i in 0..m.saturating_sub(1) {
        for j in n..c.ld {
            let (x, y) = (c1.data[i * c.ld + j], c.data[i * c.ld + j]);
            prop_assert!(x.to_bits() == y.to_bits(), "padding written");
        }
    }

    let (da, db) = (a.upload(), b.upload());
    let mut dc = Device::Cpu.upload(m, n, &c.contiguous()).unwrap();
    Device::Cpu
        .gemm(ta, tb, alpha, &da, &db, beta, &mut dc)
        .unwrap();
    assert_close(&dc.to_vec().unwrap(), &want, &bound, "Device::gemm");
    Ok(())
}

/// Old factor (symmetric random, or NaN when ε = 0), the f64 reference and the error bound.
fn syrk_case(
    rng: &mut ChaCha8Rng,
    a: &[f64],
    m: usize,
    n: usize,
    eps: f32,
) -> (T32, Vec<f64>, Vec<f64>) {
    let mut old = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let v = rng.random_range(-1.0f32..1.0) as f64;
            old[i * n + j] = v;
            old[j * n + i] = v;
        }
    }
    let mut factor = T32::from_f64(&old, n, n);
    if eps == 0.0 {
        factor.data.iter_mut().for_each(|x| *x = f32::NAN);
    }
    let (ata, abs) = ref_mm(a, n, Trans::Yes, a, n, Trans::No, (n, n, m));
    let (e, w) = (eps as f64, (1.0 - eps as f64) / m as f64);
    let old_term = |i: usize| if eps == 0.0 { 0.0 } else { e * old[i] };
    let want = (0..n * n).map(|i| old_term(i) + w * ata[i]).collect();
    let bound = (0..n * n)
        .map(|i| (m + 4) as f64 * EPS * (old_term(i).abs() + w * abs[i]))
        .collect();
    (factor, want, bound)
}

fn check_syrk(got: &[f32], n: usize, want: &[f64], bound: &[f64]) {
    assert_close(got, want, bound, "syrk_ema");
    common::assert_symmetric(got, n);
}

/// `Q D Qᵀ` in f64 with `Q` the product of two random Householder reflectors.
fn psd_with_spectrum(rng: &mut ChaCha8Rng, d: &[f64]) -> Vec<f64> {
    let n = d.len();
    let q = common::householder_q64(rng, n, 2);
    let mut a = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            a[i * n + j] = (0..n).map(|p| q[i * n + p] * d[p] * q[j * n + p]).sum();
        }
    }
    // Exact symmetry before rounding to f32.
    for i in 0..n {
        for j in 0..i {
            let s = 0.5 * (a[i * n + j] + a[j * n + i]);
            a[i * n + j] = s;
            a[j * n + i] = s;
        }
    }
    a
}

/// A random SPD matrix with eigenvalues in [1, κ] (log-uniform, both ends hit).
fn random_spd(rng: &mut ChaCha8Rng, n: usize, kappa: f64) -> Vec<f64> {
    let d: Vec<f64> = (0..n)
        .map(|i| match i {
            0 => 1.0,
            1 => kappa,
            _ => kappa.powf(rng.random_range(0.0..1.0)),
        })
        .collect();
    psd_with_spectrum(rng, &d)
}

fn abs64(x: &[f64]) -> Vec<f64> {
    x.iter().map(|v| v.abs()).collect()
}

proptest! {
    #![proptest_config(common::proptest_config(16))]

    #[test]
    fn spectral_norm_finds_known_top_eigenvalue(n in 2usize..=200, top in 0.5f64..50.0, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // Eigen-gap λ₂/λ₁ ≤ 0.6 so the iteration converges in a few dozen steps.
        let d: Vec<f64> = (0..n)
            .map(|i| if i == n / 2 { top } else { top * rng.random_range(0.0..0.6) })
            .collect();
        let a = T32::from_f64(&psd_with_spectrum(&mut rng, &d), n, n);
        let opts = PowerOptions { tol: 1e-6, max_iter: 500, ..PowerOptions::default() };
        let info: PowerInfo = cpu::spectral_norm(a.view(), &opts).unwrap();
        prop_assert!(info.converged && info.iterations <= 500);
        // Rounding A to f32 moves eigenvalues by ≤ ‖ΔA‖₂ ≤ ‖ΔA‖_F ≤ u·√n·λ₁; the stopping rule
        // leaves ≈ tol/(1 − (λ₂/λ₁)²) ≤ 1.6·tol relative. Both with a 4x margin.
        let rel = (info.value as f64 - top).abs() / top;
        prop_assert!(rel <= 4.0 * (1e-6 + EPS * (n as f64).sqrt()), "rel err {rel:e}");
        let dev = Device::Cpu.spectral_norm(&a.upload(), &opts).unwrap();
        prop_assert_eq!(dev, info);
        // Default options: 1e-4 relative tolerance.
        let def = Device::Cpu.spectral_norm(&a.upload(), &PowerOptions::default()).unwrap();
        prop_assert!(def.converged && (def.value as f64 - top).abs() <= 1e-3 * top);
    }

    #[test]
    fn cholesky_factor_solve_inverse(n in dim(), k in 1usize..=40, log_kappa in 0.0f64..3.0, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let a64 = random_spd(&mut rng, n, 10f64.powf(log_kappa));
        let a = T32::from_f64(&a64, n, n);
        let a64 = a.dense(); // the f32-rounded matrix is the one being factored

        // Factor: lower, positive diagonal, L Lᵀ = A up to the f32 rounding of L
        // (|L̂L̂ᵀ − A| ≤ 2u|L||L|ᵀ + O(u²); bound 4u·(|L||L|ᵀ)).
        let l = cpu::cholesky(a.view()).unwrap();
        let l64: Vec<f64> = l.as_slice().iter().map(|&x| x as f64).collect();
        for i in 0..n {
            prop_assert!(l64[i * n + i] > 0.0);
            for j in i + 1..n {
                prop_assert_eq!(l64[i * n + j], 0.0);
            }
        }
        let lt: Vec<f64> = (0..n * n).map(|idx| l64[(idx % n) * n + idx / n]).collect();
        let llt = common::matmul64(&l64, &lt, n, n, n);
        let llt_abs = common::matmul64(&abs64(&l64), &abs64(&lt), n, n, n);
        let bound: Vec<f64> = llt_abs.iter().map(|x| 4.0 * EPS * x).collect();
        assert_close(&a.data, &llt, &bound, "L Lᵀ vs A");

        // Solve: X solves (L̂L̂ᵀ)X = B in f64, then is rounded; so
        // |A X − B| ≤ (|A − L̂L̂ᵀ| + u|A|)|X| ≤ u(2|L||L|ᵀ + |A|)|X|, with a 4x margin.
        let b = T32::random(&mut rng, n, k, 0);
        let mut x = b.clone();
        cpu::cholesky_solve(l.as_ref(), x.view_mut()).unwrap();
        let xd = x.dense();
        // The upper triangle of the factor is ignored.
        let mut l_junk = l.clone();
        for i in 0..n {
            for j in i + 1..n {
                l_junk.as_mut_slice()[i * n + j] = 1e3;
            }
        }
        let mut x_junk = b.clone();
        cpu::cholesky_solve(l_junk.as_ref(), x_junk.view_mut()).unwrap();
        prop_assert_eq!(x_junk.dense(), xd.clone());
        let ax = common::matmul64(&a64, &xd, n, n, k);
        let m: Vec<f64> = (0..n * n).map(|i| 2.0 * llt_abs[i] + a64[i].abs()).collect();
        let bound: Vec<f64> = common::matmul64(&m, &abs64(&xd), n, n, k).iter().map(|x| 4.0 * EPS * x).collect();
        assert_close(&b.data, &ax, &bound, "A X vs B");

        let inv = cpu::cholesky_inverse(a.view()).unwrap();
        check_spd_inverse(&a64, &inv)?;
        let dinv = Device::Cpu.cholesky_inverse(&a.upload()).unwrap();
        prop_assert_eq!(dinv.to_vec().unwrap(), inv.as_slice().to_vec());
        // Only the lower triangle of `a` is read (the factor and the inverse): finite junk
        // above it changes no bit.
        let mut a_junk = a.clone();
        for i in 0..n {
            for j in i + 1..n {
                a_junk.data[i * a.ld + j] = 1e3;
            }
        }
        prop_assert_eq!(cpu::cholesky(a_junk.view()).unwrap().into_vec(), l.into_vec());
        prop_assert_eq!(cpu::cholesky_inverse(a_junk.view()).unwrap().into_vec(), inv.into_vec());
    }

    /// The inverse at sizes where faer runs in parallel (n ≥ 512; `dim()` stops at 300),
    /// called from a thread outside the rayon pool (the test thread) and from inside it: the
    /// bound of `cholesky_factor_solve_inverse`, exact symmetry, and the same bits both ways.
    #[test]
    fn cholesky_inverse_parallel_sizes(n in 512usize..=540, log_kappa in 0.0f64..3.0, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let a = T32::from_f64(&random_spd(&mut rng, n, 10f64.powf(log_kappa)), n, n);
        let a64 = a.dense();
        let inv = cpu::cholesky_inverse(a.view()).unwrap();
        check_spd_inverse(&a64, &inv)?;
        let in_pool = rayon::scope(|_| cpu::cholesky_inverse(a.view())).unwrap();
        prop_assert_eq!(in_pool.into_vec(), inv.into_vec());
    }

    #[test]
    fn cholesky_rejects_indefinite(n in 2usize..=150, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut d: Vec<f64> = (0..n).map(|_| rng.random_range(0.5..2.0)).collect();
        d[n / 3] = -1.0;
        let a = T32::from_f64(&psd_with_spectrum(&mut rng, &d), n, n);
        let r = cpu::cholesky(a.view());
        prop_assert!(matches!(r, Err(Error::NotSpd { index, pivot, .. }) if index < n && pivot <= 0.0), "{r:?}");
        let r = cpu::cholesky_inverse(a.view());
        prop_assert!(matches!(r, Err(Error::NotSpd { .. })), "{r:?}");
        let r = Device::Cpu.cholesky_inverse(&a.upload());
        prop_assert!(matches!(r, Err(Error::NotSpd { .. })), "{r:?}");
    }
}

#[test]
fn empty_shapes() {
    let e: [f32; 0] = [];
    let z = |r, c| MatRef::new(&e[..], r, c).unwrap();
    // k = 0: C ← β C.
    // (C, β, C after): β C, and β = 0 overwrites even NaN.
    for (c0, beta, want) in [(2.0f32, 0.5, 1.0), (f32::NAN, 0.0, 0.0)] {
        let mut c = vec![c0; 6];
        let cm = MatMut::new(&mut c, 2, 3).unwrap();
        cpu::gemm(
            MatMul::new(Trans::No, Trans::No, 1.0, z(2, 0), z(0, 3)),
            beta,
            cm,
        )
        .unwrap();
        assert_eq!(c, vec![want; 6]);
    }
    // m = 0 or n = 0: nothing to do.
    let mut none: [f32; 0] = [];
    let b = vec![1.0f32; 12];
    cpu::gemm(
        MatMul::new(
            Trans::Yes,
            Trans::No,
            1.0,
            z(4, 0),
            MatRef::new(&b, 4, 3).unwrap(),
        ),
        0.0,
        MatMut::new(&mut none, 0, 3).unwrap(),
    )
    .unwrap();
    // n = 0 factors and inverses.
    cpu::syrk_ema(z(3, 0), 0.5, MatMut::new(&mut none, 0, 0).unwrap()).unwrap();
    assert_eq!(cpu::cholesky_inverse(z(0, 0)).unwrap().shape(), (0, 0));
    let info = cpu::spectral_norm(z(0, 0), &PowerOptions::default()).unwrap();
    assert_eq!(info.value, 0.0);
    // The zero matrix: norm 0, converged.
    let zeros = vec![0.0f32; 9];
    let info = cpu::spectral_norm(MatRef::new(&zeros, 3, 3).unwrap(), &PowerOptions::default());
    assert_eq!(info.unwrap().value, 0.0);
}

#[test]
fn alpha_zero_does_not_read_operands() {
    let a = vec![f32::NAN; 6];
    let mut c = vec![1.0f32, 2.0, 3.0, 4.0];
    cpu::gemm(
        MatMul::new(
            Trans::No,
            Trans::No,
            0.0,
            MatRef::new(&a, 2, 3).unwrap(),
            MatRef::new(&a, 3, 2).unwrap(),
        ),
        2.0,
        MatMut::new(&mut c, 2, 2).unwrap(),
    )
    .unwrap();
    assert_eq!(c, vec![2.0, 4.0, 6.0, 8.0]);
}

/// Asserts an error variant and that the output kept its old bits.
macro_rules! assert_err_unchanged {
    ($res:expr, $pat:pat, $out:expr, $before:expr) => {{
        let r = $res;
        assert!(matches!(r, Err($pat)), "{r:?}");
        let after: Vec<u32> = $out.iter().map(|x: &f32| x.to_bits()).collect();
        assert_eq!(after, $before, "output changed on error");
    }};
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn bad_inputs_give_typed_errors_and_leave_outputs_unchanged() {
    let mut rng = common::seeded_rng();
    let a = T32::random(&mut rng, 5, 4, 0);
    let b = T32::random(&mut rng, 4, 3, 0);
    let mut c = T32::random(&mut rng, 5, 3, 0);
    let before = bits(&c.data);

    // gemm: inner dimension, output shape, non-finite scalars.
    let gemm = |(ta, tb): (Trans, Trans), alpha: f32, beta: f32, c: &mut T32| {
        cpu::gemm(
            MatMul::new(ta, tb, alpha, a.view(), b.view()),
            beta,
            c.view_mut(),
        )
    };
    for ts in [(Trans::Yes, Trans::No), (Trans::No, Trans::Yes)] {
        let r = gemm(ts, 1.0, 0.0, &mut c);
        assert_err_unchanged!(r, Error::Shape { .. }, c.data, before);
    }
    for (alpha, beta) in [(f32::NAN, 0.0), (1.0, f32::INFINITY)] {
        let r = gemm((Trans::No, Trans::No), alpha, beta, &mut c);
        assert_err_unchanged!(r, Error::Value { .. }, c.data, before);
    }
    let mut wrong = T32::random(&mut rng, 3, 5, 0);
    let wb = bits(&wrong.data);
    let r = gemm((Trans::No, Trans::No), 1.0, 0.0, &mut wrong);
    assert_err_unchanged!(r, Error::Shape { .. }, wrong.data, wb);

    // Device::gemm also rejects NaN operands (and NaN C when β ≠ 0).
    let dev = Device::Cpu;
    let mut an = a.clone();
    an.data[7] = f32::NAN;
    let mut dc = c.upload();
    // Device::gemm(ta, No, 1, a, b, β, c).
    let dgemm = |ta: Trans, a: &T32, beta: f32, c: &mut Matrix| {
        dev.gemm(ta, Trans::No, 1.0, &a.upload(), &b.upload(), beta, c)
    };
    let r = dgemm(Trans::No, &an, 0.0, &mut dc);
    assert_err_unchanged!(
        r,
        Error::NonFinite { index: 7, .. },
        dc.to_vec().unwrap(),
        before
    );
    let mut cn = c.clone();
    cn.data[2] = f32::INFINITY;
    let mut dcn = cn.upload();
    let bn = bits(&cn.data);
    let r = dgemm(Trans::No, &a, 1.0, &mut dcn);
    assert_err_unchanged!(r, Error::NonFinite { .. }, dcn.to_vec().unwrap(), bn);
    let r = dgemm(Trans::Yes, &a, 0.0, &mut dc);
    assert_err_unchanged!(r, Error::Shape { .. }, dc.to_vec().unwrap(), before);

    // syrk_ema: ε range, factor shape, NaN in A, NaN in Λ with ε > 0, empty batch.
    let mut f = T32::random(&mut rng, 4, 4, 0);
    let fb = bits(&f.data);
    for eps in [-0.1f32, 1.0, f32::NAN] {
        let r = cpu::syrk_ema(a.view(), eps, f.view_mut());
        assert_err_unchanged!(r, Error::Value { .. }, f.data, fb);
    }
    let mut f5 = T32::random(&mut rng, 5, 5, 0);
    let f5b = bits(&f5.data);
    let r = cpu::syrk_ema(a.view(), 0.5, f5.view_mut());
    assert_err_unchanged!(r, Error::Shape { .. }, f5.data, f5b);
    let r = cpu::syrk_ema(an.view(), 0.5, f.view_mut());
    assert_err_unchanged!(r, Error::NonFinite { index: 7, .. }, f.data, fb);
    let mut fnan = f.clone();
    fnan.data[5] = f32::NAN;
    let fnb = bits(&fnan.data);
    let r = cpu::syrk_ema(a.view(), 0.5, fnan.view_mut());
    assert_err_unchanged!(r, Error::NonFinite { .. }, fnan.data, fnb);
    let empty: [f32; 0] = [];
    let r = cpu::syrk_ema(MatRef::new(&empty[..], 0, 4).unwrap(), 0.5, f.view_mut());
    assert_err_unchanged!(r, Error::Shape { .. }, f.data, fb);
    let abf: Vec<bf16> = an.data.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut df = f.upload();
    let r = dev.syrk_ema(&dev.upload(5, 4, &abf).unwrap(), 0.0, &mut df);
    assert_err_unchanged!(r, Error::NonFinite { .. }, df.to_vec().unwrap(), fb);
    let r = dev.syrk_ema(&a.upload(), 1.5, &mut df);
    assert_err_unchanged!(r, Error::Value { .. }, df.to_vec().unwrap(), fb);
    let mut df5 = f5.upload();
    let r = dev.syrk_ema(&a.upload(), 0.0, &mut df5);
    assert_err_unchanged!(r, Error::Shape { .. }, df5.to_vec().unwrap(), f5b);

    // batch_gradient: row mismatch, G shape, NaN.
    let e = T32::random(&mut rng, 5, 3, 0);
    let mut g = T32::random(&mut rng, 3, 4, 0);
    let gb = bits(&g.data);
    let r = cpu::batch_gradient(e.view(), b.view(), g.view_mut());
    assert_err_unchanged!(r, Error::Shape { .. }, g.data, gb);
    let r = cpu::batch_gradient(e.view(), an.view(), g.view_mut());
    assert_err_unchanged!(r, Error::NonFinite { .. }, g.data, gb);
    let mut dg = g.upload();
    let r = dev.batch_gradient(&e.upload(), &an.upload(), &mut dg);
    assert_err_unchanged!(r, Error::NonFinite { .. }, dg.to_vec().unwrap(), gb);
    let r = dev.batch_gradient(&a.upload(), &a.upload(), &mut dg);
    assert_err_unchanged!(r, Error::Shape { .. }, dg.to_vec().unwrap(), gb);

    // precondition: Γ̃⁻¹ shape, NaN in Λ̃⁻¹.
    let gi = T32::random(&mut rng, 3, 3, 0);
    let mut li = T32::random(&mut rng, 4, 4, 0);
    let mut p = T32::random(&mut rng, 3, 4, 0);
    let pb = bits(&p.data);
    let r = cpu::precondition(li.view(), g.view(), li.view(), p.view_mut());
    assert_err_unchanged!(r, Error::Shape { .. }, p.data, pb);
    let mut dp = p.upload();
    let r = dev.precondition(&li.upload(), &g.upload(), &li.upload(), &mut dp);
    assert_err_unchanged!(r, Error::Shape { .. }, dp.to_vec().unwrap(), pb);
    li.data[15] = f32::NAN;
    let r = cpu::precondition(gi.view(), g.view(), li.view(), p.view_mut());
    assert_err_unchanged!(r, Error::NonFinite { index: 15, .. }, p.data, pb);
    let r = dev.precondition(&gi.upload(), &g.upload(), &li.upload(), &mut dp);
    assert_err_unchanged!(r, Error::NonFinite { .. }, dp.to_vec().unwrap(), pb);

    // damped_inverse_update / add_diagonal: non-square, NaN dλ, NaN X.
    let cb = bits(&c.data);
    let r = cpu::damped_inverse_update(c.view_mut(), 0.01);
    assert_err_unchanged!(r, Error::Shape { .. }, c.data, cb);
    let r = cpu::add_diagonal(c.view_mut(), 0.01);
    assert_err_unchanged!(r, Error::Shape { .. }, c.data, cb);
    let r = cpu::damped_inverse_update(f.view_mut(), f32::NAN);
    assert_err_unchanged!(r, Error::Value { .. }, f.data, fb);
    let r = cpu::add_diagonal(f.view_mut(), f32::INFINITY);
    assert_err_unchanged!(r, Error::Value { .. }, f.data, fb);
    let r = cpu::damped_inverse_update(fnan.view_mut(), 0.01);
    assert_err_unchanged!(r, Error::NonFinite { .. }, fnan.data, fnb);
    let mut dfn = fnan.upload();
    let r = dev.damped_inverse_update(&mut dfn, 0.01);
    assert_err_unchanged!(r, Error::NonFinite { .. }, dfn.to_vec().unwrap(), fnb);
    let r = dev.add_diagonal(&mut df, f32::NAN);
    assert_err_unchanged!(r, Error::Value { .. }, df.to_vec().unwrap(), fb);

    // spectral_norm / trace / cholesky: non-square, NaN, bad options.
    let opts = PowerOptions::default();
    assert!(matches!(
        cpu::spectral_norm(c.view(), &opts),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        cpu::spectral_norm(fnan.view(), &opts),
        Err(Error::NonFinite { .. })
    ));
    for bad in [
        PowerOptions {
            tol: 0.0,
            max_iter: 10,
            ..opts
        },
        PowerOptions {
            tol: f32::NAN,
            max_iter: 10,
            ..opts
        },
        PowerOptions {
            tol: 1e-3,
            max_iter: 0,
            ..opts
        },
        PowerOptions {
            max_batch: 0,
            ..opts
        },
        PowerOptions {
            max_batch: PowerOptions::MAX_BATCH + 1,
            ..opts
        },
    ] {
        assert!(matches!(
            cpu::spectral_norm(f.view(), &bad),
            Err(Error::Value { .. })
        ));
        assert!(matches!(
            dev.spectral_norm(&f.upload(), &bad),
            Err(Error::Value { .. })
        ));
    }
    assert!(matches!(dev.trace(&c.upload()), Err(Error::Shape { .. })));
    assert!(matches!(cpu::cholesky(c.view()), Err(Error::Shape { .. })));
    assert!(matches!(
        cpu::cholesky(fnan.view()),
        Err(Error::NonFinite { .. })
    ));
    assert!(matches!(
        dev.cholesky_inverse(&fnan.upload()),
        Err(Error::NonFinite { .. })
    ));
    let l = Mat::from_vec(vec![1.0, 0.0, 0.5, 0.0], 2, 2).unwrap();
    let mut rhs = vec![1.0f32, 2.0];
    let r = cpu::cholesky_solve(l.as_ref(), MatMut::new(&mut rhs, 2, 1).unwrap());
    assert_err_unchanged!(r, Error::NotSpd { index: 1, .. }, rhs, bits(&[1.0, 2.0]));
    let r = cpu::cholesky_solve(l.as_ref(), MatMut::new(&mut rhs, 1, 2).unwrap());
    assert_err_unchanged!(r, Error::Shape { .. }, rhs, bits(&[1.0, 2.0]));
}
