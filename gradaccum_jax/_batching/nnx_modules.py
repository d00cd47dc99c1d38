"""`flax.nnx` modules passed straight to `microbatch_value_and_grad`.

A module at a differentiated position is split into its `nnx.Param` state
(differentiated) and the rest (carried through the micro-batches and written
back), as `nnx.value_and_grad` would take it. flax is looked up only if the
caller imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from gradaccum_jax._base import reduce_rules
from gradaccum_jax._batching.splitting import _carry_argnums, _is_typed_key, _Options


def module_positions(args: tuple[Any, ...], options: _Options) -> tuple[int, ...]:
    """The differentiated positions that hold a `flax.nnx.Module`."""
    return modules_at(args, options.grad_nums)


def modules_at(args: tuple[Any, ...], positions: tuple[int, ...]) -> tuple[int, ...]:
    """Those of `positions` at which `args` holds a `flax.nnx.Module`."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return ()
    return tuple(i for i in positions if i < len(args) and isinstance(args[i], nnx.Module))


def differentiated(nnx: Any, options: _Options) -> Any:
    """The filter of a module's differentiated state: `nnx.Param`, and fp8 metadata.

    Flax's fp8 layers (linen, under `nnx.bridge`) update their scales and amax
    histories through the gradients of their `_overwrite_with_gradient`
    variables; under `max_leaves="auto"` those are differentiated as well, so
    that the gradient returns their new values (`_base/reduce_rules.py`).
    """
    if options.max_leaves != "auto":
        return nnx.Param
    return nnx.Any(nnx.Param, lambda path, value: reduce_rules.is_fp8_variable(value))


def value_and_grad(
    fun: Callable[..., Any],
    options: _Options,
    modules: tuple[int, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    build: Callable[[Callable[..., Any], _Options], Callable[..., Any]],
) -> Any:
    """`nnx.value_and_grad` over micro-batches for the `flax.nnx` modules at `modules`.

    As `nnx.value_and_grad` does, each module is split into its `nnx.Param`
    state, which is differentiated (its gradient is an `nnx.State` of the
    params), and the rest (BatchNorm statistics, the RNG streams' counters),
    which here is threaded through the micro-batches as a carry, so that every
    micro-batch draws its own dropout mask, and written back into the module.
    `build(pure_fun, pure_options)` is the micro-batched value and gradient of
    a function of plain pytrees (`microbatch_value_and_grad`'s own).
    """
    nnx = sys.modules["flax.nnx"]
    if options.carry_nums:
        raise TypeError(
            f"microbatch_value_and_grad got a flax.nnx module at argnums position(s) "
            f"{modules} together with carry_argnums={_carry_argnums(options)!r}. A module's "
            "non-parameter state (BatchNorm statistics, RNG counters) is carried through the "
            "micro-batches already; carry other state inside the module, or split the "
            "model yourself: graphdef, params, rest = nnx.split(model, nnx.Param, ...), "
            "differentiate params and carry rest (see the Flax NNX section of the "
            "micro-batching guide)."
        )
    if options.statistics_fn is not None:
        raise TypeError(
            f"microbatch_value_and_grad got a flax.nnx module at argnums position(s) "
            f"{modules} together with statistics_fn: its first pass cannot replay the "
            "module's carried state (RNG counters). Split the model yourself: graphdef, "
            "params, rest = nnx.split(model, nnx.Param, ...), and pass params to a loss "
            "that merges them (see the Flax NNX section of the micro-batching guide)."
        )
    wrt = differentiated(nnx, options)
    splits = {i: nnx.split(args[i], wrt, ...) for i in modules}
    rest_at = len(args)  # the modules' other state, appended as one carried argument

    def pure_fun(*pure_args: Any, **kw: Any) -> Any:
        *call_args, rests = pure_args
        merged = {}
        for i, (graphdef, _, _) in splits.items():
            merged[i] = nnx.merge(graphdef, call_args[i], rests[i], copy=True)
            call_args[i] = merged[i]
        out = fun(*call_args, **kw)
        loss, aux = out if options.has_aux else (out, None)
        new_rests = {i: nnx.state(model, nnx.Not(wrt)) for i, model in merged.items()}
        return loss, (new_rests, aux)

    weight_fn = options.weight_fn
    pure_options = options._replace(
        has_aux=True,
        carry_nums=(rest_at,),
        carry_is_tuple=False,
        weight_fn=None if weight_fn is None else (lambda *a, **kw: weight_fn(*a[:-1], **kw)),
    )
    pure_args = list(args)
    for i, (_, params, _) in splits.items():
        pure_args[i] = params
    rests = {i: rest for i, (_, _, rest) in splits.items()}
    (value, (new_rests, aux)), grads = build(pure_fun, pure_options)(*pure_args, rests, **kwargs)
    for i, rest in new_rests.items():
        nnx.update(args[i], rest)
    return ((value, aux) if options.has_aux else value), grads


class PureCoupled(NamedTuple):
    """`coupled_value_and_grad`'s functions and arguments with the module split."""

    loss_fn: Callable[..., Any]
    embed_fn: Callable[..., Any]
    options: _Options
    args: tuple[Any, ...]
    finish: Callable[[Any], Any]  # the result on plain pytrees -> the caller's result


def split_for_coupled(
    loss_fn: Callable[..., Any],
    embed_fn: Callable[..., Any],
    options: _Options,
    args: tuple[Any, ...],
    device_keys: Callable[[Any], Any],
) -> PureCoupled:
    """A `flax.nnx` module in the params' place of `coupled_value_and_grad`.

    As in `value_and_grad`: its `nnx.Param` state is differentiated, and the
    rest (RNG streams' counters, BatchNorm statistics) is carried through the
    micro-batches of `embed_fn`, replayed by the second pass, and written back
    into the module from the first. `loss_fn` gets the module with the params
    being differentiated and the rest as it came in. `device_keys` folds this
    device's position into the RNG streams' keys for the calls of `embed_fn`;
    the keys written back are the module's own.
    """
    nnx = sys.modules["flax.nnx"]
    if options.carry_nums:
        raise TypeError(
            f"coupled_value_and_grad got a flax.nnx module as params together with "
            f"carry_argnums={_carry_argnums(options)!r}. A module's other state (BatchNorm "
            "statistics, RNG counters) is carried through the micro-batches already; keep "
            "the state inside the module, or pass plain pytrees."
        )
    module = args[0]
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def pure_embed(p: Any, *call_args: Any, **kw: Any) -> Any:
        *batch_args, rest_now = call_args
        model = nnx.merge(graphdef, p, device_keys(rest_now), copy=True)
        out = embed_fn(model, *batch_args, **kw)
        new_rest = nnx.state(model, nnx.Not(nnx.Param))
        # An RNG stream moves its count, never its key: keep the module's own keys.
        kept = jax.tree.map(lambda n, o: o if _is_typed_key(o) else n, new_rest, rest_now)
        return out, kept

    def pure_loss(p: Any, reps: Any) -> Any:
        return loss_fn(nnx.merge(graphdef, p, rest, copy=True), reps)

    def finish(out: Any) -> Any:
        (value, (new_rest, aux)), grads = out
        nnx.update(module, new_rest)
        return ((value, aux) if options.has_aux else value), grads

    pure_options = options._replace(carry_nums=(len(args),), carry_is_tuple=False)
    return PureCoupled(pure_loss, pure_embed, pure_options, (params, *args[1:], rest), finish)
