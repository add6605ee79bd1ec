"""The command line behind `python run.py key=value ...`: compose, run, exit status.

Anything a user can fix (a bad value, missing weights or data, a locked or unwritable folder, a
budget that does not fit) is reported as one line on stderr with exit status 2, never a
traceback; Hydra's multi-line composition errors are condensed to one line too.
"""

from __future__ import annotations

import signal
import sys

INTERRUPTED = "specter: interrupted; finished records are kept (rerun the same command to resume)"


# SIGTERM unwinds a run as Ctrl-C does (locks released, a start with no finished record removed, every
# finished record kept): one definition for every entry point
from specter.entry import Terminated, terminate_as_interrupt  # noqa: E402,F401


def interrupted(err: KeyboardInterrupt) -> int:
    """The one line of an interrupted run; 143 for SIGTERM, 130 for Ctrl-C (the shell's 128+signal)."""
    print(INTERRUPTED, file=sys.stderr, flush=True)
    return 128 + (signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT)


def main(argv: list[str]) -> int:
    """0 on success; 2 with one line on stderr for a user error; 130 (Ctrl-C) or 143 (SIGTERM)
    when interrupted."""
    try:
        with terminate_as_interrupt():
            return _main(argv)
    except KeyboardInterrupt as err:
        return interrupted(err)


def _main(argv: list[str]) -> int:
    from specter.assembly.compose import DEFAULT_JOB, check_optional_groups, compose
    from specter.assembly.config import check_composed
    from specter.assembly.errors import USER_ERRORS, composition_error, disk_error, report
    from specter.experiments.dispatch import run_experiment

    if not argv:  # the default job: the comparison the project exists for
        print("specter: no arguments, running the default comparison (experiment=compare: target_only, "
              "offload_ar and specter on a trained tiny model, low tier, emulated link); "
              "`python run.py --help` lists every option", flush=True)
        argv = list(DEFAULT_JOB)  # compose([]) gives the same config
    try:
        cfg = compose(argv)
    except Exception as err:  # noqa: BLE001 - Hydra/OmegaConf raise many types for a bad override
        report(composition_error(err))
        return 2
    try:
        check_optional_groups(argv)
        check_composed(cfg)
        run_experiment(cfg)
    except USER_ERRORS as err:
        report(err)
        return 2
    except OSError as err:
        user = disk_error(err)
        if user is None:
            raise
        report(user)
        return 2
    return 0
