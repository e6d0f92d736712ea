//! Dense GEMM on a device.

use std::any::Any;

use super::{host_mut, host_ref, OVERFLOW};
use crate::cuda::engine::KEEP_MAX_ELEMENTS;
use crate::cuda::gemm::{Epilogue3, Split3, SplitCache};
use crate::device::{Device, Element, Matrix};
use crate::error::Result;
use crate::mat::Trans;
use crate::shape::{check_batch_gradient_args, MatMul, Shaped};
use half::bf16;

/// The op every GEMM entry point reports in its errors.
const OP: &str = "Device::gemm";

impl Device {
    /// `C ← α·op(A)·op(B) + β·C` with `op(A)` `m x k`, `op(B)` `k x n`, `C` `m x n`; `A` and `B`
    /// both `f32` or both `bf16` (widened exactly, f32 accumulation), `C` `f32`.
    ///
    /// `β = 0` never reads `C`; `α = 0` never reads `A`, `B`.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) for an operand on another device, [`Error::Shape`](crate::Error::Shape) for
    /// disagreeing dimensions, [`Error::Value`](crate::Error::Value) for a non-finite `α`/`β`,
    /// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `A`, `B`, or in `C` when `β ≠ 0` (checked on every
    /// device by [`Device::check_finite`]: one status read-back each on a GPU), and for a
    /// result that overflows (`arg` `"result (overflow)"`; computed into scratch, so `c` is
    /// unchanged on error).
    ///
    /// On the kernel devices this is one launch of a GEMM of `kernels/gemm.cu`: for `f32`
    /// operands the tiled fp32 GEMM ([`crate::cuda::gemm::gemm`]), for `bf16` ones the
    /// tensor-core engine ([`crate::cuda::gemm::gemm_tc`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm<T: Element>(
        &self,
        ta: Trans,
        tb: Trans,
        alpha: f32,
        a: &Matrix<T>,
        b: &Matrix<T>,
        beta: f32,
        c: &mut Matrix,
    ) -> Result<()> {
        let p = MatMul::new(ta, tb, alpha, a, b);
        self.check_on(OP, a)?;
        self.check_on(OP, b)?;
        self.check_on(OP, c)?;
        p.check(OP, beta, c.shape())?;
        self.check_finite(OP, "a", a)?;
        self.check_finite(OP, "b", b)?;
        if beta != 0.0 {
            self.check_finite(OP, "c", c)?;
        }
        self.commit_finite(OP, [(OVERFLOW, c, beta != 0.0)], |[c]| {
            self.gemm_kernel(p, beta, c)
        })
    }

    /// `α·op(A)·op(B)` as a new `f32` matrix, for operands the caller has already validated:
    /// one allocation (the result, which `β = 0` never reads, so no scratch copy is needed to
    /// leave anything unchanged on error), the product and its result check.
    ///
    /// On the kernel devices, `f32` operands run the f32-accurate split3 tensor-core product
    /// ([`crate::cuda::gemm::gemm3`], error `≤ (k + 8)·2⁻²⁴·|A||B|`, what the
    /// preconditioning runs), not [`Device::gemm`]'s SIMT kernel: the optimizers' products
    /// (the Kronecker step's, the cached squares) all run on the tensor cores, and the
    /// product's epilogue checks the result as it stores it (no check pass). On the CPU a
    /// Gram `AᵀA` (`ta = Yes`, `tb = No`, `a` and `b` the same matrix) runs the SYRK
    /// ([`crate::cpu::syrk_ema`]'s kernel), and so does `AAᵀ` (`ta = No`, `tb = Yes`): half the
    /// flops, exactly symmetric.
    ///
    /// # Errors
    /// [`crate::Error::NonFinite`] (`"result (overflow)"`) for a non-finite product, device
    /// and allocation errors.
    pub(crate) fn product_valid_inputs<T: Element>(&self, p: MatMul<&Matrix<T>>) -> Result<Matrix> {
        let c = self.product_unchecked(p)?;
        // The kernel devices' `f32` products were checked by their epilogue.
        let epilogue_checked = !matches!(self, Device::Cpu)
            && std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>();
        if !epilogue_checked {
            self.check_all_finite(OP, &[(OVERFLOW, &c)])?;
        }
        Ok(c)
    }

    /// [`Device::product_valid_inputs`] for a result that [`Device::axpy_over`] consumes next:
    /// that op checks every value it writes, and a NaN/Inf in the product makes its result
    /// non-finite, so on the CPU the product's own check pass is left out (the same product,
    /// the same bits). The kernel devices run [`Device::product_of`]'s product, whose epilogue
    /// checks the result as it stores it (no pass to save).
    ///
    /// # Errors
    /// As [`Device::product_of`], less the CPU's result check.
    pub(crate) fn product_consumed(&self, p: MatMul<&Operand<'_>>) -> Result<Matrix> {
        self.product_with(p, Epilogue3::default())
    }

    /// [`Device::product_consumed`] with what the kernel devices' epilogue does besides
    /// ([`Epilogue3`]: `planes` (empty) given the result's split planes where the engine writes
    /// them; `mirror` for a product known to be symmetric). The CPU ignores `epi`.
    fn product_with(&self, p: MatMul<&Operand<'_>>, epi: Epilogue3<'_>) -> Result<Matrix> {
        match (self, p.a, p.b) {
            (Device::Cpu, Operand::Host(a), Operand::Host(b)) => {
                self.product_unchecked(p.with(*a, *b))
            }
            (Device::Emulated | Device::Cuda(_), Operand::Split(a), Operand::Split(b)) => {
                crate::cuda::gemm_plan::product3_checked(self, OP, p.with(a, b), epi)
            }
            _ => Err(self.foreign_operand(OP)),
        }
    }

    /// The error for an [`Operand`] that [`Device::operand`] prepared on another kind of
    /// device.
    pub(crate) fn foreign_operand(&self, op: &'static str) -> crate::Error {
        crate::Error::DeviceMismatch {
            op,
            a: self.name(),
            b: "an operand prepared for another device",
        }
    }

    /// [`Device::product_consumed`] written over `spare` when it has the product's shape (a
    /// matrix the caller gives up, say a buffer of the last step: overwritten with `β = 0`,
    /// never read), else into a new matrix: the same product, the same bits, without a fresh
    /// allocation and its first-touch page faults. On the CPU; the kernel devices allocate
    /// (from their stream-ordered pool).
    ///
    /// # Errors
    /// As [`Device::product_consumed`].
    pub(crate) fn product_consumed_over(
        &self,
        p: MatMul<&Operand<'_>>,
        spare: Option<Matrix>,
    ) -> Result<Matrix> {
        let shape = p.shape();
        match (self, p.a, p.b, spare.filter(|c| c.shape() == shape)) {
            (Device::Cpu, Operand::Host(a), Operand::Host(b), Some(mut c)) => {
                let (a, b) = (host_ref(*a)?, host_ref(*b)?);
                crate::cpu::gemm(
                    MatMul::new(p.ta, p.tb, p.alpha, a, b),
                    0.0,
                    host_mut(&mut c)?,
                )?;
                Ok(c)
            }
            // The kernel devices' products allocate from the stream-ordered pool.
            _ => self.product_consumed(p),
        }
    }

    /// The product of [`Device::product_valid_inputs`] before its result check; the kernel
    /// devices' `f32` products are [`Device::product_of`]'s, checked by their epilogue.
    fn product_unchecked<T: Element>(&self, p: MatMul<&Matrix<T>>) -> Result<Matrix> {
        let MatMul { ta, tb, alpha, .. } = p;
        let (da, db): (&dyn Any, &dyn Any) = (p.a, p.b);
        let f32s = da.downcast_ref::<Matrix>().zip(db.downcast_ref::<Matrix>());
        if let (Device::Emulated | Device::Cuda(_), Some((a, b))) = (self, f32s) {
            // Split once even for a square (`a` is `b`); the epilogue checks the result. A Gram
            // `AᵀA` or `AAᵀ` is symmetric: half the tiles, mirrored, as the CPU's SYRK below.
            let ao = self.operand(a)?;
            return if std::ptr::eq(a, b) && ta != tb {
                self.symmetric_product_of(p.with(&ao, &ao))
            } else if std::ptr::eq(a, b) {
                self.product_of(p.with(&ao, &ao))
            } else {
                self.product_of(p.with(&ao, &self.operand(b)?))
            };
        }
        let (m, n) = p.shape();
        let c = match (self, f32s) {
            // `AᵀA` of one matrix is symmetric: the CPU's SYRK computes the lower triangle and
            // mirrors it, half the flops of the GEMM.
            (Device::Cpu, Some((a, b)))
                if (ta, tb) == (Trans::Yes, Trans::No) && std::ptr::eq(a, b) =>
            {
                let mut c = self.zeros(m, n)?;
                crate::cpu::syrk::gram(host_ref(a)?, alpha, host_mut(&mut c)?)?;
                c
            }
            // So is `AAᵀ`, the Gram matrix of the rows.
            (Device::Cpu, Some((a, b)))
                if (ta, tb) == (Trans::No, Trans::Yes) && std::ptr::eq(a, b) =>
            {
                let mut c = self.zeros(m, n)?;
                crate::cpu::syrk::gram_rows(host_ref(a)?, alpha, host_mut(&mut c)?)?;
                c
            }
            // Any other `f32` product into a result it allocates without zero-filling.
            (Device::Cpu, Some((a, b))) => {
                let c = crate::cpu::gemm::gemm_new(MatMul::new(
                    ta,
                    tb,
                    alpha,
                    host_ref(a)?,
                    host_ref(b)?,
                ))?;
                Matrix::from_host_vec(m, n, c.into_vec())?
            }
            _ => {
                let mut c = self.zeros(m, n)?;
                self.gemm_kernel(p, 0.0, &mut c)?;
                c
            }
        };
        Ok(c)
    }

    /// An `f32` operand of several products on this device ([`Device::product_of`]): on the
    /// kernel devices split into its bf16 planes at the first engine product that reads it,
    /// so each later one reuses them instead of splitting it again (a launch and 10 bytes per
    /// element each), and cuBLAS products split nothing; on the CPU the matrix itself.
    ///
    /// # Errors
    /// [`crate::Error::DeviceMismatch`], allocation and launch errors.
    pub(crate) fn operand<'a>(&self, m: &'a Matrix) -> Result<Operand<'a>> {
        self.check_on(OP, m)?;
        Ok(match self {
            Device::Cpu => Operand::Host(m),
            Device::Emulated | Device::Cuda(_) => Operand::Split(Split3::new(m)),
        })
    }

    /// [`Device::operand`] of a matrix that outlives the call, with its planes kept in `cache`
    /// (on the kernel devices; the CPU reads the matrix): a product in a later call reuses
    /// them. `cache` must be `m`'s: made by operands of `m` as it is now, or empty (the
    /// caller drops it when `m` changes). Only up to [`KEEP_MAX_ELEMENTS`]: a larger matrix
    /// gets a fresh operand, as from [`Device::operand`].
    ///
    /// # Errors
    /// [`crate::Error::DeviceMismatch`].
    pub(crate) fn kept_operand<'a>(
        &self,
        m: &'a Matrix,
        cache: &'a SplitCache,
    ) -> Result<Operand<'a>> {
        match self {
            Device::Emulated | Device::Cuda(_) if m.len() > KEEP_MAX_ELEMENTS => self.operand(m),
            _ => self.split_operand(m, cache),
        }
    }

    /// [`Device::operand`] of `m` whose planes are in `cache` (`m`'s as it is now, or empty:
    /// the caller's invariant, as the planes are read without a check of their values), of
    /// any size: the planes a check wrote ([`Device::check_finite_split`]) or a product's
    /// epilogue ([`Device::product_operand`]).
    ///
    /// # Errors
    /// [`crate::Error::DeviceMismatch`].
    pub(crate) fn split_operand<'a>(
        &self,
        m: &'a Matrix,
        cache: &'a SplitCache,
    ) -> Result<Operand<'a>> {
        self.check_on(OP, m)?;
        Ok(match self {
            Device::Cpu => Operand::Host(m),
            Device::Emulated | Device::Cuda(_) => Operand::Split(Split3::kept(m, cache)),
        })
    }

    /// A [`Product`] as an operand of the next product: with the split planes its epilogue
    /// wrote (a product on the engine), so that this one splits nothing.
    ///
    /// # Errors
    /// [`crate::Error::DeviceMismatch`].
    pub(crate) fn product_operand<'a>(&self, x: &'a Product) -> Result<Operand<'a>> {
        self.split_operand(&x.m, &x.planes)
    }

    /// [`Device::product_valid_inputs`] of operands prepared by [`Device::operand`] (the same
    /// product, the same bits).
    ///
    /// # Errors
    /// As [`Device::product_valid_inputs`]; [`crate::Error::DeviceMismatch`] for operands
    /// prepared on another kind of device.
    pub(crate) fn product_of(&self, p: MatMul<&Operand<'_>>) -> Result<Matrix> {
        self.product_checked(p, Epilogue3::default())
    }

    /// [`Device::product_of`] whose result is read by another product next
    /// ([`Device::product_operand`]): on the kernel devices the engine's epilogue writes the
    /// result's split planes beside it (6 bytes per element), so that product splits nothing
    /// (a launch, 10 bytes per element); after a vendor product, none (it splits then).
    ///
    /// # Errors
    /// As [`Device::product_of`].
    pub(crate) fn product_split_of(&self, p: MatMul<&Operand<'_>>) -> Result<Product> {
        let planes = SplitCache::default();
        let epi = Epilogue3 {
            planes: Some(&planes),
            mirror: false,
        };
        let m = self.product_checked(p, epi)?;
        Ok(Product { m, planes })
    }

    /// [`Device::product_with`] with the CPU's result check (the kernel devices' epilogue
    /// checked it already).
    fn product_checked(&self, p: MatMul<&Operand<'_>>, epi: Epilogue3<'_>) -> Result<Matrix> {
        let c = self.product_with(p, epi)?;
        if matches!(self, Device::Cpu) {
            self.check_all_finite(OP, &[(OVERFLOW, &c)])?;
        }
        Ok(c)
    }

    /// [`Device::product_of`] of a product the caller knows to be symmetric in exact
    /// arithmetic (`n x n`: `E·Γ̃⁻¹·Eᵀ`, `UᵀΓU`, …), exactly symmetric: the CPU computes its
    /// lower triangle and mirrors it ([`crate::cpu::syrk::symmetric_product`]: ~half the
    /// flops); the kernel devices' split3 engine computes the lower-triangle tiles and mirrors
    /// them ([`Epilogue3::mirror`]: `(nt − 1)/(2nt)` of the `nt²` 128-wide tiles fewer), or the
    /// GEMM plan's vendor side mirrors its full product's lower triangle.
    ///
    /// # Errors
    /// As [`Device::product_of`]; [`crate::Error::Shape`] unless `op(A)·op(B)` is square.
    pub(crate) fn symmetric_product_of(&self, p: MatMul<&Operand<'_>>) -> Result<Matrix> {
        let (n, cols) = p.shape();
        crate::error::check_shape(OP, "op(a)·op(b)", (n, cols), (n, n))?;
        let (Device::Cpu, Operand::Host(ah), Operand::Host(bh)) = (self, p.a, p.b) else {
            let mirror = Epilogue3 {
                planes: None,
                mirror: true,
            };
            return self.product_checked(p, mirror);
        };
        let mut c = self.zeros(n, n)?;
        crate::cpu::syrk::symmetric_product(
            (p.ta, host_ref(*ah)?),
            (p.tb, host_ref(*bh)?),
            p.alpha,
            host_mut(&mut c)?,
        )?;
        self.check_all_finite(OP, &[(OVERFLOW, &c)])?;
        Ok(c)
    }

    /// `C ← p + β·C` itself on this device's backend, writing `c` in place.
    fn gemm_kernel<T: Element>(
        &self,
        p: MatMul<&Matrix<T>>,
        beta: f32,
        c: &mut Matrix,
    ) -> Result<()> {
        // grng implements `Element` for f32 and bf16: pick the path of the concrete type.
        let (a, b): (&dyn Any, &dyn Any) = (p.a, p.b);
        let f32s = a.downcast_ref::<Matrix>().zip(b.downcast_ref::<Matrix>());
        let bf16s = a
            .downcast_ref::<Matrix<bf16>>()
            .zip(b.downcast_ref::<Matrix<bf16>>());
        let unsupported = || {
            crate::Error::DeviceUnavailable(format!(
                "{OP}: no kernel for elements of type {}",
                std::any::type_name::<T>()
            ))
        };
        match self {
            Device::Cpu => {
                // The CPU reference: bf16 operands widened (exact) to f32 first.
                let widened;
                let (a, b) = match (f32s, bf16s) {
                    (Some(ab), _) => ab,
                    (_, Some((a, b))) => {
                        widened = (widen(a)?, widen(b)?);
                        (&widened.0, &widened.1)
                    }
                    _ => return Err(unsupported()),
                };
                let (a, b) = (host_ref(a)?, host_ref(b)?);
                crate::cpu::gemm(MatMul::new(p.ta, p.tb, p.alpha, a, b), beta, host_mut(c)?)
            }
            Device::Emulated | Device::Cuda(_) => match (f32s, bf16s) {
                (Some((a, b)), _) => crate::cuda::gemm_plan::gemm(self, p.with(a, b), beta, c),
                (_, Some((a, b))) => crate::cuda::gemm_plan::gemm(self, p.with(a, b), beta, c),
                _ => Err(unsupported()),
            },
        }
    }
}

impl Device {
    /// Batch gradient `G = (1/m) Eᵀ A` for `E` `m x d_out`, `A` `m x d_in`, `G` `d_out x d_in`.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch), [`Error::Shape`](crate::Error::Shape) (also for `m = 0`), [`Error::NonFinite`](crate::Error::NonFinite) for
    /// NaN/Inf in `E` or `A` ([`Device::check_finite`]) or an overflowing result
    /// (`"result (overflow)"`). `g` is unchanged on error.
    ///
    /// On the kernel devices: the GEMM kernel `gemm_tn` with `α = 1/m`.
    pub fn batch_gradient(&self, e: &Matrix, a: &Matrix, g: &mut Matrix) -> Result<()> {
        const OP: &str = "Device::batch_gradient";
        self.check_on(OP, e)?;
        self.check_on(OP, a)?;
        self.check_on(OP, g)?;
        check_batch_gradient_args(OP, e.shape(), a.shape(), g.shape())?;
        self.check_finite(OP, "e", e)?;
        self.check_finite(OP, "a", a)?;
        self.commit_finite(OP, [(OVERFLOW, g, false)], |[g]| match self {
            Device::Cpu => crate::cpu::batch_gradient(host_ref(e)?, host_ref(a)?, host_mut(g)?),
            Device::Emulated | Device::Cuda(_) => crate::cuda::gemm::batch_gradient(self, e, a, g),
        })
    }
}

/// A host `bf16` matrix widened to `f32` (exact): the CPU reference's operands, and the rows the
/// low-rank route keeps (`optim/kron/low_rank.rs`).
pub(crate) fn widen(m: &Matrix<bf16>) -> Result<Matrix> {
    let mut w = Device::Cpu.zeros(m.rows(), m.cols())?;
    for (x, v) in host_mut(&mut w)?
        .data_mut()
        .iter_mut()
        .zip(host_ref(m)?.data())
    {
        *x = v.to_f32();
    }
    Ok(w)
}

/// A product's result with the split planes the engine's epilogue wrote for it
/// ([`Device::product_split_of`]; empty on the CPU and after a vendor product), read by the
/// next product as [`Device::product_operand`]. The planes go with the matrix: taking the
/// matrix out ([`Product::into_matrix`], say for an update that writes over it) drops them.
#[derive(Debug)]
pub(crate) struct Product {
    pub(super) m: Matrix,
    pub(super) planes: SplitCache,
}

impl Product {
    /// `m` without planes.
    pub(crate) fn new(m: Matrix) -> Self {
        Self {
            m,
            planes: SplitCache::default(),
        }
    }

    /// The result.
    pub(crate) fn matrix(&self) -> &Matrix {
        &self.m
    }

    /// The result's planes (empty where none were written), to keep beside it.
    pub(crate) fn planes(&self) -> &SplitCache {
        &self.planes
    }

    /// The result, its planes dropped.
    pub(crate) fn into_matrix(self) -> Matrix {
        self.m
    }
}

/// An `f32` product operand prepared by [`Device::operand`].
pub(crate) enum Operand<'a> {
    /// The CPU's: the matrix itself.
    Host(&'a Matrix),
    /// The kernel devices': the matrix with its split3 planes.
    Split(Split3<'a>),
}

impl Shaped for Operand<'_> {
    fn stored_shape(&self) -> (usize, usize) {
        match self {
            Operand::Host(m) => m.shape(),
            Operand::Split(s) => s.matrix().shape(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::mat::Trans;
    use crate::{Device, MatMul};
    use rand::{Rng, SeedableRng};

    proptest::proptest! {
        #![proptest_config(crate::testing::proptest_config(8))]

        /// [`Device::symmetric_product_of`] of `E·(X·Eᵀ)` (`X` symmetric, ragged shapes, one
        /// 128-wide tile or two or three: off-diagonal tiles), on the CPU (lower triangle,
        /// mirrored) and the emulated kernels (the lower-triangle tiles, mirrored), against the
        /// product in `f64`: within `2·(k + 8)·2⁻²⁴·Σ|e||u|` per element, twice the split3
        /// bound (the CPU's f32 GEMM bound, `k·2⁻²⁴`, is inside it). Both compute the lower
        /// triangle and mirror it, so `(i, j)` above the diagonal is checked against the
        /// reference of `(j, i)`, the element computed: `E·U` with `U` rounded to f32 is
        /// symmetric only to within `2⁻²⁴·(Σ|e_i||u_j| + Σ|e_j||u_i|)`, which the `(i, j)`
        /// bound alone need not cover (CI failed at `k = 3`, the mirrored element's terms much
        /// larger than its own). Both results are exactly symmetric; a product that is not
        /// square is an [`crate::Error::Shape`] on both.
        #[test]
        fn symmetric_product_matches_the_product(
            m in proptest::prop_oneof![2usize..=80, 129usize..=270],
            k in 1usize..=100,
            seed in proptest::prelude::any::<u64>(),
        ) {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let e: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut x = vec![0.0f32; k * k];
            for i in 0..k {
                for j in 0..=i {
                    let v = rng.random_range(-1.0..1.0);
                    (x[i * k + j], x[j * k + i]) = (v, v);
                }
            }
            // U = X·Eᵀ (k x m), rounded to f32: the reference multiplies the same values.
            let u: Vec<f32> = (0..k * m)
                .map(|t| {
                    let (r, c) = (t / m, t % m);
                    (0..k).map(|p| x[r * k + p] as f64 * e[c * k + p] as f64).sum::<f64>() as f32
                })
                .collect();
            for dev in [Device::Cpu, Device::Emulated] {
                let (ed, ud) = (dev.upload(m, k, &e).unwrap(), dev.upload(k, m, &u).unwrap());
                let (eo, uo) = (dev.operand(&ed).unwrap(), dev.operand(&ud).unwrap());
                let c = dev
                    .symmetric_product_of(MatMul::new(Trans::No, Trans::No, 0.5, &eo, &uo))
                    .unwrap()
                    .to_vec()
                    .unwrap();
                for i in 0..m {
                    for j in 0..m {
                        // The element the device computed: the lower triangle's.
                        let (r, s) = (i.max(j), i.min(j));
                        let (mut want, mut abs) = (0.0f64, 0.0f64);
                        for p in 0..k {
                            let t = e[r * k + p] as f64 * u[p * m + s] as f64;
                            (want, abs) = (want + t, abs + t.abs());
                        }
                        let bound = 2.0 * (k + 8) as f64 * (0.5 * abs) / (1u64 << 24) as f64;
                        let got = c[i * m + j] as f64;
                        proptest::prop_assert!(
                            (got - 0.5 * want).abs() <= bound,
                            "{} ({}, {}): {} vs {}", dev.name(), i, j, got, 0.5 * want
                        );
                        proptest::prop_assert_eq!(c[i * m + j].to_bits(), c[j * m + i].to_bits());
                    }
                }
                let wide = dev.zeros(k, m + 1).unwrap();
                let wo = dev.operand(&wide).unwrap();
                let not_square = dev.symmetric_product_of(MatMul::new(Trans::No, Trans::No, 1.0, &eo, &wo));
                proptest::prop_assert!(
                    matches!(not_square, Err(crate::Error::Shape { .. })),
                    "{}", dev.name()
                );
            }
        }
    }
}
