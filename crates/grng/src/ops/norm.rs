//! Spectral norm and trace of PSD factors (docs/math.md §2: RING's damping `√ρ·‖Λ‖₂`, NGD's π).

use crate::device::{Device, Matrix};
use crate::error::{check_shape, Result};
pub use crate::params::norm::{PowerInfo, PowerOptions};

impl Device {
    /// Spectral norm (largest eigenvalue) of a symmetric PSD `n x n` matrix by power iteration
    /// from a fixed start vector, so the result is deterministic; a stop below the largest
    /// diagonal element (a lower bound of `λ_max`) restarts from that element's unit vector
    /// ([`crate::cpu::spectral_norm`]). Running out of iterations is not an error: the
    /// estimate is returned with `converged = false`.
    ///
    /// On [`Device::Emulated`] / [`Device::Cuda`] the matrix-vector products and the
    /// normalization run on the device (`kernels/newton.cu`), queued in batches of up to
    /// [`PowerOptions::max_batch`] steps whose Rayleigh quotients are read back once per batch
    /// for the stop test (the same result as one read per step, a few steps run past the
    /// stop); the iterate is kept in `f32` there (`f64` on the CPU), which moves the estimate
    /// by about `1e-7` relative.
    ///
    /// # Errors
    /// [`Error::Shape`](crate::Error::Shape) unless `a` is square,
    /// [`Error::Value`](crate::Error::Value) for bad options,
    /// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `a`, and device errors.
    pub fn spectral_norm(&self, a: &Matrix, opts: &PowerOptions) -> Result<PowerInfo> {
        const OP: &str = "Device::spectral_norm";
        self.check_on(OP, a)?;
        check_shape(OP, "a", a.shape(), (a.rows(), a.rows()))?;
        opts.validate(OP)?;
        match self {
            Device::Cpu => crate::cpu::spectral_norm(super::host_ref(a)?, opts),
            Device::Emulated | Device::Cuda(_) => crate::cuda::newton::spectral_norm(self, a, opts),
        }
    }

    /// Trace of a square matrix (summed in `f64`).
    ///
    /// # Errors
    /// [`Error::Shape`](crate::Error::Shape) unless `a` is square,
    /// [`Error::NonFinite`](crate::Error::NonFinite) for a NaN/Inf diagonal or a sum that
    /// overflows `f32` (`"result (overflow)"`), device errors.
    pub fn trace(&self, a: &Matrix) -> Result<f32> {
        const OP: &str = "Device::trace";
        self.check_on(OP, a)?;
        check_shape(OP, "a", a.shape(), (a.rows(), a.rows()))?;
        let t = match self {
            Device::Cpu => crate::cpu::trace(super::host_ref(a)?),
            // One-block reduction kernel; the scalar (and any non-finite index) comes back.
            Device::Emulated | Device::Cuda(_) => crate::cuda::gemm::trace(self, a),
        }?;
        // A finite diagonal whose f64 sum does not fit in f32.
        super::finite_result(OP, t)
    }
}

#[cfg(test)]
mod tests {
    use super::PowerOptions;
    use crate::cpu::norm::HostPower;
    use crate::iteration::{power_run, start_vector, unit};
    use crate::mat::MatRef;
    use crate::Device;
    use rand::{Rng, SeedableRng};

    /// The stall a stop on the quotient's change cannot see: `A = λ₁u₁u₁ᵀ + λ₂v₀v₀ᵀ` with `v₀`
    /// the start itself and `u₁ ∝ e_j − v₀ⱼv₀ ⟂ v₀`, so the iteration from `v₀` sits at `λ₂`
    /// (checked, so the test keeps meeting the stall if the start changes). `A_jj = λ₁ −
    /// (λ₁ − λ₂)v₀ⱼ² > λ₂`, so the restart must fire and find `λ₁` on the CPU and on the
    /// emulated kernels. `A` is rounded to f32, which leaves the start a ~1e-7 component on
    /// `u₁`: it grows by `λ₁/λ₂ ≥ 1.4` a step, but moves the quotient by its square, so the
    /// first run still stops on the stall at step 2. Tolerance on `λ₁`: the stop rule leaves
    /// `≈ tol/(1 − (λ₂/λ₁)²) ≤ 2·tol`, the rounding `u·√n ≤ 7e-7` (and the device's f32
    /// iterate ~1e-7): 2e-5 is over 4x their sum.
    #[test]
    fn power_iteration_restarts_from_a_stall() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5ea1);
        for n in [2usize, 3, 5, 33, 64, 130] {
            let v0 = start_vector(n);
            let j = rng.random_range(0..n);
            let mut u1: Vec<f64> = v0.iter().map(|&x| -v0[j] * x).collect();
            u1[j] += 1.0;
            let u1 = unit(u1);
            let (l1, l2) = (rng.random_range(0.5..20.0), rng.random_range(0.05..0.7));
            let l2 = l1 * l2;
            let a: Vec<f32> = (0..n * n)
                .map(|k| (l1 * u1[k / n] * u1[k % n] + l2 * v0[k / n] * v0[k % n]) as f32)
                .collect();
            let opts = PowerOptions {
                tol: 1e-6,
                max_iter: 400,
                ..PowerOptions::default()
            };
            let view = MatRef::new(&a, n, n).unwrap();
            let (stall, _, _) =
                power_run(&mut HostPower::new(view), &v0, opts.tol, 400, 1).unwrap();
            assert!(
                (stall - l2).abs() <= 1e-5 * l1,
                "n {n}: no stall ({stall} vs λ₂ {l2})"
            );
            let cpu = crate::cpu::spectral_norm(view, &opts).unwrap();
            let dev = Device::Emulated;
            let emu = dev
                .spectral_norm(&dev.upload(n, n, &a).unwrap(), &opts)
                .unwrap();
            for (who, got) in [("cpu", cpu), ("emulated", emu)] {
                let rel = (got.value as f64 - l1).abs() / l1;
                assert!(
                    got.converged && rel <= 2e-5,
                    "n {n} {who}: {got:?} vs λ₁ {l1}"
                );
            }
        }
    }
}
