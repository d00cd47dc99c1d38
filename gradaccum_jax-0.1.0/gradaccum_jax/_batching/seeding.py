"""Micro-batches whose backward is seeded with their share of the loss (for fp8 metadata).

Flax's fp8 layers record the amax of the cotangent reaching each layer's
output (`output_grad_amax_history`), and quantize that cotangent with a scale
read off the old history. Over one large batch whose loss is the mean of the
micro-batches' losses, example `j`'s cotangent is `1/K` of the one a backward
from micro-batch `i`'s own loss gives it (its weight over the total weight
with `weight_fn`). So when the gradient tree holds leaves combined by max
(`gradaccum_jax._base.reduce_rules`), `microbatch_value_and_grad` seeds micro-batch
`i`'s backward with its share `s_i` instead of `1`: every cotangent, every fp8
quantization of it and every amax is then the large batch's, and the gradient
of the large batch is the plain sum of the seeded gradients. The loss value
itself is not scaled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import reduce_rules
from gradaccum_jax._batching.splitting import _Options


@jax.custom_vjp
def scale_cotangent(value: jax.Array, seed: jax.Array) -> jax.Array:
    """`value` unchanged; its cotangent is multiplied by `seed` on the way back."""
    return value


def _scale_fwd(value: jax.Array, seed: jax.Array) -> tuple[jax.Array, jax.Array]:
    return value, seed


def _scale_bwd(seed: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    dtype = jnp.promote_types(g.dtype, jnp.float32)
    return (g.astype(dtype) * seed.astype(dtype)).astype(g.dtype), jnp.zeros_like(seed)


scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


def value_and_grad(micro_loss: Callable[..., Any], argnums: Any) -> Callable[..., Any]:
    """`jax.value_and_grad` of `micro_loss` (returning `(value, rest)`), seeded.

    The seed is one more, last, positional argument (`None`: not seeded); the
    value is returned unscaled.
    """

    def loss(*args_and_seed: Any, **kwargs: Any) -> Any:
        *args, seed = args_and_seed
        value, rest = micro_loss(*args, **kwargs)
        return (value if seed is None else scale_cotangent(value, seed)), rest

    return jax.value_and_grad(loss, argnums, has_aux=True)


def needs_seeds(grad_shape: Any, options: _Options) -> Any:
    """The max mask of the gradients if any leaf is max-reduced, else `None`.

    Raises:
      ValueError: With `sum_and_weight`, whose total weight comes out of the
        forward passes and so is not known when the first backward runs.
    """
    mask = reduce_rules.max_mask(grad_shape, options.max_leaves)
    if not reduce_rules.any_max(mask):
        return None
    if options.sum_and_weight:
        shown = ", ".join(reduce_rules.max_paths(mask)[:2])
        raise ValueError(
            f"microbatch_value_and_grad got gradient leaves combined by max ({shown}, ...: "
            "fp8 metadata), whose backward must be seeded with each micro-batch's share of the "
            "total weight before it runs; with sum_and_weight=True that total comes out of "
            "the forward passes. Return the weighted mean and pass weight_fn= instead, or "
            "max_leaves=None to average those leaves."
        )
    return mask


def seeds(k: int, micro_inputs: Callable[..., Any], carry0: Any, options: _Options) -> jax.Array:
    """`float32[k]`: micro-batch `i`'s share of the loss, `1/K` or `W_i / sum_j W_j`.

    With `weight_fn`, a first pass evaluates it on every micro-batch, whose
    arguments are `micro_inputs(i, carry0)`: with the carry as it enters the
    step, so `weight_fn` must not read the carry. A batch of zero total
    weight seeds every backward with zero.
    """
    weight_fn = options.weight_fn
    if weight_fn is None:
        return jnp.full((k,), 1.0 / k, jnp.float32)

    def weight_of(i: jax.Array) -> jax.Array:
        args, kwargs = micro_inputs(i, carry0)
        return jnp.sum(jnp.asarray(weight_fn(*args, **kwargs), jnp.float32))

    weights = jax.lax.map(weight_of, jnp.arange(k, dtype=jnp.int32))
    total = jnp.sum(weights)
    return jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)
