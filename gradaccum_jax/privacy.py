"""Differentially private training with accumulation: `gradaccum_jax.privacy`.

* `clipped_grad`: the sum over a micro-batch of per-example gradients, each clipped to `C`.
* `epsilon`: the privacy spent after a number of logical batches (windows), through
  dp_accounting (`pip install gradaccum_jax[privacy]`).
"""

from gradaccum_jax._privacy.accounting import epsilon
from gradaccum_jax._privacy.clipping import clipped_grad

__all__ = ["clipped_grad", "epsilon"]
