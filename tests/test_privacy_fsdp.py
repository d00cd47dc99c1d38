"""Per-example clipping and the noisy window with params sharded for FSDP, under global-view jit.

The mesh is `("data", "fsdp")` (2 x 4 of the 8 forced devices), the kernels sharded over
`"fsdp"` and the bias replicated. `privacy.clipped_grad` must return each clipped sum
sharded like its param, as `jax.value_and_grad` returns a gradient (on an Explicit mesh
in its type), by a reduce-scatter rather than an all-reduce of the whole gradient, and
the DP step built on it must equal one device's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax import privacy

N, D_IN, D_HID, D_OUT = 32, 8, 16, 4
C = 0.5
SPECS = {"w1": P(None, "fsdp"), "b1": P(), "w2": P("fsdp", None)}
AXIS_TYPE = pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
# An FSDP batch is split over both axes; one split over "data" only is split further
# over "fsdp" inside clipped_grad, so that no two devices clip the same examples.
# Ids spelled out: jax before 0.9 writes a PartitionSpec as PartitionSpec(...), which would
# rename the cases there (tests/cover_cases.txt names them).
BATCH = pytest.mark.parametrize(
    "batch_spec", [P(("data", "fsdp")), P("data")], ids=["P(('data', 'fsdp'),)", "P('data',)"]
)


def init(dtype):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (D_IN, D_HID), dtype) * 0.5,
        "b1": jnp.zeros(D_HID, dtype),
        "w2": jax.random.normal(k2, (D_HID, D_OUT), dtype) * 0.5,
    }


def data(dtype, n=N):
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (n, D_IN), dtype), jax.random.normal(ky, (n, D_OUT), dtype)


def loss(params, batch):
    x, y = batch
    if not jax.sharding.get_abstract_mesh().empty:
        # FSDP: each param gathered where it is used (an all-gather).
        params = jax.tree.map(lambda p: jax.sharding.reshard(p, P()), params)
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def mesh_of(axis_type):
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type, axis_type))


def put(mesh, params, batch, batch_spec):
    sharded = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
    return sharded, jax.device_put(batch, NamedSharding(mesh, batch_spec))


def check_sharded_like(grads, params):
    for name, g in grads.items():
        p = params[name]
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (name, g.sharding, p.sharding)
        assert g.addressable_shards[0].data.shape == p.addressable_shards[0].data.shape, name
        if AxisType.Explicit in p.sharding.mesh.axis_types:
            assert jax.typeof(g).sharding.spec == jax.typeof(p).sharding.spec, name


@AXIS_TYPE
@BATCH
@pytest.mark.parametrize("method", ["fast", "per_example"])
def test_sums_are_sharded_like_the_params_and_equal_one_devices(axis_type, batch_spec, method, x64):
    fn = privacy.clipped_grad(loss, C, method=method, num_microbatches=2)
    with x64():
        params, batch = init(jnp.float64), data(jnp.float64)
        want_loss, want = jax.jit(fn)(params, batch)
        mesh = mesh_of(axis_type)
        with jax.set_mesh(mesh):
            ps, xs = put(mesh, params, batch, batch_spec)
            got_loss, got = jax.jit(fn)(ps, xs)
            check_sharded_like(got, ps)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-12)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-14, err_msg=name)


@BATCH
def test_explicit_mesh_without_set_mesh_reads_the_mesh_from_the_arrays(batch_spec, x64):
    # Arrays put on jax.make_mesh's Explicit mesh, no mesh in context: the same sums,
    # sharded like the params.
    fn = privacy.clipped_grad(loss, C, num_microbatches=2)
    with x64():
        params, batch = init(jnp.float64), data(jnp.float64)
        want_loss, want = jax.jit(fn)(params, batch)
        ps, xs = put(mesh_of(AxisType.Explicit), params, batch, batch_spec)
        got_loss, got = jax.jit(fn)(ps, xs)
        check_sharded_like(got, ps)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-12)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.mark.slow
@pytest.mark.hlo
@BATCH
def test_explicit_mesh_reduce_scatters_the_sums(batch_spec):
    fn = jax.jit(privacy.clipped_grad(loss, C))
    mesh = mesh_of(AxisType.Explicit)
    with jax.set_mesh(mesh):
        ps, xs = put(mesh, init(jnp.float32), data(jnp.float32), batch_spec)
        hlo = harness.Hlo(fn.lower(ps, xs).compile())
    # One reduce-scatter per kernel (the bias, replicated, is all-reduced).
    assert len(hlo.ops("reduce-scatter")) == 2, hlo.collective_counts()
    # Before the fix each device all-reduced the whole of every gradient (and got it
    # back replicated). What is left to all-reduce over "data" is each device's shard.
    whole = {tuple(v.shape) for k, v in ps.items() if SPECS[k] != P()}
    for inst in hlo.ops("all-reduce"):
        assert not whole & {dims for _, dims in inst.types}, inst.line


@pytest.mark.hlo
@AXIS_TYPE
def test_the_step_outputs_only_each_devices_shards(axis_type):
    # On an Auto mesh XLA's partitioner places the reduction (on XLA:CPU an all-reduce
    # and a slice, as for jax.value_and_grad); the sums still leave sharded.
    fn = jax.jit(privacy.clipped_grad(loss, C))
    mesh = mesh_of(axis_type)
    with jax.set_mesh(mesh):
        ps, xs = put(mesh, init(jnp.float32), data(jnp.float32), P(("data", "fsdp")))
        out = fn.lower(ps, xs).compile().memory_analysis().output_size_in_bytes
        # The outputs of a step that returns a scalar and a tree sharded like the params.
        like = jax.jit(lambda p: (jnp.sum(p["b1"]), jax.tree.map(lambda a: a * 2, p)))
        shards = like.lower(ps).compile().memory_analysis().output_size_in_bytes
    assert out == shards


def dp_run(params, micro_batches, put_batch, k):
    """Two windows of `k` micro-steps: `clipped_grad` -> `dp_accumulate(adam)` ->
    `ga.apply_gradients`, as in docs/privacy.md."""
    clipped = privacy.clipped_grad(loss, C, num_microbatches=2)
    tx = privacy.dp_accumulate(
        optax.adam(1e-2),
        k,
        l2_clip_norm=C,
        noise_multiplier=0.0,
        expected_batch_size=N // 2,
        key=jax.random.key(3),
    )

    @jax.jit
    def step(params, opt_state, batch):
        _, grad_sum = clipped(params, batch)
        return ga.apply_gradients(tx, grad_sum, opt_state, params)

    opt_state = tx.init(params)
    for batch in micro_batches:
        params, opt_state = step(params, opt_state, put_batch(batch))
    assert int(ga.optimizer_step(opt_state)) == 2
    return params


@AXIS_TYPE
def test_dp_step_over_two_windows_equals_one_devices(axis_type, x64):
    k = 2
    with x64():
        params = init(jnp.float64)
        x, y = data(jnp.float64, n=N * 2)
        # 2 windows of k micro-batches of N // 2 examples.
        micro = [(x[i : i + N // 2], y[i : i + N // 2]) for i in range(0, 2 * N, N // 2)]
        want = dp_run(params, micro, lambda b: b, k)
        mesh = mesh_of(axis_type)
        with jax.set_mesh(mesh):
            ps, _ = put(mesh, params, micro[0], P(("data", "fsdp")))
            batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
            got = dp_run(ps, micro, lambda b: jax.device_put(b, batch_sharding), k)
            check_sharded_like(got, ps)
    for name in want:
        assert not np.allclose(want[name], params[name]), name
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("window", ["accumulate", "dp_accumulate"])
def test_a_window_takes_replicated_sums_for_sharded_params_on_an_explicit_mesh(window):
    # Adam's moments, initialized from params sharded for FSDP, shard the updates of a
    # replicated gradient like the params: the window's skip branch must give its zeros
    # that type too (it failed with a bare "cond branches must have equal output types").
    if window == "accumulate":
        tx = ga.accumulate(optax.adam(1e-2), 2)
    else:
        tx = privacy.dp_accumulate(
            optax.adam(1e-2),
            2,
            l2_clip_norm=C,
            noise_multiplier=0.0,
            expected_batch_size=4,
            key=jax.random.key(0),
        )

    def step(params, opt_state, scale):
        grads = jax.tree.map(lambda p: jnp.full(p.shape, scale, p.dtype), params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = init(jnp.float32)
    want, state = params, tx.init(params)
    for scale in (0.5, -0.25):
        want, state = jax.jit(step)(want, state, scale)
    mesh = mesh_of(AxisType.Explicit)
    with jax.set_mesh(mesh):
        sharded, _ = put(mesh, params, data(jnp.float32), P())
        got, state = sharded, tx.init(sharded)
        for scale in (0.5, -0.25):
            got, state = jax.jit(step)(got, state, scale)
        check_sharded_like(got, sharded)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
