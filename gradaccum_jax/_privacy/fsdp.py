"""Clipped sums on FSDP meshes: each sum placed like its param, the batch split over the
params' mesh axes where it divides (`clipped_grad`'s global-view route)."""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.experimental import shard_alike

from gradaccum_jax._sharding import global_view


def sharded_like_params(params: Any, grad_sum: Any) -> Any:
    """`grad_sum`, each sum tied to its param's sharding where XLA's partitioner places it.

    On a mesh of Auto axes (or none in context) nothing in the program ties a sum to its
    param, as `jax.value_and_grad`'s transposed dot does: across the per-example work and
    the chunks' conditional the partitioner may replicate the sums, a whole gradient on
    every device of an FSDP mesh. `shard_alike` gives each sum its param's sharding.
    Explicit axes type the sums already, and inside `jax.shard_map` each device holds
    its own.
    """
    types = set(jax.sharding.get_abstract_mesh().axis_types)
    if types & {jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Manual}:
        return grad_sum
    return shard_alike.shard_alike(params, grad_sum)[1]


def split_axes(axes: tuple[Any, ...], diff: list[Any], n: int, chunking: Any) -> tuple[Any, ...]:
    """The batch's mesh `axes`, then the other mesh axes the params are sharded over where
    the batch (and each device's chunks) still divides over them all."""
    mesh = jax.sharding.get_abstract_mesh()
    sharded = {
        a
        for leaf in jax.tree.leaves(diff)
        for entry in global_view.spec_entries(leaf)
        for a in global_view.entry_axes(entry)
    }
    more = tuple(a for a in mesh.axis_names if a in sharded and a not in axes)
    devices = math.prod(mesh.shape[a] for a in (*axes, *more))
    if not more or n % devices or (isinstance(chunking, tuple) and (n // devices) % chunking[1]):
        return axes
    return (*axes, *more)
