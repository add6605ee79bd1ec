"""Errors a user can fix, reported as one clear message instead of a traceback.

Engine packages define their own exceptions; this module only collects them for the CLI.
"""

from __future__ import annotations

import sys

from specter.harness.config import ConfigError
from specter.harness.datasets import DatasetFormatError, DatasetUnavailable
from specter.models.loading import WeightError
from specter.models.registry import ModelUnavailable
from specter.offload.budget import BudgetError
from specter.quant.calibration import CorruptDraft

USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, ModelUnavailable, BudgetError, DatasetUnavailable, DatasetFormatError, CorruptDraft, WeightError,
)

__all__ = ["USER_ERRORS", "BudgetError", "ConfigError", "report"]


def report(err: BaseException) -> None:
    print(f"specter: error: {err}", file=sys.stderr)
