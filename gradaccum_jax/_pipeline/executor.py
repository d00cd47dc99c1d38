"""The schedule run per device: one scan per phase over the table's slots.

Inside `jax.shard_map` over the stage axis (and any data axes), every stage reads its
column of the table (`schedules.PipelineSchedule`) at each slot and runs one branch of
a `jax.lax.switch`: idle, a forward, or a backward that recomputes the stage from its
kept input (`jax.vjp`), each with a first-stage (embedding) and a last-stage (loss)
variant. No branch holds a collective: the two `ppermute`s of a slot, the activation
one stage on and the cotangent one stage back, run on every stage, outside the switch,
and only in the phases of the table that send in that direction. Gradients are summed
into one accumulator per leaf as they come (never stacked per micro-batch), and
reduced over the data axes once, after the last phase. Each loss is seeded with 1 (a
sum); the caller divides once, by the whole batch's count or weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax._base import compat
from gradaccum_jax._pipeline.schedules import PipelineSchedule

# What the rings hold before anything arrives. Tests set it to NaN: a bubble slot that
# read a ring place nothing was written to would then show in the gradients.
FILLER = 0.0


@dataclasses.dataclass(frozen=True)
class Model:
    """The three functions of a pipelined model, keys and options already bound.

    `embed(outer, micro, key)`, `stage(chunk_params, x, key, c)` (virtual stage `c`),
    `loss(outer, y, micro, key)` returning `(value, weight, aux)`; `key` is the
    micro-batch's key, `None` when the call has none (each function folds in its own).
    """

    embed: Callable[..., Any]
    stage: Callable[..., Any]
    loss: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Step:
    """What one device's run needs beyond the model: the table and the axes."""

    table: PipelineSchedule
    stage_axis: Any
    data_axes: tuple[Any, ...]
    aux_concat: Any  # pytree of bools like aux: per-example leaves, kept per micro-batch


def _vary(tree: Any, axes: frozenset) -> Any:
    """`tree` typed varying along `axes` (the leaves already varying left as they are)."""

    def one(x: Any) -> Any:
        missing = tuple(a for a in axes if a not in compat.varying_axes(x))
        return compat.pcast_to_varying(x, missing) if missing else x

    return jax.tree.map(one, tree)


def _chunk(tree: Any, j: jax.Array) -> Any:
    """The parameters of chunk `j` from a device's stacked `(v, ...)` leaves."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, keepdims=False), tree)


def _add_chunk(acc: Any, j: jax.Array, grads: Any) -> Any:
    def one(a: jax.Array, g: jax.Array) -> jax.Array:
        row = jax.lax.dynamic_index_in_dim(a, j, keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(a, row + g[None].astype(a.dtype), j, 0)

    return jax.tree.map(one, acc, grads)


def _add(acc: Any, grads: Any) -> Any:
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)


def _acc_dtype(x: Any) -> Any:
    return jnp.promote_types(jnp.result_type(x), jnp.float32)


def run(
    model: Model,
    step: Step,
    stage_params: Any,
    outer: Any,
    micro: Any,
    keys: Any,
    act_shape: Any,
) -> tuple[Any, ...]:
    """One device's schedule: `(value_sum, weight_sum, aux, stage_grads, outer_grads)`.

    `stage_params` are this device's chunks, leaves `(v, ...)`; `micro` the batch
    split into micro-batches (leaves `(B / N, N, ...)`, micro-batch `m` at `[:, m]`);
    `keys` one key per micro-batch (or `None`); `act_shape` the activation's
    `jax.ShapeDtypeStruct` pytree. The sums are this device's, unreduced.
    """
    table = step.table
    s, v = table.num_stages, table.num_chunks
    d = jax.lax.axis_index(step.stage_axis)
    axes = all_axes(step, (stage_params, outer, micro, keys))
    # Cast once, before the loop: replicated params typed invariant would make the vjp
    # transpose put their psum inside the loop (and inside a branch only some stages take).
    stage_params, outer, micro, keys = _vary((stage_params, outer, micro, keys), axes)

    def mb(m: jax.Array) -> tuple[Any, Any]:
        one = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, m, 1, False), micro)
        key = None if keys is None else jax.lax.dynamic_index_in_dim(keys, m, keepdims=False)
        return one, key

    def ring(depth: int) -> Any:
        return jax.tree.map(lambda a: jnp.full((depth + 1, *a.shape), FILLER, a.dtype), act_shape)

    value_shape, _, aux_shape = jax.eval_shape(
        lambda: model.loss(outer, _zeros(act_shape), *mb(jnp.int32(0)))
    )
    n = table.num_microbatches
    aux0 = jax.tree.map(
        lambda a, concat: jnp.zeros(((n,) if concat else ()) + a.shape, _acc_dtype(a)),
        aux_shape,
        step.aux_concat,
    )
    carry0 = _vary(
        (
            ring(table.act_depth),
            ring(table.cot_depth),
            jax.tree.map(lambda x: jnp.zeros(x.shape, _acc_dtype(x)), stage_params),
            jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), _acc_dtype(x)), outer),
            jnp.zeros((), _acc_dtype(value_shape)),
            jnp.float32(0.0),
            aux0,
        ),
        axes,
    )
    branches = _branches(model, step, stage_params, outer, mb, d, axes)
    columns = np.stack(
        [
            table.kind,
            table.microbatch,
            table.chunk,
            table.act_read,
            table.cot_read,
            table.act_write,
            table.cot_write,
        ],
        axis=-1,
    )
    sends_on, sends_back = table.sends()
    carry = carry0
    for lo, hi, on, back in _phases(sends_on, sends_back):
        body = _slot(branches, step, d, s, v, on, back, act_shape, axes)
        carry, _ = jax.lax.scan(body, carry, jnp.asarray(columns[lo:hi]))
    _, _, g_stage, g_outer, value, weight, aux = carry
    return value, weight, aux, g_stage, g_outer


def all_axes(step: Step, tree: Any) -> frozenset:
    """The mesh axes every value of the run is typed varying along: those of the inputs,
    and the stage and data axes where this `shard_map` checks types."""
    found = frozenset(a for leaf in jax.tree.leaves(tree) for a in compat.varying_axes(leaf))
    return found | frozenset(a for a in (step.stage_axis, *step.data_axes) if _typed(a))


def cast(tree: Any, axes: frozenset) -> Any:
    """`tree` typed varying along `axes`, as the run types its values."""
    return _vary(tree, axes)


def _typed(axis: Any) -> bool:
    """Whether values inside this shard_map carry varying types along `axis`."""
    return axis in compat.varying_axes(jax.lax.axis_index(axis))


def _zeros(shape: Any) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shape)


def _phases(on: np.ndarray, back: np.ndarray) -> list[tuple[int, int, bool, bool]]:
    """Slot ranges that send activations on only, both ways, back only.

    The middle range is everything from the first backward send to the last forward
    send, so there are at most three loops whatever the schedule.
    """
    t = len(on)
    first_back = int(np.argmax(back)) if back.any() else t
    last_on = t - 1 - int(np.argmax(on[::-1])) if on.any() else -1
    if first_back > last_on:
        cuts = [(0, first_back, True, False), (first_back, t, False, True)]
    else:
        cuts = [(0, first_back, True, False), (first_back, last_on + 1, True, True)]
        cuts.append((last_on + 1, t, False, True))
    return [(lo, hi, f, b) for lo, hi, f, b in cuts if hi > lo]


def _slot(branches, step, d, s, v, on, back, act_shape, axes):
    """The scan body of one phase: this stage's task, then the slot's permutes."""
    forward_ring = [(i, (i + 1) % s) for i in range(s)]
    backward_ring = [((i + 1) % s, i) for i in range(s)]

    def body(carry, row):
        act, cot, g_stage, g_outer, value, weight, aux = carry
        kind, m, j, act_read, cot_read, act_write, cot_write = (
            jax.lax.dynamic_index_in_dim(row, d, keepdims=False)[i] for i in range(7)
        )
        virtual = j * s + d
        first = (virtual == 0).astype(jnp.int32)
        last = (virtual == s * v - 1).astype(jnp.int32)
        # 0 idle; 1-4 forward, 5-8 backward, each plain / first / last / first and last.
        code = jnp.where(kind == 0, 0, 1 + 4 * (kind - 1) + first + 2 * last)
        x = jax.tree.map(lambda r: jax.lax.dynamic_index_in_dim(r, act_read, keepdims=False), act)
        g = jax.tree.map(lambda r: jax.lax.dynamic_index_in_dim(r, cot_read, keepdims=False), cot)
        state = (g_stage, g_outer, value, weight, aux)
        send_on, send_back, state = jax.lax.switch(code, branches, m, j, x, g, state)
        g_stage, g_outer, value, weight, aux = state
        if on:
            got = jax.lax.ppermute(send_on, step.stage_axis, forward_ring)
            act = jax.tree.map(lambda r, a: r.at[act_write].set(a), act, got)
        if back:
            got = jax.lax.ppermute(send_back, step.stage_axis, backward_ring)
            cot = jax.tree.map(lambda r, a: r.at[cot_write].set(a), cot, got)
        return (act, cot, g_stage, g_outer, value, weight, aux), None

    return body


def _branches(model, step, stage_params, outer, mb, d, axes):
    """The nine branches of a slot's switch, all returning the same types."""

    def out(send_on, send_back, state):
        return _vary((send_on, send_back, state), axes)

    def idle(m, j, x, g, state):
        return out(_zeros_like(x), _zeros_like(x), state)

    def add_value(state, m, value, weight, aux):
        g_stage, g_outer, total, weights, acc = state

        def one(a, b, concat):
            if concat:
                return jax.lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), m, 0)
            return a + (b * weight).astype(a.dtype)  # weight 1 for means

        acc = jax.tree.map(one, acc, aux, step.aux_concat)
        return g_stage, g_outer, total + value.astype(total.dtype), weights + weight, acc

    def forward(first: bool, last: bool):
        def branch(m, j, x, g, state):
            micro, key = mb(m)
            p = _chunk(stage_params, j)
            c = j * step.table.num_stages + d
            if first:
                x = model.embed(outer, micro, key)
            y = model.stage(p, x, key, c)
            if not last:
                return out(y, _zeros_like(x), state)
            value, weight, aux = model.loss(outer, y, micro, key)
            return out(_zeros_like(y), _zeros_like(x), add_value(state, m, value, weight, aux))

        return branch

    def backward(first: bool, last: bool):
        def branch(m, j, x, g, state):
            micro, key = mb(m)
            p = _chunk(stage_params, j)
            c = j * step.table.num_stages + d

            def f(outer_params, chunk_params, x):
                if first:
                    x = model.embed(outer_params, micro, key)
                y = model.stage(chunk_params, x, key, c)
                if last:
                    return model.loss(outer_params, y, micro, key)[0]
                return y

            if first or last:
                primal, vjp = jax.vjp(f, outer, p, x)
            else:  # the outer params are not used: no vjp for them
                primal, vjp = jax.vjp(lambda q, y: f(outer, q, y), p, x)
            cotangent = _vary(jnp.ones(primal.shape, primal.dtype), axes) if last else g
            grads = vjp(cotangent)
            g_stage, g_outer, value, weight, aux = state
            g_stage = _add_chunk(g_stage, j, grads[-2])
            if first or last:
                g_outer = _add(g_outer, grads[0])
            g_x = grads[-1]
            state = (g_stage, g_outer, value, weight, aux)
            return out(_zeros_like(x), g_x, state)

        return branch

    combos = [(False, False), (True, False), (False, True), (True, True)]
    return [idle] + [forward(*c) for c in combos] + [backward(*c) for c in combos]


def _zeros_like(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)
