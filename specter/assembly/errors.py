"""Errors a user can fix, reported as one clear line instead of a traceback.

Engine packages define their own exceptions; this module only collects them for the CLI, and
condenses Hydra's multi-line composition errors (a wrong type, an unknown option) into one line.
"""

from __future__ import annotations

import errno
import sys

from specter.assembly.config import ConfigError
from specter.datasets import DatasetFormatError, DatasetUnavailable
from specter.models.loading import WeightError
from specter.models.registry import ModelUnavailable
from specter.offload.budget import BudgetError
from specter.offload.calibrate import CalibrationError
from specter.paths import PathError
from specter.quant.calibration import CorruptDraft

USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, ModelUnavailable, BudgetError, DatasetUnavailable, DatasetFormatError, CorruptDraft, WeightError,
    CalibrationError, PathError,
)

# A full disk or quota under $SPECTER_HOME or the output folder, wherever it strikes (building a tiny
# model, a draft, a calibration, a GGUF export): one line naming the file, never a traceback.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def disk_error(err: OSError) -> ConfigError | None:
    """A full or read-only disk as one user error (None for any other OSError: a bug to report)."""
    if err.errno not in DISK_ERRNOS:
        return None
    where = f" writing {err.filename}" if err.filename else ""
    return ConfigError(f"{err.strerror or err}{where}; free space (or make it writable) and rerun the same "
                       "command: finished records and cached builds are kept")

__all__ = ["USER_ERRORS", "BudgetError", "ConfigError", "composition_error", "report"]


def one_line(text: str) -> str:
    """The message's non-empty lines joined with spaces (one terminal line per error, greppable).

    Messages are prose: a line break inside one is a wrapped sentence, never a list separator."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


_DETAIL = ("full_key:", "object_type=", "reference_type=")  # OmegaConf's location lines


def composition_error(err: BaseException) -> ConfigError:
    """A Hydra/OmegaConf composition failure as one ConfigError line: what failed and why.

    Drops Hydra's search-path listing, documentation links and OmegaConf's `full_key`/`object_type`
    detail lines; keeps the available options of a missing group choice.
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    keep: list[str] = []
    options: list[str] = []
    in_options = False
    for line in lines:
        if line.startswith(_DETAIL):
            continue
        if line.startswith(("Config search path", "provider=", "See https://", "Set the environment variable")):
            in_options = False
            continue
        if line.startswith("Available options in"):
            in_options = True
            continue
        if in_options:
            options.append(line)
        else:
            keep.append(line)
    msg = "; ".join(line.rstrip(":.") for line in keep) or type(err).__name__
    if options:
        msg += f" (available: {', '.join(options)})"
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause).strip():
        detail = [line.strip() for line in str(cause).splitlines()
                  if line.strip() and not line.strip().startswith(_DETAIL)]
        if detail and detail[0] not in msg:
            msg += f": {detail[0]}"
    return ConfigError(msg)


def report(err: BaseException) -> None:
    print(f"specter: error: {one_line(str(err))}", file=sys.stderr, flush=True)
