"""Partial sums over mesh axes, typed unreduced: the primitives of the unreduced window.

`add_partial`, `reduced`, `local_accept`, `local_add`, `local_count` and friends
keep a window of per-device partial sums under global-view `jax.jit`;
`_window.routes` (the unreduced route), `flax` (AccumBatchNorm's per-device
window) and `_batching.unreduced` (`unreduced_value_and_grad`, which sets
`_PER_DEVICE` while it traces `fun`) use them.
"""

from __future__ import annotations

import contextvars
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._base import compat, validation
from gradaccum_jax._base.compat import (
    pcast_to_varying,
    reshard,
    unreduced_axes_in_body,
    varying_axes,
)

# Set while `unreduced_value_and_grad` traces `fun` for one device: the mesh axes
# its batch is split over and the number of micro-batches of each device's slice
# (see `per_device_axes`).
_PER_DEVICE: contextvars.ContextVar[tuple[tuple[Any, ...], int] | None] = contextvars.ContextVar(
    "gradaccum_jax_per_device", default=None
)


def mesh_axes_size(axes: tuple[Any, ...], who: str) -> int:
    """Returns the number of devices along `axes` of the context mesh, or raises.

    `who` is the argument as the user wrote it, e.g. `"axis_name='data'"`.
    """
    mesh = jax.sharding.get_abstract_mesh()
    shown = axes[0] if len(axes) == 1 else axes
    if mesh.empty:
        raise ValueError(
            f"{who} needs a mesh: call it inside jax.jit under `with jax.set_mesh(mesh):` "
            "(or after jax.set_mesh(mesh)), with mesh = "
            f"jax.make_mesh((jax.device_count(),), ({shown!r},))."
        )
    for axis in axes:
        if axis not in mesh.shape:
            raise ValueError(
                f"{who}: the mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}. "
                "Pass the name of the data-parallel mesh axis."
            )
        kind = mesh.axis_types[mesh.axis_names.index(axis)]
        if kind != jax.sharding.AxisType.Explicit:
            raise ValueError(
                f"{who}: the mesh axis {axis!r} is of type {kind}, and unreduced arrays "
                "need an Explicit axis. Build the mesh with jax.make_mesh(..., "
                f"axis_types=(jax.sharding.AxisType.Explicit,) * {len(mesh.axis_names)})."
            )
    return math.prod(mesh.shape[axis] for axis in axes)


# --- partial sums that layers keep per device (AccumBatchNorm's window) -------------


def per_device_axes() -> tuple[Any, ...] | None:
    """The mesh axes the batch is split over, while `unreduced_value_and_grad` traces `fun`.

    `None` elsewhere. A layer that sums statistics of its input over the batch
    (`AccumBatchNorm` without `axis_name`) sees only this device's slice
    there, and can keep its sums as partial sums, unreduced over these axes.
    """
    context = _PER_DEVICE.get()
    return None if context is None else context[0]


def per_device_microbatches() -> int:
    """`num_microbatches` of the `unreduced_value_and_grad` tracing `fun` now; 1 elsewhere."""
    context = _PER_DEVICE.get()
    return 1 if context is None else context[1]


def _vary(x: jax.Array, axes: tuple[Any, ...]) -> jax.Array:
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return pcast_to_varying(x, missing) if missing else x


def as_partial(x: jax.Array, axes: tuple[Any, ...]) -> jax.Array:
    """Inside `jax.shard_map`: `x`, the same on every device, as a partial sum over `axes`.

    Device 0 holds `x` and the others zeros, so the sum is `x` exactly; the
    result is typed unreduced over `axes`. No communication.
    """
    x = _vary(x, axes)
    first = jax.lax.axis_index(axes) == 0
    return jax.lax.pcast(jnp.where(first, x, jnp.zeros_like(x)), axes, to="unreduced")


def add_partial(acc: jax.Array, term: jax.Array, axes: tuple[Any, ...]) -> jax.Array:
    """Inside `jax.shard_map`: `acc + term` as a partial sum, typed unreduced over `axes`.

    `term` is this device's own contribution. `acc` is either unreduced over
    `axes` already (partial sums from earlier calls), or the same on every
    device (a total, e.g. zeros from `init`), which `as_partial` splits.
    """
    term = jax.lax.pcast(_vary(term, axes), axes, to="unreduced")
    if unreduced_axes_in_body(acc) >= set(axes):
        return acc + term
    return as_partial(acc, axes) + term


def _global_spec(x: Any) -> Any:
    sharding = getattr(jax.typeof(x), "sharding", None)
    return getattr(sharding, "spec", None)


def is_partial(x: Any) -> bool:
    """Whether `x` is typed unreduced over some mesh axis, in global view or inside `shard_map`."""
    spec = _global_spec(x)
    return bool(unreduced_axes_in_body(x) or (spec is not None and spec.unreduced))


def _ravel(x: jax.Array) -> jax.Array:
    spec = _global_spec(x)
    if spec is not None and spec.unreduced:
        # jnp.ravel cannot infer the sharding of an unreduced array of rank > 1.
        return jnp.reshape(x, (-1,), out_sharding=jax.P(unreduced=spec.unreduced))
    return jnp.ravel(x)


def reduced(tree: Any) -> Any:
    """`tree` with its unreduced leaves summed over their axes, in one reduction.

    The unreduced leaves must share their axes and be otherwise replicated
    (as `AccumBatchNorm`'s window is). They are flattened into one vector,
    so that they travel in a single collective: in global view a
    `jax.reshard` to `P()`, inside `jax.shard_map` a `jax.lax.psum`. Leaves
    that are not unreduced are returned as they are.
    """
    leaves, treedef = jax.tree.flatten(tree)
    partial = [i for i, leaf in enumerate(leaves) if is_partial(leaf)]
    if not partial:
        return tree
    first = leaves[partial[0]]
    inside = unreduced_axes_in_body(first)
    flat = jnp.concatenate([_ravel(leaves[i]) for i in partial])
    if inside:
        flat = jax.lax.psum(flat, tuple(sorted(inside, key=str)))
    else:
        flat = reshard(flat, jax.P())
    starts = itertools.accumulate([leaves[i].size for i in partial], initial=0)
    for i, start in zip(partial, starts, strict=False):
        leaves[i] = jnp.reshape(flat[start : start + leaves[i].size], leaves[i].shape)
    return jax.tree.unflatten(treedef, leaves)


def partial_zeros_like(x: jax.Array) -> jax.Array:
    """Zeros shaped and typed like `x`, a partial sum (unreduced). No communication."""
    zeros = jnp.zeros(jnp.shape(x), x.dtype)
    inside = unreduced_axes_in_body(x)
    if inside:
        axes = tuple(sorted(inside, key=str))
        return jax.lax.pcast(pcast_to_varying(zeros, axes), axes, to="unreduced")
    spec = _global_spec(x)
    return reshard(zeros, jax.P(*compat.partitions(spec), unreduced=spec.unreduced))


# --- the unreduced window of `accumulate` ------------------------------------------
#
# Unreduced arrays allow adds and selects but no element-wise rule that is not
# linear (`abs`, `isfinite`), so the finiteness check and the weighted add run
# per device, inside a `jax.shard_map` with `check_vma=False`: there each
# device sees its own partial sum as a plain array. Nothing leaves the device.
# A leaf that is not unreduced (replicated) counts as a partial sum split
# evenly: each device holds `1/n` of it.


def _spec(leaf: Any) -> Any:
    return jax.typeof(leaf).sharding.spec


def _is_unreduced(leaf: Any) -> bool:
    return bool(_spec(leaf).unreduced)


def _mesh_axes_of(spec: Any) -> set:
    return {
        a
        for part in compat.partitions(spec)
        if part is not None
        for a in (part if isinstance(part, tuple) else (part,))
    }


def unreduced_axes(name: str, tree: Any) -> tuple[Any, ...] | None:
    """The mesh axes over which leaves of `tree` are unreduced, or `None` if none is.

    All unreduced leaves must share one set of axes, and the other leaves must
    not be sharded over them.
    """
    found: dict[frozenset, str] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        axes = frozenset(_spec(leaf).unreduced)
        if axes:
            found.setdefault(axes, jax.tree_util.keystr(path))
    if not found:
        return None
    if len(found) > 1:
        shown = {where: sorted(axes, key=str) for axes, where in found.items()}
        raise ValueError(
            f"{name} leaves are unreduced over different mesh axes: {shown}. Take every "
            "gradient with one unreduced_value_and_grad(..., axis_name=...) call, or reduce "
            "the extra axes first with jax.reshard."
        )
    axes = next(iter(found))
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        spec = _spec(leaf)
        if not spec.unreduced and _mesh_axes_of(spec) & axes:
            raise ValueError(
                f"{name} leaf {jax.tree_util.keystr(path)!r} is sharded over "
                f"{sorted(_mesh_axes_of(spec) & axes, key=str)} ({spec}) while other leaves "
                f"are unreduced over them. Take it with unreduced_value_and_grad like the "
                f"others, or reshard it: jax.reshard(leaf, jax.P()) (an all-gather)."
            )
    return tuple(sorted(axes, key=str))


def _device_count(axes: tuple[Any, ...]) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[axis] for axis in axes)


def _share(leaf: jax.Array, is_unreduced: bool, axes: tuple[Any, ...], devices: int):
    """Inside the per-device body: this device's share of a global leaf.

    An unreduced leaf's share is its partial sum; a replicated floating leaf's
    is `1/n` of it; a replicated count cannot be split, so device 0 keeps it.
    """
    if is_unreduced:
        return leaf
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return leaf / jnp.asarray(devices, leaf.dtype)
    first = jax.lax.axis_index(axes) == 0
    return jnp.where(first, leaf, jnp.zeros_like(leaf))


def _unsplit(leaf: jax.Array, axes: tuple[Any, ...]) -> jax.Array:
    spec = _spec(leaf)
    if spec.unreduced or not _mesh_axes_of(spec) & set(axes):
        return leaf

    def drop(part):
        names = part if isinstance(part, tuple) else (part,)
        kept = tuple(a for a in names if a is not None and a not in axes)
        return kept if len(kept) > 1 else (kept[0] if kept else None)

    return reshard(leaf, jax.P(*(drop(part) for part in compat.partitions(spec))))


def _with_unreduced(spec: Any, axes: tuple[Any, ...]) -> Any:
    """`spec`'s sharding over mesh axes (HSDP: `fsdp`), unreduced over `axes`."""
    return jax.P(*compat.partitions(spec), unreduced=frozenset(axes))


def _per_device(
    body: Callable[..., Any],
    axes: tuple[Any, ...],
    plain: tuple[Any, ...],
    plain_specs: tuple[Any, ...],
    shared: tuple[Any, ...],
    out_specs: Any,
) -> Any:
    """Runs `body(plain, *shares)` on every device, with no communication over `axes`.

    `plain` operands reach the body as `jax.shard_map` gives them under
    `plain_specs`; each tree of `shared` arrives as this device's share of
    its leaves (see `_share`), sharded over any other mesh axes as it is.
    `out_specs` is a spec, a tree of them, or `None`: then the outputs are
    shaped like the first tree of `shared`, each leaf sharded like its
    counterpart there and unreduced over `axes`.
    """
    devices = _device_count(axes)
    # A state leaf sharded over the axes (the accumulator `init` made like
    # params sharded for FSDP) is gathered first; this happens on the call that
    # retypes the state as unreduced, not on later ones.
    shared = tuple(jax.tree.map(lambda x: _unsplit(x, axes), tree) for tree in shared)
    kinds = [jax.tree.map(_is_unreduced, tree) for tree in shared]
    specs = [
        jax.tree.map(lambda x, u: _with_unreduced(_spec(x), axes) if u else _spec(x), tree, kind)
        for tree, kind in zip(shared, kinds, strict=True)
    ]
    if out_specs is None:
        out_specs = jax.tree.map(lambda x: _with_unreduced(_spec(x), axes), shared[0])

    def local(plain, *trees):
        shares = [
            jax.tree.map(lambda x, u: _share(x, u, axes, devices), tree, kind)
            for tree, kind in zip(trees, kinds, strict=True)
        ]
        return body(plain, *shares)

    in_specs = (tuple(plain_specs), *specs)
    return jax.shard_map(local, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        tuple(plain), *shared
    )


def _other_axes(tree: Any, axes: tuple[Any, ...]) -> tuple[Any, ...]:
    """The mesh axes other than `axes` that leaves of `tree` are sharded over (HSDP: `fsdp`)."""
    names: set = set()
    for leaf in jax.tree.leaves(tree):
        names |= _mesh_axes_of(_spec(leaf))
    return tuple(sorted(names - set(axes), key=str))


def local_accept(
    grads: Any, valid: jax.Array, axes: tuple[Any, ...], *, check: bool = True
) -> jax.Array:
    """`bool[n]` sharded over `axes`: whether each device's share of `grads` is finite.

    `valid` (a replicated boolean scalar, e.g. whether the weight is usable)
    is and-ed in. With `check=False` the gradients are not looked at. Where
    the leaves are sharded over other mesh axes too (HSDP), the devices that
    hold shards of one partial sum agree (one scalar all-reduce over those
    axes), so that a partial sum is dropped whole or added whole.
    """
    others = _other_axes(grads, axes) if check else ()

    def body(plain, grads):
        (valid,) = plain
        leaves = [leaf for leaf in jax.tree.leaves(grads) if leaf.size and check]
        finite = [jnp.isfinite(jnp.max(jnp.abs(leaf))) for leaf in leaves]
        ok = jnp.all(jnp.stack([valid, *finite]))
        if others:
            ok = jax.lax.pmin(ok.astype(jnp.int32), others).astype(jnp.bool_)
        return jnp.reshape(ok, (1,))

    return _per_device(body, axes, (valid,), (jax.P(),), (grads,), jax.P(axes))


def local_add(
    acc: Any,
    grads: Any,
    accepted: jax.Array,
    scale: jax.Array | None,
    reset: jax.Array | None,
    axes: tuple[Any, ...],
    keep: jax.Array | None = None,
) -> Any:
    """Each device's `acc + scale * g` where it accepted (fresh zeros where `reset`), unreduced.

    With `reset=None` it is the read-only window total the close reduces; with
    the conditional's `reset` flag it is the write after the conditional.
    `keep` (a scalar, the same on every device; `None` for 1) rescales the held
    sum first, in float32: a float16 window held in units of its weight so far.
    """
    scale = jnp.float32(1.0) if scale is None else scale
    reset = jnp.array(False) if reset is None else reset
    kept = keep is not None
    keep = jnp.float32(1.0) if keep is None else keep

    def body(plain, acc, grads):
        accepted, scale, reset, keep = plain
        ok = accepted[0]

        def leaf(a, g):
            if kept:
                wide = jnp.promote_types(a.dtype, jnp.float32)
                total = a.astype(wide) * keep.astype(wide) + g.astype(wide) * scale.astype(wide)
                added = jnp.where(ok, total.astype(a.dtype), a)
            else:
                added = jnp.where(ok, a + g.astype(a.dtype) * scale.astype(a.dtype), a)
            return jnp.where(reset, jnp.zeros_like(a), added)

        return jax.tree.map(leaf, acc, grads)

    plain_specs = (jax.P(axes), jax.P(), jax.P(), jax.P())
    plain = (accepted, scale, reset, keep)
    return _per_device(body, axes, plain, plain_specs, (acc, grads), None)


def local_count(
    acc_weight: jax.Array,
    num_skipped: jax.Array,
    accepted: jax.Array,
    term_weight: jax.Array,
    reset: jax.Array | None,
    axes: tuple[Any, ...],
    keep: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Each device's window weight and drop count, unreduced.

    A device that accepts adds `term_weight / n`, its share of the micro-step's
    weight, so the reduced weight is the accepted fraction of the window's
    weight; a device that drops adds one to its count. `keep` rescales the held
    weight with the held sums (see `local_add`).
    """
    reset = jnp.array(False) if reset is None else reset
    devices = _device_count(axes)
    kept = keep is not None
    keep = jnp.ones([], acc_weight.dtype) if keep is None else keep.astype(acc_weight.dtype)

    def body(plain, acc_weight, num_skipped):
        accepted, term_weight, reset, keep = plain
        ok = accepted[0]
        held = acc_weight * keep if kept else acc_weight
        weight = held + jnp.where(ok, term_weight / devices, 0.0).astype(acc_weight.dtype)
        weight = jnp.where(reset, jnp.zeros_like(weight), weight)
        skipped = jnp.where(ok, num_skipped, optax.safe_increment(num_skipped))
        return weight, skipped

    plain_specs = (jax.P(axes), jax.P(), jax.P(), jax.P())
    unreduced = jax.P(unreduced=frozenset(axes))
    return _per_device(
        body,
        axes,
        (accepted, term_weight, reset, keep),
        plain_specs,
        (acc_weight, num_skipped),
        (unreduced, unreduced),
    )


# --- the gate: one reduction at the window's close -------------------------------


def _dense(spec: Any) -> Any:
    """`spec` without its unreduced axes: the sharding the reduction produces."""
    # `*spec` refuses a spec with unreduced axes; its partitions are what is kept.
    return jax.P(*compat.partitions(spec))


def dense_spec(leaf: Any) -> Any:
    """The sharding of `leaf` without unreduced axes."""
    return _dense(_spec(leaf))


def spec_axes(name: str, specs: Any) -> tuple[Any, ...]:
    """The mesh axes that a tree of specs shards over, or a `ValueError` if none."""
    names: set = set()
    for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.P)):
        names |= _mesh_axes_of(spec)
    if not names:
        raise ValueError(
            f"{name} names no mesh axis to shard the inner state over (every spec is "
            "replicated); pass the data-parallel axis, e.g. shard_inner_state='data'."
        )
    return tuple(sorted(names, key=str))


def unreduced_zeros(tree: Any, axes: tuple[Any, ...]) -> Any:
    """`tree` of zeros typed unreduced over `axes` (each device holds zeros: no communication).

    A leaf sharded over other mesh axes (HSDP's `fsdp`) keeps that sharding.
    """
    return jax.tree.map(lambda z: reshard(z, _with_unreduced(_dense(_spec(z)), axes)), tree)


def check_unreduced_windows(what: str) -> None:
    """Raises where the installed JAX cannot accumulate unreduced gradients (see `_compat`)."""
    if not compat.UNREDUCED_IN_SHARD_MAP:
        raise ValueError(
            f"{what}: an unreduced window needs JAX >= 0.9.1 (installed {jax.__version__}). "
            "Upgrade JAX, or reduce the gradients before accumulate "
            "(jax.sharding.reshard(grads, jax.P()), an all-reduce per micro-step) and build "
            "accumulate without shard_inner_state."
        )


def check_shard_inner_state(shard_inner_state: Any) -> tuple[Any, ...] | None:
    """Validates `accumulate`'s `shard_inner_state`; returns its axes when it names them."""
    if shard_inner_state is None:
        return None
    is_spec = lambda x: isinstance(x, jax.P)  # noqa: E731
    axes = None
    if isinstance(shard_inner_state, str | tuple) and not is_spec(shard_inner_state):
        axes = validation.check_axis_name("shard_inner_state", shard_inner_state)
    elif not callable(shard_inner_state):
        leaves = jax.tree.leaves(shard_inner_state, is_leaf=is_spec)
        if not leaves or not all(is_spec(x) for x in leaves):
            raise TypeError(
                "shard_inner_state must be a mesh axis name (such as 'data'), a tuple of "
                "names, a callable (path, param) -> PartitionSpec, or a tree of "
                f"PartitionSpecs shaped like the params; got {shard_inner_state=!r}."
            )
    return axes


def _names(part: Any) -> tuple[Any, ...]:
    return () if part is None else (part if isinstance(part, tuple) else (part,))


def _reduce_into(x: jax.Array, target: Any) -> jax.Array:
    """Sums unreduced `x` into the sharding `target`: a reduce-scatter where it can be one.

    `jax.reshard` lowers a sum into a sharding that splits a dimension over the
    unreduced axes to an all-reduce followed by a slice (jax 0.10.2, XLA:CPU),
    which moves twice the bytes of a reduce-scatter. When `target` differs
    from `x`'s sharding only by those axes appended to one dimension's mesh
    axes (ZeRO-1: `P()` -> `P("data")`, HSDP: `P("fsdp")` -> `P(("fsdp", "data"))`),
    each device scatters its partial sum with `psum_scatter` instead.
    """
    spec = _spec(x)
    axes = tuple(sorted(spec.unreduced, key=str))
    ndim = jnp.ndim(x)
    src = list(compat.partitions(spec)) + [None] * (ndim - len(compat.partitions(spec)))
    dst = list(target) + [None] * (ndim - len(target))
    changed = [i for i in range(ndim) if _names(src[i]) != _names(dst[i])]
    if not axes or len(changed) != 1 or _names(dst[changed[0]]) != _names(src[changed[0]]) + axes:
        return reshard(x, target)
    dim = changed[0]

    def scatter(block: jax.Array) -> jax.Array:
        return jax.lax.psum_scatter(block, axes, scatter_dimension=dim, tiled=True)

    in_spec = jax.P(*src, unreduced=frozenset(axes))
    return jax.shard_map(scatter, in_specs=in_spec, out_specs=jax.P(*dst), check_vma=False)(x)


def inner_specs(params: Any, shard_inner_state: Any, axes: tuple[Any, ...] | None) -> Any:
    """The sharding of the inner optimizer's view of `params` (and of its state).

    `None` keeps each leaf's own (dense) sharding. An axis name (or tuple)
    splits the first dimension of every leaf whose first dimension is
    divisible by the number of devices along it and is not sharded already;
    other leaves keep their sharding. A callable `(path, leaf) -> spec` or a
    tree of specs like `params` chooses per leaf.
    """
    if shard_inner_state is None:
        return jax.tree.map(lambda p: _dense(_spec(p)), params)
    if callable(shard_inner_state):
        return jax.tree_util.tree_map_with_path(shard_inner_state, params)
    if axes is None:
        return jax.tree.map(
            lambda p, s: s, params, shard_inner_state, is_leaf=lambda x: isinstance(x, jax.P)
        )
    name = axes[0] if len(axes) == 1 else axes
    devices = mesh_axes_size(axes, f"shard_inner_state={name!r}")

    def split_first(p: Any) -> Any:
        dense = compat.partitions(_dense(_spec(p)))
        parts = list(dense) + [None] * (jnp.ndim(p) - len(dense))
        if not jnp.ndim(p):
            return jax.P(*parts)
        # The first dimension, on top of the mesh axes it is split over already
        # (HSDP: `fsdp`, so the inner state is split over both axes).
        held = (
            () if parts[0] is None else (parts[0] if isinstance(parts[0], tuple) else (parts[0],))
        )
        if set(held) & set(axes):
            return jax.P(*parts)
        held_devices = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in held)
        if jnp.shape(p)[0] % (held_devices * devices) == 0:
            joint = (*held, *axes)
            parts[0] = joint[0] if len(joint) == 1 else joint
        return jax.P(*parts)

    return jax.tree.map(split_first, params)
