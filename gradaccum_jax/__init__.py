"""gradaccum_jax: exact, fast gradient accumulation for JAX and Optax."""

from gradaccum_jax._accumulation import (
    AccumulateState,
    accumulate,
    closes_window,
    optimizer_step,
)
from gradaccum_jax._microbatch import microbatch_value_and_grad

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "accumulate",
    "closes_window",
    "microbatch_value_and_grad",
    "optimizer_step",
]
