//! Hyperparameters of the Kronecker-factored optimizers (docs/math.md §2, defaults from docs/math.md §6).

use crate::device::Device;
use crate::error::{check_value, Result};
use crate::ops::newton::{InitialGuess, NewtonOptions, Precision};
use crate::ops::norm::PowerOptions;

/// Which damping rule (docs/math.md §2 table) the optimizer applies to the factors `Λ` and `Γ`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KronVariant {
    /// RING: `λ_Λ = √ρ·‖Λ‖₂`, `λ_Γ = √ρ·‖Γ‖₂` (spectral norms by power iteration).
    Ring,
    /// RENG: `λ_Λ = λ_Γ = √ρ`. The trainer passes the gradient of `L + c‖∇L‖²`, i.e.
    /// `g + 2c·H_L g` (e.g. `grng_train::mlp::Mlp::regularized_gradient` with `c =`
    /// [`KronConfig::grad_reg`]); the optimizer preconditions whatever gradient it receives.
    Reng,
    /// NGD baseline (K-FAC, factored Tikhonov): `λ_Λ = π√ρ`, `λ_Γ = √ρ/π` with
    /// `π = √((tr Λ / d_in) / (tr Γ / d_out))` (Martens & Grosse 2015), `π = 1` when a trace
    /// is zero.
    Ngd,
}

/// How the damped factors are inverted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InverseMethod {
    /// The fastest exact-enough method of the device (the default), see
    /// [`InverseMethod::resolve`]: [`InverseMethod::Cholesky`] on [`Device::Cpu`] (faer's
    /// blocked Cholesky inverse takes about n³ flops, Newton about 18 GEMMs of 2n³: 5–10x
    /// slower on a CPU, `docs/benchmarks.md` §3), warm-started [`InverseMethod::Newton`] with
    /// default options (to the `f32` floor) on [`Device::Cuda`] and [`Device::Emulated`]
    /// (GEMM-only and device-resident, no triangular solves or host round trip) — there for
    /// factors larger than [`KronConfig::host_refresh_max`]; smaller ones are refreshed and
    /// inverted by Cholesky on the host.
    ///
    /// On [`Device::Cpu`] a Cholesky inversion at a refresh whose factor is replaced (EMA
    /// `ε = 0`, the default, or the first refresh) from `m ≤ n/2` statistics rows (`n > 64`,
    /// [`crate::cpu::low_rank_is_cheaper`]) is done without the factor, by the Woodbury
    /// identity from the rows ([`crate::cpu::low_rank_damped_inverse`]: the same exact inverse
    /// in `f64`, ~`2m²n + mn²` flops against ~`n³`; 1.5–4x faster at m = 256, n = 785 and 1024,
    /// `docs/benchmarks.md` §3), counted in [`super::KronCounters::low_rank_inversions`].
    /// Blended factors, lazy recomputes and the Newton fallback invert the formed factor by
    /// Cholesky.
    Auto,
    /// Newton iteration ([`crate::Device::newton_inverse`]). The optimizer raises
    /// `lambda_low` to the damping in use (a lower bound on the damped factor's spectrum)
    /// and, with [`InitialGuess::Warm`], passes the previous inverse as the warm start.
    /// On [`crate::Error::Diverged`] it retries once with [`NEWTON_RETRY_DAMPING`] times the
    /// damping, then falls back to Cholesky; both are counted in
    /// [`super::KronCounters`].
    Newton(NewtonOptions),
    /// Exact inverse through a Cholesky factorization ([`crate::Device::cholesky_inverse`]),
    /// or on [`Device::Cpu`] through the low-rank path described at [`InverseMethod::Auto`].
    Cholesky,
}

impl InverseMethod {
    /// The method used on `device`: [`InverseMethod::Auto`] resolved as documented there,
    /// any other method as is.
    pub fn resolve(&self, device: &Device) -> InverseMethod {
        match (self, device) {
            (InverseMethod::Auto, Device::Cpu) => InverseMethod::Cholesky,
            (InverseMethod::Auto, Device::Emulated | Device::Cuda(_)) => {
                InverseMethod::Newton(NewtonOptions {
                    init: InitialGuess::Warm,
                    ..NewtonOptions::default()
                })
            }
            (m, _) => *m,
        }
    }

    /// Short name for reports: `"newton"` or `"cholesky"` (`"auto"` unresolved).
    pub fn label(&self) -> &'static str {
        match self {
            InverseMethod::Auto => "auto",
            InverseMethod::Newton(_) => "newton",
            InverseMethod::Cholesky => "cholesky",
        }
    }
}

/// Factor by which the damping is multiplied for the single Newton retry after a divergence.
/// Ten times the damping divides the condition number of a factor dominated by its damping
/// by about ten, which is what a stalled or diverging iteration needs.
pub const NEWTON_RETRY_DAMPING: f32 = 10.0;

/// Hyperparameters of [`super::KronOptimizer`]. Build from [`KronConfig::ring`],
/// [`KronConfig::reng`] or [`KronConfig::ngd`] and override fields; [`KronConfig::validate`]
/// names the first bad field.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KronConfig {
    /// Damping rule.
    pub variant: KronVariant,
    /// Learning rate `α > 0`. Defaults: 1.0 (docs/math.md §6: RING/RENG 0.9–1.0 with the 1/L
    /// scaling, NGD ~1.0).
    pub lr: f32,
    /// Initial damping parameter `ρ`, in `[rho_min, rho_max]`. Defaults: RING/RENG `1e-3`
    /// (paper 4e-4..4e-3), NGD `1e-4` (paper 4e-5..2e-4).
    pub rho: f32,
    /// Lower clamp of the Levenberg–Marquardt rule, `> 0`. Default `1e-6` (paper's lowest ρ).
    pub rho_min: f32,
    /// Upper clamp, `≥ rho_min`. Default `0.1`: above the paper's search range (≤ 1e-2) so the
    /// controller can still damp harder after a run of bad steps.
    pub rho_max: f32,
    /// LM discount `φ ∈ (0, 1]`: `ρ ← φρ` when the quadratic model is good (`r > 3/4`),
    /// `ρ ← ρ/φ` when it is poor (`r < 1/4`); `φ = 1` freezes ρ. Default `0.99`
    /// (paper 0.99–0.9999).
    pub phi: f32,
    /// Levenberg–Marquardt interval `T ≥ 1`: only steps with `step mod T == 0` form the
    /// quadratic model, and the loss after only those is observed
    /// ([`super::KronOptimizer::adapts_damping`]); `ρ` then moves by `φᵀ`, the same rate per
    /// step as adapting every step. Martens & Grosse (2015, §6.5) adapt every `T₁ = 5`
    /// steps (kfac-jax's `damping_adaptation_interval`) because the model costs about as
    /// much as the preconditioning: on a 784-1024-1024-10 MLP at batch 256 its products are
    /// 2.9 GFLOP a step and the loss after a forward pass, against 2.9 GFLOP for `P`.
    /// Default `1` (docs/math.md §2: every step).
    pub damping_interval: usize,
    /// Fisher skip frequency `S ≥ 1`: factors, norms and inverses are recomputed on steps
    /// with `step mod S == 0`. Defaults: RING/RENG 4 (paper, small data), NGD 1 (docs/math.md §4:
    /// K-FAC inverts every step).
    pub skip: usize,
    /// Factor EMA `ε ∈ [0, 1)`: `Λ ← εΛ + (1−ε)Λ_batch` (the first refresh replaces).
    /// Default `0` (paper: replace at each refresh); K-FAC practice is 0.95.
    pub ema: f32,
    /// Divide the learning rate by the number of layers `L` (paper eq. grad_weight_update).
    /// Default `true`.
    pub scale_by_layers: bool,
    /// Inversion method. Default [`InverseMethod::Auto`]: Cholesky on the CPU, cubic Newton
    /// from the warm start (scaled identity on the first refresh) to the `f32` floor
    /// ([`crate::ops::newton::NewtonStop::Floor`]; a floor above `1e-4` is a divergence) on a
    /// GPU (small factors there: [`KronConfig::host_refresh_max`]). Until issue 36 it stopped at a residual `≤ 1e-4`, which left a few `1e-5` of
    /// relative error in the update where the floor leaves ~1e-6, for 0–1 more steps
    /// (docs/math.md §2).
    pub inverse: InverseMethod,
    /// Power iteration for RING's factor norms `‖Λ‖₂`, `‖Γ‖₂` (its damping; Newton's `λ_max`).
    pub power: PowerOptions,
    /// RENG's gradient-regularization coefficient `c ≥ 0` (docs/math.md §6: 0.001–0.1; default 0.01
    /// for RENG, 0 otherwise). Informational for the optimizer: the trainer computes
    /// `g + 2c·H_L g` with it and passes that as the gradient.
    pub grad_reg: f32,
    /// Smallest damping applied to a factor, `≥ 0`, so that a zero factor (a dead layer, a
    /// zero output gradient) still has an inverse. Default `1e-6`.
    pub damping_floor: f32,
    /// Precision in which `f32` statistics ([`crate::optim::KronStats`]) enter the factor
    /// accumulation `(1/m) AᵀA`. Default [`Precision::F32`]: the `f32` SYRK. With
    /// [`Precision::Bf16`] they are rounded to `bf16` on the device (one pass over the
    /// statistics) and accumulated by the tensor-core SYRK (`syrk_ema_tc`, f32
    /// accumulation) — at most `2⁻⁹` relative rounding per entry, so the factors move by at
    /// most `2·2⁻⁹` of `|A|ᵀ|A|/m` (small beside the damping; a small MLP trains the same,
    /// `tests/optim_kron_bf16.rs`). `F32` stays the default until the GPU bench has shown the
    /// same training quality at scale (not measured on a GPU yet).
    /// `bf16` statistics always take the `bf16` path: they carry no more precision to keep.
    pub stats_precision: Precision,
    /// Largest factor dimension `n` refreshed on the host on a kernel device with
    /// [`InverseMethod::Auto`]: the factor is read back once (with RING's last power
    /// iterate), its scalars (RING's `‖F‖₂` by the CPU's power iteration, NGD's trace) and its
    /// inverse (the CPU's Cholesky, as [`Device::Cpu`] inverts) are computed there, and the
    /// inverse (and the iterate) are uploaded. On the device such a factor costs tens of
    /// launches and a read-back per Newton iteration and power batch, each a few µs of
    /// latency for `n² ≤ 16k` values, where the host takes ~`n³` flops (≤ 0.1 ms at
    /// `n = 128`). Larger factors stay on the device; `0` keeps every factor there. An
    /// explicit [`KronConfig::inverse`] is always honoured on the device. Default
    /// [`HOST_REFRESH_MAX`] (designed, not measured on a GPU: the GPU bench's `refresh`
    /// rows time both routes at n = 32, 128 and 512).
    pub host_refresh_max: usize,
}

/// Default [`KronConfig::host_refresh_max`].
pub const HOST_REFRESH_MAX: usize = 128;

impl KronConfig {
    fn base(variant: KronVariant) -> Self {
        Self {
            variant,
            lr: 1.0,
            rho: 1e-3,
            rho_min: 1e-6,
            rho_max: 0.1,
            phi: 0.99,
            damping_interval: 1,
            skip: 4,
            ema: 0.0,
            scale_by_layers: true,
            inverse: InverseMethod::Auto,
            power: PowerOptions::default(),
            grad_reg: 0.0,
            damping_floor: 1e-6,
            stats_precision: Precision::F32,
            host_refresh_max: HOST_REFRESH_MAX,
        }
    }

    /// RING defaults: lr 1.0 with 1/L, ρ 1e-3, φ 0.99, S 4.
    pub fn ring() -> Self {
        Self::base(KronVariant::Ring)
    }

    /// RENG defaults: as RING, plus `grad_reg = 0.01`.
    pub fn reng() -> Self {
        Self {
            grad_reg: 0.01,
            ..Self::base(KronVariant::Reng)
        }
    }

    /// NGD (K-FAC with Tikhonov damping and π) defaults: lr 1.0 with 1/L, ρ 1e-4, φ 0.99,
    /// S 1.
    pub fn ngd() -> Self {
        Self {
            rho: 1e-4,
            skip: 1,
            ..Self::base(KronVariant::Ngd)
        }
    }

    /// `Err(Error::Value)` naming the first field outside its documented range.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "KronConfig::validate";
        let f = |v: f32| v as f64;
        check_value(OP, "lr", f(self.lr), self.lr > 0.0, "lr > 0")?;
        check_value(
            OP,
            "rho_min",
            f(self.rho_min),
            self.rho_min > 0.0,
            "rho_min > 0",
        )?;
        check_value(
            OP,
            "rho_max",
            f(self.rho_max),
            self.rho_max >= self.rho_min,
            "rho_max >= rho_min",
        )?;
        check_value(
            OP,
            "rho",
            f(self.rho),
            self.rho >= self.rho_min && self.rho <= self.rho_max,
            "rho_min <= rho <= rho_max (and rho > 0)",
        )?;
        check_value(
            OP,
            "phi",
            f(self.phi),
            self.phi > 0.0 && self.phi <= 1.0,
            "0 < phi <= 1",
        )?;
        check_value(
            OP,
            "damping_interval",
            self.damping_interval as f64,
            self.damping_interval >= 1,
            "damping_interval (T) >= 1",
        )?;
        check_value(
            OP,
            "skip",
            self.skip as f64,
            self.skip >= 1,
            "skip (S) >= 1",
        )?;
        check_value(
            OP,
            "ema",
            f(self.ema),
            (0.0..1.0).contains(&self.ema),
            "0 <= ema < 1",
        )?;
        check_value(
            OP,
            "grad_reg",
            f(self.grad_reg),
            self.grad_reg >= 0.0,
            "grad_reg >= 0",
        )?;
        check_value(
            OP,
            "damping_floor",
            f(self.damping_floor),
            self.damping_floor >= 0.0,
            "damping_floor >= 0",
        )?;
        self.power.validate(OP)?;
        if let InverseMethod::Newton(opts) = &self.inverse {
            opts.validate(OP)?;
        }
        Ok(())
    }
}
