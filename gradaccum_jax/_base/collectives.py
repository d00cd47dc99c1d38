"""Cross-replica pieces of `accumulate(axis_name=...)`.

Inside `jax.shard_map` with `check_vma=True` (the default) every value has
a type that records the mesh axes along which it may differ between replicas
(its *varying* axes). `jax.lax.cond` needs both branches to return the same
types, and `jax.lax.psum` needs its operand to vary along every axis it sums
over. Under `jax.pmap` or `check_vma=False` there are no such types and the
helpers here reduce to plain `psum` and `cond`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base.compat import pcast_to_varying, varying_axes


def check_axes_bound(arg_name: str, axis_names: tuple[Any, ...]) -> bool:
    """Raises unless every axis is bound; returns whether varying types are checked."""
    for axis in axis_names:
        try:
            jax.lax.axis_size(axis)
        except NameError as err:
            raise ValueError(
                f"{arg_name}={axis_names if len(axis_names) > 1 else axis_names[0]!r}: "
                f"the axis {axis!r} is not bound where update runs. Call update inside "
                f"jax.shard_map over a mesh with an axis named {axis!r} (or inside "
                f"jax.pmap(..., axis_name={axis!r})); for training on one device, or "
                "under jax.jit with sharded arrays, build accumulate without axis_name."
            ) from err
    # An axis index varies along its axis exactly when shard_map checks types.
    return any(axis in varying_axes(jax.lax.axis_index(axis)) for axis in axis_names)


def check_grads_vary(name: str, tree: Any, axis_names: tuple[Any, ...]) -> None:
    """Raises if a gradient is already replica-invariant, i.e. already reduced."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        missing = [axis for axis in axis_names if axis not in varying_axes(leaf)]
        if missing:
            axes = missing[0] if len(missing) == 1 else tuple(missing)
            raise ValueError(
                f"{name} leaf {jax.tree_util.keystr(path)!r} has a replica-invariant type "
                f"along {axes!r}, so it was already reduced across replicas (an all-reduce "
                "on every micro-step) and accumulate would sum it again. A "
                "jax.lax.pmean or psum of the gradients in your step does that: drop the "
                "pmean, accumulate averages across replicas once per window. So does "
                "differentiating with respect to replicated params inside shard_map; mark "
                "them varying first: "
                f"jax.grad(loss)(jax.lax.pcast(params, {axes!r}, to='varying'), batch) "
                "(jax.lax.pvary(params, axes) before JAX 0.8.2)."
            )


def _pvary(x: jax.Array, axes: Any) -> jax.Array:
    missing = tuple(axis for axis in axes if axis not in varying_axes(x))
    return pcast_to_varying(x, missing) if missing else x


def psum(tree: Any, axis_names: tuple[Any, ...], typed: bool) -> Any:
    """Sums `tree` across `axis_names`.

    An operand typed invariant (the same on every replica) is cast to varying
    first, so it adds up once per replica like any other, and so that a tuple
    of names works when a value varies along only some of them.
    """
    if typed:
        tree = jax.tree.map(lambda x: _pvary(x, axis_names), tree)
    return jax.lax.psum(tree, axis_names)


def pmax(tree: Any, axis_names: tuple[Any, ...], typed: bool) -> Any:
    """The elementwise max of `tree` across `axis_names` (typed operands cast as in `psum`)."""
    if typed:
        tree = jax.tree.map(lambda x: _pvary(x, axis_names), tree)
    return jax.lax.pmax(tree, axis_names)


def agree(flag: jax.Array, axis_names: tuple[Any, ...], typed: bool) -> jax.Array:
    """`flag` and-ed across the mesh axes it varies along other than `axis_names`.

    A model split over other mesh axes as well (pipeline stages, tensor shards)
    holds each replica's micro-gradient in parts; a finite check of one part
    would let the devices holding the others disagree. One scalar all-reduce
    over those axes (none when the flag varies along no other axis) makes the
    flag the same on all of them. Without types (`jax.pmap`,
    `check_vma=False`) the other axes are unknown and `flag` is returned as is.
    """
    if not typed:
        return flag
    # Sorted, so that the traced program does not depend on a set's order.
    others = tuple(sorted(varying_axes(flag) - set(axis_names), key=str))
    if not others:
        return flag
    # A min of 0s and 1s is their and (int32, as the unreduced route's agreement).
    return jax.lax.pmin(flag.astype(jnp.int32), others).astype(jnp.bool_)


def zeros_without_axes(leaf: jax.Array, dtype: Any = None, zero: Any = None) -> jax.Array:
    """Zeros shaped like `leaf` that vary along no axis (`zeros_like` would keep them).

    A scalar `zero` that varies along no axis either is broadcast instead of
    the constant 0 (see `distinct_zero` in `_window/engine.py`); one that varies is ignored,
    as it would make the zeros vary.
    """
    dtype = jnp.result_type(leaf) if dtype is None else dtype
    zeros = jnp.zeros(jnp.shape(leaf), dtype, out_sharding=jax.typeof(leaf).sharding)
    if zero is None or varying_axes(zero):
        return zeros
    return zeros + jnp.asarray(zero).astype(dtype)


def cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, *operands, typed: bool) -> Any:
    """`jax.lax.cond` whose branch outputs are raised to their joint varying axes.

    Each output leaf gets the union of the axes along which either branch's
    version varies, so a branch that returns invariant zeros matches one that
    returns a reduced (invariant) update without widening it.
    """
    if not typed:
        return jax.lax.cond(pred, true_fn, false_fn, *operands)
    true_out = jax.eval_shape(true_fn, *operands)
    false_out = jax.eval_shape(false_fn, *operands)
    joint = jax.tree.map(lambda a, b: varying_axes(a) | varying_axes(b), true_out, false_out)

    def raised(fn: Callable) -> Callable:
        def branch(*args):
            return jax.tree.map(_pvary, fn(*args), joint)

        return branch

    return jax.lax.cond(pred, raised(true_fn), raised(false_fn), *operands)
