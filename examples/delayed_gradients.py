"""Training with delayed gradients: stale ones are dropped and counted.

Each tick, every worker reads the current parameters and the server's global
step, computes a gradient on its own micro-batch, and sends it; the gradient
arrives ``delay`` ticks later (``delay`` drawn at random in ``[0, max_delay]``),
stamped with the global step it was computed at. The server feeds arrivals to
``gradaccum_jax.conditional_accumulate(adam, num_required=workers, ...)``, which
drops gradients computed more than ``max_staleness`` optimizer steps ago.

Three runs on scikit-learn's digits with a small MLP:

1. delayed, ``max_staleness=0``: only gradients of the current step count;
2. delayed, ``max_staleness=1`` with stale ones down-weighted by ``1/(1+τ)``;
3. synchronous (every delay 0): nothing is stale, and the parameters equal, bit
   for bit, those of ``gradaccum_jax.accumulate(adam, K=workers)`` fed the same
   micro-batches, and those of one large batch to float32 rounding.

    python examples/delayed_gradients.py [--ticks 60] [--workers 4] [--max-delay 2]
    python examples/delayed_gradients.py --quick
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


grad_fn = jax.jit(jax.grad(loss_fn))


def make_server_step(tx):
    @jax.jit
    def step(params, opt_state, grads, local_step):
        updates, opt_state = tx.update(grads, opt_state, params, local_step=local_step)
        return optax.apply_updates(params, updates), opt_state

    return step


def make_plain_step(tx):
    @jax.jit
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def delayed_run(tx, step, params, data, batches, delays):
    """Simulates the workers and the server; returns final params and server state."""
    x_all, y_all = data
    ticks, workers = delays.shape
    opt_state = tx.init(params)
    in_flight = []  # (arrival tick, worker, gradient, local step)
    delivered = 0
    for t in range(ticks):
        # Every worker reads the parameters and the global step now ...
        global_step = int(opt_state.accumulator.global_step)
        for w in range(workers):
            idx = batches[t, w]
            grads = grad_fn(params, x_all[idx], y_all[idx])
            in_flight.append((t + int(delays[t, w]), w, grads, global_step))
        # ... and the server applies whatever has arrived by now, in order.
        in_flight.sort(key=lambda item: (item[0], item[1]))
        while in_flight and in_flight[0][0] <= t:
            _, _, grads, local_step = in_flight.pop(0)
            params, opt_state = step(params, opt_state, grads, local_step)
            delivered += 1
    return params, opt_state, delivered


def max_abs_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b, strict=True))


def leaves(tree):
    return jax.tree.leaves(tree)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=60, help="ticks of the simulation")
    parser.add_argument("--workers", type=int, default=4, help="workers = num_required")
    parser.add_argument("--max-delay", type=int, default=2, help="largest delay in ticks")
    parser.add_argument("--micro-batch", type=int, default=32, help="examples per gradient")
    parser.add_argument("--quick", action="store_true", help="reduced size (a smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.ticks = 8

    digits = load_digits()
    data = (
        jnp.asarray(digits.data / 16.0, jnp.float32),
        jnp.asarray(digits.target, jnp.int32),
    )
    n, k, b = data[0].shape[0], args.workers, args.micro_batch
    rng = np.random.default_rng(0)
    batches = np.stack(
        [[rng.choice(n, size=b, replace=False) for _ in range(k)] for _ in range(args.ticks)]
    )
    delays = rng.integers(0, args.max_delay + 1, size=(args.ticks, k))
    params0 = init_params(jax.random.key(0), [64, 64, 10])
    adam = optax.adam(3e-3)
    results: dict[str, float] = {}

    def full_loss(params) -> float:
        return float(loss_fn(params, *data))

    strict = ga.conditional_accumulate(adam, k)
    strict_step = make_server_step(strict)
    runs = {
        "strict": ("delayed, max_staleness=0", strict),
        "lenient": (
            "delayed, max_staleness=1, weight 1/(1+tau)",
            ga.conditional_accumulate(
                adam, k, max_staleness=1, staleness_weight=lambda tau: 1.0 / (1.0 + tau)
            ),
        ),
    }
    for key, (label, tx) in runs.items():
        step = strict_step if tx is strict else make_server_step(tx)
        params, state, delivered = delayed_run(tx, step, params0, data, batches, delays)
        acc = state.accumulator
        results[f"dropped_{key}"] = float(acc.num_stale)
        results[f"delivered_{key}"] = float(delivered)
        results[f"loss_{key}"] = full_loss(params)
        print(
            f"{label}: delivered {delivered}, dropped as stale {int(acc.num_stale)}, "
            f"optimizer steps {int(acc.global_step)}, loss {results[f'loss_{key}']:.4f}"
        )

    # Synchronous: every delay 0, so nothing is stale.
    p_sync, s_sync, _ = delayed_run(
        strict, strict_step, params0, data, batches, np.zeros_like(delays)
    )
    acc_tx = ga.accumulate(adam, k)
    acc_step, big_step = make_plain_step(acc_tx), make_plain_step(adam)
    p_acc, s_acc = params0, acc_tx.init(params0)
    p_big, s_big = params0, adam.init(params0)
    for t in range(args.ticks):
        for w in range(k):
            idx = batches[t, w]
            p_acc, s_acc = acc_step(p_acc, s_acc, grad_fn(p_acc, data[0][idx], data[1][idx]))
        idx = batches[t].reshape(-1)
        p_big, s_big = big_step(p_big, s_big, grad_fn(p_big, data[0][idx], data[1][idx]))
    results["dropped_sync"] = float(s_sync.accumulator.num_stale)
    results["sync_vs_accumulate"] = max_abs_diff(leaves(p_sync), leaves(p_acc))
    results["sync_vs_large_batch"] = max_abs_diff(leaves(p_sync), leaves(p_big))
    results["steps_sync"] = float(s_sync.accumulator.global_step)
    results["loss_sync"] = full_loss(p_sync)
    print(
        f"synchronous: dropped {int(results['dropped_sync'])}, optimizer steps "
        f"{int(results['steps_sync'])}, loss {results['loss_sync']:.4f}"
    )
    print(f"largest parameter difference vs accumulate: {results['sync_vs_accumulate']:.3e}")
    print(f"largest parameter difference vs large batch: {results['sync_vs_large_batch']:.3e}")
    return results


if __name__ == "__main__":
    main()
