//! One diagonal R-Kalman step (docs/math.md §3) with d_o = 10 outputs and n = 1e5 and 1e6 parameters:
//! grng's two streaming passes against the same step assembled from faer's dense kernels
//! (`P = (H diag σ) Hᵀ` as a GEMM, Cholesky of `S`, `S⁻¹H` by a solve, then column sums).
//! Throughput: bytes of the Jacobian `H` (4·d_o·n) per second — the step is memory-bound.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use faer::linalg::matmul::matmul;
use faer::linalg::solvers::Solve;
use faer::{Accum, Par};
use grng::ops::kalman::{KalmanOptions, KalmanState};
use grng::Device;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;

const D_O: usize = 10;

/// The same step with faer (ρ = 0, β, σ floor as in grng's defaults), column-major `H`.
struct FaerKalman {
    mu: Vec<f32>,
    sigma: Vec<f32>,
    r: faer::Mat<f32>,
    g: faer::Mat<f32>,
    w: faer::Mat<f32>,
}

impl FaerKalman {
    fn step(&mut self, h: &faer::Mat<f32>, v: &faer::Mat<f32>, beta: f32) {
        let n = h.ncols();
        // G = H diag(σ), P = G Hᵀ.
        for i in 0..n {
            let s = self.sigma[i];
            for j in 0..D_O {
                self.g[(j, i)] = h[(j, i)] * s;
            }
        }
        let mut p = faer::Mat::<f32>::zeros(D_O, D_O);
        matmul(
            p.as_mut(),
            Accum::Replace,
            self.g.as_ref(),
            h.transpose(),
            1.0,
            Par::rayon(0),
        );
        for j in 0..D_O {
            for k in 0..D_O {
                self.r[(j, k)] =
                    beta * self.r[(j, k)] + (1.0 - beta) * (v[(j, 0)] * v[(k, 0)] + p[(j, k)]);
            }
        }
        let mut s = &p + &self.r;
        for j in 0..D_O {
            s[(j, j)] += 1e-7;
        }
        let llt = s.llt(faer::Side::Lower).unwrap();
        // μ += σ ⊙ Hᵀ S⁻¹ v
        let sv = llt.solve(v);
        let mut t = faer::Mat::<f32>::zeros(n, 1);
        matmul(
            t.as_mut(),
            Accum::Replace,
            h.transpose(),
            sv.as_ref(),
            1.0,
            Par::rayon(0),
        );
        // σ_i ← σ_i (1 − σ_i h_iᵀ S⁻¹ h_i)
        self.w.copy_from(h);
        llt.solve_in_place(self.w.as_mut());
        for i in 0..n {
            let s = self.sigma[i];
            self.mu[i] += s * t[(i, 0)];
            let q: f32 = (0..D_O).map(|j| h[(j, i)] * self.w[(j, i)]).sum();
            self.sigma[i] = (s * (1.0 - s * q)).max(1e-10f32.min(s));
        }
    }
}

fn bench_kalman(c: &mut Criterion) {
    let mut group = common::flat_group(c, "kalman_step");
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for n in [100_000usize, 1_000_000] {
        group.throughput(Throughput::Bytes((4 * D_O * n) as u64));
        let h: Vec<f32> = (0..D_O * n)
            .map(|_| rng.random_range(-0.1f32..0.1))
            .collect();
        let v: Vec<f32> = (0..D_O).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mu0: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();

        let dev = Device::Cpu;
        let hm = dev.upload(D_O, n, &h).unwrap();
        let vm = dev.upload(D_O, 1, &v).unwrap();
        let opts = KalmanOptions {
            rho: 0.0,
            ..KalmanOptions::default()
        };
        let mut state = KalmanState::new(&dev, &mu0, 0.1, D_O).unwrap();
        group.bench_with_input(BenchmarkId::new("grng", n), &n, |b, _| {
            b.iter(|| dev.kalman_step(&mut state, &hm, &vm, &opts).unwrap())
        });

        let fh = faer::Mat::<f32>::from_fn(D_O, n, |j, i| h[j * n + i]);
        let fv = faer::Mat::<f32>::from_fn(D_O, 1, |j, _| v[j]);
        let mut fk = FaerKalman {
            mu: mu0.clone(),
            sigma: vec![0.1; n],
            r: faer::Mat::zeros(D_O, D_O),
            g: faer::Mat::zeros(D_O, n),
            w: faer::Mat::zeros(D_O, n),
        };
        group.bench_with_input(BenchmarkId::new("faer_dense_kernels", n), &n, |b, _| {
            b.iter(|| fk.step(&fh, &fv, opts.beta))
        });
    }
    group.finish();
}

criterion_group!(benches, bench_kalman);
criterion_main!(benches);
