"""Tree helpers that every family uses: counters, the finite check, arrays, dtypes, zeros.

Nothing here knows about windows, gates or sharding; the window engine
(`gradaccum_jax._window.engine`), batching and clipping build on these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax


def counter() -> jax.Array:
    """A fresh `int32` zero for a counter field.

    Fresh for each field: fields that share one buffer cannot all be donated
    ("donate the same buffer twice").
    """
    return jnp.zeros([], jnp.int32)


def increment_if(counter: jax.Array, predicate: jax.Array) -> jax.Array:
    """`counter + 1` where `predicate` holds, saturating at the dtype's maximum."""
    return jnp.where(predicate, optax.safe_increment(counter), counter)


def stack_vectors(xs: Sequence[jax.Array]) -> list[jax.Array]:
    """`xs` with its vectors stacked, one matrix per shape, dtype and sharding, for a reduction.

    XLA:CPU reduces a vector in three kernels (the elementwise part, a
    windowed reduction, a last one) and a matrix in one. A transformer's
    norms and biases are two thirds of its leaves; reduced one by one in
    `clip_norm`'s rescaling branch they made two thirds of that branch's
    program, and half of `clip_norm`'s compile time. Stacked, each shape
    costs one reduction. The stack is a temporary, so it holds at most
    `max(2**16, n // 32)` of the `n` elements of `xs` (XLA:CPU fuses it into
    the reduction: no temporary at all on the trees of
    benchmarks/compile_time.py); vectors beyond that stay apart. Vectors
    are stacked only with vectors of the same shape, dtype and explicit
    sharding: a stack of vectors sharded alike is sharded like them, and
    needs no communication. Under `jit` with
    shardings that the types do not show (`AxisType.Auto`), vectors of one
    shape sharded along different axes are resharded for the stack: so it is
    used only in branches that ordinary steps skip (the rescaling of a norm
    whose squares leave the float range, the exact finite check behind a sum
    of squares that is not finite).
    """
    budget = max(1 << 16, sum(x.size for x in xs) // 32)
    out: list[jax.Array] = []
    stacks: dict[Any, list[jax.Array]] = {}
    used = 0
    for x in xs:
        if x.ndim == 1 and used + x.size <= budget:
            key = (x.shape, x.dtype, str(getattr(jax.typeof(x), "sharding", None)))
            stacks.setdefault(key, []).append(x)
            used += x.size
        else:
            out.append(x)
    return out + [jnp.stack(g) if len(g) > 1 else g[0] for g in stacks.values()]


def all_finite(tree: Any) -> jax.Array:
    """A boolean scalar: whether every element of every leaf of `tree` is finite."""
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(tree) if jnp.size(leaf)]
    if not leaves:
        return jnp.array(True)
    # max(|x|) propagates NaN and is finite iff every element is; XLA:CPU
    # reduces it about twice as fast as all(isfinite(x)). sum(x * 0), NaN iff
    # an element is not finite, is no faster there, and its XLA:CPU (YNNPACK)
    # reduction reads a materialised zero tensor beside x.
    return all_finite_of(jnp.max(_largest_part(leaf)) for leaf in leaves)


def _largest_part(x: jax.Array) -> jax.Array:
    # |x| of a complex element overflows when its parts are finite but large
    # (|3e38 + 3e38j| is inf in complex64); the larger part's magnitude does not.
    if jnp.iscomplexobj(x):
        return jnp.maximum(jnp.abs(x.real), jnp.abs(x.imag))
    return jnp.abs(x)


def all_finite_of(scalars: Any) -> jax.Array:
    """Whether every one of some per-leaf scalars is finite, computed once for all leaves.

    The scalars are stacked before the test: XLA turns a reduction over
    separately tested scalars into a chain of `and`s, which it then copies
    into every fusion that reads the flag (each leaf's add): a program that
    grows with the square of the number of leaves. A reduction over the
    tested vector stays one instruction that every reader shares.
    """
    return jnp.all(jnp.isfinite(jnp.stack(list(scalars))))


def all_finite_by_squares(tree: Any) -> jax.Array:
    """`all_finite(tree)`, decided in the ordinary case by each leaf's sum of squares.

    A sum of squares is finite only if every element is (a NaN or an infinity
    makes it NaN or infinite); one that is not (a non-finite element, or
    float32 elements above about 1.8e19 whose squares overflow) is decided by
    `all_finite` of the leaves with their vectors stacked (`stack_vectors`),
    in a conditional that the ordinary case skips. The answer is
    `all_finite`'s in every case. XLA:CPU reduces squares faster than
    `max(|x|)`: 7.4 ms against 9.2 ms over the 168 MB of the transformer
    tree of benchmarks/fused.py.

    Compiled for TPU the check is `_all_finite_leaf_by_leaf` instead, the same
    answer in the form that compiler keeps small (`jax.lax.platform_dependent`:
    the form is picked when the program is lowered; each compiler sees one).
    """
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(tree) if jnp.size(leaf)]
    if not leaves:
        return jnp.array(True)
    return jax.lax.platform_dependent(
        leaves, tpu=_all_finite_leaf_by_leaf, default=_all_finite_by_squares
    )


def _all_finite_leaf_by_leaf(leaves: list[jax.Array]) -> jax.Array:
    """Whether every leaf is finite: each leaf's `max(|x|)` tested alone, the flags and-ed.

    The form the TPU compiler keeps small: it leaves the flags and their `and`s
    on its scalar unit, and `max(|x|)` cannot overflow, so no exact fallback (a
    conditional holding the gradient) is needed. The sums of squares cost v5e
    temp per leaf, not per byte: 6.6 MB for 32 leaves of 8 kB or of 512 kB alike
    through `apply_gradients` (tests/test_tpu_micro_step.py). XLA:CPU reduces
    squares faster and copies such a chain of `and`s into every reader of the
    flag (`all_finite_of`).
    """
    return jnp.all(jnp.stack([jnp.isfinite(jnp.max(_largest_part(leaf))) for leaf in leaves]))


def _all_finite_by_squares(leaves: list[jax.Array]) -> jax.Array:
    """`all_finite_by_squares` of non-empty leaves on XLA:CPU and XLA:GPU."""

    def squares(x: jax.Array) -> jax.Array:
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        return jnp.square(x.real) + jnp.square(x.imag) if jnp.iscomplexobj(x) else jnp.square(x)

    quick = all_finite_of(jnp.sum(squares(leaf)) for leaf in leaves)
    # The ordinary case is the false branch (index 0). Both branches compute
    # from operands, so that they vary alike between replicas in shard_map.
    return jax.lax.cond(
        ~quick, lambda g, q: all_finite(stack_vectors(g)), lambda g, q: q, leaves, quick
    )


def as_arrays(tree: Any) -> Any:
    """`tree` with Python scalars turned into arrays, as optax's own transforms accept them.

    `jax.ShapeDtypeStruct` leaves stay as they are: `init` on abstract params (to
    build a state without materialising the params) needs only shapes and dtypes.
    """
    return jax.tree.map(
        lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jnp.asarray(x), tree
    )


def accumulator_dtype(leaf: Any, requested: Any) -> jnp.dtype:
    """The dtype in which gradients shaped like `leaf` are summed.

    `None` keeps float32 and wider dtypes and sums 16-bit gradients in float32
    (a bfloat16 sum of K terms loses about log2(K) of its 8 mantissa bits).
    Complex leaves are summed in the complex counterpart of the requested
    precision (float32 -> complex64, float64 -> complex128), as optax keeps
    complex parameters complex: a real accumulator would drop the imaginary part.
    """
    leaf_dtype = jnp.result_type(leaf)
    dtype = jnp.promote_types(leaf_dtype, jnp.float32) if requested is None else requested
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(leaf_dtype, jnp.complexfloating):
        dtype = jnp.promote_types(dtype, jnp.complex64)
    return dtype


def weight_dtype(acc: Any) -> jnp.dtype:
    """The dtype of a window's weight: float32, or float64 beside a float64 accumulator.

    A ratio of weights rounded to float32 would limit a float64 window's mean to
    float32 precision.
    """
    real = [jnp.finfo(leaf.dtype).dtype for leaf in jax.tree.leaves(acc)]
    return jnp.dtype(jnp.result_type(jnp.float32, *real))


def zeros(params: Any, requested: Any) -> Any:
    """An empty accumulator for gradients shaped like `params`."""

    def leaf_zeros(p):
        dtype = accumulator_dtype(p, requested)
        if isinstance(p, jax.ShapeDtypeStruct):
            return jnp.zeros(p.shape, dtype, device=p.sharding)
        # zeros_like keeps each param's sharding (explicit mesh axes, or the
        # varying axes under shard_map), so the accumulator shards like it.
        return jnp.zeros_like(p, dtype)

    return jax.tree.map(leaf_zeros, params)
