"""`specter generate`: streams the text of target_only's greedy tokens, then one stats line; user errors
are one line with exit status 2."""

from __future__ import annotations

import pytest
import torch

from specter.cli import main
from specter.assembly.methods import build_method
from specter.api import compose_checked

COMMON = ["model=tiny_dsv2", "memory=low", "hardware=emulated", "hardware.bandwidth_gbps=20", "hardware.latency_us=5",
          "warmup_tokens=4"]
PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def expected_text():
    from transformers import AutoTokenizer

    cfg = compose_checked([*COMMON, "method=target_only"])
    from specter.assembly.runtime import model_checkpoint

    ck = model_checkpoint(cfg)
    tok = AutoTokenizer.from_pretrained(ck)
    method = build_method(cfg, ck)
    try:
        ids = tok(PROMPT, add_special_tokens=False).input_ids
        tokens = method.generate(torch.tensor([ids]), 24, torch.Generator().manual_seed(0)).tokens
    finally:
        method.close()
    return tok.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("method", [["method=specter", "method.quant=rtn", "K=4"], ["method=target_only"],
                                    ["method=offload_ar"]])
def test_generate_streams_target_only_text_and_stats(method, expected_text, capsys):
    rc = main(["generate", *COMMON, *method, f"prompt={PROMPT}", "max_new_tokens=24", "ignore_eos=true"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.endswith(expected_text + "\n")  # (an emulated link's calibration line may come first)
    stats = out.err.strip().splitlines()[-1]
    name = method[0].split("=")[1]
    assert stats.startswith(f"{name}: 24 tokens (length)")
    for part in ("TPOT", "tokens/window", "acceptance", "H2D", "expert hit rate"):
        assert part in stats
    if name == "specter":  # speculation commits several tokens per window; offloading moves experts
        per_window = float(stats.split(" tokens/window")[0].rsplit("| ", 1)[1])
        assert per_window > 1.0 and "acceptance α -" not in stats and "H2D -" not in stats
    if name == "target_only":
        assert "H2D - KiB/token" in stats


@pytest.mark.parametrize("argv,message", [
    (["generate", *COMMON, "method=target_only"], "needs a prompt"),
    (["generate", *COMMON, "method=nope", "prompt=x"], "method/nope"),
    (["generate", *COMMON, "method=target_only", "prompt=x", "max_new_tokens=0"], "max_new_tokens"),
    (["generate", *COMMON, "method=target_only", "prompt=x", "max_new_tokens=100000"], "context"),
    (["generate", "oops"], "key=value"),
    (["launch"], "unknown command"),
])
def test_user_errors_are_one_line(argv, message, capsys):
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def test_help_lists_both_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "specter generate" in out and "specter serve" in out
