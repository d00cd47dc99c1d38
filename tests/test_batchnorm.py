"""AccumBatchNorm: running statistics equal nn.BatchNorm on the concatenated window."""

from __future__ import annotations

import functools
import pathlib
import re

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax.flax import AccumBatchNorm, NNXAccumBatchNorm

# Statistics are float32 sums of a few hundred terms: 1e-5 relative leaves
# ample room for rounding while a wrong pooling (e.g. averaging micro-batch
# variances) is off by percents. Means near zero need an absolute floor.
RTOL, ATOL = 1e-5, 1e-6
FEATURES = 3
MOMENTUM = 0.8


def _data(seed: int, sizes, *, offset=0.0, masked=False, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    xs = [
        (rng.normal(size=(b, 4, FEATURES)) * [1.0, 2.0, 0.5] + [0.3, -1.0, 2.0] + offset).astype(
            np.float32
        )
        for b in sizes
    ]
    masks = None
    if masked:
        # Per-entry, per-feature masks; every feature keeps entries in every window.
        masks = [rng.random((b, 4, FEATURES)) < 0.7 for b in sizes]
        for m in masks:
            m[0, 0] = True
    return [jnp.asarray(x, dtype) for x in xs], masks


def _train_apply(module, variables, x, mask):
    y, new = module.apply(
        variables, x, use_running_average=False, mask=mask, mutable=["batch_stats"]
    )
    return y, new["batch_stats"]


_train_call = jax.jit(_train_apply, static_argnums=0)


@functools.partial(jax.jit, static_argnums=0)
def _eval_call(module, variables, x):
    return module.apply(variables, x, use_running_average=True)


_commit = jax.jit(ga.flax.commit_batch_stats)


def _init(module, x):
    return module.init(jax.random.key(0), x, use_running_average=False)


def _run_windows(module, variables, windows):
    """Applies ``module`` to each micro-batch, committing after each window."""
    params, stats = variables["params"], variables["batch_stats"]
    for xs, masks in windows:
        for i, x in enumerate(xs):
            _, stats = _train_call(
                module,
                {"params": params, "batch_stats": stats},
                x,
                None if masks is None else masks[i],
            )
        stats = _commit(stats, True)
    return stats


def _flax_windows(momentum, variables, windows, **kwargs):
    """nn.BatchNorm on each window's concatenation: one EMA step per window."""
    bn = nn.BatchNorm(momentum=momentum, **kwargs)
    stats = {"mean": variables["batch_stats"]["mean"], "var": variables["batch_stats"]["var"]}
    for xs, masks in windows:
        x = jnp.concatenate(xs)
        mask = None if masks is None else jnp.concatenate([jnp.asarray(m) for m in masks])
        _, new = bn.apply(
            {"params": variables["params"], "batch_stats": stats},
            x,
            use_running_average=False,
            mask=mask,
            mutable=["batch_stats"],
        )
        stats = new["batch_stats"]
    return stats


def _assert_stats(stats, reference, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(stats["mean"], reference["mean"], rtol=rtol, atol=atol)
    np.testing.assert_allclose(stats["var"], reference["var"], rtol=rtol, atol=atol)


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize(
    "sizes", [(5,), (1, 1), (4, 4), (1, 3, 2, 6), (1, 1, 1, 1)], ids=lambda s: "x".join(map(str, s))
)
def test_window_statistics_equal_flax_on_concatenated_window(sizes, masked):
    module = AccumBatchNorm(momentum=MOMENTUM)
    windows = [_data(seed, sizes, masked=masked) for seed in range(3)]
    variables = _init(module, windows[0][0][0])
    stats = _run_windows(module, variables, windows[:1])
    _assert_stats(stats, _flax_windows(MOMENTUM, variables, windows[:1]))
    # Several windows, then inference with the committed statistics.
    stats = _run_windows(module, {**variables, "batch_stats": stats}, windows[1:])
    reference = _flax_windows(MOMENTUM, variables, windows)
    _assert_stats(stats, reference)
    assert not np.any(stats["window_count"]), "the window is empty after a commit"
    x = windows[0][0][0]
    y = _eval_call(module, {"params": variables["params"], "batch_stats": stats}, x)
    y_ref = nn.BatchNorm(use_running_average=True).apply(
        {"params": variables["params"], "batch_stats": reference}, x
    )
    np.testing.assert_allclose(y, y_ref, rtol=RTOL, atol=1e-5)


def test_seed_style_averaging_would_fail_these_tests():
    # The check above can fail: the mean of micro-batch variances (the seed's
    # pooling) drops the variance of the micro-batch means, far more than RTOL.
    (xs, _) = _data(0, (1, 1, 1, 1))
    micro_var = np.mean([np.var(np.asarray(x), axis=(0, 1)) for x in xs], axis=0)
    window_var = np.var(np.concatenate([np.asarray(x) for x in xs]), axis=(0, 1))
    assert np.all(micro_var < (1 - 100 * RTOL) * window_var)


def test_broadcast_mask_and_several_feature_axes_match_flax():
    xs, _ = _data(12, (1, 3))
    rng = np.random.default_rng(12)
    # Example-level masks (B, 1, 1); features on the last two axes (4 x 3).
    masks = [rng.random((x.shape[0], 1, 1)) < 0.8 for x in xs]
    masks[0][0] = True
    module = AccumBatchNorm(momentum=MOMENTUM, axis=(1, 2))
    variables = _init(module, xs[0])
    assert variables["batch_stats"]["window_sum"].shape == (4, FEATURES)
    stats = _run_windows(module, variables, [(xs, masks)])
    _assert_stats(stats, _flax_windows(MOMENTUM, variables, [(xs, masks)], axis=(1, 2)))


def test_no_running_update_before_commit_and_closes_false_is_a_no_op():
    module = AccumBatchNorm(momentum=MOMENTUM)
    (xs, _) = _data(1, (2, 3))
    variables = _init(module, xs[0])
    stats = variables["batch_stats"]
    for x in xs:
        _, stats = _train_call(module, {**variables, "batch_stats": stats}, x, None)
    np.testing.assert_array_equal(stats["mean"], variables["batch_stats"]["mean"])
    np.testing.assert_array_equal(stats["window_count"], np.full(FEATURES, 20.0))
    kept = _commit(stats, jnp.array(False))
    # Only the marker that a commit has seen the window changes.
    np.testing.assert_array_equal(stats["window_pending"], 1.0)
    np.testing.assert_array_equal(kept["window_pending"], 0.0)
    jax.tree.map(np.testing.assert_array_equal, kept, {**stats, "window_pending": jnp.zeros(())})


@pytest.mark.parametrize("fast", [True, False], ids=["fast_variance", "two_pass"])
def test_k1_matches_flax_outputs_statistics_and_gradients(fast):
    module = AccumBatchNorm(momentum=0.9, use_fast_variance=fast)
    reference = nn.BatchNorm(momentum=0.9, use_fast_variance=fast)
    (xs, _) = _data(2, (6, 6, 6))
    variables = _init(module, xs[0])
    params = jax.tree.map(lambda p: p + jnp.arange(FEATURES) * 0.1, variables["params"])
    stats, ref_stats = (
        variables["batch_stats"],
        reference.init(jax.random.key(0), xs[0], use_running_average=False)["batch_stats"],
    )

    def loss(module, params, stats, x):
        y, new = module.apply(
            {"params": params, "batch_stats": stats},
            x,
            use_running_average=False,
            mutable=["batch_stats"],
        )
        return jnp.sum(y**3), (y, new["batch_stats"])

    grad = jax.jit(jax.grad(loss, argnums=(1, 3), has_aux=True), static_argnums=0)
    for x in xs:
        g, (y, stats) = grad(module, params, stats, x)
        g_ref, (y_ref, ref_stats) = grad(reference, params, ref_stats, x)
        stats = _commit(stats, True)
        # Equal up to float32 rounding: the sums are shifted, nn.BatchNorm's are
        # not (measured differences: ~3e-7 relative).
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
        _assert_stats(stats, ref_stats)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), g, g_ref)


class _Twice(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        bn = AccumBatchNorm(momentum=MOMENTUM, use_running_average=not train)
        return bn(x) + bn(2.0 * x + 3.0)


def test_layer_used_twice_pools_both_calls_into_one_window():
    model = _Twice()
    (xs, _) = _data(3, (1, 3, 2))
    variables = model.init(jax.random.key(0), xs[0], train=True)
    step = jax.jit(
        lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"])[1]["batch_stats"]
    )
    stats = variables["batch_stats"]
    for x in xs:
        stats = step({**variables, "batch_stats": stats}, x)
    layer = stats["BatchNorm_0"]
    # Both calls of every micro-batch are in the window: no early commit.
    np.testing.assert_array_equal(layer["window_count"], np.full(FEATURES, 2 * 6 * 4.0))
    np.testing.assert_array_equal(layer["mean"], np.zeros(FEATURES))
    stats = _commit(stats, True)
    inputs = [*xs, *(2.0 * x + 3.0 for x in xs)]
    reference = _flax_windows(
        MOMENTUM,
        {"params": variables["params"]["BatchNorm_0"], "batch_stats": layer},
        [(inputs, None)],
    )
    _assert_stats(stats["BatchNorm_0"], reference)


def _mesh():
    return jax.make_mesh((8,), ("batch",))


def test_shard_map_over_8_devices_equals_one_device_on_the_global_batch():
    module = AccumBatchNorm(momentum=MOMENTUM, axis_name="batch")
    single = AccumBatchNorm(momentum=MOMENTUM)
    xs, masks = _data(4, (16, 24), masked=True)
    variables = _init(single, xs[0])
    mesh = _mesh()

    def local(stats, x, mask):
        return _train_apply(module, {"params": variables["params"], "batch_stats": stats}, x, mask)

    sharded = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=(P("batch"), P())
        )
    )
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, P("batch")))
    stats = single_stats = variables["batch_stats"]
    for x, mask in zip(xs, masks, strict=True):
        y, stats = sharded(stats, put(x), put(jnp.asarray(mask)))
        y_one, single_stats = _train_call(
            single, {**variables, "batch_stats": single_stats}, x, mask
        )
        # Training outputs use the global micro-batch's statistics on every device.
        np.testing.assert_allclose(y, y_one, rtol=RTOL, atol=1e-5)
    stats, single_stats = _commit(stats, True), _commit(single_stats, True)
    _assert_stats(stats, single_stats)
    _assert_stats(stats, _flax_windows(MOMENTUM, variables, [(xs, masks)]))

    # One stacked collective per call (two with the two-pass variance).
    for fast, expected in ((True, 1), (False, 2)):
        layer = AccumBatchNorm(axis_name="batch", use_fast_variance=fast)

        def call(stats, x, layer=layer):
            return layer.apply(
                {"params": variables["params"], "batch_stats": stats},
                x,
                use_running_average=False,
                mutable=["batch_stats"],
            )

        jaxpr = jax.make_jaxpr(
            jax.shard_map(call, mesh=mesh, in_specs=(P(), P("batch")), out_specs=(P("batch"), P()))
        )(variables["batch_stats"], put(xs[0]))
        assert str(jaxpr).count("psum") == expected


def test_pmap_with_axis_name_and_index_groups_equals_one_device():
    xs, _ = _data(5, (16, 8))
    single = AccumBatchNorm(momentum=MOMENTUM)
    variables = _init(single, xs[0])
    replicate = functools.partial(jax.tree.map, lambda a: jnp.broadcast_to(a, (8, *a.shape)))
    for groups in (None, [[0, 1, 2, 3], [4, 5, 6, 7]]):
        module = AccumBatchNorm(momentum=MOMENTUM, axis_name="i", axis_index_groups=groups)
        step = jax.pmap(
            lambda v, x, module=module: module.apply(
                v, x, use_running_average=False, mutable=["batch_stats"]
            )[1]["batch_stats"],
            axis_name="i",
        )
        stats = replicate(variables["batch_stats"])
        for x in xs:
            stats = step(
                {"params": replicate(variables["params"]), "batch_stats": stats},
                x.reshape(8, -1, 4, FEATURES),
            )
        stats = _commit(stats, True)
        parts = [range(8)] if groups is None else groups
        for part in parts:
            # Each group pools exactly its own devices' examples.
            window = [
                x.reshape(8, -1, 4, FEATURES)[np.array(part)].reshape(-1, 4, FEATURES) for x in xs
            ]
            expected = _run_windows(single, variables, [(window, None)])
            for device in part:
                _assert_stats(jax.tree.map(lambda a, d=device: a[d], stats), expected)


def test_offset_1e4_keeps_float32_accuracy():
    windows = [_data(seed, (3, 5), offset=1e4) for seed in range(2)]

    def exact(mean, var):
        # float64 EMA of the exact window moments of the same float32 inputs.
        mean, var = np.asarray(mean, np.float64), np.asarray(var, np.float64)
        for xs, _ in windows:
            x = np.concatenate([np.asarray(x, np.float64) for x in xs]).reshape(-1, FEATURES)
            mean = MOMENTUM * mean + (1 - MOMENTUM) * x.mean(0)
            var = MOMENTUM * var + (1 - MOMENTUM) * x.var(0)
        return {"mean": mean, "var": var}

    # Two-pass: the window is shifted by its first micro-batch's mean, accurate
    # from the first window on, starting from the usual mean=0, var=1.
    two_pass = AccumBatchNorm(momentum=MOMENTUM, use_fast_variance=False)
    variables = _init(two_pass, windows[0][0][0])
    _assert_stats(_run_windows(two_pass, variables, windows), exact(0.0, 1.0))

    # One pass: shifted by the running mean, accurate once that is near the data,
    # e.g. when fine-tuning from a converted nn.BatchNorm checkpoint.
    fast = AccumBatchNorm(momentum=MOMENTUM)
    start = {"mean": jnp.full(FEATURES, 1e4 - 3.0), "var": jnp.full(FEATURES, 2.0)}
    converted = {**variables, "batch_stats": ga.flax.batch_stats_from_flax(start)}
    expected = exact(start["mean"], start["var"])
    _assert_stats(_run_windows(fast, converted, windows), expected)
    # nn.BatchNorm's unshifted fast variance loses the variance at this offset.
    flax_stats = _flax_windows(MOMENTUM, {**variables, "batch_stats": start}, windows)
    assert np.max(np.abs(flax_stats["var"] / expected["var"] - 1)) > 1e-3


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_inputs_keep_float32_statistics(dtype):
    windows = [_data(seed, (2, 3), dtype=dtype) for seed in range(2)]
    for out_dtype in (None, dtype):
        module = AccumBatchNorm(momentum=MOMENTUM, dtype=out_dtype)
        variables = _init(module, windows[0][0][0])
        stats = _run_windows(module, variables, windows)
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(stats))
        # Same float32 statistics of the same 16-bit values as nn.BatchNorm.
        _assert_stats(stats, _flax_windows(MOMENTUM, variables, windows, dtype=out_dtype))
        x = windows[0][0][0]
        y, _ = _train_call(module, {**variables, "batch_stats": stats}, x, None)
        y_ref = nn.BatchNorm(dtype=out_dtype).apply(
            variables, x, use_running_average=False, mutable=["batch_stats"]
        )[0]
        assert y.dtype == y_ref.dtype
        np.testing.assert_allclose(
            np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=1e-2, atol=1e-2
        )


def test_non_finite_micro_batch_is_left_out_and_empty_features_keep_statistics():
    module = AccumBatchNorm(momentum=MOMENTUM)
    xs, _ = _data(6, (2, 3))
    variables = _init(module, xs[0])
    bad = xs[0].at[0, 0, 0].set(jnp.nan)
    stats = _run_windows(module, variables, [([bad, xs[1]], None)])
    _assert_stats(stats, _flax_windows(MOMENTUM, variables, [([xs[1]], None)]))
    # A feature with no unmasked entry in the window keeps its running statistics.
    mask = jnp.ones(xs[1].shape, bool).at[..., 1].set(False)
    before = stats
    stats = _run_windows(module, {**variables, "batch_stats": stats}, [([xs[1]], [mask])])
    assert stats["mean"][1] == before["mean"][1] and stats["var"][1] == before["var"][1]
    assert np.all(np.isfinite(stats["mean"])) and np.all(np.isfinite(stats["var"]))


class _Net(nn.Module):
    norm: type = AccumBatchNorm

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(6, name="dense")(x.reshape(x.shape[0], -1))
        x = self.norm(momentum=MOMENTUM, use_running_average=not train, name="bn")(x)
        return nn.Dense(2, name="head")(nn.relu(x))


def _loss(model, params, stats, x, y):
    logits, new = model.apply(
        {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]


@pytest.mark.slow
def test_end_to_end_with_accumulate_a_scan_loop_and_microbatch_value_and_grad():
    k, windows, lr = 2, 3, 0.3
    rng = np.random.default_rng(7)
    xs = jnp.asarray(rng.normal(size=(windows, k, 4, 12)), jnp.float32)
    ys = jnp.asarray(rng.integers(0, 2, size=(windows, k, 4)))
    model = _Net()
    variables = model.init(jax.random.key(0), xs[0, 0], train=True)
    grad_fn = jax.grad(_loss, argnums=1, has_aux=True)

    # Reference: flax's BatchNorm normalises each micro-batch the same way;
    # gradients are averaged, and the statistics are nn.BatchNorm's on the
    # concatenated inputs of the layer, computed with the window's parameters.
    ref_model = _Net(norm=nn.BatchNorm)

    @jax.jit
    def reference_window(params, ref_stats, x, y):
        grads = [grad_fn(ref_model, params, ref_stats, x[i], y[i])[0] for i in range(k)]
        hidden = [nn.Dense(6).apply({"params": params["dense"]}, x[i]) for i in range(k)]
        ref_stats = {
            "bn": _flax_windows(
                MOMENTUM, {"params": params["bn"], "batch_stats": ref_stats["bn"]}, [(hidden, None)]
            )
        }
        mean_grad = jax.tree.map(lambda *g: sum(g) / k, *grads)
        return jax.tree.map(lambda p, g: p - lr * g, params, mean_grad), ref_stats

    params, ref_stats = variables["params"], {"bn": {"mean": jnp.zeros(6), "var": jnp.ones(6)}}
    for w in range(windows):
        params, ref_stats = reference_window(params, ref_stats, xs[w], ys[w])
    ref_params = params

    # 1. One micro-batch per jitted step, optax-style, with accumulate.
    tx = ga.accumulate(optax.sgd(lr), k)

    @jax.jit
    def step(params, stats, opt_state, x, y):
        grads, stats = grad_fn(model, params, stats, x, y)
        closes = ga.closes_window(opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (
            optax.apply_updates(params, updates),
            ga.flax.commit_batch_stats(stats, closes),
            opt_state,
        )

    params, stats, opt_state = (
        variables["params"],
        variables["batch_stats"],
        tx.init(variables["params"]),
    )
    for w in range(windows):
        for i in range(k):
            params, stats, opt_state = step(params, stats, opt_state, xs[w, i], ys[w, i])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), params, ref_params
    )
    _assert_stats(stats["bn"], ref_stats["bn"])

    # 2. The whole window in one step: a lax.scan over micro-batches with the
    # statistics in the carry (and a traced commit flag, so dtypes must hold).
    @jax.jit
    def window_step(params, stats, x, y):
        def body(carry, batch):
            stats, grad_sum, i = carry
            grads, stats = grad_fn(model, params, stats, *batch)
            stats = ga.flax.commit_batch_stats(stats, i == k - 1)
            return (stats, jax.tree.map(jnp.add, grad_sum, grads), i + 1), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (stats, grad_sum, _), _ = jax.lax.scan(body, (stats, zeros, 0), (x, y))
        return jax.tree.map(lambda p, g: p - lr * g / k, params, grad_sum), stats

    params, stats = variables["params"], variables["batch_stats"]
    for w in range(windows):
        params, stats = window_step(params, stats, xs[w], ys[w])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), params, ref_params
    )
    _assert_stats(stats["bn"], ref_stats["bn"])

    # 3. The whole window in one step with microbatch_value_and_grad: the
    # statistics are its carried state. Micro-batch i takes examples i, i+k, ...
    def loss_with_stats(params, x, y, stats):
        loss, new_stats = _loss(model, params, stats, x, y)
        return loss, (new_stats, None)

    mb_value_and_grad = ga.microbatch_value_and_grad(
        loss_with_stats, k, has_aux=True, batch_argnums=(1, 2), carry_argnums=3
    )

    @jax.jit
    def microbatched_step(params, stats, x, y):
        (_, (stats, _)), grads = mb_value_and_grad(params, x, y, stats)
        stats = ga.flax.commit_batch_stats(stats)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), stats

    def interleave(batch):  # (k, n, ...) -> (n * k, ...) with micro-batch i at i, i+k, ...
        return jnp.swapaxes(batch, 0, 1).reshape(-1, *batch.shape[2:])

    params, stats = variables["params"], variables["batch_stats"]
    for w in range(windows):
        params, stats = microbatched_step(params, stats, interleave(xs[w]), interleave(ys[w]))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), params, ref_params
    )
    _assert_stats(stats["bn"], ref_stats["bn"])


def test_checkpoint_conversion_from_and_to_flax_is_lossless():
    ref_model, model = _Net(norm=nn.BatchNorm), _Net()
    x = jnp.asarray(np.random.default_rng(8).normal(size=(5, 12)), jnp.float32)
    flax_vars = ref_model.init(jax.random.key(1), x, train=True)
    _, new = ref_model.apply(flax_vars, x, train=True, mutable=["batch_stats"])
    flax_vars = {"params": flax_vars["params"], "batch_stats": new["batch_stats"]}
    converted = {
        "params": flax_vars["params"],
        "batch_stats": ga.flax.batch_stats_from_flax(flax_vars["batch_stats"]),
    }
    expected = model.init(jax.random.key(1), x, train=True)
    assert jax.tree.structure(converted) == jax.tree.structure(expected)
    np.testing.assert_array_equal(
        model.apply(converted, x, train=False), ref_model.apply(flax_vars, x, train=False)
    )
    back = ga.flax.batch_stats_to_flax(converted["batch_stats"])
    jax.tree.map(np.testing.assert_array_equal, back, flax_vars["batch_stats"])


def test_stacked_layers_under_nn_scan_commit_with_their_own_momentum():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return AccumBatchNorm(momentum=MOMENTUM, use_running_average=False)(x) * 2.0 + 1.0, None

    stack = nn.scan(
        Block,
        variable_axes={"params": 0, "batch_stats": 0},
        split_rngs={"params": True},
        length=3,
    )()
    (xs, _) = _data(9, (2, 4))
    variables = stack.init(jax.random.key(0), xs[0], None)
    stats = variables["batch_stats"]
    assert stats["BatchNorm_0"]["momentum"].shape == (3, 2)
    for x in xs:
        _, new = stack.apply({**variables, "batch_stats": stats}, x, None, mutable=["batch_stats"])
        stats = new["batch_stats"]
    stats = _commit(stats, True)["BatchNorm_0"]
    # Layer l sees 2·y + 1 of layer l-1, whose inputs it normalised with the
    # micro-batch statistics: rebuild each layer's inputs and compare.
    inputs = list(xs)
    for layer in range(3):
        params = jax.tree.map(lambda a, i=layer: a[i], variables["params"]["BatchNorm_0"])
        start = {"mean": jnp.zeros(FEATURES), "var": jnp.ones(FEATURES)}
        reference = _flax_windows(
            MOMENTUM, {"params": params, "batch_stats": start}, [(inputs, None)]
        )
        _assert_stats(jax.tree.map(lambda a, i=layer: a[i], stats), reference)
        inputs = [
            nn.BatchNorm(use_running_average=False).apply(
                {"params": params, "batch_stats": start}, x, mutable=["batch_stats"]
            )[0]
            * 2.0
            + 1.0
            for x in inputs
        ]


@pytest.mark.requires("nnx.view is new in flax 0.12.4", flax="0.12.4")
def test_nnx_view_switches_the_layer_to_batch_statistics():
    acc = NNXAccumBatchNorm(FEATURES, rngs=nnx.Rngs(0))
    acc.eval()
    assert nnx.view(acc, use_running_average=False).use_running_average is False


def test_nnx_module_matches_linen_and_nnx_batchnorm():
    xs, masks = _data(10, (1, 3, 2), masked=True)
    linen = AccumBatchNorm(momentum=MOMENTUM)
    variables = _init(linen, xs[0])
    expected = _run_windows(linen, variables, [(xs, masks)])

    layer = NNXAccumBatchNorm(FEATURES, momentum=MOMENTUM, rngs=nnx.Rngs(0))

    @nnx.jit
    def micro_step(layer, x, mask, closes):
        y = layer(x, mask=mask)
        ga.flax.commit_nnx_batch_stats(layer, closes)
        return y

    for i, (x, mask) in enumerate(zip(xs, masks, strict=True)):
        micro_step(layer, x, jnp.asarray(mask), jnp.asarray(i == len(xs) - 1))
    np.testing.assert_allclose(layer.mean[...], expected["mean"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(layer.var[...], expected["var"], rtol=RTOL, atol=ATOL)

    # K = 1 against nnx.BatchNorm, in training and in eval mode; and conversions.
    bn = nnx.BatchNorm(FEATURES, momentum=0.9, rngs=nnx.Rngs(0))
    acc = NNXAccumBatchNorm.from_batchnorm(bn)
    for x in xs:
        np.testing.assert_allclose(acc(x), bn(x), rtol=1e-5, atol=1e-5)
        acc.commit()
    np.testing.assert_allclose(acc.mean[...], bn.mean[...], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(acc.var[...], bn.var[...], rtol=RTOL, atol=ATOL)
    acc.eval()
    bn.eval()
    np.testing.assert_allclose(acc(xs[0]), bn(xs[0]), rtol=RTOL, atol=1e-5)
    back = acc.to_batchnorm()
    assert isinstance(back, nnx.BatchNorm) and back.momentum == 0.9
    np.testing.assert_array_equal(back(xs[0]), acc(xs[0]))

    # A state saved with nnx.BatchNorm loads into the accumulating layer.
    fresh = NNXAccumBatchNorm(FEATURES, rngs=nnx.Rngs(1))
    nnx.update(fresh, nnx.state(bn))
    fresh.eval()
    np.testing.assert_array_equal(fresh(xs[0]), bn(xs[0]))


def test_nnx_layer_used_twice_pools_both_calls():
    xs, _ = _data(11, (2, 3))
    layer = NNXAccumBatchNorm(FEATURES, momentum=MOMENTUM, rngs=nnx.Rngs(0))
    for x in xs:
        layer(x)
        layer(2.0 * x + 3.0)
    layer.commit()
    reference = _flax_windows(
        MOMENTUM,
        {
            "params": {"scale": jnp.ones(FEATURES), "bias": jnp.zeros(FEATURES)},
            "batch_stats": {"mean": jnp.zeros(FEATURES), "var": jnp.ones(FEATURES)},
        },
        [([*xs, *(2.0 * x + 3.0 for x in xs)], None)],
    )
    np.testing.assert_allclose(layer.mean[...], reference["mean"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(layer.var[...], reference["var"], rtol=RTOL, atol=ATOL)


def test_bad_arguments_raise_with_the_argument_named():
    x = jnp.ones((4, FEATURES))
    cases = [
        (AccumBatchNorm(momentum=1.5), ValueError, "momentum=1.5"),
        (AccumBatchNorm(epsilon=-1.0), ValueError, "epsilon=-1.0"),
        (AccumBatchNorm(force_float32_reductions=False), ValueError, "force_float32_reductions"),
        (AccumBatchNorm(axis=2), ValueError, "axis=2"),
    ]
    for module, error, text in cases:
        with pytest.raises(error, match=re.escape(text)):
            _init(module, x)
    with pytest.raises(ValueError, match="mask"):
        AccumBatchNorm().init(
            jax.random.key(0), x, use_running_average=False, mask=jnp.ones(5, bool)
        )
    with pytest.raises(TypeError, match="complex"):
        _init(AccumBatchNorm(), x.astype(jnp.complex64))
    stats = _init(AccumBatchNorm(), x)["batch_stats"]
    with pytest.raises(TypeError, match="closes"):
        ga.flax.commit_batch_stats(stats, closes=1)
    with pytest.raises(ValueError, match="no AccumBatchNorm"):
        ga.flax.commit_batch_stats({"mean": jnp.zeros(3), "var": jnp.ones(3)})
    with pytest.raises(ValueError, match="num_features"):
        NNXAccumBatchNorm(0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape("momentum=-0.1")):
        NNXAccumBatchNorm(3, momentum=-0.1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="use_running_average"):
        NNXAccumBatchNorm(3, use_running_average=None, rngs=nnx.Rngs(0))(x)
    with pytest.raises(ValueError, match="batch_stats_from_flax"):
        ga.flax.commit_batch_stats({"mean": jnp.zeros(3), "var": jnp.ones(3)})
    with pytest.raises(TypeError, match=re.escape("nnx.BatchNorm")):
        NNXAccumBatchNorm.from_batchnorm(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


# --- The Flax ImageNet example's ResNet with the norm class swapped (issue 14, item 1) ---

_DEVICES, _K, _LOCAL = 8, 2, 2  # replicas, micro-batches per window, examples per replica


class _ResNetBlock(nn.Module):
    """The ImageNet example's ResNetBlock, auto-named norms included."""

    filters: int
    norm: functools.partial
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(self.norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(residual)
            residual = self.norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class _ResNet(nn.Module):
    norm_cls: type
    train: bool = True

    @nn.compact
    def __call__(self, x):
        # As in examples/imagenet/models.py: the norm is injected with partial.
        norm = functools.partial(
            self.norm_cls,
            use_running_average=not self.train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name="batch",
        )
        x = nn.relu(norm(name="bn_init")(nn.Conv(4, (3, 3), use_bias=False, name="conv_init")(x)))
        x = _ResNetBlock(4, norm)(x)
        x = _ResNetBlock(8, norm, strides=(2, 2))(x)
        return nn.Dense(3)(jnp.mean(x, axis=(1, 2)))


def _resnet_data(windows):
    rng = np.random.default_rng(7)
    images = rng.normal(size=(windows, _K, _DEVICES, _LOCAL, 6, 6, 2)) * 2.0 + 0.5
    labels = rng.integers(0, 3, size=(windows, _K, _DEVICES, _LOCAL))
    return jnp.asarray(images, jnp.float32), jnp.asarray(labels)


def _resnet_loss(model, params, stats, x, y):
    logits, new = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, new["batch_stats"]


@pytest.mark.slow
def test_resnet_variable_paths_are_those_of_nn_batchnorm():
    x = jnp.zeros((1, 6, 6, 2))
    flax_vars = jax.jit(_ResNet(nn.BatchNorm).init)(jax.random.key(0), x)
    accum_vars = jax.jit(_ResNet(AccumBatchNorm).init)(jax.random.key(0), x)
    assert "BatchNorm_0" in flax_vars["params"]["_ResNetBlock_0"]
    assert repr(AccumBatchNorm(momentum=0.9)).startswith("AccumBatchNorm(\n")  # still its name
    # Same parameter tree (values too: same initialisers, same paths, same keys).
    assert jax.tree.structure(accum_vars["params"]) == jax.tree.structure(flax_vars["params"])
    jax.tree.map(np.testing.assert_array_equal, accum_vars["params"], flax_vars["params"])
    # The statistics convert both ways between the two layers' structures.
    flax_stats, accum_stats = flax_vars["batch_stats"], accum_vars["batch_stats"]
    converted = ga.flax.batch_stats_to_flax(accum_stats)
    assert jax.tree.structure(converted) == jax.tree.structure(flax_stats)
    back = ga.flax.batch_stats_from_flax(flax_stats)
    assert jax.tree.structure(back) == jax.tree.structure(accum_stats)
    jax.tree.map(np.testing.assert_array_equal, converted, flax_stats)
    # An nn.BatchNorm checkpoint's parameters and converted statistics run as they are.
    logits = jax.jit(_ResNet(AccumBatchNorm, train=False).apply)(
        {"params": flax_vars["params"], "batch_stats": back}, x
    )
    expected = jax.jit(_ResNet(nn.BatchNorm, train=False).apply)(flax_vars, x)
    np.testing.assert_allclose(logits, expected, rtol=1e-6)


@pytest.mark.slow
def test_resnet_drop_in_without_commit_fails_on_the_first_evaluation_call():
    # The user swaps nn.BatchNorm for AccumBatchNorm and pmean + optimizer for
    # accumulate(..., axis_name=...), and changes nothing else: no commit.
    model, eval_model = _ResNet(AccumBatchNorm), _ResNet(AccumBatchNorm, train=False)
    images, labels = _resnet_data(2)
    variables = jax.jit(model.init)(jax.random.key(0), images[0, 0, 0])
    tx = ga.accumulate(optax.sgd(0.1, momentum=0.9), _K, axis_name="batch")

    @functools.partial(jax.pmap, axis_name="batch")
    def train_step(params, stats, opt_state, x, y):
        grad_fn = jax.grad(functools.partial(_resnet_loss, model), has_aux=True)
        grads, stats = grad_fn(params, stats, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state

    @functools.partial(jax.pmap, axis_name="batch")
    def eval_step(params, stats, x):
        return eval_model.apply({"params": params, "batch_stats": stats}, x)

    replicate = functools.partial(jax.tree.map, lambda a: jnp.broadcast_to(a, (_DEVICES, *a.shape)))
    params, stats = replicate(variables["params"]), replicate(variables["batch_stats"])
    opt_state = replicate(tx.init(variables["params"]))
    # Even in the middle of the first window, before any parameter moved: no
    # commit has seen the training call, so the read is refused.
    params, stats, opt_state = train_step(params, stats, opt_state, images[0, 0], labels[0, 0])
    with pytest.raises(jax.errors.JaxRuntimeError, match="commit_batch_stats"):
        eval_step(params, stats, images[0, 0]).block_until_ready()
    for w in range(2):
        for i in range(_K - (w == 0)):
            params, stats, opt_state = train_step(
                params, stats, opt_state, images[w, i + (w == 0)], labels[w, i + (w == 0)]
            )
    np.testing.assert_array_equal(stats["bn_init"]["mean"], 0.0)  # never moved
    with pytest.raises(jax.errors.JaxRuntimeError, match="commit_batch_stats") as error:
        eval_step(params, stats, images[0, 0]).block_until_ready()
    assert "AccumBatchNorm bn_init" in str(error.value) or "AccumBatchNorm _ResNetBlock" in str(
        error.value
    )
    # The error names the fix; with it (here, a late commit) evaluation runs, and
    # this clean run also replaces the failed run's runtime tokens.
    logits = eval_step(params, ga.flax.commit_batch_stats(stats), images[0, 0])
    assert bool(jnp.all(jnp.isfinite(logits)))
    # Outside jit the same check raises a plain ValueError.
    one = jax.tree.map(lambda a: a[0], (params, stats))
    with pytest.raises(ValueError, match=r"closes=gradaccum_jax\.closes_window\(opt_state"):
        eval_model.apply({"params": one[0], "batch_stats": one[1]}, images[0, 0, 0])


@pytest.mark.slow
def test_resnet_with_commit_running_statistics_equal_the_large_batch():
    # The same pmap train step, with the one added line that commits.
    model, eval_model = _ResNet(AccumBatchNorm), _ResNet(AccumBatchNorm, train=False)
    windows = 3
    images, labels = _resnet_data(windows)
    variables = jax.jit(model.init)(jax.random.key(0), images[0, 0, 0])
    tx = ga.accumulate(optax.sgd(0.1, momentum=0.9), _K, axis_name="batch")

    @functools.partial(jax.pmap, axis_name="batch")
    def train_step(params, stats, opt_state, x, y):
        grad_fn = jax.grad(functools.partial(_resnet_loss, model), has_aux=True)
        grads, stats = grad_fn(params, stats, x, y)
        stats = ga.flax.commit_batch_stats(stats, closes=ga.closes_window(opt_state))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state

    # Reference: every layer's statistics are nn.BatchNorm's on the concatenation
    # of the inputs that layer received in the window, over micro-batches and
    # replicas. (Deeper layers' inputs depend on how earlier layers normalised,
    # with micro-batch statistics here, so a whole nn.BatchNorm model on the
    # concatenated batch would see different inputs; see docs/batchnorm.md.)
    @functools.partial(jax.pmap, axis_name="batch")
    def norm_inputs(params, stats, x):
        seen = {}

        def record(next_fun, args, kwargs, context):
            if isinstance(context.module, AccumBatchNorm):
                seen[context.module.path] = args[0]
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(record):
            _resnet_loss(model, params, stats, x, jnp.zeros(x.shape[0], jnp.int32))
        return seen

    @functools.partial(jax.pmap, axis_name="batch")
    def reference_stats(ref, x):
        bn = nn.BatchNorm(
            momentum=0.9, epsilon=1e-5, axis_name="batch", use_scale=False, use_bias=False
        )
        return bn.apply({"batch_stats": ref}, x, use_running_average=False, mutable=True)[1][
            "batch_stats"
        ]

    replicate = functools.partial(jax.tree.map, lambda a: jnp.broadcast_to(a, (_DEVICES, *a.shape)))
    params, stats = replicate(variables["params"]), replicate(variables["batch_stats"])
    opt_state = replicate(tx.init(variables["params"]))
    flat = flax.traverse_util.flatten_dict(ga.flax.batch_stats_to_flax(stats))
    ref = {path[:-1]: {key: flat[(*path[:-1], key)] for key in ("mean", "var")} for path in flat}
    for w in range(windows):
        seen = [norm_inputs(params, stats, images[w, i]) for i in range(_K)]
        ref = {
            path: reference_stats(ref[path], jnp.concatenate([s[path] for s in seen], axis=1))
            for path in ref
        }
        for x, y in zip(images[w], labels[w], strict=True):
            params, stats, opt_state = train_step(params, stats, opt_state, x, y)
        flat = flax.traverse_util.flatten_dict(stats)
        for path, expected in ref.items():
            for key in ("mean", "var"):
                np.testing.assert_allclose(
                    flat[(*path, key)], expected[key], rtol=2e-5, atol=2e-6, err_msg=f"{path}/{key}"
                )
    assert float(jnp.max(jnp.abs(stats["bn_init"]["mean"]))) > 0.1  # the statistics moved
    logits = jax.pmap(lambda p, s, x: eval_model.apply({"params": p, "batch_stats": s}, x))(
        params, stats, images[0, 0]
    )
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_evaluation_after_a_missed_commit_raises_and_names_the_fix():
    xs, _ = _data(12, (2, 2))
    bn = AccumBatchNorm(momentum=MOMENTUM)
    variables = _init(bn, xs[0])
    params, stats = variables["params"], variables["batch_stats"]
    for x in xs:
        _, stats = _train_call(bn, {"params": params, "batch_stats": stats}, x, None)
    # Mid-window, once a commit call with closes=False has seen the calls, is legitimate.
    seen = _commit(stats, jnp.array(False))
    _eval_call(bn, {"params": params, "batch_stats": seen}, xs[0]).block_until_ready()
    # An optimizer step without a commit: eager and jitted evaluation both refuse.
    stepped = jax.tree.map(lambda p: p - 0.01, params)
    with pytest.raises(ValueError, match=r"AccumBatchNorm \(top level\).*commit_batch_stats"):
        bn.apply({"params": stepped, "batch_stats": stats}, xs[0], use_running_average=True)
    with pytest.raises(jax.errors.JaxRuntimeError, match="commit_batch_stats"):
        _eval_call(bn, {"params": stepped, "batch_stats": stats}, xs[0]).block_until_ready()
    # Committed: the evaluation runs, and equals nn.BatchNorm's on the window.
    committed = ga.flax.commit_batch_stats(stats)
    out = _eval_call(bn, {"params": stepped, "batch_stats": committed}, xs[0])
    reference = _flax_windows(MOMENTUM, variables, [(xs, None)])
    expected = nn.BatchNorm(use_running_average=True).apply(
        {"params": stepped, "batch_stats": reference}, xs[0]
    )
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)

    # The NNX layer: same check, eager and under nnx.jit.
    layer = NNXAccumBatchNorm(FEATURES, momentum=MOMENTUM, rngs=nnx.Rngs(0))
    for x in xs:
        layer(x)
    layer.bias[...] = layer.bias[...] + 0.01
    layer.eval()
    with pytest.raises(ValueError, match="commit_nnx_batch_stats"):
        layer(xs[0])
    with pytest.raises(jax.errors.JaxRuntimeError, match="commit_nnx_batch_stats"):
        nnx.jit(lambda m, x: m(x))(layer, xs[0]).block_until_ready()
    layer.commit()
    # A clean run on the same device also replaces the failed run's runtime token.
    np.testing.assert_allclose(
        nnx.jit(lambda m, x: m(x))(layer, xs[0]), layer(xs[0]), rtol=1e-6, atol=1e-6
    )


# --- Issue 24: uncommitted statistics are never read, whatever the parameters do ---


class _Probe(nn.Module):
    """Dense, then the norm; `affine=False` is a norm with neither scale nor bias."""

    affine: bool = True
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(FEATURES)(x)
        return AccumBatchNorm(
            use_running_average=not train,
            use_scale=self.affine,
            use_bias=self.affine,
            axis_name=self.axis_name,
        )(x)


# Every way the layer's parameters can stay put while statistics are pending.
_FROZEN_CASES = ["no_scale_no_bias", "masked_affine", "learning_rate_0", "recalibrate_only"]


def _optimizer(case):
    if case == "masked_affine":
        # Linear probing: the norm's affine is frozen, the rest trains.
        frozen = lambda params: {name: name == "BatchNorm_0" for name in params}  # noqa: E731
        return optax.chain(optax.masked(optax.set_to_zero(), frozen), optax.sgd(0.1))
    if case == "learning_rate_0":
        # A warmup that starts at 0: both steps here have learning rate 0.
        return optax.sgd(optax.linear_schedule(0.0, 0.1, 100, transition_begin=10))
    return optax.sgd(0.1)


def _train_without_commit(case, wrap=jax.jit, axis_name=None, shard=lambda a: a):
    """Two training steps, no commit; returns (model, params, stats, x)."""
    model = _Probe(affine=case != "no_scale_no_bias", axis_name=axis_name)
    xs, _ = _data(40, (32, 32))
    xs = [shard(x.reshape(-1, 4 * FEATURES)) for x in xs]
    variables = model.init(jax.random.key(0), xs[0], True)
    tx = _optimizer(case)

    def step(params, stats, opt_state, x):
        def loss(params):
            y, new = model.apply(
                {"params": params, "batch_stats": stats}, x, True, mutable=["batch_stats"]
            )
            return jnp.mean(y**2), new["batch_stats"]

        if case == "recalibrate_only":  # forward passes only, no optimizer
            return params, loss(params)[1], opt_state
        grads, stats = jax.grad(loss, has_aux=True)(params)
        if axis_name is not None:
            grads = jax.lax.pmean(grads, axis_name)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state

    step = wrap(step)
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)
    if wrap is not jax.jit:
        replicate = functools.partial(jax.tree.map, lambda a: jnp.broadcast_to(a, (8, *a.shape)))
        params, stats, opt_state = replicate((params, stats, opt_state))
    for x in xs:
        params, stats, opt_state = step(params, stats, opt_state, x)
    return model, params, stats, xs[0]


@pytest.mark.parametrize("case", _FROZEN_CASES)
def test_uncommitted_statistics_raise_at_the_read_under_jit_with_a_mesh(case, explicit_mesh):
    mesh = explicit_mesh
    shard = functools.partial(jax.device_put, device=NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        model, params, stats, x = _train_without_commit(case, shard=shard)
        if case not in ("recalibrate_only", "no_scale_no_bias"):
            # The parameters the old fingerprint watched did not move.
            before = model.init(jax.random.key(0), x, True)["params"]["BatchNorm_0"]
            jax.tree.map(np.testing.assert_array_equal, params["BatchNorm_0"], before)
        evaluate = jax.jit(lambda p, s, x: model.apply({"params": p, "batch_stats": s}, x, False))
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"commit_batch_stats\(batch_stats"):
            jax.block_until_ready(evaluate(params, stats, x))
        # Outside jit the read raises a plain ValueError with the same message.
        with pytest.raises(ValueError, match="recomputing the statistics only"):
            model.apply({"params": params, "batch_stats": stats}, x, False)
        committed = _commit(stats, True)
        out = evaluate(params, committed, x)
    assert float(jnp.max(jnp.abs(committed["BatchNorm_0"]["mean"]))) > 0.01  # they moved
    assert bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("case", _FROZEN_CASES)
def test_uncommitted_statistics_raise_at_the_read_under_pmap(case):
    wrap = functools.partial(jax.pmap, axis_name="batch")
    split = functools.partial(jnp.reshape, shape=(8, 4, 4 * FEATURES))
    model, params, stats, x = _train_without_commit(case, wrap, "batch", split)
    evaluate = jax.pmap(lambda p, s, x: model.apply({"params": p, "batch_stats": s}, x, False))
    with pytest.raises(jax.errors.JaxRuntimeError, match="commit_batch_stats"):
        jax.block_until_ready(evaluate(params, stats, x))
    out = evaluate(params, jax.pmap(ga.flax.commit_batch_stats)(stats), x)
    assert bool(jnp.all(jnp.isfinite(out)))


def test_the_documented_train_step_evaluates_mid_window_and_after_it():
    # Committing with closes=closes_window(opt_state) on every micro-step makes
    # every read legitimate: mid-window (statistics of the last commit) or after.
    model = _Probe(affine=False)
    xs, _ = _data(41, (4, 4, 4))
    xs = [x.reshape(-1, 4 * FEATURES) for x in xs]
    variables = model.init(jax.random.key(0), xs[0], True)
    tx = ga.accumulate(optax.sgd(0.0), 2)

    @jax.jit
    def step(params, stats, opt_state, x):
        def loss(params):
            y, new = model.apply(
                {"params": params, "batch_stats": stats}, x, True, mutable=["batch_stats"]
            )
            return jnp.mean(y**2), new["batch_stats"]

        grads, stats = jax.grad(loss, has_aux=True)(params)
        stats = ga.flax.commit_batch_stats(stats, ga.closes_window(opt_state))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state

    evaluate = jax.jit(lambda p, s, x: model.apply({"params": p, "batch_stats": s}, x, False))
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)
    means = []
    for x in xs:
        params, stats, opt_state = step(params, stats, opt_state, x)
        jax.block_until_ready(evaluate(params, stats, x))
        means.append(np.asarray(stats["BatchNorm_0"]["mean"]))
    np.testing.assert_array_equal(means[0], 0.0)  # mid-window: the last commit's
    assert np.max(np.abs(means[1])) > 1e-3  # the window closed and moved them
    np.testing.assert_array_equal(means[2], means[1])


@pytest.mark.parametrize("case", ["no_scale_no_bias", "frozen_affine", "recalibrate_only"])
def test_nnx_uncommitted_statistics_raise_at_the_read(case):
    affine = case != "no_scale_no_bias"
    model = nnx.Sequential(
        nnx.Linear(4 * FEATURES, FEATURES, rngs=nnx.Rngs(0)),
        NNXAccumBatchNorm(FEATURES, use_scale=affine, use_bias=affine, rngs=nnx.Rngs(0)),
    )
    xs, _ = _data(42, (4, 4))
    xs = [x.reshape(-1, 4 * FEATURES) for x in xs]

    # Only the Linear layer trains (frozen affine); or nothing does (recalibration).
    # A callable filter: PathContains takes a single key in flax 0.12.1.
    def in_linear(path, value):
        return len(path) >= 2 and str(path[0]) == "layers" and str(path[1]) == "0"

    wrt = nnx.All(nnx.Param, in_linear) if affine else nnx.Param
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=wrt)

    @nnx.jit
    def step(model, optimizer, x):
        if case == "recalibrate_only":
            model(x)
            return
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2), argnums=nnx.DiffState(0, wrt))(model)
        optimizer.update(model, grads)

    for x in xs:
        step(model, optimizer, x)
    model.eval()
    with pytest.raises(jax.errors.JaxRuntimeError, match="commit_nnx_batch_stats"):
        nnx.jit(lambda m, x: m(x))(model, xs[0]).block_until_ready()
    with pytest.raises(ValueError, match="commit_nnx_batch_stats"):
        model(xs[0])
    ga.flax.commit_nnx_batch_stats(model)
    assert float(jnp.max(jnp.abs(model.layers[1].mean[...]))) > 0.01
    assert bool(jnp.all(jnp.isfinite(nnx.jit(lambda m, x: m(x))(model, xs[0]))))


def test_nnx_uncommitted_statistics_raise_at_the_read_under_pmap_and_a_mesh(explicit_mesh):
    layer = NNXAccumBatchNorm(
        FEATURES, use_scale=False, use_bias=False, axis_name="batch", rngs=nnx.Rngs(0)
    )
    graphdef, state = nnx.split(layer)
    x = jnp.asarray(_data(43, (32,))[0][0].reshape(8, 4, 4, FEATURES))

    def call(state, x, train):
        layer = nnx.merge(graphdef, state)
        y = layer(x, use_running_average=not train)
        return y, nnx.state(layer)

    replicated = jax.tree.map(lambda a: jnp.broadcast_to(a, (8, *a.shape)), state)
    train = jax.pmap(functools.partial(call, train=True), axis_name="batch")
    evaluate = jax.pmap(functools.partial(call, train=False), axis_name="batch")
    _, trained = train(replicated, x)
    with pytest.raises(jax.errors.JaxRuntimeError, match="commit_nnx_batch_stats"):
        jax.block_until_ready(evaluate(trained, x))
    # Committed, the read runs (and this clean run replaces the failed run's runtime tokens).
    committed = jax.pmap(lambda s: _nnx_committed(graphdef, s))(trained)
    assert bool(jnp.all(jnp.isfinite(evaluate(committed, x)[0])))

    # Training under nnx.jit over a mesh (the layer without axis_name, the batch
    # sharded); the read is eager here: after a failed host callback, a program
    # with collectives on the same devices can hang (JAX's runtime tokens).
    mesh = explicit_mesh
    single = NNXAccumBatchNorm(FEATURES, use_scale=False, use_bias=False, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        sharded = jax.device_put(x.reshape(32, 4, FEATURES), NamedSharding(mesh, P("data")))
        nnx.jit(lambda m, x: m(x))(single, sharded)
        single.eval()
        with pytest.raises(ValueError, match="commit_nnx_batch_stats"):
            single(sharded)
        single.commit()
        assert bool(jnp.all(jnp.isfinite(single(sharded))))


def _nnx_committed(graphdef, state):
    layer = nnx.merge(graphdef, state)
    ga.flax.commit_nnx_batch_stats(layer)
    return nnx.state(layer)


def test_committing_a_model_without_the_layers_is_a_no_op():
    # A model whose BatchNorm is switched off by a config flag: empty batch_stats.
    assert _commit({}, True) == {}
    assert ga.flax.commit_batch_stats({"batch_stats": {}}, jnp.array(False)) == {"batch_stats": {}}
    linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    before = nnx.state(linear)
    ga.flax.commit_nnx_batch_stats(linear)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(linear), before)
    # Arrays, but none of this layer's statistics: most likely the wrong tree.
    with pytest.raises(ValueError, match=r"no AccumBatchNorm.*batch_stats_from_flax"):
        ga.flax.commit_batch_stats({"Dense_0": {"kernel": jnp.ones((2, 2))}})


# --- Issue 24: the fold weight is flax's float32(1 - momentum) ---

_HIGH_MOMENTA = [0.9, 0.99, 0.999, 0.9999, 0.99999]


def _integer_batches(count, seed):
    # Integer entries with a mean that is a multiple of 1/8: every window statistic
    # is exact in float32 in both layers, so any difference comes from the fold.
    rng = np.random.default_rng(seed)
    return rng.integers(-8, 9, size=(count, 8, FEATURES)).astype(np.float32) + 3.0


@pytest.mark.parametrize("momentum", _HIGH_MOMENTA)
def test_k1_running_statistics_equal_flax_bit_for_bit(momentum):
    # Op by op (no compiler fusion), K = 1: the two-pass layer's statistics are
    # nn.BatchNorm's to the last bit at every commit.
    ours = AccumBatchNorm(momentum=momentum, use_fast_variance=False)
    ref = nn.BatchNorm(momentum=momentum, use_fast_variance=False)
    xs = _integer_batches(60, 44)
    variables = ours.init(jax.random.key(0), xs[0], use_running_average=False)
    stats, ref_stats = variables["batch_stats"], {"mean": jnp.zeros(3), "var": jnp.ones(3)}
    for x in xs:
        _, new = ours.apply(
            {**variables, "batch_stats": stats}, x, use_running_average=False, mutable=True
        )
        stats = ga.flax.commit_batch_stats(new["batch_stats"])
        _, new = ref.apply(
            {"params": variables["params"], "batch_stats": ref_stats},
            x,
            use_running_average=False,
            mutable=True,
        )
        ref_stats = new["batch_stats"]
        np.testing.assert_array_equal(stats["mean"], ref_stats["mean"])
        np.testing.assert_array_equal(stats["var"], ref_stats["var"])
    # The NNX layer folds with the same weights.
    layer = NNXAccumBatchNorm(
        FEATURES, momentum=momentum, use_fast_variance=False, rngs=nnx.Rngs(0)
    )
    reference = nnx.BatchNorm(
        FEATURES, momentum=momentum, use_fast_variance=False, rngs=nnx.Rngs(0)
    )
    for x in xs[:20]:
        layer(x)
        layer.commit()
        reference(x)
    np.testing.assert_array_equal(layer.mean[...], reference.mean[...])
    np.testing.assert_array_equal(layer.var[...], reference.var[...])


@pytest.mark.parametrize("fast", [True, False], ids=["fast_variance", "two_pass"])
def test_k1_running_statistics_follow_flax_over_thousands_of_commits(fast):
    # Compiled, K = 1, 4000 commits at momentum 0.9999. The fold's weight
    # 1 - float32(m) would drift by ~1.7e-4 relative; flax's float32(1 - m) gives
    # what flax gives up to the compiler's rounding choices (fused multiply-adds).
    momentum = 0.9999
    ours = AccumBatchNorm(momentum=momentum, use_fast_variance=fast)
    ref = nn.BatchNorm(momentum=momentum, use_fast_variance=fast)
    xs = jnp.asarray(_integer_batches(4000, 45))
    variables = ours.init(jax.random.key(0), xs[0], use_running_average=False)

    def body(carry, x):
        stats, ref_stats = carry
        _, new = ours.apply(
            {**variables, "batch_stats": stats}, x, use_running_average=False, mutable=True
        )
        _, ref_new = ref.apply(
            {"params": variables["params"], "batch_stats": ref_stats},
            x,
            use_running_average=False,
            mutable=True,
        )
        return (ga.flax.commit_batch_stats(new["batch_stats"]), ref_new["batch_stats"]), None

    start = (variables["batch_stats"], {"mean": jnp.zeros(3), "var": jnp.ones(3)})
    (stats, ref_stats), _ = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))(start, xs)
    assert float(jnp.min(jnp.abs(ref_stats["mean"]))) > 0.5  # moved well off zero
    # Measured: 2e-6 relative with the suite's compiler settings, 2.7e-6 with XLA's
    # defaults (the wheel and oldest-stack CI steps); the old weight drifted 1.7e-4.
    np.testing.assert_allclose(stats["mean"], ref_stats["mean"], rtol=1e-5)
    np.testing.assert_allclose(stats["var"], ref_stats["var"], rtol=1e-5)


# --- Issue 24: flax's own BatchNorm tests (tools/upstream_suites.py), differences pinned ---


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
@pytest.mark.requires(
    "flax 0.12.1's BatchNorm rounds its output otherwise (measured)", flax="0.12.8"
)
def test_k1_outputs_equal_flax_bit_for_bit(dtype):
    # flax's nnx-vs-linen test compares outputs with assert_array_equal. Without a mask
    # or axis_name a call divides by a scalar count, as nn.BatchNorm's mean does; a
    # per-feature count array rounded differently in the last bit.
    x = jax.random.normal(jax.random.key(0), (10, 5))
    ours, ref = AccumBatchNorm(dtype=dtype), nn.BatchNorm(dtype=dtype)
    variables = ours.init(jax.random.key(1), x, use_running_average=False)
    ref_vars = {
        "params": variables["params"],
        "batch_stats": {"mean": jnp.zeros(5), "var": jnp.ones(5)},
    }

    def apply(module, v):
        return module.apply(v, x, use_running_average=False, mutable=True)[0]

    # Op by op, as flax's test runs; compiled, fusion may round differently.
    np.testing.assert_array_equal(apply(ours, variables), apply(ref, ref_vars))
    compiled = jax.jit(apply, static_argnums=0)
    np.testing.assert_allclose(compiled(ours, variables), compiled(ref, ref_vars), rtol=2e-6)
    layer = NNXAccumBatchNorm(5, dtype=dtype, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(layer(x), nnx.BatchNorm(5, dtype=dtype, rngs=nnx.Rngs(0))(x))


def test_k1_running_mean_may_differ_from_flax_in_the_last_bit():
    # The commit divides the window's sum by a per-feature count (correctly rounded);
    # nn.BatchNorm's mean of an unmasked batch divides by a constant, which XLA
    # multiplies by its reciprocal. At most an ulp apart; the variance here is equal.
    x = jax.random.normal(jax.random.key(0), (10, 5))
    ours, ref = NNXAccumBatchNorm(5, rngs=nnx.Rngs(0)), nnx.BatchNorm(5, rngs=nnx.Rngs(0))
    ours(x), ref(x)
    ours.commit()
    np.testing.assert_allclose(ours.mean[...], ref.mean[...], rtol=2.5e-7, atol=0)
    np.testing.assert_array_equal(ours.var[...], ref.var[...])


def test_fully_masked_feature_keeps_statistics_where_flax_records_nan():
    x = jax.random.normal(jax.random.key(0), (10, 5))
    mask = np.array([True, False, True, False, True])
    ours, ref = NNXAccumBatchNorm(5, rngs=nnx.Rngs(0)), nnx.BatchNorm(5, rngs=nnx.Rngs(0))
    ours(x, mask=mask), ref(x, mask=mask)
    ours.commit()
    assert np.all(np.isnan(ref.mean[...][~mask])) and np.all(np.isnan(ref.var[...][~mask]))
    np.testing.assert_array_equal(ours.mean[...][~mask], 0.0)
    np.testing.assert_array_equal(ours.var[...][~mask], 1.0)
    np.testing.assert_allclose(ours.mean[...][mask], ref.mean[...][mask], rtol=2.5e-7)


# --- Issue 29: serving and export ---


class _ConvNetForExport(nn.Module):
    norm: type = AccumBatchNorm

    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(6)(x)
        x = self.norm(momentum=MOMENTUM, use_running_average=not train)(x)
        x = nn.relu(x)
        return self.norm(momentum=MOMENTUM, use_running_average=not train, axis=(-2, -1))(x)


def _trained_model_for_export():
    model = _ConvNetForExport()
    xs, _ = _data(0, (4, 2, 3))
    variables = model.init(jax.random.key(0), xs[0], True)
    params, stats = variables["params"], variables["batch_stats"]
    for x in xs:
        _, new = model.apply(
            {"params": params, "batch_stats": stats}, x, True, mutable=["batch_stats"]
        )
        stats = new["batch_stats"]
    return model, params, stats


def test_eval_after_commit_exports_with_flax_statistics_and_gives_the_same_output():
    model, params, stats = _trained_model_for_export()
    stats = ga.flax.commit_batch_stats(stats)
    x = _data(7, (5,))[0][0]
    expected = model.apply({"params": params, "batch_stats": stats}, x, False)  # checked
    serving = {"params": params, "batch_stats": ga.flax.batch_stats_to_flax(stats)}

    def serve(variables, x):
        return model.apply(variables, x, False)

    # jax.export refuses host callbacks when it exports (serializing needs flatbuffers,
    # not a dependency here): that it exports at all shows there is none.
    exported = jax.export.export(jax.jit(serve))(serving, x)
    # The same program but for the check: equal up to how XLA fuses it (equal on CPU).
    np.testing.assert_allclose(exported.call(serving, x), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jax.jit(serve)(serving, x), expected, rtol=1e-6, atol=1e-7)
    # The same statistics serve the model built with nn.BatchNorm.
    flax_model = _ConvNetForExport(norm=nn.BatchNorm)
    np.testing.assert_allclose(flax_model.apply(serving, x, False), expected, rtol=1e-6, atol=1e-6)


def test_eval_with_the_window_still_checks_and_does_not_export():
    # The statistics as training holds them keep the stale-window check (a host
    # callback): export refuses them outside exportable_eval.
    model, params, stats = _trained_model_for_export()
    variables = {"params": params, "batch_stats": ga.flax.commit_batch_stats(stats)}
    x = _data(7, (5,))[0][0]
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        jax.export.export(jax.jit(lambda v, x: model.apply(v, x, False)))(variables, x)


def test_exportable_eval_serializes_the_model_as_trained_and_checks_in_the_program():
    # Issue 34, item 5: the variables as training left them (window included), exported,
    # serialized and called after a round trip, give the checked evaluation's output.
    model, params, stats = _trained_model_for_export()
    committed = {"params": params, "batch_stats": ga.flax.commit_batch_stats(stats)}
    x = _data(7, (5,))[0][0]
    expected = model.apply(committed, x, False)  # checked on the host
    serve = jax.jit(lambda v, x: model.apply(v, x, False))
    with ga.flax.exportable_eval():
        exported = jax.export.export(serve)(committed, x)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(restored.call(committed, x), expected, rtol=1e-6, atol=1e-7)
    # An uncommitted window is still caught, in the program: NaN instead of stale numbers.
    stale = {"params": params, "batch_stats": stats}
    assert np.isnan(np.asarray(restored.call(stale, x))).all()
    # The program traced inside the context is not reused outside it: the host check stays.
    with pytest.raises(jax.errors.JaxRuntimeError, match="commit_batch_stats"):
        jax.block_until_ready(serve(stale, x))
    with pytest.raises(ValueError, match="commit_batch_stats"):  # concrete values: raised
        with ga.flax.exportable_eval():
            model.apply(stale, x, False)


def test_exportable_eval_serializes_an_nnx_model_as_trained():
    layer = NNXAccumBatchNorm(FEATURES, momentum=MOMENTUM, rngs=nnx.Rngs(0))
    xs, _ = _data(0, (4, 2))
    for x in xs:
        layer(x, use_running_average=False)
    stale_values = nnx.to_pure_dict(nnx.split(layer)[1])
    layer.commit()
    x = _data(7, (5,))[0][0]
    expected = layer(x, use_running_average=True)
    graphdef, state = nnx.split(layer)

    def serve(values, x):
        # Plain dicts in the signature: a serialized PyTreeDef cannot name nnx's Variables.
        filled = jax.tree.map(lambda v: v, state)  # a copy for replace_by_pure_dict to fill
        nnx.replace_by_pure_dict(filled, values)
        return nnx.merge(graphdef, filled)(x, use_running_average=True)

    values = nnx.to_pure_dict(state)
    with ga.flax.exportable_eval():
        exported = jax.export.export(jax.jit(serve))(values, x)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(restored.call(values, x), expected, rtol=1e-6, atol=1e-6)
    assert np.isnan(np.asarray(restored.call(stale_values, x))).all()


def test_batch_stats_to_flax_refuses_an_uncommitted_window():
    _, _, stats = _trained_model_for_export()
    with pytest.raises(ValueError, match=r"batch_stats_to_flax.*commit_batch_stats"):
        ga.flax.batch_stats_to_flax(stats)
    with pytest.raises(jax.errors.JaxRuntimeError, match="commit_batch_stats"):
        jax.block_until_ready(jax.jit(ga.flax.batch_stats_to_flax)(stats))
    # Seen by a commit that did not close the window: the running statistics are current.
    open_window = ga.flax.commit_batch_stats(stats, closes=False)
    assert sorted(ga.flax.batch_stats_to_flax(open_window)["BatchNorm_0"]) == ["mean", "var"]


def test_nnx_to_batchnorm_exports_after_commit_and_refuses_an_uncommitted_window():
    layer = NNXAccumBatchNorm(FEATURES, momentum=MOMENTUM, rngs=nnx.Rngs(0))
    xs, _ = _data(0, (4, 2))
    for x in xs:
        layer(x, use_running_average=False)
    with pytest.raises(ValueError, match=r"to_batchnorm.*commit_nnx_batch_stats"):
        layer.to_batchnorm()
    layer.commit()
    x = _data(7, (5,))[0][0]
    expected = layer(x, use_running_average=True)
    bn = layer.to_batchnorm()
    graphdef, state = nnx.split(bn)

    def serve(state, x):
        return nnx.merge(graphdef, state)(x, use_running_average=True)

    exported = jax.export.export(jax.jit(serve))(state, x)
    np.testing.assert_allclose(exported.call(state, x), expected, rtol=1e-6, atol=1e-6)


def _faq_quote(heading: str) -> str:
    """The first ```text block below `heading` in docs/faq.md."""
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "faq.md").read_text()
    section = page[page.index(heading) :]
    start = section.index("```text\n") + len("```text\n")
    return section[start : section.index("```", start)]


def test_faq_quotes_the_uncommitted_window_error_as_it_is_raised():
    # docs/faq.md quotes the message (abridged with [...]) and says what triggers it: an
    # evaluation call after a training call that no commit has seen, in a model whose
    # auto-named layer is BatchNorm_0.
    quote = _faq_quote("### I swapped `nn.BatchNorm` for `AccumBatchNorm`")
    model, params, stats = _trained_model_for_export()
    x = _data(7, (5,))[0][0]
    with pytest.raises(ValueError) as error:
        model.apply({"params": params, "batch_stats": stats}, x, False)
    raised = " ".join(f"{type(error.value).__name__}: {error.value}".split())
    position = 0
    for piece in quote.split("[...]"):
        piece = " ".join(piece.split())
        if not piece:
            continue
        found = raised.find(piece, position)
        assert found >= 0, f"faq.md quotes {piece!r}, not in the raised message {raised!r}"
        position = found + len(piece)
