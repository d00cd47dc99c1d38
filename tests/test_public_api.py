"""The public namespace: every exported name imports and is documented."""

import pathlib
import re
import subprocess
import sys

import pytest

import gradaccum_jax
import gradaccum_jax.flax
import gradaccum_jax.losses
import gradaccum_jax.privacy

# Run against the built wheel too (dev.sh test-wheel).
pytestmark = pytest.mark.wheel

NAMESPACES = {
    "gradaccum_jax": gradaccum_jax,
    "gradaccum_jax.flax": gradaccum_jax.flax,
    "gradaccum_jax.losses": gradaccum_jax.losses,
    "gradaccum_jax.privacy": gradaccum_jax.privacy,
}
ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_all_is_sorted_and_importable():
    for module in NAMESPACES.values():
        assert list(module.__all__) == sorted(module.__all__)
        for name in module.__all__:
            assert getattr(module, name) is not None, name


def test_every_public_name_has_a_docs_entry():
    entries = set()
    for page in DOCS.rglob("*.md"):
        entries.update(re.findall(r"^::: (gradaccum_jax[\w.]*)", page.read_text(), re.M))
    missing = [
        f"{prefix}.{name}"
        for prefix, module in NAMESPACES.items()
        for name in module.__all__
        if f"{prefix}.{name}" not in entries
    ]
    assert not missing, f"public names without a '::: <module>.<name>' docs entry: {missing}"


def test_losses_is_reached_from_the_package():
    # `import gradaccum_jax as ga; ga.losses.clip_loss(...)` works without a second import
    # (in a fresh process: this file's own `import gradaccum_jax.losses` would hide it).
    code = "import gradaccum_jax as ga; print(ga.losses.clip_loss.__name__, 'losses' in dir(ga))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.split() == ["clip_loss", "True"]


def test_privacy_is_reached_from_the_package():
    # As losses: `ga.privacy.dp_accumulate(...)` after `import gradaccum_jax as ga` alone.
    code = "import gradaccum_jax as ga; print(ga.privacy.dp_accumulate.__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.split() == ["dp_accumulate"]
