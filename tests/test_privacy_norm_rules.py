"""Tests for the per-primitive rules of the fast path (gradaccum_jax._privacy.norm_rules)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradaccum_jax import privacy
from gradaccum_jax._privacy import graph, norm_rules


def both_paths(loss, params, batch, clip=0.4):
    """`(fast, per_example)` results with norms, and the fast plan's methods."""
    fast = privacy.clipped_grad(loss, clip, return_grad_norms=True)
    slow = privacy.clipped_grad(loss, clip, method="per_example", return_grad_norms=True)
    got, want = jax.jit(fast)(params, batch), jax.jit(slow)(params, batch)
    return jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want), fast.plan(params, batch)


def assert_same(got, want, atol=1e-12):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)


@pytest.mark.parametrize(
    ("ids", "index"),
    [
        ("in range", lambda table, ids: jnp.take(table, ids, axis=0)),
        (
            "out of range, filled",
            lambda table, ids: jnp.take(table, ids, axis=0, mode="fill", fill_value=0.0),
        ),
        ("out of range, clamped", lambda table, ids: jnp.take(table, ids, axis=0, mode="clip")),
        ("negative, wrapped", lambda table, ids: table[ids]),
    ],
)
def test_embedding_lookup_ghost_norm_in_every_index_mode(ids, index, x64):
    rng = np.random.default_rng(0)
    with x64():
        table = jnp.asarray(rng.normal(size=(30, 4)))
        low, high = {"in range": (0, 30), "negative, wrapped": (-30, 30)}.get(ids, (-5, 40))
        tokens = jnp.asarray(rng.integers(low, high, size=(8, 5)))
        # Repeated tokens in an example: the ghost norm's cross terms are what is tested.
        tokens = tokens.at[:, 3].set(tokens[:, 0])

        def loss(params, tokens):
            return jnp.sum(jnp.sin(index(params["table"], tokens)) * params["w"])

        params = {"table": table, "w": jnp.asarray(rng.normal(size=(4,)))}
        got, want, plan = both_paths(loss, params, tokens)
    assert plan.methods["['table']"] == "ghost"  # T^2 = 25 <= V = 30
    assert_same(got, want)


@pytest.mark.parametrize(
    "config",
    [
        {"window_strides": (1, 1), "padding": "SAME"},
        {"window_strides": (2, 3), "padding": ((1, 0), (2, 2))},
        {"window_strides": (1, 1), "padding": ((-1, 1), (0, 0)), "rhs_dilation": (2, 1)},
        {"window_strides": (2, 1), "padding": ((2, 1), (1, 1)), "lhs_dilation": (2, 2)},
        {
            "window_strides": (1, 1),
            "padding": "VALID",
            "dimension_numbers": ("NCHW", "OIHW", "NCHW"),
        },
        {"window_strides": (1, 2), "padding": "VALID", "feature_group_count": 3},
    ],
)
def test_convolution_patches_and_norms(config, x64):
    config = dict(config)
    layout = config.pop("dimension_numbers", ("NHWC", "HWIO", "NHWC"))
    groups = config.get("feature_group_count", 1)
    rng = np.random.default_rng(1)
    with x64():
        x_shape = (5, 6, 7, 6) if layout[0] == "NHWC" else (5, 6, 6, 7)
        k_shape = (3, 2, 6 // groups, 6) if layout[1] == "HWIO" else (6, 6, 3, 2)
        x = jnp.asarray(rng.normal(size=x_shape))
        kernel = jnp.asarray(rng.normal(size=k_shape))

        def loss(kernel, x):
            y = jax.lax.conv_general_dilated(x, kernel, dimension_numbers=layout, **config)
            return jnp.sum(jnp.tanh(y))

        got, want, plan = both_paths(loss, kernel, x)
        # The patches of one example, against JAX's own (a grouped convolution).
        closed = jax.make_jaxpr(loss)(kernel, x[:1])
        analysis = graph.analyze(closed, [graph.DERIVED, graph.BATCHED], [0, None], frozenset())
        (site,) = analysis.sites
        patches = jnp.stack(norm_rules._shifted(site, x[:1]), -1)
        patches = patches.reshape(patches.shape[0], -1)
        spec = site.eqn.params["dimension_numbers"]
        jax_patches = jax.lax.conv_general_dilated_patches(
            x[:1],
            [k_shape[d] for d in spec.rhs_spec[2:]],
            site.eqn.params["window_strides"],
            site.eqn.params["padding"],
            site.eqn.params["lhs_dilation"],
            site.eqn.params["rhs_dilation"],
            dimension_numbers=spec,
        )
        jax_patches = jnp.moveaxis(jax_patches, spec.out_spec[1], -1).reshape(patches.shape)
        np.testing.assert_allclose(patches, jax_patches, atol=1e-12)
    assert plan.methods == {"<the argument itself>": "layer"}
    assert_same(got, want, atol=1e-10)


def test_dense_norms_switch_between_ghost_and_layer_with_the_sequence_length(x64):
    # The layer's gradient where T (d_in + d_out) > d_in d_out (fewer flops) and
    # d_in d_out <= 2 T^2 (no more floats than the Gram matrices); else Gram matrices.
    # At T = 5 the layer would cost fewer flops (80 > 64) but hold 64 floats against 50.
    rng = np.random.default_rng(2)
    cases = [(1, "ghost"), (4, "ghost"), (5, "ghost"), (6, "layer"), (12, "layer")]
    for t, want_method in cases:
        with x64():
            w = jnp.asarray(rng.normal(size=(8, 8)))
            x = jnp.asarray(rng.normal(size=(6, t, 8)))
            got, want, plan = both_paths(lambda w, x: jnp.sum(jnp.tanh(x @ w)), w, x)
        assert plan.methods == {"<the argument itself>": want_method}, t
        assert_same(got, want)


def test_a_head_far_wider_than_the_sequence_keeps_the_ghost_norm():
    # T = d_in = 16, d_out = 4096: the layer's gradient would cost 0.996x the flops but
    # hold 16 x 4096 floats per example against two 16 x 16 Gram matrices.
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.normal(size=(16, 4096)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 16, 16)), jnp.float32)

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w))

    fast = privacy.clipped_grad(loss, 0.01, return_grad_norms=True)
    (leaf,) = fast.plan(w, x)
    assert (leaf.method, leaf.why) == (
        "ghost",
        "ghost: T=16, d_in=16, d_out=4096: layer would hold 128x the bytes",
    )

    def clipped(x):  # the reference: each example's gradient, clipped, summed
        g = jax.grad(loss)(w, x[None])
        return g * jnp.minimum(1.0, 0.01 / jnp.linalg.norm(g)), jnp.linalg.norm(g)

    want, want_norms = jax.jit(jax.vmap(clipped))(x)
    _, got, norms = jax.jit(fast)(w, x)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
    np.testing.assert_allclose(got, jnp.sum(want, 0), rtol=1e-5, atol=1e-9)


@pytest.mark.hlo
def test_ghost_where_the_layer_would_hold_more_compiles_to_less_temporary_memory(monkeypatch):
    # T = 40, d_in = d_out = 64: the layer's gradient would cost 0.8x the flops, and hold
    # 64 x 64 floats per example against 2 x 40 x 40 (the flops-only rule took it).
    rng = np.random.default_rng(6)
    w = jnp.asarray(rng.normal(size=(64, 64)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 40, 64)), jnp.float32)

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w))

    def temp_bytes():
        fn = privacy.clipped_grad(loss, 0.01)
        compiled = jax.jit(fn).lower(w, x).compile()
        return fn.plan(w, x).leaves[0].method, compiled.memory_analysis().temp_size_in_bytes

    ghost_method, ghost_temp = temp_bytes()
    monkeypatch.setattr(norm_rules.DotGeneralRule, "choice", lambda *_: ("layer", ""))
    layer_method, layer_temp = temp_bytes()
    assert (ghost_method, layer_method) == ("ghost", "layer")
    # 327,688 against 409,664 bytes on a CPU (jax 0.10).
    assert ghost_temp < 0.9 * layer_temp, (ghost_temp, layer_temp)


def test_an_embedding_lookup_forms_the_table_gradient_only_where_it_is_smaller(x64):
    # T = 8: T^2 = 64 > V, so the table's gradient costs fewer flops; it is formed for a
    # 10 x 2 table (20 floats <= 64) and not for a 30 x 4 one (120 floats > 64).
    rng = np.random.default_rng(7)
    for (vocab, d), want in [
        ((30, 4), ("ghost", "layer would hold 1.88x the bytes")),
        ((10, 2), ("layer", "0.16x ghost's flops, 0.31x its bytes")),
    ]:
        with x64():
            table = jnp.asarray(rng.normal(size=(vocab, d)))
            tokens = jnp.asarray(rng.integers(0, vocab, size=(6, 8)))

            def loss(table, tokens):
                return jnp.sum(jnp.sin(jnp.take(table, tokens, axis=0)))

            got, want_sums, plan = both_paths(loss, table, tokens)
        (leaf,) = plan
        assert (leaf.method, leaf.why) == (want[0], f"{want[0]}: T=8, V={vocab}, D={d}: {want[1]}")
        assert_same(got, want_sums)


def test_the_plan_says_why_a_dense_layer_took_its_method():
    w = jnp.ones((8, 8))
    whys = {}
    for t in (3, 5, 12):
        plan = privacy.clipped_grad(lambda w, x: jnp.sum(x @ w), 1.0).plan(w, jnp.ones((2, t, 8)))
        (leaf,) = plan
        whys[t] = leaf.why
        assert f"({leaf.why})" in str(plan)
    assert whys == {
        3: "ghost: T=3, d_in=8, d_out=8: layer would take 1.33x the flops",
        5: "ghost: T=5, d_in=8, d_out=8: layer would hold 1.28x the bytes",
        12: "layer: T=12, d_in=8, d_out=8: 0.33x ghost's flops, 0.22x its bytes",
    }
    # docs/privacy.md's LM head: about the same flops either way, 128 times the bytes.
    assert norm_rules.dense_choice(128, 128, 32768) == (
        "ghost",
        "ghost: T=128, d_in=128, d_out=32768: layer would hold 128x the bytes",
    )
    # A leaf with no choice to make (an elementwise product) says nothing.
    (leaf,) = privacy.clipped_grad(lambda w, x: jnp.sum(x * w), 1.0).plan(w, jnp.ones((2, 8)))
    assert (leaf.method, leaf.why) == ("layer", "")


def test_a_rule_added_to_the_table_is_used():
    # The table is the extension point: a rule for `sin` sites (a parameter under sin),
    # which keeps the generic computation but names its method.
    class Sine(norm_rules.Rule):
        def norm_sq(self, site, position, inputs, grads):
            _, sq, per_example = super().norm_sq(site, position, inputs, grads)
            return "sine", sq, per_example

    def loss(w, x):
        return jnp.sum(jnp.sin(w * x))  # `mul` is the site; `sin` is not one

    w, x = jnp.ones(3), jnp.ones((4, 3))
    assert privacy.clipped_grad(loss, 1.0).plan(w, x).methods == {"<the argument itself>": "layer"}
    norm_rules.RULES["mul"] = Sine()
    try:
        assert privacy.clipped_grad(loss, 1.0).plan(w, x).methods == {
            "<the argument itself>": "sine"
        }
    finally:
        norm_rules.RULES["mul"] = norm_rules.LinearRule()


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_transpose_chain_moves_a_gradient_back_to_its_leaf(depth):
    rng = np.random.default_rng(3)
    # Small integers: exact in bfloat16, so the change of dtype loses nothing.
    leaf = rng.integers(-8, 8, size=(*([2] * depth), 3, 4, 5)).astype(np.float32)

    def forward(x):
        x = jnp.transpose(x, (2, 0, 1))
        x = jnp.flip(x, 1).reshape(5, 12)
        return x.astype(jnp.bfloat16)[None]

    # The chain the analysis records from the leaf to a site that uses it.
    def loss(w, x):
        return jnp.sum(forward(w) * x)

    one = jnp.asarray(leaf[(0,) * depth], jnp.float32)
    closed = jax.make_jaxpr(loss)(one, jnp.ones((1, 5, 12), jnp.bfloat16))
    analysis = graph.analyze(closed, [graph.DERIVED, graph.BATCHED], [0, None], frozenset())
    (site,) = analysis.sites
    chain = site.origins[0].chain
    assert [step.primitive for step in chain] == [
        "transpose",
        "rev",
        "reshape",
        "convert_element_type",
        "broadcast_in_dim",
    ]
    # Stacked over `depth` scan iterations, each slice moved alike.
    per_slice = forward
    for _ in range(depth):
        per_slice = jax.vmap(per_slice)
    moved = per_slice(jnp.asarray(leaf, jnp.float32))
    back = norm_rules.transpose_chain(moved, (*[graph.Step("slice")] * depth, *chain))
    np.testing.assert_array_equal(np.asarray(back, np.float32), leaf)


def test_an_integer_or_stopped_use_of_a_parameter_is_not_a_site():
    def loss(w, x):
        frozen = jax.lax.stop_gradient(w)
        k = jnp.argmax(w)  # an integer made from the parameter: no gradient
        return jnp.sum(x * w) + jnp.sum(x * frozen) + jnp.sum(x[:, k])

    w, x = jnp.arange(3.0), jnp.ones((4, 3))
    closed = jax.make_jaxpr(loss)(w, x[:1])
    analysis = graph.analyze(closed, [graph.DERIVED, graph.BATCHED], [0, None], frozenset())
    assert [site.name for site in analysis.sites] == ["mul"]
    for method in ("fast", "per_example"):
        _, g = privacy.clipped_grad(loss, 100.0, method=method)(w, x)
        np.testing.assert_allclose(g, 4.0)


def test_every_combination_of_dense_operand_order_and_batch_dims(x64):
    # dot_general with the parameter on either side, with and without shared batch dims.
    rng = np.random.default_rng(4)
    specs = ["nd,de->ne", "de,nd->ne", "nhd,hde->nhe", "hde,nhd->nhe", "ntd,de->nte"]
    for spec, dtype in itertools.product(specs, ["float64"]):
        a_spec, b_spec = spec.split("->")[0].split(",")
        param_first = "n" not in a_spec
        p_spec, x_spec = (a_spec, b_spec) if param_first else (b_spec, a_spec)
        sizes = {"n": 5, "d": 4, "e": 3, "h": 2, "t": 3}
        with x64():
            w = jnp.asarray(rng.normal(size=[sizes[c] for c in p_spec]), dtype)
            x = jnp.asarray(rng.normal(size=[sizes[c] for c in x_spec]), dtype)

            def loss(w, x, spec=spec, param_first=param_first):
                args = (w, x) if param_first else (x, w)
                return jnp.sum(jnp.tanh(jnp.einsum(spec, *args)))

            got, want, plan = both_paths(loss, w, x)
        assert_same(got, want)
        assert set(plan.methods.values()) <= {"ghost", "layer"}, spec
