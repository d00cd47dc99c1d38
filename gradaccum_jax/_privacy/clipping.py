"""Per-example clipping: the sum over a micro-batch of gradients clipped one example at a time.

`clipped_grad(loss_fn, l2_clip_norm)` is the first piece of DP-SGD: it bounds
what any one example can add to a sum. The batch is cut into contiguous
chunks and a `lax.scan` walks them; a chunk whose examples are all padding is
skipped by a `lax.cond`, so a logical batch padded up to a fixed shape pays only
for its real chunks.

Two ways to clip a chunk (`method=`):

* `"fast"` (the default, `fast.py`): one forward and one backward pass over the
  chunk, each example's gradient norm from every layer's inputs and output
  gradients (ghost norms), and the clipped sum by book-keeping; leaves the
  analysis cannot follow get per-example gradients in the same pass;
* `"per_example"`: `vmap` computes every example's whole gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax._base import clip_marks, compat, trees, validation
from gradaccum_jax._privacy import chunks, fast, fsdp, modules
from gradaccum_jax._sharding import compiled_memory, global_view


class ClippedGradFn:
    """The function `clipped_grad` returns: `loss_fn`'s arguments in, clipped sums out.

    Call it as `loss_fn` is called, optionally with `is_padding_example=` (bool,
    shape `(batch,)`). It returns `(loss_sum, grad_sum)`, or `((loss_sum, aux),
    grad_sum)` with `has_aux=True`, where `aux` keeps one entry per example
    (zeros for padding and dropped examples); with `return_grad_norms=True`, each
    example's gradient norm before clipping comes last (`(batch,)`, zero for padding).
    `plan` says how each leaf's norms are found, `plan_memory` which chunk size fits a
    memory budget (the one `microbatch_size="auto"` takes).

    Attributes:
        l2_clip_norm: The bound `C` on each example's gradient norm, a Python
            float: the add/remove (and zero-out) L2 sensitivity of `grad_sum` is
            `C`, twice that for replace-one. A noisy window reads it to check
            that its noise is calibrated to the same `C`.
        loss_fn: The wrapped loss function.
        method: `"fast"` or `"per_example"`.
    """

    def __init__(self, options: _Options):
        self.loss_fn = options.loss_fn
        self.l2_clip_norm = options.clip
        self.method = options.method
        self._options = options

    def __call__(
        self, *args: Any, is_padding_example: jax.typing.ArrayLike | None = None, **kwargs
    ):
        with global_view.batch_mesh((args, kwargs)):
            return self._call(args, kwargs, is_padding_example)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any], is_padding_example: Any):
        found = modules.module_positions(args, self._options.diff)
        _check_wrt(self._options, args, found)
        if not found:
            return _clipped_sums(self._options, args, kwargs, is_padding_example)
        options, split = _split_modules(self._options, args, found)
        out = _clipped_sums(options, split.args, kwargs, is_padding_example)
        # The streams count alike whatever the data: an example of zeros will do (no slice
        # of a batch split over a mesh, and nothing computed from it under jit).
        one = tuple(
            jax.tree.map(lambda x: jnp.zeros((1, *x.shape[1:]), x.dtype), a)
            if i in options.batched
            else a
            for i, a in enumerate(split.args)
        )
        split.finish(one, kwargs)
        return out

    def plan(self, *args: Any, **kwargs: Any) -> fast.ClippingPlan:
        """How each differentiated leaf's per-example norms are found, for these arguments.

        Takes the arguments of a call (arrays, or `jax.ShapeDtypeStruct`s: nothing is
        computed). With `method="per_example"` every leaf is `"per_example"`.

        Returns:
            A `ClippingPlan`: one `LeafPlan` per differentiated leaf (its path, its
            `method` and the primitives where it meets the batch); printed, a table.
        """
        plans: list[fast.ClippingPlan] = []

        def trace(args: tuple[Any, ...]) -> None:
            options = self._options
            positions = modules.module_positions(args, options.diff)
            _check_wrt(options, args, positions)
            if positions:
                options, split = _split_modules(options, args, positions)
                args = split.args
            chunks.batch_size(args, options.batched)
            if options.method == "per_example":
                leaves = jax.tree_util.tree_leaves_with_path([args[i] for i in options.diff])
                per_leaf = [fast.LeafPlan(_path(options, p), "per_example") for p, _ in leaves]
                plans.append(fast.ClippingPlan(per_leaf))
            else:
                plans.append(fast.ClippingPlan(_program(options, args, kwargs).program.leaves))

        with global_view.batch_mesh((args, kwargs)):
            jax.eval_shape(trace, args)
        return plans[0]

    def plan_memory(
        self,
        *args: Any,
        memory_budget: float | None = None,
        is_padding_example: Any = None,
        **kwargs: Any,
    ) -> compiled_memory.MicrobatchPlan:
        """The largest chunk size whose compiled program fits `memory_budget`, for these arguments.

        What `microbatch_size="auto"` chooses when a call with these arguments is traced:
        the program of the call is compiled for candidate chunk sizes (divisors of the
        batch size each device clips) on the arguments' shapes, dtypes and shardings, and
        nothing runs. Takes the arguments of a call, as arrays or `jax.ShapeDtypeStruct`s.
        Called inside `jax.shard_map` or `jax.pmap`, it plans one device's program, as a
        call there does.

        Args:
            *args: The positional arguments of a call.
            memory_budget: Bytes the call may use; `None` takes the budget the function was
                built with, and where it has none, 90 % of the free memory the device
                reports (a `ValueError` on a device that reports none, such as a CPU).
            is_padding_example: As in a call (its shape is part of the program).
            **kwargs: The keyword arguments of a call.

        Returns:
            A `gradaccum_jax.MicrobatchPlan`: `microbatch_size` is the chunk size,
            `num_microbatches` the chunks of each device's batch, `peak_bytes` the chosen
            program's peak (`temp + argument + output - alias` bytes), and `table` the
            peak bytes of every number of chunks compiled.

        Raises:
            ValueError: If `memory_budget` is not finite and positive, or no chunk size
                fits it (the message names the smallest peak found).
        """
        options = self._options
        if memory_budget is not None:
            validation.check_real("memory_budget", memory_budget, minimum=0, exclusive=True)
            options = options._replace(memory_budget=memory_budget)
        with global_view.batch_mesh((args, kwargs)):
            found = modules.module_positions(args, options.diff)
            _check_wrt(options, args, found)
            if found:
                options, split = _split_modules(options, args, found)
                args = split.args
            return _chunk_plan(options, args, kwargs, is_padding_example)

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__name__", repr(self.loss_fn))
        return f"clipped_grad({name}, l2_clip_norm={self.l2_clip_norm!r}, method={self.method!r})"


def clipped_grad(
    loss_fn: Callable[..., Any],
    l2_clip_norm: float,
    *,
    num_microbatches: int | None = None,
    microbatch_size: int | str | None = None,
    memory_budget: float | None = None,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    prng_argnum: int | None = None,
    accumulator_dtype: Any = None,
    method: str = "fast",
    return_grad_norms: bool = False,
    wrt: Any = None,
    remat: str = "auto",
) -> ClippedGradFn:
    r"""The sum of per-example gradients, each clipped to L2 norm `l2_clip_norm`.

    For a batch of `n` examples `x_i`, of which those with
    `is_padding_example[i]` set are padding, the returned function computes

    $$
    \Big(\sum_{i \in R} \ell(\theta; x_i),\
    \sum_{i \in R} g_i \min\big(1, C / \lVert g_i \rVert_2\big)\Big),
    \qquad g_i = \nabla_\theta \ell(\theta; x_i),
    $$

    where `R` holds the real examples whose loss and gradient are finite, and
    $\ell(\theta; x_i)$ is `loss_fn` called on a batch of one (example `i`
    with a leading axis of size 1), so a `loss_fn` written for a batch works
    unchanged. The gradient norm is taken over the whole tree (all `argnums`).

    The sum, not a mean: DP-SGD adds noise to the sum of a whole logical batch
    and divides by a public constant, which is the job of the window that
    receives these sums (`gradaccum_jax.privacy.dp_accumulate`).

    Rules that keep the sensitivity at `C` (each example moves the sum by at
    most `C` in L2 norm, whatever the other examples are):

    * a padding example contributes exactly zero (a select, not a product, so
      even a NaN in its gradient does not leak through);
    * a non-finite example is dropped whole: if its loss or any element of its
      gradient is NaN or infinite (or its squared gradient norm overflows
      float32), its gradient and its loss count as zero and the other examples
      are unaffected. jax_privacy's `nan_safe` rule differs: it zeroes the
      non-finite elements only and keeps the rest of that example's gradient;
      both keep the bound, the whole-example rule does not let a half-broken
      gradient steer the model;
    * the chunks are contiguous (examples `[j m, (j+1) m)` form chunk `j`), and
      a chunk whose examples are all padding is not computed;
    * inside `jax.shard_map` each device clips its own examples: the
      differentiated arguments are cast to vary along the batch's mesh axes,
      since the gradient of a replicated parameter would otherwise be summed
      over the devices (one example of each) before the clipping.

    How each example's norm is found (`method`): by default (`"fast"`) without
    forming any example's whole gradient. One forward pass over a chunk records
    each layer's inputs, one backward pass gives the gradients at its outputs, and
    from the two come each example's norm per layer (a dense layer's
    $\lVert A_i^\top G_i \rVert$ from $A_i A_i^\top$ and $G_i G_i^\top$: ghost
    norms) and the clipped sum $\sum_i c_i A_i^\top G_i$ (book-keeping): about the
    cost of the non-private gradient. The loss is traced once for one example and
    analysed: dense layers, einsums, convolutions, embedding lookups, scales and
    biases, inside `lax.scan` and `jax.checkpoint`, are all found without rewriting
    a layer; a leaf used at several places (a tied embedding) gets its per-example
    gradient from all its uses; a leaf the analysis cannot follow gets per-example
    gradients, in the same pass. `plan` says which leaf takes which path. The
    result is the per-example path's, to float round-off; each example's
    computation, dropout mask included (from its own key), never depends on another
    example. `method="per_example"` computes every example's gradient with `vmap`.

    Args:
        loss_fn: The loss, `loss_fn(*args, **kwargs)` returning a scalar (or
            `(scalar, aux)` with `has_aux=True`); the arguments at
            `batch_argnums` carry the batch on their leading axis.
        l2_clip_norm: `C`, a finite Python float `> 0`. Kept as the returned
            function's `l2_clip_norm` attribute.
        num_microbatches: Chunks to cut the batch into (it must divide the batch
            size). At most one of `num_microbatches` and `microbatch_size`;
            neither computes the whole batch in one `vmap`.
        microbatch_size: Examples per chunk (it must divide the batch size), as
            jax_privacy's `microbatch_size`; or `"auto"`: when a call is traced, the
            largest divisor of the batch size whose compiled program fits
            `memory_budget` (its candidates compiled on the call's shapes, nothing
            run; `plan_memory` returns the plan), and the call is then exactly the
            call with that size. Under global-view `jax.jit` the sizes divide each
            device's shard; inside `jax.shard_map` or `jax.pmap` one device's program
            is planned, compiled over the mapped axes' devices.
        memory_budget: Bytes, only with `microbatch_size="auto"`: the budget of the
            whole call's program (parameters, batch, temporaries and sums, one device's
            under a mesh); leave room for the rest of the train step. `None` takes 90 %
            of the free memory the device reports, as `gradaccum_jax.plan_microbatches`
            does (a `ValueError` on a device that reports none, such as a CPU).
        argnums: Positions of the arguments to differentiate, as in
            `jax.value_and_grad`.
        batch_argnums: Positions of the arguments with a batch axis (default 1:
            `loss_fn(params, batch)`). They must not overlap `argnums`.
        has_aux: Whether `loss_fn` returns `(loss, aux)`. The aux is returned
            per example and is not privatized: treat it as private data.
        prng_argnum: Position of a PRNG key argument (for dropout). The key is
            split into one key per example, `jax.random.split(key, n)[i]` for
            example `i`, as jax_privacy does; give a new key every call.
        accumulator_dtype: The dtype of the sums; `None` sums 16-bit gradients
            in float32 and keeps wider ones. The clip factors are applied in float32
            (or wider) whatever this is.
        method: `"fast"` (the default) or `"per_example"`, see above.
        return_grad_norms: Also return each example's gradient norm before clipping
            (jax_privacy's name), for adaptive clipping or diagnostics: 0 for padding,
            not finite for an example whose gradient is not (it is dropped).
        wrt: For `flax.nnx` modules at `argnums`: which of their state is differentiated
            and clipped, as `nnx.grad`'s filters. `None` is `nnx.Param`; an nnx filter
            (`nnx.LoRAParam`: only the adapters of LoRA layers) applies to every
            module; an `nnx.DiffState(argnum, filter)` (or a tuple of them) to the module
            at `argnum`. Give it the optimizer's `wrt`: each example's norm counts only
            what is selected, and an optimizer (`gradaccum_jax.flax.Optimizer`, or any
            inside `dp_accumulate`) that updates fewer leaves than were clipped refuses them.
        remat: At the layers inside a `jax.checkpoint` (`nn.remat`, `nnx.remat`):
            `"recompute"` keeps remat's memory (norms and sums from the inputs remat
            recomputes, the sums in a second backward pass); `"auto"` (the default)
            too, but in one pass, keeping the per-example gradients, where every such
            layer takes the layer rule with one no larger than its inputs; `"save"`
            keeps their inputs from the forward pass. `plan` says which.

    Returns:
        A `ClippedGradFn`: called like `loss_fn` plus the keyword
        `is_padding_example` (bool, shape `(n,)`, default all False), it returns
        `(loss_sum, grad_sum)` or, with `has_aux`, `((loss_sum, aux), grad_sum)`,
        followed by the norms with `return_grad_norms`. Under global-view `jax.jit`
        each sum is sharded like its param, as `jax.value_and_grad` returns a gradient
        (FSDP: reduce-scattered into the param's shards on an Explicit mesh).

    Raises:
        TypeError: If `loss_fn` is not callable or an argument has the wrong type.
        ValueError: If `l2_clip_norm` is not finite and positive, both chunk
            sizes are given, `memory_budget` is given without `microbatch_size="auto"`
            or is not finite and positive, the positions overlap, or (at trace time)
            the batch arguments disagree in size, the chunks do not divide the batch,
            or no chunk size fits `memory_budget` (the message names the smallest
            peak found).

    Examples:
        >>> import jax.numpy as jnp
        >>> from gradaccum_jax import privacy
        >>> loss = lambda w, x: 0.5 * jnp.mean((x - w) ** 2)
        >>> grad_sum = privacy.clipped_grad(loss, l2_clip_norm=1.0)
        >>> loss_sum, g = grad_sum(0.0, jnp.array([0.5, -3.0, 2.0, 9.0]),
        ...                        is_padding_example=jnp.array([False, False, False, True]))
        >>> float(g)  # -0.5 + 1 (clipped from 3) - 1 (clipped from -2); padding adds 0
        -0.5
        >>> grad_sum.l2_clip_norm
        1.0

        The largest chunk whose program fits a budget of bytes (here 256 KiB, where
        the whole batch at once needs about 1.6 MiB):

        >>> dense = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
        >>> w, x = jnp.zeros((16, 512)), jnp.ones((256, 16))
        >>> planned = privacy.clipped_grad(
        ...     dense, 1.0, microbatch_size="auto", memory_budget=2**18)
        >>> plan = planned.plan_memory(w, x)
        >>> plan.microbatch_size < 256, plan.peak_bytes <= 2**18
        (True, True)

    References:
        Abadi et al., 2016, "Deep Learning with Differential Privacy",
        https://arxiv.org/abs/1607.00133;
        Li et al., 2021, "Large Language Models Can Be Strong Differentially Private
        Learners", https://arxiv.org/abs/2110.05679;
        Bu et al., 2023, "Differentially Private Optimization on Large Model at Small
        Cost", https://arxiv.org/abs/2210.00038
    """
    if getattr(loss_fn, "_gradaccum_pipeline", False):
        raise TypeError(
            "clipped_grad got a pipeline_value_and_grad function: per-example clipping "
            "needs each example's norm summed over every stage before any stage's gradient "
            "is final, which a pipeline schedule does not have yet. Clip the unstaged "
            "model's loss (grad_fn.sequential, under microbatch_size=) instead."
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable; got {loss_fn!r}.")
    clip = validation.check_real("l2_clip_norm", l2_clip_norm, minimum=0.0, exclusive=True)
    chunking = chunks.check_chunking(num_microbatches, microbatch_size, memory_budget)
    diff = validation.check_index_tuple("argnums", argnums, allow_empty=False)
    batched = validation.check_index_tuple("batch_argnums", batch_argnums, allow_empty=False)
    if set(diff) & set(batched):
        raise ValueError(
            f"argnums and batch_argnums must not overlap (a parameter has no batch axis); "
            f"got {argnums=} and {batch_argnums=}."
        )
    if prng_argnum is not None:
        (prng_argnum,) = validation.check_index_tuple("prng_argnum", prng_argnum, allow_empty=False)
        if prng_argnum in diff or prng_argnum in batched:
            raise ValueError(
                f"prng_argnum must be an argument of its own; got {prng_argnum=} with "
                f"{argnums=} and {batch_argnums=}."
            )
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool; got {has_aux=!r}.")
    dtype = validation.check_accumulator_dtype(accumulator_dtype)
    if method not in _METHODS:
        raise ValueError(
            f"method must be one of {', '.join(map(repr, _METHODS))}; got {method=!r}. "
            "\"fast\" finds each example's norm from each layer's inputs and output "
            'gradients; "per_example" computes every example\'s gradient.'
        )
    if not isinstance(return_grad_norms, bool):
        raise TypeError(f"return_grad_norms must be a bool; got {return_grad_norms=!r}.")
    if remat not in _REMAT:
        raise ValueError(
            f"remat must be one of {', '.join(map(repr, _REMAT))}; got {remat=!r} (see "
            "the docstring: auto is the default, recompute spends time, save memory)."
        )
    value_and_grad = jax.value_and_grad(
        loss_fn, argnums=argnums if isinstance(argnums, int) else diff, has_aux=has_aux
    )
    return ClippedGradFn(
        _Options(
            loss_fn=loss_fn,
            value_and_grad=value_and_grad,
            argnums=argnums if isinstance(argnums, int) else diff,
            diff=diff,
            batched=batched,
            prng_argnum=prng_argnum,
            has_aux=has_aux,
            clip=clip,
            dtype=dtype,
            chunking=chunking,
            memory_budget=memory_budget,
            method=method,
            return_grad_norms=return_grad_norms,
            wrt=wrt,
            remat=remat,
        )
    )


_METHODS, _REMAT = ("fast", "per_example"), ("auto", "recompute", "save")


def _check_wrt(options: _Options, args: tuple[Any, ...], found: tuple[int, ...]) -> None:
    if options.wrt is not None and not found:
        kinds = [type(args[i]).__name__ for i in options.diff if i < len(args)]
        raise TypeError(
            f"clipped_grad got wrt={options.wrt!r}, which selects the state of flax.nnx "
            f"modules, but argnums={options.argnums!r} holds none (got {kinds}). For a "
            "pytree of params, pass the trained leaves as the differentiated argument and "
            "the frozen ones as another argument (or close over them)."
        )


def _split_modules(
    options: _Options, args: tuple[Any, ...], found: tuple[int, ...]
) -> tuple[_Options, modules.Split]:
    """The options and arguments of a call whose `flax.nnx` modules are split
    (`modules.py`): their params differentiated, the examples' indices a batch argument."""
    batch_leaf = jax.tree.leaves([args[i] for i in options.batched])[0]
    n = chunks.batch_size(args, options.batched)
    split = modules.split(options.loss_fn, args, found, n, batch_leaf, options.wrt)
    value_and_grad = jax.value_and_grad(
        split.loss_fn, argnums=options.argnums, has_aux=options.has_aux
    )
    batched = (*options.batched, split.index_at)
    return options._replace(
        loss_fn=split.loss_fn, value_and_grad=value_and_grad, batched=batched
    ), split


def _clipped_sums(
    options: _Options, args: tuple[Any, ...], kwargs: dict[str, Any], is_padding_example: Any
) -> Any:
    """A call of a `ClippedGradFn`: the chunks' sums, added over the chunks (and over the
    devices, where a global-view batch is split over Explicit mesh axes)."""
    if options.chunking == chunks.AUTO:
        plan = _chunk_plan(options, args, kwargs, is_padding_example)
        options = options._replace(chunking=("num_microbatches", plan.num_microbatches))
    n = chunks.batch_size(args, options.batched)
    padding = chunks.padding_mask(is_padding_example, n)
    keys = None
    if options.prng_argnum is not None:
        keys = _example_keys(args[options.prng_argnum], n, [args[i] for i in options.batched])
    axes = _explicit_batch_axes(args, options.batched)
    if axes is None:
        loss_sum, grad_sum, aux, norms = _local_sums(options, args, kwargs, padding, keys)
        diff = tuple(args[i] for i in options.diff)
        grad_sum = fsdp.sharded_like_params(
            diff[0] if isinstance(options.argnums, int) else diff, grad_sum
        )
    else:
        loss_sum, grad_sum, aux, norms = _sums_on_each_device(
            options, args, kwargs, padding, keys, axes
        )
    # dp_accumulate, given these leaves in the same trace, checks its noise uses this C.
    clip_marks.mark(grad_sum, options.clip)
    out: tuple[Any, ...] = (loss_sum, grad_sum)
    if options.has_aux:
        out = ((loss_sum, aux), grad_sum)
    return (*out, norms) if options.return_grad_norms else out


def _chunk_plan(
    options: _Options, args: tuple[Any, ...], kwargs: dict[str, Any], is_padding_example: Any
) -> compiled_memory.MicrobatchPlan:
    """The plan of `microbatch_size="auto"` for a call on plain pytrees: the fewest chunks
    of the batch each device clips (its shard under global view) whose sums fit."""
    n = chunks.batch_size(args, options.batched)
    axes = _explicit_batch_axes(args, options.batched)
    if axes is not None:
        n //= math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)

    def build(k: int) -> Callable[..., Any]:
        fixed = options._replace(chunking=("num_microbatches", k))
        return lambda *call: _clipped_sums(fixed, *call)

    # The peaks do not depend on the budget: another budget reuses them.
    key = ("clipped_grad", options._replace(chunking=None, memory_budget=None))
    return chunks.plan_chunks(
        build,
        (args, kwargs, is_padding_example),
        batch_size=n,
        memory_budget=options.memory_budget,
        cache_key=key,
    )


def _example_keys(key: jax.Array, n: int, batch: Any) -> jax.Array:
    """The keys of this device's `n` examples: `jax.random.split(key, N)[i]` for example `i`
    of the whole batch of `N`.

    Inside `jax.shard_map` or `jax.pmap` a device's examples are a slice of a larger
    batch, found as the NNX path finds its examples' indices (`modules.split_axes`):
    the slice of the whole batch's keys at the device's position, so that a device's
    example `i` does not draw device 0's example `i`'s mask. A key that already varies
    along those axes (folded per device by the caller) is split as it is.
    """
    axes = tuple(a for a in modules.split_axes(batch) if a not in compat.varying_axes(key))
    offset, devices = modules.device_position(axes)
    if devices == 1:
        return jax.random.split(key, n)
    return jax.lax.dynamic_slice_in_dim(jax.random.split(key, n * devices), offset * n, n)


def _local_sums(
    options: _Options,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    padding: jax.Array,
    keys: jax.Array | None,
) -> tuple[Any, Any, Any, jax.Array]:
    """`(loss_sum, grad_sum, aux, norms)` of the examples this device sees."""
    n = padding.shape[0]
    # Inside shard_map the scan carry and both branches of the cond must have one type:
    # everything varies along the mesh axes that any input varies along.
    axes = frozenset().union(*map(compat.varying_axes, jax.tree.leaves((args, padding))))

    def vary(tree: Any) -> Any:
        return jax.tree.map(lambda x: _vary(x, axes), tree)

    # The gradient of a replicated (invariant) parameter is summed over the devices by
    # shard_map's transpose rule: each "example" would mix one example of every device,
    # before clipping. Differentiated at a varying copy, each gradient stays local.
    args = tuple(vary(arg) if i in options.diff else arg for i, arg in enumerate(args))
    count = chunks.num_chunks(options.chunking, n, axes)
    mapped = {i: args[i] for i in options.batched}
    if keys is not None and options.prng_argnum is not None:
        mapped[options.prng_argnum] = keys
    if options.method == "per_example":
        per_chunk = _per_example_chunk(options, args, kwargs)
    else:
        per_chunk = _fast_chunk(options, args, kwargs, vary)
    xs = (chunks.chunked(mapped, count), padding.reshape(count, n // count))
    loss_sum, grad_sum, aux, norms = _over_chunks(per_chunk, xs, vary)
    aux = jax.tree.map(lambda a: a.reshape(n, *a.shape[2:]), aux)
    return loss_sum, grad_sum, aux, norms.reshape(n)


def _explicit_batch_axes(args: tuple[Any, ...], batched: tuple[int, ...]) -> tuple | None:
    """The Explicit mesh axes a global-view batch is split over (`None` where it is not).

    Per-example work must not mix devices, and `vmap` and the chunks' reshape do not
    take a batch axis sharded in the type: such a call runs on each device instead.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or jax.sharding.AxisType.Manual in mesh.axis_types:
        return None
    leaves = [(i, p, x) for i in batched for p, x in jax.tree_util.tree_leaves_with_path(args[i])]
    entries = {(global_view.spec_entries(x) or (None,))[0] for _, _, x in leaves}
    if entries == {None}:
        return None
    where = {
        f"argument {i}{jax.tree_util.keystr(p)}": global_view.spec_entries(x) for i, p, x in leaves
    }
    if len(entries) > 1 or any(any(e is not None for e in spec[1:]) for spec in where.values()):
        raise ValueError(
            "clipped_grad under global-view jit takes a batch split over mesh axes on its "
            "leading (example) axis only, every batch argument alike; got the shardings "
            f"{where}. Reshard them alike, e.g. jax.reshard(x, P('data'))."
        )
    (entry,) = entries
    return entry if isinstance(entry, tuple) else (entry,)


def _sums_on_each_device(
    options: _Options,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    padding: jax.Array,
    keys: jax.Array | None,
    axes: tuple[Any, ...],
) -> tuple[Any, Any, Any, jax.Array]:
    """`_local_sums` on each device of the batch's mesh axes, under `jax.shard_map`: the
    loss summed over the devices (replicated), each gradient summed into its param's
    sharding (a reduce-scatter for FSDP), aux and norms split like the batch.

    The params are gathered whole first (each device differentiates its own examples
    at the whole params). Where they are sharded over mesh axes the batch is not (FSDP
    with the batch on `"data"` only), the batch is split over those axes too if they
    divide it, so that no two devices compute the same examples' gradients.
    """
    split = compat.reshard
    diff = [args[i] for i in options.diff]
    split_axes = fsdp.split_axes(axes, diff, padding.shape[0], options.chunking)
    grad_specs = jax.tree.map(lambda p: _P(*global_view.spec_entries(p)), diff)
    grad_specs = grad_specs[0] if isinstance(options.argnums, int) else tuple(grad_specs)
    args = tuple(
        split(a, _P(split_axes))
        if i in options.batched
        else jax.tree.map(lambda x: split(x, _P()), a)
        if i in options.diff
        else a
        for i, a in enumerate(args)
    )
    padding = split(padding, _P(split_axes))
    keys = None if keys is None else split(keys, _P(split_axes))

    def run(*call: Any) -> Any:
        *local, pad, local_keys = call
        loss_sum, grad_sum, aux, norms = _local_sums(options, tuple(local), kwargs, pad, local_keys)
        grad_sum = jax.tree.map(
            lambda g, spec: global_view.sum_into(g, compat.partitions(spec), split_axes),
            grad_sum,
            grad_specs,
            is_leaf=lambda x: isinstance(x, _P),
        )
        return (jax.lax.psum(loss_sum, split_axes), grad_sum), (aux, norms)

    splits = {*options.batched, len(args), len(args) + 1}
    (loss_sum, grad_sum), (aux, norms) = global_view.on_each_device(
        run, split_axes, (*args, padding, keys), splits, split_out=((False, grad_specs), True)
    )
    if split_axes != axes:
        aux, norms = split((aux, norms), _P(axes))
    return loss_sum, grad_sum, aux, norms


_P = jax.sharding.PartitionSpec


def _over_chunks(per_chunk: Callable, xs: Any, vary: Callable) -> Any:
    """`per_chunk` over the chunks of `xs` in a `lax.scan`, all-padding chunks skipped:
    `(loss_sum, grad_sum, aux, norms)`, aux and norms stacked per chunk."""
    # The first chunk itself, not shapes: its type keeps the mesh axes it varies along
    # inside shard_map, which the fast path's replayed primitives check.
    shapes = jax.eval_shape(per_chunk, *jax.tree.map(lambda x: x[0], xs))
    sums = vary(
        (
            jnp.zeros((), shapes[0].dtype),
            jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), shapes[2]),
        )
    )

    def add_chunk(carry: Any, chunk: tuple[Any, jax.Array]) -> Any:
        loss_sum, aux, grad_sum, norms = per_chunk(*chunk)
        total = jax.tree.map(jnp.add, carry, (loss_sum, grad_sum))
        return vary((total, (aux, norms)))

    def skip_chunk(carry: Any, chunk: tuple[Any, jax.Array]) -> Any:
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (shapes[1], shapes[3]))
        return carry, vary(zeros)

    def step(carry: Any, chunk: tuple[Any, jax.Array]) -> Any:
        return jax.lax.cond(jnp.all(chunk[1]), skip_chunk, add_chunk, carry, chunk)

    if jax.tree.leaves(xs)[0].shape[0] == 1:
        # One chunk: no loop. (XLA:CPU compiled a convolution's gradients inside a
        # one-step scan several times slower than outside it.)
        carry, out = step(sums, jax.tree.map(lambda x: x[0], xs))
        (loss_sum, grad_sum), (aux, norms) = carry, jax.tree.map(lambda x: x[None], out)
    else:
        (loss_sum, grad_sum), (aux, norms) = jax.lax.scan(step, sums, xs)
    return loss_sum, grad_sum, aux, norms


def _vary(x: jax.Array, axes: frozenset) -> jax.Array:
    missing = axes - compat.varying_axes(x)
    return compat.pcast_to_varying(x, tuple(sorted(missing))) if missing else x


class _Options(NamedTuple):
    """`clipped_grad`'s arguments, checked."""

    loss_fn: Callable[..., Any]
    value_and_grad: Callable[..., Any]
    argnums: int | tuple[int, ...]
    diff: tuple[int, ...]
    batched: tuple[int, ...]
    prng_argnum: int | None
    has_aux: bool
    clip: float
    dtype: Any
    chunking: chunks.Chunking
    memory_budget: float | None
    method: str
    return_grad_norms: bool
    wrt: Any
    remat: str


def _per_example_chunk(options: _Options, args: tuple[Any, ...], kwargs: dict[str, Any]):
    """The chunk function of `method="per_example"`: `vmap` of each example's gradient."""
    batched = options.batched

    def one_example(example: dict[int, Any], pad: jax.Array) -> Any:
        full = [
            jax.tree.map(lambda x: x[None], example[i]) if i in batched else example.get(i, arg)
            for i, arg in enumerate(args)
        ]
        out, grads = options.value_and_grad(*full, **kwargs)
        loss, aux = out if options.has_aux else (out, ())
        return _clip_example(loss, aux, grads, pad, options.clip)

    def per_chunk(chunk: dict[int, Any], pad: jax.Array) -> Any:
        losses, aux, grads, norms = jax.vmap(one_example)(chunk, pad)
        loss_sum = jnp.sum(losses, dtype=jnp.promote_types(losses.dtype, jnp.float32))
        grad_sum = jax.tree.map(
            lambda g: jnp.sum(g, 0, dtype=trees.accumulator_dtype(g, options.dtype)), grads
        )
        return loss_sum, aux, grad_sum, norms

    return per_chunk


class _Traced(NamedTuple):
    """The loss traced for one example, and the structure of its aux."""

    program: fast.Program
    aux_tree: Any


def _program(options: _Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Traced:
    """Traces `loss_fn` for one example (a batch of one) and analyses it (`fast.Program`).

    The program's inputs are the differentiated leaves, the batch arguments' leaves
    (shape `(1, ...)`) and the example's key; everything else is closed over.
    """
    diff_leaves, diff_tree = jax.tree.flatten([args[i] for i in options.diff])
    batch_leaves, batch_tree = jax.tree.flatten([args[i] for i in options.batched])
    n_diff, n_batch = len(diff_leaves), len(batch_leaves)
    aux_tree: list[Any] = [None]

    def example(*flat: Any) -> list[Any]:
        full = list(args)
        for i, x in zip(options.diff, jax.tree.unflatten(diff_tree, flat[:n_diff]), strict=True):
            full[i] = x
        batch = jax.tree.unflatten(batch_tree, flat[n_diff : n_diff + n_batch])
        for i, x in zip(options.batched, batch, strict=True):
            full[i] = x
        if options.prng_argnum is not None:
            full[options.prng_argnum] = flat[-1]
        out = options.loss_fn(*full, **kwargs)
        loss, aux = out if options.has_aux else (out, ())
        aux_leaves, aux_tree[0] = jax.tree.flatten(aux)
        return [loss, *aux_leaves]

    # One example's slice, in the caller's trace (dead code there): its type, including
    # the mesh axes it varies along inside shard_map, is what the program is traced at.
    inputs = [*diff_leaves, *(x[:1] for x in batch_leaves)]
    if options.prng_argnum is not None:
        inputs.append(jax.random.split(args[options.prng_argnum], 1)[0])
    closed = jax.make_jaxpr(example)(*inputs)
    kinds = [fast.DERIVED] * n_diff + [fast.BATCHED] * (len(inputs) - n_diff)
    leaf_of = [*range(n_diff), *([None] * (len(inputs) - n_diff))]
    diff_paths = jax.tree_util.tree_leaves_with_path([args[i] for i in options.diff])
    paths = [_path(options, p) for p, _ in diff_paths]
    layout = fast.Layout(tuple(kinds), tuple(leaf_of), n_diff)
    program = fast.Program(closed, layout, paths, remat=options.remat)
    return _Traced(program, aux_tree[0])


def _path(options: _Options, path: tuple[Any, ...]) -> str:
    """A leaf's path as the user wrote it: `argnums` int -> inside that argument;
    a tuple -> `[k]` for the k-th differentiated argument first."""
    if isinstance(options.argnums, int):
        path = path[1:]
    return jax.tree_util.keystr(path) or "<the argument itself>"


def _fast_chunk(options: _Options, args: tuple[Any, ...], kwargs: dict[str, Any], vary: Callable):
    """The chunk function of the fast path (`fast.py`): norms from each layer's inputs
    and output gradients, sums by book-keeping."""
    program = _program(options, args, kwargs)
    diff_leaves, diff_tree = jax.tree.flatten([args[i] for i in options.diff])
    acc_dtypes = [trees.accumulator_dtype(x, options.dtype) for x in diff_leaves]

    def per_chunk(chunk: dict[int, Any], pad: jax.Array) -> Any:
        example_leaves = jax.tree.leaves(
            [jax.tree.map(lambda x: x[:, None], chunk[i]) for i in options.batched]
        )
        keys = [chunk[options.prng_argnum]] if options.prng_argnum is not None else []
        inputs = [*diff_leaves, *example_leaves, *keys]
        result = fast.run(program.program, inputs, pad, options.clip, acc_dtypes, vary)
        grads = jax.tree.unflatten(diff_tree, result.grads)
        grads = grads[0] if isinstance(options.argnums, int) else tuple(grads)
        aux = jax.tree.unflatten(program.aux_tree, result.aux) if options.has_aux else ()
        return result.loss_sum, aux, grads, result.norms

    return per_chunk


def _clip_example(loss: jax.Array, aux: Any, grads: Any, pad: jax.Array, clip: float) -> Any:
    """One example's `(loss, aux, clipped gradient, gradient norm)`; the loss, aux and
    gradient are zero if it is padding or not finite, the norm is zero for padding."""
    # float32 at least: a 16-bit sum of squares overflows at gradients of ~256, and a
    # 16-bit clip factor can leave a clipped example above the clip norm.
    grads = jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), grads)
    squares = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
    keep = ~pad & jnp.isfinite(squares) & jnp.isfinite(loss)
    norm = jnp.sqrt(squares)
    # min(1, C/0) = 1: a zero gradient stays zero.
    scale = jnp.minimum(1.0, clip / norm)

    def kept(x: jax.Array) -> jax.Array:
        # A select, not a product: NaN or inf in a dropped example does not leak through.
        return jnp.where(keep, x, jnp.zeros_like(x))

    grads = jax.tree.map(lambda g: kept(g * scale.astype(g.dtype)), grads)
    return kept(loss), jax.tree.map(kept, aux), grads, jnp.where(pad, 0.0, norm)
