"""The route matrix's capabilities: each one's train step, optimizer and whole-batch reference.

tests/_matrix.py declares what each cell must give; tests/_matrix_routes.py holds the
models, styles and routes the steps here are written against. `CAPABILITY_PROGRAMS[name]
.run(style, route)` returns the variables a cell ends with, the reference's, and the
variables it started from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import _matrix as M
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _fp8_common import META, Mlp, warm_variables
from _matrix_routes import (
    AXIS,
    D_IN,
    D_OUT,
    HIDDEN,
    MOMENTUM,
    ROUTE_CTX,
    ROUTE_RUNNERS,
    Ctx,
    LinenNet,
    R,
    Style,
    initial_params,
    linen_variables,
    make_style,
    nnx_model,
    pure_params,
    summed,
    vary_module,
)
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

# --- capabilities: the step, its optimizer and its whole-batch reference -------------------

K, WINDOWS, ROWS = M.K, M.STEPS, M.ROWS
LR = 0.5
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


_REFERENCES: dict[Any, Any] = {}


def _once(key: Any, compute: Callable[[], Any]) -> Any:
    """`compute()`, once per process for each `key`: a capability's reference depends only on
    its fixed start and batches (and the route's context), not on the cell's style or route,
    so each worker computes it once for all the cells of that capability."""
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return _REFERENCES[key]


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
        state = style.init(self.tx(ROUTE_CTX[route]), params)
        batches = self.batches()
        step = functools.partial(self.step, style)
        got = ROUTE_RUNNERS[route](step, state, batches, style.params)
        return got, _once((type(self),), lambda: self.reference(params, batches)), params


class Accumulate(Capability):
    def grads(self, style, diff, batch, ctx):
        if ctx.unreduced:
            grad_fn = ga.unreduced_value_and_grad(self.loss(style), AXIS, reduce_value=False)
            return grad_fn(diff, batch)[1]
        return style.grad(self.loss(style), diff, batch)


class Microbatch(Capability):
    window = False

    def grads(self, style, diff, batch, ctx):
        if ctx.unreduced:
            grad_fn = ga.unreduced_value_and_grad(self.loss(style), AXIS, num_microbatches=K)
            return summed(grad_fn(diff, batch)[1])
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

        if ctx.unreduced:
            grad_fn = ga.unreduced_value_and_grad(
                loss, AXIS, num_microbatches=K, statistics_fn=counts
            )
            return summed(grad_fn(diff, batch)[1])
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


def per_device_sums(style: Style, fn: Callable[..., Any], diff: Any, batch: Any) -> Any:
    """`fn(diff, batch)[1]` on each device's slice, left unreduced out of a `jax.shard_map`
    (the guides' unreduced route for the contrastive and private gradients)."""
    arrays, rebuild = style.crossing(diff)

    def local(arrays, batch):
        return fn(style.local(rebuild(arrays), ROUTE_CTX["shard_map"]), batch)[1]

    out = P(unreduced={AXIS})
    return jax.shard_map(local, in_specs=(P(), P(AXIS)), out_specs=out)(arrays, batch)


class Coupled(Capability):
    """A contrastive loss over the whole batch (every row against every other)."""

    window = False

    def grads(self, style, diff, batch, ctx):
        def embed(diff, batch):
            return {"out": style.forward(diff, batch["x"]), "y": batch["y"]}

        def loss(diff, reps):
            return _contrastive(reps)

        if ctx.unreduced:
            fn = ga.coupled_value_and_grad(loss, embed, K, axis_name=AXIS, grad_reduction="sum")
            return summed(per_device_sums(style, fn, diff, batch))
        fn = ga.coupled_value_and_grad(loss, embed, K, axis_name=ctx.axis)
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
        fn = ga.privacy.clipped_grad(self.loss(style), CLIP)
        if ctx.unreduced:  # each device's clipped sums, left unreduced: the global-view window
            return per_device_sums(style, fn, diff, batch)
        return fn(diff, batch)[1]

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


def grads_and_aux(loss: Callable[..., Any], ctx: Ctx, batch_argnum: int) -> Callable[..., Any]:
    """`(grads, aux)` of `loss(diff, ..., batch) -> (value, aux)`, as the route takes them:
    `jax.grad`, or each device's gradient left unreduced (`unreduced_value_and_grad`)."""
    if not ctx.unreduced:
        return jax.grad(loss, has_aux=True)
    fn = ga.unreduced_value_and_grad(
        loss, AXIS, has_aux=True, batch_argnums=batch_argnum, reduce_value=False
    )

    def run(*args):
        (_, aux), grads = fn(*args)
        return grads, aux

    return run


def _bn_linen_grads(model, params, stats, batch, ctx):
    def loss(params, stats, batch):
        out, new = model.apply(
            {"params": params, "batch_stats": stats}, batch["x"], mutable=["batch_stats"]
        )
        return mse(out, batch["y"]), new["batch_stats"]

    return grads_and_aux(loss, ctx, 2)(ctx.vary(params), stats, batch)


def _bn_forward(params, x):
    """The reference layer: a batch normalised with its own statistics."""
    h = x @ params["l1"]["kernel"] + params["l1"]["bias"]
    h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5) * params["bn"]["scale"] + params["bn"]["bias"]
    return jnp.tanh(h) @ params["l2"]["kernel"] + params["l2"]["bias"]


class PerStyle(Capability):
    """A capability whose step handles the model's own state (statistics, fp8 metadata),
    written once per style: `init_<style>(tx, start, ctx)`, `step_<style>(tx, state,
    batch, ctx)` and `read_<style>(state)`, with `start()` the variables it starts from
    and `expected(start, batches, ctx)` the reference's, both in the layout `read` gives."""

    def start(self) -> Any:
        raise NotImplementedError

    def expected(self, start: Any, batches: list[Any], ctx: Ctx) -> Any:
        raise NotImplementedError

    def run(self, style_name, route):
        ctx, start = ROUTE_CTX[route], self.start()
        tx = self.tx(ctx)
        state = getattr(self, f"init_{style_name}")(tx, start, ctx)
        step = functools.partial(getattr(self, f"step_{style_name}"), tx)
        batches = self.batches()
        got = ROUTE_RUNNERS[route](step, state, batches, getattr(self, f"read_{style_name}"))
        want = _once((type(self), ctx), lambda: self.expected(start, batches, ctx))
        return got, want, start


class BatchNorm(PerStyle):
    """`AccumBatchNorm` / `NNXAccumBatchNorm` in an `accumulate` window, committed at the close.

    Exact here: the running statistics after each window (those of the whole window's
    batch, one EMA step), and the params (the mean of the calls' gradients, each call's
    batch normalised with its own statistics, as the layer documents: the global batch
    of the call, or each device's slice where the windows are kept per device).
    """

    def batches(self):
        return make_batches(WINDOWS * K, R * M.BATCHNORM_ROWS)

    def start(self):
        stats = {"mean": np.zeros(HIDDEN, np.float32), "var": np.ones(HIDDEN, np.float32)}
        return {"params": initial_params(norm=True), "stats": stats}

    # linen params
    def init_linen(self, tx, start, ctx):
        self.model = LinenNet(norm=True, axis_name=ctx.axis)
        variables = linen_variables(self.model, start["params"])
        return variables["params"], variables["batch_stats"], tx.init(variables["params"])

    def step_linen(self, tx, state, batch, ctx):
        params, stats, opt_state = state
        grads, stats = _bn_linen_grads(self.model, params, stats, batch, ctx)
        closes = ga.closes_window(opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        stats = ga.flax.commit_batch_stats(stats, closes)
        return optax.apply_updates(params, updates), stats, opt_state

    def read_linen(self, state):
        return {"params": state[0], "stats": _linen_stats(state[1])}

    # ga.flax.TrainState with a batch_stats field
    def init_train_state(self, tx, start, ctx):
        self.model = LinenNet(norm=True, axis_name=ctx.axis)
        variables = linen_variables(self.model, start["params"])
        return BnTrainState.create(
            apply_fn=self.model.apply,
            params=variables["params"],
            batch_stats=variables["batch_stats"],
            tx=tx,
        )

    def step_train_state(self, tx, state, batch, ctx):
        grads, stats = _bn_linen_grads(self.model, state.params, state.batch_stats, batch, ctx)
        closes = ga.closes_window(state.opt_state)
        stats = ga.flax.commit_batch_stats(stats, closes)
        return state.apply_gradients(grads=grads, batch_stats=stats)

    def read_train_state(self, state):
        return {"params": state.params, "stats": _linen_stats(state.batch_stats)}

    # NNX modules, with flax's nnx.Optimizer or ga.flax.Optimizer
    def _init_module(self, optimizer_cls, tx, start, ctx):
        model = nnx_model(start["params"], norm=True, axis_name=ctx.axis)
        return model, optimizer_cls(model, tx, wrt=nnx.Param)

    def _step_module(self, tx, state, batch, ctx):
        model, optimizer = state
        local = vary_module(model, ctx)

        def loss(model, batch):
            return mse(model(batch["x"]), batch["y"])

        if ctx.unreduced:
            grads = ga.unreduced_value_and_grad(loss, AXIS)(local, batch)[1]
        else:
            grads = nnx.grad(loss)(local, batch)
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

    # split NNX state: params, statistics, the rest (RNG streams), the optax state
    def init_nnx_split(self, tx, start, ctx):
        model = nnx_model(start["params"], norm=True, axis_name=ctx.axis)
        self.graphdef, state, stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
        return state, stats, rest, tx.init(state)

    def step_nnx_split(self, tx, state, batch, ctx):
        params, stats, rest, opt_state = state

        def loss(params, stats, rest, batch):
            # copy=True: the variables the layer writes belong to this trace.
            model = nnx.merge(self.graphdef, params, stats, rest, copy=True)
            return mse(model(batch["x"]), batch["y"]), nnx.state(model, nnx.BatchStat)

        grads, stats = grads_and_aux(loss, ctx, 3)(ctx.vary(params), stats, rest, batch)
        closes = ga.closes_window(opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        model = nnx.merge(self.graphdef, params, stats, rest)
        ga.flax.commit_nnx_batch_stats(model, closes)
        stats = nnx.state(model, nnx.BatchStat)
        return optax.apply_updates(params, updates), stats, rest, opt_state

    def read_nnx_split(self, state):
        model = nnx.merge(self.graphdef, state[0], state[1], state[2])
        return {"params": pure_params(model), "stats": _nnx_stats(model)}

    def expected(self, start, batches, ctx):
        """One device; each call's batch normalised by itself, or each device's slice by
        itself where the windows are kept per device."""
        slices = R if ctx.unreduced else 1
        params = jax.tree.map(jnp.asarray, start["params"])
        mean, var = jnp.zeros(HIDDEN), jnp.ones(HIDDEN)

        def loss(params, x, y):
            x, y = x.reshape(slices, -1, D_IN), y.reshape(slices, -1, D_OUT)
            return jnp.mean(jax.vmap(lambda x, y: mse(_bn_forward(params, x), y))(x, y))

        for w in range(WINDOWS):
            window = batches[w * K : (w + 1) * K]
            calls = [jax.grad(loss)(params, b["x"], b["y"]) for b in window]
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


def _is_fp8(path: Any, value: Any) -> bool:
    return type(value).__name__ == META


class Fp8(PerStyle):
    """Flax fp8 layers (delayed scaling) in an `accumulate` window.

    Each call differentiates its share of the window's loss (1/K, and 1/devices on a
    mapped route) and the window sums (`use_grad_mean=False`), so that every cotangent,
    the output-gradient amax included, is the large batch's (docs/mixed_precision.md).
    """

    def tx(self, ctx):
        return ga.accumulate(optax.sgd(LR), K, use_grad_mean=False, axis_name=ctx.axis)

    model = Mlp()

    def start(self):
        return dict(warm_variables(self.model))

    def batches(self):
        # Rows of very different scales, so that every call has its own amax.
        batches = make_batches(WINDOWS * K, R * ROWS, seed=2)
        scales = np.linspace(0.5, 8.0, WINDOWS * K * R * ROWS, dtype=np.float32)
        scales = np.random.default_rng(3).permutation(scales).reshape(WINDOWS * K, R * ROWS, 1)
        return [{**b, "x": b["x"] * s} for b, s in zip(batches, scales, strict=True)]

    def shares(self, loss, diff, batch, ctx, grad=jax.grad):
        """The gradient of this call's share of the window's loss, as the route takes it."""
        if ctx.unreduced:  # unreduced_value_and_grad divides by the devices itself
            return ga.unreduced_value_and_grad(lambda d, b: loss(d, b) / K, AXIS)(diff, batch)[1]
        return grad(lambda d: loss(d, batch) / (K * ctx.devices))(diff)

    def linen_loss(self, variables, batch):
        return mse(self.model.apply(variables, batch["x"]), batch["y"])

    # linen variables with the optax step written out: the metadata reach `tx`
    def init_linen(self, tx, variables, ctx):
        return variables, tx.init(variables)

    def step_linen(self, tx, state, batch, ctx):
        variables, opt_state = state
        grads = self.shares(self.linen_loss, ctx.vary(variables), batch, ctx)
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state

    def read_linen(self, state):
        return {"params": state[0]["params"], META: state[0][META]}

    def init_train_state(self, tx, variables, ctx):
        return ga.flax.TrainState.create(apply_fn=self.model.apply, params=variables, tx=tx)

    def step_train_state(self, tx, state, batch, ctx):
        grads = self.shares(self.linen_loss, ctx.vary(state.params), batch, ctx)
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

    def init_nnx_module(self, tx, variables, ctx):
        # Flax's own optimizer, told to step the metadata with the params.
        model = self._module(variables)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Any(nnx.Param, _is_fp8))

    def init_nnx_optimizer(self, tx, variables, ctx):
        model = self._module(variables)
        return model, ga.flax.Optimizer(model, tx, wrt=nnx.Param)

    def _step_module(self, tx, state, batch, ctx):
        model, optimizer = state
        local = vary_module(model, ctx, nnx.Any(nnx.Param, _is_fp8))
        grad = functools.partial(nnx.grad, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, _is_fp8)))
        grads = self.shares(lambda m, b: mse(m(b["x"]), b["y"]), local, batch, ctx, grad)
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
    def init_nnx_split(self, tx, variables, ctx):
        self.graphdef, state, self.rest = nnx.split(
            self._module(variables), nnx.Any(nnx.Param, _is_fp8), ...
        )
        return state, tx.init(state)

    def step_nnx_split(self, tx, state, batch, ctx):
        def loss(state, batch):
            model = nnx.merge(self.graphdef, state, self.rest, copy=True)
            return mse(model(batch["x"]), batch["y"])

        params, opt_state = state
        grads = self.shares(loss, ctx.vary(params), batch, ctx)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def read_nnx_split(self, state):
        return self._read_module((nnx.merge(self.graphdef, state[0], self.rest),))

    def expected(self, variables, batches, ctx):
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
    batch = Fp8().batches()[0]
    mesh = jax.make_mesh((R,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        variables = jax.device_put(variables, NamedSharding(mesh, P()))
        batch = jax.device_put(batch, NamedSharding(mesh, P(AXIS)))
        try:
            jax.jit(jax.grad(lambda v: mse(model.apply(v, batch["x"]), batch["y"])))(variables)
        except Exception as err:  # JAX's ShardingTypeError has no public name
            return type(err).__name__ == "ShardingTypeError" and "out_sharding" in str(err)
    return False


def equinox_has_no_fp8_layer() -> bool:
    """Whether `equinox.nn` still has no fp8 layer (why the Equinox fp8 cells are not
    applicable)."""
    return not any("fp8" in name.lower() or "float8" in name.lower() for name in dir(eqx.nn))


def equinox_batchnorm_writes_at_every_call() -> bool:
    """Whether `eqx.nn.BatchNorm` writes its running statistics at each training call (why the
    Equinox batch-norm cells are not applicable: in a window, each micro-batch's would be)."""
    make = eqx.nn.make_with_state(eqx.nn.BatchNorm)
    layer, state = make(HIDDEN, axis_name="batch", momentum=MOMENTUM, mode="ema")
    x = make_batches(1, 16)[0]["x"] @ initial_params()["l1"]["kernel"]

    @eqx.filter_jit
    def call(layer, state, x):
        vmapped = jax.vmap(layer, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        return vmapped(x, state)[1]

    before, after = (
        jax.tree.leaves(s.get(layer.ema_state_index)) for s in (state, call(layer, state, x))
    )
    return not any(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


# --- pipeline stages: their own mesh and model (tests/_matrix_pipeline.py) ------------------

import _matrix_pipeline  # noqa: E402  (it imports nothing from this module)

CAPABILITY_PROGRAMS["pipeline"] = _matrix_pipeline.Pipeline()
