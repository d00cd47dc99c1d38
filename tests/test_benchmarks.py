"""The benchmarks: each runs at quick sizes, and the runner writes the report and the plot."""

import importlib.util
import json
import os
import pathlib

import pytest

pytestmark = pytest.mark.slow  # each runs a benchmark in its own process


ROOT = pathlib.Path(__file__).resolve().parents[1]


def _runner():
    spec = importlib.util.spec_from_file_location("benchmarks_run", ROOT / "benchmarks" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    return run


RUN = _runner()


# One test per benchmark (they were one test running all sixteen in a row: 160 s on one
# worker on a fast day, past its 600 s limit on a slow one); each runs in its own process,
# as `run.py` runs it, at quick sizes.
@pytest.mark.requires(
    "optax.microbatching (0.2.7), jax.lax.pcast (0.8.2)", optax="0.2.7", jax="0.8.2"
)
@pytest.mark.parametrize(
    "name",
    # The two whose compiled-program facts are checked below read compiled programs.
    [
        pytest.param(n, marks=pytest.mark.hlo) if n in ("accumulate", "pod") else n
        for n in RUN.BENCHMARKS
    ],
)
def test_benchmark_runs_at_quick_sizes(name, monkeypatch):
    if name in ("accumulate", "pod"):
        # Their compiled-program facts are checked below: the benchmark's process compiles
        # with XLA's defaults, as `dev.sh bench` does, not with the suite's faster settings
        # (conftest.py), which it would inherit.
        monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS", raising=False)
        flags = os.environ.get("XLA_FLAGS", "").replace("--xla_cpu_use_fusion_emitters=false", "")
        monkeypatch.setenv("XLA_FLAGS", flags)
    rows, printed, _ = RUN.run_one(name, quick=True)
    assert rows, printed[-3000:]
    if name == "accumulate":
        # The compiled-program facts hold even at quick sizes (timings do not).
        micro = {r["candidate"]: r for r in rows if "state_copies" in r}
        assert micro["accumulate(adam) micro-step"]["state_copies"] == 0
        assert micro["optax.MultiSteps(adam) micro-step"]["state_copies"] > 0
    if name == "pod":
        # HSDP: per micro-step only collectives inside "fsdp" groups, one over "data" per
        # window; jax.grad with FSDP params reduces across "data" on each of the K micro-steps.
        pod = {r["route"]: r for r in rows}
        assert all(key.endswith("@fsdp") for key in pod["hsdp"]["every_step"]), pod["hsdp"]
        assert list(pod["hsdp"]["once"]) == ["all-reduce@data"], pod["hsdp"]
        plain = pod["fsdp_plain"]
        assert plain["slow_shard_all_reduces"] == pytest.approx(plain["k"], rel=0.05), plain


def test_the_runner_writes_the_report_and_the_plot(tmp_path, monkeypatch):
    # The runner around the benchmarks, on the rows of the last full run (the benchmarks
    # themselves run above): every section, the machine named, the headline plot drawn.
    recorded = json.loads((ROOT / "benchmarks" / "results" / "rows.json").read_text())
    for name in RUN.BENCHMARKS:  # one not measured at full size yet gets a row of its own
        recorded.setdefault(name, [{"benchmark": name}])
    monkeypatch.setattr(
        RUN, "run_one", lambda name, quick: (recorded[name], f"{name} printed", 1.0)
    )
    assert RUN.main(["--quick", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report_quick.md").read_text()
    rows = json.loads((tmp_path / "rows_quick.json").read_text())
    for name in RUN.BENCHMARKS:
        assert f"## {name} (" in report and f"{name} printed" in report
        assert rows[name] == recorded[name], name
    assert "Measured" in report and "cores" in report  # the machine is named
    assert (tmp_path / "ratios_quick.png").stat().st_size > 10_000


def test_only_keeps_the_other_benchmarks_results(tmp_path, monkeypatch):
    # `run.py --only NAME` re-measures NAME and keeps the rows and report sections of the
    # others; the benchmark itself is replaced by a stub here (the run above is real).
    run = _runner()

    earlier = {"accumulate": [{"a": 1}], "clipping": [{"c": 1}]}
    (tmp_path / "rows.json").write_text(json.dumps(earlier))
    (tmp_path / "report.md").write_text(
        "# Benchmark report\n\nold header\n\n## accumulate (9 s, measured then)\n\nA\n\n"
        "## clipping (1 s, measured then)\n\nC\n"
    )
    monkeypatch.setattr(run, "run_one", lambda name, quick: ([{"new": name}], "NEW", 2.0))
    monkeypatch.setattr(run, "plot", lambda results, path: False)
    assert run.main(["--only", "clipping", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows == {"accumulate": [{"a": 1}], "clipping": [{"new": "clipping"}]}
    report = (tmp_path / "report.md").read_text()
    assert "## accumulate (9 s, measured then)\n\nA" in report
    assert "## clipping (2 s, measured " in report and "NEW" in report and "\nC\n" not in report
    assert report.index("## accumulate") < report.index("## clipping")
