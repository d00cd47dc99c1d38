"""Model and shard_map train step shared by test_distributed.py and its worker processes."""

from __future__ import annotations

import _equivalence as E
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax._base.compat import pcast_to_varying

B = 4  # examples per replica and micro-step
D_IN, D_HID, D_OUT = 6, 8, 3


def init_params() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (D_IN, D_HID)) / np.sqrt(D_IN),
        "b1": jnp.zeros(D_HID),
        "w2": jax.random.normal(k2, (D_HID, D_OUT)) / np.sqrt(D_HID),
        "b2": jnp.zeros(D_OUT),
    }


def predict(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def grad_step(tx, params, state, x, y, grad_params):
    """One micro-step: gradient at ``grad_params`` (params, or their varying cast), update."""
    grads = jax.grad(E.mlp_loss)(grad_params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def shard_map_fns(tx, params, mesh, axis, check_vma=True):
    """Jitted ``(init, step)`` of a data-parallel shard_map train step over ``axis``.

    Params are replicated; the batch is split along ``axis``; the accumulate
    state holds its per-replica fields on a leading replica axis.
    """
    specs = ga.replica_state_specs(jax.eval_shape(tx.init, params), axis)

    def body(params, state, x, y):
        varying = pcast_to_varying(params, axis)
        params, state = grad_step(tx, params, ga.remove_replica_axis(state), x, y, varying)
        return params, ga.add_replica_axis(state)

    init = jax.shard_map(
        lambda p: ga.add_replica_axis(tx.init(p)), mesh=mesh, in_specs=P(), out_specs=specs
    )
    step = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), specs, P(axis), P(axis)),
        out_specs=(P(), specs),
        check_vma=check_vma,
    )
    return jax.jit(init), jax.jit(step)
