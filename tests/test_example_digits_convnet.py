"""The main job (README's first command), at reduced size."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import digits_convnet

pytestmark = pytest.mark.slow  # runs an example end to end


def test_digits_convnet_quick(tmp_path, capsys):
    plot = tmp_path / "curves.png"
    result = digits_convnet.main(["--quick", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "test accuracy: accumulated" in out
    assert plot.stat().st_size > 10_000  # a real PNG with two panels
    assert result["optimizer_steps"] == result["num_steps"] == 22
    # Both runs learn, and they learn alike (they differ only through
    # BatchNorm's training-time normalisation of 32 instead of 128 images).
    assert result["accumulated_loss"] < 0.8 * result["first_loss"]
    assert abs(result["accumulated_loss"] - result["large_batch_loss"]) < 0.1
    assert abs(result["accumulated_accuracy"] - result["large_batch_accuracy"]) < 0.05
    assert result["accumulated_accuracy"] > 0.4  # chance is 0.1
