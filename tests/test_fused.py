"""`apply_gradients`: the fused path equals the optax path and moves no parameter-sized temp."""

from __future__ import annotations

import os
import re

import _equivalence as E
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._window import fused as _fused

P = jax.P
STEPS = 7


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (4, 8)) / 2.0,
        "b1": jnp.full((8,), 0.1),
        "w2": jax.random.normal(k2, (8, 2)) / 3.0,
    }


def batch(step, size=16):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(size, 4)).astype(np.float32)
    y = rng.normal(size=(size, 2)).astype(np.float32)
    if step == 1:
        x[:4, 0] = np.nan  # a dropped micro-step
    return x, y


def optax_path(tx, grads, state, params, **extra):
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state


def run(tx, step_fn, weights=None, first=0):
    params = init_params()
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y, w):
        grads = jax.grad(E.mlp_loss)(params, x, y)
        extra = {} if w is None else {"weight": w}
        return step_fn(tx, grads, state, params, **extra)

    out = []
    for i in range(STEPS):
        w = None if weights is None else jnp.float32(weights[i])
        params, state = step(params, state, *batch(first + i), w)
        out.append((params, state))
    return out


# Under the suite's compiler settings (conftest.py) the two paths agree bit for bit. With
# XLA's defaults (GRADACCUM_XLA_DEFAULTS=1, the wheel and oldest-stack CI steps) the apply
# branch that also updates the params is fused differently. Measured there: one element in
# 32 one ulp apart on jax 0.10.2; up to 16 ulp on jax 0.8.1, 1.2e-7 absolute on Adam's
# near-zero moments. There the bound is float32 rounding: rtol 2e-6, atol 2e-7.
EXACT = os.environ.get("GRADACCUM_XLA_DEFAULTS", "") in ("", "0")


def assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if EXACT or not jnp.issubdtype(x.dtype, jnp.inexact):
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(
                x.astype(np.float64), y.astype(np.float64), rtol=2e-6, atol=2e-7
            )


TRANSFORMS = {
    "alone": lambda: ga.accumulate(optax.adam(1e-2), 3),
    "chain_clip": lambda: optax.chain(ga.clip_norm(0.5), ga.accumulate(optax.adam(1e-2), 3)),
    "inject": lambda: optax.inject_hyperparams(lambda lr: ga.accumulate(optax.adam(lr), 3))(
        lr=1e-2
    ),
    "sum": lambda: ga.accumulate(optax.sgd(0.1), 3, use_grad_mean=False),
    "schedule": lambda: ga.accumulate(optax.adam(1e-2), lambda s: jnp.where(s < 1, 2, 3)),
    "k1": lambda: ga.accumulate(optax.adam(1e-2), 1),
    "k1_unchecked": lambda: ga.accumulate(optax.sgd(0.1), 1, skip_nonfinite=False),
    "compensated": lambda: ga.accumulate(
        optax.adam(1e-2), 3, accumulator_dtype=jnp.bfloat16, compensated=True
    ),
    "noise": lambda: ga.accumulate(optax.adam(1e-2), 3, track_noise_scale=True),
    # Not fused (apply_gradients falls back to the optax path): still equal.
    "masked": lambda: optax.masked(
        ga.accumulate(optax.adam(1e-2), 3), {"w1": True, "b1": False, "w2": True}
    ),
    "not_last": lambda: optax.chain(ga.accumulate(optax.adam(1e-2), 3), optax.scale(0.5)),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_apply_gradients_equals_update_then_apply_updates(name):
    tx = TRANSFORMS[name]()
    # NaN gradients of unmasked or unchecked leaves would reach the params: start later.
    first = 2 if name in ("masked", "k1_unchecked") else 0
    fused = run(tx, ga.apply_gradients, first=first)
    reference = run(tx, optax_path, first=first)
    assert_bitwise_equal(fused, reference)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(fused[-1][0]))


def test_weighted_windows_equal_the_optax_path():
    tx = ga.accumulate(optax.adam(1e-2), 3)
    weights = [3.0, 5.0, 0.0, 2.0, 7.0, 1.0, 4.0]
    assert_bitwise_equal(run(tx, ga.apply_gradients, weights), run(tx, optax_path, weights))


def _fused_calls(tx, params, grads):
    """How often a traced step asked accumulate for new params and took its answer."""
    receipts = []
    original = _fused.Receipt

    class Spy(original):
        def __init__(self):
            super().__init__()
            receipts.append(self)

    _fused.Receipt = Spy
    try:
        jax.eval_shape(lambda: ga.apply_gradients(tx, grads, tx.init(params), params))
    finally:
        _fused.Receipt = original
    return [r.calls for r in receipts]


@pytest.mark.parametrize(
    ("name", "expected"),
    [("alone", [1]), ("chain_clip", [1]), ("inject", [1]), ("masked", []), ("not_last", [])],
)
def test_fused_where_accumulate_ends_the_transformation(name, expected):
    params = init_params()
    grads = jax.tree.map(jnp.ones_like, params)
    assert _fused_calls(TRANSFORMS[name](), params, grads) == expected


def test_an_answer_changed_after_accumulate_falls_back_to_the_optax_path():
    # A wrapper whose state looks like a chain ending in accumulate, but which
    # changes accumulate's output: the fused result is dropped.
    acc = ga.accumulate(optax.sgd(0.1), 1)

    def update(updates, state, params=None, **extra):
        out, inner = acc.update(updates, state[0], params, **extra)
        return jax.tree.map(lambda u: 2 * u, out), (inner,)

    tx = optax.GradientTransformationExtraArgs(lambda p: (acc.init(p),), update)
    params = init_params()
    assert _fused_calls(tx, params, jax.tree.map(jnp.ones_like, params)) == [1]
    assert_bitwise_equal(run(tx, ga.apply_gradients, first=2), run(tx, optax_path, first=2))


def test_plain_optimizer_is_update_then_apply_updates():
    tx = optax.adam(1e-2)
    assert_bitwise_equal(run(tx, ga.apply_gradients, first=2), run(tx, optax_path, first=2))


def test_static_window_of_one_holds_no_accumulator():
    tx = ga.accumulate(optax.adam(1e-2), 1)
    state = tx.init(init_params())
    assert state.acc_grads is None and state.acc_compensation is None
    out = run(tx, ga.apply_gradients)
    final = out[-1][1]
    assert int(ga.optimizer_step(final)) == STEPS - 1  # one micro-step dropped
    assert bool(ga.closes_window(final)) and bool(ga.has_updated(final))
    assert int(final.num_skipped) == 1
    # Equal to the inner optimizer on the accepted gradients.
    adam, params = optax.adam(1e-2), init_params()
    adam_state = adam.init(params)
    for i in range(STEPS):
        if i == 1:
            continue
        grads = jax.grad(E.mlp_loss)(params, *batch(i))
        params, adam_state = jax.jit(lambda p, s, g: optax_path(adam, g, s, p))(
            params, adam_state, grads
        )
    for a, b in zip(jax.tree.leaves(out[-1][0]), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


BIG = {
    "w": jnp.zeros((512, 256), jnp.float32),
    "v": jnp.zeros((512, 256), jnp.float32),
    "b": jnp.zeros((256,), jnp.float32),
}
BIG_BYTES = sum(x.nbytes for x in jax.tree.leaves(BIG))


def _donated_step(tx, fused=True):
    grads = jax.tree.map(jnp.ones_like, BIG)
    fn = ga.apply_gradients if fused else optax_path
    step = jax.jit(lambda p, s, g: fn(tx, g, s, p), donate_argnums=(0, 1))
    return step.lower(BIG, tx.init(BIG), grads).compile()


@pytest.mark.slow
@pytest.mark.hlo
@pytest.mark.parametrize(
    "make",
    [
        lambda: ga.accumulate(optax.adam(1e-3), 4),
        lambda: ga.accumulate(optax.adam(1e-3), 4, skip_nonfinite=False),
        lambda: ga.accumulate(optax.adam(1e-3), 1),
        lambda: optax.inject_hyperparams(lambda lr: ga.accumulate(optax.adam(lr), 4))(lr=1e-3),
        # The clipped gradient is not written out: its scaling is fused into the add.
        lambda: optax.chain(ga.clip_norm(1.0), ga.accumulate(optax.adam(1e-3), 4)),
    ],
)
@pytest.mark.requires(
    "measured: jax 0.8.1's compiler keeps a parameter-sized temporary in this step", jax="0.10.2"
)
def test_fused_step_has_no_parameter_sized_temp_and_aliases_params(make):
    compiled = _donated_step(make())
    mem = harness.compiled_memory(compiled)
    assert mem.temp_bytes <= 0.01 * BIG_BYTES, mem
    hlo = harness.Hlo(compiled)
    assert not hlo.copies(256 * 512), [c.line for c in hlo.copies(256 * 512)]
    # Every donated parameter-sized buffer (params, accumulator, moments) aliases its successor.
    assert mem.output_bytes - mem.alias_bytes < 0.01 * BIG_BYTES, mem


@pytest.mark.slow
@pytest.mark.hlo
def test_static_window_of_one_unchecked_builds_no_conditional():
    compiled = _donated_step(ga.accumulate(optax.adam(1e-3), 1, skip_nonfinite=False), False)
    hlo = harness.Hlo(compiled)
    assert not hlo.conditionals()
    assert harness.compiled_memory(compiled).temp_bytes <= 0.01 * BIG_BYTES


def _pmap_run(step_fn):
    n = jax.device_count()
    tx = ga.accumulate(optax.adam(1e-2), 3, axis_name="data")
    stacked = jax.tree.map(lambda p: jnp.stack([p] * n), init_params())
    state = jax.pmap(tx.init, axis_name="data")(stacked)

    def body(params, state, x, y):
        return step_fn(tx, jax.grad(E.mlp_loss)(params, x, y), state, params)

    step = jax.pmap(body, axis_name="data")
    for i in range(STEPS):
        x, y = batch(i, size=4 * n)
        stacked, state = step(stacked, state, x.reshape(n, 4, 4), y.reshape(n, 4, 2))
    return stacked, state


def test_replica_route_fused_equals_optax_path():
    assert_bitwise_equal(_pmap_run(ga.apply_gradients), _pmap_run(optax_path))


def _global_view_run(step_fn, **kwargs):
    mesh = jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    tx = ga.accumulate(optax.adam(1e-2), 3, **kwargs)
    with jax.set_mesh(mesh):
        params = init_params()
        state = jax.jit(tx.init)(params)
        grad_fn = ga.unreduced_value_and_grad(
            lambda p, b: E.mlp_loss(p, b[0], b[1]), "data", batch_argnums=1
        )

        @jax.jit
        def step(params, state, b):
            return step_fn(tx, grad_fn(params, b)[1], state, params)

        for i in range(STEPS):
            x, y = batch(i, size=2 * jax.device_count())
            params, state = step(params, state, jax.device_put((x, y), P("data")))
        return jax.tree.map(np.asarray, params)


@pytest.mark.requires("unreduced windows", jax="0.9.1")
@pytest.mark.parametrize("kwargs", [{}, {"shard_inner_state": "data"}], ids=["dp", "zero1"])
def test_unreduced_route_fused_equals_optax_path(kwargs):
    assert_bitwise_equal(
        _global_view_run(ga.apply_gradients, **kwargs), _global_view_run(optax_path, **kwargs)
    )


# --- a clip that measured the gradient tells accumulate whether it is finite ---------


def _count_checks(monkeypatch):
    """Counts, while tracing, the finiteness passes accumulate makes over its input."""
    from gradaccum_jax._base import trees

    calls = []
    original = trees.all_finite_by_squares

    def spy(tree):
        calls.append(tree)
        return original(tree)

    monkeypatch.setattr(trees, "all_finite_by_squares", spy)
    return calls


@pytest.mark.parametrize(
    "make, passes",
    [
        # The global L2 clip vouches: accumulate reads the gradient only to add it.
        (lambda: ga.clip_norm(1.0), 0),
        # Per-leaf units, other measures and optax's clip: the check runs as before.
        (lambda: ga.clip_norm(1.0, dim=None), 1),
        (lambda: ga.clip_norm(1.0, "linf"), 1),
        (lambda: optax.clip_by_global_norm(1.0), 1),
        # A transformation between them changes the leaves: the vouch does not apply.
        (lambda: optax.chain(ga.clip_norm(1.0), optax.scale(0.5)), 1),
    ],
)
def test_only_a_vouched_gradient_skips_the_finite_check(monkeypatch, make, passes):
    tx = optax.chain(make(), ga.accumulate(optax.adam(1e-2), 3))
    params = init_params()
    calls = _count_checks(monkeypatch)
    jax.jit(lambda p, s, g: ga.apply_gradients(tx, g, s, p)).lower(params, tx.init(params), params)
    assert len(calls) == passes


def test_receipt_vouches_only_for_the_same_leaves():
    receipt = _fused.Receipt()
    tree = {"a": jnp.ones(2), "b": jnp.zeros(3)}
    flag = jnp.array(True)
    receipt.vouch(tree, flag)
    assert receipt.finite(dict(tree)) is flag  # a new dict, the same arrays
    assert receipt.finite({"a": tree["a"], "b": jnp.zeros(3)}) is None
    assert receipt.finite({"a": tree["a"]}) is None


EXTREME = [
    1.0,  # ordinary, clipped
    np.nan,  # dropped
    3e19,  # finite, but its squares overflow float32: kept, clipped exactly
    np.inf,  # dropped
    0.0,  # kept, zeros
    -np.inf,  # dropped
    1e-3,  # kept, under the bound
]


def _clip_chain_run(step_fn, dtype):
    tx = optax.chain(ga.clip_norm(0.5), ga.accumulate(optax.adam(1e-2), 3))
    params = jax.tree.map(lambda p: p.astype(dtype), init_params())
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: step_fn(tx, g, s, p))
    out = []
    for i, value in enumerate(EXTREME):
        grads = jax.tree.map(lambda p, i=i, value=value: jnp.full_like(p, value), params)
        grads["b1"] = grads["b1"].at[0].set(float(i))  # finite elements beside the value
        params, state = step(params, state, grads)
        out.append((params, state))
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vouched_clip_chain_drops_exactly_what_the_optax_path_drops(dtype):
    fused = _clip_chain_run(ga.apply_gradients, dtype)
    reference = _clip_chain_run(optax_path, dtype)
    assert_bitwise_equal(fused, reference)
    skipped = [int(s[1].num_skipped) for _, s in fused]
    assert skipped == [0, 1, 1, 2, 2, 3, 3]
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(fused[-1]))


# --- the compiled program grows linearly with the number of leaves -------------------


def _layers(n: int) -> dict:
    """`n` transformer-shaped layers of 12 leaves each (width 16)."""
    d = 16
    layer = {
        "q": (d, d),
        "k": (d, d),
        "v": (d, d),
        "o": (d, d),
        "up": {"w": (d, 4 * d), "b": (4 * d,)},
        "down": {"w": (4 * d, d), "b": (d,)},
        "ln1": {"scale": (d,), "bias": (d,)},
        "ln2": {"scale": (d,), "bias": (d,)},
    }
    shapes = {f"layer_{i}": layer for i in range(n)}
    return jax.tree.map(
        lambda s: jnp.full(s, 0.01, jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def _program_size(make, fused: bool, layers: int) -> tuple[int, int]:
    """Instructions of the compiled step, and how many distinct fused computations it calls."""
    tx, params = make(), _layers(layers)
    if fused:
        step = jax.jit(lambda p, s, g: ga.apply_gradients(tx, g, s, p), donate_argnums=(0, 1))
        compiled = step.lower(params, tx.init(params), params).compile()
    else:
        compiled = jax.jit(lambda g: tx.update(g, tx.init(g))[0]).lower(params).compile()
    hlo = harness.Hlo(compiled)

    def body(name: str) -> str:
        # The computation without names and metadata: equal bodies are one program.
        lines = [re.sub(r", metadata=\{.*", "", i.line) for i in hlo.computations[name]]
        return "\n".join(re.sub(r"%[\w.\-]+", "%", line) for line in lines)

    fusions = {body(c) for i in hlo.ops("fusion") for c in re.findall(r"calls=%([\w.\-]+)", i.line)}
    return sum(len(insts) for insts in hlo.computations.values()), len(fusions)


@pytest.mark.slow
@pytest.mark.hlo
@pytest.mark.parametrize(
    "make, fused",
    [
        (lambda: ga.clip_norm(1.0), False),
        (lambda: ga.accumulate(optax.adam(1e-3), 4), True),
        (lambda: optax.chain(ga.clip_norm(1.0), ga.accumulate(optax.adamw(1e-3), 4)), True),
    ],
    ids=["clip_norm", "accumulate", "clip_chain"],
)
def test_compiled_program_grows_linearly_with_the_leaves(make, fused):
    # A scalar reduced over every leaf and read by every leaf (a global norm, a
    # finite flag) that XLA copies into each reader's fusion makes the program
    # grow with the square of the number of leaves: each added layer would then
    # cost more instructions than the one before (SPEC.md section 11).
    sizes = [_program_size(make, fused, layers) for layers in (2, 4, 6)]
    counts = [count for count, _ in sizes]
    first, second = counts[1] - counts[0], counts[2] - counts[1]
    assert abs(second - first) <= 0.02 * first + 8, counts
    # XLA:CPU compiles each distinct fused computation on its own: more layers of the
    # same shapes must not bring new ones (the accumulator's zeros once did, one per leaf).
    # Shapes that follow the number of leaves (the stacked vectors of the finite check's
    # fallback, the vector of per-leaf flags) change a few programs and may make XLA
    # split a reduction one more way: a few, not one per leaf (two layers add 24).
    programs = [distinct for _, distinct in sizes]
    assert programs[2] <= programs[1] + 3, programs
