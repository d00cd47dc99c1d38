"""Peak memory of compiled programs, and the search for the first candidate that fits.

A plan compiles a program for each candidate it tries on abstract shapes (nothing
runs, so nothing can run out of memory), reads each program's peak bytes from
`compiled.memory_analysis()` (one device's, where the arguments are sharded over a
mesh or the program is one device's of a mapped axis), and binary-searches the
candidates for the first that fits a budget. `_batching/planning.py` searches the
number of micro-batches of `microbatch_value_and_grad`, `_privacy/chunks.py` the
chunks of `clipped_grad`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from gradaccum_jax._base import compat

# With memory_budget=None the plan may use this fraction of the memory the
# device reports free: the runtime needs room beyond the compiled program's
# buffers (allocator fragmentation, the caller's other live arrays).
DEVICE_MEMORY_FRACTION = 0.9

# Peak bytes of compiled programs, by (function, options, abstract arguments, K).
_PEAKS: collections.OrderedDict[Any, int] = collections.OrderedDict()
_MAX_CACHED = 512


class MicrobatchPlan(NamedTuple):
    """The number of micro-batches chosen by `gradaccum_jax.plan_microbatches`.

    Also the chunks of `gradaccum_jax.privacy.clipped_grad(...,
    microbatch_size="auto")`, which its function's `plan_memory` returns: there
    the batch is the one each device clips (its shard, under global-view
    `jax.jit`), and `microbatch_size` is the chunk size that function uses.

    Attributes:
      num_microbatches: `K`, the smallest candidate (a divisor of the batch
        size; with a batch explicitly sharded over devices, one that leaves a
        micro-batch size divisible by the number of shards) whose program fits
        `memory_budget`.
      microbatch_size: The batch size divided by `num_microbatches`: the
        largest micro-batch (chunk) that fits.
      peak_bytes: Peak bytes of the program with `num_microbatches`
        micro-batches: `temp + argument + output - alias` of its
        `compiled.memory_analysis()`.
      memory_budget: The budget in bytes that the plan fits.
      table: A dict `K -> peak bytes`, in increasing `K`, for every `K` the
        search compiled (or found compiled in the cache).
    """

    num_microbatches: int
    microbatch_size: int
    peak_bytes: int
    memory_budget: int
    table: dict[int, int]


def peak_bytes(compiled: Any) -> int:
    """Peak bytes of a compiled program: `temp + argument + output - alias`.

    Temporaries, inputs and outputs are live at once at the program's peak;
    an output that aliases a (donated) input occupies the input's buffer and
    is counted once.
    """
    stats = compiled.memory_analysis()
    return int(
        stats.temp_size_in_bytes
        + stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
    )


def _device_of(leaves: Sequence[Any]) -> Any:
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return next(iter(leaf.sharding.device_set))
    return jax.local_devices()[0]


def device_memory_budget(device: Any) -> int:
    """`DEVICE_MEMORY_FRACTION` of the memory `device` reports free, in bytes."""
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(
            f"memory_budget=None plans within the free memory that the device reports "
            f"(device.memory_stats()), but {device} reports no memory limit (CPU devices "
            "do not). Pass memory_budget= in bytes, e.g. memory_budget=2 * 2**30."
        )
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return int(DEVICE_MEMORY_FRACTION * free)


def _abstract(x: Any) -> Any:
    """`x` as a `jax.ShapeDtypeStruct`, or `None` for a value passed as a Python constant."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        aval = jax.typeof(x)
        # A tracer's sharding is not known until the outer program is compiled,
        # unless its mesh axes are Explicit: then it is part of the type (FSDP
        # params sharded over the mesh), and the plan must compile with it. One
        # device needs none, so arrays, tracers and shapes share cache entries.
        sharding = None
        if isinstance(x, jax.core.Tracer):
            spec = getattr(aval.sharding, "spec", None)
            if spec is not None and any(part is not None for part in compat.partitions(spec)):
                sharding = aval.sharding
        elif len(x.sharding.device_set) > 1:
            sharding = x.sharding
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=aval.weak_type)
    if isinstance(x, np.ndarray | np.generic):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return None


def _compiled(lowered: Any, shapes: Sequence[Any]) -> Any:
    """`lowered.compile()`; where the arguments' shardings name a mesh but no devices (a
    trace over arrays typed on an Explicit mesh, no `jax.set_mesh`), on as many devices as
    that mesh has: the peak bytes of one device do not depend on which."""
    meshes = [getattr(s.sharding, "mesh", None) for s in shapes if s.sharding is not None]
    abstract = [m for m in meshes if isinstance(m, jax.sharding.AbstractMesh)]
    if not abstract or len(abstract) < len(meshes) or not compat.COMPILES_ON_DEVICES:
        return lowered.compile()
    return lowered.compile(device_assignment=tuple(jax.devices()[: abstract[0].size]))


def each_device(
    build: Callable[[int], Callable[..., Any]],
    axis_name: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Callable[[int], Callable[..., Any]], tuple[Any, ...], dict[str, Any]]:
    """`plan`'s `build`, `args` and `kwargs` for a function of one device of a mapped axis.

    Called inside `jax.shard_map` or `jax.pmap`, where `build(K)` uses collectives
    over `axis_name`: a program compiled on its own has no such axis. The plan
    compiles `build(K)` under a `jax.shard_map` over as many devices as the axis
    has, each given its own copy of `args` (stacked along a new leading axis), so
    that the peak bytes read are one device's.
    """
    sizes = [int(jax.lax.psum(1, name)) for name in axis_name]
    devices = jax.devices()
    if len(devices) < int(np.prod(sizes)):
        raise ValueError(
            f"num_microbatches='auto' with axis_name={axis_name!r} compiles one device's "
            f"program over {int(np.prod(sizes))} devices, but {len(devices)} are visible. "
            "Pass num_microbatches as an int."
        )
    mesh = jax.sharding.Mesh(np.array(devices[: int(np.prod(sizes))]).reshape(sizes), axis_name)
    spec = jax.sharding.PartitionSpec(axis_name)

    def stacked(x: Any) -> Any:
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
            return jax.ShapeDtypeStruct((mesh.size, *np.shape(x)), x.dtype)
        return x

    def build_each(k: int) -> Callable[..., Any]:
        function = build(k)

        def run(*stacked_args: Any, **stacked_kwargs: Any) -> Any:
            leaves, treedef = jax.tree_util.tree_flatten((stacked_args, stacked_kwargs))
            arrays = [x for x in leaves if isinstance(x, jax.Array)]

            def one_device(*local: Any) -> Any:
                rows = iter(local)
                full = [next(rows)[0] if isinstance(x, jax.Array) else x for x in leaves]
                call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
                return jax.tree.map(lambda y: y[None], function(*call_args, **call_kwargs))

            # Its own mesh, not the caller's (whose axes are manual in the caller's body).
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return jax.shard_map(one_device, mesh=mesh, in_specs=spec, out_specs=spec)(*arrays)

        return run

    stacked_args, stacked_kwargs = jax.tree.map(stacked, (args, kwargs))
    return build_each, stacked_args, stacked_kwargs


def even_splits(batch_size: int, shards: int = 1) -> list[int]:
    """The counts `K`, increasing, that cut `batch_size` into equal parts of a multiple of
    `shards` examples each (every divisor of `batch_size` with `shards=1`)."""
    return [
        k
        for k in range(1, batch_size + 1)
        if batch_size % k == 0 and (batch_size // k) % shards == 0
    ]


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        return None
    return key


def plan(
    build: Callable[[int], Callable[..., Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    **search_options: Any,
) -> MicrobatchPlan:
    """`search(build, args, kwargs, **search_options)`, with a clear error where this JAX
    cannot compile the candidates: traced arrays typed on a mesh with Explicit axes (JAX
    0.8.1 fails there, 0.10.2 does not)."""
    mesh = _traced_explicit_mesh(args, kwargs)
    try:
        return search(build, args, kwargs, **search_options)
    except Exception as err:  # JAX's ShardingTypeError has no public name
        # JAX 0.8.1 fails on such a trace in one of two ways: a ShardingTypeError, or a
        # ValueError asking for lowering_platforms where only an AbstractMesh is known.
        old_jax = type(err).__name__ == "ShardingTypeError" or (
            isinstance(err, ValueError) and "AbstractMesh" in str(err)
        )
        if mesh is None or not old_jax:
            raise
        raise ValueError(
            "an 'auto' plan inside jax.jit, over arrays typed on a mesh with Explicit axes "
            f"({dict(mesh.shape)}): JAX {jax.__version__} could not compile the plan's "
            "candidate programs on that traced mesh. Pass the number as an int "
            "(num_microbatches= or microbatch_size=), chosen outside jax.jit on the concrete "
            "arrays with ga.plan_microbatches(...) (or, for clipped_grad, fn.plan_memory(...)), "
            "or use a newer JAX."
        ) from err


def _traced_explicit_mesh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The mesh of the first traced array typed on a mesh with Explicit axes, or None."""
    for leaf in jax.tree.leaves((args, kwargs)):
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if (
            isinstance(leaf, jax.core.Tracer)
            and mesh is not None
            and jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())
        ):
            return mesh
    return None


def search(
    build: Callable[[int], Callable[..., Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    candidates: Sequence[int],
    batch_size: int,
    memory_budget: float | None,
    cache_key: Any,
) -> MicrobatchPlan:
    """The smallest of `candidates` (increasing) for which `build(K)` fits the budget.

    `build(K)` returns the function to compile, called as `f(*args, **kwargs)`.
    Arrays among the arguments are replaced by their shapes; other leaves are
    passed as Python constants. The peak is assumed roughly non-increasing in
    `K`: a binary search compiles at most `ceil(log2(len(candidates) + 1))` programs,
    and the candidate below the chosen one is always among them (it does not
    fit). Peaks are cached by `cache_key`, the abstract arguments and `K`.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    abstract = [_abstract(leaf) for leaf in leaves]
    if memory_budget is None:
        budget = device_memory_budget(_device_of(leaves))
    else:
        budget = int(memory_budget)
    # Constants by type too: True == 1 == 1.0, but they may trace differently.
    signature = tuple(
        (type(leaf), leaf) if a is None else a for a, leaf in zip(abstract, leaves, strict=True)
    )
    table: dict[int, int] = {}

    def compile_peak(k: int) -> int:
        function = build(k)

        def flat(*arrays: Any) -> Any:
            arrays_left = iter(arrays)
            full = [
                leaf if a is None else next(arrays_left)
                for a, leaf in zip(abstract, leaves, strict=True)
            ]
            call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
            return function(*call_args, **call_kwargs)

        shapes = [a for a in abstract if a is not None]
        return peak_bytes(_compiled(jax.jit(flat).lower(*shapes), shapes))

    def peak_of(k: int) -> int:
        key = _hashable((cache_key, treedef, signature, k))
        if key is None:
            table[k] = compile_peak(k)
        elif key in _PEAKS:
            _PEAKS.move_to_end(key)
            table[k] = _PEAKS[key]
        else:
            table[k] = _PEAKS[key] = compile_peak(k)
            if len(_PEAKS) > _MAX_CACHED:
                _PEAKS.popitem(last=False)
        return table[k]

    # Invariant: candidates[low] does not fit (or low = -1), candidates[high]
    # fits (or high = len(candidates)).
    low, high = -1, len(candidates)
    while high - low > 1:
        middle = (low + high) // 2
        if peak_of(candidates[middle]) <= budget:
            high = middle
        else:
            low = middle
    table = dict(sorted(table.items()))
    if high == len(candidates):
        smallest = min(table, key=lambda k: table[k])
        raise ValueError(
            f"no number of micro-batches fits memory_budget={budget} bytes "
            f"({budget / 2**20:.1f} MiB): the smallest peak found is {table[smallest]} bytes "
            f"({table[smallest] / 2**20:.1f} MiB) at num_microbatches={smallest}, micro-batch "
            f"size {batch_size // smallest} (peaks by K: {table}). Raise memory_budget, or "
            "shrink the model, the batch or what else the program holds."
        )
    k = candidates[high]
    return MicrobatchPlan(
        num_microbatches=k,
        microbatch_size=batch_size // k,
        peak_bytes=table[k],
        memory_budget=budget,
        table=table,
    )
