//! Data-parallel step cost (`docs/distributed.md`): RING (`S = 8`; at 2 ranks also with its
//! inversions spread, `Inversions::Spread`) and AdamW on the 784-1024-1024-10 MLP's layer
//! shapes (with biases), global batch 256, at 1 and 2 ranks of the thread communicator. Per
//! step: wall time (and for RING the median refresh and lazy step), time inside the
//! collectives (packing and waiting for the other rank included) and the bytes each rank puts
//! into them — the figures the cost model of `docs/distributed.md` scales to 8 and 64 GPUs
//! with NCCL's ring cost.
//! The last line checks the target: RING's bytes per step at `S = 8` over AdamW's gradient
//! all-reduce, at most 1.3.
//!
//! `cargo bench -p grng --bench dist` (`GRNG_BENCH_STEPS`: steps per row, default 16, a
//! multiple of 8 so every row holds the same share of refreshes).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grng::dist::{Communicator, DataParallel, Inversions, Threads};
use grng::optim::adamw::{AdamW, AdamWConfig};
use grng::optim::kron::{KronConfig, KronOptimizer};
use grng::{Device, Matrix, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `(d_out, d_in + 1)` of the 784-1024-1024-10 MLP's layers.
const SHAPES: [(usize, usize); 3] = [(1024, 785), (1024, 1025), (10, 1025)];
const BATCH: usize = 256;

/// A communicator that counts the bytes given to its collectives and the time spent in them.
#[derive(Debug)]
struct Counting {
    inner: Threads,
    bytes: AtomicU64,
    nanos: AtomicU64,
}

impl Counting {
    fn timed<T>(&self, bytes: usize, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        r
    }
}

impl Communicator for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.timed(4 * buf.len(), || self.inner.all_reduce_sum(buf))
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.timed(8 * buf.len(), || self.inner.all_reduce_sum_f64(buf))
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.timed(4 * buf.len(), || self.inner.broadcast(buf, root))
    }
    fn barrier(&self) -> Result<()> {
        self.timed(0, || self.inner.barrier())
    }
}

/// Per-step averages of one rank: wall time, time in collectives, bytes; and the median
/// refresh and lazy step of a Kronecker method (`S = 8`).
struct Row {
    step: Duration,
    comm: Duration,
    bytes: f64,
    split: Option<[Duration; 2]>,
}

fn rows(rng: &mut ChaCha8Rng, dev: &Device, m: usize, n: usize) -> Matrix {
    let v: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    dev.upload(m, n, &v).unwrap()
}

/// `steps` RING steps on this rank's `BATCH / P` rows, factored gradients, `S = 8`.
fn ring(comm: Arc<Counting>, steps: usize, inversions: Inversions) -> Row {
    let dev = Device::Cpu;
    let p = comm.size();
    let m = BATCH / p;
    let mut rng = ChaCha8Rng::seed_from_u64(comm.rank() as u64);
    let config = KronConfig {
        skip: 8,
        lr: 1e-6,
        ..KronConfig::ring()
    };
    let mut opt = KronOptimizer::new(&dev, &SHAPES, config).unwrap();
    if p > 1 {
        let mut dp = DataParallel::new(comm.clone()).with_inversions(inversions);
        dp.set_rows(m);
        opt.set_data_parallel(Some(dp));
    }
    let mut w: Vec<Matrix> = SHAPES
        .iter()
        .map(|&(o, i)| dev.zeros(o, i).unwrap())
        .collect();
    let mats: Vec<(Matrix, Matrix)> = SHAPES
        .iter()
        .map(|&(o, i)| (rows(&mut rng, &dev, m, i), rows(&mut rng, &dev, m, o)))
        .collect();
    let (grads, stats) = grng_testkit::dist::factored_inputs(&mats);
    let (mut row, times) = measure(&comm, steps, || {
        let s = opt.needs_stats().then_some(&stats[..]);
        opt.step_grads(&mut w, &grads, s).unwrap();
    });
    let median = |keep: fn(usize) -> bool| {
        let mut t: Vec<Duration> = (0..steps).filter(|&k| keep(k)).map(|k| times[k]).collect();
        t.sort();
        t[t.len() / 2]
    };
    row.split = Some([median(|k| k % 8 == 0), median(|k| k % 8 != 0)]);
    row
}

/// `steps` AdamW steps over the same parameters (its gradient all-reduce).
fn adamw(comm: Arc<Counting>, steps: usize) -> Row {
    let dev = Device::Cpu;
    let p = comm.size();
    let mut rng = ChaCha8Rng::seed_from_u64(comm.rank() as u64);
    let mut opt = AdamW::for_tensors(&dev, &SHAPES, AdamWConfig::default()).unwrap();
    if p > 1 {
        let mut dp = DataParallel::new(comm.clone());
        dp.set_rows(BATCH / p);
        opt.set_data_parallel(Some(dp));
    }
    let mut w: Vec<Matrix> = SHAPES
        .iter()
        .map(|&(o, i)| dev.zeros(o, i).unwrap())
        .collect();
    let g: Vec<Matrix> = SHAPES
        .iter()
        .map(|&(o, i)| rows(&mut rng, &dev, o, i))
        .collect();
    let g: Vec<&Matrix> = g.iter().collect();
    measure(&comm, steps, || {
        let mut ps: Vec<&mut Matrix> = w.iter_mut().collect();
        opt.step_many(&mut ps, &g).unwrap();
    })
    .0
}

/// The averages of `steps` calls of `step`, and each call's time.
fn measure(comm: &Counting, steps: usize, mut step: impl FnMut()) -> (Row, Vec<Duration>) {
    let t = Instant::now();
    let times = (0..steps)
        .map(|_| {
            let t = Instant::now();
            step();
            t.elapsed()
        })
        .collect();
    let n = steps as u32;
    let row = Row {
        step: t.elapsed() / n,
        comm: Duration::from_nanos(comm.nanos.load(Ordering::Relaxed)) / n,
        bytes: comm.bytes.load(Ordering::Relaxed) as f64 / steps as f64,
        split: None,
    };
    (row, times)
}

fn world(p: usize, f: impl Fn(Arc<Counting>) -> Row + Sync) -> Row {
    let ranks: Vec<Arc<Counting>> = Threads::world(p)
        .unwrap()
        .into_iter()
        .map(|inner| {
            Arc::new(Counting {
                inner,
                bytes: AtomicU64::new(0),
                nanos: AtomicU64::new(0),
            })
        })
        .collect();
    let mut rows: Vec<Row> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    rows.swap_remove(0)
}

fn main() {
    // `cargo test --benches` runs bench targets with `--test`: nothing to time then.
    if std::env::args().any(|a| a == "--test") {
        return;
    }
    let steps: usize = std::env::var("GRNG_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    println!(
        "dist: 784-1024-1024-10 (with biases), global batch {BATCH}, {steps} steps per row, \
         thread communicator, CPU ({} rayon threads)",
        rayon::current_num_threads()
    );
    println!(
        "{:<16} {:>5} {:>12} {:>12} {:>10} {:>14} {:>16}",
        "method",
        "ranks",
        "step (ms)",
        "refresh (ms)",
        "lazy (ms)",
        "in comm (ms)",
        "bytes/step/rank"
    );
    let ms = |d: Duration| format!("{:.2}", d.as_secs_f64() * 1e3);
    let mut bytes = [0.0f64; 2];
    // RING with its inversions where they happen, or AdamW.
    let rows = [
        ("RING S=8", &[1, 2][..], Some(Inversions::Everywhere)),
        ("RING S=8 spread", &[2], Some(Inversions::Spread)),
        ("AdamW", &[1, 2], None),
    ];
    for (name, ps, inversions) in rows {
        for &p in ps {
            let r = world(p, |c| match inversions {
                Some(i) => ring(c, steps, i),
                None => adamw(c, steps),
            });
            let [refresh, lazy] = r.split.map_or(["-".into(), "-".into()], |s| s.map(ms));
            println!(
                "{name:<16} {p:>5} {:>12} {refresh:>12} {lazy:>10} {:>14} {:>16.0}",
                ms(r.step),
                ms(r.comm),
                r.bytes
            );
            match (name, p) {
                ("RING S=8", 2) => bytes[0] = r.bytes,
                ("AdamW", 2) => bytes[1] = r.bytes,
                _ => {}
            }
        }
    }
    let ratio = bytes[0] / bytes[1];
    println!(
        "RING S=8 bytes/step over AdamW's: {ratio:.3} (target <= 1.3: {})",
        if ratio <= 1.3 { "met" } else { "NOT met" }
    );
}
