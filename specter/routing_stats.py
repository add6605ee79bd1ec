"""How a MoE checkpoint routes real text: how evenly (dead experts, usage entropy) and how locally
(the distinct experts a verification window and B concurrent windows touch), beside what
independent top-k routing would give, and what an on-demand LRU cache would hit at each memory tier.

    python -m specter.routing_stats tiny_dsv2                    # the trained tiny model, held-out text
    python -m specter.routing_stats /models/DeepSeek-V2-Lite --text my_corpus.txt --tokens 8192
    python -m specter.routing_stats tiny_qwen --untrained --out results/routing/tiny_qwen-random

Every number comes from the model's own routes (a forward hook on each MoE layer's router, the
text teacher-forced); the independent-routing expectation E·(1 − (1 − k/E)^n) is printed beside
them only as the yardstick. Writes `layers.csv` (per layer), `working_set.csv` (per B),
`routing.json` and `routing.png` into `--out`.

The gates (`RoutingGates`) are what a trained tiny model must meet to stand in for its real model
(the real ones are trained with load-balancing losses and have no dead expert): every expert in
use, usage entropy >= 0.9, one window touching >= 0.75 of the independent expectation, and, where
the paper measured it, the B = 1 -> 2 growth of the working set within 10 % of the paper's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specter.metrics import independent_working_set

HELD_OUT = ("humaneval", "gsm8k")  # never in the training corpus (the Python standard library)
BATCHES = (1, 2, 4, 8, 16, 32)
SAMPLES = 256  # random draws of B windows per B
# Paper, Fig. 16 text: the verification working set grows this much from B = 1 to B = 2
PAPER_GROWTH = {"deepseek_v2": 1.31, "qwen2_moe": 1.52}


# ---- statistics of recorded routes (pure functions of the routes) --------------------------------

def usage_share(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each expert's share of all (token, slot) routes of one layer. routes [N, k] -> [E]."""
    counts = torch.bincount(routes.flatten(), minlength=num_experts).double()  # [E]
    return counts / counts.sum()


def normalized_entropy(share: torch.Tensor) -> float:
    """Usage entropy over ln E: 1.0 when every expert carries the same share."""
    p = share[share > 0]
    return float(-(p * p.log()).sum() / math.log(len(share)))


def windows(doc_routes: list[torch.Tensor], n: int) -> list[set[int]]:
    """Distinct experts of each run of n consecutive tokens within one document ([N_d, k] each)."""
    out = []
    for routes in doc_routes:
        for start in range(0, routes.shape[0] - n + 1, n):
            out.append(set(routes[start:start + n].flatten().tolist()))
    return out


def working_set(window_sets: list[set[int]], batch: int, samples: int = SAMPLES, seed: int = 0) -> float:
    """Mean distinct experts of `batch` windows drawn at random from distinct positions of the text:
    the working set of one verification pass over `batch` concurrent requests."""
    if len(window_sets) < batch:
        return float("nan")
    rng = random.Random(seed)
    total = 0
    for _ in range(samples):
        total += len(set().union(*rng.sample(window_sets, batch)))
    return total / samples


def lru_hit_rate(routes: torch.Tensor, slots: int) -> float:
    """Share of demanded experts already resident in an on-demand cache of `slots` experts run by the
    engine's own eviction policy (`LRUPolicy`), token by token, hits touched before misses are
    placed (offload_ar's order). routes [N, k]."""
    from specter.offload.cache import LRUPolicy

    policy = LRUPolicy(slots)
    hits = demands = 0
    for row in routes.tolist():
        experts = list(dict.fromkeys(row))  # one demand per distinct expert of the token
        resident = [e for e in experts if policy.lookup(e) is not None]
        for e in resident:
            policy.touch(e)
        for e in experts:
            if policy.lookup(e) is None:
                policy.admit(e)
        hits += len(resident)
        demands += len(experts)
    return hits / max(demands, 1)


@dataclass
class LayerStats:
    layer: int
    dead_experts: int
    usage_entropy: float
    top8_share: float
    window_experts: float  # B = 1
    window_vs_independent: float
    growth_1_to_2: float
    lru_hit: dict[str, float]


def layer_stats(layer: int, doc_routes: list[torch.Tensor], num_experts: int, top_k: int, window: int,
                tiers: dict[str, int]) -> tuple[LayerStats, dict[int, float]]:
    """One MoE layer's statistics and its working set per B."""
    routes = torch.cat(doc_routes)  # [N, k]
    share = usage_share(routes, num_experts)
    sets = windows(doc_routes, window)
    per_b = {b: working_set(sets, b) for b in BATCHES}
    stats = LayerStats(
        layer=layer,
        dead_experts=int((share < 1.0 / (10 * num_experts)).sum()),
        usage_entropy=normalized_entropy(share),
        top8_share=float(share.sort(descending=True).values[:8].sum()),
        window_experts=per_b[1],
        window_vs_independent=per_b[1] / independent_working_set(num_experts, top_k, window),
        growth_1_to_2=per_b[2] / per_b[1],
        lru_hit={tier: lru_hit_rate(routes, m) for tier, m in tiers.items()},
    )
    return stats, per_b


@dataclass(frozen=True)
class RoutingGates:
    """What a tiny model's routing must reach on held-out text to stand in for its real model."""

    max_dead_experts: int = 0
    min_usage_entropy: float = 0.9
    min_window_vs_independent: float = 0.75
    growth_tolerance: float = 0.10  # relative, around the paper's B = 1 -> 2 growth

    def check(self, stats: list[LayerStats], model_type: str) -> dict[str, bool]:
        passed = {
            "no_dead_expert": all(s.dead_experts <= self.max_dead_experts for s in stats),
            "usage_entropy": all(s.usage_entropy >= self.min_usage_entropy for s in stats),
            "window_vs_independent": all(s.window_vs_independent >= self.min_window_vs_independent for s in stats),
        }
        paper = PAPER_GROWTH.get(model_type)
        if paper is not None:
            growth = sum(s.growth_1_to_2 for s in stats) / len(stats)
            passed["growth_1_to_2"] = abs(growth / paper - 1) <= self.growth_tolerance
        return passed


ROUTING_GATES = RoutingGates()


# ---- recording routes from a model ----------------------------------------------------------------

@torch.no_grad()
def record_routes(model: torch.nn.Module, docs: list[torch.Tensor], max_len: int = 512) -> dict[int, list[torch.Tensor]]:
    """Teacher-force each document ([N_d] token ids) and return, per MoE layer, its routes per
    document ([N_d, k] expert ids) as the model's own routers chose them."""
    from specter.models.balance import routers_of

    blocks = routers_of(model)
    seen: dict[int, torch.Tensor] = {}
    hooks = [block.register_forward_hook(
        # every router here returns (logits [T, E], top-k weights [T, k], top-k ids [T, k])
        lambda mod, args, out, layer=layer: seen.__setitem__(layer, out[2].detach().reshape(-1, out[2].shape[-1])))
        for layer, block in blocks.items()]
    routes: dict[int, list[torch.Tensor]] = {layer: [] for layer in blocks}
    try:
        for ids in docs:
            for start in range(0, len(ids), max_len):
                model(input_ids=ids[None, start:start + max_len])
                for layer in blocks:
                    routes[layer].append(seen[layer].cpu())
    finally:
        for hook in hooks:
            hook.remove()
    return routes


def held_out_docs(tokenizer, sources: tuple[str, ...] = HELD_OUT, tokens: int = 4096) -> tuple[list[torch.Tensor], str]:
    """Token ids of held-out documents, `tokens` in all, the sources interleaved: dataset names (the
    prepared, packaged or bundled prompts, never the hub) or text files (paragraphs at blank lines)."""
    per_source = [_texts(source, tokenizer, tokens // len(sources) + 1) for source in sources]
    docs, total = [], 0
    for i in range(max(map(len, per_source))):
        for texts in per_source:
            if i < len(texts) and total < tokens:
                ids = torch.tensor(tokenizer(texts[i], add_special_tokens=False).input_ids[: tokens - total])
                if len(ids) > 1:
                    docs.append(ids)
                    total += len(ids)
    if total < tokens:
        raise ValueError(f"{', '.join(sources)} hold only {total} tokens; {tokens} were asked for")
    return docs, f"{'+'.join(Path(s).name for s in sources)}, {total} tokens, {len(docs)} documents"


def _texts(source: str, tokenizer, tokens: int) -> list[str]:
    """Enough texts of one source for `tokens` tokens (all of them if it holds fewer)."""
    from specter.datasets import TooFewPrompts, load_prompts

    path = Path(source)
    if path.is_file():
        return [t for t in path.read_text(errors="replace").split("\n\n") if t.strip()]
    texts, n = [], 16
    while True:
        try:
            texts = load_prompts(source, n, None, allow_hub=False)
        except TooFewPrompts:
            return texts if texts else load_prompts(source, 1, None, allow_hub=False)
        if sum(len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts) >= tokens:
            return texts
        n *= 2


def routing_report(model, tokenizer, window: int, tiers: dict[str, int], sources: tuple[str, ...] = HELD_OUT,
                   tokens: int = 4096) -> dict:
    """Everything the tool prints and writes, as one JSON-ready dict, from the model's routes."""
    from specter.models.facts import facts_from_config

    facts = facts_from_config(model.config)
    docs, text = held_out_docs(tokenizer, sources, tokens)
    routes = record_routes(model.eval(), docs)
    return summarize_routes(routes, facts.num_experts, facts.top_k, facts.model_type, window, tiers, text)


def summarize_routes(routes: dict[int, list[torch.Tensor]], num_experts: int, top_k: int, model_type: str,
                     window: int, tiers: dict[str, int], text: str) -> dict:
    """The report of recorded routes (MoE layer -> per-document [N_d, k] expert ids)."""
    stats, per_b = zip(*(layer_stats(layer, r, num_experts, top_k, window, tiers) for layer, r in routes.items()))
    gates = ROUTING_GATES.check(list(stats), model_type)
    return {
        "model_type": model_type, "num_experts": num_experts, "top_k": top_k, "window_tokens": window,
        "text": text, "tokens": sum(len(d) for d in next(iter(routes.values()))), "tiers": tiers,
        "layers": [asdict(s) for s in stats],
        "dead_experts": [s.dead_experts for s in stats],
        "usage_entropy": [round(s.usage_entropy, 4) for s in stats],
        "working_set": {str(b): [round(p[b], 2) for p in per_b] for b in BATCHES},
        "independent": {str(b): round(independent_working_set(num_experts, top_k, window * b), 2) for b in BATCHES},
        "gates": {"thresholds": asdict(ROUTING_GATES), "passed": gates},
        "sorted_share": {str(layer): [round(float(x), 5) for x in usage_share(torch.cat(r), num_experts)
                                      .sort(descending=True).values] for layer, r in routes.items()},
    }


# ---- output ---------------------------------------------------------------------------------------

def format_table(report: dict) -> str:
    tiers = list(report["tiers"])
    head = (f"{'layer':>5} {'dead':>5} {'entropy':>7} {'top-8':>6} {'window':>7} {'÷ indep':>7} {'B1→2':>5} "
            + " ".join(f"{'LRU ' + t:>9}" for t in tiers))
    lines = [f"{report['model_type']}: {report['num_experts']} experts, top-{report['top_k']}, windows of "
             f"{report['window_tokens']} tokens; {report['text']}", head]
    for s in report["layers"]:
        lines.append(f"{s['layer']:>5} {s['dead_experts']:>5} {s['usage_entropy']:>7.3f} {s['top8_share']:>6.2f} "
                     f"{s['window_experts']:>7.1f} {s['window_vs_independent']:>7.2f} {s['growth_1_to_2']:>5.2f} "
                     + " ".join(f"{s['lru_hit'][t]:>9.3f}" for t in tiers))
    ind = report["independent"]
    lines.append(f"independent routing: window {ind['1']:.1f}, B1→2 {ind['2'] / ind['1']:.2f}"
                 + (f"; paper B1→2 {PAPER_GROWTH[report['model_type']]}" if report["model_type"] in PAPER_GROWTH else ""))
    passed = report["gates"]["passed"]
    lines.append("routing gates: " + ", ".join(f"{k} {'ok' if ok else 'MISSED'}" for k, ok in passed.items()))
    return "\n".join(lines)


def write_outputs(report: dict, out: Path) -> None:
    import csv

    from specter.paths import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "routing.json", json.dumps(report, indent=1))
    tiers = list(report["tiers"])
    with open(out / "layers.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "dead_experts", "usage_entropy", "top8_share", "window_experts",
                    "window_vs_independent", "growth_1_to_2", *[f"lru_hit_{t}" for t in tiers]])
        for s in report["layers"]:
            w.writerow([s["layer"], s["dead_experts"], f"{s['usage_entropy']:.4f}", f"{s['top8_share']:.4f}",
                        f"{s['window_experts']:.2f}", f"{s['window_vs_independent']:.3f}", f"{s['growth_1_to_2']:.3f}",
                        *[f"{s['lru_hit'][t]:.4f}" for t in tiers]])
    with open(out / "working_set.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["batch", "tokens", "independent", *[f"layer_{s['layer']}" for s in report["layers"]]])
        for b in BATCHES:
            w.writerow([b, b * report["window_tokens"], report["independent"][str(b)], *report["working_set"][str(b)]])
    _figure(report, out / "routing.png")


def _figure(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for s, ws in zip(report["layers"], zip(*report["working_set"].values())):
        right.plot(BATCHES, ws, marker="o", label=f"layer {s['layer']}")
    right.plot(BATCHES, [report["independent"][str(b)] for b in BATCHES], "k--", label="independent routing")
    right.axhline(report["num_experts"], color="grey", lw=0.8)
    right.set(xscale="log", xticks=BATCHES, xticklabels=[str(b) for b in BATCHES], xlabel="concurrent windows B",
              ylabel="distinct experts per layer", title=f"working set of {report['window_tokens']}-token windows")
    right.legend(fontsize=8)
    n = report["num_experts"]
    for layer, share in report["sorted_share"].items():
        left.plot(range(1, n + 1), [max(x, 1e-5) for x in share], label=f"layer {layer}")  # log axis: no zeros
    left.axhline(1 / n, color="k", ls="--", lw=0.8, label="uniform")
    left.axhline(1 / (10 * n), color="tab:red", ls=":", lw=0.8, label="dead below (1/10E)")
    left.set(xlabel="expert rank", ylabel="share of routes", title="expert usage, sorted", yscale="log")
    left.legend(fontsize=8)
    fig.suptitle(f"{report['model_type']} routing on {report['text']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _load(checkpoint: str, untrained: bool):
    """(model, tokenizer, conf name for the memory tiers) of a tiny model name or a checkpoint folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specter.models import tiny

    if checkpoint in tiny.TINY_SPECS:
        folder = tiny.tiny_dir(checkpoint, trained=not untrained)
        if not folder.exists():
            hint = (f"build it with: python -m specter.models.tiny {checkpoint}" if untrained
                    else "train it with: python run.py model=" + checkpoint + " model.trained=true")
            raise FileNotFoundError(f"{folder} does not exist; {hint}")
        conf = checkpoint
    else:
        folder = Path(checkpoint)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{checkpoint!r} is neither a tiny model ({', '.join(tiny.TINY_SPECS)}) "
                                    "nor a checkpoint folder with a config.json")
        from specter.models.facts import MODEL_TYPES, facts_from_config, read_config

        model_type = facts_from_config(read_config(folder)).model_type  # refuses another architecture first
        conf = {t: name for name, t in MODEL_TYPES.items()}[model_type]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")  # the checkpoint's own dtype
    return model, tokenizer, conf


def held_out_routing(name: str, model, tokenizer) -> dict:
    """The routing report of `model` on held-out text, windows of the run config's K + 1 tokens: what a
    tiny model's training checks its routing gates on (passed to specter.models.tiny_train.train)."""
    K, tiers = model_defaults(name)
    return routing_report(model, tokenizer, K + 1, tiers)


def model_defaults(conf: str) -> tuple[int, dict[str, int]]:
    """(K, {tier: resident experts per layer}) from conf/model/<conf>.yaml."""
    from omegaconf import OmegaConf

    from specter.assembly.compose import CONF_DIR

    data = OmegaConf.load(CONF_DIR / "model" / f"{conf}.yaml")
    tiers = {t: int(v["resident_experts"]) for t, v in data["tiers"].items()}
    return int(data["K"]), dict(sorted(tiers.items(), key=lambda kv: kv[1]))


MAX_TOKENS = 2**20  # routes of a million tokens: hours on a CPU, and far more than any gate needs


def check_sources(text: str) -> tuple[str, ...]:
    """--text as sources, each a dataset name or a readable text file (UsageError otherwise)."""
    from specter.entry import UsageError
    from specter.datasets import DATASETS, canonical_name

    sources = tuple(s.strip() for s in text.split(","))
    for source in sources:
        path = Path(source)
        try:
            if not path.exists() and canonical_name(source):
                continue
        except ValueError:
            pass
        if not source or not path.exists():
            raise UsageError(f"--text {source!r} is neither a dataset ({', '.join(DATASETS)}) nor a file")
        if not path.is_file():
            raise UsageError(f"--text {source!r} is not a file")
        try:
            with path.open("rb") as f:
                f.read(1)
        except OSError as err:
            raise UsageError(f"--text {source!r} cannot be read ({err.strerror or err})") from None
    return sources


def check_out(out: Path) -> None:
    """--out must be a folder, or not exist yet, with no file on its way."""
    from specter.entry import UsageError

    for folder in (out, *out.parents):
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--out {out}: {folder} is a file, not a folder")


def main(argv: list[str] | None = None) -> int:
    from specter.entry import guarded

    return guarded("routing_stats", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    from specter.entry import OneLineParser, UsageError, bounded

    parser = OneLineParser(
        prog="python -m specter.routing_stats", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("checkpoint", help="a tiny model name (tiny_dsv2, tiny_qwen, tiny_phi) or a checkpoint folder")
    parser.add_argument("--untrained", action="store_true", help="a tiny model's random checkpoint, not its trained one")
    parser.add_argument("--text", default=",".join(HELD_OUT),
                        help="comma-separated dataset names or text files (default: %(default)s, held out from training)")
    parser.add_argument("--tokens", type=bounded(int, 64, MAX_TOKENS, f"a token count in [64, {MAX_TOKENS}]"),
                        default=4096, help="tokens of text to route (default: %(default)s)")
    parser.add_argument("--K", type=bounded(int, 1, 1024, "a draft length in [1, 1024]"), default=None,
                        help="draft length; windows are K + 1 tokens (default: the model's K)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: results/routing/<name>)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a routing gate is missed")
    args = parser.parse_args(argv)
    sources = check_sources(args.text)
    name = Path(args.checkpoint).name + ("-untrained" if args.untrained else "")
    out = args.out or Path("results") / "routing" / name
    check_out(out)
    from safetensors import SafetensorError

    from specter.datasets import DatasetFormatError, DatasetUnavailable
    from specter.models.facts import CheckpointFactsError

    try:
        model, tokenizer, conf = _load(args.checkpoint, args.untrained)
    except (FileNotFoundError, ValueError, OSError, CheckpointFactsError, SafetensorError) as err:
        # a truncated or foreign weights file is the user's to fix, like a missing one
        raise UsageError(f"{args.checkpoint}: {err}") from None
    K, tiers = model_defaults(conf)
    K = args.K or K
    try:
        report = routing_report(model, tokenizer, K + 1, tiers, sources, args.tokens)
    except (DatasetUnavailable, DatasetFormatError, ValueError) as err:  # too little text, an unreadable set
        raise UsageError(str(err)) from None
    short = [b for b in ("1", "2") if any(math.isnan(x) for x in report["working_set"][b])]
    if short:  # the gates and every per-layer column need B = 1 and 2; a larger B may lack windows (NaN)
        raise UsageError(f"the text holds too few {K + 1}-token windows for B = {' and '.join(short)}: "
                         "raise --tokens or lower --K")
    try:
        write_outputs(report, out)
    except OSError as err:
        raise UsageError(f"cannot write {out}: {err.strerror or err}") from None
    print(format_table(report))
    print(f"wrote {out}/routing.json, layers.csv, working_set.csv, routing.png")
    return 1 if args.check and not all(report["gates"]["passed"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
