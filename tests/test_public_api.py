"""The public namespace: every exported name imports and is documented."""

import pathlib
import re

import gradaccum_jax
import gradaccum_jax.flax
import gradaccum_jax.losses

NAMESPACES = {
    "gradaccum_jax": gradaccum_jax,
    "gradaccum_jax.flax": gradaccum_jax.flax,
    "gradaccum_jax.losses": gradaccum_jax.losses,
}
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


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
    # `import gradaccum_jax as ga; ga.losses.clip_loss(...)` works without a second import.
    assert gradaccum_jax.losses is gradaccum_jax.__dict__["losses"]
    assert "losses" in dir(gradaccum_jax)
