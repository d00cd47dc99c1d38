"""Tiled contrastive losses against the dense formulas: time and compiled temp, side by side.

For `clip_loss`, `info_nce` and `siglip_loss` of `gradaccum_jax.losses` and their dense
versions (the N x N logits written out, `jax.nn.log_softmax` / `jax.nn.log_sigmoid`,
plain autodiff), this compiles `jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))` at
D = 128 and growing N and reports

* ``temp_*``: `compiled.memory_analysis().temp_size_in_bytes`, and as a fraction of one
  N x N float32 matrix (``*_vs_nn``);
* ``ms_*``: the median time of one call, tiled and dense measured in turn
  (`harness.interleaved_medians`); the dense loss runs only while its temp fits
  ``--dense-budget-gb`` (default 4 GB), above which its row says it was not run;
* ``max_rel_err``: the largest deviation of the tiled value and gradients from the dense
  ones, relative to each one's largest entry (only where the dense loss runs).

Targets (issue 28), at N = 8192, D = 128: tiled time <= 1.5x dense, tiled temp <= 5% of one
N x N float32 matrix.

One more table in the same run (issue 35), rows ``part: devices``: 8 host devices against
one. The tiled loss's `jax.jit(jax.value_and_grad(...))` at N = 8192, D = 64 with the rows
sharded over an 8-device mesh of `AxisType.Auto` and of `AxisType.Explicit`, and on one
device, measured in turn. The 8 host devices share the machine's cores, so work repeated
on every device shows as a multiple of the one-device time; each device running only its
rows' tiles gives about 1x (target: at most 1.3x). ``loops_*``: the known trip counts of
the compiled loops (the row and column tile loops of the forward and the backward; a loop
of one trip is no loop).

The gradients' precision against float64 truth is `benchmarks/contrastive_precision.py`'s.

    python benchmarks/contrastive_losses.py [--quick] [--reps 3]
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

# XLA reads the device count once, when the CPU backend starts: set it before jax.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import harness
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

from gradaccum_jax import losses

D = 128
SIZES = {"default": (1024, 2048, 4096, 8192, 16384), "quick": (256, 512)}
TARGET_N = 8192
# The 8-device comparison (issue 35's setting): (N, D, block_size).
DEVICES_SIZE = {"default": (8192, 64, losses.DEFAULT_BLOCK_SIZE), "quick": (1024, 64, 128)}


def dense_clip(a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
    logits = scale * a @ b.T
    diag_rows = jnp.diag(jax.nn.log_softmax(logits, axis=1))
    diag_cols = jnp.diag(jax.nn.log_softmax(logits, axis=0))
    return -0.5 * (diag_rows.mean() + diag_cols.mean())


def dense_info_nce(q: jax.Array, k: jax.Array, scale: jax.Array) -> jax.Array:
    return -jnp.diag(jax.nn.log_softmax(scale * q @ k.T, axis=1)).mean()


def dense_siglip(a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
    z = 2.0 * jnp.eye(a.shape[0]) - 1.0
    return -jax.nn.log_sigmoid(z * (scale * a @ b.T - 10.0)).sum() / a.shape[0]


CANDIDATES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "clip_loss": (lambda a, b, s: losses.clip_loss(a, b, s), dense_clip),
    "info_nce": (lambda a, b, s: losses.info_nce(a, b, s), dense_info_nce),
    "siglip_loss": (lambda a, b, s: losses.siglip_loss(a, b, s, -10.0), dense_siglip),
}


def _inputs(n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    ka, kb = jax.random.split(jax.random.key(n))
    a = jax.random.normal(ka, (n, D))
    b = a + jax.random.normal(kb, (n, D))
    a = a / jnp.linalg.norm(a, axis=1, keepdims=True)
    b = b / jnp.linalg.norm(b, axis=1, keepdims=True)
    return a, b, jnp.float32(10.0)


def _rel_err(got: Any, want: Any) -> float:
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w, np.float64)
        diff = np.abs(np.asarray(g, np.float64) - w).max()
        worst = max(worst, float(diff / max(np.abs(w).max(), 1e-30)))
    return worst


def measure(sizes: tuple[int, ...], reps: int, dense_budget: float) -> list[dict]:
    rows = []
    for n in sizes:
        args = _inputs(n)
        square = n * n * 4
        for name, (tiled, dense) in CANDIDATES.items():
            compiled = {
                kind: jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2))).lower(*args).compile()
                for kind, fn in (("tiled", tiled), ("dense", dense))
            }
            temp = {k: harness.compiled_memory(c).temp_bytes for k, c in compiled.items()}
            row: dict[str, Any] = {
                "loss": name,
                "n": n,
                "d": D,
                "block_size": losses.DEFAULT_BLOCK_SIZE,
                "temp_tiled": temp["tiled"],
                "temp_dense": temp["dense"],
                "temp_tiled_vs_nn": round(temp["tiled"] / square, 4),
                "temp_dense_vs_nn": round(temp["dense"] / square, 3),
            }
            runs = {"tiled": functools.partial(compiled["tiled"], *args)}
            dense_runs = temp["dense"] <= dense_budget
            if dense_runs:
                runs["dense"] = functools.partial(compiled["dense"], *args)
            ms = harness.interleaved_medians(runs, reps)
            row["ms_tiled"] = round(ms["tiled"] * 1e3, 1)
            if dense_runs:
                row["ms_dense"] = round(ms["dense"] * 1e3, 1)
                row["tiled_vs_dense"] = round(ms["tiled"] / ms["dense"], 3)
                row["max_rel_err"] = float(
                    f"{_rel_err(compiled['tiled'](*args), compiled['dense'](*args)):.2g}"
                )
            else:
                row["ms_dense"] = "not run (temp over budget)"
            if n == TARGET_N and dense_runs:
                row["target_met"] = bool(
                    row["tiled_vs_dense"] <= 1.5 and row["temp_tiled_vs_nn"] <= 0.05
                )
            rows.append(row)
            del compiled
    return rows


def _trip_counts(compiled: Any) -> str:
    """The compiled loops' known trip counts, sorted: per pass, row tiles and column tiles."""
    found = re.findall(r'known_trip_count":\{"n":"(\d+)"', compiled.as_text())
    return " ".join(str(n) for n in sorted(int(n) for n in found))


def measure_devices(n: int, d: int, block: int, reps: int) -> list[dict]:
    """The tiled losses on 8 host devices (Auto and Explicit meshes) against one device."""
    ka, kb = jax.random.split(jax.random.key(n))
    a = jax.random.normal(ka, (n, d))
    b = a + jax.random.normal(kb, (n, d))
    a = a / jnp.linalg.norm(a, axis=1, keepdims=True)
    b = b / jnp.linalg.norm(b, axis=1, keepdims=True)
    rows = []
    for name in CANDIDATES:

        def loss(a, b, name=name):
            if name == "siglip_loss":
                return losses.siglip_loss(a, b, 10.0, -10.0, block_size=block)
            return getattr(losses, name)(a, b, 10.0, block_size=block)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        runs = {"one": functools.partial(step.lower(a, b).compile(), a, b)}
        trips = {}
        for kind in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
            sharded = [jax.device_put(x, NamedSharding(mesh, jax.P("data"))) for x in (a, b)]
            with jax.set_mesh(mesh):
                compiled = step.lower(*sharded).compile()
            runs[kind.name] = functools.partial(compiled, *sharded)
            trips[kind.name] = _trip_counts(compiled)
        ms = harness.interleaved_medians(runs, reps)
        row: dict[str, Any] = {"part": "devices", "loss": name, "global_n": n, "d": d}
        row["block_size"] = block
        row["ms_one_device"] = round(ms["one"] * 1e3, 1)
        for kind in ("Auto", "Explicit"):
            row[f"ms_8_devices_{kind.lower()}"] = round(ms[kind] * 1e3, 1)
            row[f"{kind.lower()}_vs_one"] = round(ms[kind] / ms["one"], 2)
            row[f"loops_{kind.lower()}"] = trips[kind]
        row["target_met"] = bool(max(row["auto_vs_one"], row["explicit_vs_one"]) <= 1.3)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dense-budget-gb", type=float, default=4.0)
    args = parser.parse_args(argv)
    sizes = SIZES["quick" if args.quick else "default"]
    size = "quick" if args.quick else "default"
    rows = measure(sizes, args.reps, args.dense_budget_gb * 2**30)
    harness.print_rows(
        f"contrastive losses, value_and_grad, D = {D}: tiled (block "
        f"{losses.DEFAULT_BLOCK_SIZE}) vs dense",
        rows,
    )
    devices = measure_devices(*DEVICES_SIZE[size], args.reps)
    harness.print_rows(
        "tiled losses, value_and_grad on 8 host devices (rows sharded on 'data') vs one "
        "device; the devices share the cores (noisy machine)",
        devices,
    )
    return rows + devices


if __name__ == "__main__":
    main()
