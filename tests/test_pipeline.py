"""`pipeline_value_and_grad`: pipeline stages and micro-batches in one schedule.

Every schedule is checked against `jax.value_and_grad` of the unstaged model on the
whole batch (float64, 1e-12; float32, 1e-5) at N < S, N = S and N >> S, on every
route (the user's `shard_map`, global view on Auto and Explicit meshes, with and
without `jax.set_mesh`), with tied weights, token weights, aux, keys and remat; the
compiled program is checked for where its collectives are, and bubble slots for not
leaking into the gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._pipeline import executor

P = jax.P
S, D, H, V_IN = 4, 2, 8, 5
EXPLICIT, AUTO = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("circular", 2)]


def stage_fn(w, x):
    """Two residual tanh layers (the stage params carry a per-stage layer axis)."""

    def layer(x, p):
        return x + jnp.tanh(x @ p["w"] + p["b"]), None

    return jax.lax.scan(layer, x, w)[0]


def embed_fn(outer, batch):
    return batch["x"] @ outer["emb"]


def tied_loss(outer, y, batch):
    """The embedding's transpose as the head: the tied weight gets both uses' gradients."""
    return jnp.mean((y @ outer["emb"].T - batch["y"]) ** 2)


def make_params(v=1, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    layers = {
        "w": rng.normal(size=(2 * S * v, H, H)) / 3,
        "b": rng.normal(size=(2 * S * v, H)) / 3,
    }
    layers = jax.tree.map(lambda x: jnp.asarray(x, dtype), layers)
    return {
        "stages": ga.stack_stages(layers, S, v),
        "emb": jnp.asarray(rng.normal(size=(V_IN, H)) / 2, dtype),
    }


def make_batch(rows, dtype=jnp.float32, seed=1):
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(rows, V_IN)), dtype),
        "y": jnp.asarray(rng.normal(size=(rows, V_IN)), dtype),
    }


def mesh(axis_type=EXPLICIT):
    return jax.make_mesh((S, D), ("stage", "data"), axis_types=(axis_type, axis_type))


def rel_error(got, want):
    def one(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)

    return max(
        float(one(a, b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def global_view(grad_fn, params, batch, axis_type=EXPLICIT, *args):
    with jax.set_mesh(mesh(axis_type)):
        return jax.jit(grad_fn)(params, batch, *args)


# ----------------------------------------------------------------------------- exactness


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
@pytest.mark.parametrize("n", [S - 1, S, 2 * S, 8 * S])
def test_every_schedule_equals_the_whole_batch_in_float64(schedule, v, n, x64):
    with x64():
        params, batch = make_params(v, jnp.float64), make_batch(2 * D * n, jnp.float64)
        grad_fn = ga.pipeline_value_and_grad(
            stage_fn,
            tied_loss,
            embed_fn=embed_fn,
            num_microbatches=n,
            schedule=schedule,
            num_chunks=v,
        )
        want = jax.jit(jax.value_and_grad(grad_fn.sequential))(params, batch)
        got = global_view(grad_fn, params, batch)
        assert rel_error(got, want) < 1e-12


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
def test_every_schedule_equals_the_whole_batch_in_float32(schedule, v):
    n = 2 * S
    params, batch = make_params(v), make_batch(2 * D * n)
    grad_fn = ga.pipeline_value_and_grad(
        stage_fn,
        tied_loss,
        embed_fn=embed_fn,
        num_microbatches=n,
        schedule=schedule,
        num_chunks=v,
    )
    want = jax.jit(jax.value_and_grad(grad_fn.sequential))(params, batch)
    got = global_view(grad_fn, params, batch)
    assert rel_error(got, want) < 1e-5
    # The stage gradients come back split over the stage axis, like the params.
    assert jax.typeof(got[1]["stages"]["w"]).sharding.spec[0] == "stage"


# ----------------------------------------------------------------------------- routes


def _route(route, grad_fn, params, batch):
    if route == "auto":
        return global_view(grad_fn, params, batch, AUTO)
    if route == "explicit":
        return global_view(grad_fn, params, batch, EXPLICIT)
    m = mesh(EXPLICIT)
    if route == "explicit, no set_mesh":  # the mesh read from the arguments' shardings
        params = jax.device_put(params, jax.NamedSharding(m, P()))
        batch = jax.device_put(batch, jax.NamedSharding(m, P("data")))
        return jax.jit(grad_fn)(params, batch)
    assert route == "shard_map"
    specs = {"stages": P("stage"), "emb": P()}
    inner = ga.pipeline_value_and_grad(
        stage_fn,
        tied_loss,
        embed_fn=embed_fn,
        num_microbatches=grad_fn.schedule(S).num_microbatches,
        schedule=grad_fn.schedule(S).name,
        num_chunks=grad_fn.schedule(S).num_chunks,
        axis_name="data",
    )
    mapped = jax.shard_map(inner, mesh=m, in_specs=(specs, P("data")), out_specs=(P(), specs))
    params = {k: jax.device_put(x, jax.NamedSharding(m, specs[k])) for k, x in params.items()}
    batch = jax.device_put(batch, jax.NamedSharding(m, P("data")))
    return jax.jit(mapped)(params, batch)


ROUTES = [
    "shard_map",
    pytest.param("auto", marks=pytest.mark.slow),
    pytest.param("explicit", marks=pytest.mark.slow),  # the schedule tests run it too
    "explicit, no set_mesh",
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved", 2)])
def test_every_route_equals_the_whole_batch(route, schedule, v):
    n = S + 1
    params, batch = make_params(v), make_batch(2 * D * n)
    grad_fn = ga.pipeline_value_and_grad(
        stage_fn,
        tied_loss,
        embed_fn=embed_fn,
        num_microbatches=n,
        schedule=schedule,
        num_chunks=v,
    )
    want = jax.jit(jax.value_and_grad(grad_fn.sequential))(params, batch)
    assert rel_error(_route(route, grad_fn, params, batch), want) < 1e-5


# ----------------------------------------------------------------------------- options


def masked_sum_loss(outer, y, batch):
    """A token-weighted loss: (sum over kept rows, rows kept), rows kept unevenly."""
    err = jnp.sum((y @ outer["emb"].T - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"])


def test_sum_and_weight_normalises_once_by_the_whole_batch_weight():
    n = 2 * S
    params, batch = make_params(), make_batch(2 * D * n)
    batch["mask"] = jnp.asarray(np.random.default_rng(3).random(2 * D * n) < 0.3, jnp.float32)
    grad_fn = ga.pipeline_value_and_grad(
        stage_fn, masked_sum_loss, embed_fn=embed_fn, num_microbatches=n, sum_and_weight=True
    )

    def whole(params, batch):
        total, weight = grad_fn.sequential(params, batch)
        return total / weight

    want = jax.jit(jax.value_and_grad(whole))(params, batch)
    got = global_view(grad_fn, params, batch)
    assert rel_error(got, want) < 1e-5
    # A mean of micro-batch means is a different number here: the check can fail.
    plain = ga.pipeline_value_and_grad(
        stage_fn,
        lambda o, y, b: whole_ratio(masked_sum_loss(o, y, b)),
        embed_fn=embed_fn,
        num_microbatches=n,
    )
    assert abs(float(global_view(plain, params, batch)[0]) - float(want[0])) > 1e-3


def whole_ratio(pair):
    total, weight = pair
    return total / jnp.maximum(weight, 1.0)


def test_aux_comes_back_as_on_the_whole_batch():
    n = S

    def loss(outer, y, batch):
        err = jnp.sum((y @ outer["emb"].T - batch["y"]) ** 2, axis=-1)
        return jnp.mean(err), {"per_example": err, "max_abs": jnp.max(jnp.abs(y))}

    params, batch = make_params(), make_batch(2 * D * n)
    grad_fn = ga.pipeline_value_and_grad(
        stage_fn, loss, embed_fn=embed_fn, num_microbatches=n, has_aux=True
    )
    (value, aux), grads = global_view(grad_fn, params, batch)
    reference = jax.jit(jax.value_and_grad(grad_fn.sequential, has_aux=True))
    (want_value, want_aux), want_grads = reference(params, batch)
    assert rel_error((value, grads), (want_value, want_grads)) < 1e-5
    # Per example: in batch order; other leaves: the mean over micro-batches.
    np.testing.assert_allclose(aux["per_example"], want_aux["per_example"], rtol=1e-5)
    rows = 2 * n  # per data shard; shard r's micro-batch m holds its rows m, m + n, ...
    sequential = jax.jit(grad_fn.sequential)
    shard = lambda r, m: jax.tree.map(lambda x: x[r * rows : (r + 1) * rows][m::n], batch)  # noqa: E731
    mean_of_maxes = np.mean(
        [float(sequential(params, shard(r, m))[1]["max_abs"]) for r in range(D) for m in range(n)]
    )
    np.testing.assert_allclose(aux["max_abs"], mean_of_maxes, rtol=1e-5)


def dropout_stage(w, x, key):
    keep = jax.random.bernoulli(key, 0.7, x.shape)
    return stage_fn(w, jnp.where(keep, x / 0.7, 0.0))


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("circular", 2)])
def test_keys_draw_the_masks_of_the_microbatched_unstaged_model(schedule, v):
    n = S
    params, batch = make_params(v), make_batch(2 * D * n)
    key = jax.random.key(7)
    grad_fn = ga.pipeline_value_and_grad(
        dropout_stage,
        lambda o, y, b, k: tied_loss(o, y, b),
        embed_fn=lambda o, b, k: embed_fn(o, b),
        num_microbatches=n,
        schedule=schedule,
        num_chunks=v,
        axis_name="data",
    )
    m = mesh()
    specs = {"stages": P("stage"), "emb": P()}
    mapped = jax.shard_map(
        grad_fn, mesh=m, in_specs=(specs, P("data"), P()), out_specs=(P(), specs)
    )
    put = {k: jax.device_put(x, jax.NamedSharding(m, specs[k])) for k, x in params.items()}
    got = jax.jit(mapped)(put, jax.device_put(batch, jax.NamedSharding(m, P("data"))), key)
    # Data shard r is micro-batched with the key folded with r, as the docs say.
    # One compiled program for the 2 x D reference calls below (eagerly, each call compiled
    # its scan again).
    reference = jax.jit(ga.microbatch_value_and_grad(grad_fn.sequential, n))
    rows = 2 * n

    def shard(r):
        return jax.tree.map(lambda x: x[r * rows : (r + 1) * rows], batch)

    shards = [
        reference(
            params,
            shard(r),
            jax.random.fold_in(key, r),
        )
        for r in range(D)
    ]
    want = jax.tree.map(lambda *xs: sum(xs) / D, *shards)
    assert rel_error(got, want) < 1e-5
    # The masks matter: without the key's fold per shard the result differs.
    same_key = jax.tree.map(
        lambda *xs: sum(xs) / D,
        *[reference(params, shard(r), key) for r in range(D)],
    )
    assert rel_error(got, same_key) > 1e-3


def test_remat_of_the_stage_body_keeps_the_result():
    n = S
    params, batch = make_params(), make_batch(2 * D * n)
    plain = ga.pipeline_value_and_grad(stage_fn, tied_loss, embed_fn=embed_fn, num_microbatches=n)
    remat = ga.pipeline_value_and_grad(
        stage_fn, tied_loss, embed_fn=embed_fn, num_microbatches=n, remat=True
    )
    assert rel_error(global_view(remat, params, batch), global_view(plain, params, batch)) < 1e-6


@pytest.mark.parametrize(
    ("schedule", "v"),
    [
        ("gpipe", 1),
        pytest.param("1f1b", 1, marks=pytest.mark.slow),
        ("interleaved", 2),
        pytest.param("circular", 2, marks=pytest.mark.slow),
    ],
)
def test_bubble_slots_never_reach_the_gradients(schedule, v, monkeypatch):
    # The rings start as NaN: a slot that read a place nothing was written to (an idle
    # stage, a spare place) would turn the gradients NaN; 0 x NaN is NaN.
    monkeypatch.setattr(executor, "FILLER", float("nan"))
    n = S - 1
    params, batch = make_params(v), make_batch(2 * D * n)
    grad_fn = ga.pipeline_value_and_grad(
        stage_fn,
        tied_loss,
        embed_fn=embed_fn,
        num_microbatches=n,
        schedule=schedule,
        num_chunks=v,
    )
    got = global_view(grad_fn, params, batch)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(got))
    assert rel_error(got, jax.jit(jax.value_and_grad(grad_fn.sequential))(params, batch)) < 1e-5


def test_sequential_takes_the_stage_params_as_the_pipeline_does():
    # Split over "stage" on an Explicit mesh, the reference still runs on the same arrays.
    m = mesh()
    params, batch = make_params(), make_batch(2 * D * S)
    put = {
        "stages": jax.device_put(params["stages"], jax.NamedSharding(m, P("stage"))),
        "emb": jax.device_put(params["emb"], jax.NamedSharding(m, P())),
    }
    shards = jax.device_put(batch, jax.NamedSharding(m, P("data")))
    grad_fn = ga.pipeline_value_and_grad(stage_fn, tied_loss, embed_fn=embed_fn, num_microbatches=S)
    with jax.set_mesh(m):
        got = jax.jit(jax.value_and_grad(grad_fn.sequential))(put, shards)
    assert rel_error(got, jax.jit(jax.value_and_grad(grad_fn.sequential))(params, batch)) < 1e-6


def test_embed_fn_none_takes_the_first_element_of_a_tuple_batch():
    n = S

    def loss(outer, y, batch):
        return jnp.mean((y @ outer["head"] - batch[1]) ** 2)

    rng = np.random.default_rng(4)
    params = {
        "stages": make_params()["stages"],
        "head": jnp.asarray(rng.normal(size=(H, 1)), jnp.float32),
    }
    batch = (jnp.asarray(rng.normal(size=(2 * D * n, H)), jnp.float32), jnp.ones((2 * D * n, 1)))
    grad_fn = ga.pipeline_value_and_grad(stage_fn, loss, num_microbatches=n)
    got = global_view(grad_fn, params, batch)
    assert rel_error(got, jax.jit(jax.value_and_grad(grad_fn.sequential))(params, batch)) < 1e-5


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("name", "names_the_fix"),
    [
        ("carry_argnums", "microbatch_value_and_grad(..., carry_argnums"),
        ("statistics_fn", "microbatch_value_and_grad(..., statistics_fn"),
        ("coupled", "coupled_value_and_grad"),
        ("weight_fn", "sum_and_weight=True"),
    ],
)
def test_what_it_cannot_do_yet_is_refused_naming_the_alternative(name, names_the_fix):
    with pytest.raises(TypeError, match=f"got {name}=") as err:
        ga.pipeline_value_and_grad(stage_fn, tied_loss, num_microbatches=2, **{name: 0})
    assert names_the_fix in str(err.value)


def test_a_stage_carrying_state_is_refused_naming_the_alternative():
    def batchnorm_like(w, x):
        return stage_fn(w, x), {"mean": jnp.mean(x, 0)}

    grad_fn = ga.pipeline_value_and_grad(
        batchnorm_like, tied_loss, embed_fn=embed_fn, num_microbatches=S
    )
    with pytest.raises(ValueError, match=r"State carried through a stage .* carry_argnums"):
        global_view(grad_fn, make_params(), make_batch(2 * D * S))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_microbatches": 0}, ValueError, "num_microbatches=0: expected an int >= 1"),
        ({"num_microbatches": 2.0}, TypeError, "num_microbatches=2.0"),
        ({"num_microbatches": 2, "schedule": "zb"}, ValueError, "schedule='zb': expected one of"),
        (
            {"num_microbatches": 2, "schedule": "1f1b", "num_chunks": 2},
            ValueError,
            "num_chunks=2 with schedule='1f1b': chunks need schedule='interleaved'",
        ),
        ({"num_microbatches": 2, "remat": "yes"}, TypeError, "remat='yes'"),
        ({"num_microbatches": 2, "bogus": 1}, TypeError, "unexpected keyword argument 'bogus'"),
    ],
)
def test_bad_options_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        ga.pipeline_value_and_grad(stage_fn, tied_loss, **kwargs)


def test_bad_calls_are_refused_with_the_fix():
    grad_fn = ga.pipeline_value_and_grad(stage_fn, tied_loss, embed_fn=embed_fn, num_microbatches=3)
    params, batch = make_params(), make_batch(2 * D * 3)
    with pytest.raises(TypeError, match="expected a mapping with the stacked stage params"):
        global_view(grad_fn, list(params.values()), batch)
    with pytest.raises(ValueError, match=r"not a multiple of 3 \(per data shard\)"):
        global_view(grad_fn, params, make_batch(2 * D * 3 + D))
    with pytest.raises(ValueError, match=r"expected a leading \(4,\) .* ga.stack_stages"):
        global_view(
            grad_fn, {**params, "stages": jax.tree.map(lambda x: x[:2], params["stages"])}, batch
        )
    with pytest.raises(ValueError, match="is not bound and no mesh is known"):
        jax.jit(grad_fn)(params, batch)
    other = jax.make_mesh((8,), ("data",), axis_types=(EXPLICIT,))
    with jax.set_mesh(other), pytest.raises(ValueError, match="not an axis of the mesh"):
        jax.jit(grad_fn)(params, batch)
    growing = ga.pipeline_value_and_grad(
        lambda w, x: jnp.concatenate([x, x], -1), tied_loss, embed_fn=embed_fn, num_microbatches=3
    )
    with pytest.raises(ValueError, match="every stage must return its input's shape"):
        global_view(growing, params, batch)


def test_stage_params_not_split_over_the_stage_axis_are_refused_in_shard_map():
    grad_fn = ga.pipeline_value_and_grad(stage_fn, tied_loss, embed_fn=embed_fn, num_microbatches=2)
    mapped = jax.shard_map(
        grad_fn,
        mesh=mesh(AUTO),
        in_specs=(P(), P("data")),
        out_specs=(P(), P()),
    )
    with pytest.raises(ValueError, match=r"in_specs P\('stage'\) for params\['stages'\]"):
        jax.jit(mapped)(make_params(), make_batch(2 * D * 2))


def test_clipped_grad_refuses_a_pipelined_function():
    grad_fn = ga.pipeline_value_and_grad(stage_fn, tied_loss, embed_fn=embed_fn, num_microbatches=2)
    with pytest.raises(TypeError, match=r"per-example clipping .* pipeline"):
        ga.privacy.clipped_grad(grad_fn, 1.0)


# ----------------------------------------------------------------------------- layout


def test_stack_stages_round_trips_and_lays_virtual_stages_on_the_ring():
    layers = {"w": jnp.arange(24.0).reshape(24, 1)}
    for v in (1, 2, 3):
        stacked = ga.stack_stages(layers, S, v)
        per = 24 // (S * v)
        assert stacked["w"].shape == ((S, per, 1) if v == 1 else (S, v, per, 1))
        back = ga.unstack_stages(stacked, v)
        np.testing.assert_array_equal(back["w"], layers["w"])
        # Virtual stage c = j S + s sits at [s, j] and holds layers c per ... (c + 1) per.
        for c in range(S * v):
            index = (c % S,) if v == 1 else (c % S, c // S)
            np.testing.assert_array_equal(
                stacked["w"][index][:, 0], np.arange(c * per, (c + 1) * per)
            )
    with pytest.raises(ValueError, match="does not split into num_stages"):
        ga.stack_stages(layers, 5)


# ----------------------------------------------------------------------------- compiled


def _expected_permutes(table):
    """Permutes the executor runs: one per direction a phase sends in, every slot."""
    on, back = table.sends()
    return sum((hi - lo) * (f + b) for lo, hi, f, b in executor._phases(on, back))


@pytest.mark.hlo
@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
def test_one_gradient_reduction_per_step_and_the_tables_permutes(schedule, v):
    n = 2 * S
    params, batch = make_params(v), make_batch(2 * D * n)
    grad_fn = ga.pipeline_value_and_grad(
        stage_fn,
        tied_loss,
        embed_fn=embed_fn,
        num_microbatches=n,
        schedule=schedule,
        num_chunks=v,
    )
    with jax.set_mesh(mesh()):
        hlo = harness.Hlo(jax.jit(grad_fn).lower(params, batch).compile())
    # Every all-reduce runs once per call: none inside the schedule's loops.
    assert 1 <= hlo.runs("all-reduce") == len(hlo.ops("all-reduce")) <= 3
    table = grad_fn.schedule(S)
    assert hlo.runs("collective-permute") == _expected_permutes(table)
    if schedule in ("gpipe", "circular"):  # one direction at a time: 2 (vN + S - 1)
        assert _expected_permutes(table) == 2 * (v * n + S - 1)


@pytest.mark.hlo
@pytest.mark.slow
def test_1f1b_temp_is_flat_in_n_and_below_gpipe_at_large_n():
    def temp(schedule, n):
        # Micro-batches of 32 rows per data shard, so stage inputs outweigh the fixed part.
        params, batch = make_params(), make_batch(32 * D * n)
        grad_fn = ga.pipeline_value_and_grad(
            stage_fn, tied_loss, embed_fn=embed_fn, num_microbatches=n, schedule=schedule
        )
        with jax.set_mesh(mesh()):
            compiled = jax.jit(grad_fn).lower(params, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    flat = temp("1f1b", 8 * S) / temp("1f1b", 2 * S)
    assert flat < 1.05
    assert temp("1f1b", 8 * S) < temp("gpipe", 8 * S)


def _window_specs(tx, params):
    """accumulate's state specs: per-replica fields on a "data" axis, stage sums split too."""
    shapes = jax.eval_shape(tx.init, params)
    stage_shapes = {x.shape for x in jax.tree.leaves(params["stages"])}
    return jax.tree.map(
        lambda spec, x: P(*spec, "stage") if x.shape in stage_shapes else spec,
        ga.replica_state_specs(shapes, "data"),
        shapes,
    )


@pytest.mark.hlo
@pytest.mark.slow
@pytest.mark.parametrize("check_vma", [True, False])
def test_with_accumulate_across_calls_the_data_reduction_runs_once_per_window(check_vma):
    # axis_name=None: each data shard's own gradient; accumulate reduces once per window.
    n, k = S, 2
    params = make_params()
    batches = [make_batch(2 * D * n, seed=s) for s in range(k)]
    grad_fn = ga.pipeline_value_and_grad(stage_fn, tied_loss, embed_fn=embed_fn, num_microbatches=n)
    tx = ga.accumulate(optax.sgd(0.1), k, axis_name="data")
    specs = {"stages": P("stage"), "emb": P()}
    m = mesh(AUTO)
    # The window's sums are each data shard's own, and the stage sums split like the params.
    state_specs = _window_specs(tx, params)

    def step(params, state, batch):
        _, grads = grad_fn(params, batch)
        params, state = ga.apply_gradients(tx, grads, ga.remove_replica_axis(state), params)
        return params, ga.add_replica_axis(state)

    # With types checked (the default) the gradients vary over "stage" as well: the
    # window's finite check agrees over it, so the counters and the tied embedding
    # stay invariant; without, each stage decides alone (the same on finite values).
    def shard_map(fn, in_specs, out_specs):
        return jax.jit(
            jax.shard_map(fn, mesh=m, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
        )

    mapped = shard_map(step, (specs, state_specs, P("data")), (specs, state_specs))
    state = shard_map(lambda p: ga.add_replica_axis(tx.init(p)), (specs,), state_specs)(params)
    compiled = mapped.lower(params, state, batches[0]).compile()  # run, and read, once
    p = params
    for batch in batches:
        p, state = compiled(p, state, batch)
    whole = jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)
    want = jax.tree.map(
        lambda a, g: a - 0.1 * g, params, jax.jit(jax.grad(grad_fn.sequential))(params, whole)
    )
    assert rel_error(p, want) < 1e-5
    # The all-reduce over data sits in the window's closing branch only (every call sums
    # the embedding's two uses over "stage", the first and last stages, and with types
    # checked the stages' finite checks over "stage": nothing over "data").
    places = harness.Hlo(compiled).collectives_by_axis(dict(m.shape))
    every_step = [key for key in places if key[0] == "every step" and key[1] == "all-reduce"]
    assert every_step and all("data" not in axes for _, _, axes in every_step)
    assert any(key[0] == "once" and "data" in key[2] for key in places)


def test_with_accumulate_one_stages_non_finite_gradient_drops_the_micro_batch_on_all():
    # Each data shard's gradient lies in parts on the stages; a NaN in one stage's part
    # (data shard 0, stage 1, first micro-step) drops that micro-batch on every stage,
    # the tied embedding's part included, and every stage divides by the same weight.
    k = 2
    rng = np.random.default_rng(3)
    params = {"stages": jnp.zeros((S, H)), "emb": jnp.zeros(H)}
    g_stages = rng.normal(size=(k, D, S, H)).astype(np.float32)
    g_emb = rng.normal(size=(k, D, H)).astype(np.float32)
    g_stages[0, 0, 1, 3] = np.nan
    tx = ga.accumulate(optax.sgd(1.0), k, axis_name="data")
    specs = {"stages": P("stage"), "emb": P()}
    state_specs = _window_specs(tx, params)

    def step(params, state, g_stages, g_emb):
        grads = {"stages": g_stages[0], "emb": g_emb[0]}  # this data shard's own
        updates, state = tx.update(grads, ga.remove_replica_axis(state), params)
        return optax.apply_updates(params, updates), ga.add_replica_axis(state)

    m = mesh(AUTO)
    mapped = jax.jit(
        jax.shard_map(
            step,
            mesh=m,
            in_specs=(specs, state_specs, P("data", "stage"), P("data")),
            out_specs=(specs, state_specs),
        )
    )
    init = jax.shard_map(
        lambda p: ga.add_replica_axis(tx.init(p)), mesh=m, in_specs=(specs,), out_specs=state_specs
    )
    p, state = params, jax.jit(init)(params)
    for t in range(k):
        p, state = mapped(p, state, g_stages[t], g_emb[t])
    kept = [(0, 1), (1, 0), (1, 1)]  # (micro-step, data shard)
    want = {
        "stages": -np.mean([g_stages[i] for i in kept], 0),
        "emb": -np.mean([g_emb[i] for i in kept], 0),
    }
    assert rel_error(p, want) < 1e-6
    assert state.num_skipped.tolist() == [1, 0]


# ----------------------------------------------------------------------------- FSDP


@pytest.mark.hlo
def test_fsdp_params_gathered_once_and_gradients_reduce_scattered_once():
    # (stage 2, data 2, fsdp 2): the stage weights and the tied embedding split over
    # "fsdp" on an Explicit mesh; the batch over data and fsdp.
    m = jax.make_mesh((2, 2, 2), ("stage", "data", "fsdp"), axis_types=(EXPLICIT,) * 3)
    n = 4
    rng = np.random.default_rng(5)
    layers = {
        "w": jnp.asarray(rng.normal(size=(4, H, H)) / 3, jnp.float32),
        "b": jnp.asarray(rng.normal(size=(4, H)) / 3, jnp.float32),
    }
    params = {
        "stages": ga.stack_stages(layers, 2),
        "emb": jnp.asarray(rng.normal(size=(6, H)) / 2, jnp.float32),
    }
    batch = make_batch(2 * 4 * n)
    batch["x"] = jnp.asarray(rng.normal(size=(2 * 4 * n, 6)), jnp.float32)
    batch["y"] = jnp.asarray(rng.normal(size=(2 * 4 * n, 6)), jnp.float32)
    specs = {
        "stages": {"w": P("stage", None, "fsdp"), "b": P("stage", None, "fsdp")},
        "emb": P(None, "fsdp"),
    }
    put = jax.tree.map(lambda x, s: jax.device_put(x, jax.NamedSharding(m, s)), params, specs)
    shards = jax.device_put(batch, jax.NamedSharding(m, P(("data", "fsdp"))))
    grad_fn = ga.pipeline_value_and_grad(stage_fn, tied_loss, embed_fn=embed_fn, num_microbatches=n)
    with jax.set_mesh(m):
        compiled = jax.jit(grad_fn).lower(put, shards).compile()
        got = compiled(put, shards)
    assert rel_error(got, jax.jit(jax.value_and_grad(grad_fn.sequential))(params, batch)) < 1e-5
    # Gradients come back sharded like the params.
    for g, s in zip(jax.tree.leaves(got[1]), jax.tree.leaves(specs), strict=True):
        entries = tuple(jax.typeof(g).sharding.spec)
        assert entries[: len(s)] == tuple(s) and not any(entries[len(s) :])
    hlo = harness.Hlo(compiled)
    for op in ("all-gather", "reduce-scatter", "all-reduce"):
        assert hlo.runs(op) == len(hlo.ops(op)), op  # none inside a loop
    assert len(hlo.ops("reduce-scatter")) >= 1 and len(hlo.ops("all-gather")) >= 1
