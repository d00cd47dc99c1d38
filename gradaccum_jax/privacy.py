"""Differentially private training with accumulation (DP-SGD over logical batches).

A public namespace, reached as `gradaccum_jax.privacy.<name>`; the code lives in
`gradaccum_jax._privacy`. It needs neither jax_privacy nor dp_accounting.
"""

from gradaccum_jax._privacy.window import (
    DPAccumulateState,
    DPCloseState,
    GaussianNoiseState,
    dp_accumulate,
)

__all__ = [
    "DPAccumulateState",
    "DPCloseState",
    "GaussianNoiseState",
    "dp_accumulate",
]
