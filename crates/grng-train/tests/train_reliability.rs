//! Issue 5 at the trainer level: the resume contract through `train_method` and the file on
//! disk (N steps straight == k steps, checkpoint, a fresh trainer resumes, N − k steps — bit
//! for bit on the CPU, every method), the [`Trainer`] checkpoint's validation, and non-finite
//! batches that skip the step, change nothing and are counted.
//!
//! No tolerance appears here: every comparison is bitwise (the CPU backend is deterministic
//! and a checkpoint stores every bit of the state).

use grng_testkit as common;

use std::path::{Path, PathBuf};

use clap::CommandFactory;
use proptest::prelude::*;

use grng::checkpoint::{Checkpoint, Reader, Value, Writer};
use grng::{Device, Error};
use grng_train::cli::Cli;
use grng_train::data::{synthetic_classification, Dataset};
use grng_train::mlp::{Activation, Loss, Mlp, MlpConfig, Targets};
use grng_train::train::{
    train_method, Batch, Checkpointing, CurvePoint, Method, MethodConfig, MethodResult,
    OptimizerConfig, RunConfig, Splits, Trainer,
};

/// A fresh directory under the system temp dir, unique per test and tag.
fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("grng-reliab-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// 60 train / 20 validation / 20 test samples of 5-dimensional, 3-class blobs.
fn splits() -> Splits {
    let data = synthetic_classification(100, 5, 3, 7).unwrap();
    let (train, val, test) = data.split(7, (0.6, 0.2)).unwrap();
    Splits { train, val, test }
}

/// Batch 8 (8 batches per epoch, the last of 4 samples; the Kalman methods keep batch 1, 60
/// steps per epoch), 3 epochs, a 5-8-3 network.
fn run_config(max_steps: u64, checkpoint: Option<Checkpointing>) -> RunConfig {
    RunConfig {
        epochs: 3,
        batch_size: Some(8),
        seed: 3,
        hidden: vec![8],
        activation: Activation::Tanh,
        fisher: None,
        target_acc: 0.9,
        eval_points: 7,
        max_steps: Some(max_steps),
        checkpoint,
        dist: None,
    }
}

fn ckpt(dir: &Path, every: Option<u64>, resume: bool) -> Option<Checkpointing> {
    Some(Checkpointing {
        dir: dir.to_path_buf(),
        every,
        resume,
    })
}

fn train(splits: &Splits, run: &RunConfig, method: Method) -> MethodResult {
    train_method(
        &Device::Cpu,
        splits,
        run,
        MethodConfig::tuned(method),
        &mut |_, _| {},
    )
    .unwrap_or_else(|e| panic!("{method}: {e}"))
}

fn point_bits(p: &CurvePoint) -> [u64; 5] {
    [
        p.step,
        p.epoch.to_bits(),
        p.val_acc.to_bits() as u64,
        p.train_loss.to_bits() as u64,
        p.grad_norm.to_bits() as u64,
    ]
}

/// N and k per method: k mid-epoch (and for RING/RENG on a lazy step, for Sophia between
/// Hessian refreshes), N in the next epoch.
fn n_k(method: Method) -> (u64, u64) {
    if method.is_kalman() {
        (75, 33)
    } else {
        (13, 5)
    }
}

#[test]
fn train_method_resume_equals_the_straight_run_bit_for_bit_for_every_method() {
    let splits = splits();
    for method in Method::ALL {
        let (n, k) = n_k(method);
        let dir = temp_dir(method.key());
        let (straight_dir, cut_dir) = (dir.join("straight"), dir.join("cut"));

        // Checkpointing itself changes nothing.
        let plain = train(&splits, &run_config(n, None), method);
        let straight = train(
            &splits,
            &run_config(n, ckpt(&straight_dir, None, false)),
            method,
        );
        assert_eq!(plain.test_acc.to_bits(), straight.test_acc.to_bits());
        assert_eq!(plain.curve.len(), straight.curve.len());

        // k steps, written at the end; a fresh train_method (fresh network, fresh trainer)
        // resumes from the file and goes on to N.
        let first = train(&splits, &run_config(k, ckpt(&cut_dir, None, false)), method);
        assert_eq!(first.steps, k, "{method}");
        let resumed = train(&splits, &run_config(n, ckpt(&cut_dir, None, true)), method);

        for r in [&straight, &first, &resumed] {
            assert!(r.failure.is_none(), "{method}: {:?}", r.failure);
        }
        assert_eq!(resumed.resumed_from, Some(k), "{method}");
        assert_eq!(straight.resumed_from, None);
        assert_eq!(resumed.steps, n, "{method}");
        assert_eq!(resumed.counters, straight.counters, "{method}");
        assert_eq!(
            resumed.test_acc.to_bits(),
            straight.test_acc.to_bits(),
            "{method}"
        );
        // The resumed curve starts at k and then has the straight run's points.
        assert_eq!(resumed.curve[0].step, k);
        for p in &resumed.curve {
            if let Some(q) = straight.curve.iter().find(|q| q.step == p.step) {
                assert_eq!(
                    point_bits(p),
                    point_bits(q),
                    "{method}: point at {}",
                    p.step
                );
            }
        }
        assert_eq!(
            point_bits(resumed.curve.last().unwrap()),
            point_bits(straight.curve.last().unwrap()),
            "{method}: final point"
        );
        // The final files: every bit of network, optimizer, random stream, counters and the
        // position in the batch schedule.
        let file = format!("{}.ckpt", method.key());
        let a = std::fs::read(straight_dir.join(&file)).unwrap();
        let b = std::fs::read(cut_dir.join(&file)).unwrap();
        assert!(a == b, "{method}: final checkpoint differs after resume");
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn periodic_checkpoints_are_written_every_n_steps() {
    let splits = splits();
    let dir = temp_dir("every");
    let run = run_config(11, ckpt(&dir, Some(4), false));
    let path = dir.join("sgd.ckpt");
    let mut seen = Vec::new();
    let r = train_method(
        &Device::Cpu,
        &splits,
        &run,
        MethodConfig::tuned(Method::Sgd),
        &mut |done, _| {
            // progress(s) runs before step s's own checkpoint: the file holds the last
            // multiple of 4 below s.
            let stored = Reader::open(&path)
                .ok()
                .map(|r| r.scope("run").u64("steps").unwrap());
            seen.push((done, stored));
        },
    )
    .unwrap();
    assert!(r.failure.is_none());
    for (done, stored) in seen {
        let want = (done - 1) / 4 * 4;
        assert_eq!(stored, (want > 0).then_some(want), "at step {done}");
    }
    // And at the end.
    let end = Reader::open(&path).unwrap();
    assert_eq!(end.scope("run").u64("steps").unwrap(), 11);
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn resume_rejects_a_checkpoint_of_another_run() {
    let splits = splits();
    let dir = temp_dir("mismatch");
    train(
        &splits,
        &run_config(5, ckpt(&dir, None, false)),
        Method::Ring,
    );
    let path = dir.join("ring.ckpt");
    let good = std::fs::read(&path).unwrap();
    let resume = |run: &RunConfig, config: MethodConfig| {
        train_method(&Device::Cpu, &splits, run, config, &mut |_, _| {})
    };
    let tuned = MethodConfig::tuned(Method::Ring);

    // Another seed: another batch schedule.
    let mut other_seed = run_config(9, ckpt(&dir, None, true));
    other_seed.seed = 4;
    let e = resume(&other_seed, tuned).unwrap_err();
    assert!(
        matches!(&e, Error::Checkpoint(m) if m.contains("seed")),
        "{e}"
    );
    // Another learning rate.
    let mut lr = tuned;
    if let OptimizerConfig::Kron(k) = &mut lr.optimizer {
        k.lr *= 2.0;
    }
    let e = resume(&run_config(9, ckpt(&dir, None, true)), lr).unwrap_err();
    assert!(
        matches!(&e, Error::Checkpoint(m) if m.contains("config")),
        "{e}"
    );
    // Another network.
    let mut wide = run_config(9, ckpt(&dir, None, true));
    wide.hidden = vec![9];
    let e = resume(&wide, tuned).unwrap_err();
    assert!(matches!(&e, Error::Checkpoint(_)), "{e}");
    // A flipped byte and a truncated file.
    let mut bad = good.clone();
    bad[good.len() / 2] ^= 0x10;
    std::fs::write(&path, &bad).unwrap();
    let e = resume(&run_config(9, ckpt(&dir, None, true)), tuned).unwrap_err();
    assert!(
        matches!(&e, Error::Checkpoint(m) if m.contains("checksum")),
        "{e}"
    );
    std::fs::write(&path, &good[..good.len() - 9]).unwrap();
    let e = resume(&run_config(9, ckpt(&dir, None, true)), tuned).unwrap_err();
    assert!(matches!(&e, Error::Checkpoint(_)), "{e}");
    // The intact file still resumes.
    std::fs::write(&path, &good).unwrap();
    let r = resume(&run_config(9, ckpt(&dir, None, true)), tuned).unwrap();
    assert_eq!((r.resumed_from, r.steps), (Some(5), 9));
    std::fs::remove_dir_all(dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// The Trainer's own checkpoint.

fn network(seed: u64) -> Mlp {
    Mlp::new(
        MlpConfig {
            sizes: vec![5, 8, 3],
            activation: Activation::Tanh,
            loss: Loss::SoftmaxCrossEntropy,
        },
        seed,
    )
    .unwrap()
}

fn trainer(method: Method, seed: u64) -> Trainer {
    let mut config = MethodConfig::tuned(method);
    if !method.is_kalman() {
        config.batch_size = 8;
    }
    Trainer::new(&Device::Cpu, network(seed), config, seed).unwrap()
}

/// The `i`-th batch of `data` for `t` (consecutive windows, wrapping).
fn batch_of(data: &Dataset, t: &Trainer, i: usize) -> (grng::Mat, Vec<usize>) {
    let b = t.config().batch_size;
    let idx: Vec<usize> = (0..b).map(|j| (i * b + j) % data.len()).collect();
    data.gather(&idx).unwrap()
}

fn step(t: &mut Trainer, x: &grng::Mat, labels: &[usize]) -> grng_train::train::StepReport {
    t.step(Batch {
        x: x.as_ref(),
        targets: Targets::Classes(labels),
    })
    .unwrap()
}

fn bytes(t: &Trainer) -> Vec<u8> {
    let mut w = Writer::new();
    t.save(&mut w).unwrap();
    w.to_bytes()
}

#[test]
fn trainer_checkpoint_rejects_wrong_method_and_inconsistent_kalman_state() {
    let data = synthetic_classification(40, 5, 3, 2).unwrap();
    let mut ring = trainer(Method::Ring, 1);
    let mut sgd = trainer(Method::Sgd, 1);
    for i in 0..3 {
        let (x, l) = batch_of(&data, &ring, i);
        step(&mut ring, &x, &l);
        step(&mut sgd, &x, &l);
    }
    let mut w = Writer::new();
    ring.save(&mut w).unwrap();
    let ring_file = w.to_reader().unwrap();
    let before = bytes(&sgd);
    let e = sgd.load(&ring_file).unwrap_err();
    assert!(
        matches!(&e, Error::Checkpoint(m) if m.contains("method")),
        "{e}"
    );
    assert!(bytes(&sgd) == before, "sgd changed on a failed load");
    // Same method, other hyperparameters.
    let mut config = MethodConfig::tuned(Method::Ring);
    config.batch_size = 8;
    if let OptimizerConfig::Kron(k) = &mut config.optimizer {
        k.rho *= 2.0;
    }
    let mut other = Trainer::new(&Device::Cpu, network(1), config, 1).unwrap();
    let before = bytes(&other);
    assert!(other.load(&ring_file).is_err());
    assert!(bytes(&other) == before);

    // A Kalman file whose network is not the filter's mean.
    let mut kalman = trainer(Method::RKalman, 1);
    for i in 0..3 {
        let (x, l) = batch_of(&data, &kalman, i);
        step(&mut kalman, &x, &l);
    }
    let mut w = Writer::new();
    kalman.save(&mut w).unwrap();
    let r = w.to_reader().unwrap();
    let mut forged = Writer::new();
    for name in r.names() {
        let mut v = r.get(name).unwrap().clone();
        if name == "mlp.params" {
            if let Value::F32 { data, .. } = &mut v {
                data[0] += 1.0;
            }
        }
        forged.put(name, v).unwrap();
    }
    let mut fresh = trainer(Method::RKalman, 5);
    let before = bytes(&fresh);
    let e = fresh.load(&forged.to_reader().unwrap()).unwrap_err();
    assert!(
        matches!(&e, Error::Checkpoint(m) if m.contains("optim.mu")),
        "{e}"
    );
    assert!(bytes(&fresh) == before);
    // The genuine file loads, and the loaded trainer continues like the original.
    fresh.load(&r).unwrap();
    assert!(bytes(&fresh) == bytes(&kalman));
    let (x, l) = batch_of(&data, &kalman, 3);
    let a = step(&mut kalman, &x, &l);
    let b = step(&mut fresh, &x, &l);
    assert_eq!(a.loss.to_bits(), b.loss.to_bits());
    assert!(bytes(&fresh) == bytes(&kalman));
}

// ---------------------------------------------------------------------------------------------
// Non-finite batches.

/// Every record of a trainer's checkpoint except the skip counter, for "nothing changed".
fn state_without_skip_counter(t: &Trainer) -> Vec<(String, Value)> {
    let mut w = Writer::new();
    t.save(&mut w).unwrap();
    let r = w.to_reader().unwrap();
    r.names()
        .filter(|n| *n != "counters.skipped_nonfinite")
        .map(|n| (n.to_string(), r.get(n).unwrap().clone()))
        .collect::<Vec<_>>()
}

fn same_state(a: &[(String, Value)], b: &[(String, Value)]) -> bool {
    // Bitwise: `Value`'s PartialEq would call NaN != NaN and 0.0 == -0.0.
    let f32_bits = |d: &[f32]| d.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let same = |x: &Value, y: &Value| match (x, y) {
        (Value::F32 { shape: s, data: d }, Value::F32 { shape: t, data: e }) => {
            s == t && f32_bits(d) == f32_bits(e)
        }
        (Value::F64(u), Value::F64(v)) => u.to_bits() == v.to_bits(),
        _ => x == y,
    };
    a.len() == b.len() && a.iter().zip(b).all(|((n, x), (m, y))| n == m && same(x, y))
}

proptest! {
    // Each case runs all eight methods for a handful of steps on a 5-8-3 network.
    #![proptest_config(common::proptest_config(12))]

    /// A NaN/±Inf anywhere in a batch skips the step: state unchanged (every checkpoint
    /// record but the counter), counted once, and the run then continues exactly like one
    /// that never saw the bad batch.
    #[test]
    fn nonfinite_batch_skips_the_step_and_changes_nothing(
        seed in 0u64..1_000_000,
        warm in 0usize..6,
        pos in 0usize..1000,
        bad in prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)],
    ) {
        let data = synthetic_classification(48, 5, 3, seed).unwrap();
        for method in Method::ALL {
            let mut a = trainer(method, seed);
            let mut b = trainer(method, seed);
            for i in 0..warm {
                let (x, l) = batch_of(&data, &a, i);
                step(&mut a, &x, &l);
                step(&mut b, &x, &l);
            }
            let before = state_without_skip_counter(&a);
            let (mut x, l) = batch_of(&data, &a, warm);
            let k = pos % x.as_slice().len();
            x.as_mut_slice()[k] = bad;
            let r = step(&mut a, &x, &l);
            prop_assert!(r.skipped, "{}: not skipped", method);
            prop_assert_eq!(r.step, warm as u64);
            prop_assert_eq!(a.counters().skipped_nonfinite, 1);
            prop_assert_eq!(a.steps(), warm as u64);
            prop_assert!(same_state(&before, &state_without_skip_counter(&a)), "{} changed", method);
            // The next good batch: identical to the run without the bad one.
            let (x, l) = batch_of(&data, &a, warm + 1);
            let ra = step(&mut a, &x, &l);
            let rb = step(&mut b, &x, &l);
            prop_assert!(!ra.skipped);
            prop_assert_eq!(ra.loss.to_bits(), rb.loss.to_bits());
            prop_assert!(same_state(&state_without_skip_counter(&a), &state_without_skip_counter(&b)));
        }
    }
}

/// A first-order update that overflows the parameters is a skipped step that changes
/// nothing: on the CPU the optimizer steps the network's own parameter vector, swapped in for
/// the update, and it must come back untouched, bit for bit, with the optimizer state. A
/// decoupled weight decay of `lr·λ = 1e19` takes one weight of 100 to about 1e21 in the
/// first step (applied: the buffers then differ) and past `f32::MAX` in the second.
#[test]
fn overflowing_first_order_update_skips_and_changes_nothing() {
    let data = synthetic_classification(48, 5, 3, 3).unwrap();
    for method in [Method::Sgd, Method::AdamW, Method::Sophia] {
        let mut config = MethodConfig::tuned(method);
        config.batch_size = 8;
        match &mut config.optimizer {
            OptimizerConfig::Sgd(c) => (c.lr, c.weight_decay) = (1e19, 1.0),
            OptimizerConfig::AdamW(c) => (c.lr, c.weight_decay, c.warmup_steps) = (1e19, 1.0, 0),
            OptimizerConfig::Sophia(c) => (c.lr, c.weight_decay) = (1e19, 1.0),
            _ => unreachable!(),
        }
        let mut mlp = network(5);
        mlp.params_mut()[3] = 100.0;
        let mut t = Trainer::new(&Device::Cpu, mlp, config, 5).unwrap();
        let (x, l) = batch_of(&data, &t, 0);
        assert!(
            !step(&mut t, &x, &l).skipped,
            "{method}: first step skipped"
        );
        let before = state_without_skip_counter(&t);
        let params: Vec<u32> = t.mlp().params().iter().map(|v| v.to_bits()).collect();
        let (x, l) = batch_of(&data, &t, 1);
        let r = step(&mut t, &x, &l);
        assert!(r.skipped, "{method}: overflow not skipped");
        assert_eq!(t.counters().skipped_nonfinite, 1, "{method}");
        assert_eq!(t.steps(), 1, "{method}");
        assert!(
            same_state(&before, &state_without_skip_counter(&t)),
            "{method} changed"
        );
        let after: Vec<u32> = t.mlp().params().iter().map(|v| v.to_bits()).collect();
        assert_eq!(after, params, "{method}: network parameters changed");
    }
}

/// A Kronecker step whose new parameters are finite but whose loss after the step is not is
/// rejected, and the network gets its parameters back bit for bit (the trainer swaps the
/// stepped ones in for the loss after and swaps them out again), and the optimizer's own
/// copy with them: the next step starts from the parameters before the rejected one. A huge
/// learning rate can leave every new weight finite (~1e19) and the predicted change too, while
/// the squared error of outputs that large overflows; the test scans learning rates for one
/// that does exactly that. (Under cross-entropy the predicted change overflows first: the
/// step is then refused before any parameter moves.)
#[test]
fn kron_step_with_non_finite_loss_after_is_rejected_and_restores_the_network() {
    let data = synthetic_classification(48, 5, 3, 3).unwrap();
    {
        let method = Method::Ring;
        let found = (40..=152).rev().find_map(|e4| {
            let e = e4 as f32 / 4.0;
            let mut config = MethodConfig::tuned(method);
            config.batch_size = 8;
            if let OptimizerConfig::Kron(k) = &mut config.optimizer {
                k.lr = 10f32.powf(e);
            }
            let mlp = Mlp::new(
                MlpConfig {
                    sizes: vec![5, 8, 3],
                    activation: Activation::Tanh,
                    loss: Loss::SquaredError,
                },
                5,
            )
            .unwrap();
            let mut t = Trainer::new(&Device::Cpu, mlp, config, 5).unwrap();
            let (x, l) = batch_of(&data, &t, 0);
            let params: Vec<u32> = t.mlp().params().iter().map(|v| v.to_bits()).collect();
            let r = step(&mut t, &x, &l);
            r.loss_after
                .is_some_and(|a| !a.is_finite())
                .then_some((t, params, r, x, l))
        });
        let (mut t, params, r, x, l) =
            found.unwrap_or_else(|| panic!("{method}: no learning rate overflowed the loss after"));
        assert!(r.skipped, "{method}: {r:?}");
        assert_eq!(t.counters().rejected_updates, 1, "{method}");
        let bits =
            |t: &Trainer| -> Vec<u32> { t.mlp().params().iter().map(|v| v.to_bits()).collect() };
        assert_eq!(
            bits(&t),
            params,
            "{method}: network parameters not restored"
        );
        // The optimizer's copy was restored too: the same step again overflows the same way
        // from the same parameters (were it stepped from the rejected ones, the loss before
        // would not be finite and the step would be skipped without a loss after).
        let again = step(&mut t, &x, &l);
        assert!(again.loss.is_finite(), "{method}: {again:?}");
        assert_eq!(bits(&t).len(), params.len());
    }
}

#[test]
fn skips_are_counted_across_a_checkpoint_and_reported() {
    let data = synthetic_classification(48, 5, 3, 9).unwrap();
    for method in Method::ALL {
        let mut t = trainer(method, 9);
        for i in 0..4 {
            let (mut x, l) = batch_of(&data, &t, i);
            if i % 2 == 1 {
                x.as_mut_slice()[0] = f32::NAN;
            }
            let r = step(&mut t, &x, &l);
            assert_eq!(r.skipped, i % 2 == 1);
            assert!(r.skipped || r.loss.is_finite());
        }
        assert_eq!((t.steps(), t.counters().skipped_nonfinite), (2, 2));
        let mut w = Writer::new();
        t.save(&mut w).unwrap();
        let mut fresh = trainer(method, 10);
        fresh.load(&w.to_reader().unwrap()).unwrap();
        assert_eq!(fresh.counters(), t.counters(), "{method}");
        assert_eq!(fresh.steps(), 2);
    }
}

#[test]
fn help_mentions_checkpoint_flags_and_the_binary_resumes() {
    Cli::command().debug_assert();
    let bin = env!("CARGO_BIN_EXE_grng");
    let help = std::process::Command::new(bin)
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--checkpoint-every",
        "--resume",
        "--max-steps",
        "resumed part",
    ] {
        assert!(help.contains(flag), "--help does not mention {flag}");
    }
    // The main job on the digits: 12 steps straight vs 5 steps then --resume to 12.
    let dir = temp_dir("cli");
    let job = |out: &Path, extra: &[&str]| {
        let o = std::process::Command::new(bin)
            .args(["--optimizers", "ring,rkalman,sophia", "--epochs", "1"])
            .args(["--eval-points", "3", "--out"])
            .arg(out)
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let (a, b) = (dir.join("a"), dir.join("b"));
    let out = job(&a, &["--max-steps", "12", "--checkpoint-every", "5"]);
    assert!(out.contains("skipped"), "no counters table:\n{out}");
    job(&b, &["--max-steps", "5", "--checkpoint-every", "5"]);
    let out = job(&b, &["--max-steps", "12", "--resume"]);
    for key in ["ring", "rkalman", "sophia"] {
        let file = format!("{key}.ckpt");
        let fa = std::fs::read(a.join(&file)).unwrap();
        let fb = std::fs::read(b.join(&file)).unwrap();
        assert!(fa == fb, "{key}: resumed main job differs");
    }
    // The counters table names the resume point.
    let ring_row = out.lines().rfind(|l| l.starts_with("RING")).unwrap();
    assert!(ring_row.trim_end().ends_with(" 5"), "{ring_row}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Set in the child process of [`a_device_fault_is_told_apart_and_stops_only_its_method`].
const FAULT_CHILD: &str = "GRNG_DEVICE_FAULT_CHILD";

/// A device fault (here the driver rejecting `kernels/syrk.cu`'s module, injected at the launch
/// layer on the emulated device) stops the method that needs the module, is flagged as the
/// device's (`MethodResult::device_fault`: the main job then exits non-zero after its table),
/// and leaves a method that never launches those kernels training to the end. The injection
/// is process-wide, so the scenario runs in a child process.
#[test]
fn a_device_fault_is_told_apart_and_stops_only_its_method() {
    if std::env::var_os(FAULT_CHILD).is_none() {
        common::run_child(
            "a_device_fault_is_told_apart_and_stops_only_its_method",
            &[(FAULT_CHILD, Some("1"))],
        );
        return;
    }
    let splits = splits();
    let run = run_config(3, None);
    let train_on = |method| {
        train_method(
            &Device::Emulated,
            &splits,
            &run,
            MethodConfig::tuned(method),
            &mut |_, _| {},
        )
        .unwrap_or_else(|e| panic!("{method}: {e}"))
    };
    grng::hooks::inject_ptx_reject(Some("SYRK"));
    let ring = train_on(Method::Ring);
    let sgd = train_on(Method::Sgd);
    grng::hooks::inject_ptx_reject(None);
    let why = ring.failure.as_deref().unwrap_or("no failure");
    assert!(ring.device_fault && why.contains("SYRK"), "{why}");
    assert!(ring.test_acc.is_nan());
    assert!(
        !sgd.device_fault && sgd.failure.is_none(),
        "{:?}",
        sgd.failure
    );
    assert_eq!(sgd.steps, 3);
    // What the flag reads: the device's errors, not the computation's.
    assert!(Error::Cuda("launch failed".into()).is_device_fault());
    assert!(!Error::NotSpd {
        op: "op",
        index: 0,
        pivot: -1.0
    }
    .is_device_fault());
}
