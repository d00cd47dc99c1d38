"""The NNX example: nnx.Optimizer + accumulate, and NNXAccumBatchNorm, against the large batch."""

import pytest
from _examples import load_example


@pytest.mark.slow  # five short training runs, about 6 s of CPU time
def test_nnx_accumulate_matches_large_batch(capsys):
    nnx_accumulate = load_example("nnx_accumulate")
    result = nnx_accumulate.main(["--steps", "6", "--k", "3", "--micro-batch", "8"])
    assert "running statistics vs nnx.BatchNorm" in capsys.readouterr().out
    assert result["optimizer_steps"] == 6
    # Pooled window statistics are the large batch's; per-micro-batch EMA steps are not.
    assert result["stats_diff"] < 1e-5
    assert result["plain_stats_diff"] > 1e-2
    assert result["param_diff"] < 1e-5
    assert result["last_loss"] < result["first_loss"]
