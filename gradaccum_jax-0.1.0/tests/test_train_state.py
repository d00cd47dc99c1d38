"""`gradaccum_jax.flax.TrainState` and `Optimizer` step like Flax's classes, fused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import gradaccum_jax as ga
from gradaccum_jax.flax import Optimizer, TrainState

# flax's nnx.as_pure is nnx.pure before flax 0.12.2 (the oldest supported stack has 0.12.1).
_pure = getattr(nnx, "as_pure", None) or nnx.pure


def data(step):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    if step == 1:
        x[0, 0] = np.nan  # dropped by accumulate
    return x, rng.normal(size=(8, 2)).astype(np.float32)


def tx():
    return optax.chain(optax.clip_by_global_norm(1.0), ga.accumulate(optax.adam(1e-2), 3))


def test_train_state_equals_flax_train_state():
    params = {"w": jnp.ones((3, 2)) / 3, "b": jnp.zeros(2)}

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    @jax.jit
    def step(state, x, y):
        return state.apply_gradients(grads=jax.grad(loss)(state.params, x, y))

    ours = TrainState.create(apply_fn=None, params=params, tx=tx())
    flax_state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx())
    for i in range(7):
        ours, flax_state = step(ours, *data(i)), step(flax_state, *data(i))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(flax_state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(ours.step) == 7 and int(ga.optimizer_step(ours.opt_state)) == 2


def test_train_state_overwrite_with_gradient_collection():
    key = train_state.OVERWRITE_WITH_GRADIENT
    params = {"params": {"w": jnp.ones(2)}, key: {"s": jnp.zeros(())}}
    grads = {"params": {"w": jnp.ones(2)}, key: {"s": jnp.ones(())}}
    state = TrainState.create(
        apply_fn=None, params=params, tx=ga.accumulate(optax.sgd(0.5), 1)
    ).apply_gradients(grads=grads)
    np.testing.assert_array_equal(state.params["params"]["w"], [0.5, 0.5])
    assert float(state.params[key]["s"]) == 1.0


def test_nnx_optimizer_equals_flax_optimizer():
    def make():
        return nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    @nnx.jit
    def step(model, optimizer, x, y):
        optimizer.update(model, nnx.grad(loss)(model, x, y))

    ours, theirs = make(), make()
    ours_opt = Optimizer(ours, tx(), wrt=nnx.Param)
    their_opt = nnx.Optimizer(theirs, tx(), wrt=nnx.Param)
    for i in range(7):
        step(ours, ours_opt, *data(i))
        step(theirs, their_opt, *data(i))
    for a, b in zip(
        jax.tree.leaves(nnx.state(ours)), jax.tree.leaves(nnx.state(theirs)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    assert int(ours_opt.step[...]) == 7


def _nnx_optimizer_after_three_micro_steps():
    """An NNX `Optimizer` over a loss scale and a noise-tracking accumulate, stepped thrice
    through `scale_loss(loss, current_loss_scale(optimizer.opt_state))`, as the docs show."""
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    tx = optax.chain(
        ga.dynamic_loss_scale(initial_scale=2.0**10),
        ga.accumulate(optax.sgd(0.1), 2, track_noise_scale=True),
    )
    optimizer = Optimizer(model, tx, wrt=nnx.Param)

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    @nnx.jit
    def step(model, optimizer, x, y):
        scaled = ga.scale_loss(loss, ga.current_loss_scale(optimizer.opt_state))
        optimizer.update(model, nnx.grad(scaled)(model, x, y))

    for i in range(3):
        x, y = data(i + 2)  # finite batches
        step(model, optimizer, x, y)
    return model, optimizer, loss


NNX_STATE_READERS = {
    "optimizer_step": ga.optimizer_step,
    "has_updated": ga.has_updated,
    "closes_window": ga.closes_window,
    "current_loss_scale": ga.current_loss_scale,
    "gradient_noise_scale": ga.gradient_noise_scale,
}


@pytest.mark.parametrize("name", sorted(NNX_STATE_READERS))
def test_state_readers_take_an_nnx_optimizer_state(name):
    # nnx.Optimizer.opt_state wraps every array in an OptArray: each reader gives the
    # plain jax.Array it gives for the optax state, eagerly and under jit.
    _, optimizer, _ = _nnx_optimizer_after_three_micro_steps()
    read = NNX_STATE_READERS[name]
    expected = read(_pure(optimizer.opt_state))
    for got in (read(optimizer.opt_state), jax.jit(read)(optimizer.opt_state)):
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            assert type(a) is type(b) and isinstance(a, jax.Array), (name, type(a))
            np.testing.assert_allclose(a, b, rtol=1e-6)  # jit may fuse the noise ratio
    assert int(ga.optimizer_step(optimizer.opt_state)) == 1


def test_scale_loss_takes_the_nnx_loss_scale():
    model, optimizer, loss = _nnx_optimizer_after_three_micro_steps()
    x, y = data(9)
    plain_scale = ga.current_loss_scale(_pure(optimizer.opt_state))
    expected = nnx.grad(ga.scale_loss(loss, plain_scale))(model, x, y)
    # The scale as the state holds it (an OptArray) and as current_loss_scale reads it.
    for scale in (optimizer.opt_state[0].loss_scale, ga.current_loss_scale(optimizer.opt_state)):
        got = nnx.grad(ga.scale_loss(loss, scale))(model, x, y)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(a, b)


def test_scaled_value_and_grad_takes_an_nnx_optimizer_state():
    model, optimizer, loss = _nnx_optimizer_after_three_micro_steps()
    x, y = data(9)
    params = _pure(nnx.state(model, nnx.Param))

    def params_loss(params, x, y):
        return loss(nnx.merge(nnx.graphdef(model), params), x, y)

    grad_fn = ga.scaled_value_and_grad(params_loss)
    value, grads = grad_fn(optimizer.opt_state, params, x, y)
    expected_value, expected = grad_fn(_pure(optimizer.opt_state), params, x, y)
    assert float(value) == float(expected_value)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


class _StateWithStats(TrainState):
    batch_stats: dict


def test_train_state_apply_gradients_passes_extra_arguments_to_update():
    # weight= names no field: it reaches tx.update. batch_stats= names a field: replaced.
    params = {"w": jnp.ones((3, 2)) / 3, "b": jnp.zeros(2)}
    weights = [3.0, 5.0, 1.0, 2.0, 7.0, 4.0]

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    @jax.jit
    def step(state, x, y, w):
        return state.apply_gradients(
            grads=jax.grad(loss)(state.params, x, y), weight=w, batch_stats={"n": w}
        )

    state = _StateWithStats.create(apply_fn=None, params=params, tx=tx(), batch_stats={"n": 0.0})
    reference, ref_state = params, tx().init(params)
    for i, w in enumerate(weights):
        x, y = data(i + 2)
        state = step(state, x, y, jnp.float32(w))
        updates, ref_state = tx().update(
            jax.grad(loss)(reference, x, y), ref_state, reference, weight=jnp.float32(w)
        )
        reference = optax.apply_updates(reference, updates)
        assert float(state.batch_stats["n"]) == w
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7)
    assert int(state.step) == 6 and int(state.optimizer_step) == 2
    # The weights matter: the unweighted windows end elsewhere.
    unweighted = TrainState.create(apply_fn=None, params=params, tx=tx())
    for i in range(6):
        unweighted = unweighted.apply_gradients(
            grads=jax.grad(loss)(unweighted.params, *data(i + 2))
        )
    assert not np.allclose(unweighted.params["w"], state.params["w"])


@pytest.mark.parametrize("typo", ["param", "batch_stat", "opt_states"])
def test_train_state_apply_gradients_refuses_a_misspelt_field(typo):
    state = _StateWithStats.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=tx(), batch_stats={"n": 0.0}
    )
    with pytest.raises(TypeError, match=rf"got {typo}=.*Did you mean"):
        state.apply_gradients(grads={"w": jnp.ones(2)}, **{typo: 1.0})


def test_nnx_optimizer_optimizer_step_counts_windows():
    _, optimizer, _ = _nnx_optimizer_after_three_micro_steps()
    assert int(optimizer.step[...]) == 3
    assert isinstance(optimizer.optimizer_step, jax.Array) and int(optimizer.optimizer_step) == 1


def test_state_readers_take_flax_own_nnx_optimizer_state():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, ga.accumulate(optax.sgd(0.1), 2), wrt=nnx.Param)
    for i in range(2):
        optimizer.update(model, nnx.grad(lambda m, x: m(x).sum())(model, data(i + 2)[0]))
    for read, expected in ((ga.optimizer_step, 1), (ga.has_updated, True)):
        value = read(optimizer.opt_state)
        assert isinstance(value, jax.Array) and value == expected
    assert not bool(ga.closes_window(optimizer.opt_state))
