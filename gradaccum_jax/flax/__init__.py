"""Flax for gradient accumulation: batch normalisation with exact window statistics, and
the training containers (`TrainState`, `nnx` `Optimizer`) stepping through `apply_gradients`."""

from gradaccum_jax.flax._fp8 import (
    fp8_metadata,
)
from gradaccum_jax.flax._linen import (
    AccumBatchNorm,
    batch_stats_from_flax,
    batch_stats_to_flax,
    commit_batch_stats,
)
from gradaccum_jax.flax._nnx import (
    NNXAccumBatchNorm,
    commit_nnx_batch_stats,
)
from gradaccum_jax.flax._train_state import (
    Optimizer,
    TrainState,
)
from gradaccum_jax.flax._window_stats import exportable_eval

__all__ = [
    "AccumBatchNorm",
    "NNXAccumBatchNorm",
    "Optimizer",
    "TrainState",
    "batch_stats_from_flax",
    "batch_stats_to_flax",
    "commit_batch_stats",
    "commit_nnx_batch_stats",
    "exportable_eval",
    "fp8_metadata",
]
