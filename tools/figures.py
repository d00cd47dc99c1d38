"""Writes every benchmark figure quoted in README.md and docs/*.md from one file of rows.

Pages mark a quoted figure as `<!-- fig:NAME -->1.14×<!-- /fig -->`; this script replaces
the text between the two comments with FIGURES[NAME] computed from
`benchmarks/results/rows.json` (what `python benchmarks/run.py` writes). `bash dev.sh bench`
runs it after the benchmarks, so prose and report never disagree;
`tests/test_docs.py` fails when a page and the rows do.

    python tools/figures.py            # rewrite the marked spans
    python tools/figures.py --check    # exit 1 and list the spans that differ
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = ROOT / "benchmarks" / "results" / "rows.json"
SPAN = re.compile(r"<!-- fig:(?P<name>[\w.-]+) -->(?P<value>.*?)<!-- /fig -->", re.S)
BIG = "MLP 33.6M params, 4 leaves"
MANY_LEAVES = "MLP 0.42M params, 200 leaves"
TRAIN_STEP = "MLP 33.56M params"

Rows = dict[str, list[dict[str, Any]]]


def row(rows: Rows, benchmark: str, **match: Any) -> dict[str, Any]:
    """The one row of `benchmark` whose fields equal `match`."""
    found = [r for r in rows.get(benchmark, []) if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise KeyError(f"{len(found)} rows of {benchmark!r} match {match} in {ROWS.name}")
    return found[0]


def micro(rows: Rows, candidate: str, model: str = BIG) -> dict[str, Any]:
    return row(rows, "accumulate", model=model, candidate=candidate)


TIMES = "\u00d7"  # the multiplication sign the pages print after a ratio
DASH = "\u2013"  # the en dash of a range


def times(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}{TIMES}"


def megabytes(mb: float) -> str:
    return f"{mb * 1e3:.0f} kB" if mb < 1 else f"{mb:.0f} MB"


ACC = "accumulate(adam) micro-step"
ACC_NO_CHECK = "accumulate(adam, skip_nonfinite=False) micro-step"
MULTISTEPS = "optax.MultiSteps(adam) micro-step"
APPLY_EVERY = "optax.chain(adam, apply_every) micro-step"
ZEROS = "floor + zero updates"


AGAINST_ZEROS = "ratio: micro-step / (floor + zero updates)"
AGAINST_ZEROS_NO_CHECK = "ratio: micro-step without the check / (floor + zero updates)"


def with_quartiles(r: dict[str, Any]) -> str:
    """A ratio row's median over the rounds, and its quartiles: `1.02× (0.99–1.05)`."""
    return f"{times(r['x_floor'])} ({r['x_floor_q1']:.2f}{DASH}{r['x_floor_q3']:.2f})"


def _distributed(rows: Rows, k: int) -> dict[str, Any]:
    return row(rows, "distributed", k=k, candidate="ours")


def _microbatch(rows: Rows, k: int) -> dict[str, Any]:
    return row(rows, "microbatch", method="ours", K=k)


# --- whole tables ------------------------------------------------------------------------------
# A span may hold a Markdown table: `<!-- fig:table.NAME -->`, a blank line, the table, a blank
# line, `<!-- /fig -->` (the blank lines end the HTML comment's block for Markdown).


def table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n\n" + "\n".join(out) + "\n\n"


def sci(x: float) -> str:
    return f"{x:.1e}"


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


MICROBATCH_NAMES = {
    "full": "`jax.value_and_grad`",
    "ours": "ours",
    "optax.microbatch": "`optax.microbatching.microbatch`",
    "optax.micro_grad": "`optax.microbatching.micro_grad`",
}


def microbatch_table(rows: Rows) -> str:
    runs = rows["microbatch"]
    largest = max(r["K"] for r in runs)
    shown = [r for r in runs if r["method"] in ("full", "ours") or r["K"] == largest]
    return table(
        ["method", "K", "temp MiB", "temp / full", "time / full", "time / optax.microbatch"],
        [
            [
                MICROBATCH_NAMES[r["method"]],
                str(r["K"]),
                mib(r["temp_bytes"]),
                f"{r['temp_vs_full']:.3f}",
                f"{r['time_vs_full']:.2f}",
                "" if r["method"] == "full" else f"{r['time_vs_optax_microbatch']:.2f}",
            ]
            for r in shown
        ],
    )


def _microbatch_speed_range(rows: Rows) -> str:
    ratios = [r["time_vs_optax_microbatch"] for r in rows["microbatch"] if r["method"] == "ours"]
    return f"{min(ratios):.2f}{DASH}{max(ratios):.2f}"


def _accuracy(rows: Rows, accumulator: str) -> list[dict[str, Any]]:
    return [
        r
        for r in rows["mixed_precision"]
        if r["table"] == "accuracy" and r["accumulator"] == accumulator
    ]


def mixed_accuracy_table(rows: Rows) -> str:
    acc = [r for r in rows["mixed_precision"] if r["table"] == "accuracy"]
    columns = sorted({(r["K"], r["regime"]) for r in acc}, key=lambda c: (c[0], c[1] != "init"))
    names = list(dict.fromkeys(r["accumulator"] for r in acc))
    return table(
        ["accumulator", *(f"K={k} {regime}" for k, regime in columns)],
        [
            [
                name,
                *(
                    sci(
                        row(rows, "mixed_precision", accumulator=name, K=k, regime=g)[
                            "rel_l2_error"
                        ]
                    )
                    for k, g in columns
                ),
            ]
            for name in names
        ],
    )


def mixed_memory_table(rows: Rows) -> str:
    mem = [r for r in rows["mixed_precision"] if r["table"] == "memory"]
    return table(
        [
            "accumulator",
            "accumulator state, bytes/param",
            "temp bytes/param",
            "copies",
            "micro-step time",
        ],
        [
            [
                r["accumulator"],
                f"{r['accumulator_bytes_per_param']:g}",
                f"{r['temp_bytes_per_param']:.0f}",
                str(r["argument_copies"]),
                f"{r['micro_step_time_vs_float32']:.2f}",
            ]
            for r in mem
        ],
    )


def _percent_range(errors: list[float]) -> str:
    return f"{100 * min(errors):.2f}{DASH}{100 * max(errors):.2f} %"


def _bf16_gain(rows: Rows) -> str:
    plain = max(r["rel_l2_error"] for r in _accuracy(rows, "bfloat16"))
    kahan = max(r["rel_l2_error"] for r in _accuracy(rows, "bfloat16 + Kahan"))
    return f"{plain / kahan:.0f}{TIMES}"


GLOBAL_VIEW_NAMES = {
    "multisteps": "`optax.MultiSteps` in the jitted step",
    "unreduced": "`accumulate` + `unreduced_value_and_grad`",
    "zero1": 'the same with `shard_inner_state="data"`',
    "shard_map": "`shard_map` + `axis_name`",
    "fsdp": "params sharded (FSDP), `jax.grad` + `accumulate`",
    "fsdp_unreduced": "params sharded, `unreduced_value_and_grad` + `accumulate`",
}


def _collectives(ops: str) -> str:
    """ "all-gatherx12,all-reducex1" (the benchmark's field) as "12 all-gather + 1 all-reduce"."""
    counts = [op.rpartition("x") for op in ops.split(",") if op]
    return " + ".join(f"{n} {name}" for name, _, n in counts) or "none"


def global_view_table(rows: Rows) -> str:
    runs = rows["global_view"]
    ks = sorted({r["k"] for r in runs})

    def per_k(name: str, field: str, fmt: Callable[[Any], str]) -> str:
        values = [fmt(row(rows, "global_view", k=k, candidate=name)[field]) for k in ks]
        return values[0] if len(set(values)) == 1 else " / ".join(values)

    return table(
        [
            "per window, K = " + " / ".join(map(str, ks)),
            "collectives",
            "MB moved",
            "time / MultiSteps",
            "time / `shard_map`",
            "inner state MB per device",
            "temp MB",
        ],
        [
            [
                label,
                per_k(name, "collective_ops", _collectives),
                per_k(name, "mb_per_window", lambda mb: f"{mb:.2f}"),
                per_k(name, "time_over_multisteps", lambda x: f"{x:.2f}"),
                per_k(name, "time_over_shard_map", lambda x: f"{x:.2f}"),
                per_k(name, "inner_state_mb_per_device", lambda mb: f"{mb:.2f}"),
                per_k(name, "temp_mb", lambda mb: f"{mb:.2f}"),
            ]
            for name, label in GLOBAL_VIEW_NAMES.items()
        ],
    )


def _global_view_ratio(rows: Rows, name: str, field: str = "time_over_multisteps") -> str:
    runs = sorted((r for r in rows["global_view"] if r["candidate"] == name), key=lambda r: r["k"])
    return " / ".join(f"{r[field]:.2f}" for r in runs) + TIMES


POD_NAMES = {
    "pmap": "DP: `jax.pmap` + `axis_name`",
    "shard_map": "DP: `shard_map` + `axis_name`",
    "global_view": "DP: global view, unreduced over both axes",
    "fsdp_plain": "FSDP plain: `jax.grad` (reduce every micro-step)",
    "fsdp_unreduced": "FSDP + unreduced over both axes",
    "hsdp": 'HSDP: unreduced over `"data"`',
    "hsdp_zero1": "HSDP + ZeRO-1",
}
POD_K = 8
OPS = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG"}


def _pod(rows: Rows, route: str, k: int = POD_K) -> dict[str, Any]:
    return row(rows, "pod", k=k, route=route)


def _pod_ops(ops: dict[str, list[int]]) -> str:
    """{"all-gather@fsdp": [3, nbytes], ...} as "fsdp: 3 AG, 2 AR; data: 1 AR"."""
    by_axes: dict[str, list[str]] = {}
    for key, (count, _) in ops.items():
        op, _, axes = key.partition("@")
        by_axes.setdefault(axes, []).append(f"{count} {OPS.get(op, op)}")
    return "; ".join(f"{axes}: {', '.join(found)}" for axes, found in by_axes.items()) or "none"


def _pod_slow_count(r: dict[str, Any]) -> int:
    """Collectives whose groups span "data" in one window: K per micro-step op, one per close op."""
    return sum(
        count * (r["k"] if where == "every_step" else 1)
        for where in ("every_step", "once")
        for key, (count, _) in r[where].items()
        if "data" in key.partition("@")[2].split("+")
    )


def pod_table(rows: Rows) -> str:
    ks = sorted({r["k"] for r in rows["pod"]})
    return table(
        [
            "route",
            "every micro-step",
            "once, at the close",
            f'collectives over `"data"` per window (K={POD_K})',
            'MB over `"data"` per window',
            'MB a device sends across `"data"`',
            "accumulator / params / Adam MB per device",
            "temp MB",
            "time / FSDP plain, K = " + " / ".join(map(str, ks)),
        ],
        [
            [
                label,
                _pod_ops(r["every_step"]),
                _pod_ops(r["once"]),
                str(_pod_slow_count(r)),
                f"{r['slow_bytes_per_window'] / 1e6:.2f}",
                f"{r['slow_wire_bytes_per_device'] / 1e6:.2f}",
                " / ".join(
                    f"{r[f'{what}_bytes_per_device'] / 1e6:.2f}"
                    for what in ("acc", "params", "opt_state")
                ),
                f"{r['temp_bytes'] / 1e6:.1f}",
                " / ".join(f"{_pod(rows, route, k)['time_over_fsdp_plain']:.2f}" for k in ks),
            ]
            for route, label in POD_NAMES.items()
            for r in [_pod(rows, route)]
        ],
    )


# The 7B model on paper: gradients and Adam in float32. A pod is (d slow, f fast, bytes per
# second a device sends across the slow axis, memory per device). v5e: Google's published
# 6.4 Tb/s of data-centre network per 256-chip pod, shared by its chips; H100: one 400 Gb/s
# InfiniBand NIC per GPU (a DGX H100's eight ConnectX-7). Both bandwidths are assumptions.
POD_PARAMS = 7e9
PODS = {
    "v5e": (2, 256, 6.4e12 / 8 / 256, 16e9),
    "h100": (16, 8, 400e9 / 8, 80e9),
}


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.0f} MB" if nbytes < 1e9 else f"{nbytes / 1e9:.1f} GB"


def _scaled_split(measured: dict[str, Any], what: str, d: int, f: int) -> int:
    """How many ways a state is split on the pod: 1, f or d*f, as it was on the 2x4 mesh."""
    mesh = measured["mesh"]
    copies = 2 if what == "opt_state" else 1  # Adam holds two moments per param
    ways = copies * measured["param_bytes"] / measured[f"{what}_bytes_per_device"]
    options = {1: 1, mesh["fsdp"]: f, mesh["data"] * mesh["fsdp"]: d * f}
    return options[min(options, key=lambda n: abs(n - ways))]


def pod_7b_table(rows: Rows, pod: str) -> str:
    d, f, bandwidth, memory = PODS[pod]
    full = 4 * POD_PARAMS  # float32 bytes of the gradient
    lines = []
    for route, label in POD_NAMES.items():
        r = _pod(rows, route)
        sent = r["slow_shard_all_reduces"] * 2 * (d - 1) / d * full / f
        acc, params, adam = (
            full * (2 if what == "opt_state" else 1) / _scaled_split(r, what, d, f)
            for what in ("acc", "params", "opt_state")
        )
        total = acc + params + adam
        lines.append(
            [
                label,
                f"{r['slow_shard_all_reduces']:.2f}",
                _gb(sent),
                f"{1e3 * sent / bandwidth:.0f}",
                _gb(acc),
                _gb(total) + ("" if total < memory else " (does not fit)"),
            ]
        )
    return table(
        [
            "route",
            "all-reduces of a shard over the slow axis per window (measured)",
            "a device sends across the slow axis per window",
            "ms at the assumed bandwidth",
            "accumulator per device",
            "params + Adam + accumulator per device",
        ],
        lines,
    )


def _noise(rows: Rows, step: str) -> dict[str, Any]:
    return row(rows, "noise_scale", step=step)


TRANSFORMER = "transformer 42.0M params, 147 leaves"


def fused(rows: Rows, candidate: str) -> dict[str, Any]:
    return row(rows, "fused", model=TRANSFORMER, candidate=candidate)


def fused_table(rows: Rows) -> str:
    shown = [r for r in rows["fused"] if r["model"] == TRANSFORMER and "moved_MB" in r]
    return table(
        ["step", "time / `acc + g`", "temp MB", "moved MB"],
        [
            [r["candidate"], f"{r['x_floor']:.2f}", f"{r['temp_MB']:.1f}", f"{r['moved_MB']:.0f}"]
            for r in shown
        ],
    )


def coupled_step(rows: Rows, method: str, n: int, k: int) -> dict[str, Any]:
    return row(rows, "coupled", kind="step", method=method, N=n, K=k)


def coupled_table(rows: Rows) -> str:
    shown = [r for r in rows["coupled"] if r["kind"] == "step"]
    return table(
        ["N", "method", "K", "time / full", "temp / full", "temp MiB"],
        [
            [
                str(r["N"]),
                r["method"],
                str(r["K"]),
                times(r["time_vs_full"]) if r["timed"] else "not timed",
                f"{r['temp_vs_full']:.3f}",
                f"{r['temp_bytes'] / 2**20:.1f}",
            ]
            for r in shown
        ],
    )


def coupled_budget(rows: Rows) -> str:
    found = next(r for r in rows["coupled"] if r["kind"] == "headline")
    return f"{found['budget_bytes'] / 2**30:.0f} GiB"


def coupled_largest(rows: Rows, prefix: str) -> str:
    found = [
        r for r in rows["coupled"] if r["kind"] == "headline" and r["method"].startswith(prefix)
    ]
    return f"{found[0]['largest_n']:,}"


def _contrastive(rows: Rows, part: str | None) -> list[dict[str, Any]]:
    """The contrastive_losses rows of one part (None: the time and memory table's)."""
    return [r for r in rows["contrastive_losses"] if r.get("part") == part]


def contrastive_losses_table(rows: Rows) -> str:
    lines = []
    for r in _contrastive(rows, None):
        ran = isinstance(r["ms_dense"], (int, float))
        lines.append(
            [
                f"`{r['loss']}`",
                str(r["n"]),
                f"{r['ms_tiled']:.0f}",
                f"{r['ms_dense']:.0f}" if ran else "not run",
                f"{r['tiled_vs_dense']:.2f}" if ran else "",
                f"{mib(r['temp_tiled'])} ({100 * r['temp_tiled_vs_nn']:.1f} %)",
                f"{mib(r['temp_dense'])} ({r['temp_dense_vs_nn']:.1f}{TIMES})",
                sci(r["max_rel_err"]) if ran else "",
            ]
        )
    return table(
        [
            "loss",
            "N",
            "tiled ms",
            "dense ms",
            "tiled / dense",
            f"tiled temp MiB (of one N{TIMES}N)",
            f"dense temp MiB (N{TIMES}N)",
            "max rel. error",
        ],
        lines,
    )


def _error(x: float) -> str:
    return "0" if x == 0 else f"{x:.0e}"


def contrastive_precision_table(rows: Rows) -> str:
    found = rows["contrastive_precision"]
    scales = sorted({r["scale"] for r in found})
    lines = []
    for loss in LOSS_NAMES:
        for batch in dict.fromkeys(r["batch"] for r in found):
            by_scale = {r["scale"]: r for r in found if r["loss"] == loss and r["batch"] == batch}
            cells = [
                f"{_error(by_scale[x]['err_dense'])} / {_error(by_scale[x]['err_tiled'])}"
                for x in scales
            ]
            lines.append([f"`{loss}`", batch, *cells])
    return table(["loss", "batch", *[f"scale {x:g}: dense / tiled" for x in scales]], lines)


def contrastive_devices_table(rows: Rows) -> str:
    lines = [
        [
            f"`{r['loss']}`",
            f"{r['ms_one_device']:.0f}",
            f"{r['ms_8_devices_auto']:.0f} ({r['auto_vs_one']:.2f}{TIMES})",
            f"{r['ms_8_devices_explicit']:.0f} ({r['explicit_vs_one']:.2f}{TIMES})",
            r["loops_auto"],
            r["loops_explicit"],
        ]
        for r in _contrastive(rows, "devices")
    ]
    return table(
        [
            "loss",
            "one device ms",
            "8 devices, Auto: ms (vs one)",
            "8 devices, Explicit: ms (vs one)",
            "loops, Auto",
            "loops, Explicit",
        ],
        lines,
    )


COMPILE_ANCHORS = {
    "MultiSteps(adam, 4)": "adam",
    "accumulate(adam, 4)": "adam",
    "clip + accumulate(adamw, 4)": "adamw",
    "ga.clip_norm": "optax's clip",
}


def compile_time_table(rows: Rows) -> str:
    """Compile time per candidate and leaf count, with the ratio each target names."""
    lines = []
    for r in rows["compile_time"]:
        ratios = []
        anchor = COMPILE_ANCHORS.get(r["candidate"], "")
        for key, against in (("x_anchor", anchor), ("x_multisteps", "MultiSteps")):
            if key in r:
                target = r.get(key + "_target")
                goal = "" if target is None else f", target ≤ {target}"
                spread = f"{r[key + '_min']:.2f}{DASH}{r[key + '_max']:.2f}"
                ratios.append(f"{times(r[key])} {against} ({spread}{goal})")
        lines.append(
            [
                str(r["leaves"]),
                f"`{r['candidate']}`",
                f"{r['compile_s']:.2f}",
                "; ".join(ratios),
                f"{r['instr_per_leaf']:.1f}",
                f"{r['instr_per_added_leaf']:.1f}" if "instr_per_added_leaf" in r else "",
                f"{r['peak_MB']:.0f}" if "peak_MB" in r else "",
            ]
        )
    return table(
        [
            "leaves",
            "candidate",
            "compile s",
            "ratio (range over rounds)",
            "instructions / leaf",
            "per added leaf",
            "peak MB",
        ],
        lines,
    )


LOSS_NAMES = ("clip_loss", "info_nce", "siglip_loss")


def _losses_row(rows: Rows, loss: str = "clip_loss", n: int = 8192) -> dict[str, Any]:
    return row(rows, "contrastive_losses", loss=loss, n=n)


LOW_LOSS_BATCH = "low loss, N = 32, D = 16"


def _precision(rows: Rows, batch: str, scale: float, loss: str = "clip_loss") -> dict[str, Any]:
    """One cell of the precision table."""
    return row(rows, "contrastive_precision", loss=loss, batch=batch, scale=scale)


def statistics_ratios(rows: Rows, key: str) -> str:
    """The range over K of a ratio of the global-statistics step to the per-micro-batch one."""
    low, high = (
        f"{f(r[key] for r in rows['global_statistics'] if r['method'] == 'global'):.2f}"
        for f in (min, max)
    )
    return f"{low}{TIMES}" if low == high else f"{low}{DASH}{high}{TIMES}"


def statistics_error(rows: Rows, method: str) -> str:
    errors = [
        r["rel_err_vs_whole_batch"] for r in rows["global_statistics"] if r["method"] == method
    ]
    return f"{max(errors):.0e}"


def _privacy(rows: Rows, measure: str) -> dict[str, Any]:
    return row(rows, "privacy", measure=measure)


PRIVACY_MODELS = ("mlp", "cnn", "transformer", "lstm")


def _private(rows: Rows, model: str, candidate: str) -> dict[str, Any]:
    return row(rows, "privacy", measure="vs_non_private", model=model, candidate=candidate)


def _opacus(rows: Rows, model: str) -> str:
    """Opacus' ghost clipping / its non-private step, where the benchmark could run it."""
    found = [
        r
        for r in rows["privacy"]
        if r.get("measure") == "opacus_ghost" and r.get("model") == model and "ratio" in r
    ]
    return times(found[0]["ratio"]) if found else "not measured"


def privacy_table(rows: Rows) -> str:
    """Per model: the fast path's time and temp against the non-private gradient, beside
    the per-example path, jax_privacy and Opacus' ghost clipping, and the targets."""
    lines = []
    for model in PRIVACY_MODELS:
        fast = _private(rows, model, "fast")
        lines.append(
            [
                fast["description"],
                f"**{times(fast['ratio'])}** ({fast['ratio_q1']:.2f}{DASH}{fast['ratio_q3']:.2f})",
                f"**{times(fast['temp_ratio'])}** ({fast['temp_mib']:.1f} vs "
                f"{fast['temp_mib_reference']:.1f} MiB)",
                times(fast["flops_ratio"]),
                f"≤ {fast['target_ratio']}{TIMES}, "
                + (
                    "none set"
                    if fast["target_temp_ratio"] is None
                    else f"≤ {fast['target_temp_ratio']}{TIMES}"
                ),
                times(_private(rows, model, "per_example")["ratio"], 1),
                times(_private(rows, model, "jax_privacy")["ratio"], 1),
                _opacus(rows, model),
            ]
        )
    return table(
        [
            "model",
            "clipped_grad / non-private (quartiles)",
            "compiled temp",
            "flops (XLA's count)",
            "targets (time, temp)",
            'method="per_example"',
            "jax_privacy",
            'Opacus grad_sample_mode="ghost"',
        ],
        lines,
    )


def privacy_remat_table(rows: Rows) -> str:
    """The Gemma-like decoder under remat: the fast path's `remat=` modes against
    the non-private step under the same remat, and the share of remat's saving kept."""
    lines = []
    for r in rows["privacy"]:
        if r.get("measure") != "remat":
            continue
        lines.append(
            [
                r["description"],
                f'`remat="{r["candidate"]}"`',
                f"**{times(r['ratio'])}** ({r['ratio_q1']:.2f}{DASH}{r['ratio_q3']:.2f})",
                f"**{times(r['temp_ratio'])}** ({r['temp_mib']:.1f} vs "
                f"{r['temp_mib_reference']:.1f} MiB)",
                f"{100 * r['saving_kept']:.0f} %",
                f"≤ {r['target_ratio']}{TIMES}, ≤ {r['target_temp_ratio']}{TIMES}",
            ]
        )
    return table(
        [
            "model",
            "mode",
            "clipped_grad / non-private (quartiles)",
            "compiled temp",
            "remat's saving kept",
            "targets (time, temp)",
        ],
        lines,
    )


FIGURES: dict[str, Callable[[Rows], str]] = {
    # global_statistics benchmark: statistics_fn (MoE balancing over the whole batch)
    "global_statistics.time": lambda r: statistics_ratios(r, "time_vs_per_micro"),
    "global_statistics.temp": lambda r: statistics_ratios(r, "temp_vs_per_micro"),
    "global_statistics.flops": lambda r: statistics_ratios(r, "flops_vs_per_micro"),
    "global_statistics.err_global": lambda r: statistics_error(r, "global"),
    "global_statistics.err_per_micro": lambda r: statistics_error(r, "per micro-batch"),
    "table.compile_time": compile_time_table,
    # privacy benchmark: clipped sums against the non-private gradient, the DP step
    "table.privacy": privacy_table,
    "table.privacy_remat": privacy_remat_table,
    **{
        f"privacy.fast.{m}": (lambda r, m=m: times(_private(r, m, "fast")["ratio"]))
        for m in PRIVACY_MODELS
    },
    **{
        f"privacy.per_example.{m}": (
            lambda r, m=m: times(_private(r, m, "per_example")["ratio"], 0)
        )
        for m in PRIVACY_MODELS
    },
    "privacy.half_padding": lambda r: times(_privacy(r, "clipped_sum_half_padding")["ratio"]),
    "privacy.dp_vs_plain": lambda r: times(_privacy(r, "dp_step")["ratio"]),
    "privacy.example_fast": lambda r: f"{_privacy(r, 'dp_digits_example')['ms']:.1f} ms",
    # examples/dp_lm.py, measured by the privacy benchmark
    "privacy.lm.chunk": lambda r: str(_privacy(r, "dp_lm_example")["microbatch_size"]),
    "privacy.lm.peaks": lambda r: ", ".join(
        f"{mib:.1f} MiB for chunks of {size}"
        for size, mib in _privacy(r, "dp_lm_example")["peaks_mib"].items()
    ),
    "privacy.lm.epsilon": lambda r: f"{_privacy(r, 'dp_lm_example')['epsilon']:.1f}",
    "privacy.lm.time": lambda r: times(_privacy(r, "dp_lm_example")["ratio"]),
    "privacy.lm.temp": lambda r: times(_privacy(r, "dp_lm_example")["temp_ratio"]),
    "privacy.example_per_example": (
        lambda r: f"{_privacy(r, 'dp_digits_example')['ms_reference']:.1f} ms"
    ),
    # coupled benchmark: exact micro-batching of a contrastive loss
    "coupled.time": lambda r: times(coupled_step(r, "coupled", 1024, 8)["time_vs_full"]),
    "coupled.temp": lambda r: f"{coupled_step(r, 'coupled', 1024, 8)['temp_vs_full']:.2f}",
    "coupled.largest_dense": lambda r: coupled_largest(r, "full"),
    "coupled.largest_tiled": lambda r: coupled_largest(r, "coupled+tiled"),
    "coupled.budget": lambda r: coupled_budget(r),
    "table.coupled": coupled_table,
    # fused benchmark, transformer-shaped tree with Adam
    "fused.model": lambda r: fused(r, "acc + g")["model"],
    "fused.micro.x_floor": lambda r: times(fused(r, "fused micro-step")["x_floor"], 1),
    "fused.optax.x_floor": lambda r: times(
        fused(r, "optax path micro-step (update + apply_updates)")["x_floor"], 1
    ),
    "table.fused": fused_table,
    # accumulate benchmark, 33.6M-parameter MLP with Adam
    "micro.temp": lambda r: megabytes(micro(r, ACC)["temp_MB"]),
    "micro.state_copies": lambda r: str(micro(r, ACC)["state_copies"]),
    "micro.x_floor": lambda r: times(micro(r, ACC)["x_floor"], 1),
    "multisteps.temp": lambda r: megabytes(micro(r, MULTISTEPS)["temp_MB"]),
    "multisteps.state_copies": lambda r: str(micro(r, MULTISTEPS)["state_copies"]),
    "multisteps.x_floor": lambda r: times(micro(r, MULTISTEPS)["x_floor"], 1),
    "apply_every.x_floor": lambda r: times(micro(r, APPLY_EVERY)["x_floor"], 1),
    "zeros.x_floor": lambda r: times(micro(r, ZEROS)["x_floor"], 1),
    "micro.x_zeros": lambda r: with_quartiles(micro(r, AGAINST_ZEROS)),
    "micro_no_check.x_zeros": lambda r: with_quartiles(micro(r, AGAINST_ZEROS_NO_CHECK)),
    "micro.speedup_multisteps": lambda r: times(
        micro(r, MULTISTEPS)["ms"] / micro(r, ACC)["ms"], 1
    ),
    "micro.speedup_apply_every": lambda r: times(
        micro(r, APPLY_EVERY)["ms"] / micro(r, ACC)["ms"], 1
    ),
    "boundary.x_adam_floor": lambda r: times(
        micro(r, "ratio: boundary step / (adam alone + floor)")["x_floor"]
    ),
    "leaves.x_multisteps": lambda r: times(
        micro(r, ACC, MANY_LEAVES)["ms"] / micro(r, MULTISTEPS, MANY_LEAVES)["ms"]
    ),
    "leaves.x_zeros": lambda r: times(micro(r, AGAINST_ZEROS, MANY_LEAVES)["x_floor"], 1),
    # whole train steps at effective batch 256, against a hand-written scan
    "step.calls.x_scan": lambda r: times(
        row(r, "accumulate", model=TRAIN_STEP, candidate="4 x 64: accumulate(adam)")["x_scan"], 1
    ),
    "step.calls_multisteps.x_scan": lambda r: times(
        row(r, "accumulate", model=TRAIN_STEP, candidate="4 x 64: optax.MultiSteps(adam)")[
            "x_scan"
        ],
        1,
    ),
    "step.scan.x_scan": lambda r: times(
        row(
            r,
            "accumulate",
            model=TRAIN_STEP,
            candidate="4 x 64 in one call (scan): accumulate(adam)",
        )["x_scan"],
        1,
    ),
    "step.scan_multisteps.x_scan": lambda r: times(
        row(
            r,
            "accumulate",
            model=TRAIN_STEP,
            candidate="4 x 64 in one call (scan): optax.MultiSteps(adam)",
        )["x_scan"],
        1,
    ),
    # microbatch benchmark, K = 8
    "microbatch8.temp_vs_full": lambda r: times(_microbatch(r, 8)["temp_vs_full"]),
    "microbatch8.time_vs_optax": lambda r: times(_microbatch(r, 8)["time_vs_optax_microbatch"]),
    # distributed benchmark, 8 host devices
    "distributed4.time_ratio": lambda r: times(_distributed(r, 4)["time_ratio_ours_over_usual"]),
    "distributed16.time_ratio": lambda r: times(_distributed(r, 16)["time_ratio_ours_over_usual"]),
    "distributed.window_mb": lambda r: megabytes(_distributed(r, 4)["mb_reduced_per_window"]),
    "distributed4.usual_mb": lambda r: megabytes(
        row(r, "distributed", k=4, candidate="usual")["mb_reduced_per_window"]
    ),
    "distributed16.usual_mb": lambda r: megabytes(
        row(r, "distributed", k=16, candidate="usual")["mb_reduced_per_window"]
    ),
    # whole tables and ranges, one page each
    "table.microbatch": microbatch_table,
    "microbatch8.temp_mib": lambda r: f"{mib(_microbatch(r, 8)['temp_bytes'])} MiB",
    "microbatch.full_temp_mib": lambda r: (
        f"{mib(row(r, 'microbatch', method='full')['temp_bytes'])} MiB"
    ),
    "microbatch.time_vs_optax_range": _microbatch_speed_range,
    "microbatch.max_rel_err": lambda r: sci(max(x["rel_err"] for x in r["microbatch"])),
    "table.mixed_precision.accuracy": mixed_accuracy_table,
    "table.mixed_precision.memory": mixed_memory_table,
    "mixed.float32_max_error": lambda r: sci(
        max(x["rel_l2_error"] for x in _accuracy(r, "float32 (default)"))
    ),
    "mixed.bfloat16_error_range": lambda r: _percent_range(
        [x["rel_l2_error"] for x in _accuracy(r, "bfloat16")]
    ),
    "mixed.kahan_gain": _bf16_gain,
    "table.global_view": global_view_table,
    "table.pod": pod_table,
    "table.pod_7b.v5e": lambda r: pod_7b_table(r, "v5e"),
    "table.pod_7b.h100": lambda r: pod_7b_table(r, "h100"),
    "pod.params": lambda r: (
        f"{_pod(r, 'hsdp')['param_bytes'] / 4e6:.2f}M float32 parameters "
        f"({_pod(r, 'hsdp')['param_bytes'] / 1e6:.1f} MB)"
    ),
    "pod.plain_step_mb": lambda r: (
        f"{_pod(r, 'fsdp_plain')['every_step']['all-reduce@data+fsdp'][1] / 1e6:.1f} MB"
    ),
    "pod.hsdp_vs_plain": lambda r: times(_pod(r, "hsdp")["time_over_fsdp_plain"]),
    "pod.zero1_vs_plain": lambda r: times(_pod(r, "hsdp_zero1")["time_over_fsdp_plain"]),
    "pod.unreduced_vs_plain": lambda r: times(_pod(r, "fsdp_unreduced")["time_over_fsdp_plain"]),
    "noise.micro_on_vs_off": lambda r: times(_noise(r, "micro-step")["on_vs_off"]),
    "noise.close_on_vs_off": lambda r: times(_noise(r, "window close")["on_vs_off"]),
    "noise.temp_growth": lambda r: megabytes(
        (_noise(r, "micro-step")["temp_bytes_on"] - _noise(r, "micro-step")["temp_bytes_off"]) / 1e6
    ),
    "microbatch.time_vs_full_by_k": lambda r: " / ".join(
        f"{x['time_vs_full']:.2f}" for x in r["microbatch"] if x["method"] == "ours"
    ),
    "step.large.x_scan": lambda r: times(
        row(r, "accumulate", model=TRAIN_STEP, candidate="1 x 256 large batch")["x_scan"]
    ),
    "global_view.unreduced_vs_multisteps": lambda r: _global_view_ratio(r, "unreduced"),
    "global_view.zero1_vs_multisteps": lambda r: _global_view_ratio(r, "zero1"),
    "global_view.unreduced_vs_shard_map": lambda r: _global_view_ratio(
        r, "unreduced", "time_over_shard_map"
    ),
    "global_view.zero1_vs_shard_map": lambda r: _global_view_ratio(
        r, "zero1", "time_over_shard_map"
    ),
    "table.contrastive_losses": contrastive_losses_table,
    "table.contrastive_precision": contrastive_precision_table,
    "losses.easy_30.truth_norm": lambda r: sci(_precision(r, "easy", 30.0)["truth_norm"]),
    "losses.easy_30.err_tiled": lambda r: _error(_precision(r, "easy", 30.0)["err_tiled"]),
    "losses.easy_30.err_dense": lambda r: _error(_precision(r, "easy", 30.0)["err_dense"]),
    "losses.low_loss_100.truth_norm": lambda r: sci(
        _precision(r, LOW_LOSS_BATCH, 100.0)["truth_norm"]
    ),
    "losses.low_loss_100.err_p_minus_1": lambda r: (
        f"{_precision(r, LOW_LOSS_BATCH, 100.0)['err_float64_p_minus_1']:.1f}"
    ),
    "losses.low_loss_100.err_tiled": lambda r: _error(
        _precision(r, LOW_LOSS_BATCH, 100.0)["err_tiled"]
    ),
    "losses.low_loss_100.err_dense": lambda r: _error(
        _precision(r, LOW_LOSS_BATCH, 100.0)["err_dense"]
    ),
    "table.contrastive_devices": contrastive_devices_table,
    "losses.clip_8192.tiled_vs_dense": lambda r: times(_losses_row(r)["tiled_vs_dense"]),
    "losses.clip_8192.temp_pct": lambda r: f"{100 * _losses_row(r)['temp_tiled_vs_nn']:.1f} %",
    "losses.clip_8192.dense_temp_vs_nn": lambda r: times(_losses_row(r)["temp_dense_vs_nn"], 1),
    "losses.worst_tiled_vs_dense_8192": lambda r: times(
        max(_losses_row(r, loss)["tiled_vs_dense"] for loss in LOSS_NAMES)
    ),
    "losses.worst_temp_pct_8192": lambda r: (
        f"{100 * max(_losses_row(r, loss)['temp_tiled_vs_nn'] for loss in LOSS_NAMES):.1f} %"
    ),
}


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def load_rows(path: pathlib.Path = ROWS) -> Rows:
    return json.loads(path.read_text(encoding="utf-8"))


def render(text: str, rows: Rows) -> tuple[str, list[tuple[str, str, str]]]:
    """Returns `text` with every marked figure recomputed, and the (name, old, new) changes."""
    changes: list[tuple[str, str, str]] = []

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in FIGURES:
            raise KeyError(f"unknown figure {name!r}; known: {sorted(FIGURES)}")
        value = FIGURES[name](rows)
        if value != match["value"]:
            changes.append((name, match["value"], value))
        return f"<!-- fig:{name} -->{value}<!-- /fig -->"

    return SPAN.sub(replace, text), changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if needed")
    parser.add_argument("--rows", type=pathlib.Path, default=ROWS)
    args = parser.parse_args(argv)
    rows = load_rows(args.rows)
    stale = False
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new, changes = render(text, rows)
        for name, old, value in changes:
            print(f"{page.relative_to(ROOT)}: {name}: {old!r} -> {value!r}")
        if changes:
            stale = True
            if not args.check:
                page.write_text(new, encoding="utf-8")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
