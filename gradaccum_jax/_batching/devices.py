"""`coupled_value_and_grad` on many devices: mapped axes, and its global-view route.

Inside `jax.shard_map` or `jax.pmap`: a device's position along mapped axes
(`axis_index`), their size, and values typed varying over them
(`varying_over`).

Under global-view `jax.jit`: each device's own micro-batches.

Left to XLA's partitioner, a coupled step whose batch is split over a mesh
reduces every micro-batch's parameter gradient in its second pass (the
gradient of replicated params is replicated, so each vjp ends in an
all-reduce). Where the batch's mesh axes are known (`batch_axes`), the step
runs as its `axis_name` form under `jax.shard_map` instead
(`_sharding/global_view.on_each_device`):
each device sums its micro-batches' gradients, and one reduction follows.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base.compat import pcast_to_varying, varying_axes
from gradaccum_jax._batching import splitting
from gradaccum_jax._sharding import global_view


def axis_size(axis_name: tuple[Any, ...]) -> int:
    """The number of devices along the mapped axes `axis_name`."""
    return math.prod(jax.lax.psum(1, name) for name in axis_name)


def axis_index(axis_name: tuple[Any, ...]) -> jax.Array:
    """This device's position along the mapped axes `axis_name`, row-major."""
    index = jnp.int32(0)
    for name in axis_name:
        index = index * jax.lax.psum(1, name) + jax.lax.axis_index(name)
    return index


def varying_over(tree: Any, axis_name: tuple[Any, ...]) -> Any:
    """`tree` typed varying over every axis of `axis_name` (a no-op where it is)."""

    def cast(x: Any) -> Any:
        missing = tuple(a for a in axis_name if a not in varying_axes(x))
        return pcast_to_varying(x, missing) if missing else x

    return jax.tree.map(cast, tree)


def batch_axes(
    args: tuple[Any, ...], options: splitting._Options, counts: Any
) -> tuple[Any, ...] | None:
    """The mesh axes a global-view call's batch is split over, where the route applies.

    `None` (XLA's partitioner then places the work) outside a mesh, inside
    `jax.shard_map`, with carried state (per-device BatchNorm statistics would
    be another function), with params sharded over an Explicit mesh (FSDP: the
    route would gather them for the whole step), or a batch sharded on more
    than its leading axis. Auto axes are not in the types: on an Auto mesh the
    route is taken when one axis has several devices (the data-parallel one)
    and every micro-batch splits evenly over it.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if options.carry_nums or mesh.empty or jax.sharding.AxisType.Manual in mesh.axis_types:
        return None
    if any(
        e is not None
        for x in jax.tree_util.tree_leaves(args[0])
        for e in global_view.spec_entries(x)
    ):
        return None
    leaves = [leaf for j in options.batch_nums for leaf in jax.tree_util.tree_leaves(args[j])]
    entries = {(global_view.spec_entries(leaf) or (None,))[0] for leaf in leaves}
    if any(e is not None for leaf in leaves for e in global_view.spec_entries(leaf)[1:]):
        return None
    if len(entries) == 1 and None not in entries:
        (entry,) = entries
        axes = entry if isinstance(entry, tuple) else (entry,)
    else:
        split = [name for name, size in mesh.shape.items() if size > 1]
        if entries != {None} or len(split) != 1:
            return None
        axes = (split[0],)
        if mesh.axis_types[mesh.axis_names.index(split[0])] != jax.sharding.AxisType.Auto:
            return None
    # Every micro-batch must split evenly over the devices (else the plain route
    # says why); with "auto", K is planned among the counts that divide a shard.
    batch_size = splitting._batch_size(args, options.batch_nums)
    ks = counts.values() if isinstance(counts, dict) else [1 if counts == "auto" else counts]
    if any(batch_size % (k * devices(axes)) for k in ks):
        return None
    return axes


def devices(axes: tuple[Any, ...] | None) -> int:
    """The number of devices over the mesh `axes` (1 for `None`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if axes is None else math.prod(mesh.shape[a] for a in axes)
