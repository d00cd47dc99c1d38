"""Tests for clipped_grad's fast path (gradaccum_jax._privacy.fast, graph, replay).

Every model family the fast path knows is checked against the per-example path
(`method="per_example"`, `vmap` of each example's gradient) in float64, where the
comparison sees the rule and not the order of float32 sums; `plan` must say which
leaf took which way. The promises both paths keep (padding, non-finite examples,
keys, aux, chunks, dtypes, shard_map) are tested on both in test_privacy_clipping.py.
"""

import contextlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax import privacy

F64 = jnp.float64
N = 6  # examples per batch: small, the models are what is tested
C = 0.3


def dense(features, **kw):
    return nn.Dense(features, param_dtype=F64, dtype=F64, **kw)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return dense(3)(jnp.tanh(dense(7)(x)))


class Tokens(nn.Module):
    """Dense layers on sequences: T = 3 with 8 -> 8 (ghost norms from Gram matrices), then
    T = 3 with 8 -> 2 (T (d_in + d_out) > d_in d_out: the layer's gradient is formed)."""

    @nn.compact
    def __call__(self, x):
        return dense(2, name="narrow")(jnp.tanh(dense(8, name="wide")(x)))


class Convs(nn.Module):
    @nn.compact
    def __call__(self, x):
        conv = lambda f, k, **kw: nn.Conv(f, k, param_dtype=F64, dtype=F64, **kw)  # noqa: E731
        x = jnp.tanh(conv(4, (3, 3), strides=(2, 1))(x))
        x = jnp.tanh(conv(4, (2, 3), feature_group_count=2, kernel_dilation=(2, 1))(x))
        x = jnp.tanh(conv(6, (3, 2), padding=((1, 2), (0, 1)), input_dilation=(2, 1))(x))
        up = nn.ConvTranspose(3, (2, 2), strides=(2, 1), param_dtype=F64, dtype=F64)
        x = jnp.tanh(up(x))
        return dense(2)(x.reshape(x.shape[0], -1))


class Einsums(nn.Module):
    """Parameters as either operand of dot_general, with and without its batch dimensions."""

    @nn.compact
    def __call__(self, x):  # x: (1, 3, 4)
        w = self.param("heads", nn.initializers.normal(), (3, 4, 5), F64)  # batch dim h
        v = self.param("left", nn.initializers.normal(), (2, 5), F64)  # the left operand
        g = nn.DenseGeneral((2, 2), axis=(-2, -1), param_dtype=F64, dtype=F64)
        h = jnp.einsum("nhd,hde->nhe", x, w)
        h = jnp.einsum("fe,nhe->nhf", v, jnp.tanh(h))
        return g(h)


class LM(nn.Module):
    """An embedding (ids out of the table's range among the inputs), causal attention,
    LayerNorm, a learned position table, and the output tied to the embedding."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(40, 8, param_dtype=F64, dtype=F64)
        x = embed(ids) + self.param("pos", nn.initializers.normal(), (ids.shape[1], 8), F64)
        h = nn.LayerNorm(param_dtype=F64, dtype=F64)(x)
        mask = nn.make_causal_mask(jnp.ones(ids.shape))
        attn = nn.MultiHeadDotProductAttention(2, param_dtype=F64, dtype=F64)
        x = x + attn(h, h, mask=mask)
        return embed.attend(nn.LayerNorm(param_dtype=F64, dtype=F64)(x))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + dense(6)(jnp.tanh(nn.LayerNorm(param_dtype=F64, dtype=F64)(x))), None


class Stacked(nn.Module):
    """Layers stacked under nn.scan, each block under remat."""

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        x, _ = scan()(dense(6)(x), None)
        return dense(2)(x)


class Shared(nn.Module):
    """One Dense applied twice: each example's gradient has cross terms between the uses."""

    @nn.compact
    def __call__(self, x):
        layer = dense(4)
        return layer(jnp.tanh(layer(x)))


class WeightNorm(nn.Module):
    """A weight made from two leaves through a norm: no single leaf reaches the site."""

    @nn.compact
    def __call__(self, x):
        v = self.param("v", nn.initializers.normal(), (4, 3), F64)
        g = self.param("g", nn.initializers.ones, (3,), F64)
        return x @ (v / jnp.linalg.norm(v, axis=0) * g)


def carried(params, x):
    """A parameter scanned over with no example (materialized), another in a carry each
    iteration changes (per-example path)."""
    scale = jax.lax.scan(lambda c, _: (c * params["a"], None), jnp.ones(4), None, length=2)[0]

    def step(carry, _):
        h, w = carry
        return (jnp.tanh(h @ w), 0.9 * w), None

    (h, _), _ = jax.lax.scan(step, (x * scale, params["w"]), None, length=3)
    return jnp.sum(h) + jnp.sum(params["w"] ** 2)


def _batch(rng, shape, ids=None):
    if ids is not None:
        return jnp.asarray(rng.integers(*ids, size=shape))
    return jnp.asarray(rng.normal(size=shape), F64)


def _linen(model, shape, ids=None):
    def build():
        rng = np.random.default_rng(0)
        x = _batch(rng, (N, *shape), ids)
        params = model.init(jax.random.key(1), x[:1])
        params = jax.tree.map(lambda p: p + 0.1 * rng.normal(size=p.shape), params)

        def loss(params, x):
            return jnp.mean(jnp.sin(model.apply(params, x)))

        return loss, params, x

    return build


def _carried():
    rng = np.random.default_rng(0)
    params = {"w": _batch(rng, (4, 4)) * 0.5, "a": _batch(rng, (4,))}
    return carried, params, _batch(rng, (N, 1, 4))


# model -> (builder, {leaf path pattern: method}); every leaf must match one pattern.
MODELS = {
    "mlp": (_linen(MLP(), (5,)), {"kernel": "ghost", "bias": "layer"}),
    "tokens": (
        _linen(Tokens(), (3, 8)),
        {"wide.*kernel": "ghost", "narrow.*kernel": "layer", "bias": "layer"},
    ),
    "convs": (
        _linen(Convs(), (7, 5, 2)),
        {"Conv.*kernel": "layer", "Dense_0.*kernel": "ghost", "bias": "layer"},
    ),
    "einsums": (
        _linen(Einsums(), (3, 4)),
        {"heads": "ghost", "left": "layer", "kernel": "ghost", "bias": "layer"},
    ),
    "lm": (
        _linen(LM(), (5,), ids=(-3, 45)),
        {
            "embedding": "materialized",
            "pos": "layer",
            "scale": "layer",
            "bias": "layer",
            "(query|key|value|out).*kernel": "ghost|layer",
        },
    ),
    "stacked": (_linen(Stacked(), (2, 3)), {"kernel": "ghost|layer", "bias|scale": "layer"}),
    "shared": (_linen(Shared(), (4,)), {".": "materialized"}),
    "weight_norm": (_linen(WeightNorm(), (4,)), {".": "materialized"}),
    "carried": (_carried, {"'a'": "materialized", "'w'": "per_example"}),
}


def _max_error(got, want):
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_fast_path_equals_per_example_gradients_in_float64(model, x64):
    build, methods = MODELS[model]
    with x64():
        loss, params, x = build()
        padding = np.arange(N) == 4
        # A clip norm among the examples' norms: some are clipped and some are not.
        norms = jax.jit(privacy.clipped_grad(loss, 1.0, return_grad_norms=True))(params, x)[2]
        clip = float(np.nanmedian(np.asarray(norms)))
        fast = privacy.clipped_grad(loss, clip, return_grad_norms=True)
        slow = privacy.clipped_grad(loss, clip, method="per_example", return_grad_norms=True)
        got = jax.jit(fast)(params, x, is_padding_example=padding)
        want = jax.jit(slow)(params, x, is_padding_example=padding)
        plan = fast.plan(params, x)
        got, want = jax.tree.map(np.asarray, (got, want))
    scale = float(np.nanmax(want[2]))
    assert _max_error(got, want) <= 1e-12 * max(scale, 1.0)
    # Examples are clipped and some are not: the comparison sees both.
    assert float(np.nanmin(want[2][~padding])) < clip < scale
    assert got[2][4] == 0.0  # the padding example's norm
    for leaf in plan:
        matching = [m for pattern, m in methods.items() if re.search(pattern, leaf.path)]
        assert matching, leaf.path
        assert re.fullmatch(matching[0], leaf.method), (leaf.path, leaf.method, str(plan))


def test_plan_prints_a_table_and_says_why_a_leaf_takes_the_per_example_path(x64):
    with x64():
        loss, params, x = _carried()
        plan = privacy.clipped_grad(loss, C).plan(params, jax.ShapeDtypeStruct(x.shape, x.dtype))
        per_example = privacy.clipped_grad(loss, C, method="per_example").plan(params, x)
    assert plan.methods == {"['a']": "materialized", "['w']": "per_example"}
    (w,) = [leaf for leaf in plan if leaf.path == "['w']"]
    assert "carried through a scan that changes it" in w.why
    text = str(plan)
    assert text.splitlines()[0].split() == [
        "leaf",
        "method",
        "where",
        "it",
        "meets",
        "the",
        "batch",
    ]
    assert "per_example" in text and "mul" in text
    assert per_example.methods == {
        "['a']": "per_example",
        "['w']": "per_example",
    }


def test_a_leaf_the_loss_does_not_use_gets_a_zero_sum():
    def loss(params, x):
        return jnp.sum(x @ params["w"])

    params = {"w": jnp.ones((3, 2)), "unused": jnp.ones(4)}
    x = jnp.ones((4, 3))
    fn = privacy.clipped_grad(loss, 1.0)
    assert fn.plan(params, x).methods["['unused']"] == "unused"
    _, grads = jax.jit(fn)(params, x)
    np.testing.assert_array_equal(grads["unused"], 0.0)


def test_bfloat16_model_matches_the_per_example_path():
    class Half(nn.Module):
        @nn.compact
        def __call__(self, x):
            layer = lambda f: nn.Dense(f, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)  # noqa: E731
            return layer(2)(jnp.tanh(layer(6)(x)))

    model = Half()
    x = jax.random.normal(jax.random.key(0), (8, 5), jnp.bfloat16)
    params = model.init(jax.random.key(1), x[:1])

    def loss(params, x):
        return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

    got = jax.jit(privacy.clipped_grad(loss, 0.05, return_grad_norms=True))(params, x)
    want = jax.jit(privacy.clipped_grad(loss, 0.05, method="per_example", return_grad_norms=True))(
        params, x
    )
    assert {leaf.dtype for leaf in jax.tree.leaves(got[1])} == {jnp.dtype(jnp.float32)}
    # bfloat16 activations and output gradients: both paths round alike, not the same sums.
    np.testing.assert_allclose(got[2], want[2], rtol=2e-2)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize("method", ["fast", "per_example"])
def test_a_clipped_bfloat16_example_stays_within_the_clip_norm(method):
    # Issue 40 item 13: a clip factor applied in bfloat16 let one example reach 1.004 C.
    # Gradients whose every entry rounds up when scaled in bfloat16 (the worst case).
    w = jnp.full((1, 64), 1.0, jnp.bfloat16)

    def loss(w, x):
        return jnp.sum(x @ w)

    # d loss / dw = x: 64 entries of 1 + 2^-7 (exact in bfloat16), norm ~8.06.
    x = jnp.full((1, 1), 1 + 2**-7, jnp.bfloat16)
    # C / norm rounds up in bfloat16, and so does each scaled entry: scaled in bfloat16,
    # the example's norm came out 1.005 C.
    clip = 1.50785
    _, g = jax.jit(privacy.clipped_grad(loss, clip, method=method))(w, x)
    norm = float(np.linalg.norm(np.asarray(g, np.float64)))
    assert norm <= clip * (1 + 1e-6), norm
    assert norm >= clip * (1 - 1e-6)


def _hlo_shapes(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    return set(re.findall(r"f32\[([\d,]+)\]", text))


@pytest.mark.slow
@pytest.mark.hlo
def test_the_fast_path_forms_no_example_gradient_of_a_dense_layer():
    # The point of the fast path: per-example norms of a 32 x 48 dense layer without any
    # (examples, 32, 48) array. The per-example path forms it (which shows the test can fail).
    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(jnp.tanh(nn.Dense(48)(x)))

    model = Wide()
    x = jnp.ones((16, 32))
    params = model.init(jax.random.key(0), x[:1])

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    fast = _hlo_shapes(privacy.clipped_grad(loss, 1.0), params, x)
    slow = _hlo_shapes(privacy.clipped_grad(loss, 1.0, method="per_example"), params, x)
    per_example = {"16,32,48", "16,1,32,48"}
    assert per_example & slow
    assert not per_example & fast


def mlp32(params, x):
    return jnp.mean(jnp.sin(jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]))


def mlp32_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (5, 7)),
        "b1": jnp.full(7, 0.1),
        "w2": jax.random.normal(k2, (7, 3)),
    }


@pytest.mark.parametrize(
    ("axis_type", "set_mesh"), [("Auto", True), ("Explicit", True), ("Explicit", False)]
)
@pytest.mark.parametrize("chunks", [{}, {"microbatch_size": 2}])
def test_global_view_jit_equals_one_device(axis_type, set_mesh, chunks):
    # Issue 40 item 1: on jax.make_mesh's default (Explicit) mesh both paths failed inside
    # the library; the batch split in the type now runs on each device, sums added once.
    # Issue 44 item 7: with no mesh set in context the arrays' types name the mesh.
    loss, params = mlp32, mlp32_params()
    x = jax.random.normal(jax.random.key(2), (16, 5))
    key = jax.random.key(3)

    def noisy_loss(params, key, x):
        keep = jax.random.bernoulli(key, 0.7, x.shape)
        return loss(params, jnp.where(keep, x, 0.0))

    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    padding = np.arange(16) % 5 == 0
    for method in ("fast", "per_example"):
        fn = privacy.clipped_grad(
            noisy_loss,
            C,
            method=method,
            prng_argnum=1,
            batch_argnums=2,
            return_grad_norms=True,
            **chunks,
        )
        want = jax.jit(fn)(params, key, x, is_padding_example=padding)
        with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
            xs = jax.device_put(x, NamedSharding(mesh, P("data")))
            got = jax.jit(fn)(params, key, xs, is_padding_example=padding)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        assert _max_error(got[1], want[1]) <= 1e-6
        np.testing.assert_allclose(got[2], want[2], rtol=1e-5)


def test_a_batch_split_unevenly_over_the_mesh_is_refused_with_the_fix(explicit_mesh):
    mesh = explicit_mesh
    loss, params = mlp32, mlp32_params()
    x = jnp.ones((16, 5), jnp.float32)
    y = jnp.ones((16, 8), jnp.float32)

    def two(params, batch):
        return loss(params, batch[0]) + jnp.sum(batch[1])

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ys = jax.device_put(y, NamedSharding(mesh, P(None, "data")))
        with pytest.raises(ValueError, match=r"Reshard them alike, e\.g\. jax\.reshard"):
            jax.jit(privacy.clipped_grad(two, C))(params, (xs, ys))


def test_dp_accumulate_over_fast_sums_equals_the_per_example_path(x64):
    build, _ = MODELS["lm"]
    with x64():
        loss, params, ids = build()
        steps = {}
        for method in ("fast", "per_example"):
            clipped = privacy.clipped_grad(loss, C, method=method, microbatch_size=3)
            tx = privacy.dp_accumulate(
                optax.adam(1e-2),
                2,
                l2_clip_norm=C,
                noise_multiplier=0.7,
                expected_batch_size=2 * N,
                key=jax.random.key(0),
            )

            @jax.jit
            def step(params, state, ids, clipped=clipped, tx=tx):
                _, grad_sum = clipped(params, ids)
                return ga.apply_gradients(tx, grad_sum, state, params)

            p, state = params, tx.init(params)
            for k in range(4):  # two windows of two micro-steps
                p, state = step(p, state, jnp.roll(ids, k, axis=0))
            steps[method] = jax.tree.map(np.asarray, p)
        windows = int(ga.optimizer_step(state))
    assert windows == 2
    assert _max_error(steps["fast"], steps["per_example"]) <= 1e-10


def test_construction_refuses_an_unknown_method_and_a_non_bool_flag():
    loss = lambda w, x: jnp.sum(w * x)  # noqa: E731
    with pytest.raises(
        ValueError, match=r"method must be one of 'fast', 'per_example'; got method='ghost'"
    ):
        privacy.clipped_grad(loss, 1.0, method="ghost")
    with pytest.raises(TypeError, match="return_grad_norms must be a bool"):
        privacy.clipped_grad(loss, 1.0, return_grad_norms=1)
    assert "method='fast'" in repr(privacy.clipped_grad(loss, 1.0))


def test_several_differentiated_arguments_share_one_norm():
    # argnums=(0, 2): each example's norm is over both arguments' leaves, as on the
    # per-example path.
    def loss(first, batch, second):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ first["w"]) @ second - y) ** 2)

    k1, k2, k3, k4 = jax.random.split(jax.random.key(5), 4)
    first = {"w": jax.random.normal(k1, (4, 6))}
    second = jax.random.normal(k2, (6, 2))
    batch = (jax.random.normal(k3, (10, 4)), jax.random.normal(k4, (10, 2)))
    results = [
        jax.jit(privacy.clipped_grad(loss, 0.2, argnums=(0, 2), method=m, return_grad_norms=True))(
            first, batch, second
        )
        for m in ("fast", "per_example")
    ]
    assert isinstance(results[0][1], tuple) and len(results[0][1]) == 2
    assert _max_error(results[0], results[1]) <= 1e-5
    plan = privacy.clipped_grad(loss, 0.2, argnums=(0, 2)).plan(first, batch, second)
    assert plan.methods == {"[0]['w']": "ghost", "[1]": "ghost"}


@pytest.mark.hlo
def test_chunks_still_bound_the_fast_paths_memory():
    params, x = mlp32_params(), jnp.ones((256, 5))
    whole = jax.jit(privacy.clipped_grad(mlp32, C)).lower(params, x).compile()
    chunked = jax.jit(privacy.clipped_grad(mlp32, C, microbatch_size=16)).lower(params, x).compile()
    temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(chunked) * 4 < temp(whole)


def _lora_forms():
    """Pure-JAX LoRA, four ways; each `(loss(ab, *rest, x), rest)`: only `ab` is trained."""
    k = jax.random.split(jax.random.key(11), 4)
    base = jax.random.normal(k[0], (5, 4), F64)
    ab = {"a": jax.random.normal(k[1], (5, 2), F64), "b": jax.random.normal(k[2], (2, 4), F64)}

    def head(h):
        return jnp.mean(jnp.tanh(h) ** 2)

    return ab, {
        "closed-over base": (lambda ab, x: head(x @ base + x @ ab["a"] @ ab["b"]), ()),
        "base as an argument": (lambda ab, w, x: head(x @ w + x @ ab["a"] @ ab["b"]), (base,)),
        "stop_gradient": (
            lambda ab, x: head(x @ jax.lax.stop_gradient(base) + x @ ab["a"] @ ab["b"]),
            (),
        ),
        "merged W + sAB": (lambda ab, x: head(x @ (base + 0.5 * ab["a"] @ ab["b"])), ()),
    }


@pytest.mark.parametrize(
    "form", ["closed-over base", "base as an argument", "stop_gradient", "merged W + sAB"]
)
def test_pure_jax_lora_forms_clip_only_the_adapters(form, x64):
    # Issue 44 item 4's guard: the frozen base is not differentiated in any of these, so
    # each example's norm is its adapters' alone, the same on both paths.
    with x64():
        ab, forms = _lora_forms()
        loss, rest = forms[form]
        x = jax.random.normal(jax.random.key(12), (N, 3, 5), F64)
        batch_at = 1 + len(rest)
        got, want = (
            jax.jit(
                privacy.clipped_grad(
                    loss, C, method=m, batch_argnums=batch_at, return_grad_norms=True
                )
            )(ab, *rest, x)
            for m in ("fast", "per_example")
        )
        one = jax.vmap(lambda xi: jax.grad(loss)(ab, *rest, xi[None]))(x)
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(N, -1) ** 2, 1) for g in jax.tree.leaves(one)))
    assert set(got[1]) == {"a", "b"}
    assert _max_error(got[1], want[1]) <= 1e-12
    np.testing.assert_allclose(got[2], norms, rtol=1e-12)
    np.testing.assert_allclose(want[2], norms, rtol=1e-12)
