"""Per-record side tables of a run folder (routes.csv, trace.csv), appended after each record.

Each row is prefixed with the record's key (dataset, prompt_index, repeat). A side table is
written after its record, so a record is never missing because its side table failed; an
interrupted write leaves at most a record without its rows (drawn as missing, never duplicated:
readers keep the rows of each record key once).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

ARTIFACT_KEY = ("dataset", "prompt_index", "repeat")


def append_rows(path: Path, key: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Append `rows` (all with the same columns) to the CSV at `path`, each prefixed with `key`."""
    if not rows:
        return
    columns = [*key, *rows[0]]
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(columns)
        for row in rows:
            w.writerow([*key.values(), *("" if row.get(c) is None else row.get(c) for c in columns[len(key):])])
        f.flush()
        os.fsync(f.fileno())


def write_artifacts(out: Path, key: dict[str, Any], artifacts: dict[str, list[dict[str, Any]]]) -> None:
    for name, rows in artifacts.items():
        append_rows(out / f"{name}.csv", key, rows)
