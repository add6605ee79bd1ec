"""Errors a user can fix, reported as one clear message instead of a traceback."""

from __future__ import annotations

import sys

from specter.harness.config import ConfigError
from specter.models.registry import ModelUnavailable


class BudgetError(ValueError):
    """The configuration does not fit the memory tier's device budget."""


from specter.calibration import CorruptDraft  # noqa: E402
from specter.harness.datasets import DatasetFormatError, DatasetUnavailable  # noqa: E402
from specter.models.loading import WeightError  # noqa: E402

USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, ModelUnavailable, BudgetError, DatasetUnavailable, DatasetFormatError, CorruptDraft, WeightError,
)


def report(err: BaseException) -> None:
    print(f"specter: error: {err}", file=sys.stderr)
