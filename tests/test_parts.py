"""The inner transformation on a window held in parts (`_window/parts.py`).

Inside `jax.shard_map`, a gradient that varies along the pipeline's `"stage"` axis
besides the window's `axis_name` lies in parts on the stages: what acts element by
element is exact; a global norm of one stage's part is not, and is refused with the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax._window import parts

S, D, H, K = 4, 2, 8, 2
SPECS = {"stages": P("stage"), "emb": P()}


def _mesh():
    return jax.make_mesh((S, D), ("stage", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _grads():
    rng = np.random.default_rng(0)
    g_stages = rng.normal(size=(K, D, S, H)).astype(np.float32)
    g_emb = rng.normal(size=(K, D, H)).astype(np.float32)
    return g_stages, g_emb


def _run(inner, check_vma=True, with_state=False, emb=True, **options):
    """Two micro-steps of `accumulate(inner, 2, axis_name="data", **options)`, each data
    shard's gradient split over the stages as a pipeline leaves it; the params after the
    window (and the replica-stacked state); `emb=False` leaves out the stage-invariant leaf."""
    params = {"stages": jnp.zeros((S, H)), "emb": jnp.zeros(H)}
    specs = SPECS
    if not emb:
        params, specs = {"stages": params["stages"]}, {"stages": SPECS["stages"]}
    tx = ga.accumulate(inner, K, axis_name="data", **options)
    shapes = jax.eval_shape(tx.init, params)
    state_specs = jax.tree.map(
        lambda spec, x: P(*spec, "stage") if x.shape == (S, H) else spec,
        ga.replica_state_specs(shapes, "data"),
        shapes,
    )
    mesh = _mesh()

    def step(params, state, g_stages, g_emb):
        grads = {"stages": g_stages[0], "emb": g_emb[0]}  # this data shard's own
        grads = {name: grads[name] for name in params}
        updates, state = tx.update(grads, ga.remove_replica_axis(state), params)
        return optax.apply_updates(params, updates), ga.add_replica_axis(state)

    def mapped(fn, in_specs, out_specs):
        return jax.jit(
            jax.shard_map(
                fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
            )
        )

    step = mapped(step, (specs, state_specs, P("data", "stage"), P("data")), (specs, state_specs))
    state = mapped(lambda p: ga.add_replica_axis(tx.init(p)), (specs,), state_specs)(params)
    g_stages, g_emb = _grads()
    for t in range(K):
        params, state = step(params, state, g_stages[t], g_emb[t])
    return (params, state) if with_state else params


def _large_batch(inner):
    """The same inner step on the whole batch's mean gradient, unsplit."""
    g_stages, g_emb = _grads()
    grads = {"stages": jnp.asarray(g_stages.mean((0, 1))), "emb": jnp.asarray(g_emb.mean((0, 1)))}
    params = {"stages": jnp.zeros((S, H)), "emb": jnp.zeros(H)}
    updates, _ = inner.update(grads, inner.init(params), params)
    return optax.apply_updates(params, updates)


def _close(got, want, rtol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize(
    "inner",
    [
        pytest.param(lambda: optax.adam(0.1), id="adam"),
        pytest.param(lambda: optax.chain(optax.scale_by_lion(), optax.scale(-0.1)), id="lion"),
    ],
)
def test_element_by_element_inner_transforms_are_exact_on_parts(inner):
    # Measured: equal to float32 round-off.
    _close(_run(inner()), _large_batch(inner()), rtol=1e-6)


@pytest.mark.parametrize(
    ("inner", "origin"),
    [
        pytest.param(
            lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0)),
            "reduce_sum",
            id="optax.clip_by_global_norm",
        ),
        pytest.param(
            lambda: optax.chain(ga.clip_norm(0.5), optax.sgd(1.0)), "reduce", id="ga.clip_norm"
        ),
        pytest.param(
            lambda: optax.chain(optax.apply_if_finite(optax.sgd(1.0), 3)),
            "reduce",
            id="optax.apply_if_finite",
        ),
    ],
)
def test_a_reduction_of_one_stages_part_is_refused_with_the_fix(inner, origin):
    # Without the check: each stage clipped by its own part's norm (the step was 0.4
    # relative off the large batch's for the global-norm clip).
    with pytest.raises(
        ValueError, match=r"lies in parts on the devices of mesh axes \['stage'\]"
    ) as info:
        _run(inner())
    message = str(info.value)
    assert origin in message and "jax.lax.psum(x, ('stage',))" in message
    assert "global-view jax.jit" in message


def test_with_every_leaf_split_over_the_stages_the_refusal_is_the_only_signal():
    # No stage-invariant leaf: JAX's own out_specs check has nothing to catch, and without
    # this check the clipped step ran silently, 0.91 relative off the large batch's.
    with pytest.raises(ValueError, match="lies in parts"):
        _run(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0)), emb=False)


def test_unchecked_types_are_not_checked_and_give_each_stage_its_own_norm():
    # check_vma=False: no types, nothing to read the parts from (documented): the stage
    # parts are clipped by their own norms, which differs from the large batch.
    inner = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0))
    got, want = _run(inner, check_vma=False), _large_batch(inner)
    assert not np.allclose(got["stages"], want["stages"], rtol=1e-3)


def test_the_noise_scale_of_a_window_in_parts_is_the_whole_gradients():
    # Each micro-gradient's squared norm and the window's are summed over the stages'
    # parts: the estimate equals one device accumulating the K x D whole micro-gradients
    # (before, each stage measured its own part: with types checked JAX refused the
    # stage-varying state, without them each stage held its own estimate).
    _, state = _run(optax.sgd(0.1), with_state=True, track_noise_scale=True)
    got = ga.gradient_noise_scale(state)  # one value per replica, equal
    g_stages, g_emb = _grads()
    tx = ga.accumulate(optax.sgd(0.1), K * D, track_noise_scale=True)
    params = {"stages": jnp.zeros((S, H)), "emb": jnp.zeros(H)}
    ref = tx.init(params)
    for t in range(K):
        for d in range(D):
            _, ref = tx.update({"stages": g_stages[t, d], "emb": g_emb[t, d]}, ref, params)
    want = ga.gradient_noise_scale(ref)
    assert np.isfinite(want.grad_sq_norm) and np.isfinite(want.trace_cov)
    for field in ("grad_sq_norm", "trace_cov"):
        np.testing.assert_allclose(getattr(got, field), [getattr(want, field)] * D, rtol=1e-5)


class _StageClip(optax.GradientTransformation):
    """Clips by the whole gradient's norm, summing the stage parts' squares with psum."""

    def __new__(cls, max_norm):
        def init(params):
            del params
            return optax.EmptyState()

        def update(updates, state, params=None):
            del params
            squares = jax.lax.psum(jnp.sum(updates["stages"] ** 2), "stage")
            norm = jnp.sqrt(squares + jnp.sum(updates["emb"] ** 2))
            scale = jnp.minimum(1.0, max_norm / norm)
            return jax.tree.map(lambda u: u * scale, updates), state

        return super().__new__(cls, init, update)


def test_a_norm_completed_with_psum_over_the_stages_passes_and_is_exact():
    # The fix the refusal names: the partial squares summed over "stage" are the whole
    # gradient's; the step equals clip_by_global_norm on the unsplit mean gradient.
    got = _run(optax.chain(_StageClip(0.5), optax.sgd(1.0)))
    want = _large_batch(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0)))
    _close(got, want, rtol=1e-5)


def _check_in_shard_map(fn):
    """Runs `parts.check_elementwise(fn, (x,))` on a stage part inside `jax.shard_map`."""

    def body(x):
        parts.check_elementwise(fn, (x,))
        return x

    mapped = jax.shard_map(body, mesh=_mesh(), in_specs=P("stage"), out_specs=P("stage"))
    jax.jit(mapped).lower(jnp.ones((S, H))).compile()


@pytest.mark.parametrize(
    ("fn", "refused"),
    [
        pytest.param(lambda x: x * 2.0 + jnp.tanh(x), False, id="elementwise"),
        pytest.param(lambda x: x / jax.lax.psum(jnp.sum(x), "stage"), False, id="completed"),
        pytest.param(lambda x: x / jnp.sum(x), True, id="reduced"),
        pytest.param(lambda x: jax.jit(lambda y: y.max())(x) + x, True, id="inside a call"),
        pytest.param(
            lambda x: jax.lax.cond(jnp.all(x > 0), lambda: x, lambda: -x), True, id="cond on a part"
        ),
        pytest.param(
            lambda x: jax.lax.scan(lambda c, r: (c + r * jnp.sum(r), None), x[0] * 0, x)[0] + x,
            True,
            id="scan carry",
        ),
        pytest.param(
            lambda x: jax.lax.fori_loop(0, 3, lambda i, c: c * 0.5, x),
            False,
            id="loop, elementwise",
        ),
        pytest.param(
            lambda x: jax.lax.while_loop(lambda c: c.sum() > 1.0, lambda c: c * 0.5, x),
            True,
            id="loop decided on a part",
        ),
    ],
)
def test_the_parts_are_followed_through_calls_and_control_flow(fn, refused):
    if refused:
        with pytest.raises(ValueError, match="lies in parts"):
            _check_in_shard_map(fn)
    else:
        _check_in_shard_map(fn)


def test_nothing_is_traced_where_no_leaf_varies():
    # Outside shard_map (and under global view): no varying types, no second trace.
    calls = []

    def fn(x):
        calls.append(1)
        return x / jnp.sum(x)

    parts.check_elementwise(fn, (jnp.ones(3),))
    assert calls == []
