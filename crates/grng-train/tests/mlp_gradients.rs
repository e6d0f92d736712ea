//! The reference MLP's derivatives against central finite differences, its Fisher statistics
//! against their definitions, and the data module.
//!
//! Finite-difference tolerances (f32 forward passes, losses accumulated in f64): a central
//! difference with step `h` errs by the truncation `h²/6·|f'''|` plus the rounding
//! `≈ ε_f/h`, where `ε_f ≈ 10·u·max(1, |f|)` is the f32 rounding of one evaluation
//! (`u = 6e-8`; a few roundings per layer on O(1) values). With `h = 1e-2` and O(1) third
//! derivatives (tanh, weights O(1), inputs in [−1, 1]) both terms are ≈ 2e-5..1e-4, so
//! `|fd − exact| ≤ 2e-3 + 2e-2·|exact|` leaves a margin of more than 10x while catching any
//! wrong term (those are O(|exact|)).

use grng_testkit as common;

use grng::{Error, Mat, MatRef};
use grng_train::data::{digits, linear_regression, synthetic_classification, Dataset};
use grng_train::mlp::{
    Activation, BackwardScratch, FisherMode, Forward, LayerStats, Loss, Mlp, MlpConfig, Targets,
    TargetsBuf,
};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const H: f32 = 1e-2;
const ABS_TOL: f64 = 2e-3;
const REL_TOL: f64 = 2e-2;

fn close(fd: f64, exact: f64) -> bool {
    (fd - exact).abs() <= ABS_TOL + REL_TOL * exact.abs()
}

fn random_mat(rng: &mut ChaCha8Rng, rows: usize, cols: usize, scale: f32) -> Mat {
    let data = (0..rows * cols)
        .map(|_| rng.random_range(-scale..scale))
        .collect();
    Mat::from_vec(data, rows, cols).unwrap()
}

/// A small network with randomised parameters (biases too), a batch and both kinds of targets.
struct Case {
    mlp: Mlp,
    x: Mat,
    targets: TargetsBuf,
}

fn case(seed: u64, sizes: Vec<usize>, activation: Activation, loss: Loss, m: usize) -> Case {
    let mut mlp = Mlp::new(
        MlpConfig {
            sizes: sizes.clone(),
            activation,
            loss,
        },
        seed,
    )
    .unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    for p in mlp.params_mut() {
        *p += rng.random_range(-0.3f32..0.3);
    }
    let x = random_mat(&mut rng, m, sizes[0], 1.0);
    let c = *sizes.last().unwrap();
    let targets = match loss {
        Loss::SoftmaxCrossEntropy => {
            TargetsBuf::Classes((0..m).map(|_| rng.random_range(0..c)).collect())
        }
        Loss::SquaredError => TargetsBuf::Values(random_mat(&mut rng, m, c, 1.0)),
    };
    Case { mlp, x, targets }
}

fn loss_at(mlp: &mut Mlp, params: &[f32], x: &Mat, t: Targets<'_>) -> f64 {
    mlp.set_params(params).unwrap();
    mlp.evaluate(x.as_ref(), t).unwrap() as f64
}

fn grad_at(mlp: &mut Mlp, params: &[f32], x: &Mat, t: Targets<'_>) -> Vec<f32> {
    mlp.set_params(params).unwrap();
    let fwd = mlp.forward(x.as_ref()).unwrap();
    mlp.gradient(&fwd, t).unwrap().0
}

/// A random direction of unit Euclidean norm, so a step `h` along it moves θ by exactly `h`.
fn unit_direction(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let norm = dot(&v, &v).sqrt().max(1e-12) as f32;
    v.into_iter().map(|x| x / norm).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Random shapes: 1-2 hidden layers (or none), inputs 1..=5, outputs 2..=4, batch 1..=5.
fn shapes() -> impl Strategy<Value = (u64, Vec<usize>, usize, bool)> {
    (
        any::<u64>(),
        1usize..=5,
        prop::collection::vec(1usize..=6, 0..=2),
        2usize..=4,
        1usize..=5,
        any::<bool>(),
    )
        .prop_map(|(seed, d0, hidden, d_out, m, softmax)| {
            let mut sizes = vec![d0];
            sizes.extend(hidden);
            sizes.push(d_out);
            (seed, sizes, m, softmax)
        })
}

fn loss_of(softmax: bool) -> Loss {
    if softmax {
        Loss::SoftmaxCrossEntropy
    } else {
        Loss::SquaredError
    }
}

/// Pre-activations of every hidden layer, recomputed from the cached inputs.
fn min_abs_hidden_preactivation(mlp: &Mlp, x: &Mat) -> f32 {
    let fwd = mlp.forward(x.as_ref()).unwrap();
    let mut min = f32::INFINITY;
    for l in 0..mlp.num_layers() - 1 {
        let a = fwd.inputs(l).unwrap();
        let w = mlp.layer(l).unwrap();
        for k in 0..a.rows() {
            for p in 0..w.rows() {
                let z: f32 = a.row(k).iter().zip(w.row(p)).map(|(x, y)| x * y).sum();
                min = min.min(z.abs());
            }
        }
    }
    min
}

/// Largest change of any hidden pre-activation when one parameter moves by `h`: the moved
/// layer's `z` changes by at most `h·max|x̄|`, and each later (1-Lipschitz ReLU, then `W`)
/// layer multiplies the max-norm change by at most `‖W‖_∞` (max absolute row sum).
fn relu_perturbation_bound(mlp: &Mlp, x: &Mat, h: f32) -> f32 {
    let fwd = mlp.forward(x.as_ref()).unwrap();
    let nl = mlp.num_layers();
    let mut bound = 0.0f32;
    for l in 0..nl {
        let a = fwd.inputs(l).unwrap();
        let mut b = h * a.data().iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // Only hidden pre-activations matter: layers l..nl-2.
        for j in l + 1..nl - 1 {
            let w = mlp.layer(j).unwrap();
            let norm = (0..w.rows())
                .map(|p| {
                    w.row(p)[..w.cols() - 1]
                        .iter()
                        .map(|v| v.abs())
                        .sum::<f32>()
                })
                .fold(0.0f32, f32::max);
            b *= norm;
        }
        bound = bound.max(b);
    }
    bound
}

fn check_gradient(c: &mut Case, h: f32) -> Result<(), TestCaseError> {
    let t = c.targets.clone();
    let fwd = c.mlp.forward(c.x.as_ref()).unwrap();
    let b = c.mlp.backward(&fwd, t.as_targets()).unwrap();
    prop_assert!(
        (b.loss as f64 - c.mlp.evaluate(c.x.as_ref(), t.as_targets()).unwrap() as f64).abs() < 1e-6
    );
    let theta = c.mlp.params().to_vec();
    let mut p = theta.clone();
    for i in 0..theta.len() {
        p[i] = theta[i] + h;
        let lp = loss_at(&mut c.mlp, &p, &c.x, t.as_targets());
        p[i] = theta[i] - h;
        let lm = loss_at(&mut c.mlp, &p, &c.x, t.as_targets());
        p[i] = theta[i];
        let fd = (lp - lm) / (2.0 * h as f64);
        prop_assert!(
            close(fd, b.grad[i] as f64),
            "param {i}: finite difference {fd} vs backward {}",
            b.grad[i]
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(48))]

    /// `forward_into` over one `Forward` reused across batches of other sizes, parameters
    /// changed in between and a failed pass (NaN input) gives every cached matrix of a fresh
    /// `forward`, bit for bit; after the failure the buffers are stale and rejected.
    #[test]
    fn forward_into_reused_buffers_match_fresh_passes((seed, sizes, m, softmax) in shapes(), relu in any::<bool>(), m2 in 1usize..12) {
        let act = if relu { Activation::Relu } else { Activation::Tanh };
        let mut c = case(seed, sizes.clone(), act, loss_of(softmax), m);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xf0);
        let mut fwd = Forward::empty();
        let bits = |m: MatRef<'_, f32>| -> Vec<u32> {
            (0..m.rows()).flat_map(|i| m.row(i).iter().map(|v| v.to_bits()).collect::<Vec<_>>()).collect()
        };
        for (k, rows) in [m, m2, m2, m].into_iter().enumerate() {
            let x = random_mat(&mut rng, rows, sizes[0], 1.0);
            if k == 2 {
                // A failed pass: the input holds NaN.
                let mut bad = x.clone();
                bad.as_mut_slice()[0] = f32::NAN;
                prop_assert!(c.mlp.forward_into(bad.as_ref(), &mut fwd).is_err());
                let stale = c.mlp.loss(&fwd, c.targets.as_targets());
                prop_assert!(matches!(stale, Err(Error::Value { arg: "fwd", .. })), "{:?}", stale);
                for p in c.mlp.params_mut() {
                    *p *= 0.9;
                }
            }
            c.mlp.forward_into(x.as_ref(), &mut fwd).unwrap();
            let fresh = c.mlp.forward(x.as_ref()).unwrap();
            for l in 0..sizes.len() - 1 {
                prop_assert_eq!(bits(fwd.inputs(l).unwrap()), bits(fresh.inputs(l).unwrap()), "pass {} layer {}", k, l);
            }
            prop_assert_eq!(bits(fwd.logits()), bits(fresh.logits()), "pass {}", k);
            prop_assert_eq!(bits(fwd.outputs()), bits(fresh.outputs()), "pass {}", k);
        }
    }

    /// `gradient_into_with` over one `BackwardScratch` (and one `Forward`) reused across batches
    /// of other sizes and a parameter change gives `gradient`'s bits on fresh buffers; the
    /// targets of each batch are drawn for its size.
    #[test]
    fn gradient_with_reused_scratch_matches_fresh_passes((seed, sizes, m, softmax) in shapes(), relu in any::<bool>(), m2 in 1usize..12) {
        let act = if relu { Activation::Relu } else { Activation::Tanh };
        let mut c = case(seed, sizes.clone(), act, loss_of(softmax), m);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0b);
        let (mut fwd, mut scratch, mut grad) = (Forward::empty(), BackwardScratch::default(), Vec::new());
        let classes = *sizes.last().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (k, rows) in [m, m2, m2, m].into_iter().enumerate() {
            if k == 2 {
                for p in c.mlp.params_mut() {
                    *p *= 0.9;
                }
            }
            let x = random_mat(&mut rng, rows, sizes[0], 1.0);
            let t = if softmax {
                TargetsBuf::Classes((0..rows).map(|_| rng.random_range(0..classes)).collect())
            } else {
                TargetsBuf::Values(random_mat(&mut rng, rows, classes, 1.0))
            };
            c.mlp.forward_into(x.as_ref(), &mut fwd).unwrap();
            let loss = c.mlp.gradient_into_with(&fwd, t.as_targets(), &mut grad, &mut scratch).unwrap();
            let fresh = c.mlp.forward(x.as_ref()).unwrap();
            let (want, want_loss) = c.mlp.gradient(&fresh, t.as_targets()).unwrap();
            prop_assert_eq!(bits(&grad), bits(&want), "pass {}", k);
            prop_assert_eq!(loss.to_bits(), want_loss.to_bits(), "pass {}", k);
        }
    }

    /// On a pool worker the backward pass computes each layer's weight gradient beside the
    /// product that carries the errors to the layer below (`cpu::join_tasks`); from a plain
    /// thread one after the other. The flat gradient (`gradient_into`, reusing its buffer, and
    /// `backward`), the per-layer statistics (`backward`, `backward_factors` and
    /// `backward_factors_from`) and the loss must have the same bits either way.
    #[test]
    fn gradient_on_a_pool_worker_matches_the_calling_thread((seed, sizes, m, softmax) in shapes(), relu in any::<bool>()) {
        let act = if relu { Activation::Relu } else { Activation::Tanh };
        let c = case(seed, sizes, act, loss_of(softmax), m);
        let run = || {
            let fwd = c.mlp.forward(c.x.as_ref()).unwrap();
            let t = c.targets.as_targets();
            // A reused buffer holding stale values: every element must be written.
            let mut grad = vec![f32::NAN; c.mlp.num_params()];
            let loss = c.mlp.gradient_into(&fwd, t, &mut grad).unwrap();
            let b = c.mlp.backward(&fwd, t).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let stats = |ls: &[LayerStats]| -> Vec<(Vec<u32>, Vec<u32>)> {
                ls.iter().map(|s| (bits(s.a.as_slice()), bits(s.e.as_slice()))).collect()
            };
            // The factors borrowing the pass and taking it by value: the same statistics.
            let (lb, loss_b) = c.mlp.backward_factors(&fwd, t).unwrap();
            let (lv, loss_v) = c.mlp.backward_factors_from(fwd, t).unwrap();
            assert!(stats(&lb) == stats(&lv) && loss_b.to_bits() == loss_v.to_bits());
            (bits(&grad), bits(&b.grad), stats(&b.layers), stats(&lv), loss.to_bits())
        };
        let here = run();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let on_worker = pool.install(run);
        prop_assert_eq!(&here.0, &here.1, "gradient_into and backward disagree");
        prop_assert!(here == on_worker, "the worker's backward pass differs");
    }

    /// Flat gradient of tanh networks, every coordinate, both losses.
    #[test]
    fn gradient_matches_finite_differences((seed, sizes, m, softmax) in shapes()) {
        let mut c = case(seed, sizes, Activation::Tanh, loss_of(softmax), m);
        check_gradient(&mut c, H)?;
    }

    /// ReLU networks, skipping draws where a step of h could cross a kink (the bound is
    /// rigorous, see `relu_perturbation_bound`). The loss is smooth between kinks; the smaller
    /// step makes the rounding term ε_f/h 5x larger (≈ 2e-4), still well inside the tolerance.
    #[test]
    fn relu_gradient_matches_finite_differences((seed, sizes, m, softmax) in shapes()) {
        let mut c = case(seed, sizes, Activation::Relu, loss_of(softmax), m);
        let h = 2e-3;
        prop_assume!(min_abs_hidden_preactivation(&c.mlp, &c.x) > relu_perturbation_bound(&c.mlp, &c.x, h));
        check_gradient(&mut c, h)?;
    }

    /// `G_l = (1/m) E_lᵀ A_l` (in f64) equals each layer's slice of the flat gradient (which
    /// [`Mlp::gradient`] returns bit for bit), the
    /// augmented inputs end in 1, and row k of `E_l` is sample k's own gradient w.r.t. the
    /// layer's bias (a one-sample batch): `E` is per sample and not divided by `m`.
    /// f32 sums of ≤ 6 O(1) terms: 1e-5 relative is ~10x their rounding.
    #[test]
    fn layer_stats_give_the_gradient((seed, sizes, m, softmax) in shapes(), relu in any::<bool>()) {
        let act = if relu { Activation::Relu } else { Activation::Tanh };
        let c = case(seed, sizes.clone(), act, loss_of(softmax), m);
        let fwd = c.mlp.forward(c.x.as_ref()).unwrap();
        let b = c.mlp.backward(&fwd, c.targets.as_targets()).unwrap();
        // The statistics-free path the first-order trainers take is the same computation.
        let (grad, loss) = c.mlp.gradient(&fwd, c.targets.as_targets()).unwrap();
        prop_assert_eq!(&grad, &b.grad);
        prop_assert_eq!(loss.to_bits(), b.loss.to_bits());
        prop_assert_eq!(b.layers.len(), sizes.len() - 1);
        for (l, s) in b.layers.iter().enumerate() {
            let (rows, cols) = c.mlp.layer_shape(l).unwrap();
            prop_assert_eq!(s.a.shape(), (m, cols));
            prop_assert_eq!(s.e.shape(), (m, rows));
            let range = c.mlp.layer_range(l).unwrap();
            for p in 0..rows {
                for q in 0..cols {
                    let g: f64 = (0..m).map(|k| s.e.as_ref().at(k, p) as f64 * s.a.as_ref().at(k, q) as f64).sum::<f64>() / m as f64;
                    let got = b.grad[range.start + p * cols + q] as f64;
                    prop_assert!((g - got).abs() <= 1e-5 * (1.0 + g.abs()), "layer {l} ({p},{q}): {g} vs {got}");
                }
            }
            for k in 0..m {
                prop_assert_eq!(s.a.as_ref().at(k, cols - 1), 1.0);
            }
        }
        for k in 0..m {
            let xk = MatRef::new(c.x.as_ref().row(k), 1, sizes[0]).unwrap();
            let one = match &c.targets {
                TargetsBuf::Classes(y) => TargetsBuf::Classes(vec![y[k]]),
                TargetsBuf::Values(v) => TargetsBuf::Values(Mat::from_vec(v.as_ref().row(k).to_vec(), 1, v.cols()).unwrap()),
            };
            let fk = c.mlp.forward(xk).unwrap();
            let bk = c.mlp.backward(&fk, one.as_targets()).unwrap();
            for (l, s) in b.layers.iter().enumerate() {
                let (rows, cols) = c.mlp.layer_shape(l).unwrap();
                let start = c.mlp.layer_range(l).unwrap().start;
                for p in 0..rows {
                    let bias_grad = bk.grad[start + p * cols + cols - 1];
                    let e = s.e.as_ref().at(k, p);
                    prop_assert!((bias_grad - e).abs() <= 1e-5 * (1.0 + e.abs()));
                }
            }
        }
    }

    /// [`Mlp::backward_factors`] is [`Mlp::backward`] without the flat gradient (same layers,
    /// same loss, bit for bit), [`Mlp::gradient_into`] its gradient, and [`LayerStats::gradient_norm_sq`] is `‖G_l‖²` of the flat
    /// gradient's slice. Hidden widths up to 40 with batches of 1–8 take both of its routes
    /// (Gram matrices when `m·(d_out + d_in) < 2·d_out·d_in`). Bound: f32 GEMMs with inner
    /// dimension `k ≤ max(m, d_out + d_in)` and the flat gradient's own rounding, each within
    /// `k·2⁻²⁴` of the exact sum on absolute values `Σ (|e||e|ᵀ)∘(|a||a|ᵀ)/m²`; 4x margin.
    #[test]
    fn backward_factors_and_gradient_norm((seed, mut sizes, m, softmax) in shapes(), wide in 8usize..=40) {
        sizes[1] = wide;
        let c = case(seed, sizes.clone(), Activation::Tanh, loss_of(softmax), m);
        let fwd = c.mlp.forward(c.x.as_ref()).unwrap();
        let b = c.mlp.backward(&fwd, c.targets.as_targets()).unwrap();
        let (layers, loss) = c.mlp.backward_factors(&fwd, c.targets.as_targets()).unwrap();
        prop_assert_eq!(loss.to_bits(), b.loss.to_bits());
        prop_assert_eq!(&layers, &b.layers);
        // `gradient_into` overwrites a reused buffer of the right length completely (NaN
        // poison) and fills one of another length: `backward`'s gradient bit for bit.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for start in [vec![f32::NAN; c.mlp.num_params()], vec![1.0; 3]] {
            let mut grad = start;
            let l2 = c.mlp.gradient_into(&fwd, c.targets.as_targets(), &mut grad).unwrap();
            prop_assert_eq!(l2.to_bits(), b.loss.to_bits());
            prop_assert_eq!(bits(&grad), bits(&b.grad));
        }
        for (l, s) in layers.iter().enumerate() {
            let range = c.mlp.layer_range(l).unwrap();
            let g = &b.grad[range];
            let exact: f64 = g.iter().map(|&v| v as f64 * v as f64).sum();
            let (e, a) = (s.e.as_ref(), s.a.as_ref());
            let (d_out, d_in) = (e.cols(), a.cols());
            let gram = |x: &MatRef<'_, f32>, k: usize, l2: usize| -> f64 {
                (0..x.cols()).map(|j| (x.at(k, j) as f64 * x.at(l2, j) as f64).abs()).sum()
            };
            let mut abs = 0.0;
            for k in 0..m {
                for l2 in 0..m {
                    abs += gram(&e, k, l2) * gram(&a, k, l2);
                }
            }
            abs /= (m * m) as f64;
            let k = m.max(d_out + d_in) as f64;
            let tol = 4.0 * 2.0 * k * 2f64.powi(-24) * abs;
            let got = s.gradient_norm_sq().unwrap();
            prop_assert!((got - exact).abs() <= tol, "layer {l}: {got} vs {exact} (tol {tol:e})");
        }
    }

    /// The output Jacobian against central differences of the outputs (probabilities or raw
    /// outputs), every parameter; the tolerance argument of the file header applies per output.
    #[test]
    fn output_jacobian_matches_finite_differences((seed, sizes, m, softmax) in shapes()) {
        let mut c = case(seed, sizes, Activation::Tanh, loss_of(softmax), m);
        let jac = c.mlp.output_jacobian(c.x.as_ref()).unwrap();
        let d_o = c.mlp.output_dim();
        let n = c.mlp.num_params();
        prop_assert_eq!(jac.h.shape(), (m * d_o, n));
        let fwd = c.mlp.forward(c.x.as_ref()).unwrap();
        prop_assert_eq!(jac.y.as_slice(), fwd.outputs().data());
        let theta = c.mlp.params().to_vec();
        let mut p = theta.clone();
        for i in 0..n {
            p[i] = theta[i] + H;
            c.mlp.set_params(&p).unwrap();
            let yp = c.mlp.forward(c.x.as_ref()).unwrap().outputs().data().to_vec();
            p[i] = theta[i] - H;
            c.mlp.set_params(&p).unwrap();
            let ym = c.mlp.forward(c.x.as_ref()).unwrap().outputs().data().to_vec();
            p[i] = theta[i];
            for r in 0..m * d_o {
                let fd = (yp[r] as f64 - ym[r] as f64) / (2.0 * H as f64);
                let exact = jac.h.as_ref().at(r, i) as f64;
                prop_assert!(close(fd, exact), "row {r} param {i}: fd {fd} vs {exact}");
            }
        }
    }

    /// `H_L v` against central differences of the gradient along `v` (every coordinate), and
    /// symmetry `wᵀ(H v) = vᵀ(H w)`. Gradients are O(1) with f32 rounding ≈ 1e-6, so the
    /// header's tolerance holds; symmetry differs only by rounding of two sums of n products.
    #[test]
    fn hvp_matches_finite_differences_and_is_symmetric((seed, sizes, m, softmax) in shapes()) {
        let mut c = case(seed, sizes, Activation::Tanh, loss_of(softmax), m);
        let n = c.mlp.num_params();
        let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(7));
        let v = unit_direction(&mut rng, n);
        let w = unit_direction(&mut rng, n);
        let t = c.targets.clone();
        let hv = c.mlp.hessian_vector_product(c.x.as_ref(), t.as_targets(), &v).unwrap();
        let hw = c.mlp.hessian_vector_product(c.x.as_ref(), t.as_targets(), &w).unwrap();
        let (a, b) = (dot(&w, &hv), dot(&v, &hw));
        prop_assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs().max(b.abs())), "wᵀHv {a} vs vᵀHw {b}");
        let theta = c.mlp.params().to_vec();
        let plus: Vec<f32> = theta.iter().zip(&v).map(|(t, d)| t + H * d).collect();
        let minus: Vec<f32> = theta.iter().zip(&v).map(|(t, d)| t - H * d).collect();
        let gp = grad_at(&mut c.mlp, &plus, &c.x, t.as_targets());
        let gm = grad_at(&mut c.mlp, &minus, &c.x, t.as_targets());
        for i in 0..n {
            let fd = (gp[i] as f64 - gm[i] as f64) / (2.0 * H as f64);
            prop_assert!(close(fd, hv[i] as f64), "coordinate {i}: fd {fd} vs R-op {}", hv[i]);
        }
    }

    /// RENG's `g + 2c·H g` against central differences of `L + c‖∇L‖²` along random
    /// directions; also the identity with separately computed `g` and `H g`.
    #[test]
    fn regularized_gradient_matches_finite_differences((seed, sizes, m, softmax) in shapes(), creg in 0.01f32..0.5) {
        let mut c = case(seed, sizes, Activation::Tanh, loss_of(softmax), m);
        let t = c.targets.clone();
        let (loss, rg) = c.mlp.regularized_gradient(c.x.as_ref(), t.as_targets(), creg).unwrap();
        let theta = c.mlp.params().to_vec();
        let g = grad_at(&mut c.mlp, &theta, &c.x, t.as_targets());
        let hg = c.mlp.hessian_vector_product(c.x.as_ref(), t.as_targets(), &g).unwrap();
        prop_assert!((loss as f64 - c.mlp.evaluate(c.x.as_ref(), t.as_targets()).unwrap() as f64).abs() < 1e-6);
        for i in 0..g.len() {
            let want = g[i] + 2.0 * creg * hg[i];
            prop_assert!((rg[i] - want).abs() <= 1e-5 * (1.0 + want.abs()));
        }
        // From a forward pass computed by the caller (the trainer's, shared with the Fisher
        // statistics): the same numbers, bit for bit.
        let fwd = c.mlp.forward(c.x.as_ref()).unwrap();
        let (loss2, rg2) = c.mlp.regularized_gradient_from(&fwd, t.as_targets(), creg).unwrap();
        prop_assert_eq!(loss2.to_bits(), loss.to_bits());
        prop_assert!(rg2.iter().zip(&rg).all(|(a, b)| a.to_bits() == b.to_bits()));
        let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(11));
        let objective = |mlp: &mut Mlp, p: &[f32]| -> f64 {
            let gp = grad_at(mlp, p, &c.x, t.as_targets());
            loss_at(mlp, p, &c.x, t.as_targets()) + creg as f64 * dot(&gp, &gp)
        };
        for _ in 0..4 {
            let v = unit_direction(&mut rng, theta.len());
            let plus: Vec<f32> = theta.iter().zip(&v).map(|(t, d)| t + H * d).collect();
            let minus: Vec<f32> = theta.iter().zip(&v).map(|(t, d)| t - H * d).collect();
            let fd = (objective(&mut c.mlp, &plus) - objective(&mut c.mlp, &minus)) / (2.0 * H as f64);
            let exact = dot(&rg, &v);
            prop_assert!(close(fd, exact), "directional derivative: fd {fd} vs {exact}");
        }
    }

    /// Exact mode: `(1/(mC)) ÊᵀÊ` equals the explicit `(1/m) Σ_k Σ_c p_kc e_kc e_kcᵀ` built from
    /// one-sample backward passes with label c (softmax), or `(1/m) Σ_k Σ_j J_kjᵀ J_kj` from the
    /// output Jacobian's per-output rows (squared error); `(1/(mC)) AᵀA = (1/m) AᵀA`. Both
    /// sides are f32 sums of ≤ m·C O(1) terms: 1e-4 relative.
    #[test]
    fn exact_fisher_matches_explicit_expectation((seed, sizes, m, softmax) in shapes(), relu in any::<bool>()) {
        let act = if relu { Activation::Relu } else { Activation::Tanh };
        let c = case(seed, sizes.clone(), act, loss_of(softmax), m);
        let cls = c.mlp.output_dim();
        let fwd = c.mlp.forward(c.x.as_ref()).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let exact = c.mlp.fisher_stats(&fwd, FisherMode::Exact, c.targets.as_targets(), &mut rng).unwrap();
        let plain = c.mlp.backward(&fwd, c.targets.as_targets()).unwrap();
        for (l, s) in exact.iter().enumerate() {
            let (rows, cols) = c.mlp.layer_shape(l).unwrap();
            prop_assert_eq!(s.e.shape(), (m * cls, rows));
            prop_assert_eq!(s.a.shape(), (m * cls, cols));
            let gram = |x: &Mat, i: usize, j: usize| -> f64 {
                (0..x.rows()).map(|k| x.as_ref().at(k, i) as f64 * x.as_ref().at(k, j) as f64).sum::<f64>() / x.rows() as f64
            };
            for i in 0..cols {
                for j in 0..cols {
                    let (a, b) = (gram(&s.a, i, j), gram(&plain.layers[l].a, i, j));
                    prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()));
                }
            }
            // Explicit Γ.
            let mut want = vec![0.0f64; rows * rows];
            for k in 0..m {
                let xk = MatRef::new(c.x.as_ref().row(k), 1, sizes[0]).unwrap();
                let fk = c.mlp.forward(xk).unwrap();
                for label in 0..cls {
                    let (weight, one) = if softmax {
                        (fwd.outputs().at(k, label) as f64, TargetsBuf::Classes(vec![label]))
                    } else {
                        // e = ŷ − t with t = ŷ − onehot: a unit output gradient, weight 1.
                        let mut t = fk.outputs().data().to_vec();
                        t[label] -= 1.0;
                        (1.0, TargetsBuf::Values(Mat::from_vec(t, 1, cls).unwrap()))
                    };
                    let e = c.mlp.backward(&fk, one.as_targets()).unwrap().layers[l].e.clone();
                    for p in 0..rows {
                        for q in 0..rows {
                            want[p * rows + q] += weight * e.as_slice()[p] as f64 * e.as_slice()[q] as f64 / m as f64;
                        }
                    }
                }
            }
            for p in 0..rows {
                for q in 0..rows {
                    let got = gram(&s.e, p, q);
                    let w = want[p * rows + q];
                    prop_assert!((got - w).abs() <= 1e-4 * (1.0 + w.abs()), "layer {l} Γ({p},{q}): {got} vs {w}");
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(12))]

    /// Sampled mode is an unbiased one-sample estimate of the exact Γ: the mean of T draws of
    /// `(1/m) EᵀE` must lie within 6 standard errors (estimated from the same draws) of the
    /// exact value, entry by entry, plus 1e-6 for entries whose variance is ~0. A false alarm
    /// per entry has probability < 1e-8 (Chebyshev-free: T = 3000 makes the mean Gaussian).
    /// Empirical mode reproduces the data-label statistics.
    #[test]
    fn sampled_fisher_approaches_exact((seed, sizes, m, softmax) in shapes()) {
        let c = case(seed, sizes, Activation::Tanh, loss_of(softmax), m);
        let fwd = c.mlp.forward(c.x.as_ref()).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xf15);
        let t = c.targets.as_targets();
        let exact = c.mlp.fisher_stats(&fwd, FisherMode::Exact, t, &mut rng).unwrap();
        let emp = c.mlp.fisher_stats(&fwd, FisherMode::Empirical, t, &mut rng).unwrap();
        prop_assert_eq!(&emp, &c.mlp.backward(&fwd, t).unwrap().layers);
        const T: usize = 3000;
        let nl = c.mlp.num_layers();
        let mut sum: Vec<Vec<f64>> = (0..nl).map(|l| vec![0.0; exact[l].e.cols().pow(2)]).collect();
        let mut sum_sq = sum.clone();
        for _ in 0..T {
            let s = c.mlp.fisher_stats(&fwd, FisherMode::Sampled, t, &mut rng).unwrap();
            for l in 0..nl {
                let e = &s[l].e;
                let d = e.cols();
                for p in 0..d {
                    for q in 0..d {
                        let v: f64 = (0..m).map(|k| e.as_ref().at(k, p) as f64 * e.as_ref().at(k, q) as f64).sum::<f64>() / m as f64;
                        sum[l][p * d + q] += v;
                        sum_sq[l][p * d + q] += v * v;
                    }
                }
            }
        }
        for l in 0..nl {
            let e = &exact[l].e;
            let d = e.cols();
            let rows = e.rows() as f64;
            for p in 0..d {
                for q in 0..d {
                    let want: f64 = (0..e.rows()).map(|k| e.as_ref().at(k, p) as f64 * e.as_ref().at(k, q) as f64).sum::<f64>() / rows;
                    let mean = sum[l][p * d + q] / T as f64;
                    let var = (sum_sq[l][p * d + q] / T as f64 - mean * mean).max(0.0);
                    let se = (var / T as f64).sqrt();
                    prop_assert!((mean - want).abs() <= 6.0 * se + 1e-6 + 1e-4 * want.abs(),
                        "layer {l} Γ({p},{q}): sampled {mean} ± {se} vs exact {want}");
                }
            }
        }
    }
}

#[test]
fn sampled_gradient_uses_sampled_labels() {
    let c = case(
        common::seed(),
        vec![4, 5, 3],
        Activation::Tanh,
        Loss::SoftmaxCrossEntropy,
        6,
    );
    let fwd = c.mlp.forward(c.x.as_ref()).unwrap();
    let seed = common::seed();
    let mut r1 = ChaCha8Rng::seed_from_u64(seed);
    let mut r2 = ChaCha8Rng::seed_from_u64(seed);
    let b = c.mlp.backward_sampled(&fwd, &mut r1).unwrap();
    let labels = c.mlp.sample_targets(&fwd, &mut r2).unwrap();
    assert_eq!(b, c.mlp.backward(&fwd, labels.as_targets()).unwrap());
    assert_eq!(b.grad.len(), c.mlp.num_params());
}

#[test]
fn bad_input_gets_typed_errors_and_changes_nothing() {
    let mut c = case(
        common::seed(),
        vec![3, 4, 3],
        Activation::Tanh,
        Loss::SoftmaxCrossEntropy,
        4,
    );
    let fwd = c.mlp.forward(c.x.as_ref()).unwrap();
    let before = c.mlp.params().to_vec();
    let mut rng = common::seeded_rng();
    // Label out of range, wrong label count, value targets with softmax.
    assert!(matches!(
        c.mlp.backward(&fwd, Targets::Classes(&[0, 1, 3, 0])),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        c.mlp.backward(&fwd, Targets::Classes(&[0, 1])),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        c.mlp.gradient(&fwd, Targets::Classes(&[0, 1])),
        Err(Error::Shape { .. })
    ));
    let vals = Mat::zeros(4, 3);
    assert!(matches!(
        c.mlp.backward(&fwd, Targets::Values(vals.as_ref())),
        Err(Error::Shape { .. })
    ));
    // Wrong input width, empty batch, NaN input.
    assert!(matches!(
        c.mlp.forward(Mat::zeros(2, 5).as_ref()),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        c.mlp.forward(Mat::zeros(0, 3).as_ref()),
        Err(Error::Shape { .. })
    ));
    let mut nan = c.x.clone();
    nan.as_mut_slice()[2] = f32::NAN;
    assert!(matches!(
        c.mlp.forward(nan.as_ref()),
        Err(Error::NonFinite { index: 2, .. })
    ));
    // HVP direction of the wrong length / non-finite, negative regularizer.
    let y = [0usize, 1, 2, 0];
    let t = Targets::Classes(&y);
    assert!(matches!(
        c.mlp.hessian_vector_product(c.x.as_ref(), t, &[1.0; 3]),
        Err(Error::Shape { .. })
    ));
    let mut v = vec![0.5; c.mlp.num_params()];
    v[0] = f32::INFINITY;
    assert!(matches!(
        c.mlp.hessian_vector_product(c.x.as_ref(), t, &v),
        Err(Error::NonFinite { .. })
    ));
    assert!(matches!(
        c.mlp.regularized_gradient(c.x.as_ref(), t, -1.0),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        c.mlp.regularized_gradient_from(&fwd, t, f32::NAN),
        Err(Error::Value { arg: "c", .. })
    ));
    assert!(matches!(c.mlp.layer_shape(2), Err(Error::Value { .. })));
    // set_params with NaN leaves the parameters unchanged.
    let mut bad = before.clone();
    bad[1] = f32::NAN;
    assert!(matches!(
        c.mlp.set_params(&bad),
        Err(Error::NonFinite { index: 1, .. })
    ));
    assert!(matches!(
        c.mlp.set_params(&bad[1..]),
        Err(Error::Shape { .. })
    ));
    assert_eq!(c.mlp.params(), &before[..]);
    // A Forward from other parameters is refused, in every consumer.
    c.mlp.params_mut()[0] += 1.0;
    assert!(matches!(
        c.mlp.backward(&fwd, t),
        Err(Error::Value { arg: "fwd", .. })
    ));
    assert!(matches!(
        c.mlp.fisher_stats(&fwd, FisherMode::Exact, t, &mut rng),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        c.mlp.sample_targets(&fwd, &mut rng),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        c.mlp.regularized_gradient_from(&fwd, t, 0.1),
        Err(Error::Value { arg: "fwd", .. })
    ));
    let other = c.mlp.clone();
    let fwd2 = c.mlp.forward(c.x.as_ref()).unwrap();
    assert!(other.backward(&fwd2, t).is_err());
    // A forward pass checks the parameters once per change (a cached stamp): a NaN written
    // through the mutable accessors after a clean pass is still caught, and so is one in a
    // single layer, and a clone checks its own copy.
    let k = c.mlp.num_params() - 1;
    c.mlp.params_mut()[k] = f32::NAN;
    assert!(matches!(
        c.mlp.forward(c.x.as_ref()),
        Err(Error::NonFinite { arg: "params", index, .. }) if index == k
    ));
    c.mlp.params_mut()[k] = 0.5;
    c.mlp.forward(c.x.as_ref()).unwrap();
    c.mlp.layer_mut(0).unwrap().data_mut()[0] = f32::INFINITY;
    let inf_clone = c.mlp.clone();
    assert!(matches!(
        c.mlp.forward(c.x.as_ref()),
        Err(Error::NonFinite {
            arg: "params",
            index: 0,
            ..
        })
    ));
    assert!(inf_clone.forward(c.x.as_ref()).is_err());
    // Bad configurations.
    let cfg = |sizes: Vec<usize>| MlpConfig {
        sizes,
        activation: Activation::Relu,
        loss: Loss::SquaredError,
    };
    assert!(Mlp::new(cfg(vec![3]), 0).is_err());
    assert!(Mlp::new(cfg(vec![3, 0, 2]), 0).is_err());
}

#[test]
fn parameter_layout_and_init() {
    let cfg = MlpConfig {
        sizes: vec![64, 64, 10],
        activation: Activation::Relu,
        loss: Loss::SoftmaxCrossEntropy,
    };
    let a = Mlp::new(cfg.clone(), 5).unwrap();
    assert_eq!(a.num_params(), 64 * 65 + 10 * 65);
    assert_eq!(a.layer_shapes(), vec![(64, 65), (10, 65)]);
    assert_eq!(a.layer_range(1).unwrap(), 64 * 65..64 * 65 + 650);
    // Deterministic by seed, He-uniform bound, zero biases.
    assert_eq!(a.params(), Mlp::new(cfg.clone(), 5).unwrap().params());
    assert_ne!(a.params(), Mlp::new(cfg, 6).unwrap().params());
    let w = a.layer(0).unwrap();
    let s = (6.0f32 / 64.0).sqrt();
    for p in 0..64 {
        assert_eq!(w.at(p, 64), 0.0);
        assert!(w.row(p)[..64].iter().all(|v| v.abs() <= s));
    }
}

#[test]
fn digits_data_set() {
    let d = digits().unwrap();
    assert_eq!((d.len(), d.dim(), d.classes), (1797, 64, 10));
    assert!(d.x.as_slice().iter().all(|&v| (0.0..=1.0).contains(&v)));
    assert!(d.x.as_slice().contains(&1.0));
    let mut counts = [0usize; 10];
    d.labels.iter().for_each(|&y| counts[y] += 1);
    assert!(
        counts.iter().all(|&c| (170..=190).contains(&c)),
        "{counts:?}"
    );
    let (tr, va, te) = d.split(42, (0.7, 0.15)).unwrap();
    assert_eq!((tr.len(), va.len(), te.len()), (1258, 270, 269));
    assert_eq!(
        d.split(42, (0.7, 0.15)).unwrap(),
        (tr.clone(), va.clone(), te.clone())
    );
    assert_ne!(d.split(43, (0.7, 0.15)).unwrap().0, tr);
    // The parts partition the samples: the multiset of rows is preserved.
    let key = |ds: &Dataset| -> Vec<(Vec<u32>, usize)> {
        (0..ds.len())
            .map(|i| {
                (
                    ds.x.as_ref().row(i).iter().map(|v| v.to_bits()).collect(),
                    ds.labels[i],
                )
            })
            .collect()
    };
    let mut all = key(&tr);
    all.extend(key(&va));
    all.extend(key(&te));
    all.sort();
    let mut orig = key(&d);
    orig.sort();
    assert_eq!(all, orig);
    assert!(d.split(0, (0.8, 0.3)).is_err());
    assert!(d.split(0, (-0.1, 0.3)).is_err());
}

#[test]
fn batches_and_gather() {
    let d = synthetic_classification(103, 5, 3, 1).unwrap();
    let batches: Vec<Vec<usize>> = d.batches(7, 0, 10).unwrap().collect();
    assert_eq!(batches.len(), 11);
    assert_eq!(batches[10].len(), 3);
    let mut seen: Vec<usize> = batches.concat();
    seen.sort();
    assert_eq!(seen, (0..103).collect::<Vec<_>>());
    assert_eq!(batches, d.batches(7, 0, 10).unwrap().collect::<Vec<_>>());
    assert_ne!(batches, d.batches(7, 1, 10).unwrap().collect::<Vec<_>>());
    assert!(d.batches(7, 0, 0).is_err());
    let (x, y) = d.gather(&batches[0]).unwrap();
    assert_eq!(x.shape(), (10, 5));
    for (r, &i) in batches[0].iter().enumerate() {
        assert_eq!(x.as_ref().row(r), d.x.as_ref().row(i));
        assert_eq!(y[r], d.labels[i]);
    }
    assert!(matches!(d.gather(&[0, 103]), Err(Error::Value { .. })));
}

/// The synthetic task is learnable: full-batch gradient descent on a small tanh MLP reaches
/// ≥ 95% training accuracy (measured ≈ 100%; the Bayes accuracy of well-separated blobs with
/// noise 0.2 is ≈ 1).
#[test]
fn synthetic_classification_is_learnable() {
    let d = synthetic_classification(240, 8, 4, 3).unwrap();
    assert_eq!((d.len(), d.dim(), d.classes), (240, 8, 4));
    assert_eq!(d, synthetic_classification(240, 8, 4, 3).unwrap());
    let mut mlp = Mlp::new(
        MlpConfig {
            sizes: vec![8, 16, 4],
            activation: Activation::Tanh,
            loss: Loss::SoftmaxCrossEntropy,
        },
        0,
    )
    .unwrap();
    let t = Targets::Classes(&d.labels);
    for _ in 0..200 {
        let fwd = mlp.forward(d.x.as_ref()).unwrap();
        let g = mlp.backward(&fwd, t).unwrap().grad;
        mlp.params_mut()
            .iter_mut()
            .zip(&g)
            .for_each(|(p, g)| *p -= 0.5 * g);
    }
    let fwd = mlp.forward(d.x.as_ref()).unwrap();
    let acc = mlp.accuracy(&fwd, &d.labels).unwrap();
    assert!(acc >= 0.95, "accuracy {acc}");
    assert_eq!(mlp.predict(d.x.as_ref()).unwrap(), fwd.argmax());
}

/// With zero noise the returned `[W b]` reproduces `y` exactly (f32 rounding of d-term dots).
#[test]
fn linear_regression_data() {
    let (x, y, w) = linear_regression(50, 6, 3, 0.0, 4).unwrap();
    assert_eq!(
        (x.shape(), y.shape(), w.shape()),
        ((50, 6), (50, 3), (3, 7))
    );
    let mut mlp = Mlp::new(
        MlpConfig {
            sizes: vec![6, 3],
            activation: Activation::Tanh,
            loss: Loss::SquaredError,
        },
        0,
    )
    .unwrap();
    mlp.set_params(w.as_slice()).unwrap();
    let fwd = mlp.forward(x.as_ref()).unwrap();
    for (a, b) in fwd.outputs().data().iter().zip(y.as_slice()) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()));
    }
    assert!(mlp.loss(&fwd, Targets::Values(y.as_ref())).unwrap() < 1e-10);
    let (_, y2, _) = linear_regression(50, 6, 3, 0.5, 4).unwrap();
    assert_ne!(y, y2);
    assert!(linear_regression(5, 0, 1, 0.1, 0).is_err());
    assert!(linear_regression(5, 2, 1, -0.1, 0).is_err());
}

proptest! {
    #![proptest_config(common::proptest_config(16))]

    /// `Mlp::evaluate_from_first` from `forward_keeping_first`'s `z_0` and `dz = 0` is
    /// `Mlp::evaluate` bit for bit (the same `φ`, products and loss), for one to three layers,
    /// both activations and both losses; with `dz = x̄_0·ΔW̄_0ᵀ` (f64, rounded) it is the
    /// evaluation after `W̄_0 ← W̄_0 + ΔW̄_0` up to rounding (`10⁻⁴` relative to the loss: the
    /// two round `z_0` differently, by `~d_0·2⁻²⁴` of `|x̄||W̄|`). Wrong shapes are typed errors.
    #[test]
    fn evaluation_from_the_first_layer_outputs(
        seed in any::<u64>(),
        sizes in prop::collection::vec(1usize..=12, 2..=4),
        m in 1usize..=9,
        relu in any::<bool>(),
        squared in any::<bool>(),
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (d0, d1) = (sizes[0], sizes[1]);
        let config = MlpConfig {
            sizes: sizes.clone(),
            activation: if relu { Activation::Relu } else { Activation::Tanh },
            loss: if squared { Loss::SquaredError } else { Loss::SoftmaxCrossEntropy },
        };
        let mut mlp = Mlp::new(config, seed).unwrap();
        let c = *sizes.last().unwrap();
        let xv: Vec<f32> = (0..m * d0).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let x = MatRef::new(&xv, m, d0).unwrap();
        let labels: Vec<usize> = (0..m).map(|_| rng.random_range(0..c)).collect();
        let tv: Vec<f32> = (0..m * c).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let targets = if squared {
            Targets::Values(MatRef::new(&tv, m, c).unwrap())
        } else {
            Targets::Classes(&labels)
        };
        let fwd = mlp.forward_keeping_first(x).unwrap();
        let kept = fwd.first_outputs().expect("kept");
        prop_assert_eq!(kept.shape(), (m, d1));
        let z0: Vec<f32> = (0..m).flat_map(|r| kept.row(r).to_vec()).collect();
        let z0 = Mat::from_vec(z0, m, d1).unwrap();
        prop_assert!(mlp.forward(x).unwrap().first_outputs().is_none());
        let zero = Mat::zeros(m, d1);
        let want = mlp.evaluate(x, targets).unwrap();
        let got = mlp.evaluate_from_first(z0.as_ref(), zero.as_ref(), targets).unwrap();
        prop_assert_eq!(got.to_bits(), want.to_bits());
        // A change of layer 0's weights, through `dz`.
        let dw: Vec<f32> = (0..d1 * (d0 + 1)).map(|_| rng.random_range(-0.1f32..0.1)).collect();
        let dz: Vec<f32> = (0..m * d1)
            .map(|k| {
                let (r, j) = (k / d1, k % d1);
                let xbar = |p: usize| if p < d0 { xv[r * d0 + p] as f64 } else { 1.0 };
                (0..=d0).map(|p| xbar(p) * dw[j * (d0 + 1) + p] as f64).sum::<f64>() as f32
            })
            .collect();
        let dz = Mat::from_vec(dz, m, d1).unwrap();
        let got = mlp.evaluate_from_first(z0.as_ref(), dz.as_ref(), targets).unwrap();
        let mut l0 = mlp.layer_mut(0).unwrap();
        for r in 0..d1 {
            for (w, d) in l0.row_mut(r).iter_mut().zip(&dw[r * (d0 + 1)..]) {
                *w += d;
            }
        }
        let want = mlp.evaluate(x, targets).unwrap();
        prop_assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{got} vs {want}");
        // Shapes: `z0`, `dz` `m x d_1`, targets for `m` rows.
        let wide = Mat::zeros(m, d1 + 1);
        for (z, d) in [(wide.as_ref(), zero.as_ref()), (z0.as_ref(), wide.as_ref())] {
            let err = mlp.evaluate_from_first(z, d, targets).unwrap_err();
            prop_assert!(matches!(err, Error::Shape { .. }), "{err:?}");
        }
    }
}
