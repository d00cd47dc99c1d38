"""Contrastive losses computed in tiles: memory that grows with N·D, never N².

`clip_loss` (symmetric InfoNCE), `info_nce` (one direction) and `siglip_loss`
(pairwise sigmoid) couple every row of a batch to every other row through an
N × N matrix of similarities. Here that matrix never exists: the rows and the
columns are cut into blocks of `block_size`, each tile of logits is computed,
used and dropped, and

* the softmax losses keep an online log-sum-exp per row (and per column for
  `clip_loss`): a running maximum and running sums of exponentials (the
  positives' and the others' apart), in float32 for 16- and 32-bit inputs
  (float64 for float64 inputs);
* the backward pass (a `jax.custom_vjp`) recomputes each tile from the inputs
  and those saved statistics, so what stays alive between the passes is the
  inputs and a few N-vectors.

The results equal the dense formulas to float32 rounding, for values and for
gradients with respect to the embeddings, `scale` and `bias`; the gradients keep
their precision where a dense float32 log-softmax keeps it, at logits of 1e4 and
on batches whose loss is near 0 (`1 - p` of a positive is the others' share, not
a difference near 1).

Masks and extra positives:

* `mask` (shape `(N,)`, bool): rows that are real examples. A masked-out pair
  (row `i` of both inputs) is neither a query nor a candidate; the loss is the
  mean over the valid rows (0 when none is valid). Use it for padded batches.
* `labels` (shape `(N,)`, integer): pairs with equal labels are positives of
  each other (duplicate captions, several views of one instance). For the
  softmax losses row `i`'s term is the cross-entropy against the uniform
  distribution over its positives, `lse_i - mean_{j in P(i)} s_ij` (the
  "outside" form of supervised contrastive losses); for `siglip_loss` the
  sign `z_ij` is +1 for every positive pair. Without `labels` the positives
  are the diagonal.

Under global-view `jax.jit` over a mesh (Auto or Explicit axes) each device runs
its own rows' tiles inside a `jax.shard_map` the loss opens itself (see
docs/losses.md, "Sharded batches").

Sharded batches: with `axis_name=` (inside `jax.shard_map` or `jax.pmap`)
each device passes its own rows; the columns are gathered with
`jax.lax.all_gather` (N × D per device, no N × N anywhere); `clip_loss`
combines its columns' log-sum-exps across devices as N-vectors. Each device
returns `R / n_valid · Σ_(its valid rows) term_i` with `R` devices and
`n_valid` valid rows over all devices, so that the mean over devices
(`jax.lax.pmean`) is the global loss, and likewise the mean over devices of
each device's gradients is the gradient of the global loss: what
`accumulate(..., axis_name=...)` with its default `use_grad_mean=True`
computes once per window, and what a `pmean` of the gradients computes. Without
masks and with equal shards each device's value is the mean of its rows'
terms, the usual data-parallel convention. Differentiate with respect to
parameters cast to varying (`jax.lax.pcast(params, axis, to="varying")`) so
that nothing is reduced before `accumulate` does it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.typing import ArrayLike

from gradaccum_jax._base import tiles
from gradaccum_jax._base.compat import partitions, reshard
from gradaccum_jax._base.tiles import SIGMOID, SOFTMAX

__all__ = ["clip_loss", "info_nce", "siglip_loss"]

DEFAULT_BLOCK_SIZE = 512


# ----------------------------------------------------------------------------- checks


def _check_embeddings(name: str, x: Any) -> jax.Array:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{name} has dtype {x.dtype}: the embeddings must be floating point "
            f"(float32, bfloat16, float16); cast them first, e.g. {name}.astype(jnp.float32)."
        )
    if x.ndim != 2:
        raise ValueError(
            f"{name} has shape {x.shape}: expected (rows, features), one embedding per "
            f"row; reshape it, e.g. {name}.reshape(len({name}), -1)."
        )
    return jnp.asarray(x)


def _check_pair(a_name: str, a: jax.Array, b_name: str, b: jax.Array, square: bool) -> None:
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"{a_name} has shape {a.shape} and {b_name} has shape {b.shape}: the feature "
            "dimensions (axis 1) must match; project both towers to the same width."
        )
    if square and a.shape[0] != b.shape[0]:
        raise ValueError(
            f"{a_name} has shape {a.shape} and {b_name} has shape {b.shape}: row i of each "
            "is one pair, so both need the same number of rows."
        )
    if not square and b.shape[0] < a.shape[0]:
        raise ValueError(
            f"{a_name} has shape {a.shape} and {b_name} has shape {b.shape}: {b_name} needs "
            f"at least as many rows as {a_name} (row i of {b_name} is the positive of row i "
            f"of {a_name}; rows beyond are extra negatives)."
        )


def _check_scalar(name: str, x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape != ():
        raise ValueError(f"{name} has shape {x.shape}: expected a scalar, e.g. {name}=10.0.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
            return x.astype(jnp.float32)
        raise TypeError(f"{name} has dtype {x.dtype}: expected a real scalar.")
    return x


def _check_rows(name: str, x: Any, rows: int, kind: str) -> jax.Array | None:
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.shape != (rows,):
        raise ValueError(
            f"{name} has shape {x.shape}: expected ({rows},), one entry per row of the "
            "embeddings (per device's rows under axis_name)."
        )
    if kind == "mask" and x.dtype != jnp.bool_:
        raise TypeError(
            f"{name} has dtype {x.dtype}: expected bool (True for real rows); "
            f"pass {name}.astype(bool) or {name} != 0."
        )
    if kind == "labels" and not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"{name} has dtype {x.dtype}: expected integers (equal labels mark positives); "
            f"pass {name}.astype(jnp.int32)."
        )
    return x


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 8:
        raise ValueError(
            f"block_size={block_size!r}: expected a Python int >= 8 (the rows and columns of "
            f"one tile; {DEFAULT_BLOCK_SIZE} by default). Larger tiles are faster, smaller "
            "ones use less memory: a tile's temporaries are a few block_size² floats."
        )
    return block_size


def _check_axis_name(axis_name: Any) -> None:
    if axis_name is None:
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for name in names:
        try:
            jax.lax.axis_size(name)
        except NameError as err:
            raise ValueError(
                f"axis_name={axis_name!r}: the axis {name!r} is not bound here. Call the "
                f"loss inside jax.shard_map over a mesh with an axis named {name!r} (or "
                f"inside jax.pmap(..., axis_name={name!r})); under jax.jit with a sharded "
                "batch, or on one device, leave axis_name=None."
            ) from err


# ----------------------------------------------------------------------------- kernel


def _run(
    mode, both, block_size, q, k, scale, bias, rlab, clab, rvalid, cvalid, cpair, axis_name,
    rpos=None,
):  # fmt: skip
    """Each row's term (and each column's, when `both`), unpadded, from whole tiles.

    Softmax: the cross-entropy of each row over the valid columns against the uniform
    distribution over its positives (and of each column over the valid rows). Sigmoid:
    each row's sum of `-log sigmoid(z s)` over the valid columns. Under `axis_name` the
    columns' statistics combine over the devices, and each device's column terms are
    those of all columns, its gradient carrying its rows' whole share of them. `rpos`
    (without labels): the column of each row's positive, -1 for none (see `tiles.Meta`).
    """
    n, m = q.shape[0], k.shape[0]
    bs = min(block_size, max(n, m))
    bs = -(-bs // 8) * 8
    np_, mp = -(-n // bs) * bs, -(-m // bs) * bs
    # Masked rows take no part: zeroed, so that padding holding inf or NaN cannot reach
    # the sums through a zero weight (0 * NaN is NaN).
    q = tiles.pad_rows(jnp.where(rvalid[:, None], q, jnp.zeros((), q.dtype)), np_)
    k = tiles.pad_rows(jnp.where(cvalid[:, None], k, jnp.zeros((), k.dtype)), mp)
    meta = tiles.Meta(
        tiles.pad_rows(rlab, np_),
        tiles.pad_rows(clab, mp),
        tiles.pad_rows(rvalid, np_, False),
        tiles.pad_rows(cvalid, mp, False),
        tiles.pad_rows(cpair, mp, False),
        None if rpos is None else tiles.pad_rows(rpos, np_, -1),
    )
    # The statistics are constants to autodiff: the backward of `cross_entropies` holds
    # the whole gradient.
    frozen = jax.lax.stop_gradient((q, k, scale, bias))
    rows, cols = tiles.statistics(mode, both, bs, *frozen, meta)
    share = 1
    if both and axis_name is not None:
        cols = tiles.combine_statistics(cols, jax.lax.stop_gradient(scale), axis_name)
        share = _device_index_and_count(axis_name)[1]
    row_terms, col_terms = tiles.cross_entropies(
        mode, both, bs, share, q, k, scale, bias, meta, rows, cols
    )
    return row_terms[:n], col_terms[:m]


# ----------------------------------------------------------------------------- sharding


def _gather(x: jax.Array, axis_name: Any) -> jax.Array:
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=True)


def _device_index_and_count(axis_name: Any) -> tuple[jax.Array, int]:
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    index, count = jnp.zeros((), jnp.int32), 1
    for name in names:
        size = jax.lax.axis_size(name)
        index = index * size + jax.lax.axis_index(name)
        count *= size
    return index, count


def _setup(n, mask, labels, axis_name):
    """Row validity, row labels, and (under axis_name) this device's global offset."""
    valid = jnp.ones(n, jnp.bool_) if mask is None else mask
    if axis_name is None:
        lab = jnp.arange(n, dtype=jnp.int32) if labels is None else labels
        return valid, lab.astype(jnp.int32), 1
    index, count = _device_index_and_count(axis_name)
    lab = index * n + jnp.arange(n, dtype=jnp.int32) if labels is None else labels
    return valid, lab.astype(jnp.int32), count


def _normalise(total, valid, count, axis_name):
    n_valid = valid.sum(dtype=jnp.float32)
    if axis_name is not None:
        n_valid = jax.lax.psum(n_valid, axis_name)
    return count * total / jnp.maximum(n_valid, 1.0)


def _clip(a, b, scale, bias, mask, labels, block_size, axis_name):
    n = a.shape[0]
    valid, lab, count = _setup(n, mask, labels, axis_name)
    pair = jnp.ones(n, jnp.bool_)
    # Without labels row i's positive is column i (global numbering under axis_name).
    rpos = None if labels is not None else jnp.where(valid, lab, -1)
    if axis_name is None:
        # One pass over the tiles gives both directions: per-row and per-column statistics.
        rows, cols = _run(
            SOFTMAX, True, block_size, a, b, scale, bias, lab, lab, valid, valid, pair, None,
            rpos,
        )  # fmt: skip
        return _normalise(0.5 * (rows.sum() + cols.sum()), valid, count, axis_name)
    # Sharded: this device's rows of `a` against all of `b` give its rows' terms and every
    # column's statistics over its rows; combined across devices (N-vectors), they give
    # every column's term on every device.
    g_lab, g_valid, g_pair = (_gather(x, axis_name) for x in (lab, valid, pair))
    index, _ = _device_index_and_count(axis_name)
    rows, cols = _run(
        SOFTMAX, True, block_size, a, _gather(b, axis_name), scale, bias,
        lab, g_lab, valid, g_valid, g_pair, axis_name, rpos,
    )  # fmt: skip
    # The value counts this device's own columns; the gradient comes through the mean of
    # all columns over the devices (1/count of each), which `_run` scaled back to whole
    # shares for this device's rows. The two agree over devices.
    own = jax.lax.dynamic_slice_in_dim(cols, index * n, n).sum()
    spread = cols.sum() / count
    col_total = spread + jax.lax.stop_gradient(own - spread)
    return _normalise(0.5 * (rows.sum() + col_total), valid, count, axis_name)


def _info_nce(q, k, scale, bias, mask, labels, block_size, axis_name):
    n, m = q.shape[0], k.shape[0]
    valid, lab, count = _setup(n, mask, labels, axis_name)
    extra = m - n
    clab = jnp.concatenate([lab, jnp.zeros(extra, jnp.int32)])
    cvalid = jnp.concatenate([valid, jnp.ones(extra, jnp.bool_)])
    cpair = jnp.arange(m) < n
    # Without labels query i's key: each device's keys are its paired ones, then its extras.
    rpos = None if labels is not None else jnp.where(valid, lab + lab // n * extra, -1)
    if axis_name is not None:
        k, clab, cvalid, cpair = (_gather(x, axis_name) for x in (k, clab, cvalid, cpair))
    rows, _ = _run(
        SOFTMAX, False, block_size, q, k, scale, bias, lab, clab, valid, cvalid, cpair, axis_name,
        rpos,
    )  # fmt: skip
    return _normalise(rows.sum(), valid, count, axis_name)


def _siglip(a, b, scale, bias, mask, labels, block_size, axis_name):
    valid, lab, count = _setup(a.shape[0], mask, labels, axis_name)
    clab, cvalid, cpair = lab, valid, jnp.ones(a.shape[0], jnp.bool_)
    if axis_name is not None:
        b, clab, cvalid, cpair = (_gather(x, axis_name) for x in (b, clab, cvalid, cpair))
    rows, _ = _run(
        SIGMOID, False, block_size, a, b, scale, bias, lab, clab, valid, cvalid, cpair, axis_name
    )
    return _normalise(rows.sum(), valid, count, axis_name)


def _explicit_batch_axes(x: jax.Array) -> tuple[Any, ...] | None:
    """The Explicit mesh axes the rows of `x` are sharded over under global-view jit."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None:
        return None
    entries = partitions(spec)
    if not entries or entries[0] is None:
        return None
    axes = entries[0] if isinstance(entries[0], tuple) else (entries[0],)
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if not all(types.get(axis) == AxisType.Explicit for axis in axes):
        return None
    return axes


def _auto_batch_axes(x: jax.Array, rows: int, extra: int) -> tuple[Any, Any] | None:
    """The mesh and the Auto axes to spread the rows over under global-view jit, if any.

    Auto axes do not show in the types how the batch is sharded, and the compiler, left
    to itself, runs every tile on every device. The tiles are N² work for N x D inputs,
    so the rows go over every Auto axis (in mesh order) whose size still divides the
    rows and the extra keys: moving the inputs there costs far less than the tiles.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.axis_names:
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", mesh)
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    # Inside shard_map the rows are already one device's: leave them there.
    if not types or any(t == AxisType.Manual for t in types.values()):
        return None
    axes, size = [], 1
    for axis, kind in types.items():
        grown = size * mesh.shape[axis]
        if kind == AxisType.Auto and grown > size and rows % grown == 0 and extra % grown == 0:
            axes.append(axis)
            size = grown
    return (mesh, tuple(axes)) if axes else None


def _dispatch(impl, x, y, scale, bias, mask, labels, block_size, axis_name):
    """Runs `impl`; under global-view jit over a mesh, on each device's own rows.

    Sharding is part of the types on Explicit axes, where the tiles' products of two
    row-sharded blocks have no legal sharding; on Auto axes the compiler partitions the
    tiled loops by repeating them on every device. Either way each device runs `impl` on
    its own rows with `axis_name` inside `jax.shard_map`, and the mean over devices is the
    loss.
    """
    if axis_name is None:
        axes = _explicit_batch_axes(x) or _explicit_batch_axes(y)
        if axes is not None:
            mesh = jax.typeof(x if _explicit_batch_axes(x) else y).sharding.mesh
            return _global_view(impl, mesh, axes, x, y, scale, bias, mask, labels, block_size)
        auto = _auto_batch_axes(x, x.shape[0], y.shape[0] - x.shape[0])
        if auto is not None:
            return _global_view(impl, *auto, x, y, scale, bias, mask, labels, block_size)
    return impl(x, y, scale, bias, mask, labels, block_size, axis_name)


def _global_view(impl, mesh, axes, x, y, scale, bias, mask, labels, block_size):
    explicit = mesh.axis_types[mesh.axis_names.index(axes[0])] == AxisType.Explicit
    size = 1
    for axis in axes:
        size *= mesh.shape[axis]
    n, m = x.shape[0], y.shape[0]
    valid = jnp.ones(n, jnp.bool_) if mask is None else mask
    lab = jnp.arange(n, dtype=jnp.int32) if labels is None else labels.astype(jnp.int32)
    if n % size or (m - n) % size:
        # Rows that do not split evenly: every device computes the whole loss (N x D each).
        x, y, valid, lab = reshard((x, y, valid, lab), jax.P())
        return impl(x, y, scale, bias, valid, lab, block_size, None)
    rows, vec = jax.P(axes, None), jax.P(axes)
    # Extra keys (info_nce with M > N) are split like the paired ones; each device appends
    # its share after its paired keys, the layout `impl` expects under axis_name.
    pairs, extra = y[:n], y[n:]
    if explicit:  # shard_map takes Explicit inputs only in the sharding its specs name
        x, pairs, extra = reshard(x, rows), reshard(pairs, rows), reshard(extra, rows)
        valid, lab = reshard(valid, vec), reshard(lab, vec)
        scale, bias = reshard(scale, jax.P()), reshard(bias, jax.P())
    name = axes if len(axes) > 1 else axes[0]

    def local(x, pairs, extra, scale, bias, valid, lab):
        y = jnp.concatenate([pairs, extra])
        return jax.lax.pmean(impl(x, y, scale, bias, valid, lab, block_size, name), name)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, jax.P(), jax.P(), vec, vec),
        out_specs=jax.P(),
        axis_names=set(axes),
    )(x, pairs, extra, scale, bias, valid, lab)


# ----------------------------------------------------------------------------- public


def _checked_dispatch(
    kernel: Any,
    first: tuple[str, Any],
    second: tuple[str, Any],
    square: bool,
    scale: Any,
    bias: Any,
    mask: Any,
    labels: Any,
    block_size: Any,
    axis_name: Any,
) -> jax.Array:
    """Checks a public loss's arguments, in the order of its signature, and runs `kernel`.

    `first` and `second` are the embeddings with their argument names; `bias`
    is `None` for the softmax losses (a zero then stands for it).
    """
    x = _check_embeddings(*first)
    y = _check_embeddings(*second)
    _check_pair(first[0], x, second[0], y, square=square)
    scale = _check_scalar("scale", scale)
    bias = jnp.zeros((), jnp.float32) if bias is None else _check_scalar("bias", bias)
    mask = _check_rows("mask", mask, x.shape[0], "mask")
    labels = _check_rows("labels", labels, x.shape[0], "labels")
    block_size = _check_block_size(block_size)
    _check_axis_name(axis_name)
    return _dispatch(kernel, x, y, scale, bias, mask, labels, block_size, axis_name)


def clip_loss(
    a: ArrayLike,
    b: ArrayLike,
    scale: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    labels: ArrayLike | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    axis_name: Any = None,
) -> jax.Array:
    r"""The symmetric InfoNCE (CLIP) loss of paired embeddings, computed in tiles.

    With logits $s_{ij} = \mathrm{scale} \cdot a_i \cdot b_j$ and row $i$ of `a`
    paired with row $i$ of `b`, the loss is the mean of both directions'
    cross-entropies:

    $$\frac{1}{2N}\sum_i \Big[\big(\log\textstyle\sum_j e^{s_{ij}} - s_{ii}\big)
    + \big(\log\textstyle\sum_j e^{s_{ji}} - s_{ii}\big)\Big].$$

    Normalise `a` and `b` yourself if you want cosine similarities. `scale`
    is the inverse temperature $1/\tau$ (CLIP's $\tau = 0.07$ is
    `scale = 1 / 0.07`), i.e. open_clip's `logit_scale.exp()`: learn it as
    `jnp.exp(log_scale)`, and clamp `log_scale` to $\ln 100$ after each
    optimizer step yourself, as open_clip does.

    Args:
      a: embeddings of the first tower, shape `(N, D)`, floating point.
      b: embeddings of the second tower, shape `(N, D)`.
      scale: the scalar multiplying the dot products: the inverse
        temperature $1/\tau$, not $\tau$ (open_clip's `logit_scale.exp()`).
      mask: optional bool `(N,)`: the valid pairs; the others are neither
        queries nor candidates, and the loss is the mean over the valid rows.
      labels: optional integers `(N,)`: pairs with equal labels are positives
        of each other; each row's term is then the cross-entropy against the
        uniform distribution over its positives.
      block_size: rows and columns per tile (a Python int >= 8).
      axis_name: a mesh axis name (or tuple of names) the batch is split over
        inside `jax.shard_map` or `jax.pmap`; see the module docstring for what
        each device returns.

    Returns:
      A float32 scalar (float64 for float64 inputs): the loss (under
      `axis_name`, this device's share times the number of devices, whose mean
      over devices is the global loss).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> a = jax.random.normal(jax.random.key(0), (100, 16))
      >>> b = a + 0.1 * jax.random.normal(jax.random.key(1), (100, 16))
      >>> loss = ga.losses.clip_loss(a, b, 2.0, block_size=32)
      >>> logits = 2.0 * a @ b.T
      >>> dense = -0.5 * (jnp.diag(jax.nn.log_softmax(logits, 1)).mean()
      ...                 + jnp.diag(jax.nn.log_softmax(logits, 0)).mean())
      >>> bool(jnp.allclose(loss, dense, rtol=1e-5))
      True

    References:
      Radford et al., *Learning Transferable Visual Models From Natural
      Language Supervision*, 2021, https://arxiv.org/abs/2103.00020;
      Khosla et al., *Supervised Contrastive Learning*, 2020,
      https://arxiv.org/abs/2004.11362 (several positives per row)
    """
    return _checked_dispatch(
        _clip, ("a", a), ("b", b), True, scale, None, mask, labels, block_size, axis_name
    )


def info_nce(
    q: ArrayLike,
    k: ArrayLike,
    scale: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    labels: ArrayLike | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    axis_name: Any = None,
) -> jax.Array:
    r"""One-directional InfoNCE: each query against all keys, computed in tiles.

    $$\frac{1}{N}\sum_i \Big(\log\textstyle\sum_j e^{s_{ij}} - s_{ii}\Big),
    \qquad s_{ij} = \mathrm{scale}\cdot q_i \cdot k_j.$$

    `k` may have more rows than `q` (`M >= N`): key `i < N` is the positive of
    query `i`, keys `N..M-1` are extra negatives (hard negatives in dense
    retrieval).

    Args:
      q: queries, shape `(N, D)`, floating point.
      k: keys, shape `(M, D)` with `M >= N`.
      scale: the scalar multiplying the dot products: the inverse
        temperature $1/\tau$, not $\tau$ (open_clip's `logit_scale.exp()`).
      mask: optional bool `(N,)`: valid (query, key) pairs; a masked-out pair
        is neither a query nor a candidate. Extra keys are always candidates.
      labels: optional integers `(N,)`: key `j < N` is a positive of query `i`
        when their labels are equal; each query's term is then the
        cross-entropy against the uniform distribution over its positives.
      block_size: rows and columns per tile (a Python int >= 8).
      axis_name: a mesh axis name (or tuple) the batch is split over; each
        device passes its own `q` and `k` rows (its extra keys after its
        paired keys) and the keys of all devices are candidates.

    Returns:
      A float32 scalar (float64 for float64 inputs): the mean over valid
      queries (under `axis_name`, this device's share times the number of
      devices).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> q = jax.random.normal(jax.random.key(0), (50, 8))
      >>> k = jax.random.normal(jax.random.key(1), (70, 8))
      >>> loss = ga.losses.info_nce(q, k, 1.0, block_size=16)
      >>> dense = -jnp.diag(jax.nn.log_softmax(q @ k.T, axis=1)).mean()
      >>> bool(jnp.allclose(loss, dense, rtol=1e-5))
      True

    References:
      van den Oord et al., *Representation Learning with Contrastive
      Predictive Coding*, 2018, https://arxiv.org/abs/1807.03748
    """
    return _checked_dispatch(
        _info_nce, ("q", q), ("k", k), False, scale, None, mask, labels, block_size, axis_name
    )


def siglip_loss(
    a: ArrayLike,
    b: ArrayLike,
    scale: ArrayLike,
    bias: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    labels: ArrayLike | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    axis_name: Any = None,
) -> jax.Array:
    r"""The pairwise sigmoid (SigLIP) loss of paired embeddings, computed in tiles.

    $$-\frac{1}{N}\sum_{i,j}\log\sigma\big(z_{ij}\,(\mathrm{scale}\cdot a_i\cdot b_j
    + \mathrm{bias})\big),$$

    with $z_{ij} = +1$ for positive pairs (the diagonal, or equal `labels`)
    and $-1$ otherwise. The sum runs over all $N^2$ pairs; the normaliser is
    the number of valid rows.

    Args:
      a: embeddings of the first tower, shape `(N, D)`, floating point.
      b: embeddings of the second tower, shape `(N, D)`.
      scale: the scalar multiplying the dot products, the inverse
        temperature (open_clip's `logit_scale.exp()`).
      bias: the scalar added to every logit (open_clip's `logit_bias`, as
        it is).
      mask: optional bool `(N,)`: valid pairs; pairs involving an invalid row
        of `a` or `b` are left out and the normaliser counts valid rows.
      labels: optional integers `(N,)`: pairs with equal labels are positives.
      block_size: rows and columns per tile (a Python int >= 8).
      axis_name: a mesh axis name (or tuple) the batch is split over; see the
        module docstring.

    Returns:
      A float32 scalar (float64 for float64 inputs; under `axis_name`, this
      device's share times the number of devices).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import gradaccum_jax as ga
      >>> a = jax.random.normal(jax.random.key(0), (40, 8))
      >>> b = jax.random.normal(jax.random.key(1), (40, 8))
      >>> loss = ga.losses.siglip_loss(a, b, 1.0, -2.0, block_size=16)
      >>> z = 2 * jnp.eye(40) - 1
      >>> dense = -jax.nn.log_sigmoid(z * (a @ b.T - 2.0)).sum() / 40
      >>> bool(jnp.allclose(loss, dense, rtol=1e-5))
      True

    References:
      Zhai et al., *Sigmoid Loss for Language Image Pre-Training*, 2023,
      https://arxiv.org/abs/2303.15343
    """
    return _checked_dispatch(
        _siglip, ("a", a), ("b", b), True, scale, bias, mask, labels, block_size, axis_name
    )
