"""Train a small MLP on scikit-learn's digits twice: accumulated and large-batch.

Run A takes K micro-batches of size b per optimizer step through
``gradaccum_jax.accumulate``; run B takes one batch of size K*b through the
same optimizer. Both see the same examples in the same order, so their
parameters must agree to float32 rounding. The script prints both losses and
the largest parameter difference.

    python examples/train_mlp.py [--steps 60] [--k 4] [--micro-batch 64]
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import gradaccum_jax as ga


def init_params(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    params = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        key, sub = jax.random.split(key)
        scale = jnp.sqrt(2.0 / fan_in)
        params.append(
            {"w": jax.random.normal(sub, (fan_in, fan_out)) * scale, "b": jnp.zeros(fan_out)}
        )
    return params


def loss_fn(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_step(tx):
    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--k", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--micro-batch", type=int, default=64, help="micro-batch size")
    args = parser.parse_args()

    digits = load_digits()
    x_all = jnp.asarray(digits.data / 16.0, jnp.float32)
    y_all = jnp.asarray(digits.target, jnp.int32)
    k, b = args.k, args.micro_batch
    rng = np.random.default_rng(0)

    params0 = init_params(jax.random.key(0), [64, 128, 128, 10])
    schedule = optax.cosine_decay_schedule(3e-3, decay_steps=args.steps)
    inner = optax.adamw(schedule, weight_decay=1e-4)
    acc_tx = ga.accumulate(inner, every_k_schedule=k)

    p_acc, s_acc = params0, acc_tx.init(params0)
    p_big, s_big = params0, inner.init(params0)
    acc_step, big_step = make_step(acc_tx), make_step(inner)

    for step in range(args.steps):
        idx = rng.choice(x_all.shape[0], size=k * b, replace=False)
        x, y = x_all[idx], y_all[idx]
        micro_losses = []
        for i in range(k):
            sl = slice(i * b, (i + 1) * b)
            p_acc, s_acc, loss = acc_step(p_acc, s_acc, x[sl], y[sl])
            micro_losses.append(loss)
        p_big, s_big, big_loss = big_step(p_big, s_big, x, y)
        if step % 10 == 0 or step == args.steps - 1:
            print(
                f"step {step:3d}  accumulated loss {float(np.mean(micro_losses)):.4f}  "
                f"large-batch loss {float(big_loss):.4f}"
            )

    diffs = jax.tree.map(lambda a, c: jnp.max(jnp.abs(a - c)), p_acc, p_big)
    max_diff = max(float(d) for d in jax.tree.leaves(diffs))
    full_acc = float(loss_fn(p_acc, x_all, y_all))
    full_big = float(loss_fn(p_big, x_all, y_all))
    print(f"optimizer steps taken (accumulated): {int(ga.optimizer_step(s_acc))}")
    print(f"final loss on all digits: accumulated {full_acc:.6f}  large-batch {full_big:.6f}")
    print(f"largest parameter difference: {max_diff:.3e}")


if __name__ == "__main__":
    main()
