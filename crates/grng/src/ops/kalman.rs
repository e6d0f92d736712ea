//! The diagonal R-Kalman step (docs/math.md §3, steps 1 and 3–7): options, state and the
//! device-agnostic entry point [`Device::kalman_step`].

pub use crate::cuda::kalman::JacobianElement;
use crate::device::{Device, Matrix};
use crate::error::{check_shape, check_value, Error, Result};
use crate::ops::host;
pub use crate::params::kalman::{KalmanInfo, KalmanOptions, RForm};

/// The R-Kalman state of `n` parameters observed through `d_o` outputs, resident on one
/// device.
#[derive(Debug)]
pub struct KalmanState {
    /// Posterior mean `μ`, `n x 1`.
    pub mu: Matrix,
    /// Diagonal posterior covariance `σ`, `n x 1`, every entry `> 0`.
    pub sigma: Matrix,
    /// Observation-noise estimate `R`, `d_o x d_o`, symmetric PSD (starts at 0).
    pub r: Matrix,
    /// Buffers the next posterior is written into, swapped in on success, so a failed step
    /// leaves `mu`, `sigma`, `r` untouched without copying them.
    spare: Option<[Matrix; 3]>,
    /// The kernels' scratch (Emulated and Cuda devices), kept across steps: a step allocates
    /// nothing on the device once the first one has run. Boxed: it is five buffers, and the
    /// CPU device never has one.
    scratch: Option<Box<crate::cuda::kalman::KalmanScratch>>,
}

impl KalmanState {
    /// `μ = mu0`, `σ = sigma0` everywhere, `R = 0` (`d_o x d_o`), on `device`.
    ///
    /// # Errors
    /// [`Error::Shape`] for an empty `mu0` or `d_o = 0`, [`Error::NonFinite`] for NaN/Inf in
    /// `mu0`, [`Error::Value`] unless `sigma0` is finite and `> 0`; device errors.
    pub fn new(device: &Device, mu0: &[f32], sigma0: f32, d_o: usize) -> Result<Self> {
        const OP: &str = "KalmanState::new";
        if mu0.is_empty() || d_o == 0 {
            return Err(Error::Shape {
                op: OP,
                arg: "mu0, d_o",
                expected: "n >= 1 parameters and d_o >= 1".into(),
                got: format!("n = {}, d_o = {d_o}", mu0.len()),
            });
        }
        crate::error::check_finite(OP, "mu0", mu0)?;
        check_value(OP, "sigma0", sigma0 as f64, sigma0 > 0.0, "sigma0 > 0")?;
        let n = mu0.len();
        Ok(Self {
            mu: device.upload(n, 1, mu0)?,
            sigma: device.upload(n, 1, &crate::error::try_vec(n, 1, sigma0)?)?,
            r: device.zeros(d_o, d_o)?,
            spare: None,
            scratch: None,
        })
    }

    /// Number of parameters `n`.
    pub fn n(&self) -> usize {
        self.mu.rows()
    }

    /// Observation size `d_o`.
    pub fn d_o(&self) -> usize {
        self.r.rows()
    }
}

impl Device {
    /// One R-Kalman step (docs/math.md §3 steps 1 and 3–7) for the `d_o x n` Jacobian `h` (row-major:
    /// row `j` is `∂ŷ_j/∂μ` at the prior mean, entry `(j, i)` at `j·n + i`; `f32` or `bf16`,
    /// see [`JacobianElement`]) and the innovation `v = y − ŷ` (`d_o x 1`): updates
    /// `state.mu`, `state.sigma` and `state.r` in place. See [`crate::cpu::kalman::kalman_step`]
    /// for the exact arithmetic, the jitter and the floor.
    ///
    /// All operands must live on this device. A failed call leaves `state` bit-for-bit
    /// unchanged. On the Emulated and Cuda devices `d_o ≤ 256`
    /// ([`crate::cuda::kalman::MAX_D_O`]; the fast path is `d_o ≤ 64`), and the host
    /// synchronizes once, to read the step's status.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`] (`state.mu`/`state.sigma` not `n x 1`,
    /// `state.r` not `d_o x d_o`, `innovation` not `d_o x 1`, empty `h`, `d_o` above the
    /// kernels' limit), [`Error::Value`]
    /// (bad options, `σ_i ≤ 0`), [`Error::NonFinite`], [`Error::NotSpd`] (no jitter made `S`
    /// factorable), and device errors.
    pub fn kalman_step<T: JacobianElement>(
        &self,
        state: &mut KalmanState,
        h: &Matrix<T>,
        innovation: &Matrix,
        opts: &KalmanOptions,
    ) -> Result<KalmanInfo> {
        const OP: &str = "Device::kalman_step";
        opts.validate(OP)?;
        for m in [&state.mu, &state.sigma, &state.r, innovation] {
            self.check_on(OP, m)?;
        }
        self.check_on(OP, h)?;
        let (d_o, n) = crate::shape::check_h_shape(OP, h.shape())?;
        check_shape(OP, "state.mu", state.mu.shape(), (n, 1))?;
        check_shape(OP, "state.sigma", state.sigma.shape(), (n, 1))?;
        check_shape(OP, "state.r", state.r.shape(), (d_o, d_o))?;
        check_shape(OP, "innovation", innovation.shape(), (d_o, 1))?;

        // The kernels' scratch first (it also rejects a d_o above their limit), so that no
        // error can come after the spare buffers were taken.
        let mut scratch = match (self, state.scratch.take()) {
            (Device::Cpu, _) => None,
            (_, Some(s)) if s.fits(self, d_o, n) => Some(s),
            _ => Some(Box::new(crate::cuda::kalman::KalmanScratch::new(
                self, d_o, n,
            )?)),
        };
        let mut spare = match state.spare.take() {
            Some(s)
                if s[0].shape() == (n, 1)
                    && s[2].shape() == (d_o, d_o)
                    && self.check_on(OP, &s[0]).is_ok() =>
            {
                s
            }
            _ => [self.zeros(n, 1)?, self.zeros(n, 1)?, self.zeros(d_o, d_o)?],
        };
        let [mu_out, sigma_out, r_out] = &mut spare;
        // A scratch exactly on the kernel devices.
        let result = match scratch.as_mut() {
            None => {
                let io = crate::cpu::kalman::KalmanIo {
                    mu: host(&state.mu)?,
                    sigma: host(&state.sigma)?,
                    r: host(&state.r)?,
                    mu_out: host_out(mu_out)?,
                    sigma_out: host_out(sigma_out)?,
                    r_out: host_out(r_out)?,
                };
                crate::cpu::kalman::kalman_step(io, super::host_ref(h)?, host(innovation)?, opts)
            }
            Some(scratch) => {
                let io = crate::cuda::kalman::KalmanBuffers {
                    mu: &state.mu,
                    sigma: &state.sigma,
                    r: &state.r,
                    mu_out,
                    sigma_out,
                    r_out,
                    scratch,
                };
                crate::cuda::kalman::kalman_step(self, io, h, innovation, opts)
            }
        };
        state.scratch = scratch;
        if result.is_ok() {
            let [mu_out, sigma_out, r_out] = &mut spare;
            std::mem::swap(&mut state.mu, mu_out);
            std::mem::swap(&mut state.sigma, sigma_out);
            std::mem::swap(&mut state.r, r_out);
        }
        state.spare = Some(spare);
        result
    }
}

/// The host elements of an output buffer allocated on a host device.
fn host_out(m: &mut Matrix) -> Result<&mut [f32]> {
    m.host_mut()
        .ok_or_else(|| Error::DeviceUnavailable("matrix is not in host memory".into()))
}
