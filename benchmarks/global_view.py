"""Global-view jit on an explicit mesh: collectives, bytes and time per window, state memory.

Data-parallel training written as plain ``jax.jit`` over an explicit 8-device
host mesh (``jax.set_mesh``, batch sharded ``P("data")``, params replicated),
an MLP of about 21 MB of float32 params, Adam, windows of K in {4, 16}
micro-steps. Four train steps, each jitted with params and optimizer state
donated:

* multisteps: ``jax.grad`` and ``optax.MultiSteps(adam, K)``, the usual way;
  the backward pass all-reduces the gradient on every micro-step;
* unreduced: ``unreduced_value_and_grad`` and ``accumulate(adam, K)``: the
  accumulator stays unreduced and the window's close reduces it once;
* zero1: the same with ``accumulate(..., shard_inner_state="data")``: the
  close reduce-scatters, Adam's moments live sharded over the 8 devices, the
  updates are all-gathered back;
* shard_map: ``accumulate(adam, K, axis_name="data")`` inside ``jax.shard_map``
  (the other style with one reduction per window), for comparison;
* fsdp and fsdp_unreduced: params (and so Adam's state) sharded over "data"
  along their first dimension; ``jax.grad`` and ``accumulate(adam, K)``
  (a reduce-scatter of the gradient every micro-step into a sharded
  accumulator), against ``unreduced_value_and_grad`` and the same
  ``accumulate`` (a full-size unreduced accumulator per device, reduced into the
  params' sharding once per window). Both gather the params every micro-step.

For each K it prints the collectives per window read from the compiled HLO (an
op inside a conditional branch runs once per window, any other op once per
micro-step) with the megabytes they carry (the full array of each all-reduce
and all-gather), the time per window (median over repetitions in which the
candidates alternate), and per device the bytes of the optimizer state (from
the arrays' shards) and the compiled step's temporaries
(``compiled.memory_analysis()``).

    python benchmarks/global_view.py [--quick] [--reps N] [--per-replica B]
"""

from __future__ import annotations

import os
import sys
import time

# XLA reads the device count once, when the CPU backend starts: set it before jax.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import harness
import jax
import numpy as np
import optax

import gradaccum_jax as ga

AXIS = "data"
KS = (4, 16)
P = jax.P


init_params = harness.mlp_host_params


loss_fn = harness.mlp_batch_loss


def inner():
    return optax.adam(1e-4)


def build_global_view(tx, grad_fn):
    def step(params, state, batch):
        _, grads = grad_fn(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(tx.init), jax.jit(step, donate_argnums=(0, 1))


def build_multisteps(k):
    return build_global_view(optax.MultiSteps(inner(), k), jax.value_and_grad(loss_fn))


def gathered_loss_fn(params, batch):
    # FSDP under explicit sharding: gather the params, then compute as usual;
    # the transpose of the gather is the gradient's reduce-scatter.
    return loss_fn(jax.reshard(params, P()), batch)


def build_fsdp(k):
    return build_global_view(ga.accumulate(inner(), k), jax.value_and_grad(gathered_loss_fn))


def build_unreduced(k, **kwargs):
    grad_fn = ga.unreduced_value_and_grad(loss_fn, AXIS, reduce_value=False)
    return build_global_view(ga.accumulate(inner(), k, **kwargs), grad_fn)


def build_shard_map(k, params):
    tx = ga.accumulate(inner(), k, axis_name=AXIS)
    return harness.shard_map_accumulate(tx, params, AXIS, loss_fn)


def collectives_per_window(compiled, k: int, devices: int) -> tuple[dict[str, int], float]:
    """Returns ({collective: ops run per window}, MB they carry) for a compiled step.

    An op inside a conditional's branch runs once per window for every
    candidate here, any other op on each of the `k` micro-steps.
    """
    hlo = harness.Hlo(compiled)
    ops: dict[str, int] = {}
    megabytes = 0.0
    for op in harness.COLLECTIVES:
        count, nbytes = hlo.per_window(op, k)
        if count:
            ops[op] = count
            # A reduce-scatter's result is 1/n of the array it reduces.
            megabytes += nbytes * (devices if op == "reduce-scatter" else 1) / 1e6
    return ops, megabytes


def per_device_bytes(tree) -> int:
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def inner_state_of(name: str, state):
    if name == "multisteps":
        return state.inner_opt_state
    return state.inner_state


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, reps="timed windows per candidate")
    parser.add_argument(
        "--per-replica", type=int, default=None, help="examples per replica and micro-step"
    )
    args = parser.parse_args(argv)
    sizes = [64, 128, 128, 64] if args.quick else [512] + [1024] * 5 + [512]
    reps = args.reps or (3 if args.quick else 7)
    per_replica = args.per_replica or (4 if args.quick else 8)

    mesh = jax.make_mesh((8,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    jax.set_mesh(mesh)
    n_dev = mesh.devices.size
    params = init_params(sizes)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"{n_dev} host devices, explicit mesh, MLP {sizes}: {n_params / 1e6:.2f}M params "
        f"({4 * n_params / 1e6:.1f} MB float32), {per_replica} examples per replica and "
        f"micro-step, Adam; time per window is the median of {reps} alternating windows"
    )
    rng = np.random.default_rng(1)
    batch = jax.device_put(
        {
            "x": rng.normal(size=(n_dev * per_replica, sizes[0])).astype(np.float32),
            "y": rng.normal(size=(n_dev * per_replica, sizes[-1])).astype(np.float32),
        },
        P(AXIS),
    )

    fsdp = jax.tree.map(lambda x: P(AXIS) if x.shape[0] % n_dev == 0 else P(), params)
    rows = []
    for k in KS:
        candidates = {
            "multisteps": build_multisteps(k),
            "unreduced": build_unreduced(k),
            "zero1": build_unreduced(k, shard_inner_state=AXIS),
            "shard_map": build_shard_map(k, params),
            "fsdp": build_fsdp(k),
            "fsdp_unreduced": build_unreduced(k),
        }
        carry, facts = {}, {}
        for name, (init, step) in candidates.items():
            p = jax.device_put(params, fsdp if name.startswith("fsdp") else P())
            s = init(p)
            for _ in range(k):  # one warm-up window (the first call may retype the state)
                p, s = step(p, s, batch)
            compiled = step.lower(p, s, batch).compile()
            ops, mb = collectives_per_window(compiled, k, n_dev)
            facts[name] = {
                "collectives_per_window": sum(ops.values()),
                "collective_ops": ",".join(f"{op}x{n}" for op, n in sorted(ops.items())),
                "mb_per_window": round(mb, 3),
                "inner_state_mb_per_device": round(
                    per_device_bytes(inner_state_of(name, s)) / 1e6, 3
                ),
                "opt_state_mb_per_device": round(per_device_bytes(s) / 1e6, 3),
                "temp_mb": round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 3),
            }
            carry[name] = jax.block_until_ready((p, s))
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for rep in range(reps):
            order = list(candidates) if rep % 2 == 0 else list(reversed(candidates))
            for name in order:
                step = candidates[name][1]
                p, s = carry[name]
                start = time.perf_counter()
                for _ in range(k):
                    p, s = step(p, s, batch)
                carry[name] = jax.block_until_ready((p, s))
                times[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
        for name in candidates:
            rows.append(
                {
                    "k": k,
                    "candidate": name,
                    **facts[name],
                    "ms_per_window": round(ms[name], 2),
                    "time_over_multisteps": round(ms[name] / ms["multisteps"], 3),
                    "time_over_shard_map": round(ms[name] / ms["shard_map"], 3),
                }
            )

    print(
        f"{'K':>3}  {'candidate':<14} {'collectives/window':>18} {'MB/window':>10} "
        f"{'ms/window':>10} {'x MultiSteps':>12} {'inner MB/dev':>12} {'temp MB':>8}  ops"
    )
    for row in rows:
        print(
            f"{row['k']:>3}  {row['candidate']:<14} {row['collectives_per_window']:>18} "
            f"{row['mb_per_window']:>10.2f} {row['ms_per_window']:>10.2f} "
            f"{row['time_over_multisteps']:>12.3f} {row['inner_state_mb_per_device']:>12.3f} "
            f"{row['temp_mb']:>8.2f}  {row['collective_ops']}"
        )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
