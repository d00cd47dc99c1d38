"""The DP-SGD digits example runs at its reduced size and shows what it claims."""

import numpy as np
import pytest
from _examples import load_example

from gradaccum_jax import privacy

# Runs an example end to end, and checks facts of the programs it compiles.
pytestmark = [pytest.mark.slow, pytest.mark.hlo]


def test_quick_run(capsys):
    # The default is the fast path (clipped_grad's own default).
    out = load_example("dp_digits").main(["--quick"])
    printed = capsys.readouterr().out
    assert "epsilon = " in printed and "PLD accountant" in printed
    # Poisson logical batches: their sizes vary around B = 256.
    assert min(out["sizes"]) < 256 < max(out["sizes"])
    # epsilon counts logical batches (windows), one per Poisson batch, not micro-steps.
    assert out["windows"] == len(out["sizes"]) == 6 * round(1 / out["q"])
    want = privacy.epsilon(2.5, out["q"], out["windows"], 1e-5, sampling="poisson")
    assert out["epsilon"] == want
    # The per-example path holds one gradient per example: micro-batches bound it. The fast
    # path holds activations and output gradients: less at B than the per-example path at m.
    temp = out["temp_bytes"]
    assert temp["per_example", 256] > 4 * temp["per_example", 32]
    assert temp["fast", 256] < temp["per_example", 32]
    assert out["seconds_per_epoch"] > 0
    assert out["history"][-1] > 0.5, "the private run learned something"
    assert out["plain_history"][-1] > 0.8
    assert np.all(np.isfinite(out["history"]))
