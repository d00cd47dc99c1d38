"""Split (positive/negative) accumulation with parameter bounds, and a hard clamp."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax._base import compat, trees, validation
from gradaccum_jax._window import engine, placement

_RUNNING_REDUCTIONS = ("sum", "mean", "max", "min", "geometric_mean")
_REDUCTIONS = (*_RUNNING_REDUCTIONS, "median")
_BOUNDS = ("power", "scaled_power", "multiplicative", "scaled_multiplicative", "sharp")
_POWER_BOUNDS = ("power", "scaled_power")
_SCALED_BOUNDS = ("scaled_power", "scaled_multiplicative")
WindowReduction = Callable[[jax.Array, jax.Array], jax.Array]


class SplitAccumulateState(NamedTuple):
    """State of `split_accumulate`.

    Every field keeps its shape and dtype from `init` on (`jax.lax.scan`
    stable, donatable, checkpointable mid-window).

    Attributes:
      micro_step: `int32[]`. Calls already taken in the current window, in
        `[0, K)`.
      gradient_step: `int32[]`. Windows that returned an update (closed with
        at least one accepted contribution); the argument of a callable
        `every_k_schedule`. Saturates at the int32 maximum.
      positive: The positive component's running reduction, a tree shaped like
        the params in the accumulator dtype (for `"geometric_mean"` the sum
        of logs, `-inf` after a zero). For `"median"` or a custom reduction
        it is a buffer of shape `(K, *param.shape)` per leaf holding the
        window's contributions, of which the first `positive_count` are valid.
      negative: The same for the negative component (stored as magnitudes,
        `>= 0` in the sign-split mode).
      positive_count: `int32[]`. Contributions to `positive` in the window.
      negative_count: `int32[]`. Contributions to `negative` in the window.
      num_skipped: `int32[]`. Calls dropped so far because an entry was not
        finite (or negative under `"geometric_mean"` in the paired mode).
        Saturates.
    """

    micro_step: jax.Array
    gradient_step: jax.Array
    positive: optax.Updates
    negative: optax.Updates
    positive_count: jax.Array
    negative_count: jax.Array
    num_skipped: jax.Array


# split_accumulate has no inner transformation: what should see the window's update
# once goes into an accumulate instead.
placement.register_window(
    SplitAccumulateState,
    placement.Window(
        "gradaccum_jax.split_accumulate",
        "ga.accumulate(optax.chain(..., {element}), K) in place of split_accumulate, "
        "or {element} before split_accumulate to run it on every micro-step's update",
    ),
)


def _positive_part(x: jax.Array) -> jax.Array:
    return jnp.maximum(x, 0)


def _negative_part(x: jax.Array) -> jax.Array:
    return jnp.maximum(-x, 0)


def _identity(x: jax.Array) -> jax.Array:
    return x


def _combine(reduction: str, acc: jax.Array, x: jax.Array, count: jax.Array) -> jax.Array:
    """One step of a running reduction; `count` is the count before `x`."""
    x = x.astype(acc.dtype)
    if reduction in ("sum", "mean"):
        return acc + x
    if reduction == "max":
        return jnp.where(count == 0, x, jnp.maximum(acc, x))
    if reduction == "min":
        return jnp.where(count == 0, x, jnp.minimum(acc, x))
    # geometric_mean: a sum of logs; log(0) = -inf is the exact log of a
    # product with a zero factor, and exp(-inf) gives the zero back.
    return acc + jnp.log(x)


def _finish(reduction: str, acc: jax.Array, count: jax.Array) -> jax.Array:
    """Turns a running reduction into the window's value; zero for an empty component."""
    n = jnp.maximum(count, 1).astype(acc.dtype)
    if reduction == "mean":
        value = acc / n
    elif reduction == "geometric_mean":
        value = jnp.exp(acc / n)
    else:
        value = acc
    return jnp.where(count > 0, value, jnp.zeros_like(value))


def _median(values: jax.Array, valid: jax.Array) -> jax.Array:
    # Invalid slots sort last as +inf; the median of the first n sorted values
    # is the mean of the entries at (n - 1) // 2 and n // 2, as numpy's.
    n = jnp.sum(valid.reshape(-1)).astype(jnp.int32)
    ordered = jnp.sort(jnp.where(valid, values, jnp.inf), axis=0)
    low = jax.lax.dynamic_index_in_dim(ordered, jnp.maximum(n - 1, 0) // 2, 0, keepdims=False)
    high = jax.lax.dynamic_index_in_dim(ordered, n // 2, 0, keepdims=False)
    return (low + high) / 2


def _buffer_finish(fn: WindowReduction, buffer: jax.Array, count: jax.Array, k: int) -> jax.Array:
    valid = (jnp.arange(k) < count).reshape((k,) + (1,) * (buffer.ndim - 1))
    value = jnp.asarray(fn(buffer, valid))
    if value.shape != buffer.shape[1:]:
        raise ValueError(
            f"the reduction must return the shape of one contribution, {buffer.shape[1:]}; "
            f"it returned shape {value.shape} for values of shape {buffer.shape}. Reduce "
            "over axis 0 only."
        )
    value = value.astype(buffer.dtype)
    return jnp.where(count > 0, value, jnp.zeros_like(value))


@dataclasses.dataclass(frozen=True)
class _Running:
    """A running reduction: one params-sized array per component, written after the gate.

    The shape of `optax.microbatching`'s accumulators: `init`, `add` one
    contribution, `finalize` the window's value.
    """

    reduction: str

    # Added inside the branch (read) and again after it (write, or reset).
    adds_before_gate: ClassVar[bool] = False

    def init(self, like: Any, dtype: Any) -> jax.Array:
        # Sharded like the param (FSDP), as the accumulator of `accumulate` is.
        return trees.zeros(like, dtype)

    def add(self, acc: jax.Array, x: jax.Array, count: jax.Array, present: jax.Array):
        return jnp.where(present, _combine(self.reduction, acc, x, count), acc)

    def finalize(self, acc: jax.Array, count: jax.Array) -> jax.Array:
        return _finish(self.reduction, acc, count)


@dataclasses.dataclass(frozen=True)
class _Buffered:
    """A buffer of the window's `K` contributions, reduced by `fn` at the window's end.

    The contribution is stored in its slot before the gate, in place (a dropped
    call rewrites the slot's old value). Slots past the count are masked out,
    so the buffer never needs a reset.
    """

    fn: WindowReduction
    length: int

    adds_before_gate: ClassVar[bool] = True

    def init(self, like: Any, dtype: Any) -> jax.Array:
        # One slot per micro-step, each sharded like the param (FSDP).
        sharding = getattr(jax.typeof(like), "sharding", None)
        spec = getattr(sharding, "spec", None)
        if spec is None or getattr(getattr(sharding, "mesh", None), "empty", True):
            return jnp.zeros((self.length, *jnp.shape(like)), dtype)
        return jnp.zeros(
            (self.length, *jnp.shape(like)),
            dtype,
            out_sharding=jax.P(None, *compat.partitions(spec)),
        )

    def add(self, buffer: jax.Array, x: jax.Array, count: jax.Array, present: jax.Array):
        slot = jnp.minimum(count, self.length - 1)
        old = jax.lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)
        new = jnp.where(present, x.astype(buffer.dtype), old)
        return jax.lax.dynamic_update_index_in_dim(buffer, new, slot, 0)

    def finalize(self, buffer: jax.Array, count: jax.Array) -> jax.Array:
        return _buffer_finish(self.fn, buffer, count, self.length)


class _Component(NamedTuple):
    """One component's contribution in this call.

    The source tree, how to take the component from it, whether it is present,
    and the component's count before it.
    """

    source: Any
    part: Callable[[jax.Array], jax.Array]
    present: jax.Array
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count on purpose


def _bound_factor(bound: str | None, distance: jax.Array, exponent: float, span: float | None):
    """The factor multiplying one component, given its distance to the limit."""
    if bound == "sharp":
        # Θ(0) = 0: a parameter exactly at its limit gets no push beyond it.
        return (distance > 0).astype(distance.dtype)
    if span is not None:
        distance = distance / span
    if bound in _POWER_BOUNDS:
        # Odd extension outside the box, where a fractional power of a
        # negative number is undefined: finite, and exponent 1 gives
        # the multiplicative bound exactly.
        return jnp.sign(distance) * jnp.abs(distance) ** exponent
    return distance


class _Bounds(NamedTuple):
    """The bound of `split_accumulate`, checked (`_check_bound`)."""

    bound: str | None
    lower: float | None
    upper: float | None
    lower_exponent: float
    upper_exponent: float
    span: float | None

    def bounded(self, big_p: jax.Array, big_n: jax.Array, p: jax.Array) -> jax.Array:
        """`P - N`, each scaled by its distance from its limit."""
        if self.upper is not None:
            factor = _bound_factor(self.bound, self.upper - p, self.upper_exponent, self.span)
            big_p = factor * big_p
        if self.lower is not None:
            factor = _bound_factor(self.bound, p - self.lower, self.lower_exponent, self.span)
            big_n = factor * big_n
        return big_p - big_n

    def apply(self, big_p: jax.Array, big_n: jax.Array, p: jax.Array) -> jax.Array:
        """One leaf's update, computed in the window's dtype, returned in the param's."""
        return self.bounded(big_p, big_n, p.astype(big_p.dtype)).astype(p.dtype)


def _window_accumulator(reduction: Any, every_k_schedule: Any) -> _Running | _Buffered:
    """The accumulator of a component's window, from `reduction` (checked here)."""
    if callable(reduction):
        window_fn: WindowReduction | None = reduction
    else:
        validation.check_choice("reduction", reduction, _REDUCTIONS)
        window_fn = _median if reduction == "median" else None
    if window_fn is None:
        return _Running(str(reduction))
    if callable(every_k_schedule):
        raise ValueError(
            f"reduction={reduction!r} keeps every contribution of the window and needs a "
            "fixed window length; pass an int every_k_schedule, or a running reduction "
            f"({', '.join(_RUNNING_REDUCTIONS)}) with a schedule."
        )
    return _Buffered(window_fn, int(every_k_schedule))


def _split_updates(updates: Any, params: Any, paired: bool) -> tuple[Any, Any, Any, Any]:
    """The positive and negative sources in `updates`, and how to take each part from them."""
    if not paired:
        validation.check_same_structure("updates", updates, "params", params)
        validation.check_float_tree("updates", updates)
        # The parts are taken where they are used (in the branch, in the
        # accumulator pass) so that XLA fuses them instead of keeping two
        # parameter-sized temporaries alive across the conditional.
        return updates, updates, _positive_part, _negative_part
    if not (isinstance(updates, (tuple, list)) and len(updates) == 2):
        raise TypeError(
            "with paired=True, updates must be a pair (positive, negative) of trees "
            "shaped like the params (None for a missing component); got "
            f"{type(updates).__name__}."
        )
    for name, part in zip(("updates[0] (positive)", "updates[1] (negative)"), updates, strict=True):
        if part is not None:
            validation.check_same_structure(name, part, "params", params)
            validation.check_float_tree(name, part)
    return updates[0], updates[1], _identity, _identity


def _accepted(given: list[Any], skip_nonfinite: bool, nonnegative: bool) -> jax.Array:
    """Whether this call's contribution joins the window: finite, and `>= 0` where required."""
    accepted = jnp.array(True)
    if skip_nonfinite:
        accepted = trees.all_finite(given)
    if nonnegative:
        for part in given:
            for leaf in jax.tree.leaves(part):
                accepted = accepted & jnp.all(leaf >= 0)
    return accepted


def _contributions(
    updates: Any,
    params: Any,
    state: SplitAccumulateState,
    paired: bool,
    skip_nonfinite: bool,
    nonnegative: bool,
) -> tuple[_Component, _Component, jax.Array]:
    """This call's positive and negative components, and whether they join the window."""
    positive, negative, pos_part, neg_part = _split_updates(updates, params, paired)
    given = [src for src in (positive, negative) if src is not None] if paired else [updates]
    accepted = _accepted(given, skip_nonfinite, nonnegative)
    pos = _Component(positive, pos_part, accepted & (positive is not None), state.positive_count)
    neg = _Component(negative, neg_part, accepted & (negative is not None), state.negative_count)
    return pos, neg, accepted


def _added(accumulator: _Running | _Buffered, acc: Any, c: _Component) -> Any:
    """The component's window with this call's contribution added."""
    if c.source is None:
        return acc
    return jax.tree.map(
        lambda a, x: accumulator.add(a, c.part(x), c.count, c.present), acc, c.source
    )


def _emptied(acc: Any, reset: jax.Array) -> Any:
    """`acc`, or zeros where the window closed (`reset`)."""
    return jax.tree.map(lambda a: jnp.where(reset, jnp.zeros_like(a), a), acc)


def split_accumulate(
    every_k_schedule: int | Callable[[jax.Array], Any],
    *,
    reduction: str | WindowReduction = "sum",
    bound: str | None = None,
    lower: float | None = None,
    upper: float | None = None,
    lower_exponent: float | None = None,
    upper_exponent: float | None = None,
    paired: bool = False,
    accumulator_dtype: Any = None,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformation:
    r"""Accumulates positive and negative parts of updates and bounds them by the params.

    For learning rules whose increments have a potentiating part `P` and a
    depressing part `N` that are reduced separately and scaled by how far
    the parameter `p` is from its limits (soft or hard weight dependence, as
    in spike-timing-dependent plasticity). Over a window of `K` calls, each
    update `u` (already in the "add to params" sign convention, e.g. after
    `optax.scale(-lr)`) contributes `max(u, 0)` to the positive component
    and `max(-u, 0)` to the negative one; with `paired=True` the caller
    passes the two magnitudes `(positive, negative)` directly. Each
    component is reduced over the window elementwise (sum, mean, max, min,
    geometric mean, median or a custom function), and the `K`-th call
    returns

    $$
    \Delta p = f_+(p_{\max} - p)\,P - f_-(p - p_{\min})\,N,
    $$

    where the upper limit acts on the positive part and the lower limit on
    the negative part (`f = 1` for a side without a limit, so
    `bound=None` returns `P - N`), and, with `r = p_max - p_min` and the
    exponent `μ` (`upper_exponent` for `f_+`, `lower_exponent` for
    `f_-`),

    - `"power"`: `f(d) = d^μ`,
    - `"scaled_power"`: `f(d) = (d / r)^μ`,
    - `"multiplicative"`: `f(d) = d`,
    - `"scaled_multiplicative"`: `f(d) = d / r`,
    - `"sharp"`: `f(d) = Θ(d)`, 1 if `d > 0` and 0 otherwise.

    Two conventions where the reference (the `inferno` library's
    accumulator) is ambiguous or undefined. The sharp bound takes
    `Θ(0) = 0`, so a parameter exactly at its upper limit gets no positive
    push and one at its lower limit no negative push (the reference's text
    says `Θ(0) = 1`, its code gives 0). Outside the box (`d < 0`) the
    power bounds use the odd extension `sign(d)·|d|^μ`, which is finite and
    pushes back towards the box, instead of the undefined `d^μ`. None of
    these soft bounds keeps a parameter inside the box; chain
    `clamp_params` after this for that.

    The other calls of the window return exact zeros. A call with a
    non-finite entry is dropped: it joins neither component's reduction nor
    its count, and `num_skipped` grows by one. A component that received
    nothing in a window reduces to zero. A window with nothing accepted returns zeros.

    This transform acts on the final increment and reads the current params:
    it must be the last transform in an `optax.chain` (only
    `clamp_params` may follow), and `update` needs `params`. A transform
    placed after it cannot be detected (`optax.chain` tells no transform
    what follows it); one that rescales the increment breaks its relation
    to the limits.

    The two strategies are accumulators with the same `init` / `add` /
    `finalize` operations: running reductions (one params-sized array per
    component, written after the window's conditional) and buffered ones
    (`"median"` and custom functions: a `K`-slot buffer written before
    it). A traced `every_k_schedule` value below 1 is taken as 1.

    Args:
      every_k_schedule: The window length `K`: an int `>= 1` or a callable
        of `gradient_step` returning an integer scalar. `"median"` and custom
        reductions need an int.
      reduction: `"sum"` (default), `"mean"`, `"max"`, `"min"`,
        `"geometric_mean"` (of magnitudes; a zero contribution gives zero),
        `"median"`, or a callable `fn(values, valid)` where `values` has
        shape `(K, *leaf.shape)` and the boolean `valid` of shape
        `(K, 1, ..., 1)` marks the window's contributions (e.g.
        `lambda v, ok: jnp.max(v, axis=0, where=ok, initial=0.0)`). Running
        reductions keep one params-sized array per component; the median and
        custom reductions keep `K` (and the median's sort at the window's
        end needs `2K` more as temporaries).
      bound: `None` (default), or one of `"power"`, `"scaled_power"`,
        `"multiplicative"`, `"scaled_multiplicative"`, `"sharp"`.
      lower: Lower limit `p_min` (acts on the negative part), or `None`.
        Scaled bounds need both; a bound needs at least one.
      upper: Upper limit `p_max` (acts on the positive part), or `None`.
      lower_exponent: `μ-` for the power bounds, `> 0` (default 1).
      upper_exponent: `μ+` for the power bounds, `> 0` (default 1).
      paired: If `True`, `update` takes `updates=(positive, negative)`,
        two trees shaped like the params holding magnitudes (`None` for a
        component without a contribution in that call).
      accumulator_dtype: dtype of the components; `None` keeps float32 and
        wider and uses float32 for 16-bit inputs.
      skip_nonfinite: If `True` (default) calls with a non-finite entry are
        dropped as described.

    Returns:
      An `optax.GradientTransformation` whose `update` requires `params`
      and returns the increment in the params' dtype.

    Raises:
      TypeError: For arguments of the wrong type.
      ValueError: For an unknown reduction or bound, missing or inconsistent
        limits, exponents without a power bound, a median or custom reduction
        with a schedule; at trace time, when `params` is missing or the
        updates do not match the params (the message names the leaf).

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.split_accumulate(2, bound="multiplicative", lower=0.0, upper=1.0)
      >>> params = {"w": jnp.array([0.25, 0.75])}
      >>> state = tx.init(params)
      >>> u, state = tx.update({"w": jnp.array([0.4, -0.4])}, state, params)
      >>> u, state = tx.update({"w": jnp.array([0.4, 0.0])}, state, params)
      >>> u["w"]  # [(1 - 0.25) * 0.8, -(0.75 - 0) * 0.4]
      Array([ 0.6, -0.3], dtype=float32)

    References:
      van Rossum, Bi and Turrigiano, *Stable Hebbian Learning from Spike
      Timing-Dependent Plasticity*, J. Neurosci. 2000 (soft and hard bounds),
      https://doi.org/10.1523/JNEUROSCI.20-23-08812.2000
    """
    if not callable(every_k_schedule):
        validation.check_int("every_k_schedule", every_k_schedule, schedule=True)
    accumulator = _window_accumulator(reduction, every_k_schedule)
    bounds = _Bounds(
        bound, lower, upper, *_check_bound(bound, lower, upper, lower_exponent, upper_exponent)
    )
    validation.check_accumulator_dtype(accumulator_dtype)
    nonnegative = paired and reduction == "geometric_mean"

    def empty_component(p):
        return accumulator.init(p, trees.accumulator_dtype(p, accumulator_dtype))

    def init_fn(params: optax.Params) -> SplitAccumulateState:
        params = trees.as_arrays(params)
        validation.check_float_tree("params", params)
        return SplitAccumulateState(
            micro_step=trees.counter(),
            gradient_step=trees.counter(),
            positive=jax.tree.map(empty_component, params),
            negative=jax.tree.map(empty_component, params),
            positive_count=trees.counter(),
            negative_count=trees.counter(),
            num_skipped=trees.counter(),
        )

    def added(acc: Any, c: _Component) -> Any:
        return _added(accumulator, acc, c)

    def update_fn(
        updates: optax.Updates,
        state: SplitAccumulateState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, SplitAccumulateState]:
        placement.check_enclosing_updates()
        if params is None:
            raise ValueError(
                "split_accumulate computes its update from the current parameters: call "
                "update(updates, state, params) with params (got params=None), and put it "
                "last in optax.chain (only clamp_params may follow it)."
            )
        validation.check_float_tree("params", params)
        validation.refuse_unreduced("updates", updates, "split_accumulate")
        pos, neg, accepted = _contributions(
            updates, params, state, paired, skip_nonfinite, nonnegative
        )
        pos_count = state.positive_count + pos.present.astype(jnp.int32)
        neg_count = state.negative_count + neg.present.astype(jnp.int32)
        # A traced schedule value below 1 is taken as 1 (documented, not counted).
        k, _ = engine.window_length(every_k_schedule, state.gradient_step)
        micro_step = state.micro_step + 1
        closes = micro_step >= k

        # A buffer takes this call's contribution before the gate, in place; a
        # running reduction is only read in the branch and written after it.
        pos_acc, neg_acc = state.positive, state.negative
        if accumulator.adds_before_gate:
            pos_acc, neg_acc = added(pos_acc, pos), added(neg_acc, neg)

        def total(accs):
            if not accumulator.adds_before_gate:
                accs = (added(accs[0], pos), added(accs[1], neg))
            big_p = jax.tree.map(lambda a: accumulator.finalize(a, pos_count), accs[0])
            big_n = jax.tree.map(lambda a: accumulator.finalize(a, neg_count), accs[1])
            return big_p, big_n

        def step(window: engine.Window, no_state):
            big_p, big_n = window.total
            return jax.tree.map(bounds.apply, big_p, big_n, params), no_state

        new_updates, _, _, reset, applied = engine.close(
            engine.local_gate(),
            closes,
            (pos_acc, neg_acc),
            (),
            (pos_count + neg_count).astype(jnp.float32),
            jnp.ones([], jnp.float32),
            total=total,
            step=step,
            like=params,
        )

        if not accumulator.adds_before_gate:
            # Ordered after the branch by its `reset` output (see engine.write).
            pos_acc = _emptied(added(state.positive, pos), reset)
            neg_acc = _emptied(added(state.negative, neg), reset)

        new_state = SplitAccumulateState(
            micro_step=jnp.where(reset, 0, micro_step).astype(jnp.int32),
            gradient_step=trees.increment_if(state.gradient_step, applied),
            positive=pos_acc,
            negative=neg_acc,
            positive_count=jnp.where(reset, 0, pos_count).astype(jnp.int32),
            negative_count=jnp.where(reset, 0, neg_count).astype(jnp.int32),
            num_skipped=trees.increment_if(state.num_skipped, ~accepted),
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _check_bound(
    bound: str | None,
    lower: Any,
    upper: Any,
    lower_exponent: Any,
    upper_exponent: Any,
) -> tuple[float, float, float | None]:
    """Validates the bound arguments; returns the lower and upper exponents and the span."""
    if bound is None:
        given = {
            "lower": lower,
            "upper": upper,
            "lower_exponent": lower_exponent,
            "upper_exponent": upper_exponent,
        }
        extra = [f"{k}={v!r}" for k, v in given.items() if v is not None]
        if extra:
            raise ValueError(
                f"{', '.join(extra)} given with bound=None, which returns P - N unbounded; "
                f"pass bound= one of {', '.join(repr(b) for b in _BOUNDS)}, or drop them."
            )
        return 1.0, 1.0, None
    validation.check_choice("bound", bound, _BOUNDS)
    if upper is not None:
        upper = validation.check_real("upper", upper)
    if lower is not None:
        lower = validation.check_real("lower", lower)
    if upper is None and lower is None:
        raise ValueError(
            f"bound={bound!r} needs a limit: pass upper= (acts on the positive part), "
            "lower= (acts on the negative part), or both."
        )
    if upper is not None and lower is not None and not lower < upper:
        raise ValueError(f"lower must be < upper; got lower={lower!r}, upper={upper!r}.")
    span = None
    if bound in _SCALED_BOUNDS:
        if upper is None or lower is None:
            raise ValueError(
                f"bound={bound!r} divides by upper - lower and needs both limits; got "
                f"upper={upper!r}, lower={lower!r}."
            )
        span = upper - lower
    exponents = []
    for name, value in (("lower_exponent", lower_exponent), ("upper_exponent", upper_exponent)):
        if value is None:
            exponents.append(1.0)
            continue
        if bound not in _POWER_BOUNDS:
            raise ValueError(
                f"{name}={value!r} applies only to the power bounds ('power', "
                f"'scaled_power'); bound={bound!r} has no exponent."
            )
        exponents.append(validation.check_real(name, value, minimum=0.0, exclusive=True))
    return exponents[0], exponents[1], span


def _inner_limit(limit: float | None, dtype: Any, direction: float) -> Any:
    """`limit` rounded into `dtype` towards the inside of the box, never subnormal.

    XLA may flush subnormal numbers to zero (XLA:CPU does), which would move a
    subnormal limit outwards, to zero; such a limit is rounded inwards to zero
    or to the smallest normal number instead.
    """
    if limit is None:
        return None
    rounded = np.asarray(limit, dtype)
    if direction > 0 and float(rounded) < limit:
        rounded = np.nextafter(rounded, np.asarray(np.inf, dtype))
    if direction < 0 and float(rounded) > limit:
        rounded = np.nextafter(rounded, np.asarray(-np.inf, dtype))
    tiny = float(jnp.finfo(dtype).tiny)
    if 0 < abs(float(rounded)) < tiny:
        inwards_is_up = direction > 0
        if (float(rounded) > 0) == inwards_is_up:
            rounded = np.asarray(np.copysign(tiny, float(rounded)), dtype)
        else:
            rounded = np.asarray(0.0, dtype)
    return rounded


def _check_real_params(params: optax.Params) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                "clamp_params keeps real parameters inside [lower, upper]; the leaf at "
                f"{jax.tree_util.keystr(path)} has dtype {dtype}, which has no order. Leave "
                "complex leaves out with optax.masked(ga.clamp_params(...), mask)."
            )


_FIXUP_ROUNDS = 4


def clamp_params(lower: float | None, upper: float | None) -> optax.GradientTransformation:
    r"""Modifies the final update so that the params land inside `[lower, upper]`.

    Returns `u' = clip(p + u, lower, upper) - p`, corrected so that
    `optax.apply_updates` (which adds in the params' dtype) gives a value in
    the box: `p + u'` is computed as `apply_updates` does, and where it
    rounds outside the box `u'` is moved by one unit in the last place
    towards the inside, for up to a few rounds. Limits that are not
    representable in the params' dtype are rounded inwards; so are limits
    that would be subnormal there (XLA may flush those to zero, which could
    put a parameter outside the box): they become zero or the smallest
    normal number, whichever is inside. Infinite
    updates are clamped like any other; a NaN propagates (it has no place in
    the box, and hiding it would hide the bug).

    The guarantee holds whenever one addition in the params' dtype can land
    `p` in the box, which includes every parameter already inside it (should
    the correction fail, such a parameter is left where it is; in tests on
    random parameters and updates in float32 and bfloat16 it never did). A
    parameter far
    outside a box narrower than the spacing of floats near it cannot be moved
    in: `-512` in bfloat16 plus any bfloat16 gives `0` or `4`, never a
    value in `[0.001, 3.3]`. It then lands just beside the box.

    Put it last in the chain, after `split_accumulate` (none of whose
    soft bounds keeps parameters inside the box) or any other optimizer.

    Args:
      lower: Lower limit, or `None` for none.
      upper: Upper limit, or `None` for none.

    Returns:
      An `optax.GradientTransformation` whose `update` requires `params`.

    Raises:
      ValueError: If both limits are `None`, a limit is not finite, or
        `lower > upper`; at trace time, if `params` is missing or the box
        holds no normal number of the params' dtype.
      TypeError: At trace time, for complex parameters.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = optax.chain(optax.sgd(1.0), ga.clamp_params(0.0, 1.0))
      >>> params = {"w": jnp.array([0.5, 0.5, 0.5])}
      >>> u, _ = tx.update({"w": jnp.array([1.0, -1.0, 0.25])}, tx.init(params), params)
      >>> optax.apply_updates(params, u)["w"]
      Array([0.  , 1.  , 0.25], dtype=float32)
    """
    if lower is not None:
        lower = validation.check_real("lower", lower)
    if upper is not None:
        upper = validation.check_real("upper", upper)
    if lower is None and upper is None:
        raise ValueError("clamp_params needs a limit: got lower=None and upper=None.")
    if lower is not None and upper is not None and lower > upper:
        raise ValueError(f"lower must be <= upper; got lower={lower!r}, upper={upper!r}.")

    def init_fn(params: optax.Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def clamp_leaf(u: jax.Array, p: jax.Array) -> jax.Array:
        dtype = jnp.result_type(p)
        lo = _inner_limit(lower, dtype, +1)
        hi = _inner_limit(upper, dtype, -1)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(
                f"the box [{lower!r}, {upper!r}] holds no value of dtype {dtype} (subnormal "
                "values do not count: XLA may flush them to zero); widen it."
            )

        def inside(x):
            above = x >= lo if lo is not None else jnp.ones_like(x, bool)
            below = x <= hi if hi is not None else jnp.ones_like(x, bool)
            return above & below

        def land(delta):
            # What optax.apply_updates computes.
            return (p + delta).astype(dtype)

        target = jnp.clip(land(u), lo, hi)
        delta = (target - p).astype(dtype)
        for _ in range(_FIXUP_ROUNDS):
            landed = land(delta)
            if hi is not None:
                delta = jnp.where(landed > hi, jnp.nextafter(delta, -jnp.inf), delta)
            if lo is not None:
                delta = jnp.where(landed < lo, jnp.nextafter(delta, jnp.inf), delta)
        # Last resort, never needed in the tests: a parameter inside the box
        # stays where it is rather than leave it (NaN excepted, it propagates).
        landed = land(delta)
        stuck = ~inside(landed) & ~jnp.isnan(landed) & inside(p)
        return jnp.where(stuck, jnp.zeros_like(delta), delta)

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        if params is None:
            raise ValueError(
                "clamp_params needs the current parameters: call update(updates, state, "
                "params) with params (got params=None)."
            )
        validation.check_same_structure("updates", updates, "params", params)
        validation.check_float_tree("params", params)
        validation.refuse_unreduced("updates", updates, "clamp_params")
        _check_real_params(params)
        return jax.tree.map(clamp_leaf, updates, params), state

    return optax.GradientTransformation(init_fn, update_fn)
