"""Runs examples/pmap_pod.py at its reduced size."""

import pytest
from _examples import load_example

# Runs an example end to end, and checks facts of the programs it compiles.
pytestmark = [pytest.mark.slow, pytest.mark.hlo]


def test_pmap_pod_matches_large_batch_and_reduces_at_window_ends(capsys):
    result = load_example("pmap_pod").main(["--quick", "--k", "3"])
    out = capsys.readouterr().out
    assert result["max_diff"] < 1e-5
    assert result["all_reduce_ops"] >= 1
    assert f"optimizer steps: {result['steps']}, micro-gradients skipped: 0" in out
    assert "largest parameter difference to one-device large-batch training" in out
