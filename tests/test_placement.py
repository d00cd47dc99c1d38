"""Tests of gradaccum_jax._window.placement: a transformation in a place that changes its meaning.

A loss scale after `accumulate`, a second window after it, a schedule of an
`optax.inject_hyperparams` around it (issue 29, items 1 to 3) are refused with an
error that names the right order, at trace time through `tx.update` where the
next element sees `accumulate`'s very output, and from the state's structure in
`apply_gradients` and the helpers that read the state. The right orders still
give the large-batch numbers.
"""

from __future__ import annotations

import ast
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga

PARAMS = {"w": jnp.zeros(2)}
ONES = {"w": jnp.ones(2)}
SCALE_FIRST = r"Put the loss scale first.*optax\.chain\(ga\.dynamic_loss_scale\(\), ga\.accumulate"
TWO_WINDOWS = r"Two windows in a row"
SCHEDULE_INSIDE = r"inject_hyperparams evaluates its schedules \(learning_rate\).*ga\.accumulate\("


def _acc(k=2, lr=1.0):
    return ga.accumulate(optax.sgd(lr), k)


def _optax_steps(tx, grads, n):
    """`n` jitted `tx.update` + `apply_updates` steps from PARAMS."""
    params, state = PARAMS, tx.init(PARAMS)
    update = jax.jit(tx.update)
    for _ in range(n):
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _fused_steps(tx, grads, n):
    params, state = PARAMS, tx.init(PARAMS)
    step = jax.jit(lambda p, s, g: ga.apply_gradients(tx, g, s, p))
    for _ in range(n):
        params, state = step(params, state, grads)
    return params, state


# ---------------------------------------------------------------------------
# Item 1: a loss scale after accumulate.

SCALE_AFTER = {
    "chain_dynamic": lambda: optax.chain(_acc(), ga.dynamic_loss_scale()),
    "chain_static": lambda: optax.chain(_acc(), ga.static_loss_scale(8.0)),
    "nested_chain": lambda: optax.chain(
        optax.chain(optax.identity(), _acc()), ga.dynamic_loss_scale()
    ),
    "named_chain": lambda: optax.named_chain(
        ("z_acc", _acc()), ("a_scale", ga.static_loss_scale(8.0))
    ),
    "scale_in_a_later_chain": lambda: optax.chain(_acc(), optax.chain(ga.dynamic_loss_scale())),
    "injected_accumulate": lambda: optax.chain(
        optax.inject_hyperparams(lambda learning_rate: ga.accumulate(optax.sgd(learning_rate), 2))(
            learning_rate=1.0
        ),
        ga.dynamic_loss_scale(),
    ),
}
# The same shapes behind a wrapper whose output is not accumulate's own: only the state shows it.
SCALE_AFTER_WRAPPED = {
    "masked_accumulate": lambda: optax.chain(
        optax.masked(_acc(), {"w": True}), optax.identity(), ga.dynamic_loss_scale()
    ),
    "transform_between": lambda: optax.chain(_acc(), optax.scale(1.0), ga.static_loss_scale(8.0)),
}


@pytest.mark.parametrize("name", sorted(SCALE_AFTER))
def test_loss_scale_after_accumulate_is_refused_by_update(name):
    tx = SCALE_AFTER[name]()
    with pytest.raises(ValueError, match=SCALE_FIRST):
        _optax_steps(tx, ONES, 1)


@pytest.mark.parametrize("name", sorted(SCALE_AFTER) + sorted(SCALE_AFTER_WRAPPED))
def test_loss_scale_after_accumulate_is_refused_by_the_state_readers(name):
    tx = {**SCALE_AFTER, **SCALE_AFTER_WRAPPED}[name]()
    state = tx.init(PARAMS)
    for read in (ga.current_loss_scale, ga.optimizer_step, ga.has_updated):
        with pytest.raises(ValueError, match=SCALE_FIRST):
            read(state)
    with pytest.raises(ValueError, match=SCALE_FIRST):
        ga.scaled_value_and_grad(lambda w: jnp.sum(w["w"] ** 2))(state, PARAMS)
    with pytest.raises(ValueError, match=SCALE_FIRST):
        _fused_steps(tx, ONES, 1)


def test_loss_scale_before_accumulate_gives_the_unscaled_clipped_step():
    # The example in the right order: the clip inside sees unscaled gradients.
    inner = optax.chain(optax.clip_by_global_norm(10.0), optax.sgd(1.0))
    params = {"w": jnp.zeros(1)}
    for tx in (
        optax.chain(ga.dynamic_loss_scale(), ga.accumulate(inner, 2)),
        optax.named_chain(("scale", ga.dynamic_loss_scale()), ("acc", ga.accumulate(inner, 2))),
    ):
        new, state = params, tx.init(params)
        for _ in range(2):
            scaled = {"w": jnp.ones(1) * ga.current_loss_scale(state)}
            new, state = ga.apply_gradients(tx, scaled, state, new)
        np.testing.assert_array_equal(new["w"], [-1.0])


def test_loss_scale_after_accumulate_in_parallel_parts_is_not_refused():
    # multi_transform's parts are side by side: a scale in one and a window in the other
    # are not in a row.
    tx = optax.multi_transform(
        {"a": optax.chain(ga.static_loss_scale(4.0), _acc()), "b": optax.sgd(1.0)},
        {"u": "a", "v": "b"},
    )
    params = {"u": jnp.zeros(2), "v": jnp.zeros(2)}
    state = tx.init(params)
    assert float(ga.current_loss_scale(state)) == 4.0
    new, state = ga.apply_gradients(tx, {"u": jnp.full(2, 4.0), "v": jnp.ones(2)}, state, params)
    np.testing.assert_array_equal(new["v"], [-1.0, -1.0])


# ---------------------------------------------------------------------------
# Item 2: a schedule of an inject_hyperparams around accumulate.


def _outer(hyper):
    return optax.inject_hyperparams(
        lambda learning_rate: ga.accumulate(optax.sgd(learning_rate), 4)
    )(learning_rate=hyper)


def test_schedule_of_an_outer_inject_hyperparams_is_refused():
    tx = _outer(optax.linear_schedule(1.0, 0.0, 4))
    with pytest.raises(ValueError, match=SCHEDULE_INSIDE):
        _fused_steps(tx, ONES, 1)
    with pytest.raises(ValueError, match=SCHEDULE_INSIDE):
        _optax_steps(tx, ONES, 1)  # tx.update: accumulate's update sees the frame around it
    state = tx.init(PARAMS)
    for read in (ga.optimizer_step, ga.closes_window, ga.has_updated):
        with pytest.raises(ValueError, match=SCHEDULE_INSIDE):
            read(state)
    # Through a chain, too.
    with pytest.raises(ValueError, match=SCHEDULE_INSIDE):
        ga.optimizer_step(optax.chain(optax.identity(), tx).init(PARAMS))


def test_schedule_inside_accumulate_advances_once_per_window():
    # The fix the error names: two windows of K = 4 read the schedule at 0 and 1.
    schedule = optax.linear_schedule(1.0, 0.0, 4)
    for tx in (
        ga.accumulate(optax.sgd(schedule), 4),
        ga.accumulate(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), 4),
    ):
        params, _ = _fused_steps(tx, ONES, 8)
        np.testing.assert_allclose(params["w"], [-1.75, -1.75], rtol=1e-6)


def test_constant_hyperparameter_of_an_outer_inject_hyperparams_still_fuses():
    tx = _outer(0.5)
    fused, state = _fused_steps(tx, ONES, 4)
    plain, _ = _optax_steps(tx, ONES, 4)
    np.testing.assert_array_equal(fused["w"], [-0.5, -0.5])
    np.testing.assert_array_equal(fused["w"], plain["w"])
    assert int(ga.optimizer_step(state)) == 1


# ---------------------------------------------------------------------------
# Item 3: two windows in a row.

TWO_ACCUMULATES = {
    "chain": lambda: optax.chain(_acc(), _acc()),
    "named_chain": lambda: optax.named_chain(("b", _acc()), ("a", _acc())),
    "nested": lambda: optax.chain(optax.chain(optax.clip(5.0), _acc()), optax.chain(_acc())),
}
WINDOW_AFTER = {
    **TWO_ACCUMULATES,
    "apply_every": lambda: optax.chain(_acc(), optax.apply_every(2)),
    "named_apply_every": lambda: optax.named_chain(
        ("acc", _acc()), ("every", optax.apply_every(2))
    ),
    "multisteps": lambda: optax.chain(
        _acc(), optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation()
    ),
    "masked_then_apply_every": lambda: optax.chain(
        optax.masked(_acc(), {"w": True}), optax.apply_every(2)
    ),
}


@pytest.mark.parametrize("name", sorted(TWO_ACCUMULATES))
def test_accumulate_after_accumulate_is_refused_by_update(name):
    with pytest.raises(ValueError, match=TWO_WINDOWS + r".*ga\.accumulate\(optax\.chain"):
        _optax_steps(TWO_ACCUMULATES[name](), ONES, 1)


@pytest.mark.parametrize("name", sorted(WINDOW_AFTER))
def test_window_after_accumulate_is_refused_by_apply_gradients_and_the_readers(name):
    tx = WINDOW_AFTER[name]()
    with pytest.raises(ValueError, match=TWO_WINDOWS):
        _fused_steps(tx, ONES, 1)
    with pytest.raises(ValueError, match=TWO_WINDOWS):
        ga.optimizer_step(tx.init(PARAMS))


@pytest.mark.parametrize("name", sorted(WINDOW_AFTER))
def test_any_window_after_accumulate_is_refused_by_update(name):
    # Issue 40, item 8: the chain's frame shows optax's windows too (apply_every, MultiSteps).
    with pytest.raises(ValueError, match=TWO_WINDOWS):
        _optax_steps(WINDOW_AFTER[name](), ONES, 1)


def test_apply_every_after_accumulate_names_the_longer_window():
    tx = optax.chain(_acc(), optax.apply_every(2))
    with pytest.raises(ValueError, match=r"ga\.accumulate\(inner, K \* N\)"):
        ga.closes_window(tx.init(PARAMS))


def test_one_window_and_parallel_windows_are_not_refused():
    # A window of windows inside accumulate, and windows side by side, are not in a row.
    nested = ga.accumulate(optax.chain(ga.accumulate(optax.sgd(1.0), 2), optax.identity()), 2)
    params, _ = _optax_steps(nested, ONES, 4)  # the inner window closes after 2 outer ones
    np.testing.assert_array_equal(params["w"], [-1.0, -1.0])
    tx = optax.multi_transform({"a": _acc(), "b": _acc(4)}, {"u": "a", "v": "b"})
    params = {"u": jnp.zeros(1), "v": jnp.zeros(1)}
    state = tx.init(params)
    for _ in range(4):
        params, state = ga.apply_gradients(tx, {"u": jnp.ones(1), "v": jnp.ones(1)}, state, params)
    np.testing.assert_array_equal(params["u"], [-2.0])
    np.testing.assert_array_equal(params["v"], [-1.0])


# ---------------------------------------------------------------------------
# Item 8: accumulate under optax.inject_hyperparams names every static argument.


@pytest.mark.parametrize("every_k", [4, lambda step: jnp.int32(4)])
def test_inject_hyperparams_of_accumulate_names_every_static_argument(every_k):
    injected = optax.inject_hyperparams(ga.accumulate)(optax.sgd(1.0), every_k_schedule=every_k)
    with pytest.raises(TypeError, match=r"static_args=\(") as info:
        injected.init(PARAMS)
    message = str(info.value)
    static = ast.literal_eval(message.split("static_args=")[1].split(")")[0] + ")")
    assert static == ("every_k_schedule", "noise_scale_decay", "micro_batch_size")
    tx = optax.inject_hyperparams(ga.accumulate, static_args=static)(
        optax.sgd(1.0), every_k_schedule=every_k
    )
    params, state = _fused_steps(tx, ONES, 4)
    np.testing.assert_array_equal(params["w"], [-1.0, -1.0])
    assert int(ga.optimizer_step(state)) == 1


# ---------------------------------------------------------------------------
# Issue 34, item 3: a stateful element after the window.

SCHEDULE = optax.linear_schedule(1.0, 0.0, 10)
STATE_INSIDE = r"ga\.accumulate\(optax\.chain\(\.\.\., {}\), K\)"
STATEFUL_AFTER = {
    "scale_by_schedule": (
        lambda: optax.scale_by_schedule(SCHEDULE),
        r"optax\.scale_by_schedule\(\.\.\.\)",
    ),
    "scale_by_learning_rate": (
        lambda: optax.scale_by_learning_rate(SCHEDULE),
        r"optax\.scale_by_schedule\(\.\.\.\)",
    ),
    "injected_schedule": (
        lambda: optax.inject_hyperparams(optax.scale)(step_size=SCHEDULE),
        r"optax\.inject_hyperparams\(\.\.\.\)\(step_size=schedule\)",
    ),
    "adam": (lambda: optax.adam(1.0), r"optax\.scale_by_adam\(\.\.\.\)"),
    "masked_ema": (
        lambda: optax.masked(optax.ema(0.9), {"w": True}),
        r"optax\.ema\(\.\.\.\)",
    ),
    "injected_constant_around_momentum": (
        lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.5, momentum=0.9),
        r"optax\.trace\(\.\.\.\)",
    ),
}


def _scalar_steps(tx, n, step=None):
    """`n` steps from w = 1 with gradient 0.5 (the issue's example), by `step`."""
    params, state = {"w": jnp.ones(())}, tx.init({"w": jnp.ones(())})
    step = step or jax.jit(lambda p, s, g: ga.apply_gradients(tx, g, s, p))
    for _ in range(n):
        params, state = step(params, state, {"w": jnp.full((), 0.5)})
    return params["w"]


@pytest.mark.parametrize("name", sorted(STATEFUL_AFTER))
def test_stateful_element_after_accumulate_is_refused_naming_the_place_inside(name):
    after, element = STATEFUL_AFTER[name]
    inside = STATE_INSIDE.format(element)
    for tx in (
        optax.chain(_acc(4), after()),
        optax.named_chain(("acc", _acc(4)), ("after", after())),
        optax.chain(optax.chain(optax.clip(5.0), _acc(4)), optax.identity(), after()),
    ):
        with pytest.raises(ValueError, match=element + r" comes after gradaccum_jax\.accumulate"):
            _scalar_steps(tx, 8)
        state = tx.init(PARAMS)
        for read in (ga.optimizer_step, ga.closes_window, ga.has_updated):
            with pytest.raises(ValueError, match=inside):
                read(state)


@pytest.mark.parametrize("name", sorted(STATEFUL_AFTER))
def test_stateful_element_after_accumulate_is_refused_by_update(name):
    after, element = STATEFUL_AFTER[name]
    tx = optax.chain(_acc(4), after())
    with pytest.raises(
        ValueError, match=element + r" comes after.*" + STATE_INSIDE.format(element)
    ):
        _scalar_steps(tx, 1, step=jax.jit(_optax_step(tx)))


def _optax_step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def test_schedule_after_accumulate_is_refused_and_inside_gives_the_large_batch_step():
    # The example: after the window the schedule advanced per micro-step (w = 0.50);
    # inside it advances once per window: 1 - 0.5 * 1.0 - 0.5 * 0.9.
    after = optax.chain(_acc(4), optax.scale_by_schedule(SCHEDULE))
    with pytest.raises(ValueError, match=r"a schedule there advances K times per window"):
        _scalar_steps(after, 8)
    inside = ga.accumulate(optax.chain(optax.sgd(1.0), optax.scale_by_schedule(SCHEDULE)), 4)
    np.testing.assert_allclose(_scalar_steps(inside, 8), 0.05, rtol=1e-6)


def test_stateful_element_after_accumulate_is_refused_by_the_flax_containers():
    from flax import nnx

    from gradaccum_jax.flax import Optimizer, TrainState

    tx = optax.chain(_acc(4), optax.scale_by_schedule(SCHEDULE))
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    with pytest.raises(
        ValueError, match=STATE_INSIDE.format(r"optax\.scale_by_schedule\(\.\.\.\)")
    ):
        state.apply_gradients(grads={"w": jnp.ones(2)})
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = Optimizer(model, tx, wrt=nnx.Param)
    grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
    with pytest.raises(ValueError, match=r"optax\.scale_by_schedule\(\.\.\.\) comes after"):
        optimizer.update(model, grads)
    with pytest.raises(ValueError, match=r"optax\.scale_by_schedule\(\.\.\.\) comes after"):
        _ = optimizer.optimizer_step


# Each window's update is -0.5 (sgd(1.0) on 0.5), then the element: w after two windows.
STATELESS_AFTER = {
    "scale": (lambda: optax.scale(0.5), 0.5),
    "sgd": (lambda: optax.sgd(0.5), 1.5),
    "clip_by_global_norm": (lambda: optax.clip_by_global_norm(0.25), 0.5),
    "injected_constant": (lambda: optax.inject_hyperparams(optax.scale)(step_size=0.5), 0.5),
    "masked_scale": (lambda: optax.masked(optax.scale(0.5), {"w": True}), 0.5),
}


@pytest.mark.parametrize("name", sorted(STATELESS_AFTER))
def test_stateless_element_after_accumulate_is_not_refused(name):
    after, expected = STATELESS_AFTER[name]
    tx = optax.chain(_acc(4), after())
    np.testing.assert_allclose(_scalar_steps(tx, 8), expected, rtol=1e-6)
    assert int(ga.optimizer_step(tx.init(PARAMS))) == 0


OTHER_WINDOWS_THEN_STATE = {
    "conditional_accumulate": (
        lambda: ga.conditional_accumulate(optax.sgd(1.0), 2),
        r"ga\.conditional_accumulate\(optax\.chain\(\.\.\., optax\.scale_by_adam\(\.\.\.\)\), "
        r"num_required\)",
    ),
    "split_accumulate": (
        lambda: ga.split_accumulate(2),
        r"optax\.scale_by_adam\(\.\.\.\) before split_accumulate",
    ),
    "apply_every": (lambda: optax.apply_every(2), STATE_INSIDE.format(r"optax\.scale_by_adam.*")),
    "multisteps": (
        lambda: optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation(),
        STATE_INSIDE.format(r"optax\.scale_by_adam.*"),
    ),
}


@pytest.mark.parametrize("name", sorted(OTHER_WINDOWS_THEN_STATE))
def test_stateful_element_after_any_window_is_refused(name):
    window, fix = OTHER_WINDOWS_THEN_STATE[name]
    tx = optax.chain(window(), optax.adam(1.0))
    with pytest.raises(ValueError, match=r"keeps state.*" + fix):
        ga.apply_gradients(tx, ONES, tx.init(PARAMS), PARAMS, local_step=0)
    # Before the window it runs on every micro-gradient, as meant: not refused.
    ga.optimizer_step(optax.chain(optax.adam(1.0), _acc()).init(PARAMS))


def test_state_side_by_side_with_a_window_is_not_refused_but_after_it_is():
    parts = {"u": "a", "v": "b"}
    params = {"u": jnp.zeros(1), "v": jnp.zeros(1)}
    beside = optax.multi_transform({"a": _acc(), "b": optax.adam(1.0)}, parts)
    state = beside.init(params)
    for _ in range(2):
        params, state = ga.apply_gradients(
            beside, {"u": jnp.ones(1), "v": jnp.ones(1)}, state, params
        )
    np.testing.assert_array_equal(params["u"], [-1.0])
    after = optax.chain(
        optax.multi_transform({"a": _acc(), "b": optax.sgd(1.0)}, parts), optax.ema(0.9)
    )
    with pytest.raises(
        ValueError, match=r"optax\.ema\(\.\.\.\) comes after gradaccum_jax\.accumulate"
    ):
        ga.optimizer_step(after.init(params))


class _OutsideWindowState(NamedTuple):
    count: jax.Array


def test_a_window_registered_from_above_gets_the_same_checks():
    # How a window defined in a package above _window (a privacy window, say) joins in.
    from gradaccum_jax._window import placement

    placement.register_window(
        _OutsideWindowState,
        placement.Window("outside_window", "outside_window(optax.chain(..., {element}), K)"),
    )
    outside = _OutsideWindowState(jnp.zeros((), jnp.int32))
    adam = optax.adam(1.0).init(PARAMS)
    fix = r"outside_window\(optax\.chain\(\.\.\., optax\.scale_by_adam\(\.\.\.\)\), K\)"
    with pytest.raises(ValueError, match=r"comes after outside_window.*" + fix):
        placement.check_state((outside, adam))
    with pytest.raises(ValueError, match=TWO_WINDOWS):
        ga.optimizer_step((outside, _acc().init(PARAMS)))
    placement.check_state((adam, outside))  # before the window: per micro-step, as meant


# ---------------------------------------------------------------------------
# Issue 40, item 9: an element after the window that does not map zeros to zeros.

DECAY = r"optax\.add_decayed_weights\(\.\.\.\)"
NONNEGATIVE = r"optax\.keep_params_nonnegative\(\)"
NOT_ZERO_AFTER = {
    "add_decayed_weights": (lambda: optax.add_decayed_weights(0.1), DECAY),
    "add_decayed_weights_mask": (lambda: optax.add_decayed_weights(0.1, mask={"w": True}), DECAY),
    "keep_params_nonnegative": (optax.keep_params_nonnegative, NONNEGATIVE),
    "masked_nonnegative": (
        lambda: optax.masked(optax.keep_params_nonnegative(), {"w": True}),
        NONNEGATIVE,
    ),
    "injected_decay": (
        lambda: optax.inject_hyperparams(optax.add_decayed_weights)(weight_decay=0.1),
        DECAY,
    ),
    "fromage": (lambda: optax.fromage(0.1), DECAY),  # decays inside its own chain
    "multi_transform_decay": (
        lambda: optax.multi_transform({"d": optax.add_decayed_weights(0.1)}, {"w": "d"}),
        DECAY,
    ),
    "contrib_normalize": (optax.contrib.normalize, r"optax\.contrib\.normalize\(\)"),
}


def _nnx_update(tx, optimizer_type):
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = optimizer_type(model, tx, wrt=nnx.Param)
    optimizer.update(model, nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model))


def _train_state_update(tx):
    from gradaccum_jax.flax import TrainState

    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    state.apply_gradients(grads={"w": jnp.ones(2)})


@pytest.mark.parametrize("name", sorted(NOT_ZERO_AFTER))
def test_element_not_zero_on_zeros_after_accumulate_is_refused_naming_the_place_inside(name):
    after, element = NOT_ZERO_AFTER[name]
    message = element + r" comes after gradaccum_jax\.accumulate and does not map zero updates"
    inside = STATE_INSIDE.format(element)
    for tx in (
        optax.chain(_acc(4), after()),
        optax.named_chain(("acc", _acc(4)), ("after", after())),
        optax.chain(optax.chain(optax.clip(5.0), _acc(4)), optax.scale(1.0), after()),
    ):
        with pytest.raises(ValueError, match=message + ".*" + inside):
            _scalar_steps(tx, 1, step=jax.jit(_optax_step(tx)))  # tx.update
        with pytest.raises(ValueError, match=message):
            _scalar_steps(tx, 1)  # apply_gradients
    with pytest.raises(ValueError, match=message):
        _train_state_update(optax.chain(_acc(4), after()))
    # Its state is empty, as optax.scale's: the state readers cannot tell (accumulate.md).
    assert int(ga.optimizer_step(optax.chain(_acc(4), after()).init(PARAMS))) == 0


def test_weight_decay_after_accumulate_is_refused_by_the_nnx_optimizers():
    from flax import nnx

    from gradaccum_jax.flax import Optimizer

    message = DECAY + r" comes after gradaccum_jax\.accumulate.*" + STATE_INSIDE.format(DECAY)
    for optimizer_type in (Optimizer, nnx.Optimizer):  # ours, and Flax's own tx.update
        with pytest.raises(ValueError, match=message):
            _nnx_update(optax.chain(_acc(4), optax.add_decayed_weights(0.1)), optimizer_type)


def test_element_not_zero_on_zeros_after_other_windows_is_refused():
    decay = optax.add_decayed_weights(0.1)
    conditional = optax.chain(ga.conditional_accumulate(optax.sgd(1.0), 2), decay)
    with pytest.raises(ValueError, match=DECAY + r" comes after gradaccum_jax\.conditional"):
        ga.apply_gradients(conditional, ONES, conditional.init(PARAMS), PARAMS, local_step=0)
    split = optax.chain(ga.split_accumulate(2), decay)
    with pytest.raises(ValueError, match=DECAY + r" comes after gradaccum_jax\.split_accumulate"):
        jax.jit(split.update)(ONES, split.init(PARAMS), PARAMS)
    # Before a window it acts on every micro-gradient, which is what the chain says: allowed.
    before = optax.chain(decay, _acc(2))
    jax.jit(before.update)(ONES, before.init(PARAMS), PARAMS)


def test_weight_decay_inside_the_window_moves_the_params_once_per_window():
    # The example: w = 1, gradient 0.5, decay 0.1, K = 4. After the window the
    # params moved on micro-steps 1-3 (0.1, 0.11, 0.121 of decay); inside, only at the
    # close, by one large-batch step of chain(decay, sgd) on the window's mean gradient.
    k, lr, wd = 4, 0.5, 0.1
    grads = [jnp.full((), g) for g in (0.5, 0.25, -1.0, 2.0, 1.0, 0.0, 0.5, 0.75)]
    tx = ga.accumulate(optax.chain(optax.add_decayed_weights(wd), optax.sgd(lr)), k)
    for step in (
        jax.jit(lambda p, s, g: ga.apply_gradients(tx, g, s, p)),
        jax.jit(_optax_step(tx)),
    ):
        params, state = {"w": jnp.ones(())}, tx.init({"w": jnp.ones(())})
        want = 1.0
        for i, g in enumerate(grads):
            before = params["w"]
            params, state = step(params, state, {"w": g})
            if (i + 1) % k:
                assert params["w"] == before  # a micro-step: nothing moves
            else:
                mean = float(np.mean([float(x) for x in grads[i + 1 - k : i + 1]]))
                want = want - lr * (mean + wd * want)
                np.testing.assert_allclose(params["w"], want, rtol=1e-6)


def _probe_arguments(function, numeric_defaults):
    """0.5 for every required argument (and numeric default, if asked): None if unsure."""
    import inspect

    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    arguments = {}
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        default = parameter.default
        numeric = isinstance(default, int | float) and not isinstance(default, bool)
        if default is parameter.empty or (numeric_defaults and numeric):
            arguments[parameter.name] = 0.5
    return arguments


def _stateless_elements():
    """Every element of optax's namespaces (and ours) that builds with numbers for its
    arguments and holds no state: name -> element, twice where a numeric default such as
    add_decayed_weights' weight_decay=0.0 hides what it does."""
    import inspect
    import warnings

    params = {"w": jnp.ones(2)}
    found = {}
    for module in (optax, optax.contrib, optax.transforms, ga):
        names = getattr(module, "__all__", None) or [n for n in dir(module) if n[0] != "_"]
        for name in sorted(names):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated names
                function = getattr(module, name)
            if inspect.isclass(function) or not callable(function):
                continue
            for numeric_defaults in (False, True):
                arguments = _probe_arguments(function, numeric_defaults)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        element = function(**arguments)
                        if not isinstance(element, optax.GradientTransformation):
                            break
                        if jax.tree.leaves(element.init(params)):
                            break  # stateful: refused from the state (above)
                except Exception:  # needs a schedule, a function, a transformation...
                    continue
                found[f"{module.__name__}.{name}{'(0.5, ...)' if numeric_defaults else ''}"] = (
                    element
                )
    return found


def test_every_stateless_element_after_a_window_either_keeps_the_zeros_or_is_refused():
    # The list of elements that do not map zeros to zeros is checked complete here: each
    # stateless element of optax and gradaccum_jax runs on zero updates with params of both
    # signs; what returns non-zeros must be refused after a window, and the rest must
    # pass the window's zeros through unchanged (and not be refused).
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.array([-1.0, 2.0])}
    zeros = jax.tree.map(jnp.zeros_like, params)
    refused, kept = set(), set()
    # Each call jitted: one program per element and step (eagerly, one per operation: 336
    # programs and 23 s of a CI worker), under jit as a user's step takes them.
    for name, element in _stateless_elements().items():
        try:
            on_zeros, _ = jax.jit(element.update)(zeros, element.init(params), params)
        except Exception:  # needs extra arguments (value=...)
            continue
        not_zero = any(bool(jnp.any(x != 0)) for x in jax.tree.leaves(on_zeros))
        if name.startswith("gradaccum_jax.clamp_params"):
            # A projection into its box, the documented last element after split_accumulate
            # (which has no inner transformation to hold it): it moves only params outside
            # the box, once, and keeps the zeros of params inside it.
            assert not_zero
            continue
        if name.endswith("add_decayed_weights"):
            # Its default weight_decay=0.0 keeps the zeros; refused by its code all the same.
            assert not not_zero
            continue
        tx = optax.chain(_acc(4), element)
        if not_zero:
            with pytest.raises(ValueError, match="does not map zero updates to zero"):
                jax.jit(tx.update)(zeros, tx.init(params), params)
            refused.add(name)
        else:
            updates, _ = jax.jit(tx.update)(params, tx.init(params), params)  # a micro-step
            assert all(not bool(jnp.any(x != 0)) for x in jax.tree.leaves(updates)), name
            kept.add(name)
    assert {
        "optax.add_decayed_weights(0.5, ...)",
        "optax.keep_params_nonnegative",
        "optax.fromage",
        "optax.contrib.normalize",
    } <= refused
    assert {"optax.scale", "optax.clip_by_global_norm", "optax.scale_by_trust_ratio"} <= kept
    assert len(kept) >= 15
