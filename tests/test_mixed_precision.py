"""Tests for loss scaling and the 16-bit accumulators (gradaccum_jax._window.loss_scale)."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from benchmarks import harness

K = 4
INITIAL_SCALE = 2.0**10
GROWTH_INTERVAL = 3


def f16_loss(params, x, y):
    # float32 master parameters, float16 compute, float32 loss.
    w, b = params["w"].astype(jnp.float16), params["b"].astype(jnp.float16)
    pred = jnp.tanh(x.astype(jnp.float16) @ w + b)
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def make_window(k):
    tx = optax.chain(
        ga.dynamic_loss_scale(INITIAL_SCALE, growth_interval=GROWTH_INTERVAL),
        ga.accumulate(optax.sgd(0.5), every_k_schedule=k),
    )

    @jax.jit
    def window(params, xs, ys):
        """Runs one window as a lax.scan over micro-batches; returns the scales used."""

        def micro_step(carry, batch):
            params, opt_state = carry
            scale = ga.current_loss_scale(opt_state)
            grads = jax.grad(ga.scale_loss(f16_loss, scale))(params, *batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), scale

        carry = (params, tx.init(params))
        (params, opt_state), scales = jax.lax.scan(micro_step, carry, (xs, ys))
        return params, opt_state, scales

    return window


WINDOW = make_window(K)
WINDOW_WITHOUT_ONE = make_window(K - 1)


def batches():
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(8, 3)) * 0.3, jnp.float32),
        "b": jnp.zeros(3, jnp.float32),
    }
    xs = jnp.asarray(rng.normal(size=(K, 16, 8)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(K, 16, 3)) * 0.5, jnp.float32)
    return params, xs, ys


# Scales used at each micro-step and the scale after the window (K=4, growth
# after 3 finite micro-steps, halving on overflow), per overflow position.
EXPECTED_SCALES = {
    0: ([1024, 512, 512, 512], 1024),
    1: ([1024, 1024, 512, 512], 512),
    2: ([1024, 1024, 1024, 512], 512),
    3: ([1024, 1024, 1024, 2048], 1024),  # grew after 3 finite steps, then overflowed
}


@pytest.mark.parametrize("position", range(K))
@pytest.mark.slow
def test_overflow_drops_only_its_micro_batch(position):
    params, xs, ys = batches()
    # float16 activations overflow (|x @ w| > 65504) for this micro-batch alone.
    bad_xs = xs.at[position].multiply(3e4)
    got, state, scales = WINDOW(params, bad_xs, ys)
    keep = np.arange(K) != position
    want, _, _ = WINDOW_WITHOUT_ONE(params, xs[keep], ys[keep])
    # Unscaling by a power of two is exact, so the scales differing between the
    # runs changes nothing unless a float16 value is subnormal.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)
    assert not np.allclose(got["w"], params["w"])
    used, final = EXPECTED_SCALES[position]
    np.testing.assert_array_equal(scales, used)
    loss_scale_state, accumulate_state = state
    assert float(loss_scale_state.loss_scale) == final
    assert int(loss_scale_state.num_overflows) == 1
    assert int(accumulate_state.num_skipped) == 1
    assert int(accumulate_state.gradient_step) == 1


def test_scale_grows_inside_a_window_and_each_gradient_uses_its_own_scale():
    params, xs, ys = batches()
    got, state, scales = WINDOW(params, xs, ys)
    np.testing.assert_array_equal(scales, [1024, 1024, 1024, 2048])
    assert float(ga.current_loss_scale(state)) == 2048
    assert int(state[0].growth_count) == 1  # one finite micro-step since the growth
    # Reference: the same float16 gradients at one fixed scale, unscaled, averaged.
    grad_fn = jax.jit(jax.vmap(jax.grad(ga.scale_loss(f16_loss, INITIAL_SCALE)), (None, 0, 0)))
    grads = grad_fn(params, xs, ys)
    mean = jax.tree.map(lambda g: g.sum(0) / (INITIAL_SCALE * K), grads)
    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, mean)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def test_loss_scaling_rescues_float16_underflow():
    # Gradients around 1e-8 flush to zero in float16 without a scale.
    def tiny_loss(w):
        return jnp.sum(w.astype(jnp.float16) * jnp.float16(1e-4)).astype(jnp.float32) * 1e-4

    w = jnp.ones(3, jnp.float32)
    assert not np.any(jax.grad(tiny_loss)(w))
    tx = ga.static_loss_scale(2.0**14)
    state = tx.init(w)
    scaled = jax.grad(ga.scale_loss(tiny_loss, ga.current_loss_scale(state)))(w)
    unscaled, _ = jax.jit(tx.update)(scaled, state)
    np.testing.assert_allclose(unscaled, np.full(3, 1e-8), rtol=2e-3)


def test_scale_bounds_and_saturating_counter():
    g = {"w": jnp.array([jnp.inf])}
    tx = ga.dynamic_loss_scale(4.0, min_scale=2.0, growth_interval=1)
    state = tx.init(g)
    update = jax.jit(tx.update)
    for _ in range(3):
        _, state = update(g, state)
    assert float(state.loss_scale) == 2.0
    state = state._replace(num_overflows=jnp.array(np.iinfo(np.int32).max, jnp.int32))
    _, state = update(g, state)
    assert int(state.num_overflows) == np.iinfo(np.int32).max
    # Growth that would overflow float32 keeps the scale.
    top = ga.dynamic_loss_scale(2.0**127, growth_interval=1)
    _, top_state = jax.jit(top.update)({"w": jnp.ones(1)}, top.init(g))
    assert float(top_state.loss_scale) == 2.0**127


def test_static_scale_counts_overflows_and_keeps_its_scale():
    tx = ga.static_loss_scale(8.0)
    state = tx.init({"w": jnp.zeros(2)})
    grads, state = jax.jit(tx.update)({"w": jnp.array([8.0, jnp.nan], jnp.float16)}, state)
    assert grads["w"].dtype == jnp.float32
    assert float(state.loss_scale) == 8.0 and int(state.num_overflows) == 1


def test_extra_arguments_pass_through_to_accumulate():
    tx = optax.chain(ga.static_loss_scale(4.0), ga.accumulate(optax.identity(), 2))
    update = jax.jit(tx.update)
    state = tx.init({"w": jnp.zeros(1)})
    _, state = update({"w": jnp.array([4.0])}, state, weight=3.0)
    u, state = update({"w": jnp.array([8.0])}, state, weight=1.0)
    np.testing.assert_array_equal(u["w"], [(3 * 1.0 + 1 * 2.0) / 4])


def test_replicas_agree_on_overflow_with_axis_name():
    mesh = jax.make_mesh((8,), ("d",))
    tx = ga.dynamic_loss_scale(64.0, axis_name="d")
    grads = jnp.ones((8, 2)).at[3].set(jnp.inf)  # one replica overflows
    grads = jax.device_put(grads, NamedSharding(mesh, P("d")))

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P()))
    def update(g, state):
        return tx.update(g, state)

    unscaled, state = update(grads, tx.init(None))
    assert float(state.loss_scale) == 32.0 and int(state.num_overflows) == 1
    np.testing.assert_array_equal(np.asarray(unscaled)[0], [1 / 64, 1 / 64])


def test_scale_loss_keeps_value_and_aux():
    def loss(w, x):
        return jnp.sum(w * x), {"norm": jnp.linalg.norm(w)}

    w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    fn = jax.jit(jax.value_and_grad(ga.scale_loss(loss, 64.0, has_aux=True), has_aux=True))
    (value, aux), grad = fn(w, x)
    assert float(value) == 11.0
    np.testing.assert_allclose(aux["norm"], np.sqrt(5.0))
    np.testing.assert_array_equal(grad, 64.0 * x)


def test_state_dtypes_are_stable_under_scan():
    params = {"w": jnp.zeros((4, 3), jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    for scaler in (ga.dynamic_loss_scale(8.0, growth_interval=2), ga.static_loss_scale(8.0)):
        tx = optax.chain(
            scaler,
            ga.accumulate(optax.adam(1e-3), 3, accumulator_dtype=jnp.bfloat16, compensated=True),
        )
        init = tx.init(params)

        def body(state, i, tx=tx):
            grads = jax.tree.map(lambda p: jnp.full(p.shape, i, jnp.float16), params)
            grads = jax.tree.map(lambda g: jnp.where(i == 4, jnp.inf, g), grads)
            _, state = tx.update(grads, state, params)
            return state, None

        final, _ = jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(7.0)))(init)
        assert jax.tree.structure(final) == jax.tree.structure(init)
        for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(init), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
        assert int(final[1].num_skipped) == 1


def test_checkpoint_mid_window_resumes_bit_identically(tmp_path):
    import orbax.checkpoint as ocp

    params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32)}
    tx = optax.chain(
        ga.dynamic_loss_scale(16.0, growth_interval=2),
        ga.accumulate(optax.adam(0.1), 3, accumulator_dtype=jnp.bfloat16, compensated=True),
    )
    update = jax.jit(tx.update)
    grads = [{"w": params["w"] * (i + 1) * 16.0} for i in range(5)]

    def run(state, gs):
        for g in gs:
            _, state = update(g, state, params)
        return state

    mid = run(tx.init(params), grads[:2])
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", mid)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "state", target=mid)
    straight, resumed = run(mid, grads[2:]), run(restored, grads[2:])
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


# --- accumulator dtypes ------------------------------------------------------------------


def bf16_valued_gradients(k, n=4096, seed=0):
    """k micro-gradients: a shared signal plus larger noise, on log-normal scales."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(-6.0, 1.5, size=n))
    signal = rng.normal(size=n) * scale
    grads = [signal + 3.0 * rng.normal(size=n) * scale for _ in range(k)]
    return [jnp.asarray(g, jnp.bfloat16) for g in grads]


def window_mean(grads, **accumulator):
    tx = ga.accumulate(optax.identity(), len(grads), **accumulator)

    @jax.jit
    def run(stacked):
        def body(state, g):
            update, state = tx.update(g, state)
            return state, update

        _, updates = jax.lax.scan(body, tx.init(stacked[0]), stacked)
        return updates[-1]

    return run(jnp.stack(grads))


def rel_error(got, grads):
    ref = np.mean(np.stack([np.asarray(g, np.float64) for g in grads]), axis=0)
    return np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref)


def test_bfloat16_gradients_with_float32_accumulator_match_float32_reference():
    grads = bf16_valued_gradients(16)
    ref = np.mean(np.stack([np.asarray(g, np.float32) for g in grads]), axis=0)
    # bfloat16 gradients: the float32 mean, rounded once to bfloat16 on the way out.
    got = window_mean(grads)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=2.0**-8, atol=0)
    # float32 gradients holding bfloat16 values (param_dtype=float32, dtype=bfloat16).
    got32 = window_mean([g.astype(jnp.float32) for g in grads])
    assert got32.dtype == jnp.float32
    np.testing.assert_allclose(got32, ref, rtol=1e-6, atol=0)


def test_kahan_accumulator_is_much_closer_than_plain_bfloat16():
    grads = [g.astype(jnp.float32) for g in bf16_valued_gradients(16, seed=1)]
    plain = rel_error(window_mean(grads, accumulator_dtype=jnp.bfloat16), grads)
    kahan = rel_error(window_mean(grads, accumulator_dtype=jnp.bfloat16, compensated=True), grads)
    # Measured: plain ~1e-3, compensated ~1e-6 (16 mantissa bits in the pair).
    assert plain > 1e-4
    assert kahan * 100 < plain
    assert kahan < 2.0**-14


def test_kahan_accumulator_drops_non_finite_and_resets():
    tx = ga.accumulate(optax.identity(), 3, accumulator_dtype=jnp.bfloat16, compensated=True)
    update = jax.jit(tx.update)
    state = tx.init({"w": jnp.zeros(2)})
    _, state = update({"w": jnp.array([1.0, 1.0 + 2.0**-12])}, state)
    before = (state.acc_grads, state.acc_compensation)
    _, state = update({"w": jnp.array([jnp.nan, 1.0])}, state)
    for a, b in zip(
        jax.tree.leaves((state.acc_grads, state.acc_compensation)),
        jax.tree.leaves(before),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    u, state = update({"w": jnp.array([2.0**-10, 2.0**-10])}, state)
    np.testing.assert_array_equal(u["w"], [(1.0 + 2.0**-10) / 2, (1.0 + 2.0**-12 + 2.0**-10) / 2])
    assert not np.any(state.acc_grads["w"]) and not np.any(state.acc_compensation["w"])
    assert state.acc_grads["w"].dtype == state.acc_compensation["w"].dtype == jnp.bfloat16


@pytest.mark.hlo
@pytest.mark.parametrize("accumulator_dtype", [None, jnp.bfloat16])
def test_accumulator_is_updated_in_place(accumulator_dtype):
    # The compensated option changed accumulate's update; the plain paths must
    # still write the accumulator in place: no parameter-sized temporary.
    n = 1 << 16
    params = {"w": jnp.zeros(n, jnp.float32)}
    tx = ga.accumulate(optax.adam(1e-3), 4, accumulator_dtype=accumulator_dtype)

    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return s, u

    state = tx.init(params)
    compiled = jax.jit(step, donate_argnums=1).lower(params, state, params).compile()
    assert harness.compiled_memory(compiled).temp_bytes < n


# --- the documented Flax pattern ----------------------------------------------------------


class BF16MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x))
        return nn.Dense(4, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x).astype(jnp.float32)


@pytest.mark.slow
def test_flax_bfloat16_compute_with_float32_params_matches_large_batch():
    model = BF16MLP()
    rng = np.random.default_rng(0)
    # numpy data: slicing it costs no dispatch.
    x = rng.normal(size=(3, K * 8, 16)).astype(np.float32)
    y = rng.integers(0, 4, size=(3, K * 8)).astype(np.int32)
    params = jax.jit(model.init)(jax.random.key(0), x[0, :1])["params"]

    def loss_fn(p, xb, yb):
        logits = model.apply({"params": p}, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    def make_step(tx):
        @jax.jit
        def step(p, s, xb, yb):
            grads = jax.grad(loss_fn)(p, xb, yb)
            u, s = tx.update(grads, s, p)
            return optax.apply_updates(p, u), s

        return step

    inner = optax.chain(ga.adaptive_grad_clip(0.05), optax.adam(1e-2))
    acc_tx = ga.accumulate(inner, K)
    acc_step, big_step = make_step(acc_tx), make_step(inner)
    p_acc, s_acc, p_big, s_big = params, acc_tx.init(params), params, inner.init(params)
    for t in range(3):
        for i in range(K):
            p_acc, s_acc = acc_step(p_acc, s_acc, x[t, i::K], y[t, i::K])
        p_big, s_big = big_step(p_big, s_big, x[t], y[t])
    assert int(ga.optimizer_step(s_acc)) == 3
    p_acc, p_big, p_0 = (jax.tree.leaves(jax.device_get(p)) for p in (p_acc, p_big, params))
    assert all(a.dtype == np.float32 for a in p_acc)
    # bfloat16 compute rounds micro-batch and full-batch gradients differently
    # (about 2^-8 relative); Adam's normalised steps of 1e-2 bound the drift.
    for a, b in zip(p_acc, p_big, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=0)
    assert max(np.max(np.abs(a - b)) for a, b in zip(p_acc, p_0, strict=True)) > 1e-2


@pytest.mark.slow
def test_docs_flax_pattern_with_agc_and_accum_batchnorm_runs_in_bfloat16():
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "mixed_precision.md"
    section = page.read_text().split("## Flax: bfloat16 compute")[1].split("\n## ")[0]
    block, _ = re.findall(r"```python\n(.*?)```", section, re.S)
    ns: dict = {}
    exec(compile(block, "mixed_precision.md[flax]", "exec"), ns)
    k = ns["K"]
    assert int(ga.optimizer_step(ns["opt_state"])) == 2
    leaves = jax.tree.leaves((ns["params"], ns["batch_stats"], ns["opt_state"]))
    assert all(x.dtype in (jnp.float32, jnp.int32, jnp.bool_) for x in leaves)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(ns["params"]))
    stats = ns["batch_stats"]["BatchNorm_0"]
    assert float(jnp.max(stats["window_count"])) == 0.0  # committed at the window's end
    assert float(jnp.max(jnp.abs(stats["mean"]))) > 0.0  # and the running mean moved
    # One more micro-step opens a new window without touching the running mean.
    before = stats["mean"]
    _, new_stats, _, _ = ns["micro_step"](
        ns["params"], ns["batch_stats"], ns["opt_state"], ns["x"][0], ns["y"][0]
    )
    np.testing.assert_array_equal(new_stats["BatchNorm_0"]["mean"], before)
    assert float(jnp.max(new_stats["BatchNorm_0"]["window_count"])) == 16.0
    assert k == 4


@pytest.mark.slow
def test_docs_float16_flax_pattern_with_loss_scale_runs():
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "mixed_precision.md"
    section = page.read_text().split("## Flax: bfloat16 compute")[1].split("\n## ")[0]
    _, block = re.findall(r"```python\n(.*?)```", section, re.S)
    ns: dict = {}
    exec(compile(block, "mixed_precision.md[float16]", "exec"), ns)
    params, stats, opt_state = ns["params16"], ns["stats16"], ns["opt16"]
    assert int(ga.optimizer_step(opt_state)) == 2  # no micro-batch overflowed
    assert float(ga.current_loss_scale(opt_state)) == 2.0**15
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
    leaves = jax.tree.leaves((params, opt_state))
    assert all(x.dtype in (jnp.float32, jnp.int32, jnp.bool_) for x in leaves)
    layer = stats["BatchNorm_0"]
    assert float(jnp.max(layer["window_count"])) == 0.0
    assert float(jnp.max(jnp.abs(layer["mean"]))) > 0.0


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_non_positive_or_non_finite_scales_raise(value):
    with pytest.raises(ValueError, match="initial_scale"):
        ga.dynamic_loss_scale(value)
    with pytest.raises(ValueError, match="loss_scale"):
        ga.static_loss_scale(value)
    with pytest.raises(ValueError, match="loss_scale"):
        ga.scale_loss(lambda w: w, value)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"growth_interval": 0}, ValueError, "growth_interval"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 2.0}, ValueError, "backoff_factor"),
        ({"min_scale": 2.0**16}, ValueError, "min_scale"),
        ({"min_scale": "1"}, TypeError, "min_scale"),
    ],
)
def test_bad_dynamic_scale_arguments_raise(kwargs, error, name):
    with pytest.raises(error, match=name):
        ga.dynamic_loss_scale(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"accumulator_dtype": "kahan_bfloat16"}, TypeError, "compensated=True"),
        ({"accumulator_dtype": jnp.int32}, TypeError, "accumulator_dtype"),
        ({"compensated": True}, ValueError, "accumulator_dtype=None"),
        ({"accumulator_dtype": jnp.float32, "compensated": True}, ValueError, "16-bit"),
        ({"accumulator_dtype": jnp.bfloat16, "compensated": 1}, TypeError, "compensated"),
    ],
)
def test_unknown_accumulator_dtype_policy_raises(kwargs, error, match):
    with pytest.raises(error, match=match):
        ga.accumulate(optax.sgd(0.1), 4, **kwargs)


def test_other_bad_input_raises():
    with pytest.raises(ValueError, match="shape"):
        ga.scale_loss(lambda w: w, jnp.ones(2))
    with pytest.raises(TypeError, match="fun"):
        ga.scale_loss("loss", 1.0)
    with pytest.raises(TypeError, match=r"\(loss, aux\)"):
        jax.grad(ga.scale_loss(lambda w: w.sum(), 2.0, has_aux=True))(jnp.ones(2))
    with pytest.raises(ValueError, match="LossScaleState"):
        ga.current_loss_scale(ga.accumulate(optax.sgd(0.1), 2).init(jnp.zeros(2)))
    tx = ga.static_loss_scale(2.0)
    with pytest.raises(TypeError, match="floating-point"):
        tx.update({"w": jnp.ones(2, jnp.int32)}, tx.init(None))


# --- misuse: loss scale in the wrong place, loss not scaled, float32 range (issues 14, 18) ---


@pytest.mark.parametrize("scale", [ga.dynamic_loss_scale, lambda: ga.static_loss_scale(8.0)])
def test_loss_scale_inside_accumulate_is_refused_naming_the_order(scale):
    # Inside accumulate, overflowing micro-gradients are dropped before the scale
    # sees them: a dynamic scale never backs off and no update is ever applied.
    nested = ga.accumulate(optax.chain(scale(), optax.sgd(0.1)), 4)
    right_order = re.escape("optax.chain(ga.dynamic_loss_scale(), ga.accumulate(")
    with pytest.raises(ValueError, match=right_order):
        nested.init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=right_order):
        jax.eval_shape(nested.init, {"w": jnp.zeros(2)})
    # A state built by hand around the check is refused where the scale is read.
    inner = optax.chain(scale(), optax.sgd(0.1))
    state = ga.accumulate(optax.sgd(0.1), 4).init({"w": jnp.zeros(2)})
    state = state._replace(inner_state=inner.init({"w": jnp.zeros(2)}))
    with pytest.raises(ValueError, match=right_order):
        ga.current_loss_scale(state)


@pytest.mark.slow
def test_scaled_value_and_grad_reads_the_scale_so_updates_equal_unscaled_sgd():
    params, xs, ys = batches()
    tx = optax.chain(
        ga.dynamic_loss_scale(INITIAL_SCALE, growth_interval=2),
        ga.accumulate(optax.sgd(0.5), every_k_schedule=K),
    )
    grad_fn = ga.scaled_value_and_grad(f16_loss)

    @jax.jit
    def micro_step(params, opt_state, x, y):
        loss, grads = grad_fn(opt_state, params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)
    got = params
    for x, y in zip(xs, ys, strict=True):
        got, opt_state, loss = micro_step(got, opt_state, x, y)
        np.testing.assert_allclose(loss, f16_loss(params, x, y), rtol=1e-6)  # unscaled value
    assert float(ga.current_loss_scale(opt_state)) == 4 * INITIAL_SCALE  # grew twice
    # Reference: plain SGD on the mean of the unscaled gradients.
    grads = jax.vmap(jax.grad(f16_loss), (None, 0, 0))(params, xs, ys)
    want = jax.tree.map(lambda p, g: p - 0.5 * g.mean(0), params, grads)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        # float16 gradients of unscaled and scaled losses round differently.
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-4)
    # The step moved the parameters by a gradient step, not by one divided by the scale.
    assert float(jnp.max(jnp.abs(got["w"] - params["w"]))) > 1e-3

    # has_aux and argnums are jax.value_and_grad's.
    aux_fn = ga.scaled_value_and_grad(
        lambda p, x, y: (f16_loss(p, x, y), {"n": x.shape[0]}), argnums=(0,), has_aux=True
    )
    (value, aux), (g,) = aux_fn(tx.init(params), params, xs[0], ys[0])
    assert aux == {"n": 16}
    np.testing.assert_allclose(value, f16_loss(params, xs[0], ys[0]), rtol=1e-6)
    expected = jax.grad(ga.scale_loss(f16_loss, INITIAL_SCALE))(params, xs[0], ys[0])
    jax.tree.map(np.testing.assert_array_equal, g, expected)
    with pytest.raises(ValueError, match="LossScaleState"):
        grad_fn(ga.accumulate(optax.sgd(0.1), 2).init(params), params, xs[0], ys[0])
    with pytest.raises(TypeError, match="fun"):
        ga.scaled_value_and_grad("loss")


@pytest.mark.parametrize("value", [1e39, 1e-50, 1e-40])
def test_scales_outside_the_normal_float32_range_raise(value):
    # 1e39 is inf in float32 (every gradient / inf = 0, and accumulate would apply
    # the zeros); 1e-50 is 0 (every gradient inf, all dropped); 1e-40 is subnormal
    # and flushed to 0 by XLA:CPU.
    match = rf"(?s)(?=.*float32).*={re.escape(repr(value))}"
    with pytest.raises(ValueError, match=match):
        ga.static_loss_scale(value)
    with pytest.raises(ValueError, match=match):
        ga.dynamic_loss_scale(value, min_scale=min(value, 1.0))
    with pytest.raises(ValueError, match=match):
        ga.scale_loss(lambda w: w, value)
    if value < 1:
        with pytest.raises(ValueError, match=rf"min_scale={re.escape(repr(value))}.*float32"):
            ga.dynamic_loss_scale(min_scale=value)
        with pytest.raises(ValueError, match=rf"backoff_factor={re.escape(repr(value))}.*float32"):
            ga.dynamic_loss_scale(backoff_factor=value)
    else:
        with pytest.raises(ValueError, match=rf"growth_factor={re.escape(repr(value))}.*float32"):
            ga.dynamic_loss_scale(growth_factor=value)


def test_smallest_allowed_min_scale_never_reaches_zero():
    tiny = float(np.finfo(np.float32).tiny)
    tx = ga.dynamic_loss_scale(1.0, min_scale=tiny, backoff_factor=0.5)
    state = tx.init(None)
    step = jax.jit(tx.update)
    for _ in range(5):  # every micro-step overflows
        _, state = step({"w": jnp.array([jnp.inf])}, state)
    state = state._replace(loss_scale=jnp.asarray(tiny, jnp.float32))
    _, state = step({"w": jnp.array([jnp.inf])}, state)
    assert float(state.loss_scale) == tiny
    grads, _ = step({"w": jnp.array([1e-30])}, state)
    assert bool(jnp.all(jnp.isfinite(grads["w"]))) and float(grads["w"][0]) > 0
