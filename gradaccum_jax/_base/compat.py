"""The few JAX APIs whose spelling changed across the releases this package supports.

The package supports every JAX release from the lower bound in `pyproject.toml`
on. Code elsewhere in the package calls the helpers here instead of the
version-specific API, so one module knows which release spells what:

- `jax.lax.pcast(x, axes, to="varying")` (JAX 0.8.2) replaced `jax.lax.pvary`,
  removed in JAX 0.10.0.
- The varying mesh axes of a value inside `jax.shard_map` moved from the
  aval's `vma` field to `manual_axis_type.varying` in JAX 0.10.0, which also
  records there the axes a value is unreduced over (`manual_axis_type.unreduced`).
- `jax.reshard` is new in JAX 0.8.2; `jax.sharding.reshard` is the same
  function.
- Unreduced arrays in `jax.shard_map` (`UNREDUCED_IN_SHARD_MAP`).
- `jax.lax.all_gather(..., to="invarying")` (`GATHERS_INVARIANT`).
- `Lowered.compile(device_assignment=)` (`COMPILES_ON_DEVICES`).
- flax's `nnx.as_pure` is `nnx.pure` in older flax releases (`plain_values`).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import jax

# From JAX 0.9.1 `jax.shard_map` hands its body an unreduced input as each
# device's partial sum, a plain array, and returns a scalar unreduced. JAX 0.8.1
# to 0.9.0 keep the input's unreduced type inside the body, where element-wise
# rules such as `abs` are missing, and all-reduce an unreduced scalar output.
UNREDUCED_IN_SHARD_MAP = jax.__version_info__ >= (0, 9, 1)

# Flax's fp8 layers inside `coupled_value_and_grad` under a mesh context: measured
# with JAX 0.8.1 (flax 0.12.1), K = 2 on an Auto mesh of 8 devices gives parameter
# gradients off by several units (both of its routes; jax.grad of the same loss is
# right); JAX 0.10.2 gives the large batch's. Releases between were not measured.
FP8_COUPLED_ON_MESHES = jax.__version_info__ >= (0, 10, 0)


def reshard(x: Any, spec: Any) -> Any:
    """`jax.reshard(x, spec)`: `x` (an array or a pytree) with the sharding `spec`."""
    if hasattr(jax, "reshard"):
        return jax.reshard(x, spec)
    return jax.sharding.reshard(x, spec)  # JAX < 0.8.2 only


def partitions(spec: Any) -> tuple[Any, ...]:
    """The per-dimension entries of a `PartitionSpec` (`spec.partitions` from JAX 0.9; the
    spec itself, a tuple, before). Newer specs with unreduced axes refuse to be iterated."""
    found = getattr(spec, "partitions", None)
    return tuple(spec) if found is None else tuple(found)


def pcast_to_varying(x: Any, axes: Any) -> Any:
    """Marks the pytree `x` as varying along the mesh `axes` (a name or a tuple of names).

    Inside `jax.shard_map` only: the values stay as they are, their types change.
    """
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # type: ignore[attr-defined]  # JAX < 0.8.2 only


# `jax.lax.all_gather(..., to="invarying")` types the gathered value invariant
# over the axis (it is the same on every device); releases without `to=` type it
# varying.
GATHERS_INVARIANT = "to" in inspect.signature(jax.lax.all_gather).parameters


# `jax.stages.Lowered.compile(device_assignment=)` compiles a program whose shardings
# name an abstract mesh only (traced arrays typed on an Explicit mesh, no context mesh).
COMPILES_ON_DEVICES = (
    "device_assignment" in inspect.signature(jax.stages.Lowered.compile).parameters
)


def all_gather_invariant(x: Any, axes: Any) -> Any:
    """The pytree `x` gathered along its first axis over the mesh `axes`, typed invariant.

    Inside `jax.shard_map` only, and only where `GATHERS_INVARIANT`.
    """
    return jax.lax.all_gather(x, axes, tiled=True, to="invarying")


def varying_axes(x: Any) -> frozenset:
    """Returns the mesh axes along which `x` varies inside `jax.shard_map` (empty elsewhere).

    `x` is an array, a tracer, or a `jax.ShapeDtypeStruct` from `jax.eval_shape`.
    """
    return aval_varying_axes(x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x))


def aval_varying_axes(aval: Any) -> frozenset:
    """Returns the mesh axes along which an abstract value's type says it varies (a jaxpr
    variable's `aval`, or what `jax.typeof` gives)."""
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def unreduced_axes_in_body(x: Any) -> frozenset:
    """Returns the mesh axes over which `x` is typed unreduced inside `jax.shard_map`.

    Empty outside `jax.shard_map`, with `check_vma=False`, and before JAX 0.10.0.
    """
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(manual, "unreduced", None) or ())


def plain_values(tree: Any) -> Any:
    """Returns `tree` with every `flax.nnx.Variable` in it replaced by its value.

    `flax.nnx.Optimizer.opt_state` holds the optax state with each array wrapped
    in an `OptArray` (an `nnx.Variable`); the helpers that read an optimizer
    state (`optimizer_step`, `current_loss_scale`, ...) call this first, so
    they take that state as well as optax's and return plain arrays. Without
    flax imported no Variable can exist, and `tree` comes back as it is.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return tree
    pure = getattr(nnx, "as_pure", None) or nnx.pure
    return pure(tree)
