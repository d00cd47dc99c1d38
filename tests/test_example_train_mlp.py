"""The MLP example: accumulated training equals large-batch training."""

import pytest
from _examples import load_example

pytestmark = pytest.mark.slow  # runs an example end to end


def test_train_mlp_matches_large_batch(capsys):
    train_mlp = load_example("train_mlp")
    result = train_mlp.main(["--steps", "12", "--k", "3", "--micro-batch", "16"])
    out = capsys.readouterr().out
    assert "largest parameter difference" in out
    assert result["optimizer_steps"] == 12
    # float32, 12 adamw steps: rounding differences only.
    assert result["max_param_diff"] < 1e-5
    assert abs(result["accumulated_loss"] - result["large_batch_loss"]) < 1e-5
    assert result["accumulated_loss"] < 2.0  # it trained (the initial loss is about 2.4)
