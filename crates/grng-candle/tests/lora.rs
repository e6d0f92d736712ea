//! `LoraLinear`: its forward pass against the formula, the frozen layer it starts as, its
//! adapters' gradients against finite differences, their Kronecker statistics against the
//! explicit Fisher, and bad input.

use grng_testkit as common;

use candle_core::{Device as CDevice, Module, Tensor};
use grng::optim::fisher::FisherMode;
use grng::Error;
use grng_candle::{capture_fisher, KronLinear, LoraConfig, LoraLinear};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn rand_tensor(rng: &mut ChaCha8Rng, dims: &[usize], bound: f32) -> Tensor {
    let n = dims.iter().product();
    let v = common::uniform(rng, n, -bound, bound);
    Tensor::from_vec(v, dims, &CDevice::Cpu).unwrap()
}

/// A layer `d_out x d_in` of rank `r` with random `W₀`, `b₀` and a random (non-zero) `B`;
/// also `W₀` and `b₀`.
fn layer_with(
    rng: &mut ChaCha8Rng,
    d_in: usize,
    d_out: usize,
    r: usize,
    alpha: f32,
) -> (LoraLinear, Tensor, Tensor) {
    let w0 = rand_tensor(rng, &[d_out, d_in], 1.0);
    let b0 = rand_tensor(rng, &[d_out], 1.0);
    let lora = LoraLinear::new(&w0, Some(&b0), LoraConfig { rank: r, alpha }, rng).unwrap();
    let [_, b] = lora.adapters();
    b.weight().set(&rand_tensor(rng, &[d_out, r], 1.0)).unwrap();
    (lora, w0, b0)
}

fn layer(rng: &mut ChaCha8Rng, d_in: usize, d_out: usize, r: usize, alpha: f32) -> LoraLinear {
    layer_with(rng, d_in, d_out, r, alpha).0
}

/// Row-major `f64` copy of a 2-D tensor.
fn mat64(t: &Tensor) -> Vec<f64> {
    host(t).iter().map(|&v| v as f64).collect()
}

proptest! {
    #![proptest_config(common::proptest_config(24))]

    /// `y = W₀x + b₀ + (α/r)·B A x` for inputs of any leading shape, against an `f64`
    /// evaluation of the formula. Bound: each output is a sum of `d_in` products for `W₀x`
    /// and `r` (`d_in` each) for `B A x`, all in `f32`; the error is at most
    /// `γ_k·Σ|terms|` with `k = d_in + r + 3` roundings per output (Higham's `γ_k ≈ k·u`),
    /// checked at `2γ_k` times the `f64` sum of absolute terms.
    #[test]
    fn forward_is_the_formula(
        d_in in 1usize..20, d_out in 1usize..20, r in 1usize..6, batch in 1usize..4,
        seq in 1usize..5, alpha in 0.5f32..16.0, seed in any::<u64>(),
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (lora, w0, b0) = layer_with(&mut rng, d_in, d_out, r, alpha);
        let x = rand_tensor(&mut rng, &[batch, seq, d_in], 1.0);
        let y = lora.forward(&x).unwrap();
        prop_assert_eq!(y.dims(), &[batch, seq, d_out]);
        prop_assert_eq!(host(&y), host(&lora.forward_eval(&x).unwrap()));
        let [a, b] = lora.adapters();
        let (w0, b0, a, b, xs) = (mat64(&w0), mat64(&b0), mat64(a.weight()), mat64(b.weight()), mat64(&x));
        let (ys, s) = (host(&y), lora.scale());
        let k = (d_in + r + 3) as f64;
        let gamma = k * common::U32 / (1.0 - k * common::U32);
        for row in 0..batch * seq {
            let xr = &xs[row * d_in..(row + 1) * d_in];
            let dot = |w: &[f64], v: &[f64]| -> (f64, f64) {
                w.iter().zip(v).fold((0.0, 0.0), |(s, t), (a, b)| (s + a * b, t + (a * b).abs()))
            };
            let ax: Vec<(f64, f64)> = (0..r).map(|q| dot(&a[q * d_in..(q + 1) * d_in], xr)).collect();
            for i in 0..d_out {
                let (base, base_abs) = dot(&w0[i * d_in..(i + 1) * d_in], xr);
                let (low, low_abs) = (0..r).fold((0.0, 0.0), |(v, t), q| {
                    (v + b[i * r + q] * ax[q].0, t + b[i * r + q].abs() * ax[q].1)
                });
                let want = base + b0[i] + s * low;
                let scale = base_abs + b0[i].abs() + s * low_abs;
                let got = ys[row * d_out + i] as f64;
                prop_assert!((got - want).abs() <= 2.0 * gamma * scale,
                    "row {} out {}: {} vs {}", row, i, got, want);
            }
        }
    }
}

/// A fresh layer (`B = 0`) computes exactly the frozen layer: `candle_nn::Linear` on the same
/// `W₀`, `b₀`, to the rounding of one product (its kernel may order the sums differently).
#[test]
fn zero_b_is_the_frozen_layer() {
    let mut rng = common::seeded_rng();
    for _ in 0..8 {
        let (d_in, d_out, r) = (
            rng.random_range(1..40),
            rng.random_range(1..40),
            rng.random_range(1..9),
        );
        let w0 = rand_tensor(&mut rng, &[d_out, d_in], 1.0);
        let b0 = rand_tensor(&mut rng, &[d_out], 1.0);
        let lora = LoraLinear::new(
            &w0,
            Some(&b0),
            LoraConfig {
                rank: r,
                alpha: 8.0,
            },
            &mut rng,
        )
        .unwrap();
        let frozen = candle_nn::Linear::new(w0.clone(), Some(b0.clone()));
        let x = rand_tensor(&mut rng, &[3, 5, d_in], 1.0);
        let (got, want) = (
            host(&lora.forward(&x).unwrap()),
            host(&frozen.forward(&x).unwrap()),
        );
        // Each output: d_in + 1 terms of magnitude ≤ 1, so |error| ≤ 2·γ_{d_in+1}·(d_in + 1).
        let k = (d_in + 1) as f64;
        let tol = 2.0 * k * k * common::U32;
        for (g, w) in got.iter().zip(&want) {
            assert!(((g - w) as f64).abs() <= tol, "{g} vs {w} (tol {tol})");
        }
        assert_eq!(
            host(lora.adapters()[1].weight()),
            vec![0.0; d_out * r],
            "B starts at zero"
        );
    }
}

/// Cross-entropy of `logits` (`n x C`) against `labels`.
fn loss(logits: &Tensor, labels: &[u32]) -> Tensor {
    let y = Tensor::from_slice(labels, labels.len(), logits.device()).unwrap();
    candle_nn::loss::cross_entropy(logits, &y).unwrap()
}

/// The adapters' gradients of a cross-entropy through a LoRA layer (mean over positions, then
/// a frozen head) against central differences along a random direction: `⟨∇L, D⟩` vs
/// `(L(θ + hD) − L(θ − hD))/2h` with `h = 1e-2` in `f32`. The truncation error is `h²/6·L'''`
/// (≲ 1e-4 here: unit-scale weights and inputs) and the rounding `~ε·|L|/h ≈ 1e-5·|L|`, so a
/// relative tolerance of 1e-2 on `|⟨∇L, D⟩|` + `1e-3` leaves ten times the margin.
#[test]
fn adapter_gradients_match_finite_differences() {
    let mut rng = common::seeded_rng();
    for _ in 0..6 {
        let (d_in, d_out, r, n, t, c) = (
            rng.random_range(2..12),
            rng.random_range(2..12),
            rng.random_range(1..5),
            rng.random_range(1..5),
            rng.random_range(1..4),
            rng.random_range(2..5),
        );
        let lora = layer(&mut rng, d_in, d_out, r, 4.0);
        let head = rand_tensor(&mut rng, &[c, d_out], 1.0);
        let x = rand_tensor(&mut rng, &[n, t, d_in], 1.0);
        let labels: Vec<u32> = (0..n).map(|_| rng.random_range(0..c as u32)).collect();
        let f = |lora: &LoraLinear| {
            let y = lora.forward(&x).unwrap().mean(1).unwrap();
            loss(&y.matmul(&head.t().unwrap()).unwrap(), &labels)
        };
        let grads = f(&lora).backward().unwrap();
        for adapter in lora.adapters() {
            let w = adapter.weight();
            let g = grads.get(w.as_tensor()).expect("adapter gradient");
            let d = rand_tensor(&mut rng, w.dims(), 1.0);
            let analytic: f32 = g.mul(&d).unwrap().sum_all().unwrap().to_scalar().unwrap();
            let w0 = w.as_tensor().copy().unwrap();
            let h = 1e-2;
            let at = |sign: f64| {
                w.set(&(&w0 + (&d * (sign * h)).unwrap()).unwrap()).unwrap();
                f(&lora).to_scalar::<f32>().unwrap() as f64
            };
            let fd = (at(1.0) - at(-1.0)) / (2.0 * h);
            w.set(&w0).unwrap();
            let tol = 1e-2 * (analytic as f64).abs() + 1e-3;
            assert!(
                (fd - analytic as f64).abs() <= tol,
                "{:?}: fd {fd} vs analytic {analytic}",
                adapter.shape()
            );
        }
    }
}

/// `Σ_c w_c vec(g_c) vec(g_c)ᵀ` with `vec` row-major: the explicit Fisher of one sample.
fn explicit_fisher(per_class: &[(f64, Vec<f64>)]) -> Vec<f64> {
    let len = per_class[0].1.len();
    let mut f = vec![0.0; len * len];
    for (w, g) in per_class {
        for i in 0..len {
            for j in 0..len {
                f[i * len + j] += w * g[i] * g[j];
            }
        }
    }
    f
}

/// `(EᵀE/rows) ⊗ (AᵀA/rows)` (`Γ ⊗ Λ` in the row-major `vec(W)` order), from captured
/// statistics.
fn kron_of_stats(a: &Tensor, e: &Tensor) -> Vec<f64> {
    let gram = |t: &Tensor| {
        let (rows, cols) = t.dims2().unwrap();
        (common::gram64(&host(t), rows, cols), cols)
    };
    let ((lam, din), (gam, dout)) = (gram(a), gram(e));
    let len = din * dout;
    let mut k = vec![0.0; len * len];
    for (i1, j1, i2, j2) in (0..dout)
        .flat_map(|i1| (0..din).map(move |j1| (i1, j1)))
        .flat_map(|(i1, j1)| (0..dout).flat_map(move |i2| (0..din).map(move |j2| (i1, j1, i2, j2))))
    {
        k[(i1 * din + j1) * len + i2 * din + j2] = gam[i1 * dout + i2] * lam[j1 * din + j2];
    }
    k
}

/// One sample at one position: K-FAC is exact, so each adapter's captured Kronecker factors
/// (`FisherMode::Exact`) give exactly its Fisher block `Σ_c p_c g_c g_cᵀ`, with `g_c` the
/// gradient of `−log p_c` from candle's own backward pass on the adapter weight (no probes).
/// Both sides are `f32` products of unit-scale terms summed over `≤ d_in·C` entries: compared
/// at `1e-4·max|F| + 1e-7`.
#[test]
fn kronecker_factors_are_the_fisher_blocks() {
    let mut rng = common::seeded_rng();
    for _ in 0..4 {
        let (d_in, d_out, r, c) = (
            rng.random_range(2..7),
            rng.random_range(2..7),
            rng.random_range(1..4),
            rng.random_range(2..5),
        );
        let lora = layer(&mut rng, d_in, d_out, r, 2.0);
        let head = KronLinear::new(d_out, c, &CDevice::Cpu).unwrap();
        let x = rand_tensor(&mut rng, &[1, d_in], 1.0);
        let logits = head.forward(&lora.forward(&x).unwrap()).unwrap();
        let adapters = lora.adapters();
        capture_fisher(&adapters, &logits, FisherMode::Exact, &[0], &mut rng).unwrap();
        let p = host(&candle_nn::ops::softmax_last_dim(&logits).unwrap());
        for adapter in &adapters {
            let (a, e) = adapter.fisher_stats().expect("captured");
            let per_class: Vec<(f64, Vec<f64>)> = (0..c)
                .map(|cls| {
                    let z = head.forward_eval(&lora.forward_eval(&x).unwrap()).unwrap();
                    let g = loss(&z, &[cls as u32]).backward().unwrap();
                    (
                        p[cls] as f64,
                        mat64(g.get(adapter.weight().as_tensor()).unwrap()),
                    )
                })
                .collect();
            let want = explicit_fisher(&per_class);
            let got = kron_of_stats(&a, &e);
            let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-4 * scale + 1e-7, "{g} vs {w}");
            }
        }
    }
}

/// A layer applied at `T` positions under mean pooling and a frozen linear head: `B`'s output
/// gradient at each position is analytic, `(α/r)/T · W_hᵀ(p_k − onehot(y_k))`, and the captured
/// `E` (`FisherMode::Empirical`) is it times `√T` (K-FAC-expand), `A` the rows `A x_kt`.
/// Tolerance: `f32` softmax and one `C`-term product, `1e-5` relative to the largest entry.
#[test]
fn positions_get_k_fac_expand_statistics() {
    let mut rng = common::seeded_rng();
    let (d_in, d_out, r, n, t, c) = (5, 4, 2, 3, 4, 3);
    let lora = layer(&mut rng, d_in, d_out, r, 2.0);
    let head = rand_tensor(&mut rng, &[c, d_out], 1.0);
    let x = rand_tensor(&mut rng, &[n, t, d_in], 1.0);
    let labels: Vec<u32> = (0..n).map(|_| rng.random_range(0..c as u32)).collect();
    let logits = lora
        .forward(&x)
        .unwrap()
        .mean(1)
        .unwrap()
        .matmul(&head.t().unwrap())
        .unwrap();
    let adapters = lora.adapters();
    capture_fisher(&adapters, &logits, FisherMode::Empirical, &labels, &mut rng).unwrap();
    let (a_b, e_b) = adapters[1].fisher_stats().unwrap();
    assert_eq!(e_b.dims(), &[n * t, d_out]);
    let p = host(&candle_nn::ops::softmax_last_dim(&logits).unwrap());
    let hw = host(&head);
    let e = host(&e_b);
    let coeff = lora.scale() / t as f64 * (t as f64).sqrt();
    let max = e.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
    for k in 0..n {
        for pos in 0..t {
            for i in 0..d_out {
                let want: f64 = (0..c)
                    .map(|cls| {
                        let resid = p[k * c + cls] as f64 - f64::from(cls as u32 == labels[k]);
                        hw[cls * d_out + i] as f64 * resid
                    })
                    .sum::<f64>()
                    * coeff;
                let got = e[(k * t + pos) * d_out + i] as f64;
                assert!((got - want).abs() <= 1e-5 * max, "{got} vs {want}");
            }
        }
    }
    // B's inputs are A x at every position.
    let ax = x
        .reshape((n * t, d_in))
        .unwrap()
        .matmul(&adapters[0].weight().t().unwrap())
        .unwrap();
    assert_eq!(host(&a_b), host(&ax));
}

/// Bad shapes and values are typed errors.
#[test]
fn bad_lora_input_is_a_typed_error() {
    let mut rng = common::seeded_rng();
    let w0 = rand_tensor(&mut rng, &[4, 3], 1.0);
    let ok = LoraConfig::default();
    let cases: Vec<(grng::Result<LoraLinear>, &str)> = vec![
        (
            LoraLinear::new(&rand_tensor(&mut rng, &[4], 1.0), None, ok, &mut rng),
            "w0 not a matrix",
        ),
        (
            LoraLinear::new(&w0, Some(&rand_tensor(&mut rng, &[3], 1.0)), ok, &mut rng),
            "b0 of the wrong length",
        ),
        (
            LoraLinear::new(
                &w0,
                None,
                LoraConfig {
                    rank: 0,
                    alpha: 8.0,
                },
                &mut rng,
            ),
            "rank 0",
        ),
    ];
    for (r, what) in cases {
        assert!(matches!(r, Err(Error::Shape { .. })), "{what}: {r:?}");
    }
    for alpha in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let r = LoraLinear::new(&w0, None, LoraConfig { rank: 2, alpha }, &mut rng);
        assert!(
            matches!(r, Err(Error::Value { .. })),
            "alpha {alpha}: {r:?}"
        );
    }
    let nan = w0.affine(f64::NAN, 0.0).unwrap();
    let r = LoraLinear::new(&nan, None, ok, &mut rng);
    assert!(matches!(r, Err(Error::NonFinite { .. })), "{r:?}");
    let lora = LoraLinear::new(&w0, None, ok, &mut rng).unwrap();
    let r = lora.forward_eval(&rand_tensor(&mut rng, &[2, 4], 1.0));
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    let r = KronLinear::bias_free(&rand_tensor(&mut rng, &[3], 1.0));
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    assert_eq!(KronLinear::bias_free(&w0).unwrap().shape(), (4, 3));
}
