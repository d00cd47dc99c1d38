"""Clipping, normalisation and centralisation of updates (torchzero's family).

The transforms follow torchzero's ``clipping`` modules: same parameters, same
defaults and the same meaning, written as optax transformations over pytrees.
Where torchzero's code disagrees with its documentation, the documented
intent is implemented and the docstring says where the two differ.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _validation, _window

Ord = int | float | Literal["mad", "std", "var", "sum", "l0", "l1", "l2", "l3", "l4", "linf"]
Dim = int | Sequence[int] | Literal["global"] | None

# --------------------------------------------------------------------------- #
# Measures                                                                     #
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class _Measure:
    """A parsed ``ord``: a p-norm of order ``p`` (``kind="norm"``) or a statistic.

    ``kind="mean"`` (the signed mean) is used by :func:`centralize` only.
    """

    kind: str
    p: float = 0.0


_NAMED_ORDS: dict[str, _Measure] = {
    "mad": _Measure("mad"),
    "std": _Measure("std"),
    "var": _Measure("var"),
    "sum": _Measure("sum"),
    "l0": _Measure("norm", 0.0),
    "l1": _Measure("norm", 1.0),
    "l2": _Measure("norm", 2.0),
    "l3": _Measure("norm", 3.0),
    "l4": _Measure("norm", 4.0),
    "linf": _Measure("norm", math.inf),
}


# optax.inject_hyperparams turns every numeric argument into an array.
_STATIC_HINT = (
    " It decides the program's structure, so it must be a Python value: with "
    "optax.inject_hyperparams pass static_args=('ord', 'min_size')."
)


def _parse_ord(ord: Any) -> _Measure:
    if isinstance(ord, str):
        if ord in _NAMED_ORDS:
            return _NAMED_ORDS[ord]
        raise ValueError(
            f"ord must be a number >= 0, inf, or one of {tuple(_NAMED_ORDS)}; got {ord=}."
        )
    if isinstance(ord, bool) or not isinstance(ord, numbers.Real):
        raise TypeError(
            f"ord must be a number >= 0, inf, or one of {tuple(_NAMED_ORDS)}; got {ord!r} "
            f"of type {type(ord).__name__}.{_STATIC_HINT if hasattr(ord, 'dtype') else ''}"
        )
    p = float(ord)
    if math.isnan(p) or p < 0:
        raise ValueError(f"ord must be a number >= 0 (or inf); got {ord=}.")
    return _Measure("norm", p)


def _compute_dtype(*dtypes: Any) -> jnp.dtype:
    # 16-bit updates are measured in float32: a bfloat16 sum of squares over a
    # large leaf keeps about two significant digits.
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


def _safe(x: jax.Array, ok: jax.Array) -> jax.Array:
    """Replaces ``x`` by 1 where not ``ok`` so that dividing by it stays finite."""
    return jnp.where(ok, x, jnp.ones_like(x))


def _measure_leaf(x: jax.Array, axes: tuple[int, ...], m: _Measure) -> jax.Array:
    """The measure of every unit of ``x`` (units span ``axes``), keeping dims."""
    dtype = _compute_dtype(x.dtype)
    n = math.prod(x.shape[a] for a in axes)
    if x.size == 0:
        shape = tuple(1 if a in axes else s for a, s in enumerate(x.shape))
        return jnp.zeros(shape, dtype)
    x = x.astype(dtype)
    a = jnp.abs(x)

    def total(v: jax.Array) -> jax.Array:
        return jnp.sum(v, axis=axes, keepdims=True)

    if m.kind == "mean":
        return total(x) / n
    if m.kind == "mad":
        return total(a) / n
    if m.kind == "sum":
        return jnp.abs(total(x))
    if m.kind in ("std", "var"):
        centred = x - total(x) / n
        var = total(jnp.square(jnp.abs(centred))) / (n - 1 if n > 1 else 1)
        return jnp.sqrt(var) if m.kind == "std" else var
    p = m.p
    if p == 0:
        return total((x != 0).astype(dtype))
    if p == 1:
        return total(a)
    if p == 2:
        return jnp.sqrt(total(jnp.square(a)))
    if p == math.inf:
        return jnp.max(a, axis=axes, keepdims=True)
    # Other orders divide by the largest magnitude first, so |x|**p neither
    # overflows nor underflows.
    big = jnp.max(a, axis=axes, keepdims=True)
    safe_big = _safe(big, big > 0)
    return big * total((a / safe_big) ** p) ** (1 / p)


def _measure_global(leaves: list[jax.Array], m: _Measure) -> jax.Array:
    """The measure of all leaves concatenated into one vector (a scalar)."""
    dtype = _compute_dtype(*[leaf.dtype for leaf in leaves]) if leaves else jnp.float32
    xs = [leaf.astype(dtype).ravel() for leaf in leaves if leaf.size]
    if not xs:
        return jnp.zeros([], dtype)
    n = sum(x.size for x in xs)

    def total(f: Callable[[jax.Array], jax.Array]) -> jax.Array:
        return sum((jnp.sum(f(x)) for x in xs), start=jnp.zeros([], dtype))

    def biggest() -> jax.Array:
        return jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in xs]))

    if m.kind == "mean":
        return total(lambda x: x) / n
    if m.kind == "mad":
        return total(jnp.abs) / n
    if m.kind == "sum":
        return jnp.abs(total(lambda x: x))
    if m.kind in ("std", "var"):
        mean = total(lambda x: x) / n
        var = total(lambda x: jnp.square(jnp.abs(x - mean))) / (n - 1 if n > 1 else 1)
        return jnp.sqrt(var) if m.kind == "std" else var
    p = m.p
    if p == 0:
        return total(lambda x: (x != 0).astype(dtype))
    if p == 1:
        return total(jnp.abs)
    if p == 2:
        return jnp.sqrt(total(lambda x: jnp.square(jnp.abs(x))))
    if p == math.inf:
        return biggest()
    big = biggest()
    safe_big = _safe(big, big > 0)
    return big * total(lambda x: (jnp.abs(x) / safe_big) ** p) ** (1 / p)


def _linear_size(value: Any, m: _Measure) -> Any:
    """Maps a measure (or a bound on it) to a size that scales linearly with ``x``.

    Scaling ``x`` by ``c`` scales every norm, ``mad``, ``std`` and ``|sum|`` by
    ``|c|`` but the variance by ``c**2``; clipping compares square roots for
    ``var`` so that the variance after clipping is at most the bound.
    """
    return jnp.sqrt(value) if m.kind == "var" else value


# --------------------------------------------------------------------------- #
# Units                                                                        #
# --------------------------------------------------------------------------- #


def _parse_dim(dim: Any, inverse_dims: Any) -> str | tuple[int, ...] | None:
    if not isinstance(inverse_dims, bool):
        raise TypeError(f"inverse_dims must be a bool; got {inverse_dims=}.")
    if dim is None or dim == "global":
        if inverse_dims:
            raise ValueError(
                f"inverse_dims=True needs dim to be an int or a tuple of ints; got {dim=}, "
                "which leaves no axis to invert."
            )
        return dim
    if isinstance(dim, str):
        raise ValueError(f"dim must be None, 'global', an int or a tuple of ints; got {dim=}.")
    dims = (dim,) if isinstance(dim, numbers.Integral) else dim
    if (
        isinstance(dim, bool)
        or not isinstance(dims, Sequence)
        or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims)
    ):
        raise TypeError(
            f"dim must be None, 'global', an int or a tuple of ints; got {dim!r} of type "
            f"{type(dim).__name__}."
        )
    return tuple(int(d) for d in dims)


def _check_min_size(min_size: Any) -> int:
    if isinstance(min_size, bool) or not isinstance(min_size, numbers.Integral):
        hint = _STATIC_HINT if hasattr(min_size, "dtype") else ""
        raise TypeError(f"min_size must be an int >= 0; got {min_size!r}.{hint}")
    if min_size < 0:
        raise ValueError(f"min_size must be an int >= 0; got {min_size=}.")
    return int(min_size)


def _unit_axes(
    shape: tuple[int, ...], dims: tuple[int, ...] | None, inverse_dims: bool
) -> tuple[int, ...]:
    """The axes a unit spans: all of them for ``dims=None``, else those named."""
    ndim = len(shape)
    if dims is None:
        return tuple(range(ndim))
    # A leaf takes part in the axes of `dims` it has; negative axes count
    # from its end. (torchzero compares raw negative axes with range(ndim),
    # so inverting dim=-1 selects every axis.)
    present = {d % ndim for d in dims if -ndim <= d < ndim}
    if inverse_dims:
        present = set(range(ndim)) - present
    return tuple(sorted(present))


def _map_units(
    tree: Any,
    dim: str | tuple[int, ...] | None,
    inverse_dims: bool,
    min_size: int,
    m: _Measure,
    transform: Callable[[jax.Array, jax.Array], jax.Array],
) -> tuple[Any, Any]:
    """Applies ``transform(x, measure)`` to every unit large enough; also returns the measures.

    ``transform`` gets a unit (in the compute dtype) and its measure and
    returns the new unit; results are cast back to each leaf's dtype. Leaves
    with no axis to span, or whose units hold fewer than ``min_size``
    elements, are returned unchanged.
    """
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    if dim == "global":
        measured = _measure_global(leaves, m)
        if sum(leaf.size for leaf in leaves) < min_size:
            return jax.tree.unflatten(treedef, leaves), measured
        out = [transform(x.astype(measured.dtype), measured).astype(x.dtype) for x in leaves]
        return jax.tree.unflatten(treedef, out), measured
    out, measures = [], []
    for leaf in leaves:
        # 0-d leaves are handled as shape (1,), as torchzero does.
        x = jnp.reshape(leaf, jnp.shape(leaf) or (1,))
        axes = _unit_axes(x.shape, dim, inverse_dims)
        measured = _measure_leaf(x, axes, m)
        if axes and x.size and math.prod(x.shape[a] for a in axes) >= min_size:
            new = transform(x.astype(measured.dtype), measured).astype(leaf.dtype)
        else:
            new = x
        out.append(jnp.reshape(new, jnp.shape(leaf)))
        # One scalar per leaf for whole-leaf units; otherwise keep the leaf's rank.
        measures.append(measured.reshape(()) if dim is None or not jnp.ndim(leaf) else measured)
    return jax.tree.unflatten(treedef, out), jax.tree.unflatten(treedef, measures)


def _unit_args(
    ord: Any, dim: Any, inverse_dims: Any, min_size: Any
) -> tuple[_Measure, str | tuple[int, ...] | None, int]:
    return _parse_ord(ord), _parse_dim(dim, inverse_dims), _check_min_size(min_size)


def _clip_scale(size: jax.Array, hi: Any, lo: Any = None) -> jax.Array:
    """Factor that brings ``size`` into ``[lo, hi]`` (either may be None); 1 for size 0."""
    scale = jnp.ones_like(size)
    if hi is not None:
        over = size > hi
        scale = jnp.where(over, hi / _safe(size, over), scale)
    if lo is not None:
        under = (size < lo) & (size > 0)
        scale = jnp.where(under, lo / _safe(size, under), scale)
    return scale


def _normalize_scale(size: jax.Array, target: Any) -> jax.Array:
    nonzero = size > 0
    return jnp.where(nonzero, target / _safe(size, nonzero), 1).astype(size.dtype)


def _stateless(fn: Callable[[optax.Updates], optax.Updates]) -> optax.GradientTransformation:
    def init_fn(params: optax.Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        return fn(updates), state

    return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------- #
# Pure tree functions                                                          #
# --------------------------------------------------------------------------- #


def clip_grad_norm(
    grads: optax.Updates,
    max_norm: jax.typing.ArrayLike | None,
    ord: Ord = 2,
    *,
    dim: Dim = None,
    inverse_dims: bool = False,
    min_size: int = 2,
    min_norm: jax.typing.ArrayLike | None = None,
) -> tuple[optax.Updates, Any]:
    r"""Clips the norm of every unit of ``grads`` into ``[min_norm, max_norm]``.

    For every unit :math:`u` (see ``dim``) with measure :math:`n_u`,
    :math:`g_u \leftarrow g_u \cdot \min(1, \mathrm{max\_norm}/n_u)` (and
    scaled up to ``min_norm`` when given and :math:`0 < n_u <` ``min_norm``).
    Units whose measure is zero are left unchanged, so zeros stay zeros.

    Unlike torchzero's ``clip_grad_norm_`` this returns a new tree (JAX arrays
    are immutable) together with the measures it took, like
    ``torch.nn.utils.clip_grad_norm_`` returns the total norm.

    Differences from torchzero, which implement its documentation where its
    code departs from it (they apply to :func:`clip_norm`, :func:`normalize`
    and :func:`normalize_grads` too): ``dim=None`` makes each leaf one unit
    over its own axes (torchzero takes the first tensor's axes for every
    tensor); negative axes are matched per leaf, so ``inverse_dims`` works
    with them; ``"var"`` and ``"sum"`` are handled as described under
    ``ord``.

    Args:
      grads: A pytree of arrays.
      max_norm: Upper bound (``>= 0``) on each unit's measure, or ``None``.
      ord: The measure: a p-norm order ``p >= 0`` (``0`` counts nonzeros, ``inf``
        is the largest magnitude), or ``"l0"`` … ``"l4"``, ``"linf"``,
        ``"mad"`` (mean absolute value), ``"std"``, ``"var"`` (with Bessel's
        correction, 0 for single-element units) or ``"sum"`` (the absolute
        value of the sum). For ``"var"`` the update is scaled by
        :math:`\sqrt{\mathrm{bound}/n_u}` so that the variance after clipping
        is the bound (torchzero scales by :math:`\mathrm{bound}/n_u`, which
        does not reach it); for ``"sum"`` torchzero divides by the signed sum,
        which flips the direction of units with a negative sum. Scaling cannot
        change a count of nonzeros: with ``"l0"`` units are scaled by
        :math:`\mathrm{bound}/n_u` as in torchzero, which does not bound the
        count.
      dim: Which axes one unit spans. ``None`` (default): each leaf is one
        unit. An int or a tuple of ints: the units of a leaf span those of
        these axes it has (negative axes count from the end; a leaf with none
        of them is left unchanged). ``"global"``: all leaves form one vector.
      inverse_dims: If ``True``, units span every axis *not* named in ``dim``
        (e.g. ``dim=-1, inverse_dims=True`` makes one unit per output feature
        of a Flax kernel). Needs ``dim`` to be an int or tuple.
      min_size: Units with fewer elements are left unchanged (default 2, so
        scalars and size-1 slices are not clipped).
      min_norm: Lower bound on each nonzero unit's measure, or ``None``.

    Returns:
      ``(clipped, measures)``: the clipped tree, and the measure of every unit
      before clipping — a tree of arrays broadcastable against each leaf (a
      scalar per leaf for ``dim=None``), or one scalar for ``dim="global"``.
      Measures are float32 (or wider).

    Raises:
      ValueError: For a negative or non-finite bound, ``min_norm > max_norm``,
        an unknown ``ord`` or ``dim``, or ``inverse_dims`` without dims.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.5, 0.0])}
      >>> clipped, norms = ga.clip_grad_norm(grads, 1.0)
      >>> clipped["a"], clipped["b"]
      (Array([0.6, 0.8], dtype=float32), Array([0.5, 0. ], dtype=float32))
      >>> norms["a"]
      Array(5., dtype=float32)
      >>> clipped, norm = ga.clip_grad_norm(grads, 1.0, dim="global")
      >>> round(float(norm), 4)
      5.0249
    """
    m, dims, min_size = _unit_args(ord, dim, inverse_dims, min_size)
    _validation.check_hyperparameter("max_norm", max_norm, allow_none=True)
    _validation.check_hyperparameter("min_norm", min_norm, allow_none=True)
    if isinstance(max_norm, numbers.Real) and isinstance(min_norm, numbers.Real):
        if min_norm > max_norm:
            raise ValueError(f"min_norm must be <= max_norm; got {min_norm=}, {max_norm=}.")
    hi = None if max_norm is None else _linear_size(max_norm, m)
    lo = None if min_norm is None else _linear_size(min_norm, m)

    def clip(x: jax.Array, measured: jax.Array) -> jax.Array:
        return x * _clip_scale(_linear_size(measured, m), hi, lo).astype(x.dtype)

    return _map_units(grads, dims, inverse_dims, min_size, m, clip)


def clip_grad_value(grads: optax.Updates, value: jax.typing.ArrayLike) -> optax.Updates:
    """Clips every element of ``grads`` into ``[-value, value]``.

    Args:
      grads: A pytree of arrays.
      value: The bound, ``>= 0``.

    Returns:
      The clipped tree, with the leaves' dtypes.

    Raises:
      ValueError: If ``value`` is negative or not finite.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> ga.clip_grad_value({"w": jnp.array([-3.0, 0.5, 2.0])}, 1.0)["w"]
      Array([-1. ,  0.5,  1. ], dtype=float32)
    """
    _validation.check_hyperparameter("value", value)
    return jax.tree.map(lambda g: jnp.clip(g, -value, value).astype(g.dtype), grads)


def normalize_grads(
    grads: optax.Updates,
    norm_value: jax.typing.ArrayLike,
    ord: Ord = 2,
    *,
    dim: Dim = None,
    inverse_dims: bool = False,
    min_size: int = 1,
) -> optax.Updates:
    r"""Rescales every unit of ``grads`` to measure ``norm_value``.

    :math:`g_u \leftarrow g_u \cdot \mathrm{norm\_value} / n_u` for every unit
    with a nonzero measure :math:`n_u`; units measuring zero are left as
    they are (torchzero divides by the global norm unguarded, giving NaN for
    an all-zero tree with ``dim="global"``).

    Args:
      grads: A pytree of arrays.
      norm_value: The target measure, ``>= 0``.
      ord: The measure, as in :func:`clip_grad_norm`.
      dim: Which axes one unit spans. ``None`` (default): each leaf is one
        unit. An int or a tuple of ints: the units of a leaf span those of
        these axes it has (negative axes count from the end; a leaf with none
        of them is left unchanged). ``"global"``: all leaves form one vector.
      inverse_dims: If ``True``, units span every axis *not* named in ``dim``.
      min_size: Units with fewer elements are left unchanged (default 1).

    Returns:
      The normalised tree, with the leaves' dtypes.

    Raises:
      ValueError: For a negative ``norm_value``, an unknown ``ord`` or
        ``dim``, or ``inverse_dims`` without dims.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> ga.normalize_grads({"w": jnp.array([3.0, 4.0]), "z": jnp.zeros(2)}, 10.0)
      {'w': Array([6., 8.], dtype=float32), 'z': Array([0., 0.], dtype=float32)}
    """
    m, dims, min_size = _unit_args(ord, dim, inverse_dims, min_size)
    _validation.check_hyperparameter("norm_value", norm_value)
    target = _linear_size(norm_value, m)

    def rescale(x: jax.Array, measured: jax.Array) -> jax.Array:
        return x * _normalize_scale(_linear_size(measured, m), target).astype(x.dtype)

    return _map_units(grads, dims, inverse_dims, min_size, m, rescale)[0]


# --------------------------------------------------------------------------- #
# Stateless transforms                                                         #
# --------------------------------------------------------------------------- #


def centralize(
    dim: Dim = None,
    *,
    inverse_dims: bool = False,
    min_size: int = 2,
) -> optax.GradientTransformation:
    r"""Subtracts the mean of every unit from it (gradient centralisation).

    For every unit :math:`u` (see ``dim``), :math:`g_u \leftarrow g_u -
    \operatorname{mean}(g_u)`. Yong et al. centralise each output feature's
    weights: in Flax's layouts (Dense ``(in, out)``, Conv ``(..., in, out)``)
    that is every axis but the last, ``centralize(-1, inverse_dims=True)``,
    which leaves vectors such as biases alone; PyTorch's ``(out, in, ...)``
    layout needs ``centralize(0, inverse_dims=True)``.

    Differences from torchzero's ``Centralize``: ``dim=None`` centralises each
    leaf over all of its own axes (torchzero takes the axes of the first
    tensor for every tensor), and negative axes are matched against each
    leaf's rank (in torchzero ``inverse_dims`` never excludes a negative
    axis, so the Flax form above centralises whole kernels).

    Args:
      dim: Which axes one unit spans. ``None`` (default): each leaf is one
        unit. An int or a tuple of ints: the units of a leaf span those of
        these axes it has (negative axes count from the end; a leaf with none
        of them is left unchanged). ``"global"``: subtract the mean of all
        elements of all leaves.
      inverse_dims: If ``True``, units span every axis *not* named in ``dim``.
      min_size: Units with fewer elements are left unchanged (default 2: a
        single element would become zero).

    Returns:
      An ``optax.GradientTransformation`` with an empty state.

    Raises:
      ValueError: For an unknown ``dim``, a negative ``min_size``, or
        ``inverse_dims`` without dims.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.centralize(-1, inverse_dims=True)  # Flax layouts
      >>> grads = {"kernel": jnp.array([[1.0, 2.0], [3.0, 6.0]]), "bias": jnp.array([1.0, 3.0])}
      >>> updates, _ = tx.update(grads, tx.init(grads))
      >>> updates["kernel"], updates["bias"]
      (Array([[-1., -2.],
             [ 1.,  2.]], dtype=float32), Array([1., 3.], dtype=float32))

    References:
      Yong et al., *Gradient Centralization: A New Optimization Technique for
      Deep Neural Networks*, 2020, https://arxiv.org/abs/2004.01461
    """
    _, dims, min_size = _unit_args(2, dim, inverse_dims, min_size)
    mean = _Measure("mean")

    def centre(x: jax.Array, measured: jax.Array) -> jax.Array:
        return x - measured

    return _stateless(lambda g: _map_units(g, dims, inverse_dims, min_size, mean, centre)[0])


def clip_norm(
    max_norm: jax.typing.ArrayLike,
    ord: Ord = 2,
    *,
    dim: Dim = None,
    inverse_dims: bool = False,
    min_size: int = 1,
) -> optax.GradientTransformation:
    r"""Clips the norm of every unit of the updates to at most ``max_norm``.

    :math:`g_u \leftarrow g_u \cdot \min(1, \mathrm{max\_norm} / n_u)` for
    every unit :math:`u` with measure :math:`n_u`; see :func:`clip_grad_norm`
    for ``ord``, the units and where this departs from torchzero's ``ClipNorm``
    (``dim=None`` is per leaf, negative axes work with ``inverse_dims``). With
    ``dim="global"`` and ``ord=2`` this is ``optax.clip_by_global_norm``.

    Args:
      max_norm: The bound, ``>= 0``.
      ord: The measure: a p-norm order ``p >= 0``, ``"l0"`` … ``"l4"``,
        ``"linf"``, ``"mad"``, ``"std"``, ``"var"`` or ``"sum"`` (see
        :func:`clip_grad_norm`).
      dim: Which axes one unit spans. ``None`` (default): each leaf is one
        unit. An int or a tuple of ints: the units of a leaf span those of
        these axes it has (negative axes count from the end; a leaf with none
        of them is left unchanged). ``"global"``: all leaves form one vector.
      inverse_dims: If ``True``, units span every axis *not* named in ``dim``.
      min_size: Units with fewer elements are left unchanged (default 1).

    Returns:
      An ``optax.GradientTransformation`` with an empty state.

    Raises:
      ValueError: For a negative bound, an unknown ``ord`` or ``dim``, or
        ``inverse_dims`` without dims.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_norm(1.0)
      >>> updates, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
      >>> updates["w"]
      Array([0.6, 0.8], dtype=float32)
    """
    _unit_args(ord, dim, inverse_dims, min_size)
    _validation.check_hyperparameter("max_norm", max_norm)
    return _stateless(
        lambda g: clip_grad_norm(
            g, max_norm, ord, dim=dim, inverse_dims=inverse_dims, min_size=min_size
        )[0]
    )


def clip_value(value: jax.typing.ArrayLike) -> optax.GradientTransformation:
    """Clips every element of the updates into ``[-value, value]``.

    Args:
      value: The bound, ``>= 0``.

    Returns:
      An ``optax.GradientTransformation`` with an empty state.

    Raises:
      ValueError: If ``value`` is negative or not finite.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_value(1.0)
      >>> updates, _ = tx.update({"w": jnp.array([-3.0, 0.5])}, tx.init(None))
      >>> updates["w"]
      Array([-1. ,  0.5], dtype=float32)
    """
    _validation.check_hyperparameter("value", value)
    return _stateless(lambda g: clip_grad_value(g, value))


def normalize(
    norm_value: jax.typing.ArrayLike = 1.0,
    ord: Ord = 2,
    *,
    dim: Dim = None,
    inverse_dims: bool = False,
    min_size: int = 1,
) -> optax.GradientTransformation:
    r"""Rescales every unit of the updates to measure ``norm_value``.

    :math:`g_u \leftarrow g_u \cdot \mathrm{norm\_value} / n_u` for every unit
    with a nonzero measure; zero units stay zero. See :func:`normalize_grads`
    and, for where this departs from torchzero's ``Normalize``,
    :func:`clip_grad_norm`.

    Args:
      norm_value: The target measure, ``>= 0`` (default 1).
      ord: The measure, as in :func:`clip_grad_norm`.
      dim: Which axes one unit spans. ``None`` (default): each leaf is one
        unit. An int or a tuple of ints: the units of a leaf span those of
        these axes it has (negative axes count from the end; a leaf with none
        of them is left unchanged). ``"global"``: all leaves form one vector.
      inverse_dims: If ``True``, units span every axis *not* named in ``dim``.
      min_size: Units with fewer elements are left unchanged (default 1).

    Returns:
      An ``optax.GradientTransformation`` with an empty state.

    Raises:
      ValueError: For a negative ``norm_value``, an unknown ``ord`` or
        ``dim``, or ``inverse_dims`` without dims.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.normalize(1.0, dim="global")
      >>> updates, _ = tx.update({"a": jnp.array([3.0]), "b": jnp.array([4.0])}, tx.init(None))
      >>> updates["a"], updates["b"]
      (Array([0.6], dtype=float32), Array([0.8], dtype=float32))
    """
    _unit_args(ord, dim, inverse_dims, min_size)
    _validation.check_hyperparameter("norm_value", norm_value)
    return _stateless(
        lambda g: normalize_grads(
            g, norm_value, ord, dim=dim, inverse_dims=inverse_dims, min_size=min_size
        )
    )


# --------------------------------------------------------------------------- #
# Transforms with memory: EMA and growth clippers                             #
# --------------------------------------------------------------------------- #


def _check_beta(beta: Any) -> Any:
    _validation.check_hyperparameter("beta", beta)
    if isinstance(beta, numbers.Real) and not beta < 1:
        raise ValueError(f"beta must be in [0, 1); got {beta=}.")
    return beta


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {name}={value!r}.")
    return value


def _keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old``, leaf by leaf, in ``old``'s dtypes."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o).astype(o.dtype), new, old)


def _state_dtype(leaf: Any) -> jnp.dtype:
    return _compute_dtype(jnp.result_type(leaf))


def _sizes(tree: Any, m: _Measure, per_leaf: bool) -> Any:
    """Linear sizes of whole leaves (a tree of scalars) or of the whole tree (a scalar)."""
    if per_leaf:
        return jax.tree.map(
            lambda x: _linear_size(_measure_leaf(x, tuple(range(x.ndim)), m), m).reshape(()),
            tree,
        )
    return _linear_size(_measure_global(jax.tree.leaves(tree), m), m)


def _size_like(params: optax.Params, per_leaf: bool) -> Any:
    """Zero sizes with the structure and dtypes that :func:`_sizes` returns."""
    if per_leaf:
        return jax.tree.map(lambda p: jnp.zeros([], _state_dtype(p)), params)
    leaves = jax.tree.leaves(params)
    dtype = _compute_dtype(*[jnp.result_type(p) for p in leaves]) if leaves else jnp.float32
    return jnp.zeros([], dtype)


def _scale_tree(tree: Any, factors: Any, per_leaf: bool) -> Any:
    """Multiplies every leaf by its factor (per leaf) or by one factor."""

    def scale(x: jax.Array, f: jax.Array) -> jax.Array:
        dtype = jnp.promote_types(x.dtype, f.dtype)
        return (x.astype(dtype) * f.astype(dtype)).astype(x.dtype)

    if per_leaf:
        return jax.tree.map(scale, tree, factors)
    return jax.tree.map(lambda x: scale(x, factors), tree)


class ClipNormByEMAState(NamedTuple):
    """State of :func:`clip_norm_by_ema` and :func:`normalize_by_ema`.

    Attributes:
      count: ``int32[]``. Updates seen so far with finite values (saturating).
      ema: Tree shaped like the params, in float32 (or the params' dtype if
        wider): the exponential moving average of past updates.
      prev_ema_norm: The EMA's size after the last step, which bounds its
        growth: one scalar per leaf (``tensorwise=True``) or one scalar, in
        float32 (or wider). Variances are kept as standard deviations.
    """

    count: jax.Array
    ema: optax.Updates
    prev_ema_norm: Any


def _by_ema(
    normalize_: bool,
    beta: Any,
    ord: Ord,
    eps: Any,
    tensorwise: bool,
    max_ema_growth: Any,
    ema_init: str,
) -> optax.GradientTransformation:
    _check_beta(beta)
    m = _parse_ord(ord)
    _validation.check_hyperparameter("eps", eps, allow_zero=False)
    _check_bool("tensorwise", tensorwise)
    _validation.check_hyperparameter(
        "max_ema_growth", max_ema_growth, allow_zero=False, allow_none=True
    )
    _validation.check_choice("ema_init", ema_init, ("zeros", "update"))

    def init_fn(params: optax.Params) -> ClipNormByEMAState:
        return ClipNormByEMAState(
            count=jnp.zeros([], jnp.int32),
            ema=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _state_dtype(p)), params),
            prev_ema_norm=_size_like(params, tensorwise),
        )

    def update_fn(
        updates: optax.Updates, state: ClipNormByEMAState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ClipNormByEMAState]:
        del params
        first = state.count == 0
        grads = jax.tree.map(lambda g, e: g.astype(e.dtype), updates, state.ema)
        start = state.ema
        if ema_init == "update":
            start = jax.tree.map(lambda e, g: jnp.where(first, g, e), state.ema, grads)
        ema = jax.tree.map(lambda e, g: beta * e + (1 - beta) * g, start, grads)
        ema_size = _sizes(ema, m, tensorwise)
        if max_ema_growth is not None:
            prev = jax.tree.map(lambda s, p: jnp.where(first, s, p), ema_size, state.prev_ema_norm)
            # torchzero floors the allowed size at 1e-6 per tensor but not
            # globally, where an EMA that is once zero stays zero for good;
            # the floor here is eps in both modes.
            shrink = jax.tree.map(
                lambda s, p: jnp.maximum(s / jnp.maximum(p * max_ema_growth, eps), 1),
                ema_size,
                prev,
            )
            ema = _scale_tree(ema, jax.tree.map(lambda d: 1 / d, shrink), tensorwise)
            ema_size = jax.tree.map(lambda s, d: s / d, ema_size, shrink)
        grad_size = _sizes(grads, m, tensorwise)
        floor = eps if normalize_ else 1

        def factor(g_size: jax.Array, e_size: jax.Array) -> jax.Array:
            return 1 / jnp.maximum(g_size / jnp.maximum(e_size, eps), floor)

        new_updates = _scale_tree(updates, jax.tree.map(factor, grad_size, ema_size), tensorwise)
        finite = _window.all_finite(updates)
        new_state = ClipNormByEMAState(
            count=_window.increment_if(state.count, finite),
            ema=_keep_if(finite, ema, state.ema),
            prev_ema_norm=_keep_if(finite, ema_size, state.prev_ema_norm),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def clip_norm_by_ema(
    beta: jax.typing.ArrayLike = 0.99,
    ord: Ord = 2,
    eps: jax.typing.ArrayLike = 1e-6,
    *,
    tensorwise: bool = True,
    max_ema_growth: jax.typing.ArrayLike | None = 1.5,
    ema_init: Literal["zeros", "update"] = "zeros",
) -> optax.GradientTransformation:
    r"""Clips the update's norm to the norm of an EMA of past updates.

    Each step updates :math:`m \leftarrow \beta m + (1-\beta) g` (with
    :math:`m` starting at zero, or at the first update for
    ``ema_init="update"``), limits the growth of :math:`\lVert m\rVert` to a
    factor ``max_ema_growth`` per step by shrinking :math:`m`, and returns

    .. math::

        g \cdot \frac{1}{\max\bigl(1, \lVert g\rVert / \max(\lVert m\rVert,
        \epsilon)\bigr)},

    per leaf (``tensorwise=True``) or for the whole tree. The EMA tracks the
    unclipped updates. With ``ema_init="zeros"`` the first step's bound is
    only :math:`(1-\beta)\lVert g\rVert`, as in torchzero (there is no bias
    correction). A non-finite update leaves the state unchanged (the returned
    update is not finite either, so a later :func:`accumulate` or
    ``optax.apply_if_finite`` can drop it).

    Args:
      beta: EMA decay in ``[0, 1)`` (default 0.99).
      ord: The measure, as in :func:`clip_grad_norm` (default 2).
      eps: Floor (``> 0``) on the EMA's norm in the division, and on the
        allowed EMA norm when its growth is limited (default 1e-6).
      tensorwise: If ``True`` (default) norms are per leaf; otherwise of all
        leaves as one vector.
      max_ema_growth: Largest factor (``> 0``) by which the EMA's norm may grow
        in one step, or ``None`` for no limit (default 1.5).
      ema_init: ``"zeros"`` (default) or ``"update"``.

    Returns:
      An ``optax.GradientTransformation`` with a :class:`ClipNormByEMAState`.

    Raises:
      ValueError: For ``beta`` outside ``[0, 1)``, ``eps <= 0``, a
        non-positive ``max_ema_growth``, an unknown ``ord`` or ``ema_init``.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_norm_by_ema(beta=0.5, ema_init="update")
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
      >>> u["w"]  # the EMA is the update itself
      Array([3., 4.], dtype=float32)
      >>> u, state = tx.update({"w": jnp.array([30.0, 40.0])}, state)
      >>> u["w"]  # EMA norm 27.5, but its growth is limited to 1.5 * 5
      Array([4.5, 6. ], dtype=float32)
    """
    return _by_ema(False, beta, ord, eps, tensorwise, max_ema_growth, ema_init)


def normalize_by_ema(
    beta: jax.typing.ArrayLike = 0.99,
    ord: Ord = 2,
    eps: jax.typing.ArrayLike = 1e-6,
    *,
    tensorwise: bool = True,
    max_ema_growth: jax.typing.ArrayLike | None = 1.5,
    ema_init: Literal["zeros", "update"] = "zeros",
) -> optax.GradientTransformation:
    r"""Rescales the update to the norm of an EMA of past updates.

    Same EMA as :func:`clip_norm_by_ema`, but the update is scaled up as well
    as down:

    .. math::

        g \cdot \frac{1}{\max\bigl(\epsilon, \lVert g\rVert / \max(\lVert m\rVert,
        \epsilon)\bigr)},

    which gives :math:`\lVert m\rVert` whenever that ratio exceeds
    :math:`\epsilon`; a zero update stays zero.

    Args:
      beta: EMA decay in ``[0, 1)`` (default 0.99).
      ord: The measure, as in :func:`clip_grad_norm` (default 2).
      eps: Floor (``> 0``) in the divisions and on the allowed EMA norm
        (default 1e-6).
      tensorwise: If ``True`` (default) norms are per leaf; otherwise of all
        leaves as one vector.
      max_ema_growth: Largest factor (``> 0``) by which the EMA's norm may grow
        in one step, or ``None`` for no limit (default 1.5).
      ema_init: ``"zeros"`` (default) or ``"update"``.

    Returns:
      An ``optax.GradientTransformation`` with a :class:`ClipNormByEMAState`.

    Raises:
      ValueError: For ``beta`` outside ``[0, 1)``, ``eps <= 0``, a
        non-positive ``max_ema_growth``, an unknown ``ord`` or ``ema_init``.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.normalize_by_ema(beta=0.5, ema_init="update")
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
      >>> u, state = tx.update({"w": jnp.array([0.3, 0.4])}, state)
      >>> u["w"].round(4)  # scaled to the EMA's norm, 0.5 * 5 + 0.5 * 0.5
      Array([1.65, 2.2 ], dtype=float32)
    """
    return _by_ema(True, beta, ord, eps, tensorwise, max_ema_growth, ema_init)


class ClipValueByEMAState(NamedTuple):
    """State of :func:`clip_value_by_ema`.

    Attributes:
      count: ``int32[]``. Updates seen so far with finite values (saturating).
      ema: Tree shaped like the params, in float32 (or the params' dtype if
        wider): the exponential moving average of past updates' magnitudes.
    """

    count: jax.Array
    ema: optax.Updates


def clip_value_by_ema(
    beta: jax.typing.ArrayLike = 0.99,
    ema_init: Literal["zeros", "update"] = "zeros",
) -> optax.GradientTransformation:
    r"""Clips every element to the EMA of past magnitudes at its position.

    :math:`m \leftarrow \beta m + (1-\beta)\lvert g\rvert`, then
    :math:`g \leftarrow \operatorname{clip}(g, -m, m)` elementwise, with
    :math:`m` starting at zero or, for ``ema_init="update"``, at the first
    update's magnitudes. The EMA tracks unclipped magnitudes. A non-finite
    update leaves the state unchanged. (torchzero's optional ``ema_tfm``, a
    transform applied to the EMA before clipping, is not offered.)

    Args:
      beta: EMA decay in ``[0, 1)`` (default 0.99).
      ema_init: ``"zeros"`` (default) or ``"update"``.

    Returns:
      An ``optax.GradientTransformation`` with a :class:`ClipValueByEMAState`.

    Raises:
      ValueError: For ``beta`` outside ``[0, 1)`` or an unknown ``ema_init``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_value_by_ema(beta=0.5, ema_init="update")
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([1.0, -2.0])}, state)
      >>> u, state = tx.update({"w": jnp.array([-5.0, 1.0])}, state)
      >>> u["w"]  # bounds 0.5 * 1 + 0.5 * 5 and 0.5 * 2 + 0.5 * 1
      Array([-3.,  1.], dtype=float32)
    """
    _check_beta(beta)
    _validation.check_choice("ema_init", ema_init, ("zeros", "update"))

    def init_fn(params: optax.Params) -> ClipValueByEMAState:
        return ClipValueByEMAState(
            count=jnp.zeros([], jnp.int32),
            ema=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _state_dtype(p)), params),
        )

    def update_fn(
        updates: optax.Updates, state: ClipValueByEMAState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ClipValueByEMAState]:
        del params
        first = state.count == 0
        mags = jax.tree.map(lambda g, e: jnp.abs(g).astype(e.dtype), updates, state.ema)
        start = state.ema
        if ema_init == "update":
            start = jax.tree.map(lambda e, a: jnp.where(first, a, e), state.ema, mags)
        ema = jax.tree.map(lambda e, a: beta * e + (1 - beta) * a, start, mags)
        new_updates = jax.tree.map(
            lambda g, e: jnp.clip(g.astype(e.dtype), -e, e).astype(g.dtype), updates, ema
        )
        finite = _window.all_finite(updates)
        new_state = ClipValueByEMAState(
            count=_window.increment_if(state.count, finite),
            ema=_keep_if(finite, ema, state.ema),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _check_growth_args(add: Any, mul: Any, min_value: Any, max_decay: Any) -> None:
    _validation.check_hyperparameter("add", add, allow_none=True)
    _validation.check_hyperparameter("mul", mul, allow_zero=False, allow_none=True)
    _validation.check_hyperparameter("min_value", min_value, allow_none=True)
    _validation.check_hyperparameter("max_decay", max_decay, allow_zero=False, allow_none=True)
    if isinstance(max_decay, numbers.Real) and max_decay < 1:
        raise ValueError(
            f"max_decay must be >= 1 (the factor by which the tracked value may shrink "
            f"per step) or None; got {max_decay=}."
        )


class ClipNormGrowthState(NamedTuple):
    """State of :func:`clip_norm_growth`.

    Attributes:
      count: ``int32[]``. Updates seen so far with finite values (saturating).
      prev_norm: The tracked norm that bounds the next update: one scalar per
        leaf (``parameterwise=True``) or one scalar, in float32 (or wider).
        Variances are kept as standard deviations.
    """

    count: jax.Array
    prev_norm: Any


def clip_norm_growth(
    add: jax.typing.ArrayLike | None = None,
    mul: jax.typing.ArrayLike | None = 1.5,
    min_value: jax.typing.ArrayLike | None = 1e-4,
    max_decay: jax.typing.ArrayLike | None = 2,
    ord: Ord = 2,
    *,
    parameterwise: bool = True,
) -> optax.GradientTransformation:
    r"""Limits how fast the update's norm may grow from one step to the next.

    With :math:`p` the tracked norm of the previous step, the update's norm
    :math:`n` is clipped to

    .. math::

        \min\bigl(p + \mathrm{add},\; \max(p, \mathrm{min\_value}) \cdot
        \mathrm{mul}\bigr)

    (either term is dropped when its argument is ``None``). The tracked norm
    becomes the clipped norm, except that it shrinks by at most a factor
    ``max_decay`` per step: after a tiny update it is :math:`p /
    \mathrm{max\_decay}`, so one small step does not pin the next ones near
    zero. The first update passes unchanged and sets :math:`p`. Norms are per
    leaf (``parameterwise=True``) or of all leaves as one vector.

    Differences from torchzero's ``ClipNormGrowth``: ``min_value`` floors
    :math:`p` in the multiplicative bound as documented (torchzero instead
    takes ``max(denominator, min_value)``, which never acts); ``add=None,
    mul=None`` passes updates through (torchzero raises); named ``ord`` values
    work (torchzero passes them to ``torch.linalg.vector_norm``). A non-finite
    update leaves the state unchanged.

    Args:
      add: Additive bound (``>= 0``) on the growth, or ``None`` (default).
      mul: Multiplicative bound (``> 0``) on the growth, or ``None``
        (default 1.5).
      min_value: Floor (``>= 0``) on the tracked norm in the multiplicative
        bound, or ``None`` (default 1e-4).
      max_decay: Largest factor (``>= 1``) by which the tracked norm may shrink
        per step, or ``None`` (default 2).
      ord: The measure, as in :func:`clip_grad_norm` (default 2).
      parameterwise: If ``True`` (default) norms are per leaf.

    Returns:
      An ``optax.GradientTransformation`` with a :class:`ClipNormGrowthState`.

    Raises:
      ValueError: For negative bounds, ``mul <= 0``, ``max_decay < 1`` or an
        unknown ``ord``.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_norm_growth(mul=2.0)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([0.3, 0.4])}, state)
      >>> u, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
      >>> u["w"]  # norm 5 cut to 2 * 0.5
      Array([0.6, 0.8], dtype=float32)
    """
    _check_growth_args(add, mul, min_value, max_decay)
    m = _parse_ord(ord)
    _check_bool("parameterwise", parameterwise)

    def init_fn(params: optax.Params) -> ClipNormGrowthState:
        return ClipNormGrowthState(
            count=jnp.zeros([], jnp.int32), prev_norm=_size_like(params, parameterwise)
        )

    def bound(prev: jax.Array) -> jax.Array:
        allowed = jnp.full_like(prev, jnp.inf)
        if add is not None:
            allowed = jnp.minimum(allowed, prev + add)
        if mul is not None:
            floor = prev if min_value is None else jnp.maximum(prev, min_value)
            allowed = jnp.minimum(allowed, floor * mul)
        return allowed

    def update_fn(
        updates: optax.Updates, state: ClipNormGrowthState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ClipNormGrowthState]:
        del params
        first = state.count == 0
        size = jax.tree.map(
            lambda s, p: s.astype(p.dtype), _sizes(updates, m, parameterwise), state.prev_norm
        )

        def factor(n: jax.Array, prev: jax.Array) -> jax.Array:
            return jnp.where(first, 1, _clip_scale(n, bound(prev))).astype(n.dtype)

        factors = jax.tree.map(factor, size, state.prev_norm)
        new_updates = _scale_tree(updates, factors, parameterwise)

        def track(n: jax.Array, f: jax.Array, prev: jax.Array) -> jax.Array:
            new = n * f
            if max_decay is not None:
                decayed = prev / max_decay
                new = jnp.where(~first & (n < decayed), decayed, new)
            return new

        tracked = jax.tree.map(track, size, factors, state.prev_norm)
        finite = _window.all_finite(updates)
        new_state = ClipNormGrowthState(
            count=_window.increment_if(state.count, finite),
            prev_norm=_keep_if(finite, tracked, state.prev_norm),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


class ClipValueGrowthState(NamedTuple):
    """State of :func:`clip_value_growth`.

    Attributes:
      count: ``int32[]``. Updates seen so far with finite values (saturating).
      prev: Tree shaped like the params, in float32 (or the params' dtype if
        wider): the tracked values that bound the next update.
    """

    count: jax.Array
    prev: optax.Updates


def clip_value_growth(
    add: jax.typing.ArrayLike | None = None,
    mul: jax.typing.ArrayLike | None = 1.5,
    min_value: jax.typing.ArrayLike | None = 1e-4,
    max_decay: jax.typing.ArrayLike | None = 2,
) -> optax.GradientTransformation:
    r"""Limits how fast each element's magnitude may grow from step to step.

    Elementwise, with :math:`p` the tracked value of the previous step, the
    magnitude :math:`\lvert g\rvert` is first cut to :math:`\lvert p\rvert +
    \mathrm{add}`, then to :math:`\max(\lvert p\rvert, \mathrm{min\_value})
    \cdot \mathrm{mul}`, keeping its sign. The tracked value becomes the
    clipped element, except where the element shrank by more than a factor
    ``max_decay`` relative to :math:`\max(\lvert p\rvert, \mathrm{min\_value})`:
    there it becomes :math:`p / \mathrm{max\_decay}`. The first update passes
    unchanged and sets :math:`p`; ``add=None, mul=None`` passes updates
    through. A non-finite update leaves the state unchanged.

    Args:
      add: Additive bound (``>= 0``) on the growth, or ``None`` (default).
      mul: Multiplicative bound (``> 0``) on the growth, or ``None``
        (default 1.5).
      min_value: Floor (``>= 0``) on the tracked magnitude in the
        multiplicative bound, or ``None`` (default 1e-4).
      max_decay: Largest factor (``>= 1``) by which the tracked magnitude may
        shrink per step, or ``None`` (default 2).

    Returns:
      An ``optax.GradientTransformation`` with a :class:`ClipValueGrowthState`.

    Raises:
      ValueError: For negative bounds, ``mul <= 0`` or ``max_decay < 1``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_value_growth(mul=2.0)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([1.0, -1.0])}, state)
      >>> u, state = tx.update({"w": jnp.array([5.0, -1.5])}, state)
      >>> u["w"]
      Array([ 2. , -1.5], dtype=float32)
    """
    _check_growth_args(add, mul, min_value, max_decay)

    def init_fn(params: optax.Params) -> ClipValueGrowthState:
        return ClipValueGrowthState(
            count=jnp.zeros([], jnp.int32),
            prev=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _state_dtype(p)), params),
        )

    def clip_leaf(g: jax.Array, prev: jax.Array, first: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = g.astype(prev.dtype)
        prev_mag = jnp.abs(prev)
        if add is not None:
            x = jnp.sign(x) * jnp.minimum(jnp.abs(x), prev_mag + add)
        floor = prev_mag if min_value is None else jnp.maximum(prev_mag, min_value)
        grown = x
        if mul is not None:
            x = jnp.sign(x) * jnp.minimum(jnp.abs(x), floor * mul)
        tracked = x
        if max_decay is not None:
            # Compared as a product: floor may be zero when min_value is None.
            tracked = jnp.where(jnp.abs(grown) * max_decay < floor, prev / max_decay, x)
        out = jnp.where(first, g.astype(prev.dtype), x)
        return out.astype(g.dtype), jnp.where(first, g.astype(prev.dtype), tracked)

    def update_fn(
        updates: optax.Updates, state: ClipValueGrowthState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ClipValueGrowthState]:
        del params
        first = state.count == 0
        leaves, treedef = jax.tree.flatten(updates)
        pairs = [
            clip_leaf(g, p, first) for g, p in zip(leaves, jax.tree.leaves(state.prev), strict=True)
        ]
        new_updates = jax.tree.unflatten(treedef, [u for u, _ in pairs])
        tracked = jax.tree.unflatten(jax.tree.structure(state.prev), [t for _, t in pairs])
        finite = _window.all_finite(updates)
        new_state = ClipValueGrowthState(
            count=_window.increment_if(state.count, finite),
            prev=_keep_if(finite, tracked, state.prev),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)
