"""`reduce_replicas`: a data-parallel step's per-device values reduced over the devices, each
leaf by its rule (the micro-batching guide's data-parallel recipe, with Flax fp8 layers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _fp8_common import (
    META,
    Mlp,
    assert_mean_window_metadata,
    assert_metadata_equal,
    batch,
    loss_fn,
    warm_variables,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._base.compat import pcast_to_varying

R = 8
MESH = jax.make_mesh((R,), ("data",))


def _fp8_setup():
    model = Mlp()
    variables, loss = warm_variables(model), loss_fn(model)
    data = batch(7, size=R * 8)  # 8 rows per device, 2 micro-batches of 4
    return variables, loss, data


def _data_parallel(loss, reduce, share=1.0):
    """The guide's recipe: micro-batches on each device, then one reduction (`reduce`)."""
    local_grad_fn = ga.microbatch_value_and_grad(lambda v, b: share * loss(v, b), 2)

    def local(variables, data):
        variables = pcast_to_varying(variables, "data")
        return reduce(local_grad_fn(variables, data))

    step = jax.shard_map(local, mesh=MESH, in_specs=(P(), P("data")), out_specs=P())
    return jax.jit(step)


def _check_params(grads, want):
    for got, ref in zip(
        jax.tree.leaves(grads["params"]), jax.tree.leaves(want["params"]), strict=True
    ):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def _on_mesh(data):
    return jax.device_put(data, NamedSharding(MESH, P("data")))


def test_shares_summed_give_the_large_batch_s_metadata_bit_for_bit():
    variables, loss, data = _fp8_setup()
    want_value, want = jax.value_and_grad(loss)(variables, data)
    step = _data_parallel(loss, lambda t: ga.reduce_replicas(t, "data", reduction="sum"), 1 / R)
    value, grads = step(variables, _on_mesh(data))
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    # Each backward is seeded with its share of the global loss, 1 / (K R): every
    # cotangent is the large batch's, the output-gradient amaxes too.
    assert_metadata_equal(grads[META], want[META])
    _check_params(grads, want)


def test_means_give_the_forward_metadata_and_each_device_s_backward_units():
    variables, loss, data = _fp8_setup()
    want = jax.grad(loss)(variables, data)
    _, grads = _data_parallel(loss, lambda t: ga.reduce_replicas(t, "data"))(
        variables, _on_mesh(data)
    )
    shards = [jax.tree.map(lambda a, d=d: a[d * 8 : (d + 1) * 8], data) for d in range(R)]
    # The output-gradient amax is the max of the devices' own backwards (their mean
    # losses: R times the large batch's cotangents). Their quantization uses the
    # scales of the large batch's units here, so the params' gradients are not the
    # large batch's: a run keeps one convention (see the mixed-precision guide).
    own = [jax.grad(loss)(variables, shard)[META] for shard in shards]
    assert_mean_window_metadata(grads[META], want[META], own)


def test_a_plain_pmean_under_estimates_the_amax():
    # What the recipe did before: the mean of the devices' amaxes.
    variables, loss, data = _fp8_setup()
    want = jax.grad(loss)(variables, data)
    _, grads = _data_parallel(loss, lambda t: jax.lax.pmean(t, "data"))(variables, _on_mesh(data))
    path = ("Dense_0", "Fp8DirectDotGeneralOp_0", "input_amax_history")
    got, ref = grads[META], want[META]
    for key in path:
        got, ref = got[key], ref[key]
    assert float(got[0]) < float(ref[0])


def test_leaves_by_rule_and_pmap():
    tree = {"g": jnp.arange(8.0), "n": jnp.arange(8), META: {"amax": jnp.arange(8.0)}}

    def reduced(**kwargs):
        return jax.pmap(lambda t: ga.reduce_replicas(t, "i", **kwargs), axis_name="i")(tree)

    out = reduced()
    np.testing.assert_array_equal(out["g"], np.full(8, 3.5))
    np.testing.assert_array_equal(out[META]["amax"], np.full(8, 7.0))
    summed = reduced(reduction="sum", max_leaves=None)
    np.testing.assert_array_equal(summed[META]["amax"], np.full(8, 28.0))
    by_rule = reduced(max_leaves=lambda path, leaf: leaf.dtype == jnp.int32)
    np.testing.assert_array_equal(by_rule["n"], np.full(8, 7))
    np.testing.assert_array_equal(by_rule[META]["amax"], np.full(8, 3.5))


def test_bad_arguments_are_refused():
    x = jnp.ones(2)
    with pytest.raises(TypeError, match="axis_name must be"):
        ga.reduce_replicas(x, None)
    with pytest.raises(ValueError, match=r"reduction must be 'mean' .*reduction='max'"):
        ga.reduce_replicas(x, "data", reduction="max")
    with pytest.raises(ValueError, match=r"max_leaves must be"):
        ga.reduce_replicas(x, "data", max_leaves="all")
    with pytest.raises(ValueError, match=r"'data' is not bound"):
        ga.reduce_replicas(x, "data")


@pytest.mark.hlo
def test_the_recipe_reduces_once_per_rule():
    # One all-reduce for the mean of the value and gradients (as jax.lax.pmean of the
    # tree), one for the fp8 metadata's max; none inside the micro-batch loop.
    variables, loss, data = _fp8_setup()
    step = _data_parallel(loss, lambda t: ga.reduce_replicas(t, "data"))
    hlo = harness.Hlo(step.lower(variables, _on_mesh(data)).compile())
    reducers = sorted(hlo.reducer(op) for op in hlo.ops("all-reduce"))
    assert reducers == ["add", "maximum"]
    n_meta = sum(np.size(m) for m in jax.tree.leaves(variables[META]))
    (top,) = [op for op in hlo.ops("all-reduce") if op.elements == n_meta]
    assert hlo.reducer(top) == "maximum"
