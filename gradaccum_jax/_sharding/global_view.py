"""Global-view `jax.jit` as per-device code: a step run under `jax.shard_map`.

Under global-view `jax.jit` an array's sharding over Explicit mesh axes is part of
its type (`jax.typeof(x).sharding.spec`). A step that is exact only per device
(its reduction placed once, or per-example work that must not mix devices) runs as
its per-device form under `jax.shard_map` over the context mesh instead
(`on_each_device`), its batch split over the mesh axes the batch is split over.

Arrays put on a mesh of Explicit axes carry it in their types, so a step over
them needs no `jax.set_mesh`: a door that splits a batch enters `batch_mesh`, and
everything inside it reads the arguments' mesh as the context's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from gradaccum_jax._base import compat

_P = jax.sharding.PartitionSpec


def spec_entries(leaf: Any) -> tuple[Any, ...]:
    """The per-dimension entries of the sharding in `leaf`'s type (empty where none)."""
    spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None)
    return compat.partitions(spec) if spec is not None else ()


@contextlib.contextmanager
def batch_mesh(tree: Any) -> Iterator[None]:
    """The context mesh, or where none is set, the mesh in the types of `tree`'s arrays.

    Under global-view `jax.jit` without `jax.set_mesh`, arrays on a mesh with Explicit
    axes still carry that mesh in their types (`jax.typeof(x).sharding.mesh`); a
    batch split over it would otherwise meet per-example slicing and reshapes that
    the type system refuses. Inside the block that mesh is the context mesh, as
    `jax.set_mesh` would make it: the abstract mesh under a trace, the arrays' own
    mesh for a call outside `jax.jit`. A no-op where a mesh is set (inside
    `jax.shard_map` too) or no array carries a mesh with Explicit axes (Auto axes
    are left to XLA's partitioner, as without a context mesh).
    """
    if not jax.sharding.get_abstract_mesh().empty:
        yield
        return
    arrays = (leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array))
    for leaf in arrays:
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if mesh is None or jax.sharding.AxisType.Explicit not in mesh.axis_types:
            continue
        concrete = None if isinstance(leaf, jax.core.Tracer) else leaf.sharding
        if isinstance(concrete, jax.sharding.NamedSharding) and isinstance(
            concrete.mesh, jax.sharding.Mesh
        ):
            with jax.set_mesh(concrete.mesh):
                yield
        else:
            with jax.sharding.use_abstract_mesh(mesh):
                yield
        return
    yield


def on_each_device(
    run: Callable[..., Any],
    axes: tuple[Any, ...],
    args: tuple[Any, ...],
    split_nums: Any,
    *,
    split_out: Any,
) -> Any:
    """`run(*local_args)` on each device under `jax.shard_map` over the context mesh.

    Arrays in the arguments at `split_nums` are split over `axes` (their
    leading axis), other arrays are passed whole, and what is not an array is
    passed as it is. With `split_out` the outputs are joined along their leading
    axis; else they must be typed invariant over `axes`, and are replicated.
    `split_out` may also be a pytree prefix of the outputs, of booleans.
    """
    leaves, treedef = jax.tree_util.tree_flatten(args)
    positions = [j for j, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    in_specs = tuple(_P(axes) if positions[i] in split_nums else _P() for i in arrays)

    def one_device(*local: Any) -> Any:
        local_leaves = list(leaves)
        for i, x in zip(arrays, local, strict=True):
            local_leaves[i] = x
        return run(*jax.tree_util.tree_unflatten(treedef, local_leaves))

    out_specs = jax.tree.map(lambda split: _P(axes) if split else _P(), split_out)
    mapped = jax.shard_map(one_device, in_specs=in_specs, out_specs=out_specs)
    return mapped(*(leaves[i] for i in arrays))
