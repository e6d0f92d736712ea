#!/usr/bin/env python3
"""Peer step times for `cargo bench --bench step`: optax AdamW and kfac-jax K-FAC on XLA's CPU.

Same problem as the bench: MLP 784-1024-1024-10, tanh hidden layers, softmax cross-entropy,
batch 256, f32. Every step is one jitted call (forward, backward, curvature, update); the table
prints the median over timed runs of 8 steps after warm-up (compilation excluded).

Rerun (kfac-jax 0.0.8 needs exactly jax 0.8.2; newer jax breaks it), outside the repo:

    python3 -m venv /work/venv-peer
    /work/venv-peer/bin/pip install kfac-jax==0.0.8 jax==0.8.2 jaxlib==0.8.2 optax
    /work/venv-peer/bin/python scripts/peer_kfac_jax.py            # --steps 10 --shape 784-1024-1024-10 --batch 256

AdamW against optax, interleaved (each round: the optax row, then our AdamW step):

    for r in 1 2 3 4 5; do
        /work/venv-peer/bin/python scripts/peer_kfac_jax.py --only-adamw --steps 20 | tail -1
        GRNG_BENCH_ONLY=adamw cargo bench --bench step -- --warm-up-time 1 --measurement-time 3 | grep time:
    done

Run it in the same session as `cargo bench --bench step` and compare ratios: the 2-core
machines are noisy.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import kfac_jax
import optax


def init_params(key, sizes):
    """Glorot-uniform weights, zero biases (the init does not change the cost)."""
    params = []
    for d_in, d_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        lim = (6.0 / (d_in + d_out)) ** 0.5
        w = jax.random.uniform(sub, (d_in, d_out), jnp.float32, -lim, lim)
        params.append((w, jnp.zeros((d_out,), jnp.float32)))
    return params


def logits_fn(params, x):
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def loss_fn(params, batch):
    x, y = batch
    logits = logits_fn(params, x)
    # Registers the output distribution so kfac-jax can sample labels (the true Fisher).
    kfac_jax.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def median_ms(step, steps, warmup):
    """Median wall time of `step()` in ms; `step` must block until its result is ready.

    Each timed sample is a run of 8 consecutive steps (divided by 8), so an every-8-steps
    inverse is amortized as criterion's mean over consecutive steps amortizes RING's S = 8."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(8):
            step()
        times.append((time.perf_counter() - t0) / 8)
    return 1e3 * statistics.median(times)


def bench_adamw(params, batch, steps, warmup):
    opt = optax.adamw(1e-5, weight_decay=1e-4)
    state = {"p": params, "s": opt.init(params)}

    @jax.jit
    def train_step(p, s, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    def step():
        state["p"], state["s"], loss = train_step(state["p"], state["s"], batch)
        loss.block_until_ready()

    return median_ms(step, steps, warmup)


def bench_kfac(params, batch, inverse_every, steps, warmup):
    opt = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss_fn),
        l2_reg=0.0,
        use_adaptive_learning_rate=False,
        use_adaptive_momentum=False,
        use_adaptive_damping=False,
        learning_rate_schedule=lambda _: 1e-3,
        momentum_schedule=lambda _: 0.0,
        damping_schedule=lambda _: 1e-3,
        inverse_update_period=inverse_every,
        estimation_mode="fisher_gradients",
        multi_device=False,
        num_burnin_steps=0,  # the timed batch is fixed; no data iterator to burn in on
    )
    rng = jax.random.PRNGKey(1)
    rng, sub = jax.random.split(rng)
    params = jax.tree.map(jnp.copy, params)  # kfac-jax donates (deletes) its input buffers
    state = {"p": params, "s": opt.init(params, sub, batch), "rng": rng}

    def step():
        state["rng"], sub = jax.random.split(state["rng"])
        state["p"], state["s"], stats = opt.step(state["p"], state["s"], sub, batch=batch)
        jax.block_until_ready(stats["loss"])

    # Warm-up covers a full inverse period so the median sees the amortized mix.
    return median_ms(step, steps, max(warmup, inverse_every + 2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="784-1024-1024-10")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10, help="timed samples of 8 steps per row")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--only-adamw", action="store_true",
                    help="the optax row only (about 5 s: for interleaving with `cargo bench`)")
    args = ap.parse_args()
    sizes = [int(w) for w in args.shape.split("-")]

    key = jax.random.PRNGKey(0)
    kp, kx, ky = jax.random.split(key, 3)
    params = init_params(kp, sizes)
    x = jax.random.uniform(kx, (args.batch, sizes[0]), jnp.float32)
    y = jax.random.randint(ky, (args.batch,), 0, sizes[-1])
    batch = (x, y)

    rows = [("optax AdamW (forward, backward, update)", bench_adamw(params, batch, args.steps, args.warmup))]
    if not args.only_adamw:
        rows += [
            ("kfac-jax K-FAC, inverse every 8 steps", bench_kfac(params, batch, 8, args.steps, args.warmup)),
            ("kfac-jax K-FAC, inverse every step", bench_kfac(params, batch, 1, args.steps, args.warmup)),
        ]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"kfac-jax {kfac_jax.__version__}, optax {optax.__version__}; "
          f"MLP {args.shape}, batch {args.batch}, median of {args.steps} runs of 8 steps")
    print("| step | median |")
    print("|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} ms |")


if __name__ == "__main__":
    main()
