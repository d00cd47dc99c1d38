"""A small Gemma-like decoder trained with DP-SGD, its chunk size planned from memory.

The model is built as the private language models of issue 44 are: RMSNorm,
multi-query attention with rotary positions, a GeGLU MLP, the output head tied to the
embedding, and its blocks stacked with `nn.scan` under `nn.remat`. Training is DP-SGD
over logical batches of `K x B` sequences, each drawn uniformly without replacement
(fixed-size sampling, the accounting's `sampling="fixed_size"`):

* `privacy.clipped_grad(loss, C, microbatch_size="auto", memory_budget=...)` clips each
  sequence's gradient to `C` and sums them, in chunks of the largest size whose compiled
  program fits the budget (`plan_memory` says which, and what each size peaks at);
* `privacy.dp_accumulate(optax.adam(lr), K, ...)` sums the `K` calls of a window and adds
  the Gaussian noise once, when the window closes;
* `privacy.epsilon` reports the privacy spent after the windows run.

It prints the clipping plan (which leaf takes ghost norms, which the layer's gradient),
the planned chunk size, the losses, epsilon, and the time and compiled temp of one
private call beside one non-private `jax.value_and_grad` call on the same batch, both
under the same `nn.remat` (medians of interleaved runs on this machine's CPU; read the
ratios). The corpus is the docstrings of a few standard-library modules, one byte per
token, so nothing is downloaded.

    python examples/dp_lm.py [--windows 6] [--budget-mib 8]
    python examples/dp_lm.py --quick
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga
from gradaccum_jax import privacy

DELTA = 1e-5
MODULES = ("json", "textwrap", "string", "functools", "itertools", "collections", "pathlib")
VOCAB = 128  # ASCII bytes


def load_sequences(length: int) -> np.ndarray:
    """Every window of `length + 1` bytes of the corpus, one per row (`int32`)."""
    text = []
    for name in MODULES:
        module = importlib.import_module(name)
        for obj in (module, *vars(module).values()):
            doc = inspect.getdoc(obj) if inspect.isclass(obj) or inspect.isroutine(obj) else None
            if obj is module:
                doc = inspect.getdoc(module)
            if doc:
                text.append(doc)
    data = np.frombuffer("\n".join(text).encode("ascii", "replace"), np.uint8) % VOCAB
    rows = len(data) // (length + 1)
    if rows < 64:
        raise RuntimeError("the corpus is empty (python -OO strips docstrings): run without -OO")
    return data[: rows * (length + 1)].reshape(rows, length + 1).astype(np.int32)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + scale)


def rotary(x: jax.Array) -> jax.Array:
    """Rotary positions on the last axis of `x` (..., T, heads, head_dim)."""
    t, half = x.shape[-3], x.shape[-1] // 2
    freq = 1.0 / 10_000 ** (jnp.arange(half) / half)
    angle = jnp.arange(t)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


class Block(nn.Module):
    """RMSNorm, multi-query causal attention with rotary positions, RMSNorm, GeGLU."""

    heads: int
    head_dim: int
    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        d = x.shape[-1]
        h = RMSNorm(name="attn_norm")(x)
        q = rotary(nn.DenseGeneral((self.heads, self.head_dim), use_bias=False, name="q")(h))
        kv = nn.DenseGeneral((2, self.head_dim), use_bias=False, name="kv")(h)  # one k, one v
        k, v = rotary(kv[..., :1, :])[..., 0, :], kv[..., 1, :]
        scores = jnp.einsum("bthd,bsd->bhts", q, k) / np.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((x.shape[-2], x.shape[-2]), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), -1)
        out = jnp.einsum("bhts,bsd->bthd", weights, v)
        x = x + nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, name="o")(out)
        h = RMSNorm(name="mlp_norm")(x)
        gate = nn.Dense(self.hidden, use_bias=False, name="gate")(h)
        up = nn.Dense(self.hidden, use_bias=False, name="up")(h)
        return x + nn.Dense(d, use_bias=False, name="down")(nn.gelu(gate) * up), None


class Decoder(nn.Module):
    width: int = 64
    layers: int = 2
    heads: int = 4
    hidden: int = 128
    remat: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(VOCAB, self.width, name="embed")
        x = embed(tokens) * np.sqrt(self.width)
        stack = nn.scan(
            nn.remat(Block) if self.remat else Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        x = stack(self.heads, self.width // self.heads, self.hidden, name="blocks")(x, None)[0]
        return embed.attend(RMSNorm(name="final_norm")(x))  # the head tied to the embedding


MODEL = Decoder()


def loss_fn(params: Any, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of the sequences in `batch` (rows of T + 1 ids)."""
    logits = MODEL.apply({"params": params}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def median_times(fns: dict[str, Any], reps: int) -> dict[str, float]:
    """Median seconds of each call, the calls interleaved (order reversed every other round)."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(reps):
        for name in list(fns)[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def temp_bytes(fn: Any, *args: Any) -> int:
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.quick:
        args.windows, args.reps, args.seq = 2, 3, 32
    data = load_sequences(args.seq)
    params = MODEL.init(jax.random.key(args.seed), jnp.zeros((1, args.seq), jnp.int32))["params"]
    budget = int(args.budget_mib * 2**20)
    clipped = privacy.clipped_grad(
        loss_fn, args.clip_norm, microbatch_size="auto", memory_budget=budget
    )
    batch = jnp.asarray(data[: args.batch])
    print(f"corpus: {len(data)} sequences of {args.seq + 1} bytes; the clipping plan:")
    print(clipped.plan(params, batch))
    plan = clipped.plan_memory(params, batch)
    print(
        f"chunk size planned for memory_budget={budget} bytes: {plan.microbatch_size} of "
        f"{args.batch} (peak {plan.peak_bytes} bytes; peaks by number of chunks: {plan.table})"
    )

    tx = privacy.dp_accumulate(
        optax.adam(args.lr),
        args.k,
        l2_clip_norm=clipped.l2_clip_norm,
        noise_multiplier=args.sigma,
        expected_batch_size=args.k * args.batch,
        key=jax.random.key(args.seed + 1),
    )

    @jax.jit
    def micro_step(params, opt_state, batch):
        loss_sum, grad_sum = clipped(params, batch)
        params, opt_state = ga.apply_gradients(tx, grad_sum, opt_state, params)
        return params, opt_state, loss_sum / batch.shape[0]

    opt_state = tx.init(params)
    rng = np.random.default_rng(args.seed + 2)
    losses = []
    for _ in range(args.windows):
        # A logical batch of K x B sequences drawn without replacement, in K calls.
        drawn = rng.choice(len(data), size=args.k * args.batch, replace=False)
        window = []
        for part in drawn.reshape(args.k, args.batch):
            params, opt_state, loss = micro_step(params, opt_state, jnp.asarray(data[part]))
            window.append(float(loss))
        losses.append(float(np.mean(window)))
        print(f"window {len(losses):3d}  loss {losses[-1]:.4f}")
    q = args.k * args.batch / len(data)
    eps = privacy.epsilon(args.sigma, q, args.windows, DELTA, sampling="fixed_size")
    print(f"privacy spent: epsilon = {eps:.2f} at delta = {DELTA:g} (q = {q:.4f})")

    plain = jax.value_and_grad(loss_fn)
    calls = {"private": jax.jit(clipped), "non-private": jax.jit(plain)}
    seconds = median_times({n: (lambda f=f: f(params, batch)) for n, f in calls.items()}, args.reps)
    temp = {name: temp_bytes(fn, params, batch) for name, fn in calls.items()}
    print(
        f"one call on {args.batch} sequences, under nn.remat: private (chunks of "
        f"{plan.microbatch_size}) {seconds['private'] * 1e3:.1f} ms, {temp['private']} temp "
        f"bytes; non-private (one chunk) "
        f"{seconds['non-private'] * 1e3:.1f} ms, {temp['non-private']} temp bytes "
        f"({seconds['private'] / seconds['non-private']:.2f}x the time, "
        f"{temp['private'] / temp['non-private']:.2f}x the temp)"
    )
    leaves = clipped.plan(params, batch)
    return {
        "losses": losses,
        "epsilon": eps,
        "plan": plan,
        "methods": leaves.methods,
        "second_pass": any(leaf.second_pass for leaf in leaves),
        "seconds": seconds,
        "temp_bytes": temp,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6, help="logical batches (DP-SGD steps)")
    parser.add_argument("--k", type=int, default=2, help="calls per logical batch")
    parser.add_argument("--batch", type=int, default=32, help="B, sequences per call")
    parser.add_argument("--seq", type=int, default=64, help="T, tokens per sequence")
    parser.add_argument("--budget-mib", type=float, default=8.0, help="memory_budget, MiB")
    parser.add_argument("--clip-norm", type=float, default=1.0, help="C")
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--reps", type=int, default=7, help="timed rounds of each call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a reduced run (for the tests)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
