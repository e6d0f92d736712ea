//! The trainer glue end to end: every method lowers the loss on a small synthetic task, runs
//! repeat bit for bit from a seed, bad input is a typed error that changes nothing, and the
//! main job's command line is consistent.

use grng_testkit as common;

use clap::CommandFactory;
use proptest::prelude::*;

use grng::{Device, Error};
use grng_train::cli::Cli;
use grng_train::data::{synthetic_classification, Dataset};
use grng_train::mlp::{Activation, FisherMode, Loss, Mlp, MlpConfig, Targets};
use grng_train::report;
use grng_train::train::{
    train_method, Batch, Method, MethodConfig, OptimizerConfig, RunConfig, Splits, Trainer,
};

fn network(d: usize, classes: usize, seed: u64) -> Mlp {
    Mlp::new(
        MlpConfig {
            sizes: vec![d, 16, classes],
            activation: Activation::Tanh,
            loss: Loss::SoftmaxCrossEntropy,
        },
        seed,
    )
    .expect("valid shape")
}

fn full_loss(mlp: &Mlp, data: &Dataset) -> f32 {
    mlp.evaluate(data.x.as_ref(), Targets::Classes(&data.labels))
        .expect("evaluation")
}

/// Trains `method` for `steps` steps on `data` (one epoch after another), returning the
/// per-step batch losses and the trainer.
fn train(method: Method, data: &Dataset, steps: usize, seed: u64) -> (Vec<f32>, Trainer) {
    let mut config = MethodConfig::tuned(method);
    if let OptimizerConfig::AdamW(c) = &mut config.optimizer {
        // The digits warm-up (100 steps) is longer than these runs.
        c.warmup_steps = 10;
    }
    train_with(method, config, data, steps, seed)
}

/// [`train`] under `config`. Every report must have a finite loss and gradient norm, and a
/// loss after the step exactly on the Kronecker steps that form the Levenberg–Marquardt model
/// (every `KronConfig::damping_interval`-th).
fn train_with(
    method: Method,
    config: MethodConfig,
    data: &Dataset,
    steps: usize,
    seed: u64,
) -> (Vec<f32>, Trainer) {
    let interval = match config.optimizer {
        OptimizerConfig::Kron(k) => k.damping_interval,
        _ => 1,
    };
    let mlp = network(data.dim(), data.classes, seed);
    let mut trainer = Trainer::new(&Device::Cpu, mlp, config, seed).expect("trainer");
    let mut losses = Vec::with_capacity(steps);
    let mut epoch = 0;
    while losses.len() < steps {
        for idx in data
            .batches(seed, epoch, config.batch_size)
            .expect("batches")
        {
            if losses.len() == steps {
                break;
            }
            if idx.len() != config.batch_size && method.is_kalman() {
                continue;
            }
            let (x, labels) = data.gather(&idx).expect("gather");
            // The plain-gradient methods report `‖g‖₂` of the batch gradient bit for bit (SGD
            // and AdamW take it from their update's pass over the gradient).
            let plain = matches!(method, Method::Sgd | Method::AdamW | Method::Sophia);
            let want = plain.then(|| {
                let mlp = trainer.mlp();
                let fwd = mlp.forward(x.as_ref()).expect("forward");
                let (g, _) = mlp
                    .gradient(&fwd, Targets::Classes(&labels))
                    .expect("gradient");
                grng::cpu::elementwise::norm2(&g).expect("norm")
            });
            let r = trainer
                .step(Batch {
                    x: x.as_ref(),
                    targets: Targets::Classes(&labels),
                })
                .unwrap_or_else(|e| panic!("{method}: step {} failed: {e}", losses.len()));
            assert!(r.loss.is_finite() && r.grad_norm.is_finite() && r.grad_norm >= 0.0);
            if let Some(want) = want {
                assert_eq!(r.grad_norm.to_bits(), want.to_bits(), "{method}: grad_norm");
            }
            let k = losses.len();
            assert_eq!(
                r.loss_after.is_some(),
                method.is_kronecker() && k % interval == 0,
                "{method}: step {k}"
            );
            losses.push(r.loss);
        }
        epoch += 1;
    }
    (losses, trainer)
}

/// Steps per method: a few dozen mini-batches; the Kalman methods see one sample per step, so
/// they get about one pass over the data instead.
fn steps_for(method: Method) -> usize {
    if method.is_kalman() {
        96
    } else {
        40
    }
}

proptest! {
    #![proptest_config(common::proptest_config(4))]

    /// With a Levenberg–Marquardt interval `T`, a Kronecker trainer evaluates the loss after
    /// the steps that form the model only, observes each of them, and still trains.
    #[test]
    fn damping_interval_evaluates_the_loss_after_every_t_steps(
        seed in 0u64..1_000_000, d in 4usize..9, t in 2usize..5,
    ) {
        let data = synthetic_classification(96, d, 3, seed).expect("data");
        for method in [Method::Ring, Method::Reng, Method::Ngd] {
            let mut config = MethodConfig::tuned(method);
            if let OptimizerConfig::Kron(k) = &mut config.optimizer {
                k.damping_interval = t;
            }
            let before = full_loss(&network(d, 3, seed), &data);
            let (_, trainer) = train_with(method, config, &data, steps_for(method), seed);
            prop_assert_eq!(trainer.counters().skipped_nonfinite, 0, "{}", method);
            let after = full_loss(trainer.mlp(), &data);
            prop_assert!(after < 0.9 * before, "{method}: full-data loss {before} -> {after}");
        }
    }
}

proptest! {
    // Each case trains all eight methods on a tiny network (milliseconds each).
    #![proptest_config(common::proptest_config(4))]

    #[test]
    fn every_method_lowers_the_training_loss(seed in 0u64..1_000_000, d in 4usize..9) {
        let data = synthetic_classification(96, d, 3, seed).expect("data");
        for method in Method::ALL {
            let before = full_loss(&network(d, 3, seed), &data);
            let (_, trainer) = train(method, &data, steps_for(method), seed);
            let after = full_loss(trainer.mlp(), &data);
            // Well-separated blobs: every method should cut the loss by at least 10%
            // (initial loss ≈ ln 3 ≈ 1.1); a no-op or diverging optimizer cannot.
            prop_assert!(
                after < 0.9 * before,
                "{method}: full-data loss {before} -> {after}"
            );
        }
    }

    #[test]
    fn same_seed_gives_identical_loss_curves(seed in 0u64..1_000_000) {
        let data = synthetic_classification(64, 6, 4, seed).expect("data");
        for method in Method::ALL {
            let (a, ta) = train(method, &data, 24, seed);
            let (b, tb) = train(method, &data, 24, seed);
            // Bitwise: same seed, same batches, same sampled labels, same arithmetic.
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&a), bits(&b), "{} loss curves differ", method);
            prop_assert_eq!(bits(ta.mlp().params()), bits(tb.mlp().params()));
        }
    }
}

#[test]
fn bad_batches_are_typed_errors_and_change_nothing() {
    let data = synthetic_classification(40, 5, 3, 1).expect("data");
    for method in Method::ALL {
        let config = MethodConfig::tuned(method);
        let mut trainer = Trainer::new(&Device::Cpu, network(5, 3, 1), config, 1).expect("trainer");
        let params = trainer.mlp().params().to_vec();
        let m = config.batch_size;
        let (x, labels) = data.gather(&(0..m).collect::<Vec<_>>()).expect("gather");
        // Wrong input width.
        let (wide, _) = synthetic_classification(m, 6, 3, 2)
            .expect("data")
            .gather(&(0..m).collect::<Vec<_>>())
            .expect("gather");
        let e = trainer.step(Batch {
            x: wide.as_ref(),
            targets: Targets::Classes(&labels),
        });
        assert!(matches!(e, Err(Error::Shape { .. })), "{method}: {e:?}");
        // A label out of range.
        let mut bad = labels.clone();
        bad[0] = 3;
        let e = trainer.step(Batch {
            x: x.as_ref(),
            targets: Targets::Classes(&bad),
        });
        assert!(
            matches!(e, Err(Error::Value { .. } | Error::Shape { .. })),
            "{method}: {e:?}"
        );
        assert_eq!(trainer.steps(), 0);
        assert_eq!(
            trainer.mlp().params(),
            &params[..],
            "{method} changed on error"
        );
        // The good batch still trains afterwards.
        trainer
            .step(Batch {
                x: x.as_ref(),
                targets: Targets::Classes(&labels),
            })
            .expect("good step");
        assert_eq!(trainer.steps(), 1);
    }
    // A Kalman filter's observation size is fixed: a batch of two is rejected.
    let mut kalman = Trainer::new(
        &Device::Cpu,
        network(5, 3, 1),
        MethodConfig::tuned(Method::RKalman),
        1,
    )
    .expect("trainer");
    let (x2, l2) = data.gather(&[0, 1]).expect("gather");
    let e = kalman.step(Batch {
        x: x2.as_ref(),
        targets: Targets::Classes(&l2),
    });
    assert!(matches!(e, Err(Error::Shape { .. })), "{e:?}");
    // A config whose optimizer does not belong to its method.
    let mut mixed = MethodConfig::tuned(Method::Ring);
    mixed.optimizer = MethodConfig::tuned(Method::Sgd).optimizer;
    assert!(matches!(mixed.optimizer, OptimizerConfig::Sgd(_)));
    let e = Trainer::new(&Device::Cpu, network(5, 3, 1), mixed, 1);
    assert!(matches!(e, Err(Error::Value { .. })));
}

#[test]
fn train_method_reports_curves_and_the_target_clock() {
    let data = synthetic_classification(150, 6, 3, 5).expect("data");
    let (train, val, test) = data.split(5, (0.6, 0.2)).expect("split");
    let splits = Splits { train, val, test };
    let run = RunConfig {
        epochs: 3,
        hidden: vec![12],
        target_acc: 0.9,
        eval_points: 10,
        ..RunConfig::default()
    };
    let mut calls = 0u64;
    let r = train_method(
        &Device::Cpu,
        &splits,
        &run,
        MethodConfig::tuned(Method::Sgd),
        &mut |done, total| {
            calls += 1;
            assert!(done <= total);
        },
    )
    .expect("run");
    assert!(r.failure.is_none());
    assert_eq!(r.steps, run.total_steps(&r.config, splits.train.len()));
    assert_eq!(calls, r.steps);
    assert_eq!(r.curve.first().map(|p| p.step), Some(0));
    assert_eq!(r.curve.last().map(|p| p.step), Some(r.steps));
    assert!(r.curve.windows(2).all(|w| w[0].step < w[1].step));
    assert!(r.test_acc >= 0.9, "test accuracy {}", r.test_acc);
    let hit = r.steps_to_target.expect("reaches 90% on separated blobs");
    assert!(r.curve.iter().any(|p| p.step == hit && p.val_acc >= 0.9));
    // The report renders it.
    let table = report::summary_table(std::slice::from_ref(&r), run.target_acc);
    assert!(table.contains("SGD") && table.contains("steps to 90%"));
    let svg = report::figure(std::slice::from_ref(&r));
    assert_eq!(svg.matches("<polyline").count(), 2);
    let csv = report::curves_csv(std::slice::from_ref(&r));
    assert_eq!(csv.lines().count(), 1 + r.curve.len());
}

#[test]
fn help_parses() {
    Cli::command().debug_assert();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_grng"))
        .arg("--help")
        .output()
        .expect("run the binary");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--optimizers",
        "--epochs",
        "--batch-size",
        "--seed",
        "--out",
        "--target-acc",
        "--device",
        "--hidden",
        "--sweep",
    ] {
        assert!(help.contains(flag), "--help does not mention {flag}");
    }
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_grng"))
        .args(["--optimizers", "ring,nope"])
        .output()
        .expect("run the binary");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("nope"));
}

/// An output folder that cannot be created fails the main job before any training (nothing
/// printed on stdout: not even the data line), and the error names the folder. The folder's
/// parent is a regular file, so `create_dir_all` fails (ENOTDIR) even as root.
#[test]
fn unwritable_out_fails_before_training_naming_the_path() {
    let dir = std::env::temp_dir().join(format!("grng-out-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("a-file");
    std::fs::write(&file, b"not a folder").expect("write the blocking file");
    let out_dir = file.join("out");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_grng"))
        .args(["--optimizers", "ring", "--device", "cpu", "--out"])
        .arg(&out_dir)
        .output()
        .expect("run the binary");
    std::fs::remove_dir_all(&dir).ok();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "the run must fail: {stderr}");
    assert!(
        stderr.contains(&*out_dir.to_string_lossy()),
        "the error must name {out_dir:?}: {stderr}"
    );
    assert!(
        run.stdout.is_empty(),
        "nothing may run before the check: {}",
        String::from_utf8_lossy(&run.stdout)
    );
}

/// The three Fisher-statistics modes (sampled, exact, empirical; `--fisher`) all drive the
/// Kronecker methods down on the synthetic task.
#[test]
fn every_fisher_mode_trains_the_kronecker_methods() {
    let data = synthetic_classification(96, 6, 3, 21).expect("data");
    let run = RunConfig::default();
    for fisher in [
        FisherMode::Sampled,
        FisherMode::Exact,
        FisherMode::Empirical,
    ] {
        for method in [Method::Ring, Method::Reng, Method::Ngd] {
            let config = RunConfig {
                fisher: Some(fisher),
                ..run.clone()
            }
            .apply(MethodConfig::tuned(method));
            assert_eq!(config.fisher, fisher);
            let mut trainer =
                Trainer::new(&Device::Cpu, network(6, 3, 21), config, 21).expect("trainer");
            let before = full_loss(trainer.mlp(), &data);
            for epoch in 0..3 {
                for idx in data.batches(21, epoch, config.batch_size).expect("batches") {
                    let (x, labels) = data.gather(&idx).expect("gather");
                    trainer
                        .step(Batch {
                            x: x.as_ref(),
                            targets: Targets::Classes(&labels),
                        })
                        .unwrap_or_else(|e| panic!("{method} {fisher:?}: {e}"));
                }
            }
            let after = full_loss(trainer.mlp(), &data);
            assert!(
                after < 0.9 * before,
                "{method} {fisher:?}: {before} -> {after}"
            );
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(4))]

    /// RING's and NGD's loss after each step (from the kept `z_0` plus the step's own
    /// `ΔZ = −η·(AVᵀ/m)·Uᵀ`, `Mlp::evaluate_from_first`) is the plain evaluation at the new
    /// parameters up to rounding: layer 0 of 48–80 inputs and 40–64 hidden units at batch 8
    /// takes the factored route, which gives the change. The two differ by the f32 roundings
    /// of `ΔZ` and of layer 0's product (`≲ (d_0 + 2m)·2⁻²⁴` relative to `|A||W̄|` per entry,
    /// amplified by the inverses' conditioning), far inside `10⁻⁴·max(1, loss)`.
    #[test]
    fn loss_after_the_step_is_the_evaluation_at_the_new_parameters(
        seed in 0u64..1_000_000, d in 48usize..=80, hidden in 40usize..=64,
    ) {
        let data = synthetic_classification(64, d, 3, seed).expect("data");
        for method in [Method::Ring, Method::Ngd] {
            let mut config = MethodConfig::tuned(method);
            config.batch_size = 8;
            let mlp = Mlp::new(
                MlpConfig {
                    sizes: vec![d, hidden, 3],
                    activation: Activation::Tanh,
                    loss: Loss::SoftmaxCrossEntropy,
                },
                seed,
            )
            .expect("valid shape");
            let mut trainer = Trainer::new(&Device::Cpu, mlp, config, seed).expect("trainer");
            let mut checked = 0;
            for idx in data.batches(seed, 0, 8).expect("batches") {
                let (x, labels) = data.gather(&idx).expect("gather");
                let targets = Targets::Classes(&labels);
                let r = trainer.step(Batch { x: x.as_ref(), targets }).expect("step");
                let Some(after) = r.loss_after.filter(|a| a.is_finite()) else {
                    continue;
                };
                let want = trainer.mlp().evaluate(x.as_ref(), targets).expect("evaluate");
                prop_assert!(
                    (after - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{method}: loss after {after} vs evaluation {want}"
                );
                checked += 1;
            }
            prop_assert!(checked > 0, "{method}: no step evaluated the loss after it");
        }
    }
}
