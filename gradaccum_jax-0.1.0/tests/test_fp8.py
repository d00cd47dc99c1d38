"""`gradaccum_jax.flax.TrainState` with Flax fp8 metadata across the calls of a window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _fp8_common import META, Mlp, assert_metadata_equal, batch, loss_fn, warm_variables

import gradaccum_jax as ga
from gradaccum_jax.flax import TrainState

K = 4
FORWARD = ("input_amax_history", "input_scale", "kernel_amax_history", "kernel_scale")


def _windows(tx, loss, share, windows=2):
    """Two windows of K calls with TrainState, and one large-batch step per window in Flax's way."""
    model = Mlp()
    variables = warm_variables(model)
    state = TrainState.create(apply_fn=None, params=variables, tx=tx)
    big = {"params": variables["params"], META: variables[META]}
    inner = optax.sgd(0.1)
    inner_state = inner.init(big["params"])

    @jax.jit
    def call(state, data):
        grads = jax.grad(lambda v, d: share * loss(v, d))(state.params, data)
        return state.apply_gradients(grads=grads)

    seen = []
    for window in range(windows):
        x, y = batch(window)
        for i in range(K):
            before = state.params[META]
            state = call(state, (x[i::K], y[i::K]))
            if i < K - 1:  # held fixed inside the window
                assert_metadata_equal(state.params[META], before)
        grads = jax.grad(loss)(big, (x, y))
        updates, inner_state = inner.update(grads["params"], inner_state)
        big = {"params": optax.apply_updates(big["params"], updates), META: grads[META]}
        seen.append((state.params, big))
    return seen


def test_metadata_are_held_and_written_at_the_close():
    # A plain mean window: each call differentiates its own mean loss. The forward
    # metadata written at the close are the large batch's; the output-gradient amax
    # is the max of the calls' own (their backward's units, K times the large batch's).
    model = Mlp()
    loss = loss_fn(model)
    ((ours, big),) = _windows(ga.accumulate(optax.sgd(0.1), K), loss, 1.0, windows=1)
    held, (x, y) = warm_variables(model), batch(0)
    calls = [jax.grad(loss)(held, (x[i::K], y[i::K]))[META] for i in range(K)]
    for layer in ("Dense_0", "Dense_1"):
        got = ours[META][layer]["Fp8DirectDotGeneralOp_0"]
        want = big[META][layer]["Fp8DirectDotGeneralOp_0"]
        assert_metadata_equal({n: got[n] for n in FORWARD}, {n: want[n] for n in FORWARD})
        per_call = [c[layer]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"] for c in calls]
        assert_metadata_equal(got["output_grad_amax_history"], jnp.max(jnp.stack(per_call), 0))
        assert float(got["output_grad_amax_history"][0]) > float(
            want["output_grad_amax_history"][0]
        )


def test_seeded_calls_with_a_summed_window_are_exact():
    # Each call differentiates its share of the window's loss (1/K) and the window
    # sums: every cotangent is the large batch's, the output-gradient amax too.
    loss = loss_fn(Mlp())
    tx = ga.accumulate(optax.sgd(0.1), K, use_grad_mean=False)
    for window, (ours, big) in enumerate(_windows(tx, loss, 1.0 / K)):
        # The first window starts from the same params: its metadata are equal bit for
        # bit. Later windows start from params equal to round-off (sums in another
        # order), and so do the amaxes of the activations they produce.
        assert_metadata_equal(ours[META], big[META], rtol=0.0 if window == 0 else 1e-5)
        for a, b in zip(
            jax.tree.leaves(ours["params"]), jax.tree.leaves(big["params"]), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_without_accumulate_the_metadata_are_overwritten_as_in_flax():
    model = Mlp()
    variables = warm_variables(model)
    grads = jax.grad(loss_fn(model))(variables, batch())
    state = TrainState.create(apply_fn=None, params=variables, tx=optax.sgd(0.1))
    state = state.apply_gradients(grads=grads)
    assert_metadata_equal(state.params[META], grads[META])


def test_running_max_is_scan_stable():
    variables = {"params": {"w": jnp.ones(2)}, META: {"amax": jnp.zeros(3)}}
    state = TrainState.create(apply_fn=None, params=variables, tx=ga.accumulate(optax.sgd(1.0), 2))

    def body(state, amax):
        grads = {"params": {"w": jnp.ones(2)}, META: {"amax": amax}}
        return state.apply_gradients(grads=grads), state.params[META]["amax"]

    amaxes = jnp.array([[1.0, 5.0, 2.0], [3.0, 1.0, 2.0], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])
    state, held = jax.lax.scan(body, state, amaxes)
    # Held through each window; the window's max written at its close.
    np.testing.assert_array_equal(held, [[0, 0, 0], [0, 0, 0], [3, 5, 2], [3, 5, 2]])
    np.testing.assert_array_equal(state.params[META]["amax"], [1.0, 1.0, 1.0])


def test_nnx_optimizer_with_fp8_metadata_in_wrt_is_refused_by_accumulate():
    from flax import nnx

    model = nnx.bridge.ToNNX(Mlp(), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, batch()[0])

    def is_meta(path, value):
        return type(value).__name__ == META

    wrt = nnx.Any(nnx.Param, is_meta)
    with pytest.raises(ValueError, match=r"wrt=nnx\.Param"):
        ga.flax.Optimizer(model, ga.accumulate(optax.sgd(0.1), 2), wrt=wrt)
