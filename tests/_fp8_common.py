"""A small Flax model with fp8 delayed scaling, shared by the fp8 metadata tests.

The variables come after two large-batch steps in Flax's own way (the
`_overwrite_with_gradient` collection overwritten by its "gradient"), so that
the amax histories hold values and the scales are no longer 1.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops

META = fp8_ops.OVERWRITE_WITH_GRADIENT
B = 16


class Mlp(nn.Module):
    """Two fp8 Dense layers (amax history of 4 steps)."""

    dot_general_cls: Any = fp8_ops.Fp8DirectDotGeneralOp

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def dot(*args: Any, **kwargs: Any) -> Any:
            return self.dot_general_cls(amax_history_length=4)

        h = jax.nn.relu(nn.Dense(8, dot_general_cls=dot)(x))
        return nn.Dense(2, dot_general_cls=dot)(h)


def batch(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(seed))
    # Rows of very different scales, so that each micro-batch has its own amax.
    scales = jnp.linspace(0.5, 8.0, B)[:, None]
    return jax.random.normal(kx, (B, 4)) * scales, jax.random.normal(ky, (B, 2))


def loss_fn(model: nn.Module) -> Any:
    def loss(variables: Any, batch: Any) -> jax.Array:
        x, y = batch
        return jnp.mean((model.apply(variables, x) - y) ** 2)

    return loss


def warm_variables(model: nn.Module) -> Any:
    """The model's variables after two steps of Flax's fp8 update on large batches."""
    variables = model.init(jax.random.key(1), batch()[0])
    loss = loss_fn(model)
    for seed in (10, 11):
        grads = jax.grad(loss)(variables, batch(seed))
        variables = {"params": variables["params"], META: grads[META]}
    return variables


def assert_metadata_equal(ours: Any, ref: Any, *, rtol: float = 0.0) -> None:
    """Every fp8 metadata leaf equal (or to `rtol`), with its path in the message."""
    paths = jax.tree_util.tree_flatten_with_path(ref)[0]
    for (path, want), got in zip(paths, jax.tree_util.tree_leaves(ours), strict=True):
        where = jax.tree_util.keystr(path)
        if rtol:
            np.testing.assert_allclose(got, want, rtol=rtol, err_msg=where)
        else:
            np.testing.assert_array_equal(got, want, err_msg=where)
