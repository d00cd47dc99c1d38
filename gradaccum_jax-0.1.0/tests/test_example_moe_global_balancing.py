"""The MoE global-balancing example runs at its reduced size and shows what it claims."""

import importlib.util
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # trains two models end to end (about 15 s)

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "moe_global_balancing.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("moe_global_balancing", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run(capsys):
    runs = _load_example().main(["--quick"])
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
