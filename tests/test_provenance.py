"""Resume is safe: prompts and weights are recorded and checked; caches are keyed by the weights;
tiny checkpoints are verified against their recorded hashes."""

from __future__ import annotations

import hashlib
import json
import shutil
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from conftest import compose
from specter.experiments import cli
from specter.models import tiny
from specter.models.registry import checkpoint_digest

QUESTIONS = ["How many legs do three spiders have altogether?", "What is seven times eight, minus six?",
             "A train leaves at noon at sixty miles an hour; where is it at three?"]
RUN = ["method=target_only", "model=tiny_qwen", "dataset=gsm8k", "num_prompts=2", "max_new_tokens=3",
       "warmup_tokens=0", "progress=false", "allow_hub=false"]


def assets(root, questions):
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k" / "test.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in questions))
    return root


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("specter: error:")]
    return line


def test_provenance_recorded_and_other_prompts_refused(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    a = assets(tmp_path / "a", QUESTIONS)
    out = tmp_path / "run"
    args = [*RUN, f"output_dir={out}"]
    assert cli.main([*args, f"assets_dir={a}"]) == 0
    rec = pd.read_csv(out / "records.csv")
    assert rec.prompt_sha256.tolist() == [hashlib.sha256(q.encode()).hexdigest() for q in QUESTIONS[:2]]
    prov = json.loads((out / "provenance.json").read_text())["datasets"]["gsm8k"]
    assert prov["file_sha256"] == hashlib.sha256((a / "gsm8k" / "test.jsonl").read_bytes()).hexdigest()
    assert prov["source"] == f"assets:{a / 'gsm8k' / 'test.jsonl'}" and prov["num_prompts"] == 2
    env = json.loads((out / "env.json").read_text())
    assert env["weights_sha256"] == checkpoint_digest(tiny_checkpoint("tiny_qwen"))

    # an interrupted run resumed against another assets folder with other prompts: refused
    lines = (out / "records.csv").read_text().splitlines()
    (out / "records.csv").write_text("\n".join(lines[:-1]) + "\n")
    b = assets(tmp_path / "b", [QUESTIONS[0], "A different second question about apples and pears?"])
    assert cli.main([*args, f"assets_dir={b}"]) == 2
    line = one_error(capsys)
    assert "other gsm8k prompts" in line and "original assets_dir" in line
    # the same file in another place resumes (assets_dir may move)
    c = tmp_path / "c"
    shutil.copytree(a, c)
    assert cli.main([*args, f"assets_dir={c}"]) == 0
    assert len(pd.read_csv(out / "records.csv")) == 2


def test_record_level_prompt_check_without_provenance_file(tmp_path, capsys, tiny_checkpoint):
    """A folder without provenance.json (an older run) is still checked record by record."""
    tiny_checkpoint("tiny_qwen")
    out = tmp_path / "run"
    args = [*RUN, f"output_dir={out}"]
    assert cli.main([*args, f"assets_dir={assets(tmp_path / 'a', QUESTIONS)}"]) == 0
    (out / "provenance.json").unlink()
    lines = (out / "records.csv").read_text().splitlines()
    (out / "records.csv").write_text("\n".join(lines[:-1]) + "\n")
    other = assets(tmp_path / "b", ["Something else entirely, asked first?", QUESTIONS[1]])
    assert cli.main([*args, f"assets_dir={other}"]) == 2
    assert "measured on another prompt" in one_error(capsys)


def test_resume_with_other_weights_is_refused(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    out = tmp_path / "run"
    args = [*RUN, f"output_dir={out}", f"assets_dir={assets(tmp_path / 'a', QUESTIONS)}"]
    assert cli.main(args) == 0
    prov = json.loads((out / "provenance.json").read_text())
    (out / "provenance.json").write_text(json.dumps({**prov, "weights_sha256": "0" * 64}))
    lines = (out / "records.csv").read_text().splitlines()
    (out / "records.csv").write_text("\n".join(lines[:-1]) + "\n")
    assert cli.main(args) == 2
    assert "other weights" in one_error(capsys)


@pytest.fixture
def replaced_weights(tmp_path, tiny_checkpoint):
    """(original checkpoint, a copy whose lm_head was retrained: same shapes, other bytes)."""
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("tiny_qwen")
    copy = tmp_path / "retrained"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns(".specter-digest.json"))
    tensors = load_file(copy / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 1.01
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return src, copy


def test_draft_and_link_caches_are_keyed_by_weights(replaced_weights, monkeypatch, tmp_path):
    from specter.assembly import runtime
    from specter.quant import calibration

    src, copy = replaced_weights
    assert checkpoint_digest(src) != checkpoint_digest(copy)
    cfg = compose(["method=specter", "model=tiny_qwen", "hardware=emulated", "num_prompts=1", "allow_hub=false",
                   "assets_dir=/nonexistent", "method.calibration_prompts=1"])
    drafts, links = [], []
    monkeypatch.setattr(calibration, "gptq_draft", lambda rt, batches, path, gs, bits=4: (drafts.append(path), ({}, {}))[1])
    params = SimpleNamespace(per_layer_step_s=1e-3, load_ratio=0.7, expert_load_s=7e-4, bandwidth_bytes_per_s=1e9,
                             latency_s=1e-5, calibration_source="measured")
    monkeypatch.setattr(runtime, "calibrated_link", lambda eb, lr, path, *a, **k: (links.append(path), params)[1])
    for ckpt in (src, copy):
        rt = SimpleNamespace(weights_digest=checkpoint_digest(ckpt), cache=SimpleNamespace(device=torch.device("cpu")))
        runtime.gptq_draft_for(runtime.method_spec(cfg), rt, ckpt)
        runtime.link_params(runtime.method_spec(cfg), ckpt, 1024, checkpoint_digest(ckpt))
    assert len(set(drafts)) == 2 and len(set(links)) == 2
    fewer_bits = compose(["method=specter", "model=tiny_qwen", "hardware=emulated", "num_prompts=1", "allow_hub=false",
                          "assets_dir=/nonexistent", "method.calibration_prompts=1", "model.draft_bits=3"])
    runtime.gptq_draft_for(runtime.method_spec(fewer_bits), rt, copy)  # another precision: another archive
    assert len(set(drafts)) == 3 and "-b3-" in drafts[-1].name


def test_random_tiny_model_is_verified_and_rebuilt(tmp_path, tiny_checkpoint, capsys):
    name = "tiny_phi"
    shutil.copytree(tiny_checkpoint(name), tmp_path / name)
    out = tiny.ensure_tiny(name, root=tmp_path)
    weights = out / "model.safetensors"
    good = weights.read_bytes()
    data = bytearray(good)
    data[-64:] = bytes(64)  # an overwritten tensor of the same size
    weights.write_bytes(bytes(data))
    tiny.ensure_tiny(name, root=tmp_path)
    assert "rebuilding the tiny model tiny_phi" in capsys.readouterr().err
    assert weights.read_bytes() == good  # the same seed gives the same bytes
    weights.write_bytes(good[: len(good) // 3])  # truncated
    tiny.ensure_tiny(name, root=tmp_path)
    assert weights.read_bytes() == good


def test_legacy_marker_is_checked_once_then_completed(tmp_path, tiny_checkpoint):
    name = "tiny_phi"
    shutil.copytree(tiny_checkpoint(name), tmp_path / name)
    marker = tmp_path / name / "specter_tiny.json"
    data = json.loads(marker.read_text())
    files = data.pop("files")
    marker.write_text(json.dumps(data))
    assert tiny.tiny_problem(tmp_path / name, name) is None
    assert json.loads(marker.read_text())["files"] == files
