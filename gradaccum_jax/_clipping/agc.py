"""Adaptive gradient clipping (AGC) with per-leaf units for every Flax and Equinox layout."""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._base import equinox, validation
from gradaccum_jax._clipping.measures import (
    L2,
    Size,
    apply_factors,
    compute_dtype,
    measure,
    ratio_factors,
)

# A per-leaf unit specification: the axes one unit spans (an int or a tuple of
# ints; `()` makes every element its own unit), `None` for the whole leaf,
# or the name of a built-in rule.
AxesSpec = int | tuple[int, ...] | Literal["flax", "optax", "equinox"] | None
UnitAxes = AxesSpec | Callable[[jax.tree_util.KeyPath, jax.Array], AxesSpec] | Any

_RULES = ("flax", "optax", "equinox")
# The top-level `unit_axes=None`: the layout's own rule, read from the layer holding each leaf.
_DEFAULT = object()
# Equinox's layers (and their subclasses) hold weights output axis first, as PyTorch does:
# Linear (out, in), Conv and ConvTranspose (out, in, *kernel), the recurrent cells' (n * hidden,
# in), Embedding (vocab, size), WeightNorm's g (out, 1). MultiheadAttention and MLP hold
# Linears; the norms and PReLU hold vectors and scalars.
_EQUINOX_LAYERS = (
    "Linear",
    "Conv",
    "ConvTranspose",
    "Embedding",
    "GRUCell",
    "LSTMCell",
    "LayerNorm",
    "RMSNorm",
    "GroupNorm",
    "BatchNorm",
    "PReLU",
    "WeightNorm",
    "SpectralNorm",
)
# Flax's MultiHeadDotProductAttention (linen) and MultiHeadAttention (nnx)
# project inputs with kernels (in, heads, head_dim) held under these names.
_ATTENTION_PROJECTIONS = frozenset({"query", "key", "value"})


def _is_spec(x: Any) -> bool:
    if x is None or isinstance(x, str):
        return True
    if isinstance(x, numbers.Integral):
        return True
    return isinstance(x, tuple) and all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in x
    )


def _check_spec(where: str, spec: Any) -> None:
    if isinstance(spec, str):
        if spec not in _RULES:
            raise ValueError(
                f"{where} names an unknown rule {spec!r}; allowed rules are {_RULES!r} "
                "(or give axes as an int, a tuple of ints, or None for the whole leaf)."
            )
        return
    if isinstance(spec, bool) or not _is_spec(spec):
        raise TypeError(
            f"{where} must be an int, a tuple of ints, None (the whole leaf is one unit) "
            f"or one of {_RULES!r}; got {spec!r} of type {type(spec).__name__}."
        )


def _path_names(path: jax.tree_util.KeyPath) -> list[str]:
    names = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            names.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            names.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            names.append(str(key.idx))
        else:
            names.append(str(getattr(key, "key", key)))
    # An nnx.Variable holds its array under the attribute `value`.
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        names.pop()
    return names


def _flax_axes(path: jax.tree_util.KeyPath, shape: tuple[int, ...]) -> tuple[int, ...]:
    ndim = len(shape)
    names = _path_names(path)
    name = names[-1] if names else ""
    if ndim <= 1 or name == "bias":
        return tuple(range(ndim))
    if ndim >= 3 and name == "kernel" and len(names) >= 2 and names[-2] in _ATTENTION_PROJECTIONS:
        # (in, heads, head_dim): one unit per (head, feature) output.
        return tuple(range(ndim - 2))
    # Dense (in, out), Conv (..., in, out), Conv1D (W, I, O), attention output
    # (heads, head_dim, out): one unit per output feature.
    return tuple(range(ndim - 1))


def _equinox_axes(path: jax.tree_util.KeyPath, shape: tuple[int, ...]) -> tuple[int, ...]:
    ndim = len(shape)
    names = _path_names(path)
    if ndim <= 1 or (names and names[-1] == "bias"):
        return tuple(range(ndim))
    # Linear (out, in), Conv (out, in, *kernel): one unit per output feature.
    return tuple(range(1, ndim))


def _equinox_layer(owner: Any) -> str | None:
    """The name of the Equinox layer type `owner` is an instance of, or None."""
    if owner is None:
        return None
    nn = sys.modules["equinox"].nn
    for name in _EQUINOX_LAYERS:
        layer = getattr(nn, name, None)
        if layer is not None and isinstance(owner, layer):
            return name
    return None


def _default_rule(path: jax.tree_util.KeyPath, shape: tuple[int, ...], owner: Any) -> str:
    """The rule `unit_axes=None` takes for a leaf held by `owner` (an Equinox module or None)."""
    if owner is None:
        return "flax"
    if _equinox_layer(owner) is not None:
        return "equinox"
    if len(shape) <= 1 or _path_names(path)[-1:] == ["bias"]:
        return "flax"  # the whole leaf is one unit under every rule
    raise ValueError(
        f"adaptive_grad_clip cannot tell the layout of the leaf at "
        f"{jax.tree_util.keystr(path)!r} (shape {shape}), held by the Equinox module "
        f"{type(owner).__name__} (not one of equinox.nn's layers): pass "
        "unit_axes='equinox' if its output axis comes first (Equinox's and PyTorch's "
        "layout), 'flax' if it comes last, or a callable (path, leaf) -> axes."
    )


def _check_layout(
    rule: str,
    axes: tuple[int, ...],
    path: jax.tree_util.KeyPath,
    shape: tuple[int, ...],
    owner: Any,
) -> None:
    """Refuses a Flax-layout rule whose units cut an Equinox layer's weight into input columns."""
    layer = _equinox_layer(owner)
    if layer is None:
        return
    # Size-1 axes do not change which elements share a unit.
    wanted = _equinox_axes(path, shape)
    if {a for a in axes if shape[a] != 1} != {a for a in wanted if shape[a] != 1}:
        raise ValueError(
            f"unit_axes={rule!r} reads the leaf at {jax.tree_util.keystr(path)!r} (shape "
            f"{shape}) as a Flax layout, output axis last, but an equinox.nn.{layer} holds "
            "it output axis first: each unit would be an input column. Pass unit_axes=None "
            "(the default: one unit per output feature for Equinox layers) or 'equinox'; for "
            "these units anyway, give the axes explicitly."
        )


def _optax_axes(path: jax.tree_util.KeyPath, shape: tuple[int, ...]) -> tuple[int, ...]:
    ndim = len(shape)
    # optax.adaptive_grad_clip decides by rank alone, after ignoring size-1 axes
    # for the "vector" test.
    if sum(1 for s in shape if s != 1) <= 1:
        return tuple(range(ndim))
    if ndim in (2, 3):
        return (0,)
    if ndim in (4, 5):
        return tuple(range(ndim - 1))
    raise ValueError(
        f"unit_axes='optax' has no rule for the leaf at {jax.tree_util.keystr(path)!r} "
        f"with shape {shape} (optax.adaptive_grad_clip handles ranks 0 to 5); give its "
        "axes explicitly, e.g. unit_axes=lambda path, leaf: tuple(range(leaf.ndim - 1))."
    )


def _resolve(
    spec: Any, path: jax.tree_util.KeyPath, shape: tuple[int, ...], owner: Any = None
) -> tuple[int, ...]:
    if spec is _DEFAULT:
        spec = _default_rule(path, shape, owner)
    where = f"unit_axes for the leaf at {jax.tree_util.keystr(path)!r} (shape {shape})"
    _check_spec(where, spec)
    ndim = len(shape)
    if spec == "equinox":
        return _equinox_axes(path, shape)
    if spec in ("flax", "optax"):
        by_rule = _flax_axes(path, shape) if spec == "flax" else _optax_axes(path, shape)
        _check_layout(spec, by_rule, path, shape, owner)
        return by_rule
    if spec is None:
        return tuple(range(ndim))
    axes = (spec,) if isinstance(spec, numbers.Integral) else spec
    resolved = []
    for axis in axes:
        if not -ndim <= axis < ndim:  # type: ignore[operator]
            raise ValueError(
                f"{where} holds axis {axis}, out of range for a rank-{ndim} leaf; allowed "
                f"axes are {-ndim}..{ndim - 1}, or None for the whole leaf."
            )
        resolved.append(int(axis) % ndim)
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            f"{where} repeats an axis: {spec!r} (axes {resolved} after resolving negative "
            "ones); list each axis once."
        )
    return tuple(sorted(resolved))


def _max_norm(clipping: Any, p_size: Size, eps: Any) -> jax.Array:
    """`clipping * max(|W_u|, eps)`, capped at the largest float of its dtype."""
    value = p_size.value()
    big = jnp.finfo(value.dtype).max
    floored = jnp.maximum(value, eps)
    # clipping * floored can exceed the largest float only when clipping > 1.
    return jnp.where(floored > big / jnp.maximum(clipping, 1), big, clipping * floored).astype(
        value.dtype
    )


def _leaf_axes(unit_axes: UnitAxes, params: optax.Params) -> list[tuple[int, ...]]:
    """Returns the reduction axes of every leaf of `params`, in flattening order."""
    with_path = jax.tree_util.tree_leaves_with_path(params)
    owners = equinox.owners(params)
    if unit_axes is None or isinstance(unit_axes, str):
        specs = [_DEFAULT if unit_axes is None else unit_axes] * len(with_path)
    elif callable(unit_axes):
        specs = [unit_axes(path, leaf) for path, leaf in with_path]
    else:
        specs = _broadcast(unit_axes, params)
    return [
        _resolve(spec, path, jnp.shape(leaf), owner)
        for spec, (path, leaf), owner in zip(specs, with_path, owners, strict=True)
    ]


def _broadcast(unit_axes: Any, params: optax.Params) -> list[Any]:
    """The spec of every leaf of `params`, from the tree (or tree prefix) `unit_axes`."""
    specs: list[Any] = []

    def broadcast(spec: Any, subtree: Any) -> None:
        specs.extend([spec] * len(jax.tree_util.tree_leaves(subtree)))

    try:
        jax.tree.map(broadcast, unit_axes, params, is_leaf=_is_spec)
    except ValueError as err:
        raise ValueError(
            "unit_axes must be a tree with the structure of the params (or a prefix of "
            f"it) whose leaves are axes specs; it does not match: {err}. Use a callable "
            "(path, leaf) -> axes for anything more selective."
        ) from None
    return specs


def adaptive_grad_clip(
    clipping: jax.typing.ArrayLike = 0.01,
    eps: jax.typing.ArrayLike = 1e-3,
    axis: int | tuple[int, ...] | None = None,
    *,
    unit_axes: UnitAxes = None,
) -> optax.GradientTransformation:
    r"""Clips each unit's gradient to a fraction of its weight's norm (AGC).

    A *unit* is a slice of a parameter leaf, usually all weights feeding one
    output feature. For every unit $u$ with weights $W_u$ and gradient $G_u$,

    $$
    G_u \leftarrow G_u \cdot \min\Bigl(1,\;
        \frac{\lambda\,\max(\lVert W_u\rVert_2, \epsilon)}{\lVert G_u\rVert_2}\Bigr),
    $$

    so that $\lVert G_u\rVert \le \lambda \max(\lVert W_u\rVert, \epsilon)$
    afterwards ($\lambda$ is `clipping`). Norms are computed in float32 (or
    wider, complex elements by their modulus) whatever the gradients' dtype,
    exactly over the whole float range: a float32 gradient of `[2e19, 2e19]`
    is clipped, not zeroed. The result keeps the gradients' dtype.

    **Units.** By default (`axis=None`, `unit_axes=None`) the units follow
    Flax's layouts, read from the leaf's rank and its name in the tree:

    - scalars, vectors and every leaf named `bias`: the whole leaf is one unit;
    - `kernel` under `query`, `key` or `value` (attention input projections,
      `(in, heads, head_dim)`): one unit per `(head, feature)`, reducing over
      the input axes;
    - every other leaf of rank ≥ 2 (Dense `(in, out)`, Conv `(..., in, out)`,
      Conv1D `(W, I, O)`, attention output `(heads, head_dim, out)`): one unit
      per output feature, reducing over all axes but the last.

    For Dense, Conv2D and Conv3D kernels, vectors and scalars this is also
    `optax.adaptive_grad_clip`'s default. optax decides by rank only and
    reduces a rank-3 leaf over axis 0, which is wrong for Conv1D and attention
    output kernels (it clips each `(W or head, out)` column separately);
    `unit_axes="optax"` reproduces its choice of units. For layouts the names
    do not reveal (DenseGeneral with several output axes, Einsum, custom
    modules) pass `unit_axes`.

    **Equinox.** Equinox's layers hold their weights output axis first, as
    PyTorch does: `eqx.nn.Linear` `(out, in)`, `eqx.nn.Conv` and
    `ConvTranspose` `(out, in, *kernel)`. By default a leaf held by one of
    `equinox.nn`'s layers (or a subclass; those inside `MultiheadAttention`
    and `MLP` included) gets the `"equinox"` rule, one unit per output
    feature, reducing over all axes but the first; vectors, scalars and
    biases stay whole units. A leaf of rank ≥ 2 held directly by a module
    of your own is refused with a `ValueError` naming the rules, since its
    layout cannot be read, and so are `"flax"` and `"optax"` where they
    would cut an Equinox layer's weight into input columns. Give AGC the
    model (or `eqx.filter(model, eqx.is_inexact_array)`) as `params`: the
    layer types are read from it.

    **From optax.** `adaptive_grad_clip(clipping, eps, axis)` takes optax's
    arguments with optax's meaning: `axis` names the axes the norms reduce
    over, the same for every leaf. One difference remains, pinned by a test:
    optax divides by `max(|G_u|, 1e-6)`, so a unit whose gradient norm is
    below `1e-6` and over its bound comes out smaller than the bound; here the
    division is by $\lVert G_u\rVert$ itself and the unit lands on its bound.

    Args:
      clipping: The bound $\lambda > 0$ on the ratio of a unit's gradient
        norm to its weight norm. Brock et al. use 0.01 to 0.16 depending on the
        batch size (smaller for larger batches).
      eps: The floor $\epsilon \ge 0$ on weight norms, so that units with
        zero-initialised weights can still move.
      axis: optax's argument: an int or a tuple of ints naming the axes the
        norms reduce over, for every leaf alike; `None` (default) leaves the
        choice to `unit_axes`. Not together with `unit_axes`.
      unit_axes: Which axes of each leaf one unit spans (the axes the norms
        reduce over). One of

        - `None`: the `"equinox"` rule for leaves of Equinox layers, the
          `"flax"` rule for all others (see above);
        - `"flax"`: the Flax rule above;
        - `"optax"`: `optax.adaptive_grad_clip`'s rank rule;
        - `"equinox"`: output axis first (Equinox and PyTorch layouts): one
          unit per index of the first axis of every leaf of rank ≥ 2 not
          named `bias`;
        - a tree with the structure of the params, or a prefix of it, whose
          leaves are specs: an int or a tuple of ints (negative counts from the
          end; `()` makes each element a unit), `None` (the whole leaf is
          one unit), `"flax"`, `"optax"` or `"equinox"`. A tuple of ints is always one
          spec, so for tuple-structured params give per-leaf specs with a
          callable;
        - a callable `(path, leaf) -> spec`, called at trace time with the
          key path (as from `jax.tree_util.tree_leaves_with_path`) and the
          parameter leaf.

    Returns:
      An `optax.GradientTransformation` with an empty state. Its `update`
      needs `params`.

    Raises:
      ValueError: If `clipping <= 0`, `eps < 0`, a rule name is unknown,
        an axis is out of range or repeated, both `axis` and `unit_axes` are
        given, `update` is called without `params`, or (at trace time) the
        units of an Equinox leaf are unknown or cut into input columns
        (see above).
      TypeError: If a spec is of the wrong type.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.adaptive_grad_clip(0.5)
      >>> params = {"kernel": jnp.array([[3.0, 0.0], [4.0, 1.0]])}  # unit norms 5 and 1
      >>> grads = {"kernel": jnp.array([[0.6, 0.0], [0.8, 2.0]])}  # unit norms 1 and 2
      >>> updates, _ = tx.update(grads, tx.init(params), params)
      >>> updates["kernel"]  # column 0 is within 0.5 * 5; column 1 is cut to 0.5 * 1
      Array([[0.6, 0. ],
             [0.8, 0.5]], dtype=float32)

      Place it on the accumulated gradient, i.e. inside `accumulate`:

      >>> import optax
      >>> tx = ga.accumulate(optax.chain(ga.adaptive_grad_clip(0.01), optax.sgd(0.1)), 4)

    References:
      Brock et al., *High-Performance Large-Scale Image Recognition Without
      Normalization*, 2021, https://arxiv.org/abs/2102.06171
    """
    validation.check_hyperparameter("clipping", clipping, allow_zero=False)
    validation.check_hyperparameter("eps", eps)
    if axis is not None:
        if unit_axes is not None:
            raise ValueError(
                f"pass either axis (optax's spelling: the same axes for every leaf) or "
                f"unit_axes (per-leaf rules), not both; got {axis=}, {unit_axes=}."
            )
        if isinstance(axis, bool) or not (
            isinstance(axis, numbers.Integral) or (_is_spec(axis) and isinstance(axis, tuple))
        ):
            hint = (
                " With optax.inject_hyperparams pass static_args=('axis', 'unit_axes')."
                if hasattr(axis, "dtype")
                else ""
            )
            raise TypeError(
                f"axis must be an int, a tuple of ints or None; got {axis!r} of type "
                f"{type(axis).__name__}.{hint}"
            )
    if isinstance(unit_axes, str):
        _check_spec("unit_axes", unit_axes)
    elif unit_axes is not None and not callable(unit_axes):
        for spec in jax.tree_util.tree_leaves(unit_axes, is_leaf=_is_spec):
            _check_spec("each leaf of unit_axes", spec)

    def init_fn(params: optax.Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(
        updates: optax.Updates,
        state: optax.EmptyState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, optax.EmptyState]:
        validation.refuse_unreduced("updates", updates, "adaptive_grad_clip")
        if params is None:
            raise ValueError(
                "adaptive_grad_clip needs the parameters: its bound is relative to each "
                "unit's weight norm. Call update(updates, state, params); optax.chain and "
                "gradaccum_jax.accumulate pass params on to it."
            )
        if equinox.holds_module(params):
            # The whole model, as eqx.apply_updates takes it: its arrays are the params.
            params = equinox.partition(params)[0]
        validation.check_same_structure("updates", updates, "params", params)
        grad_leaves, treedef = jax.tree.flatten(updates)
        param_leaves = jax.tree.leaves(params)
        leaf_axes = _leaf_axes(unit_axes if axis is None else axis, params)
        dtypes = [
            compute_dtype(jnp.result_type(g), jnp.result_type(p))
            for g, p in zip(grad_leaves, param_leaves, strict=True)
        ]
        gs = [jnp.asarray(g).astype(d) for g, d in zip(grad_leaves, dtypes, strict=True)]
        ps = [jnp.asarray(p).astype(d) for p, d in zip(param_leaves, dtypes, strict=True)]
        nonempty = [i for i, g in enumerate(gs) if g.size]
        # One measurement of all gradient and weight units: exact norms
        # whatever their magnitude, at the cost of plain ones on ordinary inputs.
        found = measure(
            [[(gs[i], leaf_axes[i])] for i in nonempty]
            + [[(ps[i], leaf_axes[i])] for i in nonempty],
            L2,
        )
        out = list(grad_leaves)
        for j, i in enumerate(nonempty):
            g_size, p_size = found[j], found[len(nonempty) + j]
            max_norm = _max_norm(clipping, p_size, eps)
            # True for a NaN norm, which makes the unit NaN, as in optax.
            over = ~(g_size.value() <= max_norm)
            one = jnp.ones_like(max_norm)
            a, b = ratio_factors(max_norm, g_size)
            scaled = apply_factors(gs[i], jnp.where(over, a, one), jnp.where(over, b, one))
            out[i] = scaled.astype(jnp.result_type(grad_leaves[i]))
        return jax.tree.unflatten(treedef, out), state

    return optax.GradientTransformation(init_fn, update_fn)
