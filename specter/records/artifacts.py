"""Per-record side tables of a run folder (routes.csv.gz, trace.csv.gz), one block of rows per record.

They are the bulky per-window logs, so they are written gzip-compressed (`<name>.csv.gz`, one gzip
member per record's block: specter/records/rowstore.py); a folder begun before that keeps appending
to its plain `<name>.csv`. `side_path` says which file a folder's table is, for writers and readers
alike; every reader takes both forms.

Each row is prefixed with the record's key (dataset, prompt_index, repeat). Both tables go through
the validated row store (specter/records/rowstore.py): a record's rows are appended as one
fsynced write, cut back when the write fails, and validated when the table is opened (torn or
invalid rows set aside in `<name>.rejected.csv`).

A record's side rows are written *before* its records.csv row, so a finished record always has
its complete side rows: a run interrupted in between leaves rows of an unfinished record, which
is measured again and appends a new block; readers keep the last block of each record key and
only the blocks of records that finished (`specter/figures/data.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specter.records.rowstore import RowStore, Schema

ARTIFACT_KEY = ("dataset", "prompt_index", "repeat")

ROUTES = Schema(
    "routes", (*ARTIFACT_KEY, "window", "layer", "expert", "count"), ARTIFACT_KEY, text=frozenset({"dataset"}),
    integers=frozenset({"prompt_index", "repeat", "window", "layer", "expert", "count"}),
    required=(*ARTIFACT_KEY, "window", "layer", "expert", "count"), blocks=True,
)
_TRACE_V1 = (*ARTIFACT_KEY, "window", "event", "start_ms", "end_ms", "layer", "expert", "bytes", "phase")
TRACE = Schema(
    "trace", (*_TRACE_V1, "queued_ms"), ARTIFACT_KEY, text=frozenset({"dataset", "event", "phase"}),
    integers=frozenset({"prompt_index", "repeat", "window", "bytes"}),
    required=(*ARTIFACT_KEY, "window", "event", "start_ms", "end_ms"), blocks=True, older=(_TRACE_V1,),
)
SIDE_TABLES: dict[str, Schema] = {"routes": ROUTES, "trace": TRACE}


def side_paths(folder: Path, name: str) -> tuple[Path, Path]:
    """The two forms of a side table in `folder`: (`<name>.csv.gz`, `<name>.csv`)."""
    return Path(folder) / f"{name}.csv.gz", Path(folder) / f"{name}.csv"


def side_path(folder: Path, name: str) -> Path:
    """The file of side table `name` in `folder`: `<name>.csv.gz` if it exists, else a plain `<name>.csv`
    that exists (a folder begun before compression), else `<name>.csv.gz` (a new table)."""
    gz, plain = side_paths(folder, name)
    return plain if plain.exists() and not gz.exists() else gz


def side_exists(folder: Path, name: str) -> bool:
    return any(p.exists() for p in side_paths(folder, name))


class SideTables:
    """The side tables of one run folder, each opened (and validated) on its first use."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self._stores: dict[str, RowStore] = {}

    def store(self, name: str) -> RowStore:
        if name not in SIDE_TABLES:
            raise KeyError(f"unknown side table {name!r}; known: {sorted(SIDE_TABLES)}")
        if name not in self._stores:
            self._stores[name] = RowStore(side_path(self.out, name), SIDE_TABLES[name])
        return self._stores[name]

    def append(self, key: dict[str, Any], artifacts: dict[str, list[dict[str, Any]]]) -> None:
        """One block per table: `rows`, each prefixed with the record's `key`."""
        for name, rows in artifacts.items():
            if rows:
                self.store(name).append_many([{**key, **row} for row in rows], what=f"the {name} rows of a record")

