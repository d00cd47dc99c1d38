"""Tests for flax.nnx modules passed to privacy.clipped_grad (gradaccum_jax._privacy.modules)."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gradaccum_jax import privacy

N, C = 16, 0.5


class Net(nnx.Module):
    def __init__(self, rngs, *, batchnorm=None):
        self.hidden = nnx.Linear(3, 6, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.norm = None if batchnorm is None else nnx.BatchNorm(6, rngs=rngs, **batchnorm)
        self.out = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
        h = self.drop(nnx.relu(self.hidden(x)))
        return self.out(h if self.norm is None else self.norm(h))


def loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def data():
    kx, ky = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, (N, 3)), jax.random.normal(ky, (N, 2))


def folded_reference(model, batch, offset=0):
    """Example i runs the module alone with its streams' keys folded with i."""
    graphdef, params, streams, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)

    def one(params, i, x, y):
        keys = jax.tree.map(
            lambda k: (
                jax.random.fold_in(k, i) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k
            ),
            streams,
        )
        return loss(nnx.merge(graphdef, params, keys, rest, copy=True), (x[None], y[None]))

    index = jnp.arange(N, dtype=jnp.uint32) + offset
    grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0, 0))(params, index, *batch)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(N, -1) ** 2, 1) for g in jax.tree.leaves(grads)))
    factor = jnp.minimum(1.0, C / norms)
    return jax.tree.map(lambda g: jnp.tensordot(factor, g, 1), grads), norms


@pytest.mark.parametrize("method", ["fast", "per_example"])
def test_each_example_draws_its_own_dropout_mask_and_the_streams_move_on(method):
    # Issue 40 item 2: a module holding nnx.Dropout failed with JAX's bare "grad requires
    # real- or complex-valued inputs"; splitting it by hand gave every example one mask.
    model = Net(nnx.Rngs(0, dropout=1))
    batch = data()
    want, want_norms = folded_reference(model, batch)
    fn = privacy.clipped_grad(loss, C, method=method, return_grad_norms=True)
    _, got, norms = fn(model, batch)
    assert isinstance(got, nnx.State)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
    # The masks differ between examples: one mask for all gives other norms.
    graphdef, params, rest = nnx.split(Net(nnx.Rngs(0, dropout=1)), nnx.Param, ...)
    same = jax.vmap(
        lambda x, y: jax.grad(
            lambda p: loss(nnx.merge(graphdef, p, rest, copy=True), (x[None], y[None]))
        )(params)
    )(*batch)
    same_norms = jnp.sqrt(sum(jnp.sum(g.reshape(N, -1) ** 2, 1) for g in jax.tree.leaves(same)))
    assert not np.allclose(same_norms, norms, rtol=1e-3)
    # The stream counted one call, as one call of the module would; the next masks differ.
    assert int(model.drop.rngs.count[...]) == 1
    _, again, _ = fn(model, batch)
    assert int(model.drop.rngs.count[...]) == 2
    assert not np.allclose(jax.tree.leaves(again)[0], jax.tree.leaves(got)[0])


def test_jitted_with_the_module_as_an_argument():
    model = Net(nnx.Rngs(0, dropout=1))
    batch = data()
    want, _ = folded_reference(model, batch)
    fn = privacy.clipped_grad(loss, C)

    @nnx.jit
    def step(model, batch):
        return fn(model, batch)[1]

    got = step(model, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(model.drop.rngs.count[...]) == 1


def test_batchnorm_in_training_mode_is_refused_and_frozen_statistics_are_taken():
    batch = data()
    training = Net(nnx.Rngs(0, dropout=1), batchnorm={"use_running_average": False})
    with pytest.raises(
        TypeError, match=r"changes its state \['norm'\]\['mean'\].*use_running_average=True"
    ):
        privacy.clipped_grad(loss, C)(training, batch)
    frozen = Net(nnx.Rngs(0, dropout=1), batchnorm={"use_running_average": True})
    _, grads = privacy.clipped_grad(loss, C)(frozen, batch)
    assert set(grads["norm"]) == {"scale", "bias"}


def test_plan_names_the_module_params():
    model = Net(nnx.Rngs(0, dropout=1))
    plan = privacy.clipped_grad(loss, C).plan(model, data())
    assert {leaf.path.removesuffix(".value"): leaf.method for leaf in plan} == {
        "['hidden']['bias']": "layer",
        "['hidden']['kernel']": "ghost",
        "['out']['bias']": "layer",
        "['out']['kernel']": "ghost",
    }


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_device_of_a_map_folds_its_examples_indices_in_the_whole_batch(check_vma):
    # Inside shard_map with check_vma=False (and under pmap) the types do not say which
    # axes split the batch, and each device folded its examples' indices from 0: example
    # i of every device drew one mask. Now every mapped axis is taken as splitting it.
    model = Net(nnx.Rngs(0, dropout=1))
    batch = data()
    _, want_norms = folded_reference(model, batch)
    graphdef, state = nnx.split(model)
    fn = privacy.clipped_grad(loss, C, return_grad_norms=True)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(state, batch):
        return fn(nnx.merge(graphdef, state), batch)[2]

    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"), check_vma=check_vma
    )
    norms = jax.jit(sharded)(state, batch)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
    mapped = jax.pmap(body, axis_name="data", in_axes=(None, 0))
    local = jax.tree.map(lambda a: a.reshape(8, N // 8, *a.shape[1:]), batch)
    np.testing.assert_allclose(mapped(state, local).reshape(N), want_norms, rtol=1e-5)
