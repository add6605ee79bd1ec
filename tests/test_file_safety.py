"""Every file as safe as records.csv: figures read only valid rows (item 2), configured names never
leave their folder and runners come from a registry (4), provenance is checked before it is
written (7), content digests for weights and caches (8), the lock before the folder check and
atomic experiment-root tables (12)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from specter import paths
from specter.figures.data import ResultSet
from specter.experiments import cli
from specter.records.artifacts import SideTables
from specter.assembly.config import ConfigError
from specter.records.output import LOCK_NAME, OutputError, run_folder
from specter.records.records import RecordWriter, token_digest
from specter.paths import UnsafeName, safe_name


def record(i: int, tpot: float = 40.0, **extra) -> dict:
    return {"method": "specter", "model": "tiny_qwen", "memory": "low", "dataset": "humaneval", "prompt_index": i,
            "repeat": 0, "new_tokens": 8, "tpot_ms": tpot, "output_digest": token_digest([i, 1]), "seed": i, **extra}


def run_dir(root: Path, n: int = 2) -> Path:
    out = root / "run"
    out.mkdir(parents=True)
    (out / "config.yaml").write_text("model:\n  name: tiny_qwen\nmemory:\n  name: low\nmethod:\n  name: specter\n")
    w = RecordWriter(out / "records.csv")
    for i in range(n):
        w.append(record(i))
    return out


# ------------------------------------------------------------------ item 2: make_figures' reader

def test_figures_skip_a_torn_records_row(tmp_path, capsys):
    out = run_dir(tmp_path)
    line = (out / "records.csv").read_text().splitlines()[-1]
    torn = line.replace(",0,0,", ",2,0,", 1).replace(",40.0,", ",1.0,")
    with (out / "records.csv").open("a") as f:
        f.write(torn[: torn.index(",1.0,") + 5])  # cut right after its (much lower) TPOT
    records = ResultSet(tmp_path).records()
    assert len(records) == 2 and records.tpot_ms.median() == 40.0
    assert "torn last line" in capsys.readouterr().out


def test_figures_survive_bad_side_tables_and_config(tmp_path, capsys):
    out = run_dir(tmp_path)
    side = SideTables(out)
    for i in range(2):
        side.append({"dataset": "humaneval", "prompt_index": i, "repeat": 0},
                    {"routes": [{"window": 0, "layer": 1, "expert": 2, "count": 1}],
                     "trace": [{"window": 0, "event": "copy", "start_ms": 0.0, "end_ms": 1.0, "layer": 1, "expert": 2,
                                "bytes": 8, "phase": "", "queued_ms": 0.0}]})
    from specter.records.rowstore import gzip_member

    with (out / "routes.csv.gz").open("ab") as f:
        f.write(gzip_member(b"humaneval,1,0,\xe9\xff,1,2,1\n"))  # not UTF-8
    with (out / "trace.csv.gz").open("ab") as f:
        f.write(gzip_member(b"humaneval,1,0,1,copy,early,late,1,2,8,,0.0\n"))  # not numbers
    (out / "config.yaml").write_text("model: [unclosed\n  name: x\n")  # not YAML
    results = ResultSet(tmp_path)
    [(_, routes)] = results.csvs("routes.csv")
    [(_, trace)] = results.csvs("trace.csv")
    assert len(routes) == 2 and len(trace) == 2 and trace.start_ms.dtype.kind == "f"
    assert results.config(out) == {}
    assert len(results.records()) == 2
    printed = capsys.readouterr().out
    assert "not UTF-8" in printed and "start_ms='early'" in printed and "config.yaml cannot be read" in printed


def test_figures_keep_side_rows_of_finished_records_only(tmp_path):
    out = run_dir(tmp_path, n=1)
    SideTables(out).append({"dataset": "humaneval", "prompt_index": 5, "repeat": 0},
                           {"routes": [{"window": 0, "layer": 1, "expert": 2, "count": 1}]})
    assert ResultSet(tmp_path).csvs("routes.csv") == []  # prompt 5 never finished


# ------------------------------------------------------------------ item 4: names and runners

@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".hidden", "", "x" * 129, "-rf", "a\nb"])
def test_unsafe_names_are_refused(name):
    with pytest.raises(UnsafeName, match="model.name"):
        safe_name(name, "model.name")


@pytest.mark.parametrize("name", ["tiny_qwen", "dsv2", "mo_sc", "B=4", "phi3.5-moe", "x+y"])
def test_safe_names_pass(name):
    assert safe_name(name, "model.name") == name


def test_runner_only_from_the_registry(tmp_path):
    from specter.assembly.methods import build_method
    from specter.assembly.runners import known_runners

    RUNNERS = known_runners()

    cfg = OmegaConf.create({"method": {"name": "evil", "runner": "os:system"}})
    with pytest.raises(ConfigError, match="unknown runner 'os:system'"):
        build_method(cfg, tmp_path)
    assert "specter.assembly.methods:Specter" in RUNNERS
    conf = Path(__file__).resolve().parents[1] / "conf" / "method"
    for f in conf.glob("*.yaml"):  # every shipped method is known
        runner = next(line.split(":", 1)[1].strip() for line in f.read_text().splitlines()
                      if line.startswith("runner:"))
        assert runner in RUNNERS, f


# ------------------------------------------------------------------ item 7: provenance checked first

def _gsm8k(root: Path, questions: list[str]) -> Path:
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k" / "test.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in questions))
    return root


def test_refused_resume_writes_no_provenance(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    a = _gsm8k(tmp_path / "a", ["What is two plus two?", "Name a prime number."])
    b = _gsm8k(tmp_path / "b", ["What is three plus three?", "Name an even number."])
    out = tmp_path / "run"
    args = ["method=target_only", "model=tiny_qwen", "dataset=gsm8k", "num_prompts=2", "max_new_tokens=2",
            "warmup_tokens=0", "progress=false", f"output_dir={out}"]
    assert cli.main([*args, f"assets_dir={a}"]) == 0
    (out / "provenance.json").unlink()
    capsys.readouterr()
    assert cli.main([*args, f"assets_dir={b}"]) == 2  # other prompts: refused ...
    assert "measured on another prompt" in capsys.readouterr().err
    assert not (out / "provenance.json").exists()  # ... before anything was written
    assert cli.main([*args, f"assets_dir={a}"]) == 0  # and the original command still resumes
    assert "nothing to run" in capsys.readouterr().out
    assert str(a) in json.loads((out / "provenance.json").read_text())["datasets"]["gsm8k"]["source"]


# ------------------------------------------------------------------ item 8: content digests

def _fake_checkpoint(folder: Path) -> Path:
    from safetensors.torch import save_file
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "qwen2_moe"}')
    return folder


def _flip_in_place_keep_mtime(path: Path, offset: int = -4) -> None:
    st = path.stat()
    time.sleep(0.05)  # past the file clock's tick: the change is a new ctime
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        byte = f.read(1)
        f.seek(offset, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_weights_digest_sees_a_same_size_change_with_mtime_kept(tmp_path, monkeypatch):
    from specter.models.registry import checkpoint_digest

    monkeypatch.setattr(paths, "RACY_NS", 0)  # remember even a just-written file
    ckpt = _fake_checkpoint(tmp_path / "ckpt")
    before = checkpoint_digest(ckpt)
    assert json.loads((ckpt / ".specter-digest.json").read_text())  # memoized
    _flip_in_place_keep_mtime(ckpt / "model.safetensors")
    after = checkpoint_digest(ckpt)
    assert after != before
    assert after == checkpoint_digest(ckpt)


def test_weights_hash_once_per_content(tmp_path, monkeypatch):
    from specter.models.registry import checkpoint_digest

    monkeypatch.setattr(paths, "RACY_NS", 0)
    ckpt = _fake_checkpoint(tmp_path / "ckpt")
    calls = []
    real = paths.file_sha256
    monkeypatch.setattr(paths, "file_sha256", lambda p, *a: calls.append(p) or real(p, *a))
    first = checkpoint_digest(ckpt)
    assert checkpoint_digest(ckpt) == first and len(calls) == 1


def test_a_just_written_file_is_hashed_again(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "ckpt")
    memo: dict = {}
    paths.content_sha256(ckpt / "model.safetensors", memo)
    assert memo == {}  # written within the clock's resolution: not trusted from a memo


def test_bit_flipped_gguf_is_exported_again(tmp_path, monkeypatch, capsys):
    gguf_export = pytest.importorskip("baselines.gguf_export")
    monkeypatch.setenv("SPECTER_HOME", str(tmp_path / "home"))
    ckpt = _fake_checkpoint(tmp_path / "ckpt")
    exports = []

    def export(checkpoint, out, file_type, name=None):
        exports.append(out)
        Path(out).write_bytes(b"GGUF" + bytes(range(256)) * 4)
        return out

    monkeypatch.setattr(gguf_export, "export_gguf", export)
    path = gguf_export.cached_gguf(ckpt, "f32", label="tiny_qwen")
    good = path.read_bytes()
    assert gguf_export.cached_gguf(ckpt, "f32", label="tiny_qwen") == path and len(exports) == 1
    _flip_in_place_keep_mtime(path, offset=-100)
    assert gguf_export.cached_gguf(ckpt, "f32", label="tiny_qwen") == path
    assert len(exports) == 2 and path.read_bytes() == good
    assert "does not match its checksum" in capsys.readouterr().err
    with pytest.raises(UnsafeName):
        gguf_export.cached_gguf(ckpt, "f32", label="../../x")


# ------------------------------------------------------------------ item 12: lock first, atomic tables

def test_a_locked_folder_names_its_holder_even_before_config_exists(tmp_path):
    out = tmp_path / "B=2"
    out.mkdir()
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"4242\n")
    (out / "records.csv").write_text("method\n")  # the holder's first file, before its config.yaml
    try:
        cfg = OmegaConf.create({"output_dir": str(out), "method": {"name": "m"}})
        with pytest.raises(OutputError, match=r"in use by another run \(pid 4242\)"):
            with run_folder(cfg):
                pass
    finally:
        os.close(fd)


def test_foreign_folder_is_refused_and_left_as_it_was(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    with pytest.raises(OutputError, match="holds no Specter run"):
        with run_folder(OmegaConf.create({"output_dir": str(out)})):
            pass
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def _fail_rename(monkeypatch):
    def replace(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(paths.os, "replace", replace)


def test_batch_summary_is_written_atomically(tmp_path, monkeypatch):
    from specter.experiments import batch as batch_mod
    from specter.experiments.batch import BatchTable
    from specter.records.rowstore import RowStoreError

    (tmp_path / "B=2").mkdir()
    BatchTable(tmp_path / "B=2" / "batch.csv").append(
        {"method": "m", "model": "x", "memory": "low", "batch_size": 2, "dataset": "humaneval", "repeat": 0,
         "requests": 2, "batches": 1, "new_tokens": 4, "wall_s": 0.1})
    (tmp_path / "batch_summary.csv").write_text("old\n")
    _fail_rename(monkeypatch)
    with pytest.raises(RowStoreError, match="batch_summary.csv"):
        batch_mod.write_batch_summary(tmp_path, [2], {2: "measured"}, {"method": "m", "model": "x", "memory": "low"})
    assert (tmp_path / "batch_summary.csv").read_text() == "old\n"


def _fake_run(monkeypatch, tpot: float = 40.0):
    from specter.experiments import run as run_mod

    def run(cfg):
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        w = RecordWriter(out / "records.csv")
        for i in range(2):
            if not w.is_done(("specter", "tiny_qwen", "low", "humaneval", str(i), "0")):
                w.append(record(i, tpot=tpot, accepted_tokens=3, drafted_tokens=4, acceptance_alpha=0.75,
                                h2d_bytes=100))
        return out

    monkeypatch.setattr(run_mod, "run", run)


def test_k_sweep_and_profile_are_written_atomically(tmp_path, monkeypatch, capsys):
    from specter.experiments.profile_k import profile_k

    _fake_run(monkeypatch)
    cfg = OmegaConf.create({"method": {"name": "specter"}, "model": {"name": "tiny_qwen"}, "memory": {"name": "low"},
                            "hardware": {"name": "cpu"}, "k_sweep": {"values": [2]}, "output_dir": str(tmp_path),
                            "K": None, "experiment": "k_sweep"})
    profile_k(cfg)
    assert pd.read_csv(tmp_path / "k_sweep.csv").K.tolist() == [2]
    assert json.loads((tmp_path / "k_profile.json").read_text())["K"] == 2
    (tmp_path / "k_sweep.csv").write_text("old\n")
    _fail_rename(monkeypatch)  # the K=2 run folder is complete: only the root's tables are written
    with pytest.raises(ValueError, match="k_sweep.csv"):
        profile_k(cfg)
    assert (tmp_path / "k_sweep.csv").read_text() == "old\n"


def test_compare_table_is_written_atomically(tmp_path, monkeypatch):
    from specter.experiments import compare as compare_mod

    _fake_run(monkeypatch)
    monkeypatch.setattr(compare_mod, "method_config", lambda cfg, m: OmegaConf.merge(
        cfg, {"output_dir": str(tmp_path / m)}))
    cfg = OmegaConf.create({"compare": {"methods": ["specter"]}, "output_dir": str(tmp_path),
                            "model": {"name": "tiny_qwen"}, "memory": {"name": "low"}, "hardware": {"name": "cpu"}})
    compare_mod.compare(cfg)
    assert pd.read_csv(tmp_path / "compare.csv").records.tolist() == [2]
    (tmp_path / "compare.csv").write_text("old\n")
    _fail_rename(monkeypatch)
    with pytest.raises(ValueError, match="compare.csv"):
        compare_mod.compare(cfg)
    assert (tmp_path / "compare.csv").read_text() == "old\n"
