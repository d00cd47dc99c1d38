"""Clipped sums from per-example gradient norms, without per-example gradients.

`Program` is what the fast path knows of a loss at one set of argument shapes: the
loss traced for one example, the analysis of where each differentiated leaf meets
the batch (`graph.py`), and for each leaf the way its per-example norms are found:

* `"ghost"`: from the layer's inputs `A` and output gradients `G`, never forming an
  example's gradient (a dense layer, an embedding lookup, a recurrent weight with
  its iterations' rows stacked);
* `"layer"`: the leaf's one layer forms its per-example gradient (convolutions,
  normalisation scales and biases, dense layers on sequences long enough that this
  costs fewer flops and holds no more per example than the ghost norm; the leaf's
  `why` gives the numbers);
* `"materialized"`: the leaf's per-example gradient is formed from all its uses
  (a tied embedding, a block applied twice, a weight made from several leaves);
* `"per_example"`: the leaf meets something the analysis does not follow; its
  per-example gradients come from the same backward pass (the leaf is copied per
  example), as on the per-example path;
* `"unused"`: the loss does not depend on it (a zero gradient).

`run` computes one chunk: one batched forward with taps, one backward for the
gradients at the taps, the norms, the clip factors, and the clipped sums by
book-keeping (ghost and layer leaves) or from the per-example gradients
(materialized and per-example leaves).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax._privacy import graph, norm_rules, replay
from gradaccum_jax._privacy.graph import BATCHED, CONST, DERIVED


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one differentiated leaf's per-example norms are found.

    Attributes:
        path: The leaf's path in the differentiated arguments (as `jax.tree_util.keystr`).
        method: One of `"ghost"`, `"layer"`, `"materialized"`, `"per_example"`, `"unused"`.
        uses: The primitives where the leaf meets the batch, one per use.
        why: For `"per_example"`, what the fast path could not follow; for `"ghost"`
            and `"layer"` where the rule chose between the two, the sizes and the
            ratios of flops or bytes that decided (`""` otherwise).
        recomputed: Whether the leaf's layer is inside a remat whose inputs are
            recomputed for it in the backward pass (`clipped_grad(..., remat=
            "auto")` or `"recompute"`): its norms and clipped sum are computed there.
        second_pass: For a recomputed leaf, whether its clipped sum takes a second
            backward pass (the remats recomputed again, once the clip factors are
            known); `False` where the first pass keeps its per-example gradient
            (`remat="auto"`, see `clipped_grad`).
    """

    path: str
    method: str
    uses: tuple[str, ...] = ()
    why: str = ""
    recomputed: bool = False
    second_pass: bool = False


@dataclasses.dataclass(frozen=True)
class ClippingPlan:
    """How `clipped_grad` finds each differentiated leaf's per-example norms.

    Attributes:
        leaves: One `LeafPlan` per leaf, in the order of `jax.tree.leaves`.
    """

    leaves: tuple[LeafPlan, ...]

    def __init__(self, leaves: Sequence[LeafPlan]):
        object.__setattr__(self, "leaves", tuple(leaves))

    def __iter__(self) -> Any:
        return iter(self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)

    @property
    def methods(self) -> dict[str, str]:
        """Each leaf's path and method."""
        return {leaf.path: leaf.method for leaf in self.leaves}

    def __str__(self) -> str:
        rows = [("leaf", "method", "where it meets the batch")]
        for leaf in self.leaves:
            where = ", ".join(leaf.uses) + (f" ({leaf.why})" if leaf.why else "")
            if leaf.recomputed:
                where += " [in remat's backward pass" + (
                    ", its sum in a second one]" if leaf.second_pass else "]"
                )
            rows.append((leaf.path, leaf.method, where))
        widths = [max(len(row[i]) for row in rows) for i in range(2)]
        return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}".rstrip() for a, b, c in rows)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the flat inputs of the per-example program come from."""

    kinds: tuple[str, ...]
    leaf_of: tuple[int | None, ...]
    n_leaves: int


class Program:
    """The fast path's knowledge of one loss at one set of shapes (see the module)."""

    def __init__(self, closed: Any, layout: Layout, paths: Sequence[str], *, remat: str = "auto"):
        self.closed, self.layout = closed, layout
        self.per_example: dict[int, str] = {}
        while True:
            try:
                analysis = graph.analyze(
                    closed, layout.kinds, layout.leaf_of, frozenset(self.per_example)
                )
            except graph.Unsupported as unsupported:
                self._fall_back(unsupported.leaves, unsupported.why)
                continue
            loss = analysis.outputs[0]
            if loss.kind == DERIVED:
                self._fall_back(loss.origin.leaves, "the loss depends on it with no example")
                continue
            break
        self.analysis = analysis
        uses: dict[int, list[tuple[int, int]]] = {i: [] for i in range(layout.n_leaves)}
        for site in analysis.sites:
            for k, origin in enumerate(site.origins):
                for leaf in origin.leaves:
                    uses[leaf].append((site.index, k))
        self.fast: dict[int, tuple[int, int]] = {}
        self.materialized: list[int] = []
        for leaf, found in uses.items():
            if leaf in self.per_example or not found:
                continue
            site_index, k = found[0]
            if len(found) == 1 and analysis.sites[site_index].origins[k].chain is not None:
                self.fast[leaf] = found[0]
            else:
                self.materialized.append(leaf)
        self.mat_positions = sorted({use for leaf in self.materialized for use in uses[leaf]})
        self.probed = self._probed() if remat != "save" else {}
        # Outputs whose gradient is an earlier output's: no tap of their own.
        self.same_gradient = {
            (site.index, j): earlier
            for site in analysis.sites
            if site.index not in self.probed
            for j, earlier in site.same_gradient.items()
            if earlier[0] not in self.probed
        }
        self.held = remat == "auto" and bool(self.probed) and all(map(self._holds, self.probed))
        self.leaves = [self._leaf_plan(i, paths[i], uses[i]) for i in range(layout.n_leaves)]

    def _probed(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """The sites inside a remat whose rules run in the backward pass (`Probe`), each
        with its fast leaves as `(k, leaf)`: every parameter input a fast leaf's, each
        iteration's own (a weight reused by every iteration of a scan needs all of
        them at once)."""
        in_remat: set[int] = set()
        for block in self.analysis.blocks:
            if block.remat:
                in_remat.update(range(block.first, block.end))
        materialized = {s for s, _ in self.mat_positions}
        by_site: dict[int, list[tuple[int, int]]] = {}
        for leaf, (s, k) in self.fast.items():
            by_site.setdefault(s, []).append((k, leaf))
        probed = {}
        for s, entries in sorted(by_site.items()):
            site = self.analysis.sites[s]
            if s not in in_remat or s in materialized:
                continue
            if any(site.reused_depth(site.derived[k]) for k, _ in entries):
                continue
            probed[s] = tuple(sorted(entries))
        return probed

    def _holds(self, s: int) -> bool:
        """Whether a probed site can keep its per-example gradients from the first
        backward pass: each takes the layer rule (no more flops or bytes than the ghost
        norm) and holds no more per example than the site's batched inputs, which is
        what `remat="save"` would hold for it."""
        site = self.analysis.sites[s]
        inputs = sum(
            int(np.prod(var.aval.shape))
            for kind, var in zip(site.kinds, site.eqn.invars, strict=True)
            if kind == BATCHED and not norm_rules.is_literal(var)
        )
        for k, _ in self.probed[s]:
            position = site.derived[k]
            if self._method(site, position)[0] != "layer":
                return False
            if int(np.prod(site.eqn.invars[position].aval.shape)) > inputs:
                return False
        return True

    def _fall_back(self, leaves: frozenset[int], why: str) -> None:
        new = leaves - set(self.per_example)
        if not new:
            raise AssertionError(f"the fast path's analysis did not converge: {why}")
        self.per_example.update(dict.fromkeys(new, why))

    def _leaf_plan(self, leaf: int, path: str, uses: list[tuple[int, int]]) -> LeafPlan:
        names = tuple(self.analysis.sites[s].name for s, _ in uses)
        if leaf in self.per_example:
            return LeafPlan(path, "per_example", names, self.per_example[leaf])
        if not uses:
            return LeafPlan(path, "unused")
        if leaf in self.fast:
            site_index, k = self.fast[leaf]
            site = self.analysis.sites[site_index]
            method, why = self._method(site, site.derived[k])
            probed = site_index in self.probed
            return LeafPlan(path, method, names, why, probed, probed and not self.held)
        return LeafPlan(path, "materialized", names)

    def _method(self, site: graph.Site, position: int) -> tuple[str, str]:
        """`(method, why)` of a fast leaf's site. The method is what the rule's
        `norm_sq` says, found without computing; the reason is its `choice`'s where the
        two agree (a rule that overrides `norm_sq` alone may take another way)."""
        rule = norm_rules.rule_for(site, position)
        n = 2
        own = _own_iterations(site, position)
        inputs = _placeholders(site, n, site.lengths[own:])
        grads = [
            None if t is None else jax.ShapeDtypeStruct(t.shape[own:], t.dtype)
            for t in replay.tap_shapes(self.analysis, n)[site.index]
        ]
        method: list[str] = []

        def probe(inputs: list[Any], grads: list[Any]) -> jax.Array:
            found, sq, _ = _leaf_norm_sq(rule, site, position, inputs, grads)
            method.append(found)
            return sq

        jax.eval_shape(probe, inputs, grads)
        chosen, why = rule.choice(site, position)
        return method[0], why if chosen == method[0] else ""

    def clean(self) -> frozenset[int]:
        """The sites whose clipped sum contracts their batched inputs as they are: the
        batched program cleans those inputs of non-finite values (`replay._cleaned`)."""
        found = set()
        for s, k in self.fast.values():
            site = self.analysis.sites[s]
            if isinstance(norm_rules.rule_for(site, site.derived[k]), norm_rules.BookKeepingRule):
                found.add(s)
        return frozenset(found)

    def wanted(self) -> frozenset[int]:
        """The sites whose parameter inputs the batched program must hand out."""
        wanted = set()
        for site in self.analysis.sites:
            for position in site.derived:
                if not norm_rules.rule_for(site, position).linear:
                    wanted.add(site.index)
        return frozenset(wanted)


def _placeholders(site: graph.Site, n: int, lead: tuple[int, ...] = ()) -> list[Any]:
    """Shape-only stand-ins for a site's inputs, `n` examples, stacked over `lead`
    iterations (literals excepted)."""
    out = []
    for kind, var in zip(site.kinds, site.eqn.invars, strict=True):
        if norm_rules.is_literal(var):
            out.append(var.val)
        elif kind == BATCHED:
            out.append(jax.ShapeDtypeStruct((*lead, n, *var.aval.shape), var.aval.dtype))
        else:
            out.append(jax.ShapeDtypeStruct((*lead, *var.aval.shape), var.aval.dtype))
    return out


def _site_inputs(
    site: graph.Site, exports: list[Any], params: list[Any] | None, vary: Any
) -> list[Any]:
    """A site's inputs, stacked over the iterations of its scans: exported values,
    literals (not stacked), and the parameter inputs (zeros where the rule is linear
    and does not read them)."""
    exported = iter(exports)
    given = iter(params) if params is not None else None
    out = []
    for kind, var in zip(site.kinds, site.eqn.invars, strict=True):
        if kind == DERIVED:
            out.append(
                next(given)
                if given is not None
                else vary(jnp.zeros((*site.lengths, *var.aval.shape), var.aval.dtype))
            )
        elif norm_rules.is_literal(var):
            out.append(var.val)
        else:
            out.append(next(exported))
    return out


def _leaf_norm_sq(
    rule: norm_rules.Rule, site: graph.Site, position: int, inputs: list[Any], grads: list[Any]
) -> tuple[str, jax.Array, jax.Array | None]:
    """The rule's norms at one site's parameter input, given the inputs and gradients of
    the iterations that reuse it (none, or the innermost scans' on leading axes)."""
    depth = site.reused_depth(position)
    if depth:
        return rule.reused_norm_sq(site, position, inputs, grads, depth)
    return rule.norm_sq(site, position, inputs, grads)


def _leaf_weighted_sum(
    rule: norm_rules.Rule,
    site: graph.Site,
    position: int,
    inputs: list[Any],
    grads: list[Any],
    weights: jax.Array,
    keep: jax.Array,
    per_example: jax.Array | None,
) -> jax.Array:
    """The rule's clipped sum at one site's parameter input (see `_leaf_norm_sq`)."""
    depth = site.reused_depth(position)
    if depth:
        return rule.reused_weighted_sum(
            site, position, inputs, grads, weights, keep, per_example, depth
        )
    return rule.weighted_sum(site, position, inputs, grads, weights, keep, per_example)


def _own_iterations(site: graph.Site, position: int) -> int:
    """How many scans around the site give each iteration its own parameter input: the
    fast path maps the rules over those, and hands them the reused ones."""
    return len(site.lengths) - site.reused_depth(position)


class ChunkResult(NamedTuple):
    """One chunk's sums: the loss, the aux (per example), the clipped gradient leaves,
    each example's gradient norm (0 for padding), and the kept-examples mask."""

    loss_sum: jax.Array
    aux: list[jax.Array]
    grads: list[jax.Array]
    norms: jax.Array


def run(
    program: Program,
    inputs: Sequence[Any],
    padding: jax.Array,
    clip: float,
    acc_dtypes: Sequence[Any],
    vary: Any = lambda x: x,
) -> ChunkResult:
    """The clipped sums of one chunk of examples.

    Args:
        program: The program, for these shapes.
        inputs: The per-example program's flat inputs, batched ones with the examples
            on axis 0.
        padding: `(n,)` bool, the padding examples.
        clip: The clip norm.
        acc_dtypes: The dtype of each leaf's sum.
        vary: Types a pytree as varying along the mesh axes the batch varies along
            (inside `jax.shard_map`): the taps and the stand-ins for parameters are
            differentiated, and the gradient of a value replicated over the devices
            would be summed over them.
    """
    chunk = _Chunk(program, inputs, padding.shape[0], vary)
    norms_sq, per_example = chunk.norms_sq()
    finite = chunk.finite()
    keep = ~padding & jnp.isfinite(chunk.losses) & jnp.isfinite(norms_sq) & finite
    norms = jnp.sqrt(norms_sq)
    factor = jnp.where(keep, jnp.minimum(1.0, clip / norms), 0.0)
    grads = chunk.sums(factor, keep, per_example)
    for leaf, i in chunk.leaf_inputs.items():
        shape = jnp.shape(inputs[i])
        g = grads.get(leaf)
        grads[leaf] = (
            jnp.zeros(shape, acc_dtypes[leaf])
            if g is None
            else g.reshape(shape).astype(acc_dtypes[leaf])
        )
    losses = chunk.losses
    loss_sum = jnp.sum(
        jnp.where(keep, losses, 0), dtype=jnp.promote_types(losses.dtype, jnp.float32)
    )
    aux = [norm_rules.select_rows(a, keep) for a in chunk.aux]
    ordered = [grads[leaf] for leaf in range(program.layout.n_leaves)]
    # An example whose inputs were cleaned has a non-finite gradient (the norm found
    # from the cleaned inputs is not its norm): NaN, as the per-example path reports.
    reported = jnp.where(finite, norms, jnp.array(jnp.nan, norms.dtype))
    return ChunkResult(loss_sum, aux, ordered, jnp.where(padding, 0.0, reported))


class _Chunk:
    """One chunk's forward and backward pass, and what the norms and sums read of them."""

    def __init__(self, program: Program, inputs: Sequence[Any], n: int, vary: Any):
        self.program, self.inputs, self.n, self.vary = program, inputs, n, vary
        layout, analysis = program.layout, program.analysis
        self.leaf_inputs = {leaf: i for i, leaf in enumerate(layout.leaf_of) if leaf is not None}
        self.norm_dtype = functools.reduce(
            jnp.promote_types,
            [jnp.float32, *(jnp.result_type(inputs[i]) for i in self.leaf_inputs.values())],
        )
        copies = {
            leaf: jnp.broadcast_to(inputs[i], (n, *jnp.shape(inputs[i])))
            for leaf, i in self.leaf_inputs.items()
            if leaf in program.per_example
        }
        taps = vary(
            {
                s: [
                    None
                    if t is None or s in program.probed or (s, j) in program.same_gradient
                    else jnp.zeros(t.shape, t.dtype)
                    for j, t in enumerate(shapes)
                ]
                for s, shapes in replay.tap_shapes(analysis, n).items()
            }
        )
        probes = {
            s: Probe(analysis.sites[s], e, n, held=program.held) for s, e in program.probed.items()
        }
        holders = vary({s: p.holders(self.norm_dtype) for s, p in probes.items()})
        self.clean = program.clean()
        wanted = program.wanted()

        def forward(taps: Any, copied: dict[int, jax.Array], holders: Any) -> Any:
            outs, exports, params, channels = replay.run_batched(
                analysis,
                program.closed,
                self.values(copied),
                taps,
                n=n,
                wanted=wanted,
                clean=self.clean,
                probes=probes,
                holders=holders,
            )
            values = [o.value if o.kind == BATCHED else _broadcast(o.value, n) for o in outs]
            return (values[0], channels), (values[1:], exports, params)

        (self.losses, self.channels), self.backward, (self.aux, self.exports, self.params) = (
            jax.vjp(forward, taps, copies, holders, has_aux=True)
        )
        # The first backward pass: the gradients at the taps and copies, and the probed
        # sites' norms (their channels bring zeros for weights).
        self.tap_grads, self.copy_grads, found = self.backward(
            (jnp.ones_like(self.losses), jax.tree.map(jnp.zeros_like, self.channels))
        )
        for (s, j), (earlier, i) in program.same_gradient.items():
            self.tap_grads[s][j] = self.tap_grads[earlier][i]
        self.probe_norms = {s: norm for s, (norm, _) in found.items()}
        # With `program.held`, the probed sites' per-example gradients.
        self.probe_held = {s: held for s, (_, held) in found.items()} if program.held else {}
        self.per_leaf: dict[int, Any] = {}  # what a fast leaf's norm left for its sum

    def probed_sums(self, factor: jax.Array) -> dict[int, list[jax.Array]]:
        """The second backward pass, where the remat blocks are recomputed again: each
        probed site's clipped sums, with the clip factors brought by its channel."""
        seed = {
            s: jnp.broadcast_to(factor.astype(c.dtype), c.shape) for s, c in self.channels.items()
        }
        _, _, found = self.backward((jnp.ones_like(self.losses), seed))
        return {s: sums for s, (_, sums) in found.items()}

    def held_sums(self, factor: jax.Array, keep: jax.Array) -> dict[int, list[jax.Array]]:
        """Each probed site's clipped sums from the per-example gradients the first
        backward pass kept (`program.held`): no second pass."""
        out = {}
        for s, held in self.probe_held.items():
            depth = len(self.program.analysis.sites[s].lengths)
            total = norm_rules.over_iterations(
                lambda g: norm_rules.clipped_total(g, factor, keep), depth
            )
            out[s] = [total(g) for g in held]
        return out

    def values(self, copied: dict[int, Any]) -> list[replay.Val]:
        """The program's inputs as values of their kinds; `copied` leaves batched."""
        out = []
        layout = self.program.layout
        for i, (kind, leaf) in enumerate(zip(layout.kinds, layout.leaf_of, strict=True)):
            x = self.inputs[i]
            if leaf in copied:
                out.append(replay.Val(BATCHED, copied[leaf]))
            elif leaf is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact):
                out.append(replay.Val(DERIVED, x))
            else:
                out.append(replay.Val(kind if leaf is None else CONST, x))
        return out

    def site_inputs(self, s: int) -> list[Any]:
        site = self.program.analysis.sites[s]
        return _site_inputs(site, self.exports[s][0], self.params.get(s), self.vary)

    def finite(self) -> jax.Array:
        """Per example: were the inputs of every cleaned site finite?"""
        ok = jnp.ones(self.n, bool)
        for s in self.clean:
            flags = self.exports[s][1]
            if flags is not None:
                ok = ok & jnp.all(flags.reshape(-1, self.n), 0)
        return ok

    def norms_sq(self) -> tuple[jax.Array, dict[int, jax.Array]]:
        """Each example's squared gradient norm, and the per-example gradients of the
        materialized and per-example leaves."""
        norm_dtype = self.norm_dtype
        total = jnp.zeros(self.n, norm_dtype)
        for norm in self.probe_norms.values():
            total = total + norm_rules.sum_lead(norm, norm.ndim - 1).astype(norm_dtype)
        for leaf, (s, k) in self.program.fast.items():
            if s in self.program.probed:
                continue
            site = self.program.analysis.sites[s]
            position = site.derived[k]
            rule = norm_rules.rule_for(site, position)

            def norm(inp: list[Any], grads: list[Any], rule=rule, site=site, position=position):
                _, sq, per_ex = _leaf_norm_sq(rule, site, position, inp, grads)
                return sq, per_ex

            own = _own_iterations(site, position)
            sq, self.per_leaf[leaf] = norm_rules.over_iterations(norm, own)(
                self.site_inputs(s), self.tap_grads[s]
            )
            total = total + norm_rules.sum_lead(sq, own).astype(norm_dtype)
        per_example: dict[int, jax.Array] = {}
        if self.program.materialized:
            per_example.update(_materialized(self))
        per_example.update(self.copy_grads)
        for g in per_example.values():
            g = g.astype(norm_rules.wide(g.dtype))
            total = total + jnp.sum(jnp.square(g.reshape(self.n, -1)), 1).astype(norm_dtype)
        return total, per_example

    def sums(
        self, factor: jax.Array, keep: jax.Array, per_example: dict[int, jax.Array]
    ) -> dict[int, jax.Array]:
        """Each leaf's clipped sum: book-keeping for the fast leaves, the per-example
        gradients' weighted sum for the others."""
        sums = {}
        probed = {}
        if self.program.held:
            probed = self.held_sums(factor, keep)
        elif self.program.probed:
            probed = self.probed_sums(factor)
        for s, entries in self.program.probed.items():
            site = self.program.analysis.sites[s]
            for (k, leaf), summed in zip(entries, probed[s], strict=True):
                sums[leaf] = norm_rules.transpose_chain(summed, site.origins[k].chain or ())
        for leaf, (s, k) in self.program.fast.items():
            if s in self.program.probed:
                continue
            site = self.program.analysis.sites[s]
            position = site.derived[k]
            rule = norm_rules.rule_for(site, position)

            def total(inp, grads, per_ex, rule=rule, site=site, position=position):
                return _leaf_weighted_sum(rule, site, position, inp, grads, factor, keep, per_ex)

            summed = norm_rules.over_iterations(total, _own_iterations(site, position))(
                self.site_inputs(s), self.tap_grads[s], self.per_leaf[leaf]
            )
            sums[leaf] = norm_rules.transpose_chain(summed, site.origins[k].chain or ())
        for leaf, g in per_example.items():
            sums[leaf] = norm_rules.clipped_total(g, factor, keep)
        return sums


class Probe:
    """A site inside a remat whose rules run in the backward pass.

    The site's floating-point outputs pass through a `jax.custom_vjp` identity that
    keeps the site's inputs as its residuals, so that a remat recomputes them in the
    backward pass as it recomputes its other values, and nothing is held for the
    chunk. Its backward rule has the inputs `A` and the output gradients `G` at once,
    and hands the norms and the clipped sums out as the gradients of zeros (the
    *holders*, one set per iteration of the scans around the site). The clip factors
    come in as the gradient of the probe's second output, its *channel*: the first
    backward pass brings zeros and reads the norms, the second brings the factors and
    reads the sums (XLA drops what each pass does not read). A `held` probe hands out
    each example's gradient at the parameter inputs instead of their sum, in the first
    pass: the sums are then formed with the factors, and there is no second pass.
    """

    def __init__(self, site: graph.Site, entries: Sequence[tuple[int, int]], n: int, *, held: bool):
        self.site, self.n, self.held = site, n, held
        self.positions = [site.derived[k] for k, _ in entries]
        self.rules = [norm_rules.rule_for(site, p) for p in self.positions]
        self.float_outs = [i for i, v in enumerate(site.eqn.outvars) if graph.is_float(v.aval)]
        self.arrays = [i for i, v in enumerate(site.eqn.invars) if not norm_rules.is_literal(v)]
        self._probe = jax.custom_vjp(self._identity)
        self._probe.defvjp(self._forward, self._backward)

    def holders(self, norm_dtype: Any) -> tuple[jax.Array, list[jax.Array]]:
        """Zeros for the norms `(*lengths, n)` and for each parameter input's sum (its
        per-example gradients, `(*lengths, n, ...)`, where the probe is `held`)."""
        lead = self.site.lengths
        per = (self.n,) if self.held else ()
        sums = []
        for p in self.positions:
            aval = self.site.eqn.invars[p].aval
            sums.append(jnp.zeros((*lead, *per, *aval.shape), norm_rules.wide(aval.dtype)))
        self.dtypes = (norm_dtype, [h.dtype for h in sums])  # what the backward rule returns
        return jnp.zeros((*lead, self.n), norm_dtype), sums

    def __call__(self, outs: list[Any], values: list[Any], holders: Any) -> tuple[list, Any]:
        arrays = [values[i] for i in self.arrays]
        found, channel = self._probe([outs[i] for i in self.float_outs], arrays, holders)
        outs = list(outs)
        for i, o in zip(self.float_outs, found, strict=True):
            outs[i] = o
        return outs, channel

    @staticmethod
    def _identity(outs: list[Any], arrays: list[Any], holders: Any) -> tuple[list, Any]:
        del arrays
        return outs, jnp.zeros_like(holders[0])

    def _forward(self, outs: list[Any], arrays: list[Any], holders: Any) -> Any:
        return self._identity(outs, arrays, holders), arrays

    def _backward(self, arrays: Any, cotangents: Any) -> Any:
        norm_dtype, sum_dtypes = self.dtypes
        grads_out, weights = cotangents
        site = self.site
        given = iter(arrays)
        inputs = [v.val if norm_rules.is_literal(v) else next(given) for v in site.eqn.invars]
        grads: list[Any] = [None] * len(site.eqn.outvars)
        for i, g in zip(self.float_outs, grads_out, strict=True):
            grads[i] = g
        norm: Any = 0
        sums = []
        keep = weights > 0
        for rule, p, dtype in zip(self.rules, self.positions, sum_dtypes, strict=True):
            if self.held:
                per_example = rule.layer_gradient(site, p, inputs, grads)
                flat = per_example.reshape(self.n, -1)
                norm = norm + jnp.sum(jnp.square(flat), 1).astype(norm_dtype)
                sums.append(per_example.astype(dtype))
                continue
            _, sq, _ = rule.norm_sq(site, p, inputs, grads)
            norm = norm + sq.astype(norm_dtype)
            total = rule.weighted_sum(site, p, inputs, grads, weights, keep, None)
            sums.append(total.astype(dtype))
        return list(grads_out), [None] * len(arrays), (norm, sums)


def _materialized(chunk: _Chunk) -> dict[int, jax.Array]:
    """Per-example gradients of the materialized leaves: each use's per-example gradient
    at its parameter input, carried back to the leaves through the parameter side."""
    program = chunk.program
    analysis = program.analysis
    positions = program.mat_positions
    cotangents = []
    for s, k in positions:
        site = analysis.sites[s]
        depth = len(site.lengths)

        def one(inp, grads, site=site, k=k):
            return norm_rules.Rule.per_example(site, [site.derived[k]], inp, grads)[0]

        per_ex = norm_rules.over_iterations(one, depth)(chunk.site_inputs(s), chunk.tap_grads[s])
        cotangents.append(jnp.moveaxis(per_ex, depth, 0))
    leaves = sorted(program.materialized)
    wanted = frozenset(s for s, _ in positions)

    def derived(mat: list[jax.Array]) -> list[jax.Array]:
        # The per-example leaves are batch inputs to the program (their kinds must be
        # the analysis'); the parameter side does not read them.
        values = chunk.values(dict.fromkeys(program.per_example))
        for leaf, x in zip(leaves, mat, strict=True):
            values[chunk.leaf_inputs[leaf]] = replay.Val(DERIVED, x)
        found = replay.run_derived(analysis, program.closed, values, wanted)
        return [found[s][k] for s, k in positions]

    _, pull = jax.vjp(derived, [chunk.inputs[chunk.leaf_inputs[leaf]] for leaf in leaves])
    (per_leaf,) = jax.vmap(pull)(cotangents)
    return dict(zip(leaves, per_leaf, strict=True))


def _broadcast(x: Any, n: int) -> jax.Array:
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, (n, *x.shape))
