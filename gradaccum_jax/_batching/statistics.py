"""Global-batch statistics for `microbatch_value_and_grad(..., statistics_fn=...)`.

Some losses depend on sums over the whole batch that carry no gradient, such as
the fraction of tokens each expert of a mixture-of-experts layer receives. A
mean of per-micro-batch losses is then another objective. How it reads:
`check_options` checks the keyword once; when the function is called,
`global_sums` runs a first pass over the same micro-batches (same keys) as the
gradient pass, sums `statistics_fn` over them in a dtype that keeps the sums
exact (`summed_dtype`) and over the devices of `axis_name`; `bind` hands the
sums to the loss as `statistics=`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import validation
from gradaccum_jax._base.compat import varying_axes


def check_options(
    statistics_fn: Any, axis_name: Any, carry_nums: tuple[int, ...], carry_argnums: Any
) -> tuple[Any, ...] | None:
    """Checks `statistics_fn` and `axis_name`; returns `axis_name` as a tuple (or `None`)."""
    if statistics_fn is not None and not callable(statistics_fn):
        raise TypeError(
            f"statistics_fn must be callable or None; got {statistics_fn=!r}. Pass a function "
            "with the loss's signature that returns a pytree of sums over its micro-batch."
        )
    if axis_name is not None and statistics_fn is None:
        raise ValueError(
            f"axis_name={axis_name!r} sums statistics_fn's statistics over devices, but no "
            "statistics_fn is given. Drop axis_name: the gradients' reduction over devices "
            "is the caller's (jax.lax.pmean, or accumulate(..., axis_name=...))."
        )
    if statistics_fn is not None and carry_nums:
        raise ValueError(
            f"statistics_fn cannot be used with carry_argnums={carry_argnums!r}: the first "
            "pass, which sums the statistics, runs before the carried state of the "
            "micro-batches exists. Compute the statistics from the parameters and the batch "
            "only, or carry the state outside microbatch_value_and_grad."
        )
    if axis_name is None:
        return None
    return validation.check_axis_name("axis_name", axis_name)


_ALLOWED = (
    "Return arrays (or Python / NumPy scalars) of integers or bools for counts and of "
    "floats for sums."
)


def summed_dtype(dtype: Any, where: str) -> Any:
    """The dtype a statistic of `dtype` is summed in: exact for counts, float32 for 16-bit floats.

    Booleans are counted in int32, other integers are summed in at least 32 bits
    (exact up to 2**31 - 1 for int32 and 2**32 - 1 for uint32), and floats in at
    least float32.
    """
    if jnp.issubdtype(dtype, jnp.bool_):
        return jnp.dtype(jnp.int32)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return jnp.promote_types(dtype, jnp.uint32)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.promote_types(dtype, jnp.int32)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.promote_types(dtype, jnp.float32)
    raise TypeError(
        f"statistics_fn must return numbers (sums over its micro-batch); {where} has dtype "
        f"{dtype}. {_ALLOWED}"
    )


def _leaf_dtype(path: Any, leaf: Any) -> Any:
    """The dtype `leaf` (a leaf of what `statistics_fn` returned) is summed in."""
    where = f"the leaf at {jax.tree_util.keystr(path)!r}"
    # Arrays, tracers and NumPy scalars carry a dtype; Python numbers take JAX's
    # (weak) one. Anything else (a string, an object) has no number to sum.
    if hasattr(leaf, "dtype"):
        dtype = leaf.dtype
    elif isinstance(leaf, (bool, int, float, complex)):
        dtype = jnp.result_type(leaf)
    else:
        raise TypeError(
            f"statistics_fn must return numbers (sums over its micro-batch); {where} is "
            f"{leaf!r:.60} of type {type(leaf).__name__}. {_ALLOWED}"
        )
    # NumPy's 64-bit dtypes narrow to JAX's 32-bit ones unless x64 is on, as jnp.asarray does.
    return jax.dtypes.canonicalize_dtype(summed_dtype(dtype, f"{where} ({type(leaf).__name__})"))


def _cast(tree: Any) -> Any:
    """`tree` in the dtypes its sums are kept in."""
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    dtypes = [_leaf_dtype(path, x) for path, x in paths_and_leaves]
    cast = [jnp.asarray(x).astype(d) for (_, x), d in zip(paths_and_leaves, dtypes, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, cast)


def global_sums(
    statistics_fn: Callable[..., Any],
    k: int,
    inputs: Callable[[jax.Array], tuple[list[Any], dict[str, Any]]],
    axis_name: tuple[Any, ...] | None,
) -> Any:
    """The first pass: `statistics_fn` summed over the `k` micro-batches and the devices.

    `inputs(i)` gives micro-batch `i`'s arguments, as the gradient pass gets them.
    Under global-view `jit` the statistics of a batch sharded over devices are
    whole-batch sums already (XLA reduces them over the devices); inside
    `shard_map` they are this device's, and `axis_name` sums them.
    """
    if k == 1:
        args, kwargs = inputs(jnp.int32(0))
        total = _cast(statistics_fn(*args, **kwargs))
    else:

        def body(_: None, i: jax.Array) -> tuple[None, Any]:
            args, kwargs = inputs(i)
            return None, _cast(statistics_fn(*args, **kwargs))

        # The K micro-batches' statistics are stacked, not carried: a carry would have
        # to match their sharding and varying axes, and statistics are small.
        _, stacked = jax.lax.scan(body, None, jnp.arange(k, dtype=jnp.int32))
        total = jax.tree.map(lambda s: jnp.sum(s, axis=0, dtype=s.dtype), stacked)
    if axis_name is not None:
        total = jax.lax.psum(total, axis_name)
    _check_invariant(total, axis_name)
    return total


def _check_invariant(total: Any, axis_name: tuple[Any, ...] | None) -> None:
    """Refuses statistics that still differ between the devices of a `shard_map`."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(total):
        varying = varying_axes(leaf)
        if varying:
            fix = (
                "pass axis_name= with those axes"
                if axis_name is None
                else f"add them to axis_name={axis_name!r}"
            )
            raise ValueError(
                f"the statistic at {jax.tree_util.keystr(path)!r} still varies over the "
                f"mesh axes {sorted(varying)} of the shard_map: each device would use its own "
                f"sums, not the whole batch's. To sum them over the devices, {fix}."
            )


def bind(fun: Callable[..., Any], sums: Any, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """`fun` with `statistics=sums`: what every micro-batch's loss is called with."""
    if "statistics" in kwargs:
        raise TypeError(
            "with statistics_fn, microbatch_value_and_grad passes statistics= to the loss "
            "itself; the call also passed a keyword argument 'statistics'. Rename it."
        )
    return functools.partial(fun, statistics=sums)
