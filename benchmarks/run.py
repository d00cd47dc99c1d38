"""Runs every benchmark of the project and writes the report under benchmarks/results/.

Each benchmark runs in its own process (the distributed one must set XLA_FLAGS
before jax is imported) and prints its own side-by-side tables; this script
collects the rows each one returns, writes them as one markdown report with
the machine they were measured on, and plots the headline ratios.

    python benchmarks/run.py            # full sizes (tens of minutes on 2 CPU cores)
    python benchmarks/run.py --quick    # tiny sizes: checks that everything runs
    python benchmarks/run.py --only global_view   # re-measure one, keep the others' results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
BENCHMARKS = [
    "accumulate",
    "microbatch",
    "distributed",
    "global_view",
    "pod",
    "mixed_precision",
    "clipping",
    "noise_scale",
    "privacy",
    "fused",
    "coupled",
    "contrastive_losses",
    "contrastive_precision",
    "compile_time",
    "global_statistics",
    "pipeline",
]
MARKER = "@@ROWS@@"
CHILD = (
    "import json, sys; sys.path.insert(0, {here!r}); import {name} as b; "
    "rows = b.main({argv!r}); print({marker!r} + json.dumps(rows, default=str))"
)


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import jax
        import optax

        versions = f"jax {jax.__version__}, optax {optax.__version__}"
    except ImportError:
        versions = "jax not importable"
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {versions}"


def run_one(name: str, quick: bool) -> tuple[list[dict], str, float]:
    argv = ["--quick"] if quick else []
    code = CHILD.format(here=str(HERE), name=name, argv=argv, marker=MARKER)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark {name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    printed, rows = [], []
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            rows = json.loads(line[len(MARKER) :])
        else:
            printed.append(line)
    return rows, "\n".join(printed), seconds


def _pick(rows, **match):
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def headline_panels(results: dict[str, list[dict]]) -> list[tuple[str, list[tuple[str, float]]]]:
    """The few ratios each benchmark exists to show, as (title, [(label, value)])."""
    panels = []
    acc = results.get("accumulate", [])
    if acc:
        big = acc[0]["model"]
        bars = [
            (r["candidate"], r["x_floor"])
            for r in acc
            if r["model"] == big and "x_floor" in r and not r["candidate"].startswith("ratio")
        ]
        panels.append((f"accumulate, {big}: time / floor (donated add)", bars))
        train = [r for r in acc if "x_scan" in r]
        if train:
            model = train[0]["model"]
            bars = [(r["candidate"], r["x_scan"]) for r in train if r["model"] == model]
            panels.append((f"whole train step, {model}: time / scan in one step", bars))
    micro = results.get("microbatch", [])
    if micro:
        bars = [
            (f"{r['method']} K={r['K']}", r["temp_vs_full"])
            for r in micro
            if r["method"] != "optax.micro_grad"
        ]
        panels.append(("microbatch: compiled temp bytes / full batch", bars))
    dist = results.get("distributed", [])
    if dist:
        bars = [
            (
                f"K={r['k']}: {r['candidate']}",
                r["ms_per_window"] / _pick(dist, k=r["k"], candidate="usual")[0]["ms_per_window"],
            )
            for r in dist
        ]
        panels.append(("distributed, 8 host devices: time per window / usual pattern", bars))
    view = results.get("global_view", [])
    if view:
        bars = [(f"K={r['k']}: {r['candidate']}", r["time_over_multisteps"]) for r in view]
        panels.append(("global-view jit, 8 host devices: time per window / MultiSteps", bars))
    mixed = [r for r in results.get("mixed_precision", []) if r.get("regime") == "trained"]
    if mixed:
        bars = [(f"{r['accumulator']} K={r['K']}", r["rel_l2_error"]) for r in mixed]
        panels.append(("mixed precision: relative L2 error vs float64 (log)", bars))
    return panels


def plot(results: dict[str, list[dict]], path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = headline_panels(results)
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels)), squeeze=False)
    for ax, (title, bars) in zip(axes[:, 0], panels, strict=True):
        labels, values = zip(*bars, strict=True)
        ax.barh(range(len(bars)), values, color="tab:blue")
        ax.set_yticks(range(len(bars)), labels, fontsize=7)
        ax.invert_yaxis()
        if "log" in title:
            ax.set_xscale("log")
        else:
            ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


SECTION = re.compile(rf"^## ({'|'.join(BENCHMARKS)}) \(", re.M)


def report_sections(text: str) -> dict[str, str]:
    """The per-benchmark sections of a report, by benchmark name (the header dropped)."""
    starts = [(m.start(), m[1]) for m in SECTION.finditer(text)]
    ends = [start for start, _ in starts[1:]] + [len(text)]
    return {
        name: text[start:end].rstrip() + "\n"
        for (start, name), end in zip(starts, ends, strict=True)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    parser.add_argument("--only", nargs="*", default=None, choices=BENCHMARKS)
    parser.add_argument("--out", default=str(HERE / "results"), help="output folder")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or BENCHMARKS
    machine = machine_description()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    suffix = "_quick" if args.quick else ""
    report = out / f"report{suffix}.md"
    rows_file = out / f"rows{suffix}.json"
    # With --only, the other benchmarks' rows and sections of an earlier run stay.
    results: dict[str, list[dict]] = {}
    sections: dict[str, str] = {}
    if args.only and rows_file.exists() and report.exists():
        results = json.loads(rows_file.read_text())
        sections = report_sections(report.read_text())
    for name in names:
        print(f"running benchmarks/{name}.py{' --quick' if args.quick else ''} ...", flush=True)
        rows, printed, seconds = run_one(name, args.quick)
        results[name] = rows
        sections[name] = (
            f"## {name} ({seconds:.0f} s, measured {stamp})\n\n```text\n{printed.strip()}\n```\n"
        )
        print(printed, flush=True)
    order = [name for name in BENCHMARKS if name in results]
    results = {name: results[name] for name in order}
    header = (
        f"# Benchmark report\n\nMeasured on {machine}.\n"
        f"Command: `python benchmarks/run.py{' --quick' if args.quick else ''}` "
        "(`--only NAME` re-measures one benchmark and keeps the others). Every table is "
        "measured side by side in one process; read the ratios.\n\n"
    )
    report.write_text(header + "\n".join(sections[name] for name in order if name in sections))
    rows_file.write_text(json.dumps(results, indent=1, default=str))
    plotted = plot(results, out / f"ratios{suffix}.png")
    print(f"wrote {report}" + (f" and {out / f'ratios{suffix}.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
