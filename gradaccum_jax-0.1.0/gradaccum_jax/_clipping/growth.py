"""Clippers that bound how fast the measured size may grow from one step to the next.

`clip_norm_growth` and `clip_value_growth`. The arguments mean what they mean
in `norm.py`.
"""

from __future__ import annotations

import numbers
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._base import trees, validation
from gradaccum_jax._clipping.measures import (
    _EMA_STATIC,
    Ord,
    _check_tree_dim,
    _parse_ord,
    ratio_factors,
)
from gradaccum_jax._clipping.norm import (
    _as_list,
    _from_list,
    _keep_if,
    _scale_by,
    _select,
    _size_like,
    _state_dtype,
    _tree_sizes,
    _unit_factors,
)


def _check_growth_args(add: Any, mul: Any, min_value: Any, max_decay: Any) -> None:
    validation.check_hyperparameter("add", add, allow_none=True)
    validation.check_hyperparameter("mul", mul, allow_zero=False, allow_none=True)
    validation.check_hyperparameter("min_value", min_value, allow_none=True)
    validation.check_hyperparameter("max_decay", max_decay, allow_zero=False, allow_none=True)
    if isinstance(max_decay, numbers.Real) and max_decay < 1:
        raise ValueError(
            f"max_decay must be >= 1 (the factor by which the tracked value may shrink "
            f"per step) or None; got {max_decay=}."
        )


class ClipNormGrowthState(NamedTuple):
    """State of `clip_norm_growth`.

    Attributes:
      count: `int32[]`. Updates seen so far with finite values (saturating).
      prev_norm: The tracked norm that bounds the next update: one scalar per
        leaf (`dim=None`) or one scalar (`dim="global"`), in float32 (or the
        params' real dtype if wider). Variances are kept as standard
        deviations.
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count
    prev_norm: Any


def clip_norm_growth(
    add: jax.typing.ArrayLike | None = None,
    mul: jax.typing.ArrayLike | None = 1.5,
    min_value: jax.typing.ArrayLike | None = 1e-4,
    max_decay: jax.typing.ArrayLike | None = 2,
    ord: Ord = 2,
    *,
    dim: Literal["global"] | None = None,
) -> optax.GradientTransformation:
    r"""Limits how fast the update's norm may grow from one step to the next.

    With $p$ the tracked norm of the previous step, the update's norm $n$ is
    clipped to

    $$
    \min\bigl(p + \mathrm{add},\; \max(p, \mathrm{min\_value}) \cdot \mathrm{mul}\bigr)
    $$

    (either term is dropped when its argument is `None`). The tracked norm
    becomes the clipped norm, except that it shrinks by at most a factor
    `max_decay` per step: after a tiny update it is $p / \mathrm{max\_decay}$,
    so one small step does not pin the next ones near zero. The first update
    passes unchanged and sets $p$. Norms are per leaf (`dim=None`, default) or
    of all leaves as one vector (`dim="global"`). Any finite update leaves a
    finite state; a non-finite update leaves the state unchanged.

    Differences from torchzero's `ClipNormGrowth`: `min_value` floors $p$ in
    the multiplicative bound only, as documented (torchzero instead takes
    `max(denominator, min_value)`, which never acts; the additive bound is
    $p + \mathrm{add}$ in both); the tracked norm decays from the previous
    tracked norm by `max_decay` whenever the update's norm falls below
    $p / \mathrm{max\_decay}$ (torchzero's decay rule differs when $p$ is
    small and the decay is active); `add=None, mul=None` passes updates
    through (torchzero raises); named `ord` values work (torchzero passes
    them to `torch.linalg.vector_norm`); `dim` replaces
    `parameterwise=True / False`.

    Args:
      add: Additive bound (`>= 0`) on the growth, or `None` (default).
      mul: Multiplicative bound (`> 0`) on the growth, or `None`
        (default 1.5).
      min_value: Floor (`>= 0`) on the tracked norm in the multiplicative
        bound, or `None` (default 1e-4).
      max_decay: Largest factor (`>= 1`) by which the tracked norm may shrink
        per step, or `None` (default 2).
      ord: The measure, as in `clip_grad_norm` (default 2).
      dim: `None` (default): norms per leaf; `"global"`: of all leaves as one
        vector.

    Returns:
      An `optax.GradientTransformation` with a `ClipNormGrowthState`.

    Raises:
      ValueError: For negative bounds, `mul <= 0`, `max_decay < 1`, an
        unknown `ord` or `dim`.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_norm_growth(mul=2.0)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([0.3, 0.4])}, state)
      >>> u, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
      >>> u["w"]  # norm 5 cut to 2 * 0.5
      Array([0.6, 0.8], dtype=float32)
    """
    _check_growth_args(add, mul, min_value, max_decay)
    m = _parse_ord(ord, _EMA_STATIC)
    per_leaf = _check_tree_dim(dim)

    def init_fn(params: optax.Params) -> ClipNormGrowthState:
        return ClipNormGrowthState(
            count=jnp.zeros([], jnp.int32), prev_norm=_size_like(params, per_leaf)
        )

    def bound(prev: jax.Array) -> jax.Array:
        allowed = jnp.full_like(prev, jnp.inf)
        if add is not None:
            allowed = jnp.minimum(allowed, prev + add)
        if mul is not None:
            floor = prev if min_value is None else jnp.maximum(prev, min_value)
            allowed = jnp.minimum(allowed, floor * mul)
        return allowed

    def update_fn(
        updates: optax.Updates, state: ClipNormGrowthState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ClipNormGrowthState]:
        del params
        validation.refuse_unreduced("updates", updates, "this clipping transformation")
        first = state.count == 0
        sizes = _tree_sizes(updates, m, per_leaf)
        factors, tracked = [], []
        for size, prev in zip(sizes, _as_list(state.prev_norm, per_leaf), strict=True):
            value = size.value().astype(prev.dtype)
            allowed = bound(prev)
            over = ~first & ~(value <= allowed)  # NaN: the unit becomes NaN, as in optax
            factors.append(_select(over, ratio_factors(allowed, size), _unit_factors(size)))
            new = jnp.where(over, allowed, value)
            if max_decay is not None:
                decayed = prev / max_decay
                new = jnp.where(~first & (value < decayed), decayed, new)
            tracked.append(jnp.minimum(new, jnp.finfo(prev.dtype).max))
        new_updates = _scale_by(updates, factors, per_leaf)
        finite = trees.all_finite(updates)
        new_state = ClipNormGrowthState(
            count=trees.increment_if(state.count, finite),
            prev_norm=_keep_if(
                finite, _from_list(tracked, state.prev_norm, per_leaf), state.prev_norm
            ),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


class ClipValueGrowthState(NamedTuple):
    """State of `clip_value_growth`.

    Attributes:
      count: `int32[]`. Updates seen so far with finite values (saturating).
      prev: Tree shaped like the params, in float32 (or the params' dtype if
        wider): the tracked values that bound the next update.
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count
    prev: optax.Updates


def clip_value_growth(
    add: jax.typing.ArrayLike | None = None,
    mul: jax.typing.ArrayLike | None = 1.5,
    min_value: jax.typing.ArrayLike | None = 1e-4,
    max_decay: jax.typing.ArrayLike | None = 2,
) -> optax.GradientTransformation:
    r"""Limits how fast each element's magnitude may grow from step to step.

    Elementwise, with $p$ the tracked value of the previous step, the
    magnitude $\lvert g\rvert$ is first cut to $\lvert p\rvert +
    \mathrm{add}$, then to $\max(\lvert p\rvert, \mathrm{min\_value})
    \cdot \mathrm{mul}$, keeping its sign. The tracked value becomes the
    clipped element, except where the element shrank by more than a factor
    `max_decay` relative to $\max(\lvert p\rvert, \mathrm{min\_value})$:
    there it becomes $p / \mathrm{max\_decay}$. The first update passes
    unchanged and sets $p$; `add=None, mul=None` passes updates
    through. A non-finite update leaves the state unchanged; its NaN elements
    stay NaN and its infinities are clipped to the limit, as in `optax.clip`.

    Args:
      add: Additive bound (`>= 0`) on the growth, or `None` (default).
      mul: Multiplicative bound (`> 0`) on the growth, or `None`
        (default 1.5).
      min_value: Floor (`>= 0`) on the tracked magnitude in the
        multiplicative bound, or `None` (default 1e-4).
      max_decay: Largest factor (`>= 1`) by which the tracked magnitude may
        shrink per step, or `None` (default 2).

    Returns:
      An `optax.GradientTransformation` with a `ClipValueGrowthState`.

    Raises:
      ValueError: For negative bounds, `mul <= 0` or `max_decay < 1`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_value_growth(mul=2.0)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([1.0, -1.0])}, state)
      >>> u, state = tx.update({"w": jnp.array([5.0, -1.5])}, state)
      >>> u["w"]
      Array([ 2. , -1.5], dtype=float32)
    """
    _check_growth_args(add, mul, min_value, max_decay)

    def init_fn(params: optax.Params) -> ClipValueGrowthState:
        return ClipValueGrowthState(
            count=jnp.zeros([], jnp.int32),
            prev=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _state_dtype(p)), params),
        )

    def clip_leaf(g: jax.Array, prev: jax.Array, first: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = g.astype(prev.dtype)
        prev_mag = jnp.abs(prev)
        if add is not None:
            x = jnp.sign(x) * jnp.minimum(jnp.abs(x), prev_mag + add)
        floor = prev_mag if min_value is None else jnp.maximum(prev_mag, min_value)
        grown = x
        if mul is not None:
            x = jnp.sign(x) * jnp.minimum(jnp.abs(x), floor * mul)
        tracked = x
        if max_decay is not None:
            # Compared as a product: floor may be zero when min_value is None.
            tracked = jnp.where(jnp.abs(grown) * max_decay < floor, prev / max_decay, x)
        out = jnp.where(first, g.astype(prev.dtype), x)
        return out.astype(g.dtype), jnp.where(first, g.astype(prev.dtype), tracked)

    def update_fn(
        updates: optax.Updates, state: ClipValueGrowthState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ClipValueGrowthState]:
        del params
        validation.refuse_unreduced("updates", updates, "this clipping transformation")
        first = state.count == 0
        leaves, treedef = jax.tree.flatten(updates)
        pairs = [
            clip_leaf(g, p, first) for g, p in zip(leaves, jax.tree.leaves(state.prev), strict=True)
        ]
        new_updates = jax.tree.unflatten(treedef, [u for u, _ in pairs])
        tracked = jax.tree.unflatten(jax.tree.structure(state.prev), [t for _, t in pairs])
        finite = trees.all_finite(updates)
        new_state = ClipValueGrowthState(
            count=trees.increment_if(state.count, finite),
            prev=_keep_if(finite, tracked, state.prev),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)
