"""Optimizers that read the loss (`value=`) inside `accumulate` (`_window/loss_value.py`).

The window's value is the large batch's loss: the micro-batches' values weighted like their
gradients. A line search, which calls `value_fn` at trial params, is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from gradaccum_jax._base.compat import pcast_to_varying

K, B, D = 4, 8, 3
WINDOWS = 12
RTOL, ATOL = 1e-5, 1e-6  # float32 sums in another order: a few ulps per step


def masked_loss(params, x, y, mask):
    """The mean squared error over the examples where `mask` is 1."""
    err = jnp.square(x @ params["w"] - y)
    return jnp.sum(mask * err) / jnp.sum(mask)


value_and_grad = jax.value_and_grad(masked_loss)


def plateau():
    """SGD whose learning rate halves when the loss stops improving, on every update."""
    return optax.chain(
        optax.sgd(0.05),
        optax.contrib.reduce_on_plateau(patience=1, factor=0.5, accumulation_size=1),
    )


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(WINDOWS, K * B, D)).astype(np.float32)
    noise = 1.5 * rng.normal(size=(WINDOWS, K * B)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32) + noise
    return x, y


def make_step(tx, weighted):
    @jax.jit
    def step(params, state, x, y, mask):
        value, grads = value_and_grad(params, x, y, mask)
        weight = {"weight": jnp.sum(mask)} if weighted else {}
        updates, state = tx.update(grads, state, params, value=value, **weight)
        return optax.apply_updates(params, updates), state, value

    return step


# One program per optimizer, shared by the tests below.
ACCUMULATED = ga.accumulate(plateau(), K)
MICRO_STEP = make_step(ACCUMULATED, weighted=True)
LARGE = plateau()
LARGE_STEP = make_step(LARGE, weighted=False)
PARAMS = {"w": jnp.zeros(D)}


def run(masks):
    """Both runs over the same windows: the large batch and its `K` micro-batches."""
    x, y = data()
    big, big_state, micro, state = PARAMS, LARGE.init(PARAMS), PARAMS, ACCUMULATED.init(PARAMS)
    big_scales, scales, values = [], [], []
    for i in range(WINDOWS):
        mask = masks[i]
        big, big_state, _ = LARGE_STEP(big, big_state, x[i], y[i], mask)
        big_scales.append(float(big_state[1].scale))
        window = []
        for j in range(K):
            rows = slice(j * B, (j + 1) * B)
            micro, state, v = MICRO_STEP(micro, state, x[i][rows], y[i][rows], mask[rows])
            window.append(float(v))
        scales.append(float(state.inner_state[1].scale))
        values.append(window)
    return big, micro, big_scales, scales, values


def test_reduce_on_plateau_reads_the_window_mean_loss():
    masks = np.ones((WINDOWS, K * B), np.float32)
    big, micro, big_scales, scales, values = run(masks)
    # The closing micro-batch's loss is far from the window's (what it received before).
    assert abs(values[0][-1] - np.mean(values[0])) > 1.0
    assert scales == big_scales
    assert min(big_scales) < 1.0  # the plateau was detected, so the test can tell
    np.testing.assert_allclose(micro["w"], big["w"], rtol=RTOL, atol=ATOL)


def test_weighted_window_value_is_the_large_batch_loss():
    # Micro-batches with 8, 3, 5 and 1 real examples: weight= is each one's count.
    counts = np.array([8, 3, 5, 1])
    mask = (np.arange(B)[None, :] < counts[:, None]).astype(np.float32).reshape(-1)
    masks = np.tile(mask, (WINDOWS, 1))
    big, micro, big_scales, scales, values = run(masks)
    weighted = np.dot(values[0], counts) / counts.sum()
    assert abs(weighted - np.mean(values[0])) > 0.1  # an unweighted mean would be off
    assert scales == big_scales
    assert min(big_scales) < 1.0
    np.testing.assert_allclose(micro["w"], big["w"], rtol=RTOL, atol=ATOL)


def test_first_window_value_reaches_the_inner_optimizer():
    x, y = data()
    masks = np.ones((K * B,), np.float32)
    masks[B + 2 :: B] = 0.0  # some examples masked in every micro-batch but the first
    state, params = ACCUMULATED.init(PARAMS), PARAMS
    values, weights = [], []
    for j in range(K):
        rows = slice(j * B, (j + 1) * B)
        xs = x[0][rows].copy()
        if j == 2:
            xs[0, 0] = np.nan  # a non-finite micro-step: dropped, value and gradient
        _, state, v = MICRO_STEP(params, state, xs, y[0][rows], masks[rows])
        values.append(float(v))
        weights.append(float(masks[rows].sum()))
    assert not np.isfinite(values[2])
    kept = [0, 1, 3]
    want = np.dot([values[j] for j in kept], [weights[j] for j in kept]) / sum(
        weights[j] for j in kept
    )
    # reduce_on_plateau keeps the best value seen: after one window, the window's value.
    np.testing.assert_allclose(state.inner_state[1].best_value, want, rtol=RTOL)
    assert int(state.num_skipped) == 1 and int(state.acc_value) == 0


def test_sum_of_values_with_use_grad_mean_false():
    tx = ga.accumulate(optax.contrib.reduce_on_plateau(accumulation_size=1), 2, use_grad_mean=False)
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    g = {"w": jnp.ones(D)}
    for value, weight in ((1.5, 2.0), (4.0, 3.0)):
        _, state = update(g, state, PARAMS, value=jnp.float32(value), weight=jnp.float32(weight))
    # The summed loss, weighted like the summed gradient: 2 * 1.5 + 3 * 4.
    np.testing.assert_allclose(state.inner_state.best_value, 15.0, rtol=1e-6)


def test_momo_reads_the_window_value():
    tx = ga.accumulate(optax.contrib.momo(learning_rate=1.0), 2)
    ref = optax.contrib.momo(learning_rate=1.0)
    params = {"w": jnp.array([1.0, -2.0, 0.5])}
    grads = [{"w": jnp.array([0.5, 1.0, -1.0])}, {"w": jnp.array([1.5, 0.0, 2.0])}]
    state, update = tx.init(params), jax.jit(tx.update)
    for g, value in zip(grads, (3.0, 1.0), strict=True):
        updates, state = update(g, state, params, value=jnp.float32(value))
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
    want, _ = jax.jit(ref.update)(mean, ref.init(params), params, value=jnp.float32(2.0))
    np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-6)


def test_value_is_required_on_every_micro_step():
    state = ACCUMULATED.init(PARAMS)
    with pytest.raises(TypeError, match=r"update got no value=.*every micro-step"):
        ACCUMULATED.update({"w": jnp.ones(D)}, state, PARAMS)
    with pytest.raises(ValueError, match=r"value must be a scalar; got shape \(2,\)"):
        ACCUMULATED.update({"w": jnp.ones(D)}, state, PARAMS, value=jnp.ones(2))


@pytest.mark.parametrize(
    "inner",
    [
        optax.lbfgs(),
        optax.chain(
            optax.sgd(1.0), optax.scale_by_backtracking_linesearch(max_backtracking_steps=4)
        ),
    ],
    ids=["lbfgs", "backtracking"],
)
def test_line_search_is_refused_with_the_whole_batch_named(inner):
    with pytest.raises(ValueError, match=r"line search.*microbatch_value_and_grad.*value_fn"):
        ga.accumulate(inner, K).init(PARAMS)


def test_lbfgs_without_line_search_is_accepted():
    state = ga.accumulate(optax.lbfgs(linesearch=None), K).init(PARAMS)
    assert state.acc_value is None


def test_the_alternative_to_an_accumulated_line_search_is_the_large_batch():
    x, y = data()
    mask = jnp.ones(K * B)
    loss = lambda p, x, y: masked_loss(p, x, y, jnp.ones(x.shape[0]))  # noqa: E731
    grad_fn = ga.microbatch_value_and_grad(loss, K, batch_argnums=(1, 2))
    tx = optax.lbfgs()

    @jax.jit
    def step(params, state, x, y):
        value, grad = grad_fn(params, x, y)
        updates, state = tx.update(
            grad, state, params, value=value, grad=grad, value_fn=lambda p: loss(p, x, y)
        )
        return optax.apply_updates(params, updates), value, grad

    params, value, grad = step(PARAMS, tx.init(PARAMS), x[0], y[0])
    want_value, want_grad = value_and_grad(PARAMS, x[0], y[0], mask)
    np.testing.assert_allclose(value, want_value, rtol=RTOL)
    np.testing.assert_allclose(grad["w"], want_grad["w"], rtol=RTOL, atol=ATOL)
    assert float(loss(params, x[0], y[0])) < float(want_value)


@pytest.mark.parametrize(
    "inner, holds",
    [
        (optax.contrib.momo(), True),
        (optax.contrib.momo_adam(), True),
        (optax.inject_hyperparams(optax.contrib.reduce_on_plateau)(factor=0.5), True),
        (optax.adam(0.1), False),
        # Stateless: not recognised, it receives the closing micro-step's value (docs).
        (optax.polyak_sgd(), False),
    ],
    ids=["momo", "momo_adam", "injected_plateau", "adam", "polyak_sgd"],
)
def test_readers_are_recognised_by_their_state(inner, holds):
    state = ga.accumulate(inner, K).init(PARAMS)
    assert (state.acc_value is not None) == holds


def test_replicas_read_the_loss_of_the_whole_window():
    replicas, steps = 4, 2
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:replicas]), ("data",))
    tx = ga.accumulate(
        optax.contrib.reduce_on_plateau(accumulation_size=1), steps, axis_name="data"
    )
    specs = ga.replica_state_specs(jax.eval_shape(tx.init, PARAMS), "data")
    batch = jax.P("data")

    def body(state, x, y, mask):
        state = ga.remove_replica_axis(state)
        local = pcast_to_varying(PARAMS, "data")  # local gradients
        value, grads = value_and_grad(local, x, y, mask)
        _, state = tx.update(grads, state, PARAMS, value=value, weight=jnp.sum(mask))
        return ga.add_replica_axis(state)

    init = jax.shard_map(
        lambda: ga.add_replica_axis(tx.init(PARAMS)), mesh=mesh, in_specs=(), out_specs=specs
    )
    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, batch, batch, batch), out_specs=specs)
    )
    x, y = data()
    x, y = x[0], y[0]  # 32 examples: 4 replicas x 2 micro-steps x 4 examples
    mask = (np.arange(K * B) % 3 != 0).astype(np.float32)
    mask[:4] = 0.0  # replica 0 has nothing in its first micro-batch
    state = jax.jit(init)()
    for j in range(steps):
        rows = np.concatenate(
            [np.arange(r * 8 + j * 4, r * 8 + j * 4 + 4) for r in range(replicas)]
        )
        state = step(state, x[rows], y[rows], mask[rows])
    want = masked_loss(PARAMS, x, y, mask)
    np.testing.assert_allclose(state.inner_state.best_value, want, rtol=RTOL)
