"""Flax fp8 metadata across the calls of a window: `gradaccum_jax.flax.TrainState` and the
NNX `gradaccum_jax.flax.Optimizer`, on one device and over replicas (`axis_name`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _fp8_common import (
    META,
    NNX_WRT,
    Mlp,
    assert_mean_window_metadata,
    assert_metadata_equal,
    batch,
    loss_fn,
    nnx_loss,
    nnx_models,
    warm_nnx,
    warm_variables,
)
from flax import nnx, serialization
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._base.compat import pcast_to_varying
from gradaccum_jax.flax import Optimizer, TrainState, fp8_metadata

K = 4


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
    assert_mean_window_metadata(ours[META], big[META], calls)
    got = ours[META]["Dense_1"]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"]
    assert float(got[0]) > float(
        big[META]["Dense_1"]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"][0]
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


def test_a_state_without_fp8_layers_serializes_as_flax_s_own():
    params = {"w": jnp.arange(3.0)}
    ours = TrainState.create(apply_fn=None, params=params, tx=ga.accumulate(optax.sgd(1.0), 2))
    flax_s = train_state.TrainState.create(apply_fn=None, params=params, tx=ours.tx)
    assert ours.fp8_window_max is None
    assert serialization.to_state_dict(ours).keys() == serialization.to_state_dict(flax_s).keys()
    restored = serialization.from_bytes(ours, serialization.to_bytes(flax_s))
    np.testing.assert_array_equal(restored.params["w"], params["w"])
    serialization.from_bytes(flax_s, serialization.to_bytes(ours))

    class WithStats(TrainState):  # a subclass with a field of its own, as in Flax's examples
        batch_stats: Any

    sub = WithStats.create(apply_fn=None, params=params, tx=ours.tx, batch_stats={"m": 1.0})
    assert "fp8_window_max" not in serialization.to_state_dict(sub)
    assert serialization.from_bytes(sub, serialization.to_bytes(sub)).batch_stats == {"m": 1.0}


def test_the_running_max_is_saved_and_restored_mid_window():
    variables = {"params": {"w": jnp.ones(2)}, META: {"amax": jnp.zeros(3)}}
    state = TrainState.create(apply_fn=None, params=variables, tx=ga.accumulate(optax.sgd(1.0), 2))
    grads = {"params": {"w": jnp.ones(2)}, META: {"amax": jnp.array([1.0, 5.0, 2.0])}}
    state = state.apply_gradients(grads=grads)
    restored = serialization.from_bytes(state, serialization.to_bytes(state))
    np.testing.assert_array_equal(restored.fp8_window_max["amax"], [1.0, 5.0, 2.0])
    # A checkpoint of Flax's class, which has no running max, starts the window afresh.
    flax_s = train_state.TrainState.create(apply_fn=None, params=variables, tx=state.tx)
    fresh = serialization.from_bytes(state, serialization.to_bytes(flax_s))
    assert np.all(np.isneginf(fresh.fp8_window_max["amax"]))


# --- flax.nnx: gradaccum_jax.flax.Optimizer ------------------------------------------------


def _meta(model):
    return nnx.state(model, fp8_metadata)


def _nnx_windows(make_model, tx, share, grads_of, windows=2):
    """Windows of K calls of `Optimizer.update`, and one large-batch step per window."""
    model = warm_nnx(make_model())
    big = nnx.clone(model)
    optimizer = Optimizer(model, tx, wrt=nnx.Param)
    inner = optax.sgd(0.1)
    inner_state = inner.init(nnx.state(big, nnx.Param))

    @nnx.jit
    def call(model, optimizer, x, y):
        optimizer.update(model, grads_of(lambda m, x, y: share * nnx_loss(m, x, y), model, x, y))

    seen = []
    for window in range(windows):
        x, y = batch(window)
        for i in range(K):
            before = _meta(model)
            call(model, optimizer, x[i::K], y[i::K])
            if i < K - 1:  # held fixed inside the window
                assert_metadata_equal(_meta(model), before)
        grads = nnx.grad(nnx_loss, argnums=nnx.DiffState(0, NNX_WRT))(big, x, y)
        updates, inner_state = inner.update(nnx.state(grads, nnx.Param), inner_state)
        nnx.update(big, optax.apply_updates(nnx.state(big, nnx.Param), updates))
        nnx.update(big, _meta(grads))
        seen.append((nnx.state(nnx.clone(model)), nnx.state(nnx.clone(big))))  # not live
    assert int(optimizer.optimizer_step) == windows
    return seen


def _by_nnx_grad(loss, model, x, y):
    return nnx.grad(loss, argnums=nnx.DiffState(0, NNX_WRT))(model, x, y)


def _by_microbatches(loss, model, x, y):
    # Two micro-batches inside each call: the module's grads hold the metadata too.
    return ga.microbatch_value_and_grad(loss, 2, batch_argnums=(1, 2))(model, x, y)[1]


@pytest.mark.parametrize(
    "style, grads_of",
    [("linear", _by_nnx_grad), ("bridge", _by_nnx_grad), ("linear", _by_microbatches)],
)
def test_nnx_seeded_calls_with_a_summed_window_are_exact(style, grads_of):
    tx = ga.accumulate(optax.sgd(0.1), K, use_grad_mean=False)
    seen = _nnx_windows(nnx_models()[style], tx, 1.0 / K, grads_of)
    for window, (ours, big) in enumerate(seen):
        # As for linen: bit for bit from the same params, to round-off after a window.
        rtol = 0.0 if window == 0 else 1e-5
        assert_metadata_equal(
            nnx.state(ours, fp8_metadata), nnx.state(big, fp8_metadata), rtol=rtol
        )
        got, want = nnx.state(ours, nnx.Param), nnx.state(big, nnx.Param)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_nnx_metadata_are_held_and_written_at_the_close():
    make = nnx_models()["linear"]
    ((ours, big),) = _nnx_windows(make, ga.accumulate(optax.sgd(0.1), K), 1.0, _by_nnx_grad, 1)
    held, (x, y) = warm_nnx(make()), batch(0)
    calls = [_meta(_by_nnx_grad(nnx_loss, held, x[i::K], y[i::K])) for i in range(K)]
    assert_mean_window_metadata(nnx.state(ours, fp8_metadata), nnx.state(big, fp8_metadata), calls)


def test_nnx_without_accumulate_the_metadata_are_overwritten():
    model = warm_nnx(nnx_models()["linear"]())
    optimizer = Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    assert "fp8_window_max" in nnx.state(optimizer)  # saved with the optimizer's state
    grads = _by_nnx_grad(nnx_loss, model, *batch(3))
    optimizer.update(model, grads)
    assert_metadata_equal(_meta(model), _meta(grads))
    plain = Optimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1), wrt=nnx.Param)
    assert not hasattr(plain, "fp8_window_max")  # no fp8 layers: Flax's state as it is


def test_nnx_misuse_is_refused_with_the_fix():
    model = warm_nnx(nnx_models()["linear"]())
    tx = ga.accumulate(optax.sgd(0.1), K)
    with pytest.raises(ValueError, match=r"selects Flax fp8 metadata .*wrt=nnx\.Param"):
        Optimizer(model, tx, wrt=NNX_WRT)
    # Flax's own class reaches accumulate's refusal, which names ours.
    with pytest.raises(ValueError, match=r"gradaccum_jax\.flax\.Optimizer\(model, tx, wrt=nnx"):
        nnx.Optimizer(model, tx, wrt=NNX_WRT)
    optimizer = Optimizer(model, tx, wrt=nnx.Param)
    params_only = nnx.grad(nnx_loss)(model, *batch())
    with pytest.raises(ValueError, match=r"without the model's fp8 metadata .*fp8_metadata"):
        optimizer.update(model, params_only)


# --- over replicas: accumulate(..., axis_name=...) ------------------------------------------

R = 8
MESH = jax.make_mesh((R,), ("data",))
DP_K = 2


def _dp_data():
    """A large batch of R * DP_K * 4 rows, and the rows of each device's call `i`."""
    x, y = batch(5, size=R * DP_K * 4)

    def rows(i):
        # Device d holds rows [d * 8, (d + 1) * 8) and calls with every DP_K-th of them.
        return tuple(
            a.reshape(R, DP_K, -1, a.shape[-1])[:, i].reshape(-1, a.shape[-1]) for a in (x, y)
        )

    return (x, y), rows


def _dp_call(loss, share, state, *, check_vma, per_device=False):
    specs = ga.replica_state_specs(state, "data")
    out = (specs, P("data")) if per_device else specs

    def body(state, x, y):
        state = ga.remove_replica_axis(state)
        local = pcast_to_varying(state.params, "data") if check_vma else state.params
        state = state.apply_gradients(grads=jax.grad(lambda v: share * loss(v, (x, y)))(local))
        if per_device:  # every device's metadata, stacked, to see them all
            return ga.add_replica_axis(state), jax.tree.map(lambda m: m[None], state.params[META])
        return ga.add_replica_axis(state)

    mapped = jax.shard_map(
        body, mesh=MESH, in_specs=(specs, P("data"), P("data")), out_specs=out, check_vma=check_vma
    )
    init = jax.shard_map(
        ga.add_replica_axis, mesh=MESH, in_specs=(P(),), out_specs=specs, check_vma=check_vma
    )
    return jax.jit(init)(state), jax.jit(mapped)


def _dp_windows(tx, share, *, check_vma, per_device=False):
    model = Mlp()
    variables, loss = warm_variables(model), loss_fn(model)
    state = TrainState.create(apply_fn=None, params=variables, tx=tx)
    state, call = _dp_call(loss, share, state, check_vma=check_vma, per_device=per_device)
    (x, y), rows = _dp_data()
    sharded = NamedSharding(MESH, P("data"))
    out = None
    for i in range(DP_K):
        out = call(state, *jax.device_put(rows(i), sharded))
        state = out[0] if per_device else out
    return out, jax.grad(loss)(variables, (x, y)), variables


def test_replicas_seeded_window_equals_the_large_batch():
    # Each device's call differentiates its share of the global loss, 1 / (K R): every
    # cotangent is the large batch's, and the window's max over the replicas is its amax.
    tx = ga.accumulate(optax.sgd(0.1), DP_K, axis_name="data", use_grad_mean=False)
    state, want, variables = _dp_windows(tx, 1.0 / (DP_K * R), check_vma=True)
    assert_metadata_equal(state.params[META], want[META])
    step = optax.apply_updates(
        variables["params"], jax.tree.map(lambda g: -0.1 * g, want["params"])
    )
    for a, b in zip(jax.tree.leaves(state.params["params"]), jax.tree.leaves(step), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The running max is each replica's own until the close: a replica axis, like acc_grads.
    assert jax.tree.leaves(state.fp8_window_max)[0].shape[0] == R


@pytest.mark.parametrize("route", ["shard_map_unchecked", "pmap"])
def test_replicas_write_the_same_metadata_on_every_device(route):
    tx = ga.accumulate(optax.sgd(0.1), DP_K, axis_name="data")
    if route == "pmap":
        model = Mlp()
        variables, loss = warm_variables(model), loss_fn(model)
        state = TrainState.create(apply_fn=None, params=variables, tx=tx)
        state = jax.tree.map(lambda a: jnp.broadcast_to(a, (R, *jnp.shape(a))), state)
        call = jax.pmap(
            lambda s, x, y: s.apply_gradients(grads=jax.grad(lambda v: loss(v, (x, y)))(s.params)),
            axis_name="data",
        )
        (x, y), rows = _dp_data()
        for i in range(DP_K):
            state = call(state, *(a.reshape(R, -1, a.shape[-1]) for a in rows(i)))
        per_device, want = state.params[META], jax.grad(loss)(variables, (x, y))
    else:
        (_, per_device), want, variables = _dp_windows(tx, 1.0, check_vma=False, per_device=True)
        loss = loss_fn(Mlp())
    # Every device writes the large batch's forward metadata, and the max of every
    # device's calls' own output-gradient amaxes.
    _, rows = _dp_data()
    own = [
        jax.grad(loss)(variables, tuple(a[d * 4 : (d + 1) * 4] for a in rows(i)))[META]
        for d in range(R)
        for i in range(DP_K)
    ]
    for device in range(R):
        on_device = jax.tree.map(lambda a, d=device: np.asarray(a)[d], per_device)
        assert_mean_window_metadata(on_device, want[META], own)


def test_nnx_optimizer_over_replicas_equals_the_large_batch():
    # The NNX container under jax.pmap: each replica's running max, their max at the close.
    model = warm_nnx(nnx_models()["linear"]())
    big = nnx.clone(model)
    tx = ga.accumulate(optax.sgd(0.1), DP_K, axis_name="data", use_grad_mean=False)
    graphdef, state = nnx.split((model, Optimizer(model, tx, wrt=nnx.Param)))

    def call(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        share = 1.0 / (DP_K * R)
        optimizer.update(
            model, _by_nnx_grad(lambda m, x, y: share * nnx_loss(m, x, y), model, x, y)
        )
        return nnx.state((model, optimizer))

    state = jax.tree.map(lambda a: jnp.broadcast_to(a, (R, *jnp.shape(a))), state)
    (x, y), rows = _dp_data()
    for i in range(DP_K):
        state = jax.pmap(call, axis_name="data")(
            state, *(a.reshape(R, -1, a.shape[-1]) for a in rows(i))
        )
    model, optimizer = nnx.merge(graphdef, state)
    want = _meta(_by_nnx_grad(nnx_loss, big, x, y))
    for device in range(R):
        assert_metadata_equal(
            jax.tree.map(lambda a, d=device: np.asarray(a)[d], _meta(model)), want
        )
    np.testing.assert_array_equal(optimizer.optimizer_step, np.ones(R))


@pytest.mark.hlo
def test_the_close_takes_the_metadata_s_max_over_replicas_once_per_window():
    model = Mlp()
    tx = ga.accumulate(optax.sgd(0.1), DP_K, axis_name="data")
    state = TrainState.create(apply_fn=None, params=warm_variables(model), tx=tx)
    state, call = _dp_call(loss_fn(model), 1.0, state, check_vma=True)
    _, rows = _dp_data()
    hlo = harness.Hlo(
        call.lower(state, *jax.device_put(rows(0), NamedSharding(MESH, P("data")))).compile()
    )
    every_step = hlo.every_step()
    assert hlo.ops("all-reduce", every_step) == []  # a micro-step runs no collective

    in_branches = [
        op
        for branches in hlo.conditionals(every_step)
        for branch in branches
        for op in hlo.ops("all-reduce", hlo.reachable([branch]))
    ]
    by_reducer = {}
    for op in in_branches:
        by_reducer[hlo.reducer(op)] = by_reducer.get(hlo.reducer(op), 0) + op.elements
    n_meta = sum(np.size(m) for m in jax.tree.leaves(state.params[META]))
    n_params = sum(np.size(p) for p in jax.tree.leaves(state.params["params"]))
    # The metadata cross the replicas by max, the gradients (and the window weight) by sum.
    assert by_reducer == {"maximum": n_meta, "add": n_params + 1}
