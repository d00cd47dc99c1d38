"""Planning the number of micro-batches from compiled memory.

`gradaccum_jax.plan_microbatches`, `microbatch_value_and_grad(...,
num_microbatches="auto")` and `coupled_value_and_grad(..., "auto")` search the counts K
that split a call's batch evenly with `_sharding/compiled_memory.py`'s search: the
smallest K whose compiled program fits the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from gradaccum_jax._batching import splitting
from gradaccum_jax._sharding import compiled_memory
from gradaccum_jax._sharding.compiled_memory import MicrobatchPlan


def plan_batch(
    build: Callable[[int], Callable[..., Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: splitting._Options,
    *,
    memory_budget: float | None,
    cache_key: Any,
    shards: int = 1,
    axis_name: tuple[Any, ...] | None = None,
) -> MicrobatchPlan:
    """`plan` over the counts `K` that split the batch of a call evenly.

    Every micro-batch must split evenly over `shards` devices and over the
    devices its batch leaves are explicitly sharded over. Under `axis_name`
    (inside `jax.shard_map` or `jax.pmap`), one device's program is planned
    (`each_device`).
    """
    splitting._check_call(args, kwargs, options)
    batch_size = splitting._batch_size(args, options.batch_nums)
    shards = math.lcm(
        shards,
        *(
            splitting._explicit_shards(leaf)[0]
            for j in options.batch_nums
            for leaf in jax.tree_util.tree_leaves(args[j])
        ),
    )
    if axis_name is not None:
        build, args, kwargs = compiled_memory.each_device(build, axis_name, args, kwargs)
    return compiled_memory.plan(
        build,
        args,
        kwargs,
        candidates=compiled_memory.even_splits(batch_size, shards),
        batch_size=batch_size,
        memory_budget=memory_budget,
        cache_key=cache_key,
    )
