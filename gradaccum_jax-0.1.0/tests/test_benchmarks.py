"""The benchmark runner: every benchmark runs at quick sizes and the report is written."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # runs the benchmark runner end to end


ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.requires(
    "optax.microbatching (0.2.7), jax.lax.pcast (0.8.2)", optax="0.2.7", jax="0.8.2"
)
def test_run_all_benchmarks_quick(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "report_quick.md").read_text()
    rows = json.loads((tmp_path / "rows_quick.json").read_text())
    for name in ("accumulate", "microbatch", "distributed", "mixed_precision", "pod"):
        assert f"## {name} (" in report
        assert rows[name], name
    assert "Measured" in report and "cores" in report  # the machine is named
    assert (tmp_path / "ratios_quick.png").stat().st_size > 10_000
    # The compiled-program facts hold even at quick sizes (timings do not).
    micro = {r["candidate"]: r for r in rows["accumulate"] if "state_copies" in r}
    assert micro["accumulate(adam) micro-step"]["state_copies"] == 0
    assert micro["optax.MultiSteps(adam) micro-step"]["state_copies"] > 0
    # HSDP: per micro-step only collectives inside "fsdp" groups, one over "data" per window;
    # jax.grad with FSDP params reduces across "data" on each of the K micro-steps.
    pod = {r["route"]: r for r in rows["pod"]}
    assert all(key.endswith("@fsdp") for key in pod["hsdp"]["every_step"]), pod["hsdp"]
    assert list(pod["hsdp"]["once"]) == ["all-reduce@data"], pod["hsdp"]
    plain = pod["fsdp_plain"]
    assert plain["slow_shard_all_reduces"] == pytest.approx(plain["k"], rel=0.05), plain


def test_only_keeps_the_other_benchmarks_results(tmp_path, monkeypatch):
    # `run.py --only NAME` re-measures NAME and keeps the rows and report sections of the
    # others; the benchmark itself is replaced by a stub here (the run above is real).
    spec = importlib.util.spec_from_file_location("benchmarks_run", ROOT / "benchmarks" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)

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
