use grng::cpu::newton::newton_inverse;
use grng::ops::newton::{NewtonOptions, NewtonStop};
use grng::MatRef;
use grng_testkit as common;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[test]
fn scratch() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut worst = (0.0, 0, 0.0);
    let mut worst_t = (0.0, 0, 0.0);
    for _ in 0..150 {
        let n = rng.random_range(1..=200usize);
        let kappa = 10f64.powf(rng.random_range(0.0..=3.0));
        let (a, _) = common::spd(&mut rng, n, kappa);
        let noise = 2e-8 * kappa + 5e-7;
        for stop in [NewtonStop::Floor, NewtonStop::Tol] {
            let o = NewtonOptions {
                stop,
                tol: if stop == NewtonStop::Tol { 1e-7 } else { 1e-4 },
                ..NewtonOptions::default()
            };
            if let Ok((x, _)) = newton_inverse(MatRef::new(&a, n, n).unwrap(), None, &o) {
                let r = common::residual64(&a, x.as_slice(), n) / noise;
                let w = if stop == NewtonStop::Floor {
                    &mut worst
                } else {
                    &mut worst_t
                };
                if r > w.0 {
                    *w = (r, n, kappa);
                }
            }
        }
    }
    eprintln!("floor worst ratio {worst:?}; tol=1e-7 worst {worst_t:?}");
}
