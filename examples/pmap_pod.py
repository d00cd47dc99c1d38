"""A pmap train step as on a TPU pod, with one gradient all-reduce per optimizer step.

Every device takes its own slice of each micro-batch; ``accumulate(...,
axis_name="batch")`` keeps a local sum per device and reduces across devices
once per window of K micro-steps, inside the window-boundary branch. The
script trains a small MLP on scikit-learn's digits that way, trains the same
model on one device with one step per window on the window's whole global
batch, and prints the largest parameter difference (float32 rounding) and the
all-reduce ops in the compiled step.

On CPU it forces 8 host devices (the flag is ignored by TPU and GPU backends).
On a multi-host pod, run the same script on every host after
``jax.distributed.initialize()``: pmap's axis then spans all hosts' devices
and each host feeds its local devices (see docs/distributed.md).

    python examples/pmap_pod.py [--steps 60] [--k 4] [--per-device-batch 8] [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import gradaccum_jax as ga


def init_params(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) * jnp.sqrt(2.0 / m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def loss_fn(params, x, y):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (windows)")
    parser.add_argument("--k", type=int, default=4, help="micro-steps per window")
    parser.add_argument("--per-device-batch", type=int, default=8, help="examples per device")
    parser.add_argument("--quick", action="store_true", help="a few steps of a smaller model")
    args = parser.parse_args(argv)
    steps, hidden = (4, 32) if args.quick else (args.steps, 128)
    k, b = args.k, args.per_device_batch
    n_dev = jax.local_device_count()

    digits = load_digits()
    x_all = np.asarray(digits.data / 16.0, np.float32)
    y_all = np.asarray(digits.target, np.int32)
    params = init_params(jax.random.key(0), [64, hidden, hidden, 10])
    inner = optax.adamw(1e-3, weight_decay=1e-4)
    tx = ga.accumulate(inner, every_k_schedule=k, axis_name="batch")

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # this device's slice
        updates, opt_state = tx.update(grads, opt_state, params)
        # The loss stays per device: a pmean here would be an all-reduce per micro-step.
        return optax.apply_updates(params, updates), opt_state, loss

    p_step = jax.pmap(train_step, axis_name="batch", donate_argnums=(0, 1))
    # One copy of params and optimizer state per device, as pmap expects.
    replicated = jax.tree.map(lambda a: jnp.broadcast_to(a, (n_dev, *a.shape)), params)
    opt_state = jax.pmap(tx.init)(replicated)
    p_params = replicated

    @jax.jit
    def large_batch_step(params, state, x, y):
        updates, state = inner.update(jax.grad(loss_fn)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    ref_params, ref_state = params, inner.init(params)
    sample = (x_all[: n_dev * b].reshape(n_dev, b, -1), y_all[: n_dev * b].reshape(n_dev, b))
    # Compile once, read the program, and train with that executable.
    p_step = p_step.lower(p_params, opt_state, *sample).compile()
    hlo = p_step.as_text()
    n_all_reduce = len(re.findall(r"\ball-reduce(?:-start)?\(", hlo))

    rng = np.random.default_rng(0)
    for step in range(steps):
        idx = rng.choice(len(x_all), size=k * n_dev * b, replace=False)
        x, y = x_all[idx], y_all[idx]
        for i in range(k):
            sl = slice(i * n_dev * b, (i + 1) * n_dev * b)
            p_params, opt_state, loss = p_step(
                p_params, opt_state, x[sl].reshape(n_dev, b, -1), y[sl].reshape(n_dev, b)
            )
        ref_params, ref_state = large_batch_step(ref_params, ref_state, x, y)
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss of the last micro-batch {float(loss.mean()):.4f}")

    ours = jax.tree.map(lambda a: a[0], p_params)
    diffs = jax.tree.map(lambda a, c: jnp.max(jnp.abs(a - c)), ours, ref_params)
    max_diff = max(float(d) for d in jax.tree.leaves(diffs))
    skipped = int(np.asarray(opt_state.num_skipped).sum())
    print(
        f"devices: {n_dev}, micro-steps per window: {k}, global batch per window: {k * n_dev * b}"
    )
    print(f"optimizer steps: {int(opt_state.gradient_step[0])}, micro-gradients skipped: {skipped}")
    print(
        f"all-reduce ops in the compiled step: {n_all_reduce} (gradients + weight, at window ends)"
    )
    print(f"largest parameter difference to one-device large-batch training: {max_diff:.3e}")
    return {"max_diff": max_diff, "all_reduce_ops": n_all_reduce, "steps": steps}


if __name__ == "__main__":
    main(sys.argv[1:])
