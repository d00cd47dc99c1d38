"""Runs examples/dp_lm.py at its reduced size and checks what it returns and prints."""

import pytest
from _examples import load_example

from gradaccum_jax import privacy

# Runs an example end to end; reads compiled programs only through its chunk planner.
pytestmark = [pytest.mark.slow, pytest.mark.plans]


def test_dp_lm_quick_plans_its_chunks_and_reports_epsilon(capsys):
    example = load_example("dp_lm")
    results = example.main(["--quick"])
    out = capsys.readouterr().out
    plan = results["plan"]
    # The planned chunk is the largest whose program fits; one size larger does not.
    assert plan.peak_bytes <= plan.memory_budget
    fewer = plan.num_microbatches // 2
    assert fewer in plan.table and plan.table[fewer] > plan.memory_budget, plan.table
    assert f"chunk size planned for memory_budget={plan.memory_budget} bytes" in out
    # Epsilon is the accountant's for the windows run, with fixed-size sampling.
    args = example.parse_args(["--quick"])
    n = len(example.load_sequences(32))
    q = args.k * args.batch / n
    want = privacy.epsilon(args.sigma, q, 2, example.DELTA, sampling="fixed_size")
    assert results["epsilon"] == pytest.approx(want)
    assert len(results["losses"]) == 2 and all(0 < x < 10 for x in results["losses"])
    # The dense projections take the fast path's norms, not per-example gradients.
    methods = results["methods"]
    for name in ("q", "kv", "o", "gate", "up", "down"):
        assert methods[f"['blocks']['{name}']['kernel']"] in ("ghost", "layer"), methods
    assert "per_example" not in methods.values(), methods
    assert set(results["temp_bytes"]) == {"private", "non-private"}
    # Its gate and up projections' per-example gradients (64 x 128) are larger than their
    # inputs (T x 64, T <= 64): remat="auto" sums them in a second backward pass.
    assert results["second_pass"]
