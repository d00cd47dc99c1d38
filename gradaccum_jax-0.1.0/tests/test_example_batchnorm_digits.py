"""The AccumBatchNorm digits example runs at its reduced size and shows what it claims."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # runs an example end to end


EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "batchnorm_digits.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("batchnorm_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    # Flax modules are dataclasses, which look their module up in sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_quick_run(capsys):
    rows = _load_example().main(["--quick"])
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
