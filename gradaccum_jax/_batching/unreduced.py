"""Per-device gradients for global-view `jax.jit` on an explicit mesh, typed unreduced.

`unreduced_value_and_grad` evaluates `fun` once per device on its slice of the
batch (micro-batched with `microbatch_value_and_grad`) and returns gradients
that are partial sums, unreduced over the batch's mesh axes. The partial-sum
primitives it and the reduction routes share live in
`gradaccum_jax._sharding.partials`.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import compat, equinox, reduce_rules, validation
from gradaccum_jax._base.compat import (
    pcast_to_varying,
    reshard,
    unreduced_axes_in_body,
    varying_axes,
)
from gradaccum_jax._batching import nnx_modules
from gradaccum_jax._batching.microbatch import microbatch_value_and_grad
from gradaccum_jax._sharding import global_view
from gradaccum_jax._sharding.partials import _PER_DEVICE, _mesh_axes_of, _spec, mesh_axes_size

_FP8 = (
    "Left unreduced, the devices' values would be summed where the large batch takes their "
    "max. Use microbatch_value_and_grad in the global-view jit step (XLA takes the amax over "
    "the sharded batch itself), or differentiate variables['params'] alone here."
)

AxisName = Hashable | Sequence[Hashable]


def _refuse_modules(args: tuple[Any, ...], grad_nums: tuple[int, ...]) -> None:
    """A `flax.nnx` module to differentiate is refused: split it, as the guide shows."""
    modules = nnx_modules.modules_at(args, grad_nums)
    if modules:
        # Differentiated whole, its RNG counters (uint32) fail inside jax.grad; split in
        # here, every device would hold its own copy of the state besides the params
        # (RNG streams drawing the same masks on every device, BatchNorm statistics of
        # its own slice), with no single module to write them back into.
        raise TypeError(
            f"unreduced_value_and_grad got a flax.nnx module at argnums position(s) "
            f"{modules}: its state besides the params (RNG streams, BatchNorm statistics) "
            "would be differentiated with them, and each device would hold its own copy. "
            "Split the model yourself: graphdef, params, rest = nnx.split(model, "
            "nnx.Param, ...), differentiate params with a loss that merges them "
            "(nnx.merge(graphdef, params, rest, copy=True)), and return the rest's new "
            "values as aux where they change (see the global-view section of the "
            "distributed-training guide)."
        )


def _positions(name: str, value: Any) -> tuple[int, ...]:
    def is_index(v: Any) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) >= 0

    positions = (value,) if is_index(value) else value
    try:
        positions = tuple(positions)
    except TypeError:
        positions = ()
    if not positions or not all(is_index(i) for i in positions):
        raise TypeError(
            f"{name} must be a non-negative int or a non-empty sequence of them (positions "
            f"of positional arguments); got {name}={value!r}."
        )
    if len(set(positions)) != len(positions):
        raise ValueError(f"{name} must not repeat a position; got {name}={value!r}.")
    return tuple(int(i) for i in positions)


def _varying_axes(x: Any) -> frozenset:
    return frozenset(varying_axes(x))


def _leaf_spec(leaf: Any) -> Any:
    """The `PartitionSpec` in the type of `leaf` (`P()` for a value without one)."""
    spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None)
    return jax.P() if spec is None else spec


def _dim_axes(spec: Any) -> tuple[tuple[Any, ...], ...]:
    """The mesh axes each dimension of `spec` is sharded over, as one tuple per dimension."""
    return tuple(
        () if part is None else part if isinstance(part, tuple) else (part,)
        for part in compat.partitions(spec)
    )


def _split_axes(
    args: tuple[Any, ...], grad_nums: tuple[int, ...], batch_nums: tuple[int, ...], axes
) -> tuple[Any, ...]:
    """The mesh axes the batch is split over: `axes`, then those the batch or the params
    are sharded over.

    A batch sharded over more axes (HSDP: `P(("data", "fsdp"))`) stays where it
    is, each device computing on its own slice, instead of being gathered; a
    param sharded over an axis (FSDP) needs the batch split over it too, or every
    device of the axis would compute the same gradient.
    """
    lead: tuple[Any, ...] = ()
    for leaf in jax.tree.leaves([args[j] for j in batch_nums]):
        parts = _dim_axes(_leaf_spec(leaf))
        if parts and parts[0]:
            lead = parts[0]
            break
    split = lead if set(axes) <= set(lead) else axes + tuple(a for a in lead if a not in axes)
    sharded = {
        a
        for leaf in jax.tree.leaves([args[i] for i in grad_nums])
        for part in _dim_axes(_leaf_spec(leaf))
        for a in part
    }
    mesh = jax.sharding.get_abstract_mesh()
    return split + tuple(a for a in mesh.axis_names if a in sharded and a not in split)


def _grad_spec(spec: Any, axes: tuple[Any, ...]) -> Any:
    """The spec of a param's gradient: the param's, less `axes`, and unreduced over `axes`."""
    parts = [tuple(a for a in part if a not in axes) for part in _dim_axes(spec)]
    return jax.P(
        *(None if not part else part[0] if len(part) == 1 else part for part in parts),
        unreduced=frozenset(axes),
    )


def _reduce_grad(grad: jax.Array, spec: Any, others: tuple[Any, ...]) -> jax.Array:
    """Inside `jax.shard_map`: sums `grad` over the batch axes `others` into its `spec`
    (a reduce-scatter along the dimensions it splits, FSDP; an all-reduce over the rest)."""
    return global_view.sum_into(grad, compat.partitions(spec), others)


def _check_params(args: tuple[Any, ...], grad_nums: tuple[int, ...]) -> None:
    for i in grad_nums:
        if i >= len(args):
            raise ValueError(
                f"argnums names position {i}, but the function was called with "
                f"{len(args)} positional argument(s)."
            )
    for i in grad_nums:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[i]):
            spec = _leaf_spec(leaf)
            if spec.unreduced or getattr(spec, "reduced", None):
                raise ValueError(
                    f"argument {i}{jax.tree_util.keystr(path)} (in argnums) is typed {spec}: "
                    "a partial sum (unreduced) or a value marked reduced, which cannot be "
                    "differentiated with respect to. Pass the params in a dense sharding: "
                    f"jax.reshard(x, {jax.P(*compat.partitions(spec))}) sums a partial sum "
                    "into it."
                )


def _check_batch(
    args: tuple[Any, ...], batch_nums: tuple[int, ...], split: tuple[Any, ...], axes, k: int
) -> None:
    shown = axes[0] if len(axes) == 1 else axes
    mesh = jax.sharding.get_abstract_mesh()
    devices = math.prod(mesh.shape[a] for a in split)
    over = f"the {devices} devices of axis_name={shown!r}"
    if split != axes:
        over = (
            f"the {devices} devices of the mesh axes {split} (axis_name={shown!r} and the "
            "axes the batch or the params are sharded over)"
        )
    if k > 1:
        over += f", then into num_microbatches={k} micro-batches"
    for j in batch_nums:
        if j >= len(args):
            raise ValueError(
                f"batch_argnums names position {j}, but the function was called with "
                f"{len(args)} positional argument(s)."
            )
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[j]):
            where = f"argument {j}{jax.tree_util.keystr(path)}"
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] % (devices * k):
                raise ValueError(
                    f"every leaf of a batch argument is split along its leading axis over "
                    f"{over}; {where} has shape {jnp.shape(leaf)}. Use a global batch size "
                    f"that is a multiple of {devices * k}, and pass per-batch constants at "
                    "a position that is not in batch_argnums."
                )


def _check_options(
    axis_name: Any,
    argnums: Any,
    batch_argnums: Any,
    num_microbatches: Any,
    reduce_value: Any,
    has_aux: bool,
    aux_out_specs: Any,
) -> tuple[tuple[Any, ...], tuple[int, ...], tuple[int, ...], int]:
    """Checks `unreduced_value_and_grad`'s options; returns the axes, positions and K."""
    axes = validation.check_axis_name("axis_name", axis_name)
    grad_nums = _positions("argnums", argnums)
    batch_nums = _positions("batch_argnums", batch_argnums)
    overlap = sorted(set(grad_nums) & set(batch_nums))
    if overlap:
        raise ValueError(
            f"position(s) {overlap} are in both argnums and batch_argnums; the params are "
            f"replicated and the batch is split. Got {argnums=!r}, {batch_argnums=!r}."
        )
    k = validation.check_int("num_microbatches", num_microbatches)
    if not isinstance(reduce_value, bool):
        raise TypeError(f"reduce_value must be a bool; got {reduce_value=!r}.")
    if aux_out_specs is not None and not has_aux:
        raise ValueError(f"aux_out_specs is given but has_aux=False; got {aux_out_specs=!r}.")
    return axes, grad_nums, batch_nums, k


def _value_and_grad_over(
    fun: Callable[..., Any],
    devices: int,
    k: int,
    has_aux: bool,
    argnums: Any,
    batch_argnums: Any,
    statistics_fn: Callable[..., Any] | None,
    split: tuple[Any, ...],
) -> Callable[..., Any]:
    """`value_and_grad` of `fun / devices`: the gradient comes out of the backward
    pass already scaled (the scalar seeds it), with no pass of its own over the
    gradient, whose result would be one more parameter-sized buffer per call.
    `statistics_fn`'s sums run over the devices of `split`, the batch's axes."""

    def fun_over_devices(*args: Any, **kwargs: Any) -> Any:
        out = fun(*args, **kwargs)
        if has_aux:
            return out[0] / devices, out[1]
        return out / devices

    if k == 1 and statistics_fn is None:
        return jax.value_and_grad(fun_over_devices, argnums, has_aux=has_aux)
    return microbatch_value_and_grad(
        fun_over_devices,
        k,
        has_aux=has_aux,
        argnums=argnums,
        batch_argnums=batch_argnums,
        statistics_fn=statistics_fn,
        axis_name=split if statistics_fn is not None else None,
    )


def _aux_spec(leaf: Any) -> Any:
    """The out spec of an aux leaf: unreduced where it is a per-device partial sum."""
    partial = unreduced_axes_in_body(leaf)
    return jax.P(unreduced=partial) if partial else jax.P()


def _reduce_aux(leaf: Any, keep_unreduced: bool, split: tuple[Any, ...]) -> Any:
    """One aux leaf as the caller sees it: averaged (or summed) over the batch's axes."""
    summed = unreduced_axes_in_body(leaf)
    if summed:
        # A per-device partial sum (AccumBatchNorm's window) leaves unreduced;
        # the first pass, which only learns the aux's types, sums it.
        return leaf if keep_unreduced else jax.lax.psum(leaf, tuple(summed))
    if not (_varying_axes(leaf) & set(split)):
        return leaf
    if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
        return jax.lax.pmean(leaf, split)
    return jax.lax.psum(leaf, split)


def _arg_spec(
    i: int,
    leaf: Any,
    grad_nums: tuple[int, ...],
    batch_nums: tuple[int, ...],
    split: tuple[Any, ...],
    partial: Any,
) -> Any:
    """The in spec of a leaf of positional argument `i`."""
    if i in batch_nums:
        return jax.P(split)
    # Partial sums over the batch's axes (AccumBatchNorm's window from an
    # earlier step) reach `fun` as they are, each device its own; reduced,
    # they would cost an all-reduce on every call.
    if i not in grad_nums and isinstance(leaf, jax.Array):
        spec = _spec(leaf)
        if spec.unreduced == frozenset(split) and not _mesh_axes_of(spec):
            return partial
    return jax.P()


def _reduce_grads(grads: Any, grad_specs: list[Any], others: tuple[Any, ...], argnums: Any) -> Any:
    """The gradients summed over the other batch axes now, into the params' sharding.

    Reduce-scatters (and all-reduces of replicated leaves) within their groups,
    none across the unreduced axes.
    """
    is_spec = lambda x: isinstance(x, jax.P)  # noqa: E731
    flat = [grads] if isinstance(argnums, numbers.Integral) else list(grads)
    flat = [
        jax.tree.map(lambda g, s: _reduce_grad(g, s, others), g, s, is_leaf=is_spec)
        for g, s in zip(flat, grad_specs, strict=True)
    ]
    return flat[0] if isinstance(argnums, numbers.Integral) else tuple(flat)


def unreduced_value_and_grad(
    fun: Callable[..., Any],
    axis_name: AxisName,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    num_microbatches: int = 1,
    reduce_value: bool = True,
    aux_out_specs: Any = None,
    statistics_fn: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    r"""Returns `jax.value_and_grad(fun)` for global-view `jit`, with gradients left unreduced.

    For a train step written as plain `jax.jit` over a mesh with explicit
    sharding (`jax.set_mesh`, a batch sharded `P("data")`, replicated params),
    `jax.value_and_grad` sums the gradient across devices in the backward pass:
    an all-reduce of every gradient on every call. This function instead
    computes each device's gradient on its own slice of the batch, inside
    `jax.shard_map` with the params cast to varying (so the backward pass adds
    nothing up), and returns the gradients as global-view arrays typed
    *unreduced* over `axis_name` (`jax.typeof(g)` shows `float32[...]{U:data}`):
    each device holds its partial sum, and no collective has run. Their sum is
    the gradient of the global batch's mean loss: with $n$ devices and $L_d$
    the mean loss on device $d$'s slice,

    $$
    g_d = \frac{1}{n}\nabla L_d, \qquad \sum_{d=1}^{n} g_d
    = \nabla \frac{1}{n}\sum_{d=1}^{n} L_d .
    $$

    Unreduced arrays can be added, scaled by a replicated constant marked
    reduced, and kept in state across jitted calls; `jax.reshard(g, P())`
    (an all-reduce) or `jax.reshard(g, P("data", ...))` (a reduce-scatter)
    turns them into ordinary arrays. `gradaccum_jax.accumulate` adds them up
    over a window and reduces once, when the window closes.

    The sum is the global-batch gradient when `fun` is a mean over equally
    weighted examples and every device holds the same number of examples
    (the batch axis is split evenly). With per-example weights or masks, `fun`
    returns each device's weighted mean and the sum is the mean of the
    devices' means: exact only when every device holds the same total weight.

    The value is the global mean (one scalar all-reduce per call, which XLA
    removes when the value is not used); with `reduce_value=False` it is
    unreduced like the gradients, $L_d / n$ on each device. JAX before 0.9.1
    cannot return an unreduced scalar from `jax.shard_map`: there it sums the
    value across devices itself (the same scalar all-reduce) and returns the
    global mean, replicated.

    Auxiliary outputs (`has_aux=True`) that are the same on every device are
    returned as they are. Each one that differs between devices is averaged
    over them (a floating-point leaf, e.g. a metric, or Flax `batch_stats`
    updated from each device's slice) or summed (an integer or boolean leaf, a
    count): a small collective per call. For Flax linen models with mutable
    batch statistics, `nn.BatchNorm(axis_name=<the axis>)` gives the
    statistics of the global batch (Flax averages them across devices in the
    forward pass); with `axis_name=None` each device normalises with its own
    slice's statistics and the returned running statistics are the average
    of the devices' running statistics (the running mean is the global one,
    the running variance misses the variance between the devices' means).
    `gradaccum_jax.flax.AccumBatchNorm` without `axis_name` keeps a window
    per device instead: an aux leaf that `fun` leaves typed unreduced over
    `axis_name` (a partial sum) is returned unreduced, with no collective
    (`fun` is then traced twice, the first time to learn which leaves are).
    `aux_out_specs` replaces this rule: a `PartitionSpec` (or a pytree prefix
    of the aux of them) as `jax.shard_map`'s `out_specs` would take, e.g.
    `jax.P("data")` for per-example outputs, concatenated in batch order.

    An argument that is neither differentiated nor a batch argument reaches
    `fun` replicated, except its leaves unreduced over `axis_name` (such as
    that window, from the previous step): each device receives its own
    partial sum, typed unreduced, instead of an all-reduce on every call.

    Parameters sharded over the mesh (FSDP, HSDP) are gathered once per call,
    and the batch is split over `axis_name` and over every other axis the
    batch or the parameters are sharded over (all devices then count in the
    $n$ above). Over those other axes the gradients are summed here, each into
    its parameter's sharding: a reduce-scatter along the dimension the
    parameter is sharded along (read from its spec), an all-reduce for a leaf
    replicated over the axis. On a `("data", "fsdp")` mesh with parameters
    `P("fsdp", None)` and `axis_name="data"`, a gradient is typed
    `float32[32@fsdp,64]{U:data}`: sharded like its parameter, unreduced over
    `"data"` only, and no collective crosses `"data"`. A parameter sharded
    over an axis of `axis_name` itself gets a full-size gradient, unreduced
    over `axis_name` (`axis_name=("data", "fsdp")` above: no gradient
    communication at all).

    Args:
      fun: The loss, `fun(*args, **kwargs)`, returning a scalar (or
        `(loss, aux)` with `has_aux`). It is traced for one device's slice of
        the batch; keyword arguments are passed to it unchanged.
      axis_name: The data-parallel axis of the context mesh (or a tuple of
        axes), which must be `Explicit`: the axes the gradients stay unreduced
        over. The batch arguments are split along their leading axis over it
        (and over the axes above); every other argument is used replicated.
      argnums: Position(s) of the arguments to differentiate (the params),
        as in `jax.value_and_grad`.
      batch_argnums: Position(s) of the batch arguments: pytrees whose leaves
        all have the global batch size, a multiple of the number of devices
        the batch is split over times `num_microbatches`, as their leading
        axis.
      has_aux: As in `jax.value_and_grad`.
      num_microbatches: If above 1, each device computes its gradient over its
        slice in that many sequential micro-batches, with
        `gradaccum_jax.microbatch_value_and_grad` (the slice must be divisible
        by it). The result is the same; peak activation memory is that of a
        micro-batch. `AccumBatchNorm` layers without `axis_name` (per-device
        windows) need 1 and raise a `ValueError` otherwise.
      reduce_value: If `True` (default) the value is the global mean; if
        `False` it is unreduced over `axis_name`, and no collective runs at
        all (JAX >= 0.9.1; see above).
      aux_out_specs: `None` (default: the rule above), or the out specs of the
        aux outputs.
      statistics_fn: As in `gradaccum_jax.microbatch_value_and_grad`: sums
        over the batch (such as the token count of each expert in MoE load
        balancing), here summed over every device's micro-batches before
        `fun(*args, statistics=sums)` runs on each device.

    Returns:
      A function with the signature of `fun` returning `(value, grads)` or
      `((value, aux), grads)`, like `jax.value_and_grad`. Call it inside
      `jax.jit`, under the mesh.

    Raises:
      TypeError: If `fun` is not callable, `axis_name` is not a name or a
        tuple of names, or an argnums value is not a position; when called, if
        a differentiated argument is a `flax.nnx` module (split it, as above).
      ValueError: If the argnums overlap; when called, if there is no context
        mesh, it lacks `axis_name` or the axis is not `Explicit`, a batch
        leaf's leading axis is not a multiple of the number of devices (times
        `num_microbatches`), a parameter is typed unreduced or reduced, or the
        params hold Flax fp8 metadata (summed over devices, they would be wrong).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> explicit = (jax.sharding.AxisType.Explicit,)
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=explicit)
      >>> def loss(w, batch):
      ...     return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
      >>> batch = {"x": jnp.arange(32.0).reshape(16, 2) / 16, "y": jnp.ones(16)}
      >>> w = jnp.array([1.0, -1.0])
      >>> full_value, full_grad = jax.value_and_grad(loss)(w, batch)
      >>> with jax.set_mesh(mesh):
      ...     sharded = jax.device_put(batch, jax.P("data"))
      ...     step = jax.jit(ga.unreduced_value_and_grad(loss, "data"))
      ...     value, grad = step(jax.device_put(w, jax.P()), sharded)
      ...     print(jax.typeof(grad))
      ...     summed = jax.jit(lambda g: jax.sharding.reshard(g, jax.P()))(grad)
      ...     print(jnp.allclose(summed, full_grad), jnp.allclose(value, full_value))
      float32[2]{U:data}
      True True
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable; got {fun=!r}.")
    axes, grad_nums, batch_nums, k = _check_options(
        axis_name, argnums, batch_argnums, num_microbatches, reduce_value, has_aux, aux_out_specs
    )

    def value_and_grad_over(devices: int, split: tuple[Any, ...]) -> Callable[..., Any]:
        return _value_and_grad_over(
            fun, devices, k, has_aux, argnums, batch_argnums, statistics_fn, split
        )

    value_and_grad_over(1, axes)  # checks the options now, not at the first call

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        reduce_rules.refuse_max_leaves(
            [args[i] for i in grad_nums], "unreduced_value_and_grad", _FP8
        )
        _refuse_modules(args, grad_nums)
        equinox.refuse_modules(args, grad_nums, "unreduced_value_and_grad")
        mesh_axes_size(axes, f"unreduced_value_and_grad(..., axis_name={axis_name!r})")
        _check_params(args, grad_nums)
        split = _split_axes(args, grad_nums, batch_nums, axes)
        _check_batch(args, batch_nums, split, axes, k)
        devices = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in split)
        # The batch axes the gradients are summed over here (HSDP's fast axes);
        # over `axes` they stay unreduced.
        others = tuple(a for a in split if a not in axes)
        unreduced = jax.P(unreduced=frozenset(axes))
        partial = jax.P(unreduced=frozenset(split))
        grad_specs = [
            jax.tree.map(lambda x: _grad_spec(_leaf_spec(x), axes), args[i]) for i in grad_nums
        ]

        def arg_spec(i: int, leaf: Any) -> Any:
            return _arg_spec(i, leaf, grad_nums, batch_nums, split, partial)

        is_spec = lambda x: isinstance(x, jax.P)  # noqa: E731
        in_specs = tuple(jax.tree.map(lambda x, i=i: arg_spec(i, x), a) for i, a in enumerate(args))
        # shard_map takes arrays already in its in_specs: params sharded over
        # the mesh (FSDP) are gathered here, a replicated batch is sliced.
        args = tuple(
            jax.tree.map(
                lambda x, s: reshard(x, s) if isinstance(x, jax.Array) else x,
                a,
                spec,
                is_leaf=is_spec,
            )
            for a, spec in zip(args, in_specs, strict=True)
        )
        seen: list[Any] = []

        def local(keep_unreduced: bool, *given: Any) -> Any:
            local_args = list(given)
            for i in grad_nums:
                # Invariant params would get their gradient summed across devices
                # by the backward pass; varying ones keep it on the device.
                local_args[i] = pcast_to_varying(local_args[i], split)
            token = _PER_DEVICE.set((split, k))
            try:
                out, grads = value_and_grad_over(devices, split)(*local_args, **kwargs)
            finally:
                _PER_DEVICE.reset(token)
            value, aux = out if has_aux else (out, None)
            # The value is this device's loss / devices: summed, the global mean.
            if reduce_value or others:
                value = jax.lax.psum(value, split if reduce_value else others)
            if others:
                grads = _reduce_grads(grads, grad_specs, others, argnums)
            if has_aux and aux_out_specs is None:
                seen.append(jax.tree.map(_aux_spec, aux))
                aux = jax.tree.map(lambda x: _reduce_aux(x, keep_unreduced, split), aux)
            return value, grads, aux

        grads_spec = grad_specs[0] if isinstance(argnums, numbers.Integral) else tuple(grad_specs)

        def run(aux_specs: Any, keep_unreduced: bool) -> Any:
            out_specs = (jax.P() if reduce_value else unreduced, grads_spec, aux_specs)
            body = functools.partial(local, keep_unreduced)
            return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs)(*args)

        value, grads, aux = run(jax.P() if aux_out_specs is None else aux_out_specs, False)
        if seen and any(s.unreduced for s in jax.tree.leaves(seen[0], is_leaf=is_spec)):
            # The aux holds partial sums: trace again with their specs (the first
            # pass, unused, is dropped from the program).
            value, grads, aux = run(seen[0], True)
        return ((value, aux), grads) if has_aux else (value, grads)

    return wrapped
