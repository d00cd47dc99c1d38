"""`optax.lookahead` and `accumulate`: lookahead inside the window is the large batch's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga

K, B, D = 4, 8, 3
WINDOWS = 7  # odd: the last window is not synced, so fast and slow both tell
RTOL, ATOL = 1e-5, 1e-6  # float32 sums in another order: a few ulps per step


def loss(params, x, y):
    return jnp.mean(jnp.square(x @ params["w"] - y))


def lookahead():
    return optax.lookahead(optax.adam(0.1), sync_period=2, slow_step_size=0.5)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(WINDOWS, K * B, D)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32) + rng.normal(size=(WINDOWS, K * B))
    return x, y.astype(np.float32)


def grad(params, x, y):
    return jax.grad(loss)(params.fast, x, y)  # the gradient of the fast params


def make_step(tx):
    @jax.jit
    def step(params, state, x, y):
        grads = grad(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


ACCUMULATED = ga.accumulate(lookahead(), K)
MICRO_STEP = make_step(ACCUMULATED)
START = optax.LookaheadParams.init_synced({"w": jnp.zeros(D)})


def large_batch():
    tx = lookahead()
    step, params, state = make_step(tx), START, tx.init(START)
    x, y = data()
    for i in range(WINDOWS):
        params, state = step(params, state, x[i], y[i])
    return params


@pytest.mark.parametrize("init_with", ["LookaheadParams", "fast params"])
def test_accumulate_lookahead_is_the_large_batch(init_with):
    want = large_batch()
    params = START
    state = ACCUMULATED.init(START if init_with == "LookaheadParams" else START.fast)
    x, y = data()
    for i in range(WINDOWS):
        for j in range(K):
            rows = slice(j * B, (j + 1) * B)
            params, state = MICRO_STEP(params, state, x[i][rows], y[i][rows])
    assert not np.allclose(want.slow["w"], want.fast["w"])
    np.testing.assert_allclose(params.fast["w"], want.fast["w"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(params.slow["w"], want.slow["w"], rtol=RTOL, atol=ATOL)
    assert int(ga.optimizer_step(state)) == WINDOWS


def test_accumulate_lookahead_micro_steps_move_nothing():
    state = ACCUMULATED.init(START)
    grads = {"w": jnp.ones(D)}
    updates, state = jax.jit(ACCUMULATED.update)(grads, state, START)
    assert isinstance(updates, optax.LookaheadParams)
    assert not jnp.any(updates.fast["w"]) and not jnp.any(updates.slow["w"])


def test_lookahead_around_accumulate_is_refused():
    tx = optax.lookahead(ga.accumulate(optax.adam(0.1), K), sync_period=2, slow_step_size=0.5)
    state = tx.init(START)
    match = r"optax.lookahead is around gradaccum_jax.accumulate.*optax.lookahead\(inner"
    with pytest.raises(ValueError, match=match):
        jax.jit(tx.update)({"w": jnp.ones(D)}, state, START)
    with pytest.raises(ValueError, match=match):
        ga.optimizer_step(state)


def test_apply_gradients_updates_lookahead_params_as_the_optax_path():
    step = jax.jit(lambda p, s, x, y: ga.apply_gradients(ACCUMULATED, grad(p, x, y), s, p))
    fused, fused_state = START, ACCUMULATED.init(START)
    plain, plain_state = START, ACCUMULATED.init(START)
    x, y = data()
    for j in range(3 * K):  # three windows: the last one's sync is pending
        rows = slice((j % K) * B, (j % K + 1) * B)
        fused, fused_state = step(fused, fused_state, x[j // K][rows], y[j // K][rows])
        plain, plain_state = MICRO_STEP(plain, plain_state, x[j // K][rows], y[j // K][rows])
    assert not np.allclose(plain.slow["w"], plain.fast["w"])
    np.testing.assert_allclose(fused.fast["w"], plain.fast["w"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(fused.slow["w"], plain.slow["w"], rtol=RTOL, atol=ATOL)
