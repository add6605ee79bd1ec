"""What a method is measured by, handed to it in one value (`Instruments`) rather than patched onto it.

A modelled device (specter/projection/virtual.py) gives a method its link (the copies it times), its meter
(every MoE operation's modelled cost), the planner's step clock and the requests' commit clocks; a normal
run gives none, and every part defaults to the method's own (its link, no meter, the host's clocks).
`Runtime.instrumented` installs them on a runtime, `SpeculativeEngine` takes them when it is built
(`instrument` for one built before), and `Method.instrument` on a built method and its engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specter.metrics import CommitClock
    from specter.moe import OpMeter
    from specter.offload.link import TransferLink


@dataclass(frozen=True)
class Instruments:
    """A method's instruments; None: the method's own."""

    link: TransferLink | None = None  # replaces the runtime's link (the old one is closed)
    meter: OpMeter | None = None  # the MoE runtimes report each operation to it
    step_clock: Callable[[], float] | None = None  # the planner's draft-step clock (None: the host's)
    commit_clock: Callable[[], CommitClock] | None = None  # a new request's commit clock (None: `CommitClock`)

    @property
    def empty(self) -> bool:
        return self == NO_INSTRUMENTS


NO_INSTRUMENTS = Instruments()
