//! grng inside candle (`grng-candle`): zero-copy views, captured Kronecker statistics
//! against the reference MLP, optimizer steps against grng's own API, and bad input.

use grng_testkit as common;

use candle_core::{DType, Device as CDevice, Tensor};
use grng::{Device, Error};
use grng_candle::{with_matrices, with_matrix, ViewAs};
use proptest::prelude::*;

/// Address of a CPU f32 tensor's buffer.
fn buffer_addr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    match &*s {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.as_ptr() as usize,
        _ => panic!("not a CPU f32 tensor"),
    }
}

fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn tensor(vals: &[f32], rows: usize, cols: usize) -> Tensor {
    Tensor::from_slice(vals, (rows, cols), &CDevice::Cpu).unwrap()
}

proptest! {
    #![proptest_config(common::proptest_config(24))]

    /// A view is the tensor's own buffer (same pointer), shaped as the tensor; what grng writes
    /// is what the tensor holds afterwards, and the buffer a matrix ends with is moved (same
    /// pointer) into its tensor: grng's ops commit by swapping in the buffer they computed.
    #[test]
    fn views_are_zero_copy(rows in 1usize..40, cols in 1usize..40, seed in any::<u64>()) {
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed);
        let x: Vec<f32> = (0..rows * cols).map(|_| rand::Rng::random_range(&mut rng, -1.0f32..1.0)).collect();
        let y: Vec<f32> = (0..rows * cols).map(|_| rand::Rng::random_range(&mut rng, -1.0f32..1.0)).collect();
        let (tx, ty) = (tensor(&x, rows, cols), tensor(&y, rows, cols));
        let (px, py) = (buffer_addr(&tx), buffer_addr(&ty));
        let seen = with_matrices(&[&ty, &tx], ViewAs::Matrix, |ms| {
            let (dst, src) = ms.split_at_mut(1);
            let ptrs = (dst[0].host().unwrap().as_ptr() as usize, src[0].host().unwrap().as_ptr() as usize);
            let shapes = (dst[0].shape(), src[0].shape());
            Device::Cpu.axpy(0.5, &src[0], &mut dst[0])?; // y ← y + x/2
            Ok((ptrs, shapes, dst[0].host().unwrap().as_ptr() as usize))
        }).unwrap();
        prop_assert_eq!(seen.0, (py, px));
        prop_assert_eq!(seen.1, ((rows, cols), (rows, cols)));
        prop_assert_eq!(buffer_addr(&tx), px);
        prop_assert_eq!(buffer_addr(&ty), seen.2);
        prop_assert_eq!(host(&tx), x.clone());
        // axpy rounds once per element: f32 `y + 0.5 x` exactly as computed here.
        let want: Vec<f32> = y.iter().zip(&x).map(|(y, x)| y + 0.5 * x).collect();
        prop_assert_eq!(host(&ty), want);
        let col = with_matrix(&tx, ViewAs::Column, |m| Ok(m.shape())).unwrap();
        prop_assert_eq!(col, (rows * cols, 1));
    }
}

fn assert_tensor_error<T: std::fmt::Debug>(r: grng::Result<T>) {
    assert!(matches!(r, Err(Error::Tensor { .. })), "{r:?}");
}

/// The views of `t` (f32, contiguous, 3 rows) refused with [`Error::Tensor`], nothing lent:
/// other dtypes, a transpose (strided), row ranges (an offset, part of the storage), one
/// storage twice.
fn assert_bad_views_refused(t: &Tensor) {
    let never = |_: &mut grng::Matrix| -> grng::Result<()> { panic!("must not be lent") };
    for bad in [
        t.to_dtype(DType::F64),
        t.to_dtype(DType::BF16),
        t.t(),
        t.narrow(0, 1, 2),
        t.narrow(0, 0, 2),
    ] {
        assert_tensor_error(with_matrix(&bad.unwrap(), ViewAs::Matrix, never));
    }
    assert_tensor_error(with_matrices(&[t, &t.clone()], ViewAs::Matrix, |_| Ok(())));
}

/// A closure that panics while `t` is lent: the panic goes on, and `t` holds zeros of its
/// length (its buffer was dropped with the matrix), not a buffer shorter than itself.
fn assert_refilled_after_panic(t: &Tensor) {
    let lent = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        with_matrix(t, ViewAs::Matrix, |_| -> grng::Result<()> {
            panic!("a closure panicking on purpose")
        })
    }));
    assert!(lent.is_err());
    assert_eq!(host(t), vec![0.0; t.elem_count()]);
}

/// dtype, strides, offsets, partial storages, ranks, aliasing and failing closures are typed
/// errors, and the tensors keep their values.
#[test]
fn bad_views_are_typed_errors_and_change_nothing() {
    let vals: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let t = tensor(&vals, 3, 4);
    let never = |_: &mut grng::Matrix| -> grng::Result<()> { panic!("must not be lent") };
    assert_bad_views_refused(&t);
    let r3 = t.reshape((3, 2, 2)).unwrap();
    assert!(matches!(
        with_matrix(&r3, ViewAs::Matrix, never),
        Err(Error::Shape { .. })
    ));
    assert_eq!(
        with_matrix(&r3, ViewAs::Column, |m| Ok(m.shape())).unwrap(),
        (12, 1)
    );
    let empty = Tensor::zeros((0, 3), DType::F32, &CDevice::Cpu).unwrap();
    assert!(matches!(
        with_matrix(&empty, ViewAs::Matrix, never),
        Err(Error::Shape { .. })
    ));
    // A grng error inside the view: propagated, the tensor as it was.
    let other = Device::Cpu.zeros(4, 3).unwrap();
    let r = with_matrix(&t, ViewAs::Matrix, |m| Device::Cpu.axpy(1.0, &other, m));
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    // A closure that swaps in a matrix of another shape: an error, the tensor stays valid.
    let r = with_matrix(&t, ViewAs::Matrix, |m| {
        *m = Device::Cpu.zeros(2, 2)?;
        Ok(())
    });
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    assert_eq!(host(&t).len(), 12);
    assert_refilled_after_panic(&tensor(&vals, 3, 4));
    // Devices: candle's CPU, and CUDA with feature `cuda` only (its arms are in `mod cuda`).
    assert!(grng_candle::candle_device("cpu").unwrap().is_cpu());
    let cuda_too = (!cfg!(feature = "cuda")).then_some("cuda");
    for name in ["metal", "", "cuda:x"].into_iter().chain(cuda_too) {
        let r = grng_candle::candle_device(name);
        assert!(matches!(r, Err(Error::DeviceUnavailable(_))), "{name}");
    }
}

// ---- Layers and captured statistics against the reference MLP ----

use candle_core::{Module, Var};
use grng::mat::Mat;
use grng::optim::adamw::{AdamW, AdamWConfig};
use grng::optim::kron::{KronConfig, KronGrad, KronOptimizer, KronVariant};
use grng::optim::sgd::{Sgd, SgdConfig};
use grng::optim::sophia::{Sophia, SophiaConfig, SophiaHessian};
use grng::optim::KronStats;
use grng_candle::{capture_fisher, GrngConfig, GrngOptimizer, KronLinear};
use grng_train::mlp::{Activation, FisherMode, Loss, Mlp, MlpConfig, Targets};
use grng_train::train::OptimizerConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A reference tanh/softmax MLP, the same network as `KronLinear`s, a batch and its labels.
struct Case {
    mlp: Mlp,
    layers: Vec<KronLinear>,
    x: Mat,
    labels: Vec<usize>,
}

fn case(sizes: Vec<usize>, m: usize, seed: u64) -> Case {
    let classes = *sizes.last().unwrap();
    let config = MlpConfig {
        sizes,
        activation: Activation::Tanh,
        loss: Loss::SoftmaxCrossEntropy,
    };
    let mlp = Mlp::new(config, seed).unwrap();
    let layers = (0..mlp.num_layers())
        .map(|l| {
            let w = mlp.layer(l).unwrap();
            KronLinear::from_weights(&tensor(w.data(), w.rows(), w.cols())).unwrap()
        })
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let d0 = mlp.input_dim();
    let x = Mat::from_vec(
        (0..m * d0).map(|_| rng.random_range(-1.0..1.0)).collect(),
        m,
        d0,
    )
    .unwrap();
    let labels = (0..m).map(|_| rng.random_range(0..classes)).collect();
    Case {
        mlp,
        layers,
        x,
        labels,
    }
}

/// Copies of `layers` (same weights) on candle device `dev`.
fn layers_on(layers: &[KronLinear], dev: &CDevice) -> Vec<KronLinear> {
    layers
        .iter()
        .map(|l| KronLinear::from_weights(&l.weight().to_device(dev).unwrap()).unwrap())
        .collect()
}

/// The candle forward pass (recording) on the layers' device, logits `m x C` scaled by `scale`
/// when given.
fn logits(layers: &[KronLinear], x: &Mat, scale: Option<&Var>) -> Tensor {
    let dev = layers[0].weight().device();
    let mut h = tensor(x.as_slice(), x.rows(), x.cols())
        .to_device(dev)
        .unwrap();
    for (l, layer) in layers.iter().enumerate() {
        h = layer.forward(&h).unwrap();
        if l + 1 < layers.len() {
            h = h.tanh().unwrap();
        }
    }
    match scale {
        Some(s) => h.broadcast_mul(s.as_tensor()).unwrap(),
        None => h,
    }
}

/// `GrngOptimizer` running `method` on the layers' weights (AdamW on nothing else), and those
/// weights.
fn optimizer_on(layers: &[KronLinear], method: OptimizerConfig) -> (Vec<Var>, GrngOptimizer) {
    let vars: Vec<Var> = layers.iter().map(|l| l.weight().clone()).collect();
    let config = GrngConfig {
        method,
        rest: AdamWConfig::default(),
        layers: layers.to_vec(),
    };
    let opt = GrngOptimizer::try_new(vars.clone(), config).unwrap();
    (vars, opt)
}

/// The cross-entropy of the logits `z` against `labels`: its value and gradients, with the
/// Fisher statistics captured (labels sampled from `rng`) when `opt` needs them.
fn backward(
    opt: &GrngOptimizer,
    layers: &[KronLinear],
    z: &Tensor,
    labels: &[usize],
    rng: &mut ChaCha8Rng,
) -> (f32, candle_core::backprop::GradStore) {
    let loss = candle_nn::loss::cross_entropy(z, &labels_tensor(labels, z.device())).unwrap();
    let grads = loss.backward().unwrap();
    if opt.needs_fisher() {
        capture_fisher(layers, z, FisherMode::Sampled, &u32s(labels), rng).unwrap();
    }
    (loss.to_scalar::<f32>().unwrap(), grads)
}

fn labels_tensor(labels: &[usize], dev: &CDevice) -> Tensor {
    Tensor::from_slice(&u32s(labels), labels.len(), dev).unwrap()
}

fn u32s(labels: &[usize]) -> Vec<u32> {
    labels.iter().map(|&y| y as u32).collect()
}

/// `max |a − b|`.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

proptest! {
    #![proptest_config(common::proptest_config(12))]

    /// `A`, `E` in every Fisher mode and the gradient `G` of `W̄` equal the reference MLP's on
    /// the same weights and batch (sampled labels drawn from the same seed). Values are O(1)
    /// and both sides sum at most a few dozen f32 products per element: 1e-5 is ~100 ulps.
    #[test]
    fn captured_statistics_match_the_reference_mlp(
        d0 in 1usize..10, h in 1usize..10, c in 2usize..6, m in 1usize..17, seed in any::<u64>(),
    ) {
        let Case { mlp, layers, x, labels } = case(vec![d0, h, c], m, seed);
        let z = logits(&layers, &x, None);
        let loss = candle_nn::loss::cross_entropy(&z, &labels_tensor(&labels, z.device())).unwrap();
        let grads = loss.backward().unwrap();
        let fwd = mlp.forward(x.as_ref()).unwrap();
        let back = mlp.backward(&fwd, Targets::Classes(&labels)).unwrap();
        for (l, layer) in layers.iter().enumerate() {
            let g = host(grads.get(layer.weight().as_tensor()).unwrap());
            let range = mlp.layer_range(l).unwrap();
            prop_assert!(max_diff(&g, &back.grad[range]) <= 1e-5);
        }
        for mode in [FisherMode::Sampled, FisherMode::Empirical, FisherMode::Exact] {
            let mut rng_ref = ChaCha8Rng::seed_from_u64(seed);
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let want = mlp.fisher_stats(&fwd, mode, Targets::Classes(&labels), &mut rng_ref).unwrap();
            capture_fisher(&layers, &z, mode, &u32s(&labels), &mut rng).unwrap();
            for (layer, s) in layers.iter().zip(&want) {
                let (a, e) = layer.fisher_stats().unwrap();
                prop_assert_eq!(a.dims(), &[s.a.rows(), s.a.cols()]);
                prop_assert_eq!(e.dims(), &[s.e.rows(), s.e.cols()]);
                prop_assert!(max_diff(&host(&a), s.a.as_slice()) <= 1e-5, "{mode:?} A");
                prop_assert!(max_diff(&host(&e), s.e.as_slice()) <= 1e-5, "{mode:?} E");
            }
        }
    }
}

// ---- One optimizer step through candle = the same step through grng's API ----

fn mat(dev: &Device, t: &Tensor, rows: usize, cols: usize) -> grng::Matrix {
    dev.upload(rows, cols, &host(t)).unwrap()
}

/// Two steps of `method` on the case's network (plus a scalar output scale, a non-Kronecker
/// variable) on candle device `cdev` through `GrngOptimizer`, each checked bit for bit against
/// grng's own optimizers on `dev` fed the same weights, gradients and statistics.
/// `factored`: the optimizer takes RING's and NGD's gradients by their batch factors
/// (`GrngOptimizer::set_factored_gradients`), and the reference steps grng's own API with
/// the same factors (`KronOptimizer::step_grads`).
fn step_matches_grng(method: OptimizerConfig, cdev: &CDevice, dev: &Device, factored: bool) {
    let Case {
        layers, x, labels, ..
    } = case(vec![6, 5, 4], 12, common::seed());
    let layers = layers_on(&layers, cdev);
    let scale = Var::from_slice(&[1.0f32], 1, cdev).unwrap();
    let rest = AdamWConfig {
        lr: 1e-2,
        warmup_steps: 0,
        ..AdamWConfig::default()
    };
    let mut vars: Vec<Var> = layers.iter().map(|l| l.weight().clone()).collect();
    vars.push(scale.clone());
    let config = GrngConfig {
        method,
        rest,
        layers: layers.clone(),
    };
    let mut opt = GrngOptimizer::try_new(vars.clone(), config).unwrap();
    opt.set_factored_gradients(factored).unwrap();
    let shapes: Vec<_> = layers.iter().map(KronLinear::shape).collect();
    let mut kron_ref = match method {
        OptimizerConfig::Kron(k) => Some(KronOptimizer::new(dev, &shapes, k).unwrap()),
        _ => None,
    };
    // First-order references: one per variable (Kronecker methods: AdamW on the scale only).
    let flat_vars: Vec<&Var> = if kron_ref.is_some() {
        vec![&scale]
    } else {
        vars.iter().collect()
    };
    enum R {
        A(AdamW),
        S(Sgd),
        So(Sophia),
    }
    let mut flat_ref: Vec<R> = flat_vars
        .iter()
        .map(|v| {
            let n = v.elem_count();
            match method {
                OptimizerConfig::Sgd(c) => R::S(Sgd::new(dev, n, c).unwrap()),
                OptimizerConfig::Sophia(c) => R::So(Sophia::new(dev, n, c).unwrap()),
                OptimizerConfig::AdamW(c) => R::A(AdamW::new(dev, n, c).unwrap()),
                _ => R::A(AdamW::new(dev, n, rest).unwrap()),
            }
        })
        .collect();
    let mut rng = common::seeded_rng();
    for _ in 0..2 {
        let z = logits(&layers, &x, Some(&scale));
        let (_, grads) = backward(&opt, &layers, &z, &labels, &mut rng);
        let sampled = opt.needs_sophia_sample().then(|| {
            let y: Vec<usize> = (0..labels.len()).map(|_| rng.random_range(0..4)).collect();
            let g = candle_nn::loss::cross_entropy(&z, &labels_tensor(&y, z.device()))
                .unwrap()
                .backward()
                .unwrap();
            opt.set_sophia_sample(&g, labels.len());
            g
        });
        // The reference, from the same inputs.
        let mut want_kron: Vec<grng::Matrix> = Vec::new();
        if let Some(k) = &mut kron_ref {
            let mut ws: Vec<_> = layers
                .iter()
                .zip(&shapes)
                .map(|(l, &(r, c))| mat(dev, l.weight(), r, c))
                .collect();
            let gs: Vec<_> = layers
                .iter()
                .zip(&shapes)
                .map(|(l, &(r, c))| mat(dev, grads.get(l.weight()).unwrap(), r, c))
                .collect();
            let st: Vec<(grng::Matrix, grng::Matrix)> = layers
                .iter()
                .filter_map(|l| l.fisher_stats())
                .map(|(a, e)| {
                    (
                        mat(dev, &a, a.dims()[0], a.dims()[1]),
                        mat(dev, &e, e.dims()[0], e.dims()[1]),
                    )
                })
                .collect();
            let stats: Option<Vec<KronStats>> = k
                .needs_stats()
                .then(|| st.iter().map(|(a, e)| KronStats { a, e }).collect());
            let fs: Vec<(grng::Matrix, grng::Matrix)> = if factored {
                layers
                    .iter()
                    .zip(&gs)
                    .map(|(l, g)| {
                        let (e, a) = l.gradient_factors(&grads).unwrap().unwrap();
                        let (e, a) = (mat2(dev, &e), mat2(dev, &a));
                        check_factors(&e, &a, g);
                        (e, a)
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let kg: Vec<KronGrad> = if factored {
                fs.iter()
                    .map(|(e, a)| KronGrad::Factored { e, a })
                    .collect()
            } else {
                gs.iter().map(KronGrad::Dense).collect()
            };
            k.step_grads(&mut ws, &kg, stats.as_deref()).unwrap();
            want_kron = ws;
        }
        let want_flat: Vec<Vec<f32>> = flat_vars
            .iter()
            .zip(&mut flat_ref)
            .map(|(v, r)| {
                let n = v.elem_count();
                let mut p = mat(dev, v, n, 1);
                let g = mat(dev, grads.get(v).unwrap(), n, 1);
                match r {
                    R::A(o) => o.step(&mut p, &g).unwrap(),
                    R::S(o) => o.step(&mut p, &g).unwrap(),
                    R::So(o) => {
                        let s = sampled.as_ref().map(|s| mat(dev, s.get(v).unwrap(), n, 1));
                        let h = s.as_ref().map(|s| SophiaHessian {
                            sampled_grad: s,
                            batch: labels.len(),
                        });
                        o.step(&mut p, &g, h).unwrap()
                    }
                }
                p.to_vec().unwrap()
            })
            .collect();
        let info = opt.try_step(&grads).unwrap();
        assert_eq!(info.is_some(), kron_ref.is_some());
        for (l, w) in layers.iter().zip(&want_kron) {
            assert_eq!(host(l.weight()), w.to_vec().unwrap(), "{method:?}: W̄");
        }
        for (v, w) in flat_vars.iter().zip(&want_flat) {
            assert_eq!(&host(v), w, "{method:?}: flat variable");
        }
    }
}

/// A 2-D tensor as a grng matrix.
fn mat2(dev: &Device, t: &Tensor) -> grng::Matrix {
    mat(dev, t, t.dims()[0], t.dims()[1])
}

/// `(1/n)·eᵀa` is the dense gradient `g` candle computed: within `2(n + 2)·u·(1/n)Σ|e||a|` per
/// entry (candle's f32 product of the probe's gradient, `(n + 1)u`, and `e = n·Ē` rounded,
/// `u`; the f64 sum here is exact enough), so the factors are the gradient's.
fn check_factors(e: &grng::Matrix, a: &grng::Matrix, g: &grng::Matrix) {
    let (n, o, i) = (e.rows(), e.cols(), a.cols());
    assert_eq!((a.rows(), g.shape()), (n, (o, i)));
    let (ev, av, gv) = (
        e.to_vec().unwrap(),
        a.to_vec().unwrap(),
        g.to_vec().unwrap(),
    );
    let u = f32::EPSILON as f64 / 2.0;
    for r in 0..o {
        for c in 0..i {
            let (mut sum, mut abs) = (0.0f64, 0.0f64);
            for k in 0..n {
                let p = ev[k * o + r] as f64 * av[k * i + c] as f64;
                sum += p;
                abs += p.abs();
            }
            let (sum, abs) = (sum / n as f64, abs / n as f64);
            let bound = 2.0 * (n + 2) as f64 * u * abs;
            let got = gv[r * i + c] as f64;
            assert!(
                (got - sum).abs() <= bound,
                "G[{r},{c}] {got} vs factors {sum} (bound {bound})"
            );
        }
    }
}

/// Every method grng runs through candle (two AdamW configurations: a Kronecker method's
/// other variables use the default one).
fn methods() -> Vec<OptimizerConfig> {
    vec![
        OptimizerConfig::Kron(KronConfig::ring()),
        OptimizerConfig::Kron(KronConfig::reng()),
        OptimizerConfig::Kron(KronConfig::ngd()),
        OptimizerConfig::AdamW(AdamWConfig {
            lr: 3e-3,
            ..AdamWConfig::default()
        }),
        OptimizerConfig::Sgd(SgdConfig::default()),
        OptimizerConfig::Sophia(SophiaConfig::default()),
    ]
}

#[test]
fn steps_match_grng() {
    for method in methods() {
        step_matches_grng(method, &CDevice::Cpu, &Device::Cpu, false);
    }
}

/// RING and NGD with factored gradients: the factors give candle's gradient (to rounding)
/// and the step equals grng's own `step_grads` on them bit for bit, refresh and lazy steps;
/// RENG and the first-order methods refuse the switch; a layer that recorded two forward
/// passes (as a layer used twice would) offers no factors.
#[test]
fn factored_steps_match_grng() {
    let c = case(vec![6, 5, 4], 12, common::seed());
    let once = logits(&c.layers, &c.x, None)
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(c.layers[0].gradient_factors(&once).unwrap().is_some());
    let _first = logits(&c.layers, &c.x, None);
    let twice = logits(&c.layers, &c.x, None)
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(c.layers[0].gradient_factors(&twice).unwrap().is_none());
    for method in methods() {
        match method {
            OptimizerConfig::Kron(KronConfig {
                variant: KronVariant::Ring | KronVariant::Ngd,
                ..
            }) => step_matches_grng(method, &CDevice::Cpu, &Device::Cpu, true),
            _ => {
                let layers = case(vec![6, 5, 4], 12, common::seed()).layers;
                let (_, mut opt) = optimizer_on(&layers, method);
                assert!(opt.set_factored_gradients(true).is_err(), "{method:?}");
                opt.set_factored_gradients(false).unwrap();
            }
        }
    }
}

// ---- Bad input: typed errors, nothing changed ----

#[test]
fn bad_optimizer_input_is_a_typed_error_and_changes_nothing() {
    let Case {
        layers, x, labels, ..
    } = case(vec![5, 4, 3], 8, common::seed());
    let scale = Var::from_slice(&[1.0f32], 1, &CDevice::Cpu).unwrap();
    let mut vars: Vec<Var> = layers.iter().map(|l| l.weight().clone()).collect();
    vars.push(scale.clone());
    let config = |method| GrngConfig {
        method,
        rest: AdamWConfig::default(),
        layers: layers.clone(),
    };
    let kalman = OptimizerConfig::Kalman(grng::optim::kalman::RKalmanConfig::default());
    assert!(matches!(
        GrngOptimizer::try_new(vars.clone(), config(kalman)),
        Err(Error::Value { .. })
    ));
    let f64_var = Var::zeros(3, DType::F64, &CDevice::Cpu).unwrap();
    let r = GrngOptimizer::try_new(
        vec![f64_var],
        config(OptimizerConfig::Kron(KronConfig::ring())),
    );
    assert!(matches!(r, Err(Error::Tensor { .. })), "{r:?}");

    let mut opt = GrngOptimizer::try_new(
        vars.clone(),
        config(OptimizerConfig::Kron(KronConfig::ring())),
    )
    .unwrap();
    let before: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
    let unchanged = |opt: &GrngOptimizer| {
        let now: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
        assert_eq!(now, before);
        assert_eq!(opt.kron().unwrap().steps(), 0);
    };
    // A batch of the wrong width.
    let wide = Tensor::zeros((4, 6), DType::F32, &CDevice::Cpu).unwrap();
    assert!(matches!(
        layers[0].forward_record(&wide),
        Err(Error::Shape { .. })
    ));
    let z = logits(&layers, &x, Some(&scale));
    let loss = candle_nn::loss::cross_entropy(&z, &labels_tensor(&labels, z.device())).unwrap();
    let mut grads = loss.backward().unwrap();
    // RING's first step needs statistics.
    assert!(matches!(opt.try_step(&grads), Err(Error::Value { .. })));
    unchanged(&opt);
    // Labels of the wrong length or range, logits of the wrong rank: nothing captured.
    let mut rng = common::seeded_rng();
    let short = &u32s(&labels)[1..];
    assert!(matches!(
        capture_fisher(&layers, &z, FisherMode::Sampled, short, &mut rng),
        Err(Error::Shape { .. })
    ));
    let big = vec![3u32; labels.len()];
    assert!(matches!(
        capture_fisher(&layers, &z, FisherMode::Empirical, &big, &mut rng),
        Err(Error::Value { .. })
    ));
    let flat = z.flatten_all().unwrap();
    assert!(matches!(
        capture_fisher(
            &layers,
            &flat,
            FisherMode::Sampled,
            &u32s(&labels),
            &mut rng
        ),
        Err(Error::Shape { .. })
    ));
    assert!(layers.iter().all(|l| l.fisher_stats().is_none()));
    // A NaN in the last variable's gradient: refused before the Kronecker step runs.
    capture_fisher(&layers, &z, FisherMode::Sampled, &u32s(&labels), &mut rng).unwrap();
    let nan = Tensor::from_slice(&[f32::NAN], 1, &CDevice::Cpu).unwrap();
    grads.insert(scale.as_tensor(), nan);
    assert!(matches!(opt.try_step(&grads), Err(Error::NonFinite { .. })));
    unchanged(&opt);
    // A gradient of the wrong shape for a KronLinear.
    grads.insert(
        scale.as_tensor(),
        Tensor::ones(1, DType::F32, &CDevice::Cpu).unwrap(),
    );
    grads.insert(
        layers[1].weight().as_tensor(),
        Tensor::ones((2, 2), DType::F32, &CDevice::Cpu).unwrap(),
    );
    assert!(matches!(opt.try_step(&grads), Err(Error::Shape { .. })));
    unchanged(&opt);
}

/// A first-order method steps every variable in one multi-tensor op: gradients for only some
/// of them are refused (typed, nothing changes), for none of them the step leaves them alone,
/// for all of them each moves.
#[test]
fn first_order_step_needs_all_gradients_or_none() {
    let a = Var::from_slice(&[1.0f32, -2.0, 3.0], 3, &CDevice::Cpu).unwrap();
    let b = Var::from_slice(&[0.5f32, 0.25], (1, 2), &CDevice::Cpu).unwrap();
    let config = GrngConfig {
        method: OptimizerConfig::AdamW(AdamWConfig {
            warmup_steps: 0,
            ..AdamWConfig::default()
        }),
        rest: AdamWConfig::default(),
        layers: Vec::new(),
    };
    let mut opt = GrngOptimizer::try_new(vec![a.clone(), b.clone()], config).unwrap();
    let before = [host(&a), host(&b)];
    let only_a = a
        .as_tensor()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(matches!(
        opt.try_step(&only_a),
        Err(Error::Value { arg: "grads", .. })
    ));
    assert_eq!([host(&a), host(&b)], before);
    let unrelated = Var::from_slice(&[1.0f32], 1, &CDevice::Cpu).unwrap();
    let none = unrelated.as_tensor().sum_all().unwrap().backward().unwrap();
    opt.try_step(&none).unwrap();
    assert_eq!([host(&a), host(&b)], before);
    let loss = (a.as_tensor().sum_all().unwrap() + b.as_tensor().sqr().unwrap().sum_all().unwrap())
        .unwrap();
    opt.try_step(&loss.backward().unwrap()).unwrap();
    let after = [host(&a), host(&b)];
    for (x, y) in after.iter().zip(&before) {
        assert!(x.iter().zip(y).all(|(p, q)| p != q), "{x:?} vs {y:?}");
    }
}

/// `step_observed` for a Kronecker method: a step whose loss afterwards is not finite is
/// undone (every variable as before) and raises ρ; a finite one stands and is observed.
#[test]
fn step_observed_undoes_a_step_with_a_non_finite_loss() {
    let Case {
        layers, x, labels, ..
    } = case(vec![5, 4, 3], 8, common::seed());
    let (vars, mut opt) = optimizer_on(&layers, OptimizerConfig::Kron(KronConfig::ring()));
    let mut rng = common::seeded_rng();
    let mut step = |after: f32| {
        let z = logits(&layers, &x, None);
        let (before, grads) = backward(&opt, &layers, &z, &labels, &mut rng);
        let w0: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
        let rho0 = opt.rho().unwrap();
        let r = opt.step_observed(&grads, before, || Ok(after)).unwrap();
        let w1: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
        (r, w0 == w1, opt.rho().unwrap() > rho0)
    };
    assert_eq!(
        step(f32::NAN),
        (grng_candle::Observed::Rejected, true, true)
    );
    let (r, same, _) = step(0.0);
    assert_eq!(r, grng_candle::Observed::Applied { after: Some(0.0) });
    assert!(!same);
}

/// `step_observed` with a Levenberg–Marquardt interval `T = 2`: the steps that form no model
/// stand without calling `loss_after` (even one that would report a non-finite loss), the
/// others read it and are undone when it is not finite.
#[test]
fn step_observed_reads_the_loss_after_only_on_adapting_steps() {
    let Case {
        layers, x, labels, ..
    } = case(vec![5, 4, 3], 8, common::seed());
    let (vars, mut opt) = optimizer_on(
        &layers,
        OptimizerConfig::Kron(KronConfig {
            damping_interval: 2,
            ..KronConfig::ring()
        }),
    );
    let mut rng = common::seeded_rng();
    for k in 0..5 {
        let z = logits(&layers, &x, None);
        let (before, grads) = backward(&opt, &layers, &z, &labels, &mut rng);
        let w0: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
        let mut called = false;
        let r = opt
            .step_observed(&grads, before, || {
                called = true;
                Ok(f32::NAN)
            })
            .unwrap();
        let same = w0 == vars.iter().map(|v| host(v)).collect::<Vec<_>>();
        if k % 2 == 0 {
            assert!(called, "step {k}");
            assert_eq!(r, grng_candle::Observed::Rejected, "step {k}");
            assert!(same, "step {k}");
        } else {
            assert!(!called, "step {k}");
            assert_eq!(
                r,
                grng_candle::Observed::Applied { after: None },
                "step {k}"
            );
            assert!(!same, "step {k}");
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(8))]

    /// RENG's `g + 2c·H_L g` by central differences against the reference MLP's exact
    /// R-operator product. The difference quotient's error is O(ε²) truncation plus f32
    /// roundoff of the gradients over 2ε (ε·‖g‖ = 10⁻²): a few 10⁻⁴ of ‖H g‖ here, so 2% of
    /// `‖2c·H g‖` (plus 1e-5 for a vanishing product) leaves a wide margin.
    #[test]
    fn regularized_gradient_matches_the_reference(
        d0 in 1usize..8, h in 1usize..8, m in 1usize..12, seed in any::<u64>(),
    ) {
        let Case { mlp, layers, x, labels } = case(vec![d0, h, 3], m, seed);
        let c = 0.5;
        let (vars, opt) = optimizer_on(
            &layers,
            OptimizerConfig::Kron(KronConfig { grad_reg: c, ..KronConfig::reng() }),
        );
        let grads_now = || {
            let z = logits(&layers, &x, None);
            let grads = || candle_nn::loss::cross_entropy(&z, &labels_tensor(&labels, z.device()))?.backward();
            grads().map_err(|e| Error::Candle(e.to_string()))
        };
        let before: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
        let mut grads = grads_now().unwrap();
        let plain: Vec<f32> = vars.iter().flat_map(|v| host(grads.get(v).unwrap())).collect();
        opt.regularize(&mut grads, grads_now).unwrap();
        let got: Vec<f32> = vars.iter().flat_map(|v| host(grads.get(v).unwrap())).collect();
        let (_, want) = mlp.regularized_gradient(x.as_ref(), Targets::Classes(&labels), c).unwrap();
        let now: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
        prop_assert_eq!(now, before);
        let term: f32 = want.iter().zip(&plain).map(|(w, g)| (w - g) * (w - g)).sum::<f32>().sqrt();
        let err: f32 = want.iter().zip(&got).map(|(w, g)| (w - g) * (w - g)).sum::<f32>().sqrt();
        prop_assert!(err <= 2e-2 * term + 1e-5, "err {err}, ‖2c·Hg‖ {term}");
    }
}

/// The same tests on candle's CUDA tensors (feature `cuda`), skipped without a GPU as
/// the `emu_*` tests' CUDA arms are (and failing then under `GRNG_REQUIRE_CUDA=1`).
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr};
    use std::sync::OnceLock;

    /// candle's GPU 0, one for the whole binary (grng's kernels are loaded once for it), or
    /// `None` without a GPU or without grng's kernels.
    fn candle_cuda() -> Option<CDevice> {
        static DEV: OnceLock<Option<CDevice>> = OnceLock::new();
        DEV.get_or_init(|| {
            common::gpu(grng_candle::candle_device("cuda").and_then(|d| {
                grng_candle::grng_device(&d)?;
                Ok(d)
            }))
        })
        .clone()
    }

    fn addr(s: &CudaSlice<f32>) -> u64 {
        s.device_ptr(s.stream()).0
    }

    /// Device address of a CUDA f32 tensor's buffer.
    fn buffer_addr(t: &Tensor) -> u64 {
        match &*t.storage_and_layout().0 {
            candle_core::Storage::Cuda(s) => addr(s.as_cuda_slice::<f32>().unwrap()),
            _ => panic!("not a CUDA tensor"),
        }
    }

    fn cuda_tensor(vals: &[f32], rows: usize, cols: usize, dev: &CDevice) -> Tensor {
        Tensor::from_slice(vals, (rows, cols), dev).unwrap()
    }

    /// grng's device of a candle CUDA device works on candle's own stream; a view is the
    /// tensor's own device buffer (same address), what grng writes is what the tensor holds,
    /// and the buffer a matrix ends with is moved (same address) into its tensor.
    #[test]
    fn views_are_zero_copy() {
        let Some(cd) = candle_cuda() else { return };
        let dev = grng_candle::grng_device(&cd).unwrap();
        let (Device::Cuda(g), CDevice::Cuda(c)) = (&dev, &cd) else {
            panic!("{dev:?} for {cd:?}")
        };
        assert!(std::sync::Arc::ptr_eq(g.stream(), &c.cuda_stream()));
        let mut rng = common::seeded_rng();
        for (rows, cols) in [(1, 1), (3, 7), (64, 33), (1000, 257)] {
            let x: Vec<f32> = common::vals(&mut rng, rows * cols);
            let y: Vec<f32> = common::vals(&mut rng, rows * cols);
            let (tx, ty) = (
                cuda_tensor(&x, rows, cols, &cd),
                cuda_tensor(&y, rows, cols, &cd),
            );
            let (px, py) = (buffer_addr(&tx), buffer_addr(&ty));
            let seen = with_matrices(&[&ty, &tx], ViewAs::Matrix, |ms| {
                let (dst, src) = ms.split_at_mut(1);
                let ptrs = (
                    addr(dst[0].cuda_slice().unwrap()),
                    addr(src[0].cuda_slice().unwrap()),
                );
                dev.axpy(0.5, &src[0], &mut dst[0])?; // y ← y + x/2
                Ok((ptrs, addr(dst[0].cuda_slice().unwrap())))
            })
            .unwrap();
            assert_eq!(seen.0, (py, px));
            assert_eq!(buffer_addr(&tx), px);
            assert_eq!(buffer_addr(&ty), seen.1);
            assert_eq!(host(&tx), x);
            // The CUDA axpy rounds as the CPU's does (`__fmul_rn`, `__fadd_rn`).
            let want: Vec<f32> = y.iter().zip(&x).map(|(y, x)| y + 0.5 * x).collect();
            assert_eq!(host(&ty), want);
        }
    }

    /// `A`, `E` (every Fisher mode) and the gradient of `W̄` captured on candle's CUDA tensors
    /// equal those captured on its CPU tensors from the same weights, batch and label draws.
    /// Both sides sum at most a few dozen f32 products of O(1) values per element in their
    /// own orders (cuBLAS, candle's CPU GEMM): 1e-5 is ~100 ulps.
    #[test]
    fn captured_statistics_match_the_cpu() {
        let Some(cd) = candle_cuda() else { return };
        let seed = common::seed();
        let Case {
            layers, x, labels, ..
        } = case(vec![9, 7, 5], 16, seed);
        let gpu = layers_on(&layers, &cd);
        for mode in [
            FisherMode::Sampled,
            FisherMode::Empirical,
            FisherMode::Exact,
        ] {
            let [cpu, gpu] = [&layers, &gpu].map(|ls| {
                let z = logits(ls, &x, None);
                let y = labels_tensor(&labels, z.device());
                let grads = candle_nn::loss::cross_entropy(&z, &y)
                    .unwrap()
                    .backward()
                    .unwrap();
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                capture_fisher(ls, &z, mode, &u32s(&labels), &mut rng).unwrap();
                ls.iter()
                    .flat_map(|l| {
                        let (a, e) = l.fisher_stats().unwrap();
                        assert!(a.device().same_device(l.weight().device()));
                        let g = host(grads.get(l.weight()).unwrap());
                        [("A", host(&a)), ("E", host(&e)), ("G", g)]
                    })
                    .collect::<Vec<_>>()
            });
            for ((what, c), (_, g)) in cpu.iter().zip(&gpu) {
                let d = max_diff(c, g);
                assert!(d <= 1e-5, "{mode:?} {what}: {d}");
            }
        }
    }

    /// One `GrngOptimizer` step per method through candle's CUDA tensors equals the same step
    /// through grng's own optimizers on a `Device::Cuda` of grng's own (same GPU, its own
    /// stream), bit for bit: the same kernels on the same inputs.
    #[test]
    fn steps_match_grng() {
        let Some(cd) = candle_cuda() else { return };
        let dev = common::cuda().expect("grng opens the GPU candle opened");
        for method in methods() {
            step_matches_grng(method, &cd, &dev, false);
        }
    }

    /// dtype, strides, offsets, a CPU tensor beside a CUDA one (views and optimizer), a CPU
    /// gradient for a CUDA variable and a matrix swapped for a host one are typed errors, and
    /// the tensors keep their values (the swapped one its length).
    #[test]
    fn bad_input_is_a_typed_error_and_changes_nothing() {
        let Some(cd) = candle_cuda() else { return };
        let vals: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let t = cuda_tensor(&vals, 3, 4, &cd);
        assert_bad_views_refused(&t);
        let cpu = tensor(&vals, 3, 4);
        for pair in [[&t, &cpu], [&cpu, &t]] {
            let r = with_matrices(&pair, ViewAs::Matrix, |_| -> grng::Result<()> {
                panic!("must not be lent")
            });
            assert!(matches!(r, Err(Error::DeviceMismatch { .. })), "{r:?}");
        }
        assert_eq!(host(&t), vals);
        let r = with_matrix(&t, ViewAs::Matrix, |m| {
            *m = Device::Cpu.zeros(3, 4)?;
            Ok(())
        });
        assert!(matches!(r, Err(Error::DeviceMismatch { .. })), "{r:?}");
        assert_eq!(host(&t).len(), 12);
        assert_refilled_after_panic(&cuda_tensor(&vals, 3, 4, &cd));

        let gpu_var = Var::from_slice(&[1.0f32, 2.0], 2, &cd).unwrap();
        let cpu_var = Var::from_slice(&[3.0f32], 1, &CDevice::Cpu).unwrap();
        let config = GrngConfig {
            method: OptimizerConfig::AdamW(AdamWConfig::default()),
            rest: AdamWConfig::default(),
            layers: Vec::new(),
        };
        let r = GrngOptimizer::try_new(vec![gpu_var.clone(), cpu_var], config.clone());
        assert!(matches!(r, Err(Error::DeviceMismatch { .. })), "{r:?}");
        let mut opt = GrngOptimizer::try_new(vec![gpu_var.clone()], config).unwrap();
        let mut grads = gpu_var.as_tensor().sum_all().unwrap().backward().unwrap();
        grads.insert(
            gpu_var.as_tensor(),
            Tensor::ones(2, DType::F32, &CDevice::Cpu).unwrap(),
        );
        let r = opt.try_step(&grads);
        assert!(matches!(r, Err(Error::DeviceMismatch { .. })), "{r:?}");
        assert_eq!(host(&gpu_var), [1.0, 2.0]);

        assert!(grng_candle::candle_device("cuda:0").unwrap().is_cuda());
    }
}

// ---- Kalman filters: the output Jacobian against the reference MLP, the step against grng ----

/// `output_jacobian` of the candle layers is the reference MLP's `output_jacobian` (the same
/// network and batch, computed by its own backward pass); `step_kalman` is grng's
/// `RKalman::step` on that Jacobian, bit for bit, over two steps (R-Kalman and plain Kalman),
/// the layers' variables set to the filter's mean.
///
/// Jacobian tolerance: entries are `p_kj·(δ_jc − p_kc)·(∂z/∂θ)` with `|p(1−p)| ≤ 1/4`,
/// inputs in `[−1, 1]` and weights `≤ 1/√d_in`, backpropagated through two `f32` layers of
/// width ≤ 6 in different summation orders: ≲ 20 roundings of unit-scale terms, `≤ 2e-6`;
/// checked at `1e-5`.
#[test]
fn kalman_steps_match_grng() {
    use grng::optim::kalman::{RKalman, RKalmanConfig};
    for config in [RKalmanConfig::default(), RKalmanConfig::plain()] {
        let Case {
            mlp,
            layers,
            x,
            labels,
        } = case(vec![6, 5, 4], 3, common::seed());
        let (m, c) = (labels.len(), 4);
        let reference = mlp.output_jacobian(x.as_ref()).unwrap();
        let (vars, mut opt) = optimizer_on(&layers, OptimizerConfig::Kalman(config));
        let mu0: Vec<f32> = vars.iter().flat_map(|v| host(v)).collect();
        assert_eq!(mu0, mlp.params());
        let mut filter = RKalman::new(&Device::Cpu, &mu0, m * c, config).unwrap();
        for step in 0..2 {
            let z = logits(&layers, &x, None);
            let jac = grng_candle::output_jacobian(&layers, &z).unwrap();
            if step == 0 {
                assert_eq!(jac.h.dims(), &[m * c, mlp.num_params()]);
                assert!(max_diff(&host(&jac.h), reference.h.as_slice()) <= 1e-5);
                assert!(max_diff(&jac.probs, reference.y.as_slice()) <= 1e-6);
            }
            let mut innovation: Vec<f32> = jac.probs.iter().map(|p| -p).collect();
            for (k, &y) in labels.iter().enumerate() {
                innovation[k * c + y] += 1.0;
            }
            let h = mat(&Device::Cpu, &jac.h, m * c, mlp.num_params());
            let innovation = Device::Cpu.upload(m * c, 1, &innovation).unwrap();
            filter.step(&h, &innovation).unwrap();
            opt.step_kalman(&z, &u32s(&labels)).unwrap();
            let now: Vec<f32> = vars.iter().flat_map(|v| host(v)).collect();
            assert_eq!(now, filter.params().to_vec().unwrap(), "step {step}");
        }
    }
}

/// The Kalman arm refuses what it cannot do, and a failed step changes nothing.
#[test]
fn bad_kalman_input_is_a_typed_error_and_changes_nothing() {
    let Case {
        layers, x, labels, ..
    } = case(vec![5, 4, 3], 4, common::seed());
    let kalman = OptimizerConfig::Kalman(grng::optim::kalman::RKalmanConfig::default());
    let (vars, mut opt) = optimizer_on(&layers, kalman);
    let before: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
    let z = logits(&layers, &x, None);
    let grads = z.sum_all().unwrap().backward().unwrap();
    assert!(matches!(opt.try_step(&grads), Err(Error::Value { .. })));
    let y = u32s(&labels);
    let r = opt.step_kalman(&z, &y[1..]);
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    let r = opt.step_kalman(&z, &[3, 0, 0, 0]);
    assert!(matches!(r, Err(Error::Value { .. })), "{r:?}");
    let nan = z.affine(f64::NAN, 0.0).unwrap();
    let r = opt.step_kalman(&nan, &y);
    assert!(matches!(r, Err(Error::NonFinite { .. })), "{r:?}");
    assert_eq!(vars.iter().map(|v| host(v)).collect::<Vec<_>>(), before);
    opt.step_kalman(&z, &y).unwrap();
    // The batch size is the filter's from the first step on.
    let short = Mat::from_vec(x.as_slice()[..10].to_vec(), 2, 5).unwrap();
    let z2 = logits(&layers, &short, None);
    let after: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
    let r = opt.step_kalman(&z2, &y[..2]);
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    assert_eq!(vars.iter().map(|v| host(v)).collect::<Vec<_>>(), after);
    // A gradient method has no Kalman step.
    let (_, mut ring) = optimizer_on(&layers, OptimizerConfig::Kron(KronConfig::ring()));
    let z = logits(&layers, &x, None);
    assert!(matches!(ring.step_kalman(&z, &y), Err(Error::Value { .. })));
}
