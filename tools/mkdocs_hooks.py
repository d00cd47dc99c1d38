"""mkdocs hook: the build fails when a public name has no API entry in the docs.

Every name in ``gradaccum_jax.__all__`` and ``gradaccum_jax.flax.__all__`` must
appear on some page as a mkdocstrings block (``::: gradaccum_jax.<name>``).
"""

from __future__ import annotations

import re

from mkdocs.exceptions import PluginError


def on_files(files, config):
    import gradaccum_jax
    import gradaccum_jax.flax

    entries: set[str] = set()
    for file in files.documentation_pages():
        with open(file.abs_src_path, encoding="utf-8") as page:
            entries.update(re.findall(r"^::: (gradaccum_jax[\w.]*)", page.read(), re.M))
    missing = [
        f"{module.__name__}.{name}"
        for module in (gradaccum_jax, gradaccum_jax.flax)
        for name in module.__all__
        if f"{module.__name__}.{name}" not in entries
    ]
    if missing:
        raise PluginError(f"public names without a '::: <module>.<name>' docs entry: {missing}")
    return files
