//! R-Kalman and the plain diagonal Kalman filter (ρ = 0) as optimizers (docs/math.md §3, Algorithm 2):
//! the parameters are the filter mean `μ`, the diagonal covariance `σ` and the
//! observation-noise estimate `R` are the optimizer state.
//!
//! Each step consumes the Jacobian `H = ∂ŷ/∂μ` (`d_o x n`, at the current `μ`) and the
//! innovation `y − ŷ` (`d_o x 1`) of one observation and runs [`Device::kalman_step`]. A batch
//! of `m` samples is one observation with the outputs stacked: sample `k`'s rows are
//! `k·d_out .. (k+1)·d_out`, so `d_o = m·d_out` — the layout of
//! `grng_train::mlp::Mlp::output_jacobian`. `R` is `d_o x d_o`, so the batch size is fixed for
//! the life of the optimizer (the paper uses batch 1).

use crate::device::{Device, Matrix};
use crate::dist::{DataParallel, Part};
use crate::error::{check_finite, check_len, check_shape, check_value, Error, Result};
use crate::ops::kalman::{JacobianElement, KalmanInfo, KalmanOptions, KalmanState};

/// Hyperparameters of [`RKalman`]; defaults from docs/math.md §6.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RKalmanConfig {
    /// The filter's step options (β = 0.97, ρ = 1e-4, q = 0, floors and jitter: see
    /// [`KalmanOptions`]).
    pub kalman: KalmanOptions,
    /// Initial diagonal covariance `σ₀ > 0`, the same for every parameter. Default `0.1`
    /// (paper: 0.04–0.2).
    pub sigma0: f32,
}

impl Default for RKalmanConfig {
    fn default() -> Self {
        Self {
            kalman: KalmanOptions::default(),
            sigma0: 0.1,
        }
    }
}

impl RKalmanConfig {
    /// The plain diagonal Kalman (EKF) baseline: the defaults with `ρ = 0`.
    pub fn plain() -> Self {
        let mut c = Self::default();
        c.kalman.rho = 0.0;
        c
    }

    /// `Err(Error::Value)` naming the first field outside its documented range.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "RKalmanConfig::validate";
        self.kalman.validate(OP)?;
        check_value(
            OP,
            "sigma0",
            self.sigma0 as f64,
            self.sigma0 > 0.0,
            "sigma0 > 0",
        )
    }
}

/// Everything [`RKalman`] carries between steps, on the host (for checkpoints).
#[derive(Clone, Debug, PartialEq)]
pub struct RKalmanState {
    /// Completed steps.
    pub steps: u64,
    /// Mean `μ` (the parameters), length `n`.
    pub mu: Vec<f32>,
    /// Diagonal covariance `σ`, length `n`, entries `> 0`.
    pub sigma: Vec<f32>,
    /// Observation-noise estimate `R`, row-major `d_o x d_o`.
    pub r: Vec<f32>,
}

/// The R-Kalman optimizer (and, with `ρ = 0`, the plain diagonal Kalman filter).
#[derive(Debug)]
pub struct RKalman {
    device: Device,
    config: RKalmanConfig,
    state: KalmanState,
    steps: u64,
    /// Data-parallel steps ([`RKalman::set_data_parallel`]).
    dp: Option<DataParallel>,
}

impl RKalman {
    /// A filter with `μ = mu0` (`n ≥ 1` parameters), `σ = σ₀`, `R = 0` (`d_o x d_o`).
    ///
    /// # Errors
    /// [`Error::Value`] for a bad config, [`Error::Shape`] for an empty `mu0` or `d_o = 0`,
    /// [`Error::NonFinite`] for NaN/Inf in `mu0`, device errors.
    pub fn new(device: &Device, mu0: &[f32], d_o: usize, config: RKalmanConfig) -> Result<Self> {
        config.validate()?;
        let state = KalmanState::new(device, mu0, config.sigma0, d_o)?;
        Ok(Self {
            device: device.clone(),
            config,
            state,
            steps: 0,
            dp: None,
        })
    }

    /// Makes the steps data-parallel over a communicator (or single-process again with
    /// `None`). The filter couples every pair of observations of a batch through the
    /// innovation covariance `S = H·diag(σ)·Hᵀ + R` (`d_o x d_o`) and its gain, so a rank's
    /// shard cannot be summed into a smaller statistic: each step gathers the ranks' Jacobian
    /// rows and innovations (rank `p`'s `r_p` rows at its offset; `Σ_p r_p = d_o`, the size
    /// the filter was made for) and every rank runs the single-process step on the whole
    /// observation — the same bits as one process on the concatenated batch. Cost:
    /// `d_o·(n + 1)` values per step (`docs/distributed.md`). [`DataParallel::rows`] is not
    /// read: the row counts are the Jacobians'.
    pub fn set_data_parallel(&mut self, dp: Option<DataParallel>) {
        self.dp = dp;
    }

    /// The whole observation of a data-parallel step: every rank's Jacobian rows and
    /// innovations at their offsets (`Σ_p r_p` must be `d_o`), gathered by a sum all-reduce
    /// of zero-padded copies, after the ranks' agreement.
    fn gathered<T: JacobianElement>(
        &self,
        dp: &DataParallel,
        h: &Matrix<T>,
        innovation: &Matrix,
    ) -> Result<(Matrix<T>, Matrix)> {
        const OP: &str = "RKalman::step";
        let (p, rank) = (dp.comm().size(), dp.comm().rank());
        let (n, d_o) = (self.n(), self.d_o());
        let rows = h.rows();
        let pre = check_shape(OP, "h", h.shape(), (rows, n))
            .and_then(|()| check_shape(OP, "innovation", innovation.shape(), (rows, 1)));
        let counts = pre.map(|()| {
            let mut slots = vec![0.0f32; p];
            slots[rank] = rows as f32;
            vec![Part::Sum(slots)]
        });
        let counts = dp.reduce(OP, counts)?;
        let counts: Vec<usize> = counts[0].values.iter().map(|&r| r as usize).collect();
        // The same sums on every rank: every rank fails alike, before the payload.
        check_len(OP, "Σ ranks' rows (h)", counts.iter().sum(), d_o)?;
        let at: usize = counts[..rank].iter().sum();
        let mut full = crate::error::try_vec(d_o * (n + 1), 1, 0.0f32)?;
        for (d, v) in full[at * n..(at + rows) * n].iter_mut().zip(h.to_vec()?) {
            *d = v.to_f32();
        }
        full[d_o * n + at..d_o * n + at + rows].copy_from_slice(&innovation.to_vec()?);
        let mut gathered = dp.reduce(OP, Ok(vec![Part::Sum(full)]))?;
        let full = std::mem::take(&mut gathered[0].values);
        // Zeros added to a value leave it exact, so a bf16 row converts back unchanged.
        let h: Vec<T> = full[..d_o * n].iter().map(|&v| T::from_f32(v)).collect();
        Ok((
            self.device.upload(d_o, n, &h)?,
            self.device.upload(d_o, 1, &full[d_o * n..])?,
        ))
    }

    /// The plain Kalman baseline: [`RKalman::new`] with `config.kalman.rho` set to 0.
    ///
    /// # Errors
    /// As [`RKalman::new`].
    pub fn plain(device: &Device, mu0: &[f32], d_o: usize, config: RKalmanConfig) -> Result<Self> {
        let mut config = config;
        config.kalman.rho = 0.0;
        Self::new(device, mu0, d_o, config)
    }

    /// One filter step for the Jacobian `h` (`d_o x n`, row-major, `∂ŷ/∂μ` at the current
    /// `μ`; `f32`, or `bf16` for half the memory traffic, see [`JacobianElement`]) and the
    /// innovation `y − ŷ` (`d_o x 1`). On the Emulated and Cuda devices the step synchronizes
    /// once (its status read) and allocates nothing on the device after the first step.
    ///
    /// # Errors
    /// [`Error::Shape`] for operands that do not match `(d_o, n)`, and everything
    /// [`Device::kalman_step`] reports. On error the state is bit-for-bit unchanged.
    pub fn step<T: JacobianElement>(
        &mut self,
        h: &Matrix<T>,
        innovation: &Matrix,
    ) -> Result<KalmanInfo> {
        const OP: &str = "RKalman::step";
        let gathered = match &self.dp {
            Some(dp) => Some(self.gathered(dp, h, innovation)?),
            None => None,
        };
        let (h, innovation) = match &gathered {
            Some((h, v)) => (h, v),
            None => (h, innovation),
        };
        check_shape(OP, "h", h.shape(), (self.d_o(), self.n()))?;
        check_shape(OP, "innovation", innovation.shape(), (self.d_o(), 1))?;
        // The largest product is the innovation covariance `H·diag(σ)·Hᵀ`: `d_o²·n`.
        let work = self.device.pool_work(self.d_o() * self.d_o() * self.n());
        let (device, state, config) = (&self.device, &mut self.state, &self.config.kalman);
        let info = crate::cpu::on_pool(work, || device.kalman_step(state, h, innovation, config))?;
        self.steps = self.steps.saturating_add(1);
        Ok(info)
    }

    /// The parameters: the mean `μ` (`n x 1`, on the device).
    pub fn params(&self) -> &Matrix {
        &self.state.mu
    }

    /// The diagonal covariance `σ` (`n x 1`, on the device).
    pub fn sigma(&self) -> &Matrix {
        &self.state.sigma
    }

    /// The observation-noise estimate `R` (`d_o x d_o`, on the device).
    pub fn noise(&self) -> &Matrix {
        &self.state.r
    }

    /// Number of parameters `n`.
    pub fn n(&self) -> usize {
        self.state.n()
    }

    /// Observation size `d_o` (batch size times output width).
    pub fn d_o(&self) -> usize {
        self.state.d_o()
    }

    /// Completed steps.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The configuration in use.
    pub fn config(&self) -> &RKalmanConfig {
        &self.config
    }

    /// Replaces the configuration; `σ₀` only matters at construction, `μ`, `σ`, `R` are kept.
    ///
    /// # Errors
    /// [`Error::Value`] for a bad config; the old one stays in use.
    pub fn set_config(&mut self, config: RKalmanConfig) -> Result<()> {
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// A host copy of the state.
    ///
    /// # Errors
    /// Device errors.
    pub fn state(&self) -> Result<RKalmanState> {
        Ok(RKalmanState {
            steps: self.steps,
            mu: self.state.mu.to_vec()?,
            sigma: self.state.sigma.to_vec()?,
            r: self.state.r.to_vec()?,
        })
    }

    /// Restores a state taken by [`RKalman::state`] from a filter with the same `n` and `d_o`.
    ///
    /// # Errors
    /// [`Error::Shape`] for other sizes, [`Error::NonFinite`], [`Error::Value`] for a
    /// `σ_i ≤ 0` or an `r` that is not positive semidefinite (a host Cholesky factorization
    /// of `R + tiny·I`, the crate-private `optim::check_psd`), device errors; on error the filter is
    /// unchanged.
    pub fn restore(&mut self, state: &RKalmanState) -> Result<()> {
        const OP: &str = "RKalman::restore";
        let (n, d_o) = (self.n(), self.d_o());
        check_len(OP, "mu", state.mu.len(), n)?;
        check_len(OP, "sigma", state.sigma.len(), n)?;
        check_len(OP, "r", state.r.len(), d_o * d_o)?;
        check_finite(OP, "mu", &state.mu)?;
        check_finite(OP, "sigma", &state.sigma)?;
        check_finite(OP, "r", &state.r)?;
        if let Some(&s) = state.sigma.iter().find(|&&s| s <= 0.0) {
            return Err(Error::Value {
                op: OP,
                arg: "sigma",
                value: s as f64,
                expected: "every entry > 0",
            });
        }
        // R is an EMA of outer products (PSD); an indefinite R would let the innovation
        // matrix lose definiteness.
        super::check_psd(
            OP,
            "r",
            &state.r,
            d_o,
            0.0,
            "a symmetric positive semidefinite R (Cholesky of R + jitter·I succeeds)",
        )?;
        let mut fresh = KalmanState::new(&self.device, &state.mu, self.config.sigma0, d_o)?;
        fresh.sigma = self.device.upload(n, 1, &state.sigma)?;
        fresh.r = self.device.upload(d_o, d_o, &state.r)?;
        self.state = fresh;
        self.steps = state.steps;
        Ok(())
    }
}
