"""Global-view jit on an explicit 8-device mesh: unreduced per-device gradients."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga

P = jax.P
AXIS = "data"
UNREDUCED = P(unreduced={AXIS})
RTOL, ATOL = 2e-5, 2e-6
# Every collective XLA can emit; "-start" forms are the async halves. A combined
# all-reduce has a tuple type with spaces, hence the lazy match up to the name.
_COLLECTIVE = re.compile(
    r"= [^=]*?\b(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
    r"(-start)?\("
)


def collectives(compiled_text: str) -> list[str]:
    return [m.group(1) for m in _COLLECTIVE.finditer(compiled_text)]


@pytest.fixture
def mesh():
    mesh = jax.make_mesh(
        (jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,)
    )
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


def assert_trees_close(actual, expected, rtol=RTOL, atol=ATOL):
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol, atol),
        actual,
        expected,
    )


def replicated(tree):
    return jax.device_put(tree, P())


def sharded(tree):
    return jax.device_put(tree, P(AXIS))


def reduce(tree):
    return jax.jit(lambda t: jax.reshard(t, P()))(tree)


def test_gradients_are_unreduced_and_sum_to_the_global_gradient(mesh):
    params, batch = init_params(), make_batch(0)
    want_value, want_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    step = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS))
    value, grads = step(replicated(params), sharded(batch))
    for leaf in jax.tree.leaves(grads):
        assert jax.typeof(leaf).sharding.spec.unreduced == {AXIS}
    assert_trees_close(reduce(grads), want_grads)
    np.testing.assert_allclose(value, want_value, RTOL)


def test_no_collective_on_the_gradients(mesh):
    params, batch = replicated(init_params()), sharded(make_batch(0))
    silent = ga.unreduced_value_and_grad(loss_fn, AXIS, reduce_value=False)
    assert collectives(jax.jit(silent).lower(params, batch).compile().as_text()) == []
    # The default reduces the scalar value only: one all-reduce of an f32[].
    text = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS)).lower(params, batch)
    text = text.compile().as_text()
    reduces = re.findall(r"= ([^=]*?) all-reduce(?:-start)?\(", text)
    assert collectives(text) == ["all-reduce"] and reduces == ["f32[]"]
    # What it replaces: the backward pass of jax.value_and_grad all-reduces.
    plain = jax.jit(jax.value_and_grad(loss_fn)).lower(params, batch).compile().as_text()
    assert "all-reduce" in collectives(plain)


def test_unreduced_value_sums_to_the_global_mean(mesh):
    params, batch = init_params(), make_batch(1)
    want = loss_fn(params, batch)
    step = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS, reduce_value=False))
    value, _ = step(replicated(params), sharded(batch))
    assert jax.typeof(value).sharding.spec.unreduced == {AXIS}
    np.testing.assert_allclose(reduce(value), want, RTOL)


def test_several_argnums_and_replicated_extra_arguments(mesh):
    params, batch = init_params(), make_batch(2)

    def loss(hidden, last, scale, batch):
        return scale * loss_fn([hidden, last], batch)

    want = jax.grad(loss, argnums=(0, 1))(params[0], params[1], 2.0, batch)
    step = jax.jit(ga.unreduced_value_and_grad(loss, AXIS, argnums=(0, 1), batch_argnums=3))
    _, grads = step(replicated(params[0]), replicated(params[1]), 2.0, sharded(batch))
    assert isinstance(grads, tuple) and len(grads) == 2
    assert_trees_close(reduce(grads), want)


def test_composes_with_microbatches_within_each_device(mesh):
    params, batch = init_params(), make_batch(3, size=64)
    want_value, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    step = jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=4))
    value, grads = step(replicated(params), sharded(batch))
    assert_trees_close(reduce(grads), want_grads)
    np.testing.assert_allclose(value, want_value, RTOL)
    silent = ga.unreduced_value_and_grad(loss_fn, AXIS, num_microbatches=4, reduce_value=False)
    lowered = jax.jit(silent).lower(replicated(params), sharded(batch))
    assert collectives(lowered.compile().as_text()) == []


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


def test_errors_name_the_fix():
    params, batch = init_params(), make_batch(0)
    with pytest.raises(ValueError, match=r"needs a mesh.*jax\.set_mesh"):
        jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS))(params, batch)
    mesh = jax.make_mesh((8,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"no axis 'batch'.*\('data',\)"):
            jax.jit(ga.unreduced_value_and_grad(loss_fn, "batch"))(params, batch)
        odd = make_batch(0, size=12)
        with pytest.raises(ValueError, match=r"argument 1\['x'\] has shape \(12, 6\)"):
            jax.jit(ga.unreduced_value_and_grad(loss_fn, AXIS))(params, odd)
    auto = jax.make_mesh((8,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
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


@pytest.mark.slow
def test_prototype_unreduced_accumulator_reduced_once_per_window(mesh):
    """An unreduced accumulator across jitted micro-steps, reduced at the window close."""
    k, params0 = 4, init_params()
    batches = [make_batch(10 + i) for i in range(3 * k)]
    inner = optax.adam(1e-2)

    # Reference: one device, one adam step per window on the concatenated batch.
    @jax.jit
    def large_batch_step(params, state, batch):
        updates, state = inner.update(jax.grad(loss_fn)(params, batch), state)
        return optax.apply_updates(params, updates), state

    want, want_state = params0, inner.init(params0)
    for w in range(3):
        big = jax.tree.map(lambda *xs: np.concatenate(xs), *batches[w * k : (w + 1) * k])
        want, want_state = large_batch_step(want, want_state, big)

    grad_fn = ga.unreduced_value_and_grad(loss_fn, AXIS, reduce_value=False)

    @jax.jit
    def init(params):
        acc = jax.tree.map(lambda p: jax.reshard(jnp.zeros_like(p), UNREDUCED), params)
        return acc, inner.init(params)

    @jax.jit
    def micro_step(params, acc, batch):
        _, grads = grad_fn(params, batch)
        return jax.tree.map(jnp.add, acc, grads)

    @jax.jit
    def close(params, acc, inner_state, batch):
        total = jax.reshard(micro_step(params, acc, batch), P())
        updates, inner_state = inner.update(jax.tree.map(lambda t: t / k, total), inner_state)
        return optax.apply_updates(params, updates), inner_state

    params = replicated(params0)
    acc, inner_state = init(params)
    for w in range(3):
        for i in range(k - 1):
            acc = micro_step(params, acc, sharded(batches[w * k + i]))
        params, inner_state = close(params, acc, inner_state, sharded(batches[w * k + k - 1]))
        acc, _ = init(params)
    assert_trees_close(params, want)
    args = (params, acc, sharded(batches[0]))
    assert collectives(micro_step.lower(*args).compile().as_text()) == []
    assert set(collectives(close.lower(params, acc, inner_state, args[2]).compile().as_text())) == {
        "all-reduce"
    }
