"""The inner transformation on a gradient held in parts: element by element, or refused.

Inside `jax.shard_map`, a window's gradient whose leaves are typed varying along mesh
axes besides `axis_name` (pipeline stages, tensor or FSDP shards) lies in parts on
those axes' devices: after the window's reduction over `axis_name`, each device holds
its part of the whole batch's mean gradient. An inner transformation that acts element
by element (`optax.sgd`, `adam`, `adamw`, `lion`, schedules) gives each part what the
whole gradient would get. One that reduces (a global norm for clipping, a finite check
over the tree, a trust ratio, a matrix product) would reduce this device's part alone
and apply a different partial value on every device: a plausible, wrong step.

`check_elementwise` traces the inner update once more, on the same abstract values, and
follows the parts through its program: a reduction of a part makes a partial value,
unless a collective over the parts' axes (`jax.lax.psum`) completes it; a partial value
that reaches the updates or the new state is refused with the fix. Under `jax.pmap`,
`check_vma=False` and global-view `jit` there are no varying types and nothing is
checked (under global view a reduction covers whole arrays).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend.core import Literal

from gradaccum_jax._base.compat import aval_varying_axes, varying_axes

# Primitives whose outputs combine several elements of an operand.
_REDUCING = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "reduce",
        "argmax",
        "argmin",
        "dot_general",
        "conv_general_dilated",
        "cumsum",
        "cumprod",
        "cummax",
        "cummin",
        "cumlogsumexp",
        "sort",
        "top_k",
        "reduce_window_sum",
        "reduce_window_max",
        "reduce_window_min",
        "reduce_window",
    }
)
# Collectives that combine the devices of the axes they name.
_COMPLETING = frozenset(
    {"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant"}
)


class Taint(NamedTuple):
    """What a value of the traced update is: clean, a part (`partial` False) or a partial
    reduction of parts (`partial` True), over `axes`; `origin` names the reduction."""

    axes: frozenset
    partial: bool = False
    origin: str = ""


CLEAN = Taint(frozenset())


def _merge(taints: Sequence[Taint]) -> Taint:
    axes = frozenset().union(*(t.axes for t in taints))
    partial = [t for t in taints if t.partial]
    return Taint(axes, bool(partial), partial[0].origin if partial else "")


def _where(eqn: Any) -> str:
    try:
        from jax._src import source_info_util

        return f"`{eqn.primitive.name}` at {source_info_util.summarize(eqn.source_info)}"
    except Exception:  # the summary is a convenience of JAX's internals
        return f"`{eqn.primitive.name}`"


def _closed(jaxpr: Any) -> tuple[Any, int]:
    """`(jaxpr, number of constvars)` of a `Jaxpr` or `ClosedJaxpr`."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    return inner, len(inner.constvars)


def _run(jaxpr: Any, taints: Sequence[Taint]) -> list[Taint]:
    """The taints of `jaxpr`'s outputs given its inputs' (constants clean)."""
    inner, _ = _closed(jaxpr)
    env: dict[Any, Taint] = {v: CLEAN for v in inner.constvars}
    env.update(zip(inner.invars, taints, strict=True))

    def read(v: Any) -> Taint:
        return CLEAN if isinstance(v, Literal) else env.get(v, CLEAN)

    for eqn in inner.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _eqn(eqn, ins)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in inner.outvars]


def _loop(body: Callable[[list[Taint]], list[Taint]], carry: list[Taint]) -> list[Taint]:
    """Carries' taints at the fixed point of `body` (a monotone map on a finite lattice)."""
    while True:
        new = [_merge([c, n]) for c, n in zip(carry, body(carry), strict=True)]
        if new == carry:
            return carry
        carry = new


def _eqn(eqn: Any, ins: list[Taint]) -> list[Taint]:
    name, params, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
    tainted = [t for t in ins if t.axes]
    if name in _COMPLETING:
        names = params.get("axes", params.get("axis_name", ()))
        names = frozenset(names if isinstance(names, tuple | list) else (names,))
        t = _merge(ins)
        left = t.axes - names
        return [Taint(left, t.partial and bool(left), t.origin if left else "")] * n_out
    if name in _REDUCING and tainted:
        return [Taint(_merge(ins).axes, True, _merge(ins).origin or _where(eqn))] * n_out
    if name == "cond":
        index, operands = ins[0], ins[1:]
        runs = [_run(b, operands) for b in params["branches"]]
        outs = [_merge(r) for r in zip(*runs, strict=True)]
        if index.axes:  # a decision taken on a part: partial everywhere it reaches
            return [Taint(o.axes | index.axes, True, o.origin or _where(eqn)) for o in outs]
        return outs
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond_consts, body_consts, init = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
        carry = _loop(lambda c: _run(params["body_jaxpr"], body_consts + c), list(init))
        decided = _merge(_run(params["cond_jaxpr"], cond_consts + carry))
        if decided.axes:
            return [Taint(c.axes | decided.axes, True, c.origin or _where(eqn)) for c in carry]
        return carry
    if name == "scan":
        nc, ncarry = params["num_consts"], params["num_carry"]
        consts, init, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
        carry = _loop(lambda c: _run(params["jaxpr"], consts + c + xs)[:ncarry], list(init))
        return carry + _run(params["jaxpr"], consts + carry + xs)[ncarry:]
    subs = [p for p in params.values() if hasattr(p, "eqns") or hasattr(p, "jaxpr")]
    if subs:  # a call (pjit, custom_jvp_call, checkpoint, ...): its operands are its inputs
        inner, _ = _closed(subs[0])
        if len(subs) == 1 and len(inner.invars) == len(ins) and len(inner.outvars) == n_out:
            return _run(subs[0], ins)
        if tainted:  # a program whose inputs cannot be followed: not element by element
            return [Taint(_merge(ins).axes, True, _merge(ins).origin or _where(eqn))] * n_out
    return [_merge(ins)] * n_out


def check_elementwise(
    update: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    """Raises `ValueError` if `update(*args)` reduces a gradient held in parts.

    `args` are `(reduced gradient, inner state, params)`; the parts' axes are those the
    reduced gradient's leaves vary along (it no longer varies along the window's
    `axis_name`).
    Nothing is traced when no leaf varies.
    """
    parts = frozenset().union(*(varying_axes(g) for g in jax.tree.leaves(args[0])))
    if not parts:
        return
    closed = jax.make_jaxpr(update)(*args)
    taints = [Taint(aval_varying_axes(v.aval) & parts) for v in closed.jaxpr.invars]
    out = _merge(_run(closed, taints))
    if not out.partial:
        return
    axes = sorted(out.axes, key=str)
    raise ValueError(
        "Inside jax.shard_map the window's gradient lies in parts "
        f"on the devices of mesh axes {axes} (its leaves vary along them besides "
        "the window's axis_name), and the inner transformation reduces it: "
        f"{out.origin} makes a value from this device's part alone (a norm, a finite "
        "check, a mean, a matrix product) that reaches the updates or the state, so each "
        "device would step with its own partial value. Keep only element-by-element "
        "transforms inside accumulate (optax.sgd, adam, adamw, lion, schedules), or "
        f"complete the reduction over the parts yourself (jax.lax.psum(x, {tuple(axes)!r}) "
        "inside your transform, e.g. of the squared norm), or take the step under "
        "global-view jax.jit, where a reduction covers whole arrays."
    )
