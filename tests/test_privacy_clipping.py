"""Tests for per-example clipping (gradaccum_jax._privacy.clipping): `privacy.clipped_grad`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from gradaccum_jax import privacy

N, D_IN, D_HID, D_OUT = 16, 5, 7, 3
C = 0.5
# The tests of the promises both ways of clipping keep, run on each.
METHOD = pytest.mark.parametrize("method", ["fast", "per_example"])


def NEEDS_JAX_PRIVACY(test):
    """jax_privacy 2.0 (the reference) needs optax >= 0.2.8, newer than the oldest stack's."""
    requires = pytest.mark.requires("jax_privacy 2.0 needs optax>=0.2.8", optax="0.2.8")
    # jax_privacy 2.0 calls optax.global_norm, which optax 0.2.8 deprecates.
    quiet = pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated:DeprecationWarning")
    return requires(quiet(test))


def init(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (D_IN, D_HID), dtype),
        "b1": jnp.zeros(D_HID, dtype),
        "w2": jax.random.normal(k2, (D_HID, D_OUT), dtype),
    }


def data(n=N, dtype=jnp.float32, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, D_IN), dtype), jax.random.normal(ky, (n, D_OUT), dtype)


def loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def reference(params, batch, keep):
    """float64 numpy: vmap(grad) per example, clip to C, sum over the kept examples."""
    x, y = batch
    per_example = jax.vmap(lambda xi, yi: jax.value_and_grad(loss)(params, (xi[None], yi[None])))
    losses, grads = jax.tree.map(lambda a: np.asarray(a, np.float64), per_example(x, y))
    norms = np.sqrt(sum(np.sum(g.reshape(len(keep), -1) ** 2, 1) for g in grads.values()))
    factor = np.where(keep, np.minimum(1.0, C / norms), 0.0)
    grad_sum = {k: np.tensordot(factor, g, 1) for k, g in grads.items()}
    return np.sum(np.where(keep, losses, 0.0)), grad_sum


def assert_tree_close(got, want, rtol, atol=0.0):
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), want[key], rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "chunks", [{}, {"num_microbatches": 4}, {"microbatch_size": 2}, {"microbatch_size": 16}]
)
@METHOD
def test_equals_vmap_grad_clip_sum_reference(chunks, method, x64):
    # float64, so that the comparison sees the rule and not the order of float32 sums.
    with x64():
        params, batch = init(jnp.float64), data(dtype=jnp.float64)
        keep = np.ones(N, bool)
        loss_sum, grad_sum = jax.jit(privacy.clipped_grad(loss, C, **chunks, method=method))(
            params, batch
        )
        want_loss, want_grads = reference(params, batch, keep)
    np.testing.assert_allclose(loss_sum, want_loss, rtol=1e-6)
    assert_tree_close(grad_sum, want_grads, rtol=1e-6)
    # Some examples are clipped and some are not: the test sees both branches.
    assert loss_sum.dtype == jnp.float64


def test_float32_within_rounding_of_the_reference():
    params, batch = init(), data()
    loss_sum, grad_sum = jax.jit(privacy.clipped_grad(loss, C, num_microbatches=4))(params, batch)
    want_loss, want_grads = reference(params, batch, np.ones(N, bool))
    np.testing.assert_allclose(loss_sum, want_loss, rtol=1e-6)
    # float32 sums of 16 terms of norm <= C: absolute error a few ulps of C.
    assert_tree_close(grad_sum, want_grads, rtol=1e-5, atol=1e-6)
    assert {k: v.dtype for k, v in grad_sum.items()} == dict.fromkeys(grad_sum, jnp.float32)


@NEEDS_JAX_PRIVACY
@pytest.mark.parametrize("microbatch_size", [None, 4])
def test_equals_jax_privacy_clipped_grad(microbatch_size, x64):
    from jax_privacy import clipping

    padding = np.arange(N) >= 11
    with x64():
        params, batch = init(jnp.float64), data(dtype=jnp.float64)
        ours = privacy.clipped_grad(loss, C, microbatch_size=microbatch_size)
        theirs = clipping.clipped_grad(loss, l2_clip_norm=C, microbatch_size=microbatch_size)
        _, got = jax.jit(ours)(params, batch, is_padding_example=padding)
        want = jax.jit(theirs)(params, batch, is_padding_example=padding)
    assert_tree_close(got, jax.tree.map(np.asarray, want), rtol=1e-6)


@NEEDS_JAX_PRIVACY
def test_float32_equals_jax_privacy_in_one_chunk():
    # One vmap over the batch on both sides: the same float32 sums, to rtol 1e-6.
    from jax_privacy import clipping

    params, batch = init(), data()
    _, got = jax.jit(privacy.clipped_grad(loss, C))(params, batch)
    want = jax.jit(clipping.clipped_grad(loss, l2_clip_norm=C))(params, batch)
    assert_tree_close(got, jax.tree.map(np.asarray, want), rtol=1e-6, atol=1e-7)


@METHOD
def test_padding_contributes_exactly_zero(method):
    params, (x, y) = init(), data()
    padding = np.arange(N) >= 10
    fn = jax.jit(privacy.clipped_grad(loss, C, microbatch_size=4, method=method))
    loss_sum, grad_sum = fn(params, (x, y), is_padding_example=padding)
    want_loss, want = reference(params, (x, y), ~padding)
    np.testing.assert_allclose(loss_sum, want_loss, rtol=1e-6)
    assert_tree_close(grad_sum, want, rtol=1e-5, atol=1e-6)
    # Padding rows hold garbage, even NaN: a select, not a product, keeps it out, bit for bit.
    x_bad = x.at[12].set(jnp.nan).at[13].set(1e30).at[10].set(-7.0)
    bad_loss, bad = fn(params, (x_bad, y), is_padding_example=padding)
    assert float(bad_loss) == float(loss_sum)
    for got, clean in zip(jax.tree.leaves(bad), jax.tree.leaves(grad_sum), strict=True):
        np.testing.assert_array_equal(got, clean)
    zero_loss, zeros = fn(params, (x_bad, y), is_padding_example=np.ones(N, bool))
    assert float(zero_loss) == 0.0
    for leaf in jax.tree.leaves(zeros):
        np.testing.assert_array_equal(leaf, 0.0)


def test_all_padding_chunks_are_not_computed():
    calls = []

    def counted_loss(params, batch):
        # Under vmap the callback runs once per chunk that is computed.
        jax.debug.callback(lambda: calls.append(1))
        return loss(params, batch)

    params, batch = init(), data()
    fn = jax.jit(privacy.clipped_grad(counted_loss, C, microbatch_size=4))
    # Chunks 1 and 3 are all padding; chunk 2 has one real example among three padding ones.
    padding = np.ones(N, bool)
    padding[[0, 1, 2, 3, 8]] = False
    jax.block_until_ready(fn(params, batch, is_padding_example=padding))
    assert len(calls) == 2  # chunks 0 and 2
    calls.clear()
    jax.block_until_ready(fn(params, batch))
    assert len(calls) == 4


def loss_with_log(params, batch):
    x, _ = batch
    # For x[:, 0] < -10, log of a negative number: NaN in the gradient of "b1" only.
    return loss(params, batch) + jnp.sum(jnp.log(x[:, 0] + 10.0) * params["b1"][0])


@METHOD
def test_non_finite_example_is_dropped_whole(method):
    params, (x, y) = init(), data()
    x = x.at[5, 0].set(-20.0)
    grads_5 = jax.grad(loss_with_log)(params, (x[5:6], y[5:6]))
    assert not np.isfinite(grads_5["b1"]).all() and np.isfinite(grads_5["w2"]).all()
    fn = jax.jit(privacy.clipped_grad(loss_with_log, C, num_microbatches=2, method=method))
    loss_sum, grad_sum = fn(params, (x, y))
    dropped = np.arange(N) == 5
    want_loss, want = fn(params, (x, y), is_padding_example=dropped)
    np.testing.assert_allclose(loss_sum, want_loss, rtol=1e-6)
    for got, expected in zip(jax.tree.leaves(grad_sum), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    # An overflowing input that makes the whole gradient infinite is dropped too.
    x_inf = x.at[5, 0].set(0.0).at[3].set(jnp.inf)
    _, grad_inf = fn(params, (x_inf, y))
    _, want_inf = fn(params, (x_inf, y), is_padding_example=np.arange(N) == 3)
    for got, expected in zip(jax.tree.leaves(grad_inf), jax.tree.leaves(want_inf), strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def dropout_loss(params, key, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = jnp.where(jax.random.bernoulli(key, 0.5, h.shape), 2.0 * h, 0.0)
    return jnp.mean((h @ params["w2"] - y) ** 2)


@METHOD
def test_per_example_keys(method):
    params, (x, y) = init(), data()
    key = jax.random.key(7)
    fn = jax.jit(
        privacy.clipped_grad(
            dropout_loss, C, num_microbatches=4, batch_argnums=2, prng_argnum=1, method=method
        )
    )
    _, got = fn(params, key, (x, y))
    keys = jax.random.split(key, N)
    grads = jax.vmap(lambda k, xi, yi: jax.grad(dropout_loss)(params, k, (xi[None], yi[None])))(
        keys, x, y
    )
    norms = np.sqrt(sum(np.sum(np.square(g).reshape(N, -1), 1) for g in jax.tree.leaves(grads)))
    factor = np.minimum(1.0, C / norms)
    for k in got:
        np.testing.assert_allclose(got[k], np.tensordot(factor, grads[k], 1), rtol=1e-5, atol=1e-6)
    # Each example has its own mask: the same key for all would give another sum.
    same = jax.vmap(lambda xi, yi: jax.grad(dropout_loss)(params, key, (xi[None], yi[None])))(x, y)
    assert not np.allclose(np.sum(same["w2"], 0), got["w2"], atol=1e-3)


@NEEDS_JAX_PRIVACY
def test_per_example_keys_equal_jax_privacy():
    from jax_privacy import clipping

    params, batch = init(), data()
    key = jax.random.key(3)
    _, got = jax.jit(privacy.clipped_grad(dropout_loss, C, batch_argnums=2, prng_argnum=1))(
        params, key, batch
    )
    theirs = clipping.clipped_grad(dropout_loss, l2_clip_norm=C, batch_argnums=2, prng_argnum=1)
    want = jax.jit(theirs)(params, key, batch)
    assert_tree_close(got, jax.tree.map(np.asarray, want), rtol=1e-6, atol=1e-7)


@METHOD
def test_has_aux_returns_per_example_aux(method):
    def loss_aux(params, batch):
        value = loss(params, batch)
        return value, {"loss": value}

    params, batch = init(), data()
    padding = np.arange(N) >= 12
    fn = jax.jit(privacy.clipped_grad(loss_aux, C, microbatch_size=4, has_aux=True, method=method))
    (loss_sum, aux), grad_sum = fn(params, batch, is_padding_example=padding)
    want_loss, want = reference(params, batch, ~padding)
    assert aux["loss"].shape == (N,)
    np.testing.assert_allclose(loss_sum, want_loss, rtol=1e-6)
    np.testing.assert_allclose(np.sum(aux["loss"]), want_loss, rtol=1e-6)
    np.testing.assert_array_equal(aux["loss"][12:], 0.0)
    assert_tree_close(grad_sum, want, rtol=1e-5, atol=1e-6)


@METHOD
def test_bfloat16_gradients_are_summed_in_float32(method):
    params, batch = init(jnp.bfloat16), data(dtype=jnp.bfloat16)
    _, grad_sum = jax.jit(privacy.clipped_grad(loss, C, method=method))(params, batch)
    assert {v.dtype for v in grad_sum.values()} == {jnp.dtype(jnp.float32)}
    _, grad_16 = jax.jit(
        privacy.clipped_grad(loss, C, accumulator_dtype=jnp.bfloat16, method=method)
    )(params, batch)
    assert {v.dtype for v in grad_16.values()} == {jnp.dtype(jnp.bfloat16)}


def test_keeps_the_clip_norm_for_the_noisy_window():
    fn = privacy.clipped_grad(loss, 2)
    assert fn.l2_clip_norm == 2.0 and isinstance(fn.l2_clip_norm, float)
    assert fn.loss_fn is loss
    assert "l2_clip_norm=2.0" in repr(fn)


@pytest.mark.parametrize("window_clip", [C, 2 * C])
def test_noisy_window_refuses_sums_clipped_to_another_norm(window_clip):
    params, batch = init(), data()
    clipped = privacy.clipped_grad(loss, C)
    tx = privacy.dp_accumulate(
        optax.sgd(0.1),
        2,
        l2_clip_norm=window_clip,
        noise_multiplier=1.0,
        expected_batch_size=N,
        key=jax.random.key(0),
    )

    @jax.jit
    def step(params, state, batch):
        _, grad_sum = clipped(params, batch)
        return tx.update(grad_sum, state, params)

    if window_clip == C:
        jax.block_until_ready(step(params, tx.init(params), batch))
    else:
        with pytest.raises(ValueError, match=r"clipped to l2_clip_norm=0.5 \(by clipped_grad\)"):
            step(params, tx.init(params), batch)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"l2_clip_norm": 0.0}, ValueError, "l2_clip_norm must be finite and > 0"),
        ({"l2_clip_norm": float("inf")}, ValueError, "l2_clip_norm"),
        ({"l2_clip_norm": jnp.array(1.0)}, TypeError, "Python number"),
        ({"num_microbatches": 2, "microbatch_size": 2}, ValueError, "at most one"),
        ({"num_microbatches": 0}, ValueError, "num_microbatches must be an int >= 1"),
        ({"argnums": 1}, ValueError, "must not overlap"),
        ({"prng_argnum": 0}, ValueError, "prng_argnum must be an argument of its own"),
        ({"has_aux": 1}, TypeError, "has_aux must be a bool"),
    ],
)
def test_construction_errors_name_the_argument(kwargs, error, match):
    kwargs = {"l2_clip_norm": C, **kwargs}
    with pytest.raises(error, match=match):
        privacy.clipped_grad(loss, **kwargs)


def test_trace_errors_name_the_fix():
    params, (x, y) = init(), data()
    with pytest.raises(ValueError, match="num_microbatches=3 must divide the batch size 16"):
        privacy.clipped_grad(loss, C, num_microbatches=3)(params, (x, y))
    with pytest.raises(ValueError, match="is_padding_example must be a bool array of shape"):
        privacy.clipped_grad(loss, C)(params, (x, y), is_padding_example=np.zeros(N))
    with pytest.raises(ValueError, match="leading axis, all of one size"):
        privacy.clipped_grad(loss, C)(params, (x, y[:3]))
    with pytest.raises(ValueError, match="called with 1 positional"):
        privacy.clipped_grad(loss, C)(params)


def test_a_chunk_size_that_does_not_divide_a_devices_share_says_it_is_a_share(explicit_mesh):
    # Issue 50, item 6: under global-view jit on 8 devices a batch of 64 is 8 examples per
    # device, and microbatch_size counts one device's examples: the error said "must divide
    # the batch size 8", which a global-view user reads as a wrong count of their batch.
    params = init()
    x = jnp.ones((64, *data()[0].shape[1:]))
    y = jnp.ones((64, *data()[1].shape[1:]))
    fn = jax.jit(privacy.clipped_grad(loss, C, microbatch_size=16))
    with jax.set_mesh(explicit_mesh):
        batch = jax.device_put((x, y), jax.sharding.NamedSharding(explicit_mesh, P("data")))
        with pytest.raises(ValueError, match=r"microbatch_size=16 must divide the batch size 8 "
                           r"\(8 examples: each device's share of the batch, which is split over "
                           r"the mesh axes \('data',\)"):  # fmt: skip
            fn(params, batch)


@pytest.mark.parametrize("extra", ["huge", "nan_in_one_leaf", "inf", "zero", "ordinary"])
@METHOD
def test_one_example_moves_the_sum_by_at_most_the_clip_norm(extra, method):
    # Add/remove neighbours: the same batch with and without example 0, whatever it holds.
    params, (x, y) = init(), data()
    values = {"huge": 1e6, "nan_in_one_leaf": -20.0, "inf": jnp.inf, "zero": 0.0, "ordinary": 0.3}
    x = x.at[0].set(values[extra])
    if extra == "zero":
        x, y = x.at[0].set(0.0), y.at[0].set(0.0)
    fn = jax.jit(privacy.clipped_grad(loss_with_log, C, num_microbatches=4, method=method))
    _, with_it = fn(params, (x, y))
    _, without = fn(params, (x, y), is_padding_example=np.arange(N) == 0)
    moved = np.sqrt(
        sum(
            np.sum((np.asarray(a) - np.asarray(b)) ** 2)
            for a, b in zip(jax.tree.leaves(with_it), jax.tree.leaves(without), strict=True)
        )
    )
    assert np.isfinite(moved)
    assert moved <= C * (1 + 1e-5)
    if extra == "huge":  # clipped to norm C, not dropped
        assert moved > 0.9 * C


def test_raw_uint32_keys_are_split_too():
    params, batch = init(), data()
    raw = jax.random.PRNGKey(5)
    typed = jax.random.wrap_key_data(raw)
    fn = jax.jit(privacy.clipped_grad(dropout_loss, C, batch_argnums=2, prng_argnum=1))
    _, from_raw = fn(params, raw, batch)
    _, from_typed = fn(params, typed, batch)
    for a, b in zip(jax.tree.leaves(from_raw), jax.tree.leaves(from_typed), strict=True):
        np.testing.assert_array_equal(a, b)


@METHOD
def test_inside_shard_map_each_device_clips_its_own_examples(method, auto_mesh):
    # Replicated params: shard_map's transpose would sum each parameter gradient over the
    # devices, mixing one example of every device before clipping. The psum of the
    # devices' clipped sums must equal the clipped sum of the whole batch.
    mesh = auto_mesh
    params, batch = init(), data(n=32)
    padding = np.arange(32) % 5 == 0
    fn = privacy.clipped_grad(loss, C, microbatch_size=2, method=method)

    @jax.jit
    def sharded(params, batch, padding):
        def body(params, batch, padding):
            loss_sum, grad_sum = fn(params, batch, is_padding_example=padding)
            return jax.lax.psum((loss_sum, grad_sum), "data")

        specs = (P(), P("data"), P("data"))
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())(params, batch, padding)

    loss_sum, grad_sum = sharded(params, batch, padding)
    want_loss, want = reference(params, batch, ~padding)
    np.testing.assert_allclose(loss_sum, want_loss, rtol=1e-5)
    assert_tree_close(grad_sum, want, rtol=1e-5, atol=1e-6)


def _masked_loss(params, key, batch):
    """`dropout_loss` returning its mask as aux (one row per example)."""
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    return jnp.mean((jnp.where(keep, 2.0 * h, 0.0) @ params["w2"] - y) ** 2), keep


@pytest.mark.parametrize("route", ["shard_map", "shard_map, check_vma=False", "pmap"])
@pytest.mark.parametrize("raw", [False, True], ids=["typed key", "raw key"])
@METHOD
def test_keys_under_a_users_map_are_the_whole_batchs(route, raw, method, x64):
    # Issue 44 item 8: each device split its replicated key over its own examples, so
    # example i of every device drew the same dropout mask; each device now takes its
    # slice of the whole batch's keys, as one device does.
    n, devices = 32, 8
    params, batch = init(), data(n=n)
    key = jax.random.PRNGKey(7) if raw else jax.random.key(7)
    fn = privacy.clipped_grad(
        _masked_loss, C, batch_argnums=2, prng_argnum=1, has_aux=True, method=method
    )
    with x64():
        params64, batch64 = jax.tree.map(lambda a: a.astype(jnp.float64), (params, batch))
        (want_loss, want_masks), want = jax.jit(fn)(params64, key, batch64)

        def body(params, key, batch):
            (loss_sum, masks), grad_sum = fn(params, key, batch)
            return jax.lax.psum((loss_sum, grad_sum), "data"), masks

        if route == "pmap":
            local = jax.tree.map(lambda a: a.reshape(devices, n // devices, *a.shape[1:]), batch64)
            mapped = jax.pmap(body, axis_name="data", in_axes=(None, None, 0))
            (loss_sum, grad_sum), masks = mapped(params64, key, local)
            loss_sum, grad_sum = loss_sum[0], jax.tree.map(lambda g: g[0], grad_sum)
            masks = masks.reshape(n, -1)
        else:
            mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
            sharded = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(), P(), P("data")),
                out_specs=(P(), P("data")),
                check_vma=route == "shard_map",
            )
            (loss_sum, grad_sum), masks = jax.jit(sharded)(params64, key, batch64)
    masks = np.asarray(masks).reshape(devices, n // devices, -1)
    # Example 0 of each device: eight masks of D_HID bits, not all one.
    assert len({m.tobytes() for m in masks[:, 0]}) > 1
    np.testing.assert_array_equal(masks.reshape(n, -1), np.asarray(want_masks).reshape(n, -1))
    np.testing.assert_allclose(loss_sum, want_loss, rtol=1e-12)
    assert_tree_close(grad_sum, jax.tree.map(np.asarray, want), rtol=1e-12, atol=1e-14)


def test_a_key_already_folded_per_device_is_split_as_it_is(auto_mesh):
    # The caller's own fold (the key varying over the batch's axis) is not folded again:
    # each device's examples take jax.random.split(its key, n), as on one device.
    mesh = auto_mesh
    params, batch = init(), data(n=16)
    key = jax.random.key(3)
    fn = privacy.clipped_grad(_masked_loss, C, batch_argnums=2, prng_argnum=1, has_aux=True)

    def body(params, key, batch):
        own = jax.random.fold_in(key, jax.lax.axis_index("data"))
        return fn(params, own, batch)[0][1]

    specs = (P(), P(), P("data"))
    masks = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("data")))(
        params, key, batch
    )
    for device in (0, 5):
        own = jax.random.fold_in(key, device)
        local = jax.tree.map(lambda a, d=device: a[2 * d : 2 * d + 2], batch)
        want = jax.jit(fn)(params, own, local)[0][1]
        np.testing.assert_array_equal(masks[2 * device : 2 * device + 2], want)
