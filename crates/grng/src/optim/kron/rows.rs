//! The statistics rows a factor is replaced from, as its SYRK read them, and the factor they
//! form: shared by the layer's refresh (`layer.rs`) and the rows' route (`low_rank.rs`).

use half::bf16;

use crate::device::{Device, Matrix};
use crate::error::Result;
use crate::optim::StatsView;

/// The statistics rows of a factor as its SYRK read them (`layer::Ctx::factor`): the low-rank
/// inverse must invert the same factor, so `f32` rows rounded to `bf16` by
/// [`KronConfig::stats_precision`](super::KronConfig::stats_precision) are kept rounded.
pub(crate) enum Rows<'x> {
    /// The caller's statistics, as given.
    Given(StatsView<'x>),
    /// `f32` statistics rounded to `bf16`.
    Rounded(Matrix<bf16>),
}

impl Rows<'_> {
    pub(crate) fn view(&self) -> StatsView<'_> {
        match self {
            Rows::Given(x) => *x,
            Rows::Rounded(x) => StatsView::Bf16(x),
        }
    }
}

/// `F = (1/m) xᵀx` of rows replacing a factor: `layer::Ctx::factor`'s formed route, and what a
/// factor left to its rows is formed with (so the same bits).
pub(super) fn replaced_factor(d: &Device, rows: &Rows<'_>) -> Result<Matrix> {
    let n = rows.view().shape().1;
    // ε = 0: the update writes every element and reads none.
    let mut f = d.scratch(n, n)?;
    factor_update(d, rows, 0.0, &mut f)?;
    Ok(f)
}

/// `f ← ε f + (1−ε)(1/m) xᵀx` for the rows `x` (`m x n`), which the update checks.
pub(super) fn factor_update(d: &Device, rows: &Rows<'_>, eps: f32, f: &mut Matrix) -> Result<()> {
    match rows.view() {
        StatsView::F32(x) => d.syrk_ema(x, eps, f),
        StatsView::Bf16(x) => d.syrk_ema(x, eps, f),
    }
}
