"""Tests for global-batch statistics: `microbatch_value_and_grad(..., statistics_fn=...)`."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._base.compat import pcast_to_varying

RTOL, ATOL = 1e-5, 1e-6
# A tiny MoE: 2 layers, top-2 of 4 experts, load-balancing coefficient 0.01.
EXPERTS, TOP_K, LAYERS, COEF = 4, 2, 2, 0.01
B, T, D, RATE = 64, 4, 8, 0.1


def _params(seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 2 * LAYERS + 1))
    layers = [
        {
            "router": jax.random.normal(next(keys), (D, EXPERTS)),
            "experts": jax.random.normal(next(keys), (EXPERTS, D, D)) / D**0.5,
        }
        for _ in range(LAYERS)
    ]
    return {"layers": layers, "head": jax.random.normal(next(keys), (D,)) / D**0.5}


def _batch(seed=1, n=B):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (n, T, D)), "y": jax.random.normal(ky, (n, T))}


def _forward(params, x, mask):
    """Predictions, and per layer the router probabilities and the 0/1 choice of experts."""
    h = x * mask / (1 - RATE)
    routing = []
    for layer in params["layers"]:
        probs = jax.nn.softmax(h @ layer["router"], axis=-1)
        top_p, top_i = jax.lax.top_k(probs, TOP_K)
        chosen = jax.nn.one_hot(top_i, EXPERTS, dtype=jnp.int32)  # (..., TOP_K, E)
        gates = jnp.sum(chosen * top_p[..., None], axis=-2)
        outs = jnp.einsum("btd,edf->btef", h, layer["experts"])
        h = h + jnp.tanh(jnp.einsum("bte,btef->btf", gates, outs))
        routing.append((probs, jnp.sum(chosen, axis=-2)))
    return h @ params["head"], routing


def _objective(params, batch, mask, counts=None):
    """MSE plus E * sum_e f_e P_e per layer; f from `counts`, else from this batch's own routing."""
    pred, routing = _forward(params, batch["x"], mask)
    balance = 0.0
    for layer, (probs, chosen) in enumerate(routing):
        c = jnp.sum(chosen, axis=(0, 1)) if counts is None else counts[layer]
        f = c / jnp.sum(c)
        balance += EXPERTS * jnp.sum(f * jnp.mean(probs, axis=(0, 1))) / LAYERS
    loss = jnp.mean((pred - batch["y"]) ** 2) + COEF * balance
    return loss, {"balance": balance, "pred": pred}


def _dropout(key, shape):
    return jax.random.bernoulli(key, 1 - RATE, shape)


def moe_loss(params, batch, key, *, statistics=None):
    counts = None if statistics is None else statistics["counts"]
    return _objective(params, batch, _dropout(key, batch["x"].shape), counts)


def moe_statistics(params, batch, key):
    _, routing = _forward(params, batch["x"], _dropout(key, batch["x"].shape))
    return {"counts": [jnp.sum(chosen, axis=(0, 1)) for _, chosen in routing]}


def _mask(key, rows, k):
    """The dropout mask micro-batching draws for `rows` examples: key fold_in(key, i) for i."""
    if k == 1:
        return _dropout(key, (rows, T, D))
    masks = jnp.stack([_dropout(jax.random.fold_in(key, i), (rows // k, T, D)) for i in range(k)])
    return jnp.swapaxes(masks, 0, 1).reshape(rows, T, D)


def _whole(params, batch, mask):
    """`jax.value_and_grad` of the whole batch's objective (its own global counts)."""
    return jax.jit(jax.value_and_grad(_objective, has_aux=True))(params, batch, mask)


PARAMS, BATCH, KEY = _params(), _batch(), jax.random.key(2)


def _assert_close(got, expected):
    chex.assert_trees_all_close(got, expected, rtol=RTOL, atol=ATOL, strict=True)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_moe_balancing_equals_the_whole_batch(k):
    fn = ga.microbatch_value_and_grad(moe_loss, k, has_aux=True, statistics_fn=moe_statistics)
    got = jax.jit(fn)(PARAMS, BATCH, KEY)
    _assert_close(got, _whole(PARAMS, BATCH, _mask(KEY, B, k)))


def test_per_microbatch_balancing_is_another_objective():
    # Control: without the first pass each micro-batch balances its own tokens.
    k = 4
    fn = ga.microbatch_value_and_grad(moe_loss, k, has_aux=True)
    (_, aux), grads = jax.jit(fn)(PARAMS, BATCH, KEY)
    (_, whole_aux), whole_grads = _whole(PARAMS, BATCH, _mask(KEY, B, k))
    assert abs(float(aux["balance"] / whole_aux["balance"] - 1)) > 1e-3
    # The balancing term is 1 % of the loss: its error shows in the router's gradient
    # at five times the tolerance of the tests above.
    router = grads["layers"][0]["router"]
    error = jnp.linalg.norm(router - whole_grads["layers"][0]["router"]) / jnp.linalg.norm(router)
    assert error > 5 * RTOL, error


def test_k1_passes_the_whole_batch_statistics():
    fn = ga.microbatch_value_and_grad(moe_loss, 1, has_aux=True, statistics_fn=moe_statistics)
    _assert_close(jax.jit(fn)(PARAMS, BATCH, KEY), _whole(PARAMS, BATCH, _mask(KEY, B, 1)))


@pytest.mark.hlo
def test_auto_plans_the_two_pass_program():
    options = {"has_aux": True, "statistics_fn": moe_statistics}
    whole = ga.plan_microbatches(moe_loss, PARAMS, BATCH, KEY, memory_budget=2**40, **options)
    assert whole.num_microbatches == 1
    # A budget just below the whole batch's peak: "auto" splits, and stays exact.
    budget = whole.peak_bytes - 1
    plan = ga.plan_microbatches(moe_loss, PARAMS, BATCH, KEY, memory_budget=budget, **options)
    assert plan.num_microbatches > 1
    fn = ga.microbatch_value_and_grad(moe_loss, "auto", memory_budget=budget, **options)
    got = jax.jit(fn)(PARAMS, BATCH, KEY)
    _assert_close(got, _whole(PARAMS, BATCH, _mask(KEY, B, plan.num_microbatches)))


def test_weights_compose_with_statistics():
    # A masked mean scaled by a whole-batch count: weight_fn and sum_and_weight as usual.
    kx, ky, km = jax.random.split(jax.random.key(5), 3)
    batch = {
        "x": jax.random.normal(kx, (16, 3)),
        "y": jax.random.normal(ky, (16,)),
        "m": (jax.random.uniform(km, (16,)) < 0.6).astype(jnp.float32).at[1::4].set(0.0),
    }
    w = jnp.array([0.5, -1.0, 2.0])

    def errors(w, batch):
        return (batch["x"] @ w - batch["y"]) ** 2 * batch["m"]

    def stats(w, batch):
        return {"kept": jnp.sum(batch["m"] > 0)}  # an integer count

    def masked(w, batch, *, statistics):
        return jnp.sum(errors(w, batch)) / jnp.sum(batch["m"]) / statistics["kept"]

    def summed(w, batch, *, statistics):
        return jnp.sum(errors(w, batch)) / statistics["kept"], jnp.sum(batch["m"])

    expected = jax.value_and_grad(lambda w: masked(w, batch, statistics=stats(w, batch)))(w)
    by_weight = ga.microbatch_value_and_grad(
        masked, 4, weight_fn=lambda w, b: b["m"], statistics_fn=stats
    )
    by_sum = ga.microbatch_value_and_grad(summed, 4, sum_and_weight=True, statistics_fn=stats)
    _assert_close(jax.jit(by_weight)(w, batch), expected)
    _assert_close(jax.jit(by_sum)(w, batch), expected)


def test_counts_past_float32_precision_are_exact():
    # 2**24 + 1 is the first integer float32 cannot hold: integer sums stay exact.
    def stats(params, batch):
        return {
            "count": batch["n"].sum(),
            "flag": jnp.any(batch["n"] > 2**22),
            "half": batch["h"].sum(),
        }

    def loss(params, batch, *, statistics):
        return params * statistics["half"], statistics

    batch = {
        "n": jnp.full((4,), 2**22, jnp.int32).at[0].add(1),
        "h": jnp.full((4,), 2049.0, jnp.bfloat16),
    }
    fn = ga.microbatch_value_and_grad(
        loss, 4, has_aux=True, statistics_fn=stats, aux_reduction="sum"
    )
    (_, seen), _ = jax.jit(fn)(jnp.float32(1.0), batch)
    # The loss sees the statistics once per micro-batch: divide the summed aux by K.
    assert seen["count"].dtype == jnp.int32 and int(seen["count"]) // 4 == 2**24 + 1
    assert seen["flag"].dtype == jnp.int32 and int(seen["flag"]) // 4 == 1  # bools are counted
    # bfloat16 holds 2049 as 2048; the sum of four is kept in float32.
    assert seen["half"].dtype == jnp.float32 and float(seen["half"]) / 4 == 4 * 2048.0


def _mesh(axis_type=jax.sharding.AxisType.Explicit):
    return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4, 8])
def test_inside_shard_map_statistics_are_summed_over_axis_name(k):
    mesh = _mesh()
    fn = ga.microbatch_value_and_grad(
        moe_loss, k, has_aux=True, statistics_fn=moe_statistics, axis_name="data"
    )

    def local(params, batch, key):
        params = pcast_to_varying(params, "data")  # no all-reduce per micro-batch
        key = jax.random.fold_in(key, jax.lax.axis_index("data"))  # own dropout per device
        (value, aux), grads = fn(params, batch, key)
        value, aux["balance"], grads = jax.lax.pmean((value, aux["balance"], grads), "data")
        return (value, aux), grads

    step = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P("data"), P()),
            out_specs=((P(), {"balance": P(), "pred": P("data")}), P()),
        )
    )
    got = step(PARAMS, jax.device_put(BATCH, NamedSharding(mesh, P("data"))), KEY)
    rows = B // 8
    mask = jnp.concatenate([_mask(jax.random.fold_in(KEY, d), rows, k) for d in range(8)])
    _assert_close(got, _whole(PARAMS, BATCH, mask))


def test_shard_map_without_axis_name_is_refused():
    mesh = _mesh()
    fn = ga.microbatch_value_and_grad(moe_loss, 2, has_aux=True, statistics_fn=moe_statistics)
    step = jax.shard_map(
        lambda p, b, key: fn(p, b, key)[1],
        mesh=mesh,
        in_specs=(P(), P("data"), P()),
        out_specs=P(),
    )
    batch = jax.device_put(BATCH, NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"varies over the mesh axes \['data'\].*axis_name="):
        jax.jit(step).lower(PARAMS, batch, KEY)


@pytest.mark.slow
@pytest.mark.hlo
@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_global_view_jit_sums_over_the_sharded_batch(axis_type):
    mesh = _mesh(axis_type)
    batch = jax.device_put(BATCH, NamedSharding(mesh, P("data")))
    params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
    for k in (2, 4, 8):
        step = jax.jit(
            ga.microbatch_value_and_grad(moe_loss, k, has_aux=True, statistics_fn=moe_statistics)
        )
        _assert_close(step(params, batch, KEY), _whole(PARAMS, BATCH, _mask(KEY, B, k)))
    # The statistics cost one all-reduce of their own bytes (in the first pass, where
    # each micro-batch's counts are summed over the batch's shards), and it replaces
    # the one the per-micro-batch loss makes for its own counts; the gradients' all-reduce
    # is the same. (The model's forward all-gathers its gates; the first pass repeats it.)
    k = 4
    step = jax.jit(
        ga.microbatch_value_and_grad(moe_loss, k, has_aux=True, statistics_fn=moe_statistics)
    )
    per_micro = jax.jit(ga.microbatch_value_and_grad(moe_loss, k, has_aux=True))
    with_stats = harness.Hlo(step.lower(params, batch, KEY).compile())
    without = harness.Hlo(per_micro.lower(params, batch, KEY).compile())
    counted = [i for i in with_stats.ops("all-reduce") if {t for t, _ in i.types} == {"s32"}]
    assert len(counted) == 1 and counted[0].nbytes == LAYERS * EXPERTS * 4, counted
    assert len(with_stats.ops("all-reduce")) == len(without.ops("all-reduce")) == 2
    ops, control = with_stats.collective_counts(), without.collective_counts()
    assert ops["all-gather"] == 2 * control["all-gather"], (ops, control)
    assert ops["all-to-all"] == ops["collective-permute"] == ops["reduce-scatter"] == 0, ops


def test_statistics_keyword_errors():
    with pytest.raises(TypeError, match="statistics_fn must be callable"):
        ga.microbatch_value_and_grad(moe_loss, 2, statistics_fn=3)
    with pytest.raises(ValueError, match="no statistics_fn"):
        ga.microbatch_value_and_grad(moe_loss, 2, axis_name="data")
    with pytest.raises(ValueError, match="carry_argnums=1"):
        ga.microbatch_value_and_grad(
            moe_loss, 2, has_aux=True, carry_argnums=1, statistics_fn=moe_statistics
        )
    fn = ga.microbatch_value_and_grad(moe_loss, 2, has_aux=True, statistics_fn=moe_statistics)
    with pytest.raises(TypeError, match="keyword argument 'statistics'"):
        fn(PARAMS, BATCH, KEY, statistics=None)

    def keys(params, batch, key):
        return {"name": jax.random.key(0)}

    bad = ga.microbatch_value_and_grad(moe_loss, 2, has_aux=True, statistics_fn=keys)
    with pytest.raises(TypeError, match=r"must return numbers.*\['name'\]"):
        bad(PARAMS, BATCH, KEY)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(
    ("leaf", "shown"),
    [
        ("expert 3", r"is 'expert 3' of type str"),
        (object(), r"is <object object at 0x\w+> of type object"),
        (np.array(["a", "b"]), r"\(ndarray\) has dtype <U1"),
    ],
    ids=["str", "object", "str-array"],
)
def test_statistics_fn_returning_a_non_number_names_the_leaf(leaf, shown, k):
    # Not JAX's bare "not a valid JAX array type": statistics_fn, the leaf's path and
    # type, and what it may return.
    def labelled(params, batch, key):
        return {"counts": moe_statistics(params, batch, key)["counts"], "tag": [0, leaf]}

    bad = ga.microbatch_value_and_grad(moe_loss, k, has_aux=True, statistics_fn=labelled)
    message = r"statistics_fn must return numbers.*\['tag'\]\[1\]. " + shown
    for run in (bad, jax.jit(bad)):
        with pytest.raises(TypeError, match=message + r".*integers or bools for counts"):
            run(PARAMS, BATCH, KEY)


def test_statistics_fn_may_return_python_and_numpy_numbers():
    # Scalars without a JAX dtype are summed like arrays: NumPy's 64-bit ones in JAX's
    # default 32 bits (no x64 warning), Python numbers as JAX types them.
    def scalars(params, batch, key):
        return {
            "counts": moe_statistics(params, batch, key)["counts"],
            "n": 1,
            "w": np.float64(0.5),
        }

    seen = {}

    def loss(params, batch, key, *, statistics):
        seen.update(n=statistics["n"], w=statistics["w"])
        return moe_loss(params, batch, key, statistics={"counts": statistics["counts"]})

    ga.microbatch_value_and_grad(loss, 4, has_aux=True, statistics_fn=scalars)(PARAMS, BATCH, KEY)
    assert (seen["n"].dtype, seen["w"].dtype) == (jnp.int32, jnp.float32)
    assert (int(seen["n"]), float(seen["w"])) == (4, 2.0)


def test_nnx_module_with_statistics_fn_names_the_split():
    from flax import nnx

    model = nnx.Linear(D, 1, rngs=nnx.Rngs(0))

    def loss(model, batch, *, statistics):
        return jnp.mean(model(batch["x"]) ** 2)

    fn = ga.microbatch_value_and_grad(loss, 2, statistics_fn=lambda m, b: {"n": b["x"].shape[0]})
    with pytest.raises(TypeError, match=r"statistics_fn.*nnx\.split"):
        fn(model, BATCH)


def test_coupled_value_and_grad_balances_from_per_example_routing():
    # coupled_value_and_grad needs no statistics_fn: its loss sees every row of embed_fn's
    # output, here each example's mean router probabilities and its expert counts.
    mask = jnp.ones((B, T, D), bool)

    def embed(params, batch):
        pred, routing = _forward(params, batch["x"], mask[: batch["x"].shape[0]])
        return {
            "pred": pred,
            "y": batch["y"],
            "probs": [jnp.mean(probs, axis=1) for probs, _ in routing],
            "counts": [jnp.sum(chosen, axis=1) for _, chosen in routing],
        }

    def loss(params, reps):
        balance = 0.0
        for probs, counts in zip(reps["probs"], reps["counts"], strict=True):
            c = jnp.sum(counts, axis=0)
            balance += EXPERTS * jnp.sum(c / jnp.sum(c) * jnp.mean(probs, axis=0)) / LAYERS
        return jnp.mean((reps["pred"] - reps["y"]) ** 2) + COEF * balance

    got = jax.jit(ga.coupled_value_and_grad(loss, embed, 4))(PARAMS, BATCH)
    (value, _), grads = _whole(PARAMS, BATCH, mask)
    _assert_close(got, (value, grads))


@pytest.mark.parametrize("k", [1, 4])
def test_unreduced_value_and_grad_sums_statistics_over_the_batch_axis(k):
    def loss(params, batch, key, *, statistics):
        return moe_loss(params, batch, key, statistics=statistics)[0]

    mesh = _mesh()
    with jax.set_mesh(mesh):
        step = jax.jit(
            ga.unreduced_value_and_grad(
                loss, "data", num_microbatches=k, statistics_fn=moe_statistics
            )
        )
        value, grads = step(jax.device_put(PARAMS, P()), jax.device_put(BATCH, P("data")), KEY)
        grads = jax.jit(lambda g: jax.sharding.reshard(g, P()))(grads)
    # Every device folds the same key: its slice's masks are those of one device.
    mask = jnp.concatenate([_mask(KEY, B // 8, k)] * 8)
    (expected_value, _), expected_grads = _whole(PARAMS, BATCH, mask)
    _assert_close((value, grads), (expected_value, expected_grads))


def test_pmap_sums_statistics_over_axis_name():
    k = 2
    fn = ga.microbatch_value_and_grad(
        moe_loss, k, has_aux=True, statistics_fn=moe_statistics, axis_name="devices"
    )

    def local(params, batch, key):
        (value, aux), grads = fn(params, batch, key)
        return jax.lax.pmean((value, aux["balance"], grads), "devices")

    per_device = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), BATCH)
    value, _, grads = jax.pmap(local, "devices", in_axes=(None, 0, None))(PARAMS, per_device, KEY)
    mask = jnp.concatenate([_mask(KEY, B // 8, k)] * 8)
    (expected_value, _), expected_grads = _whole(PARAMS, BATCH, mask)
    _assert_close((value[0], jax.tree.map(lambda g: g[0], grads)), (expected_value, expected_grads))
