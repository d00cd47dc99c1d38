"""`accumulate`'s reduction strategies on sharded params: FSDP and HSDP, on 8 host devices.

The 2x4 mesh `("data", "fsdp")`: params sharded over `fsdp` and replicated over
`data`. Each scenario trains two windows and compares with one device on the
global batch (float32, rtol 1e-5), counts collectives per mesh axis and place in
the compiled step, and reads the accumulator's bytes per device.
"""

from __future__ import annotations

import _equivalence as E
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._base import compat as _compat

P = jax.P
EXPLICIT = jax.sharding.AxisType.Explicit
AUTO = jax.sharding.AxisType.Auto
K = 3
RTOL, ATOL = 1e-5, 1e-7
SPECS = {"w": P("fsdp", None), "v": P(None, "fsdp"), "b": P()}
BATCH = P(("data", "fsdp"))

pytestmark = pytest.mark.requires("unreduced windows and scalars", jax="0.9.1")


def mesh2x4(kind=EXPLICIT):
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind, kind))


def init_params():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(32, 16)).astype(np.float32)) / 6,
        "v": jnp.asarray(rng.normal(size=(16, 8)).astype(np.float32)) / 4,
        "b": jnp.zeros(8, jnp.float32),
    }


def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] + p["b"] - y) ** 2)


def batches(n=2 * K, size=16):
    rng = np.random.default_rng(1)
    return [
        (
            rng.normal(size=(size, 32)).astype(np.float32),
            rng.normal(size=(size, 8)).astype(np.float32),
        )
        for _ in range(n)
    ]


def reference(data, inner, keep=None):
    """One device, one step per window on the concatenated (kept) rows of its micro-batches."""
    params, state = init_params(), inner.init(init_params())
    for w in range(len(data) // K):
        window = data[w * K : (w + 1) * K]
        rows = [keep(w * K + i, b) if keep else b for i, b in enumerate(window)]
        x = np.concatenate([r[0] for r in rows])
        y = np.concatenate([r[1] for r in rows])
        grads = jax.grad(loss_fn)(params, (x, y))
        updates, state = inner.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def train(tx, data, axis_name="data", mesh=None, poison=None):
    """Global-view training on the 2x4 mesh; returns params, state and the compiled step."""
    mesh = mesh or mesh2x4()
    with jax.set_mesh(mesh):
        params = jax.device_put(init_params(), SPECS)
        state = jax.jit(tx.init)(params)
        grad_fn = ga.unreduced_value_and_grad(loss_fn, axis_name)

        def step(params, state, batch, poison):
            _, grads = grad_fn(params, batch)
            if poison is not None:
                grads = jax.tree.map(jnp.add, grads, poison)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        step = jax.jit(step)
        for i, batch in enumerate(data):
            batch = jax.device_put(batch, BATCH)
            params, state = step(params, state, batch, poison(i) if poison else None)
        compiled = step.lower(params, state, batch, None).compile()
        return params, state, compiled


def by_axis(compiled, mesh):
    found = harness.Hlo(compiled).collectives_by_axis(dict(mesh.shape))
    return {key: count for key, (count, _) in found.items()}


def per_device_bytes(tree):
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def nan_in_one_shard(step):
    """At micro-step 1, a NaN in device (data=0, fsdp=2)'s shard of w's partial sum only."""
    if step != 1:
        return None

    def body():
        d, f = jax.lax.axis_index("data"), jax.lax.axis_index("fsdp")
        hit = (d == 0) & (f == 2) & (jnp.arange(8 * 16).reshape(8, 16) == 0)
        w = jax.lax.pcast(jnp.where(hit, jnp.nan, 0.0), "data", to="unreduced")
        zeros = {"v": jnp.zeros((16, 2)), "b": jnp.zeros(8)}
        zeros = jax.tree.map(
            lambda z: jax.lax.pcast(_compat.pcast_to_varying(z, ("data",)), "data", to="unreduced"),
            zeros,
        )
        return {"w": w, **zeros}

    out = {
        "w": P("fsdp", None, unreduced={"data"}),
        "v": P(None, "fsdp", unreduced={"data"}),
        "b": P(unreduced={"data"}),
    }
    return jax.shard_map(body, in_specs=(), out_specs=out)()


@pytest.mark.hlo
def test_hsdp_window_is_a_shard_per_device_reduced_over_data_once_per_window():
    data = batches()
    tx = ga.accumulate(optax.adam(1e-2), K)
    params, state, compiled = train(tx, data)
    E.assert_close(params, reference(data, optax.adam(1e-2)), rtol=RTOL, atol=ATOL)
    assert str(jax.typeof(state.acc_grads["w"])) == "float32[32@fsdp,16]{U:data}"
    assert str(jax.typeof(state.acc_grads["v"])) == "float32[16,8@fsdp]{U:data}"
    # 1/4 of each sharded leaf per device, the replicated bias whole.
    assert per_device_bytes(state.acc_grads) == (32 * 16 + 16 * 8) * 4 // 4 + 8 * 4
    counts = by_axis(compiled, mesh2x4())
    # Per micro-step only FSDP traffic inside each fsdp group (and the scalar agreement
    # on dropping a partial sum); nothing crosses `data` until the window closes.
    every = {key: n for key, n in counts.items() if key[0] == "every step"}
    assert all(axes == ("fsdp",) for _, _, axes in every), counts
    once = {key: n for key, n in counts.items() if key[0] == "once"}
    assert once == {("once", "all-reduce", ("data",)): 1}, counts


def test_hsdp_drops_a_partial_sum_whole_when_one_of_its_shards_is_not_finite():
    """The devices holding shards of one partial sum agree: the NaN drops replica 0's
    micro-step 1 on all four of its fsdp devices, not only on the one that sees it."""
    data = batches()
    tx = ga.accumulate(optax.adam(1e-2), K)
    params, state, _ = train(tx, data, poison=nan_in_one_shard)
    # Replica 0 holds rows 0..7 of each micro-batch (the batch is split data-major).
    keep = lambda i, b: (b[0][8:], b[1][8:]) if i == 1 else b  # noqa: E731
    E.assert_close(params, reference(data, optax.adam(1e-2), keep=keep), rtol=RTOL, atol=ATOL)
    with jax.set_mesh(mesh2x4()):
        skipped = jax.jit(lambda s: _compat.reshard(s, P()))(state.num_skipped)
    assert int(skipped) == 1  # one partial sum (replica 0's), held by its four devices


@pytest.mark.hlo
def test_hsdp_zero1_shards_the_inner_state_over_both_axes():
    data = batches()
    tx = ga.accumulate(optax.adam(1e-2), K, shard_inner_state="data")
    params, state, compiled = train(tx, data)
    E.assert_close(params, reference(data, optax.adam(1e-2)), rtol=RTOL, atol=ATOL)
    mu = state.inner_state[0].mu
    assert str(jax.typeof(mu["w"])) == "float32[32@(fsdp,data),16]"
    assert mu["w"].addressable_shards[0].data.size * 8 == mu["w"].size  # 1/8 per device
    counts = by_axis(compiled, mesh2x4())
    assert all(axes == ("fsdp",) for place, _, axes in counts if place == "every step"), counts
    # The close reduce-scatters the shards over data into the inner state's sharding.
    assert counts.get(("once", "reduce-scatter", ("data",)), 0) >= 1, counts


@pytest.mark.hlo
def test_unreduced_over_every_axis_holds_a_full_size_window_per_device():
    """axis_name=("data", "fsdp"): no gradient communication until the close."""
    data = batches()
    tx = ga.accumulate(optax.adam(1e-2), K)
    params, state, compiled = train(tx, data, axis_name=("data", "fsdp"))
    E.assert_close(params, reference(data, optax.adam(1e-2)), rtol=RTOL, atol=ATOL)
    assert str(jax.typeof(state.acc_grads["w"])) == "float32[32,16]{U:(data,fsdp)}"
    assert per_device_bytes(state.acc_grads) == (32 * 16 + 16 * 8 + 8) * 4
    counts = by_axis(compiled, mesh2x4())
    every_ops = {op for place, op, _ in counts if place == "every step"}
    assert every_ops <= {"all-gather", "all-reduce"}, counts  # params, the scalar value
    assert all(axes == ("data", "fsdp") for place, _, axes in counts if place == "once"), counts


@pytest.mark.parametrize("kind", [EXPLICIT, AUTO], ids=["explicit", "auto"])
def test_fsdp_params_with_plain_gradients_on_every_route(kind):
    """Params sharded over fsdp, gradients from jax.grad (reduced every micro-step): the
    local route, conditional_accumulate and split_accumulate all equal one device."""
    data = batches()
    mesh = mesh2x4(kind)
    inner = optax.sgd(0.1)
    want = reference(data, inner)
    makers = {
        "accumulate": lambda: ga.accumulate(inner, K),
        "conditional": lambda: ga.conditional_accumulate(inner, num_required=K),
        # The mean of K SGD updates taken at the window's params is one large-batch step.
        "split": lambda: optax.chain(inner, ga.split_accumulate(K, reduction="mean")),
    }

    def fsdp_loss(p, batch):
        # Explicit axes: the loss gathers each param at use (its transpose is the
        # gradient's reduce-scatter); Auto axes: the compiler does.
        if kind == EXPLICIT:
            p = jax.tree.map(lambda a: _compat.reshard(a, P()), p)
        return loss_fn(p, batch)

    with jax.set_mesh(mesh):
        for name, make in makers.items():
            tx = make()
            params = jax.device_put(init_params(), jax.sharding.NamedSharding(mesh, P()))
            params = {
                n: jax.device_put(p, jax.sharding.NamedSharding(mesh, SPECS[n]))
                for n, p in params.items()
            }
            state = jax.jit(tx.init)(params)

            @jax.jit
            def step(params, state, batch, tx=tx, name=name):
                grads = jax.grad(fsdp_loss)(params, batch)
                extra = {}
                if name == "conditional":
                    extra["local_step"] = state.accumulator.global_step
                updates, state = tx.update(grads, state, params, **extra)
                return optax.apply_updates(params, updates), state

            for batch in data:
                params, state = step(params, state, jax.device_put(batch, BATCH))
            E.assert_close(params, want, rtol=RTOL, atol=ATOL)
            assert params["w"].addressable_shards[0].data.shape == (8, 16), name


def test_a_shard_inner_state_axis_missing_from_the_mesh_names_the_axes():
    tx = ga.accumulate(optax.adam(1e-2), K, shard_inner_state="replica")
    with jax.set_mesh(mesh2x4()):
        params = jax.device_put(init_params(), SPECS)
        with pytest.raises(ValueError, match=r"no axis 'replica'.*\('data', 'fsdp'\)"):
            jax.jit(tx.init)(params)


def test_gradients_unreduced_over_another_axis_than_shard_inner_state_name_both():
    tx = ga.accumulate(optax.adam(1e-2), K, shard_inner_state="data")
    with pytest.raises(ValueError, match=r"unreduced over \('fsdp',\).*shard_inner_state='data'"):
        train(tx, batches(1), axis_name="fsdp")


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(16)(x)
        x = ga.flax.AccumBatchNorm(use_running_average=not train, momentum=0.5)(x)
        return nn.Dense(4)(jnp.tanh(x))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hsdp", "feature_sharded"])
def test_accum_batchnorm_window_with_sharded_params_and_activations(mode):
    """Running statistics after a window equal nn.BatchNorm's one step on the whole window.

    hsdp: kernels sharded over fsdp, gradients from unreduced_value_and_grad(.., "data"),
    per-device windows (unreduced over the axes the batch is split over). feature_sharded:
    plain jax.grad under jit with the kernels left sharded over fsdp, so the normalised
    activations are sharded over their features (16@fsdp) while the running statistics
    are replicated.
    """
    k, rng = 2, np.random.default_rng(0)
    xs = [rng.normal(size=(16, 8)).astype(np.float32) for _ in range(k)]
    ys = [rng.normal(size=(16, 4)).astype(np.float32) for _ in range(k)]
    variables = _BNNet().init(jax.random.key(0), xs[0])
    tx = ga.accumulate(optax.sgd(0.0), k)

    def loss(p, s, b):
        pred, new = _BNNet().apply({"params": p, "batch_stats": s}, b[0], mutable=["batch_stats"])
        return jnp.mean((pred - b[1]) ** 2), new["batch_stats"]

    if mode == "hsdp":
        grad_fn = ga.unreduced_value_and_grad(loss, "data", batch_argnums=2, has_aux=True)
        batch_spec = P(("data", "fsdp"))
    else:
        grad_fn = jax.value_and_grad(loss, has_aux=True)
        batch_spec = P("data")

    def spec(p):
        return P(None, "fsdp") if p.ndim == 2 and p.shape[1] % 4 == 0 else P()

    with jax.set_mesh(mesh2x4()):
        params = jax.device_put(variables["params"], jax.tree.map(spec, variables["params"]))
        stats = jax.device_put(variables["batch_stats"], P())
        opt_state = jax.jit(tx.init)(params)

        @jax.jit
        def step(params, stats, opt_state, batch):
            (_, stats), grads = grad_fn(params, stats, batch)
            stats = ga.flax.commit_batch_stats(stats, ga.closes_window(opt_state))
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), stats, opt_state

        for x, y in zip(xs, ys, strict=True):
            batch = jax.device_put((x, y), batch_spec)
            params, stats, opt_state = step(params, stats, opt_state, batch)
    bn = stats["BatchNorm_0"]
    dense = variables["params"]["Dense_0"]
    hidden = np.concatenate(xs) @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"])
    np.testing.assert_allclose(bn["mean"], 0.5 * hidden.mean(0), 1e-5, 1e-6)
    np.testing.assert_allclose(bn["var"], 0.5 + 0.5 * hidden.var(0), 1e-5, 1e-6)


def test_hsdp_under_shard_map_with_axis_name_over_the_slow_axis():
    """The replica route on HSDP: the loss reduce-scatters over fsdp inside shard_map, and
    accumulate(axis_name="data") sums each device's shard over data once per window."""
    data = batches()
    tx = ga.accumulate(optax.adam(1e-2), K, axis_name="data")
    mesh = mesh2x4(AUTO)
    dims = {"w": 0, "v": 1}

    def local_grads(p, batch):
        full = {
            n: jax.lax.all_gather(p[n], "fsdp", axis=dims[n], tiled=True) if n in dims else p[n]
            for n in p
        }
        full = _compat.pcast_to_varying(full, ("data", "fsdp"))
        n = jax.lax.axis_size(("data", "fsdp"))
        g = jax.grad(lambda q: loss_fn(q, batch) / n)(full)
        return {
            name: jax.lax.psum_scatter(g[name], "fsdp", scatter_dimension=dims[name], tiled=True)
            if name in dims
            else jax.lax.psum(g[name], "fsdp")
            for name in g
        }

    state_specs = ga.replica_state_specs(jax.eval_shape(tx.init, init_params()), "data")

    def body(p, state, batch):
        grads = local_grads(p, batch)
        updates, state = tx.update(grads, ga.remove_replica_axis(state), p)
        return optax.apply_updates(p, updates), ga.add_replica_axis(state)

    init = jax.jit(
        jax.shard_map(
            lambda p: ga.add_replica_axis(tx.init(p)),
            mesh=mesh,
            in_specs=(SPECS,),
            out_specs=state_specs,
            check_vma=False,
        )
    )
    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(SPECS, state_specs, BATCH),
            out_specs=(SPECS, state_specs),
            check_vma=False,
        )
    )
    params = jax.device_put(
        init_params(), {n: jax.NamedSharding(mesh, s) for n, s in SPECS.items()}
    )
    state = init(params)
    for batch in data:
        params, state = step(params, state, batch)
    # Adam divides by sqrt(v): where a gradient is near zero the summation order of the
    # per-device reductions shows (3e-6 absolute on one of 128 elements here).
    got, want = params, reference(data, optax.adam(1e-2))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
