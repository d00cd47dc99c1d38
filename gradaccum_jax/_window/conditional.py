"""Staleness-aware (conditional) accumulation for delayed gradient producers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._base import trees, validation
from gradaccum_jax._window import engine, loss_value, placement

_REDUCTIONS = ("mean", "sum")
StalenessWeight = Callable[[jax.Array], Any]


class ConditionalAccumulator(NamedTuple):
    """State of a conditional accumulator (the pure functions and `conditional_accumulate`).

    Every field keeps its shape and dtype, so the state can be carried through
    `jax.lax.scan`, donated and checkpointed like any other pytree.

    Attributes:
      global_step: `int32[]`. The accumulator's time step. A gradient computed
        at `local_step < global_step - max_staleness` is stale. Grows by one
        on every successful take (saturating at the int32 maximum) and can be
        raised with `conditional_set_global_step`.
      num_accumulated: `int32[]`. Gradients accepted since the last take.
      acc_grads: Tree shaped like the params, in the accumulator dtype. The sum
        `Σ w·g` of the accepted gradients since the last take (`w = 1`
        without a `staleness_weight`).
      num_stale: `int32[]`. Gradients dropped so far because they were stale.
        Saturates at the int32 maximum.
      num_skipped: `int32[]`. Fresh gradients dropped so far because a leaf
        (or their staleness weight) was not finite. Saturates.
      num_ignored_steps: `int32[]`. Calls of `conditional_set_global_step`
        ignored because the new step was lower than `global_step`. Jitted code
        cannot log a warning, so this counter is how that is reported.
        Saturates.
      acc_value: `None` unless the accumulator is `conditional_accumulate`'s and
        its inner optimizer reads the loss as `value=` (`reduce_on_plateau`,
        `momo`, `polyak_sgd`); then a `float32[]` (`float64[]` beside a float64
        sum), the sum `Σ w·value` of the accepted gradients' values since the
        last take, reduced like `acc_grads` for the inner optimizer's `value=`.
    """

    global_step: jax.Array
    num_accumulated: jax.Array
    acc_grads: optax.Updates
    num_stale: jax.Array
    num_skipped: jax.Array
    num_ignored_steps: jax.Array
    acc_value: jax.Array | None = None


class ConditionalAccumulateState(NamedTuple):
    """State of `conditional_accumulate`.

    Attributes:
      accumulator: A `ConditionalAccumulator`; its `global_step`
        is the step to stamp new gradients with, and it counts the dropped
        gradients.
      inner_state: The inner transformation's state. It changes only when
        `num_required` gradients are in.
    """

    accumulator: ConditionalAccumulator
    inner_state: optax.OptState


placement.register_window(
    ConditionalAccumulateState,
    placement.Window(
        "gradaccum_jax.conditional_accumulate",
        "ga.conditional_accumulate(optax.chain(..., {element}), num_required)",
    ),
)


def _unwrap(
    state: ConditionalAccumulator | ConditionalAccumulateState,
) -> tuple[ConditionalAccumulator, Callable[[ConditionalAccumulator], Any]]:
    if isinstance(state, ConditionalAccumulateState):
        return state.accumulator, lambda acc: state._replace(accumulator=acc)
    if isinstance(state, ConditionalAccumulator):
        return state, lambda acc: acc
    raise TypeError(
        "state must be a ConditionalAccumulator (from conditional_accumulator_init) "
        "or the ConditionalAccumulateState of conditional_accumulate; got "
        f"{type(state).__name__}."
    )


def _check_staleness_weight(staleness_weight: Any) -> None:
    if staleness_weight is not None and not callable(staleness_weight):
        raise TypeError(
            "staleness_weight must be None or a callable mapping the staleness (an int32 "
            "scalar >= 0) to a weight, e.g. lambda tau: 1.0 / (1.0 + tau); got "
            f"staleness_weight={staleness_weight!r}."
        )


def _evaluate_weight(staleness_weight: StalenessWeight, staleness: jax.Array) -> jax.Array:
    return validation.check_scalar("staleness_weight's result", staleness_weight(staleness))


class _Verdict(NamedTuple):
    accepted: jax.Array
    stale: jax.Array
    skipped: jax.Array
    weight: jax.Array | None


def _judge(
    acc: ConditionalAccumulator,
    grad: optax.Updates,
    local_step: Any,
    max_staleness: int,
    staleness_weight: StalenessWeight | None,
    skip_nonfinite: bool,
    value: jax.Array | None,
) -> _Verdict:
    """Decides whether `grad` (and its `value`, if the sum holds one) joins the sum, and
    with which weight."""
    validation.check_same_structure("grad", grad, "state.acc_grads", acc.acc_grads)
    validation.check_float_tree("grad", grad)
    step = validation.check_scalar("local_step", local_step, integer=True)
    # Compared as local_step < global_step - max_staleness: global_step >= 0,
    # so the right side cannot overflow, unlike global_step - local_step.
    stale = step < acc.global_step - jnp.int32(max_staleness)
    weight = None
    usable = jnp.array(True)
    if staleness_weight is not None:
        # Future steps (local_step > global_step) count as fresh; stale ones are
        # pinned so that the subtraction cannot overflow into nonsense.
        staleness = jnp.where(stale, max_staleness, jnp.maximum(acc.global_step - step, 0))
        weight = _evaluate_weight(staleness_weight, staleness.astype(jnp.int32))
        usable = jnp.isfinite(weight) & (weight >= 0)
    if skip_nonfinite:
        usable = usable & trees.all_finite(grad)
        if value is not None:
            usable = usable & jnp.isfinite(value)
    else:
        usable = jnp.array(True)
    return _Verdict(accepted=~stale & usable, stale=stale, skipped=~stale & ~usable, weight=weight)


def _reduce(total: optax.Updates, count: jax.Array, reduction: str) -> optax.Updates:
    if reduction == "sum":
        return total

    # accumulate's mean, to the bit: the product with the reciprocal, formed in at least
    # float32 (a quotient is one ulp off it in some elements; tested).
    def mean(t: jax.Array) -> jax.Array:
        wide = jnp.promote_types(t.dtype, jnp.float32)
        return t.astype(wide) * (1 / count.astype(wide))

    return jax.tree.map(mean, total)


def _counted(
    acc: ConditionalAccumulator, verdict: _Verdict, value: jax.Array | None
) -> ConditionalAccumulator:
    """`acc` with this gradient counted, and its value added where the sum holds one."""
    held = acc.acc_value
    if value is not None and held is not None:  # received only where held
        held = loss_value.add(held, value, verdict.accepted, verdict.weight)
    return acc._replace(
        num_accumulated=trees.increment_if(acc.num_accumulated, verdict.accepted),
        num_stale=trees.increment_if(acc.num_stale, verdict.stale),
        num_skipped=trees.increment_if(acc.num_skipped, verdict.skipped),
        acc_value=held,
    )


def conditional_accumulator_init(
    params: optax.Params, *, accumulator_dtype: Any = None
) -> ConditionalAccumulator:
    """Returns an empty conditional accumulator for gradients shaped like `params`.

    The pure counterpart of constructing TensorFlow's `ConditionalAccumulator`:
    `conditional_apply_grad`, `conditional_num_accumulated`,
    `conditional_set_global_step` and `conditional_take_grad` act on
    the returned state and return a new one. `conditional_accumulate`
    wraps the same state around an optimizer.

    Args:
      params: A tree of floating-point arrays (or `jax.ShapeDtypeStruct`)
        shaped like the gradients.
      accumulator_dtype: dtype of the sum. `None` (default) keeps float32 and
        wider dtypes and sums float16 and bfloat16 gradients in float32.

    Returns:
      A `ConditionalAccumulator` at `global_step = 0`.

    Raises:
      TypeError: If a leaf of `params` is not floating point, or
        `accumulator_dtype` is not a floating dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> acc = ga.conditional_accumulator_init({"w": jnp.zeros(2)})
      >>> int(acc.global_step), int(ga.conditional_num_accumulated(acc))
      (0, 0)
    """
    validation.check_accumulator_dtype(accumulator_dtype)
    params = trees.as_arrays(params)
    validation.check_float_tree("params", params)
    return ConditionalAccumulator(
        global_step=trees.counter(),
        num_accumulated=trees.counter(),
        acc_grads=trees.zeros(params, accumulator_dtype),
        num_stale=trees.counter(),
        num_skipped=trees.counter(),
        num_ignored_steps=trees.counter(),
    )


def conditional_apply_grad(
    state: ConditionalAccumulator,
    grad: optax.Updates,
    local_step: jax.typing.ArrayLike,
    *,
    max_staleness: int = 0,
    staleness_weight: StalenessWeight | None = None,
    skip_nonfinite: bool = True,
    value: jax.typing.ArrayLike | None = None,
) -> ConditionalAccumulator:
    r"""Adds `grad` to the accumulator unless it is stale; returns the new state.

    `grad` is stale when it was computed too long ago,

    $$
    \text{local\_step} < \text{global\_step} - \text{max\_staleness},
    $$

    and is then dropped and counted in `num_stale`. A fresh gradient with a
    non-finite leaf is dropped and counted in `num_skipped`. Otherwise
    `w·grad` is added and `num_accumulated` grows by one, where
    `w = staleness_weight(τ)` for the staleness
    `τ = max(global_step - local_step, 0)`, or `1` without a weight.

    Args:
      state: A `ConditionalAccumulator` (or the
        `ConditionalAccumulateState` of `conditional_accumulate`,
        whose accumulator is then updated and whose inner state is kept).
      grad: A tree with the structure and shapes of the accumulator.
      local_step: Integer scalar: the accumulator's `global_step` that was
        current when `grad` was computed.
      max_staleness: Steps a gradient may lag behind `global_step` and still
        be accepted (`0`, the default, accepts only `local_step >=
        global_step`, as TensorFlow does).
      staleness_weight: `None`, or a callable mapping `τ` (an `int32`
        scalar in `[0, max_staleness]`) to the weight of an accepted
        gradient. A non-finite or negative weight drops the gradient
        (counted in `num_skipped`).
      skip_nonfinite: If `True` (default) non-finite gradients are dropped; if
        `False` they are added as they are.
      value: The loss `grad` is the gradient of, required where the state holds
        a sum of values (`acc_value`: the `ConditionalAccumulateState` of a
        `conditional_accumulate` whose inner optimizer reads `value=`), and
        refused elsewhere. Added with the gradient's weight, dropped with it.

    Returns:
      The new state, of the same type as `state`.

    Raises:
      ValueError: If `grad` does not have the accumulator's structure, or a
        leaf has the wrong shape (the message names the leaf's path).
      TypeError: If `local_step` is not an integer scalar, or `value` is
        missing where the state holds a sum of values, or given where it holds
        none.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> acc = ga.conditional_accumulator_init({"w": jnp.zeros(2)})
      >>> acc = ga.conditional_set_global_step(acc, 3)
      >>> acc = ga.conditional_apply_grad(acc, {"w": jnp.ones(2)}, local_step=3)
      >>> acc = ga.conditional_apply_grad(acc, {"w": jnp.ones(2)}, local_step=2)  # stale
      >>> int(acc.num_accumulated), int(acc.num_stale)
      (1, 1)
    """
    max_staleness = validation.check_int("max_staleness", max_staleness, minimum=0)
    _check_staleness_weight(staleness_weight)
    acc, rewrap = _unwrap(state)
    if value is not None and acc.acc_value is None:
        raise TypeError(
            "conditional_apply_grad got value=, but the state holds no sum of values: it "
            "is a bare ConditionalAccumulator, or its inner optimizer reads no loss. Drop "
            "value=."
        )
    received = loss_value.receive(
        {} if value is None else {"value": value}, acc.acc_value, "conditional_apply_grad"
    )
    grad = trees.as_arrays(grad)
    verdict = _judge(
        acc, grad, local_step, max_staleness, staleness_weight, skip_nonfinite, received
    )
    new_sum = engine.window_total(acc.acc_grads, None, grad, verdict.accepted, verdict.weight)
    return rewrap(_counted(acc, verdict, received)._replace(acc_grads=new_sum))


def conditional_num_accumulated(
    state: ConditionalAccumulator | ConditionalAccumulateState,
) -> jax.Array:
    """Returns the number of gradients accepted since the last take.

    Args:
      state: A `ConditionalAccumulator` or
        `ConditionalAccumulateState`.

    Returns:
      An `int32` scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> acc = ga.conditional_accumulator_init({"w": jnp.zeros(2)})
      >>> acc = ga.conditional_apply_grad(acc, {"w": jnp.ones(2)}, local_step=0)
      >>> int(ga.conditional_num_accumulated(acc))
      1
    """
    return _unwrap(state)[0].num_accumulated


def conditional_set_global_step(
    state: ConditionalAccumulator | ConditionalAccumulateState,
    new_global_step: jax.typing.ArrayLike,
) -> ConditionalAccumulator | ConditionalAccumulateState:
    """Raises the accumulator's `global_step` to `new_global_step`.

    A value lower than the current `global_step` is ignored, so that
    staleness can never move backwards and let old gradients in. Since jitted
    code cannot log, the ignored call is reported by incrementing
    `num_ignored_steps` in the returned state. (TensorFlow logs a warning
    and sets the lower step anyway.) Gradients already accumulated stay in the
    sum.

    Args:
      state: A `ConditionalAccumulator` or
        `ConditionalAccumulateState`.
      new_global_step: Integer scalar.

    Returns:
      The new state, of the same type as `state`.

    Raises:
      TypeError: If `new_global_step` is not an integer scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> acc = ga.conditional_accumulator_init({"w": jnp.zeros(2)})
      >>> acc = ga.conditional_set_global_step(acc, 5)
      >>> acc = ga.conditional_set_global_step(acc, 4)  # lower: ignored, counted
      >>> int(acc.global_step), int(acc.num_ignored_steps)
      (5, 1)
    """
    acc, rewrap = _unwrap(state)
    new = validation.check_scalar("new_global_step", new_global_step, integer=True)
    lower = new < acc.global_step
    return rewrap(
        acc._replace(
            global_step=jnp.where(lower, acc.global_step, new).astype(jnp.int32),
            num_ignored_steps=trees.increment_if(acc.num_ignored_steps, lower),
        )
    )


def conditional_take_grad(
    state: ConditionalAccumulator | ConditionalAccumulateState,
    num_required: int | jax.Array,
    *,
    reduction: str = "mean",
) -> tuple[optax.Updates, jax.Array, ConditionalAccumulator | ConditionalAccumulateState]:
    r"""Takes the accumulated gradient if at least `num_required` are in.

    When `n = num_accumulated >= num_required` it returns the mean
    `Σ w·g / n` (divided by the actual count `n`, which may exceed
    `num_required`) or the sum `Σ w·g`, resets the sum and the count to zero
    and increments `global_step`. Otherwise it returns zeros and the state
    unchanged; TensorFlow blocks instead, which a pure function cannot do.

    Args:
      state: A `ConditionalAccumulator` or
        `ConditionalAccumulateState`.
      num_required: Number of gradients needed, an int `>= 1` (a traced
        integer below 1 counts as 1).
      reduction: `"mean"` (default) or `"sum"`.

    Returns:
      `(gradient, ready, new_state)`: the reduced gradient in the
      accumulator dtype (zeros when not ready), a boolean scalar, and the new
      state of the same type as `state`.

    Raises:
      ValueError: If `num_required < 1` or `reduction` is unknown.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> acc = ga.conditional_accumulator_init({"w": jnp.zeros(2)})
      >>> acc = ga.conditional_apply_grad(acc, {"w": jnp.array([1.0, 2.0])}, local_step=0)
      >>> acc = ga.conditional_apply_grad(acc, {"w": jnp.array([3.0, 6.0])}, local_step=0)
      >>> g, ready, acc = ga.conditional_take_grad(acc, num_required=2)
      >>> g["w"], bool(ready), int(acc.global_step)
      (Array([2., 4.], dtype=float32), True, 1)
    """
    validation.check_choice("reduction", reduction, _REDUCTIONS)
    if isinstance(num_required, jax.core.Tracer):
        required = jnp.maximum(
            validation.check_scalar("num_required", num_required, integer=True), 1
        )
    else:
        required = validation.check_int("num_required", num_required, minimum=1)  # type: ignore[assignment]
    acc, rewrap = _unwrap(state)
    ready = acc.num_accumulated >= required
    count = jnp.maximum(acc.num_accumulated, 1)
    reduced = _reduce(acc.acc_grads, count, reduction)
    taken = jax.tree.map(lambda r: jnp.where(ready, r, jnp.zeros_like(r)), reduced)
    new_acc = acc._replace(
        global_step=trees.increment_if(acc.global_step, ready),
        num_accumulated=jnp.where(ready, 0, acc.num_accumulated).astype(jnp.int32),
        acc_grads=jax.tree.map(lambda a: jnp.where(ready, jnp.zeros_like(a), a), acc.acc_grads),
        acc_value=_emptied_value(acc.acc_value, ready),
    )
    return taken, ready, rewrap(new_acc)


def _emptied_value(held: jax.Array | None, reset: jax.Array) -> jax.Array | None:
    return None if held is None else jnp.where(reset, jnp.zeros_like(held), held)


def conditional_accumulate(
    inner: optax.GradientTransformation,
    num_required: int,
    *,
    reduction: str = "mean",
    max_staleness: int = 0,
    staleness_weight: StalenessWeight | None = None,
    accumulator_dtype: Any = None,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""Accumulates fresh gradients and applies `inner` once `num_required` are in.

    A staleness-aware accumulator for asynchronous or delayed gradient
    producers (pipelines, parameter-server-like loops, federated rounds),
    after TensorFlow's `ConditionalAccumulator`. Every `update` call takes
    a `local_step=` extra argument: the accumulator's `global_step` (read
    from `state.accumulator.global_step`) that was current when the
    gradient's parameters were read. A gradient is dropped, and counted in
    `num_stale`, when

    $$
    \text{local\_step} < \text{global\_step} - \text{max\_staleness}.
    $$

    Accepted gradients are summed. The call that brings the count to
    `n = num_required` runs `inner.update` once on

    $$
    \bar g = \frac{1}{n}\sum_i w_i g_i \quad\text{(mean, default)}
    \qquad\text{or}\qquad \bar g = \sum_i w_i g_i \quad\text{(sum)},
    $$

    resets the sum and the count, increments `global_step` and returns the
    inner update; every other call returns exact zeros and leaves the inner
    state untouched. With `max_staleness=0` and fresh gradients this is
    `gradaccum_jax.accumulate` with `K = num_required`: the same mean (the
    sum times the count's reciprocal), and the same params bit for bit when
    XLA compiles both alike; with its default CPU flags it fuses the two
    programs differently, and an inner Adam ends up to 2 ulp apart in a few
    elements (SGD stays bit for bit; tested both ways).

    Down-weighting stale gradients: with `staleness_weight` an accepted
    gradient of staleness `τ = max(global_step - local_step, 0) <=
    max_staleness` gets the weight `w = staleness_weight(τ)` (`w = 1`
    without it). The mean still divides by the count `n`, not by `Σ w`,
    so a window of stale gradients moves the parameters less, as in
    staleness-dependent learning rates (Zhang et al. 2016 use `1/τ`-like
    scaling); dividing by `Σ w` would cancel a uniform down-weighting.
    A common choice is `lambda tau: 1.0 / (1.0 + tau)`.

    Fresh gradients with a non-finite leaf are dropped and counted in
    `num_skipped`; they do not count towards `num_required`. The gate is
    the same `jax.lax.cond` as `gradaccum_jax.accumulate`: the inner
    optimizer is not computed between takes, and the accumulator is written
    after the conditional, ordered by a flag it returns, so XLA passes the
    inner state and the sum through without copying them.

    An inner optimizer that reads the loss (`optax.contrib.reduce_on_plateau`,
    `momo`, `optax.polyak_sgd`; recognised at `init` as by
    `gradaccum_jax.accumulate`) needs `value=` on every call, and the take
    gives it the values reduced like the gradients, `Σ w·value / n` (or the
    sum): the loss whose gradient it receives. The sum is held in
    `state.accumulator.acc_value`. A line search (`optax.lbfgs`) is refused.

    The accumulator's primitive operations are also available as pure
    functions on the state: `conditional_apply_grad`,
    `conditional_num_accumulated`, `conditional_set_global_step`
    and `conditional_take_grad`.

    Args:
      inner: The optimizer to apply once per take, any
        `optax.GradientTransformation` without a line search; extra arguments
        other than `local_step` are passed to it as given on the taking call,
        `value=` as the take's loss where it reads the loss.
      num_required: Number of accepted gradients per take, an int `>= 1`.
      reduction: `"mean"` (default, divided by the actual count) or
        `"sum"`.
      max_staleness: Steps a gradient may lag behind `global_step` and still
        be accepted, an int `>= 0`. `0` (default) accepts only gradients
        computed at the current step or later.
      staleness_weight: `None` (default), or a callable mapping the
        staleness `τ` (an `int32` scalar) to a real weight, as above.
      accumulator_dtype: dtype of the sum; `None` keeps float32 and wider
        gradients and sums 16-bit gradients in float32.
      skip_nonfinite: If `True` (default), fresh gradients with a non-finite
        leaf (or weight) are dropped and counted.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose `update` requires
      `local_step=` (an integer scalar).

    Raises:
      TypeError: If `inner` is not a gradient transformation, an integer
        argument is not an int, or `staleness_weight` is not callable; at
        trace time, if `update` gets no `value=` while `inner` reads the loss.
      ValueError: If `num_required < 1`, `max_staleness < 0` or
        `reduction` is unknown; at `init`, if `inner` holds a line search;
        at trace time, if a gradient leaf has the wrong shape (the message
        names its path).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = ga.conditional_accumulate(optax.sgd(0.1), num_required=2)
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> state = tx.init(params)
      >>> g = {"w": jnp.array([1.0, 1.0])}
      >>> u, state = tx.update(g, state, params, local_step=0)
      >>> u, state = tx.update(g, state, params, local_step=0)  # second: take
      >>> u["w"], int(state.accumulator.global_step)
      (Array([-0.1, -0.1], dtype=float32), 1)
      >>> u, state = tx.update(g, state, params, local_step=0)  # computed at step 0: stale
      >>> int(state.accumulator.num_stale), int(state.accumulator.num_accumulated)
      (1, 0)

    References:
      Chen et al., *Revisiting Distributed Synchronous SGD*, 2016,
      https://arxiv.org/abs/1604.00981

      Zhang et al., *Staleness-aware Async-SGD for Distributed Deep Learning*,
      2016, https://arxiv.org/abs/1511.05950
    """
    validation.check_gradient_transformation("inner", inner)
    num_required = validation.check_int("num_required", num_required, minimum=1)
    validation.check_choice("reduction", reduction, _REDUCTIONS)
    max_staleness = validation.check_int("max_staleness", max_staleness, minimum=0)
    _check_staleness_weight(staleness_weight)
    validation.check_accumulator_dtype(accumulator_dtype)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> ConditionalAccumulateState:
        acc = conditional_accumulator_init(params, accumulator_dtype=accumulator_dtype)
        inner_state = inner.init(params)
        loss_value.refuse_line_search(inner_state, "gradaccum_jax.conditional_accumulate")
        held = loss_value.initial(
            inner, inner_state, params, params, trees.weight_dtype(acc.acc_grads)
        )
        return ConditionalAccumulateState(
            accumulator=acc._replace(acc_value=held), inner_state=inner_state
        )

    def update_fn(
        updates: optax.Updates,
        state: ConditionalAccumulateState,
        params: optax.Params | None = None,
        *,
        local_step: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, ConditionalAccumulateState]:
        placement.check_enclosing_updates()
        validation.refuse_unreduced("updates", updates, "conditional_accumulate")
        if local_step is None:
            raise TypeError(
                "conditional_accumulate's update needs local_step=, the global step at "
                "which the gradient's parameters were read (for fresh gradients, "
                "state.accumulator.global_step)."
            )
        grads = trees.as_arrays(updates)
        acc = state.accumulator
        value = loss_value.receive(extra_args, acc.acc_value)

        # Accept.
        verdict = _judge(
            acc, grads, local_step, max_staleness, staleness_weight, skip_nonfinite, value
        )
        counted = _counted(acc, verdict, value)
        # A take needs an accepted gradient in this call unless the count was
        # already raised to num_required through conditional_apply_grad.
        takes = counted.num_accumulated >= num_required

        # Apply or skip. The count enters as a float operand, as accumulate's
        # weight does: a division by an int converted inside the branch is
        # rewritten by XLA into a product with its reciprocal (one ulp off).
        def step(window: engine.Window, inner_state):
            reduced = _reduce(window.total, window.weight, reduction)
            extra = extra_args
            if counted.acc_value is not None:
                # The value of the function whose gradient `reduced` is.
                mean = reduction == "mean"
                extra = {
                    **extra,
                    "value": loss_value.of_window(counted.acc_value, window.weight, mean),
                }
            return engine.inner_update(inner, reduced, inner_state, grads, params, extra)

        new_updates, new_inner, _, took, _ = engine.close(
            engine.local_gate(),
            takes,
            acc.acc_grads,
            state.inner_state,
            counted.num_accumulated.astype(jnp.float32),
            jnp.ones([], jnp.float32),
            total=lambda a: engine.window_total(a, None, grads, verdict.accepted, verdict.weight),
            step=step,
            like=grads,
        )

        # Write.
        new_sum, _ = engine.write(
            acc.acc_grads, None, grads, verdict.accepted, verdict.weight, took
        )
        new_acc = counted._replace(
            global_step=trees.increment_if(acc.global_step, took),
            num_accumulated=jnp.where(took, 0, counted.num_accumulated).astype(jnp.int32),
            acc_grads=new_sum,
            acc_value=_emptied_value(counted.acc_value, took),
        )
        return new_updates, ConditionalAccumulateState(accumulator=new_acc, inner_state=new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
