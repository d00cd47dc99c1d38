"""Parameters sharded over the data axes (FSDP) inside the pipeline's `shard_map`.

Under global view on an Explicit mesh a parameter's type says which of its dimensions
are split over which mesh axes. The pipeline keeps that split at its boundary, gathers
each such parameter once, before the schedule's loop (not per slot), and hands back its
gradient reduce-scattered over those axes once, after the loop: sharded like the
parameter, and summed over the other data axes with the same one collective per leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from gradaccum_jax._base import collectives


@dataclasses.dataclass(frozen=True)
class Split:
    """One parameter's split: per dimension None, an axis name, or a tuple of names.

    Not a pytree node, so a tree of them has the params' structure."""

    entries: tuple[Any, ...]

    def over(self, skip: Any) -> bool:
        """Whether the leaf is split over some axis other than `skip`."""
        return any(a != skip for e in self.entries for a in _names(e))


def _names(entry: Any) -> tuple[Any, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def gather(tree: Any, layout: Any, skip: Any) -> Any:
    """Each leaf gathered whole along the dimensions its entries split (`skip` kept split)."""

    def one(x: jax.Array, split: Split) -> jax.Array:
        for dim, entry in enumerate(split.entries):
            axes = tuple(a for a in _names(entry) if a != skip)
            if axes:
                x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
        return x

    return jax.tree.map(one, tree, layout)


def reduce(tree: Any, layout: Any, sum_axes: tuple[Any, ...], skip: Any, typed: bool) -> Any:
    """Each leaf summed over `sum_axes` once: reduce-scattered back to its split where it
    is split over some of them, all-reduced over the rest."""

    def one(g: jax.Array, split: Split) -> jax.Array:
        used: list[Any] = []
        for dim, entry in enumerate(split.entries):
            axes = tuple(a for a in _names(entry) if a != skip)
            if axes:
                g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
                used += axes
        rest = tuple(a for a in sum_axes if a not in used)
        return collectives.psum(g, rest, typed) if rest else g

    return jax.tree.map(one, tree, layout)


def check(layout: Any, data: tuple[Any, ...], stage_axis: Any) -> None:
    """Refuses a parameter split over an axis the batch is not split over."""
    for path, split in jax.tree_util.tree_leaves_with_path(layout):
        for entry in split.entries:
            for axis in _names(entry):
                if axis != stage_axis and axis not in data:
                    raise ValueError(
                        f"params{jax.tree_util.keystr(path)} is split over the mesh axis "
                        f"{axis!r}, which the batch is not split over (data axes {data}): "
                        "the pipeline shards parameters over data axes only (FSDP). Leave "
                        "that axis out of axis_name=None's default, or replicate the leaf."
                    )
