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
`measures.py`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._base import trees, validation
from gradaccum_jax._clipping.measures import (
    _CENTRALIZE_STATIC,
    L2,
    Dim,
    Measure,
    Ord,
    Size,
    _check_min_size,
    _parse_dim,
    _unit_args,
    apply_factors,
    compute_dtype,
    measure,
    ratio_factors,
    real_dtype,
)
from gradaccum_jax._window.fused import FUSE_KEY

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
        validation.refuse_unreduced("updates", updates, "this clipping transformation")
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
        validation.refuse_unreduced("updates", updates, "this clipping transformation")
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
    validation.check_hyperparameter("max_norm", max_norm, allow_none=True)
    validation.check_hyperparameter("min_norm", min_norm, allow_none=True)
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
    validation.check_hyperparameter("value", value)
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
    validation.check_hyperparameter("norm_value", norm_value)
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
    validation.check_hyperparameter("max_norm", max_norm)
    if dim == "global" and m == L2:
        # The measured norm is finite exactly when every element is (it is exact
        # over the whole float range, and NaN and infinities reach it), and a
        # factor of at most 1 keeps finite elements finite and makes no
        # non-finite one finite: so it tells whether the clipped tree is finite.
        factors = _clip_factors(max_norm)

        def clip(g: optax.Updates) -> tuple[optax.Updates, jax.Array]:
            out, size = _rescale_whole(g, m, factors)
            real = all(jnp.isrealobj(leaf) for leaf in jax.tree.leaves(out))
            return out, jnp.isfinite(size.mant) if real else trees.all_finite(out)

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
    validation.check_hyperparameter("value", value)
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
    validation.check_hyperparameter("norm_value", norm_value)
    return _stateless(
        lambda g: normalize_grads(
            g, norm_value, ord, dim=dim, inverse_dims=inverse_dims, min_size=min_size
        )
    )


# --------------------------------------------------------------------------- #
# What the transforms with memory share (ema.py, growth.py)                    #
# --------------------------------------------------------------------------- #


def _check_beta(beta: Any) -> Any:
    validation.check_hyperparameter("beta", beta)
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
