"""Packaging: import cost, the shipped type marker, declared bounds, the compatibility layer."""

import importlib.resources
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

import jax
import jax.numpy as jnp
import jax.stages
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gradaccum_jax._base import compat as _compat

# Run against the built wheel too (dev.sh test-wheel).
pytestmark = pytest.mark.wheel

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_does_not_import_flax():
    out = _run_python(
        """
        import sys
        import gradaccum_jax
        print(sorted(m for m in sys.modules if m == "flax" or m.startswith("flax.")))
        """
    )
    assert out.strip() == "[]"


def test_flax_subpackage_is_reached_as_an_attribute():
    out = _run_python(
        """
        import gradaccum_jax as ga
        # AccumBatchNorm's __name__ is "BatchNorm" on purpose (flax's auto-names).
        print("flax" in dir(ga), ga.flax.AccumBatchNorm.__module__)
        from gradaccum_jax.flax import NNXAccumBatchNorm
        print(NNXAccumBatchNorm.__module__)
        """
    )
    assert out.split() == ["True", "gradaccum_jax.flax._linen", "gradaccum_jax.flax._nnx"]


def test_unknown_attribute_raises_attribute_error():
    import gradaccum_jax

    with pytest.raises(AttributeError, match="has no attribute 'flaxx'"):
        gradaccum_jax.flaxx  # noqa: B018


def test_package_ships_py_typed():
    assert (importlib.resources.files("gradaccum_jax") / "py.typed").is_file()


def _lower_bounds() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {}
    for requirement in project["dependencies"]:
        name, bound = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement).groups()
        bounds[name] = bound
    return bounds


def test_oldest_constraints_pin_the_declared_lower_bounds():
    # The lower bounds are what `bash dev.sh test-oldest` installs, so they are tested.
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints-oldest.txt").read_text().splitlines()
        if "==" in line
    )
    bounds = _lower_bounds()
    assert {name: pins.get(name) for name in bounds} == bounds
    assert "chex" not in bounds, "chex is a test dependency: the package does not import it"


def test_requires_marker_skips_with_its_reason_and_rejects_misuse(tmp_path):
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    requires: test\n")
    (tmp_path / "test_marked.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.requires("needs the future", jax="999")
            def test_future():
                raise AssertionError("must not run")

            @pytest.mark.requires("any jax", jax="0.0.1")
            def test_present():
                pass

            @pytest.mark.requires(jax="0.0.1")
            def test_no_reason():
                pass
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    out = result.stdout
    assert f"needs jax>=999 (installed {jax.__version__}): needs the future" in out, out
    assert "use @pytest.mark.requires('why', package='minimum version')" in out, out
    assert re.search(r"1 passed, 1 skipped, 1 error", out), out


def test_compat_outside_shard_map_nothing_varies():
    x = jnp.ones(3)
    assert _compat.varying_axes(x) == frozenset()
    assert _compat.varying_axes(jax.eval_shape(lambda: x)) == frozenset()


def test_compat_inside_shard_map_reads_and_widens_varying_axes():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    seen = {}

    def body(x):
        invariant = jnp.sum(jax.lax.psum(x, "b"))
        widened = _compat.pcast_to_varying(invariant, ("b",))
        seen["x"] = _compat.varying_axes(x)
        seen["psum"] = _compat.varying_axes(invariant)
        seen["widened"] = _compat.varying_axes(widened)
        seen["shape"] = _compat.varying_axes(jax.eval_shape(lambda: widened))
        return jax.lax.psum(widened, "b")[None, None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", None)))
    out = f(jnp.arange(8.0).reshape(2, 4))
    assert seen == {
        "x": {"a", "b"},
        "psum": {"a"},
        "widened": {"a", "b"},
        "shape": {"a", "b"},
    }
    # Each row's sum, counted once per device along "b" (4 of them).
    np.testing.assert_allclose(np.asarray(out)[:, 0], [4 * 6.0, 4 * 22.0])


def test_compiler_settings_follow_gradaccum_xla_defaults():
    # conftest.py runs programs with faster XLA:CPU settings unless GRADACCUM_XLA_DEFAULTS=1,
    # which dev.sh test-wheel sets: there every test runs with the settings a user has.
    # Programs compiled ahead of time get XLA's defaults either way (tests/test_harness.py
    # compares them with a process's that never set the faster ones).
    fast = os.environ.get("GRADACCUM_XLA_DEFAULTS", "") in ("", "0")
    assert jax.config.read("jax_disable_most_optimizations") is fast
    assert ("--xla_cpu_use_fusion_emitters=false" in os.environ["XLA_FLAGS"]) is fast
    assert hasattr(jax.stages.Lowered.compile, "xla_defaults") is fast
