"""Flax's training containers with their step through `gradaccum_jax.apply_gradients`.

`flax.training.train_state.TrainState.apply_gradients` and
`flax.nnx.Optimizer.update` call `tx.update` and then `optax.apply_updates`:
under `accumulate` every micro-step then writes a parameter-sized tree of zero
updates and rewrites the params. These subclasses change only that step, so
that the params are updated inside the window's close (see `apply_gradients`).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import jax
from flax import nnx, serialization, struct
from flax.nnx.training.optimizer import to_opt_state
from flax.training import train_state

from gradaccum_jax._base import clip_marks, compat
from gradaccum_jax._window import accumulate as _accumulation
from gradaccum_jax._window.fused import apply_gradients
from gradaccum_jax.flax._fp8 import (
    WINDOW_MAX,
    apply_and_survey,
    fp8_metadata,
    hold_for_window,
    window_start,
)


class TrainState(train_state.TrainState):
    """`flax.training.train_state.TrainState`, stepping with `gradaccum_jax.apply_gradients`.

    A drop-in replacement: `create`, the fields and `apply_gradients(grads=...)`
    are Flax's. Only the step differs: with `tx = gradaccum_jax.accumulate(...)`
    (alone, last in an `optax.chain`, or under `optax.inject_hyperparams`) the
    params are updated inside the window's close, and a micro-step moves only
    the gradient and the accumulator. The params come out as with Flax's class.
    `step` still counts calls (micro-steps); read the `optimizer_step` property
    for optimizer steps. Keywords of `apply_gradients` that name no field of
    the state (`weight=`, `value=`) go to `tx.update`.

    Flax's fp8 metadata (the `_overwrite_with_gradient` collection of
    `flax.linen.fp8_ops` layers: scales and amax histories) are not handed to
    `tx`. Flax overwrites them on every call; under `accumulate` they are
    held as they were when the window opened, the calls' new values are
    combined by their elementwise max in the field `fp8_window_max` (set by
    `create`, shaped like the metadata; `None` without fp8 layers, and then
    left out of `flax.serialization`'s state dict, which stays Flax's), and
    the max is written when the window closes: the history rolls once per
    optimizer step, and every micro-step of a window is quantized with the
    same scales. With `accumulate(..., axis_name=...)` each replica keeps its
    own running max and the close takes the max over the replicas too; hold
    the state across `jax.shard_map` calls with
    `gradaccum_jax.replica_state_specs(state, axis_name)`.

    The same in one line on Flax's own class, for a subclass of your own:
    `params, opt_state = gradaccum_jax.apply_gradients(state.tx, grads,
    state.opt_state, state.params)`, then `state.replace(step=state.step + 1,
    params=params, opt_state=opt_state)`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import gradaccum_jax as ga
      >>> from gradaccum_jax.flax import TrainState
      >>> state = TrainState.create(
      ...     apply_fn=None, params={"w": jnp.ones(2)}, tx=ga.accumulate(optax.sgd(0.5), 2)
      ... )
      >>> state = state.apply_gradients(grads={"w": jnp.ones(2)})
      >>> state = state.apply_gradients(grads={"w": jnp.full(2, 3.0)})
      >>> state.params["w"]  # 1 - 0.5 * mean([1, 3])
      Array([0., 0.], dtype=float32)
    """

    fp8_window_max: Any = struct.field(default=None, kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _serialize_without_empty_window(cls)

    @classmethod
    def create(cls, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any) -> TrainState:
        """Flax's `create`; with fp8 metadata in `params`, their window's running max as well."""
        overwrite = train_state.OVERWRITE_WITH_GRADIENT
        if isinstance(params, dict) and overwrite in params and WINDOW_MAX not in kwargs:
            kwargs[WINDOW_MAX] = window_start(params[overwrite])
        state: TrainState = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        return state

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Updates `step`, `params` and `opt_state`, as Flax's; other keywords: fields or `tx`'s.

        A keyword that names a field of the state (`step`, `params`, `opt_state`,
        `apply_fn`, `tx`, or a field of your subclass, such as `batch_stats`) is
        replaced, as in Flax. Any other keyword is an extra argument of
        `tx.update`: `weight=` for a weighted window, `value=` for
        `optax.contrib.reduce_on_plateau`. A keyword one letter or so from a
        field's name (`param=`, `batch_stat=`) is refused rather than passed on,
        since optax drops extra arguments that no transformation takes.

        Args:
          grads: Gradients with the structure of `params` (a top-level
            `overwrite_with_gradient` collection replaces its params, as in Flax).
          **kwargs: Fields to replace, and extra arguments for `tx.update`.

        Returns:
          The new state, `step` incremented by one.

        Raises:
          TypeError: If a keyword is not a field but close to a field's name.

        Examples:
          >>> import jax.numpy as jnp, optax
          >>> import gradaccum_jax as ga
          >>> from gradaccum_jax.flax import TrainState
          >>> state = TrainState.create(
          ...     apply_fn=None, params={"w": jnp.ones(1)}, tx=ga.accumulate(optax.sgd(1.0), 2)
          ... )
          >>> state = state.apply_gradients(grads={"w": jnp.ones(1)}, weight=3.0)
          >>> state = state.apply_gradients(grads={"w": jnp.full(1, 5.0)}, weight=1.0)
          >>> state.params["w"], state.optimizer_step  # 1 - (3 * 1 + 1 * 5) / 4
          (Array([-1.], dtype=float32), Array(1, dtype=int32))
        """
        fields = [field.name for field in dataclasses.fields(self)]
        to_replace = {name: value for name, value in kwargs.items() if name in fields}
        extra_args = {name: value for name, value in kwargs.items() if name not in fields}
        for name in extra_args:
            close = difflib.get_close_matches(name, fields, n=1, cutoff=0.8)
            if close:
                raise TypeError(
                    f"apply_gradients got {name}=, which is not a field of "
                    f"{type(self).__name__} ({', '.join(fields)}) but is close to "
                    f"{close[0]!r}. Keywords that name a field are replaced; any other goes "
                    f"to tx.update as an extra argument, where a misspelt field would be "
                    f"dropped without a word. Did you mean {close[0]}=?"
                )
        overwrite = train_state.OVERWRITE_WITH_GRADIENT
        if overwrite in grads:
            new_params, new_opt_state, axis_names = apply_and_survey(
                self.tx, grads["params"], self.opt_state, self.params["params"], **extra_args
            )
            meta, running = hold_for_window(
                self.params[overwrite],
                self.fp8_window_max,
                grads[overwrite],
                self.opt_state,
                new_opt_state,
                axis_names,
            )
            new_params = {"params": new_params, overwrite: meta}
            to_replace = {WINDOW_MAX: running, **to_replace}
        else:
            new_params, new_opt_state = apply_gradients(
                self.tx, grads, self.opt_state, self.params, **extra_args
            )
        return self.replace(
            step=self.step + 1, params=new_params, opt_state=new_opt_state, **to_replace
        )

    @property
    def optimizer_step(self) -> jax.Array:
        """Optimizer steps (windows that applied an update) so far; `step` counts calls.

        `gradaccum_jax.optimizer_step(self.opt_state)`: an `int32` scalar.
        """
        return _accumulation.optimizer_step(self.opt_state)


def _serialize_without_empty_window(cls: type) -> None:
    """Registers `cls` with `flax.serialization`, `fp8_window_max` left out where `None`.

    Without fp8 layers the state dict is then Flax's `TrainState`'s: a
    checkpoint of either class restores into the other. A state dict without
    the field (from Flax's class, with fp8 layers) starts the running max
    afresh, as at a window's opening.
    """
    fields = [f.name for f in dataclasses.fields(cls) if f.metadata.get("pytree_node", True)]

    def to_state_dict(state: Any) -> dict[str, Any]:
        return {
            name: serialization.to_state_dict(getattr(state, name))
            for name in fields
            if name != WINDOW_MAX or state.fp8_window_max is not None
        }

    def from_state_dict(state: Any, saved: dict[str, Any]) -> Any:
        if WINDOW_MAX not in saved:
            fresh = None if state.fp8_window_max is None else window_start(state.fp8_window_max)
            saved = {**saved, WINDOW_MAX: serialization.to_state_dict(fresh)}
        if set(saved) != set(fields):
            raise ValueError(
                f"The state dict's fields {sorted(saved)} are not those of "
                f"{cls.__name__} ({sorted(fields)}), at path {serialization.current_path()}."
            )
        return state.replace(
            **{
                name: serialization.from_state_dict(getattr(state, name), saved[name], name=name)
                for name in fields
            }
        )

    serialization.register_serialization_state(cls, to_state_dict, from_state_dict, override=True)


_serialize_without_empty_window(TrainState)


class Optimizer(nnx.Optimizer):
    """`flax.nnx.Optimizer`, stepping with `gradaccum_jax.apply_gradients`.

    Built and used as Flax's (`Optimizer(model, tx, wrt=nnx.Param)`,
    `optimizer.update(model, grads, **extra_args)`); with `tx =
    gradaccum_jax.accumulate(...)` the model's params are updated inside the
    window's close, and a micro-step moves only the gradient and the
    accumulator. `update` returns `None`: the updates that Flax's returns are
    what the fused step avoids writing. `step` counts calls (micro-steps),
    `optimizer_step` the windows that applied an update.

    Flax's fp8 metadata (the scales and amax histories of `flax.linen.fp8_ops`
    layers under `nnx.bridge`; see `fp8_metadata`) are handled as
    `TrainState` handles them: `wrt` leaves them out, the gradients hold
    their new values, and `update` writes those into the model, on every
    call without `accumulate`; under it they are held as they were when the
    window opened, the calls' new values are combined by their elementwise
    max in `fp8_window_max` (an attribute added when the model has fp8
    layers, in the optimizer's state), and the max is written when the
    window closes (over the replicas too with `axis_name`).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import gradaccum_jax as ga
      >>> from gradaccum_jax.flax import Optimizer
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = Optimizer(model, ga.accumulate(optax.sgd(0.1), 2), wrt=nnx.Param)
      >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
      >>> optimizer.update(model, grads)
      >>> int(optimizer.step[...])
      1
    """

    def __init__(self, model: Any, tx: Any, *, wrt: Any, **kwargs: Any) -> None:
        """Flax's; with fp8 metadata in `model`, their window's running max as well.

        Args:
          model: The model.
          tx: The optax transformation.
          wrt: The filter of the variables `tx` updates (`nnx.Param`).
          **kwargs: Flax's other keywords (`graph=` in newer Flax).

        Raises:
          ValueError: If `wrt` selects fp8 metadata, which `tx` would step as
            params.
        """
        graph = {"graph": kwargs["graph"]} if "graph" in kwargs else {}
        stepped = nnx.state(model, nnx.All(wrt, fp8_metadata), **graph)
        if jax.tree.leaves(stepped):
            raise ValueError(
                f"Optimizer got {wrt=}, which selects Flax fp8 metadata "
                f"({_shown(_paths(stepped))}): "
                "scales and amax histories, whose 'gradient' is their new value; the "
                "optimizer would step them as params. Build it with wrt=nnx.Param and "
                "differentiate the metadata with the params (nnx.grad with "
                "argnums=nnx.DiffState(0, nnx.Any(nnx.Param, gradaccum_jax.flax.fp8_metadata))"
                "): update then writes their new values into the model, once per window "
                "under gradaccum_jax.accumulate."
            )
        super().__init__(model, tx, wrt=wrt, **kwargs)
        meta = compat.plain_values(nnx.state(model, fp8_metadata, **graph))
        if jax.tree.leaves(meta):
            self.fp8_window_max = nnx.data(to_opt_state(window_start(meta)))

    def _graph(self) -> dict[str, Any]:
        # Newer flax takes a graph option; flax 0.12.1 (the oldest supported) has none.
        return {"graph": self.graph} if hasattr(self, "graph") else {}

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> None:
        """Applies `grads` to `model`'s `wrt` state, as Flax's, without returning updates.

        Args:
          model: The model whose params to update.
          grads: The gradients from `nnx.grad`; for a model with fp8 layers, of
            the metadata too (their new values; see the class).
          **kwargs: Extra arguments for `tx.update` (`weight=`, `value=`, ...).

        Raises:
          ValueError: If the model has fp8 metadata and `grads` does not hold
            the same metadata variables.
        """
        pure, graph = compat.plain_values, self._graph()
        params = pure(nnx.state(model, self.wrt, **graph))
        opt_state = pure(self.opt_state)
        chosen = pure(nnx.state(grads, self.wrt, **graph))
        _check_clipped(self.wrt, grads, chosen, params)
        args = (self.tx, chosen, opt_state, params)
        if not hasattr(self, "fp8_window_max"):
            new_params, new_opt_state = apply_gradients(*args, **pure(kwargs))
        else:
            new_params, new_opt_state, axis_names = apply_and_survey(*args, **pure(kwargs))
            held = pure(nnx.state(model, fp8_metadata, **graph))
            new = pure(nnx.state(grads, fp8_metadata, **graph))
            _check_fp8_grads(held, new)
            meta, running = hold_for_window(
                held, pure(self.fp8_window_max), new, opt_state, new_opt_state, axis_names
            )
            nnx.update(model, meta)
            nnx.update(self.fp8_window_max, nnx.state(running, **graph))
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, **graph))
        self.step[...] += 1

    @property
    def optimizer_step(self) -> jax.Array:
        """Optimizer steps (windows that applied an update) so far; `step` counts calls.

        `gradaccum_jax.optimizer_step(self.opt_state)`: an `int32` scalar.
        """
        return _accumulation.optimizer_step(self.opt_state)


def _check_clipped(wrt: Any, grads: Any, chosen: Any, params: Any) -> None:
    """Raises where `clipped_grad`'s sums and `wrt` select different variables."""
    if not clip_marks.marks(grads):
        return
    fix = (
        f"Clip what the optimizer updates: clipped_grad(loss, C, wrt={wrt!r}), the "
        "optimizer's own filter."
    )
    clip_marks.check_whole(chosen, f"Optimizer(wrt={wrt!r})", fix)
    missing = sorted(set(_paths(params)) - set(_paths(chosen)))
    if missing:
        raise ValueError(
            f"Optimizer(wrt={wrt!r}) updates {_shown(missing)}, which the clipped "
            "gradients (clipped_grad) do not hold: they would be stepped without a "
            f"gradient. {fix}"
        )


def _check_fp8_grads(held: Any, new: Any) -> None:
    """Raises unless the gradients hold every fp8 metadata variable of the model."""
    have = set(_paths(new))
    missing = [path for path in _paths(held) if path not in have]
    if not missing:
        return
    raise ValueError(
        f"Optimizer.update got gradients without the model's fp8 metadata ({_shown(missing)}): "
        "their scales and amax histories would never move. Differentiate them with the "
        "params, nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, "
        "gradaccum_jax.flax.fp8_metadata))), or pass the module to "
        "gradaccum_jax.microbatch_value_and_grad, whose gradients hold them."
    )


def _paths(state: Any) -> list[str]:
    """The paths of a state's variables, as text."""
    flat = jax.tree_util.tree_flatten_with_path(compat.plain_values(state))[0]
    return [jax.tree_util.keystr(path) for path, _ in flat]


def _shown(paths: list[str]) -> str:
    """The first few of the variables' paths, for a message."""
    return ", ".join(sorted(paths)[:3]) + (", ..." if len(paths) > 3 else "")
