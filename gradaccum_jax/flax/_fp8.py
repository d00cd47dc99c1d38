"""Flax fp8 metadata across the calls of a window: held fixed, a running max, written at the close.

Flax's `TrainState.apply_gradients` overwrites the `_overwrite_with_gradient`
collection (fp8 scales and amax histories) with its "gradients", the new
values, on every call. Under `accumulate` a call is a micro-step: the history
would roll `K` times per optimizer step and the scale would change in the
middle of a window, so the window's micro-batches would be quantized with
different scales, unlike one large batch. Here the metadata stay as they were
when the window opened; each call's new values (all computed from those same
metadata: the same new scale, the same rolled history, the call's own amax in
the new slot) join a running elementwise max, and the max is written when
the window closes. For the forward amaxes (inputs, kernels) that is the
large batch's value exactly. The output-gradient amax is each call's own
backward's: a call's loss is the mean over its batch, so its cotangents are
`K` times the window's large batch's, and so is that amax (a scale `K` times
smaller, which errs towards no overflow). Put the window inside one call
(`microbatch_value_and_grad`), or differentiate each call's share of the
window's loss, where it must be exact.

With `accumulate(..., axis_name=...)` each replica keeps its own running max
(its calls saw its own micro-batches) and the close takes the max over the
replicas (`pmax`, inside a conditional: once per window): a large batch's amax
is the max over all of its examples, on every device. The axes are the
window's own, asked from the `accumulate` in the optimizer (`fused.Survey`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import collectives, reduce_rules, validation
from gradaccum_jax._window.fused import SURVEY_KEY, Survey, apply_gradients
from gradaccum_jax._window.state import AccumulateState

#: The attribute of the containers (`TrainState`, `Optimizer`) holding the running max.
WINDOW_MAX = reduce_rules.FP8_WINDOW_MAX


def fp8_metadata(path: Any, value: Any) -> bool:
    """An `nnx` filter: whether a variable holds Flax fp8 metadata (scales, amax histories).

    Flax's fp8 layers (`flax.linen.fp8_ops`) reach `flax.nnx` through `nnx.bridge`
    (a whole linen model in `nnx.bridge.ToNNX`, or an fp8 op as the `dot_general`
    of `nnx.Linear`), which keeps the metadata in variables of the type
    `nnx.bridge` makes for their collection, `_overwrite_with_gradient`.
    Differentiate them with the params, so that the gradients hold their new
    values: `nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param,
    fp8_metadata)))`, then `gradaccum_jax.flax.Optimizer.update` writes them.

    Args:
      path: The variable's path in the module (unused: the type decides).
      value: The variable.

    Returns:
      `True` for fp8 metadata variables.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from flax.linen import fp8_ops
      >>> from gradaccum_jax.flax import fp8_metadata
      >>> op = nnx.bridge.ToNNX(fp8_ops.Fp8DirectDotGeneralOp(), rngs=nnx.Rngs(0))
      >>> dims = (((1,), (0,)), ((), ()))
      >>> _ = nnx.bridge.lazy_init(op, jnp.ones((1, 2)), jnp.ones((2, 3)), dims)
      >>> sorted(nnx.state(op, fp8_metadata))[:2]
      ['input_amax_history', 'input_scale']
    """
    del path
    return reduce_rules.is_fp8_variable(value)


def _accumulate_state(opt_state: Any) -> AccumulateState | None:
    found = [
        x
        for x in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, AccumulateState)
        )
        if isinstance(x, AccumulateState)
    ]
    if not found:
        return None
    state: AccumulateState = validation.find_unique_state(
        opt_state, AccumulateState, "gradaccum_jax.accumulate"
    )
    return state


def window_start(meta: Any) -> Any:
    """A running max before any call: `-inf` shaped like the metadata."""
    return jax.tree.map(
        lambda x: jnp.full(jnp.shape(x), reduce_rules.max_identity(jnp.result_type(x))), meta
    )


def apply_and_survey(
    tx: Any, grads: Any, opt_state: Any, params: Any, **extra_args: Any
) -> tuple[Any, Any, tuple[Any, ...] | None]:
    """`apply_gradients`, and the mapped axes of the window of the `accumulate` in `tx`.

    The axes are `None` without an `accumulate` in `opt_state` or without
    `axis_name`. Only an optimizer state that holds an `AccumulateState` is
    asked: a bare optax transformation may refuse unknown extra arguments.
    """
    if _accumulate_state(opt_state) is None:
        return (*apply_gradients(tx, grads, opt_state, params, **extra_args), None)
    survey = Survey()
    new_params, new_opt_state = apply_gradients(
        tx, grads, opt_state, params, **extra_args, **{SURVEY_KEY: survey}
    )
    return new_params, new_opt_state, survey.axis_names


def hold_for_window(
    held: Any,
    running: Any,
    new: Any,
    opt_state: Any,
    new_opt_state: Any,
    axis_names: tuple[Any, ...] | None = None,
) -> tuple[Any, Any]:
    """`(metadata, running max)` after one call (see the module).

    Args:
      held: The metadata before the call (`params["_overwrite_with_gradient"]`).
      running: The running max of the window so far (`None`: none yet).
      new: The call's new values (`grads["_overwrite_with_gradient"]`).
      opt_state: The optimizer state before the call.
      new_opt_state: The optimizer state after it.
      axis_names: The mapped axes the window reduces over (`apply_and_survey`), or
        `None`.

    Returns:
      Without an `accumulate` in the optimizer, `(new, running)`: Flax's
      overwrite. Else the metadata (`held` inside a window, the window's max
      when this call closed it, over `axis_names` too) and the running max.
    """
    before, after = _accumulate_state(opt_state), _accumulate_state(new_opt_state)
    if before is None or after is None:
        return new, running
    if running is None:
        running = window_start(new)
    opened = before.micro_step == 0
    closed = after.micro_step == 0
    running = jax.tree.map(
        lambda r, n: jnp.where(opened, n, jnp.maximum(r, n.astype(r.dtype))).astype(r.dtype),
        running,
        new,
    )
    if axis_names is None:
        meta = jax.tree.map(lambda h, r: jnp.where(closed, r.astype(h.dtype), h), held, running)
        return meta, running
    typed = collectives.check_axes_bound("axis_name", axis_names)

    def written(running: Any, held: Any) -> Any:
        # The only collective on the metadata: in the close's branch, once per window.
        window_max = collectives.pmax(running, axis_names, typed)
        return jax.tree.map(lambda h, r: r.astype(h.dtype), held, window_max)

    meta = collectives.cond(closed, written, lambda _, h: h, running, held, typed=typed)
    return meta, running
