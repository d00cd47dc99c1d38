"""Argument checks shared by the transformations.

Every check raises a `ValueError` or `TypeError` whose message names the
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

from gradaccum_jax._base import compat


def check_gradient_transformation(name: str, value: Any) -> None:
    """Raises `TypeError` unless `value` has callable `init` and `update`."""
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


def check_float_tree(name: str, tree: Any) -> None:
    """Raises `TypeError` if any leaf of `tree` is not a floating-point array."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"{name} must contain floating-point arrays; the leaf at "
                f"{jax.tree_util.keystr(path)} has dtype {dtype}. An integer or boolean "
                "leaf has no gradient to accumulate (jax.grad refuses it, or returns "
                "float0 zeros with allow_int=True), so it is refused rather than given a "
                "float buffer that only ever holds zeros. Keep such leaves out of the "
                "optimized tree, cast them to a float dtype, or wrap the transformation "
                "in optax.masked with a mask that is False for them."
            )


def refuse_unreduced(name: str, tree: Any, who: str) -> None:
    """Raises `ValueError` if a leaf of `tree` is typed unreduced over mesh axes.

    Unreduced gradients (from `unreduced_value_and_grad`) are per-device partial
    sums; a transformation that is not linear in them (a norm, a clip, a
    finiteness test) would act on each device's part instead of their sum.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, jax.Array | jax.core.Tracer):
            continue
        spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None)
        axes = getattr(spec, "unreduced", None)
        if axes:
            shown = sorted(axes, key=str)
            raise ValueError(
                f"{who} got {name} leaf {jax.tree_util.keystr(path)} typed unreduced over "
                f"mesh axes {shown} ({jax.typeof(leaf)}): per-device partial sums, as "
                "unreduced_value_and_grad returns them, which it cannot act on (it would "
                "act on each device's part instead of their sum). Put it inside accumulate, "
                "which reduces the window once at its close: gradaccum_jax.accumulate("
                "optax.chain(<this transformation>, <optimizer>), K) (K=1 reduces every "
                "step), or reduce the gradients first: jax.reshard(grads, <the params' "
                "PartitionSpecs>)."
            )


def check_same_structure(name: str, tree: Any, reference_name: str, reference: Any) -> None:
    """Raises `ValueError` unless `tree` matches `reference` in structure and shapes."""
    tree_def = jax.tree_util.tree_structure(tree)
    ref_def = jax.tree_util.tree_structure(reference)
    if tree_def != ref_def:  # type: ignore[operator]  # jaxlib's PyTreeDef stub
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


def _looks_like(node: Any, state_type: type) -> bool:
    # Restoring may drop empty fields (None, ()), so a subset of the fields counts.
    fields = set(getattr(state_type, "_fields", ()))
    return isinstance(node, dict) and len(node) >= 3 and set(node) <= fields


def find_unique_state(opt_state: Any, state_type: type, made_by: str) -> Any:
    """Returns the one `state_type` value inside `opt_state`, or raises `ValueError`.

    A checkpoint restored without a target (orbax with no abstract state) holds
    dicts and lists where the optimizer state had NamedTuples; the message says
    so when it finds a dict with the fields of `state_type`. A `flax.nnx`
    optimizer's state (its arrays wrapped in `nnx.Variable` s) is read through
    its values, so the state found holds plain arrays.
    """
    opt_state = compat.plain_values(opt_state)
    found = [
        leaf
        for leaf in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, state_type)
        )
        if isinstance(leaf, state_type)
    ]
    if len(found) == 1:
        return found[0]
    lookalikes = []
    if not found:
        lookalikes = [
            node
            for node in jax.tree_util.tree_leaves(
                opt_state, is_leaf=lambda x: _looks_like(x, state_type)
            )
            if _looks_like(node, state_type)
        ]
    if lookalikes:
        raise ValueError(
            f"opt_state contains no {state_type.__name__} (the state of {made_by}), but a "
            f"dict with its fields ({', '.join(sorted(lookalikes[0]))}): it was restored "
            "from a checkpoint without a target, which gives dicts and lists instead of "
            "the optimizer's NamedTuples. Restore with the state's structure as target, "
            "e.g. ocp.StandardCheckpointer().restore(path, jax.eval_shape(tx.init, params))."
        )
    raise ValueError(
        f"opt_state must contain exactly one {state_type.__name__} (the state of "
        f"{made_by}); found {len(found)} in a {type(opt_state).__name__}. Pass the "
        "optimizer state that holds it, e.g. state.opt_state for a Flax TrainState."
    )


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """Returns `value` if it is one of the strings in `allowed`, else raises `ValueError`."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(
            f"{name} must be one of {', '.join(repr(a) for a in allowed)}; got {name}={value!r}."
        )
    return value


def check_hyperparameter(
    name: str, value: Any, *, allow_zero: bool = True, allow_none: bool = False
) -> Any:
    """Checks a real, finite, non-negative hyperparameter; returns it unchanged.

    Python numbers and concrete scalar arrays are checked by value. Traced
    scalars (`optax.inject_hyperparams` builds the transform inside `jit`)
    are checked only for shape, since their value is not known yet.
    """
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a real number; got {name}=None.")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        check_real(name, value, minimum=0.0, exclusive=not allow_zero)
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
        check_real(name, float(value), minimum=0.0, exclusive=not allow_zero)
    return value


def check_axis_name(name: str, value: Any) -> tuple[Any, ...]:
    """Returns `value` as a tuple of mapped-axis names, or raises if it is not one.

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


def check_int(name: str, value: Any, *, minimum: int = 1, schedule: bool = False) -> int:
    """Returns `value` as an int, or raises if it is not a Python integer `>= minimum`.

    With `schedule=True` the message says that a callable (a schedule) is
    accepted too; only arguments that do accept one pass it.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        alternative = ", or a callable for a schedule" if schedule else ""
        raise TypeError(
            f"{name} must be a Python int >= {minimum}; got {name}={value!r} of type "
            f"{type(value).__name__}. Pass an int such as {name}={max(minimum, 4)}"
            f"{alternative}."
        )
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {name}={value!r}.")
    return int(value)


def _bound_text(minimum: float | None, maximum: float | None, exclusive: bool) -> str:
    parts = ["finite"]
    if minimum is not None:
        parts.append(f"{'>' if exclusive else '>='} {minimum:g}")
    if maximum is not None:
        parts.append(f"<= {maximum:g}")
    return " and ".join(parts)


def check_real(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive: bool = False,
) -> float:
    """Returns a Python real number as a float, or raises unless it is finite and in range.

    `minimum` is excluded when `exclusive` is set; `maximum` is always included.
    A JAX array (traced or not) is refused with the fix for its usual origin,
    `optax.inject_hyperparams`, which turns every numeric argument into one.
    """
    if isinstance(value, jax.Array):
        raise TypeError(
            f"{name} must be a Python number such as 1.0, fixed when the transformation "
            f"is built; got {name}={value!r}, a JAX array. optax.inject_hyperparams "
            f"passes every numeric argument as an array: keep {name!r} static with "
            f"optax.inject_hyperparams(..., static_args=({name!r},)), or pass "
            f"{name}=float(...)."
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number such as 1.0; got {name}={value!r} of type "
            f"{type(value).__name__}."
        )
    value = float(value)
    too_low = minimum is not None and (value <= minimum if exclusive else value < minimum)
    too_high = maximum is not None and value > maximum
    if not np.isfinite(value) or too_low or too_high:
        raise ValueError(
            f"{name} must be {_bound_text(minimum, maximum, exclusive)}; got {name}={value!r}."
        )
    return value


def check_scalar(
    name: str,
    value: Any,
    *,
    integer: bool = False,
    minimum: float | None = None,
    exclusive: bool = False,
    dtype: Any = None,
    hint: str = "",
) -> jax.Array:
    """Returns a scalar (a Python number or a 0-d array, traced or not) as an array, or raises.

    `integer=True` asks for an integer scalar and returns `int32`; otherwise
    integer and floating scalars are accepted and returned as `dtype` (float32
    by default). Traced values are checked for type and shape only; concrete
    ones also for their value: finite, `>= minimum` (`>` when `exclusive`),
    and representable in the dtype they are used in, neither overflowing to
    infinity nor flushing to zero (XLA flushes subnormals). `hint` follows
    the shape error and says how to fix it.
    """
    kind = "an integer scalar" if integer else "a real scalar"
    if isinstance(value, (str, bytes)) or not (
        isinstance(value, (numbers.Number, np.generic, np.ndarray, jax.Array))
    ):
        raise TypeError(
            f"{name} must be {kind} (a Python number or a 0-d array); got {name}={value!r} "
            f"of type {type(value).__name__}. Pass a number, e.g. {name}=float(...), or "
            f"jnp.asarray(...).{hint}"
        )
    value_dtype = jnp.result_type(value)
    allowed = (jnp.integer,) if integer else (jnp.integer, jnp.floating)
    if jnp.issubdtype(value_dtype, jnp.bool_) or not any(
        jnp.issubdtype(value_dtype, k) for k in allowed
    ):
        raise TypeError(f"{name} must be {kind}; got {value!r} with dtype {value_dtype}.")
    if jnp.ndim(value) != 0:  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a scalar; got shape {jnp.shape(value)}.{hint}")  # type: ignore[arg-type]
    target = jnp.dtype(jnp.int32 if integer else (dtype or jnp.float32))
    if not isinstance(value, jax.core.Tracer):
        number = int(value) if integer else float(value)  # type: ignore[arg-type]
        check_real(name, number, minimum=minimum, exclusive=exclusive)
        if integer:
            info = jnp.iinfo(target)
            if not info.min <= number <= info.max:
                raise ValueError(f"{name} must fit in {target}; got {name}={number!r}.")
        else:
            finfo = jnp.finfo(target)
            if abs(number) > float(finfo.max) or 0 < abs(number) < float(finfo.tiny):
                raise ValueError(
                    f"{name}={number!r} is not representable in {target}, in which it is "
                    f"used: it would become {'inf' if abs(number) > 1 else '0'} (the normal "
                    f"range is {float(finfo.tiny):.3g} to {float(finfo.max):.3g}). Rescale "
                    f"it, e.g. divide all values of {name} by a common constant."
                )
    return jnp.asarray(value, target)


def check_accumulator_dtype(value: Any, *, compensated: Any = False) -> jnp.dtype | None:
    """Returns `accumulator_dtype` as a dtype (or `None`), or raises unless it is a float dtype.

    With `compensated=True` the dtype must be 16-bit: a compensated (Kahan)
    accumulator is a 16-bit high part with a 16-bit remainder.
    """
    if not isinstance(compensated, bool):
        raise TypeError(f"compensated must be a bool; got {compensated=!r}.")
    dtype = None
    if value is not None:
        try:
            dtype = jnp.dtype(value)
        except TypeError:
            dtype = None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                "accumulator_dtype must be None or a floating-point dtype such as "
                f"jnp.float32 or jnp.bfloat16; got accumulator_dtype={value!r}. For a "
                "compensated (Kahan) bfloat16 accumulator pass "
                "accumulator_dtype=jnp.bfloat16, compensated=True."
            )
    compensable = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if compensated and dtype not in compensable:
        raise ValueError(
            "compensated=True needs a 16-bit accumulator_dtype (jnp.bfloat16 or "
            f"jnp.float16); got accumulator_dtype={value!r}. A float32 accumulator is "
            "already more accurate than a compensated 16-bit pair of the same size."
        )
    return dtype


def check_compensable(name: str, accumulator: Any) -> None:
    """Raises `TypeError` if a compensated accumulator would hold a complex leaf."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(accumulator):
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
            raise TypeError(
                f"compensated=True does not support complex gradients; {name} leaf "
                f"{jax.tree_util.keystr(path)} is {leaf.dtype}. Drop compensated=True "
                "(complex leaves are then summed in complex64 or complex128)."
            )


def check_index_tuple(name: str, value: Any, *, allow_empty: bool) -> tuple[int, ...]:
    """Returns `value` as a tuple of argument positions, or raises.

    Accepts one non-negative int or a sequence of them, without repeats, like
    the `argnums` of `jax.value_and_grad`.
    """

    def is_index(x: Any) -> bool:
        return isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) >= 0

    indices = (value,) if is_index(value) else value
    try:
        indices = tuple(indices)
    except TypeError:
        indices = None
    if indices is None or not all(is_index(i) for i in indices):
        raise TypeError(
            f"{name} must be a non-negative int or a sequence of them (positions of "
            f"positional arguments); got {name}={value!r}."
        )
    if not indices and not allow_empty:
        raise ValueError(
            f"{name} must name at least one positional argument; got {name}={value!r}."
        )
    if len(set(indices)) != len(indices):
        raise ValueError(f"{name} must not repeat a position; got {name}={value!r}.")
    return tuple(int(i) for i in indices)
