"""records.csv is never lost or corrupted: torn, invalid and duplicated rows are set aside and
measured again, appends never build on a torn line, and every side file is written atomically."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pandas as pd
import pytest

from specter.records import rowstore
from specter.experiments import cli
from specter.records.records import COLUMNS, REJECTED_NAME, RecordsError, RecordWriter, read_records, token_digest
from specter.records.summary import write_summary

RUN = ["method=target_only", "model=tiny_qwen", "dataset=humaneval", "num_prompts=4", "max_new_tokens=4",
       "warmup_tokens=0", "progress=false", "assets_dir=/nonexistent", "allow_hub=false"]  # the bundled HumanEval


def row(i: int, **extra) -> dict:
    return {"method": "m", "model": "x", "memory": "high", "dataset": "humaneval", "prompt_index": i, "repeat": 0,
            "new_tokens": 4, "tpot_ms": 1.5, "output_digest": token_digest([i, 1, 2, 3]), "seed": i, **extra}


def lines(path) -> list[str]:
    return path.read_text().splitlines()


def test_torn_last_row_is_set_aside_and_not_built_upon(tmp_path, capsys):
    path = tmp_path / "records.csv"
    w = RecordWriter(path)
    for i in range(3):
        w.append(row(i))
    text = path.read_text()
    path.write_text(text[: text.rindex("\n", 0, -1) + 1 + 60])  # the last row cut to 60 characters
    w = RecordWriter(path)
    assert w.finished == 2 and not w.is_done(("m", "x", "high", "humaneval", "2", "0"))
    assert "line 4: torn last line" in capsys.readouterr().err
    rejected = pd.read_csv(tmp_path / REJECTED_NAME)
    assert rejected.line.tolist() == [4] and len(rejected.row[0]) == 60  # kept, not dropped
    w.append(row(2))  # measured again, on a line of its own
    df = pd.read_csv(path)
    assert df.prompt_index.tolist() == [0, 1, 2] and tuple(df.columns) == COLUMNS


@pytest.mark.parametrize("edit,reason", [
    (lambda ln: ln[1], "duplicate of the record on line 2"),
    (lambda ln: ",".join(ln[1].split(",")[:6]), f"6 columns instead of {len(COLUMNS)}"),  # only the key columns
    (lambda ln: ",".join(ln[1].split(",")[:6] + [""] * (len(COLUMNS) - 6)), "required column(s) empty"),
    (lambda ln: ln[1].replace(",1.5,", ",fast,").replace(",0,0,", ",7,0,", 1), "tpot_ms='fast' is not a number"),
    (lambda ln: ln[1].replace(token_digest([0, 1, 2, 3]), "abc").replace(",0,0,", ",8,0,", 1), "output_digest"),
    (lambda ln: ln[1].replace(",0,0,", ",x,0,", 1), "prompt_index='x'"),
    (lambda ln: "", None),  # a blank line is harmless
])
def test_hand_edited_rows_are_reported_by_line(tmp_path, capsys, edit, reason):
    path = tmp_path / "records.csv"
    w = RecordWriter(path)
    w.append(row(0))
    w.append(row(1))
    original = lines(path)
    path.write_text("\n".join(original + [edit(original)]) + "\n")
    w = RecordWriter(path)
    err = capsys.readouterr().err
    assert w.finished == 2
    if reason is None:
        assert err == ""
        return
    assert f"line 4: {reason}" in err
    assert lines(path) == original  # records.csv keeps exactly the finished rows
    assert REJECTED_NAME in err and (tmp_path / REJECTED_NAME).exists()
    summary_input = read_records(path)
    assert len(summary_input) == 2


def test_summary_counts_each_record_once_and_survives_bad_values(tmp_path):
    path = tmp_path / "records.csv"
    w = RecordWriter(path)
    for i in range(4):
        w.append(row(i))
    text = path.read_text()
    body = text.splitlines()
    path.write_text(text + body[2] + "\n" + body[3].replace(",1.5,", ",abc,").replace(",2,0,", ",9,0,", 1) + "\n")
    summary = write_summary(tmp_path)
    assert summary.records.tolist() == [4]
    assert pd.read_csv(tmp_path / "summary.csv").records.tolist() == [4]


def test_summary_carries_the_routing_regime(tmp_path):
    w = RecordWriter(tmp_path / "records.csv")
    for i, (hit, ws, ratio) in enumerate([(0.25, 20.0, 0.5), (0.75, 30.0, 0.7)]):
        w.append(row(i, demand_hits=i + 1, demand_misses=3 - 2 * i, hit_rate=hit, window_experts=ws,
                     window_experts_vs_independent=ratio))
    write_summary(tmp_path)
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert summary.hit_rate.tolist() == [0.5] and summary.window_experts.tolist() == [25.0]
    assert summary.window_experts_vs_independent.tolist() == [pytest.approx(0.6)]


@pytest.mark.parametrize("column,value", [("hit_rate", "1.5"), ("window_experts", "-1"),
                                          ("window_experts_vs_independent", "-0.2")])
def test_impossible_routing_values_are_rejected(tmp_path, column, value):
    w = RecordWriter(tmp_path / "records.csv")
    with pytest.raises(ValueError, match=column):
        w.append(row(0, **{column: value}))


def test_append_refuses_invalid_and_duplicate_rows(tmp_path):
    w = RecordWriter(tmp_path / "records.csv")
    w.append(row(0))
    with pytest.raises(ValueError, match="already exists"):
        w.append(row(0))
    with pytest.raises(ValueError, match="not a number"):
        w.append(row(1, tpot_ms="fast"))
    with pytest.raises(ValueError, match="required"):
        w.append({k: v for k, v in row(2).items() if k != "output_digest"})
    w.append(row(3, lossless_check="tie@3 (margin 0.1)\nsecond line"))  # one physical line per record
    assert len(lines(tmp_path / "records.csv")) == 3


def test_other_schema_is_a_clear_error(tmp_path):
    (tmp_path / "records.csv").write_text("a,b\n1,2\n")
    with pytest.raises(RecordsError, match="not this version's schema"):
        RecordWriter(tmp_path / "records.csv")


def test_failed_append_is_cut_back(tmp_path, monkeypatch):
    """A write that fails part-way (disk full) leaves no torn line behind."""
    path = tmp_path / "records.csv"
    w = RecordWriter(path)
    w.append(row(0))
    before = path.read_bytes()
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, data[:17])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rowstore.os, "write", full_disk)
    with pytest.raises(RecordsError, match="No space left"):
        w.append(row(1))
    monkeypatch.undo()
    assert path.read_bytes() == before
    w.append(row(1))
    assert RecordWriter(path).finished == 2


def _mount_tmpfs(path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_real_full_disk(tmp_path, capsys, tiny_checkpoint):
    """A 12 KB tmpfs as the output folder: the run stops with one line (never a traceback, never a
    torn record); after the disk grows, the same command completes every prompt exactly once."""
    tiny_checkpoint("tiny_qwen")
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "12k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        args = [*RUN, f"output_dir={disk / 'run'}"]
        rc = cli.main(args)
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert rc == 2 and sum(ln.startswith("specter: error:") for ln in err.splitlines()) == 1, err
        assert "No space left" in err
        subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)
        assert cli.main(args) == 0
        capsys.readouterr()
        df = pd.read_csv(disk / "run" / "records.csv")
        assert sorted(df.prompt_index) == [0, 1, 2, 3]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_cut_row_end_to_end_is_measured_again(tmp_path, capsys, tiny_checkpoint):
    """The reported reproduction: cut the last row to 60 characters and rerun."""
    tiny_checkpoint("tiny_qwen")
    out = tmp_path / "run"
    args = [*RUN, f"output_dir={out}"]
    assert cli.main(args) == 0
    first = pd.read_csv(out / "records.csv")
    text = (out / "records.csv").read_text()
    (out / "records.csv").write_text(text[: text.rindex("\n", 0, -1) + 1 + 60])
    capsys.readouterr()
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "line 5: torn last line" in err and REJECTED_NAME in err
    again = pd.read_csv(out / "records.csv")
    assert again.prompt_index.tolist() == [0, 1, 2, 3]
    assert again.output_digest.tolist() == first.output_digest.tolist()
    assert again.prompt_sha256.str.len().eq(64).all()
    assert pd.read_csv(out / "summary.csv").records.tolist() == [4]
    assert cli.main(args) == 0  # and every later run is fine
    assert "nothing to run" in capsys.readouterr().out
