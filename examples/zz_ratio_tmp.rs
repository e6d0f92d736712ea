use faer::linalg::matmul::matmul;
use faer::{Accum, Par};
use grng::{Mat, MatRef, Trans};
use std::time::Instant;

fn main() {
    for n in [256usize, 512, 1024, 2048] {
        let reps = (6usize << 30) / (2 * n * n * n) + 5;
        let a: Vec<f32> = (0..n * n)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let am = Mat::from_vec(a.clone(), n, n).unwrap();
        let fa = faer::Mat::<f32>::from_fn(n, n, |i, j| a[i * n + j]);
        let mut fc = faer::Mat::<f32>::zeros(n, n);
        let mut c = Mat::zeros(n, n);
        let mut best = [f64::MAX; 4];
        for _ in 0..reps {
            let t = Instant::now();
            grng::cpu::gemm(
                Trans::No,
                Trans::No,
                1.0,
                am.as_ref(),
                am.as_ref(),
                0.0,
                c.as_mut(),
            )
            .unwrap();
            best[0] = best[0].min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            matmul(
                fc.as_mut(),
                Accum::Replace,
                fa.as_ref(),
                fa.as_ref(),
                1.0,
                Par::rayon(0),
            );
            best[1] = best[1].min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            grng::cpu::syrk_ema(MatRef::new(&a, n, n).unwrap(), 0.0, c.as_mut()).unwrap();
            best[2] = best[2].min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            matmul(
                fc.as_mut(),
                Accum::Replace,
                fa.transpose(),
                fa.as_ref(),
                1.0,
                Par::rayon(0),
            );
            best[3] = best[3].min(t.elapsed().as_secs_f64());
        }
        let gf = |t: f64| 2.0 * (n as f64).powi(3) / t / 1e9;
        println!(
            "n={n:5} reps={reps:3} gemm ours {:8.3} ms ({:5.0} GF) faer {:8.3} ms ({:5.0} GF) ratio {:.2} | syrk ours {:8.3} ms faer AtA {:8.3} ms ratio {:.2}",
            best[0] * 1e3, gf(best[0]), best[1] * 1e3, gf(best[1]), best[1] / best[0],
            best[2] * 1e3, best[3] * 1e3, best[3] / best[2]
        );
    }
}
