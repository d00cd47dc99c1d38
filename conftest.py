"""Test configuration: 8 forced host devices, reproducible Hypothesis draws, the `requires` marker.

This file sits at the repository root so that pytest loads it before it imports
any module that imports jax.
"""

import gc
import importlib.metadata
import os
import re
import sys

import pytest
from hypothesis import settings

# Multi-device tests run on 8 CPU devices; XLA reads this flag once, when the
# backend starts, so it must be set before anything imports jax.
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs are kept on disk, keyed by their HLO, the compile options and the
# jax/jaxlib version: a rerun of the suite, the pytest-xdist workers, the examples run
# as subprocesses and `dev.sh test-wheel` reuse them instead of compiling again (on
# this 2-core machine a warm rerun of tests/test_accumulation.py takes a fifth of the
# cold one). `JAX_COMPILATION_CACHE_DIR=` (empty) turns the cache off.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), ".jax_cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Compilation is most of the suite's time (two thirds of tests/test_accumulation.py).
# Two settings make XLA:CPU compile about 3x faster: LLVM at -O0
# (`JAX_DISABLE_MOST_OPTIMIZATIONS`; the optimized HLO is the same) and the loop
# emitters instead of the MLIR fusion emitters (some reductions and selects stay
# unfused). The compiled code runs slower, and its results may differ in the last bits
# (reduction order), within every test's tolerance. They apply to the programs a test
# runs. A program compiled ahead of time (`jax.jit(f).lower(...).compile()`: how every
# check of a compiled program, and every planner of the library, gets its program) is
# compiled with XLA's defaults all the same, as far as they decide the program
# (`AHEAD_OF_TIME`, given as its `compiler_options`): a check reads the program a user gets,
# on every run
# (tests/test_harness.py compares it with the program of a process without these
# settings). This holds during the tests marked `hlo`, the checks of a compiled program;
# during the others (tests/conftest.py switches it per test) a program compiled ahead of
# time, such as a planner's candidates inside an example, gets the fast settings like the
# programs the test runs (XLA's defaults doubled the time of examples/dp_lm.py's test).
# `GRADACCUM_XLA_DEFAULTS=1` keeps XLA's defaults for every program (`dev.sh test-wheel`
# runs the wheel's tests that way).
XLA_DEFAULTS = {
    "xla_backend_optimization_level": 3,
    "xla_llvm_disable_expensive_passes": False,
    "xla_cpu_use_fusion_emitters": True,
}
# What a check reads (the optimised HLO, its fusions and buffers: `as_text()`,
# `memory_analysis()`, `cost_analysis()`) is decided before LLVM runs: the fusion emitters
# are XLA's default, LLVM's optimisation level does not change the program. So checks get
# their programs with LLVM at -O0 (16-35 % less compile time than at -O3 on the programs
# measured here); tests/test_harness.py compares them with a process that has XLA's
# defaults throughout.
AHEAD_OF_TIME = {
    **XLA_DEFAULTS,
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}
FAST = os.environ.get("GRADACCUM_XLA_DEFAULTS", "") in ("", "0")
if FAST:
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    _FAST = "--xla_cpu_use_fusion_emitters=false"
    if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + _FAST

    import functools

    import jax.stages

    _compile = jax.stages.Lowered.compile
    if not hasattr(_compile, "xla_defaults"):  # once, if this file is loaded again

        @functools.wraps(_compile)
        def _compile_as_xla_defaults(self, compiler_options=None, **kwargs):
            if not _compile_as_xla_defaults.active:
                return _compile(self, compiler_options, **kwargs)
            return _compile(self, {**AHEAD_OF_TIME, **(compiler_options or {})}, **kwargs)

        _compile_as_xla_defaults.xla_defaults = XLA_DEFAULTS
        _compile_as_xla_defaults.active = True  # tests/conftest.py: False outside `hlo` tests
        jax.stages.Lowered.compile = _compile_as_xla_defaults

# Hypothesis (the property tests) draws the same examples on every run and machine: the seed
# comes from each test's source (`derandomize`), with no example database, so that no
# submission fails on a new random draw and any failure reproduces by running the test again.
# `HYPOTHESIS_PROFILE=explore` draws new examples on every run and replays the failures it
# saved in `.hypothesis/` first (with GRADACCUM_FUZZ_EXAMPLES=150 for a deeper search); a
# failure it finds is kept as an `@example` of its test. CI (`CI=true`) always reproduces.
settings.register_profile("reproduce", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")
settings.load_profile("reproduce" if _CI else os.environ.get("HYPOTHESIS_PROFILE", "reproduce"))

# Python's cyclic garbage collector passes over the young objects every 700 net allocations
# by default. Tracing and lowering allocate millions of short-lived objects, and a worker's
# heap (jax's caches) grows with the suite, so every older-generation pass gets slower.
# Measured on tests/test_matrix.py, test_losses.py and test_global_view.py in one process:
# 9.7 s of 272 s inside the collector with the defaults (6,982 young passes, 26 full
# ones), 1.6 s with these thresholds, the same peak memory (3.98 GB). Cycles are still
# collected, in fewer and larger passes; `_release_when_crowded` below still collects
# at once after it clears the caches.
gc.set_threshold(50_000, 20, 100)


def pytest_configure(config: pytest.Config) -> None:
    """Loads tests/_suite_report.py: compiled programs per file, the slowest tests and the
    quick tier's slow ones, printed at the end of every run."""
    try:
        from tests import _suite_report
    except ImportError:  # this file copied elsewhere (tests/test_packaging.py does)
        return
    config.pluginmanager.register(_suite_report, "gradaccum_suite_report")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the package's doctests `wheel`: `dev.sh test-wheel` runs them against the wheel."""
    for item in items:
        if isinstance(item, pytest.DoctestItem):
            item.add_marker(pytest.mark.wheel)


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.8.1" and "0.8.1rc1" give (0, 8, 1)."""
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skips, with its reason, a test marked `requires(reason, jax="0.9.0", ...)` on older stacks.

    The supported stacks reach back to the lower bounds in pyproject.toml; a test of an
    API that a supported older release lacks says so here, in one place, instead of
    failing there or being skipped silently.
    """
    needs = []
    for marker in item.iter_markers("requires"):
        if len(marker.args) != 1 or not isinstance(marker.args[0], str) or not marker.kwargs:
            raise TypeError(
                f"{item.nodeid}: use @pytest.mark.requires('why', package='minimum version'); "
                f"got args={marker.args!r}, kwargs={marker.kwargs!r}."
            )
        needs.append((marker.args[0], marker.kwargs))
    for why, versions in needs:
        for package, minimum in versions.items():
            installed = importlib.metadata.version(package)
            if _release(installed) < _release(minimum):
                pytest.skip(f"needs {package}>={minimum} (installed {installed}): {why}")


def _mapped_regions() -> tuple[int, int] | None:
    """`(memory maps of this process, the kernel's limit)`, where Linux tells both."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees this worker's compiled programs after a test module once they hold half the
    memory maps the kernel allows a process.

    XLA:CPU maps three regions per compiled kernel (code, constants, data), and JAX keeps
    every program it compiled until its caches are cleared: a worker that runs half of
    the suite reaches Linux's default limit of 65,530 maps, and the next compile then
    crashes inside XLA (a segmentation fault, measured at the 1,289th test of a worker,
    in CI and here). Programs compiled again after the clearing come from the persistent
    cache where it is on.
    """
    yield
    _release_when_crowded(_mapped_regions())


def _release_when_crowded(found: tuple[int, int] | None) -> bool:
    """Clears JAX's caches when `found` (maps held, the limit) is past half the limit;
    returns whether it did (tests/test_harness.py)."""
    if found is None or found[0] <= found[1] // 2 or "jax" not in sys.modules:
        return False
    sys.modules["jax"].clear_caches()
    gc.collect()
    return True
