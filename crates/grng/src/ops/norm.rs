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
        self.spectral_norm_warm(a, opts, None).map(|(info, _)| info)
    }

    /// [`Device::spectral_norm`] from a warm start, with the last iterate: `warm` (`n x 1`)
    /// is a unit vector this function returned for a nearby matrix (a Kronecker factor's
    /// previous refresh), or restored from a checkpoint that was checked unit; the returned
    /// iterate (`n x 1`, unit) is the next call's. The CPU normalizes `warm` again (and
    /// starts cold from one that is zero or not finite); the kernel devices take it as it is
    /// (a device-to-device copy, nothing read back).
    ///
    /// # Errors
    /// As [`Device::spectral_norm`]; [`Error::Shape`](crate::Error::Shape) for a `warm` that
    /// is not `n x 1`.
    pub(crate) fn spectral_norm_warm(
        &self,
        a: &Matrix,
        opts: &PowerOptions,
        warm: Option<&Matrix>,
    ) -> Result<(PowerInfo, Matrix)> {
        const OP: &str = "Device::spectral_norm";
        self.check_on(OP, a)?;
        let n = a.rows();
        check_shape(OP, "a", a.shape(), (n, n))?;
        if let Some(w) = warm {
            self.check_on(OP, w)?;
            check_shape(OP, "warm", w.shape(), (n, 1))?;
        }
        opts.validate(OP)?;
        match self {
            Device::Cpu => {
                let warm = warm.map(super::host).transpose()?;
                let (info, v) =
                    crate::cpu::norm::spectral_norm_warm(super::host_ref(a)?, opts, warm)?;
                Ok((info, self.upload(v.len(), 1, &v)?))
            }
            Device::Emulated | Device::Cuda(_) => {
                crate::cuda::newton::spectral_norm(self, a, opts, warm)
            }
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
                power_run(&mut HostPower::new(view, None), Some(&v0), opts.tol, 400, 1).unwrap();
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

    /// `λ_max` of a symmetric `n x n` matrix in `f64` to ~1e-13: power steps until the
    /// quotient stops moving (the reference of [`warm_start_stops_sooner_at_the_same_norm`]).
    fn reference_norm(a: &[f64], n: usize) -> f64 {
        let mut v = start_vector(n);
        let mut q = 0.0;
        for _ in 0..100_000 {
            let w: Vec<f64> = (0..n)
                .map(|i| (0..n).map(|j| a[i * n + j] * v[j]).sum())
                .collect();
            let next: f64 = v.iter().zip(&w).map(|(x, y)| x * y).sum();
            v = unit(w);
            if (next - q).abs() <= 1e-14 * next {
                return next;
            }
            q = next;
        }
        q
    }

    /// The warm start of RING's refreshes (`Device::spectral_norm_warm`): `A = λ₁uuᵀ +
    /// 0.9λ₁vvᵀ + 0.05λ₁I` (`u ⟂ v` unit vectors on which the fixed start has equal weights,
    /// eigenvalue ratio `r = 0.95/1.05`, so the fixed start needs tens of steps at
    /// `tol = 1e-4`), then `A' = A + 10⁻³λ₁wwᵀ` (a
    /// nearby matrix, `w` random unit). From `A`'s last iterate the iteration on `A'` stops
    /// within 4 steps where the fixed start takes at least 10, and both estimates are within
    /// the stop rule's error of `A'`'s `λ_max` (a lower bound, short by about
    /// `tol·r²/(1 − r²) ≈ 4.5·tol` relative; asserted within `2·tol/(1 − r²) ≈ 11·tol` plus
    /// the f32 rounding of `A'` and of the device's iterate, 1e-6). The returned iterate is
    /// `n x 1` and unit to 1e-5 (f32), on the CPU and the emulated kernels; a warm start of
    /// another length is a shape error.
    fn warm_start_stops_sooner_at_the_same_norm(n: usize, seed: u64) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let opts = PowerOptions::default();
        {
            let mut rand_unit = || unit((0..n).map(|_| rng.random_range(-1.0..1.0)).collect());
            // `u, v = (s ± x)/√2` with `x ⟂ s` unit, `s` the fixed start: orthonormal, and the
            // fixed start weighs them equally, so it needs ~23 steps to stop (`r² ≈ 0.82`).
            let s0 = start_vector(n);
            let x = rand_unit();
            let xs: f64 = x.iter().zip(&s0).map(|(a, b)| a * b).sum();
            let x = unit(x.iter().zip(&s0).map(|(a, b)| a - xs * b).collect());
            let half = std::f64::consts::FRAC_1_SQRT_2;
            let u: Vec<f64> = s0.iter().zip(&x).map(|(a, b)| half * (a + b)).collect();
            let v: Vec<f64> = s0.iter().zip(&x).map(|(a, b)| half * (a - b)).collect();
            let w = rand_unit();
            let l1 = rng.random_range(0.5..20.0);
            let at = |k: usize, extra: f64| {
                let (i, j) = (k / n, k % n);
                let eye = if i == j { 0.05 * l1 } else { 0.0 };
                l1 * u[i] * u[j] + 0.9 * l1 * v[i] * v[j] + eye + extra * l1 * w[i] * w[j]
            };
            let a: Vec<f32> = (0..n * n).map(|k| at(k, 0.0) as f32).collect();
            let a2: Vec<f32> = (0..n * n).map(|k| at(k, 1e-3) as f32).collect();
            let exact = reference_norm(&a2.iter().map(|&x| x as f64).collect::<Vec<_>>(), n);
            let r2 = (0.95f64 / 1.05).powi(2);
            let bound = 2.0 * opts.tol as f64 / (1.0 - r2) + 1e-6;
            for dev in [Device::Cpu, Device::Emulated] {
                let (da, da2) = (
                    dev.upload(n, n, &a).unwrap(),
                    dev.upload(n, n, &a2).unwrap(),
                );
                let (_, top) = dev.spectral_norm_warm(&da, &opts, None).unwrap();
                assert_eq!(top.shape(), (n, 1));
                let norm: f64 = top
                    .to_vec()
                    .unwrap()
                    .iter()
                    .map(|&x| x as f64 * x as f64)
                    .sum();
                assert!(
                    (norm.sqrt() - 1.0).abs() <= 1e-5,
                    "{}: |top| {norm}",
                    dev.name()
                );
                let (cold, _) = dev.spectral_norm_warm(&da2, &opts, None).unwrap();
                let (warm, _) = dev.spectral_norm_warm(&da2, &opts, Some(&top)).unwrap();
                let name = dev.name();
                assert!(
                    warm.converged && warm.iterations <= 4 && cold.iterations >= 10,
                    "{name} n {n}: warm {warm:?}, cold {cold:?}"
                );
                for (what, got) in [("cold", cold), ("warm", warm)] {
                    let rel = (got.value as f64 - exact).abs() / exact;
                    assert!(rel <= bound, "{name} n {n} {what}: {rel:e} > {bound:e}");
                }
                let short = dev.zeros(n + 1, 1).unwrap();
                let e = dev.spectral_norm_warm(&da2, &opts, Some(&short));
                assert!(
                    matches!(e, Err(crate::Error::Shape { .. })),
                    "{name}: {e:?}"
                );
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(crate::testing::proptest_config(12))]

        /// [`warm_start_stops_sooner_at_the_same_norm`] at ragged sizes.
        #[test]
        fn warm_start_stops_sooner(n in 3usize..=70, seed in proptest::prelude::any::<u64>()) {
            warm_start_stops_sooner_at_the_same_norm(n, seed);
        }
    }
}
