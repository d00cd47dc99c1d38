"""Builders of the route matrix (tests/_matrix.py): models per style, runners per route.

A cell runs a capability's train step, written once against a small style interface
(what is differentiated, how the update is applied), on a route (how the step is placed
on the 8 host devices), and returns the variables it ends with, in one layout for every
style, for comparison with the whole-batch reference of tests/_matrix.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax._base.compat import pcast_to_varying

AXIS = "data"
R = 8  # devices on the mapped and sharded routes
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


# --- the route's context, seen by the step ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What a step needs to know of its route.

    axis: the mapped axis (`shard_map`, `pmap`) or None (one device, global-view jit).
    typed: inside `shard_map`, where replicated params must be cast to varying before
      they are differentiated (otherwise the backward pass sums every device's gradient).
    """

    axis: str | None = None
    typed: bool = False

    def vary(self, tree: Any) -> Any:
        return pcast_to_varying(tree, self.axis) if self.typed else tree

    def mean(self, tree: Any) -> Any:
        return jax.lax.pmean(tree, self.axis) if self.axis else tree

    @property
    def devices(self) -> int:
        return R if self.axis else 1


def route_ctx(route: str) -> Ctx:
    """The context of a capability's optimizer: `axis_name` on the mapped routes."""
    return Ctx(axis=AXIS) if route in ("shard_map", "pmap") else Ctx()


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
    family: str  # "linen" or "nnx"

    def init(self, tx: optax.GradientTransformation, params: dict[str, Any]) -> Any:
        raise NotImplementedError

    def diff(self, state: Any, ctx: Ctx) -> Any:
        """What the capability differentiates, with params varying on a typed route."""
        raise NotImplementedError

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

    def diff(self, state, ctx):
        return ctx.vary(state[0])

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

    def diff(self, state, ctx):
        return ctx.vary(state.params)

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

    def diff(self, state, ctx):
        return vary_module(state[0], ctx)

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

    def diff(self, state, ctx):
        return ctx.vary(state[0])

    def forward(self, diff, x):
        return nnx.merge(self.graphdef, diff, self.rest, copy=True)(x)

    update = LinenParams.update

    def params(self, state):
        return nnx.to_pure_dict(state[0])


def make_style(name: str) -> Style:
    return {
        "linen": LinenParams,
        "train_state": FlaxTrainState,
        "nnx_module": functools.partial(NnxModule, "nnx_module", nnx.Optimizer),
        "nnx_optimizer": functools.partial(NnxModule, "nnx_optimizer", ga.flax.Optimizer),
        "nnx_split": NnxSplit,
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


def _replicas_agree(state: Any) -> Any:
    """One replica's copy of a `pmap` state, after checking every replica holds the same."""

    def first(x):
        x = np.asarray(
            jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        )
        np.testing.assert_array_equal(x, np.broadcast_to(x[0], x.shape))
        return x[0]

    return jax.tree.map(first, state)


def run_one_device(step, state, batches):
    step = jax.jit(functools.partial(step, ctx=Ctx()))
    for batch in batches:
        state = step(state, batch)
    return state


def run_global_view(kind):
    def run(step, state, batches):
        mesh = jax.make_mesh((R,), (AXIS,), axis_types=(kind,))
        with jax.set_mesh(mesh):
            state = jax.device_put(state, NamedSharding(mesh, P()))
            step = jax.jit(functools.partial(step, ctx=Ctx()))
            for batch in batches:
                state = step(state, jax.device_put(batch, NamedSharding(mesh, P(AXIS))))
        return state

    return run


def run_shard_map(step, state, batches):
    mesh = jax.make_mesh((R,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    specs = _state_specs(state)
    window = _has_window(state)
    ctx = Ctx(axis=AXIS, typed=True)

    def body(state, batch):
        state = ga.remove_replica_axis(state) if window else state
        state = step(state, batch, ctx=ctx)
        return ga.add_replica_axis(state) if window else state

    def place(state):
        return ga.add_replica_axis(state) if window else state

    state = jax.device_put(state, NamedSharding(mesh, P()))
    state = jax.jit(jax.shard_map(place, mesh=mesh, in_specs=P(), out_specs=specs))(state)
    step_fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(AXIS)), out_specs=specs))
    for batch in batches:
        state = step_fn(state, jax.device_put(batch, NamedSharding(mesh, P(AXIS))))
    return state


def run_pmap(step, state, batches):
    def stack(x):
        return jax.tree.map(lambda leaf: jnp.stack([leaf] * R), x)

    step_fn = jax.pmap(functools.partial(step, ctx=Ctx(axis=AXIS)), axis_name=AXIS)
    state = stack(state)
    for batch in batches:
        state = step_fn(state, jax.tree.map(lambda x: x.reshape(R, -1, *x.shape[1:]), batch))
    return _replicas_agree(state)


ROUTE_RUNNERS = {
    "one_device": run_one_device,
    "shard_map": run_shard_map,
    "pmap": run_pmap,
    "jit_auto": run_global_view(jax.sharding.AxisType.Auto),
    "jit_explicit": run_global_view(jax.sharding.AxisType.Explicit),
}


# --- capabilities: the step, its optimizer and its whole-batch reference -------------------

K = 2  # micro-batches per window or per step
LR = 0.5
WINDOWS = 2
ROWS = 2  # examples per device and micro-batch
CLIP = 0.3  # the l2 clip norm of the DP cells


def mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((out - y) ** 2)


def make_batches(calls: int, rows: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(rows, D_IN)).astype(np.float32),
            "y": rng.normal(size=(rows, D_OUT)).astype(np.float32),
        }
        for _ in range(calls)
    ]


def concat(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


def sgd_reference(params, batches, grad_of, per_update):
    """Plain SGD on one device, one update per `per_update` batches, on their concatenation."""
    params = jax.tree.map(jnp.asarray, params)
    for i in range(0, len(batches), per_update):
        grads = grad_of(params, concat(batches[i : i + per_update]))
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return params


def whole_batch_loss(params, batch):
    return mse(LinenNet().apply({"params": params}, batch["x"]), batch["y"])


class Capability:
    """A capability's train step, written once for every style, and its reference."""

    window = True  # K calls per optimizer step (else K micro-batches inside one call)

    def batches(self) -> list[dict[str, np.ndarray]]:
        if self.window:
            return make_batches(WINDOWS * K, R * ROWS)
        return make_batches(WINDOWS, R * ROWS * K)

    def tx(self, ctx: Ctx) -> optax.GradientTransformation:
        if self.window:
            return ga.accumulate(optax.sgd(LR), K, axis_name=ctx.axis)
        return optax.sgd(LR)

    def grads(self, style: Style, diff: Any, batch: Any, ctx: Ctx) -> Any:
        raise NotImplementedError

    def step(self, style: Style, state: Any, batch: Any, ctx: Ctx) -> Any:
        grads = self.grads(style, style.diff(state, ctx), batch, ctx)
        return style.update(state, grads)

    def loss(self, style: Style) -> Callable[..., jax.Array]:
        return lambda diff, batch: mse(style.forward(diff, batch["x"]), batch["y"])

    def reference(self, params, batches):
        return sgd_reference(params, batches, jax.grad(whole_batch_loss), K if self.window else 1)

    def run(self, style_name: str, route: str) -> tuple[Any, Any, Any]:
        """The variables a cell ends with, the whole-batch reference's, and the start."""
        style = make_style(style_name)
        params = initial_params()
        state = style.init(self.tx(route_ctx(route)), params)
        batches = self.batches()
        step = functools.partial(self.step, style)
        state = ROUTE_RUNNERS[route](step, state, batches)
        return style.params(state), self.reference(params, batches), params


class Accumulate(Capability):
    def grads(self, style, diff, batch, ctx):
        return style.grad(self.loss(style), diff, batch)


class Microbatch(Capability):
    window = False

    def grads(self, style, diff, batch, ctx):
        _, grads = ga.microbatch_value_and_grad(self.loss(style), K)(diff, batch)
        return ctx.mean(grads)


def _balance(out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each example's class (argmax, int32 one-hot) and its softmax probabilities."""
    probs = jax.nn.softmax(out, axis=-1)
    return jax.nn.one_hot(jnp.argmax(out, -1), D_OUT, dtype=jnp.int32), probs


def _balanced_mse(out, y, counts):
    _, probs = _balance(out)
    fractions = counts / jnp.sum(counts)
    return mse(out, y) + D_OUT * jnp.sum(fractions * probs.mean(0))


class Statistics(Capability):
    """A load-balancing loss: the whole batch's class fractions times the mean probabilities."""

    window = False

    def grads(self, style, diff, batch, ctx):
        def counts(diff, batch):
            return {"counts": _balance(style.forward(diff, batch["x"]))[0].sum(0)}

        def loss(diff, batch, *, statistics):
            return _balanced_mse(style.forward(diff, batch["x"]), batch["y"], statistics["counts"])

        fn = ga.microbatch_value_and_grad(loss, K, statistics_fn=counts, axis_name=ctx.axis)
        return ctx.mean(fn(diff, batch)[1])

    def reference(self, params, batches):
        def loss(params, batch):
            out = LinenNet().apply({"params": params}, batch["x"])
            return _balanced_mse(out, batch["y"], _balance(out)[0].sum(0))

        return sgd_reference(params, batches, jax.grad(loss), 1)


def _unit(x: jax.Array) -> jax.Array:
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _contrastive(reps: dict[str, jax.Array]) -> jax.Array:
    return ga.losses.clip_loss(_unit(reps["out"]), _unit(reps["y"]), 5.0)


class Coupled(Capability):
    """A contrastive loss over the whole batch (every row against every other)."""

    window = False

    def grads(self, style, diff, batch, ctx):
        def embed(diff, batch):
            return {"out": style.forward(diff, batch["x"]), "y": batch["y"]}

        fn = ga.coupled_value_and_grad(
            lambda d, reps: _contrastive(reps), embed, K, axis_name=ctx.axis
        )
        return ctx.mean(fn(diff, batch)[1])

    def reference(self, params, batches):
        def loss(params, batch):
            out = LinenNet().apply({"params": params}, batch["x"])
            return _contrastive({"out": out, "y": batch["y"]})

        return sgd_reference(params, batches, jax.grad(loss), 1)


class Privacy(Capability):
    """Per-example clipping (`clipped_grad`) into the noisy window (`dp_accumulate`, no noise)."""

    def tx(self, ctx):
        return ga.privacy.dp_accumulate(
            optax.sgd(LR),
            K,
            l2_clip_norm=CLIP,
            expected_batch_size=K * R * ROWS,
            noise_multiplier=0.0,
            key=jax.random.key(0),
            axis_name=ctx.axis,
        )

    def grads(self, style, diff, batch, ctx):
        return ga.privacy.clipped_grad(self.loss(style), CLIP)(diff, batch)[1]

    def reference(self, params, batches):
        def clipped_mean(params, batch):
            def one(x, y):
                return jax.grad(whole_batch_loss)(params, {"x": x[None], "y": y[None]})

            per_example = jax.vmap(one)(batch["x"], batch["y"])
            norms = jnp.sqrt(
                sum(
                    jnp.sum(g.reshape(len(batch["x"]), -1) ** 2, 1)
                    for g in jax.tree.leaves(per_example)
                )
            )
            factor = jnp.minimum(1.0, CLIP / norms)
            return jax.tree.map(
                lambda g: jnp.tensordot(factor, g, 1) / len(batch["x"]), per_example
            )

        return sgd_reference(params, batches, clipped_mean, K)


CAPABILITY_PROGRAMS: dict[str, Capability] = {
    "accumulate": Accumulate(),
    "microbatch": Microbatch(),
    "statistics": Statistics(),
    "coupled": Coupled(),
    "privacy": Privacy(),
}


# --- AccumBatchNorm: the window's running statistics ---------------------------------------


class BnTrainState(ga.flax.TrainState):
    batch_stats: Any


def _bn_linen_grads(model, params, stats, x, y):
    def loss(params):
        out, new = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
        return mse(out, y), new["batch_stats"]

    return jax.grad(loss, has_aux=True)(params)


def _bn_forward(params, x):
    """The reference layer: each call's batch normalised with its own statistics."""
    h = x @ params["l1"]["kernel"] + params["l1"]["bias"]
    h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5) * params["bn"]["scale"] + params["bn"]["bias"]
    return jnp.tanh(h) @ params["l2"]["kernel"] + params["l2"]["bias"]


class BatchNorm(Capability):
    """`AccumBatchNorm` / `NNXAccumBatchNorm` in an `accumulate` window, committed at the close.

    Exact here: the running statistics after each window (those of the whole window's
    batch, one EMA step), and the params (the mean of the calls' gradients, each call
    normalised with its own global batch's statistics, as documented).
    """

    def run(self, style_name, route):
        ctx = route_ctx(route)
        params = initial_params(norm=True)
        tx = self.tx(ctx)
        step = functools.partial(getattr(self, f"step_{style_name}"), tx)
        state = getattr(self, f"init_{style_name}")(tx, params, ctx.axis)
        batches = self.batches()
        state = ROUTE_RUNNERS[route](step, state, batches)
        start = {"params": params, "stats": {"mean": np.zeros(HIDDEN), "var": np.ones(HIDDEN)}}
        return (
            getattr(self, f"read_{style_name}")(state),
            self.bn_reference(params, batches),
            start,
        )

    # linen params
    def init_linen(self, tx, params, axis):
        self.model = LinenNet(norm=True, axis_name=axis)
        variables = linen_variables(self.model, params)
        return variables["params"], variables["batch_stats"], tx.init(variables["params"])

    def step_linen(self, tx, state, batch, ctx):
        params, stats, opt_state = state
        grads, stats = _bn_linen_grads(self.model, ctx.vary(params), stats, batch["x"], batch["y"])
        closes = ga.closes_window(opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        stats = ga.flax.commit_batch_stats(stats, closes)
        return optax.apply_updates(params, updates), stats, opt_state

    def read_linen(self, state):
        return {"params": state[0], "stats": _linen_stats(state[1])}

    # ga.flax.TrainState with a batch_stats field
    def init_train_state(self, tx, params, axis):
        self.model = LinenNet(norm=True, axis_name=axis)
        variables = linen_variables(self.model, params)
        return BnTrainState.create(
            apply_fn=self.model.apply,
            params=variables["params"],
            batch_stats=variables["batch_stats"],
            tx=tx,
        )

    def step_train_state(self, tx, state, batch, ctx):
        grads, stats = _bn_linen_grads(
            self.model, ctx.vary(state.params), state.batch_stats, batch["x"], batch["y"]
        )
        closes = ga.closes_window(state.opt_state)
        stats = ga.flax.commit_batch_stats(stats, closes)
        return state.apply_gradients(grads=grads, batch_stats=stats)

    def read_train_state(self, state):
        return {"params": state.params, "stats": _linen_stats(state.batch_stats)}

    # NNX modules, with flax's nnx.Optimizer or ga.flax.Optimizer
    def _init_module(self, optimizer_cls, tx, params, axis):
        model = nnx_model(params, norm=True, axis_name=axis)
        return model, optimizer_cls(model, tx, wrt=nnx.Param)

    def _step_module(self, tx, state, batch, ctx):
        model, optimizer = state
        local = vary_module(model, ctx)
        grads = nnx.grad(lambda m: mse(m(batch["x"]), batch["y"]))(local)
        # On a typed route the params were cast in a copy: its statistics are the model's.
        nnx.update(model, nnx.state(local, nnx.BatchStat))
        closes = ga.closes_window(optimizer.opt_state)
        optimizer.update(model, grads)
        ga.flax.commit_nnx_batch_stats(model, closes)
        return model, optimizer

    def _read_module(self, state):
        return {"params": pure_params(state[0]), "stats": _nnx_stats(state[0])}

    init_nnx_module = functools.partialmethod(_init_module, nnx.Optimizer)
    init_nnx_optimizer = functools.partialmethod(_init_module, ga.flax.Optimizer)
    step_nnx_module = step_nnx_optimizer = _step_module
    read_nnx_module = read_nnx_optimizer = _read_module

    # split NNX state: params, the rest (statistics, RNG streams), the optax state
    def init_nnx_split(self, tx, params, axis):
        self.graphdef, state, rest = nnx.split(
            nnx_model(params, norm=True, axis_name=axis), nnx.Param, ...
        )
        return state, rest, tx.init(state)

    def step_nnx_split(self, tx, state, batch, ctx):
        params, rest, opt_state = state

        def loss(params, rest):
            model = nnx.merge(self.graphdef, params, rest, copy=True)
            return mse(model(batch["x"]), batch["y"]), nnx.state(model, nnx.Not(nnx.Param))

        grads, rest = jax.grad(loss, has_aux=True)(ctx.vary(params), rest)
        closes = ga.closes_window(opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        model = nnx.merge(self.graphdef, params, rest, copy=True)
        ga.flax.commit_nnx_batch_stats(model, closes)
        rest = nnx.state(model, nnx.Not(nnx.Param))
        return optax.apply_updates(params, updates), rest, opt_state

    def read_nnx_split(self, state):
        model = nnx.merge(self.graphdef, state[0], state[1])
        return {"params": pure_params(model), "stats": _nnx_stats(model)}

    def bn_reference(self, params, batches):
        params = jax.tree.map(jnp.asarray, params)
        mean, var = jnp.zeros(HIDDEN), jnp.ones(HIDDEN)
        for w in range(WINDOWS):
            window = batches[w * K : (w + 1) * K]
            calls = [
                jax.grad(lambda p, b=b: mse(_bn_forward(p, b["x"]), b["y"]))(params) for b in window
            ]
            h = concat(window)["x"] @ params["l1"]["kernel"] + params["l1"]["bias"]
            mean = MOMENTUM * mean + (1 - MOMENTUM) * h.mean(0)
            var = MOMENTUM * var + (1 - MOMENTUM) * h.var(0)
            grads = jax.tree.map(lambda *g: sum(g) / K, *calls)
            params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        return {"params": params, "stats": {"mean": mean, "var": var}}


def _linen_stats(batch_stats):
    return {"mean": batch_stats["bn"]["mean"], "var": batch_stats["bn"]["var"]}


def _nnx_stats(model):
    return {"mean": model.bn.mean[...], "var": model.bn.var[...]}


CAPABILITY_PROGRAMS["batchnorm"] = BatchNorm()


# --- fp8 metadata: held through the window, its max written at the close ------------------

from _fp8_common import META, Mlp, warm_variables  # noqa: E402


def _is_fp8(path: Any, value: Any) -> bool:
    return type(value).__name__ == META


def _fp8_batches() -> list[dict[str, np.ndarray]]:
    # Rows of very different scales, so that every call has its own amax.
    batches = make_batches(WINDOWS * K, R * ROWS, seed=2)
    scales = np.linspace(0.5, 8.0, WINDOWS * K * R * ROWS, dtype=np.float32).reshape(
        WINDOWS * K, R * ROWS, 1
    )
    return [
        {**b, "x": b["x"] * s}
        for b, s in zip(batches, np.random.default_rng(3).permuted(scales, axis=1), strict=True)
    ]


class Fp8(Capability):
    """Flax fp8 layers (delayed scaling) in an `accumulate` window.

    Each call differentiates its share of the window's loss (1/K, and 1/devices on a
    mapped route) and the window sums (`use_grad_mean=False`), so that every cotangent,
    the output-gradient amax included, is the large batch's (docs/mixed_precision.md).
    """

    def tx(self, ctx):
        return ga.accumulate(optax.sgd(LR), K, use_grad_mean=False, axis_name=ctx.axis)

    def run(self, style_name, route):
        self.model = Mlp()
        variables = warm_variables(self.model)
        tx = self.tx(route_ctx(route))
        state = getattr(self, f"init_{style_name}")(tx, variables)
        step = functools.partial(getattr(self, f"step_{style_name}"), tx)
        batches = _fp8_batches()
        state = ROUTE_RUNNERS[route](step, state, batches)
        return (
            getattr(self, f"read_{style_name}")(state),
            self.fp8_reference(variables, batches),
            {"params": variables["params"], META: variables[META]},
        )

    def share(self, batch, ctx):
        return lambda v: mse(self.model.apply(v, batch["x"]), batch["y"]) / (K * ctx.devices)

    # linen variables with the optax step written out: the metadata reach `tx`
    def init_linen(self, tx, variables):
        return variables, tx.init(variables)

    def step_linen(self, tx, state, batch, ctx):
        variables, opt_state = state
        grads = jax.grad(self.share(batch, ctx))(ctx.vary(variables))
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state

    def read_linen(self, state):
        return {"params": state[0]["params"], META: state[0][META]}

    def init_train_state(self, tx, variables):
        return ga.flax.TrainState.create(apply_fn=self.model.apply, params=variables, tx=tx)

    def step_train_state(self, tx, state, batch, ctx):
        grads = jax.grad(self.share(batch, ctx))(ctx.vary(state.params))
        return state.apply_gradients(grads=grads)

    def read_train_state(self, state):
        return {"params": state.params["params"], META: state.params[META]}

    # NNX: the linen fp8 model under nnx.bridge; the metadata are differentiated with the params
    def _module(self, variables):
        model = nnx.bridge.ToNNX(self.model, rngs=nnx.Rngs(0))
        nnx.bridge.lazy_init(model, jnp.zeros((2, D_IN)))
        for collection, wanted in ((nnx.Param, "params"), (_is_fp8, META)):
            state = nnx.state(model, collection)
            nnx.replace_by_pure_dict(state, variables[wanted])
            nnx.update(model, state)
        return model

    def init_nnx_module(self, tx, variables):
        # Flax's own optimizer, told to step the metadata with the params.
        model = self._module(variables)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Any(nnx.Param, _is_fp8))

    def init_nnx_optimizer(self, tx, variables):
        model = self._module(variables)
        return model, ga.flax.Optimizer(model, tx, wrt=nnx.Param)

    def _step_module(self, tx, state, batch, ctx):
        model, optimizer = state
        local = vary_module(model, ctx, nnx.Any(nnx.Param, _is_fp8))
        loss = lambda m: mse(m(batch["x"]), batch["y"]) / (K * ctx.devices)  # noqa: E731
        grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, _is_fp8)))(local)
        optimizer.update(model, grads)
        return model, optimizer

    step_nnx_module = step_nnx_optimizer = _step_module

    def _read_module(self, state):
        model = state[0]
        return {
            "params": pure_params(model),
            META: nnx.to_pure_dict(nnx.state(model, _is_fp8)),
        }

    read_nnx_module = read_nnx_optimizer = _read_module

    # split NNX state: the metadata split out with the params, as the optimizer's tree
    def init_nnx_split(self, tx, variables):
        self.graphdef, state, self.rest = nnx.split(
            self._module(variables), nnx.Any(nnx.Param, _is_fp8), ...
        )
        return state, tx.init(state)

    def step_nnx_split(self, tx, state, batch, ctx):
        def loss(state):
            model = nnx.merge(self.graphdef, state, self.rest, copy=True)
            return mse(model(batch["x"]), batch["y"]) / (K * ctx.devices)

        params, opt_state = state
        grads = jax.grad(loss)(ctx.vary(params))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def read_nnx_split(self, state):
        return self._read_module((nnx.merge(self.graphdef, state[0], self.rest),))

    def fp8_reference(self, variables, batches):
        """Flax's own fp8 step on each window's whole batch: SGD, metadata overwritten."""
        loss = lambda v, b: mse(self.model.apply(v, b["x"]), b["y"])  # noqa: E731
        for w in range(WINDOWS):
            grads = jax.grad(loss)(variables, concat(batches[w * K : (w + 1) * K]))
            params = jax.tree.map(lambda p, g: p - LR * g, variables["params"], grads["params"])
            variables = {"params": params, META: grads[META]}
        return {"params": variables["params"], META: variables[META]}


CAPABILITY_PROGRAMS["fp8"] = Fp8()


# --- witnesses of the reasons given for cells that are not applicable ---------------------


def flax_fp8_fails_on_an_explicit_mesh() -> bool:
    """Whether Flax's fp8 model alone fails to differentiate under global-view `jit` on an
    Explicit mesh with a sharded batch (the reason the fp8 cells there are not applicable)."""
    model = Mlp()
    variables = warm_variables(model)
    batch = _fp8_batches()[0]
    mesh = jax.make_mesh((R,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        variables = jax.device_put(variables, NamedSharding(mesh, P()))
        batch = jax.device_put(batch, NamedSharding(mesh, P(AXIS)))
        try:
            jax.jit(jax.grad(lambda v: mse(model.apply(v, batch["x"]), batch["y"])))(variables)
        except Exception as err:  # JAX's ShardingTypeError has no public name
            return type(err).__name__ == "ShardingTypeError" and "out_sharding" in str(err)
    return False
