"""How each output of a micro-batched function is combined over its micro-batches.

An `Accumulator` per output (the loss, every gradient leaf, every aux leaf),
chosen by the output spec (`output_spec`): a mean, a sum, a max (Flax's fp8
metadata, `_base/reduce_rules.py`), or the per-micro-batch values stacked and
reduced or interleaved back into batch order. `microbatch.py` and `coupled.py`
combine their scans' outputs with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import compat, reduce_rules, trees
from gradaccum_jax._base.compat import pcast_to_varying, varying_axes
from gradaccum_jax._batching.splitting import _is_choice, _Options


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """How one output of `fun` is combined over the micro-batches.

    With `K` micro-batches, the result is

        total = init()
        for i in range(K):
            total, emitted[i] = update(total, output_i, weight_i, keep_i)
        result = finalize(total, stack(emitted), sum_i weight_i)

    where `keep_i` says that micro-batch `i` has a positive weight. Reductions
    keep a running total and emit `None`; per-micro-batch outputs are emitted
    and stacked by the scan, so they keep the batch's sharding. `whole(output)`
    is the result when the batch is a single micro-batch.
    """

    init: Callable[[], Any]
    update: Callable[[Any, Any, jax.Array, jax.Array], tuple[Any, Any]]
    finalize: Callable[[Any, Any, jax.Array], Any]
    whole: Callable[[Any], Any]


def match_varying(x: jax.Array, like: Any) -> jax.Array:
    # Inside shard_map a scan carry must keep its varying axes from one
    # iteration to the next: widen an initial value to those of its successor.
    missing = varying_axes(like) - varying_axes(x)
    return pcast_to_varying(x, tuple(missing)) if missing else x


def explicit_spec(like: jax.ShapeDtypeStruct) -> Any:
    """The `PartitionSpec` of `like` if it names a mesh axis (explicit sharding), else `None`."""
    spec = getattr(getattr(like, "sharding", None), "spec", None)
    if spec is None or not (
        any(part is not None for part in compat.partitions(spec))
        or getattr(spec, "unreduced", None)
    ):
        return None
    return spec


def zeros(like: jax.ShapeDtypeStruct, dtype: Any) -> jax.Array:
    # On a mesh with explicit sharding the sharding is part of the type: a
    # total that starts replicated while the params (and so their gradients)
    # are sharded, as under FSDP, would change type in the scan carry.
    zeros = jnp.zeros(like.shape, dtype, out_sharding=explicit_spec(like))
    return match_varying(zeros, like)


def mean_accumulator(
    like: jax.ShapeDtypeStruct, dtype: Any, *, scaled: bool, masked: bool, divided: bool = True
) -> Accumulator:
    """Sum of (weight ×) output over micro-batches, divided by the total weight (if `divided`)."""

    def update(total: jax.Array, x: Any, weight: jax.Array, keep: jax.Array) -> tuple[Any, None]:
        term = jnp.asarray(x).astype(dtype)
        if scaled:
            term = term * weight.astype(dtype)
        if masked:
            # A micro-batch of zero weight (all padding) may hold 0/0 = NaN:
            # select it away, since 0 * NaN would still be NaN.
            term = jnp.where(keep, term, jnp.zeros_like(term))
        return total + term, None

    def finalize(total: jax.Array, _: None, weight_sum: jax.Array) -> jax.Array:
        return (total / weight_sum.astype(dtype) if divided else total).astype(like.dtype)

    return Accumulator(lambda: zeros(like, dtype), update, finalize, lambda x: x)


def max_accumulator(like: jax.ShapeDtypeStruct, *, masked: bool) -> Accumulator:
    """Elementwise max over micro-batches (fp8 metadata: `_base/reduce_rules.py`)."""
    dtype = reduce_rules.float_dtype(like.dtype)

    def update(total: jax.Array, x: Any, weight: jax.Array, keep: jax.Array) -> tuple[Any, None]:
        term = reduce_rules.as_float(jnp.asarray(x))
        # A micro-batch of zero weight ran its forward (its amaxes count); its backward may be 0/0.
        kept = jnp.where(keep, jnp.maximum(total, term), jnp.fmax(total, term))
        return (kept if masked else jnp.maximum(total, term)), None

    return Accumulator(
        lambda: zeros(like, dtype) + reduce_rules.max_identity(dtype),
        update,
        lambda total, _, weight_sum: jax.lax.convert_element_type(total, like.dtype),
        lambda x: x,
    )


def sum_accumulator(like: jax.ShapeDtypeStruct) -> Accumulator:
    # Booleans are counted, as jnp.sum would; at every K, so the dtype does not depend on K.
    dtype = jnp.dtype(jnp.int32) if like.dtype == jnp.bool_ else like.dtype

    def update(total: jax.Array, x: Any, weight: jax.Array, keep: jax.Array) -> tuple[Any, None]:
        return total + jnp.asarray(x).astype(dtype), None

    return Accumulator(
        lambda: zeros(like, dtype),
        update,
        lambda total, _, weight_sum: total,
        lambda x: jnp.asarray(x).astype(dtype),
    )


def stacking_accumulator(reduce: Callable[[Any], Any]) -> Accumulator:
    """Emits every micro-batch's output; `reduce` gets them stacked (leading axis K)."""
    return Accumulator(
        lambda: None,
        lambda total, x, weight, keep: (None, x),
        lambda total, stacked, weight_sum: reduce(stacked),
        lambda x: reduce(x[None]),
    )


def interleave(stacked: jax.Array) -> jax.Array:
    # Micro-batch i holds examples i, i + K, ...: (K, B/K, ...) back to batch order.
    return jnp.swapaxes(stacked, 0, 1).reshape((-1, *stacked.shape[2:]))


def concat_accumulator() -> Accumulator:
    return dataclasses.replace(stacking_accumulator(interleave), whole=lambda x: x)


def aux_accumulator(
    choice: Any, path: Any, like: jax.ShapeDtypeStruct, micro_size: int, options: _Options
) -> Accumulator:
    where = f"the aux leaf at {jax.tree_util.keystr(path)!r}"
    if callable(choice):
        return stacking_accumulator(choice)
    per_example = like.ndim >= 1 and like.shape[0] == micro_size
    if choice == "concat" or (choice == "auto" and per_example):
        if like.ndim == 0:
            raise ValueError(
                f"aux_reduction 'concat' needs a leading batch axis, but {where} is a "
                "scalar; use 'mean', 'sum' or a callable for it."
            )
        return concat_accumulator()
    if choice == "sum":
        return sum_accumulator(like)
    if not jnp.issubdtype(like.dtype, jnp.inexact):
        rule = (
            "'auto' (the default) averages every leaf that is not per-example"
            if choice == "auto"
            else "'mean' averages"
        )
        raise TypeError(
            f"aux_reduction {rule}, which needs floating-point values; {where} is "
            f"{like.dtype}{list(like.shape)}. Choose 'sum', 'concat' or a callable for it, "
            "e.g. aux_reduction={'count': 'sum', 'acc': 'auto'}."
        )
    return mean_accumulator(
        like, jnp.promote_types(like.dtype, jnp.float32), scaled=True, masked=options.weighted
    )


def aux_spec(aux: Any, micro_size: int, options: _Options) -> Any:
    """One accumulator per aux leaf, from `aux_reduction` (a pytree prefix of `aux`)."""
    try:
        choices = jax.tree.map(
            lambda r, sub: jax.tree.map(lambda _: r, sub),
            options.aux_reduction,
            aux,
            is_leaf=_is_choice,
        )
    except ValueError as err:
        raise ValueError(
            "aux_reduction must be one choice or a pytree prefix of the aux output; "
            f"aux_reduction={options.aux_reduction!r} does not match the aux structure "
            f"{jax.tree_util.tree_structure(aux)}."
        ) from err
    flat_choices = jax.tree_util.tree_leaves(choices, is_leaf=_is_choice)
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(aux)
    accumulators = [
        aux_accumulator(choice, path, like, micro_size, options)
        for choice, (path, like) in zip(flat_choices, paths_and_leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, accumulators)


def output_spec(
    value: Any, grads: Any, aux: Any, micro_size: int, options: _Options, max_mask: Any = None
) -> Any:
    """The accumulators of `(value, grads, aux)`; with a `max_mask`, of seeded backwards."""
    # With weight_fn, fun returns a weighted mean: scale it by its weight. With
    # sum_and_weight it returns a sum already; unweighted, every weight is 1.
    scaled, masked = options.weight_fn is not None, options.weighted
    value_dtype = jnp.promote_types(value.dtype, jnp.float32)
    seeded = max_mask is not None

    def grad_accumulator(g: jax.ShapeDtypeStruct, maxed: bool) -> Accumulator:
        if maxed:
            return max_accumulator(g, masked=masked)
        return mean_accumulator(
            g,
            trees.accumulator_dtype(g, options.accumulator_dtype),
            scaled=scaled and not seeded,
            masked=masked,
            divided=not seeded,
        )

    mask = max_mask if seeded else jax.tree.map(lambda _: False, grads)
    return (
        mean_accumulator(value, value_dtype, scaled=scaled, masked=masked),
        jax.tree.map(grad_accumulator, grads, mask),
        aux_spec(aux, micro_size, options),
    )


def is_accumulator(x: Any) -> bool:
    return isinstance(x, Accumulator)


def compose(spec: Any) -> Accumulator:
    """One accumulator over a pytree of outputs, from a pytree of accumulators."""
    accumulators, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_accumulator)

    def update(totals: list[Any], outputs: Any, weight: jax.Array, keep: jax.Array) -> Any:
        values = treedef.flatten_up_to(outputs)  # type: ignore[attr-defined]
        pairs = [
            a.update(t, x, weight, keep)
            for a, t, x in zip(accumulators, totals, values, strict=True)
        ]
        return [total for total, _ in pairs], [emitted for _, emitted in pairs]

    def finalize(totals: list[Any], emitted: list[Any], weight_sum: jax.Array) -> Any:
        results = [
            a.finalize(t, e, weight_sum)
            for a, t, e in zip(accumulators, totals, emitted, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, results)

    def whole(outputs: Any) -> Any:
        values = treedef.flatten_up_to(outputs)  # type: ignore[attr-defined]
        results = [a.whole(x) for a, x in zip(accumulators, values, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, results)

    return Accumulator(lambda: [a.init() for a in accumulators], update, finalize, whole)
