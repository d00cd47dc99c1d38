"""Rewrites reStructuredText markup in docstrings as the Markdown that mkdocstrings renders.

The API pages are built by mkdocs + mkdocstrings, which read docstrings as Markdown
(Google-style sections, arithmatex math). This script converts, inside docstrings only:

* roles: ``:func:`x` `` / ``:class:`` / ``:meth:`` / ``:attr:`` / ``:data:`` / ``:mod:`` /
  ``:obj:`` / ``:exc:`` → `` `x` `` (``~a.b.c`` → `` `c` ``, ``title <target>`` → `` `title` ``);
  ``:math:`x` `` → ``$x$``;
* ``.. math::`` blocks → ``$$`` ... ``$$`` blocks at the directive's indentation;
* admonition directives (``.. note::``, ``.. warning::`` ...) → ``!!! note`` blocks;
* double-backtick literals → single backticks when the literal holds no backtick.

Doctest lines (``>>>``, ``...`` and their output) are left exactly as they are.
Running it twice changes nothing the second time.

    python tools/convert_docstrings.py gradaccum_jax/_clipping/norm.py [more files or folders]
    python tools/convert_docstrings.py --check gradaccum_jax   # exit 1 if anything would change
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
import sys

NAME_ROLES = ("func", "class", "meth", "attr", "data", "mod", "obj", "exc", "const", "py:\\w+")
ROLE = re.compile(r":(?P<role>" + "|".join(NAME_ROLES) + r"|math):`(?P<body>[^`]*)`")
DOUBLE_LITERAL = re.compile(r"(?<!`)``(?P<body>[^`]+?)``(?!`)")
DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. (?P<name>[a-z-]+)::[ \t]*(?P<arg>.*)$")
ADMONITIONS = {
    "note": "note",
    "warning": "warning",
    "tip": "tip",
    "important": "important",
    "caution": "caution",
    "danger": "danger",
    "attention": "attention",
    "hint": "hint",
    "seealso": 'info "See also"',
}


def _role_to_markdown(match: re.Match[str]) -> str:
    role, body = match["role"], match["body"]
    if role == "math":
        return f"${body}$"
    title = re.fullmatch(r"(?s)(?P<title>.*?)\s*<(?P<target>[^>]+)>", body)
    if title:
        body = title["title"]
    elif body.startswith("~"):
        body = body[1:].rsplit(".", 1)[-1]
    return f"`{body}`"


def _is_doctest(line: str) -> bool:
    return line.lstrip().startswith((">>>", "... ")) or line.strip() == "..."


def _split_prose_and_doctests(lines: list[str]) -> list[tuple[bool, list[str]]]:
    """Groups lines into runs of prose (True) and doctest input with its output (False)."""
    runs: list[tuple[bool, list[str]]] = []
    in_doctest = False
    for line in lines:
        if _is_doctest(line):
            in_doctest = True
        elif not line.strip():
            in_doctest = False  # a blank line ends a doctest's expected output
        if runs and runs[-1][0] == (not in_doctest):
            runs[-1][1].append(line)
        else:
            runs.append((not in_doctest, [line]))
    return runs


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def _convert_directives(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = DIRECTIVE.match(lines[i])
        name = match["name"] if match else None
        if name != "math" and name not in ADMONITIONS:
            out.append(lines[i])
            i += 1
            continue
        indent = match["indent"]
        body: list[str] = [match["arg"]] if match["arg"] else []
        i += 1
        # The directive's content: every following line indented deeper, and blank lines
        # between such lines.
        while i < len(lines):
            if lines[i].strip():
                if _indent_of(lines[i]) <= len(indent):
                    break
                body.append(lines[i])
            elif i + 1 < len(lines) and (
                not lines[i + 1].strip() or _indent_of(lines[i + 1]) > len(indent)
            ):
                body.append(lines[i])
            else:
                break
            i += 1
        while body and not body[-1].strip():
            body.pop()
        while body and not body[0].strip():
            body.pop(0)
        deeper = [_indent_of(line) for line in body[1 if match["arg"] else 0 :] if line.strip()]
        cut = min(deeper, default=0)
        content = [body[0].strip()] if match["arg"] else []
        content += [line[cut:] if line.strip() else "" for line in body[1 if match["arg"] else 0 :]]
        if name == "math":
            out += [f"{indent}$$"]
            out += [f"{indent}{line}" if line else "" for line in content]
            out += [f"{indent}$$"]
        else:
            out.append(f"{indent}!!! {ADMONITIONS[name]}")
            out += [f"{indent}    {line}" if line else "" for line in content]
        if i < len(lines) and lines[i].strip():
            out.append("")
    return out


def convert_docstring(text: str) -> str:
    """Returns a docstring's text with its reStructuredText markup written as Markdown."""
    out: list[str] = []
    for prose, lines in _split_prose_and_doctests(text.split("\n")):
        if not prose:
            out += lines
            continue
        chunk = "\n".join(_convert_directives(lines))
        chunk = ROLE.sub(_role_to_markdown, chunk)
        chunk = DOUBLE_LITERAL.sub(lambda m: f"`{m['body']}`", chunk)
        out += chunk.split("\n")
    return "\n".join(out)


def _docstring_nodes(tree: ast.Module) -> list[ast.Constant]:
    nodes = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
        ):
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                nodes.append(first.value)
    return nodes


def convert_source(source: str) -> str:
    """Returns a module's source with every docstring converted (code is untouched)."""
    # ast reports column offsets in UTF-8 bytes, so splice bytes.
    data = source.encode("utf-8")
    offsets = [0]
    for line in data.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    # Replace from the end so earlier offsets stay valid.
    spans = sorted(
        (
            (offsets[n.lineno - 1] + n.col_offset, offsets[n.end_lineno - 1] + n.end_col_offset)
            for n in _docstring_nodes(ast.parse(source))
        ),
        reverse=True,
    )
    for start, end in spans:
        literal = data[start:end].decode("utf-8")
        prefix = re.match(r"[rRuU]*", literal).group(0)
        quote = literal[len(prefix) : len(prefix) + 3]
        if quote not in ('"""', "'''"):
            continue  # a one-line docstring in single quotes: no markup worth converting
        body = literal[len(prefix) + 3 : -3]
        converted = convert_docstring(body)
        if converted != body:
            # Markup only moves text around, so no escape sequence is created or lost.
            new = (prefix + quote + converted + quote).encode("utf-8")
            data = data[:start] + new + data[end:]
    return data.decode("utf-8")


def python_files(paths: list[str]) -> list[pathlib.Path]:
    files: list[pathlib.Path] = []
    for path in map(pathlib.Path, paths):
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="Python files or folders")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if needed")
    args = parser.parse_args(argv)
    changed = []
    for path in python_files(args.paths):
        source = path.read_text(encoding="utf-8")
        converted = convert_source(source)
        if converted != source:
            changed.append(str(path))
            if not args.check:
                path.write_text(converted, encoding="utf-8")
    verb = "would convert" if args.check else "converted"
    for path in changed:
        print(f"{verb} {path}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
