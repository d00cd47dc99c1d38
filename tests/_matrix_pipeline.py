"""The route matrix's pipeline row: `pipeline_value_and_grad` on every route and style.

A pipeline needs a mesh with a stage axis, so its cells run on their own mesh of the 8
host devices, (stage = 4, data = 2), with a model of their own: an embedding, one
residual tanh layer per stage (the layers stacked as `nn.scan` and `nnx.vmap` stack
them) and a head. Each style keeps the params the way its users would: the linen and
`TrainState` styles hold the stacked layout (`ga.stack_stages` of the linen params) as
the optimizer's tree; the split-NNX style holds the `nnx.State` of a model whose layers
were made by `nnx.vmap`. Every cell ends with the variables in the layer layout
(`ga.unstack_stages`), compared with plain SGD of the unstaged model on each step's
whole batch (`jax.grad`, one device).
"""

from __future__ import annotations

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
from _matrix_routes import D_IN, D_OUT, HIDDEN, R
from flax import nnx
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

STAGES, DATA = 4, R // 4
N = 4  # micro-batches per step, in one 1F1B schedule
LR = 0.5
STAGE_AXIS, DATA_AXIS = "stage", "data"


# --- the model, in linen and in NNX (the same variable paths) ------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        return x + jnp.tanh(nn.Dense(HIDDEN, name="lin")(x)), None


class LinenPipeNet(nn.Module):
    """Embedding, `STAGES` blocks under `nn.scan` (params stacked on a layer axis), head."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(HIDDEN, name="embed")(x)
        layers = nn.scan(
            Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=STAGES
        )
        h = layers(name="layers")(h)[0]
        return nn.Dense(D_OUT, name="head")(h)


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.lin(x))


class NnxPipeNet(nnx.Module):
    """The same network in NNX, its layers made by `nnx.vmap` (state stacked on a layer axis)."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.embed = nnx.Linear(D_IN, HIDDEN, rngs=rngs)

        @nnx.split_rngs(splits=STAGES)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> NnxBlock:
            return NnxBlock(rngs)

        self.layers = make(nnx.Rngs(1))
        self.head = nnx.Linear(HIDDEN, D_OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.embed(x)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, layer):
            return layer(h)

        return self.head(body(h, self.layers))


class EqxBlock(eqx.Module):
    """The block as an `eqx.Module`: one example per call, its weight `(out, in)`, and its
    activation a leaf that is not an array."""

    lin: eqx.nn.Linear
    activation: Callable[[jax.Array], jax.Array]

    def __init__(self, key: jax.Array) -> None:
        self.lin = eqx.nn.Linear(HIDDEN, HIDDEN, key=key)
        self.activation = jnp.tanh

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.activation(self.lin(x))


def initial_params() -> dict[str, Any]:
    rng = np.random.default_rng(0)

    def dense(d_in: int, d_out: int, *lead: int) -> dict[str, np.ndarray]:
        return {
            "kernel": (rng.normal(size=(*lead, d_in, d_out)) / np.sqrt(d_in)).astype(np.float32),
            "bias": (rng.normal(size=(*lead, d_out)) / 4).astype(np.float32),
        }

    return {
        "embed": dense(D_IN, HIDDEN),
        "layers": {"lin": dense(HIDDEN, HIDDEN, STAGES)},
        "head": dense(HIDDEN, D_OUT),
    }


def _linen_block(p: Any, x: jax.Array) -> jax.Array:
    return Block().apply({"params": p}, x)[0]


_NNX_BLOCK = nnx.split(NnxBlock(nnx.Rngs(0)), nnx.Param)[0]


def _nnx_block(p: Any, x: jax.Array) -> jax.Array:
    return nnx.merge(_NNX_BLOCK, p)(x)


# The stacked blocks as `eqx.filter_vmap` makes them, abstractly (no program): the shapes of
# their arrays, which cross the pipeline, and the rest (the activation), merged in each layer.
_EQX_ARRAYS, _EQX_REST = eqx.partition(
    eqx.filter_eval_shape(
        lambda: eqx.filter_vmap(EqxBlock)(jax.random.split(jax.random.key(0), STAGES))
    ),
    lambda x: isinstance(x, jax.ShapeDtypeStruct),
)


def _eqx_block(p: Any, x: jax.Array) -> jax.Array:
    return jax.vmap(eqx.combine(p, _EQX_REST))(x)


def _stage(block: Any):
    def stage_fn(stage_params: Any, x: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda h, p: (block(p, h), None), x, stage_params)[0]

    return stage_fn


def _embed(outer: Any, batch: Any) -> jax.Array:
    return batch["x"] @ outer["embed"]["kernel"] + outer["embed"]["bias"]


def _loss(outer: Any, h: jax.Array, batch: Any) -> jax.Array:
    return E.mse(h @ outer["head"]["kernel"] + outer["head"]["bias"], batch["y"])


def _to_pipeline(tree: Any) -> dict[str, Any]:
    """The layer layout (`layers` leaves `(STAGES, ...)`) as the pipeline takes it."""
    return {
        "stages": ga.stack_stages(tree["layers"], STAGES),
        "embed": tree["embed"],
        "head": tree["head"],
    }


def _from_pipeline(tree: Any) -> dict[str, Any]:
    return {
        "embed": tree["embed"],
        "layers": ga.unstack_stages(tree["stages"]),
        "head": tree["head"],
    }


def _grad_fn(block: Any, axis_name: Any, embed: Any = _embed, loss: Any = _loss) -> Any:
    return ga.pipeline_value_and_grad(
        _stage(block), loss, embed_fn=embed, num_microbatches=N, axis_name=axis_name
    )


# --- styles: how the stacked params are held and stepped -----------------------------------


class _Style:
    block = staticmethod(_linen_block)

    def init(self, tx: optax.GradientTransformation, start: Any) -> Any:
        raise NotImplementedError

    def step(self, state: Any, batch: Any, axis_name: Any) -> Any:
        raise NotImplementedError

    def read(self, state: Any) -> Any:
        raise NotImplementedError


class _Linen(_Style):
    """Linen params (`nn.scan`-stacked), stacked once for the pipeline; the optax step
    written out on the stacked tree."""

    def init(self, tx, start):
        self.tx = tx
        variables = LinenPipeNet().init(jax.random.key(0), jnp.zeros((1, D_IN)))
        params = jax.tree.map(jnp.asarray, start)
        assert jax.tree.structure(variables["params"]) == jax.tree.structure(params)
        stacked = _to_pipeline(params)
        return stacked, tx.init(stacked)

    def step(self, state, batch, axis_name):
        params, opt_state = state
        grads = _grad_fn(self.block, axis_name)(params, batch)[1]
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def read(self, state):
        return _from_pipeline(state[0])


class _TrainState(_Linen):
    """`ga.flax.TrainState` holding the stacked params."""

    def init(self, tx, start):
        stacked = _to_pipeline(jax.tree.map(jnp.asarray, start))
        return ga.flax.TrainState.create(apply_fn=LinenPipeNet().apply, params=stacked, tx=tx)

    def step(self, state, batch, axis_name):
        grads = _grad_fn(self.block, axis_name)(state.params, batch)[1]
        return state.apply_gradients(grads=grads)

    def read(self, state):
        return _from_pipeline(state.params)


class _NnxModule(_Style):
    """An NNX module passed as the params: refused, naming `nnx.split`."""

    def __init__(self, optimizer_cls: type) -> None:
        self.optimizer_cls = optimizer_cls

    def init(self, tx, start):
        model = NnxPipeNet()
        return model, self.optimizer_cls(model, tx, wrt=nnx.Param)

    def step(self, state, batch, axis_name):
        model, optimizer = state
        grads = _grad_fn(_nnx_block, axis_name)(model, batch)[1]
        optimizer.update(model, grads)
        return model, optimizer

    def read(self, state):
        return nnx.to_pure_dict(nnx.state(state[0], nnx.Param))


class _NnxSplit(_Style):
    """`nnx.split(model, nnx.Param, ...)` of a model whose layers `nnx.vmap` made: the
    params' `nnx.State`, its layer subtree stacked by stage, each layer merged in the stage."""

    block = staticmethod(_nnx_block)

    def init(self, tx, start):
        self.tx = tx
        model = NnxPipeNet()
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, start))
        stacked = _to_pipeline(state)
        return stacked, tx.init(stacked)

    step = _Linen.step

    def read(self, state):
        return nnx.to_pure_dict(nnx.State(_from_pipeline(state[0])))


def _eqx_linear(p: dict[str, Any]) -> eqx.nn.Linear:
    """An `eqx.nn.Linear` holding the linen layer's params (its kernel transposed)."""
    shapes = eqx.filter_eval_shape(lambda: eqx.nn.Linear(*p["kernel"].shape, key=jax.random.key(0)))
    return eqx.tree_at(lambda m: (m.weight, m.bias), shapes, (p["kernel"].T, p["bias"]))


def _linear_params(linear: Any) -> dict[str, Any]:
    return {"kernel": jnp.swapaxes(linear.weight, -1, -2), "bias": linear.bias}


def _eqx_embed(outer: Any, batch: Any) -> jax.Array:
    return jax.vmap(outer["embed"])(batch["x"])


def _eqx_loss(outer: Any, h: jax.Array, batch: Any) -> jax.Array:
    return E.mse(jax.vmap(outer["head"])(h), batch["y"])


class _Equinox(_Style):
    """Equinox layers in the pipeline's mapping: the embedding and head `eqx.nn.Linear`s, and
    the arrays of the `eqx.filter_vmap`-made blocks stacked by stage, each layer combined with
    the blocks' rest inside the stage; stepped by `ga.apply_gradients`."""

    block = staticmethod(_eqx_block)

    def init(self, tx, start):
        self.tx = tx
        start = jax.tree.map(jnp.asarray, start)
        lin = start["layers"]["lin"]
        blocks = eqx.tree_at(
            lambda b: (b.lin.weight, b.lin.bias),
            _EQX_ARRAYS,
            (jnp.swapaxes(lin["kernel"], -1, -2), lin["bias"]),
        )
        params = {
            "stages": ga.stack_stages(blocks, STAGES),
            "embed": _eqx_linear(start["embed"]),
            "head": _eqx_linear(start["head"]),
        }
        return params, tx.init(params)

    def step(self, state, batch, axis_name):
        params, opt_state = state
        grads = _grad_fn(self.block, axis_name, embed=_eqx_embed, loss=_eqx_loss)(params, batch)[1]
        return ga.apply_gradients(self.tx, grads, opt_state, params)

    def read(self, state):
        params = state[0]
        return {
            "embed": _linear_params(params["embed"]),
            "layers": {"lin": _linear_params(ga.unstack_stages(params["stages"]).lin)},
            "head": _linear_params(params["head"]),
        }


def make_style(name: str) -> _Style:
    return {
        "linen": _Linen,
        "train_state": _TrainState,
        "nnx_module": functools.partial(_NnxModule, nnx.Optimizer),
        "nnx_optimizer": functools.partial(_NnxModule, ga.flax.Optimizer),
        "nnx_split": _NnxSplit,
        "equinox": _Equinox,
    }[name]()


# --- routes ---------------------------------------------------------------------------------


def _mesh(kind: Any = jax.sharding.AxisType.Explicit) -> jax.sharding.Mesh:
    return jax.make_mesh((STAGES, DATA), (STAGE_AXIS, DATA_AXIS), axis_types=(kind, kind))


def _specs(state: Any) -> Any:
    """The stage params (anything under a `stages` key) split over the stage axis."""

    def one(path: Any, _: Any) -> P:
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        return P(STAGE_AXIS) if "stages" in keys else P()

    return jax.tree_util.tree_map_with_path(one, state)


def run_one_device(style, state, batches):
    return E.run_one_device(functools.partial(style.step, axis_name=None), state, batches)


def run_shard_map(style, state, batches):
    step = functools.partial(style.step, axis_name=DATA_AXIS)
    specs = _specs(state)
    return E.run_shard_map(step, state, batches, mesh=_mesh(), specs=specs, batch_spec=P(DATA_AXIS))


def run_global_view(kind, *, set_mesh=True):
    def run(style, state, batches):
        step = functools.partial(style.step, axis_name=None)
        return E.run_global_view(
            step,
            state,
            batches,
            mesh=_mesh(kind),
            specs=_specs(state),
            batch_spec=P(DATA_AXIS),
            set_mesh=set_mesh,
        )

    return run


RUNNERS = {
    "one_device": run_one_device,
    "shard_map": run_shard_map,
    "jit_auto": run_global_view(jax.sharding.AxisType.Auto),
    "jit_explicit": run_global_view(jax.sharding.AxisType.Explicit),
    "jit_explicit_no_mesh": run_global_view(jax.sharding.AxisType.Explicit, set_mesh=False),
}


# --- the capability ---------------------------------------------------------------------------


class Pipeline:
    """`pipeline_value_and_grad` (1F1B, N micro-batches in one schedule) then SGD, for
    `M.STEPS` steps; reference: SGD with `jax.grad` of the unstaged linen model on each
    step's whole batch."""

    def batches(self) -> list[dict[str, np.ndarray]]:
        rng = np.random.default_rng(1)
        rows = DATA * N * M.ROWS
        return [
            {
                "x": rng.normal(size=(rows, D_IN)).astype(np.float32),
                "y": rng.normal(size=(rows, D_OUT)).astype(np.float32),
            }
            for _ in range(M.STEPS)
        ]

    def reference(self, start: Any, batches: list[Any]) -> Any:
        model = LinenPipeNet()
        loss = lambda p, b: E.mse(model.apply({"params": p}, b["x"]), b["y"])  # noqa: E731
        params = jax.tree.map(jnp.asarray, start)
        for batch in batches:
            grads = jax.grad(loss)(params, batch)
            params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        return params

    def run(self, style_name: str, route: str) -> tuple[Any, Any, Any]:
        style = make_style(style_name)
        start = initial_params()
        state = style.init(optax.sgd(LR), start)
        batches = self.batches()
        got = style.read(RUNNERS[route](style, state, batches))
        return got, self.reference(start, batches), start
