"""Per-layer expert slot cache: a residency policy (plain Python, `specter.offload.policy`) over device
slots (movement via a link). The policy decides which resident a load replaces (``residency``: ``lru``,
the default, or ``window``); the cache only moves bytes and passes the window's hints on.

Each MoE layer owns M fixed device slots (M = cache capacity of that layer). A slot
holds one expert's flat buffer and carries two orderings:

- ``ready``: the ticket of the copy that filled it (copy -> compute);
- ``last_use``: on CUDA, an event recorded on the compute stream when the slot was
  released (compute -> next overwrite; passed to the link as ``after=``).

An expert is *protected* while a handle on it is outstanding (acquired, not yet
released) or while a prefetch of it has not yet been consumed by an ``acquire``;
protected slots are never evicted, so a layer may refuse a load (``None``) when all
of its slots are protected - the caller releases something and retries.

Staging buffers (``staging=S``, default 0) are a pool of S extra device buffers shared by
all layers, as in Mixtral-Offloading: a layer whose slots are all protected borrows one
for the next load instead of refusing it, and gives one back as soon as it can evict an
unprotected expert (buffers change owner; no data moves). At rest every layer holds its
own M experts; the pool's bytes are part of ``device_bytes()``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import torch

from .link import CompletedTicket, Ticket, TransferLink
from .policy import RESIDENCIES, LRUPolicy, make_residency_policy
from .store import ExpertUID, HostExpertStore


@dataclass
class SlotHandle:
    """An expert placed in a device slot. ``ready`` may still be in flight; ``hit`` says
    whether the expert was already resident (or already loading) when asked for."""

    uid: ExpertUID
    slot: int
    ready: Ticket
    hit: bool
    prefetch: bool = False
    released: bool = False


@dataclass
class CacheCounters:
    """Per-record counters. ``loads`` counts every copy submitted (demand, prefetch or other)."""

    demand_hits: int = 0
    demand_misses: int = 0
    prefetch_loads: int = 0
    prefetch_used: int = 0  # prefetch loads later consumed by a demand acquire
    loads: int = 0
    refused_by_policy: int = 0  # loads the residency policy refused (every unprotected resident still wanted)
    staged_loads: int = 0  # loads placed in a borrowed staging buffer (all own slots protected)
    h2d_bytes: int = 0
    copy_wait_s: float = 0.0


@dataclass
class _Layer:
    policy: LRUPolicy
    slots: torch.Tensor  # [M, numel]; the layer's own buffers
    ready: list[Ticket]
    last_use: list[object | None]
    prefetched: dict[int, bool] = field(default_factory=dict)  # unconsumed prefetch -> was it a load
    rows: list[torch.Tensor] = field(default_factory=list)  # slot s -> its buffer ([numel]); own rows unless staging swapped them

    def __post_init__(self) -> None:
        if not self.rows:
            self.rows = list(self.slots)

    @property
    def own(self) -> int:
        return self.slots.shape[0]


class ExpertCache:
    """Device slots for the routed experts of each MoE layer, filled from a host store."""

    def __init__(
        self,
        store: HostExpertStore,
        link: TransferLink,
        capacity: Mapping[int, int],
        device: torch.device | str,
        dtype: torch.dtype,
        initial_residents: Mapping[int, Sequence[int]] | None = None,
        staging: int = 0,
        residency: str = "lru",
    ):
        if residency not in RESIDENCIES:
            raise ValueError(f"unknown residency {residency!r}; choose one of {RESIDENCIES}")
        self.residency = residency
        if dtype != store.layout.dtype:
            raise ValueError(f"slot dtype {dtype} differs from the host store's {store.layout.dtype}")
        for layer, m in capacity.items():
            if layer not in store.moe_layers:
                raise ValueError(f"layer {layer} has a cache capacity but is not a MoE layer of the store")
            if m < 1:
                raise ValueError(f"cache capacity of layer {layer} must be >= 1 (top-k needs a slot), got {m}")
            if m > store.num_experts:
                raise ValueError(f"cache capacity of layer {layer} is {m}, more than its {store.num_experts} experts")
        self.store = store
        self.link = link
        self.device = torch.device(device)
        self.dtype = dtype
        self.nbytes_per_expert = store.nbytes_per_expert
        self._use_events = self.device.type == "cuda"
        self._initial: dict[int, list[int]] = {}
        for layer, m in capacity.items():
            init = list(range(m)) if initial_residents is None else list(initial_residents.get(layer, range(m)))
            if len(init) != m or len(set(init)) != m or not all(0 <= e < store.num_experts for e in init):
                raise ValueError(f"initial residents of layer {layer} must be {m} distinct expert ids, got {init}")
            self._initial[layer] = init
        self._layers: dict[int, _Layer] = {}
        for layer, m in capacity.items():
            slots = torch.empty(m, store.layout.numel, dtype=dtype, device=self.device)  # [M, numel]
            self._layers[layer] = _Layer(make_residency_policy(residency, m), slots, [CompletedTicket()] * m, [None] * m)
        if staging < 0:
            raise ValueError(f"staging buffers must be >= 0, got {staging}")
        self._staging = torch.empty(staging, store.layout.numel, dtype=dtype, device=self.device)  # [S, numel]
        self._pool: list[tuple[torch.Tensor, object | None]] = []  # free staging buffers: (buffer, last use)
        self.counters = CacheCounters()
        self.reset()

    # -- lifecycle ----------------------------------------------------------------------
    def reset(self) -> None:
        """Restore the initial residents (synchronously), drop protections and counters.

        Outstanding handles become invalid. Call outside timed regions."""
        self.link.synchronize()  # in-flight copies still write into slots
        for layer, st in self._layers.items():
            before = st.policy.residents()
            ready = [t.done() for t in st.ready]
            own = [st.rows[s].data_ptr() == st.slots[s].data_ptr() for s in range(st.own)]  # staging may have swapped buffers
            policy = make_residency_policy(self.residency, st.own)
            for slot, expert in enumerate(self._initial[layer]):
                got = policy.admit(expert)
                assert got is not None and got[0] == slot
                if before.get(expert) != slot or not ready[slot] or not own[slot]:
                    st.slots[slot].copy_(self.store.buffer(ExpertUID(layer, expert)))
            st.policy = policy
            st.rows = list(st.slots)
            st.ready = [CompletedTicket()] * policy.capacity
            st.last_use = [None] * policy.capacity
            st.prefetched = {}
        self._pool = [(buf, None) for buf in self._staging]
        if self._use_events:
            torch.cuda.synchronize(self.device)
        self.reset_counters()

    def reset_counters(self) -> None:
        self.counters = CacheCounters()
        self.load_log: list[tuple[int, int]] = []  # (layer, expert) of every load, in submission order

    def set_residency(self, residency: str) -> None:
        """Switch every layer to residency policy ``residency`` (`policy.RESIDENCIES`) and reset."""
        if residency not in RESIDENCIES:
            raise ValueError(f"unknown residency {residency!r}; choose one of {RESIDENCIES}")
        self.residency = residency
        self.reset()

    # -- hints: what the window knows, passed to the layer's policy (LRU ignores them) ----------
    @property
    def wants_hints(self) -> bool:
        """Whether the policy decides by the window's hints (callers may skip computing them otherwise)."""
        return self.residency != "lru"

    def predict(self, layer: int, experts, counts=None) -> None:
        """While drafting: the draft routed to ``experts`` of ``layer`` in this window."""
        self._layer(layer).policy.predict(experts, counts)

    def begin_pass(self, layer: int, order, tokens) -> None:
        """A verification pass of ``layer`` will compute the groups ``order`` (``tokens``: expert -> tokens)."""
        self._layer(layer).policy.begin_pass(order, tokens)

    def end_pass(self, layer: int) -> None:
        self._layer(layer).policy.end_pass()

    def end_window(self) -> None:
        """The window is over (after verification and `release_prefetches`)."""
        for st in self._layers.values():
            st.policy.end_window()

    def snapshot_counters(self) -> dict[str, float]:
        return asdict(self.counters)

    # -- queries ------------------------------------------------------------------------
    def _layer(self, layer: int) -> _Layer:
        try:
            return self._layers[layer]
        except KeyError:
            raise KeyError(f"layer {layer} has no expert cache (cached layers: {sorted(self._layers)})") from None

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def initial_residents(self) -> dict[int, set[int]]:
        """Per layer, the experts `reset()` restores (the state every measured record starts from)."""
        return {layer: set(experts) for layer, experts in self._initial.items()}

    def capacity(self, layer: int) -> int:
        """The layer's own slots M (borrowed staging buffers not included)."""
        return self._layer(layer).own

    @property
    def staging(self) -> int:
        """Staging buffers shared by all layers."""
        return self._staging.shape[0]

    def free_staging(self) -> int:
        """Staging buffers in the pool now, lent to no layer (all of them at rest)."""
        return len(self._pool)

    def resident(self, layer: int) -> set[int]:
        """Experts in the layer's slots, including ones still loading."""
        return set(self._layer(layer).policy.residents())

    def is_resident(self, uid: ExpertUID) -> bool:
        return self.slot_of(uid.layer, uid.expert) is not None

    def slot_of(self, layer: int, expert: int) -> int | None:
        """The slot holding ``expert`` in ``layer`` (it may still be loading), or None."""
        return self._layer(layer).policy.lookup(expert)

    def wait_resident(self, layer: int) -> None:
        """Block until the copies into every resident slot of ``layer`` have landed (for inspection:
        `slot_buffer` then holds each expert's bytes)."""
        st = self._layer(layer)
        for slot in st.policy.residents().values():
            st.ready[slot].wait()

    def protected_count(self, layer: int) -> int:
        return self._layer(layer).policy.protected_count()

    def pending_prefetches(self, layer: int) -> set[int]:
        """Prefetched experts not yet consumed by an acquire."""
        return set(self._layer(layer).prefetched)

    def device_bytes(self) -> int:
        """Footprint of all slots and staging buffers."""
        return self.slot_bytes() + self.staging_bytes()

    def slot_bytes(self) -> int:
        """Footprint of the layers' own slots."""
        return sum(st.slots.numel() * st.slots.element_size() for st in self._layers.values())

    def staging_bytes(self) -> int:
        """Footprint of the staging buffers shared by all layers."""
        return self._staging.numel() * self._staging.element_size()

    def slot_buffer(self, layer: int, slot: int) -> torch.Tensor:
        """Flat device buffer of one slot (for inspection)."""
        return self._layer(layer).rows[slot]

    # -- movement -----------------------------------------------------------------------
    def _place(self, uid: ExpertUID) -> tuple[ExpertUID, _Layer, int, Ticket, bool] | None:
        """Find or load ``uid``; returns ``(uid, its layer, slot, ready, hit)`` or None if every slot
        of the layer is protected."""
        st = self._layer(uid.layer)
        slot = st.policy.lookup(uid.expert)
        if slot is not None:
            st.policy.touch(uid.expert)
            return uid, st, slot, st.ready[slot], True
        got = st.policy.admit(uid.expert)
        if got is None and self._pool:  # no own slot may be replaced (protected, or kept by the policy): borrow
            # a staging buffer; it goes back before the next window, so no resident is lost for the load
            buf, last_use = self._pool.pop()
            st.policy.grow()
            st.rows.append(buf)
            st.ready.append(CompletedTicket())
            st.last_use.append(last_use)
            got = st.policy.admit(uid.expert)
            self.counters.staged_loads += 1
        if got is None:
            if st.policy.refuses():  # the policy keeps every unprotected resident and no buffer is free: skip
                self.counters.refused_by_policy += 1
            return None
        slot, _evicted = got
        ticket = self.link.submit(self.store.buffer(uid), st.rows[slot], after=st.last_use[slot], tag=uid)
        st.ready[slot] = ticket
        st.last_use[slot] = None
        self.counters.loads += 1
        self.load_log.append((uid.layer, uid.expert))
        self.counters.h2d_bytes += self.nbytes_per_expert
        return uid, st, slot, ticket, False

    def acquire(self, uid: ExpertUID, *, demand: bool = True) -> SlotHandle | None:
        """Protect ``uid`` in a slot (loading it on a miss) and hand it out; None when every
        slot of the layer is protected. ``demand=False`` leaves hit/miss counters alone."""
        placed = self._place(ExpertUID(*uid))
        if placed is None:
            return None
        uid, st, slot, ticket, hit = placed
        if uid.expert in st.prefetched:  # consume the prefetch: its protection passes to this handle
            if st.prefetched.pop(uid.expert):
                self.counters.prefetch_used += 1
        else:
            st.policy.protect(uid.expert)
        if demand:
            if hit:
                self.counters.demand_hits += 1
            else:
                self.counters.demand_misses += 1
        return SlotHandle(uid, slot, ticket, hit)

    def prefetch(self, uid: ExpertUID) -> SlotHandle | None:
        """Load ``uid`` ahead of use (if not resident) and keep it protected until an
        ``acquire`` of it consumes the prefetch; None when every slot is protected."""
        placed = self._place(ExpertUID(*uid))
        if placed is None:
            return None
        uid, st, slot, ticket, hit = placed
        if uid.expert not in st.prefetched:
            st.policy.protect(uid.expert)
            st.prefetched[uid.expert] = not hit
            if not hit:
                self.counters.prefetch_loads += 1
        return SlotHandle(uid, slot, ticket, hit, prefetch=True)

    def release_prefetches(self, layer: int | None = None) -> int:
        """Drop the protection of unconsumed prefetches (mispredictions); returns how many."""
        dropped = 0
        for lay in [layer] if layer is not None else list(self._layers):
            st = self._layer(lay)
            for expert in st.prefetched:
                st.policy.unprotect(expert)
                dropped += 1
            st.prefetched = {}
            self._return_staging(st)
        return dropped

    def _return_staging(self, st: _Layer) -> None:
        """Give borrowed buffers back: evict the LRU unprotected expert and drop the top slot,
        moving the top slot's (unprotected) expert into the victim's slot by swapping buffers.
        Stops when nothing can be evicted or moved yet; a later release continues."""
        while st.policy.capacity > st.own:
            top = st.policy.capacity - 1
            holder = st.policy.holder(top)
            if holder is not None:
                victim = st.policy.choose_victim()
                if victim is None or (holder != victim and st.policy.is_protected(holder)):
                    return
                freed = st.policy.evict(victim)
                if holder != victim:
                    st.policy.relocate(holder, freed)
                    for lst in (st.rows, st.ready, st.last_use):
                        lst[freed], lst[top] = lst[top], lst[freed]
            st.policy.drop_top_slot()
            st.ready.pop()
            self._pool.append((st.rows.pop(), st.last_use.pop()))

    def wait(self, handle: SlotHandle) -> float:
        """Order the caller's compute after the slot's copy; adds host-blocked time to ``copy_wait_s``."""
        blocked = handle.ready.wait()
        self.counters.copy_wait_s += blocked
        return blocked

    def views(self, handle: SlotHandle) -> tuple[torch.Tensor, torch.Tensor]:
        """Device ``(gate_up [2I,H], down [H,I])`` of the handle's slot."""
        if handle.released:
            raise RuntimeError(f"handle of {handle.uid} was already released")
        return self.store.layout.views(self._layer(handle.uid.layer).rows[handle.slot])

    def release(self, handle: SlotHandle) -> None:
        """End a use of the slot: unprotect it and (on CUDA) record its last use."""
        if handle.prefetch:
            raise ValueError("prefetch handles are consumed by acquire; use release_prefetches() to drop them")
        if handle.released:
            raise RuntimeError(f"handle of {handle.uid} released twice")
        st = self._layer(handle.uid.layer)
        if st.policy.lookup(handle.uid.expert) != handle.slot:
            raise RuntimeError(f"stale handle: {handle.uid} no longer occupies slot {handle.slot} (cache reset?)")
        st.policy.unprotect(handle.uid.expert)
        st.policy.served(handle.uid.expert)
        if self._use_events:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            st.last_use[handle.slot] = event
        else:  # a link with its own time base marks the use (None on host links: nothing to order)
            st.last_use[handle.slot] = self.link.use_marker()
        handle.released = True
        if st.policy.capacity > st.own:
            self._return_staging(st)
