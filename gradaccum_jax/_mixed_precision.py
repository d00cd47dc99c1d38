"""Loss scaling for float16 training that survives gradient accumulation."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _validation, _window
from gradaccum_jax._accumulation import AxisName


class LossScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scale` and :func:`static_loss_scale`.

    Attributes:
      loss_scale: ``float32[]``. The factor to multiply the next loss by
        (read it with :func:`current_loss_scale`); ``update`` divides the
        gradients it receives by this value.
      growth_count: ``int32[]``. Finite ``update`` calls since the scale last
        changed, in ``[0, growth_interval)``; always ``0`` for a static scale.
      num_overflows: ``int32[]``. ``update`` calls whose gradients had a
        non-finite value. Saturates at the int32 maximum.
    """

    loss_scale: jax.Array
    growth_count: jax.Array
    num_overflows: jax.Array


_Adjust = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _loss_scaling(
    initial_scale: float, adjust: _Adjust, axis_name: AxisName | None
) -> optax.GradientTransformationExtraArgs:
    """The transformation shared by both scales; ``adjust(scale, count, finite)``."""

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
        _validation.check_float_tree("updates", updates)
        # Unscaled into float32 at least: back in float16, the small gradients
        # that the scale kept from underflowing would flush to zero again.
        grads = jax.tree.map(
            lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)) / state.loss_scale,
            updates,
        )
        finite = _window.all_finite(grads)
        if axis_name is not None:
            # One scalar per micro-step keeps every replica's scale identical.
            finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0
        scale, count = adjust(state.loss_scale, state.growth_count, finite)
        new_state = LossScaleState(
            loss_scale=scale.astype(jnp.float32),
            growth_count=count.astype(jnp.int32),
            num_overflows=_window.increment_if(state.num_overflows, ~finite),
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

    float16 has 5 exponent bits: gradients below about ``6e-8`` flush to zero
    and values above ``65504`` overflow. Multiplying the loss by a scale ``s``
    moves the backward pass into the representable range; this transformation
    divides each gradient by the ``s`` it was computed with (into float32, or
    wider) and then adapts ``s`` for the next call:

    .. math::

        s_{t+1} =
        \begin{cases}
          \max(\beta s_t,\ s_{\min}) & \text{if } g_t \text{ has a non-finite value,}\\
          \gamma s_t & \text{if the last } N \text{ calls were finite,}\\
          s_t & \text{otherwise,}
        \end{cases}

    with ``β = backoff_factor``, ``γ = growth_factor`` and
    ``N = growth_interval``; growth is skipped if ``γ s_t`` would not be
    finite.

    Put it first in an ``optax.chain`` before :func:`accumulate`, and scale
    each micro-batch's loss by :func:`current_loss_scale` of the state you
    pass to ``update`` (:func:`scale_loss` does that for any loss function).
    Every ``update`` call is a micro-step: the scale may change inside a
    window, and each micro-gradient is unscaled by its own scale before it is
    added. An overflowing micro-gradient stays non-finite after unscaling, so
    :func:`accumulate` drops it from the window's mean (and counts it in
    ``num_skipped``) while the other micro-gradients still make an update.
    ``growth_interval`` therefore counts micro-steps.

    Without :func:`accumulate` downstream, non-finite gradients reach the
    optimizer; use ``accumulate(inner, 1)`` as a guard that skips them.

    Args:
      initial_scale: The first loss scale, finite and ``> 0``. Powers of two
        make unscaling exact.
      growth_interval: Number ``N >= 1`` of consecutive finite micro-steps
        after which the scale grows.
      growth_factor: Factor ``γ >= 1`` applied on growth.
      backoff_factor: Factor ``β`` in ``(0, 1]`` applied on overflow.
      min_scale: Floor of the scale, finite, ``> 0`` and at most
        ``initial_scale``.
      axis_name: Name (or tuple of names) of a mapped axis, for use inside
        ``jax.shard_map`` or ``jax.pmap``: an overflow on any replica then
        counts on all of them (one scalar ``pmin`` per micro-step), so the
        replicas keep one scale. Without it each replica adapts its own.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state
      :class:`LossScaleState`. Its ``update`` returns the unscaled gradients,
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
    initial_scale = _validation.check_real(
        "initial_scale", initial_scale, minimum=0.0, exclusive=True
    )
    growth_interval = _validation.check_int("growth_interval", growth_interval)
    growth_factor = _validation.check_real("growth_factor", growth_factor, minimum=0.0)
    if growth_factor < 1:
        raise ValueError(
            f"growth_factor must be >= 1 (1 never grows the scale); got {growth_factor=}."
        )
    backoff_factor = _validation.check_real(
        "backoff_factor", backoff_factor, minimum=0.0, exclusive=True
    )
    if backoff_factor > 1:
        raise ValueError(
            f"backoff_factor must be in (0, 1] (0.5 halves the scale); got {backoff_factor=}."
        )
    min_scale = _validation.check_real("min_scale", min_scale, minimum=0.0, exclusive=True)
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

    The fixed-scale counterpart of :func:`dynamic_loss_scale`, with the same
    state (:class:`LossScaleState`), so that switching between them keeps
    checkpoints and train steps unchanged. Overflows are counted in
    ``num_overflows`` but do not change the scale; :func:`accumulate` after it
    still drops the overflowing micro-gradients.

    Args:
      loss_scale: The scale, finite and ``> 0``.
      axis_name: As in :func:`dynamic_loss_scale`: a mapped axis over which
        overflows are counted alike.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` returns the
      gradients divided by ``loss_scale``, in float32 for 16-bit inputs.

    Raises:
      TypeError: If ``loss_scale`` is not a real number.
      ValueError: If ``loss_scale`` is not finite and ``> 0``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> tx = ga.static_loss_scale(128.0)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> g, state = tx.update({"w": jnp.array([64.0, 256.0], jnp.float16)}, state)
      >>> g["w"]
      Array([0.5, 2. ], dtype=float32)
    """
    loss_scale = _validation.check_real("loss_scale", loss_scale, minimum=0.0, exclusive=True)
    return _loss_scaling(loss_scale, lambda scale, count, finite: (scale, count), axis_name)


def current_loss_scale(opt_state: optax.OptState) -> jax.Array:
    """Returns the loss scale to multiply the next loss by.

    Reads the :class:`LossScaleState` found anywhere inside ``opt_state``
    (directly, or in a chain, ``optax.masked`` or ``inject_hyperparams``
    state).

    Args:
      opt_state: An optimizer state that contains exactly one
        :class:`LossScaleState`.

    Returns:
      A ``float32`` scalar.

    Raises:
      ValueError: If ``opt_state`` contains no or several ``LossScaleState``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = optax.chain(ga.static_loss_scale(256.0), ga.accumulate(optax.sgd(0.1), 4))
      >>> float(ga.current_loss_scale(tx.init({"w": jnp.zeros(3)})))
      256.0
    """
    state = _validation.find_unique_state(
        opt_state, LossScaleState, "gradaccum_jax.dynamic_loss_scale or static_loss_scale"
    )
    return state.loss_scale


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
    """Wraps a loss function so that its gradients come out multiplied by ``loss_scale``.

    The wrapped function has ``fun``'s signature and returns ``fun``'s value
    (and ``aux``) unchanged; only the cotangent entering the backward pass is
    multiplied by the scale, which is what multiplying the loss by it would
    do. Any gradient maker can take it: ``jax.grad``, ``jax.value_and_grad``,
    ``nnx.grad``, or a micro-batching loop such as
    ``gradaccum_jax.microbatch_value_and_grad``.

    The product is formed in the loss's dtype: compute the loss in float32
    (cast the logits up) so that scales above float16's maximum, 65504, stay
    usable.

    Args:
      fun: The loss function. It returns a scalar, or ``(scalar, aux)`` when
        ``has_aux`` is true.
      loss_scale: The scale, usually :func:`current_loss_scale` of the
        optimizer state; a finite scalar ``> 0`` (traced values are checked
        for shape and dtype only).
      has_aux: Whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function with ``fun``'s signature and outputs.

    Raises:
      TypeError: If ``fun`` is not callable or ``loss_scale`` is not a real
        scalar.
      ValueError: If a concrete ``loss_scale`` is not finite and ``> 0``.

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
    scale = _validation.check_scalar("loss_scale", loss_scale, minimum=0.0, exclusive=True)

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
