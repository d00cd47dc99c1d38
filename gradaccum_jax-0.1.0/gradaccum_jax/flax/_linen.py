"""`AccumBatchNorm` for `flax.linen`, and the functions on its `batch_stats` collection.

The statistics of the window (micro-batch sums, pooled moments, the
stale-window check) are shared with the NNX layer in `_window_stats.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.typing import Dtype, Initializer

from gradaccum_jax.flax._window_stats import (
    _WINDOW_KEYS,
    _check_attributes,
    _check_closes,
    _check_committed,
    _check_input,
    _evaluation_stats,
    _fold_windows,
    _momentum_pair,
    _normalize,
    _partial_window_axes,
    _split_axes,
    _stats_dtype,
    _train_call,
    _Window,
)

_FLAX_KEYS = frozenset(("mean", "var"))


_ACCUM_KEYS = frozenset(("mean", "var", "momentum", "window_pending", *_WINDOW_KEYS))


# nn.BatchNorm's default; only a placeholder in converted statistics, because a
# layer records its own momentum before its window can hold anything.
_DEFAULT_MOMENTUM = 0.99


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
    trace the export inside `exportable_eval`, which puts the check into
    the program (an uncommitted window gives NaN), or evaluate with the
    statistics `batch_stats_to_flax` returns: with `mean` and `var` alone
    the layer normalises without the check, which `batch_stats_to_flax`
    ran once, refusing an uncommitted window.

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
                mean, var = _evaluation_stats(
                    mean,
                    var,
                    window_vars.count.value,  # type: ignore[attr-defined]
                    pending.value,
                    where,
                )
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
