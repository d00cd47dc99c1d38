"""Norms that neither overflow nor underflow, shared by the clipping family and AGC.

A float32 sum of squares overflows once an element exceeds about `1.8e19` and
loses everything below about `1e-19`; the ratio of a bound to a norm flushes to
zero below `1.2e-38`. Both happen in exactly the steps clipping exists for.

The measures here are computed the fast way first (one reduction per unit, as
`optax.global_norm` does). Only when some unit's fast result is out of the
range where it is exact do they run again on inputs divided by a power of two
near each unit's largest magnitude, inside one `jax.lax.cond` per call, so
ordinary inputs pay nothing. Results are kept as `Size(mant, exp)`, the value
`mant * 2**exp`, so a norm above the largest float is still ordered and divided
correctly, and scaling a unit to a target is applied as two factors that are
both representable.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax._base import trees


@dataclasses.dataclass(frozen=True)
class Measure:
    """A parsed `ord`: a p-norm of order `p` (`kind="norm"`) or a statistic.

    Kinds: `"norm"`, `"mad"` (mean magnitude), `"sum"` (magnitude of the sum),
    `"std"` and `"var"` (Bessel-corrected; both measured as the standard
    deviation, which scales linearly).
    """

    kind: str
    p: float = 0.0


L2 = Measure("norm", 2.0)


def _int_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.dtype(f"int{jnp.finfo(dtype).bits}")


def pow2(k: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`2.0**k` for integer `k` in `[minexp, maxexp - 1]` (normal numbers), built from bits.

    Much cheaper to compile than `jnp.ldexp`, which also handles subnormals.
    """
    finfo = jnp.finfo(dtype)
    itype = _int_dtype(dtype)
    biased = (k.astype(itype) + (finfo.maxexp - 1)) << finfo.nmant
    return jax.lax.bitcast_convert_type(biased, finfo.dtype)


def split_exponent(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(m, e)` with `x = m * 2**e` and `m` in `[0.5, 1)` for positive normal `x`.

    Zero and subnormal `x` (which XLA may flush to zero anyway) give `(0, 0)`;
    infinity and NaN give an `m` that is not finite.
    """
    finfo = jnp.finfo(x.dtype)
    itype = _int_dtype(x.dtype)
    bits = jax.lax.bitcast_convert_type(x, itype)
    ones = (1 << finfo.nexp) - 1
    field = (bits >> finfo.nmant) & ones
    normal = field > 0
    e = jnp.where(normal, field - (finfo.maxexp - 2), 0).astype(jnp.int32)
    # Two exact power-of-two factors (one may not be normal); multiplying
    # keeps the derivative with respect to x.
    half = -e // 2
    m = jnp.where(normal, x * pow2(half, x.dtype) * pow2(-e - half, x.dtype), 0)
    # A field of all ones is infinity or NaN: keep it visible.
    return jnp.where(field == ones, x, m), e


class Size(NamedTuple):
    """A non-negative size `mant * 2**exp` per unit (`mant` in `[0.5, 1)` or 0)."""

    mant: jax.Array
    exp: jax.Array

    def value(self) -> jax.Array:
        """The size as a float, `finfo.max` where it is larger."""
        dtype = self.mant.dtype
        finfo = jnp.finfo(dtype)
        first = jnp.clip(self.exp, finfo.minexp, finfo.maxexp - 1)
        rest = jnp.clip(self.exp - first, finfo.minexp, finfo.maxexp - 1)
        return jnp.minimum(self.mant * pow2(first, dtype) * pow2(rest, dtype), finfo.max)


# A part is a leaf (in its compute dtype) and the axes one unit spans; several
# parts with all their axes form one unit together (the global norm).
Part = tuple[jax.Array, tuple[int, ...]]


def compute_dtype(*dtypes: jnp.dtype) -> jnp.dtype:
    """float32, or the inputs' wider or complex type: 16-bit sums keep ~2 digits."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


def real_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.finfo(dtype).dtype


def _squares(x: jax.Array) -> jax.Array:
    if jnp.iscomplexobj(x):
        return jnp.square(x.real) + jnp.square(x.imag)
    return jnp.square(x)


def _sqrt(x: jax.Array) -> jax.Array:
    # sqrt has an infinite slope at 0; guarding it keeps derivatives finite.
    # NaN stays NaN: a NaN element must make its unit's measure NaN.
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1)), jnp.where(x == 0, 0, x))


def _reduce(parts: Sequence[Part], fn, op=jnp.sum) -> jax.Array:
    """`op` of `fn(x)` over each unit; summed (or maxed) across parts."""
    if len(parts) == 1:
        x, axes = parts[0]
        return op(fn(x), axis=axes, keepdims=True)
    results = [op(fn(x)) for x, _ in parts]
    combine = jnp.max if op is jnp.max else jnp.sum
    return combine(jnp.stack(results))


def _plain(parts: Sequence[Part], m: Measure, count: int) -> jax.Array:
    """The measure the direct way (exact unless squares or sums leave the range)."""
    if m.kind == "mad":
        return _reduce(parts, jnp.abs) / count
    if m.kind == "sum":
        return jnp.abs(_reduce(parts, lambda x: x))
    if m.kind in ("std", "var"):
        mean = _reduce(parts, lambda x: x) / count
        if len(parts) == 1:
            centred = [(parts[0][0] - mean, parts[0][1])]
        else:
            centred = [(x - mean, axes) for x, axes in parts]
        return _sqrt(_reduce(centred, _squares) / max(count - 1, 1))
    p = m.p
    if p == 0:
        return _reduce(parts, lambda x: (x != 0).astype(real_dtype(x.dtype)))
    if p == 1:
        return _reduce(parts, jnp.abs)
    if p == 2:
        return _sqrt(_reduce(parts, _squares))
    biggest = _reduce(parts, jnp.abs, jnp.max)
    if p == math.inf:
        return biggest
    # Other orders always divide by the largest magnitude: |x|**p leaves the
    # range far sooner than a square does.
    safe = jnp.where(biggest > 0, biggest, 1)
    if len(parts) == 1:
        scaled = [(parts[0][0] / safe, parts[0][1])]
    else:
        scaled = [(x / safe, axes) for x, axes in parts]
    return biggest * _reduce(scaled, lambda x: jnp.abs(x) ** p) ** (1 / p)


def _fast_is_exact(value: jax.Array, m: Measure) -> jax.Array:
    """Where the direct result can be trusted."""
    if m.kind == "norm" and m.p not in (1, 2):
        return jnp.ones(value.shape, bool)
    finite = jnp.isfinite(value)
    if m.kind in ("std", "var") or m.p == 2:
        # Below 2**(minexp/4) (2.3e-10 in float32) squares of the unit's
        # smaller elements may have flushed to zero; a zero may be an
        # underflow. Both are measured again, scaled.
        floor = 2.0 ** (jnp.finfo(value.dtype).minexp // 4)
        return finite & (value >= floor)
    return finite


def _scaled(parts: Sequence[Part], m: Measure, count: int, fast: jax.Array) -> Size:
    """The measure of inputs divided by a power of two near each unit's maximum."""
    if len(parts) > 1 and m.kind in ("norm", "mad", "sum"):
        return _scaled_sum(parts, m, count, fast)
    biggest = _reduce(parts, jnp.abs, jnp.max)
    finfo = jnp.finfo(biggest.dtype)
    _, k = split_exponent(biggest)
    # |x| * 2**-k is at most 1; k is kept where 2**-k is a normal number.
    k = jnp.clip(k, finfo.minexp + 2, finfo.maxexp - 2)
    down = pow2(-k, biggest.dtype)
    if len(parts) == 1:
        scaled = [(parts[0][0] * down.astype(parts[0][0].dtype), parts[0][1])]
    else:
        # One copy of the factor per part: XLA:CPU would otherwise share one
        # broadcast of it between the parts of a shape and write it to memory.
        downs = jax.lax.optimization_barrier([down.astype(x.dtype) for x, _ in parts])
        scaled = [(x * d, axes) for (x, axes), d in zip(parts, downs, strict=True)]
    mant, exp = split_exponent(_plain(scaled, m, count))
    return Size(mant, exp + k)


def _scaled_sum(parts: Sequence[Part], m: Measure, count: int, fast: jax.Array) -> Size:
    """`_scaled` for a measure summed over several parts (a 1- or 2-norm, `mad`, `sum`).

    The direct result `fast` says how the sum left the range, so one power of
    two scales every part in one pass: up if it is finite but below the floor
    of `_fast_is_exact` (every element is then that small), down if it is
    not finite (so that the largest float's terms cannot overflow), not at
    all if it was exact. Powers of two scale exactly: the sum is the one the
    direct way would give with an unlimited range, except for terms far below
    one unit in the last place of the result. The factor comes from `fast`,
    an operand of the conditional: a factor from a maximum over all the parts
    (as for a single part) would be recomputed by XLA inside each part's
    fusion, a program that grows with the square of the number of leaves.
    """
    finfo = jnp.finfo(real_dtype(parts[0][0].dtype))
    degree = 2 if m.kind == "norm" and m.p == 2 else 1
    fn: Callable[[jax.Array], jax.Array]
    if degree == 2:
        fn = _squares
    elif m.kind == "sum":
        fn = lambda x: x  # noqa: E731
    else:
        fn = jnp.abs
    # The largest sum the scaled terms may reach: 2**room, with 2 * count terms
    # (real and imaginary parts) each at most 2**(room - bits).
    room = finfo.maxexp - 2 - (2 * count).bit_length()
    down = finfo.maxexp - room // degree
    up = room // 2 - finfo.minexp // 4
    k = jnp.where(
        _fast_is_exact(fast, m),
        0,
        jnp.where(jnp.isfinite(fast), -up, down),
    ).astype(jnp.int32)
    # One copy of the factor per part: XLA:CPU would otherwise share one
    # broadcast of it between the parts of a shape and write it to memory (a
    # temporary as large as the largest leaves; measured 9.7 MB on the
    # transformer tree of benchmarks/fused.py, none with the copies).
    factor = pow2(-k, finfo.dtype)
    groups = trees.stack_vectors([x for x, _ in parts])
    factors = jax.lax.optimization_barrier([factor.astype(x.dtype) for x in groups])
    sums = [jnp.sum(fn(x * f)) for x, f in zip(groups, factors, strict=True)]
    total = jnp.sum(jnp.stack(sums))
    if m.kind == "mad":
        value = total / count
    elif m.kind == "sum":
        value = jnp.abs(total)
    elif degree == 2:
        value = _sqrt(total)
    else:
        value = total
    mant, exp = split_exponent(value)
    return Size(mant, exp + k)


def measure(
    units: Sequence[Sequence[Part]],
    m: Measure,
    then: Callable[[list[Size]], Any] = lambda sizes: sizes,
) -> Any:
    """The size of every unit of every entry of `units`, exact over the whole float range.

    Each entry is a list of parts forming units together (one part for the
    units of one leaf; all leaves for a global measure). Parts must be non-empty
    and in their compute dtype. One `lax.cond` chooses, for the whole call,
    between the direct results and the scaled recomputation. Returns
    `then(sizes)`, computed inside that conditional: scalars that every leaf
    reads afterwards (a global unit's factors) are then its outputs, computed
    once; computed after it, XLA would repeat them inside each leaf's fusion.
    """
    counts = [
        math.prod(parts[0][0].shape[a] for a in parts[0][1])
        if len(parts) == 1
        else sum(x.size for x, _ in parts)
        for parts in units
    ]
    fast = [_plain(parts, m, n) for parts, n in zip(units, counts, strict=True)]
    as_sizes = [Size(*split_exponent(v)) for v in fast]
    if not units or (m.kind == "norm" and m.p not in (1, 2)):
        return then(as_sizes)
    exact = jnp.all(jnp.stack([jnp.all(_fast_is_exact(v, m)) for v in fast]))

    def rescaled() -> Any:
        return then(
            [_scaled(parts, m, n, v) for parts, n, v in zip(units, counts, fast, strict=True)]
        )

    if not isinstance(exact, jax.core.Tracer):
        # Eagerly, a cond would be traced and compiled again on every call.
        return then(as_sizes) if bool(exact) else rescaled()
    # The ordinary case is the false branch (index 0), as in `accumulate`'s
    # conditionals, so that a reading of the branches that run takes it.
    return jax.lax.cond(
        ~exact,
        rescaled,
        lambda: then(as_sizes),
    )


def ratio_factors(target: jax.Array, size: Size) -> tuple[jax.Array, jax.Array]:
    """Factors `(a, b)` with `x * a * b == x * target / size`, neither flushing nor overflowing.

    `a` is a power of two near `1 / size`, so `x * a` stays in range for every
    element of the unit; `b` is close to `target`. Zero sizes give `(1, 1)`;
    a NaN size gives a NaN `b`, and an infinite one `b = 0`, which make the
    unit what `x * target / size` makes it (NaN; zeros and NaN for infinities).
    """
    finfo = jnp.finfo(size.mant.dtype)
    k = jnp.clip(size.exp, finfo.minexp + 2, finfo.maxexp - 2)
    dtype = size.mant.dtype
    nonzero = size.mant != 0
    a = jnp.where(nonzero, pow2(-k, dtype), 1)
    rest = jnp.clip(k - size.exp, finfo.minexp, finfo.maxexp - 1)
    b = jnp.where(nonzero, target / jnp.where(nonzero, size.mant, 1) * pow2(rest, dtype), 1)
    return a, b


def apply_factors(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """`x * a * b` in `x`'s dtype (real factors keep a complex `x` complex)."""
    dtype = real_dtype(x.dtype)
    return x * a.astype(dtype) * b.astype(dtype)


Ord = int | float | Literal["mad", "std", "var", "sum", "l0", "l1", "l2", "l3", "l4", "linf"]


Dim = int | Sequence[int] | Literal["global"] | None


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
