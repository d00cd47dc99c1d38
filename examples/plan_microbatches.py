"""Planning the micro-batches of a step from its compiled memory.

A token-wise MLP over sequences (a transformer's feed-forward blocks) whose
activations, not its parameters, fill the memory: the full batch of 1024
sequences needs several times the memory budget. ``gradaccum_jax.plan_microbatches``
compiles the micro-batched value-and-gradient program for a few values of K on
abstract shapes (nothing runs), prints the peak bytes of each, and chooses the
smallest K that fits. A train step built with ``num_microbatches="auto"`` then
plans the same K when it is traced (from the cache, without compiling again)
and gives the full batch's loss and gradients.

    python examples/plan_microbatches.py [--batch 1024] [--budget-mib 8]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga

SEQ, WIDTH, HIDDEN, CLASSES = 16, 32, 128, 10


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k_in, k_mid, k_out = jax.random.split(key, 3)
    return {
        "w_in": jax.random.normal(k_in, (WIDTH, HIDDEN)) / WIDTH**0.5,
        "w_mid": jax.random.normal(k_mid, (HIDDEN, HIDDEN)) / HIDDEN**0.5,
        "w_out": jax.random.normal(k_out, (HIDDEN, CLASSES)) / HIDDEN**0.5,
    }


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    # Every token keeps hidden-sized activations alive for the backward pass.
    h = jax.nn.gelu(batch["x"] @ params["w_in"])
    h = h + jax.nn.gelu(h @ params["w_mid"])
    logits = h.mean(axis=1) @ params["w_out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024, help="sequences per step")
    parser.add_argument("--budget-mib", type=float, default=8.0, help="memory budget, MiB")
    args = parser.parse_args(argv)
    budget = int(args.budget_mib * 2**20)

    params = init_params(jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    batch = {
        "x": jax.random.normal(kx, (args.batch, SEQ, WIDTH)),
        "y": jax.random.randint(ky, (args.batch,), 0, CLASSES),
    }

    start, start_cpu = time.perf_counter(), time.process_time()
    plan = ga.plan_microbatches(loss_fn, params, batch, memory_budget=budget)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    print(f"batch {args.batch}, memory budget {budget / 2**20:.1f} MiB")
    print(f"{'K':>6}{'micro-batch':>13}{'peak MiB':>10}  fits")
    for k, peak in plan.table.items():
        print(
            f"{k:>6}{args.batch // k:>13}{peak / 2**20:>10.2f}  {'yes' if peak <= budget else 'no'}"
        )
    print(
        f"chosen K={plan.num_microbatches} (micro-batch {plan.microbatch_size}, peak "
        f"{plan.peak_bytes / 2**20:.2f} MiB): {len(plan.table)} compilations in {seconds:.1f} s "
        f"({cpu_seconds:.1f} s of CPU time)"
    )

    full_peak = ga.plan_microbatches(loss_fn, params, batch, memory_budget=2**62).table[1]
    print(
        f"the full batch (K=1) needs {full_peak / 2**20:.2f} MiB, "
        f"{full_peak / budget:.1f}x the budget"
    )

    # The same plan at trace time, then the step runs with the chosen K.
    auto = ga.microbatch_value_and_grad(loss_fn, "auto", memory_budget=budget)
    loss, grads = jax.jit(auto)(params, batch)
    full_loss, full_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    max_diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(full_grads), strict=True)
    )
    print(
        f"loss {float(loss):.6f} (full batch {float(full_loss):.6f}); "
        f"max |grad diff| {max_diff:.1e}"
    )
    np.testing.assert_allclose(loss, full_loss, rtol=1e-5)
    return {
        "plan": plan,
        "full_peak": full_peak,
        "budget": budget,
        "plan_seconds": seconds,
        "loss": float(loss),
        "full_loss": float(full_loss),
        "max_grad_diff": max_diff,
    }


if __name__ == "__main__":
    main()
