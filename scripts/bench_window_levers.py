"""Two window levers, measured before building them: what could each buy Specter?

At the dsv2 tiers of the A100 projection Specter's copy stream idles while the draft runs (the draft phase is
memory-bound: a prefetch needs a slot whose resident the window does not use). Two lossless changes would
shorten that phase. This script measures how much room each has on the proxies, without changing the engine.

``post-verify``: keep drafting while the target verifies, and keep those tokens when the whole window is
accepted (the draft's continuation then starts the next window). On the projection's virtual clock (the
engine's own schedule, `experiment=project`'s machine), per window: the draft phase, the verification
phase, K and the accepted tokens. After a fully accepted window, the next window's draft phase could hide
behind this window's verification, up to its length. The sum over a record, taken off its decode, is an
upper bound on the TPOT the lever reaches: it assumes the bonus token always matches the draft's
continuation and that verification leaves the compute stream free. The fastest lossless rival comes from
the reference set's projection (results/reference/project/).

The same run gives Specter's *floor* at its slots (``floor_ms``): the least TPOT any residency and prefetch
policy could reach with these windows (the same draft, K and acceptance). At the end of a window's draft at
most M + the staging buffers of the experts a layer's verification routes to are on the device; the rest load
after it, one H2D each on one copy stream. Above a rival's TPOT it proves that cell lost at Specter's slots.
Specter's TPOT above the floor splits exactly in two: ``excess_copy_ms``, copying after the draft beyond the
floor's loads (a residency or prefetch shortfall), and ``idle_after_draft_ms``, time after the draft with the copy
stream idle (compute no load was left to hide behind, or a copy waiting on a slot). ``draft_copy_idle_share`` is
the share of the draft phase with the copy stream idle: prefetch capacity left unused.

``confidence``: stop drafting where the draft is unsure. On the CPU proxies (the trained proxy, its
calibrated GPTQ draft, greedy), at every drafted position up to the first rejection: the draft's margin
(top-1 minus top-2 probability) and whether the target accepted it. Per margin threshold: the share of
positions a stop rule would flag, the rejections it would catch, and P(rejected | flagged).

    python scripts/bench_window_levers.py post-verify --cells dsv2:high:16,32,48 dsv2:low:48,96 qwen15moe:high:8,24
    python scripts/bench_window_levers.py confidence --models tiny_dsv2 tiny_qwen tiny_phi --num-prompts 6
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RIVALS = ("offload_ar", "mo_sc", "mo_sm", "specmoeoff")  # lossless offloading rivals (MoE-Spec drops experts)
MARGINS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)


# -- post-verify drafting --------------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    """One window on the virtual clock (seconds): when it began, when its draft ended, when verification ended."""

    start: float
    draft_end: float
    end: float
    drafted: int
    accepted: int
    K: int

    @property
    def full(self) -> bool:
        return self.drafted == self.K and self.accepted == self.drafted


def record_windows(forwards, drafted: list[int], accepted: list[int], K: int) -> list[Window]:
    """A record's verification passes from its forwards (``kind``, ``end``; the prefill's target forward first)
    and the engine's per-window drafted / accepted counts, one per target forward after the prefill (its
    route-log window): a target forward with no draft before it is a plain step (drafted 0, no draft phase)."""
    out, start, draft_end = [], None, None
    counts = iter(zip(drafted, accepted))
    for f in forwards:
        if f.kind == "draft":
            draft_end = f.end
            continue
        if start is not None:  # not the prefill
            d, a = next(counts) if draft_end is not None else (0, 0)
            out.append(Window(start, start if draft_end is None else draft_end, f.end, d, a, K))
        start, draft_end = f.end, None
    return out


def pass_floor(window: Window, routes: dict[int, set[int]], M: int, blocks: dict[int, int], staging: int,
               h2d: float) -> float:
    """The least time a verification pass (with its draft phase) can take at M slots per layer, whatever the
    residency and prefetch policy: at the end of the draft at most M + the staging buffers of the experts each
    layer's pass routes to are on the device, the rest load after it, one H2D each on one copy stream. Per
    tiny layer, ``blocks`` real layers; ``staging`` in real experts over all layers."""
    short = sum(blocks[layer] * max(0, len(experts) - M) for layer, experts in routes.items())
    return (window.draft_end - window.start) + h2d * max(0, short - staging)


def above_floor(window: Window, floor: float, copy_after: float) -> tuple[float, float]:
    """A pass's time above its floor (``pass_floor``), split: the copy stream's busy time after the draft beyond the
    floor's loads, and the time after the draft with the copy stream idle. The two sum to pass time - floor."""
    floor_loads = floor - (window.draft_end - window.start)
    return copy_after - floor_loads, (window.end - window.draft_end) - copy_after


def hideable(windows: list[Window]) -> float:
    """Seconds post-verify drafting could hide: after a fully accepted window, the next window's draft
    phase, up to the accepted window's verification."""
    return sum(min(nxt.draft_end - nxt.start, w.end - w.draft_end) for w, nxt in zip(windows, windows[1:]) if w.full)


def fastest_rival(real: str, tier: str, device: str) -> tuple[str, float] | None:
    path = REPO / "results" / "reference" / "project" / f"{real}-{tier}-{device}" / "projection.csv"
    if not path.is_file():
        return None
    rows = [r for r in csv.DictReader(path.open()) if r["source"] == "engine" and r["method"] in RIVALS and r["tpot_ms"]]
    best = min(rows, key=lambda r: float(r["tpot_ms"]), default=None)
    return None if best is None else (best["method"], float(best["tpot_ms"]))


def post_verify_cell(real: str, tier: str, Ks: list[int], device: str) -> list[dict]:
    import torch

    from specter.assembly.compose import compose
    from specter.experiments.project import method_slots, real_and_proxy
    from specter.models.tiny_train import estimated_minutes
    from specter.projection.cost_model import cost_model
    from specter.projection.engine_run import close, decode_routes, open_method
    from specter.projection.steps import Proxy

    cfg = compose(["experiment=project", f"model={real}", f"memory={tier}", f"project.device={device}"])
    real_name, proxy, _ = real_and_proxy(cfg)
    slots, K0 = method_slots(cfg, real_name)
    px, cm, p = Proxy(cfg, proxy, slots, K0, real_name), cost_model(real_name, device), cfg.project
    if not px.trained:  # the projection falls back to the untrained proxy, which accepts and routes unlike the real model
        raise SystemExit(f"{proxy} is not trained here, and the reference projection ran on the trained one: "
                         f"python -m initialization.train_tiny {proxy} (about {estimated_minutes(proxy):.0f} CPU minutes; "
                         f"on another CPU it can train to other weights than the reference's) first")
    prompts = px.prompts(0, int(p.prompts))
    rival = fastest_rival(real_name, tier, cm.d.name)
    rows = []
    for K in Ks:
        session = open_method(px.config("specter", K), px.checkpoint, cm)
        method, machine = session.method, session.machine
        try:
            gen = torch.Generator().manual_seed(int(cfg.seed))
            method.reset()
            method.generate(prompts[0], int(p.warmup_tokens), gen)  # warm-up, as the projection does
            method.warmed()
            decode = hidden = draft = floor = excess = idle = draft_idle = 0.0
            steps = n = full = 0
            M, blocks = slots["specter"][0], machine.block
            staging = method.rt.cache.staging * max(blocks.values())  # a proxy buffer holds a block's experts
            for prompt in prompts:
                method.reset()
                machine.clock.sync()
                f0 = len(machine.forwards)
                out = method.generate(prompt, int(p.new_tokens), gen)
                forwards = machine.forwards[f0:]
                trace = method.engine.trace
                windows = record_windows(forwards, trace.drafted, trace.accepted, K)
                ends = [f.end for f in forwards if f.kind == "target"]
                decode += ends[-1] - ends[0]
                steps += len(out.tokens) - 1
                hidden += hideable(windows)
                routes = decode_routes(method)
                if len(routes) != len(windows):
                    raise RuntimeError(f"{len(windows)} passes on the clock, {len(routes)} in the route log")
                for w, r in zip(windows, routes):
                    f = pass_floor(w, r, M, blocks, staging, cm.h2d())
                    e, i = above_floor(w, f, machine.copy_busy(w.draft_end, w.end))
                    floor, excess, idle = floor + f, excess + e, idle + i
                    draft_idle += (w.draft_end - w.start) - machine.copy_busy(w.start, w.draft_end)
                n += sum(w.drafted > 0 for w in windows)
                full += sum(w.full for w in windows)
                draft += sum(w.draft_end - w.start for w in windows)
            tpot = decode / steps
            rows.append({"model": real_name, "memory": tier, "device": cm.d.name, "K": K, "windows": n,
                         "full_windows": full, "tpot_ms": round(tpot * 1e3, 2),
                         "hideable_share": round(hidden / decode, 4),
                         "tpot_bound_ms": round((decode - hidden) / steps * 1e3, 2),
                         "draft_share": round(draft / decode, 3), "floor_ms": round(floor / steps * 1e3, 2),
                         "excess_copy_ms": round(excess / steps * 1e3, 2),
                         "idle_after_draft_ms": round(idle / steps * 1e3, 2),
                         "draft_copy_idle_share": round(draft_idle / draft, 3) if draft else 0.0,
                         "fastest_rival": rival[0] if rival else "", "rival_tpot_ms": rival[1] if rival else ""})
            print(f"  {real_name} {tier} K={K}: TPOT {tpot * 1e3:.1f} ms, {full}/{n} windows fully accepted, "
                  f"post-verify drafting hides <= {hidden / decode:.1%} -> >= {rows[-1]['tpot_bound_ms']} ms; "
                  f"floor at M={M}: {rows[-1]['floor_ms']} ms (+{rows[-1]['excess_copy_ms']} copying, "
                  f"+{rows[-1]['idle_after_draft_ms']} copy-idle after the draft)"
                  + (f" (fastest rival {rival[0]} {rival[1]} ms)" if rival else ""), flush=True)
        finally:
            close(session)
    return rows


# -- draft confidence ------------------------------------------------------------------------------
class Positions:
    """Drafted positions up to each window's first rejection: (margin, accepted)."""

    def __init__(self):
        self.rows: list[tuple[float, bool]] = []
        self._margins: list[list[float]] = []

    def drafted(self, logits) -> None:
        import torch

        top = torch.softmax(logits.float(), -1).topk(2, -1).values  # [B, 2]
        self._margins.append((top[:, 0] - top[:, 1]).tolist())

    def verified(self, accepted: list[int], limits: list[int]) -> None:
        for b, (a, k) in enumerate(zip(accepted, limits)):
            for i in range(min(a + 1, k)):  # accepted positions, then the rejected one (if any)
                self.rows.append((self._margins[i][b], i < a))
        self._margins = []


def probe(engine, positions: Positions) -> None:
    """Make ``engine`` report every draft step's logits and every window's acceptance to ``positions``
    (a subclass of its own class: the engine decodes exactly as before)."""
    base = type(engine)

    class Probed(base):
        def _draft_sample(self, logits, step, limits):
            positions.drafted(logits)
            return base._draft_sample(self, logits, step, limits)

        def _accept(self, drafts, q, target_logits, limits):
            accepted, tokens = base._accept(self, drafts, q, target_logits, limits)
            positions.verified(accepted, limits)
            return accepted, tokens

    engine.__class__ = Probed


def threshold_rows(model: str, rows: list[tuple[float, bool]]) -> list[dict]:
    rejected = [m for m, ok in rows if not ok]
    out = []
    for t in MARGINS:
        flagged = [ok for m, ok in rows if m < t]
        caught = sum(m < t for m in rejected)
        out.append({"model": model, "margin_below": t, "positions": len(rows), "rejections": len(rejected),
                    "base_reject_rate": round(len(rejected) / len(rows), 4) if rows else "",
                    "flagged_share": round(len(flagged) / len(rows), 4) if rows else "",
                    "rejections_caught": caught,
                    "reject_rate_flagged": round(1 - sum(flagged) / len(flagged), 4) if flagged else ""})
    return out


def confidence_model(model: str, num_prompts: int, new_tokens: int, K: int | None) -> list[dict]:
    import torch

    import specter
    from specter.datasets import load_prompt_set

    positions = Positions()
    settings = {"model.trained": True, **({"K": K} if K else {})}
    with specter.load(model=model, memory="high", method="specter", hardware="emulated", **settings) as llm:
        method, tok = llm.method, llm.tokenizer
        keep = max(8, llm.context_length - new_tokens - 2 * int(llm.cfg.K or llm.cfg.model.K) - 8)
        probe(method.engine, positions)
        gen = torch.Generator().manual_seed(0)
        for ds in ("wikitext2", "humaneval", "gsm8k"):
            for text in load_prompt_set(ds, num_prompts, None, allow_hub=False).texts:
                method.reset()  # one request at a time, each from the reset cache (as a record decodes)
                method.generate(torch.tensor([tok(text)["input_ids"][:keep]]), new_tokens, gen)
    rows = threshold_rows(model, positions.rows)
    r0 = rows[0]
    print(f"  {model}: {r0['positions']} positions, {r0['rejections']} rejections (rate {r0['base_reject_rate']})",
          flush=True)
    for r in rows:
        print(f"    margin < {r['margin_below']}: flags {float(r['flagged_share'] or 0):.1%} of positions, catches "
              f"{r['rejections_caught']}/{r['rejections']} rejections, P(rejected | flagged) {r['reject_rate_flagged']}")
    return rows


def write(rows: list[dict], path: Path) -> None:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path, index=False)
    print(f"wrote {path}")


def parse_cell(text: str) -> tuple[str, str, list[int]]:
    try:
        model, tier, ks = text.split(":")
        Ks = [int(k) for k in ks.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected model:tier:K[,K...], e.g. dsv2:high:16,48") from None
    if tier not in ("high", "low") or any(k < 1 for k in Ks):
        raise argparse.ArgumentTypeError(f"{text!r}: tier is high or low, every K >= 1")
    return model, tier, Ks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="lever", required=True)
    pv = sub.add_parser("post-verify", help="the projection's windows: what drafting during verification could hide; Specter's floor")
    pv.add_argument("--cells", nargs="+", type=parse_cell, required=True, help="model:tier:K[,K...] (a real model)")
    pv.add_argument("--device", default="a100_40gb_pcie4", help="a device file of specter/projection/devices/")
    pv.add_argument("--csv", type=Path, default=REPO / "results" / "window_levers" / "post_verify.csv")
    cf = sub.add_parser("confidence", help="the proxies' drafts: does a low margin predict a rejection?")
    cf.add_argument("--models", nargs="+", default=["tiny_dsv2", "tiny_qwen", "tiny_phi"])
    cf.add_argument("--num-prompts", type=int, default=6, help="per dataset (WikiText-2, HumanEval, GSM8K)")
    cf.add_argument("--max-new-tokens", type=int, default=128)
    cf.add_argument("--K", type=int, default=None, help="draft length (default: the model's)")
    cf.add_argument("--csv", type=Path, default=REPO / "results" / "window_levers" / "confidence.csv")
    args = ap.parse_args(argv)
    if args.lever == "post-verify":
        rows = [r for model, tier, Ks in args.cells for r in post_verify_cell(model, tier, Ks, args.device)]
    else:
        if args.num_prompts < 1 or args.max_new_tokens < 1 or (args.K is not None and args.K < 1):
            ap.error("--num-prompts, --max-new-tokens and --K must be >= 1")
        rows = [r for m in args.models for r in confidence_model(m, args.num_prompts, args.max_new_tokens, args.K)]
    write(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
