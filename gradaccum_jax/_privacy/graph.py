"""Where each parameter meets the batch: the analysis behind the fast per-example norms.

A loss written for a batch is traced for one example (a batch of one). Every value
of that program is one of three kinds:

* `BATCHED`: it depends on the example (its data, its key); on the fast path it is
  held for a whole chunk of examples, the example on axis 0;
* `DERIVED`: it depends on the differentiated parameters and on nothing batched
  (a weight, its bfloat16 copy, a reshaped bias): computed once, not per example;
* `CONST`: neither (literals, iotas, closed-over arrays, `stop_gradient` outputs).

An equation that takes a `DERIVED` input and a `BATCHED` one is a *site*: there, and
only there, an example's gradient reaches a parameter. Knowing each site's batched
inputs `A` and the gradient `G` at its outputs is enough for each example's
gradient norm (`norm_rules.py`) and for the clipped sum (book-keeping), without any
example's whole gradient.

The analysis also follows each parameter from its leaf to the sites it reaches
(its *origin*): through operations that keep the norm of a gradient (reshape,
transpose, a change of dtype, ...) a leaf used at one site has the site's
per-example norm; anything else makes the leaf's per-example gradient be formed
from all its uses. A parameter a scan reuses in every iteration (one of its
constants, or a carry its body passes on unchanged: a recurrent weight) has at a
site inside it the sum over the iterations of each iteration's gradient; the origin
says from which scan on it is reused (`Origin.shared_at`), and the rules take the
iterations' `A` and `G` together (`norm_rules.Rule.reused_norm_sq`). What the walk
cannot follow (a parameter a scan's carry changes, a `while_loop`) is reported, and
those leaves take the per-example path.

The walk (`walk`) is shared by the analysis here and the two programs of
`replay.py`, so the three see the same equations in the same order and number the
sites alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core

BATCHED, DERIVED, CONST = "batched", "derived", "const"

# Calls whose body the walk enters as if it were written inline.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
# Rematerialisation: entered too; the programs of replay.py keep its boundary.
_REMAT = {"checkpoint", "remat", "remat2"}
# Higher-order equations that may be a site as a whole: their gradient rules are JAX's.
_OPAQUE_SITES = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "cond"}
# Operations that move a parameter's entries without mixing them: the gradient of the
# leaf is the site's gradient moved back, with the same norm.
_KEEPS_NORM = {
    "convert_element_type",
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "rev",
    "copy",
    "copy_p",
    "reduce_precision",
    "broadcast_in_dim",  # only where no entry is repeated: checked in `keeps_norm`
}


@dataclasses.dataclass(frozen=True)
class Step:
    """One step from a leaf to a site's input: an equation that keeps the norm, or a slice.

    `primitive` is the equation's primitive name, or `"slice"` for the per-iteration
    slice a `lax.scan` takes of its `xs`. `in_shape` is the operand's shape (per
    iteration) and `params` the equation's parameters.
    """

    primitive: str
    in_shape: tuple[int, ...] = ()
    params: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a `DERIVED` value comes from.

    Attributes:
        leaves: The indices of the leaves it depends on.
        chain: The steps from its one leaf to it, when every step keeps the norm;
            `None` when it mixes leaves or entries.
        shared_at: Where it is the same in every iteration of the scans around it:
            the number of those scans (outermost first) that give each iteration its
            own value; every scan inside them reuses it (as a constant, or as a carry
            passed on unchanged), each iteration adding a gradient to the same
            entries. `None` where no scan reuses it.
    """

    leaves: frozenset[int]
    chain: tuple[Step, ...] | None
    shared_at: int | None = None


_NO_ORIGIN = Origin(frozenset(), None)


@dataclasses.dataclass(frozen=True)
class Abstract:
    """A value as the analysis sees it: its kind, and its origin (read when `DERIVED`)."""

    kind: str
    origin: Origin = _NO_ORIGIN


@dataclasses.dataclass
class Site:
    """An equation where a parameter meets the batch.

    Attributes:
        index: The site's number, in the order of the walk.
        eqn: The equation.
        kinds: The kind of each input.
        derived: The positions of its `DERIVED` floating-point inputs.
        origins: Their origins, in the same order.
        lengths: The lengths of the scans around it, outermost first.
        same_gradient: For an output whose gradient is, for every example, the gradient
            at an output of an earlier site (both reach the same value through sums of
            their own shape and nothing else: `x @ W_i + h @ U_i + b_i` in an LSTM's
            gate), that site and output, by the output's index.
    """

    index: int
    eqn: Any
    kinds: tuple[str, ...]
    derived: tuple[int, ...]
    origins: tuple[Origin, ...]
    lengths: tuple[int, ...]
    same_gradient: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.eqn.primitive.name

    def reused_depth(self, position: int) -> int:
        """How many of the innermost scans around the site reuse its parameter input at
        `position` in every iteration (0 where each iteration has its own)."""
        at = self.origins[self.derived.index(position)].shared_at
        return 0 if at is None else len(self.lengths) - at

    def reused_iterations(self, position: int) -> int:
        """The number of iterations that reuse the parameter input at `position`: each
        example's gradient there is the sum of that many iterations' gradients."""
        depth = self.reused_depth(position)
        return int(np.prod(self.lengths[len(self.lengths) - depth :], dtype=int))


class Unsupported(Exception):
    """Raised by the analysis when leaves meet something the fast path does not follow."""

    def __init__(self, leaves: frozenset[int], why: str):
        super().__init__(why)
        self.leaves = leaves
        self.why = why


def is_float(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def join(kinds: Sequence[str]) -> str:
    if BATCHED in kinds:
        return BATCHED
    return DERIVED if DERIVED in kinds else CONST


def keeps_norm(eqn: Any) -> bool:
    """Whether the equation moves its one operand's entries without repeating or mixing them."""
    name = eqn.primitive.name
    if name not in _KEEPS_NORM or len(eqn.invars) != 1:
        return False
    if name == "reshape" and eqn.params.get("dimensions") is not None:
        return False
    src, dst = eqn.invars[0].aval, eqn.outvars[0].aval
    return int(np.prod(src.shape)) == int(np.prod(dst.shape)) and is_float(dst)


def shifts(eqn: Any, kinds: Sequence[str]) -> bool:
    """Whether the equation adds a constant to its one derived operand (`1 + scale`, as
    Gemma's RMSNorm writes its scale; `w - c`), of the operand's shape and dtype: the
    gradient at the operand is the gradient at the output."""
    name = eqn.primitive.name
    if name not in ("add", "sub") or list(kinds).count(DERIVED) != 1:
        return False
    position = list(kinds).index(DERIVED)
    if name == "sub" and position != 0:
        return False  # c - w flips the sign
    src, dst = eqn.invars[position].aval, eqn.outvars[0].aval
    return src.shape == dst.shape and src.dtype == dst.dtype


def step_of(eqn: Any) -> Step:
    return Step(eqn.primitive.name, tuple(eqn.invars[0].aval.shape), tuple(eqn.params.items()))


def category(eqn: Any, kinds: Sequence[str]) -> str:
    """What the walk does with an equation, given its inputs' kinds.

    One of `"const"`, `"derived"`, `"batched"` (computed as is, per example), `"stop"`
    (`stop_gradient`: no gradient passes), `"call"` / `"remat"` / `"scan"` (entered),
    `"site"`, or `"unsupported"`. Every `DERIVED` value is floating-point.
    """
    name = eqn.primitive.name
    if all(k == CONST for k in kinds):
        return "const"
    if DERIVED not in kinds:
        return "batched"
    if name == "stop_gradient":
        return "stop"
    if name in _CALLS:
        return "call"
    if name in _REMAT:
        return "remat"
    if BATCHED not in kinds:
        return "derived"
    if name == "scan":
        return "scan"
    if not any(is_float(v.aval) for v in eqn.outvars):
        return "batched"  # no gradient flows through an integer or boolean result
    if _jaxprs(eqn.params) and name not in _OPAQUE_SITES:
        return "unsupported"
    return "site"


def _jaxprs(params: dict) -> list[Any]:
    found = []
    for value in params.values():
        values = value if isinstance(value, (tuple, list)) else (value,)
        found += [v for v in values if isinstance(v, (core.Jaxpr, core.ClosedJaxpr))]
    return found


def call_body(eqn: Any) -> tuple[Any, list[Any]]:
    """The (open) jaxpr and constants of a call or remat equation's body."""
    name = eqn.primitive.name
    body = eqn.params[_CALLS[name]] if name in _CALLS else eqn.params["jaxpr"]
    if isinstance(body, core.ClosedJaxpr):
        return body.jaxpr, list(body.consts)
    return body, []


def _dropped(var: Any) -> bool:
    """Whether an equation's output variable is unused (`_` in a printed jaxpr). JAX < 0.9
    does not export the class (`jax.extend.core.DropVar`)."""
    return type(var).__name__ == "DropVar"


def walk(jaxpr: Any, consts: Sequence[Any], inputs: Sequence[Any], visit: Callable) -> list:
    """Runs `visit(eqn, inputs) -> outputs` over the equations of `jaxpr`, in order.

    `consts` and `inputs` are the values (of whatever the caller computes) of the
    jaxpr's constant and input variables; a literal reaches `visit` as a
    `core.Literal`. Returns the values of the jaxpr's outputs.
    """
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, inputs, strict=True))

    def read(v: Any) -> Any:
        return v if isinstance(v, core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        outs = visit(eqn, [read(v) for v in eqn.invars])
        for var, out in zip(eqn.outvars, outs, strict=True):
            if not _dropped(var):
                env[var] = out
    return [read(v) for v in jaxpr.outvars]


@dataclasses.dataclass(frozen=True)
class Block:
    """A scan or remat the walk entered: its sites are `first` to `end - 1`, and the
    blocks inside it are numbered up to `end_block - 1` (pre-order); `remat` for a
    `jax.checkpoint` (its values are recomputed in the backward pass)."""

    first: int
    end: int
    end_block: int
    remat: bool = False


@dataclasses.dataclass
class Analysis:
    """What the walk found: the sites and blocks in order, and the outputs' kinds."""

    sites: list[Site]
    blocks: list[Block]
    outputs: list[Abstract]


class _Analyzer:
    """The abstract walk: kinds, origins and sites."""

    def __init__(self, record: bool = True):
        self.sites: list[Site] = []
        self.blocks: list[Block] = []
        self.record = record
        self.lengths: tuple[int, ...] = ()

    def literal(self, x: Any) -> Abstract:
        del x  # a literal's gradient is nothing
        return Abstract(CONST)

    def read(self, x: Any) -> Abstract:
        return self.literal(x) if isinstance(x, core.Literal) else x

    def __call__(self, eqn: Any, inputs: list[Any]) -> list[Abstract]:
        ins = [self.read(x) for x in inputs]
        what = category(eqn, [a.kind for a in ins])
        outs_float = [is_float(v.aval) for v in eqn.outvars]
        if what in ("const", "stop"):
            return [Abstract(CONST) for _ in eqn.outvars]
        if what == "batched":
            return [Abstract(BATCHED) for _ in eqn.outvars]
        if what == "derived":
            return [self._derived(eqn, ins, f) for f in outs_float]
        if what == "call":
            body, consts = call_body(eqn)
            return self.walk(body, [Abstract(CONST)] * len(consts), ins)
        if what == "remat":
            body, consts = call_body(eqn)
            return self._block(
                lambda: self.walk(body, [Abstract(CONST)] * len(consts), ins), remat=True
            )
        if what == "scan":
            return self._block(lambda: self._scan(eqn, ins))
        if what == "unsupported":
            raise Unsupported(
                _leaves_of(ins), f"a parameter enters `{eqn.primitive.name}` with the batch"
            )
        self._site(eqn, ins)
        return [Abstract(BATCHED) for _ in eqn.outvars]

    def walk(self, jaxpr: Any, consts: list[Abstract], ins: list[Abstract]) -> list[Abstract]:
        """`walk` over `jaxpr`, then the sites of `jaxpr` whose gradients are the same."""
        first = len(self.sites)
        outs = walk(jaxpr, consts, ins, self)
        if self.record:
            _same_gradients(jaxpr, self.sites[first:])
        return outs

    def _block(self, enter: Callable[[], list[Abstract]], remat: bool = False) -> list[Abstract]:
        """Walks a scan's or remat's body, recording the sites and blocks it holds."""
        index, first = len(self.blocks), len(self.sites)
        self.blocks.append(Block(first, first, index + 1, remat))
        outs = enter()
        self.blocks[index] = Block(first, len(self.sites), len(self.blocks), remat)
        return outs

    def _derived(self, eqn: Any, ins: list[Abstract], out_float: bool) -> Abstract:
        if not out_float:  # an integer made from parameters has no gradient
            return Abstract(CONST)
        derived = [a.origin for a in ins if a.kind == DERIVED]
        leaves = frozenset().union(*(o.leaves for o in derived))
        # Where origins differ the chain is gone (`keeps_norm` takes one operand): the
        # outermost reuse is kept for the record.
        shared = [o.shared_at for o in derived if o.shared_at is not None]
        chain = None
        if derived[0].chain is not None:
            if keeps_norm(eqn):
                chain = (*derived[0].chain, step_of(eqn))
            elif shifts(eqn, [a.kind for a in ins]):
                chain = (*derived[0].chain, Step("shift", tuple(eqn.outvars[0].aval.shape)))
        return Abstract(DERIVED, Origin(leaves, chain, min(shared, default=None)))

    def _site(self, eqn: Any, ins: list[Abstract]) -> None:
        derived = tuple(i for i, a in enumerate(ins) if a.kind == DERIVED)
        origins = tuple(ins[i].origin for i in derived)
        if self.record:
            site = Site(
                len(self.sites), eqn, tuple(a.kind for a in ins), derived, origins, self.lengths
            )
            self.sites.append(site)

    def _scan(self, eqn: Any, ins: list[Abstract]) -> list[Abstract]:
        depth = len(self.lengths)
        body, carry_in, xs_in = scan_body_inputs(eqn, ins, depth)
        carry = carry_kinds(eqn, ins, depth)
        changed = [
            a
            for a, same in zip(carry, passed_on(eqn), strict=True)
            if a.kind == DERIVED and not same
        ]
        if changed:
            leaves = frozenset().union(*(a.origin.leaves for a in changed))
            raise Unsupported(leaves, "a parameter is carried through a scan that changes it")
        inner = _Analyzer(self.record)
        inner.sites, inner.blocks = self.sites, self.blocks
        inner.lengths = (*self.lengths, eqn.params["length"])
        outs = inner.walk(
            body.jaxpr, [Abstract(CONST)] * len(body.consts), [*carry_in(carry), *xs_in]
        )
        n_carry = eqn.params["num_carry"]
        ys = [_stacked(a) for a in outs[n_carry:]]
        return [*carry, *ys]


def _same_gradients(jaxpr: Any, sites: Sequence[Site]) -> None:
    """Fills `same_gradient` of the sites whose equations are in `jaxpr`.

    An output used once, by an `add` of its own shape and dtype, has the gradient of
    the sum; followed while that holds, it reaches a value whose gradient it shares
    with every site output that reaches the same value.
    """
    uses: dict[Any, list[Any]] = {}
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            if not isinstance(var, core.Literal):
                uses.setdefault(var, []).append(eqn)
    for var in jaxpr.outvars:
        if not isinstance(var, core.Literal):
            uses.setdefault(var, []).append(None)
    first: dict[Any, tuple[int, int]] = {}
    mine = {id(eqn) for eqn in jaxpr.eqns}
    for site in sites:
        if id(site.eqn) not in mine:
            continue  # inside a scan, remat or call of `jaxpr`: its own walk's
        for j, var in enumerate(site.eqn.outvars):
            if _dropped(var) or not is_float(var.aval):
                continue
            end = var
            while True:
                found = uses.get(end, [])
                if len(found) != 1 or found[0] is None:
                    break
                eqn = found[0]
                out = eqn.outvars[0]
                if eqn.primitive.name not in ("add", "add_any") or out.aval != end.aval:
                    break
                end = out
            earlier = first.setdefault(end, (site.index, j))
            if earlier != (site.index, j):
                site.same_gradient[j] = earlier


def passed_on(eqn: Any) -> list[bool]:
    """For each carry of a scan, whether its body returns it unchanged (the same
    variable): a value every iteration reuses, as it reuses a constant."""
    body = eqn.params["jaxpr"].jaxpr
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    return [body.outvars[i] is body.invars[n_consts + i] for i in range(n_carry)]


def scan_body_inputs(
    eqn: Any, ins: list[Any], depth: int = 0
) -> tuple[Any, Callable, list[Abstract]]:
    """A scan's body, a function placing carries after its constants, and its xs' kinds.

    `depth` is the number of scans around this one: its constants, and the carries its
    body passes on, are reused from there on.
    """
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    consts = [_shared(a, depth) for a in ins[:n_consts]]
    xs = [_sliced(a) for a in ins[n_consts + n_carry :]]
    same = passed_on(eqn)

    def with_carry(carry: list[Abstract]) -> list[Abstract]:
        return [*consts, *(_shared(a, depth) if s else a for a, s in zip(carry, same, strict=True))]

    return eqn.params["jaxpr"], with_carry, xs


def carry_kinds(eqn: Any, ins: list[Any], depth: int = 0) -> list[Abstract]:
    """The kinds of a scan's carries: the least fixed point over its body. A carry the
    body passes on unchanged keeps its input's kind and origin."""
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    body, carry_in, xs = scan_body_inputs(eqn, ins, depth)
    same = passed_on(eqn)
    carry = list(ins[n_consts : n_consts + n_carry])
    for _ in range(n_carry + 2):
        analyzer = _Analyzer(record=False)
        analyzer.lengths = (0,) * (depth + 1)  # nothing is recorded: only the depth is read
        try:
            outs = walk(
                body.jaxpr, [Abstract(CONST)] * len(body.consts), [*carry_in(carry), *xs], analyzer
            )
        except Unsupported:
            return carry
        new = [
            a if s else _carry_join(a, b)
            for a, b, s in zip(carry, outs[:n_carry], same, strict=True)
        ]
        if new == carry:
            return carry
        carry = new
    return carry


def _carry_join(a: Abstract, b: Abstract) -> Abstract:
    kind = join([a.kind, b.kind])
    if kind != DERIVED:
        return Abstract(kind)
    origins = [x.origin for x in (a, b) if x.kind == DERIVED]
    leaves = frozenset().union(*(o.leaves for o in origins))
    return Abstract(DERIVED, Origin(leaves, None))


def _leaves_of(ins: Sequence[Abstract]) -> frozenset[int]:
    return frozenset().union(*(a.origin.leaves for a in ins if a.kind == DERIVED))


def _shared(a: Abstract, depth: int) -> Abstract:
    """`a` inside a scan `depth` scans deep that reuses it in every iteration: the same
    entries (the chain is kept), reused from that scan on unless already reused."""
    if a.kind != DERIVED:
        return a
    o = a.origin
    return Abstract(
        DERIVED, Origin(o.leaves, o.chain, depth if o.shared_at is None else o.shared_at)
    )


def _sliced(a: Abstract) -> Abstract:
    if a.kind != DERIVED:
        return a
    o = a.origin
    # The slices of a reused value are other entries in each inner iteration but the same
    # in each outer one: the leaf's gradient is formed from all its uses.
    chain = None if o.chain is None or o.shared_at is not None else (*o.chain, Step("slice"))
    return Abstract(DERIVED, Origin(o.leaves, chain, o.shared_at))


def _stacked(a: Abstract) -> Abstract:
    if a.kind != DERIVED:
        return a
    # A scan's derived outputs are stacked iterations: no longer one leaf's entries moved.
    return Abstract(DERIVED, Origin(a.origin.leaves, None, a.origin.shared_at))


def analyze(
    closed: Any, kinds: Sequence[str], leaf_of: Sequence[int | None], per_example: frozenset
) -> Analysis:
    """Walks the per-example program `closed` (a `ClosedJaxpr`).

    Args:
        closed: The program, traced for one example.
        kinds: The kind of each of its inputs.
        leaf_of: For each input, its leaf index when it is a differentiated leaf.
        per_example: Leaves that take the per-example path (their inputs are `BATCHED`).

    Raises:
        Unsupported: naming leaves the fast path cannot follow; the caller moves them
            to `per_example` and walks again.
    """
    inputs = []
    for kind, leaf, var in zip(kinds, leaf_of, closed.jaxpr.invars, strict=True):
        f = is_float(var.aval)
        if leaf is not None and leaf not in per_example and f:
            inputs.append(Abstract(DERIVED, Origin(frozenset([leaf]), ())))
        elif leaf is not None and f:
            inputs.append(Abstract(BATCHED))
        else:
            inputs.append(Abstract(kind))
    analyzer = _Analyzer()
    outs = analyzer.walk(closed.jaxpr, [Abstract(CONST)] * len(closed.consts), inputs)
    return Analysis(analyzer.sites, analyzer.blocks, [analyzer.read(o) for o in outs])
