"""Marks on the sums `clipped_grad` returns: their clip norm, and the leaves clipped together.

Weakly, by identity (arrays or tracers), as `_window/placement.py` marks a window's
output: a consumer that receives the same leaves in the same trace reads the mark.
`dp_accumulate` refuses sums clipped to another norm than its noise's, and both it and
`gradaccum_jax.flax.Optimizer` refuse to update some of the leaves whose norms were
taken together (an optimizer's `wrt=` narrower than the clipping's: each example's clip
factor would count gradients that are never applied).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax


class Clipped(NamedTuple):
    """One call's clipped sum: its clip norm and the paths of all its leaves (one norm)."""

    l2_clip_norm: float
    paths: tuple[str, ...]


_marks: dict[int, tuple[weakref.ref, Clipped, tuple[str, ...]]] = {}


def mark(tree: Any, l2_clip_norm: float) -> None:
    """Records that the leaves of `tree` are sums of examples clipped to `l2_clip_norm`,
    each example's norm taken over all of them."""
    flat = jax.tree_util.tree_leaves_with_path(tree)
    group = Clipped(float(l2_clip_norm), tuple(jax.tree_util.keystr(p) for p, _ in flat))
    # One array may sit at several paths (a shared zero): it stands for all of them.
    at: dict[int, tuple[Any, tuple[str, ...]]] = {}
    for (_, leaf), path in zip(flat, group.paths, strict=True):
        at[id(leaf)] = (leaf, at.get(id(leaf), (leaf, ()))[1] + (path,))
    for key, (leaf, paths) in at.items():

        def forget(ref: weakref.ref, key: int = key) -> None:
            if _marks.get(key, (None,))[0] is ref:
                del _marks[key]

        try:
            _marks[key] = (weakref.ref(leaf, forget), group, paths)
        except TypeError:  # not weakly referenceable: not marked
            continue


def marks(tree: Any) -> list[tuple[Clipped, tuple[str, ...]]]:
    """`(group, paths in the clipped sum)` for each marked leaf of `tree`."""
    found = []
    for leaf in jax.tree.leaves(tree):
        entry = _marks.get(id(leaf))
        if entry is not None and entry[0]() is leaf:
            found.append(entry[1:])
    return found


def check_whole(tree: Any, where: str, fix: str) -> None:
    """Raises if `tree` holds some, not all, of the leaves of a clipped sum.

    Args:
      tree: What `where` is about to update.
      where: Who receives it, for the message.
      fix: What to do instead, for the message.
    """
    received: dict[Clipped, set[str]] = {}
    for group, paths in marks(tree):
        received.setdefault(group, set()).update(paths)
    for group, seen in received.items():
        missing = [p for p in group.paths if p not in seen]
        if missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise ValueError(
                f"{where} updates {len(seen)} of the {len(group.paths)} leaves that "
                f"clipped_grad clipped together: each example's norm and clip factor counted "
                f"the gradients of {shown} too, which are never applied. {fix}"
            )
