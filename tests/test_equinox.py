"""Equinox models through the library's doors: AGC's units, apply_gradients, micro-batching.

Equinox layers hold weights output axis first (`eqx.nn.Linear` `(out, in)`, `eqx.nn.Conv`
`(out, in, *kernel)`), the opposite of Flax; a module's leaves include what is not an array
(its activation functions). Each test holds the library to the paper's per-output AGC units,
to `eqx.filter_value_and_grad` / `eqx.apply_updates`, or to the large batch.
"""

import subprocess
import sys

import _equivalence as E
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax._base import compat
from gradaccum_jax._clipping import agc as _agc

K = 4
CLIP = 0.05
# float32 sums of 4 micro-batch gradients against one large-batch gradient.
RTOL, ATOL = 1e-5, 1e-6


class Block(eqx.Module):
    """A pre-norm transformer block: attention and an MLP, each with a residual."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, d, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(2, d, key=k1)
        self.norm2 = eqx.nn.LayerNorm(d)
        self.mlp = eqx.nn.MLP(d, d, 2 * d, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Raw(eqx.Module):
    """A module of one's own holding a matrix: its layout cannot be read."""

    weight: jax.Array


@eqx.filter_jit  # one program, where building the block eagerly takes many
def _block_and_batch():
    model = Block(8, jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(kx, (8, 5, 8)), "y": jax.random.normal(ky, (8, 5, 8))}
    return model, batch


def _loss(model, batch):
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


def _micro(batch, i):
    """Micro-batch `i` (traced) of `K`, strided: examples i, i + K, ... (the library's split)."""
    return jax.tree.map(lambda x: x.reshape(-1, K, *x.shape[1:])[:, i], batch)


@eqx.filter_jit
def _large_batch_step(inner, model, batch):
    """One step of the optax transformation `inner` on the whole batch."""
    grads = eqx.filter_grad(_loss)(model, batch)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, _ = inner.update(grads, inner.init(params), params)
    return eqx.apply_updates(model, updates)


def _close(a, b, rtol=RTOL, atol=ATOL):
    a, b = eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def _per_output_agc(g, w, whole=False, clipping=CLIP, eps=1e-3):
    """AGC per output unit (Brock et al.), output axis first, in float64 numpy; `whole`: the
    leaf is one unit (a bias)."""
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    axes = tuple(range(1, g.ndim)) if g.ndim >= 2 and not whole else tuple(range(g.ndim))
    g_norm = np.sqrt(np.sum(g * g, axis=axes, keepdims=True))
    bound = clipping * np.maximum(np.sqrt(np.sum(w * w, axis=axes, keepdims=True)), eps)
    return np.where(g_norm > bound, g * bound / np.where(g_norm > 0, g_norm, 1), g)


@jax.jit
def _grads_like(params, key):
    """Gradients whose output units differ in size, so that some and not others are clipped."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        treedef,
        [
            jax.random.normal(k, p.shape)
            * jnp.arange(1, p.shape[0] + 1).reshape((-1,) + (1,) * (p.ndim - 1))
            if p.ndim
            else jax.random.normal(k, p.shape)
            for k, p in zip(keys, leaves, strict=True)
        ],
    )


def _clip(tx, grads, params):
    """`tx.update` on fresh state, jitted."""
    return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)


def _leaves(grads, params, out):
    return jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(params), jax.tree.leaves(out)


def _is_bias(path):
    return path[-1] == jax.tree_util.GetAttrKey("bias")


@pytest.fixture(scope="module")
def agc_layers():
    """One of each Equinox layout AGC must read, with gradients to clip."""

    @eqx.filter_jit  # one program, where building the layers eagerly takes many
    def build(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {
            "head": eqx.nn.Linear(16, 6, key=k1),
            "conv": eqx.nn.Conv2d(3, 5, 3, key=k2),
            "attn": eqx.nn.MultiheadAttention(2, 8, key=k3),
        }

    model = build(jax.random.key(2))
    params = eqx.filter(model, eqx.is_inexact_array)
    return model, params, _grads_like(params, jax.random.key(3))


def test_agc_default_units_are_per_output_on_equinox_layers(agc_layers):
    """Each unit is one output feature, reducing over the input axes (was: an input column,
    silently, with output units left past their bound)."""
    _, params, grads = agc_layers
    out = _clip(ga.adaptive_grad_clip(CLIP), grads, params)
    clipped = 0
    for (path, g), w, o in zip(*_leaves(grads, params, out), strict=True):
        want = _per_output_agc(g, w, _is_bias(path))
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-7)
        clipped += int(np.sum(np.abs(want - np.asarray(g)) > 0))
    assert clipped  # the case clips something


def test_agc_default_units_through_accumulate_and_the_whole_model(agc_layers):
    """Inside `accumulate`, with the whole model (activations included) as params: the same
    per-output units."""
    model, params, grads = agc_layers
    tx = ga.accumulate(ga.adaptive_grad_clip(CLIP), 2)

    @eqx.filter_jit
    def two_steps(grads, state, model):
        _, state = tx.update(grads, state, model)
        return tx.update(grads, state, model)[0]

    out = two_steps(grads, eqx.filter_jit(tx.init)(params), model)
    for (path, g), w, o in zip(*_leaves(grads, params, out), strict=True):
        np.testing.assert_allclose(o, _per_output_agc(g, w, _is_bias(path)), rtol=1e-5, atol=1e-7)


def test_agc_units_of_each_equinox_layer():
    """The axes each unit spans (the norms reduce over), read at trace time from the layer."""

    class MyLinear(eqx.nn.Linear):
        pass

    def build(key):
        ks = jax.random.split(key, 8)
        return {
            "linear": eqx.nn.Linear(4, 3, key=ks[0]),
            "subclass": MyLinear(4, 3, key=ks[1]),
            "conv1d": eqx.nn.Conv1d(2, 3, 5, key=ks[2]),
            "deconv": eqx.nn.ConvTranspose2d(2, 3, 3, key=ks[3]),
            "gru": eqx.nn.GRUCell(3, 5, key=ks[4]),
            "embedding": eqx.nn.Embedding(10, 4, key=ks[5]),
            "norm": eqx.nn.LayerNorm(4),
            "weight_norm": eqx.nn.WeightNorm(eqx.nn.Linear(4, 3, key=ks[6])),
            "mlp": eqx.nn.MLP(4, 2, 8, 1, key=ks[7]),
        }

    shapes = eqx.filter_eval_shape(build, jax.random.key(0))  # no program: shapes only
    params = eqx.filter(shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    got = {
        jax.tree_util.keystr(path): axes
        for (path, _), axes in zip(
            jax.tree_util.tree_leaves_with_path(params), _agc._leaf_axes(None, params), strict=True
        )
    }
    assert got == {
        "['conv1d'].weight": (1, 2),  # (out, in, W)
        "['conv1d'].bias": (0, 1),  # (out, 1): a bias is one unit
        "['deconv'].weight": (1, 2, 3),
        "['deconv'].bias": (0, 1, 2),
        "['embedding'].weight": (1,),  # (vocab, size): one unit per token
        "['gru'].weight_ih": (1,),
        "['gru'].weight_hh": (1,),
        "['gru'].bias": (0,),
        "['gru'].bias_n": (0,),
        "['linear'].weight": (1,),
        "['linear'].bias": (0,),
        "['mlp'].layers[0].weight": (1,),
        "['mlp'].layers[0].bias": (0,),
        "['mlp'].layers[1].weight": (1,),
        "['mlp'].layers[1].bias": (0,),
        "['norm'].weight": (0,),
        "['norm'].bias": (0,),
        "['subclass'].weight": (1,),
        "['subclass'].bias": (0,),
        "['weight_norm'].layer.weight": (1,),
        "['weight_norm'].layer.bias": (0,),
        "['weight_norm'].g": (1,),  # (out, 1): one unit per output
    }


@pytest.mark.parametrize("rule", ["flax", "optax"])
def test_agc_flax_layout_rules_on_equinox_layers_are_refused(agc_layers, rule):
    _, params, grads = agc_layers
    tx = ga.adaptive_grad_clip(CLIP, unit_axes=rule)
    refused = r"unit_axes='(flax|optax)'.*equinox\.nn\.Linear.*'equinox'"
    with pytest.raises(ValueError, match=refused):
        tx.update(grads, tx.init(params), params)


def test_agc_module_of_ones_own_names_the_rules():
    params = {"raw": Raw(jnp.ones((4, 3))), "bias": jnp.ones(3)}
    grads = jax.tree.map(lambda x: 10 * x, params)
    tx = ga.adaptive_grad_clip(CLIP)
    with pytest.raises(ValueError, match=r"\['raw'\]\.weight.*Raw.*unit_axes='equinox'.*'flax'"):
        tx.update(grads, tx.init(params), params)
    # Named, each rule is taken: the same numbers as the hand-computed units.
    g, w = grads["raw"].weight, params["raw"].weight
    for rule, want in (
        ("equinox", _per_output_agc(g, w)),  # rows are units
        ("flax", _per_output_agc(g.T, w.T).T),  # columns are units
    ):
        out = _clip(ga.adaptive_grad_clip(CLIP, unit_axes=rule), grads, params)
        np.testing.assert_allclose(out["raw"].weight, want, rtol=1e-5)


def test_agc_equinox_rule_on_plain_pytorch_layout_arrays():
    """`unit_axes="equinox"` on plain arrays (weights converted from PyTorch): output axis first."""
    params = {"w": jax.random.normal(jax.random.key(4), (6, 3, 2)), "bias": jnp.ones(6)}
    grads = _grads_like(params, jax.random.key(5))
    out = _clip(ga.adaptive_grad_clip(CLIP, unit_axes="equinox"), grads, params)
    np.testing.assert_allclose(out["w"], _per_output_agc(grads["w"], params["w"]), rtol=1e-5)
    bias_want = _per_output_agc(grads["bias"], params["bias"], whole=True)
    np.testing.assert_allclose(out["bias"], bias_want, rtol=1e-5)


def test_apply_gradients_takes_an_equinox_module_and_equals_the_large_batch():
    """K = 4 micro-steps of `apply_gradients` under `eqx.filter_jit`, the model passed whole:
    the arrays end as after one large-batch step, the rest (the activations) passes through."""
    model, batch = _block_and_batch()
    inner = optax.adam(1e-2)
    tx = ga.accumulate(inner, K)

    @eqx.filter_jit
    def step(model, state, batch, i):
        grads = eqx.filter_grad(_loss)(model, _micro(batch, i))
        return ga.apply_gradients(tx, grads, state, model)

    state = eqx.filter_jit(tx.init)(eqx.filter(model, eqx.is_inexact_array))
    accumulated = model
    for i in range(K):
        accumulated, state = step(accumulated, state, batch, jnp.int32(i))
    _close(accumulated, _large_batch_step(inner, model, batch))
    assert accumulated.mlp.activation is model.mlp.activation
    assert jax.tree.structure(accumulated) == jax.tree.structure(model)


def test_microbatch_value_and_grad_takes_an_equinox_module():
    """As `eqx.filter_value_and_grad` on the full batch, under `eqx.filter_jit` and `jax.jit`;
    `weight_fn` and `statistics_fn` get the module whole."""
    model, batch = _block_and_batch()
    want_value, want_grads = eqx.filter_jit(eqx.filter_value_and_grad(_loss))(model, batch)

    value, grads = eqx.filter_jit(ga.microbatch_value_and_grad(_loss, K))(model, batch)
    np.testing.assert_allclose(value, want_value, rtol=RTOL)
    _close(grads, want_grads)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)

    def whole(m):
        return isinstance(m, Block) and m.mlp.activation is jax.nn.gelu

    def weights(m, b):
        assert whole(m)
        return jnp.ones(b["x"].shape[0])

    def statistics(m, b):
        assert whole(m)
        return {"examples": b["x"].shape[0]}

    def loss(m, b, *, statistics):
        # The sum of the micro-batches' counts is the batch's: the loss is unchanged.
        return _loss(m, b) * statistics["examples"] / batch["x"].shape[0]

    mb = ga.microbatch_value_and_grad(loss, K, weight_fn=weights, statistics_fn=statistics)
    params, static = eqx.partition(model, eqx.is_array)
    value, grads = jax.jit(lambda p, b: mb(eqx.combine(p, static), b))(params, batch)
    np.testing.assert_allclose(value, want_value, rtol=RTOL)
    _close(grads, want_grads)


@pytest.mark.parametrize(
    "door",
    [
        lambda: ga.unreduced_value_and_grad(_loss, "data"),
        lambda: ga.coupled_value_and_grad(lambda m, reps: jnp.sum(reps), _embed, 2),
        lambda: ga.privacy.clipped_grad(_loss, 1.0),
    ],
    ids=["unreduced_value_and_grad", "coupled_value_and_grad", "privacy.clipped_grad"],
)
def test_doors_without_equinox_support_name_eqx_partition(door):
    """Refused at the call, before anything is traced (was: "not a valid JAX type" from inside)."""
    model, batch = _block_and_batch()
    with pytest.raises(
        TypeError, match=r"equinox\.Module at argnums position\(s\) \(0,\).*eqx\.partition"
    ):
        door()(model, batch)


def _embed(model, batch):
    return jax.vmap(model)(batch["x"]).mean(axis=1)


@eqx.filter_jit  # one program
def _mlp_and_batch():
    """A small model whose leaves include its activations, and 8 examples (one per device)."""
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    return model, {"x": jax.random.normal(kx, (8, 4)), "y": jax.random.normal(ky, (8, 2))}


# Each door on the split's params, giving the mean gradient over the batch; `loss(params,
# batch)` rebuilds the model with `eqx.combine(params, static)`.


def _split_unreduced(loss, static):
    fn = ga.unreduced_value_and_grad(loss, "data")
    mesh = E.data_mesh()

    def run(params, batch):
        with jax.set_mesh(mesh):
            params, batch = jax.device_put(params, P()), jax.device_put(batch, P("data"))
            return jax.jit(lambda p, b: compat.reshard(fn(p, b)[1], P()))(params, batch)

    return run


def _split_coupled(loss, static):
    def embed(params, batch):
        return {"out": jax.vmap(eqx.combine(params, static))(batch["x"]), "y": batch["y"]}

    fn = ga.coupled_value_and_grad(lambda p, reps: E.mse(reps["out"], reps["y"]), embed, 2)
    return jax.jit(lambda p, b: fn(p, b)[1])


def _split_clipped(loss, static):
    # No example reaches the clip norm: the sum of the per-example gradients, n times the mean's.
    fn = ga.privacy.clipped_grad(loss, 1e6)
    return jax.jit(lambda p, b: jax.tree.map(lambda g: g / b["x"].shape[0], fn(p, b)[1]))


@pytest.mark.parametrize(
    "door",
    [_split_unreduced, _split_coupled, _split_clipped],
    ids=["unreduced_value_and_grad", "coupled_value_and_grad", "privacy.clipped_grad"],
)
def test_doors_without_equinox_support_take_the_split_they_name(door):
    """The arrays of `eqx.partition(model, eqx.is_inexact_array)`, still a module of the
    model's type with `None` in its activations' places, pass the check that names them (was:
    refused by it): each door gives `jax.grad`'s gradient of the whole batch."""
    model, batch = _mlp_and_batch()
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params, batch):
        return _loss(eqx.combine(params, static), batch)

    _close(door(loss, static)(params, batch), jax.jit(jax.grad(loss))(params, batch))


def test_transformer_block_through_optax_equals_the_large_batch():
    """The plain optax road (`tx.update`, `eqx.apply_updates`) with K = 4: as one large-batch
    step (it worked before; kept so)."""
    model, batch = _block_and_batch()
    inner = optax.adamw(1e-2)
    tx = ga.accumulate(inner, K)

    @eqx.filter_jit
    def step(model, state, batch, i):
        grads = eqx.filter_grad(_loss)(model, _micro(batch, i))
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state

    state = eqx.filter_jit(tx.init)(eqx.filter(model, eqx.is_inexact_array))
    accumulated = model
    for i in range(K):
        accumulated, state = step(accumulated, state, batch, jnp.int32(i))
    _close(accumulated, _large_batch_step(inner, model, batch))


def test_package_imports_without_equinox():
    code = (
        "import sys; sys.modules['equinox'] = None; import gradaccum_jax as ga; "
        "ga.adaptive_grad_clip(); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
