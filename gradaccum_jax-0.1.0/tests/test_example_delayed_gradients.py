"""Runs examples/delayed_gradients.py at its reduced size and checks what it reports."""

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.slow  # runs an example end to end


EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "delayed_gradients.py"


def test_delayed_gradients_quick(capsys):
    spec = importlib.util.spec_from_file_location("delayed_gradients", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--quick"])
    out = capsys.readouterr().out
    assert "dropped as stale" in out
    # Delays produce stale gradients; a staleness allowance keeps more of them.
    assert results["dropped_strict"] > results["dropped_lenient"] > 0
    assert results["delivered_strict"] == results["delivered_lenient"] > 0
    # Nothing is stale in the synchronous run, which matches accumulate exactly
    # and the large batch to float32 rounding.
    assert results["dropped_sync"] == 0
    assert results["steps_sync"] == 8
    assert results["sync_vs_accumulate"] == 0.0
    assert results["sync_vs_large_batch"] < 1e-5
