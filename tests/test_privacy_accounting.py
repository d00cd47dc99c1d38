"""Tests for privacy accounting (gradaccum_jax._privacy.accounting): `privacy.epsilon`."""

import math
import subprocess
import sys

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from gradaccum_jax import privacy

SIGMA, Q, WINDOWS, DELTA, K = 1.1, 0.01, 1000, 1e-5, 4


def dp_accounting_epsilon(event, count, accountant, orders=None):
    tracker = (
        dp_accounting.pld.PLDAccountant()
        if accountant == "pld"
        else dp_accounting.rdp.RdpAccountant(orders=orders)
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


def test_concrete_jax_and_numpy_scalars_are_numbers():
    # Issue 40, item 7: the window count read from the state is a JAX int32 scalar.
    tx = privacy.dp_accumulate(
        optax.sgd(1.0),
        1,
        l2_clip_norm=1.0,
        noise_multiplier=SIGMA,
        expected_batch_size=8,
        key=jax.random.key(0),
    )
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update(params, state, params)
    steps = ga.optimizer_step(state)
    assert isinstance(steps, jax.Array) and int(steps) == 3
    want = privacy.epsilon(SIGMA, Q, 3, DELTA, sampling="poisson")
    assert privacy.epsilon(SIGMA, Q, steps, DELTA, sampling="poisson") == want
    as_arrays = privacy.epsilon(
        np.float64(SIGMA), np.asarray(Q), np.int64(3), jnp.asarray(DELTA), sampling="poisson"
    )
    assert as_arrays == pytest.approx(want, rel=1e-6)  # jnp.asarray(DELTA) is float32
    # A float32 sigma is the float32 number it holds, not 1.1.
    sigma32 = float(np.float32(SIGMA))
    assert privacy.epsilon(jnp.float32(SIGMA), Q, 3, DELTA, sampling="poisson") == (
        privacy.epsilon(sigma32, Q, 3, DELTA, sampling="poisson")
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"steps": jnp.float32(3.0)}, TypeError, "steps must be an int, the number of logical"),
        ({"steps": jnp.array([3, 4])}, ValueError, r"epsilon's steps must be a scalar.*\(2,\)"),
        ({"noise_multiplier": jnp.array(True)}, TypeError, "noise_multiplier must be a real"),
        ({"delta": jnp.float32(2.0)}, ValueError, "delta must be finite and > 0 and <= 1"),
    ],
)
def test_bad_jax_scalars_get_epsilons_own_words(kwargs, error, match):
    args = {"noise_multiplier": SIGMA, "sampling_probability": Q, "steps": 10, "delta": DELTA}
    with pytest.raises(error, match=match) as info:
        privacy.epsilon(**{**args, **kwargs}, sampling="poisson")
    assert "inject_hyperparams" not in str(info.value)


@pytest.mark.parametrize("name", ["steps", "noise_multiplier", "sampling_probability", "delta"])
def test_a_traced_argument_is_refused_naming_where_to_call_it(name):
    args = {"noise_multiplier": SIGMA, "sampling_probability": Q, "steps": 10, "delta": DELTA}

    def traced(value):
        return privacy.epsilon(**{**args, name: value}, sampling="poisson")

    with pytest.raises(TypeError, match=rf"epsilon got {name}=.*traced value.*outside"):
        jax.jit(traced)(args[name])


def test_rdp_orders_default_to_dp_accountings_grid_and_can_be_given():
    event = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA))
    # The default grid, as the docstring states it.
    default = dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS
    stated = [1 + x / 10 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
    np.testing.assert_array_equal(default, stated)
    doc = " ".join(privacy.epsilon.__doc__.split())
    assert "1.1 to 10.9 in steps of 0.1, the integers 11 to 63, and 128, 256, 512, 1024" in doc
    rdp = privacy.epsilon(SIGMA, Q, WINDOWS, DELTA, sampling="poisson", accountant="rdp")
    assert rdp == dp_accounting_epsilon(event, WINDOWS, "rdp", orders=stated)
    # Fewer orders: the least bound over a subset, never below the finer grid's.
    coarse = privacy.epsilon(
        SIGMA, Q, WINDOWS, DELTA, sampling="poisson", accountant="rdp", orders=[2, 4, 8]
    )
    assert coarse > rdp


@pytest.mark.requires("jax_privacy 2.0 needs optax>=0.2.8", optax="0.2.8")
def test_rdp_orders_of_jax_privacy_give_its_epsilon():
    # Another grid, another valid bound: here 0.8% above dp_accounting's default grid.
    from jax_privacy.accounting import accountants

    event = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA))
    rdp = privacy.epsilon(SIGMA, Q, WINDOWS, DELTA, sampling="poisson", accountant="rdp")

    config = accountants.RdpAccountantConfig()
    theirs = config.create_accountant()
    theirs.compose(event, WINDOWS)
    got = privacy.epsilon(
        SIGMA, Q, WINDOWS, DELTA, sampling="poisson", accountant="rdp", orders=config.orders
    )
    assert got == theirs.get_epsilon(DELTA)
    assert got > rdp and got / rdp - 1 < 0.01


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"orders": [2.0]}, ValueError, "orders= is for the Rényi DP accountant"),
        ({"accountant": "rdp", "orders": [1.0, 2.0]}, ValueError, "finite numbers > 1"),
        ({"accountant": "rdp", "orders": []}, ValueError, "non-empty"),
        ({"accountant": "rdp", "orders": "2,3"}, TypeError, "sequence of numbers"),
    ],
)
def test_bad_orders_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        privacy.epsilon(SIGMA, Q, WINDOWS, DELTA, sampling="poisson", **kwargs)


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
