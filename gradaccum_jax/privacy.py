"""Differentially private training with accumulation (DP-SGD over logical batches).

A public namespace, reached as `gradaccum_jax.privacy.<name>`; the code lives in
`gradaccum_jax._privacy`:

* `clipped_grad`: the sum over a micro-batch of per-example gradients, each clipped to `C`
  (its `plan` says how each leaf's per-example norms are found: `ClippingPlan`, `LeafPlan`;
  its `plan_memory`, which chunk size fits a memory budget: `gradaccum_jax.MicrobatchPlan`);
* `dp_accumulate`: the noisy window, noise once per logical batch, divided by a public `B`;
* `epsilon`: the privacy spent after a number of logical batches (windows).

Importing it needs neither jax_privacy nor dp_accounting; `epsilon` needs dp_accounting
when called (`pip install gradaccum_jax[privacy]`).
"""

from gradaccum_jax._privacy.accounting import epsilon
from gradaccum_jax._privacy.clipping import clipped_grad
from gradaccum_jax._privacy.fast import ClippingPlan, LeafPlan
from gradaccum_jax._privacy.window import (
    DPAccumulateState,
    DPCloseState,
    GaussianNoiseState,
    dp_accumulate,
)

__all__ = [
    "ClippingPlan",
    "DPAccumulateState",
    "DPCloseState",
    "GaussianNoiseState",
    "LeafPlan",
    "clipped_grad",
    "dp_accumulate",
    "epsilon",
]
