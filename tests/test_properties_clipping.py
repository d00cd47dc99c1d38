"""Property-based tests of the clipping family and AGC against float64 NumPy references.

Random pytrees (None, 0-d, zero-size and size-1 axes), dtypes (float32,
float64 under `jax.enable_x64`, bfloat16, float16, complex64) and magnitudes
from 1e-30 to 1e30. Properties: bounds hold, targets are reached, measures
match the reference, no NaN or infinity comes out of finite input, and the
stateful transforms keep a finite state after any finite input.

The transforms run eagerly (no `jit`): each example then costs milliseconds
instead of a compilation. A few examples run by default; the `slow` variants
run many more. Inputs that once found a bug are kept as `@example`s.
"""

import contextlib
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import gradaccum_jax as ga

# A few fixed tree structures keep the primitives' compilation cache warm.
STRUCTURES = [
    {"a": (3, 1), "b": None, "c": (), "d": (0, 2), "e": (2, 3)},
    {"k": (2, 1, 3), "v": (4,)},
    {"s": (1,), "m": (1, 5)},
]
DTYPES = ["float32", "float64", "bfloat16", "float16", "complex64"]
ORDS = [2, 1, math.inf, 3, "mad", "std", "var"]
DIMS = [(None, False), ("global", False), (0, False), (-1, True)]
# Relative accuracy of results rounded to each dtype (a unit's measure moves
# by up to about half an ulp per element).
TOL = {"float32": 2e-5, "float64": 1e-10, "bfloat16": 2e-2, "float16": 4e-3, "complex64": 2e-5}
# Decimal exponents whose values every dtype holds as normal numbers.
EXPONENTS = {"float16": (-3, 3), "float64": (-30, 30)}

ORD = st.sampled_from(ORDS)
DIM = st.sampled_from(DIMS)
BOUND = st.floats(1e-3, 1e3)
GLOBAL = ("global", False)
PER_LEAF = (None, False)

# The quick runs skip shrinking: a failure still shows its falsifying example.
QUICK = settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
# Every example compiles new shapes: 12 keep the slow run within CI's time; set
# GRADACCUM_FUZZ_EXAMPLES (e.g. 150) for a deeper search.
SLOW_EXAMPLES = int(os.environ.get("GRADACCUM_FUZZ_EXAMPLES", "12"))
SLOW = settings(
    max_examples=SLOW_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _x64(dtype):
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


def _values(draw, structure, dtype, rng):
    lo, hi = EXPONENTS.get(dtype, (-30, 30))
    values = {}
    for key, shape in structure.items():
        if shape is None:
            values[key] = None
            continue
        scale = 10.0 ** draw(st.integers(lo, hi))
        x = rng.normal(size=shape) * scale
        if dtype == "complex64":
            x = x + 1j * rng.normal(size=shape) * scale
        values[key] = x
    return values


@st.composite
def trees(draw):
    """A tree of random values (one decimal magnitude per leaf) and its dtype."""
    structure = draw(st.sampled_from(STRUCTURES))
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    return _values(draw, structure, dtype, rng), dtype


@st.composite
def sequences(draw, max_size):
    """Several trees of one structure and dtype: the updates of consecutive steps."""
    structure = draw(st.sampled_from(STRUCTURES))
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    count = draw(st.integers(2, max_size))
    return [_values(draw, structure, dtype, rng) for _ in range(count)], dtype


def _as_jax(values, dtype):
    return {k: None if v is None else jnp.asarray(v, dtype) for k, v in values.items()}


def _as_f64(tree):
    out = {}
    for k, v in tree.items():
        x = None if v is None else np.asarray(v)
        out[k] = (
            None if x is None else x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)
        )
    return out


def _leaves(tree):
    return {k: v for k, v in tree.items() if v is not None}


def _units(shape, dim, inverse_dims):
    """The axes of each leaf's units as documented (0-d leaves as shape (1,))."""
    ndim = max(len(shape), 1)
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else dim
    present = {d % ndim for d in dims if -ndim <= d < ndim}
    if inverse_dims:
        present = set(range(ndim)) - present
    return tuple(sorted(present))


def _measure(x, axes, ord):
    """float64 measure of each unit (keepdims); the linear size for "var"."""
    a = np.abs(x)
    n = int(np.prod([x.shape[i] for i in axes]))
    if ord == "mad":
        return a.sum(axis=axes, keepdims=True) / n
    if ord in ("std", "var"):
        c = x - x.sum(axis=axes, keepdims=True) / n
        return np.sqrt((np.abs(c) ** 2).sum(axis=axes, keepdims=True) / max(n - 1, 1))
    if ord == math.inf:
        return a.max(axis=axes, keepdims=True)
    big = a.max(axis=axes, keepdims=True)
    safe = np.where(big > 0, big, 1)
    return big * ((a / safe) ** ord).sum(axis=axes, keepdims=True) ** (1 / ord)


def _spread(x, axes, ord):
    """How far rounding every element of each unit by a relative δ moves its measure, over δ.

    A measure of the values themselves moves by at most δ times itself. A centred one ("std";
    "var" as its linear size) moves by up to δ times the uncentred size, however small the
    spread: centring is a projection, so |std(x + e) - std(x)| <= |e| / sqrt(n - 1). Values far
    from zero and close together have a spread that rounding can wipe out (bfloat16's 1000 and
    1003, normalized to a standard deviation of 1, both round to 354).
    """
    if ord not in ("std", "var"):
        return _measure(x, axes, ord)
    n = int(np.prod([x.shape[i] for i in axes]))
    return np.sqrt((np.abs(x) ** 2).sum(axis=axes, keepdims=True) / max(n - 1, 1))


def _unit_sizes(tree, ord, dim, inverse_dims):
    """{key: (sizes, spreads)} per leaf, or {"*": (size, spread)} for the global unit."""
    leaves = _leaves(tree)
    if dim == "global":
        flat = np.concatenate([np.ravel(v) for v in leaves.values()])
        if not flat.size:
            return {"*": (np.zeros(1), np.zeros(1))}
        return {"*": (_measure(flat, (0,), ord), _spread(flat, (0,), ord))}
    out = {}
    for k, v in leaves.items():
        x = v.reshape(v.shape or (1,))
        axes = _units(v.shape, dim, inverse_dims)
        if axes and x.size:
            out[k] = (_measure(x, axes, ord), _spread(x, axes, ord))
    return out


def _assert_finite(tree):
    for leaf in jax.tree.leaves(tree):
        assert np.all(np.isfinite(np.asarray(leaf, np.complex128))), leaf


def _bound(value, ord):
    return math.sqrt(value) if ord == "var" else value


@QUICK
@given(
    data=trees(), ord=st.sampled_from(ORDS), dims=st.sampled_from(DIMS), bound=st.floats(1e-3, 1e3)
)
@example(data=({"w": np.array([3e19, 4e19])}, "float32"), ord=2, dims=(None, False), bound=1.0)
@example(
    data=({"w": np.array([3e19, 4e19])}, "float32"), ord="std", dims=("global", False), bound=1.0
)
@example(  # a variance beyond float32's range is reported capped
    data=({"w": np.array([1e27, -1e27, 3e26])}, "float32"),
    ord="var",
    dims=("global", False),
    bound=1.0,
)
@example(  # a standard deviation 7e-6 of the values: rounding the output moves it by 0.3 %
    data=({"w": np.array([[1000.0], [1000.01]])}, "float32"),
    ord="std",
    dims=(0, False),
    bound=1e-3,
)
def test_clip_grad_norm_bounds_every_unit(data, ord, dims, bound):
    values, dtype = data
    dim, inverse_dims = dims
    with _x64(dtype):
        tree = _as_jax(values, dtype)
        clipped, measures = ga.clip_grad_norm(tree, bound, ord, dim=dim, inverse_dims=inverse_dims)
        _assert_finite(clipped)
        _assert_finite(measures)
        before = _unit_sizes(_as_f64(tree), ord, dim, inverse_dims)
        after = _unit_sizes(_as_f64(clipped), ord, dim, inverse_dims)
    tol = TOL[dtype]
    limit = _bound(bound, ord)
    for k, (size, spread) in before.items():
        after_size, after_spread = after[k]
        assert np.all(after_size <= limit + 4 * tol * after_spread + 1e-300), (k, after_size, limit)
        # Units under the bound are left as they were.
        under = np.broadcast_to(size <= limit - 4 * tol * spread, after_size.shape)
        moved = np.abs(after_size - size) - 4 * tol * spread
        assert np.all(np.broadcast_to(moved, after_size.shape)[under] <= 0), (k, after_size, size)
        measure = measures if k == "*" else measures[k]
        reported = np.asarray(measure, np.float64).reshape(-1)
        slack = 4 * tol * spread
        expected, slack = (size**2, slack * (2 * size + slack)) if ord == "var" else (size, slack)
        # Measures are capped at their dtype's largest value, as documented: the
        # variance of float32 values near 1e27 is not a float32.
        expected = np.minimum(expected, float(jnp.finfo(measure.dtype).max)).reshape(-1)
        # XLA flushes subnormal results to zero: a variance under the dtype's smallest
        # normal value (1e-38 in float32, found by the search) may be reported as 0.
        tiny = float(jnp.finfo(measure.dtype).tiny)
        error = np.abs(reported - expected)
        assert np.all(error <= slack.reshape(-1) + tiny), (k, reported, expected, slack)


@QUICK
@given(
    data=trees(), ord=st.sampled_from(ORDS), dims=st.sampled_from(DIMS), target=st.floats(1e-3, 1e3)
)
@example(
    data=({"w": np.array([3e-20, 4e-20])}, "float32"), ord=2, dims=("global", False), target=1.0
)
@example(data=({"w": np.array([1.26e36])}, "float32"), ord=2, dims=("global", False), target=1e-3)
@example(
    data=({"w": np.array([3 + 4j, 1 - 2j])}, "complex64"), ord=2, dims=(None, False), target=1.0
)
@example(  # normalized to a standard deviation of 1, both values round to 354 in bfloat16
    data=({"w": np.array([[1000.0, 1.0], [1003.0, 2.0]])}, "bfloat16"),
    ord="std",
    dims=(0, False),
    target=1.0,
)
def test_normalize_grads_reaches_the_target(data, ord, dims, target):
    values, dtype = data
    dim, inverse_dims = dims
    with _x64(dtype):
        tree = _as_jax(values, dtype)
        out = ga.normalize_grads(tree, target, ord, dim=dim, inverse_dims=inverse_dims)
        _assert_finite(out)
        before = _unit_sizes(_as_f64(tree), ord, dim, inverse_dims)
        after = _unit_sizes(_as_f64(out), ord, dim, inverse_dims)
    tol = TOL[dtype]
    for k, (size, _) in before.items():
        after_size, after_spread = after[k]
        nonzero = np.broadcast_to(size > 0, after_size.shape)
        error = np.abs(after_size - _bound(target, ord))
        assert np.all(error[nonzero] <= 8 * tol * after_spread[nonzero]), (k, after_size, target)
    if dtype == "complex64":
        for k, v in _leaves(tree).items():
            # The phase is kept: the result is a positive multiple of the input.
            ratio = np.asarray(out[k], np.complex128) / np.where(v == 0, 1, np.asarray(v))
            assert np.all(np.abs(ratio.imag) <= 1e-4 * np.abs(ratio.real) + 1e-30)


@QUICK
@given(data=trees(), dim=st.sampled_from(["optax", None, "global", 0, -1]))
def test_centralize_subtracts_the_unit_mean(data, dim):
    values, dtype = data
    with _x64(dtype):
        tree = _as_jax(values, dtype)
        out = ga.centralize(dim).update(tree, None)[0]
        _assert_finite(out)
        got = _as_f64(out)
        x64 = _as_f64(tree)
    leaves = _leaves(x64)
    if dim == "global":
        flat = np.concatenate([np.ravel(v) for v in leaves.values()])
        mean = flat.mean() if flat.size else 0.0
        expected = {k: v - mean for k, v in leaves.items()}
    else:
        expected = {}
        for k, v in leaves.items():
            if dim == "optax":
                axes = tuple(range(1, v.ndim)) if v.ndim > 1 else ()
            else:
                axes = _units(v.shape, dim, False) if v.ndim else ()
            expected[k] = v - v.mean(axis=axes, keepdims=True) if axes and v.size else v
    everything = np.concatenate([np.abs(np.ravel(v)) for v in leaves.values()])
    for k, want in expected.items():
        # A global mean carries the rounding of the whole tree's largest values.
        scale = np.max(everything if dim == "global" else np.abs(leaves[k]), initial=0.0)
        np.testing.assert_allclose(got[k], want, atol=8 * TOL[dtype] * scale + 1e-300)


@QUICK
@given(data=trees(), clipping=st.floats(1e-3, 1.0), rule=st.sampled_from(["flax", "optax"]))
@example(data=({"w": np.array([2e19, 2e19])}, "float32"), clipping=0.01, rule="flax")
def test_adaptive_grad_clip_bounds_every_unit(data, clipping, rule):
    values, dtype = data
    if dtype == "complex64":
        dtype = "float32"  # the params below are real; complex gradients have their own test
        values = {k: None if v is None else v.real for k, v in values.items()}
    with _x64(dtype):
        grads = _as_jax(values, dtype)
        params = {k: None if v is None else jnp.ones_like(v) * 0.5 for k, v in grads.items()}
        tx = ga.adaptive_grad_clip(clipping, unit_axes=rule)
        out = tx.update(grads, tx.init(params), params)[0]
        _assert_finite(out)
        axes = ga._clipping.agc._leaf_axes(rule, params)
        got = _as_f64(out)
        x64 = _as_f64(grads)
        keys = sorted(k for k in grads if grads[k] is not None)
    for k, unit in zip(keys, axes, strict=True):
        if not got[k].size:
            continue
        p_norm = np.sqrt(np.sum(np.full(got[k].shape, 0.25), axis=unit, keepdims=True))
        limit = clipping * np.maximum(p_norm, 1e-3)
        g_after = np.sqrt(np.sum(np.abs(got[k]) ** 2, axis=unit, keepdims=True))
        g_before = np.sqrt(np.sum(np.abs(x64[k]) ** 2, axis=unit, keepdims=True))
        tol = TOL[dtype]
        assert np.all(g_after <= limit * (1 + 4 * tol))
        np.testing.assert_allclose(g_after, np.minimum(g_before, limit), rtol=8 * tol, atol=1e-300)


STATEFUL = [
    lambda: ga.clip_norm_by_ema(beta=0.5),
    lambda: ga.clip_norm_by_ema(beta=0.9, dim="global", ema_init="update"),
    lambda: ga.normalize_by_ema(beta=0.5, ema_init="update"),
    lambda: ga.normalize_by_ema(beta=0.9, ord="std", dim="global"),
    lambda: ga.clip_value_by_ema(beta=0.5),
    lambda: ga.clip_norm_growth(),
    lambda: ga.clip_norm_growth(add=1.0, dim="global"),
    lambda: ga.clip_value_growth(),
]


@QUICK
@given(steps=sequences(3), which=st.integers(0, len(STATEFUL) - 1))
@example(steps=([{"w": np.array([3e19, 4e19])}, {"w": np.array([3.0, 4.0])}], "float32"), which=0)
@example(steps=([{"w": np.array([3e19, 4e19])}, {"w": np.array([3.0, 4.0])}], "float32"), which=2)
def test_stateful_transforms_keep_a_finite_state(steps, which):
    values_list, dtype = steps
    tx = STATEFUL[which]()
    with _x64(dtype):
        params = jax.tree.map(jnp.zeros_like, _as_jax(values_list[0], dtype))
        state = tx.init(params)
        for values in values_list:
            out, state = tx.update(_as_jax(values, dtype), state, params)
            _assert_finite(out)
            _assert_finite(state)


@pytest.mark.slow
@SLOW
@given(
    data=trees(), ord=st.sampled_from(ORDS), dims=st.sampled_from(DIMS), bound=st.floats(1e-3, 1e3)
)
def test_slow_clip_grad_norm_bounds_every_unit(data, ord, dims, bound):
    test_clip_grad_norm_bounds_every_unit.hypothesis.inner_test(data, ord, dims, bound)


@pytest.mark.slow
@SLOW
@given(
    data=trees(), ord=st.sampled_from(ORDS), dims=st.sampled_from(DIMS), target=st.floats(1e-3, 1e3)
)
def test_slow_normalize_grads_reaches_the_target(data, ord, dims, target):
    test_normalize_grads_reaches_the_target.hypothesis.inner_test(data, ord, dims, target)


@pytest.mark.slow
@SLOW
@given(steps=sequences(5), which=st.integers(0, len(STATEFUL) - 1))
def test_slow_stateful_transforms_keep_a_finite_state(steps, which):
    test_stateful_transforms_keep_a_finite_state.hypothesis.inner_test(steps, which)
