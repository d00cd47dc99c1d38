"""What the equivalence tests share: closeness, reference losses, meshes and route runners.

A test of equivalence runs a step on a route (one device, `shard_map`, `pmap`, global-view
jit) and compares what it ends with against a reference, usually one device on the whole
batch. The pieces every such test writes are here, once; pytest fixtures built on them
live in tests/conftest.py. Test modules import this one by its plain name
(`import _equivalence as E`), as they import their other siblings.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DEVICES = 8  # the host devices the root conftest.py forces
AXIS = "data"
EXPLICIT = jax.sharding.AxisType.Explicit
AUTO = jax.sharding.AxisType.Auto
REPLICATED, SPLIT = P(), P(AXIS)  # the default specs of a state and of a batch

# --- closeness ------------------------------------------------------------------------------


def assert_close(
    got: Any,
    want: Any,
    *,
    rtol: float,
    atol: float = 0.0,
    start: Any = None,
    per: Literal["entry", "leaf"] = "entry",
) -> None:
    """`got` equals `want` leaf by leaf: the same tree, shapes and values within tolerance.

    Each entry within `atol + rtol * scale`, the scale being the entry's own `|want|`
    (`per="entry"`, numpy's rule) or the largest `|want|` of its leaf (`per="leaf"`, for
    leaves whose entries pass near zero while the leaf does not). A failure names the leaf's
    path. With `start`, the reference must also have moved more than `100 * atol` away from
    it somewhere, so that a step that did nothing cannot pass.
    """
    assert per in ("entry", "leaf"), per
    assert jax.tree.structure(got) == jax.tree.structure(want), (
        f"tree structures differ: {jax.tree.structure(got)} != {jax.tree.structure(want)}"
    )
    if start is not None:
        moved = max(
            float(np.max(np.abs(np.asarray(w, np.float64) - np.asarray(s, np.float64))))
            for w, s in zip(jax.tree.leaves(want), jax.tree.leaves(start), strict=True)
        )
        assert moved > 100 * atol, f"the reference moved {moved} from the start, atol {atol}"
    for (path, w), g in zip(
        jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got), strict=True
    ):
        where = jax.tree_util.keystr(path)
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
        if per == "entry":
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=where)
        else:
            g, w = g.astype(np.float64), w.astype(np.float64)
            scale = max(float(np.abs(w).max(initial=0.0)), 1e-30)
            np.testing.assert_allclose(g, w, rtol=0, atol=rtol * scale + atol, err_msg=where)


# --- reference losses -----------------------------------------------------------------------


def mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((out - y) ** 2)


def mlp_loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error of `tanh(x @ w1 + b1) @ w2 (+ b2, where params hold one)`."""
    out = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    if "b2" in params:
        out = out + params["b2"]
    return jnp.mean((out - y) ** 2)


# --- meshes ---------------------------------------------------------------------------------


def data_mesh(kind: jax.sharding.AxisType = EXPLICIT, axis: str = AXIS) -> jax.sharding.Mesh:
    """The forced host devices as one data-parallel axis of type `kind`."""
    return jax.make_mesh((DEVICES,), (axis,), axis_types=(kind,))


def place(tree: Any, specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """`tree` put on `mesh` by `specs`, one `PartitionSpec` or a tree of them (a prefix)."""
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
    )
    return jax.device_put(tree, shardings)


# --- route runners --------------------------------------------------------------------------
# Each runs `step(state, batch) -> state` over the global `batches` and returns `read` of the
# last state (read on the route, inside its mesh context, where it has one).


def _same(state: Any) -> Any:
    return state


Step = Callable[[Any, Any], Any]


def run_one_device(step: Step, state: Any, batches: Iterable[Any], read=_same) -> Any:
    step = jax.jit(step)
    for batch in batches:
        state = step(state, batch)
    return read(state)


def run_global_view(
    step: Step,
    state: Any,
    batches: Iterable[Any],
    *,
    mesh: jax.sharding.Mesh,
    specs: Any = REPLICATED,
    batch_spec: P = SPLIT,
    set_mesh: bool = True,
    read=_same,
) -> Any:
    """Global-view jit: the state placed by `specs`, each batch split by `batch_spec`, under
    `jax.set_mesh(mesh)` or (`set_mesh=False`) with the mesh known only from the arrays."""
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        state = place(state, specs, mesh)
        step = jax.jit(step)
        for batch in batches:
            state = step(state, place(batch, batch_spec, mesh))
        return read(state)


def run_shard_map(
    step: Step,
    state: Any,
    batches: Iterable[Any],
    *,
    mesh: jax.sharding.Mesh,
    specs: Any = REPLICATED,
    batch_spec: P = SPLIT,
    enter: Callable[[Any], Any] | None = None,
    read=_same,
) -> Any:
    """`step` per device under `jax.shard_map`, the state split by `specs`, each batch by
    `batch_spec`. `enter`, where given, makes the loop's per-device state from the
    replicated one (`ga.add_replica_axis`, for a window's per-device fields)."""
    if enter is None:
        state = place(state, specs, mesh)
    else:
        state = place(state, P(), mesh)
        state = jax.jit(jax.shard_map(enter, mesh=mesh, in_specs=P(), out_specs=specs))(state)
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, batch_spec), out_specs=specs))
    for batch in batches:
        state = step(state, place(batch, batch_spec, mesh))
    return read(state)


def _device_copy(x: Any, i: int) -> Any:
    """Device `i`'s copy of a pmap output, taken on the host (keys through their data)."""
    if not isinstance(x, jax.Array):
        return x
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.random.key_data(x))[i]
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jnp.asarray(np.asarray(x)[i])


def run_pmap(
    step: Step, state: Any, batches: Iterable[Any], *, axis: str = AXIS, read=_same
) -> Any:
    """`jax.pmap` over the devices, the state copied to each and each batch split among them.

    Every device holds its copy of the state: what `read` gives must end the same on all of
    them (a window's own partial sums and running maxes may differ), and is checked so.
    """
    step = jax.pmap(step, axis_name=axis)
    state = jax.tree.map(lambda leaf: jnp.stack([leaf] * DEVICES), state)
    for batch in batches:
        state = step(state, jax.tree.map(lambda x: x.reshape(DEVICES, -1, *x.shape[1:]), batch))
    # Each copy read on the host: slicing the pmap-sharded outputs with `x[i]` compiles a
    # small program per slice, and jax 0.10.2 aborts the process when it loads such a
    # program from the persistent compilation cache (seen in CI; JAX_COMPILATION_CACHE_DIR=
    # off, it passes).
    copies = [
        read(jax.tree.map(functools.partial(_device_copy, i=i), state)) for i in range(DEVICES)
    ]
    for i, copy in enumerate(copies[1:], 1):
        for (path, a), b in zip(
            jax.tree_util.tree_flatten_with_path(copies[0])[0], jax.tree.leaves(copy), strict=True
        ):
            np.testing.assert_array_equal(b, a, err_msg=f"device {i}: {jax.tree_util.keystr(path)}")
    return copies[0]
