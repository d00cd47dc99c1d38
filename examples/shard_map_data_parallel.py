"""Data-parallel training with jax.shard_map and one gradient reduction per window.

Params are replicated over a 1-D mesh axis ``"data"``; each micro-batch is
split along it. Inside the ``shard_map`` body the gradient is taken with
respect to ``jax.lax.pcast(params, "data", to="varying")``, so the backward
pass stays local (differentiating the replicated params would insert an
all-reduce on every micro-step), and ``accumulate(..., axis_name="data")``
sums the replicas' window sums once per window. The per-replica accumulators
cross the ``shard_map`` boundary on a leading replica axis
(``replica_state_specs``, ``add_replica_axis``, ``remove_replica_axis``).

The script trains a small MLP on scikit-learn's digits that way and on one
device with the whole window batch per step, prints the largest parameter
difference, and checks in the compiled step that every all-reduce sits inside
the window-boundary branch. On CPU it forces 8 host devices.

    python examples/shard_map_data_parallel.py [--steps 60] [--k 4] [--per-device-batch 8] [--quick]
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
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


def all_reduces_outside_conditionals(hlo: str) -> int:
    """All-reduce ops in the entry computation, i.e. run on every micro-step."""
    entry = hlo[hlo.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}\n")]
    return len(re.findall(r"\ball-reduce(?:-start)?\(", entry))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (windows)")
    parser.add_argument("--k", type=int, default=4, help="micro-steps per window")
    parser.add_argument("--per-device-batch", type=int, default=8, help="examples per device")
    parser.add_argument("--quick", action="store_true", help="a few steps of a smaller model")
    args = parser.parse_args(argv)
    steps, hidden = (4, 32) if args.quick else (args.steps, 128)
    k, b = args.k, args.per_device_batch

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    n_dev = mesh.devices.size
    digits = load_digits()
    x_all = np.asarray(digits.data / 16.0, np.float32)
    y_all = np.asarray(digits.target, np.int32)
    params = init_params(jax.random.key(0), [64, hidden, hidden, 10])
    inner = optax.adamw(1e-3, weight_decay=1e-4)
    tx = ga.accumulate(inner, every_k_schedule=k, axis_name="data")

    # Counters and Adam's moments replicated; each replica's accumulator in
    # its own slot of a leading replica axis.
    state_specs = ga.replica_state_specs(jax.eval_shape(tx.init, params), "data")

    def train_step(params, opt_state, x, y):
        opt_state = ga.remove_replica_axis(opt_state)
        local = jax.lax.pcast(params, "data", to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(local, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        # Updates are replica-invariant (reduced), so the params stay replicated.
        return optax.apply_updates(params, updates), ga.add_replica_axis(opt_state), loss[None]

    step = jax.jit(
        jax.shard_map(
            train_step,
            mesh=mesh,
            in_specs=(P(), state_specs, P("data"), P("data")),
            out_specs=(P(), state_specs, P("data")),
        ),
        donate_argnums=(0, 1),
    )
    init = jax.jit(
        jax.shard_map(
            lambda p: ga.add_replica_axis(tx.init(p)),
            mesh=mesh,
            in_specs=P(),
            out_specs=state_specs,
        )
    )

    @jax.jit
    def large_batch_step(params, state, x, y):
        updates, state = inner.update(jax.grad(loss_fn)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    batch = NamedSharding(mesh, P("data"))
    # From a host copy: the step donates its params, and device_put may share buffers.
    d_params = jax.device_put(jax.tree.map(np.asarray, params), NamedSharding(mesh, P()))
    opt_state = init(d_params)
    ref_params, ref_state = params, inner.init(params)
    sample = [jax.device_put(a[: n_dev * b], batch) for a in (x_all, y_all)]
    # Compile once, read the program, and train with that executable.
    step = step.lower(d_params, opt_state, *sample).compile()
    hlo = step.as_text()
    total = len(re.findall(r"\ball-reduce(?:-start)?\(", hlo))
    per_micro_step = all_reduces_outside_conditionals(hlo)

    rng = np.random.default_rng(0)
    for i_step in range(steps):
        idx = rng.choice(len(x_all), size=k * n_dev * b, replace=False)
        x, y = x_all[idx], y_all[idx]
        for i in range(k):
            sl = slice(i * n_dev * b, (i + 1) * n_dev * b)
            d_params, opt_state, loss = step(
                d_params, opt_state, jax.device_put(x[sl], batch), jax.device_put(y[sl], batch)
            )
        ref_params, ref_state = large_batch_step(ref_params, ref_state, x, y)
        if i_step % 10 == 0 or i_step == steps - 1:
            print(f"step {i_step:3d}  loss of the last micro-batch {float(loss.mean()):.4f}")

    diffs = jax.tree.map(lambda a, c: jnp.max(jnp.abs(a - c)), d_params, ref_params)
    max_diff = max(float(d) for d in jax.tree.leaves(diffs))
    skipped = int(np.asarray(opt_state.num_skipped).sum())  # per-replica counts, summed
    print(f"devices: {n_dev}, micro-steps per window: {k}, window batch: {k * n_dev * b}")
    print(f"optimizer steps: {int(opt_state.gradient_step)}, micro-gradients skipped: {skipped}")
    print(f"all-reduce ops in the compiled step: {total}, on every micro-step: {per_micro_step}")
    print(f"largest parameter difference to one-device large-batch training: {max_diff:.3e}")
    return {
        "max_diff": max_diff,
        "all_reduce_ops": total,
        "all_reduce_ops_per_micro_step": per_micro_step,
        "steps": steps,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
