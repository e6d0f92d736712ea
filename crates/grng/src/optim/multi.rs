//! The scaffold the element-wise optimizers ([`Sgd`](super::sgd::Sgd),
//! [`AdamW`](super::adamw::AdamW), [`Sophia`](super::sophia::Sophia)) share.
//!
//! The three differ only in their config, their fused device update and the names of their
//! state arrays; everything around that — the config check on construction and on
//! `set_config`, the parameter-count check, the per-tensor [`MultiState`] (shapes, offsets,
//! state arrays), the step counter, the host copy of the state and the validated, atomic
//! restore — is written once here as [`Tensors`], a struct each optimizer wraps. A struct
//! (rather than a public trait or a generic optimizer type) keeps the optimizers' public API
//! exactly as it was and the state private: each keeps its own documented methods, which
//! forward here in one line, and the accessors that are the same word for word are generated
//! by [`tensor_accessors!`].

use crate::cpu::elementwise::check_nonnegative;
use crate::device::{Device, Matrix};
use crate::dist::{self, DataParallel};
use crate::error::{check_finite, check_len, check_shape, Error, Result};
use crate::ops::elementwise::MultiState;

/// The accessors every element-wise optimizer `$opt` (a struct whose `inner` is a
/// [`Tensors`] of `$config`) has alike: `n`, `shapes`, `steps`, `config`.
macro_rules! tensor_accessors {
    ($opt:ident, $config:ty) => {
        impl $opt {
            /// Number of parameters `n` (over all tensors).
            pub fn n(&self) -> usize {
                self.inner.n()
            }

            /// The parameter tensors' shapes.
            pub fn shapes(&self) -> &[(usize, usize)] {
                self.inner.shapes()
            }

            /// Completed steps.
            pub fn steps(&self) -> u64 {
                self.inner.steps()
            }

            /// The configuration in use.
            pub fn config(&self) -> &$config {
                self.inner.config()
            }

            /// Makes the steps data-parallel over a communicator (or single-process again
            /// with `None`): each step's gradients are averaged over the ranks by their rows
            /// ([`DataParallel`](crate::dist::DataParallel)) before the update, so every
            /// rank takes the step of the concatenated batch.
            pub fn set_data_parallel(&mut self, dp: Option<crate::dist::DataParallel>) {
                self.inner.dp = dp;
            }

            /// The data-parallel setting, to set this rank's rows for the coming steps.
            pub fn data_parallel_mut(&mut self) -> Option<&mut crate::dist::DataParallel> {
                self.inner.dp.as_mut()
            }
        }
    };
}
pub(crate) use tensor_accessors;

/// An element-wise optimizer's config: checked on construction and on every replacement.
pub(crate) trait Validate {
    /// `Err(Error::Value)` naming the first field outside its documented range.
    fn validate(&self) -> Result<()>;
}

/// One host state array of a restore: its name in errors, its values (all tensors
/// concatenated in order) and whether every entry must be `≥ 0`.
pub(crate) struct HostArray<'a> {
    name: &'static str,
    values: &'a [f32],
    nonnegative: bool,
}

impl<'a> HostArray<'a> {
    /// An array of any finite values.
    pub(crate) fn finite(name: &'static str, values: &'a [f32]) -> Self {
        Self {
            name,
            values,
            nonnegative: false,
        }
    }

    /// An array of finite values `≥ 0`.
    pub(crate) fn nonnegative(name: &'static str, values: &'a [f32]) -> Self {
        Self {
            name,
            values,
            nonnegative: true,
        }
    }
}

/// The device state, config and step counter of an optimizer over many parameter tensors.
#[derive(Debug)]
pub(crate) struct Tensors<C> {
    device: Device,
    config: C,
    /// The per-tensor layout and the optimizer's state arrays.
    state: MultiState,
    steps: u64,
    /// Data-parallel steps: the gradients averaged over the ranks first.
    pub(crate) dp: Option<DataParallel>,
}

impl<C: Validate> Tensors<C> {
    /// Zero state with `arrays` state arrays for tensors of `shapes`, after checking `config`
    /// and that there is at least one parameter (`Error::Shape` naming `op` otherwise).
    pub(crate) fn new(
        op: &'static str,
        device: &Device,
        shapes: &[(usize, usize)],
        config: C,
        arrays: usize,
    ) -> Result<Self> {
        config.validate()?;
        check_n(op, total_len(shapes))?;
        Ok(Self {
            device: device.clone(),
            config,
            state: MultiState::new(device, shapes, arrays)?,
            steps: 0,
            dp: None,
        })
    }

    /// Runs `update(device, state, config, t)` for step `t` (1-based) and counts the step
    /// when it succeeds (the update leaves everything unchanged on error).
    pub(crate) fn step(
        &mut self,
        update: impl FnOnce(&Device, &mut MultiState, &C, u64) -> Result<()>,
    ) -> Result<()> {
        let t = self.steps.saturating_add(1);
        update(&self.device, &mut self.state, &self.config, t)?;
        self.steps = t;
        Ok(())
    }

    /// The lists a step averages over the ranks when data-parallel (`None` otherwise):
    /// `grads` unless they come reduced, then `also` (Sophia's Hessian sample with its own
    /// weight). Returns the means, in that order, with their total weights. `pre` is the
    /// step's own checks so far and `params` its parameters, checked against the shapes: a
    /// failure on any rank fails the call on every rank before anything moves.
    pub(crate) fn reduced(
        &self,
        op: &'static str,
        pre: Result<()>,
        params: &[&mut Matrix],
        grads: &[&Matrix],
        also: Option<(&'static str, &[&Matrix], usize)>,
    ) -> Result<Option<dist::TensorMeans>> {
        let Some(dp) = &self.dp else {
            return Ok(None);
        };
        let shapes = self.shapes();
        let mut lists = Vec::new();
        if !dp.grads_reduced() {
            lists.push(dist::Tensors {
                arg: "grads",
                tensors: grads,
                shapes,
                weight: dp.rows(),
            });
        }
        if let Some((arg, tensors, weight)) = also {
            lists.push(dist::Tensors {
                arg,
                tensors,
                shapes,
                weight,
            });
        }
        let pre = pre.and_then(|()| {
            check_shape(op, "params", (params.len(), 1), (shapes.len(), 1))?;
            for (p, &shape) in params.iter().zip(shapes) {
                self.device.check_on(op, p)?;
                check_shape(op, "params", p.shape(), shape)?;
            }
            Ok(())
        });
        dist::reduce_tensors(dp, op, &self.device, pre, &lists).map(Some)
    }

    /// [`Tensors::step`] given the step's gradients: `grads`, or when data-parallel their
    /// mean over the ranks ([`Tensors::reduced`]).
    pub(crate) fn step_with_grads(
        &mut self,
        op: &'static str,
        params: &mut [&mut Matrix],
        grads: &[&Matrix],
        update: impl FnOnce(
            &Device,
            &mut MultiState,
            &C,
            u64,
            &mut [&mut Matrix],
            &[&Matrix],
        ) -> Result<()>,
    ) -> Result<()> {
        let reduced = self.reduced(op, Ok(()), params, grads, None)?;
        let means: Vec<&Matrix>;
        let grads = match reduced.as_deref() {
            Some([(g, _), ..]) => {
                means = g.iter().collect();
                &means
            }
            _ => grads,
        };
        self.step(|d, s, c, t| update(d, s, c, t, params, grads))
    }

    /// `‖g‖₂` of the last step's gradients ([`MultiState::last_grad_sq`]).
    pub(crate) fn last_grad_norm(&self) -> Option<f32> {
        self.state.last_grad_sq().map(|s| s.sqrt() as f32)
    }

    /// Number of parameters over all tensors.
    pub(crate) fn n(&self) -> usize {
        self.state.layout().total()
    }

    /// The parameter tensors' shapes.
    pub(crate) fn shapes(&self) -> &[(usize, usize)] {
        self.state.shapes()
    }

    /// Completed steps.
    pub(crate) fn steps(&self) -> u64 {
        self.steps
    }

    /// The configuration in use.
    pub(crate) fn config(&self) -> &C {
        &self.config
    }

    /// Replaces the configuration after checking it (the old one stays on error).
    pub(crate) fn set_config(&mut self, config: C) -> Result<()> {
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// Flat state array `a` on the device.
    pub(crate) fn array(&self, a: usize) -> &Matrix {
        self.state.state(a)
    }

    /// State array `a` on the host, the tensors concatenated in order.
    pub(crate) fn to_host(&self, a: usize) -> Result<Vec<f32>> {
        self.state.to_host(a)
    }

    /// Replaces the state arrays (in order) by `arrays` and the step counter by `steps`,
    /// after checking (in this order) every array's length, then its finiteness, then the
    /// signs of those that must be `≥ 0`; errors name `op` and the array. Unchanged on error:
    /// one array is replaced by [`MultiState::load`]'s single upload; several all go into a
    /// fresh state that replaces the old one only once every upload succeeded.
    pub(crate) fn restore(
        &mut self,
        op: &'static str,
        arrays: &[HostArray<'_>],
        steps: u64,
    ) -> Result<()> {
        let n = self.n();
        for a in arrays {
            check_len(op, a.name, a.values.len(), n)?;
        }
        for a in arrays {
            check_finite(op, a.name, a.values)?;
        }
        for a in arrays.iter().filter(|a| a.nonnegative) {
            check_nonnegative(op, a.name, a.values)?;
        }
        if let [a] = arrays {
            self.state.load(&self.device, 0, a.values)?;
        } else {
            let mut next = MultiState::new(&self.device, self.state.shapes(), arrays.len())?;
            for (i, a) in arrays.iter().enumerate() {
                next.load(&self.device, i, a.values)?;
            }
            self.state = next;
        }
        self.steps = steps;
        Ok(())
    }
}

/// The error of a one-tensor step as the single-vector API reports it: a
/// [`Error::NonFiniteTensor`] of tensor 0 becomes [`Error::NonFinite`] at the same index.
pub(crate) fn one_tensor(e: Error) -> Error {
    match e {
        Error::NonFiniteTensor {
            op,
            arg,
            index,
            value,
            ..
        } => Error::NonFinite {
            op,
            arg,
            index,
            value,
        },
        e => e,
    }
}

/// Elements in tensors of `shapes` (saturating: an impossible size then fails to allocate).
fn total_len(shapes: &[(usize, usize)]) -> usize {
    shapes
        .iter()
        .fold(0usize, |n, &(r, c)| n.saturating_add(r.saturating_mul(c)))
}

/// `Err(Error::Shape)` unless the parameter count is at least 1.
fn check_n(op: &'static str, n: usize) -> Result<()> {
    if n == 0 {
        return Err(Error::Shape {
            op,
            arg: "n",
            expected: "at least 1 parameter".into(),
            got: "0".into(),
        });
    }
    Ok(())
}
