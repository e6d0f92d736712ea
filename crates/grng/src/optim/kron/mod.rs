//! RING, RENG and NGD (K-FAC with Tikhonov damping and π) — docs/math.md §2, paper Algorithm 1 —
//! as whole optimizers ([`KronOptimizer::step`]) and as a gradient preconditioner composable
//! with any first-order update ([`KronOptimizer::precondition`], kfac-pytorch style).
//!
//! # Per layer
//! With the augmented weights `W̄` (`d_out x d_in`, `d_in` including the bias column when the
//! layer has one) and the statistics of [`KronStats`]:
//! - factors `Λ = (1/m) AᵀA`, `Γ = (1/m') ÊᵀÊ`, optionally blended by the EMA `ε`;
//! - dampings `λ_Λ`, `λ_Γ` by [`KronVariant`] (RING `√ρ‖·‖₂`, RENG `√ρ`, NGD `π√ρ`, `√ρ/π`);
//! - `P = Γ̃⁻¹ G Λ̃⁻¹` with `Λ̃ = Λ + λ_Λ I`, `Γ̃ = Γ + λ_Γ I`, i.e. `(Λ̃ ⊗ Γ̃)⁻¹ vec(G)`;
//! - whole optimizer: `W̄ ← W̄ − η P`, `η = α/L` (or `α` without [`KronConfig::scale_by_layers`]).
//!
//! # Gradients by their factors
//! [`KronOptimizer::step_grads`] and [`KronOptimizer::precondition_grads`] also take a layer's
//! gradient as the batch factors of `G = (1/m) EᵀA` ([`KronGrad::Factored`], what a backward
//! pass has anyway): then `P = (1/m)(Γ̃⁻¹Eᵀ)(AΛ̃⁻¹)` and the quadratic model's terms come
//! from `m x m` products — the same values up to rounding, about 2.7x fewer flops for a
//! `1024 x 1025` layer at `m = 256` — on each layer where that is cheaper (`factored.rs`).
//!
//! # Lazy Fisher
//! Steps with `step mod S == 0` ([`KronOptimizer::needs_stats`]) recompute the factors, their
//! norms/traces and the inverses (warm-started Newton or Cholesky). Other steps reuse them; when
//! `ρ` moved since an inverse `X₀` was formed at the damping `λ₀`, the step's damping target `λ`
//! differs and it uses the first-order inverse `X₀ − (λ − λ₀)·X₀²` (docs/math.md §2) if
//! `|λ − λ₀|·‖X₀‖₂ ≤ 1/2`, else the inverse is recomputed from the stored factor (a new
//! formation). The square `X₀²` is formed once per formation, at the first lazy step that needs
//! it, and cached: a lazy step costs one axpy per factor, not a GEMM. The update is relative to
//! the formation, so its error is `O((Δλ·‖X₀‖₂)²)` relative with `Δλ = λ − λ₀` the whole drift,
//! bounded by the guard (details in `layer.rs`).
//!
//! # Levenberg–Marquardt damping
//! [`KronOptimizer::step`] stores the quadratic model's predicted change, summed over layers,
//! for the step `Δ = −ηP`:
//!
//! `q(δ) − q(0) = ⟨G, Δ⟩ + ½⟨Δ, Γ Δ Λ⟩ + ½ λ ‖Δ‖²`, with `λ = λ_Λ · λ_Γ`,
//!
//! the coefficient of the identity term of `Λ̃ ⊗ Γ̃ = Λ⊗Γ + λ_Γ Λ⊗I + λ_Λ I⊗Γ + λ_Λλ_Γ I`.
//! For RENG and NGD this is `λ = ρ` — Martens & Grosse's model `F + ρI`, of which the factored
//! Tikhonov damping is the Kronecker-friendly approximation — and for RING `ρ‖Λ‖₂‖Γ‖₂`.
//! [`KronOptimizer::observe_loss`] forms `r = (L(θ+δ) − L(θ)) / (q(δ) − q(0))` and moves `ρ` by
//! [`levenberg_marquardt`]. With [`KronConfig::damping_interval`] `T > 1` only every `T`-th
//! step forms the model ([`KronOptimizer::adapts_damping`]); the others skip its products
//! and need no loss after the step.
//!
//! # Failure
//! Every entry point validates its inputs and computes into new buffers before committing, so
//! an error leaves the optimizer exactly as it was. Newton divergence falls back (more damping,
//! then Cholesky) and is counted in [`KronCounters`]. On the kernel devices a call's checks
//! and model reductions are read back once, at its end (`Device::deferred`): a clean lazy step
//! synchronizes with the GPU once; a failing one runs again eagerly to name its error.

mod config;
mod damping;
mod factored;
mod layer;
mod low_rank;
mod rows;
mod state;
mod tasks;

pub use config::{InverseMethod, KronConfig, KronVariant, HOST_REFRESH_MAX, NEWTON_RETRY_DAMPING};
pub use damping::levenberg_marquardt;
pub use factored::KronGrad;
pub use state::{KronCounters, KronFactorState, KronLayerState, KronState, KronStepInfo};

use self::damping::{factor_dampings, FactorScalars};
use self::factored::{
    by_identity, factored_is_cheaper, Factors, InverseView, LayerView, ModelTerms, Parts,
    Preconditioned,
};
use self::layer::{formed_view, known_norm, Ctx, InverseUpdate, Refreshed, Retarget};
use super::{KronStats, StatsView};
use crate::device::{Device, Matrix};
use crate::dist::{self, DataParallel, Inversions, Part};
use crate::error::{check_shape, check_value, Error, Result};
use crate::ops::{Readout, SplitCache};

/// RING / RENG / NGD over `L` dense layers on one [`Device`]. See the module docs.
#[derive(Debug)]
pub struct KronOptimizer {
    device: Device,
    config: KronConfig,
    /// `(d_out, d_in)` of each `W̄_l`.
    shapes: Vec<(usize, usize)>,
    st: KronState,
    /// The weights the last step replaced, one matrix per layer (on the CPU): the next step
    /// writes its `P` over them (then `W − ηP` over `P`), so the layers' buffers alternate
    /// instead of being allocated every step. Not state (any contents serve): empty after
    /// `new` and after a failed step.
    spare: Vec<Matrix>,
    /// Data-parallel steps ([`KronOptimizer::set_data_parallel`]).
    dp: Option<DataParallel>,
}

/// The statistics a refresh forms its factors from: the caller's rows, or (data-parallel)
/// each layer's `[Λ, Γ]` mean Gram matrices over the ranks, with a spread refresh's results
/// as the layers' owners sent them ([`KronOptimizer::spread_inversions`]).
#[derive(Clone, Copy)]
enum StatsIn<'s, 'a> {
    Rows(&'s [KronStats<'a>]),
    Grams(&'s [[Matrix; 2]]),
    Spread(&'s [[Matrix; 2]], &'s [Vec<f32>]),
}

impl<'a> StatsIn<'_, 'a> {
    /// Layer `l`'s refreshed factor `side` (0: `Λ`, 1: `Γ`) blended into `old`.
    fn factor(
        &self,
        ctx: &Ctx<'_>,
        (l, side): (usize, usize),
        old: Option<&KronFactorState>,
        c: &mut KronCounters,
    ) -> Result<layer::Forming<'a>> {
        match *self {
            StatsIn::Rows(s) => ctx.factor([s[l].a, s[l].e][side].view(), old, c),
            StatsIn::Grams(g) | StatsIn::Spread(g, _) => ctx.factor_from_gram(&g[l][side], old, c),
        }
    }
}

/// A data-parallel call's inputs, reduced over the ranks ([`KronOptimizer::reduce_inputs`]):
/// the gradients as their mean or as every rank's rows gathered (neither when they come
/// reduced) and, on a refresh, the statistics as the factors' mean Gram matrices or as every
/// rank's rows gathered.
struct Reduced {
    /// The dense mean gradients.
    grads: Option<Vec<Matrix>>,
    /// Per layer the gathered `(E, A)` (`M x d_out`, `M x d_in`): the concatenated batch's
    /// factored gradient.
    grad_rows: Option<Vec<(Matrix, Matrix)>>,
    /// Per layer the mean Gram matrices `[Λ, Γ]`.
    grams: Option<Vec<[Matrix; 2]>>,
    /// Per layer the gathered statistics rows `(A, E)`: the concatenated batch's.
    stat_rows: Option<Vec<(Matrix, Matrix)>>,
}

impl Reduced {
    /// The gathered statistics rows as the single process takes them.
    fn stats(&self) -> Option<Vec<KronStats<'_>>> {
        let rows = self.stat_rows.as_ref()?;
        Some(rows.iter().map(|(a, e)| KronStats { a, e }).collect())
    }
}

/// A layer of a refresh with its factors formed ([`KronOptimizer::refresh_layers`]): its
/// index, each factor with the host copies of [`Ctx::host_reads`] (empty until read back), and
/// each factor's counters.
type FormedLayer<'x> = (
    usize,
    [(layer::Forming<'x>, Vec<Vec<f32>>); 2],
    [KronCounters; 2],
);

/// How the inverses move on this call: rebuilt from statistics, or retargeted lazily.
enum Plan {
    /// New layer states, and whether the step's gradients are all factored (so the rows'
    /// route of `low_rank.rs` may apply them).
    Refresh(Vec<KronLayerState>, bool),
    /// Per layer `[Λ, Γ]`, and the `low_rank` flag the retargets were planned with.
    Lazy(Vec<[Retarget; 2]>, bool),
}

fn scalars(s: &KronFactorState) -> FactorScalars {
    FactorScalars {
        dim: s.dim(),
        norm: s.norm,
        trace: s.trace,
    }
}

impl KronOptimizer {
    /// An optimizer for layers with `layers[l] = (d_out, d_in)` (the shape of `W̄_l`, `d_in`
    /// including the bias column when present). Nothing is allocated on the device until the
    /// first refresh.
    ///
    /// # Errors
    /// [`Error::Value`] for a bad config ([`KronConfig::validate`]), no layers, or a zero
    /// dimension.
    pub fn new(device: &Device, layers: &[(usize, usize)], config: KronConfig) -> Result<Self> {
        const OP: &str = "KronOptimizer::new";
        config.validate()?;
        check_value(
            OP,
            "layers",
            layers.len() as f64,
            !layers.is_empty(),
            "at least one layer",
        )?;
        for &(o, i) in layers {
            check_value(
                OP,
                "layers",
                o.min(i) as f64,
                o >= 1 && i >= 1,
                "every (d_out, d_in) >= 1",
            )?;
        }
        Ok(Self {
            device: device.clone(),
            config,
            shapes: layers.to_vec(),
            st: KronState {
                rho: config.rho,
                steps: 0,
                predicted: None,
                last_ratio: None,
                counters: KronCounters::default(),
                layers: Vec::new(),
            },
            spare: Vec::new(),
            dp: None,
        })
    }

    /// Makes the steps data-parallel over a communicator (or single-process again with
    /// `None`). Each call then sums the ranks' row counts, and reduces, in one all-reduce
    /// after the ranks' agreement (`crate::dist`): the gradients (unless they come reduced)
    /// as every rank's rows gathered when all are factored and their rows are fewer values
    /// than the dense gradients, else averaged by [`DataParallel::rows`], made dense first
    /// where given by factors; and on a refresh each layer's statistics, before the EMA, as
    /// every rank's rows gathered when they are fewer values than the Gram matrices' lower
    /// triangles (and the inversions are not spread, [`dist::Inversions`]), else as those
    /// triangles averaged by their own row counts. Every rank then forms the same factors
    /// and inverses and takes the step one process takes on the concatenated batch — with
    /// gathered rows exactly that step, the rows' routes included (`docs/distributed.md`).
    /// [`KronOptimizer::observe_loss`] averages the ranks' losses by rows likewise.
    pub fn set_data_parallel(&mut self, dp: Option<DataParallel>) {
        self.dp = dp;
    }

    /// The data-parallel setting, to set this rank's rows for the coming steps.
    pub fn data_parallel_mut(&mut self) -> Option<&mut DataParallel> {
        self.dp.as_mut()
    }

    /// Data-parallel: this call's inputs reduced over the ranks (`None` when single-process).
    /// This rank's checks (`check_inputs`, and `params` when given) go into the agreement,
    /// so a bad input on any rank fails the call on every rank before anything moves.
    ///
    /// Two reductions. The first sums every rank's row counts (each rank writes its own
    /// slots): the gradients' rows per layer when every gradient is factored, the statistics'
    /// rows per factor. The second moves, whichever is fewer values (the same choice on every
    /// rank: it reads the totals only), the gradients as their dense mean or as every rank's
    /// rows `(E, A)` gathered, and the statistics as the lower triangles of their mean Gram
    /// matrices or as every rank's rows gathered (with [`Inversions::Everywhere`]: a spread
    /// refresh inverts Gram-formed factors). Gathered rows make the call the single process's
    /// on the concatenated batch — its rows' routes included (`rows.rs`, `low_rank.rs`: the
    /// Woodbury inverse, RING's norm from the `m x m` Gram, the factored preconditioning),
    /// which a Gram matrix cannot take. A gather is an all-reduce of zero-padded rows (the
    /// trait has no all-gather).
    fn reduce_inputs(
        &self,
        op: &'static str,
        grads: &[KronGrad<'_>],
        stats: Option<&[KronStats<'_>]>,
        params: Option<&[Matrix]>,
    ) -> Result<Option<Reduced>> {
        let Some(dp) = &self.dp else {
            return Ok(None);
        };
        let ctx = Ctx {
            device: &self.device,
            cfg: &self.config,
        };
        let (p, rank) = (dp.comm().size(), dp.comm().rank());
        // This rank's row counts: per layer the gradient's (0 when a gradient is dense or
        // comes reduced), then per layer the statistics' `A` and `E`.
        let checked = || -> Result<Vec<Part>> {
            // Not split: the reduced gradients replace these.
            self.check_inputs(op, grads, stats.map(StatsIn::Rows), false)?;
            if let Some(params) = params {
                self.check_layers(op, "params", params.iter())?;
            }
            let by_rows = !dp.grads_reduced() && low_rank(grads);
            let mut counts: Vec<usize> = grads
                .iter()
                .map(|g| match g.parts() {
                    Parts::Factored(Factors { e, .. }) if by_rows => e.rows(),
                    _ => 0,
                })
                .collect();
            for s in stats.into_iter().flatten() {
                counts.extend([s.a.view().shape().0, s.e.view().shape().0]);
            }
            let mut slots = vec![0.0f32; counts.len() * p];
            for (k, &c) in counts.iter().enumerate() {
                slots[k * p + rank] = c as f32;
            }
            Ok(vec![Part::Sum(slots)])
        };
        let slots = dp.reduce(op, checked())?.remove(0).values;
        // Per count: every rank's (exact: the sum adds one nonzero per slot), its total and
        // this rank's offset in the gathered rows.
        let rows_of = |k: usize| -> (usize, usize) {
            let of = |r: usize| slots[k * p + r] as usize;
            ((0..p).map(of).sum(), (0..rank).map(of).sum())
        };
        let layers = self.shapes.len();
        let grad_rows = (0..layers).all(|l| (0..p).all(|r| slots[l * p + r] > 0.0))
            && self
                .shapes
                .iter()
                .enumerate()
                .map(|(l, &(o, i))| rows_of(l).0 * (o + i))
                .sum::<usize>()
                < self.shapes.iter().map(|&(o, i)| o * i).sum();
        let stat_rows = stats.is_some()
            && dp.inversions() == Inversions::Everywhere
            && self
                .shapes
                .iter()
                .enumerate()
                .map(|(l, &(o, i))| {
                    rows_of(layers + 2 * l).0 * i + rows_of(layers + 2 * l + 1).0 * o
                })
                .sum::<usize>()
                < self
                    .shapes
                    .iter()
                    .map(|&(o, i)| i * (i + 1) / 2 + o * (o + 1) / 2)
                    .sum();
        // This rank's rows `x` (`m x n`) in its place among every rank's (`M x n`, zeros
        // elsewhere).
        let padded = |x: &[f32], n: usize, k: usize| -> Result<Part> {
            let (total, at) = rows_of(k);
            let mut v = crate::error::try_vec(total, n, 0.0f32)?;
            v[at * n..at * n + x.len()].copy_from_slice(x);
            Ok(Part::Sum(v))
        };
        let local = || -> Result<Vec<Part>> {
            let mut parts = Vec::new();
            if !dp.grads_reduced() {
                let mut flat = Vec::new();
                for (l, (g, &(o, i))) in grads.iter().zip(&self.shapes).enumerate() {
                    match g.parts() {
                        Parts::Factored(Factors { e, a, .. }) if grad_rows => {
                            parts.push(padded(&e.to_vec()?, o, l)?);
                            parts.push(padded(&a.to_vec()?, i, l)?);
                        }
                        Parts::Dense(g) => flat.extend(g.to_vec()?),
                        Parts::Factored(Factors { e, a, .. }) => {
                            let mut dense = self.device.zeros(o, i)?;
                            self.device.batch_gradient(e, a, &mut dense)?;
                            flat.extend(dense.to_vec()?);
                        }
                    }
                }
                if !grad_rows {
                    parts.push(Part::Mean(flat, dp.rows()));
                }
            }
            for (l, s) in stats.into_iter().flatten().enumerate() {
                for (side, x) in [s.a.view(), s.e.view()].into_iter().enumerate() {
                    let (m, n) = x.shape();
                    if stat_rows {
                        let host = match x {
                            StatsView::F32(x) => x.to_vec()?,
                            StatsView::Bf16(x) => crate::ops::gemm::widen(x)?.to_vec()?,
                        };
                        parts.push(padded(&host, n, layers + 2 * l + side)?);
                    } else {
                        let gram = rows::replaced_factor(&self.device, &ctx.rows(x)?)?;
                        let tri = dist::lower_triangle(&gram.to_vec()?, n);
                        parts.push(Part::Mean(tri, m));
                    }
                }
            }
            Ok(parts)
        };
        let mut reduced = dp.reduce(op, local())?.into_iter();
        let mut next = || reduced.next().map(|r| r.values).unwrap_or_default();
        let (grads, grad_rows) = if dp.grads_reduced() {
            (None, None)
        } else if grad_rows {
            let mut gs = Vec::with_capacity(layers);
            for (l, &(o, i)) in self.shapes.iter().enumerate() {
                let m = rows_of(l).0;
                let e = self.device.upload(m, o, &next())?;
                gs.push((e, self.device.upload(m, i, &next())?));
            }
            (None, Some(gs))
        } else {
            let flat = next();
            let mut at = 0;
            let mut gs = Vec::with_capacity(layers);
            for &(o, i) in &self.shapes {
                gs.push(self.device.upload(o, i, &flat[at..at + o * i])?);
                at += o * i;
            }
            (Some(gs), None)
        };
        let (grams, stat_rows) = match stats {
            None => (None, None),
            Some(_) if stat_rows => {
                let mut rows = Vec::with_capacity(layers);
                for (l, &(o, i)) in self.shapes.iter().enumerate() {
                    let a = self.device.upload(rows_of(layers + 2 * l).0, i, &next())?;
                    let e = self
                        .device
                        .upload(rows_of(layers + 2 * l + 1).0, o, &next())?;
                    rows.push((a, e));
                }
                (None, Some(rows))
            }
            Some(_) => {
                let mut grams = Vec::with_capacity(layers);
                for &(o, i) in &self.shapes {
                    let mut side = |n: usize| -> Result<Matrix> {
                        self.device
                            .upload(n, n, &dist::from_lower_triangle(&next(), n)?)
                    };
                    grams.push([side(i)?, side(o)?]);
                }
                (Some(grams), None)
            }
        };
        Ok(Some(Reduced {
            grads,
            grad_rows,
            grams,
            stat_rows,
        }))
    }

    /// The configuration (`rho` there is the initial value; see [`KronOptimizer::rho`]).
    pub fn config(&self) -> &KronConfig {
        &self.config
    }

    /// The device the optimizer's state lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `(d_out, d_in)` per layer.
    pub fn layer_shapes(&self) -> &[(usize, usize)] {
        &self.shapes
    }

    /// Current damping parameter `ρ`.
    pub fn rho(&self) -> f32 {
        self.st.rho
    }

    /// Completed steps (`step` and `precondition` calls).
    pub fn steps(&self) -> u64 {
        self.st.steps
    }

    /// Counters, fallbacks included.
    pub fn counters(&self) -> &KronCounters {
        &self.st.counters
    }

    /// Reduction ratio formed by the last [`KronOptimizer::observe_loss`].
    pub fn last_ratio(&self) -> Option<f32> {
        self.st.last_ratio
    }

    /// Effective step size `α/L` (or `α`).
    pub fn effective_lr(&self) -> f32 {
        if self.config.scale_by_layers {
            self.config.lr / self.shapes.len() as f32
        } else {
            self.config.lr
        }
    }

    /// True when the coming [`KronOptimizer::step`] forms the quadratic model (`step mod T
    /// == 0` for [`KronConfig::damping_interval`] `T`): its predicted change then waits for
    /// [`KronOptimizer::observe_loss`]. The other steps skip the model's products, and the
    /// loss after them is not needed.
    pub fn adapts_damping(&self) -> bool {
        self.st
            .steps
            .is_multiple_of(self.config.damping_interval as u64)
    }

    /// The predicted change of the last [`KronOptimizer::step`] while it waits for
    /// [`KronOptimizer::observe_loss`]; `None` when that step formed no model or was observed.
    pub fn pending_prediction(&self) -> Option<f32> {
        self.st.predicted
    }

    /// True when the coming step refreshes the Fisher (`step mod S == 0`, or no factors yet):
    /// `stats` must be passed then. Statistics passed on other steps refresh too.
    pub fn needs_stats(&self) -> bool {
        self.st.layers.is_empty() || self.st.steps.is_multiple_of(self.config.skip as u64)
    }

    /// Preconditioner only: returns `P_l = Γ̃_l⁻¹ G_l Λ̃_l⁻¹` for any
    /// first-order update to consume, refreshing the factors when `stats` is given and moving
    /// the inverses to the current `ρ` otherwise. Counts as a step for the lazy schedule; `ρ`
    /// only moves through [`KronOptimizer::step`] + [`KronOptimizer::observe_loss`], so this
    /// clears any pending predicted change.
    ///
    /// `grads[l]`: `d_out x d_in` gradient of layer `l` (for RENG, `g + 2c·H_L g`).
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DeviceMismatch`] for wrong counts, shapes or devices,
    /// [`Error::Value`] for missing `stats` when [`KronOptimizer::needs_stats`],
    /// [`Error::NonFinite`] for NaN/Inf in gradients or statistics (or a preconditioned
    /// gradient that overflows), [`Error::NotSpd`] if even the Cholesky fallback fails.
    /// The optimizer is unchanged on error.
    pub fn precondition(
        &mut self,
        grads: &[&Matrix],
        stats: Option<&[KronStats<'_>]>,
    ) -> Result<Vec<Matrix>> {
        let grads = dense(grads);
        self.precondition_impl("KronOptimizer::precondition", &grads, stats)
    }

    /// [`KronOptimizer::precondition`] with each layer's gradient dense or by its batch
    /// factors ([`KronGrad::Factored`]: `G = (1/m) EᵀA`, preconditioned as `(1/m)(Γ̃⁻¹Eᵀ)(AΛ̃⁻¹)`
    /// where that costs fewer flops — about 2.7x fewer at `m = 256`, `1024 x 1024`).
    ///
    /// # Errors
    /// As [`KronOptimizer::precondition`]; for a factored gradient the shapes are
    /// `e: m x d_out`, `a: m x d_in` with the same `m ≥ 1`, and the finiteness check covers
    /// `e` and `a`.
    pub fn precondition_grads(
        &mut self,
        grads: &[KronGrad<'_>],
        stats: Option<&[KronStats<'_>]>,
    ) -> Result<Vec<Matrix>> {
        self.precondition_impl("KronOptimizer::precondition_grads", grads, stats)
    }

    fn precondition_impl(
        &mut self,
        op: &'static str,
        grads: &[KronGrad<'_>],
        stats: Option<&[KronStats<'_>]>,
    ) -> Result<Vec<Matrix>> {
        let reduced = self.reduce_inputs(op, grads, stats, None)?;
        let gathered = reduced.as_ref().and_then(Reduced::stats);
        let (grads, stats) = inputs(reduced.as_ref(), gathered.as_deref(), grads, stats);
        let received = self.spread_inversions(op, stats)?;
        let stats = with_received(stats, received.as_deref());
        crate::cpu::on_pool(self.pool_work(), || {
            self.precondition_on_pool(op, &grads, stats)
        })
    }

    /// The size [`crate::cpu::on_pool`] decides by ([`Device::pool_work`]): the multiply-adds
    /// of the step's largest product, `Γ̃⁻¹·G·Λ̃⁻¹`'s larger half
    /// (`d_out·d_in·max(d_out, d_in)`), on the CPU.
    fn pool_work(&self) -> usize {
        let work = |&(r, c): &(usize, usize)| r * c * r.max(c);
        let largest = self.shapes.iter().map(work).max().unwrap_or(0);
        self.device.pool_work(largest)
    }

    fn precondition_on_pool(
        &mut self,
        op: &'static str,
        grads: &[KronGrad<'_>],
        stats: Option<StatsIn<'_, '_>>,
    ) -> Result<Vec<Matrix>> {
        // Every check of the call read back once (`Device::deferred`); the body builds new
        // matrices only, installed below.
        let ((plan, counters, ps), _) = self.device.deferred(|| {
            let splits = self.check_inputs(op, grads, stats, true)?;
            let mut counters = self.st.counters;
            let plan = self.plan(stats, grads, false, &mut counters)?;
            let ps = self.preconditioned(&plan, (grads, &splits), false, None, Vec::new())?;
            Ok((plan, counters, ps))
        })?;
        self.commit(plan, counters);
        self.st.predicted = None;
        Ok(ps.into_iter().map(|p| p.p).collect())
    }

    /// Whole optimizer: `W̄_l ← W̄_l − η·P_l` with `η = α/L` (or `α`), storing the quadratic
    /// model's predicted change for [`KronOptimizer::observe_loss`] when the step
    /// [`KronOptimizer::adapts_damping`].
    ///
    /// `params[l]`: `W̄_l`, `d_out x d_in`, updated in place; `grads`, `stats` as in
    /// [`KronOptimizer::precondition`]. Each `params[l]` is replaced by a matrix holding the new
    /// weights; on the CPU the optimizer keeps the replaced one as the buffer its next step
    /// writes into (memory: one more copy of the weights, instead of a fresh allocation and
    /// its page faults every step).
    ///
    /// # Errors
    /// As [`KronOptimizer::precondition`], plus shape/device/finiteness errors for `params`.
    /// Neither the optimizer nor `params` change on error.
    pub fn step(
        &mut self,
        params: &mut [Matrix],
        grads: &[&Matrix],
        stats: Option<&[KronStats<'_>]>,
    ) -> Result<KronStepInfo> {
        let grads = dense(grads);
        Ok(self
            .step_impl("KronOptimizer::step", params, &grads, stats, None)?
            .0)
    }

    /// [`KronOptimizer::step`] with each layer's gradient dense or by its batch factors, as in
    /// [`KronOptimizer::precondition_grads`]; the quadratic model's terms are then taken from
    /// the same factors (`m x m` products, see [`KronGrad`]).
    ///
    /// # Errors
    /// As [`KronOptimizer::step`] and [`KronOptimizer::precondition_grads`].
    pub fn step_grads(
        &mut self,
        params: &mut [Matrix],
        grads: &[KronGrad<'_>],
        stats: Option<&[KronStats<'_>]>,
    ) -> Result<KronStepInfo> {
        let op = "KronOptimizer::step_grads";
        Ok(self.step_impl(op, params, grads, stats, None)?.0)
    }

    /// [`KronOptimizer::step_grads`], also giving layer `layer`'s output change on the batch
    /// rows of its factored gradient: `ΔZ = A·(W̄' − W̄)ᵀ = −η·A·Pᵀ` (`m x d_out`, on this
    /// optimizer's device), where the step's own factors give it by one `m x m x d_out`
    /// product (`P = UV/m`, `A·Pᵀ = (AVᵀ/m)·Uᵀ`). A trainer that evaluates the loss after the
    /// step on the same batch (the Levenberg–Marquardt rule) takes the first layer's new
    /// outputs as `Z + ΔZ` instead of the `m·d_in·d_out` product `A·W̄'ᵀ`: the same values up
    /// to rounding (those of `W̄'` and of the two products). `None` where the step did not form
    /// the model ([`KronOptimizer::adapts_damping`]) or the layer's gradient did not take the
    /// factored route (a dense gradient, or one cheaper to form). Not checked for finiteness
    /// on the CPU: a non-finite `ΔZ` gives a non-finite loss after the step.
    ///
    /// # Errors
    /// As [`KronOptimizer::step_grads`]; [`Error::Value`] for `layer` past the last layer.
    pub fn step_grads_with_output_change(
        &mut self,
        params: &mut [Matrix],
        grads: &[KronGrad<'_>],
        stats: Option<&[KronStats<'_>]>,
        layer: usize,
    ) -> Result<(KronStepInfo, Option<Matrix>)> {
        let op = "KronOptimizer::step_grads_with_output_change";
        if layer >= self.shapes.len() {
            return Err(Error::Value {
                op,
                arg: "layer",
                value: layer as f64,
                expected: "a layer index below the number of layers",
            });
        }
        self.step_impl(op, params, grads, stats, Some(layer))
    }

    fn step_impl(
        &mut self,
        op: &'static str,
        params: &mut [Matrix],
        grads: &[KronGrad<'_>],
        stats: Option<&[KronStats<'_>]>,
        output_change: Option<usize>,
    ) -> Result<(KronStepInfo, Option<Matrix>)> {
        let reduced = self.reduce_inputs(op, grads, stats, Some(&*params))?;
        let gathered = reduced.as_ref().and_then(Reduced::stats);
        let (grads, stats) = inputs(reduced.as_ref(), gathered.as_deref(), grads, stats);
        let received = self.spread_inversions(op, stats)?;
        let stats = with_received(stats, received.as_deref());
        let grads = &grads[..];
        crate::cpu::on_pool(self.pool_work(), || {
            let before = self.st.counters;
            let eta = self.effective_lr();
            let with_model = self.adapts_damping();
            let current: &[Matrix] = params;
            // The whole step's checks and model reductions are read back once, at the end of
            // this scope (`Device::deferred`: on a GPU one synchronization per step, not one per
            // op). The body only builds new matrices; nothing is installed before the scope has
            // confirmed every check, so a failed step leaves everything as it was.
            let mut spare = Some(std::mem::take(&mut self.spare));
            let (step, readout) = self.device.deferred(|| {
                let splits = self.check_inputs(op, grads, stats, true)?;
                self.check_layers(op, "params", current.iter())?;
                let mut counters = before;
                let plan = self.plan(stats, grads, with_model, &mut counters)?;
                let spare = spare.take().unwrap_or_default();
                // Formed with the model's terms only (`factored::precondition`).
                let change = output_change.map(|l| (l, -eta));
                let grads = (grads, &splits[..]);
                let mut ps = self.preconditioned(&plan, grads, with_model, change, spare)?;
                let change = change.and_then(|(l, _)| ps[l].output_change.take());
                let terms = factored::model_terms(&self.device, &ps, grads.0)?;
                // Where the values are known now (not deferred), an overflowing step is
                // reported before any update runs.
                if let Some(q) = self.predicted(&terms, &Readout::default()) {
                    check_predicted(op, q)?;
                }
                // The new weights go into new matrices, each over its `P` (read by nothing after
                // the model terms above): an update that overflows on a later layer must leave
                // every layer and the optimizer state as they were. Every layer's in one pass
                // (on the kernel devices one launch).
                let pairs = ps.into_iter().zip(current).map(|(p, w)| (p.p, w)).collect();
                let updated = match self.device.axpy_over_all(-eta, pairs) {
                    Ok(updated) => updated,
                    Err(e) => {
                        // Nothing reads the parameters before this update, so NaN/Inf in them
                        // surfaces here as a non-finite result; name them, checking only on
                        // this error path (no read-back on a good step).
                        let all: Vec<_> = current.iter().map(|p| ("params", p)).collect();
                        self.device.check_all_finite(op, &all)?;
                        return Err(e);
                    }
                };
                Ok((plan, counters, terms, updated, change))
            })?;
            let (plan, counters, terms, updated, change) = step;
            let q = self.predicted(&terms, &readout).unwrap_or(f64::NAN);
            let q = check_predicted(op, q)?;
            let refreshed = matches!(plan, Plan::Refresh(..));
            self.commit(plan, counters);
            // Without the model `q` is the empty sum 0: nothing to observe.
            let predicted = with_model.then_some(q);
            self.st.predicted = predicted;
            let replaced = params
                .iter_mut()
                .zip(updated)
                .map(|(w, new)| std::mem::replace(w, new));
            // Only the CPU's products write over a spare (`Device::product_consumed_over`).
            if matches!(self.device, Device::Cpu) {
                self.spare = replaced.collect();
            } else {
                replaced.for_each(drop);
            }
            let delta = |f: fn(&KronCounters) -> u64| (f(&counters) - f(&before)) as u32;
            let info = KronStepInfo {
                refreshed,
                predicted_change: predicted,
                rho: self.st.rho,
                lr: eta,
                first_order_updates: delta(|c| c.first_order_updates),
                lazy_recomputes: delta(|c| c.lazy_recomputes),
                fallbacks: delta(|c| c.fallbacks()),
            };
            Ok((info, change))
        })
    }

    /// The quadratic model's predicted change summed over the layers (a layer without terms
    /// adds nothing), `None` while a term is deferred (unknown to `r`).
    fn predicted(&self, terms: &[Option<ModelTerms>], r: &Readout) -> Option<f64> {
        let eta = self.effective_lr();
        let mut q = 0.0f64;
        for t in terms.iter().flatten() {
            q += t.model_change(r, eta)?;
        }
        Some(q)
    }

    /// Levenberg–Marquardt update after a [`KronOptimizer::step`]: `before` and `after` are
    /// the loss whose gradient was passed (RENG: the regularized one if the trainer has it,
    /// else the plain loss), on the same batch, before and after the step. Forms
    /// `r = (after − before) / q` with the stored prediction `q` and moves `ρ` by
    /// [`levenberg_marquardt`]. A non-finite `after` (the step blew up) counts as `r = −∞`
    /// and raises `ρ`; a prediction `q ≥ 0` (zero gradient) leaves `ρ` alone (counted).
    ///
    /// # Errors
    /// [`Error::Value`] when no prediction is pending ([`KronOptimizer::pending_prediction`]:
    /// a step that formed the model, observed at most once),
    /// [`Error::NonFinite`] for a non-finite `before`. Unchanged on error.
    pub fn observe_loss(&mut self, before: f32, after: f32) -> Result<()> {
        const OP: &str = "KronOptimizer::observe_loss";
        let checks = || -> Result<f32> {
            let Some(q) = self.st.predicted else {
                return Err(Error::Value {
                    op: OP,
                    arg: "predicted change",
                    value: f64::NAN,
                    expected: "a step() that formed the model (adapts_damping()), not yet observed",
                });
            };
            if !before.is_finite() {
                return Err(Error::NonFinite {
                    op: OP,
                    arg: "before",
                    index: 0,
                    value: before,
                });
            }
            Ok(q)
        };
        let q = checks();
        // Data-parallel: the concatenated batch's losses, the ranks' means weighted by rows
        // (the same on every rank, so `ρ` stays one value).
        let (q, before, after) = match &self.dp {
            None => (q?, before, after),
            Some(dp) => {
                let (q, local) = match q {
                    Ok(q) => (q, Ok(vec![Part::Mean(vec![before, after], dp.rows())])),
                    Err(e) => (0.0, Err(e)),
                };
                // This rank's error is returned here, the others' as `Error::Ranks`.
                let r = dp.reduce(OP, local)?;
                (q, r[0].values[0], r[0].values[1])
            }
        };
        let c = &mut self.st.counters;
        self.st.predicted = None;
        let r = if !after.is_finite() {
            c.nonfinite_losses += 1;
            f32::NEG_INFINITY
        } else if q < 0.0 {
            ((after as f64 - before as f64) / q as f64) as f32
        } else {
            c.lm_skipped += 1;
            return Ok(());
        };
        c.lm_updates += 1;
        self.st.last_ratio = Some(r);
        self.st.rho = levenberg_marquardt(&self.config, self.st.rho, r);
        Ok(())
    }

    /// Reacts to a step that could not be taken — [`KronOptimizer::step`] reported a
    /// non-finite value, or the trainer undid it: `ρ` grows as the Levenberg–Marquardt rule
    /// does for `r = −∞` (more damping, a shorter next step), counted in
    /// [`KronCounters::nonfinite_losses`]. A pending prediction is dropped.
    pub fn reject_step(&mut self) {
        self.st.predicted = None;
        self.st.counters.nonfinite_losses += 1;
        self.st.counters.lm_updates += 1;
        self.st.last_ratio = Some(f32::NEG_INFINITY);
        self.st.rho = levenberg_marquardt(&self.config, self.st.rho, f32::NEG_INFINITY);
    }

    /// A deep copy of the mutable state (factors, inverses, dampings, ρ, counters).
    ///
    /// # Errors
    /// Device errors from the copies.
    pub fn state(&self) -> Result<KronState> {
        self.st.try_clone()
    }

    /// Installs a state taken from an optimizer with the same layer shapes and device. A cached
    /// square ([`KronFactorState::square`]) is formed again from the restored `inverse` (one
    /// GEMM per factor that has one): the state's `inverse` may have been replaced, and the
    /// square must be its own.
    ///
    /// # Errors
    /// [`Error::Shape`] for a wrong layer count or matrix shape, [`Error::DeviceMismatch`],
    /// [`Error::Value`] for `ρ` outside `[rho_min, rho_max]` or bad scalars,
    /// [`Error::NonFinite`] for NaN/Inf in a matrix, [`Error::Value`] naming `factor` when
    /// `factor + damping·I` is not positive definite or `inverse` when the inverse is not
    /// (both by a host Cholesky factorization, the crate-private `optim::check_psd`),
    /// [`Error::NonFinite`] if re-forming a cached square overflows. Unchanged on error.
    pub fn restore(&mut self, mut state: KronState) -> Result<()> {
        const OP: &str = "KronOptimizer::restore";
        let cfg = &self.config;
        check_value(
            OP,
            "rho",
            state.rho as f64,
            state.rho >= cfg.rho_min && state.rho <= cfg.rho_max,
            "rho_min <= rho <= rho_max",
        )?;
        if let Some(q) = state.predicted {
            check_value(OP, "predicted", q as f64, true, "a finite number")?;
        }
        if let Some(r) = state.last_ratio {
            // −∞ is what a non-finite loss records.
            if !(r.is_finite() || r == f32::NEG_INFINITY) {
                return Err(Error::Value {
                    op: OP,
                    arg: "last_ratio",
                    value: r as f64,
                    expected: "finite or -inf",
                });
            }
        }
        if !state.layers.is_empty() {
            check_shape(
                OP,
                "layers",
                (state.layers.len(), 1),
                (self.shapes.len(), 1),
            )?;
        }
        for (layer, &(o, i)) in state.layers.iter().zip(&self.shapes) {
            for (s, n) in [(&layer.lambda, i), (&layer.gamma, o)] {
                check_shape(OP, "factor", s.factor.shape(), (n, n))?;
                check_shape(OP, "inverse", s.inverse.shape(), (n, n))?;
                for (arg, v) in [
                    ("damping", s.damping),
                    ("inverse_norm", s.inverse_norm),
                    ("norm", s.norm),
                    ("trace", s.trace),
                ] {
                    let ok = if arg == "damping" { v > 0.0 } else { v >= 0.0 };
                    check_value(OP, arg, v as f64, ok, "finite, >= 0 (damping > 0)")?;
                }
                self.device.check_finite(OP, "factor", &s.factor)?;
                self.device.check_finite(OP, "inverse", &s.inverse)?;
                if let Some(top) = &s.top {
                    check_top(top, n)?;
                }
                // F is an EMA of Gram matrices (PSD), so F + damping·I and X ≈ (F + damping·I)⁻¹
                // are SPD; a state that is not (corrupted, or from another run) would make the
                // next steps' Newton inversions diverge or precondition along negative
                // curvature. Checked once, on the host, when a state is installed.
                super::check_psd(
                    OP,
                    "factor",
                    &s.factor.to_vec()?,
                    n,
                    s.damping,
                    "factor + damping·I positive definite (Cholesky succeeds)",
                )?;
                super::check_psd(
                    OP,
                    "inverse",
                    &s.inverse.to_vec()?,
                    n,
                    0.0,
                    "a symmetric positive definite inverse (Cholesky succeeds)",
                )?;
            }
        }
        let ctx = Ctx {
            device: &self.device,
            cfg: &self.config,
        };
        for layer in &mut state.layers {
            for s in [&mut layer.lambda, &mut layer.gamma] {
                if s.square.is_some() {
                    s.square = Some(ctx.square(&s.inverse, None)?);
                }
            }
        }
        self.st = state;
        Ok(())
    }

    /// Counts, shapes and devices of `grads` and `stats`, `stats` presence, and finite
    /// `grads` (a factored gradient's `e` and `a`).
    /// Checks the call's inputs; returns each layer's gradient planes (dense: `G`'s in the
    /// first cache; factored: `E`'s, `A`'s), written by the check on the kernel devices
    /// where `split` asks ([`Device::check_finite_split`]) for the products that read them.
    fn check_inputs(
        &self,
        op: &'static str,
        grads: &[KronGrad<'_>],
        stats: Option<StatsIn<'_, '_>>,
        split: bool,
    ) -> Result<Vec<[SplitCache; 2]>> {
        check_shape(op, "grads", (grads.len(), 1), (self.shapes.len(), 1))?;
        let splits: Vec<[SplitCache; 2]> = grads.iter().map(|_| Default::default()).collect();
        let mut named = Vec::with_capacity(2 * grads.len());
        for ((g, &(o, i)), [s0, s1]) in grads.iter().zip(&self.shapes).zip(&splits) {
            let (s0, s1) = (split.then_some(s0), split.then_some(s1));
            match g.parts() {
                Parts::Dense(g) => {
                    self.device.check_on(op, g)?;
                    check_shape(op, "grads", g.shape(), (o, i))?;
                    named.push(("grads", g, s0));
                }
                Parts::Factored(Factors { e, a, grams }) => {
                    self.device.check_on(op, e)?;
                    self.device.check_on(op, a)?;
                    let m = e.rows().max(1);
                    check_shape(op, "grads.e", e.shape(), (m, o))?;
                    check_shape(op, "grads.a", a.shape(), (m, i))?;
                    named.push(("grads.e", e, s0));
                    named.push(("grads.a", a, s1));
                    if let Some((ee, aa)) = grams {
                        for (arg, x) in [("grads.ee", ee), ("grads.aa", aa)] {
                            self.device.check_on(op, x)?;
                            check_shape(op, arg, x.shape(), (e.rows(), e.rows()))?;
                            named.push((arg, x, None));
                        }
                    }
                }
            }
        }
        // One batched check (a launch per four gradients, one read-back per step), which
        // also splits the gradients for the products; the preconditioning then skips its own
        // input checks.
        self.device.check_finite_split(op, &named)?;
        drop(named);
        match stats {
            None if self.needs_stats() => Err(Error::Value {
                op,
                arg: "stats",
                value: self.st.steps as f64,
                expected: "statistics on a refresh step (see needs_stats())",
            }),
            // Formed by `reduce_inputs`, with the layers' shapes.
            None | Some(StatsIn::Grams(_) | StatsIn::Spread(..)) => Ok(splits),
            Some(StatsIn::Rows(stats)) => {
                check_shape(op, "stats", (stats.len(), 1), (self.shapes.len(), 1))?;
                for (s, &(o, i)) in stats.iter().zip(&self.shapes) {
                    for (arg, m, cols) in [("stats.a", s.a.view(), i), ("stats.e", s.e.view(), o)] {
                        match m {
                            StatsView::F32(m) => self.device.check_on(op, m)?,
                            StatsView::Bf16(m) => self.device.check_on(op, m)?,
                        }
                        let shape = m.shape();
                        check_shape(op, arg, shape, (shape.0.max(1), cols))?;
                    }
                }
                Ok(splits)
            }
        }
    }

    /// One matrix per layer, each `d_out x d_in` on this device.
    fn check_layers<'m>(
        &self,
        op: &'static str,
        arg: &'static str,
        ms: impl ExactSizeIterator<Item = &'m Matrix>,
    ) -> Result<()> {
        check_shape(op, arg, (ms.len(), 1), (self.shapes.len(), 1))?;
        for (m, &shape) in ms.zip(&self.shapes) {
            self.device.check_on(op, m)?;
            check_shape(op, arg, m.shape(), shape)?;
        }
        Ok(())
    }

    /// Computes the new factors/inverses (refresh) or inverse updates (lazy) without touching
    /// the state, for the call's `grads` (`with_model`: the step forms the quadratic model).
    /// The lazy inverses may be taken through the factors' rows when every gradient is
    /// factored ([`low_rank`]), and left to the factored route's products on a layer that
    /// takes it with the model ([`Retarget::ByProducts`]).
    fn plan(
        &self,
        stats: Option<StatsIn<'_, '_>>,
        grads: &[KronGrad<'_>],
        with_model: bool,
        c: &mut KronCounters,
    ) -> Result<Plan> {
        let low_rank = low_rank(grads);
        let ctx = Ctx {
            device: &self.device,
            cfg: &self.config,
        };
        let rho = self.st.rho;
        // Layers, and the two factors of a layer, are independent tasks (`tasks.rs`), each
        // with counters of its own, added up in layer order.
        let Some(stats) = stats else {
            let layers = self.st.layers.iter().zip(grads).collect();
            let ups = tasks::map(&self.device, layers, |(layer, g)| {
                let shape = (layer.gamma.dim(), layer.lambda.dim());
                let by_products = with_model && factored_is_cheaper(g, shape, with_model);
                let (dl, dg) = factor_dampings(
                    &self.config,
                    rho,
                    scalars(&layer.lambda),
                    scalars(&layer.gamma),
                );
                let (mut cl, mut cg) = (KronCounters::default(), KronCounters::default());
                let (ul, ug) = tasks::join(
                    ctx.device,
                    || ctx.retarget(&layer.lambda, dl, (low_rank, by_products), &mut cl),
                    || ctx.retarget(&layer.gamma, dg, (low_rank, by_products), &mut cg),
                )?;
                Ok(([ul, ug], [cl, cg]))
            })?;
            let ups = layer::first_order_all(&self.device, &self.st.layers, tally(ups, c))?;
            let formed: Vec<_> = ups
                .iter()
                .flatten()
                .filter_map(|u| match u {
                    Retarget::Formed(u) => Some(("inverse", &u.inverse, &u.planes)),
                    _ => None,
                })
                .collect();
            ctx.split_formed(&formed)?;
            return Ok(Plan::Lazy(ups, low_rank));
        };
        let all = (0..self.shapes.len()).collect();
        let layers = match stats {
            StatsIn::Spread(grams, received) => tasks::map(&self.device, all, |l| {
                self.received_layer(&grams[l], &received[l], l)
            })?,
            _ => self.refresh_layers(stats, all)?,
        };
        // The new inverses, and the factors where the model reads them, split together.
        let mut formed = Vec::new();
        for (layer, _) in &layers {
            for s in [&layer.lambda, &layer.gamma] {
                formed.push(("inverse", &s.inverse, &s.splits.inverse));
                if with_model {
                    formed.push(("factor", &s.factor, &s.splits.factor));
                }
            }
        }
        ctx.split_formed(&formed)?;
        c.refreshes += 1;
        Ok(Plan::Refresh(tally(layers, c), low_rank))
    }

    /// Layers `ls` refreshed from `stats`: both factors of each, their scalars and dampings at
    /// the current `ρ`, their inverses, and each factor's counters. Where a factor is refreshed
    /// on the host ([`KronConfig::host_refresh_max`]), in three phases: every factor formed,
    /// one read-back of all those factors (and RING's iterates), then each layer's scalars,
    /// dampings and inverses — one wait for the GPU per refresh where reading each factor as
    /// it was formed waited once per factor. Elsewhere each layer is one task, as before.
    fn refresh_layers(
        &self,
        stats: StatsIn<'_, '_>,
        ls: Vec<usize>,
    ) -> Result<Vec<(KronLayerState, [KronCounters; 2])>> {
        let ctx = Ctx {
            device: &self.device,
            cfg: &self.config,
        };
        let old = |l: usize| {
            let o = self.st.layers.get(l);
            [o.map(|o| &o.lambda), o.map(|o| &o.gamma)]
        };
        let form = |l: usize| -> Result<FormedLayer<'_>> {
            let [ol, og] = old(l);
            let (mut cl, mut cg) = (KronCounters::default(), KronCounters::default());
            let (fl, fg) = tasks::join(
                ctx.device,
                || stats.factor(&ctx, (l, 0), ol, &mut cl),
                || stats.factor(&ctx, (l, 1), og, &mut cg),
            )?;
            Ok((l, [(fl, Vec::new()), (fg, Vec::new())], [cl, cg]))
        };
        let host = ls.iter().any(|&l| {
            let (o, i) = self.shapes[l];
            ctx.on_host(o) || ctx.on_host(i)
        });
        if !host {
            return tasks::map(&self.device, ls, |l| self.finish_layer(&ctx, form(l)?));
        }
        let mut formed = tasks::map(&self.device, ls, form)?;
        let mut counts = Vec::with_capacity(2 * formed.len());
        let mut reads = Vec::new();
        for (l, fs, _) in &formed {
            for ((f, _), o) in fs.iter().zip(old(*l)) {
                let r = match f {
                    layer::Forming::Host(f, _) => ctx.host_reads(f, o),
                    layer::Forming::Fresh(_) => Vec::new(),
                };
                counts.push(r.len());
                reads.extend(r);
            }
        }
        let mut copies = self.device.download_all(&reads)?.into_iter();
        let mut counts = counts.into_iter();
        for (_, fs, _) in &mut formed {
            for (_, c) in fs {
                *c = copies.by_ref().take(counts.next().unwrap_or(0)).collect();
            }
        }
        tasks::map(&self.device, formed, |f| self.finish_layer(&ctx, f))
    }

    /// A layer of [`KronOptimizer::refresh_layers`] from its formed factors: their scalars
    /// (from the host copies where they are refreshed on the host), dampings at the current
    /// `ρ`, and inverses.
    fn finish_layer(
        &self,
        ctx: &Ctx<'_>,
        (l, [(fl, hl), (fg, hg)], [mut cl, mut cg]): FormedLayer<'_>,
    ) -> Result<(KronLayerState, [KronCounters; 2])> {
        let old = self.st.layers.get(l);
        let (fl, sl, tl) = ctx.refreshed(fl, hl, &mut cl)?;
        let (fg, sg, tg) = ctx.refreshed(fg, hg, &mut cg)?;
        let (dl, dg) = factor_dampings(&self.config, self.st.rho, sl, sg);
        let (il, ig) = tasks::join(
            ctx.device,
            || {
                ctx.inverse(
                    fl.arg(),
                    dl,
                    known_norm(sl.norm),
                    old.and_then(|o| o.lambda.warm_start()),
                    &mut cl,
                )
            },
            || {
                ctx.inverse(
                    fg.arg(),
                    dg,
                    known_norm(sg.norm),
                    old.and_then(|o| o.gamma.warm_start()),
                    &mut cg,
                )
            },
        )?;
        let layer = KronLayerState {
            lambda: il.with_factor((fl, sl, tl))?,
            gamma: ig.with_factor((fg, sg, tg))?,
        };
        Ok((layer, [cl, cg]))
    }

    /// Layer `l` of a spread refresh on this rank: its factors blended from the reduced
    /// Gram matrices `grams` (`[Λ, Γ]`) here, as its owner did, and the rest as the owner
    /// sent it (`packed`: [`packed`] of `Λ` then of `Γ`).
    fn received_layer(
        &self,
        grams: &[Matrix; 2],
        packed: &[f32],
        l: usize,
    ) -> Result<(KronLayerState, [KronCounters; 2])> {
        let ctx = Ctx {
            device: &self.device,
            cfg: &self.config,
        };
        let old = self.st.layers.get(l);
        let (o, i) = self.shapes[l];
        let (pl, pg) = packed.split_at(packed_len(i));
        let factor = |gram, old, packed: &[f32], n| -> Result<(KronFactorState, KronCounters)> {
            let f = ctx.blended_gram(gram, old)?;
            let t = n * (n + 1) / 2;
            let inverse = self
                .device
                .upload(n, n, &dist::from_lower_triangle(&packed[..t], n)?)?;
            let [damping, norm, trace] = [packed[t], packed[t + 1], packed[t + 2]];
            let counts = std::array::from_fn(|k| packed[t + 3 + k] as u64);
            let scalars = FactorScalars {
                dim: n,
                norm,
                trace,
            };
            let at = t + 3 + counts.len();
            let top = match packed[at] {
                0.0 => None,
                _ => Some(self.device.upload(n, 1, &packed[at + 1..at + 1 + n])?),
            };
            let state = InverseUpdate::new(inverse, damping, None, None).with_factor((
                Refreshed::Formed(f, None, None),
                scalars,
                top,
            ))?;
            Ok((state, KronCounters::from_values(counts)))
        };
        let (lambda, cl) = factor(&grams[0], old.map(|o| &o.lambda), pl, i)?;
        let (gamma, cg) = factor(&grams[1], old.map(|o| &o.gamma), pg, o)?;
        Ok((KronLayerState { lambda, gamma }, [cl, cg]))
    }

    /// A data-parallel refresh's inversions with [`Inversions::Spread`]: this rank refreshes
    /// the layers it owns ([`dist::owners`] by `d_in³ + d_out³`) from the reduced Gram
    /// matrices in `stats`, and every rank receives every layer's results from its owner
    /// ([`DataParallel::exchange`]), one [`packed`] per factor. `None` (nothing moves)
    /// unless the call refreshes data-parallel with `Spread`. Outside the CPU pool: a rank
    /// waiting in a collective must not hold a pool worker that another rank's thread of the
    /// same process needs ([`dist::Threads`]).
    fn spread_inversions(
        &self,
        op: &'static str,
        stats: Option<StatsIn<'_, '_>>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let (Some(dp), Some(stats @ StatsIn::Grams(_))) = (&self.dp, stats) else {
            return Ok(None);
        };
        if dp.inversions() != Inversions::Spread {
            return Ok(None);
        }
        let cube = |n: usize| (n as f64).powi(3);
        let costs: Vec<f64> = self
            .shapes
            .iter()
            .map(|&(o, i)| cube(i) + cube(o))
            .collect();
        let owners = dist::owners(&costs, dp.comm().size());
        let rank = dp.comm().rank();
        let lens: Vec<usize> = self
            .shapes
            .iter()
            .map(|&(o, i)| packed_len(i) + packed_len(o))
            .collect();
        let mine = crate::cpu::on_pool(self.pool_work(), || {
            let ours: Vec<usize> = (0..owners.len()).filter(|&l| owners[l] == rank).collect();
            let (layers, _) = self
                .device
                .deferred(|| self.refresh_layers(stats, ours.clone()))?;
            layers
                .iter()
                .map(|(layer, [cl, cg])| {
                    let mut v = packed(&layer.lambda, cl)?;
                    v.extend(packed(&layer.gamma, cg)?);
                    Ok(v)
                })
                .collect()
        });
        dp.exchange(op, &owners, &lens, mine).map(Some)
    }

    /// The matrices layer `l` uses under `plan`.
    fn view<'a>(&'a self, plan: &'a Plan, l: usize) -> Result<LayerView<'a>> {
        let (layer, ups, low_rank) = match plan {
            Plan::Refresh(layers, lr) => (&layers[l], None, *lr),
            Plan::Lazy(ups, lr) => (&self.st.layers[l], Some(&ups[l]), *lr),
        };
        let pick = |s: &'a KronFactorState, u: Option<&'a Retarget>| match u {
            Some(u) => u.view(s, low_rank),
            None => formed_view(s, low_rank),
        };
        let (lambda_inv, dl) = pick(&layer.lambda, ups.map(|u| &u[0]))?;
        let (gamma_inv, dg) = pick(&layer.gamma, ups.map(|u| &u[1]))?;
        let identity = |s: &KronFactorState, x: &InverseView<'_>, damping: f32| {
            let formed = matches!(x, InverseView::Dense { formed: true, .. });
            by_identity(&self.device, &self.config, s, damping, formed)
        };
        Ok(LayerView {
            lambda: &layer.lambda,
            gamma: &layer.gamma,
            identity: (
                identity(&layer.lambda, &lambda_inv, dl),
                identity(&layer.gamma, &gamma_inv, dg),
            ),
            lambda_inv,
            gamma_inv,
            damping: (dl, dg),
        })
    }

    /// `P_l = Γ̃⁻¹ G_l Λ̃⁻¹` for every layer (and the model terms when `with_model`),
    /// rejecting a non-finite result.
    /// `grads` with the planes their check wrote ([`KronOptimizer::check_inputs`]).
    fn preconditioned(
        &self,
        plan: &Plan,
        (grads, splits): (&[KronGrad<'_>], &[[SplitCache; 2]]),
        with_model: bool,
        output_change: Option<(usize, f32)>,
        spare: Vec<Matrix>,
    ) -> Result<Vec<Preconditioned>> {
        let mut spare = spare.into_iter();
        let layers = grads
            .iter()
            .zip(splits)
            .enumerate()
            .map(|(l, (&g, s))| (l, g, s, spare.next()))
            .collect();
        tasks::map(&self.device, layers, |(l, g, s, spare)| {
            let view = self.view(plan, l)?;
            let change = output_change.filter(|&(k, _)| k == l).map(|(_, a)| a);
            factored::precondition(&self.device, &view, (g, s), (with_model, change), spare)
        })
    }

    /// Installs `plan` and the counters and advances the step counter.
    fn commit(&mut self, plan: Plan, counters: KronCounters) {
        match plan {
            Plan::Refresh(layers, _) => self.st.layers = layers,
            Plan::Lazy(ups, _) => {
                for (layer, [ul, ug]) in self.st.layers.iter_mut().zip(ups) {
                    ul.apply(&mut layer.lambda);
                    ug.apply(&mut layer.gamma);
                }
            }
        }
        self.st.counters = counters;
        self.st.steps += 1;
    }
}

/// A restored warm start of RING's power iteration ([`KronFactorState::top`]) is what the
/// kernel devices take as it is: `n x 1`, finite, of unit norm (to `1e-3`; the iterations
/// leave it so to `f32` rounding).
fn check_top(top: &Matrix, n: usize) -> Result<()> {
    const OP: &str = "KronOptimizer::restore";
    check_shape(OP, "top", top.shape(), (n, 1))?;
    let v = top.to_vec()?;
    let norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    check_value(
        OP,
        "top",
        norm,
        (norm - 1.0).abs() <= 1e-3,
        "a unit vector (its norm within 1e-3 of 1)",
    )
}

/// The layers' results of [`KronOptimizer::plan`]'s tasks, their two factors' counters added
/// to `c` in layer order.
fn tally<T>(done: Vec<(T, [KronCounters; 2])>, c: &mut KronCounters) -> Vec<T> {
    done.into_iter()
        .map(|(layer, counts)| {
            counts.iter().for_each(|n| c.add(n));
            layer
        })
        .collect()
}

/// The predicted change `q` as `f32`, or [`Error::NonFinite`] when the step overflows: a
/// numerical failure of this batch (not a bad argument), so callers can skip it and call
/// [`KronOptimizer::reject_step`] to raise the damping.
fn check_predicted(op: &'static str, q: f64) -> Result<f32> {
    let q = q as f32;
    if q.is_finite() {
        Ok(q)
    } else {
        Err(Error::NonFinite {
            op,
            arg: "predicted change (the step overflows)",
            index: 0,
            value: q,
        })
    }
}

/// Whether a call's inverses may be taken through the factors' rows (`low_rank.rs`): its
/// gradients all come by their batch factors, the form that route multiplies (a dense
/// gradient keeps the dense inverses, so their caches stay the dense route's).
fn low_rank(grads: &[KronGrad<'_>]) -> bool {
    grads
        .iter()
        .all(|g| matches!(g.parts(), Parts::Factored(_)))
}

/// A call's gradients and statistics as its body uses them: the data-parallel reduction's
/// where there is one (`gathered`: its statistics rows, [`Reduced::stats`]), else the
/// caller's.
fn inputs<'s>(
    reduced: Option<&'s Reduced>,
    gathered: Option<&'s [KronStats<'s>]>,
    grads: &'s [KronGrad<'s>],
    stats: Option<&'s [KronStats<'s>]>,
) -> (Vec<KronGrad<'s>>, Option<StatsIn<'s, 's>>) {
    let Some(r) = reduced else {
        return (grads.to_vec(), stats.map(StatsIn::Rows));
    };
    let grads = match (&r.grads, &r.grad_rows) {
        (Some(gs), _) => gs.iter().map(KronGrad::Dense).collect(),
        (None, Some(rows)) => rows
            .iter()
            .map(|(e, a)| KronGrad::Factored { e, a })
            .collect(),
        (None, None) => grads.to_vec(),
    };
    let stats = match (gathered, &r.grams) {
        (Some(s), _) => Some(StatsIn::Rows(s)),
        (None, Some(g)) => Some(StatsIn::Grams(g)),
        (None, None) => None,
    };
    (grads, stats)
}

/// Dense [`KronGrad`]s of plain gradient matrices.
fn dense<'a>(grads: &[&'a Matrix]) -> Vec<KronGrad<'a>> {
    grads.iter().map(|&g| KronGrad::Dense(g)).collect()
}

/// `stats` with a spread refresh's results ([`KronOptimizer::spread_inversions`]) where
/// there are some.
fn with_received<'s, 'a>(
    stats: Option<StatsIn<'s, 'a>>,
    received: Option<&'s [Vec<f32>]>,
) -> Option<StatsIn<'s, 'a>> {
    match (stats, received) {
        (Some(StatsIn::Grams(g)), Some(r)) => Some(StatsIn::Spread(g, r)),
        (s, _) => s,
    }
}

/// What a spread refresh sends of one refreshed factor `s` (`n x n`) with its counters `c`:
/// the inverse's lower triangle (`n(n+1)/2` values; exactly symmetric from the CPU's
/// Cholesky), then the damping, norm and trace, then the counts, then RING's warm start
/// ([`KronFactorState::top`]: a flag and `n` values; [`packed_len`] in all).
/// One refresh's counts of one factor are at most Newton's iteration budget, far below
/// `2²⁴`: exact in `f32`.
fn packed(s: &KronFactorState, c: &KronCounters) -> Result<Vec<f32>> {
    let n = s.dim();
    let mut v = dist::lower_triangle(&s.dense_inverse()?.to_vec()?, n);
    v.extend([s.damping, s.norm, s.trace]);
    v.extend(c.values().map(|x| x as f32));
    // RING's warm start, so that the owner's next refresh of the layer starts where a
    // process refreshing every layer would: a flag, then `n` values (zeros without one).
    match &s.top {
        Some(top) => {
            v.push(1.0);
            v.extend(top.to_vec()?);
        }
        None => v.extend(std::iter::repeat_n(0.0, n + 1)),
    }
    Ok(v)
}

/// [`packed`]'s length for an `n x n` factor.
fn packed_len(n: usize) -> usize {
    n * (n + 1) / 2 + 3 + KronCounters::default().values().len() + 1 + n
}
