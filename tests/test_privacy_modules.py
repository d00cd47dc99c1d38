"""Tests for flax.nnx modules passed to privacy.clipped_grad (gradaccum_jax._privacy.modules)."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
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
def test_a_device_of_a_map_folds_its_examples_indices_in_the_whole_batch(check_vma, auto_mesh):
    # Inside shard_map with check_vma=False (and under pmap) the types do not say which
    # axes split the batch, and each device folded its examples' indices from 0: example
    # i of every device drew one mask. Now every mapped axis is taken as splitting it.
    model = Net(nnx.Rngs(0, dropout=1))
    batch = data()
    _, want_norms = folded_reference(model, batch)
    graphdef, state = nnx.split(model)
    fn = privacy.clipped_grad(loss, C, return_grad_norms=True)
    mesh = auto_mesh

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


class LoraNet(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.LoRALinear(3, 6, lora_rank=2, rngs=rngs)
        self.b = nnx.LoRALinear(6, 2, lora_rank=2, rngs=rngs)
        for layer in (self.a, self.b):  # nnx starts lora_b at zero: no gradient of lora_a
            shape = layer.lora.lora_b.shape
            layer.lora.lora_b[...] = 0.3 * jax.random.normal(jax.random.key(3), shape)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def _lora_reference(model, batch):
    """Each example's gradient of the LoRA params alone (nnx.grad's DiffState), clipped."""
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def one(lora, x, y):
        return loss(nnx.merge(graphdef, lora, rest, copy=True), (x[None], y[None]))

    grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(lora, *batch)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(N, -1) ** 2, 1) for g in jax.tree.leaves(grads)))
    factor = jnp.minimum(1.0, C / norms)
    return jax.tree.map(lambda g: jnp.tensordot(factor, g, 1), grads), norms


@pytest.mark.parametrize("method", ["fast", "per_example"])
@pytest.mark.parametrize("wrt", ["filter", "DiffState"])
def test_wrt_lora_params_clips_only_the_adapters(method, wrt):
    # Issue 44 item 4: every nnx.Param was differentiated, so each example's norm counted
    # the frozen base weights' gradients too.
    model, batch = LoraNet(nnx.Rngs(0)), data()
    want, want_norms = _lora_reference(model, batch)
    chosen = nnx.LoRAParam if wrt == "filter" else nnx.DiffState(0, nnx.LoRAParam)
    fn = privacy.clipped_grad(loss, C, wrt=chosen, method=method, return_grad_norms=True)
    _, got, norms = jax.jit(lambda m, b: fn(m, b))(model, batch)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
    every = privacy.clipped_grad(loss, C, wrt=nnx.Param, return_grad_norms=True)
    _, _, all_norms = every(model, batch)
    assert np.all(np.asarray(all_norms) > np.asarray(norms) * 1.01)


def _lora_step(clip_wrt, optimizer):
    model, batch = LoraNet(nnx.Rngs(0)), data()
    fn = privacy.clipped_grad(loss, C, wrt=clip_wrt)
    opt = optimizer(model)

    @nnx.jit
    def step(model, opt, batch):
        opt.update(model, fn(model, batch)[1])

    step(model, opt, batch)


def _dp(wrt):
    tx = privacy.dp_accumulate(
        optax.sgd(0.1),
        1,
        l2_clip_norm=C,
        expected_batch_size=N,
        noise_multiplier=0.0,
        key=jax.random.key(0),
    )
    return lambda model: nnx.Optimizer(model, tx, wrt=wrt)


@pytest.mark.parametrize(
    ("clip_wrt", "optimizer", "match"),
    [
        (
            nnx.Param,
            _dp(nnx.LoRAParam),
            r"dp_accumulate updates 4 of the 8 leaves.*wrt=nnx\.LoRAParam",
        ),
        (
            nnx.Param,
            lambda m: ga.flax.Optimizer(m, optax.sgd(0.1), wrt=nnx.LoRAParam),
            r"Optimizer\(wrt=.*LoRAParam.*\) updates 4 of the 8 leaves.*clipped_grad\(loss, C,",
        ),
        (
            nnx.LoRAParam,
            lambda m: ga.flax.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param),
            r"clipped gradients \(clipped_grad\) do not hold.*clipped_grad\(loss, C, wrt=",
        ),
    ],
)
def test_an_optimizer_updating_other_leaves_than_were_clipped_is_refused(
    clip_wrt, optimizer, match
):
    with pytest.raises(ValueError, match=match):
        _lora_step(clip_wrt, optimizer)


def test_a_lora_module_without_wrt_is_asked_which_params_to_clip():
    # Issue 50, item 7: "an nnx.Module goes where the params go", then a plain
    # nnx.Optimizer(model, optax.sgd(...), wrt=nnx.LoRAParam), where nothing of ours runs at
    # the update: every nnx.Param (LoRAParam is one) was differentiated, so the frozen base
    # weights' gradients went into each example's norm (all examples clipped, the LoRA sum
    # off). Without wrt= a module holding params of two kinds is asked which.
    model, batch = LoraNet(nnx.Rngs(0)), data()
    with pytest.raises(ValueError, match=r"position 0 holding params of 2 kinds \(LoRAParam, "
                       r"Param\) and no wrt=.*wrt=nnx\.LoRAParam.*wrt=nnx\.Param"):  # fmt: skip
        privacy.clipped_grad(loss, C)(model, batch)
    # A module of one kind of params needs no wrt=, as before.
    plain = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    privacy.clipped_grad(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), C)(plain, batch)


def test_matching_filters_train():
    _lora_step(nnx.LoRAParam, _dp(nnx.LoRAParam))
    _lora_step(nnx.LoRAParam, lambda m: ga.flax.Optimizer(m, optax.sgd(0.1), wrt=nnx.LoRAParam))


def test_wrt_errors_name_the_fix():
    model, batch = LoraNet(nnx.Rngs(0)), data()
    with pytest.raises(TypeError, match=r"wrt=.*holds none.*frozen ones as another argument"):
        privacy.clipped_grad(lambda p, b: jnp.sum(p * b[0]), C, wrt=nnx.LoRAParam)(1.0, batch)
    with pytest.raises(ValueError, match=r"DiffState names argument 1.*positions \(0,\)"):
        privacy.clipped_grad(loss, C, wrt=nnx.DiffState(1, nnx.LoRAParam))(model, batch)
    with pytest.raises(ValueError, match=r"selects no variable.*nnx\.LoRAParam"):
        privacy.clipped_grad(loss, C, wrt=nnx.BatchStat)(model, batch)
