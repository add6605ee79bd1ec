"""K profiled on the modelled device: the engine run on the virtual clock at every K of a set, the fastest kept.

The paper picks K by the lowest mean TPOT over a sweep on its own GPU (Fig. 7). On another device, or at
another acceptance, a different K can win: a costlier link rewards a longer window (each load is shared by
more tokens) as long as acceptance holds. So the projection profiles K on the device it models, per model x
tier, on prompts of its own (held-out prompts after the measured ones, so the K is not chosen on the
numbers it is then reported with), and reports the chosen K beside the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specter.projection.engine_run import Projected

PROFILE_FIELDS = ("model", "memory", "device", "draft", "method", "K", "tpot_ms", "loads_per_token", "acceptance",
                  "chosen")


@dataclass
class Profile:
    method: str
    points: list[tuple[int, Projected]]  # (K, its projection on the profile prompts), K ascending

    @property
    def best(self) -> int:
        """The K with the lowest projected TPOT; ties go to the smaller K (less draft work), as `choose_K` does."""
        timed = [(p.tpot, K) for K, p in self.points if p.tpot is not None]
        if not timed:
            raise ValueError(f"{self.method}: no K of the profile produced a TPOT")
        return min(timed)[1]


def profile(method: str, values: list[int], run: Callable[[int], Projected], progress: Callable[[str], None] = print
            ) -> Profile:
    """`run(K)` projects the method at draft length K (on the profile prompts) for every K of `values`."""
    points = []
    for K in sorted(set(values)):
        p = run(K)
        points.append((K, p))
        progress(f"    {method} K={K}: {p.tpot * 1e3:.2f} ms/token, acceptance {p.acceptance or 0:.3f}"
                 if p.tpot is not None else f"    {method} K={K}: no TPOT")
    return Profile(method, points)


def profile_rows(prof: Profile, base: dict[str, str]) -> list[dict[str, str]]:
    """k_profile.csv rows: every K of the profile, the chosen one marked."""
    best = prof.best
    return [{**base, "method": prof.method, "K": str(K), "tpot_ms": _f(p.tpot, 1e3),
             "loads_per_token": _f(p.loads_per_token), "acceptance": _f(p.acceptance), "chosen": str(K == best).lower()}
            for K, p in prof.points]


def _f(x: float | None, scale: float = 1.0) -> str:
    return "" if x is None else f"{x * scale:.4f}"
