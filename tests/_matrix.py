"""The route matrix, declared once: capabilities x routes x model styles, and each cell's outcome.

tests/test_matrix.py runs every cell declared here (the builders are in
tests/_matrix_run.py) and tools/matrix_table.py writes docs/matrix.md from the same
declarations, so the page says what the tests check and cannot drift from them.

A cell is one of:

* `Exact`: the train step equals the whole-batch reference, within the capability's
  tolerances;
* `Refused`: the library raises `error`, from its own code, with a message that
  matches `match` (the fix it names);
* `NotApplicable`: the triple is not meaningful, for the reason given; where the
  reason is a fact about another library, `witness` names a check in
  tests/_matrix_run.py that the test runs, so the page stops being true loudly;
* `Pending`: what the cell will be (`then`) once a known gap is closed; until then the
  test is a strict xfail, so the cell's test fails when the fix lands and the
  declaration must be flipped.

This module imports nothing but the standard library, so that the docs tool can
read it without starting JAX.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# --- the three dimensions -----------------------------------------------------------------

ROUTES = {
    "one_device": (
        "one device",
        "`jax.jit` on one device, the whole global batch per call.",
    ),
    "shard_map": (
        "`shard_map`",
        '`jax.jit(jax.shard_map(...))` over 8 devices, the capability\'s `axis_name="data"`: '
        "params replicated and cast to varying before they are differentiated, the batch "
        "split, a window's state held with `ga.replica_state_specs` / "
        "`add_replica_axis` / `remove_replica_axis`.",
    ),
    "pmap": (
        "`pmap`",
        '`jax.pmap` over 8 devices with `axis_name="data"`: one copy of the state per '
        "device, the batch split; the test checks that every copy ends the same.",
    ),
    "jit_auto": (
        "global `jit`, Auto mesh",
        "Global-view `jax.jit` under `jax.set_mesh` of an 8-device mesh with "
        '`AxisType.Auto`: params replicated (`P()`), the batch sharded (`P("data")`), '
        "the one-device step unchanged.",
    ),
    "jit_explicit": (
        "global `jit`, Explicit mesh",
        "The same on a mesh with `AxisType.Explicit`, which `jax.make_mesh` gives by "
        "default from JAX 0.10: the road most new code takes.",
    ),
    "jit_explicit_no_mesh": (
        "global `jit`, Explicit, no `set_mesh`",
        "The same arrays on the same Explicit mesh, jitted with no mesh set in context "
        "(no `jax.set_mesh`): the mesh is known from the arrays' types alone.",
    ),
    "jit_unreduced": (
        "global `jit`, Explicit, unreduced",
        "Global-view `jax.jit` on the Explicit mesh with each device's gradient left "
        "unreduced, the library's road to one reduction per window there: "
        "`ga.unreduced_value_and_grad` (with `num_microbatches=K` or `statistics_fn=` "
        "inside a step, whose partial sums the step then adds with `jax.reshard(grads, "
        "P())`); for the contrastive and private capabilities each device's partial sums "
        'leave a `jax.shard_map` with `out_specs=P(unreduced={"data"})`. Batch-norm '
        "layers keep a window per device (no `axis_name`), summed by the commit.",
    ),
}

STYLES = {
    "linen": (
        "linen params",
        "A `flax.linen` model's params; the optax step written out (`tx.update`, "
        "`optax.apply_updates`).",
    ),
    "train_state": (
        "`ga.flax.TrainState`",
        "`gradaccum_jax.flax.TrainState.apply_gradients`. Linen only: it holds an "
        "`apply_fn` and a params tree.",
    ),
    "nnx_module": (
        "NNX module",
        "An `nnx.Module` (holding an RNG stream, as modules with dropout do) "
        "differentiated as a module (`nnx.grad`, or the module passed to the capability), "
        "stepped by Flax's own `nnx.Optimizer(model, tx, wrt=nnx.Param)`.",
    ),
    "nnx_optimizer": (
        "`ga.flax.Optimizer`",
        "The same module stepped by `gradaccum_jax.flax.Optimizer`. NNX only, as Flax's.",
    ),
    "nnx_split": (
        "split NNX state",
        "`nnx.split(model, nnx.Param, ...)`: the params' `nnx.State` differentiated by "
        "pure functions whose loss merges the model, the optax step written out.",
    ),
    "equinox": (
        "Equinox module",
        "An `eqx.Module` (two `eqx.nn.Linear`, weights `(out, in)`, and its activation "
        "function, a leaf that is not an array) differentiated whole (`eqx.filter_grad`, or "
        "the module passed to the capability), stepped by `ga.apply_gradients(tx, grads, "
        "opt_state, model)`; on `shard_map` its floating-point arrays are cast to varying "
        "first. In the pipeline row: `eqx.nn.Linear` embedding and head, and the arrays of "
        "`eqx.filter_vmap`-made blocks stacked by stage.",
    ),
}

CAPABILITIES = {
    "accumulate": (
        "`accumulate`",
        "`ga.accumulate(sgd, K)` over `K` calls, gradients from `jax.grad` / `nnx.grad` / "
        "`eqx.filter_grad`. "
        "Reference: SGD on each window's whole batch.",
    ),
    "microbatch": (
        "`microbatch_value_and_grad`",
        "`ga.microbatch_value_and_grad(loss, K)` inside each step, then SGD (on the mapped "
        "routes, the devices' gradients averaged with `jax.lax.pmean`). Reference: "
        "`jax.grad` on the step's whole batch.",
    ),
    "statistics": (
        "`statistics_fn`",
        "`microbatch_value_and_grad(loss, K, statistics_fn=...)` for a load-balancing loss "
        "that needs the whole batch's class counts (`axis_name=` on the mapped routes). "
        "Reference: `jax.grad` with the whole batch's counts.",
    ),
    "coupled": (
        "`coupled_value_and_grad`",
        "`ga.coupled_value_and_grad(loss, embed, K)` for a CLIP loss that couples every "
        "row of the batch (`axis_name=` on the mapped routes). Reference: `jax.grad` on "
        "the whole batch.",
    ),
    "privacy": (
        "`clipped_grad` + `dp_accumulate`",
        "`privacy.clipped_grad(loss, C)` into `privacy.dp_accumulate(sgd, K, "
        "noise_multiplier=0)` (`axis_name=` on the mapped routes). Reference: the whole "
        "window's per-example gradients, each clipped to `C`, summed, divided by `B`.",
    ),
    "fp8": (
        "fp8 metadata",
        "Flax's fp8 layers (`Fp8DirectDotGeneralOp`; under `nnx.bridge` for NNX) in an "
        "`accumulate(sgd, K, use_grad_mean=False)` window, each call differentiating its "
        "share of the window's loss. Reference: Flax's own step on each window's whole "
        "batch, params and metadata (scales, amax histories).",
    ),
    "batchnorm": (
        "`AccumBatchNorm`",
        "`AccumBatchNorm` / `NNXAccumBatchNorm` in an `accumulate(sgd, K)` window, "
        "committed when it closes (the layer's `axis_name=` on the mapped routes). "
        "Reference: the running mean and variance of the whole window's batch (one EMA "
        "step), and params moved by the mean of the calls' gradients, each call "
        "normalised with its own global batch's statistics, or with each device's "
        "slice's where the windows are kept per device (what the layer documents).",
    ),
    "pipeline": (
        "`pipeline_value_and_grad`",
        "`ga.pipeline_value_and_grad(stage_fn, loss_fn, embed_fn=..., num_microbatches=4)` "
        "(1F1B) on a mesh of its own, (stage = 4, data = 2), with a model of its own (an "
        "embedding, one residual layer per stage stacked as `nn.scan` / `nnx.vmap` / "
        "`eqx.filter_vmap` stack them, a head; `ga.stack_stages` lays them out), then SGD on "
        "the stacked params "
        '(`axis_name="data"` under `shard_map`; tests/_matrix_pipeline.py). Reference: '
        "`jax.grad` of the unstaged linen model on the step's whole batch.",
    ),
}

# The sizes of every cell (tests/_matrix_run.py builds them from these).
DEVICES = 8  # host devices on the mapped and sharded routes
K = 2  # micro-batches per window (calls) or per step (inside one call)
STEPS = 2  # windows or steps of SGD per cell
ROWS = 2  # examples per device and micro-batch
BATCHNORM_ROWS = 8  # where each device normalises its own slice, 2 would be ill-conditioned

# Tolerances per capability: float32 sums in another order (and, for the contrastive
# loss, a tiled softmax over the batch).
TOLERANCES = {name: {"rtol": 1e-5, "atol": 1e-6} for name in CAPABILITIES}
TOLERANCES["coupled"] = {"rtol": 2e-5, "atol": 1e-5}


# --- outcomes -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Exact:
    kind = "exact"


@dataclasses.dataclass(frozen=True)
class Refused:
    error: type[Exception]
    match: str  # a regular expression the message must match: the fix it names
    why: str
    kind = "refused"


@dataclasses.dataclass(frozen=True)
class NotApplicable:
    why: str
    witness: str | None = None  # a check in tests/_matrix_run.py that the reason holds
    kind = "n/a"


@dataclasses.dataclass(frozen=True)
class Pending:
    gap: str  # what fails today, with its issue item
    then: Exact | Refused = Exact()
    kind = "pending"


Outcome = Exact | Refused | NotApplicable | Pending

ANY = "*"

_STATISTICS_MODULE = Refused(
    TypeError,
    r"statistics_fn.*Split the model yourself.*nnx\.split\(model, nnx\.Param",
    "`statistics_fn`'s first pass cannot replay a module's carried state (its RNG "
    "counters); the error says to split the model and pass its params (the split-state "
    "column).",
)
_FP8_NNX = Refused(
    ValueError,
    r"fp8 metadata leaves.*gradaccum_jax\.flax\.Optimizer",
    "`accumulate` refuses fp8 metadata in the optimizer's tree (a window would average "
    "them and step them); the error names `ga.flax.Optimizer`, which holds them through "
    "the window and writes their max at the close.",
)
_UNREDUCED_MODULE = Refused(
    TypeError,
    r"unreduced_value_and_grad got a flax\.nnx module.*nnx\.split\(model, nnx\.Param",
    "`unreduced_value_and_grad` differentiates pytrees of params: the module's other state "
    "(RNG streams, statistics) would be differentiated too, and each device would hold its "
    "own copy; the error says to split the model (the split-state column).",
)
_PRIVACY_UNREDUCED = Refused(
    ValueError,
    r"dp_accumulate does not support gradients unreduced.*axis_name=",
    "`dp_accumulate` takes no unreduced sums (its noisy close is not built for per-device "
    "windows); the error says to reduce the clipped sums first, or to use `axis_name=` "
    "under `jax.shard_map`. On this mesh `clipped_grad` itself returns reduced sums (the "
    "Explicit column).",
)
_MODULES = ("nnx_module", "nnx_optimizer")  # the styles that differentiate a module


def _equinox_split(door: str) -> Refused:
    """The refusal of an Equinox model by a door that takes pytrees of arrays."""
    return Refused(
        TypeError,
        re.escape(door)
        + r" got an equinox\.Module.*eqx\.partition\(model, eqx\.is_inexact_array\)",
        "the door takes pytrees of arrays, and an Equinox model holds its activation "
        "functions beside them; the error shows the split (`eqx.combine(params, static)` in "
        "the loss), whose arrays, still a module of the model's type, the door takes "
        "(tests/test_equinox.py).",
    )


_PIPELINE_MODULE = Refused(
    TypeError,
    r"pipeline_value_and_grad got a flax\.nnx module.*nnx\.split\(model, nnx\.Param",
    "the pipeline takes its params as a mapping with the stacked stage params under "
    '`"stages"`; a module holds its layers unstacked and its RNG streams beside them. The '
    "error says to split the model and stack the layers' state (the split-state column).",
)

# The declarations, most specific first: (capability, route, style), each entry a name, a
# tuple of names or ANY. A triple not listed is Exact.
DECLARATIONS: list[tuple[tuple[Any, Any, Any], Outcome]] = [
    (
        ("fp8", ANY, "equinox"),
        NotApplicable(
            "Equinox has no fp8 layers (`equinox.nn`, checked by the test): the capability is "
            "Flax's delayed-scaling layers, whose scales and amax histories live in Flax's "
            "`_overwrite_with_gradient` collection.",
            witness="equinox_has_no_fp8_layer",
        ),
    ),
    (
        ("batchnorm", ANY, "equinox"),
        NotApplicable(
            "`AccumBatchNorm` and `NNXAccumBatchNorm` are Flax layers, their statistics in "
            "Flax's `batch_stats` collection or `nnx.BatchStat` variables, and the library has "
            "no Equinox one; Equinox's own `eqx.nn.BatchNorm` keeps its running statistics in "
            "an `eqx.nn.State` that each training call writes (checked by the test): a "
            "micro-batch's, not the window's.",
            witness="equinox_batchnorm_writes_at_every_call",
        ),
    ),
    (
        ("coupled", ANY, "equinox"),
        _equinox_split("coupled_value_and_grad"),
    ),
    (("privacy", ANY, "equinox"), _equinox_split("privacy.clipped_grad")),
    (
        (("accumulate", "microbatch", "statistics"), "jit_unreduced", "equinox"),
        _equinox_split("unreduced_value_and_grad"),
    ),
    (
        ("fp8", ANY, "linen"),
        Refused(
            ValueError,
            r"fp8 metadata leaves.*gradaccum_jax\.flax\.TrainState",
            "`accumulate` refuses fp8 metadata in the optimizer's tree (a window would "
            "average them and step them); the error names `ga.flax.TrainState`, which "
            "holds them through the window and writes their max at the close.",
        ),
    ),
    (("fp8", ANY, ("nnx_module", "nnx_split")), _FP8_NNX),
    (
        ("fp8", "jit_unreduced", ANY),
        Refused(
            ValueError,
            r"unreduced_value_and_grad got fp8 metadata leaves.*microbatch_value_and_grad",
            "`unreduced_value_and_grad` refuses fp8 metadata: left unreduced, the devices' "
            "amaxes would be summed where the large batch takes their max; the error names "
            "`microbatch_value_and_grad` in the global-view step (a road that, on an "
            "Explicit mesh, meets the Flax limitation of the column before).",
        ),
    ),
    (
        ("fp8", ("jit_explicit", "jit_explicit_no_mesh"), ANY),
        NotApplicable(
            "Flax's fp8 layers do not run under global-view `jit` on an Explicit mesh with "
            "a sharded batch: the backward pass's `dot_general` contracts the sharded batch "
            "axis and JAX asks for an `out_sharding` that `fp8_ops` does not pass "
            "(flax 0.12, without this library; the test checks that it still fails).",
            witness="flax_fp8_fails_on_an_explicit_mesh",
        ),
    ),
    (
        (("accumulate", "microbatch", "statistics", "batchnorm"), "jit_unreduced", _MODULES),
        _UNREDUCED_MODULE,
    ),
    (("statistics", ANY, _MODULES), _STATISTICS_MODULE),
    (("privacy", "jit_unreduced", ANY), _PRIVACY_UNREDUCED),
    (
        ("pipeline", "pmap", ANY),
        NotApplicable(
            "`jax.pmap` maps one axis of devices and has no mesh: a pipeline over a stage "
            "axis beside a data axis runs under `jax.shard_map` (the column before) or "
            "global-view `jit`."
        ),
    ),
    (
        ("pipeline", "jit_unreduced", ANY),
        NotApplicable(
            "`pipeline_value_and_grad` leaves nothing unreduced: it reduces the gradients over "
            "the data axes itself, once per step, after the schedule's loop (counted in "
            "tests/test_pipeline.py); for one reduction per window across calls, "
            "`accumulate(..., axis_name=)` under `shard_map` (docs/pipeline.md)."
        ),
    ),
    (("pipeline", ANY, _MODULES), _PIPELINE_MODULE),
    (
        ("pipeline", "one_device", ANY),
        Refused(
            ValueError,
            r"stage_axis='stage' is not bound and no mesh is known.*jax\.shard_map",
            "a pipeline needs devices along a stage axis: with neither a mesh in context nor "
            "one in the arguments' shardings, the error names `jax.shard_map`, "
            "`jax.set_mesh` and `jax.device_put` onto a mesh with a stage axis.",
        ),
    ),
]


def fits(pattern: tuple[Any, Any, Any], cell: tuple[str, str, str]) -> bool:
    """Each entry of `pattern` is a name, a tuple of names, or `ANY`."""
    return all(
        p == ANY or c in (p if isinstance(p, tuple) else (p,))
        for p, c in zip(pattern, cell, strict=True)
    )


def deciding(capability: str, route: str, style: str) -> int | None:
    """The index of the first declaration that fits the cell (None: none, so `Exact`)."""
    for i, (pattern, _) in enumerate(DECLARATIONS):
        if fits(pattern, (capability, route, style)):
            return i
    return None


def outcome(capability: str, route: str, style: str) -> Outcome:
    """The declared outcome of a cell: the first declaration that fits it, else `Exact`."""
    i = deciding(capability, route, style)
    return Exact() if i is None else DECLARATIONS[i][1]


def cells() -> list[tuple[str, str, str]]:
    return [(c, r, s) for c in CAPABILITIES for r in ROUTES for s in STYLES]


def quick(capability: str, route: str, style: str) -> bool:
    """The cells of the quick loop: every (capability, route) and every (capability, style)
    pair once, one style per route, rotated from capability to capability (a Latin
    square); refusals and non-applicable cells cost nothing and always run."""
    c, r, s = (
        list(CAPABILITIES).index(capability),
        list(ROUTES).index(route),
        list(STYLES).index(style),
    )
    return (r + c) % len(STYLES) == s or not isinstance(
        outcome(capability, route, style), Exact | Pending
    )
