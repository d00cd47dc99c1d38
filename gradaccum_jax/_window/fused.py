"""`apply_gradients`: the optimizer step with the params updated inside the window's close.

Through the optax API every micro-step of `accumulate` returns a tree of zero
updates and `optax.apply_updates` reads the params and those zeros and writes
the params back: about 8 parameter-sized passes where the add into the
accumulator needs 3. `apply_gradients` asks `accumulate` to update the params
itself, in the conditional's apply branch, and to pass them through the skip
branch untouched: in a donated step the params then stay in place on the
micro-steps.

The request travels as a private extra argument of `update`, which
`optax.chain` and `optax.inject_hyperparams` forward to their elements (and
`optax.with_extra_args_support` drops for those that take none). `accumulate`
strips it before its inner transformation sees the extra arguments and
signs a `Receipt`: `apply_gradients` keeps the fused result only if exactly
one `accumulate` answered and its output reached the caller unchanged;
otherwise it falls back to `update` + `optax.apply_updates`, which is always
right (under `jit` the discarded trace is dead code).

A second private extra argument, a `Survey`, asks without changing anything:
the `accumulate` that receives it writes down the mapped axes its window
reduces over. The Flax containers ask it where fp8 metadata take their max
over the same axes at the close (`flax/_fp8.py`), so that `axis_name` is given
once, to `accumulate`.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from gradaccum_jax._base import equinox
from gradaccum_jax._window import placement
from gradaccum_jax._window.state import AccumulateState

# The private extra argument that asks `accumulate` for new params instead of updates.
FUSE_KEY = "_gradaccum_jax_apply_to_params"

# The private extra argument that asks `accumulate` which mapped axes its window reduces over.
SURVEY_KEY = "_gradaccum_jax_window_axes"

_WRAPPERS = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


class Receipt:
    """What `accumulate` signs when it answers the request: how often, and what it returned."""

    def __init__(self) -> None:
        self.calls = 0
        self.output: Any = None
        self.vouched: list[tuple[Any, list[Any], jax.Array]] = []

    def received(self, params: Any) -> None:
        if params is None:
            raise ValueError(
                "apply_gradients updates the params inside accumulate, so update needs them: "
                "pass params."
            )
        self.calls += 1

    def returned(self, output: Any) -> None:
        self.output = output

    def vouch(self, tree: Any, finite: jax.Array) -> None:
        """A transformation states that `finite` is whether every element of `tree` is.

        A clip that measured its input's norm knows this already (see
        `clip_norm`); the `accumulate` that receives exactly these leaves
        then skips its own pass over them.
        """
        leaves, treedef = jax.tree.flatten(tree)
        self.vouched.append((treedef, leaves, finite))

    def finite(self, tree: Any) -> jax.Array | None:
        """The flag vouched for `tree`'s very leaves (the same objects), or None."""
        leaves, treedef = jax.tree.flatten(tree)
        for known_def, known, finite in self.vouched:
            if known_def == treedef and len(known) == len(leaves):
                if all(a is b for a, b in zip(known, leaves, strict=True)):
                    return finite
        return None


class Survey:
    """The mapped axes over which the `accumulate` that received it reduces its window.

    `accumulate` takes it out of the extra arguments, so one nested in another's
    inner transformation never sees it: the answer is the outermost window's.
    """

    def __init__(self) -> None:
        self.axis_names: tuple[Any, ...] | None = None

    def answer(self, axis_names: tuple[Any, ...] | None) -> None:
        self.axis_names = axis_names


def _ends_in_accumulate(state: Any) -> bool:
    """Whether `state` is an `AccumulateState`, or a chain or injected state that ends in one."""
    if isinstance(state, AccumulateState):
        return True
    if isinstance(state, _WRAPPERS):
        return _ends_in_accumulate(state.inner_state)
    # optax.chain's state is a plain tuple, one state per element, in order.
    return type(state) is tuple and bool(state) and _ends_in_accumulate(state[-1])


def _unchanged(out: Any, returned: Any) -> bool:
    out_leaves, out_def = jax.tree.flatten(out)
    ret_leaves, ret_def = jax.tree.flatten(returned)
    if out_def != ret_def:  # type: ignore[operator]  # jaxlib's PyTreeDef stub
        return False
    return all(a is b for a, b in zip(out_leaves, ret_leaves, strict=True))


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
    """One optimizer step: `tx.update` then `optax.apply_updates`, fused where `tx` accumulates.

    For any optax transformation it returns what

    ```python
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    params = optax.apply_updates(params, updates)
    ```

    returns. When `tx` is `gradaccum_jax.accumulate(...)` alone, the last
    element of an `optax.chain`, or under `optax.inject_hyperparams`, the
    params are updated inside the window's close instead: a micro-step
    reads the gradient and the accumulator and writes the accumulator,
    and passes the params through untouched (no parameter-sized zero
    updates, no parameter-sized temporary). In a jitted step that donates
    the params and the state, they stay in place. The params come out as
    through the optax path up to float32 rounding: XLA may fuse the apply
    branch that also updates the params differently, and with its default
    flags on CPU a few elements in a hundred end one ulp apart after a few
    windows (tests/test_fused.py holds the two paths to a relative 2e-6).
    Anything else
    (`optax.masked`, accumulate followed by another transformation, a
    custom wrapper) takes the optax path.

    An `equinox.Module` as `params` is taken as `eqx.apply_updates` takes
    it: its floating-point arrays are what `tx` sees and updates (initialise
    the state with `tx.init(eqx.filter(model, eqx.is_inexact_array))`, the
    structure of `eqx.filter_grad`'s gradients), and the rest (activation
    functions, Python numbers, integer arrays) comes back as it went in.

    Args:
      tx: Any optax gradient transformation.
      grads: The gradients, a tree like `params`.
      opt_state: `tx`'s state.
      params: The params to update: a pytree of arrays or an `equinox.Module`.
      **extra_args: Passed to `tx.update` (`weight=`, `value=`, ...).

    Returns:
      `(new_params, new_opt_state)`: for a donated jitted step, return them
      in this order and donate `(params, opt_state)` so that each buffer
      aliases its own successor.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = ga.accumulate(optax.sgd(0.1), every_k_schedule=2)
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> state = tx.init(params)
      >>> step = jax.jit(
      ...     lambda p, s, g: ga.apply_gradients(tx, g, s, p), donate_argnums=(0, 1)
      ... )
      >>> params, state = step(params, state, {"w": jnp.array([1.0, 1.0])})
      >>> params["w"]  # micro-step: unchanged
      Array([1., 2.], dtype=float32)
      >>> params, state = step(params, state, {"w": jnp.array([3.0, 3.0])})
      >>> params["w"]  # 1 - 0.1 * mean([1, 3])
      Array([0.8, 1.8], dtype=float32)
    """
    placement.check_state(opt_state)
    if equinox.holds_module(params):
        arrays, rest = equinox.partition(params)
        new_arrays, new_state = _apply(tx, grads, opt_state, arrays, extra_args)
        return equinox.combine(new_arrays, rest), new_state
    return _apply(tx, grads, opt_state, params, extra_args)


def _apply(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    extra_args: dict[str, Any],
) -> tuple[optax.Params, optax.OptState]:
    """`apply_gradients` on a pytree of arrays."""
    if _ends_in_accumulate(opt_state):
        receipt = Receipt()
        try:
            new_params, new_state = tx.update(
                grads, opt_state, params, **extra_args, **{FUSE_KEY: receipt}
            )
        except TypeError:
            # An element that refuses unknown extra arguments: the optax path
            # below raises again if the error was not about this one.
            receipt.calls = 0
        if receipt.calls == 1 and _unchanged(new_params, receipt.output):
            return new_params, new_state
    updates, new_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), new_state
