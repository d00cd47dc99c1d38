"""The update path of `accumulate`, one named function per stage.

    accept -> weigh -> add -> close -> write

`update` below calls them in that order and is the whole path. What the
arguments of `accumulate` fix once (the inner optimizer, the schedule, the
flags) is a `Plan`; what one call knows about its micro-step is a `Micro`.
What depends on how the gradients are distributed is the `Route` (`routes`);
the two optional hooks plug into the stages instead of branching through them:

- the noise-scale `Probe` (`track_noise_scale`): its squared norm is `accept`'s
  finite check, its sums travel through `close` with the window's reduction,
  and `write` stores them;
- the fused path's `Receipt` (`apply_gradients`): `accept` takes a finiteness
  flag that the transformation before vouched for, and `close` applies the
  window's update to the params inside the conditional.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import checkify

from gradaccum_jax._base import trees, validation
from gradaccum_jax._sharding import partials
from gradaccum_jax._window import engine, loss_scale, loss_value, noise_scale, placement, routes
from gradaccum_jax._window.fused import FUSE_KEY, SURVEY_KEY
from gradaccum_jax._window.state import AccumulateState, refuse_outermost_inside


class Plan(NamedTuple):
    """What the arguments of `accumulate` fix for every call (see its docstring)."""

    inner: optax.GradientTransformationExtraArgs
    every_k_schedule: Any
    use_grad_mean: bool
    accumulator_dtype: Any
    compensated: bool
    skip_nonfinite: bool
    axis_names: tuple[Any, ...] | None
    should_skip_update_fn: Any
    count_skipped_steps: bool
    check_values: bool
    shard_inner_state: Any
    zero_axes: tuple[Any, ...] | None
    track_noise_scale: bool
    noise_scale_decay: float
    micro_batch_size: int | None
    refuse: Any  # (route name, where) -> None: raises for a refused option
    state_type: type  # AccumulateState, or UncountedAccumulateState (count_skipped_steps=False)
    window: placement.Window  # how the placement errors name this window and its fixes

    @property
    def bare(self) -> bool:
        """A static window of one micro-step holds nothing between calls: no accumulator."""
        return (
            not callable(self.every_k_schedule)
            and self.every_k_schedule == 1
            and not self.compensated
            and self.shard_inner_state is None
            and not self.track_noise_scale
        )


class Micro(NamedTuple):
    """One call of `update`, as the stages see it."""

    grads: Any  # the micro-gradient, as arrays
    params: Any  # the params passed to update (None if none)
    like: Any  # the tree that gives the updates their shardings (params, else grads)
    route: routes.Route  # the reduction strategy
    probe: noise_scale.Probe | None  # the noise-scale hook
    receipt: Any  # the fused path's Receipt, or None
    vouched: jax.Array | None  # the finiteness flag the receipt holds for `grads`, or None
    extra_args: dict[str, Any]  # passed on to the inner transformation
    ends: jax.Array | None = None  # bool[]: the caller ends the window here (None: the count)
    value: jax.Array | None = None  # the loss (value=), where the window holds their sum


class Accepted(NamedTuple):
    """What `accept` decided."""

    accepted: jax.Array  # bool[]: the micro-gradient enters the window
    valid: jax.Array  # bool[]: its weight is usable (True without a weight)
    weight: jax.Array | None  # the weight in acc_weight's dtype, None without one
    skip_state: Any  # should_skip_update_fn's metrics


class Weighed(NamedTuple):
    """What `weigh` decided: the term's factor and the units the window is held in."""

    scale: jax.Array | None  # the term's factor w / unit (None: 1)
    unit: jax.Array  # the window's weight unit after this micro-step
    term: jax.Array  # the weight this term adds to the window, in units
    keep: jax.Array | None = None  # rescales the held sums and weight first (None: 1)


class Added(NamedTuple):
    """What `add` returned: the window including this micro-step, for the gate."""

    held: Any  # the sums to pass through the gate (the gradient for a bare window)
    total: Any  # held -> the window's sums, read inside the apply branch
    empty: Any  # (held, reset) -> held emptied where reset; None for a bare window
    weight: jax.Array  # the window's weight including this micro-step, in units
    num_skipped: jax.Array  # the drop count including this micro-step
    micro_step: jax.Array  # int32[]: micro-steps counted in the window, this one included
    closes: jax.Array  # bool[]: this micro-step ends the window
    value: jax.Array | None = None  # the window's sum of values, this one included


class Closed(NamedTuple):
    """What the gate returned."""

    updates: Any  # the updates (the new params on the fused path)
    inner_state: Any
    held: Any  # the sums after the window (None for a bare window)
    reset: jax.Array  # bool[]: the window ended
    applied: jax.Array  # bool[]: an inner update was applied
    noise: Any  # the new NoiseScaleState, or None


def window_length(plan: Plan, gradient_step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The window length at `gradient_step` and whether the schedule asked for less than 1."""
    k, short = engine.window_length(plan.every_k_schedule, gradient_step)
    if plan.check_values:
        checkify.check(
            ~short,
            "every_k_schedule returned a window length below 1 at gradient_step={}",
            gradient_step,
        )
    return k, short


def skip_decision(plan: Plan, grads: Any, gradient_step: jax.Array, params: Any):
    """`should_skip_update_fn`'s answer, checked to be a boolean scalar."""
    should_skip, metrics = plan.should_skip_update_fn(grads, gradient_step, params)
    if jnp.result_type(should_skip) != jnp.bool_ or jnp.shape(should_skip) != ():
        raise TypeError(
            "should_skip_update_fn must return (should_skip, metrics) with should_skip a "
            f"boolean scalar; it returned dtype {jnp.result_type(should_skip)} and shape "
            f"{jnp.shape(should_skip)}."
        )
    return should_skip, metrics


def route_for(plan: Plan, grads: Any, like: Any) -> routes.Route:
    """The reduction strategy, from the arguments and the gradients' types."""
    if plan.axis_names is not None:
        return routes.ReplicaRoute(plan.compensated, plan.axis_names, grads)
    axes = partials.unreduced_axes("updates", grads) or plan.zero_axes
    if axes is None and plan.shard_inner_state is None:
        return routes.LocalRoute(plan.compensated)
    if axes is None:
        specs = partials.inner_specs(like, plan.shard_inner_state, None)
        axes = partials.spec_axes("shard_inner_state", specs)
    partials.check_unreduced_windows(f"updates unreduced over mesh axes {axes}")
    if plan.zero_axes is not None and set(axes) != set(plan.zero_axes):
        raise ValueError(
            f"the gradients are unreduced over {axes}, but shard_inner_state="
            f"{plan.shard_inner_state!r} shards the inner state over {plan.zero_axes}; name "
            "the same axis in both."
        )
    plan.refuse("unreduced", f"gradients unreduced over mesh axes {axes}")
    specs = partials.inner_specs(like, plan.shard_inner_state, plan.zero_axes)
    return routes.UnreducedRoute(axes, specs)


def gradient_tree(params: optax.Params) -> optax.Params:
    """The part of `params` that the gradients are taken of: the fast params of
    `optax.LookaheadParams` (whose slow params only `optax.lookahead` moves), else all."""
    return params.fast if isinstance(params, optax.LookaheadParams) else params


def init(plan: Plan, params: optax.Params) -> AccumulateState:
    """The state at the start of the first window."""
    params = trees.as_arrays(params)
    validation.check_float_tree("params", params)
    acc = trees.zeros(gradient_tree(params), plan.accumulator_dtype)
    if plan.compensated:
        validation.check_compensable("params", acc)
    acc_weight, num_skipped = jnp.zeros([], trees.weight_dtype(acc)), trees.counter()
    inner_params = params
    if plan.shard_inner_state is not None:
        # ZeRO-1: the window is unreduced from the start, the inner state sharded.
        route = route_for(plan, params, params)
        acc, acc_weight, num_skipped = partials.unreduced_zeros(
            (acc, acc_weight, num_skipped), route.axes
        )
        inner_params = route.inner_params(params)
    if plan.bare:
        acc = None
    inner_state = plan.inner.init(inner_params)
    loss_scale.refuse_inside_accumulate(inner_state)
    loss_value.refuse_line_search(inner_state, plan.window.name)
    refuse_outermost_inside(inner_state, "gradaccum_jax.accumulate")
    skip_state = ()
    if plan.should_skip_update_fn is not None:
        zeros = jax.tree.map(jnp.zeros_like, gradient_tree(params))
        _, skip_state = skip_decision(plan, zeros, trees.counter(), params)
    return plan.state_type(
        micro_step=trees.counter(),
        gradient_step=trees.counter(),
        window_length=window_length(plan, trees.counter())[0],
        updated=jnp.array(False),
        acc_grads=acc,
        acc_weight=acc_weight,
        weight_unit=jnp.ones([], acc_weight.dtype),
        num_skipped=num_skipped,
        inner_state=inner_state,
        num_short_windows=trees.counter(),
        acc_compensation=jax.tree.map(jnp.zeros_like, acc) if plan.compensated else None,
        skip_state=skip_state,
        noise_scale=noise_scale.init() if plan.track_noise_scale else None,
        acc_value=loss_value.initial(
            plan.inner, inner_state, gradient_tree(inner_params), inner_params, acc_weight.dtype
        ),
    )


def receive(
    plan: Plan, updates: Any, state: AccumulateState, params: Any, weight: Any, extra: dict
) -> Micro:
    """Checks one call's arguments and picks its route and hooks."""
    receipt = extra.pop(FUSE_KEY, None)
    if receipt is not None:
        receipt.received(params)
    survey = extra.pop(SURVEY_KEY, None)
    if survey is not None:
        survey.answer(plan.axis_names)
    grads = trees.as_arrays(updates)
    if not plan.bare:
        validation.check_same_structure("updates", grads, "state.acc_grads", state.acc_grads)
    validation.check_float_tree("updates", grads)
    like = grads if params is None else params
    route = route_for(plan, grads, like)
    probe = None
    if plan.track_noise_scale:
        if weight is not None and plan.micro_batch_size is not None:
            raise ValueError(
                f"update got weight= but accumulate has micro_batch_size="
                f"{plan.micro_batch_size}: the noise scale's batch unit is the weight when one "
                "is passed. Build accumulate with micro_batch_size=None."
            )
        probe = noise_scale.Probe(plan.noise_scale_decay, plan.micro_batch_size, plan.axis_names)
    value = loss_value.receive(extra, state.acc_value)
    if value is not None and route.per_device:
        raise ValueError(
            "an inner optimizer that reads value= (reduce_on_plateau, momo, polyak_sgd) is not "
            "supported with gradients unreduced over mesh axes: the window's loss would be a "
            "per-device partial. Take the gradients with jax.shard_map and axis_name=, or drop "
            "the reader."
        )
    # The receipt vouches for the very leaves it was handed, so it reads `updates`.
    vouched = None if receipt is None else receipt.finite(updates)
    return Micro(grads, params, like, route, probe, receipt, vouched, extra, value=value)


def check_weight(weight: Any) -> jax.Array:
    return validation.check_scalar(
        "weight",
        weight,
        minimum=0.0,
        dtype=jnp.float32,
        hint=" It is the micro-batch's total weight: sum per-example weights first, "
        "e.g. weight=mask.sum().",
    )


def accept(plan: Plan, micro: Micro, state: AccumulateState, weight: Any) -> Accepted:
    """Whether the micro-gradient enters the window: finite, with a usable weight, not rejected.

    Per device on the unreduced route. The finite check is the probe's squared
    norm when the noise scale is measured, the flag a global clip vouched for
    when there is one, and the route's own pass otherwise; the route then makes
    the devices that hold parts of one gradient agree (`agree`).
    """
    w = None if weight is None else check_weight(weight).astype(state.acc_weight.dtype)
    valid = jnp.array(True)
    if w is not None:
        # An unusable weight drops its micro-gradient whatever skip_nonfinite says:
        # held, a negative weight would cancel the next micro-gradient's.
        valid = jnp.isfinite(w) & (w >= 0)
        if plan.check_values:
            checkify.check(valid, "weight must be finite and >= 0; got weight={}", w)
    if micro.probe is not None and plan.skip_nonfinite:
        accepted = valid & micro.probe.finite(micro.grads)
    elif micro.vouched is not None and plan.skip_nonfinite and not micro.route.per_device:
        # The transformation before this one measured the gradient and said
        # whether it is finite (a global clip_norm): the same flag, no pass.
        accepted = valid & micro.vouched
    else:
        accepted = micro.route.accept(micro.grads, valid, plan.skip_nonfinite)
    if micro.value is not None and plan.skip_nonfinite:
        accepted = accepted & jnp.isfinite(micro.value)
    skip_state = state.skip_state
    if plan.should_skip_update_fn is not None:
        should_skip, skip_state = skip_decision(
            plan, micro.grads, state.gradient_step, micro.params
        )
        skip_state = engine.keep_state_types(skip_state, state.skip_state, "skip")
        accepted = accepted & ~should_skip
    return Accepted(micro.route.agree(accepted), valid, w, skip_state)


def weigh(plan: Plan, micro: Micro, state: AccumulateState, acc: Accepted) -> Weighed:
    """The term's factor, in units of the window's first usable weight (see `weight_unit`)."""
    if acc.weight is None:
        return Weighed(None, state.weight_unit, jnp.ones([], state.acc_weight.dtype))
    if not plan.bare and _holds_float16(state.acc_grads):
        return _running_mean_units(micro, state, acc, acc.weight)
    first = micro.route.starts_unit(acc.accepted, acc.valid, state) & (acc.weight > 0)
    unit = jnp.where(first, acc.weight, state.weight_unit)
    scale = acc.weight / unit
    return Weighed(scale, unit, scale)


def _holds_float16(acc: Any) -> bool:
    return any(leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(acc))


def _running_mean_units(
    micro: Micro, state: AccumulateState, acc: Accepted, w: jax.Array
) -> Weighed:
    """float16 sums held in units of the window's weight so far: its running weighted mean.

    A later, larger weight (4096 tokens after 1) then shrinks the held sum
    instead of overflowing float16's 65504; `keep` rescales the held sum in
    the add's own pass.
    """
    dtype = state.acc_weight.dtype
    if micro.route.per_device:
        # One unit on every device: the usable weight so far (the same
        # everywhere), of which each device's accepted weights are a part.
        so_far = jnp.where(state.micro_step == 0, 0.0, state.weight_unit)
        unit = so_far + jnp.where(acc.valid, w, 0.0)
        safe = jnp.where(unit > 0, unit, 1.0)
        keep = jnp.where(unit > 0, so_far / safe, 1.0).astype(dtype)
        scale = jnp.where(unit > 0, w / safe, 0.0)
        return Weighed(scale, unit, scale, keep)
    # The running weighted mean of this device's window.
    so_far = state.acc_weight * state.weight_unit
    grows = acc.accepted & (w > 0)
    unit = jnp.where(grows, so_far + w, state.weight_unit)
    keep = jnp.where(grows, so_far / unit, 1.0).astype(dtype)
    scale = w / unit
    return Weighed(scale, unit, scale, keep)


def add(plan: Plan, micro: Micro, state: AccumulateState, acc: Accepted, w: Weighed) -> Added:
    """The window including this micro-step (sums, weight, count), before the gate reads it.

    A bare window holds nothing between calls: it starts empty on every call,
    from constants, so that without a finite check or weight the gate is known
    to apply at trace time; its sum is read from the gradient inside the apply
    branch.
    """
    route = micro.route
    held_weight = jnp.zeros([], state.acc_weight.dtype) if plan.bare else state.acc_weight
    weight, num_skipped = route.count(
        held_weight, state.num_skipped, acc.accepted, w.term, None, w.keep
    )
    counted = jnp.array(True) if plan.count_skipped_steps else acc.accepted
    step = (jnp.int32(0) if plan.bare else state.micro_step) + counted.astype(jnp.int32)
    if micro.ends is None:
        closes = counted & (step >= (jnp.int32(1) if plan.bare else state.window_length))
    else:
        # The caller ends the window (a Poisson-sampled logical batch of any length).
        closes = counted & micro.ends
    value, held_value = None, state.acc_value
    if micro.value is not None and held_value is not None:  # receive took it for this sum
        held_value = jnp.zeros_like(held_value) if plan.bare else held_value
        value = loss_value.add(held_value, micro.value, acc.accepted, acc.weight)
    if plan.bare:

        def window_of(grads):
            zeros = trees.zeros(route.zeros_like(grads, micro.params), plan.accumulator_dtype)
            return route.read(route.add((zeros, None), grads, acc.accepted, w.scale))

        return Added(micro.grads, window_of, None, weight, num_skipped, step, closes, value)
    held = route.add(route.held(state), micro.grads, acc.accepted, w.scale, w.keep)

    def empty(held, reset):
        return route.emptied(held, reset, acc.accepted)

    return Added(held, route.read, empty, weight, num_skipped, step, closes, value)


def reduce_window(plan: Plan, window: engine.Window) -> Any:
    """The tree passed to the inner optimizer: the window's mean, or its sum."""
    if plan.use_grad_mean:
        # A product, not a quotient: XLA recomputes it inside each reader
        # (adam's two moments) instead of writing the mean to a buffer.
        # In at least float32, so that 1 / w keeps its precision.
        reciprocal = 1 / window.weight

        def mean(t):
            wide = jnp.promote_types(t.dtype, reciprocal.dtype)
            return t.astype(wide) * reciprocal.astype(wide)

        return jax.tree.map(mean, window.total)

    # float16 sums times their unit in float32: the sum may exceed 65504.
    def in_units(t):
        wide = jnp.float32 if t.dtype == jnp.float16 else t.dtype
        return t.astype(wide) * window.unit.astype(wide)

    return jax.tree.map(in_units, window.total)


def close(
    plan: Plan, micro: Micro, state: AccumulateState, acc: Accepted, w: Weighed, added: Added
) -> Closed:
    """The gate: on the window's last micro-step, reduce once and run the inner optimizer once."""
    route, probe, params = micro.route, micro.probe, micro.params
    stats, inner_operand = None, state.inner_state
    if probe is not None:
        noise = state.noise_scale
        if w.keep is not None:
            noise = noise._replace(acc_sq_norm=noise.acc_sq_norm * w.keep)  # type: ignore[union-attr]
        stats = probe.stats(noise, acc.accepted, w.term, w.unit)  # type: ignore[arg-type]
        inner_operand = (state.inner_state, state.noise_scale)
    if added.value is not None:
        # The window's sum of values travels with its sums, in the same reduction.
        stats = (stats, added.value)

    def apply(window: engine.Window, inner_operand: Any, params: Any = params):
        inner_state = inner_operand if probe is None else inner_operand[0]
        extra_args = micro.extra_args
        if added.value is not None:
            stats, value = window.stats
            window = window._replace(stats=stats)
            value = loss_value.of_window(value, window.weight * window.unit, plan.use_grad_mean)
            extra_args = {**extra_args, "value": value}
        new_updates, new_inner = engine.inner_update(
            plan.inner,
            reduce_window(plan, window),
            inner_state,
            micro.grads,
            route.inner_params(params),
            extra_args,
            check_parts=isinstance(route, routes.ReplicaRoute) and route.typed,
        )
        new_updates = route.back(new_updates, micro.like)
        if micro.receipt is not None:
            # The fused path: the params are updated here, once per window.
            new_updates = optax.apply_updates(params, new_updates)
        if probe is None:
            return new_updates, new_inner
        folded = probe.fold(inner_operand[1], window, probe.big_sq_norm(window))
        return new_updates, (new_inner, folded)

    updates, new_inner, new_held, reset, applied = engine.close(
        route.gate(),
        added.closes,
        added.held,
        inner_operand,
        added.weight,
        w.unit,
        total=added.total,
        step=apply,
        like=route.zeros_like(micro.grads, params),
        stats=stats,
        params=None if micro.receipt is None else params,
        empty=added.empty,
    )
    noise = None
    if probe is not None:
        new_inner, noise = new_inner
        noise = probe.after(noise, reset)
    return Closed(updates, new_inner, new_held, reset, applied, noise)


def write(
    plan: Plan,
    micro: Micro,
    state: AccumulateState,
    acc: Accepted,
    w: Weighed,
    added: Added,
    closed: Closed,
) -> AccumulateState:
    """The state after this micro-step: counters, the emptied or grown window, the next length."""
    dtype = state.acc_weight.dtype
    reset = closed.reset
    new_acc, new_comp = (None, None) if plan.bare else closed.held
    acc_weight, _ = micro.route.count(
        state.acc_weight, state.num_skipped, acc.accepted, w.term, reset, w.keep
    )
    gradient_step = trees.increment_if(state.gradient_step, closed.applied)
    next_length, short = window_length(plan, gradient_step)
    if isinstance(plan.every_k_schedule, noise_scale.CriticalBatchSchedule):
        next_length = plan.every_k_schedule.next_k(
            gradient_step, state.window_length, noise_scale.estimate(closed.noise)
        )
    return plan.state_type(
        micro_step=jnp.where(reset, 0, added.micro_step).astype(jnp.int32),
        gradient_step=gradient_step,
        window_length=jnp.where(reset, next_length, state.window_length).astype(jnp.int32),
        updated=closed.applied,
        acc_grads=new_acc,
        acc_weight=acc_weight,
        weight_unit=jnp.where(reset, 1.0, w.unit).astype(dtype),
        num_skipped=added.num_skipped,
        inner_state=closed.inner_state,
        num_short_windows=trees.increment_if(state.num_short_windows, reset & short),
        acc_compensation=new_comp,
        skip_state=acc.skip_state,
        noise_scale=closed.noise,
        acc_value=None if added.value is None else jnp.where(reset, 0.0, added.value).astype(dtype),
    )


def update(
    plan: Plan,
    updates: optax.Updates,
    state: AccumulateState,
    params: optax.Params | None,
    weight: Any,
    extra_args: dict[str, Any],
    ends: jax.Array | None = None,
) -> tuple[optax.Updates, AccumulateState]:
    """One micro-step: accept, weigh, add, close (the gate), write.

    `ends` (a boolean scalar, or `None` to follow the window's length) ends the
    window on this call when true, whatever its length says.
    """
    placement.check_enclosing_updates()
    placement.refuse_window_output(updates, plan.window)
    micro = receive(plan, updates, state, params, weight, extra_args)._replace(ends=ends)
    acc = accept(plan, micro, state, weight)
    w = weigh(plan, micro, state, acc)
    added = add(plan, micro, state, acc, w)
    closed = close(plan, micro, state, acc, w, added)
    if micro.receipt is None:
        placement.mark_window_output(closed.updates, plan.window)
    else:
        micro.receipt.returned(closed.updates)
    return closed.updates, write(plan, micro, state, acc, w, added, closed)
