"""Batch normalisation whose running statistics are exact under gradient accumulation."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import dtypes as linen_dtypes
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.typing import Dtype, Initializer, PromoteDtypeFn
from jax import lax

from gradaccum_jax import _compat, _global_view, _validation

_WINDOW_KEYS = ("window_count", "window_sum", "window_sum_sq", "window_shift")
_FLAX_KEYS = frozenset(("mean", "var"))
_ACCUM_KEYS = frozenset(("mean", "var", "momentum", "window_pending", *_WINDOW_KEYS))
# nn.BatchNorm's default; only a placeholder in converted statistics, because a
# layer records its own momentum before its window can hold anything.
_DEFAULT_MOMENTUM = 0.99
_ZEROS_INIT = nnx.initializers.zeros_init()
_ONES_INIT = nnx.initializers.ones_init()


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
    _validation.check_real("momentum", momentum, minimum=0.0, maximum=1.0)
    _validation.check_real("epsilon", epsilon, minimum=0.0)


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
    # Per-device windows (global view) are summed first: an evaluation call, not the hot path.
    window_count = _global_view.reduced(window_count)
    stale = jnp.any(window_count > 0) & jnp.any(pending > 0)
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
    return _compat.reshard(stat, jax.P(*_compat.partitions(target)))


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
        return _global_view.add_partial(old, term, axes)

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
    axes = _global_view.per_device_axes()
    k = _global_view.per_device_microbatches()
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
        if _global_view.is_partial(window.count):
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
    partial = [i for i, item in enumerate(items) if _global_view.is_partial(item[2].count)]
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
            operands, momenta, _global_view.reduced(sums), strict=True
        ):
            whole = window._replace(count=count, total=total, total_sq=total_sq)
            new_mean, new_var, _ = _fold_window(mean, var, whole, momentum, jnp.array(True))
            empty = window._replace(
                count=_global_view.partial_zeros_like(window.count),
                total=_global_view.partial_zeros_like(window.total),
                total_sq=_global_view.partial_zeros_like(window.total_sq),
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


class AccumBatchNorm(nn.Module):
    r"""`flax.linen.BatchNorm` with running statistics pooled exactly over a window.

    A replacement for `nn.BatchNorm` under gradient accumulation: the
    attributes, their defaults, the call signature and the variable paths
    (`params/scale`, `params/bias`, `batch_stats/mean`,
    `batch_stats/var`) are those of `nn.BatchNorm`, and so are the names of
    auto-named layers: the class's `__name__` is `"BatchNorm"`, which flax
    uses to name an unnamed submodule, so a model keeps its `BatchNorm_0`,
    `BatchNorm_1`, ... paths and its parameter checkpoints after the swap.

    The difference is when the running statistics move. `nn.BatchNorm` moves
    them on every call, so with `K` micro-batches per optimizer step they take
    `K` small-batch EMA steps. This layer only adds each call's statistics to
    a window in `batch_stats`; `commit_batch_stats`, called once per
    optimizer step, folds the whole window into the running statistics with
    one EMA step (the one line a train step gains with the swap):

    $$
    \mu_w = c + \frac{S}{N},\quad
    \sigma^2_w = \frac{Q}{N} - \Big(\frac{S}{N}\Big)^2,\qquad
    \text{mean} \leftarrow m\,\text{mean} + (1-m)\,\mu_w,\quad
    \text{var} \leftarrow m\,\text{var} + (1-m)\,\sigma^2_w,
    $$

    where `N`, `S = Σ(x - c)` and `Q = Σ(x - c)²` run over every
    unmasked entry the layer normalised in the window, in every micro-batch,
    every call and (with `axis_name`) every replica, and `c` is a per-feature
    shift fixed for the window. This is exactly the mean and (biased) variance
    `nn.BatchNorm` computes on the concatenated window, whatever the
    micro-batch sizes and masks. The shift is the running mean, or with
    `use_fast_variance=False` the first micro-batch's mean, so that the sums
    stay accurate in float32 when the features have a large offset.

    Training normalises each micro-batch with its own statistics, with
    gradients through them, as `nn.BatchNorm` does; no method that sees each
    micro-batch once can normalise with the window's statistics, since those
    depend on micro-batches not seen yet (see the docs page). What is exact is
    the running statistics, and so inference. A layer applied several times in
    one forward pass pools all its calls into the same window (and
    `nn.BatchNorm` would take one EMA step per call instead). With `K = 1`
    (a commit after every step) it computes what `nn.BatchNorm` computes, up
    to float32 rounding.

    A forgotten commit does not go unnoticed. The layer cannot commit by
    itself: the end of a window is known to the optimizer, not to the model.
    So every training call sets a marker, `window_pending`, that every call
    of `commit_batch_stats` clears (with `closes` true or false: the train
    step has seen the window and said whether it ends), and an evaluation
    call (`use_running_average=True`) that finds the marker set and the
    window not empty raises a `ValueError` naming `commit_batch_stats`
    (under `jit` or `pmap`, through a host callback, as a
    `jax.errors.JaxRuntimeError` carrying that message). This holds whatever
    the parameters do: frozen, masked, at learning rate 0, absent
    (`use_scale=False, use_bias=False`), or with no optimizer at all.
    Evaluating in the middle of a window is allowed once a commit call with
    `closes=False` has seen the training calls, as the train step below
    does on every micro-step.

    To serve or export (`jax.export` refuses the check's host callback),
    evaluate with the statistics `batch_stats_to_flax` returns: with `mean`
    and `var` alone the layer normalises without the check, which
    `batch_stats_to_flax` ran once, refusing an uncommitted window.

    Extra variables in `batch_stats` (all `float32`; `F` is the feature
    shape): `window_count[F]` (entries seen in the window),
    `window_sum[F]` and `window_sum_sq[F]` (`S` and `Q`),
    `window_shift[F]` (`c`), `window_pending[]` (1 after a training call,
    0 after a commit call) and `momentum[2]` (the layer's `momentum` and
    `1 - momentum`, each rounded to float32 from the Python value as flax
    rounds them, recorded on every training call so that
    `commit_batch_stats` is a pure function of the collection). Training
    needs only
    `mutable=['batch_stats']`. A call whose sums are not finite is left out of
    the window. Use `batch_stats_from_flax` and
    `batch_stats_to_flax` to convert `nn.BatchNorm` statistics;
    parameters need no conversion.

    Attributes:
      use_running_average: If `True`, normalise with the running statistics
        (inference); if `False`, with the input's statistics, adding them to
        the window. Can also be passed to `__call__`.
      axis: The feature axis or axes (default `-1`); all others are reduced.
      momentum: Decay of the running statistics per window, flax's convention
        (`new = momentum * old + (1 - momentum) * window`), in `[0, 1]`.
      epsilon: Added to the variance before the square root, `>= 0`.
      dtype: dtype of the output (default: inferred from the input and
        parameters). Statistics are float32 or wider regardless.
      param_dtype: dtype of `scale` and `bias`.
      use_bias: Whether to add the learned `bias`.
      use_scale: Whether to multiply by the learned `scale`.
      bias_init: Initialiser of `bias`.
      scale_init: Initialiser of `scale`.
      axis_name: Mapped axis (or axes) to pool statistics over, inside
        `jax.shard_map` or `jax.pmap`; one `psum` of the stacked sums per
        call. Without it, inside `gradaccum_jax.unreduced_value_and_grad`
        (global-view `jit`) each device keeps its own window, typed unreduced,
        which `commit_batch_stats` sums once per window.
      axis_index_groups: Groups of indices along `axis_name` that pool
        separately, as in `jax.lax.psum`.
      use_fast_variance: If `True` (default) one pass: the sums are shifted by
        the running mean. If `False` a second pass (and, with `axis_name`, a
        second collective) shifts the window by its first micro-batch's mean.
      force_float32_reductions: Kept for compatibility; only `True` is
        supported, because the window's sums need float32.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> bn = ga.flax.AccumBatchNorm(momentum=0.75)
      >>> x = jnp.array([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]])
      >>> variables = bn.init(jax.random.key(0), x, use_running_average=False)
      >>> stats = variables["batch_stats"]
      >>> for micro_batch in (x[:1], x[1:]):  # unequal micro-batches, sizes 1 and 3
      ...     _, new = bn.apply(
      ...         {"params": variables["params"], "batch_stats": stats},
      ...         micro_batch, use_running_average=False, mutable=["batch_stats"])
      ...     stats = new["batch_stats"]
      >>> stats["window_count"]
      Array([4., 4.], dtype=float32)
      >>> stats = ga.flax.commit_batch_stats(stats)  # once per optimizer step
      >>> stats["mean"]  # 0.75 * 0 + 0.25 * window mean [3, 4]
      Array([0.75, 1.  ], dtype=float32)
      >>> stats["var"]  # 0.75 * 1 + 0.25 * window variance 5
      Array([2., 2.], dtype=float32)

    References:
      Ioffe and Szegedy, *Batch Normalization*, 2015,
      https://arxiv.org/abs/1502.03167

      Hoffer et al., *Train longer, generalize better* (ghost batch
      normalisation), 2017, https://arxiv.org/abs/1705.08741
    """

    use_running_average: bool | None = None
    axis: int | tuple[int, ...] = -1
    momentum: float = 0.99
    epsilon: float = 1e-5
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Initializer = nn.initializers.zeros
    scale_init: Initializer = nn.initializers.ones
    axis_name: Any = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    def __repr__(self) -> str:
        # flax prints `__name__`, which is "BatchNorm" for the auto-names below.
        return type(self).__qualname__ + super().__repr__().removeprefix(type(self).__name__)

    @nn.compact
    def __call__(
        self,
        x: jax.typing.ArrayLike,
        use_running_average: bool | None = None,
        *,
        mask: jax.typing.ArrayLike | None = None,
    ) -> jax.Array:
        """Normalises `x`; in training mode also adds its statistics to the window.

        Args:
          x: The input, any real dtype; features along `axis`.
          use_running_average: Overrides the attribute of the same name.
          mask: Optional boolean array broadcastable to `x`; only entries where
            it is `True` enter the statistics.

        Returns:
          The normalised input, with the shape of `x`.

        Raises:
          ValueError: If `momentum` or `epsilon` is out of range, `axis` does
            not fit the input, `mask` does not broadcast to it, or
            `force_float32_reductions` is `False`.
          TypeError: If `x` is not real.
        """
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        _check_attributes(self.momentum, self.epsilon)
        if not self.force_float32_reductions:
            raise ValueError(
                "AccumBatchNorm needs float32 window sums; got "
                f"force_float32_reductions={self.force_float32_reductions!r}. Leave it True."
            )
        x, mask = _check_input(x, mask)
        feature_axes, reduction_axes = _split_axes(x.ndim, self.axis)
        feature_shape = tuple(x.shape[a] for a in feature_axes)

        def stat(name, fill):
            return self.variable(
                "batch_stats", name, lambda: jnp.full(feature_shape, fill, jnp.float32)
            )

        ra_mean, ra_var = stat("mean", 0.0), stat("var", 1.0)
        scale = bias = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, feature_shape, self.param_dtype)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, feature_shape, self.param_dtype)
        if (
            use_running_average
            and not self.is_initializing()
            and not self.has_variable("batch_stats", "window_count")
        ):
            # Serving statistics (batch_stats_to_flax, which refused an uncommitted
            # window): no window to check, so no host callback, and jax.export works.
            return _normalize(
                x,
                ra_mean.value,
                ra_var.value,
                scale,
                bias,
                feature_axes,
                reduction_axes,
                self.epsilon,
                self.dtype,
            )
        window_vars = _Window(*(stat(name, 0.0) for name in _WINDOW_KEYS))
        momentum = self.variable("batch_stats", "momentum", lambda: _momentum_pair(self.momentum))
        pending = self.variable("batch_stats", "window_pending", lambda: jnp.zeros((), jnp.float32))

        where = "AccumBatchNorm " + ("/".join(self.path) or "(top level)")
        if use_running_average:
            mean, var = ra_mean.value, ra_var.value
            if not self.is_initializing():
                _check_committed(window_vars.count.value, pending.value, where)  # type: ignore[attr-defined]
        else:
            window = _Window(*(v.value for v in window_vars))  # type: ignore[attr-defined]
            initializing = self.is_initializing()
            mean, var, new_window = _train_call(
                x,
                reduction_axes,
                mask,
                ra_mean.value,
                window,
                partial_axes=_partial_window_axes(self.axis_name, initializing),
                stats_dtype=_stats_dtype(self.dtype, x),
                use_fast_variance=self.use_fast_variance,
                # As in nn.BatchNorm, init does not need the mapped axis to exist.
                axis_name=None if initializing else self.axis_name,
                axis_index_groups=self.axis_index_groups,
                where=where,
            )
            if not initializing:
                for variable, value in zip(window_vars, new_window, strict=True):
                    variable.value = value  # type: ignore[attr-defined]
                momentum.value = _momentum_pair(self.momentum)
                pending.value = jnp.ones((), jnp.float32)

        return _normalize(
            x, mean, var, scale, bias, feature_axes, reduction_axes, self.epsilon, self.dtype
        )


# flax names an unnamed submodule after its class's `__name__`: with this one,
# auto-named layers get nn.BatchNorm's paths (`BatchNorm_0`, ...) so that the
# parameter trees and checkpoints of a model keep their paths after the swap.
AccumBatchNorm.__name__ = "BatchNorm"


def _is_mapping_with(keys: frozenset[str]):
    def predicate(node: Any) -> bool:
        return isinstance(node, Mapping) and frozenset(node.keys()) == keys

    return predicate


def commit_batch_stats(batch_stats: Any, closes: jax.typing.ArrayLike = True) -> Any:
    r"""Folds each `AccumBatchNorm` window into its running statistics.

    Call it once per optimizer step, after the forward pass of the window's
    last micro-batch. Every `AccumBatchNorm` state found in `batch_stats`
    gets one EMA step with the window's pooled mean and variance (see
    `AccumBatchNorm`) and an empty window; other entries, such as
    `nn.BatchNorm` statistics, are returned unchanged. A feature whose window
    is empty (fully masked) keeps its running statistics. With `closes`
    false the statistics and the window do not change, so the call can sit in
    every micro-step of a jitted train step with
    `closes=ga.closes_window(opt_state)`; either way it clears
    `window_pending`, the marker that lets evaluation calls in the middle of
    a window through (see `AccumBatchNorm`). Windows held per
    device in a global-view step (typed unreduced, see `AccumBatchNorm`'s
    `axis_name`) are summed in one all-reduce for all layers, inside a
    `jax.lax.cond` on `closes`: no collective runs when the window does not
    close.

    Args:
      batch_stats: The `batch_stats` collection returned by
        `apply(..., mutable=['batch_stats'])`, or any pytree that contains it
        (such as the whole variables dict).
      closes: A boolean scalar, Python or traced: whether this call ends the
        window.

    Returns:
      A pytree with the structure and dtypes of `batch_stats`.

    Raises:
      ValueError: If `batch_stats` holds arrays but no `AccumBatchNorm`
        statistics (a tree with no arrays, such as the empty collection of
        a model without these layers, is returned unchanged).
      TypeError: If `closes` is not a boolean scalar.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> bn = ga.flax.AccumBatchNorm(momentum=0.5, use_running_average=False)
      >>> x = jnp.array([[1.0], [3.0]])
      >>> variables = bn.init(jax.random.key(0), x)
      >>> _, new = bn.apply(variables, x, mutable=["batch_stats"])
      >>> stats = ga.flax.commit_batch_stats(new["batch_stats"], closes=jnp.array(False))
      >>> stats["mean"], stats["window_count"]  # not the window's end: unchanged
      (Array([0.], dtype=float32), Array([2.], dtype=float32))
      >>> stats = ga.flax.commit_batch_stats(stats)
      >>> stats["mean"], stats["var"], stats["window_count"]
      (Array([1.], dtype=float32), Array([1.], dtype=float32), Array([0.], dtype=float32))
    """
    closes = _check_closes(closes)
    is_state = _is_mapping_with(_ACCUM_KEYS)
    items = []

    def collect(node):
        if is_state(node):
            mean, var = jnp.asarray(node["mean"]), jnp.asarray(node["var"])
            pair = jnp.asarray(node["momentum"])
            # Layers stacked by nn.scan or nn.vmap carry one pair per layer, `[L, 2]`.
            keep, take = pair[..., 0], pair[..., 1]
            shape = keep.shape + (1,) * (mean.ndim - keep.ndim)
            window = _Window(*(jnp.asarray(node[key]) for key in _WINDOW_KEYS))
            items.append((mean, var, window, (keep.reshape(shape), take.reshape(shape))))
        return node

    jax.tree.map(collect, batch_stats, is_leaf=is_state)
    folded = iter(_fold_windows(items, closes))

    def fold(node):
        if not is_state(node):
            return node
        new_mean, new_var, new_window = next(folded)
        # Any commit call has seen the window: it closed it, or said it is still open.
        pending = jnp.zeros_like(jnp.asarray(node["window_pending"]))
        entries = {**node, "mean": new_mean, "var": new_var, "window_pending": pending}
        entries.update(zip(_WINDOW_KEYS, new_window, strict=True))
        return type(node)(entries)

    if not items and jax.tree.leaves(batch_stats):
        raise ValueError(
            "batch_stats holds arrays but no AccumBatchNorm statistics (a mapping with keys "
            f"{sorted(_ACCUM_KEYS)}); got a tree with structure "
            f"{jax.tree_util.tree_structure(batch_stats)}. Pass the 'batch_stats' "
            "collection returned by model.apply(..., mutable=['batch_stats']) of a model "
            "with AccumBatchNorm layers (an empty collection, of a model without them, is "
            "returned unchanged); convert nn.BatchNorm statistics with "
            "gradaccum_jax.flax.batch_stats_from_flax."
        )
    return jax.tree.map(fold, batch_stats, is_leaf=is_state)


def batch_stats_from_flax(batch_stats: Any) -> Any:
    """Converts `nn.BatchNorm` statistics for use with `AccumBatchNorm`.

    Every mapping with exactly the keys `mean` and `var` in `batch_stats`
    (one `nn.BatchNorm` layer's statistics) keeps its `mean` and `var`
    as they are and gains an empty window. Parameters (`scale`, `bias`)
    have the same paths in both layers and need no conversion, so a
    pretrained `nn.BatchNorm` checkpoint loads without loss.

    Args:
      batch_stats: The `batch_stats` collection of a model that uses
        `nn.BatchNorm` (not the whole variables dict: entries of other
        collections are not told apart from statistics).

    Returns:
      The collection for the same model with `AccumBatchNorm` layers.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> flax_stats = {"BatchNorm_0": {"mean": jnp.array([1.0]), "var": jnp.array([4.0])}}
      >>> stats = ga.flax.batch_stats_from_flax(flax_stats)
      >>> sorted(stats["BatchNorm_0"])
      ['mean', 'momentum', 'var', 'window_count', 'window_pending', 'window_shift',
       'window_sum', 'window_sum_sq']
      >>> ga.flax.batch_stats_to_flax(stats)["BatchNorm_0"]["var"]
      Array([4.], dtype=float32)
    """
    is_flax_state = _is_mapping_with(_FLAX_KEYS)

    def convert(node):
        if not is_flax_state(node):
            return node
        mean = jnp.asarray(node["mean"])
        empty = jnp.zeros(mean.shape, jnp.float32)
        entries = dict(node)
        entries.update({key: empty for key in _WINDOW_KEYS})
        entries["window_pending"] = jnp.zeros((), jnp.float32)
        entries["momentum"] = _momentum_pair(_DEFAULT_MOMENTUM)
        return type(node)(entries)

    return jax.tree.map(convert, batch_stats, is_leaf=is_flax_state)


def batch_stats_to_flax(batch_stats: Any) -> Any:
    """Converts `AccumBatchNorm` statistics back to `nn.BatchNorm`'s.

    Keeps `mean` and `var` of every `AccumBatchNorm` state and drops the
    window. These are also the statistics to serve and export a model with
    `AccumBatchNorm` layers: evaluated with them (`use_running_average=True`)
    the layer normalises with `mean` and `var` alone, without the
    stale-window check and its host callback, so the function goes through
    `jax.export`. The check runs here instead, once: a window that holds
    training calls no `commit_batch_stats` call has seen is refused (call it
    on the host, outside the function to export; under `jit` the check
    is a host callback, as in an evaluation call).

    Args:
      batch_stats: A `batch_stats` collection with `AccumBatchNorm` states.

    Returns:
      The collection for the same model with `nn.BatchNorm` layers, or
      for serving it with `AccumBatchNorm` layers.

    Raises:
      ValueError: If a layer's window holds statistics of training calls that
        no commit call has seen (they would be lost); commit first.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> stats = ga.flax.batch_stats_from_flax({"mean": jnp.zeros(2), "var": jnp.ones(2)})
      >>> sorted(ga.flax.batch_stats_to_flax(stats))
      ['mean', 'var']
    """
    is_state = _is_mapping_with(_ACCUM_KEYS)

    def convert(path, node):
        if not is_state(node):
            return node
        where = "AccumBatchNorm " + (jax.tree_util.keystr(path) or "(top level)")
        reading = "converted by batch_stats_to_flax (which keeps only mean and var)"
        _check_committed(
            jnp.asarray(node["window_count"]), jnp.asarray(node["window_pending"]), where, reading
        )
        return type(node)({key: value for key, value in node.items() if key in _FLAX_KEYS})

    return jax.tree_util.tree_map_with_path(convert, batch_stats, is_leaf=is_state)


class NNXAccumBatchNorm(nnx.Module):
    """The `flax.nnx` counterpart of `AccumBatchNorm`.

    A drop-in replacement for `nnx.BatchNorm` (same constructor arguments and
    defaults, same `mean`, `var`, `scale` and `bias` attributes, same
    `train()`/`eval()`/`nnx.view` behaviour) whose running statistics
    move once per window with the statistics pooled exactly over the window,
    as described for `AccumBatchNorm`. The window lives in five more
    `nnx.BatchStat` variables, `window_count`, `window_sum`,
    `window_sum_sq` and `window_shift` (`float32[num_features]`) and
    `window_pending` (`float32[]`, set by a training call, cleared by a
    commit). `commit`, or `commit_nnx_batch_stats` for a whole model,
    closes the window; call it once per optimizer step. As for
    `AccumBatchNorm`, an evaluation call that finds training calls no commit
    has seen raises an error that names `commit_nnx_batch_stats`, whatever
    the parameters did. `from_batchnorm`
    and `to_batchnorm` convert single layers; a model's `nnx.state`
    saved with `nnx.BatchNorm` layers loads into one with these layers by
    `nnx.update` (the window keeps its initial, empty value).

    Args:
      num_features: Number of features (the size of `axis`).
      use_running_average: If `True`, normalise with the running statistics.
      axis: The feature axis.
      momentum: Decay of the running statistics per window, in `[0, 1]`.
      epsilon: Added to the variance before the square root, `>= 0`.
      dtype: dtype of the computation and output (default: inferred).
      param_dtype: dtype of `scale` and `bias`.
      use_bias: Whether to add the learned `bias`.
      use_scale: Whether to multiply by the learned `scale`.
      bias_init: Initialiser of `bias`.
      scale_init: Initialiser of `scale`.
      axis_name: Mapped axis to pool statistics over (`jax.shard_map`,
        `jax.pmap`); one collective of the stacked sums per call. Without it,
        inside `gradaccum_jax.unreduced_value_and_grad` each device keeps its
        own window, as for `AccumBatchNorm`.
      axis_index_groups: Groups of indices along `axis_name`, as in
        `jax.lax.psum`.
      use_fast_variance: One pass shifted by the running mean (`True`) or a
        second pass shifted by the window's first micro-batch mean (`False`).
      promote_dtype: Function promoting `(x, mean, var, scale, bias)` to a
        common dtype, as in `nnx.BatchNorm`.
      rngs: Random number generators for the parameter initialisers.
      bias_metadata: Metadata of the `bias` parameter.
      scale_metadata: Metadata of the `scale` parameter.

    Raises:
      ValueError: If `num_features`, `momentum` or `epsilon` is out of
        range.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import gradaccum_jax as ga
      >>> bn = ga.flax.NNXAccumBatchNorm(1, momentum=0.5, rngs=nnx.Rngs(0))
      >>> for micro_batch in (jnp.array([[1.0]]), jnp.array([[3.0]])):  # sizes 1 and 1
      ...     _ = bn(micro_batch)
      >>> bn.commit()
      >>> bn.mean[...], bn.var[...]  # 0.5 * 0 + 0.5 * 2, 0.5 * 1 + 0.5 * 1
      (Array([1.], dtype=float32), Array([1.], dtype=float32))
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool | None = False,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = _ZEROS_INIT,
        scale_init: Initializer = _ONES_INIT,
        axis_name: Any = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: PromoteDtypeFn = nnx_dtypes.promote_dtype,
        rngs: nnx.Rngs,
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        _validation.check_int("num_features", num_features)
        _check_attributes(momentum, epsilon)
        shape = (num_features,)
        self.mean = nnx.BatchStat(jnp.zeros(shape, jnp.float32))
        self.var = nnx.BatchStat(jnp.ones(shape, jnp.float32))
        self.window_count = nnx.BatchStat(jnp.zeros(shape, jnp.float32))
        self.window_sum = nnx.BatchStat(jnp.zeros(shape, jnp.float32))
        self.window_sum_sq = nnx.BatchStat(jnp.zeros(shape, jnp.float32))
        self.window_shift = nnx.BatchStat(jnp.zeros(shape, jnp.float32))
        self.window_pending = nnx.BatchStat(jnp.zeros((), jnp.float32))
        self.scale: nnx.Param[jax.Array] | None
        if use_scale:
            self.scale = nnx.Param(scale_init(rngs.params(), shape, param_dtype), **scale_metadata)
        else:
            self.scale = nnx.data(None)
        self.bias: nnx.Param[jax.Array] | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), shape, param_dtype), **bias_metadata)
        else:
            self.bias = nnx.data(None)
        self.num_features = num_features
        self.use_running_average = use_running_average
        self.axis = axis
        self.momentum = momentum
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype

    def _window(self) -> _Window:
        return _Window(
            self.window_count[...],
            self.window_sum[...],
            self.window_sum_sq[...],
            self.window_shift[...],
        )

    def _set_window(self, window: _Window) -> None:
        self.window_count[...] = window.count
        self.window_sum[...] = window.total
        self.window_sum_sq[...] = window.total_sq
        self.window_shift[...] = window.shift

    def __call__(
        self,
        x: jax.typing.ArrayLike,
        use_running_average: bool | None = None,
        *,
        mask: jax.typing.ArrayLike | None = None,
    ) -> jax.Array:
        """Normalises `x`; in training mode also adds its statistics to the window.

        Args:
          x: The input; features along `axis`.
          use_running_average: Overrides the attribute of the same name.
          mask: Optional boolean array broadcastable to `x`; only entries where
            it is `True` enter the statistics.

        Returns:
          The normalised input, with the shape of `x`.

        Raises:
          ValueError: If `use_running_average` is `None` both here and on the
            module, or `axis` or `mask` does not fit the input.
          TypeError: If `x` is not real.
        """
        if use_running_average is None:
            use_running_average = self.use_running_average
        if use_running_average is None:
            raise ValueError(
                "use_running_average is None both in the call and on the module; pass "
                "use_running_average=True/False to either, or use model.train()/eval()."
            )
        x, mask = _check_input(x, mask)
        feature_axes, reduction_axes = _split_axes(x.ndim, self.axis)
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None else self.bias[...]
        x, mean, var, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype
        )
        if use_running_average:
            _check_committed(self.window_count[...], self.window_pending[...], "NNXAccumBatchNorm")
        else:
            mean, var, window = _train_call(
                x,
                reduction_axes,
                mask,
                self.mean[...],
                self._window(),
                partial_axes=_partial_window_axes(self.axis_name, initializing=False),
                stats_dtype=_stats_dtype(self.dtype, x),
                use_fast_variance=self.use_fast_variance,
                axis_name=self.axis_name,
                axis_index_groups=self.axis_index_groups,
                where="NNXAccumBatchNorm",
            )
            self._set_window(window)
            self.window_pending[...] = jnp.ones((), jnp.float32)
        return _normalize(
            x, mean, var, scale, bias, feature_axes, reduction_axes, self.epsilon, self.dtype
        )

    def commit(self, closes: jax.typing.ArrayLike = True) -> None:
        """Folds the window into `mean` and `var` (one EMA step) and empties it.

        Args:
          closes: A boolean scalar, Python or traced; with `False` nothing
            changes.

        Raises:
          TypeError: If `closes` is not a boolean scalar.
        """
        _commit_layers([self], _check_closes(closes))

    def set_view(self, use_running_average: bool | None = None) -> None:
        """Sets `use_running_average` for `nnx.view`.

        Args:
          use_running_average: If given, the new value of the attribute.
        """
        if use_running_average is not None:
            self.use_running_average = use_running_average

    @classmethod
    def from_batchnorm(cls, bn: nnx.BatchNorm) -> NNXAccumBatchNorm:
        """Returns a layer with `bn`'s configuration, statistics and parameters.

        Args:
          bn: An `nnx.BatchNorm` layer.

        Returns:
          A new `NNXAccumBatchNorm` with copies of `bn`'s variables and
          an empty window.

        Raises:
          TypeError: If `bn` is not an `nnx.BatchNorm`.
        """
        if not isinstance(bn, nnx.BatchNorm):
            raise TypeError(
                f"bn must be an nnx.BatchNorm; got {type(bn).__name__}: {bn!r}. For a linen "
                "nn.BatchNorm, swap the class and convert its statistics with "
                "gradaccum_jax.flax.batch_stats_from_flax."
            )
        layer = cls(**_shared_config(bn), rngs=nnx.Rngs(0))
        _copy_variables(bn, layer)
        return layer

    def to_batchnorm(self) -> nnx.BatchNorm:
        """Returns an `nnx.BatchNorm` with this layer's configuration and variables.

        The window is dropped. The returned layer is the one to serve and
        export: it has no stale-window check and so no host callback, and
        `jax.export` takes it.

        Returns:
          A new `nnx.BatchNorm` with copies of `mean`, `var`, `scale` and
          `bias`.

        Raises:
          ValueError: If the window holds statistics of training calls that no
            commit call has seen (they would be lost); commit first.
        """
        _check_committed(
            self.window_count[...],
            self.window_pending[...],
            "NNXAccumBatchNorm",
            "converted by to_batchnorm (which keeps only mean and var)",
        )
        bn = nnx.BatchNorm(**_shared_config(self), rngs=nnx.Rngs(0))
        _copy_variables(self, bn)
        return bn


_SHARED_ATTRIBUTES = (
    "num_features",
    "use_running_average",
    "axis",
    "momentum",
    "epsilon",
    "dtype",
    "param_dtype",
    "use_bias",
    "use_scale",
    "axis_name",
    "axis_index_groups",
    "use_fast_variance",
    "promote_dtype",
)


def _shared_config(layer: nnx.Module) -> dict[str, Any]:
    return {name: getattr(layer, name) for name in _SHARED_ATTRIBUTES}


# `Any`: an nnx.BatchNorm or an NNXAccumBatchNorm, which share these variable names.
def _copy_variables(source: Any, target: Any) -> None:
    target.mean[...] = source.mean[...]
    target.var[...] = source.var[...]
    # Copies keep the parameters' metadata (sharding annotations and the like).
    target.scale = None if source.scale is None else source.scale.copy()
    target.bias = None if source.bias is None else source.bias.copy()


def commit_nnx_batch_stats(model: nnx.Module, closes: jax.typing.ArrayLike = True) -> None:
    """Commits the window of every `NNXAccumBatchNorm` in `model`, in place.

    The `nnx` counterpart of `commit_batch_stats`: call it once per
    optimizer step (or in every micro-step with a traced `closes`), e.g. in
    an `nnx.jit` train step after the forward pass.

    Args:
      model: An `nnx.Module`; every `NNXAccumBatchNorm` in it is committed
        (a layer used several times once; a model without one is left as it
        is).
      closes: A boolean scalar, Python or traced: whether this call ends the
        window.

    Raises:
      TypeError: If `closes` is not a boolean scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import gradaccum_jax as ga
      >>> model = nnx.Sequential(
      ...     nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
      ...     ga.flax.NNXAccumBatchNorm(3, rngs=nnx.Rngs(0)),
      ... )
      >>> _ = model(jnp.ones((4, 2)))
      >>> ga.flax.commit_nnx_batch_stats(model)
      >>> model.layers[1].window_count[...]
      Array([0., 0., 0.], dtype=float32)
    """
    closes = _check_closes(closes)
    layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, NNXAccumBatchNorm)]
    _commit_layers(layers, closes)


def _commit_layers(layers: list[NNXAccumBatchNorm], closes: jax.Array) -> None:
    items = [
        (layer.mean[...], layer.var[...], layer._window(), (layer.momentum, 1 - layer.momentum))
        for layer in layers
    ]
    for layer, (mean, var, window) in zip(layers, _fold_windows(items, closes), strict=True):
        layer.mean[...] = mean
        layer.var[...] = var
        layer._set_window(window)
        layer.window_pending[...] = jnp.zeros((), jnp.float32)
