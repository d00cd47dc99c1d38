"""The AccumBatchNorm digits example runs at its reduced size and shows what it claims."""

import numpy as np
import pytest
from _examples import load_example

pytestmark = pytest.mark.slow  # runs an example end to end


def test_quick_run(capsys):
    rows = load_example("batchnorm_digits").main(["--quick"])
    printed = capsys.readouterr().out
    assert "seed's averaging" in printed and "AccumBatchNorm" in printed
    large, *accumulated = rows
    assert large["accuracy"] > 0.5, "the large-batch run learned something"
    assert len(accumulated) == 4
    for row in accumulated:
        assert np.isfinite(row["test_loss"])
        # The window's statistics are nn.BatchNorm's on the concatenated window.
        assert row["window_error"] < 1e-5
        ratios = row["seed_var_ratio"]
        # Convolutions have many positions per image: the seed loses little there.
        assert min(ratios["norm0"], ratios["norm1"]) > 0.9
        # Dense layers: the seed's variance drops the variance of the micro-batch
        # means, about (b - 1) / b of the exact one once the EMA has settled.
        bound = 0.6 if row["per_replica"] == 1 else 0.9
        assert max(ratios["norm2"], ratios["norm3"]) < bound
