"""How `clipped_grad` cuts a batch into chunks, and which chunk size fits a memory budget.

A call's batch (its size and padding checked here) is cut into contiguous chunks of
equal size, given by `num_microbatches=` or `microbatch_size=`, or planned with
`microbatch_size="auto"`. The plan's candidates are the counts of equal chunks that
the batch each device clips can be cut into; `_sharding/compiled_memory.py` compiles
the clipped sums for some of them on abstract shapes (nothing runs) and
binary-searches for the fewest chunks, so the largest chunk, whose peak bytes fit the
budget: the search, budget and error of `microbatch_value_and_grad(...,
num_microbatches="auto")`.

Inside `jax.shard_map` or `jax.pmap` a call clips one device's examples, and its
per-example keys (and maybe the loss) use collectives over the mapped axes, which a
program compiled on its own does not have: there the plan compiles one device's
program under a `jax.shard_map` over as many devices as those axes have
(`compiled_memory.each_device`), and reads one device's peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import validation
from gradaccum_jax._sharding import compiled_memory

AUTO = "auto"
# `_Options.chunking`: None (one chunk), ("num_microbatches" | "microbatch_size", int),
# or AUTO, which a call replaces by ("num_microbatches", K) from its plan.
Chunking = tuple[str, int] | str | None


def check_chunking(num_microbatches: Any, microbatch_size: Any, memory_budget: Any) -> Chunking:
    """`clipped_grad`'s chunking arguments, checked; raises naming the fix otherwise."""
    if num_microbatches is not None and microbatch_size is not None:
        raise ValueError(
            "Give at most one of num_microbatches and microbatch_size; got "
            f"{num_microbatches=} and {microbatch_size=}."
        )
    if isinstance(num_microbatches, str) and num_microbatches == AUTO:
        raise ValueError(
            "clipped_grad plans the size of its chunks: pass microbatch_size='auto' (with "
            f"memory_budget= in bytes) instead of {num_microbatches=!r}. The plan takes the "
            "largest chunk that fits, which is the fewest chunks."
        )
    auto = isinstance(microbatch_size, str) and microbatch_size == AUTO
    if memory_budget is not None:
        if not auto:
            raise ValueError(
                f"memory_budget chooses the chunk size, but {microbatch_size=!r} and "
                f"{num_microbatches=!r} are given; pass microbatch_size='auto' with "
                "memory_budget, or drop memory_budget."
            )
        validation.check_real("memory_budget", memory_budget, minimum=0, exclusive=True)
    if auto:
        return AUTO
    if num_microbatches is not None:
        return ("num_microbatches", validation.check_int("num_microbatches", num_microbatches))
    if microbatch_size is not None:
        if isinstance(microbatch_size, str):
            raise TypeError(
                f"microbatch_size must be a Python int >= 1 or 'auto'; got "
                f"{microbatch_size=!r}. Pass an int such as microbatch_size=4, or "
                "microbatch_size='auto' with memory_budget= (bytes) to plan it from the "
                "compiled program."
            )
        return ("microbatch_size", validation.check_int("microbatch_size", microbatch_size))
    return None


def plan_chunks(
    build: Callable[[int], Callable[..., Any]],
    args: tuple[Any, ...],
    *,
    batch_size: int,
    memory_budget: float | None,
    cache_key: Any,
) -> compiled_memory.MicrobatchPlan:
    """The fewest chunks `K` of `batch_size` examples (each device's) whose program fits.

    `build(K)` is the call with `K` chunks, `build(K)(*args)`. Inside `jax.shard_map`
    or `jax.pmap` (manual mesh axes in context) one device's program is planned.
    """
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(mesh.manual_axes) if not mesh.empty else ()
    kwargs: dict[str, Any] = {}
    if manual:
        build, args, kwargs = compiled_memory.each_device(build, manual, args, kwargs)
    return compiled_memory.plan(
        build,
        args,
        kwargs,
        candidates=compiled_memory.even_splits(batch_size),
        batch_size=batch_size,
        memory_budget=memory_budget,
        cache_key=cache_key,
    )


def batch_size(args: tuple[Any, ...], batched: tuple[int, ...]) -> int:
    if max(batched) >= len(args):
        raise ValueError(
            f"batch_argnums={batched} names argument {max(batched)}, but the function was "
            f"called with {len(args)} positional arguments."
        )
    # A scalar leaf has no batch axis: size 0, refused with the empty batch.
    # Keyed by argument and path: two plain arrays both have the empty path.
    sizes = {
        f"argument {i}{jax.tree_util.keystr(path)}": jnp.shape(leaf)[0] if jnp.ndim(leaf) else 0
        for i in batched
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[i])
    }
    distinct = set(sizes.values())
    if len(distinct) != 1 or 0 in distinct:
        raise ValueError(
            "Every leaf of the batch arguments (batch_argnums) must carry the batch on its "
            "leading axis, all of one size > 0 (pad an empty micro-batch and mark it with "
            f"is_padding_example=); got leading sizes {sizes}."
        )
    (size,) = distinct
    return int(size)


def padding_mask(is_padding_example: Any, n: int) -> jax.Array:
    if is_padding_example is None:
        return jnp.zeros(n, bool)
    mask = jnp.asarray(is_padding_example)
    if mask.shape != (n,) or mask.dtype != jnp.bool_:
        raise ValueError(
            f"is_padding_example must be a bool array of shape ({n},), one flag per example "
            f"of the batch; got dtype {mask.dtype} and shape {mask.shape}."
        )
    return mask


def num_chunks(chunking: Chunking, n: int, axes: Any = ()) -> int:
    """The number of chunks of `n` examples; `axes`, the mesh axes the batch is split over
    (then `n` is one device's share, and so are the chunks)."""
    if not isinstance(chunking, tuple):  # AUTO is planned before a call comes here
        return 1
    name, value = chunking
    chunks = value if name == "num_microbatches" else n // value
    if n % value:
        other = "microbatch_size" if name == "num_microbatches" else "num_microbatches"
        share = ""
        if axes:
            share = (
                f" ({n} examples: each device's share of the batch, which is split over the "
                f"mesh axes {tuple(sorted(axes))}; the chunks are cut from each device's share)"
            )
        raise ValueError(
            f"{name}={value} must divide the batch size {n}{share}. Pad the batch to a multiple "
            f"(mark the padding with is_padding_example=; all-padding chunks are skipped), "
            f"or pick another {name} or {other}."
        )
    return chunks


def chunked(mapped: dict[int, Any], chunks: int) -> dict[int, Any]:
    """The mapped arguments cut into `chunks` contiguous chunks along their leading axis."""
    return jax.tree.map(lambda x: x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:]), mapped)
