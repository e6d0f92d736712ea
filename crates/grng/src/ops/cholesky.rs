//! Exact SPD inverse on a device: the reference the Newton inversion is checked against, and
//! the optimizers' Cholesky method and fallback.

use super::host_ref;
use crate::cuda::cholesky;
use crate::device::{Device, Matrix};
use crate::error::{check_shape, Result};

impl Device {
    /// Inverse of a symmetric positive definite `n x n` matrix through its Cholesky factor,
    /// resident on this device, exactly symmetric. Only the lower triangle of `a` is read.
    ///
    /// - [`Device::Cpu`]: `f64` Cholesky (faer), rounded once to `f32`.
    /// - [`Device::Cuda`]: cuSOLVER `potrf` + `potri` in `f32` (the state's precision) on the
    ///   device, no host round trip ([`crate::cuda::cholesky`]). When `libcusolver` does not
    ///   load, or `potrf` meets a non-positive pivot in `f32`, the host path below runs
    ///   instead — counted ([`crate::cuda::cholesky::host_fallbacks`]), recorded and said once
    ///   on stderr; a non-SPD matrix then gets exactly the CPU's error.
    /// - [`Device::Emulated`]: the host path, always (no cuSOLVER under the emulator),
    ///   counted the same way: `a` is downloaded, inverted by the CPU backend in `f64` and
    ///   the inverse uploaded.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
    /// [`Error::Shape`](crate::Error::Shape) unless square,
    /// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `a` (anywhere) or an
    /// inverse that overflows `f32` (`"result (overflow)"`),
    /// [`Error::NotSpd`](crate::Error::NotSpd); [`Error::Cuda`](crate::Error::Cuda) for a
    /// cuSOLVER failure. `a` is never written.
    pub fn cholesky_inverse(&self, a: &Matrix) -> Result<Matrix> {
        const OP: &str = "Device::cholesky_inverse";
        self.check_on(OP, a)?;
        check_shape(OP, "a", a.shape(), (a.rows(), a.rows()))?;
        match self {
            // The result's own buffer becomes the matrix (no copy).
            Device::Cpu => {
                let inv = crate::cpu::cholesky_inverse(host_ref(a)?)?;
                Matrix::from_host_vec(a.rows(), a.rows(), inv.into_vec())
            }
            Device::Emulated => {
                cholesky::note_host_fallback("the emulator has no cuSOLVER");
                self.host_cholesky_inverse(a)
            }
            Device::Cuda(_) if !cholesky::available() => {
                cholesky::note_host_fallback("libcusolver could not be loaded");
                self.host_cholesky_inverse(a)
            }
            Device::Cuda(_) => {
                self.check_finite(OP, "a", a)?;
                match cholesky::cholesky_inverse(self, a)? {
                    Some(inv) => {
                        self.check_finite(OP, "result (overflow)", &inv)?;
                        Ok(inv)
                    }
                    None => {
                        cholesky::note_host_fallback(
                            "cuSOLVER's f32 potrf met a non-positive pivot; settled in f64",
                        );
                        self.host_cholesky_inverse(a)
                    }
                }
            }
        }
    }

    /// `(F + λI)⁻¹`, the optimizers' Cholesky method: [`Device::add_diagonal`] on a copy of
    /// `f`, then [`Device::cholesky_inverse`] — the same bits and the same kinds of error
    /// (the CPU's name `cpu::cholesky_inverse` as their op). The CPU forms no copy: `λ` is
    /// added to the diagonal as the factor is widened (one pass over `f` where the copy, its
    /// two finiteness checks and the widening were four).
    pub(crate) fn damped_cholesky_inverse(&self, f: &Matrix, lambda: f32) -> Result<Matrix> {
        const OP: &str = "Device::cholesky_inverse";
        if !matches!(self, Device::Cpu) {
            let mut d = f.try_clone()?;
            self.add_diagonal(&mut d, lambda)?;
            return self.cholesky_inverse(&d);
        }
        self.check_on(OP, f)?;
        let inv = crate::cpu::damped_cholesky_inverse(host_ref(f)?, lambda)?;
        Matrix::from_host_vec(f.rows(), f.rows(), inv.into_vec())
    }

    /// The CPU backend's inverse of a kernel device's `a`: download, `f64` Cholesky, upload.
    fn host_cholesky_inverse(&self, a: &Matrix) -> Result<Matrix> {
        let host = a.to_vec()?;
        let n = a.rows();
        let inv = crate::cpu::cholesky_inverse(crate::mat::MatRef::new(&host, n, n)?)?;
        self.upload(n, n, inv.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use crate::error::{Error, OVERFLOW};
    use crate::Device;
    use rand::{Rng, SeedableRng};

    proptest::proptest! {
        #![proptest_config(crate::testing::proptest_config(12))]

        /// [`Device::damped_cholesky_inverse`] is `add_diagonal` on a copy then
        /// `cholesky_inverse`, bit for bit, on the CPU (no copy: the shift added as the
        /// factor is widened, by 64-row blocks — sizes on and off them) and on the emulated
        /// device (the composition itself), for a PSD `F = XᵀX/m` of any rank; junk above the
        /// diagonal is not read.
        #[test]
        fn damped_inverse_is_add_diagonal_then_inverse(
            n in 1usize..=140,
            m in 1usize..=40,
            lambda in 1e-3f32..10.0,
            seed in proptest::prelude::any::<u64>(),
        ) {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let x: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut f = vec![0.0f32; n * n];
            for i in 0..n {
                for j in 0..=i {
                    let v = (0..m).map(|p| x[p * n + i] * x[p * n + j]).sum::<f32>() / m as f32;
                    (f[i * n + j], f[j * n + i]) = (v, if i == j { v } else { 7.0 });
                }
            }
            for dev in [Device::Cpu, Device::Emulated] {
                let fd = dev.upload(n, n, &f).unwrap();
                let got = dev.damped_cholesky_inverse(&fd, lambda).unwrap().to_vec().unwrap();
                let mut d = fd.try_clone().unwrap();
                dev.add_diagonal(&mut d, lambda).unwrap();
                let want = dev.cholesky_inverse(&d).unwrap().to_vec().unwrap();
                proptest::prop_assert_eq!(got, want, "{}", dev.name());
            }
        }
    }

    /// The damped inverse's errors on every device, as the composition reports them: a
    /// diagonal that overflows once shifted, an inverse beyond `f32`'s range (`1e-39·I`: the
    /// CPU's rounding pass checks what it writes), NaN in `F`, and a shift that leaves the
    /// matrix indefinite (the pivot of `F + λI`, not of `F`).
    #[test]
    fn damped_inverse_errors() {
        for dev in [Device::Cpu, Device::Emulated] {
            let name = dev.name();
            let up = |v: &[f32], n: usize| dev.upload(n, n, v).unwrap();
            let r = dev.damped_cholesky_inverse(&up(&[3e38, 0.0, 0.0, 1.0], 2), 1e38);
            assert!(
                matches!(
                    r,
                    Err(Error::NonFinite {
                        arg: OVERFLOW,
                        index: 0,
                        ..
                    })
                ),
                "{name}: {r:?}"
            );
            let r = dev.damped_cholesky_inverse(&up(&[1e-39], 1), 0.0);
            assert!(
                matches!(r, Err(Error::NonFinite { arg: OVERFLOW, .. })),
                "{name}: {r:?}"
            );
            let r = dev.damped_cholesky_inverse(&up(&[1.0, f32::NAN, f32::NAN, 1.0], 2), 0.5);
            assert!(matches!(r, Err(Error::NonFinite { .. })), "{name}: {r:?}");
            let r = dev.damped_cholesky_inverse(&up(&[-1.0, 0.0, 0.0, 1.0], 2), 0.5);
            assert!(
                matches!(r, Err(Error::NotSpd { index: 0, pivot, .. }) if pivot == -0.5),
                "{name}: {r:?}"
            );
        }
    }
}
