//! `KronOptimizer` with `bf16` statistics (issue 9 item 4): statistics passed as
//! `Matrix<bf16>`, or `f32` ones with `KronConfig::stats_precision = Bf16`, reach the
//! tensor-core SYRK `syrk_ema_tc` on the kernel devices (the emulator, and CUDA when a GPU
//! is present) and match the CPU backend; the two ways of asking for bf16 agree bit for bit;
//! and a network still trains with bf16 statistics.

use grng::hooks::{record_launches, take_launches};
use grng::ops::newton::Precision;
use grng::optim::kron::{InverseMethod, KronConfig, KronOptimizer};
use grng::optim::KronStats;
use grng::{Device, Matrix};
use grng_train::data::synthetic_classification;
use grng_train::mlp::{Activation, Loss, Mlp, MlpConfig, Targets};
use grng_train::train::{Batch, Method, MethodConfig, OptimizerConfig, Trainer};
use half::bf16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::sync::{Mutex, PoisonError};

use common::{devices, U32};
use grng_testkit as common;

/// The launch record is process-wide: the tests of this file take turns, so the record of
/// one holds its own launches only.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One layer's `(A m x d_in, E m x d_out, G d_out x d_in)`, row-major.
type LayerData = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Statistics and gradients of a 2-layer problem with ragged sizes around the 128-wide
/// tiles of the tensor-core SYRK; the statistics already rounded to bf16 values (so f32 and
/// bf16 statistics hold the same numbers).
struct Problem {
    shapes: Vec<(usize, usize)>,
    /// Per call, per layer.
    calls: Vec<Vec<LayerData>>,
    m: usize,
}

fn problem(rng: &mut ChaCha8Rng, calls: usize) -> Problem {
    let shapes = vec![
        (rng.random_range(2..=9), rng.random_range(120..=140)),
        (rng.random_range(1..=5), rng.random_range(2..=20)),
    ];
    let m = rng.random_range(3..=40);
    let r = |rng: &mut ChaCha8Rng, n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_f32())
            .collect()
    };
    let calls = (0..calls)
        .map(|_| {
            shapes
                .iter()
                .map(|&(o, i)| (r(rng, m * i), r(rng, m * o), r(rng, o * i)))
                .collect()
        })
        .collect();
    Problem { shapes, calls, m }
}

/// How the statistics are handed over.
#[derive(Clone, Copy, Debug)]
enum Feed {
    /// `Matrix<bf16>`.
    Bf16,
    /// `Matrix<f32>` with `stats_precision = Bf16`.
    RoundedF32,
}

/// RENG (damping `√ρ` on both factors, no spectral norm in the step) with the exact Cholesky
/// inverse on every device, so the devices differ only in the summation orders of the SYRK
/// and the preconditioning GEMMs; `ema` blends the second call's factor with the first.
fn config(feed: Feed, ema: f32) -> KronConfig {
    KronConfig {
        rho: 0.1,
        ema,
        skip: 1,
        inverse: InverseMethod::Cholesky,
        stats_precision: match feed {
            Feed::Bf16 => Precision::F32,
            Feed::RoundedF32 => Precision::Bf16,
        },
        ..KronConfig::reng()
    }
}

/// The preconditioned gradients of every call, on `dev`.
fn precondition_all(dev: &Device, p: &Problem, feed: Feed, ema: f32) -> Vec<Vec<Vec<f32>>> {
    let mut opt = KronOptimizer::new(dev, &p.shapes, config(feed, ema)).unwrap();
    let m = p.m;
    p.calls
        .iter()
        .map(|layers| {
            let f32s: Vec<(Matrix, Matrix, Matrix)> = layers
                .iter()
                .zip(&p.shapes)
                .map(|((a, e, g), &(o, i))| {
                    (
                        dev.upload(m, i, a).unwrap(),
                        dev.upload(m, o, e).unwrap(),
                        dev.upload(o, i, g).unwrap(),
                    )
                })
                .collect();
            let half = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
            let bf16s: Vec<(Matrix<bf16>, Matrix<bf16>)> = layers
                .iter()
                .zip(&p.shapes)
                .map(|((a, e, _), &(o, i))| {
                    (
                        dev.upload(m, i, &half(a)).unwrap(),
                        dev.upload(m, o, &half(e)).unwrap(),
                    )
                })
                .collect();
            let stats: Vec<KronStats<'_>> = match feed {
                Feed::Bf16 => bf16s.iter().map(|(a, e)| KronStats { a, e }).collect(),
                Feed::RoundedF32 => f32s.iter().map(|(a, e, _)| KronStats { a, e }).collect(),
            };
            let grads: Vec<&Matrix> = f32s.iter().map(|t| &t.2).collect();
            opt.precondition(&grads, Some(&stats))
                .unwrap()
                .iter()
                .map(|p| p.to_vec().unwrap())
                .collect()
        })
        .collect()
}

/// `‖ |X|ᵀ|X| / m ‖_F` of the `m x n` statistics `x`, in f64.
fn abs_gram_frob(x: &[f32], m: usize, n: usize) -> f64 {
    let mut s = 0.0f64;
    for i in 0..n {
        for j in 0..n {
            let v: f64 = (0..m)
                .map(|r| (x[r * n + i] as f64 * x[r * n + j] as f64).abs())
                .sum();
            s += (v / m as f64).powi(2);
        }
    }
    s.sqrt()
}

fn frob(x: &[f32]) -> f64 {
    x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt()
}

/// The emulated (and CUDA) preconditioned gradients match the CPU backend's, for both ways
/// of feeding bf16 statistics, over a replacing and an EMA-blending refresh; the kernel
/// devices ran the tensor-core SYRK (and the rounding kernel for f32 statistics).
///
/// Tolerance, per layer and call, from the perturbation of `P = Γ̃⁻¹ G Λ̃⁻¹` with
/// `‖Λ̃⁻¹‖₂ ≤ 1/λ`, `λ = √ρ` on both factors:
/// - factors: both sides sum the same `m` exact products (bf16 × bf16 is exact in f32) in
///   different orders, each within `(m+4)·u·‖|A|ᵀ|A|/m‖` of the exact value (emu_kron's
///   bound), so `‖δΛ‖_F ≤ δ_Λ = 2(m+4)u·‖|A|ᵀ|A|/m‖_F`; after the EMA call
///   `δ_Λ ← ε·δ_Λ,old + δ_Λ,new + 2u‖Λ‖_F` (the blend's own rounding on both sides);
/// - inverses: `‖δ(Λ̃⁻¹)‖ ≤ δ_Λ/λ²` from the factors plus the f64 Cholesky's rounding to
///   f32 on each side, `2u/λ`;
/// - the two preconditioning GEMMs: `≤ 4(d+4)u·√(d_out·d_in)·‖G‖_F/λ²` (each product's
///   rounding relative to `|X||G||Y|`, `‖|X|‖₂ ≤ √d‖X‖₂`), `d = max(d_in, d_out)`.
///
/// So `‖δP‖_F ≤ ‖G‖_F/λ²·(δ_Λ/λ + δ_Γ/λ + 4u + 4(d+4)u√(d_out d_in))`, doubled for margin.
#[test]
fn optimizer_with_bf16_stats_matches_cpu() {
    let _serial = serial();
    let mut rng = common::seeded_rng();
    let u = U32;
    for case in 0..3 {
        let p = problem(&mut rng, 2);
        let ema = 0.5f32;
        let lambda = 0.1f64.sqrt();
        for feed in [Feed::Bf16, Feed::RoundedF32] {
            let want = precondition_all(&Device::Cpu, &p, feed, ema);
            for dev in devices() {
                record_launches(true);
                let got = precondition_all(&dev, &p, feed, ema);
                let launched = take_launches();
                record_launches(false);
                let count = |k: &str| launched.iter().filter(|&&l| l == k).count();
                // One SYRK per factor and call (its sm_90a twin on a compute capability 9.0
                // GPU); the rounding kernel for f32 statistics only.
                let factors = 2 * p.shapes.len() * p.calls.len();
                assert_eq!(
                    count("syrk_ema_tc") + count("syrk_ema_wg_tc"),
                    factors,
                    "{feed:?}: {launched:?}"
                );
                assert_eq!(count("syrk_ema_f32"), 0, "{feed:?}");
                let rounds = match feed {
                    Feed::Bf16 => 0,
                    Feed::RoundedF32 => factors,
                };
                assert_eq!(count("syrk_round_bf16"), rounds, "{feed:?}");
                for (l, &(o, i)) in p.shapes.iter().enumerate() {
                    let (mut d_l, mut d_g) = (0.0f64, 0.0f64);
                    for (k, layers) in p.calls.iter().enumerate() {
                        let (a, e, g) = &layers[l];
                        let (fl, fg) = (abs_gram_frob(a, p.m, i), abs_gram_frob(e, p.m, o));
                        let new = |f: f64| 2.0 * (p.m as f64 + 4.0) * u * f;
                        (d_l, d_g) = if k == 0 {
                            (new(fl), new(fg))
                        } else {
                            let e = ema as f64;
                            (
                                e * d_l + new(fl) + 2.0 * u * fl,
                                e * d_g + new(fg) + 2.0 * u * fg,
                            )
                        };
                        let d = o.max(i) as f64;
                        let tol = 2.0 * frob(g) / (lambda * lambda)
                            * (d_l / lambda
                                + d_g / lambda
                                + 4.0 * u
                                + 4.0 * (d + 4.0) * u * ((o * i) as f64).sqrt());
                        let diff: f64 = got[k][l]
                            .iter()
                            .zip(&want[k][l])
                            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
                            .sum::<f64>()
                            .sqrt();
                        assert!(
                            diff <= tol,
                            "case {case} {feed:?} on {}: call {k} layer {l} ({o}x{i}, m {}): \
                             ‖δP‖ {diff:e} > {tol:e}",
                            dev.name(),
                            p.m
                        );
                    }
                }
            }
        }
    }
}

/// Rounding `f32` statistics through `stats_precision = Bf16` is exactly passing their bf16
/// values: the same preconditioned gradients, bit for bit, on the CPU and the emulator.
#[test]
fn rounded_f32_stats_equal_bf16_stats() {
    let _serial = serial();
    let mut rng = common::seeded_rng();
    let mut p = problem(&mut rng, 2);
    // Statistics with bits below bf16's precision, which the rounding must drop.
    for layers in &mut p.calls {
        for (a, e, _) in layers {
            for x in a.iter_mut().chain(e.iter_mut()) {
                *x *= 1.0 + rng.random_range(-1e-3f32..1e-3);
            }
        }
    }
    for dev in [Device::Cpu, Device::Emulated] {
        let direct = precondition_all(&dev, &rounded(&p), Feed::Bf16, 0.5);
        let via_config = precondition_all(&dev, &p, Feed::RoundedF32, 0.5);
        assert_eq!(direct, via_config, "{}", dev.name());
    }
}

/// `p` with its statistics rounded to bf16 values (what [`Feed::Bf16`] uploads anyway; the
/// f32 copies must hold the same numbers for the f32 gradient to be unchanged).
fn rounded(p: &Problem) -> Problem {
    let r = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect() };
    Problem {
        shapes: p.shapes.clone(),
        calls: p
            .calls
            .iter()
            .map(|ls| ls.iter().map(|(a, e, g)| (r(a), r(e), g.clone())).collect())
            .collect(),
        m: p.m,
    }
}

/// Full-data loss after `steps` trainer steps of RING (its tuned settings) with the given
/// statistics precision, and the loss before.
fn train(dev: &Device, precision: Precision, steps: usize) -> (f32, f32) {
    let data = synthetic_classification(96, 6, 4, 7).expect("data");
    let mlp = Mlp::new(
        MlpConfig {
            sizes: vec![6, 12, 4],
            activation: Activation::Tanh,
            loss: Loss::SoftmaxCrossEntropy,
        },
        3,
    )
    .expect("network");
    let mut config = MethodConfig::tuned(Method::Ring);
    let OptimizerConfig::Kron(k) = &mut config.optimizer else {
        panic!("RING has a Kron config");
    };
    k.stats_precision = precision;
    let (x_all, y_all) = data.gather(&(0..96).collect::<Vec<_>>()).expect("gather");
    let full = |mlp: &Mlp| {
        mlp.evaluate(x_all.as_ref(), Targets::Classes(&y_all))
            .unwrap()
    };
    let l0 = full(&mlp);
    let mut trainer = Trainer::new(dev, mlp, config, 11).expect("trainer");
    let batches =
        (0..).flat_map(|epoch| data.batches(5, epoch, config.batch_size).expect("batches"));
    for idx in batches.filter(|b| b.len() == config.batch_size).take(steps) {
        let (x, labels) = data.gather(&idx).expect("gather");
        trainer
            .step(Batch {
                x: x.as_ref(),
                targets: Targets::Classes(&labels),
            })
            .unwrap_or_else(|e| panic!("{precision:?} on {}: {e}", dev.name()));
    }
    (l0, full(trainer.mlp()))
}

/// bf16 statistics still train: RING with `stats_precision = Bf16` lowers the full-data loss
/// as the f32 run does, on the CPU and on the emulated tensor-core SYRK. Rounding perturbs
/// each statistic by at most `2⁻⁹` relative, so each factor by at most `2·2⁻⁹` of
/// `|A|ᵀ|A|/m` — 0.4 % — which moves the damped inverse and the step direction by about as
/// much: the descent survives. Thresholds: both runs end below `0.1·l₀` (measured: `0.004·l₀`
/// for either), and within `0.01·l₀` of each other (measured: `5e-6·l₀`), so a bf16 path that
/// trains worse than f32 (a wrong factor is a wrong preconditioner) fails.
#[test]
fn bf16_stats_still_train() {
    let _serial = serial();
    const STEPS: usize = 30;
    for dev in [Device::Cpu, Device::Emulated] {
        let (l0, l_f32) = train(&dev, Precision::F32, STEPS);
        let (_, l_bf16) = train(&dev, Precision::Bf16, STEPS);
        eprintln!(
            "{}: loss {l0} -> f32 stats {l_f32}, bf16 stats {l_bf16}",
            dev.name()
        );
        assert!(l_f32 < 0.1 * l0, "{}: f32 {l0} -> {l_f32}", dev.name());
        assert!(l_bf16 < 0.1 * l0, "{}: bf16 {l0} -> {l_bf16}", dev.name());
        assert!(
            (l_bf16 - l_f32).abs() < 0.01 * l0,
            "{}: bf16 {l_bf16} vs f32 {l_f32}",
            dev.name()
        );
    }
}

/// The CPU backend accumulates bf16 statistics a panel of 256 rows at a time (no widened copy
/// of the whole matrix): with m = 600 (three panels, the last one ragged) and ε > 0 it
/// matches the one-shot f32 SYRK of the widened values. Both sum the same m exact products
/// (bf16 products are exact in f32) in f32 in different orders, each within
/// `(m + 4)·u·(α·Σ|a a| + ε|Λ|)` of the exact value (emu_kron's bound), so they differ by at
/// most twice that.
#[test]
fn cpu_bf16_factor_is_accumulated_by_panels() {
    let mut rng = common::seeded_rng();
    let (m, n, eps) = (600usize, rng.random_range(1..=40), 0.5f32);
    let a: Vec<bf16> = (0..m * n)
        .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect();
    let wide: Vec<f32> = a.iter().map(|v| v.to_f32()).collect();
    let old = common::vals(&mut rng, n * n);
    let run = |x: &dyn Fn(&mut [f32])| {
        let mut f = old.clone();
        x(&mut f);
        f
    };
    let got = run(&|f| {
        let a = grng::MatRef::new(&a, m, n).unwrap();
        grng::cpu::syrk_ema(a, eps, grng::MatMut::new(f, n, n).unwrap()).unwrap()
    });
    let want = run(&|f| {
        let a = grng::MatRef::new(&wide, m, n).unwrap();
        grng::cpu::syrk_ema(a, eps, grng::MatMut::new(f, n, n).unwrap()).unwrap()
    });
    let alpha = (1.0 - eps as f64) / m as f64;
    for i in 0..n {
        for j in 0..n {
            let (r, c) = (i.max(j), i.min(j));
            let s: f64 = (0..m)
                .map(|k| (wide[k * n + r] as f64 * wide[k * n + c] as f64).abs())
                .sum();
            let tol = 2.0
                * (m as f64 + 4.0)
                * U32
                * (alpha * s + eps as f64 * old[r * n + c].abs() as f64);
            let d = (got[i * n + j] as f64 - want[i * n + j] as f64).abs();
            assert!(d <= tol, "({i}, {j}): {d:e} > {tol:e}");
        }
    }
}

/// NaN or Inf in bf16 statistics, or in f32 statistics rounded by `stats_precision = Bf16`
/// (the rounding keeps them), is `Error::NonFinite` and leaves the optimizer exactly as it
/// was (every state matrix and scalar), on the CPU and the emulator.
#[test]
fn bad_bf16_stats_are_errors_and_change_nothing() {
    let _serial = serial();
    let mut rng = common::seeded_rng();
    let p = problem(&mut rng, 2);
    let m = p.m;
    for dev in [Device::Cpu, Device::Emulated] {
        for feed in [Feed::Bf16, Feed::RoundedF32] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut opt = KronOptimizer::new(&dev, &p.shapes, config(feed, 0.5)).unwrap();
                let up = |v: &[f32], r: usize, c: usize| dev.upload(r, c, v).unwrap();
                let up_bf = |v: &[f32], r: usize, c: usize| -> Matrix<bf16> {
                    let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
                    dev.upload(r, c, &h).unwrap()
                };
                // A good first refresh, so there is state to keep.
                let layers = &p.calls[0];
                let f32s: Vec<(Matrix, Matrix, Matrix)> = layers
                    .iter()
                    .zip(&p.shapes)
                    .map(|((a, e, g), &(o, i))| (up(a, m, i), up(e, m, o), up(g, o, i)))
                    .collect();
                let bf16s: Vec<(Matrix<bf16>, Matrix<bf16>)> = layers
                    .iter()
                    .zip(&p.shapes)
                    .map(|((a, e, _), &(o, i))| (up_bf(a, m, i), up_bf(e, m, o)))
                    .collect();
                let grads: Vec<&Matrix> = f32s.iter().map(|t| &t.2).collect();
                let stats: Vec<KronStats<'_>> = match feed {
                    Feed::Bf16 => bf16s.iter().map(|(a, e)| KronStats { a, e }).collect(),
                    Feed::RoundedF32 => f32s.iter().map(|(a, e, _)| KronStats { a, e }).collect(),
                };
                opt.precondition(&grads, Some(&stats)).unwrap();
                let before = opt.state().unwrap();
                // The second call's statistics with one bad entry in a random layer's A or E.
                let l = rng.random_range(0..p.shapes.len());
                let (o, i) = p.shapes[l];
                let in_a = rng.random::<bool>();
                let (mut a, mut e, _) = p.calls[1][l].clone();
                let target = if in_a { &mut a } else { &mut e };
                let k = rng.random_range(0..target.len());
                target[k] = bad;
                let (a32, e32, a16, e16) =
                    (up(&a, m, i), up(&e, m, o), up_bf(&a, m, i), up_bf(&e, m, o));
                let mut stats2 = stats.clone();
                stats2[l] = match feed {
                    Feed::Bf16 => KronStats { a: &a16, e: &e16 },
                    Feed::RoundedF32 => KronStats { a: &a32, e: &e32 },
                };
                let err = opt.precondition(&grads, Some(&stats2)).unwrap_err();
                assert!(
                    matches!(err, grng::Error::NonFinite { .. }),
                    "{feed:?} {bad} on {}: {err}",
                    dev.name()
                );
                let after = opt.state().unwrap();
                assert_eq!(after.steps, before.steps);
                assert_eq!(after.counters, before.counters);
                assert_eq!(after.scalars(), before.scalars());
                for ((n1, m1), (n2, m2)) in after.matrices().iter().zip(before.matrices()) {
                    assert_eq!(n1, &n2);
                    let bits = |m: &Matrix| -> Vec<u32> {
                        m.to_vec().unwrap().iter().map(|x| x.to_bits()).collect()
                    };
                    assert_eq!(
                        bits(m1),
                        bits(m2),
                        "{n1} changed ({feed:?}, {})",
                        dev.name()
                    );
                }
            }
        }
    }
}
