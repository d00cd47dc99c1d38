"""Compile time of jitted optimizer steps against optax, at two leaf counts.

A jitted step is compiled again on every restart and every shape change, on
every host of a pod. This benchmark compiles each candidate on transformer-shaped
trees (12 leaves per layer, width 64) of two sizes, with the persistent
compilation cache off and `jax.clear_caches()` before every compile, under
XLA's default flags (this script is its own process: nothing of the tests'
fast-compile settings applies). Rounds go through every candidate in turn (the
order reversed every other round), so the machine's load hits them alike; the
median of the rounds is reported, with the spread (max / min) of each ratio.

Candidates (a donated step `(params, state, grads) -> (params, state)`; the
clippers alone `(grads) -> grads`):
  `optax.adam`, `optax.adamw`: update + `optax.apply_updates`;
  `MultiSteps(adam, 4)`: the same through `optax.MultiSteps`;
  `accumulate(adam, 4)`: `gradaccum_jax.apply_gradients` (the fused path);
  `clip + accumulate(adamw, 4)`: `chain(clip_norm(1.0), accumulate(adamw, 4))`
  through `apply_gradients`;
  `optax.clip_by_global_norm`, `ga.clip_norm`: the update alone.

Columns: `compile_s` (trace, lower and compile; median of the rounds),
`ratio` against the anchor the target names (and its range over the rounds),
`instr/leaf` (instructions of the compiled HLO per leaf), and `peak_MB`: the
compiler's peak memory, measured in a fresh child process as the rise of the
resident set's peak (`VmHWM`, reset just before) above its size before one
compile (tracing, lowering and XLA together; the child has built the tree and
the state and traced nothing else).

    python benchmarks/compile_time.py            # 291 and 579 leaves, 3 rounds
    python benchmarks/compile_time.py --quick    # 15 and 27 leaves, 1 round, no children
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import harness
import jax
import optax

import gradaccum_jax as ga

jax.config.update("jax_enable_compilation_cache", False)

HERE = pathlib.Path(__file__).resolve().parent
K = 4
# Which candidate each target compares with, and the target.
ANCHORS = {
    "MultiSteps(adam, 4)": ("optax.adam", None),
    "accumulate(adam, 4)": ("optax.adam", 3.0),
    "clip + accumulate(adamw, 4)": ("optax.adamw", 3.5),
    "ga.clip_norm": ("optax.clip_by_global_norm", 2.0),
}
AGAINST_MULTISTEPS = ("accumulate(adam, 4)", 1.2)


def _optax_step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _fused_step(tx):
    def step(params, state, grads):
        return ga.apply_gradients(tx, grads, state, params)

    return step


def _clip_only(tx):
    def step(grads):
        return tx.update(grads, tx.init(grads))[0]

    return step


def candidates() -> dict[str, tuple[Callable, optax.GradientTransformation | None]]:
    """name -> (step function, transformation whose state the step carries, or None)."""
    adam, adamw = optax.adam(1e-3), optax.adamw(1e-3)
    multi = optax.MultiSteps(optax.adam(1e-3), K).gradient_transformation()
    acc = ga.accumulate(optax.adam(1e-3), K)
    chained = optax.chain(ga.clip_norm(1.0), ga.accumulate(optax.adamw(1e-3), K))
    return {
        "optax.adam": (_optax_step(adam), adam),
        "optax.adamw": (_optax_step(adamw), adamw),
        "MultiSteps(adam, 4)": (_optax_step(multi), multi),
        "accumulate(adam, 4)": (_fused_step(acc), acc),
        "clip + accumulate(adamw, 4)": (_fused_step(chained), chained),
        "optax.clip_by_global_norm": (_clip_only(optax.clip_by_global_norm(1.0)), None),
        "ga.clip_norm": (_clip_only(ga.clip_norm(1.0)), None),
    }


def compile_once(name: str, layers: int, inputs: tuple | None = None) -> tuple[float, int]:
    """Seconds to trace, lower and compile `name`'s step afresh, and its instruction count.

    `inputs` is `prepare(name, layers)`, or None to build it here.
    """
    fn, tx = candidates()[name]
    args = inputs if inputs is not None else prepare(name, layers)
    jax.clear_caches()
    start = time.perf_counter()
    if tx is None:
        compiled = jax.jit(fn).lower(*args).compile()
    else:
        compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile()
    seconds = time.perf_counter() - start
    hlo = harness.Hlo(compiled)
    return seconds, sum(len(insts) for insts in hlo.computations.values())


def prepare(name: str, layers: int) -> tuple:
    """The arguments `name`'s step is compiled for: `(grads,)` or `(params, state, grads)`."""
    _, tx = candidates()[name]
    tree = harness.transformer_params(layers, 64, 256)
    args = (tree,) if tx is None else (tree, tx.init(tree), tree)
    return jax.block_until_ready(args)


def _status_mb(field: str) -> float:
    """A field of /proc/self/status (`VmRSS`, `VmHWM`) in MB."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def peak_growth(name: str, layers: int) -> float:
    """MB the resident set's peak rises above its size before one compile of `name`.

    The peak (`VmHWM`) is reset first (`/proc/self/clear_refs`), so that what
    the process touched before (imports, the tree) does not count.
    """
    inputs = prepare(name, layers)
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    before = _status_mb("VmRSS")
    compile_once(name, layers, inputs)
    return _status_mb("VmHWM") - before


def _child_peak(name: str, layers: int) -> float:
    """`peak_growth` measured in a fresh process (a forked child would start from this one's)."""
    code = (
        f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import compile_time as c; "
        f"print(json.dumps(c.peak_growth({name!r}, {layers})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, quick="small trees, one round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--only", nargs="*", default=None, help="candidate names")
    parser.add_argument("--no-memory", action="store_true", help="skip the child processes")
    args = parser.parse_args(argv)
    layer_counts = (1, 2) if args.quick else (24, 48)
    rounds = args.rounds or (1 if args.quick else 3)
    memory = not (args.quick or args.no_memory)
    names = list(candidates())
    if args.only:
        names = [n for n in names if n in args.only]
    print(
        f"compile_time: transformer trees of {[12 * n + 3 for n in layer_counts]} leaves, "
        f"{rounds} rounds, {jax.devices()[0].platform}, cache off, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
        f"JAX_DISABLE_MOST_OPTIMIZATIONS={os.environ.get('JAX_DISABLE_MOST_OPTIMIZATIONS', '')!r}"
    )
    rows = []
    for layers in layer_counts:
        leaves = 12 * layers + 3
        times: dict[str, list[float]] = {n: [] for n in names}
        counts: dict[str, int] = {}
        for r in range(rounds):
            for name in names if r % 2 == 0 else reversed(names):
                seconds, counts[name] = compile_once(name, layers)
                times[name].append(seconds)
        print(
            f"\n{leaves} leaves\n{'candidate':<28} {'compile_s':>9} {'instr/leaf':>10} "
            f"{'peak_MB':>8}  ratios (median, min-max over rounds; target)"
        )
        for name in names:
            row = {
                "benchmark": "compile_time",
                "candidate": name,
                "leaves": leaves,
                "compile_s": round(statistics.median(times[name]), 3),
                "instructions": counts[name],
                "instr_per_leaf": round(counts[name] / leaves, 2),
            }
            if memory:
                row["peak_MB"] = round(_child_peak(name, layers), 1)
            ratios = []
            anchor, target = ANCHORS.get(name, (None, None))
            pairs = [("x_anchor", anchor, target)] if anchor in times else []
            if name == AGAINST_MULTISTEPS[0] and "MultiSteps(adam, 4)" in times:
                pairs.append(("x_multisteps", "MultiSteps(adam, 4)", AGAINST_MULTISTEPS[1]))
            for key, other, limit in pairs:
                per_round = [a / b for a, b in zip(times[name], times[other], strict=True)]
                row[key] = round(statistics.median(per_round), 3)
                row[key + "_min"] = round(min(per_round), 3)
                row[key + "_max"] = round(max(per_round), 3)
                row[key + "_target"] = limit
                goal = "" if limit is None else f"; <= {limit}"
                spread = f"{row[key + '_min']:.2f}-{row[key + '_max']:.2f}{goal}"
                ratios.append(f"{row[key]:.2f}x {other} ({spread})")
            peak = f"{row['peak_MB']:8.1f}" if "peak_MB" in row else f"{'-':>8}"
            print(
                f"{name:<28} {row['compile_s']:9.2f} {row['instr_per_leaf']:10.2f} {peak}  "
                + ", ".join(ratios)
            )
            rows.append(row)
    small, large = layer_counts
    print("\ninstructions per added leaf (growth from the small tree to the large one)")
    for name in names:
        a = next(r for r in rows if r["candidate"] == name and r["leaves"] == 12 * small + 3)
        b = next(r for r in rows if r["candidate"] == name and r["leaves"] == 12 * large + 3)
        slope = (b["instructions"] - a["instructions"]) / (b["leaves"] - a["leaves"])
        b["instr_per_added_leaf"] = round(slope, 2)
        print(f"{name:<30} {slope:8.2f}  (per leaf {a['instr_per_leaf']} -> {b['instr_per_leaf']})")
    return rows


if __name__ == "__main__":
    main()
