"""Window levers, measured before building them: what could each buy Specter?

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

``lookahead``: how far ahead must residency see to reach the Belady bound? On the projection's verified routes
(``--cells``) or a CPU run folder's route log (``--traces``), the oracle's own rule (`predict/oracle.py`) limited
to a horizon: at each window it knows that window and the next L, and beyond them evicts the least recently
used resident. L = 0 is what a verification pass knows; with the whole trace in view it is the bound. Beside
each ratio, Specter's own loads over the same bound.

``confidence``: stop drafting where the draft is unsure. On the CPU proxies (the trained proxy, its
calibrated GPTQ draft, greedy), at every drafted position up to the first rejection: the draft's margin
(top-1 minus top-2 probability) and whether the target accepted it. Per margin threshold: the share of
positions a stop rule would flag, the rejections it would catch, and P(rejected | flagged).

    python scripts/bench_window_levers.py post-verify --cells dsv2:high:16,32,48 dsv2:low:48,96 qwen15moe:high:8,24
    python scripts/bench_window_levers.py lookahead --cells qwen15moe:high:8,16 --traces results/reference/trace/*
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


@dataclass
class Cell:
    """A projected cell as `experiment=project` builds it: its config, the trained proxy, the device's cost model,
    the held-out prompts and each method's (M, K)."""

    cfg: object
    real: str
    px: object
    cm: object
    prompts: list
    slots: dict


def projected_cell(real: str, tier: str, device: str) -> Cell:
    from specter.assembly.compose import compose
    from specter.experiments.project import method_slots, real_and_proxy
    from specter.models.tiny_train import estimated_minutes
    from specter.projection.cost_model import cost_model
    from specter.projection.steps import Proxy

    cfg = compose(["experiment=project", f"model={real}", f"memory={tier}", f"project.device={device}"])
    real_name, proxy, _ = real_and_proxy(cfg)
    slots, K0 = method_slots(cfg, real_name)
    px = Proxy(cfg, proxy, slots, K0, real_name)
    if not px.trained:  # the projection falls back to the untrained proxy, which accepts and routes unlike the real model
        raise SystemExit(f"{proxy} is not trained here, and the reference projection ran on the trained one: "
                         f"python -m initialization.train_tiny {proxy} (about {estimated_minutes(proxy):.0f} CPU minutes; "
                         f"on another CPU it can train to other weights than the reference's) first")
    return Cell(cfg, real_name, px, cost_model(real_name, device), px.prompts(0, int(cfg.project.prompts)), slots)


@dataclass
class Decoded:
    """One held-out record Specter decoded on a cell's virtual machine."""

    out: object  # the method's generate() result
    forwards: list  # the record's forwards on the virtual clock, the prefill's target forward first
    start: dict[int, set[int]]  # per MoE layer, the residents when the prefill's forward ended


def decoded_records(cell: Cell, K: int):
    """Specter at draft length K on the cell's machine, as the projection measures it (`engine_run.measure`): one
    warm-up record, then each held-out prompt from a reset cache. Yields (session, Decoded) per prompt."""
    import torch

    from specter.projection.engine_run import close, open_method

    session = open_method(cell.px.config("specter", K), cell.px.checkpoint, cell.cm)
    method, machine, p = session.method, session.machine, cell.cfg.project
    try:
        gen = torch.Generator().manual_seed(int(cell.cfg.seed))
        method.reset()
        method.generate(cell.prompts[0], int(p.warmup_tokens), gen)  # warm-up: the planner's estimates learn the clock
        method.warmed()
        for prompt in cell.prompts:
            method.reset()
            machine.clock.sync()  # records do not overlap: the previous one's copies have landed
            start: dict[int, set[int]] = {}
            machine.on_target_head = lambda start=start, cache=method.rt.cache: start.update(
                {layer: cache.resident(layer) for layer in cache.layers})
            f0 = len(machine.forwards)
            out = method.generate(prompt, int(p.new_tokens), gen)
            machine.on_target_head = None
            yield session, Decoded(out, machine.forwards[f0:], start)
    finally:
        close(session)


def post_verify_cell(real: str, tier: str, Ks: list[int], device: str) -> list[dict]:
    from specter.projection.engine_run import decode_routes

    cell = projected_cell(real, tier, device)
    cm, M = cell.cm, cell.slots["specter"][0]
    rival = fastest_rival(cell.real, tier, cm.d.name)
    rows = []
    for K in Ks:
        decode = hidden = draft = floor = excess = idle = draft_idle = 0.0
        steps = n = full = 0
        for session, rec in decoded_records(cell, K):
            method, machine = session.method, session.machine
            blocks = machine.block
            staging = method.rt.cache.staging * max(blocks.values())  # a proxy buffer holds a block's experts
            trace = method.engine.trace
            windows = record_windows(rec.forwards, trace.drafted, trace.accepted, K)
            ends = [f.end for f in rec.forwards if f.kind == "target"]
            decode += ends[-1] - ends[0]
            steps += len(rec.out.tokens) - 1
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
        rows.append({"model": cell.real, "memory": tier, "device": cm.d.name, "K": K, "windows": n,
                     "full_windows": full, "tpot_ms": round(tpot * 1e3, 2),
                     "hideable_share": round(hidden / decode, 4),
                     "tpot_bound_ms": round((decode - hidden) / steps * 1e3, 2),
                     "draft_share": round(draft / decode, 3), "floor_ms": round(floor / steps * 1e3, 2),
                     "excess_copy_ms": round(excess / steps * 1e3, 2),
                     "idle_after_draft_ms": round(idle / steps * 1e3, 2),
                     "draft_copy_idle_share": round(draft_idle / draft, 3) if draft else 0.0,
                     "fastest_rival": rival[0] if rival else "", "rival_tpot_ms": rival[1] if rival else ""})
        print(f"  {cell.real} {tier} K={K}: TPOT {tpot * 1e3:.1f} ms, {full}/{n} windows fully accepted, "
              f"post-verify drafting hides <= {hidden / decode:.1%} -> >= {rows[-1]['tpot_bound_ms']} ms; "
              f"floor at M={M}: {rows[-1]['floor_ms']} ms (+{rows[-1]['excess_copy_ms']} copying, "
              f"+{rows[-1]['idle_after_draft_ms']} copy-idle after the draft)"
              + (f" (fastest rival {rival[0]} {rival[1]} ms)" if rival else ""), flush=True)
    return rows


# -- residency lookahead ---------------------------------------------------------------------------
def horizon_loads(windows: list[set[int]], capacity: int, initial: frozenset[int] | set[int] = frozenset(),
                  L: int | None = None) -> int:
    """Loads of one layer under the Belady rule limited to a horizon: at window t the policy knows the routes of
    windows t .. t + L (None: the whole trace) and nothing after. Inside that horizon it is the oracle's own
    construction (`specter.predict.oracle.min_loads`: each window serves its hits first, then its misses
    furthest-next-request first; a load evicts the resident whose next request is furthest); residents with no
    request in the horizon go least recently used first. With the whole trace in view it is the Belady bound."""
    cache = {e: -1 for e in initial}  # resident -> the last window that used it
    loads = 0
    for t, need in enumerate(windows):
        seen = windows[t:] if L is None else windows[t:t + L + 1]
        # Backward over the horizon: a request's rank counts from its end (larger = sooner); `after` is each
        # expert's next request after window t, `order` window t's serving order.
        nxt: dict[int, int] = {}
        after: dict[int, int] = {}
        order: list[int] = []
        rank = 0
        for s in range(len(seen) - 1, -1, -1):
            after = dict(nxt)
            order = sorted(seen[s], key=lambda e: (nxt.get(e, -1), e))
            for e in reversed(order):
                rank += 1
                nxt[e] = rank
        for e in need:
            if e in cache:
                cache[e] = t
        for e in [e for e in order if e not in cache]:  # hits were served first
            loads += 1
            if len(cache) >= capacity:
                del cache[min(cache, key=lambda r: (after.get(r, -1), cache[r], r))]
            cache[e] = t
    return loads


def record_horizons(routes: list[dict[int, set[int]]], capacity: dict[int, int], start: dict[int, set[int]],
                    blocks: dict[int, int], horizons: list[int | None]) -> dict[int | None, int]:
    """Real expert loads of a decode's verified routes under each horizon (`horizon_loads`), per tiny layer from the
    residents the prefill left, each tiny layer standing for its block's real layers (as `decode_bound` counts)."""
    out = {}
    for L in horizons:
        out[L] = 0
        for layer, m in capacity.items():
            first = frozenset(start.get(layer, ()))
            out[L] += blocks[layer] * horizon_loads([w.get(layer, set()) for w in routes], max(m, len(first)), first, L)
    return out


def lookahead_cell(real: str, tier: str, Ks: list[int], device: str, horizons: list[int]) -> list[dict]:
    from specter.projection.engine_run import decode_routes

    cell = projected_cell(real, tier, device)
    levels: list[int | None] = [*horizons, None]
    rows = []
    for K in Ks:
        loads = steps = windows = 0
        totals = dict.fromkeys(levels, 0)
        for session, rec in decoded_records(cell, K):
            method, machine = session.method, session.machine
            capacity = {layer: method.rt.cache.capacity(layer) for layer in method.rt.om.moe_layers}
            first = next(f.end for f in rec.forwards if f.kind == "target")  # the decode starts at the prefill's end
            loads += machine.real_loads(since=first)
            steps += len(rec.out.tokens) - 1
            routes = decode_routes(method)
            windows += len(routes)
            for L, n in record_horizons(routes, capacity, rec.start, machine.block, levels).items():
                totals[L] += n
        bound = totals[None]
        row = {"model": cell.real, "memory": tier, "device": cell.cm.d.name, "K": K, "M": cell.slots["specter"][0],
               "windows": windows, "tokens": steps, "loads_per_token": round(loads / steps, 2),
               "belady_loads_per_token": round(bound / steps, 2), "specter_over_belady": round(loads / bound, 3)}
        row.update({f"horizon{L}_over_belady": round(totals[L] / bound, 3) for L in horizons})
        rows.append(row)
        print(f"  {cell.real} {tier} K={K} M={row['M']}: Specter {row['loads_per_token']} loads/token, "
              f"{row['specter_over_belady']}x Belady; knowing "
              + ", ".join(f"{L} more window(s) {row[f'horizon{L}_over_belady']}x" for L in horizons),
              flush=True)
    return rows


def traced_routes(folder: Path) -> dict[tuple[str, str, str], dict[int, list[set[int]]]]:
    """A run folder's route log (routes.csv.gz or routes.csv: dataset, prompt_index, repeat, window, layer, expert),
    per record: layer -> one expert set per route-log window (window 0 is the prefill)."""
    import pandas as pd

    path = next((folder / n for n in ("routes.csv.gz", "routes.csv") if (folder / n).is_file()), None)
    if path is None:
        raise SystemExit(f"{folder}: no routes.csv.gz or routes.csv (a run with method.trace_windows=true writes one)")
    df = pd.read_csv(path)
    missing = {"dataset", "prompt_index", "repeat", "window", "layer", "expert"} - set(df.columns)
    if missing:
        raise SystemExit(f"{path}: missing columns {sorted(missing)}")
    out = {}
    for key, rec in df.groupby(["dataset", "prompt_index", "repeat"], sort=True):
        T = int(rec["window"].max()) + 1
        sets = {(int(w), int(l)): set(g["expert"].astype(int)) for (w, l), g in rec.groupby(["window", "layer"])}
        out[tuple(map(str, key))] = {int(l): [sets.get((t, int(l)), set()) for t in range(T)]
                                     for l in sorted(rec["layer"].unique())}
    return out


def lookahead_traced(folder: Path, horizons: list[int]) -> list[dict]:
    """The same lookahead on a CPU run folder's route log, at the slots its records ran with. The log does not keep
    the residents the run started from, so every policy here starts from an empty cache; each record's own
    ``loads_over_belady`` (from its true start) stands beside the ratios for comparison."""
    import pandas as pd

    routes = traced_routes(folder)
    if not (folder / "records.csv").is_file():
        raise SystemExit(f"{folder}: no records.csv beside its route log")
    records = pd.read_csv(folder / "records.csv")
    rows = []
    for key, layers in routes.items():
        rec = records[(records["dataset"].astype(str) == key[0]) & (records["prompt_index"].astype(str) == key[1])
                      & (records["repeat"].astype(str) == key[2])]
        if rec.empty or pd.isna(rec["resident_experts"].iloc[0]):
            continue
        r = rec.iloc[0]
        M = int(r["resident_experts"])
        bound = sum(horizon_loads(ws, M) for ws in layers.values())
        row = {"model": r["model"], "memory": r["memory"], "device": "cpu", "K": int(r["K"]), "M": M,
               "dataset": key[0], "prompt_index": key[1], "windows": len(next(iter(layers.values()))),
               "tokens": int(r["new_tokens"]), "specter_over_belady": round(float(r["loads_over_belady"]), 3)}
        for L in horizons:
            row[f"horizon{L}_over_belady"] = round(sum(horizon_loads(ws, M, L=L) for ws in layers.values()) / bound, 3)
        rows.append(row)
        print(f"  {folder.name} {key[0]}#{key[1]} K={row['K']} M={M}: Specter {row['specter_over_belady']}x Belady; "
              "knowing " + ", ".join(f"{L} more {row[f'horizon{L}_over_belady']}x" for L in horizons), flush=True)
    if not rows:
        raise SystemExit(f"{folder}: no record of records.csv matches a record of its route log with resident_experts")
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
    la = sub.add_parser("lookahead", help="how far ahead must residency see to reach the Belady bound?")
    la.add_argument("--cells", nargs="+", type=parse_cell, default=[],
                    help="model:tier:K[,K...] (a real model): Specter on the projection's windows")
    la.add_argument("--traces", nargs="+", type=Path, default=[],
                    help="CPU run folders with a route log (e.g. results/reference/trace/*)")
    la.add_argument("--horizons", nargs="+", type=int, default=[0, 1, 2, 4],
                    help="windows known beyond the current one (0: the current window only, as Specter's passes)")
    la.add_argument("--device", default="a100_40gb_pcie4", help="a device file of specter/projection/devices/")
    la.add_argument("--csv", type=Path, default=REPO / "results" / "window_levers" / "lookahead.csv")
    cf = sub.add_parser("confidence", help="the proxies' drafts: does a low margin predict a rejection?")
    cf.add_argument("--models", nargs="+", default=["tiny_dsv2", "tiny_qwen", "tiny_phi"])
    cf.add_argument("--num-prompts", type=int, default=6, help="per dataset (WikiText-2, HumanEval, GSM8K)")
    cf.add_argument("--max-new-tokens", type=int, default=128)
    cf.add_argument("--K", type=int, default=None, help="draft length (default: the model's)")
    cf.add_argument("--csv", type=Path, default=REPO / "results" / "window_levers" / "confidence.csv")
    args = ap.parse_args(argv)
    if args.lever == "post-verify":
        rows = [r for model, tier, Ks in args.cells for r in post_verify_cell(model, tier, Ks, args.device)]
    elif args.lever == "lookahead":
        if not args.cells and not args.traces:
            ap.error("lookahead: give --cells, --traces or both")
        if any(L < 0 for L in args.horizons):
            ap.error("--horizons are >= 0")
        rows = [r for model, tier, Ks in args.cells for r in lookahead_cell(model, tier, Ks, args.device, args.horizons)]
        rows += [r for folder in args.traces for r in lookahead_traced(folder, args.horizons)]
    else:
        if args.num_prompts < 1 or args.max_new_tokens < 1 or (args.K is not None and args.K < 1):
            ap.error("--num-prompts, --max-new-tokens and --K must be >= 1")
        rows = [r for m in args.models for r in confidence_model(m, args.num_prompts, args.max_new_tokens, args.K)]
    write(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
