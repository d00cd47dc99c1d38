"""The window's loss value: what an inner optimizer that reads `value=` receives.

Optimizers that read the loss (`optax.contrib.reduce_on_plateau`, `optax.contrib.momo`,
`optax.polyak_sgd`) take `update(..., value=loss)` as the loss at the params the gradient
was taken at. In a window that loss is the large batch's: the micro-batches' values,
reduced like their gradients. A window (`accumulate`, `conditional_accumulate`) asks at
`init` whether its inner optimizer reads `value=` (`reads_value`) and then holds the
window's sum of values beside the gradients'.

A line search (`optax.lbfgs`, `scale_by_zoom_linesearch`,
`scale_by_backtracking_linesearch`) evaluates `value_fn` at trial params: a function of
one batch, which a window of micro-batches cannot give it. The windows refuse it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._base import validation

# Inner states whose optimizer reads `value=` once per update, at the params given.
_READERS: tuple[type, ...] = (
    optax.contrib.ReduceLROnPlateauState,
    optax.contrib.MomoState,
    optax.contrib.MomoAdamState,
)
# Inner states of optimizers that call `value_fn` at trial params.
_LINE_SEARCHES: tuple[type, ...] = (
    optax.ScaleByZoomLinesearchState,
    optax.ScaleByBacktrackingLinesearchState,
)


def _found(tree: Any, types: tuple[type, ...]) -> list[Any]:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, types))
    return [leaf for leaf in leaves if isinstance(leaf, types)]


def reads_value(inner: Any, inner_state: Any, grads: Any, params: Any) -> bool:
    """Whether `inner` reads `value=`: its state says so, or its update depends on it.

    The state names the readers that keep one (`reduce_on_plateau`, `momo`); a reader
    without state of its own (`optax.polyak_sgd`, one of the user's) shows itself only in
    what its update computes (`update_reads_value`).

    Args:
      inner: The inner transformation, with extra-args support.
      inner_state: `inner.init(params)`.
      grads: A tree shaped like the gradients `inner` receives.
      params: The params `inner` receives.
    """
    return bool(_found(inner_state, _READERS)) or update_reads_value(
        inner.update, inner_state, grads, params
    )


def update_reads_value(update: Any, state: Any, grads: Any, params: Any) -> bool:
    """Whether the result of `update(grads, state, params, value=v)` depends on `v`.

    Traced once, on abstract values (nothing runs, nothing compiles), and the traced
    program asked whether `v` is an operand of anything. An update that cannot be traced
    with `value=` alone (one that needs another extra argument, or a collective over a
    named axis) reads nothing this can see: `False`.
    """

    def probe(grads: Any, state: Any, params: Any, value: jax.Array) -> Any:
        return update(grads, state, params, value=value)

    try:
        traced = jax.make_jaxpr(probe)(grads, state, params, jnp.zeros([], jnp.float32))
    except Exception:  # it cannot run on value= alone: only its state can tell
        return False
    program = traced.jaxpr
    value = program.invars[-1]
    operands = [v for eqn in program.eqns for v in eqn.invars] + list(program.outvars)
    return any(v is value for v in operands)


def refuse_line_search(inner_state: Any, who: str) -> None:
    """Raises `ValueError` if `inner_state` holds a line search's state."""
    found = _found(inner_state, _LINE_SEARCHES)
    if found:
        raise ValueError(
            f"inner holds a line search ({type(found[0]).__qualname__}, as in optax.lbfgs), "
            f"refused inside {who}: it calls value_fn at trial params, and no function of a "
            "micro-batch gives the window's loss there. Take the whole batch in one step: "
            "value, grad = ga.microbatch_value_and_grad(loss_fn, K)(params, batch), then "
            "optax.lbfgs().update(grad, state, params, value=value, grad=grad, "
            "value_fn=lambda p: loss_fn(p, batch)), not accumulated; or accumulate "
            "optax.lbfgs(linesearch=None), which reads no value."
        )


def initial(inner: Any, inner_state: Any, grads: Any, params: Any, dtype: Any) -> jax.Array | None:
    """The window's sum of values at `init`: a zero of `dtype` if `inner` reads `value=`
    (`reads_value`), else `None`."""
    return jnp.zeros([], dtype) if reads_value(inner, inner_state, grads, params) else None


def receive(
    extra_args: dict[str, Any], held: jax.Array | None, who: str = "update"
) -> jax.Array | None:
    """Takes `value` out of `extra_args` where the window holds one; checks it.

    `who` is how the error names the call that got no `value=`.
    """
    if held is None:
        return None
    if "value" not in extra_args:
        raise TypeError(
            f"{who} got no value=, but the inner optimizer reads the loss "
            "(optax.contrib.reduce_on_plateau, momo, optax.polyak_sgd, ...): pass the "
            "micro-batch's loss on every micro-step, tx.update(grads, state, params, "
            "value=loss), not only where the window closes; the window's mean of them, "
            "weighted like the gradients, reaches the inner optimizer."
        )
    value = extra_args.pop("value")
    return validation.check_scalar(
        "value",
        value,
        dtype=held.dtype,
        hint=" It is the micro-batch's loss, the mean over its examples (as for the gradient).",
    )


def add(
    held: jax.Array, value: jax.Array, accepted: jax.Array, weight: jax.Array | None
) -> jax.Array:
    """The window's sum of values `Σ w · value` (`w = 1` without `weight=`), this one included.

    In absolute units (not the gradients' `weight_unit`): the sums of replicas add up.
    """
    term = value if weight is None else weight.astype(held.dtype) * value
    return held + jnp.where(accepted, term, jnp.zeros_like(held))


def of_window(total: jax.Array, weight: jax.Array, use_grad_mean: bool) -> jax.Array:
    """The value the inner optimizer receives: the weighted mean (or the sum), as the gradient.

    `weight` is the window's total weight in absolute units.
    """
    return total / weight if use_grad_mean else total
