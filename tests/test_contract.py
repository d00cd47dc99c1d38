"""The contract every public gradient transformation keeps (STYLE.md, house rule 8).

One table, `ROWS`, holds one line per public transformation: the factory's
name in `gradaccum_jax.__all__`, the arguments it is built with, the extra
keyword arguments its `update` needs, and whether it accumulates windows.
A new public transformation fails `test_table_covers_every_public_transformation`
until it has a row. Every check runs under `jax.jit`:

* `jax.eval_shape(init)` equals `init`;
* the state keeps each leaf's shape and dtype through `lax.scan` and `lax.cond`,
  for params in float32, bfloat16 and float16 and gradients in the params'
  dtype or float32 (accumulating rows wrap adam, a stateful optimizer); the
  quick loop traces the float32-gradient cases, the `slow` marker adds 16-bit
  gradients and runs every case (results finite);
* inside `optax.chain`, `optax.masked` and `optax.inject_hyperparams` (float
  arguments injected unless the row lists them as static, and then injecting
  them is refused with an error that names `static_args`) it gives the same
  updates as alone: nested in one program in the quick loop, one wrapper at a
  time under `slow`;
* a donated `(params, opt_state)` carry, the state from an eager `init`, gives
  the undonated result bit for bit;
* accumulating rows: the donated train step (gradient, update, `apply_updates`)
  of an MLP with biases and several equal-shaped leaves compiles without any
  copy of a parameter-shaped buffer.

Compilations are few and small (a two-leaf tree, single-step programs) so the
file stays fast in the quick loop.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from benchmarks import harness

ADAM = optax.adam(1e-2)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # the factory, a name in gradaccum_jax.__all__ (or "namespace.name")
    kwargs: dict[str, Any]  # its arguments
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # update's extra arguments
    accumulates: bool = False  # windows of 2 calls; the train step must not copy
    static: tuple[str, ...] = ()  # float arguments that must be Python floats (not injectable)

    @property
    def factory(self) -> Any:
        return _factory(self.name)

    def make(self, **overrides: Any) -> optax.GradientTransformation:
        return self.factory(**{**self.kwargs, **overrides})


# Public namespaces whose transformations need rows too, besides gradaccum_jax itself.
NAMESPACES = ("privacy",)


def _factory(name: str) -> Any:
    namespace, _, attribute = name.rpartition(".")
    return getattr(getattr(ga, namespace) if namespace else ga, attribute)


LOSS_SCALE_FLOATS = ("initial_scale", "growth_factor", "backoff_factor", "min_scale")
DP = dict(l2_clip_norm=1.0, noise_multiplier=0.5, expected_batch_size=4, key=jax.random.key(3))
# fmt: off
ROWS = [
    Row("accumulate", dict(inner=ADAM, every_k_schedule=2), accumulates=True, static=("noise_scale_decay",)),  # noqa: E501
    Row("conditional_accumulate", dict(inner=ADAM, num_required=2, max_staleness=1 << 20), dict(local_step=0), accumulates=True),  # noqa: E501
    Row("split_accumulate", dict(every_k_schedule=2, reduction="mean", bound="power", upper=8.0, lower=-8.0), accumulates=True, static=("upper", "lower")),  # noqa: E501
    Row("adaptive_grad_clip", dict(clipping=0.05, eps=1e-3)),
    Row("centralize", dict()),
    Row("clamp_params", dict(lower=-8.0, upper=8.0), static=("lower", "upper")),
    Row("clip_norm", dict(max_norm=0.5)),
    Row("clip_norm_by_ema", dict(beta=0.5)),
    Row("clip_norm_growth", dict(mul=1.5)),
    Row("clip_value", dict(value=0.3)),
    Row("clip_value_by_ema", dict(beta=0.5)),
    Row("clip_value_growth", dict(mul=1.5)),
    Row("dynamic_loss_scale", dict(initial_scale=256.0, growth_interval=2), static=LOSS_SCALE_FLOATS),  # noqa: E501
    Row("normalize", dict(norm_value=0.5)),
    Row("normalize_by_ema", dict(beta=0.5)),
    Row("static_loss_scale", dict(loss_scale=128.0), static=("loss_scale",)),
    Row("privacy.dp_accumulate", dict(inner=ADAM, every_k_schedule=2, **DP), accumulates=True, static=("l2_clip_norm", "noise_multiplier")),  # noqa: E501
]
# fmt: on
BY_NAME = {row.name: row for row in ROWS}
ACCUMULATING = [row for row in ROWS if row.accumulates]
row_ids = pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)

STEPS = 3  # a micro-step, a window boundary, a micro-step
PARAMS = {
    "b": jnp.linspace(-1.0, 1.0, 3),
    "w": jnp.reshape(jnp.linspace(-2.0, 2.0, 12), (4, 3)),
}
GRADS = [
    jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), PARAMS)
    for k in jax.random.split(jax.random.key(0), STEPS)
]
STACKED_GRADS = jax.tree.map(lambda *g: jnp.stack(g), *GRADS)
# Under optax.masked the selected leaf follows the row's trajectory on the selected
# subtree alone, and the other passes through.
MASK = {"b": False, "w": True}

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
QUICK_DTYPES = [(F32, F32), (BF16, F32), (F16, F32)]  # 16-bit params meet float32 grads
DTYPES = [*QUICK_DTYPES, (BF16, BF16), (F16, F16)]


def dtype_ids(dtypes):
    return pytest.mark.parametrize(
        ("params_dtype", "grads_dtype"), dtypes, ids=lambda d: jnp.dtype(d).name
    )


# LLVM's optimisation level changes neither the HLO (copies, aliasing) nor what these
# tests compare (every side is compiled alike); level 0 compiles about a quarter faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _kinds(tree: Any) -> Any:
    return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def _step(tx, extra):
    def step(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p, **extra)
        return (optax.apply_updates(p, u), s), u

    return step


def _trajectory(tx, extra, *, donate=(), params=PARAMS, grads=GRADS):
    """Updates of `STEPS` calls of a jitted step (params applied), and the final carry."""
    step = jax.jit(_step(tx, extra), donate_argnums=donate, compiler_options=FAST_COMPILE)
    carry, updates = (jax.tree.map(jnp.copy, params), tx.init(params)), []
    for g in grads:
        carry, u = step(carry, g)
        updates.append(u)
    return updates, carry


@functools.cache
def _reference(name: str):
    row = BY_NAME[name]
    return _trajectory(row.make(), row.extra)


def _scan_and_cond(tx, extra):
    """`STEPS` updates under `lax.scan`, then one inside `lax.cond`; returns the states."""

    def run(params, grads, flag):
        state = tx.init(params)
        (p, s), updates = jax.lax.scan(_step(tx, extra), (params, state), grads)
        first = jax.tree.map(lambda g: g[0], grads)
        after_cond = jax.lax.cond(
            flag, lambda s: tx.update(first, s, p, **extra)[1], lambda s: s, s
        )
        return state, s, after_cond, p, updates

    return jax.jit(run)


def _public_transformations() -> set[str]:
    names = set()
    qualified = [*ga.__all__, *(f"{ns}.{n}" for ns in NAMESPACES for n in getattr(ga, ns).__all__)]
    for name in qualified:
        obj = _factory(name)
        if inspect.isfunction(obj):
            annotation = inspect.signature(obj).return_annotation
            assert annotation is not inspect.Signature.empty, f"{name} has no return annotation"
            if "GradientTransformation" in str(annotation):
                names.add(name)
    return names


def test_table_covers_every_public_transformation():
    assert _public_transformations() == set(BY_NAME)
    assert len(BY_NAME) == len(ROWS)  # one row per name


@row_ids
def test_eval_shape_of_init_equals_init(row):
    tx = row.make()
    assert isinstance(tx, optax.GradientTransformation)
    abstract = jax.eval_shape(tx.init, PARAMS)
    concrete = jax.jit(tx.init)(PARAMS)
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    assert _kinds(abstract) == _kinds(concrete) == _kinds(tx.init(PARAMS))


def _check_kinds_under_scan_and_cond(row, params_dtype, grads_dtype):
    # Traced only: lax.scan and lax.cond refuse a state whose dtypes change.
    params, grads = _cast(PARAMS, params_dtype), _cast(STACKED_GRADS, grads_dtype)
    init, after_scan, after_cond, new_params, updates = jax.eval_shape(
        _scan_and_cond(row.make(), row.extra), params, grads, True
    )
    assert _kinds(after_scan) == _kinds(after_cond) == _kinds(init)
    assert _kinds(new_params) == _kinds(params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)


@dtype_ids(QUICK_DTYPES)
@row_ids
def test_state_kinds_stable_under_scan_and_cond(row, params_dtype, grads_dtype):
    _check_kinds_under_scan_and_cond(row, params_dtype, grads_dtype)


@pytest.mark.slow
@dtype_ids(DTYPES[len(QUICK_DTYPES) :])
@row_ids
def test_state_kinds_stable_under_scan_and_cond_16_bit_grads(row, params_dtype, grads_dtype):
    _check_kinds_under_scan_and_cond(row, params_dtype, grads_dtype)


@pytest.mark.slow
@dtype_ids(DTYPES)
@row_ids
def test_scan_and_cond_run_finite_in_every_dtype(row, params_dtype, grads_dtype):
    params, grads = _cast(PARAMS, params_dtype), _cast(STACKED_GRADS, grads_dtype)
    out = _scan_and_cond(row.make(), row.extra)(params, grads, True)
    assert _kinds(out[1]) == _kinds(out[0])
    for leaf in jax.tree.leaves(out):
        assert jnp.all(jnp.isfinite(leaf))


def _assert_same_updates(actual, expected):
    chex.assert_trees_all_close(actual, expected, rtol=1e-6, atol=1e-7)


@row_ids
def test_reference_trajectory_is_finite(row):
    updates, carry = _reference(row.name)
    for leaf in jax.tree.leaves((updates, carry)):
        assert jnp.all(jnp.isfinite(leaf))


@functools.cache
def _masked_reference(name: str):
    # optax.masked hands the row only the selected leaves: a row acting leaf by leaf
    # follows its own trajectory there, a global one (clip_norm, normalize) measures
    # the selected subtree alone.
    row = BY_NAME[name]
    keep = [k for k in PARAMS if MASK[k]]
    params = {k: PARAMS[k] for k in keep}
    grads = [{k: g[k] for k in keep} for g in GRADS]
    return _trajectory(row.make(), row.extra, params=params, grads=grads)[0]


def _masked_expectation(row):
    return [
        {k: alone[k] if MASK[k] else g[k] for k in PARAMS}
        for alone, g in zip(_masked_reference(row.name), GRADS, strict=True)
    ]


def _injectable(row: Row) -> tuple[list[str], list[str]]:
    """(static, injected) arguments: floats are injected unless the row keeps them static."""
    bound = inspect.signature(row.factory).bind(**row.kwargs)
    bound.apply_defaults()
    floats = [k for k, v in bound.arguments.items() if isinstance(v, float)]
    injected = [k for k in floats if k not in row.static]
    return [k for k in bound.arguments if k not in injected], injected


def _injected(row: Row) -> optax.GradientTransformation:
    static, _ = _injectable(row)
    return optax.inject_hyperparams(row.factory, static_args=static)(**row.kwargs)


@row_ids
def test_inside_chain_of_masked_inject_hyperparams(row):
    # The three wrappers at once (one compilation); the slow tests take them one by one.
    tx = optax.chain(optax.identity(), optax.masked(_injected(row), MASK))
    updates, _ = _trajectory(tx, row.extra)
    _assert_same_updates(updates, _masked_expectation(row))


@pytest.mark.slow
@row_ids
def test_inside_chain(row):
    updates, _ = _trajectory(optax.chain(optax.identity(), row.make()), row.extra)
    _assert_same_updates(updates, _reference(row.name)[0])


@pytest.mark.slow
@row_ids
def test_inside_masked(row):
    updates, _ = _trajectory(optax.masked(row.make(), MASK), row.extra)
    _assert_same_updates(updates, _masked_expectation(row))


@pytest.mark.slow
@row_ids
def test_inside_inject_hyperparams(row):
    updates, (_, state) = _trajectory(_injected(row), row.extra)
    assert sorted(state.hyperparams) == sorted(_injectable(row)[1])
    _assert_same_updates(updates, _reference(row.name)[0])


@pytest.mark.parametrize("row", [r for r in ROWS if r.static], ids=lambda r: r.name)
def test_static_float_arguments_refused_with_the_fix(row):
    # A float that must stay a Python float, injected anyway: the error names the fix.
    static, _ = _injectable(row)
    static = [k for k in static if k not in row.static]
    tx = optax.inject_hyperparams(row.factory, static_args=static)(**row.kwargs)
    with pytest.raises((TypeError, ValueError), match="static_args"):
        jax.eval_shape(lambda p, g: _step(tx, row.extra)((p, tx.init(p)), g), PARAMS, GRADS[0])


@row_ids
def test_donated_carry_equals_undonated(row):
    # The carry comes from an eager init(): buffers it shares would be donated twice.
    updates, carry = _trajectory(row.make(), row.extra, donate=(0,))
    chex.assert_trees_all_equal((updates, carry), _reference(row.name))


@row_ids
def test_eager_init_shares_no_buffer(row):
    # Donating (params, state) fails on a buffer held twice, between fields or with params.
    state = row.make().init(PARAMS)
    buffers = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves((PARAMS, state))]
    assert len(buffers) == len(set(buffers))


# --- the donated train step of an MLP: no parameter-sized copy -----------------------------

MLP_SIZES = [16, 16, 16]  # two (16, 16) weights, two 16-wide biases


def _mlp_params():
    keys = jax.random.split(jax.random.key(1), len(MLP_SIZES) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, MLP_SIZES[:-1], MLP_SIZES[1:], strict=True)
    ]


def _mlp_loss(params, x, y):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean((x @ params[-1]["w"] + params[-1]["b"] - y) ** 2)


@pytest.mark.hlo
@pytest.mark.parametrize("row", ACCUMULATING, ids=lambda r: r.name)
def test_donated_train_step_copies_no_parameter(row):
    tx = row.make()
    params = _mlp_params()

    # (params, state) in, (params, state) out: each donated buffer has its own successor.
    def train_step(carry, x, y):
        p, s = carry
        u, s = tx.update(jax.grad(_mlp_loss)(p, x, y), s, p, **row.extra)
        return optax.apply_updates(p, u), s

    x, y = jnp.ones((16, MLP_SIZES[0])), jnp.ones((16, MLP_SIZES[-1]))
    compiled = (
        jax.jit(train_step, donate_argnums=0).lower((params, tx.init(params)), x, y).compile()
    )
    hlo = harness.Hlo(compiled)
    shapes = {p.shape for p in jax.tree.leaves(params)}
    # Float buffers: the noise of privacy.dp_accumulate draws parameter-shaped uint32 random
    # bits, which XLA's threefry loop copies inside the window's close; no state buffer.
    copies = [
        f"{c.computation}: {c.line} (of a {hlo.source(c)})"
        for c in hlo.copies(1)
        if any(dims in shapes and dtype.startswith(("f", "bf")) for dtype, dims in c.types)
    ]
    assert copies == []
