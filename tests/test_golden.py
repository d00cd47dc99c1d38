"""Golden outputs of `accumulate`: every route gives the numbers recorded before the refactor.

Each scenario runs a few windows of a small MLP (one micro-step of every third window
has a non-finite gradient, which must be dropped) and records the params and the whole
optimizer state after every step. The recordings in `tests/golden/` were made with the
engine as it stood before `accumulate` became one update path over reduction
strategies; the test asserts that the engine reproduces them: integer leaves (counters,
flags) bit for bit, float leaves within `ULPS` units in the last place of the leaf's
largest value. On the CPU that recorded them the floats are equal bit for bit too, but
XLA:CPU picks its vector code by the CPU's features, and two machines of this project
(both "AMD EPYC") round the same program differently in the last bits (2 ulps apart at
most after the seven steps).

Recorded under the suite's compiler settings (conftest.py): XLA's defaults may round
the last bit differently, so this module is `slow` (run by `dev.sh test` only, not by
the wheel/oldest steps, which compile with the defaults). Record anew with
`GRADACCUM_RECORD_GOLDEN=1 pytest tests/test_golden.py` only after a change of the
numbers that is intended, and say why in the commit.
"""

from __future__ import annotations

import os
import pathlib

import _equivalence as E
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from gradaccum_jax._base import compat as _compat

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
RECORD = os.environ.get("GRADACCUM_RECORD_GOLDEN", "") not in ("", "0")
P = jax.P
STEPS = 7  # windows of 3: two whole windows and a partial one
NAN_STEP = 1  # a micro-step of the first window whose gradient is non-finite

ULPS = 16  # float leaves: within this many units in the last place (see the docstring)

pytestmark = pytest.mark.slow


def init_params():
    k1, k2 = jax.random.split(jax.random.key(3))
    return {
        "w1": jax.random.normal(k1, (4, 8)) / 2.0,
        "b1": jnp.full((8,), 0.1),
        "w2": jax.random.normal(k2, (8, 2)) / 3.0,
    }


def batch(step, size=16, poison_rows=None, poison=True):
    rng = np.random.default_rng(100 + step)
    x = rng.normal(size=(size, 4)).astype(np.float32)
    y = rng.normal(size=(size, 2)).astype(np.float32)
    if poison and step == NAN_STEP:
        rows = slice(None) if poison_rows is None else poison_rows
        x[rows, 0] = np.nan
    return x, y


def summed(tree):
    """Leaves typed unreduced (per-device partial sums) summed into their dense sharding."""

    def dense(x):
        spec = getattr(jax.typeof(x).sharding, "spec", None)
        if spec is None or not spec.unreduced:
            return x
        return jax.jit(lambda a: _compat.reshard(a, P(*_compat.partitions(spec))))(x)

    return jax.tree.map(dense, tree)


def flat(tree):
    """{path|dtype|shape: the leaf's bytes}: compared bit for bit, whatever the dtype."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(summed(tree)):
        value = np.asarray(leaf)
        key = f"{jax.tree_util.keystr(path)}|{value.dtype}|{value.shape}"
        out[key] = np.frombuffer(value.tobytes(), np.uint8)
    return out


def assert_within_ulps(got_bytes, want_bytes, dtype, where):
    """Integer and boolean leaves equal bit for bit; float leaves within `ULPS` ulps."""
    got, want = (np.frombuffer(b.tobytes(), dtype) for b in (got_bytes, want_bytes))
    if not np.issubdtype(dtype, np.inexact) and dtype.name != "bfloat16":
        np.testing.assert_array_equal(got, want, err_msg=where)
        return
    got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=where)
    finite = np.isfinite(want)
    if not finite.any():
        return
    # Ulps of the leaf's largest value: an element near zero (a cancellation) is as exact
    # as the sums it came from, not as its own last bit.
    scale = np.max(np.abs(want[finite]))
    ulp = float(np.spacing(np.asarray(scale).astype(dtype)).astype(np.float64)) or 1e-45
    off = np.max(np.abs(got[finite] - want[finite])) / ulp
    assert off <= ULPS, f"{where}: {off:.0f} ulps of the leaf's largest value apart"


def record(trajectory):
    """{"<step>/<params|state><path>": array} for a list of (params, state)."""
    out = {}
    for i, (params, state) in enumerate(trajectory):
        for key, value in flat(params).items():
            out[f"{i}/params{key}"] = value
        for key, value in flat(state).items():
            out[f"{i}/state{key}"] = value
    return out


def run_local(tx, weights=None, poison=True):
    params = init_params()
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y, weight):
        grads = jax.grad(E.mlp_loss)(params, x, y)
        kwargs = {} if weight is None else {"weight": weight}
        updates, state = tx.update(grads, state, params, **kwargs)
        return optax.apply_updates(params, updates), state

    out = []
    for i in range(STEPS):
        x, y = batch(i, poison=poison)
        w = None if weights is None else jnp.float32(weights[i])
        params, state = step(params, state, x, y, w)
        out.append((params, state))
    return out


def run_pmap(tx):
    n = jax.device_count()
    params = init_params()
    state = jax.pmap(tx.init, axis_name="data")(jax.tree.map(lambda p: jnp.stack([p] * n), params))

    def body(params, state, x, y):
        grads = jax.grad(E.mlp_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.pmap(body, axis_name="data")
    stacked = jax.tree.map(lambda p: jnp.stack([p] * n), params)
    out = []
    for i in range(STEPS):
        x, y = batch(i, size=8 * n, poison_rows=slice(0, 8))
        stacked, state = step(stacked, state, x.reshape(n, 8, 4), y.reshape(n, 8, 2))
        out.append((jax.tree.map(lambda p: p[0], stacked), state))
    return out


def run_shard_map(tx):
    mesh = E.data_mesh(E.AUTO)
    params = init_params()
    specs = ga.replica_state_specs(jax.eval_shape(tx.init, params), "data")

    def body(params, state, x, y):
        varying = _compat.pcast_to_varying(params, ("data",))
        grads = jax.grad(E.mlp_loss)(varying, x, y)
        updates, state = tx.update(grads, ga.remove_replica_axis(state), params)
        return optax.apply_updates(params, updates), ga.add_replica_axis(state)

    init = jax.jit(
        jax.shard_map(
            lambda p: ga.add_replica_axis(tx.init(p)), mesh=mesh, in_specs=P(), out_specs=specs
        )
    )
    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), specs, P("data"), P("data")),
            out_specs=(P(), specs),
        )
    )
    state = init(params)
    out = []
    for i in range(STEPS):
        x, y = batch(i, size=8 * jax.device_count(), poison_rows=slice(0, 8))
        params, state = step(params, state, x, y)
        out.append((params, state))
    return out


def run_global_view(tx, param_spec=None):
    mesh = E.data_mesh()
    out = []
    with jax.set_mesh(mesh):
        params = init_params()
        if param_spec is not None:
            params = jax.device_put(params, param_spec(params))
        state = jax.jit(tx.init)(params)
        grad_fn = ga.unreduced_value_and_grad(
            lambda p, b: E.mlp_loss(p, b[0], b[1]), "data", batch_argnums=1
        )

        @jax.jit
        def step(params, state, b):
            _, grads = grad_fn(params, b)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        for i in range(STEPS):
            x, y = batch(i, size=4 * jax.device_count(), poison_rows=slice(0, 4))
            b = jax.device_put((x, y), P("data"))
            params, state = step(params, state, b)
            out.append((summed(params), summed(state)))
    return out


def adam():
    return optax.adam(1e-2)


SCENARIOS = {
    "local": lambda: run_local(ga.accumulate(adam(), 3)),
    "local_weight": lambda: run_local(
        ga.accumulate(adam(), 3), weights=[3.0, 5.0, 0.0, 2.0, 7.0, 1.0, 4.0]
    ),
    "local_sum": lambda: run_local(ga.accumulate(optax.sgd(0.1), 3, use_grad_mean=False)),
    "local_schedule": lambda: run_local(
        ga.accumulate(adam(), lambda step: jnp.where(step < 1, 2, 3).astype(jnp.int32))
    ),
    "local_bf16": lambda: run_local(ga.accumulate(adam(), 3, accumulator_dtype=jnp.bfloat16)),
    "local_compensated": lambda: run_local(
        ga.accumulate(adam(), 3, accumulator_dtype=jnp.bfloat16, compensated=True)
    ),
    "local_noise": lambda: run_local(ga.accumulate(adam(), 3, track_noise_scale=True)),
    "local_skip_fn": lambda: run_local(
        ga.accumulate(adam(), 3, should_skip_update_fn=optax.skip_not_finite)
    ),
    "local_uncounted": lambda: run_local(ga.accumulate(adam(), 3, count_skipped_steps=False)),
    "local_no_check": lambda: run_local(
        ga.accumulate(optax.sgd(0.1), 3, skip_nonfinite=False), poison=False
    ),
    "local_k1": lambda: run_local(ga.accumulate(adam(), 1)),
    "pmap": lambda: run_pmap(ga.accumulate(adam(), 3, axis_name="data")),
    "pmap_noise": lambda: run_pmap(
        ga.accumulate(adam(), 3, axis_name="data", track_noise_scale=True)
    ),
    "shard_map": lambda: run_shard_map(ga.accumulate(adam(), 3, axis_name="data")),
    "global_view": lambda: run_global_view(ga.accumulate(adam(), 3)),
    "global_view_zero1": lambda: run_global_view(
        ga.accumulate(adam(), 3, shard_inner_state="data")
    ),
}


@pytest.mark.requires("unreduced windows and scalars", jax="0.9.1")
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_engine_reproduces_the_recorded_outputs(name):
    got = record(SCENARIOS[name]())
    path = GOLDEN / f"{name}.npz"
    if RECORD:
        GOLDEN.mkdir(exist_ok=True)
        np.savez_compressed(path, **got)
    expected = dict(np.load(path))
    assert sorted(got) == sorted(expected), f"{name}: the recorded fields differ"
    for key, want in expected.items():
        assert_within_ulps(got[key], want, np.dtype(key.split("|")[1]), f"{name}: {key}")
    # The non-finite micro-step was dropped: the params stay finite.
    final = {k: v for k, v in got.items() if k.startswith(f"{STEPS - 1}/params")}
    for key, value in final.items():
        dtype = np.dtype(key.split("|")[1])
        assert np.isfinite(np.frombuffer(value.tobytes(), dtype)).all(), key


def test_the_comparison_tells_round_off_from_a_change():
    want = np.linspace(-1, 1, 9, dtype=np.float32)
    as_bytes = lambda a: np.frombuffer(a.tobytes(), np.uint8)  # noqa: E731
    near = want + np.float32(2 * np.spacing(np.float32(1)))
    assert_within_ulps(as_bytes(near), as_bytes(want), np.dtype(np.float32), "round-off")
    with pytest.raises(AssertionError, match="ulps of the leaf's largest value apart"):
        changed = want * np.float32(1 + 1e-5)
        assert_within_ulps(as_bytes(changed), as_bytes(want), np.dtype(np.float32), "changed")
    counts = np.array([3, 4], np.int32)
    with pytest.raises(AssertionError):
        assert_within_ulps(as_bytes(counts + 1), as_bytes(counts), np.dtype(np.int32), "count")
