"""Tests of accumulate(axis_name=...) and the shard_map state helpers.

Everything runs on the 8 host devices that conftest.py forces. Training runs
are compared with one device taking one step per window on the whole global
batch: float32 sums in another order, so rtol=1e-5, with atol=1e-6 for the
entries (biases) that start at zero.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import _equivalence as E
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _dp_common import D_HID, D_IN, D_OUT, B, grad_step, init_params, predict, shard_map_fns
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._base.compat import pcast_to_varying

R = 8  # replicas
RTOL, ATOL = 1e-5, 1e-6
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}
MESH = jax.make_mesh((R,), ("data",))
PARAMS = init_params()


def _data(windows: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batches shaped (windows, k, replicas, B, features)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(windows, k, R, B, D_IN)).astype(np.float32)
    y = rng.normal(size=(windows, k, R, B, D_OUT)).astype(np.float32)
    return x, y


def _large_batch(inner, xs, ys, accepted=None):
    """One device, one inner step per window on every accepted micro-batch at once."""
    params, state = PARAMS, inner.init(PARAMS)
    grad = jax.jit(jax.grad(E.mlp_loss))
    for w in range(xs.shape[0]):
        keep = np.ones(xs.shape[1:3], bool) if accepted is None else accepted[w]
        g = grad(params, xs[w][keep].reshape(-1, D_IN), ys[w][keep].reshape(-1, D_OUT))
        updates, state = inner.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


# --- the two ways to run a data-parallel step ---------------------------------------------


@functools.cache
def _shard_map_fns(opt: str, k: int, mesh=MESH, axis="data", check_vma=True, mean=True):
    tx = ga.accumulate(OPTIMIZERS[opt](), k, axis_name=axis, use_grad_mean=mean)
    return shard_map_fns(tx, PARAMS, mesh, axis, check_vma)


def _run_shard_map(opt, xs, ys, mesh=MESH, axis="data", check_vma=True, mean=True):
    init, step = _shard_map_fns(opt, xs.shape[1], mesh, axis, check_vma, mean)
    batch = NamedSharding(mesh, P(axis))
    params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
    state = init(params)
    for w in range(xs.shape[0]):
        for i in range(xs.shape[1]):
            x = jax.device_put(xs[w, i].reshape(R * B, D_IN), batch)
            y = jax.device_put(ys[w, i].reshape(R * B, D_OUT), batch)
            params, state = step(params, state, x, y)
    return params, state


@functools.cache
def _pmap_fns(opt: str, k: int):
    tx = ga.accumulate(OPTIMIZERS[opt](), k, axis_name="batch")

    def body(params, state, x, y):
        return grad_step(tx, params, state, x, y, params)

    return jax.pmap(tx.init), jax.pmap(body, axis_name="batch")


def _replicate(tree):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (R, *jnp.shape(x))), tree)


def _run_pmap(opt, xs, ys):
    init, step = _pmap_fns(opt, xs.shape[1])
    params = _replicate(PARAMS)
    state = init(params)
    for w in range(xs.shape[0]):
        for i in range(xs.shape[1]):
            params, state = step(params, state, xs[w, i], ys[w, i])
    # Every replica holds the same params; check it, then keep one copy.
    for leaf in jax.tree.leaves(params):
        np.testing.assert_array_equal(np.asarray(leaf), np.broadcast_to(leaf[0], leaf.shape))
    return jax.tree.map(lambda x: x[0], params), state


RUNNERS = {"shard_map": _run_shard_map, "pmap": _run_pmap}


# --- equivalence --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_replicas_times_micro_steps_equal_one_large_batch(mode, opt):
    xs, ys = _data(windows=3, k=3)
    params, state = RUNNERS[mode](opt, xs, ys)
    chex.assert_trees_all_close(
        params, _large_batch(OPTIMIZERS[opt](), xs, ys), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_array_equal(np.asarray(state.gradient_step).reshape(-1)[0], 3)
    np.testing.assert_array_equal(np.asarray(state.micro_step).reshape(-1)[0], 0)


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_nonfinite_on_one_replica_does_not_poison_the_others(mode):
    xs, ys = _data(windows=3, k=3, seed=1)
    accepted = np.ones(xs.shape[:3], bool)
    xs[0, 1, 5] = np.nan  # replica 5, micro-step 1 of window 0
    accepted[0, 1, 5] = False
    xs[1, :, :] = np.inf  # window 1: nothing accepted anywhere, no update
    accepted[1] = False
    params, state = RUNNERS[mode]("adam", xs, ys)

    expected_windows = [accepted[0], accepted[2]]  # the empty window applies nothing
    kept = np.array([0, 2])
    chex.assert_trees_all_close(
        params,
        _large_batch(optax.adam(1e-2), xs[kept], ys[kept], np.stack(expected_windows)),
        rtol=RTOL,
        atol=ATOL,
    )
    skipped = np.asarray(state.num_skipped).reshape(R)
    np.testing.assert_array_equal(skipped, [3, 3, 3, 3, 3, 4, 3, 3])  # per replica
    assert int(np.asarray(state.gradient_step).reshape(-1)[0]) == 2


def test_float16_replica_windows_with_unequal_weights_do_not_overflow():
    # Each replica holds its float16 window in units of its weight so far (issue 29): 1 then
    # 4096 on a gradient of 20 keeps 20, where units of the first weight overflowed.
    n = jax.device_count()
    tx = ga.accumulate(optax.sgd(1.0), 2, axis_name="data", accumulator_dtype=jnp.float16)
    params = {"w": jnp.zeros((n, 2))}
    state = jax.pmap(tx.init, axis_name="data")(params)
    step = jax.pmap(
        lambda g, s, p, w: tx.update(g, s, p, weight=w), axis_name="data", in_axes=(0, 0, 0, 0)
    )
    grads = {"w": jnp.stack([jnp.full(2, 20.0 + r) for r in range(n)])}
    firsts = jnp.asarray([1.0, 4096.0] * (n // 2), jnp.float32)
    seconds = jnp.asarray([4096.0, 1.0] * (n // 2), jnp.float32)
    _, state = step(grads, state, params, firsts)
    assert np.isfinite(np.asarray(state.acc_grads["w"], np.float32)).all()
    updates, state = step(grads, state, params, seconds)
    assert np.isfinite(np.asarray(state.acc_grads["w"], np.float32)).all()
    totals = np.asarray(firsts) + np.asarray(seconds)
    want = -(totals * (20.0 + np.arange(n))).sum() / totals.sum()
    np.testing.assert_allclose(np.asarray(updates["w"]), np.full((n, 2), want), rtol=1e-3)


@pytest.mark.slow
def test_weighted_mean_sums_weights_across_replicas():
    """Token-count weights: the mean is over every replica's tokens, not a mean of means."""
    k, windows = 2, 2
    xs, ys = _data(windows, k, seed=2)
    counts = np.random.default_rng(3).integers(0, B + 1, size=(windows, k, R))
    counts[0, 0, :] = 0  # a micro-step where no replica has tokens
    mask = np.arange(B)[None, None, None, :] < counts[..., None]
    tx = ga.accumulate(optax.sgd(0.1), k, axis_name="data")
    specs = ga.replica_state_specs(jax.eval_shape(tx.init, PARAMS), "data")

    def token_loss(params, x, y, m):
        err = jnp.sum((predict(params, x) - y) ** 2, axis=-1)
        return jnp.sum(jnp.where(m, err, 0.0))

    def body(params, state, x, y, m):
        varying = pcast_to_varying(params, "data")
        count = jnp.sum(m)
        grads = jax.grad(lambda p: token_loss(p, x, y, m) / jnp.maximum(count, 1))(varying)
        updates, state = tx.update(grads, ga.remove_replica_axis(state), params, weight=count)
        return optax.apply_updates(params, updates), ga.add_replica_axis(state)

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=MESH,
            in_specs=(P(), specs, P("data"), P("data"), P("data")),
            out_specs=(P(), specs),
        )
    )
    init = jax.jit(
        jax.shard_map(
            lambda p: ga.add_replica_axis(tx.init(p)), mesh=MESH, in_specs=P(), out_specs=specs
        )
    )
    batch = NamedSharding(MESH, P("data"))
    params = jax.device_put(PARAMS, NamedSharding(MESH, P()))
    state = init(params)
    for w in range(windows):
        for i in range(k):
            args = (
                xs[w, i].reshape(R * B, -1),
                ys[w, i].reshape(R * B, -1),
                mask[w, i].reshape(-1),
            )
            params, state = step(params, state, *(jax.device_put(a, batch) for a in args))

    expected, inner = PARAMS, optax.sgd(0.1)
    inner_state = inner.init(expected)

    def mean_token_loss(params, x, y, m):
        return token_loss(params, x, y, m) / m.sum()

    for w in range(windows):
        x, y, m = xs[w].reshape(-1, D_IN), ys[w].reshape(-1, D_OUT), mask[w].reshape(-1)
        g = jax.grad(mean_token_loss)(expected, x, y, m)
        updates, inner_state = inner.update(g, inner_state, expected)
        expected = optax.apply_updates(expected, updates)
    chex.assert_trees_all_close(params, expected, rtol=RTOL, atol=ATOL)


def test_sum_over_all_replicas_and_micro_steps():
    xs, ys = _data(windows=2, k=2, seed=8)
    params, _ = _run_shard_map("sgd", xs, ys, mean=False)
    # SGD is linear in the gradient: the sum of R*K micro-batch means is R*K
    # times the large-batch mean.
    chex.assert_trees_all_close(
        params, _large_batch(optax.sgd(0.1 * R * 2), xs, ys), rtol=RTOL, atol=ATOL
    )


def test_shard_map_without_type_checks():
    """check_vma=False: no varying types to join, the same result."""
    xs, ys = _data(windows=2, k=2, seed=7)
    params, _ = _run_shard_map("sgd", xs, ys, check_vma=False)
    chex.assert_trees_all_close(params, _large_batch(optax.sgd(0.1), xs, ys), rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_tuple_of_axis_names_shard_map_and_pmap_of_vmap():
    xs, ys = _data(windows=2, k=2, seed=4)
    expected = _large_batch(optax.sgd(0.1), xs, ys)
    mesh = jax.make_mesh((2, 4), ("host", "device"))
    params, _ = _run_shard_map("sgd", xs, ys, mesh=mesh, axis=("host", "device"))
    chex.assert_trees_all_close(params, expected, rtol=RTOL, atol=ATOL)

    tx = ga.accumulate(optax.sgd(0.1), 2, axis_name=("host", "device"))

    def body(params, state, x, y):
        return grad_step(tx, params, state, x, y, params)

    # jax 0.10 cannot nest pmap; a vmap axis inside pmap gives the second name.
    grid = jax.pmap(jax.vmap(body, axis_name="device"), axis_name="host", devices=jax.devices()[:2])
    to_grid = functools.partial(jax.tree.map, lambda a: a.reshape(2, 4, *a.shape[1:]))
    params = to_grid(_replicate(PARAMS))
    state = jax.pmap(jax.vmap(tx.init), devices=jax.devices()[:2])(params)
    for w in range(2):
        for i in range(2):
            params, state = grid(params, state, *to_grid((xs[w, i], ys[w, i])))
    chex.assert_trees_all_close(
        jax.tree.map(lambda a: a[1, 3], params), expected, rtol=RTOL, atol=ATOL
    )


def test_scan_inside_shard_map_keeps_state_types():
    """A whole window in one lax.scan: the carried state keeps its varying-axis types."""
    k = 3
    xs, ys = _data(windows=2, k=k, seed=5)
    tx = ga.accumulate(optax.adam(1e-2), k, axis_name="data")
    specs = ga.replica_state_specs(jax.eval_shape(tx.init, PARAMS), "data")

    def body(params, state, x, y):
        def micro_step(carry, batch):
            params, state = carry
            varying = pcast_to_varying(params, "data")
            return grad_step(tx, params, state, *batch, varying), None

        (params, state), _ = jax.lax.scan(
            micro_step, (params, ga.remove_replica_axis(state)), (x, y)
        )
        return params, ga.add_replica_axis(state)

    window = jax.jit(
        jax.shard_map(
            body,
            mesh=MESH,
            in_specs=(P(), specs, P(None, "data"), P(None, "data")),
            out_specs=(P(), specs),
        )
    )
    init, _ = _shard_map_fns("adam", k)
    params = jax.device_put(PARAMS, NamedSharding(MESH, P()))
    state = init(params)
    batch = NamedSharding(MESH, P(None, "data"))
    for w in range(2):
        x = jax.device_put(xs[w].reshape(k, R * B, D_IN), batch)
        y = jax.device_put(ys[w].reshape(k, R * B, D_OUT), batch)
        params, state = window(params, state, x, y)
    chex.assert_trees_all_close(
        params, _large_batch(optax.adam(1e-2), xs, ys), rtol=RTOL, atol=ATOL
    )
    assert state.acc_weight.dtype == jnp.float32 and state.num_skipped.dtype == jnp.int32


# --- the compiled programs ----------------------------------------------------------------


def _all_reduces_by_region(compiled) -> tuple[list, list[list]]:
    """All-reduces on every step, and those of each branch of each every-step conditional."""
    hlo = harness.Hlo(compiled)
    every_step = hlo.every_step()
    branches = [
        hlo.ops("all-reduce", hlo.reachable([branch]))
        for branches in hlo.conditionals(every_step)
        for branch in branches
    ]
    return hlo.ops("all-reduce", every_step), branches


def _step_args(mode):
    xs, ys = _data(windows=1, k=1)
    if mode == "pmap":
        init, step = _pmap_fns("adam", 4)
        params = _replicate(PARAMS)
        return step, (params, init(params), xs[0, 0], ys[0, 0])
    init, step = _shard_map_fns("adam", 4)
    params = jax.device_put(PARAMS, NamedSharding(MESH, P()))
    batch = NamedSharding(MESH, P("data"))
    x = jax.device_put(xs[0, 0].reshape(R * B, D_IN), batch)
    y = jax.device_put(ys[0, 0].reshape(R * B, D_OUT), batch)
    return step, (params, init(params), x, y)


@pytest.mark.hlo
@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_all_reduces_only_in_the_boundary_branch(mode):
    step, args = _step_args(mode)
    outside, branches = _all_reduces_by_region(step.lower(*args).compile())
    # The micro-step path of the train step (forward, backward, accumulate)
    # runs no collective: the backward pass took the gradient of varying params.
    assert outside == []
    boundary = [ops for ops in branches if ops]
    assert len(boundary) == 1, [len(ops) for ops in branches]
    # One reduction per window of every gradient element plus the window weight
    # (XLA may fuse the leaves into fewer all-reduce ops; count both).
    n_params = sum(int(np.size(p)) for p in jax.tree.leaves(PARAMS))
    assert 1 <= len(boundary[0]) <= len(jax.tree.leaves(PARAMS)) + 1
    assert sum(op.elements for op in boundary[0]) == n_params + 1


@pytest.mark.hlo
def test_gradients_of_replicated_params_raise_inside_shard_map():
    """The trap: grad wrt invariant params already psums on every micro-step."""
    tx = ga.accumulate(optax.adam(1e-2), 4, axis_name="data")

    def body(params, state, x, y):
        return grad_step(tx, params, state, x, y, params)  # no pcast

    step = jax.shard_map(
        body, mesh=MESH, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P())
    )
    x = jax.device_put(np.zeros((R * B, D_IN), np.float32), NamedSharding(MESH, P("data")))
    y = jax.device_put(np.zeros((R * B, D_OUT), np.float32), NamedSharding(MESH, P("data")))
    with pytest.raises(ValueError, match=r"pcast\(params, 'data', to='varying'\)"):
        jax.jit(step).lower(PARAMS, tx.init(PARAMS), x, y)
    # The same program without accumulate: XLA really reduces each micro-step.
    hlo = jax.jit(
        jax.shard_map(
            lambda p, x, y: jax.grad(E.mlp_loss)(p, x, y),
            mesh=MESH,
            in_specs=(P(), P("data"), P("data")),
            out_specs=P(),
        )
    )
    outside, _ = _all_reduces_by_region(hlo.lower(PARAMS, x, y).compile())
    assert outside


def test_unbound_axis_name_says_where_to_call_update():
    tx = ga.accumulate(optax.sgd(0.1), 2, axis_name="data")
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"axis 'data' is not bound.*jax\.shard_map"):
        jax.jit(tx.update)(PARAMS, state, PARAMS)
    with pytest.raises(ValueError, match="not bound"):
        tx.update(PARAMS, state, PARAMS)
    wrong = ga.accumulate(optax.sgd(0.1), 2, axis_name="batch")
    body = jax.shard_map(
        lambda g, s: wrong.update(g, s)[0], mesh=MESH, in_specs=(P(), P()), out_specs=P()
    )
    with pytest.raises(ValueError, match="'batch' is not bound"):
        jax.jit(body).lower(PARAMS, wrong.init(PARAMS))


@pytest.mark.parametrize(
    ("axis_name", "error"),
    [({"data"}, TypeError), ((), TypeError), (("data", None), TypeError), (["a", "a"], ValueError)],
)
def test_bad_axis_name_is_refused_at_construction(axis_name, error):
    with pytest.raises(error, match="axis_name"):
        ga.accumulate(optax.sgd(0.1), 2, axis_name=axis_name)


@pytest.mark.hlo
def test_without_axis_name_no_collectives_and_no_checks_under_shard_map():
    """Plain accumulate inside shard_map stays local: no all-reduce anywhere."""
    tx = ga.accumulate(optax.sgd(0.1), 2)
    body = jax.shard_map(
        lambda g, s: tx.update(g, s)[0],
        mesh=MESH,
        in_specs=(P(), P()),
        out_specs=P(),
    )
    hlo = harness.Hlo(jax.jit(body).lower(PARAMS, tx.init(PARAMS)).compile())
    assert hlo.ops("all-reduce") == []


# --- sharded jit (FSDP-style), no axis_name -----------------------------------------------


def _fsdp_specs():
    return {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P()}


@pytest.mark.hlo
@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_sharded_jit_keeps_state_sharded_like_params(axis_type):
    axis_types = (AxisType.Explicit if axis_type == "explicit" else AxisType.Auto,)
    mesh = jax.make_mesh((R,), ("fsdp",), axis_types=axis_types)
    shardings = {k: NamedSharding(mesh, s) for k, s in _fsdp_specs().items()}
    params = jax.device_put(PARAMS, shardings)
    grads = jax.device_put(jax.tree.map(jnp.ones_like, PARAMS), shardings)
    tx = ga.accumulate(optax.adam(1e-2), 2)
    with jax.set_mesh(mesh):
        if axis_type == "explicit":
            init = jax.jit(tx.init)
        else:
            # Under Auto axes XLA picks shardings for values made from constants
            # (optax's own zeros too); say what you want, as for any optimizer.
            init = jax.jit(tx.init, out_shardings=_state_shardings(tx, params, shardings))
        state = init(params)
        update = jax.jit(tx.update)
        hlo = harness.Hlo(update.lower(grads, state, params).compile())
        init_hlo = harness.Hlo(init.lower(params).compile())
        for _ in range(2):  # a micro-step, then a window boundary
            _assert_state_sharded(state, shardings)
            updates, state = update(grads, state, params)
            _assert_tree_sharded(updates, shardings)
        _assert_state_sharded(state, shardings)
    assert int(state.gradient_step) == 1
    assert hlo.ops("all-gather") == []
    assert init_hlo.ops("all-gather") == []


def _state_shardings(tx, params, shardings):
    shapes = jax.eval_shape(tx.init, params)
    out = jax.tree.map(lambda _: NamedSharding(shardings["b2"].mesh, P()), shapes)
    adam, rest = out.inner_state
    return out._replace(
        acc_grads=shardings, inner_state=(adam._replace(mu=shardings, nu=shardings), rest)
    )


def _assert_tree_sharded(tree, shardings):
    for name, leaf in tree.items():
        assert leaf.sharding.is_equivalent_to(shardings[name], leaf.ndim), (name, leaf.sharding)


def _assert_state_sharded(state, shardings):
    _assert_tree_sharded(state.acc_grads, shardings)
    _assert_tree_sharded(state.inner_state[0].mu, shardings)
    _assert_tree_sharded(state.inner_state[0].nu, shardings)


# --- the state helpers --------------------------------------------------------------------


def test_replica_helpers_cover_chains_and_nested_accumulates():
    inner = ga.accumulate(optax.sgd(0.1), 2, axis_name="data")
    tx = optax.chain(optax.clip_by_global_norm(1.0), ga.accumulate(inner, 3, axis_name="data"))
    state = tx.init(PARAMS)
    specs = ga.replica_state_specs(jax.eval_shape(tx.init, PARAMS), ("data",))
    outer = specs[1]
    assert outer.acc_grads == {k: P("data") for k in PARAMS}
    assert outer.inner_state.acc_weight == P("data")
    assert outer.inner_state.micro_step == P() and outer.micro_step == P()
    assert jax.tree.leaves(specs[0], is_leaf=lambda x: isinstance(x, P)) == [P()] * len(
        jax.tree.leaves(state[0])
    )
    stacked = ga.add_replica_axis(state)
    assert stacked[1].inner_state.num_skipped.shape == (1,)
    assert stacked[1].acc_grads["w1"].shape == (1, D_IN, D_HID)
    assert stacked[1].micro_step.shape == ()
    back = ga.remove_replica_axis(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    assert all(
        a.shape == b.shape
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True)
    )


def test_replica_helpers_explain_misuse():
    with pytest.raises(ValueError, match="no AccumulateState"):
        ga.add_replica_axis(optax.adam(1e-3).init(PARAMS))
    state = ga.accumulate(optax.sgd(0.1), 2, axis_name="data").init(PARAMS)
    with pytest.raises(ValueError, match=r"state\.acc_grads\['b1'\] has shape \(8,\)"):
        ga.remove_replica_axis(state)
    with pytest.raises(TypeError, match="axis_name"):
        ga.replica_state_specs(state, None)


# --- several processes --------------------------------------------------------------------

_WORKER = Path(__file__).with_name("_multihost_worker.py")
MULTIHOST_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_single_process_large_batch(tmp_path):
    """2 processes x 2 host devices, gloo collectives, a 4-replica global mesh."""
    windows, k, replicas = 3, 2, 4
    rng = np.random.default_rng(6)
    xs = rng.normal(size=(windows, k, replicas, B, D_IN)).astype(np.float32)
    ys = rng.normal(size=(windows, k, replicas, B, D_OUT)).astype(np.float32)
    xs[1, 0, 2] = np.nan  # a replica on the second process drops one micro-batch
    accepted = np.isfinite(xs).all(axis=(-1, -2))
    np.savez(
        tmp_path / "data.npz", xs=xs, ys=ys, **{f"p_{n}": np.asarray(v) for n, v in PARAMS.items()}
    )

    # Each child forces its own 2 devices (conftest set 8 for this process).
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(_WORKER), str(port), str(pid), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    outputs = []
    try:
        deadline = time.monotonic() + MULTIHOST_TIMEOUT_S
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]

    expected = _large_batch(optax.adam(1e-2), xs, ys, accepted)
    for pid in range(2):
        result = np.load(tmp_path / f"result_{pid}.npz")
        chex.assert_trees_all_close(
            {n: result[f"p_{n}"] for n in PARAMS}, expected, rtol=RTOL, atol=ATOL
        )
        assert int(result["gradient_step"]) == windows
        assert int(result["num_skipped_total"]) == 1


# --- misuse of the shard_map state helpers: the error names the missing helper ------------


def _misused_step(tx, body, state_spec):
    return jax.jit(
        jax.shard_map(
            body,
            mesh=MESH,
            in_specs=(P(), state_spec, P("data"), P("data")),
            out_specs=(P(), state_spec),
        )
    )


def test_forgetting_remove_replica_axis_names_it():
    tx = ga.accumulate(optax.sgd(0.1), 2, axis_name="data")
    init, _ = _shard_map_fns("sgd", 2)
    specs = ga.replica_state_specs(jax.eval_shape(tx.init, PARAMS), "data")

    def body(params, state, x, y):
        varying = pcast_to_varying(params, "data")
        return grad_step(tx, params, state, x, y, varying)  # no remove_replica_axis

    xs, ys = _data(1, 1)
    batch = NamedSharding(MESH, P("data"))
    x, y = (jax.device_put(a[0, 0].reshape(R * B, -1), batch) for a in (xs, ys))
    params = jax.device_put(PARAMS, NamedSharding(MESH, P()))
    with pytest.raises(ValueError, match=r"leading replica axis.*remove_replica_axis\(opt_state\)"):
        _misused_step(tx, body, specs)(params, init(params), x, y)


def test_forgetting_the_replica_state_specs_names_them():
    # add_replica_axis and remove_replica_axis are there, but the state's specs
    # are P(): JAX would only report that out_specs cannot be replicated.
    tx = ga.accumulate(optax.sgd(0.1), 2, axis_name="data")
    init = jax.jit(
        jax.shard_map(
            lambda p: ga.add_replica_axis(tx.init(p)), mesh=MESH, in_specs=P(), out_specs=P()
        )
    )

    def body(params, state, x, y):
        varying = pcast_to_varying(params, "data")
        params, state = grad_step(tx, params, ga.remove_replica_axis(state), x, y, varying)
        return params, ga.add_replica_axis(state)

    xs, ys = _data(1, 1)
    batch = NamedSharding(MESH, P("data"))
    x, y = (jax.device_put(a[0, 0].reshape(R * B, -1), batch) for a in (xs, ys))
    params = jax.device_put(PARAMS, NamedSharding(MESH, P()))
    with pytest.raises(ValueError, match=r"entered jax.shard_map replicated.*replica_state_specs"):
        _misused_step(tx, body, P())(params, init(params), x, y)
    # With check_vma=False nothing is typed, so the helper cannot tell and stays quiet.
    unchecked = jax.jit(
        jax.shard_map(
            lambda s: ga.remove_replica_axis(s).acc_weight,
            mesh=MESH,
            in_specs=P(),
            out_specs=P(),
            check_vma=False,
        )
    )
    assert float(unchecked(init(params))) == 0.0


def _listed_fields(text):
    """The backticked names in the parenthesis that lists the per-replica fields of `text`."""
    match = re.search(r"\((`acc_grads`[^)]*)\)", " ".join(text.split()))
    assert match, text
    return set(re.findall(r"`(\w+)`", match.group(1)))


def test_documented_per_replica_fields_are_those_add_replica_axis_expands():
    # docs/distributed.md lists the per-replica fields for users who write the specs by
    # hand; the list must be every field that add_replica_axis and replica_state_specs
    # treat per replica, with every optional field switched on.
    tx = ga.accumulate(
        # reduce_on_plateau reads the loss: the window holds the sum of the losses too.
        optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau()),
        4,
        axis_name="data",
        compensated=True,
        track_noise_scale=True,
        accumulator_dtype=jnp.bfloat16,
    )
    state = jax.eval_shape(tx.init, {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)})
    expanded = jax.eval_shape(ga.add_replica_axis, state)
    specs = ga.replica_state_specs(state, "data")
    per_replica = set()
    for field in state._fields:
        if field == "inner_state":
            continue
        before = jax.tree.leaves(getattr(state, field))
        after = jax.tree.leaves(getattr(expanded, field))
        shapes = [(a.shape, b.shape) for a, b in zip(before, after, strict=True)]
        if shapes and all(b == (1, *a) for a, b in shapes):
            per_replica.add(field)
            assert all(s == P("data") for s in jax.tree.leaves(getattr(specs, field))), field
        else:
            assert all(a == b for a, b in shapes), field
    assert per_replica == {
        "acc_grads",
        "acc_weight",
        "weight_unit",
        "num_skipped",
        "acc_compensation",
        "noise_scale",
        "acc_value",
    }
    page = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    section = page[page.index("**Hold the per-replica accumulators on a replica axis.**") :]
    assert _listed_fields(section) == per_replica
    assert _listed_fields(ga.add_replica_axis.__doc__) == per_replica
    assert _listed_fields(ga.replica_state_specs.__doc__) == per_replica
