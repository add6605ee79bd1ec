"""Briefly train the tiny MoE checkpoints so benchmarks see non-degenerate tokens and routes.

Random weights make greedy decoding repeat one token and hit the same experts every step, which
would flatter every cache. A few CPU minutes of next-token training on the Python standard
library's sources (the tokenizer's corpus) give varied text and routing. The result is written
beside the random checkpoint as `<name>-trained` with `specter_trained.json` (loss curve ends,
greedy repetition statistics).

    python initialization/train_tiny.py                 # all three, 5 minutes each
    python initialization/train_tiny.py tiny_qwen --minutes 1
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch


from specter.models import tiny  # noqa: E402


def token_stream(tokenizer, max_bytes: int = 3_000_000) -> torch.Tensor:
    text = "\n".join(tiny.stdlib_corpus(max_bytes))
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)  # [N]


def repetition_stats(model, tokenizer, prompts: list[str], new_tokens: int = 64) -> dict[str, float]:
    """How degenerate greedy output is: share of tokens equal to one of the previous 4, distinct 2-grams."""
    repeats, total, distinct2, n2 = 0, 0, 0, 0
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids[:16]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)[0, ids.shape[1]:].tolist()
        repeats += sum(out[i] in out[max(0, i - 4):i] for i in range(1, len(out)))
        total += len(out) - 1
        grams = list(zip(out, out[1:]))
        distinct2 += len(set(grams))
        n2 += len(grams)
    return {"repeat_within_4": repeats / total, "distinct_2gram_ratio": distinct2 / n2}


def train(name: str, minutes: float, seq_len: int = 128, batch: int = 8, lr: float = 3e-3) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny.ensure_tiny(name)
    out = tiny.tiny_dir(name, trained=True)
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, experts_implementation="grouped_mm")  # fast fused training path
    model.config.output_router_logits = True  # load-balancing loss keeps experts in use
    model.train()
    data = token_stream(tokenizer)
    g = torch.Generator().manual_seed(tiny.TINY_SPECS[name].seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    prompts = ["def parse_args(argv):", "The module provides", "class Counter(dict):", "import os\nimport sys\n",
               "    for line in lines:", "Return the number of"]
    before = repetition_stats(model.eval(), tokenizer, prompts)
    model.train()
    losses, start, step = [], time.time(), 0
    deadline = start + 60 * minutes
    while time.time() < deadline:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + seq_len] for s in starts])  # [B, S]
        frac = (time.time() - start) / (60 * minutes)
        for group in opt.param_groups:  # cosine decay
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach().item())
        step += 1
        if step % 25 == 0 or step < 4:
            print(f"{name} step {step} loss {sum(losses[-25:]) / len(losses[-25:]):.3f}", flush=True)
    model.config.output_router_logits = False
    model.eval()
    after = repetition_stats(model, tokenizer, prompts)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    report = {
        "name": name, "steps": step, "minutes": minutes, "seq_len": seq_len, "batch": batch,
        "loss_first_25": sum(losses[:25]) / max(1, len(losses[:25])),
        "loss_last_25": sum(losses[-25:]) / max(1, len(losses[-25:])),
        "greedy_before": before, "greedy_after": after,
    }
    (tmp / "specter_trained.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(json.dumps(report, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", default=sorted(tiny.TINY_SPECS), help="tiny models (default: all)")
    ap.add_argument("--minutes", type=float, default=5.0, help="training wall time per model")
    args = ap.parse_args(argv)
    for name in args.names:
        train(name, args.minutes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
