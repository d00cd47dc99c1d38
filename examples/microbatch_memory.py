"""Same training, an eighth of the activation memory: micro-batching inside the step.

Two copies of a token-wise MLP (a transformer's feed-forward blocks, over
sequences) train with Adam on the same batches. One takes the gradient of the
whole batch with ``jax.value_and_grad``; the other with
``gradaccum_jax.microbatch_value_and_grad`` in K = 8 micro-batches, inside the
same jitted step. The script prints the temporary memory XLA reserves for each
compiled step (``compiled.memory_analysis().temp_size_in_bytes``) and the two
runs' losses, which agree to float32 rounding.

    python examples/microbatch_memory.py [--small] [--steps 5] [--k 8]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import gradaccum_jax as ga


def init_params(key: jax.Array, width: int, hidden: int, classes: int) -> dict[str, jax.Array]:
    k_in, k_mid, k_out = jax.random.split(key, 3)
    return {
        "w_in": jax.random.normal(k_in, (width, hidden)) / width**0.5,
        "w_mid": jax.random.normal(k_mid, (hidden, hidden)) / hidden**0.5,
        "w_out": jax.random.normal(k_out, (hidden, classes)) / hidden**0.5,
    }


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    # Every token keeps hidden-sized activations alive for the backward pass:
    # they, not the parameters, fill the memory.
    h = jax.nn.gelu(batch["x"] @ params["w_in"])
    h = h + jax.nn.gelu(h @ params["w_mid"])
    logits = h.mean(axis=1) @ params["w_out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_step(value_and_grad, tx):
    def step(params, opt_state, batch):
        loss, grads = value_and_grad(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="reduced sizes (seconds)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--k", type=int, default=8, help="micro-batches per step")
    args = parser.parse_args(argv)
    batch_size, seq, width, hidden = (64, 16, 16, 64) if args.small else (256, 128, 64, 256)
    classes = 10

    params = init_params(jax.random.key(0), width, hidden, classes)
    tx = optax.adam(1e-3)
    full_step = make_step(jax.value_and_grad(loss_fn), tx)
    micro_step = make_step(ga.microbatch_value_and_grad(loss_fn, args.k), tx)

    def batch_at(step: int) -> dict[str, jax.Array]:
        kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
        return {
            "x": jax.random.normal(kx, (batch_size, seq, width)),
            "y": jax.random.randint(ky, (batch_size,), 0, classes),
        }

    opt_state = tx.init(params)
    temp, compiled = {}, {}
    for name, step_fn in (("K=1", full_step), (f"K={args.k}", micro_step)):
        compiled[name] = step_fn.lower(params, opt_state, batch_at(0)).compile()
        temp[name] = compiled[name].memory_analysis().temp_size_in_bytes
        print(f"{name:>5}: compiled temp bytes {temp[name]:>12,d}")
    full_step, micro_step = compiled["K=1"], compiled[f"K={args.k}"]
    print(f"ratio: {temp[f'K={args.k}'] / temp['K=1']:.3f} (1/{args.k} = {1 / args.k:.3f})")

    p_full, s_full, p_micro, s_micro = params, opt_state, params, opt_state
    losses_full, losses_micro = [], []
    for step in range(args.steps):
        batch = batch_at(step)
        p_full, s_full, loss_full = full_step(p_full, s_full, batch)
        p_micro, s_micro, loss_micro = micro_step(p_micro, s_micro, batch)
        losses_full.append(float(loss_full))
        losses_micro.append(float(loss_micro))
        print(f"step {step}: loss K=1 {loss_full:.6f}   K={args.k} {loss_micro:.6f}")
    max_param_diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(p_full), jax.tree.leaves(p_micro), strict=True)
    )
    print(f"largest parameter difference after {args.steps} steps: {max_param_diff:.2e}")
    return {
        "temp_bytes": temp,
        "losses_full": losses_full,
        "losses_micro": losses_micro,
        "max_param_diff": max_param_diff,
    }


if __name__ == "__main__":
    main()
