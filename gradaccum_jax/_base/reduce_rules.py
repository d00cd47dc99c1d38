"""Per-leaf reduce rules: which leaves of a gradient tree combine by max, not by mean.

Flax's fp8 delayed scaling (`flax.linen.fp8_ops`) keeps each fp8 layer's
scales and amax histories in the `_overwrite_with_gradient` collection, and
returns their new values as their "gradients". Over one large batch the new
amax slot is the amax of the whole batch, which is the max of the
micro-batches' amax slots; the rest of the new history and the new scale come
from the old history, the same in every micro-batch. So these leaves combine
by an elementwise max, as Flax's own fp8 meta dtype adds them (max from
`-inf`), and a mean would under-estimate the amax.

A leaf is max-reduced, under `max_leaves="auto"`, when its key path passes
through a key named `_overwrite_with_gradient` (linen), when it sits in a
`flax.nnx` variable of that type (a linen fp8 layer under `nnx.bridge`), or
when its dtype is Flax's fp8 meta dtype. An explicit rule is a callable
`max_leaves(path, leaf) -> bool`; `None` max-reduces nothing. Nothing here
imports flax: the names are matched as strings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

#: The collection name that flax.linen.fp8_ops gives the fp8 metadata (its OVERWRITE_WITH_GRADIENT).
FP8_COLLECTION = "_overwrite_with_gradient"

#: The attribute in which `gradaccum_jax.flax`'s containers hold the running max of a
#: window's fp8 metadata. It differs between replicas until the window's close, so the
#: replica-axis helpers (`_window/specs.py`) look for it by name.
FP8_WINDOW_MAX = "fp8_window_max"


def check_max_leaves(max_leaves: Any) -> Any:
    """`max_leaves` if it is `"auto"`, `None` or a callable; else a `ValueError` that says so."""
    if (
        max_leaves is None
        or callable(max_leaves)
        or (isinstance(max_leaves, str) and max_leaves == "auto")
    ):
        return max_leaves
    raise ValueError(
        f"max_leaves must be 'auto' (Flax's fp8 metadata), None (no leaf) or a callable "
        f"(path, leaf) -> bool naming the gradient leaves combined by max; got {max_leaves=!r}."
    )


def _key_name(entry: Any) -> Any:
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            return getattr(entry, attribute)
    return entry


def in_collection(path: Any, name: str) -> bool:
    """Whether a key path passes through a key (dict key, attribute) called `name`."""
    return any(_key_name(entry) == name for entry in path)


def is_fp8_variable(node: Any) -> bool:
    """Whether `node` is a `flax.nnx` variable of Flax's fp8 metadata collection."""
    # nnx.bridge gives a linen collection a flax.nnx Variable type of the same name.
    return type(node).__name__ == FP8_COLLECTION


def is_fp8_meta_dtype(dtype: Any) -> bool:
    """Whether `dtype` is Flax's fp8 meta dtype (`fp8_ops.fm32`, `fp32_max_grad`)."""
    return (
        dtype is not None
        and jnp.issubdtype(dtype, jax.dtypes.extended)
        and type(dtype).__name__.startswith("fp8_meta_dtype")
    )


def _auto(path: Any, leaf: Any) -> bool:
    return in_collection(path, FP8_COLLECTION) or is_fp8_meta_dtype(getattr(leaf, "dtype", None))


def max_mask(tree: Any, max_leaves: Any = "auto") -> Any:
    """A tree of `bool` shaped like `tree`: `True` at the leaves combined by max.

    Args:
      tree: A gradient tree (arrays or `jax.ShapeDtypeStruct`), linen variables or an
        `nnx.State` included.
      max_leaves: `"auto"`, `None` or a callable `(path, leaf) -> bool` (see the module).

    Returns:
      The mask, with `tree`'s structure.
    """
    if max_leaves is None:
        return jax.tree.map(lambda _: False, tree)
    rule: Callable[[Any, Any], bool] = _auto if max_leaves == "auto" else max_leaves

    def mark(path: Any, node: Any) -> Any:
        if is_fp8_variable(node) and max_leaves == "auto":
            return jax.tree.map(lambda _: True, node)
        return bool(rule(path, node))

    return jax.tree_util.tree_map_with_path(mark, tree, is_leaf=is_fp8_variable)


def any_max(mask: Any) -> bool:
    """Whether a mask from `max_mask` marks any leaf."""
    return any(jax.tree_util.tree_leaves(mask))


def max_paths(mask: Any) -> list[str]:
    """The key paths of the marked leaves, as text, for messages."""
    return [
        jax.tree_util.keystr(path)
        for path, marked in jax.tree_util.tree_flatten_with_path(mask)[0]
        if marked
    ]


_WINDOW_FIX = (
    "A window would average them and the inner optimizer would step them, which "
    "under-estimates the amax. Keep them out of the optimizer: give it variables['params'] "
    "only, and write the metadata beside it; gradaccum_jax.flax.TrainState does both (it "
    "keeps the window's running max and writes it when the window closes). With flax.nnx, "
    "build gradaccum_jax.flax.Optimizer(model, tx, wrt=nnx.Param) and pass its update the "
    "gradients of the metadata as well (nnx.grad with "
    "argnums=nnx.DiffState(0, nnx.Any(nnx.Param, gradaccum_jax.flax.fp8_metadata))): it "
    "does the same for the model's metadata."
)


def refuse_max_leaves(tree: Any, who: str, why_and_fix: str = _WINDOW_FIX) -> None:
    """Raises a `ValueError` if `tree` holds fp8 metadata, which `who` would get wrong."""
    paths = max_paths(max_mask(tree))
    if paths:
        shown = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
        raise ValueError(
            f"{who} got fp8 metadata leaves ({shown}): Flax's scales and amax histories, whose "
            f"'gradient' is their new value. {why_and_fix}"
        )


def max_identity(dtype: Any) -> jax.Array:
    """The start of a running max in `dtype`: `-inf`, or the lowest finite value."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf, dtype)
    return jnp.array(jnp.iinfo(dtype).min, dtype)


def as_float(x: jax.Array) -> jax.Array:
    """`x`, or its float view if it has Flax's fp8 meta dtype (which has no arithmetic)."""
    if is_fp8_meta_dtype(x.dtype):
        return jax.lax.convert_element_type(x, float_dtype(x.dtype))
    return x


def float_dtype(dtype: Any) -> Any:
    """The dtype in which a leaf of `dtype` is compared: its float dtype for fp8 meta."""
    # The fp8 meta dtype is a JAX extended dtype holding its float dtype.
    return getattr(dtype, "float_dtype", dtype) if is_fp8_meta_dtype(dtype) else dtype
