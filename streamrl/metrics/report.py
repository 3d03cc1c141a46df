"""Result tables: printed with rich, and written as JSON (``--out FILE.json``) by every command
that prints one. Rows are plain dicts; the same dicts go to the console and to the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.3f}"
    return str(value)


def print_table(title: str, rows: Sequence[dict[str, Any]], columns: Iterable[str] | None = None) -> None:
    """Print ``rows`` as a table; ``columns`` picks and orders the keys (default: first row's)."""
    from rich.console import Console
    from rich.table import Table

    cols = list(columns) if columns is not None else (list(rows[0].keys()) if rows else [])
    table = Table(title=title)
    for col in cols:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*[_fmt(row.get(c, "")) for c in cols])
    Console(width=200).print(table)


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (no-op when ``path`` is None); creates parent folders."""
    if path is None:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def add_out_argument(parser) -> None:
    parser.add_argument("--out", metavar="FILE.json", default=None, help="also write the result table as JSON")
