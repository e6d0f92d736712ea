//! The CPU's element-wise loops are compiled at three instruction-set levels (AVX-512, AVX2 +
//! FMA, baseline; `grng::simd`) and must agree bit for bit: the test runs this binary
//! again once per level (`GRNG_CPU_SIMD` caps it; the level is decided once per process), each
//! child computes every multiversioned loop on the same seeded ragged inputs and prints a hash
//! of the result bits, and the parent compares them. Lengths cross the parallel threshold
//! (`PAR_MIN = 65536`) so the chunked paths run too.

use std::process::Command;

use grng::cpu::{elementwise as ew, math};
use grng::ops::elementwise::{AdamWCoeffs, MultiState, SgdCoeffs, SophiaCoeffs, SophiaRefresh};
use grng::simd;
use grng::{Device, Error, Mat, Matrix};
use grng_train::mlp::{Activation, Loss, Mlp, MlpConfig, Targets};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const CHILD: &str = "GRNG_SIMD_LEVELS_CHILD";

/// FNV-1a over the bit patterns.
fn hash(xs: &[f32]) -> u64 {
    xs.iter().fold(0xcbf2_9ce4_8422_2325, |h, x| {
        (h ^ x.to_bits() as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// `(name, hash)` of every multiversioned loop's output on fixed inputs.
fn digests() -> Vec<(String, u64)> {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let mut out = Vec::new();
    for n in [1usize, 17, 1000, 70_001] {
        let (x, y) = (random(&mut rng, n, 3.0), random(&mut rng, n, 3.0));
        let mut z = y.clone();
        ew::axpy(0.37, &x, &mut z).unwrap();
        out.push((format!("axpy {n}"), hash(&z)));
        out.push((
            format!("axpy_new {n}"),
            hash(&ew::axpy_new(-1.3, &x, &y).unwrap()),
        ));
        let mut o = x.clone();
        ew::axpy_over(0.53, ew::Over::X, &y, &mut o).unwrap();
        ew::axpy_over(-0.9, ew::Over::Y, &x, &mut o).unwrap();
        out.push((format!("axpy_over {n}"), hash(&o)));
        ew::scale(0.71, &mut z).unwrap();
        out.push((format!("scale {n}"), hash(&z)));
        let d = ew::dot(&x, &y).unwrap();
        out.push((format!("dot {n}"), hash(&[d, ew::norm2(&x).unwrap()])));
        // The finiteness scan: the index it reports.
        let mut bad = x.clone();
        bad[rng.random_range(0..n)] = f32::NAN;
        let idx = match ew::dot(&bad, &y) {
            Err(Error::NonFinite { index, .. }) => index as f32,
            other => panic!("NaN not reported: {other:?}"),
        };
        out.push((format!("non-finite index {n}"), hash(&[idx])));
        let mut t: Vec<f32> = random(&mut rng, n, 12.0);
        t[0] = f32::NAN;
        math::tanh_in_place(&mut t);
        out.push((format!("tanh {n}"), hash(&t)));
    }
    // The multi-tensor updates (one ragged tensor set past the parallel threshold).
    let shapes = [(300usize, 251usize), (7, 3), (1, 1)];
    let dev = Device::Cpu;
    let ups = |rng: &mut ChaCha8Rng, s: f32| -> Vec<Matrix> {
        shapes
            .iter()
            .map(|&(r, c)| dev.upload(r, c, &random(rng, r * c, s)).unwrap())
            .collect()
    };
    let (mut ps, mut pa, mut po) = (ups(&mut rng, 2.0), ups(&mut rng, 2.0), ups(&mut rng, 2.0));
    let [mut s_sgd, mut s_adam, mut s_soph] =
        [1, 2, 2].map(|k| MultiState::new(&dev, &shapes, k).unwrap());
    let flat =
        |ps: &[Matrix]| -> Vec<f32> { ps.iter().flat_map(|m| m.to_vec().unwrap()).collect() };
    // The single-tensor updates on the same values, flattened (past the parallel threshold):
    // equal bit for bit to the multi-tensor ones at every level (asserted below).
    let total: usize = shapes.iter().map(|&(r, c)| r * c).sum();
    let (mut fs, mut fa, mut fo) = (flat(&ps), flat(&pa), flat(&po));
    let (mut b1, mut m1, mut v1, mut m2, mut h2) = (
        vec![0.0f32; total],
        vec![0.0f32; total],
        vec![0.0f32; total],
        vec![0.0f32; total],
        vec![0.0f32; total],
    );
    for step in 1..=3u64 {
        let g = ups(&mut rng, 3.0);
        let g_flat = flat(&g);
        let g: Vec<&Matrix> = g.iter().collect();
        let gh = ups(&mut rng, 1.0);
        let gh_flat = flat(&gh);
        let gh: Vec<&Matrix> = gh.iter().collect();
        let sgd = SgdCoeffs {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        };
        let adam = AdamWCoeffs {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            step,
        };
        let soph = SophiaCoeffs {
            lr: 0.01,
            beta1: 0.96,
            gamma: 0.01,
            eps: 1e-12,
            weight_decay: 0.01,
        };
        dev.sgd_update_many(&mut ps.iter_mut().collect::<Vec<_>>(), &g, &mut s_sgd, &sgd)
            .unwrap();
        dev.adamw_update_many(
            &mut pa.iter_mut().collect::<Vec<_>>(),
            &g,
            &mut s_adam,
            &adam,
        )
        .unwrap();
        let r = (step != 2).then_some(SophiaRefresh {
            sampled_grads: &gh,
            beta2: 0.98,
            batch: 5,
        });
        dev.sophia_update_many(
            &mut po.iter_mut().collect::<Vec<_>>(),
            &g,
            &mut s_soph,
            r,
            &soph,
        )
        .unwrap();
        ew::sgd_update(&mut fs, &g_flat, &mut b1, &sgd).unwrap();
        ew::adamw_update(&mut fa, &g_flat, &mut m1, &mut v1, &adam).unwrap();
        if step != 2 {
            ew::sophia_hessian_ema(&mut h2, &gh_flat, 0.98, 5).unwrap();
        }
        ew::sophia_update(&mut fo, &g_flat, &mut m2, &h2, &soph).unwrap();
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (name, single, multi) in [
        ("sgd params", &fs, flat(&ps)),
        ("sgd momentum", &b1, s_sgd.to_host(0).unwrap()),
        ("adamw params", &fa, flat(&pa)),
        ("adamw m", &m1, s_adam.to_host(0).unwrap()),
        ("adamw v", &v1, s_adam.to_host(1).unwrap()),
        ("sophia params", &fo, flat(&po)),
        ("sophia m", &m2, s_soph.to_host(0).unwrap()),
        ("sophia h", &h2, s_soph.to_host(1).unwrap()),
    ] {
        assert!(
            bits(single) == bits(&multi),
            "{name}: single-tensor != multi-tensor"
        );
    }
    for (name, v) in [
        ("sgd params", flat(&ps)),
        ("sgd momentum", s_sgd.to_host(0).unwrap()),
        ("adamw params", flat(&pa)),
        ("adamw m", s_adam.to_host(0).unwrap()),
        ("adamw v", s_adam.to_host(1).unwrap()),
        ("sophia params", flat(&po)),
        ("sophia h", s_soph.to_host(1).unwrap()),
    ] {
        out.push((name.to_string(), hash(&v)));
    }
    // The power iteration's products (`f32` rows against the `f64` iterate, `f64` dots) on a
    // ragged symmetric matrix: its estimate and iteration count.
    let n = 37;
    let b = random(&mut rng, n * n, 1.0);
    let sym: Vec<f32> = (0..n * n).map(|k| b[k] + b[(k % n) * n + k / n]).collect();
    let opts = grng::ops::norm::PowerOptions {
        tol: 1e-7,
        max_iter: 9,
        ..Default::default()
    };
    let info = grng::cpu::spectral_norm(grng::MatRef::new(&sym, n, n).unwrap(), &opts).unwrap();
    out.push((
        "spectral_norm".to_string(),
        hash(&[info.value, info.iterations as f32]),
    ));
    // The MLP's activation loops (tanh forward, ReLU forward, φ' backward).
    for activation in [Activation::Tanh, Activation::Relu] {
        let config = MlpConfig {
            sizes: vec![33, 70, 41, 5],
            activation,
            loss: Loss::SoftmaxCrossEntropy,
        };
        let mlp = Mlp::new(config, 7).unwrap();
        let x = Mat::from_vec(random(&mut rng, 29 * 33, 2.0), 29, 33).unwrap();
        let labels: Vec<usize> = (0..29).map(|k| k % 5).collect();
        let fwd = mlp.forward(x.as_ref()).unwrap();
        let (grad, loss) = mlp.gradient(&fwd, Targets::Classes(&labels)).unwrap();
        out.push((
            format!("mlp {activation:?}"),
            hash(&[&grad[..], &[loss]].concat()),
        ));
    }
    out
}

#[test]
fn levels_agree_bit_for_bit() {
    if std::env::var_os(CHILD).is_some() {
        // libtest prints the test name without a newline first.
        println!("\nLEVEL {:?}", simd::level());
        for (name, h) in digests() {
            println!("DIGEST {name}: {h:016x}");
        }
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut runs = Vec::new();
    for cap in ["v4", "v3", "base"] {
        let out = Command::new(&exe)
            .args([
                "--exact",
                "levels_agree_bit_for_bit",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .env("GRNG_CPU_SIMD", cap)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "child at {cap} failed:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let level = text
            .lines()
            .find_map(|l| l.strip_prefix("LEVEL "))
            .unwrap()
            .to_string();
        let digests: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with("DIGEST "))
            .map(str::to_string)
            .collect();
        assert!(
            !digests.is_empty(),
            "child at {cap} printed no digests:\n{text}"
        );
        runs.push((cap, level, digests));
    }
    // The cap is honoured: `base` runs the baseline copy on every CPU.
    assert_eq!(runs[2].1, "Base");
    for (cap, level, digests) in &runs[..2] {
        assert_eq!(
            digests, &runs[2].2,
            "level {level} (cap {cap}) disagrees with the baseline"
        );
    }
    // Which levels this CPU could compare (both wide ones on the CI machines).
    eprintln!(
        "compared levels: {:?}",
        runs.iter().map(|r| &r.1).collect::<Vec<_>>()
    );
}
