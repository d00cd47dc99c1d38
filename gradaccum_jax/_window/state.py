"""`AccumulateState`: the state of `accumulate`, in a module of its own.

The loss-scaling module looks for accumulate states inside an optimizer state, and
`accumulate` refuses a loss scale inside its inner transformation: both read this
module, so neither imports the other's implementation.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import optax

from gradaccum_jax._window.noise_scale import NoiseScaleState

AxisName = Hashable | Sequence[Hashable]


class AccumulateState(NamedTuple):
    """State of `accumulate`.

    Every field keeps its shape and dtype from `init` on, so the state can be
    carried through `jax.lax.scan`, donated, sharded and checkpointed
    mid-window like any other pytree. An `accumulate` built with
    `count_skipped_steps=False` returns a subclass with the same fields,
    `UncountedAccumulateState`, whose type records that option (see
    `closes_window`).

    Attributes:
      micro_step: `int32[]`. Micro-steps already taken in the current window,
        in `[0, window_length)`; `0` right after a window closed.
      gradient_step: `int32[]`. Number of inner updates applied so far, i.e.
        optimizer steps, not micro-steps. Saturates at the int32 maximum.
      window_length: `int32[]`. The current window's length `K`: the int
        given as `every_k_schedule`, or the schedule's value at
        `gradient_step`, evaluated at `init` and whenever a window closes.
        `closes_window` reads it.
      updated: `bool[]`. Whether the last `update` call applied an inner
        update (`False` at `init`, on micro-steps, and after a window in which
        everything was dropped). `has_updated` reads it.
      acc_grads: Tree shaped like the params, in the accumulator dtype. The
        weighted sum of the micro-gradients accepted in the current window, in
        units of `weight_unit`: `Σ (w / weight_unit) · g` (local to the
        replica when `axis_name` is set). `None` when `every_k_schedule` is the
        int `1` (without `compensated`, `shard_inner_state` or
        `track_noise_scale`): every window is one micro-step, read straight
        from the gradient, and nothing is held between calls.
      acc_weight: `float32[]` (`float64[]` beside a float64 accumulator).
        `Σ w / weight_unit` over the accepted
        micro-gradients of the current window (their count when no `weight`
        is passed): the window's mean is `acc_grads / acc_weight`. Local to
        the replica when `axis_name` is set.
      weight_unit: Scalar of `acc_weight`'s dtype. The first positive accepted `weight` of the
        current window (`1` without `weight=`); for a float16 accumulator the
        window's accepted weight so far (in a global-view window, its usable
        weight so far, the same on every device), so that `acc_grads` is the
        running weighted mean. Holding the sum in this unit keeps it at the
        gradients' magnitude, so large weights (token counts) cannot overflow
        a float16 accumulator, in any order. Local to the replica when
        `axis_name` is set.
      num_skipped: `int32[]`. Micro-gradients dropped so far because a leaf
        or the weight was not finite (or the weight was negative). Saturates
        at the int32 maximum. With `axis_name` it counts this replica's drops
        only, like `acc_grads` a per-replica partial sum: the global count is
        its sum over replicas, read from the host without a collective in the
        step (`state.num_skipped.sum()` on the stacked state of `jax.pmap` or
        of `replica_state_specs`).
      inner_state: The inner transformation's state. It changes only when a
        window closes, and keeps the dtypes of the inner `init`.
      num_short_windows: `int32[]`. Windows for which a traced
        `every_k_schedule` returned a length below 1, taken as 1 (inside `jit`
        it cannot raise; see `check_values`). Saturates.
      acc_compensation: `None` unless `compensated=True`; then a tree like
        `acc_grads`, in the same dtype, holding the rounding error of
        `acc_grads`: the window's sum is `acc_grads + acc_compensation`.
      skip_state: `()` unless `should_skip_update_fn` is given; then the
        metrics it returned for the last micro-gradient (the structure it
        returns at `init` for zero gradients), as in `optax.MultiStepsState`.
      noise_scale: `None` unless `track_noise_scale=True`; then a
        `NoiseScaleState` (float32 scalars) holding the window's sum of the
        micro-gradients' squared norms and the averages that
        `gradient_noise_scale` reads.
      acc_value: `None` unless the inner optimizer reads the loss as `value=`
        (`optax.contrib.reduce_on_plateau`, `momo`, `momo_adam`, `optax.polyak_sgd`:
        recognised at `init` by its state or by what its update reads); then a
        scalar of `acc_weight`'s dtype, `Σ w · value` over the micro-steps
        accepted in the current window (`w = 1` without `weight=`), in absolute
        units: the inner optimizer receives its weighted mean (or, with
        `use_grad_mean=False`, the sum) as `value=`.
    """

    micro_step: jax.Array
    gradient_step: jax.Array
    window_length: jax.Array
    updated: jax.Array
    acc_grads: optax.Updates | None
    acc_weight: jax.Array
    weight_unit: jax.Array
    num_skipped: jax.Array
    inner_state: optax.OptState
    num_short_windows: jax.Array
    acc_compensation: optax.Updates | None = None
    skip_state: Any = ()
    noise_scale: NoiseScaleState | None = None
    acc_value: jax.Array | None = None

    def __getattr__(self, name: str) -> Any:
        # Only for names that are not fields: an optimizer's state read through the
        # window's (`schedule_free_eval_params(opt_state)`, `opt_state.hyperparams`).
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"AccumulateState has no attribute {name!r}: it is accumulate's state, the inner "
            "optimizer's is opt_state.inner_state. Pass that to what reads it, e.g. "
            "optax.contrib.schedule_free_eval_params(opt_state.inner_state, params) or "
            "opt_state.inner_state.hyperparams, or let optax search the whole state: "
            f"optax.tree_utils.tree_get(opt_state, {name!r})."
        )


class UncountedAccumulateState(AccumulateState):
    """The `AccumulateState` of `accumulate(..., count_skipped_steps=False)`.

    The same fields; the type records that a dropped micro-step does not count
    toward the window, so that the window closes only on an accepted one and
    whether the next call closes it is not known before the call
    (`closes_window` refuses the question and names what to read instead).
    """

    __slots__ = ()


def holds_outermost_window(tree: Any) -> bool:
    """Whether `tree` holds the state of a window that must be outermost (`dp_accumulate`'s).

    Such a state type has the class attribute `outermost_window = True`. Windows of
    windows are allowed otherwise (an `accumulate` inside another's inner
    transformation is a window of windows); a private window inside another window
    would clip and noise the outer window's reduced gradient, not the micro-batches.
    """
    marked = lambda x: getattr(type(x), "outermost_window", False)  # noqa: E731
    return any(marked(x) for x in jax.tree.leaves(tree, is_leaf=marked))


def refuse_outermost_inside(inner_state: Any, outer: str) -> None:
    """Raises `ValueError` if `inner_state`, the state inside `outer`'s window, holds one."""
    if holds_outermost_window(inner_state):
        raise ValueError(
            f"gradaccum_jax.privacy.dp_accumulate is inside another window ({outer}): it would "
            "receive the outer window's reduced gradient once per outer window, and clip, sum "
            "and noise that instead of the micro-batches' clipped sums. Use dp_accumulate "
            "alone, outermost, with the whole logical batch as its window: "
            "dp_accumulate(inner, K_outer * K_inner, ...)."
        )


class CallerClosedAccumulateState(AccumulateState):
    """An `AccumulateState` whose window the caller ends (`update(..., close=...)`).

    The same fields; `window_length` holds the int32 maximum, never reached. The
    type records that the window's end is not a count, so whether the next call
    closes it is the caller's flag, not the state's (`closes_window` refuses the
    question).
    """

    __slots__ = ()


class LossScaleState(NamedTuple):
    """State of `dynamic_loss_scale` and `static_loss_scale`.

    Attributes:
      loss_scale: `float32[]`. The factor to multiply the next loss by
        (read it with `current_loss_scale`); `update` divides the
        gradients it receives by this value.
      growth_count: `int32[]`. Finite `update` calls since the scale last
        changed, in `[0, growth_interval)`; always `0` for a static scale.
      num_overflows: `int32[]`. `update` calls whose gradients had a
        non-finite value. Saturates at the int32 maximum.
    """

    loss_scale: jax.Array
    growth_count: jax.Array
    num_overflows: jax.Array
