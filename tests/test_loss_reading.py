"""Optimizers that read the loss (`value=`) inside a window (`_window/loss_value.py`).

`accumulate` and `conditional_accumulate` give the inner optimizer the large batch's loss:
the micro-batches' values reduced like their gradients. A line search, which calls
`value_fn` at trial params, is refused.
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


def make_step(tx, weighted, fresh=False):
    @jax.jit
    def step(params, state, x, y, mask):
        value, grads = value_and_grad(params, x, y, mask)
        extra = {"weight": jnp.sum(mask)} if weighted else {}
        if fresh:  # conditional_accumulate: the gradient is taken at the current step
            extra["local_step"] = state.accumulator.global_step
        updates, state = tx.update(grads, state, params, value=value, **extra)
        return optax.apply_updates(params, updates), state, value

    return step


# One program per optimizer, shared by the tests below.
ACCUMULATED = ga.accumulate(plateau(), K)
MICRO_STEP = make_step(ACCUMULATED, weighted=True)
LARGE = plateau()
LARGE_STEP = make_step(LARGE, weighted=False)
PARAMS = {"w": jnp.zeros(D)}


def run(masks, tx=ACCUMULATED, micro_step=MICRO_STEP):
    """Both runs over the same windows: the large batch and its `K` micro-batches."""
    x, y = data()
    big, big_state, micro, state = PARAMS, LARGE.init(PARAMS), PARAMS, tx.init(PARAMS)
    big_scales, scales, values = [], [], []
    for i in range(WINDOWS):
        mask = masks[i]
        big, big_state, _ = LARGE_STEP(big, big_state, x[i], y[i], mask)
        big_scales.append(float(big_state[1].scale))
        window = []
        for j in range(K):
            rows = slice(j * B, (j + 1) * B)
            micro, state, v = micro_step(micro, state, x[i][rows], y[i][rows], mask[rows])
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
        # Stateless readers: recognised by what their update reads.
        (optax.polyak_sgd(), True),
        (optax.inject_hyperparams(optax.polyak_sgd)(max_learning_rate=0.5), True),
        (optax.chain(optax.adam(0.1), optax.scale_by_polyak()), True),
        (optax.lbfgs(linesearch=None), False),
    ],
    ids=[
        "momo",
        "momo_adam",
        "injected_plateau",
        "adam",
        "polyak_sgd",
        "injected_polyak",
        "adam_then_polyak",
        "lbfgs_no_search",
    ],
)
def test_readers_are_recognised(inner, holds):
    state = ga.accumulate(inner, K).init(PARAMS)
    assert (state.acc_value is not None) == holds
    state = ga.conditional_accumulate(inner, K).init(PARAMS)
    assert (state.accumulator.acc_value is not None) == holds


def _reads_extra(value_key):
    """A stateless element of the user's that scales the updates by an extra argument."""

    def update(updates, state, params=None, **extra_args):
        return jax.tree.map(lambda u: u * extra_args[value_key], updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def test_a_reader_of_the_users_own_is_recognised():
    state = ga.accumulate(optax.chain(optax.sgd(0.1), _reads_extra("value")), K).init(PARAMS)
    assert state.acc_value is not None


def test_an_inner_that_needs_other_extra_arguments_is_recognised_by_its_state_only():
    # Its update cannot run on value= alone, so what it reads is not known at init.
    needs_temperature = optax.chain(optax.sgd(0.1), _reads_extra("temperature"))
    assert ga.accumulate(needs_temperature, K).init(PARAMS).acc_value is None
    with_plateau = optax.chain(needs_temperature, optax.contrib.reduce_on_plateau())
    assert ga.accumulate(with_plateau, K).init(PARAMS).acc_value is not None


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


# --- conditional_accumulate ---------------------------------------------------------------

CONDITIONAL = ga.conditional_accumulate(plateau(), K)
CONDITIONAL_STEP = make_step(CONDITIONAL, weighted=False, fresh=True)


def test_conditional_reduce_on_plateau_reads_the_window_mean_loss():
    masks = np.ones((WINDOWS, K * B), np.float32)
    big, micro, big_scales, scales, values = run(masks, CONDITIONAL, CONDITIONAL_STEP)
    assert abs(values[0][-1] - np.mean(values[0])) > 1.0
    assert scales == big_scales
    assert min(big_scales) < 1.0
    np.testing.assert_allclose(micro["w"], big["w"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("reduction, want", [("mean", (3.0 + 0.5 * 1.0) / 2), ("sum", 3.5)])
def test_conditional_value_is_reduced_like_the_gradient(reduction, want):
    # Staleness weights 1 / (1 + tau): the value of the function whose gradient is taken.
    tx = ga.conditional_accumulate(
        optax.contrib.reduce_on_plateau(accumulation_size=1),
        2,
        reduction=reduction,
        max_staleness=1,
        staleness_weight=lambda tau: 1.0 / (1.0 + tau),
    )
    state = ga.conditional_set_global_step(tx.init(PARAMS), 2)
    update = jax.jit(tx.update)
    g = {"w": jnp.ones(D)}
    for local_step, value in ((2, 3.0), (0, 100.0), (1, 1.0)):  # the second is stale: dropped
        _, state = update(g, state, PARAMS, local_step=local_step, value=jnp.float32(value))
    assert int(state.accumulator.num_stale) == 1 and int(state.accumulator.global_step) == 3
    np.testing.assert_allclose(state.inner_state.best_value, want, rtol=1e-6)
    assert float(state.accumulator.acc_value) == 0.0


def test_conditional_drops_a_non_finite_value_with_its_gradient():
    tx = ga.conditional_accumulate(optax.contrib.reduce_on_plateau(accumulation_size=1), 2)
    state, update, g = tx.init(PARAMS), jax.jit(tx.update), {"w": jnp.ones(D)}
    for value in (3.0, np.nan, 1.0):
        _, state = update(g, state, PARAMS, local_step=0, value=jnp.float32(value))
    assert int(state.accumulator.num_skipped) == 1
    np.testing.assert_allclose(state.inner_state.best_value, 2.0, rtol=1e-6)


def test_conditional_pure_functions_carry_the_value():
    tx = ga.conditional_accumulate(optax.contrib.reduce_on_plateau(accumulation_size=1), 2)
    g = {"w": jnp.ones(D)}
    state = tx.init(PARAMS)
    with pytest.raises(TypeError, match=r"conditional_apply_grad got no value=.*every micro"):
        ga.conditional_apply_grad(state, g, 0)
    with pytest.raises(TypeError, match=r"got value=.*holds no sum of values"):
        ga.conditional_apply_grad(ga.conditional_accumulator_init(PARAMS), g, 0, value=1.0)
    apply = jax.jit(lambda s, step, v: ga.conditional_apply_grad(s, g, step, value=v))
    state = apply(state, 0, jnp.float32(3.0))
    _, state = jax.jit(tx.update)(g, state, PARAMS, local_step=0, value=jnp.float32(1.0))
    np.testing.assert_allclose(state.inner_state.best_value, 2.0, rtol=1e-6)
    state = apply(apply(state, 1, jnp.float32(5.0)), 1, jnp.float32(7.0))
    np.testing.assert_allclose(state.accumulator.acc_value, 12.0, rtol=1e-6)
    _, ready, state = jax.jit(ga.conditional_take_grad, static_argnums=1)(state, 2)
    assert bool(ready) and float(state.accumulator.acc_value) == 0.0


def test_conditional_value_is_required_on_every_micro_step():
    state = CONDITIONAL.init(PARAMS)
    with pytest.raises(TypeError, match=r"update got no value=.*every micro-step"):
        CONDITIONAL.update({"w": jnp.ones(D)}, state, PARAMS, local_step=0)


def test_conditional_refuses_a_line_search():
    with pytest.raises(ValueError, match=r"line search.*conditional_accumulate.*value_fn"):
        ga.conditional_accumulate(optax.lbfgs(), K).init(PARAMS)


# --- polyak_sgd: a reader without state ---------------------------------------------------


def polyak():
    # Steps of 0.34, 0.51, 1 (the cap), 0.52 over the first windows of the large batch.
    return optax.polyak_sgd(max_learning_rate=1.0, f_min=1.0)


@pytest.mark.parametrize("window", ["accumulate", "conditional_accumulate"])
def test_polyak_reads_the_window_mean_loss_and_gradient(window):
    if window == "accumulate":
        tx = ga.accumulate(polyak(), K)
        step = make_step(tx, weighted=True)
    else:
        tx = ga.conditional_accumulate(polyak(), K)
        step = make_step(tx, weighted=False, fresh=True)
    large = polyak()
    large_step = make_step(large, weighted=False)
    x, y = data()
    mask = jnp.ones(K * B)
    big, big_state, micro, state = PARAMS, large.init(PARAMS), PARAMS, tx.init(PARAMS)
    for i in range(4):
        big, big_state, _ = large_step(big, big_state, x[i], y[i], mask)
        values = []
        for j in range(K):
            rows = slice(j * B, (j + 1) * B)
            micro, state, v = step(micro, state, x[i][rows], y[i][rows], mask[rows])
            values.append(float(v))
        if i == 0:  # the closing micro-step's value would give a step of 0.45, not 0.34
            assert abs(values[-1] - np.mean(values)) > 1.0
        np.testing.assert_allclose(micro["w"], big["w"], rtol=RTOL, atol=ATOL)


def test_polyak_without_value_on_a_micro_step_is_refused():
    # A MultiSteps habit: the loss passed only where the window closes, in a Python loop.
    tx = ga.accumulate(polyak(), 2)
    state, g = tx.init(PARAMS), {"w": jnp.ones(D)}
    with pytest.raises(TypeError, match=r"update got no value=.*every micro-step"):
        tx.update(g, state, PARAMS)
    _, state = tx.update(g, state, PARAMS, value=jnp.float32(3.0))
    with pytest.raises(TypeError, match=r"update got no value=.*every micro-step"):
        tx.update(g, state, PARAMS)


# --- after a window: split_accumulate has no inner optimizer ---------------------------------


@pytest.mark.parametrize(
    "window, extra, fix",
    [
        (ga.split_accumulate(2), {}, r"in place of split_accumulate"),
        (ga.accumulate(optax.sgd(1.0), 2), {}, r"ga\.accumulate\(optax\.chain"),
        (ga.conditional_accumulate(optax.sgd(1.0), 2), {"local_step": 0}, r"conditional_acc"),
    ],
    ids=["split", "accumulate", "conditional"],
)
def test_a_loss_reader_after_a_window_is_refused(window, extra, fix):
    # It would read each micro-step's value, and the closing one's beside the window's update.
    tx = optax.chain(window, optax.polyak_sgd())
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"reads the loss \(value=\).*comes after.*" + fix):
        tx.update({"w": jnp.ones(D)}, state, PARAMS, value=jnp.float32(1.0), **extra)


def test_a_loss_reader_before_split_reads_each_micro_steps_value():
    # split_accumulate takes no extra arguments; what is before it runs on every micro-step.
    tx = optax.chain(polyak(), ga.split_accumulate(2))
    state, params = tx.init(PARAMS), {"w": jnp.array([0.5, -1.0, 2.0])}
    grads = [{"w": jnp.array([1.0, 2.0, -1.0])}, {"w": jnp.array([0.5, -0.5, 3.0])}]
    want = 0.0
    for g, value in zip(grads, (2.0, 4.0), strict=True):
        u, state = tx.update(g, state, params, value=jnp.float32(value))
        step, _ = polyak().update(g, polyak().init(params), params, value=jnp.float32(value))
        want = want + step["w"]
    np.testing.assert_allclose(u["w"], want, rtol=1e-6)
