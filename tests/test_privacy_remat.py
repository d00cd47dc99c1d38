"""clipped_grad's fast path under remat (`jax.checkpoint`, `nn.remat`): `remat="recompute"`
computes the norms and clipped sums of the layers inside a remat in the backward pass
(`fast.Probe`), `remat="auto"` too, keeping their per-example gradients from the first
backward pass where they are small (no second pass), `remat="save"` keeps their inputs
from the forward pass.

Both are checked against the per-example path in float64 (the rules, not float32 sums,
are compared); the compiled temp of the recomputing program against the non-private
step's under the same remat; and the promises of the fast path (padding, non-finite
examples, the norms, shard_map, global-view meshes) on a remat stack.
"""

import functools

import _equivalence as E
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import harness
from gradaccum_jax import privacy

F64 = jnp.float64
N, T, D = 8, 3, 6
C = 0.3


class Block(nn.Module):
    """RMS-style scale, two dense layers with a bias, on a sequence."""

    width: int
    dtype: object = F64

    @nn.compact
    def __call__(self, x, _):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale
        h = nn.Dense(self.width, param_dtype=self.dtype, dtype=self.dtype, name="up")(h)
        h = nn.Dense(x.shape[-1], param_dtype=self.dtype, dtype=self.dtype, name="down")(
            jnp.tanh(h)
        )
        return x + h, None


class Stack(nn.Module):
    layers: int = 3
    width: int = 10
    remat: bool = True
    dtype: object = F64

    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block) if self.remat else Block
        scan = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers
        )
        x = nn.Dense(x.shape[-1], param_dtype=self.dtype, dtype=self.dtype, name="embed")(x)
        x, _ = scan(self.width, self.dtype, name="blocks")(x, None)
        return nn.Dense(2, param_dtype=self.dtype, dtype=self.dtype, name="head")(x)


def setup(model=None, n=N, dtype=F64, length=T):
    model = model or Stack()
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (n, length, D), dtype)
    y = jax.random.normal(ky, (n, length, 2), dtype)
    params = model.init(jax.random.key(0), x[:1])["params"]

    def loss(p, x, y):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    return loss, params, x, y


close = functools.partial(E.assert_close, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("remat", ["auto", "recompute", "save"])
@pytest.mark.parametrize("length", [T, 40])
def test_a_remat_stack_equals_the_per_example_path(remat, length, x64):
    with x64():
        # At T = 3 the blocks' dense kernels take ghost norms (auto recomputes them in a
        # second pass); at T = 40 every layer of the blocks takes the layer rule, with a
        # per-example gradient smaller than its inputs (auto keeps it: one pass).
        loss, params, x, y = setup(length=length)
        fast = privacy.clipped_grad(loss, C, batch_argnums=(1, 2), remat=remat)
        ref = privacy.clipped_grad(loss, C, batch_argnums=(1, 2), method="per_example")
        (l1, g1), (l2, g2) = jax.jit(fast)(params, x, y), jax.jit(ref)(params, x, y)
        close(l1, l2)
        close(g1, g2)
        plan = fast.plan(params, x, y)
        one_pass = remat == "auto" and length == 40
        for leaf in plan:
            # Inside the remat the layers are recomputed for the fast path; outside
            # (embed, head) they are not; with "save" none is.
            inside = leaf.path.startswith("['blocks']")
            assert leaf.recomputed == (inside and remat != "save"), leaf
            assert leaf.second_pass == (leaf.recomputed and not one_pass), leaf
        assert ("remat's backward pass" in str(plan)) == (remat != "save")
        assert ("its sum in a second one" in str(plan)) == (remat != "save" and not one_pass)


def count_block_scans(fn, *args):
    """The scans over the 3 blocks in `fn`'s program, at any depth: one for the forward
    pass and one for each backward pass."""

    def count(jaxpr):
        found = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan" and eqn.params["length"] == 3:
                found += 1
            for value in eqn.params.values():
                for inner in value if isinstance(value, tuple) else (value,):
                    inner = getattr(inner, "jaxpr", inner)  # a cond's branches, a jit's body
                    if hasattr(inner, "eqns"):
                        found += count(inner)
        return found

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("length", [T, 40])
def test_the_default_recomputes_in_one_backward_pass_where_it_can(length, x64):
    with x64():
        loss, params, x, y = setup(length=length)
        modes = {
            m: privacy.clipped_grad(loss, C, batch_argnums=(1, 2), remat=m)
            for m in ("auto", "recompute")
        }
        default = privacy.clipped_grad(loss, C, batch_argnums=(1, 2))
        assert default.plan(params, x, y) == modes["auto"].plan(params, x, y)
        scans = {m: count_block_scans(fn, params, x, y) for m, fn in modes.items()}
        # The forward pass and two backward passes, or one where the gradients are kept.
        assert scans["recompute"] == 3, scans
        assert scans["auto"] == (2 if length == 40 else 3), scans


def test_without_remat_nothing_is_recomputed(x64):
    with x64():
        loss, params, x, y = setup(Stack(remat=False))
        plan = privacy.clipped_grad(loss, C, batch_argnums=(1, 2)).plan(params, x, y)
        assert not any(leaf.recomputed for leaf in plan)


def hand_written(params, x):
    """jax.checkpoint with a policy, inside a plain scan over stacked weights; inside the
    remat a weight used twice (materialized) and a recurrence reusing one weight in every
    step of an inner scan (not probed: each example's norm needs all its steps at once)."""

    def layer(h, w):
        h = jnp.tanh(h @ w["a"])
        h = jnp.tanh(h @ w["shared"]) @ w["shared"]

        def step(c, row):
            c = jnp.tanh(c @ w["rec"] + row)
            return c, c

        _, hs = jax.lax.scan(step, jnp.zeros(h.shape[-1], h.dtype), h[0])
        return h + hs[None], None

    body = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    h, _ = jax.lax.scan(body, x, params["stack"])
    return jnp.mean(h**2)


def test_a_checkpoint_with_a_policy_shared_and_reused_weights_inside(x64):
    with x64():
        ks = jax.random.split(jax.random.key(3), 4)
        params = {
            "stack": {
                "a": jax.random.normal(ks[0], (2, D, D), F64) * 0.4,
                "shared": jax.random.normal(ks[1], (2, D, D), F64) * 0.4,
                "rec": jax.random.normal(ks[2], (2, D, D), F64) * 0.4,
            }
        }
        x = jax.random.normal(ks[3], (N, T, D), F64)
        fast = privacy.clipped_grad(hand_written, C)
        ref = privacy.clipped_grad(hand_written, C, method="per_example")
        close(jax.jit(fast)(params, x), jax.jit(ref)(params, x))
        plan = {leaf.path: leaf for leaf in fast.plan(params, x)}
        assert plan["['stack']['a']"].recomputed
        assert plan["['stack']['shared']"].method == "materialized"
        assert not plan["['stack']['shared']"].recomputed
        assert not plan["['stack']['rec']"].recomputed


@pytest.mark.parametrize("length", [T, 40])
def test_padding_non_finite_examples_and_the_norms_under_remat(length, x64):
    with x64():
        loss, params, x, y = setup(length=length)
        x = x.at[2, 1, 0].set(jnp.nan).at[5, 0, 3].set(jnp.inf)
        padding = jnp.zeros(N, bool).at[6].set(True)
        kw = dict(batch_argnums=(1, 2), return_grad_norms=True)
        fast = privacy.clipped_grad(loss, C, **kw)
        ref = privacy.clipped_grad(loss, C, method="per_example", **kw)
        (l1, g1, n1) = jax.jit(fast)(params, x, y, is_padding_example=padding)
        (l2, g2, n2) = jax.jit(ref)(params, x, y, is_padding_example=padding)
        assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(g1))
        close((l1, g1), (l2, g2))
        finite = np.isfinite(np.asarray(n2))
        np.testing.assert_array_equal(np.isfinite(np.asarray(n1)), finite)
        np.testing.assert_allclose(np.asarray(n1)[finite], np.asarray(n2)[finite], rtol=1e-10)
        assert float(n1[6]) == 0.0  # padding


@pytest.mark.parametrize("length", [T, 40])  # two backward passes, or one (see above)
def test_inside_shard_map_each_device_clips_its_own_examples(length, x64, auto_mesh):
    with x64():
        loss, params, x, y = setup(n=16, length=length)
        mesh = auto_mesh
        fast = privacy.clipped_grad(loss, C, batch_argnums=(1, 2))

        def body(p, x, y):
            return jax.lax.psum(fast(p, x, y), "data")

        specs = (P(), P("data"), P("data"))
        sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()))
        ref = privacy.clipped_grad(loss, C, batch_argnums=(1, 2), method="per_example")
        close(sharded(params, x, y), jax.jit(ref)(params, x, y))


@pytest.mark.parametrize("length", [T, 40])
def test_global_view_on_an_explicit_mesh(length, x64, explicit_mesh):
    with x64():
        loss, params, x, y = setup(n=16, length=length)
        mesh = explicit_mesh
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        ps = jax.device_put(params, NamedSharding(mesh, P()))
        fast = privacy.clipped_grad(loss, C, batch_argnums=(1, 2))
        ref = privacy.clipped_grad(loss, C, batch_argnums=(1, 2), method="per_example")
        close(jax.jit(fast)(ps, xs, ys), jax.jit(ref)(params, x, y))


def test_an_unknown_remat_value_is_refused():
    with pytest.raises(
        ValueError, match=r"remat must be one of 'auto', 'recompute', 'save'; got remat='keep' "
    ):
        privacy.clipped_grad(lambda w, x: jnp.sum(w * x), C, remat="keep")


def temp(fn, *args):
    return harness.compiled_memory(jax.jit(fn).lower(*args).compile()).temp_bytes


@pytest.mark.hlo
@pytest.mark.parametrize(
    "n, length, width, d",
    [
        # Wide layers on short sequences: the layers' inputs are most of the activations,
        # which is where keeping them gives remat's saving back; their kernels take
        # ghost norms, so "auto" recomputes them in a second pass.
        (32, T, 256, 96),
        # Narrow layers on long sequences: every layer takes the layer rule, and "auto"
        # keeps the per-example gradients (n x the blocks' parameters) in one pass.
        (8, 256, 64, 32),
    ],
)
def test_recomputing_keeps_remats_memory(n, length, width, d):
    model = Stack(layers=6, width=width, dtype=jnp.float32)
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (n, length, d))
    y = jax.random.normal(ky, (n, length, 2))
    params = model.init(jax.random.key(0), x[:1])["params"]

    def loss(p, x, y):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    args = (params, x, y)
    plain = temp(jax.value_and_grad(loss), *args)
    temps = {
        m: temp(privacy.clipped_grad(loss, 1.0, batch_argnums=(1, 2), remat=m), *args)
        for m in ("auto", "recompute", "save")
    }
    one_pass = not any(
        leaf.second_pass
        for leaf in privacy.clipped_grad(loss, 1.0, batch_argnums=(1, 2)).plan(*args)
    )
    assert one_pass == (length > T)
    assert temps["recompute"] <= 1.5 * plain, (temps, plain)
    assert temps["auto"] <= 1.5 * plain, (temps, plain)
    assert temps["recompute"] < temps["save"], (temps, plain)
    assert temps["auto"] < temps["save"], (temps, plain)


def shifted(params, x):
    """Gemma's RMSNorm scale, `1 + scale`; a weight with a constant taken off, `w - c`;
    and `c - v`, whose sign flips (materialized: its gradient is not the output's)."""
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1.0 + params["scale"])
    h = jnp.tanh(h @ (params["w"] - 0.5))
    return jnp.mean((h @ (2.0 - params["v"])) ** 2)


def test_a_constant_added_to_a_weight_keeps_it_on_the_fast_path(x64):
    with x64():
        ks = jax.random.split(jax.random.key(4), 4)
        params = {
            "scale": jax.random.normal(ks[0], (D,), F64) * 0.1,
            "w": jax.random.normal(ks[1], (D, D), F64),
            "v": jax.random.normal(ks[2], (D, 2), F64),
        }
        x = jax.random.normal(ks[3], (N, T, D), F64)
        body = jax.checkpoint(shifted)
        fast = privacy.clipped_grad(body, C)
        ref = privacy.clipped_grad(body, C, method="per_example")
        close(jax.jit(fast)(params, x), jax.jit(ref)(params, x))
        plan = {leaf.path: leaf for leaf in fast.plan(params, x)}
        assert plan["['scale']"].method == "layer" and plan["['scale']"].recomputed
        assert plan["['w']"].method in ("ghost", "layer") and plan["['w']"].recomputed
        assert plan["['v']"].method == "materialized"
