"""A data-parallel step's per-device values reduced over the devices, each leaf by its rule.

Inside `jax.shard_map` or `jax.pmap` each device computes the value and
gradient of its own shard of the batch, and the step's are their mean over the
devices (`jax.lax.pmean`). Flax's fp8 metadata are not additive: the large
batch's amax is the max over all of its examples, so those leaves take the
max over the devices (`jax.lax.pmax`; `_base/reduce_rules.py` marks them), as
they take the max over the micro-batches inside `microbatch_value_and_grad`.
"""

from __future__ import annotations

from typing import Any

import jax

from gradaccum_jax._base import collectives, reduce_rules, validation

_REDUCTIONS = {"mean": jax.lax.pmean, "sum": jax.lax.psum}


def reduce_replicas(
    tree: Any, axis_name: Any, *, reduction: str = "mean", max_leaves: Any = "auto"
) -> Any:
    """Reduces per-device values over `axis_name`: their mean (or sum), fp8 metadata their max.

    Use it in place of `jax.lax.pmean(tree, axis_name)` on the value and
    gradient that each device computed on its shard of the batch (inside
    `jax.shard_map` or `jax.pmap`): it is that mean for every leaf except the
    gradient leaves combined by max, Flax's fp8 scales and amax histories
    (whose "gradient" is their new value), which take `jax.lax.pmax`. A mean
    would under-estimate the amax.

    With the default `reduction="mean"` each device's backward starts from
    its own mean loss, so its cotangents are `R` times the large batch's (`R`
    devices): the scales and the input and kernel amaxes are the large
    batch's, the output-gradient amax is in the units of the backward that
    each device runs (as for a window of calls; see the mixed-precision
    guide). For the large batch's output-gradient amax as well, differentiate
    each device's share of the global loss (its mean loss divided by `R`) and
    pass `reduction="sum"`: the sum of the shares is the large batch's value
    and gradient, and every cotangent is the large batch's.

    Args:
      tree: The per-device values, e.g. the `(loss, grads)` of
        `microbatch_value_and_grad` or `jax.value_and_grad`.
      axis_name: The mapped axis (or tuple of axes) over which the batch is
        split.
      reduction: `"mean"` (`jax.lax.pmean`) or `"sum"` (`jax.lax.psum`), for
        every leaf that is not combined by max.
      max_leaves: The leaves combined by max: `"auto"` (Flax's fp8
        metadata), `None` (none) or a callable `(path, leaf) -> bool`, as in
        `microbatch_value_and_grad`.

    Returns:
      `tree` reduced over the devices: replica-invariant, so that
      `jax.shard_map` returns it with `out_specs=P()`.

    Raises:
      TypeError: If `axis_name` is not a name or a tuple of names.
      ValueError: If `reduction` or `max_leaves` is not one of the above, or
        an axis of `axis_name` is not bound where it is called.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tree = {"grad": jnp.arange(4.0), "_overwrite_with_gradient": {"amax": jnp.arange(4.0)}}
      >>> out = jax.pmap(lambda t: ga.reduce_replicas(t, "i"), axis_name="i")(tree)
      >>> out["grad"][0], out["_overwrite_with_gradient"]["amax"][0]
      (Array(1.5, dtype=float32), Array(3., dtype=float32))
    """
    names = validation.check_axis_name("axis_name", axis_name)
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise ValueError(
            f"reduction must be 'mean' (each device's value is its shard's mean) or 'sum' "
            f"(each device's value is its share of the global one); got {reduction=!r}."
        )
    mask = reduce_rules.max_mask(tree, reduce_rules.check_max_leaves(max_leaves))
    typed = collectives.check_axes_bound("axis_name", names)
    # One collective for the leaves of each rule, as `jax.lax.pmean` of a tree is one.
    leaves, treedef = jax.tree.flatten(tree)
    marks = jax.tree.leaves(mask)
    plain = [leaf for leaf, is_max in zip(leaves, marks, strict=True) if not is_max]
    tops = [
        reduce_rules.as_float(leaf) for leaf, is_max in zip(leaves, marks, strict=True) if is_max
    ]
    reduced = iter(_REDUCTIONS[reduction](plain, names) if plain else [])
    maxima = iter(collectives.pmax(tops, names, typed) if tops else [])
    return jax.tree.unflatten(
        treedef,
        [
            jax.lax.convert_element_type(next(maxima), leaf.dtype) if is_max else next(reduced)
            for leaf, is_max in zip(leaves, marks, strict=True)
        ],
    )
