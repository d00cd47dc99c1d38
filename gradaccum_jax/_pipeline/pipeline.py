"""`pipeline_value_and_grad`: pipeline stages and micro-batching in one schedule.

How it reads: `pipeline_value_and_grad` checks its options once and returns
`grad_fn(params, batch, key=None)`. A call splits the batch into `N` strided
micro-batches (`_split`), binds keys and options into an `executor.Model`, and runs
`executor.run` on each device: directly when the stage axis is bound (the user's
`jax.shard_map`), else under a `jax.shard_map` of its own over the mesh of the context
or of the arguments' types (`_global_view`). `_finish` normalises once and reduces
over the data axes once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import collectives, compat
from gradaccum_jax._pipeline import executor, sharded
from gradaccum_jax._pipeline.schedules import SCHEDULES, pipeline_schedule
from gradaccum_jax._sharding import global_view

_P = jax.sharding.PartitionSpec

# What micro-batched options this door does not take yet, and what to use instead.
_REFUSED = {
    "carry_argnums": (
        "state carried through a stage (BatchNorm statistics, a Flax mutable collection) is "
        "not pipelined yet: normalise per example in the stages (LayerNorm, RMSNorm), or "
        "run the model unstaged with ga.microbatch_value_and_grad(..., carry_argnums=...)"
    ),
    "statistics_fn": (
        "global-batch statistics (statistics_fn) are not pipelined yet: run the model "
        "unstaged with ga.microbatch_value_and_grad(..., statistics_fn=...)"
    ),
    "coupled": (
        "a loss that couples micro-batches (contrastive) cannot be split into pipeline "
        "micro-batches yet: use ga.coupled_value_and_grad on the unstaged model"
    ),
    "weight_fn": (
        "pass the weights as the loss's second output instead: sum_and_weight=True, "
        "loss_fn returning (weighted_loss_sum, weight_sum)"
    ),
    "argnums": "the params are always the first argument: grad_fn(params, batch, key=None)",
    "batch_argnums": "the batch is always the second argument: grad_fn(params, batch, key=None)",
}


def pipeline_value_and_grad(
    stage_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    *,
    num_microbatches: int,
    embed_fn: Callable[..., Any] | None = None,
    schedule: str = "1f1b",
    num_chunks: int = 1,
    stage_axis: Any = "stage",
    axis_name: Any = None,
    stages_key: str = "stages",
    has_aux: bool = False,
    sum_and_weight: bool = False,
    remat: Any = False,
    **unsupported: Any,
) -> Callable[..., Any]:
    r"""Returns the whole batch's loss and gradients of a model split into pipeline stages.

    The model is `embed_fn` (on the first stage), then `S * v` applications of
    `stage_fn`, virtual stage `c` with its own slice of the stacked stage params, then
    `loss_fn` (on the last stage). Stage `s` of the `S` devices along `stage_axis`
    holds virtual stages `s, s + S, ..., s + (v-1) S` (`v = num_chunks`). The batch is
    cut into `N = num_microbatches` micro-batches that all flow through **one**
    schedule: one fill and one drain per call, whatever `N`. That is gradient
    accumulation and pipelining in one loop; nesting `K` accumulation steps around a
    pipeline of `M` micro-batches pays the fill and drain `K` times:

    $$
    \text{bubble} = \frac{S-1}{vN+S-1}\quad\text{against}\quad \frac{S-1}{M+S-1},
    \qquad N = KM.
    $$

    The result equals `jax.value_and_grad` of the unstaged model on the whole batch
    (`grad_fn.sequential`, below), to float rounding: the loss is normalised once,
    by `N` micro-batch means or by the whole batch's weight with
    `sum_and_weight`, never per micro-batch or per stage. Every backward recomputes
    its stage from the stage input kept since its forward (`jax.vjp`), and each
    micro-batch's weight gradient is added into one sum per leaf. Parameters used by
    both `embed_fn` and `loss_fn` (a tied embedding) get the sum of both uses.

    Schedules (`ga.pipeline_schedule` gives each one's table, bubble and stash):
    `"gpipe"` (every forward, then every backward; stage inputs kept grow with `N`),
    `"1f1b"` (at most `S - s + 1` stage inputs on stage `s`, flat in `N`),
    `"interleaved"` (1F1B over `v` chunks per device, the bubble divided by about
    `v`) and `"circular"` (GPipe over `v` chunks, MaxText's circular pipeline).

    Where it runs:

    * Inside the user's `jax.shard_map` over a mesh with `stage_axis` (the stage
      params split over it, `P("stage")`); with `axis_name` the data axes, the
      gradients are summed over them once, after the schedule's loop.
      `axis_name=None` leaves each data shard's own result, for
      `ga.accumulate(..., axis_name=...)` to reduce once per window.
    * Under global-view `jax.jit` on a mesh with `stage_axis`, set with
      `jax.set_mesh` or read from the arguments' shardings (an Explicit mesh): the
      call runs as its own `jax.shard_map`, the batch split over the other mesh axes
      (or `axis_name`), one reduction over them after the loop. The gradients come
      back with the stage params split over `stage_axis`.

    Keys: with `key`, micro-batch `m` draws from `k_m = jax.random.fold_in(key, m)`
    (as `microbatch_value_and_grad` folds it), and virtual stage `c` receives
    `fold_in(k_m, c)`, `embed_fn` `fold_in(k_m, S v)` and `loss_fn`
    `fold_in(k_m, S v + 1)`, so the dropout masks equal those of
    `microbatch_value_and_grad(grad_fn.sequential, N)` given the same key. With a
    data axis the key is first folded with the data shard's index.

    Args:
      stage_fn: `stage_fn(stage_params, x)` (`stage_fn(stage_params, x, key)` when
        called with a key): one virtual stage's layers, returning an activation
        shaped like `x` (an array or a pytree of arrays).
      loss_fn: `loss_fn(outer, y, micro_batch)` (with `key` last when called with
        one): the head and the loss on one micro-batch, returning the mean loss, or
        `(loss_sum, weight_sum)` with `sum_and_weight`, with `aux` as
        `(loss, aux)` under `has_aux`. `outer` is `params` without `stages_key`.
      num_microbatches: `N >= 1`; the batch's leading axis (per data shard) must be
        a multiple of it. Micro-batch `m` holds examples `m, m + N, ...`.
      embed_fn: `embed_fn(outer, micro_batch)` (with `key` last when called with
        one), the first stage's input. `None`: the micro-batch itself, or its
        first element when the batch is a tuple or list, or `batch["x"]` for a
        mapping with an `"x"` entry.
      schedule: `"gpipe"`, `"1f1b"` (default), `"interleaved"` or `"circular"`.
      num_chunks: `v`, chunks per device for `"interleaved"` and `"circular"`.
      stage_axis: The mesh axis the stages are laid along.
      axis_name: Data axes to reduce over once per call (inside `jax.shard_map`),
        or the axes the batch is split over (global view; default: every other
        axis of the mesh).
      stages_key: The key of `params` that holds the stacked stage params: leaves
        of shape `(S, ...)`, or `(S, v, ...)` with `num_chunks = v > 1`, where
        `[s, j]` is virtual stage `j S + s` (`ga.stack_stages` lays out a stack of
        layers so).
      has_aux: `loss_fn` returns `(loss, aux)`. A leaf whose leading axis is the
        micro-batch size comes back per example in batch order; any other is the
        mean over micro-batches, weighted like the loss.
      sum_and_weight: `loss_fn` returns `(loss_sum, weight_sum)`; the result is
        their ratio over the whole batch (token-weighted means).
      remat: `True` (or a `jax.checkpoint` policy): `stage_fn` under
        `jax.checkpoint`, so the recomputing backward keeps only what the policy
        saves inside a stage.
      **unsupported: Options of `microbatch_value_and_grad` this door does not
        take (`carry_argnums`, `statistics_fn`, `weight_fn`, ...) raise a
        `TypeError` naming what to use instead.

    Returns:
      `grad_fn(params, batch, key=None)` returning `(loss, grads)`, or
      `((loss, aux), grads)`, with `grads` laid out like `params`.
      `grad_fn.sequential(params, batch, key=None)` is the unstaged model's loss
      on one batch (the same keys), for `jax.value_and_grad` or
      `microbatch_value_and_grad` to check against; `grad_fn.schedule(S)` the
      table of one call on `S` stages.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> mesh = jax.make_mesh((1,), ("stage",), axis_types=(jax.sharding.AxisType.Explicit,))
      >>> stage = lambda w, x: jnp.tanh(x @ w)
      >>> loss = lambda outer, y, batch: jnp.mean((y @ outer["head"] - batch[1]) ** 2)
      >>> grad_fn = ga.pipeline_value_and_grad(stage, loss, num_microbatches=4)
      >>> params = {"stages": jnp.ones((1, 3, 3)) / 3, "head": jnp.ones((3, 1))}
      >>> batch = (jnp.ones((8, 3)), jnp.zeros((8, 1)))
      >>> with jax.set_mesh(mesh):
      ...     value, grads = jax.jit(grad_fn)(params, batch)
      >>> ref = jax.value_and_grad(grad_fn.sequential)(params, batch)
      >>> bool(jnp.allclose(value, ref[0]))
      True
    """
    for name in unsupported:
        if name in _REFUSED:
            raise TypeError(f"pipeline_value_and_grad got {name}=: {_REFUSED[name]}.")
        raise TypeError(f"pipeline_value_and_grad got an unexpected keyword argument {name!r}.")
    for name, fn in (("stage_fn", stage_fn), ("loss_fn", loss_fn)):
        if not callable(fn):
            raise TypeError(f"{name}={fn!r}: expected a callable.")
    if embed_fn is not None and not callable(embed_fn):
        raise TypeError(f"embed_fn={embed_fn!r}: expected a callable or None.")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise TypeError(f"{num_microbatches=}: expected an int >= 1 (N micro-batches).")
    if num_microbatches < 1:
        raise ValueError(f"{num_microbatches=}: expected an int >= 1 (N micro-batches).")
    if schedule not in SCHEDULES:
        raise ValueError(f"{schedule=}: expected one of {', '.join(map(repr, SCHEDULES))}.")
    pipeline_schedule(schedule, 1, 1, num_chunks)  # num_chunks checked against the schedule
    if sum_and_weight not in (True, False) or has_aux not in (True, False):
        raise TypeError(f"{sum_and_weight=}, {has_aux=}: expected booleans.")
    if remat is not False and remat is not True and not callable(remat):
        raise TypeError(f"{remat=}: expected a bool or a jax.checkpoint policy.")
    body = stage_fn
    if remat is not False:
        body = jax.checkpoint(stage_fn, policy=None if remat is True else remat)
    options = _Options(
        stage_fn=body,
        loss_fn=loss_fn,
        embed_fn=embed_fn,
        num_microbatches=num_microbatches,
        schedule=schedule,
        num_chunks=num_chunks,
        stage_axis=stage_axis,
        axis_name=_axes(axis_name),
        stages_key=stages_key,
        has_aux=has_aux,
        sum_and_weight=sum_and_weight,
    )

    def grad_fn(params: Any, batch: Any, key: Any = None) -> Any:
        _check_params(params, stages_key)
        if _bound(stage_axis):
            return _on_device(options, params, batch, key, options.axis_name)
        return _global_view(options, params, batch, key)

    grad_fn.sequential = functools.partial(_sequential, options)  # type: ignore[attr-defined]
    grad_fn.schedule = lambda num_stages: pipeline_schedule(  # type: ignore[attr-defined]
        schedule, num_stages, num_microbatches, num_chunks
    )
    grad_fn._gradaccum_pipeline = True  # type: ignore[attr-defined]  # privacy refuses it
    return grad_fn


class _Options:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    stage_fn: Callable[..., Any]
    loss_fn: Callable[..., Any]
    embed_fn: Callable[..., Any] | None
    num_microbatches: int
    schedule: str
    num_chunks: int
    stage_axis: Any
    axis_name: tuple[Any, ...]
    stages_key: str
    has_aux: bool
    sum_and_weight: bool


def _axes(axis_name: Any) -> tuple[Any, ...]:
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def _bound(axis: Any) -> bool:
    try:
        jax.lax.axis_size(axis)
    except NameError:
        return False
    return True


def _check_params(params: Any, stages_key: str) -> None:
    # flax.nnx only where the caller imported it: `import gradaccum_jax` does not import flax.
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(params, nnx.Module):
        raise TypeError(
            f"pipeline_value_and_grad got a flax.nnx module ({type(params).__name__}) as "
            "params: it takes a mapping of arrays with the stage params stacked. Split the "
            "model: graphdef, state, rest = nnx.split(model, nnx.Param, ...), then pass "
            f"{{{stages_key!r}: ga.stack_stages(state['layers'], S), 'embed': state['embed'], "
            "...} and merge each layer's state inside stage_fn (docs/pipeline.md, the "
            "stacked layout)."
        )
    if not isinstance(params, Mapping) or stages_key not in params:
        kind = type(params).__name__
        raise TypeError(
            f"params of type {kind}: expected a mapping with the stacked stage params under "
            f"{stages_key!r} and the rest (embedding, head) beside them, e.g. "
            f"{{{stages_key!r}: ga.stack_stages(layers, S), 'embed': ..., 'head': ...}}; "
            "another key can be named with stages_key=."
        )


def _split(batch: Any, n: int) -> Any:
    """Strided micro-batches: leaf `(B, ...)` -> `(B / N, N, ...)`, column `m` = rows `m::N`.

    A reshape only (no copy of the batch): the executor takes column `m` when it needs
    micro-batch `m`, so the program's memory does not grow with `N` by a batch copy.
    """

    def one(x: Any) -> Any:
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(
                f"num_microbatches={n}: a batch leaf of shape {tuple(x.shape)} has a leading "
                f"axis that is not a multiple of {n} (per data shard). Pick N dividing the "
                "batch size per shard, or pad the batch and weigh the padding 0 "
                "(sum_and_weight=True)."
            )
        return x.reshape(x.shape[0] // n, n, *x.shape[1:])

    return jax.tree.map(one, batch)


def _unsplit(x: jax.Array) -> jax.Array:
    """The inverse of `_split` for one leaf: `(N, b, ...)` -> `(N b, ...)` in batch order."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _first_input(batch: Any) -> Any:
    if isinstance(batch, tuple | list) and batch:
        return batch[0]
    if isinstance(batch, Mapping):
        if "x" not in batch:
            raise TypeError(
                "embed_fn=None needs the stage input in the batch: an array, a tuple or "
                f"list whose first element it is, or a mapping with an 'x' entry; got keys "
                f"{sorted(map(str, batch))}. Pass embed_fn=lambda outer, batch: ..."
            )
        return batch["x"]
    return batch


def _model(options: _Options, with_key: bool, width: int) -> executor.Model:
    """The three functions with their keys folded in and their outputs made uniform.

    `width` is `S v`, the virtual stages: `embed_fn` and `loss_fn` fold in `width` and
    `width + 1`, after every stage's own index.
    """

    def fold(key: Any, i: int | jax.Array) -> Any:
        return None if key is None else jax.random.fold_in(key, i)

    def call(fn: Callable[..., Any], *args: Any, key: Any) -> Any:
        return fn(*args, key) if with_key else fn(*args)

    def embed(outer: Any, micro: Any, key: Any) -> Any:
        if options.embed_fn is None:
            return _first_input(micro)
        return call(options.embed_fn, outer, micro, key=fold(key, width))

    def stage(chunk: Any, x: Any, key: Any, c: Any) -> Any:
        y = call(options.stage_fn, chunk, x, key=fold(key, c))
        if str(jax.tree.structure(y)) != str(jax.tree.structure(x)):
            raise ValueError(
                "stage_fn returned a value of another structure than its input "
                f"({jax.tree.structure(y)} for {jax.tree.structure(x)}): each stage must "
                "return its activation only. State carried through a stage (BatchNorm "
                "statistics) is not pipelined yet; use LayerNorm/RMSNorm in the stages, or "
                "ga.microbatch_value_and_grad(..., carry_argnums=...) unstaged."
            )
        return y

    def loss(outer: Any, y: Any, micro: Any, key: Any) -> Any:
        out = call(options.loss_fn, outer, y, micro, key=fold(key, width + 1))
        aux = None
        if options.has_aux:
            out, aux = out
        if options.sum_and_weight:
            value, weight = out
        else:
            value, weight = out, jnp.float32(1.0)
        if jnp.shape(value) != ():
            raise ValueError(
                f"loss_fn returned a loss of shape {jnp.shape(value)}: expected a scalar "
                "(the micro-batch's mean, or its (sum, weight) with sum_and_weight=True)."
            )
        weight = jax.lax.stop_gradient(jnp.sum(jnp.asarray(weight, jnp.float32)))
        return value, weight, aux

    return executor.Model(embed=embed, stage=stage, loss=loss)


def _stage_leaves(options: _Options, params: Any, num_stages: int, where: str) -> None:
    """Checks the stacked stage params' leading axes: `(S, ...)` or `(S, v, ...)`."""
    v = options.num_chunks
    for path, leaf in jax.tree_util.tree_leaves_with_path(params[options.stages_key]):
        shape = tuple(jnp.shape(leaf))
        lead = (num_stages,) if v == 1 else (num_stages, v)
        if shape[: len(lead)] != lead:
            fix = (
                f"split them over the stage axis in the shard_map: in_specs "
                f"P({options.stage_axis!r}) for params[{options.stages_key!r}]"
                if where == "device"
                else f"stack them with ga.stack_stages(layers, {num_stages}, {v})"
            )
            raise ValueError(
                f"params[{options.stages_key!r}]{jax.tree_util.keystr(path)} has shape "
                f"{shape}; expected a leading {lead} ({where}: {num_stages} stage(s), "
                f"num_chunks={v}); {fix}."
            )


def _data_index(axes: tuple[Any, ...]) -> jax.Array:
    index = jnp.int32(0)
    for axis in axes:
        index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
    return index


def _on_device(
    options: _Options,
    params: Any,
    batch: Any,
    key: Any,
    data_axes: tuple[Any, ...],
    layout: Any = None,
) -> Any:
    """The per-device call: this device's stages, its data shard's micro-batches.

    `layout` (global view on Explicit meshes): each param leaf's per-dimension split,
    for the leaves split over data axes (FSDP), gathered here once and reduce-scattered
    once in `_finish`; `None` elsewhere.
    """
    if layout is not None:
        params = sharded.gather(params, layout, options.stage_axis)
    s = jax.lax.axis_size(options.stage_axis)
    v, n = options.num_chunks, options.num_microbatches
    collectives.check_axes_bound("axis_name", data_axes)
    _stage_leaves(options, params, 1, "device")
    table = pipeline_schedule(options.schedule, s, n, v)
    stages = params[options.stages_key]
    outer = {k: p for k, p in params.items() if k != options.stages_key}
    local = jax.tree.map(lambda x: x[0] if v > 1 else x, stages)
    micro = _split(batch, n)
    keys = None
    if key is not None:
        if data_axes:
            key = jax.random.fold_in(key, _data_index(data_axes))
        keys = jax.vmap(lambda m: jax.random.fold_in(key, m))(jnp.arange(n))
    model = _model(options, key is not None, s * v)
    step = executor.Step(
        table=table,
        stage_axis=options.stage_axis,
        data_axes=data_axes,
        aux_concat=None,
    )
    axes = executor.all_axes(step, (local, outer, micro, keys))
    local, outer, micro, keys = executor.cast((local, outer, micro, keys), axes)
    one, one_key = jax.tree.map(lambda x: x[:, 0], micro), None if keys is None else keys[0]
    act_shape = jax.eval_shape(model.embed, outer, one, one_key)
    chunk0 = jax.tree.map(lambda x: x[0], local)
    out_shape = jax.eval_shape(model.stage, chunk0, act_shape, one_key, 0)
    if jax.tree.map(lambda a: (a.shape, a.dtype), out_shape) != jax.tree.map(
        lambda a: (a.shape, a.dtype), act_shape
    ):
        raise ValueError(
            f"stage_fn maps an activation {act_shape} to {out_shape}: every stage must "
            "return its input's shape and dtype, so that any stage can follow any other. "
            "Put shape changes in embed_fn (first stage) or loss_fn (last stage)."
        )
    aux_shape = jax.eval_shape(model.loss, outer, act_shape, one, one_key)[2]
    micro_size = jax.tree.leaves(micro)[0].shape[0] if jax.tree.leaves(micro) else None
    concat = jax.tree.map(lambda a: bool(a.ndim) and a.shape[0] == micro_size, aux_shape)
    for path, a in jax.tree_util.tree_leaves_with_path(aux_shape):
        if not concat_at(concat, path) and not jnp.issubdtype(a.dtype, jnp.inexact):
            raise TypeError(
                f"aux leaf {jax.tree_util.keystr(path)} of dtype {a.dtype} is neither per "
                "example (leading axis the micro-batch size) nor floating: its mean over "
                "micro-batches is not defined. Return it as a float, or per example."
            )
    step = dataclasses.replace(step, aux_concat=concat)
    value, weight, aux, g_stage, g_outer = executor.run(
        model, step, local, outer, micro, keys, act_shape
    )
    return _finish(options, params, step, (value, weight, aux, g_stage, g_outer), layout)


def concat_at(concat: Any, path: Any) -> bool:
    """The per-example flag of the aux leaf at `path`."""
    flags = dict(jax.tree_util.tree_leaves_with_path(concat))
    return bool(flags.get(path, False))


def _finish(options: _Options, params: Any, step: Any, sums: tuple, layout: Any) -> Any:
    """One normalisation and one reduction per leaf, after the schedule's loop.

    The value, weight, aux and outer gradients are summed over the stage axis (only
    the first and last stages hold them) together with the data axes; the stage
    gradients over the data axes alone. Leaves split over data axes (`layout`) are
    reduce-scattered back to their split instead.
    """
    value, weight, aux, g_stage, g_outer = sums
    stage_axis, data = options.stage_axis, step.data_axes
    typed = any(executor._typed(a) for a in (stage_axis, *data))
    every = (stage_axis, *data)
    stages = params[options.stages_key]
    outer = {k: p for k, p in params.items() if k != options.stages_key}
    if options.num_chunks > 1:  # the device's (v, ...) sums back under its stage axis
        g_stage = jax.tree.map(lambda g: g[None], g_stage)
    if layout is None:
        value, weight, g_outer, mean_aux = collectives.psum(
            (value, weight, g_outer, _means(aux, step.aux_concat)), every, typed
        )
        if data:
            g_stage = collectives.psum(g_stage, data, typed)
    else:
        value, weight, mean_aux = collectives.psum(
            (value, weight, _means(aux, step.aux_concat)), every, typed
        )
        outer_layout = {k: e for k, e in layout.items() if k != options.stages_key}
        g_outer = sharded.reduce(g_outer, outer_layout, every, stage_axis, typed)
        g_stage = sharded.reduce(g_stage, layout[options.stages_key], data, stage_axis, typed)
    concat_aux = collectives.psum(_concats(aux, step.aux_concat), (stage_axis,), typed)
    if options.sum_and_weight:
        total = weight
    else:  # micro-batch means: N of them per data shard, equal in size
        total = options.num_microbatches * math.prod(jax.lax.axis_size(a) for a in data)
    value = (value / total).astype(value.dtype)

    def scaled(g: jax.Array, p: Any) -> jax.Array:
        return (g / total).astype(jnp.result_type(p))

    grads = {k: jax.tree.map(scaled, g_outer[k], outer[k]) for k in outer}
    grads[options.stages_key] = jax.tree.map(scaled, g_stage, stages)
    grads = {k: grads[k] for k in params}
    if not options.has_aux:
        return value, grads
    aux = _join(mean_aux, concat_aux, step.aux_concat, total)
    return (value, aux), grads


def _means(aux: Any, concat: Any) -> Any:
    return jax.tree.map(lambda a, c: None if c else a, aux, concat)


def _concats(aux: Any, concat: Any) -> Any:
    return jax.tree.map(lambda a, c: a if c else None, aux, concat)


def _join(means: Any, concats: Any, concat: Any, total: jax.Array) -> Any:
    return jax.tree.map(
        lambda m, c, flag: _unsplit(c) if flag else m / total,
        means,
        concats,
        concat,
        is_leaf=lambda x: x is None,
    )


def _mesh(options: _Options, params: Any, batch: Any) -> Any:
    """The mesh of the context, else the one in the arguments' types (Explicit arrays)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        return mesh
    for leaf in jax.tree.leaves((params, batch)):
        found = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if found is not None and not found.empty:
            return found
    raise ValueError(
        f"stage_axis={options.stage_axis!r} is not bound and no mesh is known: call grad_fn "
        f"inside jax.shard_map over a mesh with a {options.stage_axis!r} axis, or under "
        "jax.jit with that mesh set (jax.set_mesh(mesh)) or with the params put on it "
        "(jax.device_put(params, NamedSharding(mesh, ...)))."
    )


def _global_view(options: _Options, params: Any, batch: Any, key: Any) -> Any:
    """The call as its own `jax.shard_map` over the mesh: stages split, batch split."""
    mesh = _mesh(options, params, batch)
    names = tuple(mesh.axis_names)
    if options.stage_axis not in names:
        raise ValueError(
            f"stage_axis={options.stage_axis!r} is not an axis of the mesh {dict(mesh.shape)}: "
            "make the mesh with a stage axis (jax.make_mesh((S, D), ('stage', 'data'))) "
            "or name yours with stage_axis=."
        )
    data = options.axis_name or tuple(a for a in names if a != options.stage_axis)
    for axis in data:
        if axis not in names or axis == options.stage_axis:
            raise ValueError(
                f"axis_name={options.axis_name!r}: {axis!r} is not a data axis of the mesh "
                f"{dict(mesh.shape)} (the stage axis is {options.stage_axis!r})."
            )
    _stage_leaves(options, params, mesh.shape[options.stage_axis], "global view")
    layout = _layout(options, params) if _explicit(mesh) else None
    if layout is None:
        param_specs = {
            k: jax.tree.map(
                lambda _, k=k: _P(options.stage_axis) if k == options.stages_key else _P(), p
            )
            for k, p in params.items()
        }
    else:
        sharded.check(layout, data, options.stage_axis)
        param_specs = jax.tree.map(lambda split: _P(*split.entries), layout)
    data_spec = _P(data)
    out_specs: Any = (_P(), param_specs)
    if options.has_aux:
        shards = math.prod(mesh.shape[a] for a in data)
        local = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // shards, *x.shape[1:]), x.dtype), batch
        )
        concat = _concat_flags(options, params, local)
        out_specs = ((_P(), jax.tree.map(lambda c: data_spec if c else _P(), concat)), param_specs)
    mapped = jax.shard_map(
        lambda p, b, k: _on_device(options, p, b, k, data, layout),
        mesh=mesh,
        in_specs=(param_specs, jax.tree.map(lambda _: data_spec, batch), _P()),
        out_specs=out_specs,
    )
    args: tuple[Any, ...] = (params, batch, key)
    if _explicit(mesh):  # shard_map takes explicit arrays only as its in_specs split them
        specs = (param_specs, jax.tree.map(lambda _: data_spec, batch), _P())
        args = tuple(
            jax.tree.map(lambda x, spec: compat.reshard(x, jax.NamedSharding(mesh, spec)), a, sp)
            if a is not None
            else a
            for a, sp in zip(args, specs, strict=True)
        )
    return mapped(*args)


def _layout(options: _Options, params: Any) -> Any:
    """Each param leaf's split from its type (the stage leaves' first entry the stage
    axis), or `None` where no leaf is split over another axis."""

    def one(x: Any, stage: bool) -> sharded.Split:
        entries = list(global_view.spec_entries(x)) + [None] * jnp.ndim(x)
        entries = entries[: jnp.ndim(x)]
        if stage:
            entries[0] = options.stage_axis
        return sharded.Split(tuple(entries))

    layout = {
        k: jax.tree.map(lambda x, k=k: one(x, k == options.stages_key), p)
        for k, p in params.items()
    }
    if not any(s.over(options.stage_axis) for s in jax.tree.leaves(layout)):
        return None  # nothing split over the data axes: the plain path, one psum
    return layout


def _explicit(mesh: Any) -> bool:
    explicit = jax.sharding.AxisType.Explicit
    return any(t == explicit for t in getattr(mesh, "axis_types", ()))


def _concat_flags(options: _Options, params: Any, batch: Any) -> Any:
    """Which aux leaves are per example (leading axis the micro-batch size), per device."""
    n = options.num_microbatches
    micro = jax.eval_shape(lambda b: jax.tree.map(lambda x: x[:, 0], _split(b, n)), batch)
    outer = {k: p for k, p in params.items() if k != options.stages_key}
    model = _model(options, False, 0)
    x = jax.eval_shape(model.embed, outer, micro, None)
    aux = jax.eval_shape(model.loss, outer, x, micro, None)[2]
    size = jax.tree.leaves(micro)[0].shape[0] if jax.tree.leaves(micro) else None
    return jax.tree.map(lambda a: bool(a.ndim) and a.shape[0] == size, aux)


def _whole(x: Any) -> Any:
    """`x` replicated where its type splits it over Explicit mesh axes, else as it is."""
    if not any(global_view.spec_entries(x)):
        return x
    return compat.reshard(x, jax.NamedSharding(jax.typeof(x).sharding.mesh, _P()))


def _sequential(options: _Options, params: Any, batch: Any, key: Any = None) -> Any:
    """The unstaged model's loss on one batch: what the pipeline's result equals.

    Returns what `loss_fn` returns (a mean, or `(sum, weight)`, with aux under
    `has_aux`), so that `jax.value_and_grad` of it, or `microbatch_value_and_grad` of
    it with `N` micro-batches (and `sum_and_weight`, `has_aux` as given), is the
    reference. Keys as in the pipeline, with `key` standing for `k_m`.
    """
    _check_params(params, options.stages_key)
    # Stage params split over the stage axis (as the pipeline takes them, Explicit mesh):
    # whole here, for the unstaged model indexes them by stage.
    stages = jax.tree.map(_whole, params[options.stages_key])
    lead = jax.tree.leaves(stages)[0].shape
    s = lead[0]
    v = options.num_chunks
    outer = {k: p for k, p in params.items() if k != options.stages_key}
    model = _model(options, key is not None, s * v)
    x = model.embed(outer, batch, key)
    for c in range(s * v):
        index = (c % s,) if v == 1 else (c % s, c // s)
        x = model.stage(jax.tree.map(lambda p, i=index: p[i], stages), x, key, c)
    return options.loss_fn(
        outer, x, batch, *(() if key is None else (jax.random.fold_in(key, s * v + 1),))
    )


def stack_stages(layers: Any, num_stages: int, num_chunks: int = 1) -> Any:
    """Lays a stack of `L` layers out as the stage params of `pipeline_value_and_grad`.

    Every leaf of `layers` has the layer axis first (`(L, ...)`, as `nn.scan`,
    `nnx.vmap` or `jax.vmap` of an init give it). Virtual stage `c` gets layers
    `c L / (S v)` up to `(c + 1) L / (S v)`, and sits at `[c % S]` (`[c % S, c // S]`
    with `v > 1` chunks), so the result has leaves `(S, L / S, ...)` or
    `(S, v, L / (S v), ...)`: `stage_fn` then runs its `L / (S v)` layers in order.

    Args:
      layers: A pytree of arrays with a leading layer axis `L`.
      num_stages: `S`.
      num_chunks: `v`, chunks per stage (the interleaved and circular schedules).

    Returns:
      The stacked stage params; `unstack_stages` is the inverse.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> w = jnp.arange(8.0)[:, None]  # 8 layers
      >>> ga.stack_stages(w, num_stages=2, num_chunks=2)[..., 0].tolist()
      [[[0.0, 1.0], [4.0, 5.0]], [[2.0, 3.0], [6.0, 7.0]]]
      >>> bool((ga.unstack_stages(ga.stack_stages(w, 2, 2), 2) == w).all())
      True
    """
    s, v = num_stages, num_chunks
    for arg, value in (("num_stages", s), ("num_chunks", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg}={value!r}: expected an int >= 1.")

    def one(x: Any) -> Any:
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] % (s * v):
            raise ValueError(
                f"stack_stages: a layer leaf of shape {tuple(jnp.shape(x))} does not split into "
                f"num_stages * num_chunks = {s * v} equal groups of layers along its first axis."
            )
        per = x.shape[0] // (s * v)
        y = jnp.swapaxes(x.reshape(v, s, per, *x.shape[1:]), 0, 1)  # (S, v, per, ...)
        return y[:, 0] if v == 1 else y

    return jax.tree.map(one, layers)


def unstack_stages(stages: Any, num_chunks: int = 1) -> Any:
    """The inverse of `stack_stages`: stage params (or their gradients) back to `(L, ...)`.

    Args:
      stages: Leaves `(S, per, ...)`, or `(S, v, per, ...)` with `num_chunks = v > 1`.
      num_chunks: `v`, as given to `stack_stages`.

    Returns:
      The layers, with the layer axis first, in model order.
    """

    def one(x: Any) -> Any:
        y = x[:, None] if num_chunks == 1 else x
        y = jnp.swapaxes(y, 0, 1)  # (v, S, per, ...)
        return y.reshape(y.shape[0] * y.shape[1] * y.shape[2], *y.shape[3:])

    return jax.tree.map(one, stages)
