"""The two programs the fast path runs over the per-example program `graph.py` analysed.

* `run_batched` evaluates the program for a whole chunk of examples at once, each
  equation mapped over the examples (axis 0) where it takes a batched input, and
  adds a *tap* to every floating-point output of every site: a zero whose gradient
  is the gradient `G` at that output, one row per example. It also hands out what
  each site's rule needs: the site's batched and constant inputs (`A`) and, where
  asked, its parameter inputs.
* `run_derived` evaluates only what depends on the parameters and not on the batch,
  and returns the parameter inputs of chosen sites: differentiated, it carries
  per-example gradients at the sites back to the leaves.

Inside a `lax.scan` a site's taps and exports are stacked over the iterations
(`(length, n, ...)`, outer scans first); a scan's batched `xs` and `ys` have the
examples on axis 1 while the scan runs. Both programs walk the equations in the
analysis' order and number sites and blocks (scans, remats) alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core

from gradaccum_jax._privacy import graph
from gradaccum_jax._privacy.graph import BATCHED, CONST, DERIVED


@dataclasses.dataclass(frozen=True)
class Val:
    """A value of the replayed program: its kind and its array (`None` if not computed)."""

    kind: str
    value: Any


def bind(eqn: Any, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
    """Applies the equation's primitive to `invals`, as `jax.core.eval_jaxpr` does
    (with `params` in place of the equation's, where given)."""
    found = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    # JAX < 0.9 returns (subfunctions, params); later releases the params alone.
    subfuns, bind_params = found if isinstance(found, tuple) else ((), found)
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with ctx if ctx is not None else contextlib.nullcontext():
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def bind_batched(eqn: Any, invals: Sequence[Any], batched: Sequence[bool]) -> list[Any]:
    """`bind`, mapped over axis 0 of the inputs flagged in `batched`."""
    if not any(batched):
        return bind(eqn, invals)
    in_axes = [0 if b else None for b in batched]
    return jax.vmap(lambda *xs: bind(eqn, xs), in_axes=in_axes)(*invals)


def exported_positions(site: graph.Site) -> list[int]:
    """The inputs of a site that the batched program hands out: batched and constant,
    literals excepted (a rule reads those from the equation)."""
    return [
        i
        for i, (kind, var) in enumerate(zip(site.kinds, site.eqn.invars, strict=True))
        if kind != DERIVED and not isinstance(var, core.Literal)
    ]


class _Replay:
    """One walk of the program; `batched=False` computes only parameter-side values."""

    def __init__(
        self,
        analysis: graph.Analysis,
        *,
        n: int,
        batched: bool,
        site: int,
        block: int,
        taps: dict[int, list[Any]] | None = None,
        wanted: frozenset = frozenset(),
        clean: frozenset = frozenset(),
        probes: dict[int, Any] | None = None,
        holders: dict[int, Any] | None = None,
    ):
        self.analysis, self.n, self.batched = analysis, n, batched
        self.site, self.block = site, block
        self.taps = taps or {}
        self.wanted = wanted  # sites whose parameter inputs are handed out
        self.clean = clean  # sites whose batched inputs are cleaned of non-finite values
        self.probes = probes or {}  # sites whose rules run in the backward pass
        self.holders = holders or {}  # the probes' zeros, whose gradients they fill
        self.exports: dict[int, tuple[list[Any], Any]] = {}
        # An input another site of this walk exported already (the four gates of an
        # LSTM read the same `x` and `h`) is handed out once: `None` in the export,
        # its place `(site, index)` here, filled in by `_resolve` once the arrays
        # have left a scan or a remat (stacked once, not once per site).
        self.aliases: dict[tuple[int, int], tuple[int, int]] = {}
        self._exported: dict[int, tuple[int, int]] = {}
        self._clean_cache: dict[int, tuple[Any, Any, Any]] = {}  # see `_cleaned`
        self.params: dict[int, list[Any]] = {}
        self.channels: dict[int, Any] = {}  # the probes' outputs that bring the weights

    def read(self, x: Any) -> Val:
        return Val(CONST, x.val) if isinstance(x, core.Literal) else x

    def __call__(self, eqn: Any, inputs: list[Any]) -> list[Val]:
        ins = [self.read(x) for x in inputs]
        what = graph.category(eqn, [v.kind for v in ins])
        vals = [v.value for v in ins]
        if what in ("const", "stop"):
            return [Val(CONST, o) for o in bind(eqn, vals)]
        if what == "derived":
            return [self._derived(eqn, o) for o in bind(eqn, vals)]
        if what == "batched":
            if not self.batched:
                return [Val(BATCHED, None) for _ in eqn.outvars]
            return [Val(BATCHED, o) for o in self._mapped(eqn, ins)]
        if what == "call":
            body, consts = graph.call_body(eqn)
            return graph.walk(body, [Val(CONST, c) for c in consts], ins, self)
        if what == "remat":
            return self._remat(eqn, ins)
        if what == "scan":
            return self._scan(eqn, ins)
        if what == "site":
            return self._site(eqn, ins)
        raise AssertionError(f"the analysis left `{eqn.primitive.name}` unsupported")

    @staticmethod
    def _derived(eqn: Any, out: Any) -> Val:
        return Val(DERIVED if graph.is_float(jax.typeof(out)) else CONST, out)

    def _mapped(self, eqn: Any, ins: list[Val]) -> list[Any]:
        return bind_batched(eqn, [v.value for v in ins], [v.kind == BATCHED for v in ins])

    def _site(self, eqn: Any, ins: list[Val]) -> list[Val]:
        site = self.analysis.sites[self.site]
        if site.eqn is not eqn and site.eqn.primitive is not eqn.primitive:
            raise AssertionError("the replay lost its place among the sites")
        if self.site in self.wanted:
            self.params[self.site] = [ins[i].value for i in site.derived]
        if not self.batched:
            self.site += 1
            return [Val(BATCHED, None) for _ in eqn.outvars]
        finite = None
        if self.site in self.clean:
            ins, finite = _cleaned(ins, self._clean_cache)
        outs = self._mapped(eqn, ins)
        taps = self.taps[self.site]
        outs = [o if t is None else o + t for o, t in zip(outs, taps, strict=True)]
        probe = self.probes.get(self.site)
        if probe is not None:
            # The rules run in the backward pass, on the inputs the forward pass (or a
            # remat's recomputation) gives them: nothing is handed out but the flags.
            outs, self.channels[self.site] = probe(
                outs, [v.value for v in ins], self.holders[self.site]
            )
            self.exports[self.site] = ([], finite)
        else:
            self.exports[self.site] = (self._export(ins, exported_positions(site)), finite)
        self.site += 1
        return [Val(BATCHED, o) for o in outs]

    def _export(self, ins: list[Val], positions: list[int]) -> list[Any]:
        out = []
        for j, i in enumerate(positions):
            value = ins[i].value
            first = self._exported.setdefault(id(value), (self.site, j))
            if first != (self.site, j):
                self.aliases[self.site, j] = first
                value = None
            out.append(value)
        return out

    def _child(self, first: int) -> _Replay:
        return _Replay(
            self.analysis,
            n=self.n,
            batched=self.batched,
            site=first,
            block=self.block + 1,
            taps=None,
            wanted=self.wanted,
            clean=self.clean,
            probes=self.probes,
        )

    def _block_inputs(self, block: graph.Block) -> tuple[dict, dict]:
        """The taps and the probes' holders of the sites inside `block`."""
        inside = range(block.first, block.end)
        return (
            {s: self.taps[s] for s in inside if s in self.taps},
            {s: self.holders[s] for s in inside if s in self.holders},
        )

    def _remat(self, eqn: Any, ins: list[Val]) -> list[Val]:
        body, consts = graph.call_body(eqn)
        block = self.analysis.blocks[self.block]
        kinds: list[str] = []
        aliases: dict[tuple[int, int], tuple[int, int]] = {}

        def run(values: list[Any], taps: dict[int, list[Any]], holders: dict) -> Any:
            child = self._child(block.first)
            child.taps, child.holders = taps, holders
            outs = graph.walk(
                body,
                [Val(CONST, c) for c in consts],
                [Val(v.kind, x) for v, x in zip(ins, values, strict=True)],
                child,
            )
            kinds[:] = [o.kind for o in outs]
            aliases.update(child.aliases)
            return [o.value for o in outs], (child.exports, child.params, child.channels)

        taps, holders = self._block_inputs(block)
        if self.batched:
            run = jax.checkpoint(
                run,
                prevent_cse=eqn.params.get("prevent_cse", True),
                policy=eqn.params.get("policy"),
            )
        values, (exports, params, channels) = run([v.value for v in ins], taps, holders)
        self.exports.update(_resolve(exports, aliases))
        self.params.update(params)
        self.channels.update(channels)
        self.site, self.block = block.end, block.end_block
        return [Val(k, v) for k, v in zip(kinds, values, strict=True)]

    def _scan(self, eqn: Any, ins: list[Val]) -> list[Val]:
        p = eqn.params
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        block = self.analysis.blocks[self.block]
        abstract = [graph.Abstract(v.kind) for v in ins]
        carry_kinds = [a.kind for a in graph.carry_kinds(eqn, abstract)]
        consts, xs = ins[:n_consts], ins[n_consts + n_carry :]
        init = [
            self._as(k, v)
            for k, v in zip(carry_kinds, ins[n_consts : n_consts + n_carry], strict=True)
        ]
        kept = [self.batched or k != BATCHED for k in carry_kinds]
        xs_kept = [self.batched or v.kind != BATCHED for v in xs]
        body = p["jaxpr"]
        ys_kinds: list[str] = []
        aliases: dict[tuple[int, int], tuple[int, int]] = {}

        def step(carry: list[Any], x: tuple[list[Any], dict[int, list[Any]], dict]) -> Any:
            x_values, taps, holders = x
            carry_iter = iter(carry)
            x_iter = iter(x_values)
            child = self._child(block.first)
            child.taps, child.holders = taps, holders
            inputs = [
                *consts,
                *[
                    Val(k, next(carry_iter) if keep else None)
                    for k, keep in zip(carry_kinds, kept, strict=True)
                ],
                *[
                    Val(v.kind, next(x_iter) if keep else None)
                    for v, keep in zip(xs, xs_kept, strict=True)
                ],
            ]
            outs = graph.walk(body.jaxpr, [Val(CONST, c) for c in body.consts], inputs, child)
            new_carry = [
                self._as(k, o).value
                for k, o, keep in zip(carry_kinds, outs[:n_carry], kept, strict=True)
                if keep
            ]
            ys_kinds[:] = [o.kind for o in outs[n_carry:]]
            aliases.update(child.aliases)
            ys = [o.value for o in outs[n_carry:] if self.batched or o.kind != BATCHED]
            return new_carry, (ys, child.exports, child.params, child.channels)

        taps, holders = self._block_inputs(block)
        x_values = [_to_scan(v) for v, keep in zip(xs, xs_kept, strict=True) if keep]
        carry_out, (ys, exports, params, channels) = jax.lax.scan(
            step,
            [v.value for v, keep in zip(init, kept, strict=True) if keep],
            (x_values, taps, holders),
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        self.exports.update(_resolve(exports, aliases))
        self.params.update(params)
        self.channels.update(channels)
        self.site, self.block = block.end, block.end_block
        carry_iter, ys_iter = iter(carry_out), iter(ys)
        carry_vals = [
            Val(k, next(carry_iter) if keep else None)
            for k, keep in zip(carry_kinds, kept, strict=True)
        ]
        ys_vals = [
            Val(k, _from_scan(k, next(ys_iter)) if self.batched or k != BATCHED else None)
            for k in ys_kinds
        ]
        return [*carry_vals, *ys_vals]

    def _as(self, kind: str, v: Val) -> Val:
        """`v` as a value of `kind`: a scan carry that becomes batched is broadcast."""
        if kind == BATCHED and v.kind != BATCHED and self.batched:
            x = jnp.asarray(v.value)
            return Val(BATCHED, jnp.broadcast_to(x, (self.n, *x.shape)))
        return Val(kind, v.value)


def _resolve(
    exports: dict[int, tuple[list[Any], Any]], aliases: dict[tuple[int, int], tuple[int, int]]
) -> dict[int, tuple[list[Any], Any]]:
    """`exports` with each aliased input filled in from the site that exported it."""
    for (s, j), (first, i) in aliases.items():
        exports[s][0][j] = exports[first][0][i]
    return exports


def _cleaned(ins: list[Val], cache: dict[int, Any]) -> tuple[list[Val], jax.Array | None]:
    """The site's batched floating-point inputs with every NaN and infinity replaced by
    zero, and a flag per example: were its inputs all finite? An input cleaned for
    an earlier site (`cache`, by identity) is cleaned once, and exported once.

    An example with a non-finite input at a site whose gradient contracts that input
    (a dense layer) has a non-finite gradient: it is dropped whichever path computes
    it. Cleaning its rows in the forward pass, which changes no other example, lets
    the clipped sum contract the inputs as they are (see norm_rules.BookKeepingRule):
    a zero times a NaN would be a NaN.
    """
    out, finite = [], None
    for v in ins:
        if v.kind == BATCHED and graph.is_float(jax.typeof(v.value)):
            found = cache.get(id(v.value))
            if found is None or found[0] is not v.value:
                ok = jnp.isfinite(v.value)
                rows = jnp.all(ok.reshape(ok.shape[0], -1), 1)
                found = (v.value, jnp.where(ok, v.value, jnp.zeros((), v.value.dtype)), rows)
                cache[id(v.value)] = found
            _, clean, rows = found
            finite = rows if finite is None else finite & rows
            v = Val(BATCHED, clean)
        out.append(v)
    return out, finite


def _to_scan(v: Val) -> Any:
    """A scan's xs with the examples on axis 1, where the iterations are axis 0."""
    return jnp.moveaxis(v.value, 0, 1) if v.kind == BATCHED else v.value


def _from_scan(kind: str, y: Any) -> Any:
    return jnp.moveaxis(y, 1, 0) if kind == BATCHED else y


def run_batched(
    analysis: graph.Analysis,
    closed: Any,
    inputs: Sequence[Val],
    taps: dict[int, list[Any]],
    *,
    n: int,
    wanted: frozenset = frozenset(),
    clean: frozenset = frozenset(),
    probes: dict[int, Any] | None = None,
    holders: dict[int, Any] | None = None,
) -> tuple[list[Val], dict[int, Any], dict[int, list[Any]], dict[int, Any]]:
    """The program for a chunk of `n` examples: `(outputs, exports, parameter inputs,
    channels)`.

    Each site's export is `(inputs, finite)`: its batched and constant inputs (none for
    a probed site), and for the `clean` sites (see `_cleaned`) a flag per example,
    `None` elsewhere. A probed site's outputs pass through `probes[site](outputs,
    inputs, holders[site])`, which returns them and its channel (stacked over the
    iterations of the scans around it, like the taps).
    """
    replay = _Replay(
        analysis,
        n=n,
        batched=True,
        site=0,
        block=0,
        taps=taps,
        wanted=wanted,
        clean=clean,
        probes=probes,
        holders=holders,
    )
    outs = graph.walk(closed.jaxpr, [Val(CONST, c) for c in closed.consts], list(inputs), replay)
    return outs, _resolve(replay.exports, replay.aliases), replay.params, replay.channels


def run_derived(
    analysis: graph.Analysis, closed: Any, inputs: Sequence[Val], wanted: frozenset
) -> dict[int, list[Any]]:
    """The parameter inputs of the `wanted` sites, computed from the parameters alone."""
    replay = _Replay(analysis, n=0, batched=False, site=0, block=0, wanted=wanted)
    graph.walk(closed.jaxpr, [Val(CONST, c) for c in closed.consts], list(inputs), replay)
    return replay.params


def tap_shapes(analysis: graph.Analysis, n: int) -> dict[int, list[Any]]:
    """The shape and dtype of every site's taps (`None` for outputs with no gradient)."""
    shapes = {}
    for site in analysis.sites:
        shapes[site.index] = [
            jax.ShapeDtypeStruct((*site.lengths, n, *v.aval.shape), v.aval.dtype)
            if graph.is_float(v.aval)
            else None
            for v in site.eqn.outvars
        ]
    return shapes
