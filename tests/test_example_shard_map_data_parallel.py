"""Runs examples/shard_map_data_parallel.py at its reduced size."""

import pytest
from _examples import load_example

# Runs an example end to end, and checks facts of the programs it compiles.
pytestmark = [pytest.mark.slow, pytest.mark.hlo]


@pytest.mark.requires("the example uses jax.lax.pcast, new in JAX 0.8.2", jax="0.8.2")
def test_shard_map_example_matches_large_batch_without_per_step_all_reduce(capsys):
    result = load_example("shard_map_data_parallel").main(["--quick", "--k", "3"])
    out = capsys.readouterr().out
    assert result["max_diff"] < 1e-5
    assert result["all_reduce_ops"] >= 1
    assert result["all_reduce_ops_per_micro_step"] == 0
    assert f"optimizer steps: {result['steps']}, micro-gradients skipped: 0" in out
