"""gradaccum_jax: exact, fast gradient accumulation for JAX and Optax."""

from gradaccum_jax._accumulation import (
    AccumulateState,
    accumulate,
    closes_window,
    optimizer_step,
)
from gradaccum_jax._distributed import (
    add_replica_axis,
    remove_replica_axis,
    replica_state_specs,
)

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "accumulate",
    "add_replica_axis",
    "closes_window",
    "optimizer_step",
    "remove_replica_axis",
    "replica_state_specs",
]
