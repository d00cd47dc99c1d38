"""Exact micro-batching for batch-coupled losses (contrastive, SigLIP, in-batch negatives).

How it reads: `coupled_value_and_grad` checks its options once; the function it
returns (`_coupled`) runs three steps in one program:

1. `embedding.embed_all`: a `jax.lax.scan` over the micro-batches of each group of towers
   embeds every micro-batch, with no differentiation, so no activations are kept;
2. `jax.value_and_grad` of the loss with respect to the params and all the
   embeddings, once, on the whole batch;
3. `embedding.pull_back`: a second scan re-embeds each micro-batch under `jax.vjp` against
   its rows of the embeddings' gradient and adds the parameter gradients to the
   loss's own.

Micro-batches, keys and carried state follow `microbatch_value_and_grad`, whose
helpers this module uses. Under `axis_name` (`_loss_and_cotangents`) each device
keeps its own rows of the cotangent, scaled for the reduction its caller applies.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import compat, equinox, reduce_rules, trees, validation
from gradaccum_jax._base.compat import varying_axes
from gradaccum_jax._batching import combining, devices, embedding, nnx_modules, planning, splitting
from gradaccum_jax._sharding import global_view

# --- options ------------------------------------------------------------------


def _check_counts(num_microbatches: Any, memory_budget: Any) -> int | str | dict[Any, int]:
    if isinstance(num_microbatches, Mapping):
        if memory_budget is not None:
            raise ValueError(
                "memory_budget plans one K for every tower; with a per-tower "
                f"num_microbatches={dict(num_microbatches)!r} drop memory_budget, or pass "
                "num_microbatches='auto'."
            )
        if not num_microbatches:
            raise ValueError(
                "num_microbatches={} names no tower; give a count per tower of embed_fn's "
                "output, e.g. {'image': 16, 'text': 4}, or one int for all."
            )
        return {
            tower: validation.check_int(f"num_microbatches[{tower!r}]", k, minimum=1)
            for tower, k in num_microbatches.items()
        }
    return splitting._check_num_microbatches(num_microbatches, memory_budget)


def _groups(counts: int | dict[Any, int], out_shape: Any) -> list[embedding.Group]:
    if isinstance(counts, int):
        return [embedding.Group(counts, None)]
    if not isinstance(out_shape, Mapping) or set(out_shape) != set(counts):
        towers = sorted(out_shape, key=str) if isinstance(out_shape, Mapping) else None
        raise ValueError(
            "a per-tower num_microbatches needs embed_fn to return a dict with one entry per "
            f"tower and a count for each; got counts for {sorted(counts, key=str)} and an "
            f"output with {'keys ' + str(towers) if towers is not None else 'no dict at its top'}"
            ". Name every tower in num_microbatches, or pass one int for all."
        )
    by_k: dict[int, list[Any]] = {}
    for tower in out_shape:
        by_k.setdefault(counts[tower], []).append(tower)
    return [embedding.Group(k, tuple(towers)) for k, towers in by_k.items()]


# --- the coupled function -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
    loss_fn: Callable[..., Any]
    embed_fn: Callable[..., Any]
    options: splitting._Options
    axis_name: tuple[Any, ...] | None
    gather: bool  # under axis_name: loss_fn sees the gathered batch (else its own rows)
    summed: bool  # under axis_name: the devices' gradients will be summed (else averaged)


_PADDING = (
    "leave the padded rows out of the loss: pass mask= (False on padding) to the losses of "
    "gradaccum_jax.losses, which then neither query nor score against them, or mask them "
    "in your own loss_fn"
)


def _check_batch(
    args: tuple[Any, ...], kwargs: dict[str, Any], counts: int | dict[Any, int], options: Any
) -> int:
    splitting._check_call(args, kwargs, options)
    batch_size = splitting._batch_size(args, options.batch_nums)
    for k in {counts} if isinstance(counts, int) else set(counts.values()):
        splitting._check_divisible(batch_size, k, padding=_PADDING)
        splitting._check_shards(args, options.batch_nums, batch_size // k)
    return batch_size


def _embedders(
    spec: _Spec,
    counts: int | dict[Any, int],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    params: Any,
    carry0: Any,
) -> tuple[list[embedding.Embedder], Any, Any]:
    """One `embedding.Embedder` per group of towers, the output's structure, and the typed carry."""
    options = spec.options
    probe = embedding.Embedder(
        spec.embed_fn, embedding.Group(1, None), args, kwargs, options, spec.axis_name
    )
    whole_shape = jax.eval_shape(lambda p, c: probe(p, jnp.int32(0), c)[0], params, carry0)
    groups = _groups(counts, whole_shape)
    if options.carry_nums and len(groups) > 1:
        raise ValueError(
            f"carry_argnums={splitting._carry_argnums(options)!r} with a per-tower "
            f"num_microbatches={counts!r}: each tower's pass would move the carried "
            "statistics of every tower. Use one num_microbatches for all towers with "
            "carried state, or keep the statistics out of the carry."
        )
    embedders = [
        embedding.Embedder(spec.embed_fn, g, args, kwargs, options, spec.axis_name) for g in groups
    ]
    for e in embedders:
        shape = jax.eval_shape(lambda p, c, e=e: e(p, jnp.int32(0), c), params, carry0)
        embedding.check_embeddings(shape[0], e.micro, e.group.k)
        if options.carry_nums:
            splitting._check_carry(shape[1], carry0, splitting._carry_argnums(options))
            carry0 = jax.tree.map(combining.match_varying, carry0, shape[1])
    return embedders, whole_shape, carry0


def _loss_and_cotangents(
    spec: _Spec,
    embedders: list[embedding.Embedder],
    whole_shape: Any,
    params: tuple[Any, Any],
    local: list[Any],
) -> tuple[Any, Any, list[list[jax.Array]]]:
    """The loss's output, its parameter gradient, and each group's embedding cotangents.

    `params` are the caller's and their varying cast: inside `jax.shard_map`, the
    gathered batch's loss is computed from the caller's params and embeddings
    gathered invariant, so that it is typed like what it is, the same value on
    every device; else from the varying params (a loss of this device's rows, or
    under `jax.pmap`), whose gradient no collective reduces.
    """
    axis_name = spec.axis_name
    seen = local  # one device, or a loss sharded over axis_name itself
    given, varying = params
    if axis_name is not None and spec.gather:
        invariant = compat.GATHERS_INVARIANT and all(
            set(axis_name) <= varying_axes(x) for x in jax.tree_util.tree_leaves(local)
        )
        if invariant:
            seen = compat.all_gather_invariant(local, axis_name)
        else:
            seen = jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name, tiled=True), local)
        params = given if invariant else varying
    else:
        params = varying

    def loss_of(p: Any, floats: list[list[Any]]) -> Any:
        parts = [_with_floats(g, f) for g, f in zip(seen, floats, strict=True)]
        towers = embedders[0].group.towers is None
        return spec.loss_fn(p, parts[0] if towers else _merge(parts, whole_shape))

    floats = [embedding.float_part(g) for g in seen]
    out, (loss_grads, cotangents) = jax.value_and_grad(
        loss_of, argnums=(0, 1), has_aux=spec.options.has_aux
    )(params, floats)
    if axis_name is not None:
        # Scale each device's share so that combining the devices (their mean, or their
        # sum with grad_reduction="sum") counts every row and the loss's own gradient once.
        n = devices.axis_size(axis_name)
        if spec.summed:
            loss_grads = jax.tree.map(lambda g: g / n, loss_grads)
        scale = (n if spec.gather else 1) / (n if spec.summed else 1)
        rows = embedders[0].micro * embedders[0].group.k
        # With the loss computed on every device, each holds the whole cotangent:
        # keep this device's rows.
        start = devices.axis_index(axis_name) * rows
        cotangents = [
            [
                (jax.lax.dynamic_slice_in_dim(c, start, rows, axis=0) if spec.gather else c) * scale
                for c in group
            ]
            for group in cotangents
        ]
    return out, loss_grads, cotangents


def _prepare(
    spec: _Spec, counts: int | dict[Any, int], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """Checks a call; under `axis_name`, folds this device's position into the keys
    (a key passed the same to every device would draw the same masks on all of them)
    and types the params varying (the gradient of replicated params would be summed
    over the devices in the backward pass: each device's own share is wanted here).
    Returns the arguments and the params to differentiate."""
    _check_batch(args, kwargs, counts, spec.options)
    if spec.axis_name is None:
        return args, kwargs, args[0]
    here = devices.axis_index(spec.axis_name)
    folded, kwargs = splitting.fold_argument_keys(args, kwargs, here, spec.options)
    return tuple(folded), kwargs, devices.varying_over(args[0], spec.axis_name)


def _first_pass(
    spec: _Spec,
    counts: int | dict[Any, int],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    params: Any,
) -> tuple[list[embedding.Embedder], Any, Any, list[Any], Any]:
    """Pass 1, with no differentiation (no activations kept): the embedders, the
    output's structure, the typed carry, each group's embeddings and the final carry."""
    options = spec.options
    carry0 = embedding.strong(splitting._carried(args, options)) if options.carry_nums else None
    embedders, whole_shape, carry0 = _embedders(spec, counts, args, kwargs, params, carry0)
    local, final_carry = [], None
    for e in embedders:
        reps, final_carry = embedding.embed_all(e, params, carry0)
        local.append(jax.tree.map(jax.lax.stop_gradient, reps))
    return embedders, whole_shape, carry0, local, final_carry


def _dtypes(loss_grads: Any, options: splitting._Options) -> Any:
    return jax.tree.map(lambda g: trees.accumulator_dtype(g, options.accumulator_dtype), loss_grads)


def _result(out: Any, grads: Any, final_carry: Any, options: splitting._Options) -> Any:
    value, aux = out if options.has_aux else (out, None)
    if options.carry_nums:
        return (value, (final_carry, aux)), grads
    return (value, aux) if options.has_aux else value, grads


def _coupled(spec: _Spec, counts: int | dict[Any, int]) -> Callable[..., Any]:
    options = spec.options

    def value_and_grad(*args: Any, **kwargs: Any) -> Any:
        given = args[0]
        args, kwargs, params = _prepare(spec, counts, args, kwargs)
        embedders, whole_shape, carry0, local, final_carry = _first_pass(
            spec, counts, args, kwargs, params
        )
        out, loss_grads, cotangents = _loss_and_cotangents(
            spec, embedders, whole_shape, (given, params), local
        )
        # Pass 2, from the loss's own parameter gradient (loss-only params counted once).
        # It replays pass 1's carry so every micro-batch is embedded as it was then;
        # the carry returned is pass 1's, so statistics are counted once.
        dtypes = _dtypes(loss_grads, options)
        # Typed like the params of pass 2 (varying over axis_name), whose gradients it sums.
        totals = jax.tree.map(
            lambda g, d, p: combining.match_varying(g.astype(d), p), loss_grads, dtypes, params
        )
        max_mask = _max_mask(spec, loss_grads)
        for e, cotangent in zip(embedders, cotangents, strict=True):
            totals = embedding.pull_back(e, params, cotangent, carry0, totals, dtypes, max_mask)
        grads = jax.tree.map(lambda t, g: t.astype(jnp.result_type(g)), totals, loss_grads)
        return _result(out, grads, final_carry, options)

    return value_and_grad


def _max_mask(spec: _Spec, loss_grads: Any) -> Any:
    """The gradient leaves that take the max over micro-batches (fp8 metadata).

    The embeddings' cotangents are the whole batch's, so every micro-batch's
    backward has the large batch's scale already. The loss's own gradient of
    such a leaf (zero where `loss_fn` does not use that layer) is part of the
    max, which is harmless for amax values and scales (never negative).
    """
    mask = reduce_rules.max_mask(loss_grads, spec.options.max_leaves)
    if spec.axis_name is not None and reduce_rules.any_max(mask):
        shown = ", ".join(reduce_rules.max_paths(mask)[:2])
        raise ValueError(
            f"coupled_value_and_grad got gradient leaves combined by max ({shown}, ...: fp8 "
            f"metadata) with axis_name={spec.axis_name!r}; each device's cotangents are "
            "scaled for combining the devices' gradients, which would scale the "
            "output-gradient amax as well. Call it without axis_name (global-view jit), or "
            "pass max_leaves=None and combine the metadata yourself."
        )
    return mask


def _on_devices(
    spec: _Spec, counts: int | dict[Any, int], axes: tuple[Any, ...], *args: Any, **kwargs: Any
) -> Any:
    """Global-view `jax.jit` with the batch split over the mesh `axes` (no carry).

    Left to XLA's partitioner, pass 2 would reduce every micro-batch's parameter
    gradient. Here both passes run on each device under `jax.shard_map`, over its
    own shard (keys folded per device, as under `axis_name`); the loss between
    them is the caller's global-view code on the whole batch, partitioned by XLA
    as it would be without micro-batching; and each device's pass-2 sum is
    reduced once, after its micro-batches.
    """
    local_spec, options, seen = dataclasses.replace(spec, axis_name=axes), spec.options, []
    n, batch = len(args), options.batch_nums

    def embed_here(*local: Any) -> Any:
        *positional, local_kwargs = local  # keyword arguments go whole, replicated
        call = _prepare(local_spec, counts, tuple(positional), local_kwargs)
        embedders, whole_shape, _, reps, _ = _first_pass(local_spec, counts, *call)
        seen.append((embedders, whole_shape))  # the towers' layout, read when tracing
        return reps

    local = global_view.on_each_device(embed_here, axes, (*args, kwargs), batch, split_out=True)
    out, loss_grads, cotangents = _loss_and_cotangents(spec, *seen[0], (args[0],) * 2, local)
    dtypes = _dtypes(loss_grads, options)
    # fp8 metadata: the cotangents are the whole batch's, so each device's max is the
    # large batch's over its rows, and the devices' max is the large batch's.
    max_mask = _max_mask(spec, loss_grads)

    def pull_back_here(*local: Any) -> Any:
        *positional, local_kwargs, rows = local
        call = _prepare(local_spec, counts, tuple(positional), local_kwargs)
        embedders, params = _embedders(local_spec, counts, *call, None)[0], call[2]
        totals = jax.tree.map(
            lambda p, d: devices.varying_over(jnp.zeros(jnp.shape(p), d), axes), params, dtypes
        )
        for e, cotangent in zip(embedders, rows, strict=True):
            totals = embedding.pull_back(e, params, cotangent, None, totals, dtypes, max_mask)
        return jax.tree.map(
            lambda t, m: jax.lax.pmax(t, axes) if m else jax.lax.psum(t, axes), totals, max_mask
        )

    sums = global_view.on_each_device(
        pull_back_here, axes, (*args, kwargs, cotangents), (*batch, n + 1), split_out=False
    )
    grads = jax.tree.map(
        lambda g, t, d, m: (jnp.maximum(g.astype(d), t) if m else g.astype(d) + t).astype(
            jnp.result_type(g)
        ),
        loss_grads,
        sums,
        dtypes,
        max_mask,
    )
    return _result(out, grads, None, options)


def _with_floats(template: Any, floats: list[Any]) -> Any:
    it = iter(floats)
    return jax.tree.map(lambda x: next(it) if embedding.is_float(x) else x, template)


def _merge(parts: list[dict[Any, Any]], whole_shape: Any) -> dict[Any, Any]:
    merged = {t: v for part in parts for t, v in part.items()}
    return {t: merged[t] for t in whole_shape}


def coupled_value_and_grad(
    loss_fn: Callable[..., Any],
    embed_fn: Callable[..., Any],
    num_microbatches: int | str | Mapping[Any, int],
    *,
    has_aux: bool = False,
    batch_argnums: int | Sequence[int] = 1,
    key_argnums: int | Sequence[int] = (),
    carry_argnums: int | Sequence[int] = (),
    accumulator_dtype: Any = None,
    axis_name: Any = None,
    gather_embeddings: bool = True,
    grad_reduction: str = "mean",
    memory_budget: float | None = None,
    max_leaves: Any = "auto",
) -> CoupledValueAndGrad:
    r"""Returns the value and gradient of a batch-coupled loss, computed in micro-batches.

    For a loss in which every example's term depends on the other examples'
    embeddings (CLIP, InfoNCE, SigLIP, retrieval with in-batch negatives) a mean
    of per-micro-batch losses is a different objective: each micro-batch sees
    `B/K` negatives instead of `B`. This function computes the large batch's
    loss and gradient exactly, holding the activations of one micro-batch at a
    time, by caching the embeddings (Gao et al., 2021). The returned
    `f(params, batch, *args)` equals

        jax.value_and_grad(lambda p, b, *a: loss_fn(p, embed_fn(p, b, *a)))(params, batch, *args)

    up to summation order, and runs as one program:

    1. embed every micro-batch with `embed_fn`, in a `jax.lax.scan`, without
       differentiating (no activations kept);
    2. take `jax.value_and_grad` of `loss_fn` with respect to the params and
       all $N$ embeddings $Z$ at once: $\partial L / \partial Z$;
    3. embed each micro-batch again under `jax.vjp` against its rows of
       $\partial L / \partial Z$ and add its parameter gradient to the loss's
       own (so parameters used only by the loss, such as a logit scale, are
       counted once):

    $$
      \nabla_\theta L = \frac{\partial L}{\partial \theta}\Big|_Z
        + \sum_{i=1}^K \Big(\frac{\partial Z_i}{\partial \theta}\Big)^{\!\top}
          \frac{\partial L}{\partial Z_i}.
    $$

    Cost: one extra forward pass of the encoders. Memory: one micro-batch's
    activations, the $N$ embeddings and their gradient, and whatever `loss_fn`
    itself needs on $N$ rows (a dense CLIP loss holds several $N \times N$
    matrices; `gradaccum_jax.losses` computes them in tiles).

    `embed_fn` must be *example-separable*: row `i` of every output leaf
    depends on example `i` only. This cannot be checked in general: an
    encoder that mixes examples (BatchNorm normalising with batch statistics,
    attention across the batch) gives gradients of a different function,
    silently. Only the shapes are checked: every leaf needs the batch axis
    first. Micro-batches follow `microbatch_value_and_grad`: micro-batch `i`
    holds examples `i, i + K, …` of every batch argument, and typed PRNG keys
    (and raw keys at `key_argnums`) reach it as `jax.random.fold_in(key, i)`,
    in both passes, so the second pass sees the same dropout masks as the
    first. A raw `uint32` key outside `key_argnums` is refused. Under
    `axis_name` each device first folds its position along the axis into
    every key (`jax.random.fold_in(key, d)`, `d` counting row-major over a
    tuple of names), so a key passed the same to every device draws each
    device's own masks; the large batch of reference is then defined per
    device: device `d` embeds its shard as one device would with
    `fold_in(key, d)`.

    A `flax.nnx` module in the params' place is taken as `nnx.value_and_grad`
    takes it (as in `microbatch_value_and_grad`): `loss_fn(model, embeddings)`
    and `embed_fn(model, batch, ...)` receive the module, its `nnx.Param`
    state is differentiated (the gradient is an `nnx.State`), and its other
    state (dropout streams' counters, BatchNorm statistics) is carried
    through the micro-batches, replayed by the second pass, and written back
    into the module from the first. Not with `carry_argnums`.

    Args:
      loss_fn: `loss_fn(params, embeddings)` returning a scalar (or
        `(loss, aux)` with `has_aux`), where `embeddings` is `embed_fn`'s
        output for the whole batch, in batch order.
      embed_fn: `embed_fn(params, batch, *args, **kwargs)` returning a pytree
        whose leaves all have the batch axis first, e.g.
        `{"image": (B, D), "text": (B, D)}`. Non-floating leaves (labels,
        ids) are passed to `loss_fn` and not differentiated. With
        `carry_argnums` it returns `(embeddings, new_carry)`.
      num_microbatches: `K`, an int that divides the batch size; `"auto"` to
        let `gradaccum_jax.plan_microbatches`' search pick the smallest `K`
        whose compiled program (this function's, both passes) fits
        `memory_budget`; or a dict with one count per top-level entry
        (tower) of `embed_fn`'s output, e.g. `{"image": 16, "text": 4}`, for
        towers of different cost. Towers with the same count are embedded
        together; each count's pass calls `embed_fn` and keeps its own towers
        (under `jax.jit` XLA removes the other towers' work). With `"auto"`
        and `axis_name` the plan is made per device, from inside the mapped
        function, on the device's shard; `f.plan(params, batch, ...)`, called
        where `f` is, returns the `gradaccum_jax.MicrobatchPlan` (its
        `num_microbatches` is the `K` chosen, which also sets the dropout
        masks).
      has_aux: `loss_fn` returns `(loss, aux)`; the result is then
        `((loss, aux), grads)`.
      batch_argnums: Position(s) of the batch arguments of `f` (and
        `embed_fn`); the params are at position 0.
      key_argnums: Position(s) of PRNG key arguments, typed or raw, folded
        with the micro-batch index as above.
      carry_argnums: Position(s) of state threaded through the micro-batches
        in order, such as Flax `batch_stats` of a BatchNorm in an encoder.
        `embed_fn` returns `(embeddings, new_carry)`. The second pass replays
        the carry of the first, so each micro-batch is embedded the same way
        twice, and the carry returned is the first pass's: statistics are
        counted once. The result is `((loss, (new_carry, aux)), grads)`,
        `aux` being `None` without `has_aux`. Only with one count for all
        towers. With `gradaccum_jax.flax.AccumBatchNorm` the statistics are
        the large batch's.
      accumulator_dtype: dtype in which parameter gradients are summed, as
        in `microbatch_value_and_grad`.
      axis_name: For use inside `jax.shard_map` or `jax.pmap` with the batch
        split over this mapped axis (a name or a tuple of names): each device
        embeds its own shard, the embeddings are gathered (`all_gather`, an
        $N \times D$ transfer), every device evaluates the loss on the global
        batch, and each device pulls back its own rows. The gradients
        returned on each device are its share, scaled so that their mean over
        the axis (what `jax.lax.pmean` and `accumulate(axis_name=...)` take)
        is the global batch's gradient; the loss returned is the global
        batch's on every device, and (from JAX 0.10, where
        `jax.lax.all_gather(..., to="invarying")` exists) typed invariant
        over the axis, so `out_specs=P()` takes it as it is (on older JAX,
        `jax.lax.pmean` it first). With `gather_embeddings=False` each
        device's value is a share: `jax.lax.pmean` it. Params are taken as
        varying over the axis, so no collective runs on gradients inside this
        function. Under global-view `jax.jit` on a mesh, without
        `axis_name`, with replicated params and the batch split over one
        mesh axis (named in its Explicit sharding, or the only axis of
        several devices of an Auto mesh), both passes run this way by
        themselves, on each device's shard (keys folded per device as
        above), and the loss between them is `loss_fn` on the whole batch
        as XLA partitions it: each device sums its micro-batches' gradients
        and one all-reduce after them combines the devices, so the step has
        the collectives of `jax.value_and_grad` on the whole batch. Otherwise
        (carried state, sharded params) XLA's partitioner places all the
        work and reduces every micro-batch's parameter gradient in pass 2.
      gather_embeddings: Only with `axis_name`. `True` (default): `loss_fn`
        gets the whole batch's embeddings, gathered, and every device holds
        the loss's temporaries for all $N$ rows. `False`: `loss_fn` gets this
        device's rows and is itself sharded, following the same convention:
        its value on each device is a share whose mean over the axis is the
        global loss, e.g. `gradaccum_jax.losses.clip_loss(a, b, scale,
        axis_name=...)`, which gathers the columns itself and holds no
        $N \times N$ matrix on any device.
      grad_reduction: Only with `axis_name`: how the caller combines the
        devices' gradients. `"mean"` (default): their mean over the axis is
        the global gradient (`jax.lax.pmean`, `accumulate(axis_name=...)`).
        `"sum"`: their sum is (`jax.lax.psum`, or `jax.shard_map`'s
        `out_specs=P(unreduced={axis})` for `accumulate`'s unreduced route
        under global-view `jax.jit`). The value is the same either way.
      memory_budget: Bytes, only with `num_microbatches="auto"`.
      max_leaves: The gradient leaves combined by their max over micro-batches
        rather than summed: `"auto"` (default) takes Flax's fp8 metadata (the
        scales and amax histories of `flax.linen.fp8_ops` layers, whose
        "gradient" is their new value), `None` none, or a callable
        `(path, leaf) -> bool`, as in `microbatch_value_and_grad`. Each
        micro-batch's backward runs against its rows of the whole batch's
        cotangent, so the metadata equal the whole batch's. Not with
        `axis_name`.

    Returns:
      A function `f(params, batch, *args, **kwargs)` returning
      `(loss, grads)`, or `((loss, aux), grads)` with `has_aux`; with
      `num_microbatches="auto"`, `f.plan(params, batch, *args, **kwargs)`
      returns the plan a call makes.

    Raises:
      TypeError: For non-callable functions, a bad `num_microbatches`, or
        (when called) a raw `uint32` key outside `key_argnums`.
      ValueError: For overlapping argnums, `gather_embeddings=False` or
        `grad_reduction="sum"` without `axis_name`, or (when called) a batch
        size that a count does not divide (pad it and leave the padding out
        with the losses' `mask=`), an embedding leaf without the batch
        axis, a per-tower count that does not match `embed_fn`'s towers,
        `carry_argnums` with per-tower counts, or a `memory_budget` that no
        count fits.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> def embed(params, batch):
      ...     return {"a": jnp.tanh(batch["x"] @ params["wa"]),
      ...             "b": jnp.tanh(batch["y"] @ params["wb"])}
      >>> def clip(params, reps):
      ...     logits = params["scale"] * reps["a"] @ reps["b"].T
      ...     labels = jnp.arange(logits.shape[0])
      ...     row = jax.nn.log_softmax(logits, axis=1)[labels, labels]
      ...     col = jax.nn.log_softmax(logits, axis=0)[labels, labels]
      ...     return -(row.mean() + col.mean()) / 2
      >>> keys = jax.random.split(jax.random.key(0), 4)
      >>> params = {"wa": jax.random.normal(keys[0], (5, 3)),
      ...           "wb": jax.random.normal(keys[1], (4, 3)), "scale": jnp.float32(2.0)}
      >>> batch = {"x": jax.random.normal(keys[2], (16, 5)),
      ...          "y": jax.random.normal(keys[3], (16, 4))}
      >>> f = jax.jit(ga.coupled_value_and_grad(clip, embed, 4))
      >>> value, grads = f(params, batch)
      >>> ref_value, ref_grads = jax.value_and_grad(
      ...     lambda p, b: clip(p, embed(p, b)))(params, batch)
      >>> bool(jnp.allclose(value, ref_value)), bool(jnp.allclose(grads["wa"], ref_grads["wa"]))
      (True, True)

    References:
      Gao, Zhang, Han and Callan, *Scaling Deep Contrastive Learning Batch
      Size under Memory Limited Setup*, 2021, https://arxiv.org/abs/2101.06983
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable; got {loss_fn!r}.")
    # The carry comes from embed_fn, apart from the loss's aux: has_aux is the loss's.
    options = splitting._check_options(
        embed_fn,
        has_aux=has_aux or bool(carry_argnums),
        argnums=0,
        batch_argnums=batch_argnums,
        weight_fn=None,
        sum_and_weight=False,
        aux_reduction="auto",
        key_argnums=key_argnums,
        carry_argnums=carry_argnums,
        accumulator_dtype=accumulator_dtype,
        max_leaves=max_leaves,
    )
    options = options._replace(has_aux=has_aux)
    names = None if axis_name is None else validation.check_axis_name("axis_name", axis_name)
    if not isinstance(gather_embeddings, bool):
        raise TypeError(f"gather_embeddings must be True or False; got {gather_embeddings=!r}.")
    if names is None and not gather_embeddings:
        raise ValueError(
            "gather_embeddings=False is for a loss sharded over axis_name; without "
            "axis_name there is nothing to gather. Drop gather_embeddings, or pass axis_name."
        )
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction must be 'mean' or 'sum'; got {grad_reduction=!r}.")
    if names is None and grad_reduction != "mean":
        raise ValueError(
            f"grad_reduction={grad_reduction!r} says how the devices' gradients along "
            "axis_name are combined; without axis_name the gradient is the whole batch's. "
            "Drop grad_reduction, or pass axis_name."
        )
    spec = _Spec(loss_fn, embed_fn, options, names, gather_embeddings, grad_reduction == "sum")
    return CoupledValueAndGrad(spec, _check_counts(num_microbatches, memory_budget), memory_budget)


class CoupledValueAndGrad:
    """The function `coupled_value_and_grad` returns: `f(params, batch, *args, **kwargs)`.

    Called, it returns `(loss, grads)` (see `coupled_value_and_grad`). With
    `num_microbatches="auto"`, `f.plan(params, batch, *args, **kwargs)` returns
    the `gradaccum_jax.MicrobatchPlan` that a call with those arguments follows
    (called where `f` would be: under `axis_name`, inside the mapped function).
    """

    def __init__(self, spec: _Spec, counts: int | str | dict[Any, int], memory_budget: Any):
        self._spec, self._counts, self._memory_budget = spec, counts, memory_budget

    def _pure(self, args: tuple[Any, ...]) -> tuple[_Spec, tuple[Any, ...], Callable[..., Any]]:
        """The spec and arguments of a call on plain pytrees, and how to finish its result.

        A `flax.nnx` module in the params' place is split into its `nnx.Param`
        state, differentiated, and the rest, carried through the micro-batches.
        """
        spec = self._spec
        equinox.refuse_modules(args, spec.options.grad_nums, "coupled_value_and_grad")
        if not nnx_modules.module_positions(args, spec.options):
            return spec, args, lambda out: out
        axis_name = spec.axis_name

        def device_keys(rest: Any) -> Any:
            if axis_name is None:
                return rest
            return splitting._fold_keys(rest, devices.axis_index(axis_name), typed_only=True)

        pure = nnx_modules.split_for_coupled(
            spec.loss_fn, spec.embed_fn, spec.options, args, device_keys
        )
        pure_spec = dataclasses.replace(
            spec, loss_fn=pure.loss_fn, embed_fn=pure.embed_fn, options=pure.options
        )
        return pure_spec, pure.args, pure.finish

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with global_view.batch_mesh((args, kwargs)):
            return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        spec, args, finish = self._pure(args)
        _refuse_fp8_on_old_meshes(spec, args[0])
        axes = None if spec.axis_name else devices.batch_axes(args, spec.options, self._counts)
        counts = self._counts
        if isinstance(counts, str):
            counts = self._plan(spec, axes, args, kwargs).num_microbatches
        return finish(_program(spec, axes, counts)(*args, **kwargs))

    def plan(self, *args: Any, **kwargs: Any) -> planning.MicrobatchPlan:
        """The plan of `num_microbatches="auto"` for a call with these arguments.

        Its `num_microbatches` is the `K` the call uses, which also decides the
        dropout masks (micro-batch `i` folds its index into the keys).

        Raises:
          ValueError: If `num_microbatches` was given as a count.
        """
        if not isinstance(self._counts, str):
            raise ValueError(
                f"plan() reports the K that num_microbatches='auto' chooses; this function "
                f"was built with num_microbatches={self._counts!r}."
            )
        with global_view.batch_mesh((args, kwargs)):
            spec, args, _ = self._pure(args)
            axes = None if spec.axis_name else devices.batch_axes(args, spec.options, "auto")
            return self._plan(spec, axes, args, kwargs)

    def _plan(
        self, spec: _Spec, axes: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> planning.MicrobatchPlan:
        # The program a call runs: under axis_name planned per device (on its shard),
        # on the per-device route as a whole, with K splitting every device's shard.
        return planning.plan_batch(
            functools.partial(_program, spec, axes),
            args,
            kwargs,
            spec.options,
            memory_budget=self._memory_budget,
            cache_key=("coupled", spec, axes),
            shards=devices.devices(axes),
            axis_name=spec.axis_name,
        )


def _refuse_fp8_on_old_meshes(spec: _Spec, params: Any) -> None:
    """Raises for Flax fp8 layers under a mesh context on a JAX release measured wrong there."""
    if compat.FP8_COUPLED_ON_MESHES or jax.sharding.get_abstract_mesh().empty:
        return
    fp8 = reduce_rules.max_paths(reduce_rules.max_mask(params))
    if spec.axis_name is not None and reduce_rules.any_max(
        reduce_rules.max_mask(params, spec.options.max_leaves)
    ):
        return  # refused where the max leaves meet axis_name, with that fix (_max_mask)
    if fp8:
        raise ValueError(
            f"coupled_value_and_grad got Flax fp8 layers ({fp8[0]}, ...) under a mesh "
            f"context with JAX {jax.__version__}: measured with JAX 0.8.1, their parameter "
            "gradients there are wrong (JAX 0.10.2 gives the large batch's). Upgrade to "
            "jax>=0.10, or call it outside the mesh context (jax.set_mesh)."
        )


def _program(spec: _Spec, axes: Any, counts: int | dict[Any, int]) -> Callable[..., Any]:
    """The coupled value and gradient with `counts` micro-batches, on its route."""
    if axes is None:
        return _coupled(spec, counts)
    return functools.partial(_on_devices, spec, counts, axes)
