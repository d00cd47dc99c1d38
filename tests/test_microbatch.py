"""Tests for gradaccum_jax.microbatch_value_and_grad."""

import pathlib
import re

import chex
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
from benchmarks import harness
from gradaccum_jax._base.compat import pcast_to_varying

RTOL, ATOL = 1e-5, 1e-6
B = 32


def _params(key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {
        "w1": jax.random.normal(k1, (6, 16)) / 6**0.5,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 3)) / 4.0,
    }


def _batch(key=1, n=B):
    kx, ky, km = jax.random.split(jax.random.key(key), 3)
    mask = (jax.random.uniform(km, (n,)) < 0.6).astype(jnp.float32)
    # Micro-batch 1 of 4 (examples 1, 5, 9, ...) is all padding, the case
    # where a mean of micro-batch means goes wrong and 0/0 appears.
    mask = mask.at[1::4].set(0.0)
    return {
        "x": jax.random.normal(kx, (n, 6)),
        "y": jax.random.randint(ky, (n,), 0, 3),
        "mask": mask,
    }


def _per_example(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), logits


def mean_loss(params, batch):
    return _per_example(params, batch)[0].mean()


def masked_loss(params, batch):
    losses, _ = _per_example(params, batch)
    return jnp.sum(losses * batch["mask"]) / jnp.sum(batch["mask"])


def masked_sum_and_weight(params, batch):
    losses, _ = _per_example(params, batch)
    return jnp.sum(losses * batch["mask"]), jnp.sum(batch["mask"])


def loss_with_metrics(params, batch):
    losses, logits = _per_example(params, batch)
    correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
    aux = {
        "accuracy": jnp.mean(correct),
        "num_correct": jnp.sum(correct.astype(jnp.int32)),
        "losses": losses,
        "max_loss": jnp.max(losses),
    }
    return losses.mean(), aux


PARAMS, BATCH = _params(), _batch()
FULL = jax.jit(jax.value_and_grad(mean_loss))(PARAMS, BATCH)
MASKED_FULL = jax.jit(jax.value_and_grad(masked_loss))(PARAMS, BATCH)


@pytest.mark.parametrize("k", [2, 8])
def test_matches_full_batch(k):
    value, grads = jax.jit(ga.microbatch_value_and_grad(mean_loss, k))(PARAMS, BATCH)
    chex.assert_trees_all_close((value, grads), FULL, rtol=RTOL, atol=ATOL, strict=True)


METRIC_REDUCTIONS = {
    "accuracy": "mean",
    "num_correct": "sum",
    "losses": "concat",
    "max_loss": lambda stacked: jnp.max(stacked, axis=0),
}


def test_k1_is_exactly_value_and_grad():
    reductions = {**METRIC_REDUCTIONS, "max_loss": "mean"}
    ours = ga.microbatch_value_and_grad(
        loss_with_metrics, 1, has_aux=True, argnums=(0,), aux_reduction=reductions
    )
    theirs = jax.value_and_grad(loss_with_metrics, argnums=(0,), has_aux=True)
    # The same program, hence bit-identical results.
    assert str(jax.make_jaxpr(ours)(PARAMS, BATCH)) == str(jax.make_jaxpr(theirs)(PARAMS, BATCH))
    out, expected = jax.jit(ours)(PARAMS, BATCH), jax.jit(theirs)(PARAMS, BATCH)
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(x, y)


def test_argnums_tuple_and_batch_in_several_arguments():
    def loss(x, params, y, scale):
        return scale * mean_loss(params, {"x": x, "y": y})

    fn = ga.microbatch_value_and_grad(loss, 4, argnums=(1, 3), batch_argnums=(0, 2))
    out = jax.jit(fn)(BATCH["x"], PARAMS, BATCH["y"], 2.0)
    expected = jax.jit(jax.value_and_grad(loss, argnums=(1, 3)))(
        BATCH["x"], PARAMS, BATCH["y"], 2.0
    )
    chex.assert_trees_all_close(out, expected, rtol=RTOL, atol=ATOL, strict=True)


def test_weight_fn_gives_full_batch_weighted_mean():
    fn = ga.microbatch_value_and_grad(masked_loss, 4, weight_fn=lambda p, b: b["mask"])
    expected = MASKED_FULL
    chex.assert_trees_all_close(
        jax.jit(fn)(PARAMS, BATCH), expected, rtol=RTOL, atol=ATOL, strict=True
    )
    # Without the weights: a mean of micro-batch means, NaN from the empty one.
    naive_value, _ = jax.jit(ga.microbatch_value_and_grad(masked_loss, 4))(PARAMS, BATCH)
    assert not np.isfinite(naive_value)


def test_sum_and_weight_gives_full_batch_weighted_mean():
    expected = MASKED_FULL
    for k in (1, 4):
        fn = ga.microbatch_value_and_grad(masked_sum_and_weight, k, sum_and_weight=True)
        chex.assert_trees_all_close(
            jax.jit(fn)(PARAMS, BATCH), expected, rtol=RTOL, atol=ATOL, strict=True
        )


def test_aux_reductions():
    fn = ga.microbatch_value_and_grad(
        loss_with_metrics,
        4,
        has_aux=True,
        aux_reduction=METRIC_REDUCTIONS,
    )
    out = jax.jit(fn)(PARAMS, BATCH)
    expected = jax.jit(jax.value_and_grad(loss_with_metrics, has_aux=True))(PARAMS, BATCH)
    chex.assert_trees_all_close(out, expected, rtol=RTOL, atol=ATOL, strict=True)
    (_, aux), _ = out
    assert aux["num_correct"].dtype == jnp.int32


def test_aux_default_mean_is_weighted_like_the_loss():
    def loss(params, batch):
        losses, logits = _per_example(params, batch)
        correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
        w = batch["mask"]
        return jnp.sum(losses * w), jnp.sum(w), {"acc": jnp.sum(correct * w) / jnp.sum(w)}

    def as_sum_and_weight(params, batch):
        s, w, aux = loss(params, batch)
        return (s, w), aux

    def full(params, batch):
        s, w, aux = loss(params, batch)
        return s / w, aux

    fn = ga.microbatch_value_and_grad(as_sum_and_weight, 4, has_aux=True, sum_and_weight=True)
    expected = jax.jit(jax.value_and_grad(full, has_aux=True))(PARAMS, BATCH)
    chex.assert_trees_all_close(
        jax.jit(fn)(PARAMS, BATCH), expected, rtol=RTOL, atol=ATOL, strict=True
    )


def test_aux_reduction_errors():
    fn = ga.microbatch_value_and_grad(loss_with_metrics, 4, has_aux=True)
    with pytest.raises(TypeError, match=r"'num_correct'.*int32"):
        fn(PARAMS, BATCH)
    with pytest.raises(ValueError, match=r"concat.*scalar"):
        ga.microbatch_value_and_grad(loss_with_metrics, 4, has_aux=True, aux_reduction="concat")(
            PARAMS, BATCH
        )
    with pytest.raises(ValueError, match="aux_reduction"):
        ga.microbatch_value_and_grad(mean_loss, 4, has_aux=True, aux_reduction="median")
    with pytest.raises(ValueError, match="has_aux=False"):
        ga.microbatch_value_and_grad(mean_loss, 4, aux_reduction="sum")
    with pytest.raises(ValueError, match="prefix"):
        ga.microbatch_value_and_grad(
            loss_with_metrics, 4, has_aux=True, aux_reduction={"accuracy": "mean"}
        )(PARAMS, BATCH)


def _dropout_loss(params, batch, key):
    keep = jax.random.bernoulli(key, 0.5, (batch["x"].shape[0], 16))
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) * keep / 0.5
    logits = h @ params["w2"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, jax.random.uniform(key)


@pytest.mark.slow
def test_key_argnums_folds_a_raw_key():
    # Typed keys need no key_argnums (see the test below); raw keys are listed.
    k = 4
    key = jax.random.PRNGKey(3)
    fn = ga.microbatch_value_and_grad(
        _dropout_loss, k, has_aux=True, key_argnums=2, aux_reduction=lambda draws: draws
    )
    (value, draws), grads = jax.jit(fn)(PARAMS, BATCH, key)
    assert len(set(np.asarray(draws).tolist())) == k
    # Reference: a Python loop over the strided micro-batches, key fold_in(key, i).
    reference = jax.jit(jax.value_and_grad(_dropout_loss, has_aux=True))
    results = [
        reference(
            PARAMS,
            jax.tree.map(lambda x, i=i: x[i::k], BATCH),
            jax.random.fold_in(key, i),
        )
        for i in range(k)
    ]
    np.testing.assert_allclose(draws, [r[0][1] for r in results], rtol=RTOL)
    chex.assert_trees_all_close(
        (value, grads),
        jax.tree.map(lambda *xs: sum(xs) / k, *[(r[0][0], r[1]) for r in results]),
        rtol=RTOL,
        atol=ATOL,
        strict=True,
    )
    with pytest.raises(TypeError, match="key_argnums"):
        fn(PARAMS, BATCH, jnp.zeros(2))


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        return nn.Dense(3)(nn.relu(x))


_BN_MODEL = _BNNet()
_BN_VARS = _BN_MODEL.init(jax.random.key(0), BATCH["x"], train=False)


def _bn_loss(params, batch_stats, batch):
    logits, updates = _BN_MODEL.apply(
        {"params": params, "batch_stats": batch_stats},
        batch["x"],
        train=True,
        mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, (updates["batch_stats"], None)


def test_flax_batch_stats_thread_through_microbatches_in_order():
    k = 4
    fn = ga.microbatch_value_and_grad(_bn_loss, k, has_aux=True, batch_argnums=2, carry_argnums=1)

    @jax.jit
    def two_steps(params, batch_stats):
        # Inside a scan over train steps: the carried state keeps its types.
        def step(stats, _):
            (loss, (stats, _)), grads = fn(params, stats, BATCH)
            return stats, (loss, grads)

        return jax.lax.scan(step, batch_stats, length=2)

    stats, (losses, grads) = two_steps(_BN_VARS["params"], _BN_VARS["batch_stats"])
    # Reference: a Python loop over the strided micro-batches, in order.
    ref_stats = _BN_VARS["batch_stats"]
    reference = jax.jit(jax.value_and_grad(_bn_loss, has_aux=True))
    for step in range(2):
        total_loss, total_grads = 0.0, None
        for i in range(k):
            micro = jax.tree.map(lambda x, i=i: x[i::k], BATCH)
            (loss, (ref_stats, _)), g = reference(_BN_VARS["params"], ref_stats, micro)
            total_loss += loss / k
            total_grads = g if total_grads is None else jax.tree.map(jnp.add, total_grads, g)
        total_grads = jax.tree.map(lambda g: g / k, total_grads)
        chex.assert_trees_all_close(
            (losses[step], jax.tree.map(lambda g, step=step: g[step], grads)),
            (total_loss, total_grads),
            rtol=RTOL,
            atol=ATOL,
            strict=True,
        )
    chex.assert_trees_all_close(stats, ref_stats, rtol=RTOL, atol=ATOL, strict=True)
    assert not np.allclose(stats["BatchNorm_0"]["mean"], 0.0)


def test_carry_errors():
    with pytest.raises(ValueError, match="has_aux=True"):
        ga.microbatch_value_and_grad(_bn_loss, 4, batch_argnums=2, carry_argnums=1)

    def bad(params, batch_stats, batch):
        loss, (stats, _) = _bn_loss(params, batch_stats, batch)
        return loss, ({"stats": stats}, None)

    fn = ga.microbatch_value_and_grad(bad, 4, has_aux=True, batch_argnums=2, carry_argnums=1)
    with pytest.raises(ValueError, match="carry_argnums=1"):
        fn(_BN_VARS["params"], _BN_VARS["batch_stats"], BATCH)


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
@pytest.mark.slow
@pytest.mark.hlo
def test_sharded_batch_stays_sharded(axis_type):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    batch = jax.device_put(BATCH, NamedSharding(mesh, P("data")))
    params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
    step = jax.jit(
        ga.microbatch_value_and_grad(
            loss_with_metrics, 2, has_aux=True, aux_reduction=METRIC_REDUCTIONS
        )
    )
    compiled = step.lower(params, batch).compile()
    ops = harness.Hlo(compiled).collective_counts()
    assert ops["all-gather"] == ops["all-to-all"] == ops["collective-permute"] == 0, ops
    # Each device reads its own 2 rows of the 16-example micro-batch.
    assert re.search(r"f32\[2,6\][^\n]*dynamic-slice", compiled.as_text())
    (value, aux), grads = step(params, batch)
    expected = jax.jit(jax.value_and_grad(loss_with_metrics, has_aux=True))(PARAMS, BATCH)
    chex.assert_trees_all_close(((value, aux), grads), expected, rtol=RTOL, atol=ATOL, strict=True)
    # Per-example outputs come back in batch order and still sharded.
    assert aux["losses"].sharding.is_equivalent_to(batch["y"].sharding, 1)

    if axis_type == jax.sharding.AxisType.Explicit:
        # Micro-batches of 4 examples cannot split over 8 devices without moving data.
        with pytest.raises(ValueError, match="micro-batch size 4"):
            jax.jit(ga.microbatch_value_and_grad(mean_loss, 8))(params, batch)
        return

    # Control: contiguous micro-batches (examples 0..15, 16..31) need resharding.
    def contiguous(params, batch):
        halves = jax.tree.map(lambda x: x.reshape(2, -1, *x.shape[1:]), batch)
        grads = [
            jax.grad(mean_loss)(params, jax.tree.map(lambda x, i=i: x[i], halves)) for i in (0, 1)
        ]
        return jax.tree.map(lambda a, b: (a + b) / 2, *grads)

    control = harness.Hlo(jax.jit(contiguous).lower(params, batch).compile()).collective_counts()
    assert control["all-gather"] + control["all-to-all"] + control["collective-permute"] > 0


@pytest.mark.hlo
def test_inside_shard_map_one_reduction_per_step(explicit_mesh):
    # Local micro-batching per device and one cross-device mean per step.
    mesh = explicit_mesh
    batch = jax.device_put(BATCH, NamedSharding(mesh, P("data")))
    params = jax.device_put(PARAMS, NamedSharding(mesh, P()))

    def loss(params, seen, batch):
        # `seen` is carried state that becomes device-varying: a running sum.
        return mean_loss(params, batch), (seen + batch["x"].sum(0), None)

    grad_fn = ga.microbatch_value_and_grad(loss, 2, has_aux=True, batch_argnums=2, carry_argnums=1)

    def local(params, batch):
        # Varying params: no implicit all-reduce of every micro-gradient.
        params = pcast_to_varying(params, "data")
        (value, (seen, _)), grads = grad_fn(params, jnp.zeros(6), batch)
        return jax.lax.pmean((value, grads), "data"), jax.lax.psum(seen, "data")

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))
    ops = harness.Hlo(step.lower(params, batch).compile()).collective_counts()
    # XLA merges the final mean and sum into one all-reduce; none is left in the loop.
    assert ops["all-reduce"] == 1 and ops["all-gather"] == 0, ops
    out, seen = step(params, batch)
    chex.assert_trees_all_close(out, FULL, rtol=RTOL, atol=ATOL, strict=True)
    np.testing.assert_allclose(seen, BATCH["x"].sum(0), rtol=RTOL, atol=1e-5)


def test_batch_size_not_divisible():
    fn = ga.microbatch_value_and_grad(mean_loss, 5)
    with pytest.raises(ValueError, match=r"batch size 32 and num_microbatches=5"):
        fn(PARAMS, BATCH)
    with pytest.raises(ValueError, match="same leading"):
        ga.microbatch_value_and_grad(mean_loss, 4)(PARAMS, {**BATCH, "y": BATCH["y"][:8]})
    with pytest.raises(ValueError, match="scalar"):
        ga.microbatch_value_and_grad(mean_loss, 4)(PARAMS, {**BATCH, "t": jnp.float32(1)})


def test_accumulator_dtype_for_16_bit_gradients():
    # Micro-gradients 256, 1, 1, ... : in bfloat16 (8 significant bits)
    # 256 + 1 rounds back to 256, so a bfloat16 sum loses every 1.
    x = jnp.array([256.0] + [1.0] * 7, jnp.bfloat16)

    def loss(w, x):
        return jnp.mean(w * x)

    w = jnp.ones((), jnp.bfloat16)
    value, grad = jax.jit(ga.microbatch_value_and_grad(loss, 8))(w, x)
    assert value.dtype == grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(float(grad), 263 / 8, rtol=2**-8)
    np.testing.assert_allclose(float(value), 263 / 8, rtol=2**-8)
    low = ga.microbatch_value_and_grad(loss, 8, accumulator_dtype=jnp.bfloat16)
    assert float(jax.jit(low)(w, x)[1]) == 32.0
    with pytest.raises(TypeError, match="accumulator_dtype"):
        ga.microbatch_value_and_grad(loss, 8, accumulator_dtype=jnp.int32)


def test_complex_gradients_keep_their_imaginary_part_with_a_real_accumulator_dtype():
    def loss(w, x):
        return jnp.mean(jnp.abs(x @ w) ** 2)

    w = jnp.array([1.0 + 2.0j, -0.5j])
    x = BATCH["x"][:, :2].astype(jnp.complex64) * (1 - 1j)
    fn = ga.microbatch_value_and_grad(loss, 4, accumulator_dtype=jnp.float32)
    chex.assert_trees_all_close(
        jax.jit(fn)(w, x), jax.value_and_grad(loss)(w, x), rtol=RTOL, atol=ATOL, strict=True
    )


def test_construction_errors():
    with pytest.raises(TypeError, match="fun must be callable"):
        ga.microbatch_value_and_grad(3, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        ga.microbatch_value_and_grad(mean_loss, 0)
    with pytest.raises(ValueError, match="both argnums and batch_argnums"):
        ga.microbatch_value_and_grad(mean_loss, 2, batch_argnums=0)
    with pytest.raises(TypeError, match="batch_argnums"):
        ga.microbatch_value_and_grad(mean_loss, 2, batch_argnums="batch")
    with pytest.raises(ValueError, match="weight_fn and sum_and_weight"):
        ga.microbatch_value_and_grad(mean_loss, 2, weight_fn=len, sum_and_weight=True)
    with pytest.raises(ValueError, match="batch_argnums names position 1"):
        ga.microbatch_value_and_grad(mean_loss, 2)(PARAMS)
    with pytest.raises(TypeError, match=r"\(loss_sum, weight_sum\)"):
        ga.microbatch_value_and_grad(mean_loss, 2, sum_and_weight=True)(PARAMS, BATCH)


def test_float_num_microbatches_names_the_fix():
    # The message once suggested "a callable for a schedule", which is refused.
    with pytest.raises(TypeError, match="num_microbatches") as error:
        ga.microbatch_value_and_grad(mean_loss, 4.0)
    message = str(error.value)
    assert "num_microbatches=4," in message and "'auto'" in message
    assert "schedule" not in message and "callable" not in message


def test_batch_passed_as_keyword_names_the_fix():
    with pytest.raises(ValueError, match="batch_argnums names position 1") as error:
        ga.microbatch_value_and_grad(mean_loss, 4)(PARAMS, batch=BATCH)
    message = str(error.value)
    assert "['batch']" in message and "by position" in message
    assert "grad_fn(params, batch) rather than grad_fn(params, batch=batch)" in message


def test_default_aux_is_what_value_and_grad_gives_on_the_full_batch():
    # No aux_reduction: per-example leaves come back per example (B,), scalar
    # metrics as their full-batch value, at every K. (Weighted scalars: see
    # test_aux_default_mean_is_weighted_like_the_loss.)
    def loss(params, batch):
        losses, logits = _per_example(params, batch)
        correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
        return losses.mean(), {"losses": losses, "logits": logits, "accuracy": correct.mean()}

    expected = jax.jit(jax.value_and_grad(loss, has_aux=True))(PARAMS, BATCH)
    for k in (1, 2, 8):
        out = jax.jit(ga.microbatch_value_and_grad(loss, k, has_aux=True))(PARAMS, BATCH)
        chex.assert_trees_all_close(out, expected, rtol=RTOL, atol=ATOL, strict=True)
        assert out[0][1]["losses"].shape == (B,) and out[0][1]["logits"].shape == (B, 3)


def test_bool_aux_sum_has_the_same_dtype_at_every_k():
    def loss(params, batch):
        losses, logits = _per_example(params, batch)
        return losses.mean(), jnp.any(jnp.argmax(logits, -1) == batch["y"])

    results = [
        jax.jit(ga.microbatch_value_and_grad(loss, k, has_aux=True, aux_reduction="sum"))(
            PARAMS, BATCH
        )[0][1]
        for k in (1, 2, 4)
    ]
    assert [r.dtype for r in results] == [jnp.int32] * 3
    # Each micro-batch's bool counts once: K=1 sees one.
    any_correct = jax.jit(lambda batch: loss(PARAMS, batch)[1])
    expected = [
        sum(bool(any_correct(jax.tree.map(lambda x, i=i, k=k: x[i::k], BATCH))) for i in range(k))
        for k in (1, 2, 4)
    ]
    assert [int(r) for r in results] == expected


@pytest.mark.slow
def test_typed_key_gets_a_distinct_key_per_microbatch_without_key_argnums():
    k = 4
    key = jax.random.key(3)

    def loss(params, batch, key, *, scale):
        value, draw = _dropout_loss(params, batch, key)
        return scale * value, draw

    def kw_loss(params, batch, rngs, scale):
        return loss(params, batch, rngs["dropout"], scale=scale)

    fn = ga.microbatch_value_and_grad(loss, k, has_aux=True, aux_reduction=lambda d: d)
    (value, draws), grads = jax.jit(fn)(PARAMS, BATCH, key, scale=2.0)
    assert len(set(np.asarray(draws).tolist())) == k
    # Reference: a Python loop over the strided micro-batches, key fold_in(key, i).
    reference = jax.jit(jax.value_and_grad(loss, has_aux=True))
    results = [
        reference(PARAMS, jax.tree.map(lambda x, i=i: x[i::k], BATCH), fold, scale=2.0)
        for i, fold in enumerate(jax.random.fold_in(key, i) for i in range(k))
    ]
    np.testing.assert_allclose(draws, [r[0][1] for r in results], rtol=RTOL)
    chex.assert_trees_all_close(
        (value, grads),
        jax.tree.map(lambda *xs: sum(xs) / k, *[(r[0][0], r[1]) for r in results]),
        rtol=RTOL,
        atol=ATOL,
        strict=True,
    )
    # An array of typed keys is folded key by key.
    keys = jax.random.split(key, 2)

    def two_keys(params, batch, keys):
        return loss(params, batch, keys[1], scale=2.0)

    two_fn = ga.microbatch_value_and_grad(two_keys, k, has_aux=True, aux_reduction=lambda d: d)
    (_, two_draws), _ = jax.jit(two_fn)(PARAMS, BATCH, keys)
    expected = [jax.random.uniform(jax.random.fold_in(keys[1], i)) for i in range(k)]
    np.testing.assert_allclose(two_draws, expected, rtol=RTOL)
    # A typed key inside a keyword argument is folded the same way.
    kw_fn = ga.microbatch_value_and_grad(kw_loss, k, has_aux=True, aux_reduction=lambda d: d)
    (kw_value, kw_draws), _ = jax.jit(kw_fn)(PARAMS, BATCH, rngs={"dropout": key}, scale=2.0)
    np.testing.assert_allclose(kw_draws, draws, rtol=RTOL)
    np.testing.assert_allclose(kw_value, value, rtol=RTOL)


def test_raw_key_outside_key_argnums_is_refused_with_the_fix():
    fn = ga.microbatch_value_and_grad(_dropout_loss, 4, has_aux=True)
    with pytest.raises(TypeError, match="argument 2") as error:
        fn(PARAMS, BATCH, jax.random.PRNGKey(3))
    message = str(error.value)
    assert "jax.random.key(" in message and "key_argnums" in message
    with pytest.raises(TypeError, match="keyword argument 'rng'"):
        ga.microbatch_value_and_grad(lambda p, b, rng: mean_loss(p, b), 4)(
            PARAMS, BATCH, rng=jax.random.PRNGKey(0)
        )


@pytest.mark.slow
def test_docs_page_code_runs():
    # Every Python block of the page, in order, in one namespace: the train
    # steps shown there (linen TrainState, NNX, with accumulate) are the tested ones.
    page = pathlib.Path(__file__).parents[1] / "docs" / "microbatching.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(blocks) >= 8
    ns: dict = {}
    for n, block in enumerate(blocks):
        exec(compile(block, f"{page.name}[block {n}]", "exec"), ns)
    # linen: three steps, statistics moved, metrics reduced to a scalar.
    assert int(ns["state"].step) == 3
    assert not np.allclose(ns["state"].batch_stats["BatchNorm_0"]["mean"], 0.0)
    assert ns["metrics"]["accuracy"].shape == ()
    # NNX: the dropout stream advanced once per micro-batch (3 steps x 4).
    from flax import nnx

    counts = jax.tree.leaves(nnx.state(ns["nnx_model"], nnx.RngCount))
    assert [int(c) for c in counts] == [12]
    assert not np.allclose(ns["nnx_model"].norm.mean[...], 0.0)
    assert int(ns["nnx_optimizer"].step) == 3
    # The module passed straight in: the same steps, the same state as the split pattern.
    for a, b in zip(
        jax.tree.leaves(nnx.state(ns["direct_model"])),
        jax.tree.leaves(nnx.state(ns["nnx_model"])),
        strict=True,
    ):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert int(ga.optimizer_step(ns["w_state"])) == 1


# --- FSDP: params sharded over the mesh (issue 23) ------------------------------

_MESHES = {
    # mesh shape, axis names, the batch's spec, the params' specs (sharded and replicated leaves)
    "data": ((8,), ("data",), P("data"), {"w1": P(None, "data"), "b1": P(), "w2": P("data")}),
    "data_fsdp": (
        (2, 4),
        ("data", "fsdp"),
        P(("data", "fsdp")),
        {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)},
    ),
}


def _gathered(params):
    # The user's FSDP loss gathers each param at use; its transpose reduce-scatters.
    # (Without a mesh, for the one-device reference, there is nothing to gather.)
    if jax.sharding.get_abstract_mesh().empty:
        return params
    return jax.tree.map(lambda x: jax.sharding.reshard(x, P()), params)


def _fsdp_loss(params, seen, batch):
    losses, logits = _per_example(_gathered(params), batch)
    # A carry (running sum) and aux of every kind: per example, a mean, a count.
    aux = {"losses": losses, "max_logit": jnp.max(logits), "count": jnp.sum(batch["y"] == 0)}
    return losses.mean(), (seen + jnp.sum(batch["x"], 0), aux)


@pytest.mark.parametrize("layout", sorted(_MESHES))
@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_fsdp_params_match_the_full_batch(layout, axis_type):
    shape, names, batch_spec, specs = _MESHES[layout]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
    fn = ga.microbatch_value_and_grad(
        _fsdp_loss,
        4,
        has_aux=True,
        batch_argnums=2,
        carry_argnums=1,
        aux_reduction={"losses": "auto", "max_logit": "mean", "count": "sum"},
    )
    expected = jax.jit(jax.value_and_grad(_fsdp_loss, has_aux=True))(PARAMS, jnp.zeros(6), BATCH)
    with jax.set_mesh(mesh):
        params = jax.device_put(PARAMS, specs)
        batch = jax.device_put(BATCH, batch_spec)
        (value, (seen, aux)), grads = jax.jit(fn)(params, jax.device_put(jnp.zeros(6), P()), batch)
    if axis_type == jax.sharding.AxisType.Explicit:
        # Each gradient is typed, and sharded, like its leaf (FSDP: 1/n per device).
        # On an Auto mesh the compiler chooses the gradients' shardings.
        for name in specs:
            assert jax.typeof(grads[name]).sharding.spec == jax.typeof(params[name]).sharding.spec
            assert grads[name].sharding.is_equivalent_to(params[name].sharding, grads[name].ndim)
    (want_value, (want_seen, want_aux)), want_grads = expected
    want_aux = {**want_aux, "max_logit": None}  # a max per micro-batch, averaged: not the full max
    aux = {**aux, "max_logit": None}
    chex.assert_trees_all_close(
        ((value, (seen, aux)), grads),
        ((want_value, (want_seen, want_aux)), want_grads),
        rtol=RTOL,
        atol=ATOL,
    )


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_fsdp_bfloat16_params_sum_in_float32(axis_type):
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
    specs = _MESHES["data_fsdp"][3]
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)

    def loss(params, batch):
        return mean_loss(jax.tree.map(lambda x: x.astype(jnp.float32), _gathered(params)), batch)

    fn = jax.jit(ga.microbatch_value_and_grad(loss, 4, accumulator_dtype=jnp.float32))
    want = jax.jit(jax.value_and_grad(loss))(params16, BATCH)
    with jax.set_mesh(mesh):
        params = jax.device_put(params16, specs)
        value, grads = fn(params, jax.device_put(BATCH, P(("data", "fsdp"))))
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    if axis_type == jax.sharding.AxisType.Explicit:
        assert jax.typeof(grads["w2"]).sharding.spec == P("fsdp", None)
    # One bfloat16 rounding of a float32 sum: within bfloat16's precision of the full batch.
    chex.assert_trees_all_close((value, grads), want, rtol=2**-7, atol=1e-3)


# --- Issue 29: a flax.nnx module passed as the differentiated argument ---


class _NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.dense1 = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.dense2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.dropout(nnx.relu(self.norm(self.dense1(x)))))


def _nnx_batch(seed=0, size=16):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(size, 5)), jnp.float32), jnp.asarray(
        rng.integers(0, 3, size), jnp.int32
    )


def _nnx_loss(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits


def _leaves_equal(a, b, **tolerance):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if tolerance:
            np.testing.assert_allclose(x, y, **tolerance)
        else:
            np.testing.assert_array_equal(
                jax.random.key_data(x) if _is_key(x) else x,
                jax.random.key_data(y) if _is_key(y) else y,
            )


def _is_key(x):
    return jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)


def test_nnx_module_with_dropout_equals_the_split_merge_pattern():
    # Training mode: dropout draws a mask per micro-batch and BatchNorm's statistics move.
    # Passing the module straight in gives what the docs' split/merge pattern gives.
    x, y = _nnx_batch()

    @nnx.jit
    def direct(model, x, y):
        grad_fn = ga.microbatch_value_and_grad(_nnx_loss, 4, has_aux=True, batch_argnums=(1, 2))
        return grad_fn(model, x, y)

    @nnx.jit
    def split_merge(model, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params, rest, x, y):
            model = nnx.merge(graphdef, params, rest, copy=True)
            loss, logits = _nnx_loss(model, x, y)
            return loss, (nnx.state(model, nnx.Not(nnx.Param)), logits)

        grad_fn = ga.microbatch_value_and_grad(
            loss_fn, 4, has_aux=True, batch_argnums=(2, 3), carry_argnums=1
        )
        (loss, (rest, logits)), grads = grad_fn(params, rest, x, y)
        nnx.update(model, rest)
        return (loss, logits), grads

    ours, theirs = _NnxNet(nnx.Rngs(0)), _NnxNet(nnx.Rngs(0))
    (loss, logits), grads = direct(ours, x, y)
    (ref_loss, ref_logits), ref_grads = split_merge(theirs, x, y)
    assert float(loss) == float(ref_loss)
    np.testing.assert_array_equal(logits, ref_logits)
    _leaves_equal(grads, ref_grads)
    _leaves_equal(nnx.state(ours), nnx.state(theirs))  # statistics and RNG counters moved
    before = nnx.state(_NnxNet(nnx.Rngs(0)), nnx.Not(nnx.Param))
    assert not np.array_equal(
        nnx.state(ours, nnx.BatchStat)["norm"]["mean"][...], before["norm"]["mean"][...]
    )


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("has_aux", [False, True])
def test_nnx_module_gradients_equal_the_full_batch(k, has_aux):
    # Evaluation mode (dropout off, running statistics): the micro-batched value and
    # gradient are nnx.value_and_grad's on the full batch, an nnx.State of the params.
    x, y = _nnx_batch(1)
    model = _NnxNet(nnx.Rngs(1))
    model.eval()

    def loss(model, x, y):
        value, logits = _nnx_loss(model, x, y)
        return (value, logits) if has_aux else value

    full, full_grads = nnx.value_and_grad(loss, has_aux=has_aux)(model, x, y)
    grad_fn = ga.microbatch_value_and_grad(loss, k, has_aux=has_aux, batch_argnums=(1, 2))
    got, grads = nnx.jit(grad_fn)(model, x, y)
    _leaves_equal(got, full, rtol=1e-6, atol=1e-7)
    assert type(grads) is type(full_grads)
    _leaves_equal(grads, full_grads, rtol=1e-5, atol=1e-7)


def test_nnx_module_each_micro_batch_draws_its_own_dropout_mask():
    # Dropout only, on a constant input: K micro-batches advance the RNG stream K times,
    # as K calls of the model would, and their masks differ.
    class Drop(nnx.Module):
        def __init__(self):
            self.scale = nnx.Param(jnp.ones(64))
            self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))

        def __call__(self, x):
            return self.dropout(x * self.scale[...])

    model, reference = Drop(), Drop()
    x = jnp.ones((4, 64))
    grad_fn = ga.microbatch_value_and_grad(lambda m, x: m(x).sum(), 4)
    _, grads = grad_fn(model, x)
    masks = [reference(x[:1]) for _ in range(4)]  # four calls, one micro-batch each
    # The mean over micro-batches of each one's gradient, its mask (0 or 2).
    np.testing.assert_array_equal(grads["scale"][...], sum(m[0] for m in masks) / 4)
    assert len({tuple(np.asarray(m[0])) for m in masks}) == 4
    _leaves_equal(nnx.state(model, nnx.RngState), nnx.state(reference, nnx.RngState))


def test_nnx_module_with_carry_argnums_names_the_split_merge_pattern():
    model = _NnxNet(nnx.Rngs(0))
    x, y = _nnx_batch()
    grad_fn = ga.microbatch_value_and_grad(
        lambda m, c, x, y: (_nnx_loss(m, x, y)[0], (c, None)),
        4,
        has_aux=True,
        batch_argnums=(2, 3),
        carry_argnums=1,
    )
    with pytest.raises(TypeError, match=r"carry_argnums=1.*nnx.split\(model, nnx.Param"):
        grad_fn(model, jnp.zeros(()), x, y)
