"""The package's layout: no import circles, modules and functions a reader can take in.

The subpackages stack bottom to top (`_base` <- `_sharding` <- `_window` <-
{`_batching`, `_clipping`, `_privacy`, `flax`}, and `_pipeline` on `_sharding`); a
module imports only from its own floor or below. Sizes: no module over 800 lines, no
function over 100 code lines (docstrings, comments and blank lines excluded; nested functions count
in their parent).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import gradaccum_jax

# Tables and source text: no jax computation (the `pure` marker).
pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parent.parent
# The package that is imported: the source tree, or the installed wheel (dev.sh test-wheel).
PACKAGE = Path(gradaccum_jax.__file__).resolve().parent
SUBPACKAGES = {
    "_base",
    "_sharding",
    "_window",
    "_batching",
    "_clipping",
    "_privacy",
    "_pipeline",
    "flax",
}
# The arrows of the picture in docs/concepts.md ("Architecture"): package -> what it imports.
DRAWN_ARROWS = {
    "_base": set(),
    "_sharding": {"_base"},
    "_window": {"_base", "_sharding"},
    "_batching": {"_base", "_sharding"},
    "_clipping": {"_base", "_window"},
    "_privacy": {"_base", "_sharding", "_window"},
    "_pipeline": {"_base", "_sharding"},
    "flax": {"_base", "_sharding", "_window"},
}
MAX_MODULE_LINES = 800
MAX_FUNCTION_CODE_LINES = 100
# Functions still over the limit, with their code lines today; each entry goes
# when its function is split (the test fails if an entry is no longer needed).
KNOWN_LONG_FUNCTIONS = {}


def _modules() -> dict[str, Path]:
    """Dotted module name -> path, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports (at any depth of its code)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            # `from pkg import mod` imports a module; `from mod import name` the module.
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            if target in modules and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _subpackage(module: str) -> str | None:
    """The subpackage a module belongs to; None for the package root and its own modules."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir() else None


def _package_graph() -> dict[str, set[str]]:
    """Subpackage -> the subpackages its modules import (the package root excluded)."""
    out: dict[str, set[str]] = {}
    for module, imported in _graph().items():
        src = _subpackage(module)
        if src is None:
            continue
        out.setdefault(src, set())
        out[src] |= {d for m in imported if (d := _subpackage(m)) not in (None, src)}
    return out


def _code_line_numbers(src: str, tree: ast.AST) -> set[int]:
    """The lines of `src` holding code: docstrings (of the defs and classes in `tree`),
    comments and blank lines excluded. Tokenized once per file (once per function took
    the check 36 s)."""
    doc_lines = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(
                getattr(first, "value", None), ast.Constant
            ):
                if isinstance(first.value.value, str):
                    doc_lines.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in skip or tok.type == tokenize.ENDMARKER:
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - doc_lines


def _code_lines(src: str, node: ast.AST, code: set[int] | None = None) -> int:
    """Lines of `node` holding code (`code`: the file's, from _code_line_numbers)."""
    code = _code_line_numbers(src, node) if code is None else code
    return sum(1 for line in range(node.lineno, node.end_lineno + 1) if line in code)


def _function_sizes() -> dict[str, int]:
    """`path:qualname` -> code lines, for every top-level function and method."""
    sizes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = path.read_text()
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(src)
        code = _code_line_numbers(src, tree)

        def visit(
            body: list[ast.stmt], prefix: str, src: str = src, rel: str = rel, code: set = code
        ) -> None:
            for node in body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    sizes[f"{rel}:{prefix}{node.name}"] = _code_lines(src, node, code)
                elif isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")

        visit(tree.body, "")
    return sizes


def test_the_subpackages_are_the_expected_floors():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == SUBPACKAGES


def test_no_module_import_circle():
    assert _find_cycle(_graph()) is None


def test_no_package_import_circle():
    assert _find_cycle(_package_graph()) is None


def test_the_subpackages_import_only_downwards():
    floor = {"_base": 0, "_sharding": 1, "_window": 2}
    floor |= {"_batching": 3, "_clipping": 3, "_privacy": 3, "_pipeline": 3, "flax": 3}
    upward = sorted(
        (src, dst)
        for src, imported in _package_graph().items()
        for dst in imported
        if floor[dst] >= floor[src]
    )
    assert upward == []


def test_base_imports_nothing_of_ours_outside_it():
    for module, imported in _graph().items():
        if _subpackage(module) == "_base":
            assert {_subpackage(m) for m in imported} <= {"_base"}, module


@pytest.mark.parametrize("module", sorted(_modules()))
def test_no_module_over_the_line_limit(module):
    lines = len(_modules()[module].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module} has {lines} lines"


def test_no_function_over_the_code_line_limit():
    sizes = _function_sizes()
    long = {name: n for name, n in sizes.items() if n > MAX_FUNCTION_CODE_LINES}
    assert set(long) == set(KNOWN_LONG_FUNCTIONS), long


def test_the_cycle_finder_finds_a_cycle():
    # The checks above pass on an acyclic graph; this shows they can fail.
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_code_lines_exclude_docstrings_and_comments():
    src = (
        'def f():\n    """Doc.\n\n    More.\n    """\n    # a comment\n\n    x = 1\n    return x\n'
    )
    assert _code_lines(src, ast.parse(src).body[0]) == 3


def _architecture_section() -> str:
    text = (ROOT / "docs" / "concepts.md").read_text()
    return text.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]


def test_the_architecture_picture_draws_the_real_arrows():
    picture = _architecture_section().split("```text\n", 1)[1].split("```", 1)[0]
    drawn = set(re.findall(r"(?<![\w.])_[a-z]+", picture)) | ({"flax"} & set(picture.split()))
    assert drawn == SUBPACKAGES
    assert _package_graph() == DRAWN_ARROWS


def test_the_architecture_counts_the_private_packages():
    # Issue 34, item 4: the page said six private packages when there were five.
    words = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    said = re.search(r"sits in (\w+) private packages", " ".join(_architecture_section().split()))
    assert said is not None
    private = sorted(package for package in SUBPACKAGES if package.startswith("_"))
    assert said.group(1) == words[len(private)], private


def test_the_architecture_table_lists_every_module():
    named = {}
    for row in _architecture_section().splitlines():
        if row.startswith("| `"):
            package, _, modules = (cell.strip() for cell in row.strip("|").split("|"))
            named[package.strip("`")] = set(re.findall(r"`(\w+\.py)`", modules))
    real = {
        package: {p.name for p in (PACKAGE / package).glob("*.py") if p.name != "__init__.py"}
        for package in SUBPACKAGES
    }
    assert named == real


# The core's own budget (issue 30): `accumulate` is a thin factory, and each
# stage of its update path fits on a screen.
CORE_LIMITS = {"_window/accumulate.py": {"accumulate": 80}, "_window/stages.py": {"*": 60}}


@pytest.mark.parametrize("module", sorted(CORE_LIMITS))
def test_the_core_reads_in_one_sitting(module):
    path = PACKAGE / module
    limits = CORE_LIMITS[module]
    tree = ast.parse(path.read_text())
    source = path.read_text()
    code = _code_line_numbers(source, tree)
    measured = {
        node.name: _code_lines(source, node, code)
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }
    assert measured, f"{module} defines no function"
    for name, lines in measured.items():
        limit = limits.get(name, limits.get("*"))
        if limit is not None:
            assert lines <= limit, f"{module}:{name} has {lines} code lines (limit {limit})"


def test_the_public_losses_module_stands_on_base_alone():
    # gradaccum_jax.losses (a public module beside the subpackages) needs no window or batching.
    imported = _graph()["gradaccum_jax.losses"]
    assert {_subpackage(m) for m in imported} <= {"_base"}, imported
