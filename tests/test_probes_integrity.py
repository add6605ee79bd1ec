"""Integrity probes: a file dropped into a shipped tree, a record with impossible numbers, a side
table cut short in a finished folder — none may reach a figure or a summary unnoticed."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from specter.figures.data import ResultSet, manifest
from specter.records.artifacts import SideTables
from specter.records.records import RecordWriter, token_digest
from specter.experiments.run import repair_side_tables

BASE_KEY = {"method": "specter", "model": "tiny_qwen", "memory": "low"}


def record(i: int, **extra) -> dict:
    return {**BASE_KEY, "dataset": "humaneval", "prompt_index": i, "repeat": 0, "new_tokens": 8, "tpot_ms": 40.0,
            "output_digest": token_digest([i, 1]), "seed": i, **extra}


def run_dir(root: Path, n: int = 2, name: str = "run") -> Path:
    out = root / name
    out.mkdir(parents=True)
    (out / "config.yaml").write_text("model:\n  name: tiny_qwen\nmemory:\n  name: low\nmethod:\n  name: specter\n")
    w = RecordWriter(out / "records.csv")
    for i in range(n):
        w.append(record(i))
    return out


# -- verify --pinned and the figures' manifest ----------------------------------------------------------
def test_verify_pinned_catches_an_uncommitted_file(tmp_path):
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "checksums.py", repo / "scripts" / "checksums.py")
    ref = repo / "results" / "reference"
    ref.mkdir(parents=True)
    (ref / "records.csv").write_text("a\n")
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    script = [sys.executable, str(repo / "scripts" / "checksums.py")]
    assert subprocess.run([*script, "write", "--pinned"], capture_output=True).returncode == 0
    assert subprocess.run([*script, "verify", "--pinned"], capture_output=True).returncode == 0
    (ref / "extra").mkdir()
    (ref / "extra" / "records.csv").write_text("b\n")  # never committed, never listed
    res = subprocess.run([*script, "verify", "--pinned"], capture_output=True, text=True)
    assert res.returncode == 1 and "not committed" in res.stderr and "extra/records.csv" in res.stderr


def _sums(root: Path, names: list[str], at: Path) -> None:
    (at / "SHA256SUMS").write_text("".join(
        f"{hashlib.sha256((root / n).read_bytes()).hexdigest()}  {(root / n).relative_to(at).as_posix()}\n"
        for n in names))


@pytest.mark.parametrize("where", ["own", "above"])
def test_figures_read_only_what_the_manifest_lists(where, tmp_path):
    root = tmp_path / "set"
    good = run_dir(root, 2, "good")
    _sums(root, ["good/records.csv", "good/config.yaml"], root if where == "own" else tmp_path)
    dropped = run_dir(root, 2, "dropped")  # an untracked extra run in a shipped tree
    assert manifest(root) is not None and (dropped / "records.csv").resolve() not in manifest(root)
    records = ResultSet(root).records()
    assert len(records) == 2 and set(records.run) == {"good"} if "run" in records else len(records) == 2
    assert (good / "records.csv").resolve() in manifest(root)


def test_a_folder_no_manifest_covers_is_read_whole(tmp_path):
    run_dir(tmp_path / "mine", 2, "a")
    run_dir(tmp_path / "mine", 1, "b")
    assert manifest(tmp_path / "mine") is None or not manifest(tmp_path / "mine")
    assert len(ResultSet(tmp_path / "mine").records()) == 3


def test_the_reference_tree_is_read_through_the_repository_manifest():
    listed = manifest(REPO / "results" / "reference")
    assert listed and all(p.is_relative_to((REPO / "results" / "reference").resolve()) for p in listed)


# -- impossible values ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,needle", [
    ({"tpot_ms": -5}, "tpot_ms=-5 is negative"),
    ({"ttft_ms": -0.1}, "ttft_ms=-0.1 is negative"),
    ({"accepted_tokens": 9, "drafted_tokens": 4}, "accepted_tokens=9 exceeds drafted_tokens=4"),
    ({"accepted_fraction": 1.5}, "accepted_fraction=1.5 is not in [0, 1]"),
    ({"h2d_bytes": -1}, "h2d_bytes=-1 is negative"),
])
def test_records_with_impossible_values_are_rejected(bad, needle, tmp_path, capsys):
    out = run_dir(tmp_path, 3)
    w = RecordWriter(out / "records.csv")
    with pytest.raises(ValueError, match="refusing to write an invalid record"):
        w.append(record(7, **bad))
    text = (out / "records.csv").read_text().splitlines()
    hacked = text[-1].replace(",40.0,", ",-5,", 1) if "tpot_ms" in bad else None
    if hacked:  # hand-edited into a finished folder: set aside on open, measured again
        (out / "records.csv").write_text("\n".join([*text[:-1], hacked]) + "\n")
        w = RecordWriter(out / "records.csv", warn=lambda m: None)
        assert w.finished == 2 and needle in w.rejected[0].reason
        assert len(ResultSet(tmp_path).records()) == 2


# -- torn side tables in a finished folder ----------------------------------------------------------------
def _routes(n: int) -> list[dict]:
    return [{"window": w, "layer": 1, "expert": w % 4, "count": 1} for w in range(n)]


def test_a_torn_routes_block_of_a_finished_record_is_measured_again(tmp_path, capsys):
    out = run_dir(tmp_path, 0)
    w = RecordWriter(out / "records.csv")
    side = SideTables(out)
    for i in range(2):
        side.append({"dataset": "humaneval", "prompt_index": i, "repeat": 0}, {"routes": _routes(4)})
        w.append(record(i))
    data = (out / "routes.csv.gz").read_bytes()
    (out / "routes.csv.gz").write_bytes(data[:-3])  # the last record's block torn (its gzip member cut short)
    w = RecordWriter(out / "records.csv", warn=lambda m: None)
    side = SideTables(out)
    repair_side_tables(out, w, BASE_KEY, side)
    key = tuple(str(v) for v in (*BASE_KEY.values(), "humaneval", 1, 0))
    assert not w.is_done(key) and w.is_done(tuple(str(v) for v in (*BASE_KEY.values(), "humaneval", 0, 0)))
    assert "routes.csv block lost a line" in (out / "records.rejected.csv").read_text()
    # the rerun measures it again: a new whole block supersedes the short one
    side.append({"dataset": "humaneval", "prompt_index": 1, "repeat": 0}, {"routes": _routes(4)})
    w.append(record(1))
    from specter.figures.data import read_validated

    routes = read_validated(out / "routes.csv.gz")
    assert (routes.prompt_index == 1).sum() == 4 and (routes.prompt_index == 0).sum() == 4


def test_a_torn_block_of_an_unfinished_record_spares_the_finished_one(tmp_path):
    out = run_dir(tmp_path, 0)
    w = RecordWriter(out / "records.csv")
    side = SideTables(out)
    side.append({"dataset": "humaneval", "prompt_index": 0, "repeat": 0}, {"routes": _routes(3)})
    w.append(record(0))
    side.append({"dataset": "humaneval", "prompt_index": 1, "repeat": 0}, {"routes": _routes(3)})
    data = (out / "routes.csv.gz").read_bytes()
    (out / "routes.csv.gz").write_bytes(data[:-3])  # killed while writing record 1's rows: record 1 not finished
    w = RecordWriter(out / "records.csv", warn=lambda m: None)
    repair_side_tables(out, w, BASE_KEY, SideTables(out))
    assert w.finished == 1
