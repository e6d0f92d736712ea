//! How the output gradients of the Fisher statistics are formed ([`FisherMode`]) and the
//! draw of a sampled label ([`sample_class`]): shared by every trainer that feeds
//! [`KronStats`](super::KronStats) (the reference MLP of `grng-train`, the candle layers of
//! `grng-candle`).

/// Which output gradients feed the error factor `Γ = (1/rows) Êᵀ Ê` (docs/math.md §1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FisherMode {
    /// True Fisher, one Monte-Carlo sample per input (docs/math.md §1, Algorithm 1 line 7): labels drawn
    /// from the model's predictive distribution — a class `c ~ softmax(z_k)` for softmax, a value
    /// `y ~ N(ŷ_k, I)` for squared error (the unit-variance Gaussian the loss is the NLL of).
    #[default]
    Sampled,
    /// True Fisher, expectation taken in closed form. The statistics have `m·C` rows (`C` = the
    /// output width): row `k·C + c` of the output `Ê` is `√(C·p_kc)·(p_k − onehot(c))` for
    /// softmax and `√C·onehot(c)` for squared error (whose `E[e eᵀ] = I`), backpropagated like
    /// any output gradient, and `A`'s row `k` is repeated `C` times. Then
    /// `(1/(mC)) ÊᵀÊ = (1/m) Σ_k Σ_c p_kc e_kc e_kcᵀ` — the exact expectation — and
    /// `(1/(mC)) AᵀA` is unchanged, so consumers apply the usual `1/rows` normalisation.
    /// The rows are NOT the gradient of any loss: do not form `EᵀA` from them.
    Exact,
    /// Empirical Fisher: the data labels (only as an option, docs/math.md §1).
    Empirical,
}

/// Inverse-CDF draw from the probabilities `p` with a uniform `u ∈ [0, 1)`; rounding that
/// leaves the cumulative sum below `u` falls back to the last class with positive probability.
pub fn sample_class(p: &[f32], u: f64) -> usize {
    let mut cum = 0.0f64;
    let mut last = 0;
    for (j, &pj) in p.iter().enumerate() {
        if pj > 0.0 {
            last = j;
            cum += pj as f64;
            if u < cum {
                return j;
            }
        }
    }
    last
}
