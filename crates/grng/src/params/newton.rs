//! Settings and reports of the Newton inversion (docs/math.md §2), used by
//! [`Device::newton_inverse`](crate::Device::newton_inverse) and both backends.

use crate::error::{check_value, Result};

/// The Newton–Schulz iteration, by the power its error is raised to per step
/// (`I − A X_{k+1} = (I − A X_k)^p`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NewtonOrder {
    /// `X ← X (2I − AX)`: 2 products per step.
    Quadratic,
    /// `X ← X (3I − 3AX + (AX)²)`: 3 products per step, the best error reduction per product.
    #[default]
    Cubic,
    /// `X ← X (4I − AX (6I − AX (4I − AX)))`: 4 products per step.
    Quartic,
}

/// The starting guess `X₀` (docs/math.md §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum InitialGuess {
    /// The paper's `X₀ = Aᵀ / (‖A‖₁ ‖A‖∞)`: always convergent, but the eigenvalues of `A X₀`
    /// are `λ²/(‖A‖₁‖A‖∞)`, so the condition number is squared and the residual sits near 1
    /// for the first iterations.
    Paper,
    /// The SPD-aware `X₀ = c I`, `c = 2 / (λ_hi + λ_low)`, with `λ_low` =
    /// [`NewtonOptions::lambda_low`] and `λ_hi = 1.1·min(‖A‖∞, m + s√(n−1))` (`m = tr A/n`,
    /// `s² = ‖A‖_F²/n − m²`: the Wolkowicz–Styan bound, one pass over `A`, no power iteration),
    /// or `1.1·`[`NewtonOptions::lambda_high`] when that is smaller. The eigenvalues of
    /// `I − A X₀` then lie in `(−1, 1)`; should a caller's estimate have missed `λ_max` (the
    /// iteration diverges), it restarts once from the bound ([`NewtonInfo::residual_history`]
    /// then holds both runs).
    #[default]
    ScaledIdentity,
    /// The caller's previous inverse, when `‖I − A X_warm‖₂ < 1` (tested through the bounds
    /// `‖·‖_F` and `√(‖·‖₁‖·‖∞)`); otherwise [`InitialGuess::ScaledIdentity`].
    /// [`NewtonInfo::init_used`] says which one ran.
    Warm,
}

/// Arithmetic of the products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// `f32` everywhere.
    #[default]
    F32,
    /// Every product's inputs are rounded to `bf16` (round-to-nearest-even) and accumulated in
    /// `f32`; the iterate stays `f32` (the tensor-core GPU path). Converges to a floor that
    /// grows with the condition number (see [`crate::cpu::newton`]); the best iterate is kept.
    Bf16,
}

/// Where an `F32` iteration stops (docs/math.md §2). Ignored in [`Precision::Bf16`] mode,
/// which always runs to its floor (its `tol` is below any `bf16` floor but the smallest κ).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NewtonStop {
    /// At the `f32` rounding floor: past `tol`, until a step no longer lowers the residual,
    /// or lowers it to more than twice what exact arithmetic allows from the previous one
    /// (`r_{k+1} ≤ (√n·r_k)^(p−1)·r_k`: rounding, not convergence, set it, so further steps
    /// cannot go lower). The best iterate is returned; `tol` is the acceptance bound (a floor
    /// above it is [`Error::Diverged`](crate::Error::Diverged)). 0–1 steps more than
    /// [`NewtonStop::Tol`], at most 2 (`docs/math.md` §2), for the residual of the floor
    /// (`≈ 5e-9·κ`) instead of up to `tol`.
    #[default]
    Floor,
    /// At the first residual `≤ tol` (the default before the floor rule): the cheapest stop,
    /// which leaves up to `tol` of residual — at `1e-4`, a few `1e-5` of relative error in a
    /// preconditioned update.
    Tol,
}

/// Settings of [`Device::newton_inverse`](crate::Device::newton_inverse).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NewtonOptions {
    /// Iteration order. Default [`NewtonOrder::Cubic`].
    pub order: NewtonOrder,
    /// Starting guess. Default [`InitialGuess::ScaledIdentity`].
    pub init: InitialGuess,
    /// Product arithmetic. Default [`Precision::F32`].
    pub precision: Precision,
    /// The residual `‖I − AX‖_F / √n` (`tol > 0`) that is good enough: with
    /// [`NewtonStop::Floor`] (the default) the largest accepted floor, with
    /// [`NewtonStop::Tol`] (and in `Bf16` mode) the stop itself. Default `1e-4`, which the
    /// `f32` floor stays below up to condition numbers of about `1e4`.
    pub tol: f32,
    /// Where the `F32` iteration stops. Default [`NewtonStop::Floor`].
    pub stop: NewtonStop,
    /// Iteration budget (`0` only evaluates `X₀`). Default `100`: the cubic iteration from
    /// the scaled identity needs about `log₃ κ + 3` steps, the quadratic one from the paper's
    /// start about `2 log₂ κ + 5`.
    pub max_iter: usize,
    /// A known lower bound `≥ 0` on the smallest eigenvalue of `A` (for a damped factor
    /// `Λ + λI`: the damping `λ`), used by [`InitialGuess::ScaledIdentity`]. Any value is safe;
    /// a tight one saves iterations. Default `0`.
    pub lambda_low: f32,
    /// An estimate `> 0` of the largest eigenvalue of `A` already at hand (for a damped factor
    /// `Λ + λI` whose `‖Λ‖₂` was computed: `‖Λ‖₂ + λ`), used by
    /// [`InitialGuess::ScaledIdentity`] when below the guaranteed bound from `A`'s norms. An
    /// underestimate that makes the iteration diverge is retried once from the bound. Default
    /// `None`: the bound alone (`min(‖A‖∞, Wolkowicz–Styan)`, one pass, no power iteration).
    pub lambda_high: Option<f32>,
    /// After a [`Precision::Bf16`] run, one `f32` quadratic step from the best iterate (which
    /// squares its residual), kept only if it lowers the residual. Ignored in `F32` mode.
    /// Default `true`.
    pub polish: bool,
}

impl Default for NewtonOptions {
    fn default() -> Self {
        Self {
            order: NewtonOrder::Cubic,
            init: InitialGuess::ScaledIdentity,
            precision: Precision::F32,
            tol: 1e-4,
            stop: NewtonStop::Floor,
            max_iter: 100,
            lambda_low: 0.0,
            lambda_high: None,
            polish: true,
        }
    }
}

impl NewtonOptions {
    /// `Err(Error::Value)` unless `tol` is finite and `> 0`, `lambda_low` finite and `≥ 0`,
    /// and `lambda_high` (when given) finite and `> 0`.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        check_value(op, "tol", self.tol as f64, self.tol > 0.0, "tol > 0")?;
        check_value(
            op,
            "lambda_low",
            self.lambda_low as f64,
            self.lambda_low >= 0.0,
            "lambda_low >= 0",
        )?;
        if let Some(h) = self.lambda_high {
            check_value(op, "lambda_high", h as f64, h > 0.0, "lambda_high > 0")?;
        }
        Ok(())
    }
}

/// What a Newton inversion achieved.
#[derive(Clone, Debug, PartialEq)]
pub struct NewtonInfo {
    /// `‖I − AX‖_F / √n` of the returned `X`, from an `f32` product (in `Bf16` mode
    /// recomputed in `f32` at the end, so it includes the rounding of `A` to `bf16`).
    pub residual: f32,
    /// Newton steps applied to `X₀` to reach the returned `X` (the `Bf16` polish not counted;
    /// after a scaled-identity restart, the first run's steps included).
    pub iterations: usize,
    /// The starting guess actually used.
    pub init_used: InitialGuess,
    /// `residual_history[k]` = residual of `X_k` as the iteration saw it (from its own
    /// products, so with `bf16` inputs in `Bf16` mode); `X₀` first. `iterations + 1` entries
    /// with [`NewtonStop::Tol`] (`Bf16`, and [`NewtonStop::Floor`] where a step did not
    /// improve, add the steps past the best iterate); after a restart the two
    /// runs follow each other, each from its own `X₀`.
    pub residual_history: Vec<f32>,
    /// Whether the `Bf16` polish step was applied (it is dropped when it does not help).
    pub polished: bool,
}
