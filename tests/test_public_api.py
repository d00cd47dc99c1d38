"""The public namespace: every exported name imports and is documented."""

import pathlib
import re

import gradaccum_jax

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def test_all_is_sorted_and_importable():
    assert list(gradaccum_jax.__all__) == sorted(gradaccum_jax.__all__)
    for name in gradaccum_jax.__all__:
        assert getattr(gradaccum_jax, name) is not None, name


def test_every_public_name_has_a_docs_entry():
    entries = set()
    for page in DOCS.rglob("*.md"):
        entries.update(re.findall(r"^::: (gradaccum_jax[\w.]*)", page.read_text(), re.M))
    missing = [n for n in gradaccum_jax.__all__ if f"gradaccum_jax.{n}" not in entries]
    assert not missing, f"public names without a '::: gradaccum_jax.<name>' docs entry: {missing}"
