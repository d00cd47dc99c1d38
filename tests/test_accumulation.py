"""Tests of gradaccum_jax.accumulate: equivalence, robustness, composition, programs."""

from __future__ import annotations

import functools
import pathlib

import _equivalence as E
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify

import gradaccum_jax as ga
from benchmarks import harness

# ---------------------------------------------------------------------------
# A small regression problem shared by the equivalence tests.

IN, HIDDEN, OUT = 6, 8, 3
MICRO = 4  # examples per micro-batch


def _init_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) * 0.5,
        "b1": jnp.full((HIDDEN,), 0.1, jnp.float32),
        "w2": jax.random.normal(k2, (HIDDEN, OUT)) * 0.5,
        "b2": jnp.zeros((OUT,)),
    }


def _data(num_examples, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (num_examples, IN))
    y = jax.random.normal(ky, (num_examples, OUT))
    return x, y


def _train_accumulated(tx, params, x, y, micro):
    """Runs one update per micro-batch of size `micro`, in order, inside a scan."""
    xs = x.reshape(-1, micro, IN)
    ys = y.reshape(-1, micro, OUT)

    def body(carry, batch):
        p, s = carry
        g = jax.grad(E.mlp_loss)(p, *batch)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

    (params, state), _ = jax.lax.scan(body, (params, tx.init(params)), (xs, ys))
    return params, state


def _train_large(tx, params, x, y, batch):
    return _train_accumulated(tx, params, x, y, batch)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw_schedule": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6), weight_decay=1e-2
    ),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2),
}
NUM_WINDOWS = 3


# Every optimizer at K = 1 (the static window of one) and K = 4; K = 2 and 7 (odd, longer
# than the others' windows) on the two whose state counts steps. What accumulate does
# between micro-steps does not depend on the inner optimizer beyond its state's tree,
# which K = 4 already carries through three windows.
EQUIVALENCE_CASES = [(name, k) for name in sorted(OPTIMIZERS) for k in (1, 4)] + [
    (name, k) for name in ("adam", "adamw_schedule") for k in (2, 7)
]


@pytest.mark.parametrize("name, k", EQUIVALENCE_CASES)
def test_equals_large_batch(name, k):
    params = _init_params()
    x, y = _data(NUM_WINDOWS * k * MICRO)
    inner = OPTIMIZERS[name]()

    @jax.jit
    def both(params, x, y):  # one program for the two runs (it was one each)
        accumulated = _train_accumulated(ga.accumulate(inner, k), params, x, y, micro=MICRO)
        return accumulated, _train_large(inner, params, x, y, batch=k * MICRO)

    (p_acc, state), (p_big, _) = both(params, x, y)
    assert int(state.gradient_step) == NUM_WINDOWS
    assert int(state.micro_step) == 0
    # float32: the window mean is summed in another order than the large
    # batch's mean, so the two differ by a few ulps per step.
    chex.assert_trees_all_close(p_acc, p_big, rtol=1e-5, atol=1e-6)


@pytest.mark.pure
def test_the_guide_names_the_equivalence_cases():
    # docs/accumulate.md says which optimizers and window lengths the test above checks.
    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "accumulate.md"
    text = " ".join(guide.read_text().split())
    assert (
        "lion, adafactor, lamb and rmsprop at `K ∈ {1, 4}`, and adam and adamw with a "
        "schedule at `K ∈ {2, 7}` too, to `rtol=1e-5`."
    ) in text
    by_k = {k: {n for n, j in EQUIVALENCE_CASES if j == k} for k in (1, 2, 4, 7)}
    assert by_k[1] == by_k[4] == set(OPTIMIZERS)
    assert by_k[2] == by_k[7] == {"adam", "adamw_schedule"}


def test_sum_mode_returns_sum_of_micro_gradients():
    params = _init_params()
    tx = ga.accumulate(optax.sgd(1.0), 3, use_grad_mean=False)
    state = tx.init(params)
    grads = [jax.tree.map(lambda p, i=i: jnp.full_like(p, i + 1.0), params) for i in range(3)]
    update = jax.jit(tx.update)
    for g in grads:
        u, state = update(g, state, params)
    chex.assert_trees_all_close(u, jax.tree.map(lambda p: jnp.full_like(p, -6.0), params))


@pytest.mark.slow
def test_weighted_mean_of_unequal_micro_batches_equals_large_batch_gradient():
    params = _init_params()
    sizes = [1, 3, 5, 7]
    x, y = _data(sum(sizes))
    tx = ga.accumulate(optax.sgd(1.0), len(sizes))
    state = tx.init(params)
    update = jax.jit(tx.update)
    start = 0
    for size in sizes:
        g = jax.grad(E.mlp_loss)(params, x[start : start + size], y[start : start + size])
        u, state = update(g, state, params, weight=size)
        start += size
    expected = jax.tree.map(jnp.negative, jax.grad(E.mlp_loss)(params, x, y))
    chex.assert_trees_all_close(u, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_weighted_adam_over_windows_equals_large_batch():
    params = _init_params()
    sizes = [2, 6, 4]
    x, y = _data(3 * sum(sizes))
    inner = optax.adam(1e-2)
    tx = ga.accumulate(inner, len(sizes))

    @jax.jit
    def run(params):
        state, big_state, big = tx.init(params), inner.init(params), params
        start = 0
        for _ in range(3):
            window_start = start
            for size in sizes:
                sl = slice(start, start + size)
                g = jax.grad(E.mlp_loss)(params, x[sl], y[sl])
                u, state = tx.update(g, state, params, weight=size)
                params = optax.apply_updates(params, u)
                start += size
            sl = slice(window_start, start)
            g = jax.grad(E.mlp_loss)(big, x[sl], y[sl])
            u, big_state = inner.update(g, big_state, big)
            big = optax.apply_updates(big, u)
        return params, big

    p_acc, p_big = run(params)
    chex.assert_trees_all_close(p_acc, p_big, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Non-finite micro-gradients.


@functools.cache
def _two_windows_with_a_bad_micro_gradient():
    """Eight micro-steps of `accumulate(adam, 4)` in one program, with one micro-gradient's
    first entries set to `bad` at micro-step `bad_index`: both are traced, so the twelve
    cases below share one compiled program (they compiled one each when they were baked in).
    """
    k = 4
    tx = ga.accumulate(optax.adam(1e-2), k)
    x, y = _data(2 * k * MICRO)

    @jax.jit
    def run(params, bad_index, bad):
        state = tx.init(params)
        for i in range(2 * k):
            sl = slice(i * MICRO, (i + 1) * MICRO)
            g = jax.grad(E.mlp_loss)(params, x[sl], y[sl])
            g = jax.tree.map(lambda t, i=i: jnp.where(i == bad_index, t.at[0].set(bad), t), g)
            u, state = tx.update(g, state, params)
            if i % k != k - 1:
                # Micro-steps return exact zeros, even for the non-finite one.
                zeros = jax.tree.map(jnp.zeros_like, u)
                u = jax.tree.map(lambda a, z: jnp.where(jnp.all(a == z), a, jnp.nan), u, zeros)
            params = optax.apply_updates(params, u)
        return params, state

    return run, x, y


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("position", [0, 1, 2, 3])
def test_nonfinite_micro_gradient_is_dropped(position, bad):
    k = 4
    params = _init_params()
    inner = optax.adam(1e-2)
    run, x, y = _two_windows_with_a_bad_micro_gradient()
    bad_index = k + position  # a micro-batch of the second window

    p_acc, state = run(params, bad_index, bad)
    # Reference: large batches with the dropped micro-batch removed.
    keep = [i for i in range(2 * k) if i != bad_index]
    windows = [keep[:k], keep[k:]]
    p_ref, s_ref = params, inner.init(params)
    for window in windows:
        idx = np.concatenate([np.arange(i * MICRO, (i + 1) * MICRO) for i in window])
        g = jax.grad(E.mlp_loss)(p_ref, x[idx], y[idx])
        u, s_ref = inner.update(g, s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
    assert int(state.num_skipped) == 1
    assert int(state.gradient_step) == 2
    chex.assert_tree_all_finite((p_acc, state))
    chex.assert_trees_all_close(p_acc, p_ref, rtol=1e-5, atol=1e-6)


def test_window_with_nothing_accepted_applies_no_update():
    params = _init_params()
    inner = optax.adam(1e-2)
    tx = ga.accumulate(inner, 2)
    state = tx.init(params)
    update = jax.jit(tx.update)
    nan_grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
    for _ in range(2):
        u, state = update(nan_grads, state, params)
    chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, params))
    chex.assert_trees_all_equal(state.inner_state, inner.init(params))
    assert int(state.gradient_step) == 0
    assert int(state.num_skipped) == 2
    assert int(state.micro_step) == 0  # the window still closed on schedule
    chex.assert_tree_all_finite(state)


def test_skip_nonfinite_false_adds_non_finite_values():
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(1.0), 2, skip_nonfinite=False)
    state = tx.init(params)
    _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    assert int(state.num_skipped) == 0
    assert np.isnan(state.acc_grads["w"][0])


def test_traced_negative_weight_is_dropped():
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(1.0), 2)
    update = jax.jit(tx.update)
    state = tx.init(params)
    _, state = update({"w": jnp.ones(2)}, state, params, weight=jnp.float32(-1.0))
    u, state = update({"w": jnp.full(2, 3.0)}, state, params, weight=jnp.float32(2.0))
    assert int(state.num_skipped) == 1
    chex.assert_trees_all_close(u, {"w": jnp.full(2, -3.0)})


@pytest.mark.parametrize("weight", [-1.0, np.nan, np.inf])
def test_traced_unusable_weight_is_dropped_without_the_finite_check(weight):
    # skip_nonfinite=False skips the gradient's check, not the weight's: held, a weight of
    # -1 would cancel the next micro-batch's weight and lose it (issue 29).
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(1.0), 3, skip_nonfinite=False)
    update = jax.jit(tx.update)
    state = tx.init(params)
    _, state = update({"w": jnp.ones(2)}, state, params, weight=jnp.float32(weight))
    assert int(state.num_skipped) == 1 and float(state.acc_weight) == 0.0
    _, state = update({"w": jnp.full(2, 3.0)}, state, params, weight=jnp.float32(1.0))
    u, state = update({"w": jnp.full(2, 5.0)}, state, params, weight=jnp.float32(3.0))
    np.testing.assert_array_equal(u["w"], [-4.5, -4.5])
    assert int(state.num_skipped) == 1 and bool(ga.has_updated(state))


# ---------------------------------------------------------------------------
# State: checkpointing, scan, donation, abstract init, dtypes.


def _micro_grads(params, n, seed=3):
    keys = jax.random.split(jax.random.key(seed), n)
    return [jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params) for k in keys]


def test_checkpoint_at_every_micro_step_resumes_bit_identically(tmp_path):
    import orbax.checkpoint as ocp

    k = 3
    params = _init_params()
    tx = ga.accumulate(optax.adam(1e-2), k)
    grads = _micro_grads(params, 2 * k)
    update = jax.jit(tx.update)

    def run(state, p, gs):
        for g in gs:
            u, state = update(g, state, p)
            p = optax.apply_updates(p, u)
        return state, p

    ref_state, ref_params = run(tx.init(params), params, grads)
    checkpointer = ocp.StandardCheckpointer()
    for cut in range(2 * k + 1):
        state, p = run(tx.init(params), params, grads[:cut])
        path = tmp_path / f"cut{cut}"
        checkpointer.save(path, {"state": state, "params": p})
        checkpointer.wait_until_finished()
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"state": state, "params": p})
        restored = checkpointer.restore(path, target)
        restored_state = jax.tree.unflatten(
            jax.tree.structure(state), jax.tree.leaves(restored["state"])
        )
        state, p = run(restored_state, restored["params"], grads[cut:])
        chex.assert_trees_all_equal(p, ref_params)
        chex.assert_trees_all_equal(state, ref_state)
    checkpointer.close()


@pytest.mark.parametrize(
    ("param_dtype", "accumulator_dtype", "expected_acc"),
    [
        (jnp.float32, None, jnp.float32),
        (jnp.bfloat16, None, jnp.float32),
        (jnp.float16, None, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
        (jnp.float32, jnp.bfloat16, jnp.bfloat16),
    ],
)
@pytest.mark.slow
def test_state_dtypes_stable_under_scan(param_dtype, accumulator_dtype, expected_acc):
    params = jax.tree.map(lambda p: p.astype(param_dtype), _init_params())
    tx = ga.accumulate(optax.adam(1e-2), 3, accumulator_dtype=accumulator_dtype)
    state = tx.init(params)
    assert all(a.dtype == expected_acc for a in jax.tree.leaves(state.acc_grads))
    grads = jax.tree.map(lambda p: jnp.stack([p] * 7) * 0.01, params)

    def body(s, g):
        u, s = tx.update(g, s, params)
        return s, u

    final, us = jax.jit(lambda s, g: jax.lax.scan(body, s, g))(state, grads)
    chex.assert_trees_all_equal_shapes_and_dtypes(final, state)
    chex.assert_trees_all_equal_dtypes(jax.tree.map(lambda u: u[0], us), params)
    assert int(final.gradient_step) == 2


def test_eval_shape_init_matches_init():
    params = _init_params()
    tx = ga.accumulate(optax.adam(1e-2), 4)
    abstract = jax.eval_shape(
        tx.init, jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    )
    chex.assert_trees_all_equal_shapes_and_dtypes(abstract, tx.init(params))


def test_init_on_shape_dtype_structs_eagerly_equals_init():
    # As optax's own init: a state built from abstract params, outside jit too.
    params = _init_params()
    tx = ga.accumulate(optax.adam(1e-2), 4)
    eager = tx.init(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params))
    chex.assert_trees_all_equal(eager, tx.init(params), strict=True)


def test_donated_step_matches_undonated():
    params = _init_params()
    tx = ga.accumulate(optax.adam(1e-2), 2)
    grads = _micro_grads(params, 4)

    def step(params, state, g):
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    plain, donated = jax.jit(step), jax.jit(step, donate_argnums=(0, 1))
    p1, s1 = params, tx.init(params)
    p2, s2 = jax.tree.map(jnp.copy, params), tx.init(params)
    for g in grads:
        p1, s1 = plain(p1, s1, g)
        p2, s2 = donated(p2, s2, g)
    chex.assert_trees_all_equal((p1, s1), (p2, s2))


def test_updates_have_gradient_dtype():
    params = {"w": jnp.ones(4, jnp.bfloat16)}
    tx = ga.accumulate(optax.adam(1e-2), 2)
    state = tx.init(params)
    for _ in range(2):
        u, state = jax.jit(tx.update)({"w": jnp.full(4, 0.5, jnp.bfloat16)}, state, params)
        assert u["w"].dtype == jnp.bfloat16


# ---------------------------------------------------------------------------
# Window-length schedules.


@pytest.mark.slow
def test_schedule_changes_window_without_recompiling():
    params = _init_params()
    sizes = [2, 2, 3, 3]  # windows: gradient_step 0, 1 -> K=2; then K=3
    x, y = _data(sum(sizes) * MICRO)
    inner = optax.adam(1e-2)
    tx = ga.accumulate(inner, lambda step: jnp.where(step < 2, 2, 3))
    traces = []

    @jax.jit
    def step(p, s, xb, yb):
        traces.append(1)
        u, s = tx.update(jax.grad(E.mlp_loss)(p, xb, yb), s, p)
        return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    for i in range(sum(sizes)):
        sl = slice(i * MICRO, (i + 1) * MICRO)
        p, s = step(p, s, x[sl], y[sl])
    assert len(traces) == 1
    assert int(s.gradient_step) == 4
    p_ref, s_ref, start = params, inner.init(params), 0
    for size in sizes:
        sl = slice(start * MICRO, (start + size) * MICRO)
        u, s_ref = inner.update(jax.grad(E.mlp_loss)(p_ref, x[sl], y[sl]), s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
        start += size
    chex.assert_trees_all_close(p, p_ref, rtol=1e-5, atol=1e-6)


def test_closes_window_has_updated_and_optimizer_step():
    params = {"w": jnp.zeros(2)}
    tx = optax.chain(optax.clip(1.0), ga.accumulate(optax.sgd(0.1), 3))
    state = tx.init(params)
    assert not bool(ga.has_updated(state))
    closes, updated = [], []
    for _ in range(6):
        closes.append(bool(ga.closes_window(state)))
        _, state = tx.update({"w": jnp.ones(2)}, state, params)
        updated.append(bool(ga.has_updated(state)))
    assert closes == [False, False, True] * 2
    assert updated == closes
    assert int(ga.optimizer_step(state)) == 2


def test_closes_window_refuses_a_repeated_window_length():
    state = ga.accumulate(optax.sgd(0.1), 4).init({"w": jnp.zeros(2)})
    with pytest.raises(TypeError, match=r"window length 3 as well.*closes_window\(opt_state\)"):
        ga.closes_window(state, 3)


def test_closes_window_follows_a_schedule_from_the_state():
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(0.1), lambda step: jnp.where(step < 1, 1, 3))
    step = jax.jit(lambda g, s: tx.update(g, s, params)[1])
    state = tx.init(params)
    closes = []
    for _ in range(7):
        closes.append(bool(ga.closes_window(state)))
        state = step({"w": jnp.ones(2)}, state)
    assert closes == [True, False, False, True, False, False, True]
    assert state.window_length.dtype == jnp.int32 and int(state.window_length) == 3


def test_closes_window_is_exact_when_a_dropped_closing_micro_step_counts():
    # count_skipped_steps=True (the default): the window closes on schedule, dropped or not.
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite)
    update = jax.jit(tx.update)
    state = tx.init(params)
    _, state = update({"w": jnp.ones(2)}, state, params)
    assert bool(ga.closes_window(state))
    u, state = update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    assert int(state.micro_step) == 0 and bool(ga.has_updated(state))
    np.testing.assert_array_equal(u["w"], [-1.0, -1.0])


def test_closes_window_refuses_uncounted_windows_and_has_updated_tells_the_close():
    # count_skipped_steps=False: a dropped micro-step where the window would close leaves it
    # open, so closes_window cannot answer before the call; has_updated after it can.
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(
        optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite, count_skipped_steps=False
    )
    update = jax.jit(tx.update)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"count_skipped_steps=False.*has_updated\(opt_state\)"):
        ga.closes_window(state)
    closed = []
    for g in (1.0, jnp.nan, 3.0, jnp.nan, 5.0, 7.0):
        before = int(state.gradient_step)
        u, state = update({"w": jnp.array([g, 1.0])}, state, params)
        with pytest.raises(ValueError, match="count_skipped_steps=False"):
            ga.closes_window(state)
        assert bool(ga.has_updated(state)) == (int(state.gradient_step) == before + 1)
        closed.append(bool(ga.has_updated(state)))
    assert closed == [False, False, True, False, False, True]
    np.testing.assert_array_equal(u["w"], [-6.0, -1.0])
    # The state's type records the option; its fields are AccumulateState's.
    assert isinstance(state, ga.AccumulateState) and state._fields == ga.AccumulateState._fields


def test_has_updated_is_false_after_a_window_with_everything_dropped():
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(0.1), 2)
    state = tx.init(params)
    for _ in range(2):
        _, state = tx.update({"w": jnp.full(2, jnp.nan)}, state, params)
    assert int(state.micro_step) == 0 and int(state.gradient_step) == 0
    assert not bool(ga.has_updated(state))


# ---------------------------------------------------------------------------
# Composition with optax and flax.


def test_extra_args_reach_inner_reduce_on_plateau():
    params = {"w": jnp.ones(3)}

    def make_inner():
        plateau = optax.contrib.reduce_on_plateau(patience=1, factor=0.5)
        return optax.chain(optax.sgd(1.0), plateau)

    tx = ga.accumulate(make_inner(), 2)
    state = tx.init(params)
    update = jax.jit(tx.update)
    g = {"w": jnp.ones(3)}
    window_values = [3.0, 2.0, 2.5, 2.6, 2.7]
    scales = []
    for value in window_values:
        for micro in range(2):
            # The window's mean value reaches the inner (tests/test_loss_reading.py).
            v = jnp.float32(value + (0.5 if micro == 1 else -0.5))
            _, state = update(g, state, params, value=v)
        scales.append(float(state.inner_state[1].scale))
    ref_tx = make_inner()
    ref_state, ref_scales = ref_tx.init(params), []
    for value in window_values:
        _, ref_state = ref_tx.update(g, ref_state, params, value=jnp.float32(value))
        ref_scales.append(float(ref_state[1].scale))
    assert scales == ref_scales
    assert scales[-1] < 1.0  # the plateau was detected, so the test can tell


def test_inject_hyperparams_as_inner_stays_changeable():
    params = {"w": jnp.ones(3)}
    tx = ga.accumulate(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), 2)
    state = tx.init(params)
    update = jax.jit(tx.update)
    g = {"w": jnp.ones(3)}
    _, state = update(g, state, params)
    u, state = update(g, state, params)
    chex.assert_trees_all_close(u, {"w": jnp.full(3, -0.1)})
    state.inner_state.hyperparams["learning_rate"] = jnp.float32(0.5)
    _, state = update(g, state, params)
    u, state = update(g, state, params)
    chex.assert_trees_all_close(u, {"w": jnp.full(3, -0.5)})


def test_inside_chain_and_masked():
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    mask = {"a": True, "b": False}
    tx = optax.chain(
        optax.clip_by_global_norm(100.0),
        optax.masked(ga.accumulate(optax.sgd(1.0), 2), mask),
    )
    state = tx.init(params)
    update = jax.jit(tx.update)
    g = {"a": jnp.ones(3), "b": jnp.full(2, 7.0)}
    u1, state = update(g, state, params)
    u2, state = update(g, state, params)
    chex.assert_trees_all_close(u1, {"a": jnp.zeros(3), "b": jnp.full(2, 7.0)})
    chex.assert_trees_all_close(u2, {"a": jnp.full(3, -1.0), "b": jnp.full(2, 7.0)})
    assert int(ga.optimizer_step(state)) == 1


def test_flax_train_state_counts_micro_steps_and_matches_large_batch():
    from flax.training import train_state

    k = 3
    params = _init_params()
    x, y = _data(2 * k * MICRO)
    inner = optax.adam(1e-2)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=ga.accumulate(inner, k))

    @jax.jit
    def step(state, xb, yb):
        return state.apply_gradients(grads=jax.grad(E.mlp_loss)(state.params, xb, yb))

    for i in range(2 * k):
        sl = slice(i * MICRO, (i + 1) * MICRO)
        state = step(state, x[sl], y[sl])
    assert int(state.step) == 2 * k  # TrainState counts micro-steps ...
    assert int(ga.optimizer_step(state.opt_state)) == 2  # ... optimizer_step does not.
    p_big, _ = _train_large(inner, params, x, y, k * MICRO)
    chex.assert_trees_all_close(state.params, p_big, rtol=1e-5, atol=1e-6)


def test_nnx_optimizer_matches_large_batch():
    from flax import nnx

    k = 2
    x, y = _data(2 * k * MICRO)

    def make():
        return nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))

    def loss(model, xb, yb):
        return jnp.mean((model(xb) - yb) ** 2)

    inner = optax.adam(1e-2)
    model_acc, model_big = make(), make()
    opt_acc = nnx.Optimizer(model_acc, ga.accumulate(inner, k), wrt=nnx.Param)
    opt_big = nnx.Optimizer(model_big, inner, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, xb, yb):
        optimizer.update(model, nnx.grad(loss)(model, xb, yb))

    for i in range(2 * k):
        step(model_acc, opt_acc, x[i * MICRO : (i + 1) * MICRO], y[i * MICRO : (i + 1) * MICRO])
    for w in range(2):
        sl = slice(w * k * MICRO, (w + 1) * k * MICRO)
        step(model_big, opt_big, x[sl], y[sl])
    chex.assert_trees_all_close(
        nnx.state(model_acc, nnx.Param), nnx.state(model_big, nnx.Param), rtol=1e-5, atol=1e-6
    )


# ---------------------------------------------------------------------------
# Compiled program: gating and memory.


def _micro_step_program(tx, params):
    def step(state, g):
        u, state = tx.update(g, state, params)
        return state, u  # state first: each donated buffer aliases its successor

    grads = jax.tree.map(jnp.ones_like, params)
    return jax.jit(step, donate_argnums=0).lower(tx.init(params), grads).compile()


def _state_copies(compiled, min_elements: int) -> list[str]:
    """Copies of parameter-sized buffers other than freshly broadcast zeros."""
    hlo = harness.Hlo(compiled)
    return [c.line for c in hlo.copies(min_elements) if hlo.source(c) != "broadcast"]


BIG = {"w1": jnp.ones((256, 512)), "b1": jnp.ones(512), "w2": jnp.ones((512, 256))}


@pytest.mark.hlo
def test_inner_optimizer_runs_only_inside_the_conditional():
    hlo = harness.Hlo(_micro_step_program(ga.accumulate(optax.adam(1e-3), 4), BIG))
    every_step = hlo.every_step()
    # adam's denominator sqrt(nu) + eps is the marker of the inner optimizer.
    assert hlo.ops("sqrt", every_step) == []
    assert hlo.ops("sqrt", set(hlo.computations) - every_step)
    assert hlo.ops("conditional", [hlo.entry])


@pytest.mark.hlo
def test_no_copy_of_state_buffers_unlike_multisteps():
    ours = _micro_step_program(ga.accumulate(optax.adam(1e-3), 4), BIG)
    theirs = _micro_step_program(optax.MultiSteps(optax.adam(1e-3), 4), BIG)
    assert _state_copies(ours, 512 * 256) == []
    assert _state_copies(theirs, 512 * 256)  # the check can see a copy


@pytest.mark.hlo
def test_temp_memory_no_more_than_adam_alone():
    def temp_bytes(tx):
        return harness.compiled_memory(_micro_step_program(tx, BIG)).temp_bytes

    ours = temp_bytes(ga.accumulate(optax.adam(1e-3), 4))
    adam = temp_bytes(optax.adam(1e-3))
    multisteps = temp_bytes(optax.MultiSteps(optax.adam(1e-3), 4))
    param_bytes = sum(p.nbytes for p in jax.tree.leaves(BIG))
    assert ours <= adam + 16 * 1024, (ours, adam)
    assert multisteps > param_bytes  # for contrast: MultiSteps keeps a parameter-sized temp


@pytest.mark.hlo
def test_k1_without_the_check_compiles_to_the_inner_optimizer_alone():
    # docs/accumulate.md: with K = 1, skip_nonfinite=False and no weight= the gate's
    # predicate is a constant, which XLA folds: the compiled program has no conditional.
    def compiled(tx):
        def step(state, grads):
            return tx.update(grads, state, BIG)

        grads = jax.tree.map(jnp.ones_like, BIG)
        return jax.jit(step).lower(tx.init(BIG), grads).compile()

    k1 = ga.accumulate(optax.adam(1e-3), 1, skip_nonfinite=False)
    assert harness.Hlo(compiled(k1)).ops("conditional") == []
    traced = jax.make_jaxpr(k1.update)(BIG, k1.init(BIG), BIG)
    assert [e.primitive.name for e in traced.eqns].count("cond") == 1  # folded by XLA
    # The check (or a longer window) keeps a conditional in the compiled program.
    checked = harness.Hlo(compiled(ga.accumulate(optax.adam(1e-3), 1)))
    assert checked.ops("conditional")


# ---------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    ("every_k", "error", "pattern"),
    [
        (0, ValueError, r"every_k_schedule must be an int >= 1; got every_k_schedule=0"),
        (-3, ValueError, r"every_k_schedule=-3"),
        (2.0, TypeError, r"every_k_schedule must be a Python int.*2\.0.*float"),
        (True, TypeError, r"every_k_schedule.*True.*bool"),
        ("4", TypeError, r"every_k_schedule.*'4'"),
    ],
)
def test_bad_every_k_schedule(every_k, error, pattern):
    with pytest.raises(error, match=pattern):
        ga.accumulate(optax.sgd(0.1), every_k)


def test_schedule_returning_float_or_zero():
    params = {"w": jnp.zeros(2)}
    g = {"w": jnp.ones(2)}
    tx = ga.accumulate(optax.sgd(0.1), lambda step: 2.5)
    with pytest.raises(TypeError, match=r"every_k_schedule must return an integer.*2\.5"):
        tx.update(g, tx.init(params), params)
    tx = ga.accumulate(optax.sgd(0.1), lambda step: 0)
    with pytest.raises(ValueError, match=r"window length >= 1; it returned 0"):
        tx.update(g, tx.init(params), params)
    tx = ga.accumulate(optax.sgd(0.1), lambda step: jnp.array([2, 3]))
    with pytest.raises(ValueError, match=r"must return a scalar"):
        tx.update(g, tx.init(params), params)


@pytest.mark.parametrize(
    ("inner", "pattern"),
    [
        (lambda: None, r"inner must be an optax.GradientTransformation.*function"),
        ("adam", r"inner must be.*'adam'"),
        (optax.adam, r"did you mean to call it"),
    ],
)
def test_bad_inner(inner, pattern):
    with pytest.raises(TypeError, match=pattern):
        ga.accumulate(inner, 2)


def test_bad_accumulator_dtype():
    with pytest.raises(TypeError, match=r"accumulator_dtype must be None or a floating.*int32"):
        ga.accumulate(optax.sgd(0.1), 2, accumulator_dtype=jnp.int32)


def test_gradient_tree_mismatch():
    params = {"w": jnp.zeros(2), "b": jnp.zeros(3)}
    tx = ga.accumulate(optax.sgd(0.1), 2)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"updates does not have the structure"):
        tx.update({"w": jnp.zeros(2)}, state, params)
    with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(4,\).*shape \(3,\)"):
        tx.update({"w": jnp.zeros(2), "b": jnp.zeros(4)}, state, params)


def test_integer_gradients_and_params():
    tx = ga.accumulate(optax.sgd(0.1), 2)
    with pytest.raises(
        TypeError, match=r"params must contain floating.*\['n'\].*int32.*optax\.masked"
    ):
        tx.init({"n": jnp.zeros(2, jnp.int32)})
    state = tx.init({"w": jnp.zeros(2)})
    with pytest.raises(TypeError, match=r"updates must contain floating.*\['w'\]"):
        tx.update({"w": jnp.zeros(2, jnp.int32)}, state)


@pytest.mark.parametrize(
    ("weight", "error", "pattern"),
    [
        (-1.0, ValueError, r"weight must be finite and >= 0; got weight=-1\.0"),
        (float("nan"), ValueError, r"weight=nan"),
        (np.ones(3), ValueError, r"weight must be a scalar.*\(3,\)"),
        (True, TypeError, r"weight must be a real scalar.*bool"),
    ],
)
def test_bad_weight(weight, error, pattern):
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(0.1), 2)
    with pytest.raises(error, match=pattern):
        tx.update({"w": jnp.ones(2)}, tx.init(params), params, weight=weight)


def test_optimizer_step_errors():
    with pytest.raises(ValueError, match=r"exactly one AccumulateState.*found 0"):
        ga.optimizer_step(optax.adam(0.1).init({"w": jnp.zeros(2)}))
    # Two windows side by side (each part of the params its own) have no one step count.
    two = optax.multi_transform(
        {"a": ga.accumulate(optax.sgd(0.1), 2), "b": ga.accumulate(optax.sgd(0.1), 2)},
        {"u": "a", "v": "b"},
    )
    with pytest.raises(ValueError, match=r"exactly one AccumulateState.*found 2"):
        ga.optimizer_step(two.init({"u": jnp.zeros(2), "v": jnp.zeros(2)}))
    # Two in a row are refused as such (tests/test_placement.py).
    in_a_row = optax.chain(ga.accumulate(optax.sgd(0.1), 2), ga.accumulate(optax.sgd(0.1), 2))
    with pytest.raises(ValueError, match=r"Two windows in a row"):
        ga.optimizer_step(in_a_row.init({"w": jnp.zeros(2)}))


# ---------------------------------------------------------------------------
# Dtypes: 16-bit params, float32 gradients, complex gradients, Python scalars.

STATEFUL = {
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adam_mu_f32": lambda: optax.adam(1e-3, mu_dtype=jnp.float32),
}


@pytest.mark.parametrize("name", sorted(STATEFUL))
@pytest.mark.parametrize("grad_dtype", [None, jnp.float32])
@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.slow
def test_16_bit_params_keep_state_dtypes_under_scan(name, param_dtype, grad_dtype):
    params = {"w": jnp.linspace(-1, 1, 6, dtype=param_dtype), "b": jnp.ones(3, param_dtype)}
    tx = ga.accumulate(STATEFUL[name](), 2)
    state0 = tx.init(params)
    gdt = grad_dtype or param_dtype
    grads = [jax.tree.map(lambda p, i=i: (p * (i + 1)).astype(gdt), params) for i in range(4)]

    def body(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), u

    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *grads)
    (p_acc, state), us = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))((params, state0), stacked)
    chex.assert_trees_all_equal_shapes_and_dtypes(state, state0)
    # The updates come in the dtype the inner optimizer returns, zeros included.
    u_ref, _ = STATEFUL[name]().update(grads[0], STATEFUL[name]().init(params), params)
    assert jax.tree.map(lambda u: u.dtype, us) == jax.tree.map(lambda u: u.dtype, u_ref)
    # Against the inner optimizer on the windows' mean gradients, in the same dtypes.
    inner = STATEFUL[name]()
    p_ref, s_ref = params, inner.init(params)
    for i in (0, 2):
        mean = jax.tree.map(
            lambda a, b: ((a.astype(jnp.float32) + b) / 2).astype(gdt), grads[i], grads[i + 1]
        )
        u, s_ref = inner.update(mean, s_ref, p_ref)
        s_ref = jax.tree.map(lambda new, old: new.astype(old.dtype), s_ref, inner.init(params))
        p_ref = optax.apply_updates(p_ref, u)
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x.astype(jnp.float32), p_acc),
        jax.tree.map(lambda x: x.astype(jnp.float32), p_ref),
        rtol=1e-2,
        atol=1e-3,
    )


def test_issue_13_adam_on_bf16_params_with_f32_gradients_runs():
    params = {"w": jnp.zeros(3, jnp.bfloat16)}
    tx = ga.accumulate(optax.adam(1e-3), 2)
    state = tx.init(params)
    for _ in range(2):
        u, state = tx.update({"w": jnp.ones(3, jnp.float32)}, state, params)
    assert u["w"].dtype == jnp.float32
    np.testing.assert_allclose(u["w"], -1e-3, rtol=1e-3)
    assert state.inner_state[0].mu["w"].dtype == jnp.bfloat16


def test_inner_state_changing_structure_is_refused_with_the_leaf_path():
    def init(params):
        return {"m": jnp.zeros(2)}

    def update(updates, state, params=None):
        return updates, {"m": jnp.zeros(3)}

    tx = ga.accumulate(optax.GradientTransformation(init, update), 1)
    params = {"w": jnp.zeros(2)}
    with pytest.raises(TypeError, match=r"inner state leaf \['m'\] has shape \(2,\).*\(3,\)"):
        tx.update({"w": jnp.ones(2)}, tx.init(params), params)

    def update_int(updates, state, params=None):
        return updates, {"m": jnp.zeros(2, jnp.int32)}

    tx = ga.accumulate(optax.GradientTransformation(init, update_int), 1)
    with pytest.raises(TypeError, match=r"\['m'\] has dtype float32 after init but int32"):
        tx.update({"w": jnp.ones(2)}, tx.init(params), params)


def test_complex_gradients_keep_their_imaginary_part():
    params = {"w": jnp.zeros(2, jnp.complex64)}
    g = {"w": jnp.array([3 + 4j, 1 - 2j], jnp.complex64)}
    for dtype in (None, jnp.float32, jnp.bfloat16):
        tx = ga.accumulate(optax.sgd(1.0), 2, accumulator_dtype=dtype)
        state = tx.init(params)
        assert state.acc_grads["w"].dtype == jnp.complex64
        _, state = tx.update(g, state, params)
        u, state = tx.update(g, state, params)
        np.testing.assert_allclose(u["w"], -np.array([3 + 4j, 1 - 2j]), rtol=1e-2)
    with pytest.raises(TypeError, match="compensated=True does not support complex"):
        ga.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.bfloat16, compensated=True).init(
            params
        )


def test_python_float_gradient_leaf_is_accepted():
    params = {"w": jnp.zeros([])}
    tx = ga.accumulate(optax.sgd(1.0), 2)
    state = tx.init(params)
    _, state = tx.update({"w": 1.0}, state, params)
    u, state = tx.update({"w": 3.0}, state, params)
    assert float(u["w"]) == -2.0


# ---------------------------------------------------------------------------
# Weights at the edge of the accumulator's range (issue 18, items 3 and 5).


@pytest.mark.parametrize("weight", [4096.0, 70000.0])
@pytest.mark.parametrize("compensated", [False, True])
def test_float16_accumulator_with_large_weights_does_not_overflow(weight, compensated):
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.float16, compensated=compensated)
    state = tx.init(params)
    _, state = tx.update({"w": jnp.full(2, 20.0)}, state, params, weight=weight)
    u, state = jax.jit(tx.update)({"w": jnp.full(2, 20.0)}, state, params, weight=weight)
    np.testing.assert_array_equal(u["w"], [-20.0, -20.0])
    assert int(state.num_skipped) == 0


@pytest.mark.parametrize("compensated", [False, True])
@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_float16_accumulator_with_unequal_weights_does_not_overflow(compensated, use_grad_mean):
    # Held in units of the first weight, 4096 * 20 = 81920 overflowed float16 (issue 29).
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(
        optax.sgd(1.0),
        3,
        accumulator_dtype=jnp.float16,
        compensated=compensated,
        use_grad_mean=use_grad_mean,
    )
    update = jax.jit(tx.update)
    state = tx.init(params)
    for w in (1.0, 4096.0):
        _, state = update({"w": jnp.full(2, 20.0)}, state, params, weight=jnp.float32(w))
        assert np.isfinite(np.asarray(state.acc_grads["w"], np.float32)).all()
        assert float(jnp.max(jnp.abs(state.acc_grads["w"]))) <= 20.0
    u, state = update({"w": jnp.full(2, 20.0)}, state, params, weight=jnp.float32(3.0))
    want = -20.0 if use_grad_mean else -20.0 * 4100
    np.testing.assert_allclose(u["w"], [want, want], rtol=1e-3)


def test_float16_running_mean_matches_a_float32_window():
    # Random weights spanning 1 to 1e4 and signed gradients: the float16 window's mean is
    # the float32 window's within float16 rounding over K additions.
    params = {"w": jnp.zeros(64)}
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(4, 64)).astype(np.float32) * 30
    weights = [1.0, 9000.0, 0.0, 37.0]
    results = []
    for dtype in (jnp.float16, None):
        tx = ga.accumulate(optax.sgd(1.0), 4, accumulator_dtype=dtype)
        state = tx.init(params)
        for g, w in zip(grads, weights, strict=True):
            u, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, state, params, weight=w)
        results.append(np.asarray(u["w"]))
    expected = -(np.asarray(weights)[:, None] * grads).sum(0) / sum(weights)
    np.testing.assert_allclose(results[1], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[0], results[1], rtol=0, atol=4 * 2**-11 * 30 * 4)


def test_huge_weights_times_large_gradients_do_not_overflow_float32():
    params = {"w": jnp.zeros(1)}
    tx = ga.accumulate(optax.sgd(1.0), 2)
    state = tx.init(params)
    _, state = tx.update({"w": jnp.array([1e10])}, state, params, weight=1e30)
    u, state = tx.update({"w": jnp.array([3e10])}, state, params, weight=3e30)
    np.testing.assert_allclose(u["w"], [-2.5e10], rtol=1e-6)


@pytest.mark.parametrize(
    ("weight", "pattern"),
    [
        (1e39, r"weight=1e\+39 is not representable in float32.*inf.*Rescale"),
        (1e-40, r"weight=1e-40 is not representable in float32.*0.*Rescale"),
        ("3", r"weight must be a real scalar \(a Python number or a 0-d array\); got weight='3'"),
    ],
)
def test_weight_outside_float32_or_not_a_number_is_refused(weight, pattern):
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(0.1), 2)
    error = TypeError if isinstance(weight, str) else ValueError
    with pytest.raises(error, match=pattern):
        tx.update({"w": jnp.ones(2)}, tx.init(params), params, weight=weight)


@pytest.mark.parametrize(
    "make",
    [
        lambda d: ga.accumulate(optax.sgd(0.1), 2, accumulator_dtype=d),
        lambda d: ga.conditional_accumulate(optax.sgd(0.1), 2, accumulator_dtype=d),
        lambda d: ga.conditional_accumulator_init({"w": jnp.zeros(2)}, accumulator_dtype=d),
        lambda d: ga.split_accumulate(2, accumulator_dtype=d),
        lambda d: ga.microbatch_value_and_grad(lambda p, b: 0.0, 2, accumulator_dtype=d),
    ],
    ids=["accumulate", "conditional_accumulate", "conditional_init", "split", "microbatch"],
)
def test_bad_accumulator_dtype_string_in_every_transform(make):
    with pytest.raises(TypeError, match=r"accumulator_dtype must be None or a floating.*'foo'"):
        make("foo")


# ---------------------------------------------------------------------------
# optax.MultiSteps' options: should_skip_update_fn, has_updated, counting.


@pytest.mark.parametrize("count_skipped_steps", [True, False])
def test_should_skip_update_fn_with_both_counting_behaviours(count_skipped_steps):
    params = {"a": jnp.zeros([])}
    tx = ga.accumulate(
        optax.sgd(1.0),
        2,
        should_skip_update_fn=optax.skip_not_finite,
        count_skipped_steps=count_skipped_steps,
        skip_nonfinite=False,  # only should_skip_update_fn decides
    )
    update = jax.jit(tx.update)
    state = tx.init(params)
    micro_steps = []
    for g in (1.0, float("inf"), float("nan"), 1.0):
        u, state = update({"a": jnp.asarray(g)}, state, params)
        params = optax.apply_updates(params, u)
        micro_steps.append(int(state.micro_step))
    assert int(state.num_skipped) == 2
    assert int(state.skip_state["num_not_finite"]) == 0  # metrics of the last call
    if count_skipped_steps:
        # The inf closes the first window (only the 1.0 in it), the nan opens the second.
        assert micro_steps == [1, 0, 1, 0]
        assert float(params["a"]) == -2.0
    else:
        # As optax.MultiSteps (its test_multi_steps_skip_not_finite, mini_step):
        # dropped micro-steps do not count toward the window.
        assert micro_steps == [1, 1, 1, 0]
        assert float(params["a"]) == -1.0
        assert bool(ga.has_updated(state))


def test_should_skip_update_fn_large_updates_and_bad_return():
    params = {"a": jnp.zeros(2)}
    skip = functools.partial(optax.skip_large_updates, max_squared_norm=10.0)
    tx = ga.accumulate(optax.sgd(1.0), 1, should_skip_update_fn=skip)
    state = tx.init(params)
    u, state = tx.update({"a": jnp.full(2, 3.0)}, state, params)  # norm² 18 > 10
    np.testing.assert_array_equal(u["a"], [0.0, 0.0])
    assert int(state.num_skipped) == 1 and not bool(ga.has_updated(state))
    bad = ga.accumulate(optax.sgd(1.0), 1, should_skip_update_fn=lambda u, s, p: (1, ()))
    with pytest.raises(TypeError, match=r"should_skip a boolean scalar"):
        bad.init(params)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"should_skip_update_fn": 3}, TypeError, r"should_skip_update_fn must be None or"),
        ({"count_skipped_steps": 1}, TypeError, r"count_skipped_steps must be a bool"),
        (
            {"axis_name": "data", "count_skipped_steps": False},
            ValueError,
            r"count_skipped_steps=False is not supported with axis_name.*Keep",
        ),
        (
            {"axis_name": "data", "should_skip_update_fn": optax.skip_not_finite},
            ValueError,
            r"should_skip_update_fn is not supported with axis_name.*skip_nonfinite",
        ),
    ],
)
def test_skip_option_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        ga.accumulate(optax.sgd(1.0), 2, **kwargs)


# ---------------------------------------------------------------------------
# Traced invalid values: counted, and raised through checkify on request.


def _schedule_zero_after_first(step):
    return jnp.where(step < 1, 1, 0).astype(jnp.int32)


def test_traced_schedule_below_one_is_counted():
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(1.0), _schedule_zero_after_first)
    update = jax.jit(tx.update)
    state = tx.init(params)
    for _ in range(3):
        _, state = update({"w": jnp.ones(2)}, state, params)
    assert int(state.gradient_step) == 3  # taken as K=1
    assert int(state.num_short_windows) == 3


def test_check_values_raises_through_checkify():
    params = {"w": jnp.zeros(2)}
    tx = ga.accumulate(optax.sgd(1.0), _schedule_zero_after_first, check_values=True)
    checked = jax.jit(checkify.checkify(tx.update, errors=checkify.user_checks))
    err, _ = checked({"w": jnp.ones(2)}, tx.init(params), params)
    with pytest.raises(checkify.JaxRuntimeError, match=r"every_k_schedule returned a window"):
        err.throw()
    tx = ga.accumulate(optax.sgd(1.0), 2, check_values=True)
    checked = jax.jit(checkify.checkify(tx.update, errors=checkify.user_checks))
    err, _ = checked({"w": jnp.ones(2)}, tx.init(params), params, weight=jnp.float32(-1.0))
    with pytest.raises(checkify.JaxRuntimeError, match=r"weight must be finite and >= 0"):
        err.throw()
    err, _ = checked({"w": jnp.ones(2)}, tx.init(params), params, weight=jnp.float32(2.0))
    err.throw()  # a valid weight passes


def test_optimizer_step_on_a_state_restored_without_target_names_the_fix():
    tx = ga.accumulate(optax.sgd(0.1), 2)
    state = tx.init({"w": jnp.zeros(2)})
    # What orbax gives back without a target: dicts, the empty fields dropped.
    empty = ("acc_compensation", "skip_state")
    as_dicts = {k: v for k, v in state._asdict().items() if k not in empty}
    with pytest.raises(ValueError, match=r"restored from a checkpoint without a target.*eval_sha"):
        ga.optimizer_step(as_dicts)


WRAPPERS = {
    "accumulate": lambda inner: (ga.accumulate(inner, 2), {}),
    "conditional_accumulate": lambda inner: (
        ga.conditional_accumulate(inner, 2),
        {"local_step": jnp.int32(0)},
    ),
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"sgd"}))
def test_every_stateful_optimizer_on_bf16_params_with_f32_gradients(name, wrapper):
    """jit + scan + donation keep the state's dtypes; the result matches the inner optimizer."""
    params = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.bfloat16).reshape(3, 4)}
    tx, extra = WRAPPERS[wrapper](OPTIMIZERS[name]())
    state0 = tx.init(params)
    grads = jnp.stack([jnp.full((3, 4), 0.5 * (i + 1), jnp.float32) for i in range(4)])

    @functools.partial(jax.jit, donate_argnums=(0,))
    def run(carry, gs):
        def body(carry, g):
            p, s = carry
            local = {"local_step": s.accumulator.global_step} if extra else {}
            u, s = tx.update({"w": g}, s, p, **local)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, carry, gs)[0]

    p_acc, state = run((jax.tree.map(jnp.copy, params), state0), grads)
    chex.assert_trees_all_equal_shapes_and_dtypes(state, tx.init(params))
    inner = OPTIMIZERS[name]()
    p_ref, s_ref = params, inner.init(params)
    for i in (0, 2):
        u, s_ref = inner.update({"w": (grads[i] + grads[i + 1]) / 2}, s_ref, p_ref)
        s_ref = jax.tree.map(lambda new, old: new.astype(old.dtype), s_ref, inner.init(params))
        p_ref = optax.apply_updates(p_ref, u)
    chex.assert_trees_all_close(
        p_acc["w"].astype(jnp.float32), p_ref["w"].astype(jnp.float32), rtol=1e-2, atol=1e-3
    )


@pytest.mark.parametrize(
    "tx",
    [
        ga.accumulate(optax.sgd(0.1), 2, should_skip_update_fn=optax.skip_not_finite),
        ga.conditional_accumulate(optax.sgd(0.1), 2),
        ga.split_accumulate(2),
    ],
    ids=["accumulate", "conditional_accumulate", "split_accumulate"],
)
def test_eagerly_initialised_state_can_be_donated(tx):
    # Counter fields must not share one buffer: donation would reject it.
    state = tx.init({"w": jnp.zeros(2)})
    buffers = [id(x) for x in jax.tree.leaves(state)]
    assert len(buffers) == len(set(buffers))
    jax.jit(lambda s: s, donate_argnums=0)(state)


@pytest.mark.parametrize("use_grad_mean", [False, True])
def test_weighted_float64_window_keeps_float64_precision(use_grad_mean):
    # Found by the property suite: the ratio 0.5 / 3 of the weights was rounded to
    # float32, which left float64 windows 1.5e-8 off.
    if hasattr(jax, "enable_x64"):
        x64 = jax.enable_x64(True)
    else:  # older jax releases of the supported range
        from jax.experimental import enable_x64

        x64 = enable_x64()
    with x64:
        params = {"w": jnp.zeros(3, jnp.float64)}
        tx = ga.accumulate(optax.sgd(1.0), 2, use_grad_mean=use_grad_mean)
        state = tx.init(params)
        assert state.acc_weight.dtype == state.weight_unit.dtype == jnp.float64
        grads = [jnp.full(3, -1.0, jnp.float64), jnp.full(3, 0.7, jnp.float64)]
        for g, w in zip(grads, [3.0, 0.5], strict=True):
            updates, state = jax.jit(tx.update)({"w": g}, state, params, weight=w)
        total = 3.0 * -1.0 + 0.5 * 0.7
        want = -(total / 3.5 if use_grad_mean else total)
        np.testing.assert_allclose(updates["w"], want, rtol=4e-16, atol=0)
        assert state.acc_weight.dtype == jnp.float64


@pytest.mark.parametrize(
    "leaves",
    [
        [np.ones((3, 4)), np.arange(5.0)],
        [np.ones((3, 4)), np.array([1.0, np.nan])],
        [np.array([np.inf, 1.0]), np.ones(2)],
        [np.array([-np.inf])],
        [np.full((2, 2), 3e19), np.ones(3)],  # squares overflow: decided by the exact pass
        # The largest finite floats, alone, in vectors (stacked by the exact pass), in
        # a matrix; and a complex element whose modulus overflows though its parts do not.
        [np.array([3.4e38], np.float32)],
        [np.full((257,), -3.4e38, np.float32), np.ones((2, 3))],
        [np.full((256, 256), 3.4e38, np.float32)],
        [np.full((256, 256), 3.4e38, np.float32), np.array([0.0, np.nan], np.float32)],
        [np.full((3, 3), 3e38 + 3e38j, np.complex64)],
        [np.full((8,), 65504, np.float16), np.array([np.finfo(np.float32).tiny], np.float32)],
        [np.array([3e19, np.nan])],
        [np.zeros((0, 3)), np.ones(2)],
        [],
        [np.array([1.0, 2.0], jnp.bfloat16), np.array([1e30], np.float32)],
        [np.array([1.0, 2.0], jnp.bfloat16), np.array([np.inf], jnp.bfloat16)],
        [np.array([1 + 2j, 3e30 + 0j], np.complex64)],
        [np.array([1 + 1j, complex(np.inf, 0)], np.complex64)],
    ],
)
def test_all_finite_by_squares_answers_as_all_finite(leaves):
    from gradaccum_jax._base import trees

    tree = {f"x{i}": jnp.asarray(leaf) for i, leaf in enumerate(leaves)}
    expected = all(np.isfinite(np.asarray(leaf, np.complex128)).all() for leaf in leaves)
    assert bool(trees.all_finite(tree)) == expected
    assert bool(trees.all_finite_by_squares(tree)) == expected
    assert bool(jax.jit(trees.all_finite_by_squares)(tree)) == expected
