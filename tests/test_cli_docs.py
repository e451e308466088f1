"""docs/cli.md is generated from the typer app; it must match the commands as they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).parents[1] / "docs" / "cli.md"
GENERATE = [sys.executable, "-m", "typer", "mpt.cli", "utils", "docs", "--name", "mpt"]


def test_cli_reference_is_up_to_date(tmp_path):
    fresh = tmp_path / "cli.md"
    subprocess.run([*GENERATE, "--output", str(fresh)], check=True, capture_output=True,
                   timeout=120)
    assert fresh.read_text() == DOCS.read_text(), (
        "docs/cli.md is stale; regenerate it with: python -m typer mpt.cli utils docs "
        "--name mpt --output docs/cli.md")
