"""All-reduces and time per window: one reduction per window versus one per micro-step.

Data-parallel training inside ``jax.shard_map`` on 8 forced host CPU devices,
params replicated, an MLP of about 21 MB of float32 params, Adam, windows of
K in {4, 16} micro-steps. Two train steps, both jitted with params and
optimizer state donated:

* ours: ``accumulate(adam, K, axis_name="data")`` takes each replica's local
  gradient (params marked varying with ``jax.lax.pcast``) and sums across
  replicas once per window, inside the window-boundary branch;
* usual: ``jax.lax.pmean`` of the gradient on every micro-step, then
  ``optax.MultiSteps(adam, K)`` on the replicated mean.

For each K it prints all-reduce ops per window (read from the compiled HLO: an
op inside a conditional branch runs once per window, any other op once per
micro-step), the megabytes they reduce, and the time per window as a median
over repetitions in which the two candidates alternate; then the ratio
ours / usual.

    python benchmarks/distributed.py [--quick] [--reps N] [--per-replica B]
"""

from __future__ import annotations

import os
import sys

# XLA reads the device count once, when the CPU backend starts: set it before jax.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

AXIS = "data"
KS = (4, 16)


init_params = harness.mlp_host_params


def loss_fn(params, x, y):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return jnp.mean((x @ params[-1]["w"] + params[-1]["b"] - y) ** 2)


def local_grads(params, x, y):
    # Varying params: the backward pass stays local (no psum of its own).
    return jax.grad(loss_fn)(jax.lax.pcast(params, AXIS, to="varying"), x, y)


def build_ours(mesh, params, k):
    tx = ga.accumulate(optax.adam(1e-4), k, axis_name=AXIS)
    specs = ga.replica_state_specs(jax.eval_shape(tx.init, params), AXIS)

    def body(params, state, x, y):
        updates, state = tx.update(local_grads(params, x, y), ga.remove_replica_axis(state), params)
        return optax.apply_updates(params, updates), ga.add_replica_axis(state)

    init = jax.shard_map(
        lambda p: ga.add_replica_axis(tx.init(p)), mesh=mesh, in_specs=P(), out_specs=specs
    )
    step = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)
    )
    return jax.jit(init), jax.jit(step, donate_argnums=(0, 1))


def build_usual(mesh, params, k):
    tx = optax.MultiSteps(optax.adam(1e-4), every_k_schedule=k)

    def body(params, state, x, y):
        grads = jax.lax.pmean(local_grads(params, x, y), AXIS)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P())
    step = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)), out_specs=(P(), P())
    )
    return jax.jit(init), jax.jit(step, donate_argnums=(0, 1))


def window_runner(step, carry, k, x, y):
    """A callable that runs one window of `k` donated micro-steps on from the last carry."""
    held = [carry]

    def run():
        p, s = held[0]
        for _ in range(k):
            p, s = step(p, s, x, y)
        held[0] = (p, s)
        return held[0]

    return run


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, reps="timed windows per candidate")
    parser.add_argument(
        "--per-replica", type=int, default=None, help="examples per replica and micro-step"
    )
    args = parser.parse_args(argv)
    sizes = [64, 128, 128, 64] if args.quick else [512] + [1024] * 5 + [512]
    reps = args.reps or (3 if args.quick else 7)
    per_replica = args.per_replica or (4 if args.quick else 8)

    mesh = jax.make_mesh((8,), (AXIS,))
    n_dev = mesh.devices.size
    params = init_params(sizes)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"{n_dev} host devices, MLP {sizes}: {n_params / 1e6:.2f}M params "
        f"({4 * n_params / 1e6:.1f} MB float32), {per_replica} examples per replica and "
        f"micro-step, Adam; time per window is the median of {reps} alternating windows"
    )
    batch = NamedSharding(mesh, P(AXIS))
    rng = np.random.default_rng(1)
    x = jax.device_put(rng.normal(size=(n_dev * per_replica, sizes[0])).astype(np.float32), batch)
    y = jax.device_put(rng.normal(size=(n_dev * per_replica, sizes[-1])).astype(np.float32), batch)

    rows = []
    for k in KS:
        candidates = {"ours": build_ours(mesh, params, k), "usual": build_usual(mesh, params, k)}
        carry, counts = {}, {}
        for name, (init, step) in candidates.items():
            p = jax.device_put(params, NamedSharding(mesh, P()))
            carry[name] = (p, init(p))
            # An op inside a conditional's branch runs once per window, any other op on
            # every micro-step (harness.Hlo.per_window).
            compiled = step.lower(*carry[name], x, y).compile()
            counts[name] = harness.Hlo(compiled).per_window("all-reduce", k)

        runs = {name: window_runner(candidates[name][1], carry[name], k, x, y) for name in carry}
        seconds = harness.interleaved_medians(runs, reps)
        ms = {name: 1e3 * t for name, t in seconds.items()}
        for name in candidates:
            ops, nbytes = counts[name]
            rows.append(
                {
                    "k": k,
                    "candidate": name,
                    "all_reduces_per_window": ops,
                    "mb_reduced_per_window": round(nbytes / 1e6, 3),
                    "ms_per_window": round(ms[name], 2),
                    "time_ratio_ours_over_usual": round(ms["ours"] / ms["usual"], 3),
                }
            )

    print(
        f"{'K':>3}  {'candidate':<9} {'all-reduces/window':>18} {'MB/window':>10} {'ms/window':>10}"
    )
    for row in rows:
        print(
            f"{row['k']:>3}  {row['candidate']:<9} {row['all_reduces_per_window']:>18} "
            f"{row['mb_reduced_per_window']:>10.2f} {row['ms_per_window']:>10.2f}"
        )
    for k in KS:
        ratio = next(row["time_ratio_ours_over_usual"] for row in rows if row["k"] == k)
        print(f"K={k}: time per window, ours / usual = {ratio:.3f}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
