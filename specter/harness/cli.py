"""The command line behind `python run.py key=value ...`: compose, run, exit status.

Anything a user can fix (a bad value, missing weights or data, a locked or unwritable folder, a
budget that does not fit) is reported as one line on stderr with exit status 2, never a
traceback; Hydra's multi-line composition errors are condensed to one line too.
"""

from __future__ import annotations

import sys

from specter.harness.config import ConfigError

def main(argv: list[str]) -> int:
    """0 on success; 2 with one line on stderr for a user error; 130 when interrupted."""
    from specter.harness.compose import DEFAULT_JOB, compose
    from specter.harness.errors import USER_ERRORS, composition_error, disk_error, report
    from specter.harness.experiments import run_experiment

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
    except KeyboardInterrupt:
        print("specter: interrupted; finished records are kept (rerun the same command to resume)", file=sys.stderr)
        return 130
    return 0


def check_optional_groups(argv: list[str]) -> None:
    """Hydra silently skips a missing option of an optional group (`experiment=typo` would run the
    plain protocol); refuse it like any unknown option."""
    from specter.harness.compose import CONF_DIR

    for arg in argv:
        group, eq, value = arg.lstrip("+").partition("=")
        folder = CONF_DIR / group
        if not (eq and "." not in group and folder.is_dir()) or "(" in value:  # sweep functions: Hydra checks
            continue
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        for option in value.split(","):  # a multirun sweep (-m group=a,b) lists several
            if option not in ("null", "") and option not in options:
                raise ConfigError(f"unknown {group}={option!r}; choose one of {options}")
