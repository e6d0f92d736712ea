//! grng inside candle (feature `candle`): zero-copy views, captured Kronecker statistics
//! against the reference MLP, optimizer steps against grng's own API, and bad input.
#![cfg(feature = "candle")]

mod common;

use candle_core::{DType, Device as CDevice, Tensor};
use grng::candle::{with_matrices, with_matrix, ViewAs};
use grng::{Device, Error};
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

/// dtype, strides, offsets, partial storages, ranks, aliasing and failing closures are typed
/// errors, and the tensors keep their values.
#[test]
fn bad_views_are_typed_errors_and_change_nothing() {
    let vals: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let t = tensor(&vals, 3, 4);
    let never = |_: &mut grng::Matrix| -> grng::Result<()> { panic!("must not be lent") };
    assert_tensor_error(with_matrix(
        &t.to_dtype(DType::F64).unwrap(),
        ViewAs::Matrix,
        never,
    ));
    assert_tensor_error(with_matrix(&t.t().unwrap(), ViewAs::Matrix, never));
    assert_tensor_error(with_matrix(
        &t.narrow(0, 1, 2).unwrap(),
        ViewAs::Matrix,
        never,
    ));
    assert_tensor_error(with_matrix(
        &t.narrow(0, 0, 2).unwrap(),
        ViewAs::Matrix,
        never,
    ));
    assert_tensor_error(with_matrices(&[&t, &t.clone()], ViewAs::Matrix, |_| Ok(())));
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
    // Devices: only candle's CPU is viewed (no GPU here to build a mismatching tensor).
    assert!(grng::candle::candle_device("cpu").unwrap().is_cpu());
    for name in ["cuda", "metal", ""] {
        let r = grng::candle::candle_device(name);
        assert!(matches!(r, Err(Error::DeviceUnavailable(_))), "{name}");
    }
}

// ---- Layers and captured statistics against the reference MLP ----

use candle_core::{Module, Var};
use grng::candle::{capture_fisher, GrngConfig, GrngOptimizer, KronLinear};
use grng::mat::Mat;
use grng::mlp::{Activation, FisherMode, Loss, Mlp, MlpConfig, Targets};
use grng::optim::adamw::{AdamW, AdamWConfig};
use grng::optim::kron::{KronConfig, KronOptimizer};
use grng::optim::sgd::{Sgd, SgdConfig};
use grng::optim::sophia::{Sophia, SophiaConfig, SophiaHessian};
use grng::optim::KronStats;
use grng::train::OptimizerConfig;
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

/// The candle forward pass (recording), logits `m x C` scaled by `scale` when given.
fn logits(layers: &[KronLinear], x: &Mat, scale: Option<&Var>) -> Tensor {
    let mut h = tensor(x.as_slice(), x.rows(), x.cols());
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

fn labels_tensor(labels: &[usize]) -> Tensor {
    let l: Vec<u32> = labels.iter().map(|&y| y as u32).collect();
    Tensor::from_slice(&l, labels.len(), &CDevice::Cpu).unwrap()
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
        let loss = candle_nn::loss::cross_entropy(&z, &labels_tensor(&labels)).unwrap();
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

fn mat(t: &Tensor, rows: usize, cols: usize) -> grng::Matrix {
    Device::Cpu.upload(rows, cols, &host(t)).unwrap()
}

/// Two steps of `method` on the case's network (plus a scalar output scale, a non-Kronecker
/// variable) through `GrngOptimizer`, each checked bit for bit against grng's own optimizers
/// fed the same weights, gradients and statistics.
fn step_matches_grng(method: OptimizerConfig) {
    let Case {
        layers, x, labels, ..
    } = case(vec![6, 5, 4], 12, common::seed());
    let scale = Var::from_slice(&[1.0f32], 1, &CDevice::Cpu).unwrap();
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
    let shapes: Vec<_> = layers.iter().map(KronLinear::shape).collect();
    let mut kron_ref = match method {
        OptimizerConfig::Kron(k) => Some(KronOptimizer::new(&Device::Cpu, &shapes, k).unwrap()),
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
                OptimizerConfig::Sgd(c) => R::S(Sgd::new(&Device::Cpu, n, c).unwrap()),
                OptimizerConfig::Sophia(c) => R::So(Sophia::new(&Device::Cpu, n, c).unwrap()),
                OptimizerConfig::AdamW(c) => R::A(AdamW::new(&Device::Cpu, n, c).unwrap()),
                _ => R::A(AdamW::new(&Device::Cpu, n, rest).unwrap()),
            }
        })
        .collect();
    let mut rng = common::seeded_rng();
    for _ in 0..2 {
        let z = logits(&layers, &x, Some(&scale));
        let loss = candle_nn::loss::cross_entropy(&z, &labels_tensor(&labels)).unwrap();
        let grads = loss.backward().unwrap();
        if opt.needs_fisher() {
            capture_fisher(&layers, &z, FisherMode::Sampled, &u32s(&labels), &mut rng).unwrap();
        }
        let sampled = opt.needs_sophia_sample().then(|| {
            let y: Vec<usize> = (0..labels.len()).map(|_| rng.random_range(0..4)).collect();
            let g = candle_nn::loss::cross_entropy(&z, &labels_tensor(&y))
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
                .map(|(l, &(r, c))| mat(l.weight(), r, c))
                .collect();
            let gs: Vec<_> = layers
                .iter()
                .zip(&shapes)
                .map(|(l, &(r, c))| mat(grads.get(l.weight()).unwrap(), r, c))
                .collect();
            let st: Vec<(grng::Matrix, grng::Matrix)> = layers
                .iter()
                .filter_map(|l| l.fisher_stats())
                .map(|(a, e)| {
                    (
                        mat(&a, a.dims()[0], a.dims()[1]),
                        mat(&e, e.dims()[0], e.dims()[1]),
                    )
                })
                .collect();
            let stats: Option<Vec<KronStats>> = k
                .needs_stats()
                .then(|| st.iter().map(|(a, e)| KronStats { a, e }).collect());
            let g_refs: Vec<&grng::Matrix> = gs.iter().collect();
            k.step(&mut ws, &g_refs, stats.as_deref()).unwrap();
            want_kron = ws;
        }
        let want_flat: Vec<Vec<f32>> = flat_vars
            .iter()
            .zip(&mut flat_ref)
            .map(|(v, r)| {
                let n = v.elem_count();
                let mut p = mat(v, n, 1);
                let g = mat(grads.get(v).unwrap(), n, 1);
                match r {
                    R::A(o) => o.step(&mut p, &g).unwrap(),
                    R::S(o) => o.step(&mut p, &g).unwrap(),
                    R::So(o) => {
                        let s = sampled.as_ref().map(|s| mat(s.get(v).unwrap(), n, 1));
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

#[test]
fn ring_step_matches_grng() {
    step_matches_grng(OptimizerConfig::Kron(KronConfig::ring()));
}

#[test]
fn reng_step_matches_grng() {
    step_matches_grng(OptimizerConfig::Kron(KronConfig::reng()));
}

#[test]
fn ngd_step_matches_grng() {
    step_matches_grng(OptimizerConfig::Kron(KronConfig::ngd()));
}

#[test]
fn first_order_steps_match_grng() {
    step_matches_grng(OptimizerConfig::AdamW(AdamWConfig {
        lr: 3e-3,
        ..AdamWConfig::default()
    }));
    step_matches_grng(OptimizerConfig::Sgd(SgdConfig::default()));
    step_matches_grng(OptimizerConfig::Sophia(SophiaConfig::default()));
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
    let loss = candle_nn::loss::cross_entropy(&z, &labels_tensor(&labels)).unwrap();
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
    let vars: Vec<Var> = layers.iter().map(|l| l.weight().clone()).collect();
    let config = GrngConfig {
        method: OptimizerConfig::Kron(KronConfig::ring()),
        rest: AdamWConfig::default(),
        layers: layers.clone(),
    };
    let mut opt = GrngOptimizer::try_new(vars.clone(), config).unwrap();
    let mut rng = common::seeded_rng();
    let mut step = |after: f32| {
        let z = logits(&layers, &x, None);
        let loss = candle_nn::loss::cross_entropy(&z, &labels_tensor(&labels)).unwrap();
        let before = loss.to_scalar::<f32>().unwrap();
        let grads = loss.backward().unwrap();
        if opt.needs_fisher() {
            capture_fisher(&layers, &z, FisherMode::Sampled, &u32s(&labels), &mut rng).unwrap();
        }
        let w0: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
        let rho0 = opt.rho().unwrap();
        let r = opt.step_observed(&grads, before, || Ok(after)).unwrap();
        let w1: Vec<Vec<f32>> = vars.iter().map(|v| host(v)).collect();
        (r, w0 == w1, opt.rho().unwrap() > rho0)
    };
    assert_eq!(
        step(f32::NAN),
        (grng::candle::Observed::Rejected, true, true)
    );
    let (r, same, _) = step(0.0);
    assert_eq!(r, grng::candle::Observed::Applied { after: Some(0.0) });
    assert!(!same);
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
        let vars: Vec<Var> = layers.iter().map(|l| l.weight().clone()).collect();
        let c = 0.5;
        let config = GrngConfig {
            method: OptimizerConfig::Kron(KronConfig { grad_reg: c, ..KronConfig::reng() }),
            rest: AdamWConfig::default(),
            layers: layers.clone(),
        };
        let opt = GrngOptimizer::try_new(vars.clone(), config).unwrap();
        let grads_now = || {
            let z = logits(&layers, &x, None);
            Ok(candle_nn::loss::cross_entropy(&z, &labels_tensor(&labels))?.backward()?)
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
