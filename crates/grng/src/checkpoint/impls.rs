//! [`Checkpoint`] for every optimizer and a trainer's ChaCha8 stream (the reference MLP and
//! trainer save themselves in `grng-train`, beside their private state).
//!
//! Each object writes a `kind` tag first, then its records; loading checks the tag, reads and
//! checks every record into a host-side state, and only then installs it through the object's
//! own validating `restore` (which commits nothing on error). Errors from that `restore` are
//! re-wrapped as [`Error::Checkpoint`] naming the scope.
//!
//! | object          | kind       | records                                                        |
//! |-----------------|------------|----------------------------------------------------------------|
//! | [`Sgd`]         | `sgd`      | `steps` u64, `momentum` `[n]`                                  |
//! | [`AdamW`]       | `adamw`    | `steps` u64, `m` `[n]`, `v` `[n]`                              |
//! | [`Sophia`]      | `sophia`   | `steps` u64, `m` `[n]`, `h` `[n]`                              |
//! | [`RKalman`]     | `rkalman`  | `steps` u64, `mu` `[n]`, `sigma` `[n]`, `r` `[d_o, d_o]`      |
//! | [`KronOptimizer`] | `kron`   | `variant`, `layer_shapes` u64s, `rho`, `steps`, `predicted`, `last_ratio`, `counters.*`, `factored_layers`, `layer{l}.{lambda,gamma}.{factor,inverse}` `[n, n]`, `.{damping,inverse_norm,norm,trace}`, RING's `.top` `[n]` |
//! | [`ChaCha8Rng`]  | `chacha8`  | `seed` 32 bytes, `stream` u64, `word_pos` u64s `[lo, hi]`      |
//!
//! `kron`'s `counters.low_rank_inversions` may be absent (checkpoints written before that
//! counter existed): it then loads as 0. A RING factor's `top` `[n]` (its power iteration's
//! warm start) is written when the factor keeps one, and may be absent.
//!
//! A Kronecker factor's `inverse` and `damping` are the inverse `X₀` as formed and its damping
//! `λ₀` (lazy steps derive theirs from them); its cached square `X₀·X₀` is not stored: the
//! loaded optimizer forms it again, bit for bit, when a lazy step needs it.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::{Checkpoint, Reader, Writer};
use crate::error::{Error, Result};
use crate::optim::adamw::{AdamW, AdamWState};
use crate::optim::kalman::{RKalman, RKalmanState};
use crate::optim::kron::{
    KronCounters, KronFactorState, KronLayerState, KronOptimizer, KronState, KronVariant,
};
use crate::optim::sgd::{Sgd, SgdState};
use crate::optim::sophia::{Sophia, SophiaState};

impl Checkpoint for Sgd {
    fn save(&self, w: &mut Writer) -> Result<()> {
        let s = self.state()?;
        save_elementwise(w, "sgd", s.steps, [("momentum", &s.momentum)])
    }

    fn load(&mut self, r: &Reader) -> Result<()> {
        let (steps, [momentum]) = load_elementwise(r, "sgd", self.n(), ["momentum"])?;
        let state = SgdState { steps, momentum };
        self.restore(&state).map_err(|e| r.wrap_restore(e))
    }
}

impl Checkpoint for AdamW {
    fn save(&self, w: &mut Writer) -> Result<()> {
        let s = self.state()?;
        save_elementwise(w, "adamw", s.steps, [("m", &s.m), ("v", &s.v)])
    }

    fn load(&mut self, r: &Reader) -> Result<()> {
        let (steps, [m, v]) = load_elementwise(r, "adamw", self.n(), ["m", "v"])?;
        let state = AdamWState { steps, m, v };
        self.restore(&state).map_err(|e| r.wrap_restore(e))
    }
}

impl Checkpoint for Sophia {
    fn save(&self, w: &mut Writer) -> Result<()> {
        let s = self.state()?;
        save_elementwise(w, "sophia", s.steps, [("m", &s.m), ("h", &s.h)])
    }

    fn load(&mut self, r: &Reader) -> Result<()> {
        let (steps, [m, h]) = load_elementwise(r, "sophia", self.n(), ["m", "h"])?;
        let state = SophiaState { steps, m, h };
        self.restore(&state).map_err(|e| r.wrap_restore(e))
    }
}

/// The records of an element-wise optimizer ([`Sgd`], [`AdamW`], [`Sophia`]): its `kind`,
/// `steps` and each named state array (`[n]`, all tensors concatenated), in order.
fn save_elementwise<const K: usize>(
    w: &mut Writer,
    kind: &str,
    steps: u64,
    arrays: [(&str, &[f32]); K],
) -> Result<()> {
    w.str("kind", kind)?;
    w.u64("steps", steps)?;
    for (name, values) in arrays {
        w.tensor(name, &[values.len()], values)?;
    }
    Ok(())
}

/// Reads back what [`save_elementwise`] wrote for an optimizer of `n` parameters: `steps`
/// and the state arrays of `names`, in order (the first error wins).
fn load_elementwise<const K: usize>(
    r: &Reader,
    kind: &str,
    n: usize,
    names: [&str; K],
) -> Result<(u64, [Vec<f32>; K])> {
    r.expect_kind(kind)?;
    let steps = r.u64("steps")?;
    let mut arrays = names.map(|_| Vec::new());
    for (array, name) in arrays.iter_mut().zip(names) {
        *array = crate::error::try_to_vec(r.tensor(name, &[n])?)?;
    }
    Ok((steps, arrays))
}

impl Checkpoint for RKalman {
    fn save(&self, w: &mut Writer) -> Result<()> {
        let s = self.state()?;
        let d_o = self.d_o();
        w.str("kind", "rkalman")?;
        w.u64("steps", s.steps)?;
        w.tensor("mu", &[s.mu.len()], &s.mu)?;
        w.tensor("sigma", &[s.sigma.len()], &s.sigma)?;
        w.tensor("r", &[d_o, d_o], &s.r)
    }

    fn load(&mut self, r: &Reader) -> Result<()> {
        r.expect_kind("rkalman")?;
        let (n, d_o) = (self.n(), self.d_o());
        let state = RKalmanState {
            steps: r.u64("steps")?,
            mu: crate::error::try_to_vec(r.tensor("mu", &[n])?)?,
            sigma: crate::error::try_to_vec(r.tensor("sigma", &[n])?)?,
            r: crate::error::try_to_vec(r.tensor("r", &[d_o, d_o])?)?,
        };
        self.restore(&state).map_err(|e| r.wrap_restore(e))
    }
}

fn variant_name(v: KronVariant) -> &'static str {
    match v {
        KronVariant::Ring => "ring",
        KronVariant::Reng => "reng",
        KronVariant::Ngd => "ngd",
    }
}

const FACTOR_SCALARS: [&str; 4] = ["damping", "inverse_norm", "norm", "trace"];

impl Checkpoint for KronOptimizer {
    fn save(&self, w: &mut Writer) -> Result<()> {
        let s = self.state()?;
        w.str("kind", "kron")?;
        w.str("variant", variant_name(self.config().variant))?;
        let shapes: Vec<u64> = self
            .layer_shapes()
            .iter()
            .flat_map(|&(o, i)| [o as u64, i as u64])
            .collect();
        w.u64s("layer_shapes", &shapes)?;
        w.f32("rho", s.rho)?;
        w.u64("steps", s.steps)?;
        w.opt_f32("predicted", s.predicted)?;
        w.opt_f32("last_ratio", s.last_ratio)?;
        w.u64_scope("counters", &s.counters.named())?;
        w.u64("factored_layers", s.layers.len() as u64)?;
        for (l, layer) in s.layers.iter().enumerate() {
            w.scope(&format!("layer{l}"), |w| {
                for (side, f) in [("lambda", &layer.lambda), ("gamma", &layer.gamma)] {
                    w.scope(side, |w| {
                        let n = f.factor.rows();
                        w.tensor("factor", &[n, n], &f.factor.to_vec()?)?;
                        w.tensor("inverse", &[n, n], &f.inverse.to_vec()?)?;
                        let vals = [f.damping, f.inverse_norm, f.norm, f.trace];
                        for (name, v) in FACTOR_SCALARS.iter().zip(vals) {
                            w.f32(name, v)?;
                        }
                        if let Some(top) = f.top() {
                            w.tensor("top", &[n], &top.to_vec()?)?;
                        }
                        Ok(())
                    })?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    fn load(&mut self, r: &Reader) -> Result<()> {
        r.expect_kind("kron")?;
        let want = variant_name(self.config().variant);
        let got = r.str("variant")?;
        if got != want {
            return Err(Error::Checkpoint(format!(
                "`variant`: the checkpoint holds {got} state, this optimizer is {want}"
            )));
        }
        let shapes = self.layer_shapes().to_vec();
        let flat: Vec<u64> = shapes
            .iter()
            .flat_map(|&(o, i)| [o as u64, i as u64])
            .collect();
        let stored = r.u64s("layer_shapes")?;
        if stored != flat.as_slice() {
            return Err(Error::Checkpoint(format!(
                "`layer_shapes`: the checkpoint has (d_out, d_in) pairs {stored:?}, this optimizer {flat:?}"
            )));
        }
        // The names `save` wrote (`KronCounters::named`). Absent from checkpoints written
        // before the counter existed: `low_rank_inversions`, loaded as 0.
        let names = KronCounters::default().named().map(|(name, _)| name);
        let counters =
            KronCounters::from_values(r.u64_scope("counters", names, &["low_rank_inversions"])?);
        let factored = r.usize("factored_layers")?;
        if factored != 0 && factored != shapes.len() {
            return Err(Error::Checkpoint(format!(
                "`factored_layers` = {factored}, expected 0 or {}",
                shapes.len()
            )));
        }
        let device = self.device().clone();
        let mut layers = Vec::with_capacity(factored);
        for (l, &(o, i)) in shapes.iter().enumerate().take(factored) {
            let lr = r.scope(&format!("layer{l}"));
            let factor = |side: &str, n: usize| -> Result<KronFactorState> {
                let fr = lr.scope(side);
                let f = fr.tensor("factor", &[n, n])?;
                let x = fr.tensor("inverse", &[n, n])?;
                // Absent for a factor without one (and in checkpoints written before RING
                // kept it: the next refresh then starts its power iteration cold).
                let top = match fr.contains("top") {
                    true => Some(device.upload(n, 1, fr.tensor("top", &[n])?)?),
                    false => None,
                };
                Ok(KronFactorState {
                    factor: device.upload(n, n, f)?,
                    inverse: device.upload(n, n, x)?,
                    damping: fr.f32("damping")?,
                    inverse_norm: fr.f32("inverse_norm")?,
                    norm: fr.f32("norm")?,
                    trace: fr.f32("trace")?,
                    top,
                    // Not stored: the loaded optimizer forms X₀·X₀ again at its first lazy
                    // step that needs it (the same product of the same X₀: the same bits).
                    square: None,
                    retargeted: None,
                    low_rank: None,
                    splits: Default::default(),
                    host_factor: None,
                })
            };
            layers.push(KronLayerState {
                lambda: factor("lambda", i)?,
                gamma: factor("gamma", o)?,
            });
        }
        let state = KronState {
            rho: r.f32("rho")?,
            steps: r.u64("steps")?,
            predicted: r.opt_f32("predicted")?,
            last_ratio: r.opt_f32("last_ratio")?,
            counters,
            layers,
        };
        self.restore(state).map_err(|e| r.wrap_restore(e))
    }
}

/// ChaCha's block counter is 64 bits of 16-word blocks: positions are below `2^68`.
const WORD_POS_LIMIT: u128 = 1 << 68;

impl Checkpoint for ChaCha8Rng {
    fn save(&self, w: &mut Writer) -> Result<()> {
        let pos = self.get_word_pos();
        w.str("kind", "chacha8")?;
        w.bytes("seed", &self.get_seed())?;
        w.u64("stream", self.get_stream())?;
        w.u64s("word_pos", &[pos as u64, (pos >> 64) as u64])
    }

    fn load(&mut self, r: &Reader) -> Result<()> {
        r.expect_kind("chacha8")?;
        let seed: [u8; 32] = r
            .bytes("seed")?
            .try_into()
            .map_err(|_| Error::Checkpoint(format!("`{}seed`: expected 32 bytes", r.prefix)))?;
        let stream = r.u64("stream")?;
        let pos = match r.u64s("word_pos")? {
            &[lo, hi] => (hi as u128) << 64 | lo as u128,
            other => {
                return Err(Error::Checkpoint(format!(
                    "`{}word_pos`: expected [lo, hi], got {} values",
                    r.prefix,
                    other.len()
                )))
            }
        };
        // set_word_pos would silently drop the high bits: reject instead.
        if pos >= WORD_POS_LIMIT {
            return Err(Error::Checkpoint(format!(
                "`{}word_pos` = {pos} is past the end of a ChaCha stream (2^68 words)",
                r.prefix
            )));
        }
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(stream);
        rng.set_word_pos(pos);
        *self = rng;
        Ok(())
    }
}
