"""A checkpoint's facts come from its own config; the run config may not contradict them.

A user's checkpoint of a supported architecture (other expert count, top-k, depth) run under a
real model's name (`model=dsv2 model.local_dir=...`): the facts recorded are the checkpoint's, a
contradicting override is one clear line, MO-SM's presets apply only to the checkpoint they were
measured on. Also: the missing-weights message (one readable line, absolute path) and a refused
start leaving nothing that looks like a run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, REPO, compose

from specter.experiments import cli as cli_mod
from specter.assembly.config import ConfigError, bind_checkpoint
from specter.models.facts import CheckpointFacts, facts_from_config, matching_preset, read_facts

ASSETS = FIXTURES / "datasets"
BASE = ["num_prompts=1", "max_new_tokens=2", "warmup_tokens=0", "progress=false", f"assets_dir={ASSETS}",
        "hardware=cpu"]
LITE = dict(model_type="deepseek_v2", num_experts=64, top_k=6, num_layers=27, hidden_size=2048)


def save_checkpoint(folder: Path, model_type: str, **kwargs) -> Path:
    """A small random checkpoint with the tiny model's tokenizer (what a user's fine-tune looks like)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **kwargs)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def user_dsv2(tmp_path_factory, tiny_checkpoint):
    """DeepSeek-V2 with 16 experts, top-3, 3 layers, q_lora_rank null, the tiny tokenizer."""
    import shutil

    folder = tmp_path_factory.mktemp("user") / "dsv2-16x3"
    tok = tiny_checkpoint("tiny_dsv2")
    from specter.models.tiny import TINY_SPECS

    kw = dict(TINY_SPECS["tiny_dsv2"].config_kwargs, num_hidden_layers=3, n_routed_experts=16, num_experts_per_tok=3,
              q_lora_rank=None, norm_topk_prob=True)
    save_checkpoint(folder, "deepseek_v2", **kw)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok / name).exists():
            shutil.copy(tok / name, folder / name)
    return folder


def test_facts_are_read_from_the_checkpoint_config(user_dsv2):
    f = read_facts(user_dsv2)
    assert (f.model_type, f.num_experts, f.top_k, f.num_layers) == ("deepseek_v2", 16, 3, 3)
    assert f.q_lora_rank is None and f.norm_topk_prob is True and f.rope_type == "default"


@pytest.mark.parametrize("model_type,kwargs,expect", [
    ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, num_hidden_layers=2),
     dict(num_experts=6, top_k=3, norm_topk_prob=True, q_lora_rank=None, num_layers=2)),
    ("phimoe", dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=3),
     dict(num_experts=4, top_k=2, norm_topk_prob=None, num_layers=3)),
    ("deepseek_v2", dict(n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=24, num_hidden_layers=2,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                          "original_max_position_embeddings": 512}, max_position_embeddings=2048),
     dict(num_experts=8, top_k=2, q_lora_rank=24, rope_type="yarn", rope_factor=4.0)),
])
def test_facts_of_each_architecture(model_type, kwargs, expect):
    from transformers import AutoConfig

    f = facts_from_config(AutoConfig.for_model(model_type, **kwargs))
    assert {k: getattr(f, k) for k in expect} == expect


def test_null_facts_are_filled_from_the_checkpoint(user_dsv2):
    cfg = compose(["model=dsv2", f"model.local_dir={user_dsv2}"])
    assert cfg.model.num_experts is None and cfg.model.top_k is None
    bind_checkpoint(cfg, user_dsv2)
    assert (cfg.model.num_experts, cfg.model.top_k) == (16, 3)


def test_a_matching_override_is_accepted(user_dsv2):
    cfg = compose(["model=dsv2", "model.num_experts=16", "model.top_k=3"])
    bind_checkpoint(cfg, user_dsv2)


def test_a_contradicting_override_is_one_clear_message(user_dsv2):
    cfg = compose(["model=dsv2", "model.num_experts=64", "model.top_k=6"])
    with pytest.raises(ConfigError) as err:
        bind_checkpoint(cfg, user_dsv2)
    msg = str(err.value)
    assert "\n" not in msg and "; " not in msg
    assert "model.num_experts=64 (the checkpoint has 16)" in msg and "model.top_k=6 (the checkpoint has 3)" in msg
    assert str(user_dsv2.resolve() / "config.json") in msg


def test_tiny_model_facts_must_match_too(tiny_checkpoint):
    cfg = compose(["model=tiny_qwen", "model.num_experts=32"])
    with pytest.raises(ConfigError, match="model.num_experts=32 .the checkpoint has 60."):
        bind_checkpoint(cfg, tiny_checkpoint("tiny_qwen"))


def test_run_refuses_a_contradicting_override_before_any_folder(user_dsv2, tmp_path, capsys):
    out = tmp_path / "o"
    rc = cli_mod.main([*BASE, "model=dsv2", f"model.local_dir={user_dsv2}", "model.num_experts=64",
                       "method=offload_ar", "memory=low", f"output_dir={out}"])
    _, err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("specter: error:")]
    assert len(lines) == 1 and "model.num_experts=64 (the checkpoint has 16)" in lines[0]
    assert not out.exists()


def test_user_checkpoint_under_a_real_model_name_records_its_own_facts(user_dsv2, tmp_path, capsys):
    import yaml

    out = tmp_path / "o"
    rc = cli_mod.main([*BASE, "model=dsv2", f"model.local_dir={user_dsv2}", "method=offload_ar", "memory=low",
                       "memory.budget_mb=null", f"output_dir={out}"])
    _, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["model"]["num_experts"], saved["model"]["top_k"]) == (16, 3)


# ------------------------------------------------------------------------------------- MO-SM presets
def _facts(**changes) -> CheckpointFacts:
    base = dict(LITE, vocab_size=102400, max_position_embeddings=163840, norm_topk_prob=False, q_lora_rank=None,
                rope_type="yarn", rope_factor=40.0)
    return CheckpointFacts(**{**base, **changes})


def test_presets_match_by_checkpoint_facts_not_by_name():
    presets = compose(["method=mo_sm", "model=dsv2"]).method.presets
    assert matching_preset(presets, _facts())[0] == 0  # DeepSeek-V2-Lite itself
    assert matching_preset(presets, _facts(num_experts=16, top_k=3)) is None  # a user's dsv2-shaped checkpoint
    assert matching_preset(presets, _facts(model_type="qwen2_moe", num_experts=60, top_k=4, num_layers=24))[0] == 1
    assert matching_preset([], _facts()) is None and matching_preset(None, _facts()) is None
    assert matching_preset([{"checkpoint": {}, "slots": {"low": 3}}], _facts()) is None  # no facts: no match


@pytest.mark.parametrize("clear", ["method.presets=[]", "method.presets=null"])
def test_presets_can_be_cleared(clear):
    assert not compose(["method=mo_sm", clear]).method.presets


def _mo_sm(tiny_checkpoint, *overrides):
    from specter.assembly.methods import build_method

    ckpt = tiny_checkpoint("tiny_dsv2")
    cfg = compose(["method=mo_sm", "model=tiny_dsv2", "memory=low", "hardware=cpu", *overrides])
    bind_checkpoint(cfg, ckpt)
    return build_method(cfg, ckpt)


def test_mo_sm_takes_a_preset_only_for_its_checkpoint(tiny_checkpoint):
    preset = "method.presets=[{checkpoint:{model_type:deepseek_v2,num_experts:64,top_k:6,num_layers:4},slots:{low:7}}]"
    method = _mo_sm(tiny_checkpoint, preset)
    try:
        used = method.environment()["same_memory_derivation"]["used"]
        assert used["resident"] == 7 and used["from"] == "method.presets[0]"
    finally:
        method.close()
    other = preset.replace("num_layers:4", "num_layers:27")  # measured on another checkpoint: derive
    method = _mo_sm(tiny_checkpoint, other)
    try:
        d = method.environment()["same_memory_derivation"]
        assert d["used"]["from"] == "derived" and d["used"]["resident"] == d["resident"]
    finally:
        method.close()


# ----------------------------------------------------------------------------- error text, refused starts
def test_missing_weights_message_is_one_readable_line_with_an_absolute_path(tmp_path, monkeypatch):
    from specter.assembly.errors import one_line
    from specter.models.registry import ModelUnavailable, resolve_checkpoint

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelUnavailable) as err:
        resolve_checkpoint("dsv2", "hub", local_dir="models/DeepSeek-V2-Lite", hf_id="deepseek-ai/nowhere-xyz")
    msg = one_line(str(err.value))
    assert str(tmp_path / "models" / "DeepSeek-V2-Lite") in msg
    assert "; " not in msg and "a tiny model of the same architecture" in msg
    assert "python -m initialization.download_models dsv2" in msg


def test_a_refused_start_leaves_nothing_that_looks_like_a_run(tmp_path, capsys):
    out = tmp_path / "o"
    rc = cli_mod.main([*BASE, "method=offload_ar", "model=tiny_qwen", "memory.budget_mb=0.5", f"output_dir={out}"])
    _, err = capsys.readouterr()
    assert rc == 2 and "budget" in err
    assert not out.exists()  # no config.yaml, provenance.json or header-only records.csv
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc = cli_mod.main([*BASE, "method=offload_ar", "model=tiny_qwen", "memory.budget_mb=0.5", f"output_dir={out}"])
    capsys.readouterr()
    assert rc == 2 and sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # someone else's folder: untouched


def test_an_empty_existing_folder_is_left_empty(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    rc = cli_mod.main([*BASE, "method=offload_ar", "model=tiny_qwen", "memory.budget_mb=0.5", f"output_dir={out}"])
    capsys.readouterr()
    assert rc == 2 and out.is_dir() and list(out.iterdir()) == []


# ------------------------------------------------------------------------------------------ quiet output
def _python(code: str, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "SPECTER_VERBOSE": "0", **env})


QUIET = ("import os, sys\nfrom specter.quiet import quiet_import\nwith quiet_import():\n"
         "    os.write(1, b'BANNER\\n'); os.write(2, b'WARN env\\n'); print('py banner')\nprint('ours')\n")


def test_quiet_import_hides_what_a_library_prints():
    res = _python(QUIET)
    assert res.returncode == 0 and res.stdout == "ours\n" and res.stderr == "", (res.stdout, res.stderr)


def test_verbose_shows_it():
    res = _python(QUIET, SPECTER_VERBOSE="1")
    assert "BANNER" in res.stdout and "py banner" in res.stdout and "WARN env" in res.stderr


def test_a_failing_import_shows_what_the_library_said():
    res = _python("import os\nfrom specter.quiet import quiet_import\nwith quiet_import():\n"
                  "    os.write(2, b'missing libfoo.so\\n'); raise ImportError('no foo')\n")
    assert res.returncode != 0 and "missing libfoo.so" in res.stderr and "no foo" in res.stderr


@pytest.mark.slow  # imports gptqmodel (and torchao) in a fresh process: ~20 s, minutes on a loaded machine
def test_gptqmodel_prints_no_banner_in_our_output():
    pytest.importorskip("gptqmodel")
    res = _python("import torch\nfrom specter.quant.gptq import gptqmodel_linear\n"
                  "w = torch.randn(16, 32); x = torch.randn(64, 32)\n"
                  "codes, scales = gptqmodel_linear(w, x, 32, 0.01, False)\nprint('done', tuple(codes.shape))\n",
                  timeout=1200, GPTQMODEL_CPU_WORKERS="1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "done (16, 32)", res.stdout[-2000:]
    assert "GPT-QModel" not in res.stderr and "WARN" not in res.stderr and "INFO" not in res.stderr, res.stderr[-2000:]
