"""`equinox` modules passed straight to `microbatch_value_and_grad`.

A module at a differentiated position is taken as `eqx.filter_value_and_grad`
takes it: its floating-point arrays are differentiated (the gradient is the
module with `None` in the other leaves' places), and the rest (activation
functions, Python numbers, integer arrays) reaches every micro-batch's call as
it came in. equinox is looked up only if the caller imported it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradaccum_jax._base import equinox
from gradaccum_jax._batching.splitting import _Options


def split(
    fun: Callable[..., Any], options: _Options, positions: tuple[int, ...], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], _Options, tuple[Any, ...]]:
    """`fun`, `options` and `args` on plain pytrees: the modules at `positions` split.

    `fun`, `weight_fn` and `statistics_fn` get each module back whole, its
    arrays those of the micro-step; the arguments hold only the arrays.
    """
    splits = {i: equinox.partition(args[i]) for i in positions}

    def on_modules(f: Callable[..., Any]) -> Callable[..., Any]:
        def call(*pure_args: Any, **kwargs: Any) -> Any:
            call_args = list(pure_args)
            for i, (_, rest) in splits.items():
                call_args[i] = equinox.combine(call_args[i], rest)
            return f(*call_args, **kwargs)

        return call

    pure_args = list(args)
    for i, (arrays, _) in splits.items():
        pure_args[i] = arrays
    weight_fn, statistics_fn = options.weight_fn, options.statistics_fn
    pure_options = options._replace(
        weight_fn=None if weight_fn is None else on_modules(weight_fn),
        statistics_fn=None if statistics_fn is None else on_modules(statistics_fn),
    )
    return on_modules(fun), pure_options, tuple(pure_args)
