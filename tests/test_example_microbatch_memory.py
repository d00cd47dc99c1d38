"""Runs examples/microbatch_memory.py at its reduced size."""

import numpy as np
import pytest
from _examples import load_example

# Runs an example end to end, and checks facts of the programs it compiles.
pytestmark = [pytest.mark.slow, pytest.mark.hlo]


def test_example_microbatch_memory(capsys):
    result = load_example("microbatch_memory").main(["--small", "--steps", "3"])
    printed = capsys.readouterr().out
    assert "K=1: compiled temp bytes" in printed and "K=8: compiled temp bytes" in printed
    temp = result["temp_bytes"]
    # Activations dominate: eight micro-batches need at most ~1/8 of the temp
    # memory, plus a little for the gradient accumulator.
    assert temp["K=8"] < 0.2 * temp["K=1"], temp
    np.testing.assert_allclose(result["losses_micro"], result["losses_full"], rtol=1e-5)
    assert result["max_param_diff"] < 1e-5
