"""Expert offloading: host store, transfer links, per-layer slot cache, expert-wise execution."""

from .cache import CacheCounters, ExpertCache, LRUPolicy, SlotHandle
from .link import (
    CompletedTicket,
    CudaLink,
    EmulatedLink,
    ImmediateLink,
    LinkStats,
    Ticket,
    TransferLink,
    make_link,
)
from .residency import expert_wise_moe, group_by_expert, token_wise_moe
from .store import ExpertLayout, ExpertUID, HostExpertStore

__all__ = [
    "CacheCounters",
    "CompletedTicket",
    "CudaLink",
    "EmulatedLink",
    "ExpertCache",
    "ExpertLayout",
    "ExpertUID",
    "HostExpertStore",
    "ImmediateLink",
    "LRUPolicy",
    "LinkStats",
    "SlotHandle",
    "Ticket",
    "TransferLink",
    "expert_wise_moe",
    "group_by_expert",
    "make_link",
    "token_wise_moe",
]
