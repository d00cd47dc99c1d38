"""The route matrix's models, model styles and routes (tests/_matrix.py declares the cells).

A capability's train step (tests/_matrix_run.py) is written once against the small
`Style` interface (what is differentiated, how the update is applied) and a `Ctx` (what
the route asks of the step); a runner places it on a route, on the 8 host devices, and
returns the variables it ends with in one layout for every style.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import _equivalence as E
import _matrix as M
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax._base import compat
from gradaccum_jax._base.compat import pcast_to_varying

AXIS = "data"
R = M.DEVICES
D_IN, HIDDEN, D_OUT = 4, 8, 2
MOMENTUM = 0.9  # of the batch-norm layers


# --- models -------------------------------------------------------------------------------


class LinenNet(nn.Module):
    """Dense, (AccumBatchNorm,) tanh, Dense: the linen model of every style that uses linen."""

    norm: bool = False
    axis_name: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(HIDDEN, name="l1")(x)
        if self.norm:
            h = ga.flax.AccumBatchNorm(
                use_running_average=False, momentum=MOMENTUM, axis_name=self.axis_name, name="bn"
            )(h)
        return nn.Dense(D_OUT, name="l2")(jnp.tanh(h))


class NnxNet(nnx.Module):
    """The same network in NNX (the same variable paths as `LinenNet`'s params)."""

    def __init__(self, *, norm: bool = False, axis_name: Any = None) -> None:
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
        self.bn = (
            ga.flax.NNXAccumBatchNorm(HIDDEN, momentum=MOMENTUM, axis_name=axis_name, rngs=rngs)
            if norm
            else None
        )
        # Modules hold RNG streams (here a dropout layer's): a rate of 0 keeps the
        # outputs those of the linen model, while the stream's key and counter are
        # state that every capability must carry without differentiating it.
        self.drop = nnx.Dropout(0.0, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, D_OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.l2(self.drop(jnp.tanh(h)))


class EqxNet(eqx.Module):
    """The same network as an `eqx.Module`: one example per call, weights `(out, in)`."""

    l1: eqx.nn.Linear
    l2: eqx.nn.Linear
    # A leaf that is not an array, as `eqx.nn.MLP` keeps its activation: the doors
    # differentiate and update the arrays and pass it through.
    activation: Callable[[jax.Array], jax.Array]

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(D_IN, HIDDEN, key=k1)
        self.l2 = eqx.nn.Linear(HIDDEN, D_OUT, key=k2)
        self.activation = jnp.tanh

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.activation(self.l1(x)))


def initial_params(norm: bool = False) -> dict[str, Any]:
    """The params every style starts from (numpy, the layout of `LinenNet`'s params)."""
    rng = np.random.default_rng(0)
    params = {
        "l1": {
            "kernel": rng.normal(size=(D_IN, HIDDEN)).astype(np.float32) / 2,
            "bias": rng.normal(size=HIDDEN).astype(np.float32) / 4,
        },
        "l2": {
            "kernel": rng.normal(size=(HIDDEN, D_OUT)).astype(np.float32) / 3,
            "bias": rng.normal(size=D_OUT).astype(np.float32) / 4,
        },
    }
    if norm:
        params["bn"] = {
            "scale": 1 + rng.normal(size=HIDDEN).astype(np.float32) / 4,
            "bias": rng.normal(size=HIDDEN).astype(np.float32) / 4,
        }
    return params


def linen_variables(model: nn.Module, params: dict[str, Any]) -> dict[str, Any]:
    variables = model.init(jax.random.key(0), jnp.zeros((2, D_IN)))
    return {**variables, "params": jax.tree.map(jnp.asarray, params)}


def nnx_model(params: dict[str, Any], **kwargs: Any) -> NnxNet:
    model = NnxNet(**kwargs)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    nnx.update(model, state)
    return model


def pure_params(module: nnx.Module) -> dict[str, Any]:
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _linear_leaves(model: Any) -> tuple[Any, ...]:
    return model.l1.weight, model.l1.bias, model.l2.weight, model.l2.bias


def equinox_model(params: dict[str, Any]) -> EqxNet:
    """An `EqxNet` holding `params` (the layout of `LinenNet`'s): each kernel transposed to
    Equinox's `(out, in)`. Its structure comes from Equinox's own layers, abstractly."""
    shapes = eqx.filter_eval_shape(lambda: EqxNet(jax.random.key(0)))
    l1, l2 = params["l1"], params["l2"]
    values = (l1["kernel"].T, l1["bias"], l2["kernel"].T, l2["bias"])
    return eqx.tree_at(_linear_leaves, shapes, tuple(map(jnp.asarray, values)))


def equinox_params(model: Any) -> dict[str, Any]:
    """The arrays of an `EqxNet` in the layout of `LinenNet`'s params."""
    w1, b1, w2, b2 = _linear_leaves(model)
    return {"l1": {"kernel": w1.T, "bias": b1}, "l2": {"kernel": w2.T, "bias": b2}}


# --- the route's context, seen by the step ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What a step needs to know of its route.

    axis: the mapped axis (`shard_map`, `pmap`) or None (one device, global-view jit).
    typed: inside `shard_map`, where replicated params must be cast to varying before
      they are differentiated (otherwise the backward pass sums every device's gradient).
    unreduced: global-view jit on an Explicit mesh with per-device gradients left
      unreduced (`ga.unreduced_value_and_grad`), summed where a window closes.
    """

    axis: str | None = None
    typed: bool = False
    unreduced: bool = False

    def vary(self, tree: Any) -> Any:
        return pcast_to_varying(tree, self.axis) if self.typed else tree

    def mean(self, tree: Any) -> Any:
        """The devices' values reduced as the micro-batching guide does (`reduce_replicas`)."""
        return ga.reduce_replicas(tree, self.axis) if self.axis else tree

    @property
    def devices(self) -> int:
        return R if self.axis else 1


ROUTE_CTX = {
    "one_device": Ctx(),
    "shard_map": Ctx(axis=AXIS, typed=True),
    "pmap": Ctx(axis=AXIS),
    "jit_auto": Ctx(),
    "jit_explicit": Ctx(),
    "jit_explicit_no_mesh": Ctx(),
    "jit_unreduced": Ctx(unreduced=True),
}


def summed(tree: Any) -> Any:
    """Partial sums typed unreduced over the devices, summed into replicated arrays."""
    return compat.reshard(tree, P())


def vary_module(model: nnx.Module, ctx: Ctx, wrt: Any = nnx.Param) -> nnx.Module:
    """`model`, or on a typed route a copy whose differentiated variables (`wrt`) vary.

    The rest of the state (statistics, RNG streams) stays replicated, as the state
    that the step returns must be.
    """
    if not ctx.typed:
        return model
    graphdef, diff, rest = nnx.split(model, wrt, ...)
    return nnx.merge(graphdef, ctx.vary(diff), rest)


# --- styles: what is differentiated, and how the update is applied -------------------------


class Style:
    """One way to hold a model and its optimizer; every step is written against this."""

    name: str
    family: str  # "linen", "nnx" or "equinox"

    def init(self, tx: optax.GradientTransformation, params: dict[str, Any]) -> Any:
        raise NotImplementedError

    def arg(self, state: Any) -> Any:
        """What the capability differentiates: params, a params `nnx.State`, a module."""
        raise NotImplementedError

    def local(self, diff: Any, ctx: Ctx) -> Any:
        """`diff` with its params cast to varying on a typed route (`shard_map`)."""
        return ctx.vary(diff)

    def diff(self, state: Any, ctx: Ctx) -> Any:
        return self.local(self.arg(state), ctx)

    def crossing(self, diff: Any) -> tuple[Any, Callable[[Any], Any]]:
        """`diff` as what crosses a `jax.shard_map` boundary, and how to rebuild it inside."""
        return diff, lambda inside: inside

    def forward(self, diff: Any, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def grad(self, loss: Callable[..., jax.Array], diff: Any, *args: Any) -> Any:
        return jax.grad(loss)(diff, *args)

    def update(self, state: Any, grads: Any) -> Any:
        raise NotImplementedError

    def params(self, state: Any) -> dict[str, Any]:
        raise NotImplementedError


class LinenParams(Style):
    """Linen params, the optax step written out: `tx.update`, `optax.apply_updates`."""

    name, family = "linen", "linen"

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model or LinenNet()

    def init(self, tx, params):
        self.tx = tx
        variables = linen_variables(self.model, params)
        return variables["params"], tx.init(variables["params"])

    def arg(self, state):
        return state[0]

    def forward(self, diff, x):
        return self.model.apply({"params": diff}, x)

    def update(self, state, grads):
        params, opt_state = state
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def params(self, state):
        return state[0]


class FlaxTrainState(LinenParams):
    """`ga.flax.TrainState`: linen only (it holds `apply_fn` and a params tree)."""

    name = "train_state"

    def init(self, tx, params):
        variables = linen_variables(self.model, params)
        return ga.flax.TrainState.create(
            apply_fn=self.model.apply, params=variables["params"], tx=tx
        )

    def arg(self, state):
        return state.params

    def update(self, state, grads):
        return state.apply_gradients(grads=grads)

    def params(self, state):
        return state.params


class NnxModule(Style):
    """An NNX module, differentiated as a module, stepped by `optimizer_cls`."""

    family = "nnx"

    def __init__(self, name: str, optimizer_cls: type) -> None:
        self.name = name
        self.optimizer_cls = optimizer_cls

    def init(self, tx, params):
        model = nnx_model(params)
        return model, self.optimizer_cls(model, tx, wrt=nnx.Param)

    def arg(self, state):
        return state[0]

    def local(self, diff, ctx):
        return vary_module(diff, ctx)

    def forward(self, diff, x):
        return diff(x)

    def grad(self, loss, diff, *args):
        return nnx.grad(loss)(diff, *args)

    def update(self, state, grads):
        model, optimizer = state
        optimizer.update(model, grads)
        return model, optimizer

    def params(self, state):
        return pure_params(state[0])


class NnxSplit(Style):
    """`nnx.split` state: pure functions of the params' `nnx.State`, merged in the loss."""

    name, family = "nnx_split", "nnx"

    def init(self, tx, params):
        self.tx = tx
        self.graphdef, state, self.rest = nnx.split(nnx_model(params), nnx.Param, ...)
        return state, tx.init(state)

    def arg(self, state):
        return state[0]

    def forward(self, diff, x):
        return nnx.merge(self.graphdef, diff, self.rest, copy=True)(x)

    update = LinenParams.update

    def params(self, state):
        return nnx.to_pure_dict(state[0])


class EquinoxModel(Style):
    """An `eqx.Module` passed whole to the doors that take one (`eqx.filter_grad`,
    `microbatch_value_and_grad`, `ga.apply_gradients`). Across the route's boundary (`jax.jit`,
    `jax.shard_map`, `jax.pmap`) go its arrays, the rest closed over, as `eqx.filter_jit` does
    and as Equinox's users write `shard_map`: `eqx.partition`, then `eqx.combine` inside."""

    name, family = "equinox", "equinox"

    def init(self, tx, params):
        self.tx = tx
        arrays, self.static = eqx.partition(equinox_model(params), eqx.is_array)
        return arrays, tx.init(eqx.filter(arrays, eqx.is_inexact_array))

    def arg(self, state):
        return eqx.combine(state[0], self.static)

    def local(self, diff, ctx):
        arrays, rest = eqx.partition(diff, eqx.is_inexact_array)
        return eqx.combine(ctx.vary(arrays), rest)

    def crossing(self, diff):
        arrays, rest = eqx.partition(diff, eqx.is_array)
        return arrays, lambda inside: eqx.combine(inside, rest)

    def forward(self, diff, x):
        return jax.vmap(diff)(x)

    def grad(self, loss, diff, *args):
        return eqx.filter_grad(loss)(diff, *args)

    def update(self, state, grads):
        model, opt_state = ga.apply_gradients(self.tx, grads, state[1], self.arg(state))
        arrays, rest = eqx.partition(model, eqx.is_array)
        assert rest.activation is self.static.activation  # passed through
        return arrays, opt_state

    def params(self, state):
        return equinox_params(state[0])


def make_style(name: str) -> Style:
    return {
        "linen": LinenParams,
        "train_state": FlaxTrainState,
        "nnx_module": functools.partial(NnxModule, "nnx_module", nnx.Optimizer),
        "nnx_optimizer": functools.partial(NnxModule, "nnx_optimizer", ga.flax.Optimizer),
        "nnx_split": NnxSplit,
        "equinox": EquinoxModel,
    }[name]()


# --- routes: where the step runs ----------------------------------------------------------


def _has_window(state: Any) -> bool:
    found = []
    jax.tree.map(
        lambda x: found.append(isinstance(x, ga.AccumulateState)),
        state,
        is_leaf=lambda x: isinstance(x, ga.AccumulateState),
    )
    return any(found)


def _state_specs(state: Any) -> Any:
    if _has_window(state):
        return ga.replica_state_specs(jax.eval_shape(lambda: state), AXIS)
    return jax.tree.map(lambda _: P(), state)


# A runner takes `step(state, batch, ctx)`, the initial state, the global batches and
# `read(state)`, the variables to compare; it returns what `read` gives at the end. The
# routes themselves are tests/_equivalence.py's runners.


def run_one_device(step, state, batches, read):
    return E.run_one_device(
        functools.partial(step, ctx=ROUTE_CTX["one_device"]), state, batches, read
    )


def run_global_view(kind, route, *, set_mesh=True):
    def run(step, state, batches, read):
        step = functools.partial(step, ctx=ROUTE_CTX[route])
        return E.run_global_view(
            step, state, batches, mesh=E.data_mesh(kind, AXIS), set_mesh=set_mesh, read=read
        )

    return run


def run_shard_map(step, state, batches, read):
    window = _has_window(state)
    ctx = ROUTE_CTX["shard_map"]

    def body(state, batch):
        state = ga.remove_replica_axis(state) if window else state
        state = step(state, batch, ctx=ctx)
        return ga.add_replica_axis(state) if window else state

    return E.run_shard_map(
        body,
        state,
        batches,
        mesh=E.data_mesh(axis=AXIS),
        specs=_state_specs(state),
        enter=ga.add_replica_axis if window else None,
        read=read,
    )


def run_pmap(step, state, batches, read):
    step = functools.partial(step, ctx=ROUTE_CTX["pmap"])
    return E.run_pmap(step, state, batches, axis=AXIS, read=read)


ROUTE_RUNNERS = {
    "one_device": run_one_device,
    "shard_map": run_shard_map,
    "pmap": run_pmap,
    "jit_auto": run_global_view(jax.sharding.AxisType.Auto, "jit_auto"),
    "jit_explicit": run_global_view(jax.sharding.AxisType.Explicit, "jit_explicit"),
    "jit_explicit_no_mesh": run_global_view(
        jax.sharding.AxisType.Explicit, "jit_explicit_no_mesh", set_mesh=False
    ),
    "jit_unreduced": run_global_view(jax.sharding.AxisType.Explicit, "jit_unreduced"),
}
