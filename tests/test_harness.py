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
import pytest

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
