//! The per-output Jacobian `H = ∂ŷ/∂θ` consumed by the Kalman methods (docs/math.md §3 step 2).

use rayon::prelude::*;

use super::model::row_mut;
use super::{Loss, Mlp};
use grng::error::Result;
use grng::mat::{Mat, MatRef};

/// Model outputs and their Jacobian with respect to the flat parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputJacobian {
    /// `m x d_o` outputs `ŷ`: class probabilities (softmax) or raw outputs (squared error).
    pub y: Mat,
    /// `(m·d_o) x n`: row `k·d_o + j` is `∂ŷ_kj/∂θ` in the flat parameter layout.
    pub h: Mat,
}

impl Mlp {
    /// Outputs `ŷ` of a batch `x` (`m x d_0`) and the Jacobian `H = ∂ŷ/∂θ`, samples stacked
    /// (`(m·d_o) x n`, row `k·d_o + j`). For softmax, `ŷ` are the probabilities, so the output
    /// layer contributes the softmax Jacobian `diag(p) − p pᵀ`.
    ///
    /// Each of the `m·d_o` output directions is backpropagated as an output gradient; the row of
    /// `H` for layer `l` is then the outer product `e_l x̄_lᵀ` flattened row-major.
    ///
    /// # Errors
    /// As [`Mlp::forward`].
    pub fn output_jacobian(&self, x: MatRef<'_, f32>) -> Result<OutputJacobian> {
        let fwd = self.forward(x)?;
        let m = fwd.batch_size();
        let d_o = self.output_dim();
        let n = self.num_params();
        let mut e = Mat::zeros(m * d_o, d_o);
        for k in 0..m {
            let p = fwd.y.as_ref().row(k);
            for j in 0..d_o {
                let row = row_mut(&mut e, k * d_o + j);
                match self.config().loss {
                    // ∂p_j/∂z = p_j (onehot(j) − p): row j of the symmetric diag(p) − p pᵀ.
                    Loss::SoftmaxCrossEntropy => {
                        for (r, &pi) in row.iter_mut().zip(p) {
                            *r = -p[j] * pi;
                        }
                        row[j] += p[j];
                    }
                    Loss::SquaredError => row[j] = 1.0,
                }
            }
        }
        let es = self.backprop(&fwd, e, d_o)?;
        let ranges = (0..self.num_layers())
            .map(|l| self.layer_range(l))
            .collect::<Result<Vec<_>>>()?;
        let mut h = Mat::zeros(m * d_o, n);
        let a = &fwd.a;
        h.as_mut_slice()
            .par_chunks_mut(n.max(1))
            .enumerate()
            .for_each(|(i, hrow)| {
                for ((range, e_l), a_l) in ranges.iter().zip(&es).zip(a) {
                    let xbar = a_l.as_ref().row(i / d_o);
                    let block = &mut hrow[range.clone()];
                    for (dst, &ep) in block.chunks_mut(xbar.len()).zip(e_l.as_ref().row(i)) {
                        for (d, &xq) in dst.iter_mut().zip(xbar) {
                            *d = ep * xq;
                        }
                    }
                }
            });
        Ok(OutputJacobian { y: fwd.y, h })
    }
}
