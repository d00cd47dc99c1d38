"""Runs examples/delayed_gradients.py at its reduced size and checks what it reports."""

import pytest
from _examples import load_example

pytestmark = pytest.mark.slow  # runs an example end to end


def test_delayed_gradients_quick(capsys):
    results = load_example("delayed_gradients").main(["--quick"])
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
