"""The migration guides' "Edit by edit" tables, applied to a script: what the tests run.

Each guide (docs/migration/*.md) has a table of rows ``| `before` | `after` |``. A row
whose ``before`` holds ``…`` is a pattern for a whole statement (each ``…`` matches anything;
the ``…`` of ``after`` take what they matched, in order); a row without one replaces the
statement that is exactly ``before``, or else every occurrence of it inside lines (a replaced
statement's trailing comment goes with it). A statement is Python's logical line: one that
spans several lines inside brackets (``deepspeed.initialize(`` with one argument a line) is
matched as if written on one, its lines joined by single spaces. ``after`` may be ``(delete
the line)`` and may hold several lines separated by ``<br>``. The tests run the result: if a
script needed one edit more than its guide names, it fails.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

DOCS = Path(__file__).parents[2] / "docs" / "migration"
DELETE = "(delete the line)"
_ROW = re.compile(r"^\|\s*`(?P<before>[^`]+)`\s*\|\s*(?:`(?P<after>[^`]*)`|(?P<delete>\(delete "
                  r"the line\)))\s*\|", re.MULTILINE)


def table(guide: str) -> list[tuple[str, str]]:
    """The (before, after) rows of ``docs/migration/<guide>.md``'s edit table."""
    text = (DOCS / f"{guide}.md").read_text()
    rows = [(m["before"], DELETE if m["delete"] else m["after"]) for m in _ROW.finditer(text)]
    assert rows, f"{guide}.md has no edit table"
    return rows


_END = r"\s*(?:#.*)?"
"""What may follow a replaced line: spaces, a comment (dropped with the line)."""


def _pattern(before: str) -> re.Pattern[str]:
    return re.compile(r"(\s*)" + r"(.*?)".join(re.escape(p) for p in before.split("…")) + _END)


def statements(lines: list[str]) -> list[tuple[int, int, str]]:
    """Each logical line of ``lines`` as (first, last + 1, its text on one line): the physical
    lines inside brackets joined by single spaces, their comments dropped. Blank and comment
    lines, and lines that do not tokenize (a fragment), are statements of their own."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [(i, i + 1, line) for i, line in enumerate(lines)]
    comments = {t.start[0] - 1: t.start[1] for t in tokens if t.type == tokenize.COMMENT}
    skip = {tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE,
            tokenize.ENDMARKER}
    spans: dict[int, int] = {}
    first = None
    for token in tokens:
        if first is None and token.type not in skip:
            first = token.start[0] - 1
        elif first is not None and token.type == tokenize.NEWLINE:
            spans[first], first = token.end[0], None
    out, i = [], 0
    while i < len(lines):
        stop = spans.get(i, i + 1)
        pieces = [lines[j][:comments.get(j, len(lines[j]))] for j in range(i, stop)]
        text = lines[i] if stop == i + 1 else pieces[0].rstrip()
        for piece in (p.strip() for p in pieces[1:]):
            if piece:
                glue = "" if text.endswith(("(", "[", "{")) or piece[0] in ")]}" else " "
                text += glue + piece
        out.append((i, stop, text))
        i = stop
    return out


def apply(source: str, rows: list[tuple[str, str]]) -> tuple[str, set[str]]:
    """``source`` with the rows applied, and the ``before`` of each row that changed it."""
    used: set[str] = set()
    lines = source.splitlines()
    for before, after in rows:
        out: list[str] = []
        for start, stop, statement in statements(lines):
            if "…" in before:
                found = _pattern(before).fullmatch(statement)
            else:
                found = re.fullmatch(r"(\s*)" + re.escape(before) + _END, statement)
            if found is None:
                for line in lines[start:stop]:
                    if "…" not in before and after != DELETE and before in line:
                        used.add(before)
                        line = line.replace(before, after)
                    out.append(line)
                continue
            used.add(before)
            if after == DELETE:
                continue
            indent, captures = found.group(1), list(found.groups()[1:])
            filled = re.sub("…", lambda _, taken=captures: taken.pop(0), after)
            out += [indent + piece for piece in filled.split("<br>")]
        lines = out
    return "\n".join(lines) + "\n", used


def migrate(script: Path, guide: str, into: Path) -> tuple[Path, set[str]]:
    """Write ``script`` with ``guide``'s edits into the folder ``into``; its path, rows used."""
    text, used = apply(script.read_text(), table(guide))
    into.mkdir(parents=True, exist_ok=True)
    target = into / script.name
    target.write_text(text)
    return target, used
