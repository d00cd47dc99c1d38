"""The tiled pairwise kernel behind `gradaccum_jax.losses`: statistics, then gradients.

Two sweeps over the tiles of `s = scale * q @ k.T`, never the whole matrix:

* `statistics` (no autodiff through it) keeps, per row and per column, the running maximum
  `m`, the sums of `exp(s - m)` over the positives (`l_pos`) and over the other valid
  entries (`l_neg`) apart, the sum of the positives' logits and their number; for the
  sigmoid loss, each row's sum of `-log sigmoid(z s)`.
* `cross_entropies` turns those statistics into each row's (and column's) term, and its
  `jax.custom_vjp` backward sweeps the tiles again with the gradient written so that no
  term is the difference of two numbers near 1: a positive's `p - 1/|P|` is
  `-l_neg / l` for a single positive, `(e - l_pos/|P|)/l - l_neg/(|P| l)` for several,
  and `p = exp(s - m) / l` with `s - m` taken in the tile, not against a float32
  log-sum-exp (whose rounding at logits of 1e4 is 1e-3); the sigmoid's is `-z sigmoid(-z x)`.

The statistics of devices that each hold some rows of a column combine with
`combine_statistics` (N-vectors), so that the backward of every device uses the global
statistics of the columns it sees.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax._base.compat import pcast_to_varying, varying_axes

SOFTMAX = "softmax"
SIGMOID = "sigmoid"
# Running maximum before any column was seen: finite, so that `m - new_m` is never inf - inf.
_FLOOR = -1e30


class Stats(NamedTuple):
    """Softmax statistics of rows (or columns), each `(rows,)` in the accumulation dtype.

    For the sigmoid loss `l_neg` holds each row's summed loss and the others are unused.
    """

    m: jax.Array  # running maximum of the valid logits / |scale| (_FLOOR when none)
    l_pos: jax.Array  # sum of exp(s - m) over the positives
    l_neg: jax.Array  # sum of exp(s - m) over the other valid entries
    pos_sum: jax.Array  # sum of the positives' logits
    n_pos: jax.Array  # number of positives (int32)


def _empty_stats(rows: int, acc: Any) -> Stats:
    zeros = jnp.zeros(rows, acc)
    return Stats(jnp.full(rows, _FLOOR, acc), zeros, zeros, zeros, jnp.zeros(rows, jnp.int32))


def pad_rows(x: jax.Array, rows: int, value: Any = 0) -> jax.Array:
    extra = rows - x.shape[0]
    if extra == 0:
        return x
    pad = [(0, extra)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad, constant_values=value)


def _match_vma(ct: jax.Array, primal: jax.Array) -> jax.Array:
    # Inside shard_map a cotangent may vary along axes its primal does not (an invariant
    # `scale` used by varying rows): autodiff of the implicit broadcast sums it there.
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal), key=str))
    return jax.lax.psum(ct, extra) if extra else ct


def _joint_axes(*xs: Any) -> frozenset:
    return frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(xs)))


def _vary(tree: Any, axes: frozenset) -> Any:
    # Scan carries start as constants; inside shard_map they must vary like the values
    # the loop body adds to them.
    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x), key=str))
        return pcast_to_varying(x, missing) if missing else x

    return jax.tree.map(cast, tree)


def acc_dtype(q: jax.Array, k: jax.Array) -> Any:
    # float32 for 16- and 32-bit inputs; float64 inputs (with jax_enable_x64) keep float64.
    return jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), jnp.float32)


def _block(x, i, bs):
    return jax.lax.dynamic_slice_in_dim(x, i * bs, bs)


def _tile(q, k, i, j, bs):
    qb, kb = _block(q, i, bs), _block(k, j, bs)
    raw = jax.lax.dot_general(
        qb,
        kb,
        (((1,), (1,)), ((), ())),
        preferred_element_type=acc_dtype(q, k),
        precision=jax.lax.Precision.HIGHEST,
    )
    return qb, kb, raw


class Meta(NamedTuple):
    """What the tiles need besides the embeddings: labels and validity, padded to tiles."""

    rlab: jax.Array  # (rows,) int32
    clab: jax.Array  # (cols,) int32
    rvalid: jax.Array  # (rows,) bool
    cvalid: jax.Array  # (cols,) bool
    cpair: jax.Array  # (cols,) bool: columns that can be positives (paired keys)
    # Without labels every valid row has one positive: its column (`rpos`, (rows,) int32,
    # -1 for none), and each paired column has one row. The sweep then reads the
    # positives' logits from the tile instead of summing over a mask of positives.
    rpos: jax.Array | None = None


def _positives(meta: Meta, i, j, bs):
    rl, rv = _block(meta.rlab, i, bs), _block(meta.rvalid, i, bs)
    cl, cv, cp = _block(meta.clab, j, bs), _block(meta.cvalid, j, bs), _block(meta.cpair, j, bs)
    pos = (rl[:, None] == cl[None, :]) & cp[None, :] & rv[:, None] & cv[None, :]
    return pos, rv, cv


def _magnitude(scale):
    """`|scale|` and `sign(scale) * raw`: logits are `|scale| * t`, differences taken in `t`."""
    return jnp.abs(scale), lambda raw: jnp.where(scale < 0, -raw, raw)


def _single_positives(t, rpos, offset, bs):
    """The tile's entries of the rows' and the columns' single positives.

    `rpos`: the rows' positive columns (-1 for none), `offset`: the tile's first column.
    Returns `(t, inside)` for the rows and for the columns: the positives' `t` and
    whether each positive is in the tile.
    """
    local = rpos - offset
    inside = (local >= 0) & (local < bs)
    t_row = jnp.take_along_axis(t, jnp.clip(local, 0, bs - 1)[:, None], axis=1)[:, 0]
    # Column c's positive is the row whose positive is c: scatter the rows' (index bs
    # is out of range, dropped).
    at = jnp.where(inside, local, bs)
    t_col = jnp.zeros(bs, t.dtype).at[at].set(t_row, mode="drop")
    in_col = jnp.zeros(bs, jnp.bool_).at[at].set(True, mode="drop")
    return (t_row, inside), (t_col, in_col)


def _update(st: Stats, t, mag, pos, valid, axis, single=None):
    """Adds one tile of `t` (logits `mag * t`) to the statistics along `axis` (1: rows).

    `single`: `(t of each one's positive, whether it is in the tile)` when every row has
    at most one positive; the positives are then read, not summed under a mask.
    """
    new_m = jnp.maximum(st.m, jnp.where(valid, t, -jnp.inf).max(axis))

    # `t - m` is exact near the maximum (both float32 of the same size) and one product
    # rounds it; `s - mag * m` would round at the size of the logits, and a fused
    # multiply-add in one pass but not the other would give the maximum exp(+-ulp).
    # Each sum masks the exponentials it reads, so that each reads only the tile `t`.
    def masked_sum(x, mask):
        return jnp.where(mask, jnp.exp(mag * (x - jnp.expand_dims(new_m, axis))), 0.0).sum(axis)

    rescale = jnp.exp(mag * (st.m - new_m))
    if single is None:
        l_pos = masked_sum(t, pos)
        pos_sum = jnp.where(pos, mag * t, 0.0).sum(axis)
        count = pos.sum(axis, dtype=jnp.int32)
    else:
        t_pos, inside = single
        l_pos = jnp.where(inside, jnp.exp(mag * (t_pos - new_m)), 0.0)
        pos_sum = jnp.where(inside, mag * t_pos, 0.0)
        count = inside.astype(jnp.int32)
    # The others' sum on its own: 1 - p of a positive near 1 is this sum over the total.
    l_neg = masked_sum(t, valid & ~pos)
    return Stats(
        new_m,
        st.l_pos * rescale + l_pos,
        st.l_neg * rescale + l_neg,
        st.pos_sum + pos_sum,
        st.n_pos + count,
    )


def statistics(mode, both, bs, q, k, scale, bias, meta: Meta) -> tuple[Stats, Stats]:
    """One sweep over the tiles: the row statistics and (when `both`) the column ones."""
    nr, nc = q.shape[0] // bs, k.shape[0] // bs
    acc = acc_dtype(q, k)
    scale_acc, bias_acc = scale.astype(acc), bias.astype(acc)
    mag, signed = _magnitude(scale_acc)
    axes = _joint_axes(q, k, scale, bias, meta)

    def row_block(cols, i):
        def col_block(carry, j):
            row, cols = carry
            t = signed(_tile(q, k, i, j, bs)[2])
            pos, rv, cv = _positives(meta, i, j, bs)
            if mode == SIGMOID:
                x = mag * t + bias_acc
                term = jax.nn.softplus(jnp.where(pos, -x, x))
                term = jnp.where(rv[:, None] & cv[None, :], term, 0.0)
                return (row._replace(l_neg=row.l_neg + term.sum(1)), cols), None
            single_row = single_col = None
            if meta.rpos is not None:
                rpos = _block(meta.rpos, i, bs)
                pos = jnp.arange(bs)[None, :] + j * bs == rpos[:, None]
                single_row, single_col = _single_positives(t, rpos, j * bs, bs)
            row = _update(row, t, mag, pos, cv[None, :], 1, single_row)
            if both:
                mine = jax.tree.map(lambda x: _block(x, j, bs), cols)
                mine = _update(mine, t, mag, pos, rv[:, None], 0, single_col)
                cols = jax.tree.map(
                    lambda x, b: jax.lax.dynamic_update_slice_in_dim(x, b, j * bs, 0), cols, mine
                )
            return (row, cols), None

        init = (_vary(_empty_stats(bs, acc), axes), cols)
        (row, cols), _ = jax.lax.scan(col_block, init, jnp.arange(nc))
        return cols, row

    cols0 = _vary(_empty_stats(k.shape[0] if both else 0, acc), axes)
    cols, rows = jax.lax.scan(row_block, cols0, jnp.arange(nr))
    return jax.tree.map(lambda x: x.reshape(-1), rows), cols


def combine_statistics(st: Stats, scale, axis_name: Any) -> Stats:
    """The statistics over all devices' rows of each column, from each device's own."""
    top = jax.lax.pmax(st.m, axis_name)
    rescale = jnp.exp(jnp.abs(scale.astype(st.m.dtype)) * (st.m - top))
    return Stats(
        top,
        jax.lax.psum(st.l_pos * rescale, axis_name),
        jax.lax.psum(st.l_neg * rescale, axis_name),
        jax.lax.psum(st.pos_sum, axis_name),
        jax.lax.psum(st.n_pos, axis_name),
    )


def _total(st: Stats) -> jax.Array:
    total = st.l_pos + st.l_neg
    # A row with no valid entry (masked or padding) has total 0: 1 keeps its terms finite.
    return jnp.where(total > 0, total, 1.0)


def _terms(mode, st: Stats, mag, valid) -> jax.Array:
    if mode == SIGMOID:
        return jnp.where(valid, st.l_neg, 0.0)
    ce = mag * st.m + jnp.log(_total(st)) - st.pos_sum / jnp.maximum(st.n_pos, 1)
    return jnp.where(valid, ce, 0.0)


def _softmax_grad(e, pos, valid, st: Stats, axis, single):
    """d term / d s for the tile's entries `e = exp(s - m)`, along `axis` (1: rows)."""

    def per(x):
        return jnp.expand_dims(x, axis)

    # Per row: the weights of the cross-entropy's gradient, so that an entry costs a
    # product, not a division.
    inv = 1.0 / _total(st)
    count = jnp.maximum(st.n_pos, 1).astype(e.dtype)
    neg_share = per(st.l_neg / count * inv)
    # Several positives: their spread about their mean, (e - l_pos/count) / l; one
    # positive: that spread is 0 exactly (e and l_pos may differ by rounding).
    if single:  # no labels: one positive per row
        d_pos = -neg_share
    else:
        several = per(st.n_pos > 1)
        d_pos = jnp.where(several, (e - per(st.l_pos / count)) * per(inv), 0.0) - neg_share
    return jnp.where(valid, jnp.where(pos, d_pos, e * per(inv)), 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def cross_entropies(mode, both, bs, col_share, q, k, scale, bias, meta, rows, cols):
    """Each row's term (and column's, when `both`) from the statistics of `statistics`.

    Differentiable in `q`, `k`, `scale` and `bias` (the statistics are constants whose
    dependence on them the backward accounts for). `col_share`: the column terms are
    computed alike on that many devices and each device's backward carries its rows'
    whole share of them (the caller sums the devices' copies divided by `col_share`).
    """
    return _ce_fwd(mode, both, bs, col_share, q, k, scale, bias, meta, rows, cols)[0]


def _ce_fwd(mode, both, bs, col_share, q, k, scale, bias, meta, rows, cols):
    axes = _joint_axes(q, k, scale, bias, meta, rows, cols)
    mag = jnp.abs(scale.astype(acc_dtype(q, k)))
    row_terms = _terms(mode, rows, mag, meta.rvalid)
    col_terms = _terms(mode, cols, mag, meta.cvalid) if both else jnp.zeros(0, row_terms.dtype)
    out = _vary((row_terms, col_terms), axes)
    return out, (q, k, scale, bias, meta, rows, cols)


def _ce_bwd(mode, both, bs, col_share, res, cts):
    q, k, scale, bias, meta, rows, cols = res
    acc = acc_dtype(q, k)
    g_row = jnp.where(meta.rvalid, cts[0].astype(acc), 0.0)
    g_col = jnp.where(meta.cvalid, col_share * cts[1].astype(acc), 0.0) if both else None
    nr, nc = q.shape[0] // bs, k.shape[0] // bs
    scale_acc, bias_acc = scale.astype(acc), bias.astype(acc)
    signed = _magnitude(scale_acc)[1]
    single = meta.rpos is not None
    axes = _joint_axes(q, k, scale, bias, meta, rows, cols, cts)

    # `scale` and `bias` gather sums of N^2 terms of both signs: summed per row first (the
    # rows' sums leave the loop as outputs), not into one running float32 number.
    def row_block(dk, i):
        row = jax.tree.map(lambda x: _block(x, i, bs), rows)
        gr = _block(g_row, i, bs)

        def col_block(carry, j):
            dq_b, dk, dscale, dbias = carry
            qb, kb, raw = _tile(q, k, i, j, bs)
            s = scale_acc * raw
            pos, rv, cv = _positives(meta, i, j, bs)
            if mode == SIGMOID:
                # d softplus(-z x) / dx = -z sigmoid(-z x): no 1 - sigmoid for positives.
                x = s + bias_acc
                g = jax.nn.sigmoid(jnp.where(pos, -x, x))
                ds = jnp.where(rv[:, None] & cv[None, :], gr[:, None] * jnp.where(pos, -g, g), 0.0)
                dbias = dbias + ds.sum(1)
            else:
                # mag * (t - m) as scale * (raw - sign * m): the same number, no select.
                e = jnp.exp(scale_acc * (raw - signed(row.m)[:, None]))
                ds = gr[:, None] * _softmax_grad(e, pos, cv[None, :], row, 1, single)
                if both:
                    col = jax.tree.map(lambda x: _block(x, j, bs), cols)
                    ec = jnp.exp(scale_acc * (raw - signed(col.m)[None, :]))
                    gc = _block(g_col, j, bs)[None, :]
                    ds = ds + gc * _softmax_grad(ec, pos, rv[:, None], col, 0, single)
            dscale = dscale + (ds * raw).sum(1)
            ds_in = (scale_acc * ds).astype(q.dtype)
            dq_b = dq_b + jnp.dot(ds_in, kb, preferred_element_type=acc)
            dk_b = _block(dk, j, bs) + jax.lax.dot_general(
                ds_in, qb, (((0,), (0,)), ((), ())), preferred_element_type=acc
            )
            dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_b, j * bs, 0)
            return (dq_b, dk, dscale, dbias), None

        init = _vary(
            (jnp.zeros((bs, q.shape[1]), acc), jnp.zeros(bs, acc), jnp.zeros(bs, acc)), axes
        )
        (dq_b, dk, dscale, dbias), _ = jax.lax.scan(
            col_block, (init[0], dk, *init[1:]), jnp.arange(nc)
        )
        return dk, (dq_b, dscale, dbias)

    dk, (dq, dscale, dbias) = jax.lax.scan(
        row_block, _vary(jnp.zeros(k.shape, acc), axes), jnp.arange(nr)
    )
    dq = _match_vma(dq.reshape(q.shape).astype(q.dtype), q)
    dk = _match_vma(dk.astype(k.dtype), k)
    dscale = _match_vma(dscale.sum().astype(scale.dtype), scale)
    dbias = _match_vma(dbias.sum().astype(bias.dtype), bias)
    zeros = jax.tree.map(jnp.zeros_like, (rows, cols))
    return (dq, dk, dscale, dbias, jax.tree.map(lambda _: None, meta), *zeros)


cross_entropies.defvjp(_ce_fwd, _ce_bwd)
