"""Where the gradient is reduced, compiled for TPU v5e data-parallel meshes (the `tpu` tier).

Programs compiled by libtpu for "v5e:4x4" (16 chips) and "v5e:2x2" (4 chips) without a TPU
(tests/_tpu.py), read with benchmarks/harness.py: each collective by kind, mesh axes and
place (every step or inside the window's closing branch, inside a loop or not, synchronous
or not). Figures measured with jax 0.10.2 and libtpu 0.0.42.1.
"""

from __future__ import annotations

import functools
import itertools
import math

import _tpu
import jax
import jax.numpy as jnp
import optax
import pytest

import gradaccum_jax as ga
from benchmarks import harness

pytest.importorskip("libtpu", reason=_tpu.REASON)
pytestmark = [pytest.mark.tpu, pytest.mark.hlo, pytest.mark.slow]

P = jax.P


def _mlp(sizes: list[int]) -> list[dict[str, jax.ShapeDtypeStruct]]:
    """Abstract params of `harness.mlp_batch_loss`'s ReLU MLP."""
    return [
        {
            "w": jax.ShapeDtypeStruct((m, n), jnp.float32),
            "b": jax.ShapeDtypeStruct((n,), jnp.float32),
        }
        for m, n in itertools.pairwise(sizes)
    ]


def _batch(rows: int, sizes: list[int]) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "x": jax.ShapeDtypeStruct((rows, sizes[0]), jnp.float32),
        "y": jax.ShapeDtypeStruct((rows, sizes[-1]), jnp.float32),
    }


# 8.4 MB of params; 8 examples per chip on v5e:4x4.
SIZES = [512, 1024, 1024, 512]


@pytest.fixture(scope="module")
def pod16() -> jax.sharding.Mesh:
    """The 16 chips of a v5e 4x4 as one data-parallel axis."""
    return _tpu.mesh("v5e:4x4", (16,), ("data",))


def test_shard_map_accumulate_reduces_once_per_window_in_the_close(pod16):
    # accumulate(adam, 4, axis_name="data") inside shard_map with params cast to varying
    # (harness.shard_map_accumulate): no collective on a micro-step; in the window's
    # closing branch one all-reduce (the leaves combined) of the gradient's bytes and the
    # window weight's 4, 8,398,852 B: 1.00x the gradient. It runs synchronously.
    params = _mlp(SIZES)
    tx = ga.accumulate(optax.adam(1e-3), 4, axis_name="data")
    with jax.set_mesh(pod16):
        init, step = harness.shard_map_accumulate(tx, params, "data", harness.mlp_batch_loss)
        params = _tpu.abstract(params, jax.NamedSharding(pod16, P()))
        state = jax.eval_shape(init, params)
        batch = _tpu.abstract(_batch(16 * 8, SIZES), jax.NamedSharding(pod16, P("data")))
        hlo = harness.Hlo(step.lower(params, state, batch).compile())
    (reduction,) = hlo.collectives(dict(pod16.shape))
    assert (reduction.op, reduction.axes, reduction.place) == ("all-reduce", ("data",), "once")
    assert reduction.nbytes == _tpu.nbytes(params) + 4
    assert not reduction.asynchronous and not reduction.in_loop


# 0.79 MB of params; 65,536 examples per chip on v5e:2x2, whose activations do not fit VMEM.
WIDE_BATCH = [256, 256, 256, 256]


@pytest.fixture(scope="module")
def global_view():
    """`global_view(k, compiler="tpu")`: `jax.jit(microbatch_value_and_grad(loss, k))` on 4
    chips of a v5e 2x2 (or 4 XLA:CPU devices) as one Explicit data axis, params replicated
    and the batch split; returns `(memory, hlo, mesh, param bytes)`, compiled once."""

    @functools.cache
    def compiled(k: int, compiler: str = "tpu"):
        if compiler == "tpu":
            mesh = _tpu.mesh("v5e:2x2", (4,), ("data",))
        else:
            mesh = jax.make_mesh(
                (4,),
                ("data",),
                axis_types=(jax.sharding.AxisType.Explicit,),
                devices=jax.devices("cpu")[:4],
            )
        params = _tpu.abstract(_mlp(WIDE_BATCH), jax.NamedSharding(mesh, P()))
        batch = _tpu.abstract(_batch(4 * 65536, WIDE_BATCH), jax.NamedSharding(mesh, P("data")))
        grad_fn = jax.jit(ga.microbatch_value_and_grad(harness.mlp_batch_loss, k))
        with jax.set_mesh(mesh):
            program = grad_fn.lower(params, batch).compile()
        return harness.compiled_memory(program), harness.Hlo(program), mesh, _tpu.nbytes(params)

    return compiled


def test_global_view_micro_batching_reduces_the_gradient_after_the_loop(global_view):
    """A known disagreement with docs/microbatching.md, whose K all-reduces per step for
    plain `jit` micro-batching are XLA:CPU's: there each micro-batch's gradient (and loss)
    is reduced inside the loop. The TPU compiler moves the gradient's all-reduce out of the
    loop: once per step, after it. Only each micro-batch's loss, 4 bytes, is reduced inside
    the loop (K = 8: 9 all-reduces run per step, 8 of them scalars)."""
    _, hlo, mesh, param_bytes = global_view(8)
    found = hlo.collectives(dict(mesh.shape))
    in_loop = [c for c in found if c.in_loop]
    after = [c for c in found if not c.in_loop]
    assert [(c.op, c.nbytes) for c in in_loop] == [("all-reduce", 4)]
    assert [(c.op, c.axes, c.nbytes) for c in after] == [("all-reduce", ("data",), param_bytes)]
    assert hlo.runs("all-reduce") == 8 + 1
    # XLA:CPU: one combined all-reduce of the gradient and the loss in the loop, 8 per step.
    _, cpu, cpu_mesh, _ = global_view(8, "cpu")
    (reduction,) = cpu.collectives(dict(cpu_mesh.shape))
    assert (reduction.op, reduction.in_loop, reduction.nbytes) == (
        "all-reduce",
        True,
        param_bytes + 4,
    )
    assert cpu.runs("all-reduce") == 8


def test_micro_batching_frees_the_activations_temp(global_view):
    # 65,536 examples per chip: K = 1 holds 201,616,896 B of temp (activations); K = 8 none.
    one, eight = global_view(1)[0], global_view(8)[0]
    assert one.temp_bytes == pytest.approx(201_616_896, rel=0.05)
    assert eight.temp_bytes == 0


def test_micro_batching_inside_shard_map_reduces_nothing_in_its_loop(pod16):
    # docs/microbatching.md's data-parallel recipe: varying params, micro-batches in a loop
    # with no collective, one all-reduce (gradient and loss, 8,398,852 B) after it.
    params = _tpu.abstract(_mlp(SIZES), jax.NamedSharding(pod16, P()))
    batch = _tpu.abstract(_batch(16 * 64, SIZES), jax.NamedSharding(pod16, P("data")))
    grad_fn = ga.microbatch_value_and_grad(harness.mlp_batch_loss, 8)

    def local(params, batch):
        params = jax.lax.pcast(params, "data", to="varying")
        return ga.reduce_replicas(grad_fn(params, batch), "data")

    with jax.set_mesh(pod16):
        step = jax.jit(jax.shard_map(local, in_specs=(P(), P("data")), out_specs=P()))
        hlo = harness.Hlo(step.lower(params, batch).compile())
    assert hlo.in_loops(), "the micro-batches run in a loop"
    (reduction,) = hlo.collectives(dict(pod16.shape))
    assert (reduction.op, reduction.in_loop, reduction.nbytes) == (
        "all-reduce",
        False,
        _tpu.nbytes(params) + 4,
    )


def test_global_batch_statistics_add_no_bytes_and_the_gradient_is_reduced_once():
    # tests/test_statistics.py's MoE (2 layers of 4 experts, counts in int32) through
    # microbatch_value_and_grad(4) on a 4-chip data-parallel Explicit mesh. On XLA:CPU the
    # statistics' first pass makes one all-reduce of both layers' counts per micro-batch,
    # in place of the loss's own per-micro-batch one. The TPU compiler hoists the first
    # layer's counts out of the first pass's loop (one all-reduce of all micro-batches'
    # counts) and keeps the second layer's in it (one per micro-batch): 1 + K runs where the
    # CPU has K, of the same bytes the loss moves without statistics (K x layers x experts
    # x 4 B). Measured (jax 0.10.2, libtpu 0.0.42.1): with statistics 4 all-reduce ops run
    # 10 times, without 3 run 9.
    import test_statistics as moe

    mesh = _tpu.mesh("v5e:2x2", (4,), ("data",))
    params = _tpu.abstract(jax.eval_shape(lambda: moe.PARAMS), jax.NamedSharding(mesh, P()))
    batch = _tpu.abstract(jax.eval_shape(lambda: moe.BATCH), jax.NamedSharding(mesh, P("data")))
    key = jax.ShapeDtypeStruct((), moe.KEY.dtype, sharding=jax.NamedSharding(mesh, P()))
    k = 4

    def moved(statistics_fn):
        with jax.set_mesh(mesh):
            step = jax.jit(
                ga.microbatch_value_and_grad(
                    moe.moe_loss, k, has_aux=True, statistics_fn=statistics_fn
                )
            )
            hlo = harness.Hlo(step.lower(params, batch, key).compile())
        runs = hlo.computation_runs()
        loops = hlo.in_loops()
        counted = 0  # bytes of int32 (the counts) all-reduced per call, loops unrolled
        after_loops = []
        for op in hlo.ops("all-reduce"):
            times = runs[hlo.place(op)]
            counted += times * sum(
                4 * math.prod(shape) for dtype, shape in op.types if dtype == "s32"
            )
            if hlo.place(op) not in loops and times == 1:
                after_loops.append(op.nbytes)
        return counted, after_loops, len(hlo.ops("all-reduce")), hlo.runs("all-reduce")

    with_stats, after_with, ops_with, runs_with = moved(moe.moe_statistics)
    without, after_without, ops_without, runs_without = moved(None)
    counts = k * moe.LAYERS * moe.EXPERTS * 4
    assert with_stats == without == counts, (with_stats, without)
    # The gradient (and nothing else of its size) is reduced once, after the loop, in both.
    grads = _tpu.nbytes(params)
    assert max(after_with) == max(after_without) == grads, (after_with, after_without)
    assert (ops_with, runs_with, ops_without, runs_without) == (4, 10, 3, 9)
