//! Per-factor work on the device: refresh from statistics, inversion with fallbacks, and the
//! lazy first-order inverse update. Every function builds new matrices and leaves the old
//! state untouched, so the caller can commit all layers at once or drop everything on error.
//!
//! # The lazy update, relative to the formation
//! An inverse `X₀ ≈ (F + λ₀I)⁻¹` is *formed* at a refresh (or recomputed on a lazy step). A
//! later lazy step whose damping target is `λ` uses (docs/math.md §2, eq. inverse_update)
//!
//! `X(λ) = X₀ − (λ − λ₀)·S₀`,  `S₀ = X₀·X₀`,
//!
//! with `S₀` formed once per formation, at the first lazy step that needs it, and cached in
//! the factor's state. Cost: one axpy (a pass over `n²` values) per factor and lazy step,
//! where updating the previous step's inverse, `X ← X − dλ·X·X`, is a `2n³`-flop GEMM each
//! time (~8.6 GFLOP a step for RING on a 784-1024-1024-10 MLP). Accuracy: with `Δ = λ − λ₀`
//! the total drift since the formation, `(X₀⁻¹ + ΔI)⁻¹ = X₀ − Δ·X₀² + Δ²·X₀³(I + ΔX₀)⁻¹`, so
//! the error is `Δ²X₀³(I + ΔX₀)⁻¹`, at most `t²/(1 − t)·‖X₀‖₂` with `t = |Δ|·‖X₀‖₂`:
//! `O((Δ‖X₀‖)²)` relative, kept small by the guard `t ≤ FIRST_ORDER_LIMIT` (beyond it the
//! inverse is recomputed and becomes the new formation). Compounding per-step updates has the
//! smaller error `O(Σ dλₖ²)` when the damping drifts in many small moves, at a GEMM per step;
//! docs/math.md §2 takes the update relative to the formation.
//! Positive definiteness is kept: `X₀` and `S₀` share eigenvectors, and each eigenvalue `μ`
//! of `X₀` maps to `μ(1 − Δμ) ≥ μ/2` for `|Δ|μ ≤ 1/2`.
//! A layer whose step takes the factored route with the model applies the same `X(λ)` by
//! products with `X₀` instead, forming neither `S₀` nor `X(λ)` ([`Retarget::ByProducts`],
//! `factored.rs`); so do the rows' route's `m x m` terms (`low_rank.rs`).

use super::config::{InverseMethod, KronConfig, KronVariant, NEWTON_RETRY_DAMPING};
use super::damping::FactorScalars;
use super::factored::{by_identity, InverseView};
use super::low_rank::{deferred, LowRank, Terms};
use super::rows::{factor_update, replaced_factor, Rows};
use super::state::{KronCounters, KronFactorState, KronLayerState, Splits};
use crate::device::{Device, Matrix};
use crate::error::{Error, Result};
use crate::mat::Trans;
use crate::ops::gemm::Product;
use crate::ops::newton::{InitialGuess, Precision};
use crate::ops::{host, host_ref, SplitCache};
use crate::optim::StatsView;
use crate::shape::MatMul;

/// Largest `|λ − λ₀|·‖X₀‖₂` for which a lazy step uses the first-order inverse
/// `X₀ − (λ − λ₀)·X₀²` (docs/math.md §2), `λ₀` the damping `X₀` was formed at; its relative error is
/// about `(|λ − λ₀|·‖X₀‖₂)²` (module docs).
pub(super) const FIRST_ORDER_LIMIT: f32 = 0.5;

/// The device and configuration shared by the per-factor routines.
pub(super) struct Ctx<'a> {
    pub device: &'a Device,
    pub cfg: &'a KronConfig,
}

impl Ctx<'_> {
    /// New undamped factor from the statistics rows `x` (`m x n`): `(1/m) xᵀx`, blended with
    /// `old`'s by the EMA when there is one, and its scalars for the damping rules. `f32` rows
    /// are rounded to `bf16` first when [`KronConfig::stats_precision`] says so. When the
    /// factor is replaced (`ε = 0` or no `old`), also the rows as the SYRK read them, for
    /// [`Ctx::inverse`]'s low-rank path.
    ///
    /// The factor is [`Refreshed::Rows`], left to its rows ([`Ctx::defers_factor`]), where
    /// nothing of this refresh reads it: RING's norm comes from the rows' Gram matrix, and the
    /// low-rank route keeps the rows ([`super::low_rank::LowRank::dense_factor`] forms it,
    /// with the same bits, when something does). [`Ctx::inverse`] forms it should the rows'
    /// route not apply after all.
    pub fn factor<'x>(
        &self,
        x: StatsView<'x>,
        old: Option<&KronFactorState>,
        c: &mut KronCounters,
    ) -> Result<Forming<'x>> {
        let (m, n) = x.shape();
        let eps = match old {
            Some(_) if self.cfg.ema > 0.0 => self.cfg.ema,
            // ε = 0 (or the first refresh, which replaces) never reads the old factor.
            _ => 0.0,
        };
        let rows = self.rows(x)?;
        // RING's `‖F‖₂` from the rows on the CPU when `F = (1/m) xᵀx` exactly (replaced, not
        // blended) and `m < n`: the `m x m` Gram `(1/m) x xᵀ` has the same nonzero eigenvalues,
        // and each power-iteration step then reads `m²` values instead of `n²` (16x fewer at
        // m = 256, n = 1024, where RING's refresh spent most of its time in these
        // matrix-vector passes). Not on the kernel devices, whose steps cost a launch each
        // at these sizes, not their bytes: the `n x n` factor they form anyway, with the last
        // refresh's iterate as the warm start (the rows, a new batch, give the Gram's
        // iteration none), takes a few launches where the Gram takes its product and tens.
        let gram_norm = self.cfg.variant == KronVariant::Ring
            && eps == 0.0
            && m < n
            && matches!(self.device, Device::Cpu);
        let scalars = |norm, trace| FactorScalars {
            dim: n,
            norm,
            trace,
        };
        if gram_norm && self.defers_factor(&rows)? {
            let norm = self.rows_norm(&rows, c)?;
            return Ok(Forming::Fresh((
                Refreshed::Rows(rows),
                scalars(norm, 0.0),
                None,
            )));
        }
        // The factor update checks the rows, so `rows_norm`'s Gram product reads checked rows.
        let f = match old {
            Some(o) if eps > 0.0 => {
                let mut f = o.dense_factor()?.try_clone()?;
                factor_update(self.device, &rows, eps, &mut f)?;
                f
            }
            _ => replaced_factor(self.device, &rows)?,
        };
        // (Never with `gram_norm`, which is the CPU's.)
        if self.on_host(n) {
            return Ok(Forming::Host(f, (eps == 0.0).then_some(rows)));
        }
        let (norm, trace, top) = match self.cfg.variant {
            KronVariant::Ring if gram_norm => (self.rows_norm(&rows, c)?, 0.0, None),
            _ => self.formed_scalars(&f, old.and_then(|o| o.top.as_ref()), c)?,
        };
        let rows = (eps == 0.0).then_some(rows);
        Ok(Forming::Fresh((
            Refreshed::Formed(f, rows, None),
            scalars(norm, trace),
            top,
        )))
    }

    /// The statistics rows `x` as the factor's SYRK reads them: `f32` rows rounded to `bf16`
    /// when [`KronConfig::stats_precision`] says so.
    pub fn rows<'x>(&self, x: StatsView<'x>) -> Result<Rows<'x>> {
        Ok(match x {
            StatsView::F32(x) if self.cfg.stats_precision == Precision::Bf16 => {
                Rows::Rounded(self.device.round_to_bf16(x)?)
            }
            x => Rows::Given(x),
        })
    }

    /// [`Ctx::factor`] from the mean Gram matrix `(1/M) Σ_p x_pᵀx_p` of a data-parallel step's
    /// ranks (`crate::dist`) instead of rows: blended into `old`'s factor by the EMA when
    /// there is one, always formed (the rows' routes need rows at hand).
    pub fn factor_from_gram<'x>(
        &self,
        gram: &Matrix,
        old: Option<&KronFactorState>,
        c: &mut KronCounters,
    ) -> Result<Forming<'x>> {
        let f = self.blended_gram(gram, old)?;
        if self.on_host(f.rows()) {
            return Ok(Forming::Host(f, None));
        }
        let (norm, trace, top) = self.formed_scalars(&f, old.and_then(|o| o.top.as_ref()), c)?;
        let scalars = FactorScalars {
            dim: f.rows(),
            norm,
            trace,
        };
        Ok(Forming::Fresh((
            Refreshed::Formed(f, None, None),
            scalars,
            top,
        )))
    }

    /// The factor of [`Ctx::factor_from_gram`] without its scalars: `gram` blended into
    /// `old`'s factor by the EMA, or `gram` itself. (A spread refresh's ranks form every
    /// factor so, and take the scalars and inverses from the layer's owner.)
    pub fn blended_gram(&self, gram: &Matrix, old: Option<&KronFactorState>) -> Result<Matrix> {
        match old {
            Some(o) if self.cfg.ema > 0.0 => {
                let mut f = o.dense_factor()?.try_clone()?;
                self.device.scale(self.cfg.ema, &mut f)?;
                self.device.axpy(1.0 - self.cfg.ema, gram, &mut f)?;
                Ok(f)
            }
            _ => gram.try_clone(),
        }
    }

    /// Whether a factor of dimension `n` is refreshed on the host
    /// ([`KronConfig::host_refresh_max`]).
    pub fn on_host(&self, n: usize) -> bool {
        !matches!(self.device, Device::Cpu)
            && self.cfg.inverse == InverseMethod::Auto
            && n <= self.cfg.host_refresh_max
    }

    /// What a factor refreshed on the host ([`Forming::Host`]) needs read back: the factor `f`,
    /// and for RING the iterate `old` kept ([`KronFactorState::top`], its power iteration's
    /// warm start).
    pub fn host_reads<'a>(
        &self,
        f: &'a Matrix,
        old: Option<&'a KronFactorState>,
    ) -> Vec<&'a Matrix> {
        let warm = old.and_then(|o| o.top.as_ref());
        match self.cfg.variant {
            KronVariant::Ring => std::iter::once(f).chain(warm).collect(),
            KronVariant::Reng | KronVariant::Ngd => vec![f],
        }
    }

    /// The refreshed factor of `forming`: as it is, or for [`Forming::Host`] from `copies`, the
    /// elements of its [`Ctx::host_reads`] in order: [`Ctx::formed_scalars`] of the host copy
    /// by the CPU backend (RING's iterate found there uploaded), and the copy kept for
    /// [`Ctx::inverse`].
    pub fn refreshed<'x>(
        &self,
        forming: Forming<'x>,
        copies: Vec<Vec<f32>>,
        c: &mut KronCounters,
    ) -> Result<Fresh<'x>> {
        let (f, rows) = match forming {
            Forming::Fresh(fresh) => return Ok(fresh),
            Forming::Host(f, rows) => (f, rows),
        };
        let n = f.rows();
        let mut copies = copies.into_iter();
        let mut host = |cols| -> Result<Option<Matrix>> {
            copies
                .next()
                .map(|v| Matrix::from_host_vec(n, cols, v))
                .transpose()
        };
        let (factor, warm) = (host(n)?, host(1)?);
        let factor = factor.ok_or(Error::Value {
            op: "KronOptimizer::step",
            arg: "host copies",
            value: 0.0,
            expected: "the factor's host copy (Ctx::host_reads)",
        })?;
        let cpu = Ctx {
            device: &Device::Cpu,
            cfg: self.cfg,
        };
        let (norm, trace, top) = cpu.formed_scalars(&factor, warm.as_ref(), c)?;
        let top = top.map(|t| self.upload(&t)).transpose()?;
        let scalars = FactorScalars {
            dim: n,
            norm,
            trace,
        };
        Ok((Refreshed::Formed(f, rows, Some(factor)), scalars, top))
    }

    /// The split planes of the matrices of `items` (a refresh's new inverses and factors, a
    /// recomputed inverse: formed without planes), written into their caches by one pass that
    /// checks them too (`Device::check_finite_split`: up to four per launch), where each
    /// product reading one first would have split it in a launch of its own. The kernel
    /// devices only, matrices whose planes the pass would write ([`SplitCache::wants_planes`]:
    /// no pass over the others).
    pub fn split_formed(&self, items: &[(&'static str, &Matrix, &SplitCache)]) -> Result<()> {
        if matches!(self.device, Device::Cpu) {
            return Ok(());
        }
        let arrays: Vec<_> = items
            .iter()
            .filter(|(_, m, c)| c.wants_planes(m))
            .map(|&(arg, m, c)| (arg, m, Some(c)))
            .collect();
        if arrays.is_empty() {
            return Ok(());
        }
        self.device
            .check_finite_split("KronOptimizer::step", &arrays)
    }

    /// `m`, a CPU-backend matrix, uploaded to this context's device.
    fn upload(&self, m: &Matrix) -> Result<Matrix> {
        self.device.upload(m.rows(), m.cols(), host(m)?)
    }

    /// The damping rules' scalars of a formed factor `f`: `(‖f‖₂, 0)` for RING, `(0, tr f)`
    /// for NGD, zeros for RENG — each only for the variant that reads it: both are host round
    /// trips. RING's power iteration starts from `warm`, the last refresh's iterate when the
    /// factor kept one ([`KronFactorState::top`]), and returns its own, the next refresh's.
    fn formed_scalars(
        &self,
        f: &Matrix,
        warm: Option<&Matrix>,
        c: &mut KronCounters,
    ) -> Result<Scalars> {
        Ok(match self.cfg.variant {
            KronVariant::Ring => {
                let (norm, top) = self.spectral_norm(f, warm, c)?;
                (norm, 0.0, Some(top))
            }
            KronVariant::Reng => (0.0, 0.0, None),
            KronVariant::Ngd => (0.0, self.device.trace(f)?, None),
        })
    }

    /// Whether [`Ctx::factor`] leaves a replaced factor to its rows: on the CPU, inverted by
    /// Cholesky, with rows few enough for the low-rank route
    /// ([`crate::cpu::low_rank_is_cheaper`]) and provably finite in their SYRK
    /// ([`crate::cpu::syrk::syrk_fits`], one pass over the rows: what the SYRK's own input
    /// check would read). Rows that fail it take the formed route, which reports them.
    fn defers_factor(&self, rows: &Rows<'_>) -> Result<bool> {
        let (m, n) = rows.view().shape();
        if !matches!(self.device, Device::Cpu)
            || !matches!(
                self.cfg.inverse.resolve(self.device),
                InverseMethod::Cholesky
            )
            || !crate::cpu::low_rank_is_cheaper(m, n)
        {
            return Ok(false);
        }
        Ok(match rows.view() {
            StatsView::F32(x) => crate::cpu::syrk::syrk_fits(host_ref(x)?),
            StatsView::Bf16(x) => crate::cpu::syrk::syrk_fits(host_ref(x)?),
        })
    }

    /// `‖(1/m) x xᵀ‖₂` of checked rows `x` (`m x n`): `‖(1/m) xᵀx‖₂` through the `m x m` Gram
    /// (see [`Ctx::factor`]).
    fn rows_norm(&self, rows: &Rows<'_>, c: &mut KronCounters) -> Result<f32> {
        let m = rows.view().shape().0;
        let alpha = 1.0 / m as f32;
        let (no, yes) = (Trans::No, Trans::Yes);
        let gram = match rows.view() {
            StatsView::F32(x) => self
                .device
                .product_valid_inputs(MatMul::new(no, yes, alpha, x, x))?,
            StatsView::Bf16(x) => self
                .device
                .product_valid_inputs(MatMul::new(no, yes, alpha, x, x))?,
        };
        // Cold: the batch's rows, and so this Gram's dimension, change at every refresh.
        self.spectral_norm(&gram, None, c).map(|(norm, _)| norm)
    }

    /// `‖M‖₂` of a symmetric PSD matrix from the warm start `warm` (a unit `n x 1` iterate
    /// of an earlier call), counting a power iteration that hit its budget; with the last
    /// iterate.
    pub fn spectral_norm(
        &self,
        m: &Matrix,
        warm: Option<&Matrix>,
        c: &mut KronCounters,
    ) -> Result<(f32, Matrix)> {
        let (info, top) = self.device.spectral_norm_warm(m, &self.cfg.power, warm)?;
        if !info.converged {
            c.power_unconverged += 1;
        }
        Ok((info.value, top))
    }

    /// A fresh inverse of `factor + damping·I` and its norm bound. `norm`: `‖factor‖₂` when
    /// already computed (RING's damping), handed to Newton as its `λ_max` estimate. `factor`
    /// ([`FactorArg`]) carries the statistics rows it was just formed from when it replaced
    /// the old factor ([`Ctx::factor`]), for the low-rank path of [`Ctx::low_rank_inverse`],
    /// or is left to those rows (formed here unless that path takes it).
    ///
    /// `‖X‖₂` is not measured: the factor is PSD (an EMA of Gram matrices), so the damped
    /// factor's smallest eigenvalue is at least its damping `λ` and `‖(F + λI)⁻¹‖₂ ≤ 1/λ`,
    /// with equality when `F` is singular — the usual case, since `F` has rank at most the
    /// number of rows seen. `X` carries the inverse's residual `r`, which moves its norm by
    /// `‖I − AX‖₂ ≤ √n·r` relative (`≤ 1e-2` at the default tolerance and `n ≤ 1e4`). The
    /// lazy-update test `|λ − λ₀|·‖X₀‖₂ ≤ 1/2` thus reads `|λ − λ₀| ≤ λ₀/2` — conservative by the
    /// factor `λ_min(F + λI)/λ` where the bound is loose — and needs no power iteration on
    /// `X`, whose top eigenvalues (`1/(λ + λ_i)` for the near-zero `λ_i` of `F`) cluster, so
    /// its Rayleigh quotient converged slowly (RING's hit the budget at every refresh).
    ///
    /// `(F + λI)⁻¹` by the configured method. Cholesky takes the low-rank path from the rows
    /// when [`Ctx::low_rank_inverse`] applies. Newton that diverges is retried once with
    /// `NEWTON_RETRY_DAMPING·λ`, then replaced by Cholesky at `λ`; each step is counted.
    pub fn inverse(
        &self,
        factor: FactorArg<'_, '_>,
        damping: f32,
        norm: Option<f32>,
        warm: Option<&Matrix>,
        c: &mut KronCounters,
    ) -> Result<InverseUpdate> {
        let method = self.cfg.inverse.resolve(self.device);
        // Cholesky (resolve() never returns Auto) from the rows of a replaced factor.
        if !matches!(method, InverseMethod::Newton(_)) {
            if let Some(low_rank) = self.low_rank_inverse(factor.rows(), damping)? {
                c.low_rank_inversions += 1;
                return Ok(InverseUpdate::new(
                    deferred()?,
                    damping,
                    Some(Box::new(low_rank)),
                    None,
                ));
            }
        }
        let mut formed = None;
        let (factor, host_copy) = match factor {
            FactorArg::Formed(f, _, host) => (f, host),
            FactorArg::Rows(rows) => (&*formed.insert(replaced_factor(self.device, rows)?), None),
        };
        if self.on_host(factor.rows()) {
            // The CPU backend's inverse (`Device::Cpu`'s Cholesky), uploaded.
            let read;
            let host_factor = match host_copy {
                Some(h) => h,
                None => {
                    read = to_host(factor)?;
                    &read
                }
            };
            c.cholesky_inversions += 1;
            let x = Device::Cpu.damped_cholesky_inverse(host_factor, damping)?;
            return Ok(InverseUpdate::new(self.upload(&x)?, damping, None, formed));
        }
        // `factor` is a checked result (formed and checked, or restored and checked).
        let damped = |lambda: f32| -> Result<Matrix> {
            let mut d = factor.try_clone()?;
            self.device.add_diagonal_to_finite(&mut d, lambda)?;
            Ok(d)
        };
        let opts = match method {
            InverseMethod::Newton(o) => o,
            _ => {
                c.cholesky_inversions += 1;
                let x = self.device.damped_cholesky_inverse(factor, damping)?;
                return Ok(InverseUpdate::new(x, damping, None, formed));
            }
        };
        let warm = if opts.init == InitialGuess::Warm {
            warm
        } else {
            None
        };
        for lambda in [damping, NEWTON_RETRY_DAMPING * damping] {
            let mut o = opts;
            // F is PSD, so λ bounds the spectrum of F + λI from below, and ‖F‖₂ + λ is its
            // largest eigenvalue.
            o.lambda_low = o.lambda_low.max(lambda);
            o.lambda_high = norm.map(|f| f + lambda);
            match self.device.newton_inverse(&damped(lambda)?, warm, &o) {
                Ok((x, info)) => {
                    if lambda == damping {
                        c.newton_inversions += 1;
                    } else {
                        c.newton_retries += 1;
                    }
                    c.newton_iterations += info.iterations as u64;
                    return Ok(InverseUpdate::new(x, lambda, None, formed));
                }
                Err(Error::Diverged { .. }) => {
                    if lambda == damping {
                        c.newton_divergences += 1;
                    }
                }
                Err(e) => return Err(e),
            }
        }
        c.cholesky_fallbacks += 1;
        c.cholesky_inversions += 1;
        let x = self.device.damped_cholesky_inverse(factor, damping)?;
        Ok(InverseUpdate::new(x, damping, None, formed))
    }

    /// `(F + λI)⁻¹` from the rows `x` (`m x n`) that `F = xᵀx/m` was just formed from, by
    /// the Woodbury identity ([`crate::cpu::low_rank_damped_inverse`], `f64`, ~`2m²n + mn²`
    /// flops against the Cholesky inverse's ~`n³`) — on [`Device::Cpu`] when
    /// [`crate::cpu::low_rank_is_cheaper`] (`m ≤ n/2`, `n > 64`) and `λ` is normal (`λ = 0`,
    /// possible with a zero damping floor, is left to Cholesky, which reports the singular
    /// factor).
    /// `None` when it does not apply: no rows (an EMA blend or a lazy recompute, where `F`
    /// is no Gram matrix of rows at hand), another device (whose Newton or cuSOLVER path stays
    /// on the device), or too many rows (exact Fisher's `m·C` rows often exceed `n`).
    /// It inverts the exact Gram matrix of the rows rather than the `f32`-rounded `F`; the two
    /// differ by `F`'s rounding (`≲ m·2⁻²⁴` of `|x|ᵀ|x|/m` per entry), which moves the inverse
    /// by that times `κ` relative: the error the Cholesky inverse of `F` has against the rows'
    /// Gram matrix anyway.
    fn low_rank_inverse(&self, rows: Option<&Rows<'_>>, damping: f32) -> Result<Option<LowRank>> {
        let Some(rows) = rows else {
            return Ok(None);
        };
        let (m, n) = rows.view().shape();
        if !matches!(self.device, Device::Cpu)
            || !crate::cpu::low_rank_is_cheaper(m, n)
            || !damping.is_normal()
        {
            return Ok(None);
        }
        LowRank::form(rows, damping).map(Some)
    }

    /// `s`'s inverse at the damping `target` on a lazy step (module docs): the one as formed
    /// when `target` is its damping, the first-order `X₀ − (target − λ₀)·S₀` when
    /// `|target − λ₀|·‖X₀‖₂ ≤ 1/2` (forming `S₀ = X₀·X₀` if `s` has none yet; taken from the
    /// state's cache when the last one was at the same `target`), otherwise a recomputed
    /// inverse (warm started from `X₀`), which becomes the new formation; the counters say
    /// which happened.
    ///
    /// With `low_rank` (every gradient of the call factored) and the factor's rows at hand
    /// (`low_rank.rs`), the same inverses by their `m x m` terms: no `n x n` pass at all.
    /// Else with `by_products` (the layer's step takes the factored route with the model)
    /// and `X₀` meeting [`super::factored::by_identity`], the first-order inverse is left to
    /// that route's products ([`Retarget::ByProducts`]): no `S₀`, no axpy.
    ///
    /// A first-order inverse to form is [`Planned::Due`]: [`first_order_all`] forms every
    /// factor's of a step in one pass.
    pub fn retarget(
        &self,
        s: &KronFactorState,
        target: f32,
        (low_rank, by_products): (bool, bool),
        c: &mut KronCounters,
    ) -> Result<Planned> {
        // The drift since the formation, not since the last step.
        let d = target - s.damping;
        if d == 0.0 {
            return Ok(Planned::Ready(Retarget::Keep));
        }
        let first_order = (d * s.inverse_norm).abs() <= FIRST_ORDER_LIMIT;
        if let (true, Some(lr)) = (low_rank, &s.low_rank) {
            if first_order {
                c.first_order_updates += 1;
                if lr.retargeted.as_ref().is_some_and(|t| t.damping == target) {
                    return Ok(Planned::Ready(Retarget::Cached));
                }
                let terms = lr.terms_at(target)?;
                return Ok(Planned::Ready(Retarget::LowRank(Box::new(terms))));
            }
            c.lazy_recomputes += 1;
            return Ok(Planned::Ready(Retarget::Formed(Box::new(InverseUpdate {
                inverse: deferred()?,
                planes: SplitCache::default(),
                damping: target,
                inverse_norm: 1.0 / target,
                low_rank: Some(Box::new(lr.reformed(target)?)),
                formed: None,
            }))));
        }
        if first_order {
            c.first_order_updates += 1;
            if by_products && by_identity(self.device, self.cfg, s, s.damping, true) {
                return Ok(Planned::Ready(Retarget::ByProducts { damping: target }));
            }
            if s.retargeted.as_ref().is_some_and(|r| r.1 == target) {
                return Ok(Planned::Ready(Retarget::Cached));
            }
            // S₀ is formed once per formation and handed to the caller to cache.
            let square = match &s.square {
                Some(_) => None,
                // X₀'s kept planes, unless X₀ is the low-rank route's (they are `inverse`'s).
                None => {
                    let kept = s.low_rank.is_none().then_some(&s.splits.inverse);
                    Some(self.square(s.dense_inverse()?, kept)?)
                }
            };
            return Ok(Planned::Due {
                damping: target,
                drift: d,
                square,
            });
        }
        c.lazy_recomputes += 1;
        self.inverse(
            FactorArg::Formed(s.dense_factor()?, None, s.host_factor.as_ref()),
            target,
            known_norm(s.norm),
            s.warm_start(),
            c,
        )
        .map(|u| Planned::Ready(Retarget::Formed(Box::new(u))))
    }

    /// `S₀ = X₀ᵀX₀` of a formed inverse: `X₀²` for the symmetric Cholesky and Woodbury
    /// inverses, and equal to it up to rounding for a Newton inverse, symmetric only to
    /// rounding (`X₀` is checked state: the product's result check only). A Gram, so on the
    /// CPU the SYRK (`n³` flops, exactly symmetric) and elsewhere one `2n³`-flop product per
    /// formation; the same device product every time, so the same bits for the same `X₀`.
    /// `kept`: `x`'s split-plane cache ([`Splits::inverse`]), whose planes the kernel devices
    /// read (or write there, where it has none).
    pub fn square(&self, x: &Matrix, kept: Option<&SplitCache>) -> Result<Matrix> {
        let p = MatMul::new(Trans::Yes, Trans::No, 1.0, x, x);
        match (self.device, kept) {
            // The product `product_valid_inputs` runs there (half the tiles, mirrored), from
            // the planes the refresh kept (`Ctx::split_formed`) instead of a split of its own.
            (Device::Emulated | Device::Cuda(_), Some(c)) => {
                let x = self.device.kept_operand(x, c)?;
                self.device.symmetric_product_of(p.with(&x, &x))
            }
            _ => self.device.product_valid_inputs(p),
        }
    }
}

/// A formed factor's damping scalars `(‖F‖₂, tr F)` and RING's power iterate
/// ([`Ctx::formed_scalars`]).
type Scalars = (f32, f32, Option<Matrix>);

/// `m`, on a kernel device, as a CPU-backend matrix: one read-back.
fn to_host(m: &Matrix) -> Result<Matrix> {
    Matrix::from_host_vec(m.rows(), m.cols(), m.to_vec()?)
}

/// `‖F‖₂` as stored in a factor state: RENG and NGD store `0` (never computed).
pub(super) fn known_norm(norm: f32) -> Option<f32> {
    (norm > 0.0).then_some(norm)
}

/// A refreshed factor ([`Ctx::factor`]): the factor, its damping rules' scalars, and RING's
/// power-iteration iterate ([`KronFactorState::top`]).
pub(super) type Fresh<'x> = (Refreshed<'x>, FactorScalars, Option<Matrix>);

/// A factor formed by [`Ctx::factor`] (or [`Ctx::factor_from_gram`]), refreshed or waiting
/// for its host copies.
pub(super) enum Forming<'x> {
    /// Refreshed: its scalars computed on its device.
    Fresh(Fresh<'x>),
    /// Formed on a kernel device, with the rows it replaced the old one from, and refreshed on
    /// the host ([`KronConfig::host_refresh_max`]) by [`Ctx::refreshed`] once
    /// [`Ctx::host_reads`] are read back: a refresh reads every such factor back at once.
    Host(Matrix, Option<Rows<'x>>),
}

/// A factor refreshed by [`Ctx::factor`].
pub(super) enum Refreshed<'x> {
    /// Formed, with the rows it replaced the old factor from (none for an EMA blend), and its
    /// host copy where it is refreshed on the host ([`KronConfig::host_refresh_max`]).
    Formed(Matrix, Option<Rows<'x>>, Option<Matrix>),
    /// Left to the rows that replace the old factor ([`Ctx::defers_factor`]): formed by
    /// [`Ctx::inverse`] unless the low-rank route takes it, and then on demand
    /// ([`super::low_rank::LowRank::dense_factor`]).
    Rows(Rows<'x>),
}

impl<'x> Refreshed<'x> {
    /// The factor as [`Ctx::inverse`] reads it.
    pub fn arg(&self) -> FactorArg<'_, 'x> {
        match self {
            Refreshed::Formed(f, rows, host) => FactorArg::Formed(f, rows.as_ref(), host.as_ref()),
            Refreshed::Rows(rows) => FactorArg::Rows(rows),
        }
    }
}

/// The factor [`Ctx::inverse`] inverts: formed (with the rows that replaced the old one, for
/// the low-rank path, and its host copy where it was refreshed on the host), or left to its
/// rows.
#[derive(Clone, Copy)]
pub(super) enum FactorArg<'a, 'x> {
    Formed(&'a Matrix, Option<&'a Rows<'x>>, Option<&'a Matrix>),
    Rows(&'a Rows<'x>),
}

impl<'a, 'x> FactorArg<'a, 'x> {
    fn rows(self) -> Option<&'a Rows<'x>> {
        match self {
            FactorArg::Formed(_, rows, _) => rows,
            FactorArg::Rows(rows) => Some(rows),
        }
    }
}

/// A factor's inverse on a lazy step as [`Ctx::retarget`] plans it.
pub(super) enum Planned {
    /// Decided.
    Ready(Retarget),
    /// The first-order inverse `X₀ − drift·S₀` at the target `damping`, to be formed by
    /// [`first_order_all`]; `square` is `S₀` when this step formed it (else the state's).
    Due {
        damping: f32,
        drift: f32,
        square: Option<Matrix>,
    },
}

/// Every [`Planned::Due`] of a lazy step's plan `ups` (per layer `[Λ, Γ]`, the states
/// `layers`') formed: `X₀ + (−drift)·S₀` into a new matrix with its split planes, written by
/// the same pass (the products read them), all factors' in one pass
/// ([`Device::axpy_new_split_all`]: on the kernel devices one launch for the step, not one per
/// factor).
pub(super) fn first_order_all(
    device: &Device,
    layers: &[KronLayerState],
    ups: Vec<[Planned; 2]>,
) -> Result<Vec<[Retarget; 2]>> {
    let mut jobs = Vec::new();
    for (layer, up) in layers.iter().zip(&ups) {
        for (s, u) in [&layer.lambda, &layer.gamma].into_iter().zip(up) {
            if let Planned::Due { drift, square, .. } = u {
                let square = square.as_ref().or(s.square.as_ref());
                let square = square.ok_or(Error::Value {
                    op: "KronOptimizer::step",
                    arg: "square",
                    value: f64::from(*drift),
                    expected: "X₀·X₀ formed for a first-order inverse (Ctx::retarget)",
                })?;
                jobs.push((-drift, square, s.dense_inverse()?));
            }
        }
    }
    let count = jobs.len();
    let mut formed = device.axpy_new_split_all(&jobs)?.into_iter();
    drop(jobs);
    let mut ready = |u: Planned| -> Result<Retarget> {
        Ok(match u {
            Planned::Ready(r) => r,
            Planned::Due {
                damping, square, ..
            } => Retarget::FirstOrder {
                // One result per job (`axpy_new_split_all`).
                inverse: Box::new(formed.next().ok_or(Error::Value {
                    op: "KronOptimizer::step",
                    arg: "first-order inverses",
                    value: count as f64,
                    expected: "one formed per first-order inverse due",
                })?),
                damping,
                square,
            },
        })
    };
    ups.into_iter()
        .map(|[ul, ug]| Ok([ready(ul)?, ready(ug)?]))
        .collect()
}

/// A factor's inverse on a lazy step ([`Ctx::retarget`], [`first_order_all`]).
pub(super) enum Retarget {
    /// The inverse as formed serves: the damping target is the one it was formed at.
    Keep,
    /// The state's cached first-order inverse serves: the last one was at this target.
    Cached,
    /// The first-order inverse `X₀ − (λ − λ₀)·S₀` at the target `damping` (the state keeps
    /// `X₀` and `λ₀`, and caches this one on commit); `square` is `S₀` when this step formed
    /// it, for the state to cache too.
    FirstOrder {
        inverse: Box<Product>,
        damping: f32,
        square: Option<Matrix>,
    },
    /// The first-order inverse at the target `damping`, never formed: the factored route
    /// applies `X₀ − (λ − λ₀)·X₀²` by products with `X₀` ([`InverseView::FirstOrder`]).
    ByProducts { damping: f32 },
    /// The first-order inverse by the rows' `m x m` terms (`low_rank.rs`), cached in the
    /// state's low-rank part on commit.
    LowRank(Box<Terms>),
    /// A recomputed inverse: the new formation.
    Formed(Box<InverseUpdate>),
}

/// The inverse a factor state holds as formed: through its rows when `low_rank` allows and
/// it has them, else dense.
pub(super) fn formed_view(s: &KronFactorState, low_rank: bool) -> Result<(InverseView<'_>, f32)> {
    let kept = Some(&s.splits.inverse);
    as_formed(
        (&s.inverse, kept),
        s.damping,
        s.low_rank.as_deref(),
        low_rank,
    )
}

/// A formed inverse (`inverse` at `damping`, with the rows' part `rows` when the low-rank path
/// formed it, `inverse` then deferred) as a step applies it: through the rows when `low_rank`
/// allows, else dense (formed from the rows if it was deferred), with the split planes `kept`
/// for the dense one where it is a state's.
fn as_formed<'a>(
    (inverse, kept): (&'a Matrix, Option<&'a SplitCache>),
    damping: f32,
    rows: Option<&'a LowRank>,
    low_rank: bool,
) -> Result<(InverseView<'a>, f32)> {
    Ok(match (rows, low_rank) {
        (Some(lr), true) => (InverseView::LowRank(lr, lr.formed()), damping),
        (Some(lr), false) => (
            InverseView::Dense {
                x: lr.dense_inverse()?,
                formed: true,
                kept,
            },
            damping,
        ),
        (None, _) => (
            InverseView::Dense {
                x: inverse,
                formed: true,
                kept,
            },
            damping,
        ),
    })
}

impl Retarget {
    /// The inverse and its damping this step uses, `s` being the factor's state and
    /// `low_rank` the flag [`Ctx::retarget`] was given.
    pub fn view<'a>(
        &'a self,
        s: &'a KronFactorState,
        low_rank: bool,
    ) -> Result<(InverseView<'a>, f32)> {
        match self {
            Retarget::Keep => formed_view(s, low_rank),
            // `retarget` says `Cached` only when the state holds that inverse.
            Retarget::Cached => match (&s.low_rank, low_rank) {
                (Some(lr), true) => lr.retargeted.as_ref().map_or(formed_view(s, true), |t| {
                    Ok((InverseView::LowRank(lr, t), t.damping))
                }),
                _ => match &s.retargeted {
                    Some((x, l)) => Ok((
                        InverseView::Dense {
                            x: x.matrix(),
                            formed: false,
                            kept: Some(x.planes()),
                        },
                        *l,
                    )),
                    None => formed_view(s, false),
                },
            },
            Retarget::FirstOrder {
                inverse, damping, ..
            } => Ok((
                InverseView::Dense {
                    x: inverse.matrix(),
                    formed: false,
                    kept: Some(inverse.planes()),
                },
                *damping,
            )),
            Retarget::ByProducts { damping } => Ok((
                InverseView::FirstOrder {
                    x0: s.dense_inverse()?,
                    kept: &s.splits.inverse,
                    lambda0: s.damping,
                    d: damping - s.damping,
                },
                *damping,
            )),
            Retarget::LowRank(t) => match &s.low_rank {
                Some(lr) => Ok((InverseView::LowRank(lr, t), t.damping)),
                // `retarget` says `LowRank` only for a state with rows.
                None => formed_view(s, false),
            },
            // This step's formation, with the planes written since it was formed.
            Retarget::Formed(u) => as_formed(
                (&u.inverse, Some(&u.planes)),
                u.damping,
                u.low_rank.as_deref(),
                low_rank,
            ),
        }
    }

    /// Installs the outcome into `s`: a first-order inverse is cached (and a newly formed
    /// `S₀`), a new formation replaces the inverse (and drops the old caches).
    pub fn apply(self, s: &mut KronFactorState) {
        match self {
            Retarget::Keep | Retarget::Cached | Retarget::ByProducts { .. } => {}
            Retarget::FirstOrder {
                inverse,
                damping,
                square,
            } => {
                s.retargeted = Some((*inverse, damping));
                if square.is_some() {
                    s.square = square;
                }
            }
            Retarget::LowRank(t) => {
                if let Some(lr) = &mut s.low_rank {
                    lr.retargeted = Some(*t);
                }
            }
            Retarget::Formed(u) => (*u).apply(s),
        }
    }
}

/// A newly formed inverse for one factor: replaces `inverse`, `damping` and `inverse_norm` of
/// its [`KronFactorState`] and drops its caches.
pub(super) struct InverseUpdate {
    pub inverse: Matrix,
    /// `inverse`'s split planes where they were written before the update is installed
    /// ([`Ctx::split_formed`]), kept by the state on [`InverseUpdate::apply`].
    pub planes: SplitCache,
    pub damping: f32,
    pub inverse_norm: f32,
    /// The rows' kernel of the low-rank path (`low_rank.rs`), when it formed the inverse.
    pub low_rank: Option<Box<LowRank>>,
    /// A factor left to its rows ([`Refreshed::Rows`]) that the inversion had to form.
    pub formed: Option<Matrix>,
}

impl InverseUpdate {
    /// `inverse` at `damping`, its norm bounded by `1/damping` (see [`Ctx::inverse`]).
    pub(super) fn new(
        inverse: Matrix,
        damping: f32,
        low_rank: Option<Box<LowRank>>,
        formed: Option<Matrix>,
    ) -> Self {
        Self {
            inverse,
            planes: SplitCache::default(),
            damping,
            inverse_norm: 1.0 / damping,
            low_rank,
            formed,
        }
    }

    /// Installs the update into `s`. A factor left to the rows of a kernel this update
    /// drops was formed for the inversion ([`Ctx::retarget`] inverts
    /// [`KronFactorState::dense_factor`]), and moves into the state.
    pub fn apply(self, s: &mut KronFactorState) {
        let old = std::mem::replace(&mut s.low_rank, self.low_rank);
        if s.low_rank.is_none() {
            if let Some(f) = old.and_then(|lr| lr.into_dense_factor()) {
                s.factor = f;
                s.splits.factor = SplitCache::default();
                s.host_factor = None;
            }
        }
        s.inverse = self.inverse;
        s.splits.inverse = self.planes;
        s.damping = self.damping;
        s.inverse_norm = self.inverse_norm;
        s.square = None;
        s.retargeted = None;
    }

    /// The full factor state for a freshly refreshed factor: formed, or left to its rows
    /// (formed by the inversion, or else kept by the low-rank kernel, the state holding the
    /// placeholder [`deferred`]).
    pub fn with_factor(self, (factor, scalars, top): Fresh<'_>) -> Result<KronFactorState> {
        let (factor, host_factor) = match (factor, self.formed) {
            (Refreshed::Formed(f, _, host), _) => (f, host),
            (Refreshed::Rows(_), Some(f)) => (f, None),
            (Refreshed::Rows(_), None) => (deferred()?, None),
        };
        Ok(KronFactorState {
            factor,
            inverse: self.inverse,
            damping: self.damping,
            inverse_norm: self.inverse_norm,
            norm: scalars.norm,
            trace: scalars.trace,
            top,
            square: None,
            retargeted: None,
            low_rank: self.low_rank,
            splits: Splits {
                factor: SplitCache::default(),
                inverse: self.planes,
            },
            host_factor,
        })
    }
}
