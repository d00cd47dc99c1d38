"""Time and memory of exact micro-batching for a contrastive loss, side by side.

A two-tower model (each tower: a token-wise MLP over a sequence, mean-pooled and
projected, so activations dominate memory as in a transformer) trained with the
CLIP loss. For each batch size N this compiles, and times where it is affordable:

* ``full``: ``jax.value_and_grad`` of the dense loss on the whole batch;
* ``coupled``: ``gradaccum_jax.coupled_value_and_grad`` with K micro-batches and
  the same dense loss;
* ``coupled+tiled``: the same with ``gradaccum_jax.losses.clip_loss`` (tiles of
  512), whose memory grows with N·D instead of N².

It reports ``compiled.memory_analysis()`` temp and peak bytes, the median step
time over interleaved repetitions, and the largest relative deviation of the
gradients from ``full``. Targets: time(coupled) <= 1.4x time(full) and
temp(coupled) <= 0.5x temp(full) at N = 1024, K = 8, temp falling with K.

The headline: the largest N (a power of two) whose compiled peak fits a memory
budget, for the dense loss on the full batch and for coupled + tiled with
micro-batches of 256 examples (found by compiling only; nothing runs).

    python benchmarks/coupled.py [--quick] [--reps 5]
"""

from __future__ import annotations

import functools
from typing import Any

import harness
import jax
import jax.numpy as jnp

import gradaccum_jax as ga

SIZES = {
    # N values timed, N values compiled only: timing every candidate side by side at
    # N = 1024 and 4096 took more than 15 minutes on two shared CPU cores.
    "default": {
        "seq": 16,
        "width": 64,
        "hidden": 512,
        "dim": 128,
        "timed": (1024,),
        "compiled": (4096, 16384),
        "ks": (4, 8, 16),
        "budget": 2 * 2**30,
        "search": tuple(2**p for p in range(10, 18)),
        "micro": 256,
    },
    "quick": {
        "seq": 4,
        "width": 16,
        "hidden": 32,
        "dim": 16,
        "timed": (128,),
        "compiled": (),
        "ks": (4, 8),
        "budget": 8 * 2**20,
        "search": (128, 256, 512, 1024),
        "micro": 32,
    },
}


def init_params(key: jax.Array, size: dict[str, Any]) -> dict[str, Any]:
    def tower(k: jax.Array) -> dict[str, jax.Array]:
        k1, k2, k3 = jax.random.split(k, 3)
        w, h, d = size["width"], size["hidden"], size["dim"]
        return {
            "w1": jax.random.normal(k1, (w, h)) / w**0.5,
            "w2": jax.random.normal(k2, (h, h)) / h**0.5,
            "proj": jax.random.normal(k3, (h, d)) / h**0.5,
        }

    ka, kb = jax.random.split(key)
    return {"img": tower(ka), "txt": tower(kb), "scale": jnp.float32(10.0)}


def _tower(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ p["w1"])
    h = jax.nn.gelu(h @ p["w2"])
    z = h.mean(axis=1) @ p["proj"]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def embed(params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {"a": _tower(params["img"], batch["img"]), "b": _tower(params["txt"], batch["txt"])}


def dense_clip(params: Any, reps: dict[str, jax.Array]) -> jax.Array:
    logits = params["scale"] * reps["a"] @ reps["b"].T
    diag = jnp.diagonal(logits)
    rows = jax.nn.logsumexp(logits, axis=1) - diag
    cols = jax.nn.logsumexp(logits, axis=0) - diag
    return (rows.mean() + cols.mean()) / 2


def tiled_clip(params: Any, reps: dict[str, jax.Array]) -> jax.Array:
    return ga.losses.clip_loss(reps["a"], reps["b"], params["scale"], block_size=512)


def full_step(params: Any, batch: Any) -> Any:
    return jax.value_and_grad(lambda p, b: dense_clip(p, embed(p, b)))(params, batch)


def batch_shapes(n: int, size: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (n, size["seq"], size["width"])
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32) for k in ("img", "txt")}


def make_batch(n: int, size: dict[str, Any]) -> dict[str, jax.Array]:
    ka, kb = jax.random.split(jax.random.key(1))
    img = jax.random.normal(ka, (n, size["seq"], size["width"]))
    return {"img": img, "txt": img + 0.5 * jax.random.normal(kb, img.shape)}


def candidates(ks: tuple[int, ...]) -> list[tuple[str, int, Any]]:
    out: list[tuple[str, int, Any]] = [("full", 1, full_step)]
    for k in ks:
        out.append(("coupled", k, ga.coupled_value_and_grad(dense_clip, embed, k)))
    for k in ks:
        out.append(("coupled+tiled", k, ga.coupled_value_and_grad(tiled_clip, embed, k)))
    return out


def _rel_err(a: Any, b: Any) -> float:
    num = sum(
        float(jnp.sum((x - y) ** 2))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


def largest_fitting(build: Any, params: Any, size: dict[str, Any]) -> tuple[int, dict[int, int]]:
    """The largest N of the search whose compiled peak fits the budget (0 if none)."""
    peaks: dict[int, int] = {}
    best = 0
    for n in size["search"]:
        exe = jax.jit(build(n)).lower(params, batch_shapes(n, size)).compile()
        peaks[n] = harness.compiled_memory(exe).peak_bytes
        if peaks[n] > size["budget"]:
            break
        best = n
    return best, peaks


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, reps="timed repetitions")
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "default"]
    reps = args.reps or (3 if args.quick else 5)
    params = init_params(jax.random.key(0), size)
    rows: list[dict] = []

    for n in (*size["timed"], *size["compiled"]):
        timed = n in size["timed"]
        compiled = []
        for method, k, fn in candidates(size["ks"]):
            exe = jax.jit(fn).lower(params, batch_shapes(n, size)).compile()
            compiled.append((method, k, exe))
        outs: dict[int, Any] = {}
        times: dict[Any, float] = {}
        if timed:
            batch = make_batch(n, size)
            outs = {
                i: jax.block_until_ready(exe(params, batch)) for i, (*_, exe) in enumerate(compiled)
            }
            times = harness.interleaved_medians(
                {i: functools.partial(exe, params, batch) for i, (*_, exe) in enumerate(compiled)},
                reps,
                warmup=0,
            )
        full_mem = harness.compiled_memory(compiled[0][2])
        for i, (method, k, exe) in enumerate(compiled):
            mem = harness.compiled_memory(exe)
            row = {
                "kind": "step",
                "method": method,
                "N": n,
                "K": k,
                "temp_bytes": mem.temp_bytes,
                "peak_bytes": mem.peak_bytes,
                "temp_vs_full": mem.temp_bytes / full_mem.temp_bytes,
                "timed": timed,
            }
            if timed:
                row["time_ms"] = 1e3 * times[i]
                row["time_vs_full"] = times[i] / times[0]
                row["rel_err"] = _rel_err(outs[i], outs[0])
            rows.append(row)

    micro = size["micro"]
    dense_n, dense_peaks = largest_fitting(lambda n: full_step, params, size)
    tiled_n, tiled_peaks = largest_fitting(
        lambda n: ga.coupled_value_and_grad(tiled_clip, embed, max(1, n // micro)), params, size
    )
    for method, best, peaks in (
        ("full (dense loss)", dense_n, dense_peaks),
        (f"coupled+tiled (micro-batch {micro})", tiled_n, tiled_peaks),
    ):
        rows.append(
            {
                "kind": "headline",
                "method": method,
                "budget_bytes": size["budget"],
                "largest_n": best,
                "peaks": {str(k): v for k, v in peaks.items()},
            }
        )

    print(
        f"two towers: seq {size['seq']} x width {size['width']} -> hidden {size['hidden']} "
        f"-> dim {size['dim']}; {reps} reps, medians; jax {jax.__version__}, "
        f"{jax.devices()[0].platform}; N in {size['compiled']} compiled only (not timed)"
    )
    print(
        f"{'method':<15}{'N':>7}{'K':>4}{'temp MiB':>11}{'temp/full':>11}{'peak MiB':>10}"
        f"{'ms':>10}{'t/full':>8}{'rel err':>10}"
    )
    for r in rows:
        if r["kind"] != "step":
            continue
        t = (
            f"{r['time_ms']:>10.1f}{r['time_vs_full']:>8.2f}{r['rel_err']:>10.1e}"
            if r["timed"]
            else f"{'-':>10}{'-':>8}{'-':>10}"
        )
        print(
            f"{r['method']:<15}{r['N']:>7}{r['K']:>4}{r['temp_bytes'] / 2**20:>11.2f}"
            f"{r['temp_vs_full']:>11.3f}{r['peak_bytes'] / 2**20:>10.1f}{t}"
        )
    for r in rows:
        if r["kind"] == "headline":
            print(
                f"largest N within {r['budget_bytes'] / 2**30:.2f} GiB, {r['method']}: "
                f"{r['largest_n']} (peaks MiB: "
                f"{ {k: round(v / 2**20) for k, v in r['peaks'].items()} })"
            )
    n0 = size["timed"][0]
    k0 = 8
    by = {(r["method"], r["N"], r["K"]): r for r in rows if r["kind"] == "step"}
    c = by.get(("coupled", n0, k0))
    if c is not None:
        t_ok = "met" if c["time_vs_full"] <= 1.4 else "MISSED"
        m_ok = "met" if c["temp_vs_full"] <= 0.5 else "MISSED"
        print(
            f"target time(coupled) <= 1.4 x full at N={n0}, K={k0}: {c['time_vs_full']:.2f}: {t_ok}"
        )
        print(
            f"target temp(coupled) <= 0.5 x full at N={n0}, K={k0}: {c['temp_vs_full']:.3f}: {m_ok}"
        )
    return rows


if __name__ == "__main__":
    main()
