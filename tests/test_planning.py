"""Tests for gradaccum_jax.plan_microbatches and num_microbatches="auto"."""

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _examples import load_example
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._sharding import compiled_memory

B, WIDTH, HIDDEN = 64, 16, 256


def loss_fn(params, batch):
    # Hidden-sized activations per example dominate the memory.
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _arrays(batch_size=B):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k1, (WIDTH, HIDDEN)) / WIDTH**0.5,
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / HIDDEN**0.5,
    }
    batch = {
        "x": jax.random.normal(k3, (batch_size, WIDTH)),
        "y": jax.random.normal(k4, (batch_size, 1)),
    }
    return params, batch


def _shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


PARAMS, BATCH = _arrays()


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _full_peak():
    return ga.plan_microbatches(loss_fn, PARAMS, BATCH, memory_budget=2**62).table[1]


@pytest.mark.slow
@pytest.mark.hlo
def test_chosen_k_fits_and_the_next_smaller_divisor_does_not():
    budget = _full_peak() // 3
    plan = ga.plan_microbatches(loss_fn, _shapes(PARAMS), _shapes(BATCH), memory_budget=budget)
    k = plan.num_microbatches
    smaller = _divisors(B)[_divisors(B).index(k) - 1]
    assert k > 1 and plan.microbatch_size == B // k and plan.memory_budget == budget
    assert plan.peak_bytes == plan.table[k] <= budget
    assert plan.table[smaller] > budget
    # The peak is exactly temp + argument + output - alias of the compiled program.
    compiled = jax.jit(ga.microbatch_value_and_grad(loss_fn, k)).lower(PARAMS, BATCH).compile()
    expected = harness.compiled_memory(compiled).peak_bytes
    assert plan.peak_bytes == expected
    assert list(plan.table) == sorted(plan.table)


@pytest.mark.hlo
def test_batch_of_1024_takes_at_most_four_compilations_and_a_second_plan_none(monkeypatch):
    compiled = []
    peak_bytes = compiled_memory.peak_bytes

    def counting_peak_bytes(program):
        compiled.append(program)
        return peak_bytes(program)

    monkeypatch.setattr(compiled_memory, "peak_bytes", counting_peak_bytes)
    params = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
    batch = jax.ShapeDtypeStruct((1024, 4), jnp.float32)

    for budget in (1, 2**40):  # nothing fits; everything fits
        compiled.clear()

        def tiny(params, x):  # a new function each time: nothing cached
            return jnp.mean(jnp.tanh(x @ params["w"]))

        try:
            plan = ga.plan_microbatches(tiny, params, batch, memory_budget=budget)
        except ValueError:
            plan = None
        # 11 divisors of 1024: a binary search compiles at most ceil(log2(12)) programs.
        assert 3 <= len(compiled) <= 4
    assert plan.num_microbatches == 1 and len(plan.table) == len(compiled)
    compiled.clear()
    ga.plan_microbatches(tiny, params, batch, memory_budget=2**40)
    assert not compiled


@pytest.mark.plans
def test_auto_equals_full_batch_and_the_planned_k():
    budget = _full_peak() // 3
    plan = ga.plan_microbatches(loss_fn, PARAMS, BATCH, memory_budget=budget)
    auto = jax.jit(ga.microbatch_value_and_grad(loss_fn, "auto", memory_budget=budget))
    value, grads = auto(PARAMS, BATCH)
    full_value, full_grads = jax.jit(jax.value_and_grad(loss_fn))(PARAMS, BATCH)
    np.testing.assert_allclose(value, full_value, rtol=1e-5)
    for g, f in zip(jax.tree.leaves(grads), jax.tree.leaves(full_grads), strict=True):
        np.testing.assert_allclose(g, f, rtol=1e-5, atol=1e-7)
    # Behaves exactly like the chosen K: the same program, bit-identical results.
    fixed = jax.jit(ga.microbatch_value_and_grad(loss_fn, plan.num_microbatches))
    for a, b in zip(
        jax.tree.leaves((value, grads)), jax.tree.leaves(fixed(PARAMS, BATCH)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def _table_in(message):
    return ast.literal_eval(re.search(r"peaks by K: (\{.*?\})", message).group(1))


@pytest.mark.hlo
def test_candidates_respect_explicit_batch_sharding(explicit_mesh):
    mesh = explicit_mesh
    batch = jax.device_put(BATCH, NamedSharding(mesh, P("data")))
    params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match="no number of micro-batches fits") as error:
        ga.plan_microbatches(loss_fn, params, batch, memory_budget=1)
    table = _table_in(str(error.value))
    # Every micro-batch must split over the 8 devices: K in {1, 2, 4, 8}, and
    # the search for an impossible budget ends at the largest of them.
    assert set(table) <= {1, 2, 4, 8} and 8 in table


# The first refusal comes after the planner compiled and measured its candidates.
@pytest.mark.plans
def test_errors():
    with pytest.raises(ValueError, match="no number of micro-batches fits") as error:
        ga.plan_microbatches(loss_fn, PARAMS, BATCH, memory_budget=1024)
    table = _table_in(str(error.value))
    smallest = min(table, key=table.get)
    assert f"smallest peak found is {table[smallest]} bytes" in str(error.value)
    assert f"at num_microbatches={smallest}," in str(error.value)
    with pytest.raises(ValueError, match=r"reports no memory limit.*memory_budget="):
        ga.plan_microbatches(loss_fn, PARAMS, BATCH)
    with pytest.raises(ValueError, match=r"reports no memory limit.*memory_budget="):
        jax.jit(ga.microbatch_value_and_grad(loss_fn, "auto"))(PARAMS, BATCH)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['num_micro'\]"):
        ga.plan_microbatches(loss_fn, PARAMS, BATCH, memory_budget=2**30, num_micro=2)
    with pytest.raises(ValueError, match="memory_budget must be finite and > 0"):
        ga.plan_microbatches(loss_fn, PARAMS, BATCH, memory_budget=-1)
    with pytest.raises(ValueError, match="num_microbatches='auto' with memory_budget"):
        ga.microbatch_value_and_grad(loss_fn, 4, memory_budget=2**30)
    with pytest.raises(ValueError, match="memory_budget must be finite and > 0"):
        ga.microbatch_value_and_grad(loss_fn, "auto", memory_budget=0)
    with pytest.raises(ValueError, match="same leading"):
        ga.plan_microbatches(loss_fn, PARAMS, {**BATCH, "y": BATCH["y"][:60]}, memory_budget=2**30)


@pytest.mark.slow
@pytest.mark.plans
def test_docs_page_code_runs():
    # Every Python block of docs/choosing_k.md, in order, in one namespace.
    page = pathlib.Path(__file__).parents[1] / "docs" / "choosing_k.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(blocks) == 4  # the plan (2), the noise scale (2)
    ns: dict = {}
    for n, block in enumerate(blocks):
        exec(compile(block, f"{page.name}[block {n}]", "exec"), ns)
    assert ns["plan"].num_microbatches > 1


@pytest.mark.slow
@pytest.mark.plans
def test_example_plan_microbatches(capsys):
    result = load_example("plan_microbatches").main([])
    printed = capsys.readouterr().out
    plan = result["plan"]
    assert "chosen K=" in printed and "peak MiB" in printed
    # The full batch needs several times the budget; the plan fits it.
    assert result["full_peak"] > 3 * result["budget"]
    assert plan.peak_bytes <= result["budget"] and plan.num_microbatches > 1
    assert result["max_grad_diff"] < 1e-5


def fsdp_loss(params, batch):
    # FSDP on an explicit mesh: each param is gathered at use (none to gather off the mesh).
    if not jax.sharding.get_abstract_mesh().empty:
        params = jax.tree.map(lambda x: jax.sharding.reshard(x, P()), params)
    return loss_fn(params, batch)


@pytest.mark.hlo
def test_fsdp_params_are_planned_with_their_sharding():
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=explicit)
    params0, batch0 = _arrays(batch_size=1024)
    specs = {"w1": P(None, "fsdp"), "w2": P("fsdp", None)}
    peaks, peak_bytes = [], compiled_memory.peak_bytes

    def spy(compiled):
        peaks.append(compiled.memory_analysis().argument_size_in_bytes)
        return peak_bytes(compiled)

    with jax.set_mesh(mesh):
        params = jax.device_put(params0, specs)
        batch = jax.device_put(batch0, P(("data", "fsdp")))
        full = ga.plan_microbatches(fsdp_loss, params, batch, memory_budget=2**62).table[1]
        plan = ga.plan_microbatches(fsdp_loss, params, batch, memory_budget=full // 2)
        assert plan.num_microbatches > 1
        replicated = jax.device_put(params0, P())
        assert full < ga.plan_microbatches(loss_fn, replicated, batch, memory_budget=2**62).table[1]
        # Planned inside jit (tracers), the params keep their sharding: the same plan.
        compiled_memory._PEAKS.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(compiled_memory, "peak_bytes", spy)
            auto = ga.microbatch_value_and_grad(fsdp_loss, "auto", memory_budget=full // 2)
            value, grads = jax.jit(auto)(params, batch)
        shard_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
        batch_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(batch))
        assert set(peaks) == {shard_bytes + batch_bytes}
    for name, spec in specs.items():
        assert jax.typeof(grads[name]).sharding.spec == spec
    want = jax.jit(jax.value_and_grad(loss_fn))(params0, batch0)
    np.testing.assert_allclose(value, want[0], rtol=1e-5)
    for name in specs:
        np.testing.assert_allclose(grads[name], want[1][name], rtol=1e-5, atol=1e-6)
