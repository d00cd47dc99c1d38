"""Flax NNX: `nnx.Optimizer` with `accumulate`, and `NNXAccumBatchNorm`, against the large batch.

`ga.accumulate(...)` is an optax transformation, so `nnx.Optimizer` takes it unchanged:
`optimizer.update(model, grads)` is called once per micro-batch and applies one Adam step
per window. The model normalises its inputs with `NNXAccumBatchNorm`, whose window is
committed once per optimizer step with `ga.flax.commit_nnx_batch_stats`. Two models train
side by side from the same weights on the same data, one on 4 micro-batches of 16 per step,
one on batches of 64 with `nnx.BatchNorm`; the script prints

* the largest difference between their running statistics (equal: the window's pooled
  statistics are the large batch's, and the inputs of this first layer do not depend on
  the parameters), and the same for plain `nnx.BatchNorm` under accumulation, which moves
  its statistics on every micro-batch;
* the largest difference between the parameters of an accumulated and a large-batch model
  without normalisation (float32 round-off).

    python examples/nnx_accumulate.py [--steps 40] [--k 4] [--micro-batch 16]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import gradaccum_jax as ga


class Classifier(nnx.Module):
    """Input normalisation (optional), one hidden layer, 4 classes."""

    def __init__(self, norm, rngs: nnx.Rngs):
        self.norm = norm(16, momentum=0.9, rngs=rngs) if norm else None
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        if self.norm is not None:
            x = self.norm(x)
        return self.out(nnx.gelu(self.hidden(x)))


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)  # with accumulate: one Adam step every K calls
    return loss


def make_data(num_steps: int, batch: int):
    key_x, key_w = jax.random.split(jax.random.key(0))
    # Features with an offset and unequal scales, so that normalising them matters.
    x = 3.0 + jax.random.normal(key_x, (num_steps, batch, 16)) * jnp.linspace(0.5, 4.0, 16)
    y = jnp.argmax((x - 3.0) @ jax.random.normal(key_w, (16, 4)), axis=-1)
    return x, y


def max_difference(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(u - v)))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def running_stats(model: Classifier):
    return {"mean": model.norm.mean[...], "var": model.norm.var[...]}


def train(norm, k: int, data, *, accumulated: bool, commit: bool = False):
    """One model and its optimizer over all steps; returns the model and its losses."""
    model = Classifier(norm, nnx.Rngs(0))  # same seed: identical weights in every run
    inner = optax.adam(1e-2)
    tx = ga.accumulate(inner, every_k_schedule=k) if accumulated else inner
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses = []
    for x, y in zip(*data, strict=True):
        if accumulated:
            for xs, ys in zip(jnp.split(x, k), jnp.split(y, k), strict=True):
                losses.append(float(train_step(model, optimizer, xs, ys)))
            if commit:
                ga.flax.commit_nnx_batch_stats(model)  # once per window, after its K calls
        else:
            losses.append(float(train_step(model, optimizer, x, y)))
    return model, optimizer, losses


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args(argv)
    k = args.k
    data = make_data(args.steps, k * args.micro_batch)

    big, _, big_losses = train(nnx.BatchNorm, k, data, accumulated=False)
    accum, optimizer, _ = train(ga.flax.NNXAccumBatchNorm, k, data, accumulated=True, commit=True)
    plain, _, _ = train(nnx.BatchNorm, k, data, accumulated=True)
    stats_diff = max_difference(running_stats(accum), running_stats(big))
    plain_diff = max_difference(running_stats(plain), running_stats(big))

    exact_big, _, _ = train(None, k, data, accumulated=False)
    exact_acc, _, _ = train(None, k, data, accumulated=True)
    param_diff = max_difference(nnx.state(exact_acc, nnx.Param), nnx.state(exact_big, nnx.Param))

    steps = int(ga.optimizer_step(optimizer.opt_state)[...])
    print(f"optimizer steps: {steps} (accumulated, {k} calls each), {args.steps} (large batch)")
    print(f"large-batch loss: first {big_losses[0]:.3f}, last {big_losses[-1]:.3f}")
    print(f"running statistics vs nnx.BatchNorm on the large batch: {stats_diff:.1e}")
    print(f"  nnx.BatchNorm under accumulation (moves every micro-batch): {plain_diff:.1e}")
    print(f"parameters without normalisation, accumulated vs large batch: {param_diff:.1e}")
    return {
        "optimizer_steps": steps,
        "stats_diff": stats_diff,
        "plain_stats_diff": plain_diff,
        "param_diff": param_diff,
        "first_loss": big_losses[0],
        "last_loss": big_losses[-1],
    }


if __name__ == "__main__":
    main()
