"""Batch normalisation whose running statistics are exact under gradient accumulation."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes as linen_dtypes
from flax.typing import Dtype
from jax import lax

from gradaccum_jax._base import compat, validation
from gradaccum_jax._sharding import partials

_WINDOW_KEYS = ("window_count", "window_sum", "window_sum_sq", "window_shift")


class _Window(NamedTuple):
    """The statistics of the current window, one entry per feature, float32."""

    # float32 like the sums it divides: exact up to 2**24 entries per feature,
    # and beyond that its rounding stays below the sums' own.
    count: jax.Array  # type: ignore[assignment]  # unmasked entries seen
    total: jax.Array  # Σ (x - shift)
    total_sq: jax.Array  # Σ (x - shift)²
    shift: jax.Array  # constant within a window


def _split_axes(ndim: int, axis: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    axes = tuple(axis) if isinstance(axis, Iterable) else (axis,)
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, numbers.Integral) or not -ndim <= int(a) < ndim:
            raise ValueError(
                f"axis must be an int or a tuple of ints in [{-ndim}, {ndim}) for an input "
                f"of rank {ndim}; got {axis=}. Name the feature axis (axis=-1, the default, "
                "for Flax's channels-last layouts)."
            )
    feature_axes = tuple(sorted({int(a) % ndim for a in axes}))
    reduction_axes = tuple(i for i in range(ndim) if i not in feature_axes)
    return feature_axes, reduction_axes


def _check_attributes(momentum: Any, epsilon: Any) -> None:
    validation.check_real("momentum", momentum, minimum=0.0, maximum=1.0)
    validation.check_real("epsilon", epsilon, minimum=0.0)


def _check_input(x: Any, mask: Any) -> tuple[jax.Array, jax.Array | None]:
    x = jnp.asarray(x)
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(
            f"AccumBatchNorm normalises real inputs; got an input with dtype {x.dtype}. "
            "Pass a float array (complex and boolean inputs are not supported): cast "
            "a boolean input with x.astype(jnp.float32); for complex inputs keep "
            "nn.BatchNorm / nnx.BatchNorm, or normalise the real and imaginary parts as "
            "two real features."
        )
    if mask is None:
        return x, None
    mask = jnp.asarray(mask, jnp.bool_)
    try:
        shape = jnp.broadcast_shapes(mask.shape, x.shape)
    except ValueError:
        shape = None
    if shape != x.shape:
        raise ValueError(
            f"mask must be broadcastable to the input's shape {x.shape}; got "
            f"mask.shape={mask.shape}. Pass a boolean mask of the input's shape, or one "
            "with size-1 axes where it should broadcast (e.g. mask[..., None])."
        )
    return x, mask


def _check_closes(closes: Any) -> jax.Array:
    value = jnp.asarray(closes)
    if value.dtype != jnp.bool_ or value.ndim != 0:
        raise TypeError(
            "closes must be a boolean scalar (True, or a traced flag such as "
            f"gradaccum_jax.closes_window(opt_state)); got {closes=!r}."
        )
    return value


def _momentum_pair(momentum: Any) -> jax.Array:
    """`float32[2]`: `momentum` and `1 - momentum`, each rounded once from the Python value.

    flax folds with `momentum * old + (1 - momentum) * new` where `1 - momentum`
    is computed before the rounding to float32; `1 - float32(momentum)` differs
    from it by up to half an ulp of `momentum`, which is 1.7e-4 relative at
    momentum 0.9999.
    """
    return jnp.asarray([momentum, 1 - momentum], jnp.float32)


def _uncommitted_message(where: str, reading: str) -> str:
    return (
        f"{where} is {reading} while its window holds the "
        "statistics of training calls that no commit has seen: the running mean and var "
        "are still what they were at the previous commit (their initial values if there "
        "was none), whatever the optimizer did to the parameters. Commit in the train "
        "step, after the forward pass: batch_stats = "
        "gradaccum_jax.flax.commit_batch_stats(batch_stats, "
        "closes=gradaccum_jax.closes_window(opt_state)) for flax.linen, or "
        "gradaccum_jax.flax.commit_nnx_batch_stats(model, "
        "closes=gradaccum_jax.closes_window(optimizer.opt_state)) for flax.nnx; with "
        "no optimizer (recomputing the statistics only), commit with closes=True after "
        "the training calls."
    )


def _stale(window_count: jax.Array, pending: jax.Array) -> jax.Array:
    """Whether the window holds training calls that no commit call has seen."""
    # Per-device windows (global view) are summed first: an evaluation call, not the hot path.
    return jnp.any(partials.reduced(window_count) > 0) & jnp.any(pending > 0)


def _check_committed(
    window_count: jax.Array,
    pending: jax.Array,
    where: str,
    reading: str = "read with use_running_average=True",
) -> None:
    """Raises if the window holds statistics that no commit call has seen.

    Runs on every evaluation call: directly for concrete values, through a
    host callback under `jit`/`pmap` (only on the failing path), where the
    error surfaces as a `jax.errors.JaxRuntimeError` carrying this message.
    """
    stale = _stale(window_count, pending)
    message = _uncommitted_message(where, reading)

    def raise_if_stale(flag):
        # Re-checked on the host: under vmap the conditional runs both branches.
        if np.any(flag):
            raise ValueError(message)

    if isinstance(stale, jax.core.Tracer):
        # The callback runs only on the (rare) stale path; the predicate is the
        # only value that leaves the device on every evaluation call.
        lax.cond(stale, lambda f: jax.debug.callback(raise_if_stale, f), lambda f: None, stale)
    else:
        raise_if_stale(stale)


# True inside `exportable_eval`. A jit cache key (jax.make_user_context): a program
# traced inside is never reused outside it, nor the reverse.
_CHECK_IN_PROGRAM = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def exportable_eval() -> Iterator[None]:
    """Traces evaluation calls with the stale-window check inside the program.

    By default an evaluation call (`use_running_average=True`) of
    `AccumBatchNorm` or `NNXAccumBatchNorm` traced under `jit` checks for
    an uncommitted window through a host callback, which `jax.export`
    cannot serialize. Traced inside this context, the check is part of the
    program instead: a layer whose window holds training calls no commit
    has seen returns NaN everywhere rather than raising. The program then
    holds no host callback, and a function evaluating the model with the
    `batch_stats` collection as training left it (window included) exports
    and serializes. Calls with concrete values still raise the
    `ValueError`, and programs traced outside the context keep the host
    callback (the context is part of `jax.jit`'s cache key).

    Yields:
      Nothing; use it as `with gradaccum_jax.flax.exportable_eval(): ...`
      around `jax.export.export(...)(...)`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> bn = ga.flax.AccumBatchNorm(use_running_average=True)
      >>> variables = bn.init(jax.random.key(0), jnp.ones((4, 3)))
      >>> serve = jax.jit(bn.apply)
      >>> with ga.flax.exportable_eval():
      ...     exported = jax.export.export(serve)(variables, jnp.ones((4, 3)))
      >>> exported.call(variables, jnp.ones((4, 3))).shape
      (4, 3)
    """
    with _CHECK_IN_PROGRAM(True):
        yield


def _evaluation_stats(
    mean: jax.Array, var: jax.Array, window_count: jax.Array, pending: jax.Array, where: str
) -> tuple[jax.Array, jax.Array]:
    """`mean` and `var` to normalise with, after the stale-window check of an evaluation call."""
    if not (_CHECK_IN_PROGRAM.value and isinstance(window_count, jax.core.Tracer)):
        _check_committed(window_count, pending, where)
        return mean, var
    stale = _stale(window_count, pending)
    return jnp.where(stale, jnp.nan, mean), jnp.where(stale, jnp.nan, var)


def _stats_dtype(dtype: Dtype | None, x: jax.Array) -> jnp.dtype:
    # Statistics are reduced in at least float32, also for 16-bit inputs.
    return jnp.promote_types(x.dtype if dtype is None else dtype, jnp.float32)


def _sharded_like(stat: jax.Array, ref: jax.Array) -> jax.Array:
    """A per-feature statistic in the running statistics' sharding, under explicit mesh axes.

    Activations sharded over their features (tensor parallelism, or params left sharded
    in the layer before) give per-feature sums sharded like them, while the running
    statistics are replicated variables; the sums are gathered (a few floats per
    feature) so that both meet in one sharding. Elsewhere (no mesh, inside
    `shard_map`, Auto axes) the shardings already agree and nothing happens.
    """
    have = getattr(jax.typeof(stat), "sharding", None)
    want = getattr(jax.typeof(ref), "sharding", None)
    spec, target = getattr(have, "spec", None), getattr(want, "spec", None)
    if spec is None or target is None or spec == target or spec.unreduced:
        return stat
    mesh = jax.sharding.get_abstract_mesh()
    explicit = jax.sharding.AxisType.Explicit
    if mesh.empty or any(t != explicit for t in mesh.axis_types):
        return stat
    return compat.reshard(stat, jax.P(*compat.partitions(target)))


def _micro_batch_sums(
    x: jax.Array,
    reduction_axes: tuple[int, ...],
    mask: jax.Array | None,
    running_mean: jax.Array,
    window: _Window | None,
    *,
    stats_dtype: jnp.dtype,
    use_fast_variance: bool,
    axis_name: Any,
    axis_index_groups: Any,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Returns `(count, shift, Σ(x - shift), Σ(x - shift)²)` of this call, over replicas.

    `window=None` is a per-device window (see `_train_call`), shifted by the
    running mean. Without a mask or `axis_name` the count is a scalar: dividing
    by it rounds as `nn.BatchNorm`'s `mean` does (a division by a per-feature
    array of the same value can differ in the last bit), so that `K = 1`
    reproduces `nn.BatchNorm` bit for bit.
    """
    x = x.astype(stats_dtype)

    def masked_sum(v):
        return _sharded_like(jnp.sum(v, reduction_axes, where=mask), running_mean)

    def over_replicas(*parts):
        if axis_name is None:
            return parts
        # One collective for all statistics of the call.
        stacked = jnp.stack([jnp.broadcast_to(p, running_mean.shape) for p in parts])
        return tuple(lax.psum(stacked, axis_name, axis_index_groups=axis_index_groups))

    if mask is None:
        reduced = math.prod(x.shape[a] for a in reduction_axes)
        count = jnp.asarray(reduced, stats_dtype)
    else:
        count = jnp.sum(jnp.broadcast_to(mask, x.shape), reduction_axes, dtype=stats_dtype)
        count = _sharded_like(count, running_mean)
    running_mean = running_mean.astype(stats_dtype)
    one_pass = use_fast_variance or window is None
    if window is None:
        shift = running_mean
    elif use_fast_variance:
        shift = jnp.where(window.count > 0, window.shift.astype(stats_dtype), running_mean)
    else:
        window_open = window.count > 0
        count, raw_total = over_replicas(count, masked_sum(x))
        # The first micro-batch of a window sets the shift to its own mean, so the
        # window's sums stay accurate even when the running mean is far off.
        first = jnp.where(count > 0, raw_total / count, running_mean)
        shift = jnp.where(window_open, window.shift.astype(stats_dtype), first)
    shift = lax.stop_gradient(shift)
    centred = x - jnp.expand_dims(shift, reduction_axes)
    if one_pass:
        count, total, total_sq = over_replicas(
            count, masked_sum(centred), masked_sum(centred * centred)
        )
    else:
        total, total_sq = over_replicas(masked_sum(centred), masked_sum(centred * centred))
    return count, shift, total, total_sq


def _moments(
    count: jax.Array, shift: jax.Array, total: jax.Array, total_sq: jax.Array
) -> tuple[jax.Array, jax.Array]:
    delta = total / count
    return shift + delta, jnp.maximum(total_sq / count - delta * delta, 0.0)


def _add_to_window(
    window: _Window, count: jax.Array, shift: jax.Array, total: jax.Array, total_sq: jax.Array
) -> _Window:
    # A call with a non-finite sum is left out of the window instead of poisoning
    # the running statistics at the next commit.
    ok = jnp.all(jnp.isfinite(total)) & jnp.all(jnp.isfinite(total_sq))
    count = jnp.broadcast_to(count, total.shape)

    def add(old, new):
        return jnp.where(ok, old + lax.stop_gradient(new).astype(old.dtype), old)

    return _Window(
        count=add(window.count, count),
        total=add(window.total, total),
        total_sq=add(window.total_sq, total_sq),
        shift=jnp.where(ok, lax.stop_gradient(shift).astype(window.shift.dtype), window.shift),
    )


def _add_to_partial_window(
    window: _Window,
    count: jax.Array,
    shift: jax.Array,
    total: jax.Array,
    total_sq: jax.Array,
    axes: tuple[Any, ...],
) -> _Window:
    """`_add_to_window` for a per-device window: each device adds its own sums, unreduced."""
    ok = jnp.all(jnp.isfinite(total)) & jnp.all(jnp.isfinite(total_sq))
    count = jnp.broadcast_to(count, total.shape)

    def add(old, new):
        term = jnp.where(ok, lax.stop_gradient(new).astype(old.dtype), 0.0).astype(old.dtype)
        return partials.add_partial(old, term, axes)

    return _Window(
        count=add(window.count, count),
        total=add(window.total, total),
        total_sq=add(window.total_sq, total_sq),
        # The running mean: the same on every device, and constant within a window.
        shift=lax.stop_gradient(shift).astype(window.shift.dtype),
    )


def _partial_window_axes(axis_name: Any, initializing: bool) -> tuple[Any, ...] | None:
    """The axes of a per-device window, or `None` for a window held whole."""
    if axis_name is not None or initializing:
        return None
    axes = partials.per_device_axes()
    k = partials.per_device_microbatches()
    if axes is not None and k > 1:
        # The micro-batches' outputs would be averaged, and a per-device partial sum
        # cannot be divided by a count that is the same on every device.
        raise ValueError(
            "AccumBatchNorm without axis_name keeps a per-device window inside "
            f"unreduced_value_and_grad, which cannot be split into num_microbatches={k}. "
            "Use num_microbatches=1 and let accumulate's window collect the micro-batches "
            "(one per call), or give the layer axis_name=<the data axis> to pool its "
            "statistics over the devices on every call."
        )
    return axes


def _train_call(
    x: jax.Array,
    reduction_axes: tuple[int, ...],
    mask: jax.Array | None,
    running_mean: jax.Array,
    window: _Window,
    *,
    partial_axes: tuple[Any, ...] | None,
    stats_dtype: jnp.dtype,
    use_fast_variance: bool,
    axis_name: Any,
    axis_index_groups: Any,
    where: str,
) -> tuple[jax.Array, jax.Array, _Window]:
    """A training call: the micro-batch's mean and variance and the new window.

    With `partial_axes` (a layer without `axis_name` in the function that
    `unreduced_value_and_grad` runs per device) each device sees its slice of
    the batch: it normalises with the slice's statistics and adds its sums to
    its own partial window, typed unreduced over those axes, which
    `commit_batch_stats` sums once when the window closes. No collective runs.
    The shift is the running mean (the same on every device).
    """
    kwargs = dict(
        stats_dtype=stats_dtype,
        use_fast_variance=use_fast_variance,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
    )
    if partial_axes is None:
        if partials.is_partial(window.count):
            raise ValueError(
                f"{where}: its window holds per-device partial sums, written by a training "
                "call inside gradaccum_jax.unreduced_value_and_grad, and this training call "
                "is outside it (or the layer has an axis_name). Call the model inside the "
                "function given to unreduced_value_and_grad, or sum the window first: "
                "batch_stats = jax.tree.map(lambda x: jax.reshard(x, jax.P()), batch_stats)."
            )
        sums = _micro_batch_sums(x, reduction_axes, mask, running_mean, window, **kwargs)
        new_window = _add_to_window(window, *sums)
        return (*_moments(*sums), new_window)
    if not use_fast_variance:
        raise ValueError(
            f"{where} has use_fast_variance=False, which shifts the window by its first "
            "micro-batch's mean; inside unreduced_value_and_grad each device sees only its "
            "slice, and a common shift would need a collective on every call. Use "
            "use_fast_variance=True (shift by the running mean), or pool the statistics "
            "over the devices with axis_name=<the data axis>."
        )
    sums = _micro_batch_sums(x, reduction_axes, mask, running_mean, None, **kwargs)
    new_window = _add_to_partial_window(window, *sums, partial_axes)
    return (*_moments(*sums), new_window)


def _fold_window(
    mean: jax.Array,
    var: jax.Array,
    window: _Window,
    momentum: tuple[Any, Any],
    closes: jax.Array,
) -> tuple[jax.Array, jax.Array, _Window]:
    """One EMA step with `momentum = (m, 1 - m)`, in flax's order of operations."""
    keep, take = momentum
    seen = window.count > 0
    count = jnp.where(seen, window.count, 1.0)
    delta = window.total / count
    window_mean = window.shift + delta
    window_var = jnp.maximum(window.total_sq / count - delta * delta, 0.0)
    update = closes & seen
    new_mean = jnp.where(update, keep * mean + take * window_mean, mean)
    new_var = jnp.where(update, keep * var + take * window_var, var)

    def reset(field):
        return jnp.where(closes, jnp.zeros_like(field), field)

    new_window = _Window(
        count=reset(window.count),
        total=reset(window.total),
        total_sq=reset(window.total_sq),
        shift=window.shift,
    )
    return new_mean.astype(mean.dtype), new_var.astype(var.dtype), new_window


def _fold_windows(
    items: list[tuple[jax.Array, jax.Array, _Window, Any]], closes: jax.Array
) -> list[tuple[jax.Array, jax.Array, _Window]]:
    """`_fold_window` of several layers' `(mean, var, window, (m, 1 - m))`.

    Per-device windows (partial sums, unreduced over mesh axes) are summed,
    folded and reset inside one `jax.lax.cond` on `closes`, with a single
    reduction for all of them: no collective runs when the window does not
    close.
    """
    folded: list[Any] = [None] * len(items)
    partial = [i for i, item in enumerate(items) if partials.is_partial(item[2].count)]
    for i, (mean, var, window, momentum) in enumerate(items):
        if i not in partial:
            folded[i] = _fold_window(mean, var, window, momentum, closes)
    if not partial:
        return folded

    momenta = [items[i][3] for i in partial]

    def close(operands):
        sums = [(w.count, w.total, w.total_sq) for _, _, w in operands]
        results = []
        for (mean, var, window), momentum, (count, total, total_sq) in zip(
            operands, momenta, partials.reduced(sums), strict=True
        ):
            whole = window._replace(count=count, total=total, total_sq=total_sq)
            new_mean, new_var, _ = _fold_window(mean, var, whole, momentum, jnp.array(True))
            empty = window._replace(
                count=partials.partial_zeros_like(window.count),
                total=partials.partial_zeros_like(window.total),
                total_sq=partials.partial_zeros_like(window.total_sq),
            )
            results.append((new_mean, new_var, empty))
        return results

    def keep(operands):
        return operands

    operands = [items[i][:3] for i in partial]
    for i, result in zip(partial, lax.cond(closes, close, keep, operands), strict=True):
        folded[i] = result
    return folded


def _normalize(
    x: jax.Array,
    mean: jax.Array,
    var: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    feature_axes: tuple[int, ...],
    reduction_axes: tuple[int, ...],
    epsilon: float,
    dtype: Dtype | None,
) -> jax.Array:
    feature_shape = [1] * x.ndim
    for a in feature_axes:
        feature_shape[a] = x.shape[a]
    y = x - jnp.expand_dims(mean, reduction_axes)
    mul = lax.rsqrt(jnp.expand_dims(var, reduction_axes) + epsilon)
    args = [x]
    if scale is not None:
        scale = scale.reshape(feature_shape)
        mul = mul * scale
        args.append(scale)
    y = y * mul
    if bias is not None:
        bias = bias.reshape(feature_shape)
        y = y + bias
        args.append(bias)
    return jnp.asarray(y, linen_dtypes.canonicalize_dtype(*args, dtype=dtype))
