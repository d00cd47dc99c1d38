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
    `split_out` may also be a pytree prefix of the outputs, of booleans and
    `PartitionSpec`s (an output sharded like a parameter, see `sum_into`).
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

    def out_spec(split: Any) -> Any:
        if isinstance(split, _P):
            return split
        return _P(axes) if split else _P()

    out_specs = jax.tree.map(out_spec, split_out, is_leaf=lambda x: isinstance(x, _P))
    mapped = jax.shard_map(one_device, in_specs=in_specs, out_specs=out_specs)
    return mapped(*(leaves[i] for i in arrays))


def sum_into(x: jax.Array, entries: tuple[Any, ...], axes: tuple[Any, ...]) -> jax.Array:
    """Inside `jax.shard_map`: `x`, each device's partial sum over `axes`, summed into
    the block of a leaf sharded as `entries` (its spec's entries) that this device holds.

    A dimension split over some of `axes` (FSDP: a kernel `P(None, "fsdp")`, the batch
    over `("data", "fsdp")`) is reduce-scattered, so no device holds the whole sum;
    the remaining `axes` are all-reduced (a leaf replicated over them, such as a bias).
    A dimension split over axes the sum does not run over (the batch on `"data"` only)
    keeps this device's block of the sum, sliced out after the all-reduce.
    """
    scattered: list[Any] = []
    for dim, entry in enumerate(entries):
        names = entry_axes(entry)
        if names and set(names) <= set(axes) - set(scattered):
            x = jax.lax.psum_scatter(x, names, scatter_dimension=dim, tiled=True)
            scattered += names
    rest = tuple(a for a in axes if a not in scattered)
    if rest:
        x = jax.lax.psum(x, rest)
    for dim, entry in enumerate(entries):
        names = entry_axes(entry)
        if names and not set(names) <= set(scattered):
            # The block at this device's row-major position along `names`, as the spec splits.
            position: Any = 0
            count = 1
            for name in names:
                position = position * jax.lax.axis_size(name) + jax.lax.axis_index(name)
                count *= jax.lax.axis_size(name)
            size = x.shape[dim] // count
            x = jax.lax.dynamic_slice_in_dim(x, position * size, size, dim)
    return x


def entry_axes(entry: Any) -> tuple[Any, ...]:
    """The mesh axes one entry of a spec names (`None`, a name, or a tuple of names)."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)
