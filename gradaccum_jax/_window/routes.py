"""Reduction strategies of `accumulate`: how a window is held, added, counted and reduced.

`accumulate` has one update path (accept, add, gate, write; see `_window`). What
changes with the way the gradients are distributed is confined to one `Route`,
chosen once per trace from the arguments and the gradients' types:

- `LocalRoute`: one device, or `jit` over global arrays (FSDP params included); the
  window is held like the params and needs no reduction.
- `ReplicaRoute`: per replica under `shard_map`/`pmap` (`axis_name`); one `psum` at
  the close.
- `UnreducedRoute`: global-view `jit` with gradients typed unreduced over mesh axes
  (data parallel, HSDP, ZeRO-1); each device holds its partial sum, sharded like the
  params over the other axes; one `jax.reshard` at the close.

Each route answers the same questions: its gate (`engine.Gate`), whether a
micro-gradient is accepted (one flag, or one per device), how a term is added
(and the window's total read, and emptied at its close), how the window's
weight and drop count move, and
in which sharding the inner optimizer sees the params and returns its updates.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from gradaccum_jax._base import collectives, compat, trees
from gradaccum_jax._base.compat import reshard
from gradaccum_jax._sharding import partials
from gradaccum_jax._sharding.partials import _reduce_into
from gradaccum_jax._window import engine

# The window's held sums: (sums, compensation or None), trees like the gradients.
Held = tuple[Any, Any]


class Route(Protocol):
    """What the update path asks of a reduction strategy; the three below answer it (the
    methods' bodies are their docstrings: a protocol's are never run)."""

    name: str  # "local", "replica" or "unreduced": the route's name in refusals
    per_device: bool  # each device accepts or drops its own partial sum
    axes: tuple[Any, ...]  # the mesh axes the window is reduced over at its close

    def gate(self) -> engine.Gate:
        """How the window closes: the conditional, the reduction, where the flag lives."""

    def accept(self, grads: Any, valid: jax.Array, check: bool) -> jax.Array:
        """Whether this micro-gradient enters the window (`check`: its finiteness too)."""

    def agree(self, accepted: jax.Array) -> jax.Array:
        """The flag agreed by the devices that hold parts of one micro-gradient."""

    def starts_unit(self, accepted: jax.Array, valid: jax.Array, state: Any) -> jax.Array:
        """Whether this micro-step's weight becomes the window's running-mean unit."""

    def held(self, state: Any) -> Held:
        """The sums the state holds."""

    def add(
        self, held: Held, grads: Any, accepted: jax.Array, scale: Any, keep: Any = None
    ) -> Held:
        """The sums with this micro-step's term added (where `accepted`)."""

    def read(self, held: Held) -> Any:
        """The window's total, as the close reduces it."""

    def emptied(self, held: Held, reset: list[jax.Array], accepted: jax.Array) -> Held:
        """The sums zeroed where `reset`."""

    def count(
        self,
        weight: jax.Array,
        skipped: jax.Array,
        accepted: jax.Array,
        term: jax.Array,
        reset: jax.Array | None,
        keep: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """The window's weight with this term, and the count of dropped micro-steps."""

    def inner_params(self, params: Any) -> Any:
        """The params as the inner optimizer sees them."""

    def zeros_like(self, grads: Any, params: Any) -> Any:
        """The tree that gives the skip branch's zero updates their shardings."""

    def back(self, updates: Any, like: Any) -> Any:
        """The inner optimizer's updates in the params' sharding."""


class LocalRoute:
    """A window on one device, or under `jit` with (possibly sharded) global arrays.

    The accumulator is `(acc, compensation)`; the compensation is `None` unless
    `compensated=True`. Everything is one XLA program over global arrays: with
    FSDP-sharded params the accumulator is sharded like them and XLA inserts
    the collectives that a global finiteness check needs (one scalar).
    """

    name = "local"
    per_device = False
    axes: tuple[Any, ...] = ()  # nothing to reduce: global arrays, or one device

    def __init__(self, compensated: bool) -> None:
        self.compensated = compensated

    def gate(self) -> engine.Gate:
        return engine.local_gate()

    def accept(self, grads: Any, valid: jax.Array, check: bool) -> jax.Array:
        return valid & trees.all_finite_by_squares(grads) if check else valid

    def agree(self, accepted: jax.Array) -> jax.Array:
        """The acceptance flag as it is: on one device, or over global arrays, where XLA
        reduces the finite check across the devices that hold parts of the gradient."""
        return accepted

    def starts_unit(self, accepted: jax.Array, valid: jax.Array, state: Any) -> jax.Array:
        """Whether this micro-step's weight becomes the window's unit: the first accepted one."""
        del valid
        return accepted & (state.acc_weight == 0)

    def held(self, state: Any) -> Held:
        return (state.acc_grads, state.acc_compensation)

    def add(
        self, held: Held, grads: Any, accepted: jax.Array, scale: Any, keep: Any = None
    ) -> Held:
        """The window's sums including this micro-step's term: one fused in-place pass.

        `keep` (`None` for 1) rescales the held sums in the same pass (see
        `engine.window_total`).
        """
        return engine.write(held[0], held[1], grads, accepted, scale, None, keep)

    def read(self, held: Held) -> Any:
        return engine.window_sum(held[0], held[1])

    def emptied(self, held: Held, reset: list[jax.Array], accepted: jax.Array) -> Held:
        """The held sums zeroed where `reset` (traced flags, one per leaf, true where this runs)."""
        del accepted
        return engine.emptied(held, reset)

    def count(
        self,
        weight: jax.Array,
        skipped: jax.Array,
        accepted: jax.Array,
        term: jax.Array,
        reset: jax.Array | None,
        keep: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """The window's weight including this term (zero where `reset`), and the drop count.

        `keep` (`None` for 1) rescales the held weight with the held sums.
        """
        held = weight if keep is None else weight * keep.astype(weight.dtype)
        weight = held + jnp.where(accepted, term, 0.0)
        if reset is not None:
            weight = jnp.where(reset, 0.0, weight).astype(weight.dtype)
        return weight, trees.increment_if(skipped, ~accepted)

    def inner_params(self, params: Any) -> Any:
        return params

    def zeros_like(self, grads: Any, params: Any) -> Any:
        """The tree whose leaves give the skip branch's zero updates their shardings."""
        del params
        return grads

    def back(self, updates: Any, like: Any) -> Any:
        del like
        return updates


class ReplicaRoute(LocalRoute):
    """A window per replica inside `jax.shard_map` or `jax.pmap`, summed once at its close."""

    name = "replica"

    def __init__(self, compensated: bool, axes: tuple[Any, ...], grads: Any) -> None:
        super().__init__(compensated)
        self.axes = axes
        self.typed = collectives.check_axes_bound("axis_name", axes)
        if self.typed:
            collectives.check_grads_vary("updates", grads, axes)

    def gate(self) -> engine.Gate:
        return engine.replica_gate(self.axes, self.typed)

    def agree(self, accepted: jax.Array) -> jax.Array:
        """The flag and-ed over the mesh axes other than `axes` that it varies along.

        Each replica decides alone; the devices holding parts of its gradient (pipeline
        stages, tensor shards, other axes of the mesh) agree with one scalar all-reduce,
        so that the gate, the counters and the updates of replicated params stay invariant
        along them and a micro-gradient is dropped whole. Untyped (`pmap`, `check_vma=False`)
        each device decides alone.
        """
        return collectives.agree(accepted, self.axes, self.typed)


class UnreducedRoute:
    """A window of per-device partial sums in global-view `jit` (unreduced over `axes`).

    Each device accepts or drops its own partial sum and adds it to its part of
    the accumulator with no collective over `axes`; the close reduces the sums
    and weights once, into `specs` (the params' sharding, or the inner state's
    for ZeRO-1). A leaf sharded over other mesh axes as well (HSDP: `fsdp`)
    keeps that sharding: each device holds its shard of its partial sum, and
    the devices that share a partial sum agree on dropping it (one scalar
    all-reduce over those axes per micro-step).
    """

    name = "unreduced"
    per_device = True

    def __init__(self, axes: tuple[Any, ...], specs: Any) -> None:
        self.axes = axes
        self.specs = specs

    def gate(self) -> engine.Gate:
        return unreduced_gate(self.specs)

    def accept(self, grads: Any, valid: jax.Array, check: bool) -> jax.Array:
        return partials.local_accept(grads, valid, self.axes, check=check)

    def agree(self, accepted: jax.Array) -> jax.Array:
        """The per-device flags, agreed already by `accept` where shards share a partial sum."""
        return accepted

    def starts_unit(self, accepted: jax.Array, valid: jax.Array, state: Any) -> jax.Array:
        """The unit must be the same on every device: the first micro-step's usable weight."""
        del accepted
        return valid & (state.micro_step == 0)

    def held(self, state: Any) -> Held:
        return (state.acc_grads, None)

    def add(
        self, held: Held, grads: Any, accepted: jax.Array, scale: Any, keep: Any = None
    ) -> Held:
        return partials.local_add(held[0], grads, accepted, scale, None, self.axes, keep), None

    def read(self, held: Held) -> Any:
        return held[0]

    def emptied(self, held: Held, reset: list[jax.Array], accepted: jax.Array) -> Held:
        # Each device's zeros, typed unreduced like the sums they replace.
        return partials.local_add(held[0], held[0], accepted, None, reset[0], self.axes), None

    def count(
        self,
        weight: jax.Array,
        skipped: jax.Array,
        accepted: jax.Array,
        term: jax.Array,
        reset: jax.Array | None,
        keep: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        return partials.local_count(weight, skipped, accepted, term, reset, self.axes, keep)

    def inner_params(self, params: Any) -> Any:
        if params is None:
            return None
        return jax.tree.map(compat.reshard, params, self.specs)

    def zeros_like(self, grads: Any, params: Any) -> Any:
        # The updates leave in the params' sharding, not the gradients' unreduced one.
        return grads if params is None else params

    def back(self, updates: Any, like: Any) -> Any:
        # Back to the params' sharding (an all-gather where the inner state is sharded).
        return jax.tree.map(lambda u, p: compat.reshard(u, partials.dense_spec(p)), updates, like)


def unreduced_gate(specs: Any) -> engine.Gate:
    """The gate of an unreduced window: one reduction of the sums at the close.

    `specs` (a tree like the window sums) gives the sharding the reduction
    produces: the params' sharding is an all-reduce over the unreduced axes (of
    each device's shard, for HSDP), a spec that splits a dimension over the
    unreduced axes (ZeRO-1) a reduce-scatter. The weight is reduced with them.
    No other collective runs; "anything accepted" is known after the reduction.
    """

    def reduce(window: engine.Window) -> engine.Window:
        total = jax.tree.map(_reduce_into, window.total, specs)
        return window._replace(total=total, weight=reshard(window.weight, jax.P()))

    def zeros_like(leaf: jax.Array, dtype: Any, zero: jax.Array) -> jax.Array:
        # Adding the leaf's own zero keeps equal-shaped leaves' zeros apart (no CSE, no copy).
        zeros = jnp.zeros(jnp.shape(leaf), dtype, out_sharding=partials.dense_spec(leaf))
        return zeros + zero.astype(dtype)

    return engine.Gate(
        cond=jax.lax.cond, reduce=reduce, decides_locally=False, zeros_like=zeros_like
    )
