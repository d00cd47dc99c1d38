"""The pod benchmark's decoder at its quick size, compiled for a TPU v5e 2x2 (the `tpu` tier).

benchmarks/tpu_pod.py compiles Llama-shaped decoders for v5e-256 and v5p pods
(docs/tpu_pods.md); here its tiny decoder (2 scanned layers) on a `data 2 x fsdp 2` mesh
of "v5e:2x2", through the HSDP route: `unreduced_value_and_grad(loss, "data")` and
`accumulate(adamw, 8)` through `apply_gradients`, one compiled program for the window's
micro-steps and its close. Measured with jax 0.10.2 and libtpu 0.0.42.1.
"""

from __future__ import annotations

import _tpu
import pytest

from benchmarks import tpu_pod

pytest.importorskip("libtpu", reason=_tpu.REASON)
pytestmark = [pytest.mark.tpu, pytest.mark.hlo, pytest.mark.slow]


def test_unreduced_accumulate_crosses_data_only_in_the_close_and_gathers_the_whole_model():
    config = tpu_pod.CONFIGS["tiny-v5e"]
    row = tpu_pod.compile_step(config, "accumulate_unreduced", per_chip=2, seq=128, k=8)
    every = [c for c in row["collectives"] if c["place"] == "every call"]
    once = [c for c in row["collectives"] if c["place"] == "once"]
    # Every micro-step: the params' gathers, the gradients' reduce-scatters and the small
    # all-reduces (the norms' gradients, the finite check's verdict), all inside "fsdp".
    assert {c["op"] for c in every} == {"AG@fsdp", "RS@fsdp", "AR@fsdp"}, every
    # The close: one all-reduce over "data" of the float32 gradient's shard (and the
    # window's weight, 4 bytes): the only collective that crosses "data".
    model, fsdp = tpu_pod.MODELS[config.model], config.mesh[1]
    sharded, replicated = model.count(sharded=True), model.count(sharded=False)
    assert [(c["op"], c["instructions"]) for c in once] == [("AR@data", 1)], once
    assert once[0]["bytes"] == 4 * (sharded // fsdp + replicated) + 4
    # The whole model, cast to bfloat16, is gathered once per call before the layer loop
    # (unreduced_value_and_grad gathers at its shard_map's entry): what rules this route
    # out for the 8B model on a 16 GiB v5e chip (docs/tpu_pods.md).
    (hoisted,) = [c for c in every if c["op"] == "AG@fsdp" and c["where"] == "hoisted"]
    assert hoisted["bytes"] == 2 * sharded
