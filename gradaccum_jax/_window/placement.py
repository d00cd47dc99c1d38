"""Where transformations sit around `accumulate`, checked where the library can see it.

A loss scale, a second window (`accumulate`, `optax.apply_every`, `optax.MultiSteps`,
the windows registered with `register_window`), a schedule of an
`optax.inject_hyperparams`, or any element that keeps state (a schedule's count, an
EMA, adam's moments) means one thing before a window or inside it and another after
it or around it: after it, it runs on every micro-step, on the zeros between the
window's updates too. The wrong place gives plausible wrong numbers. After a window
only elements that map zero updates to zero updates and hold no state are right;
`optax.add_decayed_weights` and `optax.keep_params_nonnegative` hold none but read the
params and move them on the micro-steps there (`optax.contrib.normalize` turns the zeros
into NaN). Three checks, all in Python at `init` or trace time, none in the compiled
step:

- `check_state` reads an optimizer state's structure, element by element in the
  order `optax.chain` and `optax.named_chain` apply them; `apply_gradients` and the
  helpers that read the state (`optimizer_step`, `closes_window`, `has_updated`,
  `current_loss_scale`, `scaled_value_and_grad`) call it.
- `check_enclosing_updates`: a window's `update` finds the optax chains (and
  `inject_hyperparams`) whose `update` is calling it, on the Python stack, and runs
  `check_state` on their states and `refuse_not_zero_after_window` on their elements
  (and `refuse_loss_reader_after_window`, where the chain is given `value=`), so a step
  written with `tx.update` alone is checked too.
- `mark_window_output` / `refuse_window_output`: a window marks the updates it
  returns, and a loss scale or another window that receives them (the very same
  arrays or tracers) raises, where no optax chain composes the two.
"""

from __future__ import annotations

import collections
import functools
import re
import sys
import types
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import optax

from gradaccum_jax._window import loss_value
from gradaccum_jax._window.state import AccumulateState, LossScaleState, refuse_outermost_inside

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
_SCALE_ORDER = "optax.chain(ga.dynamic_loss_scale(), ga.accumulate(inner, K))"
_SCALE = "a loss scale (dynamic_loss_scale or static_loss_scale)"


class Window(NamedTuple):
    """How the errors name a window transformation that `check_state` recognises by its state.

    Attributes:
      name: The transformation as the user writes it (`"gradaccum_jax.accumulate"`).
      inside: Where a stateful element found after the window belongs, with
        `{element}` where its name goes: inside a window, where it runs once per
        window on the window's gradient.
      longer: How a window `N` times as long is written (`""`: no such form), the
        fix for `optax.apply_every(N)` after it.
    """

    name: str
    inside: str
    longer: str = ""


_INSIDE_ACCUMULATE = "ga.accumulate(optax.chain(..., {element}), K)"
ACCUMULATE = Window("gradaccum_jax.accumulate", _INSIDE_ACCUMULATE, "ga.accumulate(inner, K * N)")
# Window state types (subclasses included). A window returns zeros on the calls between
# its updates, so what follows it in a chain runs on those zeros too.
_WINDOWS: dict[type, Window] = {
    AccumulateState: ACCUMULATE,
    optax.ApplyEvery: Window("optax.apply_every", _INSIDE_ACCUMULATE),
    optax.MultiStepsState: Window("optax.MultiSteps", _INSIDE_ACCUMULATE),
}


def register_window(state_type: type, window: Window) -> None:
    """Has `check_state` treat `state_type` as a window's state, as `AccumulateState`.

    For windows defined outside this module (other modules of `_window`, and
    subpackages above it, which this module cannot import): nothing stateful, no
    loss scale and no second window may follow them in a chain.
    """
    _WINDOWS[state_type] = window


def _window(node: Any) -> Window | None:
    for state_type, window in _WINDOWS.items():
        if isinstance(node, state_type):
            return window
    return None


class _Kind(NamedTuple):
    """An element of a chain that `_check_sequence` orders: a window, a scale or state."""

    kind: str  # "window", "scale" or "state"
    name: str  # how the error names it; "" for state not yet named by its element
    window: Window | None = None


def _two_windows(first: Window, second: str) -> ValueError:
    if second == "optax.apply_every" and first.longer:
        fix = (
            f"Drop apply_every and give {first.name} the whole window: {first.longer} for "
            "apply_every(N) after it."
        )
    else:
        fix = (
            "Use one window and put everything that should run once per window inside it: "
            + first.inside.format(element="<what follows>")
            + (f"; a window N times as long is {first.longer}." if first.longer else ".")
        )
    return ValueError(
        f"Two windows in a row: {second} comes after {first.name} in the optimizer's chain. The "
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


_RULE = (
    "After a window only elements that map zero updates to zero updates and hold no state "
    "are right (optax.scale with a constant, clip_by_global_norm, clip)."
)


def _state_after_window(window: Window, element: str) -> ValueError:
    return ValueError(
        f"In the optimizer's chain, {element} comes after {window.name} and keeps state. "
        "What follows a window runs on every micro-step, on the zeros the window returns "
        "between its updates too: a schedule there advances K times per window, and a "
        "count, an EMA or adam's moments take in the zeros. " + _RULE + " Put it inside the "
        "window, where it runs once per window on the window's gradient: "
        + window.inside.format(element=element)
        + "."
    )


def _not_zero_after_window(window: Window, element: str, what: str) -> ValueError:
    return ValueError(
        f"In the optimizer's chain, {element} comes after {window.name} and does not map "
        "zero updates to zero: what follows a window runs on every micro-step, and on the "
        f"zeros the window returns between its updates it {what}, so the params change on "
        "the micro-steps, not once per window. " + _RULE + " Put it inside the window, where "
        "it runs once per window: " + window.inside.format(element=element) + "."
    )


def _check_sequence(kinds: list[_Kind]) -> None:
    """Raises for a window followed by a loss scale, another window or a stateful element."""
    window = None
    for kind in kinds:
        if window is None:
            window = kind.window
        elif kind.kind == "window":
            raise _two_windows(window, kind.name)
        elif kind.kind == "scale":
            raise _scale_after_window(window.name)
        else:
            raise _state_after_window(window, kind.name or "an element with an array as its state")


def _injected(node: Any, scale_type: type) -> list[_Kind]:
    """An `optax.inject_hyperparams` state: its inner state's kinds, and its schedules."""
    kinds = _walk(node.inner_state, scale_type)
    scheduled = sorted(getattr(node, "hyperparams_states", None) or {})
    if not scheduled:
        # Its count and constant hyperparameters change nothing the updates depend on.
        return kinds
    if any(kind.window for kind in kinds):
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
    hypers = ", ".join(f"{name}=schedule" for name in scheduled)
    return [_Kind("state", f"optax.inject_hyperparams(...)({hypers})"), *kinds]


def _refuse_lookahead_around(kinds: list[_Kind]) -> None:
    """Raises if `optax.lookahead`'s fast optimizer (`kinds`) holds a window."""
    windows = [kind.window for kind in kinds if kind.window]
    if windows:
        inside = windows[0].inside.format(element="optax.lookahead(inner, sync_period, ...)")
        raise ValueError(
            f"optax.lookahead is around {windows[0].name}: it counts its update calls, "
            "micro-steps, so its slow weights sync every sync_period micro-steps instead of "
            "every sync_period optimizer steps, and they move on the windows' zeros. Put it "
            f"inside the window, where it runs once per window: {inside}, with "
            "optax.LookaheadParams as the params of init and update (the gradients are "
            "those of params.fast)."
        )


def _element(state_type: type) -> str:
    """The factory of `state_type` where its name says it (`ScaleByAdamState`:
    `optax.scale_by_adam`), else the state type."""
    package = state_type.__module__.split(".")[0]
    stem = state_type.__qualname__.removesuffix("State")
    factory = re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()
    with warnings.catch_warnings():
        # A package may warn of (or refuse) a deprecated factory of that name.
        warnings.simplefilter("ignore")
        try:
            found = getattr(sys.modules.get(package), factory, None)
        except Exception:
            found = None
    if callable(found):
        return f"{package}.{factory}(...)"
    return f"the element whose state is {package}.{state_type.__qualname__}"


def _walk(node: Any, scale_type: type) -> list[_Kind]:
    """The windows, loss scales and stateful elements in `node`, in the order applied."""
    window = _window(node)
    if window is not None:
        # What is inside a window runs on the window's gradient; accumulate refuses a
        # loss scale there itself.
        return [_Kind("window", window.name, window)]
    if isinstance(node, scale_type):
        return [_Kind("scale", _SCALE)]
    if isinstance(node, _INJECTED):
        return _injected(node, scale_type)
    if isinstance(node, optax.LookaheadState):
        _refuse_lookahead_around(_walk(node.fast_state, scale_type))
    children = list(node.values()) if isinstance(node, dict) else node
    if not isinstance(children, tuple | list):
        # A leaf: an array is state (EmptyState, () and None have no leaves).
        return [_Kind("state", "")] if hasattr(node, "shape") else []
    if type(node) is tuple or isinstance(node, collections.OrderedDict):
        # optax.chain (a plain tuple) and optax.named_chain (an OrderedDict), in order.
        kinds = [kind for child in children for kind in _walk(child, scale_type)]
        _check_sequence(kinds)
        return kinds
    return _side_by_side(node, children, scale_type)


def _side_by_side(node: Any, children: Sequence[Any], scale_type: type) -> list[_Kind]:
    """Parts that run side by side (an element's fields, optax.masked's inner state,
    multi_transform's partitions): each part is checked on its own.

    The parts together count as one element holding the kinds found, scales and state
    before a window (an order that cannot be wrong), so that what follows in an outer
    chain is still checked. State not yet named takes the name of this element's type.
    """
    found: list[_Kind] = []
    for child in children:
        kinds = _walk(child, scale_type)
        _check_sequence(kinds)
        found.extend(kind for kind in kinds if kind not in found)
    if hasattr(node, "_fields"):  # a NamedTuple: an element's state
        label = _element(type(node))
        found = [kind._replace(name=label) if kind.name == "" else kind for kind in found]
        found = list(dict.fromkeys(found))
    scales = [kind for kind in found if kind.kind == "scale"]
    state = [kind for kind in found if kind.kind == "state"]
    windows = [kind for kind in found if kind.window]
    return scales + state + windows[:1]


def check_state(opt_state: Any) -> None:
    """Raises `ValueError` if `opt_state`'s structure shows a transformation in a wrong place."""
    _check_sequence(_walk(opt_state, LossScaleState))
    _refuse_noise_before_window(opt_state)
    multi_steps = optax.MultiStepsState
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, multi_steps)):
        if isinstance(node, multi_steps):
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


# --- the chains calling a window's update --------------------------------------------------


@functools.cache
def _combinator_codes() -> dict[types.CodeType, str]:
    """The code of the `update` of `optax.chain`, `named_chain`, `inject_hyperparams` and
    `lookahead`.

    Every chain shares its factory's `update_fn` code object, so a frame running one is
    recognised by its code, whatever the chain holds.
    """
    identity = optax.identity()
    injected = optax.inject_hyperparams(optax.scale)(step_size=1.0)
    return {
        optax.chain(identity).update.__code__: "chain",
        optax.named_chain(("only", identity)).update.__code__: "named_chain",
        injected.update.__code__: "inject_hyperparams",
        optax.lookahead(identity, 1, 0.5).update.__code__: "lookahead",
    }


def check_enclosing_updates() -> None:
    """Checks the optax chains whose `update` is calling this window's `update`.

    optax's elements are closures that call nothing of ours, so a window cannot see
    what follows it from its own arguments (its state is its own; a chain passes
    each element only its part). The chain's frame holds all of it: its `state`
    (what `check_state` reads) and its elements' update functions (what
    `refuse_not_zero_after_window` reads). A window's `update` calls this first; it
    reads the Python stack at trace time (or per call, eagerly), never the compiled
    step. Frames of optax versions whose chains keep other local names are skipped;
    the tests of the checks run on the oldest supported optax and the newest.
    """
    codes = _combinator_codes()
    frame: types.FrameType | None = sys._getframe(1)
    try:
        while frame is not None:
            kind = codes.get(frame.f_code)
            if kind is not None:
                _check_frame(kind, frame.f_locals)
            frame = frame.f_back
    finally:
        del frame


def _check_frame(kind: str, local: Any) -> None:
    state = local.get("state")
    if state is None:
        return
    check_state(state)
    functions, states = None, None
    if kind == "chain" and isinstance(state, tuple | list):
        functions, states = local.get("update_fns"), list(state)
    elif kind == "named_chain" and isinstance(state, Mapping):
        transforms = local.get("transforms") or ()
        functions = [transform.update for _, transform in transforms]
        states = [state.get(name) for name, _ in transforms]
    if functions is not None and states is not None and len(functions) == len(states):
        refuse_not_zero_after_window(states, list(functions))
        if "value" in (local.get("extra_args") or {}):
            refuse_loss_reader_after_window(
                states, list(functions), local.get("updates"), local.get("params")
            )


# The optax elements that hold no state but do not map zero updates to zero, each with
# what it returns on zeros. Their states are empty NamedTuples (optax.EmptyState for the
# first two, as optax.scale's), so only their code tells them apart; tests/test_placement.py
# runs every stateless element of optax's namespaces on zero updates and checks that this
# list names all that return non-zero ones. The factory's own code counts too:
# optax.inject_hyperparams(optax.add_decayed_weights) holds the factory, not an element.
_NOT_ZERO_ON_ZEROS = (
    (
        optax.add_decayed_weights,
        (0.0,),
        "optax.add_decayed_weights(...)",
        "adds weight_decay * params to them",
    ),
    (
        optax.keep_params_nonnegative,
        (),
        "optax.keep_params_nonnegative()",
        "returns -params where a param is negative",
    ),
    (
        optax.contrib.normalize,
        (),
        "optax.contrib.normalize()",
        "divides them by their norm, 0 / 0: NaN",
    ),
)


@functools.cache
def _not_zero_codes() -> dict[types.CodeType, tuple[str, str]]:
    codes = {}
    for factory, arguments, name, what in _NOT_ZERO_ON_ZEROS:
        codes[factory(*arguments).update.__code__] = (name, what)
        codes[factory.__code__] = (name, what)
    return codes


_SEARCHED = (types.FunctionType, functools.partial, tuple, list, dict)


def _not_zero_on_zeros(node: Any, seen: set[int], depth: int = 0) -> tuple[str, str] | None:
    """The element of `_NOT_ZERO_ON_ZEROS` that `node` (an update function, an element)
    runs, if any, as `(name, what it returns on zeros)`.

    Searches the closures of functions and what they hold (elements, tuples, lists,
    dicts, partials) a few levels deep: chains, `optax.masked`, `multi_transform`,
    `inject_hyperparams` and optax's extra-args wrappers keep their elements there.
    """
    if depth > 8 or id(node) in seen:
        return None
    seen.add(id(node))
    if isinstance(node, types.FunctionType):
        if node.__code__ in _not_zero_codes():
            return _not_zero_codes()[node.__code__]
        children = [cell.cell_contents for cell in node.__closure__ or () if _filled(cell)]
    elif isinstance(node, functools.partial):
        children = [node.func, *node.args, *node.keywords.values()]
    elif isinstance(node, tuple | list):
        children = list(node)
    elif isinstance(node, dict):
        children = list(node.values())
    else:
        return None
    for child in children:
        if not isinstance(child, _SEARCHED):
            continue  # numbers, arrays, masks' booleans: no element in them
        found = _not_zero_on_zeros(child, seen, depth + 1)
        if found:
            return found
    return None


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018  # an empty cell raises
    except ValueError:
        return False
    return True


def _after_window(states: list[Any]) -> tuple[Window, int] | None:
    """The first window in a chain's element `states`, and the position after its element."""
    for position, state in enumerate(states):
        windows = [kind.window for kind in _walk(state, LossScaleState) if kind.window]
        if windows:
            return windows[0], position + 1
    return None


def refuse_not_zero_after_window(states: list[Any], functions: list[Any]) -> None:
    """Raises if an element after the first element holding a window is one of
    `_NOT_ZERO_ON_ZEROS` (or runs one).

    `states` and `functions` are a chain's element states and update functions, in
    the order applied.
    """
    after = _after_window(states)
    if after is not None:
        window, position = after
        for function in functions[position:]:
            found = _not_zero_on_zeros(function, set())
            if found:
                raise _not_zero_after_window(window, *found)


def refuse_loss_reader_after_window(
    states: list[Any], functions: list[Any], updates: Any, params: Any
) -> None:
    """Raises if an element after a window reads `value=` (a chain given `value=`).

    A stateful one is refused by `check_state` already; this finds the stateless ones
    (`optax.polyak_sgd`) by what their update reads (`loss_value.update_reads_value`).
    There they read every micro-step's value, and the closing micro-step's beside the
    window's update: never the window's loss. `updates` stands in for the window's update.
    """
    after = _after_window(states)
    if after is None or updates is None:
        return
    window, position = after
    for function, state in zip(functions[position:], states[position:], strict=True):
        if loss_value.update_reads_value(function, state, updates, params):
            raise ValueError(
                f"In the optimizer's chain, an element that reads the loss (value=) comes "
                f"after {window.name}: it receives the value= of every micro-step, and where "
                "the window closes the closing micro-batch's loss beside the window's "
                "update, never the window's loss. Put it inside the window, which gives it "
                "the window's loss: "
                + window.inside.format(element="<the loss reader, e.g. optax.polyak_sgd()>")
                + "."
            )


# --- the updates a window returned ------------------------------------------------------

# The updates returned by a window, by identity: id -> a weak reference that confirms
# the object is still the one marked (an id may be reused after it dies), and the window.
_window_outputs: dict[int, tuple[weakref.ref, Window]] = {}


def mark_window_output(updates: Any, window: Window) -> None:
    """Remembers the leaves `window` returns, weakly (no buffer is kept alive)."""
    for leaf in jax.tree.leaves(updates):
        try:
            _window_outputs[id(leaf)] = (weakref.ref(leaf, _forget(id(leaf))), window)
        except TypeError:  # not weakly referenceable: not marked
            continue


def _forget(key: int) -> Any:
    def callback(ref: weakref.ref) -> None:
        if _window_outputs.get(key, (None,))[0] is ref:
            del _window_outputs[key]

    return callback


def _marking_window(updates: Any) -> Window | None:
    """The window that returned every leaf of `updates`, or `None`."""
    window = None
    for leaf in jax.tree.leaves(updates):
        mark = _window_outputs.get(id(leaf))
        if mark is None or mark[0]() is not leaf:
            return None
        window = mark[1]
    return window


def refuse_window_output(updates: Any, receiver: Window | str) -> None:
    """Raises if `updates` are the very updates a window returned.

    `receiver` is the next element: another window, or how a loss scale is named.
    """
    first = _marking_window(updates)
    if first is None:
        return
    if isinstance(receiver, Window):
        raise _two_windows(first, receiver.name)
    raise _scale_after_window(first.name)
