"""A transformer language model in 4 pipeline stages, accumulated over 32 micro-batches.

A small decoder-only transformer (token embedding tied with the output head, pre-norm
blocks of causal self-attention and a GELU MLP with RMSNorm) learns the next character
of the standard library's docstrings, the corpus and padding of
``examples/transformer_lm.py``. Its blocks are split over a ``"stage"`` mesh axis of 4
host devices and the batch over a ``"data"`` axis of 2 (8 forced host devices), and
``gradaccum_jax.pipeline_value_and_grad`` with ``schedule="1f1b"`` runs the step's
``N = 32`` micro-batches per data shard through one pipeline schedule: one fill and one
drain per optimizer step, the gradient reduced over ``"data"`` once. The loss is the
mean over real (non-padding) tokens (``sum_and_weight=True``), over the whole batch.

For a few Adam steps it prints the pipelined loss beside the unpipelined large-batch
loss, ``jax.value_and_grad(grad_fn.sequential)`` on the same batch at the same
parameters, and their difference (float32 rounding), and the largest relative
difference of the gradients. Then, per schedule at ``N = 32`` (``gpipe``, ``1f1b``,
``interleaved`` with 2 chunks per device), the bubble of its table beside the formula
``(S - 1) / (v N + S - 1)`` and the compiled step's temporary bytes per device, and the
bubble of gradient accumulation outside the pipeline: ``K = 8`` schedules of ``M = 4``
micro-batches idle ``(S - 1) / (M + S - 1)`` of the time.

    python examples/pipeline_lm.py [--steps 5] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys

# XLA reads the device count once, when the CPU backend starts: set it before jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga

S, D = 4, 2  # devices along "stage" and "data"
P = jax.P


def corpus_module():
    """examples/transformer_lm.py, for its corpus (`load_lines`) and padded rows (`encode`)."""
    path = pathlib.Path(__file__).resolve().parent / "transformer_lm.py"
    spec = importlib.util.spec_from_file_location("transformer_lm_corpus", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def block(x, w, num_heads: int):
    """One pre-norm block: causal self-attention, then a GELU MLP, each a residual."""
    t, width = x.shape[-2], x.shape[-1]
    h = rms_norm(x, w["norm1"])
    q, k, v = (
        (h @ w[name]).reshape(*x.shape[:-1], num_heads, width // num_heads)
        for name in ("q", "k", "v")
    )
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // num_heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    attention = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", attention, v).reshape(x.shape)
    x = x + mixed @ w["o"]
    h = rms_norm(x, w["norm2"])
    return x + jax.nn.gelu(h @ w["up"]) @ w["down"]


def init_params(key, *, vocab: int, width: int, depth: int, seq_len: int) -> tuple[dict, dict]:
    """The model's params as host arrays: the blocks as a `(depth, ...)` layer stack, and
    the rest (token and position embeddings, the final norm)."""
    keys = iter(jax.random.split(key, 8))

    def dense(shape, fan_in):
        return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(fan_in)

    layers = {
        "norm1": jnp.ones((depth, width)),
        "q": dense((depth, width, width), width),
        "k": dense((depth, width, width), width),
        "v": dense((depth, width, width), width),
        "o": dense((depth, width, width), width) / np.sqrt(2 * depth),
        "norm2": jnp.ones((depth, width)),
        "up": dense((depth, width, 4 * width), width),
        "down": dense((depth, 4 * width, width), 4 * width) / np.sqrt(2 * depth),
    }
    outer = {
        "embed": dense((vocab, width), 1) * 0.1,
        "pos": dense((seq_len, width), 1) * 0.1,
        "norm_f": jnp.ones((width,)),
    }
    # On the host: each placement below makes fresh device arrays, which the step donates.
    return jax.tree.map(np.asarray, (layers, outer))


def make_grad_fn(schedule: str, num_chunks: int, num_microbatches: int, num_heads: int, pad: int):
    def stage_fn(blocks, x):
        return jax.lax.scan(lambda x, w: (block(x, w, num_heads), None), x, blocks)[0]

    def embed_fn(outer, rows):
        tokens = rows[:, :-1]
        # A one-hot matmul, not a gather: the unstaged reference runs on the global batch,
        # split over "data" (Explicit mesh), where a gather of the replicated table by
        # split indices has no unambiguous output sharding; a matmul has.
        one_hot = jax.nn.one_hot(tokens, outer["embed"].shape[0], dtype=outer["embed"].dtype)
        return one_hot @ outer["embed"] + outer["pos"][: tokens.shape[1]]

    def loss_fn(outer, y, rows):
        # Tied head: the same matrix embeds a token and scores it, so its gradient is
        # the sum of both uses (the first and the last stage's).
        logits = rms_norm(y, outer["norm_f"]) @ outer["embed"].T
        targets = rows[:, 1:]
        mask = (targets != pad).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(losses * mask), jnp.sum(mask)

    return ga.pipeline_value_and_grad(
        stage_fn,
        loss_fn,
        embed_fn=embed_fn,
        num_microbatches=num_microbatches,
        schedule=schedule,
        num_chunks=num_chunks,
        sum_and_weight=True,
    )


def pipeline_params(mesh, layers, outer, num_chunks: int) -> dict:
    stages = jax.device_put(
        ga.stack_stages(layers, S, num_chunks), jax.NamedSharding(mesh, P("stage"))
    )
    return {"stages": stages, **jax.device_put(outer, jax.NamedSharding(mesh, P()))}


def max_rel_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="Adam steps")
    parser.add_argument("--microbatches", type=int, default=32, help="N per data shard")
    parser.add_argument("--micro-rows", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=8, help="blocks; a multiple of 2 S")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--quick", action="store_true", help="3 steps, the same sizes")
    args = parser.parse_args(argv)
    steps = 3 if args.quick else args.steps
    n = args.microbatches

    corpus = corpus_module()
    rows = corpus.encode(corpus.load_lines(), args.seq_len)
    rows = rows[np.random.default_rng(0).permutation(len(rows))]
    batch_rows = n * args.micro_rows * D
    mesh = jax.make_mesh(
        (S, D), ("stage", "data"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    layers, outer = init_params(
        jax.random.key(0),
        vocab=corpus.VOCAB_SIZE,
        width=args.width,
        depth=args.depth,
        seq_len=args.seq_len,
    )
    grad_fn = make_grad_fn("1f1b", 1, n, args.heads, corpus.PAD)
    tx = optax.adam(args.lr)
    print(
        f"{mesh.devices.size} host devices, mesh (stage={S}, data={D}); {args.depth} blocks "
        f"of width {args.width} ({args.depth // S} per stage), 1f1b over N = {n} micro-batches "
        f"of {args.micro_rows} sequences per data shard: {batch_rows} sequences of "
        f"{args.seq_len} characters per step"
    )

    def large_batch_loss(params, batch):
        # The stage params come whole (replicated) to the unstaged model, which indexes
        # their stage axis; sequential returns loss_fn's (sum, tokens) on the whole batch.
        total, tokens = grad_fn.sequential(jax.reshard(params, P()), batch)
        return total / tokens

    def train_step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        # The large batch in one piece, at the same params: what the pipeline must equal.
        ref_loss, ref_grads = jax.value_and_grad(large_batch_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, ref_loss, grads, ref_grads

    history = {"pipelined": [], "large batch": [], "grad_rel_diff": []}
    with jax.set_mesh(mesh):
        params = pipeline_params(mesh, layers, outer, 1)
        opt_state = jax.jit(tx.init)(params)
        step = jax.jit(train_step, donate_argnums=(0, 1))
        data = jax.NamedSharding(mesh, P("data"))
        print(
            f"\n{'step':>4} {'pipelined 1f1b':>15} {'large batch':>12} {'|difference|':>13} "
            f"{'grads, max rel. diff':>21}"
        )
        for i in range(steps):
            start = (i * batch_rows) % (len(rows) - batch_rows)
            batch = jax.device_put(rows[start : start + batch_rows], data)
            params, opt_state, loss, ref_loss, grads, ref_grads = step(params, opt_state, batch)
            loss, ref_loss = float(loss), float(ref_loss)
            history["pipelined"].append(loss)
            history["large batch"].append(ref_loss)
            history["grad_rel_diff"].append(max_rel_diff(grads, ref_grads))
            print(
                f"{i + 1:>4} {loss:>15.6f} {ref_loss:>12.6f} {abs(loss - ref_loss):>13.1e} "
                f"{history['grad_rel_diff'][-1]:>21.1e}"
            )
        loss_diff = max(
            abs(a - b) for a, b in zip(history["pipelined"], history["large batch"], strict=True)
        )
        print(
            f"largest loss difference over {steps} steps: {loss_diff:.1e}; "
            f"largest gradient difference: {max(history['grad_rel_diff']):.1e} (relative)"
        )

        print(f"\nschedules at N = {n} (S = {S}; temp: compiled step, per device)")
        print(f"{'schedule':<16} {'bubble (table)':>14} {'(formula)':>10} {'temp bytes':>12}")
        batch = jax.device_put(rows[:batch_rows], data)
        schedules = {}
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
            table = ga.pipeline_schedule(name, S, n, v)
            fn = make_grad_fn(name, v, n, args.heads, corpus.PAD)
            compiled = jax.jit(fn).lower(pipeline_params(mesh, layers, outer, v), batch).compile()
            temp = int(compiled.memory_analysis().temp_size_in_bytes)
            label = f"{name} (v={v})" if v > 1 else name
            schedules[label] = {
                "bubble": table.bubble,
                "formula": table.formula_bubble,
                "temp_bytes": temp,
            }
            print(f"{label:<16} {table.bubble:>14.3f} {table.formula_bubble:>10.3f} {temp:>12,}")
        m = 4
        nested = (S - 1) / (m + S - 1)
        print(
            f"{'nested GA':<16} {ga.pipeline_schedule('gpipe', S, m).bubble:>14.3f} {nested:>10.3f}"
            f"   K = {n // m} schedules of M = {m} (gradient accumulation outside the pipeline)"
        )
    return {
        "history": history,
        "loss_diff": loss_diff,
        "schedules": schedules,
        "nested_bubble": nested,
    }


if __name__ == "__main__":
    main()
