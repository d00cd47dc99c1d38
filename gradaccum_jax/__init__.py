"""gradaccum_jax: exact, fast gradient accumulation for JAX and Optax."""

from gradaccum_jax._accumulation import (
    AccumulateState,
    accumulate,
    closes_window,
    optimizer_step,
)
from gradaccum_jax._mixed_precision import (
    LossScaleState,
    current_loss_scale,
    dynamic_loss_scale,
    scale_loss,
    static_loss_scale,
)

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "LossScaleState",
    "accumulate",
    "closes_window",
    "current_loss_scale",
    "dynamic_loss_scale",
    "optimizer_step",
    "scale_loss",
    "static_loss_scale",
]
