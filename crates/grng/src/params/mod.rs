//! The plain-data settings, coefficients and reports the ops hand to the backends and get
//! back from them: [`newton`], [`norm`], [`kalman`], [`elementwise`].
//!
//! **Why here.** The layers call downwards only:
//!
//! ```text
//! optim, checkpoint  →  ops (validation, dispatch)  →  cpu | cuda (arithmetic)
//!                                   ↘                       ↓
//!                               params, iteration  (data; the shared Newton/power driver)
//! ```
//!
//! `ops` validates every argument once and dispatches to a backend; a backend computes.
//! Both need the same option and coefficient types, so those types cannot live in `ops`
//! (a backend importing from the layer that calls it is an import circle: neither side can
//! be read, tested or changed without the other) nor in one backend (the other would then
//! depend on it). So they live here, below both, and depend on nothing but
//! [`crate::error`]. The Newton iteration control and the power iteration, shared by both
//! backends through traits, sit beside them in [`crate::iteration`] for the same reason.
//!
//! The public paths stay those of the ops that take them (`grng::ops::newton::NewtonOptions`,
//! `grng::ops::elementwise::AdamWCoeffs`, …): this module is crate-internal and the ops
//! re-export its types. `tests/layering.rs` keeps the arrows pointing down: it fails, naming
//! the lines, on any import cycle among the modules (docs/architecture.md).

pub mod elementwise;
pub mod kalman;
pub mod newton;
pub mod norm;
