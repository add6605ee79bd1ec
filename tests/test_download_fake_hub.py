"""initialization/download_models.py against a local fake hub: download, pin, verify, resume, repair."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("download_models", REPO / "initialization" / "download_models.py")
dm = importlib.util.module_from_spec(spec)
sys.modules["download_models"] = dm
spec.loader.exec_module(dm)

C1, C2 = "1" * 40, "2" * 40


def snapshot(hub: Path, commit: str, weights: bytes, branch: str | None = "main") -> Path:
    repo = hub / "models--fake--tiny-moe"
    snap = repo / "snapshots" / commit
    (snap / "sub").mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "fake", "commit": commit}))
    (snap / "model.safetensors").write_bytes(weights)
    (snap / "sub" / "tokenizer.json").write_text("{}")
    (snap / "README.md").write_text("not a weight file")  # filtered out
    if branch:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / branch).write_text(commit + "\n")
    return snap


@pytest.fixture
def hub(tmp_path):
    weights = os.urandom(300_000)
    snapshot(tmp_path / "hub", C1, weights)
    return tmp_path / "hub", weights


def run(tmp_path, hub_dir, *extra):
    return dm.main(["--repo", "fake/tiny-moe", "--name", "fake", "--source", str(hub_dir), "--dest",
                    str(tmp_path / "models"), "--manifest", str(tmp_path / "revisions.json"), *extra])


def test_download_records_revision_and_checksums(tmp_path, hub, capsys):
    hub_dir, weights = hub
    assert run(tmp_path, hub_dir) == 0
    folder = tmp_path / "models" / "tiny-moe"
    assert (folder / "model.safetensors").read_bytes() == weights
    assert (folder / "sub" / "tokenizer.json").exists() and not (folder / "README.md").exists()
    record = json.loads((tmp_path / "revisions.json").read_text())["fake"]
    assert record["revision"] == C1 and record["hf_id"] == "fake/tiny-moe"
    assert record["files"]["model.safetensors"] == {"size": 300_000, "sha256": hashlib.sha256(weights).hexdigest()}
    assert set(record["files"]) == {"config.json", "model.safetensors", "sub/tokenizer.json"}
    sums = (folder / "SHA256SUMS").read_text()
    assert f"{hashlib.sha256(weights).hexdigest()}  model.safetensors" in sums
    # a rerun touches nothing
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert run(tmp_path, hub_dir) == 0
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert "bytes, verified" not in capsys.readouterr().out
    assert dm.main(["--repo", "fake/tiny-moe", "--name", "fake", "--dest",
                   str(tmp_path / "models"), "--manifest", str(tmp_path / "revisions.json"), "--verify-only"]) == 0


def test_resume_and_repair(tmp_path, hub, capsys):
    hub_dir, weights = hub
    assert run(tmp_path, hub_dir) == 0
    folder = tmp_path / "models" / "tiny-moe"
    # an interrupted download: the file is gone, half of it waits in .part
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.part").write_bytes(weights[:120_000])
    capsys.readouterr()
    assert run(tmp_path, hub_dir) == 0
    assert "resuming at 120000 bytes" in capsys.readouterr().out
    assert (folder / "model.safetensors").read_bytes() == weights and not (folder / "model.safetensors.part").exists()
    # a corrupted byte: --verify-only reports it, a normal run fetches the file again
    data = bytearray(weights)
    data[1000] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(data))
    verify = ["--repo", "fake/tiny-moe", "--name", "fake", "--dest", str(tmp_path / "models"), "--manifest",
              str(tmp_path / "revisions.json"), "--verify-only"]
    assert dm.main(verify) == 1
    assert "model.safetensors" in capsys.readouterr().err
    assert run(tmp_path, hub_dir) == 0
    assert (folder / "model.safetensors").read_bytes() == weights
    assert dm.main(verify) == 0
    # a bad half-file left in .part: the checksum catches it and the file is fetched whole
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.part").write_bytes(b"\0" * 1000)
    assert run(tmp_path, hub_dir) == 0
    assert (folder / "model.safetensors").read_bytes() == weights


def test_recorded_revision_is_pinned(tmp_path, hub):
    hub_dir, weights = hub
    assert run(tmp_path, hub_dir) == 0
    new = os.urandom(1000)
    snapshot(hub_dir, C2, new)  # the branch moves on upstream
    folder = tmp_path / "models" / "tiny-moe"
    (folder / "model.safetensors").unlink()
    assert run(tmp_path, hub_dir) == 0
    assert (folder / "model.safetensors").read_bytes() == weights  # still the recorded commit
    assert json.loads((tmp_path / "revisions.json").read_text())["fake"]["revision"] == C1
    assert run(tmp_path, hub_dir, "--update") == 0
    assert (folder / "model.safetensors").read_bytes() == new
    assert json.loads((tmp_path / "revisions.json").read_text())["fake"]["revision"] == C2


def test_changed_source_bytes_are_refused(tmp_path, hub, capsys):
    hub_dir, _ = hub
    assert run(tmp_path, hub_dir) == 0
    (hub_dir / "models--fake--tiny-moe" / "snapshots" / C1 / "model.safetensors").write_bytes(b"tampered")
    (tmp_path / "models" / "tiny-moe" / "model.safetensors").unlink()
    assert run(tmp_path, hub_dir) == 2
    err = capsys.readouterr().err
    assert "model.safetensors does not match its recorded sha256" in err
    assert not (tmp_path / "models" / "tiny-moe" / "model.safetensors").exists()


def test_missing_mirror_is_a_clear_error(tmp_path, capsys):
    assert run(tmp_path, tmp_path / "nowhere") == 2
    assert "not in the mirror" in capsys.readouterr().err


# ---------------------------------------------------------------- datasets from a fake mirror

FIX = REPO / "tests" / "fixtures" / "datasets"


def _hub_file(mirror: Path, repo: str, path: str) -> Path:
    root = mirror / ("datasets--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(C1)
    dest = root / "snapshots" / C1 / path
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest


def dataset_mirror(root: Path) -> Path:
    import gzip
    import shutil

    import pandas as pd

    _hub_file(root, "allenai/c4", "en/c4-validation.00000-of-00008.json.gz").write_bytes(
        (FIX / "c4" / "c4-validation.00000-of-00008.json.gz").read_bytes())
    lines = (FIX / "wikitext2" / "wiki.test.raw").read_text().splitlines(keepends=True)
    pd.DataFrame({"text": lines}).to_parquet(_hub_file(root, "Salesforce/wikitext", "wikitext-2-raw-v1/test-00000-of-00001.parquet"))
    tokens = [ln.replace("-", " @-@ ") for ln in lines]
    pd.DataFrame({"text": tokens}).to_parquet(_hub_file(root, "Salesforce/wikitext", "wikitext-2-v1/test-00000-of-00001.parquet"))
    with gzip.open(FIX / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    pd.DataFrame(rows).to_parquet(_hub_file(root, "openai/openai_humaneval", "openai_humaneval/test-00000-of-00001.parquet"))
    rows = [json.loads(line) for line in (FIX / "gsm8k" / "test.jsonl").read_text().splitlines()]
    pd.DataFrame(rows).to_parquet(_hub_file(root, "openai/gsm8k", "main/test-00000-of-00001.parquet"))
    gpqa = root / "urls" / "github.com" / "idavidrein" / "gpqa" / "raw" / "main" / "dataset.zip"
    gpqa.parent.mkdir(parents=True)
    shutil.copyfile(FIX / "gpqa" / "gpqa_main.csv.zip", gpqa)
    return root


def test_prepare_datasets_from_mirror(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from initialization import prepare_datasets as pdm

    mirror = dataset_mirror(tmp_path / "mirror")
    assets = tmp_path / "assets"
    assert pdm.main(["--assets", str(assets), "--source", str(mirror), "--verify-prompts", "2"]) == 0, capsys.readouterr().err
    manifest = json.loads((assets / "MANIFEST.json").read_text())
    assert set(manifest) == {"c4", "wikitext2", "humaneval", "gsm8k", "gpqa"}
    assert manifest["wikitext2"]["variant"] == "raw" and manifest["wikitext2"]["file"] == "wikitext2/wiki.test.raw"
    assert all(e["origin"] == f"mirror:{mirror}" for e in manifest.values())
    c4 = assets / "c4" / "c4-validation.00000-of-00008.json.gz"
    assert manifest["c4"]["sha256"] == hashlib.sha256(c4.read_bytes()).hexdigest()
    # resume: half a copy waits in .part
    data = c4.read_bytes()
    c4.unlink()
    c4.with_name(c4.name + ".part").write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert pdm.main(["--assets", str(assets), "--source", str(mirror), "--datasets", "c4", "--verify-prompts", "2"]) == 0
    assert f"resuming at {len(data) // 2} bytes" in capsys.readouterr().out and c4.read_bytes() == data
    # the tokenized WikiText-2 replaces the raw one only when asked to
    assert pdm.main(["--assets", str(assets), "--source", str(mirror), "--datasets", "WT", "--wikitext", "tokens"]) == 1
    assert "--force" in capsys.readouterr().err
    assert pdm.main(["--assets", str(assets), "--source", str(mirror), "--datasets", "WT", "--wikitext", "tokens",
                     "--force", "--verify-prompts", "2"]) == 0
    manifest = json.loads((assets / "MANIFEST.json").read_text())
    assert manifest["wikitext2"]["variant"] == "tokens" and manifest["wikitext2"]["file"] == "wikitext2/wiki.test.tokens"
    assert not (assets / "wikitext2" / "wiki.test.raw").exists() and "@-@" in (assets / "wikitext2" / "wiki.test.tokens").read_text()
    assert pdm.main(["--assets", str(assets), "--datasets", "WT", "--wikitext", "tokens", "--verify-only",
                     "--verify-prompts", "2"]) == 0


def test_prepare_wikitext_tokens_from_zip(tmp_path, monkeypatch):
    import zipfile

    monkeypatch.syspath_prepend(str(REPO))
    from initialization import prepare_datasets as pdm

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    text = (FIX / "wikitext2" / "wiki.test.raw").read_text().replace("-", " @-@ ")
    with zipfile.ZipFile(downloads / "wikitext-2-v1.zip", "w") as zf:
        zf.writestr("wikitext-2/wiki.test.tokens", text)
    assets = tmp_path / "assets"
    assert pdm.main(["--assets", str(assets), "--from-dir", str(downloads), "--datasets", "wikitext2",
                     "--wikitext", "tokens", "--verify-prompts", "2"]) == 0
    entry = json.loads((assets / "MANIFEST.json").read_text())["wikitext2"]
    assert entry["variant"] == "tokens" and entry["origin"] == f"copied:{downloads}"
    assert (assets / "wikitext2" / "wiki.test.tokens").read_text() == text
