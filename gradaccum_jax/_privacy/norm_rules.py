"""One rule per primitive: each example's gradient norm at a site, and the clipped sum.

A site is an equation `z = op(A, W)` where `W` is a parameter input (see
`graph.py`). With `G` the gradient at `z`, one row per example, a rule answers two
questions for one parameter input of the site:

* `norm_sq`: each example's squared gradient norm with respect to `W`, and how it
  was found: `"ghost"` (from `A` and `G` alone, never forming the example's
  gradient) or `"layer"` (forming this one layer's per-example gradient, where that
  costs fewer flops and holds no more per example, or no ghost form is known);
  `choice` says which, and why, from the site's shapes alone;
* `weighted_sum`: `sum_i w_i dW_i`, the clipped sum at that input, where `w_i` is
  example `i`'s clip factor (zero for examples dropped): "book-keeping" (Bu et al.
  2023) computes it from `A` and `w * G` in one contraction, as the non-private
  gradient is computed, with no second backward pass.

Inside a `lax.scan` that reuses `W` in every iteration (a recurrent weight), an
example's gradient is the sum of every iteration's: `reused_norm_sq` and
`reused_weighted_sum` take the iterations' inputs and gradients stacked on leading
axes. The dense rule reads the iterations as more rows of `A` and `G`; the other
rules form each example's summed gradient.

Both work in float32 (wider dtypes kept): a 16-bit clip factor could let a clipped
example exceed the clip norm. Rows of dropped examples are selected away before any
product, so a NaN or infinity in them never reaches the sum (`0 * NaN` is NaN).

`RULES` maps a primitive's name to its rule; a primitive without an entry takes
`Rule`, which forms the layer's per-example gradient with JAX's own gradient of the
equation. To teach the fast path a new primitive, add a `Rule` subclass to `RULES`.

References:
    Goodfellow, 2015, "Efficient Per-Example Gradient Computations",
    https://arxiv.org/abs/1510.01799;
    Li et al., 2021, "Large Language Models Can Be Strong Differentially Private
    Learners", https://arxiv.org/abs/2110.05679;
    Bu et al., 2022, "Scalable and Efficient Training of Large Convolutional Neural
    Networks with Differential Privacy", https://arxiv.org/abs/2205.10683;
    Bu et al., 2023, "Differentially Private Optimization on Large Model at Small Cost",
    https://arxiv.org/abs/2210.00038
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from gradaccum_jax._privacy import graph, replay


def wide(dtype: Any) -> Any:
    """float32 for 16-bit floats; wider floats as they are."""
    return jnp.promote_types(dtype, jnp.float32)


def select_rows(x: jax.Array, keep: jax.Array) -> jax.Array:
    """`x` (examples on axis 0) with the rows of dropped examples replaced by zeros."""
    return jnp.where(keep.reshape(-1, *([1] * (x.ndim - 1))), x, jnp.zeros((), x.dtype))


def over_iterations(fn: Any, depth: int) -> Any:
    """`fn` mapped over the `depth` leading (scan iteration) axes of its array inputs
    (a literal, a Python or NumPy scalar, is the same in every iteration)."""
    if not depth:
        return fn

    def mapped(*args: Any) -> Any:
        in_axes = jax.tree.map(lambda x: 0 if isinstance(x, jax.Array) else None, args)
        inner = fn
        for _ in range(depth):
            inner = jax.vmap(inner, in_axes=in_axes)
        return inner(*args)

    return mapped


def sum_lead(x: jax.Array, depth: int) -> jax.Array:
    """`x` summed over its `depth` leading axes."""
    return jnp.sum(x, tuple(range(depth))) if depth else x


def clipped_total(per_example: jax.Array, weights: jax.Array, keep: jax.Array) -> jax.Array:
    """`sum_i weights_i g_i` over the kept rows of `per_example`, in float32 or wider:
    one select, product and sum that XLA fuses (no copy of `per_example`)."""
    g = per_example.astype(wide(per_example.dtype))
    return jnp.sum(select_rows(g * _column(weights, g), keep), 0)


class Rule:
    """The rule of a primitive with no cheaper form: the layer's per-example gradient.

    Each example's gradient with respect to the parameter input is JAX's gradient of
    the equation alone, at that example's inputs and output gradient.
    """

    # Whether the equation is linear in its parameter input, so that its gradient
    # there does not depend on the parameter's value.
    linear = False

    def applies(self, site: graph.Site, position: int) -> bool:
        del site, position
        return True

    def choice(self, site: graph.Site, position: int) -> tuple[str, str]:
        """`(method, why)`: the method `norm_sq` takes at `position`, and the costs that
        decided it (`""` where there was nothing to decide)."""
        del site, position
        return "layer", ""

    def norm_sq(
        self, site: graph.Site, position: int, inputs: list[Any], grads: list[Any]
    ) -> tuple[str, jax.Array, jax.Array | None]:
        """`(method, squared norms (n,), per-example gradients or None)` at `position`."""
        per_example = self.per_example(site, [position], inputs, grads)[0]
        g = per_example.astype(wide(per_example.dtype))
        return "layer", jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), 1), per_example

    def layer_gradient(
        self, site: graph.Site, position: int, inputs: list[Any], grads: list[Any]
    ) -> jax.Array:
        """Each example's gradient at `position`, `(n, *parameter shape)`, in float32 or
        wider (what the layer rule's norm is taken of)."""
        per_example = self.per_example(site, [position], inputs, grads)[0]
        return per_example.astype(wide(per_example.dtype))

    def weighted_sum(
        self,
        site: graph.Site,
        position: int,
        inputs: list[Any],
        grads: list[Any],
        weights: jax.Array,
        keep: jax.Array,
        per_example: jax.Array | None,
    ) -> jax.Array:
        """`sum_i weights_i dW_i` at `position`, in float32 or wider."""
        if per_example is None:
            per_example = self.per_example(site, [position], inputs, grads)[0]
        return clipped_total(per_example, weights, keep)

    def reused_norm_sq(
        self, site: graph.Site, position: int, inputs: list[Any], grads: list[Any], depth: int
    ) -> tuple[str, jax.Array, jax.Array | None]:
        """`norm_sq` where the `depth` innermost scans around the site reuse the parameter
        in every iteration: the inputs and gradients hold those iterations on `depth`
        leading axes, and each example's gradient is their sum, formed here."""

        def one(inp: list[Any], g: list[Any]) -> jax.Array:
            return self.per_example(site, [position], inp, g)[0]

        per_example = sum_lead(over_iterations(one, depth)(inputs, grads), depth)
        g = per_example.astype(wide(per_example.dtype))
        return "layer", jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), 1), per_example

    def reused_weighted_sum(
        self,
        site: graph.Site,
        position: int,
        inputs: list[Any],
        grads: list[Any],
        weights: jax.Array,
        keep: jax.Array,
        per_example: jax.Array | None,
        depth: int,
    ) -> jax.Array:
        """`weighted_sum` over the iterations of `reused_norm_sq`: it is linear in each
        example's gradient, so each iteration's sum adds up to the whole."""
        if per_example is not None:
            return clipped_total(per_example, weights, keep)

        def one(inp: list[Any], g: list[Any]) -> jax.Array:
            return self.weighted_sum(site, position, inp, g, weights, keep, None)

        return sum_lead(over_iterations(one, depth)(inputs, grads), depth)

    @staticmethod
    def per_example(
        site: graph.Site, positions: Sequence[int], inputs: list[Any], grads: list[Any]
    ) -> list[jax.Array]:
        """Each example's gradient at the parameter inputs `positions`, examples on axis 0,
        in the equation's own dtypes."""
        batched = [k == graph.BATCHED for k in site.kinds]
        float_outs = [i for i, g in enumerate(grads) if g is not None]

        def one(example_inputs: list[Any], example_grads: list[Any]) -> list[Any]:
            def op(*params: Any) -> list[Any]:
                values = list(example_inputs)
                for p, w in zip(positions, params, strict=True):
                    values[p] = w
                outs = replay.bind(site.eqn, values)
                return [outs[i] for i in float_outs]

            _, vjp = jax.vjp(op, *[example_inputs[p] for p in positions])
            return list(vjp([example_grads[i] for i in float_outs]))

        in_axes = (
            [0 if b else None for b in batched],
            [0 if g is not None else None for g in grads],
        )
        return jax.vmap(one, in_axes=in_axes)(inputs, grads)


class LinearRule(Rule):
    """Elementwise products and sums: linear in the parameter; the layer's gradient is
    the activation-sized product of `A` and `G`, formed per example."""

    linear = True


def _f32_bind(site: graph.Site, values: Sequence[Any]) -> list[Any]:
    """The site's equation on `values`, computing in float32 where it was 16-bit."""
    params = dict(site.eqn.params)
    preferred = params.get("preferred_element_type")
    if preferred is not None and jnp.issubdtype(preferred, jnp.floating):
        params["preferred_element_type"] = wide(preferred)
    return replay.bind(site.eqn, values, params)


class BookKeepingRule(Rule):
    """A rule whose clipped sum is one contraction of `A` with `w * G`.

    The rows of `w * G` of dropped examples are zeros. `A` is read as it is, which is
    exact because it holds no NaN or infinity: the batched program cleans the inputs
    of these sites and drops the examples it cleaned (`replay._cleaned`). Selecting
    the rows of `A` instead would copy every `A`.
    """

    linear = True

    def weighted_sum(self, site, position, inputs, grads, weights, keep, per_example):
        del per_example
        batched = [k == graph.BATCHED for k in site.kinds]

        values = [
            x.astype(wide(x.dtype)) if b and _is_float(x) else x
            for x, b in zip(inputs, batched, strict=True)
        ]
        (float_out,) = [i for i, g in enumerate(grads) if g is not None]
        g = grads[float_out]
        cot = select_rows(g.astype(wide(g.dtype)) * _column(weights, g), keep)
        # The gradient of a linear equation does not read the parameter: zeros will do
        # (typed like the parameter, varying over the mesh axes where it varies).
        w = jnp.zeros_like(inputs[position], wide(inputs[position].dtype))

        def op(param: jax.Array) -> jax.Array:
            vals = list(values)
            vals[position] = param
            in_axes = [0 if b else None for b in batched]
            return jax.vmap(lambda *xs: _f32_bind(site, xs)[float_out], in_axes=in_axes)(*vals)

        _, vjp = jax.vjp(op, w)
        (total,) = vjp(cot.astype(jax.eval_shape(op, w).dtype))
        return total.astype(wide(total.dtype))


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _column(weights: jax.Array, like: jax.Array) -> jax.Array:
    return weights.astype(wide(like.dtype)).reshape(-1, *([1] * (like.ndim - 1)))


def cheaper(shapes: str, ghost: tuple[int, int], layer: tuple[int, int]) -> tuple[str, str]:
    """`(method, why)` between a ghost norm and the layer's gradient, each given as
    `(flops, floats held per example)`.

    The layer's gradient is taken only where it costs fewer flops and holds no more
    per example: a head far wider than the sequence is long costs about as many flops
    either way, but its per-example gradient can hold a hundred times the Gram
    matrices. `shapes` names the sizes in `why`.
    """
    (ghost_flops, ghost_floats), (layer_flops, layer_floats) = ghost, layer
    # (An empty layer costs nothing either way: `max` keeps the ratios finite.)
    flops, floats = layer_flops / max(ghost_flops, 1), layer_floats / max(ghost_floats, 1)
    if layer_flops < ghost_flops and layer_floats <= ghost_floats:
        return "layer", f"layer: {shapes}: {flops:.2g}x ghost's flops, {floats:.2g}x its bytes"
    if layer_flops < ghost_flops:
        return "ghost", f"ghost: {shapes}: layer would hold {floats:.3g}x the bytes"
    return "ghost", f"ghost: {shapes}: layer would take {flops:.3g}x the flops"


def dense_choice(t: int, d_in: int, d_out: int, iterations: int = 1) -> tuple[str, str]:
    """`(method, why)` for a dense layer's norms, per example `T` rows `d_in` wide in
    and `d_out` wide out: two `T x T` Gram matrices for `T^2 (d_in + d_out)` flops, or
    the `d_in x d_out` gradient for `T d_in d_out` (see `cheaper`). A weight reused by
    `iterations` iterations of a scan has `T` rows in each of them."""
    rows = f"T={t}" if iterations == 1 else f"T={t * iterations} ({t} x {iterations} iterations)"
    t = t * iterations
    ghost = (t * t * (d_in + d_out), 2 * t * t)
    return cheaper(f"{rows}, d_in={d_in}, d_out={d_out}", ghost, (t * d_in * d_out, d_in * d_out))


class DotGeneralRule(BookKeepingRule):
    """`dot_general` with a parameter operand (dense, einsum, attention projections).

    Per example, with `A` the other operand's rows (`T` of them, `d_in` wide, per
    batch dimension of the contraction) and `G` the output gradient's (`d_out`
    wide): the gradient is `A^T G` and

        ||A^T G||_F^2 = sum_{t,s} (A A^T)_{ts} (G G^T)_{ts},

    which costs `T^2 (d_in + d_out)` flops and holds two `T x T` matrices, against
    `T d_in d_out` flops and `d_in d_out` floats for forming `A^T G`. `A^T G` is
    formed only where it costs fewer flops and holds no more (Bu et al. 2022's mixed
    ghost norm, with memory counted too: an LM head of `128 x 32768` on 128 tokens
    costs about the same either way, but `A^T G` would hold 128 times the Gram
    matrices); with `T = 1` the ghost norm is `||a||^2 ||g||^2`.

    A weight a scan reuses in every iteration (`h @ W_h` in a recurrence) has, per
    example, the gradient `sum_l A_l^T G_l`: the same product with the iterations'
    rows stacked, so the same norms on `L T` rows.
    """

    def applies(self, site, position):
        return site.kinds[1 - position] == graph.BATCHED

    def choice(self, site, position):
        _, t, d_in, d_out = self._sizes(site, position)
        return dense_choice(t, d_in, d_out, site.reused_iterations(position))

    def norm_sq(self, site, position, inputs, grads):
        a, g = self._canonical(site, position, inputs[1 - position], grads[0])
        return self._norm_sq(site, position, a, g)

    def reused_norm_sq(self, site, position, inputs, grads, depth):
        a, g = self._stacked(site, position, inputs[1 - position], grads[0], depth)
        return self._norm_sq(site, position, _as_rows(a), _as_rows(g))

    def _norm_sq(
        self, site: graph.Site, position: int, a: jax.Array, g: jax.Array
    ) -> tuple[str, jax.Array, None]:
        """The norms from `A` and `G` in the layout of `_canonical`."""
        t = a.shape[2]
        if self.choice(site, position)[0] == "ghost":
            if t == 1:
                sq = jnp.sum(jnp.square(a), (2, 3)) * jnp.sum(jnp.square(g), (2, 3))
            else:
                sq = jnp.sum(
                    jnp.einsum("nbti,nbsi->nbts", a, a) * jnp.einsum("nbto,nbso->nbts", g, g),
                    (2, 3),
                )
            return "ghost", jnp.sum(sq, 1), None
        per_layer = jnp.einsum("nbto,nbti->nboi", g, a)  # see weighted_sum
        return "layer", jnp.sum(jnp.square(per_layer), (1, 2, 3)), None

    def weighted_sum(self, site, position, inputs, grads, weights, keep, per_example):
        del per_example
        a, g = self._canonical(site, position, inputs[1 - position], grads[0])
        return self._book_keeping(site, position, a, g, weights, keep)

    def layer_gradient(self, site, position, inputs, grads):
        a, g = self._canonical(site, position, inputs[1 - position], grads[0])
        per_example = jnp.einsum("nbti,nbto->nbio", a, g)
        return jax.vmap(lambda total: self._to_param_layout(site, position, total))(per_example)

    def reused_weighted_sum(self, site, position, inputs, grads, weights, keep, per_example, depth):
        del per_example
        a, g = self._stacked(site, position, inputs[1 - position], grads[0], depth)
        cot = jax.vmap(lambda g: select_rows(g * _column(weights, g), keep))(g)
        # Contracted in the scan's layout, iterations then examples: one product over
        # all the rows, with neither operand copied (the norms' layout would copy both).
        total = jnp.swapaxes(jnp.einsum("lnbto,lnbti->boi", cot, a), 1, 2)
        return self._to_param_layout(site, position, total)

    def _book_keeping(
        self,
        site: graph.Site,
        position: int,
        a: jax.Array,
        g: jax.Array,
        weights: jax.Array,
        keep: jax.Array,
    ) -> jax.Array:
        """`sum_i w_i A_i^T G_i` from `A` and `G` in the layout of `_canonical`."""
        cot = select_rows(g * _column(weights, g), keep)
        # The product made in the (examples, T)-major layout of `cot`, a fresh buffer
        # whose layout XLA is free to choose, rather than of `A`, which it would copy.
        total = jnp.swapaxes(jnp.einsum("nbto,nbti->boi", cot, a), 1, 2)
        return self._to_param_layout(site, position, total)

    @staticmethod
    def _to_param_layout(site: graph.Site, position: int, total: jax.Array) -> jax.Array:
        """`(batch, d_in, d_out)` back to the parameter operand's shape and order."""
        (lc, rc), (lb, rb) = site.eqn.params["dimension_numbers"]
        contract, batch = (lc, lb) if position == 0 else (rc, rb)
        shape = site.eqn.invars[position].aval.shape
        free = [d for d in range(len(shape)) if d not in (*contract, *batch)]
        order = [*batch, *contract, *free]
        total = total.reshape([shape[d] for d in order])
        return jnp.transpose(total, [int(d) for d in np.argsort(order)])

    @staticmethod
    def _other_dims(site: graph.Site, position: int) -> tuple[list[int], list[int], list[int]]:
        """The other operand's batch, free and contracted dimensions."""
        (lc, rc), (lb, rb) = site.eqn.params["dimension_numbers"]
        contract, batch = (rc, rb) if position == 0 else (lc, lb)
        ndim = len(site.eqn.invars[1 - position].aval.shape)
        free = [d for d in range(ndim) if d not in (*contract, *batch)]
        return [int(d) for d in batch], free, [int(d) for d in contract]

    @classmethod
    def _sizes(cls, site: graph.Site, position: int) -> tuple[int, int, int, int]:
        """`(batch, T, d_in, d_out)` of one example."""
        shape = site.eqn.invars[1 - position].aval.shape
        size = lambda dims: int(np.prod([shape[d] for d in dims], dtype=int))  # noqa: E731
        batch, free, contract = cls._other_dims(site, position)
        nb, t = size(batch), size(free)
        return nb, t, size(contract), int(np.prod(site.eqn.outvars[0].aval.shape)) // max(nb * t, 1)

    @classmethod
    def _stacked(
        cls, site: graph.Site, position: int, other: jax.Array, g: jax.Array, depth: int
    ) -> tuple[jax.Array, jax.Array]:
        """`A` and `G` as in `_canonical`, from `depth` leading axes of iterations, the
        iterations on one leading axis: `(L, n, batch, T, d)`."""

        def one(o: jax.Array, gi: jax.Array) -> tuple[jax.Array, jax.Array]:
            return cls._canonical(site, position, o, gi)

        a, g = over_iterations(one, depth)(other, g)
        return a.reshape(-1, *a.shape[depth:]), g.reshape(-1, *g.shape[depth:])

    @classmethod
    def _canonical(
        cls, site: graph.Site, position: int, other: jax.Array, g: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """`A` as `(n, batch, T, d_in)` and `G` as `(n, batch, T, d_out)`, in float32.

        The output's dimensions are the contraction's batch dimensions, then the left
        operand's free ones, then the right's.
        """
        batch, free, contract = cls._other_dims(site, position)
        nb, t, d_in, _ = cls._sizes(site, position)
        n = other.shape[0]
        a = jnp.transpose(other, [0, *[1 + d for d in (*batch, *free, *contract)]])
        a = a.reshape(n, nb, t, d_in)
        if position == 0:  # the parameter is the left operand: its free dims come first
            g = jnp.swapaxes(g.reshape(n, nb, -1, t), 2, 3)
        else:
            g = g.reshape(n, nb, t, -1)
        return a.astype(wide(a.dtype)), g.astype(wide(g.dtype))


def _as_rows(x: jax.Array) -> jax.Array:
    """`(L, n, batch, T, d)` as `(n, batch, L T, d)`: the iterations' rows stacked."""
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape(*x.shape[:2], -1, x.shape[-1])


class GatherRule(BookKeepingRule):
    """An embedding lookup: rows of a `(V, D)` table gathered by token ids.

    Per example, with tokens `k_t` and output gradients `g_t`, the table's gradient
    adds `g_t` to row `k_t`, and

        ||dE||^2 = sum_{t,s} [k_t = k_s] g_t . g_s

    (`T^2 D` flops and a `T x T` matrix per example, against `V D` flops and floats
    for the table's gradient). The table's gradient is formed only where it costs
    fewer flops and holds no more (`T^2 > V` and `V D <= T^2`): a long sequence on a
    wide table still takes the ghost norm. Ids outside the table contribute nothing
    where the lookup fills (the default `mode`), and are clamped where it clamps, as
    the lookup does.
    """

    def applies(self, site, position):
        if position != 0 or site.kinds[1] != graph.BATCHED:
            return False
        p = site.eqn.params
        dims = p["dimension_numbers"]
        table = site.eqn.invars[0].aval
        return (
            table.ndim == 2
            and tuple(dims.collapsed_slice_dims) == (0,)
            and tuple(dims.start_index_map) == (0,)
            and not tuple(getattr(dims, "operand_batching_dims", ()))
            and tuple(p["slice_sizes"]) == (1, table.shape[1])
            and tuple(dims.offset_dims) == (site.eqn.outvars[0].aval.ndim - 1,)
        )

    def choice(self, site, position):
        vocab, d = site.eqn.invars[0].aval.shape
        t = int(np.prod(site.eqn.invars[1].aval.shape))
        return cheaper(f"T={t}, V={vocab}, D={d}", (t * t * d, t * t), (vocab * d, vocab * d))

    def norm_sq(self, site, position, inputs, grads):
        if self.choice(site, position)[0] == "layer":
            return super().norm_sq(site, position, inputs, grads)
        vocab = site.eqn.invars[0].aval.shape[0]
        ids = inputs[1]
        n = ids.shape[0]
        ids = ids.reshape(n, -1)
        g = grads[0].reshape(n, ids.shape[1], -1)
        mode = str(site.eqn.params.get("mode", ""))
        if "CLIP" in mode or "PROMISE" in mode:
            valid = jnp.ones(ids.shape, bool)
            ids = jnp.clip(ids, 0, vocab - 1)
        else:
            valid = (ids >= 0) & (ids < vocab)
        g = jnp.where(valid[..., None], g, 0).astype(wide(g.dtype))
        same = ids[:, :, None] == ids[:, None, :]
        dots = jnp.einsum("ntd,nsd->nts", g, g)
        return "ghost", jnp.sum(jnp.where(same, dots, 0), (1, 2)), None


class ConvRule(BookKeepingRule):
    """`conv_general_dilated` with a parameter kernel (any stride, padding, dilation
    and feature groups).

    Per example the kernel's gradient is that of a dense layer on the input's patches
    (`T` output positions, each a row of `C_in k` input values): the dense rule's
    norms on the patches and output gradients, per feature group; the clipped sum is
    the convolution's own kernel gradient with `w * G`.
    """

    def applies(self, site, position):
        p = site.eqn.params
        return position == 1 and site.kinds[0] == graph.BATCHED and p["batch_group_count"] == 1

    def choice(self, site, position):
        # Per feature group, `T` output positions, `d_in` the input values of a patch.
        dn = site.eqn.params["dimension_numbers"]
        kernel, out = site.eqn.invars[1].aval.shape, site.eqn.outvars[0].aval.shape
        t = int(np.prod([out[d] for d in dn.out_spec[2:]], dtype=int))
        d_in = int(np.prod([kernel[d] for d in dn.rhs_spec[1:]], dtype=int))
        d_out = kernel[dn.rhs_spec[0]] // site.eqn.params["feature_group_count"]
        return dense_choice(t, d_in, d_out)

    def norm_sq(self, site, position, inputs, grads):
        dn = site.eqn.params["dimension_numbers"]
        groups = site.eqn.params["feature_group_count"]
        n = inputs[0].shape[0]
        # The patches' rows are the input shifted by each kernel offset: their Gram
        # matrix, or the layer's gradient, is a sum over the offsets, so the patches are
        # never stacked (on a CPU the stack cost as much as the rest of the norms).
        shifted = [
            x.astype(wide(x.dtype)).reshape(n, x.shape[1], groups, -1)
            for x in jax.vmap(lambda x: _shifted(site, x))(inputs[0])
        ]
        g = jnp.moveaxis(grads[0], 1 + dn.out_spec[1], -1)
        g = g.reshape(n, shifted[0].shape[1], groups, -1).astype(wide(g.dtype))
        if self.choice(site, position)[0] == "ghost":
            gram = sum(jnp.einsum("ntgc,nsgc->ngts", x, x) for x in shifted)
            sq = jnp.sum(gram * jnp.einsum("ntgo,nsgo->ngts", g, g), (1, 2, 3))
            return "ghost", sq, None
        # G^T A, transposing the smaller G (see DotGeneralRule.weighted_sum).
        sq = sum(
            jnp.sum(jnp.square(jnp.einsum("ntgo,ntgc->ngoc", g, x)), (1, 2, 3)) for x in shifted
        )
        return "layer", sq, None

    def weighted_sum(self, site, position, inputs, grads, weights, keep, per_example):
        # The convolution of the whole chunk, its examples in the batch dimension: XLA
        # runs its kernel gradient as it runs the non-private one (mapped over the
        # examples, it picks a layout several times slower on a CPU).
        del per_example
        dn = site.eqn.params["dimension_numbers"]
        x = inputs[0].astype(wide(inputs[0].dtype))
        g = grads[0].astype(wide(grads[0].dtype))
        cot = select_rows(g * _column(weights, g), keep)
        x, cot = _into_batch(x, dn.lhs_spec[0]), _into_batch(cot, dn.out_spec[0])
        kernel = jnp.zeros_like(inputs[1], wide(inputs[1].dtype))

        def conv(k: jax.Array) -> jax.Array:
            return _f32_bind(site, [x, k])[0]

        _, vjp = jax.vjp(conv, kernel)
        return vjp(cot)[0]


def _shifted(site: graph.Site, x: jax.Array) -> list[jax.Array]:
    """One example's convolution input seen through each kernel offset: `k` arrays of
    `(T, C_in)`, row `t` the input values that offset multiplies for output position `t`.

    Strided slices of the padded (and, with `lhs_dilation`, dilated) input. Stacked
    along a last axis they are the patches of `jax.lax.conv_general_dilated_patches`
    (channel-major), a grouped convolution that is several times slower on a CPU.
    """
    p = site.eqn.params
    dn = p["dimension_numbers"]
    kernel = [site.eqn.invars[1].aval.shape[d] for d in dn.rhs_spec[2:]]
    out = [site.eqn.outvars[0].aval.shape[d] for d in dn.out_spec[2:]]
    # Channels last: (1, *spatial, C).
    x = jnp.transpose(x, [dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1]])
    config = [
        (0, 0, 0),
        *((lo, hi, d - 1) for (lo, hi), d in zip(p["padding"], p["lhs_dilation"], strict=True)),
        (0, 0, 0),
    ]
    x = jax.lax.pad(x, jnp.zeros((), x.dtype), config)
    strides = p["window_strides"]
    views = []
    for offsets in itertools.product(*(range(k) for k in kernel)):
        start = [o * d for o, d in zip(offsets, p["rhs_dilation"], strict=True)]
        limit = [s + (n - 1) * st + 1 for s, n, st in zip(start, out, strides, strict=True)]
        view = jax.lax.slice(x, [0, *start, 0], [1, *limit, x.shape[-1]], [1, *strides, 1])
        views.append(view.reshape(int(np.prod(out)), x.shape[-1]))
    return views


def _into_batch(x: jax.Array, batch_dim: int) -> jax.Array:
    """`(n, ...)` with a batch dimension of one at `batch_dim` of the rest: the `n`
    examples moved into that batch dimension."""
    return jnp.squeeze(jnp.moveaxis(x, 0, batch_dim + 1), batch_dim)


# Primitives linear in each operand: the gradient at a parameter operand needs only
# the other operands, so the batched program does not hand out the parameter.
_LINEAR = ("mul", "add", "sub", "neg", "add_any", "reduce_sum")

RULES: dict[str, Rule] = {
    "dot_general": DotGeneralRule(),
    "conv_general_dilated": ConvRule(),
    "gather": GatherRule(),
    **{name: LinearRule() for name in _LINEAR},
}


def rule_for(site: graph.Site, position: int) -> Rule:
    """The rule for a parameter input of a site (the generic one where none applies)."""
    found = RULES.get(site.name)
    return found if found is not None and found.applies(site, position) else _GENERIC


_GENERIC = Rule()


def transpose_chain(total: jax.Array, chain: Sequence[graph.Step]) -> jax.Array:
    """Moves a gradient at a site's parameter input back to its leaf, through the steps
    of its origin (each keeps the norm). Stacked scan iterations lead `total`."""
    depth = sum(step.primitive == "slice" for step in chain)
    for step in reversed(chain):
        if step.primitive == "slice":
            depth -= 1
            continue
        lead = total.shape[:depth]
        params = dict(step.params)
        if step.primitive == "transpose":
            inverse = [int(d) for d in np.argsort(params["permutation"])]
            total = jnp.transpose(total, [*range(depth), *(depth + d for d in inverse)])
        elif step.primitive == "rev":
            total = jnp.flip(total, [depth + d for d in params["dimensions"]])
        elif step.primitive == "shift":  # a constant added: the gradient passes as it is
            continue
        else:  # reshape-like, or a change of dtype: the entries stay in order
            total = total.reshape(*lead, *step.in_shape)
    return total


def is_literal(var: Any) -> bool:
    return isinstance(var, core.Literal)
