"""`flax.nnx` modules passed straight to `clipped_grad`.

A module at a differentiated position is split into its `nnx.Param` state (or
what `wrt=` selects, `nnx.LoRAParam` for LoRA), which is differentiated (the
clipped sum comes back as an `nnx.State` of the params, as `nnx.grad` gives it),
its random streams' state (`nnx.Rngs`, the streams of `nnx.Dropout`), and the rest.
Each example gets the module as it is, with the keys of its streams folded with the
example's index: each example draws its own dropout mask, from the module's keys and
its own index alone, never from another example.
After the call the streams' counts move on as after one call of the module, so the
next call draws new masks.

The rest must come out of an example's loss as it went in: a per-example loss sees
a batch of one, and BatchNorm statistics gathered from it mean nothing. flax is
looked up only if the caller imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax._base import compat, equinox
from gradaccum_jax._sharding import global_view


class Split(NamedTuple):
    """`clipped_grad`'s loss and arguments with the modules split.

    Attributes:
        loss_fn: The loss on plain pytrees: the params at the modules' positions, the
            modules' other state appended after the arguments, then the example's
            index (a batch argument).
        args: The arguments so arranged.
        index_at: The position of the examples' indices.
        finish: Writes the streams' new counts back into the modules; takes the
            arguments of one example (batch arguments of leading size 1).
    """

    loss_fn: Callable[..., Any]
    args: tuple[Any, ...]
    index_at: int
    finish: Callable[[tuple[Any, ...], dict[str, Any]], None]


def module_positions(args: tuple[Any, ...], diff: tuple[int, ...]) -> tuple[int, ...]:
    """The differentiated positions that hold a `flax.nnx.Module` (an Equinox one is refused)."""
    equinox.refuse_modules(args, diff, "privacy.clipped_grad")
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return ()
    return tuple(i for i in diff if i < len(args) and isinstance(args[i], nnx.Module))


def filters(wrt: Any, modules: tuple[int, ...]) -> dict[int, Any]:
    """The filter of the state differentiated at each module position, from `wrt`.

    `None` is `nnx.Param` (as `nnx.grad`); an `nnx.DiffState(argnum, filter)`, or a
    tuple of them, filters the module at `argnum` (the others take `nnx.Param`); any
    other value is an nnx filter for every module.
    """
    nnx = sys.modules["flax.nnx"]
    if wrt is None:
        return dict.fromkeys(modules, nnx.Param)
    if isinstance(wrt, nnx.DiffState):
        states: tuple[Any, ...] = (wrt,)
    elif isinstance(wrt, tuple | list) and wrt and all(isinstance(w, nnx.DiffState) for w in wrt):
        states = tuple(wrt)
    else:
        return dict.fromkeys(modules, wrt)
    chosen = dict.fromkeys(modules, nnx.Param)
    for state in states:
        if state.argnum not in modules:
            raise ValueError(
                f"clipped_grad got wrt={wrt!r}, whose nnx.DiffState names argument "
                f"{state.argnum}; the flax.nnx modules among argnums are at positions "
                f"{modules}. Name one of those, or pass the filter alone (wrt=nnx.LoRAParam) "
                "for every module."
            )
        chosen[state.argnum] = state.filter
    return chosen


def _refuse_ambiguous_params(module: Any, position: int) -> None:
    """Raises if `module` holds params of more than one kind (`nnx.Param` and its subclass
    `nnx.LoRAParam`): without `wrt=` all of them are differentiated, and each example's
    norm counts the frozen ones' gradients too when the optimizer trains only some."""
    nnx = sys.modules["flax.nnx"]
    kinds = sorted(
        {type(v).__name__ for _, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)}
    )
    if len(kinds) > 1:
        raise ValueError(
            f"clipped_grad got a flax.nnx module at argnums position {position} holding "
            f"params of {len(kinds)} kinds ({', '.join(kinds)}) and no wrt=: it would "
            "differentiate and clip them all, while an optimizer built with "
            "wrt=nnx.LoRAParam trains the adapters alone. Pass the optimizer's wrt: "
            "wrt=nnx.LoRAParam (the adapters' norms) or wrt=nnx.Param (every param)."
        )


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def split(
    loss_fn: Callable[..., Any],
    args: tuple[Any, ...],
    modules: tuple[int, ...],
    n: int,
    batch_leaf: Any,
    wrt: Any = None,
) -> Split:
    """Splits the modules at `modules` (see the module docstring) for a batch of `n`;
    `batch_leaf`, a leaf of the batch, says how the examples' indices are sharded, and
    `wrt` (see `filters`) what of each module is differentiated."""
    nnx = sys.modules["flax.nnx"]
    if wrt is None:
        for i in modules:
            _refuse_ambiguous_params(args[i], i)
    chosen = filters(wrt, modules)
    parts = {i: nnx.split(args[i], chosen[i], nnx.RngState, ...) for i in modules}
    for i, (_, params, _, _) in parts.items():
        if not jax.tree.leaves(params):
            raise ValueError(
                f"clipped_grad got wrt={chosen[i]!r}, which selects no variable of the "
                f"flax.nnx module at argnums position {i}: nothing to differentiate. Pass "
                "the filter of the variables the optimizer trains (nnx.Param, nnx.LoRAParam)."
            )
    state_at = len(args)

    def fold(key: Any, index: jax.Array) -> Any:
        if not _is_key(key):
            return key
        # Inside shard_map the index varies over the batch's axes and the module's keys
        # (replicated) do not: typed alike first, as fold_in requires.
        missing = tuple(sorted(compat.varying_axes(index) - compat.varying_axes(key), key=str))
        return jax.random.fold_in(compat.pcast_to_varying(key, missing) if missing else key, index)

    def merged(call_args: list[Any], states: dict, index: jax.Array) -> dict[int, Any]:
        models = {}
        for i, (graphdef, *_) in parts.items():
            streams, rest = states[i]
            streams = jax.tree.map(lambda x: fold(x, index), streams)
            models[i] = nnx.merge(graphdef, call_args[i], streams, rest, copy=True)
        return models

    def pure_loss(*pure_args: Any, **kwargs: Any) -> Any:
        *call_args, states, index = pure_args
        models = merged(call_args, states, index[0])
        for i, model in models.items():
            call_args[i] = model
        out = loss_fn(*call_args, **kwargs)
        for i, model in models.items():
            after = nnx.state(model, nnx.Not(nnx.Any(chosen[i], nnx.RngState)))
            _check_unchanged(i, states[i][1], after)
        return out

    def finish(example: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The streams' counts after one example's call (each example moves them alike);
        # the keys stay the module's own: a stream moves its count, never its key.
        *call_args, states, index = example
        models = merged(call_args, states, index[0])
        for i, model in models.items():
            call_args[i] = model
        loss_fn(*call_args, **kwargs)
        for i, model in models.items():
            counts = nnx.state(model, nnx.RngState)
            kept = jax.tree.map(lambda new, old: old if _is_key(old) else new, counts, parts[i][2])
            nnx.update(args[i], kept)

    pure_args = list(args)
    for i, (_, params, _, _) in parts.items():
        pure_args[i] = params
    states = {i: (streams, rest) for i, (_, _, streams, rest) in parts.items()}
    pure_args += [states, _example_indices(args, n, batch_leaf)]
    return Split(pure_loss, tuple(pure_args), state_at + 1, finish)


def _example_indices(args: tuple[Any, ...], n: int, batch_leaf: Any) -> jax.Array:
    """Each example's index, a batch argument like the others.

    Inside `jax.shard_map` or `jax.pmap`, unique across the devices the arguments are
    split over (`split_axes`; the module's keys are the same on every device). Under
    global-view `jax.jit`, split over the mesh axes the batch is split over in its type.
    """
    offset, _ = device_position(split_axes(args))
    index = offset * n + jnp.arange(n, dtype=jnp.uint32)
    entry = (global_view.spec_entries(batch_leaf) or (None,))[0]
    if entry is not None and not jax.sharding.get_abstract_mesh().manual_axes:
        index = compat.reshard(index, jax.sharding.PartitionSpec(entry))
    return index


def split_axes(tree: Any) -> tuple[Any, ...]:
    """Inside `jax.shard_map` or `jax.pmap`: the mesh axes `tree` is split over, in mesh order.

    Those its arrays vary along, where the types say (`jax.shard_map`'s default
    `check_vma=True`). Where they do not (`jax.pmap`, `check_vma=False`), every mapped
    axis: a batch passed to each device is taken as split over all of them. Empty
    outside both.
    """
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(mesh.manual_axes) if not mesh.empty else ()
    if not manual:
        return ()
    # axis_index is typed varying exactly where the types track what varies.
    if not any(compat.varying_axes(jax.lax.axis_index(name)) for name in manual):
        return manual
    varying = frozenset().union(*map(compat.varying_axes, jax.tree.leaves(tree)))
    return tuple(name for name in mesh.axis_names if name in varying)


def device_position(axes: tuple[Any, ...]) -> tuple[jax.Array, int]:
    """This device's position among the devices of the mapped `axes`, row-major
    (`uint32`), and their number."""
    offset, count = jnp.uint32(0), 1
    for name in axes:
        size = int(jax.lax.psum(1, name))
        offset = offset * size + jax.lax.axis_index(name).astype(jnp.uint32)
        count *= size
    return offset, count


def _check_unchanged(position: int, before: Any, after: Any) -> None:
    """Refuses a module whose loss changed state other than its params and streams."""
    old = dict(jax.tree_util.tree_leaves_with_path(before))
    for path, value in jax.tree_util.tree_leaves_with_path(after):
        if old.get(path, value) is not value:
            raise TypeError(
                f"clipped_grad got a flax.nnx module at argnums position {position} whose "
                f"loss changes its state {jax.tree_util.keystr(path)} (BatchNorm statistics "
                "in training mode, a cache, ...). Each example's loss sees a batch of one: "
                "statistics gathered from it mean nothing, and would mix examples once "
                "combined. Use LayerNorm or GroupNorm, or BatchNorm with "
                "use_running_average=True, or keep that state outside the module."
            )
