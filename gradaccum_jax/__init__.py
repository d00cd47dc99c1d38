"""gradaccum_jax: exact, fast gradient accumulation for JAX and Optax."""

# The Flax layers live in a subpackage, reached as gradaccum_jax.flax.<name>.
from gradaccum_jax import flax as flax
from gradaccum_jax._accumulation import (
    AccumulateState,
    accumulate,
    closes_window,
    optimizer_step,
)

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "accumulate",
    "closes_window",
    "optimizer_step",
]
