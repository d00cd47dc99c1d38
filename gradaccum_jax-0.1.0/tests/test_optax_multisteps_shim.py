"""optax's own MultiSteps tests, run against `accumulate` through a forwarding shim.

The shim forwards `MultiSteps(opt, k, use_grad_mean, ..., accumulator_dtype)` to
`accumulate(opt, k, use_grad_mean=..., accumulator_dtype=...)` and nothing else:
`gradient_transformation()` returns the transform, `has_updated` reads the state
with `gradaccum_jax.has_updated`. The test module of the installed optax is
imported and its `MultiSteps` replaced by the shim for the duration of a test.
"""

from __future__ import annotations

import pathlib
import re
import unittest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.transforms import _accumulation_test as accumulation_test

import gradaccum_jax as ga

# The case names below are those of optax 0.2.8's test module. Older releases
# hold other cases: 0.2.6 runs `test_multi_steps` under chex variants and has
# one unparameterised mixed-precision case, and neither 0.2.6 nor 0.2.7 has the
# scan dtype case.
pytestmark = pytest.mark.requires(
    "the shim runs optax 0.2.8's MultiSteps test cases, by name", optax="0.2.8"
)


class _MultiStepsShim:
    def __init__(
        self,
        opt,
        every_k_schedule,
        use_grad_mean=True,
        should_skip_update_fn=None,
        accumulator_dtype=None,
    ):
        self._tx = ga.accumulate(
            opt,
            every_k_schedule,
            use_grad_mean=use_grad_mean,
            accumulator_dtype=accumulator_dtype,
        )
        if should_skip_update_fn is not None:
            raise NotImplementedError("not forwarded by this shim")

    def gradient_transformation(self) -> optax.GradientTransformation:
        return self._tx

    def has_updated(self, state):
        return ga.has_updated(state)


# MultiSteps-only API that accumulate names differently, so the shim cannot
# forward it: the state field `mini_step` (accumulate's `micro_step`, which
# also counts a skipped micro-step toward the window) and
# `should_skip_update_fn` (tested in tests/test_accumulation.py).
EXCLUDED = {
    "test_multi_steps_skip_not_finite": "reads MultiStepsState.mini_step",
}

CASES = [
    "test_multi_steps",
    "test_multi_steps_every_k_schedule",
    "test_multi_steps_scan_dtype_stability",
    "test_multi_steps_zero_nans",
    "test_multi_steps_computes_mean",
    # The 2 parameterisations x 9 dtype pairs of the mixed-precision test.
    "test_multi_steps_mixed_precision0",
    "test_multi_steps_mixed_precision1",
]


def _run(name: str) -> unittest.TestResult:
    case = accumulation_test.AccumulationTest(name)
    result = unittest.TestResult()
    case.run(result)
    return result


# Subtests each mixed-precision case runs (its 9 dtype pairs): counting them shows
# that every pair ran through the shim, not only that nothing failed.
SUBTESTS = {"test_multi_steps_mixed_precision0": 9, "test_multi_steps_mixed_precision1": 9}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SUBTESTS else n for n in CASES]
)
def test_optax_multisteps_case_passes_on_accumulate(monkeypatch, name):
    monkeypatch.setattr(accumulation_test._accumulation, "MultiSteps", _MultiStepsShim)
    seen = []
    original = accumulation_test.AccumulationTest.subTest

    def counting(self, msg=None, **params):
        seen.append(msg)
        return original(self, msg, **params)

    monkeypatch.setattr(accumulation_test.AccumulationTest, "subTest", counting)
    result = _run(name)
    problems = [text for _, text in result.errors + result.failures]
    assert result.testsRun == 1
    assert not problems, "\n".join(problems)
    if name in SUBTESTS:
        assert len(seen) == SUBTESTS[name], seen


def test_every_multisteps_case_is_run_or_excluded():
    names = {n for n in dir(accumulation_test.AccumulationTest) if n.startswith("test_multi")}
    covered = set(CASES) | set(EXCLUDED)
    assert names == covered, names ^ covered


NAN = float("nan")


def _trajectory(tx, grads):
    """Params and the skip metrics after each call of `tx` on the scalar gradients `grads`."""
    params = jnp.zeros(())
    state = tx.init(params)
    step = jax.jit(tx.update)
    params_seen, skip_states = [], []
    for g in grads:
        updates, state = step(jnp.float32(g), state, params)
        params = optax.apply_updates(params, updates)
        params_seen.append(float(params))
        skip_states.append(state.skip_state)
    return params_seen, skip_states


@pytest.mark.parametrize(
    "grads, k",
    [
        ([1.0, NAN, 3.0, 5.0], 2),  # the example of docs/migration.md
        ([NAN, 2.0, 4.0, NAN, NAN, 1.0, 3.0, 7.0, 6.0], 3),
        ([2.0, NAN, NAN, 5.0, 1.0, NAN, 8.0], 2),
    ],
)
def test_migration_recipe_for_multisteps_skip_rule_matches_multisteps(grads, k):
    # docs/migration.md: MultiSteps' should_skip_update_fn rule is
    # should_skip_update_fn= together with count_skipped_steps=False, and
    # MultiStepsState.skip_state is AccumulateState.skip_state.
    inner = optax.adam(0.5)
    multisteps = optax.MultiSteps(inner, k, should_skip_update_fn=optax.skip_not_finite)
    expected, expected_skip = _trajectory(multisteps.gradient_transformation(), grads)
    recipe = ga.accumulate(
        inner, k, should_skip_update_fn=optax.skip_not_finite, count_skipped_steps=False
    )
    got, got_skip = _trajectory(recipe, grads)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    for a, b in zip(got_skip, expected_skip, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    # should_skip_update_fn= alone counts the skipped call toward the window: other windows.
    alone, _ = _trajectory(
        ga.accumulate(inner, k, should_skip_update_fn=optax.skip_not_finite), grads
    )
    assert not np.allclose(alone, expected)


def test_accumulate_page_names_every_excluded_case():
    # docs/accumulate.md says which of optax's cases the shim does not run, and why.
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "accumulate.md").read_text()
    text = " ".join(page.split())
    start = text.index("optax's own `MultiSteps` tests")
    paragraph = text[start : text.index("##", start)]
    named = set(re.findall(r"`(test_multi\w+)`", paragraph))
    assert named == set(EXCLUDED)
    assert "all but one" in paragraph and len(EXCLUDED) == 1
    assert "MultiStepsState.mini_step" in paragraph  # the reason EXCLUDED gives
