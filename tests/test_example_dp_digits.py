"""The DP-SGD digits example runs at its reduced size and shows what it claims."""

import importlib.util
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gradaccum_jax import privacy

pytestmark = pytest.mark.slow  # runs an example end to end

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "dp_digits.py"


class _StandInState(NamedTuple):
    acc: Any
    key: jax.Array
    window: jax.Array
    micro_step: jax.Array
    inner: Any


def _stand_in_dp_accumulate(
    inner, every_k_schedule, *, l2_clip_norm, noise_multiplier, expected_batch_size, key
):
    """The rule of SPEC section 13 written out, for branches without privacy.dp_accumulate.

    A window closes after `every_k_schedule` (an int) micro-steps, or where `close=` says.
    """
    assert every_k_schedule is None or isinstance(every_k_schedule, int)

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        count = jnp.zeros((), jnp.int32)
        return _StandInState(zeros, key, count, count, inner.init(params))

    def update(grads, state, params=None, *, close=None, **extra_args):
        if close is None:
            close = state.micro_step + 1 == every_k_schedule
        acc = jax.tree.map(jnp.add, state.acc, grads)
        zeros = jax.tree.map(jnp.zeros_like, acc)

        def closing():
            leaves, treedef = jax.tree.flatten(acc)
            keys = jax.random.split(jax.random.fold_in(state.key, state.window), len(leaves))
            std = noise_multiplier * l2_clip_norm
            noisy = [
                (g + std * jax.random.normal(k, g.shape, g.dtype)) / expected_batch_size
                for g, k in zip(leaves, keys, strict=True)
            ]
            updates, inner_state = inner.update(
                jax.tree.unflatten(treedef, noisy), state.inner, params
            )
            count = jnp.zeros((), jnp.int32)
            return updates, _StandInState(zeros, state.key, state.window + 1, count, inner_state)

        def open_window():
            return zeros, state._replace(acc=acc, micro_step=state.micro_step + 1)

        return jax.lax.cond(close, closing, open_window)

    return optax.GradientTransformationExtraArgs(init, update)


def _load_example():
    spec = importlib.util.spec_from_file_location("dp_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run(capsys, monkeypatch):
    if not hasattr(privacy, "dp_accumulate"):
        monkeypatch.setattr(privacy, "dp_accumulate", _stand_in_dp_accumulate, raising=False)
    out = _load_example().main(["--quick"])
    printed = capsys.readouterr().out
    assert "epsilon = " in printed and "PLD accountant" in printed
    # Poisson logical batches: their sizes vary around B = 256.
    assert min(out["sizes"]) < 256 < max(out["sizes"])
    # epsilon counts logical batches (windows), one per Poisson batch, not micro-steps.
    assert out["windows"] == len(out["sizes"]) == 6 * round(1 / out["q"])
    want = privacy.epsilon(2.5, out["q"], out["windows"], 1e-5, sampling="poisson")
    assert out["epsilon"] == want
    # The point of micro-batches: per-example gradients of m examples, not of B.
    assert out["temp_bytes"][256] > 4 * out["temp_bytes"][32]
    assert out["history"][-1] > 0.5, "the private run learned something"
    assert out["plain_history"][-1] > 0.8
    assert np.all(np.isfinite(out["history"]))
