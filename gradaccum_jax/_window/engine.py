"""The window engine shared by the accumulating transformations.

Every accumulating transformation of this package (`accumulate`,
`conditional_accumulate`, `split_accumulate`) runs the same five steps on each
call of `update`:

1. **accept**: decide whether this micro-step's contribution joins the window
   (`trees.all_finite`, plus each transform's own rules such as staleness);
2. **add**: the contribution's term, `scale * g` in the accumulator dtype,
   plainly or with a Kahan compensation, added in place before the gate
   (`write` with `reset=None`), so that the gate never takes the gradient;
3. **gate**: a `jax.lax.cond` with two named branches, *apply* (reduce the
   window once, run the inner transformation once) and *skip* (zeros, inner
   state passed through), see `close`;
4. **write**: the window emptied at its end by a second conditional on the
   `reset` flag the first returns (which orders it after the apply branch's
   reads), or, for the transforms that add after the gate, one fused pass
   that adds or resets (`write`);
5. **count**: saturating `int32` counters (`trees.increment_if`).

The conditional only *reads* the accumulator and passes the inner state
through untouched on the skip branch; the accumulator is written in place,
outside it. With that layout XLA aliases the inner state and the accumulator
instead of copying them (tests/test_accumulation.py checks the compiled
program).

The reduction at the window's close is one function, `Gate.reduce`, from a
`Window` (the tree of window sums and its scalars) to the reduced `Window`:
the identity on one device (`local_gate`), one `psum` of everything across
replicas (`replica_gate`). A new way of closing a window is a new `Gate`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax._base import collectives, compat
from gradaccum_jax._window import parts

# --- counters and acceptance ------------------------------------------------


# --- the accumulator ----------------------------------------------------------


def _term(grad: jax.Array, dtype: jnp.dtype, scale: jax.Array | None) -> jax.Array:
    term = grad.astype(dtype)
    return term if scale is None else term * scale.astype(dtype)


def _compensated_total(acc, comp, grad, accepted, scale, keep=None):
    wide = jnp.promote_types(acc.dtype, jnp.float32)
    held = acc.astype(wide) + comp.astype(wide)
    kept = held if keep is None else held * keep.astype(wide)
    return jnp.where(accepted, kept + _term(grad, wide, scale), held)


def _kept_total(a, grad, accepted, scale, keep):
    """`keep * a + scale * g` formed in float32 (at least), rounded once to `a`'s dtype."""
    wide = jnp.promote_types(a.dtype, jnp.float32)
    total = a.astype(wide) * keep.astype(wide) + _term(grad, wide, scale)
    return jnp.where(accepted, total.astype(a.dtype), a)


def window_total(
    acc: Any,
    comp: Any,
    grads: Any,
    accepted: jax.Array,
    scale: jax.Array | None,
    keep: jax.Array | None = None,
) -> Any:
    """The window's sum including this micro-step's term `scale * g` (if accepted).

    Read-only: the apply branch calls it, the accumulator is written by `write`.
    With a compensation tree `comp` the sum `acc + comp` is formed in float32.
    `keep` (a scalar, `None` for 1) rescales the held sum first, in the same pass:
    a window held as a running mean (float16 sums with weights) shrinks its
    sum as its total weight grows.
    """
    if comp is None and keep is None:
        return jax.tree.map(
            lambda a, g: jnp.where(accepted, a + _term(g, a.dtype, scale), a), acc, grads
        )
    if comp is None:
        return jax.tree.map(lambda a, g: _kept_total(a, g, accepted, scale, keep), acc, grads)
    return jax.tree.map(
        lambda a, c, g: _compensated_total(a, c, g, accepted, scale, keep), acc, comp, grads
    )


def write(
    acc: Any,
    comp: Any,
    grads: Any,
    accepted: jax.Array,
    scale: jax.Array | None,
    reset: jax.Array | None,
    keep: jax.Array | None = None,
) -> tuple[Any, Any]:
    """Adds this micro-step's term, or resets to zero where `reset`: one fused in-place pass.

    `reset` (if not `None`) must be an output of the conditional: depending on
    it schedules this write after the branch has read the old accumulator
    (with the predicate instead, XLA may run it first and must copy the
    accumulator). The reset writes fresh zeros, never a product with zero
    (NaN * 0 = NaN). With `reset=None` it is the add alone, which
    `accumulate` runs before its conditional. `keep` as in `window_total`.
    """
    if comp is None:
        total = window_total(acc, None, grads, accepted, scale, keep)
        if reset is None:
            return total, None
        return jax.tree.map(lambda a, t: jnp.where(reset, jnp.zeros_like(a), t), acc, total), None

    def split(a, c, g):
        total = _compensated_total(a, c, g, accepted, scale, keep)
        finfo = jnp.finfo(a.dtype)
        # Rounded with reduce_precision, not with a cast: the high part is then
        # exactly representable, and XLA's licence to drop a float32 -> 16-bit
        # -> float32 convert pair (excess precision) cannot turn the remainder
        # into zero.
        high = jax.lax.reduce_precision(total, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)
        high, low = high.astype(a.dtype), (total - high).astype(a.dtype)
        if reset is None:
            return high, low
        zero = jnp.zeros_like(a)
        return jnp.where(reset, zero, high), jnp.where(reset, zero, low)

    pairs = jax.tree.map(split, acc, comp, grads)
    is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
    return (
        jax.tree.map(lambda hl: hl[0], pairs, is_leaf=is_pair),
        jax.tree.map(lambda hl: hl[1], pairs, is_leaf=is_pair),
    )


def window_sum(acc: Any, comp: Any) -> Any:
    """The window's sum held in `acc` (plus its compensation `comp`, in float32)."""
    if comp is None:
        return acc

    def pair(a, c):
        wide = jnp.promote_types(a.dtype, jnp.float32)
        return a.astype(wide) + c.astype(wide)

    return jax.tree.map(pair, acc, comp)


def emptied(tree: Any, reset: jax.Array | list[jax.Array]) -> Any:
    """Zeros like `tree`, for the branch taken on `reset` (a traced flag): a write, no read.

    Each leaf's zero is computed from a traced flag, so that XLA does not
    hoist the zeros out of the branch, and must differ from the other leaves'
    so that XLA does not merge equal-shaped ones into one buffer that it
    would then copy. `reset` is either one flag per leaf (`close` passes
    copies of it that are distinct operands of the conditional: the zeros
    are then the same program for every leaf of a shape, compiled once), or
    one flag, combined with the leaf's index (`distinct_zero`: a different
    program per leaf, which XLA compiles one by one).
    """
    leaves, treedef = jax.tree.flatten(tree)
    if isinstance(reset, list):
        seeds = [distinct_zero(flag, 0) for flag in reset]
    else:
        seeds = [distinct_zero(reset, i) for i in range(len(leaves))]
    zeros = [
        jax.lax.full_like(leaf, seed, leaf.dtype) for leaf, seed in zip(leaves, seeds, strict=True)
    ]
    return jax.tree.unflatten(treedef, zeros)


# --- the window length ---------------------------------------------------------


def window_length(
    schedule: int | Callable[[jax.Array], Any], step: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The window length `K` at `step` as an `int32` scalar, and whether it was clamped.

    `schedule` is an int or a callable of the optimizer step. A concrete value
    below 1 raises; a traced one cannot raise inside `jit`, so it is taken as 1
    and the second output (a boolean scalar) says so, for the caller to count.
    """
    if not callable(schedule):
        return jnp.int32(schedule), jnp.array(False)
    k = schedule(step)
    k_dtype = jnp.result_type(k)
    if jnp.issubdtype(k_dtype, jnp.bool_) or not jnp.issubdtype(k_dtype, jnp.integer):
        raise TypeError(
            "every_k_schedule must return an integer window length; it returned "
            f"{k!r} (dtype {k_dtype}) for gradient_step={step!r}. Round it, e.g. "
            "lambda step: jnp.int32(...)."
        )
    if jnp.ndim(k) != 0:
        raise ValueError(
            f"every_k_schedule must return a scalar; it returned shape {jnp.shape(k)}."
        )
    if not isinstance(k, jax.core.Tracer) and int(k) < 1:
        raise ValueError(
            f"every_k_schedule must return a window length >= 1; it returned {int(k)} "
            f"at gradient_step={step!r}."
        )
    k = jnp.asarray(k, jnp.int32)
    return jnp.maximum(k, 1), k < 1


# --- the gate ------------------------------------------------------------------


class Window(NamedTuple):
    """What a window hands to its close: the sums and the scalars reduced with them.

    Attributes:
      total: The tree of window sums `Σ (w / unit) · g`.
      weight: `float32[]`, `Σ w / unit`: the mean is `total / weight`.
      unit: `float32[]`, the unit in which the weights are held; the window's
        sum in the gradients' units is `total * unit`.
      stats: `None`, or a tree of `float32` scalars that travel with the sums
        in the same reduction and are summed across replicas as they are
        (already in absolute units): the noise-scale measurements.
    """

    total: Any
    weight: jax.Array
    unit: jax.Array
    stats: Any = None


class Gate(NamedTuple):
    """How a window closes.

    Attributes:
      cond: `jax.lax.cond`, or a replacement with the same signature.
      reduce: The one reduction at the window's close, `Window -> Window`,
        called once inside the apply branch.
      decides_locally: Whether "anything accepted in the window" is known
        before `reduce` (on one device), or only after it (across replicas,
        where another replica may have accepted what this one dropped).
      zeros_like: `(leaf, dtype, zero) -> zeros` for the skip branch's
        updates: `zero` (a `float32[]` zero, see `distinct_zero`) broadcast to
        the leaf's shape in `dtype`.
    """

    cond: Callable[..., Any]
    reduce: Callable[[Window], Window]
    decides_locally: bool
    zeros_like: Callable[[jax.Array, Any, jax.Array], jax.Array]


def local_gate() -> Gate:
    """The gate of a window on one device (or under `jit` with sharded arrays)."""
    return Gate(
        cond=jax.lax.cond,
        reduce=lambda window: window,
        decides_locally=True,
        # full_like keeps the leaf's sharding, as zeros_like does.
        zeros_like=lambda leaf, dtype, zero: jnp.full_like(leaf, zero, dtype),
    )


def replica_gate(axis_names: tuple[Any, ...], typed: bool) -> Gate:
    """The gate of a window held per replica and reduced across `axis_names` at its close.

    The only collective of the whole step is one `psum` of the window sums
    and weights, on the close only. The product `total * unit` is formed, and
    the reduced sum kept, in float32 for float16 sums, whose range would
    overflow with large weights or many replicas.
    """

    def reduce(window: Window) -> Window:
        def in_units(t):
            wide = jnp.float32 if t.dtype == jnp.float16 else t.dtype
            return t.astype(wide) * window.unit.astype(wide)

        total, weight, stats = collectives.psum(
            (jax.tree.map(in_units, window.total), window.weight * window.unit, window.stats),
            axis_names,
            typed,
        )
        # float16 sums stay in float32: the replicas' sum in absolute units may
        # exceed 65504 (the window's mean is formed in float32 in any case).
        total = jax.tree.map(
            lambda t, old: t if old.dtype == jnp.float16 else t.astype(old.dtype),
            total,
            window.total,
        )
        # Fresh ones, not ones_like: they must not vary between replicas.
        return Window(total=total, weight=weight, unit=jnp.ones([], jnp.float32), stats=stats)

    def cond(pred, true_fn, false_fn, *operands):
        return collectives.cond(pred, true_fn, false_fn, *operands, typed=typed)

    # The gradients vary between replicas but the reduced updates do not;
    # zeros without varying axes keep the updates (and the params they are
    # applied to) replica-invariant under shard_map.
    return Gate(
        cond=cond,
        reduce=reduce,
        decides_locally=False,
        zeros_like=collectives.zeros_without_axes,
    )


Step = Callable[[Window, Any], tuple[Any, Any]]


def distinct_zero(seed: jax.Array, index: int) -> jax.Array:
    """A `float32[]` zero computed from `seed` and `index`, which XLA cannot fold.

    The skip branch returns one zero tree per update leaf, each in its own
    output buffer of the conditional. Zeros broadcast from the constant 0 are
    all equal for equal-shaped leaves: XLA merges them into one buffer and
    then copies it into every output but one, an extra parameter-sized pass
    per duplicate. `(seed + index) * 0` differs for each `index`, and XLA does
    not fold a float product with zero (`NaN * 0` is NaN), so each leaf's
    zeros are written straight into its output. `seed` must be a traced
    boolean or integer scalar, so that its float value is finite and the
    product an exact `+0.0`.
    """
    # lax, not jnp: the same four operations, traced without jnp's dispatch,
    # once per leaf of the accumulator (a sixth of the trace of a window).
    magnitude = jax.lax.abs(jax.lax.convert_element_type(seed, jnp.float32))
    return jax.lax.mul(jax.lax.add(magnitude, np.float32(index)), np.float32(0.0))


def _shape_dtype(x: Any) -> jax.ShapeDtypeStruct:
    sharding = jax.typeof(x).sharding
    return jax.ShapeDtypeStruct(
        jnp.shape(x), jnp.result_type(x), sharding=sharding if _typed(sharding) else None
    )


def _typed(sharding: Any) -> bool:
    """Whether `sharding` is part of its array's type: a mesh of Explicit axes, outside
    `jax.shard_map`."""
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return jax.sharding.AxisType.Explicit in types and jax.sharding.AxisType.Manual not in types


def _typed_like(x: jax.Array, spec: jax.ShapeDtypeStruct) -> jax.Array:
    """`x` resharded as `spec` where the sharding is part of the type.

    The skip branch's zeros take the sharding of the leaves they stand for (the
    gradients), the apply branch's updates that of the inner optimizer's arithmetic:
    Adam's moments, initialized from params sharded for FSDP, shard the updates of a
    replicated gradient like the params. Both branches of the conditional must have
    one type.
    """
    sharding: Any = getattr(spec, "sharding", None)
    want = sharding.spec if _typed(sharding) else None
    if want is None or jax.typeof(x).sharding.spec == want:
        return x
    return compat.reshard(x, want)


def close(
    gate: Gate,
    closes: jax.Array,
    operand: Any,
    inner_state: Any,
    weight: jax.Array,
    unit: jax.Array,
    *,
    total: Callable[[Any], Any],
    step: Step,
    like: Any,
    stats: Any = None,
    params: Any = None,
    empty: Callable[[Any, jax.Array], Any] | None = None,
) -> tuple[Any, Any, Any, jax.Array, jax.Array]:
    """The gate: runs `step` once if the window `closes` with something accepted.

    Args:
      gate: How the window closes (`local_gate` or `replica_gate`).
      closes: Boolean scalar, whether this micro-step ends the window.
      operand: The accumulator, only read (by `total`) inside the apply branch.
      inner_state: Passed through untouched by the skip branch.
      weight: `float32[]` (float64 beside a float64 accumulator), the window's weight
        including this micro-step, in units.
      unit: `float32[]` unit of the weights.
      total: `operand -> tree of window sums`, including this micro-step.
      step: `(reduced Window, inner_state) -> (updates, new inner_state)`.
      like: A tree shaped like the updates (the gradients), for the skip
        branch's zeros, which take the dtypes `step` returns.
      stats: `Window.stats`, reduced with the sums (`None`: nothing more).
      params: `None`, or the params for the fused path (`apply_gradients`):
        an operand of the conditional that `step` (called as
        `step(window, inner_state, params)`) returns updated and the skip
        branch returns untouched, so that in a donated step they stay in
        place on the micro-steps. The first output is then the new params.

      empty: `None`, or `(operand, reset) -> operand zeroed where reset`: the window's sums are
        then added before the conditional (`operand` holds them, this
        micro-step included), and the apply branch returns them emptied while
        the skip branch passes them through untouched. The conditional takes
        no gradient: a gradient computed in the step (scaled by a clip) is
        then fused into the add instead of being written to a buffer.

    Returns:
      `(updates, inner_state, operand, reset, applied)`: `operand` is the
      sums after the window (`None` without `empty`); `reset` (the window
      ends) is an output of the conditional, for `write` to depend on;
      `applied` says whether `step` ran on an accepted window. With
      `params`, the new params instead of `updates`.
    """
    fused = params is not None

    # The updates' shapes and dtypes, for the skip branches' zeros. jax.lax.cond
    # traces its true branch (apply) first, and `step_on` records them there:
    # tracing the inner update again only for its shapes (jax.eval_shape) took a
    # third of the trace of an adamw window. The fallback covers a skip branch
    # traced alone or first.
    specs: list[Any] = []

    def skip_like(spec_of, seed, params):
        if fused:
            return params
        spec = specs[0] if specs else spec_of()
        leaves, treedef = jax.tree.flatten(like)
        spec_leaves, spec_def = jax.tree.flatten(spec)
        if spec_def != treedef:
            # The inner optimizer returns another tree than the gradients (optax.lookahead:
            # fast and slow updates): its own output gives the zeros their shapes.
            leaves, treedef = spec_leaves, spec_def
        zeros = [
            _typed_like(gate.zeros_like(g, s.dtype, distinct_zero(seed, i)), s)
            for i, (g, s) in enumerate(zip(leaves, spec_leaves, strict=True))
        ]
        return treedef.unflatten(zeros)

    def step_on(window, inner_state, params):
        out = step(window, inner_state, params) if fused else step(window, inner_state)
        if not specs:
            specs.append(jax.tree.map(_shape_dtype, out[0]))
        return out

    def apply_branch(operand, inner_state, closes, weight, unit, stats, params):
        del closes
        window = gate.reduce(Window(total(operand), weight, unit, stats))
        if gate.decides_locally:
            updates, new_inner = step_on(window, inner_state, params)
            return updates, new_inner, jnp.array(True), jnp.array(True)

        def nothing(window, inner_state, params):
            def spec_of():
                return jax.eval_shape(step_on, window, inner_state, params)[0]

            return skip_like(spec_of, window.weight > 0, params), inner_state

        accepted = window.weight > 0
        updates, new_inner = gate.cond(accepted, step_on, nothing, window, inner_state, params)
        return updates, new_inner, jnp.array(True), accepted

    operands = (operand, inner_state, closes, weight, unit, stats, params)

    def skip_branch(operand, inner_state, closes, weight, unit, stats, params):
        def spec_of():
            return jax.eval_shape(apply_branch, *operands)[0]

        del operand, weight, unit, stats
        # A window with nothing accepted still ends on schedule (reset = closes).
        return skip_like(spec_of, closes, params), inner_state, closes, jnp.array(False)

    # On one device a window with nothing accepted is known before the branch
    # and takes the skip branch.
    predicate = closes & (weight > 0) if gate.decides_locally else closes
    if isinstance(predicate, jax.core.Tracer):
        updates, new_inner, reset, applied = gate.cond(
            predicate, apply_branch, skip_branch, *operands
        )
    else:
        # Known when tracing (a static window of one, nothing to check): no conditional.
        branch = apply_branch if bool(predicate) else skip_branch
        updates, new_inner, reset, applied = branch(*operands)
    if empty is None:
        return updates, new_inner, None, reset, applied
    # Emptied in a conditional of its own, on `reset` (an output of the first):
    # ordered after the apply branch's reads, it writes in place, and its pass
    # through is free. Emptied inside the apply branch, the sums would need a
    # second buffer and a copy on every micro-step.
    # One copy of `reset` per leaf of the sums, each its own operand of the
    # conditional (`emptied`): the barrier keeps JAX from passing them as one.
    seeds = jax.lax.optimization_barrier([reset] * len(jax.tree.leaves(operand)))
    held = gate.cond(reset, empty, lambda held, seeds: held, operand, seeds)
    return updates, new_inner, held, reset, applied


# --- the inner update ------------------------------------------------------------


def keep_state_types(new: Any, old: Any, who: str) -> Any:
    """`new` cast to the floating dtypes of `old`, or a `TypeError` naming the leaf.

    The skip branch passes the old state through, so both branches must give
    the state of `init`'s structure, shapes and dtypes; and a state whose
    dtypes drift would not survive `jax.lax.scan` or donation. A floating leaf
    whose dtype the update changed (adam's moments on 16-bit params meet
    float32 gradients) is cast back, as `optax.MultiSteps` does.
    """
    new_def, old_def = jax.tree.structure(new), jax.tree.structure(old)
    if new_def != old_def:  # type: ignore[operator]  # jaxlib's PyTreeDef stub
        raise TypeError(
            f"{who}.update returned a state of another structure than {who}.init: "
            f"{new_def} instead of {old_def}. The accumulating transformation keeps the "
            "inner state's structure fixed so that it can be carried through jax.lax.cond "
            "and jax.lax.scan: make the inner transformation return the structure its "
            "init returns."
        )

    def cast(path, n, o):
        n_dtype, o_dtype = jnp.result_type(n), jnp.result_type(o)
        where = f"{who} state leaf {jax.tree_util.keystr(path)}"
        if jnp.shape(n) != jnp.shape(o):
            raise TypeError(
                f"{where} has shape {jnp.shape(o)} after init but {jnp.shape(n)} after "
                "update. The inner transformation must keep its state's shapes: "
                "initialise the leaf in the shape update returns."
            )
        if n_dtype == o_dtype:
            return n
        same_kind = any(
            jnp.issubdtype(n_dtype, kind) and jnp.issubdtype(o_dtype, kind)
            for kind in (jnp.floating, jnp.complexfloating)
        )
        if not same_kind:
            raise TypeError(
                f"{where} has dtype {o_dtype} after init but {n_dtype} after update. "
                "Floating leaves are cast back to their init dtype, other changes "
                "cannot be: initialise the leaf in the dtype update returns."
            )
        return jnp.asarray(n).astype(o_dtype)

    return jax.tree_util.tree_map_with_path(cast, new, old)


def inner_update(
    inner: optax.GradientTransformationExtraArgs,
    reduced: Any,
    inner_state: Any,
    grads: Any,
    params: Any,
    extra_args: dict[str, Any],
    check_parts: bool = False,
) -> tuple[Any, Any]:
    """Runs `inner` once on the window's reduced gradient.

    With `check_parts` (a replica window inside `jax.shard_map` with types checked), an
    inner transformation that reduces a gradient held in parts on other mesh axes is
    refused (`parts.check_elementwise`).

    The inner transformation receives the reduced gradient in the gradients'
    dtype (what it would receive without accumulation, and what
    `optax.MultiSteps` feeds it); its updates are returned in the dtype it
    returns them in, and its new state is cast back to the dtypes of its
    `init` (see `keep_state_types`).
    """
    reduced = jax.tree.map(lambda t, g: t.astype(g.dtype), reduced, grads)
    if check_parts:  # a window that may lie in parts on other mesh axes (`_window/parts.py`)
        parts.check_elementwise(
            lambda *args: inner.update(*args, **extra_args), (reduced, inner_state, params)
        )
    updates, new_inner = inner.update(reduced, inner_state, params, **extra_args)
    return updates, keep_state_types(new_inner, inner_state, "inner")
