"""Equinox modules at the library's doors: their arrays differentiated and updated, the rest kept.

An `equinox.Module` is a pytree whose leaves include what is not an array (its
activation functions, Python numbers). As `eqx.filter_value_and_grad` and
`eqx.apply_updates` do, the doors that take a module split it into its
floating-point arrays (differentiated, updated) and the rest (passed through as
it came). equinox is not a dependency: it is looked up only if the caller
imported it, and without it no module can exist.
"""

from __future__ import annotations

import sys
from typing import Any

import jax


def _equinox() -> Any:
    return sys.modules.get("equinox")


def holds_module(tree: Any) -> bool:
    """Whether `tree` is or holds an `equinox.Module` (False when equinox is not imported)."""
    eqx = _equinox()
    if eqx is None:
        return False

    def is_module(x: Any) -> bool:
        return isinstance(x, eqx.Module)

    return any(is_module(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_module))


def partition(tree: Any) -> tuple[Any, Any]:
    """`eqx.partition(tree, eqx.is_inexact_array)`: `(arrays, rest)`, each with `None` holes.

    The arrays are what `eqx.filter_grad` differentiates, with the structure of
    its gradients.
    """
    eqx = sys.modules["equinox"]
    return eqx.partition(tree, eqx.is_inexact_array)


def combine(arrays: Any, rest: Any) -> Any:
    """`eqx.combine(arrays, rest)`: the module again, with `arrays` in their places."""
    return sys.modules["equinox"].combine(arrays, rest)


def positions(args: tuple[Any, ...], candidates: tuple[int, ...]) -> tuple[int, ...]:
    """Those of `candidates` at which `args` holds an `equinox.Module`."""
    if _equinox() is None:
        return ()
    return tuple(i for i in candidates if i < len(args) and holds_module(args[i]))


def owners(tree: Any) -> list[Any]:
    """The innermost `equinox.Module` holding each leaf of `tree`, in flattening order.

    `None` for a leaf outside every module (all of them when equinox is not imported).
    """
    eqx = _equinox()
    if eqx is None:
        return [None] * len(jax.tree_util.tree_leaves(tree))
    found: list[Any] = []

    def walk(node: Any, owner: Any) -> None:
        def is_inner(x: Any) -> bool:
            return x is not node and isinstance(x, eqx.Module)

        # Flattening stops at the modules inside `node`; each is then walked in
        # its place, so the leaves come in the order of flattening `tree` whole.
        for child in jax.tree_util.tree_leaves(node, is_leaf=is_inner):
            if is_inner(child):
                walk(child, child)
            else:
                found.append(owner)

    walk(tree, tree if isinstance(tree, eqx.Module) else None)
    return found


def arrays_only(tree: Any) -> bool:
    """Whether every leaf of `tree` is a floating-point array: a module's arrays alone, as
    `eqx.partition(model, eqx.is_inexact_array)` gives them (`None` in the other places)."""
    eqx = sys.modules["equinox"]
    return all(eqx.is_inexact_array(x) for x in jax.tree_util.tree_leaves(tree))


def refuse_modules(args: tuple[Any, ...], candidates: tuple[int, ...], door: str) -> None:
    """Refuses an `equinox.Module` at a differentiated position of a door that takes pytrees
    of arrays, where it holds something else (activation functions, Python numbers).

    Its arrays alone, still a module of the same type with `None` holes, are a pytree of
    arrays: the split the message names, taken.
    """
    found = tuple(i for i in positions(args, candidates) if not arrays_only(args[i]))
    if found:
        raise TypeError(
            f"{door} got an equinox.Module at argnums position(s) {found}; it takes pytrees "
            "of arrays there. Split the model: params, static = eqx.partition(model, "
            "eqx.is_inexact_array), and differentiate params with a loss that rebuilds it "
            "(eqx.combine(params, static)). microbatch_value_and_grad and apply_gradients "
            "take the module whole."
        )
