"""Loss scaling for float16 training that survives gradient accumulation."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax._base import compat, trees, validation
from gradaccum_jax._window import placement
from gradaccum_jax._window.state import AccumulateState, AxisName, LossScaleState

_F32 = np.finfo(np.float32)
_RIGHT_ORDER = (
    "optax.chain(ga.dynamic_loss_scale(), ga.accumulate(inner, every_k_schedule)) "
    "(or static_loss_scale in the same place)"
)


def _check_float32_factor(name: str, value: Any, *, at_most_one: bool = False) -> float:
    """Returns `value` if it is a normal, finite float32 `> 0`, else raises `ValueError`.

    Scales live in a `float32[]` state, so a Python float that passes as
    finite and positive can still overflow to `inf` (`1e39`) or flush to `0`
    (`1e-50`, or a subnormal that XLA:CPU flushes) once it is used.
    """
    value = validation.check_real(name, value, minimum=0.0, exclusive=True)
    largest, smallest = float(_F32.max), float(_F32.tiny)
    if not smallest <= value <= largest:
        becomes = "inf" if value > largest else "0 (or a subnormal that XLA may flush to 0)"
        raise ValueError(
            f"{name} must be a normal float32 number, in [{smallest:.4g}, {largest:.4g}], "
            f"because the loss scale is stored and applied in float32; got {name}={value!r}, "
            f"which is {becomes} in float32. Use a power of two such as 2.0**15."
        )
    if at_most_one and value > 1:
        raise ValueError(f"{name} must be in (0, 1] (0.5 halves the scale); got {name}={value!r}.")
    return value


def refuse_inside_accumulate(inner_state: Any) -> None:
    """Raises `ValueError` if `inner_state` (an `accumulate`'s inner state) holds a loss scale.

    Inside `accumulate` a loss scale would see one mean gradient per window
    instead of every micro-gradient: overflowing micro-gradients are dropped
    by `accumulate` before it sees them, so a dynamic scale never backs off,
    and training stalls with the scale stuck.
    """
    found = jax.tree.leaves(inner_state, is_leaf=lambda x: isinstance(x, LossScaleState))
    if any(isinstance(x, LossScaleState) for x in found):
        raise ValueError(
            "A dynamic_loss_scale or static_loss_scale is inside gradaccum_jax.accumulate "
            "(in its inner transformation). There it would see one mean gradient per window, "
            "not each micro-gradient: overflowing micro-gradients are dropped before it sees "
            "them, so the scale never backs off and no update is applied. Put the loss scale "
            f"first, before accumulate: {_RIGHT_ORDER}."
        )


def _find_loss_scale_state(opt_state: optax.OptState) -> LossScaleState:
    placement.check_state(opt_state)
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, AccumulateState)):
        if isinstance(node, AccumulateState):
            refuse_inside_accumulate(node.inner_state)
    return validation.find_unique_state(
        opt_state, LossScaleState, "gradaccum_jax.dynamic_loss_scale or static_loss_scale"
    )


_Adjust = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _loss_scaling(
    initial_scale: float, adjust: _Adjust, axis_name: AxisName | None
) -> optax.GradientTransformationExtraArgs:
    """The transformation shared by both scales; `adjust(scale, count, finite)`."""

    def init_fn(params: optax.Params) -> LossScaleState:
        del params
        return LossScaleState(
            loss_scale=jnp.asarray(initial_scale, jnp.float32),
            growth_count=jnp.zeros([], jnp.int32),
            num_overflows=jnp.zeros([], jnp.int32),
        )

    def update_fn(
        updates: optax.Updates,
        state: LossScaleState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaleState]:
        del params, extra_args
        placement.refuse_window_output(updates, "the loss scale")
        validation.check_float_tree("updates", updates)
        validation.refuse_unreduced("updates", updates, "the loss scale")
        # Unscaled into float32 at least: back in float16, the small gradients
        # that the scale kept from underflowing would flush to zero again.
        grads = jax.tree.map(
            lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)) / state.loss_scale,
            updates,
        )
        finite = trees.all_finite(grads)
        if axis_name is not None:
            # One scalar per micro-step keeps every replica's scale identical.
            finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0
        scale, count = adjust(state.loss_scale, state.growth_count, finite)
        new_state = LossScaleState(
            loss_scale=scale.astype(jnp.float32),
            growth_count=count.astype(jnp.int32),
            num_overflows=trees.increment_if(state.num_overflows, ~finite),
        )
        return grads, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dynamic_loss_scale(
    initial_scale: float = 2.0**15,
    *,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Unscales loss-scaled gradients and adapts the scale, one micro-step at a time.

    float16 has 5 exponent bits: gradients below about `6e-8` flush to zero
    and values above `65504` overflow. Multiplying the loss by a scale `s`
    moves the backward pass into the representable range; this transformation
    divides each gradient by the `s` it was computed with (into float32, or
    wider) and then adapts `s` for the next call:

    $$
    s_{t+1} =
    \begin{cases}
      \max(\beta s_t,\ s_{\min}) & \text{if } g_t \text{ has a non-finite value,}\\
      \gamma s_t & \text{if the last } N \text{ calls were finite,}\\
      s_t & \text{otherwise,}
    \end{cases}
    $$

    with `β = backoff_factor`, `γ = growth_factor` and
    `N = growth_interval`; growth is skipped if `γ s_t` would not be
    finite.

    Put it first in an `optax.chain` before `accumulate`, and scale
    each micro-batch's loss by `current_loss_scale` of the state you
    pass to `update` (`scale_loss` does that for any loss function).
    Every `update` call is a micro-step: the scale may change inside a
    window, and each micro-gradient is unscaled by its own scale before it is
    added. An overflowing micro-gradient stays non-finite after unscaling, so
    `accumulate` drops it from the window's mean (and counts it in
    `num_skipped`) while the other micro-gradients still make an update.
    `growth_interval` therefore counts micro-steps.

    Without `accumulate` downstream, non-finite gradients reach the
    optimizer; use `accumulate(inner, 1)` as a guard that skips them.

    Args:
      initial_scale: The first loss scale, finite and `> 0`. Powers of two
        make unscaling exact.
      growth_interval: Number `N >= 1` of consecutive finite micro-steps
        after which the scale grows.
      growth_factor: Factor `γ >= 1` applied on growth.
      backoff_factor: Factor `β` in `(0, 1]` applied on overflow.
      min_scale: Floor of the scale, finite, `> 0` and at most
        `initial_scale`.
      axis_name: Name (or tuple of names) of a mapped axis, for use inside
        `jax.shard_map` or `jax.pmap`: an overflow on any replica then
        counts on all of them (one scalar `pmin` per micro-step), so the
        replicas keep one scale. Without it each replica adapts its own.

    Returns:
      An `optax.GradientTransformationExtraArgs` with state
      `LossScaleState`. Its `update` returns the unscaled gradients,
      in float32 for 16-bit inputs, and ignores extra arguments.

    Raises:
      TypeError: If an argument has the wrong type.
      ValueError: If an argument is out of its range.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = optax.chain(
      ...     ga.dynamic_loss_scale(2.0**10, growth_interval=2),
      ...     ga.accumulate(optax.sgd(1.0), every_k_schedule=2),
      ... )
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> float(ga.current_loss_scale(state))
      1024.0
      >>> g = {"w": jnp.array([1024.0, jnp.inf], jnp.float16)}  # overflowed
      >>> u, state = tx.update(g, state)
      >>> float(ga.current_loss_scale(state))  # halved; micro-batch dropped
      512.0
      >>> u, state = tx.update({"w": jnp.array([512.0, 1024.0], jnp.float16)}, state)
      >>> u["w"]  # the window's mean is the one accepted gradient, unscaled
      Array([-1., -2.], dtype=float32)

    References:
      Micikevicius et al., *Mixed Precision Training*, 2017,
      https://arxiv.org/abs/1710.03740
    """
    initial_scale = _check_float32_factor("initial_scale", initial_scale)
    growth_interval = validation.check_int("growth_interval", growth_interval)
    growth_factor = _check_float32_factor("growth_factor", growth_factor)
    if growth_factor < 1:
        raise ValueError(
            f"growth_factor must be >= 1 (1 never grows the scale); got {growth_factor=}."
        )
    backoff_factor = _check_float32_factor("backoff_factor", backoff_factor, at_most_one=True)
    min_scale = _check_float32_factor("min_scale", min_scale)
    if min_scale > initial_scale:
        raise ValueError(
            f"min_scale must be <= initial_scale; got {min_scale=} and {initial_scale=}."
        )

    def adjust(scale, count, finite):
        counted = count + 1
        grow = finite & (counted >= growth_interval)
        grown = scale * growth_factor
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        shrunk = jnp.maximum(scale * backoff_factor, min_scale)
        new_scale = jnp.where(finite, jnp.where(grow, grown, scale), shrunk)
        return new_scale, jnp.where(finite & ~grow, counted, 0)

    return _loss_scaling(initial_scale, adjust, axis_name)


def static_loss_scale(
    loss_scale: float, *, axis_name: AxisName | None = None
) -> optax.GradientTransformationExtraArgs:
    """Unscales gradients computed with a fixed loss scale.

    The fixed-scale counterpart of `dynamic_loss_scale`, with the same
    state (`LossScaleState`), so that switching between them keeps
    checkpoints and train steps unchanged. Overflows are counted in
    `num_overflows` but do not change the scale; `accumulate` after it
    still drops the overflowing micro-gradients.

    Args:
      loss_scale: The scale, finite and `> 0`.
      axis_name: As in `dynamic_loss_scale`: a mapped axis over which
        overflows are counted alike.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose `update` returns the
      gradients divided by `loss_scale`, in float32 for 16-bit inputs.

    Raises:
      TypeError: If `loss_scale` is not a real number.
      ValueError: If `loss_scale` is not finite and `> 0`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.static_loss_scale(128.0)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> g, state = tx.update({"w": jnp.array([64.0, 256.0], jnp.float16)}, state)
      >>> g["w"]
      Array([0.5, 2. ], dtype=float32)
    """
    loss_scale = _check_float32_factor("loss_scale", loss_scale)
    return _loss_scaling(loss_scale, lambda scale, count, finite: (scale, count), axis_name)


def current_loss_scale(opt_state: optax.OptState) -> jax.Array:
    """Returns the loss scale to multiply the next loss by.

    Reads the `LossScaleState` found anywhere inside `opt_state`
    (directly, or in a chain, `optax.masked` or `inject_hyperparams`
    state).

    Args:
      opt_state: An optimizer state that contains exactly one
        `LossScaleState`.

    Returns:
      A `float32` scalar.

    Raises:
      ValueError: If `opt_state` contains no or several `LossScaleState`, or
        the loss scale is inside `accumulate` (it must come before it).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = optax.chain(ga.static_loss_scale(256.0), ga.accumulate(optax.sgd(0.1), 4))
      >>> float(ga.current_loss_scale(tx.init({"w": jnp.zeros(3)})))
      256.0
    """
    return _find_loss_scale_state(opt_state).loss_scale


@jax.custom_vjp
def _scale_cotangent(value: jax.Array, scale: jax.Array) -> jax.Array:
    return value


def _scale_cotangent_fwd(value, scale):
    return value, scale


def _scale_cotangent_bwd(scale, cotangent):
    return (cotangent * scale).astype(cotangent.dtype), jnp.zeros_like(scale)


_scale_cotangent.defvjp(_scale_cotangent_fwd, _scale_cotangent_bwd)


def scale_loss(
    fun: Callable[..., Any], loss_scale: jax.typing.ArrayLike, *, has_aux: bool = False
) -> Callable[..., Any]:
    """Wraps a loss function so that its gradients come out multiplied by `loss_scale`.

    The wrapped function has `fun`'s signature and returns `fun`'s value
    (and `aux`) unchanged; only the cotangent entering the backward pass is
    multiplied by the scale, which is what multiplying the loss by it would
    do. Any gradient maker can take it: `jax.grad`, `jax.value_and_grad`,
    `nnx.grad`, or a micro-batching loop such as
    `gradaccum_jax.microbatch_value_and_grad`.

    The product is formed in the loss's dtype: compute the loss in float32
    (cast the logits up) so that scales above float16's maximum, 65504, stay
    usable.

    Args:
      fun: The loss function. It returns a scalar, or `(scalar, aux)` when
        `has_aux` is true.
      loss_scale: The scale, usually `current_loss_scale` of the
        optimizer state; a normal float32 scalar `> 0` (traced values are
        checked for shape and dtype only).
      has_aux: Whether `fun` returns `(loss, aux)`.

    Returns:
      A function with `fun`'s signature and outputs.

    Raises:
      TypeError: If `fun` is not callable or `loss_scale` is not a real
        scalar.
      ValueError: If a concrete `loss_scale` is not a finite, normal float32
        number `> 0`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> loss = lambda w: jnp.sum(w**2)
      >>> value, grad = jax.value_and_grad(ga.scale_loss(loss, 1024.0))(jnp.array([1.0, 2.0]))
      >>> float(value), grad
      (5.0, Array([2048., 4096.], dtype=float32))
    """
    if not callable(fun):
        raise TypeError(f"fun must be a callable loss function; got {fun!r}.")
    scale = validation.check_scalar(
        "loss_scale", compat.plain_values(loss_scale), minimum=0.0, exclusive=True
    )

    @functools.wraps(fun)
    def scaled(*args: Any, **kwargs: Any) -> Any:
        out = fun(*args, **kwargs)
        if not has_aux:
            return _scale_cotangent(out, scale)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "with has_aux=True, fun must return a (loss, aux) pair; it returned "
                f"{type(out).__name__}."
            )
        return _scale_cotangent(out[0], scale), out[1]

    return scaled


def scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """`jax.value_and_grad` with the loss scaled by the scale in the optimizer state.

    With a loss scale in the optimizer, the loss of every micro-batch must be
    multiplied by the scale the state holds at that micro-step, or every
    update is silently divided by it. This wrapper takes the optimizer state
    as its first argument and reads the scale from it, so the scale the
    gradients were computed with and the scale `update` divides by are the
    same by construction:

    ```python
    grad_fn = ga.scaled_value_and_grad(loss_fn)
    loss, grads = grad_fn(opt_state, params, batch)  # grads are scaled
    updates, opt_state = tx.update(grads, opt_state, params)  # unscaled here
    ```

    The value (and `aux`) come back unscaled; the gradients come back
    multiplied by the scale, for the loss-scale transformation at the head of
    the chain to divide. What is checked: the optimizer state holds exactly
    one loss scale, and it is not inside `accumulate`. What cannot be
    checked: gradients computed some other way without the scale (for
    example with plain `jax.value_and_grad`) are indistinguishable from
    small gradients, so nothing detects them; use this wrapper, or
    `scale_loss` with `current_loss_scale(opt_state)` for another gradient
    maker (`nnx.value_and_grad`, `gradaccum_jax.microbatch_value_and_grad`).

    Args:
      fun: The loss function; a scalar, or `(scalar, aux)` with `has_aux`.
      argnums: Which of `fun`'s positional arguments to differentiate (the
        optimizer state is not counted), as in `jax.value_and_grad`.
      has_aux: Whether `fun` returns `(loss, aux)`.

    Returns:
      A function `(opt_state, *args, **kwargs) -> (value, grads)`, or
      `((value, aux), grads)` with `has_aux`, where `args` and `kwargs` are
      `fun`'s.

    Raises:
      TypeError: If `fun` is not callable.
      ValueError: When called, if `opt_state` holds no or several loss
        scales, or one inside `accumulate`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = optax.chain(ga.static_loss_scale(1024.0), ga.accumulate(optax.sgd(1.0), 1))
      >>> params = jnp.array([1.0, 2.0])
      >>> opt_state = tx.init(params)
      >>> loss, grads = ga.scaled_value_and_grad(lambda w: jnp.sum(w**2))(opt_state, params)
      >>> float(loss), grads  # the gradient 2w, times the scale
      (5.0, Array([2048., 4096.], dtype=float32))
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> updates  # unscaled before the optimizer: -1.0 * 2w
      Array([-2., -4.], dtype=float32)
    """
    if not callable(fun):
        raise TypeError(f"fun must be a callable loss function; got {fun!r}.")

    @functools.wraps(fun)
    def value_and_scaled_grad(opt_state: optax.OptState, *args: Any, **kwargs: Any) -> Any:
        scaled = scale_loss(fun, current_loss_scale(opt_state), has_aux=has_aux)
        return jax.value_and_grad(scaled, argnums=argnums, has_aux=has_aux)(*args, **kwargs)

    return value_and_scaled_grad
