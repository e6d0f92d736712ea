//! Each CUDA primitive the emulator provides, checked against its CUDA definition through
//! the self-test kernels (`kernels/emu/selftest.cu`), launched by the same Rust launch code
//! as on a GPU. Runs on `Device::Emulated`, and also on CUDA when a GPU and the kernels are
//! present. Every output buffer is poisoned with NaN before the launch, so an element the
//! kernel fails to write cannot pass. The launchers (`grng::cuda::selftest`) exist only with
//! the feature `test-hooks`, which the crate's dev-dependency on itself turns on here.

use grng::cuda::launch::{launch, KernelArgs, LaunchConfig};
use grng::cuda::selftest::{self, DimsParams};
use grng::{Device, Error, Matrix};
use half::bf16;
use proptest::prelude::*;

use common::devices;
use grng_testkit as common;

/// A quiet NaN with a payload no test expects as an integer result (0x7fc0dead).
const POISON_BITS: u32 = 0x7fc0_dead;

fn poison(dev: &Device, len: usize) -> Matrix<f32> {
    dev.upload(len, 1, &vec![f32::from_bits(POISON_BITS); len])
        .unwrap()
}

fn poison_bf16(dev: &Device, len: usize) -> Matrix<bf16> {
    dev.upload(len, 1, &vec![bf16::NAN; len]).unwrap()
}

/// i32 values carried as f32 bit patterns (matrices hold f32 or bf16).
fn upload_i32(dev: &Device, v: &[i32]) -> Matrix<f32> {
    let bits: Vec<f32> = v.iter().map(|&x| f32::from_bits(x as u32)).collect();
    dev.upload(v.len(), 1, &bits).unwrap()
}

fn download_i32(m: &Matrix<f32>) -> Vec<i32> {
    m.to_vec()
        .unwrap()
        .iter()
        .map(|x| x.to_bits() as i32)
        .collect()
}

fn small_or_any_i32() -> impl Strategy<Value = i32> {
    prop_oneof![3 => -8i32..8, 1 => any::<i32>()]
}

proptest! {
    #![proptest_config(common::proptest_config(24))]

    /// __syncthreads + static shared memory: a padded-tile transpose is exact.
    #[test]
    fn transpose_through_shared_tile(rows in 1usize..100, cols in 1usize..100, seed in any::<u64>()) {
        let x: Vec<f32> = (0..rows * cols).map(|i| (i as u64 ^ seed) as f32 * 0.5 - 7.0).collect();
        for dev in devices() {
            let a = dev.upload(rows, cols, &x).unwrap();
            let mut out = dev.upload(cols, rows, &vec![f32::from_bits(POISON_BITS); rows * cols]).unwrap();
            selftest::transpose(&dev, &a, &mut out).unwrap();
            let got = out.to_vec().unwrap();
            for r in 0..rows {
                for c in 0..cols {
                    prop_assert_eq!(got[c * rows + r].to_bits(), x[r * cols + c].to_bits(), "({}, {})", r, c);
                }
            }
        }
    }

    /// Dynamic shared memory of the launch's size, per block, up to beyond 48 KiB.
    #[test]
    fn dynamic_shared_memory(
        x in prop::collection::vec(-1e3f32..1e3, 1..3000),
        chunk in prop_oneof![1usize..300, 12_000usize..14_000],
        block in 1u32..300,
    ) {
        for dev in devices() {
            let xm = dev.upload(x.len(), 1, &x).unwrap();
            let mut out = poison(&dev, x.len());
            selftest::dyn_smem_reverse(&dev, &xm, &mut out, chunk, block).unwrap();
            let got = out.to_vec().unwrap();
            for (base, part) in x.chunks(chunk).enumerate().map(|(b, p)| (b * chunk, p)) {
                for i in 0..part.len() {
                    prop_assert_eq!(got[base + i].to_bits(), part[part.len() - 1 - i].to_bits());
                }
            }
        }
    }

    /// Every shuffle variant, 4- and 8-byte values, all lanes, widths 1..32, offsets beyond
    /// the width and the warp (PTX takes b[4:0]), and split half-warp masks.
    #[test]
    fn warp_shuffles(
        warps in 1u32..4,
        blocks in 1usize..3,
        seed in any::<u64>(),
        cases in prop::collection::vec((0i32..5, -40i32..80, 0u32..6), 1..10),
    ) {
        let n = blocks * 32 * warps as usize;
        let v: Vec<i32> = (0..n as u64).map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed) as i32).collect();
        let cases: Vec<(i32, i32, i32)> = cases
            .into_iter()
            .map(|(op, b, wlog)| match op {
                1 | 2 => (op, b.rem_euclid(41), 1 << wlog),   // delta 0..=40
                3 => (op, b.rem_euclid(32), 1 << wlog),
                4 => (op, b.rem_euclid(16), 1 << wlog.min(4)), // stays inside its half-warp
                _ => (op, b, 1 << wlog),
            })
            .collect();
        let flat: Vec<i32> = cases.iter().flat_map(|&(o, b, w)| [o, b, w]).collect();
        for dev in devices() {
            let vin = upload_i32(&dev, &v);
            let cm = upload_i32(&dev, &flat);
            let mut out = poison(&dev, n * cases.len());
            let mut out64 = poison(&dev, 2 * n * cases.len());
            selftest::shfl(&dev, &vin, &cm, &mut out, &mut out64, warps).unwrap();
            let (got, got64) = (download_i32(&out), download_i32(&out64));
            for (t, &(op, b, width)) in cases.iter().enumerate() {
                for g in 0..n {
                    let lane = (g % 32) as i32;
                    let base = g as i32 - lane;
                    let seg = lane - lane % width; // first lane of this lane's segment
                    let src = match op {
                        // CUDA guide: srcLane modulo width, within the caller's segment.
                        0 => seg + (b + 3 * lane).rem_euclid(width),
                        // up: lane - delta unless it falls before the segment.
                        1 => { let j = lane - (b & 31); if j >= seg { j } else { lane } }
                        // down: lane + delta unless it passes the segment's end.
                        2 => { let j = lane + (b & 31); if j < seg + width { j } else { lane } }
                        // xor: later segments return the caller's own value.
                        _ => { let j = lane ^ (b & 31); if j < seg + width { j } else { lane } }
                    };
                    let sv = v[(base + src) as usize];
                    prop_assert_eq!(got[t * n + g], sv, "case {:?} thread {}", (op, b, width), g);
                    let lo = !sv;
                    let hi = sv ^ 0x5a5a_5a5a;
                    prop_assert_eq!((got64[2 * (t * n + g)], got64[2 * (t * n + g) + 1]), (lo, hi));
                }
            }
        }
    }

    /// Ballot/any/all (full and partial masks), sm_80 warp reductions and the block votes.
    #[test]
    fn votes_and_reductions(
        block in prop_oneof![Just(32u32), Just(64), Just(96), Just(256)],
        blocks in 1usize..3,
        mask in prop_oneof![any::<u32>(), Just(u32::MAX), (0u32..32).prop_map(|i| 1u32 << i)],
        v in prop::collection::vec(small_or_any_i32(), 768),
    ) {
        let n = blocks * block as usize;
        let v = &v[..n];
        for dev in devices() {
            let vin = upload_i32(&dev, v);
            let mut out = poison(&dev, 9 * n);
            let mut blk = poison(&dev, 3 * blocks);
            selftest::vote(&dev, &vin, &mut out, &mut blk, mask, block).unwrap();
            let (got, gblk) = (download_i32(&out), download_i32(&blk));
            for w in 0..n / 32 {
                let lanes = &v[w * 32..w * 32 + 32];
                let ballot = |f: &dyn Fn(i32) -> bool, m: u32| -> u32 {
                    (0..32).filter(|&l| m >> l & 1 == 1 && f(lanes[l])).fold(0, |a, l| a | 1 << l)
                };
                let full = ballot(&|x| x & 1 != 0, u32::MAX) as i32;
                let any = lanes.iter().any(|&x| x > 1_000_000) as i32;
                let all = lanes.iter().all(|&x| x > -1_000_000) as i32;
                let mb = ballot(&|x| x & 2 != 0, mask) as i32;
                let mall = (ballot(&|x| x & 4 != 0, mask) == mask) as i32;
                let sum = lanes.iter().fold(0u32, |a, &x| a.wrapping_add(x as u32)) as i32;
                let max = *lanes.iter().max().unwrap();
                let min = lanes.iter().map(|&x| x as u32).min().unwrap() as i32;
                let b = (w * 32) / block as usize;
                let bv = &v[b * block as usize..(b + 1) * block as usize];
                let count = bv.iter().filter(|&&x| x > 0).count() as i32;
                for l in 0..32 {
                    let o = &got[9 * (w * 32 + l)..9 * (w * 32 + l) + 9];
                    let (m3, m4) = if mask >> l & 1 == 1 { (mb, mall) } else { (-1, -1) };
                    prop_assert_eq!(o, &[full, any, all, m3, m4, sum, max, min, count][..], "warp {} lane {}", w, l);
                }
            }
            for b in 0..blocks {
                let bv = &v[b * block as usize..(b + 1) * block as usize];
                let count = bv.iter().filter(|&&x| x > 0).count() as i32;
                prop_assert_eq!(&gblk[3 * b..3 * b + 3], &[count, (count == block as i32) as i32, (count > 0) as i32][..]);
            }
        }
    }

    /// atomicAdd (float, int, returned old values), atomicMax, atomicMin from many blocks.
    #[test]
    fn atomics_from_many_blocks(
        x in prop::collection::vec(-1.0f32..1.0, 0..5000),
        grid in 1u32..9,
        block in prop_oneof![Just(32u32), Just(96), Just(256)],
        seed in any::<u32>(),
    ) {
        let n = x.len();
        let k: Vec<i32> = (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as i32 >> 4).collect();
        for dev in devices() {
            let xm = dev.upload(n, 1, &x).unwrap();
            let km = upload_i32(&dev, &k);
            let mut acc = dev.upload(1, 1, &[0.0f32]).unwrap();
            let mut iacc = upload_i32(&dev, &[0, i32::MIN, i32::MAX, 0]);
            let mut slot = poison(&dev, n);
            selftest::atomics(&dev, &xm, &km, &mut acc, &mut iacc, &mut slot, (grid, block)).unwrap();
            let sum: f64 = x.iter().map(|&v| f64::from(v)).sum();
            let abs: f64 = x.iter().map(|&v| f64::from(v.abs())).sum();
            // n f32 additions in some order: each rounding costs at most 2^-24 of the running
            // |sum| ≤ Σ|x|.
            let got = f64::from(acc.to_vec().unwrap()[0]);
            prop_assert!((got - sum).abs() <= n as f64 * 2f64.powi(-24) * abs + 1e-30, "{} vs {}", got, sum);
            let ia = download_i32(&iacc);
            let isum = k.iter().fold(0i32, |a, &v| a.wrapping_add(v));
            let imax = k.iter().copied().max().unwrap_or(i32::MIN);
            let imin = k.iter().copied().min().unwrap_or(i32::MAX);
            prop_assert_eq!(ia, vec![isum, imax, imin, n as i32]);
            let mut s = download_i32(&slot);
            s.sort_unstable();
            prop_assert_eq!(s, (0..n as i32).collect::<Vec<_>>());
        }
    }

    /// f32 → bf16 rounds to nearest even exactly like half::bf16::from_f32 (ties, subnormals,
    /// overflow to Inf, Inf), NaN stays NaN, bf16 → f32 is exact.
    #[test]
    fn bf16_round_trip(bits in prop::collection::vec(prop_oneof![
        any::<u32>(),
        (any::<u16>(), prop_oneof![Just(0x8000u32), Just(0x7fff), Just(0x8001), Just(0)]).prop_map(|(h, l)| (u32::from(h) << 16) | l),
        0u32..0x0080_0000,                       // subnormals
        prop_oneof![Just(0x7f80_0000u32), Just(0xff80_0000), Just(0x7f7f_ffff), Just(0x7fc0_0001), Just(0xffc0_0000)],
    ], 1..2000)) {
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let n = x.len();
        for dev in devices() {
            let xm = dev.upload(n, 1, &x).unwrap();
            let mut out = poison_bf16(&dev, n);
            let mut back = poison(&dev, n);
            let mut pair = poison(&dev, 2 * n);
            selftest::bf16_convert(&dev, &xm, &mut out, &mut back, &mut pair).unwrap();
            let (o, b, p) = (out.to_vec().unwrap(), back.to_vec().unwrap(), pair.to_vec().unwrap());
            for i in 0..n {
                let want = bf16::from_f32(x[i]);
                if x[i].is_nan() {
                    prop_assert!(o[i].is_nan() && b[i].is_nan() && p[2 * i].is_nan() && p[2 * i + 1].is_nan());
                    continue;
                }
                prop_assert_eq!(o[i].to_bits(), want.to_bits(), "x = {:#010x}", x[i].to_bits());
                prop_assert_eq!(b[i].to_bits(), want.to_f32().to_bits());
                prop_assert_eq!(p[2 * i].to_bits(), want.to_f32().to_bits());
                prop_assert_eq!(p[2 * i + 1].to_bits(), bf16::from_f32(-x[i]).to_f32().to_bits());
            }
        }
    }

    /// WMMA bf16 m16n16k16 with every row/col-major combination of A, B, C, D, element-wise
    /// scaling through num_elements/x[], against the f64 product of the bf16 inputs.
    #[test]
    fn wmma_bf16_matches_f64(
        mt in 1usize..4, nt in 1usize..4, kt in 1usize..4,
        layouts in 0u32..16,
        alpha in -2.0f32..2.0,
        seed in any::<u64>(),
    ) {
        let (m, n, k) = (16 * mt, 16 * nt, 16 * kt);
        let mut s = seed | 1;
        let mut rnd = move || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0 };
        let a: Vec<f32> = (0..m * k).map(|_| rnd()).collect(); // logical A[i][kk] = a[i*k+kk]
        let b: Vec<f32> = (0..k * n).map(|_| rnd()).collect(); // logical B[kk][j] = b[kk*n+j]
        let c: Vec<f32> = (0..m * n).map(|_| rnd()).collect(); // logical C[i][j] = c[i*n+j]
        let ab: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
        let bb: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
        let (a_col, b_col, c_col, d_col) = (layouts & 1 != 0, layouts & 2 != 0, layouts & 4 != 0, layouts & 8 != 0);
        let store = |v: &[bf16], rows: usize, cols: usize, col: bool| -> Vec<bf16> {
            if !col { return v.to_vec(); }
            let mut t = vec![bf16::ZERO; rows * cols];
            for r in 0..rows { for cc in 0..cols { t[r + cc * rows] = v[r * cols + cc]; } }
            t
        };
        let a_st = store(&ab, m, k, a_col);
        let b_st = store(&bb, k, n, b_col);
        let c_st: Vec<f32> = if c_col { (0..m * n).map(|idx| c[(idx % m) * n + idx / m]).collect() } else { c.clone() };
        for dev in devices() {
            let am = dev.upload(m * k, 1, &a_st).unwrap();
            let bm = dev.upload(k * n, 1, &b_st).unwrap();
            let cm = dev.upload(m * n, 1, &c_st).unwrap();
            let mut d = poison(&dev, m * n);
            selftest::wmma(&dev, &am, &bm, &cm, &mut d, (m, n, k), layouts, alpha).unwrap();
            let got = d.to_vec().unwrap();
            for i in 0..m {
                for j in 0..n {
                    let mut acc = f64::from(c[i * n + j]);
                    let mut mag = acc.abs();
                    for kk in 0..k {
                        let p = f64::from(ab[i * k + kk].to_f32()) * f64::from(bb[kk * n + j].to_f32());
                        acc += p;
                        mag += p.abs();
                    }
                    let want = f64::from(alpha) * acc;
                    let g = f64::from(got[if d_col { i + j * m } else { i * n + j }]);
                    // Products of bf16 are exact in f32; k + 1 f32 additions and the scaling
                    // each round by ≤ 2^-24 of a partial sum ≤ mag. Hardware may truncate
                    // instead of rounding: allow 4x.
                    let tol = 4.0 * (k as f64 + 2.0) * 2f64.powi(-24) * mag * f64::from(alpha.abs()) + 1e-30;
                    prop_assert!((g - want).abs() <= tol, "({}, {}): {} vs {}", i, j, g, want);
                }
            }
        }
    }

    /// A loop of __syncthreads / __syncwarp / block sums (common.cuh) / warp maxima.
    #[test]
    fn barrier_loop(
        block in prop_oneof![Just(32u32), Just(64), Just(160), Just(1024)],
        blocks in 1usize..3,
        iters in 1usize..6,
        seed in any::<u64>(),
    ) {
        let bs = block as usize;
        let n = blocks * bs;
        let x: Vec<f32> = (0..n as u64).map(|i| ((i.wrapping_mul(0x9e37_79b9) ^ seed) % 2001) as f32 / 100.0 - 10.0).collect();
        for dev in devices() {
            let xm = dev.upload(n, 1, &x).unwrap();
            let mut out = poison(&dev, n);
            let mut sums = poison(&dev, blocks * iters);
            let mut wmax = poison(&dev, n / 32);
            selftest::barriers(&dev, &xm, &mut out, &mut sums, &mut wmax, iters, block).unwrap();
            let (o, s, w) = (out.to_vec().unwrap(), sums.to_vec().unwrap(), wmax.to_vec().unwrap());
            for b in 0..blocks {
                let mut v = x[b * bs..(b + 1) * bs].to_vec();
                for it in 0..iters {
                    // Same f32 operations as the kernel: scalings by powers of two are exact,
                    // so FMA contraction on a GPU cannot change the result.
                    let r = v.clone();
                    for t in 0..bs {
                        v[t] = 0.5 * r[t] + 0.25 * (r[(t + 1) % bs] + r[(t + bs - 1) % bs]);
                    }
                    let sum: f64 = v.iter().map(|&e| f64::from(e)).sum();
                    let abs: f64 = v.iter().map(|&e| f64::from(e.abs())).sum();
                    // A tree of block-1 f32 additions: ≤ log2(block) + 1 roundings per term.
                    let tol = 12.0 * 2f64.powi(-24) * abs + 1e-30;
                    prop_assert!((f64::from(s[b * iters + it]) - sum).abs() <= tol, "block {} iter {}", b, it);
                }
                for t in 0..bs {
                    prop_assert_eq!(o[b * bs + t].to_bits(), v[t].to_bits());
                }
                for wi in 0..bs / 32 {
                    let m = v[wi * 32..wi * 32 + 32].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    prop_assert_eq!(w[b * bs / 32 + wi], m);
                }
            }
        }
    }

    /// threadIdx/blockIdx/blockDim/gridDim over 3-D launches, and every scalar kind.
    #[test]
    fn builtin_variables_and_scalars(
        grid in (1u32..4, 1u32..4, 1u32..3),
        block in (1u32..9, 1u32..5, 1u32..5),
        i in any::<i32>(), u in any::<u32>(), f in -1e30f32..1e30, ll in any::<i64>(), ull in any::<u64>(), d in -1e300f64..1e300,
    ) {
        let threads = (grid.0 * grid.1 * grid.2 * block.0 * block.1 * block.2) as usize;
        for dev in devices() {
            let mut out = poison(&dev, 8 * threads);
            let mut params = poison(&dev, 6);
            let p = DimsParams { i, u, f, ll, ull, d };
            selftest::dims(&dev, &mut out, &mut params, grid, block, p).unwrap();
            let o = out.to_vec().unwrap();
            let mut g = 0;
            for bz in 0..grid.2 { for by in 0..grid.1 { for bx in 0..grid.0 {
                for tz in 0..block.2 { for ty in 0..block.1 { for tx in 0..block.0 {
                    let want = [tx, ty, tz, bx, by, bz, block.0 + 100 * block.1 + 10000 * block.2, grid.0 + 100 * grid.1 + 10000 * grid.2]
                        .map(|v| v as f32);
                    prop_assert_eq!(&o[8 * g..8 * g + 8], &want[..], "thread {}", g);
                    g += 1;
                }}}
            }}}
            prop_assert_eq!(params.to_vec().unwrap(), vec![i as f32, u as f32, f, ll as f32, ull as f32, d as f32]);
        }
    }
}

/// Bad launches are typed errors on every device, before anything runs.
#[test]
fn invalid_launches_are_errors() {
    let dev = Device::Emulated;
    let mut out = poison(&dev, 256);
    let bad = [
        ((1, 1, 1), (0, 1, 1), 0),
        ((1, 1, 1), (1025, 1, 1), 0),
        ((1, 1, 1), (1, 1, 65), 0),
        ((0, 1, 1), (32, 1, 1), 0),
        ((1, 65_536, 1), (32, 1, 1), 0),
        ((1, 1, 1), (32, 1, 1), 232_449),
    ];
    for (grid, block, shared_mem) in bad {
        let cfg = LaunchConfig {
            grid,
            block,
            shared_mem,
        };
        let mut args = KernelArgs::new(&dev);
        args.output("test", &mut out).unwrap().scalar(0i32);
        // SAFETY: selftest_overhead(float* out, int barriers) — never runs: the
        // configuration is rejected first.
        let r = unsafe { launch(&selftest::OVERHEAD, cfg, args) };
        assert!(matches!(r, Err(Error::Value { .. })), "{cfg:?}: {r:?}");
    }
    // Kernels do not run on the CPU backend, and buffers must live on the launch's device.
    let mut cpu_out = Device::Cpu.upload(256, 1, &[0.0f32; 256]).unwrap();
    assert!(matches!(
        selftest::overhead(&Device::Cpu, &mut cpu_out, 1, 256, 0),
        Err(Error::DeviceUnavailable(_))
    ));
    assert!(matches!(
        selftest::overhead(&dev, &mut out, 2, 256, 0),
        Err(Error::Shape { .. })
    ));
}

/// The emulator reports misuse (CUDA: undefined behaviour) by aborting with a message; run
/// each case in a child process.
#[test]
fn misuse_aborts_with_a_message() {
    let exe = std::env::current_exe().unwrap();
    let expect = [
        "every thread of a block must reach each barrier",
        "not taking part",
        "does not include the calling lane",
        "fragments differ",
    ];
    for (mode, needle) in expect.iter().enumerate() {
        let o = std::process::Command::new(&exe)
            .args(["misuse_child", "--exact", "--nocapture", "--test-threads=1"])
            .env("GRNG_TEST_MISUSE_MODE", mode.to_string())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "mode {mode} did not abort");
        assert!(
            err.contains("grng emu: kernel selftest_misuse") && err.contains(needle),
            "mode {mode}: {err}"
        );
    }
}

/// Child half of `misuse_aborts_with_a_message` (does nothing unless asked to).
#[test]
fn misuse_child() {
    if let Ok(mode) = std::env::var("GRNG_TEST_MISUSE_MODE") {
        let dev = Device::Emulated;
        let mut out = poison(&dev, 256);
        let _ = selftest::misuse(&dev, &mut out, mode.parse().unwrap());
        // Reaching this point means the misuse went unnoticed: exit successfully so that
        // the parent's "did not abort" check fails.
    }
}

/// Emulated launch cost: a grid of 4096 blocks of 256 threads with 0 and 2 barriers.
#[test]
fn emulated_launch_overhead() {
    let dev = Device::Emulated;
    let (blocks, block) = (4096u32, 256u32);
    let n = (blocks * block) as usize;
    for barriers in [0u32, 2] {
        let mut out = poison(&dev, n);
        let t = std::time::Instant::now();
        selftest::overhead(&dev, &mut out, blocks, block, barriers).unwrap();
        let dt = t.elapsed().as_secs_f64();
        println!(
            "emulated launch, {blocks} blocks x {block} threads, {barriers} barriers: {:.3} s \
             ({:.0} ns per thread)",
            dt,
            dt / n as f64 * 1e9
        );
        let o = out.to_vec().unwrap();
        assert!(o.iter().enumerate().all(|(g, &v)| v == (g % 256) as f32));
        // Generous (CI shares 2 cores): measured ~0.1-0.2 s.
        assert!(dt < 10.0, "emulated launch took {dt} s");
    }
    let mut tiny = poison(&dev, 32);
    let t = std::time::Instant::now();
    for _ in 0..1000 {
        selftest::overhead(&dev, &mut tiny, 1, 32, 0).unwrap();
    }
    println!(
        "emulated launch of 1 block x 32 threads: {:.1} us",
        t.elapsed().as_secs_f64() * 1e3
    );
}

// ---------------------------------------------------------------------------------------
// sm_80 matrix primitives of the GEMM engine (kernels/gemm/mma_sm80.cuh), each against its
// PTX ISA definition.

/// Bytes of a matrix of f32 (the test buffers carry raw bytes as f32 bit patterns).
fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

proptest! {
    #![proptest_config(common::proptest_config(16))]

    /// mma.m16n8k16 with fragments built per lane by the ISA layout equals A·B + C.
    #[test]
    fn mma_m16n8k16_fragments_match_isa(count in 1usize..4, scale in -3i32..4, seed in any::<u64>()) {
        let mut s = seed | 1;
        let mut rnd = move || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0 };
        let sc = 2f32.powi(scale);
        let a: Vec<bf16> = (0..256 * count).map(|_| bf16::from_f32(rnd() * sc)).collect();
        let b: Vec<bf16> = (0..128 * count).map(|_| bf16::from_f32(rnd())).collect();
        let c: Vec<f32> = (0..128 * count).map(|_| rnd()).collect();
        for dev in devices() {
            let (am, bm, cm) = (dev.upload(256 * count, 1, &a).unwrap(), dev.upload(128 * count, 1, &b).unwrap(), dev.upload(128 * count, 1, &c).unwrap());
            let mut d = poison(&dev, 128 * count);
            selftest::mma(&dev, &am, &bm, &cm, &mut d, count).unwrap();
            let got = d.to_vec().unwrap();
            for blk in 0..count {
                for i in 0..16 {
                    for j in 0..8 {
                        let mut acc = f64::from(c[128 * blk + 8 * i + j]);
                        let mut mag = acc.abs();
                        for k in 0..16 {
                            let p = f64::from(a[256 * blk + 16 * i + k].to_f32()) * f64::from(b[128 * blk + 8 * k + j].to_f32());
                            acc += p;
                            mag += p.abs();
                        }
                        // bf16 products are exact in f32; 16 f32 additions round by ≤ 2^-24
                        // of a partial sum ≤ mag each. Hardware may truncate: allow 4x.
                        let tol = 4.0 * 18.0 * 2f64.powi(-24) * mag;
                        let g = f64::from(got[128 * blk + 8 * i + j]);
                        prop_assert!((g - acc).abs() <= tol, "block {} ({}, {}): {} vs {}", blk, i, j, g, acc);
                    }
                }
            }
        }
    }

    /// ldmatrix.x4 (and .trans) hands lane p the ISA's elements of the rows the lanes address.
    #[test]
    fn ldmatrix_x4_matches_isa(rows in proptest::array::uniform32(0usize..64), seed in any::<u64>()) {
        let input: Vec<u16> = (0..512u64).map(|i| ((i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed) >> 17) as u16 & 0x7f7f).collect();
        let input_bf: Vec<bf16> = input.iter().map(|&u| bf16::from_bits(u)).collect();
        for dev in devices() {
            let im = dev.upload(512, 1, &input_bf).unwrap();
            let mut out = poison(&dev, 256);
            selftest::ldmatrix(&dev, &im, &rows, &mut out).unwrap();
            let got: Vec<u32> = out.to_vec().unwrap().iter().map(|x| x.to_bits()).collect();
            // Matrix j, row i = the 8 elements at the address of lane 8j + i.
            let m = |j: usize, i: usize, c: usize| u32::from(input[8 * rows[8 * j + i] + c]);
            for p in 0..32 {
                let (r, c) = (p / 4, 2 * (p % 4));
                for j in 0..4 {
                    let plain = m(j, r, c) | m(j, r, c + 1) << 16;
                    let trans = m(j, c, r) | m(j, c + 1, r) << 16;
                    prop_assert_eq!(got[4 * p + j], plain, "lane {} reg {}", p, j);
                    prop_assert_eq!(got[128 + 4 * p + j], trans, "lane {} reg {} .trans", p, j);
                }
            }
        }
    }

    /// cp.async: after wait_group N every older group has landed (src-size bytes copied, the
    /// rest of the 16 zero); the emulator performs a group only when a wait lets it complete.
    #[test]
    fn cp_async_groups_complete_in_order(threads in prop_oneof![Just(1u32), Just(32), Just(96), Just(256)], seed in any::<u64>()) {
        let t = threads as usize;
        let mut s = seed | 1;
        let mut next = move || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s };
        let src: Vec<f32> = (0..12 * t).map(|_| f32::from_bits(next() as u32 & 0x3fff_ffff)).collect();
        let bytes: Vec<i32> = (0..3 * t).map(|_| (next() % 17) as i32).collect();
        for dev in devices() {
            let sm = dev.upload(12 * t, 1, &src).unwrap();
            let mut out = poison(&dev, 12 * t);
            let mut early = poison(&dev, 4 * t);
            selftest::cp_async(&dev, &sm, &bytes, &mut out, &mut early, threads).unwrap();
            let (want_src, got) = (bytes_of(&src), bytes_of(&out.to_vec().unwrap()));
            for (ch, &nb) in bytes.iter().enumerate() {
                for byte in 0..16 {
                    let want = if (byte as i32) < nb { want_src[16 * ch + byte] } else { 0 };
                    prop_assert_eq!(got[16 * ch + byte], want, "chunk {} byte {}", ch, byte);
                }
            }
            if matches!(dev, Device::Emulated) {
                // Group 2 was still in flight: the emulator shows the shared-memory poison.
                prop_assert!(bytes_of(&early.to_vec().unwrap()).iter().all(|&b| b == 0xff));
            }
        }
    }
}

/// The engine's swizzle permutes the chunks of each row, and the 8 rows an ldmatrix matrix
/// reads (consecutive rows, same logical chunk) fall in 8 distinct 16-byte slots of the
/// 128-byte bank window: no bank conflicts.
#[test]
fn swizzle_is_a_conflict_free_permutation() {
    for dev in devices() {
        let mut out = poison(&dev, 4096);
        selftest::swizzle(&dev, &mut out).unwrap();
        let got = download_i32(&out);
        for k in 0..4 {
            let chunks = 2usize << k;
            let off = |row: usize, c: usize| got[(k * 64 + row) * 16 + c] as usize;
            for row in 0..64 {
                let mut seen: Vec<usize> = (0..chunks).map(|c| off(row, c)).collect();
                seen.sort_unstable();
                let want: Vec<usize> = (0..chunks).map(|c| (row * chunks + c) * 8).collect();
                assert_eq!(seen, want, "chunks {chunks}, row {row}: not a permutation");
            }
            for row0 in (0..64).step_by(8) {
                for c in 0..chunks {
                    // Element offset · 2 bytes / 16 bytes, modulo the 8 slots of 128 bytes.
                    let mut slots: Vec<usize> =
                        (row0..row0 + 8).map(|r| off(r, c) / 8 % 8).collect();
                    slots.sort_unstable();
                    slots.dedup();
                    assert_eq!(
                        slots.len(),
                        8,
                        "chunks {chunks}, rows {row0}.., chunk {c}: bank conflict"
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(24))]

    /// The GEMM engine on ragged shapes (M, N, K off every tile, slice and granule size,
    /// below 16 included), all four operand layouts, against f64 on the bf16 inputs.
    #[test]
    fn gemm_engine_matches_f64(
        m in prop_oneof![1usize..=20, 120usize..=140, 250usize..=260],
        n in prop_oneof![1usize..=20, 120usize..=140],
        k in prop_oneof![1usize..=17, 30usize..=100],
        a_k_outer in any::<bool>(),
        b_k_inner in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut s = seed | 1;
        let mut rnd = move || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0 };
        // Logical A[i][l] (m x k) and B[l][j] (k x n), bf16-rounded.
        let a: Vec<bf16> = (0..m * k).map(|_| bf16::from_f32(rnd())).collect();
        let b: Vec<bf16> = (0..k * n).map(|_| bf16::from_f32(rnd())).collect();
        let a_st: Vec<bf16> = if a_k_outer { (0..m * k).map(|x| a[(x % m) * k + x / m]).collect() } else { a.clone() };
        let b_st: Vec<bf16> = if b_k_inner { (0..k * n).map(|x| b[(x % k) * n + x / k]).collect() } else { b.clone() };
        for dev in devices() {
            let (am, bm) = (dev.upload(m * k, 1, &a_st).unwrap(), dev.upload(k * n, 1, &b_st).unwrap());
            let mut d = poison(&dev, m * n);
            selftest::gemm(&dev, &am, &bm, &mut d, (m, n, k), a_k_outer, b_k_inner).unwrap();
            let got = d.to_vec().unwrap();
            for i in 0..m {
                for j in 0..n {
                    let (mut acc, mut mag) = (0.0f64, 0.0f64);
                    for l in 0..k {
                        let p = f64::from(a[i * k + l].to_f32()) * f64::from(b[l * n + j].to_f32());
                        acc += p;
                        mag += p.abs();
                    }
                    // bf16 products are exact in f32; the k f32 additions each round by
                    // ≤ 2^-24 of a partial sum ≤ mag. Hardware may truncate: allow 4x.
                    let tol = 4.0 * (k as f64 + 1.0) * 2f64.powi(-24) * mag + 1e-30;
                    let g = f64::from(got[i * n + j]);
                    prop_assert!((g - acc).abs() <= tol, "({}, {}) of {}x{}x{}: {} vs {}", i, j, m, n, k, g, acc);
                }
            }
        }
    }
}
