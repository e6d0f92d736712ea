//! Kronecker preconditioning and damping on a device.

use super::gemm::{Operand, Product};
use super::SplitCache;
use super::{host_mut, host_ref, OVERFLOW};
use crate::device::{Device, Matrix};
use crate::error::{check_shape, Result};
use crate::shape::Shaped;

impl Device {
    /// `P = Γ̃⁻¹ G Λ̃⁻¹` with `Γ̃⁻¹` `d_out x d_out`, `G` `d_out x d_in`, `Λ̃⁻¹` `d_in x d_in`.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
    /// [`Error::Shape`](crate::Error::Shape), [`Error::NonFinite`](crate::Error::NonFinite) for
    /// NaN/Inf in an input ([`Device::check_finite`]: one status read-back each on a GPU) or an
    /// overflowing result (`"result (overflow)"`: computed into scratch, committed only when
    /// finite). `p` is unchanged on error.
    ///
    /// On the kernel devices: two GEMM launches (`gemm_nn`) through a `d_out x d_in`
    /// scratch matrix, `P = Γ̃⁻¹ (G Λ̃⁻¹)`.
    pub fn precondition(
        &self,
        gamma_inv: &Matrix,
        g: &Matrix,
        lambda_inv: &Matrix,
        p: &mut Matrix,
    ) -> Result<()> {
        const OP: &str = "Device::precondition";
        for m in [gamma_inv, g, lambda_inv] {
            self.check_on(OP, m)?;
        }
        self.check_on(OP, p)?;
        let (d_out, d_in) = g.shape();
        check_shape(OP, "gamma_inv", gamma_inv.shape(), (d_out, d_out))?;
        check_shape(OP, "lambda_inv", lambda_inv.shape(), (d_in, d_in))?;
        check_shape(OP, "p", p.shape(), (d_out, d_in))?;
        self.check_finite(OP, "gamma_inv", gamma_inv)?;
        self.check_finite(OP, "g", g)?;
        self.check_finite(OP, "lambda_inv", lambda_inv)?;
        self.precondition_valid_inputs([gamma_inv, g, lambda_inv], p)
    }

    /// [`Device::precondition`] for operands the caller has already validated (on this
    /// device, shapes agreeing, finite), given in product order `[Γ̃⁻¹, G, Λ̃⁻¹]`: the products
    /// and the result check only, without the input read-backs.
    pub(crate) fn precondition_valid_inputs(
        &self,
        [gamma_inv, g, lambda_inv]: [&Matrix; 3],
        p: &mut Matrix,
    ) -> Result<()> {
        let (gi, li) = (self.operand(gamma_inv)?, self.operand(lambda_inv)?);
        self.precondition_of((&gi, &self.operand(g)?, &li), p, None)
    }

    /// [`Device::precondition_valid_inputs`] with the inverses as product operands
    /// ([`Device::operand`], [`Device::kept_operand`]: on the kernel devices their split planes,
    /// kept from an earlier step where the caller keeps them; `G`'s where its check wrote them):
    /// the same products, the same bits.
    /// With `planes` (empty, for `P`): `P`'s split planes where the engine's epilogue writes
    /// them (as [`Device::product_split_of`]).
    ///
    /// # Errors
    /// As [`Device::precondition`]; [`crate::Error::DeviceMismatch`] for operands prepared
    /// for another kind of device.
    pub(crate) fn precondition_of(
        &self,
        (gamma_inv, g, lambda_inv): (&Operand<'_>, &Operand<'_>, &Operand<'_>),
        p: &mut Matrix,
        planes: Option<&SplitCache>,
    ) -> Result<()> {
        const OP: &str = "Device::precondition";
        match (self, gamma_inv, g, lambda_inv) {
            (Device::Cpu, Operand::Host(gi), Operand::Host(g), Operand::Host(li)) => self
                .commit_finite(OP, [(OVERFLOW, p, false)], |[p]| {
                    crate::cpu::precondition(
                        host_ref(gi)?,
                        host_ref(g)?,
                        host_ref(li)?,
                        host_mut(p)?,
                    )
                }),
            // The second product checks `P` in its epilogue as it stores it (no check pass),
            // into a new matrix installed only when clean.
            (
                Device::Emulated | Device::Cuda(_),
                Operand::Split(gi),
                Operand::Split(g),
                Operand::Split(li),
            ) => crate::cuda::gemm_plan::precondition_checked(self, OP, gi, g, li, p, planes),
            _ => Err(self.foreign_operand(OP)),
        }
    }

    /// [`Device::precondition_of`] as a new [`Product`] (`P` with its split planes where the
    /// engine wrote them): `P` read by a product next splits nothing.
    ///
    /// # Errors
    /// As [`Device::precondition_of`].
    pub(crate) fn precondition_split_of(
        &self,
        inputs: (&Operand<'_>, &Operand<'_>, &Operand<'_>),
    ) -> Result<Product> {
        let (o, i) = inputs.1.stored_shape();
        let mut p = Product::new(self.scratch(o, i)?);
        self.precondition_of(inputs, &mut p.m, Some(&p.planes))?;
        Ok(p)
    }

    /// Lazy-Fisher damped-inverse update `X ← X − dλ · X X` (docs/math.md §2) for a square `X`.
    /// Callers recompute the inverse instead when `|dλ|·‖X‖₂ > 0.5`. A GEMM per call:
    /// [`crate::optim::kron::KronOptimizer`] instead keeps the square of the inverse as formed
    /// and takes `X₀ − (λ − λ₀)·X₀²` by [`Device::axpy`] on each lazy step.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
    /// [`Error::Shape`](crate::Error::Shape) unless square, [`Error::Value`](crate::Error::Value)
    /// for a non-finite `dλ`, [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `X`
    /// or an overflowing result (`"result (overflow)"`). `inv` is unchanged on error.
    ///
    /// On the kernel devices, the GEMM plan's product (`cuda::gemm_plan`): one engine launch
    /// (`α = −dλ`, `β = 1`, the update fused into its epilogue) reading the split planes of the
    /// old `X`, or cuBLAS SGEMM reading a copy of it.
    pub fn damped_inverse_update(&self, inv: &mut Matrix, dlambda: f32) -> Result<()> {
        self.square_update(
            ("Device::damped_inverse_update", true),
            ("inv", inv),
            ("dlambda", dlambda),
            crate::cpu::damped_inverse_update,
            crate::cuda::gemm_plan::damped_inverse_update,
        )
    }

    /// `A ← A + λ I` for a square `A`.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
    /// [`Error::Shape`](crate::Error::Shape) unless square, [`Error::Value`](crate::Error::Value)
    /// for a non-finite `λ`, [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `A`
    /// or an overflowing diagonal (`"result (overflow)"`). `a` is unchanged on error.
    pub fn add_diagonal(&self, a: &mut Matrix, lambda: f32) -> Result<()> {
        self.add_diagonal_checked(a, lambda, true)
    }

    /// [`Device::add_diagonal`] of an `a` the caller knows to be finite (a result an op has
    /// checked: a Kronecker factor to be damped), without the pass that checks it again —
    /// on the kernel devices one launch less. The result is still checked.
    ///
    /// # Errors
    /// As [`Device::add_diagonal`], but for NaN/Inf in `a`, which is not looked for.
    pub(crate) fn add_diagonal_to_finite(&self, a: &mut Matrix, lambda: f32) -> Result<()> {
        self.add_diagonal_checked(a, lambda, false)
    }

    /// [`Device::add_diagonal`], checking `a` when `check_input`.
    fn add_diagonal_checked(&self, a: &mut Matrix, lambda: f32, check_input: bool) -> Result<()> {
        self.square_update(
            ("Device::add_diagonal", check_input),
            ("a", a),
            ("lambda", lambda),
            crate::cpu::add_diagonal,
            crate::cuda::gemm::add_diagonal,
        )
    }

    /// The checks and commit of an in-place update of the square matrix `a` by the scalar
    /// `s` ([`Device::damped_inverse_update`], [`Device::add_diagonal`]), in this order: `a`
    /// on this device, square, `s` finite, `a` finite (when `check_input`); then the
    /// backend's update (`cpu` or `kernel`) into scratch, committed only when every result is
    /// finite.
    fn square_update(
        &self,
        (op, check_input): (&'static str, bool),
        (arg, a): (&'static str, &mut Matrix),
        (s_arg, s): (&'static str, f32),
        cpu: fn(crate::mat::MatMut<'_, f32>, f32) -> Result<()>,
        kernel: fn(&Device, &mut Matrix, f32) -> Result<()>,
    ) -> Result<()> {
        self.check_on(op, a)?;
        check_shape(op, arg, a.shape(), (a.rows(), a.rows()))?;
        super::check_finite_scalar(op, s_arg, s)?;
        if check_input {
            self.check_finite(op, arg, a)?;
        }
        self.commit_finite(op, [(OVERFLOW, a, true)], |[a]| match self {
            Device::Cpu => cpu(host_mut(a)?, s),
            Device::Emulated | Device::Cuda(_) => kernel(self, a, s),
        })
    }
}
