"""Runs examples/pmap_pod.py at its reduced size."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs an example end to end


def _load(name):
    path = Path(__file__).parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pmap_pod_matches_large_batch_and_reduces_at_window_ends(capsys):
    result = _load("pmap_pod").main(["--quick", "--k", "3"])
    out = capsys.readouterr().out
    assert result["max_diff"] < 1e-5
    assert result["all_reduce_ops"] >= 1
    assert f"optimizer steps: {result['steps']}, micro-gradients skipped: 0" in out
    assert "largest parameter difference to one-device large-batch training" in out
