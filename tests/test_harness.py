"""The measuring harness (benchmarks/harness.py) reads compiled HLO the way the tests rely on."""

import gc
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import gradaccum_jax as ga
from benchmarks import harness
from gradaccum_jax._base import compat

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A hand-written module in the printed form of XLA:CPU: a combined all-reduce whose
# tuple type has spaces and an index comment, an asynchronous pair, a conditional
# whose boundary branch reduces, and a copy of a broadcast made by a fusion.
HLO = """\
HloModule jit_step

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_broadcast_computation (p: f32[]) -> f32[4,4] {
  %p = f32[] parameter(0)
  ROOT %b = f32[4,4]{1,0} broadcast(%p), dimensions={}
}

%skip (arg: (f32[4,4], f32[4,4])) -> (f32[4,4], f32[4,4]) {
  %arg = (f32[4,4]{1,0}, f32[4,4]{1,0}) parameter(0)
  %zero = f32[] constant(0)
  %wrapped_broadcast = f32[4,4]{1,0} fusion(%zero), kind=kLoop, calls=%wrapped_broadcast_computation
  %copy.1 = f32[4,4]{1,0} copy(%wrapped_broadcast)
  ROOT %t = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%wrapped_broadcast, %copy.1)
}

%apply (arg: (f32[4,4], f32[4,4])) -> (f32[4,4], f32[4,4]) {
  %arg = (f32[4,4]{1,0}, f32[4,4]{1,0}) parameter(0)
  %a = f32[4,4]{1,0} get-tuple-element(%arg), index=0
  %b = f32[4,4]{1,0} get-tuple-element(%arg), index=1
  %c = f32[2]{0} constant({1, 2})
  %ar = (f32[4,4]{1,0}, f32[4,4]{1,0}, f32[], f32[], f32[], \
/*index=5*/f32[2]{0}) all-reduce(%a, %b, %zero, %zero, %zero, \
/*index=5*/%c), replica_groups={}, to_apply=%add
  %copy.2 = f32[4,4]{1,0} copy(%a)
  ROOT %t = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%copy.2, %b)
}

ENTRY %main (p0: f32[4,4], p1: f32[4,4], flag: pred[]) -> (f32[4,4], f32[4,4]) {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  %flag = pred[] parameter(2)
  %start = f32[4,4]{1,0} all-reduce-start(%p0), replica_groups={}, to_apply=%add
  %done = f32[4,4]{1,0} all-reduce-done(%start)
  %pair = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%done, %p1)
  %copy.3 = f32[4,4]{1,0} copy(%p1)
  ROOT %cond = (f32[4,4]{1,0}, f32[4,4]{1,0}) conditional(%flag, %pair, %pair), \
branch_computations={%skip, %apply}
}
"""


def test_regions_and_collectives():
    hlo = harness.Hlo(HLO)
    assert hlo.entry == "main"
    assert hlo.every_step() == {"main", "add"}
    assert hlo.conditionals() == [["skip", "apply"]]
    assert [op.name for op in hlo.ops("all-reduce", hlo.every_step())] == ["start"]
    (combined,) = hlo.ops("all-reduce", hlo.reachable(["apply"]))
    assert combined.elements == 2 * 16 + 3 + 2
    assert combined.nbytes == 4 * combined.elements
    # The asynchronous op runs on each of K calls, the combined one once per window.
    assert hlo.per_window("all-reduce", 4) == (4 + 1, 4 * 16 * 4 + 4 * 37)
    assert hlo.collective_counts()["all-reduce"] == 2


def test_copies_and_their_sources():
    hlo = harness.Hlo(HLO)
    copies = {c.name: hlo.source(c) for c in hlo.copies(16)}
    assert copies == {"copy.1": "broadcast", "copy.2": "get-tuple-element", "copy.3": "parameter"}
    assert [c.name for c in hlo.copies(16, within=[hlo.entry])] == ["copy.3"]
    assert hlo.copies(17) == []


@pytest.mark.hlo
def test_compiled_program_and_memory():
    def step(state, g):
        return jax.tree.map(jnp.add, state, g)

    tree = {"a": jnp.zeros((8, 8)), "b": jnp.zeros((8, 8))}
    compiled = jax.jit(step, donate_argnums=0).lower(tree, tree).compile()
    memory = harness.compiled_memory(compiled)
    assert memory.argument_bytes == 2 * 2 * 8 * 8 * 4
    # Each donated leaf aliases its output: counted once in the peak.
    assert memory.alias_bytes == 2 * 8 * 8 * 4 <= memory.output_bytes
    assert memory.peak_bytes < memory.argument_bytes + memory.output_bytes
    assert harness.Hlo(compiled).copies(1) == []


# A hand-written module in the printed form of the TPU compiler (libtpu 0.0.42.1, compiled
# for a topology without a TPU): tiled layouts with memory spaces, a prefetch into VMEM
# (`S(1)`), an all-gather split into the steps of one chain (async collective fusion), a
# reduce-scatter wrapped by async-start/async-done, an asynchronous collective-permute, a
# counted loop without `known_trip_count` whose counter lives in scalar memory (`S(6)`),
# and a mesh's replica groups without device ids.
TPU_HLO = """\
HloModule jit_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[]{:T(128)} parameter(0)
  %y = f32[]{:T(128)} parameter(1)
  ROOT %sum = f32[]{:T(128)} add(%x, %y)
}

%bitcast_fusion (b: f32[256,128]) -> f32[256,128] {
  %b = f32[256,128]{1,0:T(8,128)} parameter(0)
  ROOT %c = f32[256,128]{1,0:T(8,128)} bitcast(%b)
}

%gather_first (p: f32[256,128]) -> (f32[256,128], f32[1024,128], u32[]) {
  %p = f32[256,128]{1,0:T(8,128)} parameter(0)
  %all-gather.1 = f32[1024,128]{1,0:T(8,128)} all-gather(%p), channel_id=1, \
replica_groups={{0,1,2,3}}, dimensions={0}, frontend_attributes={chain_id="0"}
  %ctx = u32[]{:S(2)} constant(0)
  ROOT %t = (f32[256,128]{1,0:T(8,128)}, f32[1024,128]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) \
tuple(%p, %all-gather.1, %ctx)
}

%gather_last (p: f32[256,128], g: f32[1024,128]) -> f32[1024,128] {
  %p = f32[256,128]{1,0:T(8,128)} parameter(0)
  %inner = f32[256,128]{1,0:T(8,128)} fusion(%p), kind=kLoop, calls=%bitcast_fusion
  ROOT %all-gather.2 = f32[1024,128]{1,0:T(8,128)} all-gather(%inner), channel_id=1, \
replica_groups={{0,1,2,3}}, dimensions={0}, frontend_attributes={chain_id="0"}
}

%wrapped_reduce_scatter (w: f32[1024,128]) -> f32[256,128] {
  %w = f32[1024,128]{1,0:T(8,128)} parameter(0)
  ROOT %rs = f32[256,128]{1,0:T(8,128)} reduce-scatter(%w), replica_groups={{0,1,2,3}}, \
dimensions={0}, to_apply=%add
}

%body (arg: (s32[], f32[256,128])) -> (s32[], f32[256,128]) {
  %arg = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%arg), index=0
  %i.1 = s32[]{:T(128)S(6)} copy(%i)
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i.1, %one)
  %v = f32[256,128]{1,0:T(8,128)} get-tuple-element(%arg), index=1
  %ar = f32[256,128]{1,0:T(8,128)} all-reduce(%v), channel_id=2, \
replica_groups=mesh['data'=2,'model'=2] {'data'}, use_global_device_ids=true, to_apply=%add
  ROOT %out = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) tuple(%next, %ar)
}

%cond (arg: (s32[], f32[256,128])) -> pred[] {
  %arg = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%arg), index=0
  %n = s32[]{:T(128)} constant(5)
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

ENTRY %main (p0: f32[256,128], big: f32[1024,128]) -> (f32[256,128], f32[1024,128]) {
  %p0 = f32[256,128]{1,0:T(8,128)} parameter(0)
  %big = f32[1024,128]{1,0:T(8,128)} parameter(1)
  %copy-start = (f32[256,128]{1,0:T(8,128)S(1)}, f32[256,128]{1,0:T(8,128)}, u32[]{:S(2)}) \
copy-start(%p0)
  %in_vmem = f32[256,128]{1,0:T(8,128)S(1)} copy-done(%copy-start)
  %transposed = f32[256,128]{0,1:T(8,128)} copy(%p0)
  %gather-start = (f32[256,128]{1,0:T(8,128)}, f32[1024,128]{1,0:T(8,128)S(1)}, \
u32[]{:S(2)}) fusion(%p0), kind=kCustom, calls=%gather_first
  %part = f32[1024,128]{1,0:T(8,128)S(1)} get-tuple-element(%gather-start), index=1
  %gathered = f32[1024,128]{1,0:T(8,128)} fusion(%p0, %part), kind=kCustom, calls=%gather_last
  %rs-start = ((f32[1024,128]{1,0:T(8,128)}), f32[256,128]{1,0:T(8,128)}, s32[]{:S(2)}) \
async-start(%big), calls=%wrapped_reduce_scatter
  %rs-done = f32[256,128]{1,0:T(8,128)} async-done(%rs-start), calls=%wrapped_reduce_scatter
  %cp-start = (f32[256,128]{1,0:T(8,128)S(1)}, f32[256,128]{1,0:T(8,128)}, u32[]{:S(2)}, \
u32[]{:S(2)}) collective-permute-start(%in_vmem), channel_id=3, \
source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  %cp-done = f32[256,128]{1,0:T(8,128)} collective-permute-done(%cp-start)
  %zero = s32[]{:T(128)} constant(0)
  %zero.1 = s32[]{:T(128)S(6)} copy(%zero)
  %init = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) tuple(%zero.1, %cp-done)
  %loop = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) while(%init), condition=%cond, \
body=%body
  %result = f32[256,128]{1,0:T(8,128)} get-tuple-element(%loop), index=1
  ROOT %t = (f32[256,128]{1,0:T(8,128)}, f32[1024,128]{1,0:T(8,128)}) tuple(%result, %gathered)
}
"""
TILE = 256 * 128


def test_tpu_programs_layouts_prefetches_and_asynchronous_ops():
    hlo = harness.Hlo(TPU_HLO)
    assert hlo.entry == "main"
    (prefetch,) = hlo.memory_moves(TILE)
    assert prefetch.name == "copy-start" and prefetch.memory_spaces == (1,)
    # The start's result is its done's: one tile, not the pair of buffers and a context.
    assert prefetch.types == (("f32", (256, 128)),) and prefetch.nbytes == 4 * TILE
    assert [c.name for c in hlo.copies(TILE)] == ["transposed"]  # a relayout in HBM
    # The chain's two all-gathers are one op, its first step; the async-done that names
    # the wrapped reduce-scatter again does not run it twice.
    (gather,) = hlo.ops("all-gather")
    assert gather.name == "all-gather.1" and hlo.place(gather) == "main"
    assert hlo.runs("all-gather") == hlo.runs("reduce-scatter") == 1
    permute = hlo.ops("collective-permute")[0]
    assert permute.nbytes == 4 * TILE
    # Kernels: the entry's two fusions, not the one nested in a fusion's computation.
    assert [f.name for f in hlo.fusions()] == ["gather-start", "gathered"]


def test_tpu_loops_are_counted_from_their_counter():
    hlo = harness.Hlo(TPU_HLO)
    (loop,) = hlo.ops("while")
    assert "known_trip_count" not in loop.attributes
    assert hlo.trip_count(loop) == 5 and hlo.runs("all-reduce") == 5
    # A loop whose bound is not a constant is not counted: no guess.
    unbounded = TPU_HLO.replace(
        "%n = s32[]{:T(128)} constant(5)", "%n = s32[]{:T(128)} add(%i, %i)"
    )
    hlo = harness.Hlo(unbounded)
    with pytest.raises(ValueError, match="no known_trip_count"):
        hlo.trip_count(hlo.ops("while")[0])


def test_computation_runs_counts_loops_callees_and_not_reducers():
    # benchmarks/tpu_pod.py reads this: how often each computation runs per call.
    runs = harness.Hlo(TPU_HLO).computation_runs()
    # The loop's body its trip count, its condition once more; a fusion's or an
    # async-start's callee once (the async-done naming it again adds nothing); a
    # reduction's `to_apply` (per element) not at all.
    assert runs == {
        "main": 1,
        "gather_first": 1,
        "gather_last": 1,
        "bitcast_fusion": 1,
        "wrapped_reduce_scatter": 1,
        "body": 5,
        "cond": 6,
    }
    # Nested loops multiply: a loop of 3 (its count as XLA:CPU states it) inside the body.
    outer = TPU_HLO.replace(
        "ROOT %out = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) tuple(%next, %ar)",
        "%sub = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) while(%arg), condition=%cond3, "
        'body=%inner, backend_config={"known_trip_count":{"n":"3"}}\n'
        "  %w = f32[256,128]{1,0:T(8,128)} get-tuple-element(%sub), index=1\n"
        "  ROOT %out = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) tuple(%next, %w)",
    )
    inner = (
        "%inner (a: (s32[], f32[256,128])) -> (s32[], f32[256,128]) {\n"
        "  ROOT %a = (s32[]{:T(128)}, f32[256,128]{1,0:T(8,128)}) parameter(0)\n}\n\n"
        + "%cond3"
        + TPU_HLO.split("%cond", 1)[1].split("ENTRY", 1)[0]
    )
    nested = harness.Hlo(outer.replace("ENTRY", inner + "ENTRY", 1)).computation_runs()
    assert nested["body"] == 5 and nested["inner"] == 5 * 3 and nested["cond3"] == 5 * 4


def test_tpu_collectives_by_axes_place_and_mode():
    hlo = harness.Hlo(TPU_HLO)
    found = {
        c.op: (c.axes, c.place, c.in_loop, c.asynchronous, c.nbytes)
        for c in hlo.collectives({"data": 2, "model": 2})
    }
    assert found == {
        # mesh['data'=2,'model'=2] {'data'}: devices {0,2} and {1,3}.
        "all-reduce": (("data",), "every step", True, False, 4 * TILE),
        "all-gather": (("data", "model"), "every step", False, True, 4 * 4 * TILE),
        "reduce-scatter": (("data", "model"), "every step", False, True, 4 * TILE),
        # The pairs {0,2}, {1,3} cross "data" only.
        "collective-permute": (("data",), "every step", False, True, 4 * TILE),
    }
    assert harness.replica_groups("replica_groups=mesh['a'=2,'b'=2] {'b'}", 4) == [(0, 1), (2, 3)]


def test_interleaved_medians_alternate_the_order():
    calls = []
    medians = harness.interleaved_medians(
        {"x": lambda: calls.append("x"), "y": lambda: calls.append("y")}, repeats=3, warmup=1
    )
    assert calls == ["x", "y", "x", "y", "y", "x", "x", "y"]
    assert set(medians) == {"x", "y"} and all(t >= 0 for t in medians.values())


def test_interleaved_times_keep_every_round_and_ratio_quartiles_read_them():
    times = harness.interleaved_times({"x": lambda: None, "y": lambda: None}, repeats=5)
    assert {name: len(t) for name, t in times.items()} == {"x": 5, "y": 5}
    median, q1, q3 = harness.ratio_quartiles([2.0, 4.0, 6.0, 8.0, 10.0], [1.0] * 5)
    assert (q1, median, q3) == (4.0, 6.0, 8.0)
    assert harness.ratio_quartiles([3.0], [2.0]) == (1.5, 1.5, 1.5)


def test_the_benchmarks_page_names_every_benchmark_and_the_one_the_runner_leaves_out():
    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("run", root / "benchmarks" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    helpers = {"harness", "roofline", "run"}
    scripts = {p.stem for p in (root / "benchmarks").glob("*.py")} - helpers
    # privacy_opacus is the PyTorch peer that benchmarks/privacy.py runs in its own process.
    assert scripts - set(run.BENCHMARKS) == {"tpu_pod", "tpu_estimate", "privacy_opacus"}
    page = " ".join((root / "docs" / "benchmarks.md").read_text().split())
    assert (
        "Two benchmarks are not in the runner: `benchmarks/tpu_pod.py` and "
        "`benchmarks/tpu_estimate.py` need libtpu"
    ) in page


def test_no_entry_is_an_error():
    with pytest.raises(ValueError, match="ENTRY"):
        harness.Hlo("HloModule empty\n")


@pytest.mark.hlo
def test_bytes_moved_takes_the_ordinary_branch_of_a_boolean_fallback():
    from gradaccum_jax._base import trees

    x = jnp.ones((256, 256))

    def check_then_add(acc, g):
        ok = trees.all_finite_by_squares(g)
        return jnp.where(ok, acc + g, acc)

    hlo = harness.Hlo(jax.jit(check_then_add).lower(x, x).compile())
    assert len(hlo.conditionals()) == 1
    # Either `branch` counts the quick branch (nothing), not the exact fallback (a
    # read of g): the same total, at least the sums of squares (P) and the add (3 P).
    # (jax 0.8.1's compiler moves 6 P here, jax 0.10.2's 4 P.)
    assert hlo.bytes_moved(0) == hlo.bytes_moved(1) >= 4 * x.nbytes


def test_benchmark_parser_is_every_benchmarks_command_line():
    parser = harness.benchmark_parser("Times one thing.\n\nDetails.", reps="timed repetitions")
    assert parser.description == "Times one thing."
    assert vars(parser.parse_args([])) == {"quick": False, "reps": None}
    assert vars(parser.parse_args(["--quick", "--reps", "5"])) == {"quick": True, "reps": 5}
    plain = harness.benchmark_parser("Times another.", quick="small trees, one round")
    assert vars(plain.parse_args(["--quick"])) == {"quick": True}
    assert "small trees, one round" in plain.format_help()
    # Every benchmark builds its command line here (run.py, the runner, has its own, and
    # privacy_opacus.py runs in a Python with torch, without this project's packages).
    for script in sorted(pathlib.Path(harness.__file__).parent.glob("*.py")):
        source = script.read_text()
        if "def main(" in source and script.name not in ("run.py", "privacy_opacus.py"):
            assert "harness.benchmark_parser(__doc__" in source, script.name
            assert "argparse" not in source, script.name


@pytest.mark.hlo
def test_runs_multiplies_ops_by_their_loops_trip_counts(explicit_mesh):
    # A psum per outer step, three per inner step (a scan inside the scan), one in a
    # cond's branch (at most once per outer step), and one after the loops.
    mesh = explicit_mesh

    def reduced(c):
        return compat.pcast_to_varying(jax.lax.psum(c, "data"), "data")

    def per_device(x):
        def outer(c, _):
            c = c + jax.lax.psum(jnp.sin(c), "data")
            c = jax.lax.scan(lambda c, _: (c * 0.5 + jax.lax.psum(c, "data"), None), c, length=3)[0]
            c = jax.lax.cond(c.sum() > 0, reduced, lambda c: c, c)
            return c, None

        c = jax.lax.scan(outer, x, length=5)[0]
        return c + jax.lax.psum(c, "data")

    step = jax.shard_map(per_device, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))
    x = jax.device_put(jnp.ones((8, 4)), jax.NamedSharding(mesh, jax.P("data")))
    hlo = harness.Hlo(jax.jit(step).lower(x).compile())
    assert hlo.runs("all-reduce") == 5 * (1 + 3 + 1) + 1
    assert len(hlo.ops("all-reduce", hlo.in_loops())) == 3
    assert hlo.runs("collective-permute") == 0


def test_the_suite_frees_compiled_programs_before_the_kernels_map_limit():
    # conftest.py: a worker running half the suite passed Linux's 65,530 memory maps
    # (XLA:CPU maps three regions per compiled kernel) and crashed in the next compile.
    # The repository's conftest.py, by its path: `import conftest` finds tests/conftest.py.
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    assert conftest._release_when_crowded(None) is False  # no /proc: nothing done
    found = conftest._mapped_regions()
    if found is None and not pathlib.Path("/proc/self/maps").exists():
        pytest.skip("no /proc/self/maps on this system: the release can only do nothing")
    assert found is not None and found[0] > 0 and found[1] > 0, found

    # Jitted functions that stay alive, as a test module's do: their programs stay mapped
    # until the caches are cleared.
    steps = [jax.jit(lambda x, i=i: x * i + 1.0) for i in range(20)]
    for step in steps:
        step(1.0)
    gc.collect()
    before = conftest._mapped_regions()[0]
    assert conftest._release_when_crowded((before, 65530)) is False  # below half: kept
    assert conftest._mapped_regions()[0] >= before
    assert conftest._release_when_crowded((40000, 65530)) is True
    assert conftest._mapped_regions()[0] < before - 20, (before, conftest._mapped_regions())


def test_every_slow_case_names_a_test_of_the_suite():
    # tests/slow_cases.txt moves cases to the slow tier by node id; an id that names no
    # test (a renamed test, or one cut at a space of its parameters' id) would leave its
    # case in the quick tier without a word.
    import conftest  # tests/conftest.py, which reads the file

    root = pathlib.Path(__file__).resolve().parents[1]
    assert conftest.SLOW_CASES
    for nodeid in conftest.SLOW_CASES:
        path, _, name = nodeid.partition("::")
        function, bracket, params = name.partition("[")
        assert (root / path).is_file(), nodeid
        # A test function, or a doctest (`module.function`), defined or assigned there.
        name = function.rsplit(".", 1)[-1]
        assert re.search(rf"\b{name}\b", (root / path).read_text()), nodeid
        assert not bracket or (params.endswith("]") and params.count("[") < params.count("]")), (
            nodeid
        )


# A micro-step of accumulate(adam) and a shard_map window with its all-reduce: programs
# whose optimised HLO differs between the suite's fast settings and XLA's defaults.
AHEAD_OF_TIME = """
import hashlib, json, re
import jax, jax.numpy as jnp, optax
import gradaccum_jax as ga
from jax.sharding import PartitionSpec as P

def facts(compiled):
    memory = compiled.memory_analysis()
    # The program without its source locations (the stack frames' tables and each op's
    # metadata) and without the names' numeric suffixes.
    lines = [
        re.sub(r", metadata=[{][^}]*[}]", "", line)
        for line in compiled.as_text().splitlines()
        if not re.match(r"(\\d+ |FileNames|FunctionNames|FileLocations|StackFrames)", line)
    ]
    text = re.sub(r"[.]\\d+", "", "\\n".join(lines))
    return {
        "hlo": hashlib.sha1(text.encode()).hexdigest(),
        "fusions": text.count(" fusion("),
        "bytes": [memory.temp_size_in_bytes, memory.argument_size_in_bytes,
                  memory.output_size_in_bytes, memory.alias_size_in_bytes],
    }

def programs(compile):
    params = {"w1": jnp.ones((64, 128)), "b1": jnp.ones(128), "w2": jnp.ones((128, 64))}
    tx = ga.accumulate(optax.adam(1e-3), 4)
    step = lambda state, g: tx.update(g, state, params)[::-1]
    grads = jax.tree.map(jnp.ones_like, params)
    yield compile(jax.jit(step, donate_argnums=0).lower(tx.init(params), grads))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = ga.accumulate(optax.sgd(0.1), 4, axis_name="data")
    def local(p, s, x):
        g = jax.grad(lambda p, x: jnp.mean(jnp.tanh(x @ p["w1"]) ** 2))(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    p = {"w1": jnp.ones((16, 8))}
    specs = dict(in_specs=(P(), P(), P("data")), out_specs=(P(), P()), check_vma=False)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, **specs))
    yield compile(fn.lower(p, tx.init(p), jnp.ones((64, 16))))
"""


@pytest.mark.slow  # a second process with jax, and eight programs: about 10 s
@pytest.mark.hlo
def test_programs_compiled_ahead_of_time_are_those_of_xla_defaults():
    # conftest.py compiles the programs a test runs with faster settings, and every program
    # compiled ahead of time, the one each check of a compiled program reads, with XLA's
    # defaults (`XLA_DEFAULTS`): here the same program from a process that never set the
    # faster ones is the same, op for op and byte for byte.
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    if not conftest.FAST:
        pytest.skip("GRADACCUM_XLA_DEFAULTS=1: every program is compiled with XLA's defaults")
    scope: dict = {}
    exec(AHEAD_OF_TIME, scope)
    here = [scope["facts"](c) for c in scope["programs"](lambda lowered: lowered.compile())]
    fast = {key: not value for key, value in conftest.XLA_DEFAULTS.items()}
    fast["xla_backend_optimization_level"] = 0
    ran_fast = [scope["facts"](c) for c in scope["programs"](lambda low: low.compile(fast))]

    script = AHEAD_OF_TIME + (
        "print(json.dumps([facts(c) for c in programs(lambda lowered: lowered.compile())]))"
    )
    env = {
        **{k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"},
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_COMPILATION_CACHE_DIR": "",
        "GRADACCUM_XLA_DEFAULTS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    defaults = json.loads(proc.stdout.strip().splitlines()[-1])
    assert here == defaults
    # The comparison can tell: the faster settings give other programs.
    assert all(f["hlo"] != d["hlo"] for f, d in zip(ran_fast, defaults, strict=True))


def _compiles_with_xla_defaults() -> bool:
    """Whether a program compiled ahead of time now gets XLA's defaults (conftest.py)."""
    compile_ = jax.stages.Lowered.compile
    return not hasattr(compile_, "xla_defaults") or compile_.active


def _fast_settings() -> bool:
    return os.environ.get("GRADACCUM_XLA_DEFAULTS", "") in ("", "0")


@pytest.mark.hlo
def test_a_check_of_a_compiled_program_compiles_it_with_xla_defaults():
    assert _compiles_with_xla_defaults()


def test_other_tests_compile_ahead_of_time_with_the_fast_settings():
    # A planner's candidates inside a behavioural test or an example: the fast settings, as
    # for the programs the test runs (tests/conftest.py switches per test).
    assert _compiles_with_xla_defaults() is not _fast_settings()
    if _fast_settings():
        # A micro-step of accumulate: its optimised HLO differs between the two settings.
        params = {"w": jnp.ones((64, 128))}
        tx = ga.accumulate(optax.sgd(0.1), 4)
        step = jax.jit(lambda state, g: tx.update(g, state, params))
        lowered = step.lower(tx.init(params), params)
        # Read past the suite's record of readers (tests/conftest.py): this test reads a
        # program of the fast settings on purpose.
        text = getattr(jax.stages.Compiled.as_text, "__wrapped__", jax.stages.Compiled.as_text)
        compile_ = jax.stages.Lowered.compile
        compile_.active = True  # what the wrapper adds, and only then
        try:
            with_defaults = text(lowered.compile())
        finally:
            compile_.active = False
        assert text(lowered.compile()) != with_defaults
