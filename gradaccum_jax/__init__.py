"""gradaccum_jax: exact, fast gradient accumulation for JAX and Optax."""

from typing import TYPE_CHECKING, Any

# The tiled contrastive losses: a public submodule, reached as gradaccum_jax.losses.<name>.
from gradaccum_jax import losses as losses
from gradaccum_jax._accumulation import (
    AccumulateState,
    accumulate,
    closes_window,
    has_updated,
    optimizer_step,
)
from gradaccum_jax._agc import (
    adaptive_grad_clip,
)
from gradaccum_jax._checkpoint import (
    checkpointable,
    restore_unreduced,
)
from gradaccum_jax._clipping import (
    ClipNormByEMAState,
    ClipNormGrowthState,
    ClipValueByEMAState,
    ClipValueGrowthState,
    centralize,
    clip_grad_norm,
    clip_grad_value,
    clip_norm,
    clip_norm_by_ema,
    clip_norm_growth,
    clip_value,
    clip_value_by_ema,
    clip_value_growth,
    normalize,
    normalize_by_ema,
    normalize_grads,
)
from gradaccum_jax._conditional import (
    ConditionalAccumulateState,
    ConditionalAccumulator,
    conditional_accumulate,
    conditional_accumulator_init,
    conditional_apply_grad,
    conditional_num_accumulated,
    conditional_set_global_step,
    conditional_take_grad,
)
from gradaccum_jax._coupled import (
    coupled_value_and_grad,
)
from gradaccum_jax._distributed import (
    add_replica_axis,
    remove_replica_axis,
    replica_state_specs,
)
from gradaccum_jax._fused import (
    apply_gradients,
)
from gradaccum_jax._global_view import (
    unreduced_value_and_grad,
)
from gradaccum_jax._microbatch import (
    microbatch_value_and_grad,
    plan_microbatches,
)
from gradaccum_jax._mixed_precision import (
    LossScaleState,
    current_loss_scale,
    dynamic_loss_scale,
    scale_loss,
    scaled_value_and_grad,
    static_loss_scale,
)
from gradaccum_jax._noise_scale import (
    CriticalBatchSchedule,
    GradientNoiseScale,
    NoiseScaleState,
    critical_batch_schedule,
    gradient_noise_scale,
)
from gradaccum_jax._planning import (
    MicrobatchPlan,
)
from gradaccum_jax._split import (
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
    "plan_microbatches",
    "remove_replica_axis",
    "replica_state_specs",
    "restore_unreduced",
    "scale_loss",
    "scaled_value_and_grad",
    "split_accumulate",
    "static_loss_scale",
    "unreduced_value_and_grad",
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
