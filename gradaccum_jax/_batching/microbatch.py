"""Micro-batched `value_and_grad`: one large batch, K sequential micro-batches, one step.

How it reads: `microbatch_value_and_grad` checks its options once
(`_check_options`); the function it returns splits the batch, evaluates one
micro-batch per iteration of a `jax.lax.scan` (`_micro_step`), and hands each
output (the loss, every gradient leaf, every aux leaf) to its own
`combining.Accumulator`, chosen by the output spec (`combining.output_spec`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import equinox, validation
from gradaccum_jax._batching import (
    combining,
    equinox_modules,
    nnx_modules,
    planning,
    seeding,
    statistics,
)
from gradaccum_jax._batching.splitting import (
    _batch_size,
    _carried,
    _carry_argnums,
    _check_call,
    _check_carry,
    _check_divisible,
    _check_num_microbatches,
    _check_options,
    _check_shards,
    _is_choice,
    _microbatch_inputs,
    _Options,
    _result,
    _split_carry,
    _split_output,
    _with_carry,
)
from gradaccum_jax._sharding import global_view

# --- the micro-batched function -------------------------------------------------


def _whole_batch(
    fun: Callable[..., Any], args: tuple, kwargs: dict, batch_size: int, options: _Options
) -> Any:
    """K = 1: `jax.value_and_grad` itself; only `sum_and_weight` divides."""
    if options.sum_and_weight:

        def normalized(*a: Any, **kw: Any) -> Any:
            value, weight, aux = _split_output(fun(*a, **kw), options)
            return (value / weight, aux) if options.has_aux else value / weight

        value_and_grad = jax.value_and_grad(normalized, options.argnums, has_aux=options.has_aux)
    else:
        value_and_grad = jax.value_and_grad(fun, options.argnums, has_aux=options.has_aux)
    out, grads = value_and_grad(*args, **kwargs)
    if not options.has_aux:
        return out, grads
    value, aux = out
    new_carry, aux = _split_carry(aux, options)
    if options.carry_nums:
        _check_carry(new_carry, _carried(args, options), _carry_argnums(options))
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), aux)
    aux = combining.compose(combining.aux_spec(shapes, batch_size, options)).whole(aux)
    return _result(value, grads, new_carry, aux, options)


def _micro_loss(fun: Callable[..., Any], options: _Options) -> Callable[..., Any]:
    """`fun` on one micro-batch, returning `(value, (weight, new_carry, aux))`."""

    def micro_loss(*args: Any, **kwargs: Any) -> Any:
        value, weight, aux = _split_output(fun(*args, **kwargs), options)
        if options.weight_fn is not None:
            weight = jax.lax.stop_gradient(
                jnp.sum(jnp.asarray(options.weight_fn(*args, **kwargs), jnp.float32))
            )
        if weight is None:
            weight = jnp.float32(1.0)
        new_carry, aux = _split_carry(aux, options)
        return value, (weight, new_carry, aux)

    return micro_loss


def _scan_microbatches(
    fun: Callable[..., Any], k: int, args: tuple, kwargs: dict, options: _Options
) -> Any:
    micro = _batch_size(args, options.batch_nums) // k
    inputs = _microbatch_inputs(args, kwargs, k, options)
    value_and_grad = seeding.value_and_grad(_micro_loss(fun, options), options.argnums)

    def micro_inputs(i: jax.Array, carry: Any) -> tuple[list[Any], dict[str, Any]]:
        micro_args, micro_kwargs = inputs(i)
        if options.carry_nums:
            micro_args = _with_carry(micro_args, carry, options)
        return micro_args, micro_kwargs

    def micro_step(i: jax.Array, carry: Any, seed: jax.Array | None = None) -> Any:
        """Value, weight, new carry, aux and gradients of micro-batch `i`."""
        micro_args, micro_kwargs = micro_inputs(i, carry)
        return value_and_grad(*micro_args, seed, **micro_kwargs)

    carry0 = None
    if options.carry_nums:
        # Strong dtypes, so that the scan carry keeps one type throughout.
        carry0 = jax.tree.map(
            lambda x: jax.lax.convert_element_type(x, jnp.result_type(x)), _carried(args, options)
        )
    shapes = jax.eval_shape(lambda c: micro_step(jnp.int32(0), c), carry0)
    (value_shape, (_, carry_shape, aux_shape)), grad_shape = shapes
    if options.carry_nums:
        _check_carry(carry_shape, carry0, _carry_argnums(options))
        carry0 = jax.tree.map(combining.match_varying, carry0, carry_shape)
    max_mask = seeding.needs_seeds(grad_shape, options)
    accumulator = combining.compose(
        combining.output_spec(value_shape, grad_shape, aux_shape, micro, options, max_mask)
    )
    seeds = None if max_mask is None else seeding.seeds(k, micro_inputs, carry0, options)

    def body(state: Any, i: jax.Array) -> Any:
        carry, totals, weight_sum = state
        seed = None if seeds is None else seeds[i]
        (value, (weight, new_carry, aux)), grads = micro_step(i, carry, seed)
        totals, emitted = accumulator.update(totals, (value, grads, aux), weight, weight > 0)
        if options.carry_nums:
            # Same dtypes, checked above; astype drops a weak type scan would reject.
            new_carry = jax.tree.map(
                lambda n, c: combining.match_varying(n.astype(c.dtype), c), new_carry, carry
            )
        return (new_carry, totals, weight_sum + weight), emitted

    state0 = (carry0, accumulator.init(), jnp.zeros((), jnp.float32))
    (carry, totals, weight_sum), emitted = jax.lax.scan(
        body, state0, jnp.arange(k, dtype=jnp.int32)
    )
    value, grads, aux = accumulator.finalize(totals, emitted, weight_sum)
    return _result(value, grads, carry, aux, options)


def _microbatched(fun: Callable[..., Any], k: int, options: _Options) -> Callable[..., Any]:
    """`fun`'s value and gradient over K micro-batches, as `microbatch_value_and_grad` returns."""

    def value_and_grad(*args: Any, **kwargs: Any) -> Any:
        _check_call(args, kwargs, options)
        batch_size = _batch_size(args, options.batch_nums)
        _check_divisible(batch_size, k)
        if k > 1:
            _check_shards(args, options.batch_nums, batch_size // k)
        loss = fun
        if options.statistics_fn is not None:
            inputs = _microbatch_inputs(args, kwargs, k, options)
            sums = statistics.global_sums(options.statistics_fn, k, inputs, options.axis_name)
            loss = statistics.bind(fun, sums, kwargs)
        if k == 1:
            return _whole_batch(loss, args, kwargs, batch_size, options)
        return _scan_microbatches(loss, k, args, kwargs, options)

    return value_and_grad


def microbatch_value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int | str,
    *,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    weight_fn: Callable[..., Any] | None = None,
    sum_and_weight: bool = False,
    aux_reduction: Any = "auto",
    key_argnums: int | Sequence[int] = (),
    carry_argnums: int | Sequence[int] = (),
    accumulator_dtype: Any = None,
    statistics_fn: Callable[..., Any] | None = None,
    axis_name: Any = None,
    memory_budget: float | None = None,
    max_leaves: Any = "auto",
) -> Callable[..., Any]:
    r"""Returns `jax.value_and_grad(fun)` computed over the batch in sequential micro-batches.

    The batch arguments are split along their leading axis into
    `K = num_microbatches` micro-batches, and a `jax.lax.scan` evaluates the
    value and gradient of `fun` on one micro-batch at a time, adding the
    gradient to an accumulator. Activations therefore live for one micro-batch
    only: peak memory is about that of a batch `K` times smaller plus one
    gradient-sized accumulator, while the optimizer still runs once per (large)
    batch. Call it inside the jitted train step, in place of
    `jax.value_and_grad`.

    The result is the full batch's. For a loss that is a mean over examples,

    $$
    L = \frac{1}{K}\sum_{i=1}^K L_i,\qquad
    \nabla L = \frac{1}{K}\sum_{i=1}^K \nabla L_i .
    $$

    When examples carry weights or masks (padding tokens, a ragged last batch)
    the loss is a weighted mean, and a mean of micro-batch means would be
    wrong. Say where the weights are in one of two ways:

    * `weight_fn`: `fun` returns the micro-batch's weighted mean $L_i$, and
      `weight_fn`, called with the same arguments as `fun`, returns the
      micro-batch's weights (e.g. `lambda params, batch: batch["mask"]`),
      summed to $W_i$. The result is $\sum_i W_i L_i / \sum_i W_i$, and
      micro-batches with $W_i = 0$ are left out (their `0/0` loss does not
      leak NaN).
    * `sum_and_weight=True`: `fun` returns the pair `(S_i, W_i)`, the
      micro-batch's weighted loss sum and weight sum, and the result is
      $\sum_i S_i / \sum_i W_i$ (gradients of $S_i$, the weight taken as a
      constant). With `K = 1` this is `jax.value_and_grad` of `S / W`.

    Either way the result equals the full batch's weighted mean, and it is the
    same whatever the micro-batch sizes in weight.

    Micro-batch `i` holds the examples `i, i + K, i + 2K, …` (a strided
    split). A batch sharded along its leading axis over devices thus gives
    every device its share of every micro-batch, without any communication, as
    long as the micro-batch size `B/K` is a multiple of the number of shards.
    Parameters sharded over the mesh (FSDP) keep their sharding: with explicit
    sharding each gradient, and its running sum, is typed and sharded like its
    parameter.

    As a drop-in for `jax.value_and_grad`:

    * Aux outputs come back as `jax.value_and_grad` on the full batch gives
      them under the default `aux_reduction="auto"`: a leaf whose leading axis
      is the micro-batch size `B/K` is per-example and is concatenated back
      into batch order (shape `(B, ...)`); any other leaf is averaged over the
      micro-batches, weighted like the loss (a mean metric such as accuracy).
      A non-floating leaf that is not per-example (a count) raises a
      `TypeError` asking for a choice. Where the rule guesses wrong (a
      per-class vector whose length happens to equal `B/K`), name the choice
      for that leaf: `aux_reduction={"per_class": "mean", "logits": "auto"}`.
    * Typed PRNG keys (`jax.random.key`) anywhere in the arguments that are
      not batch, carry or differentiated arguments, keyword arguments
      included, reach micro-batch `i` as `jax.random.fold_in(key, i)`, so
      every micro-batch draws its own dropout mask. A raw `uint32` key
      (`jax.random.PRNGKey`) cannot be told apart from integer data, so one
      passed outside `key_argnums` is refused with a `TypeError`: pass a
      typed key, or list its position in `key_argnums`.
    * A `flax.nnx` module at a differentiated position is taken as
      `nnx.value_and_grad` takes it: its `nnx.Param` state is differentiated
      (the gradient is an `nnx.State` of the params), and its other state
      (BatchNorm statistics, the RNG streams' counters) is threaded through
      the micro-batches as a carry and written back into the module, so each
      micro-batch draws its own dropout mask. `weight_fn` then receives the
      params' state in the module's place. Not with `carry_argnums`.
    * An `equinox.Module` at a differentiated position is taken as
      `eqx.filter_value_and_grad` takes it: its floating-point arrays are
      differentiated (the gradient is the module with `None` in the other
      leaves' places), and the rest (activation functions, Python numbers,
      integer arrays) reaches `fun`, `weight_fn` and `statistics_fn` as it came in.
    * Flax fp8 metadata (scales and amax histories, the "gradients" of `flax.linen.fp8_ops`
      layers, also under `nnx.bridge`) come back as on the full batch. See `max_leaves`.

    Args:
      fun: The function to differentiate, `fun(*args, **kwargs)`, returning a
        scalar loss, or `(loss, aux)` with `has_aux`. With `sum_and_weight`
        the loss is the pair `(loss_sum, weight_sum)` (so
        `((loss_sum, weight_sum), aux)` with `has_aux`); with `carry_argnums`
        the aux is `(new_carry, aux)`. Keyword arguments go whole to every
        micro-batch (typed keys among them folded as above).
      num_microbatches: `K`, an int `>= 1` that divides the batch size, or
        `"auto"`: then `gradaccum_jax.plan_microbatches` chooses the smallest
        `K` whose compiled program fits `memory_budget`, when the function is
        first called (traced) with given shapes, and the function behaves
        exactly as with that `K`. `K = 1` calls `jax.value_and_grad` itself
        and returns its result unchanged.
      has_aux: As in `jax.value_and_grad`.
      argnums: As in `jax.value_and_grad`: the position(s) to differentiate
        with respect to (the parameters). Gradients come back in the same form.
      batch_argnums: Position(s) of the batch arguments: pytrees whose leaves
        all have the batch size `B` as leading axis. Everything else is
        passed whole to each micro-batch. Pass the batch by position.
      weight_fn: Optional callable, taking the same arguments as `fun` for a
        micro-batch and returning its per-example weights (any shape; summed)
        or their sum, for a loss that is a weighted mean (see above).
      sum_and_weight: If `True`, `fun` returns `(loss_sum, weight_sum)` in
        place of the loss (see above). Not together with `weight_fn`.
      aux_reduction: How each aux leaf is combined across micro-batches:
        `"auto"` (default; see above), `"mean"` (weighted like the loss,
        floating-point leaves only), `"sum"` (counts; a bool leaf is counted
        as `int32` at every `K`), `"concat"` (per-example outputs with the
        batch axis first, returned in the batch's order) or a callable
        receiving the leaf stacked over micro-batches (leading axis `K`, in
        micro-batch order). Either one choice for all leaves, or a pytree
        prefix of aux with a choice per subtree, e.g.
        `{"acc": "mean", "logits": "concat"}`.
      key_argnums: Position(s) of PRNG key arguments (or pytrees of keys),
        typed or raw `uint32`: micro-batch `i` receives
        `jax.random.fold_in(key, i)`. Typed keys elsewhere need no entry.
      carry_argnums: Position(s) of state threaded through the micro-batches
        in order, such as Flax mutable collections (`batch_stats`). `fun`
        must have `has_aux=True` and return `(loss, (new_carry, aux))`,
        `new_carry` shaped like the carried argument (a tuple of them when
        `carry_argnums` is a sequence); micro-batch `i + 1` receives
        micro-batch `i`'s `new_carry`. The result's aux is
        `(final_carry, reduced_aux)`.
      accumulator_dtype: dtype in which gradients are summed. `None`
        (default) keeps float32 and wider gradients in their dtype and sums
        float16 and bfloat16 gradients in float32. Returned gradients have the
        dtype `jax.value_and_grad` would give.
      statistics_fn: For a loss that needs sums over the whole batch (the
        token count of each expert in MoE load balancing; see the
        global-batch statistics guide). Called like `fun` on each micro-batch
        (same examples and keys), it returns a pytree of sums over that
        micro-batch; a first pass adds them over the micro-batches (and the
        devices of `axis_name`) and `fun(*args, statistics=sums)` is then
        called on every micro-batch. No gradient flows through them. Bool
        leaves are counted and integers summed in int32 (exact below 2**31),
        16-bit floats in float32. Exact up to top-k ties that the two
        compiled passes break differently. Not with `carry_argnums`.
      axis_name: Only with `statistics_fn`, inside `jax.shard_map` or
        `jax.pmap`: the axis (or tuple of axes) over whose devices the
        statistics are summed (`jax.lax.psum`).
      memory_budget: Bytes, only with `num_microbatches="auto"`; `None` there
        means the device's free memory (see
        `gradaccum_jax.plan_microbatches`).
      max_leaves: Gradient leaves taken as their max over micro-batches: `"auto"` (Flax's
        fp8 metadata), `None`, or a callable `(path, leaf) -> bool`. If any, micro-batch
        `i`'s backward is seeded with `1/K` (`W_i / W` with `weight_fn`; not `sum_and_weight`).

    Returns:
      A function with the signature of `fun` returning what
      `jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)` returns:
      `(loss, grads)` or `((loss, aux), grads)`.

    Raises:
      TypeError: If `fun` or `weight_fn` is not callable, `num_microbatches`
        is neither an int nor `"auto"`, an argnums value is not an int or a
        sequence of ints, a key argument holds no keys, or (when called) a raw
        `uint32` key is passed outside `key_argnums`.
      ValueError: If `num_microbatches < 1`, the argnums overlap, options
        conflict, or (when called) a positional argument named by the
        argnums is missing, the batch size is not divisible by
        `num_microbatches` or the batch leaves disagree in size.

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
    options = _check_options(
        fun,
        has_aux=has_aux,
        argnums=argnums,
        batch_argnums=batch_argnums,
        weight_fn=weight_fn,
        sum_and_weight=sum_and_weight,
        aux_reduction=aux_reduction,
        key_argnums=key_argnums,
        carry_argnums=carry_argnums,
        accumulator_dtype=accumulator_dtype,
        statistics_fn=statistics_fn,
        axis_name=axis_name,
        max_leaves=max_leaves,
    )
    k = _check_num_microbatches(num_microbatches, memory_budget)
    plain = _built(fun, k, memory_budget, options)

    def value_and_grad(*args: Any, **kwargs: Any) -> Any:
        with global_view.batch_mesh((args, kwargs)):
            return on_plain_trees(args, kwargs)

    def on_plain_trees(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        equinox_at = equinox.positions(args, options.grad_nums)
        if equinox_at:
            pure_fun, pure_options, pure_args = equinox_modules.split(
                fun, options, equinox_at, args
            )
            return _built(pure_fun, k, memory_budget, pure_options)(*pure_args, **kwargs)
        modules = nnx_modules.module_positions(args, options)
        if not modules:
            return plain(*args, **kwargs)

        def build(pure_fun: Callable[..., Any], pure_options: _Options) -> Callable[..., Any]:
            return _built(pure_fun, k, memory_budget, pure_options)

        return nnx_modules.value_and_grad(fun, options, modules, args, kwargs, build)

    return value_and_grad


def _built(
    fun: Callable[..., Any], k: int | str, memory_budget: Any, options: _Options
) -> Callable[..., Any]:
    """The micro-batched value and gradient of `fun` on plain pytrees."""
    if not isinstance(k, str):
        return _microbatched(fun, k, options)

    def planned(*args: Any, **kwargs: Any) -> Any:
        plan = _plan(fun, args, kwargs, memory_budget, options)
        return _microbatched(fun, plan.num_microbatches, options)(*args, **kwargs)

    return planned


# --- planning K ----------------------------------------------------------------


def _frozen(tree: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_choice)
    return tuple(leaves), treedef


def _plan(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    memory_budget: float | None,
    options: _Options,
) -> planning.MicrobatchPlan:
    cache_key = (
        fun,
        options._replace(
            argnums=_frozen(options.argnums), aux_reduction=_frozen(options.aux_reduction)
        ),
    )
    return planning.plan_batch(
        lambda k: _microbatched(fun, k, options),
        args,
        kwargs,
        options,
        memory_budget=memory_budget,
        cache_key=cache_key,
    )


# The keyword options of microbatch_value_and_grad that a plan passes on.
_PLAN_OPTIONS = {
    name: parameter.default
    for name, parameter in inspect.signature(microbatch_value_and_grad).parameters.items()
    if parameter.kind is parameter.KEYWORD_ONLY and name != "memory_budget"
}


def plan_microbatches(
    fun: Callable[..., Any],
    *args: Any,
    memory_budget: float | None = None,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    **options: Any,
) -> planning.MicrobatchPlan:
    r"""Chooses the number of micro-batches from the compiled program's memory.

    Compiles `microbatch_value_and_grad(fun, K, ...)` for the arguments'
    shapes, for candidate values of `K`, and returns the smallest `K` whose
    program fits `memory_budget`: the fewest sequential micro-batches, hence
    the fastest step that fits. Only shapes, dtypes and shardings of `args`
    are read (arrays or `jax.ShapeDtypeStruct`); nothing runs, so nothing can
    run out of memory.

    The memory of a program is its peak bytes from
    `compiled.memory_analysis()`:

    $$
        \text{peak} = \text{temp} + \text{argument} + \text{output} - \text{alias},
    $$

    the temporaries, the inputs (parameters, batch) and the outputs (loss,
    gradients, aux) of the value-and-gradient program alone. Leave room in
    the budget for what the rest of the train step holds (optimizer state,
    updates), or plan the whole step with your own search.

    The candidates are the divisors of the batch size (with a batch sharded
    over devices with explicit sharding, those that leave a micro-batch size
    divisible by the number of shards). Peak memory falls as `K` grows, so a
    binary search over the $d$ candidates finds the smallest `K` that fits
    with at most $\lceil \log_2(d + 1) \rceil$ compilations; the next smaller
    candidate is always among them, and does not fit. For a batch of 1024
    (11 divisors) that is 3 or 4 compilations. Peaks are cached per function,
    options, argument shapes and `K`, so a second plan (another budget, or
    `num_microbatches="auto"` tracing again) compiles only what is new.

    Args:
      fun: The loss function, as for `microbatch_value_and_grad`.
      *args: Its positional arguments, as arrays or `jax.ShapeDtypeStruct`
        (other values, such as Python flags, are passed as constants).
      memory_budget: Bytes the program may use. `None` takes 90 % of the
        free memory the device reports (`device.memory_stats()`:
        `bytes_limit - bytes_in_use`), the device being that of the first
        array argument, leaving the runtime room beyond the compiled buffers;
        on a device that reports no limit (CPU) it raises a `ValueError`
        asking for `memory_budget=`.
      argnums: As in `microbatch_value_and_grad`.
      batch_argnums: As in `microbatch_value_and_grad`.
      has_aux: As in `microbatch_value_and_grad`.
      **options: Other keyword options of `microbatch_value_and_grad`
        (`weight_fn`, `sum_and_weight`, `aux_reduction`, `key_argnums`,
        `carry_argnums`, `accumulator_dtype`, `statistics_fn`, `axis_name`).
        Keyword arguments of `fun` itself cannot be passed here: bind them
        with `functools.partial`.

    Returns:
      A `MicrobatchPlan`: `num_microbatches`, `microbatch_size`,
      `peak_bytes`, `memory_budget` and the `table` of peak bytes by `K`.

    Raises:
      ValueError: If no candidate `K` fits (the message names the smallest
        peak found and its `K`), `memory_budget` is `None` on a device that
        reports no memory limit, or an option or argument is invalid as for
        `microbatch_value_and_grad`.
      TypeError: For an unknown option, or as for `microbatch_value_and_grad`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> def loss(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w = jax.ShapeDtypeStruct((64, 512), jnp.float32)
      >>> x = jax.ShapeDtypeStruct((2048, 64), jnp.float32)  # 4 MiB of activations
      >>> plan = ga.plan_microbatches(loss, w, x, memory_budget=2 * 2**20)
      >>> plan.num_microbatches > 1, plan.peak_bytes <= 2 * 2**20
      (True, True)
    """
    unknown = sorted(set(options) - set(_PLAN_OPTIONS))
    if unknown:
        raise TypeError(
            f"plan_microbatches got unknown option(s) {unknown}; it takes the keyword "
            f"options of microbatch_value_and_grad: {sorted(_PLAN_OPTIONS)}."
        )
    if memory_budget is not None:
        validation.check_real("memory_budget", memory_budget, minimum=0, exclusive=True)
    checked = _check_options(
        fun,
        **{
            **_PLAN_OPTIONS,
            **options,
            "argnums": argnums,
            "batch_argnums": batch_argnums,
            "has_aux": has_aux,
        },
    )
    return _plan(fun, args, {}, memory_budget, checked)
