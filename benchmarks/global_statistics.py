"""Time and memory of global-batch statistics (MoE load balancing), side by side.

A small mixture-of-experts model (2 layers, top-2 of 4 MLP experts, load-balancing
coefficient 0.01, as in issue 34) trains one Adam step on a batch of token
sequences in K micro-batches, two ways:

* ``per micro-batch``: ``microbatch_value_and_grad`` of the loss that balances each
  micro-batch's own tokens (one pass; another objective);
* ``global``: the same with ``statistics_fn=`` returning each layer's expert token
  counts: a first pass (forward only, to the last router) sums them over the
  micro-batches, and every micro-batch's loss uses the whole batch's fractions.

It reports the median step time over interleaved repetitions, the compiled
temporary bytes (``compiled.memory_analysis()``), their ratios to the
per-micro-batch step at the same K (targets: time <= 1.45x, temp <= 1.2x), the
ratio of the programs' floating-point operations (``compiled.cost_analysis()``,
which counts a loop's body once: the ratio of one micro-batch's work, and free
of timing noise), and
the largest relative gradient difference from ``jax.value_and_grad`` of the whole
batch's objective. The machine is shared and noisy: compare only the ratios of
one run.

The module is not called ``statistics``: that would shadow the standard library's
module, which ``harness`` imports.

    python benchmarks/global_statistics.py [--quick] [--reps 5]
"""

from __future__ import annotations

import functools
from typing import Any

import harness
import jax
import jax.numpy as jnp
import optax

import gradaccum_jax as ga

LAYERS, EXPERTS, TOP_K, COEF = 2, 4, 2, 0.01
SIZES = {
    "default": {"sequences": 64, "tokens": 64, "dim": 128, "hidden": 512, "ks": (4, 8)},
    "quick": {"sequences": 16, "tokens": 8, "dim": 16, "hidden": 32, "ks": (4,)},
}


def init_params(key: jax.Array, size: dict[str, Any]) -> dict[str, Any]:
    d, h = size["dim"], size["hidden"]
    keys = iter(jax.random.split(key, 3 * LAYERS))
    return {
        "layers": [
            {
                "router": jax.random.normal(next(keys), (d, EXPERTS)) / d**0.5,
                "w_in": jax.random.normal(next(keys), (EXPERTS, d, h)) / d**0.5,
                "w_out": jax.random.normal(next(keys), (EXPERTS, h, d)) / h**0.5,
            }
            for _ in range(LAYERS)
        ]
    }


def forward(params: Any, x: jax.Array) -> tuple[jax.Array, list[Any]]:
    """The last hidden state and, per layer, (router probabilities, expert choice per token)."""
    routing = []
    for layer in params["layers"]:
        probs = jax.nn.softmax(x @ layer["router"], axis=-1)
        top_p, top_i = jax.lax.top_k(probs, TOP_K)
        chosen = jax.nn.one_hot(top_i, EXPERTS, dtype=jnp.int32)
        gates = jnp.sum(chosen * top_p[..., None], axis=-2)
        hidden = jax.nn.gelu(jnp.einsum("btd,edh->bteh", x, layer["w_in"]))
        x = x + jnp.einsum("bte,bteh,ehd->btd", gates, hidden, layer["w_out"])
        routing.append((probs, jnp.sum(chosen, axis=-2)))
    return x, routing


def statistics_fn(params: Any, batch: Any) -> list[jax.Array]:
    _, routing = forward(params, batch["x"])
    return [jnp.sum(chosen, axis=(0, 1)) for _, chosen in routing]


def loss(params: Any, batch: Any, *, statistics: Any = None) -> jax.Array:
    out, routing = forward(params, batch["x"])
    balance = 0.0
    for layer, (probs, chosen) in enumerate(routing):
        counts = jnp.sum(chosen, axis=(0, 1)) if statistics is None else statistics[layer]
        balance += EXPERTS * jnp.sum(counts / jnp.sum(counts) * jnp.mean(probs, axis=(0, 1)))
    return jnp.mean((out - batch["y"]) ** 2) + COEF * balance / LAYERS


def whole_batch_loss(params: Any, batch: Any) -> jax.Array:
    return loss(params, batch, statistics=statistics_fn(params, batch))


def make_batch(size: dict[str, Any]) -> dict[str, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    shape = (size["sequences"], size["tokens"], size["dim"])
    return {"x": jax.random.normal(kx, shape), "y": jax.random.normal(ky, shape)}


def train_step(grad_fn: Any, tx: Any) -> Any:
    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        _, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    return jax.jit(step)


def _flops(compiled: Any) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, reps="timed repetitions")
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "default"]
    reps = args.reps or (3 if args.quick else 9)
    params, batch = init_params(jax.random.key(0), size), make_batch(size)
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    expected = jax.jit(jax.grad(whole_batch_loss))(params, batch)
    model = (
        f"MoE {LAYERS} layers, top-{TOP_K} of {EXPERTS}, {size['sequences']}x{size['tokens']} "
        f"tokens, d={size['dim']}, hidden={size['hidden']}"
    )
    rows: list[dict] = []
    for k in size["ks"]:
        methods = {
            "per micro-batch": ga.microbatch_value_and_grad(loss, k),
            "global": ga.microbatch_value_and_grad(loss, k, statistics_fn=statistics_fn),
        }
        compiled = {
            name: train_step(fn, tx).lower(params, opt_state, batch).compile()
            for name, fn in methods.items()
        }
        grads = {name: exe(params, opt_state, batch)[2] for name, exe in compiled.items()}
        times = harness.interleaved_medians(
            {
                name: functools.partial(exe, params, opt_state, batch)
                for name, exe in compiled.items()
            },
            reps,
        )
        memory = {name: harness.compiled_memory(exe) for name, exe in compiled.items()}
        flops = {name: _flops(exe) for name, exe in compiled.items()}
        base = "per micro-batch"
        for name in compiled:
            rows.append(
                {
                    "model": model,
                    "method": name,
                    "K": k,
                    "time_ms": 1e3 * times[name],
                    "temp_bytes": memory[name].temp_bytes,
                    "time_vs_per_micro": times[name] / times[base],
                    "temp_vs_per_micro": memory[name].temp_bytes / memory[base].temp_bytes,
                    "flops_vs_per_micro": flops[name] / flops[base],
                    "rel_err_vs_whole_batch": harness.max_relative_error(grads[name], expected),
                }
            )
    harness.print_rows(f"global-batch statistics: {model}, Adam step, {reps} reps", rows)
    return rows


if __name__ == "__main__":
    main()
