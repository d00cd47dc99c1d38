"""Global-view jit on an explicit 8-device mesh: unreduced per-device gradients."""

import collections
import contextlib
import functools
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import _equivalence as E
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._base import compat as _compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_global_view_worker.py"
P = jax.P
AXIS = "data"
UNREDUCED = P(unreduced={AXIS})
RTOL, ATOL = 2e-5, 2e-6


def collectives(compiled) -> dict[str, int]:
    """The collectives of a compiled program that run: {op: count}, zero counts left out."""
    return {op: n for op, n in harness.Hlo(compiled).collective_counts().items() if n}


def every_step_and_all_collectives(compiled) -> tuple[dict[str, int], dict[str, int]]:
    """Collectives on every call (outside conditional branches), and in the whole program."""
    hlo = harness.Hlo(compiled)
    every_step = {op: n for op, n in hlo.collective_counts(hlo.every_step()).items() if n}
    return every_step, collectives(compiled)


@pytest.fixture
def mesh():
    mesh = E.data_mesh()
    with jax.set_mesh(mesh):
        yield mesh


def init_params(seed=0, sizes=(6, 16, 3)):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(key, (m, n)) / np.sqrt(m),
            "b": jnp.full((n,), 0.1 * (i + 1)),
        }
        for i, (key, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))
    ]


def mlp(params, x):
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jnp.tanh(x)
    return x


def loss_fn(params, batch):
    return jnp.mean((mlp(params, batch["x"]) - batch["y"]) ** 2)


def make_batch(seed, size=32):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(size, 6)).astype(np.float32),
        "y": rng.normal(size=(size, 3)).astype(np.float32),
    }


assert_trees_close = functools.partial(E.assert_close, rtol=RTOL, atol=ATOL)


def replicated(tree):
    return jax.device_put(tree, P())


def sharded(tree):
    return jax.device_put(tree, P(AXIS))


def reduce(tree):
    return jax.jit(lambda t: _compat.reshard(t, P()))(tree)


def test_gradients_are_unreduced_and_sum_to_the_global_gradient(mesh):
    params, batch = init_params(), make_batch(0)
    want_value, want_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    step = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS))
    value, grads = step(replicated(params), sharded(batch))
    for leaf in jax.tree.leaves(grads):
        assert jax.typeof(leaf).sharding.spec.unreduced == {AXIS}
    assert_trees_close(reduce(grads), want_grads)
    np.testing.assert_allclose(value, want_value, RTOL)


UNREDUCED_SCALAR = (
    "jax.shard_map returns an unreduced scalar from 0.9.1; 0.8.1 to 0.9.0 all-reduce it "
    "(one f32[] all-reduce) and return it replicated"
)
# Older JAX keeps the unreduced type inside jax.shard_map's body, where `abs` has no
# rule; accumulate refuses unreduced gradients there (test_unreduced_windows_need_...).
UNREDUCED_WINDOWS = (
    "accumulating unreduced gradients needs 0.9.1; 0.8.1 to 0.9.0 keep the unreduced "
    "type inside jax.shard_map (no rule for abs), and accumulate refuses them there"
)


@pytest.mark.hlo
@pytest.mark.requires(UNREDUCED_SCALAR, jax="0.9.1")
def test_no_collective_at_all_with_an_unreduced_value(mesh):
    params, batch = replicated(init_params()), sharded(make_batch(0))
    silent = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS, reduce_value=False))
    assert collectives(silent.lower(params, batch).compile()) == {}
    value, _ = silent(params, batch)
    assert jax.typeof(value).sharding.spec.unreduced == {AXIS}


@pytest.mark.hlo
def test_no_collective_on_the_gradients(mesh):
    params, batch = replicated(init_params()), sharded(make_batch(0))
    # The default reduces the scalar value only: one all-reduce of an f32[].
    compiled = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS)).lower(params, batch).compile()
    assert collectives(compiled) == {"all-reduce": 1}
    assert harness.Hlo(compiled).ops("all-reduce")[0].types == (("f32", ()),)
    # What it replaces: the backward pass of jax.value_and_grad all-reduces.
    plain = jax.jit(jax.value_and_grad(loss_fn)).lower(params, batch).compile()
    assert "all-reduce" in collectives(plain)


def test_unreduced_value_sums_to_the_global_mean(mesh):
    # Unreduced from JAX 0.9.1 (test above); before, summed by JAX: the same number.
    params, batch = init_params(), make_batch(1)
    want = loss_fn(params, batch)
    step = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS, reduce_value=False))
    value, _ = step(replicated(params), sharded(batch))
    np.testing.assert_allclose(reduce(value), want, RTOL)


@pytest.mark.slow
def test_several_argnums_and_replicated_extra_arguments(mesh):
    params, batch = init_params(), make_batch(2)

    def loss(hidden, last, scale, batch):
        return scale * loss_fn([hidden, last], batch)

    want = jax.grad(loss, argnums=(0, 1))(params[0], params[1], 2.0, batch)
    step = jax.jit(ga.unreduced_value_and_grad(loss, AXIS, argnums=(0, 1), batch_argnums=3))
    _, grads = step(replicated(params[0]), replicated(params[1]), 2.0, sharded(batch))
    assert isinstance(grads, tuple) and len(grads) == 2
    assert_trees_close(reduce(grads), want)


@pytest.mark.requires(UNREDUCED_SCALAR, jax="0.9.1")
@pytest.mark.slow
@pytest.mark.hlo
def test_composes_with_microbatches_within_each_device(mesh):
    params, batch = init_params(), make_batch(3, size=64)
    want_value, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    step = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=4))
    value, grads = step(replicated(params), sharded(batch))
    assert_trees_close(reduce(grads), want_grads)
    np.testing.assert_allclose(value, want_value, RTOL)
    silent = ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=4, reduce_value=False)
    lowered = jax.jit(silent).lower(replicated(params), sharded(batch))
    assert collectives(lowered.compile()) == {}


def test_aux_is_averaged_or_summed_or_returned_with_given_specs(mesh):
    params, batch = init_params(), make_batch(4)

    def loss(params, batch):
        pred = mlp(params, batch["x"])
        err = jnp.mean((pred - batch["y"]) ** 2)
        aux = {"err": err, "positive": jnp.sum(pred > 0), "pred": pred}
        return err, aux

    (_, want_aux), want_grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
    step = jax.jit(ga.unreduced_value_and_grad(loss, AXIS, has_aux=True))
    (_, aux), grads = step(replicated(params), sharded(batch))
    assert_trees_close(reduce(grads), want_grads)
    np.testing.assert_allclose(aux["err"], want_aux["err"], RTOL)
    assert int(aux["positive"]) == int(want_aux["positive"])
    # The default averages per-example outputs too: wrong for them; say how to
    # concatenate them instead.
    specs = {"err": P(), "positive": P(unreduced={AXIS}), "pred": P(AXIS)}

    def loss_local(params, batch):
        err, aux = loss(params, batch)
        aux["err"] = jax.lax.pmean(aux["err"], AXIS)
        return err, aux

    step = jax.jit(ga.unreduced_value_and_grad(loss_local, AXIS, has_aux=True, aux_out_specs=specs))
    (_, aux), _ = step(replicated(params), sharded(batch))
    np.testing.assert_allclose(aux["pred"], want_aux["pred"], RTOL, ATOL)
    assert int(reduce(aux["positive"])) == int(want_aux["positive"])


class _BNNet(nn.Module):
    axis_name: str | None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(x)
        return nn.Dense(3)(jnp.tanh(x))


@pytest.mark.slow
def test_flax_batchnorm_across_devices_matches_the_global_batch(mesh):
    batch = make_batch(5)
    variables = _BNNet(None).init(jax.random.key(0), batch["x"])

    def loss(params, batch_stats, batch, axis_name):
        pred, updated = _BNNet(axis_name).apply(
            {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
        )
        return jnp.mean((pred - batch["y"]) ** 2), updated["batch_stats"]

    (want_value, want_stats), want_grads = jax.jit(
        jax.value_and_grad(lambda p, s, b: loss(p, s, b, None), has_aux=True)
    )(variables["params"], variables["batch_stats"], batch)
    step = jax.jit(
        ga.unreduced_value_and_grad(
            lambda p, s, b: loss(p, s, b, AXIS), AXIS, batch_argnums=2, has_aux=True
        )
    )
    (value, stats), grads = step(
        replicated(variables["params"]), replicated(variables["batch_stats"]), sharded(batch)
    )
    assert_trees_close(reduce(grads), want_grads)
    assert_trees_close(stats, want_stats)
    np.testing.assert_allclose(value, want_value, RTOL)


@pytest.mark.slow
def test_flax_batchnorm_per_device_averages_running_statistics(mesh):
    batch = make_batch(6)
    variables = _BNNet(None).init(jax.random.key(0), batch["x"])

    def loss(params, batch_stats, batch):
        pred, updated = _BNNet(None).apply(
            {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
        )
        return jnp.mean((pred - batch["y"]) ** 2), updated["batch_stats"]

    slices = [jax.tree.map(lambda x, i=i: x[4 * i : 4 * i + 4], batch) for i in range(8)]
    local_loss = jax.jit(loss)
    per_device = [local_loss(variables["params"], variables["batch_stats"], s)[1] for s in slices]
    want = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *per_device)
    step = jax.jit(ga.unreduced_value_and_grad(loss, AXIS, batch_argnums=2, has_aux=True))
    (_, stats), _ = step(
        replicated(variables["params"]), replicated(variables["batch_stats"]), sharded(batch)
    )
    assert_trees_close(stats, want)


class _AccumBNNet(nn.Module):
    axis_name: str | None
    train: bool = True

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = ga.flax.AccumBatchNorm(
            use_running_average=not self.train, momentum=0.5, axis_name=self.axis_name
        )(x)
        return nn.Dense(3)(jnp.tanh(x))


def _train_accum_bn_window(axis_name, batches, num_microbatches=1):
    """One window of len(batches) global-view steps of `_AccumBNNet` (the params do not move).

    Returns the initial variables, the final (params, batch_stats, opt_state) and the step.
    """
    variables = _AccumBNNet(axis_name).init(jax.random.key(0), batches[0]["x"])
    tx = ga.accumulate(optax.sgd(0.0), len(batches))

    def loss(params, batch_stats, batch):
        pred, updated = _AccumBNNet(axis_name).apply(
            {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
        )
        return jnp.mean((pred - batch["y"]) ** 2), updated["batch_stats"]

    grad_fn = ga.unreduced_value_and_grad(
        loss, AXIS, batch_argnums=2, has_aux=True, num_microbatches=num_microbatches
    )

    @jax.jit
    def step(params, batch_stats, opt_state, batch):
        (_, batch_stats), grads = grad_fn(params, batch_stats, batch)
        batch_stats = ga.flax.commit_batch_stats(batch_stats, ga.closes_window(opt_state))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state

    params, stats = replicated(variables["params"]), replicated(variables["batch_stats"])
    opt_state = jax.jit(tx.init)(params)
    for batch in batches:
        params, stats, opt_state = step(params, stats, opt_state, sharded(batch))
    return variables, (params, stats, opt_state), step


def _assert_window_statistics(variables, batches, bn):
    """nn.BatchNorm's one EMA step (momentum 0.5) on the window's concatenated batch."""
    window = np.concatenate([b["x"] for b in batches])
    dense = variables["params"]["Dense_0"]
    hidden = window @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"])
    np.testing.assert_allclose(bn["mean"], 0.5 * hidden.mean(0), 1e-5, 1e-6)
    np.testing.assert_allclose(bn["var"], 0.5 + 0.5 * hidden.var(0), 1e-5, 1e-6)


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
@pytest.mark.parametrize("axis_name", [None, AXIS], ids=["per_device", "pooled"])
@pytest.mark.hlo
def test_accum_batchnorm_in_the_global_view_step(mesh, axis_name):
    """Running statistics of the window's global batch, committed when the window closes.

    Without axis_name each device normalises its slice and keeps its window's
    sums unreduced: the step runs no collective outside the window's close.
    With axis_name every call pools its statistics over the devices.
    """
    batches = [make_batch(90 + i) for i in range(2)]
    variables, (params, stats, opt_state), step = _train_accum_bn_window(axis_name, batches)
    bn = stats["BatchNorm_0"]
    _assert_window_statistics(variables, batches, bn)
    partial = {name for name, leaf in bn.items() if jax.typeof(leaf).sharding.spec.unreduced}
    hlo = harness.Hlo(step.lower(params, stats, opt_state, sharded(batches[0])).compile())
    every_step = hlo.collective_counts(hlo.every_step())
    if axis_name is not None:
        assert partial == set()
        assert every_step["all-reduce"] > 0  # the statistics of every call, for normalising
        return
    assert partial == {"window_count", "window_sum", "window_sum_sq"}
    assert set(every_step.values()) == {0}
    # The close: one all-reduce of the gradients, one of the layer's window sums.
    assert hlo.collective_counts()["all-reduce"] == 2

    evaluate = jax.jit(
        lambda p, s, x: _AccumBNNet(None, train=False).apply({"params": p, "batch_stats": s}, x)
    )
    # A mid-window evaluation after the step's commit call (closes=False) is
    # allowed; training calls that no commit has seen are caught at evaluation,
    # with the per-device windows summed for the check.
    _, open_stats, _ = step(params, stats, opt_state, sharded(batches[0]))
    jax.block_until_ready(evaluate(params, open_stats, batches[0]["x"]))
    unseen = {"BatchNorm_0": {**open_stats["BatchNorm_0"], "window_pending": jnp.ones(())}}
    with pytest.raises(jax.errors.JaxRuntimeError, match="commit_batch_stats"):
        jax.block_until_ready(evaluate(params, unseen, batches[0]["x"]))
    # Committed statistics evaluate as their sums would (and this clean run
    # replaces the failed run's runtime tokens).
    want = _AccumBNNet(None, train=False).apply(
        {"params": variables["params"], "batch_stats": jax.tree.map(reduce, stats)},
        batches[0]["x"],
    )
    np.testing.assert_allclose(evaluate(params, stats, batches[0]["x"]), want, RTOL, ATOL)


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
def test_accum_batchnorm_with_microbatches_within_each_device(mesh):
    # Pooled statistics (axis_name) split into micro-batches within each device still
    # give the window's running statistics; per-device windows cannot be averaged over
    # micro-batches, and say what to use instead.
    batches = [make_batch(90 + i) for i in range(2)]
    variables, (_, stats, _), _ = _train_accum_bn_window(AXIS, batches, num_microbatches=2)
    _assert_window_statistics(variables, batches, stats["BatchNorm_0"])
    with pytest.raises(ValueError, match=r"num_microbatches=2.*num_microbatches=1"):
        _train_accum_bn_window(None, batches, num_microbatches=2)


@pytest.mark.slow
def test_flax_nnx_model_through_split_and_merge(mesh):
    from flax import nnx

    batch = make_batch(7)
    model = nnx.Sequential(
        nnx.Linear(6, 16, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(16, 3, rngs=nnx.Rngs(1))
    )
    graphdef, state = nnx.split(model)

    def loss(state, batch):
        return jnp.mean((nnx.merge(graphdef, state)(batch["x"]) - batch["y"]) ** 2)

    want = jax.jit(jax.grad(loss))(state, batch)
    _, grads = jax.jit(ga.unreduced_value_and_grad(loss, AXIS))(replicated(state), sharded(batch))
    assert_trees_close(reduce(grads), want)


def test_an_nnx_module_is_refused_with_the_split_as_the_fix(mesh):
    from flax import nnx

    model = nnx.Sequential(nnx.Linear(6, 3, rngs=nnx.Rngs(0)), nnx.Dropout(0.1, rngs=nnx.Rngs(1)))

    def loss(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    # Differentiated whole, its RNG counters would reach jax.grad as uint32 leaves.
    with pytest.raises(
        TypeError, match=r"flax\.nnx module at argnums position\(s\) \(0,\).*nnx\.split"
    ):
        jax.jit(ga.unreduced_value_and_grad(loss, AXIS))(model, sharded(make_batch(0)))


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
@pytest.mark.hlo
def test_nnx_accum_batchnorm_per_device_windows(mesh):
    """NNXAccumBatchNorm through nnx.split / merge: one reduction per window, at the commit."""
    from flax import nnx

    k = 2
    xs = [make_batch(120 + i)["x"] for i in range(k)]
    model = nnx.Sequential(
        nnx.Linear(6, 8, rngs=nnx.Rngs(0)),
        ga.flax.NNXAccumBatchNorm(8, momentum=0.5, rngs=nnx.Rngs(1)),
    )
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

    def loss(params, stats, x):
        # copy=True: the variables the layer writes belong to this trace.
        model = nnx.merge(graphdef, params, stats, copy=True)
        return jnp.mean(model(x) ** 2), nnx.state(model, nnx.BatchStat)

    grad_fn = ga.unreduced_value_and_grad(loss, AXIS, batch_argnums=2, has_aux=True)
    tx = ga.accumulate(optax.sgd(0.0), k)

    @jax.jit
    def step(params, stats, opt_state, x):
        (_, stats), grads = grad_fn(params, stats, x)
        model = nnx.merge(graphdef, params, stats)
        ga.flax.commit_nnx_batch_stats(model, ga.closes_window(opt_state))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), nnx.state(model, nnx.BatchStat), opt_state

    params, stats = replicated(params), replicated(stats)
    opt_state = jax.jit(tx.init)(params)
    for x in xs:
        params, stats, opt_state = step(params, stats, opt_state, sharded(x))
    linear = model.layers[0]
    hidden = np.concatenate(xs) @ np.asarray(linear.kernel[...]) + np.asarray(linear.bias[...])
    bn = stats["layers"][1]
    assert jax.typeof(bn["window_count"][...]).sharding.spec.unreduced == {AXIS}
    np.testing.assert_allclose(bn["mean"][...], 0.5 * hidden.mean(0), 1e-5, 1e-6)
    np.testing.assert_allclose(bn["var"][...], 0.5 + 0.5 * hidden.var(0), 1e-5, 1e-6)
    every_step, _ = every_step_and_all_collectives(
        step.lower(params, stats, opt_state, sharded(xs[0])).compile()
    )
    assert every_step == {}


def test_errors_name_the_fix():
    params, batch = init_params(), make_batch(0)
    with pytest.raises(ValueError, match=r"needs a mesh.*jax\.set_mesh"):
        jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS))(params, batch)
    mesh = E.data_mesh()
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"no axis 'batch'.*\('data',\)"):
            jax.jit(ga.unreduced_value_and_grad(loss_fn, "batch"))(params, batch)
        odd = make_batch(0, size=12)
        with pytest.raises(ValueError, match=r"argument 1\['x'\] has shape \(12, 6\)"):
            jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS))(params, odd)
    auto = E.data_mesh(E.AUTO)
    with jax.set_mesh(auto):
        with pytest.raises(ValueError, match=r"AxisType.Explicit"):
            jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS))(params, batch)
    with pytest.raises(ValueError, match=r"both argnums and batch_argnums"):
        ga.unreduced_value_and_grad(loss_fn, AXIS, argnums=1)
    with pytest.raises(TypeError, match=r"argnums must be"):
        ga.unreduced_value_and_grad(loss_fn, AXIS, argnums="params")
    with pytest.raises(TypeError, match=r"axis_name must be"):
        ga.unreduced_value_and_grad(loss_fn, None)
    with pytest.raises(ValueError, match=r"num_microbatches"):
        ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=0)
    with pytest.raises(ValueError, match=r"has_aux=False"):
        ga.unreduced_value_and_grad(loss_fn, AXIS, aux_out_specs=P())


def _windows(batches, k):
    return [
        jax.tree.map(lambda *xs: np.concatenate(xs), *batches[w * k : (w + 1) * k])
        for w in range(len(batches) // k)
    ]


def large_batch_reference(inner, params, windows, grad_of=None):
    """One device, one inner step per window on that window's gradient."""

    @jax.jit
    def step(params, state, grads):
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grad_of = grad_of or (lambda p, w: jax.jit(jax.grad(loss_fn))(p, w))
    state = inner.init(params)
    for window in windows:
        params, state = step(params, state, grad_of(params, window))
    return params


def global_view_step(tx):
    grad_fn = ga.unreduced_value_and_grad(loss_fn, AXIS, reduce_value=False)

    def step(params, opt_state, batch, **kwargs):
        _, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step)


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
@pytest.mark.hlo
def test_accumulate_unreduced_matches_the_large_batch(mesh):
    k, params0 = 4, init_params()
    batches = [make_batch(10 + i) for i in range(3 * k)]
    want = large_batch_reference(optax.adam(1e-2), params0, _windows(batches, k))
    tx = ga.accumulate(optax.adam(1e-2), k)
    step = global_view_step(tx)
    params = replicated(params0)
    opt_state = jax.jit(tx.init)(params)
    closes = []
    for batch in batches:
        closes.append(bool(ga.closes_window(opt_state)))
        params, opt_state = step(params, opt_state, sharded(batch))
    assert_trees_close(params, want)
    assert closes == [False, False, False, True] * 3
    assert int(ga.optimizer_step(opt_state)) == 3
    for leaf in jax.tree.leaves(opt_state.acc_grads):
        assert jax.typeof(leaf).sharding.spec.unreduced == {AXIS}
    every_step, everywhere = every_step_and_all_collectives(
        step.lower(params, opt_state, sharded(batches[0])).compile()
    )
    # Micro-steps run no collective; the close all-reduces the window's sums
    # (and weight) once, inside the conditional's apply branch.
    assert every_step == {}
    assert set(everywhere) == {"all-reduce"}


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
@pytest.mark.hlo
def test_global_view_step_keeps_no_more_temporaries_than_the_shard_map_step(mesh):
    # unreduced_value_and_grad divides the loss by the device count before
    # differentiating, so the gradient leaves the backward pass scaled; dividing the
    # gradient afterwards kept one more parameter-sized buffer in every micro-step
    # (measured: 4 against 3 parameter sizes of compiled temporaries, 1.1x the time).
    k, params = 4, init_params(sizes=(6, 64, 64, 3))
    batch = sharded(make_batch(0))
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))

    tx = ga.accumulate(optax.adam(1e-2), k)
    view = global_view_step(tx)
    state = jax.jit(tx.init)(replicated(params))
    _, state = view(replicated(params), state, batch)  # the accumulator becomes unreduced
    view_temp = harness.compiled_memory(
        view.lower(replicated(params), state, batch).compile()
    ).temp_bytes

    local = ga.accumulate(optax.adam(1e-2), k, axis_name=AXIS)
    specs = ga.replica_state_specs(jax.eval_shape(local.init, params), AXIS)

    def body(p, s, b):
        grads = jax.grad(loss_fn)(jax.lax.pcast(p, AXIS, to="varying"), b)
        updates, s = local.update(grads, ga.remove_replica_axis(s), p)
        return optax.apply_updates(p, updates), ga.add_replica_axis(s)

    init = jax.shard_map(
        lambda p: ga.add_replica_axis(local.init(p)), in_specs=P(), out_specs=specs
    )
    step = jax.jit(jax.shard_map(body, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs)))
    local_state = jax.jit(init)(replicated(params))
    map_temp = harness.compiled_memory(
        step.lower(replicated(params), local_state, batch).compile()
    ).temp_bytes
    assert view_temp < map_temp + param_bytes, (view_temp, map_temp, param_bytes)


@pytest.mark.slow
@pytest.mark.hlo
def test_multisteps_in_the_same_step_reduces_every_micro_step(mesh):
    tx = optax.MultiSteps(optax.adam(1e-2), 4)

    @jax.jit
    def step(params, opt_state, batch):
        updates, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = replicated(init_params())
    lowered = step.lower(params, jax.jit(tx.init)(params), sharded(make_batch(0)))
    every_step, _ = every_step_and_all_collectives(lowered.compile())
    assert "all-reduce" in every_step


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
def test_weighted_windows_and_sum(mesh):
    k, params0 = 3, init_params()
    batches = [make_batch(20 + i) for i in range(2 * k)]
    weights = [1.0, 3.0, 0.5, 2.0, 0.0, 4.0]
    grad = jax.jit(jax.grad(loss_fn))

    def weighted(mean):
        def grad_of(params, w):
            micro = [grad(params, b) for b in batches[w * k : (w + 1) * k]]
            ws = weights[w * k : (w + 1) * k]
            total = jax.tree.map(
                lambda *gs: sum(wi * g for wi, g in zip(ws, gs, strict=True)), *micro
            )
            return jax.tree.map(lambda t: t / sum(ws), total) if mean else total

        return grad_of

    for mean in (True, False):
        inner = optax.sgd(0.1)
        want = large_batch_reference(inner, params0, [0, 1], weighted(mean))
        tx = ga.accumulate(inner, k, use_grad_mean=mean)
        step = global_view_step(tx)
        params = replicated(params0)
        opt_state = jax.jit(tx.init)(params)
        for batch, w in zip(batches, weights, strict=True):
            params, opt_state = step(params, opt_state, sharded(batch), weight=jnp.float32(w))
        assert_trees_close(params, want)


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
def test_float16_window_with_unequal_weights_does_not_overflow(mesh):
    # Held in units of the first weight, 1 then 4096 on a gradient of 20 per device overflowed
    # float16 (issue 29); in units of the usable weight so far the sums stay at 20.
    params0 = [{"w": jnp.ones((6, 3)) * 0.1, "b": jnp.zeros(3)}]
    batches = [make_batch(40 + i) for i in range(3)]
    weights = [1.0, 4096.0, 3.0]
    results = []
    for dtype in (jnp.float16, None):
        tx = ga.accumulate(optax.sgd(1.0), 3, accumulator_dtype=dtype)
        step = global_view_step(tx)
        params = replicated(params0)
        opt_state = jax.jit(tx.init)(params)
        for batch, w in zip(batches, weights, strict=True):
            batch = {"x": batch["x"] * 400.0, "y": batch["y"]}
            params, opt_state = step(params, opt_state, sharded(batch), weight=jnp.float32(w))
            if dtype is not None and int(opt_state.micro_step):
                held = reduce(opt_state.acc_grads)
                assert all(
                    np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(held)
                )
        results.append(params)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(results[0]))
    assert_trees_close(results[0], results[1], rtol=2e-3, atol=1e-2)


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
def test_a_non_finite_partial_is_dropped_on_its_device_only(mesh):
    k, params0 = 2, init_params()
    batches = [make_batch(30 + i) for i in range(2 * k)]
    # Device 3's slice of micro-batch 1 overflows: its partial gradient is NaN.
    batches[1]["x"][3 * 4 + 1, 0] = np.inf
    grad = jax.jit(jax.grad(loss_fn))

    def grad_of(params, w):
        # The mean of the local gradients of every accepted (device, micro-batch).
        parts = [
            grad(params, jax.tree.map(lambda x, d=d: x[4 * d : 4 * d + 4], batches[i]))
            for i in range(w * k, (w + 1) * k)
            for d in range(8)
        ]
        kept = [g for g in parts if all(np.isfinite(x).all() for x in jax.tree.leaves(g))]
        return jax.tree.map(lambda *gs: sum(gs) / len(kept), *kept)

    inner = optax.adam(1e-2)
    want = large_batch_reference(inner, params0, [0, 1], grad_of)
    tx = ga.accumulate(inner, k)
    step = global_view_step(tx)
    params = replicated(params0)
    opt_state = jax.jit(tx.init)(params)
    for batch in batches:
        params, opt_state = step(params, opt_state, sharded(batch))
    assert_trees_close(params, want)
    assert int(reduce(opt_state.num_skipped)) == 1
    assert int(ga.optimizer_step(opt_state)) == 2


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
def test_schedule_and_window_with_nothing_accepted(mesh):
    schedule = lambda step: jnp.where(step < 1, 2, 3)  # noqa: E731
    params0 = init_params()
    batches = [make_batch(40 + i) for i in range(5)]
    for i in (2, 3, 4):  # the second window: every partial on every device is NaN
        batches[i]["y"][:] = np.nan
    want = large_batch_reference(optax.adam(1e-2), params0, _windows(batches[:2], 2))
    tx = ga.accumulate(optax.adam(1e-2), schedule)
    step = global_view_step(tx)
    params = replicated(params0)
    opt_state = jax.jit(tx.init)(params)
    for batch in batches:
        params, opt_state = step(params, opt_state, sharded(batch))
    assert_trees_close(params, want)
    assert int(ga.optimizer_step(opt_state)) == 1
    assert int(reduce(opt_state.num_skipped)) == 3 * 8
    assert int(opt_state.micro_step) == 0


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
def test_mixed_leaves_work_or_name_the_fix(mesh):
    k, params0 = 2, init_params()
    batches = [make_batch(50 + i) for i in range(k)]
    want = large_batch_reference(optax.adam(1e-2), params0, _windows(batches, k))
    tx = ga.accumulate(optax.adam(1e-2), k)
    grad_fn = ga.unreduced_value_and_grad(loss_fn, AXIS, reduce_value=False)

    @jax.jit
    def step(params, opt_state, batch):
        _, grads = grad_fn(params, batch)
        # One leaf reduced already (replicated): it counts as split evenly.
        grads[0]["b"] = _compat.reshard(grads[0]["b"], P())
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = replicated(params0)
    opt_state = jax.jit(tx.init)(params)
    for batch in batches:
        params, opt_state = step(params, opt_state, sharded(batch))
    assert_trees_close(params, want)

    @jax.jit
    def scattered(params, opt_state, batch):
        _, grads = grad_fn(params, batch)
        grads[0]["b"] = _compat.reshard(grads[0]["b"], P(AXIS))  # reduce-scattered
        return tx.update(grads, opt_state, params)

    with pytest.raises(ValueError, match=r"\[0\]\['b'\].*sharded over \['data'\]"):
        scattered(params, tx.init(params), sharded(make_batch(0)))


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
@pytest.mark.parametrize(
    "inner",
    [
        optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, weight_decay=0.1)),
        optax.chain(ga.adaptive_grad_clip(0.05), optax.sgd(0.1, momentum=0.9)),
    ],
    ids=["clip_adamw", "agc_sgd"],
)
@pytest.mark.hlo
def test_zero1_sharded_inner_state_matches_the_large_batch(mesh, inner):
    k, params0 = 2, init_params(sizes=(6, 16, 8))
    batches = [make_batch(60 + i) for i in range(2 * k)]
    for b in batches:
        b["y"] = np.concatenate([b["y"], b["y"] + 1.0, b["y"][:, :2]], axis=1)
    want = large_batch_reference(inner, params0, _windows(batches, k))
    tx = ga.accumulate(inner, k, shard_inner_state=AXIS)
    step = global_view_step(tx)
    params = replicated(params0)
    opt_state = jax.jit(tx.init)(params)
    compiled = step.lower(params, opt_state, sharded(batches[0])).compile()
    for batch in batches:
        params, opt_state = step(params, opt_state, sharded(batch))
    assert_trees_close(params, want)
    divisible = 0
    for leaf in jax.tree.leaves(opt_state.inner_state):
        if jnp.ndim(leaf) and leaf.shape[0] % 8 == 0:
            assert leaf.addressable_shards[0].data.size * 8 == leaf.size
            divisible += 1
    assert divisible > 0
    for leaf in jax.tree.leaves(params):
        assert leaf.addressable_shards[0].data.size == leaf.size
    every_step, everywhere = every_step_and_all_collectives(compiled)
    assert every_step == {}
    assert "all-gather" in everywhere


def test_unreduced_windows_need_jax_0_9_1_and_name_the_fix(mesh, monkeypatch):
    # What a user of JAX 0.8.1 to 0.9.0 meets (measured there); on newer JAX, pretended.
    monkeypatch.setattr(_compat, "UNREDUCED_IN_SHARD_MAP", False)
    fix = (
        r"an unreduced window needs JAX >= 0\.9\.1 \(installed .*"
        r"jax\.sharding\.reshard\(grads, jax\.P\(\)\)"
    )
    with pytest.raises(ValueError, match="shard_inner_state='data': " + fix):
        ga.accumulate(optax.sgd(0.1), 2, shard_inner_state=AXIS)
    params, batch = replicated(init_params()), sharded(make_batch(0))
    _, grads = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS))(params, batch)
    tx = ga.accumulate(optax.sgd(0.1), 1)
    update = jax.jit(tx.update)
    with pytest.raises(ValueError, match=r"updates unreduced over mesh axes \('data',\): " + fix):
        update(grads, tx.init(params), params)
    # The fix it names: reduced gradients take the replicated path, which any JAX runs.
    want = jax.jit(jax.grad(loss_fn))(init_params(), make_batch(0))
    updates, _ = update(reduce(grads), tx.init(params), params)
    assert_trees_close(updates, jax.tree.map(lambda g: -0.1 * g, want))


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
def test_zero1_spec_tree_and_callable(mesh):
    params = replicated(init_params(sizes=(6, 16, 8)))
    only_w = lambda path, p: P(AXIS) if p.ndim == 2 and p.shape[0] % 8 == 0 else P()  # noqa: E731
    specs = jax.tree.map(lambda p: only_w(None, p), params)
    for choice in (only_w, specs):
        tx = ga.accumulate(optax.adam(1e-2), 2, shard_inner_state=choice)
        state = jax.jit(tx.init)(params)
        mu = state.inner_state[0].mu
        assert mu[1]["w"].addressable_shards[0].data.size * 8 == mu[1]["w"].size
        assert mu[1]["b"].addressable_shards[0].data.size == mu[1]["b"].size


def test_shard_inner_state_errors():
    with pytest.raises(ValueError, match=r"give one of them"):
        ga.accumulate(optax.sgd(0.1), 2, shard_inner_state=AXIS, axis_name=AXIS)
    with pytest.raises(ValueError, match=r"compensated=True"):
        ga.accumulate(
            optax.sgd(0.1),
            2,
            shard_inner_state=AXIS,
            accumulator_dtype=jnp.bfloat16,
            compensated=True,
        )
    with pytest.raises(TypeError, match=r"shard_inner_state must be"):
        ga.accumulate(optax.sgd(0.1), 2, shard_inner_state=3)


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
def test_a_traced_schedule_below_one_is_counted_and_params_are_optional(mesh):
    """As on one device: a window length below 1 is taken as 1 and counted."""
    schedule = lambda step: jnp.where(step < 1, 1, 0).astype(jnp.int32)  # noqa: E731
    tx = ga.accumulate(optax.sgd(0.1), schedule)
    grad_fn = ga.unreduced_value_and_grad(loss_fn, AXIS, reduce_value=False)

    @jax.jit
    def step(params, opt_state, batch):  # sgd needs no params: update without them
        _, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    params0 = init_params()
    want = large_batch_reference(optax.sgd(0.1), params0, [make_batch(i) for i in range(3)])
    params = replicated(params0)
    opt_state = jax.jit(tx.init)(params)
    for i in range(3):
        params, opt_state = step(params, opt_state, sharded(make_batch(i)))
    assert_trees_close(params, want)
    assert int(ga.optimizer_step(opt_state)) == 3  # taken as K=1
    assert int(opt_state.num_short_windows) == 3
    noisy = global_view_step(ga.accumulate(optax.sgd(0.1), 2, track_noise_scale=True))
    with pytest.raises(ValueError, match=r"track_noise_scale=True.*unreduced"):
        noisy(params, tx.init(params), sharded(make_batch(0)))


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
def test_a_reduced_state_resumes_the_window(mesh):
    """Checkpointing: unreduced fields reduced to P() mid-window are accepted again."""
    k, params0 = 4, init_params()
    batches = [make_batch(70 + i) for i in range(2 * k)]
    batches[5]["x"][0, 0] = np.nan  # a drop on device 0, in the resumed half
    tx = ga.accumulate(optax.adam(1e-2), k, shard_inner_state=AXIS)
    step = global_view_step(tx)

    def run(reduce_at):
        params = replicated(params0)
        opt_state = jax.jit(tx.init)(params)
        for i, batch in enumerate(batches):
            if i == reduce_at:
                opt_state = opt_state._replace(
                    acc_grads=reduce(opt_state.acc_grads),
                    acc_weight=reduce(opt_state.acc_weight),
                    num_skipped=reduce(opt_state.num_skipped),
                )
            params, opt_state = step(params, opt_state, sharded(batch))
        return params, opt_state

    want, want_state = run(reduce_at=None)
    got, got_state = run(reduce_at=6)
    assert_trees_close(got, want)
    assert int(reduce(got_state.num_skipped)) == int(reduce(want_state.num_skipped)) == 1


def summed(tree):
    """Each unreduced leaf summed into its own sharding: docs/distributed.md's recipe."""

    def dense(x):
        spec = jax.typeof(x).sharding.spec
        return _compat.reshard(x, jax.P(*_compat.partitions(spec))) if spec.unreduced else x

    return jax.tree.map(dense, tree)


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
def test_orbax_checkpoint_mid_window_resumes_the_run(mesh, tmp_path):
    """The documented recipe: save the summed state, restore into a fresh state's shardings."""
    import orbax.checkpoint as ocp

    k, params0 = 4, init_params(sizes=(6, 16, 8))
    batches = [make_batch(110 + i) for i in range(2 * k)]
    for b in batches:
        b["y"] = np.concatenate([b["y"], b["y"] + 1.0, b["y"][:, :2]], axis=1)
    batches[1]["x"][0, 0] = np.nan  # a drop on device 0 before the checkpoint
    batches[7]["x"][9, 0] = np.nan  # and one on device 2 after it
    tx = ga.accumulate(optax.adam(1e-2), k, shard_inner_state=AXIS)
    step = global_view_step(tx)

    def run(cut):
        params = replicated(params0)
        opt_state = jax.jit(tx.init)(params)
        for i, batch in enumerate(batches):
            if i == cut:
                checkpointer = ocp.StandardCheckpointer()
                checkpointer.save(
                    tmp_path / "mid", jax.jit(summed)({"params": params, "opt_state": opt_state})
                )
                checkpointer.wait_until_finished()
                fresh = jax.jit(summed)({"params": params, "opt_state": tx.init(params)})
                target = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
                restored = checkpointer.restore(tmp_path / "mid", target)
                checkpointer.close()
                params, opt_state = restored["params"], restored["opt_state"]
                assert jax.tree.map(lambda x: x.sharding, restored) == jax.tree.map(
                    lambda x: x.sharding, fresh
                )
                mu = opt_state.inner_state[0].mu[0]["b"]
                assert mu.addressable_shards[0].data.size * 8 == mu.size
            params, opt_state = step(params, opt_state, sharded(batch))
        return params, opt_state

    want, want_state = run(cut=None)
    got, got_state = run(cut=k + 2)
    assert_trees_close(got, want)
    assert int(ga.optimizer_step(got_state)) == 2
    assert int(reduce(got_state.num_skipped)) == int(reduce(want_state.num_skipped)) == 2


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
@pytest.mark.hlo
def test_fsdp_params_reduce_scatter_once_per_window(mesh):
    """Params sharded over the data axis: one reduction per window, into their sharding."""
    k, params0 = 2, init_params(sizes=(8, 16, 8))
    batches = [make_batch(80 + i) for i in range(2 * k)]
    for b in batches:
        b["x"] = np.concatenate([b["x"], b["x"][:, :2]], axis=1)
        b["y"] = np.concatenate([b["y"], b["y"], b["y"][:, :2]], axis=1)
    want = large_batch_reference(optax.adam(1e-2), params0, _windows(batches, k))
    tx = ga.accumulate(optax.adam(1e-2), k)
    step = global_view_step(tx)
    fsdp = jax.tree.map(lambda p: P(AXIS) if p.shape[0] % 8 == 0 else P(), params0)
    params = jax.device_put(params0, fsdp)
    opt_state = jax.jit(tx.init)(params)
    for batch in batches:
        params, opt_state = step(params, opt_state, sharded(batch))
    assert_trees_close(params, want)
    for leaf in jax.tree.leaves(params):  # still sharded like FSDP put them
        split = 8 if leaf.shape[0] % 8 == 0 else 1
        assert leaf.addressable_shards[0].data.shape[0] * split == leaf.shape[0]
    every_step, _ = every_step_and_all_collectives(
        step.lower(params, opt_state, sharded(batches[0])).compile()
    )
    # The forward pass gathers the sharded params on every micro-step, as FSDP does;
    # the gradients are not reduced there.
    assert "all-reduce" not in every_step and "reduce-scatter" not in every_step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
def test_two_processes_run_the_global_view_step(tmp_path):
    """2 processes x 2 host devices, gloo collectives, an explicit 4-device mesh."""
    windows, k, replicas, per_device = 2, 2, 4, 3
    rng = np.random.default_rng(9)
    xs = rng.normal(size=(windows, k, replicas, per_device, 5)).astype(np.float32)
    ys = rng.normal(size=(windows, k, replicas, per_device, 2)).astype(np.float32)
    xs[1, 0, 3, 0, 0] = np.nan  # the second process's last device drops one partial
    params = {
        "w1": rng.normal(size=(5, 8)).astype(np.float32) / 2,
        "b1": np.zeros(8, np.float32),
        "w2": rng.normal(size=(8, 2)).astype(np.float32) / 3,
        "b2": np.zeros(2, np.float32),
    }
    np.savez(tmp_path / "data.npz", xs=xs, ys=ys, **{f"p_{n}": v for n, v in params.items()})
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(pid), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    outputs = []
    try:
        deadline = time.monotonic() + 240
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]

    # Reference: one process, one adam step per window on the mean of the
    # accepted (device, micro-batch) gradients.
    from _global_view_worker import loss_fn as worker_loss

    inner = optax.adam(1e-2)
    grad = jax.jit(jax.grad(worker_loss))
    want, state = params, inner.init(params)
    for w in range(windows):
        parts = [grad(want, xs[w, i, d], ys[w, i, d]) for i in range(k) for d in range(replicas)]
        kept = [g for g in parts if all(np.isfinite(x).all() for x in jax.tree.leaves(g))]
        mean = jax.tree.map(lambda *gs: sum(gs) / len(gs), *kept)
        updates, state = inner.update(mean, state, want)
        want = optax.apply_updates(want, updates)
    for pid in range(2):
        result = np.load(tmp_path / f"result_{pid}.npz")
        assert_trees_close({n: result[f"p_{n}"] for n in params}, want)
        assert int(result["gradient_step"]) == windows
        assert int(result["num_skipped_total"]) == 1


@pytest.mark.requires(UNREDUCED_WINDOWS, jax="0.9.1")
@pytest.mark.slow
@pytest.mark.hlo
def test_donated_steps_copy_no_parameter_sized_buffer(mesh):
    params0 = init_params(sizes=(6, 64, 32))
    shapes = {("f32", p.shape) for p in jax.tree.leaves(params0)}
    for shard in (None, AXIS):
        tx = ga.accumulate(optax.adam(1e-2), 2, shard_inner_state=shard)
        grad_fn = ga.unreduced_value_and_grad(loss_fn, AXIS, reduce_value=False)

        def step(params, opt_state, batch, tx=tx, grad_fn=grad_fn):
            _, grads = grad_fn(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        params = replicated(params0)
        opt_state = jax.jit(tx.init)(params)
        batch = make_batch(0)
        batch["y"] = np.tile(batch["y"], (1, 11))[:, :32]
        if shard is None:  # the first call retypes the state as unreduced
            params, opt_state = jax.jit(step)(params, opt_state, sharded(batch))
        donated = jax.jit(step, donate_argnums=(0, 1))
        hlo = harness.Hlo(donated.lower(params, opt_state, sharded(batch)).compile())
        copied = {t for c in hlo.copies(1, [hlo.entry]) for t in c.types}
        assert not copied & shapes, copied
        for _ in range(3):  # every donated buffer is reused: no warning
            params, opt_state = donated(params, opt_state, sharded(batch))


# --- HSDP: a ("data", "fsdp") mesh, params sharded over fsdp (issue 23) -----------------

HSDP_SPECS = [{"w": P(None, "fsdp"), "b": P()}, {"w": P("fsdp", None), "b": P("fsdp")}]
FSDP_GROUPS = [(0, 1, 2, 3), (4, 5, 6, 7)]


@pytest.fixture
def mesh2x4():
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 4), (AXIS, "fsdp"), axis_types=explicit)
    with jax.set_mesh(mesh):
        yield mesh


def hsdp_params():
    params = init_params(sizes=(6, 32, 64))
    return jax.tree.map(lambda x: x.astype(jnp.float32), params)  # strong dtypes


def hsdp_batch(size=32):
    batch = make_batch(3, size)
    batch["y"] = np.tile(batch["y"], (1, 22))[:, :64]
    return batch


def collective_groups(compiled) -> list[tuple[str, list[tuple[int, ...]]]]:
    hlo = harness.Hlo(compiled)
    return [
        (op, harness.replica_groups(inst.attributes, jax.device_count()))
        for op in harness.COLLECTIVES
        for inst in hlo.ops(op)
    ]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.requires(UNREDUCED_SCALAR, jax="0.9.1")
def test_hsdp_gradients_are_sharded_like_the_params_and_unreduced_over_data(mesh2x4, k):
    params0, batch = hsdp_params(), hsdp_batch()
    want_value, want = jax.jit(jax.value_and_grad(loss_fn))(params0, batch)
    params = jax.device_put(params0, HSDP_SPECS)
    grad_fn = jax.jit(
        ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=k, reduce_value=False)
    )
    value, grads = grad_fn(params, jax.device_put(batch, P((AXIS, "fsdp"))))
    assert str(jax.typeof(grads[1]["w"])) == "float32[32@fsdp,64]{U:data}"
    assert str(jax.typeof(grads[0]["w"])) == "float32[6,32@fsdp]{U:data}"
    assert str(jax.typeof(grads[0]["b"])) == "float32[32]{U:data}"  # a psum over fsdp
    assert str(jax.typeof(grads[1]["b"])) == "float32[64@fsdp]{U:data}"
    assert str(jax.typeof(value)) == "float32[]{U:data}"
    assert grads[1]["w"].addressable_shards[0].data.shape == (8, 64)  # 1/4 per device
    summed = jax.jit(lambda g: _compat.reshard(g, HSDP_SPECS))(grads)
    assert_trees_close(summed, want, rtol=1e-5)
    np.testing.assert_allclose(reduce(value), want_value, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.requires(UNREDUCED_SCALAR, jax="0.9.1")
@pytest.mark.slow
@pytest.mark.hlo
def test_hsdp_collectives_stay_inside_fsdp_groups(mesh2x4, k):
    params = jax.device_put(hsdp_params(), HSDP_SPECS)
    batch = jax.device_put(hsdp_batch(), P((AXIS, "fsdp")))
    grad_fn = ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=k, reduce_value=False)
    found = collective_groups(jax.jit(grad_fn).lower(params, batch).compile())
    assert found and all(groups == FSDP_GROUPS for _, groups in found), found
    ops = collections.Counter(op for op, _ in found)
    # The 3 sharded leaves: gathered once (all-gather) and reduce-scattered once,
    # whatever K; the replicated bias and the value: one all-reduce.
    assert ops == {"all-gather": 3, "reduce-scatter": 3, "all-reduce": 1}, ops
    # The default global mean value adds one scalar all-reduce over all 8 devices.
    mean_value = ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=k)
    found = collective_groups(jax.jit(mean_value).lower(params, batch).compile())
    across = [(op, g) for op, g in found if g != FSDP_GROUPS]
    assert across == [("all-reduce", [tuple(range(8))])], across


@pytest.mark.hlo
@pytest.mark.requires(UNREDUCED_SCALAR, jax="0.9.1")
def test_fsdp_params_unreduced_over_every_axis_stay_full_size(mesh2x4):
    """axis_name=("data", "fsdp"): no communication of gradients until the window closes."""
    params0, batch = hsdp_params(), hsdp_batch()
    want = jax.jit(jax.grad(loss_fn))(params0, batch)
    params = jax.device_put(params0, HSDP_SPECS)
    batch = jax.device_put(batch, P((AXIS, "fsdp")))
    for k in (1, 4):
        grad_fn = ga.unreduced_value_and_grad(loss_fn, (AXIS, "fsdp"), num_microbatches=k)
        _, grads = jax.jit(grad_fn)(params, batch)
        assert str(jax.typeof(grads[1]["w"])) == "float32[32,64]{U:(data,fsdp)}"
        assert grads[1]["w"].addressable_shards[0].data.shape == (32, 64)
        assert_trees_close(jax.jit(lambda g: _compat.reshard(g, HSDP_SPECS))(grads), want)
    ops = collections.Counter(
        op for op, _ in collective_groups(jax.jit(grad_fn).lower(params, batch).compile())
    )
    assert ops == {"all-gather": 3, "all-reduce": 1}, ops  # the params, the value


@pytest.mark.requires(UNREDUCED_SCALAR, jax="0.9.1")
def test_fsdp_params_on_the_data_axis_stay_full_size(mesh):
    params0, batch = hsdp_params(), hsdp_batch()
    want = jax.jit(jax.grad(loss_fn))(params0, batch)
    specs = [{"w": P(None, AXIS), "b": P(AXIS)}, {"w": P(AXIS, None), "b": P()}]
    params = jax.device_put(params0, specs)
    _, grads = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=2))(
        params, sharded(batch)
    )
    assert str(jax.typeof(grads[1]["w"])) == "float32[32,64]{U:data}"
    assert_trees_close(jax.jit(lambda g: _compat.reshard(g, specs))(grads), want)


def test_hsdp_errors_name_the_fix(mesh2x4):
    params = jax.device_put(hsdp_params(), HSDP_SPECS)
    grad_fn = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=2))
    odd = jax.device_put(hsdp_batch(size=36), P(AXIS))
    with pytest.raises(ValueError, match=r"8 devices of the mesh axes \('data', 'fsdp'\)"):
        grad_fn(params, odd)
    # 32 examples over 8 devices, then 8 micro-batches: 4 per device, not 8.
    with pytest.raises(ValueError, match=r"num_microbatches=8 micro-batches.*multiple of 64"):
        jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=8))(
            params, jax.device_put(hsdp_batch(), P((AXIS, "fsdp")))
        )
    with pytest.raises(ValueError, match=r"no axis 'model'.*\('data', 'fsdp'\)"):
        jax.jit(ga.unreduced_value_and_grad(loss_fn, "model"))(params, hsdp_batch())
    partial = jax.jit(lambda p: jax.tree.map(lambda x: _compat.reshard(x, UNREDUCED), p))
    with pytest.raises(ValueError, match=r"argument 0\[0\]\['b'\] \(in argnums\) is typed"):
        jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS))(partial(hsdp_params()), hsdp_batch())
    auto = jax.make_mesh((2, 4), (AXIS, "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(auto):
        with pytest.raises(ValueError, match=r"AxisType.Explicit"):
            jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS))(
                jax.device_put(hsdp_params(), HSDP_SPECS), hsdp_batch()
            )


@pytest.mark.requires(UNREDUCED_SCALAR, jax="0.9.1")
def test_hsdp_leaves_sharded_over_both_axes_and_a_batch_split_over_data_only(mesh2x4):
    """`data` is dropped from a gradient's spec; the batch is sliced over fsdp as well."""
    params0, batch = hsdp_params(), hsdp_batch()
    want = jax.jit(jax.grad(loss_fn))(params0, batch)
    specs = [{"w": P(None, (AXIS, "fsdp")), "b": P("fsdp")}, {"w": P(("fsdp", AXIS)), "b": P()}]
    grad_fn = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=2))
    _, grads = grad_fn(jax.device_put(params0, specs), jax.device_put(batch, P(AXIS)))
    assert str(jax.typeof(grads[0]["w"])) == "float32[6,32@fsdp]{U:data}"
    assert str(jax.typeof(grads[1]["w"])) == "float32[32@fsdp,64]{U:data}"
    assert_trees_close(jax.jit(lambda g: _compat.reshard(g, specs))(grads), want)


# --- Explicit meshes known from the arrays' types alone (issue 44 item 7) ----------------


# Releases before 0.9 fail to compile the plan's candidates on a traced Explicit mesh.
_OLD_PLANNER = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 9)


def _typed_mesh_doors():
    """Every door that splits a batch, on float64 `(params, x)`: name -> function."""

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)

    def embed(p, x):
        return jnp.tanh(x @ p["w"])

    def coupled_loss(p, e):
        # A loss written for the Explicit mesh: the candidates replicated, whatever says
        # where the mesh is (the context, or here only e's type).
        mesh = jax.typeof(e).sharding.mesh
        if jax.sharding.AxisType.Explicit in mesh.axis_types:
            e_all = _compat.reshard(e, jax.sharding.NamedSharding(mesh, P()))
        else:
            e_all = e
        return jnp.mean(jax.nn.logsumexp(e @ e_all.T, axis=1))

    def counts(p, x):
        return {"s": jnp.sum(x, 0)}

    def balanced(p, x, statistics):
        return loss(p, x) * jnp.sum(statistics["s"])

    return {
        "clipped_grad": ga.privacy.clipped_grad(loss, 0.1),
        "clipped_grad_chunks": ga.privacy.clipped_grad(
            loss, 0.1, microbatch_size=4, method="per_example"
        ),
        "microbatch": ga.microbatch_value_and_grad(loss, 4),
        "microbatch_auto": ga.microbatch_value_and_grad(loss, "auto", memory_budget=2**30),
        "statistics_fn": ga.microbatch_value_and_grad(balanced, 4, statistics_fn=counts),
        "coupled": ga.coupled_value_and_grad(coupled_loss, embed, 4),
    }


@pytest.mark.hlo  # the coupled door's loops read from its program; microbatch_auto plans
@pytest.mark.parametrize("door", list(_typed_mesh_doors()))
@pytest.mark.parametrize("context", ["set_mesh", "types only", "types only, not jitted"])
def test_a_batch_on_an_explicit_mesh_needs_no_context_mesh(door, context, x64):
    # Without jax.set_mesh, clipped_grad failed inside the library (slicing an example out
    # of f32[64@data,16]) and coupled_value_and_grad left its per-device route (one
    # reduction per step) for XLA's partitioner; the other doors guard the same promise.
    with x64():
        fn = _typed_mesh_doors()[door]
        params = {"w": jax.random.normal(jax.random.key(1), (16, 4)) * 0.3}
        x = jax.random.normal(jax.random.key(0), (64, 16))
        want = jax.jit(fn)(params, x)
        mesh = E.data_mesh()
        on = contextlib.nullcontext() if context.startswith("types") else jax.set_mesh(mesh)
        with on:
            xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(AXIS)))
            ps = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
            step = fn if context.endswith("not jitted") else jax.jit(fn)
            if door == "microbatch_auto" and step is not fn and _OLD_PLANNER:
                # JAX 0.8 cannot compile the plan's candidates on a traced Explicit mesh.
                old = r"'auto' plan inside jax\.jit.*plan_microbatches"
                with pytest.raises(ValueError, match=old):
                    step(ps, xs)
                return
            got = step(ps, xs)
            if door == "coupled" and context == "types only":
                inside = harness.Hlo(jax.jit(fn).lower(ps, xs).compile())
                loops = {
                    n
                    for inst in inside.instructions()
                    if inst.opcode == "while"
                    for n in re.findall(r"body=%?([\w.\-]+)", inst.attributes)
                }
                in_loops = inside.collective_counts(inside.reachable(loops))
                assert in_loops["all-reduce"] == in_loops["reduce-scatter"] == 0, in_loops
    E.assert_close(got, want, rtol=1e-12, atol=1e-14)
