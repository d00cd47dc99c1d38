"""The main job (README's first command), at reduced size."""

import pytest
from _examples import load_example

pytestmark = pytest.mark.slow  # runs an example end to end


@pytest.mark.slow  # four training runs, about 10 s of CPU time
def test_digits_convnet_quick(tmp_path, capsys):
    digits_convnet = load_example("digits_convnet")
    plot = tmp_path / "curves.png"
    result = digits_convnet.main(["--quick", "--no-progress", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "1. Without batch statistics, accumulation is the large batch" in out
    assert "OUTSIDE" not in out
    assert plot.stat().st_size > 30_000  # a real PNG with four panels
    assert result["optimizer_steps"] == result["num_steps"] == 22
    # Fact 1: without batch statistics, accumulated training is large-batch training.
    assert result["param_diff"] <= digits_convnet.PARAM_BOUND
    assert result["grad_gap_exact"] < 1e-5
    # Round-off may flip the argmax of at most a borderline image of the 297 test images.
    assert abs(result["accumulated_accuracy"] - result["large_batch_accuracy"]) <= 1 / 297
    # Fact 2: AccumBatchNorm's running statistics are nn.BatchNorm's on the window, where
    # averaging micro-batch statistics is off by orders of magnitude more ...
    assert result["stats_diff"] <= digits_convnet.STATS_BOUND
    assert result["averaged_stats_diff"] > 100 * result["stats_diff"]
    # ... while training-time normalisation of 32 instead of 128 images changes the gradient.
    assert result["grad_gap_batchnorm"] > 1e-2
    assert result["batchnorm_param_diff"] > 1e3 * result["param_diff"]
    accuracies = result["batchnorm_accumulated_accuracy"], result["batchnorm_large_batch_accuracy"]
    assert abs(accuracies[0] - accuracies[1]) < 0.05
    assert min(accuracies) > 0.4  # chance is 0.1
