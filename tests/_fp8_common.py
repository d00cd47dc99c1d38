"""Small Flax models with fp8 delayed scaling, shared by the fp8 metadata tests.

The variables come after two large-batch steps in Flax's own way (the
`_overwrite_with_gradient` collection overwritten by its "gradient"), so that
the amax histories hold values and the scales are no longer 1. The linen
model (`Mlp`) and the flax.nnx one (`nnx_mlp`: `nnx.Linear` layers whose
`dot_general` is Flax's fp8 op under `nnx.bridge`) have the same layers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import fp8_ops

from gradaccum_jax.flax import fp8_metadata

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


def batch(seed: int = 0, size: int = B) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(seed))
    # Rows of very different scales, so that each micro-batch has its own amax.
    scales = jnp.linspace(0.5, 8.0, size)[:, None]
    return jax.random.normal(kx, (size, 4)) * scales, jax.random.normal(ky, (size, 2))


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


def assert_mean_window_metadata(got: Any, large: Any, own: list[Any]) -> None:
    """What a window of calls (or devices) that each differentiate their own mean loss writes.

    The scales and the input and kernel histories are the large batch's (`large`);
    the output-gradient history is the max of the calls' own (`own`, one metadata
    tree per call), whose cotangents are in the units of their own mean losses.
    """
    flat = jax.tree_util.tree_flatten_with_path(large)[0]
    theirs = [jax.tree.leaves(tree) for tree in own]
    for i, ((path, want), mine) in enumerate(zip(flat, jax.tree.leaves(got), strict=True)):
        name = [entry.key for entry in path if isinstance(entry, jax.tree_util.DictKey)][-1]
        if name == "output_grad_amax_history":
            want = jnp.max(jnp.stack([leaves[i] for leaves in theirs]), 0)
        np.testing.assert_array_equal(mine, want, err_msg=jax.tree_util.keystr(path))


#: What an NNX fp8 model differentiates: its params and its fp8 metadata.
NNX_WRT = nnx.Any(nnx.Param, fp8_metadata)


class NnxMlp(nnx.Module):
    """`Mlp` in flax.nnx: `nnx.Linear` layers with Flax's fp8 op as their `dot_general`."""

    def __init__(self, rngs: nnx.Rngs):
        def fp8_dot(n_in: int, n_out: int) -> Any:
            op = nnx.bridge.ToNNX(fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=4), rngs=rngs)
            dims = (((1,), (0,)), ((), ()))
            nnx.bridge.lazy_init(op, jnp.zeros((1, n_in)), jnp.zeros((n_in, n_out)), dims)
            return op

        self.dense_0 = nnx.Linear(4, 8, dot_general=fp8_dot(4, 8), rngs=rngs)
        self.dense_1 = nnx.Linear(8, 2, dot_general=fp8_dot(8, 2), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dense_1(jax.nn.relu(self.dense_0(x)))


def nnx_loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def nnx_models() -> dict[str, Any]:
    """Makers of the NNX fp8 models: native `nnx.Linear` layers, and `Mlp` under `nnx.bridge`."""

    def bridged() -> Any:
        model = nnx.bridge.ToNNX(Mlp(), rngs=nnx.Rngs(0))
        nnx.bridge.lazy_init(model, batch()[0])
        return model

    return {"linear": lambda: NnxMlp(nnx.Rngs(0)), "bridge": bridged}


def warm_nnx(model: Any) -> Any:
    """`model` after two steps of Flax's fp8 update on large batches (as `warm_variables`)."""
    for seed in (10, 11):
        grads = nnx.grad(nnx_loss, argnums=nnx.DiffState(0, NNX_WRT))(model, *batch(seed))
        nnx.update(model, nnx.state(grads, fp8_metadata))
    return model
