"""The noisy window: `dp_accumulate`, DP-SGD's noise once per logical batch.

`dp_accumulate` is the window engine of `accumulate` (`_window/stages.py`) with a
fixed plan: the micro-steps' clipped sums are added as they are (no finite check,
no weights, no mean), and the inner transformation the engine runs once per
window, inside its closing branch, is `_closing`: the privatizer (Gaussian noise
by default), the division by the public expected batch size, then the user's
optimizer. The random bits are drawn there and nowhere else.

What the library can see of the clip norm: `clipped_grad` marks the sums it
returns with its `l2_clip_norm` (`_base/clip_marks.py`), and `dp_accumulate`'s update
refuses sums marked with another norm than the one its noise is calibrated to, and
some but not all of the leaves clipped together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax._base import clip_marks, compat, trees, validation
from gradaccum_jax._window import placement, stages
from gradaccum_jax._window.state import AccumulateState, CallerClosedAccumulateState

# The window length of a window closed by `close=`: a count it never reaches.
_NEVER = int(np.iinfo(np.int32).max)

# The options of `accumulate` that a private window refuses, each with why and the fix.
_REFUSED = {
    "use_grad_mean": "a mean over micro-steps divides by a count of the data (its "
    "sensitivity is no longer C / B). The window's sum is divided by the public "
    "expected_batch_size; drop the argument.",
    "skip_nonfinite": "dropping a micro-step because one example is not finite removes a "
    "whole micro-batch (sensitivity b * C, not C). clipped_grad drops non-finite examples "
    "one by one; dp_accumulate adds every sum as it is. Drop the argument.",
    "should_skip_update_fn": "it drops whole micro-batches on a test of their values "
    "(sensitivity b * C, not C). Drop it; clipped_grad drops non-finite examples one by one.",
    "weight": "the window's sum is divided by the public expected_batch_size, never by a "
    "weight or count of the data. Mark padding examples with clipped_grad's "
    "is_padding_example= instead.",
}


class GaussianNoiseState(NamedTuple):
    """State of the Gaussian privatizer that `dp_accumulate` runs at each window's close.

    Attributes:
      key: `uint32[...]`, the key data of `dp_accumulate`'s `key`
        (`jax.random.key_data`), fixed from `init` on. Each window's noise is
        drawn from it folded with `num_windows`, so a run resumed from a
        checkpoint draws what the uninterrupted run would have drawn.
      num_windows: `int32[]`, the windows closed so far (the window index).
        Saturates at the int32 maximum.
    """

    key: jax.Array
    num_windows: jax.Array


class DPCloseState(NamedTuple):
    """What `dp_accumulate` runs once per window: the privatizer's state and the optimizer's.

    Attributes:
      privatizer: The privatizer's state: a `GaussianNoiseState` by default,
        or the state of the `privatizer=` given.
      inner: The inner optimizer's state.
    """

    privatizer: Any
    inner: Any


class _DPAccumulateFields(NamedTuple):
    window: AccumulateState


class DPAccumulateState(_DPAccumulateFields):
    """State of `dp_accumulate`.

    Every leaf keeps its shape and dtype from `init` on (scan-stable, donated,
    checkpointed mid-window and resumed bit-identically).

    Attributes:
      window: The window engine's state, an `AccumulateState` (a
        `CallerClosedAccumulateState` when `every_k_schedule=None`): `acc_grads`
        holds the sum of the window's clipped sums so far (not noised, local to
        the replica with `axis_name`), `acc_weight` the number of micro-steps in
        it, `gradient_step` the windows closed, and `inner_state` a
        `DPCloseState` holding the privatizer's state (the key and the window
        index) and the inner optimizer's. `gradaccum_jax.optimizer_step`,
        `closes_window` and `has_updated` read it.
    """

    # Another window around it is refused (`_window/state.py`, holds_outermost_window).
    outermost_window = True
    __slots__ = ()


# What follows dp_accumulate in a chain runs on every micro-step, on its zeros too:
# the placement checks name this window, and its own factory, in their errors.
_WINDOW = placement.Window(
    "gradaccum_jax.privacy.dp_accumulate",
    "ga.privacy.dp_accumulate(optax.chain(..., {element}), K, l2_clip_norm=C, "
    "noise_multiplier=sigma, expected_batch_size=B, key=key)",
    "ga.privacy.dp_accumulate(inner, K * N, l2_clip_norm=C, noise_multiplier=sigma, "
    "expected_batch_size=B * N, key=key)",
)
placement.register_window(DPAccumulateState, _WINDOW)


# --- the clip norm the sums were clipped to --------------------------------------------


# id of a leaf -> (weak reference confirming it is the leaf marked, the clip norm)
def _check_clip_norm(updates: Any, l2_clip_norm: float) -> None:
    norms = {group.l2_clip_norm for group, _ in clip_marks.marks(updates)}
    other = sorted(norm for norm in norms if norm != l2_clip_norm)
    if other:
        raise ValueError(
            f"dp_accumulate calibrates its noise to l2_clip_norm={l2_clip_norm!r}, but the "
            f"sums it received were clipped to l2_clip_norm={other[0]!r} (by clipped_grad). "
            "The noise's scale is noise_multiplier * l2_clip_norm of the clipping: give both "
            "the same l2_clip_norm."
        )
    clip_marks.check_whole(
        updates,
        "dp_accumulate",
        "An optimizer with wrt= narrower than the clipping, such as nnx.Optimizer(model, "
        "tx, wrt=nnx.LoRAParam), passes on only its own leaves: clip the same ones, "
        "clipped_grad(loss, C, wrt=nnx.LoRAParam).",
    )


# --- what runs once per window ----------------------------------------------------------


def _key_data(key: Any) -> tuple[jax.Array, Any]:
    """`key`'s data and implementation (`None`: the default), or a `TypeError`."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"key must be a single key (shape ()); got shape {key.shape}.")
        return jax.random.key_data(key), jax.random.key_impl(key)
    if isinstance(key, jax.Array | np.ndarray) and key.dtype == np.uint32 and key.ndim == 1:
        return jnp.asarray(key), None
    raise TypeError(
        f"key must be a JAX PRNG key such as jax.random.key(0) (or the legacy "
        f"jax.random.PRNGKey(0)); got key={key!r}."
    )


def _gaussian_noise(stddev: float, key: Any) -> optax.GradientTransformation:
    """Adds `N(0, stddev^2)` to every element, from `key` folded with the window index."""
    data, impl = _key_data(key)

    def init(params: optax.Params) -> GaussianNoiseState:
        del params
        # A copy: a donated state must not take the caller's key buffer with it.
        return GaussianNoiseState(key=jnp.array(data, copy=True), num_windows=trees.counter())

    def update(sums: Any, state: GaussianNoiseState, params: Any = None):
        del params
        count = trees.increment_if(state.num_windows, jnp.array(True))
        if stddev == 0:
            return sums, state._replace(num_windows=count)
        window_key = jax.random.fold_in(
            jax.random.wrap_key_data(state.key, impl=impl), state.num_windows
        )
        leaves, treedef = jax.tree.flatten(sums)
        keys = jax.random.split(window_key, len(leaves))

        def noised(x: jax.Array, k: jax.Array) -> jax.Array:
            wide = jnp.promote_types(x.dtype, jnp.float32)
            noise = jax.random.normal(k, x.shape, wide) * np.asarray(stddev, wide)
            return (x.astype(wide) + noise).astype(x.dtype)

        noisy = [noised(x, k) for x, k in zip(leaves, keys, strict=True)]
        return jax.tree.unflatten(treedef, noisy), state._replace(num_windows=count)

    return optax.GradientTransformation(init, update)


def _closing(
    privatizer: optax.GradientTransformation,
    expected_batch_size: float,
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """The privatizer on the window's sum, the division by `B`, then `inner`: once per window."""
    inner = optax.with_extra_args_support(inner)

    def init(params: optax.Params) -> DPCloseState:
        return DPCloseState(privatizer.init(params), inner.init(params))

    def update(sums: Any, state: DPCloseState, params: Any = None, **extra_args: Any):
        noisy, privatizer_state = privatizer.update(sums, state.privatizer, params)

        def divided(x: jax.Array) -> jax.Array:
            wide = jnp.promote_types(x.dtype, jnp.float32)
            return (x.astype(wide) / np.asarray(expected_batch_size, wide)).astype(x.dtype)

        mean = jax.tree.map(divided, noisy)
        updates, inner_state = inner.update(mean, state.inner, params, **extra_args)
        return updates, DPCloseState(privatizer_state, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


# --- the transformation ----------------------------------------------------------------


def _check_static(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, jax.Array):
            raise TypeError(
                f"dp_accumulate got {name}={value!r}, a JAX array, where a Python value fixed "
                "when it is built is needed: the privacy guarantee is computed from it. "
                "optax.inject_hyperparams passes numeric arguments as arrays: keep it static, "
                f"optax.inject_hyperparams(dp_accumulate, static_args=({name!r}, ...))."
            )


def _refuse_options(**options: Any) -> None:
    for name, value in options.items():
        if value is not None:
            raise ValueError(f"dp_accumulate does not take {name}=: {_REFUSED[name]}")


def _check_noise_args(privatizer: Any, noise_multiplier: Any, key: Any) -> None:
    if privatizer is None:
        if noise_multiplier is None or key is None:
            raise ValueError(
                "dp_accumulate needs noise_multiplier= and key= (the Gaussian noise "
                "N(0, (noise_multiplier * l2_clip_norm)^2) added once per window), or a "
                f"privatizer=; got {noise_multiplier=!r}, key={key!r}. noise_multiplier=0.0 "
                "turns the noise off (for tests: no privacy)."
            )
        validation.check_real("noise_multiplier", noise_multiplier, minimum=0.0)
        return
    validation.check_gradient_transformation("privatizer", privatizer)
    if noise_multiplier is not None or key is not None:
        raise ValueError(
            "dp_accumulate got a privatizer= and noise_multiplier= or key= as well: the "
            "privatizer adds the noise (with its own key), so the noise would have two "
            f"sources. Drop {'noise_multiplier' if noise_multiplier is not None else 'key'}=."
        )


def _check_close(close: Any, by_caller: bool, axis_names: Any) -> jax.Array | None:
    if not by_caller:
        if close is not None:
            raise ValueError(
                "update got close= but dp_accumulate was built with an every_k_schedule: a "
                "window has one rule for its end. Build it with every_k_schedule=None to end "
                "each (Poisson-sampled) logical batch with close=, or drop close=."
            )
        return None
    if close is None:
        raise ValueError(
            "dp_accumulate was built with every_k_schedule=None: every update needs "
            "close= (a boolean scalar, True on the last micro-step of a logical batch)."
        )
    close = jnp.asarray(close)
    if close.dtype != jnp.bool_ or close.shape != ():
        raise TypeError(
            f"close must be a boolean scalar; got dtype {close.dtype} and shape {close.shape}."
        )
    varying = sorted(compat.varying_axes(close) & set(axis_names or ()), key=str)
    if varying:
        raise ValueError(
            f"close varies between replicas along {varying}: replicas would end their "
            "logical batches at different calls and wait for each other's reduction. Decide "
            "it from replicated values (the sampled batch's size, known to every replica)."
        )
    return close


def _refuse_route(route: str, where: str) -> None:
    if route == "unreduced":
        raise ValueError(
            f"dp_accumulate does not support {where}: the noisy window is not built for "
            "unreduced (global-view data-parallel) windows. Reduce the clipped sums first, or "
            "use axis_name= under jax.shard_map."
        )


def dp_accumulate(
    inner: optax.GradientTransformation,
    every_k_schedule: int | Callable[[jax.Array], Any] | None,
    *,
    l2_clip_norm: float,
    expected_batch_size: float,
    noise_multiplier: float | None = None,
    key: jax.Array | None = None,
    privatizer: optax.GradientTransformation | None = None,
    accumulator_dtype: Any = None,
    axis_name: Any = None,
    use_grad_mean: None = None,
    skip_nonfinite: None = None,
    should_skip_update_fn: None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Sums clipped micro-batch sums over a logical batch and adds DP noise once, at its close.

    The DP-SGD rule over a logical batch that spans several calls. Each
    `update` receives one micro-batch's sum of per-example gradients, each
    clipped to L2 norm `C = l2_clip_norm` (from `clipped_grad`), adds it to the
    window and returns exact zeros. The window's last call adds Gaussian noise
    to the sum, once, divides by the public expected batch size `B`, never by a
    count of the data, and runs `inner` once on

    $$
    \tilde g = \frac{1}{B}\Big(\sum_{i \in \text{batch}} \operatorname{clip}_C(g_i)
      + \mathcal N\big(0, \sigma^2 C^2 I\big)\Big),
    \qquad \sigma = \text{noise\_multiplier}.
    $$

    The noise is drawn inside the window's closing branch (a `jax.lax.cond`),
    so micro-steps draw no random bits. It comes from `key`, kept in the state
    and folded with the window's index, so a run resumed from a checkpoint
    draws the same noise; each leaf gets its own key. With `axis_name` the
    replicas' sums are added once, at the close, and the noise is drawn once for
    that sum, the same on every replica.

    A window ends after `every_k_schedule` calls (fixed-size logical batches of
    `K` micro-batches), or, with `every_k_schedule=None`, on the call whose
    `update(..., close=True)` says so: a Poisson-sampled logical batch of any
    number of micro-batches (an empty one is one micro-step whose examples are
    all padding: its update is the noise alone). Giving both is refused.

    Nothing is dropped: every micro-step's sum is added as it is, whatever its
    values (a test of the values that dropped a whole micro-batch would make
    the sensitivity `b * C`). `clipped_grad` drops a non-finite example on its
    own; a non-finite sum from elsewhere makes its window's update, and the
    params, non-finite, visibly.

    Refused with an error that names the fix: `weight=`, `use_grad_mean`,
    `skip_nonfinite`, `should_skip_update_fn` (see the privacy guide); a window
    after it in an optax chain (`accumulate`, `dp_accumulate`, `optax.apply_every`,
    `optax.MultiSteps`, at `update`), and elements after it that keep state or do
    not map zero updates to zero (`optax.add_decayed_weights`);
    a window around it (`accumulate` at `init`, `optax.MultiSteps` where a
    state reader sees it); sums marked by `clipped_grad` with another
    `l2_clip_norm`. `gradaccum_jax.optimizer_step`, `closes_window` and
    `has_updated` refuse a state in which
    `optax.contrib.differentially_private_aggregate` or `dpsgd` comes before a
    window.

    Args:
      inner: The optimizer to apply once per logical batch, to the noisy mean.
      every_k_schedule: The number of micro-steps per logical batch: an int
        `>= 1`, a callable of `gradient_step` (the windows closed so far), or
        `None` for windows ended by `update(..., close=...)`.
      l2_clip_norm: `C`, the norm each example's gradient was clipped to
        (`> 0`). Sums marked by `clipped_grad` with another norm are refused.
      expected_batch_size: `B`, the public divisor: the expected logical batch
        size, a positive number (`q * N` under Poisson sampling with rate `q` from
        `N` examples, an integer or not: it only has to be public, not a count).
      noise_multiplier: `sigma >= 0`; the noise's standard deviation is
        `sigma * C`. `0.0` adds no noise (tests only: no privacy).
      key: A `jax.random.key` (or legacy `PRNGKey`) for the noise.
      privatizer: Instead of `noise_multiplier` and `key`: an optax
        transformation run once per window on the window's sum, before the
        division by `B` (a jax_privacy privatizer such as
        `noise_addition.gaussian_privatizer(stddev=..., prng_key=...)`, or a
        correlated-noise mechanism). It owns its noise and key; its scale is not
        checked against `l2_clip_norm`.
      accumulator_dtype: dtype of the window's sum; `None` (default) keeps
        float32 and wider sums in their dtype (float64 stays float64) and sums
        float16 and bfloat16 ones in float32.
      axis_name: A mapped axis name (or tuple) for `jax.shard_map` or
        `jax.pmap`, as for `accumulate`: each replica holds its own sum, the
        close adds them across replicas once and draws the noise once.
        `close=` must then be the same on every replica.
      use_grad_mean: Refused (`accumulate`'s mean over micro-steps): any
        value but `None` raises a `ValueError` saying why and what to do.
      skip_nonfinite: Refused likewise (it drops whole micro-batches).
      should_skip_update_fn: Refused likewise (it drops whole micro-batches).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose `update` accepts
      `close=` (with `every_k_schedule=None`) and passes other keyword
      arguments to `inner`. Its state is a `DPAccumulateState`.

    Raises:
      TypeError: If `inner` or `privatizer` is not a gradient transformation,
        `key` is not a key, an argument is a JAX array where a Python value is
        needed, or `close` is not a boolean scalar.
      ValueError: For a refused argument or layout (above), a bad value, a
        missing `noise_multiplier` or `key`, or `close=` without
        `every_k_schedule=None` (or the reverse).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from gradaccum_jax import privacy
      >>> tx = privacy.dp_accumulate(
      ...     optax.sgd(1.0), 2, l2_clip_norm=1.0, noise_multiplier=0.0,
      ...     expected_batch_size=4, key=jax.random.key(0))
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.array([1.0, 0.0])}, state)
      >>> u["w"]  # a micro-step: exact zeros
      Array([0., 0.], dtype=float32)
      >>> u, state = tx.update({"w": jnp.array([1.0, 2.0])}, state)
      >>> u["w"]  # -1.0 * (sum of the two sums) / 4
      Array([-0.5, -0.5], dtype=float32)

    References:
      Abadi et al., *Deep Learning with Differential Privacy*, 2016,
      https://arxiv.org/abs/1607.00133
    """
    _refuse_options(
        use_grad_mean=use_grad_mean,
        skip_nonfinite=skip_nonfinite,
        should_skip_update_fn=should_skip_update_fn,
    )
    validation.check_gradient_transformation("inner", inner)
    _check_static(
        every_k_schedule=every_k_schedule,
        l2_clip_norm=l2_clip_norm,
        expected_batch_size=expected_batch_size,
        noise_multiplier=noise_multiplier,
    )
    by_caller = every_k_schedule is None
    if not by_caller and not callable(every_k_schedule):
        validation.check_int("every_k_schedule", every_k_schedule, schedule=True)
    l2_clip_norm = validation.check_real("l2_clip_norm", l2_clip_norm, minimum=0.0, exclusive=True)
    expected_batch_size = validation.check_real(
        "expected_batch_size", expected_batch_size, minimum=0.0, exclusive=True
    )
    _check_noise_args(privatizer, noise_multiplier, key)
    validation.check_accumulator_dtype(accumulator_dtype)
    axis_names = None if axis_name is None else validation.check_axis_name("axis_name", axis_name)
    if privatizer is None:
        privatizer = _gaussian_noise(float(noise_multiplier) * l2_clip_norm, key)  # type: ignore[arg-type]
    plan = stages.Plan(
        inner=_closing(privatizer, expected_batch_size, inner),
        every_k_schedule=_NEVER if by_caller else every_k_schedule,
        use_grad_mean=False,
        accumulator_dtype=accumulator_dtype,
        compensated=False,
        skip_nonfinite=False,
        axis_names=axis_names,
        should_skip_update_fn=None,
        count_skipped_steps=True,
        check_values=False,
        shard_inner_state=None,
        zero_axes=None,
        track_noise_scale=False,
        noise_scale_decay=0.99,
        micro_batch_size=None,
        refuse=_refuse_route,
        state_type=CallerClosedAccumulateState if by_caller else AccumulateState,
        window=_WINDOW,
    )

    def init_fn(params: optax.Params) -> DPAccumulateState:
        return DPAccumulateState(stages.init(plan, params))

    def update_fn(
        updates: optax.Updates,
        state: DPAccumulateState,
        params: optax.Params | None = None,
        *,
        close: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, DPAccumulateState]:
        if "weight" in extra_args:
            raise ValueError(f"dp_accumulate's update does not take weight=: {_REFUSED['weight']}")
        _check_clip_norm(updates, l2_clip_norm)
        flag = _check_close(close, by_caller, axis_names)
        new_updates, window = stages.update(
            plan, updates, state.window, params, None, extra_args, flag
        )
        return new_updates, DPAccumulateState(window)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
