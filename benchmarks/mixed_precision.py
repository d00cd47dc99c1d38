"""Accuracy and memory of the accumulator dtypes for 16-bit gradients.

Accuracy: per-micro-batch gradients of a Flax MLP on scikit-learn's digits,
computed in bfloat16 with float32 parameters (``dtype=bfloat16,
param_dtype=float32``, so every gradient value is a bfloat16 number), are
averaged over windows of K in {4, 16, 64} micro-steps by ``accumulate`` with
each accumulator, and compared with the float64 mean of the same gradients.
Two regimes: at initialisation, and after training, where micro-gradients
disagree more and their mean is smaller than each of them.

Memory: ``compiled.memory_analysis()`` of one jitted micro-step (Adam inner,
optimizer state donated) on a parameter tree of P float32 values, for each
accumulator: the accumulator's state bytes per parameter, the program's temp
bytes per parameter, and the number of state buffers the HLO copies instead of
updating in place. The micro-step time relative to the float32 accumulator is
measured interleaved (median of repetitions).

    python benchmarks/mixed_precision.py [--quick]
"""

from __future__ import annotations

import flax.linen as nn
import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import gradaccum_jax as ga

ACCUMULATORS = {
    "float32 (default)": {},
    "bfloat16": {"accumulator_dtype": jnp.bfloat16},
    "bfloat16 + Kahan": {"accumulator_dtype": jnp.bfloat16, "compensated": True},
}


class MLP(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(nn.Dense(self.hidden, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x))
        logits = nn.Dense(10, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)
        return logits.astype(jnp.float32)


def micro_gradients(hidden: int, k: int, micro_batch: int, train_steps: int, seed: int):
    """Returns {regime: list of k gradient trees} for an MLP on digits."""
    digits = load_digits()
    x_all = jnp.asarray(digits.data / 16.0, jnp.float32)
    y_all = jnp.asarray(digits.target, jnp.int32)
    model = MLP(hidden)
    params = model.init(jax.random.key(seed), x_all[:1])["params"]

    def loss_fn(p, x, y):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grad_fn = jax.jit(jax.grad(loss_fn))
    rng = np.random.default_rng(seed)

    def window(p):
        idx = rng.choice(x_all.shape[0], size=k * micro_batch, replace=False)
        return [
            grad_fn(p, x_all[idx[i::k]], y_all[idx[i::k]])  # strided: k disjoint micro-batches
            for i in range(k)
        ]

    out = {"init": window(params)}
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(p, s, x, y):
        g = jax.grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for _ in range(train_steps):
        idx = rng.choice(x_all.shape[0], size=64, replace=False)
        params, opt_state = train_step(params, opt_state, x_all[idx], y_all[idx])
    out["trained"] = window(params)
    return out


def window_mean(grads, **accumulator):
    """The mean ``accumulate`` hands to its inner transformation, float32."""
    tx = ga.accumulate(optax.identity(), len(grads), **accumulator)
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)

    @jax.jit
    def run(stacked):
        def body(state, g):
            update, state = tx.update(g, state)
            return state, update

        _, updates = jax.lax.scan(body, tx.init(grads[0]), stacked)
        return jax.tree.map(lambda u: u[-1], updates)

    return run(stacked)


def errors(mean, grads):
    ref = [
        np.mean(np.stack([np.asarray(g, np.float64) for g in leaves]), axis=0)
        for leaves in zip(*[jax.tree.leaves(g) for g in grads], strict=True)
    ]
    got = [np.asarray(m, np.float64) for m in jax.tree.leaves(mean)]
    diff = np.concatenate([(g - r).ravel() for g, r in zip(got, ref, strict=True)])
    ref_flat = np.concatenate([r.ravel() for r in ref])
    return (
        float(np.linalg.norm(diff) / np.linalg.norm(ref_flat)),
        float(np.max(np.abs(diff)) / np.max(np.abs(ref_flat))),
    )


def accuracy_rows(quick: bool) -> list[dict]:
    ks = (4,) if quick else (4, 16, 64)
    rows = []
    for k in ks:
        sets = micro_gradients(
            hidden=64 if quick else 512,
            k=k,
            micro_batch=16,
            train_steps=20 if quick else 300,
            seed=k,
        )
        for regime, grads in sets.items():
            for name, accumulator in ACCUMULATORS.items():
                rel_l2, rel_max = errors(window_mean(grads, **accumulator), grads)
                rows.append(
                    {
                        "table": "accuracy",
                        "accumulator": name,
                        "K": k,
                        "regime": regime,
                        "rel_l2_error": rel_l2,
                        "rel_max_error": rel_max,
                    }
                )
    return rows


def argument_copies(compiled) -> int:
    """Copies of the step's arguments: state XLA did not update in place."""
    hlo = harness.Hlo(compiled)
    copies = hlo.copies(1, within=[hlo.entry])
    return sum(hlo.source(c) == "parameter" for c in copies)


def memory_rows(quick: bool, reps: int) -> list[dict]:
    n = 1 << (16 if quick else 23)
    params = {"w1": jnp.zeros((n // 2,), jnp.float32), "w2": jnp.zeros((n // 2,), jnp.float32)}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), params)
    compiled, states = {}, {}
    rows = []
    for name, accumulator in ACCUMULATORS.items():
        tx = ga.accumulate(optax.adam(1e-3), 4, **accumulator)
        state = tx.init(params)

        # State first in the outputs, so each donated buffer aliases its successor.
        def step(g, s, p, tx=tx):
            u, s = tx.update(g, s, p)
            return s, u

        c = jax.jit(step, donate_argnums=(1,)).lower(grads, state, params).compile()
        m = harness.compiled_memory(c)
        copies = argument_copies(c)
        acc_bytes = sum(
            x.nbytes for x in jax.tree.leaves((state.acc_grads, state.acc_compensation))
        )
        compiled[name], states[name] = c, state
        rows.append(
            {
                "table": "memory",
                "accumulator": name,
                "params": n,
                "accumulator_bytes_per_param": acc_bytes / n,
                "temp_bytes_per_param": m.temp_bytes / n,
                "argument_copies": copies,
            }
        )

    def micro_step(name):
        def call():
            states[name], _ = compiled[name](grads, states[name], params)
            return states[name]

        return call

    times = harness.interleaved_medians({name: micro_step(name) for name in ACCUMULATORS}, reps)
    for row in rows:
        row["micro_step_time_vs_float32"] = times[row["accumulator"]] / times["float32 (default)"]
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__)
    args = parser.parse_args(argv)

    rows = accuracy_rows(args.quick)
    print("Error of the window mean against float64 (bfloat16-valued gradients)")
    print(f"{'accumulator':<20}{'K':>4}  {'regime':<8}{'rel L2':>10}{'rel max':>10}")
    for r in rows:
        print(
            f"{r['accumulator']:<20}{r['K']:>4}  {r['regime']:<8}"
            f"{r['rel_l2_error']:>10.2e}{r['rel_max_error']:>10.2e}"
        )
    mem = memory_rows(args.quick, reps=3 if args.quick else 15)
    print(f"\nMemory of one donated micro-step, P = {mem[0]['params']} float32 parameters, Adam")
    print(f"{'accumulator':<20}{'state B/param':>14}{'temp B/param':>14}{'copies':>8}{'time':>8}")
    for r in mem:
        print(
            f"{r['accumulator']:<20}{r['accumulator_bytes_per_param']:>14.2f}"
            f"{r['temp_bytes_per_param']:>14.2f}{r['argument_copies']:>8d}"
            f"{r['micro_step_time_vs_float32']:>8.2f}"
        )
    return rows + mem


if __name__ == "__main__":
    main()
