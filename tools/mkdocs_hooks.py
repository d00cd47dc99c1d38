"""mkdocs hooks: the build fails when the docs are incomplete or render markup as text.

* Every name in `gradaccum_jax.__all__` and `gradaccum_jax.flax.__all__` must appear on
  some page as a mkdocstrings block (`::: gradaccum_jax.<name>`).
* No page may show reStructuredText markup as text: mkdocstrings renders docstrings as
  Markdown, so a role such as `:func:` or a directive such as `.. math::` left in a
  docstring reaches the HTML literally. `tools/convert_docstrings.py` rewrites them.
"""

from __future__ import annotations

import re

ROLE_NAMES = (
    "func|class|meth|attr|data|mod|obj|exc|const|math|ref|doc|term|py:[a-z]+|any|envvar|file"
)
# Code elements are replaced by this before the search: code shows markup on purpose (an
# example of what not to write), and a role renders as ":func:<code>x</code>".
CODE_SENTINEL = "\x00"
RST_MARKUP = re.compile(
    r":(?:" + ROLE_NAMES + r"):(?=`|" + CODE_SENTINEL + r")|(?<!\.)\.\. [a-z][a-z-]*::"
)
CODE = re.compile(r"<(pre|code)\b[^>]*>.*?</\1>", re.S)
TAG = re.compile(r"<[^>]+>")


def find_rst_markup(html: str) -> list[str]:
    """Returns every reStructuredText role or directive shown as text in rendered HTML.

    Text inside `<pre>` and `<code>` elements is ignored; each finding comes with a little
    of its surrounding text so that the docstring it came from can be found.
    """
    text = TAG.sub("", CODE.sub(CODE_SENTINEL, html))
    return [
        " ".join(text[max(0, m.start() - 40) : m.end() + 40].replace(CODE_SENTINEL, "`…`").split())
        for m in RST_MARKUP.finditer(text)
    ]


def on_files(files, config):
    from mkdocs.exceptions import PluginError

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


def on_post_page(output, page, config):
    from mkdocs.exceptions import PluginError

    found = find_rst_markup(output)
    if found:
        shown = "\n  ".join(found[:10])
        raise PluginError(
            f"{page.file.src_uri}: {len(found)} reStructuredText role(s)/directive(s) rendered "
            f"as text (write docstrings in Markdown; python tools/convert_docstrings.py "
            f"<module> converts them):\n  {shown}"
        )
    return output
