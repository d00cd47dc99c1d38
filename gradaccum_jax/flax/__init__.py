"""Flax layers for gradient accumulation: batch normalisation with exact window statistics."""

from gradaccum_jax.flax._batchnorm import (
    AccumBatchNorm,
    NNXAccumBatchNorm,
    batch_stats_from_flax,
    batch_stats_to_flax,
    commit_batch_stats,
    commit_nnx_batch_stats,
)

__all__ = [
    "AccumBatchNorm",
    "NNXAccumBatchNorm",
    "batch_stats_from_flax",
    "batch_stats_to_flax",
    "commit_batch_stats",
    "commit_nnx_batch_stats",
]
