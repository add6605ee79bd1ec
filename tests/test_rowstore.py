"""The one validated row store behind records.csv, batch.csv, routes.csv and trace.csv: a failed
append is cut back (disk full mid-row), torn and invalid rows are set aside and measured again,
and a new row is never glued onto a torn one (issue items 1 and 3)."""

from __future__ import annotations

import errno
import os

import pandas as pd
import pytest

from specter.experiments import batch as batch_mod
from specter.records import rowstore
from specter.records.artifacts import ROUTES, TRACE, SideTables
from specter.experiments.batch import BATCH_COLUMNS, BATCH_SCHEMA, BatchTable
from specter.records.rowstore import RowStore, RowStoreError, read_frame, read_table


def batch_row(ds: str = "humaneval", repeat: int = 0, **extra) -> dict:
    return {"method": "specter", "model": "tiny_qwen", "memory": "low", "batch_size": 2, "dataset": ds,
            "repeat": repeat, "tpot_median_ms": 3.5, "throughput_tok_s": 100.0, "requests": 2, "batches": 1,
            "new_tokens": 8, "wall_s": 0.08, "iterations": 4, **extra}


def routes(n: int = 3) -> list[dict]:
    return [{"window": w, "layer": 1, "expert": e, "count": 1} for w in range(n) for e in (0, 2)]


def trace(n: int = 2) -> list[dict]:
    return [{"window": w, "event": "copy", "start_ms": 0.5 * w, "end_ms": 0.5 * w + 0.25, "layer": 1, "expert": 3,
             "bytes": 4096, "phase": "cold_start", "queued_ms": 0.0} for w in range(n)]


def full_disk_after(monkeypatch, n_bytes: int):
    """The next write puts `n_bytes` on disk, then fails with ENOSPC (a disk that fills mid-row)."""
    real_write = os.write

    def write(fd, data):
        real_write(fd, data[:n_bytes])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rowstore.os, "write", write)


def full_disk_at_fsync(monkeypatch):
    monkeypatch.setattr(rowstore.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))


# ------------------------------------------------------------------ item 1: batch.csv

def test_hand_torn_batch_row_is_not_trusted(tmp_path, capsys):
    path = tmp_path / "batch.csv"
    t = BatchTable(path)
    t.append(batch_row(repeat=0))
    t.append(batch_row(repeat=1))
    text = path.read_text()
    path.write_text(text[: text.rindex("\n", 0, -1) + 1 + 40])  # the last row cut to 40 characters
    assert not batch_mod.unit_finished(path, "humaneval", 1)  # read only: not measured, so it runs again
    assert batch_mod.unit_finished(path, "humaneval", 0)
    t = BatchTable(path)
    assert t.is_done("humaneval", 0) and not t.is_done("humaneval", 1)
    assert "line 3: torn last line" in capsys.readouterr().err
    rejected = pd.read_csv(tmp_path / "batch.rejected.csv")
    assert rejected.line.tolist() == [3]
    t.append(batch_row(repeat=1))  # measured again, on a line of its own
    df = pd.read_csv(path)
    assert df.repeat.tolist() == [0, 1] and tuple(df.columns) == BATCH_COLUMNS


def test_two_parsable_fields_do_not_make_a_batch_row(tmp_path, capsys):
    path = tmp_path / "batch.csv"
    BatchTable(path).append(batch_row(repeat=0))
    with path.open("a") as f:  # dataset and repeat parse, nothing else does
        f.write("specter,tiny_qwen,low,2,humaneval,fast,,,,,,1" + "," * (len(BATCH_COLUMNS) - 12) + "\n")
    assert not batch_mod.unit_finished(path, "humaneval", 1)
    assert BatchTable(path).done == {("humaneval", "0")}
    assert "batch.csv line 3: required column(s) empty" in capsys.readouterr().err


@pytest.mark.parametrize("fail", ["write", "fsync"])
def test_batch_disk_full_is_one_error_and_the_folder_stays_usable(tmp_path, monkeypatch, fail):
    path = tmp_path / "batch.csv"
    t = BatchTable(path)
    t.append(batch_row(repeat=0))
    before = path.read_bytes()
    if fail == "write":
        full_disk_after(monkeypatch, 25)
    else:
        full_disk_at_fsync(monkeypatch)
    with pytest.raises(RowStoreError, match="No space left on device.*rerun the same command"):
        t.append(batch_row(repeat=1))
    monkeypatch.undo()
    assert path.read_bytes() == before  # cut back: nothing for the next row to be glued onto
    t = BatchTable(path)
    t.append(batch_row(repeat=1))
    assert read_frame(path, BATCH_SCHEMA).repeat.tolist() == [0, 1]


def test_batch_summary_reads_only_valid_rows(tmp_path, capsys):
    out = tmp_path / "B=2"
    out.mkdir()
    t = BatchTable(out / "batch.csv")
    t.append(batch_row(repeat=0))
    with (out / "batch.csv").open("a") as f:
        f.write("specter,tiny_qwen,low,2,humaneval,1.0,2.0\n")  # torn by hand, glued-on garbage
        f.write('specter,tiny_qwen,low,2,"unterminated\n')
    batch_mod.write_batch_summary(tmp_path, [2], {2: "measured"},
                                  {"method": "specter", "model": "tiny_qwen", "memory": "low"})
    summary = pd.read_csv(tmp_path / "batch_summary.csv")
    assert summary.repeat.tolist() == [0]
    assert "not counted" in capsys.readouterr().err


# ------------------------------------------------------------------ item 3: routes.csv / trace.csv
# A new run writes routes.csv.gz / trace.csv.gz; a folder begun before that keeps its plain routes.csv /
# trace.csv. Every side-table guarantee holds for both forms.

FORMS = ("gz", "plain")


def side_file(folder, name: str, form: str):
    """The file SideTables writes in `folder` for `form` (a plain table: as in a folder begun before
    compression, which already held the plain file)."""
    if form == "plain":
        path = folder / f"{name}.csv"
        path.touch()
        return path
    return folder / f"{name}.csv.gz"


def append_raw(path, data: bytes) -> None:
    """Bytes appended to a table by hand, as one gzip member in a compressed table."""
    with path.open("ab") as f:
        f.write(rowstore.gzip_member(data) if path.name.endswith(".gz") else data)


@pytest.mark.parametrize("form", FORMS)
def test_side_tables_disk_full_mid_block_is_cut_back(tmp_path, monkeypatch, form):
    paths = {n: side_file(tmp_path, n, form) for n in ("routes", "trace")}
    side = SideTables(tmp_path)
    side.append({"dataset": "humaneval", "prompt_index": 0, "repeat": 0}, {"routes": routes(), "trace": trace()})
    before = {n: p.read_bytes() for n, p in paths.items()}
    full_disk_after(monkeypatch, 30)
    with pytest.raises(RowStoreError, match="routes rows of a record.*No space left"):
        side.append({"dataset": "humaneval", "prompt_index": 1, "repeat": 0}, {"routes": routes(), "trace": trace()})
    monkeypatch.undo()
    assert paths["routes"].read_bytes() == before["routes"]
    assert paths["trace"].read_bytes() == before["trace"]
    SideTables(tmp_path).append({"dataset": "humaneval", "prompt_index": 1, "repeat": 0},
                                {"routes": routes(), "trace": trace()})
    df = read_frame(paths["routes"], ROUTES)
    assert df.groupby("prompt_index").size().tolist() == [6, 6]
    assert len(df.columns) == 7


@pytest.mark.parametrize("form", FORMS)
def test_torn_side_row_is_set_aside_and_not_glued(tmp_path, capsys, form):
    key = {"dataset": "humaneval", "prompt_index": 0, "repeat": 0}
    path = side_file(tmp_path, "routes", form)
    SideTables(tmp_path).append(key, {"routes": routes()})
    # a crash mid-row: 7 columns become fewer, no line end (compressed: the last member loses its trailer)
    path.write_bytes(path.read_bytes()[:-(9 if form == "plain" else 3)])
    SideTables(tmp_path).append({**key, "prompt_index": 1}, {"routes": routes(1)})
    assert "torn last line" in capsys.readouterr().err
    table = read_table(path, ROUTES)
    assert not table.rejected  # every line has its 7 columns: nothing was glued onto the torn row
    assert len(pd.read_csv(tmp_path / "routes.rejected.csv")) == 1


@pytest.mark.parametrize("form", FORMS)
def test_measured_again_keeps_the_last_block(tmp_path, form):
    key = {"dataset": "humaneval", "prompt_index": 0, "repeat": 0}
    path = side_file(tmp_path, "routes", form)
    side = SideTables(tmp_path)
    side.append(key, {"routes": routes(3)[:2]})  # a block cut short: its record never finished
    side.append({**key, "prompt_index": 1}, {"routes": routes(2)})
    side.append(key, {"routes": routes(3)})  # the record measured again
    df = read_frame(path, ROUTES)
    assert df.groupby("prompt_index").size().to_dict() == {0: 6, 1: 4}


@pytest.mark.parametrize("form", FORMS)
def test_trace_rows_are_numbers_and_the_older_header_reads(tmp_path, capsys, form):
    path = side_file(tmp_path, "trace", form)
    SideTables(tmp_path).append({"dataset": "gsm8k", "prompt_index": 0, "repeat": 0}, {"trace": trace()})
    append_raw(path, b"gsm8k,0,0,1,copy,soon,later,1,3,4096,cold_start,0.0\n")
    df = read_frame(path, TRACE)
    assert len(df) == 2 and df.start_ms.dtype.kind == "f"
    assert "start_ms='soon' is not a number" in capsys.readouterr().err
    old = tmp_path / "old" / "trace.csv"
    old.parent.mkdir()
    old.write_text("dataset,prompt_index,repeat,window,event,start_ms,end_ms,layer,expert,bytes,phase\n"
                   "gsm8k,0,0,0,copy,0.0,0.5,1,3,4096,\n")
    assert len(read_frame(old, TRACE)) == 1  # the figures still read traces written before queued_ms
    with pytest.raises(RowStoreError, match="not this version's schema of trace.csv"):
        RowStore(old, TRACE)  # but a run never appends rows of another layout to it


@pytest.mark.parametrize("form", FORMS)
def test_non_utf8_line_is_rejected_not_fatal(tmp_path, capsys, form):
    path = side_file(tmp_path, "routes", form)
    SideTables(tmp_path).append({"dataset": "gsm8k", "prompt_index": 0, "repeat": 0}, {"routes": routes(1)})
    append_raw(path, b"gsm8k,0,0,\xff\xfe,1,2,3\n")
    assert len(read_frame(path, ROUTES)) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_invalid_rows_are_refused_on_write(tmp_path):
    store = RowStore(tmp_path / "routes.csv", ROUTES)
    with pytest.raises(ValueError, match="count='x'"):
        store.append({"dataset": "d", "prompt_index": 0, "repeat": 0, "window": 0, "layer": 1, "expert": 0,
                      "count": "x"})
    with pytest.raises(KeyError, match="unknown"):
        store.append({"dataset": "d", "prompt_index": 0, "repeat": 0, "bogus": 1})
