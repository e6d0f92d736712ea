//! PLACEHOLDER until grng_candle::{LoraConfig, LoraLinear} lands on main: same API.
#![allow(missing_docs)]
use candle_core::{DType, Module, Tensor};
use grng::Result;
use grng_candle::KronLinear;

fn c(e: candle_core::Error) -> grng::Error {
    grng::Error::Candle(e.to_string())
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f32,
}
impl Default for LoraConfig {
    fn default() -> Self {
        Self { rank: 8, alpha: 8.0 }
    }
}
#[derive(Clone, Debug)]
pub struct LoraLinear {
    w0t: Tensor,
    b0: Option<Tensor>,
    a: KronLinear,
    b: KronLinear,
    scale: f64,
}
impl LoraLinear {
    pub fn new<R: rand::Rng + ?Sized>(
        w0: &Tensor,
        b0: Option<&Tensor>,
        config: LoraConfig,
        rng: &mut R,
    ) -> Result<Self> {
        let (d_out, d_in) = w0.dims2().map_err(c)?;
        let r = config.rank;
        let bound = 1.0 / (d_in as f32).sqrt();
        let a0: Vec<f32> = (0..r * (d_in + 1))
            .map(|i| if i % (d_in + 1) == d_in { 0.0 } else { rng.random_range(-bound..bound) })
            .collect();
        let dev = w0.device();
        let a0 = Tensor::from_vec(a0, (r, d_in + 1), dev).map_err(c)?;
        let bz = Tensor::zeros((d_out, r + 1), DType::F32, dev).map_err(c)?;
        Ok(Self {
            w0t: w0.t().and_then(|w| w.contiguous()).map_err(c)?,
            b0: b0.cloned(),
            a: KronLinear::from_weights(&a0)?,
            b: KronLinear::from_weights(&bz)?,
            scale: config.alpha as f64 / r as f64,
        })
    }
    pub fn adapters(&self) -> [KronLinear; 2] {
        [self.a.clone(), self.b.clone()]
    }
    pub fn forward_eval(&self, x: &Tensor) -> Result<Tensor> {
        self.with(x, |l, u| l.forward_eval(u))
    }
    pub fn forward_record(&self, x: &Tensor) -> Result<Tensor> {
        self.with(x, |l, u| l.forward(u).map_err(c))
    }
    fn with(&self, x: &Tensor, f: impl Fn(&KronLinear, &Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let low = f(&self.b, &f(&self.a, x)?)?;
        (|| {
            let mut y = x.broadcast_matmul(&self.w0t)?;
            if let Some(b0) = &self.b0 {
                y = y.broadcast_add(b0)?;
            }
            y.add(&low.affine(self.scale, 0.0)?)
        })()
        .map_err(c)
    }
}
impl Module for LoraLinear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_record(xs).map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}
