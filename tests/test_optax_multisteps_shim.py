"""optax's own MultiSteps tests, run against `accumulate` through a forwarding shim.

The shim forwards `MultiSteps(opt, k, use_grad_mean, ..., accumulator_dtype)` to
`accumulate(opt, k, use_grad_mean=..., accumulator_dtype=...)` and nothing else:
`gradient_transformation()` returns the transform, `has_updated` reads the state
with `gradaccum_jax.has_updated`. The test module of the installed optax is
imported and its `MultiSteps` replaced by the shim for the duration of a test.
"""

from __future__ import annotations

import unittest

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
