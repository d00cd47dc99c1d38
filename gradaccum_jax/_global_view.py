"""Per-device gradients for global-view `jax.jit` on an explicit mesh, typed unreduced."""

from __future__ import annotations

import contextvars
import functools
import itertools
import math
import numbers
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _compat, _validation, _window
from gradaccum_jax._compat import pcast_to_varying, reshard, unreduced_axes_in_body, varying_axes
from gradaccum_jax._microbatch import microbatch_value_and_grad

AxisName = Hashable | Sequence[Hashable]

# Set while `unreduced_value_and_grad` traces `fun` for one device: the mesh axes
# its batch is split over and the number of micro-batches of each device's slice
# (see `per_device_axes`).
_PER_DEVICE: contextvars.ContextVar[tuple[tuple[Any, ...], int] | None] = contextvars.ContextVar(
    "gradaccum_jax_per_device", default=None
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
        for part in _compat.partitions(spec)
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
    """Inside `jax.shard_map`: sums `grad` over the batch axes `others` into its `spec`.

    Along a dimension `spec` shards over some of them, a reduce-scatter leaves
    each device its shard (FSDP); over the rest, an all-reduce (a leaf
    replicated over them, such as a bias).
    """
    scattered: set = set()
    for dim, part in enumerate(_dim_axes(spec)):
        if part:
            grad = jax.lax.psum_scatter(grad, part, scatter_dimension=dim, tiled=True)
            scattered |= set(part)
    rest = tuple(a for a in others if a not in scattered)
    return jax.lax.psum(grad, rest) if rest else grad


def _check_params(args: tuple[Any, ...], grad_nums: tuple[int, ...]) -> None:
    for i in grad_nums:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[i]):
            spec = _leaf_spec(leaf)
            if spec.unreduced or getattr(spec, "reduced", None):
                raise ValueError(
                    f"argument {i}{jax.tree_util.keystr(path)} (in argnums) is typed {spec}: "
                    "a partial sum (unreduced) or a value marked reduced, which cannot be "
                    "differentiated with respect to. Pass the params in a dense sharding: "
                    f"jax.reshard(x, {jax.P(*_compat.partitions(spec))}) sums a partial sum "
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

    Returns:
      A function with the signature of `fun` returning `(value, grads)` or
      `((value, aux), grads)`, like `jax.value_and_grad`. Call it inside
      `jax.jit`, under the mesh.

    Raises:
      TypeError: If `fun` is not callable, `axis_name` is not a name or a
        tuple of names, or an argnums value is not a position.
      ValueError: If the argnums overlap; when called, if there is no context
        mesh, it lacks `axis_name` or the axis is not `Explicit`, a batch
        leaf's leading axis is not a multiple of the number of devices (times
        `num_microbatches`), or a parameter is typed unreduced or reduced.

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
    axes = _validation.check_axis_name("axis_name", axis_name)
    grad_nums = _positions("argnums", argnums)
    batch_nums = _positions("batch_argnums", batch_argnums)
    overlap = sorted(set(grad_nums) & set(batch_nums))
    if overlap:
        raise ValueError(
            f"position(s) {overlap} are in both argnums and batch_argnums; the params are "
            f"replicated and the batch is split. Got {argnums=!r}, {batch_argnums=!r}."
        )
    k = _validation.check_int("num_microbatches", num_microbatches)
    if not isinstance(reduce_value, bool):
        raise TypeError(f"reduce_value must be a bool; got {reduce_value=!r}.")
    if aux_out_specs is not None and not has_aux:
        raise ValueError(f"aux_out_specs is given but has_aux=False; got {aux_out_specs=!r}.")

    def value_and_grad_over(devices: int) -> Callable[..., Any]:
        """`value_and_grad` of `fun / devices`: the gradient comes out of the backward
        pass already scaled (the scalar seeds it), with no pass of its own over the
        gradient, whose result would be one more parameter-sized buffer per call."""

        def fun_over_devices(*args: Any, **kwargs: Any) -> Any:
            out = fun(*args, **kwargs)
            if has_aux:
                return out[0] / devices, out[1]
            return out / devices

        if k == 1:
            return jax.value_and_grad(fun_over_devices, argnums, has_aux=has_aux)
        return microbatch_value_and_grad(
            fun_over_devices, k, has_aux=has_aux, argnums=argnums, batch_argnums=batch_argnums
        )

    value_and_grad_over(1)  # checks the options now, not at the first call

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mesh_axes_size(axes, f"unreduced_value_and_grad(..., axis_name={axis_name!r})")
        for i in grad_nums:
            if i >= len(args):
                raise ValueError(
                    f"argnums names position {i}, but the function was called with "
                    f"{len(args)} positional argument(s)."
                )
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

        def aux_spec(leaf: Any) -> Any:
            partial = unreduced_axes_in_body(leaf)
            return jax.P(unreduced=partial) if partial else jax.P()

        def reduce_aux(leaf: Any, keep_unreduced: bool) -> Any:
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

        def arg_spec(i: int, leaf: Any) -> Any:
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
                out, grads = value_and_grad_over(devices)(*local_args, **kwargs)
            finally:
                _PER_DEVICE.reset(token)
            value, aux = out if has_aux else (out, None)
            # The value is this device's loss / devices: summed, the global mean.
            if reduce_value or others:
                value = jax.lax.psum(value, split if reduce_value else others)
            if others:
                # Summed over the other batch axes now, into the params' sharding:
                # reduce-scatters (and all-reduces of replicated leaves) within
                # their groups, none across `axes`.
                flat = [grads] if isinstance(argnums, numbers.Integral) else list(grads)
                flat = [
                    jax.tree.map(lambda g, s: _reduce_grad(g, s, others), g, s, is_leaf=is_spec)
                    for g, s in zip(flat, grad_specs, strict=True)
                ]
                grads = flat[0] if isinstance(argnums, numbers.Integral) else tuple(flat)
            if has_aux and aux_out_specs is None:
                seen.append(jax.tree.map(aux_spec, aux))
                aux = jax.tree.map(lambda x: reduce_aux(x, keep_unreduced), aux)
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
    return reshard(zeros, jax.P(*_compat.partitions(spec), unreduced=spec.unreduced))


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
        for part in _compat.partitions(spec)
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

    return reshard(leaf, jax.P(*(drop(part) for part in _compat.partitions(spec))))


def _with_unreduced(spec: Any, axes: tuple[Any, ...]) -> Any:
    """`spec`'s sharding over mesh axes (HSDP: `fsdp`), unreduced over `axes`."""
    return jax.P(*_compat.partitions(spec), unreduced=frozenset(axes))


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
    return jax.P(*_compat.partitions(spec))


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
    if not _compat.UNREDUCED_IN_SHARD_MAP:
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
        axes = _validation.check_axis_name("shard_inner_state", shard_inner_state)
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
    src = list(_compat.partitions(spec)) + [None] * (ndim - len(_compat.partitions(spec)))
    dst = list(target) + [None] * (ndim - len(target))
    changed = [i for i in range(ndim) if _names(src[i]) != _names(dst[i])]
    if not axes or len(changed) != 1 or _names(dst[changed[0]]) != _names(src[changed[0]]) + axes:
        return reshard(x, target)
    dim = changed[0]

    def scatter(block: jax.Array) -> jax.Array:
        return jax.lax.psum_scatter(block, axes, scatter_dimension=dim, tiled=True)

    in_spec = jax.P(*src, unreduced=frozenset(axes))
    return jax.shard_map(scatter, in_specs=in_spec, out_specs=jax.P(*dst), check_vma=False)(x)


def unreduced_gate(specs: Any) -> _window.Gate:
    """The gate of an unreduced window: one reduction of the sums at the close.

    `specs` (a tree like the window sums) gives the sharding the reduction
    produces: the params' sharding is an all-reduce over the unreduced axes (of
    each device's shard, for HSDP), a spec that splits a dimension over the
    unreduced axes (ZeRO-1) a reduce-scatter. The weight is reduced with them.
    No other collective runs; "anything accepted" is known after the reduction.
    """

    def reduce(window: _window.Window) -> _window.Window:
        total = jax.tree.map(_reduce_into, window.total, specs)
        return window._replace(total=total, weight=reshard(window.weight, jax.P()))

    def zeros_like(leaf: jax.Array, dtype: Any, zero: jax.Array) -> jax.Array:
        # Adding the leaf's own zero keeps equal-shaped leaves' zeros apart (no CSE, no copy).
        zeros = jnp.zeros(jnp.shape(leaf), dtype, out_sharding=_dense(_spec(leaf)))
        return zeros + zero.astype(dtype)

    return _window.Gate(
        cond=jax.lax.cond, reduce=reduce, decides_locally=False, zeros_like=zeros_like
    )


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
        dense = _compat.partitions(_dense(_spec(p)))
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
