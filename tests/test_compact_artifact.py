"""A compact artifact: the bulky per-window logs (routes, trace) are written gzip-compressed, every
reader takes the plain and the compressed form alike, and the tracked tree stays under the 64 MiB a
device call carries."""

from __future__ import annotations

import gzip
import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from specter.figures.data import ResultSet, read_validated
from specter.records.artifacts import SideTables, side_path
from specter.records.records import RecordWriter, token_digest
from specter.reproduce.outputs import _csv_rows

REPO = Path(__file__).resolve().parents[1]
KEY = {"dataset": "humaneval", "repeat": 0}
ROUTES = [{"window": w, "layer": 1, "expert": e, "count": 1} for w in range(3) for e in (0, 2)]
TRACE = [{"window": 0, "event": "copy", "start_ms": 0.0, "end_ms": 1.0, "layer": 1, "expert": 2, "bytes": 8,
          "phase": "", "queued_ms": 0.0}]


def _run(folder: Path, prompts: int = 2) -> Path:
    """A finished run folder: `prompts` records, their routes and trace written by the harness."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("model:\n  name: tiny_qwen\nmemory:\n  name: low\nmethod:\n  name: specter\n")
    side, writer = SideTables(folder), RecordWriter(folder / "records.csv")
    for i in range(prompts):
        side.append({**KEY, "prompt_index": i}, {"routes": ROUTES, "trace": TRACE})
        writer.append({"method": "specter", "model": "tiny_qwen", "memory": "low", "dataset": "humaneval",
                       "prompt_index": i, "repeat": 0, "new_tokens": 8, "tpot_ms": 40.0,
                       "output_digest": token_digest([i, 1]), "seed": i})
    return folder


def test_the_writer_compresses_the_side_tables(tmp_path):
    out = _run(tmp_path / "run")
    for name, rows in (("routes", ROUTES), ("trace", TRACE)):
        assert side_path(out, name) == out / f"{name}.csv.gz" and not (out / f"{name}.csv").exists()
        raw = (out / f"{name}.csv.gz").read_bytes()
        assert raw[:2] == b"\x1f\x8b"  # gzip: one member for the header, one per record's block
        assert gzip.decompress(raw).decode().count("\n") == 1 + 2 * len(rows)
        df = pd.read_csv(out / f"{name}.csv.gz")  # any gzip reader takes it whole
        assert len(df) == 2 * len(rows) and set(df.prompt_index) == {0, 1}


def test_a_folder_begun_before_compression_keeps_its_plain_table(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "routes.csv").touch()
    SideTables(out).append({**KEY, "prompt_index": 0}, {"routes": ROUTES, "trace": TRACE})
    assert (out / "routes.csv").read_text().count("\n") == 1 + len(ROUTES) and not (out / "routes.csv.gz").exists()
    assert (out / "trace.csv.gz").exists()  # a table it did not have yet starts compressed


def test_readers_take_csv_and_csv_gz_alike(tmp_path):
    gz = _run(tmp_path / "gz")
    plain = _run(tmp_path / "plain")
    for name in ("routes", "trace"):  # the plain form, as older folders and results/reference hold it
        (plain / f"{name}.csv").write_bytes(gzip.decompress((plain / f"{name}.csv.gz").read_bytes()))
        (plain / f"{name}.csv.gz").unlink()
    for name in ("routes.csv", "trace.csv"):
        found = dict(ResultSet(tmp_path).csvs(name))  # what Fig. 13 and Figs. 8/9 read
        assert set(found) == {gz / f"{name}.gz", plain / name}
        pd.testing.assert_frame_equal(found[gz / f"{name}.gz"], found[plain / name])
        pd.testing.assert_frame_equal(read_validated(gz / f"{name}.gz"), read_validated(plain / name))
        assert _csv_rows(gz / f"{name}.gz") == _csv_rows(plain / name)  # reproduce_all's output check
    # a folder holding both forms counts once, in the form the writer appends to
    (gz / "routes.csv").write_bytes((plain / "routes.csv").read_bytes())
    found = [p for p, _ in ResultSet(tmp_path).csvs("routes.csv")]
    assert sorted(found) == sorted([gz / "routes.csv.gz", plain / "routes.csv"]) and side_path(gz, "routes") in found


def test_the_tracked_tree_fits_one_device_call():
    """git ls-files, every tracked file's size summed (nothing excluded): under the 64 MiB working tree
    the device machine takes."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    files = [REPO / os.fsdecode(name) for name in listed.split(b"\0") if name]
    if not files:
        pytest.skip("not a git checkout")
    total = sum(p.lstat().st_size for p in files if os.path.lexists(p))
    assert total < 64 * 2**20, f"the tracked tree holds {total / 2**20:.1f} MiB, over 64 MiB"
