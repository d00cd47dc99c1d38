"""gradaccum_jax.losses: tiled contrastive losses equal the dense formulas, sharded or not.

The references below build the N x N logits densely and use jax.nn's log-softmax and
log-sigmoid with autodiff; the tiled losses must match them in value and in gradients
with respect to the embeddings, `scale` and `bias` to float32 rounding.
"""

import decimal
import functools
import json
import pathlib
import re

import _equivalence as E
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from benchmarks import contrastive_precision as precision
from gradaccum_jax import losses
from gradaccum_jax._base.compat import pcast_to_varying

RTOL = 1e-5  # float32 rounding of sums over a few hundred terms, in another order
HI = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- references


def _logits(x, y, scale):
    dtype = jnp.promote_types(x.dtype, jnp.float32)  # 16-bit inputs: float32 logits
    return scale * jnp.dot(x.astype(dtype), y.astype(dtype).T, precision=HI)


def _soft_ce(s, pos, cvalid):
    """Cross-entropy of each row of `s` against the uniform distribution over `pos`."""
    logp = jax.nn.log_softmax(jnp.where(cvalid[None, :], s, -jnp.inf), axis=1)
    target = pos / jnp.maximum(pos.sum(1, keepdims=True), 1)
    return -jnp.where(pos, target * logp, 0.0).sum(1)


def _pos(labels, valid):
    return (labels[:, None] == labels[None, :]) & valid[:, None] & valid[None, :]


def dense_clip(a, b, scale, mask=None, labels=None):
    n = a.shape[0]
    valid = jnp.ones(n, bool) if mask is None else mask
    lab = jnp.arange(n) if labels is None else labels
    s, pos = _logits(a, b, scale), _pos(lab, valid)
    rows = jnp.where(valid, _soft_ce(s, pos, valid), 0.0)
    cols = jnp.where(valid, _soft_ce(s.T, pos.T, valid), 0.0)
    return 0.5 * (rows.sum() + cols.sum()) / jnp.maximum(valid.sum(), 1)


def dense_info_nce(q, k, scale, mask=None, labels=None):
    n, m = q.shape[0], k.shape[0]
    valid = jnp.ones(n, bool) if mask is None else mask
    lab = jnp.arange(n) if labels is None else labels
    pos = jnp.zeros((n, m), bool).at[:, :n].set(_pos(lab, valid))
    cvalid = jnp.concatenate([valid, jnp.ones(m - n, bool)])
    rows = jnp.where(valid, _soft_ce(_logits(q, k, scale), pos, cvalid), 0.0)
    return rows.sum() / jnp.maximum(valid.sum(), 1)


def dense_siglip(a, b, scale, bias, mask=None, labels=None):
    n = a.shape[0]
    valid = jnp.ones(n, bool) if mask is None else mask
    lab = jnp.arange(n) if labels is None else labels
    z = jnp.where(_pos(lab, valid), 1.0, -1.0)
    terms = -jax.nn.log_sigmoid(z * (_logits(a, b, scale) + bias))
    both = valid[:, None] & valid[None, :]
    return jnp.where(both, terms, 0.0).sum() / jnp.maximum(valid.sum(), 1)


# Every loss as f(x, y, scale, bias, **kw) so that the tests treat them alike.
LOSSES = {
    "clip": (
        lambda x, y, s, c, **kw: losses.clip_loss(x, y, s, **kw),
        lambda x, y, s, c, **kw: dense_clip(x, y, s, **kw),
    ),
    "info_nce": (
        lambda x, y, s, c, **kw: losses.info_nce(x, y, s, **kw),
        lambda x, y, s, c, **kw: dense_info_nce(x, y, s, **kw),
    ),
    "siglip": (
        lambda x, y, s, c, **kw: losses.siglip_loss(x, y, s, c, **kw),
        lambda x, y, s, c, **kw: dense_siglip(x, y, s, c, **kw),
    ),
}
ARGNUMS = (0, 1, 2, 3)


def dense_value_and_grad(dense):
    """The dense reference's value and gradients, run eagerly: compiled as one program (the
    suite's fast XLA settings) its value at scale 100 moved by more than the tests' 1e-5."""
    return jax.value_and_grad(dense, ARGNUMS)


# One compiled program per shape (run eagerly, each of its operations was one).
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 5))
def _embeddings(n, d, m=None, dtype=jnp.float32, seed=0, aligned=True):
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n, d))
    y = jax.random.normal(ky, (m or n, d))
    if aligned:  # positives more alike than negatives, like a trained model
        y = y.at[:n].add(2.0 * x)
    x = x / jnp.linalg.norm(x, axis=1, keepdims=True)
    y = y / jnp.linalg.norm(y, axis=1, keepdims=True)
    return x.astype(dtype), y.astype(dtype)


# Each entry within RTOL of its leaf's largest: entries near zero get the leaf's scale.
_assert_close = functools.partial(E.assert_close, rtol=RTOL, per="leaf")


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize(
    ("n", "block", "scale"),
    [(100, 32, 1.7), (64, 16, 10.0), (5, 512, 3.0), (37, 8, 100.0)],
    ids=["ragged", "divisible", "one-tile", "sharp"],
)
def test_value_and_grads_equal_the_dense_loss(name, n, block, scale):
    tiled, dense = LOSSES[name]
    m = n + 23 if name == "info_nce" else None  # extra negatives beyond the pairs
    x, y = _embeddings(n, 24, m)
    fn = jax.jit(jax.value_and_grad(functools.partial(tiled, block_size=block), ARGNUMS))
    got = fn(x, y, jnp.float32(scale), jnp.float32(-3.0))
    want = dense_value_and_grad(dense)(x, y, jnp.float32(scale), jnp.float32(-3.0))
    _assert_close(got[0], want[0])
    # Where the softmax saturates (scale 100) a gradient is p - 1 with p within float32's
    # epsilon of 1: its rounding, times scale and the unit-norm rows, is an absolute floor.
    for g, w in zip(got[1], want[1], strict=True):
        _assert_close(g, w, atol=float(jnp.finfo(jnp.float32).eps) * scale)
    if name != "siglip":
        assert float(got[1][3]) == 0.0  # the softmax losses do not use bias


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_result_does_not_depend_on_the_block_size(name):
    tiled, _ = LOSSES[name]
    x, y = _embeddings(96, 16, 120 if name == "info_nce" else None)
    results = [
        jax.jit(jax.value_and_grad(functools.partial(tiled, block_size=bs), ARGNUMS))(
            x, y, 4.0, -1.0
        )
        for bs in (8, 24, 96, 1024)
    ]
    for other in results[1:]:
        _assert_close(other, results[0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_16_bit_inputs_use_float32_statistics(name, dtype):
    # Logits up to 30 with no dominant positive: 16-bit logits or running sums of a few
    # hundred exponentials would be ~1e-3 off. The tiled loss equals the float32 loss of
    # the same (16-bit) values.
    tiled, dense = LOSSES[name]
    m = 230 if name == "info_nce" else None
    x, y = _embeddings(200, 32, m, dtype=dtype, aligned=False)
    fn = jax.jit(jax.value_and_grad(functools.partial(tiled, block_size=64), ARGNUMS))
    value, grads = fn(x, y, jnp.float32(30.0), jnp.float32(-5.0))
    x32, y32 = x.astype(jnp.float32), y.astype(jnp.float32)
    want_value, want_grads = dense_value_and_grad(dense)(x32, y32, 30.0, -5.0)
    assert value.dtype == jnp.float32
    _assert_close(value, want_value)
    assert grads[0].dtype == grads[1].dtype == dtype
    # Gradients come back in the inputs' dtype: 16-bit rounding (8 or 11 bits) of float32 sums.
    _assert_close(grads[:2], want_grads[:2], rtol=1e-2)
    _assert_close(grads[2], want_grads[2])


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_float64_inputs_keep_float64(name):
    # float32 statistics are a floor, not a cap: float64 embeddings are not rounded.
    tiled, dense = LOSSES[name]
    x64 = jax.enable_x64(True) if hasattr(jax, "enable_x64") else _experimental_x64()
    with x64:
        x, y = _embeddings(60, 8, 70 if name == "info_nce" else None)
        x, y = x.astype(jnp.float64), y.astype(jnp.float64)
        s, c = jnp.float64(7.0), jnp.float64(-3.0)
        fn = jax.jit(jax.value_and_grad(functools.partial(tiled, block_size=16), ARGNUMS))
        got = fn(x, y, s, c)
        want = dense_value_and_grad(dense)(x, y, s, c)
        assert got[0].dtype == got[1][0].dtype == jnp.float64
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            scale = max(float(np.abs(np.asarray(w)).max()), 1e-30)
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-12 * scale)


def _experimental_x64():  # older jax releases of the supported range
    from jax.experimental import enable_x64

    return enable_x64()


# ----------------------------------------------------------------------------- masks, labels


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_rows_are_as_if_absent(name):
    # Padding a batch with garbage rows and masking them gives the loss of the real rows.
    tiled, dense = LOSSES[name]
    n, pad, d = 50, 14, 16
    extra = 9 if name == "info_nce" else 0
    x, y = _embeddings(n, d, n + extra)
    rng = np.random.default_rng(0)
    order = rng.permutation(n + pad)
    mask = jnp.asarray(order < n)
    junk = jnp.asarray(rng.normal(size=(n + pad, d)) * 5, jnp.float32)
    # Real row r goes to position where order == r; the others hold junk.
    where = np.argsort(order)[:n]
    px = junk.at[where].set(x)
    py = jnp.concatenate([junk.at[where].set(y[:n]), y[n:]])
    fn = jax.jit(jax.value_and_grad(functools.partial(tiled, block_size=16), ARGNUMS))
    value, grads = fn(px, py, 5.0, -2.0, mask=mask)
    want_value, want_grads = dense_value_and_grad(dense)(x, y, 5.0, -2.0)
    _assert_close(value, want_value)
    _assert_close(grads[0][where], want_grads[0])
    _assert_close(grads[1][where], want_grads[1][:n])
    if extra:
        _assert_close(grads[1][n + pad :], want_grads[1][n:])
    _assert_close(grads[2:], want_grads[2:])
    assert not np.asarray(grads[0])[~np.asarray(mask)].any()  # padding gets no gradient


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_rows_holding_nan_do_not_spread(name):
    tiled, _ = LOSSES[name]
    x, y = _embeddings(40, 8, 45 if name == "info_nce" else None)
    mask = jnp.arange(40) < 33
    fn = jax.jit(jax.value_and_grad(functools.partial(tiled, block_size=16), ARGNUMS))
    clean = fn(x, y, 3.0, -1.0, mask=mask)
    nan_x, nan_y = x.at[35].set(jnp.nan), y.at[36].set(jnp.inf)
    _assert_close(fn(nan_x, nan_y, 3.0, -1.0, mask=mask), clean)


def test_an_all_masked_batch_has_zero_loss_and_gradient():
    x, y = _embeddings(20, 8)
    mask = jnp.zeros(20, bool)
    for name, (tiled, _) in LOSSES.items():
        value, grads = jax.value_and_grad(tiled, ARGNUMS)(x, y, 2.0, 0.5, mask=mask)
        assert float(value) == 0.0, name
        assert all(not np.asarray(g).any() for g in grads), name


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_labels_make_equal_labelled_pairs_positives(name):
    tiled, dense = LOSSES[name]
    n = 70
    x, y = _embeddings(n, 16, n + 11 if name == "info_nce" else None)
    labels = jnp.asarray(np.random.default_rng(1).integers(0, 25, n), jnp.int32)
    mask = jnp.arange(n) % 9 != 4
    fn = jax.jit(jax.value_and_grad(functools.partial(tiled, block_size=16), ARGNUMS))
    got = fn(x, y, 6.0, -2.0, labels=labels, mask=mask)
    want = dense_value_and_grad(dense)(x, y, 6.0, -2.0, labels=labels, mask=mask)
    _assert_close(got, want)
    # Distinct labels are the diagonal positives.
    plain = jax.jit(functools.partial(tiled, block_size=16))(x, y, 6.0, -2.0)
    distinct = jax.jit(functools.partial(tiled, block_size=16))(
        x, y, 6.0, -2.0, labels=jnp.arange(n) * 7
    )
    _assert_close(distinct, plain)
    assert abs(float(got[0]) - float(plain)) > 1e-2  # the labels changed the loss


def test_clip_loss_value_by_hand():
    # Two pairs, orthogonal: logits diag(s), off-diagonal 0; each term log(1 + e^-s).
    a = jnp.eye(2, dtype=jnp.float32)
    loss = losses.clip_loss(a, a, 3.0)
    np.testing.assert_allclose(float(loss), np.log1p(np.exp(-3.0)), rtol=1e-6)
    sig = losses.siglip_loss(a, a, 3.0, -1.0)
    want = (2 * np.log1p(np.exp(-2.0)) + 2 * np.log1p(np.exp(-1.0))) / 2
    np.testing.assert_allclose(float(sig), want, rtol=1e-6)


# ----------------------------------------------------------------------------- memory


def _temp_bytes(fn, *args):
    compiled = jax.jit(jax.value_and_grad(fn, ARGNUMS)).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.hlo
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_value_and_grad_never_holds_an_n_by_n_matrix(name):
    tiled, dense = LOSSES[name]
    n, d = 2048, 64
    x = jax.ShapeDtypeStruct((n, d), jnp.float32)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    square = n * n * 4
    tiled_temp = _temp_bytes(functools.partial(tiled, block_size=256), x, x, s, s)
    dense_temp = _temp_bytes(dense, x, x, s, s)
    assert tiled_temp < 0.1 * square, (tiled_temp, square)
    assert dense_temp > square, (dense_temp, square)


# ----------------------------------------------------------------------------- sharded

MESH = E.data_mesh(AxisType.Auto, "d")


def _towers(seed=3, d=12):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "wx": jax.random.normal(k1, (d, d)) / d**0.5,
        "wy": jax.random.normal(k2, (d, d)) / d**0.5,
        "scale": jnp.float32(4.0),
        "bias": jnp.float32(-2.0),
    }


def _model_loss(name, params, x, y, axis_name=None, **kw):
    tiled, _ = LOSSES[name]
    ex, ey = jnp.tanh(x @ params["wx"]), jnp.tanh(y @ params["wy"])
    return tiled(ex, ey, params["scale"], params["bias"], axis_name=axis_name, block_size=8, **kw)


def _sharded_value_and_grad(name, params, x, y, extra=None, **kw):
    """Per-device values and gradients under shard_map, stacked on a leading device axis."""

    def body(params, x, y, extra, kw):
        params = pcast_to_varying(params, "d")
        if extra is not None:
            y = jnp.concatenate([y, extra])
        value, grads = jax.value_and_grad(
            lambda p: _model_loss(name, p, x, y, axis_name="d", **kw)
        )(params)
        return value[None], jax.tree.map(lambda g: g[None], grads)

    fn = jax.shard_map(
        body, mesh=MESH, in_specs=(P(), P("d"), P("d"), P("d"), P("d")), out_specs=P("d")
    )
    return jax.jit(fn)(params, x, y, extra, kw)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("masked", ["full", "masked", "device_masked"])
def test_shard_map_mean_over_devices_is_the_global_loss_and_gradient(name, masked):
    n, per, d = 8 * 12, 3, 12
    x, y = _embeddings(n, d, seed=4)
    params = _towers()
    # "device_masked": every row of device 0 is padding (its column statistics are empty).
    masks = {"masked": jnp.arange(n) % 5 != 2, "device_masked": jnp.arange(n) >= 12}
    kw = {"mask": masks[masked]} if masked in masks else {}
    extra = None
    if name == "info_nce":  # three extra negatives per device, after its paired keys
        extra = jax.random.normal(jax.random.key(9), (8 * per, d))
    values, grads = _sharded_value_and_grad(name, params, x, y, extra, **kw)
    # Global batch on one device: each device's extra keys follow all the paired keys.
    y_all = y if extra is None else jnp.concatenate([y, extra])
    want_value, want_grads = jax.value_and_grad(lambda p: _model_loss(name, p, x, y_all, **kw))(
        params
    )
    _assert_close(values.mean(), want_value)
    _assert_close(jax.tree.map(lambda g: g.mean(0), grads), want_grads)
    # Each device's gradients are its own: they differ between devices.
    assert float(jnp.abs(grads["wx"][0] - grads["wx"][1]).max()) > 1e-4


def test_shard_map_device_value_is_the_mean_of_its_rows_terms():
    # Without masks each device returns the mean over its rows of the per-row terms
    # (1/2 of both directions for CLIP), the usual data-parallel convention.
    n, d = 8 * 6, 12
    x, y = _embeddings(n, d, seed=5)
    params = _towers()
    values, _ = _sharded_value_and_grad("clip", params, x, y)
    ex, ey = jnp.tanh(x @ params["wx"]), jnp.tanh(y @ params["wy"])
    s = _logits(ex, ey, params["scale"])
    eye = jnp.eye(n, dtype=bool)
    terms = 0.5 * (_soft_ce(s, eye, eye[0] | True) + _soft_ce(s.T, eye, eye[0] | True))
    _assert_close(values, terms.reshape(8, 6).mean(1))


def test_shard_map_accumulate_takes_the_global_batch_step():
    # accumulate(axis_name=...) with the loss's per-device gradients: K = 2 micro-steps on 8
    # devices give the parameters of one SGD step on the 2 global batches' mean gradient.
    n, d, k = 8 * 8, 12, 2
    params = _towers()
    batches = [_embeddings(n, d, seed=10 + i) for i in range(k)]
    tx = ga.accumulate(optax.sgd(0.5), every_k_schedule=k, axis_name="d")
    specs = ga.replica_state_specs(jax.eval_shape(tx.init, params), "d")

    def step(params, state, x, y):
        grads = jax.grad(lambda p: _model_loss("clip", p, x, y, axis_name="d"))(
            pcast_to_varying(params, "d")
        )
        updates, state = tx.update(grads, ga.remove_replica_axis(state), params)
        return optax.apply_updates(params, updates), ga.add_replica_axis(state)

    init = jax.jit(
        jax.shard_map(
            lambda p: ga.add_replica_axis(tx.init(p)), mesh=MESH, in_specs=P(), out_specs=specs
        )
    )
    step = jax.jit(
        jax.shard_map(
            step,
            mesh=MESH,
            in_specs=(P(), specs, P("d"), P("d")),
            out_specs=(P(), specs),
        )
    )
    p, state = params, init(params)
    for x, y in batches:
        p, state = step(p, state, x, y)
    grads = [jax.grad(lambda q, x=x, y=y: _model_loss("clip", q, x, y))(params) for x, y in batches]
    want = jax.tree.map(lambda w, g0, g1: w - 0.5 * (g0 + g1) / 2, params, *grads)
    _assert_close(p, want)


def test_shard_map_over_two_mesh_axes():
    # axis_name=("x", "y"): rows are numbered in all_gather's order over both axes, so the
    # default diagonal positives pair the right rows.
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto, AxisType.Auto))
    x, y = _embeddings(8 * 5, 12, seed=11)
    params = _towers()

    def body(params, x, y):
        params = pcast_to_varying(params, ("x", "y"))
        value, grads = jax.value_and_grad(
            lambda p: _model_loss("clip", p, x, y, axis_name=("x", "y"))
        )(params)
        return jax.lax.pmean(value, ("x", "y")), jax.lax.pmean(grads, ("x", "y"))

    spec = P(("x", "y"))
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), spec, spec), out_specs=(P(), P())))(
        params, x, y
    )
    want = jax.value_and_grad(lambda p: _model_loss("clip", p, x, y))(params)
    _assert_close(got, want)


def test_pmap_mean_over_devices_is_the_global_loss():
    n, d = 8 * 4, 12
    x, y = _embeddings(n, d, seed=6)
    params = _towers()

    def local(params, x, y):
        return jax.value_and_grad(lambda p: _model_loss("siglip", p, x, y, axis_name="d"))(params)

    values, grads = jax.pmap(local, axis_name="d", in_axes=(None, 0, 0))(
        params, x.reshape(8, 4, d), y.reshape(8, 4, d)
    )
    want_value, want_grads = jax.value_and_grad(lambda p: _model_loss("siglip", p, x, y))(params)
    _assert_close(values.mean(), want_value)
    _assert_close(jax.tree.map(lambda g: g.mean(0), grads), want_grads)


EXPLICIT_NEEDS = pytest.mark.requires(
    "jax 0.8.1 refuses the tiles' products on Explicit axes (ShardingTypeError, measured)",
    jax="0.9.0",
)


@pytest.mark.parametrize(
    "axis_type",
    [pytest.param(AxisType.Explicit, marks=EXPLICIT_NEEDS), AxisType.Auto],
    ids=str,
)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_global_view_jit_with_a_sharded_batch(name, axis_type):
    mesh = E.data_mesh(axis_type, "d")
    n, d = 8 * 10, 12
    m = n + 16 if name == "info_nce" else None
    x, y = _embeddings(n, d, m, seed=7)
    mask = jnp.arange(n) % 6 != 1
    params = _towers()
    spec = NamedSharding(mesh, P("d"))
    sx, sy, smask = (jax.device_put(v, spec) for v in (x, y, mask))
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(lambda p, x, y, m: _model_loss(name, p, x, y, mask=m)))(
            params, sx, sy, smask
        )
    want = jax.value_and_grad(lambda p: _model_loss(name, p, x, y, mask=mask))(params)
    _assert_close(got, want)


# ----------------------------------------------------------------------------- bad input


def _x(*shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: losses.clip_loss(_x(4, 8), _x(4, 6), 1.0), ValueError, "feature dimensions"),
        (lambda: losses.clip_loss(_x(4, 8), _x(5, 8), 1.0), ValueError, "same number of rows"),
        (lambda: losses.info_nce(_x(5, 8), _x(4, 8), 1.0), ValueError, "at least as many rows"),
        (lambda: losses.clip_loss(_x(4, 8, 2), _x(4, 8), 1.0), ValueError, "a has shape"),
        (lambda: losses.siglip_loss(_x(4, 8), _x(4), 1.0, 0.0), ValueError, "b has shape"),
        (
            lambda: losses.clip_loss(_x(4, 8, dtype=jnp.int32), _x(4, 8), 1.0),
            TypeError,
            r"a has dtype int32.*astype",
        ),
        (lambda: losses.clip_loss(_x(4, 8), _x(4, 8), _x(2)), ValueError, "scale has shape"),
        (lambda: losses.siglip_loss(_x(4, 8), _x(4, 8), 1.0, _x(4)), ValueError, "bias"),
        (
            lambda: losses.clip_loss(_x(4, 8), _x(4, 8), 1.0, block_size=4),
            ValueError,
            "block_size=4",
        ),
        (
            lambda: losses.clip_loss(_x(4, 8), _x(4, 8), 1.0, block_size=64.0),
            ValueError,
            "block_size=64.0",
        ),
        (
            lambda: losses.clip_loss(_x(4, 8), _x(4, 8), 1.0, mask=jnp.ones(3, bool)),
            ValueError,
            r"mask has shape \(3,\): expected \(4,\)",
        ),
        (
            lambda: losses.info_nce(_x(4, 8), _x(6, 8), 1.0, mask=jnp.ones(4)),
            TypeError,
            "mask has dtype float32",
        ),
        (
            lambda: losses.siglip_loss(_x(4, 8), _x(4, 8), 1.0, 0.0, labels=jnp.ones(4)),
            TypeError,
            "labels has dtype float32",
        ),
        (
            lambda: losses.clip_loss(_x(4, 8), _x(4, 8), 1.0, axis_name="batch"),
            ValueError,
            "axis_name='batch'.*not bound",
        ),
    ],
)
def test_bad_input_names_the_argument_and_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


@EXPLICIT_NEEDS
def test_global_view_extra_keys_that_do_not_split_evenly():
    # 4 extra keys over 8 devices: every device computes the whole loss (replicated rows).
    mesh = E.data_mesh(AxisType.Explicit, "d")
    q, k = _embeddings(48, 12, 52, seed=8)
    sq = jax.device_put(q, NamedSharding(mesh, P("d")))
    sk = jax.device_put(k, NamedSharding(mesh, P()))
    fn = jax.value_and_grad(lambda q, k: losses.info_nce(q, k, 3.0, block_size=16), (0, 1))
    with jax.set_mesh(mesh):
        got = jax.jit(fn)(sq, sk)
    _assert_close(got, fn(q, k))


# ----------------------------------------------------------------------------- precision


def _assert_cells_read_as_the_docs_say(rows):
    """docs/losses.md's reading of the precision table's cells of 0, inf and about 1."""
    for r in rows:
        for column in ("dense", "tiled"):
            err, zero = r[f"err_{column}"], r[f"zero_{column}"]
            if err == 0:  # both exactly 0
                assert r["truth_norm"] == 0 and zero, r
            if err == np.inf:  # the truth is 0, the loss's gradient is not
                assert r["truth_norm"] == 0 and not zero, r
        if r["err_tiled"] >= 0.5:
            # The tiles' 1s are zeros, where every term is below float32's normal numbers
            # (XLA flushes smaller ones); the dense loss is no better there.
            assert r["zero_tiled"] and r["err_tiled"] == 1, r
            assert 0 < r["max_term"] < np.finfo(np.float32).tiny, r
            assert r["zero_dense"] or r["err_dense"] >= 0.5, r
        elif r["err_dense"] >= 0.5:
            # The dense loss alone: its softmax positives' p - 1 rounded, not zeros.
            assert r["loss"] != "siglip_loss" and not r["zero_dense"], r


@pytest.mark.parametrize("name", precision.NAMES)
def test_gradient_error_is_within_10x_dense_float32_at_every_scale(name):
    # Against float64 truth, at scales 1 to 1e4, on random, aligned and easy batches (a
    # loss near 0, where p - onehot at the positive must not be a difference near 1), and
    # on the low-loss batch of issue 40 at its own size.
    rows = precision.table(128, 256, 32, names=(name,))
    assert len(rows) == len(precision.SCALES) * (len(precision.KINDS) + 1)
    assert {r["batch"] for r in rows} == {*precision.KINDS, precision.LOW_LOSS[0]}
    assert all(row["within_10x_dense"] for row in rows), [
        row for row in rows if not row["within_10x_dense"]
    ]
    _assert_cells_read_as_the_docs_say(rows)


def test_published_precision_table_reads_as_the_docs_say():
    # The table docs/losses.md shows (rows.json, N = 512): every cell within 10x dense,
    # and its cells of 0, inf and about 1 what the page says they are.
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "rows.json"
    rows = json.loads(path.read_text())["contrastive_precision"]
    assert len(rows) == len(precision.NAMES) * len(precision.SCALES) * (len(precision.KINDS) + 1)
    assert all(row["within_10x_dense"] for row in rows)
    _assert_cells_read_as_the_docs_say(rows)


def _decimal_grads(name, a, b, scale):
    """The softmax losses' gradients w.r.t. `(a, b, scale)` in 50-digit decimal arithmetic."""

    def softmax_minus_target(logits):  # the target of row i is column i
        out = []
        for i, row in enumerate(logits):
            top = max(row)
            e = [(x - top).exp() for x in row]
            total = sum(e)
            out.append([x / total - (1 if j == i else 0) for j, x in enumerate(e)])
        return out

    with decimal.localcontext() as context:
        context.prec = 50
        x = [[decimal.Decimal(float(v)) for v in row] for row in a]
        y = [[decimal.Decimal(float(v)) for v in row] for row in b]
        n, m, d = len(x), len(y), len(x[0])
        raw = [[sum(p * q for p, q in zip(xi, yj, strict=True)) for yj in y] for xi in x]
        s = [[scale * v for v in row] for row in raw]
        ds = softmax_minus_target(s)
        if name == "clip_loss":
            cols = softmax_minus_target([list(col) for col in zip(*s, strict=True)])
            ds = [[(ds[i][j] + cols[j][i]) / 2 for j in range(m)] for i in range(n)]
        ds = [[v / n for v in row] for row in ds]
        da = [
            [scale * sum(ds[i][j] * y[j][k] for j in range(m)) for k in range(d)] for i in range(n)
        ]
        db = [
            [scale * sum(ds[i][j] * x[i][k] for i in range(n)) for k in range(d)] for j in range(m)
        ]
        dscale = sum(ds[i][j] * raw[i][j] for i in range(n) for j in range(m))
        return [np.array(da, np.float64), np.array(db, np.float64), np.array(float(dscale))]


@pytest.mark.parametrize("name", ["clip_loss", "info_nce"])
def test_low_loss_batch_gradient_matches_exact_arithmetic(name):
    # Issue 40's low-loss batch (32 pairs, D = 16, positives within 1e-3) at scale 100: the
    # true gradient is about 1e-18, and each positive's 1 - p is below float64's spacing
    # near 1, so a reference that forms p - 1 by subtraction (float64 autodiff of the dense
    # loss) drops it; the tiles keep it, as the benchmark's truth does.
    _, kind, n, d, seed = precision.LOW_LOSS
    a, b = precision.batch(name, n, d, kind, seed)
    exact = _decimal_grads(name, a, b, 100)
    assert 1e-19 < max(float(np.abs(g).max()) for g in exact) < 1e-17
    raw = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
    others = [-np.diag(precision._softmax_minus_target(100 * raw))]  # 1 - p per positive
    if name == "clip_loss":
        others.append(-np.diag(precision._softmax_minus_target(100 * raw.T)))
    assert max(float(x.max()) for x in others) < np.finfo(np.float64).eps / 2
    truth = precision.float64_grads(name, a, b, 100.0, 0.0)
    assert precision.rel_error(truth, exact) < 1e-12
    subtracted = precision.float64_grads(name, a, b, 100.0, 0.0, subtract=True)
    assert precision.rel_error(subtracted, exact) > 1
    loss = getattr(losses, name)
    tiled = jax.jit(jax.grad(lambda a, b, s: loss(a, b, s), (0, 1, 2)))(a, b, 100.0)
    assert precision.rel_error(tiled, exact) < 2e-5  # measured 5e-6
    # What a sign-based optimizer (or Adam with a small eps) steps by: every entry's sign.
    for got, want in zip(tiled, exact, strict=True):
        np.testing.assert_array_equal(np.sign(got), np.sign(want))


def test_easy_batch_gradient_is_small_not_rounding_noise():
    # Positives within 1e-3 at scale 100: the true gradient is about 1e-24, and a backward
    # that forms 1 - p by subtraction returns noise of about 1e-7 instead.
    a, b = precision.batch("info_nce", 64, 32, "easy")
    grads = jax.grad(lambda a, b: losses.info_nce(a, b, 100.0, block_size=16), (0, 1))(a, b)
    truth = precision.float64_grads("info_nce", a, b, 100.0, 0.0)
    assert max(float(np.abs(w).max()) for w in truth[:2]) < 1e-15
    assert precision.rel_error(grads, truth[:2]) < 1e-4


# ----------------------------------------------------------------------------- global view


def _trip_counts(compiled):
    return sorted(
        int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', compiled.as_text())
    )


@pytest.mark.hlo
@pytest.mark.parametrize(
    "axis_type",
    [pytest.param(AxisType.Explicit, marks=EXPLICIT_NEEDS), AxisType.Auto],
    ids=str,
)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_global_view_each_device_runs_only_its_rows_tiles(name, axis_type):
    # 256 rows in tiles of 16 on 8 devices: each device runs 2 row tiles against all 16
    # column tiles (20 with info_nce's 64 extra keys), forward and backward. Before,
    # Auto axes ran all 16 x 16 tiles on every device.
    mesh = E.data_mesh(axis_type, "d")
    n, d = 256, 8
    m = n + 64 if name == "info_nce" else n
    x, y = _embeddings(n, d, m, seed=12)
    spec = NamedSharding(mesh, P("d"))
    sx, sy = jax.device_put(x, spec), jax.device_put(y, spec)
    tiled, _ = LOSSES[name]
    fn = jax.value_and_grad(lambda x, y: tiled(x, y, 3.0, -1.0, block_size=16), (0, 1))
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(sx, sy).compile()
        got = compiled(sx, sy)
    cols = m // 16
    assert _trip_counts(compiled) == sorted([2, 2, cols, cols])
    _assert_close(got, fn(x, y))


@pytest.mark.hlo
def test_global_view_auto_mesh_spreads_unsharded_rows_too():
    # Replicated inputs under an Auto mesh (or sharded ones without a mesh context) are
    # spread over the devices as well; the result is the one-device loss.
    mesh = E.data_mesh(AxisType.Auto, "d")
    x, y = _embeddings(256, 8, seed=13)
    fn = jax.value_and_grad(lambda x, y: losses.clip_loss(x, y, 3.0, block_size=16), (0, 1))
    with jax.set_mesh(mesh):
        replicated = jax.jit(fn).lower(x, y).compile()
    spec = NamedSharding(mesh, P("d"))
    sx, sy = jax.device_put(x, spec), jax.device_put(y, spec)
    no_context = jax.jit(fn).lower(sx, sy).compile()
    for compiled, args in ((replicated, (x, y)), (no_context, (sx, sy))):
        assert _trip_counts(compiled) == [2, 2, 16, 16]
        _assert_close(compiled(*args), fn(x, y))
