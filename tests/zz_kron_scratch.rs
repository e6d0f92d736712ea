use grng::data::synthetic_classification;
use grng::mlp::{Activation, FisherMode, Loss, Mlp, MlpConfig, Targets};
use grng::optim::kron::{KronConfig, KronOptimizer, KronVariant, InverseMethod};
use grng::optim::KronStats;
use grng::{Device, Mat, Matrix};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
const DEV: Device = Device::Cpu;
fn host(m: &Matrix) -> Vec<f32> { m.to_vec().unwrap() }
// ---------- training an MLP ----------

struct Task {
    x: Mat,
    labels: Vec<usize>,
    sizes: Vec<usize>,
}

fn task() -> Task {
    let n: usize = std::env::var("KN").map(|v| v.parse().unwrap()).unwrap_or(512);
    let c: usize = std::env::var("KC").map(|v| v.parse().unwrap()).unwrap_or(6);
    let d = synthetic_classification(n, 8, c, 7).unwrap();
    Task {
        x: d.x.clone(),
        labels: d.labels.clone(),
        sizes: { let h: Vec<usize> = std::env::var("KH").unwrap_or("16".into()).split(',').map(|v| v.parse().unwrap()).collect(); let mut v = vec![8]; v.extend(h); v.push(c); v },
    }
}

fn mlp(t: &Task) -> Mlp {
    Mlp::new(
        MlpConfig {
            sizes: t.sizes.clone(),
            activation: Activation::Tanh,
            loss: Loss::SoftmaxCrossEntropy,
        },
        3,
    )
    .unwrap()
}

/// Mini-batch `k` (64 samples, cycling through a fixed permutation).
fn batch(t: &Task, k: usize) -> (Mat, Vec<usize>) {
    let n = t.labels.len();
    let bs = 64;
    let idx: Vec<usize> = (0..bs).map(|j| (k * bs + j) * 7919 % n).collect();
    let d = t.x.cols();
    let mut x = Vec::with_capacity(bs * d);
    for &i in &idx {
        x.extend_from_slice(&t.x.as_slice()[i * d..(i + 1) * d]);
    }
    (
        Mat::from_vec(x, bs, d).unwrap(),
        idx.iter().map(|&i| t.labels[i]).collect(),
    )
}

fn accuracy(net: &Mlp, t: &Task) -> f32 {
    let pred = net.predict(t.x.as_ref()).unwrap();
    pred.iter().zip(&t.labels).filter(|(a, b)| a == b).count() as f32 / t.labels.len() as f32
}

fn full_loss(net: &Mlp, t: &Task) -> f32 {
    net.evaluate(t.x.as_ref(), Targets::Classes(&t.labels))
        .unwrap()
}

fn layer_mats(net: &Mlp) -> Vec<Matrix> {
    (0..net.num_layers())
        .map(|l| {
            let (o, i) = net.layer_shape(l).unwrap();
            DEV.upload(o, i, &net.params()[net.layer_range(l).unwrap()])
                .unwrap()
        })
        .collect()
}

fn store(net: &mut Mlp, ws: &[Matrix]) {
    let mut flat = net.params().to_vec();
    for (l, w) in ws.iter().enumerate() {
        flat[net.layer_range(l).unwrap()].copy_from_slice(&host(w));
    }
    net.set_params(&flat).unwrap();
}

fn target() -> f32 { std::env::var("KT").map(|v| v.parse().unwrap()).unwrap_or(0.95) }
const TARGET: f32 = 0.95;
const MAX_STEPS: usize = 300;

/// Trains with a Kronecker optimizer; returns (steps to reach TARGET training accuracy,
/// initial and final full-batch loss).
fn train_kron(t: &Task, cfg: KronConfig) -> (Option<usize>, f32, f32) {
    let mut net = mlp(t);
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    let shapes = net.layer_shapes();
    let mut opt = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
    let mut ws = layer_mats(&net);
    let l0 = full_loss(&net, t);
    let mut reached = None;
    for k in 0..MAX_STEPS {
        let (x, y) = batch(t, k);
        let targets = Targets::Classes(&y);
        let fwd = net.forward(x.as_ref()).unwrap();
        let (loss, grad) = if cfg.variant == KronVariant::Reng {
            net.regularized_gradient(x.as_ref(), targets, cfg.grad_reg)
                .unwrap()
        } else {
            let b = net.backward(&fwd, targets).unwrap();
            (b.loss, b.grad)
        };
        let grads: Vec<Matrix> = (0..shapes.len())
            .map(|l| {
                let (o, i) = shapes[l];
                DEV.upload(o, i, &grad[net.layer_range(l).unwrap()])
                    .unwrap()
            })
            .collect();
        let gref: Vec<&Matrix> = grads.iter().collect();
        let stats_dev: Option<Vec<(Matrix, Matrix)>> = opt.needs_stats().then(|| {
            net.fisher_stats(&fwd, FisherMode::Sampled, targets, &mut rng)
                .unwrap()
                .into_iter()
                .map(|s| {
                    (
                        DEV.upload(s.a.rows(), s.a.cols(), s.a.as_slice()).unwrap(),
                        DEV.upload(s.e.rows(), s.e.cols(), s.e.as_slice()).unwrap(),
                    )
                })
                .collect()
        });
        let stats: Option<Vec<KronStats<'_>>> = stats_dev
            .as_ref()
            .map(|v| v.iter().map(|(a, e)| KronStats { a, e }).collect());
        opt.step(&mut ws, &gref, stats.as_deref()).unwrap();
        store(&mut net, &ws);
        let after = if cfg.variant == KronVariant::Reng {
            net.regularized_gradient(x.as_ref(), targets, cfg.grad_reg)
                .unwrap()
                .0
        } else {
            net.evaluate(x.as_ref(), targets).unwrap()
        };
        opt.observe_loss(loss, after).unwrap();
        if std::env::var("KDBG").is_ok() { eprintln!("{:?} k {k} loss {loss:.4} after {after:.4} rho {:.2e} acc {}", cfg.variant, opt.rho(), accuracy(&net, t)); }
        if reached.is_none() && accuracy(&net, t) >= target() {
            reached = Some(k + 1);
            break;
        }
    }
    (reached, l0, full_loss(&net, t))
}

/// SGD with heavy-ball momentum on the same batches, through the device element-wise ops.
fn train_sgd(t: &Task, lr: f32) -> Option<usize> {
    let mut net = mlp(t);
    let n = net.num_params();
    let mut w = DEV.upload(n, 1, net.params()).unwrap();
    let mut buf = DEV.zeros(n, 1).unwrap();
    for k in 0..MAX_STEPS {
        let (x, y) = batch(t, k);
        let fwd = net.forward(x.as_ref()).unwrap();
        let b = net.backward(&fwd, Targets::Classes(&y)).unwrap();
        let g = DEV.upload(n, 1, &b.grad).unwrap();
        DEV.scale(0.9, &mut buf).unwrap();
        DEV.axpy(1.0, &g, &mut buf).unwrap();
        DEV.axpy(-lr, &buf, &mut w).unwrap();
        net.set_params(&host(&w)).unwrap();
        if accuracy(&net, t) >= target() {
            return Some(k + 1);
        }
    }
    None
}


#[test]
fn sweep() {
    let t = task();
    for lr in [0.3f32, 1.0, 2.0, 3.0, 5.0, 10.0] { eprintln!("sgd {lr}: {:?}", train_sgd(&t, lr)); }
    for mut cfg in [KronConfig::ring(), KronConfig::reng(), KronConfig::ngd()] {
        for lr in [0.3f32, 0.5, 1.0] { for rho in [3e-3f32, 1e-2, 3e-2] { for skip in [1usize, 4] { for ema in [0.0f32, 0.95] {
            cfg.lr = lr; cfg.rho = rho; cfg.skip = skip; cfg.ema = ema;
            let (s, l0, l1) = train_kron(&t, cfg);
            eprintln!("{:?} lr {lr} rho {rho} S {skip} ema {ema}: {s:?} {l0:.3}->{l1:.3}", cfg.variant);
        }}}}
    }
}
