"""`gradaccum_jax.flax.TrainState` and `Optimizer` step like Flax's classes, fused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import gradaccum_jax as ga
from gradaccum_jax.flax import Optimizer, TrainState


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
