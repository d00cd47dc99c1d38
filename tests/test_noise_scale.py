"""Tests of accumulate(track_noise_scale=True) and gradient_noise_scale.

The reference is linear regression with Gaussian inputs x ~ N(0, I_d), labels
y = x·(w - δ) + ε with ε ~ N(0, σ²), loss ½(x·w - y)², evaluated at fixed
parameters w (the inner optimizer is sgd(0)). The per-example gradient
x xᵀδ - x ε has mean δ and covariance |δ|² I + δδᵀ + σ² I, so

    |G|² = |δ|²,   tr(Σ) = (d + 1)|δ|² + σ² d,   B_simple = tr(Σ) / |G|².

Single windows are noisy; after a few hundred windows the averages are within
a few per cent, and the tests allow 15 %.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._base.compat import pcast_to_varying

D, SIGMA = 8, 0.5
DELTA = np.random.default_rng(0).normal(size=D).astype(np.float32)
W = jnp.zeros(D, jnp.float32)
DD = float(DELTA @ DELTA)
TRACE = (D + 1) * DD + SIGMA**2 * D
B_SIMPLE = TRACE / DD
RTOL = 0.15


def _grad(w, x, y, mask):
    """Gradient of the masked mean loss: a micro-batch of `mask.sum()` examples."""

    def loss(w):
        return 0.5 * jnp.sum(mask * (x @ w - y) ** 2) / jnp.sum(mask)

    return jax.grad(loss)(w)


def _batch(key, b):
    kx, ke = jax.random.split(key)
    x = jax.random.normal(kx, (b, D))
    y = x @ (W - DELTA) + SIGMA * jax.random.normal(ke, (b,))
    return x, y


def _assert_close_to_closed_form(est, batch_unit):
    """`batch_unit`: examples per unit of b_simple (micro_batch_size, or 1)."""
    np.testing.assert_allclose(float(est.grad_sq_norm), DD, rtol=RTOL)
    np.testing.assert_allclose(float(est.trace_cov), TRACE / batch_unit, rtol=RTOL)
    np.testing.assert_allclose(float(est.b_simple), B_SIMPLE / batch_unit, rtol=RTOL)


@pytest.mark.parametrize("micro_batch_size", [4, None])
@pytest.mark.slow
def test_linear_regression_closed_form(micro_batch_size):
    b, k, windows = 4, 4, 300
    tx = ga.accumulate(optax.sgd(0.0), k, track_noise_scale=True, micro_batch_size=micro_batch_size)

    @jax.jit
    def run(state, key):
        def body(state, key):
            x, y = _batch(key, b)
            _, state = tx.update(_grad(W, x, y, jnp.ones(b)), state, W)
            return state, None

        return jax.lax.scan(body, state, jax.random.split(key, k * windows))[0]

    state = run(tx.init(W), jax.random.key(1))
    _assert_close_to_closed_form(ga.gradient_noise_scale(state), 1 if micro_batch_size else b)


def test_compensated_bfloat16_accumulator_measures_what_float32_measures():
    """`compensated=True` sums the window in two bfloat16 buffers; the estimate is unchanged."""
    b, k, windows = 4, 4, 300
    estimates = []
    for options in ({}, {"accumulator_dtype": jnp.bfloat16, "compensated": True}):
        tx = ga.accumulate(optax.sgd(0.0), k, track_noise_scale=True, **options)

        @jax.jit
        def run(state, key, tx=tx):
            def body(state, key):
                x, y = _batch(key, b)
                _, state = tx.update(_grad(W, x, y, jnp.ones(b)), state, W)
                return state, None

            return jax.lax.scan(body, state, jax.random.split(key, k * windows))[0]

        estimates.append(ga.gradient_noise_scale(run(tx.init(W), jax.random.key(1))))
    # Measured: 1.6e-7 relative at most (a plain bfloat16 accumulator: 1.4e-5).
    np.testing.assert_allclose(np.array(estimates[1]), np.array(estimates[0]), rtol=1e-6)
    _assert_close_to_closed_form(estimates[1], b)


def test_unequal_micro_batches_weighted_by_example_count():
    """Micro-batches of 1 to 8 examples, weight=examples: b_simple is in examples."""
    b_max, k, windows = 8, 4, 300
    tx = ga.accumulate(optax.sgd(0.0), k, track_noise_scale=True)

    @jax.jit
    def run(state, key):
        def body(state, key):
            kb, ks = jax.random.split(key)
            x, y = _batch(kb, b_max)
            size = jax.random.randint(ks, [], 1, b_max + 1)
            mask = (jnp.arange(b_max) < size).astype(jnp.float32)
            g = _grad(W, x, y, mask)
            _, state = tx.update(g, state, W, weight=mask.sum())
            return state, None

        return jax.lax.scan(body, state, jax.random.split(key, k * windows))[0]

    state = run(tx.init(W), jax.random.key(2))
    _assert_close_to_closed_form(ga.gradient_noise_scale(state), 1)


def test_dropped_micro_gradients_are_not_counted():
    """A window [g1, NaN, g2] measures exactly what the window [g1, g2] measures."""
    g1, g2 = jnp.array([1.0, 2.0, 0.0]), jnp.array([3.0, -1.0, 2.0])
    nan = jnp.full(3, jnp.nan)
    results = []
    for k, grads in [(3, [g1, nan, g2]), (2, [g1, g2])]:
        tx = ga.accumulate(optax.sgd(0.0), k, track_noise_scale=True, noise_scale_decay=0.5)
        state = tx.init(jnp.zeros(3))
        update = jax.jit(tx.update)
        for g in grads:
            _, state = update(g, state)
        results.append(ga.gradient_noise_scale(state))
    for got, want in zip(results[0], results[1], strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The hand-computed estimates: S = (5 + 14) / 2, |ḡ|² = |(2, 0.5, 1)|² = 5.25.
    np.testing.assert_allclose(float(results[1].grad_sq_norm), 2 * 5.25 - 9.5, rtol=1e-6)
    np.testing.assert_allclose(float(results[1].trace_cov), (9.5 - 5.25) * 2, rtol=1e-6)


def test_nan_until_a_window_with_two_micro_gradients_closes():
    tx = ga.accumulate(
        optax.sgd(0.0),
        lambda step: jnp.where(step < 1, 1, 2).astype(jnp.int32),
        track_noise_scale=True,
    )
    state = tx.init(jnp.zeros(2))
    assert all(np.isnan(np.asarray(v)) for v in ga.gradient_noise_scale(state))
    _, state = tx.update(jnp.ones(2), state)  # a window of K = 1: no estimate
    assert all(np.isnan(np.asarray(v)) for v in ga.gradient_noise_scale(state))
    _, state = tx.update(jnp.ones(2), state)
    _, state = tx.update(jnp.array([1.0, 3.0]), state)
    assert np.isfinite(float(ga.gradient_noise_scale(state).grad_sq_norm))
    assert ga.gradient_noise_scale(state).b_simple.dtype == jnp.float32


def test_found_anywhere_in_a_chain():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), ga.accumulate(optax.adam(1e-3), 2, track_noise_scale=True)
    )
    state = tx.init(jnp.zeros(2))
    assert ga.gradient_noise_scale(state).b_simple.shape == ()


@pytest.mark.hlo
def test_off_by_default_state_and_program_unchanged():
    inner = optax.adam(1e-3)
    params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)}
    grads = jax.tree.map(jnp.ones_like, params)
    default, off, on = (
        ga.accumulate(inner, 4),
        ga.accumulate(inner, 4, track_noise_scale=False),
        ga.accumulate(inner, 4, track_noise_scale=True),
    )
    state = default.init(params)
    assert state.noise_scale is None
    # The same pytree as a state that has no noise-scale field at all.
    assert jax.tree.structure(state) == jax.tree.structure(ga.AccumulateState(*state[:-1]))

    def hlo(tx):
        text = jax.jit(tx.update).lower(grads, tx.init(params), params).compile().as_text()
        # Source locations (metadata and the debug tables after the program)
        # differ with the call site; the program must not.
        text = text.split("\nFileNames")[0]
        return re.sub(r",? metadata=\{[^}]*\}", "", text)

    assert hlo(default) == hlo(off)
    assert hlo(on) != hlo(off)
    assert len(jax.tree.leaves(on.init(params))) == len(jax.tree.leaves(state)) + 5


def test_errors():
    with pytest.raises(ValueError, match=r"every_k_schedule=1.*K >= 2"):
        ga.accumulate(optax.sgd(0.1), 1, track_noise_scale=True)
    with pytest.raises(ValueError, match="noise_scale_decay"):
        ga.accumulate(optax.sgd(0.1), 2, track_noise_scale=True, noise_scale_decay=1.0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        ga.accumulate(optax.sgd(0.1), 2, track_noise_scale=True, micro_batch_size=0)
    with pytest.raises(TypeError, match="track_noise_scale"):
        ga.accumulate(optax.sgd(0.1), 2, track_noise_scale="yes")
    tx = ga.accumulate(optax.sgd(0.1), 2, track_noise_scale=True, micro_batch_size=4)
    with pytest.raises(ValueError, match=r"weight=.*micro_batch_size=4"):
        tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), weight=3.0)
    untracked = ga.accumulate(optax.sgd(0.1), 2)
    with pytest.raises(ValueError, match="track_noise_scale=True"):
        ga.gradient_noise_scale(untracked.init(jnp.zeros(2)))


# --- across 8 replicas ---------------------------------------------------------------------

R = len(jax.devices())
MESH = jax.make_mesh((R,), ("data",))


def _shard_map_step(tx, scan: bool):
    specs = ga.replica_state_specs(jax.eval_shape(tx.init, W), "data")
    # Fields replica_state_specs leaves unmapped (the engine's newer counters) are
    # replicated.
    specs = jax.tree.map(
        lambda s: s if isinstance(s, P) else P(), specs, is_leaf=lambda s: isinstance(s, P)
    )

    def micro_step(state, x, y):
        varying = pcast_to_varying(W, "data")
        g = _grad(varying, x, y, jnp.ones(x.shape[0]))
        return tx.update(g, state, W)[1]

    def body(state, xs, ys):
        state = ga.remove_replica_axis(state)
        if scan:
            state = jax.lax.scan(lambda s, xy: (micro_step(s, *xy), None), state, (xs, ys))[0]
        else:
            state = micro_step(state, xs, ys)
        return ga.add_replica_axis(state)

    batch = P(None, "data") if scan else P("data")
    init = jax.shard_map(
        lambda p: ga.add_replica_axis(tx.init(p)), mesh=MESH, in_specs=P(), out_specs=specs
    )
    step = jax.shard_map(body, mesh=MESH, in_specs=(specs, batch, batch), out_specs=specs)
    return jax.jit(init), jax.jit(step)


@pytest.mark.slow
@pytest.mark.hlo
def test_closed_form_across_replicas_with_one_all_reduce_per_window():
    b, k, windows = 2, 2, 300
    tx = ga.accumulate(optax.sgd(0.0), k, track_noise_scale=True, axis_name="data")
    init, run = _shard_map_step(tx, scan=True)
    x, y = jax.vmap(lambda key: _batch(key, R * b))(
        jax.random.split(jax.random.key(3), k * windows)
    )
    scanned = NamedSharding(MESH, P(None, "data"))
    state = run(init(W), jax.device_put(x, scanned), jax.device_put(y, scanned))
    # Every replica holds the same averages; read replica 0's.
    noise = jax.tree.map(lambda a: np.asarray(a), state.noise_scale)
    np.testing.assert_array_equal(noise.ema_trace_cov, noise.ema_trace_cov[0])
    est = ga.gradient_noise_scale(jax.tree.map(lambda a: a[0], noise))
    _assert_close_to_closed_form(est, b)  # b_simple in micro-batches of b examples

    _, step = _shard_map_step(tx, scan=False)
    batch = NamedSharding(MESH, P("data"))
    hlo = step.lower(init(W), jax.device_put(x[0], batch), jax.device_put(y[0], batch))
    program = harness.Hlo(hlo.compile())
    every_step = program.every_step()
    assert program.ops("all-reduce", every_step) == []
    branches = [
        program.ops("all-reduce", program.reachable([branch]))
        for branches in program.conditionals(every_step)
        for branch in branches
    ]
    boundary = [ops for ops in branches if ops]
    assert len(boundary) == 1
    # One all-reduce: the gradient sum, the window weight and the two noise-scale sums.
    assert len(boundary[0]) == 1, boundary[0]
    assert boundary[0][0].elements == D + 1 + 2


def test_finite_gradients_whose_square_overflows_are_accepted():
    """The finiteness test reuses |g|²; a finite |g|² = inf must not drop the gradient."""
    tx = ga.accumulate(optax.sgd(0.0), 2, track_noise_scale=True)
    state = tx.init(jnp.zeros(2))
    update = jax.jit(tx.update)
    for g in ([1e20, 0.0], [jnp.nan, 0.0], [1.0, 0.0]):
        _, state = update(jnp.array(g), state)
    assert int(state.num_skipped) == 1  # only the NaN
    assert int(ga.optimizer_step(state)) == 1
    # No window had two accepted micro-gradients: no estimate, and nothing poisoned.
    assert np.isnan(float(ga.gradient_noise_scale(state).b_simple))
    assert float(state.noise_scale.ema_normalizer) == 0.0


# --- critical_batch_schedule -------------------------------------------------------------


def test_schedule_next_k_rules():
    sched = ga.critical_batch_schedule(2, 32, warmup_steps=3, max_change=2.0)

    def nxt(step, k, b_simple):
        noise = ga.GradientNoiseScale(jnp.float32(b_simple), jnp.float32(1), jnp.float32(1))
        return int(sched.next_k(jnp.int32(step), jnp.int32(k), noise))

    assert int(sched(jnp.int32(0))) == 2
    assert nxt(1, 2, 20.0) == 2  # warm-up
    assert nxt(5, 4, 20.0) == 8  # growth capped at 2x
    assert nxt(5, 16, 20.0) == 20
    assert nxt(5, 16, 3.0) == 8  # shrink capped at 1/2
    assert nxt(5, 30, 1e6) == 32  # max_k
    assert nxt(5, 3, 0.1) == 2  # min_k
    assert nxt(5, 6, float("nan")) == 6  # no estimate: keep
    sched4 = ga.critical_batch_schedule(2, 32, batch_per_micro_step=4.0, max_change=10.0)
    noise = ga.GradientNoiseScale(jnp.float32(40.0), jnp.float32(1), jnp.float32(1))
    assert int(sched4.next_k(jnp.int32(9), jnp.int32(4), noise)) == 10


def test_schedule_moves_small_k_and_reads_negative_estimates():
    sched = ga.critical_batch_schedule(2, 32, max_change=1.25)

    def nxt(k, b_simple, grad_sq=1.0, trace=1.0):
        noise = ga.GradientNoiseScale(*map(jnp.float32, (b_simple, grad_sq, trace)))
        return int(sched.next_k(jnp.int32(7), jnp.int32(k), noise))

    # 2 x 1.25 = 2.5 rounds to 2: K moves by at least one, or it never leaves 2.
    assert nxt(2, 10.0) == 3
    assert nxt(3, 10.0) == 4
    assert nxt(8, 10.0) == 10  # within the factor: the target itself
    assert nxt(3, 1.0) == 2
    assert nxt(5, 5.0) == 5  # on target: stays
    # An averaged |G|² <= 0 under a positive trace: the noise swamps the
    # gradient, B_simple is beyond measure, so K grows (by the cap).
    assert nxt(8, -40.0, grad_sq=-0.5, trace=20.0) == 10
    assert nxt(8, float("inf"), grad_sq=0.0, trace=20.0) == 10
    # A non-positive trace is no usable estimate: K stays.
    assert nxt(8, -40.0, grad_sq=0.5, trace=-20.0) == 8
    assert nxt(8, 40.0, grad_sq=-0.5, trace=-20.0) == 8


def test_schedule_follows_the_noise_scale_with_exact_windows():
    """At fixed params b_simple ≈ 9.6 micro-batches of one example: K settles near 10."""
    sched = ga.critical_batch_schedule(2, 64, warmup_steps=20, max_change=1.5)
    tx = ga.accumulate(optax.sgd(0.0), sched, track_noise_scale=True, noise_scale_decay=0.95)

    @jax.jit
    def run(state, key):
        def body(state, key):
            x, y = _batch(key, 1)
            _, state = tx.update(_grad(W, x, y, jnp.ones(1)), state, W)
            return state, (state.window_length, state.micro_step)

        return jax.lax.scan(body, state, jax.random.split(key, 3000))

    _, (lengths, micro) = run(tx.init(W), jax.random.key(4))
    lengths, micro = np.asarray(lengths), np.asarray(micro)
    assert lengths[0] == 2
    # Every window ran exactly its length: the micro-step count restarts at K.
    closes = np.flatnonzero(micro == 0)
    starts = np.concatenate([[-1], closes[:-1]])
    np.testing.assert_array_equal(closes - starts, np.concatenate([[2], lengths[closes[:-1]]]))
    # K never changes by more than 1.5x per window.
    ks = lengths[closes]
    assert np.all(ks[1:] <= np.ceil(1.5 * ks[:-1])) and np.all(ks[1:] >= np.floor(ks[:-1] / 1.5))
    np.testing.assert_allclose(np.median(ks[-20:]), B_SIMPLE, rtol=0.35)


def test_schedule_needs_tracking_and_valid_bounds():
    with pytest.raises(ValueError, match="track_noise_scale=True"):
        ga.accumulate(optax.sgd(0.1), ga.critical_batch_schedule(2, 8))
    with pytest.raises(ValueError, match="min_k"):
        ga.critical_batch_schedule(1, 8)
    with pytest.raises(ValueError, match="max_k"):
        ga.critical_batch_schedule(4, 3)
    with pytest.raises(ValueError, match="max_change"):
        ga.critical_batch_schedule(2, 8, max_change=1.0)
