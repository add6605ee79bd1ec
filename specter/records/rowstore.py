"""One validated, append-only CSV row store: every table the harness appends row by row.

records.csv, batch.csv, routes.csv and trace.csv are all written and read through this module,
so they share one set of guarantees:

* **Appends are whole or absent.** Rows are formatted first, then written with one `O_APPEND`
  write and fsynced. A write that fails part-way (a full disk, a quota) is cut back to the
  previous end of file (`ftruncate`), and the caller gets one `RowStoreError` naming the file and
  the reason; the folder stays usable, and the next run appends after the last good row.
* **Rows are validated on read.** A row counts only when its line is terminated, UTF-8, parses
  as CSV with exactly the header's columns, has its required columns filled, its numbers
  parseable, and (for keyed tables) a key not seen before. Anything else is *rejected*.
* **Rejects are set aside, never dropped.** A writer opening a table appends its rejected lines
  to `<name>.rejected.csv` (line number, reason, the line as it was), rewrites the table
  atomically without them and warns; whatever the rejected rows stood for is measured again. A
  reader (figures, summaries) skips them with a warning and never modifies the file. A writer
  needs this version's header; a reader also takes another one (an older layout, a hand-made
  table) and validates the columns it has: structure and numbers always, a table's further
  rules (e.g. records' digests) only under this version's header.

A table whose name ends in `.csv.gz` (the bulky per-window side tables, routes and trace) is the
same text stored gzip-compressed: every append is one gzip member (a multi-member file is one valid
gzip stream, so `pandas.read_csv` and `gzip.open` read it whole), a rewrite one member. A member torn
by an interrupted write is read up to where it breaks, and its last line then counts as torn, as in
a plain table. `load_bytes` gives either form's text.

A *keyed* table (records, batch) allows one row per key; the first wins, later duplicates are
rejected. A *block* table (routes, trace) holds many rows per record key, written as one block
per record before the record itself; when a record is measured again, the reader keeps the last
block of that key (an earlier block, possibly cut short by a crash, is superseded).
"""

from __future__ import annotations

import bisect
import csv
import gzip
import io
import math
import os
import sys
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specter.assembly.config_error import ConfigError
from specter.paths import atomic_write_bytes


class RowStoreError(ConfigError):
    """A table cannot be used or extended as it is; the message names the file and what to do."""


@dataclass(frozen=True)
class Rejected:
    """A line of a table that is not a valid row."""

    line: int  # 1-based line number in the file
    reason: str
    text: str  # the line as it was (undecodable bytes replaced)


@dataclass(frozen=True)
class Schema:
    """What a valid row of one table looks like."""

    name: str  # the table's file stem ("records", "batch", "routes", "trace")
    columns: tuple[str, ...]  # what this version writes, in order
    key: tuple[str, ...]  # unique key (keyed tables) or record key (block tables)
    text: frozenset[str] = frozenset()  # columns that hold text; every other column is a number
    integers: frozenset[str] = frozenset()  # non-negative integers when filled
    required: tuple[str, ...] = ()  # never empty in a valid row
    blocks: bool = False  # many rows per key (routes, trace) instead of one
    check: Callable[[dict[str, str]], str | None] | None = None  # further rules, a reason or None
    older: tuple[tuple[str, ...], ...] = ()  # earlier headers a reader still accepts
    noun: str = "row"  # what one row is called in messages

    @property
    def numeric(self) -> tuple[str, ...]:
        return tuple(c for c in self.columns if c not in self.text)

    def problem(self, values: dict[str, str], rules: bool = True) -> str | None:
        """Why `values` (column -> text as in the CSV) is not a valid row, or None. `rules=False`
        checks the structure only (filled required columns, parseable numbers), not `check`."""
        empty = [c for c in self.required if c in values and not values[c].strip()]
        if empty:
            return f"required column(s) empty: {', '.join(empty)}"
        for c in self.columns:
            v = values.get(c, "")
            if v == "" or c in self.text:
                continue
            if c in self.integers:
                if not v.isdigit():
                    return f"{c}={v!r} is not a non-negative integer"
                continue
            try:
                float(v)
            except ValueError:
                return f"{c}={v!r} is not a number"
        return self.check(values) if self.check is not None and rules else None

    def accepts_header(self, header: list[str], exact: bool) -> bool:
        """The writer needs this version's header; a reader (not exact) takes any header and
        validates the columns it has."""
        if tuple(header) == self.columns:
            return True
        return not exact and bool(header)


@dataclass
class Table:
    """A parsed table: its header, valid rows (line, raw line, values) and rejected lines."""

    header: list[str]
    rows: list[tuple[int, str, dict[str, str]]] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    damaged: set[tuple[str, ...]] = field(default_factory=set)  # block tables: keys whose block lost a line
    every_row: list[tuple[int, str, dict[str, str]]] = field(default_factory=list)  # block tables: superseded too

    def values(self) -> list[dict[str, str]]:
        return [v for _, _, v in self.rows]


def cell(v: Any) -> str:
    """One value as CSV text: empty for None, one physical line always."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return str(v).replace("\r", " ").replace("\n", " ")


def format_row(values: Iterable[str]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(list(values))
    return buf.getvalue()


def key_of(schema: Schema, values: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(values.get(c, "")) for c in schema.key)


def parse(data: bytes, schema: Schema, exact: bool = True) -> Table:
    """Split a table's bytes into valid rows and rejected lines (see the module docstring).

    Raises RowStoreError when the header is not one this schema accepts (`exact`: this version's)."""
    lines = data.split(b"\n")
    terminated = data.endswith(b"\n")
    if terminated:
        lines = lines[:-1]
    if not lines:
        return Table([])
    if not lines[0].strip():
        raise RowStoreError("has no header line")
    try:
        header = next(csv.reader([lines[0].decode("utf-8")]), [])
    except (UnicodeDecodeError, csv.Error):
        header = []
    if not schema.accepts_header(header, exact):
        raise RowStoreError(f"has columns {header[:12]}{' ...' if len(header) > 12 else ''}, not this version's "
                            f"schema of {schema.name}.csv")
    table = Table(header)
    keyed = set(schema.key) <= set(header)  # a reader's older layout without the key: no duplicates check
    seen: dict[tuple[str, ...], int] = {}
    for i, raw_bytes in enumerate(lines[1:], start=2):
        raw = raw_bytes.decode("utf-8", errors="replace")
        if not raw_bytes.strip():
            if raw_bytes:
                table.rejected.append(Rejected(i, "blank line", raw))
            continue
        if i == len(lines) and not terminated:
            table.rejected.append(Rejected(i, "torn last line (no line end: the write was interrupted)", raw))
            continue
        try:
            text = raw_bytes.decode("utf-8")
        except UnicodeDecodeError as err:
            table.rejected.append(Rejected(i, f"not UTF-8 text ({err.reason} at byte {err.start})", raw))
            continue
        try:
            fields = next(csv.reader([text]))
        except csv.Error as err:
            table.rejected.append(Rejected(i, f"not a CSV row ({err})", raw))
            continue
        if len(fields) != len(header):
            table.rejected.append(Rejected(i, f"{len(fields)} columns instead of {len(header)}", raw))
            continue
        values = dict(zip(header, fields))
        problem = schema.problem(values, rules=exact or tuple(header) == schema.columns)
        if problem:
            table.rejected.append(Rejected(i, problem, raw))
            continue
        if not schema.blocks and keyed:
            key = key_of(schema, values)
            if key in seen:
                table.rejected.append(Rejected(i, f"duplicate of the {schema.noun} on line {seen[key]}", raw))
                continue
            seen[key] = i
        table.rows.append((i, raw, values))
    if schema.blocks:
        table.damaged = damaged_blocks(schema, table.rows, table.rejected)
        table.every_row = table.rows
        table.rows = last_blocks(schema, table.rows)
    return table


def damaged_blocks(schema: Schema, rows: list[tuple[int, str, dict[str, str]]],
                   rejected: list[Rejected]) -> set[tuple[str, ...]]:
    """Keys whose last block (the one readers keep) lost a rejected line.

    A block is one write of consecutive lines. A rejected line belongs to its own key when the key
    columns came through whole (more fields follow them), else to the block just before or just
    after it. A block superseded by a later one of the same key does not count."""
    if not rejected:
        return set()
    by_line = sorted(rows, key=lambda r: r[0])
    lines = [r[0] for r in by_line]
    start: dict[tuple[str, ...], int] = {}  # key -> first line of its last block
    prev = None
    for line, _, values in by_line:
        k = key_of(schema, values)
        if k != prev:
            start[k] = line
            prev = k
    header = list(by_line[0][2]) if by_line else list(schema.columns)
    out: set[tuple[str, ...]] = set()
    for r in rejected:
        try:
            fields = next(csv.reader([r.text]), [])
        except csv.Error:
            fields = []
        own = dict(zip(header, fields))
        if len(fields) > len(schema.key) and all(own.get(c, "").isdigit() for c in schema.key if c in schema.integers):
            k = key_of(schema, own)
            if k in start and start[k] <= r.line + 1:
                out.add(k)
            continue
        i = bisect.bisect_left(lines, r.line)
        if i > 0:
            k = key_of(schema, by_line[i - 1][2])
            if lines[i - 1] >= start[k]:
                out.add(k)
        if i < len(by_line):
            k = key_of(schema, by_line[i][2])
            if lines[i] == start[k]:
                out.add(k)
    return out


def last_blocks(schema: Schema, rows: list[tuple[int, str, dict[str, str]]]) -> list[tuple[int, str, dict[str, str]]]:
    """Of each key's blocks (runs of consecutive rows with that key), only the last one."""
    block_of: list[int] = []
    last: dict[tuple[str, ...], int] = {}
    prev: tuple[str, ...] | None = None
    n = -1
    for _, _, values in rows:
        k = key_of(schema, values)
        if k != prev:
            n += 1
            prev = k
        block_of.append(n)
        last[k] = n
    return [r for r, b in zip(rows, block_of) if last[key_of(schema, r[2])] == b]


def rejected_path(path: Path) -> Path:
    """Where a table's rejected lines are set aside: records.csv -> records.rejected.csv (and
    routes.csv.gz -> routes.rejected.csv: the rejected lines are few, kept as plain text)."""
    return path.with_name(f"{table_stem(path.name)}.rejected.csv")


def table_stem(name: str) -> str:
    """routes.csv.gz -> routes, records.csv -> records."""
    for suffix in (".csv.gz", ".csv", ".gz"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return Path(name).stem


def compressed(path: Path) -> bool:
    return Path(path).name.endswith(".gz")


def gunzip_members(data: bytes) -> tuple[bytes, bool]:
    """The text of a multi-member gzip stream, and whether its last member is torn (cut short or
    damaged: its text is kept up to where it breaks)."""
    out: list[bytes] = []
    while data.count(0) < len(data):  # stop at the end, or at the zero padding allowed after the last member
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out.append(d.decompress(data))
        except zlib.error:
            return b"".join(out), True
        if not d.eof:
            out.append(d.flush())
            return b"".join(out), True
        data = d.unused_data
    return b"".join(out), False


def gzip_member(data: bytes) -> bytes:
    """`data` as one gzip member (mtime 0: the same text always gives the same bytes)."""
    return gzip.compress(data, compresslevel=6, mtime=0)


def load_bytes(path: Path) -> bytes:
    """A table's text as bytes: a `.gz` table decompressed; a torn last member's text ends in a torn
    line (its line end dropped when the break fell just after one), so the parser rejects that line
    and a block table marks its block as having lost a line."""
    data = Path(path).read_bytes()
    if not compressed(path):
        return data
    text, torn = gunzip_members(data)
    if torn and text.endswith(b"\n"):
        text = text[:-1]
    return text


def _warn_default(msg: str) -> None:
    print(f"specter: warning: {msg}", file=sys.stderr, flush=True)


def read_table(path: Path, schema: Schema, warn: Callable[[str], None] | None = None,
               exact: bool = False) -> Table:
    """The valid rows of a table, read only: rejected lines are reported (`warn`) and not counted."""
    path = Path(path)
    warn = warn or _warn_default
    try:
        data = load_bytes(path)
    except OSError as err:
        raise RowStoreError(f"cannot read {path} ({err.strerror or err})") from None
    try:
        table = parse(data, schema, exact=exact)
    except RowStoreError as err:
        raise RowStoreError(f"{path} {err}") from None
    for r in table.rejected:
        warn(f"{path} line {r.line}: {r.reason}; not counted")
    return table


def read_frame(path: Path, schema: Schema, warn: Callable[[str], None] | None = None, exact: bool = False):
    """`read_table` as a DataFrame: text columns as str, numbers as numbers, empty cells NaN."""
    import pandas as pd

    table = read_table(path, schema, warn, exact)
    if not table.header:
        return pd.DataFrame(columns=list(schema.columns))

    body = format_row(table.header) + "".join(raw + "\n" for _, raw, _ in table.rows)
    text_cols = {c: str for c in table.header if c in schema.text}
    df = pd.read_csv(io.StringIO(body), dtype=text_cols)
    return df


class RowStore:
    """An append-only table on disk, validated when opened (see the module docstring)."""

    def __init__(self, path: Path, schema: Schema, warn: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.schema = schema
        self.rejected_path = rejected_path(self.path)
        self.rejected: list[Rejected] = []
        self.keys: set[tuple[str, ...]] = set()
        self.rows: list[dict[str, str]] = []  # keyed tables: the valid rows found when opened
        self.damaged: set[tuple[str, ...]] = set()  # block tables: keys whose block lost a line (rejected)
        warn = warn or _warn_default
        try:
            data = load_bytes(self.path) if self.path.exists() else b""
        except OSError as err:
            raise RowStoreError(f"cannot read {self.path} ({err.strerror or err})") from None
        header_line = format_row(schema.columns).encode()
        if not data.strip():
            self._write_atomic(header_line)
            return
        try:
            table = parse(data, schema, exact=True)
        except RowStoreError as err:
            raise RowStoreError(f"{self.path} {err}; use a new output_dir") from None
        if table.rejected:
            self._set_aside(table.rejected)
            self._write_atomic(header_line + "".join(raw + "\n" for _, raw, _ in table.rows).encode())
            for r in table.rejected:
                warn(f"{self.path} line {r.line}: {r.reason}; moved to {self.rejected_path.name} "
                     "(measured again)")
        self.rejected = table.rejected
        self.damaged = table.damaged
        self.keys = {key_of(schema, v) for v in table.values()}
        if not schema.blocks:  # the valid rows when opened (a block table's can be many; not kept)
            self.rows = table.values()

    def set_aside_keys(self, keys: set[tuple[str, ...]], reason: str,
                       warn: Callable[[str], None] | None = None) -> list[Rejected]:
        """Move every row of `keys` to `<name>.rejected.csv` with `reason`, and rewrite the table
        atomically without them: what they stood for is measured again (a block table's new block then
        never runs on from a stale one of the same key)."""
        data = load_bytes(self.path)
        table = parse(data, self.schema, exact=True)
        rows = table.every_row if self.schema.blocks else table.rows
        gone = [Rejected(i, reason, raw) for i, raw, v in rows if key_of(self.schema, v) in keys]
        if not gone:
            return []
        self._set_aside(gone)
        kept = [raw for i, raw, v in rows if key_of(self.schema, v) not in keys]
        self._write_atomic(format_row(self.schema.columns).encode() + "".join(r + "\n" for r in kept).encode())
        self.keys -= set(keys)
        self.damaged -= set(keys)
        self.rows = [v for v in self.rows if key_of(self.schema, v) not in keys]
        lines = ", ".join(str(r.line) for r in gone[:8]) + (" ..." if len(gone) > 8 else "")
        (warn or _warn_default)(f"{self.path} line(s) {lines}: {reason}; moved to {self.rejected_path.name}")
        return gone

    def _set_aside(self, rejected: list[Rejected]) -> None:
        try:
            new = not self.rejected_path.exists() or self.rejected_path.stat().st_size == 0
            text = ("line,reason,row\n" if new else "") + "".join(
                format_row([str(r.line), r.reason, r.text]) for r in rejected)
            _append_bytes(self.rejected_path, text.encode("utf-8"))
        except OSError as err:
            raise RowStoreError(f"cannot set aside invalid rows of {self.path} in {self.rejected_path} "
                                f"({err.strerror or err})") from None

    def _write_atomic(self, data: bytes) -> None:
        try:
            atomic_write_bytes(self.path, gzip_member(data) if compressed(self.path) else data)
        except OSError as err:
            raise RowStoreError(f"cannot write {self.path} ({err.strerror or err})") from None

    def has(self, key: tuple[str, ...]) -> bool:
        return tuple(str(k) for k in key) in self.keys

    def format(self, row: dict[str, Any]) -> tuple[tuple[str, ...], bytes]:
        """(key, line) of a row, validated; ValueError for a row this table must never hold."""
        unknown = set(row) - set(self.schema.columns)
        if unknown:
            raise KeyError(f"unknown {self.schema.name} columns: {sorted(unknown)}")
        values = [cell(row.get(c)) for c in self.schema.columns]
        as_dict = dict(zip(self.schema.columns, values))
        key = key_of(self.schema, as_dict)
        problem = self.schema.problem(as_dict)
        if problem:
            raise ValueError(f"refusing to write an invalid {self.schema.noun} {key}: {problem}")
        return key, format_row(values).encode("utf-8")

    def append(self, row: dict[str, Any], what: str = "a row") -> None:
        self.append_many([row], what)

    def append_many(self, rows: list[dict[str, Any]], what: str = "rows") -> None:
        """Append rows as one write, fsynced; a failed write leaves the file as it was."""
        if not rows:
            return
        keys, lines = [], []
        for row in rows:
            key, line = self.format(row)
            if not self.schema.blocks and (key in self.keys or key in keys):
                raise ValueError(f"{self.schema.noun} {key} already exists in {self.path}")
            keys.append(key)
            lines.append(line)
        data = b"".join(lines)
        try:
            _append_bytes(self.path, gzip_member(data) if compressed(self.path) else data)
        except OSError as err:
            raise RowStoreError(f"cannot append {what} to {self.path} ({err.strerror or err}); finished rows "
                                "are kept, free space and rerun the same command to resume") from None
        self.keys.update(keys)


def _append_bytes(path: Path, data: bytes) -> None:
    """Append `data` with O_APPEND and fsync; on failure cut the file back to its previous end."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        end = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            while written < len(data):
                written += os.write(fd, data[written:])
            os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, end)
            except OSError:
                pass  # the torn line is rejected on the next open
            raise
    finally:
        os.close(fd)
