"""Tests for recurrent weights on clipped_grad's fast path (graph.Origin.shared_at, the
reused rules of norm_rules).

A weight a `lax.scan` reuses in every iteration (closed over, or carried unchanged)
has, per example, the sum of every iteration's gradient. Each model here is checked
against the per-example path in float64, where the comparison sees the rule and not
the order of float32 sums, and its plan must say which way each recurrent leaf took.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gradaccum_jax import privacy

F64 = jnp.float64
N, T, V, D, H = 5, 6, 11, 4, 7  # examples, steps, vocabulary, embedding, hidden


def _normal(rng, *shape, scale=0.5):
    return jnp.asarray(scale * rng.normal(size=shape), F64)


def _tokens(rng):
    ids = jnp.asarray(rng.integers(0, V, (N, T)))
    return ids, jnp.asarray(rng.integers(0, V, (N, T)))


def _cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _rnn_params(rng):
    return {
        "embed": _normal(rng, V, D, scale=1.0),
        "wx": _normal(rng, D, H),
        "wh": _normal(rng, H, H),
        "b": _normal(rng, H),
        "head": _normal(rng, H, V),
    }


def _rnn(reverse=False):
    """h_t = tanh(x_t Wx + h_{t-1} Wh + b), the weights closed over by the scan."""

    def loss(params, batch):
        ids, targets = batch
        x = jnp.swapaxes(params["embed"][ids], 0, 1)

        def step(h, x_t):
            h = jnp.tanh(x_t @ params["wx"] + h @ params["wh"] + params["b"])
            return h, h

        _, hs = jax.lax.scan(step, jnp.zeros((ids.shape[0], H), F64), x, reverse=reverse)
        return _cross_entropy(jnp.swapaxes(hs, 0, 1) @ params["head"], targets)

    def build():
        rng = np.random.default_rng(0)
        return loss, _rnn_params(rng), _tokens(rng)

    return build


def _carried_rnn():
    """The recurrent weight in the carry, passed on unchanged by every iteration."""

    def loss(params, batch):
        ids, targets = batch
        x = jnp.swapaxes(params["embed"][ids], 0, 1)

        def step(carry, x_t):
            h, wh = carry
            h = jnp.tanh(x_t @ params["wx"] + h @ wh + params["b"])
            return (h, wh), h

        init = (jnp.zeros((ids.shape[0], H), F64), params["wh"])
        _, hs = jax.lax.scan(step, init, x)
        return _cross_entropy(jnp.swapaxes(hs, 0, 1) @ params["head"], targets)

    def build():
        rng = np.random.default_rng(1)
        return loss, _rnn_params(rng), _tokens(rng)

    return build


def _layers_over_time():
    """Two recurrent layers stacked under an outer scan: each layer's slice of the
    weights is reused by every step of the inner scan."""

    def loss(params, batch):
        ids, targets = batch
        x = jnp.swapaxes(params["embed"][ids], 0, 1) @ params["wx"]

        def layer(x, wh):
            def step(h, x_t):
                h = jnp.tanh(x_t + h @ wh)
                return h, h

            return jax.lax.scan(step, jnp.zeros((ids.shape[0], H), F64), x)[1], None

        hs = jax.lax.scan(layer, x, params["wh"])[0]
        return _cross_entropy(jnp.swapaxes(hs, 0, 1) @ params["head"], targets)

    def build():
        rng = np.random.default_rng(2)
        params = _rnn_params(rng)
        params["wh"] = _normal(rng, 2, H, H)
        del params["b"]
        return loss, params, _tokens(rng)

    return build


def _reused_outside():
    """The recurrent weight used once more after the scan: its gradient is formed from
    both uses (materialized)."""

    def loss(params, batch):
        ids, targets = batch
        x = jnp.swapaxes(params["embed"][ids], 0, 1)

        def step(h, x_t):
            return jnp.tanh(x_t @ params["wx"] + h @ params["wh"]), None

        h = jax.lax.scan(step, jnp.zeros((ids.shape[0], H), F64), x)[0]
        return _cross_entropy(jnp.tanh(h @ params["wh"]) @ params["head"], targets[:, 0])

    def build():
        rng = np.random.default_rng(3)
        params = _rnn_params(rng)
        del params["b"]
        return loss, params, _tokens(rng)

    return build


def _sums_read_twice():
    """Sums that do not pass a gradient on unchanged: a layer's output added into the
    state and read again (`+ 0.5 z`), and one added to itself (`u + u`, twice the
    gradient). The fast path takes the gradient at each output from its own tap."""

    def loss(params, batch):
        ids, targets = batch
        x = jnp.swapaxes(params["embed"][ids], 0, 1)

        def step(h, x_t):
            z = x_t @ params["wx"]
            h = jnp.tanh(z + h @ params["wh"] + params["b"]) + 0.5 * jnp.tanh(z)
            u = h @ params["wu"]
            return h, u + u

        _, us = jax.lax.scan(step, jnp.zeros((ids.shape[0], H), F64), x)
        return _cross_entropy(jnp.swapaxes(us, 0, 1) @ params["head"], targets)

    def build():
        rng = np.random.default_rng(6)
        params = _rnn_params(rng)
        params["wu"] = _normal(rng, H, H)
        return loss, params, _tokens(rng)

    return build


class LSTMLM(nn.Module):
    dtype: object = F64
    sizes: tuple[int, int, int] = (V, D, H)  # vocabulary, embedding, hidden

    @nn.compact
    def __call__(self, ids):
        vocab, width, hidden = self.sizes
        kw = {"param_dtype": self.dtype, "dtype": self.dtype}
        x = nn.Embed(vocab, width, **kw)(ids)
        h = nn.RNN(nn.LSTMCell(hidden, **kw))(x)
        return nn.Dense(vocab, **kw)(h)


def _lstm():
    def build():
        rng = np.random.default_rng(4)
        ids, targets = _tokens(rng)
        model = LSTMLM()
        params = model.init(jax.random.key(0), ids[:1])
        params = jax.tree.map(lambda p: p + 0.3 * rng.normal(size=p.shape), params)

        def loss(params, batch):
            return _cross_entropy(model.apply(params, batch[0]), batch[1])

        return loss, params, (ids, targets)

    return build


# model -> (builder, {leaf path pattern: method}); every leaf must match one pattern.
MODELS = {
    "rnn": (_rnn(), {"w[xh]|head": "ghost|layer", "'b'": "layer", "embed": "ghost"}),
    "rnn_reversed": (_rnn(reverse=True), {"w[xh]|head|embed": "ghost|layer", "'b'": "layer"}),
    "carried": (_carried_rnn(), {"w[xh]|head|embed": "ghost|layer", "'b'": "layer"}),
    "layers_over_time": (_layers_over_time(), {"w[xh]|head|embed": "ghost|layer"}),
    "reused_outside": (
        _reused_outside(),
        {"wh": "materialized", "wx|head|embed": "ghost|layer"},
    ),
    "lstm": (_lstm(), {"kernel|embedding": "ghost|layer", "bias": "layer"}),
    "sums_read_twice": (_sums_read_twice(), {"w[xhu]|head|embed": "ghost|layer", "'b'": "layer"}),
}


def _max_error(got, want):
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_recurrent_weights_on_the_fast_path_equal_per_example_gradients(model, x64):
    build, methods = MODELS[model]
    with x64():
        loss, params, batch = build()
        padding = np.arange(N) == 2
        norms = jax.jit(privacy.clipped_grad(loss, 1.0, return_grad_norms=True))(params, batch)[2]
        # A clip norm among the examples' norms: some are clipped and some are not.
        clip = float(np.median(np.asarray(norms)))
        fast = privacy.clipped_grad(loss, clip, return_grad_norms=True)
        slow = privacy.clipped_grad(loss, clip, method="per_example", return_grad_norms=True)
        got = jax.jit(fast)(params, batch, is_padding_example=padding)
        want = jax.jit(slow)(params, batch, is_padding_example=padding)
        plan = fast.plan(params, batch)
        got, want = jax.tree.map(np.asarray, (got, want))
    scale = float(np.max(want[2]))
    assert _max_error(got, want) <= 1e-12 * max(scale, 1.0)
    assert float(np.min(want[2][~padding])) < clip < scale
    assert got[2][2] == 0.0  # the padding example's norm
    for leaf in plan:
        matching = [m for pattern, m in methods.items() if re.search(pattern, leaf.path)]
        assert matching, leaf.path
        assert re.fullmatch(matching[0], leaf.method), (leaf.path, leaf.method, str(plan))


def test_the_sum_over_iterations_matches_a_vmap_of_grad(x64):
    """One recurrent weight and no clipping: each example's gradient norm is that of the
    example's own gradient, the sum over every iteration."""
    with x64():
        loss, params, batch = _rnn()()
        _, _, norms = jax.jit(privacy.clipped_grad(loss, 1e9, return_grad_norms=True))(
            params, batch
        )

        def one(ids, targets):
            return jax.grad(loss)(params, (ids[None], targets[None]))

        grads = jax.vmap(one)(*batch)
        want = jnp.sqrt(sum(jnp.sum(g.reshape(N, -1) ** 2, 1) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(np.asarray(norms), np.asarray(want), rtol=1e-12)


def test_the_plan_counts_the_iterations_as_rows(x64):
    with x64():
        loss, params, batch = _rnn()()
        plan = privacy.clipped_grad(loss, 1.0).plan(params, batch)
    (wh,) = [leaf for leaf in plan if leaf.path == "['wh']"]
    assert wh.uses == ("dot_general",)
    assert f"T={T} (1 x {T} iterations)" in wh.why


def test_a_weight_the_carry_changes_takes_the_per_example_path_and_says_why(x64):
    def loss(params, batch):
        ids, targets = batch
        x = jnp.swapaxes(params["embed"][ids], 0, 1)

        def step(carry, x_t):
            h, wh = carry
            return (jnp.tanh(x_t @ params["wx"] + h @ wh), 0.9 * wh), None

        (h, _), _ = jax.lax.scan(step, (jnp.zeros((ids.shape[0], H), F64), params["wh"]), x)
        return _cross_entropy(h @ params["head"], targets[:, 0])

    with x64():
        rng = np.random.default_rng(5)
        params = _rnn_params(rng)
        del params["b"]
        batch = _tokens(rng)
        fast = privacy.clipped_grad(loss, 0.5)
        slow = privacy.clipped_grad(loss, 0.5, method="per_example")
        plan = fast.plan(params, batch)
        got, want = jax.jit(fast)(params, batch), jax.jit(slow)(params, batch)
    (wh,) = [leaf for leaf in plan if leaf.path == "['wh']"]
    assert wh.method == "per_example"
    assert "carried through a scan that changes it" in wh.why
    assert plan.methods["['wx']"] in ("ghost", "layer")
    assert _max_error(got, want) <= 1e-12


@pytest.mark.slow
@pytest.mark.hlo
def test_an_lstms_gates_hand_out_their_inputs_and_gradients_once():
    """The four gates of an LSTM cell read the same `x_t` and `h` and share the gradient
    at their sum (`x W_i + h U_i + b_i`): the fast path keeps each iteration's `x_t`
    and `h` once and one gradient per gate, not one per weight (which held 2.4x the
    non-private step's temp on the benchmark's LSTM LM, against 1.3x)."""
    model = LSTMLM(dtype=jnp.float32, sizes=(256, 64, 128))
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(0, 256, (32, 64)))
    params = model.init(jax.random.key(0), ids[:1])

    def loss(params, batch):
        return _cross_entropy(model.apply(params, batch[0]), batch[1])

    batch = (ids, ids)

    def temp(fn):
        compiled = jax.jit(fn).lower(params, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain, fast = temp(jax.value_and_grad(loss)), temp(privacy.clipped_grad(loss, 1.0))
    assert fast <= 1.6 * plain, (fast, plain)
