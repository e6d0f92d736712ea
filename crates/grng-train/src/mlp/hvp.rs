//! Exact Hessian-vector products of the mean loss by Pearlmutter's R-operator, and RENG's
//! gradient-regularized gradient `g + 2c·H_L g` (docs/math.md §2).
//!
//! With `R{·}` the directional derivative along the parameter direction `V` (per layer `V̄_l`,
//! `V_l` without the bias column), batch rows as samples, `Δ_l = ∂ℓ/∂z_l` and `X_l` the hidden
//! part of `A_l`:
//! - forward R-pass: `R{A_0} = 0`; `R{Z_l} = A_l V̄_lᵀ + R{X_l} W_lᵀ`;
//!   `R{X_{l+1}} = φ'(Z_l) ⊙ R{Z_l}`;
//! - output: `R{Δ} = p ⊙ R{z} − p (pᵀR{z})` per row for softmax, `R{z}` for squared error;
//! - backward R-pass: `R{G_l} = (1/m)(R{Δ_l}ᵀ A_l + Δ_lᵀ [R{X_l} 0])`;
//!   `R{Δ_{l−1}} = φ'(Z_{l−1}) ⊙ (R{Δ_l} W_l + Δ_l V_l) + φ''(Z_{l−1}) ⊙ R{Z_{l−1}} ⊙ (Δ_l W_l)`.
//!
//! `R{G}` is `H_L v`. For ReLU, `φ'' = 0` away from the kinks.

use super::model::{act_deriv, act_second_deriv, check_nonneg, mul_act_deriv, row_mut, Forward};
use super::{Loss, Mlp, Targets};
use grng::cpu::gemm;
use grng::error::{check_finite, check_len, Result};
use grng::mat::{Mat, MatMut, MatRef, Trans};
use grng::MatMul;

impl Mlp {
    /// `H_L v`: the exact Hessian of the mean loss over the batch `(x, targets)` times `v`
    /// (flat parameter layout, length `n`).
    ///
    /// # Errors
    /// As [`Mlp::forward`] and [`Mlp::backward`]; [`Error::Shape`](grng::Error::Shape) /
    /// [`Error::NonFinite`](grng::Error::NonFinite) for a bad `v`.
    pub fn hessian_vector_product(
        &self,
        x: MatRef<'_, f32>,
        targets: Targets<'_>,
        v: &[f32],
    ) -> Result<Vec<f32>> {
        const OP: &str = "Mlp::hessian_vector_product";
        check_len(OP, "v", v.len(), self.num_params())?;
        check_finite(OP, "v", v)?;
        self.check_targets(OP, targets, x.rows())?;
        let fwd = self.forward(x)?;
        let (e, _) = self.output_grad(&fwd, targets);
        let deltas = self.backprop(&fwd, e, 1)?;
        self.r_op(&fwd, &deltas, v)
    }

    /// RENG's gradient (docs/math.md §2): `∇(L + c‖∇L‖²) = g + 2c·H_L g` over the batch, with the mean
    /// loss `L`. Returns `(L, g + 2c·H_L g)`.
    ///
    /// # Errors
    /// [`Error::Value`](grng::Error::Value) unless `c` is finite and ≥ 0; otherwise as
    /// [`Mlp::hessian_vector_product`].
    pub fn regularized_gradient(
        &self,
        x: MatRef<'_, f32>,
        targets: Targets<'_>,
        c: f32,
    ) -> Result<(f32, Vec<f32>)> {
        const OP: &str = "Mlp::regularized_gradient";
        check_nonneg(OP, "c", c)?;
        self.check_targets(OP, targets, x.rows())?;
        let fwd = self.forward(x)?;
        self.regularized_gradient_from(&fwd, targets, c)
    }

    /// [`Mlp::regularized_gradient`] from a forward pass already computed on the batch (with
    /// the current parameters): the same numbers, without a second forward pass for a caller
    /// that needs `fwd` for something else too (the trainer's Fisher statistics).
    ///
    /// # Errors
    /// [`Error::Value`](grng::Error::Value) unless `c` is finite and ≥ 0, or for a stale
    /// `fwd`; otherwise as [`Mlp::backward`].
    pub fn regularized_gradient_from(
        &self,
        fwd: &Forward,
        targets: Targets<'_>,
        c: f32,
    ) -> Result<(f32, Vec<f32>)> {
        self.regularized_gradient_reduced(fwd, targets, c, &mut |_| Ok(()))
    }

    /// [`Mlp::regularized_gradient_from`] for data-parallel training: `reduce` turns this
    /// shard's mean into the whole batch's (the ranks' mean by rows), applied to `g` before
    /// the Hessian product and to `H_L g` after, so the result is the whole batch's
    /// `g + 2c·H_L g` (`H_L g` is linear in the batch for a fixed `g`). The loss is the
    /// shard's.
    ///
    /// # Errors
    /// As [`Mlp::regularized_gradient_from`], and `reduce`'s.
    pub fn regularized_gradient_reduced(
        &self,
        fwd: &Forward,
        targets: Targets<'_>,
        c: f32,
        reduce: &mut dyn FnMut(&mut [f32]) -> Result<()>,
    ) -> Result<(f32, Vec<f32>)> {
        const OP: &str = "Mlp::regularized_gradient_from";
        check_nonneg(OP, "c", c)?;
        let b = self.backward(fwd, targets)?;
        let mut g = b.grad;
        reduce(&mut g)?;
        if c > 0.0 {
            let deltas: Vec<Mat> = b.layers.into_iter().map(|s| s.e).collect();
            // An overflow after `g`'s reduction still takes part in `H_L g`'s, as NaN: every
            // rank's result is then non-finite and every rank skips the step alike (a
            // single process skips it too, on the error).
            let mut hg = match self.r_op(fwd, &deltas, &g) {
                Ok(hg) => hg,
                Err(grng::Error::NonFinite { .. }) => vec![f32::NAN; g.len()],
                Err(e) => return Err(e),
            };
            reduce(&mut hg)?;
            for (gi, hi) in g.iter_mut().zip(hg) {
                *gi += 2.0 * c * hi;
            }
        }
        Ok((b.loss, g))
    }

    /// The R-passes (module docs) given the forward cache and the per-layer `Δ_l`.
    fn r_op(&self, fwd: &Forward, deltas: &[Mat], v: &[f32]) -> Result<Vec<f32>> {
        let nl = self.num_layers();
        let m = fwd.batch_size();
        let act = self.config().activation;
        let sizes = &self.config().sizes;
        let v_layer = |l: usize| -> Result<MatRef<'_, f32>> {
            let (r, c) = self.layer_shape(l)?;
            MatRef::new(&v[self.layer_range(l)?], r, c)
        };
        let v_weights = |l: usize| -> Result<MatRef<'_, f32>> {
            MatRef::with_ld(
                &v[self.layer_range(l)?],
                sizes[l + 1],
                sizes[l],
                sizes[l] + 1,
            )
        };

        // Forward R-pass: rz[l] = R{Z_l}; rx[l] = R{X_l} (rx[0] unused: the input is fixed).
        let mut rz: Vec<Mat> = Vec::with_capacity(nl);
        let mut rx: Vec<Mat> = Vec::with_capacity(nl);
        rx.push(Mat::zeros(0, 0));
        for l in 0..nl {
            let mut z = Mat::zeros(m, sizes[l + 1]);
            gemm(
                MatMul::new(Trans::No, Trans::Yes, 1.0, fwd.a[l].as_ref(), v_layer(l)?),
                0.0,
                z.as_mut(),
            )?;
            if l > 0 {
                gemm(
                    MatMul::new(Trans::No, Trans::Yes, 1.0, rx[l].as_ref(), self.weights(l)?),
                    1.0,
                    z.as_mut(),
                )?;
            }
            if l + 1 < nl {
                let mut next = z.clone();
                let h = fwd.a[l + 1].as_ref();
                for k in 0..m {
                    mul_act_deriv(act, row_mut(&mut next, k), h.row(k));
                }
                rx.push(next);
            }
            rz.push(z);
        }

        // R{Δ} at the output.
        let mut rdelta = rz[nl - 1].clone();
        if self.config().loss == Loss::SoftmaxCrossEntropy {
            for k in 0..m {
                let p = fwd.y.as_ref().row(k);
                let row = row_mut(&mut rdelta, k);
                let dot: f32 = p.iter().zip(row.iter()).map(|(a, b)| a * b).sum();
                for (r, &pj) in row.iter_mut().zip(p) {
                    *r = pj * (*r - dot);
                }
            }
        }

        // Backward R-pass.
        let mut hv = grng::error::try_vec(self.num_params(), 1, 0.0f32)?;
        let inv_m = 1.0 / m as f32;
        for l in (0..nl).rev() {
            let (rows, cols) = self.layer_shape(l)?;
            let range = self.layer_range(l)?;
            gemm(
                MatMul::new(
                    Trans::Yes,
                    Trans::No,
                    inv_m,
                    rdelta.as_ref(),
                    fwd.a[l].as_ref(),
                ),
                0.0,
                MatMut::new(&mut hv[range.clone()], rows, cols)?,
            )?;
            if l == 0 {
                break;
            }
            let d_in = sizes[l];
            // The bias column of [R{X_l} 0] is zero: only the first d_in columns get Δ_lᵀ R{X_l}.
            gemm(
                MatMul::new(
                    Trans::Yes,
                    Trans::No,
                    inv_m,
                    deltas[l].as_ref(),
                    rx[l].as_ref(),
                ),
                1.0,
                MatMut::with_ld(&mut hv[range], rows, d_in, cols)?,
            )?;
            let mut dx = Mat::zeros(m, d_in);
            gemm(
                MatMul::new(
                    Trans::No,
                    Trans::No,
                    1.0,
                    deltas[l].as_ref(),
                    self.weights(l)?,
                ),
                0.0,
                dx.as_mut(),
            )?;
            let mut rdx = Mat::zeros(m, d_in);
            gemm(
                MatMul::new(Trans::No, Trans::No, 1.0, rdelta.as_ref(), self.weights(l)?),
                0.0,
                rdx.as_mut(),
            )?;
            gemm(
                MatMul::new(Trans::No, Trans::No, 1.0, deltas[l].as_ref(), v_weights(l)?),
                1.0,
                rdx.as_mut(),
            )?;
            let h = fwd.a[l].as_ref();
            for k in 0..m {
                let (hk, zk, dk) = (h.row(k), rz[l - 1].as_ref().row(k), dx.as_ref().row(k));
                for (j, r) in row_mut(&mut rdx, k).iter_mut().enumerate() {
                    *r = act_deriv(act, hk[j]) * *r + act_second_deriv(act, hk[j]) * zk[j] * dk[j];
                }
            }
            rdelta = rdx;
        }
        Ok(hv)
    }
}
