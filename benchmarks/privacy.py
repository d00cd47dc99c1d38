"""Cost of differential privacy: per-example clipped sums against the non-private gradient.

The three shapes of issue 39 (Flax linen, float32), each one batch under `jit`,
timed interleaved (median of repetitions, the order reversed every other round):

- MLP: 4 Dense layers of width 512, input 256, 10 classes, B = 256;
- CNN: Conv 16 (3x3) + Conv 32 (3x3, stride 2) + Dense, 28x28x1, B = 128;
- transformer LM: Embed 256 x 128, 2 blocks (LayerNorm, 4-head causal attention,
  MLP 512), T = 64, B = 64;

and the recurrent one of issue 44: an LSTM LM, Embed 256 x 64, `nn.RNN(nn.LSTMCell(128))`,
a Dense head, T = 64, B = 32 (its cell's weights are reused by every step of the scan).

Candidates, each against `jax.value_and_grad` of the mean loss on the same batch (the
fast path interleaved with it alone; the per-example ones, whose calls write a gradient
per example and slow whatever runs next, in a group of their own):
`privacy.clipped_grad(loss, C)` (the fast path: ghost norms and book-keeping),
`privacy.clipped_grad(loss, C, method="per_example", microbatch_size=m)` (vmap), and
`jax_privacy.clipping.clipped_grad(loss, l2_clip_norm=C, microbatch_size=m)`.
Compiled temp bytes (`memory_analysis()`) beside the times. Targets (issue 39):
fast / non-private <= 1.3x (MLP), <= 1.4x (transformer), <= 2.0x (CNN, LSTM); temp <= 2x
(CNN <= 3x; none set for the LSTM).

Also, on the 85k-parameter MLP of the earlier rounds: the padded-batch saving (half
the batch marked as padding, chunks skipped) and a whole DP step (clipped sum,
`dp_accumulate` with noise, SGD) against a non-private step.

With `GRADACCUM_OPACUS_PYTHON` set to a Python that has torch and Opacus, the same
shapes run there too (`benchmarks/privacy_opacus.py`: Opacus' ghost clipping against
its non-private step), reported beside ours; without it those rows say so.

The machine is shared and noisy: read the ratios, measured side by side.

Under remat (issue 44): the Gemma-like decoder of `examples/dp_lm.py` at T = 256 and
512, B = 8, the fast path with `remat="auto"` (the default), `"recompute"` and `"save"`
against the non-private step under the same `nn.remat`; targets: temp <= 1.5x, time
<= 1.3x; and the share of remat's saving each keeps.

    python benchmarks/privacy.py [--quick] [--reps N] [--models lstm,...] [--remat]

`--models` measures those models alone (no padded-batch, DP-step, example, Opacus or
remat rows; `--remat` adds the remat rows).
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess

import flax.linen as nn
import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax import privacy

C, SIGMA = 1.0, 1.1
MODELS = ("mlp", "cnn", "transformer", "lstm")
TARGETS = {"mlp": (1.3, 2.0), "cnn": (2.0, 3.0), "transformer": (1.4, 2.0), "lstm": (2.0, None)}


class MLP(nn.Module):
    width: int = 512

    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=(2, 2))(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class Block(nn.Module):
    heads: int = 4
    hidden: int = 512

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(self.heads)(h, h, mask=mask)
        h = nn.Dense(self.hidden)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class LM(nn.Module):
    vocab: int = 256
    width: int = 128

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class LSTMLM(nn.Module):
    vocab: int = 256
    width: int = 64
    hidden: int = 128

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        return nn.Dense(self.vocab)(nn.RNN(nn.LSTMCell(self.hidden))(x))


def setup(name: str, quick: bool):
    """`(loss, params, batch, description)` of one of the shapes."""
    rng = np.random.default_rng(0)
    if name == "mlp":
        model, batch_size = (MLP(32), 16) if quick else (MLP(), 256)
        x = jnp.asarray(rng.normal(size=(batch_size, 256)), jnp.float32)
        batch = (x, jnp.asarray(rng.integers(0, 10, batch_size)))
        first = x[:1]
    elif name == "cnn":
        model, batch_size = CNN(), 8 if quick else 128
        x = jnp.asarray(rng.normal(size=(batch_size, 28, 28, 1)), jnp.float32)
        batch = (x, jnp.asarray(rng.integers(0, 10, batch_size)))
        first = x[:1]
    else:
        if name == "lstm":
            model, batch_size, length = (LSTMLM(32, 16, 24), 4, 8) if quick else (LSTMLM(), 32, 64)
        else:
            model, batch_size, length = (LM(32, 16), 4, 8) if quick else (LM(), 64, 64)
        tokens = jnp.asarray(rng.integers(0, model.vocab, (batch_size, length + 1)), jnp.int32)
        batch = (tokens[:, :-1], tokens[:, 1:])
        first = tokens[:1, :-1]
    params = model.init(jax.random.key(1), first)

    def loss(params, batch):
        inputs, labels = batch
        logits = model.apply(params, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    size = sum(leaf.size for leaf in jax.tree.leaves(params))
    return loss, params, batch, f"{name}, {size / 1e3:.0f}k parameters, B = {batch_size}"


def _compiled(fn, *args) -> tuple[float, float]:
    """`(temp MiB, floating-point operations)` of the compiled program."""
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return harness.compiled_memory(compiled).temp_bytes / 2**20, float(cost.get("flops", 0.0))


def measure_model(name: str, quick: bool, reps: int, micro: int) -> list[dict]:
    from jax_privacy import clipping

    loss, params, batch, description = setup(name, quick)
    micro = min(micro, batch[0].shape[0])
    candidates = {
        "non-private": jax.value_and_grad(loss),
        "fast": privacy.clipped_grad(loss, C),
        "per_example": privacy.clipped_grad(loss, C, method="per_example", microbatch_size=micro),
        "jax_privacy": clipping.clipped_grad(loss, l2_clip_norm=C, microbatch_size=micro),
    }
    jitted = {k: jax.jit(f) for k, f in candidates.items()}
    calls = {k: (lambda f=f: f(params, batch)) for k, f in jitted.items()}
    # Two groups, each against its own non-private runs: a per-example call writes a
    # gradient per example (hundreds of MB on the MLP), which slows whatever runs next.
    times = harness.interleaved_times(
        {k: calls[k] for k in ("non-private", "fast")}, reps, warmup=2
    )
    slow = harness.interleaved_times(
        {k: calls[k] for k in ("non-private", "per_example", "jax_privacy")},
        max(2, reps // 5),
        warmup=1,
    )
    references = {"fast": times["non-private"]}
    for k in ("per_example", "jax_privacy"):
        times[k], references[k] = slow[k], slow["non-private"]
    compiled = {k: _compiled(f, params, batch) for k, f in candidates.items()}
    temps = {k: temp for k, (temp, _) in compiled.items()}
    flops = {k: f for k, (_, f) in compiled.items()}
    plan = privacy.clipped_grad(loss, C).plan(params, batch)
    methods = {m: sum(leaf.method == m for leaf in plan) for m in ("ghost", "layer")}
    rows = []
    target_time, target_temp = TARGETS[name]
    for k in ("fast", "per_example", "jax_privacy"):
        ratio, q1, q3 = harness.ratio_quartiles(times[k], references[k])
        rows.append(
            {
                "benchmark": "privacy",
                "model": name,
                "description": description,
                "measure": "vs_non_private",
                "candidate": k,
                "ms": 1e3 * float(np.median(times[k])),
                "ms_reference": 1e3 * float(np.median(references[k])),
                "ratio": ratio,
                "ratio_q1": q1,
                "ratio_q3": q3,
                "temp_mib": temps[k],
                "temp_mib_reference": temps["non-private"],
                "temp_ratio": temps[k] / temps["non-private"],
                # XLA's count: what the step computes, whatever this CPU makes of it.
                "flops_ratio": flops[k] / flops["non-private"] if flops["non-private"] else None,
                "microbatch_size": None if k == "fast" else micro,
                "target_ratio": target_time if k == "fast" else None,
                "target_temp_ratio": target_temp if k == "fast" else None,
                "leaves_ghost": methods["ghost"] if k == "fast" else None,
                "leaves_layer": methods["layer"] if k == "fast" else None,
            }
        )
    return rows


def _example(name: str):
    """The module of `examples/<name>.py`, loaded once per process (the examples are not a
    package)."""
    import importlib.util
    import sys

    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def measure_remat(quick: bool, reps: int) -> list[dict]:
    """The Gemma-like decoder of `examples/dp_lm.py` under `nn.remat`, T = 256 and 512
    (B = 8): the fast path with each `remat=` mode against the non-private
    step under the same remat (times interleaved, compiled temps), and the share of
    remat's saving each keeps: (temp without remat - temp with) over the non-private
    step's."""
    dp_lm = _example("dp_lm")

    rows = []
    for length in (16,) if quick else (256, 512):
        batch_size = 2 if quick else 8
        rng = np.random.default_rng(0)
        tokens = jnp.asarray(rng.integers(0, dp_lm.VOCAB, (batch_size, length + 1)), jnp.int32)
        batch = (tokens[:, :-1], tokens[:, 1:])
        candidates, temps = {}, {}
        for remat in (True, False):
            model = dp_lm.Decoder(remat=remat)
            params = model.init(jax.random.key(0), tokens[:1, :-1])

            def loss(params, batch, model=model):
                logits = model.apply(params, batch[0])
                return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

            fns = {"non-private": jax.value_and_grad(loss)}
            fns["auto"] = privacy.clipped_grad(loss, C)
            if remat:
                for mode in ("recompute", "save"):
                    fns[mode] = privacy.clipped_grad(loss, C, remat=mode)
            for k, fn in fns.items():
                temps[k, remat] = _compiled(fn, params, batch)[0]
                if remat:
                    jitted = jax.jit(fn)
                    candidates[k] = lambda f=jitted, p=params, b=batch: f(p, b)
        times = harness.interleaved_times(candidates, reps, warmup=1)
        saving = temps["non-private", False] - temps["non-private", True]
        for k in ("auto", "recompute", "save"):
            ratio, q1, q3 = harness.ratio_quartiles(times[k], times["non-private"])
            kept = (temps["auto", False] - temps[k, True]) / saving
            rows.append(
                {
                    "benchmark": "privacy",
                    "model": f"gemma_remat_T{length}",
                    "description": f"Gemma-like decoder under nn.remat, T = {length}, "
                    f"B = {batch_size}",
                    "measure": "remat",
                    "candidate": k,
                    "ms": 1e3 * float(np.median(times[k])),
                    "ms_reference": 1e3 * float(np.median(times["non-private"])),
                    "ratio": ratio,
                    "ratio_q1": q1,
                    "ratio_q3": q3,
                    "temp_mib": temps[k, True],
                    "temp_mib_reference": temps["non-private", True],
                    "temp_ratio": temps[k, True] / temps["non-private", True],
                    "saving_kept": kept,
                    "target_ratio": 1.3,
                    "target_temp_ratio": 1.5,
                }
            )
    return rows


def make_params(widths: tuple[int, ...], seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.zeros(b, jnp.float32),
        }
        for a, b in itertools.pairwise(widths)
    ]


def mlp_loss(params: list[dict], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def measure_steps(widths: tuple[int, ...], batch: int, micro: int, reps: int) -> list[dict]:
    """Half padding (chunks skipped) and a whole DP step, on the small MLP."""
    params = make_params(widths)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(batch, widths[0])), jnp.float32)
    y = jnp.asarray(rng.integers(0, widths[-1], size=batch), jnp.int32)
    data = (x, y)
    half = np.arange(batch) >= batch // 2
    chunked = jax.jit(privacy.clipped_grad(mlp_loss, C, microbatch_size=micro))
    clipped = privacy.clipped_grad(mlp_loss, C)
    inner = optax.sgd(0.1)
    tx = privacy.dp_accumulate(
        inner,
        1,
        l2_clip_norm=C,
        noise_multiplier=SIGMA,
        expected_batch_size=batch,
        key=jax.random.key(0),
    )

    @jax.jit
    def dp_step(params, state, batch):
        _, grad_sum = clipped(params, batch)
        updates, state = tx.update(grad_sum, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def plain_step(params, state, batch):
        _, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    dp_state, plain_state = tx.init(params), inner.init(params)
    fns = {
        "full": lambda: chunked(params, data),
        "half padding": lambda: chunked(params, data, is_padding_example=half),
        "dp step": lambda: dp_step(params, dp_state, data),
        "plain step": lambda: plain_step(params, plain_state, data),
    }
    times = harness.interleaved_medians(fns, reps, warmup=2)
    size = sum(leaf.size for leaf in jax.tree.leaves(params))
    common = {"benchmark": "privacy", "params": size, "batch": batch, "microbatch_size": micro}
    return [
        {
            **common,
            "measure": "clipped_sum_half_padding",
            "candidate": "clipped sum, half the batch padding / none",
            "ms": 1e3 * times["half padding"],
            "ms_reference": 1e3 * times["full"],
            "ratio": times["half padding"] / times["full"],
        },
        {
            **common,
            "measure": "dp_step",
            "candidate": "DP step (clipped_grad, dp_accumulate K=1, SGD) / non-private step",
            "ms": 1e3 * times["dp step"],
            "ms_reference": 1e3 * times["plain step"],
            "ratio": times["dp step"] / times["plain step"],
        },
    ]


def measure_example(quick: bool) -> list[dict]:
    """examples/dp_digits.py's private training on each path: seconds per epoch."""
    example = _example("dp_digits")
    seconds = {}
    for method in ("fast", "per_example"):
        args = example.parse_args(["--method", method, "--epochs", "2" if quick else "6"])
        seconds[method] = example.train_private(args, *example.load_data(0))["seconds_per_epoch"]
    return [
        {
            "benchmark": "privacy",
            "measure": "dp_digits_example",
            "candidate": "examples/dp_digits.py private training, s per epoch: fast / per_example",
            "ms": 1e3 * seconds["fast"],
            "ms_reference": 1e3 * seconds["per_example"],
            "ratio": seconds["fast"] / seconds["per_example"],
        }
    ]


def measure_lm_example(quick: bool) -> list[dict]:
    """examples/dp_lm.py as it runs: the planned chunk size and peaks, epsilon, and one
    private call against one non-private call under the same remat."""
    dp_lm = _example("dp_lm")

    out = dp_lm.main(["--quick"] if quick else [])
    plan, seconds, temp = out["plan"], out["seconds"], out["temp_bytes"]
    return [
        {
            "benchmark": "privacy",
            "measure": "dp_lm_example",
            "candidate": "examples/dp_lm.py: one private call (planned chunks) / non-private",
            "ms": 1e3 * seconds["private"],
            "ms_reference": 1e3 * seconds["non-private"],
            "ratio": seconds["private"] / seconds["non-private"],
            "temp_ratio": temp["private"] / temp["non-private"],
            "microbatch_size": plan.microbatch_size,
            "peaks_mib": {
                str(plan.microbatch_size * plan.num_microbatches // k): v / 2**20
                for k, v in sorted(plan.table.items())
            },
            "epsilon": out["epsilon"],
            "second_pass": out["second_pass"],
        }
    ]


def opacus_rows(quick: bool, reps: int) -> list[dict]:
    """Opacus' ghost clipping on the same shapes, where a Python with torch is given."""
    python = os.environ.get("GRADACCUM_OPACUS_PYTHON")
    if not python:
        return [
            {
                "benchmark": "privacy",
                "measure": "opacus_ghost",
                "candidate": "opacus ghost clipping",
                "note": "not measured: set GRADACCUM_OPACUS_PYTHON to a Python with torch "
                "and opacus",
            }
        ]
    script = pathlib.Path(__file__).with_name("privacy_opacus.py")
    argv = [python, str(script), "--reps", str(reps)] + (["--quick"] if quick else [])
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, reps="interleaved rounds per model")
    parser.add_argument(
        "--models",
        default=None,
        help=f"comma-separated, among {', '.join(MODELS)}: those models alone",
    )
    parser.add_argument(
        "--remat",
        action="store_true",
        help="with --models: the remat rows (Gemma-like decoder, T = 256, 512) as well",
    )
    args = parser.parse_args(argv)
    reps = args.reps or (2 if args.quick else 21)
    names = MODELS if args.models is None else tuple(args.models.split(","))
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    rows = []
    for name in names:
        rows += measure_model(name, args.quick, reps, micro=8 if args.quick else 32)
    if args.models is None or args.remat:
        rows += measure_remat(args.quick, reps if args.quick else min(reps, 11))
    if args.models is None:
        if args.quick:
            rows += measure_steps((64, 32, 10), 32, 8, reps)
        else:
            rows += measure_steps((64, 256, 256, 10), 256, 32, 21)
        rows += measure_example(args.quick)
        if not args.quick:  # its --quick run is tests/test_example_dp_lm.py's
            rows += measure_lm_example(args.quick)
        rows += opacus_rows(args.quick, reps)
    print(f"privacy: C={C}, jax {jax.__version__} (shared, noisy machine: ratios side by side)")
    print(f"{'model':<12} {'candidate':<12} {'ms':>9} {'ref ms':>9} {'ratio':>6} {'temp':>7}")
    for r in rows:
        if r.get("measure") == "remat":
            print(
                f"{r['model']:<12} {r['candidate']:<12} {r['ms']:9.2f} {r['ms_reference']:9.2f}"
                f" {r['ratio']:6.2f} {r['temp_ratio']:6.2f}x  (remat's saving kept: "
                f"{100 * r['saving_kept']:.0f} %)"
            )
        elif r.get("measure") in ("vs_non_private", "opacus_ghost") and "ratio" in r:
            temp = f"{r['temp_ratio']:6.2f}x" if r.get("temp_ratio") else ""
            print(
                f"{r['model']:<12} {r['candidate']:<12} {r['ms']:9.2f} {r['ms_reference']:9.2f}"
                f" {r['ratio']:6.2f} {temp}"
            )
        elif "ratio" in r:
            print(
                f"{r['candidate']}: {r['ratio']:.2f} ({r['ms']:.2f} / {r['ms_reference']:.2f} ms)"
            )
        else:
            print(f"{r['candidate']}: {r.get('note', '')}")
    return rows


if __name__ == "__main__":
    main()
