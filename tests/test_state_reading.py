"""Reading the inner optimizer's state through an `AccumulateState`, and a user's `pmean`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from gradaccum_jax._base.compat import pcast_to_varying

PARAMS = {"w": jnp.ones(3)}


def test_schedule_free_eval_params_names_the_inner_state():
    state = ga.accumulate(optax.contrib.schedule_free_adamw(0.1), 2).init(PARAMS)
    with pytest.raises(AttributeError, match=r"schedule_free_eval_params\(opt_state.inner_state"):
        optax.contrib.schedule_free_eval_params(state, PARAMS)
    # The documented way.
    params = optax.contrib.schedule_free_eval_params(state.inner_state, PARAMS)
    np.testing.assert_array_equal(params["w"], PARAMS["w"])


def test_hyperparams_name_the_inner_state_and_tree_get():
    tx = ga.accumulate(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), 2)
    state = tx.init(PARAMS)
    with pytest.raises(AttributeError, match=r"opt_state.inner_state.hyperparams.*tree_get"):
        state.hyperparams["learning_rate"]
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(0.1)
    assert float(optax.tree_utils.tree_get(state, "learning_rate")) == pytest.approx(0.1)
    assert not hasattr(state, "fast")  # probes with getattr(..., None) still work


def test_a_users_pmean_is_named_as_the_fix():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    tx = ga.accumulate(optax.sgd(0.1), 2, axis_name="data")

    def body(x):
        local = pcast_to_varying(PARAMS, "data")
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(local)
        grads = jax.lax.pmean(grads, "data")  # the user's own reduction
        return tx.update(grads, tx.init(PARAMS), PARAMS)[0]

    step = jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P())
    with pytest.raises(ValueError, match=r"drop the pmean"):
        jax.jit(step)(jnp.ones(6))
