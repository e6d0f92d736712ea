//! Data-parallel steps: every rank holds the whole model and a shard of each batch, and the
//! optimizers reduce what a batch contributes so that every rank takes the step one process
//! would take on the concatenated batch (`docs/distributed.md`).
//!
//! [`Communicator`] is the seam: rank, size, sum all-reduce in place, broadcast, barrier —
//! what the optimizers need from MPI or NCCL, nothing more. Implementations:
//! [`SingleProcess`] (a world of one), [`Threads`] (ranks as threads of one process, on std
//! sync primitives: for tests and for trying the data-parallel path on one machine),
//! `Mpi` (feature `mpi`, rsmpi over the system's Open MPI) and `Nccl` (feature `nccl`,
//! cudarc's binding, loaded at run time). An optimizer takes one through a [`DataParallel`]
//! handle (`set_data_parallel`).
//!
//! # No hang, nothing changed
//! A collective that one rank skips (its inputs failed a check) or calls with another length
//! (its shapes differ) would hang or corrupt every rank. So each reduction of a step starts
//! with a fixed-size agreement: every rank all-reduces, in `f64`, whether its
//! local checks failed and its payload's signature `s` (lengths and shapes, in 20-bit
//! chunks), with their squares. A rank passes when the sums are `P·s` and `P·s²` for its own
//! `s`; if the signatures are not all equal, the mean of the squares exceeds the square of
//! the mean (Cauchy–Schwarz), so no rank can pass: every rank returns a typed error before
//! the payload moves, all ranks having made the same calls. Every step computes into new
//! buffers and commits only after its reductions, so the error leaves every rank unchanged.
//!
//! # Same bits everywhere
//! The ranks' replicas stay equal only if each receives the same reduced bits. MPI's
//! `Allreduce` does not promise that (its algorithm may add in a different order on
//! different ranks), so `Mpi` reduces to rank 0 and broadcasts; [`Threads`] adds in rank
//! order; NCCL's ring gives every rank the same chunks.

/// The [`Communicator`] methods of a transport with fields `rank`, `size` and a generic
/// `sum` (`Mpi`, `Nccl`): written once.
#[cfg(any(feature = "mpi", feature = "nccl"))]
macro_rules! rank_size_sums {
    () => {
        fn rank(&self) -> usize {
            self.rank
        }

        fn size(&self) -> usize {
            self.size
        }

        fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
            self.sum(buf)
        }

        fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
            self.sum(buf)
        }
    };
}

#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod threads;

#[cfg(feature = "mpi")]
pub use self::mpi::Mpi;
#[cfg(feature = "nccl")]
pub use self::nccl::Nccl;
pub use self::threads::Threads;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::device::{Device, Matrix};
use crate::error::{check_finite, check_shape, try_vec, Error, Result};

/// What a data-parallel optimizer needs from a distributed engine. Every rank must make the
/// same calls in the same order with buffers of the same length (the optimizers agree on
/// lengths first, see the module docs).
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This process's rank, `0 ≤ rank < size`.
    fn rank(&self) -> usize;
    /// Number of ranks `P ≥ 1`.
    fn size(&self) -> usize;
    /// `buf ← Σ_p buf_p` on every rank, the same bits on every rank.
    ///
    /// # Errors
    /// [`Error::Communicator`] when the engine fails.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// [`Communicator::all_reduce_sum`] in `f64` (the agreement and the losses).
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_sum`].
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()>;
    /// `buf ← buf_root` on every rank.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_sum`]; [`Error::Value`] for `root ≥ size`.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_sum`].
    fn barrier(&self) -> Result<()>;
}

/// A world of one: every collective is the identity. What an optimizer without a
/// communicator does, as a [`Communicator`] for code written against one.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleProcess;

impl Communicator for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn broadcast(&self, _: &mut [f32], root: usize) -> Result<()> {
        check_root("SingleProcess::broadcast", root, 1)
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

/// `Err(Error::Value)` unless `root < size`.
fn check_root(op: &'static str, root: usize, size: usize) -> Result<()> {
    crate::error::check_value(op, "root", root as f64, root < size, "root < size")
}

/// Where a data-parallel refresh of the Kronecker optimizers (RING, RENG, NGD) inverts each
/// layer's factors (`docs/distributed.md` has the memory, bytes and when each wins).
///
/// Either way every rank forms every factor from the reduced statistics (the state holds
/// them, and the lazy steps between refreshes retarget every inverse on every rank), and
/// every rank ends the refresh with the same state, bit for bit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Inversions {
    /// Every rank inverts every layer's two factors (and, for RING, takes their spectral
    /// norms): identical inputs, identical results, no bytes.
    #[default]
    Everywhere,
    /// KAISA-style: each layer is refreshed on one rank — its factors' norms or traces,
    /// dampings and inverses — and broadcast from there, each inverse as its lower triangle
    /// (`n(n+1)/2` values) with its scalars and counters. Layers go to ranks by their
    /// inversion cost `d_in³ + d_out³`, largest first, each to the rank with the least cost so
    /// far (longest-processing-time first), so a rank's inversions take about `1/min(P, L)`
    /// of all of them. A rank whose inversion fails (a factor that is not positive
    /// definite) fails the refresh on every rank, before anything changes: its own error
    /// there, [`Error::Ranks`] on the others. The statistics then travel as Gram matrices,
    /// never as rows (the rows' routes keep an `m x m` kernel, not the dense inverse every
    /// rank installs).
    ///
    /// The step is the [`Inversions::Everywhere`] step bit for bit where the inverse is
    /// exactly symmetric (the CPU's Cholesky inverse, the default there); a Newton inverse
    /// (symmetric to rounding) travels as its lower triangle, so the step differs from the
    /// `Everywhere` step by that rounding (every rank still holds the same bits).
    Spread,
}

/// An optimizer's data-parallel setting: the communicator, this rank's share of the current
/// batch, whether the gradients it is given are already reduced and where the Kronecker
/// factors are inverted.
///
/// With it, a step reduces the rank's gradient `G_p` (the mean over its `m_p` rows) to
/// `Σ_p m_p G_p / Σ_p m_p` — the mean over the concatenated batch, so ragged shards weigh by
/// their rows — and the optimizer-specific statistics likewise (Kronecker factors by their
/// own row counts, Sophia's Hessian sample by its batch, the Kalman filter's observation
/// rows gathered). Every rank then takes the same step.
#[derive(Clone, Debug)]
pub struct DataParallel {
    comm: Arc<dyn Communicator>,
    rows: usize,
    grads_reduced: bool,
    inversions: Inversions,
    /// Reductions taken part in, shared by the handle's clones (the optimizer's and its
    /// trainer's): [`DataParallel::reductions`].
    reductions: Arc<AtomicU64>,
}

impl DataParallel {
    /// Data-parallel steps over `comm`, each rank's gradient the mean over 1 row until
    /// [`DataParallel::set_rows`] says otherwise.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self {
            comm,
            rows: 1,
            grads_reduced: false,
            inversions: Inversions::Everywhere,
            reductions: Arc::default(),
        }
    }

    /// The gradients given to a step are already the concatenated batch's (the trainer
    /// all-reduced them, e.g. overlapped with its backward pass): the step reduces only the
    /// optimizer's own statistics.
    pub fn with_grads_reduced(mut self) -> Self {
        self.grads_reduced = true;
        self
    }

    /// Where the Kronecker optimizers' refreshes invert the factors ([`Inversions`]; default
    /// [`Inversions::Everywhere`]). Every rank must use the same setting.
    pub fn with_inversions(mut self, inversions: Inversions) -> Self {
        self.inversions = inversions;
        self
    }

    /// Where the Kronecker factors are inverted ([`DataParallel::with_inversions`]).
    pub fn inversions(&self) -> Inversions {
        self.inversions
    }

    /// This rank's rows `m_p` in the coming steps' gradients (the weight of its gradient in
    /// the mean; `0` for a rank without rows this step, whose gradient is then ignored).
    pub fn set_rows(&mut self, rows: usize) {
        self.rows = rows;
    }

    /// This rank's rows in the coming steps' gradients.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Whether the steps' gradients come reduced ([`DataParallel::with_grads_reduced`]).
    pub fn grads_reduced(&self) -> bool {
        self.grads_reduced
    }

    /// The communicator.
    pub fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    /// `values ← Σ_p m_p·values_p / Σ_p m_p` over the ranks (`m_p` their
    /// [`DataParallel::rows`]), after the agreement of the module docs; returns `Σ_p m_p`.
    /// For a trainer's own reductions (a loss, RENG's gradient before its Hessian product).
    ///
    /// # Errors
    /// [`Error::Ranks`] when another rank's call failed or had another length (`values` is
    /// then unchanged), [`Error::Communicator`].
    pub fn all_reduce_mean(&self, op: &'static str, values: &mut [f32]) -> Result<usize> {
        let local = try_vec(values.len(), 1, 0.0f32).map(|mut v| {
            v.copy_from_slice(values);
            vec![Part::Mean(v, self.rows)]
        });
        let r = self.reduce(op, local)?;
        values.copy_from_slice(&r[0].values);
        Ok(r[0].weight)
    }

    /// Takes part in the ranks' coming reduction as a rank whose inputs failed, so that every
    /// other rank's call fails too ([`Error::Ranks`]) instead of waiting for this one: for a
    /// trainer that skips a step (a non-finite loss on its shard) before its optimizer
    /// reduced anything ([`DataParallel::reductions`] unchanged).
    ///
    /// # Errors
    /// [`Error::Communicator`].
    pub fn abstain(&self, op: &'static str) -> Result<()> {
        let failed = Err(Error::Ranks {
            op,
            reason: "this rank abstained",
        });
        match self.reduce(op, failed) {
            Err(Error::Communicator(e)) => Err(Error::Communicator(e)),
            _ => Ok(()),
        }
    }

    /// Reductions this handle and its clones have taken part in: a step that made none on
    /// one rank must [`DataParallel::abstain`] there.
    pub fn reductions(&self) -> u64 {
        self.reductions.load(Ordering::Relaxed)
    }

    /// Every task's results on every rank, each task computed on its owner (`owners[t]`, the
    /// rank: [`owners`]) and broadcast from there: `mine` holds this rank's tasks' results
    /// in task order (each `lens[t]` values), or the error that stopped them. One broadcast
    /// per rank that owns a task (its tasks' results after a status value), made by every
    /// rank whatever happened locally, so a failure reaches every rank without a hang: this
    /// rank's own error where it failed, else [`Error::Ranks`] when another rank's did.
    ///
    /// # Errors
    /// As described, and [`Error::Communicator`].
    pub(crate) fn exchange(
        &self,
        op: &'static str,
        owners: &[usize],
        lens: &[usize],
        mine: Result<Vec<Vec<f32>>>,
    ) -> Result<Vec<Vec<f32>>> {
        let comm = &*self.comm;
        let mut out = vec![Vec::new(); owners.len()];
        let mut failed = false;
        let mut mine = mine.map(Vec::into_iter);
        for root in 0..comm.size() {
            let tasks: Vec<usize> = (0..owners.len()).filter(|&t| owners[t] == root).collect();
            if tasks.is_empty() {
                continue;
            }
            let len = 1 + tasks.iter().map(|&t| lens[t]).sum::<usize>();
            let mut buf = try_vec(len, 1, 0.0f32)?;
            if root == comm.rank() {
                match &mut mine {
                    Ok(results) => {
                        let mut at = 1;
                        for (&t, r) in tasks.iter().zip(results) {
                            buf[at..at + lens[t]].copy_from_slice(&r);
                            at += lens[t];
                        }
                    }
                    Err(_) => buf[0] = 1.0,
                }
            }
            comm.broadcast(&mut buf, root)?;
            if buf[0] != 0.0 {
                failed = true;
                continue;
            }
            let mut at = 1;
            for &t in &tasks {
                out[t] = buf[at..at + lens[t]].to_vec();
                at += lens[t];
            }
        }
        mine?;
        if failed {
            return Err(Error::Ranks {
                op,
                reason: "another rank's share of the work failed (its own error names it)",
            });
        }
        Ok(out)
    }

    /// [`reduce`] over this handle's communicator, counted.
    pub(crate) fn reduce(
        &self,
        op: &'static str,
        local: Result<Vec<Part>>,
    ) -> Result<Vec<Reduced>> {
        self.reductions.fetch_add(1, Ordering::Relaxed);
        reduce(&*self.comm, op, local)
    }
}

/// The rank each task goes to, tasks of cost `costs[t]` spread over `p` ranks by the
/// longest-processing-time rule: by decreasing cost (ties: the lower index first), each to
/// the rank with the least cost so far (ties: the lower rank). Within `4/3` of the best
/// largest load (Graham 1969); the same on every rank (a function of the costs alone).
pub(crate) fn owners(costs: &[f64], p: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    let mut load = vec![0.0f64; p.max(1)];
    let mut out = vec![0; costs.len()];
    for t in order {
        let r = (0..load.len())
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
            .unwrap_or(0);
        load[r] += costs[t];
        out[t] = r;
    }
    out
}

/// One host vector of a reduction ([`reduce`]).
#[derive(Debug)]
pub(crate) enum Part {
    /// The weighted mean `Σ_p w_p x_p / Σ_p w_p` of every rank's `x` (its `weight` the rows it
    /// averages over).
    Mean(Vec<f32>, usize),
    /// The plain sum `Σ_p x_p` (a gather, each rank writing its own slots).
    Sum(Vec<f32>),
}

/// A reduced [`Part`]: the values, and for a mean the total weight `Σ_p w_p`.
#[derive(Debug)]
pub(crate) struct Reduced {
    pub values: Vec<f32>,
    pub weight: usize,
}

/// Bits per chunk of a signature entry: a chunk `c < 2²⁰` has `c² < 2⁴⁰`, so the sums of
/// up to `2¹²` ranks' squares stay exact in `f64`.
const CHUNK_BITS: u32 = 20;

/// Every rank's `parts`, reduced ([`Part`]), after the agreement of the module docs: `local`
/// is this rank's parts, or the error of its local checks. On every rank: that error on the
/// rank that had it, [`Error::Ranks`] on the others, and [`Error::Ranks`] on every rank
/// when the parts' count, kinds or lengths differ between ranks — before any payload moves.
/// A weight above `2²⁴` (where an `f32` count stops being exact) fails the same way.
fn reduce(
    comm: &dyn Communicator,
    op: &'static str,
    local: Result<Vec<Part>>,
) -> Result<Vec<Reduced>> {
    const MAX_WEIGHT: usize = 1 << 24;
    let p = comm.size();
    let local = local.and_then(|parts| {
        for part in &parts {
            if let Part::Mean(_, w) = part {
                crate::error::check_value(
                    op,
                    "rows",
                    *w as f64,
                    *w <= MAX_WEIGHT,
                    "at most 2^24 rows per rank and step",
                )?;
            }
        }
        Ok(parts)
    });
    // The signature: part count, then per part its kind and length.
    let mut sig = Vec::new();
    if let Ok(parts) = &local {
        sig.push(parts.len() as u64);
        for part in parts {
            let (kind, len) = match part {
                Part::Mean(x, _) => (1, x.len()),
                Part::Sum(x) => (2, x.len()),
            };
            sig.push(kind);
            sig.push(len as u64);
        }
    }
    // Folded into a fixed number of 20-bit chunks (so every rank's header has one length):
    // the total length exactly (three chunks), and a mix of the whole signature.
    let total: u64 = sig.iter().skip(2).step_by(2).sum::<u64>() + sig.len() as u64;
    let mix = sig.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &v| {
        (h ^ v).wrapping_mul(0x0100_0000_01b3)
    });
    let mask = (1u64 << CHUNK_BITS) - 1;
    let chunks = [
        total & mask,
        (total >> CHUNK_BITS) & mask,
        total >> (2 * CHUNK_BITS),
        mix & mask,
        (mix >> CHUNK_BITS) & mask,
    ];
    let mut header = vec![f64::from(u8::from(local.is_err()))];
    header.extend(chunks.iter().map(|&c| c as f64));
    header.extend(chunks.iter().map(|&c| (c as f64) * (c as f64)));
    comm.all_reduce_sum_f64(&mut header)?;
    let parts = local?;
    if header[0] != 0.0 {
        return Err(Error::Ranks {
            op,
            reason: "another rank's inputs failed its checks (its own error names them)",
        });
    }
    let n = chunks.len();
    let pf = p as f64;
    let agree = chunks.iter().enumerate().all(|(i, &c)| {
        let c = c as f64;
        header[1 + i] == pf * c && header[1 + n + i] == pf * c * c
    });
    if !agree {
        return Err(Error::Ranks {
            op,
            reason: "the ranks' shapes differ (every rank must step the same model)",
        });
    }
    // The payload: each mean's `w·x` then its `w`, each sum's `x`.
    let len: usize = parts
        .iter()
        .map(|part| match part {
            Part::Mean(x, _) => x.len() + 1,
            Part::Sum(x) => x.len(),
        })
        .sum();
    let mut payload = try_vec(len, 1, 0.0f32)?;
    let mut at = 0;
    for part in &parts {
        match part {
            Part::Mean(x, w) => {
                let wf = *w as f32;
                for (d, &v) in payload[at..at + x.len()].iter_mut().zip(x) {
                    *d = wf * v;
                }
                payload[at + x.len()] = wf;
                at += x.len() + 1;
            }
            Part::Sum(x) => {
                payload[at..at + x.len()].copy_from_slice(x);
                at += x.len();
            }
        }
    }
    comm.all_reduce_sum(&mut payload)?;
    let mut at = 0;
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        match part {
            Part::Mean(mut x, _) => {
                let w = payload[at + x.len()];
                // No rows anywhere: nothing to average, zeros (a step then fails its own
                // checks on every rank alike).
                let inv = if w > 0.0 { 1.0 / w } else { 0.0 };
                for (d, &v) in x.iter_mut().zip(&payload[at..]) {
                    *d = v * inv;
                }
                at += x.len() + 1;
                out.push(Reduced {
                    values: x,
                    weight: w as usize,
                });
            }
            Part::Sum(mut x) => {
                let len = x.len();
                x.copy_from_slice(&payload[at..at + len]);
                at += len;
                out.push(Reduced {
                    values: x,
                    weight: 0,
                });
            }
        }
    }
    Ok(out)
}

/// One list of tensors to average over the ranks ([`reduce_tensors`]): the tensors, the
/// shapes they must have, and this rank's weight (its rows).
pub(crate) struct Tensors<'a> {
    pub arg: &'static str,
    pub tensors: &'a [&'a Matrix],
    pub shapes: &'a [(usize, usize)],
    pub weight: usize,
}

/// Per list of a [`reduce_tensors`]: its mean tensors and the ranks' total weight.
pub(crate) type TensorMeans = Vec<(Vec<Matrix>, usize)>;

/// Each list's weighted mean over the ranks ([`reduce`]), uploaded to `device` with the
/// expected shapes, and its total weight. This rank's checks — `pre` (the caller's), then
/// each list's count, shapes, device and finiteness — come first, so a bad input is named by
/// the rank that has it (the others fail with [`Error::Ranks`]).
pub(crate) fn reduce_tensors(
    dp: &DataParallel,
    op: &'static str,
    device: &Device,
    pre: Result<()>,
    lists: &[Tensors<'_>],
) -> Result<TensorMeans> {
    let local = pre.and_then(|()| {
        lists
            .iter()
            .map(|l| {
                check_shape(op, l.arg, (l.tensors.len(), 1), (l.shapes.len(), 1))?;
                let mut flat = Vec::new();
                for (m, &shape) in l.tensors.iter().zip(l.shapes) {
                    device.check_on(op, m)?;
                    check_shape(op, l.arg, m.shape(), shape)?;
                    let host = m.to_vec()?;
                    check_finite(op, l.arg, &host)?;
                    flat.extend_from_slice(&host);
                }
                Ok(Part::Mean(flat, l.weight))
            })
            .collect()
    });
    let reduced = dp.reduce(op, local)?;
    lists
        .iter()
        .zip(reduced)
        .map(|(l, r)| {
            let mut at = 0;
            let ms = l
                .shapes
                .iter()
                .map(|&(rows, cols)| {
                    let m = device.upload(rows, cols, &r.values[at..at + rows * cols]);
                    at += rows * cols;
                    m
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((ms, r.weight))
        })
        .collect()
}

/// The lower triangle of the symmetric `n x n` row-major `a`, row by row (`n(n+1)/2`
/// values): what a symmetric factor sends.
pub(crate) fn lower_triangle(a: &[f32], n: usize) -> Vec<f32> {
    let mut t = Vec::with_capacity(n * (n + 1) / 2);
    for i in 0..n {
        t.extend_from_slice(&a[i * n..i * n + i + 1]);
    }
    t
}

/// The symmetric `n x n` row-major matrix whose lower triangle is `t` ([`lower_triangle`]).
pub(crate) fn from_lower_triangle(t: &[f32], n: usize) -> Result<Vec<f32>> {
    let mut a = try_vec(n, n, 0.0f32)?;
    let mut at = 0;
    for i in 0..n {
        for j in 0..=i {
            a[i * n + j] = t[at];
            a[j * n + i] = t[at];
            at += 1;
        }
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_balance_by_cost() {
        // The 784-1024-1024-10 MLP's layers (d_in³ + d_out³): the largest alone at P = 2.
        let c = |i: f64, o: f64| i.powi(3) + o.powi(3);
        let costs = [c(785.0, 1024.0), c(1025.0, 1024.0), c(1025.0, 10.0)];
        assert_eq!(owners(&costs, 2), vec![1, 0, 1]);
        assert_eq!(owners(&costs, 3), vec![1, 0, 2]);
        assert_eq!(owners(&costs, 1), vec![0, 0, 0]);
        // Equal costs go round the ranks in task order.
        assert_eq!(owners(&[1.0; 5], 2), vec![0, 1, 0, 1, 0]);
    }

    #[test]
    fn triangle_round_trip() {
        let n = 4;
        let mut a = vec![0.0f32; n * n];
        for i in 0..n {
            for j in 0..n {
                a[i * n + j] = (i.min(j) * 10 + i.max(j)) as f32;
            }
        }
        let t = lower_triangle(&a, n);
        assert_eq!(t.len(), n * (n + 1) / 2);
        assert_eq!(from_lower_triangle(&t, n).unwrap(), a);
    }
}
