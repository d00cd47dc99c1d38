"""The contrastive digits example runs at its reduced size and shows what it claims."""

import numpy as np
import pytest
from _examples import load_example

# Runs an example end to end, and checks facts of the programs it compiles.
pytestmark = [pytest.mark.slow, pytest.mark.hlo]


def test_quick_run(tmp_path, capsys):
    out = load_example("contrastive_digits").main(["--quick", "--plot", str(tmp_path / "plot.png")])
    printed = capsys.readouterr().out
    assert "coupled vs large batch" in printed and "probe acc" in printed
    # (a) coupled follows the large batch to float32 rounding on the same steps ...
    assert out["max_param_gap"] < 1e-5
    large, coupled, naive = (out["history"][n] for n in ("large batch", "coupled", "naive"))
    np.testing.assert_allclose(coupled, large, rtol=1e-5)
    # ... and the naive per-micro-batch loss trains another model, worse on the N-pair loss.
    assert out["naive_gap"] > 0.01
    assert naive[-1] > large[-1]
    assert large[-1] < large[0]  # it learned
    # (c) memory: the large batch's step holds the most, the coupled step less.
    peaks = out["peaks"]
    assert peaks["naive"] < peaks["coupled"] < peaks["large batch"]
    assert (tmp_path / "plot.png").stat().st_size > 10_000
