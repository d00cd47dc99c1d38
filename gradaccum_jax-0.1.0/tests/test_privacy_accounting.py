"""Tests for privacy accounting (gradaccum_jax._privacy.accounting): `privacy.epsilon`."""

import math
import subprocess
import sys

import dp_accounting
import pytest

from gradaccum_jax import privacy

SIGMA, Q, WINDOWS, DELTA, K = 1.1, 0.01, 1000, 1e-5, 4


def dp_accounting_epsilon(event, count, accountant):
    tracker = (
        dp_accounting.pld.PLDAccountant()
        if accountant == "pld"
        else dp_accounting.rdp.RdpAccountant()
    )
    tracker.compose(event, count)
    return tracker.get_epsilon(DELTA)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_poisson_equals_dp_accounting(accountant):
    event = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA))
    want = dp_accounting_epsilon(event, WINDOWS, accountant)
    got = privacy.epsilon(SIGMA, Q, WINDOWS, DELTA, sampling="poisson", accountant=accountant)
    assert got == want


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_fixed_size_doubles_the_sensitivity(accountant):
    # Replace-one neighbours: sensitivity 2C, i.e. Poisson with half the noise multiplier.
    event = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA / 2))
    want = dp_accounting_epsilon(event, WINDOWS, accountant)
    got = privacy.epsilon(SIGMA, Q, WINDOWS, DELTA, sampling="fixed_size", accountant=accountant)
    assert got == want
    assert got > privacy.epsilon(
        SIGMA, Q, WINDOWS, DELTA, sampling="poisson", accountant=accountant
    )


def test_steps_count_windows_not_micro_steps():
    # SPEC section 13's anchors (RDP): 1000 windows of K = 4 micro-steps spend 1.71;
    # counting the 4000 micro-steps as steps would claim 3.41.
    per_window = privacy.epsilon(SIGMA, Q, WINDOWS, DELTA, sampling="poisson", accountant="rdp")
    per_micro = privacy.epsilon(SIGMA, Q, K * WINDOWS, DELTA, sampling="poisson", accountant="rdp")
    assert round(per_window, 2) == 1.71
    assert round(per_micro, 2) == 3.41
    # The accountants differ by about 13% here: a reported epsilon must name its accountant.
    pld = privacy.epsilon(SIGMA, Q, WINDOWS, DELTA, sampling="poisson")
    assert 1.10 < per_window / pld < 1.16


def test_edge_values():
    assert privacy.epsilon(0.0, Q, 10, DELTA, sampling="poisson") == math.inf
    assert privacy.epsilon(SIGMA, Q, 0, DELTA, sampling="poisson") == 0.0
    assert privacy.epsilon(SIGMA, 0.0, 10, DELTA, sampling="poisson") == 0.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sampling": "shuffle"}, ValueError, "sampling must be one of 'poisson', 'fixed_size'"),
        ({"accountant": "gdp"}, ValueError, "accountant must be one of 'pld', 'rdp'"),
        ({"steps": 10.0}, TypeError, "steps must be an int, the number of logical batches"),
        ({"steps": -1}, ValueError, "steps must be an int >= 0"),
        ({"delta": 0.0}, ValueError, "delta must be finite and > 0"),
        ({"delta": 1.0}, ValueError, "delta must be < 1"),
        ({"sampling_probability": 1.5}, ValueError, "sampling_probability must be finite"),
        ({"noise_multiplier": -1.0}, ValueError, "noise_multiplier must be finite and >= 0"),
    ],
)
def test_errors_name_the_argument(kwargs, error, match):
    args = {
        "noise_multiplier": SIGMA,
        "sampling_probability": Q,
        "steps": WINDOWS,
        "delta": DELTA,
        "sampling": "poisson",
        **kwargs,
    }
    with pytest.raises(error, match=match):
        privacy.epsilon(**args)


def test_sampling_must_be_named():
    with pytest.raises(TypeError, match="sampling"):
        privacy.epsilon(SIGMA, Q, WINDOWS, DELTA)


def test_without_dp_accounting_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ImportError, match=r"pip install 'gradaccum_jax\[privacy\]'"):
        privacy.epsilon(SIGMA, Q, WINDOWS, DELTA, sampling="poisson")


def test_namespace_imports_without_the_optional_packages():
    code = (
        "import sys; sys.modules['dp_accounting'] = None; sys.modules['jax_privacy'] = None; "
        "import gradaccum_jax.privacy as p; print(sorted(p.__all__))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "clipped_grad" in out.stdout and "epsilon" in out.stdout
