"""The accumulating gradient transformation."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _collectives, _validation

AxisName = Hashable | Sequence[Hashable]
_INT32_MAX = jnp.iinfo(jnp.int32).max


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Every field keeps its shape and dtype from ``init`` on, so the state can be
    carried through ``jax.lax.scan``, donated, sharded and checkpointed
    mid-window like any other pytree.

    Attributes:
      micro_step: ``int32[]``. Micro-steps already taken in the current window,
        in ``[0, K)``; ``0`` right after a window closed.
      gradient_step: ``int32[]``. Number of inner updates applied so far, i.e.
        optimizer steps, not micro-steps. Saturates at the int32 maximum.
      acc_grads: Tree shaped like the params, in the accumulator dtype. The
        weighted sum ``Σ w·g`` of the micro-gradients accepted in the current
        window (local to the replica when ``axis_name`` is set).
      acc_weight: ``float32[]``. Sum of the weights ``Σ w`` of the accepted
        micro-gradients in the current window (their count when no ``weight``
        is passed); local to the replica when ``axis_name`` is set.
      num_skipped: ``int32[]``. Micro-gradients dropped so far because a leaf
        or the weight was not finite. Saturates at the int32 maximum. With
        ``axis_name`` it counts this replica's drops only, like the two
        fields above a per-replica partial sum: the global count is its sum
        over replicas, read from the host without a collective in the step
        (``state.num_skipped.sum()`` on the stacked state of ``jax.pmap`` or
        of :func:`replica_state_specs`).
      inner_state: The inner transformation's state. It changes only when a
        window closes.
      acc_compensation: ``None`` unless ``compensated=True``; then a tree like
        ``acc_grads``, in the same dtype, holding the rounding error of
        ``acc_grads``: the window's sum is ``acc_grads + acc_compensation``.
    """

    micro_step: jax.Array
    gradient_step: jax.Array
    acc_grads: optax.Updates
    acc_weight: jax.Array
    num_skipped: jax.Array
    inner_state: optax.OptState
    acc_compensation: optax.Updates | None = None


def _saturating_increment(count: jax.Array, predicate: jax.Array) -> jax.Array:
    bumped = jnp.where(count < _INT32_MAX, count + 1, count)
    return jnp.where(predicate, bumped, count)


def _accumulator_dtype(leaf: Any, accumulator_dtype: Any) -> jnp.dtype:
    if accumulator_dtype is not None:
        return jnp.dtype(accumulator_dtype)
    # 16-bit gradients are summed in float32: a bfloat16 sum of K terms loses
    # about log2(K) of its 8 mantissa bits. Wider dtypes are kept as they are.
    return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


# Compensated accumulators hold a 16-bit high part and a 16-bit low part; wider
# accumulators gain nothing from a second buffer of their own width.
_COMPENSABLE = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_accumulator_dtype(accumulator_dtype: Any, compensated: Any) -> None:
    if not isinstance(compensated, bool):
        raise TypeError(f"compensated must be a bool; got {compensated=!r}.")
    if accumulator_dtype is not None:
        try:
            dtype = jnp.dtype(accumulator_dtype)
        except TypeError:
            dtype = None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                "accumulator_dtype must be None or a floating-point dtype such as "
                f"jnp.float32 or jnp.bfloat16; got {accumulator_dtype=!r}. For a "
                "compensated (Kahan) bfloat16 accumulator pass "
                "accumulator_dtype=jnp.bfloat16, compensated=True."
            )
    if compensated and (
        accumulator_dtype is None or jnp.dtype(accumulator_dtype) not in _COMPENSABLE
    ):
        raise ValueError(
            "compensated=True needs a 16-bit accumulator_dtype (jnp.bfloat16 or "
            f"jnp.float16); got {accumulator_dtype=!r}. A float32 accumulator is "
            "already more accurate than a compensated 16-bit pair of the same size."
        )


def _window_length(every_k_schedule: int | Callable[[jax.Array], Any], step: jax.Array):
    if not callable(every_k_schedule):
        return jnp.int32(every_k_schedule)
    k = every_k_schedule(step)
    k_dtype = jnp.result_type(k)
    if jnp.issubdtype(k_dtype, jnp.bool_) or not jnp.issubdtype(k_dtype, jnp.integer):
        raise TypeError(
            "every_k_schedule must return an integer window length; it returned "
            f"{k!r} (dtype {k_dtype}) for gradient_step={step!r}. Round it, e.g. "
            "lambda step: jnp.int32(...)."
        )
    if jnp.ndim(k) != 0:
        raise ValueError(
            f"every_k_schedule must return a scalar; it returned shape {jnp.shape(k)}."
        )
    if not isinstance(k, jax.core.Tracer) and int(k) < 1:
        raise ValueError(
            f"every_k_schedule must return a window length >= 1; it returned {int(k)} "
            f"at gradient_step={step!r}."
        )
    # A traced length below 1 cannot raise inside jit; it is treated as 1.
    return jnp.maximum(jnp.asarray(k, jnp.int32), 1)


def _check_weight(weight: Any) -> jax.Array:
    as_float = _validation.check_real_scalar(
        "weight",
        weight,
        hint=" It is the micro-batch's total weight: sum per-example weights first, "
        "e.g. weight=mask.sum().",
    )
    if not isinstance(weight, jax.core.Tracer):
        value = float(weight)
        if not (value >= 0 and value != float("inf")):
            raise ValueError(f"weight must be finite and >= 0; got weight={value!r}.")
    return as_float


def _all_finite(tree: Any) -> jax.Array:
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(tree) if jnp.size(leaf)]
    if not leaves:
        return jnp.array(True)
    # max(|x|) propagates NaN and is finite iff every element is; XLA:CPU
    # reduces it about twice as fast as all(isfinite(x)).
    return jnp.all(jnp.stack([jnp.isfinite(jnp.max(jnp.abs(leaf))) for leaf in leaves]))


def accumulate(
    inner: optax.GradientTransformation,
    every_k_schedule: int | Callable[[jax.Array], Any],
    *,
    use_grad_mean: bool = True,
    accumulator_dtype: Any = None,
    compensated: bool = False,
    skip_nonfinite: bool = True,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Accumulates micro-gradients over a window and applies ``inner`` once per window.

    A window is ``K`` consecutive calls of ``update``. The first ``K - 1`` calls
    add their gradient to an accumulator and return exact zeros, leaving the
    inner state untouched. The ``K``-th call reduces the accumulated gradients,

    .. math::

        \bar g = \frac{\sum_i w_i g_i}{\sum_i w_i}
        \quad\text{(mean, default)}\qquad\text{or}\qquad
        \bar g = \sum_i w_i g_i \quad\text{(sum)},

    over the accepted micro-gradients ``g_i`` with weights ``w_i`` (``1`` unless
    ``update`` gets a ``weight=`` extra argument, such as the micro-batch's
    token count), runs ``inner.update`` once on ``ḡ``, resets the accumulator
    and returns the inner update. With the mean, ``K`` micro-batches give the
    same parameters as one batch ``K`` times larger, for any inner optimizer.

    The gate is a ``jax.lax.cond``: the inner optimizer is not computed on the
    micro-steps. The accumulator is updated after the conditional, in one fused
    in-place pass that also resets it at the window's end, and the conditional
    returns a flag that orders that pass after the inner optimizer has read
    the sum. With that layout XLA passes the inner state and the accumulator
    through without copying them (the compiled program is tested for it).

    A micro-gradient with a non-finite leaf (or a non-finite or negative
    traced ``weight``) is dropped: it is not added, it does not count in the
    mean's denominator, and ``num_skipped`` grows by one. The window still
    closes on schedule; a window with nothing accepted applies no inner update
    and returns zeros.

    Step counting: ``gradient_step`` counts inner updates. Schedules inside
    ``inner`` (``optax.adam(optax.cosine_decay_schedule(...))``,
    ``optax.inject_hyperparams``) therefore advance once per window. Counters
    outside, such as Flax's ``TrainState.step``, count calls of ``update``
    (micro-steps); read :func:`optimizer_step` instead.

    Args:
      inner: The optimizer to apply once per window, any
        ``optax.GradientTransformation`` (extra arguments such as ``value=``
        are passed through to it).
      every_k_schedule: The window length ``K``: an int ``>= 1``, or a callable
        mapping ``gradient_step`` (an ``int32`` scalar) to an integer scalar,
        so that ``K`` can change between windows without recompiling.
      use_grad_mean: If ``True`` (default) the window's weighted mean is passed
        to ``inner``; if ``False``, the weighted sum.
      accumulator_dtype: dtype of the accumulator. ``None`` (default) keeps
        float32 and wider gradients in their dtype and accumulates float16 and
        bfloat16 gradients in float32. Returned updates always have the
        gradients' dtype. ``jnp.bfloat16`` halves the accumulator's memory for
        float32 gradients at the cost of about ``log2(K)`` mantissa bits.
      compensated: If ``True``, a second buffer in ``accumulator_dtype`` (which
        must be ``jnp.bfloat16`` or ``jnp.float16``) keeps the rounding error
        of the accumulator, as in Kahan summation: each addition is done in
        float32 and its result split into a 16-bit high part and the 16-bit
        remainder, so the pair carries about 16 mantissa bits. It costs as
        much memory as a float32 accumulator and is less accurate than one;
        see the mixed-precision docs for measurements.
      skip_nonfinite: If ``True`` (default) non-finite micro-gradients are
        dropped as described above. If ``False`` they are added as they are.
      axis_name: Name (or tuple of names) of a mapped axis, for use inside
        ``jax.shard_map`` or ``jax.pmap``. Each replica accumulates its own
        micro-gradients, and the sums and weights are summed across replicas
        once per window, inside the conditional, so the mean is over every
        replica's accepted micro-gradients (weighted by the global weight) and
        micro-steps run no collective. Under ``shard_map`` the gradients must
        vary between replicas: take them with respect to
        ``jax.lax.pcast(params, axis_name, to='varying')``, not the replicated
        params, whose gradient is already summed; the returned updates are
        replica-invariant. Hold the state across calls with
        :func:`replica_state_specs`. See the distributed-training guide.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` accepts
      ``weight=`` (a non-negative scalar) and passes any other keyword
      argument to ``inner``.

    Raises:
      TypeError: If ``inner`` is not a gradient transformation,
        ``every_k_schedule`` is neither an int nor a callable, or
        ``accumulator_dtype`` is not a floating-point dtype, or ``axis_name``
        is neither a name nor a tuple of names.
      ValueError: If ``every_k_schedule`` is an int below 1, or
        ``compensated=True`` without a 16-bit ``accumulator_dtype``; at trace
        time, if an ``axis_name`` is not bound where ``update`` runs, or
        (under ``shard_map``) the gradients are already replica-invariant.

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
    _validation.check_gradient_transformation("inner", inner)
    if not callable(every_k_schedule):
        _validation.check_positive_int("every_k_schedule", every_k_schedule)
    _check_accumulator_dtype(accumulator_dtype, compensated)
    axis_names = None if axis_name is None else _validation.check_axis_name("axis_name", axis_name)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> AccumulateState:
        _validation.check_float_tree("params", params)
        # zeros_like keeps each param's sharding (explicit mesh axes, or the
        # varying axes under shard_map), so the accumulator shards like it.
        acc = jax.tree.map(
            lambda p: jnp.zeros_like(p, _accumulator_dtype(p, accumulator_dtype)), params
        )
        inner_state = inner.init(params)
        # Imported here: _mixed_precision builds on this module.
        from gradaccum_jax._mixed_precision import refuse_inside_accumulate

        refuse_inside_accumulate(inner_state)
        return AccumulateState(
            micro_step=jnp.zeros([], jnp.int32),
            gradient_step=jnp.zeros([], jnp.int32),
            acc_grads=acc,
            acc_weight=jnp.zeros([], jnp.float32),
            num_skipped=jnp.zeros([], jnp.int32),
            inner_state=inner_state,
            acc_compensation=jax.tree.map(jnp.zeros_like, acc) if compensated else None,
        )

    def update_fn(
        updates: optax.Updates,
        state: AccumulateState,
        params: optax.Params | None = None,
        *,
        weight: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, AccumulateState]:
        grads = updates
        _validation.check_same_structure("updates", grads, "state.acc_grads", state.acc_grads)
        _validation.check_float_tree("updates", grads)
        w = None if weight is None else _check_weight(weight)
        if axis_names is not None:
            typed = _collectives.check_axes_bound("axis_name", axis_names)
            if typed:
                _collectives.check_grads_vary("updates", grads, axis_names)

        k = _window_length(every_k_schedule, state.gradient_step)
        if skip_nonfinite:
            accepted = _all_finite(grads)
            if w is not None:
                accepted = accepted & jnp.isfinite(w) & (w >= 0)
        else:
            accepted = jnp.array(True)
        step_weight = jnp.float32(1.0) if w is None else w
        window_weight = state.acc_weight + jnp.where(accepted, step_weight, 0.0)
        micro_step = state.micro_step + 1
        closes = micro_step >= k

        def term(grad_leaf, dtype):
            t = grad_leaf.astype(dtype)
            return t if w is None else t * w.astype(dtype)

        def add(acc_leaf, grad_leaf):
            return jnp.where(accepted, acc_leaf + term(grad_leaf, acc_leaf.dtype), acc_leaf)

        def compensated_add(acc_leaf, comp_leaf, grad_leaf):
            wide = jnp.promote_types(acc_leaf.dtype, jnp.float32)
            held = acc_leaf.astype(wide) + comp_leaf.astype(wide)
            return jnp.where(accepted, held + term(grad_leaf, wide), held)

        def compensated_split(acc_leaf, comp_leaf, grad_leaf):
            total = compensated_add(acc_leaf, comp_leaf, grad_leaf)
            finfo = jnp.finfo(acc_leaf.dtype)
            # Rounded with reduce_precision, not with a cast: the high part is
            # then exactly representable, and XLA's licence to drop a
            # float32->16-bit->float32 convert pair (excess precision) cannot
            # turn the remainder into zero.
            high = jax.lax.reduce_precision(
                total, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant
            )
            return high.astype(acc_leaf.dtype), (total - high).astype(acc_leaf.dtype)

        def window_total(acc):
            if compensated:
                sums, comps = acc
                return jax.tree.map(compensated_add, sums, comps, grads)
            return jax.tree.map(add, acc, grads)

        def zero_updates():
            if axis_names is None:
                return jax.tree.map(jnp.zeros_like, grads)
            # The gradients vary between replicas but the reduced updates do
            # not; zeros without varying axes let the updates (and the params
            # they are applied to) stay replica-invariant under shard_map.
            return jax.tree.map(_collectives.zeros_without_axes, grads)

        def run_inner(total, inner_state, total_weight):
            if use_grad_mean:
                total = jax.tree.map(lambda t: t / total_weight.astype(t.dtype), total)
            reduced = jax.tree.map(lambda t, g: t.astype(g.dtype), total, grads)
            new_updates, new_inner = inner.update(reduced, inner_state, params, **extra_args)
            new_updates = jax.tree.map(lambda u, g: u.astype(g.dtype), new_updates, grads)
            return new_updates, new_inner

        # Branch outputs are (updates, inner_state, reset, applied). The skip
        # branch passes the inner state through untouched, and the accumulator
        # is only *read* inside the conditional; it is written afterwards (see
        # below), so XLA aliases both instead of copying them.
        def skip_branch(acc, inner_state, closes_, total_weight):
            del acc, total_weight
            return zero_updates(), inner_state, closes_, jnp.array(False)

        if axis_names is None:
            cond = jax.lax.cond

            def apply_branch(acc, inner_state, closes_, total_weight):
                del closes_
                total = window_total(acc)
                new_updates, new_inner = run_inner(total, inner_state, total_weight)
                return new_updates, new_inner, jnp.array(True), jnp.array(True)

            # Known before the branch: a window with no accepted micro-gradient
            # takes the skip branch and still resets (reset = closes).
            predicate = closes & (window_weight > 0)
        else:

            def cond(pred, true_fn, false_fn, *operands):
                return _collectives.cond(pred, true_fn, false_fn, *operands, typed=typed)

            def apply_branch(acc, inner_state, closes_, total_weight):
                del closes_
                # The only collectives: one sum of the local window sums and
                # weights, on window boundaries only. Skipped micro-gradients
                # are out of both sums, so they leave the global mean's
                # denominator on every replica alike.
                total, global_weight = _collectives.psum(
                    (window_total(acc), total_weight), axis_names, typed
                )

                def run(total, inner_state):
                    return run_inner(total, inner_state, global_weight)

                def nothing(total, inner_state):
                    del total
                    return zero_updates(), inner_state

                # Whether any replica accepted anything is known only after
                # the reduction, and it is the same on every replica.
                new_updates, new_inner = cond(global_weight > 0, run, nothing, total, inner_state)
                return new_updates, new_inner, jnp.array(True), global_weight > 0

            predicate = closes

        acc_operand = state.acc_grads
        if compensated:
            acc_operand = (state.acc_grads, state.acc_compensation)
        new_updates, new_inner, reset, applied = cond(
            predicate,
            apply_branch,
            skip_branch,
            acc_operand,
            state.inner_state,
            closes,
            window_weight,
        )
        # One fused pass: add the micro-gradient, or reset at the window's end.
        # Depending on `reset` (an output of the conditional) schedules this
        # in-place write after the branch has read the old accumulator; with
        # `closes` instead, XLA may run it first and must copy the accumulator.
        # The reset uses fresh zeros, never a product with zero (NaN * 0 = NaN).
        new_comp = None
        if compensated:
            split = jax.tree.map(compensated_split, state.acc_grads, state.acc_compensation, grads)
            # `split` holds a (high, low) pair where acc_grads holds a leaf.
            new_acc = jax.tree.map(
                lambda a, hl: jnp.where(reset, jnp.zeros_like(a), hl[0]), state.acc_grads, split
            )
            new_comp = jax.tree.map(
                lambda a, hl: jnp.where(reset, jnp.zeros_like(a), hl[1]), state.acc_grads, split
            )
        else:
            new_acc = jax.tree.map(
                lambda a, g: jnp.where(reset, jnp.zeros_like(a), add(a, g)),
                state.acc_grads,
                grads,
            )
        new_state = AccumulateState(
            micro_step=jnp.where(reset, 0, micro_step).astype(jnp.int32),
            gradient_step=_saturating_increment(state.gradient_step, applied),
            acc_grads=new_acc,
            acc_weight=jnp.where(reset, 0.0, window_weight).astype(jnp.float32),
            num_skipped=_saturating_increment(state.num_skipped, ~accepted),
            inner_state=new_inner,
            acc_compensation=new_comp,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find_accumulate_state(opt_state: Any) -> AccumulateState:
    return _validation.find_unique_state(opt_state, AccumulateState, "gradaccum_jax.accumulate")


def optimizer_step(opt_state: optax.OptState) -> jax.Array:
    """Returns the number of optimizer steps (inner updates) applied so far.

    Counters that tick on every ``update`` call, such as Flax's
    ``TrainState.step`` or ``nnx.Optimizer.step``, count micro-steps under
    accumulation. This reads the count of windows that applied an update from
    the :class:`AccumulateState` found anywhere inside ``opt_state`` (a chain,
    ``optax.masked`` or ``inject_hyperparams`` state), so schedules and logs
    outside the optimizer can use the step the inner optimizer sees.

    Args:
      opt_state: An optimizer state that contains exactly one
        :class:`AccumulateState`.

    Returns:
      An ``int32`` scalar.

    Raises:
      ValueError: If ``opt_state`` contains no or several ``AccumulateState``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = optax.chain(optax.clip_by_global_norm(1.0), ga.accumulate(optax.sgd(0.1), 4))
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> int(ga.optimizer_step(state))
      0
    """
    return _find_accumulate_state(opt_state).gradient_step


def closes_window(
    opt_state: optax.OptState, every_k_schedule: int | Callable[[jax.Array], Any]
) -> jax.Array:
    """Returns whether the next ``update`` call closes the current window.

    Useful for work that must happen once per window beside the optimizer,
    such as committing :class:`gradaccum_jax.flax.AccumBatchNorm` statistics.

    Args:
      opt_state: An optimizer state that contains exactly one
        :class:`AccumulateState`.
      every_k_schedule: The same window length (or schedule) given to
        :func:`accumulate`.

    Returns:
      A boolean scalar.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = ga.accumulate(optax.sgd(0.1), 2)
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> bool(ga.closes_window(state, 2))
      False
    """
    state = _find_accumulate_state(opt_state)
    if not callable(every_k_schedule):
        _validation.check_positive_int("every_k_schedule", every_k_schedule)
    k = _window_length(every_k_schedule, state.gradient_step)
    return state.micro_step + 1 >= k
