//! [`Checkpoint`] for the reference MLP (kind `mlp`: `sizes` u64s, `activation`, `loss`,
//! `params` `[n]`), next to the model it saves.

use grng::checkpoint::{Checkpoint, Reader, Writer};
use grng::error::{Error, Result};

use super::{Activation, Loss, Mlp};

fn activation_name(a: Activation) -> &'static str {
    match a {
        Activation::Relu => "relu",
        Activation::Tanh => "tanh",
    }
}

fn loss_name(l: Loss) -> &'static str {
    match l {
        Loss::SoftmaxCrossEntropy => "softmax_cross_entropy",
        Loss::SquaredError => "squared_error",
    }
}

impl Checkpoint for Mlp {
    fn save(&self, w: &mut Writer) -> Result<()> {
        let c = self.config();
        w.str("kind", "mlp")?;
        let sizes: Vec<u64> = c.sizes.iter().map(|&s| s as u64).collect();
        w.u64s("sizes", &sizes)?;
        w.str("activation", activation_name(c.activation))?;
        w.str("loss", loss_name(c.loss))?;
        w.tensor("params", &[self.num_params()], self.params())
    }

    fn load(&mut self, r: &Reader) -> Result<()> {
        r.expect_kind("mlp")?;
        let c = self.config();
        let sizes: Vec<u64> = c.sizes.iter().map(|&s| s as u64).collect();
        let stored = r.u64s("sizes")?;
        if stored != sizes.as_slice() {
            return Err(Error::Checkpoint(format!(
                "`sizes`: the checkpoint's network has widths {stored:?}, this one {sizes:?}"
            )));
        }
        for (name, want) in [
            ("activation", activation_name(c.activation)),
            ("loss", loss_name(c.loss)),
        ] {
            let got = r.str(name)?;
            if got != want {
                return Err(Error::Checkpoint(format!(
                    "`{name}`: the checkpoint's network uses {got}, this one {want}"
                )));
            }
        }
        let params = r.tensor("params", &[self.num_params()])?;
        self.set_params(params).map_err(|e| r.wrap_restore(e))
    }
}
