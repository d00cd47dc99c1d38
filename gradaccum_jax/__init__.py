"""gradaccum_jax: exact, fast gradient accumulation for JAX and Optax."""

from gradaccum_jax._accumulation import (
    AccumulateState,
    accumulate,
    closes_window,
    optimizer_step,
)
from gradaccum_jax._agc import adaptive_grad_clip
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

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "ClipNormByEMAState",
    "ClipNormGrowthState",
    "ClipValueByEMAState",
    "ClipValueGrowthState",
    "accumulate",
    "adaptive_grad_clip",
    "centralize",
    "clip_grad_norm",
    "clip_grad_value",
    "clip_norm",
    "clip_norm_by_ema",
    "clip_norm_growth",
    "clip_value",
    "clip_value_by_ema",
    "clip_value_growth",
    "closes_window",
    "normalize",
    "normalize_by_ema",
    "normalize_grads",
    "optimizer_step",
]
