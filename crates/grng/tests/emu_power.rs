//! The power iteration of `Device::spectral_norm` on the kernel devices (the emulator, and
//! CUDA when a GPU is present) in batches of steps read back once each
//! (`PowerOptions::max_batch`): the same `PowerInfo`, bit for bit, as one read per step
//! (`max_batch = 1`, the rule before batches) — on the restart from the top diagonal, on runs
//! that end unconverged at `max_iter` and on a zero matrix too — and the read-backs it saves.

use common::{devices, with_spectrum};
use grng_testkit as common;

use grng::hooks::read_backs;
use grng::ops::norm::{PowerInfo, PowerOptions};
use grng::Device;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Ragged sizes up to ~150: 1, around the matvec's 8-row blocks and the 32-lane rows, plus
/// anything.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        1 => Just(1usize),
        3 => prop::sample::select(vec![2usize, 7, 8, 9, 31, 32, 33, 63, 65, 127, 129, 150]),
        4 => 1usize..=150,
    ]
}

/// The start vector of the power iteration (`crate::iteration::start_vector`): all-ones plus
/// golden-ratio fractional parts, normalized. Only to build a stall on it; the test checks
/// the stall happens, so a change of the start fails loudly instead of testing nothing.
fn start_vector(n: usize) -> Vec<f64> {
    let v: Vec<f64> = (0..n)
        .map(|i| 1.0 + 0.5 * ((i as f64 * 0.618_033_988_749_895).fract() - 0.5))
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter().map(|x| x / norm).collect()
}

/// `λ₁u₁u₁ᵀ + λ₂v₀v₀ᵀ` with `v₀` the start and `u₁ ⟂ v₀` (`u₁ ∝ e_j − v₀ⱼv₀`): the
/// iteration from `v₀` stalls at `λ₂` and must restart from the top diagonal element
/// (`A_jj > λ₂`) to find `λ₁` (`src/ops/norm.rs`'s unit test of the restart). `n ≥ 2`.
fn stall(rng: &mut ChaCha8Rng, n: usize) -> (Vec<f32>, f64, f64) {
    let v0 = start_vector(n);
    let j = rng.random_range(0..n);
    let mut u1: Vec<f64> = v0.iter().map(|&x| -v0[j] * x).collect();
    u1[j] += 1.0;
    let norm = u1.iter().map(|x| x * x).sum::<f64>().sqrt();
    u1.iter_mut().for_each(|x| *x /= norm);
    let l1 = rng.random_range(0.5..20.0);
    let l2 = l1 * rng.random_range(0.05..0.7);
    let a = (0..n * n)
        .map(|k| (l1 * u1[k / n] * u1[k % n] + l2 * v0[k / n] * v0[k % n]) as f32)
        .collect();
    (a, l1, l2)
}

fn norm_on(dev: &Device, a: &[f32], n: usize, opts: &PowerOptions) -> PowerInfo {
    dev.spectral_norm(&dev.upload(n, n, a).unwrap(), opts)
        .unwrap()
}

/// What the test draws (the weights keep every path in most runs of 32 cases).
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// A spectrum with a random gap: converges, after a few to ~150 steps.
    Converging,
    /// [`stall`]: the restart (with a budget of 3 to 8 steps in 30% of the cases, which it may
    /// exhaust).
    Stall,
    /// Eigenvalues `λ₁` and `[0.97, 0.99]·λ₁` under a tolerance of `1e-9`, for 5 to 60 steps:
    /// the quotient still moves by ~1e-6 a step when they run out (unconverged).
    Unconverged,
    /// `A = 0`: `‖Av‖ = 0` at the first step.
    Zero,
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        4 => Just(Kind::Converging),
        3 => Just(Kind::Stall),
        2 => Just(Kind::Unconverged),
        1 => Just(Kind::Zero),
    ]
}

proptest! {
    #![proptest_config(common::proptest_config(32))]

    /// Batched steps (`max_batch` drawn, and the default) give the `PowerInfo` of one read per
    /// step, bit for bit: the steps are the same kernels in the same order, and the stop test
    /// sees their quotients in the same order.
    #[test]
    fn batches_match_one_read_per_step(
        kind in kind(),
        n in size(),
        max_batch in prop::sample::select(vec![2usize, 3, 5, 8, 64, PowerOptions::MAX_BATCH]),
        seed: u64,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = match kind {
            Kind::Stall | Kind::Unconverged => n.max(2),
            _ => n,
        };
        let scale = rng.random_range(0.1f64..10.0);
        let (a, opts) = match kind {
            Kind::Converging => {
                let gap = rng.random_range(0.05f64..0.95);
                let d: Vec<f64> = (0..n)
                    .map(|i| scale * if i == 0 { 1.0 } else { gap * rng.random_range(0.0..1.0) })
                    .collect();
                // Not below 1e-6: the f32 iterate's rounding moves the quotient by ~1e-7.
                let tol = 10f32.powi(-rng.random_range(2i32..=6));
                (with_spectrum(&mut rng, &d), PowerOptions { tol, max_iter: 200, ..Default::default() })
            }
            Kind::Stall => {
                let (a, ..) = stall(&mut rng, n);
                // A few steps only: the restart too may run out of them.
                let max_iter = if rng.random_bool(0.3) { rng.random_range(3usize..=8) } else { 400 };
                (a, PowerOptions { tol: 1e-6, max_iter, ..Default::default() })
            }
            Kind::Unconverged => {
                let d: Vec<f64> = (0..n)
                    .map(|i| scale * if i == 0 { 1.0 } else { rng.random_range(0.97..0.99) })
                    .collect();
                let max_iter = rng.random_range(5usize..=60);
                (with_spectrum(&mut rng, &d), PowerOptions { tol: 1e-9, max_iter, ..Default::default() })
            }
            Kind::Zero => (vec![0.0; n * n], PowerOptions::default()),
        };
        for dev in devices() {
            let one = norm_on(&dev, &a, n, &PowerOptions { max_batch: 1, ..opts });
            for max_batch in [max_batch, PowerOptions::default().max_batch] {
                let got = norm_on(&dev, &a, n, &PowerOptions { max_batch, ..opts });
                prop_assert_eq!(got.value.to_bits(), one.value.to_bits(), "{:?} vs {:?}", got, one);
                prop_assert_eq!(got.iterations, one.iterations, "{:?} vs {:?}", got, one);
                prop_assert_eq!(got.converged, one.converged, "{:?} vs {:?}", got, one);
            }
            // The path each kind is drawn for is the one it takes.
            match kind {
                Kind::Converging => prop_assert!(one.converged, "{:?}", one),
                Kind::Stall => {
                    // Two steps stop on the stall (nothing left to restart with)...
                    let two = norm_on(&dev, &a, n, &PowerOptions { max_iter: 2, ..opts });
                    prop_assert!(two.converged && two.iterations == 2, "{:?}", two);
                    // ...which the run leaves for a larger quotient from the diagonal (A_jj > λ₂),
                    // and with its 400 steps converges at λ₁ ≥ λ₂/0.7.
                    prop_assert!(one.value > two.value, "{:?} after {:?}", one, two);
                    if opts.max_iter == 400 {
                        prop_assert!(one.value > 1.3 * two.value && one.converged, "{:?} after {:?}", one, two);
                    }
                }
                Kind::Unconverged => {
                    prop_assert!(!one.converged && one.iterations == opts.max_iter, "{:?}", one);
                }
                Kind::Zero => prop_assert_eq!(one, PowerInfo { value: 0.0, iterations: 1, converged: true }),
            }
        }
    }
}

/// Read-backs of a run stopping at step `t` with batches `2, 4, …, cap` (`cap` a power of
/// two), then `cap` each: `⌈log₂(t/2 + 1)⌉` up to step `2·cap − 2`, one per `cap` steps after.
fn batch_reads(t: usize, cap: usize) -> u64 {
    let doubling = ((t + 2).next_power_of_two().trailing_zeros() - 1).min(cap.trailing_zeros());
    (doubling as usize + t.saturating_sub(2 * cap - 2).div_ceil(cap)) as u64
}

/// Read-backs of [`batch_reads`] for `t` steps in one run or two (a restart from the top
/// diagonal starts its own schedule): the worst split.
fn run_reads(t: usize, cap: usize) -> u64 {
    (0..=t)
        .map(|t1| batch_reads(t1, cap) + batch_reads(t - t1, cap))
        .max()
        .unwrap_or(0)
}

/// Reads of `Device::spectral_norm` besides its batches': none, `newton_sym_stats`' partials
/// (finite check, top diagonal) come back with the first batch.
const SETUP_READS: u64 = 0;

/// One read per step with `max_batch = 1`; with batches of up to 16 at most
/// [`run_reads`]`(t, 16)` for `t` steps (n = 1 and 2 included), and for n = 33
/// and 150 fewer than the steps, which are at least 20 there: `λ₂/λ₁` in `[0.9, 0.95]` and
/// the rest of the spectrum in `[0.5, 1]·λ₂` under a tolerance of `1e-6` take ~40 to 140.
#[test]
fn batches_read_back_once() {
    let mut rng = common::seeded_rng();
    for n in [1usize, 2, 33, 150] {
        let gap = rng.random_range(0.9f64..0.95);
        let d: Vec<f64> = (0..n)
            .map(|i| match i {
                0 => 1.0,
                1 => gap,
                _ => gap * rng.random_range(0.5..1.0),
            })
            .collect();
        let a = with_spectrum(&mut rng, &d);
        let opts = PowerOptions {
            tol: 1e-6,
            max_iter: 200,
            max_batch: 16,
        };
        for dev in devices() {
            let reads = |opts: &PowerOptions| {
                let m = dev.upload(n, n, &a).unwrap();
                let before = read_backs();
                let info = dev.spectral_norm(&m, opts).unwrap();
                (info, read_backs() - before)
            };
            let (one, one_reads) = reads(&PowerOptions {
                max_batch: 1,
                ..opts
            });
            assert_eq!(
                one_reads,
                SETUP_READS + one.iterations as u64,
                "n {n}: {one:?}"
            );
            let (got, got_reads) = reads(&opts);
            assert_eq!(got, one, "n {n}");
            let t = got.iterations;
            let bound = run_reads(t, 16);
            assert!(
                got_reads <= SETUP_READS + bound,
                "n {n}: {got_reads} reads for {t} steps, bound {SETUP_READS} + {bound}"
            );
            if n > 2 {
                assert!(
                    got.converged && t >= 20,
                    "n {n}: {got:?} (the case needs 20 steps)"
                );
                assert!(
                    got_reads - SETUP_READS < t as u64,
                    "n {n}: {got_reads} reads, {t} steps"
                );
            }
        }
    }
}

/// The bound's closed form against the schedule it counts.
#[test]
fn batch_reads_counts_the_schedule() {
    for cap in [1usize, 2, 4, 16, 64] {
        let (mut batches, mut covered, mut batch) = (0u64, 0usize, cap.min(2));
        for t in 1..=500 {
            while covered < t {
                covered += batch;
                batches += 1;
                batch = (2 * batch).min(cap);
            }
            assert_eq!(batch_reads(t, cap), batches, "t {t}, cap {cap}");
        }
    }
}

/// A symmetric `n x n` matrix from a fixed seed: uniform entries in `[-1, 1)` plus `2` on the
/// diagonal (cheap to build at n = 2065, where the matvec runs 259 blocks: more partials than
/// the 256 threads that sum them).
fn pinned_matrix(n: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(0x0005_eed0_f9e7);
    let mut a = vec![0f32; n * n];
    for i in 0..n {
        for j in 0..=i {
            let x = rng.random_range(-1.0f32..1.0) + if i == j { 2.0 } else { 0.0 };
            a[i * n + j] = x;
            a[j * n + i] = x;
        }
    }
    a
}

/// `spectral_norm` on the emulator pinned bit for bit to the values of the two-kernel step
/// (a matvec launch and a one-block normalize launch, before the step became one launch):
/// the fused step keeps the partials, their summation order and the normalization. Twelve
/// steps under an unreachable tolerance (n = 1 is exact after
/// two), in batches of 8, so every step's `v` feeds the
/// next.
#[test]
fn spectral_norm_is_pinned() {
    // (n, steps, bits of the value)
    let pinned: [(usize, usize, u32); 5] = [
        (1, 2, 0x4029_2351),
        (9, 12, 0x409d_8995),
        (100, 12, 0x413f_b3ec),
        (300, 12, 0x419d_fcf0),
        (2065, 12, 0x4226_ecbe),
    ];
    let opts = PowerOptions {
        tol: 1e-30,
        max_iter: 12,
        max_batch: 8,
    };
    for (n, steps, bits) in pinned {
        let info = norm_on(&Device::Emulated, &pinned_matrix(n), n, &opts);
        assert_eq!(info.iterations, steps, "n = {n}: {info:?}");
        assert_eq!(info.value.to_bits(), bits, "n = {n}: {info:?}");
    }
}
