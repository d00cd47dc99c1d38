"""Holding an `accumulate(axis_name=...)` state across `jax.shard_map` calls.

With `axis_name`, some fields of `AccumulateState` differ between
replicas: `acc_grads`, `acc_weight`, `weight_unit`, `num_skipped` (and
`acc_compensation` with `compensated=True`) describe each replica's own
micro-batches (the sums over replicas are the global values). `jax.pmap`
keeps one copy of the whole state per device anyway. `jax.shard_map` needs a
global array for every value it returns, and a value that differs between
replicas must be returned with a `PartitionSpec` that names the axis; these
helpers give those fields a leading replica axis for that, and leave the rest
(counters, inner state) replicated.

They take a whole training state as well: the running max of fp8 metadata
that `gradaccum_jax.flax.TrainState` keeps through a window (its field
`fp8_window_max`, found by its name) is each replica's own until the close
too, and gets the replica axis with the accumulators.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from gradaccum_jax._base import reduce_rules, validation
from gradaccum_jax._base.compat import varying_axes
from gradaccum_jax._window.state import AccumulateState, AxisName

# The rounding error of a replica's `acc_grads` is its own, like `acc_grads`; the
# noise-scale window sums are the replica's own too (its averages are equal on
# every replica, held per replica with them), and so is the sum of its losses.
_PER_REPLICA = (
    "acc_grads",
    "acc_weight",
    "weight_unit",
    "num_skipped",
    "acc_compensation",
    "noise_scale",
    "acc_value",
)


def _map_accumulate_states(
    tree: Any,
    fn: Callable[[AccumulateState], AccumulateState],
    per_replica: Callable[[str, Any], Any],
    other: Callable,
) -> Any:
    """Maps `tree`: its accumulate states by `fn`, fp8 running maxes by `per_replica`."""
    found = False

    def visit(path: Any, node: Any) -> Any:
        nonlocal found
        if isinstance(node, AccumulateState):
            found = True
            # An accumulate nested in another one's inner transformation has its
            # own per-replica fields.
            return fn(node._replace(inner_state=_map(node.inner_state)))
        if reduce_rules.in_collection(path, reduce_rules.FP8_WINDOW_MAX):
            return per_replica(jax.tree_util.keystr(path).lstrip("."), node)
        return other(node)

    def _map(tree: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            visit, tree, is_leaf=lambda x: isinstance(x, AccumulateState)
        )

    out = _map(tree)
    if not found:
        raise ValueError(
            "opt_state contains no AccumulateState: pass the state (or jax.eval_shape of "
            "the state) of an optimizer built with gradaccum_jax.accumulate(..., "
            "axis_name=...)."
        )
    return out


def _map_per_replica(state: AccumulateState, fn: Callable[[str, Any], Any]) -> AccumulateState:
    return state._replace(
        **{
            field: jax.tree_util.tree_map_with_path(
                lambda path, x, field=field: fn(field + jax.tree_util.keystr(path), x),
                getattr(state, field),
            )
            for field in _PER_REPLICA
        }
    )


def _type_checked_manual_axes() -> tuple[Any, ...]:
    """The `shard_map` axes bound here whose varying types are checked.

    Empty outside `jax.shard_map`, under `jax.pmap` and with `check_vma=False`:
    an axis index varies along its axis exactly when types are checked.
    """
    axes = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    return tuple(a for a in axes if a in varying_axes(jax.lax.axis_index(a)))


def replica_state_specs(opt_state: optax.OptState, axis_name: AxisName) -> Any:
    """Returns `PartitionSpec` s for an accumulate state held across `shard_map` calls.

    The per-replica fields of every `AccumulateState` in `opt_state`
    (`acc_grads`, `acc_weight`, `weight_unit`, `num_skipped`,
    `acc_compensation`, `noise_scale` and `acc_value`) get `P(axis_name)`: they
    carry a leading replica axis (see `add_replica_axis`), one slot per
    replica. Every other leaf gets `P()`, replicated, like the params of
    data-parallel training. Use the result as the state's entry in both
    `in_specs` and `out_specs` of `jax.shard_map`.

    A whole `gradaccum_jax.flax.TrainState` may be passed as well: its
    fp8 metadata's running max (its field `fp8_window_max`, each
    replica's own until the window closes) gets `P(axis_name)` too,
    everything else `P()`.

    For params sharded along other mesh axes as well, build the specs by hand
    on the same rule: per-replica fields `P(axis_name, *param_spec)`, the
    inner state as you shard it for the params.

    Args:
      opt_state: An optimizer state containing at least one
        `AccumulateState`, or its shape (`jax.eval_shape(tx.init,
        params)`), or a training state holding one; only its structure is
        used.
      axis_name: The mesh axis name (or tuple of names) given to
        `accumulate`.

    Returns:
      A pytree of `jax.sharding.PartitionSpec` shaped like `opt_state`.

    Raises:
      TypeError: If `axis_name` is not a name or a tuple of names.
      ValueError: If `opt_state` contains no `AccumulateState`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = ga.accumulate(optax.sgd(0.1), 4, axis_name="data")
      >>> specs = ga.replica_state_specs(jax.eval_shape(tx.init, jnp.zeros(3)), "data")
      >>> specs.acc_grads == jax.P("data"), specs.micro_step == jax.P()
      (True, True)
    """
    names = validation.check_axis_name("axis_name", axis_name)
    replica_spec = PartitionSpec(names[0] if len(names) == 1 else names)

    def per_replica(_: str, x: Any) -> PartitionSpec:
        return replica_spec

    return _map_accumulate_states(
        opt_state,
        lambda state: _map_per_replica(
            # Every other field (counters, flags, the window length) is the
            # same on all replicas; the inner state was mapped already.
            state._replace(
                **{
                    field: jax.tree.map(lambda _: PartitionSpec(), getattr(state, field))
                    for field in state._fields
                    if field not in (*_PER_REPLICA, "inner_state")
                }
            ),
            per_replica,
        ),
        per_replica,
        lambda _: PartitionSpec(),
    )


def add_replica_axis(opt_state: optax.OptState) -> optax.OptState:
    """Gives the per-replica fields of every `AccumulateState` a leading axis of size 1.

    Call it on the state a `jax.shard_map` body returns (and on
    `tx.init(params)` inside a `shard_map` that creates the state): with
    `replica_state_specs` as `out_specs`, the global arrays stack the
    replicas' accumulators along that axis, one slot per replica, each on its
    own device. Other fields are returned as they are. In a whole
    `gradaccum_jax.flax.TrainState` the fp8 metadata's running max gets the
    axis too (see `replica_state_specs`).

    Args:
      opt_state: An optimizer state containing at least one
        `AccumulateState`.

    Returns:
      `opt_state` with its per-replica fields (`acc_grads`, `acc_weight`,
      `weight_unit`, `num_skipped`, `acc_compensation`, `noise_scale`,
      `acc_value`) expanded to shape `(1, *shape)`.

    Raises:
      ValueError: If `opt_state` contains no `AccumulateState`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = ga.accumulate(optax.sgd(0.1), 4, axis_name="data")
      >>> state = ga.add_replica_axis(tx.init(jnp.zeros(3)))
      >>> state.acc_grads.shape, state.acc_weight.shape, state.micro_step.shape
      ((1, 3), (1,), ())
    """

    def expand(_: str, x: Any) -> Any:
        return jnp.expand_dims(x, 0)

    return _map_accumulate_states(
        opt_state, lambda state: _map_per_replica(state, expand), expand, lambda x: x
    )


def remove_replica_axis(opt_state: optax.OptState) -> optax.OptState:
    """Drops the leading size-1 axis that `add_replica_axis` added.

    Call it first thing in a `jax.shard_map` body that received the state with
    `replica_state_specs` as `in_specs`: each replica then sees its own
    accumulator in the shape of the params, as `update` expects.

    Args:
      opt_state: An optimizer state whose `AccumulateState` per-replica
        fields have a leading axis of size 1.

    Returns:
      `opt_state` with that axis removed.

    Raises:
      ValueError: If `opt_state` contains no `AccumulateState`, or a
        per-replica field has no leading axis of size 1, or (inside
        `jax.shard_map` with its default `check_vma=True`) does not vary
        along any mesh axis: the state did not go through `shard_map` with
        `replica_state_specs`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> tx = ga.accumulate(optax.sgd(0.1), 4, axis_name="data")
      >>> state = ga.remove_replica_axis(ga.add_replica_axis(tx.init(jnp.zeros(3))))
      >>> state.acc_grads.shape
      (3,)
    """

    checked_axes = _type_checked_manual_axes()

    def squeeze(where: str, x: Any) -> Any:
        if checked_axes and not varying_axes(x) & set(checked_axes):
            raise ValueError(
                f"state.{where} entered jax.shard_map replicated: it does not vary along the "
                f"mesh axes {checked_axes}, so the state's in_specs entry was P() (and its "
                "out_specs entry would fail JAX's replication check). The per-replica fields "
                "need a replica axis: pass in_specs and out_specs entries "
                "specs = gradaccum_jax.replica_state_specs(jax.eval_shape(tx.init, params), "
                "axis_name) for the state, here and in the shard_map that creates it with "
                "add_replica_axis(tx.init(params))."
            )
        shape = jnp.shape(x)
        if not shape or shape[0] != 1:
            raise ValueError(
                f"state.{where} has shape {shape}, but remove_replica_axis expects a "
                "leading replica axis of size 1. Pass the state into jax.shard_map with "
                "in_specs=replica_state_specs(state, axis_name), after creating it with "
                "add_replica_axis (see gradaccum_jax.add_replica_axis)."
            )
        return jnp.squeeze(x, 0)

    return _map_accumulate_states(
        opt_state, lambda state: _map_per_replica(state, squeeze), squeeze, lambda x: x
    )
