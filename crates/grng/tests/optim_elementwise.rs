//! Element-wise device ops and the first-order optimizers (SGD, AdamW, Sophia-G).
//!
//! Each fused op is checked against a plain `f64` evaluation of its documented formula on
//! the same `f32` inputs, over ragged lengths (and once above the parallel threshold). The
//! optimizers must lower the loss of a small MLP; bad input must give a typed error and leave
//! parameters and optimizer state bit-for-bit unchanged.

use grng_testkit as common;

use grng::cpu::elementwise::PAR_MIN;
use grng::ops::elementwise::{AdamWCoeffs, SgdCoeffs, SophiaCoeffs};
use grng::optim::adamw::{AdamW, AdamWConfig, LrSchedule};
use grng::optim::sgd::{Sgd, SgdConfig};
use grng::optim::sophia::{Sophia, SophiaConfig, SophiaHessian};
use grng::{Device, Error, Matrix};
use grng_train::data::synthetic_classification;
use grng_train::mlp::{Activation, Loss, Mlp, MlpConfig, Targets};
use proptest::prelude::*;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Unit roundoff of `f32`. The fused ops chain at most ~6 roundings per element, each with
/// relative error ≤ U; `TOL_ULPS · U` times the sum of the magnitudes of the terms bounds the
/// deviation from the exact result (cancellation included), with a margin of ~2x.
const U: f64 = f32::EPSILON as f64 / 2.0;
const TOL_ULPS: f64 = 16.0;

fn up(v: &[f32]) -> Matrix {
    Device::Cpu.upload(v.len(), 1, v).unwrap()
}

fn host(m: &Matrix) -> Vec<f32> {
    m.to_vec().unwrap()
}

fn close(got: f32, want: f64, scale: f64, what: &str, i: usize) -> Result<(), TestCaseError> {
    let tol = TOL_ULPS * U * scale + f64::from(f32::MIN_POSITIVE);
    prop_assert!(
        (got as f64 - want).abs() <= tol,
        "{what}[{i}]: got {got}, want {want}, tol {tol}"
    );
    Ok(())
}

// ---- f64 references of the documented formulas, with error scales ---------------------

fn check_sgd(
    p0: &[f32],
    g: &[f32],
    b0: &[f32],
    c: &SgdCoeffs,
    p: &[f32],
    b: &[f32],
) -> Result<(), TestCaseError> {
    let (lr, mu, wd) = (c.lr as f64, c.momentum as f64, c.weight_decay as f64);
    for i in 0..p0.len() {
        let (th, gi, bi) = (p0[i] as f64, g[i] as f64, b0[i] as f64);
        let bn = mu * bi + gi;
        close(b[i], bn, mu * bi.abs() + gi.abs(), "b", i)?;
        let want = th - lr * wd * th - lr * bn;
        let scale = th.abs() * (1.0 + lr * wd) + lr * (mu * bi.abs() + gi.abs());
        close(p[i], want, scale, "params", i)?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn check_adamw(
    p0: &[f32],
    g: &[f32],
    m0: &[f32],
    v0: &[f32],
    c: &AdamWCoeffs,
    p: &[f32],
    m: &[f32],
    v: &[f32],
) -> Result<(), TestCaseError> {
    let (lr, b1, b2, eps, wd) = (
        c.lr as f64,
        c.beta1 as f64,
        c.beta2 as f64,
        c.eps as f64,
        c.weight_decay as f64,
    );
    let t = c.step as i32;
    let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
    for i in 0..p0.len() {
        let (th, gi) = (p0[i] as f64, g[i] as f64);
        let mn = b1 * m0[i] as f64 + (1.0 - b1) * gi;
        let m_scale = b1 * (m0[i] as f64).abs() + (1.0 - b1) * gi.abs();
        let vn = b2 * v0[i] as f64 + (1.0 - b2) * gi * gi;
        close(m[i], mn, m_scale, "m", i)?;
        close(v[i], vn, vn, "v", i)?;
        let den = (vn / bc2).sqrt() + eps;
        let want = th - lr * wd * th - lr * (mn / bc1) / den;
        let scale = th.abs() * (1.0 + lr * wd) + lr * (m_scale / bc1) / den;
        close(p[i], want, scale, "params", i)?;
    }
    Ok(())
}

fn check_sophia(
    p0: &[f32],
    g: &[f32],
    m0: &[f32],
    h: &[f32],
    c: &SophiaCoeffs,
    p: &[f32],
    m: &[f32],
) -> Result<(), TestCaseError> {
    let (lr, b1, gamma, eps, wd) = (
        c.lr as f64,
        c.beta1 as f64,
        c.gamma as f64,
        c.eps as f64,
        c.weight_decay as f64,
    );
    for i in 0..p0.len() {
        let (th, gi) = (p0[i] as f64, g[i] as f64);
        let mn = b1 * m0[i] as f64 + (1.0 - b1) * gi;
        let m_scale = b1 * (m0[i] as f64).abs() + (1.0 - b1) * gi.abs();
        close(m[i], mn, m_scale, "m", i)?;
        let den = (gamma * h[i] as f64).max(eps);
        let want = th - lr * wd * th - lr * (mn / den).clamp(-1.0, 1.0);
        // clip is 1-Lipschitz: the ratio's error is at most its unclipped error.
        let scale = th.abs() * (1.0 + lr * wd) + lr * (1.0 + m_scale / den);
        close(p[i], want, scale, "params", i)?;
    }
    Ok(())
}

fn check_hessian_ema(
    h0: &[f32],
    g: &[f32],
    beta2: f32,
    batch: usize,
    h: &[f32],
) -> Result<(), TestCaseError> {
    let (b2, bs) = (beta2 as f64, batch as f64);
    for i in 0..h0.len() {
        let gi = g[i] as f64;
        let want = b2 * h0[i] as f64 + (1.0 - b2) * bs * gi * gi;
        close(h[i], want, want, "h", i)?;
    }
    Ok(())
}

// ---- strategies ----------------------------------------------------------------------

fn vecs(k: usize, max_n: usize) -> impl Strategy<Value = Vec<Vec<f32>>> {
    (0..=max_n)
        .prop_flat_map(move |n| prop::collection::vec(prop::collection::vec(-10.0f32..10.0, n), k))
}

fn sgd_coeffs() -> impl Strategy<Value = SgdCoeffs> {
    (0.0f32..1.0, 0.0f32..0.999, 0.0f32..0.1).prop_map(|(lr, momentum, weight_decay)| SgdCoeffs {
        lr,
        momentum,
        weight_decay,
    })
}

fn adamw_coeffs() -> impl Strategy<Value = AdamWCoeffs> {
    (
        0.0f32..0.1,
        0.0f32..0.999,
        0.0f32..0.9999,
        1e-8f32..1e-3,
        0.0f32..0.1,
        1u64..2000,
    )
        .prop_map(|(lr, beta1, beta2, eps, weight_decay, step)| AdamWCoeffs {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            step,
        })
}

fn sophia_coeffs() -> impl Strategy<Value = SophiaCoeffs> {
    (
        0.0f32..0.1,
        0.0f32..0.999,
        1e-3f32..1.0,
        1e-12f32..1e-2,
        0.0f32..0.2,
    )
        .prop_map(|(lr, beta1, gamma, eps, weight_decay)| SophiaCoeffs {
            lr,
            beta1,
            gamma,
            eps,
            weight_decay,
        })
}

fn abs(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| x.abs()).collect()
}

// ---- fused ops vs f64 ------------------------------------------------------------------

proptest! {
    #![proptest_config(common::proptest_config(48))]

    #[test]
    fn axpy_scale_copy_match_f64(v in vecs(2, 300), alpha in -4.0f32..4.0) {
        let dev = Device::Cpu;
        let (x, y0) = (&v[0], &v[1]);
        let mut y = up(y0);
        dev.axpy(alpha, &up(x), &mut y).unwrap();
        for (i, (&got, (&xi, &yi))) in host(&y).iter().zip(x.iter().zip(y0)).enumerate() {
            let want = alpha as f64 * xi as f64 + yi as f64;
            close(got, want, (alpha as f64 * xi as f64).abs() + (yi as f64).abs(), "axpy", i)?;
        }
        let mut s = up(x);
        dev.scale(alpha, &mut s).unwrap();
        for (i, (&got, &xi)) in host(&s).iter().zip(x).enumerate() {
            close(got, alpha as f64 * xi as f64, (alpha as f64 * xi as f64).abs(), "scale", i)?;
        }
        let mut d = up(y0);
        dev.copy(&up(x), &mut d).unwrap();
        prop_assert_eq!(host(&d), x.clone());
    }

    #[test]
    fn dot_norm2_match_f64(v in vecs(2, 300)) {
        let dev = Device::Cpu;
        let (x, y) = (&v[0], &v[1]);
        let want: f64 = x.iter().zip(y).map(|(&a, &b)| a as f64 * b as f64).sum();
        let mag: f64 = x.iter().zip(y).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
        // f64 accumulation: only the final rounding to f32 (≤ U·|xᵀy|) and n·2⁻⁵³·Σ|xy| remain.
        let got = dev.dot(&up(x), &up(y)).unwrap() as f64;
        prop_assert!((got - want).abs() <= 2.0 * U * want.abs() + 1e-12 * mag + 1e-30,
            "dot {got} vs {want}");
        let n2: f64 = x.iter().map(|&a| a as f64 * a as f64).sum::<f64>().sqrt();
        let got = dev.norm2(&up(x)).unwrap() as f64;
        prop_assert!((got - n2).abs() <= 2.0 * U * n2 + 1e-30, "norm2 {got} vs {n2}");
    }

    #[test]
    fn sgd_update_matches_f64(v in vecs(3, 300), c in sgd_coeffs()) {
        let (mut p, mut b) = (up(&v[0]), up(&v[2]));
        Device::Cpu.sgd_update(&mut p, &up(&v[1]), &mut b, &c).unwrap();
        check_sgd(&v[0], &v[1], &v[2], &c, &host(&p), &host(&b))?;
    }

    #[test]
    fn adamw_update_matches_f64(v in vecs(4, 300), c in adamw_coeffs()) {
        let v0 = abs(&v[3]);
        let (mut p, mut m, mut vv) = (up(&v[0]), up(&v[2]), up(&v0));
        Device::Cpu.adamw_update(&mut p, &up(&v[1]), &mut m, &mut vv, &c).unwrap();
        check_adamw(&v[0], &v[1], &v[2], &v0, &c, &host(&p), &host(&m), &host(&vv))?;
    }

    #[test]
    fn sophia_update_matches_f64(v in vecs(4, 300), c in sophia_coeffs(), tiny in 0usize..4) {
        // Some h entries far below ε/γ exercise the max(γh, ε) floor and the clip.
        let h: Vec<f32> = v[3].iter().enumerate()
            .map(|(i, x)| if i % 4 == tiny { x.abs() * 1e-9 } else { x.abs() })
            .collect();
        let (mut p, mut m) = (up(&v[0]), up(&v[2]));
        Device::Cpu.sophia_update(&mut p, &up(&v[1]), &mut m, &up(&h), &c).unwrap();
        check_sophia(&v[0], &v[1], &v[2], &h, &c, &host(&p), &host(&m))?;
    }

    #[test]
    fn sophia_hessian_ema_matches_f64(v in vecs(2, 300), beta2 in 0.0f32..0.9999,
                                      batch in 1usize..512) {
        let h0 = abs(&v[0]);
        let mut h = up(&h0);
        Device::Cpu.sophia_hessian_ema(&mut h, &up(&v[1]), beta2, batch).unwrap();
        check_hessian_ema(&h0, &v[1], beta2, batch, &host(&h))?;
    }
}

/// Above [`PAR_MIN`] the ops run over rayon chunks; the results must still match.
#[test]
fn parallel_path_matches_f64() {
    let n = PAR_MIN + 4321;
    let mut rng = common::seeded_rng();
    let mut rv = || -> Vec<f32> { (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect() };
    let (p0, g, m0, w0) = (rv(), rv(), rv(), abs(&rv()));
    let dev = Device::Cpu;

    let c = SgdCoeffs {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.01,
    };
    let (mut p, mut b) = (up(&p0), up(&m0));
    dev.sgd_update(&mut p, &up(&g), &mut b, &c).unwrap();
    check_sgd(&p0, &g, &m0, &c, &host(&p), &host(&b)).unwrap();

    let c = common::ADAMW;
    let (mut p, mut m, mut v) = (up(&p0), up(&m0), up(&w0));
    dev.adamw_update(&mut p, &up(&g), &mut m, &mut v, &c)
        .unwrap();
    check_adamw(&p0, &g, &m0, &w0, &c, &host(&p), &host(&m), &host(&v)).unwrap();

    let c = SophiaCoeffs {
        lr: 1e-3,
        beta1: 0.965,
        gamma: 0.01,
        eps: 1e-12,
        weight_decay: 0.1,
    };
    let (mut p, mut m) = (up(&p0), up(&m0));
    dev.sophia_update(&mut p, &up(&g), &mut m, &up(&w0), &c)
        .unwrap();
    check_sophia(&p0, &g, &m0, &w0, &c, &host(&p), &host(&m)).unwrap();

    let mut h = up(&w0);
    dev.sophia_hessian_ema(&mut h, &up(&g), 0.98, 64).unwrap();
    check_hessian_ema(&w0, &g, 0.98, 64, &host(&h)).unwrap();

    let mut y = up(&m0);
    dev.axpy(-0.5, &up(&g), &mut y).unwrap();
    for (i, &got) in host(&y).iter().enumerate() {
        let want = -0.5 * g[i] as f64 + m0[i] as f64;
        close(
            got,
            want,
            0.5 * (g[i] as f64).abs() + (m0[i] as f64).abs(),
            "axpy",
            i,
        )
        .unwrap();
    }
    let want: f64 = p0.iter().zip(&g).map(|(&a, &b)| a as f64 * b as f64).sum();
    let mag: f64 = p0
        .iter()
        .zip(&g)
        .map(|(&a, &b)| (a as f64 * b as f64).abs())
        .sum();
    let got = dev.dot(&up(&p0), &up(&g)).unwrap() as f64;
    assert!(
        (got - want).abs() <= 2.0 * U * want.abs() + 1e-12 * mag,
        "{got} vs {want}"
    );
    // Deterministic regardless of scheduling.
    assert_eq!(
        dev.dot(&up(&p0), &up(&g)).unwrap().to_bits(),
        (got as f32).to_bits()
    );
}

// ---- bad input to the ops ---------------------------------------------------------------

#[test]
fn ops_reject_bad_input_without_writing() {
    let dev = Device::Cpu;
    let p0 = vec![0.5f32, -1.0, 2.0];
    let g = up(&[0.1, 0.2, 0.3]);
    let mut p = up(&p0);
    let mut m = up(&[0.0, 1.0, -1.0]);
    let mut v = up(&[1.0, 2.0, 3.0]);
    let ok = AdamWCoeffs {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.0,
        step: 1,
    };

    let short = up(&[1.0, 2.0]);
    assert!(matches!(
        dev.adamw_update(&mut p, &short, &mut m, &mut v, &ok),
        Err(Error::Shape { .. })
    ));
    let nan = up(&[0.1, f32::NAN, 0.3]);
    assert!(matches!(
        dev.adamw_update(&mut p, &nan, &mut m, &mut v, &ok),
        Err(Error::NonFinite { index: 1, .. })
    ));
    for bad in [
        AdamWCoeffs { beta1: 1.0, ..ok },
        AdamWCoeffs { eps: 0.0, ..ok },
        AdamWCoeffs { lr: -1.0, ..ok },
        AdamWCoeffs { lr: f32::NAN, ..ok },
        AdamWCoeffs { step: 0, ..ok },
    ] {
        assert!(matches!(
            dev.adamw_update(&mut p, &g, &mut m, &mut v, &bad),
            Err(Error::Value { .. })
        ));
    }
    let mut neg_v = up(&[1.0, -2.0, 3.0]);
    assert!(matches!(
        dev.adamw_update(&mut p, &g, &mut m, &mut neg_v, &ok),
        Err(Error::Value { .. })
    ));
    assert_eq!(host(&p), p0);
    assert_eq!(host(&m), vec![0.0, 1.0, -1.0]);
    assert_eq!(host(&v), vec![1.0, 2.0, 3.0]);

    let mut b = up(&[0.0; 3]);
    let sgd = SgdCoeffs {
        lr: 0.1,
        momentum: 1.0,
        weight_decay: 0.0,
    };
    assert!(matches!(
        dev.sgd_update(&mut p, &g, &mut b, &sgd),
        Err(Error::Value { .. })
    ));
    let sophia = SophiaCoeffs {
        lr: 0.1,
        beta1: 0.9,
        gamma: 0.0,
        eps: 1e-12,
        weight_decay: 0.0,
    };
    assert!(matches!(
        dev.sophia_update(&mut p, &g, &mut m, &v, &sophia),
        Err(Error::Value { .. })
    ));
    let mut h = up(&[1.0, 2.0, 3.0]);
    assert!(matches!(
        dev.sophia_hessian_ema(&mut h, &g, 0.98, 0),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        dev.sophia_hessian_ema(&mut h, &nan, 0.98, 4),
        Err(Error::NonFinite { .. })
    ));
    assert!(matches!(
        dev.axpy(f32::INFINITY, &g, &mut h),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        dev.axpy(1.0, &short, &mut h),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(dev.dot(&g, &short), Err(Error::Shape { .. })));
    assert!(matches!(dev.norm2(&nan), Err(Error::NonFinite { .. })));
    assert!(matches!(dev.copy(&short, &mut h), Err(Error::Shape { .. })));
    // Same element count, different shape: still a shape error.
    let row = dev.upload(1, 3, &[1.0f32, 2.0, 3.0]).unwrap();
    assert!(matches!(
        dev.axpy(1.0, &row, &mut h),
        Err(Error::Shape { .. })
    ));
    assert_eq!(host(&h), vec![1.0, 2.0, 3.0]);
    assert_eq!(host(&p), p0);
}

// ---- optimizers ------------------------------------------------------------------------

/// A 4-16-3 tanh MLP on Gaussian blobs, full batch (deterministic loss curve).
struct Problem {
    mlp: Mlp,
    x: grng::Mat,
    labels: Vec<usize>,
}

impl Problem {
    fn new() -> Self {
        let data = synthetic_classification(96, 4, 3, 11).unwrap();
        let (x, labels) = data.gather(&(0..data.len()).collect::<Vec<_>>()).unwrap();
        let cfg = MlpConfig {
            sizes: vec![4, 16, 3],
            activation: Activation::Tanh,
            loss: Loss::SoftmaxCrossEntropy,
        };
        Self {
            mlp: Mlp::new(cfg, 5).unwrap(),
            x,
            labels,
        }
    }

    fn n(&self) -> usize {
        self.mlp.num_params()
    }

    /// Loss and gradient at `params`.
    fn grad(&mut self, params: &Matrix) -> (f32, Matrix) {
        self.mlp.set_params(&host(params)).unwrap();
        let fwd = self.mlp.forward(self.x.as_ref()).unwrap();
        let bw = self
            .mlp
            .backward(&fwd, Targets::Classes(&self.labels))
            .unwrap();
        (bw.loss, up(&bw.grad))
    }

    /// Mean gradient under labels sampled from the model (Sophia's GNB estimator).
    fn sampled_grad(&mut self, params: &Matrix, rng: &mut ChaCha8Rng) -> Matrix {
        self.mlp.set_params(&host(params)).unwrap();
        let fwd = self.mlp.forward(self.x.as_ref()).unwrap();
        up(&self.mlp.backward_sampled(&fwd, rng).unwrap().grad)
    }

    fn loss(&mut self, params: &Matrix) -> f32 {
        self.grad(params).0
    }
}

const STEPS: usize = 150;

/// Each optimizer must cut the full-batch loss at least in half within [`STEPS`] steps
/// (the initial loss is ≈ ln 3 ≈ 1.1; these blobs are nearly separable).
fn assert_trains(name: &str, initial: f32, last: f32) {
    println!("{name}: loss {initial:.4} -> {last:.4}");
    assert!(
        last.is_finite() && last < 0.5 * initial,
        "{name}: loss {initial} -> {last}"
    );
}

#[test]
fn sgd_lowers_the_loss() {
    let mut pb = Problem::new();
    let mut params = up(pb.mlp.params());
    let initial = pb.loss(&params);
    let mut opt = Sgd::new(
        &Device::Cpu,
        pb.n(),
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        },
    )
    .unwrap();
    for _ in 0..STEPS {
        let (_, g) = pb.grad(&params);
        opt.step(&mut params, &g).unwrap();
    }
    assert_eq!(opt.steps(), STEPS as u64);
    assert_trains("sgd", initial, pb.loss(&params));
}

#[test]
fn adamw_lowers_the_loss() {
    let mut pb = Problem::new();
    let mut params = up(pb.mlp.params());
    let initial = pb.loss(&params);
    let cfg = AdamWConfig {
        lr: 1e-2,
        warmup_steps: 10,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(&Device::Cpu, pb.n(), cfg).unwrap();
    for _ in 0..STEPS {
        let (_, g) = pb.grad(&params);
        opt.step(&mut params, &g).unwrap();
    }
    assert_trains("adamw", initial, pb.loss(&params));
}

#[test]
fn sophia_lowers_the_loss() {
    let mut pb = Problem::new();
    let mut params = up(pb.mlp.params());
    let initial = pb.loss(&params);
    let cfg = SophiaConfig {
        lr: 1e-2,
        weight_decay: 0.0,
        hessian_every: 5,
        ..SophiaConfig::default()
    };
    let mut opt = Sophia::new(&Device::Cpu, pb.n(), cfg).unwrap();
    let mut rng = common::seeded_rng();
    let batch = pb.labels.len();
    let mut refreshes = 0;
    for _ in 0..STEPS {
        let (_, g) = pb.grad(&params);
        if opt.needs_hessian() {
            refreshes += 1;
            let sg = pb.sampled_grad(&params, &mut rng);
            opt.step(
                &mut params,
                &g,
                Some(SophiaHessian {
                    sampled_grad: &sg,
                    batch,
                }),
            )
            .unwrap();
        } else {
            opt.step(&mut params, &g, None).unwrap();
        }
    }
    assert_eq!(refreshes, STEPS.div_ceil(5));
    assert!(host(opt.hessian()).iter().all(|&h| h >= 0.0));
    assert_trains("sophia", initial, pb.loss(&params));
}

#[test]
fn adamw_schedule_and_first_step() {
    let cfg = AdamWConfig {
        lr: 1e-3,
        warmup_steps: 10,
        schedule: LrSchedule::Cosine {
            total_steps: 110,
            min_lr: 1e-4,
        },
        ..AdamWConfig::default()
    };
    assert!((cfg.lr_at(1) - 1e-4).abs() < 1e-9);
    assert!((cfg.lr_at(5) - 5e-4).abs() < 1e-9);
    assert_eq!(cfg.lr_at(10), 1e-3);
    assert!((cfg.lr_at(60) - 5.5e-4).abs() < 1e-8, "{}", cfg.lr_at(60));
    assert_eq!(cfg.lr_at(110), 1e-4);
    assert_eq!(cfg.lr_at(10_000), 1e-4);
    assert!(AdamWConfig {
        schedule: LrSchedule::Cosine {
            total_steps: 10,
            min_lr: 0.0
        },
        ..cfg
    }
    .validate()
    .is_err());

    // Bias correction: the first step moves every coordinate by lr·sign(g) (ε ≪ |g|).
    let cfg = AdamWConfig {
        lr: 0.01,
        warmup_steps: 0,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(&Device::Cpu, 4, cfg).unwrap();
    let p0 = [1.0f32, -2.0, 0.5, 3.0];
    let mut p = up(&p0);
    opt.step(&mut p, &up(&[0.3, -4.0, 1e-3, -0.2])).unwrap();
    let want = [0.99f32, -1.99, 0.49, 3.01];
    for (got, want) in host(&p).iter().zip(want) {
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }
}

/// Taking a state and restoring it into a fresh optimizer continues bit-for-bit.
#[test]
fn state_restore_round_trip() {
    let dev = Device::Cpu;
    let mut rng = common::seeded_rng();
    let n = 37;
    let grads: Vec<Matrix> = (0..6)
        .map(|_| {
            up(&(0..n)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect::<Vec<_>>())
        })
        .collect();
    let p0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();

    let cfg = AdamWConfig {
        lr: 1e-2,
        warmup_steps: 4,
        ..AdamWConfig::default()
    };
    let (mut a, mut b) = (
        AdamW::new(&dev, n, cfg).unwrap(),
        AdamW::new(&dev, n, cfg).unwrap(),
    );
    let mut pa = up(&p0);
    for g in &grads[..3] {
        a.step(&mut pa, g).unwrap();
    }
    b.restore(&a.state().unwrap()).unwrap();
    let mut pb = up(&host(&pa));
    for g in &grads[3..] {
        a.step(&mut pa, g).unwrap();
        b.step(&mut pb, g).unwrap();
    }
    assert_eq!(host(&pa), host(&pb));
    assert_eq!(a.state().unwrap(), b.state().unwrap());

    let cfg = SophiaConfig {
        hessian_every: 2,
        ..SophiaConfig::default()
    };
    let (mut a, mut b) = (
        Sophia::new(&dev, n, cfg).unwrap(),
        Sophia::new(&dev, n, cfg).unwrap(),
    );
    let mut pa = up(&p0);
    for g in &grads[..3] {
        let hs = a.needs_hessian().then_some(SophiaHessian {
            sampled_grad: g,
            batch: 8,
        });
        a.step(&mut pa, g, hs).unwrap();
    }
    b.restore(&a.state().unwrap()).unwrap();
    let mut pb = up(&host(&pa));
    assert_eq!(a.needs_hessian(), b.needs_hessian());
    for g in &grads[3..] {
        let hs = a.needs_hessian().then_some(SophiaHessian {
            sampled_grad: g,
            batch: 8,
        });
        a.step(&mut pa, g, hs).unwrap();
        b.step(&mut pb, g, hs).unwrap();
    }
    assert_eq!(host(&pa), host(&pb));
    assert_eq!(a.state().unwrap(), b.state().unwrap());

    let cfg = SgdConfig::default();
    let (mut a, mut b) = (
        Sgd::new(&dev, n, cfg).unwrap(),
        Sgd::new(&dev, n, cfg).unwrap(),
    );
    let mut pa = up(&p0);
    a.step(&mut pa, &grads[0]).unwrap();
    b.restore(&a.state().unwrap()).unwrap();
    let mut pb = up(&host(&pa));
    a.step(&mut pa, &grads[1]).unwrap();
    b.step(&mut pb, &grads[1]).unwrap();
    assert_eq!(host(&pa), host(&pb));
}

#[test]
fn optimizers_reject_bad_input_and_keep_state() {
    let dev = Device::Cpu;
    let n = 5;
    let p0: Vec<f32> = vec![0.1, -0.2, 0.3, -0.4, 0.5];
    let g = up(&[1.0, 2.0, 3.0, 4.0, 5.0]);
    let nan_g = up(&[1.0, 2.0, f32::NAN, 4.0, 5.0]);
    let wrong = up(&[1.0; 4]);
    let row = dev.upload(1, n, &[1.0f32; 5]).unwrap();

    // Configs.
    assert!(matches!(
        Sgd::new(
            &dev,
            n,
            SgdConfig {
                lr: -0.1,
                ..SgdConfig::default()
            }
        ),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        Sgd::new(&dev, 0, SgdConfig::default()),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        AdamW::new(
            &dev,
            n,
            AdamWConfig {
                beta2: 1.0,
                ..AdamWConfig::default()
            }
        ),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        Sophia::new(
            &dev,
            n,
            SophiaConfig {
                hessian_every: 0,
                ..SophiaConfig::default()
            }
        ),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        Sophia::new(
            &dev,
            n,
            SophiaConfig {
                beta2: -0.1,
                ..SophiaConfig::default()
            }
        ),
        Err(Error::Value { .. })
    ));
    for c in [
        SgdConfig::default().validate(),
        AdamWConfig::default().validate(),
        SophiaConfig::default().validate(),
    ] {
        c.unwrap();
    }

    // Sgd / AdamW: one good step, then bad steps leave everything as it was.
    let mut sgd = Sgd::new(&dev, n, SgdConfig::default()).unwrap();
    let mut adamw = AdamW::new(&dev, n, AdamWConfig::default()).unwrap();
    let (mut ps, mut pa) = (up(&p0), up(&p0));
    sgd.step(&mut ps, &g).unwrap();
    adamw.step(&mut pa, &g).unwrap();
    let (ss, sa) = (sgd.state().unwrap(), adamw.state().unwrap());
    let (hs, ha) = (host(&ps), host(&pa));
    assert!(matches!(
        sgd.step(&mut ps, &nan_g),
        Err(Error::NonFinite { index: 2, .. })
    ));
    assert!(matches!(
        sgd.step(&mut ps, &wrong),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(sgd.step(&mut ps, &row), Err(Error::Shape { .. })));
    assert!(matches!(
        adamw.step(&mut pa, &nan_g),
        Err(Error::NonFinite { .. })
    ));
    assert!(matches!(
        adamw.step(&mut pa, &wrong),
        Err(Error::Shape { .. })
    ));
    let mut p_nan = up(&[0.0, f32::INFINITY, 0.0, 0.0, 0.0]);
    assert!(matches!(
        adamw.step(&mut p_nan, &g),
        Err(Error::NonFinite { .. })
    ));
    assert!(sgd
        .set_config(SgdConfig {
            momentum: 1.5,
            ..SgdConfig::default()
        })
        .is_err());
    assert_eq!((sgd.state().unwrap(), host(&ps)), (ss.clone(), hs));
    assert_eq!((adamw.state().unwrap(), host(&pa)), (sa.clone(), ha));
    assert_eq!(sgd.config(), &SgdConfig::default());
    // Restore with the wrong size or bad values.
    let mut bad = sa.clone();
    bad.v[0] = -1.0;
    assert!(matches!(adamw.restore(&bad), Err(Error::Value { .. })));
    bad.v.pop();
    assert!(matches!(adamw.restore(&bad), Err(Error::Shape { .. })));
    assert_eq!(adamw.state().unwrap(), sa);

    // Sophia: missing Hessian, bad Hessian sample, and a bad gradient on a refresh step must
    // leave m, h, the counter and the parameters untouched.
    let mut sophia = Sophia::new(&dev, n, SophiaConfig::default()).unwrap();
    let mut p = up(&p0);
    assert!(sophia.needs_hessian());
    assert!(matches!(
        sophia.step(&mut p, &g, None),
        Err(Error::Value { .. })
    ));
    let hess = |sampled_grad, batch| {
        Some(SophiaHessian {
            sampled_grad,
            batch,
        })
    };
    let hs_ok = SophiaHessian {
        sampled_grad: &g,
        batch: 4,
    };
    sophia.step(&mut p, &g, Some(hs_ok)).unwrap();
    // Force another refresh step with a bad gradient: h must not move.
    let st = sophia.state().unwrap();
    let hp = host(&p);
    assert!(matches!(
        sophia.step(&mut p, &nan_g, Some(hs_ok)),
        Err(Error::NonFinite { .. })
    ));
    assert!(matches!(
        sophia.step(&mut p, &g, hess(&nan_g, 4)),
        Err(Error::NonFinite { .. })
    ));
    assert!(matches!(
        sophia.step(&mut p, &g, hess(&g, 0)),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        sophia.step(&mut p, &g, hess(&wrong, 4)),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        sophia.step(&mut p, &wrong, None),
        Err(Error::Shape { .. })
    ));
    assert_eq!((sophia.state().unwrap(), host(&p)), (st, hp));
}
