"""The options and call checks of `microbatch_value_and_grad`, and how a call is split.

Option checks (`_check_options`), the checks of a call's batch and carry,
splitting what `fun` returns into value, aux and carry, and the random keys
folded per micro-batch. `gradaccum_jax._batching.microbatch` builds the
micro-batched function on these.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax._base import reduce_rules, validation
from gradaccum_jax._batching import statistics

_AUX_REDUCTIONS = ("auto", "mean", "sum", "concat")


class _Options(NamedTuple):
    """The checked options of one `microbatch_value_and_grad`."""

    has_aux: bool
    argnums: int | tuple[int, ...]  # as given: jax.value_and_grad's result follows its form
    grad_nums: tuple[int, ...]
    batch_nums: tuple[int, ...]
    key_nums: tuple[int, ...]
    carry_nums: tuple[int, ...]
    carry_is_tuple: bool  # carry_argnums was a sequence: the carry is a tuple of arguments
    weight_fn: Callable[..., Any] | None
    sum_and_weight: bool
    aux_reduction: Any
    accumulator_dtype: Any
    statistics_fn: Callable[..., Any] | None = None
    axis_name: tuple[Any, ...] | None = None  # the devices statistics_fn's sums run over
    max_leaves: Any = "auto"  # gradient leaves combined by max (see _base/reduce_rules.py)

    @property
    def weighted(self) -> bool:
        return self.weight_fn is not None or self.sum_and_weight

    @property
    def roles(self) -> dict[str, tuple[int, ...]]:
        return {
            "argnums": self.grad_nums,
            "batch_argnums": self.batch_nums,
            "key_argnums": self.key_nums,
            "carry_argnums": self.carry_nums,
        }


def _is_choice(x: Any) -> bool:
    return isinstance(x, str) or callable(x)


def _check_options(
    fun: Any,
    *,
    has_aux: Any,
    argnums: Any,
    batch_argnums: Any,
    weight_fn: Any,
    sum_and_weight: Any,
    aux_reduction: Any,
    key_argnums: Any,
    carry_argnums: Any,
    accumulator_dtype: Any,
    statistics_fn: Any = None,
    axis_name: Any = None,
    max_leaves: Any = "auto",
) -> _Options:
    if not callable(fun):
        raise TypeError(f"fun must be callable; got {fun!r} of type {type(fun).__name__}.")
    options = _Options(
        has_aux=has_aux,
        argnums=argnums,
        grad_nums=validation.check_index_tuple("argnums", argnums, allow_empty=False),
        batch_nums=validation.check_index_tuple("batch_argnums", batch_argnums, allow_empty=False),
        key_nums=validation.check_index_tuple("key_argnums", key_argnums, allow_empty=True),
        carry_nums=validation.check_index_tuple("carry_argnums", carry_argnums, allow_empty=True),
        carry_is_tuple=not isinstance(carry_argnums, numbers.Integral),
        weight_fn=weight_fn,
        sum_and_weight=sum_and_weight,
        aux_reduction=aux_reduction,
        accumulator_dtype=accumulator_dtype,
        max_leaves=reduce_rules.check_max_leaves(max_leaves),
    )
    options = options._replace(
        statistics_fn=statistics_fn,
        axis_name=statistics.check_options(
            statistics_fn, axis_name, options.carry_nums, carry_argnums
        ),
    )
    seen: dict[int, str] = {}
    for role, nums in options.roles.items():
        for i in nums:
            if i in seen:
                raise ValueError(
                    f"position {i} is in both {seen[i]} and {role}; each positional "
                    f"argument has one role. Got argnums={argnums!r}, "
                    f"batch_argnums={batch_argnums!r}, key_argnums={key_argnums!r}, "
                    f"carry_argnums={carry_argnums!r}."
                )
            seen[i] = role
    if weight_fn is not None and not callable(weight_fn):
        raise TypeError(f"weight_fn must be callable or None; got {weight_fn=}.")
    if weight_fn is not None and sum_and_weight:
        raise ValueError(
            "weight_fn and sum_and_weight=True are two ways to give the weights; use one. "
            f"Got {weight_fn=} and {sum_and_weight=}."
        )
    if options.carry_nums and not has_aux:
        raise ValueError(
            f"carry_argnums={carry_argnums!r} needs has_aux=True: fun returns "
            "(loss, (new_carry, aux)), aux may be None."
        )
    for leaf in jax.tree_util.tree_leaves(aux_reduction, is_leaf=_is_choice):
        if not (callable(leaf) or (isinstance(leaf, str) and leaf in _AUX_REDUCTIONS)):
            raise ValueError(
                f"aux_reduction must be one of {_AUX_REDUCTIONS}, a callable, or a pytree "
                f"prefix of the aux output with those at its leaves; got {leaf!r} in "
                f"aux_reduction={aux_reduction!r}."
            )
    if not has_aux and not (isinstance(aux_reduction, str) and aux_reduction == "auto"):
        raise ValueError(
            f"aux_reduction={aux_reduction!r} is given but has_aux=False; set "
            "has_aux=True or drop aux_reduction."
        )
    validation.check_accumulator_dtype(accumulator_dtype)
    return options


def _check_num_microbatches(num_microbatches: Any, memory_budget: Any) -> int | str:
    """Returns K, or `"auto"`; raises naming the fix otherwise."""
    if isinstance(num_microbatches, str) and num_microbatches == "auto":
        if memory_budget is not None:
            validation.check_real("memory_budget", memory_budget, minimum=0, exclusive=True)
        return "auto"
    if memory_budget is not None:
        raise ValueError(
            f"memory_budget is used to choose K, but {num_microbatches=!r} is given; pass "
            "num_microbatches='auto' with memory_budget, or drop memory_budget."
        )
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, numbers.Integral):
        raise TypeError(
            f"num_microbatches must be a Python int >= 1 or 'auto'; got "
            f"{num_microbatches=!r} of type {type(num_microbatches).__name__}. Pass an int "
            "such as num_microbatches=4, or num_microbatches='auto' with memory_budget= "
            "(bytes) to plan K from the compiled program."
        )
    return validation.check_int("num_microbatches", num_microbatches, minimum=1)


@functools.cache
def _raw_key_shape() -> tuple[int, ...]:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def _is_typed_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _looks_like_raw_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype == jnp.uint32 and tuple(getattr(x, "shape", ())) == _raw_key_shape()


def _passed_whole(args: Sequence[Any], kwargs: dict[str, Any], options: _Options) -> list[Any]:
    """(where, value) of every argument that reaches each micro-batch unchanged but for keys."""
    taken = {i for nums in options.roles.values() for i in nums}
    return [(f"argument {i}", a) for i, a in enumerate(args) if i not in taken] + [
        (f"keyword argument {name!r}", v) for name, v in kwargs.items()
    ]


def _check_call(args: tuple[Any, ...], kwargs: dict[str, Any], options: _Options) -> None:
    for role, nums in options.roles.items():
        for i in nums:
            if i >= len(args):
                passed = f" and keyword argument(s) {sorted(kwargs)}" if kwargs else ""
                raise ValueError(
                    f"{role} names position {i}, but the function was called with "
                    f"{len(args)} positional argument(s){passed}. Pass it by position, "
                    "e.g. grad_fn(params, batch) rather than grad_fn(params, batch=batch): "
                    "keyword arguments go whole to every micro-batch."
                )
    for i in options.key_nums:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[i]):
            dtype = jnp.result_type(leaf)
            if not (jnp.issubdtype(dtype, jax.dtypes.prng_key) or dtype == jnp.uint32):
                raise TypeError(
                    f"the arguments at key_argnums={options.key_nums} must hold PRNG keys "
                    "(jax.random.key(...) or a raw uint32 key from jax.random.PRNGKey(...)); "
                    f"the leaf at {jax.tree_util.keystr(path)!r} has dtype {dtype}."
                )
    for where, value in _passed_whole(args, kwargs, options):
        for path, leaf in jax.tree_util.tree_leaves_with_path(value):
            if _looks_like_raw_key(leaf):
                raise TypeError(
                    f"{where}{jax.tree_util.keystr(path)} is a uint32{list(leaf.shape)} "
                    "array, a raw PRNG key (jax.random.PRNGKey): every micro-batch would "
                    "draw the same random numbers (the same dropout mask). Pass a typed key "
                    "from jax.random.key(...), which each micro-batch receives folded with "
                    "its index, or list its position in key_argnums. If it is data, not a "
                    "key, pass it with another dtype."
                )


def _batch_size(args: tuple[Any, ...], batch_nums: tuple[int, ...]) -> int:
    sizes = {}
    for j in batch_nums:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[j]):
            where = f"argument {j}{jax.tree_util.keystr(path)}"
            if jnp.ndim(leaf) == 0:
                raise ValueError(
                    f"every leaf of a batch argument needs a leading batch axis; {where} "
                    f"is a scalar. Pass per-batch constants through a position that is "
                    f"not in batch_argnums."
                )
            sizes[where] = jnp.shape(leaf)[0]
    if not sizes:
        raise ValueError(
            f"the arguments at batch_argnums={batch_nums} hold no arrays; pass the "
            "batch (arrays with a leading batch axis) at those positions."
        )
    if len(set(sizes.values())) > 1:
        raise ValueError(
            "all leaves of the batch arguments must have the same leading (batch) size; "
            f"got {sizes}."
        )
    return next(iter(sizes.values()))


def _microbatch_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], k: int, options: _Options
) -> Callable[[jax.Array], tuple[list[Any], dict[str, Any]]]:
    """`inputs(i)`: micro-batch `i`'s arguments and keyword arguments (`k = 1`: the call's own).

    Micro-batch `i` holds the batch's examples `i, i + K, ...`; its keys are
    folded with `i` (see `microbatch_value_and_grad`).
    """
    if k == 1:
        return lambda i: (list(args), kwargs)
    micro = _batch_size(args, options.batch_nums) // k
    # (B, ...) -> (B/K, K, ...) moves no data; micro-batch i is column i, so a
    # sharded leading axis stays the leading axis of every micro-batch.
    # (optax.microbatching.reshape_batch_axis makes the same split, but its
    # column-major reshape copies the whole batch.)
    columns = {
        j: jax.tree.map(lambda x: x.reshape((micro, k, *x.shape[1:])), args[j])
        for j in options.batch_nums
    }
    whole = {i for i, _ in enumerate(args)} - {n for nums in options.roles.values() for n in nums}

    def inputs(i: jax.Array) -> tuple[list[Any], dict[str, Any]]:
        micro_args = list(args)
        for j, column in columns.items():
            micro_args[j] = jax.tree.map(
                lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False), column
            )
        for j in options.key_nums:
            micro_args[j] = _fold_keys(args[j], i, typed_only=False)
        for j in whole:
            micro_args[j] = _fold_keys(args[j], i, typed_only=True)
        return micro_args, _fold_keys(kwargs, i, typed_only=True)

    return inputs


PAD_WITH_WEIGHTS = "mask the padding out with weight_fn or sum_and_weight"


def _check_divisible(batch_size: int, k: int, padding: str = PAD_WITH_WEIGHTS) -> None:
    """Raises unless `k` divides the batch; `padding` says how padded examples are left out."""
    if batch_size % k:
        raise ValueError(
            f"the batch size must be divisible by num_microbatches; got batch size "
            f"{batch_size} and num_microbatches={k} (remainder {batch_size % k}). Use a "
            f"batch size that is a multiple of {k}, or pad the batch and {padding}."
        )


def _explicit_shards(leaf: Any) -> tuple[int, Any]:
    """(number of devices, spec entry) over which the leading axis is explicitly sharded."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
    else:
        sharding = getattr(jax.typeof(leaf), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not spec or spec[0] is None:
        return 1, None
    names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    axis_types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True))
    explicit = [n for n in names if axis_types[n] == jax.sharding.AxisType.Explicit]
    return int(np.prod([sharding.mesh.shape[n] for n in explicit])), spec[0]


def _check_shards(args: tuple[Any, ...], batch_nums: tuple[int, ...], micro: int) -> None:
    """Raises unless every micro-batch splits evenly over the batch axis's explicit shards."""
    for j in batch_nums:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[j]):
            shards, entry = _explicit_shards(leaf)
            if micro % shards:
                raise ValueError(
                    f"the batch axis of argument {j}{jax.tree_util.keystr(path)} is split "
                    f"over {shards} devices ({entry!r}), so each micro-batch must hold a "
                    f"multiple of {shards} examples; got micro-batch size {micro} (batch "
                    "size / num_microbatches). Use fewer micro-batches or a larger batch."
                )


def _check_carry(new: Any, old: Any, carry_argnums: Any) -> None:
    new_def, old_def = jax.tree_util.tree_structure(new), jax.tree_util.tree_structure(old)
    if new_def != old_def:  # type: ignore[operator]  # jaxlib's PyTreeDef stub
        raise ValueError(
            "with carry_argnums, fun must return (loss, (new_carry, aux)) where new_carry "
            f"has the structure of the argument(s) at {carry_argnums=}; got {new_def}, "
            f"expected {old_def}."
        )
    pairs = zip(
        jax.tree_util.tree_leaves_with_path(new), jax.tree_util.tree_leaves(old), strict=True
    )
    for (path, n), o in pairs:
        if jnp.shape(n) != jnp.shape(o) or jnp.result_type(n) != jnp.result_type(o):
            raise ValueError(
                f"the new carry leaf {jax.tree_util.keystr(path)!r} is "
                f"{jnp.result_type(n)}{list(jnp.shape(n))}, but the argument at "
                f"{carry_argnums=} holds {jnp.result_type(o)}{list(jnp.shape(o))} there; "
                "the carried state must keep its shapes and dtypes."
            )


def _split_output(out: Any, options: _Options) -> tuple[Any, Any, Any]:
    """Returns (value to differentiate, weight or None, aux) of one call of fun."""
    loss, aux = out if options.has_aux else (out, None)
    if not options.sum_and_weight:
        return loss, None, aux
    if not (isinstance(loss, tuple | list) and len(loss) == 2):
        raise TypeError(
            "with sum_and_weight=True, fun must return (loss_sum, weight_sum)"
            f"{' and aux' if options.has_aux else ''}; got {loss!r} as its loss."
        )
    return loss[0], jax.lax.stop_gradient(jnp.asarray(loss[1], jnp.float32)), aux


def _split_carry(aux: Any, options: _Options) -> tuple[Any, Any]:
    if not options.carry_nums:
        return None, aux
    if not (isinstance(aux, tuple | list) and len(aux) == 2):
        raise TypeError(
            f"with carry_argnums={_carry_argnums(options)!r}, fun must return "
            f"(loss, (new_carry, aux)); got aux {aux!r}."
        )
    return aux[0], aux[1]


def _carry_argnums(options: _Options) -> Any:
    return options.carry_nums if options.carry_is_tuple else options.carry_nums[0]


def _carried(args: Sequence[Any], options: _Options) -> Any:
    if not options.carry_is_tuple:
        return args[options.carry_nums[0]]
    return tuple(args[i] for i in options.carry_nums)


def _with_carry(args: list[Any], carry: Any, options: _Options) -> list[Any]:
    carries = carry if options.carry_is_tuple else (carry,)
    for i, c in zip(options.carry_nums, carries, strict=True):
        args[i] = c
    return args


def _result(value: Any, grads: Any, carry: Any, aux: Any, options: _Options) -> Any:
    if not options.has_aux:
        return value, grads
    return (value, (carry, aux) if options.carry_nums else aux), grads


def _fold_in(key: jax.Array, i: jax.Array) -> jax.Array:
    """`jax.random.fold_in` for a key or an array of keys (raw ones: key data last)."""
    single = () if _is_typed_key(key) else _raw_key_shape()
    if key.ndim == len(single):
        return jax.random.fold_in(key, i)
    flat = key.reshape((-1, *single))
    return jax.vmap(lambda one: jax.random.fold_in(one, i))(flat).reshape(key.shape)


def _fold_keys(tree: Any, i: jax.Array, *, typed_only: bool) -> Any:
    def fold(x: Any) -> Any:
        return _fold_in(x, i) if _is_typed_key(x) or not typed_only else x

    return jax.tree.map(fold, tree)


def fold_argument_keys(
    args: tuple[Any, ...], kwargs: dict[str, Any], index: jax.Array, options: _Options
) -> tuple[list[Any], dict[str, Any]]:
    """The arguments with their keys folded with `index`: those at `key_argnums`, raw
    or typed, and the typed keys among the arguments passed whole."""
    taken = {n for nums in options.roles.values() for n in nums}
    folded = list(args)
    for j, arg in enumerate(args):
        if j in options.key_nums or j not in taken:
            folded[j] = _fold_keys(arg, index, typed_only=j not in options.key_nums)
    return folded, _fold_keys(kwargs, index, typed_only=True)
