"""A character-level transformer language model with token-weighted gradient accumulation.

A small decoder-only transformer (Flax linen, pre-LayerNorm blocks, causal
self-attention) learns to predict the next character of the standard
library's docstrings. Sequences are padded, and the loss is the mean over real
tokens. Three copies start from the same parameters and see the same
sequences in the same order:

1. **large batch**: one optimizer step on the whole batch with
   ``jax.value_and_grad`` of the per-token mean loss;
2. **token-weighted accumulation**: the same batch arrives in ``--calls``
   jitted calls; inside each call ``gradaccum_jax.microbatch_value_and_grad``
   (``sum_and_weight=True``) splits it into ``--microbatches`` micro-batches,
   and across calls ``gradaccum_jax.accumulate`` weighs each call's gradient by
   its number of real (non-padding) tokens (``weight=``). The window's gradient
   is then the large batch's per-token mean, whatever the padding;
3. **unweighted accumulation**: the same loop, but every micro-batch's mean
   counts equally (what ``jax.value_and_grad`` per micro-batch with
   ``optax.MultiSteps`` computes). The tokens of micro-batches with few real
   tokens count more, so it optimizes another objective.

The model computes in bfloat16 (``dtype=jnp.bfloat16``) and keeps float32
parameters (``param_dtype=jnp.float32``), so gradients, the accumulators of
both ``microbatch_value_and_grad`` and ``accumulate``, and AdamW's moments are
float32. The script prints the losses, the validation losses and the largest
parameter difference of each accumulated run from the large-batch run, and
writes the loss curves and the parameter differences to a PNG. In bfloat16 the
token-weighted run differs from the large batch by rounding only (Adam turns
rounding-size differences of rare, small gradients into step-size ones, so the
largest difference is about 1e-2); with ``--compute-dtype float32`` it is
below 1e-6. The unweighted run is about 0.1 away in both.

The corpus: the docstrings of a fixed list of standard-library modules and
their public classes and functions, read with ``inspect.getdoc``, one sequence
per line. It is English prose with code in it, present in every Python
installation, so nothing is downloaded, and its lines have very different
lengths, which is what makes the padding, and the token weighting, matter. The
text changes a little between Python versions, and so do the printed figures;
the comparisons do not. (Under ``python -OO`` docstrings are stripped, and the
script says so.)

    python examples/transformer_lm.py [--steps 200] [--plot /tmp/transformer_lm.png]
    python examples/transformer_lm.py --compute-dtype float32
    python examples/transformer_lm.py --quick
    python examples/transformer_lm.py --adaptive-k [--plot /tmp/adaptive_k.png]

With ``--adaptive-k`` it runs another comparison instead: three copies see
one stream of ``--sequences`` sequences in calls of ``--call-batch`` (default 2)
sequences, with token weights and ``track_noise_scale=True``, and AdamW at a
constant learning rate, so they differ only in the window length K: fixed
``--k-min`` (2), fixed ``--k-max`` (64), and K from
``gradaccum_jax.critical_batch_schedule`` between the two. It prints and plots
the measured noise scale ``b_simple`` (in tokens), the K chosen, and the
validation loss against optimizer steps and against tokens seen, and how many
steps and tokens each run needed to reach the loss that all of them reach.
About 3 minutes on 2 CPU cores; ``--quick`` (800 sequences, the small model)
under a minute.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import sys
import time
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from matplotlib.figure import Figure
from tqdm import tqdm

import gradaccum_jax as ga

CORPUS_MODULES = (
    "argparse",
    "bisect",
    "collections",
    "contextlib",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "inspect",
    "itertools",
    "json",
    "pathlib",
    "random",
    "re",
    "shutil",
    "statistics",
    "string",
    "textwrap",
    "typing",
    "unittest",
)
PAD, BOS = 0, 1
# Printable ASCII after the two special ids; anything else becomes "?".
FIRST_CHAR, LAST_CHAR = 32, 126
VOCAB_SIZE = 2 + LAST_CHAR - FIRST_CHAR + 1


def load_lines(modules: tuple[str, ...] = CORPUS_MODULES) -> list[str]:
    """Returns the non-empty lines of the docstrings of ``modules`` and their public members."""
    docs = []
    for name in modules:
        module = importlib.import_module(name)
        members = [module] + [
            obj
            for attr, obj in sorted(vars(module).items())
            if not attr.startswith("_")
            and getattr(obj, "__module__", None) == module.__name__
            and (inspect.isclass(obj) or inspect.isroutine(obj))
        ]
        with warnings.catch_warnings():
            # Deprecated aliases such as typing.io warn when their docstring is read.
            warnings.simplefilter("ignore", DeprecationWarning)
            docs.extend(doc for doc in map(inspect.getdoc, members) if doc)
    lines = [line.strip() for doc in docs for line in doc.splitlines() if line.strip()]
    if not lines:
        raise RuntimeError(
            "the standard library has no docstrings in this interpreter (python -OO?); "
            "run the example without -OO."
        )
    return lines


def encode(lines: list[str], seq_len: int) -> np.ndarray:
    """Returns int32 rows ``[BOS, c_1, ..., c_n, PAD, ...]`` of length ``seq_len + 1``.

    Lines longer than ``seq_len`` characters are cut into pieces of at most that
    length, so rows hold from 1 to ``seq_len`` real characters.
    """
    rows = []
    for line in lines:
        codes = np.frombuffer(line.encode("ascii", "replace"), np.uint8).astype(np.int32)
        codes = np.where((codes >= FIRST_CHAR) & (codes <= LAST_CHAR), codes, ord("?"))
        for start in range(0, len(codes), seq_len):
            piece = codes[start : start + seq_len] - FIRST_CHAR + 2
            row = np.full(seq_len + 1, PAD, np.int32)
            row[0] = BOS
            row[1 : 1 + len(piece)] = piece
            rows.append(row)
    return np.stack(rows)


class DecoderBlock(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    num_heads: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        # Compute in self.dtype, keep the parameters float32: the gradients
        # and every accumulator are then float32 too.
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=jnp.float32)
        norm = functools.partial(nn.LayerNorm, dtype=self.dtype, param_dtype=jnp.float32)
        width = x.shape[-1]
        # No biases in the attention: a key bias's gradient is zero in exact
        # arithmetic (softmax ignores a constant shift), so in floating point it
        # is pure rounding noise, which Adam would blow up into full-size steps.
        attention = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, dtype=self.dtype, param_dtype=jnp.float32, use_bias=False
        )
        x = x + attention(norm()(x), mask=mask)
        return x + dense(width)(nn.gelu(dense(4 * width)(norm()(x))))


class CharTransformer(nn.Module):
    """A decoder-only transformer over characters; returns float32 logits."""

    seq_len: int
    width: int
    depth: int
    num_heads: int
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        # The embeddings are looked up and added in float32 (a gather does no
        # arithmetic to speed up), so their gradients are summed in float32.
        x = nn.Embed(VOCAB_SIZE, self.width, dtype=jnp.float32, param_dtype=jnp.float32)(tokens)
        # Initialized at the token embeddings' scale (Flax's default for Embed).
        init = nn.initializers.normal(self.width**-0.5)
        position = self.param("position", init, (self.seq_len, self.width), jnp.float32)
        x = (x + position[: tokens.shape[-1]]).astype(self.dtype)
        # Padding sits at the end of a row, so under the causal mask no real
        # token ever attends to it; padded positions are masked in the loss.
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.depth):
            x = DecoderBlock(self.num_heads, self.dtype)(x, mask)
        x = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32)(x)
        # No output bias: in bfloat16, its gradient for rarely seen characters
        # is mostly rounding noise, which Adam would turn into full-size steps.
        logits = nn.Dense(VOCAB_SIZE, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32)(x)
        # The softmax cross-entropy and its sums run in float32.
        return logits.astype(jnp.float32)


def make_loss(model: CharTransformer):
    """Returns ``loss_sum_and_tokens(params, rows) -> (Σ token losses, number of real tokens)``."""

    def loss_sum_and_tokens(params, rows):
        logits = model.apply({"params": params}, rows[:, :-1])
        targets = rows[:, 1:]
        mask = (targets != PAD).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(losses * mask), jnp.sum(mask)

    return loss_sum_and_tokens


def make_large_batch_step(loss_sum_and_tokens, tx):
    def token_mean(params, rows):
        loss_sum, tokens = loss_sum_and_tokens(params, rows)
        return loss_sum / tokens

    @jax.jit
    def step(params, opt_state, rows):
        loss, grads = jax.value_and_grad(token_mean)(params, rows)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make_weighted_step(loss_sum_and_tokens, tx, num_microbatches: int):
    # Each micro-batch returns (loss sum, real tokens): the call's result is
    # Σ sums / Σ tokens, its per-token mean, however the padding falls.
    grad_fn = ga.microbatch_value_and_grad(
        loss_sum_and_tokens,
        num_microbatches,
        sum_and_weight=True,
        accumulator_dtype=jnp.float32,
    )

    @jax.jit
    def step(params, opt_state, rows):
        loss, grads = grad_fn(params, rows)
        tokens = jnp.sum(rows[:, 1:] != PAD)
        # Across calls, accumulate weighs each call's mean by its token count:
        # the window's mean is the per-token mean of all its calls' tokens.
        updates, opt_state = tx.update(grads, opt_state, params, weight=tokens)
        return optax.apply_updates(params, updates), opt_state, loss, tokens

    return step


def make_unweighted_step(loss_sum_and_tokens, tx, num_microbatches: int):
    def mean_loss(params, rows):
        loss_sum, tokens = loss_sum_and_tokens(params, rows)
        # Each micro-batch's mean counts equally. The sums come back as aux
        # (summed over micro-batches) so that the reported loss is per token.
        return loss_sum / tokens, (loss_sum, tokens)

    grad_fn = ga.microbatch_value_and_grad(
        mean_loss, num_microbatches, has_aux=True, aux_reduction="sum"
    )

    @jax.jit
    def step(params, opt_state, rows):
        (_, (loss_sum, tokens)), grads = grad_fn(params, rows)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_sum / tokens, tokens

    return step


def compare_adaptive_k(args, model, params0, train_rows, val_rows) -> dict[str, Any]:
    """Fixed K against `critical_batch_schedule`, on one stream of calls.

    Every run sees the same `--sequences` sequences in the same order, in calls
    of `--call-batch` sequences (drawn at random, not length-sorted: the
    noise-scale estimate assumes independent micro-batches), each call's
    gradient weighted by its real tokens, so `b_simple` is in tokens. The inner
    optimizer has a constant learning rate, so the runs differ only in K:
    fixed `--k-min`, fixed `--k-max`, and K from `critical_batch_schedule`
    between the two, which aims the window's batch (K x the mean real tokens
    per call) at `b_simple`. The validation loss is taken at `--evals` points
    spaced evenly in sequences seen, each at the first window close past it.
    """
    loss_sum_and_tokens = make_loss(model)
    rng = np.random.default_rng(1)
    num_calls = args.sequences // args.call_batch
    calls = train_rows[rng.choice(len(train_rows), (num_calls, args.call_batch))]
    call_tokens = (calls[:, :, 1:] != PAD).sum((1, 2))
    tokens_per_call = float(call_tokens.mean())
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.01))
    sched = ga.critical_batch_schedule(
        args.k_min,
        args.k_max,
        warmup_steps=args.k_warmup,
        max_change=args.max_change,
        batch_per_micro_step=tokens_per_call,
    )
    tracked = functools.partial(
        ga.accumulate, track_noise_scale=True, noise_scale_decay=args.noise_decay
    )
    txs = {
        f"fixed K={args.k_min}": tracked(inner, args.k_min),
        f"fixed K={args.k_max}": tracked(inner, args.k_max),
        "adaptive K": tracked(inner, sched),
    }
    val_loss = jax.jit(lambda p: jnp.divide(*loss_sum_and_tokens(p, val_rows)))
    eval_every = max(num_calls // args.evals, 1)
    print(
        f"adaptive K: critical_batch_schedule({args.k_min}, {args.k_max}, "
        f"warmup_steps={args.k_warmup}, max_change={args.max_change}, batch_per_micro_step="
        f"{tokens_per_call:.1f}) against fixed K={args.k_min} and K={args.k_max}; each run sees "
        f"the same {num_calls} calls of {args.call_batch} sequences ({int(call_tokens.sum()):,} "
        f"real tokens, {tokens_per_call:.1f} per call); AdamW at a constant {args.lr}; "
        f"noise_scale_decay={args.noise_decay}"
    )
    out: dict[str, Any] = {"tokens_per_call": tokens_per_call, "runs": {}}
    for name, tx in txs.items():
        step = make_weighted_step(loss_sum_and_tokens, tx, 1)
        params, state = params0, tx.init(params0)
        windows: dict[str, list[float]] = {"tokens": [], "k": [], "b_simple": [], "loss": []}
        evals: dict[str, list[float]] = {"tokens": [0], "steps": [0], "val_loss": []}
        evals["val_loss"].append(float(val_loss(params)))
        tokens_seen, next_eval = 0, eval_every
        window_loss = window_tokens = 0.0
        progress = tqdm(range(num_calls), desc=name, unit="call", disable=args.no_progress)
        for c in progress:
            k = int(state.window_length)
            params, state, loss, n = step(params, state, jnp.asarray(calls[c]))
            tokens_seen += int(n)
            window_loss += float(loss) * float(n)
            window_tokens += float(n)
            if not bool(ga.has_updated(state)):
                continue
            windows["tokens"].append(tokens_seen)
            windows["k"].append(k)
            windows["b_simple"].append(float(ga.gradient_noise_scale(state).b_simple))
            windows["loss"].append(window_loss / window_tokens)
            window_loss = window_tokens = 0.0
            if c + 1 >= next_eval:
                evals["tokens"].append(tokens_seen)
                evals["steps"].append(int(ga.optimizer_step(state)))
                evals["val_loss"].append(float(val_loss(params)))
                next_eval += eval_every
        progress.close()
        out["runs"][name] = {"windows": windows, "evals": evals}
    print_adaptive_k_table(out["runs"])
    return out


def print_adaptive_k_table(runs: dict[str, Any]) -> None:
    print(
        f"{'run':<12} {'tokens seen':>12} {'steps':>6} {'K':>4} {'b_simple (tokens)':>18} "
        f"{'val loss':>8}"
    )
    for name, run in runs.items():
        windows, evals = run["windows"], run["evals"]
        n = len(evals["tokens"])
        for i in sorted({(n - 1) // 4, (n - 1) // 2, 3 * (n - 1) // 4, n - 1}):
            # The window that closed at this evaluation point.
            w = windows["tokens"].index(evals["tokens"][i]) if i else 0
            print(
                f"{name:<12} {evals['tokens'][i]:>12,} {evals['steps'][i]:>6} "
                f"{windows['k'][w]:>4} {windows['b_simple'][w]:>18.0f} {evals['val_loss'][i]:>8.4f}"
            )
    # The comparison that matters: the cost of reaching a loss every run reaches.
    target = max(run["evals"]["val_loss"][-1] for run in runs.values())
    print(f"to reach the validation loss {target:.4f} (the highest final one):")
    for name, run in runs.items():
        evals = run["evals"]
        i = next(j for j, v in enumerate(evals["val_loss"]) if v <= target)
        print(
            f"  {name:<12} {evals['steps'][i]:>6} optimizer steps, {evals['tokens'][i]:>10,} tokens"
        )
    changes = runs["adaptive K"]["windows"]["k"]
    print(
        f"adaptive K: from {changes[0]} to {changes[-1]} (range {min(changes)} to "
        f"{max(changes)}) over {len(changes)} optimizer steps"
    )


def write_adaptive_k_plot(path: str, result: dict[str, Any], title: str) -> None:
    fig = Figure(figsize=(11, 8), layout="constrained")
    (ax_noise, ax_k), (ax_steps, ax_tokens) = fig.subplots(2, 2)
    runs = result["runs"]
    for name, run in runs.items():
        windows, evals = run["windows"], run["evals"]
        (line,) = ax_noise.plot(windows["tokens"], windows["b_simple"], label=f"b_simple, {name}")
        ax_k.plot(windows["tokens"], windows["k"], label=name, color=line.get_color())
        ax_steps.plot(evals["steps"][1:], evals["val_loss"][1:], "o-", ms=3, label=name)
        ax_tokens.plot(evals["tokens"], evals["val_loss"], "o-", ms=3, label=name)
    adaptive = runs["adaptive K"]["windows"]
    window_batch = np.asarray(adaptive["k"]) * result["tokens_per_call"]
    ax_noise.plot(
        adaptive["tokens"],
        window_batch,
        "k:",
        label="adaptive window's batch (K x tokens per call)",
    )
    ax_noise.set(
        xlabel="training tokens seen",
        ylabel="tokens",
        yscale="log",
        title="measured noise scale b_simple (EMA) and the adaptive batch",
    )
    ax_k.set(xlabel="training tokens seen", ylabel="K (calls per window)", title="window length K")
    ax_steps.set(
        xscale="log",
        xlabel="optimizer step",
        ylabel="validation loss",
        title="loss against optimizer steps",
    )
    ax_tokens.set(
        xlabel="training tokens seen", ylabel="validation loss", title="loss against tokens seen"
    )
    for ax in (ax_noise, ax_k, ax_steps, ax_tokens):
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


@jax.jit
def max_abs_diff(a, b) -> jax.Array:
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x - y)) for x, y in zip(a, b, strict=True)]))


def write_plot(path: str, history: dict[str, list[float]], title: str) -> None:
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_loss, ax_diff = fig.subplots(1, 2)
    steps = np.arange(1, len(history["large batch"]) + 1)
    styles = {"large batch": "-", "token-weighted": "--", "unweighted": ":"}
    for name, style in styles.items():
        ax_loss.plot(steps, history[name], style, label=name)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss (nats per token)", title=title)
    ax_loss.legend()
    for name in ("token-weighted", "unweighted"):
        ax_diff.semilogy(steps, history[f"diff {name}"], styles[name], label=name)
    ax_diff.set(
        xlabel="optimizer step",
        ylabel="max |θ - θ(large batch)|",
        title="parameter difference from the large-batch run",
    )
    ax_diff.legend()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--calls", type=int, default=2, help="jitted calls per optimizer step")
    parser.add_argument(
        "--call-batch",
        type=int,
        default=None,
        help="sequences per call (default 32; 16 with --quick; 2 with --adaptive-k)",
    )
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per call")
    parser.add_argument("--seq-len", type=int, default=80, help="characters per sequence")
    parser.add_argument("--width", type=int, default=64, help="model width")
    parser.add_argument("--depth", type=int, default=2, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument(
        "--compute-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype of the activations (parameters are float32 either way)",
    )
    parser.add_argument("--plot", default="/tmp/transformer_lm.png", help="PNG file to write")
    parser.add_argument("--quick", action="store_true", help="reduced size (a smoke test)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    adaptive = parser.add_argument_group(
        "adaptive K",
        "instead of the token-weighting comparison: fixed K against K that "
        "follows the measured noise scale",
    )
    adaptive.add_argument(
        "--adaptive-k",
        action="store_true",
        help="compare critical_batch_schedule with fixed --k-min and --k-max",
    )
    adaptive.add_argument(
        "--sequences",
        type=int,
        default=None,
        help="training sequences each run sees (default 6000; 800 with --quick)",
    )
    adaptive.add_argument("--k-min", type=int, default=2, help="smallest window length")
    adaptive.add_argument("--k-max", type=int, default=64, help="largest window length")
    adaptive.add_argument("--k-warmup", type=int, default=20, help="optimizer steps at K = --k-min")
    adaptive.add_argument(
        "--max-change", type=float, default=1.25, help="largest change of K per window"
    )
    adaptive.add_argument(
        "--noise-decay", type=float, default=0.95, help="noise_scale_decay of accumulate"
    )
    adaptive.add_argument(
        "--evals", type=int, default=24, help="validation-loss evaluations per run"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seq_len = 15, 32
        args.width, args.depth, args.heads = 32, 1, 2
    if args.call_batch is None:
        args.call_batch = 2 if args.adaptive_k else 16 if args.quick else 32
    if args.sequences is None:
        args.sequences = 800 if args.quick else 6000
    if args.adaptive_k and args.sequences < args.k_max * args.call_batch:
        parser.error(
            f"--sequences {args.sequences} is less than one window of the fixed K={args.k_max} "
            f"run ({args.k_max} calls of {args.call_batch}); give more sequences or a smaller "
            "--k-max."
        )
    start = time.perf_counter()

    lines = load_lines()
    rng = np.random.default_rng(0)
    rows = encode(lines, args.seq_len)
    rows = rows[rng.permutation(len(rows))]
    num_val = len(rows) // 20
    val_rows, train_rows = jnp.asarray(rows[:num_val]), rows[num_val:]
    print(
        f"corpus: docstrings of {len(CORPUS_MODULES)} standard-library modules (Python "
        f"{sys.version.split()[0]}), {len(lines)} lines, {sum(map(len, lines))} characters "
        f"-> {len(rows)} sequences of 1 to {args.seq_len} characters ({len(train_rows)} "
        f"train, {num_val} validation)"
    )
    compute_dtype = jnp.dtype(args.compute_dtype)
    model = CharTransformer(args.seq_len, args.width, args.depth, args.heads, compute_dtype)
    params0 = model.init(jax.random.key(0), jnp.asarray(rows[:1, :-1]))["params"]
    if args.adaptive_k:
        print(
            f"model: depth {args.depth}, width {args.width}, {args.heads} heads, "
            f"{sum(x.size for x in jax.tree.leaves(params0)):,} float32 parameters; compute in "
            f"{compute_dtype.name}"
        )
        results: dict[str, Any] = {
            "adaptive_k": compare_adaptive_k(args, model, params0, train_rows, val_rows)
        }
        write_adaptive_k_plot(
            args.plot,
            results["adaptive_k"],
            f"character LM ({args.width} wide, {args.depth} deep), calls of "
            f"{args.call_batch} sequences: fixed K against critical_batch_schedule",
        )
        results["plot"] = args.plot
        results["seconds"] = time.perf_counter() - start
        print(f"plot written to {args.plot}; {results['seconds']:.1f} s in all")
        return results

    batch_size = args.calls * args.call_batch
    picks = np.stack(
        [rng.choice(len(train_rows), batch_size, replace=False) for _ in range(args.steps)]
    )
    batches = train_rows[picks]
    # Like a length-bucketing loader, sort each optimizer step's sequences by
    # length: its calls then hold very different numbers of real tokens.
    lengths = (batches[:, :, 1:] != PAD).sum(-1)
    batches = np.take_along_axis(batches, np.argsort(lengths, axis=1)[:, :, None], axis=1)
    tokens_per_call = (batches[:, :, 1:] != PAD).reshape(args.steps, args.calls, -1).sum(-1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(args.steps // 10, 1), decay_steps=args.steps
    )
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    # Inside accumulate, the clipping, the schedule and AdamW act once per
    # window, on its mean gradient. float32 is also the default accumulator
    # for float32 gradients; it is spelled out here.
    weighted_tx = ga.accumulate(inner, args.calls, accumulator_dtype=jnp.float32)
    unweighted_tx = ga.accumulate(inner, args.calls, accumulator_dtype=jnp.float32)
    loss_sum_and_tokens = make_loss(model)
    runs = {
        "large batch": (make_large_batch_step(loss_sum_and_tokens, inner), inner),
        "token-weighted": (
            make_weighted_step(loss_sum_and_tokens, weighted_tx, args.microbatches),
            weighted_tx,
        ),
        "unweighted": (
            make_unweighted_step(loss_sum_and_tokens, unweighted_tx, args.microbatches),
            unweighted_tx,
        ),
    }
    params = dict.fromkeys(runs, params0)
    opt_states = {name: tx.init(params0) for name, (_, tx) in runs.items()}

    acc_dtypes = {x.dtype.name for x in jax.tree.leaves(opt_states["token-weighted"].acc_grads)}
    param_dtypes = {x.dtype.name for x in jax.tree.leaves(params0)}
    print(
        f"model: depth {args.depth}, width {args.width}, {args.heads} heads, "
        f"{sum(x.size for x in jax.tree.leaves(params0)):,} parameters in "
        f"{', '.join(param_dtypes)}; compute in {compute_dtype.name}; accumulator in "
        f"{', '.join(acc_dtypes)}"
    )
    print(
        f"optimizer step: {batch_size} sequences = {args.calls} calls (accumulate) x "
        f"{args.call_batch} sequences = {args.calls} x {args.microbatches} micro-batches of "
        f"{args.call_batch // args.microbatches} (microbatch_value_and_grad); real tokens "
        f"per call: {tokens_per_call.min()} to {tokens_per_call.max()} of "
        f"{args.call_batch * args.seq_len}"
    )

    history: dict[str, list[float]] = {name: [] for name in runs}
    history.update({"diff token-weighted": [], "diff unweighted": []})
    log_every = max(args.steps // 10, 1)
    tqdm.write(f"{'step':>5} {'large batch':>12} {'token-weighted':>15} {'unweighted':>11}")
    progress = tqdm(range(args.steps), desc="training", unit="step", disable=args.no_progress)
    for t in progress:
        batch = jnp.asarray(batches[t])
        step = runs["large batch"][0]
        params["large batch"], opt_states["large batch"], loss = step(
            params["large batch"], opt_states["large batch"], batch
        )
        history["large batch"].append(float(loss))
        for name in ("token-weighted", "unweighted"):
            step = runs[name][0]
            loss_sum = tokens = 0.0
            for c in range(args.calls):
                call_rows = batch[c * args.call_batch : (c + 1) * args.call_batch]
                params[name], opt_states[name], loss, n = step(
                    params[name], opt_states[name], call_rows
                )
                loss_sum += float(loss) * float(n)
                tokens += float(n)
            history[name].append(loss_sum / tokens)
            diff = max_abs_diff(
                jax.tree.leaves(params[name]), jax.tree.leaves(params["large batch"])
            )
            history[f"diff {name}"].append(float(diff))
        progress.set_postfix(loss=f"{history['large batch'][-1]:.3f}")
        if t % log_every == 0 or t == args.steps - 1:
            tqdm.write(
                f"{t + 1:>5} {history['large batch'][-1]:>12.4f} "
                f"{history['token-weighted'][-1]:>15.4f} {history['unweighted'][-1]:>11.4f}"
            )
    progress.close()

    val_loss = jax.jit(lambda p: jnp.divide(*loss_sum_and_tokens(p, val_rows)))
    results: dict[str, Any] = {
        "optimizer_steps": int(ga.optimizer_step(opt_states["token-weighted"])),
        "calls": args.steps * args.calls,
        "history": history,
    }
    for name, key in (
        ("large batch", "large_batch"),
        ("token-weighted", "weighted"),
        ("unweighted", "unweighted"),
    ):
        results[f"first_loss_{key}"] = history[name][0]
        results[f"final_loss_{key}"] = history[name][-1]
        results[f"val_loss_{key}"] = float(val_loss(params[name]))
    results["param_diff_weighted"] = history["diff token-weighted"][-1]
    results["param_diff_unweighted"] = history["diff unweighted"][-1]

    def by_run(prefix: str) -> str:
        return (
            f"large batch {results[prefix + 'large_batch']:.4f}, token-weighted "
            f"{results[prefix + 'weighted']:.4f}, unweighted {results[prefix + 'unweighted']:.4f}"
        )

    print(f"final training loss (nats per token): {by_run('final_loss_')}")
    print(f"validation loss (nats per token): {by_run('val_loss_')}")
    print(
        f"optimizer steps of the accumulated runs (ga.optimizer_step): "
        f"{results['optimizer_steps']}, from {results['calls']} calls"
    )
    print(
        "largest parameter difference from the large-batch run: token-weighted "
        f"{results['param_diff_weighted']:.3e}, unweighted {results['param_diff_unweighted']:.3e}"
    )
    if args.adaptive_k:
        results["adaptive_k"] = compare_adaptive_k(
            args, loss_sum_and_tokens, inner, params0, train_rows
        )
    write_plot(args.plot, history, f"character LM, {compute_dtype.name} compute")
    results["plot"] = args.plot
    results["seconds"] = time.perf_counter() - start
    print(f"loss curves written to {args.plot}; {results['seconds']:.1f} s in all")
    return results


if __name__ == "__main__":
    main()
