"""`python -m specter.projection.report [out.csv]`: the cost model's per-operation times for the three
real models on each device file, target_only's projected TPOT, and the sensitivity sweep.

No weights, no device: config arithmetic only. The CSV is exact bytes (fixed formatting, fixed order).
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

from specter.projection.cost_model import cost_model, sensitivity

MODELS = ("dsv2", "qwen15moe", "phi35moe")
DEVICES = ("a100_40gb_pcie4", "h200_pcie5")
FIELDS = ("model", "device", "quantity", "factor", "ms")


def rows() -> list[dict[str, str]]:
    out = []

    def add(model, device, quantity, ms, factor=1.0):
        out.append({"model": model, "device": device, "quantity": quantity, "factor": f"{factor:g}", "ms": f"{ms:.4f}"})

    for device in DEVICES:
        for model in MODELS:
            c = cost_model(model, device)
            add(model, device, "attention_norms_layer", c.t(c.attention(1)) * 1e3)
            add(model, device, "router_layer", c.t(c.router(1)) * 1e3)
            add(model, device, "shared_layer", c.t(c.shared(1)) * 1e3)
            add(model, device, "expert_fp16_1tok", c.t(c.expert(1)) * 1e3)
            add(model, device, "draft_experts_int4_fused_layer", c.t(c.draft_experts(c.s.top_k), int4=True) * 1e3)
            add(model, device, "lm_head", c.t(c.lm_head(1)) * 1e3)
            add(model, device, "h2d_one_expert", c.h2d() * 1e3)
            add(model, device, "draft_step_fused", c.draft_step(True) * 1e3)
            add(model, device, "draft_step_eager", c.draft_step(False) * 1e3)
            add(model, device, "target_only_tpot", c.target_step_resident() * 1e3)
            for param, f, v in sensitivity(model, device, lambda m: m.target_step_resident()):
                add(model, device, f"target_only_tpot@{param}", v * 1e3, f)
            for param, f, v in sensitivity(model, device, lambda m: m.h2d()):
                add(model, device, f"h2d_one_expert@{param}", v * 1e3, f)
    return out


def report_csv() -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows())
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = report_csv()
    for r in rows():
        if r["factor"] == "1" and "@" not in r["quantity"]:
            print(f"{r['device']:<16} {r['model']:<10} {r['quantity']:<32} {r['ms']:>10} ms")
    if argv:
        Path(argv[0]).parent.mkdir(parents=True, exist_ok=True)
        Path(argv[0]).write_text(text)
        print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
