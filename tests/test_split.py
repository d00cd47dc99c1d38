"""Tests for split_accumulate (positive/negative components, bounds) and clamp_params."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._window import split as _split


def run(tx, params, inputs):
    """Feeds ``inputs`` through a jitted ``tx.update``; returns the outputs and final state."""
    update = jax.jit(tx.update)
    state = tx.init(params)
    outputs = []
    for x in inputs:
        u, state = update(x, state, params)
        outputs.append(u)
    return outputs, state


@pytest.mark.slow
def test_no_bound_sum_equals_plain_sum_accumulation():
    params = {"w": jnp.zeros((4, 5)), "b": jnp.zeros(5)}
    key = jax.random.key(0)
    inputs = []
    for _ in range(9):
        key, kw, kb = jax.random.split(key, 3)
        inputs.append({"w": jax.random.normal(kw, (4, 5)), "b": jax.random.normal(kb, (5,))})
    split_out, split_state = run(ga.split_accumulate(3), params, inputs)
    plain = ga.accumulate(optax.identity(), 3, use_grad_mean=False)
    plain_out, _ = run(plain, params, inputs)
    for a, b in zip(jax.tree.leaves(split_out), jax.tree.leaves(plain_out), strict=True):
        # Σmax(u, 0) - Σmax(-u, 0) rounds differently from Σu: a few ulps.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(split_state.gradient_step) == 3
    # With values whose sums are exact, the two agree bit for bit.
    dyadic = [jax.tree.map(lambda x: jnp.round(x * 8) / 8, u) for u in inputs]
    split_out, _ = run(ga.split_accumulate(3), params, dyadic)
    plain_out, _ = run(plain, params, dyadic)
    for a, b in zip(jax.tree.leaves(split_out), jax.tree.leaves(plain_out), strict=True):
        np.testing.assert_array_equal(a, b)


def test_mean_without_bound_equals_mean_accumulation():
    params = {"w": jnp.zeros(6)}
    inputs = [{"w": jax.random.normal(jax.random.key(i), (6,))} for i in range(4)]
    out, _ = run(ga.split_accumulate(4, reduction="mean"), params, inputs)
    ref, _ = run(ga.accumulate(optax.identity(), 4), params, inputs)
    np.testing.assert_allclose(out[-1]["w"], ref[-1]["w"], rtol=1e-5, atol=1e-7)


def test_sign_split_by_hand_and_zeros_between_boundaries():
    params = {"w": jnp.zeros(3)}
    rows = [[1.0, -2.0, 4.0], [3.0, -1.0, -4.0], [-2.0, 5.0, 2.0], [6.0, -3.0, 1.0]]
    inputs = [{"w": jnp.array(r)} for r in rows]
    out, _ = run(ga.split_accumulate(4, reduction="max"), params, inputs)
    for u in out[:3]:
        np.testing.assert_array_equal(u["w"], jnp.zeros(3))
    # P = max of positive parts [6, 5, 4]; N = max of negative magnitudes [2, 3, 4].
    np.testing.assert_array_equal(out[3]["w"], [4.0, 2.0, 0.0])


# Paired inputs, window of 4. Columns: positive [1,4,16,1], [2,8,2,4], [4,1,2,8];
# negative [2,2,8,4], [1,4,1,16], [1,1,0,2].
POS = [[1.0, 2.0, 4.0], [4.0, 8.0, 1.0], [16.0, 2.0, 2.0], [1.0, 4.0, 8.0]]
NEG = [[2.0, 1.0, 1.0], [2.0, 4.0, 1.0], [8.0, 1.0, 0.0], [4.0, 16.0, 2.0]]
ROOT4_64, ROOT4_128 = 64.0**0.25, 128.0**0.25


def _value_range(values, valid):
    high = jnp.max(values, axis=0, where=valid, initial=-jnp.inf)
    low = jnp.min(values, axis=0, where=valid, initial=jnp.inf)
    return high - low


@pytest.mark.parametrize(
    ("reduction", "expected"),
    [
        ("sum", [22 - 16, 16 - 22, 15 - 4]),
        ("mean", [5.5 - 4.0, 4.0 - 5.5, 3.75 - 1.0]),
        ("max", [16 - 8, 8 - 16, 8 - 2]),
        ("min", [1 - 2, 2 - 1, 1 - 0]),
        ("geometric_mean", [ROOT4_64 - ROOT4_128, ROOT4_128 - ROOT4_64, ROOT4_64 - 0.0]),
        ("median", [2.5 - 3.0, 3.0 - 2.5, 3.0 - 1.0]),
        (_value_range, [15 - 6, 6 - 15, 7 - 2]),
    ],
)
def test_reductions_by_hand(reduction, expected):
    params = {"w": jnp.zeros(3)}
    tx = ga.split_accumulate(4, reduction=reduction, paired=True)
    inputs = [({"w": jnp.array(p)}, {"w": jnp.array(n)}) for p, n in zip(POS, NEG, strict=True)]
    out, state = run(tx, params, inputs)
    np.testing.assert_allclose(out[-1]["w"], expected, rtol=1e-6)
    assert int(state.positive_count) == int(state.negative_count) == 0  # reset
    assert int(state.gradient_step) == 1


# Window of 1, P = 0.4 and N = 0.2 everywhere, limits [-1, 1], exponents
# mu+ = 2 and mu- = 0.5. Params: inside, exactly at the upper and lower
# limits, and outside above and below.
P_VALUES = [0.5, 1.0, -1.0, 1.5, -1.5]
BOUND_CASES = {
    "power": [
        0.25 * 0.4 - 1.5**0.5 * 0.2,
        0.0 - 2**0.5 * 0.2,
        4.0 * 0.4 - 0.0,
        -0.25 * 0.4 - 2.5**0.5 * 0.2,
        6.25 * 0.4 + 0.5**0.5 * 0.2,
    ],
    "scaled_power": [
        0.0625 * 0.4 - 0.75**0.5 * 0.2,
        0.0 - 1.0 * 0.2,
        1.0 * 0.4 - 0.0,
        -0.0625 * 0.4 - 1.25**0.5 * 0.2,
        1.5625 * 0.4 + 0.5 * 0.2,
    ],
    "multiplicative": [-0.1, -0.4, 0.8, -0.7, 1.1],
    "scaled_multiplicative": [-0.05, -0.2, 0.4, -0.35, 0.55],
    # Θ(0) = 0: no positive push at the upper limit, no negative one at the lower.
    "sharp": [0.2, -0.2, 0.4, -0.2, 0.4],
}


@pytest.mark.parametrize("bound", sorted(BOUND_CASES))
def test_bounds_by_hand_including_params_at_the_limits(bound):
    exponents = {}
    if "power" in bound:
        exponents = {"upper_exponent": 2.0, "lower_exponent": 0.5}
    tx = ga.split_accumulate(1, bound=bound, lower=-1.0, upper=1.0, paired=True, **exponents)
    params = {"w": jnp.array(P_VALUES)}
    pair = ({"w": jnp.full(5, 0.4)}, {"w": jnp.full(5, 0.2)})
    out, _ = run(tx, params, [pair])
    np.testing.assert_allclose(out[0]["w"], BOUND_CASES[bound], rtol=1e-6, atol=1e-7)


def test_one_sided_bounds_and_exponent_one_is_multiplicative():
    params = {"w": jnp.array([0.5, 1.0])}
    pair = ({"w": jnp.full(2, 0.4)}, {"w": jnp.full(2, 0.2)})
    upper_only, _ = run(
        ga.split_accumulate(1, bound="power", upper=1.0, upper_exponent=2.0, paired=True),
        params,
        [pair],
    )
    np.testing.assert_allclose(upper_only[0]["w"], [0.25 * 0.4 - 0.2, -0.2], rtol=1e-6)
    lower_only, _ = run(
        ga.split_accumulate(1, bound="sharp", lower=1.0, paired=True), params, [pair]
    )
    np.testing.assert_allclose(lower_only[0]["w"], [0.4, 0.4], rtol=1e-6)  # Θ(0) at p = 1
    power, _ = run(
        ga.split_accumulate(1, bound="power", lower=-1.0, upper=1.0, paired=True), params, [pair]
    )
    mult, _ = run(
        ga.split_accumulate(1, bound="multiplicative", lower=-1.0, upper=1.0, paired=True),
        params,
        [pair],
    )
    np.testing.assert_allclose(power[0]["w"], mult[0]["w"], rtol=1e-6)


@pytest.mark.parametrize("reduction", ["max", "min", "mean", "geometric_mean", "median"])
@pytest.mark.slow
def test_empty_components_reduce_to_zero(reduction):
    params = {"w": jnp.array([0.2, 0.8])}
    tx = ga.split_accumulate(3, reduction=reduction, bound="multiplicative", upper=1.0, paired=True)
    pos = {"w": jnp.array([2.0, 2.0])}
    # The negative component never receives anything in this window, and one
    # call brings no component at all.
    out, state = run(tx, params, [(pos, None), (None, None), (pos, None)])
    np.testing.assert_allclose(out[-1]["w"], [0.8 * 2.0, 0.2 * 2.0], rtol=1e-6)
    # A window where only the negative component is fed: -N, P empty.
    out, state = run(tx, params, [(None, pos), (None, pos), (None, None)])
    np.testing.assert_allclose(out[-1]["w"], [-2.0, -2.0], rtol=1e-6)
    assert int(state.gradient_step) == 1


def test_nonfinite_calls_are_dropped_and_counted():
    params = {"w": jnp.zeros(3)}
    inputs = [
        {"w": jnp.array([1.0, -1.0, 2.0])},
        {"w": jnp.array([jnp.nan, 5.0, 5.0])},
        {"w": jnp.array([3.0, -3.0, jnp.inf])},
        {"w": jnp.array([2.0, 0.5, -1.0])},
    ]
    out, state = run(ga.split_accumulate(4), params, inputs)
    np.testing.assert_array_equal(out[-1]["w"], [3.0, -0.5, 1.0])
    assert int(state.num_skipped) == 2
    assert bool(jnp.all(jnp.isfinite(state.positive["w"])))
    # The median of the two accepted calls (an even count: the mean of both).
    out, state = run(ga.split_accumulate(4, reduction="median"), params, inputs)
    np.testing.assert_array_equal(out[-1]["w"], [1.5, -0.25, 0.5])
    # A window with nothing accepted returns zeros and applies no update.
    bad = {"w": jnp.array([jnp.nan, 0.0, 0.0])}
    out, state = run(ga.split_accumulate(2), params, [bad, bad])
    np.testing.assert_array_equal(out[-1]["w"], jnp.zeros(3))
    assert int(state.gradient_step) == 0 and int(state.micro_step) == 0


def test_median_of_an_odd_count():
    params = {"w": jnp.zeros(2)}
    inputs = [{"w": jnp.array(r)} for r in ([5.0, -1.0], [1.0, -7.0], [3.0, -2.0])]
    out, _ = run(ga.split_accumulate(3, reduction="median"), params, inputs)
    # P columns [5, 1, 3] and [0, 0, 0]; N columns [0, 0, 0] and [1, 7, 2].
    np.testing.assert_array_equal(out[-1]["w"], [3.0, -2.0])


def test_geometric_mean_rejects_negative_paired_magnitudes():
    params = {"w": jnp.zeros(2)}
    tx = ga.split_accumulate(2, reduction="geometric_mean", paired=True)
    good = ({"w": jnp.array([4.0, 1.0])}, {"w": jnp.array([1.0, 1.0])})
    negative = ({"w": jnp.array([-4.0, 1.0])}, {"w": jnp.array([1.0, 1.0])})
    out, state = run(tx, params, [good, negative])
    np.testing.assert_allclose(out[-1]["w"], [3.0, 0.0], rtol=1e-6)
    assert int(state.num_skipped) == 1


def test_schedule_changes_the_window_length():
    params = {"w": jnp.zeros(1)}
    tx = ga.split_accumulate(lambda step: jnp.where(step == 0, 2, 3))
    inputs = [{"w": jnp.array([float(i)])} for i in range(1, 6)]
    out, state = run(tx, params, inputs)
    values = [float(u["w"][0]) for u in out]
    assert values == [0.0, 3.0, 0.0, 0.0, 12.0]
    assert int(state.gradient_step) == 2


@pytest.mark.parametrize("reduction", ["geometric_mean", "median"])
@pytest.mark.slow
def test_scan_keeps_state_dtypes(reduction):
    params = {"w": jnp.full((3,), 0.5, jnp.bfloat16), "b": jnp.zeros(2)}
    tx = ga.split_accumulate(
        3, reduction=reduction, bound="scaled_power", lower=0.0, upper=1.0, upper_exponent=1.5
    )
    key = jax.random.key(3)
    xs = {
        "w": jax.random.normal(key, (7, 3)).astype(jnp.bfloat16),
        "b": jax.random.normal(jax.random.fold_in(key, 1), (7, 2)),
    }

    def body(carry, x):
        p, s = carry
        u, s = tx.update(x, s, p)
        return (optax.apply_updates(p, u), s), None

    state0 = tx.init(params)
    (p_scan, s_scan), _ = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))((params, state0), xs)
    kinds = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    assert kinds(state0) == kinds(s_scan)
    assert s_scan.positive["w"].dtype == jnp.float32  # bfloat16 summed in float32
    carry = (params, state0)
    step = jax.jit(body)
    for i in range(7):
        carry, _ = step(carry, jax.tree.map(lambda x, i=i: x[i], xs))
    for a, b in zip(jax.tree.leaves(p_scan), jax.tree.leaves(carry[0]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert p_scan["w"].dtype == jnp.bfloat16


@pytest.mark.hlo
def test_gate_keeps_no_copies_or_extra_temporaries():
    # With donation the components are updated in place and the positive and
    # negative parts are fused where they are used: the only parameter-sized
    # temporary is the update that the boundary branch returns.
    big = {"w": jnp.full((256, 256), 0.5)}
    tx = ga.split_accumulate(
        4, reduction="geometric_mean", bound="power", lower=0.0, upper=1.0, upper_exponent=2.0
    )

    def step(state, params, updates):
        updates, state = tx.update(updates, state, params)
        return state, optax.apply_updates(params, updates)

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(tx.init(big), big, big).compile()
    assert [c.line for c in harness.Hlo(compiled).copies(big["w"].size)] == []
    assert harness.compiled_memory(compiled).temp_bytes < 2 * big["w"].nbytes


def test_construction_and_trace_errors():
    with pytest.raises(ValueError, match="reduction must be one of"):
        ga.split_accumulate(2, reduction="harmonic")
    with pytest.raises(ValueError, match="bound must be one of"):
        ga.split_accumulate(2, bound="soft", upper=1.0)
    with pytest.raises(ValueError, match="needs a limit"):
        ga.split_accumulate(2, bound="power")
    with pytest.raises(ValueError, match="needs both limits"):
        ga.split_accumulate(2, bound="scaled_multiplicative", upper=1.0)
    with pytest.raises(ValueError, match=r"lower must be < upper; got lower=1.0, upper=0.0"):
        ga.split_accumulate(2, bound="sharp", upper=0.0, lower=1.0)
    with pytest.raises(ValueError, match=r"upper_exponent=2\.0 applies only to the power"):
        ga.split_accumulate(2, bound="sharp", upper=1.0, upper_exponent=2.0)
    with pytest.raises(ValueError, match="lower_exponent must be finite and > 0"):
        ga.split_accumulate(2, bound="power", lower=0.0, lower_exponent=0.0)
    with pytest.raises(ValueError, match=r"upper=1\.0 given with bound=None"):
        ga.split_accumulate(2, upper=1.0)
    with pytest.raises(ValueError, match="fixed window length"):
        ga.split_accumulate(lambda step: 2, reduction="median")
    with pytest.raises(ValueError, match="every_k_schedule must be an int >= 1"):
        ga.split_accumulate(0)
    params = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
    tx = ga.split_accumulate(2, bound="sharp", upper=1.0)
    state = tx.init(params)
    with pytest.raises(ValueError, match="params=None"):
        tx.update(params, state)
    with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(2,\)"):
        tx.update({"w": jnp.zeros(2), "b": jnp.zeros(2)}, state, params)
    paired = ga.split_accumulate(2, paired=True)
    with pytest.raises(TypeError, match=r"pair \(positive, negative\)"):
        paired.update(params, paired.init(params), params)
    custom = ga.split_accumulate(2, reduction=lambda v, ok: v)
    with pytest.raises(ValueError, match="must return the shape of one contribution"):
        custom.update(params, custom.init(params), params)


def test_clamp_params_by_hand_inf_and_nan():
    tx = ga.clamp_params(-1.0, 1.0)
    params = {"w": jnp.array([0.0, 0.5, -0.5, 2.0, 0.0, 0.0])}
    updates = {"w": jnp.array([0.25, 1.0, -1.0, 0.0, jnp.inf, jnp.nan])}
    u, _ = jax.jit(tx.update)(updates, tx.init(params), params)
    new = optax.apply_updates(params, u)["w"]
    # A parameter outside the box is moved in even by a zero update.
    np.testing.assert_array_equal(new[:5], [0.25, 1.0, -1.0, 1.0, 1.0])
    assert bool(jnp.isnan(new[5]))  # NaN is not hidden
    one_sided = ga.clamp_params(None, 0.0)
    u, _ = one_sided.update({"w": jnp.array([5.0, -5.0])}, optax.EmptyState(), {"w": jnp.zeros(2)})
    np.testing.assert_array_equal(u["w"], [0.0, -5.0])


def test_clamp_params_errors():
    with pytest.raises(ValueError, match="needs a limit"):
        ga.clamp_params(None, None)
    with pytest.raises(ValueError, match=r"lower must be <= upper; got lower=2.0, upper=1.0"):
        ga.clamp_params(2.0, 1.0)
    with pytest.raises(ValueError, match="lower must be finite"):
        ga.clamp_params(float("nan"), 1.0)
    tx = ga.clamp_params(0.0, 1.0)
    with pytest.raises(ValueError, match="params=None"):
        tx.update({"w": jnp.zeros(2)}, optax.EmptyState())
    narrow = ga.clamp_params(0.1, 0.1000001)
    p = {"w": jnp.zeros(2, jnp.bfloat16)}
    with pytest.raises(ValueError, match="holds no value of dtype bfloat16"):
        narrow.update(p, optax.EmptyState(), p)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clamp_params_lands_inside_whenever_any_addition_can(dtype):
    lo, hi = 1e-3, 3.3
    rng = np.random.default_rng(0)
    n = 20000
    p = rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-8, 3, n)
    inside = rng.uniform(size=n) < 0.5
    p[inside] = rng.uniform(lo, hi, inside.sum())
    u = rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-10, 4, n)
    params = {"w": jnp.asarray(p, dtype)}
    tx = ga.clamp_params(lo, hi)
    delta, _ = jax.jit(tx.update)({"w": jnp.asarray(u, dtype)}, optax.EmptyState(), params)
    new = np.asarray(optax.apply_updates(params, delta)["w"], np.float64)
    outside = (new < lo) | (new > hi)
    p_used = np.asarray(params["w"], np.float64)
    was_inside = (p_used >= lo) & (p_used <= hi)
    assert not np.any(outside & was_inside)
    # ... and they land within rounding of the clipped sum (the last-resort
    # "stay put" is never what kept them inside).
    target = np.clip(p_used + np.asarray(jnp.asarray(u, dtype), np.float64), lo, hi)
    slack = 4 * float(jnp.finfo(dtype).eps) * np.maximum(np.abs(target), np.abs(p_used))
    assert np.all(np.abs(new - target)[was_inside] <= slack[was_inside])
    # Elsewhere a miss must be unavoidable: p + d is monotone in d, so if d
    # lands below the box and the next float above d lands above it (or the
    # reverse), no addition lands inside.
    w = params["w"][outside]
    d = delta["w"][outside]
    toward = jnp.where(jnp.asarray(new[outside] < lo), jnp.inf, -jnp.inf).astype(dtype)
    beside = np.asarray(optax.apply_updates(w, jnp.nextafter(d, toward)), np.float64)
    below = new[outside] < lo
    assert np.all(np.where(below, beside > hi, beside < lo))


def test_clamp_after_split_accumulate_keeps_params_in_the_box():
    # The soft sharp bound overshoots the upper limit from just below it;
    # clamp_params catches that.
    tx = optax.chain(
        ga.split_accumulate(2, bound="sharp", lower=0.0, upper=1.0), ga.clamp_params(0.0, 1.0)
    )
    params = {"w": jnp.array([0.95, 0.05, 0.5])}
    step = jax.jit(tx.update)
    state = tx.init(params)
    for i in range(6):
        g = {"w": jnp.array([0.3, -0.3, 0.2 * (-1) ** i])}
        u, state = step(g, state, params)
        params = optax.apply_updates(params, u)
        assert bool(jnp.all((params["w"] >= 0.0) & (params["w"] <= 1.0)))
    np.testing.assert_array_equal(params["w"][:2], [1.0, 0.0])


def test_docstring_examples():
    result = doctest.testmod(_split, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------------- #
# clamp_params regressions (issue 18 items 6 and 7)                            #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("lower", "upper", "p", "u"),
    [(1e-40, 1.0, 0.5, -1.0), (-1.0, -1e-40, -0.5, 1.0), (0.0, 1e-40, 0.5, 1.0)],
)
def test_clamp_params_keeps_the_box_for_subnormal_limits(lower, upper, p, u):
    tx = ga.clamp_params(lower, upper)
    params = {"w": jnp.array([p])}
    step = jax.jit(lambda g, q: optax.apply_updates(q, tx.update(g, tx.init(q), q)[0]))
    landed = float(step({"w": jnp.array([u])}, params)["w"][0])
    assert lower <= landed <= upper, landed


def test_clamp_params_refuses_boxes_and_params_it_cannot_keep():
    params = {"w": jnp.array([0.5])}
    tx = ga.clamp_params(1e-40, 2e-40)
    with pytest.raises(ValueError, match=r"no value of dtype float32 \(subnormal values do not"):
        tx.update(params, tx.init(params), params)
    tx = ga.clamp_params(0.0, 1.0)
    complex_params = {"w": jnp.array([0.5 + 0.5j])}
    with pytest.raises(TypeError, match=r"has dtype complex64, which has no order.*optax\.masked"):
        tx.update(complex_params, tx.init(complex_params), complex_params)
