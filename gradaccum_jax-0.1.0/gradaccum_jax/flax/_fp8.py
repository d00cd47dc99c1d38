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
(`microbatch_value_and_grad`) where it must be exact.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import reduce_rules, validation
from gradaccum_jax._window.state import AccumulateState

#: The collection of `TrainState.params` that holds the window's running max of the metadata.
WINDOW_MAX = "_overwrite_with_gradient_max"


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


def hold_for_window(
    held: Any, running: Any, new: Any, opt_state: Any, new_opt_state: Any
) -> tuple[Any, Any]:
    """`(metadata, running max)` after one call (see the module).

    Args:
      held: The metadata before the call (`params["_overwrite_with_gradient"]`).
      running: The running max of the window so far (`None`: none yet).
      new: The call's new values (`grads["_overwrite_with_gradient"]`).
      opt_state: The optimizer state before the call.
      new_opt_state: The optimizer state after it.

    Returns:
      Without an `accumulate` in the optimizer, `(new, running)`: Flax's
      overwrite. Else the metadata (`held` inside a window, the window's max
      when this call closed it) and the running max.
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
    meta = jax.tree.map(lambda h, r: jnp.where(closed, r.astype(h.dtype), h), held, running)
    return meta, running
