"""Estimated, not measured: a window's time on one TPU chip, ours beside optax's, from the programs.

Needs libtpu (`.venv-tpu`, `bash dev.sh test-tpu` builds it). Every step is compiled ahead
of time for one chip of a TPU topology on this machine (docs/tpu.md), from abstract
inputs, and nothing runs: the times are `roofline.estimate`'s, the slower of the matrix
products at the chip's peak and the bytes at its HBM bandwidth, read from the scheduled
TPU program. A lower bound on a real step, to compare the candidates side by side; never a
measurement.

The steps, with params and optimizer state donated, on the trees of
tests/test_tpu_micro_step.py (a 4-layer MLP of 4096-wide layers, 268 MB; 32 leaves of
128 kB) and K = 4 micro-batches per window:

* `accumulate(adam) apply_gradients`: `ga.apply_gradients(ga.accumulate(optax.adam(...),
  K), grads, state, params)`; its micro-step and its close are the two branches of one
  conditional, estimated each;
* `accumulate(adam) tx.update`: the same through `tx.update` and `optax.apply_updates`;
* `optax.MultiSteps(adam)`: through `tx.update` and `optax.apply_updates` (the TPU compiler
  turns its conditional into selects: every call costs the same);
* `adam, every step`: `optax.adam` on each gradient, no window (what a micro-step costs
  when nothing is accumulated: the floor of a step that touches every parameter).

The window's time is K - 1 micro-steps and one close. The gradients' own computation is
not part of these steps: add the model's forward and backward, the same for every row.

    .venv-tpu/bin/python benchmarks/tpu_estimate.py [--chip v5e] [--quick]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga

try:
    import harness
    import roofline
except ModuleNotFoundError:  # imported as benchmarks.tpu_estimate
    from benchmarks import harness, roofline

K = 4
TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1"}


def trees(quick: bool) -> dict[str, Any]:
    def f32(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    width = 1024 if quick else 4096
    return {
        f"mlp {width}x{width} x4": [{"w": f32(width, width), "b": f32(width)} for _ in range(4)],
        "32 leaves of 128 kB": {f"leaf_{i:02d}": f32(128, 256) for i in range(32)},
    }


def _through_update(tx, grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


# name: (the transformation, the door, the branches to estimate as (label, branch)).
CANDIDATES: dict[str, tuple[Callable[[], Any], Callable[..., Any], tuple]] = {
    "accumulate(adam) apply_gradients": (
        lambda: ga.accumulate(optax.adam(1e-3), K),
        ga.apply_gradients,
        (("micro", 0), ("close", 1)),
    ),
    "accumulate(adam) tx.update": (
        lambda: ga.accumulate(optax.adam(1e-3), K),
        _through_update,
        (("micro", 0), ("close", 1)),
    ),
    "optax.MultiSteps(adam)": (
        lambda: optax.MultiSteps(optax.adam(1e-3), K),
        _through_update,
        (("micro", None), ("close", None)),
    ),
    "adam, every step": (lambda: optax.adam(1e-3), _through_update, (("micro", None),)),
}


def chip_sharding(chip: str) -> jax.sharding.NamedSharding:
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name=TOPOLOGIES[chip], platform="tpu").devices
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
    return jax.NamedSharding(mesh, jax.P())


def measure(chip: str, quick: bool) -> list[dict]:
    on_chip = chip_sharding(chip)

    def placed(tree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_chip), tree
        )

    rows = []
    for tree_name, tree in trees(quick).items():
        param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
        for name, (make, door, branches) in CANDIDATES.items():
            tx = make()
            params, state = placed(tree), placed(jax.eval_shape(tx.init, tree))
            step = jax.jit(
                lambda p, s, g, tx=tx, door=door: door(tx, g, s, p), donate_argnums=(0, 1)
            )
            hlo = harness.Hlo(step.lower(params, state, params).compile())
            found = {label: roofline.estimate(hlo, chip, branch) for label, branch in branches}
            micro = found["micro"]
            close = found.get("close", micro)
            rows.append(
                {
                    "benchmark": "tpu_estimate",
                    "chip": roofline.CHIPS[chip].name,
                    "tree": tree_name,
                    "candidate": name,
                    "estimate": True,
                    "micro_us": micro.microseconds,
                    "close_us": close.microseconds,
                    "window_us": (K - 1) * micro.microseconds + close.microseconds,
                    "micro_bytes_over_params": micro.bytes / param_bytes,
                    "close_bytes_over_params": close.bytes / param_bytes,
                    "bound": micro.bound,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, quick="a 1024-wide MLP")
    parser.add_argument("--chip", default="v5e", choices=sorted(TOPOLOGIES))
    args = parser.parse_args(argv)
    rows = measure(args.chip, args.quick)
    print(
        f"ESTIMATES (roofline on {roofline.CHIPS[args.chip].name}'s public peaks, from the "
        f"TPU-compiled programs; not measurements), K = {K}, jax {jax.__version__}"
    )
    print(
        f"{'tree':<22} {'candidate':<34} {'micro us':>9} {'close us':>9} {'window us':>10}"
        f" {'micro B/P':>9} {'close B/P':>9}"
    )
    for r in rows:
        print(
            f"{r['tree']:<22} {r['candidate']:<34} {r['micro_us']:9.1f} {r['close_us']:9.1f}"
            f" {r['window_us']:10.1f} {r['micro_bytes_over_params']:9.2f}"
            f" {r['close_bytes_over_params']:9.2f}"
        )
    return rows


if __name__ == "__main__":
    main()
