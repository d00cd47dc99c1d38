"""gradaccum_jax: exact, fast gradient accumulation for JAX and Optax."""

from gradaccum_jax._accumulation import (
    AccumulateState,
    accumulate,
    closes_window,
    optimizer_step,
)
from gradaccum_jax._conditional import (
    ConditionalAccumulateState,
    ConditionalAccumulatorState,
    conditional_accumulate,
    conditional_accumulator_init,
    conditional_apply_grad,
    conditional_num_accumulated,
    conditional_set_global_step,
    conditional_take_grad,
)
from gradaccum_jax._mixed_precision import (
    LossScaleState,
    current_loss_scale,
    dynamic_loss_scale,
    scale_loss,
    static_loss_scale,
)
from gradaccum_jax._split import (
    SplitAccumulateState,
    clamp_params,
    split_accumulate,
)

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "ConditionalAccumulateState",
    "ConditionalAccumulatorState",
    "LossScaleState",
    "SplitAccumulateState",
    "accumulate",
    "clamp_params",
    "closes_window",
    "conditional_accumulate",
    "conditional_accumulator_init",
    "conditional_apply_grad",
    "conditional_num_accumulated",
    "conditional_set_global_step",
    "conditional_take_grad",
    "current_loss_scale",
    "dynamic_loss_scale",
    "optimizer_step",
    "scale_loss",
    "split_accumulate",
    "static_loss_scale",
]
