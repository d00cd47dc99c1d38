"""The two passes of `coupled_value_and_grad` over one group of towers' micro-batches.

`Embedder` calls `embed_fn` on micro-batch `i` exactly as both passes need it
(same slice, same folded keys, same carry); `embed_all` is pass 1, a scan that
embeds every micro-batch with nothing differentiated; `pull_back` is pass 2, a
scan that re-embeds each micro-batch under `jax.vjp` against its rows of the
embeddings' cotangent and adds the parameter gradients (fp8 metadata leaves take
their max, `_base/reduce_rules.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base.compat import varying_axes
from gradaccum_jax._batching import combining, devices, splitting


@dataclasses.dataclass(frozen=True)
class Group:
    """Towers embedded with the same number of micro-batches."""

    k: int
    towers: tuple[Any, ...] | None  # None: the whole output of embed_fn

    def select(self, out: Any) -> Any:
        return out if self.towers is None else {t: out[t] for t in self.towers}


def is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def check_embeddings(out: Any, micro: int, k: int) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(out):
        shape = jnp.shape(leaf)
        if not shape or shape[0] != micro:
            raise ValueError(
                f"every leaf of embed_fn's output needs the batch axis first, one row per "
                f"example; the leaf at {jax.tree_util.keystr(path)!r} has shape {list(shape)} "
                f"for a micro-batch of {micro} examples (num_microbatches={k}). Return "
                "per-example embeddings (and labels) from embed_fn, and compute anything "
                "over the batch (means, norms across examples) in loss_fn."
            )


class Embedder:
    """Calls `embed_fn` on micro-batch `i` of a group, as in both passes."""

    def __init__(
        self,
        embed_fn: Callable[..., Any],
        group: Group,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: splitting._Options,
        axis_name: tuple[Any, ...] | None,
    ):
        self.embed_fn, self.group, self.options = embed_fn, group, options
        self.args, self.kwargs = args, kwargs
        # Types to match only where they are tracked (jax.shard_map; not jax.pmap,
        # where a varying cast would transpose to a psum of the cotangents).
        batch = [x for j in options.batch_nums for x in jax.tree_util.tree_leaves(args[j])]
        tracked = axis_name and any(set(axis_name) <= varying_axes(x) for x in batch)
        self.axis_name = axis_name if tracked else None
        k = group.k
        self.micro = splitting._batch_size(args, options.batch_nums) // k
        # (B, ...) -> (B/K, K, ...): micro-batch i is column i (a strided split that
        # keeps a sharded leading axis leading, as in microbatch_value_and_grad).
        self.columns = {
            j: jax.tree.map(lambda x: x.reshape((self.micro, k, *x.shape[1:])), args[j])
            for j in options.batch_nums
        }

    def __call__(self, params: Any, i: jax.Array, carry: Any) -> tuple[Any, Any]:
        """(selected embeddings, new carry) of micro-batch `i`."""
        options = self.options
        args, kwargs = list(self.args), self.kwargs
        if self.group.k > 1:
            args, kwargs = splitting.fold_argument_keys(self.args, kwargs, i, options)
            for j, column in self.columns.items():
                args[j] = jax.tree.map(
                    lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False), column
                )
        args[0] = params
        if options.carry_nums:
            args = splitting._with_carry(args, carry, options)
        out = self.embed_fn(*args, **kwargs)
        new_carry = None
        if options.carry_nums:
            if not (isinstance(out, tuple | list) and len(out) == 2):
                raise TypeError(
                    f"with carry_argnums={splitting._carry_argnums(options)!r}, embed_fn "
                    f"must return (embeddings, new_carry); got {type(out).__name__}."
                )
            out, new_carry = out
        reps = self.group.select(out)
        if self.axis_name is not None:
            # Rows of a device's own examples, whatever embed_fn's types say (a leaf
            # built the same on every device, such as jnp.ones(n), is typed invariant):
            # their cotangents, sliced by device, are varying.
            reps = devices.varying_over(reps, self.axis_name)
        return reps, new_carry


def strong(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, jnp.result_type(x)), tree)


def embed_all(embedder: Embedder, params: Any, carry0: Any) -> tuple[Any, Any]:
    """Pass 1: every micro-batch's embeddings in batch order, and the final carry."""
    if embedder.group.k == 1:
        return embedder(params, jnp.int32(0), carry0)

    def body(carry: Any, i: jax.Array) -> Any:
        reps, new_carry = embedder(params, i, carry)
        return thread(new_carry, carry), reps

    carry, stacked = jax.lax.scan(body, carry0, jnp.arange(embedder.group.k, dtype=jnp.int32))
    return jax.tree.map(combining.interleave, stacked), carry


def thread(new_carry: Any, carry: Any) -> Any:
    if carry is None:
        return None
    return jax.tree.map(
        lambda n, c: combining.match_varying(n.astype(c.dtype), c), new_carry, carry
    )


def float_part(tree: Any) -> list[Any]:
    return [x for x in jax.tree_util.tree_leaves(tree) if is_float(x)]


def pull_back(
    embedder: Embedder,
    params: Any,
    cotangent: Any,
    carry0: Any,
    totals: Any,
    dtypes: Any,
    max_mask: Any,
) -> Any:
    """Pass 2: `totals` plus the parameter gradients of every micro-batch's embeddings.

    The leaves of `max_mask` (fp8 metadata, `_base/reduce_rules.py`) take the max instead.
    """
    k = embedder.group.k

    def grads_of(i: jax.Array, carry: Any, rows: list[Any]) -> tuple[Any, Any]:
        def embed(p: Any) -> tuple[list[Any], Any]:
            reps, new_carry = embedder(p, i, carry)
            return float_part(reps), new_carry

        _, vjp, new_carry = jax.vjp(embed, params, has_aux=True)
        (grads,) = vjp(rows)
        return grads, new_carry

    def add(totals: Any, grads: Any) -> Any:
        return jax.tree.map(
            lambda t, g, d, m: jnp.maximum(t, g.astype(d)) if m else t + g.astype(d),
            totals,
            grads,
            dtypes,
            max_mask,
        )

    if k == 1:
        grads, _ = grads_of(jnp.int32(0), carry0, cotangent)
        return add(totals, grads)
    columns = [c.reshape((embedder.micro, k, *c.shape[1:])) for c in cotangent]

    def body(state: Any, i: jax.Array) -> Any:
        carry, totals = state
        rows = [jax.lax.dynamic_index_in_dim(c, i, axis=1, keepdims=False) for c in columns]
        grads, new_carry = grads_of(i, carry, rows)
        return (thread(new_carry, carry), add(totals, grads)), None

    (_, totals), _ = jax.lax.scan(body, (carry0, totals), jnp.arange(k, dtype=jnp.int32))
    return totals
