"""Tests for clipped_grad's chunks (gradaccum_jax._privacy.chunks): `microbatch_size="auto"`
and `ClippedGradFn.plan_memory`, the largest chunk whose compiled program fits a budget."""

import ast
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradaccum_jax import privacy
from gradaccum_jax._sharding import compiled_memory

B, D_IN, D_HID, D_OUT = 64, 8, 128, 2
C = 0.5
METHOD = pytest.mark.parametrize("method", ["fast", "per_example"])


def loss(params, batch):
    # Hidden-sized activations per example dominate the memory of a chunk.
    x, y = batch
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def dropout_loss(params, key, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"])
    h = jnp.where(jax.random.bernoulli(key, 0.5, h.shape), 2.0 * h, 0.0)
    return jnp.mean((h @ params["w2"] - y) ** 2)


def init(n=B):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k1, (D_IN, D_HID)) / D_IN**0.5,
        "w2": jax.random.normal(k2, (D_HID, D_OUT)) / D_HID**0.5,
    }
    batch = (jax.random.normal(k3, (n, D_IN)), jax.random.normal(k4, (n, D_OUT)))
    return params, batch


PARAMS, BATCH = init()


def divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def compiled_peak(fn, *args, **kwargs):
    return compiled_memory.peak_bytes(jax.jit(fn).lower(*args, **kwargs).compile())


def assert_tree_close(got, want, rtol):
    # float32 sums taken in another order: relative to each leaf's scale.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = float(np.max(np.abs(w))) or 1.0
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


def assert_tree_equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)


def budget_between_chunks(method, k=4, **options):
    """A budget that `k` chunks fit and `k // 2` do not."""
    peaks = [
        compiled_peak(
            privacy.clipped_grad(loss, C, num_microbatches=j, method=method, **options),
            PARAMS,
            BATCH,
        )
        for j in (k // 2, k)
    ]
    assert peaks[1] < peaks[0]
    return (peaks[0] + peaks[1]) // 2


@pytest.mark.hlo
@METHOD
def test_the_chosen_size_fits_and_the_next_larger_does_not(method):
    budget = budget_between_chunks(method)
    fn = privacy.clipped_grad(loss, C, method=method)
    plan = fn.plan_memory(PARAMS, BATCH, memory_budget=budget)
    assert plan.num_microbatches == 4 and plan.microbatch_size == B // 4
    assert plan.memory_budget == budget and plan.peak_bytes == plan.table[4] <= budget
    # The neighbours compiled on their own: the chosen size's peak is the program's, and
    # the next larger size (the next smaller divisor K) does not fit.
    fixed = privacy.clipped_grad(loss, C, microbatch_size=plan.microbatch_size, method=method)
    assert compiled_peak(fixed, PARAMS, BATCH) == plan.peak_bytes
    larger = privacy.clipped_grad(loss, C, microbatch_size=2 * plan.microbatch_size, method=method)
    assert compiled_peak(larger, PARAMS, BATCH) > budget
    assert set(plan.table) <= set(divisors(B)) and list(plan.table) == sorted(plan.table)


@pytest.mark.hlo
@METHOD
def test_auto_under_jit_equals_the_unchunked_sums_and_the_chosen_size(method):
    budget = budget_between_chunks(method)
    padding = np.arange(B) % 7 == 3
    auto = privacy.clipped_grad(
        loss,
        C,
        microbatch_size="auto",
        memory_budget=budget,
        method=method,
        return_grad_norms=True,
    )
    got = jax.jit(auto)(PARAMS, BATCH, is_padding_example=padding)
    plan = auto.plan_memory(PARAMS, BATCH, is_padding_example=padding)
    assert plan.peak_bytes <= budget < plan.table[plan.num_microbatches // 2]
    whole = privacy.clipped_grad(loss, C, method=method, return_grad_norms=True)
    assert_tree_close(got, jax.jit(whole)(PARAMS, BATCH, is_padding_example=padding), 1e-6)
    # Exactly the call with the chosen size: the same program, the same bits.
    fixed = privacy.clipped_grad(
        loss, C, microbatch_size=plan.microbatch_size, method=method, return_grad_norms=True
    )
    assert_tree_equal(got, jax.jit(fixed)(PARAMS, BATCH, is_padding_example=padding))


@pytest.mark.hlo
def test_a_call_reuses_the_peaks_its_plan_compiled(monkeypatch):
    budget = budget_between_chunks("fast")
    auto = privacy.clipped_grad(loss, C, microbatch_size="auto", memory_budget=budget)
    plan = auto.plan_memory(PARAMS, BATCH)
    compiled = []
    peak_bytes = compiled_memory.peak_bytes

    def counting_peak_bytes(program):
        compiled.append(program)
        return peak_bytes(program)

    monkeypatch.setattr(compiled_memory, "peak_bytes", counting_peak_bytes)
    jax.jit(auto)(PARAMS, BATCH)
    assert not compiled
    # Another budget on the same function compiles only the sizes not yet seen.
    other = auto.plan_memory(PARAMS, BATCH, memory_budget=2**40)
    assert other.num_microbatches == 1 and len(compiled) == len(set(other.table) - set(plan.table))
    # Shapes in, the same plan out.
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (PARAMS, BATCH))
    assert auto.plan_memory(*shapes) == plan


@pytest.mark.hlo
def test_inside_shard_map_one_devices_program_is_planned(auto_mesh):
    # The per-example keys use collectives over the map's axis: the plan compiles one
    # device's program over the axis's devices, and equals a plan of the device's shard.
    mesh = auto_mesh
    params, batch = init(n=8 * 16)
    key = jax.random.key(3)
    options = dict(batch_argnums=2, prng_argnum=1)
    whole = privacy.clipped_grad(dropout_loss, C, **options)
    local = jax.tree.map(lambda x: x[:16], batch)
    budget = whole.plan_memory(params, key, local, memory_budget=2**40).table[1] - 1
    auto = privacy.clipped_grad(
        dropout_loss, C, microbatch_size="auto", memory_budget=budget, **options
    )
    plans = []

    def body(params, key, batch):
        plans.append(auto.plan_memory(params, key, batch))
        return jax.lax.psum(auto(params, key, batch), "data")

    specs = (P(), P(), P("data"))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())
    got = jax.jit(mapped)(params, key, batch)
    (plan,) = plans
    assert 1 < plan.num_microbatches and plan.peak_bytes <= budget
    assert_tree_close(got, jax.jit(whole)(params, key, batch), 1e-5)


@pytest.mark.hlo
def test_under_global_view_the_sizes_divide_each_devices_shard(explicit_mesh):
    mesh = explicit_mesh
    params, batch = init(n=8 * 16)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    whole = privacy.clipped_grad(loss, C)
    budget = whole.plan_memory(params, batch, memory_budget=2**40).table[1] - 1
    auto = privacy.clipped_grad(loss, C, microbatch_size="auto", memory_budget=budget)
    plan = auto.plan_memory(params, batch)
    assert set(plan.table) <= set(divisors(16)) and plan.num_microbatches > 1
    assert plan.microbatch_size * plan.num_microbatches == 16
    if tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 9):
        # JAX 0.8.1 cannot compile the candidates on a traced Explicit mesh: refused,
        # naming the int chosen outside jit (concrete arrays plan fine, above).
        with pytest.raises(ValueError, match=r"'auto' plan inside jax\.jit.*plan_memory"):
            jax.jit(auto)(params, batch)
        return
    got = jax.jit(auto)(params, batch)
    assert_tree_close(got, jax.jit(whole)(params, batch), 1e-5)


@pytest.mark.slow
@pytest.mark.plans
def test_an_nnx_module_is_planned_on_its_split_state():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(D_IN, D_HID, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.out = nnx.Linear(D_HID, D_OUT, rngs=rngs)

        def __call__(self, x):
            return self.out(self.drop(jnp.tanh(self.hidden(x))))

    def net_loss(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    _, batch = init(n=16)
    whole = privacy.clipped_grad(net_loss, C)
    full = whole.plan_memory(Net(nnx.Rngs(0, dropout=1)), batch, memory_budget=2**40)
    auto = privacy.clipped_grad(
        net_loss, C, microbatch_size="auto", memory_budget=full.table[1] - 1
    )
    model = Net(nnx.Rngs(0, dropout=1))
    plan = auto.plan_memory(model, batch)  # the streams do not move
    assert plan.num_microbatches > 1
    fixed = privacy.clipped_grad(net_loss, C, microbatch_size=plan.microbatch_size)
    assert_tree_equal(auto(model, batch), fixed(Net(nnx.Rngs(0, dropout=1)), batch))


@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [
        (0, ValueError, "memory_budget must be finite and > 0"),
        (-1.0, ValueError, "memory_budget must be finite and > 0"),
        (float("nan"), ValueError, "memory_budget must be finite"),
        ("1GB", TypeError, "memory_budget must be a real number"),
        (True, TypeError, "memory_budget must be a real number"),
    ],
)
def test_a_bad_memory_budget_is_refused(budget, error, match):
    with pytest.raises(error, match=match):
        privacy.clipped_grad(loss, C, microbatch_size="auto", memory_budget=budget)
    with pytest.raises(error, match=match):
        privacy.clipped_grad(loss, C).plan_memory(PARAMS, BATCH, memory_budget=budget)


@pytest.mark.hlo
def test_a_budget_nothing_fits_names_the_smallest_peak():
    auto = privacy.clipped_grad(loss, C, microbatch_size="auto", memory_budget=1024)
    with pytest.raises(ValueError, match="fits memory_budget=1024 bytes") as error:
        jax.jit(auto)(PARAMS, BATCH)
    message = str(error.value)
    table = ast.literal_eval(re.search(r"peaks by K: (\{.*?\})", message).group(1))
    k = min(table, key=table.get)
    # The search for an impossible budget ends at the most chunks, one example each.
    assert B in table and set(table) <= set(divisors(B))
    assert f"the smallest peak found is {table[k]} bytes" in message
    assert f"at num_microbatches={k}, micro-batch size {B // k}" in message
    fixed = privacy.clipped_grad(loss, C, num_microbatches=k)
    assert compiled_peak(fixed, PARAMS, BATCH) == table[k]
    assert "Raise memory_budget" in message


def test_the_chunking_arguments_are_checked():
    with pytest.raises(ValueError, match=r"memory_budget chooses the chunk size.*'auto'"):
        privacy.clipped_grad(loss, C, microbatch_size=4, memory_budget=2**20)
    with pytest.raises(ValueError, match=r"memory_budget chooses the chunk size.*'auto'"):
        privacy.clipped_grad(loss, C, num_microbatches=4, memory_budget=2**20)
    with pytest.raises(ValueError, match=r"memory_budget chooses the chunk size.*'auto'"):
        privacy.clipped_grad(loss, C, memory_budget=2**20)
    with pytest.raises(ValueError, match=r"pass microbatch_size='auto'.*num_microbatches='auto'"):
        privacy.clipped_grad(loss, C, num_microbatches="auto")
    with pytest.raises(ValueError, match="at most one of num_microbatches and microbatch_size"):
        privacy.clipped_grad(loss, C, num_microbatches=2, microbatch_size="auto")
    with pytest.raises(TypeError, match=r"microbatch_size must be a Python int >= 1 or 'auto'"):
        privacy.clipped_grad(loss, C, microbatch_size="Auto")
    # memory_budget=None plans within the device's free memory, which a CPU does not report.
    with pytest.raises(ValueError, match=r"reports no memory limit.*memory_budget="):
        jax.jit(privacy.clipped_grad(loss, C, microbatch_size="auto"))(PARAMS, BATCH)
    with pytest.raises(ValueError, match="must carry the batch on its leading axis"):
        privacy.clipped_grad(loss, C).plan_memory(
            PARAMS, (BATCH[0], BATCH[1][:3]), memory_budget=2**30
        )
