//! Bad input against every optimizer and every hot-path `Device` op (issue 5, "Bad input").
//!
//! Each probe feeds one bad input — a wrong shape, an empty batch, NaN/±Inf at a random
//! position, a negative / NaN / out-of-range hyperparameter, a non-SPD "factor", or huge
//! magnitudes (1e30) — inside `catch_unwind` and checks:
//! - no panic;
//! - a strictly invalid input returns an error whose message names the offending argument;
//! - a huge-but-finite input either errors or returns finite results (never silently NaN/Inf);
//! - on error, every mutable operand / the whole optimizer state is bit-for-bit unchanged
//!   (optimizers are snapshotted through their checkpoint records, which hold every bit).
//!
//! One test per device (the CPU, and the emulated kernels, whose launch code is the GPU's) runs
//! every family under a proptest runner (fresh random sizes and values per case) and prints
//! the counts; violations are listed with file, function and input, then fail it.

use grng_testkit as common;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use grng::checkpoint::{Checkpoint, Value, Writer};
use grng::ops::elementwise::{AdamWCoeffs, SgdCoeffs, SophiaCoeffs};
use grng::ops::kalman::{KalmanOptions, KalmanState};
use grng::ops::newton::NewtonOptions;
use grng::ops::norm::PowerOptions;
use grng::optim::adamw::{AdamW, AdamWConfig, AdamWState};
use grng::optim::kalman::{RKalman, RKalmanConfig, RKalmanState};
use grng::optim::kron::{KronConfig, KronOptimizer};
use grng::optim::sgd::{Sgd, SgdConfig, SgdState};
use grng::optim::sophia::{Sophia, SophiaConfig, SophiaHessian, SophiaState};
use grng::optim::KronStats;
use grng::{Device, Matrix, Result, Trans};
use half::bf16;
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The device the running test probes: each `#[test]` runs on its own thread and sets it
/// ([`on_device`]), so every family below runs unchanged on the CPU, the emulated kernels and
/// a GPU when present.
const DEV: CurrentDevice = CurrentDevice;
static CPU: Device = Device::Cpu;
thread_local! {
    static CURRENT: Cell<Option<&'static Device>> = const { Cell::new(None) };
}
struct CurrentDevice;
impl std::ops::Deref for CurrentDevice {
    type Target = Device;
    fn deref(&self) -> &Device {
        CURRENT.get().unwrap_or(&CPU)
    }
}
/// "Huge but finite": squares and products of two overflow `f32` (max ≈ 3.4e38).
const HUGE: f32 = 1e30;

// ---------------------------------------------------------------------------------------------
// Snapshots and the tally.

/// Every float bit and every integer of a state.
#[derive(Clone, Debug, PartialEq)]
struct Snap {
    float_bits: Vec<u32>,
    ints: Vec<u64>,
}

impl Snap {
    fn finite(&self) -> bool {
        self.float_bits
            .iter()
            .all(|&b| f32::from_bits(b).is_finite())
    }
}

fn snap_mats(ms: &[&Matrix]) -> Snap {
    Snap {
        float_bits: ms
            .iter()
            .flat_map(|m| m.to_vec().unwrap())
            .map(f32::to_bits)
            .collect(),
        ints: ms
            .iter()
            .flat_map(|m| [m.rows() as u64, m.cols() as u64])
            .collect(),
    }
}

/// The full state of a checkpointable object (its records) plus extra matrices.
fn snap_ck(c: &dyn Checkpoint, extra: &[&Matrix]) -> Snap {
    let mut w = Writer::new();
    c.save(&mut w).unwrap();
    let r = w.to_reader().unwrap();
    let mut s = snap_mats(extra);
    for name in r.names() {
        match r.get(name).unwrap() {
            Value::F32 { shape, data } => {
                s.ints.extend(shape.iter().map(|&d| d as u64));
                s.float_bits.extend(data.iter().map(|x| x.to_bits()));
            }
            Value::U64(v) => s.ints.push(*v),
            Value::F64(v) => s.ints.push(v.to_bits()),
            Value::Bytes(b) => s.ints.extend(b.iter().map(|&x| x as u64)),
            Value::U64s(v) => s.ints.extend(v),
        }
    }
    s
}

#[derive(Clone, Copy)]
enum Expect {
    /// Strictly invalid: an error naming one of these arguments (empty: any error).
    Err(&'static [&'static str]),
    /// Huge but finite: an error, or finite results.
    ErrOrFinite,
}

#[derive(Default)]
struct Tally {
    tried: usize,
    errors: usize,
    finite_ok: usize,
    panics: usize,
    /// Per target: [tried, errors, finite results].
    per_target: BTreeMap<&'static str, [usize; 3]>,
    violations: Vec<String>,
}

impl Tally {
    /// Runs `call` on `obj` with `snap` before and after (see the module docs).
    fn probe<O: ?Sized, T: Outputs>(
        &mut self,
        target: &'static str,
        input: &str,
        expect: Expect,
        obj: &mut O,
        snap: impl Fn(&O) -> Snap,
        call: impl FnOnce(&mut O) -> Result<T>,
    ) {
        self.tried += 1;
        let counts = self.per_target.entry(target).or_default();
        counts[0] += 1;
        let before = snap(obj);
        let res = catch_unwind(AssertUnwindSafe(|| call(obj)));
        let after = snap(obj);
        let mut violation = |what: String| {
            self.violations.push(format!("{target}: {input}: {what}"));
        };
        match res {
            Err(_) => {
                self.panics += 1;
                violation("PANICKED".into());
            }
            Ok(Err(e)) => {
                self.errors += 1;
                counts[1] += 1;
                if after != before {
                    violation(format!("state changed although it returned `{e}`"));
                }
                let msg = e.to_string();
                if let Expect::Err(args) = expect {
                    if !args.is_empty() && !args.iter().any(|a| names(&msg).contains(a)) {
                        violation(format!("error does not name {args:?}: `{msg}`"));
                    }
                }
            }
            Ok(Ok(out)) => match expect {
                Expect::Err(_) => violation("accepted (returned Ok)".into()),
                Expect::ErrOrFinite => {
                    if out.finite() && after.finite() {
                        self.finite_ok += 1;
                        counts[2] += 1;
                    } else {
                        violation("returned Ok with non-finite results".into());
                    }
                }
            },
        }
    }

    /// Probes `step` on `obj` with each bad gradient `(input, grad)`: an error naming `grad`.
    fn probe_grads<O>(
        &mut self,
        target: &'static str,
        grads: &[(String, &Matrix)],
        obj: &mut O,
        snap: impl Fn(&O) -> Snap,
        step: impl Fn(&mut O, &Matrix) -> Result<()>,
    ) {
        for (input, g) in grads {
            self.probe(target, input, Expect::Err(&["grad"]), obj, &snap, |o| {
                step(o, g)
            });
        }
    }

    /// Probes `restore` on `obj` with each bad state `(input, the arguments its error names,
    /// state)`.
    fn probe_restores<O, St>(
        &mut self,
        target: &'static str,
        states: &[(String, &'static [&'static str], St)],
        obj: &mut O,
        snap: impl Fn(&O) -> Snap,
        restore: impl Fn(&mut O, &St) -> Result<()>,
    ) {
        for (input, args, st) in states {
            self.probe(target, input, Expect::Err(args), obj, &snap, |o| {
                restore(o, st)
            });
        }
    }

    /// Probes each rejected config `C` through `set` on the live `obj` (targets `.0`) and
    /// through `new` from scratch (target `.1`): both must fail naming the config's field.
    fn probe_configs<O, C: Copy + std::fmt::Debug>(
        &mut self,
        (set_target, new_target): (&'static str, &'static str),
        cases: &[(&'static [&'static str], C)],
        obj: &mut O,
        snap: impl Fn(&O) -> Snap,
        set: impl Fn(&mut O, C) -> Result<()>,
        new: impl Fn(C) -> Result<()>,
    ) {
        for &(args, c) in cases {
            let input = format!("{c:?}");
            self.probe(set_target, &input, Expect::Err(args), obj, &snap, |o| {
                set(o, c)
            });
            let s0 = |_: &()| snap_mats(&[]);
            self.probe(new_target, &input, Expect::Err(args), &mut (), s0, |_| {
                new(c)
            });
        }
    }
}

/// The argument names a message quotes: the back-quoted segments, split at `", "`
/// (`` `mu0, d_o` `` names both).
fn names(msg: &str) -> Vec<&str> {
    msg.split('`')
        .skip(1)
        .step_by(2)
        .flat_map(|s| s.split(", "))
        .collect()
}

/// Results of a call whose finiteness is checked on success.
trait Outputs {
    fn finite(&self) -> bool;
}
impl Outputs for () {
    fn finite(&self) -> bool {
        true
    }
}
impl Outputs for f32 {
    fn finite(&self) -> bool {
        self.is_finite()
    }
}
impl Outputs for Matrix {
    fn finite(&self) -> bool {
        self.to_vec().unwrap().iter().all(|v| v.is_finite())
    }
}
impl<T: Outputs, U> Outputs for (T, U) {
    fn finite(&self) -> bool {
        self.0.finite()
    }
}
impl Outputs for Vec<Matrix> {
    fn finite(&self) -> bool {
        self.iter().all(Outputs::finite)
    }
}
impl Outputs for grng::ops::norm::PowerInfo {
    fn finite(&self) -> bool {
        self.value.is_finite()
    }
}
impl Outputs for grng::ops::kalman::KalmanInfo {
    fn finite(&self) -> bool {
        self.nis.is_finite() && self.jitter.is_finite()
    }
}
impl Outputs for grng::optim::kron::KronStepInfo {
    fn finite(&self) -> bool {
        self.predicted_change.is_some_and(f32::is_finite)
    }
}

// ---------------------------------------------------------------------------------------------
// Random inputs.

/// Values in `±scale`, never exactly zero.
fn vals(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v: f32 = rng.random_range(-scale..scale);
            if v == 0.0 {
                scale / 2.0
            } else {
                v
            }
        })
        .collect()
}

fn mat(rng: &mut ChaCha8Rng, r: usize, c: usize) -> Matrix {
    DEV.upload(r, c, &vals(rng, r * c, 1.0)).unwrap()
}

fn filled(r: usize, c: usize, v: f32) -> Matrix {
    DEV.upload(r, c, &vec![v; r * c]).unwrap()
}

/// `v` with NaN, +Inf or −Inf at a random position; returns the description.
fn poison(rng: &mut ChaCha8Rng, v: &mut [f32]) -> String {
    let i = rng.random_range(0..v.len());
    let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.random_range(0..3)];
    v[i] = bad;
    format!("{bad} at index {i} of {}", v.len())
}

fn poisoned(rng: &mut ChaCha8Rng, r: usize, c: usize) -> (Matrix, String) {
    let mut v = vals(rng, r * c, 1.0);
    let d = poison(rng, &mut v);
    (DEV.upload(r, c, &v).unwrap(), d)
}

fn bad_scalar(rng: &mut ChaCha8Rng) -> f32 {
    [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.random_range(0..3)]
}

/// `BᵀB/n + 0.1·I`: symmetric positive definite.
fn spd(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let b = vals(rng, n * n, 1.0);
    let mut a = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            let s: f32 = (0..n).map(|k| b[k * n + i] * b[k * n + j]).sum();
            a[i * n + j] = s / n as f32 + if i == j { 0.1 } else { 0.0 };
        }
    }
    a
}

/// Symmetric, with a negative diagonal entry: not positive definite.
fn non_spd(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let mut a = spd(rng, n);
    let k = rng.random_range(0..n);
    a[k * n + k] = -1.0 - rng.random_range(0.0..1.0f32);
    a
}

/// A different shape: one more row or column.
fn other_shape(rng: &mut ChaCha8Rng, r: usize, c: usize) -> (usize, usize) {
    if rng.random() {
        (r + 1, c)
    } else {
        (r, c + 1)
    }
}

// ---------------------------------------------------------------------------------------------
// Device ops.

fn elementwise_ops(t: &mut Tally, rng: &mut ChaCha8Rng, n: usize) {
    const F: &str = "src/ops/elementwise.rs";
    let x = mat(rng, n, 1);
    let (xs, xd) = poisoned(rng, n, 1);
    let wrong = mat(rng, n + 1, 1);
    let huge = filled(n, 1, HUGE);
    let s1 = |m: &Matrix| snap_mats(&[m]);

    let mut y = mat(rng, n, 1);
    let _ = F;
    // `axpy` writes `y` in place and `axpy_new` a new matrix; `y` must stay unchanged on error
    // either way, so both get the same probes.
    type Axpy = fn(f32, &Matrix, &mut Matrix) -> Result<()>;
    let axpys: [(&'static str, Axpy); 2] = [
        ("Device::axpy", |a, x, y| DEV.axpy(a, x, y)),
        ("Device::axpy_new", |a, x, y| {
            DEV.axpy_new(a, x, y).map(drop)
        }),
    ];
    for (tgt, op) in axpys {
        t.probe(
            tgt,
            "x one row longer",
            Expect::Err(&["x"]),
            &mut y,
            s1,
            |y| op(0.5, &wrong, y),
        );
        t.probe(
            tgt,
            &format!("x holds {xd}"),
            Expect::Err(&["x"]),
            &mut y,
            s1,
            |y| op(0.5, &xs, y),
        );
        let a = bad_scalar(rng);
        t.probe(
            tgt,
            &format!("alpha = {a}"),
            Expect::Err(&["alpha"]),
            &mut y,
            s1,
            |y| op(a, &x, y),
        );
        let (mut ys, yd) = poisoned(rng, n, 1);
        t.probe(
            tgt,
            &format!("y holds {yd}"),
            Expect::Err(&["y"]),
            &mut ys,
            s1,
            |y| op(0.5, &x, y),
        );
        let mut yh = filled(n, 1, HUGE);
        t.probe(
            tgt,
            "alpha = 1e30, x = y = 1e30",
            Expect::ErrOrFinite,
            &mut yh,
            s1,
            |y| op(HUGE, &huge, y),
        );
    }

    let tgt = "Device::scale";
    let a = bad_scalar(rng);
    t.probe(
        tgt,
        &format!("alpha = {a}"),
        Expect::Err(&["alpha"]),
        &mut y,
        s1,
        |y| DEV.scale(a, y),
    );
    let (mut ys, yd) = poisoned(rng, n, 1);
    t.probe(
        tgt,
        &format!("x holds {yd}"),
        Expect::Err(&["x"]),
        &mut ys,
        s1,
        |y| DEV.scale(2.0, y),
    );
    let mut yh = filled(n, 1, HUGE);
    t.probe(
        tgt,
        "alpha = 1e30, x = 1e30",
        Expect::ErrOrFinite,
        &mut yh,
        s1,
        |y| DEV.scale(HUGE, y),
    );

    let tgt = "Device::dot";
    let mut none = ();
    let s0 = |_: &()| snap_mats(&[]);
    t.probe(
        tgt,
        "y one row longer",
        Expect::Err(&["y"]),
        &mut none,
        s0,
        |_| DEV.dot(&x, &wrong),
    );
    t.probe(
        tgt,
        &format!("x holds {xd}"),
        Expect::Err(&["x"]),
        &mut none,
        s0,
        |_| DEV.dot(&xs, &x),
    );
    t.probe(
        tgt,
        "x = y = 1e30",
        Expect::ErrOrFinite,
        &mut none,
        s0,
        |_| DEV.dot(&huge, &huge),
    );

    let tgt = "Device::norm2";
    t.probe(
        tgt,
        &format!("x holds {xd}"),
        Expect::Err(&["x"]),
        &mut none,
        s0,
        |_| DEV.norm2(&xs),
    );
    let big = filled(n, 1, 3e38);
    t.probe(tgt, "x = 3e38", Expect::ErrOrFinite, &mut none, s0, |_| {
        DEV.norm2(&big)
    });

    let tgt = "Device::copy";
    t.probe(
        tgt,
        "src one row longer",
        Expect::Err(&["src"]),
        &mut y,
        s1,
        |y| DEV.copy(&wrong, y),
    );

    // Fused updates: operands (params, buffers) snapshotted together.
    let s2 = |v: &(Matrix, Matrix)| snap_mats(&[&v.0, &v.1]);
    let s3 = |v: &(Matrix, Matrix, Matrix)| snap_mats(&[&v.0, &v.1, &v.2]);
    let sgd = SgdCoeffs {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.01,
    };
    let tgt = "Device::sgd_update";
    let mut pm = (mat(rng, n, 1), mat(rng, n, 1));
    let bad_sgd = [
        ("lr", SgdCoeffs { lr: -0.1, ..sgd }),
        (
            "lr",
            SgdCoeffs {
                lr: bad_scalar(rng),
                ..sgd
            },
        ),
        (
            "momentum",
            SgdCoeffs {
                momentum: 1.0,
                ..sgd
            },
        ),
        (
            "momentum",
            SgdCoeffs {
                momentum: -0.5,
                ..sgd
            },
        ),
        (
            "weight_decay",
            SgdCoeffs {
                weight_decay: -1.0,
                ..sgd
            },
        ),
        (
            "weight_decay",
            SgdCoeffs {
                weight_decay: f32::NAN,
                ..sgd
            },
        ),
    ];
    for (arg, c) in bad_sgd {
        let args: &'static [&'static str] = match arg {
            "lr" => &["lr"],
            "momentum" => &["momentum"],
            _ => &["weight_decay"],
        };
        t.probe(
            tgt,
            &format!("{c:?}"),
            Expect::Err(args),
            &mut pm,
            s2,
            |(p, m)| DEV.sgd_update(p, &x, m, &c),
        );
    }
    t.probe(
        tgt,
        "grad one row longer",
        Expect::Err(&["grad"]),
        &mut pm,
        s2,
        |(p, m)| DEV.sgd_update(p, &wrong, m, &sgd),
    );
    t.probe(
        tgt,
        &format!("grad holds {xd}"),
        Expect::Err(&["grad"]),
        &mut pm,
        s2,
        |(p, m)| DEV.sgd_update(p, &xs, m, &sgd),
    );
    let (ps, pd) = poisoned(rng, n, 1);
    let mut pm_bad = (ps, mat(rng, n, 1));
    t.probe(
        tgt,
        &format!("params holds {pd}"),
        Expect::Err(&["params"]),
        &mut pm_bad,
        s2,
        |(p, m)| DEV.sgd_update(p, &x, m, &sgd),
    );
    let (ms, md) = poisoned(rng, n, 1);
    let mut pm_bad = (mat(rng, n, 1), ms);
    t.probe(
        tgt,
        &format!("momentum_buf holds {md}"),
        Expect::Err(&["momentum_buf"]),
        &mut pm_bad,
        s2,
        |(p, m)| DEV.sgd_update(p, &x, m, &sgd),
    );
    let mut pm_wrong = (mat(rng, n, 1), mat(rng, n + 1, 1));
    t.probe(
        tgt,
        "momentum_buf one row longer",
        Expect::Err(&["momentum_buf"]),
        &mut pm_wrong,
        s2,
        |(p, m)| DEV.sgd_update(p, &x, m, &sgd),
    );
    let mut pm_huge = (filled(n, 1, HUGE), filled(n, 1, HUGE));
    let big_lr = SgdCoeffs { lr: HUGE, ..sgd };
    t.probe(
        tgt,
        "lr = params = grad = momentum = 1e30",
        Expect::ErrOrFinite,
        &mut pm_huge,
        s2,
        |(p, m)| DEV.sgd_update(p, &huge, m, &big_lr),
    );

    let adam = common::ADAMW;
    let tgt = "Device::adamw_update";
    let mut pmv = (mat(rng, n, 1), mat(rng, n, 1), filled(n, 1, 0.5));
    let bad_adam: [(&'static [&'static str], AdamWCoeffs); 8] = [
        (&["lr"], AdamWCoeffs { lr: -1.0, ..adam }),
        (&["beta1"], AdamWCoeffs { beta1: 1.0, ..adam }),
        (
            &["beta2"],
            AdamWCoeffs {
                beta2: f32::NAN,
                ..adam
            },
        ),
        (
            &["beta2"],
            AdamWCoeffs {
                beta2: -0.1,
                ..adam
            },
        ),
        (&["eps"], AdamWCoeffs { eps: 0.0, ..adam }),
        (
            &["eps"],
            AdamWCoeffs {
                eps: f32::INFINITY,
                ..adam
            },
        ),
        (
            &["weight_decay"],
            AdamWCoeffs {
                weight_decay: -0.5,
                ..adam
            },
        ),
        (&["step"], AdamWCoeffs { step: 0, ..adam }),
    ];
    for (args, c) in bad_adam {
        t.probe(
            tgt,
            &format!("{c:?}"),
            Expect::Err(args),
            &mut pmv,
            s3,
            |(p, m, v)| DEV.adamw_update(p, &x, m, v, &c),
        );
    }
    t.probe(
        tgt,
        &format!("grad holds {xd}"),
        Expect::Err(&["grad"]),
        &mut pmv,
        s3,
        |(p, m, v)| DEV.adamw_update(p, &xs, m, v, &adam),
    );
    t.probe(
        tgt,
        "grad one row longer",
        Expect::Err(&["grad"]),
        &mut pmv,
        s3,
        |(p, m, v)| DEV.adamw_update(p, &wrong, m, v, &adam),
    );
    let mut neg_v = vals(rng, n, 1.0);
    neg_v.iter_mut().for_each(|v| *v = v.abs());
    let k = rng.random_range(0..n);
    neg_v[k] = -0.25;
    let mut pmv_neg = (
        mat(rng, n, 1),
        mat(rng, n, 1),
        DEV.upload(n, 1, &neg_v).unwrap(),
    );
    t.probe(
        tgt,
        &format!("v[{k}] = -0.25"),
        Expect::Err(&["v"]),
        &mut pmv_neg,
        s3,
        |(p, m, v)| DEV.adamw_update(p, &x, m, v, &adam),
    );
    let mut pmv_huge = (mat(rng, n, 1), mat(rng, n, 1), filled(n, 1, 0.5));
    t.probe(
        tgt,
        "grad = 1e30 (g² overflows f32)",
        Expect::ErrOrFinite,
        &mut pmv_huge,
        s3,
        |(p, m, v)| DEV.adamw_update(p, &huge, m, v, &adam),
    );

    let soph = SophiaCoeffs {
        lr: 1e-3,
        beta1: 0.96,
        gamma: 0.01,
        eps: 1e-12,
        weight_decay: 0.1,
    };
    let tgt = "Device::sophia_update";
    let h_ok = filled(n, 1, 0.5);
    let mut pm2 = (mat(rng, n, 1), mat(rng, n, 1));
    let bad_soph: [(&'static [&'static str], SophiaCoeffs); 6] = [
        (
            &["lr"],
            SophiaCoeffs {
                lr: f32::NAN,
                ..soph
            },
        ),
        (&["beta1"], SophiaCoeffs { beta1: 1.5, ..soph }),
        (&["gamma"], SophiaCoeffs { gamma: 0.0, ..soph }),
        (
            &["gamma"],
            SophiaCoeffs {
                gamma: -1.0,
                ..soph
            },
        ),
        (
            &["eps"],
            SophiaCoeffs {
                eps: -1e-12,
                ..soph
            },
        ),
        (
            &["weight_decay"],
            SophiaCoeffs {
                weight_decay: f32::INFINITY,
                ..soph
            },
        ),
    ];
    for (args, c) in bad_soph {
        t.probe(
            tgt,
            &format!("{c:?}"),
            Expect::Err(args),
            &mut pm2,
            s2,
            |(p, m)| DEV.sophia_update(p, &x, m, &h_ok, &c),
        );
    }
    let neg_h = DEV.upload(n, 1, &neg_v).unwrap();
    t.probe(
        tgt,
        &format!("h[{k}] = -0.25"),
        Expect::Err(&["h"]),
        &mut pm2,
        s2,
        |(p, m)| DEV.sophia_update(p, &x, m, &neg_h, &soph),
    );
    t.probe(
        tgt,
        &format!("h holds {xd}"),
        Expect::Err(&["h"]),
        &mut pm2,
        s2,
        |(p, m)| DEV.sophia_update(p, &x, m, &xs, &soph),
    );
    t.probe(
        tgt,
        "h one row longer",
        Expect::Err(&["h"]),
        &mut pm2,
        s2,
        |(p, m)| DEV.sophia_update(p, &x, m, &wrong, &soph),
    );
    t.probe(
        tgt,
        &format!("grad holds {xd}"),
        Expect::Err(&["grad"]),
        &mut pm2,
        s2,
        |(p, m)| DEV.sophia_update(p, &xs, m, &h_ok, &soph),
    );
    let mut pm2_huge = (filled(n, 1, HUGE), filled(n, 1, HUGE));
    let big_wd = SophiaCoeffs {
        lr: HUGE,
        weight_decay: HUGE,
        ..soph
    };
    t.probe(
        tgt,
        "lr = weight_decay = params = 1e30",
        Expect::ErrOrFinite,
        &mut pm2_huge,
        s2,
        |(p, m)| DEV.sophia_update(p, &huge, m, &h_ok, &big_wd),
    );

    let tgt = "Device::sophia_hessian_ema";
    let mut h = filled(n, 1, 0.5);
    t.probe(tgt, "batch = 0", Expect::Err(&["batch"]), &mut h, s1, |h| {
        DEV.sophia_hessian_ema(h, &x, 0.98, 0)
    });
    let b2 = [1.0, -0.1, f32::NAN][rng.random_range(0..3)];
    t.probe(
        tgt,
        &format!("beta2 = {b2}"),
        Expect::Err(&["beta2"]),
        &mut h,
        s1,
        |h| DEV.sophia_hessian_ema(h, &x, b2, 4),
    );
    t.probe(
        tgt,
        &format!("sampled_grad holds {xd}"),
        Expect::Err(&["sampled_grad"]),
        &mut h,
        s1,
        |h| DEV.sophia_hessian_ema(h, &xs, 0.98, 4),
    );
    t.probe(
        tgt,
        "sampled_grad one row longer",
        Expect::Err(&["sampled_grad"]),
        &mut h,
        s1,
        |h| DEV.sophia_hessian_ema(h, &wrong, 0.98, 4),
    );
    let mut hn = DEV.upload(n, 1, &neg_v).unwrap();
    t.probe(
        tgt,
        &format!("h[{k}] = -0.25"),
        Expect::Err(&["h"]),
        &mut hn,
        s1,
        |h| DEV.sophia_hessian_ema(h, &x, 0.98, 4),
    );
    t.probe(
        tgt,
        "sampled_grad = 1e30 (B·g² overflows f32)",
        Expect::ErrOrFinite,
        &mut h,
        s1,
        |h| DEV.sophia_hessian_ema(h, &huge, 0.98, 4),
    );
}

fn dense_ops(t: &mut Tally, rng: &mut ChaCha8Rng, m: usize, k: usize, n: usize) {
    let s1 = |c: &Matrix| snap_mats(&[c]);
    let a = mat(rng, m, k);
    let b = mat(rng, k, n);
    let mut c = mat(rng, m, n);

    let tgt = "Device::gemm";
    let b_wrong = mat(rng, k + 1, n);
    t.probe(
        tgt,
        "b has k+1 rows",
        Expect::Err(&["b"]),
        &mut c,
        s1,
        |c| DEV.gemm(Trans::No, Trans::No, 1.0, &a, &b_wrong, 0.0, c),
    );
    let (r2, c2) = other_shape(rng, m, n);
    let mut c_wrong = mat(rng, r2, c2);
    t.probe(
        tgt,
        &format!("c is {r2}x{c2}"),
        Expect::Err(&["c"]),
        &mut c_wrong,
        s1,
        |c| DEV.gemm(Trans::No, Trans::No, 1.0, &a, &b, 0.0, c),
    );
    let al = bad_scalar(rng);
    t.probe(
        tgt,
        &format!("alpha = {al}"),
        Expect::Err(&["alpha"]),
        &mut c,
        s1,
        |c| DEV.gemm(Trans::No, Trans::No, al, &a, &b, 0.0, c),
    );
    t.probe(
        tgt,
        &format!("beta = {al}"),
        Expect::Err(&["beta"]),
        &mut c,
        s1,
        |c| DEV.gemm(Trans::No, Trans::No, 1.0, &a, &b, al, c),
    );
    let (a_bad, ad) = poisoned(rng, m, k);
    t.probe(
        tgt,
        &format!("a holds {ad}"),
        Expect::Err(&["a"]),
        &mut c,
        s1,
        |c| DEV.gemm(Trans::No, Trans::No, 1.0, &a_bad, &b, 0.0, c),
    );
    let (b_bad, bd) = poisoned(rng, k, n);
    t.probe(
        tgt,
        &format!("b holds {bd}"),
        Expect::Err(&["b"]),
        &mut c,
        s1,
        |c| {
            DEV.gemm(
                Trans::No,
                Trans::Yes,
                1.0,
                &a,
                &DEV.upload(n, k, &b_bad.to_vec().unwrap()).unwrap(),
                0.0,
                c,
            )
        },
    );
    let (mut c_bad, cd) = poisoned(rng, m, n);
    t.probe(
        tgt,
        &format!("c holds {cd}, beta = 0.5"),
        Expect::Err(&["c"]),
        &mut c_bad,
        s1,
        |c| DEV.gemm(Trans::No, Trans::No, 1.0, &a, &b, 0.5, c),
    );
    let (ha, hb) = (filled(m, k, HUGE), filled(k, n, HUGE));
    t.probe(tgt, "a = b = 1e30", Expect::ErrOrFinite, &mut c, s1, |c| {
        DEV.gemm(Trans::No, Trans::No, 1.0, &ha, &hb, 0.0, c)
    });

    // Kronecker factors: A is m x k, factor k x k.
    let tgt = "Device::syrk_ema";
    let mut f = DEV.upload(k, k, &spd(rng, k)).unwrap();
    let empty = DEV.zeros::<f32>(0, k).unwrap();
    t.probe(
        tgt,
        "a has 0 rows (empty batch)",
        Expect::Err(&["a"]),
        &mut f,
        s1,
        |f| DEV.syrk_ema(&empty, 0.0, f),
    );
    let e = [1.0, -0.1, f32::NAN, f32::INFINITY][rng.random_range(0..4)];
    t.probe(
        tgt,
        &format!("eps = {e}"),
        Expect::Err(&["eps"]),
        &mut f,
        s1,
        |f| DEV.syrk_ema(&a, e, f),
    );
    let mut f_wrong = mat(rng, k + 1, k + 1);
    t.probe(
        tgt,
        "factor (k+1)x(k+1)",
        Expect::Err(&["factor"]),
        &mut f_wrong,
        s1,
        |f| DEV.syrk_ema(&a, 0.5, f),
    );
    t.probe(
        tgt,
        &format!("a holds {ad}"),
        Expect::Err(&["a"]),
        &mut f,
        s1,
        |f| DEV.syrk_ema(&a_bad, 0.5, f),
    );
    let (mut f_bad, fd) = poisoned(rng, k, k);
    t.probe(
        tgt,
        &format!("factor holds {fd}, eps = 0.5"),
        Expect::Err(&["factor"]),
        &mut f_bad,
        s1,
        |f| DEV.syrk_ema(&a, 0.5, f),
    );
    t.probe(
        tgt,
        "a = 1e30 (AᵀA overflows)",
        Expect::ErrOrFinite,
        &mut f,
        s1,
        |f| DEV.syrk_ema(&ha, 0.0, f),
    );
    // bf16 activations (the tensor-core SYRK on the kernel devices): same checks.
    let to_bf16 = |m: &Matrix| {
        let v: Vec<bf16> = m
            .to_vec()
            .unwrap()
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        DEV.upload(m.rows(), m.cols(), &v).unwrap()
    };
    let a16_bad = to_bf16(&a_bad);
    t.probe(
        tgt,
        &format!("a (bf16) holds {ad}"),
        Expect::Err(&["a"]),
        &mut f,
        s1,
        |f| DEV.syrk_ema(&a16_bad, 0.5, f),
    );
    let ha16 = to_bf16(&ha);
    t.probe(
        tgt,
        "a (bf16) = 1e30 (AᵀA overflows)",
        Expect::ErrOrFinite,
        &mut f,
        s1,
        |f| DEV.syrk_ema(&ha16, 0.5, f),
    );

    // Batch gradient: E is m x n, A is m x k, G is n x k.
    let tgt = "Device::batch_gradient";
    let e_ok = mat(rng, m, n);
    let mut g = mat(rng, n, k);
    let e_empty = DEV.zeros::<f32>(0, n).unwrap();
    let a_empty = DEV.zeros::<f32>(0, k).unwrap();
    t.probe(
        tgt,
        "e, a have 0 rows (empty batch)",
        Expect::Err(&["e"]),
        &mut g,
        s1,
        |g| DEV.batch_gradient(&e_empty, &a_empty, g),
    );
    let a_rows = mat(rng, m + 1, k);
    t.probe(
        tgt,
        "a has m+1 rows",
        Expect::Err(&["a"]),
        &mut g,
        s1,
        |g| DEV.batch_gradient(&e_ok, &a_rows, g),
    );
    let mut g_wrong = mat(rng, n + 1, k);
    t.probe(
        tgt,
        "g (n+1)xk",
        Expect::Err(&["g"]),
        &mut g_wrong,
        s1,
        |g| DEV.batch_gradient(&e_ok, &a, g),
    );
    let (e_bad, ed) = poisoned(rng, m, n);
    t.probe(
        tgt,
        &format!("e holds {ed}"),
        Expect::Err(&["e"]),
        &mut g,
        s1,
        |g| DEV.batch_gradient(&e_bad, &a, g),
    );
    t.probe(
        tgt,
        &format!("a holds {ad}"),
        Expect::Err(&["a"]),
        &mut g,
        s1,
        |g| DEV.batch_gradient(&e_ok, &a_bad, g),
    );
    let he = filled(m, n, HUGE);
    t.probe(tgt, "e = a = 1e30", Expect::ErrOrFinite, &mut g, s1, |g| {
        DEV.batch_gradient(&he, &ha, g)
    });

    // Preconditioning: Γ⁻¹ n x n, G n x k, Λ⁻¹ k x k, P n x k.
    let tgt = "Device::precondition";
    let gi = DEV.upload(n, n, &spd(rng, n)).unwrap();
    let li = DEV.upload(k, k, &spd(rng, k)).unwrap();
    let g_in = mat(rng, n, k);
    let mut p = mat(rng, n, k);
    let gi_wrong = mat(rng, n + 1, n + 1);
    t.probe(
        tgt,
        "gamma_inv (n+1)x(n+1)",
        Expect::Err(&["gamma_inv"]),
        &mut p,
        s1,
        |p| DEV.precondition(&gi_wrong, &g_in, &li, p),
    );
    let li_wrong = mat(rng, k, k + 1);
    t.probe(
        tgt,
        "lambda_inv kx(k+1)",
        Expect::Err(&["lambda_inv"]),
        &mut p,
        s1,
        |p| DEV.precondition(&gi, &g_in, &li_wrong, p),
    );
    let mut p_wrong = mat(rng, n, k + 1);
    t.probe(
        tgt,
        "p nx(k+1)",
        Expect::Err(&["p"]),
        &mut p_wrong,
        s1,
        |p| DEV.precondition(&gi, &g_in, &li, p),
    );
    let (g_bad, gd) = poisoned(rng, n, k);
    t.probe(
        tgt,
        &format!("g holds {gd}"),
        Expect::Err(&["g"]),
        &mut p,
        s1,
        |p| DEV.precondition(&gi, &g_bad, &li, p),
    );
    let (li_bad, lid) = poisoned(rng, k, k);
    t.probe(
        tgt,
        &format!("lambda_inv holds {lid}"),
        Expect::Err(&["lambda_inv"]),
        &mut p,
        s1,
        |p| DEV.precondition(&gi, &g_in, &li_bad, p),
    );
    let hg = filled(n, k, HUGE);
    let hgi = filled(n, n, HUGE);
    t.probe(
        tgt,
        "gamma_inv = g = 1e30",
        Expect::ErrOrFinite,
        &mut p,
        s1,
        |p| DEV.precondition(&hgi, &hg, &li, p),
    );

    let tgt = "Device::damped_inverse_update";
    let mut x = DEV.upload(k, k, &spd(rng, k)).unwrap();
    let mut x_rect = mat(rng, k, k + 1);
    t.probe(
        tgt,
        "inv kx(k+1)",
        Expect::Err(&["inv"]),
        &mut x_rect,
        s1,
        |x| DEV.damped_inverse_update(x, 0.01),
    );
    let dl = bad_scalar(rng);
    t.probe(
        tgt,
        &format!("dlambda = {dl}"),
        Expect::Err(&["dlambda"]),
        &mut x,
        s1,
        |x| DEV.damped_inverse_update(x, dl),
    );
    let (mut x_bad, xd) = poisoned(rng, k, k);
    t.probe(
        tgt,
        &format!("inv holds {xd}"),
        Expect::Err(&["inv"]),
        &mut x_bad,
        s1,
        |x| DEV.damped_inverse_update(x, 0.01),
    );
    let mut x_huge = filled(k, k, HUGE);
    t.probe(
        tgt,
        "inv = 1e30 (X·X overflows)",
        Expect::ErrOrFinite,
        &mut x_huge,
        s1,
        |x| DEV.damped_inverse_update(x, 0.01),
    );

    let tgt = "Device::add_diagonal";
    t.probe(
        tgt,
        "a kx(k+1)",
        Expect::Err(&["a"]),
        &mut x_rect,
        s1,
        |x| DEV.add_diagonal(x, 0.01),
    );
    t.probe(
        tgt,
        &format!("lambda = {dl}"),
        Expect::Err(&["lambda"]),
        &mut x,
        s1,
        |x| DEV.add_diagonal(x, dl),
    );
    let (mut x_bad, xd) = poisoned(rng, k, k);
    t.probe(
        tgt,
        &format!("a holds {xd}"),
        Expect::Err(&["a"]),
        &mut x_bad,
        s1,
        |x| DEV.add_diagonal(x, 0.01),
    );
    let mut x_big = filled(k, k, 3e38);
    t.probe(
        tgt,
        "a = 3e38, lambda = 1e38 (diagonal overflows)",
        Expect::ErrOrFinite,
        &mut x_big,
        s1,
        |x| DEV.add_diagonal(x, 1e38),
    );
}

fn inverse_ops(t: &mut Tally, rng: &mut ChaCha8Rng, n: usize) {
    let mut none = ();
    let s0 = |_: &()| snap_mats(&[]);
    let a = DEV.upload(n, n, &spd(rng, n)).unwrap();
    let rect = mat(rng, n, n + 1);
    let (a_bad, ad) = {
        let mut v = spd(rng, n);
        let d = poison(rng, &mut v);
        (DEV.upload(n, n, &v).unwrap(), d)
    };
    let indef = DEV.upload(n, n, &non_spd(rng, n)).unwrap();
    let huge_spd = {
        let mut v = vec![0.0f32; n * n];
        (0..n).for_each(|i| v[i * n + i] = HUGE);
        DEV.upload(n, n, &v).unwrap()
    };
    let opts = NewtonOptions::default();

    let tgt = "Device::newton_inverse";
    t.probe(tgt, "a nx(n+1)", Expect::Err(&["a"]), &mut none, s0, |_| {
        DEV.newton_inverse(&rect, None, &opts)
    });
    let warm = mat(rng, n + 1, n + 1);
    t.probe(
        tgt,
        "warm (n+1)x(n+1)",
        Expect::Err(&["warm"]),
        &mut none,
        s0,
        |_| DEV.newton_inverse(&a, Some(&warm), &opts),
    );
    t.probe(
        tgt,
        &format!("a holds {ad}"),
        Expect::Err(&["a"]),
        &mut none,
        s0,
        |_| DEV.newton_inverse(&a_bad, None, &opts),
    );
    t.probe(
        tgt,
        "a not positive definite",
        Expect::Err(&[]),
        &mut none,
        s0,
        |_| DEV.newton_inverse(&indef, None, &opts),
    );
    let tol = [0.0, -1e-4, f32::NAN][rng.random_range(0..3)];
    let bad_tol = NewtonOptions { tol, ..opts };
    t.probe(
        tgt,
        &format!("tol = {tol}"),
        Expect::Err(&["tol"]),
        &mut none,
        s0,
        |_| DEV.newton_inverse(&a, None, &bad_tol),
    );
    let bad_low = NewtonOptions {
        lambda_low: -1.0,
        ..opts
    };
    t.probe(
        tgt,
        "lambda_low = -1",
        Expect::Err(&["lambda_low"]),
        &mut none,
        s0,
        |_| DEV.newton_inverse(&a, None, &bad_low),
    );
    let empty = DEV.zeros::<f32>(0, 0).unwrap();
    t.probe(tgt, "a is 0x0", Expect::Err(&["a"]), &mut none, s0, |_| {
        DEV.newton_inverse(&empty, None, &opts)
    });
    t.probe(
        tgt,
        "a = 1e30·I",
        Expect::ErrOrFinite,
        &mut none,
        s0,
        |_| DEV.newton_inverse(&huge_spd, None, &opts),
    );

    let tgt = "Device::cholesky_inverse";
    t.probe(tgt, "a nx(n+1)", Expect::Err(&["a"]), &mut none, s0, |_| {
        DEV.cholesky_inverse(&rect)
    });
    t.probe(
        tgt,
        &format!("a holds {ad}"),
        Expect::Err(&["a"]),
        &mut none,
        s0,
        |_| DEV.cholesky_inverse(&a_bad),
    );
    t.probe(
        tgt,
        "a not positive definite",
        Expect::Err(&[]),
        &mut none,
        s0,
        |_| DEV.cholesky_inverse(&indef),
    );
    t.probe(
        tgt,
        "a = 1e30·I",
        Expect::ErrOrFinite,
        &mut none,
        s0,
        |_| DEV.cholesky_inverse(&huge_spd),
    );

    let tgt = "Device::spectral_norm";
    let popts = PowerOptions::default();
    t.probe(tgt, "a nx(n+1)", Expect::Err(&["a"]), &mut none, s0, |_| {
        DEV.spectral_norm(&rect, &popts)
    });
    t.probe(
        tgt,
        &format!("a holds {ad}"),
        Expect::Err(&["a"]),
        &mut none,
        s0,
        |_| DEV.spectral_norm(&a_bad, &popts),
    );
    let bad_p = PowerOptions { tol: -1.0, ..popts };
    t.probe(
        tgt,
        "tol = -1",
        Expect::Err(&["tol"]),
        &mut none,
        s0,
        |_| DEV.spectral_norm(&a, &bad_p),
    );
    let bad_p = PowerOptions {
        max_iter: 0,
        ..popts
    };
    t.probe(
        tgt,
        "max_iter = 0",
        Expect::Err(&["max_iter"]),
        &mut none,
        s0,
        |_| DEV.spectral_norm(&a, &bad_p),
    );
    let full_huge = filled(n, n, HUGE);
    t.probe(
        tgt,
        "a = 1e30 everywhere",
        Expect::ErrOrFinite,
        &mut none,
        s0,
        |_| DEV.spectral_norm(&full_huge, &popts),
    );

    let tgt = "Device::trace";
    t.probe(tgt, "a nx(n+1)", Expect::Err(&["a"]), &mut none, s0, |_| {
        DEV.trace(&rect)
    });
    let mut v = spd(rng, n);
    let i = rng.random_range(0..n);
    v[i * n + i] = bad_scalar(rng);
    let diag_bad = DEV.upload(n, n, &v).unwrap();
    t.probe(
        tgt,
        &format!("a[{i},{i}] = {}", v[i * n + i]),
        Expect::Err(&["a"]),
        &mut none,
        s0,
        |_| DEV.trace(&diag_bad),
    );
    let big = {
        let mut v = vec![0.0f32; (n + 2) * (n + 2)];
        (0..n + 2).for_each(|i| v[i * (n + 2) + i] = 3e38);
        DEV.upload(n + 2, n + 2, &v).unwrap()
    };
    t.probe(
        tgt,
        "diagonal of 3e38 (sum overflows)",
        Expect::ErrOrFinite,
        &mut none,
        s0,
        |_| DEV.trace(&big),
    );
}

fn kalman_ops(t: &mut Tally, rng: &mut ChaCha8Rng, n: usize, d_o: usize) {
    const TGT: &str = "Device::kalman_step";
    let snap = |s: &KalmanState| snap_mats(&[&s.mu, &s.sigma, &s.r]);
    let mu0 = vals(rng, n, 1.0);
    let mut st = KalmanState::new(&DEV, &mu0, 0.1, d_o).unwrap();
    let opts = KalmanOptions::default();
    let h = mat(rng, d_o, n);
    let v = mat(rng, d_o, 1);
    // A valid step first, so R and σ are not at their initial values.
    DEV.kalman_step(&mut st, &h, &v, &opts).unwrap();

    let h_wide = mat(rng, d_o, n + 1);
    t.probe(
        TGT,
        "h d_o x (n+1)",
        Expect::Err(&["h", "state.mu"]),
        &mut st,
        snap,
        |s| DEV.kalman_step(s, &h_wide, &v, &opts),
    );
    let h_tall = mat(rng, d_o + 1, n);
    t.probe(
        TGT,
        "h (d_o+1) x n",
        Expect::Err(&["h", "state.r"]),
        &mut st,
        snap,
        |s| DEV.kalman_step(s, &h_tall, &v, &opts),
    );
    let h_empty = DEV.zeros::<f32>(0, n).unwrap();
    t.probe(
        TGT,
        "h 0 x n (empty observation)",
        Expect::Err(&["h"]),
        &mut st,
        snap,
        |s| DEV.kalman_step(s, &h_empty, &v, &opts),
    );
    let v_wrong = mat(rng, d_o + 1, 1);
    t.probe(
        TGT,
        "innovation (d_o+1) x 1",
        Expect::Err(&["innovation"]),
        &mut st,
        snap,
        |s| DEV.kalman_step(s, &h, &v_wrong, &opts),
    );
    let (h_bad, hd) = poisoned(rng, d_o, n);
    t.probe(
        TGT,
        &format!("h holds {hd}"),
        Expect::Err(&["h"]),
        &mut st,
        snap,
        |s| DEV.kalman_step(s, &h_bad, &v, &opts),
    );
    let (v_bad, vd) = poisoned(rng, d_o, 1);
    t.probe(
        TGT,
        &format!("innovation holds {vd}"),
        Expect::Err(&["innovation"]),
        &mut st,
        snap,
        |s| DEV.kalman_step(s, &h, &v_bad, &opts),
    );
    let bad_opts: [(&'static [&'static str], KalmanOptions); 7] = [
        (&["beta"], KalmanOptions { beta: 1.5, ..opts }),
        (
            &["beta"],
            KalmanOptions {
                beta: f32::NAN,
                ..opts
            },
        ),
        (&["rho"], KalmanOptions { rho: -1e-4, ..opts }),
        (
            &["process_noise"],
            KalmanOptions {
                process_noise: -1.0,
                ..opts
            },
        ),
        (
            &["sigma_floor"],
            KalmanOptions {
                sigma_floor: 0.0,
                ..opts
            },
        ),
        (
            &["jitter"],
            KalmanOptions {
                jitter: f32::INFINITY,
                ..opts
            },
        ),
        (
            &["max_jitter_escalations"],
            KalmanOptions {
                max_jitter_escalations: 1000,
                ..opts
            },
        ),
    ];
    for (args, o) in bad_opts {
        t.probe(
            TGT,
            &format!("{o:?}"),
            Expect::Err(args),
            &mut st,
            snap,
            |s| DEV.kalman_step(s, &h, &v, &o),
        );
    }
    // A state whose σ was corrupted through the public fields.
    let mut corrupt = KalmanState::new(&DEV, &mu0, 0.1, d_o).unwrap();
    let mut sig = vec![0.1f32; n];
    let i = rng.random_range(0..n);
    sig[i] = -0.1;
    corrupt.sigma = DEV.upload(n, 1, &sig).unwrap();
    t.probe(
        TGT,
        &format!("state.sigma[{i}] = -0.1"),
        Expect::Err(&["sigma", "state.sigma"]),
        &mut corrupt,
        snap,
        |s| DEV.kalman_step(s, &h, &v, &opts),
    );
    let mut corrupt = KalmanState::new(&DEV, &mu0, 0.1, d_o).unwrap();
    corrupt.r = DEV.upload(d_o, d_o, &non_spd(rng, d_o)).unwrap();
    t.probe(
        TGT,
        "state.r not positive semidefinite",
        Expect::ErrOrFinite,
        &mut corrupt,
        snap,
        |s| DEV.kalman_step(s, &h, &v, &opts),
    );
    let h_huge = filled(d_o, n, HUGE);
    t.probe(
        TGT,
        "h = 1e30 (H Σ Hᵀ overflows)",
        Expect::ErrOrFinite,
        &mut st,
        snap,
        |s| DEV.kalman_step(s, &h_huge, &v, &opts),
    );
    let v_huge = filled(d_o, 1, HUGE);
    t.probe(
        TGT,
        "innovation = 1e30",
        Expect::ErrOrFinite,
        &mut st,
        snap,
        |s| DEV.kalman_step(s, &h, &v_huge, &opts),
    );

    let tgt = "KalmanState::new";
    let mut none = ();
    let s0 = |_: &()| snap_mats(&[]);
    let mut mu_bad = mu0.clone();
    let md = poison(rng, &mut mu_bad);
    t.probe(
        tgt,
        &format!("mu0 holds {md}"),
        Expect::Err(&["mu0"]),
        &mut none,
        s0,
        |_| KalmanState::new(&DEV, &mu_bad, 0.1, d_o).map(|_| ()),
    );
    t.probe(
        tgt,
        "mu0 empty",
        Expect::Err(&["mu0"]),
        &mut none,
        s0,
        |_| KalmanState::new(&DEV, &[], 0.1, d_o).map(|_| ()),
    );
    t.probe(tgt, "d_o = 0", Expect::Err(&["d_o"]), &mut none, s0, |_| {
        KalmanState::new(&DEV, &mu0, 0.1, 0).map(|_| ())
    });
    let s = [0.0, -0.1, f32::NAN][rng.random_range(0..3)];
    t.probe(
        tgt,
        &format!("sigma0 = {s}"),
        Expect::Err(&["sigma0"]),
        &mut none,
        s0,
        |_| KalmanState::new(&DEV, &mu0, s, d_o).map(|_| ()),
    );
}

// ---------------------------------------------------------------------------------------------
// Optimizers.

fn flat_optimizers(t: &mut Tally, rng: &mut ChaCha8Rng, n: usize) {
    let x = mat(rng, n, 1);
    let (xs, xd) = poisoned(rng, n, 1);
    let wrong = mat(rng, n + 1, 1);
    let two_cols = mat(rng, n, 2);
    let huge = filled(n, 1, HUGE);
    let mut none = ();
    let s0 = |_: &()| snap_mats(&[]);

    // SGD.
    let mut o = (
        Sgd::new(&DEV, n, SgdConfig::default()).unwrap(),
        mat(rng, n, 1),
    );
    o.0.step(&mut o.1, &x).unwrap();
    let s = |o: &(Sgd, Matrix)| snap_ck(&o.0, &[&o.1]);
    let tgt = "Sgd::step";
    let bad_grads = [
        ("grad one row longer".into(), &wrong),
        ("grad n x 2".into(), &two_cols),
        (format!("grad holds {xd}"), &xs),
    ];
    t.probe_grads(tgt, &bad_grads, &mut o, s, |(o, p), g| o.step(p, g));
    let mut o_bad = (
        Sgd::new(&DEV, n, SgdConfig::default()).unwrap(),
        xs.try_clone().unwrap(),
    );
    t.probe(
        tgt,
        &format!("params holds {xd}"),
        Expect::Err(&["params"]),
        &mut o_bad,
        s,
        |(o, p)| o.step(p, &x),
    );
    let mut o_wrong = (
        Sgd::new(&DEV, n, SgdConfig::default()).unwrap(),
        mat(rng, n + 1, 1),
    );
    t.probe(
        tgt,
        "params one row longer",
        Expect::Err(&["params"]),
        &mut o_wrong,
        s,
        |(o, p)| o.step(p, &x),
    );
    t.probe(
        tgt,
        "grad = 1e30",
        Expect::ErrOrFinite,
        &mut o,
        s,
        |(o, p)| o.step(p, &huge),
    );
    let tgt = "Sgd::set_config";
    let cfg = SgdConfig::default();
    t.probe_configs(
        (tgt, "Sgd::new"),
        &[
            (&["lr"][..], SgdConfig { lr: -0.1, ..cfg }),
            (
                &["momentum"][..],
                SgdConfig {
                    momentum: 1.0,
                    ..cfg
                },
            ),
            (
                &["weight_decay"][..],
                SgdConfig {
                    weight_decay: f32::NAN,
                    ..cfg
                },
            ),
        ],
        &mut o,
        s,
        |(o, _), c| o.set_config(c),
        |c| Sgd::new(&DEV, n, c).map(|_| ()),
    );
    t.probe(
        "Sgd::new",
        "n = 0",
        Expect::Err(&["n"]),
        &mut none,
        s0,
        |_| Sgd::new(&DEV, 0, cfg).map(|_| ()),
    );
    let good = o.0.state().unwrap();
    let mut m = good.momentum.clone();
    let md = poison(rng, &mut m);
    let bad_states = [
        (
            "momentum length n+1".into(),
            &["momentum"][..],
            SgdState {
                momentum: vec![0.1; n + 1],
                ..good.clone()
            },
        ),
        (
            format!("momentum holds {md}"),
            &["momentum"][..],
            SgdState {
                momentum: m,
                ..good.clone()
            },
        ),
    ];
    t.probe_restores("Sgd::restore", &bad_states, &mut o, s, |(o, _), st| {
        o.restore(st)
    });

    // AdamW.
    let mut o = (
        AdamW::new(&DEV, n, AdamWConfig::default()).unwrap(),
        mat(rng, n, 1),
    );
    o.0.step(&mut o.1, &x).unwrap();
    let s = |o: &(AdamW, Matrix)| snap_ck(&o.0, &[&o.1]);
    let tgt = "AdamW::step";
    let bad_grads = [
        ("grad one row longer".into(), &wrong),
        (format!("grad holds {xd}"), &xs),
    ];
    t.probe_grads(tgt, &bad_grads, &mut o, s, |(o, p), g| o.step(p, g));
    let mut o_bad = (
        AdamW::new(&DEV, n, AdamWConfig::default()).unwrap(),
        xs.try_clone().unwrap(),
    );
    t.probe(
        tgt,
        &format!("params holds {xd}"),
        Expect::Err(&["params"]),
        &mut o_bad,
        s,
        |(o, p)| o.step(p, &x),
    );
    t.probe(
        tgt,
        "grad = 1e30 (g² overflows f32)",
        Expect::ErrOrFinite,
        &mut o,
        s,
        |(o, p)| o.step(p, &huge),
    );
    let cfg = AdamWConfig::default();
    t.probe_configs(
        ("AdamW::set_config", "AdamW::new"),
        &[
            (
                &["lr"][..],
                AdamWConfig {
                    lr: f32::NAN,
                    ..cfg
                },
            ),
            (&["beta1"][..], AdamWConfig { beta1: 1.0, ..cfg }),
            (&["beta2"][..], AdamWConfig { beta2: 2.0, ..cfg }),
            (&["eps"][..], AdamWConfig { eps: 0.0, ..cfg }),
            (
                &["weight_decay"][..],
                AdamWConfig {
                    weight_decay: -1.0,
                    ..cfg
                },
            ),
            (
                &["schedule.total_steps"][..],
                AdamWConfig {
                    schedule: grng::optim::adamw::LrSchedule::Cosine {
                        total_steps: 10,
                        min_lr: 0.0,
                    },
                    ..cfg
                },
            ),
            (
                &["schedule.min_lr"][..],
                AdamWConfig {
                    schedule: grng::optim::adamw::LrSchedule::Cosine {
                        total_steps: 1000,
                        min_lr: 1.0,
                    },
                    ..cfg
                },
            ),
        ],
        &mut o,
        s,
        |(o, _), c| o.set_config(c),
        |c| AdamW::new(&DEV, n, c).map(|_| ()),
    );
    let good = o.0.state().unwrap();
    let mut v = good.v.clone();
    let k = rng.random_range(0..n);
    v[k] = -1.0;
    let mut m = good.m.clone();
    let md = poison(rng, &mut m);
    let short_v = vec![0.0; n.saturating_sub(1)];
    let bad_states = [
        (
            format!("v[{k}] = -1"),
            &["v"][..],
            AdamWState { v, ..good.clone() },
        ),
        (
            format!("m holds {md}"),
            &["m"][..],
            AdamWState { m, ..good.clone() },
        ),
        (
            "v length n-1".into(),
            &["v"][..],
            AdamWState {
                v: short_v,
                ..good.clone()
            },
        ),
    ];
    t.probe_restores("AdamW::restore", &bad_states, &mut o, s, |(o, _), st| {
        o.restore(st)
    });

    // Sophia.
    let cfg = SophiaConfig::default();
    let mut o = (Sophia::new(&DEV, n, cfg).unwrap(), mat(rng, n, 1));
    let hs = mat(rng, n, 1);
    o.0.step(
        &mut o.1,
        &x,
        Some(SophiaHessian {
            sampled_grad: &hs,
            batch: 4,
        }),
    )
    .unwrap();
    let s = |o: &(Sophia, Matrix)| snap_ck(&o.0, &[&o.1]);
    let tgt = "Sophia::step";
    let hess = |g| {
        Some(SophiaHessian {
            sampled_grad: g,
            batch: 4,
        })
    };
    // (input, the arguments its error names, grad, hess.sampled_grad).
    type SophiaCase<'a> = (
        String,
        &'static [&'static str],
        &'a Matrix,
        Option<&'a Matrix>,
    );
    let bad_steps: [SophiaCase<'_>; 4] = [
        ("grad one row longer".into(), &["grad"], &wrong, None),
        (format!("grad holds {xd}"), &["grad"], &xs, Some(&hs)),
        (
            format!("hess.sampled_grad holds {xd}"),
            &["sampled_grad"],
            &x,
            Some(&xs),
        ),
        (
            "hess.sampled_grad one row longer".into(),
            &["hess.sampled_grad"],
            &x,
            Some(&wrong),
        ),
    ];
    for (input, args, g, h) in bad_steps {
        t.probe(tgt, &input, Expect::Err(args), &mut o, s, |(o, p)| {
            o.step(p, g, h.and_then(hess))
        });
    }
    t.probe(
        tgt,
        "hess.batch = 0",
        Expect::Err(&["batch"]),
        &mut o,
        s,
        |(o, p)| {
            o.step(
                p,
                &x,
                Some(SophiaHessian {
                    sampled_grad: &hs,
                    batch: 0,
                }),
            )
        },
    );
    let mut o_need = (Sophia::new(&DEV, n, cfg).unwrap(), mat(rng, n, 1));
    t.probe(
        tgt,
        "no hess on a refresh step",
        Expect::Err(&["hess"]),
        &mut o_need,
        s,
        |(o, p)| o.step(p, &x, None),
    );
    t.probe(
        tgt,
        "hess.sampled_grad = 1e30 (B·g² overflows)",
        Expect::ErrOrFinite,
        &mut o,
        s,
        |(o, p)| o.step(p, &x, hess(&huge)),
    );
    t.probe_configs(
        ("Sophia::set_config", "Sophia::new"),
        &[
            (&["lr"][..], SophiaConfig { lr: -1.0, ..cfg }),
            (&["beta1"][..], SophiaConfig { beta1: 1.0, ..cfg }),
            (
                &["beta2"][..],
                SophiaConfig {
                    beta2: f32::NAN,
                    ..cfg
                },
            ),
            (&["gamma"][..], SophiaConfig { gamma: 0.0, ..cfg }),
            (&["eps"][..], SophiaConfig { eps: -1.0, ..cfg }),
            (
                &["hessian_every"][..],
                SophiaConfig {
                    hessian_every: 0,
                    ..cfg
                },
            ),
        ],
        &mut o,
        s,
        |(o, _), c| o.set_config(c),
        |c| Sophia::new(&DEV, n, c).map(|_| ()),
    );
    let good = o.0.state().unwrap();
    let mut h = good.h.clone();
    let k = rng.random_range(0..n);
    h[k] = -1.0;
    let bad_states = [
        (
            format!("h[{k}] = -1"),
            &["h"][..],
            SophiaState { h, ..good.clone() },
        ),
        (
            "m length n+2".into(),
            &["m"][..],
            SophiaState {
                m: vec![0.0; n + 2],
                ..good.clone()
            },
        ),
    ];
    t.probe_restores("Sophia::restore", &bad_states, &mut o, s, |(o, _), st| {
        o.restore(st)
    });
}

fn kalman_optimizer(t: &mut Tally, rng: &mut ChaCha8Rng, n: usize, d_o: usize) {
    let cfg = RKalmanConfig::default();
    let mu0 = vals(rng, n, 1.0);
    let h = mat(rng, d_o, n);
    let v = mat(rng, d_o, 1);
    let mut o = RKalman::new(&DEV, &mu0, d_o, cfg).unwrap();
    o.step(&h, &v).unwrap();
    let s = |o: &RKalman| snap_ck(o, &[]);
    let tgt = "RKalman::step";
    let h_wide = mat(rng, d_o, n + 1);
    t.probe(tgt, "h d_o x (n+1)", Expect::Err(&["h"]), &mut o, s, |o| {
        o.step(&h_wide, &v)
    });
    let v2 = mat(rng, d_o, 2);
    t.probe(
        tgt,
        "innovation d_o x 2",
        Expect::Err(&["innovation"]),
        &mut o,
        s,
        |o| o.step(&h, &v2),
    );
    let (hb, hd) = poisoned(rng, d_o, n);
    t.probe(
        tgt,
        &format!("h holds {hd}"),
        Expect::Err(&["h"]),
        &mut o,
        s,
        |o| o.step(&hb, &v),
    );
    let (vb, vd) = poisoned(rng, d_o, 1);
    t.probe(
        tgt,
        &format!("innovation holds {vd}"),
        Expect::Err(&["innovation"]),
        &mut o,
        s,
        |o| o.step(&h, &vb),
    );
    let h_huge = filled(d_o, n, HUGE);
    t.probe(tgt, "h = 1e30", Expect::ErrOrFinite, &mut o, s, |o| {
        o.step(&h_huge, &v)
    });

    let mut none = ();
    let s0 = |_: &()| snap_mats(&[]);
    let k = cfg.kalman;
    t.probe_configs(
        ("RKalman::set_config", "RKalman::new"),
        &[
            (&["sigma0"][..], RKalmanConfig { sigma0: 0.0, ..cfg }),
            (
                &["beta"][..],
                RKalmanConfig {
                    kalman: KalmanOptions { beta: -0.1, ..k },
                    ..cfg
                },
            ),
            (
                &["rho"][..],
                RKalmanConfig {
                    kalman: KalmanOptions { rho: f32::NAN, ..k },
                    ..cfg
                },
            ),
            (
                &["jitter"][..],
                RKalmanConfig {
                    kalman: KalmanOptions { jitter: 0.0, ..k },
                    ..cfg
                },
            ),
        ],
        &mut o,
        s,
        |o, c| o.set_config(c),
        |c| RKalman::new(&DEV, &mu0, d_o, c).map(|_| ()),
    );
    t.probe(
        "RKalman::new",
        "d_o = 0",
        Expect::Err(&["d_o"]),
        &mut none,
        s0,
        |_| RKalman::new(&DEV, &mu0, 0, cfg).map(|_| ()),
    );

    let tgt = "RKalman::restore";
    let good = o.state().unwrap();
    let mut sigma = good.sigma.clone();
    let i = rng.random_range(0..n);
    sigma[i] = 0.0;
    let st = RKalmanState {
        sigma,
        ..good.clone()
    };
    t.probe(
        tgt,
        &format!("sigma[{i}] = 0"),
        Expect::Err(&["sigma"]),
        &mut o,
        s,
        |o| o.restore(&st),
    );
    let mut mu = good.mu.clone();
    let md = poison(rng, &mut mu);
    let st = RKalmanState { mu, ..good.clone() };
    t.probe(
        tgt,
        &format!("mu holds {md}"),
        Expect::Err(&["mu"]),
        &mut o,
        s,
        |o| o.restore(&st),
    );
    let st = RKalmanState {
        r: vec![0.0; d_o * d_o + 1],
        ..good.clone()
    };
    t.probe(
        tgt,
        "r length d_o²+1",
        Expect::Err(&["r"]),
        &mut o,
        s,
        |o| o.restore(&st),
    );
    let st = RKalmanState {
        r: non_spd(rng, d_o),
        ..good.clone()
    };
    t.probe(
        tgt,
        "r not positive semidefinite",
        Expect::Err(&["r"]),
        &mut o,
        s,
        |o| o.restore(&st),
    );
}

/// Statistics for `shapes` with `m` rows, on the CPU.
fn stats(rng: &mut ChaCha8Rng, shapes: &[(usize, usize)], m: usize) -> Vec<(Matrix, Matrix)> {
    shapes
        .iter()
        .map(|&(o, i)| (mat(rng, m, i), mat(rng, m, o)))
        .collect()
}

fn kron_optimizer(t: &mut Tally, rng: &mut ChaCha8Rng, shapes: &[(usize, usize)], variant: usize) {
    let cfg = [KronConfig::ring(), KronConfig::reng(), KronConfig::ngd()][variant];
    let m = 8;
    let mut params: Vec<Matrix> = shapes.iter().map(|&(o, i)| mat(rng, o, i)).collect();
    let grads: Vec<Matrix> = shapes.iter().map(|&(o, i)| mat(rng, o, i)).collect();
    let g: Vec<&Matrix> = grads.iter().collect();
    let mut opt = KronOptimizer::new(&DEV, shapes, cfg).unwrap();
    // Two valid steps: factors and inverses exist, a prediction is pending.
    for _ in 0..2 {
        let st = stats(rng, shapes, m);
        let ks: Vec<KronStats<'_>> = st.iter().map(|(a, e)| KronStats { a, e }).collect();
        let ks = opt.needs_stats().then_some(ks);
        opt.step(&mut params, &g, ks.as_deref()).unwrap();
    }
    let mut o = (opt, params);
    let s = |o: &(KronOptimizer, Vec<Matrix>)| {
        let refs: Vec<&Matrix> = o.1.iter().collect();
        snap_ck(&o.0, &refs)
    };
    let st_ok = stats(rng, shapes, m);
    let ks_ok: Vec<KronStats<'_>> = st_ok.iter().map(|(a, e)| KronStats { a, e }).collect();
    let l = rng.random_range(0..shapes.len());
    let (o_l, i_l) = shapes[l];

    for tgt in ["KronOptimizer::step", "KronOptimizer::precondition"] {
        let run = |o: &mut (KronOptimizer, Vec<Matrix>),
                   g: &[&Matrix],
                   ks: Option<&[KronStats<'_>]>|
         -> Result<()> {
            if tgt == "KronOptimizer::step" {
                o.0.step(&mut o.1, g, ks).map(|_| ())
            } else {
                o.0.precondition(g, ks).map(|_| ())
            }
        };
        t.probe(
            tgt,
            "one gradient missing",
            Expect::Err(&["grads"]),
            &mut o,
            s,
            |o| run(o, &g[1..], Some(&ks_ok)),
        );
        let wrong = mat(rng, o_l + 1, i_l);
        let mut gw = g.clone();
        gw[l] = &wrong;
        t.probe(
            tgt,
            &format!("grads[{l}] one row longer"),
            Expect::Err(&["grads"]),
            &mut o,
            s,
            |o| run(o, &gw, Some(&ks_ok)),
        );
        let (bad, bd) = poisoned(rng, o_l, i_l);
        let mut gb = g.clone();
        gb[l] = &bad;
        t.probe(
            tgt,
            &format!("grads[{l}] holds {bd}"),
            Expect::Err(&["grads", "g"]),
            &mut o,
            s,
            |o| run(o, &gb, Some(&ks_ok)),
        );
        t.probe(
            tgt,
            "stats for one layer too few",
            Expect::Err(&["stats"]),
            &mut o,
            s,
            |o| run(o, &g, Some(&ks_ok[1..])),
        );
        let a_wrong = mat(rng, m, i_l + 1);
        let mut kw = ks_ok.clone();
        kw[l].a = &a_wrong;
        t.probe(
            tgt,
            &format!("stats[{l}].a has d_in+1 columns"),
            Expect::Err(&["stats.a"]),
            &mut o,
            s,
            |o| run(o, &g, Some(&kw)),
        );
        let a_empty = DEV.zeros::<f32>(0, i_l).unwrap();
        let e_empty = DEV.zeros::<f32>(0, o_l).unwrap();
        let mut ke = ks_ok.clone();
        ke[l] = KronStats {
            a: &a_empty,
            e: &e_empty,
        };
        t.probe(
            tgt,
            &format!("stats[{l}] with 0 rows (empty batch)"),
            Expect::Err(&["stats.a", "stats.e", "a"]),
            &mut o,
            s,
            |o| run(o, &g, Some(&ke)),
        );
        let (ab, ad) = poisoned(rng, m, i_l);
        let mut kb = ks_ok.clone();
        kb[l].a = &ab;
        t.probe(
            tgt,
            &format!("stats[{l}].a holds {ad}"),
            Expect::Err(&["a", "stats.a"]),
            &mut o,
            s,
            |o| run(o, &g, Some(&kb)),
        );
        let (eb, ed) = poisoned(rng, m, o_l);
        let mut kb = ks_ok.clone();
        kb[l].e = &eb;
        t.probe(
            tgt,
            &format!("stats[{l}].e holds {ed}"),
            Expect::Err(&["a", "e", "stats.e"]),
            &mut o,
            s,
            |o| run(o, &g, Some(&kb)),
        );
        let huge: Vec<Matrix> = shapes.iter().map(|&(o, i)| filled(o, i, HUGE)).collect();
        let gh: Vec<&Matrix> = huge.iter().collect();
        t.probe(tgt, "grads = 1e30", Expect::ErrOrFinite, &mut o, s, |o| {
            run(o, &gh, Some(&ks_ok))
        });
        let st_h: Vec<(Matrix, Matrix)> = shapes
            .iter()
            .map(|&(o, i)| (filled(m, i, HUGE), filled(m, o, 1.0)))
            .collect();
        let kh: Vec<KronStats<'_>> = st_h.iter().map(|(a, e)| KronStats { a, e }).collect();
        t.probe(
            tgt,
            "stats.a = 1e30 (AᵀA overflows)",
            Expect::ErrOrFinite,
            &mut o,
            s,
            |o| run(o, &g, Some(&kh)),
        );
    }
    // Missing statistics on a refresh step (a fresh optimizer always needs them).
    let mut fresh = (
        KronOptimizer::new(&DEV, shapes, cfg).unwrap(),
        o.1.iter()
            .map(|p| p.try_clone().unwrap())
            .collect::<Vec<_>>(),
    );
    t.probe(
        "KronOptimizer::step",
        "no stats on a refresh step",
        Expect::Err(&["stats"]),
        &mut fresh,
        s,
        |o| o.0.step(&mut o.1, &g, None).map(|_| ()),
    );
    let (pb, pd) = poisoned(rng, o_l, i_l);
    let mut with_bad_param = (
        KronOptimizer::new(&DEV, shapes, cfg).unwrap(),
        o.1.iter()
            .map(|p| p.try_clone().unwrap())
            .collect::<Vec<_>>(),
    );
    with_bad_param.1[l] = pb;
    t.probe(
        "KronOptimizer::step",
        &format!("params[{l}] holds {pd}"),
        Expect::Err(&["x", "params"]),
        &mut with_bad_param,
        s,
        |o| o.0.step(&mut o.1, &g, Some(&ks_ok)).map(|_| ()),
    );

    let tgt = "KronOptimizer::observe_loss";
    // A valid step first, so a prediction is pending.
    let ks_now = o.0.needs_stats().then_some(&ks_ok[..]);
    o.0.step(&mut o.1, &g, ks_now).unwrap();
    let b = bad_scalar(rng);
    t.probe(
        tgt,
        &format!("before = {b}"),
        Expect::Err(&["before"]),
        &mut o,
        s,
        |o| o.0.observe_loss(b, 0.5),
    );
    let mut no_pending = (KronOptimizer::new(&DEV, shapes, cfg).unwrap(), Vec::new());
    t.probe(
        tgt,
        "no step to observe",
        Expect::Err(&["predicted change"]),
        &mut no_pending,
        s,
        |o| o.0.observe_loss(1.0, 0.5),
    );

    let tgt = "KronOptimizer::restore";
    let base = || o.0.state().unwrap();
    let mut cases: Vec<(
        String,
        &'static [&'static str],
        grng::optim::kron::KronState,
    )> = Vec::new();
    let mut st = base();
    st.rho = [-1.0, f32::NAN, 10.0][rng.random_range(0..3)];
    cases.push((format!("rho = {}", st.rho), &["rho"], st));
    let mut st = base();
    st.layers[l].gamma.damping = 0.0;
    cases.push((format!("layer {l} gamma damping 0"), &["damping"], st));
    let mut st = base();
    st.layers[l].lambda.factor = mat(rng, i_l + 1, i_l + 1);
    cases.push((
        format!("layer {l} lambda factor (d_in+1)²"),
        &["factor"],
        st,
    ));
    let mut st = base();
    let (fb, fd) = poisoned(rng, o_l, o_l);
    st.layers[l].gamma.inverse = fb;
    cases.push((
        format!("layer {l} gamma inverse holds {fd}"),
        &["x", "inverse"],
        st,
    ));
    let mut st = base();
    st.layers.pop();
    if !st.layers.is_empty() {
        cases.push(("one layer missing".into(), &["layers"], st));
    }
    let mut st = base();
    st.layers[l].lambda.factor = DEV.upload(i_l, i_l, &non_spd(rng, i_l)).unwrap();
    cases.push((
        format!("layer {l} lambda factor not positive definite"),
        &["factor"],
        st,
    ));
    let mut st = base();
    st.layers[l].lambda.inverse = DEV.upload(i_l, i_l, &non_spd(rng, i_l)).unwrap();
    cases.push((
        format!("layer {l} lambda inverse not positive definite"),
        &["inverse"],
        st,
    ));
    for (input, args, st) in cases {
        t.probe(tgt, &input, Expect::Err(args), &mut o, s, move |o| {
            o.0.restore(st)
        });
    }

    let tgt = "KronOptimizer::new";
    let mut none = ();
    let s0 = |_: &()| snap_mats(&[]);
    let bad_cfgs: [(&'static [&'static str], KronConfig); 10] = [
        (&["lr"], KronConfig { lr: 0.0, ..cfg }),
        (
            &["lr"],
            KronConfig {
                lr: f32::NAN,
                ..cfg
            },
        ),
        (
            &["rho_min"],
            KronConfig {
                rho_min: -1.0,
                ..cfg
            },
        ),
        (
            &["rho_max"],
            KronConfig {
                rho_max: 1e-9,
                ..cfg
            },
        ),
        (&["rho"], KronConfig { rho: 1.0, ..cfg }),
        (&["phi"], KronConfig { phi: 1.5, ..cfg }),
        (&["skip"], KronConfig { skip: 0, ..cfg }),
        (&["ema"], KronConfig { ema: 1.0, ..cfg }),
        (
            &["grad_reg"],
            KronConfig {
                grad_reg: -0.01,
                ..cfg
            },
        ),
        (
            &["damping_floor"],
            KronConfig {
                damping_floor: f32::NEG_INFINITY,
                ..cfg
            },
        ),
    ];
    for (args, c) in bad_cfgs {
        t.probe(
            tgt,
            &format!("{c:?}"),
            Expect::Err(args),
            &mut none,
            s0,
            |_| KronOptimizer::new(&DEV, shapes, c).map(|_| ()),
        );
    }
    t.probe(
        tgt,
        "no layers",
        Expect::Err(&["layers"]),
        &mut none,
        s0,
        |_| KronOptimizer::new(&DEV, &[], cfg).map(|_| ()),
    );
    t.probe(
        tgt,
        "a layer with d_in = 0",
        Expect::Err(&["layers"]),
        &mut none,
        s0,
        |_| KronOptimizer::new(&DEV, &[(3, 0)], cfg).map(|_| ()),
    );
}

// ---------------------------------------------------------------------------------------------
// The run.

/// Runs every family `cases` times on `device` (fresh random sizes and values each run), prints
/// the counts and fails on any panic or violation.
fn on_device(device: Device, cases: u32) {
    // Leaked once per test (a few bytes) so `DEV` can hand out a `'static` reference.
    let device: &'static Device = Box::leak(Box::new(device));
    CURRENT.set(Some(device));
    let tally = RefCell::new(Tally::default());
    let mut runner = TestRunner::new(common::proptest_config(cases));
    let sizes = (any::<u64>(), 1usize..9, 1usize..9, 1usize..9, 0usize..3);
    let result = runner.run(&sizes, |(seed, a, b, c, v)| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let t = &mut *tally.borrow_mut();
        elementwise_ops(t, &mut rng, a * b);
        dense_ops(t, &mut rng, a, b, c);
        inverse_ops(t, &mut rng, a + 1);
        kalman_ops(t, &mut rng, a * b, c);
        flat_optimizers(t, &mut rng, a * c);
        kalman_optimizer(t, &mut rng, a + b, c);
        let shapes = if c % 2 == 0 {
            vec![(b, a + 1)]
        } else {
            vec![(c, a + 1), (b, c + 1)]
        };
        kron_optimizer(t, &mut rng, &shapes, v);
        Ok(())
    });
    result.unwrap();
    let t = tally.into_inner();
    let name = device.name();
    eprintln!("bad input on {name}, per target: tried / errors / finite results");
    for (target, [n, e, f]) in &t.per_target {
        eprintln!("  {target:<32} {n:>6} {e:>6} {f:>6}");
    }
    eprintln!(
        "bad input total on {name}: {} inputs tried, {} errors returned, {} huge inputs with finite results, {} panics, {} violations",
        t.tried,
        t.errors,
        t.finite_ok,
        t.panics,
        t.violations.len()
    );
    // One line per (target, kind of input, outcome), with how often and one example.
    let mut groups: BTreeMap<String, (usize, &String)> = BTreeMap::new();
    for v in &t.violations {
        let mut key = String::new();
        for c in v.replace("NaN", "#").replace("inf", "#").chars() {
            let c = if c.is_ascii_digit() || c == '-' {
                '#'
            } else {
                c
            };
            if !(c == '#' && key.ends_with('#')) {
                key.push(c);
            }
        }
        groups.entry(key).or_insert((0, v)).0 += 1;
    }
    for (count, example) in groups.values() {
        eprintln!("VIOLATION x{count}: {example}");
    }
    assert_eq!(t.panics, 0);
    assert!(t.violations.is_empty(), "{} violations", t.violations.len());
}

#[test]
fn bad_inputs_error_without_panic_and_leave_state_unchanged_on_cpu() {
    on_device(Device::Cpu, 48);
}

/// The kernels run by the emulator (the GPU launch code, status read-backs included), and by a
/// GPU when one is present, must reject exactly what the CPU rejects; fewer cases, as emulation
/// is slow.
#[test]
fn bad_inputs_error_without_panic_and_leave_state_unchanged_on_kernel_devices() {
    for device in common::devices() {
        on_device(device, 16);
    }
}
