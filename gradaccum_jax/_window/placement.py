"""Where transformations sit around `accumulate`, checked where the library can see it.

A loss scale, a second window (`accumulate`, `optax.apply_every`, `optax.MultiSteps`)
or a schedule of an `optax.inject_hyperparams` means one thing before `accumulate` or
inside it and another after it or around it; the wrong place gives plausible wrong
numbers. Two checks, both in Python at `init` or trace time, none in the compiled step:

- `check_state` reads an optimizer state's structure, element by element in the
  order `optax.chain` and `optax.named_chain` apply them; `apply_gradients` and the
  helpers that read the state (`optimizer_step`, `closes_window`, `has_updated`,
  `current_loss_scale`, `scaled_value_and_grad`) call it.
- `mark_window_output` / `refuse_window_output`: `accumulate` marks the updates it
  returns, and the next element of a chain that is a loss scale or another
  `accumulate` recognises them (the very same arrays or tracers) and raises, also
  for a step written with `tx.update` alone.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import jax
import optax

from gradaccum_jax._window.state import AccumulateState, LossScaleState, refuse_outermost_inside

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
_OTHER_WINDOWS = (optax.ApplyEvery, optax.MultiStepsState)
_SCALE_ORDER = "optax.chain(ga.dynamic_loss_scale(), ga.accumulate(inner, K))"


def _name(node: Any) -> str:
    if isinstance(node, AccumulateState):
        return "gradaccum_jax.accumulate"
    if isinstance(node, optax.ApplyEvery):
        return "optax.apply_every"
    if isinstance(node, optax.MultiStepsState):
        return "optax.MultiSteps"
    return "a loss scale (dynamic_loss_scale or static_loss_scale)"


def _two_windows(first: str, second: str) -> ValueError:
    if second == "optax.apply_every":
        fix = (
            "Drop apply_every and give accumulate the whole window: ga.accumulate(inner, K * N) "
            "for apply_every(N) after accumulate(inner, K)."
        )
    else:
        fix = (
            "Use one window and put everything that should run once per window inside it: "
            "ga.accumulate(optax.chain(<the first window's inner>, <what follows>), K)."
        )
    return ValueError(
        f"Two windows in a row: {second} comes after {first} in the optimizer's chain. The "
        "first window returns zeros on its micro-steps and one update per window; the second "
        "then accumulates those updates as if they were gradients (another optimizer flips "
        "or rescales them, apply_every sums several windows), which is not a longer window. " + fix
    )


def _scale_after_window(first: str) -> ValueError:
    return ValueError(
        f"A loss scale (dynamic_loss_scale or static_loss_scale) comes after {first} in the "
        "optimizer's chain. There it unscales the window's update instead of each "
        "micro-gradient: the transformations inside the window (a clip, the optimizer) see "
        "scaled gradients, and the scale adapts to one update per window, so it backs off "
        "too late or never. Put the loss scale first, before the window: "
        f"{_SCALE_ORDER} (or static_loss_scale in the same place)."
    )


def _check_sequence(kinds: list[tuple[str, str]]) -> None:
    """Raises for a window followed by a loss scale or by another window."""
    window = None
    for kind, name in kinds:
        if kind == "window":
            if window is not None:
                raise _two_windows(window, name)
            window = name
        elif window is not None:
            raise _scale_after_window(window)


def _walk(node: Any, scale_type: type) -> list[tuple[str, str]]:
    """The windows and loss scales in `node`, in the order the chain applies them."""
    if isinstance(node, (AccumulateState, *_OTHER_WINDOWS)):
        # What is inside a window runs on the window's gradient; accumulate refuses a
        # loss scale there itself.
        return [("window", _name(node))]
    if isinstance(node, scale_type):
        return [("scale", _name(node))]
    if isinstance(node, _INJECTED):
        kinds = _walk(node.inner_state, scale_type)
        scheduled = sorted(getattr(node, "hyperparams_states", None) or {})
        if scheduled and any(kind == "window" for kind, _ in kinds):
            raise ValueError(
                f"optax.inject_hyperparams evaluates its schedules ({', '.join(scheduled)}) "
                "outside gradaccum_jax.accumulate, once per update call: per micro-step, not "
                "once per window as the inner optimizer's own schedules. Give the schedule to "
                "the optimizer inside accumulate, where it advances once per window: "
                "ga.accumulate(optax.sgd(schedule), K), or ga.accumulate("
                "optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), K) to keep "
                "the injected hyperparameters (in opt_state.inner_state.hyperparams). A "
                "schedule written in micro-steps becomes lambda step: schedule(step * K)."
            )
        return kinds
    children = list(node.values()) if isinstance(node, dict) else node
    if not isinstance(children, tuple | list):
        return []
    if type(node) is tuple or isinstance(node, collections.OrderedDict):
        # optax.chain (a plain tuple) and optax.named_chain (an OrderedDict), in order.
        kinds = [kind for child in children for kind in _walk(child, scale_type)]
        _check_sequence(kinds)
        return kinds
    # Side by side (optax.masked's inner state, multi_transform's partitions, other
    # NamedTuples): each part is checked on its own; the parts together count as one
    # element holding the kinds found, scales before a window (an order that cannot
    # be wrong), so that what follows in an outer chain is still checked.
    found: list[tuple[str, str]] = []
    for child in children:
        kinds = _walk(child, scale_type)
        _check_sequence(kinds)
        found.extend(kind for kind in kinds if kind not in found)
    scales = [kind for kind in found if kind[0] == "scale"]
    windows = [kind for kind in found if kind[0] == "window"]
    return scales + windows[:1]


def check_state(opt_state: Any) -> None:
    """Raises `ValueError` if `opt_state`'s structure shows a transformation in a wrong place."""
    _check_sequence(_walk(opt_state, LossScaleState))
    _refuse_noise_before_window(opt_state)
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, _OTHER_WINDOWS)):
        if isinstance(node, optax.MultiStepsState):
            refuse_outermost_inside(node.inner_opt_state, "optax.MultiSteps")


def _refuse_noise_before_window(opt_state: Any) -> None:
    """Raises if optax's per-step DP noise (`dpsgd`) comes before a window, in leaf order.

    Leaf order is the order in which `optax.chain` applies its elements; side-by-side
    parts (`optax.masked`, `multi_transform`) count in their tree order too, which
    may refuse a harmless layout but never passes a noisy one.
    """
    noise = optax.contrib.DifferentiallyPrivateAggregateState
    seen_noise = False
    kinds = (noise, AccumulateState)
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds)):
        if isinstance(node, AccumulateState) and seen_noise:
            raise ValueError(
                "optax.contrib.differentially_private_aggregate (or optax.contrib.dpsgd) comes "
                "before an accumulating window in the optimizer's chain: it clips and adds "
                "noise on every micro-step, K draws per window (sqrt(K) times the noise "
                "calibrated for the logical batch, or its sum scaled by K), and its mean "
                "divides by the micro-batch. Clip per example with "
                "gradaccum_jax.privacy.clipped_grad and put the noise in the window's close: "
                "gradaccum_jax.privacy.dp_accumulate(inner, K, l2_clip_norm=C, "
                "noise_multiplier=sigma, expected_batch_size=B, key=key)."
            )
        seen_noise = seen_noise or isinstance(node, noise)


# The updates returned by `accumulate`, by identity: id -> a weak reference that
# confirms the object is still the one marked (an id may be reused after it dies).
_window_outputs: dict[int, weakref.ref] = {}


def mark_window_output(updates: Any) -> None:
    """Remembers the leaves `accumulate` returns, weakly (no buffer is kept alive)."""
    for leaf in jax.tree.leaves(updates):
        try:
            _window_outputs[id(leaf)] = weakref.ref(leaf, _forget(id(leaf)))
        except TypeError:  # not weakly referenceable: not marked
            continue


def _forget(key: int) -> Any:
    def callback(ref: weakref.ref) -> None:
        if _window_outputs.get(key) is ref:
            del _window_outputs[key]

    return callback


def _is_window_output(updates: Any) -> bool:
    leaves = jax.tree.leaves(updates)
    if not leaves:
        return False
    for leaf in leaves:
        ref = _window_outputs.get(id(leaf))
        if ref is None or ref() is not leaf:
            return False
    return True


def refuse_window_output(updates: Any, who: str) -> None:
    """Raises if `updates` are the very updates an `accumulate` returned (`who` is next)."""
    if not _is_window_output(updates):
        return
    if who == "gradaccum_jax.accumulate":
        raise _two_windows("gradaccum_jax.accumulate", who)
    raise _scale_after_window("gradaccum_jax.accumulate")
