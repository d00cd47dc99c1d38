"""Per-example clipping: the sum over a micro-batch of gradients clipped one example at a time.

`clipped_grad(loss_fn, l2_clip_norm)` is the first piece of DP-SGD: it bounds
what any one example can add to a sum. The batch is cut into contiguous
chunks; a `lax.scan` walks the chunks and `vmap` computes the examples of a
chunk side by side, so the per-example gradients of only one chunk exist at a
time. A chunk whose examples are all padding is skipped by a `lax.cond`: a
logical batch padded up to a fixed shape pays only for its real chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._base import compat, trees, validation
from gradaccum_jax._privacy.window import mark_clip_norm


class ClippedGradFn:
    """The function `clipped_grad` returns: `loss_fn`'s arguments in, clipped sums out.

    Call it as `loss_fn` is called, optionally with `is_padding_example=` (bool,
    shape `(batch,)`). It returns `(loss_sum, grad_sum)`, or `((loss_sum, aux),
    grad_sum)` with `has_aux=True`, where `aux` keeps one entry per example
    (zeros for padding and dropped examples).

    Attributes:
        l2_clip_norm: The bound `C` on each example's gradient norm, a Python
            float: the add/remove (and zero-out) L2 sensitivity of `grad_sum` is
            `C`, twice that for replace-one. A noisy window reads it to check
            that its noise is calibrated to the same `C`.
        loss_fn: The wrapped loss function.
    """

    def __init__(self, loss_fn: Callable[..., Any], l2_clip_norm: float, call: Callable[..., Any]):
        self.loss_fn = loss_fn
        self.l2_clip_norm = l2_clip_norm
        self._call = call

    def __call__(
        self, *args: Any, is_padding_example: jax.typing.ArrayLike | None = None, **kwargs
    ):
        return self._call(args, kwargs, is_padding_example)

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__name__", repr(self.loss_fn))
        return f"clipped_grad({name}, l2_clip_norm={self.l2_clip_norm!r})"


def clipped_grad(
    loss_fn: Callable[..., Any],
    l2_clip_norm: float,
    *,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    prng_argnum: int | None = None,
    accumulator_dtype: Any = None,
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
            jax_privacy's `microbatch_size`.
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
            in float32 and keeps wider ones.

    Returns:
        A `ClippedGradFn`: called like `loss_fn` plus the keyword
        `is_padding_example` (bool, shape `(n,)`, default all False), it returns
        `(loss_sum, grad_sum)` or, with `has_aux`, `((loss_sum, aux), grad_sum)`.

    Raises:
        TypeError: If `loss_fn` is not callable or an argument has the wrong type.
        ValueError: If `l2_clip_norm` is not finite and positive, both chunk
            sizes are given, the positions overlap, or (at trace time) the batch
            arguments disagree in size or the chunks do not divide the batch.

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

    References:
        Abadi et al., 2016, "Deep Learning with Differential Privacy",
        https://arxiv.org/abs/1607.00133
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable; got {loss_fn!r}.")
    clip = validation.check_real("l2_clip_norm", l2_clip_norm, minimum=0.0, exclusive=True)
    if num_microbatches is not None and microbatch_size is not None:
        raise ValueError(
            "Give at most one of num_microbatches and microbatch_size; got "
            f"{num_microbatches=} and {microbatch_size=}."
        )
    chunking = None
    if num_microbatches is not None:
        chunking = ("num_microbatches", validation.check_int("num_microbatches", num_microbatches))
    elif microbatch_size is not None:
        chunking = ("microbatch_size", validation.check_int("microbatch_size", microbatch_size))
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
    value_and_grad = jax.value_and_grad(
        loss_fn, argnums=argnums if isinstance(argnums, int) else diff, has_aux=has_aux
    )

    def call(args: tuple[Any, ...], kwargs: dict[str, Any], is_padding_example: Any) -> Any:
        n = _batch_size(args, batched)
        padding = _padding_mask(is_padding_example, n)
        # Inside shard_map the scan carry and both branches of the cond must have one type:
        # everything varies along the mesh axes that any input varies along.
        axes = frozenset().union(*map(compat.varying_axes, jax.tree.leaves((args, padding))))

        def vary(tree: Any) -> Any:
            return jax.tree.map(lambda x: _vary(x, axes), tree)

        # The gradient of a replicated (invariant) parameter is summed over the devices by
        # shard_map's transpose rule: each "example" would mix one example of every device,
        # before clipping. Differentiated at a varying copy, each gradient stays local.
        args = tuple(vary(arg) if i in diff else arg for i, arg in enumerate(args))
        chunks = _num_chunks(chunking, n)
        mapped = {i: args[i] for i in batched}
        if prng_argnum is not None:
            mapped[prng_argnum] = jax.random.split(args[prng_argnum], n)

        def one_example(example: dict[int, Any], pad: jax.Array) -> Any:
            full = [
                jax.tree.map(lambda x: x[None], example[i]) if i in batched else example.get(i, arg)
                for i, arg in enumerate(args)
            ]
            out, grads = value_and_grad(*full, **kwargs)
            loss, aux = out if has_aux else (out, ())
            return _clip_example(loss, aux, grads, pad, clip)

        per_chunk = jax.vmap(one_example)
        xs = (_chunked(mapped, chunks), padding.reshape(chunks, n // chunks))
        shapes = jax.eval_shape(
            per_chunk, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), xs)
        )
        sums = vary(
            (
                jnp.zeros((), jnp.promote_types(shapes[0].dtype, jnp.float32)),
                jax.tree.map(
                    lambda g: jnp.zeros(g.shape[1:], trees.accumulator_dtype(g, dtype)), shapes[2]
                ),
            )
        )

        def add_chunk(carry: Any, chunk: tuple[Any, jax.Array]) -> Any:
            loss_sum, grad_sum = carry
            losses, aux, grads = per_chunk(*chunk)
            grad_sum = jax.tree.map(lambda s, g: s + jnp.sum(g, 0, dtype=s.dtype), grad_sum, grads)
            return vary(((loss_sum + jnp.sum(losses, dtype=loss_sum.dtype), grad_sum), aux))

        def skip_chunk(carry: Any, chunk: tuple[Any, jax.Array]) -> Any:
            return carry, vary(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes[1]))

        def step(carry: Any, chunk: tuple[Any, jax.Array]) -> Any:
            return jax.lax.cond(jnp.all(chunk[1]), skip_chunk, add_chunk, carry, chunk)

        (loss_sum, grad_sum), aux = jax.lax.scan(step, sums, xs)
        # dp_accumulate, given these leaves in the same trace, checks its noise uses this C.
        mark_clip_norm(grad_sum, clip)
        if has_aux:
            aux = jax.tree.map(lambda a: a.reshape(n, *a.shape[2:]), aux)
            return (loss_sum, aux), grad_sum
        return loss_sum, grad_sum

    return ClippedGradFn(loss_fn, clip, call)


def _vary(x: jax.Array, axes: frozenset) -> jax.Array:
    missing = axes - compat.varying_axes(x)
    return compat.pcast_to_varying(x, tuple(sorted(missing))) if missing else x


def _clip_example(loss: jax.Array, aux: Any, grads: Any, pad: jax.Array, clip: float) -> Any:
    """One example's `(loss, aux, clipped gradient)`, all zero if it is padding or not finite."""
    # float32 at least: a 16-bit sum of squares overflows at gradients of ~256.
    squares = sum(
        jnp.sum(jnp.square(g.astype(jnp.promote_types(g.dtype, jnp.float32))))
        for g in jax.tree.leaves(grads)
    )
    keep = ~pad & jnp.isfinite(squares) & jnp.isfinite(loss)
    # min(1, C/0) = 1: a zero gradient stays zero.
    scale = jnp.minimum(1.0, clip / jnp.sqrt(squares))

    def kept(x: jax.Array) -> jax.Array:
        # A select, not a product: NaN or inf in a dropped example does not leak through.
        return jnp.where(keep, x, jnp.zeros_like(x))

    grads = jax.tree.map(lambda g: kept(g * scale.astype(g.dtype)), grads)
    return kept(loss), jax.tree.map(kept, aux), grads


def _batch_size(args: tuple[Any, ...], batched: tuple[int, ...]) -> int:
    if max(batched) >= len(args):
        raise ValueError(
            f"batch_argnums={batched} names argument {max(batched)}, but the function was "
            f"called with {len(args)} positional arguments."
        )
    # A scalar leaf has no batch axis: size 0, refused with the empty batch.
    sizes = {
        jax.tree_util.keystr(path): jnp.shape(leaf)[0] if jnp.ndim(leaf) else 0
        for i in batched
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[i])
    }
    distinct = set(sizes.values())
    if len(distinct) != 1 or 0 in distinct:
        raise ValueError(
            "Every leaf of the batch arguments (batch_argnums) must carry the batch on its "
            "leading axis, all of one size > 0 (pad an empty micro-batch and mark it with "
            f"is_padding_example=); got leading sizes {sizes}."
        )
    (size,) = distinct
    return int(size)


def _padding_mask(is_padding_example: Any, n: int) -> jax.Array:
    if is_padding_example is None:
        return jnp.zeros(n, bool)
    mask = jnp.asarray(is_padding_example)
    if mask.shape != (n,) or mask.dtype != jnp.bool_:
        raise ValueError(
            f"is_padding_example must be a bool array of shape ({n},), one flag per example "
            f"of the batch; got dtype {mask.dtype} and shape {mask.shape}."
        )
    return mask


def _num_chunks(chunking: tuple[str, int] | None, n: int) -> int:
    if chunking is None:
        return 1
    name, value = chunking
    chunks = value if name == "num_microbatches" else n // value
    if n % value:
        other = "microbatch_size" if name == "num_microbatches" else "num_microbatches"
        raise ValueError(
            f"{name}={value} must divide the batch size {n}. Pad the batch to a multiple "
            f"(mark the padding with is_padding_example=; all-padding chunks are skipped), "
            f"or pick another {name} or {other}."
        )
    return chunks


def _chunked(mapped: dict[int, Any], chunks: int) -> dict[int, Any]:
    """The mapped arguments cut into `chunks` contiguous chunks along their leading axis."""
    return jax.tree.map(lambda x: x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:]), mapped)
