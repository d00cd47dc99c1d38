"""Memory and step time of micro-batched value_and_grad, side by side.

On a model whose activations dominate memory (a token-wise MLP over sequences,
like a transformer's feed-forward blocks), this compiles and times, in one run:

* ``full``: ``jax.value_and_grad`` on the whole batch (K = 1);
* ``ours``: ``gradaccum_jax.microbatch_value_and_grad`` with K micro-batches;
* ``optax.microbatch``: ``optax.microbatching.microbatch`` wrapped around
  ``jax.value_and_grad`` with a MEAN accumulator, the same computation;
* ``optax.micro_grad``: ``optax.microbatching.micro_grad`` with a MEAN
  accumulator. It applies here because the loss is a mean of per-example
  losses, but it computes per-example gradients (``vmap`` inside each
  micro-batch), so it holds ``B/K`` parameter-sized gradients at once.

For each it reports ``compiled.memory_analysis().temp_size_in_bytes``, the
median step time over interleaved repetitions, and the largest deviation of
loss and gradients from the full batch. The targets checked are
``temp(ours, K=8) <= 1.25 * (temp(full) / 8 + one gradient buffer)`` and
``time(ours) <= 1.1 * time(optax.microbatch)`` at equal K.

    python benchmarks/microbatch.py [--quick] [--reps 7]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import harness
import jax
import optax

import gradaccum_jax as ga

SIZES = {
    # batch, sequence length, model width, hidden width, classes
    "default": dict(batch=256, seq=128, width=64, hidden=256, classes=10),
    "quick": dict(batch=32, seq=16, width=16, hidden=32, classes=10),
}
KS = (2, 4, 8)


def init_params(key: jax.Array, width: int, hidden: int, classes: int) -> dict[str, jax.Array]:
    keys = jax.random.split(key, 4)
    return {
        "w_in": jax.random.normal(keys[0], (width, hidden)) / width**0.5,
        "w1": jax.random.normal(keys[1], (hidden, hidden)) / hidden**0.5,
        "w2": jax.random.normal(keys[2], (hidden, hidden)) / hidden**0.5,
        "w_out": jax.random.normal(keys[3], (hidden, classes)) / hidden**0.5,
    }


def per_example_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h = jax.nn.gelu(batch["x"] @ params["w_in"])
    h = h + jax.nn.gelu(h @ params["w1"])
    h = h + jax.nn.gelu(h @ params["w2"])
    logits = h.mean(axis=1) @ params["w_out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    return per_example_loss(params, batch).mean()


def candidates(batch_size: int) -> list[tuple[str, int, Callable[..., Any]]]:
    """Returns (method, K, value_and_grad function) for every candidate."""
    mean = optax.microbatching.AccumulationType.MEAN
    rows: list[tuple[str, int, Callable[..., Any]]] = [("full", 1, jax.value_and_grad(loss_fn))]
    for k in KS:
        rows.append(("ours", k, ga.microbatch_value_and_grad(loss_fn, k)))
        rows.append(
            (
                "optax.microbatch",
                k,
                optax.microbatching.microbatch(
                    jax.value_and_grad(loss_fn),
                    argnums=1,
                    microbatch_size=batch_size // k,
                    accumulator=mean,
                ),
            )
        )
        micro_grad = optax.microbatching.micro_grad(
            loss_fn, batch_argnums=1, microbatch_size=batch_size // k, accumulator=mean
        )

        def micro_grad_value_and_grad(params, batch, micro_grad=micro_grad):
            grads, aux = micro_grad(params, batch)
            return aux.values.mean(), grads

        rows.append(("optax.micro_grad", k, micro_grad_value_and_grad))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, reps="timed repetitions")
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "default"]
    reps = args.reps or (3 if args.quick else 7)

    params = init_params(jax.random.key(0), size["width"], size["hidden"], size["classes"])
    kx, ky = jax.random.split(jax.random.key(1))
    batch = {
        "x": jax.random.normal(kx, (size["batch"], size["seq"], size["width"])),
        "y": jax.random.randint(ky, (size["batch"],), 0, size["classes"]),
    }
    grad_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))

    compiled = []
    for method, k, fn in candidates(size["batch"]):
        exe = jax.jit(fn).lower(params, batch).compile()
        out = jax.block_until_ready(exe(params, batch))
        compiled.append((method, k, exe, out))
    reference = compiled[0][3]

    # Interleaved: every candidate sees the same machine load.
    times = harness.interleaved_medians(
        {n: functools.partial(exe, params, batch) for n, (_, _, exe, _) in enumerate(compiled)},
        reps,
        warmup=0,  # each was called once above
    )

    rows = []
    for n, (method, k, exe, out) in enumerate(compiled):
        rows.append(
            {
                "method": method,
                "K": k,
                "temp_bytes": harness.compiled_memory(exe).temp_bytes,
                "time_ms": 1e3 * times[n],
                "loss": float(out[0]),
                "rel_err": harness.max_relative_error(out, reference),
            }
        )
    full_temp, full_time = rows[0]["temp_bytes"], rows[0]["time_ms"]
    by_key = {(r["method"], r["K"]): r for r in rows}
    for row in rows:
        row["temp_vs_full"] = row["temp_bytes"] / full_temp
        row["time_vs_full"] = row["time_ms"] / full_time
        optax_row = by_key.get(("optax.microbatch", row["K"]))
        row["time_vs_optax_microbatch"] = (
            row["time_ms"] / optax_row["time_ms"] if optax_row else float("nan")
        )

    print(
        f"batch {size['batch']} x seq {size['seq']} x width {size['width']}, hidden "
        f"{size['hidden']}; gradient buffer {grad_bytes / 2**20:.2f} MiB; {reps} reps, "
        f"medians; jax {jax.__version__}, optax {optax.__version__}, {jax.devices()[0].platform}"
    )
    header = (
        f"{'method':<18}{'K':>3}{'temp MiB':>11}{'temp/full':>11}{'ms':>10}"
        f"{'t/full':>8}{'t/optax.mb':>12}{'loss':>10}{'rel err':>10}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['method']:<18}{r['K']:>3}{r['temp_bytes'] / 2**20:>11.2f}"
            f"{r['temp_vs_full']:>11.3f}{r['time_ms']:>10.1f}{r['time_vs_full']:>8.2f}"
            f"{r['time_vs_optax_microbatch']:>12.3f}{r['loss']:>10.5f}{r['rel_err']:>10.1e}"
        )
    ours8 = by_key[("ours", 8)]["temp_bytes"]
    bound = 1.25 * (full_temp / 8 + grad_bytes)
    verdict = "met" if ours8 <= bound else "MISSED"
    print(
        f"target temp(ours, K=8) <= 1.25 x (temp(full)/8 + gradient buffer): "
        f"{ours8 / 2**20:.2f} MiB <= {bound / 2**20:.2f} MiB: {verdict}"
    )
    for k in KS:
        ratio = by_key[("ours", k)]["time_vs_optax_microbatch"]
        verdict = "met" if ratio <= 1.1 else "MISSED"
        print(f"target time(ours) <= 1.1 x time(optax.microbatch) at K={k}: {ratio:.3f}: {verdict}")
    return rows


if __name__ == "__main__":
    main()
