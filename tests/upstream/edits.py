"""The migration guides' "Edit by edit" tables, applied to a script: what the tests run.

Each guide (docs/migration/*.md) has a table of rows ``| `before` | `after` |``. A row
whose ``before`` holds ``…`` is a pattern for a whole line (each ``…`` matches anything; the
``…`` of ``after`` take what they matched, in order); a row without one replaces the line that
is exactly ``before``, or else every occurrence of it inside lines (a replaced line's trailing
comment goes with it). ``after`` may be ``(delete the line)`` and may hold several lines
separated by ``<br>``. The tests run the result: if a script needed one edit more than its guide
names, it fails.
"""

from __future__ import annotations

import re
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


def apply(source: str, rows: list[tuple[str, str]]) -> tuple[str, set[str]]:
    """``source`` with the rows applied, and the ``before`` of each row that changed it."""
    used: set[str] = set()
    lines = source.splitlines()
    for before, after in rows:
        out: list[str] = []
        for line in lines:
            if "…" in before:
                found = _pattern(before).fullmatch(line)
            else:
                found = re.fullmatch(r"(\s*)" + re.escape(before) + _END, line)
            if found is None:
                if "…" not in before and after != DELETE and before in line:
                    used.add(before)
                    line = line.replace(before, after)
                out.append(line)
                continue
            used.add(before)
            if after == DELETE:
                continue
            indent, captures = found.group(1), list(found.groups()[1:])
            filled = re.sub("…", lambda _: captures.pop(0), after)
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
