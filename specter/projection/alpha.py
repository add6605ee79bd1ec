"""The α curve: projected TPOT against the draft's acceptance, for Specter and the speculative baselines.

Acceptance is the one input of the projection the proxies cannot vouch for (a 4-layer, 128-wide proxy
accepts its INT4 draft more often than a 27-layer real model does). So instead of one point, the
projection draws the curve: the same engine, slots and K on the same prompts, with drafts of several
precisions (`drafts.DraftSpec`: GPTQ or RTN at 2-4 bits and several group sizes), each point at the
acceptance that draft actually reached on the proxy. Every draft is charged the paper's INT4 g128 bytes
and time, so only α moves along a method's curve; the paper's measured mean α (0.966) is marked on it.
"""

from __future__ import annotations

from typing import Callable

from specter.projection.drafts import DraftSpec
from specter.projection.engine_run import Projected

ALPHA_FIELDS = ("model", "memory", "device", "method", "K", "draft", "bits", "group", "algo", "alpha", "tpot_ms",
                "loads_per_token", "copy_busy")


def alpha_rows(method: str, drafts: list[DraftSpec], run: Callable[[DraftSpec], Projected], base: dict[str, str],
               progress: Callable[[str], None] = print) -> list[dict[str, str]]:
    """`run(spec)` projects the method with that draft; one row per draft, in the order given."""
    rows = []
    for spec in drafts:
        p = run(spec)
        progress(f"    {method} {spec.name}: alpha {p.acceptance or 0:.3f}, "
                 f"{(p.tpot or 0) * 1e3:.2f} ms/token")
        rows.append({**base, "method": method, "K": "" if p.K is None else str(p.K), "draft": spec.name,
                     "bits": str(spec.bits), "group": str(spec.group), "algo": spec.algo,
                     "alpha": "" if p.acceptance is None else f"{p.acceptance:.4f}",
                     "tpot_ms": "" if p.tpot is None else f"{p.tpot * 1e3:.4f}",
                     "loads_per_token": "" if p.loads_per_token is None else f"{p.loads_per_token:.4f}",
                     "copy_busy": "" if p.copy_busy is None else f"{p.copy_busy:.4f}"})
    return rows
