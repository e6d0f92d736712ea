//! The BERT encoder, its loader and tokenizer on tiny random models (no download): shapes,
//! padding, the cached split, zero-init adapters, gradients through a training pass, a model
//! folder read back, the errors of bad folders, checkpoints and tokenizers, and a fine-tune
//! with every method (`SentenceClassifier::train_step`).

use candle_core::{DType, Device, Tensor, Var};
use grng::optim::adamw::AdamWConfig;
use grng::optim::kalman::RKalmanConfig;
use grng::optim::kron::{InverseMethod, KronConfig};
use grng::optim::sgd::SgdConfig;
use grng::optim::sophia::SophiaConfig;
use grng::optim::OptimizerConfig;
use grng::Error;
use grng_lora::{
    mean_pool, random_weights, Adapt, AdaptConfig, BertConfig, BertModel, BertTokenizer,
    LoraConfig, Pass, SentenceClassifier, WEIGHTS_FILE,
};
use grng_testkit as common;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;

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

/// LoRA of rank 2 on every projection of the top `top` layers.
fn lora_all(top: usize) -> Option<(LoraConfig, AdaptConfig)> {
    let place = AdaptConfig {
        adapt: Adapt::All,
        top_layers: Some(top),
    };
    Some((
        LoraConfig {
            rank: 2,
            alpha: 4.0,
        },
        place,
    ))
}

/// `U(±1)` entries of `shape`, drawn from `rng` (candle's own generator is not seeded).
fn uniform(shape: &[usize], rng: &mut impl Rng) -> Tensor {
    let n = shape.iter().product::<usize>();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    Tensor::from_vec(v, shape, &CPU).unwrap()
}

/// A [`tiny`] model adapted in every projection of its `top` layers, every adapter `B` (zero
/// at init) given random entries so that the adapters change the output.
fn adapted_model(top: usize, rng: &mut impl Rng) -> BertModel {
    let model = BertModel::random(tiny(), &CPU, lora_all(top), rng).unwrap();
    for b in model.adapters().iter().skip(1).step_by(2) {
        let v = b.weight();
        v.set(&(uniform(v.dims(), rng) * 0.5).unwrap()).unwrap();
    }
    model
}

/// `batch x seq` ids of the given lengths (random tokens, `[PAD]` = 0 after), type ids 0 and
/// 1 at random, and the mask.
fn tokens(lens: &[usize], seq: usize, rng: &mut impl Rng) -> (Tensor, Tensor, Tensor) {
    let mut ids = vec![0u32; lens.len() * seq];
    let mut types = vec![0u32; lens.len() * seq];
    let mut mask = vec![0u32; lens.len() * seq];
    for (r, &len) in lens.iter().enumerate() {
        for j in 0..len {
            ids[r * seq + j] = rng.random_range(1..40);
            types[r * seq + j] = rng.random_range(0..2);
            mask[r * seq + j] = 1;
        }
    }
    let t = |v| Tensor::from_vec(v, (lens.len(), seq), &CPU).unwrap();
    (t(ids), t(types), t(mask))
}

/// A seeded generator, an [`adapted_model`] of `top` layers drawn from it, then a batch of
/// [`tokens`] of lengths `lens` padded to `seq` (the generator returned for further draws).
fn adapted_batch(
    top: usize,
    lens: &[usize],
    seq: usize,
) -> (ChaCha8Rng, BertModel, (Tensor, Tensor, Tensor)) {
    let mut rng = common::seeded_rng();
    let model = adapted_model(top, &mut rng);
    let batch = tokens(lens, seq, &mut rng);
    (rng, model, batch)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(&(a - b).unwrap())
}

fn max_abs(a: &Tensor) -> f32 {
    a.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// The argument an [`Error::Value`] names; any other outcome fails the test.
fn value_arg<T>(r: Result<T, Error>) -> &'static str {
    match r {
        Err(Error::Value { arg, .. }) => arg,
        Err(e) => panic!("expected Error::Value, got {e}"),
        Ok(_) => panic!("expected Error::Value, got Ok"),
    }
}

#[test]
fn forward_shapes_and_padding_invariance() {
    let lens = [5, 1, 9, 3];
    let (_, model, (ids, types, mask)) = adapted_batch(2, &lens, 12);
    for pass in [Pass::Eval, Pass::Train] {
        let hidden = model.forward(&ids, &types, &mask, pass).unwrap();
        assert_eq!(hidden.dims(), [4, 12, 16]);
        let pooled = mean_pool(&hidden, &mask).unwrap();
        assert_eq!(pooled.dims(), [4, 16]);
        for (r, &len) in lens.iter().enumerate() {
            let one = |t: &Tensor| t.narrow(0, r, 1).unwrap().narrow(1, 0, len).unwrap();
            let alone = model
                .forward(&one(&ids), &one(&types), &one(&mask), pass)
                .unwrap();
            let alone = mean_pool(&alone, &one(&mask)).unwrap();
            let batched = pooled.narrow(0, r, 1).unwrap();
            // Padding keys get softmax weight exactly 0 (f32::MIN added to their scores), so
            // the two differ only in how f32 sums of ≤ 12 terms are blocked: a few ulps of
            // the O(1) LayerNorm outputs, far below 1e-5 (seen: ≤ 1e-6).
            let d = max_abs_diff(&alone, &batched);
            assert!(
                d <= 1e-5,
                "{pass:?} row {r}: pooled differs by {d} with padding"
            );
        }
    }
}

#[test]
fn cached_lower_layers_continue_exactly() {
    // Adapters in the top layer only: layer 0 is frozen whole and may be cached.
    let (_, model, (ids, types, mask)) = adapted_batch(1, &[7, 4, 10], 10);
    // A training pass may continue from a cache of the layers below the adapted one (0 or
    // 1 here); an evaluation pass from any layer.
    for (pass, splits) in [(Pass::Eval, 0..=2), (Pass::Train, 0..=1)] {
        let full = model.forward(&ids, &types, &mask, pass).unwrap();
        for k in splits {
            let cached = model
                .embed_and_encode(&ids, &types, &mask, k, Pass::Eval)
                .unwrap();
            let rest = model.encode_from(&cached, &mask, k, pass).unwrap();
            // The same operations in the same order (below the adapted layer a training
            // pass runs the evaluation kernels too): equal bit for bit.
            assert_eq!(max_abs_diff(&full, &rest), 0.0, "{pass:?}, split at {k}");
        }
    }
}

#[test]
fn zero_init_adapters_leave_the_frozen_model() {
    let seed = common::seed();
    let frozen = BertModel::random(tiny(), &CPU, None, &mut ChaCha8Rng::seed_from_u64(seed));
    let frozen = frozen.unwrap();
    assert!(frozen.adapters().is_empty());
    // The weights are drawn before the adapters, so the same seed gives the same weights.
    let rng = &mut ChaCha8Rng::seed_from_u64(seed);
    let adapted = BertModel::random(tiny(), &CPU, lora_all(2), rng).unwrap();
    // 6 projections x 2 layers x [A, B].
    assert_eq!(adapted.adapters().len(), 24);
    let (ids, types, mask) = tokens(&[6, 2], 6, &mut common::seeded_rng());
    // In evaluation passes (a training pass of the adapted model runs the composed softmax
    // and LayerNorm, the frozen model's the fused ones: training_and_evaluation_passes_agree).
    let a = frozen.forward(&ids, &types, &mask, Pass::Eval).unwrap();
    let b = adapted.forward(&ids, &types, &mask, Pass::Eval).unwrap();
    // B = 0 adds exact zeros to the frozen product.
    assert_eq!(max_abs_diff(&a, &b), 0.0);
}

#[test]
fn query_value_adapters_and_top_layers() {
    let mut rng = common::seeded_rng();
    let place = AdaptConfig::default();
    assert_eq!(place.adapt, Adapt::QueryValue);
    let model = BertModel::random(tiny(), &CPU, Some((LoraConfig::default(), place)), &mut rng);
    let shapes: Vec<_> = model
        .unwrap()
        .adapters()
        .iter()
        .map(|a| a.shape())
        .collect();
    // Per layer [A_q, B_q, A_v, B_v]: A r x (16 + 1)? No: bias-free, r x 16 and 16 x r.
    assert_eq!(shapes.len(), 8);
    let top = Some((
        LoraConfig::default(),
        AdaptConfig {
            adapt: Adapt::QueryValue,
            top_layers: Some(0),
        },
    ));
    let none = BertModel::random(tiny(), &CPU, top, &mut rng).unwrap();
    assert!(none.adapters().is_empty());
    let too_many = Some((
        LoraConfig::default(),
        AdaptConfig {
            adapt: Adapt::All,
            top_layers: Some(3),
        },
    ));
    let err = BertModel::random(tiny(), &CPU, too_many, &mut rng);
    assert_eq!(value_arg(err), "top_layers");
}

#[test]
fn training_pass_differentiates_every_adapter() {
    let (mut rng, model, (ids, types, mask)) = adapted_batch(2, &[8, 3, 5], 8);
    // A loss that depends on every position and feature.
    let target = uniform(&[3, 16], &mut rng);
    let loss = |pass| -> Tensor {
        let h = model.forward(&ids, &types, &mask, pass).unwrap();
        let p = mean_pool(&h, &mask).unwrap();
        (p - &target).unwrap().sqr().unwrap().sum_all().unwrap()
    };
    let vars = model.adapter_vars();
    let at_start = loss(Pass::Train);
    let l0 = at_start.to_scalar::<f32>().unwrap() as f64;
    let grads = at_start.backward().unwrap();
    // Each adapter moved along its own gradient's direction û = g/‖g‖: the central difference
    // (L(θ + εû) − L(θ − εû)) / 2ε must give ‖g‖. A gradient blocked anywhere (a fused kernel
    // without backward in the training pass) leaves the adapters below it no gradient.
    let eps = 1e-2;
    // Its truncation error ε²·L‴/6 is 1e-5–1e-3 of ‖g‖ at this ε (seen: ≤ 1.3e-3·‖g‖ over
    // 2400 adapters, 100 seeds), allowed 1e-2·‖g‖; each f32 loss is off by a few ulps of L,
    // a difference error ≤ 16·u·|L|/ε (≈ 4e-3, against ‖g‖ ≥ 0.3 seen).
    let noise = 16.0 * common::U32 * l0.abs() / eps;
    for (i, v) in vars.iter().enumerate() {
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("adapter {i} gets no gradient"));
        let norm = g.sqr().unwrap().sum_all().unwrap().sqrt().unwrap();
        let norm_f = norm.to_scalar::<f32>().unwrap() as f64;
        assert!(norm_f > 0.0, "adapter {i} has a zero gradient");
        let step = g.broadcast_div(&norm).unwrap().affine(eps, 0.0).unwrap();
        let start = v.as_tensor().copy().unwrap();
        let moved = |by: &Tensor| {
            v.set(&(&start + by).unwrap()).unwrap();
            loss(Pass::Eval).to_scalar::<f32>().unwrap() as f64
        };
        let fd = (moved(&step) - moved(&step.neg().unwrap())) / (2.0 * eps);
        v.set(&start).unwrap();
        assert!(
            (fd - norm_f).abs() <= 1e-2 * norm_f + noise,
            "adapter {i}: ‖g‖ = {norm_f}, central difference = {fd}"
        );
    }
}

#[test]
fn training_and_evaluation_passes_agree() {
    let (_, model, (ids, types, mask)) = adapted_batch(2, &[9, 4], 9);
    let train = model.forward(&ids, &types, &mask, Pass::Train).unwrap();
    let eval = model.forward(&ids, &types, &mask, Pass::Eval).unwrap();
    // The fused and the composed softmax / LayerNorm round differently: a few ulps of the
    // O(1) outputs per layer, well under 1e-5.
    let d = max_abs_diff(&train, &eval);
    assert!(d <= 1e-5 * max_abs(&eval).max(1.0), "passes differ by {d}");
}

#[test]
fn bad_forward_inputs_are_errors() {
    let mut rng = common::seeded_rng();
    let model = BertModel::random(tiny(), &CPU, None, &mut rng).unwrap();
    let (ids, types, mask) = tokens(&[3, 2], 3, &mut rng);
    let short_mask = mask.narrow(1, 0, 2).unwrap();
    let err = model
        .forward(&ids, &types, &short_mask, Pass::Eval)
        .err()
        .unwrap();
    assert!(matches!(err, Error::Shape { arg: "mask", .. }), "{err}");
    let (long, long_types, long_mask) = tokens(&[25], 25, &mut rng);
    let err = model
        .forward(&long, &long_types, &long_mask, Pass::Eval)
        .err()
        .unwrap();
    assert!(matches!(err, Error::Shape { arg: "ids", .. }), "{err}");
    let out_of_vocab = Tensor::new(&[[1u32, 40]], &CPU).unwrap();
    let two = Tensor::new(&[[1u32, 1]], &CPU).unwrap();
    let err = model.forward(&out_of_vocab, &two.zeros_like().unwrap(), &two, Pass::Eval);
    assert!(matches!(err, Err(Error::Candle(_))), "{err:?}");
    let hidden = Tensor::zeros((2, 3, 15), DType::F32, &CPU).unwrap();
    let err = model
        .encode_from(&hidden, &mask, 1, Pass::Eval)
        .err()
        .unwrap();
    assert!(matches!(err, Error::Shape { arg: "hidden", .. }), "{err}");
    let err = model.embed_and_encode(&ids, &types, &mask, 3, Pass::Eval);
    assert_eq!(value_arg(err), "until_layer");
}

// ---- model folders ----

/// A fresh, empty folder under the system's temp dir.
fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("grng-lora-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `[PAD] [UNK] [CLS] [SEP]`, a few words, then `w5…` up to `size` tokens.
fn vocab(size: usize) -> Vec<String> {
    let words = [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "movie", "was", "good", "bad", "##s",
    ];
    let mut v: Vec<String> = words.iter().map(|w| w.to_string()).collect();
    v.extend((v.len()..size).map(|i| format!("w{i}")));
    v.truncate(size);
    v
}

/// A BERT `tokenizer.json` (lower-casing normalizer, WordPiece, `[CLS] … [SEP]`) over `vocab`.
fn tokenizer_json(vocab: &[String]) -> String {
    let ids: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i.into()))
        .collect();
    let id = |t: &str| vocab.iter().position(|v| v == t).unwrap_or(1);
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": {"type": "BertNormalizer", "clean_text": true,
            "handle_chinese_chars": true, "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "BertProcessing",
            "sep": ["[SEP]", id("[SEP]")], "cls": ["[CLS]", id("[CLS]")]},
        "decoder": null,
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100, "vocab": ids}
    })
    .to_string()
}

/// A model folder: `config.json`, the weights (names prefixed with `prefix`) and a
/// tokenizer of `config`'s vocabulary size.
fn write_folder(dir: &Path, config: &BertConfig, weights: &HashMap<String, Tensor>, prefix: &str) {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(config).unwrap(),
    )
    .unwrap();
    let named: HashMap<String, Tensor> = weights
        .iter()
        .map(|(k, t)| (format!("{prefix}{k}"), t.clone()))
        .collect();
    candle_core::safetensors::save(&named, dir.join(WEIGHTS_FILE)).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        tokenizer_json(&vocab(config.vocab_size)),
    )
    .unwrap();
}

#[test]
fn a_saved_folder_loads_back_the_same_model() {
    let seed = common::seed();
    let weights = random_weights(&tiny(), &CPU, &mut ChaCha8Rng::seed_from_u64(seed)).unwrap();
    let reference = BertModel::random(tiny(), &CPU, None, &mut ChaCha8Rng::seed_from_u64(seed));
    let reference = reference.unwrap();
    let texts = ["The movie was good", "bad", "the movies was the bad movie"];
    for prefix in ["", "bert."] {
        let dir = temp_dir(&format!("roundtrip{prefix}"));
        write_folder(&dir, &tiny(), &weights, prefix);
        let model = BertModel::load(&dir, &CPU, None, &mut common::seeded_rng()).unwrap();
        assert_eq!(model.config(), &tiny());
        let tok = BertTokenizer::load(&dir, model.config(), 8).unwrap();
        let enc = tok.encode(&texts, &CPU).unwrap();
        let ids: Vec<Vec<u32>> = enc.ids.to_vec2().unwrap();
        // [CLS] the movie was good [SEP] [PAD] [PAD]; "movies" is movie ##s; truncated to 8.
        assert_eq!(ids[0], [2, 4, 5, 6, 7, 3, 0, 0]);
        assert_eq!(ids[1], [2, 8, 3, 0, 0, 0, 0, 0]);
        assert_eq!(ids[2], [2, 4, 5, 9, 6, 4, 8, 3]);
        let mask: Vec<Vec<u32>> = enc.mask.to_vec2().unwrap();
        assert_eq!(mask[1], [1, 1, 1, 0, 0, 0, 0, 0]);
        let got = model
            .forward(&enc.ids, &enc.type_ids, &enc.mask, Pass::Eval)
            .unwrap();
        let want = reference
            .forward(&enc.ids, &enc.type_ids, &enc.mask, Pass::Eval)
            .unwrap();
        assert_eq!(max_abs_diff(&got, &want), 0.0, "prefix {prefix:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

fn pretrained_reason(err: Error) -> (PathBuf, String) {
    match err {
        Error::Pretrained { path, reason } => (path, reason),
        e => panic!("expected Error::Pretrained, got {e:?}"),
    }
}

#[test]
fn missing_folder_or_file_says_how_to_fetch() {
    let dir = temp_dir("missing").join("no-such-model");
    let err = BertModel::load(&dir, &CPU, None, &mut common::seeded_rng())
        .err()
        .unwrap();
    let msg = err.to_string();
    let (path, _) = pretrained_reason(err);
    assert_eq!(path, dir);
    assert!(
        msg.contains("no-such-model") && msg.contains("scripts/fetch-minilm.sh"),
        "{msg}"
    );
    let err = BertTokenizer::load(&dir, &tiny(), 8).err().unwrap();
    assert!(err.to_string().contains("scripts/fetch-minilm.sh"), "{err}");

    let dir = temp_dir("no-weights");
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&tiny()).unwrap(),
    )
    .unwrap();
    let err = BertModel::load(&dir, &CPU, None, &mut common::seeded_rng())
        .err()
        .unwrap();
    let (path, _) = pretrained_reason(err);
    assert_eq!(path, dir.join(WEIGHTS_FILE));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn wrong_architecture_names_the_tensor_or_field() {
    let mut rng = common::seeded_rng();
    let weights = random_weights(&tiny(), &CPU, &mut rng).unwrap();
    let dir = temp_dir("arch");
    let load = |rng: &mut ChaCha8Rng| BertModel::load(&dir, &CPU, None, rng).err().unwrap();

    // A tensor missing.
    let key = "encoder.layer.1.attention.self.key.weight";
    let mut missing = weights.clone();
    missing.remove(key);
    write_folder(&dir, &tiny(), &missing, "");
    let (path, reason) = pretrained_reason(load(&mut rng));
    assert_eq!(path, dir.join(WEIGHTS_FILE));
    assert!(reason.contains(key), "{reason}");

    // A tensor of another shape.
    let key = "encoder.layer.0.intermediate.dense.weight";
    let mut reshaped = weights.clone();
    reshaped.insert(
        key.into(),
        Tensor::zeros((16, 32), DType::F32, &CPU).unwrap(),
    );
    write_folder(&dir, &tiny(), &reshaped, "");
    let (_, reason) = pretrained_reason(load(&mut rng));
    assert!(
        reason.contains(key) && reason.contains("[16, 32]") && reason.contains("[32, 16]"),
        "{reason}"
    );

    // A config.json of another width than the checkpoint.
    let wide = BertConfig {
        hidden_size: 32,
        ..tiny()
    };
    write_folder(&dir, &tiny(), &weights, "");
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&wide).unwrap(),
    )
    .unwrap();
    let (_, reason) = pretrained_reason(load(&mut rng));
    assert!(
        reason.contains("[16]") && reason.contains("[32]"),
        "{reason}"
    );

    // An unsupported activation; a field missing; not JSON.
    let relu = BertConfig {
        hidden_act: "relu".into(),
        ..tiny()
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&relu).unwrap(),
    )
    .unwrap();
    let (path, reason) = pretrained_reason(load(&mut rng));
    assert_eq!(path, dir.join("config.json"));
    assert!(reason.contains("hidden_act"), "{reason}");
    std::fs::write(dir.join("config.json"), r#"{"vocab_size": 40}"#).unwrap();
    let (_, reason) = pretrained_reason(load(&mut rng));
    assert!(reason.contains("hidden_size"), "{reason}");

    // Weights that are not a safetensors file.
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&tiny()).unwrap(),
    )
    .unwrap();
    std::fs::write(dir.join(WEIGHTS_FILE), b"not safetensors").unwrap();
    let (_, reason) = pretrained_reason(load(&mut rng));
    assert!(reason.contains("not a safetensors file"), "{reason}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mismatched_tokenizers_are_refused() {
    let dir = temp_dir("tokenizer");
    let path = dir.join("tokenizer.json");
    // Another model's vocabulary size.
    std::fs::write(&path, tokenizer_json(&vocab(30))).unwrap();
    let err = BertTokenizer::from_file(&path, &tiny(), 8).err().unwrap();
    let (p, reason) = pretrained_reason(err);
    assert_eq!(p, path);
    assert!(
        reason.contains("30") && reason.contains("vocab_size = 40"),
        "{reason}"
    );
    // No [PAD] (renamed), same size.
    let mut v = vocab(40);
    v[0] = "<pad>".into();
    std::fs::write(&path, tokenizer_json(&v)).unwrap();
    let (_, reason) = pretrained_reason(BertTokenizer::from_file(&path, &tiny(), 8).err().unwrap());
    assert!(reason.contains("[PAD]"), "{reason}");
    // Not a tokenizer; a length the model cannot take.
    std::fs::write(&path, "{}").unwrap();
    let (_, reason) = pretrained_reason(BertTokenizer::from_file(&path, &tiny(), 8).err().unwrap());
    assert!(reason.contains("not a tokenizer.json"), "{reason}");
    std::fs::write(&path, tokenizer_json(&vocab(40))).unwrap();
    let err = BertTokenizer::from_file(&path, &tiny(), 25);
    assert_eq!(value_arg(err), "max_len");
    let tok = BertTokenizer::from_file(&path, &tiny(), 8).unwrap();
    let err = tok.encode::<&str>(&[], &CPU).err().unwrap();
    assert!(matches!(err, Error::Value { .. }), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn adapter_vars_are_the_adapters_weights() {
    let model = BertModel::random(tiny(), &CPU, lora_all(1), &mut common::seeded_rng()).unwrap();
    let vars: Vec<Var> = model.adapter_vars();
    let adapters = model.adapters();
    assert_eq!(vars.len(), 12);
    for (v, a) in vars.iter().zip(&adapters) {
        assert_eq!(v.as_tensor().id(), a.weight().as_tensor().id());
    }
}

// ---- Fine-tuning with every method ----

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
    (
        Tensor::from_vec(ids, (n, s), &CPU).unwrap(),
        Tensor::zeros((n, s), DType::U32, &CPU).unwrap(),
        Tensor::from_vec(mask, (n, s), &CPU).unwrap(),
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
        let model = BertModel::random(tiny(), &CPU, Some((lora, AdaptConfig::default())), &mut rng)
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
