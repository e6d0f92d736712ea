//! The shape rules every layer shares, below both backends: what `ops` validates once before
//! it calls a backend, and what a backend rechecks where its memory safety rests on a
//! dimension (a kernel indexes every operand by the dimensions it is passed). Depends only on
//! `error` and `mat`.

use crate::error::{check_len, check_shape, check_value, Error, Result};
use crate::mat::Trans;

/// Shape of `op(X)` for a stored `rows x cols` operand.
pub(crate) fn op_shape(t: Trans, shape: (usize, usize)) -> (usize, usize) {
    match t {
        Trans::No => shape,
        Trans::Yes => (shape.1, shape.0),
    }
}

/// The GEMM argument checks of [`crate::Device::gemm`] and both backends: finite `α`, `β`,
/// then [`gemm_dims`]. Returns `(m, n, k)` for `op(A)` `m x k`, `op(B)` `k x n`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_gemm(
    op: &'static str,
    trans_a: Trans,
    a: (usize, usize),
    trans_b: Trans,
    b: (usize, usize),
    alpha: f32,
    beta: f32,
    c: (usize, usize),
) -> Result<(usize, usize, usize)> {
    check_value(op, "alpha", alpha as f64, true, "a finite number")?;
    check_value(op, "beta", beta as f64, true, "a finite number")?;
    gemm_dims(op, trans_a, a, trans_b, b, c)
}

/// The product `α·op(A)·op(B)` of a GEMM `C ← α·op(A)·op(B) + β·C`: the operands with their
/// transposes and `α`, written once and passed whole by the layers below
/// [`crate::Device::gemm`] (the GEMM plan, the engine's and the vendor's launchers: `β` and
/// `C` beside it) and by the optimizers' products (a new matrix: no `β`, no old `C`). `X` is
/// the operands' form: `&Matrix<f32>` or `&Matrix<bf16>`, the split3 planes of
/// `cuda::gemm::Split3`, the planes a launcher hands its kernel.
///
/// BLAS semantics wherever it runs: `α = 0` never reads `A` and `B`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatMul<X> {
    /// Whether `A` is transposed (`op(A) = Aᵀ`).
    pub ta: Trans,
    /// Whether `B` is transposed.
    pub tb: Trans,
    /// `α`.
    pub alpha: f32,
    /// `A`.
    pub a: X,
    /// `B`.
    pub b: X,
}

impl<X> MatMul<X> {
    /// `α·op(A)·op(B)`, its arguments in BLAS order.
    pub fn new(ta: Trans, tb: Trans, alpha: f32, a: X, b: X) -> Self {
        Self {
            ta,
            tb,
            alpha,
            a,
            b,
        }
    }

    /// The same product of other operands: `A` and `B` in another form (say their split
    /// planes), the transposes and `α` kept.
    pub fn with<Y>(&self, a: Y, b: Y) -> MatMul<Y> {
        MatMul::new(self.ta, self.tb, self.alpha, a, b)
    }

    /// [`MatMul::with`] `f(A)` and `f(B)`.
    pub fn map<Y>(self, mut f: impl FnMut(X) -> Y) -> MatMul<Y> {
        MatMul::new(self.ta, self.tb, self.alpha, f(self.a), f(self.b))
    }
}

/// An operand with a stored `rows x cols` shape ([`MatMul::dims`]).
pub(crate) trait Shaped {
    /// `(rows, cols)` as stored (before any transpose).
    fn stored_shape(&self) -> (usize, usize);
}

impl<X: ?Sized> MatMul<&X> {
    /// [`gemm_dims`] of this product into a `c`-shaped `C`: `(m, n, k)`.
    ///
    /// # Errors
    /// [`Error::Shape`] naming `op`.
    pub(crate) fn dims(&self, op: &'static str, c: (usize, usize)) -> Result<(usize, usize, usize)>
    where
        X: Shaped,
    {
        let (a, b) = (self.a.stored_shape(), self.b.stored_shape());
        gemm_dims(op, self.ta, a, self.tb, b, c)
    }

    /// The shape of `op(A)·op(B)`: the rows of `op(A)`, the columns of `op(B)`.
    pub(crate) fn shape(&self) -> (usize, usize)
    where
        X: Shaped,
    {
        let (m, _) = op_shape(self.ta, self.a.stored_shape());
        let (_, n) = op_shape(self.tb, self.b.stored_shape());
        (m, n)
    }

    /// [`check_gemm`] of `C ← this product + β·C` for a `c`-shaped `C`: finite `α`, `β`, then
    /// [`MatMul::dims`].
    ///
    /// # Errors
    /// [`Error::Value`], [`Error::Shape`] naming `op`.
    pub(crate) fn check(
        &self,
        op: &'static str,
        beta: f32,
        c: (usize, usize),
    ) -> Result<(usize, usize, usize)>
    where
        X: Shaped,
    {
        let (a, b) = (self.a.stored_shape(), self.b.stored_shape());
        check_gemm(op, self.ta, a, self.tb, b, self.alpha, beta, c)
    }
}

/// `(m, n, k)` for `op(A)` `m x k`, `op(B)` `k x n`, or [`Error::Shape`] unless the inner
/// dimensions agree and `C` is `m x n`: the part of [`check_gemm`] a GEMM kernel's memory
/// safety rests on (it indexes every operand by these dimensions).
pub(crate) fn gemm_dims(
    op: &'static str,
    trans_a: Trans,
    a: (usize, usize),
    trans_b: Trans,
    b: (usize, usize),
    c: (usize, usize),
) -> Result<(usize, usize, usize)> {
    let (m, k) = op_shape(trans_a, a);
    let (kb, n) = op_shape(trans_b, b);
    if kb != k {
        return Err(Error::Shape {
            op,
            arg: "b",
            expected: format!("op(b) with {k} rows (the columns of op(a))"),
            got: format!("op(b) of {kb}x{n}"),
        });
    }
    check_shape(op, "c", c, (m, n))?;
    Ok((m, n, k))
}

/// The batch-gradient shape checks every backend shares: `e` `m x d_out` with `m ≥ 1`, `a`
/// `m x d_in`, `g` `d_out x d_in`.
pub(crate) fn check_batch_gradient_args(
    op: &'static str,
    e: (usize, usize),
    a: (usize, usize),
    g: (usize, usize),
) -> Result<()> {
    check_batch(op, "e", e)?;
    check_shape(op, "a", a, (e.0, a.1))?;
    check_shape(op, "g", g, (e.1, a.1))
}

/// `Err(Error::Shape)` when the batch `arg` (`m x cols`) has no row.
pub(crate) fn check_batch(
    op: &'static str,
    arg: &'static str,
    (m, cols): (usize, usize),
) -> Result<()> {
    if m == 0 {
        return Err(Error::Shape {
            op,
            arg,
            expected: "at least one row (sample)".into(),
            got: format!("0x{cols}"),
        });
    }
    Ok(())
}

/// The SYRK-EMA argument checks every backend shares: `0 ≤ ε < 1`, `a` `m x n` with
/// `m ≥ 1`, `factor` `n x n`.
pub(crate) fn check_syrk_args(
    op: &'static str,
    a: (usize, usize),
    eps: f32,
    factor: (usize, usize),
) -> Result<()> {
    check_value(
        op,
        "eps",
        eps as f64,
        (0.0..1.0).contains(&eps),
        "0 <= eps < 1",
    )?;
    check_batch(op, "a", a)?;
    check_shape(op, "factor", factor, (a.1, a.1))
}

/// `Err(Error::Shape)` unless `h` is `d_o x n` with `d_o ≥ 1` and `n ≥ 1`; returns `(d_o, n)`.
pub(crate) fn check_h_shape(op: &'static str, (d_o, n): (usize, usize)) -> Result<(usize, usize)> {
    if d_o == 0 || n == 0 {
        return Err(Error::Shape {
            op,
            arg: "h",
            expected: "d_o x n with d_o >= 1 and n >= 1".into(),
            got: format!("{d_o}x{n}"),
        });
    }
    Ok((d_o, n))
}

/// The lengths [`check_kalman_lens`] checks, in its order, of a step's `io` and `innovation`:
/// either backend's buffers (`cpu::kalman::KalmanIo`'s slices, `cuda::kalman::KalmanBuffers`'
/// matrices), whose fields share their names.
macro_rules! kalman_lens {
    ($io:ident, $innovation:expr) => {
        [
            $io.mu.len(),
            $io.sigma.len(),
            $io.r.len(),
            $innovation.len(),
            $io.mu_out.len(),
            $io.sigma_out.len(),
        ]
    };
}
pub(crate) use kalman_lens;

/// The buffer lengths of a Kalman step both backends check against `h`'s `(d_o, n)`, in this
/// order: `mu`, `sigma` of `n`, `r` of `d_o²`, `innovation` of `d_o`, `mu_out`, `sigma_out` of
/// `n` ([`Error::Shape`] naming the first that differs); [`kalman_lens`] lists them.
pub(crate) fn check_kalman_lens(
    op: &'static str,
    (d_o, n): (usize, usize),
    [mu, sigma, r, innovation, mu_out, sigma_out]: [usize; 6],
) -> Result<()> {
    check_len(op, "mu", mu, n)?;
    check_len(op, "sigma", sigma, n)?;
    check_len(op, "r", r, d_o * d_o)?;
    check_len(op, "innovation", innovation, d_o)?;
    check_len(op, "mu_out", mu_out, n)?;
    check_len(op, "sigma_out", sigma_out, n)
}

/// `n` of a square `a` with `n ≥ 1`, else [`Error::Shape`].
pub(crate) fn check_square(op: &'static str, shape: (usize, usize)) -> Result<usize> {
    let n = shape.0;
    check_shape(op, "a", shape, (n, n))?;
    if n == 0 {
        return Err(Error::Shape {
            op,
            arg: "a",
            expected: "n x n with n >= 1".into(),
            got: "0x0".into(),
        });
    }
    Ok(n)
}
