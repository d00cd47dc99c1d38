"""Argument checks shared by the transformations.

Every check raises a ``ValueError`` or ``TypeError`` whose message names the
argument, shows the offending value and says what would be accepted, so a
user can fix the call without reading the source.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def check_gradient_transformation(name: str, value: Any) -> None:
    """Raises ``TypeError`` unless ``value`` has callable ``init`` and ``update``."""
    if isinstance(value, optax.GradientTransformation):
        return
    init = getattr(value, "init", None)
    update = getattr(value, "update", None)
    if callable(init) and callable(update):
        return
    hint = ""
    if hasattr(value, "gradient_transformation"):
        hint = " (for optax.MultiSteps, pass the optimizer it wraps instead)"
    raise TypeError(
        f"{name} must be an optax.GradientTransformation (an object with init and "
        f"update methods, e.g. optax.adam(1e-3)); got {value!r} of type "
        f"{type(value).__name__}{hint}."
    )


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """Returns ``value`` as an int, or raises if it is not an integer ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be a Python int >= {minimum}; got {value!r} of type "
            f"{type(value).__name__}. Pass an int such as {name}=4, or a callable "
            "for a schedule."
        )
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {name}={value!r}.")
    return int(value)


def check_nonnegative_float(name: str, value: Any, *, allow_zero: bool = True) -> float:
    """Returns ``value`` as a float, or raises if it is negative, non-finite or not a number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number; got {value!r} of type {type(value).__name__}."
        )
    value = float(value)
    bad = not np.isfinite(value) or value < 0 or (value == 0 and not allow_zero)
    if bad:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}; got {name}={value!r}.")
    return value


def check_float_tree(name: str, tree: Any) -> None:
    """Raises ``TypeError`` if any leaf of ``tree`` is not a floating-point array."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"{name} must contain floating-point arrays; the leaf at "
                f"{jax.tree_util.keystr(path)!r} has dtype {dtype}. Gradients of "
                "integer inputs are not accumulated: cast to a float dtype, or mask "
                "those leaves out with optax.masked."
            )


def check_same_structure(name: str, tree: Any, reference_name: str, reference: Any) -> None:
    """Raises ``ValueError`` unless ``tree`` matches ``reference`` in structure and shapes."""
    tree_def = jax.tree_util.tree_structure(tree)
    ref_def = jax.tree_util.tree_structure(reference)
    if tree_def != ref_def:
        raise ValueError(
            f"{name} does not have the structure of {reference_name}: got {tree_def}, "
            f"expected {ref_def}. Call init with the same parameter tree whose "
            "gradients you pass to update."
        )
    pairs = zip(
        jax.tree_util.tree_leaves_with_path(tree), jax.tree_util.tree_leaves(reference), strict=True
    )
    for (path, leaf), ref_leaf in pairs:
        if jnp.shape(leaf) != jnp.shape(ref_leaf):
            raise ValueError(
                f"{name} leaf {jax.tree_util.keystr(path)!r} has shape {jnp.shape(leaf)}, "
                f"but {reference_name} holds shape {jnp.shape(ref_leaf)} there. Call "
                "init with the same parameter tree whose gradients you pass to update."
            )


def check_unit_interval(name: str, value: Any) -> float:
    """Returns ``value`` as a float, or raises unless it is a real number in ``[0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number in [0, 1]; got {value!r} of type {type(value).__name__}."
        )
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1]; got {name}={value!r}.")
    return value
