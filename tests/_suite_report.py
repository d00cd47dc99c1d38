"""A pytest plugin that tells where the suite's time goes: compiled programs and slow tests.

Loaded by the root conftest.py. Each test's report carries the number of programs it
compiled or loaded from the persistent cache (a listener on jax's compile event) and the
seconds spent in them; under pytest-xdist these travel to the controller with the
report. At the end of the session the terminal summary prints the compiled programs
per file, the 15 slowest tests, and every test of the quick tier (not marked `slow`)
that took longer than the `slow` marker's rule of about 5 s. `GRADACCUM_SUITE_REPORT=PATH`
also writes every test's figures to PATH as JSON, for comparing two runs.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from typing import Any

import pytest

# The `slow` marker's own rule (pyproject.toml): a quick test takes less than about 5 s.
QUICK_LIMIT_S = 5.0
SLOWEST = 15
_EVENT = "/jax/core/compile/backend_compile_duration"


class _Compiles:
    """Counts compile events while a test runs (one process: an xdist worker or pytest)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.registered = False

    def listen(self) -> None:
        if self.registered or "jax" not in sys.modules:
            return
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        self.registered = True

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if event == _EVENT:
            self.count += 1
            self.seconds += duration


_COMPILES = _Compiles()
_START = pytest.StashKey[tuple[int, float]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    if call.when == "setup":
        _COMPILES.listen()
        item.stash[_START] = (_COMPILES.count, _COMPILES.seconds)
    outcome = yield
    if call.when == "teardown":
        count0, seconds0 = item.stash.get(_START, (_COMPILES.count, _COMPILES.seconds))
        report = outcome.get_result()
        report.user_properties.append(("compiles", _COMPILES.count - count0))
        report.user_properties.append(("compile_s", round(_COMPILES.seconds - seconds0, 3)))
        report.user_properties.append(("slow", item.get_closest_marker("slow") is not None))


class _Collector:
    """Gathers the reports on the controller (or the only process)."""

    def __init__(self) -> None:
        self.tests: dict[str, dict[str, Any]] = collections.defaultdict(
            lambda: {
                "seconds": 0.0,
                "compiles": 0,
                "compile_s": 0.0,
                "slow": False,
                "reads_compiled": "",
                "marked_hlo": True,
            }
        )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.tests[report.nodeid]
        entry["seconds"] += report.duration
        for key, value in report.user_properties:
            if key in ("compiles", "compile_s", "slow", "reads_compiled", "marked_hlo"):
                entry[key] = value

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.tests:
            return
        write = terminalreporter.write_line
        files: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
        for nodeid, entry in self.tests.items():
            row = files[nodeid.split("::")[0]]
            row[0] += entry["compiles"]
            row[1] += entry["compile_s"]
            row[2] += entry["seconds"]
            row[3] += 1
        total = sum(row[0] for row in files.values())
        seconds = sum(row[1] for row in files.values())
        terminalreporter.section("where the time went")
        write(f"compiled programs: {total} in {seconds:.0f} s of compiling")
        write("by file (programs, compile s, test s, tests), most programs first:")
        for name, row in sorted(files.items(), key=lambda kv: -kv[1][0])[:20]:
            write(f"  {row[0]:6d} {row[1]:7.1f} {row[2]:7.1f} {row[3]:5d}  {name}")
        write(f"the {SLOWEST} slowest tests (s, programs):")
        ranked = sorted(self.tests.items(), key=lambda kv: -kv[1]["seconds"])
        for nodeid, entry in ranked[:SLOWEST]:
            write(f"  {entry['seconds']:7.1f} {entry['compiles']:5d}  {nodeid}")
        over = [(n, e) for n, e in ranked if not e["slow"] and e["seconds"] > QUICK_LIMIT_S]
        write(f"quick-tier tests over {QUICK_LIMIT_S:.0f} s: {len(over)}")
        for nodeid, entry in over:
            write(f"  {entry['seconds']:7.1f} {entry['compiles']:5d}  {nodeid}")
        readers = [n for n, e in ranked if e["reads_compiled"]]
        unmarked = [n for n in readers if not self.tests[n]["marked_hlo"]]
        write(
            f"tests that read a compiled program: {len(readers)}, {len(unmarked)} of them "
            "without the `hlo` or `plans` marker (tests/conftest.py; mark these):"
        )
        for nodeid in sorted(unmarked):
            write(f"  {nodeid}")
        path = os.environ.get("GRADACCUM_SUITE_REPORT")
        if path:
            with open(path, "w") as out:
                json.dump(self.tests, out, indent=0, sort_keys=True)


def pytest_configure(config: pytest.Config) -> None:
    # Workers send their reports to the controller, which alone prints the summary.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Collector(), "gradaccum_suite_report_collector")
