"""Privacy accounting: epsilon after a number of logical batches, through dp_accounting.

dp_accounting is an optional dependency (`pip install gradaccum_jax[privacy]`),
imported when `epsilon` is called, so that `import gradaccum_jax.privacy` works
without it.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax._base import validation

SAMPLINGS = ("poisson", "fixed_size")
ACCOUNTANTS = ("pld", "rdp")


def epsilon(
    noise_multiplier: float,
    sampling_probability: float,
    steps: int,
    delta: float,
    *,
    sampling: str,
    accountant: str = "pld",
    orders: Sequence[float] | None = None,
) -> float:
    r"""The epsilon spent by DP-SGD after `steps` logical batches, from dp_accounting.

    Each logical batch (one window of `dp_accumulate`, however many micro-steps
    it spans) is one subsampled Gaussian mechanism: the sum of clipped
    gradients gets noise of standard deviation `noise_multiplier * C` once.
    `steps` therefore counts windows, not micro-steps: counting the K
    micro-steps of each window would compose K times as many mechanisms and
    overstate epsilon: for sigma = 1.1, q = 0.01, 1000 windows of K = 4
    micro-steps and delta = 1e-5, the RDP accountant gives 1.71 for the 1000
    windows and 3.41 for 4000 "steps" (PLD: 1.52 and 3.12).

    The sampling of the logical batches must be named, because it sets the
    sensitivity the bound is about:

    * `"poisson"`: each example joins each logical batch independently with
      probability `q` (variable batch sizes; close windows with `close=`).
      Add/remove-one neighbours, sensitivity `C`: the event is
      `PoissonSampledDpEvent(q, GaussianDpEvent(noise_multiplier))`.
    * `"fixed_size"`: batches of a fixed size `q * N` drawn without replacement.
      Neighbours then replace one example (the size is public), sensitivity
      `2C`; as jax_privacy's accountant does, the bound is that of Poisson
      sampling with the noise multiplier halved:
      `PoissonSampledDpEvent(q, GaussianDpEvent(noise_multiplier / 2))`.

    Shuffled epochs cut into consecutive batches are neither: no bound here
    covers them.

    Args:
        noise_multiplier: `sigma`, the noise standard deviation over the clip
            norm, `>= 0` (0 spends an infinite epsilon).
        sampling_probability: `q`, the expected logical batch size over the
            dataset size, in `[0, 1]`.
        steps: The number of logical batches (windows), an int `>= 0`.
        delta: The target delta, in `(0, 1)`.
        sampling: `"poisson"` or `"fixed_size"`, keyword-only and required.
        accountant: `"pld"` (privacy loss distributions, the tighter bound) or
            `"rdp"` (Rényi DP, looser: 13% more epsilon at the numbers above).
            Say which one a reported epsilon comes from.
        orders: The Rényi orders at which the `"rdp"` accountant bounds the
            privacy loss (each `> 1`); epsilon is the least bound over them, so
            every grid gives a valid bound and a finer one a tighter bound.
            `None` (default) uses dp_accounting's default orders: 1.1 to 10.9 in
            steps of 0.1, the integers 11 to 63, and 128, 256, 512, 1024.
            jax_privacy's accountant uses its own grid
            (`RdpAccountantConfig().orders`): pass it to reproduce its epsilon.
            Refused with `accountant="pld"`, which has no orders.

    Returns:
        Epsilon, a Python float (`inf` if no finite bound holds).

    Raises:
        ImportError: If dp_accounting is not installed.
        TypeError, ValueError: If an argument is out of range, or traced (inside
            `jax.jit`: epsilon is computed in Python); the message names it.

    The numbers may be Python or NumPy numbers or concrete JAX scalars, such
    as `gradaccum_jax.optimizer_step(opt_state)` for `steps`.

    Examples:
        >>> from gradaccum_jax import privacy
        >>> eps = privacy.epsilon(1.1, 0.01, steps=1000, delta=1e-5, sampling="poisson")
        >>> round(eps, 2)
        1.52
        >>> round(privacy.epsilon(1.1, 0.01, 1000, 1e-5, sampling="poisson", accountant="rdp"), 2)
        1.71

    References:
        Abadi et al., 2016, "Deep Learning with Differential Privacy",
        https://arxiv.org/abs/1607.00133;
        Doroshenko et al., 2022, "Connect the Dots: Tighter Discrete
        Approximations of Privacy Loss Distributions",
        https://arxiv.org/abs/2207.04380
    """
    sigma = validation.check_real(
        "noise_multiplier", _number("noise_multiplier", noise_multiplier), minimum=0.0
    )
    q = validation.check_real(
        "sampling_probability",
        _number("sampling_probability", sampling_probability),
        minimum=0.0,
        maximum=1.0,
    )
    steps = _number("steps", steps)
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise TypeError(
            f"steps must be an int, the number of logical batches (windows); got {steps=!r}."
        )
    steps = validation.check_int("steps", steps, minimum=0)
    delta = _number("delta", delta)
    target_delta = validation.check_real("delta", delta, minimum=0.0, maximum=1.0, exclusive=True)
    if target_delta >= 1.0:
        raise ValueError(f"delta must be < 1; got {delta=!r}.")
    sampling = validation.check_choice("sampling", sampling, SAMPLINGS)
    accountant = validation.check_choice("accountant", accountant, ACCOUNTANTS)
    orders = _check_orders(orders, accountant)
    dp_accounting = _import_dp_accounting()
    if steps == 0:  # no mechanism has run (dp_accounting refuses a count of 0)
        return 0.0
    sensitivity = 1.0 if sampling == "poisson" else 2.0
    event = dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(sigma / sensitivity)
    )
    tracker: Any = (
        dp_accounting.pld.PLDAccountant()
        if accountant == "pld"
        else dp_accounting.rdp.RdpAccountant(orders=orders)
    )
    tracker.compose(event, steps)
    return float(tracker.get_epsilon(target_delta))


def _number(name: str, value: Any) -> Any:
    """`value` as a Python number if it is a concrete NumPy or JAX scalar, else as it is.

    `epsilon` runs in Python (dp_accounting), on numbers known when it is called:
    a traced value (inside `jax.jit`) has none yet.
    """
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"epsilon got {name}={value!r}, a traced value: it is computed in Python by "
            "dp_accounting, from numbers known when it is called, so it cannot run inside "
            "jax.jit or another transformation. Call privacy.epsilon outside the traced "
            "function, e.g. on ga.optimizer_step(opt_state) after the step has returned it."
        )
    if not isinstance(value, jax.Array | np.ndarray | np.generic):
        return value
    dtype = value.dtype
    if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
        raise TypeError(f"epsilon's {name} must be a number; got {name}={value!r}.")
    if np.ndim(value) != 0:
        raise ValueError(
            f"epsilon's {name} must be a scalar; got an array of shape {np.shape(value)}."
        )
    return value.item()


def _check_orders(orders: Any, accountant: str) -> np.ndarray | None:
    """`orders` as a float64 array of Rényi orders `> 1`, or `None` for the default grid."""
    if orders is None:
        return None
    if accountant != "rdp":
        raise ValueError(
            f"orders= is for the Rényi DP accountant; got orders with {accountant=!r}, which "
            "has none. Pass accountant='rdp', or drop orders=."
        )
    if isinstance(orders, str | bytes | jax.core.Tracer):
        raise TypeError(f"orders must be a sequence of numbers > 1; got {orders=!r}.")
    try:
        grid = np.asarray(orders, np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"orders must be a sequence of numbers > 1; got {orders=!r}.") from error
    if grid.ndim != 1 or grid.size == 0 or not np.all(np.isfinite(grid) & (grid > 1)):
        raise ValueError(
            f"orders must be a non-empty sequence of finite numbers > 1 (Rényi orders); got "
            f"{orders=!r}."
        )
    return grid


def _import_dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError as error:
        raise ImportError(
            "gradaccum_jax.privacy.epsilon needs the dp_accounting package: "
            "pip install 'gradaccum_jax[privacy]' (or pip install dp-accounting)."
        ) from error
    return dp_accounting
