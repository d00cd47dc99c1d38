"""`NNXAccumBatchNorm` for `flax.nnx`, and `commit_nnx_batch_stats`.

The statistics of the window (micro-batch sums, pooled moments, the
stale-window check) are shared with the linen layer in `_window_stats.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.typing import Dtype, Initializer, PromoteDtypeFn

from gradaccum_jax._base import validation
from gradaccum_jax.flax._window_stats import (
    _check_attributes,
    _check_closes,
    _check_committed,
    _check_input,
    _evaluation_stats,
    _fold_windows,
    _normalize,
    _partial_window_axes,
    _split_axes,
    _stats_dtype,
    _train_call,
    _Window,
)

_ZEROS_INIT = nnx.initializers.zeros_init()


_ONES_INIT = nnx.initializers.ones_init()


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
        validation.check_int("num_features", num_features)
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
            mean, var = _evaluation_stats(
                mean, var, self.window_count[...], self.window_pending[...], "NNXAccumBatchNorm"
            )
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
