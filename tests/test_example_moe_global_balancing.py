"""The MoE global-balancing example runs at its reduced size and shows what it claims."""

import numpy as np
import pytest
from _examples import load_example

pytestmark = pytest.mark.slow  # trains two models end to end (about 15 s)


def test_quick_run(capsys):
    runs = load_example("moe_global_balancing").main(["--quick"])
    printed = capsys.readouterr().out
    assert "expert load per domain" in printed and "specialisation" in printed
    local, whole = runs["per micro-batch"], runs["global batch"]
    # The global run is the large batch's objective: its gradients are jax.value_and_grad's.
    assert max(whole["gaps"]) < 1e-5
    # Per micro-batch, each domain (one per micro-batch) spreads over the experts; over
    # the global batch the experts specialise by domain, and the total load stays even.
    assert whole["specialisation"] > 0.9 > 0.6 > local["specialisation"]
    np.testing.assert_allclose(whole["load"].mean(axis=0), 1 / 8, atol=0.03)
    assert whole["mse"] < local["mse"]
