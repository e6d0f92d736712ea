//! A tiny random BERT (2 layers, adapters on query and value of both) fine-tunes with every
//! method: `SentenceClassifier::train_step` lowers the training loss of a small labeled set.

use grng_testkit as common;

use candle_core::{Device as CDevice, Tensor};
use grng::optim::adamw::AdamWConfig;
use grng::optim::kalman::RKalmanConfig;
use grng::optim::kron::{InverseMethod, KronConfig};
use grng::optim::sgd::SgdConfig;
use grng::optim::sophia::SophiaConfig;
use grng::optim::OptimizerConfig;
use grng_lora::{AdaptConfig, BertConfig, BertModel, LoraConfig, Pass, SentenceClassifier};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn tiny() -> BertConfig {
    BertConfig {
        vocab_size: 40,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 32,
        max_position_embeddings: 24,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_act: "gelu".into(),
    }
}

fn methods() -> Vec<(&'static str, OptimizerConfig)> {
    let kron = |k: KronConfig| {
        OptimizerConfig::Kron(KronConfig {
            inverse: InverseMethod::Cholesky,
            ..k
        })
    };
    // Dampings for a tiny model on 16 sentences (see the test's note), and a larger prior
    // σ₀ = 1 for the filters, which at σ₀ = 0.1 moved the loss by under 2% in 30 steps.
    let kalman = |k: RKalmanConfig| OptimizerConfig::Kalman(RKalmanConfig { sigma0: 1.0, ..k });
    vec![
        (
            "RING",
            kron(KronConfig {
                lr: 0.5,
                rho: 1e-2,
                ..KronConfig::ring()
            }),
        ),
        (
            "RENG",
            kron(KronConfig {
                rho: 0.1,
                ..KronConfig::reng()
            }),
        ),
        (
            "NGD",
            kron(KronConfig {
                rho: 0.1,
                ..KronConfig::ngd()
            }),
        ),
        ("R-Kalman", kalman(RKalmanConfig::default())),
        ("Kalman", kalman(RKalmanConfig::plain())),
        (
            "AdamW",
            OptimizerConfig::AdamW(AdamWConfig {
                lr: 1e-2,
                warmup_steps: 0,
                ..AdamWConfig::default()
            }),
        ),
        ("SGD", OptimizerConfig::Sgd(SgdConfig::default())),
        (
            "Sophia",
            OptimizerConfig::Sophia(SophiaConfig {
                lr: 1e-2,
                hessian_every: 2,
                ..SophiaConfig::default()
            }),
        ),
    ]
}

/// 16 sequences of 6 tokens (2 of them padding in half the rows), labeled by whether token 7
/// occurs: learnable through attention from the adapters.
fn data(rng: &mut ChaCha8Rng) -> (Tensor, Tensor, Tensor, Vec<u32>) {
    let (n, s) = (16, 6);
    let mut ids = vec![0u32; n * s];
    let mut mask = vec![0f32; n * s];
    let mut labels = Vec::with_capacity(n);
    for k in 0..n {
        let len = if k % 2 == 0 { s } else { s - 2 };
        let positive = k % 4 < 2;
        for t in 0..len {
            ids[k * s + t] = rng.random_range(8..40);
            mask[k * s + t] = 1.0;
        }
        if positive {
            ids[k * s + rng.random_range(1..len)] = 7;
        }
        labels.push(u32::from(positive));
    }
    let dev = CDevice::Cpu;
    (
        Tensor::from_vec(ids, (n, s), &dev).unwrap(),
        Tensor::zeros((n, s), candle_core::DType::U32, &dev).unwrap(),
        Tensor::from_vec(mask, (n, s), &dev).unwrap(),
        labels,
    )
}

/// Every method, 30 full-batch steps from the same start, ends with a lower training loss.
/// Over seeds 1–40 the worst final/initial ratios were RING 0.982, R-Kalman and Kalman 0.973,
/// NGD 0.81, RENG 0.78, SGD, AdamW and Sophia ≤ 0.66 (the adapters start at `B = 0`, so step
/// 0 is the frozen model's loss, ≈ ln 2). With the paper's small dampings the Kronecker
/// methods fit these 16 sentences within a few steps and then diverge as the Fisher of a
/// separated set vanishes (NGD at ρ = 1e-3 reached a loss of ~300 on 3 seeds of 12, RENG at
/// ρ = 1e-3 on 5): hence the larger ρ here.
#[test]
fn tiny_bert_fine_tunes_with_every_method() {
    let seed = common::seed();
    for (name, method) in methods() {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let lora = LoraConfig {
            rank: 2,
            alpha: 2.0,
        };
        let model = BertModel::random(
            tiny(),
            &CDevice::Cpu,
            Some((lora, AdaptConfig::default())),
            &mut rng,
        )
        .unwrap();
        let (ids, types, mask, labels) = data(&mut rng);
        let clf = SentenceClassifier::new(model, 0, 2, &mut rng).unwrap();
        let hidden = clf.embed(&ids, &types, &mask).unwrap();
        let mut opt = clf.optimizer(method, AdamWConfig::default()).unwrap();
        let loss = |clf: &SentenceClassifier| {
            clf.loss(&hidden, &mask, &labels, Pass::Eval)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        let first = loss(&clf);
        for _ in 0..30 {
            clf.train_step(&mut opt, &hidden, &mask, &labels, &mut rng)
                .unwrap();
        }
        let last = loss(&clf);
        assert!(
            last.is_finite() && last < first,
            "{name}: loss {first} → {last} (GRNG_TEST_SEED replays)"
        );
    }
}
