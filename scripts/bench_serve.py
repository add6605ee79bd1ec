"""Load benchmark of `specter serve`: requests per second, TTFT and TPOT percentiles against the number of
concurrent clients, per method, over loopback only.

    python -m scripts.bench_serve                                   # trained tiny_dsv2, low tier, emulated link
    python -m scripts.bench_serve --clients 1 4 --requests 8 --max-tokens 32 --quant rtn   # a quick look
    python -m scripts.bench_serve --methods specter target_only --untrained

For every method a server runs in its own process (`python -m specter.cli serve`, as a user runs it, on
a free 127.0.0.1 port); this process is the load generator: at each concurrency level C, C clients
(one asyncio task each, the `openai` package's async client) send streaming completions one after
another until `--requests` are done or `--time-limit` seconds pass. Prompts are HumanEval's (the
bundled file), 16-token prefixes as in the paper's protocol, `ignore_eos` so every request decodes
exactly --max-tokens tokens, greedy. Per request: TTFT (send to the first token), TPOT ((last -
first token) / (n - 1), the paper's definition, at the client: a speculative window's tokens arrive
together), end to end; beside it the engine's mean TPOT over its own commit stamps (/metrics). Per level: RPS (finished requests /
wall), generated tokens per second, and p50/p90/p99 of TTFT and TPOT. Writes serve.csv and
serve.png under --out (default results/bench/serve).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIELDS = ("method", "model", "memory", "clients", "requests", "wall_s", "rps", "tokens_per_s", "ttft_p50_ms",
          "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "e2e_p50_ms", "server_tpot_mean_ms", "max_batch",
          "acceptance", "h2d_bytes_per_token")


def percentile(values: list[float], q: float) -> float | None:
    from specter.experiments.batch import percentile as pct

    return pct(values, q)


def prompts(n: int, prefix: int, checkpoint: Path) -> list[list[int]]:
    """The first `n` HumanEval prompts as `prefix`-token id lists (the harness's protocol)."""
    from transformers import AutoTokenizer

    from specter.datasets import load_prompt_set

    tok = AutoTokenizer.from_pretrained(checkpoint)
    texts = load_prompt_set("humaneval", n, str(REPO / "assets"), allow_hub=False).texts
    return [tok(t, add_special_tokens=False).input_ids[:prefix] for t in texts]


def start_server(overrides: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = open(log, "w")  # noqa: SIM115 - the server's log for as long as it runs
    proc = subprocess.Popen([sys.executable, "-m", "specter.cli", "serve", *overrides, "--port", str(port),
                             "--max-queue", "256"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # a first GPTQ draft build takes minutes
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"bench_serve: the server did not start; see {log}") from None
            time.sleep(0.5)


def scrape(url: str) -> dict[str, float]:
    """The server's counters (sums over label sets) from /metrics."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("specter_") and " " in line:
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def level(url: str, model: str, ids: list[list[int]], clients: int, requests: int, max_tokens: int,
                time_limit: float) -> tuple[list[dict], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    results: list[dict] = []
    issued = 0
    t0 = time.perf_counter()

    async def one(prompt: list[int]) -> dict:
        sent = time.perf_counter()
        stamps, n = [], 0
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            k = len(chunk.choices[0].model_extra.get("token_ids") or [])
            if k:
                stamps.append(time.perf_counter())
                n += k
        first, last = stamps[0], stamps[-1]
        return {"ttft_ms": (first - sent) * 1e3, "tpot_ms": (last - first) * 1e3 / (n - 1) if n > 1 else None,
                "e2e_ms": (last - sent) * 1e3, "tokens": n}

    async def worker() -> None:
        nonlocal issued
        while issued < requests and time.perf_counter() - t0 < time_limit:
            prompt = ids[issued % len(ids)]
            issued += 1
            results.append(await one(prompt))

    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return results, wall


def summarize(method: str, model: str, memory: str, clients: int, results: list[dict], wall: float,
              before: dict, after: dict, max_batch: int) -> dict:
    ttft = [r["ttft_ms"] for r in results]
    tpot = [r["tpot_ms"] for r in results if r["tpot_ms"] is not None]
    tokens = sum(r["tokens"] for r in results)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafted = delta("specter_draft_tokens_total")
    return {
        "method": method, "model": model, "memory": memory, "clients": clients, "requests": len(results),
        "wall_s": wall, "rps": len(results) / wall, "tokens_per_s": tokens / wall,
        **{f"ttft_p{q}_ms": percentile(ttft, q / 100) for q in (50, 90, 99)},
        **{f"tpot_p{q}_ms": percentile(tpot, q / 100) for q in (50, 90, 99)},
        "e2e_p50_ms": statistics.median(r["e2e_ms"] for r in results),
        # the engine's own commit stamps (its TPOT histogram): a client sees a window's tokens arrive at once
        "server_tpot_mean_ms": (delta("specter_tpot_seconds_sum") / delta("specter_tpot_seconds_count") * 1e3
                                if delta("specter_tpot_seconds_count") else None),
        "max_batch": max_batch,
        "acceptance": delta("specter_accepted_tokens_total") / drafted if drafted else None,
        "h2d_bytes_per_token": delta("specter_h2d_bytes_total") / tokens if tokens else None,
    }


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        xs = [r["clients"] for r in mine]
        axes[0].plot(xs, [r["rps"] for r in mine], marker="o", label=method)
        axes[1].plot(xs, [r["tpot_p50_ms"] for r in mine], marker="o", label=f"{method} p50")
        axes[1].plot(xs, [r["tpot_p90_ms"] for r in mine], marker="x", ls="--", label=f"{method} p90")
        axes[2].plot(xs, [r["ttft_p50_ms"] for r in mine], marker="o", label=f"{method} p50")
        axes[2].plot(xs, [r["ttft_p90_ms"] for r in mine], marker="x", ls="--", label=f"{method} p90")
    for ax, title in zip(axes, ("requests / s", "TPOT (ms)", "TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    model, memory = rows[0]["model"], rows[0]["memory"]
    fig.suptitle(f"specter serve on {model} ({memory} tier), loopback, streaming, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny_dsv2")
    ap.add_argument("--memory", default="low")
    ap.add_argument("--methods", nargs="+", default=["specter", "offload_ar"])
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16, 32])
    ap.add_argument("--requests", type=int, default=32, help="requests per level (at least the level's clients)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per level before no new request starts")
    ap.add_argument("--hardware", default="emulated")
    ap.add_argument("--quant", default="gptq", help="specter's draft quantization (gptq | rtn)")
    ap.add_argument("--untrained", action="store_true", help="the random-weight tiny model")
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "serve"))
    ap.add_argument("extra", nargs="*", help="more overrides for every server (key=value)")
    args = ap.parse_args(argv)

    import json

    import pandas as pd

    from specter.assembly.runtime import model_checkpoint
    from specter.api import compose_checked

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [f"model={args.model}", f"memory={args.memory}", f"hardware={args.hardware}", *args.extra]
    if not args.untrained:
        base.append("model.trained=true")
    ids = prompts(max(args.requests, 8), args.prefix_tokens, model_checkpoint(compose_checked(base)))
    rows: list[dict] = []
    for method in args.methods:
        overrides = [*base, f"method={method}", *([f"method.quant={args.quant}"] if method == "specter" else [])]
        proc, url = start_server(overrides, out / f"server-{method}.log")
        try:
            health = json.loads(urllib.request.urlopen(url + "/health").read())
            model = health["model"]
            asyncio.run(level(url, model, ids, 1, 2, args.max_tokens, args.time_limit))  # warm the HTTP path
            for clients in args.clients:
                before = scrape(url)
                results, wall = asyncio.run(level(url, model, ids, clients, max(args.requests, clients),
                                                  args.max_tokens, args.time_limit))
                row = summarize(method, args.model, args.memory, clients, results, wall, before, scrape(url),
                                health["max_batch"])
                rows.append(row)
                print(f"{method:>10} C={clients:<3} {row['requests']:>3} req  {row['rps']:.2f} req/s  "
                      f"{row['tokens_per_s']:.0f} tok/s  TTFT p50 {row['ttft_p50_ms']:.1f} ms  "
                      f"TPOT p50 {row['tpot_p50_ms']:.2f} / p90 {row['tpot_p90_ms']:.2f} ms  "
                      f"(engine mean {row['server_tpot_mean_ms'] or float('nan'):.2f} ms)", flush=True)
        finally:
            proc.terminate()  # SIGTERM: the server drains and exits
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    table = pd.DataFrame(rows, columns=list(FIELDS))
    table.to_csv(out / "serve.csv", index=False)
    figure(rows, out / "serve.png")
    print(f"wrote {out / 'serve.csv'} and {out / 'serve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
