"""Tests for the clipping / normalisation family (gradaccum_jax._clipping)."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradaccum_jax as ga

RTOL = 1e-5

# Scalars, vectors and 2-D to 5-D leaves.
SHAPES = {
    "s": (),
    "v": (5,),
    "m": (3, 4),
    "t3": (2, 3, 4),
    "t4": (2, 2, 3, 2),
    "t5": (2, 1, 2, 2, 3),
}
NAMED = {"l0": 0, "l1": 1, "l2": 2, "l3": 3, "l4": 4, "linf": math.inf}
ORDS = [1, 2, math.inf, 0.5, 3, "mad", "std", "var", "sum", *NAMED]


def _tree(seed, scale=1.0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(scale * rng.normal(size=s), jnp.float32) for k, s in shapes.items()}


# --------------------------------------------------------------------------- #
# float64 numpy references of the documented maths                            #
# --------------------------------------------------------------------------- #


def ref_measure(x, axes, ord):
    """The measure of each unit (keepdims) in float64."""
    x = np.asarray(x, np.float64)
    ord = NAMED.get(ord, ord)
    n = int(np.prod([x.shape[a] for a in axes]))
    if ord == "mad":
        return np.mean(np.abs(x), axis=axes, keepdims=True)
    if ord == "sum":
        return np.abs(np.sum(x, axis=axes, keepdims=True))
    if ord in ("std", "var"):
        var = np.var(x, axis=axes, keepdims=True, ddof=1 if n > 1 else 0)
        return np.sqrt(var) if ord == "std" else var
    if ord == 0:
        return np.sum(x != 0, axis=axes, keepdims=True).astype(np.float64)
    if ord == math.inf:
        return np.max(np.abs(x), axis=axes, keepdims=True)
    return np.sum(np.abs(x) ** ord, axis=axes, keepdims=True) ** (1 / ord)


def ref_linear(value, ord):
    return np.sqrt(value) if ord == "var" else value


def ref_units(shape, dim, inverse_dims):
    """Axes per leaf as documented: None -> all; ints matched per leaf; 0-d as (1,)."""
    ndim = max(len(shape), 1)
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else dim
    present = {d % ndim for d in dims if -ndim <= d < ndim}
    if inverse_dims:
        present = set(range(ndim)) - present
    return tuple(sorted(present))


def ref_scale_units(tree, ord, dim, inverse_dims, min_size, factor):
    """Applies factor(linear_size) per unit, as the documentation describes."""
    leaves = {k: np.asarray(v, np.float64) for k, v in tree.items()}
    if dim == "global":
        flat = np.concatenate([v.ravel() for v in leaves.values()])
        f = factor(ref_linear(ref_measure(flat, (0,), ord), ord))
        return {k: v * f for k, v in leaves.items()}
    out = {}
    for k, v in leaves.items():
        x = v.reshape(v.shape or (1,))
        axes = ref_units(v.shape, dim, inverse_dims)
        size = int(np.prod([x.shape[a] for a in axes])) if axes else 0
        if not axes or size < min_size:
            out[k] = v
            continue
        out[k] = (x * factor(ref_linear(ref_measure(x, axes, ord), ord))).reshape(v.shape)
    return out


def ref_clip(tree, bound, ord=2, dim=None, inverse_dims=False, min_size=1):
    b = ref_linear(bound, ord)

    def factor(size):
        return np.where(size > b, b / np.where(size > 0, size, 1), 1.0)

    return ref_scale_units(tree, ord, dim, inverse_dims, min_size, factor)


def ref_normalize(tree, target, ord=2, dim=None, inverse_dims=False, min_size=1):
    t = ref_linear(target, ord)

    def factor(size):
        return np.where(size > 0, t / np.where(size > 0, size, 1), 1.0)

    return ref_scale_units(tree, ord, dim, inverse_dims, min_size, factor)


def _stateless_update(tx, grads):
    return jax.jit(lambda g: tx.update(g, tx.init(g))[0])(grads)


# --------------------------------------------------------------------------- #
# Stateless transforms and tree functions                                     #
# --------------------------------------------------------------------------- #


def test_clip_norm_hand_values_for_each_ord():
    v = jnp.array([3.0, -4.0])
    cases = [
        (2, 1.0, [0.6, -0.8]),
        (1, 1.0, [3 / 7, -4 / 7]),
        (math.inf, 2.0, [1.5, -2.0]),
        ("mad", 1.0, [3 / 3.5, -4 / 3.5]),
        ("sum", 0.5, [1.5, -2.0]),  # |sum| = 1; the direction is kept
        ("std", 1.0, [3 / 4.9497475, -4 / 4.9497475]),  # std (ddof 1) = 7/sqrt(2)
        ("var", 0.5, [3 / 7, -4 / 7]),  # var 24.5 -> 0.5: scaled by sqrt(0.5 / 24.5)
        ("l3", 1.0, [3 / 91 ** (1 / 3), -4 / 91 ** (1 / 3)]),
    ]
    for ord, bound, expected in cases:
        out = _stateless_update(ga.clip_norm(bound, ord), {"v": v})["v"]
        np.testing.assert_allclose(out, expected, rtol=RTOL, err_msg=str(ord))
    # l0 counts nonzeros: scaling cannot change the count, so (as in
    # torchzero) the unit is divided by count / bound.
    out = _stateless_update(ga.clip_norm(1.0, "l0"), {"v": jnp.array([3.0, 0.0, 4.0])})["v"]
    np.testing.assert_allclose(out, [1.5, 0.0, 2.0], rtol=RTOL)
    # A variance clipped to 0.5 is 0.5 afterwards.
    out = _stateless_update(ga.clip_norm(0.5, "var"), {"v": v})["v"]
    np.testing.assert_allclose(np.var(np.asarray(out, np.float64), ddof=1), 0.5, rtol=RTOL)


@pytest.mark.slow
def test_clip_norm_and_normalize_match_reference_for_all_ords():
    tree = _tree(0, scale=2.0)

    @jax.jit
    def every_ord(t):
        return [
            (
                ga.clip_grad_norm(t, 1.5, ord, dim=None)[0],
                ga.normalize_grads(t, 0.7, ord, dim=None),
            )
            for ord in ORDS
        ]

    for ord, (clipped, normalized) in zip(ORDS, every_ord(tree), strict=True):
        chex.assert_trees_all_close(clipped, ref_clip(tree, 1.5, ord), rtol=RTOL, atol=1e-7)
        if ord not in (0, "l0"):
            chex.assert_trees_all_close(
                normalized, ref_normalize(tree, 0.7, ord), rtol=1e-4, atol=1e-7
            )


@pytest.mark.parametrize(
    ("dim", "inverse_dims"),
    [(None, False), (0, False), (-1, True), ((0, 2), False), ((0, -1), True), ("global", False)],
)
@pytest.mark.slow
def test_units_follow_dim_and_inverse_dims(dim, inverse_dims):
    tree = _tree(1, scale=3.0)
    min_size = 1 if dim == "global" else 2
    clipped, norms = jax.jit(
        lambda t: ga.clip_grad_norm(
            t, 1.0, 2, dim=dim, inverse_dims=inverse_dims, min_size=min_size
        )
    )(tree)
    chex.assert_trees_all_close(
        clipped, ref_clip(tree, 1.0, 2, dim, inverse_dims, min_size=min_size), rtol=RTOL, atol=1e-7
    )
    normalized = jax.jit(
        lambda t: ga.normalize_grads(t, 2.0, "mad", dim=dim, inverse_dims=inverse_dims)
    )(tree)
    chex.assert_trees_all_close(
        normalized, ref_normalize(tree, 2.0, "mad", dim, inverse_dims), rtol=1e-4, atol=1e-7
    )
    if dim == "global":
        flat = np.concatenate([np.ravel(v) for v in tree.values()])
        np.testing.assert_allclose(norms, np.linalg.norm(flat), rtol=RTOL)
    else:
        for k, v in tree.items():
            x = np.asarray(v).reshape(v.shape or (1,))
            expected = ref_measure(x, ref_units(v.shape, dim, inverse_dims), 2)
            if dim is None or not v.shape:
                expected = expected.reshape(())
            assert norms[k].shape == expected.shape
            np.testing.assert_allclose(norms[k], expected, rtol=RTOL, err_msg=k)


def test_dim_none_uses_each_leafs_own_axes():
    # torchzero takes dim=None's axes from the first tensor; here a vector
    # first and a 3-D leaf second must both end at norm <= bound as wholes.
    tree = {"a": jnp.ones(4) * 3.0, "b": jnp.ones((2, 3, 4)) * 3.0}
    out = _stateless_update(ga.clip_norm(1.0, dim=None), tree)
    for leaf in out.values():
        np.testing.assert_allclose(np.linalg.norm(np.ravel(leaf)), 1.0, rtol=RTOL)


def test_min_size_and_missing_axes_leave_leaves_unchanged():
    tree = {"s": jnp.float32(5.0), "v": jnp.array([3.0, 4.0]), "m": jnp.ones((3, 4)) * 10.0}
    # min_size=2 (torchzero's clip_grad_norm_ default): the scalar is not clipped.
    out, _ = jax.jit(lambda t: ga.clip_grad_norm(t, 1.0, dim=None, min_size=2))(tree)
    assert float(out["s"]) == 5.0
    np.testing.assert_allclose(out["v"], [0.6, 0.8], rtol=RTOL)
    # min_size=1 (the default everywhere) clips the scalar to magnitude 1.
    assert float(_stateless_update(ga.clip_norm(1.0, dim=None), tree)["s"]) == 1.0
    # Units of 3 elements (dim=0 on the matrix) are skipped with min_size=4.
    out, _ = jax.jit(lambda t: ga.clip_grad_norm(t, 1.0, dim=0, min_size=4))(tree)
    np.testing.assert_array_equal(out["m"], tree["m"])
    # Axis 4 exists in no leaf: nothing changes.
    out = _stateless_update(ga.clip_norm(1.0, dim=4), tree)
    for k in tree:
        np.testing.assert_array_equal(out[k], tree[k])


def test_min_norm_scales_small_units_up():
    tree = {"a": jnp.array([0.3, 0.4]), "b": jnp.array([3.0, 4.0]), "z": jnp.zeros(2)}
    out, _ = jax.jit(lambda t: ga.clip_grad_norm(t, 2.0, dim=None, min_norm=1.0))(tree)
    np.testing.assert_allclose(out["a"], [0.6, 0.8], rtol=RTOL)
    np.testing.assert_allclose(out["b"], [1.2, 1.6], rtol=RTOL)
    np.testing.assert_array_equal(out["z"], [0.0, 0.0])


def test_clip_value_and_optax_equivalents():
    tree = _tree(2, scale=3.0)
    out = _stateless_update(ga.clip_value(1.0), tree)
    ref = _stateless_update(optax.clip(1.0), tree)
    chex.assert_trees_all_close(out, jax.tree.map(np.asarray, ref), rtol=0, atol=1e-7)
    out = _stateless_update(ga.clip_norm(1.0, dim="global"), tree)
    ref = _stateless_update(optax.clip_by_global_norm(1.0), tree)
    chex.assert_trees_all_close(out, jax.tree.map(np.asarray, ref), rtol=RTOL, atol=1e-7)


def test_centralize_flax_pytorch_and_global():
    k = jnp.arange(24.0).reshape(2, 3, 4) ** 2  # Conv1D-like (W, I, O)
    tree = {"kernel": k, "bias": jnp.array([1.0, 2.0, 6.0]), "s": jnp.float32(3.0)}
    kn = np.asarray(k, np.float64)
    flax_out = _stateless_update(ga.centralize(-1, inverse_dims=True), tree)
    np.testing.assert_allclose(
        flax_out["kernel"], kn - kn.mean(axis=(0, 1), keepdims=True), rtol=RTOL, atol=1e-4
    )
    np.testing.assert_array_equal(flax_out["bias"], tree["bias"])  # no axis but the last
    np.testing.assert_allclose(np.asarray(flax_out["kernel"]).mean(axis=(0, 1)), 0, atol=1e-4)
    torch_out = _stateless_update(ga.centralize(0, inverse_dims=True), tree)
    np.testing.assert_allclose(
        torch_out["kernel"], kn - kn.mean(axis=(1, 2), keepdims=True), rtol=RTOL, atol=1e-4
    )
    # dim=None: every leaf over its own axes; the scalar (no axis) is kept.
    whole = _stateless_update(ga.centralize(None, min_size=2), tree)
    np.testing.assert_allclose(whole["bias"], [-2.0, -1.0, 3.0], rtol=RTOL)
    np.testing.assert_allclose(whole["kernel"], kn - kn.mean(), rtol=RTOL, atol=1e-3)
    assert float(whole["s"]) == 3.0
    glob = _stateless_update(ga.centralize("global"), tree)
    mean = (kn.sum() + 9.0 + 3.0) / 28
    np.testing.assert_allclose(glob["s"], 3.0 - mean, rtol=RTOL)
    np.testing.assert_allclose(glob["bias"], np.array([1.0, 2.0, 6.0]) - mean, rtol=RTOL)


@pytest.mark.slow
def test_zero_updates_stay_zero_without_nan():
    zeros = jax.tree.map(jnp.zeros_like, _tree(3))
    txs = [
        ga.centralize(),
        ga.clip_norm(1.0),
        ga.clip_norm(1.0, "std", dim="global"),
        ga.clip_value(1.0),
        ga.normalize(),
        ga.normalize(2.0, "var", dim="global"),
        ga.normalize(2.0, 3, dim=-1, inverse_dims=True),
        ga.clip_norm_by_ema(),
        ga.normalize_by_ema(dim="global"),
        ga.clip_value_by_ema(),
        ga.clip_norm_growth(),
        ga.clip_norm_growth(min_value=None, dim="global"),
        ga.clip_value_growth(min_value=None),
    ]
    for outs, state in _run_many(txs, [zeros] * 3, zeros):
        for leaf in jax.tree.leaves(state):
            assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
        for leaf in jax.tree.leaves(outs):
            np.testing.assert_array_equal(leaf, 0)


# --------------------------------------------------------------------------- #
# Stateful transforms                                                          #
# --------------------------------------------------------------------------- #


def _run_many(txs, grads_list, params):
    """Runs every transform over the steps in one lax.scan (one compilation).

    Checks that each state keeps its structure and dtypes; returns a list of
    (per-step float64 updates, final state), one per transform.
    """
    states0 = tuple(tx.init(params) for tx in txs)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *grads_list)

    def body(states, g):
        pairs = [tx.update(g, s, params) for tx, s in zip(txs, states, strict=True)]
        return tuple(p[1] for p in pairs), tuple(p[0] for p in pairs)

    states, outs = jax.jit(lambda s, g: jax.lax.scan(body, s, g))(states0, stacked)
    assert jax.tree.structure(states) == jax.tree.structure(states0)
    for a, b in zip(jax.tree.leaves(states), jax.tree.leaves(states0), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
    results = []
    for out, state in zip(outs, states, strict=True):
        steps = [
            jax.tree.map(lambda u, i=i: np.asarray(u[i], np.float64), out)
            for i in range(len(grads_list))
        ]
        results.append((steps, state))
    return results


def _run_steps(tx, grads_list, params):
    return _run_many([tx], grads_list, params)[0]


def ref_by_ema(grads_list, beta, ord, eps, tensorwise, growth, init, normalize_):
    """float64 reference of clip_norm_by_ema / normalize_by_ema."""
    keys = list(grads_list[0])
    ema = {k: np.zeros(np.shape(grads_list[0][k])) for k in keys}
    prev = None
    outs = []

    def size(tree):
        if tensorwise:
            return {
                k: ref_linear(ref_measure(np.ravel(tree[k]), (0,), ord), ord).item() for k in keys
            }
        flat = np.concatenate([np.ravel(tree[k]) for k in keys])
        return ref_linear(ref_measure(flat, (0,), ord), ord).item()

    def per(s, k):
        return s[k] if tensorwise else s

    for step, g in enumerate(grads_list):
        g = {k: np.asarray(v, np.float64) for k, v in g.items()}
        if step == 0 and init == "update":
            ema = dict(g)
        ema = {k: beta * ema[k] + (1 - beta) * g[k] for k in keys}
        es = size(ema)
        if growth is not None:
            if prev is None:
                prev = es
            shrink = {k: max(per(es, k) / max(per(prev, k) * growth, eps), 1) for k in keys}
            ema = {k: ema[k] / shrink[k] for k in keys}
            es = {k: per(es, k) / shrink[k] for k in keys}
            es = es if tensorwise else es[keys[0]]
            prev = es
        gs = size(g)
        out = {}
        for k in keys:
            ratio = per(gs, k) / max(per(es, k), eps)
            out[k] = g[k] / max(ratio, eps if normalize_ else 1)
        outs.append(out)
    return outs


@pytest.mark.parametrize(
    ("normalize_", "ord", "tensorwise", "growth", "init"),
    [
        (False, 2, True, 1.5, "zeros"),
        (False, "mad", False, None, "update"),
        (False, "var", True, 1.2, "update"),
        (True, 2, True, 1.5, "zeros"),
        (True, math.inf, False, 1.5, "update"),
    ],
)
@pytest.mark.slow
def test_ema_norm_clippers_over_several_steps(normalize_, ord, tensorwise, growth, init):
    shapes = {"s": (), "v": (3,), "m": (2, 3), "t4": (2, 1, 2, 2)}
    scales = [1.0, 0.2, 5.0, 0.0, 3.0, 40.0]
    grads = [_tree(10 + i, scale=c, shapes=shapes) for i, c in enumerate(scales)]
    factory = ga.normalize_by_ema if normalize_ else ga.clip_norm_by_ema
    dim = None if tensorwise else "global"
    tx = factory(0.8, ord, 1e-6, dim=dim, max_ema_growth=growth, ema_init=init)
    outs, state = _run_steps(tx, grads, grads[0])
    expected = ref_by_ema(grads, 0.8, ord, 1e-6, tensorwise, growth, init, normalize_)
    for got, want in zip(outs, expected, strict=True):
        chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
    assert int(state.count) == len(scales)


def test_ema_growth_limit_and_first_step_hand_values():
    tx = ga.clip_norm_by_ema(beta=0.5, max_ema_growth=None)
    g = [{"w": jnp.array([3.0, 4.0])}, {"w": jnp.array([0.0, 1.0])}]
    outs, state = _run_steps(tx, g, g[0])
    # zeros init: the first EMA is (1.5, 2), norm 2.5.
    np.testing.assert_allclose(outs[0]["w"], [1.5, 2.0], rtol=RTOL)
    np.testing.assert_allclose(outs[1]["w"], [0.0, 1.0], rtol=RTOL)  # under 1.677
    np.testing.assert_allclose(state.ema["w"], [0.75, 1.5], rtol=RTOL)
    # With growth 1.5 per step the EMA norm cannot jump from 5 to 27.5.
    tx = ga.clip_norm_by_ema(beta=0.5, max_ema_growth=1.5, ema_init="update")
    g = [
        {"w": jnp.array([3.0, 4.0])},
        {"w": jnp.array([30.0, 40.0])},
        {"w": jnp.array([30.0, 40.0])},
    ]
    outs, state = _run_steps(tx, g, g[0])
    np.testing.assert_allclose([np.linalg.norm(o["w"]) for o in outs], [5.0, 7.5, 11.25], rtol=RTOL)
    np.testing.assert_allclose(state.prev_ema_norm["w"], 11.25, rtol=RTOL)


def test_clip_value_by_ema_over_several_steps():
    grads = [_tree(20 + i, scale=c) for i, c in enumerate([1.0, 4.0, 0.1, 2.0])]
    for init in ("zeros", "update"):
        outs, _ = _run_steps(ga.clip_value_by_ema(0.7, init), grads, grads[0])
        ema = {k: np.zeros(np.shape(v)) for k, v in grads[0].items()}
        for step, (g, out) in enumerate(zip(grads, outs, strict=True)):
            g = {k: np.asarray(v, np.float64) for k, v in g.items()}
            if step == 0 and init == "update":
                ema = {k: np.abs(v) for k, v in g.items()}
            ema = {k: 0.7 * ema[k] + 0.3 * np.abs(g[k]) for k in g}
            chex.assert_trees_all_close(
                out, {k: np.clip(g[k], -ema[k], ema[k]) for k in g}, rtol=RTOL, atol=1e-7
            )


def test_clip_norm_growth_hand_sequences():
    def norms(tx, values):
        g = [{"w": jnp.array([0.6, 0.8]) * v} for v in values]
        outs, _ = _run_steps(tx, g, g[0])
        return [float(np.linalg.norm(o["w"])) for o in outs]

    # mul=2: each step at most twice the last (clipped) norm.
    got = norms(ga.clip_norm_growth(mul=2.0, min_value=None, max_decay=None), [1, 10, 10, 10, 3])
    np.testing.assert_allclose(got, [1, 2, 4, 8, 3], rtol=RTOL)
    # add=1 and mul=None: at most one more than the last norm.
    got = norms(ga.clip_norm_growth(add=1.0, mul=None), [1, 5, 5, 0.5])
    np.testing.assert_allclose(got, [1, 2, 3, 0.5], rtol=RTOL)
    # max_decay=2: after a tiny step the tracked norm halves instead of collapsing.
    got = norms(ga.clip_norm_growth(mul=1.5, max_decay=2), [8, 0.1, 8, 8])
    np.testing.assert_allclose(got, [8, 0.1, 6, 8], rtol=RTOL)
    got = norms(ga.clip_norm_growth(mul=1.5, max_decay=None), [8, 0.1, 8])
    np.testing.assert_allclose(got, [8, 0.1, 0.15], rtol=RTOL)
    # min_value floors the tracked norm in the multiplicative bound.
    got = norms(ga.clip_norm_growth(mul=1.5, min_value=1e-2, max_decay=None), [0, 1])
    np.testing.assert_allclose(got, [0, 1.5e-2], rtol=RTOL)
    got = norms(ga.clip_norm_growth(mul=1.5, min_value=None, max_decay=None), [0, 1])
    np.testing.assert_allclose(got, [0, 0], rtol=RTOL)
    # add=None, mul=None passes through (torchzero raises).
    got = norms(ga.clip_norm_growth(add=None, mul=None), [1, 100])
    np.testing.assert_allclose(got, [1, 100], rtol=RTOL)


def test_clip_norm_growth_per_leaf_and_global():
    grads = [
        {"a": jnp.array([3.0, 4.0]), "b": jnp.array([1.0])},
        {"a": jnp.array([3.0, 4.0]), "b": jnp.array([4.0])},
    ]
    outs, state = _run_steps(ga.clip_norm_growth(mul=2.0), grads, grads[0])
    np.testing.assert_allclose(outs[1]["a"], [3.0, 4.0], rtol=RTOL)
    np.testing.assert_allclose(outs[1]["b"], [2.0], rtol=RTOL)
    np.testing.assert_allclose([state.prev_norm["a"], state.prev_norm["b"]], [5.0, 2.0])
    outs, state = _run_steps(ga.clip_norm_growth(mul=1.1, dim="global"), grads, grads[0])
    # Global norms sqrt(26) then sqrt(41), cut to 1.1 * sqrt(26).
    scale = 1.1 * np.sqrt(26) / np.sqrt(41)
    np.testing.assert_allclose(outs[1]["b"], [4.0 * scale], rtol=RTOL)
    np.testing.assert_allclose(state.prev_norm, 1.1 * np.sqrt(26), rtol=RTOL)
    # Named ords work (torchzero passes them to vector_norm and fails).
    outs, _ = _run_steps(ga.clip_norm_growth(mul=2.0, ord="mad"), grads, grads[0])
    np.testing.assert_allclose(outs[1]["b"], [2.0], rtol=RTOL)


def test_clip_value_growth_hand_sequence():
    seq = [[1.0, -1.0, 0.0, 8.0], [5.0, -1.5, 1.0, 0.1], [5.0, -5.0, 1.0, 8.0]]
    g = [{"w": jnp.array(s)} for s in seq]
    outs, state = _run_steps(ga.clip_value_growth(mul=2.0, min_value=0.25, max_decay=2), g, g[0])
    np.testing.assert_allclose(outs[0]["w"], seq[0])
    # step 2: bounds max(|p|, 0.25) * 2 = [2, 2, 0.5, 16]
    np.testing.assert_allclose(outs[1]["w"], [2.0, -1.5, 0.5, 0.1], rtol=RTOL)
    # tracked: [2, -1.5, 0.5, 8 / 2] (0.1 shrank by more than 2x, so 8 halves)
    np.testing.assert_allclose(outs[2]["w"], [4.0, -3.0, 1.0, 8.0], rtol=RTOL)
    np.testing.assert_allclose(state.prev["w"], [4.0, -3.0, 1.0, 8.0], rtol=RTOL)
    outs, _ = _run_steps(ga.clip_value_growth(add=0.5, mul=None, max_decay=None), g, g[0])
    np.testing.assert_allclose(outs[1]["w"], [1.5, -1.5, 0.5, 0.1], rtol=RTOL)
    np.testing.assert_allclose(outs[2]["w"], [2.0, -2.0, 1.0, 0.6], rtol=RTOL)


@pytest.mark.slow
def test_non_finite_updates_leave_state_unchanged():
    params = {"w": jnp.zeros(3), "m": jnp.zeros((2, 2))}
    good = {"w": jnp.array([1.0, 2.0, 3.0]), "m": jnp.ones((2, 2))}
    bad = {"w": jnp.array([1.0, jnp.nan, 3.0]), "m": jnp.ones((2, 2))}
    txs = [
        ga.clip_norm_by_ema(),
        ga.normalize_by_ema(dim="global"),
        ga.clip_value_by_ema(ema_init="update"),
        ga.clip_norm_growth(),
        ga.clip_value_growth(),
    ]
    after_good = _run_many(txs, [good], params)
    after_bad = _run_many(txs, [good, bad], params)
    for (_, state_good), (outs, state_bad) in zip(after_good, after_bad, strict=True):
        assert int(state_bad.count) == 1
        for a, b in zip(jax.tree.leaves(state_good), jax.tree.leaves(state_bad), strict=True):
            np.testing.assert_array_equal(a, b)
        # The update itself is not finite, so a later guard can see and drop it.
        assert not np.all(np.isfinite(outs[1]["w"]))


@pytest.mark.slow
def test_low_precision_updates_keep_dtype_and_state_dtype():
    params = {"w": jnp.zeros((2, 3)), "v": jnp.zeros(4)}
    grads = {"w": jnp.ones((2, 3), jnp.bfloat16), "v": jnp.ones(4, jnp.float16) * 3}
    txs = [
        ga.centralize(),
        ga.clip_norm(1.0),
        ga.normalize(dim="global"),
        ga.clip_value(0.5),
        ga.clip_norm_by_ema(),
        ga.normalize_by_ema(),
        ga.clip_value_by_ema(),
        ga.clip_norm_growth(),
        ga.clip_value_growth(),
    ]
    # float32 params, 16-bit updates: the states stay float32 (checked under
    # scan by _run_many) and the updates keep their dtypes.
    _run_many(txs, [grads] * 3, params)
    steps = jax.jit(lambda g: [tx.update(g, tx.init(params), params)[0] for tx in txs])(grads)
    for step in steps:
        assert step["w"].dtype == jnp.bfloat16 and step["v"].dtype == jnp.float16


def test_inject_hyperparams():
    with pytest.raises(TypeError, match=r"static_args=\('ord', 'dim', 'min_size'\)"):
        optax.inject_hyperparams(ga.clip_norm)(max_norm=1.0).init({})
    tx = optax.inject_hyperparams(ga.clip_norm, static_args=("ord", "dim", "min_size"))(
        max_norm=1.0
    )
    g = {"w": jnp.array([3.0, 4.0])}
    state = tx.init(g)
    u, state = jax.jit(tx.update)(g, state)
    np.testing.assert_allclose(u["w"], [0.6, 0.8], rtol=RTOL)
    state.hyperparams["max_norm"] = jnp.array(2.0)
    u, _ = jax.jit(tx.update)(g, state)
    np.testing.assert_allclose(u["w"], [1.2, 1.6], rtol=RTOL)


# --------------------------------------------------------------------------- #
# Errors                                                                       #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: ga.clip_norm(-1.0),
            ValueError,
            r"max_norm must be finite and >= 0; got max_norm=-1",
        ),
        (lambda: ga.clip_norm(1.0, "l7"), ValueError, r"ord must be .*got ord='l7'"),
        (lambda: ga.clip_norm(1.0, -2), ValueError, r"ord must be a number >= 0.*ord=-2"),
        (lambda: ga.clip_norm(1.0, None), TypeError, r"ord must be"),
        (lambda: ga.clip_norm(1.0, dim="all"), ValueError, r"dim must be None, 'global'.*'all'"),
        (lambda: ga.clip_norm(1.0, dim=1.0), TypeError, r"dim must be"),
        (lambda: ga.clip_norm(1.0, inverse_dims=True), ValueError, r"inverse_dims=True needs dim"),
        (lambda: ga.clip_norm(1.0, min_size=-1), ValueError, r"min_size must be an int >= 0"),
        (lambda: ga.clip_value(-0.1), ValueError, r"value must be finite and >= 0"),
        (lambda: ga.normalize(-1.0), ValueError, r"norm_value must be finite and >= 0"),
        (lambda: ga.normalize(1.0, "median"), ValueError, r"ord must be"),
        (lambda: ga.centralize("global", inverse_dims=True), ValueError, r"inverse_dims"),
        (
            lambda: ga.clip_norm_by_ema(beta=1.0),
            ValueError,
            r"beta must be in \[0, 1\); got beta=1.0",
        ),
        (lambda: ga.clip_norm_by_ema(beta=-0.1), ValueError, r"beta must be finite and >= 0"),
        (lambda: ga.normalize_by_ema(eps=0.0), ValueError, r"eps must be finite and > 0"),
        (lambda: ga.clip_norm_by_ema(max_ema_growth=0.0), ValueError, r"max_ema_growth"),
        (lambda: ga.clip_norm_by_ema(ema_init="ones"), ValueError, r"ema_init must be one of"),
        (lambda: ga.clip_norm_by_ema(dim=1), ValueError, r"dim must be None .* or 'global'"),
        (lambda: ga.clip_norm_by_ema(tensorwise=True), TypeError, r"tensorwise"),
        (lambda: ga.clip_value_by_ema(beta=1.5), ValueError, r"beta must be in \[0, 1\)"),
        (lambda: ga.clip_norm_growth(add=-1.0), ValueError, r"add must be finite and >= 0"),
        (lambda: ga.clip_norm_growth(mul=0.0), ValueError, r"mul must be finite and > 0"),
        (lambda: ga.clip_value_growth(max_decay=0.5), ValueError, r"max_decay must be >= 1"),
        (lambda: ga.clip_value_growth(min_value=-1.0), ValueError, r"min_value must be finite"),
        (lambda: ga.clip_norm_growth(parameterwise=True), TypeError, r"parameterwise"),
        (lambda: ga.clip_norm_growth(dim=0), ValueError, r"replaces torchzero's tensorwise"),
        (
            lambda: ga.clip_norm(1.0, min_size=2),
            ValueError,
            r"min_size applies to per-leaf .* dim='global'",
        ),
        (
            lambda: ga.clip_grad_norm({}, 1.0, min_norm=2.0),
            ValueError,
            r"min_norm must be <= max_norm",
        ),
        (lambda: ga.clip_grad_value({}, float("inf")), ValueError, r"value must be finite"),
    ],
)
def test_bad_arguments_raise_at_construction(make, error, match):
    with pytest.raises(error, match=match):
        make()


# --------------------------------------------------------------------------- #
# Properties                                                                   #
# --------------------------------------------------------------------------- #

# "sum" is left out: after rescaling, a sum that nearly cancels is recomputed
# with a relative error of eps * sum|x| / |sum x|, which no tolerance bounds.
PROP_ORDS = [1, 2, math.inf, 3, "mad", "std", "var"]
PROP_DIMS = [(None, False), (0, False), (-1, True), ("global", False)]
PROP_SHAPES = [(), (5,), (3, 4), (2, 3, 2), (2, 1, 2, 3)]


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _prop_clip_and_normalize(tree, bound, ord, dim, inverse_dims):
    def measure(t):
        return ga.clip_grad_norm(t, None, ord, dim=dim, inverse_dims=inverse_dims, min_size=1)[1]

    clipped, before = ga.clip_grad_norm(
        tree, bound, ord, dim=dim, inverse_dims=inverse_dims, min_size=1
    )
    normalized = ga.normalize_grads(tree, bound, ord, dim=dim, inverse_dims=inverse_dims)
    return clipped, normalized, before, measure(clipped), measure(normalized)


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from(PROP_SHAPES),
    ord=st.sampled_from(PROP_ORDS),
    dims=st.sampled_from(PROP_DIMS),
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-4, 4),
    bound=st.floats(0.01, 10.0),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
)
@pytest.mark.slow
def test_property_clip_bounds_and_normalize_reaches_target(
    shape, ord, dims, seed, log_scale, bound, dtype
):
    dim, inverse_dims = dims
    rng = np.random.default_rng(seed)
    tree = {
        "a": jnp.asarray(rng.normal(size=shape) * 10.0**log_scale, dtype),
        "b": jnp.asarray(rng.normal(size=(3,)), dtype),
    }
    clipped, normalized, before, after, norm_after = _prop_clip_and_normalize(
        tree, jnp.float32(bound), ord, dim, inverse_dims
    )
    for leaf in jax.tree.leaves((clipped, normalized)):
        assert leaf.dtype == dtype
        assert np.all(np.isfinite(np.asarray(leaf, np.float32)))
    # Rounding back to bfloat16 may move a measure by a few parts in 1e3.
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    lin_bound = np.sqrt(bound) if ord == "var" else bound
    if dim == "global":
        before, after, norm_after = {"all": before}, {"all": after}, {"all": norm_after}
    for k in before:
        if dim != "global" and not ref_units(tree[k].shape, dim, inverse_dims):
            continue  # no axis to span: the leaf is left alone
        k0, k1, k2 = (np.asarray(x[k], np.float64) for x in (before, after, norm_after))
        assert np.all(ref_linear(k1, ord) <= lin_bound * (1 + tol))
        # Units that measured nonzero reach the target; the rest stay as they were.
        nonzero = np.broadcast_to(ref_linear(k0, ord) > 0, k2.shape)
        np.testing.assert_allclose(ref_linear(k2[nonzero], ord), lin_bound, rtol=4 * max(tol, 1e-4))


@settings(max_examples=15, deadline=None)
@given(
    shape=st.sampled_from(PROP_SHAPES),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
    which=st.integers(0, 5),
)
@pytest.mark.slow
def test_property_zero_stays_zero_and_dtype_preserved(shape, dtype, which):
    zeros = {"a": jnp.zeros(shape, dtype)}
    tx = [
        ga.centralize(None),
        ga.clip_norm(1.0, "std"),
        ga.normalize(1.0, 3, dim=0),
        ga.clip_norm_by_ema(),
        ga.normalize_by_ema(),
        ga.clip_norm_growth(min_value=None),
    ][which]
    out, _ = jax.jit(tx.update)(zeros, tx.init(zeros))
    assert out["a"].dtype == dtype
    np.testing.assert_array_equal(np.asarray(out["a"], np.float32), 0)


# --------------------------------------------------------------------------- #
# Regressions: numerics over the whole float range (issue 18)                  #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("ord", [2, "l2", "std", "var"])
def test_huge_and_tiny_units_are_clipped_and_normalised_not_zeroed(ord):
    huge = {"w": jnp.array([3e19, 4e19])}
    tiny = {"w": jnp.array([3e-20, 4e-20])}
    clipped, _ = jax.jit(lambda t: ga.clip_grad_norm(t, 1.0, ord))(huge)
    direction = np.array([3.0, 4.0]) / (5.0 if ord in (2, "l2") else 1.0)
    if ord in (2, "l2"):
        np.testing.assert_allclose(clipped["w"], [0.6, 0.8], rtol=RTOL)
        normalized = jax.jit(lambda t: ga.normalize_grads(t, 1.0, ord))(tiny)
        np.testing.assert_allclose(normalized["w"], direction, rtol=RTOL)
    else:
        # std of [3, 4] * c is |c| / sqrt(2): the bound is reached, not zero.
        got = np.asarray(clipped["w"], np.float64)
        measured = np.std(got, ddof=1) ** (2 if ord == "var" else 1)
        np.testing.assert_allclose(measured, 1.0, rtol=1e-5)
        normalized = np.asarray(ga.normalize_grads(tiny, 1.0, ord)["w"], np.float64)
        measured = np.std(normalized, ddof=1) ** (2 if ord == "var" else 1)
        np.testing.assert_allclose(measured, 1.0, rtol=1e-5)


def test_global_norm_of_huge_leaves_and_ratio_below_smallest_normal():
    tx = ga.clip_norm(1.0)
    out, _ = jax.jit(tx.update)({"a": jnp.array([3e19]), "b": jnp.array([4e19])}, tx.init(None))
    np.testing.assert_allclose([out["a"][0], out["b"][0]], [0.6, 0.8], rtol=RTOL)
    # bound / norm = 7.9e-40 is below float32's smallest normal number.
    out = ga.normalize_grads({"w": jnp.array([1.26e36])}, 1e-3)
    np.testing.assert_allclose(out["w"], [1e-3], rtol=RTOL)
    out, norm = ga.clip_grad_norm({"w": jnp.array([3e38, 3e38])}, 1.0)
    np.testing.assert_allclose(out["w"], [0.70710677, 0.70710677], rtol=RTOL)
    assert float(norm) == np.finfo(np.float32).max  # 4.2e38 is capped, not inf


@pytest.mark.parametrize("factory", [ga.clip_norm_by_ema, ga.normalize_by_ema])
@pytest.mark.parametrize("ema_init", ["zeros", "update"])
def test_one_finite_spike_does_not_poison_the_ema_clippers(factory, ema_init):
    tx = factory(beta=0.5, ema_init=ema_init)
    grads = [{"w": jnp.array([3e19, 4e19])}] + [{"w": jnp.array([3.0, 4.0])}] * 3
    outs, state = _run_steps(tx, grads, grads[0])
    for out in outs:
        assert np.all(np.isfinite(out["w"]))
    for leaf in jax.tree.leaves(state):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    # And they are the float64 reference's numbers: the spike decays as any value does.
    normalize_ = factory is ga.normalize_by_ema
    expected = ref_by_ema(grads, 0.5, 2, 1e-6, True, 1.5, ema_init, normalize_)
    for got, want in zip(outs, expected, strict=True):
        chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-7)
    # Updates as large as the largest float: the state still stays finite.
    big = np.finfo(np.float32).max
    outs, state = _run_steps(tx, [{"w": jnp.array([big, big])}] * 2, grads[0])
    for leaf in jax.tree.leaves(state):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))


def test_complex_updates_keep_their_imaginary_part():
    g = {"w": jnp.array([3 + 4j, 1 - 2j], jnp.complex64)}
    out = _stateless_update(ga.clip_norm(100.0), g)
    np.testing.assert_array_equal(out["w"], g["w"])
    out = ga.normalize_grads(g, 1.0, dim=None)
    expected = np.array([3 + 4j, 1 - 2j]) / np.sqrt(30)
    np.testing.assert_allclose(out["w"], expected, rtol=RTOL)
    out = _stateless_update(ga.clip_value(2.5), g)
    np.testing.assert_allclose(out["w"], [1.5 + 2j, 1 - 2j], rtol=RTOL)


# --------------------------------------------------------------------------- #
# Regressions: names shared with optax keep optax's meaning (issue 14)         #
# --------------------------------------------------------------------------- #


def test_centralize_default_is_optax_centralize():
    tree = {
        "kernel": jnp.arange(12.0).reshape(3, 4) ** 2,
        "conv": jnp.arange(24.0).reshape(2, 3, 4),
        "column": jnp.array([[1.0], [2.0], [4.0]]),  # rows of one element become zero
        "bias": jnp.array([1.0, 5.0]),
        "scale": jnp.float32(3.0),
    }
    ours = _stateless_update(ga.centralize(), tree)
    theirs = _stateless_update(optax.centralize(), tree)
    chex.assert_trees_all_close(ours, jax.tree.map(np.asarray, theirs), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(ours["column"], 0)


def test_clip_norm_default_is_optax_clip_by_global_norm():
    tree = _tree(5, scale=2.0)
    ours = _stateless_update(ga.clip_norm(2.0), tree)
    theirs = _stateless_update(optax.clip_by_global_norm(2.0), tree)
    chex.assert_trees_all_close(ours, jax.tree.map(np.asarray, theirs), rtol=RTOL, atol=1e-7)
    # torchzero's per-leaf ClipNorm stays reachable by name.
    per_leaf = _stateless_update(ga.clip_norm(2.0, dim=None), tree)
    chex.assert_trees_all_close(per_leaf, ref_clip(tree, 2.0, dim=None), rtol=RTOL, atol=1e-7)


def test_min_size_defaults_agree_across_the_family():
    import inspect

    defaults = {
        f.__name__: inspect.signature(f).parameters["min_size"].default
        for f in (ga.clip_norm, ga.clip_grad_norm, ga.normalize, ga.normalize_grads, ga.centralize)
    }
    assert set(defaults.values()) == {1}, defaults


def test_inject_hyperparams_hint_names_each_transforms_own_static_args():
    g = {"w": jnp.array([3.0, 4.0])}
    cases = [
        (ga.centralize, {}),
        (ga.clip_norm, {"max_norm": 1.0}),
        (ga.normalize, {}),
        (ga.clip_norm_by_ema, {"ord": 1}),
        (ga.normalize_by_ema, {"ord": 1}),
        (ga.clip_norm_growth, {"ord": 1}),
        (ga.adaptive_grad_clip, {"axis": 0}),
    ]
    for factory, kwargs in cases:
        with pytest.raises(TypeError, match=r"static_args=") as info:
            optax.inject_hyperparams(factory)(**kwargs).init(g)
        static = eval(str(info.value).split("static_args=")[1].rstrip("."))
        tx = optax.inject_hyperparams(factory, static_args=static)(**kwargs)
        state = tx.init(g)
        u, _ = jax.jit(tx.update)(g, state, g)
        assert np.all(np.isfinite(u["w"])), factory.__name__


# --------------------------------------------------------------------------- #
# Regressions: the deviations from torchzero, pinned (issue 14)                #
# --------------------------------------------------------------------------- #


def test_tiny_units_are_normalised_where_torchzero_leaves_them():
    # torchzero replaces a measure <= 1e-12 by 1, leaving such a unit nearly
    # as it is; here every nonzero unit reaches the target.
    out = ga.normalize_grads({"w": jnp.array([3e-13, 4e-13])}, 1.0)
    np.testing.assert_allclose(out["w"], [0.6, 0.8], rtol=RTOL)
    out, _ = ga.clip_grad_norm({"w": jnp.array([3e-13, 4e-13])}, 2.0, min_norm=1.0)
    np.testing.assert_allclose(out["w"], [0.6, 0.8], rtol=RTOL)


def test_ema_eps_floors_the_ema_norm_and_caps_normalisation():
    # First step, zeros init: the EMA's norm is 2.5e-9, floored at eps = 1e-6 in
    # the division, so the update (norm 5e-9) passes unclipped (torchzero,
    # whose division has no such floor, would cut it to 2.5e-9).
    tx = ga.clip_norm_by_ema(beta=0.5, eps=1e-6, max_ema_growth=None)
    grads = [{"w": jnp.array([3e-9, 4e-9])}]
    outs, _ = _run_steps(tx, grads, grads[0])
    np.testing.assert_allclose(outs[0]["w"], [3e-9, 4e-9], rtol=1e-6)
    # normalize_by_ema amplifies by at most 1 / eps.
    tx = ga.normalize_by_ema(beta=0.5, eps=1e-2, ema_init="update")
    grads = [{"w": jnp.array([3.0, 4.0])}, {"w": jnp.array([3e-6, 4e-6])}]
    outs, _ = _run_steps(tx, grads, grads[0])
    np.testing.assert_allclose(outs[1]["w"], [3e-4, 4e-4], rtol=1e-5)


def test_centralize_keeps_0d_leaves_and_zeroes_one_element_units():
    tree = {"s": jnp.float32(3.0), "one": jnp.array([2.0]), "v": jnp.array([1.0, 3.0])}
    out = _stateless_update(ga.centralize(None, min_size=1), tree)
    assert float(out["s"]) == 3.0
    np.testing.assert_array_equal(out["one"], [0.0])
    np.testing.assert_array_equal(out["v"], [-1.0, 1.0])


def test_where_torchzero_fails_results_stay_defined():
    # The global l0 count of an all-zero tree is 0: nothing is divided by it.
    out, count = ga.clip_grad_norm({"a": jnp.zeros(3)}, 1.0, "l0")
    np.testing.assert_array_equal(out["a"], 0)
    assert float(count) == 0
    # A named ord per leaf (torchzero raises TypeError).
    out, _ = ga.clip_grad_norm({"a": jnp.array([3.0, 4.0])}, 1.0, "linf", dim=None)
    np.testing.assert_allclose(out["a"], [0.75, 1.0], rtol=RTOL)
    # The std of a one-element unit is 0, not NaN: the unit is left alone.
    out, std = ga.clip_grad_norm({"a": jnp.array([5.0])}, 1.0, "std", dim=None)
    np.testing.assert_array_equal(out["a"], [5.0])
    assert float(std["a"]) == 0.0


# --- Issue 24: non-finite input gives what optax gives, element for element ---

_NON_FINITE = [
    {"a": jnp.array([jnp.nan, 1e6]), "b": jnp.array([2e6])},
    {"a": jnp.array([jnp.inf, 1.0]), "b": jnp.array([2.0])},
    {"a": jnp.array([-jnp.inf, jnp.nan]), "b": jnp.array([0.5])},
]


@pytest.mark.parametrize("grads", _NON_FINITE, ids=["nan", "inf", "inf_and_nan"])
def test_global_norm_clipping_of_non_finite_input_equals_optax(grads):
    expected, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    clip = ga.clip_norm(1.0)
    got = {
        "clip_grad_norm": jax.jit(lambda g: ga.clip_grad_norm(g, 1.0)[0])(grads),
        "clip_norm": jax.jit(lambda g: clip.update(g, clip.init(g))[0])(grads),
    }
    for name, tree in got.items():
        for key in grads:
            np.testing.assert_array_equal(tree[key], expected[key], err_msg=name)


@pytest.mark.parametrize("grads", _NON_FINITE, ids=["nan", "inf", "inf_and_nan"])
def test_normalizing_a_non_finite_unit_makes_it_what_dividing_by_its_norm_makes_it(grads):
    # No optax counterpart; the rule is the same: g * target / norm, NaN where that is NaN.
    tx = ga.normalize(1.0)
    norm = optax.tree.norm(grads)
    expected = jax.tree.map(lambda g: g / norm, grads)
    for tree in (
        jax.jit(lambda g: ga.normalize_grads(g, 1.0))(grads),
        jax.jit(lambda g: tx.update(g, tx.init(g))[0])(grads),
    ):
        for key in grads:
            np.testing.assert_array_equal(tree[key], expected[key])
    # Per-leaf units: only the unit holding the non-finite element is touched by it.
    clipped, _ = jax.jit(lambda g: ga.clip_grad_norm(g, 1.0, dim=None))(grads)
    np.testing.assert_allclose(clipped["b"], jnp.clip(grads["b"], -1.0, 1.0))
    assert not np.all(np.isfinite(clipped["a"]))


# --- Issue 24: non-finite input to the EMA and growth clippers ---


def _after_history(tx, grads):
    state = tx.init(grads)
    for scale in (1.0, 100.0):
        _, state = jax.jit(tx.update)(jax.tree.map(lambda g, s=scale: s * g, grads), state)
    return state


@pytest.mark.parametrize(
    "make",
    [ga.clip_norm_by_ema, ga.normalize_by_ema, ga.clip_norm_growth],
    ids=["clip_norm_by_ema", "normalize_by_ema", "clip_norm_growth"],
)
@pytest.mark.parametrize("dim", [None, "global"], ids=["per_leaf", "global"])
def test_nan_makes_the_unit_it_scales_nan_and_leaves_the_state(make, dim):
    grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([1.0])}
    tx = make(dim=dim)
    state = _after_history(tx, grads)
    out, new_state = jax.jit(tx.update)({"a": jnp.array([jnp.nan, 4.0]), "b": grads["b"]}, state)
    assert np.all(np.isnan(out["a"]))  # was [nan, 4.0]: the 4.0 passed unscaled
    assert np.all(np.isnan(out["b"])) == (dim == "global")
    jax.tree.map(np.testing.assert_array_equal, new_state, state)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf], ids=["nan", "inf", "-inf"])
def test_value_clippers_treat_non_finite_elements_as_optax_clip_and_keep_the_state(bad):
    grads = {"a": jnp.array([3.0, 4.0])}
    g = {"a": jnp.array([bad, 4.0])}
    want, _ = optax.clip(1.0).update(g, None)
    np.testing.assert_array_equal(ga.clip_grad_value(g, 1.0)["a"], want["a"])
    for tx in (ga.clip_value_by_ema(), ga.clip_value_growth()):
        state = _after_history(tx, grads)
        out, new_state = jax.jit(tx.update)(g, state)
        jax.tree.map(np.testing.assert_array_equal, new_state, state)
        if jnp.isnan(bad):
            assert np.isnan(out["a"][0])
        else:
            # Clipped to the bound the state gives, not to an EMA the infinity blew up
            # (clip_value_by_ema returned float32's max here).
            assert np.isfinite(out["a"][0]) and abs(float(out["a"][0])) < 1e3
    tx = ga.clip_value_by_ema()
    state = _after_history(tx, grads)
    out, _ = jax.jit(tx.update)({"a": jnp.array([jnp.inf, 4.0])}, state)
    # The infinity is clipped to the element's EMA before this call.
    assert float(out["a"][0]) == pytest.approx(float(state.ema["a"][0]), rel=1e-6)


# --------------------------------------------------------------------------- #
# The rescaling branch stacks vectors of one shape (issue 30)                  #
# --------------------------------------------------------------------------- #


def _global_tree(scale):
    rng = np.random.default_rng(3)
    shapes = {"a": (64,), "b": (64,), "c": (64,), "d": (256,), "m": (8, 64), "s": ()}
    return {k: rng.normal(size=s) * scale for k, s in shapes.items()}


@pytest.mark.parametrize("scale", [1e25, 1e-25, 1.0])
def test_global_clip_of_stacked_vectors_equals_the_float64_reference(scale):
    # 1e25 overflows the squares and 1e-25 flushes them: both take the rescaling
    # branch, which sums the three 64-vectors as one stacked matrix.
    tree = _global_tree(scale)
    tx = ga.clip_norm(1.0)
    out, _ = jax.jit(tx.update)(jax.tree.map(jnp.float32, tree), tx.init(None))
    f32 = {k: np.asarray(v, np.float32).astype(np.float64) for k, v in tree.items()}
    norm = math.sqrt(sum(float(np.sum(v * v)) for v in f32.values()))
    factor = min(1.0, 1.0 / norm)
    for k, v in f32.items():
        np.testing.assert_allclose(out[k], v * factor, rtol=2e-6, atol=0)


def test_rescaling_branch_stacks_vectors_of_one_shape():
    from gradaccum_jax._base import trees

    xs = [jnp.ones(64), jnp.ones(64), jnp.ones(256), jnp.ones((4, 4)), jnp.ones(()), jnp.ones(64)]
    groups = trees.stack_vectors(xs)
    shapes = sorted(g.shape for g in groups)
    assert shapes == sorted([(), (4, 4), (256,), (3, 64)]), shapes
    # Beyond the budget (2**16 elements, or a 32nd of all), vectors stay apart.
    big = [jnp.ones(2**15), jnp.ones(2**15), jnp.ones(2**15)]
    assert sorted(g.shape for g in trees.stack_vectors(big)) == sorted([(2**15,), (2, 2**15)])


@pytest.mark.hlo
def test_stacked_vectors_under_explicit_sharding_need_no_communication():
    # Vectors of one shape sharded differently are stacked apart: the stack of
    # vectors sharded alike is sharded like them, so nothing moves between devices.
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tree = {f"v{i}": jax.device_put(jnp.ones(64), sharded if i % 2 else whole) for i in range(6)}
    tx = ga.clip_norm(1.0)
    compiled = jax.jit(lambda g: tx.update(g, tx.init(g))[0]).lower(tree).compile()
    text = compiled.as_text()
    for op in ("all-gather", "collective-permute", "all-to-all", "dynamic-slice"):
        assert f" {op}(" not in text and f" {op}-start(" not in text, op
    out = jax.jit(lambda g: tx.update(g, tx.init(g))[0])(jax.tree.map(lambda x: x * 1e25, tree))
    np.testing.assert_allclose(out["v1"], np.full(64, 1 / math.sqrt(6 * 64)), rtol=2e-6)
