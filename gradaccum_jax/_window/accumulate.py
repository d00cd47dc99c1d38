"""The accumulating gradient transformation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from gradaccum_jax._base import reduce_rules, validation
from gradaccum_jax._sharding import partials
from gradaccum_jax._window import noise_scale, placement, stages
from gradaccum_jax._window.state import (
    AccumulateState,
    AxisName,
    CallerClosedAccumulateState,
    UncountedAccumulateState,
)

ShouldSkipUpdateFn = Callable[[optax.Updates, jax.Array, optax.Params], tuple[jax.Array, Any]]


def _check_skip_options(
    should_skip_update_fn: Any, count_skipped_steps: Any, check_values: Any
) -> None:
    if should_skip_update_fn is not None and not callable(should_skip_update_fn):
        raise TypeError(
            "should_skip_update_fn must be None or a callable (updates, gradient_step, "
            "params) -> (should_skip, metrics), such as optax.skip_not_finite; got "
            f"{should_skip_update_fn=!r}."
        )
    flags = (("count_skipped_steps", count_skipped_steps), ("check_values", check_values))
    for name, value in flags:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool; got {name}={value!r}.")


class _Options(NamedTuple):
    """The arguments of `accumulate` that some routes refuse (see `_REFUSED`)."""

    axis_name: Any
    shard_inner_state: Any
    compensated: bool
    should_skip_update_fn: Any
    count_skipped_steps: bool
    track_noise_scale: bool


# The combinations of a route and an option that `accumulate` refuses, in one place:
# (route, the option as written, whether it is set, why it cannot work there and the fix).
# The replica route is known from `axis_name` when accumulate is built; the unreduced
# route from `shard_inner_state` then, or from the gradients' types at trace time.
_REFUSED: tuple[tuple[str, str, Callable[[_Options], bool], str], ...] = (
    (
        "replica",
        "should_skip_update_fn",
        lambda o: o.should_skip_update_fn is not None,
        "its metrics would differ between replicas. Drop it (non-finite micro-gradients are "
        "already dropped by skip_nonfinite=True), or accumulate without axis_name.",
    ),
    (
        "replica",
        "count_skipped_steps=False",
        lambda o: not o.count_skipped_steps,
        "replicas that drop different micro-steps would close their windows at different "
        "calls and wait for each other's all-reduce forever. Keep count_skipped_steps=True.",
    ),
    (
        "replica",
        "shard_inner_state",
        lambda o: o.shard_inner_state is not None,
        "shard_inner_state is for global-view jax.jit on a mesh, axis_name for "
        "jax.shard_map or jax.pmap; give one of them.",
    ),
    (
        "unreduced",
        "compensated=True",
        lambda o: o.compensated,
        "the window is unreduced over mesh axes; use a float32 accumulator "
        "(accumulator_dtype=None).",
    ),
    (
        "unreduced",
        "should_skip_update_fn",
        lambda o: o.should_skip_update_fn is not None,
        "it needs the whole gradient on every device. Drop it (non-finite partial sums are "
        "dropped per device already).",
    ),
    (
        "unreduced",
        "count_skipped_steps=False",
        lambda o: not o.count_skipped_steps,
        "it needs the whole gradient on every device. Keep count_skipped_steps=True "
        "(non-finite partial sums are dropped per device already).",
    ),
    (
        "unreduced",
        "track_noise_scale=True",
        lambda o: o.track_noise_scale,
        "it measures each micro-gradient's norm, which needs the whole gradient on every "
        "device. Drop track_noise_scale, or measure it with axis_name= under jax.shard_map.",
    ),
)


def _refuse(route: str, options: _Options, where: str) -> None:
    """Raises the `ValueError` of the first refused option of `route` that is set."""
    for name, option, is_set, why in _REFUSED:
        if name == route and is_set(options):
            raise ValueError(f"{option} is not supported with {where}: {why}")


def _refuse_injected(**static: Any) -> None:
    """Raises one `TypeError` naming every static argument if any of them came as an array.

    `optax.inject_hyperparams(accumulate)` passes every numeric argument (and a
    schedule's value) as a JAX array; these arguments shape the compiled step.
    """
    injected = [name for name, value in static.items() if isinstance(value, jax.Array)]
    if injected:
        shown = ", ".join(f"{name}={static[name]!r}" for name in injected)
        raise TypeError(
            f"accumulate got {shown}: a JAX array where a Python value fixed when accumulate "
            "is built is needed (the window length and the noise scale's settings shape the "
            "compiled step; a schedule of K must be called by accumulate, once per window). "
            "optax.inject_hyperparams passes every numeric argument, and the value of every "
            "callable, as an array: keep all of accumulate's static arguments static, "
            f"optax.inject_hyperparams(ga.accumulate, static_args={tuple(static)!r})"
            "(inner, every_k_schedule=4), or inject the inner optimizer's hyperparameters "
            "instead: ga.accumulate(optax.inject_hyperparams(optax.adam)(learning_rate=...), 4)."
        )


def accumulate(
    inner: optax.GradientTransformation,
    every_k_schedule: int | Callable[[jax.Array], Any],
    *,
    use_grad_mean: bool = True,
    accumulator_dtype: Any = None,
    compensated: bool = False,
    skip_nonfinite: bool = True,
    axis_name: AxisName | None = None,
    should_skip_update_fn: ShouldSkipUpdateFn | None = None,
    count_skipped_steps: bool = True,
    check_values: bool = False,
    shard_inner_state: Any = None,
    track_noise_scale: bool = False,
    noise_scale_decay: float = 0.99,
    micro_batch_size: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Accumulates micro-gradients over a window and applies `inner` once per window.

    A window is `K` consecutive calls of `update`. The first `K - 1` calls
    add their gradient to an accumulator and return exact zeros, leaving the
    inner state untouched. The `K`-th call reduces the accumulated gradients,

    $$
    \bar g = \frac{\sum_i w_i g_i}{\sum_i w_i}
    \quad\text{(mean, default)}\qquad\text{or}\qquad
    \bar g = \sum_i w_i g_i \quad\text{(sum)},
    $$

    over the accepted micro-gradients `g_i` with weights `w_i` (`1` unless
    `update` gets a `weight=` extra argument, such as the micro-batch's
    token count), runs `inner.update` once on `ḡ`, resets the accumulator
    and returns the inner update. With the mean, `K` micro-batches give the
    same parameters as one batch `K` times larger, for any inner optimizer
    that reads the gradient. One that reads the loss
    (`optax.contrib.reduce_on_plateau`, `momo`, `momo_adam`, `optax.polyak_sgd`,
    recognised at `init` by their state or by what their update reads) receives
    the window's loss as `value=`: the values passed on every micro-step,
    weighted like the gradients (`AccumulateState.acc_value`).
    A line search (`optax.lbfgs`), which calls `value_fn` at trial params, is
    refused. `optax.lookahead` goes inside, with `optax.LookaheadParams` as
    the params of `init` and `update` and the gradients of `params.fast`.

    Gradients typed unreduced over mesh axes (from `unreduced_value_and_grad`
    in a global-view `jax.jit` step) are accumulated unreduced, with no
    collective on the micro-steps: each device drops its own non-finite
    partial sum, and the window's close reduces the sums and weights once
    (`jax.reshard`). See the distributed-training guide. Unreduced windows
    need JAX 0.9.1 or newer.

    The gate is a `jax.lax.cond`: the inner optimizer is not computed on the
    micro-steps. The gradient is added to the accumulator before the
    conditional, in one fused in-place pass, and a second conditional on the
    first one's `reset` output empties it at the window's end. With that
    layout XLA passes the inner state and the accumulator through without
    copying them (the compiled program is tested for it). For a step that
    updates the params as well, use `apply_gradients`: it updates them inside
    the window's close, so that a micro-step does not touch them.

    A micro-gradient with a non-finite leaf (or a non-finite or negative
    traced `weight`, or one that `should_skip_update_fn` rejects) is
    dropped: it is not added, it does not count in the mean's denominator,
    and `num_skipped` grows by one. By default the dropped micro-step still
    counts toward the window, which closes on schedule after `K` calls; a
    window with nothing accepted applies no inner update and returns zeros.
    With `count_skipped_steps=False` it does not count, as in
    `optax.MultiSteps`: the window closes after `K` accepted
    micro-gradients.

    Values only known inside `jit` cannot raise there: a traced schedule
    value below 1 is taken as 1 (counted in `num_short_windows`), and a
    negative or non-finite traced `weight` drops its micro-gradient
    (counted in `num_skipped`). With `check_values=True` both are also
    reported through `jax.experimental.checkify`: run the step as
    `checkify.checkify(step, errors=checkify.user_checks)` and call
    `err.throw()` on the error it returns.

    Step counting: `gradient_step` counts inner updates. Schedules inside
    `inner` (`optax.adam(optax.cosine_decay_schedule(...))`,
    `optax.inject_hyperparams`) therefore advance once per window. Counters
    outside, such as Flax's `TrainState.step`, count calls of `update`
    (micro-steps); read `optimizer_step` instead.

    Args:
      inner: The optimizer to apply once per window, any
        `optax.GradientTransformation` without a line search (extra
        arguments reach it as given on the closing micro-step; `value=` as the
        window's loss where it reads the loss).
      every_k_schedule: The window length `K`: an int `>= 1`, or a callable
        mapping `gradient_step` (an `int32` scalar) to an integer scalar,
        so that `K` can change between windows without recompiling.
      use_grad_mean: If `True` (default) the window's weighted mean is passed
        to `inner`; if `False`, the weighted sum.
      accumulator_dtype: dtype of the accumulator. `None` (default) keeps
        float32 and wider gradients in their dtype and accumulates float16 and
        bfloat16 gradients in float32; complex gradients are summed in the
        complex counterpart of the precision. `jnp.bfloat16` halves the
        accumulator's memory for float32 gradients at the cost of about
        `log2(K)` mantissa bits. Whatever the accumulator, the inner
        optimizer receives the window's gradient in the gradients' dtype, the
        updates come back in the dtype it returns (zeros on micro-steps
        too), and its state is cast back to the dtypes of its `init`.
      compensated: If `True`, a second buffer in `accumulator_dtype` (which
        must be `jnp.bfloat16` or `jnp.float16`) keeps the rounding error
        of the accumulator, as in Kahan summation: each addition is done in
        float32 and its result split into a 16-bit high part and the 16-bit
        remainder, so the pair carries about 16 mantissa bits. It costs as
        much memory as a float32 accumulator and is less accurate than one;
        see the mixed-precision docs for measurements.
      skip_nonfinite: If `True` (default) non-finite micro-gradients are
        dropped as described above. If `False` they are added as they are.
      axis_name: Name (or tuple of names) of a mapped axis, for use inside
        `jax.shard_map` or `jax.pmap`. Each replica accumulates its own
        micro-gradients, and the sums and weights are summed across replicas
        once per window, inside the conditional, so the mean is over every
        replica's accepted micro-gradients (weighted by the global weight) and
        micro-steps run no collective over `axis_name`. Under `shard_map` the
        gradients must vary between replicas: take them with respect to
        `jax.lax.pcast(params, axis_name, to='varying')`, not the replicated
        params, whose gradient is already summed; the returned updates are
        replica-invariant. Gradients typed varying along other mesh axes as
        well (pipeline stages, tensor shards) hold one replica's
        micro-gradient in parts: their devices agree on dropping it, with one
        scalar all-reduce over those axes per micro-step (under `jax.pmap`
        or `check_vma=False` there are no types, and each device decides
        alone); the inner transformation then sees this device's part, and one
        that reduces it (a global-norm clip) is refused at trace time. Hold
        the state across calls with `replica_state_specs`. See the
        distributed-training guide.
      should_skip_update_fn: `None`, or optax's
        `should_skip_update_fn(updates, gradient_step, params) ->
        (should_skip, metrics)` (`optax.skip_not_finite`,
        `optax.skip_large_updates`, as for `optax.MultiSteps`): a
        micro-gradient for which it returns `True` is dropped as above;
        `metrics` is kept in `AccumulateState.skip_state`. Not with
        `axis_name`.
      count_skipped_steps: If `True` (default) a dropped micro-step counts
        toward the window's `K` calls; if `False` it does not, as in
        `optax.MultiSteps`. Not with `axis_name`, where replicas that drop
        different micro-steps would close their windows at different calls.
      check_values: If `True`, invalid traced values (a schedule value
        below 1, a negative or non-finite `weight`) are reported with
        `jax.experimental.checkify.check` besides being counted.
      shard_inner_state: For global-view `jax.jit` on a mesh with gradients
        from `unreduced_value_and_grad` (ZeRO-1). `None` (default) keeps the
        inner state sharded like the params. A mesh axis name (or tuple of
        names) shards the inner optimizer's state, and the reduced gradient
        and params it sees, over that axis: each leaf whose first dimension
        is divisible by the number of devices along it is split there, the
        others keep the params' sharding. A callable `(path, param) ->
        PartitionSpec` or a tree of `PartitionSpec`s like the params chooses
        per leaf. The window's close then reduces the unreduced sums straight
        into that sharding (a reduce-scatter) and all-gathers the updates
        back to the params' sharding; the accumulator is unreduced from
        `init` on. Not with `axis_name` or `compensated`; needs JAX 0.9.1 or
        newer.
      track_noise_scale: If `True`, measure the gradient noise scale
        (McCandlish et al. 2018) for free: each micro-step also sums its
        micro-gradient's squared norm (one scalar), each window with at least
        two accepted micro-gradients (across replicas) estimates $|G|^2$ and
        $\operatorname{tr}(\Sigma)$ from the micro-gradients' and the window
        mean's squared norms, and `gradient_noise_scale` reads their averages.
        The extra sums travel in the window's one reduction. With an int
        `every_k_schedule`, `K = 1` without `axis_name` is an error (there is
        no small batch to compare with); a scheduled window with a single
        micro-gradient leaves the averages unchanged. `False` (default) leaves
        the state (`noise_scale=None`) and the compiled program as without it.
      noise_scale_decay: Decay $\beta \in [0, 1)$ of the averages, per
        window that yields an estimate (the estimates of single windows are
        very noisy: keep it close to 1).
      micro_batch_size: The unit of batch size for the noise scale when
        `update` gets no `weight`: each micro-batch counts as
        `micro_batch_size` examples, and `b_simple` is in examples. `None`
        (default) counts micro-batches: `b_simple` is then in micro-batches,
        directly comparable with `K` (times replicas). With `weight=` the
        weight is the unit (e.g. tokens) and `micro_batch_size` must be
        `None`; the estimates assume each weight is proportional to its
        micro-batch's number of examples.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose `update` accepts
      `weight=` (a non-negative scalar) and passes any other keyword
      argument to `inner`.

    Raises:
      TypeError: If `inner` is not a gradient transformation, or (at trace
        time) `update` gets no `value=` while `inner` reads the loss,
        `every_k_schedule` is neither an int nor a callable, or
        `accumulator_dtype` is not a floating-point dtype, or `axis_name`
        is neither a name nor a tuple of names, or `shard_inner_state` is
        neither a name, a callable nor a tree of specs.
      ValueError: If `every_k_schedule` is an int below 1, or `inner` holds a
        line search (at `init`), or
        `compensated=True` without a 16-bit `accumulator_dtype` or with
        `shard_inner_state`, or `should_skip_update_fn`,
        `count_skipped_steps=False` or `shard_inner_state` is combined
        with `axis_name`, or `shard_inner_state` is given on JAX older than
        0.9.1, or `noise_scale_decay` is outside `[0, 1)`,
        `micro_batch_size` is not a positive int, or `track_noise_scale=True`
        with `every_k_schedule=1` and no `axis_name`; at trace time, if
        `weight=` is passed together with `micro_batch_size`, if an
        `axis_name` is not bound where `update` runs, or (under
        `shard_map`) the gradients are already replica-invariant, or
        unreduced gradients mix unreduced axes or sit beside leaves sharded
        over them, or come on JAX older than 0.9.1.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = ga.accumulate(optax.sgd(0.1), every_k_schedule=2)
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> state = tx.init(params)
      >>> u, state = tx.update({"w": jnp.array([1.0, 1.0])}, state, params)
      >>> u["w"]  # micro-step: exact zeros
      Array([0., 0.], dtype=float32)
      >>> u, state = tx.update({"w": jnp.array([3.0, 3.0])}, state, params)
      >>> u["w"]  # -0.1 * mean([1, 3])
      Array([-0.2, -0.2], dtype=float32)
      >>> int(state.gradient_step)
      1

    References:
      Goyal et al., *Accurate, Large Minibatch SGD*, 2017,
      https://arxiv.org/abs/1706.02677
    """
    validation.check_gradient_transformation("inner", inner)
    _refuse_injected(
        every_k_schedule=every_k_schedule,
        noise_scale_decay=noise_scale_decay,
        micro_batch_size=micro_batch_size,
    )
    if not callable(every_k_schedule):
        validation.check_int("every_k_schedule", every_k_schedule, schedule=True)
    validation.check_accumulator_dtype(accumulator_dtype, compensated=compensated)
    axis_names = None if axis_name is None else validation.check_axis_name("axis_name", axis_name)
    _check_skip_options(should_skip_update_fn, count_skipped_steps, check_values)
    zero_axes = partials.check_shard_inner_state(shard_inner_state)
    _check_noise_scale_args(
        track_noise_scale, noise_scale_decay, micro_batch_size, every_k_schedule, axis_name
    )
    options = _Options(
        axis_name=axis_name,
        shard_inner_state=shard_inner_state,
        compensated=compensated,
        should_skip_update_fn=should_skip_update_fn,
        count_skipped_steps=count_skipped_steps,
        track_noise_scale=track_noise_scale,
    )
    if axis_name is not None:
        _refuse("replica", options, f"{axis_name=!r}")
    if shard_inner_state is not None:
        _refuse("unreduced", options, f"shard_inner_state={shard_inner_state!r}")
        partials.check_unreduced_windows(f"shard_inner_state={shard_inner_state!r}")
    plan = stages.Plan(
        inner=optax.with_extra_args_support(inner),
        every_k_schedule=every_k_schedule,
        use_grad_mean=use_grad_mean,
        accumulator_dtype=accumulator_dtype,
        compensated=compensated,
        skip_nonfinite=skip_nonfinite,
        axis_names=axis_names,
        should_skip_update_fn=should_skip_update_fn,
        count_skipped_steps=count_skipped_steps,
        check_values=check_values,
        shard_inner_state=shard_inner_state,
        zero_axes=zero_axes,
        track_noise_scale=track_noise_scale,
        noise_scale_decay=noise_scale_decay,
        micro_batch_size=micro_batch_size,
        refuse=lambda route, where: _refuse(route, options, where),
        # The state's type says whether dropped micro-steps count (see closes_window).
        state_type=AccumulateState if count_skipped_steps else UncountedAccumulateState,
        window=placement.ACCUMULATE,
    )

    def init_fn(params: optax.Params) -> AccumulateState:
        reduce_rules.refuse_max_leaves(params, "gradaccum_jax.accumulate")
        return stages.init(plan, params)

    def update_fn(
        updates: optax.Updates,
        state: AccumulateState,
        params: optax.Params | None = None,
        *,
        weight: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, AccumulateState]:
        return stages.update(plan, updates, state, params, weight, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_noise_scale_args(
    track: Any, decay: Any, micro_batch_size: Any, every_k_schedule: Any, axis_name: Any
) -> None:
    if not isinstance(track, bool):
        raise TypeError(f"track_noise_scale must be True or False; got {track=}.")
    validation.check_real("noise_scale_decay", decay, minimum=0.0)
    if decay >= 1:
        raise ValueError(
            f"noise_scale_decay must be in [0, 1), e.g. 0.99; got noise_scale_decay={decay!r}."
        )
    if micro_batch_size is not None:
        validation.check_int("micro_batch_size", micro_batch_size)
    if isinstance(every_k_schedule, noise_scale.CriticalBatchSchedule) and not track:
        raise ValueError(
            "every_k_schedule is a critical_batch_schedule, which reads the measured noise "
            "scale: pass track_noise_scale=True as well."
        )
    if track and axis_name is None and not callable(every_k_schedule) and every_k_schedule == 1:
        raise ValueError(
            "track_noise_scale=True needs windows of at least two micro-gradients to compare "
            f"small and big batches; got {every_k_schedule=} without axis_name. Use K >= 2."
        )


def _find_accumulate_state(opt_state: Any) -> AccumulateState:
    placement.check_state(opt_state)
    return validation.find_unique_state(opt_state, AccumulateState, "gradaccum_jax.accumulate")


def optimizer_step(opt_state: optax.OptState) -> jax.Array:
    """Returns the number of optimizer steps (inner updates) applied so far.

    Counters that tick on every `update` call, such as Flax's
    `TrainState.step` or `nnx.Optimizer.step`, count micro-steps under
    accumulation. This reads the count of windows that applied an update from
    the `AccumulateState` found anywhere inside `opt_state` (a chain,
    `optax.masked` or `inject_hyperparams` state), so schedules and logs
    outside the optimizer can use the step the inner optimizer sees.

    Args:
      opt_state: An optimizer state that contains exactly one
        `AccumulateState`.

    Returns:
      An `int32` scalar.

    Raises:
      ValueError: If `opt_state` contains no or several `AccumulateState`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = optax.chain(optax.clip_by_global_norm(1.0), ga.accumulate(optax.sgd(0.1), 4))
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> int(ga.optimizer_step(state))
      0
    """
    return _find_accumulate_state(opt_state).gradient_step


def closes_window(opt_state: optax.OptState, *removed: Any) -> jax.Array:
    """Returns whether the next `update` call closes the current window.

    Useful for work that must happen once per window beside the optimizer,
    such as committing `gradaccum_jax.flax.AccumBatchNorm` statistics. The
    window's length is read from the state (`AccumulateState.window_length`),
    so a schedule is followed without repeating it here.

    The answer is exact when dropped micro-steps count toward the window
    (`count_skipped_steps=True`, the default): the window closes on schedule
    whatever the next micro-gradient is. With `count_skipped_steps=False` it
    closes only if the next micro-gradient is accepted, which the call
    decides, so the question has no answer before it and this raises: read
    `has_updated(opt_state)` after the `update` instead (it is `True` exactly
    after the calls that closed a window, except one whose accepted weights
    were all zero, which applies nothing).

    Args:
      opt_state: An optimizer state that contains exactly one
        `AccumulateState`.
      *removed: Nothing: the window length argument of earlier versions,
        refused with a `TypeError` that says to drop it.

    Returns:
      A boolean scalar.

    Raises:
      ValueError: If `opt_state` contains no or several `AccumulateState`, or
        it belongs to an `accumulate` built with `count_skipped_steps=False`.
      TypeError: If a window length is passed as well.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = ga.accumulate(optax.sgd(0.1), 2)
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> bool(ga.closes_window(state))
      False
      >>> _, state = tx.update({"w": jnp.ones(3)}, state)
      >>> bool(ga.closes_window(state))
      True
    """
    if removed:
        raise TypeError(
            f"closes_window takes only the optimizer state; got a window length {removed[0]!r} "
            "as well. The state carries its window's length (AccumulateState.window_length, "
            "which follows a schedule), so a repeated one could only disagree: call "
            "closes_window(opt_state)."
        )
    state = _find_accumulate_state(opt_state)
    if isinstance(state, CallerClosedAccumulateState):
        raise ValueError(
            "closes_window cannot answer for a window that the caller closes with "
            "update(..., close=...) (gradaccum_jax.privacy.dp_accumulate built with "
            "every_k_schedule=None): the next call closes it exactly when you pass close=True. "
            "Use that flag, or read has_updated(opt_state) after the update."
        )
    if isinstance(state, UncountedAccumulateState):
        raise ValueError(
            "closes_window cannot answer for an accumulate built with "
            "count_skipped_steps=False: there the next update closes the window only if its "
            "micro-gradient is accepted (finite, with a usable weight, not rejected by "
            "should_skip_update_fn), which that call decides. Read has_updated(opt_state) "
            "after the update instead, e.g. batch_stats = commit_batch_stats(batch_stats, "
            "ga.has_updated(opt_state)); it is True exactly after the calls that closed a "
            "window and applied its update. (state.micro_step + 1 >= state.window_length "
            "is whether an accepted micro-gradient would close it.)"
        )
    return state.micro_step + 1 >= state.window_length


def has_updated(opt_state: optax.OptState) -> jax.Array:
    """Returns whether the last `update` call applied an inner update.

    The counterpart of `optax.MultiSteps.has_updated`: `False` at `init`, on
    the micro-steps inside a window, and after a window that closed with every
    micro-gradient dropped (nothing was applied, `gradient_step` did not
    move); `True` after a window that applied its update.

    Args:
      opt_state: An optimizer state that contains exactly one
        `AccumulateState`.

    Returns:
      A boolean scalar.

    Raises:
      ValueError: If `opt_state` contains no or several `AccumulateState`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = ga.accumulate(optax.sgd(0.1), 2)
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> _, state = tx.update({"w": jnp.ones(3)}, state)
      >>> bool(ga.has_updated(state))
      False
      >>> _, state = tx.update({"w": jnp.ones(3)}, state)
      >>> bool(ga.has_updated(state))
      True
    """
    return _find_accumulate_state(opt_state).updated
