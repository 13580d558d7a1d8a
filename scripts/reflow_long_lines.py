"""Rewrap comments and docstrings that ruff reports as too long (E501, 100 columns).

Usage, from the repository root::

    python scripts/reflow_long_lines.py            # list what it would leave to a person
    python scripts/reflow_long_lines.py --apply    # rewrap; then run it again (a second pass
                                                   # picks up lines the first one moved)

Only text is touched, never code: a reported line is rewrapped if it is a full-line comment or
lies inside a docstring (found with :mod:`ast`), together with the following lines of the same
paragraph (same prefix or indentation; a blank line, a list marker, a doctest prompt, a
section header or a literal block ends it). Continuation lines of an ``Args:``-style entry keep
their hanging indent. Everything else (code, string literals that are not docstrings, literal
blocks, tables, a single word longer than the limit) is printed for a person to fix, so the
script never changes what the code does. Review the diff: it rewraps prose, and prose in
jupytext tutorials must be re-synced into the notebooks (``jupytext --update --to ipynb``).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import textwrap
import tokenize
from collections import defaultdict
from pathlib import Path

WIDTH = 100
MARKER = re.compile(r"^([*\-+] |\d+\. |\(\w\) |\(\d+\) )")
STOP = re.compile(
    r"^(>>>|\.\.\.|\.\. |\||[A-Z][a-z]+( [a-z]+)?:$|#|```|\"\"\"$|'''$|r\"\"\"$|[-=~^]{4,})"
)
SECTION = re.compile(r"^(Args|Arguments|Returns|Raises|Yields|Attributes|Keyword Args|Warns):$")
ENTRY = re.compile(r"^\**[\w.`]+( \([^)]*\))?: ")


def violations() -> dict[str, set[int]]:
    """Path -> line numbers that ruff reports as E501."""
    ruff = Path(sys.executable).with_name("ruff")
    out = subprocess.run(
        [str(ruff), "check", "--select", "E501", "--output-format", "concise", "."],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    found: dict[str, set[int]] = defaultdict(set)
    for line in out.splitlines():
        match = re.match(r"^(.+?\.py):(\d+):\d+: E501", line)
        if match:
            found[match.group(1)].add(int(match.group(2)))
    return found


def docstring_lines(src: str) -> set[int]:
    """1-based line numbers inside module, class or function docstrings."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def comment_lines(src: str) -> set[int]:
    """1-based line numbers that hold only a comment."""
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    return {
        tok.start[0]
        for tok in tokens
        if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#")
    }


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _wrap(text: str, first: str, rest: str) -> list[str] | None:
    new = textwrap.wrap(
        text,
        WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return None if any(len(n) > WIDTH for n in new) else new


def reflow_comment(lines: list[str], i: int, comments: set[int]):
    """(start, end, new lines) for the comment paragraph starting at 0-based line ``i``."""
    line = lines[i].rstrip("\n")
    prefix = re.match(r"^(\s*#:? ?)", line).group(1)
    prefix += "" if prefix.endswith(" ") else " "
    text = line[len(prefix) :]
    if re.fullmatch(r"-{5,}.*|.*-{5,}", text.strip()):  # a rule line: shorten its dashes
        while len(line) > WIDTH and "--" in line:
            line = line.replace("--", "-", 1)
        return i, i + 1, [line]
    if STOP.match(text):
        return None
    marker = MARKER.match(text)
    cont = prefix + (" " * len(marker.group(1)) if marker else "")
    j = i + 1
    while j < len(lines) and (j + 1) in comments:
        nxt = lines[j].rstrip("\n")
        if not nxt.startswith(cont) or nxt.startswith(cont + " "):
            break
        rest = nxt[len(cont) :]
        if not rest.strip() or MARKER.match(rest) or STOP.match(rest):
            break
        j += 1
    words = " ".join([text] + [lines[k].rstrip("\n")[len(cont) :] for k in range(i + 1, j)])
    new = _wrap(words, prefix, cont)
    return None if new is None else (i, j, new)


def _in_literal_block(lines: list[str], i: int, ind: int) -> bool:
    k = i
    while k > 0 and lines[k - 1].strip() and indent_of(lines[k - 1]) >= ind:
        k -= 1
    for prev in reversed(lines[:k]):
        if prev.strip() and indent_of(prev) < ind:
            return prev.rstrip().endswith("::")
    return False


def _in_section(lines: list[str], i: int, ind: int) -> bool:
    for prev in reversed(lines[:i]):
        if not prev.strip():
            return False
        if indent_of(prev) < ind:
            return indent_of(prev) == ind - 4 and bool(SECTION.match(prev.strip()))
    return False


def reflow_docstring(lines: list[str], i: int, docs: set[int]):
    """(start, end, new lines) for the docstring paragraph starting at 0-based line ``i``."""
    line = lines[i].rstrip("\n")
    ind = indent_of(line)
    text = line.lstrip(" ")
    opening = text.startswith(('"""', 'r"""'))
    if (STOP.match(text) and not opening) or _in_literal_block(lines, i, ind):
        return None
    marker = MARKER.match(text)
    entry = _in_section(lines, i, ind) and bool(ENTRY.match(text))
    if entry:
        cont = ind + 4
    elif marker:
        cont = ind + len(marker.group(1))
    else:
        cont = ind
    j = i + 1
    while j < len(lines) and (j + 1) in docs:
        nxt = lines[j]
        if not nxt.strip() or indent_of(nxt) != cont or lines[j - 1].rstrip().endswith("::"):
            break
        if MARKER.match(nxt.strip()) or STOP.match(nxt.strip()):
            break
        j += 1
    words = " ".join([text] + [lines[k].strip() for k in range(i + 1, j)])
    new = _wrap(words, " " * ind, " " * cont)
    if new is None or new[0].strip() in ('"""', 'r"""'):
        return None
    return i, j, new


def main(apply: bool) -> int:
    left = []
    for path, numbers in sorted(violations().items()):
        src = Path(path).read_text(encoding="utf-8")
        docs, comments = docstring_lines(src), comment_lines(src)
        lines = src.splitlines(keepends=True)
        edits = []
        for n in sorted(numbers):
            if n in comments:
                edit = reflow_comment(lines, n - 1, comments)
            elif n in docs:
                edit = reflow_docstring(lines, n - 1, docs)
            else:
                edit = None
            if edit is None:
                left.append(f"{path}:{n}: {lines[n - 1].rstrip()[:120]}")
            else:
                edits.append(edit)
        last = None
        for start, end, new in sorted(edits, reverse=True):  # bottom-up; skip overlaps
            if last is not None and end > last:
                continue
            lines[start:end] = [x + "\n" for x in new]
            last = start
        if apply and edits:
            Path(path).write_text("".join(lines), encoding="utf-8")
    print("\n".join(left))
    print(f"{len(left)} line(s) left to a person")
    return 0


if __name__ == "__main__":
    sys.exit(main("--apply" in sys.argv))
