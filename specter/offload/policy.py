"""Residency policies of one cached MoE layer: which resident expert a load replaces (plain Python).

A policy only decides; `specter.offload.cache.ExpertCache` moves the bytes. Both policies keep
the same bookkeeping (expert -> slot map, a recency order, protection counts, staging slots) and
the cache drives them through one interface. The cache tells a policy what the window knows
through *hints*; `LRUPolicy` ignores them, `WindowPolicy` decides by them:

- ``predict(experts)``: while drafting, the experts the draft has routed to in this window so far
  (the ELB's counted experts at a planner boundary);
- ``begin_pass(order, tokens)`` / ``served(e)`` / ``end_pass()``: a verification pass of this layer,
  its groups in the order they will be computed and the tokens routed to each; ``served`` when a
  group's compute is done;
- ``end_window()``: verification is over; the next window's evidence starts empty.

Residencies (`method.residency`): ``lru`` (the least recently used unprotected expert is replaced,
every phase alike) and ``window``:

- drafting: a load (a prefetch) replaces only a *cold* resident: one the draft has not routed to in
  this window and the layer's last verification pass did not use (the least recently used of those).
  Windows overlap heavily (consecutive tokens route alike), so a resident the last pass used is
  likely needed by this one, and an early boundary has seen only a few draft tokens; replacing it
  costs a second load of it in verification. When no resident is cold, the load goes to a free
  staging buffer (the cache's, given back before the next window), else it is refused (skipped)
  and the expert loads on demand: one load either way;
- verifying: a miss replaces a resident with no use left in this pass (Belady over the pass's known
  routes: an expert with none is the furthest), never one a not-yet-computed group still needs;
  among those, the one least worth keeping for the next window;
- at the end of a layer's pass the recency order is re-ranked by what the next window is likely to
  use: the tokens this pass routed to each expert, then the draft's counts this window, then
  recency. Nothing moves; the next window's evictions simply take the least valuable first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping, Sequence

RESIDENCIES = ("lru", "window")


class LRUPolicy:
    """Eviction policy of one layer: expert -> slot map, LRU order, protection counts."""

    name = "lru"

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._slot: dict[int, int] = {}  # expert -> slot
        self._order: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._protect: dict[int, int] = {}  # expert -> outstanding protections
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() gives slot 0 first

    # -- hints (what the window knows); LRU ignores them ---------------------------------
    def predict(self, experts: Iterable[int], counts: Mapping[int, int] | None = None) -> None:
        """The draft routed to ``experts`` in this window (``counts``: how often)."""

    def begin_pass(self, order: Sequence[int], tokens: Mapping[int, int]) -> None:
        """A verification pass of this layer computes the groups ``order`` (in that order)."""

    def served(self, expert: int) -> None:
        """The pass's group of ``expert`` is computed."""

    def end_pass(self) -> None:
        """The layer's verification pass is over."""

    def end_window(self) -> None:
        """The window (draft and verification) is over."""

    def refuses(self) -> bool:
        """True when unprotected residents exist but none may be replaced now (LRU never refuses them)."""
        return False

    # -- bookkeeping ---------------------------------------------------------------------
    def lookup(self, expert: int) -> int | None:
        """Slot holding ``expert``, or None."""
        return self._slot.get(expert)

    def touch(self, expert: int) -> None:
        """Mark ``expert`` most recently used."""
        self._order.move_to_end(expert)

    def unprotected(self) -> list[int]:
        """Unprotected residents, least recently used first."""
        return [e for e in self._order if not self._protect.get(e)]

    def choose_victim(self) -> int | None:
        """Least recently used unprotected expert, or None when all are protected."""
        for expert in self._order:
            if not self._protect.get(expert):
                return expert
        return None

    def admit(self, expert: int) -> tuple[int, int | None] | None:
        """Place a new ``expert``: a free slot, else the victim's. Returns ``(slot, evicted)``,
        or None when the layer is full and no resident may be replaced."""
        if expert in self._slot:
            raise ValueError(f"expert {expert} is already resident in slot {self._slot[expert]}")
        if self._free:
            slot, evicted = self._free.pop(), None
        else:
            evicted = self.choose_victim()
            if evicted is None:
                return None
            slot = self._slot.pop(evicted)
            del self._order[evicted]
        self._slot[expert] = slot
        self._order[expert] = None
        return slot, evicted

    def protect(self, expert: int) -> None:
        if expert not in self._slot:
            raise KeyError(f"cannot protect non-resident expert {expert}")
        self._protect[expert] = self._protect.get(expert, 0) + 1

    def unprotect(self, expert: int) -> None:
        count = self._protect.get(expert, 0)
        if count < 1:
            raise RuntimeError(f"expert {expert} is not protected")
        if count == 1:
            del self._protect[expert]
        else:
            self._protect[expert] = count - 1

    def is_protected(self, expert: int) -> bool:
        return bool(self._protect.get(expert))

    def protected_count(self) -> int:
        """Number of resident experts currently protected."""
        return len(self._protect)

    def residents(self) -> dict[int, int]:
        """expert -> slot, a copy."""
        return dict(self._slot)

    # -- staging: a lent slot is added above the layer's own, and removed again from the top
    def grow(self) -> int:
        """Add one (free) slot; returns its id (= the old capacity)."""
        slot = self.capacity
        self.capacity += 1
        self._free.append(slot)
        return slot

    def holder(self, slot: int) -> int | None:
        """Expert in ``slot``, or None when it is free."""
        return next((e for e, s in self._slot.items() if s == slot), None)

    def evict(self, expert: int) -> int:
        """Remove an unprotected ``expert``; returns the slot it freed."""
        if self._protect.get(expert):
            raise RuntimeError(f"cannot evict protected expert {expert}")
        slot = self._slot.pop(expert)
        del self._order[expert]
        self._free.append(slot)
        return slot

    def relocate(self, expert: int, slot: int) -> int:
        """Move an unprotected ``expert`` into the free ``slot``; returns the slot it left (now free)."""
        if self._protect.get(expert) or slot not in self._free:
            raise RuntimeError(f"cannot move expert {expert} into slot {slot}")
        old = self._slot[expert]
        self._free.remove(slot)
        self._free.append(old)
        self._slot[expert] = slot
        return old

    def drop_top_slot(self) -> None:
        """Remove the highest slot, which must be free."""
        top = self.capacity - 1
        if top not in self._free or top == 0:
            raise RuntimeError(f"slot {top} is not free (or is the last slot)")
        self._free.remove(top)
        self.capacity -= 1

    def lru_order(self) -> list[int]:
        return list(self._order)

    def __len__(self) -> int:
        return len(self._slot)


class WindowPolicy(LRUPolicy):
    """Window-aware residency (see the module docstring): predicted residents survive the draft's
    prefetches, a verification miss replaces only residents the pass no longer needs, and what a pass
    leaves behind is ranked for the next window."""

    name = "window"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._predicted: dict[int, int] = {}  # expert -> draft routes this window
        self._pass: dict[int, int] | None = None  # verifying: expert -> position of its not-yet-computed group
        self._tokens: dict[int, int] = {}  # verifying: expert -> tokens this pass routes to it
        self._recent: dict[int, int] = {}  # expert -> tokens the layer's last finished pass routed to it

    # -- hints ---------------------------------------------------------------------------
    def predict(self, experts: Iterable[int], counts: Mapping[int, int] | None = None) -> None:
        for e in experts:
            self._predicted[e] = max(self._predicted.get(e, 0), int((counts or {}).get(e, 1)))

    def begin_pass(self, order: Sequence[int], tokens: Mapping[int, int]) -> None:
        self._pass = {e: i for i, e in enumerate(order)}
        self._tokens = {int(e): int(n) for e, n in tokens.items()}

    def served(self, expert: int) -> None:
        if self._pass is not None:
            self._pass.pop(expert, None)

    def end_pass(self) -> None:
        """Re-rank the recency order for the next window: least worth keeping first (no data moves)."""
        self._pass = None
        self._recent = dict(self._tokens)
        rank = {e: i for i, e in enumerate(self._order)}
        for e in sorted(self._order, key=lambda e: (self._keep(e), rank[e])):
            self._order.move_to_end(e)
        self._tokens = {}

    def end_window(self) -> None:
        self._predicted = {}
        self._pass = None
        self._tokens = {}

    def _keep(self, expert: int) -> tuple[int, int]:
        """How much the next window is expected to want ``expert`` (larger: keep)."""
        return self._tokens.get(expert, 0), self._predicted.get(expert, 0)

    # -- victims -------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        return "verify" if self._pass is not None else "draft" if self._predicted else "idle"

    def choose_victim(self) -> int | None:
        candidates = self.unprotected()  # least recently used first
        if not candidates:
            return None
        if self._pass is not None:  # Belady over the pass: only residents with no use left in it
            done = [e for e in candidates if e not in self._pass]
            if not done:
                return None  # every candidate is still needed by a group of this pass: refuse
            rank = {e: i for i, e in enumerate(candidates)}
            return min(done, key=lambda e: (self._keep(e), rank[e]))
        if self._predicted:  # drafting: never a resident the draft has routed to, nor one the last pass used
            return next((e for e in candidates if e not in self._predicted and e not in self._recent), None)
        return candidates[0]

    def refuses(self) -> bool:
        """True when unprotected residents exist but the policy keeps them all (a prefetch is skipped;
        a staging buffer is borrowed only when every resident is protected, as under LRU)."""
        return self.choose_victim() is None and bool(self.unprotected())


def make_residency_policy(name: str, capacity: int) -> LRUPolicy:
    """The policy object of residency ``name`` (one of RESIDENCIES) for a layer of ``capacity`` slots."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "window":
        return WindowPolicy(capacity)
    raise ValueError(f"unknown residency {name!r}; choose one of {RESIDENCIES}")
