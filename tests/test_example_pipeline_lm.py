"""Runs examples/pipeline_lm.py at its reduced size and checks what it prints."""

import re

import numpy as np
import pytest
from _examples import load_example

# Runs an example end to end, and checks facts of the programs it compiles.
pytestmark = [pytest.mark.slow, pytest.mark.hlo]


def test_pipeline_lm_quick_equals_the_large_batch(capsys):
    results = load_example("pipeline_lm").main(["--quick"])
    out = capsys.readouterr().out
    printed = [
        (float(pipelined), float(large))
        for pipelined, large in re.findall(r"^\s+\d+\s+([\d.]+)\s+([\d.]+)\s+\S+\s+\S+$", out, re.M)
    ]
    assert len(printed) == 3, out
    pipelined, large = np.array(printed).T
    # One 1f1b schedule of 32 micro-batches per data shard is the whole batch's token mean
    # in float32: the losses differ by rounding (measured: at most 4.8e-7 on losses of 4 to
    # 5 nats, 1e-6 relative on the gradients). The bound is twenty times that, and far
    # below a per-micro-batch normalisation's error (tokens per micro-batch vary by tens
    # of percent).
    np.testing.assert_allclose(pipelined, large, rtol=2e-6, atol=0)
    assert max(results["history"]["grad_rel_diff"]) < 2e-5
    assert pipelined[-1] < pipelined[0] - 0.3  # it learns (measured: 4.82 -> 4.13)
    # The tables' bubbles are the formulas', and 1f1b keeps less than gpipe at N = 8 S.
    for row in results["schedules"].values():
        assert row["bubble"] == pytest.approx(row["formula"])
    assert results["schedules"]["1f1b"]["temp_bytes"] < results["schedules"]["gpipe"]["temp_bytes"]
    assert results["nested_bubble"] == pytest.approx(3 / 7)
    assert "nested GA" in out
