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
    if callable(value):
        hint = "; did you mean to call it, e.g. optax.adam(1e-3) rather than optax.adam?"
    raise TypeError(
        f"{name} must be an optax.GradientTransformation (an object with init and "
        f"update methods, e.g. optax.adam(1e-3)); got {value!r} of type "
        f"{type(value).__name__}{hint or '.'}"
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
                f"{jax.tree_util.keystr(path)} has dtype {dtype}. Gradients of "
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
        jax.tree_util.tree_leaves_with_path(tree),
        jax.tree_util.tree_leaves(reference),
        strict=True,
    )
    for (path, leaf), ref_leaf in pairs:
        if jnp.shape(ref_leaf) == (1, *jnp.shape(leaf)) and reference_name.startswith("state."):
            raise ValueError(
                f"{reference_name} leaf {jax.tree_util.keystr(path)} has shape "
                f"{jnp.shape(ref_leaf)}, the shape of {name} {jnp.shape(leaf)} with a leading "
                "replica axis of size 1: the state still has the replica axis that "
                "add_replica_axis gives it for jax.shard_map. Call "
                "gradaccum_jax.remove_replica_axis(opt_state) first thing in the shard_map "
                "body and pass that state to update (and add_replica_axis on the way out)."
            )
        if jnp.shape(leaf) != jnp.shape(ref_leaf):
            raise ValueError(
                f"{name} leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, "
                f"but {reference_name} holds shape {jnp.shape(ref_leaf)} there. Call "
                "init with the same parameter tree whose gradients you pass to update."
            )


def check_positive_scalar(name: str, value: Any) -> jax.Array:
    """Returns ``value`` as a float32 scalar, or raises if it is not a finite real ``> 0``.

    Traced values are checked for shape and dtype only; their value is known
    only when the program runs.
    """
    dtype = jnp.result_type(value)
    if jnp.issubdtype(dtype, jnp.bool_) or not (
        jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    ):
        raise TypeError(f"{name} must be a real scalar; got {value!r} with dtype {dtype}.")
    if jnp.ndim(value) != 0:
        raise ValueError(f"{name} must be a scalar; got shape {jnp.shape(value)}.")
    if not isinstance(value, jax.core.Tracer):
        number = float(value)
        if not (np.isfinite(number) and number > 0):
            raise ValueError(f"{name} must be finite and > 0; got {name}={number!r}.")
    return jnp.asarray(value, jnp.float32)


def find_unique_state(opt_state: Any, state_type: type, made_by: str) -> Any:
    """Returns the one ``state_type`` value inside ``opt_state``, or raises ``ValueError``."""
    found = [
        leaf
        for leaf in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, state_type)
        )
        if isinstance(leaf, state_type)
    ]
    if len(found) != 1:
        raise ValueError(
            f"opt_state must contain exactly one {state_type.__name__} (the state of "
            f"{made_by}); found {len(found)}. Pass the optimizer state that holds it, "
            "e.g. state.opt_state for a Flax TrainState."
        )
    return found[0]


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """Returns ``value`` as an int, or raises if it is not an integer ``>= minimum``.

    Unlike :func:`check_positive_int` its message does not suggest a schedule,
    for arguments that must be a plain count.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be a Python int >= {minimum}; got {name}={value!r} of type "
            f"{type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {name}={value!r}.")
    return int(value)


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """Returns ``value`` if it is one of the strings in ``allowed``, else raises ``ValueError``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(
            f"{name} must be one of {', '.join(repr(a) for a in allowed)}; got {name}={value!r}."
        )
    return value


def check_finite_real(name: str, value: Any) -> float:
    """Returns ``value`` as a float, or raises if it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number such as 1.0; got {name}={value!r} of type "
            f"{type(value).__name__}."
        )
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite; got {name}={value!r}.")
    return value


def check_int_scalar(name: str, value: Any) -> jax.Array:
    """Returns ``value`` as an ``int32`` scalar, or raises if it is not an integer scalar."""
    dtype = jnp.result_type(value)
    if jnp.issubdtype(dtype, jnp.bool_) or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"{name} must be an integer scalar such as a step count; got {name}={value!r} "
            f"with dtype {dtype}."
        )
    if jnp.ndim(value) != 0:
        raise ValueError(f"{name} must be a scalar; got shape {jnp.shape(value)}.")
    if not isinstance(value, jax.core.Tracer):
        as_int = int(value)
        info = jnp.iinfo(jnp.int32)
        if not info.min <= as_int <= info.max:
            raise ValueError(f"{name} must fit in int32; got {name}={as_int!r}.")
    return jnp.asarray(value, jnp.int32)


def check_hyperparameter(
    name: str, value: Any, *, allow_zero: bool = True, allow_none: bool = False
) -> Any:
    """Checks a real, finite, non-negative hyperparameter; returns it unchanged.

    Python numbers and concrete scalar arrays are checked by value. Traced
    scalars (``optax.inject_hyperparams`` builds the transform inside ``jit``)
    are checked only for shape, since their value is not known yet.
    """
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a real number; got {name}=None.")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        check_nonnegative_float(name, value, allow_zero=allow_zero)
        return value
    dtype = getattr(value, "dtype", None)
    if dtype is None or isinstance(value, bool) or not jnp.issubdtype(dtype, jnp.number):
        raise TypeError(
            f"{name} must be a real number{' or None' if allow_none else ''}; got "
            f"{value!r} of type {type(value).__name__}."
        )
    if jnp.ndim(value) != 0:
        raise ValueError(f"{name} must be a scalar; got shape {jnp.shape(value)}.")
    if not isinstance(value, jax.core.Tracer):
        check_nonnegative_float(name, float(value), allow_zero=allow_zero)
    return value


def check_float_dtype(name: str, value: Any) -> jnp.dtype:
    """Returns ``value`` as a dtype, or raises ``TypeError`` unless it is a floating dtype."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{name} must be a floating-point dtype such as jnp.float32 or jnp.bfloat16; "
            f"got {name}={value!r}."
        )
    return dtype


def check_axis_name(name: str, value: Any) -> tuple[Any, ...]:
    """Returns ``value`` as a tuple of mapped-axis names, or raises if it is not one.

    A single hashable name becomes a 1-tuple; a tuple or list of names keeps its
    order. Sets are refused: collectives need a fixed order of names.
    """
    names = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    bad = isinstance(value, (set, frozenset)) or not names
    for axis in names:
        try:
            hash(axis)
        except TypeError:
            bad = True
        if axis is None or isinstance(axis, (tuple, list, set, frozenset)):
            bad = True
    if bad:
        raise TypeError(
            f"{name} must be the name of a mapped axis (such as 'data') or a non-empty "
            f"tuple of names (such as ('host', 'device')); got {name}={value!r}. Use "
            "the names given to jax.make_mesh or jax.pmap(..., axis_name=...)."
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{name} must not repeat an axis; got {name}={value!r}.")
    return names


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


def check_real_scalar(subject: str, value: Any, *, hint: str = "") -> jax.Array:
    """Returns a real (integer or floating) scalar as ``float32``, or raises.

    ``subject`` starts the message, e.g. ``"weight"`` or ``"staleness_weight's
    result"``; ``hint`` is appended to the shape error to say how to fix it.
    Works on traced values (only dtype and shape are checked).
    """
    dtype = jnp.result_type(value)
    if jnp.issubdtype(dtype, jnp.bool_) or not (
        jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    ):
        raise TypeError(f"{subject} must be a real scalar; got {value!r} with dtype {dtype}.")
    if jnp.ndim(value) != 0:
        raise ValueError(f"{subject} must be a scalar; got shape {jnp.shape(value)}.{hint}")
    return jnp.asarray(value, jnp.float32)
