//! Data-parallel checks (`grng::dist`), written once per rank so that the same code runs on
//! the thread communicator (`crates/grng/tests/dist.rs`) and under `mpirun`
//! (`crates/grng/examples/dist_mpi.rs`): `P` ranks, each with its own shard of every batch
//! (ragged: uneven row counts), take the step one process takes on the concatenated batch,
//! for every method, and hold the same bits; ranks that disagree fail on every rank,
//! unchanged, without hanging. Every rank draws the same inputs from the case seed and runs
//! the single-process reference itself.
//!
//! # Bounds (u = 2⁻²⁴)
//! A rank's gradient is the f32 mean of its `m_p` rows; the reduction multiplies it by `m_p`,
//! adds the `P` ranks and divides by `M = Σ m_p`; one process adds all `M` rows and divides.
//! Both are within `γ_{M+P+2}·Σ_k|g_k|/M` of the exact mean (Higham Thm 3.5), so they differ
//! by at most `r·Σ_k|g_k|/M` with `r = 2γ_{M+P+2}`. The per-sample gradients of the
//! element-wise checks keep one sign per coordinate (magnitudes drawn fresh), so
//! `Σ_k|g_k|/M = |g|`: relative `r`. The element-wise methods' bounds follow per coordinate
//! (beside each); a Kronecker step's from its factors' perturbation (beside [`kron`]); the
//! Kalman filter gathers the whole observation, so its step is the same bits.

use std::sync::Arc;

use grng::dist::{Communicator, DataParallel, Inversions, Threads};
use grng::optim::adamw::{AdamW, AdamWConfig};
use grng::optim::kalman::{RKalman, RKalmanConfig};
use grng::optim::kron::{KronConfig, KronFactorState, KronGrad, KronOptimizer, KronState};
use grng::optim::sgd::{Sgd, SgdConfig};
use grng::optim::sophia::{Sophia, SophiaConfig, SophiaHessians};
use grng::optim::KronStats;
use grng::{Device, Error, Matrix};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const U: f64 = crate::U32;

/// Runs `f` on every rank of a world of `p` threads ([`Threads`]), results in rank order.
pub fn ranks<R: Send>(p: usize, f: impl Fn(Arc<dyn Communicator>) -> R + Sync) -> Vec<R> {
    let world = Threads::world(p).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = world
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(Arc::new(c)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `p` uneven shard sizes in `1..=6` (not all equal when `p > 1`), and their offsets.
fn shards(rng: &mut ChaCha8Rng, p: usize) -> Vec<(usize, usize)> {
    loop {
        let sizes: Vec<usize> = (0..p).map(|_| rng.random_range(1..=6)).collect();
        if p == 1 || sizes.windows(2).any(|w| w[0] != w[1]) {
            let mut at = 0;
            return sizes
                .iter()
                .map(|&m| {
                    at += m;
                    (at - m, m)
                })
                .collect();
        }
    }
}

/// `m x n` per-sample rows, coordinate `i` of sign `signs[i]` and magnitude in `[0.5, 1.5)`.
fn signed_rows(rng: &mut ChaCha8Rng, m: usize, signs: &[f32]) -> Vec<f32> {
    let n = signs.len();
    (0..m * n)
        .map(|k| signs[k % n] * rng.random_range(0.5f32..1.5))
        .collect()
}

/// The f32 mean, in row order, of rows `lo..lo + m` of the `n`-wide `rows`.
fn mean(rows: &[f32], n: usize, (lo, m): (usize, usize)) -> Vec<f32> {
    let mut s = vec![0.0f32; n];
    for r in lo..lo + m {
        for (a, &v) in s.iter_mut().zip(&rows[r * n..(r + 1) * n]) {
            *a += v;
        }
    }
    s.iter().map(|v| v / m as f32).collect()
}

/// `r = 2γ_{M+P+2}`: the relative gap of two f32 means of the same rows (module docs).
fn mean_gap(m: usize, p: usize) -> f64 {
    let k = (m + p + 2) as f64;
    2.0 * k * U / (1.0 - k * U)
}

fn max_abs(x: &[f32]) -> f64 {
    x.iter().fold(0.0f64, |a, &v| a.max(v.abs() as f64))
}

/// Asserts `|a_i − b_i| ≤ tol` for every coordinate.
fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f64, seed: u64) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let d = (x as f64 - y as f64).abs();
        assert!(
            d <= tol,
            "{what}[{i}]: {x} vs {y} (|diff| {d:e} > bound {tol:e}), case seed {seed}"
        );
    }
}

/// Asserts that every rank holds `x` with the same bits as rank 0 (broadcast and compared).
fn assert_same_bits(comm: &dyn Communicator, what: &str, x: &[f32]) {
    let mut root = x.to_vec();
    comm.broadcast(&mut root, 0).unwrap();
    let same = root.iter().zip(x).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "rank {}: {what} differs from rank 0's", comm.rank());
}

/// One element-wise method: the parameters after `T` steps on `P` ranks (rank 0's; every
/// rank's must be the same bits) and on one process, and the per-sample data's scale.
pub trait Elementwise: Sized {
    fn make(dev: &Device, n: usize) -> Self;
    fn set(&mut self, dp: DataParallel);
    /// One step with gradient `g` and Hessian sample `h` (of `batch` rows).
    fn step(&mut self, p: &mut Matrix, g: &Matrix, h: &Matrix, batch: usize) -> grng::Result<()>;
    /// `|Δθ|` bound per coordinate for `T` steps given the relative gradient gap `r`, the
    /// largest `|θ|` and the reference's final state.
    fn bound(&self, steps: usize, r: f64, theta: f64) -> f64;
}

impl Elementwise for Sgd {
    fn make(dev: &Device, n: usize) -> Self {
        let config = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        Sgd::new(dev, n, config).unwrap()
    }
    fn set(&mut self, dp: DataParallel) {
        self.set_data_parallel(Some(dp));
    }
    fn step(&mut self, p: &mut Matrix, g: &Matrix, _: &Matrix, _: usize) -> grng::Result<()> {
        Sgd::step(self, p, g)
    }
    /// `v ← μv + g`, `θ ← θ − lr·v`: `v` is a positive combination of the gradients, so its
    /// relative gap is `r` (plus `2u` per step for its own rounding), and each step moves `θ`
    /// by at most `lr·(r + 2Tu)·|v|` apart, plus both runs' roundings of `θ − lr·v` (`2u|θ|`).
    fn bound(&self, steps: usize, r: f64, theta: f64) -> f64 {
        let v = max_abs(&self.state().unwrap().momentum);
        let t = steps as f64;
        t * (self.config().lr as f64 * (r + 2.0 * t * U) * v + 2.0 * U * theta) * 2.0
    }
}

impl Elementwise for AdamW {
    fn make(dev: &Device, n: usize) -> Self {
        let config = AdamWConfig {
            lr: 0.01,
            ..AdamWConfig::default()
        };
        AdamW::new(dev, n, config).unwrap()
    }
    fn set(&mut self, dp: DataParallel) {
        self.set_data_parallel(Some(dp));
    }
    fn step(&mut self, p: &mut Matrix, g: &Matrix, _: &Matrix, _: usize) -> grng::Result<()> {
        AdamW::step(self, p, g)
    }
    /// With one sign per coordinate, `m̂` (a positive combination of the gradients) and `√v̂`
    /// have relative gaps `r` and `r` (plus a few `u`), and `|m̂| ≤ √v̂` (a weighted mean is at
    /// most the root mean square), so the direction `m̂/(√v̂ + ε)` (at most 1) moves by at
    /// most `2r + 8u`; each step adds `lr·(2r + 8u)` and the roundings of `θ` (`2u|θ|`), and
    /// decoupled weight decay scales the gap by `1 − lr·λ ≤ 1`.
    fn bound(&self, steps: usize, r: f64, theta: f64) -> f64 {
        let t = steps as f64;
        t * (self.config().lr as f64 * (2.0 * r + 8.0 * U) + 2.0 * U * theta) * 2.0
    }
}

impl Elementwise for Sophia {
    fn make(dev: &Device, n: usize) -> Self {
        let config = SophiaConfig {
            lr: 0.01,
            hessian_every: 2,
            ..SophiaConfig::default()
        };
        Sophia::new(dev, n, config).unwrap()
    }
    fn set(&mut self, dp: DataParallel) {
        self.set_data_parallel(Some(dp));
    }
    fn step(&mut self, p: &mut Matrix, g: &Matrix, h: &Matrix, batch: usize) -> grng::Result<()> {
        let s = [h];
        let hess = self.needs_hessian().then_some(SophiaHessians {
            sampled_grads: &s,
            batch,
        });
        self.step_many(&mut [p], &[g], hess)
    }
    /// `m` (gradients) and `h` (an EMA of `B·ĝ²`, `ĝ` a one-signed mean) have relative gaps
    /// `r` and `2r` (plus a few `u`); the clipped ratio `clip(m / max(γh, ε), 1)` is
    /// 1-Lipschitz in a ratio of relative gap `3r`, and only moves where it is below 1: at
    /// most `3r + 8u` per step, times `lr`, plus the roundings of `θ`.
    fn bound(&self, steps: usize, r: f64, theta: f64) -> f64 {
        let t = steps as f64;
        t * (self.config().lr as f64 * (3.0 * r + 8.0 * U) + 2.0 * U * theta) * 2.0
    }
}

/// This rank's part of an element-wise method's check: `P` ranks (the communicator's) against
/// one process (run here too), `T = 4` steps, inputs drawn from `seed` (the same on every rank).
pub fn elementwise<O: Elementwise>(comm: Arc<dyn Communicator>, seed: u64) {
    const T: usize = 4;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let p = comm.size();
    let n = rng.random_range(3..40);
    let dev = Device::Cpu;
    let theta0 = crate::vals(&mut rng, n);
    let shards = shards(&mut rng, p);
    let m: usize = shards.iter().map(|s| s.1).sum();
    let signs: Vec<f32> = (0..n)
        .map(|_| if rng.random::<bool>() { 1.0 } else { -1.0 })
        .collect();
    // Per step: per-sample gradients and sampled gradients (Sophia's Hessian sample).
    let data: Vec<(Vec<f32>, Vec<f32>)> = (0..T)
        .map(|_| {
            let g = signed_rows(&mut rng, m, &signs);
            let h = signed_rows(&mut rng, m, &signs);
            (g, h)
        })
        .collect();

    let mut reference = O::make(&dev, n);
    let mut theta = dev.upload(n, 1, &theta0).unwrap();
    for (g, h) in &data {
        let gm = dev.upload(n, 1, &mean(g, n, (0, m))).unwrap();
        let hm = dev.upload(n, 1, &mean(h, n, (0, m))).unwrap();
        reference.step(&mut theta, &gm, &hm, m).unwrap();
    }
    let want = theta.to_vec().unwrap();

    let shard = shards[comm.rank()];
    let mut opt = O::make(&dev, n);
    let mut dp = DataParallel::new(comm.clone());
    dp.set_rows(shard.1);
    opt.set(dp);
    let mut theta = dev.upload(n, 1, &theta0).unwrap();
    for (g, h) in &data {
        let gm = dev.upload(n, 1, &mean(g, n, shard)).unwrap();
        let hm = dev.upload(n, 1, &mean(h, n, shard)).unwrap();
        opt.step(&mut theta, &gm, &hm, shard.1).unwrap();
    }
    let got = theta.to_vec().unwrap();
    assert_same_bits(&*comm, "theta", &got);
    let tol = reference.bound(T, mean_gap(m, p), max_abs(&want) + 1.0);
    assert_close("theta", &got, &want, tol, seed);
}

/// One Kronecker problem: layer shapes `(d_out, d_in)` and per step the rows `A` (`M x d_in`,
/// last column the bias 1) and `E` (`M x d_out`) of every layer.
struct KronProblem {
    shapes: Vec<(usize, usize)>,
    steps: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
    w0: Vec<Vec<f32>>,
}

impl KronProblem {
    /// Two layers of `M` rows per step, each `d_out` in `outs` and `d_in` in `ins` (capped
    /// at `M`: see [`kron`]).
    fn draw(
        rng: &mut ChaCha8Rng,
        m: usize,
        steps: usize,
        (outs, ins): (
            std::ops::RangeInclusive<usize>,
            std::ops::RangeInclusive<usize>,
        ),
    ) -> Self {
        let shapes: Vec<(usize, usize)> = (0..2)
            .map(|_| {
                (
                    rng.random_range(outs.clone()),
                    rng.random_range(ins.clone()),
                )
            })
            .collect();
        let steps = (0..steps)
            .map(|_| {
                shapes
                    .iter()
                    .map(|&(o, i)| {
                        let mut a = crate::vals(rng, m * i);
                        (0..m).for_each(|k| a[k * i + i - 1] = 1.0);
                        (a, crate::vals(rng, m * o))
                    })
                    .collect()
            })
            .collect();
        let w0 = shapes
            .iter()
            .map(|&(o, i)| crate::vals(rng, o * i))
            .collect();
        Self { shapes, steps, w0 }
    }
}

/// Rows `lo..lo + m` of the `n`-wide `rows` as a matrix.
fn rows_of(dev: &Device, rows: &[f32], n: usize, (lo, m): (usize, usize)) -> Matrix {
    dev.upload(m, n, &rows[lo * n..(lo + m) * n]).unwrap()
}

/// Runs the problem on `shard` of the rows (the whole batch for one process), gradients
/// dense or by their factors; returns the weights and the state after every step.
fn kron_run(
    prob: &KronProblem,
    config: KronConfig,
    shard: (usize, usize),
    factored: bool,
    dp: Option<DataParallel>,
) -> Vec<(Vec<Vec<f32>>, KronState)> {
    let dev = Device::Cpu;
    let mut opt = KronOptimizer::new(&dev, &prob.shapes, config).unwrap();
    opt.set_data_parallel(dp);
    let mut w: Vec<Matrix> = prob
        .w0
        .iter()
        .zip(&prob.shapes)
        .map(|(w, &(o, i))| dev.upload(o, i, w).unwrap())
        .collect();
    let mut trace = Vec::new();
    for step in &prob.steps {
        let mats: Vec<(Matrix, Matrix)> = step
            .iter()
            .zip(&prob.shapes)
            .map(|((a, e), &(o, i))| (rows_of(&dev, a, i, shard), rows_of(&dev, e, o, shard)))
            .collect();
        let dense: Vec<Matrix> = mats
            .iter()
            .zip(&prob.shapes)
            .map(|((a, e), &(o, i))| {
                let mut g = dev.zeros(o, i).unwrap();
                dev.batch_gradient(e, a, &mut g).unwrap();
                g
            })
            .collect();
        let (by_factors, stats) = factored_inputs(&mats);
        let grads: Vec<KronGrad<'_>> = if factored {
            by_factors
        } else {
            dense.iter().map(KronGrad::Dense).collect()
        };
        let stats = opt.needs_stats().then_some(&stats[..]);
        opt.step_grads(&mut w, &grads, stats).unwrap();
        let ws = w.iter().map(|m| m.to_vec().unwrap()).collect();
        trace.push((ws, opt.state().unwrap()));
    }
    trace
}

/// Asserts that `b` is `a` bit for bit: every matrix, scalar and counter.
fn assert_state_bits(a: &KronState, b: &KronState, what: &str) {
    let (ma, mb) = (a.matrices(), b.matrices());
    assert_eq!(ma.len(), mb.len(), "{what}: matrices");
    for ((name, x), (_, y)) in ma.iter().zip(&mb) {
        let (x, y) = (x.to_vec().unwrap(), y.to_vec().unwrap());
        let same = x.len() == y.len() && x.iter().zip(&y).all(|(u, v)| u.to_bits() == v.to_bits());
        assert!(same, "{what}: {name} differs");
    }
    let (sa, sb) = (a.scalars(), b.scalars());
    let same = sa.len() == sb.len()
        && sa
            .iter()
            .zip(&sb)
            .all(|(u, v)| u.0 == v.0 && u.1.to_bits() == v.1.to_bits());
    assert!(same, "{what}: scalars {sa:?} vs {sb:?}");
}

fn fro(x: &[f32]) -> f64 {
    x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt()
}

/// `‖|X|ᵀ|Y|‖_F / M` for `M x a` and `M x b` rows: the scale of a mean Gram product's rounding.
fn abs_gram(x: &[f32], y: &[f32], m: usize, a: usize, b: usize) -> f64 {
    let mut s = 0.0;
    for i in 0..a {
        for j in 0..b {
            let v: f64 = (0..m)
                .map(|k| (x[k * a + i] as f64).abs() * (y[k * b + j] as f64).abs())
                .sum();
            s += v * v;
        }
    }
    s.sqrt() / m as f64
}

/// This rank's part of a Kronecker method's check: `P` ranks against one process (run here
/// too), gradients dense or by their factors, `T = 3` steps with `S = 2` (a
/// refresh, a lazy step, a refresh blended by the EMA).
///
/// Bound per step, from the reference's state (`λ` the dampings, `F` the factors, `G` the
/// gradient, `P` the preconditioned gradient): `δG`, `δF` (the mean products' gap, `r` times
/// `‖|E|ᵀ|A|‖_F/M` and `‖|X|ᵀ|X|‖_F/M`, carried through the EMA with its rounding), then
///
/// `‖δP‖_F ≤ (‖δG‖ + ‖G‖(‖δΓ‖/λ_Γ + ‖δΛ‖/λ_Λ))/(λ_Γλ_Λ) + ‖P‖(δλ_Γ/λ_Γ + δλ_Λ/λ_Λ + 2·4n·u·(κ_Γ + κ_Λ))`
///
/// (`‖(F + λI)⁻¹‖₂ ≤ 1/λ` for PSD `F`; the last term is the two Cholesky inverses' own
/// errors, `κ = (‖F‖ + λ)/λ`), with a 4x margin, summed over the steps times `η`. `δλ` is
/// RING's power-iteration estimate of `‖F‖₂`, whose stopping point may differ between two
/// runs on factors equal to rounding: the two iterations follow the same path from the same
/// start and each stops once an iteration moves it by at most `tol`, so they differ by at
/// most a couple of such moves, `|δλ|/λ ≤ 4·tol` (asserted); RENG's `√ρ` is the same and
/// NGD's trace ratio moves by `δF`'s relative size.
///
/// The ranks run it twice, inverting every layer everywhere and spread over the ranks
/// ([`Inversions`]): the spread run must hold the other's weights and whole state bit for bit
/// after every step (the same code inverts the same factors, and the CPU's Cholesky inverse
/// is exactly symmetric, so its triangle loses nothing) — so it is within the bound too.
pub fn kron(comm: Arc<dyn Communicator>, seed: u64, config: KronConfig, factored: bool) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let p = comm.size();
    let shards = shards(&mut rng, p);
    let m: usize = shards.iter().map(|s| s.1).sum();
    let config = KronConfig { skip: 2, ..config };
    // M ≥ every dimension, so the ranks reduce Gram matrices and dense gradients (fewer values
    // than their rows, `KronOptimizer::set_data_parallel`) and one process forms its factors
    // as they do (RING's norm from the factor, not from the rows' `m x m` Gram: `layer.rs`).
    let prob = KronProblem::draw(&mut rng, m, 3, (2..=m.clamp(2, 5), 2..=m.clamp(2, 6)));
    let want = kron_run(&prob, config, (0, m), factored, None);
    let shard = shards[comm.rank()];
    let mut dp = DataParallel::new(comm.clone());
    dp.set_rows(shard.1);
    let got = kron_run(&prob, config, shard, factored, Some(dp.clone()));
    for (t, (w, _)) in got.iter().enumerate() {
        assert_same_bits(&*comm, &format!("weights after step {t}"), &w.concat());
    }
    let spread = dp.with_inversions(Inversions::Spread);
    let spread = kron_run(&prob, config, shard, factored, Some(spread));
    for (t, ((w, st), (ws, sts))) in got.iter().zip(&spread).enumerate() {
        let what = format!("{:?} P={p} step {t}: spread", config.variant);
        assert_eq!(ws, w, "{what} weights; case seed {seed}");
        assert_state_bits(st, sts, &what);
    }
    let r = mean_gap(m, p);
    let eta = (config.lr / prob.shapes.len() as f32) as f64;
    let mut drift = vec![0.0f64; prob.shapes.len()];
    let mut df = vec![[0.0f64; 2]; prob.shapes.len()];
    for (t, step) in prob.steps.iter().enumerate() {
        for (l, (&(o, i), (a, e))) in prob.shapes.iter().zip(step).enumerate() {
            let ls = &want[t].1.layers[l];
            let ds = &got[t].1.layers[l];
            // Refreshes at t = 0 and 2 (S = 2); the EMA (ε) keeps a share of the old gap.
            if t % 2 == 0 {
                let eps = if t == 0 { 0.0 } else { config.ema as f64 };
                let fresh = [abs_gram(a, a, m, i, i), abs_gram(e, e, m, o, o)];
                for s in 0..2 {
                    df[l][s] = eps * df[l][s] + (1.0 - eps) * r * fresh[s] + 4.0 * U * fresh[s];
                }
            }
            let (lam, gam) = (&ls.lambda, &ls.gamma);
            let (dl, dg) = (lam.damping as f64, gam.damping as f64);
            let dlam = |x: f32, y: f32| ((x - y) as f64).abs() / (x as f64);
            let (ddl, ddg) = (
                dlam(lam.damping, ds.lambda.damping),
                dlam(gam.damping, ds.gamma.damping),
            );
            if config.variant == grng::optim::kron::KronVariant::Ring {
                let tol = config.power.tol as f64;
                assert!(
                    ddl <= 4.0 * tol && ddg <= 4.0 * tol,
                    "RING dampings {ddl:e} {ddg:e}"
                );
            }
            let g = abs_gram(e, a, m, o, i);
            let dgrad = r * g;
            // κ ≤ (‖F‖_F + λ)/λ.
            let kappa = |s: &KronFactorState| {
                (fro(&s.factor.to_vec().unwrap()) + s.damping as f64) / s.damping as f64
            };
            let prev = if t == 0 {
                &prob.w0[l]
            } else {
                &want[t - 1].0[l]
            };
            let pnorm = fro(&want[t].0[l]
                .iter()
                .zip(prev)
                .map(|(x, y)| x - y)
                .collect::<Vec<_>>())
                / eta;
            let n = o.max(i) as f64;
            let dp = (dgrad + g * (df[l][1] / dg + df[l][0] / dl)) / (dl * dg)
                + pnorm * (ddl + ddg + 8.0 * n * U * (kappa(lam) + kappa(gam)));
            drift[l] += 4.0 * eta * dp + 4.0 * U * fro(&want[t].0[l]);
            let diff: Vec<f32> = want[t].0[l]
                .iter()
                .zip(&got[t].0[l])
                .map(|(x, y)| x - y)
                .collect();
            let d = fro(&diff);
            assert!(
                d <= drift[l],
                "{:?} P={p} factored={factored} step {t} layer {l}: ‖ΔW‖ {d:e} > bound {:e}; \
                 case seed {seed}",
                config.variant,
                drift[l],
            );
        }
    }
}

/// This rank's part of the rows check: layers more than twice as wide as the batch (and
/// `n > 64`), factored gradients, so one process takes the rows' routes (the Woodbury inverse,
/// RING's norm from the `m x m` Gram, the factored preconditioning, the lazy steps' `m x m`
/// terms). The ranks gather every rank's rows instead of reducing dense gradients and Gram
/// matrices (fewer values), so they take that process's step on the concatenated batch:
/// weights and whole state the same bits, after every step (a refresh, a lazy step, a
/// refresh; `T = 3`, `S = 2`).
pub fn kron_rows(comm: Arc<dyn Communicator>, seed: u64, config: KronConfig) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let p = comm.size();
    let shards = shards(&mut rng, p);
    let m: usize = shards.iter().map(|s| s.1).sum();
    let config = KronConfig { skip: 2, ..config };
    let prob = KronProblem::draw(&mut rng, m, 3, (65..=80, 65..=80));
    let want = kron_run(&prob, config, (0, m), true, None);
    let shard = shards[comm.rank()];
    let mut dp = DataParallel::new(comm.clone());
    dp.set_rows(shard.1);
    let got = kron_run(&prob, config, shard, true, Some(dp));
    for (t, ((w, st), (wg, stg))) in want.iter().zip(&got).enumerate() {
        let what = format!("{:?} P={p} step {t}: gathered rows", config.variant);
        assert_eq!(wg, w, "{what} weights; case seed {seed}");
        assert_state_bits(st, stg, &what);
    }
    let low_rank = got[2].1.counters.low_rank_inversions;
    assert!(low_rank > 0, "the rows' route was not taken");
}

/// This rank's part of the Kalman check: the filter (R-Kalman, or plain with `rho = 0`)
/// stepped on `P` ranks' shards of the observation (two output rows per sample) holds the same
/// bits as one process stepped on the whole observation: the step gathers the rows and runs
/// the single-process step, so not even rounding differs.
pub fn kalman(comm: Arc<dyn Communicator>, seed: u64, config: RKalmanConfig) {
    const T: usize = 3;
    const D_OUT: usize = 2;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let dev = Device::Cpu;
    let shards = shards(&mut rng, comm.size());
    let m: usize = shards.iter().map(|s| s.1).sum();
    let n = rng.random_range(4..24);
    let mu0 = crate::vals(&mut rng, n);
    let d_o = m * D_OUT;
    let data: Vec<(Vec<f32>, Vec<f32>)> = (0..T)
        .map(|_| (crate::vals(&mut rng, d_o * n), crate::vals(&mut rng, d_o)))
        .collect();
    let mut reference = RKalman::new(&dev, &mu0, d_o, config).unwrap();
    for (h, v) in &data {
        let h = dev.upload(d_o, n, h).unwrap();
        let v = dev.upload(d_o, 1, v).unwrap();
        reference.step(&h, &v).unwrap();
    }
    let (lo, rows) = shards[comm.rank()];
    let (lo, rows) = (lo * D_OUT, rows * D_OUT);
    let mut filter = RKalman::new(&dev, &mu0, d_o, config).unwrap();
    filter.set_data_parallel(Some(DataParallel::new(comm.clone())));
    for (h, v) in &data {
        let h = rows_of(&dev, h, n, (lo, rows));
        let v = rows_of(&dev, v, 1, (lo, rows));
        filter.step(&h, &v).unwrap();
    }
    let (want, got) = (reference.state().unwrap(), filter.state().unwrap());
    assert_eq!(
        got, want,
        "the gathered step is the single-process step, bit for bit"
    );
}

/// This rank's part of the failure check: ranks whose shapes differ, or one rank whose input
/// fails its checks, make the step fail on every rank — a typed error, nothing changed, no
/// hang — and the ranks step together again afterwards. Needs `P ≥ 2`.
pub fn failures(comm: Arc<dyn Communicator>, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let dev = Device::Cpu;
    let (rank, p) = (comm.rank(), comm.size());
    let last = rank == p - 1;
    let n = rng.random_range(2..10);
    let dp = DataParallel::new(comm.clone());

    // AdamW: the last rank's model has one more parameter.
    // (Every rank draws the same values, so the streams stay together.)
    let mine = if last { n + 1 } else { n };
    let mut opt = AdamW::new(&dev, mine, AdamWConfig::default()).unwrap();
    opt.set_data_parallel(Some(dp.clone()));
    let mut theta = dev
        .upload(mine, 1, &crate::vals(&mut rng, n + 1)[..mine])
        .unwrap();
    let before = theta.to_vec().unwrap();
    let g = dev.upload(mine, 1, &vec![0.5; mine]).unwrap();
    let e = opt.step(&mut theta, &g).unwrap_err();
    assert!(matches!(e, Error::Ranks { .. }), "rank {rank}: {e}");
    assert_eq!((opt.steps(), theta.to_vec().unwrap()), (0, before));

    // AdamW, same shapes: a NaN on the last rank is named there, `Ranks` elsewhere; then a
    // good step succeeds everywhere (every rank made the same collectives).
    let mut opt = AdamW::new(&dev, n, AdamWConfig::default()).unwrap();
    opt.set_data_parallel(Some(dp.clone()));
    let theta0 = crate::vals(&mut rng, n);
    let mut theta = dev.upload(n, 1, &theta0).unwrap();
    let mut g = vec![0.5f32; n];
    if last {
        g[n - 1] = f32::NAN;
    }
    let e = opt
        .step(&mut theta, &dev.upload(n, 1, &g).unwrap())
        .unwrap_err();
    match (&e, last) {
        (Error::NonFinite { .. }, true) | (Error::Ranks { .. }, false) => {}
        _ => panic!("rank {rank}: unexpected {e}"),
    }
    assert_eq!((opt.steps(), theta.to_vec().unwrap()), (0, theta0));
    let good = dev.upload(n, 1, &vec![0.5f32; n]).unwrap();
    opt.step(&mut theta, &good).unwrap();
    assert_same_bits(&*comm, "theta after a good step", &theta.to_vec().unwrap());

    // Kronecker: the last rank's second layer is wider.
    let shapes = [(2, 3), (3, if last { 5 } else { 4 })];
    let mut kron = KronOptimizer::new(&dev, &shapes, KronConfig::ring()).unwrap();
    kron.set_data_parallel(Some(dp.clone()));
    let mut w: Vec<Matrix> = shapes
        .iter()
        .map(|&(o, i)| dev.upload(o, i, &crate::vals(&mut rng, o * i)).unwrap())
        .collect();
    let w0: Vec<Vec<f32>> = w.iter().map(|m| m.to_vec().unwrap()).collect();
    let mats: Vec<(Matrix, Matrix)> = shapes
        .iter()
        .map(|&(o, i)| {
            let a = dev.upload(4, i, &crate::vals(&mut rng, 4 * i)).unwrap();
            let e = dev.upload(4, o, &crate::vals(&mut rng, 4 * o)).unwrap();
            (a, e)
        })
        .collect();
    let (grads, stats) = factored_inputs(&mats);
    let e = kron.step_grads(&mut w, &grads, Some(&stats)).unwrap_err();
    assert!(matches!(e, Error::Ranks { .. }), "rank {rank}: {e}");
    let w1: Vec<Vec<f32>> = w.iter().map(|m| m.to_vec().unwrap()).collect();
    assert_eq!((kron.steps(), w1), (0, w0));
    spread_failure(&comm, seed);

    // Kalman: the ranks' rows do not add up to the filter's observation size.
    let mut filter = RKalman::new(&dev, &[0.1; 3], 2 * p, RKalmanConfig::default()).unwrap();
    filter.set_data_parallel(Some(dp));
    let rows = if last { 3 } else { 2 };
    let h = dev.upload(rows, 3, &vec![0.5; rows * 3]).unwrap();
    let v = dev.upload(rows, 1, &vec![0.5; rows]).unwrap();
    let before = filter.state().unwrap();
    let e = filter.step(&h, &v).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "rank {rank}: {e}");
    assert_eq!(filter.state().unwrap(), before);
}

/// The spread refresh's failure check: RING without a damping floor, one layer's error rows
/// zero on every rank, so that layer's `Γ = 0` gets the damping `√ρ·‖Γ‖₂ = 0` and its
/// Cholesky inversion fails — on the one rank that owns the layer ([`Inversions::Spread`]),
/// which reports it ([`Error::NotSpd`]); every other rank fails with [`Error::Ranks`],
/// every optimizer and weight unchanged. Then a good refresh steps every rank together with
/// the same bits as inverting everywhere.
fn spread_failure(comm: &Arc<dyn Communicator>, seed: u64) {
    // Its own stream: the checks before it draw different amounts on the last rank.
    let rng = &mut ChaCha8Rng::seed_from_u64(case(seed, 1));
    let dev = Device::Cpu;
    let rank = comm.rank();
    let shapes = [(3, 4), (2, 5), (4, 3)];
    let config = KronConfig {
        damping_floor: 0.0,
        ..KronConfig::ring()
    };
    let w0: Vec<Vec<f32>> = shapes
        .iter()
        .map(|&(o, i)| crate::vals(rng, o * i))
        .collect();
    let draw = |rng: &mut ChaCha8Rng, dead: Option<usize>| -> Vec<(Matrix, Matrix)> {
        shapes
            .iter()
            .enumerate()
            .map(|(l, &(o, i))| {
                let a = dev.upload(3, i, &crate::vals(rng, 3 * i)).unwrap();
                let mut e = crate::vals(rng, 3 * o);
                if dead == Some(l) {
                    e.iter_mut().for_each(|v| *v = 0.0);
                }
                (a, dev.upload(3, o, &e).unwrap())
            })
            .collect()
    };
    let bad = draw(rng, Some(1));
    let good = draw(rng, None);
    let run = |inversions| {
        let mut kron = KronOptimizer::new(&dev, &shapes, config).unwrap();
        let dp = DataParallel::new(comm.clone()).with_inversions(inversions);
        kron.set_data_parallel(Some(dp));
        let mut w: Vec<Matrix> = w0
            .iter()
            .zip(&shapes)
            .map(|(w, &(o, i))| dev.upload(o, i, w).unwrap())
            .collect();
        let (grads, stats) = factored_inputs(&bad);
        let e = kron.step_grads(&mut w, &grads, Some(&stats)).unwrap_err();
        let w1: Vec<Vec<f32>> = w.iter().map(|m| m.to_vec().unwrap()).collect();
        assert_eq!((kron.steps(), &w1), (0, &w0), "rank {rank}: changed by {e}");
        assert!(kron.state().unwrap().layers.is_empty());
        let (grads, stats) = factored_inputs(&good);
        kron.step_grads(&mut w, &grads, Some(&stats)).unwrap();
        let w: Vec<Vec<f32>> = w.iter().map(|m| m.to_vec().unwrap()).collect();
        (e, w, kron.state().unwrap())
    };
    let (e, w, st) = run(Inversions::Everywhere);
    assert!(matches!(e, Error::NotSpd { .. }), "rank {rank}: {e}");
    let (e, ws, sts) = run(Inversions::Spread);
    // Layer 1 (costs 2³ + 5³ = 133, the largest) goes to rank 0.
    match (&e, rank) {
        (Error::NotSpd { .. }, 0) | (Error::Ranks { .. }, 1..) => {}
        _ => panic!("rank {rank}: unexpected {e}"),
    }
    assert_eq!(ws, w, "rank {rank}: spread weights after the good step");
    assert_state_bits(&st, &sts, "spread state after the good step");
    assert_same_bits(&**comm, "spread weights after the good step", &ws.concat());
}

/// Every check on this rank, for a runner with one communicator (the MPI example): each case
/// draws its inputs from `seed` mixed with its index.
pub fn all(comm: Arc<dyn Communicator>, seed: u64) {
    let case = |i| case(seed, i);
    elementwise::<Sgd>(comm.clone(), case(1));
    elementwise::<AdamW>(comm.clone(), case(2));
    elementwise::<Sophia>(comm.clone(), case(3));
    for (i, config) in kron_configs().into_iter().enumerate() {
        for factored in [false, true] {
            kron(
                comm.clone(),
                case(10 + 2 * i as u64 + factored as u64),
                config,
                factored,
            );
        }
    }
    for (i, config) in kron_configs().into_iter().take(3).enumerate() {
        kron_rows(comm.clone(), case(20 + i as u64), config);
    }
    kalman(comm.clone(), case(30), RKalmanConfig::default());
    kalman(comm.clone(), case(31), RKalmanConfig::plain());
    failures(comm, case(40));
}

/// Each layer's `(A, E)` as a factored gradient and as statistics.
pub fn factored_inputs(mats: &[(Matrix, Matrix)]) -> (Vec<KronGrad<'_>>, Vec<KronStats<'_>>) {
    let grads = mats
        .iter()
        .map(|(a, e)| KronGrad::Factored { e, a })
        .collect();
    let stats = mats.iter().map(|(a, e)| KronStats { a, e }).collect();
    (grads, stats)
}

/// Case `i`'s seed: `seed` mixed with `i`.
fn case(seed: u64, i: u64) -> u64 {
    seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The equivalence checks that hold on a world of one rank (the failure check needs two):
/// the world-of-one NCCL test.
pub fn all_single(comm: Arc<dyn Communicator>, seed: u64) {
    let case = |i| case(seed, i);
    elementwise::<AdamW>(comm.clone(), case(2));
    kron(comm.clone(), case(10), KronConfig::ring(), true);
    kalman(comm, case(30), RKalmanConfig::default());
}

/// The Kronecker configurations checked: RING, RENG, NGD, and RING with the EMA (factors
/// reduced before the blend).
pub fn kron_configs() -> Vec<KronConfig> {
    vec![
        KronConfig::ring(),
        KronConfig::reng(),
        KronConfig::ngd(),
        KronConfig {
            ema: 0.5,
            ..KronConfig::ring()
        },
    ]
}
