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
//! Most probes are rows of tables (description, expectation, bad value) run through one call
//! per target, so a probe is one line; the three flat optimizers share one family ([`Flat`]).
//!
//! One test per device (the CPU, and the emulated kernels, whose launch code is the GPU's) runs
//! every family under a proptest runner (fresh random sizes and values per case) and prints
//! the counts; violations are listed with file, function and input, then fail it.

use grng_testkit as common;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};

use grng::checkpoint::{Checkpoint, Value, Writer};
use grng::ops::elementwise::{AdamWCoeffs, SgdCoeffs, SophiaCoeffs};
use grng::ops::kalman::{KalmanOptions, KalmanState};
use grng::ops::newton::NewtonOptions;
use grng::ops::norm::PowerOptions;
use grng::optim::adamw::{AdamW, AdamWConfig, AdamWState, LrSchedule::Cosine};
use grng::optim::kalman::{RKalman, RKalmanConfig};
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

/// The snapshot of a call with no mutable operand.
fn no_operand(_: &()) -> Snap {
    snap_mats(&[])
}

/// The arguments an error must name: any one of these, comma-separated (empty: any error).
type Args = &'static str;

#[derive(Clone, Copy)]
enum Expect {
    /// Strictly invalid: an error naming one of these arguments.
    Err(Args),
    /// Huge but finite: an error, or finite results.
    ErrOrFinite,
}

/// One row of a table of bad inputs: its description, what the call must do, the value.
type Row<X> = (String, Expect, X);

/// A strictly invalid input `x`, whose error must name one of `args`.
fn err<X>(input: impl Into<String>, args: Args, x: X) -> Row<X> {
    (input.into(), Expect::Err(args), x)
}

/// A huge-but-finite input `x`.
fn huge<X>(input: impl Into<String>, x: X) -> Row<X> {
    (input.into(), Expect::ErrOrFinite, x)
}

/// `base` changed by `edit`.
fn edited<S>(mut base: S, edit: impl FnOnce(&mut S)) -> S {
    edit(&mut base);
    base
}

/// A rejected config (or set of coefficients): `base` changed by `edit`, described by its
/// `Debug` form; its error must name one of `args`.
fn bad<C: Debug>(args: Args, base: C, edit: impl FnOnce(&mut C)) -> Row<C> {
    let c = edited(base, edit);
    (format!("{c:?}"), Expect::Err(args), c)
}

/// [`bad`] rows that each set one field of `base`, whose error must name that field:
/// `bad_fields!(cfg; lr = -1.0, eps = 0.0)`.
macro_rules! bad_fields {
    ($base:expr; $($field:ident = $v:expr),+ $(,)?) => {
        [$(bad(stringify!($field), $base, |c| c.$field = $v)),+]
    };
}

#[derive(Default)]
struct Tally {
    tried: usize,
    errors: usize,
    finite_ok: usize,
    panics: usize,
    /// Per target: [tried, errors, finite results].
    per_target: BTreeMap<String, [usize; 3]>,
    violations: Vec<String>,
}

impl Tally {
    /// Runs `call` on `obj` with `snap` before and after (see the module docs).
    fn probe<O: ?Sized, T: Outputs>(
        &mut self,
        target: &str,
        input: &str,
        expect: Expect,
        obj: &mut O,
        snap: impl Fn(&O) -> Snap,
        call: impl FnOnce(&mut O) -> Result<T>,
    ) {
        self.tried += 1;
        let counts = self.per_target.entry(target.to_owned()).or_default();
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
                    if !args.is_empty() && !args.split(", ").any(|a| names(&msg).contains(&a)) {
                        violation(format!("error does not name any of `{args}`: `{msg}`"));
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

    /// The probes of `target`, whose mutable operands `snap` snapshots.
    fn on<S>(&mut self, target: impl Into<String>, snap: S) -> On<'_, S> {
        On {
            t: self,
            target: target.into(),
            snap,
        }
    }

    /// The probes of `target`, which has no mutable operand.
    fn pure(&mut self, target: impl Into<String>) -> Pure<'_> {
        Pure(self.on(target, no_operand as fn(&()) -> Snap))
    }

    /// Each rejected config must fail both through `set` on the live `obj`
    /// (`{name}::set_config`) and through `new` from scratch (`{name}::new`).
    fn configs<O, C: Copy>(
        &mut self,
        name: &str,
        rows: impl IntoIterator<Item = Row<C>>,
        obj: &mut O,
        snap: impl Fn(&O) -> Snap,
        set: impl Fn(&mut O, C) -> Result<()>,
        new: impl Fn(C) -> Result<()>,
    ) {
        let (set_target, new_target) = (format!("{name}::set_config"), format!("{name}::new"));
        for (input, expect, c) in rows {
            self.probe(&set_target, &input, expect, obj, &snap, |o| set(o, c));
            self.probe(&new_target, &input, expect, &mut (), no_operand, |_| new(c));
        }
    }
}

/// The probes of one target (see [`Tally::probe`]); `snap` snapshots its mutable operands.
struct On<'t, S> {
    t: &'t mut Tally,
    target: String,
    snap: S,
}

impl<S> On<'_, S> {
    fn probe<O: ?Sized, T: Outputs>(
        &mut self,
        input: &str,
        expect: Expect,
        obj: &mut O,
        call: impl FnOnce(&mut O) -> Result<T>,
    ) where
        S: Fn(&O) -> Snap,
    {
        self.t
            .probe(&self.target, input, expect, obj, &self.snap, call);
    }

    /// A strictly invalid input: `call` on `obj` must fail naming one of `args`.
    fn err<O: ?Sized, T: Outputs>(
        &mut self,
        input: impl AsRef<str>,
        args: Args,
        obj: &mut O,
        call: impl FnOnce(&mut O) -> Result<T>,
    ) where
        S: Fn(&O) -> Snap,
    {
        self.probe(input.as_ref(), Expect::Err(args), obj, call);
    }

    /// A huge-but-finite input: `call` on `obj` must fail or give finite results.
    fn huge<O: ?Sized, T: Outputs>(
        &mut self,
        input: &str,
        obj: &mut O,
        call: impl FnOnce(&mut O) -> Result<T>,
    ) where
        S: Fn(&O) -> Snap,
    {
        self.probe(input, Expect::ErrOrFinite, obj, call);
    }

    /// Each row's value `x` as `call(obj, x)`.
    fn rows<O: ?Sized, X, T: Outputs>(
        &mut self,
        obj: &mut O,
        rows: impl IntoIterator<Item = Row<X>>,
        call: impl Fn(&mut O, X) -> Result<T>,
    ) where
        S: Fn(&O) -> Snap,
    {
        for (input, expect, x) in rows {
            self.probe(&input, expect, obj, |o| call(o, x));
        }
    }
}

/// [`On`] for a target with no mutable operand: nothing to keep unchanged.
struct Pure<'t>(On<'t, fn(&()) -> Snap>);

impl Pure<'_> {
    fn err<T: Outputs>(
        &mut self,
        input: impl AsRef<str>,
        args: Args,
        call: impl FnOnce() -> Result<T>,
    ) {
        self.0.err(input, args, &mut (), |_| call());
    }

    fn huge<T: Outputs>(&mut self, input: &str, call: impl FnOnce() -> Result<T>) {
        self.0.huge(input, &mut (), |_| call());
    }

    fn rows<X, T: Outputs>(
        &mut self,
        rows: impl IntoIterator<Item = Row<X>>,
        call: impl Fn(X) -> Result<T>,
    ) {
        self.0.rows(&mut (), rows, |_, x| call(x));
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

/// `v` with entry `l` replaced by `x`.
fn replaced<T: Copy>(v: &[T], l: usize, x: T) -> Vec<T> {
    let mut v = v.to_vec();
    v[l] = x;
    v
}

// ---------------------------------------------------------------------------------------------
// Device ops. The tables keep one row a line (`rustfmt::skip`): they read as tables.

fn elementwise_ops(t: &mut Tally, rng: &mut ChaCha8Rng, n: usize) {
    let x = mat(rng, n, 1);
    let (xs, xd) = poisoned(rng, n, 1);
    let wrong = mat(rng, n + 1, 1);
    let x_huge = filled(n, 1, HUGE);
    let s1 = |m: &Matrix| snap_mats(&[m]);
    let mut y = mat(rng, n, 1);

    // `axpy` writes `y` in place and `axpy_new` a new matrix; `y` must stay unchanged on error
    // either way, so both get the same probes.
    type Axpy = fn(f32, &Matrix, &mut Matrix) -> Result<()>;
    let axpys: [(&str, Axpy); 2] = [
        ("Device::axpy", |a, x, y| DEV.axpy(a, x, y)),
        ("Device::axpy_new", |a, x, y| {
            DEV.axpy_new(a, x, y).map(drop)
        }),
    ];
    for (target, op) in axpys {
        let mut p = t.on(target, s1);
        p.err("x one row longer", "x", &mut y, |y| op(0.5, &wrong, y));
        p.err(format!("x holds {xd}"), "x", &mut y, |y| op(0.5, &xs, y));
        let a = bad_scalar(rng);
        p.err(format!("alpha = {a}"), "alpha", &mut y, |y| op(a, &x, y));
        let (mut ys, yd) = poisoned(rng, n, 1);
        p.err(format!("y holds {yd}"), "y", &mut ys, |y| op(0.5, &x, y));
        let input = "alpha = 1e30, x = y = 1e30";
        p.huge(input, &mut filled(n, 1, HUGE), |y| op(HUGE, &x_huge, y));
    }

    let mut p = t.on("Device::scale", s1);
    let a = bad_scalar(rng);
    p.err(format!("alpha = {a}"), "alpha", &mut y, |y| DEV.scale(a, y));
    let (mut ys, yd) = poisoned(rng, n, 1);
    p.err(format!("x holds {yd}"), "x", &mut ys, |y| DEV.scale(2.0, y));
    let input = "alpha = 1e30, x = 1e30";
    p.huge(input, &mut filled(n, 1, HUGE), |y| DEV.scale(HUGE, y));

    let mut q = t.pure("Device::dot");
    q.err("y one row longer", "y", || DEV.dot(&x, &wrong));
    q.err(format!("x holds {xd}"), "x", || DEV.dot(&xs, &x));
    q.huge("x = y = 1e30", || DEV.dot(&x_huge, &x_huge));

    let mut q = t.pure("Device::norm2");
    q.err(format!("x holds {xd}"), "x", || DEV.norm2(&xs));
    let big = filled(n, 1, 3e38);
    q.huge("x = 3e38", || DEV.norm2(&big));

    let mut p = t.on("Device::copy", s1);
    p.err("src one row longer", "src", &mut y, |y| DEV.copy(&wrong, y));

    // Fused updates: operands (params, buffers) snapshotted together. SGD and AdamW take the
    // same bad gradients.
    let s2 = |v: &(Matrix, Matrix)| snap_mats(&[&v.0, &v.1]);
    let s3 = |v: &(Matrix, Matrix, Matrix)| snap_mats(&[&v.0, &v.1, &v.2]);
    let bad_grads = [
        err("grad one row longer", "grad", &wrong),
        err(format!("grad holds {xd}"), "grad", &xs),
    ];

    let mut p = t.on("Device::sgd_update", s2);
    let up = |(p, m): &mut (Matrix, Matrix), g: &Matrix, c: SgdCoeffs| DEV.sgd_update(p, g, m, &c);
    let sgd = SgdCoeffs {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.01,
    };
    let mut pm = (mat(rng, n, 1), mat(rng, n, 1));
    let lr = bad_scalar(rng);
    let coeffs = bad_fields!(sgd; lr = -0.1, lr = lr, momentum = 1.0, momentum = -0.5,
        weight_decay = -1.0, weight_decay = f32::NAN);
    p.rows(&mut pm, coeffs, |o, c| up(o, &x, c));
    p.rows(&mut pm, bad_grads.clone(), |o, g| up(o, g, sgd));
    // Operands of their own: (params, momentum_buf), each stepped with `x`.
    let (ps, pd) = poisoned(rng, n, 1);
    let mut pm_bad = (ps, mat(rng, n, 1));
    p.err(format!("params holds {pd}"), "params", &mut pm_bad, |o| {
        up(o, &x, sgd)
    });
    let (ms, md) = poisoned(rng, n, 1);
    let mut pm_bad = (mat(rng, n, 1), ms);
    let input = format!("momentum_buf holds {md}");
    p.err(input, "momentum_buf", &mut pm_bad, |o| up(o, &x, sgd));
    let mut pm_wrong = (mat(rng, n, 1), mat(rng, n + 1, 1));
    let input = "momentum_buf one row longer";
    p.err(input, "momentum_buf", &mut pm_wrong, |o| up(o, &x, sgd));
    let mut pm_huge = (filled(n, 1, HUGE), filled(n, 1, HUGE));
    let big_lr = SgdCoeffs { lr: HUGE, ..sgd };
    let input = "lr = params = grad = momentum = 1e30";
    p.huge(input, &mut pm_huge, |o| up(o, &x_huge, big_lr));

    let mut p = t.on("Device::adamw_update", s3);
    let up = |(p, m, v): &mut (Matrix, Matrix, Matrix), g: &Matrix, c: AdamWCoeffs| {
        DEV.adamw_update(p, g, m, v, &c)
    };
    let adam = common::ADAMW;
    let mut pmv = (mat(rng, n, 1), mat(rng, n, 1), filled(n, 1, 0.5));
    let coeffs = bad_fields!(adam; lr = -1.0, beta1 = 1.0, beta2 = f32::NAN, beta2 = -0.1,
        eps = 0.0, eps = f32::INFINITY, weight_decay = -0.5, step = 0);
    p.rows(&mut pmv, coeffs, |o, c| up(o, &x, c));
    p.rows(&mut pmv, bad_grads, |o, g| up(o, g, adam));
    // Non-negative but for one entry: a corrupt second moment here, a corrupt Hessian below.
    let mut neg_v = vals(rng, n, 1.0);
    neg_v.iter_mut().for_each(|v| *v = v.abs());
    let k = rng.random_range(0..n);
    neg_v[k] = -0.25;
    let neg = DEV.upload(n, 1, &neg_v).unwrap();
    let mut pmv_neg = (mat(rng, n, 1), mat(rng, n, 1), neg.try_clone().unwrap());
    p.err(format!("v[{k}] = -0.25"), "v", &mut pmv_neg, |o| {
        up(o, &x, adam)
    });
    let mut pmv_huge = (mat(rng, n, 1), mat(rng, n, 1), filled(n, 1, 0.5));
    let input = "grad = 1e30 (g² overflows f32)";
    p.huge(input, &mut pmv_huge, |o| up(o, &x_huge, adam));

    let mut p = t.on("Device::sophia_update", s2);
    let up = |(p, m): &mut (Matrix, Matrix), g: &Matrix, h: &Matrix, c: SophiaCoeffs| {
        DEV.sophia_update(p, g, m, h, &c)
    };
    let soph = SophiaCoeffs {
        lr: 1e-3,
        beta1: 0.96,
        gamma: 0.01,
        eps: 1e-12,
        weight_decay: 0.1,
    };
    let h_ok = filled(n, 1, 0.5);
    let mut pm2 = (mat(rng, n, 1), mat(rng, n, 1));
    let coeffs = bad_fields!(soph; lr = f32::NAN, beta1 = 1.5, gamma = 0.0, gamma = -1.0,
        eps = -1e-12, weight_decay = f32::INFINITY);
    p.rows(&mut pm2, coeffs, |o, c| up(o, &x, &h_ok, c));
    // (grad, h).
    let rows = [
        err(format!("h[{k}] = -0.25"), "h", (&x, &neg)),
        err(format!("h holds {xd}"), "h", (&x, &xs)),
        err("h one row longer", "h", (&x, &wrong)),
        err(format!("grad holds {xd}"), "grad", (&xs, &h_ok)),
    ];
    p.rows(&mut pm2, rows, |o, (g, h)| up(o, g, h, soph));
    let mut pm2_huge = (filled(n, 1, HUGE), filled(n, 1, HUGE));
    let big = SophiaCoeffs {
        lr: HUGE,
        weight_decay: HUGE,
        ..soph
    };
    let input = "lr = weight_decay = params = 1e30";
    p.huge(input, &mut pm2_huge, |o| up(o, &x_huge, &h_ok, big));

    let mut p = t.on("Device::sophia_hessian_ema", s1);
    let ema = |h: &mut Matrix, (g, beta2, batch): (&Matrix, f32, usize)| {
        DEV.sophia_hessian_ema(h, g, beta2, batch)
    };
    let mut h = filled(n, 1, 0.5);
    let b2 = [1.0, -0.1, f32::NAN][rng.random_range(0..3)];
    // (sampled_grad, beta2, batch).
    #[rustfmt::skip]
    let rows = [
        err("batch = 0", "batch", (&x, 0.98, 0)),
        err(format!("beta2 = {b2}"), "beta2", (&x, b2, 4)),
        err(format!("sampled_grad holds {xd}"), "sampled_grad", (&xs, 0.98, 4)),
        err("sampled_grad one row longer", "sampled_grad", (&wrong, 0.98, 4)),
        huge("sampled_grad = 1e30 (B·g² overflows f32)", (&x_huge, 0.98, 4)),
    ];
    p.rows(&mut h, rows, ema);
    let mut h_neg = neg;
    p.err(format!("h[{k}] = -0.25"), "h", &mut h_neg, |h| {
        ema(h, (&x, 0.98, 4))
    });
}

fn dense_ops(t: &mut Tally, rng: &mut ChaCha8Rng, m: usize, k: usize, n: usize) {
    let s1 = |c: &Matrix| snap_mats(&[c]);
    let a = mat(rng, m, k);
    let b = mat(rng, k, n);
    let mut c = mat(rng, m, n);

    let b_wrong = mat(rng, k + 1, n);
    let (r2, c2) = other_shape(rng, m, n);
    let mut c_wrong = mat(rng, r2, c2);
    let al = bad_scalar(rng);
    let (a_bad, ad) = poisoned(rng, m, k);
    let (b_bad, bd) = poisoned(rng, k, n);
    // The same values read as an n x k `b`, used transposed.
    let bt_bad = DEV.upload(n, k, &b_bad.to_vec().unwrap()).unwrap();
    let (mut c_bad, cd) = poisoned(rng, m, n);
    let (ha, hb) = (filled(m, k, HUGE), filled(k, n, HUGE));
    let no = Trans::No;
    // (whether b is transposed, alpha, a, b, beta).
    #[rustfmt::skip]
    let rows = [
        err("b has k+1 rows", "b", (no, 1.0, &a, &b_wrong, 0.0)),
        err(format!("alpha = {al}"), "alpha", (no, al, &a, &b, 0.0)),
        err(format!("beta = {al}"), "beta", (no, 1.0, &a, &b, al)),
        err(format!("a holds {ad}"), "a", (no, 1.0, &a_bad, &b, 0.0)),
        err(format!("b holds {bd}"), "b", (Trans::Yes, 1.0, &a, &bt_bad, 0.0)),
        huge("a = b = 1e30", (no, 1.0, &ha, &hb, 0.0)),
    ];
    let gemm = |c: &mut Matrix, (tb, al, a, b, be): (Trans, f32, &Matrix, &Matrix, f32)| {
        DEV.gemm(Trans::No, tb, al, a, b, be, c)
    };
    let mut p = t.on("Device::gemm", s1);
    p.rows(&mut c, rows, gemm);
    let input = format!("c is {r2}x{c2}");
    p.err(input, "c", &mut c_wrong, |c| {
        gemm(c, (no, 1.0, &a, &b, 0.0))
    });
    let input = format!("c holds {cd}, beta = 0.5");
    p.err(input, "c", &mut c_bad, |c| gemm(c, (no, 1.0, &a, &b, 0.5)));

    // Kronecker factors: A is m x k, factor k x k.
    let mut f = DEV.upload(k, k, &spd(rng, k)).unwrap();
    let empty = DEV.zeros::<f32>(0, k).unwrap();
    let e = [1.0, -0.1, f32::NAN, f32::INFINITY][rng.random_range(0..4)];
    let mut f_wrong = mat(rng, k + 1, k + 1);
    let (mut f_bad, fd) = poisoned(rng, k, k);
    // (a, eps).
    let rows = [
        err("a has 0 rows (empty batch)", "a", (&empty, 0.0)),
        err(format!("eps = {e}"), "eps", (&a, e)),
        err(format!("a holds {ad}"), "a", (&a_bad, 0.5)),
        huge("a = 1e30 (AᵀA overflows)", (&ha, 0.0)),
    ];
    let mut p = t.on("Device::syrk_ema", s1);
    p.rows(&mut f, rows, |f, (a, eps)| DEV.syrk_ema(a, eps, f));
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
    let rows = [
        err(format!("a (bf16) holds {ad}"), "a", to_bf16(&a_bad)),
        huge("a (bf16) = 1e30 (AᵀA overflows)", to_bf16(&ha)),
    ];
    p.rows(&mut f, rows, |f, a| DEV.syrk_ema(&a, 0.5, f));
    p.err("factor (k+1)x(k+1)", "factor", &mut f_wrong, |f| {
        DEV.syrk_ema(&a, 0.5, f)
    });
    let input = format!("factor holds {fd}, eps = 0.5");
    p.err(input, "factor", &mut f_bad, |f| DEV.syrk_ema(&a, 0.5, f));

    // Batch gradient: E is m x n, A is m x k, G is n x k.
    let e_ok = mat(rng, m, n);
    let mut g = mat(rng, n, k);
    let (e_empty, a_empty) = (
        DEV.zeros::<f32>(0, n).unwrap(),
        DEV.zeros::<f32>(0, k).unwrap(),
    );
    let a_rows = mat(rng, m + 1, k);
    let mut g_wrong = mat(rng, n + 1, k);
    let (e_bad, ed) = poisoned(rng, m, n);
    let he = filled(m, n, HUGE);
    // (e, a).
    let rows = [
        err("e, a have 0 rows (empty batch)", "e", (&e_empty, &a_empty)),
        err("a has m+1 rows", "a", (&e_ok, &a_rows)),
        err(format!("e holds {ed}"), "e", (&e_bad, &a)),
        err(format!("a holds {ad}"), "a", (&e_ok, &a_bad)),
        huge("e = a = 1e30", (&he, &ha)),
    ];
    let mut p = t.on("Device::batch_gradient", s1);
    p.rows(&mut g, rows, |g, (e, a)| DEV.batch_gradient(e, a, g));
    p.err("g (n+1)xk", "g", &mut g_wrong, |g| {
        DEV.batch_gradient(&e_ok, &a, g)
    });

    // Preconditioning: Γ⁻¹ n x n, G n x k, Λ⁻¹ k x k, P n x k.
    let gi = DEV.upload(n, n, &spd(rng, n)).unwrap();
    let li = DEV.upload(k, k, &spd(rng, k)).unwrap();
    let g_in = mat(rng, n, k);
    let mut pc = mat(rng, n, k);
    let gi_wrong = mat(rng, n + 1, n + 1);
    let li_wrong = mat(rng, k, k + 1);
    let mut pc_wrong = mat(rng, n, k + 1);
    let (g_bad, gd) = poisoned(rng, n, k);
    let (li_bad, lid) = poisoned(rng, k, k);
    let (hg, hgi) = (filled(n, k, HUGE), filled(n, n, HUGE));
    // (gamma_inv, g, lambda_inv).
    #[rustfmt::skip]
    let rows = [
        err("gamma_inv (n+1)x(n+1)", "gamma_inv", (&gi_wrong, &g_in, &li)),
        err("lambda_inv kx(k+1)", "lambda_inv", (&gi, &g_in, &li_wrong)),
        err(format!("g holds {gd}"), "g", (&gi, &g_bad, &li)),
        err(format!("lambda_inv holds {lid}"), "lambda_inv", (&gi, &g_in, &li_bad)),
        huge("gamma_inv = g = 1e30", (&hgi, &hg, &li)),
    ];
    let mut p = t.on("Device::precondition", s1);
    p.rows(&mut pc, rows, |pc, (gi, g, li)| {
        DEV.precondition(gi, g, li, pc)
    });
    p.err("p nx(k+1)", "p", &mut pc_wrong, |pc| {
        DEV.precondition(&gi, &g_in, &li, pc)
    });

    // The two in-place ops on a k x k matrix and a scalar get the same probes: (target, the
    // matrix's and the scalar's names, the op, the huge input: description, matrix, scalar).
    let mut x = DEV.upload(k, k, &spd(rng, k)).unwrap();
    let mut x_rect = mat(rng, k, k + 1);
    let dl = bad_scalar(rng);
    type SquareOp = fn(&mut Matrix, f32) -> Result<()>;
    #[rustfmt::skip]
    let ops: [(&str, Args, Args, SquareOp, &str, f32, f32); 2] = [
        ("Device::damped_inverse_update", "inv", "dlambda", |x, l| DEV.damped_inverse_update(x, l),
            "inv = 1e30 (X·X overflows)", HUGE, 0.01),
        ("Device::add_diagonal", "a", "lambda", |x, l| DEV.add_diagonal(x, l),
            "a = 3e38, lambda = 1e38 (diagonal overflows)", 3e38, 1e38),
    ];
    for (target, x_arg, l_arg, op, huge_input, huge_x, huge_l) in ops {
        let mut p = t.on(target, s1);
        p.err(format!("{x_arg} kx(k+1)"), x_arg, &mut x_rect, |x| {
            op(x, 0.01)
        });
        p.err(format!("{l_arg} = {dl}"), l_arg, &mut x, |x| op(x, dl));
        let (mut x_bad, xd) = poisoned(rng, k, k);
        p.err(format!("{x_arg} holds {xd}"), x_arg, &mut x_bad, |x| {
            op(x, 0.01)
        });
        p.huge(huge_input, &mut filled(k, k, huge_x), |x| op(x, huge_l));
    }
}

fn inverse_ops(t: &mut Tally, rng: &mut ChaCha8Rng, n: usize) {
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
    // The bad square matrices: the ops below each take the first few.
    let square = [
        err("a nx(n+1)", "a", &rect),
        err(format!("a holds {ad}"), "a", &a_bad),
        err("a not positive definite", "", &indef),
        huge("a = 1e30·I", &huge_spd),
    ];

    let mut q = t.pure("Device::newton_inverse");
    let opts = NewtonOptions::default();
    q.rows(square.clone(), |a| DEV.newton_inverse(a, None, &opts));
    let warm = mat(rng, n + 1, n + 1);
    q.err("warm (n+1)x(n+1)", "warm", || {
        DEV.newton_inverse(&a, Some(&warm), &opts)
    });
    let tol = [0.0, -1e-4, f32::NAN][rng.random_range(0..3)];
    #[rustfmt::skip]
    let rows = [
        err(format!("tol = {tol}"), "tol", NewtonOptions { tol, ..opts }),
        err("lambda_low = -1", "lambda_low", NewtonOptions { lambda_low: -1.0, ..opts }),
    ];
    q.rows(rows, |o| DEV.newton_inverse(&a, None, &o));
    let empty = DEV.zeros::<f32>(0, 0).unwrap();
    q.err("a is 0x0", "a", || DEV.newton_inverse(&empty, None, &opts));

    let mut q = t.pure("Device::cholesky_inverse");
    q.rows(square.clone(), |a| DEV.cholesky_inverse(a));

    let mut q = t.pure("Device::spectral_norm");
    let popts = PowerOptions::default();
    q.rows(square[..2].to_vec(), |a| DEV.spectral_norm(a, &popts));
    #[rustfmt::skip]
    let rows = [
        err("tol = -1", "tol", PowerOptions { tol: -1.0, ..popts }),
        err("max_iter = 0", "max_iter", PowerOptions { max_iter: 0, ..popts }),
        err("max_batch = 0", "max_batch", PowerOptions { max_batch: 0, ..popts }),
    ];
    q.rows(rows, |o| DEV.spectral_norm(&a, &o));
    let full_huge = filled(n, n, HUGE);
    q.huge("a = 1e30 everywhere", || {
        DEV.spectral_norm(&full_huge, &popts)
    });

    let mut q = t.pure("Device::trace");
    q.rows(square[..1].to_vec(), |a| DEV.trace(a));
    let mut v = spd(rng, n);
    let i = rng.random_range(0..n);
    v[i * n + i] = bad_scalar(rng);
    let diag_bad = DEV.upload(n, n, &v).unwrap();
    q.err(format!("a[{i},{i}] = {}", v[i * n + i]), "a", || {
        DEV.trace(&diag_bad)
    });
    let big = {
        let mut v = vec![0.0f32; (n + 2) * (n + 2)];
        (0..n + 2).for_each(|i| v[i * (n + 2) + i] = 3e38);
        DEV.upload(n + 2, n + 2, &v).unwrap()
    };
    q.huge("diagonal of 3e38 (sum overflows)", || DEV.trace(&big));
}

fn kalman_ops(t: &mut Tally, rng: &mut ChaCha8Rng, n: usize, d_o: usize) {
    let snap = |s: &KalmanState| snap_mats(&[&s.mu, &s.sigma, &s.r]);
    let mu0 = vals(rng, n, 1.0);
    let mut st = KalmanState::new(&DEV, &mu0, 0.1, d_o).unwrap();
    let opts = KalmanOptions::default();
    let h = mat(rng, d_o, n);
    let v = mat(rng, d_o, 1);
    // A valid step first, so R and σ are not at their initial values.
    DEV.kalman_step(&mut st, &h, &v, &opts).unwrap();

    let h_wide = mat(rng, d_o, n + 1);
    let h_tall = mat(rng, d_o + 1, n);
    let h_empty = DEV.zeros::<f32>(0, n).unwrap();
    let v_wrong = mat(rng, d_o + 1, 1);
    let (h_bad, hd) = poisoned(rng, d_o, n);
    let (v_bad, vd) = poisoned(rng, d_o, 1);
    let (h_huge, v_huge) = (filled(d_o, n, HUGE), filled(d_o, 1, HUGE));
    // (h, innovation).
    let rows = [
        err("h d_o x (n+1)", "h, state.mu", (&h_wide, &v)),
        err("h (d_o+1) x n", "h, state.r", (&h_tall, &v)),
        err("h 0 x n (empty observation)", "h", (&h_empty, &v)),
        err("innovation (d_o+1) x 1", "innovation", (&h, &v_wrong)),
        err(format!("h holds {hd}"), "h", (&h_bad, &v)),
        err(format!("innovation holds {vd}"), "innovation", (&h, &v_bad)),
    ];
    let bad_opts = bad_fields!(opts; beta = 1.5, beta = f32::NAN, rho = -1e-4,
        process_noise = -1.0, sigma_floor = 0.0, jitter = f32::INFINITY,
        max_jitter_escalations = 1000);
    let huges = [
        huge("h = 1e30 (H Σ Hᵀ overflows)", (&h_huge, &v)),
        huge("innovation = 1e30", (&h, &v_huge)),
    ];
    let mut p = t.on("Device::kalman_step", snap);
    let step = |s: &mut KalmanState, (h, v): (&Matrix, &Matrix)| DEV.kalman_step(s, h, v, &opts);
    p.rows(&mut st, rows, step);
    p.rows(&mut st, bad_opts, |s, o| DEV.kalman_step(s, &h, &v, &o));
    p.rows(&mut st, huges, step);
    // States corrupted through the public fields.
    let mut corrupt = KalmanState::new(&DEV, &mu0, 0.1, d_o).unwrap();
    let mut sig = vec![0.1f32; n];
    let i = rng.random_range(0..n);
    sig[i] = -0.1;
    corrupt.sigma = DEV.upload(n, 1, &sig).unwrap();
    let input = format!("state.sigma[{i}] = -0.1");
    p.err(input, "sigma, state.sigma", &mut corrupt, |s| {
        step(s, (&h, &v))
    });
    let mut corrupt = KalmanState::new(&DEV, &mu0, 0.1, d_o).unwrap();
    corrupt.r = DEV.upload(d_o, d_o, &non_spd(rng, d_o)).unwrap();
    let input = "state.r not positive semidefinite";
    p.huge(input, &mut corrupt, |s| step(s, (&h, &v)));

    let mut mu_bad = mu0.clone();
    let md = poison(rng, &mut mu_bad);
    let s = [0.0, -0.1, f32::NAN][rng.random_range(0..3)];
    // (mu0, sigma0, d_o).
    let rows = [
        err(format!("mu0 holds {md}"), "mu0", (&mu_bad[..], 0.1, d_o)),
        err("mu0 empty", "mu0", (&[][..], 0.1, d_o)),
        err("d_o = 0", "d_o", (&mu0[..], 0.1, 0)),
        err(format!("sigma0 = {s}"), "sigma0", (&mu0[..], s, d_o)),
    ];
    let new = |(mu, s, d)| KalmanState::new(&DEV, mu, s, d).map(drop);
    t.pure("KalmanState::new").rows(rows, new);
}

// ---------------------------------------------------------------------------------------------
// Optimizers.

/// The gradients the flat optimizers are probed with, `n` x 1 unless named.
struct Grads {
    x: Matrix,
    /// `x` with NaN or ±Inf where `xd` says.
    xs: Matrix,
    xd: String,
    /// One row longer.
    wrong: Matrix,
    /// `n` x 2.
    two_cols: Matrix,
    huge: Matrix,
}

/// One step of a flat optimizer: (grad, the Hessian sample of a refresh: Sophia's only).
type Step<'a> = (&'a Matrix, Option<SophiaHessian<'a>>);

fn hess(sampled_grad: &Matrix, batch: usize) -> Option<SophiaHessian<'_>> {
    Some(SophiaHessian {
        sampled_grad,
        batch,
    })
}

/// What SGD, AdamW and Sophia share, so that one family ([`flat_optimizer`]) probes all three;
/// each lists its own bad inputs.
trait Flat: Checkpoint + Sized {
    type Config: Copy + Debug + Default;
    type State: Clone;
    /// The type's name: its targets are `{NAME}::step` and so on.
    const NAME: &'static str;
    /// Whether a step samples the Hessian (Sophia): the warm-up step then gets a sample.
    const SAMPLES_HESSIAN: bool = false;
    fn new(n: usize, config: Self::Config) -> Result<Self>;
    fn step(
        &mut self,
        params: &mut Matrix,
        grad: &Matrix,
        hess: Option<SophiaHessian<'_>>,
    ) -> Result<()>;
    fn set_config(&mut self, config: Self::Config) -> Result<()>;
    fn state(&self) -> Self::State;
    fn restore(&mut self, state: &Self::State) -> Result<()>;

    /// Bad steps on the warmed-up optimizer (`hs`: the warm-up's Hessian sample) beyond
    /// those every flat optimizer gets ([`flat_optimizer`]).
    fn bad_steps<'a>(g: &'a Grads, hs: Option<&'a Matrix>) -> Vec<Row<Step<'a>>>;
    /// Bad first steps beyond the shared ones, each with `g.x` and no Hessian sample on a
    /// fresh optimizer with these parameters.
    fn bad_first_steps(g: &Grads, rng: &mut ChaCha8Rng) -> Vec<Row<Matrix>>;
    /// Configs that `new` and `set_config` must reject.
    fn bad_configs() -> Vec<Row<Self::Config>>;
    /// States that `restore` must reject, made from a good one.
    fn bad_states(good: &Self::State, rng: &mut ChaCha8Rng) -> Vec<Row<Self::State>>;
}

/// The half of [`Flat`] that only forwards, the same for all three; `plain step` adds a `step`
/// without a Hessian sample.
macro_rules! flat_forwarding {
    ($ty:ident, $config:ty, $state:ty) => {
        type Config = $config;
        type State = $state;
        const NAME: &'static str = stringify!($ty);
        fn new(n: usize, config: $config) -> Result<Self> {
            $ty::new(&DEV, n, config)
        }
        fn set_config(&mut self, config: $config) -> Result<()> {
            $ty::set_config(self, config)
        }
        fn state(&self) -> $state {
            $ty::state(self).unwrap()
        }
        fn restore(&mut self, state: &$state) -> Result<()> {
            $ty::restore(self, state)
        }
    };
    ($ty:ident, $config:ty, $state:ty, plain step) => {
        flat_forwarding!($ty, $config, $state);
        fn step(&mut self, p: &mut Matrix, g: &Matrix, _: Option<SophiaHessian<'_>>) -> Result<()> {
            $ty::step(self, p, g)
        }
    };
}

impl Flat for Sgd {
    flat_forwarding!(Sgd, SgdConfig, SgdState, plain step);

    fn bad_steps<'a>(g: &'a Grads, _: Option<&'a Matrix>) -> Vec<Row<Step<'a>>> {
        vec![huge("grad = 1e30", (&g.huge, None))]
    }

    fn bad_first_steps(_: &Grads, _: &mut ChaCha8Rng) -> Vec<Row<Matrix>> {
        Vec::new()
    }

    fn bad_configs() -> Vec<Row<SgdConfig>> {
        let cfg = SgdConfig::default();
        bad_fields!(cfg; lr = -0.1, momentum = 1.0, weight_decay = f32::NAN).into()
    }

    fn bad_states(good: &SgdState, rng: &mut ChaCha8Rng) -> Vec<Row<SgdState>> {
        let n = good.momentum.len();
        let mut m = good.momentum.clone();
        let md = poison(rng, &mut m);
        #[rustfmt::skip]
        let rows = vec![
            err("momentum length n+1", "momentum",
                edited(good.clone(), |s| s.momentum = vec![0.1; n + 1])),
            err(format!("momentum holds {md}"), "momentum",
                edited(good.clone(), |s| s.momentum = m)),
        ];
        rows
    }
}

impl Flat for AdamW {
    flat_forwarding!(AdamW, AdamWConfig, AdamWState, plain step);

    fn bad_steps<'a>(g: &'a Grads, _: Option<&'a Matrix>) -> Vec<Row<Step<'a>>> {
        vec![huge("grad = 1e30 (g² overflows f32)", (&g.huge, None))]
    }

    fn bad_first_steps(_: &Grads, _: &mut ChaCha8Rng) -> Vec<Row<Matrix>> {
        Vec::new()
    }

    fn bad_configs() -> Vec<Row<AdamWConfig>> {
        let cfg = AdamWConfig::default();
        let mut rows = Vec::from(bad_fields!(cfg; lr = f32::NAN, beta1 = 1.0, beta2 = 2.0,
            eps = 0.0, weight_decay = -1.0));
        // A cosine schedule that ends within the warm-up (100 steps), one whose floor is over `lr`.
        #[rustfmt::skip]
        rows.extend([
            bad("schedule.total_steps", cfg,
                |c| c.schedule = Cosine { total_steps: 10, min_lr: 0.0 }),
            bad("schedule.min_lr", cfg,
                |c| c.schedule = Cosine { total_steps: 1000, min_lr: 1.0 }),
        ]);
        rows
    }

    fn bad_states(good: &AdamWState, rng: &mut ChaCha8Rng) -> Vec<Row<AdamWState>> {
        let n = good.v.len();
        let k = rng.random_range(0..n);
        let mut m = good.m.clone();
        let md = poison(rng, &mut m);
        #[rustfmt::skip]
        let rows = vec![
            err(format!("v[{k}] = -1"), "v", edited(good.clone(), |s| s.v[k] = -1.0)),
            err(format!("m holds {md}"), "m", edited(good.clone(), |s| s.m = m)),
            err("v length n-1", "v",
                edited(good.clone(), |s| s.v = vec![0.0; n.saturating_sub(1)])),
        ];
        rows
    }
}

impl Flat for Sophia {
    flat_forwarding!(Sophia, SophiaConfig, SophiaState);
    const SAMPLES_HESSIAN: bool = true;

    fn step(&mut self, p: &mut Matrix, g: &Matrix, h: Option<SophiaHessian<'_>>) -> Result<()> {
        Sophia::step(self, p, g, h)
    }

    fn bad_steps<'a>(g: &'a Grads, hs: Option<&'a Matrix>) -> Vec<Row<Step<'a>>> {
        let hs = hs.unwrap();
        #[rustfmt::skip]
        let rows = vec![
            err(format!("hess.sampled_grad holds {}", g.xd), "sampled_grad",
                (&g.x, hess(&g.xs, 4))),
            err("hess.sampled_grad one row longer", "hess.sampled_grad", (&g.x, hess(&g.wrong, 4))),
            err("hess.batch = 0", "batch", (&g.x, hess(hs, 0))),
            huge("hess.sampled_grad = 1e30 (B·g² overflows)", (&g.x, hess(&g.huge, 4))),
        ];
        rows
    }

    fn bad_first_steps(g: &Grads, rng: &mut ChaCha8Rng) -> Vec<Row<Matrix>> {
        let params = mat(rng, g.x.rows(), 1);
        vec![err("no hess on a refresh step", "hess", params)]
    }

    fn bad_configs() -> Vec<Row<SophiaConfig>> {
        let cfg = SophiaConfig::default();
        bad_fields!(cfg; lr = -1.0, beta1 = 1.0, beta2 = f32::NAN, gamma = 0.0, eps = -1.0,
            hessian_every = 0)
        .into()
    }

    fn bad_states(good: &SophiaState, rng: &mut ChaCha8Rng) -> Vec<Row<SophiaState>> {
        let n = good.h.len();
        let k = rng.random_range(0..n);
        #[rustfmt::skip]
        let rows = vec![
            err(format!("h[{k}] = -1"), "h", edited(good.clone(), |s| s.h[k] = -1.0)),
            err("m length n+2", "m", edited(good.clone(), |s| s.m = vec![0.0; n + 2])),
        ];
        rows
    }
}

/// The probes of one flat optimizer (see [`Flat`]) on `n` x 1 parameters.
fn flat_optimizer<O: Flat>(t: &mut Tally, rng: &mut ChaCha8Rng, g: &Grads) {
    let n = g.x.rows();
    let snap = |o: &(O, Matrix)| snap_ck(&o.0, &[&o.1]);
    let mut o = (O::new(n, O::Config::default()).unwrap(), mat(rng, n, 1));
    // A valid step first, so the state is not at its initial values.
    let hs = O::SAMPLES_HESSIAN.then(|| mat(rng, n, 1));
    let warm_up = hs.as_ref().and_then(|h| hess(h, 4));
    o.0.step(&mut o.1, &g.x, warm_up).unwrap();

    let mut p = t.on(format!("{}::step", O::NAME), snap);
    // Every flat optimizer gets these; a Hessian sample goes with each where the optimizer
    // samples one, so that the probe reaches the argument it names.
    let sample = || hs.as_ref().and_then(|h| hess(h, 4));
    #[rustfmt::skip]
    let shared = vec![
        err("grad one row longer", "grad", (&g.wrong, sample())),
        err("grad n x 2", "grad", (&g.two_cols, sample())),
        err(format!("grad holds {}", g.xd), "grad", (&g.xs, sample())),
    ];
    let steps = shared.into_iter().chain(O::bad_steps(g, hs.as_ref()));
    p.rows(&mut o, steps.collect::<Vec<_>>(), |(o, p), (g, h)| {
        o.step(p, g, h)
    });
    #[rustfmt::skip]
    let shared = vec![
        err(format!("params holds {}", g.xd), "params", g.xs.try_clone().unwrap()),
        err("params one row longer", "params", mat(rng, n + 1, 1)),
        err("params n x 2", "params", mat(rng, n, 2)),
    ];
    let first = shared.into_iter().map(|r| (r, sample()));
    let own = O::bad_first_steps(g, rng).into_iter().map(|r| (r, None));
    for ((input, expect, params), h) in first.chain(own) {
        let mut fresh = (O::new(n, O::Config::default()).unwrap(), params);
        p.probe(&input, expect, &mut fresh, |(o, p)| o.step(p, &g.x, h));
    }
    let empty = || O::new(0, O::Config::default()).map(drop);
    t.pure(format!("{}::new", O::NAME)).err("n = 0", "n", empty);
    let set = |(o, _): &mut (O, Matrix), c| o.set_config(c);
    t.configs(O::NAME, O::bad_configs(), &mut o, snap, set, |c| {
        O::new(n, c).map(drop)
    });
    let states = O::bad_states(&o.0.state(), rng);
    let mut p = t.on(format!("{}::restore", O::NAME), snap);
    p.rows(&mut o, states, |(o, _), st| o.restore(&st));
}

fn flat_optimizers(t: &mut Tally, rng: &mut ChaCha8Rng, n: usize) {
    let x = mat(rng, n, 1);
    let (xs, xd) = poisoned(rng, n, 1);
    let g = Grads {
        x,
        xs,
        xd,
        wrong: mat(rng, n + 1, 1),
        two_cols: mat(rng, n, 2),
        huge: filled(n, 1, HUGE),
    };
    flat_optimizer::<Sgd>(t, rng, &g);
    flat_optimizer::<AdamW>(t, rng, &g);
    flat_optimizer::<Sophia>(t, rng, &g);
}

fn kalman_optimizer(t: &mut Tally, rng: &mut ChaCha8Rng, n: usize, d_o: usize) {
    let cfg = RKalmanConfig::default();
    let mu0 = vals(rng, n, 1.0);
    let h = mat(rng, d_o, n);
    let v = mat(rng, d_o, 1);
    let mut o = RKalman::new(&DEV, &mu0, d_o, cfg).unwrap();
    o.step(&h, &v).unwrap();
    let s = |o: &RKalman| snap_ck(o, &[]);

    let h_wide = mat(rng, d_o, n + 1);
    let v2 = mat(rng, d_o, 2);
    let (hb, hd) = poisoned(rng, d_o, n);
    let (vb, vd) = poisoned(rng, d_o, 1);
    let h_huge = filled(d_o, n, HUGE);
    // (h, innovation).
    let rows = [
        err("h d_o x (n+1)", "h", (&h_wide, &v)),
        err("innovation d_o x 2", "innovation", (&h, &v2)),
        err(format!("h holds {hd}"), "h", (&hb, &v)),
        err(format!("innovation holds {vd}"), "innovation", (&h, &vb)),
        huge("h = 1e30", (&h_huge, &v)),
    ];
    t.on("RKalman::step", s)
        .rows(&mut o, rows, |o, (h, v)| o.step(h, v));

    let configs = [
        bad("sigma0", cfg, |c| c.sigma0 = 0.0),
        bad("beta", cfg, |c| c.kalman.beta = -0.1),
        bad("rho", cfg, |c| c.kalman.rho = f32::NAN),
        bad("jitter", cfg, |c| c.kalman.jitter = 0.0),
    ];
    let new = |d_o, c| RKalman::new(&DEV, &mu0, d_o, c).map(drop);
    let set = |o: &mut RKalman, c| o.set_config(c);
    t.configs("RKalman", configs, &mut o, s, set, |c| new(d_o, c));
    t.pure("RKalman::new").err("d_o = 0", "d_o", || new(0, cfg));

    let good = o.state().unwrap();
    let i = rng.random_range(0..n);
    let mut mu = good.mu.clone();
    let md = poison(rng, &mut mu);
    #[rustfmt::skip]
    let rows = [
        err(format!("sigma[{i}] = 0"), "sigma", edited(good.clone(), |s| s.sigma[i] = 0.0)),
        err(format!("mu holds {md}"), "mu", edited(good.clone(), |s| s.mu = mu)),
        err("r length d_o²+1", "r", edited(good.clone(), |s| s.r = vec![0.0; d_o * d_o + 1])),
        err("r not positive semidefinite", "r", edited(good.clone(), |s| s.r = non_spd(rng, d_o))),
    ];
    t.on("RKalman::restore", s)
        .rows(&mut o, rows, |o, st| o.restore(&st));
}

/// Statistics for `shapes` with `m` rows, on the CPU.
fn stats(rng: &mut ChaCha8Rng, shapes: &[(usize, usize)], m: usize) -> Vec<(Matrix, Matrix)> {
    shapes
        .iter()
        .map(|&(o, i)| (mat(rng, m, i), mat(rng, m, o)))
        .collect()
}

fn kron_stats(st: &[(Matrix, Matrix)]) -> Vec<KronStats<'_>> {
    st.iter().map(|(a, e)| KronStats { a, e }).collect()
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
        let ks = opt.needs_stats().then(|| kron_stats(&st));
        opt.step(&mut params, &g, ks.as_deref()).unwrap();
    }
    let mut o = (opt, params);
    let s = |o: &(KronOptimizer, Vec<Matrix>)| {
        let refs: Vec<&Matrix> = o.1.iter().collect();
        snap_ck(&o.0, &refs)
    };
    let st_ok = stats(rng, shapes, m);
    let ks_ok = kron_stats(&st_ok);
    let l = rng.random_range(0..shapes.len());
    let (o_l, i_l) = shapes[l];

    for target in ["KronOptimizer::step", "KronOptimizer::precondition"] {
        type Inputs<'a> = (Vec<&'a Matrix>, Vec<KronStats<'a>>);
        let run = |o: &mut (KronOptimizer, Vec<Matrix>), (g, ks): Inputs| {
            if target == "KronOptimizer::step" {
                o.0.step(&mut o.1, &g, Some(&ks)).map(drop)
            } else {
                o.0.precondition(&g, Some(&ks)).map(drop)
            }
        };
        let wrong = mat(rng, o_l + 1, i_l);
        let (bad, bd) = poisoned(rng, o_l, i_l);
        let a_wrong = mat(rng, m, i_l + 1);
        let a_empty = DEV.zeros::<f32>(0, i_l).unwrap();
        let e_empty = DEV.zeros::<f32>(0, o_l).unwrap();
        let (ab, ad) = poisoned(rng, m, i_l);
        let (eb, ed) = poisoned(rng, m, o_l);
        let huge_g: Vec<Matrix> = shapes.iter().map(|&(o, i)| filled(o, i, HUGE)).collect();
        let st_h: Vec<(Matrix, Matrix)> = shapes
            .iter()
            .map(|&(o, i)| (filled(m, i, HUGE), filled(m, o, 1.0)))
            .collect();
        // (grads, stats): layer `l`'s gradient or statistics replaced, or a layer short.
        let g_l = |x| (replaced(&g, l, x), ks_ok.clone());
        let ks_l = |x| (g.clone(), replaced(&ks_ok, l, x));
        let k_l = ks_ok[l];
        #[rustfmt::skip]
        let rows = [
            err("one gradient missing", "grads", (g[1..].to_vec(), ks_ok.clone())),
            err(format!("grads[{l}] one row longer"), "grads", g_l(&wrong)),
            err(format!("grads[{l}] holds {bd}"), "grads, g", g_l(&bad)),
            err("stats for one layer too few", "stats", (g.clone(), ks_ok[1..].to_vec())),
            err(format!("stats[{l}].a has d_in+1 columns"), "stats.a",
                ks_l(KronStats { a: &a_wrong, ..k_l })),
            err(format!("stats[{l}] with 0 rows (empty batch)"), "stats.a, stats.e, a",
                ks_l(KronStats { a: &a_empty, e: &e_empty })),
            err(format!("stats[{l}].a holds {ad}"), "a, stats.a",
                ks_l(KronStats { a: &ab, ..k_l })),
            err(format!("stats[{l}].e holds {ed}"), "a, e, stats.e",
                ks_l(KronStats { e: &eb, ..k_l })),
            huge("grads = 1e30", (huge_g.iter().collect(), ks_ok.clone())),
            huge("stats.a = 1e30 (AᵀA overflows)", (g.clone(), kron_stats(&st_h))),
        ];
        t.on(target, s).rows(&mut o, rows, run);
    }

    // Fresh optimizers: a refresh step without statistics, a poisoned parameter.
    let fresh = |params| (KronOptimizer::new(&DEV, shapes, cfg).unwrap(), params);
    let params = || -> Vec<Matrix> { o.1.iter().map(|p| p.try_clone().unwrap()).collect() };
    let mut p = t.on("KronOptimizer::step", s);
    let mut no_stats = fresh(params());
    p.err("no stats on a refresh step", "stats", &mut no_stats, |o| {
        o.0.step(&mut o.1, &g, None).map(drop)
    });
    let (pb, pd) = poisoned(rng, o_l, i_l);
    let mut bad_params = fresh(params());
    bad_params.1[l] = pb;
    let input = format!("params[{l}] holds {pd}");
    p.err(input, "x, params", &mut bad_params, |o| {
        o.0.step(&mut o.1, &g, Some(&ks_ok)).map(drop)
    });

    // A valid step first, so a prediction is pending.
    let ks_now = o.0.needs_stats().then_some(&ks_ok[..]);
    o.0.step(&mut o.1, &g, ks_now).unwrap();
    let mut p = t.on("KronOptimizer::observe_loss", s);
    let b = bad_scalar(rng);
    p.err(format!("before = {b}"), "before", &mut o, |o| {
        o.0.observe_loss(b, 0.5)
    });
    let mut no_pending = fresh(Vec::new());
    let input = "no step to observe";
    p.err(input, "predicted change", &mut no_pending, |o| {
        o.0.observe_loss(1.0, 0.5)
    });

    // The optimizer's own state (a fresh copy: `KronState` is not `Clone`), one thing changed.
    let base = || o.0.state().unwrap();
    let rho = [-1.0, f32::NAN, 10.0][rng.random_range(0..3)];
    let factor_wrong = mat(rng, i_l + 1, i_l + 1);
    let (fb, fd) = poisoned(rng, o_l, o_l);
    #[rustfmt::skip]
    let mut rows = vec![
        err(format!("rho = {rho}"), "rho", edited(base(), |s| s.rho = rho)),
        err(format!("layer {l} gamma damping 0"), "damping",
            edited(base(), |s| s.layers[l].gamma.damping = 0.0)),
        err(format!("layer {l} lambda factor (d_in+1)²"), "factor",
            edited(base(), |s| s.layers[l].lambda.factor = factor_wrong)),
        err(format!("layer {l} gamma inverse holds {fd}"), "x, inverse",
            edited(base(), |s| s.layers[l].gamma.inverse = fb)),
    ];
    // With one layer, none left is a fresh optimizer's valid state: only probed with two.
    let one_missing = edited(base(), |s| {
        s.layers.pop();
    });
    if !one_missing.layers.is_empty() {
        rows.push(err("one layer missing", "layers", one_missing));
    }
    let mut indef = || DEV.upload(i_l, i_l, &non_spd(rng, i_l)).unwrap();
    #[rustfmt::skip]
    rows.extend([
        err(format!("layer {l} lambda factor not positive definite"), "factor",
            edited(base(), |s| s.layers[l].lambda.factor = indef())),
        err(format!("layer {l} lambda inverse not positive definite"), "inverse",
            edited(base(), |s| s.layers[l].lambda.inverse = indef())),
    ]);
    t.on("KronOptimizer::restore", s)
        .rows(&mut o, rows, |o, st| o.0.restore(st));

    let mut q = t.pure("KronOptimizer::new");
    let rows = bad_fields!(cfg; lr = 0.0, lr = f32::NAN, rho_min = -1.0, rho_max = 1e-9,
        rho = 1.0, phi = 1.5, skip = 0, ema = 1.0, grad_reg = -0.01,
        damping_floor = f32::NEG_INFINITY);
    q.rows(rows, |c| KronOptimizer::new(&DEV, shapes, c).map(drop));
    let rows = [
        err("no layers", "layers", &[][..]),
        err("a layer with d_in = 0", "layers", &[(3, 0)][..]),
    ];
    q.rows(rows, |shapes| {
        KronOptimizer::new(&DEV, shapes, cfg).map(drop)
    });
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
