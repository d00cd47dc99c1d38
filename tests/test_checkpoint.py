"""`checkpointable` and `restore_unreduced`: unreduced states through Orbax, mid-window."""

from __future__ import annotations

import _equivalence as E
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga

P = jax.P
EXPLICIT = jax.sharding.AxisType.Explicit
K = 4
TOL = {"rtol": 1e-5, "atol": 1e-7}
SPECS = {"w": P("fsdp", None), "b": P()}

pytestmark = pytest.mark.requires("unreduced windows and scalars", jax="0.9.1")


def init_params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(16, 4)).astype(np.float32)) / 4, "b": jnp.zeros(4)}


def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)


def batches(n=2 * K, size=16):
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        x = rng.normal(size=(size, 16)).astype(np.float32)
        if i == 1:
            x[0, 0] = np.nan  # one device's partial sum is dropped before the checkpoint
        out.append((x, rng.normal(size=(size, 4)).astype(np.float32)))
    return out


def make_step(tx, axis_name, batch_spec):
    grad_fn = ga.unreduced_value_and_grad(loss_fn, axis_name)

    @jax.jit
    def step(params, state, batch):
        batch = jax.tree.map(lambda b: jax.reshard(b, batch_spec), batch)
        _, grads = grad_fn(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def mesh_of(shape, names, devices=None):
    return jax.make_mesh(shape, names, axis_types=(EXPLICIT,) * len(shape), devices=devices)


def run(tx, mesh, specs, axis_name, batch_spec, data, state=None, params=None):
    with jax.set_mesh(mesh):
        if params is None:
            params = jax.device_put(init_params(), specs)
            state = jax.jit(tx.init)(params)
        step = make_step(tx, axis_name, batch_spec)
        for batch in data:
            params, state = step(params, state, batch)
    return params, state, step


def save_and_restore(tree, target, path):
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    return checkpointer.restore(path, abstract)


@pytest.mark.slow
def test_hsdp_state_mid_window_through_orbax_resumes_the_run(tmp_path):
    mesh = mesh_of((2, 4), ("data", "fsdp"))
    tx = ga.accumulate(optax.adam(1e-2), K)
    batch_spec = P(("data", "fsdp"))
    data = batches()
    want, _, _ = run(tx, mesh, SPECS, "data", batch_spec, data)
    params, state, step = run(tx, mesh, SPECS, "data", batch_spec, data[: K + 2])
    assert str(jax.typeof(state.acc_grads["w"])) == "float32[16@fsdp,4]{U:data}"
    saved = ga.checkpointable({"params": params, "opt_state": state})
    assert not any(jax.typeof(x).sharding.spec.unreduced for x in jax.tree.leaves(saved))
    assert str(jax.typeof(saved["opt_state"].acc_grads["w"])) == "float32[16@fsdp,4]"
    restored = save_and_restore(saved, saved, tmp_path / "mid_window")
    # Back to the live state's types: the jitted step runs without compiling again.
    with jax.set_mesh(mesh):
        like = {"params": params, "opt_state": state}
        restored = ga.restore_unreduced(restored, like)
        assert jax.tree.map(jax.typeof, restored) == jax.tree.map(jax.typeof, like)
        compiled = step._cache_size()
        params, state = restored["params"], restored["opt_state"]
        for batch in data[K + 2 :]:
            params, state = step(params, state, batch)
        assert step._cache_size() == compiled
    E.assert_close(params, want, **TOL)
    assert int(ga.optimizer_step(state)) == 2


@pytest.mark.slow
def test_a_checkpoint_from_8_devices_resumes_on_4(tmp_path):
    """Data parallel over 8 devices, saved mid-window, finished over 4: the same run."""
    tx = ga.accumulate(optax.adam(1e-2), K)
    specs = {"w": P(), "b": P()}
    data = batches()
    mesh8 = mesh_of((8,), ("data",))
    want, _, _ = run(tx, mesh8, specs, "data", P("data"), data)
    params, state, _ = run(tx, mesh8, specs, "data", P("data"), data[: K + 2])
    saved = ga.checkpointable({"params": params, "opt_state": state})
    mesh4 = mesh_of((4,), ("data",), devices=jax.devices()[:4])
    with jax.set_mesh(mesh4):
        fresh_params = jax.device_put(init_params(), specs)
        target = ga.checkpointable(
            {"params": fresh_params, "opt_state": jax.jit(tx.init)(fresh_params)}
        )
    restored = save_and_restore(saved, target, tmp_path / "eight")
    assert restored["params"]["w"].sharding.mesh.size == 4
    got, state, _ = run(
        tx,
        mesh4,
        specs,
        "data",
        P("data"),
        data[K + 2 :],
        state=restored["opt_state"],
        params=restored["params"],
    )
    E.assert_close(got, want, **TOL)
    assert int(ga.optimizer_step(state)) == 2


def test_checkpointable_leaves_dense_trees_alone_and_restore_checks_structure():
    tree = {"a": jnp.ones(3), "n": None, "i": 3}
    assert ga.checkpointable(tree) is tree
    with pytest.raises(ValueError, match="structure of `tree`"):
        ga.restore_unreduced({"a": jnp.ones(3)}, {"b": jnp.ones(3)})


def test_unreduced_gradients_reaching_a_clip_name_the_fix():
    mesh = mesh_of((8,), ("data",))
    grad_fn = ga.unreduced_value_and_grad(loss_fn, "data")
    with jax.set_mesh(mesh):
        params = jax.device_put(init_params(), {"w": P(), "b": P()})
        batch = jax.device_put(batches(1)[0], P("data"))
        for tx in (ga.clip_norm(1.0), ga.adaptive_grad_clip(0.1), ga.dynamic_loss_scale()):

            @jax.jit
            def step(params, batch, tx=tx):
                _, grads = grad_fn(params, batch)
                return tx.update(grads, tx.init(params), params)

            with pytest.raises(
                ValueError, match=r"unreduced over mesh axes \['data'\].*accumulate"
            ):
                step(params, batch)
