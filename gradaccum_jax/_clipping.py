"""Clipping, normalisation and centralisation of updates.

Names shared with optax or PyTorch keep their meaning there: `clip_norm`,
`normalize`, `clip_grad_norm` and `normalize_grads` measure the whole tree by
default (as `optax.clip_by_global_norm` and `torch.nn.utils.clip_grad_norm_`
do), and `centralize()` centres each row of every matrix as
`optax.centralize()` does. The arguments of torchzero's clipping modules
(`ord`, `dim`, `inverse_dims`, `min_size`, the EMA and growth clippers) reach
torchzero's semantics; where torchzero's code disagrees with its
documentation, the documented intent is implemented and the docstring says
where the two differ. Norms are exact over the whole float range (see
`_norms.py`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _validation, _window
from gradaccum_jax._fused import FUSE_KEY
from gradaccum_jax._norms import (
    L2,
    Measure,
    Size,
    apply_factors,
    compute_dtype,
    measure,
    ratio_factors,
    real_dtype,
)

Ord = int | float | Literal["mad", "std", "var", "sum", "l0", "l1", "l2", "l3", "l4", "linf"]
Dim = int | Sequence[int] | Literal["global"] | None

# --------------------------------------------------------------------------- #
# Arguments                                                                    #
# --------------------------------------------------------------------------- #

_NAMED_ORDS: dict[str, Measure] = {
    "mad": Measure("mad"),
    "std": Measure("std"),
    "var": Measure("var"),
    "sum": Measure("sum"),
    "l0": Measure("norm", 0.0),
    "l1": Measure("norm", 1.0),
    "l2": Measure("norm", 2.0),
    "l3": Measure("norm", 3.0),
    "l4": Measure("norm", 4.0),
    "linf": Measure("norm", math.inf),
}

# The arguments of each factory that decide the program's structure.
_UNIT_STATIC = ("ord", "dim", "min_size")
_CENTRALIZE_STATIC = ("dim", "min_size")
_EMA_STATIC = ("ord",)


def _static_hint(value: Any, static: tuple[str, ...]) -> str:
    # optax.inject_hyperparams turns every numeric argument into an array.
    if not hasattr(value, "dtype"):
        return ""
    return (
        " It decides the program's structure, so it must be a Python value: with "
        f"optax.inject_hyperparams pass static_args={static!r}."
    )


def _parse_ord(ord: Any, static: tuple[str, ...]) -> Measure:
    if isinstance(ord, str):
        if ord in _NAMED_ORDS:
            return _NAMED_ORDS[ord]
        raise ValueError(
            f"ord must be a number >= 0, inf, or one of {tuple(_NAMED_ORDS)}; got {ord=}."
        )
    if isinstance(ord, bool) or not isinstance(ord, numbers.Real):
        raise TypeError(
            f"ord must be a number >= 0, inf, or one of {tuple(_NAMED_ORDS)}; got {ord!r} "
            f"of type {type(ord).__name__}.{_static_hint(ord, static)}"
        )
    p = float(ord)
    if math.isnan(p) or p < 0:
        raise ValueError(f"ord must be a number >= 0 (or inf); got {ord=}.")
    return Measure("norm", p)


def _parse_dim(
    dim: Any, inverse_dims: Any, static: tuple[str, ...], rules: tuple[str, ...] = ("global",)
) -> str | tuple[int, ...] | None:
    if not isinstance(inverse_dims, bool):
        raise TypeError(f"inverse_dims must be a bool; got {inverse_dims=}.")
    allowed = f"None, {', '.join(repr(r) for r in rules)}, an int or a tuple of ints"
    if dim is None or (isinstance(dim, str) and dim in rules):
        if inverse_dims:
            raise ValueError(
                f"inverse_dims=True needs dim to be an int or a tuple of ints; got {dim=}, "
                "which leaves no axis to invert."
            )
        return dim
    if isinstance(dim, str):
        raise ValueError(f"dim must be {allowed}; got {dim=}.")
    dims = (dim,) if isinstance(dim, numbers.Integral) else dim
    if (
        isinstance(dim, bool)
        or not isinstance(dims, Sequence)
        or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims)
    ):
        raise TypeError(
            f"dim must be {allowed}; got {dim!r} of type {type(dim).__name__}."
            f"{_static_hint(dim, static)}"
        )
    return tuple(int(d) for d in dims)


def _check_min_size(min_size: Any, dims: Any, static: tuple[str, ...]) -> int:
    if isinstance(min_size, bool) or not isinstance(min_size, numbers.Integral):
        raise TypeError(
            f"min_size must be an int >= 0; got {min_size!r}.{_static_hint(min_size, static)}"
        )
    if min_size < 0:
        raise ValueError(f"min_size must be an int >= 0; got {min_size=}.")
    if dims == "global" and min_size > 1:  # type: ignore[operator]
        # torchzero ignores min_size for the global norm; ignoring it silently
        # here would hide that the whole tree is always one unit.
        raise ValueError(
            f"min_size applies to per-leaf and per-slice units; with dim='global' the whole "
            f"tree is one unit and is always measured (got {min_size=}). Pass dim=None (each "
            "leaf a unit) or an int or tuple of axes to use min_size."
        )
    return int(min_size)


def _unit_args(
    ord: Any, dim: Any, inverse_dims: Any, min_size: Any
) -> tuple[Measure, str | tuple[int, ...] | None, int]:
    dims = _parse_dim(dim, inverse_dims, _UNIT_STATIC)
    return _parse_ord(ord, _UNIT_STATIC), dims, _check_min_size(min_size, dims, _UNIT_STATIC)


def _check_tree_dim(dim: Any) -> bool:
    """`dim` of the EMA and growth clippers: `None` (per leaf) or `"global"`; True if per leaf."""
    if dim is None or (isinstance(dim, str) and dim == "global"):
        return dim is None
    raise ValueError(
        f"dim must be None (each leaf is measured on its own) or 'global' (all leaves as one "
        f"vector); got {dim=}. (This replaces torchzero's tensorwise=True / False and "
        "parameterwise=True / False.)"
    )


# --------------------------------------------------------------------------- #
# Units                                                                        #
# --------------------------------------------------------------------------- #


def _unit_axes(
    shape: tuple[int, ...], dims: tuple[int, ...] | None, inverse_dims: bool
) -> tuple[int, ...]:
    """The axes a unit spans: all of them for `dims=None`, else those named."""
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


def _linear_size(value: Any, m: Measure) -> Any:
    """Maps a bound on a measure to a bound on a size that scales linearly with `x`.

    Scaling `x` by `c` scales every norm, `mad`, `std` and `|sum|` by `|c|`
    but the variance by `c**2`; the variance is handled as the standard
    deviation so that the variance after clipping is at most the bound.
    """
    return None if value is None else (jnp.sqrt(value) if m.kind == "var" else value)


def _reported(size: Size, m: Measure) -> jax.Array:
    """The measure as the user asked for it (the variance for `"var"`)."""
    value = size.value()
    if m.kind == "var":
        return jnp.minimum(jnp.square(value), jnp.finfo(value.dtype).max)
    return value


Factors = Callable[[Size], tuple[jax.Array, jax.Array]]


def _rescale_units(
    tree: Any,
    dim: str | tuple[int, ...] | None,
    inverse_dims: bool,
    min_size: int,
    m: Measure,
    factors: Factors,
) -> tuple[Any, Any]:
    """Multiplies every unit large enough by `a * b` from `factors(size)`; returns the measures.

    Leaves with no axis to span, or whose units hold fewer than `min_size`
    elements, are returned unchanged. 0-d leaves are handled as shape `(1,)`,
    as torchzero does.
    """
    if dim == "global":
        out, size = _rescale_whole(tree, m, factors)
        return out, _reported(size, m)
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    xs, axes_list = [], []
    for leaf in leaves:
        x = jnp.reshape(leaf, jnp.shape(leaf) or (1,)).astype(compute_dtype(leaf.dtype))
        xs.append(x)
        axes_list.append(_unit_axes(x.shape, dim, inverse_dims))  # type: ignore[arg-type]
    nonempty = [i for i, x in enumerate(xs) if x.size]
    sizes = dict(
        zip(nonempty, measure([[(xs[i], axes_list[i])] for i in nonempty], m), strict=True)
    )
    out, measures = [], []
    for i, (leaf, x, axes) in enumerate(zip(leaves, xs, axes_list, strict=True)):
        if i not in sizes:
            shape = tuple(1 if a in axes else s for a, s in enumerate(x.shape))
            zero = jnp.zeros(shape, real_dtype(x.dtype))
            sizes[i] = Size(zero, zero.astype(jnp.int32))
        size = sizes[i]
        if axes and x.size and math.prod(x.shape[a] for a in axes) >= min_size:
            new = jnp.reshape(apply_factors(x, *factors(size)).astype(leaf.dtype), leaf.shape)
        else:
            new = leaf
        out.append(new)
        reported = _reported(size, m)
        # One scalar per leaf for whole-leaf units; otherwise keep the leaf's rank.
        measures.append(reported.reshape(()) if dim is None or not leaf.ndim else reported)
    return jax.tree.unflatten(treedef, out), jax.tree.unflatten(treedef, measures)


def _rescale_whole(tree: Any, m: Measure, factors: Factors) -> tuple[Any, Size]:
    """`_rescale_units` with all leaves one unit; returns the unit's `Size` as measured."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    dtype = compute_dtype(*[leaf.dtype for leaf in leaves]) if leaves else jnp.float32
    xs = [leaf.astype(dtype) for leaf in leaves]
    parts = [(x, tuple(range(x.ndim))) for x in xs if x.size]

    def finish(sizes: list[Size]) -> tuple[Size, tuple[jax.Array, jax.Array]]:
        size = Size(sizes[0].mant.reshape(()), sizes[0].exp.reshape(()))
        return size, factors(size)

    if parts:
        size, (a, b) = measure([parts], m, finish)
    else:
        zero = jnp.zeros([], real_dtype(dtype))
        size = Size(zero, zero.astype(jnp.int32))
        a, b = factors(size)
    out = [apply_factors(x, a, b).astype(leaf.dtype) for x, leaf in zip(xs, leaves, strict=True)]
    return jax.tree.unflatten(treedef, out), size


def _select(
    where: jax.Array, chosen: tuple[jax.Array, jax.Array], other: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    return jnp.where(where, chosen[0], other[0]), jnp.where(where, chosen[1], other[1])


def _unit_factors(size: Size) -> tuple[jax.Array, jax.Array]:
    one = jnp.ones_like(size.mant)
    return one, one


def _clip_factors(hi: Any, lo: Any = None) -> Factors:
    """Factors that bring a size into `[lo, hi]` (either may be None); sizes 0 stay.

    A NaN size is out of every range, so that its unit becomes NaN as in
    `optax.clip_by_global_norm` (a comparison with NaN is false both ways).
    """

    def factors(size: Size) -> tuple[jax.Array, jax.Array]:
        value = size.value()
        out = _unit_factors(size)
        if hi is not None:
            out = _select(~(value <= hi), ratio_factors(hi, size), out)
        if lo is not None:
            out = _select(~(value >= lo) & (size.mant != 0), ratio_factors(lo, size), out)
        return out

    return factors


def _normalize_factors(target: Any) -> Factors:
    return lambda size: ratio_factors(target, size)


def _empty_init(params: optax.Params) -> optax.EmptyState:
    del params
    return optax.EmptyState()


def _stateless(fn: Callable[[optax.Updates], optax.Updates]) -> optax.GradientTransformation:
    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        _validation.refuse_unreduced("updates", updates, "this clipping transformation")
        return fn(updates), state

    return optax.GradientTransformation(_empty_init, update_fn)


def _vouching(
    fn: Callable[[optax.Updates], tuple[optax.Updates, jax.Array]],
) -> optax.GradientTransformationExtraArgs:
    """`_stateless` for a `fn` that also returns whether its output is all finite.

    Under `apply_gradients` the flag is handed to the `accumulate` that
    follows (`Receipt.vouch`): it then knows whether the clipped gradient is
    finite without reading it again, and XLA can fuse the clip's scaling
    into the add instead of writing the clipped gradient to memory for two
    readers. Other extra arguments are ignored, as `optax.chain` does for a
    transformation that takes none.
    """

    def update_fn(
        updates: optax.Updates,
        state: optax.EmptyState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        _validation.refuse_unreduced("updates", updates, "this clipping transformation")
        out, finite = fn(updates)
        receipt = extra_args.get(FUSE_KEY)
        if receipt is not None:
            receipt.vouch(out, finite)
        return out, state

    return optax.GradientTransformationExtraArgs(_empty_init, update_fn)


# --------------------------------------------------------------------------- #
# Pure tree functions                                                          #
# --------------------------------------------------------------------------- #


def clip_grad_norm(
    grads: optax.Updates,
    max_norm: jax.typing.ArrayLike | None,
    ord: Ord = 2,
    *,
    dim: Dim = "global",
    inverse_dims: bool = False,
    min_size: int = 1,
    min_norm: jax.typing.ArrayLike | None = None,
) -> tuple[optax.Updates, Any]:
    r"""Clips the norm of `grads` (or of each of its units) into `[min_norm, max_norm]`.

    For every unit $u$ (the whole tree by default, see `dim`) with measure
    $n_u$,

    $$
    g_u \leftarrow g_u \cdot \min\bigl(1, \mathrm{max\_norm} / n_u\bigr),
    $$

    and scaled up to `min_norm` when that is given and $0 < n_u <$ `min_norm`.
    Units whose measure is zero are left unchanged, so zeros stay zeros. With
    the defaults this is `torch.nn.utils.clip_grad_norm_` (and the update of
    `optax.clip_by_global_norm`); `dim=None` is torchzero's per-tensor default.

    It returns a new tree (JAX arrays are immutable) together with the
    measures it took, as `torch.nn.utils.clip_grad_norm_` returns the total
    norm. Norms are exact over the whole float range: a float32 gradient of
    `[3e19, 4e19]` is clipped to `[0.6, 0.8]`, not to zeros, and complex
    gradients keep their phase.

    Differences from torchzero's `clip_grad_norm_` (they apply to `clip_norm`,
    `normalize` and `normalize_grads` too), each pinned by a test:

    - defaults: `dim="global"` and `min_size=1` (torchzero: `dim=None`,
      `min_size=2`); `min_size > 1` with `dim="global"` raises (torchzero
      ignores it);
    - `dim=None` makes each leaf one unit over its own axes (torchzero takes
      the first tensor's axes for every tensor); negative axes are matched
      per leaf, so `inverse_dims` works with them;
    - a unit with a tiny nonzero measure (at most `1e-12`) is treated like any
      other: torchzero replaces such a measure by 1, so it normalises a
      `1e-13` vector to about `1e-13` where this gives the target;
    - `"var"` reaches its bound and `"sum"` keeps the direction (see `ord`);
    - the global `"l0"` count, a named `ord` with every setting of `dim`, and
      the `"std"` of a one-element unit give defined results (torchzero
      divides by zero, raises `TypeError` and returns NaN respectively).

    Args:
      grads: A pytree of arrays.
      max_norm: Upper bound (`>= 0`) on each unit's measure, or `None`.
      ord: The measure: a p-norm order `p >= 0` (`0` counts nonzeros, `inf` is
        the largest magnitude), or `"l0"` … `"l4"`, `"linf"`, `"mad"` (mean
        magnitude), `"std"`, `"var"` (with Bessel's correction, 0 for
        single-element units) or `"sum"` (the magnitude of the sum). Complex
        elements are measured by their modulus. For `"var"` the update is
        scaled by $\sqrt{\mathrm{bound}/n_u}$ so that the variance after
        clipping is the bound (torchzero scales by $\mathrm{bound}/n_u$, which
        does not reach it); for `"sum"` torchzero divides by the signed sum,
        which flips the direction of units with a negative sum. Scaling cannot
        change a count of nonzeros: with `"l0"` units are scaled by
        $\mathrm{bound}/n_u$ as in torchzero, which does not bound the count.
      dim: Which axes one unit spans. `"global"` (default): all leaves form one
        vector. `None`: each leaf is one unit. An int or a tuple of ints: the
        units of a leaf span those of these axes it has (negative axes count
        from the end; a leaf with none of them is left unchanged).
      inverse_dims: If `True`, units span every axis *not* named in `dim`
        (e.g. `dim=-1, inverse_dims=True` makes one unit per output feature of
        a Flax kernel). Needs `dim` to be an int or tuple.
      min_size: Units with fewer elements are left unchanged (default 1). Only
        for per-leaf and per-slice units.
      min_norm: Lower bound on each nonzero unit's measure, or `None`.

    Returns:
      `(clipped, measures)`: the clipped tree, and the measure of every unit
      before clipping: one scalar for `dim="global"`, else a tree of arrays
      broadcastable against each leaf (a scalar per leaf for `dim=None`).
      Measures are float32 (or wider), capped at the dtype's largest value.

    Raises:
      ValueError: For a negative or non-finite bound, `min_norm > max_norm`,
        an unknown `ord` or `dim`, `inverse_dims` without dims, or
        `min_size > 1` with `dim="global"`.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0, 0.0])}
      >>> clipped, norm = ga.clip_grad_norm(grads, 1.0)
      >>> clipped["a"], norm
      (Array([0.6, 0.8], dtype=float32), Array(5., dtype=float32))
      >>> clipped, norms = ga.clip_grad_norm({"a": jnp.array([3.0, 4.0])}, 1.0, dim=None)
      >>> norms["a"]
      Array(5., dtype=float32)
    """
    m, dims, min_size = _unit_args(ord, dim, inverse_dims, min_size)
    _validation.check_hyperparameter("max_norm", max_norm, allow_none=True)
    _validation.check_hyperparameter("min_norm", min_norm, allow_none=True)
    if isinstance(max_norm, numbers.Real) and isinstance(min_norm, numbers.Real):
        if min_norm > max_norm:
            raise ValueError(f"min_norm must be <= max_norm; got {min_norm=}, {max_norm=}.")
    factors = _clip_factors(_linear_size(max_norm, m), _linear_size(min_norm, m))
    return _rescale_units(grads, dims, inverse_dims, min_size, m, factors)


def clip_grad_value(grads: optax.Updates, value: jax.typing.ArrayLike) -> optax.Updates:
    """Clips every element of `grads` into `[-value, value]`.

    Complex elements keep their phase: their modulus is clipped to `value`.

    Args:
      grads: A pytree of arrays.
      value: The bound, `>= 0`.

    Returns:
      The clipped tree, with the leaves' dtypes.

    Raises:
      ValueError: If `value` is negative or not finite.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> ga.clip_grad_value({"w": jnp.array([-3.0, 0.5, 2.0])}, 1.0)["w"]
      Array([-1. ,  0.5,  1. ], dtype=float32)
    """
    _validation.check_hyperparameter("value", value)
    return jax.tree.map(lambda g: _clip_elements(jnp.asarray(g), value), grads)


def _clip_elements(g: jax.Array, bound: Any) -> jax.Array:
    """Elementwise clip to `[-bound, bound]`; complex elements have their modulus clipped."""
    if jnp.iscomplexobj(g):
        mag = jnp.abs(g)
        over = mag > bound
        return jnp.where(over, g * (bound / jnp.where(over, mag, 1)), g).astype(g.dtype)
    return jnp.clip(g, -bound, bound).astype(g.dtype)


def normalize_grads(
    grads: optax.Updates,
    norm_value: jax.typing.ArrayLike,
    ord: Ord = 2,
    *,
    dim: Dim = "global",
    inverse_dims: bool = False,
    min_size: int = 1,
) -> optax.Updates:
    r"""Rescales `grads` (or each of its units) to measure `norm_value`.

    $g_u \leftarrow g_u \cdot \mathrm{norm\_value} / n_u$ for every unit with
    a nonzero measure $n_u$, however small or large (a float32 `[3e-20, 4e-20]`
    becomes `[0.6, 0.8]`); units measuring zero are left as they are
    (torchzero divides by the global norm unguarded, giving NaN for an
    all-zero tree). See `clip_grad_norm` for the other differences from
    torchzero's `normalize_grads_`, including the default `dim="global"`.

    Args:
      grads: A pytree of arrays.
      norm_value: The target measure, `>= 0`.
      ord: The measure, as in `clip_grad_norm`.
      dim: Which axes one unit spans. `"global"` (default): all leaves form one
        vector. `None`: each leaf is one unit. An int or a tuple of ints: the
        units of a leaf span those of these axes it has (negative axes count
        from the end; a leaf with none of them is left unchanged).
      inverse_dims: If `True`, units span every axis *not* named in `dim`.
      min_size: Units with fewer elements are left unchanged (default 1). Only
        for per-leaf and per-slice units.

    Returns:
      The normalised tree, with the leaves' dtypes.

    Raises:
      ValueError: For a negative `norm_value`, an unknown `ord` or `dim`,
        `inverse_dims` without dims, or `min_size > 1` with `dim="global"`.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> ga.normalize_grads({"w": jnp.array([3.0, 4.0]), "z": jnp.zeros(2)}, 10.0, dim=None)
      {'w': Array([6., 8.], dtype=float32), 'z': Array([0., 0.], dtype=float32)}
    """
    m, dims, min_size = _unit_args(ord, dim, inverse_dims, min_size)
    _validation.check_hyperparameter("norm_value", norm_value)
    factors = _normalize_factors(_linear_size(norm_value, m))
    return _rescale_units(grads, dims, inverse_dims, min_size, m, factors)[0]


# --------------------------------------------------------------------------- #
# Stateless transforms                                                         #
# --------------------------------------------------------------------------- #


def centralize(
    dim: Dim | Literal["optax"] = "optax",
    *,
    inverse_dims: bool = False,
    min_size: int = 1,
) -> optax.GradientTransformation:
    r"""Subtracts the mean of every unit from it (gradient centralisation).

    For every unit $u$, $g_u \leftarrow g_u - \operatorname{mean}(g_u)$.

    The default, `dim="optax"`, is what `optax.centralize()` does: every leaf
    of rank 2 or more is centred per row, over all axes but the first, and
    vectors and scalars pass unchanged. That is Yong et al.'s per-output-feature
    centring for PyTorch's `(out, in, ...)` layout. Flax's layouts (Dense
    `(in, out)`, Conv `(..., in, out)`) keep the output feature last: there
    the paper's rule is `centralize(-1, inverse_dims=True)`, which leaves
    vectors such as biases alone too.

    The other values of `dim` are torchzero's `Centralize`: `None` centres
    every leaf as a whole (torchzero's default), an int or tuple names the
    axes a unit spans, `"global"` subtracts the mean of all elements of all
    leaves. Differences from torchzero: a 0-d leaf is never changed (it has no
    axis; torchzero leaves it too, while a one-element unit with
    `min_size=1` becomes zero, its mean being itself); `dim=None` centres each
    leaf over its own axes (torchzero takes the axes of the first tensor for
    every tensor); negative axes are matched against each leaf's rank (in
    torchzero `inverse_dims` never excludes a negative axis, so the Flax form
    above centralises whole kernels); the default `min_size` is 1 (torchzero:
    2), so that the default matches `optax.centralize()`, which also zeroes
    rows of one element.

    Args:
      dim: Which axes one unit spans: `"optax"` (default; each row of every
        leaf of rank >= 2), `None` (each leaf), an int or a tuple of ints (the
        units of a leaf span those of these axes it has; a leaf with none of
        them is left unchanged), or `"global"`.
      inverse_dims: If `True`, units span every axis *not* named in `dim`.
      min_size: Units with fewer elements are left unchanged (default 1). Only
        for per-leaf and per-slice units.

    Returns:
      An `optax.GradientTransformation` with an empty state.

    Raises:
      ValueError: For an unknown `dim`, a negative `min_size`, `inverse_dims`
        without dims, or `min_size > 1` with `dim="global"`.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> grads = {"kernel": jnp.array([[1.0, 2.0], [3.0, 6.0]]), "bias": jnp.array([1.0, 3.0])}
      >>> tx = ga.centralize()  # as optax.centralize(): rows of the kernel
      >>> updates, _ = tx.update(grads, tx.init(grads))
      >>> updates["kernel"], updates["bias"]
      (Array([[-0.5,  0.5],
             [-1.5,  1.5]], dtype=float32), Array([1., 3.], dtype=float32))
      >>> tx = ga.centralize(-1, inverse_dims=True)  # per output feature, Flax layouts
      >>> updates, _ = tx.update(grads, tx.init(grads))
      >>> updates["kernel"]
      Array([[-1., -2.],
             [ 1.,  2.]], dtype=float32)

    References:
      Yong et al., *Gradient Centralization: A New Optimization Technique for
      Deep Neural Networks*, 2020, https://arxiv.org/abs/2004.01461
    """
    dims = _parse_dim(dim, inverse_dims, _CENTRALIZE_STATIC, rules=("global", "optax"))
    min_size = _check_min_size(min_size, dims, _CENTRALIZE_STATIC)

    def leaf_axes(leaf: jax.Array) -> tuple[int, ...]:
        if dims == "optax":
            return tuple(range(1, leaf.ndim)) if leaf.ndim > 1 else ()
        if leaf.ndim == 0:
            return ()
        return _unit_axes(leaf.shape, dims, inverse_dims)  # type: ignore[arg-type]

    def mean(x: jax.Array, axes: tuple[int, ...] | None, count: int) -> jax.Array:
        # Dividing before summing cannot overflow: every partial sum is at
        # most the largest magnitude.
        return jnp.sum(x / count, axis=axes, keepdims=axes is not None)

    def centre(updates: optax.Updates) -> optax.Updates:
        leaves, treedef = jax.tree.flatten(updates)
        leaves = [jnp.asarray(leaf) for leaf in leaves]
        if dims == "global":
            count = sum(leaf.size for leaf in leaves)
            if not count:
                return updates
            dtype = compute_dtype(*[leaf.dtype for leaf in leaves])
            total = sum(
                (mean(leaf.astype(dtype), None, count) for leaf in leaves if leaf.size),
                start=jnp.zeros([], dtype),
            )
            out = [(leaf.astype(dtype) - total).astype(leaf.dtype) for leaf in leaves]
            return jax.tree.unflatten(treedef, out)
        out = []
        for leaf in leaves:
            axes = leaf_axes(leaf)
            count = math.prod(leaf.shape[a] for a in axes)
            if not axes or not leaf.size or count < min_size:
                out.append(leaf)
                continue
            x = leaf.astype(compute_dtype(leaf.dtype))
            out.append((x - mean(x, axes, count)).astype(leaf.dtype))
        return jax.tree.unflatten(treedef, out)

    return _stateless(centre)


def clip_norm(
    max_norm: jax.typing.ArrayLike,
    ord: Ord = 2,
    *,
    dim: Dim = "global",
    inverse_dims: bool = False,
    min_size: int = 1,
) -> optax.GradientTransformation:
    r"""Clips the norm of the updates (or of each of their units) to at most `max_norm`.

    $g_u \leftarrow g_u \cdot \min(1, \mathrm{max\_norm} / n_u)$ for every unit
    $u$ with measure $n_u$. With the defaults the whole tree is one unit and
    this is `optax.clip_by_global_norm(max_norm)`; `dim=None` clips every leaf
    on its own (torchzero's `ClipNorm` default). See `clip_grad_norm` for
    `ord`, the units and where this departs from torchzero.

    With the defaults, in `optax.chain(clip_norm(c), accumulate(...))` stepped
    by `gradaccum_jax.apply_gradients`, the norm measured here also tells
    `accumulate` whether the clipped gradient is finite (it is finite exactly
    when every element is): `accumulate` makes no pass of its own to check,
    and the clip's scaling is fused into its add, so the clipped gradient is
    never written to memory.

    Args:
      max_norm: The bound, `>= 0`.
      ord: The measure, as in `clip_grad_norm` (default 2).
      dim: Which axes one unit spans. `"global"` (default): all leaves form one
        vector. `None`: each leaf is one unit. An int or a tuple of ints: the
        units of a leaf span those of these axes it has (negative axes count
        from the end; a leaf with none of them is left unchanged).
      inverse_dims: If `True`, units span every axis *not* named in `dim`.
      min_size: Units with fewer elements are left unchanged (default 1). Only
        for per-leaf and per-slice units.

    Returns:
      An `optax.GradientTransformation` with an empty state.

    Raises:
      ValueError: For a negative bound, an unknown `ord` or `dim`,
        `inverse_dims` without dims, or `min_size > 1` with `dim="global"`.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.clip_norm(1.0)  # as optax.clip_by_global_norm(1.0)
      >>> grads = {"a": jnp.array([3.0]), "b": jnp.array([4.0])}
      >>> updates, _ = tx.update(grads, tx.init(grads))
      >>> updates["a"], updates["b"]
      (Array([0.6], dtype=float32), Array([0.8], dtype=float32))
      >>> tx = ga.clip_norm(1.0, dim=None)  # each leaf on its own
      >>> updates, _ = tx.update(grads, tx.init(grads))
      >>> updates["a"], updates["b"]
      (Array([1.], dtype=float32), Array([1.], dtype=float32))
    """
    m, _, _ = _unit_args(ord, dim, inverse_dims, min_size)
    _validation.check_hyperparameter("max_norm", max_norm)
    if dim == "global" and m == L2:
        # The measured norm is finite exactly when every element is (it is exact
        # over the whole float range, and NaN and infinities reach it), and a
        # factor of at most 1 keeps finite elements finite and makes no
        # non-finite one finite: so it tells whether the clipped tree is finite.
        factors = _clip_factors(max_norm)

        def clip(g: optax.Updates) -> tuple[optax.Updates, jax.Array]:
            out, size = _rescale_whole(g, m, factors)
            real = all(jnp.isrealobj(leaf) for leaf in jax.tree.leaves(out))
            return out, jnp.isfinite(size.mant) if real else _window.all_finite(out)

        return _vouching(clip)
    return _stateless(
        lambda g: clip_grad_norm(
            g, max_norm, ord, dim=dim, inverse_dims=inverse_dims, min_size=min_size
        )[0]
    )


def clip_value(value: jax.typing.ArrayLike) -> optax.GradientTransformation:
    """Clips every element of the updates into `[-value, value]`.

    Complex elements keep their phase: their modulus is clipped.

    Args:
      value: The bound, `>= 0`.

    Returns:
      An `optax.GradientTransformation` with an empty state.

    Raises:
      ValueError: If `value` is negative or not finite.

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
    dim: Dim = "global",
    inverse_dims: bool = False,
    min_size: int = 1,
) -> optax.GradientTransformation:
    r"""Rescales the updates (or each of their units) to measure `norm_value`.

    $g_u \leftarrow g_u \cdot \mathrm{norm\_value} / n_u$ for every unit with
    a nonzero measure; zero units stay zero. By default the whole tree is one
    unit; `dim=None` normalises every leaf on its own (torchzero's `Normalize`
    default). See `normalize_grads` and, for where this departs from
    torchzero, `clip_grad_norm`.

    Args:
      norm_value: The target measure, `>= 0` (default 1).
      ord: The measure, as in `clip_grad_norm` (default 2).
      dim: Which axes one unit spans. `"global"` (default): all leaves form one
        vector. `None`: each leaf is one unit. An int or a tuple of ints: the
        units of a leaf span those of these axes it has (negative axes count
        from the end; a leaf with none of them is left unchanged).
      inverse_dims: If `True`, units span every axis *not* named in `dim`.
      min_size: Units with fewer elements are left unchanged (default 1). Only
        for per-leaf and per-slice units.

    Returns:
      An `optax.GradientTransformation` with an empty state.

    Raises:
      ValueError: For a negative `norm_value`, an unknown `ord` or `dim`,
        `inverse_dims` without dims, or `min_size > 1` with `dim="global"`.
      TypeError: For arguments of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.normalize(1.0)
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


def _keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    """`new` where `ok`, else `old`, leaf by leaf, in `old`'s dtypes."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o).astype(o.dtype), new, old)


def _state_dtype(leaf: Any) -> jnp.dtype:
    return compute_dtype(jnp.result_type(leaf))


def _capped(x: jax.Array) -> jax.Array:
    """`x` with values beyond the largest float brought back to it.

    A weighted mean of finite values can round past `finfo.max` by one
    rounding step; keeping it finite keeps the state usable.
    """
    big = jnp.finfo(real_dtype(x.dtype)).max
    if jnp.iscomplexobj(x):
        return jax.lax.complex(jnp.clip(x.real, -big, big), jnp.clip(x.imag, -big, big))
    return jnp.clip(x, -big, big)


def _tree_sizes(tree: Any, m: Measure, per_leaf: bool) -> list[Size]:
    """Sizes of whole leaves (one per leaf) or of the whole tree (a list of one)."""
    leaves = [jnp.asarray(leaf) for leaf in jax.tree.leaves(tree)]
    if per_leaf:
        nonempty = [i for i, x in enumerate(leaves) if x.size]
        found = measure([[(leaves[i], tuple(range(leaves[i].ndim)))] for i in nonempty], m)
        sizes = dict(zip(nonempty, found, strict=True))
        out = []
        for i, x in enumerate(leaves):
            size = sizes.get(i)
            if size is None:
                zero = jnp.zeros([], real_dtype(x.dtype))
                size = Size(zero, zero.astype(jnp.int32))
            out.append(Size(size.mant.reshape(()), size.exp.reshape(())))
        return out
    parts = [(x, tuple(range(x.ndim))) for x in leaves if x.size]
    dtype = real_dtype(compute_dtype(*[x.dtype for x in leaves])) if leaves else jnp.float32
    if not parts:
        zero = jnp.zeros([], dtype)
        return [Size(zero, zero.astype(jnp.int32))]
    (size,) = measure([parts], m)
    return [Size(size.mant.reshape(()), size.exp.reshape(()))]


def _size_like(params: optax.Params, per_leaf: bool) -> Any:
    """Zero sizes (plain floats) with the structure the state keeps."""
    if per_leaf:
        return jax.tree.map(lambda p: jnp.zeros([], real_dtype(_state_dtype(p))), params)
    leaves = jax.tree.leaves(params)
    dtype = compute_dtype(*[jnp.result_type(p) for p in leaves]) if leaves else jnp.float32
    return jnp.zeros([], real_dtype(dtype))


def _scale_by(tree: Any, factors: list[tuple[jax.Array, jax.Array]], per_leaf: bool) -> Any:
    """Multiplies every leaf by its factor pair (per leaf) or by one pair."""
    leaves, treedef = jax.tree.flatten(tree)
    pairs = factors if per_leaf else factors * len(leaves)
    out = [
        apply_factors(jnp.asarray(x).astype(compute_dtype(jnp.result_type(x))), a, b).astype(
            jnp.result_type(x)
        )
        for x, (a, b) in zip(leaves, pairs, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def _as_list(sizes: Any, per_leaf: bool) -> list[jax.Array]:
    return jax.tree.leaves(sizes) if per_leaf else [sizes]


def _from_list(values: list[jax.Array], like: Any, per_leaf: bool) -> Any:
    if per_leaf:
        return jax.tree.unflatten(jax.tree.structure(like), values)
    return values[0]


class ClipNormByEMAState(NamedTuple):
    """State of `clip_norm_by_ema` and `normalize_by_ema`.

    Attributes:
      count: `int32[]`. Updates seen so far with finite values (saturating).
      ema: Tree shaped like the params, in float32 (or the params' dtype if
        wider or complex): the exponential moving average of past updates.
      prev_ema_norm: The EMA's size after the last step, which bounds its
        growth: one scalar per leaf (`dim=None`) or one scalar (`dim="global"`),
        in the real dtype of `ema`. Variances are kept as standard deviations.
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count
    ema: optax.Updates
    prev_ema_norm: Any


def _by_ema(
    normalize_: bool,
    beta: Any,
    ord: Ord,
    eps: Any,
    dim: Any,
    max_ema_growth: Any,
    ema_init: str,
) -> optax.GradientTransformation:
    _check_beta(beta)
    m = _parse_ord(ord, _EMA_STATIC)
    _validation.check_hyperparameter("eps", eps, allow_zero=False)
    per_leaf = _check_tree_dim(dim)
    _validation.check_hyperparameter(
        "max_ema_growth", max_ema_growth, allow_zero=False, allow_none=True
    )
    _validation.check_choice("ema_init", ema_init, ("zeros", "update"))

    def init_fn(params: optax.Params) -> ClipNormByEMAState:
        return ClipNormByEMAState(
            count=jnp.zeros([], jnp.int32),
            ema=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _state_dtype(p)), params),
            prev_ema_norm=_size_like(params, per_leaf),
        )

    def update_fn(
        updates: optax.Updates, state: ClipNormByEMAState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ClipNormByEMAState]:
        del params
        _validation.refuse_unreduced("updates", updates, "this clipping transformation")
        first = state.count == 0
        grads = jax.tree.map(lambda g, e: jnp.asarray(g).astype(e.dtype), updates, state.ema)
        start = state.ema
        if ema_init == "update":
            start = jax.tree.map(lambda e, g: jnp.where(first, g, e), state.ema, grads)
        ema = jax.tree.map(lambda e, g: _capped(beta * e + (1 - beta) * g), start, grads)
        ema_sizes = _tree_sizes(ema, m, per_leaf)
        ema_values = [s.value() for s in ema_sizes]
        if max_ema_growth is not None:
            prevs = _as_list(state.prev_ema_norm, per_leaf)
            shrink, new_values = [], []
            for size, value, prev in zip(ema_sizes, ema_values, prevs, strict=True):
                prev = jnp.where(first, value, prev)
                # torchzero floors the allowed size at 1e-6 per tensor but not
                # globally, where an EMA that is once zero stays zero for good;
                # the floor here is eps in both modes.
                allowed = jnp.maximum(
                    jnp.minimum(prev * max_ema_growth, jnp.finfo(value.dtype).max), eps
                ).astype(value.dtype)
                over = value > allowed
                shrink.append(_select(over, ratio_factors(allowed, size), _unit_factors(size)))
                new_values.append(jnp.where(over, allowed, value))
            ema = _scale_by(ema, shrink, per_leaf)
            ema_values = new_values
        grad_sizes = _tree_sizes(grads, m, per_leaf)
        factors = []
        for size, e_value in zip(grad_sizes, ema_values, strict=True):
            target = jnp.maximum(e_value, eps).astype(e_value.dtype)
            value = size.value()
            if normalize_:
                # At most a factor 1/eps up, so a near-zero update is not
                # blown up to the EMA's size.
                cap = (jnp.ones_like(value), jnp.full_like(value, 1 / eps))
                factors.append(_select(value < target * eps, cap, ratio_factors(target, size)))
            else:
                # A NaN measure is over every bound: its unit becomes NaN, as in optax.
                factors.append(
                    _select(~(value <= target), ratio_factors(target, size), _unit_factors(size))
                )
        new_updates = _scale_by(updates, factors, per_leaf)
        finite = _window.all_finite(updates)
        new_state = ClipNormByEMAState(
            count=_window.increment_if(state.count, finite),
            ema=_keep_if(finite, ema, state.ema),
            prev_ema_norm=_keep_if(
                finite, _from_list(ema_values, state.prev_ema_norm, per_leaf), state.prev_ema_norm
            ),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def clip_norm_by_ema(
    beta: jax.typing.ArrayLike = 0.99,
    ord: Ord = 2,
    eps: jax.typing.ArrayLike = 1e-6,
    *,
    dim: Literal["global"] | None = None,
    max_ema_growth: jax.typing.ArrayLike | None = 1.5,
    ema_init: Literal["zeros", "update"] = "zeros",
) -> optax.GradientTransformation:
    r"""Clips the update's norm to the norm of an EMA of past updates.

    Each step updates $m \leftarrow \beta m + (1-\beta) g$ (with $m$ starting
    at zero, or at the first update for `ema_init="update"`), limits the
    growth of $\lVert m\rVert$ to a factor `max_ema_growth` per step by
    shrinking $m$ (never below `eps`), and returns

    $$
    g \cdot \frac{1}{\max\bigl(1, \lVert g\rVert / \max(\lVert m\rVert, \epsilon)\bigr)},
    $$

    per leaf (`dim=None`, default) or for the whole tree (`dim="global"`).
    The EMA tracks the unclipped updates. With `ema_init="zeros"` the first
    step's bound is only $(1-\beta)\lVert g\rVert$, as in torchzero (there is
    no bias correction).

    Any finite update leaves a finite state, however large: norms are exact
    over the whole float range, and an EMA that rounds past the largest float
    is kept at it. A non-finite update leaves the state unchanged (the
    returned update is not finite either, so a later `accumulate` or
    `optax.apply_if_finite` can drop it).

    Differences from torchzero's `ClipNormByEMA`: `eps` floors both the EMA's
    norm in the division and the allowed EMA norm of the growth limit, per
    leaf and globally (torchzero floors only the growth bound, at `1e-6` and
    only per tensor, and guards the division with `2 * finfo.tiny`); `dim`
    replaces `tensorwise=True / False`.

    Args:
      beta: EMA decay in `[0, 1)` (default 0.99).
      ord: The measure, as in `clip_grad_norm` (default 2).
      eps: Floor (`> 0`) on the EMA's norm in the division, and on the
        allowed EMA norm when its growth is limited (default 1e-6).
      dim: `None` (default): norms per leaf; `"global"`: of all leaves as one
        vector.
      max_ema_growth: Largest factor (`> 0`) by which the EMA's norm may grow
        in one step, or `None` for no limit (default 1.5).
      ema_init: `"zeros"` (default) or `"update"`.

    Returns:
      An `optax.GradientTransformation` with a `ClipNormByEMAState`.

    Raises:
      ValueError: For `beta` outside `[0, 1)`, `eps <= 0`, a non-positive
        `max_ema_growth`, an unknown `ord`, `dim` or `ema_init`.
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
    return _by_ema(False, beta, ord, eps, dim, max_ema_growth, ema_init)


def normalize_by_ema(
    beta: jax.typing.ArrayLike = 0.99,
    ord: Ord = 2,
    eps: jax.typing.ArrayLike = 1e-6,
    *,
    dim: Literal["global"] | None = None,
    max_ema_growth: jax.typing.ArrayLike | None = 1.5,
    ema_init: Literal["zeros", "update"] = "zeros",
) -> optax.GradientTransformation:
    r"""Rescales the update to the norm of an EMA of past updates.

    Same EMA, growth limit and state guarantees as `clip_norm_by_ema`, but
    the update is scaled up as well as down:

    $$
    g \cdot \frac{1}{\max\bigl(\epsilon, \lVert g\rVert / \max(\lVert m\rVert, \epsilon)\bigr)},
    $$

    which gives $\lVert m\rVert$ whenever that ratio exceeds $\epsilon$; a
    zero update stays zero. Differences from torchzero's `NormalizeByEMA`:
    `eps` also caps the amplification at `1 / eps` (torchzero divides by the
    update's norm guarded only by `2 * finfo.tiny`), and `eps` floors the
    EMA's norm as in `clip_norm_by_ema`.

    Args:
      beta: EMA decay in `[0, 1)` (default 0.99).
      ord: The measure, as in `clip_grad_norm` (default 2).
      eps: Floor (`> 0`) in the divisions and on the allowed EMA norm
        (default 1e-6).
      dim: `None` (default): norms per leaf; `"global"`: of all leaves as one
        vector.
      max_ema_growth: Largest factor (`> 0`) by which the EMA's norm may grow
        in one step, or `None` for no limit (default 1.5).
      ema_init: `"zeros"` (default) or `"update"`.

    Returns:
      An `optax.GradientTransformation` with a `ClipNormByEMAState`.

    Raises:
      ValueError: For `beta` outside `[0, 1)`, `eps <= 0`, a non-positive
        `max_ema_growth`, an unknown `ord`, `dim` or `ema_init`.
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
    return _by_ema(True, beta, ord, eps, dim, max_ema_growth, ema_init)


class ClipValueByEMAState(NamedTuple):
    """State of `clip_value_by_ema`.

    Attributes:
      count: `int32[]`. Updates seen so far with finite values (saturating).
      ema: Tree shaped like the params, in the real float32 dtype (or the
        params' real dtype if wider): the exponential moving average of past
        updates' magnitudes.
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count
    ema: optax.Updates


def clip_value_by_ema(
    beta: jax.typing.ArrayLike = 0.99,
    ema_init: Literal["zeros", "update"] = "zeros",
) -> optax.GradientTransformation:
    r"""Clips every element to the EMA of past magnitudes at its position.

    $m \leftarrow \beta m + (1-\beta)\lvert g\rvert$, then
    $g \leftarrow \operatorname{clip}(g, -m, m)$ elementwise (complex elements
    keep their phase), with $m$ starting at zero or, for `ema_init="update"`,
    at the first update's magnitudes. The EMA tracks unclipped magnitudes. A
    non-finite update leaves the state unchanged; its NaN elements stay NaN and
    its infinities are clipped to the EMA before the call, as `optax.clip`
    clips them to its bound. (torchzero's optional
    `ema_tfm`, a transform applied to the EMA before clipping, is not offered.)

    Args:
      beta: EMA decay in `[0, 1)` (default 0.99).
      ema_init: `"zeros"` (default) or `"update"`.

    Returns:
      An `optax.GradientTransformation` with a `ClipValueByEMAState`.

    Raises:
      ValueError: For `beta` outside `[0, 1)` or an unknown `ema_init`.

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
            ema=jax.tree.map(
                lambda p: jnp.zeros(jnp.shape(p), real_dtype(_state_dtype(p))), params
            ),
        )

    def update_fn(
        updates: optax.Updates, state: ClipValueByEMAState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ClipValueByEMAState]:
        del params
        _validation.refuse_unreduced("updates", updates, "this clipping transformation")
        first = state.count == 0
        mags = jax.tree.map(lambda g, e: jnp.abs(g).astype(e.dtype), updates, state.ema)
        start = state.ema
        if ema_init == "update":
            start = jax.tree.map(lambda e, a: jnp.where(first, a, e), state.ema, mags)
        ema = jax.tree.map(lambda e, a: _capped(beta * e + (1 - beta) * a), start, mags)
        # A non-finite element is clipped by the EMA before it (an infinity to the
        # bound, as optax.clip does; NaN stays NaN), not by an EMA it has blown up.
        bounds = jax.tree.map(lambda e, s, a: jnp.where(jnp.isfinite(a), e, s), ema, start, mags)
        new_updates = jax.tree.map(
            lambda g, e: _clip_elements(
                jnp.asarray(g).astype(jnp.promote_types(jnp.result_type(g), e.dtype)), e
            ).astype(jnp.result_type(g)),
            updates,
            bounds,
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
    """State of `clip_norm_growth`.

    Attributes:
      count: `int32[]`. Updates seen so far with finite values (saturating).
      prev_norm: The tracked norm that bounds the next update: one scalar per
        leaf (`dim=None`) or one scalar (`dim="global"`), in float32 (or the
        params' real dtype if wider). Variances are kept as standard
        deviations.
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count
    prev_norm: Any


def clip_norm_growth(
    add: jax.typing.ArrayLike | None = None,
    mul: jax.typing.ArrayLike | None = 1.5,
    min_value: jax.typing.ArrayLike | None = 1e-4,
    max_decay: jax.typing.ArrayLike | None = 2,
    ord: Ord = 2,
    *,
    dim: Literal["global"] | None = None,
) -> optax.GradientTransformation:
    r"""Limits how fast the update's norm may grow from one step to the next.

    With $p$ the tracked norm of the previous step, the update's norm $n$ is
    clipped to

    $$
    \min\bigl(p + \mathrm{add},\; \max(p, \mathrm{min\_value}) \cdot \mathrm{mul}\bigr)
    $$

    (either term is dropped when its argument is `None`). The tracked norm
    becomes the clipped norm, except that it shrinks by at most a factor
    `max_decay` per step: after a tiny update it is $p / \mathrm{max\_decay}$,
    so one small step does not pin the next ones near zero. The first update
    passes unchanged and sets $p$. Norms are per leaf (`dim=None`, default) or
    of all leaves as one vector (`dim="global"`). Any finite update leaves a
    finite state; a non-finite update leaves the state unchanged.

    Differences from torchzero's `ClipNormGrowth`: `min_value` floors $p$ in
    the multiplicative bound only, as documented (torchzero instead takes
    `max(denominator, min_value)`, which never acts; the additive bound is
    $p + \mathrm{add}$ in both); the tracked norm decays from the previous
    tracked norm by `max_decay` whenever the update's norm falls below
    $p / \mathrm{max\_decay}$ (torchzero's decay rule differs when $p$ is
    small and the decay is active); `add=None, mul=None` passes updates
    through (torchzero raises); named `ord` values work (torchzero passes
    them to `torch.linalg.vector_norm`); `dim` replaces
    `parameterwise=True / False`.

    Args:
      add: Additive bound (`>= 0`) on the growth, or `None` (default).
      mul: Multiplicative bound (`> 0`) on the growth, or `None`
        (default 1.5).
      min_value: Floor (`>= 0`) on the tracked norm in the multiplicative
        bound, or `None` (default 1e-4).
      max_decay: Largest factor (`>= 1`) by which the tracked norm may shrink
        per step, or `None` (default 2).
      ord: The measure, as in `clip_grad_norm` (default 2).
      dim: `None` (default): norms per leaf; `"global"`: of all leaves as one
        vector.

    Returns:
      An `optax.GradientTransformation` with a `ClipNormGrowthState`.

    Raises:
      ValueError: For negative bounds, `mul <= 0`, `max_decay < 1`, an
        unknown `ord` or `dim`.
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
    m = _parse_ord(ord, _EMA_STATIC)
    per_leaf = _check_tree_dim(dim)

    def init_fn(params: optax.Params) -> ClipNormGrowthState:
        return ClipNormGrowthState(
            count=jnp.zeros([], jnp.int32), prev_norm=_size_like(params, per_leaf)
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
        _validation.refuse_unreduced("updates", updates, "this clipping transformation")
        first = state.count == 0
        sizes = _tree_sizes(updates, m, per_leaf)
        factors, tracked = [], []
        for size, prev in zip(sizes, _as_list(state.prev_norm, per_leaf), strict=True):
            value = size.value().astype(prev.dtype)
            allowed = bound(prev)
            over = ~first & ~(value <= allowed)  # NaN: the unit becomes NaN, as in optax
            factors.append(_select(over, ratio_factors(allowed, size), _unit_factors(size)))
            new = jnp.where(over, allowed, value)
            if max_decay is not None:
                decayed = prev / max_decay
                new = jnp.where(~first & (value < decayed), decayed, new)
            tracked.append(jnp.minimum(new, jnp.finfo(prev.dtype).max))
        new_updates = _scale_by(updates, factors, per_leaf)
        finite = _window.all_finite(updates)
        new_state = ClipNormGrowthState(
            count=_window.increment_if(state.count, finite),
            prev_norm=_keep_if(
                finite, _from_list(tracked, state.prev_norm, per_leaf), state.prev_norm
            ),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


class ClipValueGrowthState(NamedTuple):
    """State of `clip_value_growth`.

    Attributes:
      count: `int32[]`. Updates seen so far with finite values (saturating).
      prev: Tree shaped like the params, in float32 (or the params' dtype if
        wider): the tracked values that bound the next update.
    """

    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count
    prev: optax.Updates


def clip_value_growth(
    add: jax.typing.ArrayLike | None = None,
    mul: jax.typing.ArrayLike | None = 1.5,
    min_value: jax.typing.ArrayLike | None = 1e-4,
    max_decay: jax.typing.ArrayLike | None = 2,
) -> optax.GradientTransformation:
    r"""Limits how fast each element's magnitude may grow from step to step.

    Elementwise, with $p$ the tracked value of the previous step, the
    magnitude $\lvert g\rvert$ is first cut to $\lvert p\rvert +
    \mathrm{add}$, then to $\max(\lvert p\rvert, \mathrm{min\_value})
    \cdot \mathrm{mul}$, keeping its sign. The tracked value becomes the
    clipped element, except where the element shrank by more than a factor
    `max_decay` relative to $\max(\lvert p\rvert, \mathrm{min\_value})$:
    there it becomes $p / \mathrm{max\_decay}$. The first update passes
    unchanged and sets $p$; `add=None, mul=None` passes updates
    through. A non-finite update leaves the state unchanged; its NaN elements
    stay NaN and its infinities are clipped to the limit, as in `optax.clip`.

    Args:
      add: Additive bound (`>= 0`) on the growth, or `None` (default).
      mul: Multiplicative bound (`> 0`) on the growth, or `None`
        (default 1.5).
      min_value: Floor (`>= 0`) on the tracked magnitude in the
        multiplicative bound, or `None` (default 1e-4).
      max_decay: Largest factor (`>= 1`) by which the tracked magnitude may
        shrink per step, or `None` (default 2).

    Returns:
      An `optax.GradientTransformation` with a `ClipValueGrowthState`.

    Raises:
      ValueError: For negative bounds, `mul <= 0` or `max_decay < 1`.

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
        _validation.refuse_unreduced("updates", updates, "this clipping transformation")
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
