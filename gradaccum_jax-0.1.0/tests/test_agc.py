"""Tests for gradaccum_jax.adaptive_grad_clip."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import gradaccum_jax as ga
from gradaccum_jax._clipping import agc as _agc

RTOL = 1e-6


def _random_tree(key, shapes, scale=1.0):
    keys = jax.random.split(key, len(shapes))
    return {
        name: scale * jax.random.normal(k, shape)
        for k, (name, shape) in zip(keys, shapes.items(), strict=True)
    }


def _apply(tx, grads, params):
    return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)


def _hand_agc(g, w, axes, clipping, eps):
    """Reference AGC in float64 numpy for one leaf."""
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    g_norm = np.sqrt(np.sum(g * g, axis=axes, keepdims=True))
    w_norm = np.sqrt(np.sum(w * w, axis=axes, keepdims=True))
    bound = clipping * np.maximum(w_norm, eps)
    return np.where(g_norm > bound, g * bound / np.where(g_norm > 0, g_norm, 1), g)


def _unit_norms(x, axes):
    return np.sqrt(np.sum(np.square(np.asarray(x, np.float64)), axis=axes, keepdims=True))


# Layouts on which the Flax rule and optax's rank rule agree.
AGREE = {
    "dense": (3, 4),  # (in, out)
    "conv2d": (3, 3, 2, 4),  # (H, W, in, out)
    "conv3d": (2, 2, 2, 2, 3),  # (D, H, W, in, out)
    "bias": (4,),
    "scale": (),
}


@pytest.mark.requires("optax.adaptive_grad_clip takes rank-5 kernels from 0.2.7", optax="0.2.7")
@pytest.mark.slow
def test_matches_optax_where_layouts_agree():
    params = _random_tree(jax.random.key(0), AGREE)
    grads = _random_tree(jax.random.key(1), AGREE, scale=0.02)
    # Mix of clipped and unclipped units (checked below), so both branches count.
    ours = _apply(ga.adaptive_grad_clip(0.02, 1e-3), grads, params)
    ref = _apply(optax.adaptive_grad_clip(0.02, 1e-3), grads, params)
    for name in AGREE:
        np.testing.assert_allclose(ours[name], ref[name], rtol=RTOL, err_msg=name)
    changed = np.concatenate([np.ravel(ours[n] != grads[n]) for n in AGREE])
    assert 0.2 < changed.mean() < 0.8


@pytest.mark.requires("optax.adaptive_grad_clip takes rank-5 kernels from 0.2.7", optax="0.2.7")
@pytest.mark.slow
def test_optax_mode_reproduces_optax_on_every_rank():
    shapes = dict(AGREE, conv1d=(3, 2, 4), row=(1, 5), mha=(2, 3, 4))
    params = _random_tree(jax.random.key(2), shapes)
    grads = _random_tree(jax.random.key(3), shapes, scale=0.05)
    ours = _apply(ga.adaptive_grad_clip(0.02, unit_axes="optax"), grads, params)
    ref = _apply(optax.adaptive_grad_clip(0.02), grads, params)
    for name in shapes:
        np.testing.assert_allclose(ours[name], ref[name], rtol=RTOL, err_msg=name)


@pytest.mark.slow
def test_conv1d_and_attention_output_against_hand_computation():
    params = {
        "Conv_0": {"kernel": jnp.ones((3, 2, 4)) * jnp.arange(1.0, 5.0)},  # (W, I, O)
        "attention": {
            "out": {"kernel": jnp.ones((2, 3, 4)) * jnp.arange(1.0, 5.0)},  # (heads, dim, out)
            "query": {"kernel": jnp.ones((5, 2, 3))},  # (in, heads, dim)
            "query_bias": {"bias": jnp.ones((2, 3))},
        },
    }
    grads = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size) * 0.7).reshape(p.shape), params)
    clipping, eps = 0.1, 1e-3
    out = _apply(ga.adaptive_grad_clip(clipping, eps), grads, params)
    expected_axes = {
        ("Conv_0", "kernel"): (0, 1),  # one unit per output channel, over W and I
        ("attention", "out", "kernel"): (0, 1),  # one unit per output feature
        ("attention", "query", "kernel"): (0,),  # one unit per (head, dim)
        ("attention", "query_bias", "bias"): (0, 1),  # whole leaf
    }
    for path, axes in expected_axes.items():
        g, w, o = grads, params, out
        for key in path:
            g, w, o = g[key], w[key], o[key]
        np.testing.assert_allclose(o, _hand_agc(g, w, axes, clipping, eps), rtol=RTOL)
        # Every unit ends within its bound.
        bound = clipping * np.maximum(_unit_norms(w, axes), eps)
        assert np.all(_unit_norms(o, axes) <= bound * (1 + 1e-6))
    # optax reduces the rank-3 kernels over axis 0 only, which differs.
    wrong = _apply(optax.adaptive_grad_clip(clipping, eps), grads, params)
    assert not np.allclose(wrong["Conv_0"]["kernel"], out["Conv_0"]["kernel"])
    assert not np.allclose(wrong["attention"]["out"]["kernel"], out["attention"]["out"]["kernel"])


def _axes_by_path(params, unit_axes=None):
    with_path = jax.tree_util.tree_leaves_with_path(params)
    axes = _agc._leaf_axes(unit_axes, params)
    return {
        "/".join(_agc._path_names(path)): a for (path, _), a in zip(with_path, axes, strict=True)
    }


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):  # x: (batch, length, features)
        x = nn.Conv(4, (3,))(x)
        x = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=6)(x)
        x = nn.LayerNorm()(x)
        x = nn.Conv(3, (2, 2))(x[..., None])
        return nn.Dense(5)(x)


def test_default_units_for_real_flax_models():
    # Shapes are all the rule needs, so nothing is computed.
    variables = jax.eval_shape(_LinenNet().init, jax.random.key(0), jnp.ones((1, 7, 2)))
    axes = _axes_by_path(variables)
    mha = "params/MultiHeadDotProductAttention_0"
    assert axes["params/Conv_0/kernel"] == (0, 1)  # Conv1D (W, I, O)
    assert axes["params/Conv_0/bias"] == (0,)
    for proj in ("query", "key", "value"):
        assert axes[f"{mha}/{proj}/kernel"] == (0,)  # (in, heads, head_dim)
        assert axes[f"{mha}/{proj}/bias"] == (0, 1)  # (heads, head_dim): whole
    assert axes[f"{mha}/out/kernel"] == (0, 1)  # (heads, head_dim, out)
    assert axes["params/LayerNorm_0/scale"] == (0,)
    assert axes["params/Conv_1/kernel"] == (0, 1, 2)  # Conv2D (H, W, I, O)
    assert axes["params/Dense_0/kernel"] == (0,)

    # nnx wraps each array in a Variable whose path ends in `.value`.
    model = nnx.eval_shape(
        lambda: nnx.MultiHeadAttention(
            num_heads=2, in_features=6, qkv_features=4, decode=False, rngs=nnx.Rngs(0)
        )
    )
    axes = _axes_by_path(nnx.state(model, nnx.Param))
    assert axes["query/kernel"] == (0,)
    assert axes["value/kernel"] == (0,)
    assert axes["out/kernel"] == (0, 1)
    assert axes["key/bias"] == (0, 1)


@pytest.mark.slow
def test_unit_axes_tree_prefix_and_callable():
    params = {"a": jnp.arange(1.0, 13.0).reshape(3, 4), "b": {"c": jnp.ones((2, 3, 4))}}
    grads = jax.tree.map(lambda p: jnp.sin(p * 3.0) * 10, params)
    clipping = 0.05

    def check(out, axes_a, axes_c):
        np.testing.assert_allclose(
            out["a"], _hand_agc(grads["a"], params["a"], axes_a, clipping, 1e-3), rtol=RTOL
        )
        np.testing.assert_allclose(
            out["b"]["c"],
            _hand_agc(grads["b"]["c"], params["b"]["c"], axes_c, clipping, 1e-3),
            rtol=RTOL,
        )

    # A prefix: `None` (whole leaf) for "a", one spec for the whole subtree "b".
    tree_spec = {"a": None, "b": (0, -1)}
    check(_apply(ga.adaptive_grad_clip(clipping, unit_axes=tree_spec), grads, params), None, (0, 2))
    # A bare int is a prefix of every tree: one spec for all leaves.
    check(_apply(ga.adaptive_grad_clip(clipping, unit_axes=1), grads, params), (1,), (1,))
    # Elementwise units, and a rule name per leaf.
    check(
        _apply(ga.adaptive_grad_clip(clipping, unit_axes={"a": (), "b": "optax"}), grads, params),
        (),
        (0,),
    )
    seen = []

    def by_path(path, leaf):
        seen.append((jax.tree_util.keystr(path), leaf.shape))
        return (1,) if leaf.ndim == 2 else "flax"

    check(_apply(ga.adaptive_grad_clip(clipping, unit_axes=by_path), grads, params), (1,), (0, 1))
    assert ("['a']", (3, 4)) in seen and ("['b']['c']", (2, 3, 4)) in seen


@pytest.mark.slow
def test_zero_gradients_zero_params_and_dtypes():
    params = {"kernel": jnp.zeros((3, 2)), "bias": jnp.zeros(2)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    tx = ga.adaptive_grad_clip(0.1, eps=1e-2)
    out = _apply(tx, zeros, params)
    assert all(np.all(o == 0) for o in jax.tree.leaves(out))
    # Zero weights: the bound is clipping * eps per unit.
    grads = {"kernel": jnp.full((3, 2), 4.0), "bias": jnp.array([3.0, 4.0])}
    out = _apply(tx, grads, params)
    np.testing.assert_allclose(_unit_norms(out["kernel"], (0,)), 1e-3, rtol=RTOL)
    np.testing.assert_allclose(out["bias"], [6e-4, 8e-4], rtol=RTOL)
    # bfloat16 gradients keep their dtype, with float32 params.
    out = _apply(tx, jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads), params)
    assert all(o.dtype == jnp.bfloat16 for o in jax.tree.leaves(out))
    np.testing.assert_allclose(out["bias"].astype(np.float32), [6e-4, 8e-4], rtol=1e-2)
    # No NaN in the derivative either, at zero gradients.
    grad_of = jax.grad(lambda g: jnp.sum(tx.update(g, tx.init(params), params)[0]["bias"]))
    assert np.all(np.isfinite(grad_of(zeros)["bias"]))


def test_errors():
    with pytest.raises(ValueError, match=r"clipping must be finite and > 0; got clipping=0.0"):
        ga.adaptive_grad_clip(0.0)
    with pytest.raises(ValueError, match=r"clipping.*-0.5"):
        ga.adaptive_grad_clip(-0.5)
    with pytest.raises(ValueError, match=r"eps must be finite and >= 0; got eps=-1"):
        ga.adaptive_grad_clip(0.1, -1.0)
    with pytest.raises(TypeError, match="clipping must be a real number"):
        ga.adaptive_grad_clip("0.1")
    with pytest.raises(ValueError, match="unknown rule 'torch'"):
        ga.adaptive_grad_clip(unit_axes="torch")
    with pytest.raises(ValueError, match="unknown rule 'pytorch'"):
        ga.adaptive_grad_clip(unit_axes={"a": "pytorch"})
    with pytest.raises(TypeError, match=r"got 1.5 of type float"):
        ga.adaptive_grad_clip(unit_axes={"a": 1.5})
    params = {"a": jnp.ones((2, 3))}
    tx = ga.adaptive_grad_clip()
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(params, tx.init(params))
    with pytest.raises(ValueError, match=r"\['a'\].*holds axis 2, out of range"):
        _apply(ga.adaptive_grad_clip(unit_axes={"a": 2}), params, params)
    with pytest.raises(ValueError, match="repeats an axis"):
        _apply(ga.adaptive_grad_clip(unit_axes={"a": (0, -2)}), params, params)
    with pytest.raises(ValueError, match="structure of the params"):
        _apply(ga.adaptive_grad_clip(unit_axes={"b": 0}), params, params)
    with pytest.raises(ValueError, match="ranks 0 to 5"):
        p6 = {"a": jnp.ones((2,) * 6)}
        _apply(ga.adaptive_grad_clip(unit_axes="optax"), p6, p6)
    with pytest.raises(ValueError, match="does not have the structure"):
        tx.update({"b": params["a"]}, tx.init(params), params)


K = 4
SHAPES = {"kernel": (3, 2), "bias": (2,)}


def _micro_grads(key):
    """K micro-gradients: a shared direction with noise, some units far over the bound."""
    base = _random_tree(key, SHAPES, scale=1.0)
    noise = [_random_tree(k, SHAPES, scale=0.3) for k in jax.random.split(key, K)]
    return [jax.tree.map(lambda b, n: b + n, base, nz) for nz in noise]


def _run_window(tx, params, micro_grads):
    def body(state, g):
        u, state = tx.update(g, state, params)
        return state, u

    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *micro_grads)
    _, updates = jax.jit(lambda s, gs: jax.lax.scan(body, s, gs))(tx.init(params), stacked)
    return jax.tree.map(lambda u: u[-1], updates)  # the window's update


@pytest.mark.slow
def test_agc_inside_accumulate_bounds_the_accumulated_gradient():
    """AGC on the accumulated gradient honours its bound; per-micro-batch AGC does not.

    The seed package clips each micro-gradient scaled by 1/K and sums the
    clipped terms: each term may reach the bound B, so their sum may reach K·B
    when the micro-gradients agree. Clipping inside ``accumulate`` sees the
    window's mean gradient, exactly as a large batch would.
    """
    params = {"kernel": jnp.full((3, 2), 0.5), "bias": jnp.full((2,), 0.5)}
    micro = _micro_grads(jax.random.key(7))
    clipping = 0.1
    bound = jax.tree.map(lambda p: clipping * np.asarray(_unit_norms(p, (0,))), params)
    bound["bias"] = clipping * _unit_norms(params["bias"], None)

    inside = ga.accumulate(optax.chain(ga.adaptive_grad_clip(clipping), optax.identity()), K)
    seed_style = optax.chain(
        optax.scale(1.0 / K),
        ga.adaptive_grad_clip(clipping),
        ga.accumulate(optax.identity(), K, use_grad_mean=False),
    )
    per_micro_mean = optax.chain(
        ga.adaptive_grad_clip(clipping), ga.accumulate(optax.identity(), K)
    )
    g_inside = _run_window(inside, params, micro)
    g_seed = _run_window(seed_style, params, micro)
    g_micro = _run_window(per_micro_mean, params, micro)
    mean = jax.tree.map(lambda *xs: sum(xs) / K, *micro)
    ratios = {}
    for name, axes in (("kernel", (0,)), ("bias", None)):
        n_inside = _unit_norms(g_inside[name], axes)
        n_seed = _unit_norms(g_seed[name], axes)
        assert np.all(n_inside <= bound[name] * (1 + 1e-6))
        ratios[name] = n_seed / bound[name]
        # The mean of clipped micro-gradients stays within the bound (triangle
        # inequality) but is not the large-batch AGC: it clipped the noise.
        assert np.all(_unit_norms(g_micro[name], axes) <= bound[name] * (1 + 1e-6))
        assert not np.allclose(g_micro[name], g_inside[name], rtol=1e-3)
        # Inside accumulate it is exactly the large-batch AGC of the mean.
        np.testing.assert_allclose(
            g_inside[name],
            _hand_agc(mean[name], params[name], axes, clipping, 1e-3),
            rtol=1e-5,
        )
    worst = max(float(r.max()) for r in ratios.values())
    assert 1.5 < worst <= K * (1 + 1e-6)
    # With identical micro-gradients the seed's sum reaches exactly K·B.
    same = [micro[0]] * K
    g_same = _run_window(seed_style, params, same)
    np.testing.assert_allclose(_unit_norms(g_same["bias"], None), K * bound["bias"], rtol=1e-5)


@pytest.mark.slow
def test_agc_in_accumulate_equals_large_batch_training():
    key = jax.random.key(3)
    x = jax.random.normal(key, (K * 8, 3))
    y = jax.random.normal(jax.random.key(4), (K * 8, 2))
    params = {"kernel": jnp.full((3, 2), 0.1), "bias": jnp.zeros(2)}

    def loss(p, xb, yb):
        return jnp.mean((xb @ p["kernel"] + p["bias"] - yb) ** 2)

    inner = optax.chain(ga.adaptive_grad_clip(0.05), optax.adam(0.05))
    big_tx, acc_tx = inner, ga.accumulate(inner, K)

    @jax.jit
    def big_step(p, s):
        u, s = big_tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    @jax.jit
    def micro_step(p, s, xb, yb):
        u, s = acc_tx.update(jax.grad(loss)(p, xb, yb), s, p)
        return optax.apply_updates(p, u), s

    p_big, s_big = params, big_tx.init(params)
    p_acc, s_acc = params, acc_tx.init(params)
    for _ in range(3):
        p_big, s_big = big_step(p_big, s_big)
        for i in range(K):
            sl = slice(i * 8, (i + 1) * 8)
            p_acc, s_acc = micro_step(p_acc, s_acc, x[sl], y[sl])
    for name in params:
        np.testing.assert_allclose(p_acc[name], p_big[name], rtol=1e-5, atol=1e-6)
    assert not np.allclose(p_big["kernel"], params["kernel"])


_prop_jit = jax.jit(lambda g, p, c: ga.adaptive_grad_clip(c).update(g, optax.EmptyState(), p)[0])


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(), (5,), (4, 3), (2, 3, 4), (2, 2, 3, 3)]),
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-3, 3),
    clipping=st.sampled_from([0.01, 0.1, 1.0]),
)
def test_property_units_within_bound(shape, seed, log_scale, clipping):
    kg, kp = jax.random.split(jax.random.key(seed))
    g = {"kernel": jax.random.normal(kg, shape) * 10.0**log_scale}
    p = {"kernel": jax.random.normal(kp, shape)}
    out = _prop_jit(g, p, jnp.float32(clipping))["kernel"]
    axes = _agc._flax_axes((jax.tree_util.DictKey("kernel"),), shape)
    bound = clipping * np.maximum(_unit_norms(p["kernel"], axes), 1e-3)
    assert out.dtype == g["kernel"].dtype
    assert np.all(_unit_norms(out, axes) <= bound * (1 + 1e-5))
    # Units already within the bound are untouched.
    within = _unit_norms(g["kernel"], axes) <= bound
    np.testing.assert_array_equal(np.where(within, out, 0), np.where(within, g["kernel"], 0))


# --------------------------------------------------------------------------- #
# Regressions (issues 14 and 18)                                               #
# --------------------------------------------------------------------------- #


def test_huge_gradients_are_clipped_not_zeroed():
    params = {"w": jnp.array([1.0, 1.0])}
    out = _apply(ga.adaptive_grad_clip(0.01), {"w": jnp.array([2e19, 2e19])}, params)
    # The bound is 0.01 * sqrt(2): each element 0.01.
    np.testing.assert_allclose(out["w"], [0.01, 0.01], rtol=RTOL)
    out = _apply(ga.adaptive_grad_clip(0.01), {"w": jnp.array([3e-30, 4e-30])}, params)
    np.testing.assert_allclose(out["w"], [3e-30, 4e-30], rtol=RTOL)


def test_optax_axis_argument_has_optax_meaning():
    rng = np.random.default_rng(3)
    params = {"k": jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.float32)}
    grads = jax.tree.map(lambda p: 2.0 * p[::-1], params)
    for axis in (0, (0, 1), -1):
        ours = _apply(ga.adaptive_grad_clip(0.05, 1e-3, axis), grads, params)
        theirs = _apply(optax.adaptive_grad_clip(0.05, 1e-3, axis), grads, params)
        np.testing.assert_allclose(ours["k"], theirs["k"], rtol=RTOL, atol=1e-7)
    with pytest.raises(ValueError, match=r"either axis .* or unit_axes"):
        ga.adaptive_grad_clip(0.01, axis=0, unit_axes="flax")
    with pytest.raises(TypeError, match=r"axis must be an int, a tuple of ints or None"):
        ga.adaptive_grad_clip(0.01, axis="0")


def test_tiny_gradient_over_its_bound_lands_on_it_where_optax_undershoots():
    # Zero weights: the bound is clipping * eps = 1e-8; the gradient norm is
    # 5e-7, below optax's floor of 1e-6 on the divisor.
    params = {"w": jnp.zeros(2)}
    grads = {"w": jnp.array([3e-7, 4e-7])}
    ours = _apply(ga.adaptive_grad_clip(1e-5, 1e-3, unit_axes="optax"), grads, params)
    theirs = _apply(optax.adaptive_grad_clip(1e-5, 1e-3), grads, params)
    np.testing.assert_allclose(np.linalg.norm(ours["w"]), 1e-8, rtol=RTOL)
    np.testing.assert_allclose(np.linalg.norm(theirs["w"]), 5e-9, rtol=RTOL)


def test_complex_gradients_keep_their_phase():
    params = {"w": jnp.array([1.0 + 0j, 0.0], jnp.complex64)}
    grads = {"w": jnp.array([3 + 4j, 0.0], jnp.complex64)}
    out = _apply(ga.adaptive_grad_clip(0.1), grads, params)
    np.testing.assert_allclose(out["w"], [0.06 + 0.08j, 0.0], rtol=RTOL)


# --- Issue 24: non-finite gradients and the units of size-1 input axes ---


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf], ids=["nan", "inf"])
def test_non_finite_gradient_unit_equals_optax(bad):
    params = {"w": jnp.ones((3, 2)) * 0.5, "b": jnp.ones(2)}
    grads = {"w": jnp.array([[bad, 5.0], [1.0, 5.0], [1.0, 5.0]]), "b": jnp.array([bad, 0.1])}
    expected, _ = optax.adaptive_grad_clip(0.1).update(grads, optax.EmptyState(), params)
    tx = ga.adaptive_grad_clip(0.1, unit_axes="optax")
    got, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    for key in grads:
        np.testing.assert_array_equal(got[key], expected[key])


@pytest.mark.parametrize(
    "shape", [(1, 4), (1, 1, 1, 4), (1, 1, 1, 1, 4)], ids=["dense", "conv2d", "conv3d"]
)
def test_kernels_with_size_1_input_axes_differ_from_optax_by_design(shape):
    # optax treats a kernel whose only axis longer than 1 is the output axis as one
    # vector (one unit); the default rule keeps one unit per output feature, as for
    # every other Dense/Conv kernel, so each feature's bound stays its own.
    params = {"kernel": jax.random.normal(jax.random.key(0), shape)}
    grads = {"kernel": 10.0 * jax.random.normal(jax.random.key(1), shape)}
    tx = ga.adaptive_grad_clip(0.05)
    got, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    axes = tuple(range(len(shape) - 1))
    p_norm = jnp.maximum(jnp.sqrt(jnp.sum(params["kernel"] ** 2, axes, keepdims=True)), 1e-3)
    g_norm = jnp.sqrt(jnp.sum(grads["kernel"] ** 2, axes, keepdims=True))
    want = grads["kernel"] * jnp.minimum(1.0, 0.05 * p_norm / g_norm)
    np.testing.assert_allclose(got["kernel"], want, rtol=1e-6)
    optax_out, _ = optax.adaptive_grad_clip(0.05).update(grads, optax.EmptyState(), params)
    assert float(jnp.max(jnp.abs(optax_out["kernel"] - got["kernel"]))) > 1e-3
    # unit_axes="optax" reproduces optax exactly.
    same = ga.adaptive_grad_clip(0.05, unit_axes="optax")
    np.testing.assert_allclose(
        jax.jit(same.update)(grads, same.init(params), params)[0]["kernel"],
        optax_out["kernel"],
        rtol=1e-6,
    )
