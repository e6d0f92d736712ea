//! Element-wise vector operations and the fused optimizer updates on a device.
//!
//! Operands are [`Matrix`] values of one shape; they are treated as flat vectors of
//! `rows * cols` elements in row-major order. Each fused update states its formula; the CPU
//! backend ([`crate::cpu::elementwise`]) and the GPU kernels (`kernels/elementwise.cu`)
//! implement exactly those formulas, in `f32`.
//!
//! Every op also fails with [`Error::NonFinite`] when finite inputs give a non-finite result
//! (`arg` `result (overflow)`, or `<output> (overflow)` for the fused updates, e.g. AdamW's
//! `v` after `g² > f32::MAX`): the outputs are computed into scratch copies and moved into
//! place only when finite (`Device::commit_finite`), so they are unchanged on error. On
//! the kernel devices that check is one more launch and 20-byte read-back per call.

use crate::cuda::elementwise as ew;
use crate::device::{Device, Matrix};
use crate::error::{check_shape, check_value, Error, Result};
use crate::ops::{check_finite_scalar, finite_result, OVERFLOW};
use crate::params::elementwise::check_beta;
pub use crate::params::elementwise::{AdamWCoeffs, SgdCoeffs, SophiaCoeffs};

/// Host elements of a matrix already checked to live on a host device.
fn host(m: &Matrix) -> Result<&[f32]> {
    m.host()
        .ok_or_else(|| Error::DeviceUnavailable("matrix is not in host memory".into()))
}

/// Mutable host elements of a matrix already checked to live on a host device.
fn host_mut(m: &mut Matrix) -> Result<&mut [f32]> {
    m.host_mut()
        .ok_or_else(|| Error::DeviceUnavailable("matrix is not in host memory".into()))
}

impl Device {
    /// Checks that every operand lives on this device and has the shape of the first.
    fn check_same(&self, op: &'static str, args: &[(&'static str, &Matrix)]) -> Result<()> {
        let shape = args[0].1.shape();
        for &(name, m) in args {
            self.check_on(op, m)?;
            check_shape(op, name, m.shape(), shape)?;
        }
        Ok(())
    }

    /// `y ← α x + y` for `x`, `y` of one shape.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`], [`Error::Value`] for a non-finite `α`,
    /// [`Error::NonFinite`] for NaN/Inf in `x` or `y`. `y` is unchanged on error.
    pub fn axpy(&self, alpha: f32, x: &Matrix, y: &mut Matrix) -> Result<()> {
        const OP: &str = "Device::axpy";
        self.check_same(OP, &[("y", &*y), ("x", x)])?;
        check_finite_scalar(OP, "alpha", alpha)?;
        self.commit_finite(OP, [(OVERFLOW, y, true)], |[y]| match self {
            Device::Cpu => crate::cpu::elementwise::axpy(alpha, host(x)?, host_mut(y)?),
            Device::Emulated | Device::Cuda(_) => ew::axpy(self, alpha, x, y),
        })
    }

    /// `x ← α x`.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Value`] for a non-finite `α`, [`Error::NonFinite`]
    /// for NaN/Inf in `x`. `x` is unchanged on error.
    pub fn scale(&self, alpha: f32, x: &mut Matrix) -> Result<()> {
        const OP: &str = "Device::scale";
        self.check_on(OP, x)?;
        check_finite_scalar(OP, "alpha", alpha)?;
        self.commit_finite(OP, [(OVERFLOW, x, true)], |[x]| match self {
            Device::Cpu => crate::cpu::elementwise::scale(alpha, host_mut(x)?),
            Device::Emulated | Device::Cuda(_) => ew::scale(self, alpha, x),
        })
    }

    /// Dot product `Σ xᵢ yᵢ` of two matrices of one shape (Frobenius inner product),
    /// accumulated in `f64` (see [`crate::cpu::elementwise::dot`] for the error bound).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`], [`Error::NonFinite`].
    pub fn dot(&self, x: &Matrix, y: &Matrix) -> Result<f32> {
        const OP: &str = "Device::dot";
        self.check_same(OP, &[("x", x), ("y", y)])?;
        let r = match self {
            Device::Cpu => crate::cpu::elementwise::dot(host(x)?, host(y)?),
            Device::Emulated | Device::Cuda(_) => ew::dot(self, x, y),
        }?;
        finite_result(OP, r)
    }

    /// Euclidean (Frobenius) norm `√(Σ xᵢ²)`, accumulated in `f64`.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::NonFinite`].
    pub fn norm2(&self, x: &Matrix) -> Result<f32> {
        const OP: &str = "Device::norm2";
        self.check_on(OP, x)?;
        let r = match self {
            Device::Cpu => crate::cpu::elementwise::norm2(host(x)?),
            Device::Emulated | Device::Cuda(_) => ew::norm2(self, x),
        }?;
        finite_result(OP, r)
    }

    /// `dst ← src` for two matrices of one shape (non-finite values are copied as they are).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`]. `dst` is unchanged on error.
    pub fn copy(&self, src: &Matrix, dst: &mut Matrix) -> Result<()> {
        const OP: &str = "Device::copy";
        self.check_same(OP, &[("dst", &*dst), ("src", src)])?;
        match self {
            Device::Cpu => crate::cpu::elementwise::copy(host(src)?, host_mut(dst)?),
            Device::Emulated | Device::Cuda(_) => ew::copy(self, src, dst),
        }
    }

    /// Fused SGD step with momentum buffer `b` and decoupled weight decay:
    /// `b ← μ b + g`, `θ ← θ − lr·λ·θ − lr·b` (see [`crate::cpu::elementwise::sgd_update`]).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`] (operands of different shapes),
    /// [`Error::Value`] (coefficients), [`Error::NonFinite`]. Nothing is written on error.
    pub fn sgd_update(
        &self,
        params: &mut Matrix,
        grad: &Matrix,
        momentum_buf: &mut Matrix,
        c: &SgdCoeffs,
    ) -> Result<()> {
        const OP: &str = "Device::sgd_update";
        self.check_same(
            OP,
            &[
                ("params", &*params),
                ("grad", grad),
                ("momentum_buf", &*momentum_buf),
            ],
        )?;
        c.validate(OP)?;
        let outs = [
            ("params (overflow)", params, true),
            ("momentum_buf (overflow)", momentum_buf, true),
        ];
        self.commit_finite(OP, outs, |[p, b]| match self {
            Device::Cpu => {
                crate::cpu::elementwise::sgd_update(host_mut(p)?, host(grad)?, host_mut(b)?, c)
            }
            Device::Emulated | Device::Cuda(_) => ew::sgd_update(self, p, grad, b, c),
        })
    }

    /// Fused AdamW step: `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
    /// `θ ← θ − lr·λ·θ − lr·(m/bc₁)/(√(v/bc₂) + ε)` with `bcₖ = 1 − βₖᵗ`
    /// (see [`crate::cpu::elementwise::adamw_update`]).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`], [`Error::Value`] (coefficients, negative
    /// `v`), [`Error::NonFinite`]. Nothing is written on error.
    pub fn adamw_update(
        &self,
        params: &mut Matrix,
        grad: &Matrix,
        m: &mut Matrix,
        v: &mut Matrix,
        c: &AdamWCoeffs,
    ) -> Result<()> {
        const OP: &str = "Device::adamw_update";
        self.check_same(
            OP,
            &[("params", &*params), ("grad", grad), ("m", &*m), ("v", &*v)],
        )?;
        c.validate(OP)?;
        let outs = [
            ("params (overflow)", params, true),
            ("m (overflow)", m, true),
            ("v (overflow)", v, true),
        ];
        self.commit_finite(OP, outs, |[p, m, v]| match self {
            Device::Cpu => crate::cpu::elementwise::adamw_update(
                host_mut(p)?,
                host(grad)?,
                host_mut(m)?,
                host_mut(v)?,
                c,
            ),
            Device::Emulated | Device::Cuda(_) => ew::adamw_update(self, p, grad, m, v, c),
        })
    }

    /// Fused Sophia step: `m ← β₁m + (1−β₁)g`,
    /// `θ ← θ − lr·λ·θ − lr·clip(m / max(γ·h, ε), −1, 1)` with the Hessian estimate `h`
    /// read only (see [`crate::cpu::elementwise::sophia_update`]).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`], [`Error::Value`] (coefficients, negative
    /// `h`), [`Error::NonFinite`]. Nothing is written on error.
    pub fn sophia_update(
        &self,
        params: &mut Matrix,
        grad: &Matrix,
        m: &mut Matrix,
        h: &Matrix,
        c: &SophiaCoeffs,
    ) -> Result<()> {
        const OP: &str = "Device::sophia_update";
        self.check_same(
            OP,
            &[("params", &*params), ("grad", grad), ("m", &*m), ("h", h)],
        )?;
        c.validate(OP)?;
        let outs = [
            ("params (overflow)", params, true),
            ("m (overflow)", m, true),
        ];
        self.commit_finite(OP, outs, |[p, m]| match self {
            Device::Cpu => crate::cpu::elementwise::sophia_update(
                host_mut(p)?,
                host(grad)?,
                host_mut(m)?,
                host(h)?,
                c,
            ),
            Device::Emulated | Device::Cuda(_) => ew::sophia_update(self, p, grad, m, h, c),
        })
    }

    /// Sophia-G's Gauss–Newton–Bartlett EMA `h ← β₂h + (1−β₂)·B·ĝ⊙ĝ`, `ĝ` the mean gradient
    /// of a batch of `B = batch` samples under model-sampled labels
    /// (see [`crate::cpu::elementwise::sophia_hessian_ema`]).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`], [`Error::Value`] (`β₂ ∉ [0, 1)`,
    /// `batch = 0`, negative `h`), [`Error::NonFinite`]. `h` is unchanged on error.
    pub fn sophia_hessian_ema(
        &self,
        h: &mut Matrix,
        sampled_grad: &Matrix,
        beta2: f32,
        batch: usize,
    ) -> Result<()> {
        const OP: &str = "Device::sophia_hessian_ema";
        self.check_same(OP, &[("h", &*h), ("sampled_grad", sampled_grad)])?;
        check_beta(OP, "beta2", beta2)?;
        check_value(OP, "batch", batch as f64, batch >= 1, "batch >= 1")?;
        self.commit_finite(OP, [(OVERFLOW, h, true)], |[h]| match self {
            Device::Cpu => crate::cpu::elementwise::sophia_hessian_ema(
                host_mut(h)?,
                host(sampled_grad)?,
                beta2,
                batch,
            ),
            Device::Emulated | Device::Cuda(_) => {
                ew::sophia_hessian_ema(self, h, sampled_grad, beta2, batch)
            }
        })
    }
}
