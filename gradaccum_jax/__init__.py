"""gradaccum_jax: exact, fast gradient accumulation for JAX and Optax.

Every public name is re-exported here, flat. The code lives in private packages by job,
each importing only from those below it (docs/concepts.md, "Architecture", has the picture):

- `_base`: version shims, argument checks, collectives, tree helpers; imports nothing of ours.
- `_sharding`: partial sums over mesh axes (typed unreduced) and their checkpoints.
- `_window`: the window engine (`engine.py`) and the transformations built on it.
- `_batching`: micro-batching inside a step, the planner, per-device unreduced gradients.
- `_clipping`: overflow-free measures and the clipping families.
- `_privacy`: differential privacy (per-example clipping, the noisy window
  `dp_accumulate`, accounting), behind the public namespace `gradaccum_jax.privacy`.
- `flax`: the Flax layers (linen, NNX, their shared window statistics) and containers.

Reading order: `_base/trees.py`, `_window/engine.py`, `_window/routes.py` with
`_sharding/partials.py`, `_window/stages.py` (accumulate's update path: accept, weigh, add,
close, write), then `_window/accumulate.py`.
"""

from typing import TYPE_CHECKING, Any

# The tiled contrastive losses: a public submodule, reached as gradaccum_jax.losses.<name>.
from gradaccum_jax import losses as losses

# Differential privacy (clipping per example, the noisy window): gradaccum_jax.privacy.<name>.
from gradaccum_jax import privacy as privacy
from gradaccum_jax._batching.coupled import (
    coupled_value_and_grad,
)
from gradaccum_jax._batching.microbatch import (
    microbatch_value_and_grad,
    plan_microbatches,
)
from gradaccum_jax._batching.replicas import (
    reduce_replicas,
)
from gradaccum_jax._batching.unreduced import (
    unreduced_value_and_grad,
)
from gradaccum_jax._clipping.agc import (
    adaptive_grad_clip,
)
from gradaccum_jax._clipping.ema import (
    ClipNormByEMAState,
    ClipValueByEMAState,
    clip_norm_by_ema,
    clip_value_by_ema,
    normalize_by_ema,
)
from gradaccum_jax._clipping.growth import (
    ClipNormGrowthState,
    ClipValueGrowthState,
    clip_norm_growth,
    clip_value_growth,
)
from gradaccum_jax._clipping.norm import (
    centralize,
    clip_grad_norm,
    clip_grad_value,
    clip_norm,
    clip_value,
    normalize,
    normalize_grads,
)
from gradaccum_jax._pipeline.pipeline import (
    pipeline_value_and_grad,
    stack_stages,
    unstack_stages,
)
from gradaccum_jax._pipeline.schedules import (
    PipelineSchedule,
    pipeline_schedule,
)
from gradaccum_jax._sharding.checkpoint import (
    checkpointable,
    restore_unreduced,
)
from gradaccum_jax._sharding.compiled_memory import (
    MicrobatchPlan,
)
from gradaccum_jax._window.accumulate import (
    AccumulateState,
    accumulate,
    closes_window,
    has_updated,
    optimizer_step,
)
from gradaccum_jax._window.conditional import (
    ConditionalAccumulateState,
    ConditionalAccumulator,
    conditional_accumulate,
    conditional_accumulator_init,
    conditional_apply_grad,
    conditional_num_accumulated,
    conditional_set_global_step,
    conditional_take_grad,
)
from gradaccum_jax._window.fused import (
    apply_gradients,
)
from gradaccum_jax._window.loss_scale import (
    LossScaleState,
    current_loss_scale,
    dynamic_loss_scale,
    scale_loss,
    scaled_value_and_grad,
    static_loss_scale,
)
from gradaccum_jax._window.noise_scale import (
    CriticalBatchSchedule,
    GradientNoiseScale,
    NoiseScaleState,
    critical_batch_schedule,
    gradient_noise_scale,
)
from gradaccum_jax._window.specs import (
    add_replica_axis,
    remove_replica_axis,
    replica_state_specs,
)
from gradaccum_jax._window.split import (
    SplitAccumulateState,
    clamp_params,
    split_accumulate,
)

if TYPE_CHECKING:
    from gradaccum_jax import flax as flax

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "ClipNormByEMAState",
    "ClipNormGrowthState",
    "ClipValueByEMAState",
    "ClipValueGrowthState",
    "ConditionalAccumulateState",
    "ConditionalAccumulator",
    "CriticalBatchSchedule",
    "GradientNoiseScale",
    "LossScaleState",
    "MicrobatchPlan",
    "NoiseScaleState",
    "PipelineSchedule",
    "SplitAccumulateState",
    "accumulate",
    "adaptive_grad_clip",
    "add_replica_axis",
    "apply_gradients",
    "centralize",
    "checkpointable",
    "clamp_params",
    "clip_grad_norm",
    "clip_grad_value",
    "clip_norm",
    "clip_norm_by_ema",
    "clip_norm_growth",
    "clip_value",
    "clip_value_by_ema",
    "clip_value_growth",
    "closes_window",
    "conditional_accumulate",
    "conditional_accumulator_init",
    "conditional_apply_grad",
    "conditional_num_accumulated",
    "conditional_set_global_step",
    "conditional_take_grad",
    "coupled_value_and_grad",
    "critical_batch_schedule",
    "current_loss_scale",
    "dynamic_loss_scale",
    "gradient_noise_scale",
    "has_updated",
    "microbatch_value_and_grad",
    "normalize",
    "normalize_by_ema",
    "normalize_grads",
    "optimizer_step",
    "pipeline_schedule",
    "pipeline_value_and_grad",
    "plan_microbatches",
    "reduce_replicas",
    "remove_replica_axis",
    "replica_state_specs",
    "restore_unreduced",
    "scale_loss",
    "scaled_value_and_grad",
    "split_accumulate",
    "stack_stages",
    "static_loss_scale",
    "unreduced_value_and_grad",
    "unstack_stages",
]


def __getattr__(name: str) -> Any:
    # The Flax layers live in a subpackage, reached as gradaccum_jax.flax.<name>. It is
    # imported on first use so that `import gradaccum_jax` does not import flax (most
    # of its import time) for users who never touch the Flax layers.
    if name == "flax":
        import gradaccum_jax.flax

        return gradaccum_jax.flax
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "flax"])
