r"""The gradient noise scale, measured from the accumulator.

McCandlish et al. (2018) read the "simple" noise scale
$B_\text{simple} = \operatorname{tr}(\Sigma) / |G|^2$ from two squared norms
that an accumulator already has: that of each micro-gradient (small batch) and
that of the window's mean (big batch).

Derivation for micro-batches of unequal sizes. Micro-gradient $g_i$ is the
mean over $b_i$ examples, so $E|g_i|^2 = |G|^2 + \operatorname{tr}(\Sigma)/b_i$.
With weights $w_i \propto b_i$ (the `weight` passed to `update`, or equal
weights for equal micro-batches), $W = \sum_i w_i$ and $n$ accepted
micro-gradients of non-zero weight, the window's mean
$\bar g = \sum_i w_i g_i / W$ and the weighted mean of the small-batch norms
$S = \sum_i w_i |g_i|^2 / W$ have

$$
E|\bar g|^2 = |G|^2 + \frac{\operatorname{tr}(\Sigma)}{B_\text{big}},\qquad
E\,S = |G|^2 + \frac{\operatorname{tr}(\Sigma)}{B_\text{small}},\qquad
B_\text{big} = W,\quad B_\text{small} = W / n,
$$

(the weighted mean makes the small batch size the plain mean micro-batch size,
whatever the sizes), so the unbiased estimates are the paper's (appendix A.1)
with these two sizes:

$$
|G|^2 \approx \frac{n |\bar g|^2 - S}{n - 1},\qquad
\operatorname{tr}(\Sigma) \approx \frac{(S - |\bar g|^2)\, B_\text{big}}{n - 1}.
$$

Dropped micro-gradients are simply not among the $n$. Each window with
$n \ge 2$ updates bias-corrected EMAs of both estimates; $B_\text{simple}$ is
the ratio of the EMAs (the ratio of two noisy unbiased estimates is biased, the
ratio of their averages much less so).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._base import collectives, trees, validation
from gradaccum_jax._base.compat import varying_axes


class NoiseScaleState(NamedTuple):
    """The noise-scale part of `AccumulateState` (`track_noise_scale=True`).

    With `axis_name`, every field is held per replica (like `acc_grads`): the
    window sums are each replica's own, the averages are equal on every
    replica because they are computed from the reduced window.

    Attributes:
      acc_sq_norm: `float32[]`. $\\sum_i (w_i / u) |g_i|^2$ over the accepted
        micro-gradients of the current window, in the accumulator's weight
        unit $u$ (`AccumulateState.weight_unit`).
      acc_count: `float32[]`. How many micro-gradients of non-zero weight the
        current window accepted.
      ema_grad_sq_norm: `float32[]`. Exponential moving average of the
        windows' estimates of $|G|^2$, not yet bias-corrected.
      ema_trace_cov: `float32[]`. Same for $\\operatorname{tr}(\\Sigma)$, per
        unit of batch size.
      ema_normalizer: `float32[]`. $1 - \\beta^t$ after $t$ estimates: the
        averages divided by it are bias-corrected. `0` until the first window
        with at least two accepted micro-gradients.
    """

    acc_sq_norm: jax.Array
    acc_count: jax.Array
    ema_grad_sq_norm: jax.Array
    ema_trace_cov: jax.Array
    ema_normalizer: jax.Array


class GradientNoiseScale(NamedTuple):
    """The measured gradient noise scale (`gradient_noise_scale`).

    All three are `float32[]`, NaN until a window with at least two accepted
    micro-gradients (across replicas) has closed.

    Attributes:
      b_simple: $B_\\text{simple} = \\operatorname{tr}(\\Sigma) / |G|^2$, in
        the batch-size unit (see `accumulate`'s `micro_batch_size`).
      grad_sq_norm: Bias-corrected average estimate of $|G|^2$, the squared
        norm of the true (full-data) gradient.
      trace_cov: Bias-corrected average estimate of
        $\\operatorname{tr}(\\Sigma)$, the trace of the per-example gradient
        covariance (per unit of batch size).
    """

    b_simple: jax.Array
    grad_sq_norm: jax.Array
    trace_cov: jax.Array


def init() -> NoiseScaleState:
    """The empty noise-scale state."""
    # A fresh buffer per field, so that an eagerly created state can be donated.
    return NoiseScaleState(*(jnp.zeros([], jnp.float32) for _ in NoiseScaleState._fields))


def sq_norm(tree: Any, own_axes: tuple[Any, ...] = ()) -> jax.Array:
    """$|g|^2$ of a tree, summed in float32 (real part of $g^* g$ for complex leaves).

    Inside `jax.shard_map`, leaves typed varying along mesh axes besides `own_axes` (the
    window's `axis_name`: each replica's own gradient) hold parts of one gradient
    (pipeline stages, tensor shards): their squares are summed over those axes, one
    scalar all-reduce per set of axes, so that every part's device holds the whole
    norm. Untyped (`jax.pmap`, `check_vma=False`) each device has its part's norm.
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros([], jnp.float32)
    groups: dict[frozenset, list[Any]] = {}
    for x in leaves:
        groups.setdefault(varying_axes(x) - set(own_axes), []).append(x)
    total = jnp.zeros([], jnp.float32)
    for parts, xs in groups.items():
        part = functools.reduce(jnp.add, [_leaf_sq(x) for x in xs])
        total = total + (jax.lax.psum(part, tuple(sorted(parts, key=str))) if parts else part)
    return total


def _leaf_sq(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if jnp.iscomplexobj(x):
        return jnp.sum(jnp.real(x) ** 2 + jnp.imag(x) ** 2).astype(jnp.float32)
    return jnp.sum(x * x).astype(jnp.float32)


def all_finite_given_sq_norm(
    grads: Any, grads_sq: jax.Array, own_axes: tuple[Any, ...] = ()
) -> jax.Array:
    """Whether every element of `grads` is finite, given their squared norm `grads_sq`.

    A finite squared norm proves it, and saves the pass of `trees.all_finite`
    over the gradients; only an infinite or NaN norm (a non-finite element, or
    elements above ~1e19 whose squares overflow) needs that pass.
    """
    # Both branches compute from operands, so they vary between replicas alike; the
    # parts' flags agree (the squared norm is whole already: `sq_norm`).
    return jax.lax.cond(
        jnp.isfinite(grads_sq),
        lambda g, q: jnp.isfinite(q),
        lambda g, q: collectives.agree(trees.all_finite(g), own_axes, typed=True),
        grads,
        grads_sq,
    )


def window_sums(
    state: NoiseScaleState, grads_sq: jax.Array, accepted: jax.Array, term_weight: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The window's `(Σ (w/u)|g|², count)` including this micro-step, local to the replica."""
    counted = accepted & (term_weight > 0)
    # where, not a product: a dropped micro-gradient's norm may be NaN.
    add_sq = jnp.where(counted, term_weight * grads_sq, 0.0)
    return state.acc_sq_norm + add_sq, state.acc_count + counted.astype(jnp.float32)


def update_averages(
    state: NoiseScaleState,
    big_sq_norm: jax.Array,
    small_sq_norm_sum: jax.Array,
    count: jax.Array,
    total_weight: jax.Array,
    batch_unit: float,
    decay: float,
) -> NoiseScaleState:
    """Folds one closed window into the averages.

    Args:
      state: The state before the window closed.
      big_sq_norm: $|\\bar g|^2$, the squared norm of the window's mean.
      small_sq_norm_sum: $\\sum_i w_i |g_i|^2$ in the weights' own units
        (summed across replicas).
      count: $n$, accepted micro-gradients of non-zero weight (all replicas).
      total_weight: $W = \\sum_i w_i$ in the weights' own units.
      batch_unit: Examples per unit of weight (`micro_batch_size`, or 1).
      decay: The averages' decay $\\beta$.
    """
    small = small_sq_norm_sum / total_weight
    big_batch = total_weight * batch_unit
    usable = (count >= 2) & (total_weight > 0)
    # Guarded denominators: the estimates of an unusable window are discarded.
    n_minus_1 = jnp.where(usable, count - 1.0, 1.0)
    grad_sq = (count * big_sq_norm - small) / n_minus_1
    trace = (small - big_sq_norm) * big_batch / n_minus_1
    # Squared norms that overflowed float32 give no estimate rather than a NaN average.
    usable = usable & jnp.isfinite(grad_sq) & jnp.isfinite(trace)

    def ema(old, new):
        return jnp.where(usable, decay * old + (1.0 - decay) * new, old).astype(jnp.float32)

    return state._replace(
        ema_grad_sq_norm=ema(state.ema_grad_sq_norm, grad_sq),
        ema_trace_cov=ema(state.ema_trace_cov, trace),
        ema_normalizer=ema(state.ema_normalizer, jnp.float32(1.0)),
    )


def estimate(state: NoiseScaleState) -> GradientNoiseScale:
    """The bias-corrected averages and their ratio (NaN before the first estimate)."""
    norm = jnp.where(state.ema_normalizer > 0, state.ema_normalizer, jnp.nan)
    grad_sq = state.ema_grad_sq_norm / norm
    trace = state.ema_trace_cov / norm
    return GradientNoiseScale(
        b_simple=(trace / grad_sq).astype(jnp.float32),
        grad_sq_norm=grad_sq.astype(jnp.float32),
        trace_cov=trace.astype(jnp.float32),
    )


def gradient_noise_scale(opt_state: optax.OptState) -> GradientNoiseScale:
    r"""Returns the gradient noise scale measured by `accumulate(..., track_noise_scale=True)`.

    Reads the bias-corrected averages of the per-window estimates of
    $|G|^2$ and $\operatorname{tr}(\Sigma)$ from the `AccumulateState` found
    anywhere inside `opt_state` (a chain, `optax.masked`, `inject_hyperparams`),
    and their ratio

    $$
    B_\text{simple} = \frac{\operatorname{tr}(\Sigma)}{|G|^2},
    $$

    the batch size at which the gradient's noise is about as large as the
    gradient itself. It is a cheap proxy for the critical batch size; see the
    guide "Choosing K" for what it means and its caveats.

    Args:
      opt_state: An optimizer state that contains exactly one
        `AccumulateState` built with `track_noise_scale=True`. With
        `axis_name`, pass one replica's state (every replica holds the same
        averages); on a replica-stacked state each field has the replica axis.

    Returns:
      A `GradientNoiseScale` of `float32` scalars, NaN until a window with at
      least two accepted micro-gradients has closed.

    Raises:
      ValueError: If `opt_state` contains no `accumulate` state built with
        `track_noise_scale=True`, or several.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = ga.accumulate(optax.sgd(0.0), 2, track_noise_scale=True, noise_scale_decay=0.0)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> _, state = tx.update({"w": jnp.array([1.0, 0.0])}, state)
      >>> _, state = tx.update({"w": jnp.array([3.0, 0.0])}, state)
      >>> ga.gradient_noise_scale(state).grad_sq_norm  # (2 * 2² - (1 + 9) / 2) / 1
      Array(3., dtype=float32)
    """
    state = validation.find_unique_state(
        opt_state, NoiseScaleState, "gradaccum_jax.accumulate(..., track_noise_scale=True)"
    )
    return estimate(state)


class CriticalBatchSchedule(NamedTuple):
    """A window length that follows the measured noise scale; see `critical_batch_schedule`.

    Attributes:
      min_k: Smallest window length.
      max_k: Largest window length.
      warmup_steps: Optimizer steps during which `K = min_k`.
      max_change: Largest factor by which `K` may grow or shrink per window
        (a step of one is always allowed).
      batch_per_micro_step: Units of `b_simple` that one micro-step adds to
        the window's batch.
    """

    min_k: int
    max_k: int
    warmup_steps: int
    max_change: float
    batch_per_micro_step: float

    def __call__(self, gradient_step: jax.Array) -> jax.Array:
        """The window length before any estimate: `min_k`."""
        del gradient_step
        return jnp.int32(self.min_k)

    def next_k(
        self, gradient_step: jax.Array, current_k: jax.Array, noise: GradientNoiseScale
    ) -> jax.Array:
        """The next window's length, from the current one and the measured noise scale."""
        # An average |G|² at or below zero under a positive tr(Σ) means the noise
        # swamps the gradient at this batch: B_simple is beyond measure, K grows.
        swamped = (noise.grad_sq_norm <= 0) & (noise.trace_cov > 0)
        target = jnp.where(swamped, jnp.inf, noise.b_simple / self.batch_per_micro_step)
        k = current_k.astype(jnp.float32)
        # At least one either way: 2 x 1.25 rounds back to 2, so a small K with a
        # small max_change could otherwise never move.
        up = jnp.maximum(jnp.floor(k * self.max_change), k + 1.0)
        down = jnp.minimum(jnp.ceil(k / self.max_change), k - 1.0)
        chosen = jnp.clip(jnp.clip(jnp.round(target), down, up), self.min_k, self.max_k)
        # No estimate yet (NaN) keeps K, so does a non-positive tr(Σ) (no
        # usable estimate), and so does the warm-up.
        keep = (gradient_step < self.warmup_steps) | ~(noise.trace_cov > 0) | jnp.isnan(target)
        return jnp.where(keep, current_k, chosen.astype(jnp.int32)).astype(jnp.int32)


def critical_batch_schedule(
    min_k: int,
    max_k: int,
    *,
    warmup_steps: int = 0,
    max_change: float = 1.25,
    batch_per_micro_step: float = 1.0,
) -> CriticalBatchSchedule:
    r"""A window length `K` that tracks the measured noise scale, for `every_k_schedule`.

    Pass it as `accumulate(inner, critical_batch_schedule(...),
    track_noise_scale=True)`. Each window starts with `K = min_k`; whenever a
    window closes after the warm-up, the next `K` is chosen from the averaged
    noise scale of `gradient_noise_scale`:

    $$
    K_\text{next} = \operatorname{clip}\Big(\operatorname{round}(B_\text{simple} / b),\
    K_\downarrow,\ K_\uparrow\Big)\ \text{clipped to}\ [K_\text{min}, K_\text{max}],
    \qquad K_\uparrow = \max(\lfloor K c \rfloor, K + 1),\quad
    K_\downarrow = \min(\lceil K / c \rceil, K - 1),
    $$

    with $b$ = `batch_per_micro_step` and $c$ = `max_change`, so that the
    window's batch `K × b` follows $B_\text{simple}$ without jumping with one
    noisy estimate. `K` moves by at least one when the target differs (else
    `K = 2` with `c = 1.25` would round back to 2 forever), and by at most a
    factor `c` otherwise. While there is no estimate (NaN, or an averaged
    $\operatorname{tr}(\Sigma) \le 0$), `K` stays; an averaged $|G|^2 \le 0$
    with a positive $\operatorname{tr}(\Sigma)$ means the noise swamps the
    gradient at this batch, so `K` grows to $K_\uparrow$. Windows are exact
    whatever `K`: the mean divides by what was accepted.

    Args:
      min_k: Smallest window length, `>= 2` (one micro-gradient gives no
        estimate, so a window of 1 could never leave it).
      max_k: Largest window length, `>= min_k`.
      warmup_steps: Optimizer steps during which `K` stays `min_k`: the first
        estimates are few and taken far from the trained parameters.
      max_change: Factor `> 1` by which `K` may grow or shrink per window;
        a step of one is allowed whatever the factor.
      batch_per_micro_step: How many units of `b_simple` one micro-step adds
        to the window's batch: `1` when `b_simple` counts micro-batches
        (`micro_batch_size=None`, one device); the number of replicas under
        `axis_name`; the micro-batch's tokens or examples when `b_simple` is
        in those units.

    Returns:
      A `CriticalBatchSchedule`.

    Raises:
      TypeError, ValueError: If an argument is out of range (the message names
        it).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> sched = ga.critical_batch_schedule(2, 64, max_change=2.0)
      >>> tx = ga.accumulate(optax.sgd(0.1), sched, track_noise_scale=True)
      >>> int(tx.init({"w": jnp.zeros(3)}).window_length)
      2
    """
    min_k = validation.check_int("min_k", min_k, minimum=2)
    max_k = validation.check_int("max_k", max_k, minimum=min_k)
    warmup_steps = validation.check_int("warmup_steps", warmup_steps, minimum=0)
    max_change = validation.check_real("max_change", max_change, minimum=1.0, exclusive=True)
    batch_per_micro_step = validation.check_real(
        "batch_per_micro_step", batch_per_micro_step, minimum=0.0, exclusive=True
    )
    return CriticalBatchSchedule(min_k, max_k, warmup_steps, max_change, batch_per_micro_step)


class Probe:
    """The noise-scale measurement as hooks on `accumulate`'s one update path.

    `finite` replaces the route's finiteness pass (the squared norm proves it),
    `stats` are the sums that travel in the window's one reduction, `wrap`
    carries the averages through the gate beside the inner state and folds the
    closed window into them, and `after` writes the running sums.
    """

    def __init__(
        self, decay: float, micro_batch_size: int | None, axis_names: tuple[Any, ...] | None
    ) -> None:
        self.decay = decay
        self.own_axes = axis_names or ()
        self.batch_unit = 1.0 if micro_batch_size is None else float(micro_batch_size)
        self.grads_sq: jax.Array | None = None
        self.sums: tuple[jax.Array, jax.Array] | None = None

    def finite(self, grads: Any) -> jax.Array:
        self.grads_sq = sq_norm(grads, self.own_axes)
        return all_finite_given_sq_norm(grads, self.grads_sq, self.own_axes)

    def stats(self, state: NoiseScaleState, accepted: jax.Array, term_weight: jax.Array, unit):
        """The window's sums, in absolute units so that replicas with different units add up."""
        self.sums = window_sums(state, self.grads_sq, accepted, term_weight)  # type: ignore[arg-type]
        sq_sum, count = self.sums
        return (sq_sum * unit, count)

    def big_sq_norm(self, window: Any) -> jax.Array:
        # The window's sum is a buffer already (the accumulator, added before
        # the gate, or the reduction across replicas): a read, no temporary.
        return sq_norm(window.total, self.own_axes)

    def fold(self, state: NoiseScaleState, window: Any, big_sq: jax.Array) -> NoiseScaleState:
        sq_sum, count = window.stats
        return update_averages(
            state,
            big_sq_norm=big_sq / jnp.square(window.weight),
            small_sq_norm_sum=sq_sum,
            count=count,
            total_weight=window.weight * window.unit,
            batch_unit=self.batch_unit,
            decay=self.decay,
        )

    def after(self, state: NoiseScaleState, reset: jax.Array) -> NoiseScaleState:
        sq_sum, count = self.sums  # type: ignore[misc]
        return state._replace(
            acc_sq_norm=jnp.where(reset, 0.0, sq_sum).astype(jnp.float32),
            acc_count=jnp.where(reset, 0.0, count).astype(jnp.float32),
        )
