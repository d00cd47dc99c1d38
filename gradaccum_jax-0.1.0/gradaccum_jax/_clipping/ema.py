"""Clippers with a bound that follows an exponential moving average of the measured sizes.

`clip_norm_by_ema`, `normalize_by_ema` (both through `_by_ema`) and
`clip_value_by_ema`. The arguments mean what they mean in `norm.py`.
"""

from __future__ import annotations

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
    real_dtype,
)
from gradaccum_jax._clipping.norm import (
    _as_list,
    _capped,
    _check_beta,
    _clip_elements,
    _from_list,
    _keep_if,
    _scale_by,
    _select,
    _size_like,
    _state_dtype,
    _tree_sizes,
    _unit_factors,
)


class ClipNormByEMAState(NamedTuple):
    """State of `clip_norm_by_ema` and `normalize_by_ema`.

    Attributes:
      count: `int32[]`. Updates seen so far with finite values (saturating).
      ema: Tree shaped like the params, in float32 (or the params' dtype if
        wider or complex): the exponential moving average of past updates.
      prev_ema_norm: The EMA's size after the last step, which bounds its
        growth: one scalar per leaf (`dim=None`) or one scalar (`dim="global"`),
        in the real dtype of `ema`. Variances are kept as standard deviations.
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count
    ema: optax.Updates
    prev_ema_norm: Any


def _by_ema(
    normalize_: bool,
    beta: Any,
    ord: Ord,
    eps: Any,
    dim: Any,
    max_ema_growth: Any,
    ema_init: str,
) -> optax.GradientTransformation:
    _check_beta(beta)
    m = _parse_ord(ord, _EMA_STATIC)
    validation.check_hyperparameter("eps", eps, allow_zero=False)
    per_leaf = _check_tree_dim(dim)
    validation.check_hyperparameter(
        "max_ema_growth", max_ema_growth, allow_zero=False, allow_none=True
    )
    validation.check_choice("ema_init", ema_init, ("zeros", "update"))

    def init_fn(params: optax.Params) -> ClipNormByEMAState:
        return ClipNormByEMAState(
            count=jnp.zeros([], jnp.int32),
            ema=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _state_dtype(p)), params),
            prev_ema_norm=_size_like(params, per_leaf),
        )

    def update_fn(
        updates: optax.Updates, state: ClipNormByEMAState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ClipNormByEMAState]:
        del params
        validation.refuse_unreduced("updates", updates, "this clipping transformation")
        first = state.count == 0
        grads = jax.tree.map(lambda g, e: jnp.asarray(g).astype(e.dtype), updates, state.ema)
        start = state.ema
        if ema_init == "update":
            start = jax.tree.map(lambda e, g: jnp.where(first, g, e), state.ema, grads)
        ema = jax.tree.map(lambda e, g: _capped(beta * e + (1 - beta) * g), start, grads)
        ema_sizes = _tree_sizes(ema, m, per_leaf)
        ema_values = [s.value() for s in ema_sizes]
        if max_ema_growth is not None:
            prevs = _as_list(state.prev_ema_norm, per_leaf)
            shrink, new_values = [], []
            for size, value, prev in zip(ema_sizes, ema_values, prevs, strict=True):
                prev = jnp.where(first, value, prev)
                # torchzero floors the allowed size at 1e-6 per tensor but not
                # globally, where an EMA that is once zero stays zero for good;
                # the floor here is eps in both modes.
                allowed = jnp.maximum(
                    jnp.minimum(prev * max_ema_growth, jnp.finfo(value.dtype).max), eps
                ).astype(value.dtype)
                over = value > allowed
                shrink.append(_select(over, ratio_factors(allowed, size), _unit_factors(size)))
                new_values.append(jnp.where(over, allowed, value))
            ema = _scale_by(ema, shrink, per_leaf)
            ema_values = new_values
        grad_sizes = _tree_sizes(grads, m, per_leaf)
        factors = []
        for size, e_value in zip(grad_sizes, ema_values, strict=True):
            target = jnp.maximum(e_value, eps).astype(e_value.dtype)
            value = size.value()
            if normalize_:
                # At most a factor 1/eps up, so a near-zero update is not
                # blown up to the EMA's size.
                cap = (jnp.ones_like(value), jnp.full_like(value, 1 / eps))
                factors.append(_select(value < target * eps, cap, ratio_factors(target, size)))
            else:
                # A NaN measure is over every bound: its unit becomes NaN, as in optax.
                factors.append(
                    _select(~(value <= target), ratio_factors(target, size), _unit_factors(size))
                )
        new_updates = _scale_by(updates, factors, per_leaf)
        finite = trees.all_finite(updates)
        new_state = ClipNormByEMAState(
            count=trees.increment_if(state.count, finite),
            ema=_keep_if(finite, ema, state.ema),
            prev_ema_norm=_keep_if(
                finite, _from_list(ema_values, state.prev_ema_norm, per_leaf), state.prev_ema_norm
            ),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def clip_norm_by_ema(
    beta: jax.typing.ArrayLike = 0.99,
    ord: Ord = 2,
    eps: jax.typing.ArrayLike = 1e-6,
    *,
    dim: Literal["global"] | None = None,
    max_ema_growth: jax.typing.ArrayLike | None = 1.5,
    ema_init: Literal["zeros", "update"] = "zeros",
) -> optax.GradientTransformation:
    r"""Clips the update's norm to the norm of an EMA of past updates.

    Each step updates $m \leftarrow \beta m + (1-\beta) g$ (with $m$ starting
    at zero, or at the first update for `ema_init="update"`), limits the
    growth of $\lVert m\rVert$ to a factor `max_ema_growth` per step by
    shrinking $m$ (never below `eps`), and returns

    $$
    g \cdot \frac{1}{\max\bigl(1, \lVert g\rVert / \max(\lVert m\rVert, \epsilon)\bigr)},
    $$

    per leaf (`dim=None`, default) or for the whole tree (`dim="global"`).
    The EMA tracks the unclipped updates. With `ema_init="zeros"` the first
    step's bound is only $(1-\beta)\lVert g\rVert$, as in torchzero (there is
    no bias correction).

    Any finite update leaves a finite state, however large: norms are exact
    over the whole float range, and an EMA that rounds past the largest float
    is kept at it. A non-finite update leaves the state unchanged (the
    returned update is not finite either, so a later `accumulate` or
    `optax.apply_if_finite` can drop it).

    Differences from torchzero's `ClipNormByEMA`: `eps` floors both the EMA's
    norm in the division and the allowed EMA norm of the growth limit, per
    leaf and globally (torchzero floors only the growth bound, at `1e-6` and
    only per tensor, and guards the division with `2 * finfo.tiny`); `dim`
    replaces `tensorwise=True / False`.

    Args:
      beta: EMA decay in `[0, 1)` (default 0.99).
      ord: The measure, as in `clip_grad_norm` (default 2).
      eps: Floor (`> 0`) on the EMA's norm in the division, and on the
        allowed EMA norm when its growth is limited (default 1e-6).
      dim: `None` (default): norms per leaf; `"global"`: of all leaves as one
        vector.
      max_ema_growth: Largest factor (`> 0`) by which the EMA's norm may grow
        in one step, or `None` for no limit (default 1.5).
      ema_init: `"zeros"` (default) or `"update"`.

    Returns:
      An `optax.GradientTransformation` with a `ClipNormByEMAState`.

    Raises:
      ValueError: For `beta` outside `[0, 1)`, `eps <= 0`, a non-positive
        `max_ema_growth`, an unknown `ord`, `dim` or `ema_init`.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_norm_by_ema(beta=0.5, ema_init="update")
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
      >>> u["w"]  # the EMA is the update itself
      Array([3., 4.], dtype=float32)
      >>> u, state = tx.update({"w": jnp.array([30.0, 40.0])}, state)
      >>> u["w"]  # EMA norm 27.5, but its growth is limited to 1.5 * 5
      Array([4.5, 6. ], dtype=float32)
    """
    return _by_ema(False, beta, ord, eps, dim, max_ema_growth, ema_init)


def normalize_by_ema(
    beta: jax.typing.ArrayLike = 0.99,
    ord: Ord = 2,
    eps: jax.typing.ArrayLike = 1e-6,
    *,
    dim: Literal["global"] | None = None,
    max_ema_growth: jax.typing.ArrayLike | None = 1.5,
    ema_init: Literal["zeros", "update"] = "zeros",
) -> optax.GradientTransformation:
    r"""Rescales the update to the norm of an EMA of past updates.

    Same EMA, growth limit and state guarantees as `clip_norm_by_ema`, but
    the update is scaled up as well as down:

    $$
    g \cdot \frac{1}{\max\bigl(\epsilon, \lVert g\rVert / \max(\lVert m\rVert, \epsilon)\bigr)},
    $$

    which gives $\lVert m\rVert$ whenever that ratio exceeds $\epsilon$; a
    zero update stays zero. Differences from torchzero's `NormalizeByEMA`:
    `eps` also caps the amplification at `1 / eps` (torchzero divides by the
    update's norm guarded only by `2 * finfo.tiny`), and `eps` floors the
    EMA's norm as in `clip_norm_by_ema`.

    Args:
      beta: EMA decay in `[0, 1)` (default 0.99).
      ord: The measure, as in `clip_grad_norm` (default 2).
      eps: Floor (`> 0`) in the divisions and on the allowed EMA norm
        (default 1e-6).
      dim: `None` (default): norms per leaf; `"global"`: of all leaves as one
        vector.
      max_ema_growth: Largest factor (`> 0`) by which the EMA's norm may grow
        in one step, or `None` for no limit (default 1.5).
      ema_init: `"zeros"` (default) or `"update"`.

    Returns:
      An `optax.GradientTransformation` with a `ClipNormByEMAState`.

    Raises:
      ValueError: For `beta` outside `[0, 1)`, `eps <= 0`, a non-positive
        `max_ema_growth`, an unknown `ord`, `dim` or `ema_init`.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.normalize_by_ema(beta=0.5, ema_init="update")
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
      >>> u, state = tx.update({"w": jnp.array([0.3, 0.4])}, state)
      >>> u["w"].round(4)  # scaled to the EMA's norm, 0.5 * 5 + 0.5 * 0.5
      Array([1.65, 2.2 ], dtype=float32)
    """
    return _by_ema(True, beta, ord, eps, dim, max_ema_growth, ema_init)


class ClipValueByEMAState(NamedTuple):
    """State of `clip_value_by_ema`.

    Attributes:
      count: `int32[]`. Updates seen so far with finite values (saturating).
      ema: Tree shaped like the params, in the real float32 dtype (or the
        params' real dtype if wider): the exponential moving average of past
        updates' magnitudes.
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count
    ema: optax.Updates


def clip_value_by_ema(
    beta: jax.typing.ArrayLike = 0.99,
    ema_init: Literal["zeros", "update"] = "zeros",
) -> optax.GradientTransformation:
    r"""Clips every element to the EMA of past magnitudes at its position.

    $m \leftarrow \beta m + (1-\beta)\lvert g\rvert$, then
    $g \leftarrow \operatorname{clip}(g, -m, m)$ elementwise (complex elements
    keep their phase), with $m$ starting at zero or, for `ema_init="update"`,
    at the first update's magnitudes. The EMA tracks unclipped magnitudes. A
    non-finite update leaves the state unchanged; its NaN elements stay NaN and
    its infinities are clipped to the EMA before the call, as `optax.clip`
    clips them to its bound. (torchzero's optional
    `ema_tfm`, a transform applied to the EMA before clipping, is not offered.)

    Args:
      beta: EMA decay in `[0, 1)` (default 0.99).
      ema_init: `"zeros"` (default) or `"update"`.

    Returns:
      An `optax.GradientTransformation` with a `ClipValueByEMAState`.

    Raises:
      ValueError: For `beta` outside `[0, 1)` or an unknown `ema_init`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_value_by_ema(beta=0.5, ema_init="update")
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([1.0, -2.0])}, state)
      >>> u, state = tx.update({"w": jnp.array([-5.0, 1.0])}, state)
      >>> u["w"]  # bounds 0.5 * 1 + 0.5 * 5 and 0.5 * 2 + 0.5 * 1
      Array([-3.,  1.], dtype=float32)
    """
    _check_beta(beta)
    validation.check_choice("ema_init", ema_init, ("zeros", "update"))

    def init_fn(params: optax.Params) -> ClipValueByEMAState:
        return ClipValueByEMAState(
            count=jnp.zeros([], jnp.int32),
            ema=jax.tree.map(
                lambda p: jnp.zeros(jnp.shape(p), real_dtype(_state_dtype(p))), params
            ),
        )

    def update_fn(
        updates: optax.Updates, state: ClipValueByEMAState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ClipValueByEMAState]:
        del params
        validation.refuse_unreduced("updates", updates, "this clipping transformation")
        first = state.count == 0
        mags = jax.tree.map(lambda g, e: jnp.abs(g).astype(e.dtype), updates, state.ema)
        start = state.ema
        if ema_init == "update":
            start = jax.tree.map(lambda e, a: jnp.where(first, a, e), state.ema, mags)
        ema = jax.tree.map(lambda e, a: _capped(beta * e + (1 - beta) * a), start, mags)
        # A non-finite element is clipped by the EMA before it (an infinity to the
        # bound, as optax.clip does; NaN stays NaN), not by an EMA it has blown up.
        bounds = jax.tree.map(lambda e, s, a: jnp.where(jnp.isfinite(a), e, s), ema, start, mags)
        new_updates = jax.tree.map(
            lambda g, e: _clip_elements(
                jnp.asarray(g).astype(jnp.promote_types(jnp.result_type(g), e.dtype)), e
            ).astype(jnp.result_type(g)),
            updates,
            bounds,
        )
        finite = trees.all_finite(updates)
        new_state = ClipValueByEMAState(
            count=trees.increment_if(state.count, finite),
            ema=_keep_if(finite, ema, state.ema),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)
