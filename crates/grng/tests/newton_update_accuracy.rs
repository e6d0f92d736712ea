//! The NGD and RING update `P = Γ̃⁻¹ G Λ̃⁻¹` with default settings against an `f64`
//! exact-inverse reference (issue 36, item 7): `≤ 1e-5` relative (Frobenius) on
//! well-conditioned damped factors, on every device — the CPU (its default Cholesky, and the
//! kernel devices' default Newton), the emulator (running `kernels/newton.cu`) and, when one
//! is present, the GPU (`GRNG_REQUIRE_CUDA=1` makes its absence an error).
//!
//! The reference is the exact inverse of the optimizer's own damped `f32` factors: what is
//! tested is the inverse, not the factors' `f32` rounding (which moves `P` by up to
//! `κ·√m·2⁻²⁴` with any inverse: ~5e-6 against factors formed in `f64` here).
//!
//! The tolerance: the default Newton stops at the `f32` floor, a residual `≈ 5e-9·κ`
//! (`grng::cpu::newton`), `≲ 1.5e-6` at the κ ≤ 300 below, which each inverse carries into
//! `P`, with the products' `≲ √d·2⁻²⁴`. Measured (4 seeds): CPU Newton ≤ 1.9e-6, emulator ≤
//! 1.0e-6, CPU Cholesky ≤ 2.8e-7 at κ ≤ 131; with `d/4` statistics rows (κ up to ~300) the
//! floor's share grows to ~1e-5, the bound itself, for either stop rule.

use grng_testkit as common;

use grng::optim::kron::{InverseMethod, KronConfig, KronFactorState, KronGrad, KronOptimizer};
use grng::optim::KronStats;
use grng::{Device, Matrix};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The bound on the update's relative error.
const TOL: f64 = 1e-5;

fn f64s(m: &Matrix) -> Vec<f64> {
    m.to_vec().unwrap().iter().map(|&v| v as f64).collect()
}

fn frob(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

/// The largest eigenvalue of a symmetric PSD `n x n` matrix (power iteration: the Rayleigh
/// quotient, from below).
fn max_eig64(a: &[f64], n: usize) -> f64 {
    let mut v = vec![1.0 / (n as f64).sqrt(); n];
    let mut rq = 0.0;
    for _ in 0..300 {
        let w = common::matmul64(a, &v, n, n, 1);
        rq = v.iter().zip(&w).map(|(x, y)| x * y).sum();
        let norm = frob(&w);
        v = w.iter().map(|x| x / norm).collect();
    }
    rq
}

/// The damped factor the optimizer inverts, `F + λI` with its `f32` factor `F` and the
/// diagonal added in `f32` (as `Device::add_diagonal` does), in `f64`.
fn damped64(s: &KronFactorState) -> Vec<f64> {
    let n = s.factor.rows();
    let mut f = s.factor.to_vec().unwrap();
    (0..n).for_each(|i| f[i * n + i] += s.damping);
    f.iter().map(|&v| v as f64).collect()
}

/// The two refreshes' largest relative error `‖P − P₆₄‖_F / ‖P₆₄‖_F` of the optimizer `cfg`
/// on `dev` for one `d_out x d_in` layer, statistics of `m` rows (entries uniform in
/// `[-1, 1)`), and the largest condition number of a damped factor seen. `cfg.skip = 1`, so
/// the second call refreshes too: Newton then starts warm from the first inverse.
fn update_error(
    dev: &Device,
    mut cfg: KronConfig,
    d_out: usize,
    d_in: usize,
    m: usize,
    seed: u64,
) -> (f64, f64) {
    cfg.skip = 1;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut upload = |r: usize, c: usize| dev.upload(r, c, &common::vals(&mut rng, r * c)).unwrap();
    let mut opt = KronOptimizer::new(dev, &[(d_out, d_in)], cfg).unwrap();
    let (mut worst, mut kappa) = (0.0f64, 0.0f64);
    for _ in 0..2 {
        let (a, e, g) = (upload(m, d_in), upload(m, d_out), upload(d_out, d_in));
        let p = opt
            .precondition_grads(&[KronGrad::Dense(&g)], Some(&[KronStats { a: &a, e: &e }]))
            .unwrap();
        let c = opt.counters();
        assert_eq!(c.fallbacks(), 0, "{c:?}");
        let st = opt.state().unwrap();
        let (sl, sg) = (&st.layers[0].lambda, &st.layers[0].gamma);
        // The reference: exact inverses of the optimizer's own damped factors — the inverse
        // is what is tested, not the f32 rounding of the factors (which moves P by up to
        // κ·√m·2⁻²⁴ relative, ~5e-6 here, with any inverse).
        let (lt, gt) = (damped64(sl), damped64(sg));
        for (f, n, s) in [(&lt, d_in, sl), (&gt, d_out, sg)] {
            kappa = kappa.max(max_eig64(f, n) / s.damping as f64);
        }
        let (li, gi) = (
            common::spd_inverse64(&lt, d_in),
            common::spd_inverse64(&gt, d_out),
        );
        let gp = common::matmul64(&gi, &f64s(&g), d_out, d_out, d_in);
        let p_ref = common::matmul64(&gp, &li, d_out, d_in, d_in);
        let diff: Vec<f64> = f64s(&p[0]).iter().zip(&p_ref).map(|(x, y)| x - y).collect();
        worst = worst.max(frob(&diff) / frob(&p_ref));
    }
    (worst, kappa)
}

/// RING and NGD at their defaults.
fn variants() -> [(&'static str, KronConfig); 2] {
    [("ring", KronConfig::ring()), ("ngd", KronConfig::ngd())]
}

/// Statistics rows for a layer of widths up to `d`: `d..=2d`, so that `‖Λ‖₂ ≲
/// (1 + 1)²/3 ≈ 1.3` against NGD's damping `≈ √1e-4 = 1e-2` (times π or 1/π): κ ≲ 300
/// (RING's is `≤ 1 + 1/√ρ ≈ 33` at any size). The f32 floor's share of the update's error
/// grows about as `3.5e-8·κ` (measured: 7.6e-6 at κ = 207, 2.8e-6 at 146, with `d/4` rows).
fn rows(rng: &mut ChaCha8Rng, d: usize) -> usize {
    rng.random_range(d..=2 * d)
}

fn check(dev: &Device, cfg: KronConfig, name: &str, d_out: usize, d_in: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let m = rows(&mut rng, d_out.max(d_in));
    let (err, kappa) = update_error(dev, cfg, d_out, d_in, m, seed);
    eprintln!(
        "{name} {} {} {d_out} x {d_in}, m = {m}: κ ≤ {kappa:.0}, relative error {err:.1e}",
        dev.name(),
        cfg.inverse.resolve(dev).label()
    );
    assert!(
        kappa <= 300.0,
        "{name} on {}: κ {kappa:.0} is not well-conditioned",
        dev.name()
    );
    assert!(
        err <= TOL,
        "{name} on {}, {d_out} x {d_in}, m = {m}, κ ≤ {kappa:.0}: relative error {err:e} > {TOL:e}",
        dev.name()
    );
}

/// The kernel devices' default inverse ([`InverseMethod::Auto`] there), on the CPU.
fn kernel_default() -> InverseMethod {
    InverseMethod::Auto.resolve(&Device::Emulated)
}

proptest! {
    #![proptest_config(common::proptest_config(15))]

    /// `on`: the CPU's default (Cholesky, or Woodbury from the rows), the kernel devices'
    /// default Newton run by the CPU backend, the emulator's default (factors up to
    /// `host_refresh_max = 128` refreshed on the host by Cholesky, larger ones by warm-started
    /// Newton in `kernels/newton.cu`), or the emulator with every factor on the device
    /// (`host_refresh_max = 0`: Newton at every width).
    #[test]
    fn update_matches_f64_reference(
        on in 0u8..4,
        d_out in 17usize..=130,
        d_in in 17usize..=130,
        seed: u64,
    ) {
        let dev = if on >= 2 { Device::Emulated } else { Device::Cpu };
        for (name, mut cfg) in variants() {
            if on == 1 {
                cfg.inverse = kernel_default();
            }
            if on == 3 {
                cfg.host_refresh_max = 0;
            }
            check(&dev, cfg, name, d_out, d_in, seed);
        }
    }
}

/// The GPU's default, at ragged sizes past one 128-wide tile; skipped (with a note) without
/// a GPU unless `GRNG_REQUIRE_CUDA=1`.
#[test]
fn cuda_update_matches_f64_reference() {
    let Some(dev) = common::cuda() else {
        return;
    };
    let mut rng = common::seeded_rng();
    for _ in 0..3 {
        let (d_out, d_in) = (rng.random_range(129..=700), rng.random_range(129..=700));
        let seed = rng.random();
        for (name, cfg) in variants() {
            check(&dev, cfg, name, d_out, d_in, seed);
        }
    }
}
