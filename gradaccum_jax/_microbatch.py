"""Micro-batched ``value_and_grad``: one large batch, K sequential micro-batches, one step."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _validation, _window

_AUX_REDUCTIONS = ("mean", "sum", "concat")


def _is_index(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _as_index_tuple(name: str, value: Any, *, allow_empty: bool) -> tuple[int, ...]:
    indices = (value,) if _is_index(value) else value
    try:
        indices = tuple(indices)
    except TypeError:
        indices = None
    if indices is None or not all(_is_index(i) for i in indices):
        raise TypeError(
            f"{name} must be a non-negative int or a sequence of them (positions of "
            f"positional arguments); got {name}={value!r}."
        )
    if not indices and not allow_empty:
        raise ValueError(
            f"{name} must name at least one positional argument; got {name}={value!r}."
        )
    if len(set(indices)) != len(indices):
        raise ValueError(f"{name} must not repeat a position; got {name}={value!r}.")
    return tuple(int(i) for i in indices)


def _check_aux_reduction(aux_reduction: Any) -> None:
    choices = jax.tree_util.tree_leaves(
        aux_reduction, is_leaf=lambda x: isinstance(x, str) or callable(x)
    )
    for leaf in choices:
        if callable(leaf) or (isinstance(leaf, str) and leaf in _AUX_REDUCTIONS):
            continue
        raise ValueError(
            f"aux_reduction must be one of {_AUX_REDUCTIONS}, a callable, or a pytree "
            f"prefix of the aux output with those at its leaves; got {leaf!r} in "
            f"aux_reduction={aux_reduction!r}."
        )


def _batch_size(args: tuple[Any, ...], batch_argnums: tuple[int, ...], k: int) -> int:
    sizes = {}
    for j in batch_argnums:
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
            f"the arguments at batch_argnums={batch_argnums} hold no arrays; pass the "
            "batch (arrays with a leading batch axis) at those positions."
        )
    if len(set(sizes.values())) > 1:
        raise ValueError(
            "all leaves of the batch arguments must have the same leading (batch) size; "
            f"got {sizes}."
        )
    batch_size = next(iter(sizes.values()))
    if batch_size % k:
        raise ValueError(
            f"the batch size must be divisible by num_microbatches; got batch size "
            f"{batch_size} and num_microbatches={k} (remainder {batch_size % k}). Use a "
            f"batch size that is a multiple of {k}, or pad the batch and mask the padding "
            "out with weight_fn or sum_and_weight."
        )
    return batch_size


def _check_shards(args: tuple[Any, ...], batch_argnums: tuple[int, ...], micro: int) -> None:
    """Raises unless every micro-batch splits evenly over the batch axis's explicit shards."""
    for j in batch_argnums:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[j]):
            sharding = getattr(jax.typeof(leaf), "sharding", None)
            spec = getattr(sharding, "spec", None)
            if not spec or spec[0] is None:
                continue
            names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
            shards = int(np.prod([sharding.mesh.shape[name] for name in names]))
            if micro % shards:
                raise ValueError(
                    f"the batch axis of argument {j}{jax.tree_util.keystr(path)} is split "
                    f"over {shards} devices ({spec[0]!r}), so each micro-batch must hold a "
                    f"multiple of {shards} examples; got micro-batch size {micro} (batch "
                    "size / num_microbatches). Use fewer micro-batches or a larger batch."
                )


def _varying(x: Any) -> frozenset:
    """Returns the mesh axes along which ``x`` varies inside ``shard_map`` (none outside)."""
    manual = getattr(x, "manual_axis_type", None)
    if manual is None and not isinstance(x, jax.ShapeDtypeStruct):
        manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", None) or ())


def _match_varying(x: jax.Array, like: Any) -> jax.Array:
    # Inside shard_map a scan carry must keep its varying axes from one
    # iteration to the next: widen an initial value to those of its successor.
    missing = _varying(like) - _varying(x)
    return jax.lax.pcast(x, tuple(missing), to="varying") if missing else x


def _zeros(like: jax.ShapeDtypeStruct, dtype: Any) -> jax.Array:
    return _match_varying(jnp.zeros(like.shape, dtype), like)


def _check_carry(new: Any, old: Any, carry_argnums: Any) -> None:
    new_def, old_def = jax.tree_util.tree_structure(new), jax.tree_util.tree_structure(old)
    if new_def != old_def:
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


def _check_key(leaf: Any, path: Any, key_argnums: Any) -> None:
    dtype = jnp.result_type(leaf)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key) or dtype == jnp.uint32:
        return
    raise TypeError(
        f"the arguments at {key_argnums=} must hold PRNG keys (jax.random.key(...) or "
        f"a raw uint32 key from jax.random.PRNGKey(...)); the leaf at "
        f"{jax.tree_util.keystr(path)!r} has dtype {dtype}."
    )


def _leaf_reductions(aux_reduction: Any, aux: Any) -> list[Any]:
    """Broadcasts the reduction spec (a pytree prefix of aux) to one entry per aux leaf."""

    def is_choice(x: Any) -> bool:
        return isinstance(x, str) or callable(x)

    try:
        per_leaf = jax.tree.map(
            lambda r, sub: jax.tree.map(lambda _: r, sub), aux_reduction, aux, is_leaf=is_choice
        )
    except ValueError as err:
        raise ValueError(
            "aux_reduction must be one choice or a pytree prefix of the aux output; "
            f"{aux_reduction=} does not match the aux structure "
            f"{jax.tree_util.tree_structure(aux)}."
        ) from err
    reductions = jax.tree_util.tree_leaves(per_leaf, is_leaf=is_choice)
    for (path, leaf), reduction in zip(
        jax.tree_util.tree_leaves_with_path(aux), reductions, strict=True
    ):
        dtype = jnp.result_type(leaf)
        if isinstance(reduction, str) and reduction == "mean":
            if not jnp.issubdtype(dtype, jnp.inexact):
                raise TypeError(
                    f"aux_reduction 'mean' (the default) needs floating-point leaves; the "
                    f"aux leaf at {jax.tree_util.keystr(path)!r} has dtype {dtype}. Choose "
                    "'sum', 'concat' or a callable for it, e.g. "
                    "aux_reduction={'count': 'sum', 'acc': 'mean'}."
                )
        if isinstance(reduction, str) and reduction == "concat" and jnp.ndim(leaf) == 0:
            raise ValueError(
                f"aux_reduction 'concat' needs a leading batch axis, but the aux leaf at "
                f"{jax.tree_util.keystr(path)!r} is a scalar; use 'mean', 'sum' or a "
                "callable for it."
            )
    return reductions


def _is(reduction: Any, name: str) -> bool:
    return isinstance(reduction, str) and reduction == name


def microbatch_value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    weight_fn: Callable[..., Any] | None = None,
    sum_and_weight: bool = False,
    aux_reduction: Any = "mean",
    key_argnums: int | Sequence[int] = (),
    carry_argnums: int | Sequence[int] = (),
    accumulator_dtype: Any = None,
) -> Callable[..., Any]:
    r"""Returns ``jax.value_and_grad(fun)`` computed over the batch in sequential micro-batches.

    The batch arguments are split along their leading axis into ``K =
    num_microbatches`` micro-batches, and a ``jax.lax.scan`` evaluates the value
    and gradient of ``fun`` on one micro-batch at a time, adding the gradient to
    an accumulator. Activations therefore live for one micro-batch only: peak
    memory is about that of a batch ``K`` times smaller plus one gradient-sized
    accumulator, while the optimizer still runs once per (large) batch. Call it
    inside the jitted train step, in place of ``jax.value_and_grad``.

    The result is the full batch's. For a loss that is a mean over examples,

    .. math::

        L = \frac{1}{K}\sum_{i=1}^K L_i,\qquad
        \nabla L = \frac{1}{K}\sum_{i=1}^K \nabla L_i .

    When examples carry weights or masks (padding tokens, a ragged last batch)
    the loss is a weighted mean, and a mean of micro-batch means would be
    wrong. Say where the weights are in one of two ways:

    * ``weight_fn``: ``fun`` returns the micro-batch's weighted mean ``L_i``,
      and ``weight_fn``, called with the same arguments as ``fun``, returns the
      micro-batch's weights (e.g. ``lambda params, batch: batch["mask"]``),
      summed to ``W_i``. The result is :math:`\sum_i W_i L_i / \sum_i W_i`,
      and micro-batches with ``W_i = 0`` are left out (their ``0/0`` loss
      does not leak NaN).
    * ``sum_and_weight=True``: ``fun`` returns the pair ``(S_i, W_i)``, the
      micro-batch's weighted loss sum and weight sum, and the result is
      :math:`\sum_i S_i / \sum_i W_i` (gradients of ``S_i``, the weight taken
      as a constant). With ``K = 1`` this is ``jax.value_and_grad`` of
      ``S / W``.

    Either way the result equals the full batch's weighted mean, and it is the
    same whatever the micro-batch sizes in weight.

    Micro-batch ``i`` holds the examples ``i, i + K, i + 2K, …`` (a strided
    split). A batch sharded along its leading axis over devices thus gives
    every device its share of every micro-batch, without any communication, as
    long as the micro-batch size ``B/K`` is a multiple of the number of shards.

    Args:
      fun: The function to differentiate, ``fun(*args, **kwargs)``, returning
        a scalar loss, or ``(loss, aux)`` with ``has_aux``. With
        ``sum_and_weight`` the loss is the pair ``(loss_sum, weight_sum)``
        (so ``((loss_sum, weight_sum), aux)`` with ``has_aux``); with
        ``carry_argnums`` the aux is ``(new_carry, aux)``. Keyword arguments
        are passed unchanged to every micro-batch.
      num_microbatches: ``K``, an int ``>= 1``. It must divide the batch size.
        ``K = 1`` calls ``jax.value_and_grad`` itself and returns its result
        unchanged.
      has_aux: As in ``jax.value_and_grad``.
      argnums: As in ``jax.value_and_grad``: the position(s) to differentiate
        with respect to (the parameters). Gradients come back in the same form.
      batch_argnums: Position(s) of the batch arguments: pytrees whose leaves
        all have the batch size ``B`` as leading axis. Everything else is
        passed whole to each micro-batch.
      weight_fn: Optional callable, taking the same arguments as ``fun`` for a
        micro-batch and returning its per-example weights (any shape; summed)
        or their sum, for a loss that is a weighted mean (see above).
      sum_and_weight: If ``True``, ``fun`` returns ``(loss_sum, weight_sum)``
        in place of the loss (see above). Not together with ``weight_fn``.
      aux_reduction: How each aux leaf is combined across micro-batches:
        ``"mean"`` (default; weighted like the loss, for metrics such as
        accuracy; floating-point leaves only), ``"sum"`` (counts),
        ``"concat"`` (per-example outputs with the batch axis first, returned
        in the batch's order) or a callable receiving the leaf stacked over
        micro-batches (leading axis ``K``, in micro-batch order). Either one
        choice for all leaves, or a pytree prefix of aux with a choice per
        subtree, e.g. ``{"acc": "mean", "logits": "concat"}``.
      key_argnums: Position(s) of PRNG key arguments (or pytrees of keys).
        Micro-batch ``i`` receives ``jax.random.fold_in(key, i)``, so dropout
        masks differ between micro-batches.
      carry_argnums: Position(s) of state threaded through the micro-batches
        in order, such as Flax mutable collections (``batch_stats``). ``fun``
        must have ``has_aux=True`` and return ``(loss, (new_carry, aux))``,
        ``new_carry`` shaped like the carried argument (a tuple of them when
        ``carry_argnums`` is a sequence); micro-batch ``i + 1`` receives
        micro-batch ``i``'s ``new_carry``. The result's aux is
        ``(final_carry, reduced_aux)``.
      accumulator_dtype: dtype in which gradients are summed. ``None``
        (default) keeps float32 and wider gradients in their dtype and sums
        float16 and bfloat16 gradients in float32. Returned gradients have the
        dtype ``jax.value_and_grad`` would give.

    Returns:
      A function with the signature of ``fun`` returning what
      ``jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)`` returns:
      ``(loss, grads)`` or ``((loss, aux), grads)``.

    Raises:
      TypeError: If ``fun`` or ``weight_fn`` is not callable, an argnums value
        is not an int or a sequence of ints, or a key argument holds no keys.
      ValueError: If ``num_microbatches < 1``, the argnums overlap, options
        conflict, or (when called) the batch size is not divisible by
        ``num_microbatches`` or the batch leaves disagree in size.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> def loss(w, batch):
      ...     return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
      >>> batch = {"x": jnp.arange(16.0).reshape(8, 2) / 8, "y": jnp.arange(8.0)}
      >>> w = jnp.array([1.0, -1.0])
      >>> value, grad = jax.jit(ga.microbatch_value_and_grad(loss, 4))(w, batch)
      >>> full_value, full_grad = jax.value_and_grad(loss)(w, batch)
      >>> bool(jnp.allclose(value, full_value)), bool(jnp.allclose(grad, full_grad))
      (True, True)

      Weighted (masked) examples, with micro-batches of unequal weight:

      >>> def masked_loss(w, batch):
      ...     err = (batch["x"] @ w - batch["y"]) ** 2
      ...     return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])
      >>> batch["mask"] = jnp.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
      >>> mb = ga.microbatch_value_and_grad(
      ...     masked_loss, 4, weight_fn=lambda w, batch: batch["mask"])
      >>> value, grad = mb(w, batch)
      >>> bool(jnp.allclose(value, masked_loss(w, batch)))
      True

    References:
      Huang et al., *GPipe: Efficient Training of Giant Neural Networks using
      Pipeline Parallelism*, 2019, https://arxiv.org/abs/1811.06965 (micro-batches)

      Goyal et al., *Accurate, Large Minibatch SGD*, 2017,
      https://arxiv.org/abs/1706.02677
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable; got {fun!r} of type {type(fun).__name__}.")
    k = _validation.check_int("num_microbatches", num_microbatches)
    grad_nums = _as_index_tuple("argnums", argnums, allow_empty=False)
    batch_nums = _as_index_tuple("batch_argnums", batch_argnums, allow_empty=False)
    key_nums = _as_index_tuple("key_argnums", key_argnums, allow_empty=True)
    carry_nums = _as_index_tuple("carry_argnums", carry_argnums, allow_empty=True)
    roles = {
        "argnums": grad_nums,
        "batch_argnums": batch_nums,
        "key_argnums": key_nums,
        "carry_argnums": carry_nums,
    }
    seen: dict[int, str] = {}
    for role, nums in roles.items():
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
    if carry_nums and not has_aux:
        raise ValueError(
            f"carry_argnums={carry_argnums!r} needs has_aux=True: fun returns "
            "(loss, (new_carry, aux)), aux may be None."
        )
    _check_aux_reduction(aux_reduction)
    if not has_aux and not (isinstance(aux_reduction, str) and aux_reduction == "mean"):
        raise ValueError(
            f"aux_reduction={aux_reduction!r} is given but has_aux=False; set "
            "has_aux=True or drop aux_reduction."
        )
    _validation.check_accumulator_dtype(accumulator_dtype)
    weighted = weight_fn is not None or sum_and_weight

    def split_output(out: Any) -> tuple[Any, Any, Any]:
        """Returns (value to differentiate, weight or None, aux) of one call of fun."""
        loss, aux = out if has_aux else (out, None)
        if not sum_and_weight:
            return loss, None, aux
        if not (isinstance(loss, tuple | list) and len(loss) == 2):
            raise TypeError(
                "with sum_and_weight=True, fun must return (loss_sum, weight_sum)"
                f"{' and aux' if has_aux else ''}; got {loss!r} as its loss."
            )
        return loss[0], jax.lax.stop_gradient(jnp.asarray(loss[1], jnp.float32)), aux

    def split_carry(aux: Any) -> tuple[Any, Any]:
        if not carry_nums:
            return None, aux
        if not (isinstance(aux, tuple | list) and len(aux) == 2):
            raise TypeError(
                f"with carry_argnums={carry_argnums!r}, fun must return "
                f"(loss, (new_carry, aux)); got aux {aux!r}."
            )
        return aux[0], aux[1]

    def carried(args: Sequence[Any]) -> Any:
        if _is_index(carry_argnums):
            return args[carry_argnums]
        return tuple(args[i] for i in carry_nums)

    def with_carry(args: list[Any], carry: Any) -> list[Any]:
        if _is_index(carry_argnums):
            args[carry_argnums] = carry
        else:
            for i, c in zip(carry_nums, carry, strict=True):
                args[i] = c
        return args

    def check_call(args: tuple[Any, ...]) -> None:
        for role, nums in roles.items():
            for i in nums:
                if i >= len(args):
                    raise ValueError(
                        f"{role} names position {i}, but the function was called with "
                        f"{len(args)} positional argument(s)."
                    )
        for i in key_nums:
            for path, leaf in jax.tree_util.tree_leaves_with_path(args[i]):
                _check_key(leaf, path, key_argnums)

    def single_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # K = 1 is jax.value_and_grad itself; only sum_and_weight divides.
        if sum_and_weight:

            def normalized(*a: Any) -> Any:
                value, weight, aux = split_output(fun(*a, **kwargs))
                return (value / weight, aux) if has_aux else value / weight

            value_and_grad = jax.value_and_grad(normalized, argnums, has_aux=has_aux)
        else:
            value_and_grad = jax.value_and_grad(fun, argnums, has_aux=has_aux)
        out, grads = value_and_grad(*args, **kwargs)
        if not has_aux:
            return out, grads
        value, aux = out
        new_carry, aux = split_carry(aux)
        if carry_nums:
            _check_carry(new_carry, carried(args), carry_argnums)
        leaves, treedef = jax.tree_util.tree_flatten(aux)
        reductions = _leaf_reductions(aux_reduction, aux)
        # A custom reduction sees its usual stacked input, with K = 1.
        leaves = [r(x[None]) if callable(r) else x for r, x in zip(reductions, leaves, strict=True)]
        reduced = jax.tree_util.tree_unflatten(treedef, leaves)
        return (value, (new_carry, reduced) if carry_nums else reduced), grads

    def microbatched(*args: Any, **kwargs: Any) -> Any:
        check_call(args)
        batch_size = _batch_size(args, batch_nums, k)
        if k == 1:
            return single_batch(args, kwargs)
        micro = batch_size // k
        _check_shards(args, batch_nums, micro)
        # (B, ...) -> (B/K, K, ...) is free; micro-batch i is column i, so the
        # sharded leading axis stays the leading axis of every micro-batch.
        columns = {
            j: jax.tree.map(lambda x: x.reshape((micro, k, *x.shape[1:])), args[j])
            for j in batch_nums
        }

        def micro_args(i: jax.Array, carry: Any) -> list[Any]:
            new = list(args)
            for j in batch_nums:
                new[j] = jax.tree.map(
                    lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False),
                    columns[j],
                )
            for j in key_nums:
                new[j] = jax.tree.map(lambda key: jax.random.fold_in(key, i), args[j])
            if carry_nums:
                new = with_carry(new, carry)
            return new

        def inner(*a: Any) -> Any:
            value, weight, aux = split_output(fun(*a, **kwargs))
            if weight_fn is not None:
                weight = jax.lax.stop_gradient(
                    jnp.sum(jnp.asarray(weight_fn(*a, **kwargs), jnp.float32))
                )
            if weight is None:
                weight = jnp.float32(1.0)
            new_carry, aux = split_carry(aux)
            return value, (weight, new_carry, aux)

        value_and_grad = jax.value_and_grad(inner, argnums, has_aux=True)
        carry0 = None
        if carry_nums:
            # Strong dtypes, so that the scan carry keeps one type throughout.
            carry0 = jax.tree.map(
                lambda x: jax.lax.convert_element_type(x, jnp.result_type(x)), carried(args)
            )
        shapes = jax.eval_shape(lambda c: value_and_grad(*micro_args(jnp.int32(0), c)), carry0)
        (value_shape, (weight_shape, carry_shape, aux_shape)), grad_shape = shapes
        if carry_nums:
            _check_carry(carry_shape, carry0, carry_argnums)
            carry0 = jax.tree.map(_match_varying, carry0, carry_shape)
        aux_leaves, aux_def = jax.tree_util.tree_flatten(aux_shape)
        reductions = _leaf_reductions(aux_reduction, aux_shape)
        summed = [n for n, r in enumerate(reductions) if _is(r, "sum") or _is(r, "mean")]
        stacked = [n for n, r in enumerate(reductions) if n not in summed]
        value_dtype = jnp.promote_types(value_shape.dtype, jnp.float32)

        def sum_dtype(n: int) -> Any:
            dtype = aux_leaves[n].dtype
            if _is(reductions[n], "mean"):
                return jnp.promote_types(dtype, jnp.float32)
            # Booleans are counted, as sum would do.
            return jnp.int32 if dtype == jnp.bool_ else dtype

        acc0 = (
            jax.tree.map(
                lambda s: _zeros(s, _window.accumulator_dtype(s, accumulator_dtype)), grad_shape
            ),
            _zeros(value_shape, value_dtype),
            _zeros(weight_shape, jnp.float32),
            [_zeros(aux_leaves[n], sum_dtype(n)) for n in summed],
        )

        def body(state: Any, i: jax.Array) -> Any:
            carry, (acc_grad, acc_value, acc_weight, acc_aux) = state
            (value, (weight, new_carry, aux)), grads = value_and_grad(*micro_args(i, carry))
            keep = weight > 0

            def add(acc: jax.Array, x: Any, scale: jax.Array | None) -> jax.Array:
                term = jnp.asarray(x).astype(acc.dtype)
                if scale is not None:
                    term = term * scale.astype(acc.dtype)
                if not weighted:
                    return acc + term
                # A micro-batch of zero weight (all padding) may hold 0/0 = NaN:
                # select it away, since 0 * NaN would still be NaN.
                return acc + jnp.where(keep, term, jnp.zeros_like(term))

            # With weight_fn, fun returns a weighted mean: scale it by its weight.
            # With sum_and_weight it returns a sum already.
            scale = weight if weight_fn is not None else None
            acc_grad = jax.tree.map(lambda a, g: add(a, g, scale), acc_grad, grads)
            acc_value = add(acc_value, value, scale)
            leaves = jax.tree_util.tree_leaves(aux)
            acc_aux = [
                add(a, leaves[n], weight) if _is(reductions[n], "mean") else a + leaves[n]
                for a, n in zip(acc_aux, summed, strict=True)
            ]
            if carry_nums:
                # Same dtypes, checked above; astype drops a weak type scan would reject.
                new_carry = jax.tree.map(
                    lambda n, c: _match_varying(n.astype(c.dtype), c), new_carry, carry
                )
            new_state = (new_carry, (acc_grad, acc_value, acc_weight + weight, acc_aux))
            return new_state, [leaves[n] for n in stacked]

        (final_carry, totals), stacks = jax.lax.scan(
            body, (carry0, acc0), jnp.arange(k, dtype=jnp.int32)
        )
        acc_grad, acc_value, acc_weight, acc_aux = totals
        grads = jax.tree.map(
            lambda a, s: (a / acc_weight.astype(a.dtype)).astype(s.dtype), acc_grad, grad_shape
        )
        value = (acc_value / acc_weight.astype(value_dtype)).astype(value_shape.dtype)
        if not has_aux:
            return value, grads
        leaves: list[Any] = [None] * len(aux_leaves)
        for n, total in zip(summed, acc_aux, strict=True):
            if _is(reductions[n], "mean"):
                total = total / acc_weight.astype(total.dtype)
            leaves[n] = (
                total if aux_leaves[n].dtype == jnp.bool_ else total.astype(aux_leaves[n].dtype)
            )
        for n, stack in zip(stacked, stacks, strict=True):
            if _is(reductions[n], "concat"):
                # Micro-batch i holds examples i, i + K, ...: interleave them back.
                leaves[n] = jnp.swapaxes(stack, 0, 1).reshape((-1, *stack.shape[2:]))
            else:
                leaves[n] = reductions[n](stack)
        reduced = jax.tree_util.tree_unflatten(aux_def, leaves)
        return (value, (final_carry, reduced) if carry_nums else reduced), grads

    return microbatched
