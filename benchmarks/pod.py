"""Routes for a pod, measured on a 2x4 host mesh: collectives per mesh axis, bytes, memory, time.

The mesh is ``("data", "fsdp")`` = 2 x 4 forced host devices with explicit
axes: ``"data"`` stands for the slow axis of a pod (across slices or hosts),
``"fsdp"`` for the fast one (within a slice or host). An MLP of a few MB of
float32 params, Adam, windows of K in {4, 8} micro-steps, every step jitted
with params and optimizer state donated, the global batch split over all 8
devices. Seven routes:

* pmap: ``jax.pmap`` over the 8 devices, params replicated (a leading device
  axis), ``accumulate(adam, K, axis_name="batch")``;
* shard_map: ``jax.shard_map`` over both mesh axes, params replicated (cast to
  varying), ``accumulate(adam, K, axis_name=("data", "fsdp"))``;
* global_view: plain ``jit``, params replicated,
  ``unreduced_value_and_grad(loss, ("data", "fsdp"))`` and ``accumulate(adam, K)``;
* fsdp_plain: params sharded over ``"fsdp"`` (dimension 0 of each kernel,
  biases replicated) and replicated over ``"data"``; the loss gathers them at
  use and ``jax.grad`` reduces the gradient on every micro-step (PyTorch
  FSDP2's first HSDP flavour, what ``optax.MultiSteps`` gives); the window is
  summed by ``accumulate(adam, K)``'s local route. The baseline of the time column;
* fsdp_unreduced: the same params, ``unreduced_value_and_grad(loss, ("data",
  "fsdp"))``: a full-size partial sum per device, no gradient communication
  until the close (FSDP2's third flavour);
* hsdp: the same params, ``unreduced_value_and_grad(loss, "data")``: the
  gradient is reduce-scattered inside each ``"fsdp"`` group every micro-step
  and the all-reduce over ``"data"`` is deferred to the close (the second flavour);
* hsdp_zero1: the same with ``accumulate(..., shard_inner_state="data")``:
  Adam's state sharded over both axes, the close reduce-scatters over ``"data"``.

For each route it reads from the compiled step (``harness.Hlo.collectives_by_axis``)
the collectives outside the window's conditional branch (every micro-step) and
inside it (once per window) by mesh axes, with their bytes: the size of the
instruction's result (for a reduce-scatter that is the scattered output, 1/n of
the array reduced; for an all-gather the gathered array). From those it derives
per window the bytes of collectives whose groups span ``"data"`` and the bytes a
device sends across ``"data"`` with ring algorithms (all-reduce of S over n:
2(n-1)/n S; reduce-scatter or all-gather of a full array S: (n-1)/n S; a group
spanning both axes done hierarchically, only its 1/4 slice crossing ``"data"``).
Per device it reads the accumulator's, the params' and the inner optimizer
state's bytes (``addressable_shards[0]``), and the compiled step's temporaries.
The time per window is a median over rounds in which the routes alternate,
relative to fsdp_plain.

    python benchmarks/pod.py [--quick] [--reps N] [--per-device B]
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

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

P = jax.P
SLOW, FAST = "data", "fsdp"
BOTH = (SLOW, FAST)
MESH_SHAPE = {SLOW: 2, FAST: 4}
KS = (4, 8)
ROUTES = (
    "pmap",
    "shard_map",
    "global_view",
    "fsdp_plain",
    "fsdp_unreduced",
    "hsdp",
    "hsdp_zero1",
)
BASELINE = "fsdp_plain"


init_params = harness.mlp_host_params


loss_fn = harness.mlp_batch_loss


def gathered_loss_fn(params, batch):
    # FSDP under explicit sharding: gather each param at use; the transpose of the
    # gather is the gradient's reduce-scatter.
    return loss_fn(jax.reshard(params, P()), batch)


def inner():
    return optax.adam(1e-4)


def fsdp_specs(params):
    return [{"w": P(FAST, None), "b": P()} for _ in params]


def build_global_view(tx, grad_fn):
    def step(params, state, batch):
        _, grads = grad_fn(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(tx.init), jax.jit(step, donate_argnums=(0, 1))


def build_shard_map(k, params):
    tx = ga.accumulate(inner(), k, axis_name=BOTH)
    return harness.shard_map_accumulate(tx, params, BOTH, loss_fn)


def build_pmap(k):
    tx = ga.accumulate(inner(), k, axis_name="batch")

    def step(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.pmap(tx.init), jax.pmap(step, axis_name="batch", donate_argnums=(0, 1))


def build(route: str, k: int, params):
    if route == "pmap":
        return build_pmap(k)
    if route == "shard_map":
        return build_shard_map(k, params)
    if route == "fsdp_plain":
        return build_global_view(ga.accumulate(inner(), k), jax.value_and_grad(gathered_loss_fn))
    axes = SLOW if route.startswith("hsdp") else BOTH
    zero1 = {"shard_inner_state": SLOW} if route == "hsdp_zero1" else {}
    grad_fn = ga.unreduced_value_and_grad(loss_fn, axes, reduce_value=False)
    return build_global_view(ga.accumulate(inner(), k, **zero1), grad_fn)


def within(route: str, mesh):
    """The mesh context of the global-view routes; pmap refuses to run inside one."""
    return contextlib.nullcontext() if route == "pmap" else jax.set_mesh(mesh)


def place(route: str, params, batch, n_dev: int):
    """The route's params and batch on the devices."""
    if route == "pmap":
        stack = lambda x: np.broadcast_to(x, (n_dev, *x.shape))  # noqa: E731
        split = lambda x: x.reshape(n_dev, -1, *x.shape[1:])  # noqa: E731
        return jax.tree.map(stack, params), jax.tree.map(split, batch)
    sharded = route.startswith(("fsdp", "hsdp"))
    return (
        jax.device_put(params, fsdp_specs(params) if sharded else P()),
        jax.device_put(batch, P(BOTH)),
    )


def wire_bytes_across_slow(op: str, axes: tuple[str, ...], nbytes: int) -> float:
    """Bytes one device sends across the slow axis for a collective of HLO result `nbytes`.

    Ring algorithms over the `d` devices of the slow axis. A group spanning both axes
    is taken as done hierarchically (reduce-scatter or gather within the fast axis,
    then the slow axis on a 1/f slice), so 1/f of its array crosses the slow axis.
    """
    if SLOW not in axes:
        return 0.0
    d = MESH_SHAPE[SLOW]
    n = math.prod(MESH_SHAPE[a] for a in axes)
    full = nbytes * n if op == "reduce-scatter" else nbytes  # the array before scattering
    slice_ = full / (n // d)
    ring = 2 * (d - 1) / d if op == "all-reduce" else (d - 1) / d
    return ring * slice_


def axes_label(axes: tuple[str, ...]) -> str:
    return "+".join(axes) if axes else "none"


def collectives(compiled, k: int, param_bytes: int) -> dict:
    """Per micro-step and per window collectives by axes, and the slow axis' bytes.

    `slow_shard_all_reduces` is the slow axis' traffic per device per window in units
    of one ring all-reduce, over the slow axis, of a gradient shard (params / f): the
    number that scales to other meshes (8 for fsdp_plain at K=8, about 1 for hsdp).
    """
    found = harness.Hlo(compiled).collectives_by_axis(MESH_SHAPE)
    every, once = {}, {}
    slow_hlo = slow_wire = 0.0
    for (where, op, axes), (count, nbytes) in sorted(found.items()):
        runs = k if where == "every step" else 1
        table = every if where == "every step" else once
        table[f"{op}@{axes_label(axes)}"] = [count, nbytes]
        if SLOW in axes:
            slow_hlo += runs * nbytes
            slow_wire += runs * wire_bytes_across_slow(op, axes, nbytes)
    d, f = MESH_SHAPE[SLOW], MESH_SHAPE[FAST]
    shard_all_reduce = 2 * (d - 1) / d * param_bytes / f
    return {
        "every_step": every,
        "once": once,
        "slow_bytes_per_window": int(slow_hlo),
        "slow_wire_bytes_per_device": int(slow_wire),
        "slow_shard_all_reduces": round(slow_wire / shard_all_reduce, 3),
    }


def per_device_bytes(tree) -> int:
    leaves = jax.tree.leaves(tree)
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves)


def window_runner(step, carry, batch, k, route, mesh):
    """A callable that runs one window of `k` donated micro-steps on from the last carry."""
    held = [carry]

    def run():
        p, s = held[0]
        with within(route, mesh):
            for _ in range(k):
                p, s = step(p, s, batch)
        held[0] = (p, s)
        return held[0]

    return run


def print_table(rows: list[dict]) -> None:
    kb = lambda n: f"{n / 1e3:.0f}"  # noqa: E731
    print(
        f"{'K':>2} {'route':<15} {'data kB/window':>14} {'sent/dev kB':>11} {'shard ARs':>9}"
        f" {'acc/params/opt kB per device':>28} {'temp kB':>8} {'ms/window':>9} {'x plain':>7}"
    )
    for row in rows:
        memory = "/".join(
            kb(row[f"{what}_bytes_per_device"]) for what in ("acc", "params", "opt_state")
        )
        print(
            f"{row['k']:>2} {row['route']:<15} {kb(row['slow_bytes_per_window']):>14}"
            f" {kb(row['slow_wire_bytes_per_device']):>11} {row['slow_shard_all_reduces']:>9.2f}"
            f" {memory:>28} {kb(row['temp_bytes']):>8} {row['ms_per_window']:>9.1f}"
            f" {row['time_over_fsdp_plain']:>7.2f}"
        )
    print("collectives (count x op@axes, kB of results): every micro-step | once per window")
    for row in rows:
        if row["k"] != rows[-1]["k"]:
            continue
        ops = [
            ", ".join(f"{n}x{op} {kb(b)}" for op, (n, b) in row[where].items()) or "-"
            for where in ("every_step", "once")
        ]
        print(f"  {row['route']:<15} {ops[0]} | {ops[1]}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, reps="timed windows per route")
    parser.add_argument("--per-device", type=int, default=None, help="examples per device")
    args = parser.parse_args(argv)
    sizes = [32, 64, 32] if args.quick else [256, 1024, 1024, 256]
    reps = args.reps or (1 if args.quick else 5)
    per_device = args.per_device or (2 if args.quick else 8)
    ks = (4,) if args.quick else KS

    mesh = jax.make_mesh(
        tuple(MESH_SHAPE.values()),
        tuple(MESH_SHAPE),
        axis_types=(jax.sharding.AxisType.Explicit,) * 2,
    )
    n_dev = mesh.devices.size
    params = init_params(sizes)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    param_bytes = 4 * n_params
    print(
        f"{n_dev} host devices as a {SLOW}={MESH_SHAPE[SLOW]} x {FAST}={MESH_SHAPE[FAST]} mesh, "
        f"MLP {sizes}: {n_params / 1e6:.2f}M params ({param_bytes / 1e6:.1f} MB float32), "
        f"{per_device} examples per device and micro-step, Adam; time per window is the "
        f"median of {reps} alternating windows"
    )
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.normal(size=(n_dev * per_device, sizes[0])).astype(np.float32),
        "y": rng.normal(size=(n_dev * per_device, sizes[-1])).astype(np.float32),
    }

    rows = []
    for k in ks:
        carry, facts, steps, batches = {}, {}, {}, {}
        for route in ROUTES:
            with within(route, mesh):
                init, step = build(route, k, params)
                p, b = place(route, params, batch, n_dev)
                s = init(p)
                for _ in range(k):  # one warm-up window (the first call may retype the state)
                    p, s = step(p, s, b)
                compiled = step.lower(p, s, b).compile()
            facts[route] = {
                **collectives(compiled, k, param_bytes),
                "acc_bytes_per_device": per_device_bytes(s.acc_grads),
                "params_bytes_per_device": per_device_bytes(p),
                "opt_state_bytes_per_device": per_device_bytes(s.inner_state),
                "temp_bytes": harness.compiled_memory(compiled).temp_bytes,
            }
            carry[route], steps[route], batches[route] = (p, s), step, b
            jax.block_until_ready(carry[route])

        runs = {
            route: window_runner(steps[route], carry[route], batches[route], k, route, mesh)
            for route in ROUTES
        }
        seconds = harness.interleaved_medians(runs, reps, warmup=0)
        for route in ROUTES:
            rows.append(
                {
                    "k": k,
                    "route": route,
                    "mesh": dict(MESH_SHAPE),
                    "param_bytes": param_bytes,
                    **facts[route],
                    "ms_per_window": round(1e3 * seconds[route], 2),
                    "time_over_fsdp_plain": round(seconds[route] / seconds[BASELINE], 3),
                }
            )

    print_table(rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
