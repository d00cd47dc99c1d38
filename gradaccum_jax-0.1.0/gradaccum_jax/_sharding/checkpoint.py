"""Checkpointing states that hold unreduced (per-device partial-sum) arrays."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import compat


def _sharding(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.sharding
    if isinstance(x, jax.Array | jax.core.Tracer):
        return jax.typeof(x).sharding
    return None


def _unreduced(x: Any) -> frozenset:
    spec = getattr(_sharding(x), "spec", None)
    return frozenset(getattr(spec, "unreduced", ()) or ())


def _mesh_of(tree: Any) -> Any:
    """The concrete mesh of the first unreduced leaf, for calls outside a mesh context."""
    for leaf in jax.tree.leaves(tree):
        if _unreduced(leaf) and not isinstance(leaf, jax.core.Tracer):
            # The concrete mesh is on the array's sharding (its type has the abstract one).
            mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
            if isinstance(mesh, jax.sharding.Mesh):
                return mesh
    return None


def _under_mesh(fn: Any, tree: Any, mesh_from: Any) -> Any:
    """`jax.jit(fn)(tree)`, inside `mesh_from`'s mesh when no mesh context is set."""
    mesh = _mesh_of(mesh_from)
    if mesh is not None and jax.sharding.get_abstract_mesh().empty:
        with jax.set_mesh(mesh):
            return jax.jit(fn)(tree)
    return jax.jit(fn)(tree)


def checkpointable(tree: Any) -> Any:
    """Returns `tree` with every unreduced leaf summed into its dense sharding.

    In a global-view `jax.jit` step, `accumulate`'s window and `AccumBatchNorm`'s
    per-device statistics are *unreduced* arrays: each device holds its own
    partial sum, and the array's value is their sum. Orbax and other
    checkpointers cannot write such arrays (`jax.Array` has no index map for
    them). This sums each one over its unreduced axes (one all-reduce per leaf,
    which XLA combines), keeping its sharding over the other mesh axes; other
    leaves are returned as they are. The result is an ordinary pytree with the
    same values: save it, restore it on the same or another mesh shape, and
    pass it to the train step, whose `accumulate` takes a dense window as a
    partial sum split over the devices. `restore_unreduced` turns it back
    into the unreduced types of a live state, so that the jitted step is not
    compiled again for the dense types.

    Works inside and outside `jax.jit`; outside, under the arrays' own mesh
    when no mesh context is set.

    Args:
      tree: Any pytree, e.g. `{"params": params, "opt_state": opt_state}`.

    Returns:
      The same structure, with no unreduced leaf.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> explicit = (jax.sharding.AxisType.Explicit,)
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=explicit)
      >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> x = jnp.arange(32.0).reshape(16, 2) / 16
      >>> with jax.set_mesh(mesh):
      ...     grad_fn = jax.jit(ga.unreduced_value_and_grad(loss, "data"))
      ...     _, grad = grad_fn(jnp.array([1.0, -1.0]), jax.device_put(x, jax.P("data")))
      ...     print(jax.typeof(grad))
      float32[2]{U:data}
      >>> dense = ga.checkpointable({"window": grad})
      >>> print(jax.typeof(dense["window"]))
      float32[2]
      >>> bool(jnp.allclose(dense["window"], jax.grad(loss)(jnp.array([1.0, -1.0]), x)))
      True
    """

    def summed(tree: Any) -> Any:
        def dense(x: Any) -> Any:
            if not _unreduced(x):
                return x
            return compat.reshard(x, jax.P(*compat.partitions(_sharding(x).spec)))

        return jax.tree.map(dense, tree)

    if not any(_unreduced(leaf) for leaf in jax.tree.leaves(tree)):
        return tree
    return _under_mesh(summed, tree, mesh_from=tree)


def restore_unreduced(tree: Any, like: Any) -> Any:
    """Returns `tree` with each leaf typed as its counterpart in `like`: unreduced where that is.

    The inverse of `checkpointable` for the types: a leaf whose counterpart in
    `like` is unreduced over some mesh axes becomes a partial sum over them
    whose sum is the leaf (the first device along the axes holds it, the
    others zeros: exact for every dtype), sharded over the other mesh axes
    as `like` is. Other leaves are returned as they are. No communication
    beyond resharding a leaf to `like`'s sharding.

    Args:
      tree: A restored pytree with no unreduced leaf.
      like: A pytree of the same structure whose leaves (arrays, or
        `jax.ShapeDtypeStruct`s such as `jax.eval_shape` returns) carry the
        shardings to restore, e.g. the state a jitted step returns.

    Returns:
      `tree` with `like`'s unreduced types.

    Raises:
      ValueError: If the two trees differ in structure, or JAX is older than 0.9.1.

    Examples:
      In the train loop of the distributed-training guide (its checkpointing
      section, whose code the test suite runs), after restoring with Orbax:

      ```python
      restored = checkpointer.restore(path, abstract_checkpointable_state)
      live = {"params": params, "opt_state": opt_state}  # or jax.eval_shape of the step
      restored = ga.restore_unreduced(restored, live)
      ```
    """
    tree_def, like_def = jax.tree.structure(tree), jax.tree.structure(like)
    if tree_def != like_def:  # type: ignore[operator]  # jaxlib's PyTreeDef stub
        raise ValueError(
            "restore_unreduced needs `like` with the structure of `tree`; got "
            f"{like_def} for {tree_def}. Pass the state the train step returns (or its "
            "jax.eval_shape) as `like`."
        )

    def split(x: Any, ref: Any) -> Any:
        axes = tuple(sorted(_unreduced(ref), key=str))
        if not axes:
            return x
        dense = jax.P(*compat.partitions(_sharding(ref).spec))
        x = compat.reshard(jnp.asarray(x), dense)

        def first_holds(block: jax.Array) -> jax.Array:
            return jnp.where(jax.lax.axis_index(axes) == 0, block, jnp.zeros_like(block))

        out = jax.P(*dense, unreduced=frozenset(axes))
        return jax.shard_map(first_holds, in_specs=dense, out_specs=out, check_vma=False)(x)

    def restore(tree: Any) -> Any:
        # `like` only gives types: closed over, its values are never read.
        return jax.tree.map(split, tree, like)

    if not any(_unreduced(leaf) for leaf in jax.tree.leaves(like)):
        return tree
    if not compat.UNREDUCED_IN_SHARD_MAP:
        raise ValueError(
            f"restore_unreduced needs JAX >= 0.9.1 (installed {jax.__version__}), which "
            "can return unreduced arrays from jax.shard_map. Upgrade JAX, or pass the "
            "restored tree to the train step as it is: accumulate takes a dense window as "
            "a partial sum split over the devices (the step then compiles once more)."
        )
    return _under_mesh(restore, tree, mesh_from=like)
